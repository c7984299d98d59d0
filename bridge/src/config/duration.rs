//! Durations as the file writes them (`"30s"`, `"500ms"`, `"2m"`).

use std::time::Duration;

/// Parses `250ms`, `30s`, `5m`, `1h` or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(digits_end);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration like 250ms, 30s, 5m or 1h"))?;
    let per_unit = match unit.trim() {
        "ms" => Duration::from_millis(1),
        "" | "s" => Duration::from_secs(1),
        "m" => Duration::from_secs(60),
        "h" => Duration::from_secs(3600),
        other => {
            return Err(format!(
                "{text:?}: unknown unit {other:?} (use ms, s, m or h)"
            ))
        }
    };
    per_unit
        .checked_mul(u32::try_from(n).map_err(|_| format!("{text:?} is too long"))?)
        .ok_or_else(|| format!("{text:?} is too long"))
}

/// Durations as text (`"30s"`) or a number of seconds.
pub(crate) mod duration_text {
    use std::time::Duration;

    use serde::{de, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        if d.subsec_millis() == 0 {
            s.serialize_str(&format!("{}s", d.as_secs()))
        } else {
            s.serialize_str(&format!("{}ms", d.as_millis()))
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Text {
            Secs(u64),
            Text(String),
        }
        match Text::deserialize(d)? {
            Text::Secs(n) => Ok(Duration::from_secs(n)),
            Text::Text(t) => super::parse_duration(&t).map_err(de::Error::custom),
        }
    }
}
