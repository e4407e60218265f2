//! The `kvtier` command line (also installed as `tier`): parsing, dispatch
//! and exit codes. Both binaries call [`main_with`].
//!
//! Exit codes (documented in `docs/cli.md`): 0 ok, 1 error, 2 usage,
//! 3 daemon unreachable, 4 not found / miss, 5 verification failures found,
//! 130 `node start` stopped by a second signal, 141 stdout closed early.

/// Writes a line to stdout like `println!`, but returns the error instead
/// of panicking: a reader that went away (`kvtier stats | head -1`) ends the
/// command quietly ([`StdoutClosed`]), any other failure is an error.
macro_rules! outln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($t)*).map_err($crate::StdoutClosed::wrap)?
    }};
}

/// `eprintln!` that never panics (a closed stderr drops the line).
macro_rules! errln {
    ($($t:tt)*) => {
        node::logging::eprint_lossy(&format!("{}\n", format_args!($($t)*)))
    };
}

/// `print!` counterpart of [`outln!`].
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        write!(std::io::stdout().lock(), $($t)*).map_err($crate::StdoutClosed::wrap)?
    }};
}

mod args;
mod bench;
mod cmd_cert;
mod cmd_peers;
mod commands;

use std::process::ExitCode;

pub use args::Cli;

/// Exit code: success.
pub const EXIT_OK: u8 = 0;
/// Exit code: an error (bad config, I/O, daemon error).
pub const EXIT_ERROR: u8 = 1;
/// Exit code: bad usage (unknown flag, missing argument, malformed value).
pub const EXIT_USAGE: u8 = 2;
/// Exit code: the daemon could not be reached on its socket, did not
/// answer within `--timeout`, or closed the connection.
pub const EXIT_UNREACHABLE: u8 = 3;
/// Exit code: a key was not found (lookup, get, delete).
pub const EXIT_MISS: u8 = 4;
/// Exit code: `verify` found bad chunks.
pub const EXIT_VERIFY_FAILED: u8 = 5;
/// Exit code: stdout was closed before all output was written (a `| head`).
pub const EXIT_STDOUT_CLOSED: u8 = 141;

/// A write to stdout failed. When the reader closed the pipe the command
/// ends quietly with [`EXIT_STDOUT_CLOSED`] (141, the status a shell shows
/// for a tool killed by SIGPIPE: not 0, so `set -o pipefail` scripts never
/// mistake a cut-off `verify` for a clean one); otherwise it is an error
/// like any other.
#[derive(Debug)]
pub struct StdoutClosed(pub std::io::Error);

impl std::fmt::Display for StdoutClosed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("write to stdout")
    }
}

impl std::error::Error for StdoutClosed {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

impl StdoutClosed {
    /// Wraps a stdout write error (for `map_err`).
    pub fn wrap(e: std::io::Error) -> anyhow::Error {
        anyhow::Error::new(StdoutClosed(e))
    }

