//! The embedded durable broker: a [`QueueAdapter`] on one SQLite file in a
//! data directory (`local:///abs/dir`, `local:./dir`), the default that needs
//! no infrastructure.
//!
//! Delivery semantics: at least once, durable. `publish` returns after the
//! batch is committed (one transaction: all of it or none). A received message
//! is leased for the consumer's visibility timeout; it comes back when the
//! lease ends (also after `kill -9` of its consumer), when it is nacked, or at
//! once when its consumer is dropped. Several processes may publish to and
//! consume from one directory at the same time; SQLite's locking makes each
//! claim atomic. Order: higher priority first, then publish order;
//! `deliver_at` (OJS `scheduled_at`) is honoured.
//!
//! ```no_run
//! # async fn demo() -> ojs_queue::Result<()> {
//! use ojs_adapter_local::{LocalAdapter, LocalConfig};
//! use ojs_queue::{ConsumerOptions, OutgoingMessage, QueueAdapter};
//! use std::time::Duration;
//!
//! let adapter = LocalAdapter::open(LocalConfig::from_url("local:./ojs-bridge-data")?).await?;
//! adapter.publish("default", vec![OutgoingMessage::new("hi", "text/plain")]).await?;
//! let mut consumer = adapter.consumer("default", ConsumerOptions::default()).await?;
//! for delivery in consumer.receive(10, Duration::from_secs(1)).await? {
//!     delivery.ack().await?;
//! }
//! # Ok(()) }
//! ```

mod ack;
mod config;
mod consume;
mod group;
mod move_;
mod publish;
mod row_headers;
mod store;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use ojs_queue::{admit, publish_outcome};
use ojs_queue::{Consumer, ConsumerOptions, Error, Health, OutgoingMessage, QueueAdapter, Result};
use rusqlite::Connection;
use tokio::sync::Notify;

pub use config::{Durability, LocalConfig, DATABASE_FILE};

use crate::ack::AckRequest;
use crate::group::GroupCommit;
use crate::publish::{commit_publishes, PublishRequest};
pub use consume::LocalConsumer;
use consume::{lock_held, Held};

/// Acks between two housekeeping passes (vacuum + WAL truncate).
const HOUSEKEEPING_EVERY: u64 = 20_000;
#[derive(Debug)]
struct Inner {
    config: LocalConfig,
    /// Declared before the connection: stopped before it closes.
    checkpointer: ojs_sqlite::Checkpointer,
    conn: Mutex<Connection>,
    /// Wakes this process's consumers on publish and nack.
    notify: Notify,
    deletes: AtomicU64,
    /// Acks and publishes waiting for their commit. Unbounded: each is a
    /// caller awaiting its answer, so the callers bound them.
    acks: GroupCommit<AckRequest>,
    publishes: GroupCommit<PublishRequest>,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Connection> {
        // SQLite keeps its own consistency; a panic elsewhere while holding
        // the guard leaves the connection usable.
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }
}

async fn blocking<T: Send + 'static>(
    inner: &Arc<Inner>,
    f: impl FnOnce(&Inner, &mut Connection) -> Result<T> + Send + 'static,
) -> Result<T> {
    let inner = inner.clone();
    tokio::task::spawn_blocking(move || {
        let mut conn = inner.lock();
        let done = f(&inner, &mut conn);
        inner.checkpointer.committed(&conn);
        done
    })
    .await
    .map_err(|e| Error::broker("local", format!("store task failed: {e}"), true))?
}

/// Waits for messages to come, after a look found none: until a publish
/// or nack of this process (`notified`), the next look for other
/// processes' messages (`poll_interval_ms`), the time the queue's next
/// message becomes deliverable (`next`, ms since the epoch), or
/// `deadline`, whichever is first. `false` when `deadline` had passed.
async fn wait_for_messages(
    inner: &Inner,
    notified: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>,
    next: Option<i64>,
    deadline: tokio::time::Instant,
) -> bool {
    let now = tokio::time::Instant::now();
    if now >= deadline {
        return false;
    }
    let mut wake = (now + inner.config.poll_interval()).min(deadline);
    if let Some(at) = next {
        let until =
            std::time::Duration::from_millis(at.saturating_sub(store::now_ms()).max(0) as u64);
        wake = wake.min(now + until);
    }
    tokio::select! {
        () = notified => {}
        () = tokio::time::sleep_until(wake) => {}
    }
    true
}

/// A connection to an embedded broker directory.
#[derive(Debug)]
pub struct LocalAdapter {
    inner: Arc<Inner>,
    closed: AtomicBool,
}

impl LocalAdapter {
    /// Opens (creating when needed) the broker in `config.path`. A corrupt or
    /// foreign database file is [`Error::InvalidConfig`] naming the file.
    pub async fn open(config: LocalConfig) -> Result<Self> {
        let cfg = config.clone();
        let (conn, checkpoints) = tokio::task::spawn_blocking(move || {
            Ok::<_, Error>((store::open(&cfg)?, store::open_checkpoints(&cfg)?))
        })
        .await
        .map_err(|e| Error::broker("local", e.to_string(), false))??;
        let checkpointer =
            ojs_sqlite::Checkpointer::start(config::DATABASE_FILE, checkpoints, &conn);
        let inner = Arc::new(Inner {
            config,
            checkpointer,
            conn: Mutex::new(conn),
            notify: Notify::new(),
            deletes: AtomicU64::new(0),
            acks: GroupCommit::default(),
            publishes: GroupCommit::default(),
        });
        Ok(LocalAdapter {
            inner,
            closed: AtomicBool::new(false),
        })
    }

    /// The settings this adapter runs with.
    pub fn config(&self) -> &LocalConfig {
        &self.inner.config
    }
}

