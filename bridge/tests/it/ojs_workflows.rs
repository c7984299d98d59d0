//! Workflows through a real daemon on RabbitMQ, killed with SIGKILL at
//! random points while workers run 1,000 chains of 3 steps: every chain
//! completes, a step is never handed out before the step it follows was
//! acknowledged, never handed out again once its own completion was
//! acknowledged, and none is lost. Prints steps / completed / handed out
//! again after a kill / duplicated / lost.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ojs_bridge_tests::brokers::{find, unique_queue, Broker};
use serde_json::{json, Value};

use crate::ojs_server::{get, post_json, try_answer, OjsServer};

const CHAINS: usize = 1_000;
const STEPS: usize = 3;
const WORKERS: usize = 8;
/// Kills -9 of the daemon while the chains run.
const KILLS: usize = 4;

/// A small seeded generator: the kill points of a run can be replayed
/// (`OJS_WORKFLOW_KILL_SEED`).
struct Points(u64);

impl Points {
    /// The next of the points, in `from..to`.
    fn next(&mut self, from: u64, to: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        from + self.0 % (to - from)
    }
}

#[derive(Default)]
struct Record {
    /// Each hand-out: job id, the server generation (when no restart came
    /// between the FETCH and its answer), when the FETCH was sent and when
    /// its answer came.
    handed: Vec<(String, Option<u32>, Instant, Instant)>,
    /// When the first ACK of each job was sent.
    first_ack: HashMap<String, Instant>,
    /// When the server said the job was completed (a 200 ACK, or a 409
    /// for a job INFO then reads completed).
    completed: HashMap<String, Instant>,
}

struct Shared {
    addr: Mutex<SocketAddr>,
    generation: AtomicU32,
    done: AtomicBool,
    record: Mutex<Record>,
}

impl Shared {
    fn addr(&self) -> SocketAddr {
        *self.addr.lock().unwrap()
    }
}

