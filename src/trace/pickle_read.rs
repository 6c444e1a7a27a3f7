//! A small pickle reader: runs the pickle machine of protocols 2 to 5 over plain data into an
//! arena of objects (so memo references share, as in Python, and nothing is copied).
//!
//! Refuses class references and everything that would call code (`GLOBAL`, `REDUCE`, `BUILD`,
//! ...), the text opcodes of protocols 0 and 1, and out-of-band buffers. Never panics and never
//! allocates more than the input's size justifies: every length is checked against the bytes
//! left before anything is reserved.
#![forbid(unsafe_code)]

use crate::int_hash::IntMap;

use super::import::ByteBudget;
use super::io_error::TraceIoError;
use super::pickle::{PickleValue, op};

/// Index of an object in the arena.
pub(crate) type Id = usize;

/// One decoded object.
#[derive(Debug)]
pub(crate) enum Obj {
    None,
    Bool(bool),
    Int(i128),
    /// An integer wider than 128 bits (its width in bytes); refused where a value is needed.
    HugeInt(usize),
    Float(f64),
    Str(Box<str>),
    Bytes(Box<[u8]>),
    List(Vec<Id>),
    Tuple(Box<[Id]>),
    Dict(Vec<(Id, Id)>),
    Set(Vec<Id>),
}

impl Obj {
    /// "a string", "an integer", ... for messages.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Obj::None => "None",
            Obj::Bool(_) => "a bool",
            Obj::Int(_) | Obj::HugeInt(_) => "an integer",
            Obj::Float(_) => "a float",
            Obj::Str(_) => "a string",
            Obj::Bytes(_) => "a bytes object",
            Obj::List(_) => "a list",
            Obj::Tuple(_) => "a tuple",
            Obj::Dict(_) => "a dict",
            Obj::Set(_) => "a set",
        }
    }
}

/// What the reader saw besides the data (for [`check_memory_viz`](super::check_memory_viz)).
#[derive(Debug)]
pub(crate) struct Facts {
    /// The highest protocol a `PROTO` opcode named.
    pub(crate) protocol: u8,
    /// First offset of each opcode that occurred.
    first_offset: Vec<Option<usize>>,
    /// The widest `LONG1` argument in bytes (0 when none).
    pub(crate) widest_long1: usize,
}

impl Facts {
    /// `(opcode, first offset)` of every opcode that occurred, by first offset.
    pub(crate) fn first_offsets(&self) -> Vec<(u8, usize)> {
        let mut seen: Vec<(u8, usize)> = (0..=255u8)
            .filter_map(|opcode| self.first_offset[usize::from(opcode)].map(|at| (opcode, at)))
            .collect();
        seen.sort_by_key(|&(_, at)| at);
        seen
    }
}

/// A decoded pickle: the arena, the root object and what was seen on the way.
#[derive(Debug)]
pub(crate) struct Pickle {
    objs: Vec<Obj>,
    root: Id,
    ops: usize,
    facts: Facts,
}

/// Deepest nesting [`Pickle::to_value`] converts.
const MAX_DEPTH: usize = 64;

impl Pickle {
    /// The object the pickle returns.
    pub(crate) fn root(&self) -> Id {
        self.root
    }

    /// Number of opcodes executed.
    pub(crate) fn ops(&self) -> usize {
        self.ops
    }

    /// Protocol, opcodes seen, widest `LONG1`.
    pub(crate) fn facts(&self) -> &Facts {
        &self.facts
    }

    /// The object `id` (ids come from this pickle, so they are in range; an unknown id reads
    /// as `None`).
    pub(crate) fn obj(&self, id: Id) -> &Obj {
        self.objs.get(id).unwrap_or(&Obj::None)
    }

    /// The items of a dict, by insertion order.
    pub(crate) fn dict_items(&self, id: Id) -> Option<&[(Id, Id)]> {
        match self.obj(id) {
            Obj::Dict(items) => Some(items),
            _ => None,
        }
    }

    /// The items of a list.
    pub(crate) fn list_items(&self, id: Id) -> Option<&[Id]> {
        match self.obj(id) {
            Obj::List(items) => Some(items),
            _ => None,
        }
    }

