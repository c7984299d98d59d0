//! The backend-agnostic queue contract every broker adapter implements,
//! built on the OJS envelope (`ojs-core`) and knowing no grpcq.
//!
//! Object-safe (`Arc<dyn QueueAdapter>`) so that the daemon picks backends from
//! configuration. Semantics, the same for every adapter:
//!
//! * **publish** resolves only once the broker accepted every message; when
//!   some were not accepted the error is [`Error::Publish`], which lists each
//!   failed message (handed back, never lost) with its own error. Messages
//!   over [`QueueAdapter::max_message_bytes`] fail with
//!   [`Error::PayloadTooLarge`] before anything is sent.
//! * **consume** goes through a [`Consumer`]; [`Consumer::receive`] waits at
//!   most the given time and is cancellation-safe: dropping its future never
//!   loses a message (unacknowledged messages come back).
//! * **ack / nack** belong to each [`Delivery`]. Acknowledging a delivery a
//!   second time is an error ([`Error::AlreadyAcknowledged`]), not a silent
//!   success, so double handling shows up in tests and logs.
//! * A delivery that is neither acked nor nacked comes back once its
//!   consumer goes away or its visibility timeout ends.

pub mod backoff;
mod error;
pub mod federation;
mod headers;
pub mod log_limit;
pub mod metrics;
pub mod receiver;
pub mod settings;

use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use futures::future::join_all;

pub use error::{BoxError, BrokerErrorKind, Error, Result};
use ojs_core::envelope::media::Encoding;
use ojs_core::envelope::JobEnvelope;

pub use headers::{HeaderName, HeaderValue, Headers};

/// Header names shared by all adapters (docs/design.md §4).
pub mod header {
    /// The body's media type.
    pub const CONTENT_TYPE: &str = "content-type";
    /// Envelope `specversion`.
    pub const SPECVERSION: &str = "ojs-specversion";
    /// Envelope `id`.
    pub const ID: &str = "ojs-id";
    /// Envelope `type`.
    pub const TYPE: &str = "ojs-type";
    /// Envelope `queue`.
    pub const QUEUE: &str = "ojs-queue";
    /// Delivery attempt carried across republishes.
    pub const ATTEMPT: &str = "ojs-attempt";
    /// W3C trace context.
    pub const TRACEPARENT: &str = "traceparent";
    /// W3C trace state.
    pub const TRACESTATE: &str = "tracestate";
    /// Dead-letter reason: error type.
    pub const ERROR_TYPE: &str = "ojs-error-type";
    /// Dead-letter reason: message.
    pub const ERROR_MESSAGE: &str = "ojs-error-message";
    /// A dead letter too large for its destination went without its body;
    /// this is the body's size in bytes (the original stays where it was
    /// read: Kafka `ojs-source-topic`/`-partition`/`-offset`).
    pub const PAYLOAD_OMITTED: &str = "ojs-payload-omitted";
    /// A dead letter its destination refused with the headers it came
    /// with went with only the headers named here; this is how many were
    /// left out.
    pub const HEADERS_OMITTED: &str = "ojs-headers-omitted";
    /// On a dead letter: what keeps its record when it is not the broker
    /// (`ojs-server`: an OJS server's job store, which the broker's copy
    /// follows; `ojs-bridge dead-letters` acts on such copies through the
    /// server).
    pub const DEAD_LETTER_RECORD: &str = "ojs-dead-letter-record";
    /// grpcq topic (grpcq's SQS attribute name).
    pub const GRPCQ_TOPIC: &str = "topic";
    /// grpcq action.
    pub const GRPCQ_ACTION: &str = "action";
    /// grpcq originator.
    pub const GRPCQ_ORIGINATOR: &str = "originator";

    /// Whether `name` is one of the names above (the OJS binding, the
    /// dead-letter reason, grpcq's attributes).
    pub fn is_known(name: &str) -> bool {
        super::headers::is_known(name)
    }
}

/// A message to publish.
#[derive(Debug, Clone, PartialEq)]
pub struct OutgoingMessage {
    /// Body bytes.
    pub payload: Bytes,
    /// Headers, `content-type` at least.
    pub headers: Headers,
    /// Ordering key: messages with the same key keep their order where the
    /// broker can (Kafka partition key, SQS FIFO group).
    pub key: Option<Bytes>,
    /// Stable id (job id / grpcq message id): broker message id, dedup id.
    pub message_id: Option<String>,
    /// Higher is delivered first where the broker supports priorities.
    pub priority: i32,
    /// Not to be delivered before this time.
    pub deliver_at: Option<DateTime<Utc>>,
    /// The envelope `payload` was encoded from, when its producer kept it
    /// for a sink that works on the job itself (a federation): that sink
    /// then never parses the payload again. It must describe `payload`;
    /// whatever changes the payload drops it. Adapters ignore it.
    pub envelope: Option<std::sync::Arc<JobEnvelope>>,
}

impl OutgoingMessage {
    /// A message with a body and its content type.
    pub fn new(payload: impl Into<Bytes>, content_type: &str) -> Self {
        let mut headers = Headers::with_capacity(8);
        headers.insert(header::CONTENT_TYPE, HeaderValue::media_type(content_type));
        OutgoingMessage {
            payload: payload.into(),
            headers,
            key: None,
            message_id: None,
            priority: 0,
            deliver_at: None,
            envelope: None,
        }
    }

