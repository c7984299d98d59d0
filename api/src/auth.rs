//! Bearer tokens: each carries the operations it allows and the queues it
//! may touch. Every binding asks the same [`Tokens`], so a token means the
//! same over HTTP and gRPC.
//!
//! With no token configured the API is open (the listener is on loopback by
//! default); with one or more, every request needs `Authorization: Bearer
//! <token>` — 401 without a valid one, 403 outside its scope. A token's
//! secret is never printed: logs and error bodies name the token by its
//! configured `name`.

use ojs_core::glob::Glob;
use ojs_core::redact::Secret;

use crate::error::ApiError;

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// PUSH jobs (single and batch).
    Push,
    /// INFO, the queue list, events, the manifest.
    Read,
    /// The worker side: FETCH, ACK, NACK, heartbeat.
    Work,
    /// Everything above and CANCEL.
    Admin,
}

impl Operation {
    /// The name used in configuration and error bodies.
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Push => "push",
            Operation::Read => "read",
            Operation::Work => "work",
            Operation::Admin => "admin",
        }
    }

    /// Parses `push`, `read` or `admin`.
    pub fn parse(name: &str) -> Option<Operation> {
        match name {
            "push" => Some(Operation::Push),
            "read" => Some(Operation::Read),
            "work" => Some(Operation::Work),
            "admin" => Some(Operation::Admin),
            _ => None,
        }
    }
}

/// One configured token.
#[derive(Debug, Clone)]
pub struct Token {
    /// How logs and errors name it.
    pub name: String,
    /// The bearer value.
    pub secret: Secret,
    /// What it allows; `admin` allows everything.
    pub operations: Vec<Operation>,
    /// Queues it may touch; empty: every queue.
    pub queues: Vec<Glob>,
}

impl Token {
    fn allows(&self, operation: Operation) -> bool {
        self.operations
            .iter()
            .any(|o| *o == operation || *o == Operation::Admin)
    }

    fn covers(&self, queue: &str) -> bool {
        in_scope(&self.queues, queue)
    }
}

/// Whether `queue` is within `scope`, a token's queue patterns (empty:
/// every queue): the one rule for a token's grant and for work that runs
/// without it (a store transaction, a log read), which carries its scope.
pub fn in_scope(scope: &[Glob], queue: &str) -> bool {
    scope.is_empty() || scope.iter().any(|g| g.matches(queue))
}

/// The token of an `Authorization: Bearer <token>` header; the scheme's
/// name in any case (RFC 9110), surrounding spaces ignored.
pub fn bearer(authorization: Option<&str>) -> Option<&str> {
    let (scheme, value) = authorization?.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(value.trim())
        .filter(|v| !v.is_empty())
}

/// The tokens of one API; empty: no token needed.
#[derive(Debug, Clone, Default)]
pub struct Tokens(Vec<Token>);

impl Tokens {
    /// These tokens.
    pub fn new(tokens: Vec<Token>) -> Self {
        Tokens(tokens)
    }

    /// Whether requests need no token.
    pub fn is_open(&self) -> bool {
        self.0.is_empty()
    }

    /// The grant of a request from its `Authorization` value: 401 when a
    /// token is needed and this one is missing or matches none. Every
    /// token is compared in full, whichever matches.
    pub fn identify(&self, authorization: Option<&str>) -> Result<Grant<'_>, ApiError> {
        if self.0.is_empty() {
            return Ok(Grant(None));
        }
        let given = bearer(authorization).ok_or(ApiError::Unauthenticated)?;
        let mut found = None;
        for token in &self.0 {
            if token.secret.matches(given) && found.is_none() {
                found = Some(token);
            }
        }
        found
            .map(|t| Grant(Some(t)))
            .ok_or(ApiError::Unauthenticated)
    }
}

/// What one request may do: open, or one token's scope.
#[derive(Debug, Clone, Copy)]
pub struct Grant<'a>(Option<&'a Token>);

