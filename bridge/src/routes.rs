//! Routes: which messages go where, and what they become on the way
//! (DESIGN §5). Compiled once from the configuration; matching and mapping
//! are pure functions of the message, so a redelivered message maps to the
//! same output.

use std::collections::BTreeSet;

use ojs_core::mapping::{self, JobPayload};
use ojs_core::{envelope, grpcq, DeadLetterReason, Encoding, JobEnvelope, OutgoingMessage};
use serde_json::Value;

use crate::config::{EnvelopeEncoding, OutputFormat, RouteConfig};
use crate::transcode::Transcoder;

/// A `*` wildcard pattern (`*` matches any run of characters, dots
/// included).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Glob {
    parts: Vec<String>,
    exact: bool,
}

impl Glob {
    /// Compiles a pattern; empty patterns are refused.
    pub fn new(pattern: &str) -> Result<Glob, String> {
        if pattern.is_empty() {
            return Err("an empty pattern matches nothing; use \"*\" to match everything".into());
        }
        Ok(Glob {
            parts: pattern.split('*').map(str::to_owned).collect(),
            exact: !pattern.contains('*'),
        })
    }

    /// Whether `text` matches.
    pub fn matches(&self, text: &str) -> bool {
        if self.exact {
            return self.parts[0] == text;
        }
        let (first, rest) = self.parts.split_first().unwrap_or((&self.parts[0], &[]));
        let Some(mut remaining) = text.strip_prefix(first.as_str()) else {
            return false;
        };
        let Some((last, middle)) = rest.split_last() else {
            return true;
        };
        for part in middle {
            match remaining.find(part.as_str()) {
                Some(at) => remaining = &remaining[at + part.len()..],
                None => return false,
            }
        }
        remaining.len() >= last.len() && remaining.ends_with(last.as_str())
    }
}

/// A placeholder of a [`Template`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateVar {
    /// grpcq topic.
    Topic,
    /// grpcq action.
    Action,
    /// OJS job type (for calls: `{topic}.{action}`).
    Type,
    /// The queue the message came from (for jobs: the job's queue).
    Queue,
    /// grpcq originator.
    Originator,
}

impl TemplateVar {
    /// Every placeholder.
    pub const ALL: &'static [TemplateVar] = &[
        TemplateVar::Topic,
        TemplateVar::Action,
        TemplateVar::Type,
        TemplateVar::Queue,
        TemplateVar::Originator,
    ];

    fn name(self) -> &'static str {
        match self {
            TemplateVar::Topic => "topic",
            TemplateVar::Action => "action",
            TemplateVar::Type => "type",
            TemplateVar::Queue => "queue",
            TemplateVar::Originator => "originator",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    Var(TemplateVar),
}

/// A string with `{placeholders}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    pieces: Vec<Piece>,
}

/// Values of the placeholders for one message.
#[derive(Debug, Clone, Copy)]
pub struct Vars<'a> {
    /// grpcq topic.
    pub topic: &'a str,
    /// grpcq action.
    pub action: &'a str,
    /// OJS type; empty for calls (rendered as `{topic}.{action}`).
    pub job_type: &'a str,
    /// Source queue or job queue.
    pub queue: &'a str,
    /// grpcq originator.
    pub originator: &'a str,
}

