//! The OJS job envelope, its protobuf and JSON codecs, delimited streams and
//! batches, and its media types: what a job is and how its bytes look. It
//! knows neither queues nor grpcq: the queue contract is `ojs-queue`, grpcq
//! calls and their mapping to jobs are `ojs-grpcq`, both built on this crate.
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

pub mod duration;
pub mod envelope;
mod error;
#[doc(hidden)]
pub mod fuzz_targets;
pub mod glob;
pub mod json_out;
pub mod redact;
pub mod timestamp;

pub use envelope::media::Encoding;
pub use envelope::value::MAX_VALUE_DEPTH;
pub use envelope::{JobEnvelope, JobError, JobState, RetryPolicy, UniquePolicy};
pub use error::{Error, Result};