    /// The items of a list or a tuple.
    pub(crate) fn sequence_items(&self, id: Id) -> Option<&[Id]> {
        match self.obj(id) {
            Obj::List(items) => Some(items),
            Obj::Tuple(items) => Some(items),
            _ => None,
        }
    }

    /// The string `id`, when it is one.
    pub(crate) fn str_of(&self, id: Id) -> Option<&str> {
        match self.obj(id) {
            Obj::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The value under string key `key` of dict `id` (the last one, as Python keeps it).
    pub(crate) fn dict_get(&self, id: Id, key: &str) -> Option<Id> {
        self.dict_items(id)?
            .iter()
            .rev()
            .find(|&&(k, _)| self.str_of(k) == Some(key))
            .map(|&(_, v)| v)
    }

    /// Converts object `id` into an owned tree, charging every value's bytes (its
    /// `PickleValue` and its string or bytes payload, once per reference: shared objects are
    /// copied) to `bytes`.
    ///
    /// # Errors
    /// Too deep, too many values (shared references expanding beyond 16 values per opcode),
    /// more bytes than `bytes` has left ([`TraceIoError::TooLarge`]), or an integer wider than
    /// 128 bits.
    pub(crate) fn to_value(
        &self,
        id: Id,
        bytes: &mut ByteBudget,
    ) -> Result<PickleValue, TraceIoError> {
        let mut budget = self.ops.saturating_mul(16).saturating_add(64);
        self.value_at(id, 0, &mut (&mut budget, bytes))
    }

    fn value_at(
        &self,
        id: Id,
        depth: usize,
        budgets: &mut (&mut usize, &mut ByteBudget),
    ) -> Result<PickleValue, TraceIoError> {
        let (budget, bytes) = budgets;
        if depth > MAX_DEPTH {
            return Err(TraceIoError::pickle(
                0,
                format!("data nested deeper than {MAX_DEPTH} levels"),
            ));
        }
        if **budget == 0 {
            return Err(TraceIoError::pickle(
                0,
                "shared references expand the data beyond 16 values per opcode",
            ));
        }
        **budget -= 1;
        let payload = match self.obj(id) {
            Obj::Str(s) => s.len(),
            Obj::Bytes(b) => b.len(),
            _ => 0,
        };
        bytes.charge(
            std::mem::size_of::<PickleValue>().saturating_add(payload),
            "the values built from the pickle (shared references count once per use)",
        )?;
        let seq = |items: &[Id],
                   budgets: &mut (&mut usize, &mut ByteBudget)|
         -> Result<Vec<PickleValue>, TraceIoError> {
            items
                .iter()
                .map(|&item| self.value_at(item, depth + 1, budgets))
                .collect()
        };
        Ok(match self.obj(id) {
            Obj::None => PickleValue::None,
            Obj::Bool(b) => PickleValue::Bool(*b),
            Obj::Int(i) => PickleValue::Int(*i),
            Obj::HugeInt(width) => {
                return Err(TraceIoError::pickle(
                    0,
                    format!("an integer of {width} bytes (at most 16 are read)"),
                ));
            }
            Obj::Float(x) => PickleValue::Float(*x),
            Obj::Str(s) => PickleValue::Str(s.to_string()),
            Obj::Bytes(b) => PickleValue::Bytes(b.to_vec()),
            Obj::List(items) => PickleValue::List(seq(items, budgets)?),
            Obj::Tuple(items) => PickleValue::Tuple(seq(items, budgets)?),
            Obj::Set(items) => PickleValue::Set(seq(items, budgets)?),
            Obj::Dict(items) => {
                let mut out = Vec::with_capacity(items.len());
                for &(k, v) in items {
                    let key = self.value_at(k, depth + 1, budgets)?;
                    out.push((key, self.value_at(v, depth + 1, budgets)?));
                }
                PickleValue::Dict(out)
            }
        })
    }
}

/// A cursor over the input.
struct Input<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Input<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let bytes = self.data.get(self.pos..end)?;
        self.pos = end;
        Some(bytes)
    }

