//! The realtime WebSocket (`GET /ojs/v1/ws`, subprotocol `ojs.v1`): a
//! client subscribes to channels (`all`, `job:<id>`, `queue:<name>`,
//! each with optional event types, `job.*` prefixes allowed) and is sent
//! the log's events as they are written; the events document's dialect
//! (`channel: "events"` with a `filter`, answered with a
//! `subscription_id`, events sent bare) is served beside it.
//!
//! A connection is one follower of the event log (`crate::events`): one
//! of `[api] max_event_streams`, a cursor rather than a queue, so a slow
//! client falls behind in the log and never holds more than a page. A
//! client that reconnects sends `{"action":"resume","last_event_id":…}`:
//! the subscriptions of the connection that was last sent that event come
//! back (the server remembers the newest [`SESSIONS_KEPT`] closed
//! connections' subscriptions) and the events after it are sent again.
//! The server pings every [`PING_EVERY`] and closes a connection that
//! does not answer within [`PONG_WITHIN`]; it closes every connection
//! with 1001 (going away) when it drains.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use ojs_core::redact::Secret;
use serde_json::{json, Value};
use tokio_stream::Stream;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use crate::error::ApiError;
use crate::events::{cursor_of, Delivery};
use crate::store::{Event, EventFilter};
use crate::Api;

/// Where the WebSocket is served.
pub const PATH: &str = "/ojs/v1/ws";
/// The subprotocol the binding names.
pub const SUBPROTOCOL: &str = "ojs.v1";
/// How often the server pings.
pub const PING_EVERY: Duration = Duration::from_secs(30);
/// How long a ping waits for its pong before the connection is closed.
pub const PONG_WITHIN: Duration = Duration::from_secs(10);
/// Subscriptions one connection may hold.
pub const MAX_SUBSCRIPTIONS: usize = 100;
/// The largest message a client may send (a subscription is a few
/// hundred bytes).
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;
/// Closed connections whose subscriptions a `resume` can restore.
pub const SESSIONS_KEPT: usize = 1_000;
/// The text of one subscription (its channel, types and filters), at
/// most: with [`MAX_SUBSCRIPTIONS`], what a connection holds, and with
/// [`SESSIONS_KEPT`], what the remembered ones hold (100 MiB at the very
/// most; a few hundred KiB in practice).
pub const MAX_SUBSCRIPTION_BYTES: usize = 1024;

/// Whether the request is for the WebSocket.
pub fn is_websocket(method: &Method, path: &str) -> bool {
    *method == Method::GET && path.trim_end_matches('/') == PATH
}

/// What a client subscribed to.
#[derive(Debug, Clone, PartialEq)]
pub struct Subscription {
    channel: Channel,
    /// Event types or `prefix.*` patterns (empty: all).
    event_types: Vec<String>,
}

#[derive(Debug, Clone, PartialEq)]
enum Channel {
    All,
    Job(String),
    Queue(String),
    /// The events document's dialect: a filter under an id.
    Events {
        id: String,
        queues: Vec<String>,
        job_types: Vec<String>,
    },
}

impl Channel {
    fn name(&self) -> String {
        match self {
            Channel::All => "all".to_owned(),
            Channel::Job(id) => format!("job:{id}"),
            Channel::Queue(q) => format!("queue:{q}"),
            Channel::Events { .. } => "events".to_owned(),
        }
    }
}

impl Subscription {
    /// The bytes of text it holds.
    fn size(&self) -> usize {
        let list = |l: &[String]| l.iter().map(String::len).sum::<usize>();
        let channel = match &self.channel {
            Channel::All => 0,
            Channel::Job(s) | Channel::Queue(s) => s.len(),
            Channel::Events {
                id,
                queues,
                job_types,
            } => id.len() + list(queues) + list(job_types),
        };
        channel + list(&self.event_types)
    }

    fn admits(&self, event: &Event) -> bool {
        let field = |k: &str| event.body[k].as_str().unwrap_or_default();
        let kind = field("type");
        let typed =
            self.event_types.is_empty() || self.event_types.iter().any(|t| type_matches(t, kind));
        typed
            && match &self.channel {
                Channel::All => true,
                Channel::Job(id) => field("job_id") == id,
                Channel::Queue(q) => field("queue") == q,
                Channel::Events {
                    queues, job_types, ..
                } => {
                    let listed = |l: &[String], v: &str| l.is_empty() || l.iter().any(|x| x == v);
                    listed(queues, field("queue")) && listed(job_types, field("job_type"))
                }
            }
    }

