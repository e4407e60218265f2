//! The INFO reply: Redis's layout (`# Name` headers, `field:value` lines,
//! a blank line between sections) with the fields redis-cli, redis-benchmark
//! and monitoring scripts read, plus `kvtier_*` fields.

use std::sync::atomic::Ordering;

use bytes::Bytes;

use super::commands::{REDIS_COMPAT_VERSION, Shared};

fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "K", "M", "G", "T"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes}B")
    } else {
        format!("{v:.2}{}", UNITS[u])
    }
}

/// Whether INFO of `sections` asks for section `name` (no section: the
/// default ones, which include every section served).
fn includes(sections: &[Bytes], name: &str) -> bool {
    sections.is_empty()
        || sections.iter().any(|s| {
            let w = String::from_utf8_lossy(s).to_ascii_lowercase();
            w == name || w == "all" || w == "default" || w == "everything"
        })
}

/// Whether INFO of `sections` needs the key count ([`info_text`]'s `keys`).
pub fn wants_keyspace(sections: &[Bytes]) -> bool {
    includes(sections, "keyspace")
}

/// The INFO text for the requested sections (Redis's layout: `# Name`
/// headers, `field:value` lines, a blank line between sections). `keys`:
/// the RESP key count, when [`wants_keyspace`].
pub fn info_text(shared: &Shared, sections: &[Bytes], keys: Option<u64>) -> String {
    let all = ["server", "clients", "memory", "stats", "keyspace"];
    let include = |name: &str| includes(sections, name);
    let ctx = &shared.ctx;
    let st = ctx.store.stats();
    let uptime = ctx.started.elapsed().as_secs();
    let c = &ctx.counters;
    let mut out = String::new();
    for name in all {
        if !include(name) {
            continue;
        }
        if !out.is_empty() {
            out.push_str("\r\n");
        }
        let lines: Vec<(String, String)> = match name {
            "server" => vec![
                ("redis_version".into(), REDIS_COMPAT_VERSION.into()),
                ("kvtier_version".into(), env!("CARGO_PKG_VERSION").into()),
                ("redis_mode".into(), "standalone".into()),
                ("os".into(), std::env::consts::OS.into()),
                ("arch_bits".into(), (usize::BITS).to_string()),
                ("process_id".into(), std::process::id().to_string()),
                ("tcp_port".into(), shared.port.to_string()),
                ("uptime_in_seconds".into(), uptime.to_string()),
                ("uptime_in_days".into(), (uptime / 86_400).to_string()),
                ("kvtier_node".into(), ctx.node_name.clone()),
            ],
            "clients" => vec![
                (
                    "connected_clients".into(),
                    shared.clients.load(Ordering::Relaxed).to_string(),
                ),
                ("maxclients".into(), shared.opts.max_connections.to_string()),
                // No command blocks; redis-cli --stat reads the field (QA:
                // garbage in its "blocked" column without it).
                ("blocked_clients".into(), "0".into()),
            ],
            "memory" => vec![
                ("used_memory".into(), st.ram_bytes.to_string()),
                ("used_memory_human".into(), human(st.ram_bytes)),
                ("maxmemory".into(), st.ram_budget.to_string()),
                ("maxmemory_human".into(), human(st.ram_budget)),
                ("maxmemory_policy".into(), "allkeys-lru".into()),
                ("kvtier_dirty_bytes".into(), st.dirty_bytes.to_string()),
                (
                    "kvtier_pinned_bytes".into(),
                    shared.pinned_bytes.load(Ordering::Relaxed).to_string(),
                ),
                ("kvtier_disk_bytes".into(), st.disk_bytes.to_string()),
                ("kvtier_disk_budget".into(), st.disk_budget.to_string()),
            ],
            "stats" => vec![
                (
                    "total_connections_received".into(),
                    c.resp_connections.load(Ordering::Relaxed).to_string(),
                ),
                (
                    "total_commands_processed".into(),
                    c.resp_commands.load(Ordering::Relaxed).to_string(),
                ),
                (
                    "total_error_replies".into(),
                    c.resp_errors.load(Ordering::Relaxed).to_string(),
                ),
                (
                    "keyspace_hits".into(),
                    (st.hits_ram + st.hits_disk + st.hits_peer).to_string(),
                ),
                ("keyspace_misses".into(), st.misses.to_string()),
                ("evicted_keys".into(), st.evicted_chunks.to_string()),
                ("kvtier_hits_ram".into(), st.hits_ram.to_string()),
                ("kvtier_hits_disk".into(), st.hits_disk.to_string()),
                ("kvtier_hits_peer".into(), st.hits_peer.to_string()),
            ],
            _ => {
                let keys = keys.unwrap_or(0);
                if keys == 0 {
                    vec![]
                } else {
                    vec![("db0".into(), format!("keys={keys},expires=0,avg_ttl=0"))]
                }
            }
        };
        let title = match name {
            "server" => "Server",
            "clients" => "Clients",
            "memory" => "Memory",
            "stats" => "Stats",
            _ => "Keyspace",
        };
        out.push_str("# ");
        out.push_str(title);
        out.push_str("\r\n");
        for (k, v) in lines {
            out.push_str(&k);
            out.push(':');
            out.push_str(&v);
            out.push_str("\r\n");
        }
    }
    out
}