    /// Keeps `job`, the envelope the payload was encoded from (see
    /// [`OutgoingMessage::envelope`]).
    pub fn with_envelope(mut self, job: JobEnvelope) -> Self {
        self.envelope = Some(std::sync::Arc::new(job));
        self
    }

    /// Encodes an envelope and fills the binding headers of docs/design.md §4:
    /// `content-type`, `ojs-specversion`, `ojs-id`, `ojs-type`, `ojs-queue`,
    /// `ojs-attempt`, `traceparent`/`tracestate` from meta; key = meta
    /// `partition_key` or the job id.
    pub fn from_envelope(job: &JobEnvelope, encoding: Encoding) -> ojs_core::Result<Self> {
        let payload = match encoding {
            Encoding::OjsProto => job.to_proto_bytes()?,
            Encoding::OjsJson => job.to_json_vec()?,
            Encoding::OjsProtoDelimited => ojs_core::envelope::stream::encode_delimited([job])?,
            Encoding::GrpcqProto => {
                return Err(ojs_core::Error::UnknownContentType(format!(
                    "{encoding} cannot carry an OJS envelope"
                )))
            }
        };
        let mut msg = OutgoingMessage::new(payload, encoding.media_type());
        let h = &mut msg.headers;
        h.insert(header::SPECVERSION, job.specversion.as_str());
        h.insert(header::ID, job.id.as_str());
        h.insert(header::TYPE, job.job_type.as_str());
        h.insert(header::QUEUE, job.queue.as_str());
        if job.attempt > 0 {
            h.insert(header::ATTEMPT, job.attempt.to_string());
        }
        for key in [header::TRACEPARENT, header::TRACESTATE] {
            if let Some(v) = job.meta_str(key) {
                h.insert(key, v);
            }
        }
        msg.key = Some(Bytes::from(
            job.meta_str("partition_key")
                .map_or_else(|| job.id.clone(), str::to_owned),
        ));
        msg.message_id = Some(job.id.clone());
        msg.priority = job.priority;
        msg.deliver_at = job.scheduled_at;
        Ok(msg)
    }

    /// Sets one header (builder style).
    pub fn with_header(
        mut self,
        name: impl Into<HeaderName>,
        value: impl Into<HeaderValue>,
    ) -> Self {
        self.headers.insert(name, value);
        self
    }

    /// Sets the ordering key (builder style). Keys are bytes: a binary
    /// Kafka key goes out again exactly as it came in.
    pub fn with_key(mut self, key: impl Into<Bytes>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// The `content-type` header.
    pub fn content_type(&self) -> Option<&str> {
        self.headers.get_str(header::CONTENT_TYPE)
    }

    /// Bytes on the wire for size limits: body plus header names and values.
    pub fn encoded_size(&self) -> usize {
        self.payload.len() + self.headers.encoded_size()
    }

    /// [`Error::PayloadTooLarge`] when over `limit`.
    pub fn check_size(&self, limit: usize) -> Result<()> {
        let size = self.encoded_size();
        if size > limit {
            Err(Error::PayloadTooLarge { size, limit })
        } else {
            Ok(())
        }
    }
}

/// One message of a batch that the broker did not accept.
#[derive(Debug)]
pub struct FailedPublish {
    /// Position in the batch given to `publish`.
    pub index: usize,
    /// The message, handed back so the caller can retry or dead-letter it.
    pub message: OutgoingMessage,
    /// Why it failed.
    pub error: Error,
}

/// Which messages of a batch failed (the others were accepted).
#[derive(Debug)]
pub struct PublishFailure {
    /// Size of the batch.
    pub total: usize,
    /// The failed messages, by index.
    pub failed: Vec<FailedPublish>,
}

impl fmt::Display for PublishFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} of {} messages not published",
            self.failed.len(),
            self.total
        )?;
        if let Some(first) = self.failed.first() {
            write!(f, " (message {}: {})", first.index, first.error)?;
        }
        Ok(())
    }
}

impl PublishFailure {
    /// Every message of `messages` failed with an error made by `error`.
    pub fn all(messages: Vec<OutgoingMessage>, error: impl Fn() -> Error) -> Self {
        let total = messages.len();
        PublishFailure {
            total,
            failed: messages
                .into_iter()
                .enumerate()
                .map(|(index, message)| FailedPublish {
                    index,
                    message,
                    error: error(),
                })
                .collect(),
        }
    }
}

