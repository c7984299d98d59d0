#![allow(clippy::unwrap_used)]

use super::*;
use ojs_core::envelope::RetryPolicy;
use ojs_core::JobEnvelope;
use serde_json::Map;

const STATES: [JobState; 9] = [
    JobState::Scheduled,
    JobState::Available,
    JobState::Pending,
    JobState::Active,
    JobState::Completed,
    JobState::Retryable,
    JobState::Cancelled,
    JobState::Discarded,
    JobState::Other(42),
];

fn at(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).unwrap().to_utc()
}

fn now() -> DateTime<Utc> {
    at("2026-01-02T03:04:05.678Z")
}

fn job(state: JobState) -> Job {
    let mut envelope = JobEnvelope::with_id("019400000000-job".into(), "email.send", Vec::new());
    envelope.queue = "mail".into();
    envelope.state = Some(state);
    envelope.attempt = 1;
    envelope.started_at = Some(at("2026-01-02T03:04:05.000Z"));
    envelope.retry = Some(RetryPolicy {
        max_attempts: Some(2),
        initial_interval: "PT10S".into(),
        jitter: false,
        ..RetryPolicy::default()
    });
    Job {
        envelope,
        extra: Map::new(),
    }
}

fn dead_letter() -> Job {
    let mut j = job(JobState::Discarded);
    j.extra.insert("dead_letter".into(), json!(true));
    j.extra
        .insert("discarded_at".into(), json!("2026-01-01T00:00:00.000Z"));
    j
}

fn failed(retryable: bool) -> Failed {
    Failed::read(
        json!({"code": "smtp", "message": "refused", "retryable": retryable})
            .as_object()
            .unwrap(),
    )
}

/// Every command once, with the arguments the tests below vary.
fn commands(f: &Failed) -> Vec<Command<'_>> {
    vec![
        Command::Start { worker: Some("w1") },
        Command::Complete { result: None },
        Command::Fail {
            failed: f,
            requeue: false,
            exhausted: Exhaustion::Discard,
            jitter: 0.0,
        },
        Command::TimeOut,
        Command::Cancel,
        Command::Activate,
        Command::Deactivate,
        Command::Promote,
        Command::Revive,
        Command::Expire,
        Command::Limit {
            key: "queue:q",
            until: None,
        },
    ]
}

#[test]
fn the_transition_table() {
    // Rows: the states in STATES' order; a letter per command in
    // `commands`' order: y allowed, . refused.
    let table = [
        ("scheduled", "y...y..y.yy"),
        ("available", "y...y.y..yy"),
        ("pending", "....yy....."),
        ("active", "yyyyy....yy"),
        ("completed", "..........."),
        ("retryable", "y...y....yy"),
        ("cancelled", "..........."),
        ("discarded", "........y.."),
        ("other", "..........."),
    ];
    let f = failed(true);
    for (state, (name, row)) in STATES.into_iter().zip(table) {
        for (command, cell) in commands(&f).iter().zip(row.chars()) {
            assert_eq!(
                allows(state, command),
                cell == 'y',
                "{name} × {}",
                command.name()
            );
        }
    }
}

#[test]
fn a_refused_command_names_the_state_that_refused_it() {
    let f = failed(true);
    for state in STATES {
        for command in commands(&f) {
            let name = command.name();
            let allowed = allows(state, &command);
            match apply(job(state), command, now()) {
                Ok(t) => {
                    assert!(allowed, "{state:?} × {name} applied");
                    assert_eq!(t.previous, state);
                }
                // Two commands also look past the state: a deactivation of
                // a job not activated, a revival of a job not dead-lettered.
                Err(Refused(s)) => {
                    assert_eq!(s, state);
                    assert!(
                        !allowed || matches!(name, "deactivate" | "revive"),
                        "{state:?} × {name} refused"
                    );
                }
            }
        }
    }
}

#[test]
fn start_counts_an_attempt_and_names_its_worker() {
    let mut j = job(JobState::Retryable);
    j.extra.insert("next_attempt_at".into(), json!("x"));
    j.envelope.completed_at = Some(now());
    let t = apply(j, Command::Start { worker: Some("w1") }, now()).unwrap();
    assert_eq!(t.job.state(), JobState::Active);
    assert_eq!(t.job.envelope.attempt, 2);
    assert_eq!(t.job.envelope.started_at, Some(now()));
    assert_eq!(t.job.envelope.completed_at, None);
    assert_eq!(t.job.extra.get("worker_id"), Some(&json!("w1")));
    assert!(!t.job.extra.contains_key("next_attempt_at"));
    assert_eq!(t.finished, None);
    assert_eq!(t.events.len(), 1);
    assert_eq!(t.events[0].kind, "job.started");
    assert_eq!(t.events[0].data.value()["attempt"], 2);
    // A start without a worker id forgets the previous worker's.
    let t = apply(t.job, Command::Start { worker: None }, now()).unwrap();
    assert!(!t.job.extra.contains_key("worker_id"));
}

