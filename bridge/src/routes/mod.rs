//! Routes: which messages go where, and what they become on the way
//! (docs/design.md §5). Compiled once from the configuration; matching and mapping
//! are pure functions of the message, so a redelivered message maps to the
//! same output.

use std::borrow::Cow;
use std::collections::BTreeSet;

use ojs_core::{envelope, Encoding, JobEnvelope};
use ojs_grpcq as grpcq;
use ojs_grpcq::mapping::{self, JobPayload, JobTypes};
use ojs_queue::{DeadLetterReason, HeaderValue, OutgoingMessage};
use serde_json::Value;

use crate::config::{
    allowed_destinations, ConfigError, EnvelopeEncoding, OutputFormat, RouteConfig,
};
pub mod template;
pub mod transcode;

use ojs_core::glob::Glob;
use template::{Template, TemplateVar, Vars};
use transcode::Transcoder;

/// A decoded source message (defined in core, where it is decoded).
pub use ojs_grpcq::Incoming;

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
    /// Globs a destination must match (empty: see `literal_queue`).
    allowed: Vec<Glob>,
    /// The destination when it does not depend on the message (computed
    /// once: the per-message check only compares against it).
    literal: Option<String>,
    /// The queue of the jobs this route makes from calls when no call
    /// changes it (no `queue`, or a literal one that is a valid OJS queue
    /// name), checked once and shared by every job's header.
    call_job_queue: Option<(String, HeaderValue)>,
    max_destinations: usize,
    /// Destinations published to so far (bounded by `max_destinations`).
    destinations: std::sync::Mutex<BTreeSet<String>>,
    /// Logs when the sink starts failing and when it recovers; health
    /// reads it.
    pub sink_alarm: std::sync::Arc<crate::alarm::Alarm>,
    /// Jobs keep their envelope on the message (a federated sink works on
    /// the job: it then does not parse the payload again).
    keep_envelope: bool,
}

fn unmappable(reason: impl Into<String>) -> DeadLetterReason {
    DeadLetterReason::of(ojs_queue::DeadLetterKind::Unmappable, reason)
}

/// The problems of one route, each with its field path.
struct Problems {
    index: usize,
    errors: Vec<ConfigError>,
}

impl Problems {
    fn push(&mut self, field: &str, reason: impl Into<String>) {
        self.errors.push(ConfigError::Invalid {
            field: format!("routes[{}].{field}", self.index),
            reason: reason.into(),
        });
    }

    /// The value, or `None` with the problem noted.
    fn check<T>(&mut self, field: &str, result: Result<T, String>) -> Option<T> {
        result.map_err(|reason| self.push(field, reason)).ok()
    }
}

/// Placeholders render in type form; the literal text of a type template
/// must be type text too, or every job would be unmappable.
fn check_type_template(text: &str, template: &Template) -> Result<(), String> {
    let bad_text = template.literal_pieces().find(|piece| {
        !piece
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'.')
    });
    if let Some(piece) = bad_text {
        return Err(format!("{text:?}: the text {piece:?} cannot be part of an OJS type (^[a-z][a-z0-9_]*(\\.[a-z][a-z0-9_]*)*$); placeholders are inserted as lowercase snake_case"));
    }
    if let Some(literal) = template.as_literal() {
        envelope::validate_job_type(&literal).map_err(|e| e.to_string())?;
    }
    Ok(())
}

