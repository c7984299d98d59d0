//! What SQS accepts in a message attribute and a FIFO id, checked before a
//! message is sent.
//!
//! SQS refuses a `SendMessageBatch` **as a whole** (400
//! `InvalidParameterValue`) when one entry breaks these rules, so a single
//! message with a header SQS cannot carry would otherwise hold every message
//! of its batch, and be retried for ever as if SQS were down. Each rule
//! here either turns the header into something SQS takes without losing a
//! byte (values), or fails that message alone with an error naming the rule
//! (names), which the daemon dead-letters as `sink_rejected`.

use std::borrow::Cow;
use std::fmt::Write as _;

use ojs_queue::{BrokerErrorKind, Error, Result};
use sha2::{Digest, Sha256};

/// Longest attribute name SQS accepts.
pub const SQS_MAX_ATTRIBUTE_NAME: usize = 256;
/// Longest `MessageGroupId` / `MessageDeduplicationId`.
pub const SQS_MAX_FIFO_ID: usize = 128;
/// Data type of an attribute whose value is empty. SQS refuses empty values
/// (String and Binary alike), so an empty header travels as this custom
/// type with a placeholder value, and is read back as empty.
pub const EMPTY_VALUE_TYPE: &str = "String.ojs-empty";
/// The placeholder value sent with [`EMPTY_VALUE_TYPE`].
pub const EMPTY_VALUE_PLACEHOLDER: &str = "-";

/// Whether SQS accepts `name` as a message attribute name: letters, digits,
/// `_`, `-` and `.`; at most 256 characters; no `AWS.` or `Amazon.` prefix
/// in any case; no leading, trailing or doubled period.
pub fn check_name(name: &str) -> Result<()> {
    let rule = if name.is_empty() {
        Some("is empty")
    } else if name.len() > SQS_MAX_ATTRIBUTE_NAME {
        Some("is longer than 256 characters")
    } else if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
    {
        Some("holds a character other than letters, digits, '_', '-' and '.'")
    } else if starts_with_ignoring_case(name, "aws.") || starts_with_ignoring_case(name, "amazon.")
    {
        Some("starts with the reserved prefix AWS. or Amazon.")
    } else if name.starts_with('.') || name.ends_with('.') || name.contains("..") {
        Some("starts or ends with a period or holds two in a row")
    } else {
        None
    };
    match rule {
        None => Ok(()),
        // The name itself is left out: like a value, it is the sender's
        // data; its length says which header it is in practice.
        Some(rule) => Err(Error::broker(
            "sqs",
            format!(
                "a header name of {} bytes {rule}; SQS refuses such message attribute names",
                name.len()
            ),
            false,
        )
        .with_broker_kind(BrokerErrorKind::Rejected)),
    }
}

fn starts_with_ignoring_case(name: &str, prefix: &str) -> bool {
    name.get(..prefix.len())
        .is_some_and(|head| head.eq_ignore_ascii_case(prefix))
}

/// Whether SQS takes `text` as a String value: the characters XML allows
/// (#x9, #xA, #xD, #x20–#xD7FF, #xE000–#xFFFD, #x10000–#x10FFFF), the
/// same rule as a body. Other text travels as a Binary attribute, so its
/// bytes arrive unchanged.
pub fn is_xml_text(text: &str) -> bool {
    text.chars().all(|c| {
        matches!(c, '\u{9}' | '\u{A}' | '\u{D}' | '\u{20}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}')
            || c >= '\u{10000}'
    })
}

/// A FIFO `MessageGroupId` or `MessageDeduplicationId` SQS accepts: the
/// value itself when it is 1–128 printable ASCII characters, else a digest
/// of it (`ojs-` and 32 hex digits). The digest is the same for the same
/// value, so deduplication and grouping keep working.
pub fn fifo_id(value: &str) -> Cow<'_, str> {
    let fits = !value.is_empty()
        && value.len() <= SQS_MAX_FIFO_ID
        && value.bytes().all(|b| b.is_ascii_graphic());
    if fits {
        return Cow::Borrowed(value);
    }
    let digest = Sha256::digest(value.as_bytes());
    let mut id = String::with_capacity(4 + 32);
    id.push_str("ojs-");
    for byte in &digest[..16] {
        // Writing to a String cannot fail.
        let _ = write!(id, "{byte:02x}");
    }
    Cow::Owned(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_sqs_refuses_are_errors_that_name_the_rule_not_the_name() {
        for good in ["ojs-type", "traceparent", "a.b_c-D9", &"n".repeat(256)] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for (bad, rule) in [
            ("bad name!", "character"),
            ("caf\u{e9}", "character"),
            ("", "empty"),
            (&"n".repeat(257), "256"),
            ("AWS.trace", "reserved"),
            ("amazon.x", "reserved"),
            (".x", "period"),
            ("x.", "period"),
            ("a..b", "period"),
        ] {
            let e = check_name(bad).expect_err(bad);
            let text = e.to_string();
            assert!(text.contains(rule), "{bad}: {text}");
            assert!(!e.is_retryable());
            assert_eq!(e.broker_kind(), Some(BrokerErrorKind::Rejected));
            if bad.len() > 2 {
                assert!(!text.contains(bad), "the name itself is left out: {text}");
            }
        }
    }

    #[test]
    fn text_outside_xml_characters_is_told_apart() {
        assert!(is_xml_text("plain \t\r\n caf\u{e9} \u{1F600}"));
        assert!(!is_xml_text("nul \0"));
        assert!(!is_xml_text("bell \u{7}"));
        assert!(!is_xml_text("\u{FFFE}"));
    }

    #[test]
    fn fifo_ids_that_do_not_fit_become_a_stable_digest() {
        assert_eq!(fifo_id("order-42"), "order-42");
        let long = "x".repeat(129);
        let spaced = "a b";
        for value in [long.as_str(), spaced, "caf\u{e9}", ""] {
            let id = fifo_id(value);
            assert_eq!(id.len(), 36, "{value}");
            assert!(id.starts_with("ojs-"));
            assert!(id.bytes().all(|b| b.is_ascii_graphic()));
            assert_eq!(id, fifo_id(value), "the same value, the same id");
        }
        assert_ne!(fifo_id(&long), fifo_id(spaced));
    }
}
