//! Adapter settings from every place a user may write them.
//!
//! An adapter's settings are one serde struct (`KafkaConfig`, `RabbitConfig`,
//! …). Users write them in three ways: as URL query items on the command line
//! (`kafka://h:9092?replication=3`), as a TOML table in the daemon's config
//! (`[adapters.events] replication = 3`) and as environment variables. URL
//! and environment values are text, so a setting's type decides how its text
//! is read: `3` is a number for `replication` and a string for a topic
//! template. [`overlay`] applies such items, typed or text, over a config
//! that already holds the defaults and whatever came before, and names the
//! setting when one is unknown or does not parse.

use serde::de::value::{MapAccessDeserializer, SeqDeserializer};
use serde::de::{self, DeserializeOwned, IntoDeserializer, MapAccess, Visitor};
use serde::Serialize;

use crate::{Error, Result};

/// One value for a setting.
#[derive(Clone, PartialEq)]
pub enum SettingValue {
    /// Text, read according to the setting's type (URL query items,
    /// environment variables, TOML strings).
    Text(String),
    /// An already typed value (TOML numbers, booleans, arrays, tables).
    Typed(serde_json::Value),
}

impl std::fmt::Debug for SettingValue {
    // Values may be secrets (a password setting): never printed.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SettingValue::Text(_) => f.write_str("Text(..)"),
            SettingValue::Typed(_) => f.write_str("Typed(..)"),
        }
    }
}

impl SettingValue {
    /// The value as text (typed values in their JSON form, strings bare), for
    /// options passed through to a client library.
    pub fn into_text(self) -> String {
        match self {
            SettingValue::Text(t) | SettingValue::Typed(serde_json::Value::String(t)) => t,
            SettingValue::Typed(v) => v.to_string(),
        }
    }
}

impl From<&str> for SettingValue {
    fn from(text: &str) -> Self {
        SettingValue::Text(text.to_owned())
    }
}

/// The names of a settings struct's fields, sorted (every
/// field of an adapter config serializes, so its serialized keys are its
/// settings).
pub fn setting_names<T: Serialize>(config: &T) -> Vec<String> {
    match serde_json::to_value(config) {
        Ok(serde_json::Value::Object(map)) => map.keys().cloned().collect(),
        _ => Vec::new(),
    }
}

/// The candidate closest to `name` when it is close enough to be a typo
/// of it (an edit distance of at most a third of its length, and at least
/// one edit allowed), for "did you mean" hints; case is ignored and `-`
/// counts as `_`.
pub fn did_you_mean<'a>(
    name: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    let fold = |s: &str| s.to_ascii_lowercase().replace('-', "_");
    let wanted = fold(name);
    let limit = (wanted.chars().count() / 3).max(1);
    candidates
        .into_iter()
        .map(|c| (edit_distance(&wanted, &fold(c)), c))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// `" (did you mean `x`?)"` when one of `candidates` is close to `name`.
pub fn suggestion<'a>(name: &str, candidates: impl IntoIterator<Item = &'a str>) -> String {
    did_you_mean(name, candidates)
        .map(|c| format!(" (did you mean `{c}`?)"))
        .unwrap_or_default()
}

/// Edit distance counting characters, where swapping two neighbours is one
/// edit (`locla` → `local`), as typos go (optimal string alignment).
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut before: Vec<usize> = vec![0; b.len() + 1];
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for i in 1..=a.len() {
        let mut current = vec![i; b.len() + 1];
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            current[j] = (previous[j] + 1)
                .min(current[j - 1] + 1)
                .min(previous[j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                current[j] = current[j].min(before[j - 2] + 1);
            }
        }
        before = std::mem::replace(&mut previous, current);
    }
    previous[b.len()]
}

