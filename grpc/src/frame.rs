//! gRPC message framing (the 5-byte length prefix) and the `grpc-timeout`
//! header.

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};

/// One uncompressed gRPC message frame of `payload`.
pub fn frame(payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + payload.len());
    out.put_u8(0);
    // A protobuf message is at most 2 GiB; larger cannot be a payload.
    out.put_u32(u32::try_from(payload.len()).unwrap_or(u32::MAX));
    out.put_slice(payload);
    out.freeze()
}

/// Why a unary body is not one gRPC message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Fewer than 5 bytes, or fewer than the prefix announces.
    #[error("truncated gRPC frame: {0} bytes")]
    Truncated(usize),
    /// The compressed flag is set (compression is never negotiated here).
    #[error("compressed gRPC frame (no compression was negotiated)")]
    Compressed,
    /// Bytes after the one message of a unary call.
    #[error("{0} bytes after the gRPC message of a unary call")]
    Trailing(usize),
}

/// The message of a unary body: exactly one uncompressed frame. An empty
/// body is an empty message.
pub fn unframe(body: &Bytes) -> Result<Bytes, FrameError> {
    if body.is_empty() {
        return Ok(Bytes::new());
    }
    let Some(header) = body.get(..5) else {
        return Err(FrameError::Truncated(body.len()));
    };
    if header[0] != 0 {
        return Err(FrameError::Compressed);
    }
    let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    let end = 5usize.saturating_add(len);
    if body.len() < end {
        return Err(FrameError::Truncated(body.len()));
    }
    if body.len() > end {
        return Err(FrameError::Trailing(body.len() - end));
    }
    Ok(body.slice(5..end))
}

/// `grpc-timeout` value of `d`: milliseconds, at most 8 digits as the
/// spec allows (longer: seconds, then hours).
pub fn timeout_header(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 100_000_000 {
        format!("{}m", ms.max(1))
    } else if d.as_secs() < 100_000_000 {
        format!("{}S", d.as_secs())
    } else {
        format!("{}H", (d.as_secs() / 3600).min(99_999_999))
    }
}

/// A `grpc-timeout` header value (`<1–8 digits><H|M|S|m|u|n>`).
pub fn parse_timeout(value: &str) -> Option<Duration> {
    let unit = value.chars().last()?;
    let digits = value.get(..value.len() - unit.len_utf8())?;
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        'H' => Duration::from_secs(n * 3600),
        'M' => Duration::from_secs(n * 60),
        'S' => Duration::from_secs(n),
        'm' => Duration::from_millis(n),
        'u' => Duration::from_micros(n),
        'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_bad_frames_are_named() {
        let f = frame(b"abc");
        assert_eq!(&f[..], b"\0\0\0\0\x03abc");
        assert_eq!(unframe(&f).unwrap(), Bytes::from_static(b"abc"));
        assert_eq!(unframe(&Bytes::new()).unwrap(), Bytes::new());
        assert_eq!(unframe(&frame(b"")).unwrap(), Bytes::new());
        assert_eq!(
            unframe(&Bytes::from_static(b"\0\0\0")),
            Err(FrameError::Truncated(3))
        );
        assert_eq!(
            unframe(&Bytes::from_static(b"\0\0\0\0\x05ab")),
            Err(FrameError::Truncated(7))
        );
        assert_eq!(
            unframe(&Bytes::from_static(b"\x01\0\0\0\0")),
            Err(FrameError::Compressed)
        );
        assert_eq!(
            unframe(&Bytes::from_static(b"\0\0\0\0\x01ab")),
            Err(FrameError::Trailing(1))
        );
    }

    #[test]
    fn timeouts_round_trip() {
        for d in [
            Duration::from_millis(1),
            Duration::from_millis(1500),
            Duration::from_secs(200_000),
        ] {
            assert_eq!(parse_timeout(&timeout_header(d)), Some(d));
        }
        assert_eq!(timeout_header(Duration::ZERO), "1m");
        assert_eq!(parse_timeout("10S"), Some(Duration::from_secs(10)));
        assert_eq!(parse_timeout("5u"), Some(Duration::from_micros(5)));
        for bad in ["", "m", "123456789m", "1x", "-1m", "1.5S"] {
            assert_eq!(parse_timeout(bad), None, "{bad}");
        }
    }
}
