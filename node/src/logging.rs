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
pub fn parse_filter(level: &str) -> Result<EnvFilter, String> {
    if level.trim().is_empty() {
        return Err("must not be empty (e.g. \"info\")".into());
    }
    EnvFilter::builder()
        .parse(level)
        .map_err(|e| format!("{level:?} is not a log level or filter ({e}); use e.g. \"info\", \"debug\" or \"info,node=debug\""))
}

/// Installs the global subscriber writing to stderr. Fails if one is
/// already installed or the filter is invalid.
pub fn init(format: LogFormat, level: &str) -> Result<()> {
    let filter = parse_filter(level).map_err(NodeError::Logging)?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let res = match format {
        LogFormat::Human => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
        LogFormat::Json => builder.json().with_current_span(false).try_init(),
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
    }
}
