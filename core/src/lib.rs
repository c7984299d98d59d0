//! The heart of ojs-bridge: the OJS job envelope and its codecs, content types,
//! and the [`QueueAdapter`] contract that every broker adapter implements.
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

pub mod adapter;
pub mod backoff;
pub mod decode;
pub mod duration;
pub mod envelope;
mod error;
pub mod federation;
#[doc(hidden)]
pub mod fuzz_targets;
pub mod grpcq;
mod json_codec;
pub mod mapping;
pub mod media;
mod proto_codec;
pub mod publisher;
pub mod redact;
pub mod registry;
pub mod retry;
pub mod settings;
pub mod stream;
pub mod trace;
mod value;
mod wire;
pub mod worker;

pub use adapter::{
    header, Acknowledger, Consumer, ConsumerOptions, DeadLetterReason, Delivery, DeliveryRef,
    FailedPublish, Headers, Health, Nack, OutgoingMessage, PublishFailure, QueueAdapter, Source,
};
pub use decode::{Decoded, Incoming};
pub use envelope::{JobEnvelope, JobError, JobState, RetryPolicy, UniquePolicy};
pub use error::{BoxError, BrokerErrorKind, Error, Result};
pub use media::Encoding;
pub use value::MAX_VALUE_DEPTH;