/// The reasons ojs-bridge itself gives for dead-lettering a message, each
/// with the `ojs-error-type` it writes. Reasons read back from a broker are
/// whatever their writer said ([`DeadLetterReason::error_type`] is text).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeadLetterKind {
    /// Bytes that do not decode as their content type says.
    Undecodable,
    /// An envelope that decodes but breaks the OJS schema.
    InvalidEnvelope,
    /// A content type no codec reads.
    UnknownContentType,
    /// A batch (`BatchEnqueueRequest`, delimited envelopes) where one
    /// message was expected.
    UnsupportedBatch,
    /// No route (daemon) or handler (worker) takes the message.
    UnknownRoute,
    /// The route's mapping cannot make a valid job or call of it.
    Unmappable,
    /// The payload does not transcode with the route's descriptor set.
    Untranscodable,
    /// Larger than the sink takes.
    PayloadTooLarge,
    /// A destination the route does not allow.
    ForbiddenDestination,
    /// More distinct destinations than the route allows.
    TooManyDestinations,
    /// The sink refused this message, for the message's sake.
    SinkRejected,
    /// A federation region that does not exist.
    UnknownRegion,
    /// Delivered as often as the consumer allows without being settled.
    MaxDeliveries,
}

impl DeadLetterKind {
    /// Every kind, for documentation and tests.
    pub const ALL: &'static [DeadLetterKind] = &[
        DeadLetterKind::Undecodable,
        DeadLetterKind::InvalidEnvelope,
        DeadLetterKind::UnknownContentType,
        DeadLetterKind::UnsupportedBatch,
        DeadLetterKind::UnknownRoute,
        DeadLetterKind::Unmappable,
        DeadLetterKind::Untranscodable,
        DeadLetterKind::PayloadTooLarge,
        DeadLetterKind::ForbiddenDestination,
        DeadLetterKind::TooManyDestinations,
        DeadLetterKind::SinkRejected,
        DeadLetterKind::UnknownRegion,
        DeadLetterKind::MaxDeliveries,
    ];

    /// The `ojs-error-type` written for it (also the `reason` label of
    /// `ojs_bridge_dead_lettered_total`).
    pub const fn as_str(self) -> &'static str {
        match self {
            DeadLetterKind::Undecodable => "undecodable",
            DeadLetterKind::InvalidEnvelope => "invalid_envelope",
            DeadLetterKind::UnknownContentType => "unknown_content_type",
            DeadLetterKind::UnsupportedBatch => "unsupported_batch",
            DeadLetterKind::UnknownRoute => "unknown_route",
            DeadLetterKind::Unmappable => "unmappable",
            DeadLetterKind::Untranscodable => "untranscodable",
            DeadLetterKind::PayloadTooLarge => "payload_too_large",
            DeadLetterKind::ForbiddenDestination => "forbidden_destination",
            DeadLetterKind::TooManyDestinations => "too_many_destinations",
            DeadLetterKind::SinkRejected => "sink_rejected",
            DeadLetterKind::UnknownRegion => "unknown_region",
            DeadLetterKind::MaxDeliveries => "max_deliveries",
        }
    }
}

impl fmt::Display for DeadLetterKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a message is dead-lettered; travels in `ojs-error-type` /
/// `ojs-error-message` headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterReason {
    /// Short machine-readable kind (`unknown_content_type`, `max_attempts`…).
    pub error_type: String,
    /// Human-readable explanation.
    pub message: String,
    /// What keeps the dead letter's record, when not the broker
    /// ([`header::DEAD_LETTER_RECORD`]).
    pub record: Option<String>,
}

impl DeadLetterReason {
    /// A reason from its parts.
    pub fn new(error_type: impl Into<String>, message: impl Into<String>) -> Self {
        DeadLetterReason {
            error_type: error_type.into(),
            message: message.into(),
            record: None,
        }
    }

    /// The same reason, naming what keeps the dead letter's record.
    #[must_use]
    pub fn with_record(mut self, record: impl Into<String>) -> Self {
        self.record = Some(record.into());
        self
    }

    /// One of the reasons ojs-bridge gives, with its explanation.
    pub fn of(kind: DeadLetterKind, message: impl Into<String>) -> Self {
        DeadLetterReason::new(kind.as_str(), message)
    }

    /// Why an envelope read from a broker is refused: `invalid_envelope`
    /// (with the attribute and the rule) when it parsed but breaks the OJS
    /// schema, `undecodable` when it did not parse.
    pub fn for_envelope(error: &ojs_core::Error) -> Self {
        let kind = if error.is_schema_violation() {
            DeadLetterKind::InvalidEnvelope
        } else {
            DeadLetterKind::Undecodable
        };
        DeadLetterReason::of(kind, error.to_string())
    }

    /// Writes the reason into headers.
    pub fn write_headers(&self, headers: &mut Headers) {
        headers.insert(header::ERROR_TYPE, self.error_type.as_str());
        headers.insert(header::ERROR_MESSAGE, self.message.as_str());
        if let Some(record) = &self.record {
            headers.insert(header::DEAD_LETTER_RECORD, record.as_str());
        }
    }
}

/// What to do with a message that was not handled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Nack {
    /// Deliver again after `delay` (zero: as soon as possible); the attempt
    /// count goes up.
    Retry {
        /// Earliest redelivery.
        delay: Duration,
    },
    /// Move to the queue's dead-letter destination with the reason.
    DeadLetter(DeadLetterReason),
    /// Give the message back as it was, to be delivered again as soon as
    /// possible: it was looked at or never handed out (a listing, a `tail`
    /// without `--ack`, a FETCH's excess), so it is not a delivery attempt
    /// and its attempt count stays. Where the broker itself counts
    /// receives (SQS's `ApproximateReceiveCount`) that count still rises.
    /// Never dead-letters, whatever `max_deliveries` says.
    Release,
}

