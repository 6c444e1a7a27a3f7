//! The integration tests, built as one binary (bumpalo's `tests/all` layout).

mod cuda;
