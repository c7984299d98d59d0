//! A message's headers as its row stores them.
//!
//! Since schema 5 a BLOB: for each header, in name order, the name's
//! length, the name, the value's length and the value, each length an
//! unsigned LEB128. Rows written before hold a JSON object as TEXT and are
//! read as before; the column's storage type tells which. Writing and
//! reading JSON was a tenth of the instructions of moving a message from
//! one embedded queue to another (an escape scan and an allocation for
//! every name and value).

use bytes::Bytes;
use ojs_queue::{HeaderName, Headers};
use rusqlite::types::ValueRef;

/// `headers` in the stored form.
pub(crate) fn encode(headers: &Headers) -> Vec<u8> {
    let mut out = Vec::with_capacity(headers.encoded_size() + 2 * headers.len());
    for (name, value) in headers.iter() {
        put_len(&mut out, name.len());
        out.extend_from_slice(name.as_bytes());
        put_len(&mut out, value.len());
        out.extend_from_slice(value.as_bytes());
    }
    out
}

/// The headers of a stored row: the BLOB of [`encode`], or the JSON text
/// of a row from before schema 5. A row edited by hand into something
/// else still delivers its body, without headers, rather than being stuck.
pub(crate) fn decode(stored: ValueRef<'_>) -> Headers {
    match stored {
        ValueRef::Blob(bytes) => decode_blob(bytes).unwrap_or_default(),
        ValueRef::Text(text) => serde_json::from_slice(text).unwrap_or_default(),
        _ => Headers::new(),
    }
}

/// The values are slices of one copy of the BLOB: one allocation for all.
fn decode_blob(stored: &[u8]) -> Option<Headers> {
    let bytes = Bytes::copy_from_slice(stored);
    let mut headers = Headers::new();
    let mut at = 0;
    while at < bytes.len() {
        let name_len = take_len(&bytes, &mut at)?;
        let name = bytes.get(at..at.checked_add(name_len)?)?;
        let name = std::str::from_utf8(name).ok()?;
        at += name_len;
        let value_len = take_len(&bytes, &mut at)?;
        let end = at.checked_add(value_len)?;
        if end > bytes.len() {
            return None;
        }
        headers.insert(HeaderName::new(name), bytes.slice(at..end));
        at = end;
    }
    Some(headers)
}

fn put_len(out: &mut Vec<u8>, mut n: usize) {
    while n >= 0x80 {
        out.push((n as u8 & 0x7f) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

fn take_len(bytes: &[u8], at: &mut usize) -> Option<usize> {
    let mut n: usize = 0;
    for shift in (0..usize::BITS).step_by(7) {
        let b = *bytes.get(*at)?;
        *at += 1;
        n |= usize::from(b & 0x7f).checked_shl(shift)?;
        if b < 0x80 {
            return Some(n);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn headers() -> Headers {
        let mut h = Headers::new();
        h.insert("content-type", "application/openjobspec+json");
        h.insert("ojs-id", "019300000000-7000-8000-000000000000");
        h.insert("x-binary", vec![0u8, 255, 10, 13]);
        h.insert("x-empty", "");
        h.insert("x-long", "v".repeat(300));
        h
    }

    #[test]
    fn headers_read_back_as_written() {
        let h = headers();
        let stored = encode(&h);
        assert_eq!(decode(ValueRef::Blob(&stored)), h);
        assert_eq!(
            decode(ValueRef::Blob(&encode(&Headers::new()))),
            Headers::new()
        );
    }

    #[test]
    fn a_row_of_an_earlier_schema_reads_its_json() {
        let h = headers();
        let json = serde_json::to_string(&h).unwrap();
        assert_eq!(decode(ValueRef::Text(json.as_bytes())), h);
    }

    #[test]
    fn lengths_past_one_byte_read_back() {
        for n in [0, 1, 127, 128, 300, 16_383, 16_384, 1 << 21] {
            let mut out = Vec::new();
            put_len(&mut out, n);
            let mut at = 0;
            assert_eq!(take_len(&out, &mut at), Some(n));
            assert_eq!(at, out.len());
        }
    }

    #[test]
    fn a_damaged_row_delivers_without_headers() {
        let stored = encode(&headers());
        // Cut anywhere inside: never a panic, never a value read past the end.
        for cut in 1..stored.len() {
            let read = decode(ValueRef::Blob(&stored[..cut]));
            assert!(read.len() < headers().len(), "cut at {cut}: {read:?}");
        }
        // A length running past the end, a length that never ends, a name
        // that is no text.
        assert!(decode(ValueRef::Blob(&[5, b'a'])).is_empty());
        assert!(decode(ValueRef::Blob(&[0xff; 12])).is_empty());
        assert!(decode(ValueRef::Blob(&[2, 0xff, 0xfe, 0])).is_empty());
        assert!(decode(ValueRef::Text(b"{not json")).is_empty());
        assert!(decode(ValueRef::Null).is_empty());
    }
}
