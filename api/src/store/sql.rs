//! Statements the two stores share: where SQLite and PostgreSQL agree on
//! a statement it is written once, here, with PostgreSQL's `$n`
//! parameters; SQLite's spelling (`?n`, the same parameters by number) is
//! made from it when the crate is compiled. What only one dialect has
//! (arrays, `FOR UPDATE`, leases, SQLite's row ids) stays in its store.

/// One statement in both dialects.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sql {
    /// With `$n` parameters.
    pub(crate) postgres: &'static str,
    /// With `?n` parameters.
    pub(crate) sqlite: &'static str,
}

/// `text` with each `$` made a `?`: the same length, so it can be built
/// into an array of a size known when compiling.
const fn numbered<const N: usize>(text: &str) -> [u8; N] {
    let bytes = text.as_bytes();
    let mut out = [0u8; N];
    let mut i = 0;
    while i < N {
        out[i] = if bytes[i] == b'$' { b'?' } else { bytes[i] };
        i += 1;
    }
    out
}

macro_rules! shared {
    ($(#[$doc:meta])* $name:ident = $text:literal) => {
        $(#[$doc])*
        pub(crate) const $name: Sql = Sql {
            postgres: $text,
            sqlite: {
                const BYTES: [u8; $text.len()] = numbered($text);
                match core::str::from_utf8(&BYTES) {
                    Ok(text) => text,
                    Err(_) => panic!("a shared statement is ASCII"),
                }
            },
        };
    };
}

shared!(
    /// A job's envelope and extra fields, by id.
    JOB = "SELECT envelope, extra FROM jobs WHERE id = $1"
);
shared!(
    /// Removes a job.
    DELETE_JOB = "DELETE FROM jobs WHERE id = $1"
);
shared!(
    /// Removes a job's events.
    DELETE_JOB_EVENTS = "DELETE FROM events WHERE job_id = $1"
);
shared!(
    /// Every queue with the time its first job arrived.
    QUEUES = "SELECT name, created_ms FROM queues ORDER BY name"
);
shared!(
    /// Finished jobs past retention.
    PRUNE_JOBS = "DELETE FROM jobs WHERE finished_ms IS NOT NULL AND finished_ms < $1"
);
shared!(
    /// Workers silent past retention.
    PRUNE_WORKERS = "DELETE FROM workers WHERE seen_ms < $1"
);
shared!(
    /// A worker's record.
    WORKER = "SELECT record FROM workers WHERE id = $1"
);
shared!(
    /// Writes a worker's record.
    SAVE_WORKER = "INSERT INTO workers (id, seen_ms, record) VALUES ($1, $2, $3)
     ON CONFLICT (id) DO UPDATE SET seen_ms = excluded.seen_ms, record = excluded.record"
);
shared!(
    /// Removes a worker's record.
    DELETE_WORKER = "DELETE FROM workers WHERE id = $1"
);
shared!(
    /// Every worker's record, by id.
    WORKERS = "SELECT id, record FROM workers ORDER BY id"
);

/// The tables a reset empties, in an order foreign keys would allow.
pub(crate) const RESET_TABLES: [&str; 15] = [
    "events",
    "unique_keys",
    "jobs",
    "job_counts",
    "queues",
    "workers",
    "crons",
    "paused_queues",
    "rate_keys",
    "rate_jobs",
    "queue_configs",
    "leaders",
    "workflows",
    "system",
    "settles",
];

shared!(
    /// A setting of the server kept in the store (maintenance).
    SYSTEM = "SELECT value FROM system WHERE key = $1"
);
shared!(
    /// Writes a setting of the server.
    SET_SYSTEM = "INSERT INTO system (key, value) VALUES ($1, $2)
     ON CONFLICT (key) DO UPDATE SET value = excluded.value"
);
shared!(
    /// Removes a setting of the server.
    DELETE_SYSTEM = "DELETE FROM system WHERE key = $1"
);
shared!(
    /// Stored jobs by queue and state, as the store keeps them in
    /// `job_counts` (the embedded store's writer at each commit;
    /// PostgreSQL's triggers in one row per connection that wrote: no two
    /// transactions wait on one counter).
    COUNTS_BY_QUEUE = "SELECT queue, state, CAST(sum(n) AS bigint) FROM job_counts
     GROUP BY queue, state HAVING sum(n) <> 0"
);
shared!(
    /// Jobs finished since a time, by queue and state.
    FINISHED_BY_QUEUE = "SELECT queue, state, count(*) FROM jobs
     WHERE finished_ms IS NOT NULL AND finished_ms >= $1 GROUP BY queue, state"
);
shared!(
    /// Jobs created, completed and discarded per bucket ($3 ms) from $1
    /// to $2, of queue $4 (or all when it is empty).
    HISTORY = "SELECT (created_ms / $3) * $3 AS at, 'created', count(*) FROM jobs
       WHERE created_ms >= $1 AND created_ms < $2 AND ($4 = '' OR queue = $4) GROUP BY at
     UNION ALL
     SELECT (finished_ms / $3) * $3 AS at, state, count(*) FROM jobs
       WHERE finished_ms IS NOT NULL AND finished_ms >= $1 AND finished_ms < $2
         AND state IN ('completed', 'discarded') AND ($4 = '' OR queue = $4)
       GROUP BY at, state"
);
shared!(
    /// Writes a workflow's record.
    SAVE_WORKFLOW = "INSERT INTO workflows (id, state, created_ms, finished_ms, record)
     VALUES ($1, $2, $3, $4, $5)
     ON CONFLICT (id) DO UPDATE SET state = excluded.state,
         finished_ms = excluded.finished_ms, record = excluded.record"
);
shared!(
    /// Workflows, newest first, from an offset (every state).
    WORKFLOWS = "SELECT id, record FROM workflows ORDER BY created_ms DESC, id DESC LIMIT $1 OFFSET $2"
);
shared!(
    /// Workflows in one state, newest first, from an offset.
    WORKFLOWS_IN = "SELECT id, record FROM workflows WHERE state = $3
     ORDER BY created_ms DESC, id DESC LIMIT $1 OFFSET $2"
);
shared!(
    /// Removes a workflow's record.
    DELETE_WORKFLOW = "DELETE FROM workflows WHERE id = $1"
);
shared!(
    /// Removes finished workflows past retention.
    PRUNE_WORKFLOWS = "DELETE FROM workflows WHERE finished_ms < $1"
);
shared!(
    /// A cron job's record.
    CRON = "SELECT record FROM crons WHERE name = $1"
);
shared!(
    /// Writes a cron job's record.
    SAVE_CRON = "INSERT INTO crons (name, record) VALUES ($1, $2)
     ON CONFLICT (name) DO UPDATE SET record = excluded.record"
);
shared!(
    /// Removes a cron job.
    DELETE_CRON = "DELETE FROM crons WHERE name = $1"
);
shared!(
    /// Every cron job's record, by name.
    CRONS = "SELECT name, record FROM crons ORDER BY name"
);
shared!(
    /// Takes or renews a role for a holder: it changes a row only where
    /// the role is free, lapsed, or the holder's already.
    HOLD_ROLE = "INSERT INTO leaders (role, holder, until_ms) VALUES ($1, $2, $3)
     ON CONFLICT (role) DO UPDATE SET holder = excluded.holder, until_ms = excluded.until_ms
     WHERE leaders.holder = excluded.holder OR leaders.until_ms < $4"
);

shared!(
    /// Paused queues, with when each was paused.
    PAUSED_QUEUES = "SELECT name, paused_ms FROM paused_queues ORDER BY name"
);
shared!(
    /// Pauses a queue (paused already: unchanged).
    PAUSE_QUEUE = "INSERT INTO paused_queues (name, paused_ms) VALUES ($1, $2)
     ON CONFLICT (name) DO NOTHING"
);
shared!(
    /// Resumes a queue.
    RESUME_QUEUE = "DELETE FROM paused_queues WHERE name = $1"
);
shared!(
    /// A queue made known (pausing one creates it).
    ADD_QUEUE = "INSERT INTO queues (name, created_ms) VALUES ($1, $2)
     ON CONFLICT (name) DO NOTHING"
);
shared!(
    /// A queue's stored jobs by state, and how many of each are dead
    /// letters.
    QUEUE_STATES = "SELECT state, count(*), sum(CASE WHEN dead = 1 THEN 1 ELSE 0 END)
     FROM jobs WHERE queue = $1 GROUP BY state"
);
shared!(
    /// A queue's jobs finished since a time, by state.
    QUEUE_FINISHED = "SELECT state, count(*) FROM jobs
     WHERE queue = $1 AND finished_ms >= $2 GROUP BY state"
);
shared!(
    /// A queue's jobs completed since a time, newest first (their run
    /// and wait times).
    QUEUE_COMPLETED = "SELECT id, envelope, extra FROM jobs
     WHERE queue = $1 AND state = 'completed' AND finished_ms >= $2
     ORDER BY finished_ms DESC LIMIT $3"
);

shared!(
    /// A rate-limit key's state.
    RATE_KEY = "SELECT record FROM rate_keys WHERE key = $1"
);
shared!(
    /// Writes a rate-limit key's state; `seen_ms` is when it may be
    /// pruned from (its last use, or its override's end).
    SAVE_RATE_KEY = "INSERT INTO rate_keys (key, seen_ms, record) VALUES ($1, $2, $3)
     ON CONFLICT (key) DO UPDATE SET seen_ms = excluded.seen_ms, record = excluded.record"
);
shared!(
    /// A page of rate-limit keys, by key.
    RATE_KEYS = "SELECT key, record FROM rate_keys ORDER BY key LIMIT $1 OFFSET $2"
);
shared!(
    /// How many rate-limit keys there are.
    COUNT_RATE_KEYS = "SELECT count(*) FROM rate_keys"
);
shared!(
    /// A key's jobs by state (`active`, `waiting`).
    RATE_JOB_COUNTS = "SELECT state, count(*) FROM rate_jobs WHERE key = $1 GROUP BY state"
);
shared!(
    /// Files a job under a key in a state.
    FILE_RATE_JOB = "INSERT INTO rate_jobs (job_id, key, state) VALUES ($1, $2, $3)
     ON CONFLICT (job_id, key) DO UPDATE SET state = excluded.state"
);
shared!(
    /// Unfiles a job from every key.
    UNFILE_RATE_JOB = "DELETE FROM rate_jobs WHERE job_id = $1"
);
shared!(
    /// Rate-limit keys unused since a time (`$1`, a day before the
    /// retention cut: no window is longer) and filed under by no job.
    PRUNE_RATE_KEYS = "DELETE FROM rate_keys WHERE seen_ms < $1
     AND NOT EXISTS (SELECT 1 FROM rate_jobs r WHERE r.key = rate_keys.key)"
);
shared!(
    /// Every queue's configuration.
    QUEUE_CONFIGS = "SELECT name, record FROM queue_configs ORDER BY name"
);
shared!(
    /// Writes a queue's configuration.
    SAVE_QUEUE_CONFIG = "INSERT INTO queue_configs (name, record) VALUES ($1, $2)
     ON CONFLICT (name) DO UPDATE SET record = excluded.record"
);

shared!(
    /// Jobs filed under unique keys, by key (a page of them).
    UNIQUE_HOLDERS = "SELECT u.key, j.id, j.envelope, j.extra FROM unique_keys u
     JOIN jobs j ON j.id = u.job_id ORDER BY u.key, j.id LIMIT $1"
);
shared!(
    /// A queue's jobs that wait to run, by priority.
    PRIORITY_COUNTS = "SELECT envelope FROM jobs
     WHERE queue = $1 AND state IN ('available', 'scheduled', 'retryable', 'pending') LIMIT $2"
);

shared!(
    /// The jobs filed under a unique key.
    JOBS_WITH_UNIQUE_KEY = "SELECT j.id, j.envelope, j.extra FROM unique_keys u
     JOIN jobs j ON j.id = u.job_id WHERE u.key = $1"
);
shared!(
    /// Files a job under its unique key.
    KEEP_UNIQUE_KEY = "INSERT INTO unique_keys (job_id, key) VALUES ($1, $2)
     ON CONFLICT (job_id) DO UPDATE SET key = excluded.key"
);
shared!(
    /// Unique keys of jobs no longer stored.
    PRUNE_UNIQUE_KEYS = "DELETE FROM unique_keys WHERE job_id NOT IN (SELECT id FROM jobs)"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_gets_the_same_statement_with_numbered_question_marks() {
        assert_eq!(
            JOB.postgres,
            "SELECT envelope, extra FROM jobs WHERE id = $1"
        );
        assert_eq!(JOB.sqlite, "SELECT envelope, extra FROM jobs WHERE id = ?1");
        assert!(SAVE_WORKER.sqlite.contains("VALUES (?1, ?2, ?3)"));
        for sql in [JOB, DELETE_JOB, DELETE_JOB_EVENTS, SAVE_WORKER, WORKERS] {
            assert!(!sql.sqlite.contains('$'), "{}", sql.sqlite);
            assert_eq!(sql.sqlite.len(), sql.postgres.len());
        }
    }
}