/// Applies `items` over `base`, one at a time, so that an error names the
/// setting at fault. Unknown names are refused by the struct's
/// `deny_unknown_fields`; the error lists the known ones.
pub fn overlay<T>(base: &T, items: impl IntoIterator<Item = (String, SettingValue)>) -> Result<T>
where
    T: Serialize + DeserializeOwned,
{
    let mut current = to_map(base)?;
    let known = current.keys().cloned().collect::<Vec<_>>();
    for (name, value) in items {
        if !current.contains_key(&name) {
            return Err(Error::InvalidConfig {
                field: name.clone(),
                reason: format!(
                    "unknown setting {name:?}{}; known settings: {}",
                    suggestion(&name, known.iter().map(String::as_str)),
                    known.join(", ")
                ),
            });
        }
        let mut entries: Vec<(String, SettingValue)> = current
            .iter()
            .map(|(k, v)| (k.clone(), SettingValue::Typed(v.clone())))
            .collect();
        if let Some(slot) = entries.iter_mut().find(|(k, _)| *k == name) {
            slot.1 = value;
        }
        let next: T = deserialize_entries(entries).map_err(|e| Error::InvalidConfig {
            field: name.clone(),
            reason: e.to_string(),
        })?;
        current = to_map(&next)?;
    }
    serde_json::from_value(serde_json::Value::Object(current)).map_err(|e| Error::InvalidConfig {
        field: "settings".into(),
        reason: e.to_string(),
    })
}

fn to_map<T: Serialize>(config: &T) -> Result<serde_json::Map<String, serde_json::Value>> {
    match serde_json::to_value(config) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(_) => Err(Error::InvalidConfig {
            field: "settings".into(),
            reason: "settings must be a struct".into(),
        }),
        Err(e) => Err(Error::InvalidConfig {
            field: "settings".into(),
            reason: e.to_string(),
        }),
    }
}

fn deserialize_entries<T: DeserializeOwned>(
    entries: Vec<(String, SettingValue)>,
) -> std::result::Result<T, de::value::Error> {
    T::deserialize(MapAccessDeserializer::new(Entries {
        entries: entries.into_iter(),
        value: None,
    }))
}

/// A struct's fields as a map whose values are typed or text.
struct Entries {
    entries: std::vec::IntoIter<(String, SettingValue)>,
    value: Option<SettingValue>,
}

impl<'de> MapAccess<'de> for Entries {
    type Error = de::value::Error;

    fn next_key_seed<K: de::DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> std::result::Result<Option<K::Value>, Self::Error> {
        match self.entries.next() {
            Some((key, value)) => {
                self.value = Some(value);
                seed.deserialize(key.into_deserializer()).map(Some)
            }
            None => Ok(None),
        }
    }

    fn next_value_seed<V: de::DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> std::result::Result<V::Value, Self::Error> {
        match self.value.take() {
            Some(SettingValue::Typed(v)) => seed.deserialize(v).map_err(de::Error::custom),
            Some(SettingValue::Text(t)) => seed.deserialize(Text(t)),
            None => Err(de::Error::custom("value without a key")),
        }
    }
}

/// A text value that becomes whatever type the setting has: `"3"` a number,
/// `"true"` a boolean, `"a,b"` a list, `""` or `"null"` an absent option.
struct Text(String);

impl Text {
    fn parse<T: std::str::FromStr>(&self, what: &str) -> std::result::Result<T, de::value::Error> {
        self.0
            .trim()
            .parse()
            .map_err(|_| de::Error::custom(format!("{:?} is not {what}", self.0)))
    }
}

macro_rules! parse_as {
    ($($method:ident $visit:ident $ty:ty, $what:literal;)*) => {
        $(fn $method<V: Visitor<'de>>(self, visitor: V) -> std::result::Result<V::Value, Self::Error> {
            visitor.$visit(self.parse::<$ty>($what)?)
        })*
    };
}

impl<'de> de::Deserializer<'de> for Text {
    type Error = de::value::Error;

