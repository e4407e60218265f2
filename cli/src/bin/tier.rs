//! `tier`: an alias of `kvtier`.

fn main() {
    eprintln!("tier: not built yet; see docs/STATUS.md");
    std::process::exit(1);
}
