//! Protobuf wire-format primitives: just enough to decode and encode the OJS
//! envelope by hand, which is what lets us keep unknown fields byte-for-byte
//! (prost-generated structs drop them). Public for the other codecs built on
//! them (ojs-grpcq reads a call in place and writes a call's job directly).
//! Every function is `#[inline]`: called from another crate a small write
//! is otherwise a call each time (the mapping bench's direct encoder went
//! from 435 to 480 ns when these moved behind a crate boundary, and back
//! to 415 with the attribute).

use crate::error::{Error, Result};

pub const WT_VARINT: u8 = 0;
pub const WT_I64: u8 = 1;
pub const WT_LEN: u8 = 2;
pub const WT_START_GROUP: u8 = 3;
pub const WT_END_GROUP: u8 = 4;
pub const WT_I32: u8 = 5;

/// Groups are deprecated but legal; skipping them needs a bound like any recursion.
const MAX_GROUP_DEPTH: usize = 64;

/// A cursor over protobuf bytes that reports absolute offsets in its errors.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Offset of `buf[0]` in the outermost input, for error messages.
    base: usize,
}

impl<'a> Reader<'a> {
    #[inline]
    pub fn new(buf: &'a [u8]) -> Self {
        Reader {
            buf,
            pos: 0,
            base: 0,
        }
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.pos >= self.buf.len()
    }

    #[inline]
    pub fn pos(&self) -> usize {
        self.pos
    }

    #[inline]
    pub fn offset(&self) -> usize {
        self.base + self.pos
    }

    #[inline]
    pub fn slice(&self, from: usize, to: usize) -> &'a [u8] {
        &self.buf[from..to]
    }

    #[inline]
    pub fn err(&self, reason: impl Into<String>) -> Error {
        Error::malformed(self.offset(), reason)
    }

    #[inline]
    pub fn varint(&mut self) -> Result<u64> {
        let mut value: u64 = 0;
        for i in 0..10 {
            let Some(&byte) = self.buf.get(self.pos) else {
                return Err(self.err("truncated varint"));
            };
            self.pos += 1;
            if i == 9 && byte > 1 {
                return Err(self.err("varint overflows 64 bits"));
            }
            value |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(self.err("varint longer than 10 bytes"))
    }

    /// Reads a field key; returns (field number, wire type).
    #[inline]
    pub fn key(&mut self) -> Result<(u32, u8)> {
        let start = self.offset();
        let key = self.varint()?;
        let wire_type = (key & 7) as u8;
        let field = key >> 3;
        if field == 0 || field > u64::from(u32::MAX >> 3) {
            return Err(Error::malformed(
                start,
                format!("invalid field number {field}"),
            ));
        }
        if wire_type > 5 {
            return Err(Error::malformed(
                start,
                format!("invalid wire type {wire_type}"),
            ));
        }
        Ok((field as u32, wire_type))
    }

    #[inline]
    pub fn fixed64(&mut self) -> Result<u64> {
        let bytes = self.take(8)?;
        let mut arr = [0u8; 8];
        arr.copy_from_slice(bytes);
        Ok(u64::from_le_bytes(arr))
    }

    /// Everything not read yet.
    #[inline]
    pub fn rest(&mut self) -> &'a [u8] {
        let out = &self.buf[self.pos.min(self.buf.len())..];
        self.pos = self.buf.len();
        out
    }

    #[inline]
    pub fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&end| end <= self.buf.len());
        let Some(end) = end else {
            return Err(self.err(format!(
                "truncated: needs {n} bytes, {} left",
                self.buf.len() - self.pos
            )));
        };
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    /// Reads a length-delimited field's body as a sub-reader that keeps offsets.
    #[inline]
    pub fn sub(&mut self) -> Result<Reader<'a>> {
        let len = self.varint()?;
        let len = usize::try_from(len).map_err(|_| self.err("length does not fit in memory"))?;
        let base = self.offset();
        let buf = self.take(len)?;
        Ok(Reader { buf, pos: 0, base })
    }

    #[inline]
    pub fn string(&mut self) -> Result<&'a str> {
        let at = self.offset();
        let bytes = self.sub()?.rest();
        std::str::from_utf8(bytes)
            .map_err(|e| Error::malformed(at, format!("string is not valid UTF-8: {e}")))
    }

    /// Skips the body of a field whose key was just read.
    #[inline]
    pub fn skip(&mut self, field: u32, wire_type: u8) -> Result<()> {
        self.skip_depth(field, wire_type, 0)
    }

    fn skip_depth(&mut self, field: u32, wire_type: u8, depth: usize) -> Result<()> {
        match wire_type {
            WT_VARINT => {
                self.varint()?;
            }
            WT_I64 => {
                self.take(8)?;
            }
            WT_LEN => {
                self.sub()?;
            }
            WT_I32 => {
                self.take(4)?;
            }
            WT_START_GROUP => {
                if depth >= MAX_GROUP_DEPTH {
                    return Err(self.err("groups nested too deeply"));
                }
                loop {
                    if self.is_empty() {
                        return Err(self.err("truncated group"));
                    }
                    let (inner, wt) = self.key()?;
                    if wt == WT_END_GROUP {
                        if inner != field {
                            return Err(self.err("mismatched end-group"));
                        }
                        break;
                    }
                    self.skip_depth(inner, wt, depth + 1)?;
                }
            }
            _ => return Err(self.err("unexpected end-group")),
        }
        Ok(())
    }

    /// Checks the wire type of a known field.
    #[inline]
    pub fn expect(&self, name: &str, got: u8, want: u8) -> Result<()> {
        if got == want {
            Ok(())
        } else {
            Err(self.err(format!(
                "field `{name}` has wire type {got}, expected {want}"
            )))
        }
    }
}