async fn work(shared: Arc<Shared>, worker: String) {
    let fetch =
        json!({"queues": ["flow"], "count": 10, "worker_id": worker, "wait_ms": 500}).to_string();
    while !shared.done.load(Ordering::Relaxed) {
        let generation = shared.generation.load(Ordering::SeqCst);
        let sent = Instant::now();
        let Some((200, body)) = try_answer(
            shared.addr(),
            "POST",
            "/ojs/v1/workers/fetch",
            fetch.as_bytes(),
        )
        .await
        else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let received = Instant::now();
        let same = (shared.generation.load(Ordering::SeqCst) == generation).then_some(generation);
        let jobs: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        for job in jobs["jobs"].as_array().into_iter().flatten() {
            let id = job["id"].as_str().unwrap().to_owned();
            shared
                .record
                .lock()
                .unwrap()
                .handed
                .push((id.clone(), same, sent, received));
            let ack = json!({"job_id": id, "result": {"by": worker}}).to_string();
            // The ACK is repeated through restarts until the server says
            // what became of the job: 200, or 409 (its completion was
            // committed by an attempt whose answer the kill took, or the
            // job was handed out again after a kill and completed there).
            let deadline = Instant::now() + Duration::from_secs(60);
            while Instant::now() < deadline {
                shared
                    .record
                    .lock()
                    .unwrap()
                    .first_ack
                    .entry(id.clone())
                    .or_insert_with(Instant::now);
                match try_answer(shared.addr(), "POST", "/ojs/v1/workers/ack", ack.as_bytes()).await
                {
                    Some((200, _)) => {
                        shared
                            .record
                            .lock()
                            .unwrap()
                            .completed
                            .entry(id.clone())
                            .or_insert_with(Instant::now);
                        break;
                    }
                    Some((409, _)) => {
                        let at = Instant::now();
                        if let Some((200, info)) =
                            try_answer(shared.addr(), "GET", &format!("/ojs/v1/jobs/{id}"), b"")
                                .await
                        {
                            let info: Value = serde_json::from_slice(&info).unwrap_or(Value::Null);
                            if info["job"]["state"] == "completed" {
                                shared
                                    .record
                                    .lock()
                                    .unwrap()
                                    .completed
                                    .entry(id.clone())
                                    .or_insert(at);
                            }
                        }
                        break;
                    }
                    _ => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_at_random_points_under_1000_chains_on_rabbitmq_loses_and_repeats_no_step() {
    let Some(rabbit) = find(Broker::RabbitMq).await else {
        return;
    };
    let prefix = unique_queue("flow");
    let config = format!(
        "[adapters.rabbit]\nurl = \"{}\"\nqueue_template = \"{prefix}.{{queue}}\"\n\n[api]\nadapter = \"rabbit\"\n",
        rabbit.url
    );
    let seed = std::env::var("OJS_WORKFLOW_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| u64::from(std::process::id()) | 1);
    println!("kill points from OJS_WORKFLOW_KILL_SEED={seed}");
    let mut points = Points(seed);
    let server = OjsServer::start(Some(&config)).await;

    // 1,000 chains, 16 creations at a time; each step's job id, in order.
    let mut chains: Vec<(String, Vec<String>)> = Vec::with_capacity(CHAINS);
    let addr = server.addr;
    let mut creations = tokio::task::JoinSet::new();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for _ in 0..16 {
        let next = next.clone();
        creations.spawn(async move {
            let mut made = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < CHAINS {
                let steps: Vec<Value> = (0..STEPS)
                    .map(|i| json!({"type": format!("flow.step{i}"), "args": [i], "options": {"queue": "flow"}}))
                    .collect();
                let a = post_json(addr, "/ojs/v1/workflows", &json!({"type": "chain", "steps": steps})).await;
                assert_eq!(a.status, 201, "{:?}", a.body);
                let w = a.json()["workflow"].clone();
                let ids = w["steps"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|s| s["job_id"].as_str().unwrap().to_owned())
                    .collect::<Vec<_>>();
                made.push((w["id"].as_str().unwrap().to_owned(), ids));
            }
            made
        });
    }
    while let Some(made) = creations.join_next().await {
        chains.extend(made.unwrap());
    }
    assert_eq!(chains.len(), CHAINS);
    let steps: Vec<&String> = chains.iter().flat_map(|(_, ids)| ids).collect();

    let shared = Arc::new(Shared {
        addr: Mutex::new(server.addr),
        generation: AtomicU32::new(0),
        done: AtomicBool::new(false),
        record: Mutex::new(Record::default()),
    });
    let workers: Vec<_> = (0..WORKERS)
        .map(|n| tokio::spawn(work(shared.clone(), format!("w{n}"))))
        .collect();

    // Kill -9 and restart at random points of the work: once each of
    // KILLS random shares of the steps (5-80 %) has completed, so that the
    // kills fall while the chains run however fast the machine is (random
    // pauses of 0.3-2 s between kills let a fast run finish before its
    // second kill).
    let mut kill_at: Vec<usize> = (0..KILLS)
        .map(|_| steps.len() * points.next(5, 80) as usize / 100)
        .collect();
    kill_at.sort_unstable();
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut server = Some(server);
    let mut kills = 0;
    while Instant::now() < deadline {
        let completed = shared.record.lock().unwrap().completed.len();
        if completed >= steps.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        if kill_at.get(kills).is_some_and(|&at| completed >= at) {
            let dir = server.take().unwrap().kill();
            kills += 1;
            let restarted = OjsServer::start_in(dir, Some(&config)).await;
            *shared.addr.lock().unwrap() = restarted.addr;
            shared.generation.fetch_add(1, Ordering::Relaxed);
            server = Some(restarted);
        }
    }
    shared.done.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.unwrap();
    }
    let server = server.unwrap();

    let record = std::mem::take(&mut *shared.record.lock().unwrap());
    let lost = steps
        .iter()
        .filter(|id| !record.completed.contains_key(id.as_str()))
        .count();
    // Duplicated: handed out by a FETCH sent after the server said the
    // job was completed, or handed out twice by one server generation
    // (only a kill gives a job back early; the visibility timeout is a
    // minute). Either means a step was published or handed out twice.
    let mut per_generation: HashMap<(&str, u32), usize> = HashMap::new();
    for (id, generation, _, _) in &record.handed {
        if let Some(g) = generation {
            *per_generation.entry((id.as_str(), *g)).or_default() += 1;
        }
    }
    let duplicated = record
        .handed
        .iter()
        .filter(|(id, _, sent, _)| record.completed.get(id).is_some_and(|done| done < sent))
        .count()
        + per_generation.values().filter(|n| **n > 1).count();
    // What a duplicate was, to read it from the daemon's log.
    for ((id, generation), n) in per_generation.iter().filter(|(_, n)| **n > 1).take(5) {
        println!("handed out {n} times by server generation {generation}: job {id}");
    }
    for (id, _, sent, _) in record
        .handed
        .iter()
        .filter(|(id, _, sent, _)| record.completed.get(id).is_some_and(|done| done < sent))
        .take(5)
    {
        let done = record.completed[id];
        println!(
            "handed out by a FETCH sent {:?} after its completion was answered: job {id}",
            sent.duration_since(done)
        );
    }
    let mut hand_outs: HashMap<&str, usize> = HashMap::new();
    for (id, _, _, _) in &record.handed {
        *hand_outs.entry(id.as_str()).or_default() += 1;
    }
    let again = hand_outs.values().filter(|n| **n > 1).count();
    // Out of order: a step handed out before any ACK of the step it
    // follows was sent.
    let mut early = 0;
    for (_, ids) in &chains {
        for pair in ids.windows(2) {
            let handed = record
                .handed
                .iter()
                .filter(|(id, _, _, _)| id == &pair[1])
                .map(|(_, _, _, received)| *received)
                .min();
            if let (Some(handed), Some(before)) = (handed, record.first_ack.get(&pair[0])) {
                if handed < *before {
                    early += 1;
                }
            }
        }
    }
    println!(
        "{CHAINS} chains of {STEPS} steps on RabbitMQ, {kills} kill -9: steps {}, completed {}, handed out again after a kill {again}, duplicated {duplicated}, out of order {early}, lost {lost}",
        steps.len(),
        record.completed.len(),
    );
    assert_eq!(
        kills, KILLS,
        "the daemon was killed {kills} times while the chains ran"
    );
    assert_eq!(lost, 0, "steps never completed");
    assert_eq!(duplicated, 0, "steps handed out after their completion");
    assert_eq!(
        early, 0,
        "steps handed out before the step they follow completed"
    );

    // Every chain reads back completed, its steps in order.
    for (id, _) in chains.iter().step_by(7) {
        let a = get(server.addr, &format!("/ojs/v1/workflows/{id}")).await;
        assert_eq!(a.status, 200, "{:?}", a.body);
        let w = a.json()["workflow"].clone();
        assert_eq!(
            (w["state"].as_str(), w["steps_completed"].as_u64()),
            (Some("completed"), Some(3)),
            "{w}"
        );
    }
    server.stop();
}
