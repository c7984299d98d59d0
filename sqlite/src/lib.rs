//! What the two SQLite files of ojs-bridge share: the embedded broker's
//! queues (`ojs-adapter-local`) and the job store (`ojs-api`). Each has one
//! connection that writes; [`Checkpointer`] takes the copying of its log
//! (WAL) back into the file out of its commits, and [`open`] opens each
//! connection through a VFS that writes a commit's log frames in one call
//! ([`log_writes`]).

use std::cell::Cell;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use rusqlite::Connection;

pub mod log_writes;
mod lookaside;
mod transaction;
pub use log_writes::open;
pub use lookaside::set_lookaside;
pub use transaction::{begin_immediate, WriteTransaction};

/// Log pages past which the log is copied back into the file: SQLite's own
/// automatic checkpoint threshold.
pub const CHECKPOINT_PAGES: i32 = 1000;

thread_local! {
    /// Pages in the log after the last commit made on this thread, as
    /// SQLite's log hook said: the hook is a plain function, called on the
    /// thread that commits, and read there right after the commit.
    /// [`NO_COMMIT`] until the hook is called.
    static WAL_PAGES: Cell<i32> = const { Cell::new(NO_COMMIT) };
}

/// No commit on this thread since the last look.
const NO_COMMIT: i32 = -1;

fn note_wal_pages(_: &rusqlite::hooks::Wal, pages: std::ffi::c_int) -> rusqlite::Result<()> {
    WAL_PAGES.set(pages);
    Ok(())
}

/// Log pages past which a writer whose pass has not ended yet waits for it
/// and copies the rest itself, as SQLite's own checkpoint would have in its
/// commit: on a disk slow to sync (a loaded machine), passes last long and
/// the log would grow by all that was committed meanwhile.
pub const WAIT_PAGES: i32 = 3 * CHECKPOINT_PAGES;

/// The longest the writer waits for the thread's pass.
pub const PASS_WAIT: Duration = Duration::from_secs(2);

const IDLE: u8 = 0;
const COPYING: u8 = 1;
/// A pass done: it copied what was committed when it began.
const COPIED: u8 = 2;

/// Checkpoints mostly on a thread and connection of their own.
///
/// SQLite's automatic checkpoint runs inside the commit that crosses its
/// threshold: that commit's callers wait while the log is copied into the
/// file and synced (the slowest PUSHes and FETCHes were those). Here a
/// passive checkpoint on another thread copies what was committed when it
/// began, while the writer goes on.
///
/// The log starts over only when the writer begins a transaction and finds
/// every page in it copied. A pass copies up to the last commit it saw:
/// whenever the writer committed while it ran (always, under load, and
/// more so on a busy machine) the log did not start over, and passes asked
/// again and again never caught up (the log grew past 70 MB in CI that
/// way). So after every pass the writer's next commit tells: a short log
/// means it started over; a long one, the writer copies what the pass left
/// itself, between two commits — a few pages, nothing committed after it —
/// and its next transaction starts the log over. Passes back to back
/// instead cost FETCH + ACK a third more CPU per job (hot pages copied
/// again and again). A pass that runs long (a disk slow to sync) is waited
/// for past [`WAIT_PAGES`], as SQLite's own checkpoint would make the
/// commit wait: the log stays within that however slow the disk.
///
/// Stopped when dropped, before the writer's connection closes (SQLite's
/// unix VFS can deadlock when two connections to one file close at once on
/// two threads): keep it declared, or drop it, before that connection.
#[derive(Debug)]
pub struct Checkpointer {
    nudge: Option<mpsc::SyncSender<()>>,
    /// [`IDLE`], [`COPYING`] (the thread's pass, asked by the writer) or
    /// [`COPIED`] (a pass done, the writer's next commit to tell whether
    /// the log started over): one checkpoint at a time, so the writer's
    /// never finds the thread's running (it would fail busy).
    pass: Arc<AtomicU8>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Which file, for the log.
    file: &'static str,
    /// The writer's failed checkpoints.
    failures: Failures,
}

