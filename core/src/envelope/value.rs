//! JSON values ↔ `google.protobuf.Value`, with the edges of docs/design.md §3:
//! integers beyond ±2^53 are rejected (a double cannot hold them), non-finite
//! doubles have no JSON form, and nesting is bounded so that hostile input
//! cannot overflow the stack.

use serde_json::{Map, Number, Value};

use crate::envelope::wire::{self, Reader, WT_I64, WT_LEN, WT_VARINT};
use crate::error::{Error, Result};

/// Deepest nesting of arrays/objects accepted inside `args`, `meta`, `result`
/// and `extensions`. serde_json stops at 128; we stop earlier so that every
/// codec (JSON and protobuf) fails the same way with a path in the error.
pub const MAX_VALUE_DEPTH: usize = 64;

/// Largest integer a double holds exactly (2^53).
const MAX_SAFE_INTEGER: u64 = 1 << 53;

/// A JSON path built lazily: nothing is allocated unless an error is reported.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Path<'a> {
    Root(&'a str),
    Index(&'a Path<'a>, usize),
    Key(&'a Path<'a>, &'a str),
}

impl Path<'_> {
    pub(crate) fn render(&self) -> String {
        match self {
            Path::Root(name) => (*name).to_string(),
            Path::Index(parent, i) => format!("{}[{i}]", parent.render()),
            Path::Key(parent, key) => format!("{}.{key}", parent.render()),
        }
    }
}

/// Checks that a JSON value named `root` (`result`, `args`) can be
/// carried in an envelope: nesting within [`MAX_VALUE_DEPTH`], integers
/// within ±2^53.
pub fn check_json_value(root: &str, value: &Value) -> Result<()> {
    check_value(value, &Path::Root(root), 0)
}

/// Checks that a JSON value can be carried as `google.protobuf.Value`.
pub(crate) fn check_value(value: &Value, path: &Path<'_>, depth: usize) -> Result<()> {
    match value {
        Value::Number(n) => check_number(n, path),
        Value::Array(items) => {
            check_depth(path, depth)?;
            for (i, item) in items.iter().enumerate() {
                check_value(item, &Path::Index(path, i), depth + 1)?;
            }
            Ok(())
        }
        Value::Object(map) => {
            check_depth(path, depth)?;
            for (key, item) in map {
                check_value(item, &Path::Key(path, key), depth + 1)?;
            }
            Ok(())
        }
        Value::Null | Value::Bool(_) | Value::String(_) => Ok(()),
    }
}

fn check_depth(path: &Path<'_>, depth: usize) -> Result<()> {
    if depth >= MAX_VALUE_DEPTH {
        Err(Error::NestingTooDeep {
            path: path.render(),
            limit: MAX_VALUE_DEPTH,
        })
    } else {
        Ok(())
    }
}

fn check_number(n: &Number, path: &Path<'_>) -> Result<()> {
    let too_big = if let Some(i) = n.as_i64() {
        i.unsigned_abs() > MAX_SAFE_INTEGER
    } else if let Some(u) = n.as_u64() {
        u > MAX_SAFE_INTEGER
    } else {
        false
    };
    if too_big {
        return Err(Error::NumberOutOfRange {
            path: path.render(),
            value: n.to_string(),
        });
    }
    Ok(())
}

fn number_as_f64(n: &Number) -> f64 {
    // Checked beforehand to be exactly representable.
    n.as_f64().unwrap_or(0.0)
}

/// Encoded length of a `google.protobuf.Value` body (without its own key/length).
pub(crate) fn value_body_len(value: &Value) -> usize {
    match value {
        Value::Null => 2,
        Value::Bool(_) => 2,
        Value::Number(_) => 9,
        Value::String(s) => wire::len_field_len(3, s.len()),
        Value::Array(items) => wire::len_field_len(6, list_body_len(items)),
        Value::Object(map) => wire::len_field_len(5, struct_body_len(map)),
    }
}

fn list_body_len(items: &[Value]) -> usize {
    items
        .iter()
        .map(|v| wire::len_field_len(1, value_body_len(v)))
        .sum()
}

fn struct_body_len(map: &Map<String, Value>) -> usize {
    map.iter()
        .map(|(k, v)| wire::len_field_len(1, map_entry_body_len(k, v)))
        .sum()
}

/// Length of one `map<string, Value>` entry body: key = 1, value = 2.
pub(crate) fn map_entry_body_len(key: &str, value: &Value) -> usize {
    wire::string_len(1, key) + wire::len_field_len(2, value_body_len(value))
}

/// Writes a `google.protobuf.Value` body. Oneof members are always written,
/// even when they hold a default, exactly as prost does.
pub(crate) fn put_value_body(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::Null => {
            wire::put_key(out, 1, WT_VARINT);
            out.push(0);
        }
        Value::Bool(b) => {
            wire::put_key(out, 4, WT_VARINT);
            out.push(u8::from(*b));
        }
        Value::Number(n) => {
            wire::put_key(out, 2, WT_I64);
            out.extend_from_slice(&number_as_f64(n).to_bits().to_le_bytes());
        }
        Value::String(s) => {
            wire::put_len_header(out, 3, s.len());
            out.extend_from_slice(s.as_bytes());
        }
        Value::Array(items) => {
            wire::put_len_header(out, 6, list_body_len(items));
            for item in items {
                put_value_field(out, 1, item);
            }
        }
        Value::Object(map) => {
            wire::put_len_header(out, 5, struct_body_len(map));
            for (k, v) in map {
                put_map_entry(out, 1, k, v);
            }
        }
    }
}

