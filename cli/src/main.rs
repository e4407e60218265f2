//! The `kvtier` command.

fn main() {
    eprintln!("kvtier: not built yet; see docs/STATUS.md");
    std::process::exit(1);
}
