//! The single integration-test binary. Each module is one area; shared helpers live in `util`.

// Helpers outside `#[test]` functions unwrap too (clippy.toml's `allow-unwrap-in-tests` covers
// only test bodies), and `pub` in a module here means "for the sibling modules".
#![allow(clippy::unwrap_used, unreachable_pub)]

mod caching;
mod config_env;
mod faults;
mod fidelity;
mod props;
mod trace_io;
mod util;
