//! A small pickle writer that emits only what PyTorch's memory_viz unpickler reads: protocol 4
//! without frames, integers of at most 8 bytes, no bytes, sets or classes. Strings are memoized
//! (`MEMOIZE`, then `BINGET`/`LONG_BINGET`), so repeated dict keys cost 2 to 5 bytes.
#![forbid(unsafe_code)]

use std::collections::HashMap;

use super::io_error::TraceIoError;
use super::pickle::{PickleValue, op};

/// Items per `APPENDS`/`SETITEMS` batch (Python's pickler uses the same).
const BATCH: usize = 1000;
/// Deepest nesting written.
const MAX_DEPTH: usize = 64;

/// Encodes `value` as a protocol-4 pickle that Python's `pickle.load` and PyTorch's memory_viz
/// page both read (see [`check_memory_viz`](super::check_memory_viz) for the opcode set).
///
/// # Errors
/// [`TraceIoError::MemoryViz`] for a value memory_viz cannot read: an integer outside the
/// signed 64-bit range, a bytes object, a set, a string longer than 4 GiB, or nesting deeper
/// than 64 levels.
pub fn write_pickle(value: &PickleValue) -> Result<Vec<u8>, TraceIoError> {
    let mut w = PickleWriter::default();
    w.out.extend([op::PROTO, 4]);
    w.value(value, 0)?;
    w.out.push(op::STOP);
    Ok(w.out)
}

/// Output buffer plus the string memo.
#[derive(Debug, Default)]
struct PickleWriter {
    out: Vec<u8>,
    memo: HashMap<String, u32>,
}

impl PickleWriter {
    fn value(&mut self, value: &PickleValue, depth: usize) -> Result<(), TraceIoError> {
        if depth > MAX_DEPTH {
            return Err(TraceIoError::memory_viz(format!(
                "data nested deeper than {MAX_DEPTH} levels"
            )));
        }
        match value {
            PickleValue::None => self.out.push(op::NONE),
            PickleValue::Bool(true) => self.out.push(op::NEWTRUE),
            PickleValue::Bool(false) => self.out.push(op::NEWFALSE),
            PickleValue::Int(i) => self.int(*i)?,
            PickleValue::Float(x) => {
                self.out.push(op::BINFLOAT);
                self.out.extend(x.to_be_bytes());
            }
            PickleValue::Str(s) => self.string(s)?,
            PickleValue::Bytes(_) => return Err(TraceIoError::memory_viz("a bytes object")),
            PickleValue::Set(_) => return Err(TraceIoError::memory_viz("a set")),
            PickleValue::List(items) => {
                self.out.push(op::EMPTY_LIST);
                for batch in items.chunks(BATCH) {
                    if let [item] = batch {
                        self.value(item, depth + 1)?;
                        self.out.push(op::APPEND);
                    } else {
                        self.out.push(op::MARK);
                        for item in batch {
                            self.value(item, depth + 1)?;
                        }
                        self.out.push(op::APPENDS);
                    }
                }
            }
            PickleValue::Dict(items) => {
                self.out.push(op::EMPTY_DICT);
                for batch in items.chunks(BATCH) {
                    let single = batch.len() == 1;
                    if !single {
                        self.out.push(op::MARK);
                    }
                    for (k, v) in batch {
                        self.value(k, depth + 1)?;
                        self.value(v, depth + 1)?;
                    }
                    self.out
                        .push(if single { op::SETITEM } else { op::SETITEMS });
                }
            }
            PickleValue::Tuple(items) => {
                if items.is_empty() {
                    self.out.push(op::EMPTY_TUPLE);
                    return Ok(());
                }
                let small = items.len() <= 3;
                if !small {
                    self.out.push(op::MARK);
                }
                for item in items {
                    self.value(item, depth + 1)?;
                }
                self.out.push(match items.len() {
                    1 => op::TUPLE1,
                    2 => op::TUPLE2,
                    3 => op::TUPLE3,
                    _ => op::TUPLE,
                });
            }
        }
        Ok(())
    }

    /// BININT1 / BININT2 / BININT, else LONG1 of at most 8 bytes (as Python chooses).
    fn int(&mut self, i: i128) -> Result<(), TraceIoError> {
        if let Ok(small) = u8::try_from(i) {
            self.out.extend([op::BININT1, small]);
        } else if let Ok(small) = u16::try_from(i) {
            self.out.push(op::BININT2);
            self.out.extend(small.to_le_bytes());
        } else if let Ok(word) = i32::try_from(i) {
            self.out.push(op::BININT);
            self.out.extend(word.to_le_bytes());
        } else {
            let wide = i64::try_from(i).map_err(|_| {
                TraceIoError::memory_viz(format!("integer {i} needs more than 8 bytes"))
            })?;
            let bytes = wide.to_le_bytes();
            let mut len = bytes.len();
            // Drop sign-extension bytes while the next byte keeps the sign.
            while len > 1 {
                let (last, next) = (bytes[len - 1], bytes[len - 2]);
                if (last == 0x00 && next & 0x80 == 0) || (last == 0xff && next & 0x80 != 0) {
                    len -= 1;
                } else {
                    break;
                }
            }
            self.out.extend([op::LONG1, len as u8]);
            self.out.extend(&bytes[..len]);
        }
        Ok(())
    }