impl Grant<'_> {
    /// A grant that allows everything (no token configured).
    pub fn open() -> Self {
        Grant(None)
    }

    /// The token's name, if a token was used.
    pub fn token_name(&self) -> Option<&str> {
        self.0.map(|t| t.name.as_str())
    }

    /// 403 unless the token allows `operation` at all.
    pub fn allow(&self, operation: Operation) -> Result<(), ApiError> {
        match self.0 {
            Some(t) if !t.allows(operation) => Err(self.denied(operation, "this server".into())),
            _ => Ok(()),
        }
    }

    /// 403 unless the token allows `operation` on every queue (what
    /// belongs to no queue, such as the workers' roster).
    pub fn allow_everywhere(&self, operation: Operation) -> Result<(), ApiError> {
        self.allow(operation)?;
        if self.scope().is_empty() || self.scope().iter().any(Glob::matches_everything) {
            Ok(())
        } else {
            Err(self.denied(operation, "every queue".into()))
        }
    }

    /// 403 unless the token allows `operation` on `queue`.
    pub fn allow_on(&self, operation: Operation, queue: &str) -> Result<(), ApiError> {
        self.allow(operation)?;
        match self.0 {
            Some(t) if !t.covers(queue) => Err(self.denied(operation, format!("queue {queue:?}"))),
            _ => Ok(()),
        }
    }

    /// The queue patterns of the token (empty: every queue).
    /// Whether the token may do `operation` to the job `id` on `queue`.
    /// Outside the token's queues the job does not exist for it (404
    /// `not_found`, nothing naming its queue), so that a token cannot
    /// learn which ids exist elsewhere; inside them, an operation it lacks
    /// is 403.
    pub fn allow_job(&self, operation: Operation, queue: &str, id: &str) -> Result<(), ApiError> {
        if !self.sees(queue) {
            tracing::debug!(
                token = self.token_name().unwrap_or(""),
                operation = operation.as_str(),
                "OJS request for a job outside the token's queues"
            );
            return Err(ApiError::NotFound {
                resource_type: "job",
                resource_id: id.to_owned(),
            });
        }
        self.allow_on(operation, queue)
    }

    pub fn scope(&self) -> &[Glob] {
        self.0.map_or(&[], |t| t.queues.as_slice())
    }

    /// Whether listings may show `queue` (and its jobs and events).
    pub fn sees(&self, queue: &str) -> bool {
        self.0.is_none_or(|t| t.covers(queue))
    }

    fn denied(&self, operation: Operation, scope: String) -> ApiError {
        tracing::debug!(
            token = self.token_name().unwrap_or(""),
            operation = operation.as_str(),
            %scope,
            "OJS request outside the token's scope"
        );
        ApiError::PermissionDenied {
            operation: operation.as_str(),
            scope,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(name: &str, secret: &str, ops: &[Operation], queues: &[&str]) -> Token {
        Token {
            name: name.into(),
            secret: Secret::new(secret),
            operations: ops.to_vec(),
            queues: queues.iter().map(|q| Glob::new(q).unwrap()).collect(),
        }
    }

    #[test]
    fn a_token_allows_its_operations_on_its_queues() {
        let tokens = Tokens::new(vec![
            token(
                "producer",
                "p-123",
                &[Operation::Push],
                &["orders", "mail.*"],
            ),
            token("ops", "a-456", &[Operation::Admin], &[]),
        ]);
        assert!(matches!(
            tokens.identify(None),
            Err(ApiError::Unauthenticated)
        ));
        assert!(matches!(
            tokens.identify(Some("Bearer nope")),
            Err(ApiError::Unauthenticated)
        ));
        assert!(matches!(
            tokens.identify(Some("Basic p-123")),
            Err(ApiError::Unauthenticated)
        ));
        let producer = tokens.identify(Some("Bearer p-123")).unwrap();
        assert_eq!(producer.token_name(), Some("producer"));
        assert!(producer.allow_on(Operation::Push, "orders").is_ok());
        assert!(producer.allow_on(Operation::Push, "mail.eu").is_ok());
        let e = producer.allow_on(Operation::Push, "billing").unwrap_err();
        assert_eq!(e.code(), crate::error::ErrorCode::PermissionDenied);
        assert!(!e.to_string().contains("p-123"));
        assert_eq!(
            producer.allow(Operation::Read).unwrap_err().code().as_str(),
            "permission_denied"
        );
        assert!(producer.sees("orders") && !producer.sees("billing"));
        let ops = tokens.identify(Some("bearer  a-456 ")).unwrap();
        assert!(ops.allow_on(Operation::Read, "billing").is_ok());
        assert!(ops.allow_on(Operation::Admin, "anything").is_ok());
        let none = Tokens::default();
        let open = none.identify(None).unwrap();
        assert!(open.allow_on(Operation::Admin, "x").is_ok());
    }

    #[test]
    fn what_belongs_to_no_queue_needs_every_queue() {
        let tokens = Tokens::new(vec![
            token("tenant", "t-1", &[Operation::Admin], &["tenant-a.*"]),
            token("stars", "s-1", &[Operation::Admin], &["*"]),
            token("all", "a-1", &[Operation::Admin], &[]),
            token("worker", "w-1", &[Operation::Work], &[]),
        ]);
        let grant = |secret: &str| tokens.identify(Some(&format!("Bearer {secret}"))).unwrap();
        assert_eq!(
            grant("t-1")
                .allow_everywhere(Operation::Admin)
                .unwrap_err()
                .code(),
            crate::error::ErrorCode::PermissionDenied
        );
        assert!(grant("s-1").allow_everywhere(Operation::Admin).is_ok());
        assert!(grant("a-1").allow_everywhere(Operation::Admin).is_ok());
        assert!(grant("w-1").allow_everywhere(Operation::Admin).is_err());
    }
}
