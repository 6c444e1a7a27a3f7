//! Placeholder replaced by the hot-path criterion suite.
fn main() {}
