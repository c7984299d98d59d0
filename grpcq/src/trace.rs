//! W3C Trace Context (`traceparent`) continued across queues.
//!
//! The worker reads the `traceparent` of each call or job, runs the handler
//! as a child span of it (same trace id, a new span id, recorded on the
//! handler's tracing span), and makes that context current for the
//! handler's task: calls published and jobs enqueued from inside the handler
//! carry a `traceparent` whose parent is the handler, so one trace follows
//! the work through every hop. No OpenTelemetry SDK is needed for this; an
//! exporter can read the ids from the span fields.

use std::fmt::Write as _;
use std::future::Future;

/// One hop of a distributed trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    /// 16-byte trace id (never all zero).
    pub trace_id: [u8; 16],
    /// 8-byte id of this span (never all zero).
    pub span_id: [u8; 8],
    /// Trace flags (bit 0: sampled).
    pub flags: u8,
}

tokio::task_local! {
    static CURRENT: TraceContext;
}

fn hex_bytes<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != N * 2
        || !text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return None;
    }
    let mut out = [0u8; N];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[i * 2..i * 2 + 2], 16).ok()?;
    }
    Some(out)
}

fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

fn random_span_id() -> [u8; 8] {
    loop {
        let bytes = uuid::Uuid::new_v4().into_bytes();
        let mut id = [0u8; 8];
        // Bytes 6 and 8 carry the UUID version and variant: take the rest.
        id[..6].copy_from_slice(&bytes[..6]);
        id[6..].copy_from_slice(&bytes[9..11]);
        if id != [0; 8] {
            return id;
        }
    }
}

impl TraceContext {
    /// Parses a `traceparent` header (W3C Trace Context level 1): version
    /// `00` exactly; higher versions by their first four fields; `ff`,
    /// all-zero ids, upper-case hex and wrong lengths are refused.
    pub fn parse(traceparent: &str) -> Option<TraceContext> {
        let t = traceparent.trim();
        let mut parts = t.splitn(5, '-');
        let version = parts.next()?;
        let trace_id = hex_bytes::<16>(parts.next()?)?;
        let span_id = hex_bytes::<8>(parts.next()?)?;
        let flags = hex_bytes::<1>(parts.next()?)?[0];
        let rest = parts.next();
        let version = hex_bytes::<1>(version)?[0];
        if version == 0xff || (version == 0 && rest.is_some()) {
            return None;
        }
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceContext {
            trace_id,
            span_id,
            flags,
        })
    }

    /// A child: same trace, a new span id, same flags.
    pub fn child(&self) -> TraceContext {
        TraceContext {
            span_id: random_span_id(),
            ..*self
        }
    }

    /// The `traceparent` header naming this span as the parent.
    pub fn traceparent(&self) -> String {
        format!(
            "00-{}-{}-{:02x}",
            hex(&self.trace_id),
            hex(&self.span_id),
            self.flags
        )
    }

    /// Trace id as 32 hex digits.
    pub fn trace_id_hex(&self) -> String {
        hex(&self.trace_id)
    }

    /// Span id as 16 hex digits.
    pub fn span_id_hex(&self) -> String {
        hex(&self.span_id)
    }

    /// The context current in this task (set by the worker around a
    /// handler), if any.
    pub fn current() -> Option<TraceContext> {
        CURRENT.try_with(|c| *c).ok()
    }

    /// Runs `fut` with this context current.
    pub async fn scope<F: Future>(self, fut: F) -> F::Output {
        CURRENT.scope(self, fut).await
    }

    /// The `traceparent` for a message published now: a child of the
    /// current context, so the receiver's span is a grandchild of ours.
    pub fn outgoing() -> Option<String> {
        TraceContext::current().map(|c| c.traceparent())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_and_prints_w3c_traceparent() {
        let c = TraceContext::parse(SAMPLE).unwrap();
        assert_eq!(c.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(c.span_id_hex(), "00f067aa0ba902b7");
        assert_eq!(c.flags, 1);
        assert_eq!(c.traceparent(), SAMPLE);
        // Future versions: the first four fields count, the rest is ignored.
        assert!(TraceContext::parse(&format!("cc{}-what-ever", &SAMPLE[2..])).is_some());
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert!(TraceContext::parse(bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn a_child_keeps_the_trace_and_gets_a_new_span() {
        let parent = TraceContext::parse(SAMPLE).unwrap();
        let child = parent.child();
        assert_eq!(child.trace_id, parent.trace_id);
        assert_ne!(child.span_id, parent.span_id);
        assert_ne!(child.span_id, [0; 8]);
        assert_eq!(child.flags, parent.flags);
        assert_ne!(parent.child().span_id, child.span_id);
    }

    #[tokio::test]
    async fn the_current_context_is_scoped_to_the_task() {
        assert_eq!(TraceContext::current(), None);
        let c = TraceContext::parse(SAMPLE).unwrap();
        let inside = c.scope(async { TraceContext::outgoing() }).await;
        assert_eq!(inside.as_deref(), Some(SAMPLE));
        assert_eq!(TraceContext::current(), None);
    }
}