    /// A length-prefixed payload: the length is checked against the bytes left before use.
    fn take_len(&mut self, len: u64) -> Option<&'a [u8]> {
        self.take(usize::try_from(len).ok()?)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }
}

/// The pickle machine's state.
struct Machine {
    objs: Vec<Obj>,
    stack: Vec<Id>,
    marks: Vec<usize>,
    memo: IntMap<Id>,
}

impl Machine {
    fn push(&mut self, obj: Obj) {
        self.stack.push(self.objs.len());
        self.objs.push(obj);
    }
}

/// Runs the pickle machine over `data`.
///
/// # Errors
/// [`TraceIoError::Pickle`] with the offset of the offending opcode.
pub(crate) fn parse(data: &[u8]) -> Result<Pickle, TraceIoError> {
    match data {
        [] => return Err(TraceIoError::pickle(0, "empty input; not a pickle")),
        [op::PROTO, 2..=5, ..] => {}
        [op::PROTO, version, ..] => {
            return Err(TraceIoError::pickle(
                0,
                format!("pickle protocol {version} (2 to 5 are read)"),
            ));
        }
        [first, ..] => {
            return Err(TraceIoError::pickle(
                0,
                format!(
                    "not a pickle of protocol 2 or later (starts with byte {first:#04x}, not PROTO 0x80)"
                ),
            ));
        }
    }
    let mut input = Input { data, pos: 0 };
    let mut m = Machine {
        objs: Vec::new(),
        stack: Vec::new(),
        marks: Vec::new(),
        memo: IntMap::default(),
    };
    let mut facts = Facts {
        protocol: 0,
        first_offset: vec![None; 256],
        widest_long1: 0,
    };
    let mut ops = 0usize;

    loop {
        let at = input.pos;
        let Some(&opcode) = data.get(at) else {
            return Err(TraceIoError::pickle(
                at,
                "truncated: the input ends before the STOP opcode",
            ));
        };
        input.pos += 1;
        ops += 1;
        let seen = &mut facts.first_offset[usize::from(opcode)];
        if seen.is_none() {
            *seen = Some(at);
        }
        let err =
            |detail: String| TraceIoError::pickle(at, format!("{}: {detail}", op::name(opcode)));
        let truncated = || err("truncated argument".to_string());
        let underflow = || err("stack underflow".to_string());

        macro_rules! arg {
            ($n:literal) => {
                input.array::<$n>().ok_or_else(truncated)?
            };
        }

        match opcode {
            op::PROTO => {
                let [version] = arg!(1);
                if !(2..=5).contains(&version) {
                    return Err(err(format!("protocol {version} (2 to 5 are read)")));
                }
                facts.protocol = facts.protocol.max(version);
            }
            op::FRAME => {
                let _frame_len = arg!(8);
            }
            op::STOP => {
                let root = m.stack.pop().ok_or_else(underflow)?;
                return Ok(Pickle {
                    objs: m.objs,
                    root,
                    ops,
                    facts,
                });
            }
            op::MARK => m.marks.push(m.stack.len()),
            op::POP => {
                if m.stack.pop().is_none() {
                    pop_mark(&mut m).ok_or_else(underflow)?;
                }
            }
            op::POP_MARK => {
                pop_mark(&mut m).ok_or_else(|| err("no MARK".to_string()))?;
            }
            op::DUP => {
                let top = *m.stack.last().ok_or_else(underflow)?;
                m.stack.push(top);
            }
            op::NONE => m.push(Obj::None),
            op::NEWTRUE => m.push(Obj::Bool(true)),
            op::NEWFALSE => m.push(Obj::Bool(false)),
            op::BININT => m.push(Obj::Int(i128::from(i32::from_le_bytes(arg!(4))))),
            op::BININT1 => m.push(Obj::Int(i128::from(arg!(1)[0]))),
            op::BININT2 => m.push(Obj::Int(i128::from(u16::from_le_bytes(arg!(2))))),
            op::LONG1 | op::LONG4 => {
                let len = if opcode == op::LONG1 {
                    u64::from(arg!(1)[0])
                } else {
                    let len = i32::from_le_bytes(arg!(4));
                    u64::try_from(len).map_err(|_| err(format!("negative length {len}")))?
                };
                let bytes = input.take_len(len).ok_or_else(truncated)?;
                if opcode == op::LONG1 {
                    facts.widest_long1 = facts.widest_long1.max(bytes.len());
                }
                m.push(decode_long(bytes));
            }
            op::BINFLOAT => m.push(Obj::Float(f64::from_be_bytes(arg!(8)))),
            op::SHORT_BINUNICODE | op::BINUNICODE | op::BINUNICODE8 => {
                let len = match opcode {
                    op::SHORT_BINUNICODE => u64::from(arg!(1)[0]),
                    op::BINUNICODE => u64::from(u32::from_le_bytes(arg!(4))),
                    _ => u64::from_le_bytes(arg!(8)),
                };
                let bytes = input.take_len(len).ok_or_else(truncated)?;
                let text =
                    std::str::from_utf8(bytes).map_err(|e| err(format!("invalid UTF-8: {e}")))?;
                m.push(Obj::Str(text.into()));
            }
            op::SHORT_BINSTRING | op::BINSTRING => {
                let len = if opcode == op::SHORT_BINSTRING {
                    u64::from(arg!(1)[0])
                } else {
                    let len = i32::from_le_bytes(arg!(4));
                    u64::try_from(len).map_err(|_| err(format!("negative length {len}")))?
                };
                let bytes = input.take_len(len).ok_or_else(truncated)?;
                // Python 3 decodes these Python 2 strings as ASCII by default.
                match std::str::from_utf8(bytes) {
                    Ok(text) => m.push(Obj::Str(text.into())),
                    Err(_) => m.push(Obj::Bytes(bytes.into())),
                }
            }
            op::SHORT_BINBYTES | op::BINBYTES | op::BINBYTES8 | op::BYTEARRAY8 => {
                let len = match opcode {
                    op::SHORT_BINBYTES => u64::from(arg!(1)[0]),
                    op::BINBYTES => u64::from(u32::from_le_bytes(arg!(4))),
                    _ => u64::from_le_bytes(arg!(8)),
                };
                let bytes = input.take_len(len).ok_or_else(truncated)?;
                m.push(Obj::Bytes(bytes.into()));
            }
            op::EMPTY_LIST => m.push(Obj::List(Vec::new())),
            op::EMPTY_DICT => m.push(Obj::Dict(Vec::new())),
            op::EMPTY_TUPLE => m.push(Obj::Tuple(Box::new([]))),
            op::EMPTY_SET => m.push(Obj::Set(Vec::new())),
            op::LIST | op::TUPLE | op::FROZENSET => {
                let items = pop_mark(&mut m).ok_or_else(|| err("no MARK".to_string()))?;
                m.push(match opcode {
                    op::LIST => Obj::List(items),
                    op::TUPLE => Obj::Tuple(items.into()),
                    _ => Obj::Set(items),
                });
            }
            op::DICT => {
                let items = pop_mark(&mut m).ok_or_else(|| err("no MARK".to_string()))?;
                m.push(Obj::Dict(
                    pairs(&items).ok_or_else(|| err("odd number of items".to_string()))?,
                ));
            }
            op::TUPLE1 | op::TUPLE2 | op::TUPLE3 => {
                let n = usize::from(opcode - op::TUPLE1 + 1);
                let start = m.stack.len().checked_sub(n).ok_or_else(underflow)?;
                let items = m.stack.split_off(start);
                m.push(Obj::Tuple(items.into()));
            }
            op::APPEND | op::SETITEM => {
                let n = if opcode == op::APPEND { 1 } else { 2 };
                let start = m.stack.len().checked_sub(n).ok_or_else(underflow)?;
                let items = m.stack.split_off(start);
                let target = *m.stack.last().ok_or_else(underflow)?;
                extend(&mut m.objs, target, opcode, &items).map_err(err)?;
            }
            op::APPENDS | op::SETITEMS | op::ADDITEMS => {
                let items = pop_mark(&mut m).ok_or_else(|| err("no MARK".to_string()))?;
                let target = *m.stack.last().ok_or_else(underflow)?;
                extend(&mut m.objs, target, opcode, &items).map_err(err)?;
            }
            op::BINPUT | op::LONG_BINPUT | op::MEMOIZE => {
                let index = match opcode {
                    op::BINPUT => u64::from(arg!(1)[0]),
                    op::LONG_BINPUT => u64::from(u32::from_le_bytes(arg!(4))),
                    _ => m.memo.len() as u64,
                };
                let top = *m.stack.last().ok_or_else(underflow)?;
                m.memo.insert(index, top);
            }
            op::BINGET | op::LONG_BINGET => {
                let index = if opcode == op::BINGET {
                    u64::from(arg!(1)[0])
                } else {
                    u64::from(u32::from_le_bytes(arg!(4)))
                };
                let id = *m
                    .memo
                    .get(&index)
                    .ok_or_else(|| err(format!("memo entry {index} was never stored")))?;
                m.stack.push(id);
            }
            _ => {
                return Err(err(
                    "not supported: only plain data (no classes, functions, buffers or protocol 0/1 \
                     text opcodes) is read"
                        .to_string(),
                ));
            }
        }
    }
}