/// Writes `value` as a length-delimited message field.
pub(crate) fn put_value_field(out: &mut Vec<u8>, field: u32, value: &Value) {
    wire::put_len_header(out, field, value_body_len(value));
    put_value_body(out, value);
}

/// Length of one `map<string, Value>` entry holding a string, as field
/// `field` (what [`put_string_map_entry`] writes).
#[inline]
pub fn string_map_entry_len(field: u32, key: &str, value: &str) -> usize {
    let body =
        wire::string_len(1, key) + wire::len_field_len(2, wire::len_field_len(3, value.len()));
    wire::len_field_len(field, body)
}

/// Writes one `map<string, Value>` entry holding a string, byte for byte
/// what [`put_map_entry`] writes for `Value::String` (without building it).
#[inline]
pub fn put_string_map_entry(out: &mut Vec<u8>, field: u32, key: &str, value: &str) {
    let string_body = wire::len_field_len(3, value.len());
    wire::put_len_header(
        out,
        field,
        wire::string_len(1, key) + wire::len_field_len(2, string_body),
    );
    wire::put_string(out, 1, key);
    wire::put_len_header(out, 2, string_body);
    wire::put_len_header(out, 3, value.len());
    out.extend_from_slice(value.as_bytes());
}

/// Writes one `map<string, Value>` entry as field `field`.
pub(crate) fn put_map_entry(out: &mut Vec<u8>, field: u32, key: &str, value: &Value) {
    wire::put_len_header(out, field, map_entry_body_len(key, value));
    wire::put_string(out, 1, key);
    put_value_field(out, 2, value);
}

