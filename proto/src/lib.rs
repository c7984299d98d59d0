//! Generated Rust types for the two schemas ojs-bridge speaks:
//!
//! * [`openjobspec::v1`]: the OJS Layer 2 protobuf envelope (`JobEnvelope`,
//!   batches, policies, errors);
//! * [`grpcq`]: the grpcq `Message` that carries one asynchronous gRPC call.
//!
//! Hand-written codecs that preserve unknown fields live in `ojs-core`; these
//! types are the schema as compiled, used for interop and cross-checks.

#![allow(missing_docs, missing_debug_implementations, clippy::all)]

/// `openjobspec.*` packages.
pub mod openjobspec {
    /// `openjobspec.v1`.
    pub mod v1 {
        include!(concat!(env!("OUT_DIR"), "/openjobspec.v1.rs"));
    }
}

/// `grpcq` package.
pub mod grpcq {
    include!(concat!(env!("OUT_DIR"), "/grpcq.rs"));
}

/// Raw `.proto` sources, for tools that want to ship or print them.
pub mod sources {
    /// `openjobspec/v1/job.proto`.
    pub const JOB_PROTO: &str = include_str!("../proto/openjobspec/v1/job.proto");
    /// `grpcq/message.proto`.
    pub const GRPCQ_MESSAGE_PROTO: &str = include_str!("../proto/grpcq/message.proto");
}