    /// The message that carries `event` to this subscription's client.
    fn message(&self, event: &Event) -> Value {
        match &self.channel {
            Channel::Events { .. } => event.body.clone(),
            channel => {
                let mut data = match &event.body["data"] {
                    Value::Object(m) => m.clone(),
                    _ => serde_json::Map::new(),
                };
                for k in ["job_id", "queue", "job_type"] {
                    if !data.contains_key(k) {
                        data.insert(k.to_owned(), event.body[k].clone());
                    }
                }
                json!({"type": "event", "channel": channel.name(), "event": event.body["type"],
                       "data": data, "id": event.body["id"], "timestamp": event.body["time"]})
            }
        }
    }
}

/// `job.*` matches every `job.` type, `*` every type, anything else only
/// itself.
pub(crate) fn type_matches(pattern: &str, kind: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => kind.starts_with(prefix),
        None => pattern == kind,
    }
}

/// Closed connections' subscriptions, by the last event each was sent.
#[derive(Debug, Default)]
pub struct Sessions(std::sync::Mutex<VecDeque<(i64, Vec<Subscription>)>>);

impl Sessions {
    fn keep(&self, last_sent: i64, subscriptions: Vec<Subscription>) {
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() >= SESSIONS_KEPT {
            kept.pop_front();
        }
        kept.push_back((last_sent, subscriptions));
    }

    fn of(&self, last_sent: i64) -> Vec<Subscription> {
        let kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        kept.iter()
            .rev()
            .find(|(seq, _)| *seq == last_sent)
            .map(|(_, s)| s.clone())
            .unwrap_or_default()
    }
}

type Follower = Pin<Box<dyn Stream<Item = Delivery> + Send>>;

/// One accepted connection, before and while it runs.
pub struct Session {
    api: Arc<Api>,
    /// The request's `Authorization`, checked again for each subscription.
    authorization: Option<Secret>,
    follower: Follower,
    subscriptions: Vec<Subscription>,
    last_sent: Option<i64>,
    next_id: u64,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("subscriptions", &self.subscriptions)
            .field("last_sent", &self.last_sent)
            .finish_non_exhaustive()
    }
}

/// Checks the upgrade request: the WebSocket handshake's answer (101) and
/// the session to run on the upgraded connection, or the error answer
/// (400 not a WebSocket upgrade, 401/403 the token, 429 past `[api]
/// max_event_streams`).
pub async fn accept(
    api: &Arc<Api>,
    request: &Request<()>,
    request_id: &str,
) -> Result<(Response<()>, Session), Response<Bytes>> {
    let began = Instant::now();
    let accepted = handshake(api, request).await;
    let status = match &accepted {
        Ok(_) => 101,
        Err(e) => crate::http::status_of(e),
    };
    api.metrics()
        .request(crate::metrics::Binding::Http, "ws", status, began.elapsed());
    accepted.map_err(|e| crate::http::error_response(&e, request_id))
}

