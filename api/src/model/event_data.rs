//! An event's data as the JSON object text the store keeps.
//!
//! Every transition records events (two per job on a worker's FETCH and
//! ACK, one per pushed job), and the store keeps only their text. Writing
//! the fields straight into that text skips what a `Value` costs: a map
//! node and a key string per field, copies of the job's type and queue,
//! the value's clone when it is recorded, a second pass to write it and
//! its drop.

use serde::Serialize;
use serde_json::Value;

/// Bytes an event's text starts with room for: a job event's fields (its
/// type, queue, state, attempt, worker, timestamps) fit.
const EVENT_TEXT_ROOM: usize = 256;

/// A JSON object's text, written field by field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventData(Vec<u8>);

impl EventData {
    /// `{}`, with room for a job event's fields (growing from two bytes
    /// reallocated the text five or six times per event).
    pub fn empty() -> Self {
        let mut text = Vec::with_capacity(EVENT_TEXT_ROOM);
        text.extend_from_slice(b"{}");
        EventData(text)
    }

    /// The fields every job event starts with.
    pub fn of_job(job_type: &str, queue: &str, state: &str) -> Self {
        EventData::empty()
            .field("job_type", job_type)
            .field("queue", queue)
            .field("state", state)
    }

    /// A `Value`'s text: its fields when it is an object, else it under
    /// `value` (every event's data is an object).
    pub fn of_value(value: &Value) -> Self {
        match value {
            Value::Object(fields) => fields
                .iter()
                .fold(EventData::empty(), |data, (k, v)| data.field(k, v)),
            other => EventData::empty().field("value", other),
        }
    }

    /// Adds `key` with `value` (written as serde writes it: `None` as
    /// `null`).
    pub fn field<T: Serialize + ?Sized>(mut self, key: &str, value: &T) -> Self {
        // Always ends with the object's `}`: it is taken off and put back.
        self.0.pop();
        let mark = self.0.len();
        if mark > 1 {
            self.0.push(b',');
        }
        ojs_core::json_out::write_str(&mut self.0, key);
        self.0.push(b':');
        let written = ojs_core::json_out::write(&mut self.0, value).is_ok();
        if !written {
            // Only a map with keys that are not strings fails to write,
            // and no event holds one; the field is left out rather than
            // the object broken.
            self.0.truncate(mark);
        }
        self.0.push(b'}');
        self
    }

    /// The object's text.
    pub fn text(&self) -> &str {
        // serde_json writes UTF-8 only, as do the braces and commas here.
        std::str::from_utf8(&self.0).unwrap_or("{}")
    }

    /// The object, parsed back (tests read fields by name).
    #[cfg(test)]
    pub(crate) fn value(&self) -> Value {
        serde_json::from_slice(&self.0).unwrap_or(Value::Null)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn fields_are_written_as_json_does_with_every_escape() {
        let data = EventData::of_job("email.send", "q\"1\n", "active")
            .field("attempt", &3u32)
            .field("worker_id", &None::<&str>)
            .field("result", &json!({"ok": [1, 2.5, "é\u{1}"]}));
        let expected = json!({"job_type": "email.send", "queue": "q\"1\n", "state": "active",
                              "attempt": 3, "worker_id": null, "result": {"ok": [1, 2.5, "é\u{1}"]}});
        assert_eq!(data.value(), expected);
        assert_eq!(
            serde_json::from_str::<Value>(data.text()).unwrap(),
            expected
        );
    }

    #[test]
    fn an_empty_object_and_one_from_a_value() {
        assert_eq!(EventData::empty().text(), "{}");
        let v = json!({"queue": "a", "paused_by": "ops"});
        assert_eq!(EventData::of_value(&v).value(), v);
        assert_eq!(EventData::of_value(&json!(7)).value(), json!({"value": 7}));
    }

    #[test]
    fn a_field_that_cannot_be_written_is_left_out_and_the_object_stays_whole() {
        let mut bad = std::collections::HashMap::new();
        bad.insert((1, 2), "x");
        let data = EventData::empty()
            .field("a", &1)
            .field("bad", &bad)
            .field("b", &2);
        assert_eq!(data.value(), json!({"a": 1, "b": 2}));
    }
}