impl Route {
    /// Builds `[[routes]]` entry `index`, or refuses it with every rule it
    /// breaks (each with its field path). `federated`: its sink is a
    /// federation, which works on the job, so jobs keep their envelope on
    /// the message. Descriptor sets are read here.
    pub fn build(
        config: &RouteConfig,
        index: usize,
        federated: bool,
    ) -> Result<Route, Vec<ConfigError>> {
        let mut problems = Problems {
            index,
            errors: Vec::new(),
        };
        let glob = |problems: &mut Problems, field: &str, pattern: &Option<String>| {
            pattern
                .as_deref()
                .and_then(|p| problems.check(field, Glob::new(p)))
        };
        let topic = glob(&mut problems, "match.topic", &config.matcher.topic);
        let action = glob(&mut problems, "match.action", &config.matcher.action);
        let job_type = glob(&mut problems, "match.type", &config.matcher.job_type);
        if config.matcher.job_type.is_some()
            && (config.matcher.topic.is_some() || config.matcher.action.is_some())
        {
            problems.push(
                "match",
                "match.type matches OJS jobs and match.topic/action grpcq calls; one route cannot require both",
            );
        }
        let template = |problems: &mut Problems, field: &str, text: &Option<String>| {
            text.as_deref()
                .and_then(|t| problems.check(field, Template::parse(t, TemplateVar::ALL)))
        };
        let queue = template(&mut problems, "queue", &config.queue);
        let type_template = template(&mut problems, "type", &config.job_type);
        let topic_template = template(&mut problems, "topic", &config.topic);
        let action_template = template(&mut problems, "action", &config.action);
        if let (Some(text), Some(t)) = (&config.job_type, &type_template) {
            if let Err(reason) = check_type_template(text, t) {
                problems.push("type", reason);
            }
        }
        let mut allowed_globs = Vec::new();
        for (j, g) in config.allowed_queues.iter().enumerate() {
            if let Some(glob) = problems.check(&format!("allowed_queues[{j}]"), Glob::new(g)) {
                allowed_globs.push(glob);
            }
        }
        let allowed = match allowed_destinations(config) {
            // Listed globs are parsed above; a bound drawn from `match`
            // renders a glob of those already parsed.
            Ok(globs) if config.allowed_queues.is_empty() => globs
                .iter()
                .filter_map(|g| problems.check("allowed_queues", Glob::new(g)))
                .collect(),
            Ok(_) => allowed_globs,
            Err(reason) => {
                problems.push("allowed_queues", reason);
                Vec::new()
            }
        };
        if config.max_destinations == 0 {
            problems.push("max_destinations", "must be at least 1");
        }
        if config.message_type.is_some() && config.descriptor_set.is_none() {
            problems.push("message_type", "needs descriptor_set");
        }
        let transcoder = match &config.descriptor_set {
            Some(path) if problems.errors.is_empty() => problems.check(
                "descriptor_set",
                Transcoder::load(path, config.message_type.as_deref()),
            ),
            _ => None,
        };
        if !problems.errors.is_empty() {
            return Err(problems.errors);
        }
        let literal = queue.as_ref().and_then(Template::as_literal);
        let call_job_queue = match (&config.queue, &literal) {
            (None, _) => Some(envelope::DEFAULT_QUEUE.to_owned()),
            // An invalid literal is refused per message, with its reason.
            (Some(_), Some(q)) => envelope::validate_queue_name(q).is_ok().then(|| q.clone()),
            (Some(_), None) => None,
        }
        .map(|q| {
            let header = HeaderValue::from(q.as_str());
            (q, header)
        });
        Ok(Route {
            keep_envelope: federated,
            name: config.name.clone(),
            sink: config.sink.clone(),
            sources: (!config.sources.is_empty()).then(|| config.sources.iter().cloned().collect()),
            topic,
            action,
            job_type,
            to: config.to,
            encoding: match config.encoding {
                EnvelopeEncoding::Proto => Encoding::OjsProto,
                EnvelopeEncoding::Json => Encoding::OjsJson,
            },
            queue,
            type_template,
            topic_template,
            action_template,
            transcoder,
            allowed,
            literal,
            call_job_queue,
            max_destinations: config.max_destinations,
            destinations: std::sync::Mutex::new(BTreeSet::new()),
            sink_alarm: std::sync::Arc::new(crate::alarm::Alarm::new(
                "sink",
                &config.name,
                &config.sink,
            )),
        })
    }