#[test]
fn complete_keeps_the_result_and_the_duration() {
    let t = apply(
        job(JobState::Active),
        Command::Complete {
            result: Some(json!({"sent": 1})),
        },
        now(),
    )
    .unwrap();
    assert_eq!(t.job.state(), JobState::Completed);
    assert_eq!(t.job.envelope.result, Some(json!({"sent": 1})));
    assert_eq!(t.finished, Some(now()));
    assert_eq!(t.events[0].kind, "job.completed");
    assert_eq!(t.events[0].data.value()["duration_ms"], 678);
    assert_eq!(t.settle, None);
}

#[test]
fn a_failure_with_attempts_left_is_retried_after_its_backoff() {
    let f = failed(true);
    let fail = Command::Fail {
        failed: &f,
        requeue: false,
        exhausted: Exhaustion::DeadLetter,
        jitter: 0.0,
    };
    let t = apply(job(JobState::Active), fail, now()).unwrap();
    assert_eq!(t.job.state(), JobState::Retryable);
    assert_eq!(t.settle, Some(Settle::Retry { delay_ms: 10_000 }));
    assert_eq!(
        t.job.extra.get("next_attempt_at"),
        Some(&json!("2026-01-02T03:04:15.678Z"))
    );
    assert_eq!(t.job.envelope.errors.len(), 1);
    assert_eq!(t.job.envelope.errors[0]["attempt"], 1);
    assert_eq!(t.job.envelope.error.as_ref().unwrap().error_type, "smtp");
    let kinds: Vec<_> = t.events.iter().map(|e| e.kind).collect();
    assert_eq!(kinds, ["job.failed", "job.retrying"]);
    assert_eq!(t.finished, None);
}

#[test]
fn an_exhausted_job_is_discarded_or_dead_lettered() {
    let f = failed(true);
    let mut last = job(JobState::Active);
    last.envelope.attempt = 2;
    for (exhausted, settle, dead) in [
        (Exhaustion::Discard, Settle::Drop, false),
        (
            Exhaustion::DeadLetter,
            Settle::DeadLetter {
                error_type: "smtp".into(),
                message: "refused".into(),
            },
            true,
        ),
    ] {
        let fail = Command::Fail {
            failed: &f,
            requeue: false,
            exhausted,
            jitter: 0.0,
        };
        let t = apply(last.clone(), fail, now()).unwrap();
        assert_eq!(t.job.state(), JobState::Discarded);
        assert_eq!(t.job.is_dead_letter(), dead);
        assert_eq!(t.settle, Some(settle));
        assert_eq!(t.finished, Some(now()));
        assert_eq!(t.events[1].kind, "job.discarded");
        assert_eq!(t.events[1].data.value()["total_attempts"], 2);
        // A dead letter goes back from attempt 0; a job merely discarded
        // cannot.
        let revived = apply(t.job, Command::Revive, now());
        if dead {
            let r = revived.unwrap();
            assert_eq!(r.job.state(), JobState::Available);
            assert_eq!(r.job.envelope.attempt, 0);
            assert!(!r.job.extra.contains_key("dead_letter"));
            assert!(r.job.extra.contains_key("re_enqueued_at"));
        } else {
            assert_eq!(revived.unwrap_err(), Refused(JobState::Discarded));
        }
    }
}

#[test]
fn a_requeue_puts_the_job_back_without_a_backoff() {
    let f = failed(false);
    let fail = Command::Fail {
        failed: &f,
        requeue: true,
        exhausted: Exhaustion::Discard,
        jitter: 0.0,
    };
    let t = apply(job(JobState::Active), fail, now()).unwrap();
    assert_eq!(t.job.state(), JobState::Available);
    assert_eq!(t.settle, Some(Settle::Requeue));
    assert_eq!(t.events.len(), 1);
    assert_eq!(t.events[0].data.value()["error"]["retryable"], false);
}

#[test]
fn the_error_history_keeps_the_latest_fifty() {
    let f = failed(true);
    let mut j = job(JobState::Active);
    j.envelope.retry = None;
    j.envelope.errors = (0..ERROR_HISTORY).map(|n| json!({"n": n})).collect();
    let fail = Command::Fail {
        failed: &f,
        requeue: true,
        exhausted: Exhaustion::Discard,
        jitter: 0.0,
    };
    let t = apply(j, fail, now()).unwrap();
    assert_eq!(t.job.envelope.errors.len(), ERROR_HISTORY);
    assert_eq!(t.job.envelope.errors[0], json!({"n": 1}));
    assert_eq!(t.job.envelope.errors[ERROR_HISTORY - 1]["code"], "smtp");
}

