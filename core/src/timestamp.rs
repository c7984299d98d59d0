//! RFC 3339 timestamps as the envelope and the OJS bindings write them: the
//! text chrono's `to_rfc3339_opts(format, true)` writes, built with a few
//! digit writes. chrono goes through its general formatter (an item list,
//! `fmt` calls per field), which was a thirtieth of the instructions of a
//! FETCH + ACK: every envelope the store keeps and every job an answer
//! carries holds several timestamps. Reading is the same: the shape this
//! module writes is read digit by digit, and any other text goes to chrono.

use chrono::{DateTime, Datelike, NaiveDate, SecondsFormat, Timelike, Utc};

/// `t` in RFC 3339, UTC with `Z`, its fraction as `format` says
/// (`Millis`: always three digits; `AutoSi`: none, 3, 6 or 9 digits, as
/// few as hold it exactly). Years outside 0–9999, leap seconds and the
/// other formats go to chrono.
pub fn rfc3339(t: &DateTime<Utc>, format: SecondsFormat) -> String {
    with_rfc3339(t, format, str::to_owned)
}

/// [`rfc3339`]'s text handed to `f` where it was written, on the stack: a
/// writer of many timestamps (every envelope the store keeps, every job an
/// answer carries) skips making a `String` of each.
pub fn with_rfc3339<R>(t: &DateTime<Utc>, format: SecondsFormat, f: impl FnOnce(&str) -> R) -> R {
    with_rfc3339_ascii(t, format, |text| match std::str::from_utf8(text) {
        Ok(text) => f(text),
        // Every byte is an ASCII digit or separator, so this never happens.
        Err(_) => f(&t.to_rfc3339_opts(format, true)),
    })
}

/// [`with_rfc3339`]'s text as its bytes, every one an ASCII digit or
/// separator: a writer of bytes (a JSON writer) copies them as they are,
/// where the text would be checked for UTF-8 first and for characters to
/// escape after.
pub fn with_rfc3339_ascii<R>(
    t: &DateTime<Utc>,
    format: SecondsFormat,
    f: impl FnOnce(&[u8]) -> R,
) -> R {
    // The accessors of `DateTime` convert to local time on each call; the
    // naive date and time are that once.
    let naive = t.naive_utc();
    let (date, time) = (naive.date(), naive.time());
    let nanos = time.nanosecond();
    let year = date.year();
    let digits = match format {
        SecondsFormat::Millis => 3,
        SecondsFormat::AutoSi if nanos == 0 => 0,
        SecondsFormat::AutoSi if nanos % 1_000_000 == 0 => 3,
        SecondsFormat::AutoSi if nanos % 1_000 == 0 => 6,
        SecondsFormat::AutoSi => 9,
        _ => return f(t.to_rfc3339_opts(format, true).as_bytes()),
    };
    if !(0..=9999).contains(&year) || nanos >= 1_000_000_000 {
        return f(t.to_rfc3339_opts(format, true).as_bytes());
    }
    let mut out = *b"0000-00-00T00:00:00.000000000Z";
    write_digits(&mut out[0..4], year as u32);
    write_digits(&mut out[5..7], date.month());
    write_digits(&mut out[8..10], date.day());
    write_digits(&mut out[11..13], time.hour());
    write_digits(&mut out[14..16], time.minute());
    write_digits(&mut out[17..19], time.second());
    let end = if digits == 0 {
        19
    } else {
        write_digits(
            &mut out[20..20 + digits],
            nanos / 10u32.pow(9 - digits as u32),
        );
        20 + digits
    };
    out[end] = b'Z';
    f(&out[..=end])
}

/// `s` read as [`rfc3339`] writes it — `YYYY-MM-DDTHH:MM:SS`, a fraction
/// of one to nine digits or none, then `Z` — into the instant chrono's
/// `DateTime::parse_from_rfc3339` reads from the same text. `None` for any
/// other text, valid or not (offsets, a lower-case `z`, a leap second, more
/// fraction digits, a day the month lacks): the caller asks chrono, which
/// reads it or says why not.
pub fn parse_rfc3339(s: &str) -> Option<DateTime<Utc>> {
    let b = s.as_bytes();
    if b.len() < 20 || b[b.len() - 1] != b'Z' {
        return None;
    }
    let separators = [(4, b'-'), (7, b'-'), (10, b'T'), (13, b':'), (16, b':')];
    if separators.iter().any(|&(i, c)| b[i] != c) {
        return None;
    }
    let year = read_digits(&b[0..4])?;
    let month = read_digits(&b[5..7])?;
    let day = read_digits(&b[8..10])?;
    let hour = read_digits(&b[11..13])?;
    let minute = read_digits(&b[14..16])?;
    let second = read_digits(&b[17..19])?;
    let nanos = match &b[19..b.len() - 1] {
        [] => 0,
        [b'.', fraction @ ..] if (1..=9).contains(&fraction.len()) => {
            read_digits(fraction)? * 10u32.pow(9 - fraction.len() as u32)
        }
        _ => return None,
    };
    // chrono reads a second of 60 as a leap second; that text goes to it.
    if second > 59 {
        return None;
    }
    let date = NaiveDate::from_ymd_opt(i32::try_from(year).ok()?, month, day)?;
    Some(
        date.and_hms_nano_opt(hour, minute, second, nanos)?
            .and_utc(),
    )
}