impl Nack {
    /// Redeliver now.
    pub fn requeue() -> Self {
        Nack::Retry {
            delay: Duration::ZERO,
        }
    }

    /// Redeliver after `delay`.
    pub fn retry_after(delay: Duration) -> Self {
        Nack::Retry { delay }
    }
}

/// The delivery being settled, borrowed from it: what an adapter needs to
/// republish a retry or dead-letter copy, without copying every message up
/// front in case it is nacked.
#[derive(Debug, Clone, Copy)]
pub struct DeliveryRef<'a> {
    /// Body bytes.
    pub payload: &'a Bytes,
    /// Headers.
    pub headers: &'a Headers,
    /// Ordering key.
    pub key: Option<&'a [u8]>,
    /// Broker message id.
    pub message_id: Option<&'a str>,
    /// Attempt of this delivery.
    pub attempt: u32,
}

impl DeliveryRef<'_> {
    /// The message as an outgoing copy (for retry and dead-letter topics).
    pub fn to_outgoing(&self) -> OutgoingMessage {
        OutgoingMessage {
            payload: self.payload.clone(),
            headers: self.headers.clone(),
            key: self.key.map(Bytes::copy_from_slice),
            message_id: self.message_id.map(str::to_owned),
            priority: 0,
            deliver_at: None,
            envelope: None,
        }
    }
}

/// A view of an acknowledger as [`Any`], so that an adapter settling a
/// batch ([`Acknowledger::ack_batch`]) can recognise its own. Implemented
/// for every `'static` type: adapters write nothing for it.
pub trait AsAny {
    /// `self`, as [`Any`].
    fn as_any(&self) -> &dyn Any;
}

impl<T: Any> AsAny for T {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The members of an [`Acknowledger::ack_batch`] batch as the adapter's own
/// acknowledger type `T`, when every one is a `T` for which `same` holds
/// (of the same consumer); `None` when one is not.
pub fn batch_of<'a, T: Acknowledger + 'static>(
    batch: &[&'a dyn Acknowledger],
    same: impl Fn(&T) -> bool,
) -> Option<Vec<&'a T>> {
    batch
        .iter()
        .map(|acker| {
            AsAny::as_any(*acker)
                .downcast_ref::<T>()
                .filter(|t| same(t))
        })
        .collect()
}

/// The adapter-specific half of a delivery: how to settle it.
#[async_trait]
pub trait Acknowledger: AsAny + Send + Sync + fmt::Debug {
    /// The message was handled; remove it.
    async fn ack(&self) -> Result<()>;
    /// Acknowledges without waiting, when the adapter's ack is bookkeeping
    /// in this process (Kafka's offset tracker): saves the boxed future of
    /// [`Acknowledger::ack`] on the hot path. `None` means "call `ack`".
    fn ack_now(&self) -> Option<Result<()>> {
        None
    }
    /// Acknowledges `batch` together — one lock, one write, one request —
    /// where the adapter can: a sink confirms hundreds of messages at once,
    /// and settling each under its own lock (or its own channel message)
    /// costs more than the bookkeeping itself. `batch` holds `self` and the
    /// acknowledgers of other deliveries; an adapter settles them only when
    /// each is its own kind and of the same consumer (checked through
    /// [`AsAny::as_any`]), and returns one result per member, in order.
    /// `None` (the default, or a batch it does not recognise) means "ack
    /// each": [`Delivery::ack_all`] then does.
    async fn ack_batch(&self, batch: &[&dyn Acknowledger]) -> Option<Vec<Result<()>>> {
        let _ = batch;
        None
    }
    /// The message was not handled. `delivery` is the message as received.
    async fn nack(&self, action: Nack, delivery: DeliveryRef<'_>) -> Result<()>;
    /// Keeps the message invisible to others for `by` more (heartbeat).
    /// Brokers without visibility timeouts (RabbitMQ, Kafka) need nothing.
    async fn extend(&self, by: Duration) -> Result<()> {
        let _ = by;
        Ok(())
    }
}

const PENDING: u8 = 0;
const SETTLING: u8 = 1;
const ACKED: u8 = 2;
const NACKED: u8 = 3;

/// A received message that owns its acknowledgement.
#[derive(Debug)]
pub struct Delivery {
    /// Body bytes.
    pub payload: Bytes,
    /// Headers, normalised to the names in [`header`].
    pub headers: Headers,
    /// 1 on first delivery, counted up on every redelivery and retry.
    pub attempt: u32,
    /// Ordering key, when the broker keeps one.
    pub key: Option<Bytes>,
    /// Broker message id.
    pub message_id: Option<String>,
    /// Queue it came from (the OJS queue name, not the broker's); shared, as
    /// every delivery of a consumer names the same queue.
    pub queue: Arc<str>,
    acker: Box<dyn Acknowledger>,
    state: AtomicU8,
}

impl Delivery {
    /// Assembles a delivery (for adapter implementations).
    pub fn new(
        payload: Bytes,
        headers: Headers,
        attempt: u32,
        queue: impl Into<Arc<str>>,
        acker: Box<dyn Acknowledger>,
    ) -> Self {
        Delivery {
            payload,
            headers,
            attempt,
            key: None,
            message_id: None,
            queue: queue.into(),
            acker,
            state: AtomicU8::new(PENDING),
        }
    }