async fn handshake(
    api: &Arc<Api>,
    request: &Request<()>,
) -> Result<(Response<()>, Session), ApiError> {
    let header = |name: &str| {
        request
            .headers()
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let has = |name: &str, token: &str| header(name).iter().any(|v| v.eq_ignore_ascii_case(token));
    if !has("upgrade", "websocket") || !has("connection", "upgrade") {
        return Err(ApiError::invalid(
            "Upgrade",
            "GET /ojs/v1/ws is a WebSocket: send Connection: Upgrade and Upgrade: websocket",
        ));
    }
    if !has("sec-websocket-version", "13") {
        return Err(ApiError::invalid(
            "Sec-WebSocket-Version",
            "must be 13 (RFC 6455)",
        ));
    }
    let key = request
        .headers()
        .get("sec-websocket-key")
        .map(HeaderValue::as_bytes)
        .filter(|k| !k.is_empty())
        .ok_or_else(|| ApiError::invalid("Sec-WebSocket-Key", "is required"))?;
    let accept_key = tokio_tungstenite::tungstenite::handshake::derive_accept_key(key);
    let authorization = request
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let grant = api.tokens().identify(authorization)?;
    let follower = api
        .follow(&grant, EventFilter::default(), None)
        .await?
        .boxed();
    let mut head = Response::new(());
    *head.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = head.headers_mut();
    h.insert(http::header::UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(
        http::header::CONNECTION,
        HeaderValue::from_static("upgrade"),
    );
    if let Ok(v) = HeaderValue::from_str(&accept_key) {
        h.insert("sec-websocket-accept", v);
    }
    if has("sec-websocket-protocol", SUBPROTOCOL) {
        h.insert(
            "sec-websocket-protocol",
            HeaderValue::from_static(SUBPROTOCOL),
        );
    }
    Ok((
        head,
        Session {
            api: api.clone(),
            authorization: authorization.map(Secret::new),
            follower,
            subscriptions: Vec::new(),
            last_sent: None,
            next_id: 0,
        },
    ))
}

/// The limits a server side of the connection reads frames with.
pub fn config() -> WebSocketConfig {
    WebSocketConfig::default()
        .max_message_size(Some(MAX_MESSAGE_BYTES))
        .max_frame_size(Some(MAX_MESSAGE_BYTES))
}

/// Why a connection ended, for the log.
enum Ended {
    ClientClosed,
    TooBig,
    NoPong,
    Draining,
    Failed(String),
}

impl Session {
    /// Runs the session on the upgraded connection `io` until the client
    /// leaves, stops answering pings, or the server drains.
    pub async fn run<S>(self, io: S)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send,
    {
        let ws = WebSocketStream::from_raw_socket(io, Role::Server, Some(config())).await;
        self.serve(ws).await;
    }

    async fn serve<S>(mut self, ws: WebSocketStream<S>)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send,
    {
        let (mut sink, mut source) = ws.split();
        let mut pinged: Option<Instant> = None;
        let mut last_ping = Instant::now();
        let mut tick = tokio::time::interval(PONG_WITHIN / 2);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let ended = loop {
            tokio::select! {
                incoming = source.next() => {
                    let text = match incoming {
                        None | Some(Ok(Message::Close(_))) => break Ended::ClientClosed,
                        Some(Err(tokio_tungstenite::tungstenite::Error::Capacity(_))) => {
                            break Ended::TooBig
                        }
                        Some(Err(e)) => break Ended::Failed(e.to_string()),
                        Some(Ok(Message::Text(t))) => t.to_string(),
                        Some(Ok(Message::Binary(_))) => {
                            let e = error("invalid_request", "send JSON text messages");
                            if let Err(e) = sink.send(text_message(&e)).await {
                                break Ended::Failed(e.to_string());
                            }
                            continue;
                        }
                        Some(Ok(Message::Pong(_))) => {
                            pinged = None;
                            continue;
                        }
                        // Pings are answered by the connection itself.
                        Some(Ok(_)) => continue,
                    };
                    let replies = self.on_text(&text).await;
                    let mut failed = None;
                    for r in replies {
                        if let Err(e) = sink.feed(text_message(&r)).await {
                            failed = Some(e.to_string());
                            break;
                        }
                    }
                    if let Some(e) = failed.or(sink.flush().await.err().map(|e| e.to_string())) {
                        break Ended::Failed(e);
                    }
                }
                delivery = self.follower.next() => {
                    let Some(delivery) = delivery else {
                        break Ended::Draining;
                    };
                    match self.deliver(delivery, &mut sink).await {
                        Ok(true) => {}
                        Ok(false) => break Ended::Draining,
                        Err(e) => break Ended::Failed(e),
                    }
                }
                _ = tick.tick() => {
                    if pinged.is_some_and(|at| at.elapsed() >= PONG_WITHIN) {
                        break Ended::NoPong;
                    }
                    if pinged.is_none() && last_ping.elapsed() >= PING_EVERY {
                        last_ping = Instant::now();
                        pinged = Some(last_ping);
                        if let Err(e) = sink.send(Message::Ping(Bytes::new())).await {
                            break Ended::Failed(e.to_string());
                        }
                    }
                }
            }
        };
        let (code, reason) = match &ended {
            Ended::ClientClosed | Ended::Failed(_) => (CloseCode::Normal, ""),
            Ended::NoPong => (CloseCode::Policy, "no pong within 10 s"),
            Ended::TooBig => (CloseCode::Size, "a message is at most 64 KiB"),
            Ended::Draining => (CloseCode::Away, "the server is stopping"),
        };
        if !matches!(ended, Ended::Failed(_)) {
            let close = Message::Close(Some(CloseFrame {
                code,
                reason: reason.into(),
            }));
            // The client may be gone already; nothing is owed to it then.
            let _ = sink.send(close).await;
        }
        let why = match &ended {
            Ended::ClientClosed => "the client closed it",
            Ended::NoPong => "no pong",
            Ended::TooBig => "a message too large",
            Ended::Draining => "the server is draining",
            Ended::Failed(e) => e.as_str(),
        };
        tracing::debug!(
            why,
            subscriptions = self.subscriptions.len(),
            "WebSocket closed"
        );
        if let Some(last) = self.last_sent {
            if !self.subscriptions.is_empty() {
                self.api.sessions.keep(last, self.subscriptions);
            }
        }
    }

    /// Sends what `delivery` owes the client; `false` when the session
    /// ends after it.
    async fn deliver<K>(&mut self, delivery: Delivery, sink: &mut K) -> Result<bool, String>
    where
        K: futures::Sink<Message> + Unpin,
        K::Error: std::fmt::Display,
    {
        let messages: Vec<Value> = match delivery {
            Delivery::Idle => return Ok(true),
            Delivery::Shutdown => {
                let m = json!({"type": "event", "channel": "system", "event": "server.shutdown",
                               "data": Delivery::shutdown_body()["data"]});
                sink.send(text_message(&m))
                    .await
                    .map_err(|e| e.to_string())?;
                return Ok(false);
            }
            Delivery::Gap { after, oldest } => {
                vec![json!({"type": "warning", "code": "events_dropped",
                            "count": oldest - 1 - after, "channel": "all",
                            "oldest_dropped_id": crate::events::event_id(after + 1),
                            "newest_dropped_id": crate::events::event_id(oldest - 1)})]
            }
            Delivery::Event(e) => {
                let out: Vec<Value> = self
                    .subscriptions
                    .iter()
                    .filter(|s| s.admits(&e))
                    .map(|s| s.message(&e))
                    .collect();
                if !out.is_empty() {
                    self.last_sent = Some(e.seq);
                }
                out
            }
        };
        for m in &messages {
            sink.feed(text_message(m))
                .await
                .map_err(|e| e.to_string())?;
        }
        if !messages.is_empty() {
            sink.flush().await.map_err(|e| e.to_string())?;
        }
        Ok(true)
    }

    /// The answers to one client message.
    async fn on_text(&mut self, text: &str) -> Vec<Value> {
        let Ok(Value::Object(m)) = serde_json::from_str::<Value>(text) else {
            return vec![error(
                "invalid_request",
                "a message is a JSON object with an action",
            )];
        };
        let field = |k: &str| m.get(k).and_then(Value::as_str).map(str::to_owned);
        let strings = |v: Option<&Value>| -> Result<Vec<String>, Value> {
            match v {
                None | Some(Value::Null) => Ok(Vec::new()),
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|i| i.as_str().map(str::to_owned))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| error("invalid_request", "a filter is a list of strings")),
                Some(_) => Err(error("invalid_request", "a filter is a list of strings")),
            }
        };
        match field("action").as_deref() {
            Some("subscribe") => {
                let Some(channel) = field("channel") else {
                    return vec![error("invalid_request", "subscribe names a channel")];
                };
                if channel == "events" {
                    let filter = m.get("filter");
                    let part = |k: &str| strings(filter.and_then(|f| f.get(k)));
                    let (types, queues, job_types) =
                        match (part("event_types"), part("queues"), part("job_types")) {
                            (Ok(t), Ok(q), Ok(j)) => (t, q, j),
                            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => return vec![e],
                        };
                    if self.subscriptions.len() >= MAX_SUBSCRIPTIONS {
                        return vec![too_many()];
                    }
                    self.next_id += 1;
                    let id = format!("sub_{}", self.next_id);
                    let subscription = Subscription {
                        channel: Channel::Events {
                            id: id.clone(),
                            queues,
                            job_types,
                        },
                        event_types: types,
                    };
                    if subscription.size() > MAX_SUBSCRIPTION_BYTES {
                        return vec![too_large()];
                    }
                    self.subscriptions.push(subscription);
                    return vec![
                        json!({"action": "subscribed", "channel": "events", "subscription_id": id}),
                    ];
                }
                let event_types = match strings(m.get("event_types")) {
                    Ok(t) => t,
                    Err(e) => return vec![e],
                };
                let text: usize =
                    channel.len() + event_types.iter().map(String::len).sum::<usize>();
                if text > MAX_SUBSCRIPTION_BYTES {
                    return vec![too_large()];
                }
                let (api, authorization) = (self.api.clone(), self.authorization.clone());
                let parsed = match channel_named(&api, authorization.as_ref(), &channel).await {
                    Ok(c) => c,
                    Err(e) => return vec![e],
                };
                let subscription = Subscription {
                    channel: parsed,
                    event_types: event_types.clone(),
                };
                if subscription.size() > MAX_SUBSCRIPTION_BYTES {
                    return vec![too_large()];
                }
                // Subscribing again replaces the channel's filter.
                let held = self.subscriptions.len();
                match self
                    .subscriptions
                    .iter_mut()
                    .find(|s| s.channel == subscription.channel)
                {
                    Some(s) => *s = subscription,
                    None if held >= MAX_SUBSCRIPTIONS => return vec![too_many()],
                    None => self.subscriptions.push(subscription),
                }
                let mut reply = json!({"type": "subscribed", "channel": channel});
                if m.contains_key("event_types") {
                    reply["event_types"] = json!(event_types);
                }
                vec![reply]
            }
            Some("unsubscribe") => {
                if let Some(id) = field("subscription_id") {
                    let before = self.subscriptions.len();
                    self.subscriptions.retain(
                        |s| !matches!(&s.channel, Channel::Events { id: sid, .. } if *sid == id),
                    );
                    if self.subscriptions.len() == before {
                        return vec![error("not_found", &format!("no subscription {id}"))];
                    }
                    return vec![json!({"action": "unsubscribed", "subscription_id": id})];
                }
                let Some(channel) = field("channel") else {
                    return vec![error(
                        "invalid_request",
                        "unsubscribe names a channel or a subscription_id",
                    )];
                };
                let before = self.subscriptions.len();
                self.subscriptions.retain(|s| s.channel.name() != channel);
                if self.subscriptions.len() == before {
                    return vec![error("not_found", &format!("not subscribed to {channel}"))];
                }
                vec![json!({"type": "unsubscribed", "channel": channel})]
            }
            Some("resume") => self.resume(field("last_event_id")).await,
            Some("ping") => vec![json!({"type": "pong"})],
            _ => vec![error(
                "invalid_request",
                "action is subscribe, unsubscribe, resume or ping",
            )],
        }
    }

    /// Goes back to the event after `last_event_id`, with the
    /// subscriptions of the connection that was last sent it.
    async fn resume(&mut self, last_event_id: Option<String>) -> Vec<Value> {
        let Some(id) = last_event_id else {
            return vec![error("invalid_request", "resume names a last_event_id")];
        };
        let unknown = || {
            error(
                "unknown_event_id",
                &format!("{id} is not an event of this server"),
            )
        };
        let Some(seq) = cursor_of(&id) else {
            return vec![unknown()];
        };
        let newest = match self.api.store.run(|tx| tx.event_bounds()).await {
            Ok((_, newest)) => newest.unwrap_or(0),
            Err(e) => return vec![api_error(&ApiError::from(e))],
        };
        if seq > newest || seq < 0 {
            return vec![unknown()];
        }
        for s in self.api.sessions.of(seq) {
            if !self.subscriptions.contains(&s) && self.subscriptions.len() < MAX_SUBSCRIPTIONS {
                self.subscriptions.push(s);
            }
        }
        let grant = match self
            .api
            .tokens()
            .identify(self.authorization.as_ref().map(Secret::expose))
        {
            Ok(g) => g,
            Err(e) => return vec![api_error(&e)],
        };
        // The old follower's place is given back before the new one takes one.
        self.follower = futures::stream::empty().boxed();
        match self
            .api
            .follow(&grant, EventFilter::default(), Some(seq))
            .await
        {
            Ok(f) => self.follower = f.boxed(),
            Err(e) => return vec![api_error(&e)],
        }
        let channels: Vec<String> = self
            .subscriptions
            .iter()
            .map(|s| s.channel.name())
            .collect();
        vec![json!({"type": "resumed", "last_event_id": id, "channels": channels})]
    }
}