    /// The destination queue when it does not depend on the message (the
    /// daemon prepares it at start).
    pub fn literal_queue(&self) -> Option<&str> {
        // Without a template the queue comes from the message (a job's own
        // queue, a call's topic) or its kind (calls → `default`).
        self.literal.as_deref()
    }

    /// Whether the messages of this route choose their destination (no
    /// literal `queue`): what the start-up log warns about when
    /// `allowed_queues` does not bound it.
    pub fn message_chooses_destination(&self) -> bool {
        self.literal.is_none()
    }

    /// Whether `queue` may be published to on this route: the config bounds
    /// it (literal queue, `allowed_queues`), the sink does not reserve it
    /// (dead-letter and retry names), and the route is within
    /// `max_destinations`.
    pub fn admit_destination(
        &self,
        queue: &str,
        reserved: impl Fn(&str) -> bool,
    ) -> Result<(), DeadLetterReason> {
        let forbidden = |why: &str| {
            Err(DeadLetterReason::of(
                ojs_queue::DeadLetterKind::ForbiddenDestination,
                format!("route {} may not publish to {queue:?}: {why}", self.name),
            ))
        };
        if let Some(literal) = &self.literal {
            // One destination, named by the config: nothing to count.
            if queue == literal && self.allowed.iter().all(|g| g.matches(queue)) {
                return Ok(());
            }
            return forbidden(if queue == literal {
                "not in allowed_queues"
            } else {
                "not the route's queue"
            });
        }
        if !self.allowed.is_empty() && !self.allowed.iter().any(|g| g.matches(queue)) {
            return forbidden("not in allowed_queues");
        }
        if reserved(queue) {
            return forbidden("a dead-letter or retry destination of the sink");
        }
        let mut seen = self.destinations.lock().unwrap_or_else(|e| e.into_inner());
        if !seen.contains(queue) {
            if seen.len() >= self.max_destinations {
                return Err(DeadLetterReason::of(
                    ojs_queue::DeadLetterKind::TooManyDestinations,
                    format!(
                        "route {} already publishes to {} destinations (max_destinations); {queue:?} would be one more",
                        self.name, self.max_destinations
                    ),
                ));
            }
            seen.insert(queue.to_owned());
        }
        Ok(())
    }

