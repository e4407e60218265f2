//! `kvtier peers [--json] [--watch]`: this node and every peer, from the
//! daemon's STATS document (its `peers` field).

use std::io::IsTerminal;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use node::HumanDuration;
use serde_json::Value;

use crate::EXIT_OK;
use crate::args::ClientArgs;

/// `kvtier peers`
#[derive(Debug, Args)]
pub struct PeersArgs {
    /// Print the peer list as JSON (objects with name, addr, state, rtt_us,
    /// chunks, bytes, synced, last_sync_age_ms, bytes_fetched,
    /// bytes_served, ...).
    #[arg(long)]
    pub json: bool,
    /// Refresh until interrupted (with --json: one compact JSON array per
    /// line, JSON Lines).
    #[arg(long)]
    pub watch: bool,
    /// Refresh interval of --watch (which it requires).
    #[arg(
        long,
        value_name = "DURATION",
        allow_hyphen_values = true,
        default_value = "1s",
        requires = "watch"
    )]
    pub interval: HumanDuration,
    /// The daemon.
    #[command(flatten)]
    pub client: ClientArgs,
}

/// Runs `kvtier peers`.
pub fn run(args: &PeersArgs) -> Result<u8> {
    let mut client = crate::commands::connect(&args.client)?;
    loop {
        let doc = client.stats().context("read the daemon's stats")?;
        let peers = doc
            .get("peers")
            .cloned()
            .unwrap_or(Value::Array(Vec::new()));
        if args.json && args.watch {
            // One document per line (JSON Lines), so that a reader can
            // take each refresh as it comes (QA: pretty arrays one after
            // another were no JSON a parser could read).
            outln!("{}", serde_json::to_string(&peers)?);
        } else if args.json {
            outln!("{}", serde_json::to_string_pretty(&peers)?);
        } else {
            if args.watch && std::io::stdout().is_terminal() {
                out!("\x1b[2J\x1b[H");
            }
            out!("{}", render(&doc, &peers));
        }
        if !args.watch {
            return Ok(EXIT_OK);
        }
        std::thread::sleep(args.interval.0.max(Duration::from_millis(100)));
    }
}

fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn num(v: &Value, k: &str) -> Option<u64> {
    v.get(k).and_then(Value::as_u64)
}

/// The table: a first row for this node, then one per peer.
fn render(doc: &Value, peers: &Value) -> String {
    let mut rows = vec![
        [
            "NAME",
            "ADDR",
            "STATE",
            "RTT",
            "CHUNKS",
            "BYTES",
            "LAST SYNC",
            "FETCHED",
            "SERVED",
        ]
        .map(str::to_owned),
    ];
    let store = doc.get("store").cloned().unwrap_or(Value::Null);
    // A flushed chunk can be in RAM and on disk at once: show both.
    let chunks = format!(
        "{} RAM, {} disk",
        num(&store, "ram_chunks").unwrap_or(0),
        num(&store, "disk_chunks").unwrap_or(0)
    );
    let bytes = format!(
        "{}, {}",
        human_bytes(num(&store, "ram_bytes").unwrap_or(0)),
        human_bytes(num(&store, "disk_bytes").unwrap_or(0))
    );
    rows.push([
        format!(
            "{} (this node)",
            doc.get("node").and_then(Value::as_str).unwrap_or("?")
        ),
        "-".into(),
        "self".into(),
        "-".into(),
        chunks,
        bytes,
        "-".into(),
        "-".into(),
        "-".into(),
    ]);
    for p in peers.as_array().map(Vec::as_slice).unwrap_or_default() {
        let s = |k: &str| p.get(k).and_then(Value::as_str).unwrap_or("-").to_owned();
        rows.push([
            p.get("name")
                .and_then(Value::as_str)
                .unwrap_or("(not connected yet)")
                .to_owned(),
            s("addr"),
            s("state"),
            num(p, "rtt_us").map_or("-".into(), |us| format!("{:.2} ms", us as f64 / 1e3)),
            num(p, "chunks").unwrap_or(0).to_string(),
            human_bytes(num(p, "bytes").unwrap_or(0)),
            num(p, "last_sync_age_ms")
                .map_or("never".into(), |ms| format!("{:.1}s ago", ms as f64 / 1e3)),
            human_bytes(num(p, "bytes_fetched").unwrap_or(0)),
            human_bytes(num(p, "bytes_served").unwrap_or(0)),
        ]);
    }
    let mut widths = [0usize; 9];
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for r in &rows {
        let line: Vec<String> = r
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    // Why a peer is not up, as its last connect attempt failed (a refused
    // certificate, an unreachable address).
    for p in peers.as_array().map(Vec::as_slice).unwrap_or_default() {
        let up = p.get("state").and_then(Value::as_str) == Some("up");
        if let (false, Some(e)) = (up, p.get("last_error").and_then(Value::as_str)) {
            let who = p
                .get("name")
                .and_then(Value::as_str)
                .or_else(|| p.get("addr").and_then(Value::as_str))
                .unwrap_or("?");
            out.push_str(&format!("{who}: last connect failed: {e}\n"));
        }
    }
    // Nodes that fetch from us without being in our seed list.
    if let Some(m) = doc.get("served_unlisted").and_then(Value::as_object) {
        for (name, bytes) in m {
            out.push_str(&format!(
                "{name} (not in peers, dials this node): served {}\n",
                human_bytes(bytes.as_u64().unwrap_or(0))
            ));
        }
    }
    if peers.as_array().is_none_or(Vec::is_empty) {
        out.push_str(
            "(no peers: none configured, or only this node's own address or repeats of \
             another seed; set peer-listen and peers)\n",
        );
    }
    out
}