/// Pops everything above the last mark (and the mark).
fn pop_mark(m: &mut Machine) -> Option<Vec<Id>> {
    let mark = m.marks.pop()?;
    // A mark above the stack can only come from POPs below it; Python treats that the same way.
    Some(m.stack.split_off(mark.min(m.stack.len())))
}

/// `[k0, v0, k1, v1, ...]` as pairs; `None` for an odd count.
fn pairs(items: &[Id]) -> Option<Vec<(Id, Id)>> {
    if items.len() % 2 != 0 {
        return None;
    }
    Some(items.chunks_exact(2).map(|kv| (kv[0], kv[1])).collect())
}

/// APPEND(S) / SETITEM(S) / ADDITEMS onto object `target`.
fn extend(objs: &mut [Obj], target: Id, opcode: u8, items: &[Id]) -> Result<(), String> {
    let obj = objs
        .get_mut(target)
        .ok_or_else(|| "no target object".to_string())?;
    match (opcode, obj) {
        (op::APPEND | op::APPENDS, Obj::List(list)) => list.extend_from_slice(items),
        (op::ADDITEMS, Obj::Set(set)) => set.extend_from_slice(items),
        (op::SETITEM | op::SETITEMS, Obj::Dict(dict)) => {
            dict.extend(pairs(items).ok_or_else(|| "odd number of items".to_string())?);
        }
        (_, other) => return Err(format!("cannot add items to {}", other.kind())),
    }
    Ok(())
}

