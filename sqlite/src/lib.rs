//! What the two SQLite files of ojs-bridge share: the embedded broker's
//! queues (`ojs-adapter-local`) and the job store (`ojs-api`). Each has one
//! connection that writes; [`Checkpointer`] takes the copying of its log
//! (WAL) back into the file out of its commits.

use std::cell::Cell;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use rusqlite::Connection;

/// Log pages past which the log is copied back into the file: SQLite's own
/// automatic checkpoint threshold.
pub const CHECKPOINT_PAGES: i32 = 1000;

thread_local! {
    /// Pages in the log after the last commit made on this thread, as
    /// SQLite's log hook said: the hook is a plain function, called on the
    /// thread that commits, and read there right after the commit.
    static WAL_PAGES: Cell<i32> = const { Cell::new(0) };
}

fn note_wal_pages(_: &rusqlite::hooks::Wal, pages: std::ffi::c_int) -> rusqlite::Result<()> {
    WAL_PAGES.set(pages);
    Ok(())
}

const IDLE: u8 = 0;
const COPYING: u8 = 1;
/// A pass that copied all but what was committed while it ran.
const COPIED: u8 = 2;

/// Checkpoints mostly on a thread and connection of their own.
///
/// SQLite's automatic checkpoint runs inside the commit that crosses its
/// threshold: that commit's callers wait while the log is copied into the
/// file and synced (the slowest PUSHes and FETCHes were those). Here a
/// passive checkpoint on another thread copies what is committed while the
/// writer goes on. The log starts over only once every page in it was
/// copied: a pass that ran while the writer paused does that, but beside
/// a writer that keeps committing no pass ever sees it all (the log grew
/// without bound that way), so after a pass that left pages the writer
/// copies them itself, between two commits: the syncs of SQLite's own
/// checkpoint stay in its commit path, the copying does not. Passes that
/// ran back to back instead, each copying the few pages committed during
/// the last, cost FETCH + ACK a third more CPU per job (hot pages copied
/// again and again).
///
/// Stopped when dropped, before the writer's connection closes (SQLite's
/// unix VFS can deadlock when two connections to one file close at once on
/// two threads): keep it declared, or drop it, before that connection.
#[derive(Debug)]
pub struct Checkpointer {
    nudge: Option<mpsc::SyncSender<()>>,
    /// [`IDLE`], [`COPYING`] (the thread's pass, asked by the writer) or
    /// [`COPIED`] (a pass done that left pages): one checkpoint at a time,
    /// so the writer's never finds the thread's running (it would fail
    /// busy).
    pass: Arc<AtomicU8>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Which file, for the log.
    file: &'static str,
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
                }
            }
            Err(error) => {
                tracing::warn!(file, %error, "no checkpoint thread; the writer checkpoints in its commits");
                Checkpointer {
                    nudge: None,
                    pass,
                    thread: None,
                    file,
                }
            }
        }
    }

    /// To call on the thread that committed, right after its commits on
    /// `writer`: past [`CHECKPOINT_PAGES`] the thread is asked to copy the
    /// log; after a pass that left pages, `writer` copies them.
    pub fn committed(&self, writer: &Connection) {
        let pages = WAL_PAGES.replace(0);
        if pages < CHECKPOINT_PAGES {
            return;
        }
        let Some(nudge) = &self.nudge else { return };
        match self.pass.load(Ordering::Acquire) {
            COPIED => {
                if let Err(error) = checkpoint(writer) {
                    tracing::warn!(file = self.file, %error, "a checkpoint of the log failed; the next commit tries again");
                }
                self.pass.store(IDLE, Ordering::Release);
            }
            IDLE => {
                self.pass.store(COPYING, Ordering::Release);
                if nudge.try_send(()).is_err() {
                    self.pass.store(IDLE, Ordering::Release);
                }
            }
            _ => {}
        }
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

/// A passive checkpoint: whether it copied every page in the log.
fn checkpoint(conn: &Connection) -> rusqlite::Result<bool> {
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| {
        Ok(r.get::<_, i64>(2)? >= r.get::<_, i64>(1)?)
    })
}

fn checkpoint_loop(
    file: &'static str,
    conn: &Connection,
    nudged: &mpsc::Receiver<()>,
    pass: &AtomicU8,
) {
    while nudged.recv().is_ok() {
        match checkpoint(conn) {
            // All of it: the writer's next transaction starts the log over.
            Ok(true) => pass.store(IDLE, Ordering::Release),
            Ok(false) => pass.store(COPIED, Ordering::Release),
            Err(error) => {
                tracing::warn!(file, %error, "a checkpoint of the log failed; the next commit asks again");
                std::thread::sleep(Duration::from_millis(100));
                pass.store(IDLE, Ordering::Release);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(path: &std::path::Path) -> rusqlite::Result<Connection> {
        let conn = Connection::open(path)?;
        conn.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))?;
        conn.execute_batch("PRAGMA synchronous = NORMAL;")?;
        Ok(conn)
    }

    fn file_len(path: &std::path::Path) -> u64 {
        std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
    }

    /// A writer that commits without a pause: with SQLite's automatic
    /// checkpoint off, the log still starts over (it stays within a few
    /// thresholds), the thread does the copying, and every row is there.
    #[test]
    fn the_log_stays_bounded_while_the_writer_keeps_committing(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let dir = std::env::temp_dir().join(format!(
            "ojs-sqlite-checkpoint-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default()
        ));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("t.sqlite");
        let mut writer = open(&path)?;
        writer.execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, body BLOB NOT NULL)")?;
        let mut checkpointer = Checkpointer::start("test", open(&path)?, &writer);
        let body = vec![7u8; 1000];
        let mut largest_log = 0;
        let commits = 20_000;
        for _ in 0..commits {
            let tx = writer.transaction()?;
            tx.execute("INSERT INTO t (body) VALUES (?1)", [&body])?;
            tx.commit()?;
            checkpointer.committed(&writer);
            largest_log = largest_log.max(file_len(&dir.join("t.sqlite-wal")));
        }
        checkpointer.stop();
        let rows: i64 = writer.query_row("SELECT count(*) FROM t", [], |r| r.get(0))?;
        let page: i64 = writer.query_row("PRAGMA page_size", [], |r| r.get(0))?;
        let file = file_len(&path);
        drop(writer);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(rows, commits);
        // A page or more each commit: 20,000 commits would be a log of 80
        // MiB or more had it never started over.
        let bound = 8 * CHECKPOINT_PAGES as u64 * page as u64;
        println!("largest log {largest_log} bytes (bound {bound}), file {file} bytes");
        assert!(largest_log < bound, "the log grew to {largest_log} bytes");
        // What was copied reached the file.
        assert!(
            file >= (commits as u64) * 1000 / 2,
            "the file holds {file} bytes"
        );
        Ok(())
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