thread_local! {
    /// Values the protobuf decoder may still build on this thread, while
    /// [`with_value_budget`] runs; none: no bound.
    static VALUE_BUDGET: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Runs `decode` with at most `limit` JSON values built by the protobuf
/// decoder on this thread: a message of a few bytes per nested empty list
/// would otherwise cost tens of bytes of memory per byte. Past the limit
/// the decode fails naming the value where it stopped.
pub fn with_value_budget<T>(limit: usize, decode: impl FnOnce() -> T) -> T {
    let before = VALUE_BUDGET.with(|b| b.replace(Some(limit)));
    let out = decode();
    VALUE_BUDGET.with(|b| b.set(before));
    out
}

fn spend_value(path: &Path<'_>) -> Result<()> {
    VALUE_BUDGET.with(|b| match b.get() {
        Some(0) => Err(Error::invalid(
            path.render(),
            "the message holds more values than this reader takes in one request",
        )),
        Some(n) => {
            b.set(Some(n - 1));
            Ok(())
        }
        None => Ok(()),
    })
}

/// Decodes a `google.protobuf.Value` body into JSON.
pub(crate) fn read_value(r: &mut Reader<'_>, path: &Path<'_>, depth: usize) -> Result<Value> {
    spend_value(path)?;
    let mut value = Value::Null;
    while !r.is_empty() {
        let (field, wt) = r.key()?;
        match field {
            1 => {
                r.expect("null_value", wt, WT_VARINT)?;
                r.varint()?;
                value = Value::Null;
            }
            2 => {
                r.expect("number_value", wt, WT_I64)?;
                let f = f64::from_bits(r.fixed64()?);
                value = double_to_json(f, path)?;
            }
            3 => {
                r.expect("string_value", wt, WT_LEN)?;
                value = Value::String(r.string()?.to_owned());
            }
            4 => {
                r.expect("bool_value", wt, WT_VARINT)?;
                value = Value::Bool(r.varint()? != 0);
            }
            5 => {
                r.expect("struct_value", wt, WT_LEN)?;
                check_depth(path, depth)?;
                let mut sub = r.sub()?;
                let mut map = Map::new();
                while !sub.is_empty() {
                    let (f, wt) = sub.key()?;
                    if f == 1 {
                        sub.expect("fields", wt, WT_LEN)?;
                        let mut entry = sub.sub()?;
                        let (k, v) = read_map_entry(&mut entry, path, depth + 1)?;
                        map.insert(k, v);
                    } else {
                        sub.skip(f, wt)?;
                    }
                }
                value = Value::Object(map);
            }
            6 => {
                r.expect("list_value", wt, WT_LEN)?;
                check_depth(path, depth)?;
                let mut sub = r.sub()?;
                let mut items = Vec::new();
                while !sub.is_empty() {
                    let (f, wt) = sub.key()?;
                    if f == 1 {
                        sub.expect("values", wt, WT_LEN)?;
                        let mut item = sub.sub()?;
                        let p = Path::Index(path, items.len());
                        items.push(read_value(&mut item, &p, depth + 1)?);
                    } else {
                        sub.skip(f, wt)?;
                    }
                }
                value = Value::Array(items);
            }
            _ => r.skip(field, wt)?,
        }
    }
    Ok(value)
}

/// Decodes one `map<string, Value>` entry.
pub(crate) fn read_map_entry(
    r: &mut Reader<'_>,
    path: &Path<'_>,
    depth: usize,
) -> Result<(String, Value)> {
    let mut key = String::new();
    let mut value = Value::Null;
    let mut value_bytes = None;
    while !r.is_empty() {
        let (field, wt) = r.key()?;
        match field {
            1 => {
                r.expect("key", wt, WT_LEN)?;
                key = r.string()?.to_owned();
            }
            2 => {
                r.expect("value", wt, WT_LEN)?;
                value_bytes = Some(r.sub()?);
            }
            _ => r.skip(field, wt)?,
        }
    }
    // The key may come after the value on the wire; decode the value last so
    // that its path names the key.
    if let Some(mut sub) = value_bytes {
        value = read_value(&mut sub, &Path::Key(path, &key), depth)?;
    }
    Ok((key, value))
}

/// A double as JSON: integral values within ±2^53 become JSON integers so that
/// `1` round-trips as `1`, not `1.0`.
pub(crate) fn double_to_json(f: f64, path: &Path<'_>) -> Result<Value> {
    if !f.is_finite() {
        return Err(Error::NonFiniteNumber {
            path: path.render(),
        });
    }
    if f.fract() == 0.0 && f.abs() <= MAX_SAFE_INTEGER as f64 {
        return Ok(Value::Number(Number::from(f as i64)));
    }
    Number::from_f64(f)
        .map(Value::Number)
        .ok_or_else(|| Error::NonFiniteNumber {
            path: path.render(),
        })
}

/// Normalises a JSON value to what survives a protobuf round trip (numbers
/// become doubles). Used by tests and by the JSON decoder so that equal
/// envelopes compare equal whichever codec they came from.
pub(crate) fn normalize_number(n: &Number) -> Number {
    if n.is_f64() {
        let f = n.as_f64().unwrap_or(0.0);
        if f.fract() == 0.0 && f.abs() <= MAX_SAFE_INTEGER as f64 {
            return Number::from(f as i64);
        }
    } else if let Some(u) = n.as_u64() {
        // u64 within 2^53 is also an i64; keep one representation.
        if let Ok(i) = i64::try_from(u) {
            return Number::from(i);
        }
    }
    n.clone()
}

/// Recursively normalises numbers (see [`normalize_number`]).
pub(crate) fn normalize_value(v: &mut Value) {
    match v {
        Value::Number(n) => *n = normalize_number(n),
        Value::Array(items) => items.iter_mut().for_each(normalize_value),
        Value::Object(map) => map.values_mut().for_each(normalize_value),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;
    use serde_json::json;

    fn encode(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        put_value_body(&mut out, v);
        out
    }

    #[test]
    fn matches_prost_types_encoding() {
        let v = json!({"a": [1, 2.5, "x", null, true, {"b": false}], "": 0});
        let ours = encode(&v);
        let decoded = prost_types::Value::decode(ours.as_slice()).unwrap();
        assert_eq!(decoded.encode_to_vec(), ours, "byte-identical to prost");
        let back = read_value(&mut Reader::new(&ours), &Path::Root("v"), 0).unwrap();
        assert_eq!(back, v);
    }

    #[test]
    fn big_integers_are_rejected_with_their_path() {
        let v = json!([{"amount": 9_007_199_254_740_993u64}]);
        let err = check_value(&v, &Path::Root("args"), 0).unwrap_err();
        match err {
            Error::NumberOutOfRange { path, value } => {
                assert_eq!(path, "args[0].amount");
                assert_eq!(value, "9007199254740993");
            }
            other => panic!("unexpected {other}"),
        }
        assert!(check_value(&json!(9_007_199_254_740_992u64), &Path::Root("x"), 0).is_ok());
        assert!(check_value(&json!(-9_007_199_254_740_993i64), &Path::Root("x"), 0).is_err());
    }

    #[test]
    fn nesting_is_bounded_in_both_directions() {
        let mut v = json!(1);
        for _ in 0..MAX_VALUE_DEPTH + 1 {
            v = json!([v]);
        }
        let err = check_value(&v, &Path::Root("args"), 0).unwrap_err();
        assert!(matches!(err, Error::NestingTooDeep { .. }), "{err}");
        let bytes = encode(&v);
        let err = read_value(&mut Reader::new(&bytes), &Path::Root("args"), 0).unwrap_err();
        assert!(matches!(err, Error::NestingTooDeep { .. }), "{err}");
    }

    #[test]
    fn non_finite_doubles_have_no_json_form() {
        let mut out = Vec::new();
        wire::put_key(&mut out, 2, WT_I64);
        out.extend_from_slice(&f64::NAN.to_bits().to_le_bytes());
        let err = read_value(&mut Reader::new(&out), &Path::Root("result"), 0).unwrap_err();
        assert!(matches!(err, Error::NonFiniteNumber { .. }));
    }
}