#[async_trait]
impl QueueAdapter for LocalAdapter {
    fn kind(&self) -> &'static str {
        "local"
    }

    fn max_message_bytes(&self) -> usize {
        self.inner.config.max_message_bytes
    }

    fn mover(&self) -> Option<&dyn ojs_queue::MoveWithin> {
        Some(self)
    }

    #[tracing::instrument(skip_all, fields(queue = %queue, count = messages.len()))]
    async fn publish(&self, queue: &str, messages: Vec<OutgoingMessage>) -> Result<()> {
        let (total, accepted, mut failed) = admit(
            messages,
            self.inner.config.max_message_bytes,
            self.closed.load(Ordering::Acquire),
        )?;
        if !accepted.is_empty() {
            let (indices, batch): (Vec<usize>, Vec<OutgoingMessage>) = accepted.into_iter().unzip();
            let (reply, answer) = tokio::sync::oneshot::channel();
            let request = PublishRequest {
                queue: queue.to_owned(),
                messages: batch,
                reply,
            };
            GroupCommit::submit(&self.inner, |i| &i.publishes, request, commit_publishes);
            // The batch comes back so that a failed commit can hand it back.
            let (result, batch) = answer
                .await
                .map_err(|_| Error::broker("local", "the publish commit stopped", true))?;
            match result {
                // The commit woke the waiting consumers (`commit_publishes`).
                Ok(()) => {}
                Err(e) => {
                    let kind_retryable = e.is_retryable();
                    let text = e.to_string();
                    failed.extend(indices.into_iter().zip(batch).map(|(index, message)| {
                        ojs_queue::FailedPublish {
                            index,
                            message,
                            error: Error::broker("local", text.clone(), kind_retryable),
                        }
                    }));
                }
            }
        }
        publish_outcome(total, failed)
    }

    async fn consumer(&self, queue: &str, options: ConsumerOptions) -> Result<Box<dyn Consumer>> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        Ok(Box::new(LocalConsumer {
            inner: self.inner.clone(),
            queue: Arc::from(queue),
            options,
            held: Arc::new(Mutex::new(HashSet::new())),
        }))
    }

    async fn health(&self) -> Health {
        let path = self.inner.config.database_path();
        match blocking(&self.inner, |_, conn| {
            conn.query_row("SELECT 1", [], |_| Ok(()))
                .map_err(|e| Error::broker("local", e.to_string(), true))
        })
        .await
        {
            Ok(()) => Health::ok(format!("sqlite {}", path.display())),
            Err(e) => Health::down(e.to_string()),
        }
    }

    async fn delete_reply_queue(&self, queue: &str) -> Result<()> {
        let q = queue.to_owned();
        blocking(&self.inner, move |_, conn| {
            store::delete_queue(conn, &q).map(|_| ())
        })
        .await
    }

    async fn depth(&self, queue: &str) -> Result<Option<u64>> {
        let q = queue.to_owned();
        blocking(&self.inner, move |_, conn| store::depth(conn, &q).map(Some)).await
    }

    async fn close(&self) -> Result<()> {
        // Commits are durable when publish returns: nothing to flush. Tidy up.
        self.closed.store(true, Ordering::Release);
        blocking(&self.inner, |inner, conn| {
            store::housekeeping(conn, &inner.checkpointer)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use ojs_queue::{Nack, Source};
    use tokio::time::Instant;

    use super::*;
    use ojs_core::envelope::media::OJS_PROTO;

    fn temp_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "ojs-local-{name}-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// The one text column of every row `sql` reads from the adapter's
    /// database.
    fn texts(a: &LocalAdapter, sql: &str) -> Vec<String> {
        a.inner
            .lock()
            .prepare(sql)
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    async fn dead_letters(a: &LocalAdapter, queue: &str) -> Box<dyn Consumer> {
        let options = ConsumerOptions {
            source: Source::DeadLetters,
            ..ConsumerOptions::default()
        };
        a.consumer(queue, options).await.unwrap()
    }

    #[tokio::test]
    async fn a_corrupt_file_is_a_clear_error() {
        let dir = temp_dir("corrupt");
        std::fs::write(dir.join(DATABASE_FILE), b"this is not a database, just some bytes......................................................................................").unwrap();
        let err = LocalAdapter::open(LocalConfig::new(&dir))
            .await
            .unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, Error::InvalidConfig { .. }), "{text}");
        assert!(
            text.contains(DATABASE_FILE) && text.contains("not an ojs-bridge local queue database"),
            "{text}"
        );
        std::fs::remove_dir_all(dir).ok();
    }

    #[tokio::test]
    async fn a_foreign_sqlite_database_is_refused_untouched() {
        let dir = temp_dir("foreign");
        let path = dir.join(DATABASE_FILE);
        {
            let c = Connection::open(&path).unwrap();
            c.execute_batch(
                "CREATE TABLE invoices (id INTEGER PRIMARY KEY); INSERT INTO invoices VALUES (1);",
            )
            .unwrap();
        }
        let before = std::fs::read(&path).unwrap();
        let err = LocalAdapter::open(LocalConfig::new(&dir))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("another application"), "{err}");
        assert_eq!(
            std::fs::read(&path).unwrap(),
            before,
            "foreign file not modified"
        );
        std::fs::remove_dir_all(dir).ok();
    }

    /// A database of schema 1 (queues named by text in every row), as
    /// builds before schema 2 left it: waiting, scheduled, leased and
    /// dead-lettered messages of two queues, and ids handed out past the
    /// largest left (acked messages).
    fn write_schema_1(path: &std::path::Path) {
        let c = Connection::open(path).unwrap();
        c.execute_batch(
            "PRAGMA auto_vacuum = INCREMENTAL; PRAGMA journal_mode = WAL;
             CREATE TABLE messages (
                 id INTEGER PRIMARY KEY AUTOINCREMENT, queue TEXT NOT NULL,
                 dead INTEGER NOT NULL DEFAULT 0, priority INTEGER NOT NULL DEFAULT 0,
                 visible_at INTEGER NOT NULL, deliveries INTEGER NOT NULL DEFAULT 0,
                 lease INTEGER, max_deliveries INTEGER, payload BLOB NOT NULL,
                 headers TEXT NOT NULL, msg_key TEXT, message_id TEXT,
                 enqueued_at INTEGER NOT NULL);
             CREATE INDEX messages_order ON messages (queue, dead, priority DESC, id);
             CREATE INDEX messages_visible ON messages (queue, dead, visible_at);
             CREATE INDEX messages_leased ON messages (queue, visible_at) WHERE lease IS NOT NULL;
             INSERT INTO messages (id, queue, visible_at, payload, headers, enqueued_at)
                 VALUES (90, 'acked', 0, CAST('gone' AS BLOB), '{}', 0);
             DELETE FROM messages;
             INSERT INTO messages (id, queue, priority, visible_at, payload, headers, msg_key, message_id, enqueued_at) VALUES
                 (3, 'q', 0, 0, CAST('low' AS BLOB), '{\"traceparent\":\"t1\"}', 'k1', 'm-low', 1),
                 (4, 'q', 5, 0, CAST('high' AS BLOB), '{}', NULL, NULL, 1),
                 (5, 'q', 0, 0, CAST('next' AS BLOB), '{}', NULL, NULL, 1),
                 (6, 'q', 9, 4102444800000, CAST('scheduled' AS BLOB), '{}', NULL, NULL, 1),
                 (7, 'other', 0, 0, CAST('elsewhere' AS BLOB), '{}', NULL, NULL, 1);
             INSERT INTO messages (id, queue, dead, visible_at, payload, headers, enqueued_at)
                 VALUES (8, 'q', 1, 0, CAST('dead' AS BLOB), '{\"x-ojs-dead-letter-kind\":\"test\"}', 1);
             INSERT INTO messages (id, queue, visible_at, deliveries, lease, payload, headers, enqueued_at)
                 VALUES (9, 'q', 4102444800000, 1, 77, CAST('leased' AS BLOB), '{}', 1);",
        )
        .unwrap();
        c.execute_batch(&format!(
            "PRAGMA application_id = {}; PRAGMA user_version = 1;",
            store::APPLICATION_ID
        ))
        .unwrap();
    }

    /// Opening a directory of schema 1 moves it to the current schema with nothing
    /// lost or reordered: each queue delivers what it held, in its order,
    /// scheduled and leased messages stay invisible, dead letters stay
    /// dead, and no id handed out before is given again.
    #[tokio::test]
    async fn a_schema_1_database_is_moved_to_the_current_schema_with_its_messages() {
        let dir = temp_dir("schema-1");
        write_schema_1(&dir.join(DATABASE_FILE));
        let a = LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap();
        let payloads = |batch: &[ojs_queue::Delivery]| -> Vec<String> {
            batch
                .iter()
                .map(|d| String::from_utf8(d.payload.to_vec()).unwrap())
                .collect()
        };
        let mut c = a.consumer("q", ConsumerOptions::default()).await.unwrap();
        let got = c.receive(10, Duration::ZERO).await.unwrap();
        assert_eq!(payloads(&got), ["high", "low", "next"]);
        assert_eq!(got[1].headers.get_str("traceparent"), Some("t1"));
        assert_eq!(got[1].key.as_deref(), Some(&b"k1"[..]));
        assert_eq!(got[1].message_id.as_deref(), Some("m-low"));
        let mut dead = dead_letters(&a, "q").await;
        assert_eq!(
            payloads(&dead.receive(10, Duration::ZERO).await.unwrap()),
            ["dead"]
        );
        let mut other = a
            .consumer("other", ConsumerOptions::default())
            .await
            .unwrap();
        assert_eq!(
            payloads(&other.receive(10, Duration::ZERO).await.unwrap()),
            ["elsewhere"]
        );
        a.publish("q", vec![OutgoingMessage::new("new", OJS_PROTO)])
            .await
            .unwrap();
        let (version, ids): (i64, Vec<i64>) = {
            let conn = a.inner.lock();
            let version = conn
                .query_row("PRAGMA user_version", [], |r| r.get(0))
                .unwrap();
            let ids = conn
                .prepare("SELECT id FROM messages WHERE payload = CAST('new' AS BLOB)")
                .unwrap()
                .query_map([], |r| r.get(0))
                .unwrap()
                .map(Result::unwrap)
                .collect();
            (version, ids)
        };
        assert_eq!(version, store::SCHEMA_VERSION);
        assert!(
            ids.len() == 1 && ids[0] > 90,
            "the new message's id: {ids:?}"
        );
        // The scheduled and the leased one are still there, not delivered.
        assert_eq!(
            payloads(&c.receive(10, Duration::ZERO).await.unwrap()),
            ["new"]
        );
        drop((c, dead, other));
        a.close().await.unwrap();
        drop(a);
        // Opened again, it has the current schema already and opens as it is.
        let again = LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap();
        let counts: (i64, i64) = again
            .inner
            .lock()
            .query_row(
                "SELECT (SELECT count(*) FROM messages), (SELECT count(*) FROM messages WHERE visible_at = 4102444800000)",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!(counts.1, 2, "the scheduled and the leased message");
        assert!(counts.0 >= 2, "{counts:?}");
        std::fs::remove_dir_all(dir).ok();
    }

    /// A directory of schema 2: its messages as that schema's build left
    /// them, with its two indexes over every message.
    fn write_schema_2(path: &std::path::Path) {
        let c = Connection::open(path).unwrap();
        c.execute_batch(
            "PRAGMA auto_vacuum = INCREMENTAL; PRAGMA journal_mode = WAL;
             CREATE TABLE queues (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE);
             CREATE TABLE messages (
                 id INTEGER PRIMARY KEY AUTOINCREMENT, queue_id INTEGER NOT NULL,
                 dead INTEGER NOT NULL DEFAULT 0, priority INTEGER NOT NULL DEFAULT 0,
                 visible_at INTEGER NOT NULL, deliveries INTEGER NOT NULL DEFAULT 0,
                 lease INTEGER, max_deliveries INTEGER, payload BLOB NOT NULL,
                 headers TEXT NOT NULL, msg_key TEXT, message_id TEXT,
                 enqueued_at INTEGER NOT NULL);
             CREATE INDEX messages_order ON messages (queue_id, dead, priority DESC);
             CREATE INDEX messages_visible ON messages (queue_id, dead, visible_at);
             CREATE INDEX messages_leased ON messages (queue_id, visible_at) WHERE lease IS NOT NULL;
             INSERT INTO queues (id, name) VALUES (1, 'q'), (2, 'other');
             INSERT INTO messages (id, queue_id, priority, visible_at, deliveries, lease, payload, headers, enqueued_at) VALUES
                 (3, 1, 0, 0, 0, NULL, CAST('low' AS BLOB), '{}', 1),
                 (4, 1, 5, 0, 0, NULL, CAST('high' AS BLOB), '{}', 1),
                 (5, 1, 9, 4102444800000, 0, NULL, CAST('scheduled' AS BLOB), '{}', 1),
                 (6, 1, 0, 4102444800000, 1, 77, CAST('leased' AS BLOB), '{}', 1),
                 (7, 1, 7, 1, 2, 78, CAST('expired' AS BLOB), '{}', 1),
                 (8, 2, 0, 0, 0, NULL, CAST('elsewhere' AS BLOB), '{}', 1);
             INSERT INTO messages (id, queue_id, dead, visible_at, payload, headers, enqueued_at)
                 VALUES (9, 1, 1, 0, CAST('dead' AS BLOB), '{}', 1);",
        )
        .unwrap();
        c.execute_batch(&format!(
            "PRAGMA application_id = {}; PRAGMA user_version = 2;",
            store::APPLICATION_ID
        ))
        .unwrap();
    }

    /// Opening a directory of schema 2 gives it schema 4's indexes, with
    /// nothing lost or reordered: the queue delivers what was not leased and
    /// what was leased but ran out, by priority, counted once more; what is
    /// still leased or scheduled stays invisible; dead letters stay dead.
    #[tokio::test]
    async fn a_schema_2_database_gets_the_indexes_of_schema_4() {
        let dir = temp_dir("schema-2");
        write_schema_2(&dir.join(DATABASE_FILE));
        let a = LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap();
        let (version, indexes): (i64, Vec<String>) = {
            let conn = a.inner.lock();
            let version = conn
                .query_row("PRAGMA user_version", [], |r| r.get(0))
                .unwrap();
            let indexes = conn
                .prepare(
                    "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'messages'
                     AND sql IS NOT NULL ORDER BY name",
                )
                .unwrap()
                .query_map([], |r| r.get(0))
                .unwrap()
                .map(Result::unwrap)
                .collect();
            (version, indexes)
        };
        assert_eq!(version, store::SCHEMA_VERSION);
        assert_eq!(
            indexes,
            ["messages_leased", "messages_ready", "messages_waiting"]
        );
        let mut c = a.consumer("q", ConsumerOptions::default()).await.unwrap();
        let got = c.receive(10, Duration::ZERO).await.unwrap();
        let payloads: Vec<String> = got
            .iter()
            .map(|d| String::from_utf8(d.payload.to_vec()).unwrap())
            .collect();
        assert_eq!(payloads, ["expired", "high", "low"]);
        assert_eq!(got.iter().map(|d| d.attempt).collect::<Vec<_>>(), [3, 1, 1]);
        let mut dead = dead_letters(&a, "q").await;
        assert_eq!(dead.receive(10, Duration::ZERO).await.unwrap().len(), 1);
        drop((got, c, dead));
        a.close().await.unwrap();
        std::fs::remove_dir_all(dir).ok();
    }

    /// How the index of waiting times is defined in the file.
    fn waiting_index_sql(conn: &Connection) -> String {
        conn.query_row(
            "SELECT sql FROM sqlite_master WHERE name = 'messages_waiting'",
            [],
            |r| r.get(0),
        )
        .unwrap()
    }

    /// A directory of schema 3 gets schema 4's index of delayed messages
    /// in place of its index of every message not leased by time (same
    /// name: created anew, not kept), its messages as they were.
    #[tokio::test]
    async fn a_schema_3_database_gets_the_waiting_index_of_schema_4() {
        let dir = temp_dir("schema-3");
        let path = dir.join(DATABASE_FILE);
        {
            let a = LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap();
            let mut later = OutgoingMessage::new("later", OJS_PROTO);
            later.deliver_at = Some(chrono::Utc::now() + chrono::Duration::minutes(10));
            a.publish("q", vec![OutgoingMessage::new("now", OJS_PROTO), later])
                .await
                .unwrap();
            a.close().await.unwrap();
        }
        Connection::open(&path)
            .unwrap()
            .execute_batch(
                "DROP INDEX messages_waiting;
                 CREATE INDEX messages_waiting ON messages (queue_id, dead, visible_at) WHERE lease IS NULL;
                 PRAGMA user_version = 3;",
            )
            .unwrap();
        let a = LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap();
        let (version, sql): (i64, String) = {
            let conn = a.inner.lock();
            (
                conn.query_row("PRAGMA user_version", [], |r| r.get(0))
                    .unwrap(),
                waiting_index_sql(&conn),
            )
        };
        assert_eq!(version, store::SCHEMA_VERSION);
        assert!(sql.contains("visible_at > enqueued_at"), "{sql}");
        let mut c = a.consumer("q", ConsumerOptions::default()).await.unwrap();
        let got = c.receive(10, Duration::ZERO).await.unwrap();
        assert_eq!(
            got.iter().map(|d| &d.payload[..]).collect::<Vec<_>>(),
            [&b"now"[..]],
            "the scheduled one is not due"
        );
        drop((got, c));
        a.close().await.unwrap();
        std::fs::remove_dir_all(dir).ok();
    }

    /// Headers are written as `row_headers`' BLOB; a directory of schema 4,
    /// whose rows hold them as JSON text, opens as schema 5 with its rows
    /// as they were: each delivers its headers, a dead-lettered one keeps
    /// them beside its reason (written anew as a BLOB), and a message
    /// published after it is stored as a BLOB.
    #[tokio::test]
    async fn a_schema_4_database_with_json_headers_delivers_them() {
        let dir = temp_dir("schema-4");
        let path = dir.join(DATABASE_FILE);
        let with = |n: &str| {
            let mut m = OutgoingMessage::new(n.to_owned(), OJS_PROTO);
            m.headers.insert("traceparent", format!("t-{n}"));
            m.headers.insert("x-bytes", vec![0u8, 200, 7]);
            m
        };
        {
            let a = LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap();
            a.publish("q", vec![with("one"), with("two")])
                .await
                .unwrap();
            a.close().await.unwrap();
        }
        {
            // What schema 4 wrote: the same headers as a JSON object.
            let c = Connection::open(&path).unwrap();
            let rows: Vec<(i64, Vec<u8>)> = c
                .prepare("SELECT id, headers FROM messages WHERE typeof(headers) = 'blob'")
                .unwrap()
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
                .unwrap()
                .map(Result::unwrap)
                .collect();
            assert_eq!(rows.len(), 2, "both stored as a BLOB");
            for (id, blob) in rows {
                let headers = row_headers::decode(rusqlite::types::ValueRef::Blob(&blob));
                let json = serde_json::to_string(&headers).unwrap();
                c.execute(
                    "UPDATE messages SET headers = ?2 WHERE id = ?1",
                    rusqlite::params![id, json],
                )
                .unwrap();
            }
            c.execute_batch("PRAGMA user_version = 4;").unwrap();
        }
        let a = LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap();
        let version: i64 = a
            .inner
            .lock()
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, 5);
        let mut c = a.consumer("q", ConsumerOptions::default()).await.unwrap();
        let got = c.receive(10, Duration::ZERO).await.unwrap();
        assert_eq!(got.len(), 2);
        for (d, n) in got.iter().zip(["one", "two"]) {
            assert_eq!(&d.payload[..], n.as_bytes());
            assert_eq!(d.headers, with(n).headers, "{n}");
        }
        let mut got = got.into_iter();
        let first = got.next().unwrap();
        first
            .nack(Nack::DeadLetter(ojs_queue::DeadLetterReason::new(
                "test.reason",
                "dead-lettered after the move",
            )))
            .await
            .unwrap();
        let mut dead = dead_letters(&a, "q").await;
        let back = dead.receive(10, Duration::ZERO).await.unwrap();
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].headers.get_str("traceparent"), Some("t-one"));
        assert_eq!(
            back[0]
                .headers
                .get("x-bytes")
                .map(|v| v.as_bytes().to_vec()),
            Some(vec![0u8, 200, 7])
        );
        assert!(
            back[0].headers.len() > with("one").headers.len(),
            "the reason beside them: {:?}",
            back[0].headers
        );
        a.publish("q", vec![with("three")]).await.unwrap();
        let types = texts(&a, "SELECT typeof(headers) FROM messages ORDER BY id");
        assert_eq!(
            types,
            ["blob", "text", "blob"],
            "dead-lettered, untouched, new"
        );
        drop((got, back, c, dead));
        a.close().await.unwrap();
        std::fs::remove_dir_all(dir).ok();
    }

    /// The index a consumer with nothing to claim reads holds only the
    /// messages delayed past their publish, and finds the next one due
    /// from them: a scheduled message, a retried one, whichever is first.
    /// Messages published for now are not in it.
    #[test]
    fn the_waiting_index_holds_the_delayed_messages_alone_and_finds_the_next_due() {
        let dir = temp_dir("waiting");
        let mut conn = store::open(&LocalConfig::new(&dir)).unwrap();
        let sql = waiting_index_sql(&conn);
        assert!(
            sql.ends_with("WHERE lease IS NULL AND visible_at > enqueued_at"),
            "{sql}"
        );
        // Read through the index (its condition named, as a partial index
        // needs): the messages it holds.
        let in_index = |conn: &Connection| -> i64 {
            conn.query_row(
                "SELECT count(*) FROM messages INDEXED BY messages_waiting
                 WHERE queue_id = (SELECT id FROM queues WHERE name = 'q') AND dead = 0
                   AND lease IS NULL AND visible_at > enqueued_at",
                [],
                |r| r.get(0),
            )
            .unwrap()
        };
        let now: Vec<OutgoingMessage> = (0..3)
            .map(|i| OutgoingMessage::new(format!("now{i}"), OJS_PROTO))
            .collect();
        store::insert(&mut conn, "q", &now).unwrap();
        assert_eq!(in_index(&conn), 0, "messages published for now");
        assert_eq!(store::next_visible(&conn, "q", false).unwrap(), None);
        let at = chrono::Utc::now() + chrono::Duration::minutes(10);
        let mut later = OutgoingMessage::new("later", OJS_PROTO);
        later.deliver_at = Some(at);
        store::insert(&mut conn, "q", &[later]).unwrap();
        assert_eq!(in_index(&conn), 1, "the scheduled message");
        assert_eq!(
            store::next_visible(&conn, "q", false).unwrap(),
            Some(at.timestamp_millis())
        );
        // Retried in a minute: due before the scheduled one.
        let (got, lease) =
            store::claim(&mut conn, "q", false, 1, Duration::from_secs(30), None).unwrap();
        let before = store::now_ms();
        store::retry(&mut conn, got[0].id, lease, Duration::from_secs(60)).unwrap();
        assert_eq!(in_index(&conn), 2, "the scheduled and the retried message");
        let next = store::next_visible(&conn, "q", false).unwrap().unwrap();
        assert!(
            (before + 60_000..at.timestamp_millis()).contains(&next),
            "{next} against the retry's {before} + 60 s"
        );
        // The other two published for now are claimable, and only they.
        let (rest, _) =
            store::claim(&mut conn, "q", false, 10, Duration::from_secs(30), None).unwrap();
        assert_eq!(rest.len(), 2);
        drop(conn);
        std::fs::remove_dir_all(dir).ok();
    }

    /// A database a newer build wrote is refused, untouched.
    #[tokio::test]
    async fn a_newer_schema_is_refused_untouched() {
        let dir = temp_dir("schema-newer");
        let path = dir.join(DATABASE_FILE);
        drop(LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap());
        Connection::open(&path)
            .unwrap()
            .execute_batch(&format!(
                "PRAGMA user_version = {};",
                store::SCHEMA_VERSION + 1
            ))
            .unwrap();
        let before = std::fs::read(&path).unwrap();
        let err = LocalAdapter::open(LocalConfig::new(&dir))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
        assert!(
            err.to_string().contains(&format!(
                "schema version {} is newer",
                store::SCHEMA_VERSION + 1
            )),
            "{err}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), before, "not modified");
        std::fs::remove_dir_all(dir).ok();
    }

    /// A deleted reply queue takes its name with it, and housekeeping
    /// removes the names of queues left empty, so short-lived queue names
    /// do not accumulate; a queue used again works under a new id.
    #[tokio::test]
    async fn names_of_deleted_and_empty_queues_do_not_accumulate() {
        let dir = temp_dir("queue-names");
        let a = LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap();
        let names = |a: &LocalAdapter| texts(a, "SELECT name FROM queues ORDER BY name");
        for q in ["reply-1", "reply-2", "kept", "emptied"] {
            a.publish(q, vec![OutgoingMessage::new(q.to_owned(), OJS_PROTO)])
                .await
                .unwrap();
        }
        a.delete_reply_queue("reply-1").await.unwrap();
        a.delete_reply_queue("never-used").await.unwrap();
        assert_eq!(names(&a), ["emptied", "kept", "reply-2"]);
        a.delete_reply_queue("reply-2").await.unwrap();
        let mut c = a
            .consumer("emptied", ConsumerOptions::default())
            .await
            .unwrap();
        for d in c.receive(10, Duration::ZERO).await.unwrap() {
            d.ack().await.unwrap();
        }
        blocking(&a.inner, |inner, conn| {
            store::housekeeping(conn, &inner.checkpointer)
        })
        .await
        .unwrap();
        assert_eq!(names(&a), ["kept"]);
        assert_eq!(a.depth("reply-1").await.unwrap(), Some(0));
        a.publish("emptied", vec![OutgoingMessage::new("again", OJS_PROTO)])
            .await
            .unwrap();
        let got = c.receive(10, Duration::ZERO).await.unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(&got[0].payload[..], b"again");
        assert_eq!(a.depth("kept").await.unwrap(), Some(1));
        std::fs::remove_dir_all(dir).ok();
    }

    /// Makes the store refuse every message whose payload is `bad`, on
    /// the adapter's own connection (a TEMP trigger): a publish that fails
    /// for its own rows, as a constraint would make it.
    fn refuse_bad_payloads(conn: &Connection) {
        conn.execute_batch(
            "CREATE TEMP TRIGGER refuse_bad BEFORE INSERT ON main.messages
             WHEN NEW.payload = CAST('bad' AS BLOB)
             BEGIN SELECT RAISE(ABORT, 'refused by the test'); END;",
        )
        .unwrap();
    }

    /// A publish larger than one statement's rows (two statements of 16
    /// and five rows alone) lands whole and in order, each message with
    /// its own fields; one of its rows refused fails the whole publish,
    /// whichever statement it is in.
    #[test]
    fn a_publish_of_many_statements_lands_each_message_as_sent() {
        let dir = temp_dir("many-rows");
        let mut conn = store::open(&LocalConfig::new(&dir)).unwrap();
        let messages: Vec<OutgoingMessage> = (0..37)
            .map(|i| {
                let mut m = OutgoingMessage::new(format!("m{i}"), OJS_PROTO);
                m.headers.insert("x-index", i.to_string());
                m.key = (i % 3 == 0).then(|| bytes::Bytes::from(format!("k{i}")));
                m.message_id = (i % 2 == 0).then(|| format!("id{i}"));
                m.priority = if i == 20 { 5 } else { 0 };
                if i == 30 {
                    m.deliver_at = Some(chrono::Utc::now() + chrono::Duration::minutes(10));
                }
                m
            })
            .collect();
        store::insert(&mut conn, "q", &messages).unwrap();
        let (got, _) =
            store::claim(&mut conn, "q", false, 100, Duration::from_secs(30), None).unwrap();
        let order: Vec<usize> = std::iter::once(20)
            .chain((0..37).filter(|&i| i != 20 && i != 30))
            .collect();
        assert_eq!(got.len(), order.len(), "all but the scheduled one");
        for (c, &i) in got.iter().zip(&order) {
            assert_eq!(&c.payload[..], format!("m{i}").as_bytes());
            assert_eq!(c.headers.get_str("x-index"), Some(&*i.to_string()));
            let key = (i % 3 == 0).then(|| format!("k{i}"));
            assert_eq!(c.key.as_deref(), key.as_deref().map(str::as_bytes));
            assert_eq!(c.message_id, (i % 2 == 0).then(|| format!("id{i}")));
            assert_eq!(c.deliveries, 1);
        }
        assert!(store::next_visible(&conn, "q", false).unwrap().is_some());
        refuse_bad_payloads(&conn);
        for bad in [3, 35] {
            let mut refused = messages.clone();
            refused[bad] = OutgoingMessage::new("bad", OJS_PROTO);
            let error = store::insert(&mut conn, "other", &refused).unwrap_err();
            assert!(error.to_string().contains("refused by the test"), "{error}");
            assert_eq!(
                store::depth(&conn, "other").unwrap(),
                0,
                "row {bad} refused"
            );
        }
        drop(conn);
        std::fs::remove_dir_all(dir).ok();
    }

    /// Publishes committed together are each all or nothing: one whose
    /// rows fail leaves the others of its commit on disk, and nothing of
    /// its own (`insert_publishes` directly, so the group is certain).
    #[test]
    fn one_failing_publish_of_a_group_fails_alone() {
        let dir = temp_dir("group");
        let mut conn = store::open(&LocalConfig::new(&dir)).unwrap();
        refuse_bad_payloads(&conn);
        let message = |p: &str| OutgoingMessage::new(p.to_owned(), OJS_PROTO);
        let first = [message("a1"), message("a2")];
        let failing = [message("b1"), message("bad"), message("b3")];
        let last = [message("c1")];
        let results = store::insert_publishes(
            &mut conn,
            &[("q", &first[..]), ("q", &failing[..]), ("other", &last[..])],
        )
        .unwrap();
        assert!(results[0].is_ok() && results[2].is_ok(), "{results:?}");
        let error = results[1].as_ref().unwrap_err().to_string();
        assert!(error.contains("refused by the test"), "{error}");
        let payloads: Vec<(String, String)> = conn
            .prepare(
                "SELECT q.name, CAST(m.payload AS TEXT) FROM messages m
                 JOIN queues q ON q.id = m.queue_id ORDER BY m.id",
            )
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let expected = [("q", "a1"), ("q", "a2"), ("other", "c1")];
        assert_eq!(
            payloads,
            expected.map(|(q, p)| (q.to_owned(), p.to_owned())),
            "what is on disk"
        );
        // Alone, a failing publish leaves nothing either.
        let results = store::insert_publishes(&mut conn, &[("q", &failing[..])]).unwrap();
        assert!(results[0].is_err());
        assert_eq!(store::depth(&conn, "q").unwrap(), 2);
        drop(conn);
        std::fs::remove_dir_all(dir).ok();
    }

    /// Concurrent publishes go through group commits: every
    /// good one is received, each publisher's in its order, and a refused
    /// one comes back to its caller with its messages while the publishes
    /// beside it land.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_publishes_land_each_in_order_and_fail_alone() {
        let dir = temp_dir("concurrent");
        let a = Arc::new(LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap());
        refuse_bad_payloads(&a.inner.lock());
        const PUBLISHERS: usize = 32;
        const EACH: usize = 50;
        let mut tasks = Vec::new();
        for p in 0..PUBLISHERS {
            let a = a.clone();
            tasks.push(tokio::spawn(async move {
                let mut refused = 0;
                for i in 0..EACH {
                    // Every 10th publish of every 4th publisher is refused.
                    let bad = p % 4 == 0 && i % 10 == 5;
                    let payload = if bad {
                        "bad".to_owned()
                    } else {
                        format!("{p}:{i}")
                    };
                    match a
                        .publish("q", vec![OutgoingMessage::new(payload, OJS_PROTO)])
                        .await
                    {
                        Ok(()) => assert!(!bad, "a refused message was published"),
                        Err(Error::Publish(failure)) => {
                            assert!(bad, "a good message failed: {failure}");
                            assert_eq!(failure.failed.len(), 1);
                            assert_eq!(&failure.failed[0].message.payload[..], b"bad");
                            refused += 1;
                        }
                        Err(other) => panic!("{other}"),
                    }
                }
                refused
            }));
        }
        let mut refused = 0;
        for t in tasks {
            refused += t.await.unwrap();
        }
        assert_eq!(refused, (PUBLISHERS / 4) * (EACH / 10));
        let mut consumer = a.consumer("q", ConsumerOptions::default()).await.unwrap();
        let mut next = vec![0usize; PUBLISHERS];
        let mut received = 0;
        let expected = PUBLISHERS * EACH - refused;
        while received < expected {
            let batch = consumer
                .receive(100, Duration::from_millis(200))
                .await
                .unwrap();
            assert!(!batch.is_empty(), "{received} of {expected} received");
            for d in batch {
                let text = std::str::from_utf8(&d.payload).unwrap().to_owned();
                let (p, i) = text.split_once(':').unwrap();
                let (p, i): (usize, usize) = (p.parse().unwrap(), i.parse().unwrap());
                assert!(i >= next[p], "publisher {p}: {i} after {}", next[p]);
                next[p] = i + 1;
                received += 1;
                d.ack().await.unwrap();
            }
        }
        assert!(consumer
            .receive(10, Duration::from_millis(50))
            .await
            .unwrap()
            .is_empty());
        a.close().await.unwrap();
        std::fs::remove_dir_all(dir).ok();
    }

    /// The store runs out of room (its quota, as a full disk would) while
    /// publishes are committed in groups. SQLite may roll a whole
    /// transaction back on a full database, so a group can lose what its
    /// earlier publishes wrote: every publish answered Ok must be on disk,
    /// and every one answered with an error (retryable: the store's fault)
    /// must have left nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_store_answers_every_grouped_publish_truthfully() {
        let dir = temp_dir("full");
        let mut config = LocalConfig::new(&dir);
        config.max_size_bytes = 256 * 1024;
        let a = Arc::new(LocalAdapter::open(config).await.unwrap());
        const PUBLISHERS: usize = 32;
        const EACH: usize = 20;
        let mut tasks = Vec::new();
        for p in 0..PUBLISHERS {
            let a = a.clone();
            tasks.push(tokio::spawn(async move {
                let (mut stored, mut refused) = (Vec::new(), 0);
                for i in 0..EACH {
                    let mut payload = format!("{p}:{i}:").into_bytes();
                    payload.resize(2048, b'x');
                    let message = OutgoingMessage::new(payload, OJS_PROTO);
                    match a.publish("q", vec![message]).await {
                        Ok(()) => stored.push(format!("{p}:{i}")),
                        Err(Error::Publish(failure)) => {
                            let error = &failure.failed[0].error;
                            assert!(error.is_retryable(), "{error}");
                            refused += 1;
                        }
                        Err(other) => panic!("{other}"),
                    }
                }
                (stored, refused)
            }));
        }
        let (mut stored, mut refused) = (HashSet::new(), 0);
        for t in tasks {
            let (s, r) = t.await.unwrap();
            stored.extend(s);
            refused += r;
        }
        assert!(refused > 0, "the quota was never reached");
        assert!(!stored.is_empty(), "nothing fit");
        let mut consumer = a.consumer("q", ConsumerOptions::default()).await.unwrap();
        let mut received = HashSet::new();
        loop {
            let batch = consumer
                .receive(100, Duration::from_millis(100))
                .await
                .unwrap();
            if batch.is_empty() {
                break;
            }
            for d in batch {
                let text = String::from_utf8_lossy(&d.payload);
                let id = text.rsplit_once(':').unwrap().0.to_owned();
                assert!(received.insert(id), "received twice");
            }
        }
        println!(
            "published {} · stored {} · refused {refused} · on disk {}",
            PUBLISHERS * EACH,
            stored.len(),
            received.len()
        );
        assert_eq!(
            received, stored,
            "on disk: exactly the publishes answered Ok"
        );
        a.close().await.unwrap();
        std::fs::remove_dir_all(dir).ok();
    }

    /// A new broker directory, opened, with `n` messages in queue `q`.
    fn directory_with_messages(name: &str, n: usize) -> (std::path::PathBuf, Connection) {
        let dir = temp_dir(name);
        let mut conn = store::open(&LocalConfig::new(&dir)).unwrap();
        let messages: Vec<OutgoingMessage> = (0..n)
            .map(|i| OutgoingMessage::new(format!("m{i}"), OJS_PROTO))
            .collect();
        store::insert(&mut conn, "q", &messages).unwrap();
        (dir, conn)
    }

    /// A claim is prepared once: its time and its count change on every
    /// call, and SQLite would prepare it again each time if its plan
    /// depended on them.
    #[test]
    fn a_claim_is_not_prepared_again_for_new_values() {
        let (dir, mut conn) = directory_with_messages("reprepare", 20);
        let mut claimed = 0;
        for max in [1, 2, 3, 5, 1, 4] {
            std::thread::sleep(Duration::from_millis(2));
            let (got, _) =
                store::claim(&mut conn, "q", false, max, Duration::from_secs(30), None).unwrap();
            claimed += got.len();
        }
        assert_eq!(claimed, 16);
        for sql in [store::CLAIM, store::CLAIM_EXPIRED] {
            let stmt = conn.prepare_cached(sql).unwrap();
            assert_eq!(
                stmt.get_status(rusqlite::StatementStatus::RePrepare),
                0,
                "the claim was prepared again: {sql}"
            );
        }
        drop(conn);
        std::fs::remove_dir_all(dir).ok();
    }

    /// A claim leases the messages it hands out and no other, each under
    /// its own lease, deadline and delivery limit, counted once: a claim of
    /// 35, then one of 2, of 40 messages.
    #[test]
    fn a_claim_leases_exactly_the_messages_it_hands_out() {
        let (dir, mut conn) = directory_with_messages("leases", 40);
        let leases = |conn: &Connection| -> Vec<(i64, Option<i64>, i64, Option<i64>)> {
            let mut stmt = conn
                .prepare("SELECT id, lease, deliveries, max_deliveries FROM messages ORDER BY id")
                .unwrap();
            stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
                .unwrap()
                .map(Result::unwrap)
                .collect()
        };
        let (first, lease) =
            store::claim(&mut conn, "q", false, 35, Duration::from_secs(30), Some(7)).unwrap();
        let (second, again) =
            store::claim(&mut conn, "q", false, 2, Duration::from_secs(60), None).unwrap();
        assert_eq!((first.len(), second.len()), (35, 2));
        let rows = leases(&conn);
        assert_eq!(rows.len(), 40);
        for (i, (id, held, deliveries, max)) in rows.iter().enumerate() {
            let expected = match i {
                0..35 => (Some(lease), 1, Some(7)),
                35..37 => (Some(again), 1, None),
                _ => (None, 0, None),
            };
            assert_eq!(
                (*held, *deliveries, *max),
                expected,
                "message {i} (row {id})"
            );
        }
        let ids: Vec<i64> = first.iter().chain(&second).map(|c| c.id).collect();
        assert_eq!(ids, rows[..37].iter().map(|r| r.0).collect::<Vec<_>>());
        // Each lease runs until its own deadline.
        let deadline = |lease: i64| -> (i64, i64) {
            conn.query_row(
                "SELECT min(visible_at), max(visible_at) FROM messages WHERE lease = ?1",
                [lease],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap()
        };
        let ((a, b), (c, d)) = (deadline(lease), deadline(again));
        assert_eq!(a, b, "one deadline for the whole claim");
        assert_eq!(c, d);
        assert!(c - a >= 29_000, "{a} then {c}");
        drop(conn);
        std::fs::remove_dir_all(dir).ok();
    }

    /// Every statement that looks a queue's messages up reads them through
    /// an index: none scans the whole table (a backlog of millions, or the
    /// messages in flight, would be read on every claim, wait or depth).
    #[test]
    fn every_lookup_of_a_queue_reads_an_index() {
        let dir = temp_dir("plans");
        let conn = store::open(&LocalConfig::new(&dir)).unwrap();
        let mut statements: Vec<(&str, &str)> = vec![
            ("claim", store::CLAIM),
            ("claim of expired leases", store::CLAIM_EXPIRED),
            ("depth", store::DEPTH),
            ("empty queues", store::DELETE_EMPTY_QUEUES),
        ];
        for sql in store::NEXT_VISIBLE {
            statements.push(("next visible", sql));
        }
        for sql in store::DELETE_QUEUE {
            statements.push(("delete queue", sql));
        }
        for (what, sql) in statements {
            let mut explain = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
            let unbound = std::iter::repeat_n(rusqlite::types::Null, explain.parameter_count());
            let plan: Vec<String> = explain
                .query_map(rusqlite::params_from_iter(unbound), |r| r.get(3))
                .unwrap()
                .map(Result::unwrap)
                .collect();
            assert!(
                !plan
                    .iter()
                    .any(|step| step.starts_with("SCAN messages") && !step.contains("INDEX")),
                "{what} scans the table: {plan:?}"
            );
            assert!(
                plan.iter().any(|step| step.contains("messages USING")),
                "{what} reads no index of messages: {plan:?}"
            );
            if what == "claim" {
                assert!(
                    !plan.iter().any(|step| step.contains("TEMP B-TREE")),
                    "the claim sorts: {plan:?}"
                );
            }
        }
        drop(conn);
        std::fs::remove_dir_all(dir).ok();
    }

    /// A claim hands out the most urgent messages first and counts each
    /// delivery; a lease that ran out makes its message claimable again,
    /// counted once more; past the consumer's limit it goes to the dead
    /// letters, counted afresh there.
    #[test]
    fn claims_count_deliveries_and_expired_leases_come_back() {
        let dir = temp_dir("claims");
        let mut conn = store::open(&LocalConfig::new(&dir)).unwrap();
        let mut messages: Vec<OutgoingMessage> = (0..4)
            .map(|i| OutgoingMessage::new(format!("m{i}"), OJS_PROTO))
            .collect();
        messages[2].priority = 5;
        store::insert(&mut conn, "q", &messages).unwrap();
        let bodies = |got: &[store::Claimed]| -> Vec<String> {
            got.iter()
                .map(|c| String::from_utf8_lossy(&c.payload).into_owned())
                .collect()
        };
        // Leased for no time: visible again at once.
        let (first, lease) =
            store::claim(&mut conn, "q", false, 3, Duration::ZERO, Some(2)).unwrap();
        assert_eq!(bodies(&first), ["m2", "m0", "m1"]);
        assert!(first.iter().all(|c| c.deliveries == 1));
        std::thread::sleep(Duration::from_millis(2));
        let (second, again) =
            store::claim(&mut conn, "q", false, 10, Duration::from_secs(30), Some(2)).unwrap();
        assert_ne!(lease, again);
        assert_eq!(bodies(&second), ["m2", "m0", "m1", "m3"]);
        assert_eq!(
            second.iter().map(|c| c.deliveries).collect::<Vec<_>>(),
            [2, 2, 2, 1]
        );
        // The first lease is over: its ack finds nothing.
        let acks = store::ack_many(&mut conn, &[(first[0].id, lease)]).unwrap();
        assert!(acks[0].is_err());
        // Held under the second lease: nothing more to claim.
        let (none, _) = store::claim(&mut conn, "q", false, 10, Duration::ZERO, Some(2)).unwrap();
        assert!(none.is_empty());
        // The second lease runs out at once: the three delivered twice reach
        // the limit of 2 and go to the dead letters; m3 comes back.
        let ids: Vec<(i64, i64)> = second.iter().map(|c| (c.id, again)).collect();
        store::release(&mut conn, &ids[3..]).unwrap();
        conn.execute(
            "UPDATE messages SET visible_at = 0 WHERE lease = ?1",
            [again],
        )
        .unwrap();
        let (back, _) =
            store::claim(&mut conn, "q", false, 10, Duration::from_secs(30), Some(2)).unwrap();
        assert_eq!(bodies(&back), ["m3"]);
        assert_eq!(back[0].deliveries, 2);
        let (dead, _) =
            store::claim(&mut conn, "q", true, 10, Duration::from_secs(30), None).unwrap();
        assert_eq!(bodies(&dead), ["m2", "m0", "m1"]);
        assert!(dead.iter().all(|c| c.deliveries == 1));
        drop(conn);
        std::fs::remove_dir_all(dir).ok();
    }

    /// Every publish is a commit of its own: the WAL is copied back into
    /// the file beside them (`ojs_sqlite::Checkpointer`) and starts over,
    /// and what was published is all there to receive. 12,000 commits of a
    /// page or more would be a WAL of 48 MiB had it never started over.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_wal_stays_bounded_under_a_stream_of_publishes() {
        let dir = temp_dir("checkpoints");
        let a = LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap();
        let wal = dir.join(format!("{DATABASE_FILE}-wal"));
        let body = "x".repeat(1024);
        let sent = 12_000;
        let mut largest = 0;
        for _ in 0..sent {
            a.publish("q", vec![OutgoingMessage::new(body.clone(), OJS_PROTO)])
                .await
                .unwrap();
            largest = largest.max(std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0));
        }
        let bound = 4 * ojs_sqlite::CHECKPOINT_PAGES as u64 * 4096;
        println!("largest WAL {largest} bytes (bound {bound})");
        assert!(largest < bound, "the WAL grew to {largest} bytes");
        let mut c = a.consumer("q", ConsumerOptions::default()).await.unwrap();
        let mut received = 0;
        loop {
            let got = c.receive(500, Duration::ZERO).await.unwrap();
            if got.is_empty() {
                break;
            }
            received += got.len();
            let refs: Vec<&ojs_queue::Delivery> = got.iter().collect();
            for result in ojs_queue::Delivery::ack_all(&refs).await {
                result.unwrap();
            }
        }
        assert_eq!(received, sent);
        a.close().await.unwrap();
        std::fs::remove_dir_all(dir).ok();
    }

    #[tokio::test]
    async fn priority_then_publish_order_and_scheduled_delivery() {
        let dir = temp_dir("order");
        let a = LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap();
        let mk = |body: &str, priority: i32| {
            let mut m = OutgoingMessage::new(body.to_owned(), OJS_PROTO);
            m.priority = priority;
            m
        };
        let mut later = mk("later", 100);
        later.deliver_at = Some(chrono::Utc::now() + chrono::Duration::milliseconds(800));
        a.publish(
            "q",
            vec![mk("low", -1), mk("a", 0), later, mk("high", 10), mk("b", 0)],
        )
        .await
        .unwrap();
        let mut c = a.consumer("q", ConsumerOptions::default()).await.unwrap();
        let got: Vec<String> = c
            .receive(10, Duration::ZERO)
            .await
            .unwrap()
            .into_iter()
            .map(|d| String::from_utf8(d.payload.to_vec()).unwrap())
            .collect();
        assert_eq!(
            got,
            ["high", "a", "b", "low"],
            "the scheduled one is not due yet"
        );
        let started = Instant::now();
        let later = c.receive(1, Duration::from_secs(5)).await.unwrap();
        assert_eq!(later.len(), 1);
        assert_eq!(&later[0].payload[..], b"later");
        assert!(started.elapsed() >= Duration::from_millis(300));
        std::fs::remove_dir_all(dir).ok();
    }

    /// Two processes on one directory (the daemon and a worker, say): one
    /// keeps writing while the other retries and dead-letters. A settle
    /// that read before it wrote used to fail at once with SQLITE_BUSY
    /// when the other connection committed in between (the busy timeout
    /// does not cover that), leaving the message leased for its whole
    /// visibility timeout.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn settles_succeed_while_another_connection_writes() {
        let dir = temp_dir("two-writers");
        let writer = LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap();
        let settler = LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap();
        let n = 300;
        let batch = (0..n)
            .map(|i| OutgoingMessage::new(format!("m{i}"), OJS_PROTO))
            .collect();
        settler.publish("q", batch).await.unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let noise = {
            let stop = stop.clone();
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let batch = (0..5)
                        .map(|_| OutgoingMessage::new("noise", OJS_PROTO))
                        .collect();
                    writer.publish("noise", batch).await.unwrap();
                }
            })
        };
        let mut c = settler
            .consumer("q", ConsumerOptions::default())
            .await
            .unwrap();
        let (mut settled, mut failed) = (0, Vec::new());
        while settled < n {
            for (i, d) in c
                .receive(20, Duration::from_secs(1))
                .await
                .unwrap()
                .into_iter()
                .enumerate()
            {
                let nack = if i % 2 == 0 {
                    Nack::DeadLetter(ojs_queue::DeadLetterReason::new("test", "dead"))
                } else {
                    Nack::retry_after(Duration::from_secs(3600))
                };
                if let Err(e) = d.nack(nack).await {
                    failed.push(e.to_string());
                }
                settled += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        noise.await.unwrap();
        assert!(
            failed.is_empty(),
            "{} of {n} settles failed: {:?}",
            failed.len(),
            &failed[..failed.len().min(3)]
        );
        // Every settle took effect: half are dead letters, half wait for
        // their retry; none is lost, none is still leased.
        let mut dead = dead_letters(&settler, "q").await;
        let dead_letters = dead.receive(n, Duration::from_secs(1)).await.unwrap().len();
        let waiting = settler.depth("q").await.unwrap();
        println!(
            "settled {n}: dead letters {dead_letters}, waiting to retry {waiting:?}, lost {}",
            n - dead_letters - waiting.unwrap_or(0) as usize
        );
        assert_eq!(dead_letters, n / 2);
        assert_eq!(waiting, Some((n / 2) as u64));
        std::fs::remove_dir_all(dir).ok();
    }

    fn file_bytes(dir: &std::path::Path) -> u64 {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn acked_messages_do_not_grow_the_files() {
        let dir = temp_dir("housekeeping");
        let a = LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap();
        let body = vec![b'x'; 2048];
        let mut sizes = Vec::new();
        for _round in 0..3 {
            for _ in 0..20 {
                let batch = (0..100)
                    .map(|_| OutgoingMessage::new(body.clone(), OJS_PROTO))
                    .collect();
                a.publish("q", batch).await.unwrap();
            }
            let mut c = a.consumer("q", ConsumerOptions::default()).await.unwrap();
            let mut acked = 0;
            while acked < 2000 {
                for d in c.receive(100, Duration::from_secs(1)).await.unwrap() {
                    d.ack().await.unwrap();
                    acked += 1;
                }
            }
            blocking(&a.inner, |inner, conn| {
                store::housekeeping(conn, &inner.checkpointer)
            })
            .await
            .unwrap();
            sizes.push(file_bytes(&dir));
        }
        println!("files after each round of 2000 x 2 KiB published and acked: {sizes:?} bytes");
        assert_eq!(a.depth("q").await.unwrap(), Some(0));
        assert!(
            sizes[2] <= sizes[0] + 64 * 1024,
            "files keep growing: {sizes:?}"
        );
        assert!(sizes[2] < 2000 * 2048, "acked data is released: {sizes:?}");
        std::fs::remove_dir_all(dir).ok();
    }
}