/// Two's-complement little-endian integer bytes (as `LONG1`/`LONG4` hold them).
fn decode_long(bytes: &[u8]) -> Obj {
    if bytes.len() > 16 {
        return Obj::HugeInt(bytes.len());
    }
    let negative = bytes.last().is_some_and(|&b| b & 0x80 != 0);
    let mut buf = if negative { [0xff; 16] } else { [0; 16] };
    buf[..bytes.len()].copy_from_slice(bytes);
    Obj::Int(i128::from_le_bytes(buf))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(bytes: &[u8]) -> PickleValue {
        let p = parse(bytes).unwrap();
        p.to_value(p.root(), &mut ByteBudget::new(u64::MAX))
            .unwrap()
    }

    #[test]
    fn decodes_scalars_and_containers() {
        // {'a': [1, -2, 300, 70000, None, True], 'b': (1.5,)} as Python 3.12 writes it (protocol 4).
        let bytes = b"\x80\x04\x95-\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94]\x94(K\x01J\xfe\xff\xff\xffM,\x01J\x70\x11\x01\x00N\x88e\x8c\x01b\x94G?\xf8\x00\x00\x00\x00\x00\x00\x85\x94u.";
        let v = value(bytes);
        let expected = PickleValue::dict([
            (
                "a",
                PickleValue::List(vec![
                    PickleValue::Int(1),
                    PickleValue::Int(-2),
                    PickleValue::Int(300),
                    PickleValue::Int(70000),
                    PickleValue::None,
                    PickleValue::Bool(true),
                ]),
            ),
            ("b", PickleValue::Tuple(vec![PickleValue::Float(1.5)])),
        ]);
        assert_eq!(v, expected);
    }

    #[test]
    fn long1_sign_and_width() {
        assert_eq!(value(b"\x80\x02\x8a\x00."), PickleValue::Int(0));
        assert_eq!(value(b"\x80\x02\x8a\x01\xff."), PickleValue::Int(-1));
        assert_eq!(value(b"\x80\x02\x8a\x02\xff\x00."), PickleValue::Int(255));
        assert_eq!(
            value(b"\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01."),
            PickleValue::Int(1 << 64)
        );
        let mut huge = b"\x80\x02\x8a\x11".to_vec();
        huge.extend([1u8; 17]);
        huge.push(b'.');
        let p = parse(&huge).unwrap();
        assert!(
            p.to_value(p.root(), &mut ByteBudget::new(u64::MAX))
                .is_err()
        );
    }

    #[test]
    fn memo_shares_objects_as_python_does() {
        // l = []; d = {'x': l}; l.append(1) after memoizing: the dict sees the append.
        // PROTO 4, EMPTY_LIST, MEMOIZE(0), EMPTY_DICT, SHORT_BINUNICODE 'x', BINGET 0, SETITEM,
        // BINGET 0, K 1, APPEND, POP, STOP
        let bytes = b"\x80\x04]\x94}\x8c\x01xh\x00sh\x00K\x01a0.";
        let v = value(bytes);
        assert_eq!(
            v,
            PickleValue::dict([("x", PickleValue::List(vec![PickleValue::Int(1)]))])
        );
    }

    #[test]
    fn exponential_sharing_is_refused_not_expanded() {
        let mut b = vec![0x80u8, 4, b']', 0x94];
        for i in 0..40u32 {
            for _ in 0..2 {
                b.push(b'j');
                b.extend_from_slice(&i.to_le_bytes());
            }
            b.extend([0x86, 0x94]);
        }
        b.push(b'.');
        let p = parse(&b).unwrap();
        assert!(
            p.to_value(p.root(), &mut ByteBudget::new(u64::MAX))
                .is_err()
        );
    }

    #[test]
    fn malformed_inputs_are_errors_with_offsets() {
        let cases: &[(&[u8], &str)] = &[
            (b"", "empty"),
            (b"hello", "not a pickle"),
            (b"\x80\x01N.", "protocol 1"),
            (b"\x80\x04N", "before the STOP"),
            (b"\x80\x04X\xff\xff\xff\x7fabc.", "truncated"),
            (b"\x80\x04cos\nsystem\n.", "GLOBAL"),
            (b"\x80\x04h\x05.", "never stored"),
            (b"\x80\x04K\x01a.", "underflow"),
            (b"\x80\x04K\x01K\x02a.", "cannot add items"),
            (b"\x80\x04}(K\x01u.", "odd number"),
            (b"\x80\x04e.", "no MARK"),
            (b"\x80\x04.", "underflow"),
            (b"\x80\x04\x8c\x02\xff\xfe.", "UTF-8"),
            (b"\x80\x04\x8b\xff\xff\xff\xff.", "negative length"),
        ];
        for (bytes, needle) in cases {
            let err = parse(bytes).unwrap_err();
            assert!(matches!(err, TraceIoError::Pickle { .. }));
            assert!(err.to_string().contains(needle), "{bytes:?}: {err}");
        }
    }

    #[test]
    fn facts_record_protocol_opcodes_and_long1_width() {
        let p =
            parse(b"\x80\x04\x95\x01\x00\x00\x00\x00\x00\x00\x00\x8a\x03\x01\x02\x03.").unwrap();
        assert_eq!(p.facts().protocol, 4);
        assert_eq!(p.facts().widest_long1, 3);
        let ops: Vec<u8> = p
            .facts()
            .first_offsets()
            .into_iter()
            .map(|(o, _)| o)
            .collect();
        assert_eq!(ops, vec![op::PROTO, op::FRAME, op::LONG1, op::STOP]);
        assert_eq!(p.ops(), 4);
    }
}
