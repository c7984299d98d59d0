//! Compact JSON written straight into a byte vector: the text
//! `serde_json::to_vec` writes, byte for byte, for any `Serialize` value.
//!
//! serde_json looks at every byte of every string for a character to
//! escape, one at a time (a table lookup and a branch each): ids,
//! timestamps, names and keys, some ninety strings in the JSON of one job
//! fetched and acknowledged, which was about a twentieth of the daemon's
//! instructions. This writer looks at eight bytes at a time and copies a
//! string that needs no escape (nearly all of them) in one piece; one that
//! does is escaped exactly as serde_json escapes it. Numbers are written
//! as serde_json writes them (`itoa`; floats through serde_json itself).

use serde::ser::{self, Impossible, Serialize};

/// The error of a value that cannot be written (as serde_json says it).
pub type Error = serde_json::Error;

/// `value` as compact JSON, appended to `out`. On an error `out` may hold
/// part of the value.
pub fn write<T: ?Sized + Serialize>(out: &mut Vec<u8>, value: &T) -> Result<(), Error> {
    value.serialize(&mut Writer { out })
}

/// `value` as compact JSON bytes.
pub fn to_vec<T: ?Sized + Serialize>(value: &T) -> Result<Vec<u8>, Error> {
    let mut out = Vec::with_capacity(128);
    write(&mut out, value)?;
    Ok(out)
}

/// `value` as compact JSON text.
pub fn to_string<T: ?Sized + Serialize>(value: &T) -> Result<String, Error> {
    // Every byte written is ASCII punctuation, digits, or a whole UTF-8
    // string copied or escaped character by character.
    String::from_utf8(to_vec(value)?).map_err(|e| ser::Error::custom(e.to_string()))
}

/// A JSON object written entry by entry straight into a byte vector, by a
/// writer that knows its keys where it is compiled: each such key comes as
/// its JSON text with the colon after it (`"id":`) and is copied whole,
/// where a key given to a serializer is looked at for characters to escape
/// each time (an envelope's dozen keys, several times a job). The text is
/// what [`write`] writes of a map with the same entries.
#[derive(Debug)]
pub struct Object<'o> {
    out: &'o mut Vec<u8>,
    first: bool,
}

