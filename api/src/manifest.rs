//! What the server declares about itself (`GET /ojs/manifest`, the gRPC
//! `Manifest`) and the health parts it reports: typed here, written in
//! each binding's own format.

use serde::Serialize;

/// The manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Manifest {
    /// The OJS version served.
    pub ojs_version: &'static str,
    /// The CloudEvents-style spec version of the envelope.
    pub specversion: &'static str,
    /// This server.
    pub implementation: Implementation,
    /// The highest OJS conformance level met.
    pub conformance_level: u8,
    /// The conformance tier.
    pub conformance_tier: &'static str,
    /// The bindings served.
    pub protocols: Vec<&'static str>,
    /// The kind of broker the jobs are on (`kafka`, `rabbitmq`, …).
    pub backend: &'static str,
    /// What is supported.
    pub capabilities: Capabilities,
    /// Extensions served.
    pub extensions: Vec<&'static str>,
    /// Content types a job may be pushed and fetched in.
    pub encodings: Vec<&'static str>,
    /// How far unique jobs are guaranteed: `strong` (of concurrent pushes
    /// of one key exactly one is stored, also across replicas).
    pub unique_job_strength: &'static str,
}

/// The implementation part of the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Implementation {
    /// Its name.
    pub name: &'static str,
    /// Its version.
    pub version: &'static str,
    /// The language it is written in.
    pub language: &'static str,
    /// Where its source is.
    pub repository: &'static str,
}

/// The capabilities part of the manifest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Capabilities {
    /// Batch PUSH.
    pub batch_enqueue: bool,
    /// Cron jobs.
    pub cron_jobs: bool,
    /// Cron jobs, under the key the admin UI shows its Cron page for.
    pub cron: bool,
    /// Dead letters kept and listed.
    pub dead_letter: bool,
    /// Jobs scheduled for later.
    pub delayed_jobs: bool,
    /// Jobs that expire.
    pub job_ttl: bool,
    /// Priorities honoured by the broker.
    pub priority_queues: bool,
    /// Rate limits.
    pub rate_limiting: bool,
    /// Validation of args against a schema.
    pub schema_validation: bool,
    /// Unique jobs.
    pub unique_jobs: bool,
    /// Workflows.
    pub workflows: bool,
    /// Pausing and resuming queues.
    pub pause_resume: bool,
    /// The event log and its live views (SSE, WebSocket, gRPC
    /// `StreamEvents`); the admin UI shows its Events page for it.
    pub events: bool,
}

impl Manifest {
    /// The manifest of this server over a broker of `backend` kind.
    pub fn of(backend: &'static str) -> Self {
        let priority_queues = matches!(backend, "local" | "memory" | "rabbitmq");
        Manifest {
            ojs_version: "1.0",
            specversion: "1.0",
            implementation: Implementation {
                name: "ojs-bridge",
                version: env!("CARGO_PKG_VERSION"),
                language: "rust",
                repository: "https://github.com/ojs-bridge/ojs-bridge",
            },
            // Every official case of levels 0 to 4 passes (bar those that
            // cannot pass as written; docs/api.md lists them) where the
            // broker orders a queue by priority; on Kafka and SQS the
            // priority cases of level 4 cannot, so they meet level 3.
            conformance_level: if priority_queues { 4 } else { 3 },
            conformance_tier: "runtime",
            protocols: vec!["http", "grpc"],
            backend,
            capabilities: Capabilities {
                batch_enqueue: true,
                cron_jobs: true,
                cron: true,
                dead_letter: true,
                delayed_jobs: true,
                job_ttl: true,
                priority_queues,
                rate_limiting: true,
                schema_validation: false,
                unique_jobs: true,
                workflows: true,
                pause_resume: true,
                events: true,
            },
            extensions: Vec::new(),
            encodings: vec![
                "application/openjobspec+json",
                "application/openjobspec+proto",
            ],
            unique_job_strength: "strong",
        }
    }
}

/// The broker the API works over, as health names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Backend {
    /// Its kind (`kafka`, `rabbitmq`, `sqs`, `local`, `memory`).
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// Its name in the configuration.
    pub name: String,
}

/// Whether the job store answers, as health reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StoreHealth {
    /// The store's kind (`sqlite`, `postgres`).
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// `ok` or `unavailable`.
    pub status: &'static str,
    /// Why it does not answer; shown only to callers who see detail.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl StoreHealth {
    /// Whether the store answers.
    pub fn is_up(&self) -> bool {
        self.reason.is_none()
    }

    /// Without the reason (for callers who do not see detail).
    pub fn without_detail(mut self) -> Self {
        self.reason = None;
        self
    }
}