/// The number `digits` spell, each an ASCII digit (at most nine).
fn read_digits(digits: &[u8]) -> Option<u32> {
    digits.iter().try_fold(0u32, |n, &d| {
        d.is_ascii_digit().then(|| n * 10 + u32::from(d - b'0'))
    })
}

/// `n`'s last `slot.len()` decimal digits into `slot`, zero-padded.
fn write_digits(slot: &mut [u8], mut n: u32) {
    for byte in slot.iter_mut().rev() {
        *byte = b'0' + (n % 10) as u8;
        n /= 10;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;
    use proptest::prelude::*;

    fn both(t: DateTime<Utc>) {
        for format in [SecondsFormat::Millis, SecondsFormat::AutoSi] {
            assert_eq!(
                rfc3339(&t, format),
                t.to_rfc3339_opts(format, true),
                "{t:?}"
            );
        }
    }

    #[test]
    fn the_text_is_chronos_at_the_edges() {
        let day = Utc.with_ymd_and_hms(2026, 11, 29, 7, 5, 9).unwrap();
        for nanos in [
            0,
            1,
            999,
            1_000,
            1_001,
            999_000,
            1_000_000,
            120_000_000,
            999_999_999,
        ] {
            both(day + chrono::Duration::nanoseconds(nanos));
        }
        both(Utc.with_ymd_and_hms(0, 1, 1, 0, 0, 0).unwrap());
        both(Utc.with_ymd_and_hms(9999, 12, 31, 23, 59, 59).unwrap());
        // chrono's own text outside the four-digit years.
        both(Utc.with_ymd_and_hms(10000, 1, 1, 0, 0, 0).unwrap());
        both(Utc.with_ymd_and_hms(-1, 1, 1, 0, 0, 0).unwrap());
        // A leap second.
        let leap = chrono::NaiveDate::from_ymd_opt(2016, 12, 31)
            .and_then(|d| d.and_hms_nano_opt(23, 59, 59, 1_500_000_000))
            .unwrap()
            .and_utc();
        both(leap);
    }

    /// `text` read here is what chrono reads, wherever this reads it at all.
    fn read_as_chrono(text: &str) -> Option<DateTime<Utc>> {
        let ours = parse_rfc3339(text);
        if let Some(t) = ours {
            let chronos = DateTime::parse_from_rfc3339(text).map(|t| t.with_timezone(&Utc));
            assert_eq!(chronos, Ok(t), "{text}");
        }
        ours
    }

    #[test]
    fn reads_what_it_writes_and_leaves_the_rest_to_chrono() {
        for text in [
            "2026-11-30T03:04:05Z",
            "2026-11-30T03:04:05.1Z",
            "2026-11-30T03:04:05.120Z",
            "2026-11-30T03:04:05.123456789Z",
            "2024-02-29T23:59:59.999999999Z",
            "0000-01-01T00:00:00Z",
            "9999-12-31T23:59:59Z",
        ] {
            assert!(read_as_chrono(text).is_some(), "{text}");
        }
        // Valid RFC 3339 that chrono reads, and text that is not: neither
        // is read here.
        for text in [
            "2026-11-30T03:04:05z",
            "2026-11-30t03:04:05Z",
            "2026-11-30 03:04:05Z",
            "2026-11-30T03:04:05+00:00",
            "2026-11-30T03:04:05.1234567891Z",
            "2016-12-31T23:59:60Z",
            "2026-11-30T03:04:05.Z",
            "2025-02-29T00:00:00Z",
            "2026-13-01T00:00:00Z",
            "2026-00-01T00:00:00Z",
            "2026-11-31T00:00:00Z",
            "2026-11-30T24:00:00Z",
            "2026-11-30T23:60:00Z",
            "2026-11-30T03:04:05",
            "2026-11-30T03:04:0aZ",
            "+2026-11-30T03:04:05Z",
            "2026-11-30T03:04:05.-1Z",
            "",
        ] {
            assert_eq!(read_as_chrono(text), None, "{text}");
        }
    }

    /// As many whole millis and micros as arbitrary nanos: `nanos` as it
    /// is, to the micro, to the milli or none, as `round` says.
    fn rounded(nanos: u32, round: u8) -> u32 {
        match round {
            0 => nanos,
            1 => nanos / 1_000 * 1_000,
            2 => nanos / 1_000_000 * 1_000_000,
            _ => 0,
        }
    }

    proptest! {
        #[test]
        fn reads_every_text_it_writes(secs in -62_167_219_200i64..253_402_300_799, nanos in 0u32..1_000_000_000, round in 0u8..4) {
            let nanos = rounded(nanos, round);
            let t = DateTime::from_timestamp(secs, nanos).unwrap();
            prop_assert_eq!(read_as_chrono(&rfc3339(&t, SecondsFormat::AutoSi)), Some(t));
            // Whole milliseconds: read as chrono reads them (checked inside).
            prop_assert!(read_as_chrono(&rfc3339(&t, SecondsFormat::Millis)).is_some());
        }

        #[test]
        fn reads_nothing_chrono_reads_otherwise(text in "[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\\.[0-9]{0,11})?(Z|z|[+-][0-9]{2}:[0-9]{2})?") {
            read_as_chrono(&text);
        }

        #[test]
        fn the_text_is_chronos(secs in -62_167_219_200i64..253_402_300_799, nanos in 0u32..1_000_000_000, round in 0u8..4) {
            let nanos = rounded(nanos, round);
            both(DateTime::from_timestamp(secs, nanos).unwrap());
        }
    }
}
