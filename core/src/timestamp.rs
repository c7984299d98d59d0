//! RFC 3339 timestamps as the envelope and the OJS bindings write them: the
//! text chrono's `to_rfc3339_opts(format, true)` writes, built with a few
//! digit writes. chrono goes through its general formatter (an item list,
//! `fmt` calls per field), which was a thirtieth of the instructions of a
//! FETCH + ACK: every envelope the store keeps and every job an answer
//! carries holds several timestamps.

use chrono::{DateTime, Datelike, SecondsFormat, Timelike, Utc};

/// `t` in RFC 3339, UTC with `Z`, its fraction as `format` says
/// (`Millis`: always three digits; `AutoSi`: none, 3, 6 or 9 digits, as
/// few as hold it exactly). Years outside 0–9999, leap seconds and the
/// other formats go to chrono.
pub fn rfc3339(t: &DateTime<Utc>, format: SecondsFormat) -> String {
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
        _ => return t.to_rfc3339_opts(format, true),
    };
    if !(0..=9999).contains(&year) || nanos >= 1_000_000_000 {
        return t.to_rfc3339_opts(format, true);
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
    // Every byte is an ASCII digit or separator, so this never falls back.
    std::str::from_utf8(&out[..=end])
        .map_or_else(|_| t.to_rfc3339_opts(format, true), str::to_owned)
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

    proptest! {
        #[test]
        fn the_text_is_chronos(secs in -62_167_219_200i64..253_402_300_799, nanos in 0u32..1_000_000_000, round in 0u8..4) {
            // As many whole millis and micros as arbitrary nanos.
            let nanos = match round {
                0 => nanos,
                1 => nanos / 1_000 * 1_000,
                2 => nanos / 1_000_000 * 1_000_000,
                _ => 0,
            };
            both(DateTime::from_timestamp(secs, nanos).unwrap());
        }
    }
}