#[test]
fn cancel_time_out_and_expire_record_why() {
    let t = apply(job(JobState::Scheduled), Command::Cancel, now()).unwrap();
    assert_eq!(t.job.state(), JobState::Cancelled);
    assert_eq!(t.job.extra.get("previous_state"), Some(&json!("scheduled")));
    assert_eq!(t.events[0].data.value()["previous_state"], "scheduled");
    assert_eq!(t.finished, Some(now()));

    let mut active = job(JobState::Active);
    active.extra.insert("worker_id".into(), json!("w1"));
    let t = apply(active, Command::TimeOut, now()).unwrap();
    assert_eq!(t.job.state(), JobState::Available);
    assert_eq!(
        t.job.envelope.error.as_ref().unwrap().error_type,
        "visibility_timeout"
    );
    assert!(!t.job.extra.contains_key("worker_id"));

    let mut old = job(JobState::Available);
    old.envelope.expires_at = Some(at("2026-01-02T03:04:05.000Z"));
    assert!(is_expired(&old, now()));
    assert!(!is_expired(&job(JobState::Available), now()));
    let t = apply(old, Command::Expire, now()).unwrap();
    assert_eq!(t.job.state(), JobState::Discarded);
    assert!(!t.job.is_dead_letter());
    assert_eq!(t.events[0].data.value()["reason"], "expired");
}

#[test]
fn over_its_rate_limit_a_job_is_rescheduled_or_dropped() {
    let until = at("2026-01-02T03:04:06.000Z");
    let t = apply(
        job(JobState::Available),
        Command::Limit {
            key: "tenant:1",
            until: Some(until),
        },
        now(),
    )
    .unwrap();
    assert_eq!(t.job.state(), JobState::Scheduled);
    assert_eq!(t.job.envelope.scheduled_at, Some(until));
    assert_eq!(t.finished, None);
    assert_eq!(t.events[0].kind, "job.scheduled");
    assert_eq!(t.events[0].data.value()["key"], "tenant:1");
    let t = apply(
        job(JobState::Available),
        Command::Limit {
            key: "tenant:1",
            until: None,
        },
        now(),
    )
    .unwrap();
    assert_eq!(t.job.state(), JobState::Discarded);
    assert!(!t.job.is_dead_letter());
    assert_eq!(t.finished, Some(now()));
    let kinds: Vec<_> = t.events.iter().map(|e| e.kind).collect();
    assert_eq!(kinds, ["job.discarded", "rate_limit.dropped"]);
    assert_eq!(t.events[0].data.value()["reason"], "rate_limited");
}

#[test]
fn activation_and_its_undo() {
    let t = apply(job(JobState::Pending), Command::Activate, now()).unwrap();
    assert_eq!(t.job.state(), JobState::Available);
    assert_eq!(t.job.envelope.enqueued_at, Some(now()));
    let undone = apply(t.job, Command::Deactivate, now()).unwrap();
    assert_eq!(undone.job.state(), JobState::Pending);
    assert_eq!(undone.job.envelope.enqueued_at, None);
    assert!(undone.job.extra.is_empty());
    assert!(undone.events.is_empty());
    // An available job that was never staged is not sent back.
    assert_eq!(
        apply(job(JobState::Available), Command::Deactivate, now()).unwrap_err(),
        Refused(JobState::Available)
    );
}

#[test]
fn later_saturates_at_the_end_of_the_calendar() {
    assert_eq!(
        later(now(), std::time::Duration::from_secs(1)),
        at("2026-01-02T03:04:06.678Z")
    );
    assert_eq!(
        later(now(), std::time::Duration::MAX),
        DateTime::<Utc>::MAX_UTC
    );
}

#[test]
fn a_dead_letter_goes_back_from_attempt_zero() {
    let t = apply(dead_letter(), Command::Revive, now()).unwrap();
    assert_eq!(t.job.state(), JobState::Available);
    assert_eq!(t.job.envelope.enqueued_at, Some(now()));
    assert_eq!(t.job.envelope.started_at, None);
    assert!(!t.job.is_dead_letter());
    assert!(!t.job.extra.contains_key("discarded_at"));
    assert_eq!(t.events[0].data.value()["from"], "dead_letter");
    let started = apply(t.job, Command::Start { worker: None }, now()).unwrap();
    assert_eq!(started.job.envelope.attempt, 1);
}
