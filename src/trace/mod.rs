//! Traces: the one operation language used by property tests, fuzzing, golden tests, benches and
//! the CLI, plus (behind the `trace-io` feature) import from PyTorch snapshot pickles and RMM CSV
//! logs and export back to both.
//!
//! The model is versioned ([`TRACE_FORMAT_VERSION`]) and specified in `docs/trace-format.md`.
//! May use: nothing internal (plain values only).
#![forbid(unsafe_code)]

mod event;

pub use event::{TRACE_FORMAT_VERSION, Trace, TraceEvent, TraceOp, TraceSource};
