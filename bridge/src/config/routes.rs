//! `[[routes]]`: which messages go where, and as what.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::routes::template::{Template, TemplateVar};

/// What a route publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OutputFormat {
    /// OJS jobs (grpcq calls are mapped per docs/design.md §5). The default.
    #[default]
    Ojs,
    /// grpcq calls (OJS jobs are mapped back).
    Grpcq,
}

/// Encoding of published OJS envelopes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum EnvelopeEncoding {
    /// `application/openjobspec+proto`. The default.
    #[default]
    Proto,
    /// `application/openjobspec+json`.
    Json,
}

/// `match = { … }`: every given pattern must match; `*` matches any run of
/// characters. An empty match matches every message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct MatchConfig {
    /// grpcq topic pattern (matches calls only).
    #[serde(default)]
    pub topic: Option<String>,
    /// grpcq action pattern (matches calls only).
    #[serde(default)]
    pub action: Option<String>,
    /// OJS job type pattern (matches jobs only).
    #[serde(default, rename = "type")]
    pub job_type: Option<String>,
}

/// `[[routes]]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Name used by metrics and logs.
    pub name: String,
    /// Sources this route applies to. Default: all.
    #[serde(default)]
    pub sources: Vec<String>,
    /// Which messages this route takes. Default: all.
    #[serde(default, rename = "match")]
    pub matcher: MatchConfig,
    /// Adapter name from `[adapters]` to publish to.
    pub sink: String,
    /// What to publish. Default `ojs`.
    #[serde(default)]
    pub to: OutputFormat,
    /// Destination queue template. Default `default` for OJS output and
    /// `{topic}` for grpcq output (grpcq's Kafka/RabbitMQ convention).
    #[serde(default)]
    pub queue: Option<String>,
    /// OJS job type template; placeholders are inserted as lowercase
    /// snake_case segments. Default `{topic}.{action}` for calls and
    /// `{type}` (unchanged) for jobs.
    #[serde(default, rename = "type")]
    pub job_type: Option<String>,
    /// grpcq topic template for jobs turned into calls. Default: the
    /// job's `grpcq.topic` meta, else its type up to the last dot.
    #[serde(default)]
    pub topic: Option<String>,
    /// grpcq action template for jobs turned into calls. Default: the
    /// job's `grpcq.action` meta, else its type after the last dot.
    #[serde(default)]
    pub action: Option<String>,
    /// OJS envelope encoding. Default `proto`.
    #[serde(default)]
    pub encoding: EnvelopeEncoding,
    /// A protobuf FileDescriptorSet (`protoc --descriptor_set_out`,
    /// `buf build -o`): requests are transcoded to proto3 JSON args (and
    /// back on the reverse route). Default: payload as base64url.
    #[serde(default)]
    pub descriptor_set: Option<PathBuf>,
    /// Request message type in the descriptor set. Default: the input type
    /// of method `{action}` of service `{topic}`.
    #[serde(default)]
    pub message_type: Option<String>,
    /// Globs (`*` = any run of characters) a destination chosen by the
    /// message (a `{queue}`/`{topic}`/… template, a call's topic) must
    /// match; anything else is dead-lettered `forbidden_destination`.
    /// Default: a literal `queue` allows itself only; a template is bounded
    /// by the route's `match` globs (and refused at config check when a
    /// placeholder has none); a job keeping its own queue is bounded only
    /// by the sink's reserved names and `max_destinations`.
    #[serde(default)]
    pub allowed_queues: Vec<String>,
    /// Distinct destinations this route may publish to; messages for more
    /// are dead-lettered `too_many_destinations`. Default 100.
    #[serde(default = "default_max_destinations")]
    pub max_destinations: usize,
}

pub(crate) fn default_max_destinations() -> usize {
    100
}

/// The destination template of a route whose messages choose their
/// destination: its `queue` template, or `{topic}` for grpcq output without
/// one. `None` for a literal queue and for OJS output without a queue (each
/// job keeps its queue; calls go to `default`).
pub(crate) fn destination_template(config: &RouteConfig) -> Option<String> {
    match (&config.queue, config.to) {
        (Some(q), _) => Some(q.clone()),
        (None, OutputFormat::Grpcq) => Some("{topic}".to_owned()),
        (None, OutputFormat::Ojs) => None,
    }
}

/// The globs a route's destination must match: `allowed_queues` when set;
/// otherwise, for a destination template, the template with each
/// placeholder replaced by the route's `match` glob for it (`{topic}` with
/// `match.topic = "payment.*"` allows `payment.*`) — and an error when a
/// placeholder has no such glob (`{queue}`, `{originator}`, or an unmatched
/// `{topic}`), because then any message could choose any destination.
/// Empty: no bound beyond reserved names and `max_destinations`.
pub fn allowed_destinations(config: &RouteConfig) -> Result<Vec<String>, String> {
    if !config.allowed_queues.is_empty() {
        return Ok(config.allowed_queues.clone());
    }
    let Some(text) = destination_template(config) else {
        return Ok(Vec::new());
    };
    let template = Template::parse(&text, TemplateVar::ALL)?;
    if template.as_literal().is_some() {
        return Ok(Vec::new());
    }
    let bound = |v: TemplateVar| match v {
        TemplateVar::Topic => config.matcher.topic.clone(),
        TemplateVar::Action => config.matcher.action.clone(),
        TemplateVar::Type => config.matcher.job_type.clone(),
        TemplateVar::Queue | TemplateVar::Originator => None,
    };
    if let Some(free) = template.vars().find(|v| bound(*v).is_none()) {
        return Err(format!(
            "messages choose this route's destination through {{{}}} in {text:?}, and nothing bounds it: list the queues they may choose (allowed_queues = [\"orders\", \"payment.*\"]), or match the {} this placeholder takes",
            free.name(),
            free.name()
        ));
    }
    Ok(vec![template.render_with(|v| bound(v).unwrap_or_default())])
}