impl Template {
    /// Parses `text`, allowing the placeholders in `allowed`.
    pub fn parse(text: &str, allowed: &[TemplateVar]) -> Result<Template, String> {
        let mut pieces = Vec::new();
        let mut rest = text;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                pieces.push(Piece::Text(rest[..open].to_owned()));
            }
            let Some(close) = rest[open..].find('}') else {
                return Err(format!("{text:?}: `{{` without `}}`"));
            };
            let name = &rest[open + 1..open + close];
            let var = allowed.iter().find(|v| v.name() == name).ok_or_else(|| {
                format!(
                    "{text:?}: unknown placeholder {{{name}}} (known: {})",
                    allowed
                        .iter()
                        .map(|v| format!("{{{}}}", v.name()))
                        .collect::<Vec<_>>()
                        .join(" ")
                )
            })?;
            pieces.push(Piece::Var(*var));
            rest = &rest[open + close + 1..];
        }
        if rest.contains('}') {
            return Err(format!("{text:?}: `}}` without `{{`"));
        }
        if !rest.is_empty() {
            pieces.push(Piece::Text(rest.to_owned()));
        }
        Ok(Template { pieces })
    }

    /// The text for one message.
    pub fn render(&self, vars: &Vars<'_>) -> String {
        let mut out = String::new();
        for piece in &self.pieces {
            match piece {
                Piece::Text(t) => out.push_str(t),
                Piece::Var(TemplateVar::Topic) => out.push_str(vars.topic),
                Piece::Var(TemplateVar::Action) => out.push_str(vars.action),
                Piece::Var(TemplateVar::Type) if vars.job_type.is_empty() => {
                    out.push_str(vars.topic);
                    out.push('.');
                    out.push_str(vars.action);
                }
                Piece::Var(TemplateVar::Type) => out.push_str(vars.job_type),
                Piece::Var(TemplateVar::Queue) => out.push_str(vars.queue),
                Piece::Var(TemplateVar::Originator) => out.push_str(vars.originator),
            }
        }
        out
    }
}

/// A decoded source message.
#[derive(Debug, Clone, PartialEq)]
pub enum Incoming {
    /// A grpcq call.
    Call(grpcq::Message),
    /// An OJS job (boxed: it is several times the size of a call).
    Job(Box<JobEnvelope>),
}

impl Incoming {
    /// When the message was created, Unix ms (for end-to-end latency).
    pub fn created_ms(&self) -> Option<i64> {
        match self {
            Incoming::Call(m) => (m.timestamp_ms > 0).then_some(m.timestamp_ms),
            Incoming::Job(j) => j.enqueued_at.or(j.created_at).map(|t| t.timestamp_millis()),
        }
    }
}

/// A compiled `[[routes]]` entry.
#[derive(Debug)]
pub struct Route {
    /// Route name (metrics label).
    pub name: String,
    /// Adapter name of the sink.
    pub sink: String,
    sources: Option<BTreeSet<String>>,
    topic: Option<Glob>,
    action: Option<Glob>,
    job_type: Option<Glob>,
    to: OutputFormat,
    encoding: Encoding,
    queue: Option<Template>,
    type_template: Option<Template>,
    topic_template: Option<Template>,
    action_template: Option<Template>,
    transcoder: Option<Transcoder>,
}

fn unmappable(reason: impl Into<String>) -> DeadLetterReason {
    DeadLetterReason::new("unmappable", reason)
}

impl Route {
    /// Compiles a validated route (descriptor sets are read here).
    pub fn compile(
        config: &RouteConfig,
        index: usize,
    ) -> Result<Route, crate::config::ConfigError> {
        let field = |f: &str| format!("routes[{index}].{f}");
        let err = |f: &str, reason: String| crate::config::ConfigError::Invalid {
            field: field(f),
            reason,
        };
        let glob = |f: &str, p: &Option<String>| {
            p.as_deref()
                .map(Glob::new)
                .transpose()
                .map_err(|e| err(f, e))
        };
        let template = |f: &str, t: &Option<String>| {
            t.as_deref()
                .map(|t| Template::parse(t, TemplateVar::ALL))
                .transpose()
                .map_err(|e| err(f, e))
        };
        let transcoder = match &config.descriptor_set {
            Some(path) => Some(
                Transcoder::load(path, config.message_type.as_deref())
                    .map_err(|e| err("descriptor_set", e))?,
            ),
            None => None,
        };
        Ok(Route {
            name: config.name.clone(),
            sink: config.sink.clone(),
            sources: (!config.sources.is_empty()).then(|| config.sources.iter().cloned().collect()),
            topic: glob("match.topic", &config.matcher.topic)?,
            action: glob("match.action", &config.matcher.action)?,
            job_type: glob("match.type", &config.matcher.job_type)?,
            to: config.to,
            encoding: match config.encoding {
                EnvelopeEncoding::Proto => Encoding::OjsProto,
                EnvelopeEncoding::Json => Encoding::OjsJson,
            },
            queue: template("queue", &config.queue)?,
            type_template: template("type", &config.job_type)?,
            topic_template: template("topic", &config.topic)?,
            action_template: template("action", &config.action)?,
            transcoder,
        })
    }