    fn deserialize_any<V: Visitor<'de>>(
        self,
        visitor: V,
    ) -> std::result::Result<V::Value, Self::Error> {
        visitor.visit_string(self.0)
    }

    fn deserialize_bool<V: Visitor<'de>>(
        self,
        visitor: V,
    ) -> std::result::Result<V::Value, Self::Error> {
        match self.0.trim().to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => visitor.visit_bool(true),
            "false" | "0" | "no" | "off" => visitor.visit_bool(false),
            _ => Err(de::Error::custom(format!(
                "{:?} is not a boolean (true or false)",
                self.0
            ))),
        }
    }

    parse_as! {
        deserialize_i8 visit_i8 i8, "a number";
        deserialize_i16 visit_i16 i16, "a number";
        deserialize_i32 visit_i32 i32, "a number";
        deserialize_i64 visit_i64 i64, "a number";
        deserialize_u8 visit_u8 u8, "a number from 0 to 255";
        deserialize_u16 visit_u16 u16, "a number from 0 to 65535";
        deserialize_u32 visit_u32 u32, "a non-negative number";
        deserialize_u64 visit_u64 u64, "a non-negative number";
        deserialize_f32 visit_f32 f32, "a number";
        deserialize_f64 visit_f64 f64, "a number";
    }

    fn deserialize_option<V: Visitor<'de>>(
        self,
        visitor: V,
    ) -> std::result::Result<V::Value, Self::Error> {
        match self.0.trim() {
            "" | "null" | "none" => visitor.visit_none(),
            _ => visitor.visit_some(self),
        }
    }

    fn deserialize_seq<V: Visitor<'de>>(
        self,
        visitor: V,
    ) -> std::result::Result<V::Value, Self::Error> {
        let items: Vec<Text> = self
            .0
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| Text(s.to_owned()))
            .collect();
        visitor.visit_seq(SeqDeserializer::new(items.into_iter()))
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> std::result::Result<V::Value, Self::Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> std::result::Result<V::Value, Self::Error> {
        visitor.visit_enum(self.0.into_deserializer())
    }

    fn deserialize_map<V: Visitor<'de>>(
        self,
        _visitor: V,
    ) -> std::result::Result<V::Value, Self::Error> {
        Err(de::Error::custom(
            "a table cannot be given as text; set it in the config file",
        ))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> std::result::Result<V::Value, Self::Error> {
        self.deserialize_map(visitor)
            .map_err(|e: Self::Error| de::Error::custom(format!("{name}: {e}")))
    }

    serde::forward_to_deserialize_any! {
        i128 u128 char str string bytes byte_buf unit unit_struct tuple
        tuple_struct identifier ignored_any
    }
}

impl<'de> IntoDeserializer<'de, de::value::Error> for Text {
    type Deserializer = Text;

    fn into_deserializer(self) -> Text {
        self
    }
}

/// Splits `scheme://authority/path?query` into the part before `?` and its
/// query items, each percent-decoded (`%7Bqueue%7D` and `{queue}` alike; `+`
/// stays a plus, as in URIs).
pub fn split_query(url: &str) -> Result<(&str, Vec<(String, String)>)> {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut items = Vec::new();
    for item in query.split('&').filter(|i| !i.is_empty()) {
        let (k, v) = item.split_once('=').ok_or_else(|| Error::InvalidConfig {
            field: "url".into(),
            reason: format!(
                "query item {:?} is not name=value",
                ojs_core::redact::query_item_for_display(item)
            ),
        })?;
        items.push((percent_decode(k)?, percent_decode(v)?));
    }
    Ok((base, items))
}