impl Checkpointer {
    /// Starts the thread on `own` (a connection of its own to the file of
    /// `writer`) and turns `writer`'s automatic checkpoint off. Without a
    /// thread (the system refused one), `writer` checkpoints in its commits
    /// as SQLite does.
    pub fn start(file: &'static str, own: Connection, writer: &Connection) -> Checkpointer {
        let (nudge, nudged) = mpsc::sync_channel::<()>(1);
        let pass = Arc::new(AtomicU8::new(IDLE));
        let done = pass.clone();
        let thread = std::thread::Builder::new()
            .name("ojs-checkpoint".into())
            .spawn(move || checkpoint_loop(file, &own, &nudged, &done));
        match thread {
            Ok(thread) => {
                // The hook replaces SQLite's automatic checkpoint.
                writer.wal_hook(Some(note_wal_pages));
                Checkpointer {
                    nudge: Some(nudge),
                    pass,
                    thread: Some(thread),
                    file,
                    failures: Failures::default(),
                }
            }
            Err(error) => {
                tracing::warn!(file, %error, "no checkpoint thread; the writer checkpoints in its commits");
                Checkpointer {
                    nudge: None,
                    pass,
                    thread: None,
                    file,
                    failures: Failures::default(),
                }
            }
        }
    }

    /// To call on the thread that committed, right after its commits on
    /// `writer` (a call with no commit since the last does nothing): past
    /// [`CHECKPOINT_PAGES`] the thread is asked to copy the log; after a
    /// pass, `writer` copies what it left unless the log started over.
    pub fn committed(&self, writer: &Connection) {
        let pages = WAL_PAGES.replace(NO_COMMIT);
        if pages == NO_COMMIT {
            return;
        }
        if pages < CHECKPOINT_PAGES {
            // Started over since the pass (or never grew): nothing left.
            if self.pass.load(Ordering::Acquire) == COPIED {
                self.pass.store(IDLE, Ordering::Release);
            }
            return;
        }
        let Some(nudge) = &self.nudge else { return };
        match self.pass.load(Ordering::Acquire) {
            IDLE => {
                self.pass.store(COPYING, Ordering::Release);
                if nudge.try_send(()).is_err() {
                    self.pass.store(IDLE, Ordering::Release);
                }
            }
            COPIED => self.copy_rest(writer),
            // A pass still running: past WAIT_PAGES the writer waits for it.
            _ => {
                if pages >= WAIT_PAGES && self.pass_ended() {
                    self.copy_rest(writer);
                }
            }
        }
    }

    /// The writer copies what the thread's pass left (what was committed
    /// while it ran), so that its next transaction starts the log over.
    fn copy_rest(&self, writer: &Connection) {
        if let Err(error) = checkpoint(writer) {
            self.failures.warn(self.file, "the writer's", &error);
        }
        self.pass.store(IDLE, Ordering::Release);
    }