    /// The `content-type` header.
    pub fn content_type(&self) -> Option<&str> {
        self.headers.get_str(header::CONTENT_TYPE)
    }

    /// The encoding named by `content-type`, or `default` when there is
    /// none. An OJS default reads a body that starts with `{` as OJS JSON:
    /// the OJS project's own Kafka and SQS backends write JSON envelopes
    /// without a content type, and no binary `JobEnvelope` starts with that
    /// byte (it would open a protobuf group, which the schema never uses).
    pub fn encoding(&self, default: Option<Encoding>) -> ojs_core::Result<Encoding> {
        match (self.content_type(), default) {
            (Some(ct), _) => Encoding::from_content_type(ct),
            (None, Some(Encoding::OjsProto)) if looks_like_json_object(&self.payload) => {
                Ok(Encoding::OjsJson)
            }
            (None, default) => {
                default.ok_or_else(|| ojs_core::Error::UnknownContentType(String::new()))
            }
        }
    }

    /// The id of the one OJS job this delivery carries as a binary
    /// envelope, read without decoding the rest: for a consumer that may
    /// not need the rest (the job store holds the job). `None` for the
    /// other encodings and for bytes that are no envelope:
    /// [`Delivery::decode_job`] decodes those, or says why it cannot.
    pub fn job_id(&self, default: Option<Encoding>) -> Option<&str> {
        match self.encoding(default) {
            Ok(Encoding::OjsProto) => ojs_core::JobEnvelope::proto_id(&self.payload),
            _ => None,
        }
    }

    /// The one OJS job this delivery carries, decoded by its content type
    /// (`default` when it has none), or why it belongs in the dead letters
    /// of a queue of jobs: `unknown_content_type`, `undecodable` (also a
    /// grpcq call, which is no job), `invalid_envelope`, `unsupported_batch`
    /// (more than one envelope).
    pub fn decode_job(
        &self,
        default: Option<Encoding>,
    ) -> std::result::Result<ojs_core::JobEnvelope, DeadLetterReason> {
        let encoding = self.encoding(default).map_err(|e| {
            DeadLetterReason::of(
                match e {
                    ojs_core::Error::UnknownContentType(_) => DeadLetterKind::UnknownContentType,
                    _ => DeadLetterKind::Undecodable,
                },
                e.to_string(),
            )
        })?;
        if encoding == Encoding::GrpcqProto {
            return Err(DeadLetterReason::of(
                DeadLetterKind::Undecodable,
                "a grpcq call where OJS jobs are expected",
            ));
        }
        let mut jobs = encoding
            .decode_envelopes(&self.payload)
            .map_err(|e| DeadLetterReason::for_envelope(&e))?;
        match jobs.len() {
            1 => Ok(jobs.remove(0)),
            n => Err(DeadLetterReason::of(
                DeadLetterKind::UnsupportedBatch,
                format!("a message must carry one envelope, this one has {n}"),
            )),
        }
    }

    /// The dead-letter reason, on deliveries read from a dead-letter queue.
    pub fn dead_letter_reason(&self) -> Option<DeadLetterReason> {
        let error_type = self.headers.get(header::ERROR_TYPE)?;
        let reason = DeadLetterReason::new(
            error_type.to_str_lossy(),
            self.headers
                .get(header::ERROR_MESSAGE)
                .map(|m| m.to_str_lossy().into_owned())
                .unwrap_or_default(),
        );
        Some(match self.headers.get_str(header::DEAD_LETTER_RECORD) {
            Some(record) => reason.with_record(record),
            None => reason,
        })
    }

    /// Whether the delivery was acked or nacked already.
    pub fn is_settled(&self) -> bool {
        matches!(self.state.load(Ordering::Acquire), ACKED | NACKED)
    }

    fn begin(&self) -> Result<()> {
        match self
            .state
            .compare_exchange(PENDING, SETTLING, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Ok(()),
            Err(ACKED) => Err(Error::AlreadyAcknowledged("acked")),
            Err(NACKED) => Err(Error::AlreadyAcknowledged("nacked")),
            Err(_) => Err(Error::AlreadyAcknowledged("being settled")),
        }
    }

    fn finish(&self, result: &Result<()>, done: u8) {
        // A failed settle leaves the delivery pending so the caller may retry.
        let next = if result.is_ok() { done } else { PENDING };
        self.state.store(next, Ordering::Release);
    }

    /// Acknowledges at once when the adapter's ack is bookkeeping in this
    /// process ([`Acknowledger::ack_now`]): for acking many deliveries
    /// without a future each. `None` when the adapter has to wait for its
    /// broker: the delivery is then as it was, and [`Delivery::ack`] acks it.
    pub fn ack_now(&self) -> Option<Result<()>> {
        if let Err(e) = self.begin() {
            return Some(Err(e));
        }
        match self.acker.ack_now() {
            Some(result) => {
                self.finish(&result, ACKED);
                Some(result)
            }
            None => {
                self.state.store(PENDING, Ordering::Release);
                None
            }
        }
    }