/// Encodes every byte outside URL-unreserved characters as `%XX` (for a
/// password put into a URL's userinfo).
pub fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Decodes `%XX` escapes.
pub fn percent_decode(text: &str) -> Result<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            match hex {
                Some(b) => {
                    out.push(b);
                    i += 3;
                    continue;
                }
                None => {
                    return Err(Error::InvalidConfig {
                        field: "url".into(),
                        reason: "a `%` in a query item is not followed by two hex digits".into(),
                    })
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8(out).map_err(|_| Error::InvalidConfig {
        field: "url".into(),
        reason: "a query item is not UTF-8 once decoded".into(),
    })
}

/// Whether `name` could have been rendered from `template`: each
/// `{placeholder}` stands for one or more characters. Adapters use it to
/// recognise their own dead-letter and retry names, which a message must
/// never be able to choose as a destination.
pub fn matches_template(template: &str, name: &str) -> bool {
    // Literal pieces between placeholders, in order.
    let mut pieces = Vec::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let Some(close) = rest[open..].find('}') else {
            break;
        };
        pieces.push(&rest[..open]);
        rest = &rest[open + close + 1..];
    }
    pieces.push(rest);
    if pieces.len() == 1 {
        return template == name;
    }
    let (first, last) = (pieces[0], pieces[pieces.len() - 1]);
    if !name.starts_with(first) || !name.ends_with(last) || name.len() < first.len() + last.len() {
        return false;
    }
    let mut middle = &name[first.len()..name.len() - last.len()];
    // Each placeholder takes at least one character; literal pieces in
    // between are found leftmost (placeholders never hold the dot pieces
    // of a template like `{queue}.{delay_ms}` ambiguously enough to matter).
    for piece in &pieces[1..pieces.len() - 1] {
        match middle.get(1..).and_then(|m| m.find(piece)) {
            Some(at) => middle = &middle[1 + at + piece.len()..],
            None => return false,
        }
    }
    !middle.is_empty()
}

/// Whether resources on the broker are created by the adapter or only used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Topology {
    /// Create what is missing; use what exists as it is (never re-declared
    /// with conflicting settings). The default.
    #[default]
    Declare,
    /// Never create or declare anything; a missing queue or topic is an
    /// error that names it.
    Existing,
}

impl Topology {
    /// Under `existing`, the error for a client that asked the adapter to
    /// create its private reply `queue` (`QueueAdapter::open_reply_queue`);
    /// `Ok` under `declare`.
    pub fn may_create_reply_queue(self, queue: &str) -> Result<()> {
        match self {
            Topology::Declare => Ok(()),
            Topology::Existing => Err(Error::InvalidConfig {
                field: "reply queue".into(),
                reason: format!(
                    "topology = \"existing\" creates nothing: provision a reply queue for this client and name it instead of letting {queue:?} be created"
                ),
            }),
        }
    }
}

