//! The `kvtier` command: see `kvtier --help` and `docs/cli.md`.

fn main() -> std::process::ExitCode {
    kvtier_cli::main_with("kvtier")
}