    /// Copies the whole log into the file and truncates it to nothing, on
    /// `writer`, between two of its commits (as `committed` is called).
    /// A pass of the thread's is waited for first (at most
    /// [`PASS_WAIT`]): two checkpoints cannot run at once, and a
    /// truncation during a pass did nothing (busy). Whether the log was
    /// emptied: a reader's older snapshot, or a pass that did not end in
    /// time, keeps it.
    pub fn truncate(&self, writer: &Connection) -> rusqlite::Result<bool> {
        if !self.pass_ended() {
            return Ok(false);
        }
        let busy: i64 = writer.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0))?;
        if busy != 0 {
            return Ok(false);
        }
        // The log is empty: what the last commit said of it is past.
        WAL_PAGES.set(NO_COMMIT);
        self.pass.store(IDLE, Ordering::Release);
        Ok(true)
    }

    /// Waits (at most [`PASS_WAIT`]) for a pass of the thread's to end;
    /// whether it did. Only the writer asks for a pass, and it is the
    /// caller: once this one ended, none starts until its next commit.
    fn pass_ended(&self) -> bool {
        let deadline = Instant::now() + PASS_WAIT;
        while self.pass.load(Ordering::Acquire) == COPYING {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// Ends the thread and closes its connection (also when dropped).
    pub fn stop(&mut self) {
        self.nudge = None;
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::warn!(file = self.file, "the checkpoint thread panicked");
            }
        }
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A passive checkpoint: it copies what no reader still needs from the log,
/// up to the last commit it sees, and waits for no one.
fn checkpoint(conn: &Connection) -> rusqlite::Result<()> {
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
}

fn checkpoint_loop(
    file: &'static str,
    conn: &Connection,
    nudged: &mpsc::Receiver<()>,
    pass: &AtomicU8,
) {
    let failures = Failures::default();
    while nudged.recv().is_ok() {
        // Complete or not (a reader kept older pages), the writer's next
        // commit finishes it: the pass could not see what was committed
        // while it ran. A failed pass too: the writer's own connection may
        // still copy, as SQLite's automatic checkpoint would have.
        if let Err(error) = checkpoint(conn) {
            failures.warn(file, "the checkpoint thread's", &error);
        }
        pass.store(COPIED, Ordering::Release);
    }
}

/// Failed checkpoints, logged at most once per [`Failures::EVERY`] with
/// how many failed since: a file that cannot be checkpointed fails at every
/// commit past the threshold.
#[derive(Debug, Default)]
struct Failures {
    /// When the last was logged, and how many failed since.
    last: std::sync::Mutex<(Option<Instant>, u64)>,
}

impl Failures {
    const EVERY: Duration = Duration::from_secs(10);

    fn warn(&self, file: &'static str, by: &'static str, error: &rusqlite::Error) {
        let Ok(mut last) = self.last.lock() else {
            return;
        };
        let (logged, failed_since) = &mut *last;
        if logged.is_some_and(|at| at.elapsed() < Self::EVERY) {
            *failed_since += 1;
            return;
        }
        tracing::warn!(
            file,
            by,
            %error,
            failed_since = *failed_since,
            "a checkpoint of the log failed; the next commit past the threshold tries again"
        );
        *logged = Some(Instant::now());
        *failed_since = 0;
    }
}

/// A directory of its own for a test, removed when dropped.
#[cfg(test)]
struct ScratchDir(std::path::PathBuf);

#[cfg(test)]
impl ScratchDir {
    fn new(name: &str) -> std::io::Result<ScratchDir> {
        let dir = std::env::temp_dir().join(format!(
            "ojs-sqlite-{name}-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default()
        ));
        std::fs::create_dir_all(&dir)?;
        Ok(ScratchDir(dir))
    }

    fn file(&self, name: &str) -> std::path::PathBuf {
        self.0.join(name)
    }
}

#[cfg(test)]
impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(path: &std::path::Path) -> rusqlite::Result<Connection> {
        let conn = crate::open(
            path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_WRITE | rusqlite::OpenFlags::SQLITE_OPEN_CREATE,
        )?;
        conn.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))?;
        conn.execute_batch("PRAGMA synchronous = NORMAL;")?;
        Ok(conn)
    }

    /// The bundled SQLite is compiled as `.cargo/config.toml` says: no
    /// allocation statistics (a global mutex around every allocation) and
    /// a page cache of each connection's own (no mutex around every page
    /// fetched). A build that lost the setting fails here, not only in a
    /// bench's count.
    #[test]
    fn sqlite_is_compiled_without_the_global_mutexes() -> rusqlite::Result<()> {
        let conn = Connection::open_in_memory()?;
        let mut stmt = conn.prepare("PRAGMA compile_options")?;
        let options = stmt
            .query_map([], |r| r.get::<_, String>(0))?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        // What the bundled build sets beside ours: the list was read.
        assert!(options.iter().any(|o| o == "THREADSAFE=1"), "{options:?}");
        assert!(
            options.iter().any(|o| o == "DEFAULT_MEMSTATUS=0"),
            "{options:?}"
        );
        assert!(
            !options.iter().any(|o| o == "ENABLE_MEMORY_MANAGEMENT"),
            "{options:?}"
        );
        Ok(())
    }

    /// `t.sqlite` with a table `t` in a directory of its own, and the
    /// writer's connection to it; the directory goes when dropped.
    struct Scratch {
        dir: crate::ScratchDir,
        path: std::path::PathBuf,
    }

    impl Scratch {
        fn new(name: &str) -> Result<(Scratch, Connection), Box<dyn std::error::Error>> {
            let dir = crate::ScratchDir::new(name)?;
            let path = dir.file("t.sqlite");
            let writer = open(&path)?;
            writer.execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, body BLOB)")?;
            Ok((Scratch { dir, path }, writer))
        }

        fn log_len(&self) -> u64 {
            file_len(&self.dir.file("t.sqlite-wal"))
        }
    }

    fn file_len(path: &std::path::Path) -> u64 {
        std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
    }

    /// What a writer that commits 20,000 rows of 1,000 bytes without a
    /// pause saw, beside a checkpointer whose thread has the connection
    /// `own` opens.
    struct Stream {
        largest_log: u64,
        /// Four thresholds' worth of pages.
        bound: u64,
        rows: i64,
        file: u64,
        during_passes: usize,
    }

    impl Stream {
        /// Every row is there, the log stayed within its bound, and what
        /// was copied reached the file.
        fn assert_bounded_and_whole(&self) {
            assert_eq!(self.rows, COMMITS);
            assert!(
                self.largest_log < self.bound,
                "the log grew to {} bytes",
                self.largest_log
            );
            assert!(
                self.file >= (COMMITS as u64) * 1000 / 2,
                "the file holds {} bytes",
                self.file
            );
        }
    }

    const COMMITS: i64 = 20_000;

    fn stream_of_commits(
        name: &str,
        own: impl FnOnce(&std::path::Path) -> rusqlite::Result<Connection>,
    ) -> Result<Stream, Box<dyn std::error::Error>> {
        let (scratch, mut writer) = Scratch::new(name)?;
        let mut checkpointer = Checkpointer::start("test", own(&scratch.path)?, &writer);
        let body = vec![7u8; 1000];
        let mut largest_log = 0;
        let mut during_passes = 0;
        for _ in 0..COMMITS {
            let passing = checkpointer.pass.load(Ordering::Acquire) == COPYING;
            let tx = writer.transaction()?;
            tx.execute("INSERT INTO t (body) VALUES (?1)", [&body])?;
            tx.commit()?;
            during_passes += usize::from(passing);
            checkpointer.committed(&writer);
            largest_log = largest_log.max(scratch.log_len());
        }
        checkpointer.stop();
        let rows: i64 = writer.query_row("SELECT count(*) FROM t", [], |r| r.get(0))?;
        let page: i64 = writer.query_row("PRAGMA page_size", [], |r| r.get(0))?;
        let file = file_len(&scratch.path);
        drop(writer);
        let stream = Stream {
            largest_log,
            // A page or more each commit: 20,000 commits would be a log of
            // 80 MiB or more had it never started over.
            bound: 4 * CHECKPOINT_PAGES as u64 * page as u64,
            rows,
            file,
            during_passes,
        };
        println!(
            "{name}: largest log {} bytes (bound {}), file {} bytes, {} commits while a pass ran",
            stream.largest_log, stream.bound, stream.file, stream.during_passes
        );
        Ok(stream)
    }

    /// A writer that commits without a pause, so through every pass: with
    /// SQLite's automatic checkpoint off, the log still starts over (it
    /// stays within a few thresholds: a pass that saw all it could is not
    /// enough, what was committed while it ran must be copied too), and
    /// every row is there.
    #[test]
    fn the_log_stays_bounded_while_the_writer_keeps_committing(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let stream = stream_of_commits("passes", open)?;
        assert!(
            stream.during_passes > 0,
            "no commit was made while a pass ran"
        );
        stream.assert_bounded_and_whole();
        Ok(())
    }

    /// The thread's connection cannot checkpoint (it is read-only, as a
    /// file gone read-only under it would be): every pass fails, commits go
    /// on, and the writer copies the log itself, so it still starts over.
    #[test]
    fn when_the_thread_cannot_checkpoint_the_writer_does() -> Result<(), Box<dyn std::error::Error>>
    {
        let stream = stream_of_commits("read-only", |path| {
            Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
        })?;
        stream.assert_bounded_and_whole();
        Ok(())
    }

    /// A read-only connection's checkpoint fails: what the test above
    /// stands on.
    #[test]
    fn a_read_only_connection_cannot_checkpoint() -> Result<(), Box<dyn std::error::Error>> {
        let (scratch, writer) = Scratch::new("ro")?;
        writer.execute_batch("INSERT INTO t DEFAULT VALUES")?;
        let read_only =
            Connection::open_with_flags(&scratch.path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)?;
        let outcome = checkpoint(&read_only);
        drop(read_only);
        drop(writer);
        assert!(outcome.is_err(), "{outcome:?}");
        Ok(())
    }

    /// Truncating the log (the broker's housekeeping) right after the
    /// writer asked the thread for a pass: it waits for the pass, and the
    /// log is empty afterwards, every time.
    #[test]
    fn a_truncation_waits_for_the_threads_pass() -> Result<(), Box<dyn std::error::Error>> {
        let (scratch, writer) = Scratch::new("truncate")?;
        let mut checkpointer = Checkpointer::start("test", open(&scratch.path)?, &writer);
        let body = vec![7u8; 4000];
        let mut outcomes = Vec::new();
        for _ in 0..50 {
            while checkpointer.pass.load(Ordering::Acquire) != COPYING {
                writer.execute("INSERT INTO t (body) VALUES (?1)", [&body])?;
                checkpointer.committed(&writer);
            }
            let emptied = checkpointer.truncate(&writer)?;
            outcomes.push((emptied, scratch.log_len()));
        }
        checkpointer.stop();
        drop(writer);
        assert!(
            outcomes.iter().all(|&(emptied, log)| emptied && log == 0),
            "(emptied, log bytes) after each truncation: {outcomes:?}"
        );
        Ok(())
    }

    /// A pass that runs long (a disk slow to sync): past [`WAIT_PAGES`]
    /// the writer waits for it and copies the rest, so the log stays within
    /// its bound however long the pass takes. The pass here is one the
    /// test holds open for half a second.
    #[test]
    fn the_writer_waits_for_a_pass_that_runs_long() -> Result<(), Box<dyn std::error::Error>> {
        let (scratch, writer) = Scratch::new("long-pass")?;
        let mut checkpointer = Checkpointer::start("test", open(&scratch.path)?, &writer);
        checkpointer.pass.store(COPYING, Ordering::Release);
        let pass = checkpointer.pass.clone();
        let long_pass = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(500));
            pass.store(COPIED, Ordering::Release);
        });
        let body = vec![7u8; 1000];
        let mut largest_log = 0;
        let commits = 2 * WAIT_PAGES as i64;
        for _ in 0..commits {
            writer.execute("INSERT INTO t (body) VALUES (?1)", [&body])?;
            checkpointer.committed(&writer);
            largest_log = largest_log.max(scratch.log_len());
        }
        let _ = long_pass.join();
        checkpointer.stop();
        let rows: i64 = writer.query_row("SELECT count(*) FROM t", [], |r| r.get(0))?;
        let page: i64 = writer.query_row("PRAGMA page_size", [], |r| r.get(0))?;
        drop(writer);
        assert_eq!(rows, commits);
        let bound = (WAIT_PAGES as u64 + 100) * (page as u64 + 24);
        assert!(
            largest_log < bound,
            "the log grew to {largest_log} bytes (bound {bound})"
        );
        Ok(())
    }

    /// A file that cannot be checkpointed fails at every commit past the
    /// threshold: the first failure is logged, the next ones counted until
    /// [`Failures::EVERY`] has passed.
    #[test]
    fn failures_are_logged_once_then_counted() {
        let failures = Failures::default();
        let error = rusqlite::Error::InvalidQuery;
        for _ in 0..3 {
            failures.warn("test", "the writer's", &error);
        }
        let last = failures.last.lock().map(|l| *l).unwrap_or((None, 0));
        assert!(last.0.is_some(), "the first failure was not logged");
        assert_eq!(last.1, 2);
    }

    /// Stopping ends the thread (a second stop, and the drop, do nothing).
    #[test]
    fn stopping_ends_the_thread() -> rusqlite::Result<()> {
        let writer = Connection::open_in_memory()?;
        let mut checkpointer = Checkpointer::start("test", Connection::open_in_memory()?, &writer);
        assert!(checkpointer.thread.is_some());
        checkpointer.stop();
        assert!(checkpointer.thread.is_none());
        checkpointer.stop();
        Ok(())
    }
}