    /// Acknowledges: the message is done. A second settle is an error.
    pub async fn ack(&self) -> Result<()> {
        self.begin()?;
        self.ack_begun().await
    }

    /// Acks a delivery whose settle has begun.
    async fn ack_begun(&self) -> Result<()> {
        let result = match self.acker.ack_now() {
            Some(result) => result,
            None => self.acker.ack().await,
        };
        self.finish(&result, ACKED);
        result
    }

    /// Acknowledges `deliveries` (of one consumer) together where their
    /// adapter settles a batch at once ([`Acknowledger::ack_batch`]), and
    /// otherwise each as [`Delivery::ack`] does, all at the same time. One
    /// result per delivery, in order; a delivery settled before gets
    /// [`Error::AlreadyAcknowledged`], as from `ack`.
    pub async fn ack_all(deliveries: &[&Delivery]) -> Vec<Result<()>> {
        let mut results: Vec<Option<Result<()>>> = deliveries
            .iter()
            .map(|d| d.begin().err().map(Err))
            .collect();
        let begun: Vec<usize> = (0..deliveries.len())
            .filter(|&i| results[i].is_none())
            .collect();
        let ackers: Vec<&dyn Acknowledger> = begun.iter().map(|&i| &*deliveries[i].acker).collect();
        let batched = match ackers.first() {
            Some(first) if ackers.len() > 1 => first.ack_batch(&ackers).await,
            _ => None,
        };
        // An adapter answers for every member or for none; were it to answer
        // for fewer, the rest are acked one by one below.
        let mut answered = 0;
        for (&i, result) in begun.iter().zip(batched.into_iter().flatten()) {
            deliveries[i].finish(&result, ACKED);
            results[i] = Some(result);
            answered += 1;
        }
        let rest = &begun[answered..];
        let one_by_one = join_all(rest.iter().map(|&i| deliveries[i].ack_begun())).await;
        for (&i, result) in rest.iter().zip(one_by_one) {
            results[i] = Some(result);
        }
        // Every slot is filled by now: refused at `begin`, batched, or acked
        // one by one.
        results
            .into_iter()
            .map(|r| r.unwrap_or(Err(Error::AlreadyAcknowledged("being settled"))))
            .collect()
    }

    /// The message as received, borrowed.
    pub fn view(&self) -> DeliveryRef<'_> {
        DeliveryRef {
            payload: &self.payload,
            headers: &self.headers,
            key: self.key.as_deref(),
            message_id: self.message_id.as_deref(),
            attempt: self.attempt,
        }
    }

    /// The message as an outgoing copy, to publish elsewhere (a dead-letter
    /// destination, another queue).
    pub fn to_outgoing(&self) -> OutgoingMessage {
        self.view().to_outgoing()
    }

    /// Negative acknowledgement: retry later or dead-letter.
    pub async fn nack(&self, action: Nack) -> Result<()> {
        self.begin()?;
        let result = self.acker.nack(action, self.view()).await;
        self.finish(&result, NACKED);
        result
    }

    /// Extends the visibility of a long-running message (heartbeat).
    pub async fn extend(&self, by: Duration) -> Result<()> {
        if self.is_settled() {
            return Err(Error::AlreadyAcknowledged("settled"));
        }
        self.acker.extend(by).await
    }
}

/// Where a consumer reads from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Source {
    /// The queue itself.
    #[default]
    Queue,
    /// The queue's dead-letter destination.
    DeadLetters,
}

/// How a consumer behaves. Adapters ignore what their broker does not have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerOptions {
    /// Consumer group (Kafka group id); consumers of one group share work.
    pub group: String,
    /// How long a received message stays invisible to others before it
    /// comes back (memory, local, SQS).
    pub visibility_timeout: Duration,
    /// Messages held unacknowledged at once (RabbitMQ prefetch). `0`:
    /// none waits in this process between receives — messages are taken
    /// from the broker only inside `receive` (RabbitMQ `basic.get`), so a
    /// receive of another process sharing the queue sees them; deliveries
    /// a receive returned stay held until settled.
    pub prefetch: u16,
    /// After this many deliveries the message is dead-lettered instead of
    /// delivered again (SQS `maxReceiveCount`); `None` = never.
    pub max_deliveries: Option<u32>,
    /// Queue or its dead letters.
    pub source: Source,
    /// Whether what this consumer receives may be dead-lettered (a daemon's
    /// source, a worker); `tail` only reads. An adapter whose dead-letter
    /// destination is missing warns about it only when it may be needed.
    pub may_dead_letter: bool,
}

impl Default for ConsumerOptions {
    fn default() -> Self {
        ConsumerOptions {
            group: "ojs-bridge".to_owned(),
            // SQS's default visibility timeout.
            visibility_timeout: Duration::from_secs(30),
            prefetch: 100,
            max_deliveries: None,
            source: Source::Queue,
            may_dead_letter: true,
        }
    }
}

/// A stream of deliveries from one queue.
#[async_trait]
pub trait Consumer: Send + fmt::Debug {
    /// Waits up to `wait` for at least one message and returns up to `max`.
    /// An empty vector means nothing arrived in time. Cancellation-safe.
    async fn receive(&mut self, max: usize, wait: Duration) -> Result<Vec<Delivery>>;