    /// Whether `err` is a stdout write whose reader went away.
    fn is_broken_pipe(err: &anyhow::Error) -> bool {
        err.chain().any(|c| {
            c.downcast_ref::<StdoutClosed>()
                .is_some_and(|s| s.0.kind() == std::io::ErrorKind::BrokenPipe)
        })
    }
}

/// The daemon could not be reached or did not answer, other than on its
/// native socket (its HTTP `/status`): exit code 3.
#[derive(Debug)]
pub struct Unreachable(pub String);

impl std::fmt::Display for Unreachable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unreachable {}

/// A command used wrongly in a way clap cannot check (exit code 2).
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// Parses `std::env::args`, runs the command, prints errors (the chain,
/// no backtrace) and returns the exit code. `bin` names the program in
/// messages ("kvtier" or "tier").
pub fn main_with(bin: &'static str) -> ExitCode {
    use clap::{CommandFactory, FromArgMatches};
    let parsed = Cli::command()
        .name(bin)
        .bin_name(bin)
        .try_get_matches()
        .and_then(|m| Cli::from_arg_matches(&m));
    let cli = match parsed {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version print to stdout and exit 0; usage errors exit 2.
            if e.use_stderr() && json_requested(std::env::args_os().skip(1)) {
                print_json_error(&usage_error_line(&e), &[], EXIT_USAGE);
            }
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { EXIT_USAGE } else { EXIT_OK });
        }
    };
    let json = cli.json_output();
    match commands::run(cli) {
        Ok(code) => ExitCode::from(code),
        Err(err) if StdoutClosed::is_broken_pipe(&err) => ExitCode::from(EXIT_STDOUT_CLOSED),
        Err(err) => {
            // Causes a message already quotes (many errors end with their
            // source's text) are not repeated.
            let mut said = err.to_string();
            let mut causes = Vec::new();
            for cause in err.chain().skip(1) {
                let cause = cause.to_string();
                if !said.contains(&cause) {
                    causes.push(cause.clone());
                }
                said.push_str(&cause);
            }
            let code = exit_code_of(&err);
            if json {
                // A script parsing stdout gets a document there too (QA:
                // stdout was empty but for `config check`); the message
                // also goes to stderr, and the exit code is as without it.
                print_json_error(&err.to_string(), &causes, code);
            }
            if node::logging::json_active() {
                // `node start --log-format json`: stderr carries JSON lines only.
                let line = node::logging::fatal_json_line(bin, &err.to_string(), &causes);
                node::logging::eprint_lossy(&format!("{line}\n"));
            } else {
                errln!("{bin}: error: {err}");
                for cause in &causes {
                    errln!("  caused by: {cause}");
                }
                if unknown_namespace(&err) {
                    // The daemon's message speaks to protocol clients
                    // ("send HELLO"); a CLI user registers with a flag.
                    errln!(
                        "  hint: `{bin} namespaces` lists the namespaces the daemon has; `{bin} put \
                         --namespace-record FILE` registers one from its record"
                    );
                }
            }
            ExitCode::from(code)
        }
    }
}

/// Prints the `{"ok": false, ...}` document of a failed `--json` command
/// on stdout.
fn print_json_error(error: &str, causes: &[String], code: u8) {
    use std::io::Write as _;
    let doc = serde_json::json!({
        "ok": false,
        "error": error,
        "causes": causes,
        "exit_code": code,
    });
    let text = serde_json::to_string_pretty(&doc).unwrap_or_default();
    let _ = writeln!(std::io::stdout().lock(), "{text}");
}

/// Whether a command line that clap refused asked for `--json` (before a
/// `--`, after which words are values): its usage error then goes to
/// stdout as a JSON document too (QA: a script got nothing to parse).
fn json_requested(args: impl Iterator<Item = std::ffi::OsString>) -> bool {
    args.take_while(|a| a != "--").any(|a| a == "--json")
}

/// The first paragraph of a usage error on one line, without clap's
/// "error: " prefix: "the following required arguments were not provided:
/// --name <NAME>" (review: the first line alone left out the arguments).
fn usage_error_line(e: &clap::Error) -> String {
    let text = e.to_string();
    let para: Vec<&str> = text
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect();
    let line = para.join(" ");
    line.strip_prefix("error: ").unwrap_or(&line).to_string()
}

/// Whether the daemon refused a request for a namespace it has no record of.
fn unknown_namespace(err: &anyhow::Error) -> bool {
    err.chain().any(|c| {
        matches!(
            c.downcast_ref(),
            Some(node::native::NativeError::Remote {
                code: node::native::codec::ErrorCode::UnknownNamespace,
                ..
            })
        )
    })
}

/// The exit code for an error: 2 for a usage error, 3 when the daemon is
/// unreachable or stopped answering, else 1.
fn exit_code_of(err: &anyhow::Error) -> u8 {
    for cause in err.chain() {
        if cause.downcast_ref::<UsageError>().is_some() {
            return EXIT_USAGE;
        }
        if cause.downcast_ref::<Unreachable>().is_some() {
            return EXIT_UNREACHABLE;
        }
        // A daemon past max-connections answers `busy` and closes the
        // connection: not reachable now, like one that is down.
        if let Some(
            node::native::NativeError::Unavailable { .. }
            | node::native::NativeError::Timeout { .. }
            | node::native::NativeError::Closed
            | node::native::NativeError::Remote {
                code: node::native::codec::ErrorCode::Busy,
                ..
            },
        ) = cause.downcast_ref()
        {
            return EXIT_UNREACHABLE;
        }
    }
    EXIT_ERROR
}
