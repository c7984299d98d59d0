//! Workflows in process: `Api` over a real broker of the embedded kind
//! (or the in-memory one shared by two replicas), the embedded job store
//! or a real PostgreSQL, called as the bindings call it. Each case asserts
//! what becomes of the steps' jobs: what a FETCH hands out, when, with
//! which results, and the workflow's record.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use ojs_api::worker::{Failure, Fetch};
use ojs_api::{Api, ApiError, ApiSettings, ErrorCode, Job};
use ojs_queue::QueueAdapter;
use serde_json::{json, Map, Value};
use tokio::sync::watch;

struct Server {
    api: Arc<Api>,
    stop: watch::Sender<bool>,
}

impl Server {
    /// An `Api` over `adapter`; its loop (the scheduler, the publisher of
    /// readied jobs, recovery) runs only when `running`: one that does not
    /// is a process that stopped before publishing what it readied.
    async fn open(settings: ApiSettings, adapter: Arc<dyn QueueAdapter>, running: bool) -> Server {
        let api = Api::open(settings, adapter, "broker").await.unwrap();
        let (stop, stopped) = watch::channel(false);
        if running {
            tokio::spawn(api.clone().run(stopped));
        }
        Server { api, stop }
    }

    async fn create(&self, body: Value) -> Result<Value, ApiError> {
        let grant = self.api.tokens().identify(None)?;
        Ok(self.api.create_workflow(&grant, body).await?.to_json())
    }

    async fn get(&self, id: &str) -> Value {
        let grant = self.api.tokens().identify(None).unwrap();
        self.api.workflow(&grant, id).await.unwrap().to_json()
    }

    async fn cancel(&self, id: &str) -> Result<Value, ApiError> {
        let grant = self.api.tokens().identify(None)?;
        Ok(self.api.cancel_workflow(&grant, id).await?.to_json())
    }

    async fn fetch(&self, queue: &str, wait: Duration) -> Vec<Job> {
        let grant = self.api.tokens().identify(None).unwrap();
        self.api
            .fetch(
                &grant,
                Fetch {
                    queues: vec![queue.to_owned()],
                    count: 10,
                    worker_id: Some("w1".into()),
                    visibility: None,
                    wait,
                },
            )
            .await
            .unwrap()
    }

    async fn ack(&self, id: &str, result: Value) -> Job {
        let grant = self.api.tokens().identify(None).unwrap();
        self.api.ack(&grant, id, Some(result)).await.unwrap()
    }

    async fn nack(&self, id: &str) -> Job {
        let grant = self.api.tokens().identify(None).unwrap();
        let error: Map<String, Value> =
            json!({"code": "boom", "message": "failed", "retryable": false})
                .as_object()
                .cloned()
                .unwrap();
        self.api
            .nack(
                &grant,
                Failure {
                    job_id: id.to_owned(),
                    error,
                    requeue: false,
                },
            )
            .await
            .unwrap()
    }

    /// Stops its loop and lets its workers' settlements finish.
    async fn stop(self) {
        let _ = self.stop.send(true);
        self.api.drain().await;
    }
}

fn settings(dir: &std::path::Path) -> ApiSettings {
    ApiSettings {
        state_dir: dir.join("store"),
        ..ApiSettings::default()
    }
}

async fn embedded(dir: &std::path::Path) -> Arc<dyn QueueAdapter> {
    Arc::new(
        ojs_adapter_local::LocalAdapter::open(ojs_adapter_local::LocalConfig::new(
            dir.join("broker"),
        ))
        .await
        .unwrap(),
    )
}

fn memory() -> Arc<dyn QueueAdapter> {
    Arc::new(ojs_adapter_memory::MemoryAdapter::new(
        ojs_adapter_memory::MemoryConfig::default(),
    ))
}

