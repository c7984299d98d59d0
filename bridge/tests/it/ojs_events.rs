//! The live event stream (`GET /ojs/v1/events/stream`) of a real daemon:
//! 100 subscribers each receive every event of 10,000 pushed jobs in the
//! log's order, none lost; one that reconnects with `Last-Event-ID` goes
//! on where it was; a stream past `[api] max_event_streams` is refused;
//! and 1,000 open streams cost the daemon a bounded, printed amount of
//! memory.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use serde_json::{json, Value};

use crate::ojs_server::{post_json, OjsServer};

/// One SSE event: its id, type and data (JSON text).
#[derive(Debug, Clone)]
pub(crate) struct Sse {
    pub(crate) id: Option<String>,
    pub(crate) event: String,
    pub(crate) data: String,
}

impl Sse {
    /// The event's `job_id`, read without parsing the whole event (a
    /// million of them go by in a run).
    fn job_id(&self) -> &str {
        let rest = self
            .data
            .split("\"job_id\":\"")
            .nth(1)
            .expect("a job event names its job");
        &rest[..rest.find('"').unwrap()]
    }
}

/// A subscriber: the answer's body and what is left of its last frame.
pub(crate) struct Subscriber {
    body: Incoming,
    buffer: Vec<u8>,
    parsed: std::collections::VecDeque<Sse>,
}

impl Subscriber {
    /// Opens a stream; its status when it was refused.
    async fn open(
        addr: SocketAddr,
        query: &str,
        last: Option<&str>,
    ) -> Result<Subscriber, (u16, Value)> {
        Subscriber::at(addr, &format!("/ojs/v1/events/stream?{query}"), last).await
    }

    /// Opens the stream at `path`; its status when it was refused.
    pub(crate) async fn at(
        addr: SocketAddr,
        path: &str,
        last: Option<&str>,
    ) -> Result<Subscriber, (u16, Value)> {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(conn);
        let mut request = hyper::Request::get(path)
            .header("host", "test")
            .header("accept", "text/event-stream");
        if let Some(id) = last {
            request = request.header("last-event-id", id);
        }
        let response = sender
            .send_request(request.body(Empty::<Bytes>::new()).unwrap())
            .await
            .unwrap();
        let status = response.status().as_u16();
        if status != 200 {
            let body = response.into_body().collect().await.unwrap().to_bytes();
            return Err((status, serde_json::from_slice(&body).unwrap_or(Value::Null)));
        }
        assert_eq!(
            response.headers()["content-type"].to_str().unwrap(),
            "text/event-stream"
        );
        Ok(Subscriber {
            body: response.into_body(),
            buffer: Vec::new(),
            parsed: std::collections::VecDeque::new(),
        })
    }

    /// The next event (comments and the `retry:` line skipped); `None` at
    /// the stream's end or after `limit`.
    pub(crate) async fn next(&mut self, limit: Duration) -> Option<Sse> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if let Some(e) = self.parsed.pop_front() {
                return Some(e);
            }
            let frame = tokio::time::timeout_at(deadline, self.body.frame())
                .await
                .ok()??
                .ok()?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            self.buffer.extend_from_slice(&data);
            // Every whole block at once, one pass over what came.
            let mut start = 0;
            while let Some(end) = self.buffer[start..].windows(2).position(|w| w == b"\n\n") {
                let block = std::str::from_utf8(&self.buffer[start..start + end]).unwrap();
                let (mut id, mut event, mut data) = (None, String::new(), String::new());
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("id: ") {
                        id = Some(v.to_owned());
                    } else if let Some(v) = line.strip_prefix("event: ") {
                        event = v.to_owned();
                    } else if let Some(v) = line.strip_prefix("data: ") {
                        data.push_str(v);
                    }
                }
                if !event.is_empty() {
                    self.parsed.push_back(Sse { id, event, data });
                }
                start += end + 2;
            }
            self.buffer.drain(..start);
        }
    }

    /// Job events until `n` were read (or 120 s passed): their ids, and
    /// the last event id.
    async fn jobs(&mut self, n: usize) -> (Vec<String>, Option<String>) {
        let mut jobs = Vec::with_capacity(n);
        let mut last = None;
        let mut seqs = Vec::new();
        // Generous: with a thousand streams open the server writes every
        // event to each (a million frames from a debug build), which took
        // 58 s alone and more than 120 s in a loaded clean-clone run.
        let until = Instant::now() + Duration::from_secs(300);
        while jobs.len() < n && Instant::now() < until {
            let Some(e) = self.next(Duration::from_secs(30)).await else {
                break;
            };
            if e.event == "job.enqueued" {
                jobs.push(e.job_id().to_owned());
                let id = e.id.clone().unwrap();
                seqs.push(id.trim_start_matches("evt_").parse::<i64>().unwrap());
                last = Some(id);
            }
        }
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "the log's order");
        (jobs, last)
    }
}