    /// Whether this route takes `msg` from `source`.
    pub fn matches(&self, source: &str, msg: &Incoming) -> bool {
        if let Some(sources) = &self.sources {
            if !sources.contains(source) {
                return false;
            }
        }
        let ok = |g: &Option<Glob>, text: &str| g.as_ref().is_none_or(|g| g.matches(text));
        match msg {
            Incoming::Call(m) => {
                self.job_type.is_none() && ok(&self.topic, &m.topic) && ok(&self.action, &m.action)
            }
            Incoming::Job(j) => {
                self.topic.is_none() && self.action.is_none() && ok(&self.job_type, &j.job_type)
            }
        }
    }

    /// What `msg` becomes on this route: the sink queue and the message.
    pub fn map(
        &self,
        msg: Incoming,
        source_queue: &str,
    ) -> Result<(String, OutgoingMessage), DeadLetterReason> {
        match (msg, self.to) {
            (Incoming::Call(call), OutputFormat::Ojs) => self.call_to_job(call, source_queue),
            (Incoming::Call(call), OutputFormat::Grpcq) => {
                let vars = call_vars(&call, source_queue);
                let queue = self.render_queue(&vars, vars.topic)?;
                Ok((queue, OutgoingMessage::from_grpcq(&call)))
            }
            (Incoming::Job(job), OutputFormat::Ojs) => self.job_to_job(*job),
            (Incoming::Job(job), OutputFormat::Grpcq) => self.job_to_call(&job),
        }
    }

    /// The route's queue template rendered, or `default` (already resolved
    /// by the caller) when the route names no queue.
    fn render_queue(&self, vars: &Vars<'_>, default: &str) -> Result<String, DeadLetterReason> {
        let queue = match &self.queue {
            Some(t) => t.render(vars),
            None => default.to_owned(),
        };
        if queue.is_empty() {
            return Err(unmappable(format!(
                "route {} renders an empty queue name",
                self.name
            )));
        }
        Ok(queue)
    }

    fn call_to_job(
        &self,
        call: grpcq::Message,
        source_queue: &str,
    ) -> Result<(String, OutgoingMessage), DeadLetterReason> {
        let vars = call_vars(&call, source_queue);
        let job_type = match &self.type_template {
            Some(t) => t.render(&vars),
            None => format!("{}.{}", call.topic, call.action),
        };
        envelope::validate_job_type(&job_type)
            .map_err(|e| unmappable(format!("job type {job_type:?}: {e}")))?;
        let queue = self.render_queue(&vars, ojs_core::envelope::DEFAULT_QUEUE)?;
        envelope::validate_queue_name(&queue)
            .map_err(|e| unmappable(format!("queue {queue:?}: {e}")))?;
        let payload = match &self.transcoder {
            Some(t) => t
                .to_json(&call.topic, &call.action, &call.payload)
                .map_err(|e| DeadLetterReason::new("untranscodable", e))?,
            None => None,
        };
        let job = mapping::call_to_job(&call, job_type, queue.clone(), payload);
        let out = OutgoingMessage::from_envelope(&job, self.encoding)
            .map_err(|e| unmappable(e.to_string()))?;
        Ok((queue, out))
    }

    fn job_to_job(
        &self,
        mut job: JobEnvelope,
    ) -> Result<(String, OutgoingMessage), DeadLetterReason> {
        // Topic and action only matter to templates; the defaults need neither.
        let (topic, action) = if self.queue.is_some() || self.type_template.is_some() {
            mapping::job_topic_action(&job).unwrap_or_default()
        } else {
            (String::new(), String::new())
        };
        let vars = Vars {
            topic: &topic,
            action: &action,
            job_type: &job.job_type,
            queue: &job.queue,
            originator: job.meta_str(mapping::META_ORIGINATOR).unwrap_or_default(),
        };
        let queue = self.render_queue(&vars, vars.queue)?;
        if let Some(t) = &self.type_template {
            job.job_type = t.render(&vars);
        }
        job.queue = queue.clone();
        let out = OutgoingMessage::from_envelope(&job, self.encoding)
            .map_err(|e| unmappable(e.to_string()))?;
        Ok((queue, out))
    }

