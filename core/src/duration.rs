//! ISO 8601 durations as OJS uses them (`PT1S`, `PT5M`, `P1DT2H`).
//!
//! Years and months have no fixed length, so they are rejected rather than
//! guessed; weeks, days, hours, minutes and (fractional) seconds are accepted.

use std::time::Duration;

/// Parses an ISO 8601 duration; the error says what is wrong.
pub fn parse_iso8601_duration(s: &str) -> Result<Duration, String> {
    let bad = |why: &str| format!("{s:?} is not an ISO 8601 duration: {why}");
    let rest = s
        .strip_prefix('P')
        .ok_or_else(|| bad("must start with P"))?;
    if rest.is_empty() {
        return Err(bad("no components"));
    }
    let mut total = 0f64;
    let mut in_time = false;
    let mut number = String::new();
    let mut saw_component = false;
    for c in rest.chars() {
        match c {
            'T' if !in_time && number.is_empty() => in_time = true,
            '0'..='9' | '.' | ',' => number.push(if c == ',' { '.' } else { c }),
            unit => {
                if number.is_empty() {
                    return Err(bad("a unit without a number"));
                }
                let n: f64 = number.parse().map_err(|_| bad("bad number"))?;
                number.clear();
                let secs = match (in_time, unit) {
                    (false, 'W') => 7.0 * 86_400.0,
                    (false, 'D') => 86_400.0,
                    (true, 'H') => 3_600.0,
                    (true, 'M') => 60.0,
                    (true, 'S') => 1.0,
                    (false, 'Y') | (false, 'M') => {
                        return Err(bad("years and months have no fixed length"))
                    }
                    _ => return Err(bad("unexpected unit")),
                };
                total += n * secs;
                saw_component = true;
            }
        }
    }
    if !number.is_empty() || !saw_component {
        return Err(bad("trailing number without a unit"));
    }
    if !total.is_finite() || total > u64::MAX as f64 / 2.0 {
        return Err(bad("too long"));
    }
    Ok(Duration::from_secs_f64(total))
}

/// Formats a duration as `PT…S` (the form OJS examples use).
pub fn format_iso8601_duration(d: Duration) -> String {
    let secs = d.as_secs();
    let millis = d.subsec_millis();
    if millis == 0 {
        format!("PT{secs}S")
    } else {
        format!("PT{secs}.{millis:03}S")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_common_forms() {
        assert_eq!(
            parse_iso8601_duration("PT1S").unwrap(),
            Duration::from_secs(1)
        );
        assert_eq!(
            parse_iso8601_duration("PT5M").unwrap(),
            Duration::from_secs(300)
        );
        assert_eq!(
            parse_iso8601_duration("P1DT2H").unwrap(),
            Duration::from_secs(93_600)
        );
        assert_eq!(
            parse_iso8601_duration("PT0.5S").unwrap(),
            Duration::from_millis(500)
        );
        assert_eq!(
            parse_iso8601_duration("P1W").unwrap(),
            Duration::from_secs(604_800)
        );
    }

    #[test]
    fn rejects_what_is_not_a_duration() {
        for bad in ["", "P", "PT", "1S", "PT1", "P1Y", "P1M", "PTS", "PT1X"] {
            assert!(parse_iso8601_duration(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn formats_round_trip() {
        for d in [
            Duration::from_secs(0),
            Duration::from_millis(1500),
            Duration::from_secs(300),
        ] {
            assert_eq!(
                parse_iso8601_duration(&format_iso8601_duration(d)).unwrap(),
                d
            );
        }
    }
}