/// A realtime channel by name, if it names something the token sees.
async fn channel_named(
    api: &Api,
    authorization: Option<&Secret>,
    name: &str,
) -> Result<Channel, Value> {
    let grant = api
        .tokens()
        .identify(authorization.map(Secret::expose))
        .map_err(|e| api_error(&e))?;
    if name == "all" {
        return Ok(Channel::All);
    }
    if let Some(id) = name.strip_prefix("job:").filter(|s| !s.is_empty()) {
        return match api.info(&grant, id).await {
            Ok(_) => Ok(Channel::Job(id.to_owned())),
            Err(e) => Err(api_error(&e)),
        };
    }
    if let Some(queue) = name.strip_prefix("queue:").filter(|s| !s.is_empty()) {
        let queues = api.queues(&grant).await.map_err(|e| api_error(&e))?;
        if queues.iter().any(|q| q.name == queue) {
            return Ok(Channel::Queue(queue.to_owned()));
        }
        return Err(error("not_found", &format!("queue {queue} is not known")));
    }
    Err(error(
        "not_found",
        &format!("no channel {name}: all, job:<id>, queue:<name> or events"),
    ))
}

fn text_message(v: &Value) -> Message {
    Message::text(v.to_string())
}

fn error(code: &str, message: &str) -> Value {
    json!({"type": "error", "code": code, "message": message})
}

