//! The single integration-test binary. Each module is one area; shared helpers live in `util`.

mod caching;
mod config_env;
mod cuda;
mod faults;
mod fidelity;
mod props;
mod util;