async fn push(addr: SocketAddr, n: usize) -> Vec<String> {
    let mut ids = Vec::with_capacity(n);
    for start in (0..n).step_by(100) {
        let jobs: Vec<Value> = (start..n.min(start + 100))
            .map(|i| json!({"type": "stream.job", "args": [i], "options": {"queue": "streamed"}}))
            .collect();
        let a = post_json(addr, "/ojs/v1/jobs/batch", &json!({"jobs": jobs})).await;
        assert_eq!(a.status, 201, "{:?}", a.body);
        ids.extend(
            a.json()["jobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|j| j["id"].as_str().unwrap().to_owned()),
        );
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_subscribers_get_every_event_of_10000_jobs_in_order_and_resume_where_they_were() {
    const JOBS: usize = 10_000;
    const SUBSCRIBERS: usize = 100;
    let config = "[adapters]\nlocal = \"local:./ojs-bridge-data\"\n[api]\nadapter = \"local\"\nmax_event_streams = 100\n";
    let server = OjsServer::start(Some(config)).await;
    let addr = server.addr;
    let mut subscribers = Vec::with_capacity(SUBSCRIBERS);
    for _ in 0..SUBSCRIBERS {
        subscribers.push(
            Subscriber::open(addr, "types=job.enqueued", None)
                .await
                .unwrap(),
        );
    }
    // One more than the bound: refused, retryable.
    let Err((status, body)) = Subscriber::open(addr, "", None).await else {
        panic!("a stream past max_event_streams was opened");
    };
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (429, Some("rate_limited")),
        "{body}"
    );

    let sent = push(addr, JOBS).await;
    let expected: HashSet<&String> = sent.iter().collect();
    // Subscriber 0 leaves halfway and comes back with its last id.
    let mut first = subscribers.remove(0);
    let (before, last) = first.jobs(JOBS / 2).await;
    drop(first);
    let mut readers = tokio::task::JoinSet::new();
    for mut s in subscribers {
        readers.spawn(async move { s.jobs(JOBS).await.0 });
    }
    let mut complete = 0;
    while let Some(got) = readers.join_next().await {
        let got = got.unwrap();
        let distinct: HashSet<&String> = got.iter().collect();
        assert_eq!(got.len(), JOBS, "every event, each once");
        assert_eq!(distinct, expected, "the pushed jobs' events");
        complete += 1;
    }
    // Its slot is freed once the server sees the connection gone.
    let mut again = None;
    for _ in 0..50 {
        match Subscriber::open(addr, "types=job.enqueued", last.as_deref()).await {
            Ok(s) => {
                again = Some(s);
                break;
            }
            Err((429, _)) => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(other) => panic!("{other:?}"),
        }
    }
    let (after, _) = again
        .expect("the reconnect was admitted")
        .jobs(JOBS - before.len())
        .await;
    let mut all = before.clone();
    all.extend(after);
    let distinct: HashSet<&String> = all.iter().collect();
    println!(
        "event stream: {JOBS} jobs, {SUBSCRIBERS} subscribers: {complete} received every event in order; the one that reconnected after {} got {} more: lost {}, duplicated {}",
        before.len(),
        all.len() - before.len(),
        expected.len() - distinct.len(),
        all.len() - distinct.len()
    );
    assert_eq!((all.len(), distinct), (JOBS, expected));
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_open_streams_cost_bounded_memory() {
    let config = "[http]\nmax_connections = 1100\n[adapters]\nlocal = \"local:./ojs-bridge-data\"\n[api]\nadapter = \"local\"\n";
    let server = OjsServer::start(Some(config)).await;
    let rss = || {
        let status = std::fs::read_to_string(format!("/proc/{}/status", server.pid())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .unwrap()
            / 1024.0
    };
    push(server.addr, 100).await;
    let idle = rss();
    let mut streams = Vec::new();
    for _ in 0..1_000 {
        streams.push(Subscriber::open(server.addr, "", None).await.unwrap());
    }
    // Every stream gets 1,000 events, none read yet by its client: the
    // server holds a page per stream, not the events.
    push(server.addr, 1_000).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let open = rss();
    let mut read = 0;
    for s in streams.iter_mut().step_by(100) {
        read += s.jobs(1_000).await.0.len();
    }
    println!(
        "1,000 event streams: daemon RSS {idle:.1} MiB without, {open:.1} MiB with them and 1,000 events unread by each ({:.1} KiB a stream); 10 of them then read {read} events",
        (open - idle) * 1024.0 / 1000.0
    );
    assert_eq!(read, 10 * 1_000);
    // Bounded: well under what holding each stream's 1,000 events would take
    // (about 500 bytes an event, 500 MB for all).
    assert!(open - idle < 200.0, "{idle:.1} → {open:.1} MiB");
    drop(streams);
    server.stop();
}