impl<'o> Object<'o> {
    /// Opens an object at the end of `out`.
    pub fn open(out: &'o mut Vec<u8>) -> Object<'o> {
        out.push(b'{');
        Object { out, first: true }
    }

    fn comma(&mut self) {
        if self.first {
            self.first = false;
        } else {
            self.out.push(b',');
        }
    }

    /// Starts an entry whose key is given as its JSON text and a colon
    /// (`"id":`): a key of plain ASCII letters, digits and `_`, made by
    /// the caller's code, never by its input.
    pub fn key_text(&mut self, text: &'static str) {
        self.comma();
        self.out.extend_from_slice(text.as_bytes());
    }

    /// Starts an entry of any key, escaped as needed.
    pub fn key(&mut self, key: &str) {
        self.comma();
        write_str(self.out, key);
        self.out.push(b':');
    }

    /// The value of the entry started last.
    pub fn value<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<(), Error> {
        value.serialize(&mut Writer { out: self.out })
    }

    /// A string value of the entry started last.
    pub fn str_value(&mut self, value: &str) {
        write_str(self.out, value);
    }

    /// A string value of the entry started last given as bytes that should
    /// all be printable ASCII needing no escape (a time's digits and
    /// separators): copied between quotes once checked a word at a time.
    /// Any other bytes are written as a string of their text (invalid
    /// UTF-8 replaced), escaped as needed.
    pub fn ascii_value(&mut self, value: &[u8]) {
        if value.is_ascii() && is_clean(value) {
            self.out.reserve(value.len() + 2);
            self.out.push(b'"');
            self.out.extend_from_slice(value);
            self.out.push(b'"');
        } else {
            write_str(self.out, &String::from_utf8_lossy(value));
        }
    }

    /// A time value of the entry started last, as RFC 3339 text in
    /// `format` (its digits copied, no `String` of it).
    pub fn time_value(&mut self, t: &chrono::DateTime<chrono::Utc>, format: chrono::SecondsFormat) {
        crate::timestamp::with_rfc3339_ascii(t, format, |text| self.ascii_value(text));
    }

    /// The bytes written so far, for a value of the entry started last
    /// that the caller writes itself, whole and valid JSON.
    pub fn raw_value(&mut self) -> &mut Vec<u8> {
        self.out
    }

    /// Closes the object.
    pub fn close(self) {
        self.out.push(b'}');
    }
}

/// `s` as a JSON string (quotes included), escaped as serde_json does.
pub fn write_str(out: &mut Vec<u8>, s: &str) {
    out.reserve(s.len() + 2);
    out.push(b'"');
    let bytes = s.as_bytes();
    let clean = clean_prefix(bytes);
    out.extend_from_slice(&bytes[..clean]);
    if clean < bytes.len() {
        escape_rest(out, &bytes[clean..]);
    }
    out.push(b'"');
}

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGHS: u64 = 0x8080_8080_8080_8080;

/// Whether a byte of `w` may need escaping: below 0x20, `"` or `\`. A
/// byte that does is always found; a false alarm only sends the word to
/// the byte-by-byte check.
#[inline]
fn word_needs_escape(w: u64) -> bool {
    let below_space = w.wrapping_sub(ONES * 0x20) & !w;
    let quote = w ^ (ONES * u64::from(b'"'));
    let backslash = w ^ (ONES * u64::from(b'\\'));
    let zero_in = |x: u64| x.wrapping_sub(ONES) & !x;
    (below_space | zero_in(quote) | zero_in(backslash)) & HIGHS != 0
}

/// Whether no byte of `bytes` needs an escape.
fn is_clean(bytes: &[u8]) -> bool {
    clean_prefix(bytes) == bytes.len()
}

/// How many bytes at the start of `bytes` need no escape.
#[inline]
fn clean_prefix(bytes: &[u8]) -> usize {
    let mut at = 0;
    while let Some(chunk) = bytes.get(at..at + 8) {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        if word_needs_escape(u64::from_le_bytes(word)) {
            break;
        }
        at += 8;
    }
    while let Some(&b) = bytes.get(at) {
        if ESCAPE[usize::from(b)] != 0 {
            break;
        }
        at += 1;
    }
    at
}

const HEX: &[u8; 16] = b"0123456789abcdef";
const BB: u8 = b'b';
const TT: u8 = b't';
const NN: u8 = b'n';
const FF: u8 = b'f';
const RR: u8 = b'r';
const QU: u8 = b'"';
const BS: u8 = b'\\';
const UU: u8 = b'u';
#[allow(clippy::just_underscores_and_digits)] // The table reads as serde_json's.
const __: u8 = 0;

/// serde_json's escape table: what follows the backslash of each byte
/// that needs one (`u`: `\u00XX`), 0 for one written as it is.
static ESCAPE: [u8; 256] = [
    //   1   2   3   4   5   6   7   8   9   A   B   C   D   E   F
    UU, UU, UU, UU, UU, UU, UU, UU, BB, TT, NN, UU, FF, RR, UU, UU, // 0
    UU, UU, UU, UU, UU, UU, UU, UU, UU, UU, UU, UU, UU, UU, UU, UU, // 1
    __, __, QU, __, __, __, __, __, __, __, __, __, __, __, __, __, // 2
    __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, // 3
    __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, // 4
    __, __, __, __, __, __, __, __, __, __, __, __, BS, __, __, __, // 5
    __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, // 6
    __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, // 7
    __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, // 8
    __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, // 9
    __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, // A
    __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, // B
    __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, // C
    __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, // D
    __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, // E
    __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, __, // F
];

/// `bytes` (which starts with a byte to escape) escaped, byte by byte.
#[cold]
fn escape_rest(out: &mut Vec<u8>, bytes: &[u8]) {
    for &b in bytes {
        match ESCAPE[usize::from(b)] {
            0 => out.push(b),
            UU => out.extend_from_slice(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[usize::from(b >> 4)],
                HEX[usize::from(b & 0xF)],
            ]),
            e => out.extend_from_slice(&[b'\\', e]),
        }
    }
}

fn write_int(out: &mut Vec<u8>, n: impl itoa::Integer) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// A float as serde_json writes it (`null` when not finite).
fn write_float<F: Serialize>(out: &mut Vec<u8>, f: F) -> Result<(), Error> {
    serde_json::to_writer(out, &f)
}

