//! Decoding a delivery by its content type, here where both codecs are
//! known (an OJS envelope or a grpcq call): the one function the daemon,
//! the grpcq worker, the OJS API's workers and `ojs-bridge tail` share, so
//! that a body means the same everywhere and fails with the same named
//! reason.

use ojs_core::envelope::media::Encoding;
use ojs_core::{Error, JobEnvelope};
use ojs_queue::{DeadLetterReason, Delivery};

use crate as grpcq;

/// The message a delivery carries.
#[derive(Debug, Clone, PartialEq)]
pub enum Incoming {
    /// A grpcq call.
    Call(grpcq::Call),
    /// An OJS job (boxed: it is several times the size of a call).
    Job(Box<JobEnvelope>),
}

impl Incoming {
    /// When the message was created, Unix ms (for end-to-end latency).
    pub fn created_ms(&self) -> Option<i64> {
        match self {
            Incoming::Call(m) => (m.timestamp_ms() > 0).then_some(m.timestamp_ms()),
            Incoming::Job(j) => j.enqueued_at.or(j.created_at).map(|t| t.timestamp_millis()),
        }
    }
}

/// Everything a delivery carries: a delimited stream or a JSON array may
/// hold several envelopes (`tail` shows them all).
#[derive(Debug, Clone, PartialEq)]
pub enum Decoded {
    /// A grpcq call.
    Call(grpcq::Call),
    /// One or more OJS jobs.
    Jobs(Vec<JobEnvelope>),
}

/// Where decoding stopped, which names the dead-letter reason.
enum Failed {
    /// No usable content type.
    Encoding(Error),
    /// Not a grpcq.Message.
    Call(Error),
    /// Not an envelope (or not a valid one).
    Envelope(Error),
}

fn decode_parts(d: &Delivery, default: Option<Encoding>) -> Result<Decoded, Failed> {
    match d.encoding(default).map_err(Failed::Encoding)? {
        Encoding::GrpcqProto => grpcq::Call::decode_lenient(&d.payload)
            .map(Decoded::Call)
            .map_err(Failed::Call),
        envelope => envelope
            .decode_envelopes(&d.payload)
            .map(Decoded::Jobs)
            .map_err(Failed::Envelope),
    }
}

/// Decoding of a [`Delivery`] (`use ojs_grpcq::Decode as _`).
pub trait Decode {
    /// The one message this delivery carries, decoded by its content type
    /// (`default` when it has none), or why it belongs in the dead letters:
    /// `unknown_content_type`, `undecodable`, `invalid_envelope`,
    /// `unsupported_batch` (more than one envelope).
    fn decode(&self, default: Option<Encoding>) -> Result<Incoming, DeadLetterReason>;

    /// Everything this delivery carries, decoded by its content type
    /// (`default` when it has none).
    fn decode_all(&self, default: Option<Encoding>) -> Result<Decoded, Error>;
}

impl Decode for Delivery {
    /// The one message this delivery carries, decoded by its content type
    /// (`default` when it has none), or why it belongs in the dead letters:
    /// `unknown_content_type`, `undecodable`, `invalid_envelope`,
    /// `unsupported_batch` (more than one envelope).
    fn decode(&self, default: Option<Encoding>) -> Result<Incoming, DeadLetterReason> {
        match decode_parts(self, default) {
            Ok(Decoded::Call(call)) => Ok(Incoming::Call(call)),
            Ok(Decoded::Jobs(mut jobs)) if jobs.len() == 1 => {
                Ok(Incoming::Job(Box::new(jobs.remove(0))))
            }
            Ok(Decoded::Jobs(jobs)) => Err(DeadLetterReason::of(
                ojs_queue::DeadLetterKind::UnsupportedBatch,
                format!(
                    "a message must carry one envelope, this one has {}",
                    jobs.len()
                ),
            )),
            Err(Failed::Encoding(e)) => Err(DeadLetterReason::of(
                match e {
                    Error::UnknownContentType(_) => ojs_queue::DeadLetterKind::UnknownContentType,
                    _ => ojs_queue::DeadLetterKind::Undecodable,
                },
                e.to_string(),
            )),
            Err(Failed::Call(e)) => Err(DeadLetterReason::of(
                ojs_queue::DeadLetterKind::Undecodable,
                format!("not a grpcq.Message: {e}"),
            )),
            Err(Failed::Envelope(e)) => Err(DeadLetterReason::for_envelope(&e)),
        }
    }

    /// Everything this delivery carries, decoded by its content type
    /// (`default` when it has none).
    fn decode_all(&self, default: Option<Encoding>) -> Result<Decoded, Error> {
        decode_parts(self, default).map_err(|f| match f {
            Failed::Encoding(e) | Failed::Call(e) | Failed::Envelope(e) => e,
        })
    }
}