fn api_error(e: &ApiError) -> Value {
    error(e.code().as_str(), &e.to_string())
}

fn too_large() -> Value {
    error(
        "invalid_request",
        &format!("a subscription's channel, types and filters hold at most {MAX_SUBSCRIPTION_BYTES} bytes"),
    )
}

fn too_many() -> Value {
    error(
        "too_many_subscriptions",
        &format!("a connection holds at most {MAX_SUBSCRIPTIONS} subscriptions"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: &str, job: &str, queue: &str) -> Event {
        Event {
            seq: 7,
            body: json!({"id": "evt_0000000000000007", "type": kind, "job_id": job, "queue": queue,
                         "job_type": "email.send", "time": "2026-11-28T00:00:00.000Z",
                         "data": {"attempt": 1}}),
        }
    }

    #[test]
    fn channels_and_types_select_events() {
        let sub = |channel, types: &[&str]| Subscription {
            channel,
            event_types: types.iter().map(|s| (*s).to_owned()).collect(),
        };
        let e = event("job.completed", "j1", "mail");
        assert!(sub(Channel::All, &[]).admits(&e));
        assert!(sub(Channel::All, &["job.*"]).admits(&e));
        assert!(!sub(Channel::All, &["workflow.*"]).admits(&e));
        assert!(sub(Channel::Job("j1".into()), &["job.completed"]).admits(&e));
        assert!(!sub(Channel::Job("j2".into()), &[]).admits(&e));
        assert!(sub(Channel::Queue("mail".into()), &["*"]).admits(&e));
        assert!(!sub(Channel::Queue("other".into()), &[]).admits(&e));
        let events = |queues: &[&str]| Channel::Events {
            id: "sub_1".into(),
            queues: queues.iter().map(|s| (*s).to_owned()).collect(),
            job_types: vec![],
        };
        assert!(sub(events(&["mail"]), &[]).admits(&e));
        assert!(!sub(events(&["other"]), &[]).admits(&e));
    }

    #[test]
    fn each_dialect_gets_its_message() {
        let e = event("job.started", "j1", "mail");
        let realtime = Subscription {
            channel: Channel::Queue("mail".into()),
            event_types: vec![],
        }
        .message(&e);
        assert_eq!(realtime["type"], "event");
        assert_eq!(realtime["channel"], "queue:mail");
        assert_eq!(realtime["event"], "job.started");
        assert_eq!(realtime["id"], "evt_0000000000000007");
        assert_eq!(realtime["data"]["attempt"], 1);
        assert_eq!(realtime["data"]["job_id"], "j1");
        assert_eq!(realtime["timestamp"], "2026-11-28T00:00:00.000Z");
        let bare = Subscription {
            channel: Channel::Events {
                id: "sub_1".into(),
                queues: vec![],
                job_types: vec![],
            },
            event_types: vec![],
        }
        .message(&e);
        assert_eq!(bare, e.body);
    }

    #[test]
    fn a_subscription_counts_its_text() {
        let sub = Subscription {
            channel: Channel::Events {
                id: "sub_1".into(),
                queues: vec!["q".repeat(600)],
                job_types: vec!["t".repeat(600)],
            },
            event_types: vec![],
        };
        assert_eq!(sub.size(), 1205);
    }

    #[test]
    fn closed_sessions_are_kept_newest_first_and_bounded() {
        let sessions = Sessions::default();
        let s = |q: &str| Subscription {
            channel: Channel::Queue(q.into()),
            event_types: vec![],
        };
        sessions.keep(5, vec![s("a")]);
        sessions.keep(5, vec![s("b")]);
        assert_eq!(sessions.of(5), vec![s("b")]);
        assert!(sessions.of(6).is_empty());
        for i in 0..SESSIONS_KEPT as i64 {
            sessions.keep(100 + i, vec![s("c")]);
        }
        assert!(sessions.of(5).is_empty(), "the oldest are forgotten");
    }
}