/// The ten integer methods of a serializer, each `$body` with `$w` the
/// serializer and `$v` the value.
macro_rules! integers {
    (|$w:ident: Self, $v:ident| $body:expr) => {
        integers!(@each $w $v $body;
            serialize_i8: i8, serialize_i16: i16, serialize_i32: i32,
            serialize_i64: i64, serialize_i128: i128, serialize_u8: u8,
            serialize_u16: u16, serialize_u32: u32, serialize_u64: u64,
            serialize_u128: u128);
    };
    (@each $w:ident $v:ident $body:expr; $($name:ident: $t:ty),*) => {
        $(
            fn $name(self, $v: $t) -> Result<(), Error> {
                let $w = self;
                $body
            }
        )*
    };
}

/// The serializer: every value appends its text to `out`.
struct Writer<'o> {
    out: &'o mut Vec<u8>,
}

/// A sequence or map being written: whether an element came yet (the next
/// one is preceded by a comma), and what closes it.
struct Compound<'w, 'o> {
    w: &'w mut Writer<'o>,
    first: bool,
}

impl<'w, 'o> Compound<'w, 'o> {
    fn open(w: &'w mut Writer<'o>, open: u8) -> Compound<'w, 'o> {
        w.out.push(open);
        Compound { w, first: true }
    }

    fn comma(&mut self) {
        if self.first {
            self.first = false;
        } else {
            self.w.out.push(b',');
        }
    }

    fn element<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<(), Error> {
        self.comma();
        value.serialize(&mut *self.w)
    }

    fn key<T: ?Sized + Serialize>(&mut self, key: &T) -> Result<(), Error> {
        self.comma();
        key.serialize(MapKey(&mut *self.w))
    }

    fn value<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<(), Error> {
        self.w.out.push(b':');
        value.serialize(&mut *self.w)
    }

    fn field<T: ?Sized + Serialize>(&mut self, key: &str, value: &T) -> Result<(), Error> {
        self.comma();
        write_str(self.w.out, key);
        self.value(value)
    }

    fn close(self, close: &[u8]) {
        self.w.out.extend_from_slice(close);
    }
}

impl<'w, 'o> ser::Serializer for &'w mut Writer<'o> {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = Compound<'w, 'o>;
    type SerializeTuple = Compound<'w, 'o>;
    type SerializeTupleStruct = Compound<'w, 'o>;
    type SerializeTupleVariant = Compound<'w, 'o>;
    type SerializeMap = Compound<'w, 'o>;
    type SerializeStruct = Compound<'w, 'o>;
    type SerializeStructVariant = Compound<'w, 'o>;

    fn serialize_bool(self, v: bool) -> Result<(), Error> {
        self.out
            .extend_from_slice(if v { b"true" as &[u8] } else { b"false" });
        Ok(())
    }
    integers!(|w: Self, v| {
        write_int(w.out, v);
        Ok(())
    });
    fn serialize_f32(self, v: f32) -> Result<(), Error> {
        write_float(self.out, v)
    }
    fn serialize_f64(self, v: f64) -> Result<(), Error> {
        write_float(self.out, v)
    }
    fn serialize_char(self, v: char) -> Result<(), Error> {
        write_str(self.out, v.encode_utf8(&mut [0; 4]));
        Ok(())
    }
    fn serialize_str(self, v: &str) -> Result<(), Error> {
        write_str(self.out, v);
        Ok(())
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<(), Error> {
        let mut seq = Compound::open(self, b'[');
        for b in v {
            seq.element(b)?;
        }
        seq.close(b"]");
        Ok(())
    }
    fn serialize_none(self) -> Result<(), Error> {
        self.serialize_unit()
    }
    fn serialize_some<T: ?Sized + Serialize>(self, value: &T) -> Result<(), Error> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), Error> {
        self.out.extend_from_slice(b"null");
        Ok(())
    }
    fn serialize_unit_struct(self, _name: &'static str) -> Result<(), Error> {
        self.serialize_unit()
    }
    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
    ) -> Result<(), Error> {
        self.serialize_str(variant)
    }
    fn serialize_newtype_struct<T: ?Sized + Serialize>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: ?Sized + Serialize>(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        let mut map = Compound::open(self, b'{');
        map.field(variant, value)?;
        map.close(b"}");
        Ok(())
    }
    fn serialize_seq(self, _len: Option<usize>) -> Result<Compound<'w, 'o>, Error> {
        Ok(Compound::open(self, b'['))
    }
    fn serialize_tuple(self, len: usize) -> Result<Compound<'w, 'o>, Error> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_struct(
        self,
        _name: &'static str,
        len: usize,
    ) -> Result<Compound<'w, 'o>, Error> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Compound<'w, 'o>, Error> {
        self.out.push(b'{');
        write_str(self.out, variant);
        self.out.push(b':');
        Ok(Compound::open(self, b'['))
    }
    fn serialize_map(self, _len: Option<usize>) -> Result<Compound<'w, 'o>, Error> {
        Ok(Compound::open(self, b'{'))
    }
    fn serialize_struct(self, _name: &'static str, len: usize) -> Result<Compound<'w, 'o>, Error> {
        self.serialize_map(Some(len))
    }
    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Compound<'w, 'o>, Error> {
        self.out.push(b'{');
        write_str(self.out, variant);
        self.out.push(b':');
        Ok(Compound::open(self, b'{'))
    }
}

