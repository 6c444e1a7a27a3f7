//! The `cca` command-line tool.
fn main() {}
