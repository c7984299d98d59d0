//! The active jobs the SQLite store's writer committed last, kept decoded.
//!
//! A worker's next step on a job it fetched (its ACK, NACK or heartbeat)
//! loads the job the FETCH saved a moment before: reading that row and
//! decoding its JSON was about a seventh of a FETCH + ACK's work. The writer
//! is the only connection that writes the store, so it can keep what it
//! wrote, if it learns of every change it did not make through this cache:
//! - SQLite's update hook names each row of `jobs` a statement on the
//!   writer's connection updates or deletes (inserts make rows no entry
//!   can name: the writer numbers rows upwards, never twice); an entry
//!   whose row is named is dropped (the writer's own saves included: the
//!   saved job is staged again after its statement);
//! - `PRAGMA data_version` changes when another connection (another
//!   process) committed: everything is dropped;
//! - a reset's `DELETE FROM jobs`, which SQLite runs without the hook,
//!   drops everything ([`Recent::clear`]).
//!
//! A job enters only with the commit that wrote it: staged by its request,
//! kept when the request's savepoint is released, moved in when the group
//! commits, forgotten when either is rolled back.
//!
//! What it keeps is bounded three ways ([`Limits`]): jobs, their stored
//! bytes together, and the bytes of one job; the oldest entered go first.

use std::collections::VecDeque;

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use std::sync::{Arc, Mutex};

use crate::job::Job;

/// The most jobs kept: a worker's next step comes within its visibility
/// timeout, and more jobs than this active at once read their rows as
/// before.
pub(super) const RECENT_JOBS: usize = 4096;

/// The most stored bytes (a job's JSON, envelope and the store's own
/// fields) kept in all: without it, 4,096 jobs of the largest body a PUSH
/// may send (4 MiB) would hold 16 GiB. Jobs kept decoded take a few times
/// their JSON.
pub(super) const RECENT_BYTES: usize = 32 << 20;

/// A job larger than this is never kept: reading its row back is small
/// beside what a job that large costs anyway, and it would push out
/// hundreds of small ones.
pub(super) const RECENT_JOB_BYTES: usize = 256 << 10;

/// How much [`Recent`] keeps.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    /// Jobs.
    pub(super) jobs: usize,
    /// Stored bytes, all jobs together.
    pub(super) bytes: usize,
    /// Stored bytes of one job.
    pub(super) job_bytes: usize,
}

impl Limits {
    /// The writer's.
    pub(super) const WRITER: Limits = Limits {
        jobs: RECENT_JOBS,
        bytes: RECENT_BYTES,
        job_bytes: RECENT_JOB_BYTES,
    };

    /// Nothing kept (the update hook could not be installed).
    pub(super) const NONE: Limits = Limits {
        jobs: 0,
        bytes: 0,
        job_bytes: 0,
    };
}

/// Rows of `jobs` that statements changed, as the update hook reports
/// them; drained by the writer.
pub(super) type Changed = Arc<Mutex<Vec<i64>>>;

/// See the module.
#[derive(Debug)]
pub(super) struct Recent {
    /// By job id: its row id, when it entered, the job as committed, its
    /// stored bytes.
    jobs: HashMap<String, (i64, u64, Job, usize)>,
    /// The stored bytes of the jobs in `jobs`.
    bytes: usize,
    /// Row id → job id, for the hook's row ids.
    ids: HashMap<i64, String>,
    /// (entered, row id), oldest first; an entry that entered again later
    /// or was dropped is skipped when its turn comes.
    order: VecDeque<(u64, i64)>,
    entered: u64,
    /// Staged by the request running now: row, job, stored bytes.
    request: Vec<(i64, Job, usize)>,
    /// Staged by the requests of this group whose savepoints were released.
    group: Vec<(i64, Job, usize)>,
    /// The rows of `request` and `group` (and of jobs staged and dropped
    /// since the group began): a change is looked up here, not in every
    /// staged job, which a group of a few thousand made quadratic.
    staged_rows: HashSet<i64>,
    changed: Changed,
    data_version: Option<i64>,
    limits: Limits,
}

impl Recent {
    pub(super) fn new(changed: Changed, limits: Limits) -> Recent {
        Recent {
            jobs: HashMap::new(),
            bytes: 0,
            ids: HashMap::new(),
            order: VecDeque::new(),
            entered: 0,
            request: Vec::new(),
            group: Vec::new(),
            staged_rows: HashSet::new(),
            changed,
            data_version: None,
            limits,
        }
    }

