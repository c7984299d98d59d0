//! Commits through SQLite's own unix VFS beside the same commits through
//! [`ojs_sqlite::open`]'s, which writes a commit's log frames in one call:
//! CPU time per commit (the thread's, user and system, from
//! `/proc/thread-self/schedstat`) and write calls per commit (the
//! process's, from `/proc/self/io`), in alternating rounds, medians printed.
//!
//! `cargo bench -p ojs-sqlite --bench log_writes [-- COMMITS [ROUNDS]]`
//! (default 4000 commits a case, 5 rounds). Each case is a table of rows
//! of 200 bytes with an index on a text column, in WAL mode with
//! `synchronous = NORMAL` and SQLite's automatic checkpoint (the job
//! store's and the embedded broker's settings, but for their checkpoint
//! thread); a commit inserts ROWS rows and updates as many older ones.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::time::Instant;

use rusqlite::{params, Connection, OpenFlags};

/// (case, rows inserted and updated by one commit)
const CASES: [(&str, usize); 3] = [("1 row", 1), ("10 rows", 10), ("100 rows", 100)];

fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn write_calls() -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("syscw:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}

struct Measured {
    cpu_us: f64,
    writes: f64,
    commits_per_s: f64,
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "ojs-log-writes-bench-{name}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run(ours: bool, rows: usize, commits: usize) -> Measured {
    let dir = scratch(if ours { "ours" } else { "unix" });
    let path = dir.join("t.sqlite");
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE;
    let mut conn = if ours {
        ojs_sqlite::open(&path, flags).unwrap()
    } else {
        Connection::open_with_flags(&path, flags).unwrap()
    };
    setup(&conn);
    // Warm: the file and its cache past their first pages.
    commit_rounds(&mut conn, rows, commits / 10, 0);
    let (cpu, writes, began) = (thread_cpu_ns(), write_calls(), Instant::now());
    commit_rounds(&mut conn, rows, commits, commits / 10);
    let elapsed = began.elapsed().as_secs_f64();
    let measured = Measured {
        cpu_us: (thread_cpu_ns() - cpu) as f64 / 1000.0 / commits as f64,
        writes: (write_calls() - writes) as f64 / commits as f64,
        commits_per_s: commits as f64 / elapsed,
    };
    drop(conn);
    let _ = std::fs::remove_dir_all(&dir);
    measured
}

fn setup(conn: &Connection) {
    conn.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))
        .unwrap();
    conn.execute_batch(
        "PRAGMA synchronous = NORMAL;
         CREATE TABLE t (id INTEGER PRIMARY KEY, state TEXT NOT NULL, body BLOB NOT NULL);
         CREATE INDEX t_state ON t (state, id);",
    )
    .unwrap();
}

fn commit_rounds(conn: &mut Connection, rows: usize, commits: usize, from: usize) {
    for n in from..from + commits {
        let tx = conn.transaction().unwrap();
        for i in 0..rows {
            tx.execute(
                "INSERT INTO t (state, body) VALUES ('available', ?1)",
                params![vec![(n + i) as u8; 200]],
            )
            .unwrap();
        }
        // The older rows move on, as jobs do (their index entries too).
        tx.execute(
            "UPDATE t SET state = 'completed' WHERE id IN (SELECT id FROM t WHERE state = 'available' ORDER BY id LIMIT ?1)",
            [rows as i64],
        )
        .unwrap();
        tx.commit().unwrap();
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let commits = args.first().copied().unwrap_or(4000);
    let rounds = args.get(1).copied().unwrap_or(5).max(1);
    println!(
        "SQLite commits, {commits} a case, median of {rounds} alternating rounds (one thread; CPU is its user + system time)"
    );
    for (case, rows) in CASES {
        let (mut unix, mut ours) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            // Alternating which goes first.
            for first_ours in [round % 2 == 1, round % 2 == 0] {
                let m = run(first_ours, rows, commits);
                if first_ours {
                    ours.push(m)
                } else {
                    unix.push(m)
                }
            }
        }
        let cpu = |v: &[Measured]| median(v.iter().map(|m| m.cpu_us).collect());
        let writes = |v: &[Measured]| median(v.iter().map(|m| m.writes).collect());
        let rate = |v: &[Measured]| median(v.iter().map(|m| m.commits_per_s).collect());
        for (side, v) in [("SQLite's unix VFS", &unix), ("one write a commit", &ours)] {
            println!(
                "  {case:>8}, {side:<20} {:>8.0} commits/s  {:>7.1} µs CPU a commit  {:>6.1} write calls a commit",
                rate(v),
                cpu(v),
                writes(v)
            );
        }
        println!(
            "{{\"bench\":\"log_writes\",\"case\":\"{case}\",\"unix_cpu_us_per_commit\":{:.2},\"cpu_us_per_commit\":{:.2},\"unix_writes_per_commit\":{:.2},\"writes_per_commit\":{:.2}}}",
            cpu(&unix),
            cpu(&ours),
            writes(&unix),
            writes(&ours)
        );
    }
}