    /// Waits, at most `limit`, until the consumer can receive: a Kafka
    /// consumer's group join and partition assignment, which a short
    /// `receive` timeout would otherwise spend. Whether it is ready; brokers
    /// without a join are ready at once. A reader with an idle timeout
    /// (`tail`) starts its clock after this.
    async fn ready(&mut self, limit: Duration) -> Result<bool> {
        let _ = limit;
        Ok(true)
    }

    /// Leaves the queue: unacknowledged deliveries of this consumer become
    /// available to others. Dropping a consumer does the same, less politely.
    async fn close(self: Box<Self>) -> Result<()>;
}

/// Health as reported to `/ojs/v1/health` and to federation probes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// Whether the adapter can publish and consume right now.
    pub healthy: bool,
    /// What was checked, or what is wrong.
    pub detail: String,
}

impl Health {
    /// Healthy with a detail.
    pub fn ok(detail: impl Into<String>) -> Self {
        Health {
            healthy: true,
            detail: detail.into(),
        }
    }

    /// Unhealthy with the reason.
    pub fn down(detail: impl Into<String>) -> Self {
        Health {
            healthy: false,
            detail: detail.into(),
        }
    }
}

/// A queue backend.
#[async_trait]
pub trait QueueAdapter: Send + Sync + fmt::Debug {
    /// Short backend name: `memory`, `local`, `kafka`, `rabbitmq`, `sqs`.
    fn kind(&self) -> &'static str;

    /// Largest message ([`OutgoingMessage::encoded_size`]) this backend takes.
    fn max_message_bytes(&self) -> usize;

    /// Publishes a batch to `queue` (an OJS queue name). See the module docs
    /// for what success and [`Error::Publish`] promise.
    async fn publish(&self, queue: &str, messages: Vec<OutgoingMessage>) -> Result<()>;

    /// Opens a consumer on `queue`.
    async fn consumer(&self, queue: &str, options: ConsumerOptions) -> Result<Box<dyn Consumer>>;

    /// Makes `queue` ready to publish to, before the first publish: with
    /// `topology = "declare"` its broker resources are created when
    /// missing; with `existing` an error names what is missing (and nothing
    /// is created). Adapters without topology have nothing to do.
    async fn prepare(&self, queue: &str) -> Result<()> {
        let _ = queue;
        Ok(())
    }

    /// Creates a private reply queue for one client instance
    /// (request/response calls, `ojs-grpc`): named by the caller, used by
    /// nobody else, removed by [`delete_reply_queue`](Self::delete_reply_queue).
    /// Adapters that can tie it to their connection (RabbitMQ: exclusive,
    /// auto-delete) do, so a crashed client leaves nothing behind. The
    /// default prepares it like any queue.
    async fn open_reply_queue(&self, queue: &str) -> Result<()> {
        self.prepare(queue).await
    }

    /// Removes a reply queue made by
    /// [`open_reply_queue`](Self::open_reply_queue) and what is left in it.
    /// The default does nothing (queues without broker resources).
    async fn delete_reply_queue(&self, queue: &str) -> Result<()> {
        let _ = queue;
        Ok(())
    }

    /// Whether `queue` names one of the adapter's own internal destinations
    /// (a dead-letter queue or topic, a retry queue or topic) once mapped
    /// to a broker name. The daemon never lets a message choose one.
    fn is_reserved(&self, queue: &str) -> bool {
        let _ = queue;
        false
    }

    /// What, beside its name, makes this adapter's `queue` another than a
    /// same-named queue of another deployment on the same broker (a Kafka
    /// topic made by a topic template of its own), for naming the
    /// consumer groups of that queue apart; none where the adapter's names
    /// are its defaults (or the broker has no groups).
    fn group_scope(&self, queue: &str) -> Option<String> {
        let _ = queue;
        None
    }

    /// This adapter as a broker that moves messages between its own
    /// queues in one transaction ([`MoveWithin`]), where it is one.
    fn mover(&self) -> Option<&dyn MoveWithin> {
        None
    }

    /// Checks the connection to the broker.
    async fn health(&self) -> Health;

    /// Messages waiting in `queue` (not in flight), when the broker can tell.
    async fn depth(&self, queue: &str) -> Result<Option<u64>>;

    /// Flushes what was accepted and releases connections. Publishing after
    /// close is [`Error::Closed`].
    async fn close(&self) -> Result<()>;
}

/// What the planner of a [`MoveWithin::move_within`] makes of one message.
#[derive(Debug)]
pub enum MoveTo {
    /// Published to `queue` of the same broker.
    Queue {
        /// The destination queue.
        queue: String,
        /// What is published there.
        message: OutgoingMessage,
    },
    /// Moved to the broker's own dead letters of its queue, with the reason.
    DeadLetter(DeadLetterReason),
}

/// The planner of a move: one [`MoveTo`] for each delivery, in order. It
/// runs while the broker holds its write lock: it reads, maps and decides,
/// and settles nothing itself.
pub type MovePlanner = Box<dyn FnOnce(&[Delivery]) -> Vec<MoveTo> + Send>;