impl std::fmt::Display for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Topology::Declare => "declare",
            Topology::Existing => "existing",
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde::Deserialize;

    use super::*;

    #[test]
    fn near_misses_get_a_suggestion_and_strangers_do_not() {
        let known = ["topic_template", "topology", "replication", "partitions"];
        assert_eq!(did_you_mean("topic_templat", known), Some("topic_template"));
        assert_eq!(did_you_mean("topolgy", known), Some("topology"));
        assert_eq!(did_you_mean("Replication", known), Some("replication"));
        assert_eq!(did_you_mean("banana", known), None);
        assert_eq!(did_you_mean("partitons", known), Some("partitions"));
        assert_eq!(did_you_mean("security.protocol", known), None);
        assert_eq!(did_you_mean("x", known), None);
        assert_eq!(
            suggestion("topic_templat", known),
            " (did you mean `topic_template`?)"
        );
        assert_eq!(suggestion("zzz", known), "");
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("locla", "local"), 1);
        assert_eq!(did_you_mean("locla", ["local", "kafka"]), Some("local"));
    }

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Sample {
        name: String,
        #[serde(default)]
        count: u16,
        #[serde(default)]
        on: bool,
        #[serde(default)]
        limit: Option<u8>,
        #[serde(default)]
        list: Vec<String>,
        #[serde(default)]
        topology: Topology,
        #[serde(default)]
        extra: BTreeMap<String, String>,
    }

    fn base() -> Sample {
        Sample {
            name: "n".into(),
            count: 1,
            on: false,
            limit: Some(5),
            list: vec![],
            topology: Topology::Declare,
            extra: BTreeMap::new(),
        }
    }

    fn text(items: &[(&str, &str)]) -> Vec<(String, SettingValue)> {
        items
            .iter()
            .map(|(k, v)| (k.to_string(), SettingValue::from(*v)))
            .collect()
    }

    #[test]
    fn text_takes_the_type_of_its_setting() {
        let s = overlay(
            &base(),
            text(&[
                ("count", "3"),
                ("on", "true"),
                ("limit", ""),
                ("list", "a, b"),
                ("name", "42"),
                ("topology", "existing"),
            ]),
        )
        .unwrap();
        assert_eq!(s.count, 3);
        assert!(s.on);
        assert_eq!(s.limit, None);
        assert_eq!(s.list, vec!["a", "b"]);
        assert_eq!(s.name, "42");
        assert_eq!(s.topology, Topology::Existing);
        let s = overlay(&s, text(&[("limit", "7")])).unwrap();
        assert_eq!(s.limit, Some(7));
    }

    #[test]
    fn typed_values_and_later_items_win() {
        let s = overlay(
            &base(),
            vec![
                ("count".into(), SettingValue::Typed(serde_json::json!(9))),
                (
                    "extra".into(),
                    SettingValue::Typed(serde_json::json!({"a": "b"})),
                ),
                ("count".into(), SettingValue::from("10")),
            ],
        )
        .unwrap();
        assert_eq!(s.count, 10);
        assert_eq!(s.extra["a"], "b");
    }

    #[test]
    fn errors_name_the_setting() {
        for (items, field) in [
            (text(&[("count", "x")]), "count"),
            (text(&[("count", "70000")]), "count"),
            (text(&[("on", "maybe")]), "on"),
            (text(&[("topology", "create")]), "topology"),
            (text(&[("extra", "a=b")]), "extra"),
            (text(&[("bogus", "1")]), "bogus"),
        ] {
            match overlay(&base(), items) {
                Err(Error::InvalidConfig { field: f, reason }) => {
                    assert_eq!(f, field, "{reason}");
                    if field == "bogus" {
                        assert!(reason.contains("count"), "{reason}");
                    }
                }
                other => panic!("{field}: {other:?}"),
            }
        }
    }

    #[test]
    fn names_come_from_the_struct() {
        assert_eq!(
            setting_names(&base()),
            ["count", "extra", "limit", "list", "name", "on", "topology"]
        );
    }

    #[test]
    fn names_are_matched_against_templates() {
        assert!(matches_template(
            "ojs.queue.{queue}.retry",
            "ojs.queue.a.retry"
        ));
        assert!(matches_template("{queue}.dlq", "orders.dlq"));
        assert!(!matches_template("{queue}.dlq", ".dlq"));
        assert!(matches_template(
            "ojs.queue.retry.{queue}.{delay_ms}",
            "ojs.queue.retry.a.b.1500"
        ));
        assert!(!matches_template(
            "ojs.queue.retry.{queue}.{delay_ms}",
            "ojs.queue.retry.a"
        ));
        assert!(!matches_template("ojs.dead.{queue}", "ojs.queue.x"));
        assert!(matches_template("fixed", "fixed"));
        assert!(!matches_template("fixed", "other"));
    }

    #[test]
    fn queries_are_split_and_decoded() {
        let (base, items) =
            split_query("kafka://h:1?topic_template=%7Bqueue%7D&a.b=c%2Bd&x=").unwrap();
        assert_eq!(base, "kafka://h:1");
        assert_eq!(
            items,
            vec![
                ("topic_template".into(), "{queue}".into()),
                ("a.b".into(), "c+d".into()),
                ("x".into(), "".into())
            ]
        );
        assert!(split_query("kafka://h?novalue").is_err());
        assert!(split_query("kafka://h?a=%zz").is_err());
    }
}