    /// Whether the config bounds this route's destinations (a literal
    /// queue, `allowed_queues`, or globs derived from its `match`).
    pub fn is_bounded(&self) -> bool {
        !self.allowed.is_empty() || self.literal.is_some()
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
                self.job_type.is_none()
                    && ok(&self.topic, m.topic())
                    && ok(&self.action, m.action())
            }
            Incoming::Job(j) => {
                self.topic.is_none() && self.action.is_none() && ok(&self.job_type, &j.job_type)
            }
        }
    }

    /// What `msg` becomes on this route: the sink queue and the message.
    /// `job_types` names the job types of calls (keep one per batch: it
    /// remembers the last).
    pub fn map(
        &self,
        msg: Incoming,
        source_queue: &str,
        job_types: &mut JobTypes,
    ) -> Result<(Cow<'_, str>, OutgoingMessage), DeadLetterReason> {
        match (msg, self.to) {
            (Incoming::Call(call), OutputFormat::Ojs) => {
                self.call_to_job(call, source_queue, job_types)
            }
            (Incoming::Call(call), OutputFormat::Grpcq) => {
                let vars = incoming_call_vars(&call, source_queue);
                let queue = self.render_queue(&vars, vars.topic)?;
                Ok((Cow::Owned(queue), call.to_outgoing()))
            }
            (Incoming::Job(job), OutputFormat::Ojs) => {
                self.job_to_job(*job).map(|(q, m)| (Cow::Owned(q), m))
            }
            (Incoming::Job(job), OutputFormat::Grpcq) => {
                self.job_to_call(&job).map(|(q, m)| (Cow::Owned(q), m))
            }
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
        call: grpcq::Call,
        source_queue: &str,
        job_types: &mut JobTypes,
    ) -> Result<(Cow<'_, str>, OutgoingMessage), DeadLetterReason> {
        let vars = incoming_call_vars(&call, source_queue);
        let job_type = match &self.type_template {
            Some(t) => {
                let job_type = t.render_type(&vars);
                envelope::validate_job_type(&job_type)
                    .map_err(|e| unmappable(format!("job type {job_type:?}: {e}")))?;
                HeaderValue::from(job_type)
            }
            None => job_types.of(call.topic(), call.action()).map_err(|e| {
                let job_type = envelope::type_from_topic_action(call.topic(), call.action());
                unmappable(format!("job type {job_type:?}: {e}"))
            })?,
        };
        let (queue, queue_header) = match &self.call_job_queue {
            Some((queue, header)) => (Cow::Borrowed(queue.as_str()), Some(header)),
            None => {
                let queue = self.render_queue(&vars, envelope::DEFAULT_QUEUE)?;
                envelope::validate_queue_name(&queue)
                    .map_err(|e| unmappable(format!("queue {queue:?}: {e}")))?;
                (Cow::Owned(queue), None)
            }
        };
        let payload = match &self.transcoder {
            Some(t) => t
                .to_json(call.topic(), call.action(), call.payload())
                .map_err(|e| DeadLetterReason::of(ojs_queue::DeadLetterKind::Untranscodable, e))?,
            None => None,
        };
        if payload.is_none() && self.encoding == Encoding::OjsProto && !self.keep_envelope {
            // The common case, written straight to protobuf: no envelope.
            let out = match queue_header {
                Some(header) => mapping::call_to_job_message(&call, &job_type, header),
                None => mapping::call_to_job_message(&call, &job_type, &HeaderValue::from(&*queue)),
            };
            return Ok((queue, out));
        }
        let job = mapping::call_to_job(
            &call.to_message(),
            // Checked above: text.
            job_type.to_str_lossy().into_owned(),
            queue.clone().into_owned(),
            payload,
        );
        Ok((queue, self.encode(job)?))
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
            job.job_type = t.render_type(&vars);
            envelope::validate_job_type(&job.job_type)
                .map_err(|e| unmappable(format!("job type {:?}: {e}", job.job_type)))?;
        }
        job.queue = queue.clone();
        Ok((queue, self.encode(job)?))
    }

    /// The job as the message to publish, keeping the envelope when asked.
    fn encode(&self, job: JobEnvelope) -> Result<OutgoingMessage, DeadLetterReason> {
        let out = OutgoingMessage::from_envelope(&job, self.encoding)
            .map_err(|e| unmappable(e.to_string()))?;
        Ok(if self.keep_envelope {
            out.with_envelope(job)
        } else {
            out
        })
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
                    .map_err(|e| DeadLetterReason::of(ojs_queue::DeadLetterKind::Untranscodable, e))?,
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
                    .map_err(|e| DeadLetterReason::of(ojs_queue::DeadLetterKind::Untranscodable, e))?,
                // A job that never was a call: its args as JSON text.
                _ => serde_json::to_vec(&Value::Array(args.to_vec()))
                    .map_err(|e| unmappable(e.to_string()))?,
            },
        };
        let call = mapping::job_to_call(job, topic, action, payload);
        let vars = call_vars(&call.topic, &call.action, &call.originator, &job.queue);
        let queue = self.render_queue(&vars, vars.topic)?;
        Ok((queue, ojs_grpcq::outgoing(&call)))
    }
}

/// A call's template variables (read in place or built by a route).
fn call_vars<'a>(
    topic: &'a str,
    action: &'a str,
    originator: &'a str,
    source_queue: &'a str,
) -> Vars<'a> {
    Vars {
        topic,
        action,
        job_type: "",
        queue: source_queue,
        originator,
    }
}