/// The sequence-like compounds: elements, then `]`.
macro_rules! sequence {
    ($($trait:ident::$method:ident),*) => {
        $(
            impl ser::$trait for Compound<'_, '_> {
                type Ok = ();
                type Error = Error;
                fn $method<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<(), Error> {
                    self.element(value)
                }
                fn end(self) -> Result<(), Error> {
                    self.close(b"]");
                    Ok(())
                }
            }
        )*
    };
}

sequence!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field
);

impl ser::SerializeTupleVariant for Compound<'_, '_> {
    type Ok = ();
    type Error = Error;
    fn serialize_field<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<(), Error> {
        self.element(value)
    }
    fn end(self) -> Result<(), Error> {
        self.close(b"]}");
        Ok(())
    }
}

impl ser::SerializeMap for Compound<'_, '_> {
    type Ok = ();
    type Error = Error;
    fn serialize_key<T: ?Sized + Serialize>(&mut self, key: &T) -> Result<(), Error> {
        self.key(key)
    }
    fn serialize_value<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<(), Error> {
        self.value(value)
    }
    fn end(self) -> Result<(), Error> {
        self.close(b"}");
        Ok(())
    }
}

/// The struct-like compounds: fields, then what closes them.
macro_rules! structure {
    ($($trait:ident: $close:expr),*) => {
        $(
            impl ser::$trait for Compound<'_, '_> {
                type Ok = ();
                type Error = Error;
                fn serialize_field<T: ?Sized + Serialize>(
                    &mut self,
                    key: &'static str,
                    value: &T,
                ) -> Result<(), Error> {
                    self.field(key, value)
                }
                fn end(self) -> Result<(), Error> {
                    self.close($close);
                    Ok(())
                }
            }
        )*
    };
}

structure!(SerializeStruct: b"}", SerializeStructVariant: b"}}");

/// A map's key: a string, or a number or `true`/`false` written as one, as
/// serde_json writes keys; anything else is the error serde_json gives.
struct MapKey<'w, 'o>(&'w mut Writer<'o>);

impl MapKey<'_, '_> {
    fn quoted_int(self, n: impl itoa::Integer) -> Result<(), Error> {
        self.0.out.push(b'"');
        write_int(self.0.out, n);
        self.0.out.push(b'"');
        Ok(())
    }

    fn quoted_float<F: Serialize + Copy>(self, f: F, finite: bool) -> Result<(), Error> {
        if !finite {
            return Err(ser::Error::custom("float key must be finite"));
        }
        self.0.out.push(b'"');
        write_float(self.0.out, f)?;
        self.0.out.push(b'"');
        Ok(())
    }
}

fn key_must_be_a_string() -> Error {
    ser::Error::custom("key must be a string")
}

impl ser::Serializer for MapKey<'_, '_> {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = Impossible<(), Error>;
    type SerializeTuple = Impossible<(), Error>;
    type SerializeTupleStruct = Impossible<(), Error>;
    type SerializeTupleVariant = Impossible<(), Error>;
    type SerializeMap = Impossible<(), Error>;
    type SerializeStruct = Impossible<(), Error>;
    type SerializeStructVariant = Impossible<(), Error>;