    /// A group's transaction began (holding the write lock) and read
    /// `data_version`: another connection's commit since the last group
    /// drops everything, as does a version that could not be read.
    /// Anything staged by a group that never finished (it panicked) goes.
    pub(super) fn begin(&mut self, data_version: Option<i64>) {
        if data_version.is_none() || self.data_version != data_version {
            self.clear();
            self.data_version = data_version;
        }
        self.request.clear();
        self.group.clear();
        self.staged_rows.clear();
        self.drain();
    }

    /// The job `id` as committed, with its row id, unless a statement
    /// changed its row since: taken out, not copied. The request that
    /// loads a job saves it (staged again, entering when its group
    /// commits) or leaves it as its row reads; a second load in the same
    /// transaction reads the row, which is current there. Copying it out
    /// was half a per cent of a FETCH + ACK.
    pub(super) fn take(&mut self, id: &str) -> Option<(i64, Job)> {
        self.drain();
        let (row, _, job, bytes) = self.jobs.remove(id)?;
        self.bytes -= bytes;
        self.ids.remove(&row);
        Some((row, job))
    }

    /// What [`Recent::take`] would give, left kept.
    #[cfg(test)]
    pub(super) fn get(&mut self, id: &str) -> Option<(i64, Job)> {
        self.drain();
        self.jobs
            .get(id)
            .map(|(row, _, job, _)| (*row, job.clone()))
    }

    /// The running request wrote `job` to row `row` (its statement has
    /// run), `bytes` of it: kept if the request and its group commit, and
    /// it is no larger than one job may be.
    pub(super) fn stage(&mut self, row: i64, job: &Job, bytes: usize) {
        self.drain();
        if bytes > self.limits.job_bytes {
            return;
        }
        self.staged_rows.insert(row);
        self.request.push((row, job.clone(), bytes));
    }

    /// The request's savepoint was released.
    pub(super) fn released(&mut self) {
        self.drain();
        self.group.append(&mut self.request);
    }

    /// The request's savepoint was rolled back: its staged jobs go (the rows
    /// it changed are dropped as the hook named them).
    pub(super) fn rolled_back(&mut self) {
        self.request.clear();
    }

    /// The group committed: its staged jobs enter.
    pub(super) fn committed(&mut self) {
        self.drain();
        let staged = std::mem::take(&mut self.group);
        for (row, job, bytes) in staged {
            self.enter(row, job, bytes);
        }
        self.request.clear();
        self.staged_rows.clear();
    }

    /// The group failed: nothing it staged enters.
    pub(super) fn failed(&mut self) {
        self.request.clear();
        self.group.clear();
        self.staged_rows.clear();
        self.drain();
    }

    /// Everything goes.
    pub(super) fn clear(&mut self) {
        self.jobs.clear();
        self.bytes = 0;
        self.ids.clear();
        self.order.clear();
        self.request.clear();
        self.group.clear();
        self.staged_rows.clear();
        self.take_changed();
    }