fn chain(queue: &str, steps: usize) -> Value {
    let steps: Vec<Value> = (0..steps)
        .map(|i| json!({"type": format!("step.n{i}"), "args": [i], "options": {"queue": queue}}))
        .collect();
    json!({"type": "chain", "name": "c", "steps": steps})
}

fn id_of(workflow: &Value) -> String {
    workflow["id"].as_str().unwrap().to_owned()
}

const NONE_WAIT: Duration = Duration::from_millis(300);
const SOME_WAIT: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_hands_out_each_step_after_the_one_before_with_every_earlier_result() {
    let dir = ojs_bridge_tests::tempdir::TempDir::new("wf-chain");
    let s = Server::open(settings(dir.path()), embedded(dir.path()).await, true).await;
    let wf = s.create(chain("wf-chain", 3)).await.unwrap();
    assert_eq!(
        (wf["state"].as_str(), wf["steps_total"].as_u64()),
        (Some("running"), Some(3))
    );
    let mut results = Vec::new();
    for i in 0..3 {
        let jobs = s.fetch("wf-chain", SOME_WAIT).await;
        assert_eq!(jobs.len(), 1, "step {i} alone is out");
        let job = &jobs[0];
        assert_eq!(job.envelope.job_type, format!("step.n{i}"));
        assert_eq!(job.extra["workflow_id"], json!(id_of(&wf)));
        if i > 0 {
            assert_eq!(job.extra["parent_results"], json!(results), "step {i}");
        }
        assert!(
            s.fetch("wf-chain", NONE_WAIT).await.is_empty(),
            "no later step before step {i} completed"
        );
        let result = json!({"n": i});
        s.ack(&job.envelope.id, result.clone()).await;
        results.push(result);
    }
    let done = s.get(&id_of(&wf)).await;
    assert_eq!(done["state"], "completed");
    assert_eq!(done["steps_completed"], 3);
    // The first step's life in the event log: enqueued once.
    let grant = s.api.tokens().identify(None).unwrap();
    let first = done["steps"][0]["job_id"].as_str().unwrap();
    let log = s
        .api
        .events(
            &grant,
            ojs_api::store::EventFilter {
                types: vec!["job.enqueued".into()],
                limit: 1000,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let enqueued = log
        .events
        .iter()
        .filter(|e| e.body["job_id"] == first)
        .count();
    assert_eq!(enqueued, 1, "one job.enqueued for the first step");
    // The workflow's own events, in order.
    let log = s
        .api
        .events(
            &grant,
            ojs_api::store::EventFilter {
                limit: 1000,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let ours: Vec<&str> = log
        .events
        .iter()
        .filter(|e| e.body["data"]["workflow_id"] == id_of(&wf).as_str())
        .map(|e| e.body["type"].as_str().unwrap())
        .collect();
    assert_eq!(
        ours,
        [
            "workflow.created",
            "workflow.started",
            "workflow.step_completed",
            "workflow.step_completed",
            "workflow.step_completed",
            "workflow.completed"
        ]
    );
    assert!(done["completed_at"].is_string());
    assert_eq!(done["steps"][2]["result"], json!({"n": 2}));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_readied_by_a_process_that_stopped_before_publishing_it_is_handed_out_once_after_the_start(
) {
    let dir = ojs_bridge_tests::tempdir::TempDir::new("wf-crash");
    let before = Server::open(settings(dir.path()), embedded(dir.path()).await, false).await;
    let wf = before.create(chain("wf-crash", 2)).await.unwrap();
    let first = before.fetch("wf-crash", SOME_WAIT).await;
    assert_eq!(first.len(), 1);
    // Step 1 is readied in the ACK's transaction; this process has no
    // publisher running, so it never reaches the broker here.
    before.ack(&first[0].envelope.id, json!({"ok": 1})).await;
    let info = {
        let grant = before.api.tokens().identify(None).unwrap();
        before.api.workflow(&grant, &id_of(&wf)).await.unwrap()
    };
    let step_1 = info.workflow.steps[1].job_id.clone();
    assert!(
        before.fetch("wf-crash", NONE_WAIT).await.is_empty(),
        "not published by the stopped process"
    );
    before.stop().await;

    let after = Server::open(settings(dir.path()), embedded(dir.path()).await, true).await;
    let jobs = after.fetch("wf-crash", SOME_WAIT).await;
    assert_eq!(
        jobs.iter()
            .map(|j| j.envelope.id.clone())
            .collect::<Vec<_>>(),
        vec![step_1.clone()]
    );
    assert_eq!(jobs[0].extra["parent_results"], json!([{"ok": 1}]));
    assert!(
        !jobs[0]
            .to_json()
            .as_object()
            .unwrap()
            .contains_key("publishing"),
        "the mark is the server's"
    );
    assert!(
        after.fetch("wf-crash", NONE_WAIT).await.is_empty(),
        "handed out once"
    );
    after.ack(&step_1, json!(null)).await;
    assert_eq!(after.get(&id_of(&wf)).await["state"], "completed");
    after.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_chain_cancels_the_step_already_on_the_broker_and_what_waits() {
    let dir = ojs_bridge_tests::tempdir::TempDir::new("wf-cancel");
    let s = Server::open(settings(dir.path()), embedded(dir.path()).await, true).await;
    let wf = s.create(chain("wf-cancel", 3)).await.unwrap();
    let first = s.fetch("wf-cancel", SOME_WAIT).await;
    s.ack(&first[0].envelope.id, json!(1)).await;
    // Step 1 is on the broker now.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let cancelled = s.cancel(&id_of(&wf)).await.unwrap();
    assert_eq!(cancelled["state"], "cancelled");
    assert!(cancelled["cancelled_at"].is_string());
    let states: Vec<&str> = cancelled["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, vec!["completed", "cancelled", "cancelled"]);
    assert!(
        s.fetch("wf-cancel", Duration::from_secs(1))
            .await
            .is_empty(),
        "the broker's copy of step 1 is not handed out"
    );
    let again = s.cancel(&id_of(&wf)).await.unwrap_err();
    assert_eq!(again.code(), ErrorCode::Conflict);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_step_stops_a_chain_and_a_group_runs_on_past_a_failed_member() {
    let dir = ojs_bridge_tests::tempdir::TempDir::new("wf-fail");
    let s = Server::open(settings(dir.path()), embedded(dir.path()).await, true).await;
    let wf = s.create(chain("wf-fail", 3)).await.unwrap();
    let first = s.fetch("wf-fail", SOME_WAIT).await;
    let failed = s.nack(&first[0].envelope.id).await;
    assert_eq!(failed.state(), ojs_core::JobState::Discarded);
    assert!(s.fetch("wf-fail", Duration::from_secs(1)).await.is_empty());
    let record = s.get(&id_of(&wf)).await;
    assert_eq!(
        (
            record["state"].as_str(),
            record["failed_step_index"].as_u64()
        ),
        (Some("failed"), Some(0))
    );
    assert_eq!(record["errors"][0]["code"], "boom");
    let grant = s.api.tokens().identify(None).unwrap();
    let failed = s
        .api
        .events(
            &grant,
            ojs_api::store::EventFilter {
                types: vec!["workflow.failed".into()],
                limit: 100,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let data = &failed.events[0].body["data"];
    assert_eq!(
        (
            data["failed_step_id"].as_str(),
            data["error"]["code"].as_str()
        ),
        (Some("0"), Some("boom")),
        "{data}"
    );

    let group = json!({"type": "group", "jobs": [
        {"type": "g.a", "args": [], "options": {"queue": "wf-group"}},
        {"type": "g.b", "args": [], "options": {"queue": "wf-group"}},
    ]});
    let g = s.create(group).await.unwrap();
    let jobs = s.fetch("wf-group", SOME_WAIT).await;
    assert_eq!(jobs.len(), 2, "a group's members are out at once");
    assert_eq!(jobs[0].envelope.job_type, "g.a", "in the request's order");
    s.nack(&jobs[0].envelope.id).await;
    assert_eq!(
        s.get(&id_of(&g)).await["state"],
        "running",
        "the sibling goes on"
    );
    s.ack(&jobs[1].envelope.id, json!(2)).await;
    let done = s.get(&id_of(&g)).await;
    assert_eq!(
        (done["state"].as_str(), done["jobs_completed"].as_u64()),
        (Some("failed"), Some(1))
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_past_the_bound_reach_the_next_step_as_null_nearest_first() {
    let dir = ojs_bridge_tests::tempdir::TempDir::new("wf-results");
    let mut settings = settings(dir.path());
    settings.max_parent_results_bytes = 60;
    let s = Server::open(settings, embedded(dir.path()).await, true).await;
    s.create(chain("wf-results", 3)).await.unwrap();
    let big = json!({"text": "x".repeat(40)});
    for _ in 0..2 {
        let jobs = s.fetch("wf-results", SOME_WAIT).await;
        s.ack(&jobs[0].envelope.id, big.clone()).await;
    }
    let last = s.fetch("wf-results", SOME_WAIT).await;
    assert_eq!(last[0].extra["parent_results"], json!([null, big]));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workflow_that_breaks_a_rule_is_refused_naming_where_and_stores_nothing() {
    let dir = ojs_bridge_tests::tempdir::TempDir::new("wf-bad");
    let mut settings = settings(dir.path());
    settings.max_workflow_steps = 3;
    let s = Server::open(settings, embedded(dir.path()).await, true).await;
    let path_of = |e: ApiError| match e {
        ApiError::InvalidWorkflow { path, .. } => path,
        other => panic!("not invalid_workflow: {other:?}"),
    };
    let bad_job = json!({"type": "chain", "steps": [
        {"type": "ok.one", "args": [], "options": {"queue": "wf-bad"}},
        {"type": "Not A Type", "args": []},
    ]});
    assert_eq!(
        path_of(s.create(bad_job).await.unwrap_err()),
        "steps[1].type"
    );
    assert_eq!(
        path_of(s.create(chain("wf-bad", 4)).await.unwrap_err()),
        "steps"
    );
    let cycle = json!({"name": "g", "steps": [
        {"id": "a", "type": "x.a", "args": [], "depends_on": ["b"]},
        {"id": "b", "type": "x.b", "args": [], "depends_on": ["a"]},
    ]});
    assert_eq!(
        path_of(s.create(cycle).await.unwrap_err()),
        "steps[0].depends_on"
    );
    let no_callback = json!({"type": "batch", "jobs": [{"type": "x.a", "args": []}]});
    assert_eq!(
        path_of(s.create(no_callback).await.unwrap_err()),
        "callbacks"
    );
    assert!(
        s.fetch("wf-bad", Duration::from_millis(500))
            .await
            .is_empty(),
        "nothing of a refused workflow was published"
    );
    let grant = s.api.tokens().identify(None).unwrap();
    let listed = s.api.workflows(&grant, None, 1, 10).await.unwrap();
    assert!(listed.items.is_empty(), "nor stored");
    s.stop().await;
}

/// Two replicas on PostgreSQL (one broker): the ACKs of a batch's two
/// members race through different replicas, and its callback fires once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_acks_of_a_batch_through_two_replicas_fire_its_callback_once() {
    let Some(url) = ojs_bridge_tests::postgres::find() else {
        return;
    };
    let schema = ojs_bridge_tests::postgres::TestSchema::new(&url);
    let dir = ojs_bridge_tests::tempdir::TempDir::new("wf-replicas");
    let replica_settings = |n: usize| ApiSettings {
        state_dir: dir.path().join(format!("r{n}")),
        postgres: Some(ojs_api::store::PostgresSettings {
            url: ojs_core::redact::Secret::new(url.clone()),
            password: None,
            schema: schema.name.clone(),
            connections: 4,
        }),
        ..ApiSettings::default()
    };
    let broker = memory();
    let a = Server::open(replica_settings(0), broker.clone(), true).await;
    let b = Server::open(replica_settings(1), broker.clone(), true).await;
    for round in 0..10 {
        let queue = format!("wf-race-{round}");
        let callbacks = format!("wf-race-cb-{round}");
        let wf = a
            .create(json!({"type": "batch", "jobs": [
                {"type": "m.a", "args": [], "options": {"queue": queue}},
                {"type": "m.b", "args": [], "options": {"queue": queue}},
            ], "callbacks": {"on_complete": {"type": "cb.done", "args": [], "options": {"queue": callbacks}}}}))
            .await
            .unwrap();
        let first = a.fetch(&queue, SOME_WAIT).await;
        let second = if first.len() == 2 {
            vec![]
        } else {
            b.fetch(&queue, SOME_WAIT).await
        };
        let (x, y) = match (first.as_slice(), second.as_slice()) {
            ([x, y], []) => (x.envelope.id.clone(), y.envelope.id.clone()),
            ([x], [y]) => (x.envelope.id.clone(), y.envelope.id.clone()),
            other => panic!("round {round}: {other:?}"),
        };
        tokio::join!(a.ack(&x, json!("x")), b.ack(&y, json!("y")));
        let fired = a.fetch(&callbacks, SOME_WAIT).await;
        assert_eq!(fired.len(), 1, "round {round}: the callback fired");
        assert_eq!(
            fired[0].extra["parent_results"].as_array().map(Vec::len),
            Some(2)
        );
        assert!(
            b.fetch(&callbacks, NONE_WAIT).await.is_empty(),
            "round {round}: and once"
        );
        a.ack(&fired[0].envelope.id, json!(null)).await;
        assert_eq!(
            b.get(&id_of(&wf)).await["state"],
            "completed",
            "round {round}"
        );
    }
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_s_unique_key_refuses_or_replaces_as_a_push_s_does() {
    let dir = ojs_bridge_tests::tempdir::TempDir::new("wf-unique");
    let s = Server::open(settings(dir.path()), embedded(dir.path()).await, true).await;
    let grant = s.api.tokens().identify(None).unwrap();
    let unique = |on_conflict: &str| {
        json!({"type": "report.build", "args": [7], "options": {"queue": "wf-unique",
               "unique": {"keys": ["type", "args"], "on_conflict": on_conflict}}})
    };
    let holder = ojs_api::job::from_json(unique("reject"), s.api.now()).unwrap();
    let holder = s.api.push(&grant, vec![holder]).await.unwrap().remove(0);
    let group = |step: Value| json!({"type": "group", "jobs": [{"type": "other.job", "args": [], "options": {"queue": "wf-unique"}}, step]});

    let refused = s.create(group(unique("reject"))).await.unwrap_err();
    assert_eq!(refused.code(), ErrorCode::Duplicate, "{refused:?}");
    let listed = s.api.workflows(&grant, None, 1, 10).await.unwrap();
    assert!(
        listed.items.is_empty(),
        "nothing of the workflow was stored"
    );

    let ignored = s.create(group(unique("ignore"))).await.unwrap_err();
    match ignored {
        ApiError::InvalidWorkflow { path, .. } => {
            assert_eq!(path, "jobs[1].options.unique.on_conflict")
        }
        other => panic!("{other:?}"),
    }

    let wf = s.create(group(unique("replace"))).await.unwrap();
    assert_eq!(wf["state"], "running");
    let holder_now = s.api.info(&grant, &holder.envelope.id).await.unwrap();
    assert_eq!(
        holder_now.state(),
        ojs_core::JobState::Cancelled,
        "the holder was replaced"
    );
    let jobs = s.fetch("wf-unique", SOME_WAIT).await;
    assert_eq!(jobs.len(), 2, "both steps are out, the holder is not");
    s.stop().await;
}