// ---- writing ----------------------------------------------------------------

#[inline]
pub fn varint_len(mut v: u64) -> usize {
    let mut n = 1;
    while v >= 0x80 {
        v >>= 7;
        n += 1;
    }
    n
}

#[inline]
pub fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

#[inline]
pub fn key_len(field: u32) -> usize {
    varint_len(u64::from(field) << 3)
}

#[inline]
pub fn put_key(out: &mut Vec<u8>, field: u32, wire_type: u8) {
    put_varint(out, (u64::from(field) << 3) | u64::from(wire_type));
}

/// Length of a length-delimited field whose body is `body` bytes.
#[inline]
pub fn len_field_len(field: u32, body: usize) -> usize {
    key_len(field) + varint_len(body as u64) + body
}

#[inline]
pub fn put_len_header(out: &mut Vec<u8>, field: u32, body: usize) {
    put_key(out, field, WT_LEN);
    put_varint(out, body as u64);
}

#[inline]
pub fn string_len(field: u32, s: &str) -> usize {
    bytes_len(field, s.as_bytes())
}

/// proto3 scalar rule: the default value (empty) is not written.
#[inline]
pub fn put_string(out: &mut Vec<u8>, field: u32, s: &str) {
    put_bytes(out, field, s.as_bytes());
}

/// [`string_len`] of text held as bytes (the wire format is the same).
#[inline]
pub fn bytes_len(field: u32, b: &[u8]) -> usize {
    if b.is_empty() {
        0
    } else {
        len_field_len(field, b.len())
    }
}

/// [`put_string`] of text held as bytes.
#[inline]
pub fn put_bytes(out: &mut Vec<u8>, field: u32, b: &[u8]) {
    if !b.is_empty() {
        put_len_header(out, field, b.len());
        out.extend_from_slice(b);
    }
}

/// int32 is encoded sign-extended to 64 bits, as protobuf requires.
#[inline]
pub fn int32_len(field: u32, v: i32) -> usize {
    if v == 0 {
        0
    } else {
        key_len(field) + varint_len(i64::from(v) as u64)
    }
}

#[inline]
pub fn put_int32(out: &mut Vec<u8>, field: u32, v: i32) {
    if v != 0 {
        put_key(out, field, WT_VARINT);
        put_varint(out, i64::from(v) as u64);
    }
}

/// An `optional int32`: present (even 0) or absent.
#[inline]
pub fn optional_int32_len(field: u32, v: Option<i32>) -> usize {
    v.map_or(0, |v| key_len(field) + varint_len(i64::from(v) as u64))
}

/// Writes an `optional int32` when present, 0 included.
#[inline]
pub fn put_optional_int32(out: &mut Vec<u8>, field: u32, v: Option<i32>) {
    if let Some(v) = v {
        put_key(out, field, WT_VARINT);
        put_varint(out, i64::from(v) as u64);
    }
}

#[inline]
pub fn int64_len(field: u32, v: i64) -> usize {
    if v == 0 {
        0
    } else {
        key_len(field) + varint_len(v as u64)
    }
}

#[inline]
pub fn put_int64(out: &mut Vec<u8>, field: u32, v: i64) {
    if v != 0 {
        put_key(out, field, WT_VARINT);
        put_varint(out, v as u64);
    }
}

#[inline]
pub fn bool_len(field: u32, v: bool) -> usize {
    if v {
        key_len(field) + 1
    } else {
        0
    }
}

#[inline]
pub fn put_bool(out: &mut Vec<u8>, field: u32, v: bool) {
    if v {
        put_key(out, field, WT_VARINT);
        out.push(1);
    }
}

#[inline]
pub fn double_len(field: u32, v: f64) -> usize {
    if v == 0.0 {
        0
    } else {
        key_len(field) + 8
    }
}

#[inline]
pub fn put_double(out: &mut Vec<u8>, field: u32, v: f64) {
    if v != 0.0 {
        put_key(out, field, WT_I64);
        out.extend_from_slice(&v.to_bits().to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varint_round_trip_and_lengths() {
        for v in [0u64, 1, 127, 128, 300, u32::MAX as u64, u64::MAX] {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            assert_eq!(out.len(), varint_len(v));
            let mut r = Reader::new(&out);
            assert_eq!(r.varint().unwrap(), v);
            assert!(r.is_empty());
        }
    }

    #[test]
    fn overlong_varint_is_an_error() {
        let bytes = [0xffu8; 11];
        let err = Reader::new(&bytes).varint().unwrap_err();
        assert!(matches!(err, Error::MalformedProtobuf { .. }), "{err}");
    }

    #[test]
    fn skip_handles_groups_and_rejects_stray_end_group() {
        // field 7 start-group, field 1 varint 5, field 7 end-group
        let bytes = [0x3b, 0x08, 0x05, 0x3c];
        let mut r = Reader::new(&bytes);
        let (f, wt) = r.key().unwrap();
        r.skip(f, wt).unwrap();
        assert!(r.is_empty());
        let stray = [0x3c];
        let mut r = Reader::new(&stray);
        let (f, wt) = r.key().unwrap();
        assert!(r.skip(f, wt).is_err());
    }
}
