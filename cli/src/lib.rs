//! The `kvtier` command line (also installed as `tier`): parsing, dispatch
//! and exit codes. Both binaries call [`main_with`].
//!
//! Exit codes (documented in `docs/cli.md`): 0 ok, 1 error, 2 usage,
//! 3 daemon unreachable, 4 not found / miss, 5 verification failures found.

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
/// Exit code: the daemon could not be reached on its socket.
pub const EXIT_UNREACHABLE: u8 = 3;
/// Exit code: a key was not found (lookup, get, delete).
pub const EXIT_MISS: u8 = 4;
/// Exit code: `verify` found bad chunks.
pub const EXIT_VERIFY_FAILED: u8 = 5;

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
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { EXIT_USAGE } else { EXIT_OK });
        }
    };
    match commands::run(cli) {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            eprintln!("{bin}: error: {err}");
            for cause in err.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            ExitCode::from(exit_code_of(&err))
        }
    }
}

/// The exit code for an error: 3 when the daemon is unreachable, else 1.
fn exit_code_of(err: &anyhow::Error) -> u8 {
    for cause in err.chain() {
        if let Some(node::native::NativeError::Unavailable { .. }) = cause.downcast_ref() {
            return EXIT_UNREACHABLE;
        }
    }
    EXIT_ERROR
}