    fn string(&mut self, s: &str) -> Result<(), TraceIoError> {
        if let Some(&index) = self.memo.get(s) {
            if let Ok(short) = u8::try_from(index) {
                self.out.extend([op::BINGET, short]);
            } else {
                self.out.push(op::LONG_BINGET);
                self.out.extend(index.to_le_bytes());
            }
            return Ok(());
        }
        if let Ok(short) = u8::try_from(s.len()) {
            self.out.extend([op::SHORT_BINUNICODE, short]);
        } else {
            let len = u32::try_from(s.len())
                .map_err(|_| TraceIoError::memory_viz("a string longer than 4 GiB"))?;
            self.out.push(op::BINUNICODE);
            self.out.extend(len.to_le_bytes());
        }
        self.out.extend(s.as_bytes());
        if let Ok(index) = u32::try_from(self.memo.len()) {
            self.out.push(op::MEMOIZE);
            self.memo.insert(s.to_owned(), index);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::pickle::{check_memory_viz, parse_pickle};

    fn sample() -> PickleValue {
        let long = "x".repeat(300);
        PickleValue::dict([
            (
                "ints",
                PickleValue::List(
                    [
                        0,
                        1,
                        255,
                        256,
                        65535,
                        65536,
                        -1,
                        -129,
                        i32::MAX as i128,
                        i32::MIN as i128,
                        1 << 31,
                        140_578_373_238_784,
                        i64::MAX as i128,
                        i64::MIN as i128,
                        -(1 << 40),
                    ]
                    .into_iter()
                    .map(PickleValue::Int)
                    .collect(),
                ),
            ),
            (
                "one",
                PickleValue::List(vec![PickleValue::Str("only".into())]),
            ),
            (
                "tuples",
                PickleValue::List(vec![
                    PickleValue::Tuple(vec![]),
                    PickleValue::Tuple(vec![PickleValue::Int(0)]),
                    PickleValue::Tuple(vec![PickleValue::Int(0), PickleValue::Int(0)]),
                    PickleValue::Tuple(vec![PickleValue::None; 3]),
                    PickleValue::Tuple(vec![PickleValue::Bool(true); 4]),
                ]),
            ),
            (
                "floats",
                PickleValue::List(vec![PickleValue::Float(0.5), PickleValue::Float(-1e300)]),
            ),
            (
                "single",
                PickleValue::dict([("k", PickleValue::Bool(false))]),
            ),
            ("long", PickleValue::Str(long.clone())),
            ("again", PickleValue::Str(long)),
            (
                "many",
                PickleValue::List(
                    (0..2500)
                        .map(|i| PickleValue::Str(format!("s{}", i % 300)))
                        .collect(),
                ),
            ),
        ])
    }

    #[test]
    fn round_trips_through_own_reader_and_meets_memory_viz() {
        let v = sample();
        let bytes = write_pickle(&v).unwrap();
        check_memory_viz(&bytes).unwrap();
        assert_eq!(parse_pickle(&bytes).unwrap(), v);
    }

    #[test]
    fn long1_is_minimal() {
        for (i, len) in [
            (1i128 << 31, 5u8),
            (-(1i128 << 31) - 1, 5),
            (i64::MAX as i128, 8),
            (1 << 40, 6),
        ] {
            let bytes = write_pickle(&PickleValue::Int(i)).unwrap();
            assert_eq!(&bytes[2..4], &[op::LONG1, len], "{i}");
            assert_eq!(parse_pickle(&bytes).unwrap(), PickleValue::Int(i));
        }
    }

    #[test]
    fn refuses_what_memory_viz_cannot_read() {
        for v in [
            PickleValue::Int(1 << 63),
            PickleValue::Int(i128::MIN),
            PickleValue::Bytes(vec![1]),
            PickleValue::Set(vec![]),
        ] {
            assert!(
                matches!(write_pickle(&v), Err(TraceIoError::MemoryViz { .. })),
                "{v:?}"
            );
        }
        let mut deep = PickleValue::None;
        for _ in 0..70 {
            deep = PickleValue::List(vec![deep]);
        }
        assert!(write_pickle(&deep).is_err());
    }
}
