//! `tier`: an alias of `kvtier` (same commands, same exit codes).

fn main() -> std::process::ExitCode {
    kvtier_cli::main_with("tier")
}
