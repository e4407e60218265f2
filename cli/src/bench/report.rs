//! Tables on stdout and the JSON document of a bench run.

use std::path::Path;

use anyhow::{Context, Result};
use serde_json::{Value, json};

/// A printed table.
#[derive(Debug, Default)]
pub(crate) struct Table {
    title: String,
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub(crate) fn new(title: &str, headers: &[&str]) -> Self {
        Self {
            title: title.into(),
            headers: headers.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    pub(crate) fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub(crate) fn print(&self) -> anyhow::Result<()> {
        let n = self.headers.len();
        let mut w: Vec<usize> = self.headers.iter().map(String::len).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate().take(n) {
                w[i] = w[i].max(c.len());
            }
        }
        outln!("\n{}", self.title);
        let line = |cells: &[String]| {
            let mut s = String::new();
            for (i, c) in cells.iter().enumerate().take(n) {
                if i == 0 {
                    s.push_str(&format!("{:<width$}", c, width = w[i]));
                } else {
                    s.push_str(&format!("  {:>width$}", c, width = w[i]));
                }
            }
            outln!("{}", s.trim_end());
            Ok::<(), anyhow::Error>(())
        };
        line(&self.headers)?;
        outln!(
            "{}",
            "-".repeat(w.iter().sum::<usize>() + 2 * n.saturating_sub(1))
        );
        for r in &self.rows {
            line(r)?;
        }
        Ok(())
    }
}

/// The JSON document of one run: scenario, machine, command line, results.
#[derive(Debug)]
pub(crate) struct Report {
    doc: serde_json::Map<String, Value>,
}

impl Report {
    pub(crate) fn new(scenario: &str) -> Self {
        let mut doc = serde_json::Map::new();
        doc.insert("scenario".into(), json!(scenario));
        doc.insert(
            "command".into(),
            json!(std::env::args().collect::<Vec<_>>().join(" ")),
        );
        doc.insert("kvtier_version".into(), json!(env!("CARGO_PKG_VERSION")));
        doc.insert("unix_time".into(), json!(unix_time()));
        doc.insert("machine".into(), machine());
        Self { doc }
    }

    pub(crate) fn set(&mut self, key: &str, v: Value) {
        self.doc.insert(key.into(), v);
    }

    pub(crate) fn write(&self, path: Option<&Path>) -> Result<()> {
        if let Some(p) = path {
            let text = serde_json::to_string_pretty(&Value::Object(self.doc.clone()))?;
            std::fs::write(p, text + "\n").with_context(|| format!("write {}", p.display()))?;
            outln!("\nwrote {}", p.display());
        }
        Ok(())
    }
}

fn unix_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// CPU model, core count, memory and kernel of this machine.
pub(crate) fn machine() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|| std::env::consts::ARCH.to_owned());
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem = meminfo("MemTotal").unwrap_or(0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    json!({
        "cpu": model,
        "cpus": cpus,
        "mem_bytes": mem,
        "kernel": kernel,
        "arch": std::env::consts::ARCH,
    })
}

/// Prints the one-line machine summary under a scenario's title.
pub(crate) fn print_header(scenario: &str) -> anyhow::Result<()> {
    let m = machine();
    outln!(
        "kvtier bench {scenario} — {} ({} CPUs, {:.0} GiB RAM, kernel {})",
        m["cpu"].as_str().unwrap_or("?"),
        m["cpus"],
        m["mem_bytes"].as_u64().unwrap_or(0) as f64 / (1u64 << 30) as f64,
        m["kernel"].as_str().unwrap_or("?")
    );
    Ok(())
}

/// "12.3" with one decimal, or "-" for NaN.
pub(crate) fn f1(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.1}")
    } else {
        "-".into()
    }
}

/// "1.23" with two decimals, or "-".
pub(crate) fn f2(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.2}")
    } else {
        "-".into()
    }
}

/// A `/proc/meminfo` field (`"MemTotal"`, `"MemAvailable"`), in bytes.
pub(crate) fn meminfo(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text
        .lines()
        .find(|l| l.strip_prefix(field).is_some_and(|r| r.starts_with(':')))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}