    /// How many jobs are kept.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.jobs.len()
    }

    /// The stored bytes of the jobs kept.
    #[cfg(test)]
    pub(super) fn bytes(&self) -> usize {
        debug_assert_eq!(
            self.bytes,
            self.jobs.values().map(|(_, _, _, b)| b).sum::<usize>()
        );
        self.bytes
    }

    /// Drops the entry of job `id`, if any.
    fn forget(&mut self, id: &str) {
        if let Some((_, _, _, bytes)) = self.jobs.remove(id) {
            self.bytes -= bytes;
        }
    }

    fn take_changed(&self) -> Vec<i64> {
        std::mem::take(&mut *self.changed.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Drops every entry and staged job whose row a statement changed.
    fn drain(&mut self) {
        let changed = self.take_changed();
        if changed.is_empty() {
            return;
        }
        if self.jobs.is_empty() && self.request.is_empty() && self.group.is_empty() {
            return;
        }
        for row in &changed {
            if let Some(id) = self.ids.remove(row) {
                self.forget(&id);
            }
        }
        // Usually no staged job's row is among them: a save's own row is
        // named before its job is staged, so only a second save of a job
        // in the same group, or a statement deleting it, drops one.
        if !changed.iter().any(|row| self.staged_rows.contains(row)) {
            return;
        }
        // A set: a prune or a queue's purge names every row it deletes,
        // and a group stages up to its size.
        let changed: HashSet<i64> = changed.into_iter().collect();
        self.request.retain(|(row, _, _)| !changed.contains(row));
        self.group.retain(|(row, _, _)| !changed.contains(row));
    }

    fn enter(&mut self, row: i64, job: Job, bytes: usize) {
        self.entered += 1;
        let id = job.envelope.id.clone();
        let was = self
            .jobs
            .insert(id.clone(), (row, self.entered, job, bytes));
        if let Some((old_row, _, _, old_bytes)) = was {
            if old_row != row {
                self.ids.remove(&old_row);
            }
            self.bytes -= old_bytes;
        }
        self.ids.insert(row, id);
        self.bytes += bytes;
        self.order.push_back((self.entered, row));
        while self.jobs.len() > self.limits.jobs || self.bytes > self.limits.bytes {
            let Some((entered, row)) = self.order.pop_front() else {
                break;
            };
            let current = self
                .ids
                .get(&row)
                .and_then(|id| self.jobs.get(id))
                .is_some_and(|(_, e, _, _)| *e == entered);
            if current {
                if let Some(id) = self.ids.remove(&row) {
                    self.forget(&id);
                }
            }
        }
        // Entries that entered again leave their old places behind.
        if self.order.len() > 4 * self.limits.jobs.max(1) {
            let mut live: Vec<(u64, i64)> = self
                .jobs
                .values()
                .map(|(row, e, _, _)| (*e, *row))
                .collect();
            live.sort_unstable();
            self.order = live.into();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A job whose id is made of `name` (at most 6 bytes).
    fn job(name: &str) -> Job {
        let body = serde_json::json!({"type": "a.b", "args": [1], "id": id(name)});
        crate::job::from_json(body, chrono::Utc::now()).unwrap_or_else(|e| panic!("{e}"))
    }

    fn id(name: &str) -> String {
        let hex: String = name.bytes().map(|b| format!("{b:02x}")).collect();
        format!("019aaaaa-0000-7000-8000-{hex:0>12}")
    }

    fn recent(capacity: usize) -> (Recent, Changed) {
        limited(Limits {
            jobs: capacity,
            ..Limits::WRITER
        })
    }

    fn limited(limits: Limits) -> (Recent, Changed) {
        let changed = Changed::default();
        (Recent::new(changed.clone(), limits), changed)
    }

    /// What a test job takes.
    const SMALL: usize = 100;

    #[test]
    fn a_taken_job_is_no_longer_kept_until_a_commit_enters_it_again() {
        let (mut r, _) = recent(8);
        r.begin(Some(1));
        r.stage(7, &job("a"), SMALL);
        r.stage(8, &job("b"), SMALL);
        r.released();
        r.committed();
        assert_eq!(r.len(), 2);
        assert_eq!(r.bytes(), 2 * SMALL);
        let (row, taken) = r.take(&id("a")).unwrap();
        assert_eq!((row, taken.envelope.id.as_str()), (7, id("a").as_str()));
        assert!(r.take(&id("a")).is_none(), "taken once");
        assert_eq!(r.len(), 1);
        assert_eq!(r.bytes(), SMALL);
        // Its request saved it again and committed: kept again.
        r.begin(Some(1));
        r.stage(7, &taken, SMALL);
        r.released();
        r.committed();
        assert_eq!(r.take(&id("a")).map(|(row, _)| row), Some(7));
        // Taken by a request rolled back: read from its row from then on.
        r.begin(Some(1));
        assert!(r.take(&id("b")).is_some());
        r.rolled_back();
        r.failed();
        assert!(r.take(&id("b")).is_none());
        assert_eq!((r.len(), r.bytes()), (0, 0));
    }

    #[test]
    fn a_job_enters_with_its_commit_and_leaves_when_its_row_changes() {
        let (mut r, changed) = recent(10);
        r.begin(Some(1));
        // Our own statement names the row, then the job is staged.
        changed.lock().unwrap().push(7);
        r.stage(7, &job("a"), SMALL);
        assert!(r.get(&id("a")).is_none(), "staged, not committed");
        r.released();
        assert!(r.get(&id("a")).is_none());
        r.committed();
        assert_eq!(r.get(&id("a")).unwrap().0, 7);
        // Any later change of the row drops it.
        changed.lock().unwrap().push(7);
        assert!(r.get(&id("a")).is_none());
    }

    #[test]
    fn what_a_rolled_back_request_or_group_staged_never_enters() {
        let (mut r, changed) = recent(10);
        r.begin(Some(1));
        r.stage(1, &job("a"), SMALL);
        r.rolled_back();
        r.stage(2, &job("b"), SMALL);
        r.released();
        r.committed();
        assert!(r.get(&id("a")).is_none());
        assert!(r.get(&id("b")).is_some());
        r.begin(Some(1));
        r.stage(3, &job("c"), SMALL);
        r.released();
        r.failed();
        r.begin(Some(1));
        r.committed();
        assert!(r.get(&id("c")).is_none());
        // A later request of the group changing a staged job's row (a
        // delete, say) drops it before the commit.
        r.begin(Some(1));
        r.stage(4, &job("d"), SMALL);
        r.released();
        changed.lock().unwrap().push(4);
        r.committed();
        assert!(r.get(&id("d")).is_none());
        // Of several staged jobs, in the group and in the request, the one
        // whose row a statement changed goes and the others stay.
        r.begin(Some(1));
        r.stage(5, &job("e"), SMALL);
        r.released();
        r.stage(6, &job("f"), SMALL);
        r.stage(7, &job("g"), SMALL);
        changed.lock().unwrap().extend([6, 99]);
        r.released();
        r.committed();
        assert!(r.get(&id("e")).is_some());
        assert!(r.get(&id("f")).is_none());
        assert!(r.get(&id("g")).is_some());
    }

    #[test]
    fn another_connections_commit_or_a_reset_drops_everything() {
        let (mut r, _) = recent(10);
        r.begin(Some(1));
        r.stage(1, &job("a"), SMALL);
        r.released();
        r.committed();
        r.begin(Some(1));
        assert!(r.get(&id("a")).is_some());
        r.begin(Some(2));
        assert!(r.get(&id("a")).is_none());
        r.stage(1, &job("a"), SMALL);
        r.released();
        r.committed();
        r.clear();
        assert!(r.get(&id("a")).is_none());
    }

    #[test]
    fn it_keeps_at_most_its_capacity_the_latest_entered() {
        let (mut r, _) = recent(3);
        r.begin(Some(1));
        for (row, name) in ["a", "b", "c", "d"].iter().enumerate() {
            r.stage(row as i64, &job(name), SMALL);
        }
        // "a" again: it is now the latest.
        r.stage(0, &job("a"), SMALL);
        r.released();
        r.committed();
        assert_eq!(r.len(), 3);
        assert!(r.get(&id("b")).is_none(), "the oldest goes");
        for name in ["a", "c", "d"] {
            assert!(r.get(&id(name)).is_some(), "{name}");
        }
        for n in 0..100 {
            r.stage(10 + n, &job(&format!("x{n}")), SMALL);
        }
        r.released();
        r.committed();
        assert_eq!(r.len(), 3);
        assert!(r.order.len() <= 12);
    }

    #[test]
    fn it_keeps_at_most_its_bytes_and_no_job_larger_than_one_may_be() {
        let (mut r, changed) = limited(Limits {
            jobs: 100,
            bytes: 1_000,
            job_bytes: 400,
        });
        r.begin(Some(1));
        r.stage(1, &job("big"), 401);
        r.stage(2, &job("a"), 400);
        r.stage(3, &job("b"), 300);
        r.stage(4, &job("c"), 300);
        r.released();
        r.committed();
        assert!(r.get(&id("big")).is_none(), "larger than one job may be");
        assert_eq!(r.bytes(), 1_000);
        assert_eq!(r.len(), 3);
        // One more pushes out the oldest until the total fits again.
        r.stage(5, &job("d"), 200);
        r.released();
        r.committed();
        assert!(r.get(&id("a")).is_none(), "the oldest goes");
        assert_eq!(r.bytes(), 800);
        // A job kept again at a new size counts once, at that size; one
        // dropped by a change of its row gives its bytes back.
        changed.lock().unwrap().push(3);
        r.stage(3, &job("b"), 100);
        r.released();
        r.committed();
        assert_eq!(r.bytes(), 600);
        changed.lock().unwrap().push(4);
        assert!(r.get(&id("c")).is_none());
        assert_eq!(r.bytes(), 300);
        // Grown past what one job may be: the old entry went with the
        // save's change of its row, and nothing comes in its place.
        changed.lock().unwrap().push(5);
        r.stage(5, &job("d"), 500);
        r.released();
        r.committed();
        assert!(r.get(&id("d")).is_none());
        assert_eq!(r.bytes(), 100);
        r.clear();
        assert_eq!(r.bytes(), 0);
    }
}
