//! The single integration-test binary. Each module is one area; shared helpers live in `util`.

// Test helpers outside `#[test]` functions unwrap too (clippy.toml only exempts test bodies), and
// the helpers in `util` are `pub` for the sibling modules.
#![allow(clippy::unwrap_used, unreachable_pub)]

mod caching;
mod config_env;
mod expandable;
mod expandable_fidelity;
mod faults;
mod fidelity;
mod fragmentation;
mod props;
mod util;