    fn serialize_str(self, v: &str) -> Result<(), Error> {
        write_str(self.0.out, v);
        Ok(())
    }
    fn serialize_char(self, v: char) -> Result<(), Error> {
        write_str(self.0.out, v.encode_utf8(&mut [0; 4]));
        Ok(())
    }
    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
    ) -> Result<(), Error> {
        self.serialize_str(variant)
    }
    fn serialize_newtype_struct<T: ?Sized + Serialize>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        value.serialize(self)
    }
    fn serialize_bool(self, v: bool) -> Result<(), Error> {
        self.0.out.extend_from_slice(if v {
            b"\"true\"" as &[u8]
        } else {
            b"\"false\""
        });
        Ok(())
    }
    integers!(|k: Self, v| k.quoted_int(v));
    fn serialize_f32(self, v: f32) -> Result<(), Error> {
        self.quoted_float(v, v.is_finite())
    }
    fn serialize_f64(self, v: f64) -> Result<(), Error> {
        self.quoted_float(v, v.is_finite())
    }
    fn serialize_bytes(self, _v: &[u8]) -> Result<(), Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_none(self) -> Result<(), Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_some<T: ?Sized + Serialize>(self, _value: &T) -> Result<(), Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_unit(self) -> Result<(), Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_unit_struct(self, _name: &'static str) -> Result<(), Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_newtype_variant<T: ?Sized + Serialize>(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
        _value: &T,
    ) -> Result<(), Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_seq(self, _len: Option<usize>) -> Result<Self::SerializeSeq, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_tuple(self, _len: usize) -> Result<Self::SerializeTuple, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_tuple_struct(
        self,
        _name: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeTupleStruct, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeTupleVariant, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_map(self, _len: Option<usize>) -> Result<Self::SerializeMap, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_struct(
        self,
        _name: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeStruct, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeStructVariant, Error> {
        Err(key_must_be_a_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{json, Value};
    use std::collections::BTreeMap;

    fn same<T: Serialize + std::fmt::Debug>(value: &T) {
        let ours = to_vec(value).expect("ours writes it");
        let theirs = serde_json::to_vec(value).expect("serde_json writes it");
        assert_eq!(
            String::from_utf8_lossy(&ours),
            String::from_utf8_lossy(&theirs),
            "{value:?}"
        );
    }

    #[test]
    fn every_byte_is_escaped_as_serde_json_escapes_it() {
        // Each byte alone, and at each place of a word (the eight-byte
        // check must find it wherever it is).
        for b in 0u8..0x80 {
            let c = char::from(b);
            same(&c.to_string());
            for at in 0..17 {
                let mut s: String = "a".repeat(17);
                s.replace_range(at..=at, &c.to_string());
                same(&s);
            }
        }
        for s in [
            "",
            "é",
            "日本語",
            "\u{7f}",
            "a\u{2028}b",
            "tab\there",
            "x\"y\\z",
        ] {
            same(&s);
        }
    }

    /// Bytes given as plain ASCII are a JSON string of their text whatever
    /// they are: copied when they are plain, escaped when not, invalid
    /// UTF-8 replaced.
    #[test]
    fn an_ascii_value_is_the_string_of_its_text() {
        let cases: [&[u8]; 7] = [
            b"2026-12-06T23:59:59.123Z",
            b"",
            b"a\"b",
            b"tab\there\\",
            b"\x01\x1f",
            "\u{e9}t\u{e9}".as_bytes(),
            b"\xff\xfeok",
        ];
        for bytes in cases {
            let mut out = Vec::new();
            let mut object = Object::open(&mut out);
            object.key("k");
            object.ascii_value(bytes);
            object.close();
            let text = String::from_utf8_lossy(bytes).into_owned();
            let theirs = serde_json::to_vec(&serde_json::json!({ "k": text }))
                .expect("serde_json writes it");
            assert_eq!(
                String::from_utf8_lossy(&out),
                String::from_utf8_lossy(&theirs),
                "{bytes:?}"
            );
        }
    }

    #[test]
    fn the_word_check_never_misses_a_byte_to_escape() {
        for b in 0u8..=255 {
            let needs = ESCAPE[usize::from(b)] != 0;
            for at in 0..8 {
                for fill in [b'a', 0x80, 0xFF, 0x1F, b' '] {
                    let mut w = [fill; 8];
                    w[at] = b;
                    let flagged = word_needs_escape(u64::from_le_bytes(w));
                    if needs || w.iter().any(|&x| ESCAPE[usize::from(x)] != 0) {
                        assert!(flagged, "{w:?} (byte {b:#x} at {at})");
                    }
                }
            }
        }
    }

    #[derive(Debug, serde::Serialize)]
    enum Shape {
        Unit,
        Newtype(u8),
        Tuple(i32, String),
        Struct { a: Option<bool>, b: Vec<f64> },
    }

    #[derive(Debug, serde::Serialize)]
    struct Everything {
        unit: (),
        none: Option<u8>,
        some: Option<&'static str>,
        ints: (i8, i16, i32, i64, i128, u8, u16, u32, u64, u128),
        floats: (f32, f64, f64, f64, f64),
        ch: char,
        #[serde(with = "serde_bytes_as_slice")]
        bytes: Vec<u8>,
        shapes: Vec<Shape>,
        map: BTreeMap<String, Value>,
        int_keys: BTreeMap<i64, bool>,
        bool_keys: BTreeMap<bool, u8>,
        #[serde(skip_serializing_if = "Option::is_none")]
        skipped: Option<u8>,
        empty: (Vec<u8>, BTreeMap<String, u8>),
    }

    mod serde_bytes_as_slice {
        pub fn serialize<S: serde::Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(v)
        }
    }

    #[test]
    fn every_kind_of_value_is_written_as_serde_json_writes_it() {
        same(&Everything {
            unit: (),
            none: None,
            some: Some("some"),
            ints: (
                i8::MIN,
                -300,
                i32::MAX,
                i64::MIN,
                i128::MIN,
                255,
                u16::MAX,
                7,
                u64::MAX,
                u128::MAX,
            ),
            floats: (1.5, 2.0, -0.0, f64::NAN, 1e300),
            ch: '"',
            bytes: vec![0, 1, 255],
            shapes: vec![
                Shape::Unit,
                Shape::Newtype(9),
                Shape::Tuple(-1, "t\n".into()),
                Shape::Struct {
                    a: None,
                    b: vec![0.1, f64::INFINITY],
                },
            ],
            map: [
                ("k\u{1}".to_owned(), json!({"a": [1, 2.5, null, true]})),
                ("".to_owned(), json!("v")),
            ]
            .into_iter()
            .collect(),
            int_keys: [(-5, true), (i64::MAX, false)].into_iter().collect(),
            bool_keys: [(true, 1), (false, 0)].into_iter().collect(),
            skipped: None,
            empty: (Vec::new(), BTreeMap::new()),
        });
    }

    #[test]
    fn keys_serde_json_refuses_are_refused() {
        let mut unit_keys = BTreeMap::new();
        unit_keys.insert((), 1);
        assert!(serde_json::to_vec(&unit_keys).is_err());
        assert!(to_vec(&unit_keys).is_err());
        let mut nan_keys = std::collections::HashMap::new();
        nan_keys.insert(FloatKey(f64::NAN), 1);
        assert!(serde_json::to_vec(&nan_keys).is_err());
        assert!(to_vec(&nan_keys).is_err());
        let mut float_keys = std::collections::HashMap::new();
        float_keys.insert(FloatKey(2.5), 1);
        same(&float_keys);
    }

    #[derive(Debug, PartialEq)]
    struct FloatKey(f64);
    impl Eq for FloatKey {}
    impl std::hash::Hash for FloatKey {
        fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
            self.0.to_bits().hash(h);
        }
    }
    impl Serialize for FloatKey {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_f64(self.0)
        }
    }

    fn value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            any::<u64>().prop_map(|n| json!(n)),
            any::<f64>().prop_map(|f| json!(f)),
            any::<String>().prop_map(Value::String),
            "[\\x00-\\x7f]{0,40}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 64, 8, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
                prop::collection::btree_map(any::<String>(), inner, 0..8)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn any_json_value_is_written_as_serde_json_writes_it(v in value()) {
            same(&v);
        }

        #[test]
        fn any_string_is_written_as_serde_json_writes_it(s in any::<String>(), ascii in "[\\x00-\\x7f]{0,64}") {
            same(&s);
            same(&ascii);
        }
    }
}
