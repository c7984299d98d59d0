//! The heart of ojs-bridge: the OJS job envelope and its codecs, content types,
//! and the [`QueueAdapter`] contract that every broker adapter implements.
//! It knows no grpcq: grpcq calls, their runtime and their mapping to jobs
//! are `ojs-grpcq`, built on this crate.
//!
//! ```no_run
//! use ojs_core::{Encoding, JobEnvelope};
//! use serde_json::json;
//!
//! let job = JobEnvelope::new("email.send", vec![json!("user@example.com")]).with_queue("mail");
//! let bytes = job.to_proto_bytes()?;                 // application/openjobspec+proto
//! let back = JobEnvelope::from_proto_bytes(&bytes)?;
//! assert_eq!(back.to_json_value()?, job.to_json_value()?);
//! assert_eq!(Encoding::negotiate("application/openjobspec+proto")?, Encoding::OjsProto);
//! # Ok::<(), ojs_core::Error>(())
//! ```

// The architecture, one folder each: `envelope/` (the OJS envelope, its
// codecs and media types), `adapter/` (the contract every broker adapter
// implements, its settings, the consume loop), then federation (an adapter
// over adapters).
pub mod adapter;
pub mod duration;
pub mod envelope;
mod error;
pub mod federation;
#[doc(hidden)]
pub mod fuzz_targets;
pub mod glob;
pub mod redact;

pub use adapter::{
    batch_of, header, Acknowledger, AsAny, Consumer, ConsumerOptions, DeadLetterKind,
    DeadLetterReason, Delivery, DeliveryRef, FailedPublish, HeaderName, HeaderValue, Headers,
    Health, Nack, OutgoingMessage, PublishFailure, QueueAdapter, Source,
};
pub use envelope::media::Encoding;
pub use envelope::value::MAX_VALUE_DEPTH;
pub use envelope::{JobEnvelope, JobError, JobState, RetryPolicy, UniquePolicy};
pub use error::{BoxError, BrokerErrorKind, Error, Result};
