//! The single integration-test binary. Each module is one area; shared helpers live in `util`.

// Test helpers outside `#[test]` functions unwrap (a failure there is a test failure), and
// `util`'s helpers are `pub` for the sibling modules.
#![allow(clippy::unwrap_used, unreachable_pub)]

mod borrow;
mod caching;
mod capture_replays;
mod capture_review;
mod chaos;
mod cli;
mod concurrency;
mod config_env;
mod cross_stream;
mod cuda;
mod cuda_capture;
mod cuda_pinned;
mod cuda_port;
mod cuda_streams;
mod device_cost;
mod docs;
mod expandable;
mod expandable_fidelity;
mod fast_path;
mod fast_path_events;
mod fast_path_parity;
mod faults;
mod fidelity;
mod fragmentation;
mod graph_capture;
mod input_review;
mod interop_review2;
mod interop_review3;
mod lagged_programs;
mod limits;
mod move_budget;
mod names;
mod oom_truth;
mod package;
mod pinned;
mod pinned_engine;
mod pinned_fallbacks;
mod pinned_pages;
mod pinned_review;
mod pool_checkpoint;
mod ports;
mod programs;
mod props;
mod segment_events;
mod shared_pages;
mod snapshot_review;
mod spin;
mod stats_truth;
mod stream_safety;
mod tools_review;
mod trace_io;
mod util;