fn incoming_call_vars<'a>(call: &'a grpcq::Call, source_queue: &'a str) -> Vars<'a> {
    call_vars(call.topic(), call.action(), call.originator(), source_queue)
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

    /// The first route of a config with one `local` source of calls.
    fn route(route_lines: &str) -> Route {
        let text = format!(
            r#"
            [adapters]
            local = "local:./data"
            [[sources]]
            name = "calls"
            adapter = "local"
            queue = "calls"
            [[routes]]
            name = "r"
            sink = "local"
            {route_lines}
            "#
        );
        let config = crate::config::BridgeConfig::parse(&text, "test.toml", &[]).unwrap();
        Route::build(&config.routes[0], 0, false).unwrap()
    }

    fn call(topic: &str, action: &str) -> Incoming {
        Incoming::Call(grpcq::Call::from_message(&grpcq::Message {
            topic: topic.into(),
            action: action.into(),
            message_id: format!("{topic}/{action}"),
            timestamp_ms: 1_763_700_000_000,
            payload: b"p".to_vec(),
            ..Default::default()
        }))
    }

    /// The job type and queue the job's headers carry, and the sink queue.
    fn mapped(route: &Route, msg: Incoming, types: &mut JobTypes) -> (String, String, String) {
        let (queue, out) = route.map(msg, "calls", types).unwrap();
        let header = |name| out.headers.get_str(name).unwrap().to_owned();
        let job = &Encoding::OjsProto.decode_envelopes(&out.payload).unwrap()[0];
        assert_eq!(job.job_type, header(ojs_queue::header::TYPE));
        assert_eq!(job.queue, header(ojs_queue::header::QUEUE));
        assert_eq!(job.queue, queue);
        (job.job_type.clone(), job.queue.clone(), queue.into_owned())
    }

    #[test]
    fn jobs_of_calls_carry_the_route_s_queue_and_each_call_s_own_type() {
        let mut types = JobTypes::new();
        // No queue: `default`, named once for the route.
        let plain = route("");
        let (job_type, queue, _) = mapped(&plain, call("payment.Pay", "Charge"), &mut types);
        assert_eq!(
            (job_type.as_str(), queue.as_str()),
            ("payment.pay.charge", "default")
        );
        // The next call names another method: its own type, not the last one.
        let (job_type, _, _) = mapped(&plain, call("payment.Pay", "Refund"), &mut types);
        assert_eq!(job_type, "payment.pay.refund");
        let (job_type, _, _) = mapped(&plain, call("payment.Pay", "Charge"), &mut types);
        assert_eq!(job_type, "payment.pay.charge");
        // A literal queue; a templated one, rendered per call.
        let literal = route(r#"queue = "payments""#);
        assert_eq!(mapped(&literal, call("a.B", "C"), &mut types).1, "payments");
        let templated = route(
            r#"queue = "{topic}"
            allowed_queues = ["billing.*"]"#,
        );
        let (_, queue, _) = mapped(&templated, call("billing.invoices", "Send"), &mut types);
        assert_eq!(queue, "billing.invoices");
        // A type template replaces the named type.
        let typed = route(r#"type = "jobs.{action}""#);
        assert_eq!(mapped(&typed, call("a.B", "c"), &mut types).0, "jobs.c");
    }

    #[test]
    fn calls_that_make_invalid_job_names_are_unmappable_each_time() {
        let mut types = JobTypes::new();
        // An empty segment: no valid job type.
        let plain = route("");
        for _ in 0..2 {
            let reason = plain
                .map(call("a..b", "Do"), "calls", &mut types)
                .unwrap_err();
            assert_eq!(reason.error_type, "unmappable");
            assert!(reason.message.contains("job type"), "{}", reason.message);
        }
        // A literal queue the OJS schema refuses: every call says so.
        let upper = route(r#"queue = "Payments""#);
        for _ in 0..2 {
            let reason = upper
                .map(call("a.B", "C"), "calls", &mut types)
                .unwrap_err();
            assert_eq!(reason.error_type, "unmappable");
            assert!(
                reason.message.contains("\"Payments\""),
                "{}",
                reason.message
            );
        }
    }
}
