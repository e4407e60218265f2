//! Logging set-up: `tracing` to stderr, human-readable by default or one
//! JSON object per line.

use serde::{Deserialize, Serialize};
use tracing_subscriber::EnvFilter;

use crate::error::{NodeError, Result};

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    /// One human-readable line per event. Default.
    #[default]
    Human,
    /// One JSON object per line (for log collectors).
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "human" => Ok(LogFormat::Human),
            "json" => Ok(LogFormat::Json),
            _ => Err(format!(
                "{s:?} is not a log format: use \"human\" or \"json\""
            )),
        }
    }
}

/// Parses a log filter: a level (`info`) or tracing directives
/// (`info,node=debug`).
///
/// A bare word must be a level: tracing would read `warning` as a target
/// name and silently log nothing else, warnings included.
pub fn parse_filter(level: &str) -> Result<EnvFilter, String> {
    if level.trim().is_empty() {
        return Err("must not be empty (e.g. \"info\")".into());
    }
    const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];
    for d in level.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let bare = !d.contains(['=', '[', ':']);
        if bare && !LEVELS.iter().any(|l| l.eq_ignore_ascii_case(d)) {
            return Err(format!(
                "{d:?} is not a log level: use one of {} or target=level directives (e.g. \"info,node=debug\")",
                LEVELS.join(", ")
            ));
        }
    }
    EnvFilter::builder()
        .parse(level)
        .map_err(|e| format!("{level:?} is not a log level or filter ({e}); use e.g. \"info\", \"debug\" or \"info,node=debug\""))
}

/// Stderr that never fails: bytes that cannot be written (the reader of a
/// log pipe went away, a full disk behind a redirect) are dropped. A failed
/// log write must never stop the daemon, least of all the flush at
/// shutdown (`eprintln!`, and tracing's own error report, panic on it).
#[derive(Clone, Copy, Debug, Default)]
pub struct LossyStderr;

impl std::io::Write for LossyStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = std::io::stderr().lock().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
}

/// `eprint!` through [`LossyStderr`]: never fails, never panics.
pub fn eprint_lossy(text: &str) {
    use std::io::Write as _;
    let _ = LossyStderr.write_all(text.as_bytes());
}

/// Whether [`init`] installed the JSON format (a fatal error is then
/// written as one JSON line too, see [`fatal_json_line`]).
static JSON_ACTIVE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Has a fatal error written as JSON although no subscriber is installed
/// yet: a start whose configuration failed to load, when its flag,
/// environment or file asked for JSON logs.
pub fn fatal_errors_as_json() {
    JSON_ACTIVE.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Whether the JSON log format is installed (or [`fatal_errors_as_json`]
/// was called).
pub fn json_active() -> bool {
    JSON_ACTIVE.load(std::sync::atomic::Ordering::Relaxed)
}

/// A fatal error as one line in the JSON log format's shape (`timestamp`,
/// `level`, `fields.message`, `target`), its causes under `fields.causes`,
/// so that a log pipeline reading JSON lines gets the reason a start
/// failed instead of a line it cannot parse.
pub fn fatal_json_line(target: &str, message: &str, causes: &[String]) -> String {
    serde_json::json!({
        "timestamp": humantime::format_rfc3339_micros(std::time::SystemTime::now()).to_string(),
        "level": "ERROR",
        "fields": { "message": message, "causes": causes },
        "target": target,
    })
    .to_string()
}

/// One line in the JSON log format's shape (`timestamp`, `level`,
/// `fields.message`, `target`) for a message written without tracing: one
/// the process writes right before it exits at once (`level` as tracing
/// writes it: "WARN", "ERROR").
pub fn json_line(level: &str, target: &str, message: &str) -> String {
    serde_json::json!({
        "timestamp": humantime::format_rfc3339_micros(std::time::SystemTime::now()).to_string(),
        "level": level,
        "fields": { "message": message },
        "target": target,
    })
    .to_string()
}

/// Installs the global subscriber writing to stderr (lossily, see
/// [`LossyStderr`]). Fails if one is already installed or the filter is
/// invalid.
pub fn init(format: LogFormat, level: &str) -> Result<()> {
    let filter = parse_filter(level).map_err(NodeError::Logging)?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| LossyStderr);
    let res = match format {
        LogFormat::Human => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
        LogFormat::Json => {
            let res = builder.json().with_current_span(false).try_init();
            if res.is_ok() {
                JSON_ACTIVE.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            res
        }
    };
    res.map_err(|e| NodeError::Logging(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_parse_or_explain() {
        assert!(parse_filter("info").is_ok());
        assert!(parse_filter("info,node=debug").is_ok());
        assert!(parse_filter("").is_err());
        let e = parse_filter("loud=!!").unwrap_err();
        assert!(e.contains("not a log level"), "{e}");
        // A mistyped level would otherwise be a target name: no logs at all.
        for typo in ["warning", "info,verbose", "INF"] {
            let e = parse_filter(typo).unwrap_err();
            assert!(e.contains("is not a log level: use one of"), "{e}");
        }
        assert!(parse_filter("WARN").is_ok());
        assert!(parse_filter("off").is_ok());
        assert!(parse_filter("info,").is_ok());
        assert!(parse_filter("warn,tier::segment=debug").is_ok());
    }
}
