//! Plain pickle data ([`PickleValue`]), the opcode table shared by the reader and the writer, and
//! [`check_memory_viz`], which tells whether PyTorch's memory_viz page can load a pickle.
//!
//! Only plain data is in scope: `None`, booleans, integers, floats, strings, bytes, lists,
//! tuples, dicts and sets. Class references (`GLOBAL`, `REDUCE`, ...) are refused.
#![forbid(unsafe_code)]

use super::import::ByteBudget;
use super::io_error::TraceIoError;
use super::pickle_read;

/// A plain Python value as a pickle holds it.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum PickleValue {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// An integer (pickles may hold wider ones; the reader refuses integers beyond 128 bits).
    Int(i128),
    /// A float.
    Float(f64),
    /// A `str`.
    Str(String),
    /// A `bytes` or `bytearray` (never written: memory_viz cannot read them).
    Bytes(Vec<u8>),
    /// A `list`.
    List(Vec<PickleValue>),
    /// A `tuple`.
    Tuple(Vec<PickleValue>),
    /// A `dict`, in insertion order.
    Dict(Vec<(PickleValue, PickleValue)>),
    /// A `set` or `frozenset` (never written: memory_viz cannot read them).
    Set(Vec<PickleValue>),
}

impl PickleValue {
    /// The value under string key `key`, when `self` is a dict that has one.
    pub fn get(&self, key: &str) -> Option<&PickleValue> {
        match self {
            PickleValue::Dict(items) => items
                .iter()
                .find(|(k, _)| k.as_str() == Some(key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    /// The string, when `self` is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            PickleValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The integer, when `self` is one.
    pub fn as_int(&self) -> Option<i128> {
        match self {
            PickleValue::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// A dict with string keys, built from `(key, value)` pairs.
    pub fn dict<K: Into<String>>(items: impl IntoIterator<Item = (K, PickleValue)>) -> Self {
        PickleValue::Dict(
            items
                .into_iter()
                .map(|(k, v)| (PickleValue::Str(k.into()), v))
                .collect(),
        )
    }

    /// Equality that treats two NaN floats with the same bits as equal (`PartialEq` does not),
    /// for round-trip checks.
    pub fn same_as(&self, other: &PickleValue) -> bool {
        use PickleValue as V;
        fn all(a: &[V], b: &[V]) -> bool {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.same_as(y))
        }
        match (self, other) {
            (V::Float(a), V::Float(b)) => a.to_bits() == b.to_bits(),
            (V::List(a), V::List(b)) | (V::Tuple(a), V::Tuple(b)) | (V::Set(a), V::Set(b)) => {
                all(a, b)
            }
            (V::Dict(a), V::Dict(b)) => {
                a.len() == b.len()
                    && a.iter()
                        .zip(b)
                        .all(|((ka, va), (kb, vb))| ka.same_as(kb) && va.same_as(vb))
            }
            _ => self == other,
        }
    }
}

/// Decodes a pickle (protocol 2 to 5, plain data only) into a [`PickleValue`].
///
/// Shared references are copied, so the result is a tree; nesting deeper than 64 levels, a
/// tree that would be more than 16 times larger than the pickle's opcode count, or one of more
/// than [`DEFAULT_MAX_IMPORT_BYTES`](super::DEFAULT_MAX_IMPORT_BYTES) (shared references
/// expanding), is refused.
///
/// # Errors
/// [`TraceIoError::Pickle`] with the byte offset when the bytes are not a well-formed pickle of
/// plain data; [`TraceIoError::TooLarge`] for a tree beyond the byte limit.
pub fn parse_pickle(bytes: &[u8]) -> Result<PickleValue, TraceIoError> {
    let pickle = pickle_read::parse(bytes)?;
    pickle.to_value(
        pickle.root(),
        &mut ByteBudget::new(super::DEFAULT_MAX_IMPORT_BYTES),
    )
}

/// Opcodes that PyTorch's memory_viz unpickler (`MemoryViz.js`) implements; LONG1 additionally
/// only up to 8 bytes and PROTO only for versions 2 to 4.
const MEMORY_VIZ_OPCODES: &[u8] = &[
    op::PROTO,
    op::FRAME,
    op::EMPTY_DICT,
    op::EMPTY_LIST,
    op::EMPTY_TUPLE,
    op::MARK,
    op::DICT,
    op::LIST,
    op::TUPLE,
    op::TUPLE1,
    op::TUPLE2,
    op::TUPLE3,
    op::SETITEM,
    op::SETITEMS,
    op::APPEND,
    op::APPENDS,
    op::BININT,
    op::BININT1,
    op::BININT2,
    op::LONG1,
    op::BINFLOAT,
    op::NONE,
    op::NEWTRUE,
    op::NEWFALSE,
    op::SHORT_BINUNICODE,
    op::BINUNICODE,
    op::BINPUT,
    op::LONG_BINPUT,
    op::BINGET,
    op::LONG_BINGET,
    op::MEMOIZE,
    op::STOP,
];

/// Checks that PyTorch's memory_viz page (whose unpickler is a small subset of Python's) can
/// load `bytes`: not gzip-compressed, protocol 2 to 4, only the opcodes it implements, and
/// integers (`LONG1`) of at most 8 bytes.
///
/// # Errors
/// [`TraceIoError::MemoryViz`] naming the first offending opcode or value, or
/// [`TraceIoError::Pickle`] when `bytes` are not a well-formed pickle at all.
pub fn check_memory_viz(bytes: &[u8]) -> Result<(), TraceIoError> {
    if super::compress::is_gzip(bytes) {
        return Err(TraceIoError::memory_viz(
            "the pickle is gzip-compressed; memory_viz reads plain pickles",
        ));
    }
    let pickle = pickle_read::parse(bytes)?;
    let facts = pickle.facts();
    if !(2..=4).contains(&facts.protocol) {
        return Err(TraceIoError::memory_viz(format!(
            "protocol {} (memory_viz reads 2 to 4)",
            facts.protocol
        )));
    }
    for (opcode, first_offset) in facts.first_offsets() {
        if !MEMORY_VIZ_OPCODES.contains(&opcode) {
            return Err(TraceIoError::memory_viz(format!(
                "opcode {} at byte {first_offset} is not implemented by memory_viz",
                op::name(opcode)
            )));
        }
    }
    if facts.widest_long1 > 8 {
        return Err(TraceIoError::memory_viz(format!(
            "a LONG1 integer of {} bytes (memory_viz reads at most 8)",
            facts.widest_long1
        )));
    }
    Ok(())
}

/// Pickle opcodes (Python's `pickletools` names).
pub(crate) mod op {
    pub(crate) const MARK: u8 = b'(';
    pub(crate) const STOP: u8 = b'.';
    pub(crate) const POP: u8 = b'0';
    pub(crate) const POP_MARK: u8 = b'1';
    pub(crate) const DUP: u8 = b'2';
    pub(crate) const BININT: u8 = b'J';
    pub(crate) const BININT1: u8 = b'K';
    pub(crate) const BININT2: u8 = b'M';
    pub(crate) const NONE: u8 = b'N';
    pub(crate) const BINSTRING: u8 = b'T';
    pub(crate) const SHORT_BINSTRING: u8 = b'U';
    pub(crate) const BINUNICODE: u8 = b'X';
    pub(crate) const APPEND: u8 = b'a';
    pub(crate) const APPENDS: u8 = b'e';
    pub(crate) const BINBYTES: u8 = b'B';
    pub(crate) const SHORT_BINBYTES: u8 = b'C';
    pub(crate) const DICT: u8 = b'd';
    pub(crate) const EMPTY_DICT: u8 = b'}';
    pub(crate) const BINFLOAT: u8 = b'G';
    pub(crate) const BINGET: u8 = b'h';
    pub(crate) const LONG_BINGET: u8 = b'j';
    pub(crate) const LIST: u8 = b'l';
    pub(crate) const EMPTY_LIST: u8 = b']';
    pub(crate) const BINPUT: u8 = b'q';
    pub(crate) const LONG_BINPUT: u8 = b'r';
    pub(crate) const SETITEM: u8 = b's';
    pub(crate) const TUPLE: u8 = b't';
    pub(crate) const EMPTY_TUPLE: u8 = b')';
    pub(crate) const SETITEMS: u8 = b'u';
    pub(crate) const PROTO: u8 = 0x80;
    pub(crate) const TUPLE1: u8 = 0x85;
    pub(crate) const TUPLE2: u8 = 0x86;
    pub(crate) const TUPLE3: u8 = 0x87;
    pub(crate) const NEWTRUE: u8 = 0x88;
    pub(crate) const NEWFALSE: u8 = 0x89;
    pub(crate) const LONG1: u8 = 0x8a;
    pub(crate) const LONG4: u8 = 0x8b;
    pub(crate) const SHORT_BINUNICODE: u8 = 0x8c;
    pub(crate) const BINUNICODE8: u8 = 0x8d;
    pub(crate) const BINBYTES8: u8 = 0x8e;
    pub(crate) const EMPTY_SET: u8 = 0x8f;
    pub(crate) const ADDITEMS: u8 = 0x90;
    pub(crate) const FROZENSET: u8 = 0x91;
    pub(crate) const MEMOIZE: u8 = 0x94;
    pub(crate) const FRAME: u8 = 0x95;
    pub(crate) const BYTEARRAY8: u8 = 0x96;

    /// The `pickletools` name of an opcode, with its byte value.
    pub(crate) fn name(opcode: u8) -> String {
        let name = match opcode {
            MARK => "MARK",
            STOP => "STOP",
            POP => "POP",
            POP_MARK => "POP_MARK",
            DUP => "DUP",
            BININT => "BININT",
            BININT1 => "BININT1",
            BININT2 => "BININT2",
            NONE => "NONE",
            BINSTRING => "BINSTRING",
            SHORT_BINSTRING => "SHORT_BINSTRING",
            BINUNICODE => "BINUNICODE",
            APPEND => "APPEND",
            APPENDS => "APPENDS",
            BINBYTES => "BINBYTES",
            SHORT_BINBYTES => "SHORT_BINBYTES",
            DICT => "DICT",
            EMPTY_DICT => "EMPTY_DICT",
            BINFLOAT => "BINFLOAT",
            BINGET => "BINGET",
            LONG_BINGET => "LONG_BINGET",
            LIST => "LIST",
            EMPTY_LIST => "EMPTY_LIST",
            BINPUT => "BINPUT",
            LONG_BINPUT => "LONG_BINPUT",
            SETITEM => "SETITEM",
            TUPLE => "TUPLE",
            EMPTY_TUPLE => "EMPTY_TUPLE",
            SETITEMS => "SETITEMS",
            PROTO => "PROTO",
            TUPLE1 => "TUPLE1",
            TUPLE2 => "TUPLE2",
            TUPLE3 => "TUPLE3",
            NEWTRUE => "NEWTRUE",
            NEWFALSE => "NEWFALSE",
            LONG1 => "LONG1",
            LONG4 => "LONG4",
            SHORT_BINUNICODE => "SHORT_BINUNICODE",
            BINUNICODE8 => "BINUNICODE8",
            BINBYTES8 => "BINBYTES8",
            EMPTY_SET => "EMPTY_SET",
            ADDITEMS => "ADDITEMS",
            FROZENSET => "FROZENSET",
            MEMOIZE => "MEMOIZE",
            FRAME => "FRAME",
            BYTEARRAY8 => "BYTEARRAY8",
            b'c' => "GLOBAL",
            0x93 => "STACK_GLOBAL",
            b'R' => "REDUCE",
            b'b' => "BUILD",
            0x81 => "NEWOBJ",
            0x92 => "NEWOBJ_EX",
            b'i' => "INST",
            b'o' => "OBJ",
            b'P' => "PERSID",
            b'Q' => "BINPERSID",
            0x82..=0x84 => "EXT",
            0x97 => "NEXT_BUFFER",
            0x98 => "READONLY_BUFFER",
            b'I' => "INT",
            b'L' => "LONG",
            b'F' => "FLOAT",
            b'S' => "STRING",
            b'V' => "UNICODE",
            b'p' => "PUT",
            b'g' => "GET",
            _ => "unknown opcode",
        };
        format!("{name} ({opcode:#04x})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dict_helpers() {
        let d = PickleValue::dict([
            ("a", PickleValue::Int(1)),
            ("b", PickleValue::Str("x".into())),
        ]);
        assert_eq!(d.get("a").and_then(PickleValue::as_int), Some(1));
        assert_eq!(d.get("b").and_then(PickleValue::as_str), Some("x"));
        assert_eq!(d.get("c"), None);
        assert_eq!(PickleValue::None.get("a"), None);
    }

    #[test]
    fn same_as_treats_nan_as_equal() {
        let a = PickleValue::List(vec![PickleValue::Float(f64::NAN)]);
        assert_ne!(a, a.clone());
        assert!(a.same_as(&a.clone()));
        assert!(!a.same_as(&PickleValue::List(vec![])));
    }

    #[test]
    fn memory_viz_check_rejects_what_the_page_cannot_read() {
        // Protocol 5.
        let err = check_memory_viz(&[0x80, 5, b'N', b'.']).unwrap_err();
        assert!(err.to_string().contains("protocol 5"), "{err}");
        // A later PROTO naming protocol 5.
        let err = check_memory_viz(&[0x80, 4, 0x80, 5, b'N', b'.']).unwrap_err();
        assert!(err.to_string().contains("protocol 5"), "{err}");
        // A 9-byte LONG1.
        let mut wide = vec![0x80, 4, op::LONG1, 9];
        wide.extend([0xff; 8]);
        wide.extend([0, b'.']);
        let err = check_memory_viz(&wide).unwrap_err();
        assert!(err.to_string().contains("9 bytes"), "{err}");
        // Bytes.
        let err = check_memory_viz(&[0x80, 4, op::SHORT_BINBYTES, 1, b'x', b'.']).unwrap_err();
        assert!(err.to_string().contains("SHORT_BINBYTES"), "{err}");
        // Fine.
        check_memory_viz(&[0x80, 4, op::EMPTY_DICT, op::MEMOIZE, b'.']).unwrap();
    }
}
