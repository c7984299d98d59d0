//! `*` wildcard patterns, as route matches, `allowed_queues` and
//! `[api] queues` use them: compiled once, matched per message.

/// A `*` wildcard pattern (`*` matches any run of characters, dots
/// included).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Glob {
    parts: Vec<String>,
    exact: bool,
}

impl Glob {
    /// Compiles a pattern; empty patterns are refused.
    pub fn new(pattern: &str) -> Result<Glob, String> {
        if pattern.is_empty() {
            return Err("an empty pattern matches nothing; use \"*\" to match everything".into());
        }
        Ok(Glob {
            parts: pattern.split('*').map(str::to_owned).collect(),
            exact: !pattern.contains('*'),
        })
    }

    /// The pattern itself when it has no `*` (it matches only itself).
    pub fn literal(&self) -> Option<&str> {
        self.exact.then(|| self.parts[0].as_str())
    }

    /// Whether the pattern is only stars: it matches every text.
    pub fn matches_everything(&self) -> bool {
        !self.exact && self.parts.iter().all(String::is_empty)
    }

    /// Whether `text` matches.
    pub fn matches(&self, text: &str) -> bool {
        if self.exact {
            return self.parts[0] == text;
        }
        let (first, rest) = self.parts.split_first().unwrap_or((&self.parts[0], &[]));
        let Some(mut remaining) = text.strip_prefix(first.as_str()) else {
            return false;
        };
        let Some((last, middle)) = rest.split_last() else {
            return true;
        };
        for part in middle {
            match remaining.find(part.as_str()) {
                Some(at) => remaining = &remaining[at + part.len()..],
                None => return false,
            }
        }
        remaining.len() >= last.len() && remaining.ends_with(last.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::Glob;

    #[test]
    fn stars_match_any_run_of_characters() {
        let g = |p: &str| Glob::new(p).unwrap_or_else(|e| panic!("{e}"));
        assert!(g("orders").matches("orders"));
        assert!(!g("orders").matches("orders2"));
        assert!(g("mail.*").matches("mail.eu"));
        assert!(!g("mail.*").matches("mail"));
        assert!(g("*").matches("anything"));
        assert!(g("a*c*e").matches("abcde"));
        assert!(!g("a*c*e").matches("abcd"));
        assert!(Glob::new("").is_err());
    }
}
