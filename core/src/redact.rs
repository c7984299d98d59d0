//! The one rule for printing anything that may hold a credential: URLs
//! (their userinfo and secret-looking query items) and setting values whose
//! names look secret. Every URL the program prints or logs goes through
//! [`url`], whatever its scheme (a mistyped `kafkx://u:secret@…` included).

/// Printed in place of a secret.
pub const MASK: &str = "***";

/// A secret value (a token, a password read from a file) whose `Debug`
/// and `Display` never show it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The value, for the one place that must use it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether `given` is this secret, compared without an early exit so
    /// the time taken does not tell how much of a guess was right.
    pub fn matches(&self, given: &str) -> bool {
        let (given, expected) = (given.as_bytes(), self.0.as_bytes());
        let mut diff = given.len() ^ expected.len();
        for (i, e) in expected.iter().enumerate() {
            diff |= usize::from(given.get(i).copied().unwrap_or(0) ^ e);
        }
        diff == 0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(MASK)
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(MASK)
    }
}

/// Whether a setting or query item named `name` may hold a secret:
/// passwords, secrets, tokens, keys, SASL settings, AWS credentials.
pub fn is_secret_name(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n.starts_with("sasl.")
        || n.starts_with("sasl_")
        || [
            "password",
            "passwd",
            "secret",
            "token",
            "key",
            "credential",
            "signature",
        ]
        .iter()
        .any(|s| n.contains(s))
}

/// `url` with the password of its userinfo and the values of secret query
/// items replaced by `***`. Text that is not a URL comes back with any
/// `user:password@` still masked.
pub fn url(url: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let mut out = userinfo(base);
    if let Some(q) = query {
        out.push('?');
        let items: Vec<String> = q.split('&').map(query_item_for_display).collect();
        out.push_str(&items.join("&"));
    }
    out
}

/// One `name=value` query item, with the value masked when the name looks
/// secret.
pub fn query_item_for_display(item: &str) -> String {
    match item.split_once('=') {
        Some((k, _)) if is_secret_name(k) => format!("{k}={MASK}"),
        Some(_) => item.to_owned(),
        // No `=`: a bare word might be a pasted secret; show only its length.
        None if item.len() > 16 => format!("<{} characters>", item.len()),
        None => item.to_owned(),
    }
}

fn userinfo(base: &str) -> String {
    let authority_start = base.find("://").map_or(0, |i| i + 3);
    let authority_end = base[authority_start..]
        .find('/')
        .map_or(base.len(), |i| authority_start + i);
    let authority = &base[authority_start..authority_end];
    match authority.rfind('@') {
        Some(at) => {
            let creds = &authority[..at];
            let user = creds.split(':').next().unwrap_or("");
            let masked = if creds.contains(':') {
                format!("{user}:{MASK}")
            } else {
                // A lone userinfo part may be a token (`https://TOKEN@host`).
                MASK.to_owned()
            };
            format!(
                "{}{}{}",
                &base[..authority_start],
                masked,
                &base[authority_start + at..]
            )
        }
        None => base.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_compare_whole() {
        let s = Secret::new("abc");
        assert!(s.matches("abc"));
        assert!(!s.matches("abd"));
        assert!(!s.matches("ab"));
        assert!(!s.matches("abcd"));
        assert!(!s.matches(""));
        assert_eq!(format!("{s:?} {s}"), "*** ***");
    }

    #[test]
    fn userinfo_and_secret_items_are_masked() {
        assert_eq!(
            url("amqp://bridge:s3cret@h:5672/%2f?heartbeat=10"),
            "amqp://bridge:***@h:5672/%2f?heartbeat=10"
        );
        assert_eq!(
            url("kafka://h:9092?sasl.password=s3cret&linger.ms=5&sasl.username=u"),
            "kafka://h:9092?sasl.password=***&linger.ms=5&sasl.username=***"
        );
        assert_eq!(url("kafkx://u:s3cret@h"), "kafkx://u:***@h");
        assert_eq!(
            url("sqs://r?aws_secret_access_key=s3cret"),
            "sqs://r?aws_secret_access_key=***"
        );
        assert_eq!(url("https://tok3n@h/x"), "https://***@h/x");
        assert_eq!(url("local:./data"), "local:./data");
        assert_eq!(url("amqp://h/a@b"), "amqp://h/a@b");
        assert!(!url("kafka://h?ssl.key.password=s3cret").contains("s3cret"));
        assert!(!url("kafka://h?s3cretthatislongerthan16").contains("s3cret"));
    }
}