    fn job_to_call(
        &self,
        job: &JobEnvelope,
    ) -> Result<(String, OutgoingMessage), DeadLetterReason> {
        let (default_topic, default_action) = match (&self.topic_template, &self.action_template) {
            (Some(_), Some(_)) => (String::new(), String::new()),
            _ => mapping::job_topic_action(job).map_err(|e| unmappable(e.to_string()))?,
        };
        let vars = Vars {
            topic: &default_topic,
            action: &default_action,
            job_type: &job.job_type,
            queue: &job.queue,
            originator: job.meta_str(mapping::META_ORIGINATOR).unwrap_or_default(),
        };
        let topic = self
            .topic_template
            .as_ref()
            .map_or_else(|| default_topic.clone(), |t| t.render(&vars));
        let action = self
            .action_template
            .as_ref()
            .map_or_else(|| default_action.clone(), |t| t.render(&vars));
        if topic.is_empty() || action.is_empty() {
            return Err(unmappable(format!(
                "route {} gives job {} an empty grpcq topic or action",
                self.name, job.id
            )));
        }
        let payload = match mapping::job_payload(job).map_err(|e| unmappable(e.to_string()))? {
            JobPayload::Bytes(b) => b,
            JobPayload::Proto3Json { json, message_type } => match &self.transcoder {
                Some(t) => t
                    .from_json(json, message_type, &topic, &action)
                    .map_err(|e| DeadLetterReason::new("untranscodable", e))?,
                None => {
                    return Err(unmappable(format!(
                        "job {} carries a proto3 JSON request; route {} needs descriptor_set to encode it",
                        job.id, self.name
                    )))
                }
            },
            JobPayload::Native(args) => match (&self.transcoder, args) {
                (Some(t), [single]) => t
                    .from_json(single, None, &topic, &action)
                    .map_err(|e| DeadLetterReason::new("untranscodable", e))?,
                // A job that never was a call: its args as JSON text.
                _ => serde_json::to_vec(&Value::Array(args.to_vec()))
                    .map_err(|e| unmappable(e.to_string()))?,
            },
        };
        let call = mapping::job_to_call(job, topic, action, payload);
        let vars = call_vars(&call, &job.queue);
        let queue = self.render_queue(&vars, vars.topic)?;
        Ok((queue, OutgoingMessage::from_grpcq(&call)))
    }
}

fn call_vars<'a>(call: &'a grpcq::Message, source_queue: &'a str) -> Vars<'a> {
    Vars {
        topic: &call.topic,
        action: &call.action,
        job_type: "",
        queue: source_queue,
        originator: &call.originator,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_exactly_or_with_wildcards() {
        let g = |p: &str| Glob::new(p).unwrap();
        assert!(g("payment.PaymentService").matches("payment.PaymentService"));
        assert!(!g("payment.PaymentService").matches("payment.PaymentServiceX"));
        assert!(g("payment.*").matches("payment.PaymentService"));
        assert!(!g("payment.*").matches("billing.PaymentService"));
        assert!(g("*").matches(""));
        assert!(g("*.Process*").matches("a.b.ProcessPayment"));
        assert!(g("a*b*c").matches("abc"));
        assert!(!g("a*b*c").matches("acb"));
        assert!(!g("ab*ba").matches("aba"));
        assert!(Glob::new("").is_err());
    }

    #[test]
    fn templates_render_and_refuse_unknown_placeholders() {
        let t = Template::parse("{topic}.{action}-{queue}", TemplateVar::ALL).unwrap();
        let vars = Vars {
            topic: "t",
            action: "a",
            job_type: "",
            queue: "q",
            originator: "o",
        };
        assert_eq!(t.render(&vars), "t.a-q");
        assert_eq!(
            Template::parse("x{type}", TemplateVar::ALL)
                .unwrap()
                .render(&vars),
            "xt.a"
        );
        assert!(Template::parse("{nope}", TemplateVar::ALL)
            .unwrap_err()
            .contains("unknown placeholder {nope}"));
        assert!(Template::parse("{topic", TemplateVar::ALL).is_err());
        assert!(Template::parse("topic}", TemplateVar::ALL).is_err());
    }
}
