//! The one integration-test binary; each module is one area.

mod trace_io;