/// A broker whose queues share one transactional store (the embedded
/// broker), so that a message can go from one of its queues to another in
/// one transaction: taken, published, removed, all or none. What a
/// consumer, a publish and an ack do in three commits with a lease between
/// them is one commit with none, and a crash leaves each message either
/// where it was or moved: exactly once.
#[async_trait]
pub trait MoveWithin: Send + Sync {
    /// Takes up to `max` deliverable messages of `queue` (waiting up to
    /// `wait` for the first, as a consumer's receive does), hands them to
    /// `plan` as deliveries, and in one transaction publishes what `plan`
    /// made of each and removes it, or dead-letters it. A message larger
    /// than the broker takes is dead-lettered (`PayloadTooLarge`). Returns,
    /// in order, whether each message taken was published (`false`: it was
    /// dead-lettered); none when nothing came within `wait`. On an error
    /// nothing was taken.
    async fn move_within(
        &self,
        queue: &str,
        max: usize,
        wait: Duration,
        plan: MovePlanner,
    ) -> Result<Vec<bool>>;
}

/// Whether `payload` starts (after white space) with `{`.
fn looks_like_json_object(payload: &[u8]) -> bool {
    payload
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|b| *b == b'{')
}

/// Splits a batch into messages small enough for `limit` and the oversized
/// ones, which fail with [`Error::PayloadTooLarge`] without being sent.
pub fn partition_by_size(
    messages: Vec<OutgoingMessage>,
    limit: usize,
) -> (Vec<(usize, OutgoingMessage)>, Vec<FailedPublish>) {
    let mut ok = Vec::with_capacity(messages.len());
    let mut failed = Vec::new();
    for (index, message) in messages.into_iter().enumerate() {
        match message.check_size(limit) {
            Ok(()) => ok.push((index, message)),
            Err(error) => failed.push(FailedPublish {
                index,
                message,
                error,
            }),
        }
    }
    (ok, failed)
}

/// What `publish` may send after [`admit`]: (index in the batch, message).
pub type Admitted = Vec<(usize, OutgoingMessage)>;

/// The common front of every adapter's `publish`: a closed adapter refuses
/// the whole batch ([`Error::Closed`] per message); oversized messages fail
/// with [`Error::PayloadTooLarge`] before anything is sent. Returns the
/// batch size, what may be sent, and the failures so far.
pub fn admit(
    messages: Vec<OutgoingMessage>,
    limit: usize,
    closed: bool,
) -> Result<(usize, Admitted, Vec<FailedPublish>)> {
    if closed {
        return Err(Error::Publish(PublishFailure::all(messages, || {
            Error::Closed
        })));
    }
    let total = messages.len();
    let (accepted, failed) = partition_by_size(messages, limit);
    Ok((total, accepted, failed))
}

/// The common end of every adapter's `publish`: `Ok` when nothing failed,
/// else [`Error::Publish`] with the failures in batch order.
pub fn publish_outcome(total: usize, mut failed: Vec<FailedPublish>) -> Result<()> {
    if failed.is_empty() {
        return Ok(());
    }
    failed.sort_by_key(|f| f.index);
    Err(Error::Publish(PublishFailure { total, failed }))
}

#[cfg(test)]
mod decode_job_tests {
    use super::*;

    #[derive(Debug)]
    struct Unsettled;

    #[async_trait]
    impl Acknowledger for Unsettled {
        async fn ack(&self) -> Result<()> {
            Ok(())
        }

        async fn nack(&self, _action: Nack, _delivery: DeliveryRef<'_>) -> Result<()> {
            Ok(())
        }
    }

    fn delivery(payload: Vec<u8>, content_type: Option<&str>) -> Delivery {
        let mut headers = Headers::new();
        if let Some(ct) = content_type {
            headers.insert(header::CONTENT_TYPE, ct);
        }
        Delivery::new(Bytes::from(payload), headers, 1, "q", Box::new(Unsettled))
    }

    #[test]
    fn one_job_decodes_and_anything_else_is_named_for_the_dead_letters() {
        let job = JobEnvelope::new("a.b", vec![serde_json::json!(1)]);
        let one = delivery(
            job.to_json_vec().unwrap(),
            Some("application/openjobspec+json"),
        );
        assert_eq!(one.decode_job(None).unwrap().id, job.id);
        let two = delivery(
            ojs_core::envelope::stream::encode_delimited([&job, &job]).unwrap(),
            Some(Encoding::OjsProtoDelimited.media_type()),
        );
        let kind = |d: &Delivery| d.decode_job(None).unwrap_err().error_type;
        assert_eq!(kind(&two), "unsupported_batch");
        let call = delivery(vec![1, 2, 3], Some(Encoding::GrpcqProto.media_type()));
        assert_eq!(kind(&call), "undecodable");
        let unknown = delivery(b"x".to_vec(), Some("text/plain"));
        assert_eq!(kind(&unknown), "unknown_content_type");
        let invalid = delivery(
            br#"{"type": 1}"#.to_vec(),
            Some("application/openjobspec+json"),
        );
        assert!(["invalid_envelope", "undecodable"].contains(&kind(&invalid).as_str()));
    }
}
