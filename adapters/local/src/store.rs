//! The synchronous SQLite store behind the adapter. Every function here runs
//! on a blocking thread; the adapter wraps them in `spawn_blocking`.
//!
//! One table holds every message. `visible_at` (Unix ms) folds scheduling,
//! delayed retries and leases into one column: a message is deliverable when
//! `visible_at <= now`. Claiming sets a fresh `lease` token and pushes
//! `visible_at` to the end of the visibility timeout; ack, nack and extend
//! apply only while the token matches, so a settle after the lease ended (and
//! the message went to someone else) is detected instead of corrupting state.

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use ojs_queue::{
    BrokerErrorKind, DeadLetterReason, Error, Headers, MoveTo, OutgoingMessage, Result,
};
use rusqlite::{params, Connection, OpenFlags, OptionalExtension};

use crate::config::{Durability, LocalConfig};
use crate::row_headers;

/// `PRAGMA application_id` of our databases ("OJSB"), so a foreign SQLite
/// file is recognised instead of being written to.
pub(crate) const APPLICATION_ID: i64 = 0x4F4A_5342;
/// Schema version in `PRAGMA user_version`. 5: a message's headers are
/// written as a BLOB of lengths and bytes (`row_headers`), rows of earlier
/// versions keep their JSON text and are read as they are (the version
/// says that a build which reads only JSON must not open the file); 4:
/// the index of times a message becomes deliverable holds only messages delayed past their
/// publish (scheduled, retried later, given back), not every message
/// published for now; 3: the indexes a claim and a waiting consumer read
/// hold only messages not leased; 2: messages name their queue by an
/// integer id (table `queues`); 1 named it by its text, which every step of
/// every index lookup compared as text.
pub(crate) const SCHEMA_VERSION: i64 = 5;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS queues (
    id   INTEGER PRIMARY KEY,
    name TEXT    NOT NULL UNIQUE
);
CREATE TABLE IF NOT EXISTS messages (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    queue_id    INTEGER NOT NULL,
    dead        INTEGER NOT NULL DEFAULT 0,
    priority    INTEGER NOT NULL DEFAULT 0,
    visible_at  INTEGER NOT NULL,
    deliveries  INTEGER NOT NULL DEFAULT 0,
    lease       INTEGER,
    -- max_deliveries of the consumer holding the lease (NULL = unlimited)
    max_deliveries INTEGER,
    payload     BLOB    NOT NULL,
    -- row_headers' BLOB (a JSON object as TEXT in rows from before schema
    -- 5); TEXT affinity stores a BLOB as it is
    headers     TEXT    NOT NULL,
    msg_key     TEXT,
    message_id  TEXT,
    enqueued_at INTEGER NOT NULL
);
-- Messages not leased, in delivery order (every index entry ends with the
-- row's id: publish order within a priority). A claim walks it and never
-- steps over the messages in flight; an ack finds nothing of its message
-- here to delete.
CREATE INDEX IF NOT EXISTS messages_ready ON messages (queue_id, dead, priority DESC) WHERE lease IS NULL;
-- Messages not leased and delayed past their publish, by the time they
-- become deliverable: what a consumer finding nothing to claim waits for.
-- A message published for now (most of them) is not in it, so its publish
-- and its claim each write one index entry fewer. One not leased whose time
-- is still to come is always here: its time is after now, and its publish
-- was not.
CREATE INDEX IF NOT EXISTS messages_waiting ON messages (queue_id, dead, visible_at) WHERE lease IS NULL AND visible_at > enqueued_at;
-- Only leased rows: expired leases, found without scanning the backlog.
CREATE INDEX IF NOT EXISTS messages_leased ON messages (queue_id, visible_at) WHERE lease IS NOT NULL;
";

/// From schema 2, before [`SCHEMA`]: its two indexes over every message
/// give way to schema 3's over those not leased.
const FROM_2: &str = "
DROP INDEX IF EXISTS messages_order;
DROP INDEX IF EXISTS messages_visible;
";

/// From schema 3, before [`SCHEMA`]: its index of every message not leased
/// by time gives way to schema 4's of those delayed (same name, so
/// `CREATE INDEX IF NOT EXISTS` alone would keep the old one).
const FROM_3: &str = "
DROP INDEX IF EXISTS messages_waiting;
";

/// From schema 1, before [`SCHEMA`]: the table of schema 1 steps aside
/// (its indexes dropped, their names are schema 2's).
const SET_ASIDE_1: &str = "
ALTER TABLE messages RENAME TO messages_1;
DROP INDEX messages_order;
DROP INDEX messages_visible;
DROP INDEX messages_leased;
";

/// From schema 1, after [`SCHEMA`]: the queue names move to `queues` and
/// the messages into schema 2's table, ids, order, leases and dead letters
/// kept, with the counter of ids handed out (not only the largest left: an
/// acked message's id is never given again).
const MOVE_FROM_1: &str = "
INSERT INTO queues (name) SELECT DISTINCT queue FROM messages_1 ORDER BY queue;
INSERT INTO messages (id, queue_id, dead, priority, visible_at, deliveries, lease, max_deliveries,
                      payload, headers, msg_key, message_id, enqueued_at)
    SELECT m.id, q.id, m.dead, m.priority, m.visible_at, m.deliveries, m.lease, m.max_deliveries,
           m.payload, m.headers, m.msg_key, m.message_id, m.enqueued_at
    FROM messages_1 m JOIN queues q ON q.name = m.queue;
DELETE FROM sqlite_sequence WHERE name = 'messages';
INSERT INTO sqlite_sequence (name, seq) VALUES ('messages', max(
    coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'messages_1'), 0),
    coalesce((SELECT max(id) FROM messages), 0)));
DROP TABLE messages_1;
";

pub(crate) fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// A key as stored: UTF-8 as text (what a reader of the file expects),
/// anything else as a blob, so its bytes come back as they went in.
fn key_value(key: Option<&[u8]>) -> Option<rusqlite::types::Value> {
    key.map(|k| match std::str::from_utf8(k) {
        Ok(text) => rusqlite::types::Value::Text(text.to_owned()),
        Err(_) => rusqlite::types::Value::Blob(k.to_vec()),
    })
}

fn db_error(e: rusqlite::Error) -> Error {
    use rusqlite::ErrorCode;
    // Almost nothing the store fails on is the message's fault: a full disk
    // or quota, an I/O error, a read-only file, a lock are the store's, and
    // a daemon waits them out instead of dead-lettering good messages.
    let about_the_message = matches!(
        e.sqlite_error_code(),
        Some(ErrorCode::TooBig | ErrorCode::ConstraintViolation | ErrorCode::TypeMismatch)
    );
    let kind = match e.sqlite_error_code() {
        _ if about_the_message => BrokerErrorKind::Rejected,
        Some(ErrorCode::PermissionDenied | ErrorCode::ReadOnly) => BrokerErrorKind::AccessDenied,
        Some(
            ErrorCode::DiskFull
            | ErrorCode::SystemIoFailure
            | ErrorCode::DatabaseBusy
            | ErrorCode::DatabaseLocked
            | ErrorCode::OutOfMemory,
        ) => BrokerErrorKind::Unavailable,
        _ => BrokerErrorKind::Other,
    };
    Error::broker("local", e.to_string(), !about_the_message)
        .with_broker_kind(kind)
        .with_source(e)
}

fn foreign(path: &Path, why: &str) -> Error {
    Error::InvalidConfig {
        field: "path".into(),
        reason: format!(
            "{} is not an ojs-bridge local queue database ({why}); point local:// at an empty or ojs-bridge directory",
            path.display()
        ),
    }
}

/// Opens (creating when needed) the database of `config`.
pub(crate) fn open(config: &LocalConfig) -> Result<Connection> {
    std::fs::create_dir_all(&config.path).map_err(|e| Error::InvalidConfig {
        field: "path".into(),
        reason: format!("cannot create {}: {e}", config.path.display()),
    })?;
    let path = config.database_path();
    let mut conn = ojs_sqlite::open(
        &path,
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| foreign(&path, &e.to_string()))?;
    conn.busy_timeout(Duration::from_millis(config.busy_timeout_ms))
        .map_err(db_error)?;
    // Reading the header is the first thing that fails on a corrupt or
    // non-SQLite file.
    let app_id: i64 = conn
        .query_row("PRAGMA application_id", [], |r| r.get(0))
        .map_err(|e| foreign(&path, &e.to_string()))?;
    let tables: i64 = conn
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table'",
            [],
            |r| r.get(0),
        )
        .map_err(|e| foreign(&path, &e.to_string()))?;
    if app_id != APPLICATION_ID && (app_id != 0 || tables > 0) {
        return Err(foreign(&path, "it belongs to another application"));
    }
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(db_error)?;
    if version > SCHEMA_VERSION {
        return Err(foreign(
            &path,
            &format!("schema version {version} is newer than this build's {SCHEMA_VERSION}"),
        ));
    }
    // auto_vacuum must be chosen before the first table exists.
    conn.execute_batch("PRAGMA auto_vacuum = INCREMENTAL;")
        .map_err(db_error)?;
    conn.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))
        .map_err(db_error)?;
    if config.max_size_bytes > 0 {
        let page: i64 = conn
            .query_row("PRAGMA page_size", [], |r| r.get(0))
            .map_err(db_error)?;
        let pages = (config.max_size_bytes / page.max(1) as u64).max(1);
        conn.query_row(&format!("PRAGMA max_page_count = {pages}"), [], |_| Ok(()))
            .map_err(db_error)?;
    }
    let sync = match config.durability {
        Durability::Process => "NORMAL",
        Durability::Power => "FULL",
    };
    conn.execute_batch(&format!("PRAGMA synchronous = {sync};"))
        .map_err(db_error)?;
    prepare_schema(&mut conn, &path)?;
    // Plans that do not depend on bound values: otherwise SQLite prepares
    // a claim again on every call (its time and its LIMIT change, and the
    // planner had looked at them), a thirtieth of the daemon's CPU under
    // FETCH + ACK. The claim names its index; the others look up keys.
    conn.set_db_config(
        rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG,
        true,
    )
    .map_err(db_error)?;
    Ok(conn)
}

/// Brings the schema to [`SCHEMA_VERSION`] in one transaction that holds
/// the write lock and reads the version again: of two processes opening a
/// directory at once, one migrates and the other finds it done.
fn prepare_schema(conn: &mut Connection, path: &Path) -> Result<()> {
    let tx = write_transaction(conn)?;
    let version: i64 = tx
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(db_error)?;
    if version > SCHEMA_VERSION {
        return Err(foreign(
            path,
            &format!("schema version {version} is newer than this build's {SCHEMA_VERSION}"),
        ));
    }
    if version == 1 {
        tx.execute_batch(SET_ASIDE_1).map_err(db_error)?;
    }
    if version == 2 {
        tx.execute_batch(FROM_2).map_err(db_error)?;
    }
    if version == 2 || version == 3 {
        tx.execute_batch(FROM_3).map_err(db_error)?;
    }
    tx.execute_batch(SCHEMA).map_err(db_error)?;
    if version == 1 {
        let messages: i64 = tx
            .query_row("SELECT count(*) FROM messages_1", [], |r| r.get(0))
            .map_err(db_error)?;
        tx.execute_batch(MOVE_FROM_1).map_err(db_error)?;
        tracing::info!(
            path = %path.display(),
            messages,
            "moved the embedded broker's database from schema 1 to {SCHEMA_VERSION}"
        );
    } else if version > 0 && version < SCHEMA_VERSION {
        tracing::info!(
            path = %path.display(),
            from = version,
            to = SCHEMA_VERSION,
            "the embedded broker's database has its new schema"
        );
    }
    tx.execute_batch(&format!(
        "PRAGMA application_id = {APPLICATION_ID}; PRAGMA user_version = {SCHEMA_VERSION};"
    ))
    .map_err(db_error)?;
    tx.commit().map_err(db_error)
}

/// A second connection to the database of `config` (opened by [`open`]
/// first), for its checkpoints.
pub(crate) fn open_checkpoints(config: &LocalConfig) -> Result<Connection> {
    let conn = ojs_sqlite::open(
        &config.database_path(),
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(db_error)?;
    conn.busy_timeout(Duration::from_millis(config.busy_timeout_ms))
        .map_err(db_error)?;
    Ok(conn)
}

/// A transaction that writes, holding the write lock from its start. A
/// deferred one that reads before it writes fails at once with
/// `SQLITE_BUSY` when another connection (another process on the same
/// directory) committed in between: the busy timeout does not cover that
/// upgrade, and a settle lost that way left its message leased for the
/// whole visibility timeout. Taken at the start, the lock waits out other
/// writers for up to the busy timeout.
fn write_transaction(conn: &mut Connection) -> Result<ojs_sqlite::WriteTransaction<'_>> {
    // `&mut`: no transaction of this connection's is open.
    ojs_sqlite::WriteTransaction::begin(conn).map_err(db_error)
}

/// Inserts a batch in one transaction: all on disk, or none.
#[cfg(test)]
pub(crate) fn insert(
    conn: &mut Connection,
    queue: &str,
    messages: &[OutgoingMessage],
) -> Result<()> {
    insert_publishes(conn, &[(queue, messages)])?
        .pop()
        .unwrap_or(Ok(()))
}

/// Inserts several publishes in one transaction (one commit), each in a
/// savepoint of its own: a publish is all on disk or none, and one whose
/// rows fail fails alone. One result per publish, in order; `Err` when
/// the transaction itself failed (nothing of any publish is on disk).
pub(crate) fn insert_publishes(
    conn: &mut Connection,
    publishes: &[(&str, &[OutgoingMessage])],
) -> Result<Vec<Result<()>>> {
    let now = now_ms();
    let tx = write_transaction(conn)?;
    let mut results = Vec::with_capacity(publishes.len());
    if let [(queue, messages)] = publishes {
        // Alone, the transaction is the publish's all or nothing; a
        // failure rolls it back when `tx` is dropped.
        if let Err(e) = insert_rows(&tx, queue, messages, now) {
            return Ok(vec![Err(e)]);
        }
        results.push(Ok(()));
    } else {
        for (queue, messages) in publishes {
            let step = |sql: &str| tx.prepare_cached(sql).and_then(|mut s| s.execute([]));
            step("SAVEPOINT publish").map_err(db_error)?;
            match insert_rows(&tx, queue, messages, now) {
                Ok(()) => results.push(Ok(())),
                Err(e) => {
                    step("ROLLBACK TO publish").map_err(db_error)?;
                    results.push(Err(e));
                }
            }
            step("RELEASE publish").map_err(db_error)?;
        }
    }
    tx.commit().map_err(db_error)?;
    Ok(results)
}

/// The id of `queue`, or `None` when nothing was ever published to it
/// (or everything in it is gone and housekeeping removed its name).
fn queue_id(conn: &Connection, queue: &str) -> Result<Option<i64>> {
    conn.prepare_cached("SELECT id FROM queues WHERE name = ?1")
        .and_then(|mut s| s.query_row([queue], |r| r.get(0)).optional())
        .map_err(db_error)
}

/// The id of `queue`, its name added when it has none, in the publish's
/// transaction or savepoint: a publish that fails leaves no name behind.
fn add_queue(conn: &Connection, queue: &str) -> Result<i64> {
    if let Some(id) = queue_id(conn, queue)? {
        return Ok(id);
    }
    conn.prepare_cached("INSERT INTO queues (name) VALUES (?1)")
        .and_then(|mut s| s.execute([queue]))
        .map_err(db_error)?;
    Ok(conn.last_insert_rowid())
}

/// A publish's insert up to its rows of values: the columns it writes,
/// in [`bind_row`]'s order.
macro_rules! insert_into_messages {
    () => {
        "INSERT INTO messages (queue_id, priority, visible_at, payload, headers, msg_key, message_id, enqueued_at) VALUES "
    };
}
/// One row of values: a `?` a column of [`insert_into_messages`].
macro_rules! insert_row {
    () => {
        "(?, ?, ?, ?, ?, ?, ?, ?)"
    };
}
const INSERT_COLUMNS: usize = 8;
const INSERT_ONE: &str = concat!(insert_into_messages!(), insert_row!());
/// Rows one statement of a larger publish writes. Each statement run opens
/// its cursors on the table and its indexes and reads and rewrites the
/// table's id counter (`AUTOINCREMENT`) once, whatever its rows: a publish
/// of 512 messages runs 32 statements, not 512.
const ROWS_PER_INSERT: usize = 16;

/// [`INSERT_ONE`] with [`ROWS_PER_INSERT`] rows of values.
fn insert_many() -> &'static str {
    static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SQL.get_or_init(|| {
        format!(
            "{}{}",
            insert_into_messages!(),
            [insert_row!(); ROWS_PER_INSERT].join(", ")
        )
    })
}

fn insert_rows(tx: &Connection, queue: &str, messages: &[OutgoingMessage], now: i64) -> Result<()> {
    let queue_id = add_queue(tx, queue)?;
    let mut chunks = messages.chunks_exact(ROWS_PER_INSERT);
    if messages.len() >= ROWS_PER_INSERT {
        let mut many = tx.prepare_cached(insert_many()).map_err(db_error)?;
        for chunk in &mut chunks {
            for (row, m) in chunk.iter().enumerate() {
                bind_row(&mut many, row * INSERT_COLUMNS, m, queue_id, now)?;
            }
            many.raw_execute().map_err(db_error)?;
        }
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut one = tx.prepare_cached(INSERT_ONE).map_err(db_error)?;
        for m in rest {
            bind_row(&mut one, 0, m, queue_id, now)?;
            one.raw_execute().map_err(db_error)?;
        }
    }
    Ok(())
}

/// Binds one message's values to the row of `stmt` whose first `?` follows
/// parameter `before`.
fn bind_row(
    stmt: &mut rusqlite::Statement<'_>,
    before: usize,
    m: &OutgoingMessage,
    queue_id: i64,
    now: i64,
) -> Result<()> {
    let visible_at = m.deliver_at.map_or(now, |t| t.timestamp_millis().max(now));
    let headers = row_headers::encode(&m.headers);
    let at = before + 1;
    (|| {
        stmt.raw_bind_parameter(at, queue_id)?;
        stmt.raw_bind_parameter(at + 1, m.priority)?;
        stmt.raw_bind_parameter(at + 2, visible_at)?;
        stmt.raw_bind_parameter(at + 3, m.payload.as_ref())?;
        stmt.raw_bind_parameter(at + 4, headers)?;
        stmt.raw_bind_parameter(at + 5, key_value(m.key.as_deref()))?;
        stmt.raw_bind_parameter(at + 6, &m.message_id)?;
        stmt.raw_bind_parameter(at + 7, now)
    })()
    .map_err(db_error)
}

/// A claimed message.
pub(crate) struct Claimed {
    pub id: i64,
    pub payload: Bytes,
    pub headers: Headers,
    pub key: Option<Bytes>,
    pub message_id: Option<String>,
    pub deliveries: u32,
}

impl Claimed {
    /// The message as a delivery of `queue`, settled through `acker`.
    pub(crate) fn into_delivery(
        self,
        queue: std::sync::Arc<str>,
        acker: Box<dyn ojs_queue::Acknowledger>,
    ) -> ojs_queue::Delivery {
        let mut d =
            ojs_queue::Delivery::new(self.payload, self.headers, self.deliveries, queue, acker);
        d.key = self.key;
        d.message_id = self.message_id;
        d
    }
}

/// The messages not leased that a claim takes, in delivery order: highest
/// priority, then oldest. Read first and then leased one by one by their
/// row id: an `UPDATE … WHERE id IN (SELECT …) RETURNING …` built two
/// temporary B-trees a claim (the subquery's ids, the returned rows), each
/// with a page cache of its own opened and freed, and gave its rows in no
/// order.
pub(crate) const CLAIM: &str =
    "SELECT id, payload, headers, msg_key, message_id, deliveries, priority
     FROM messages INDEXED BY messages_ready
     WHERE queue_id = ?1 AND dead = ?2 AND lease IS NULL AND visible_at <= ?3
     ORDER BY priority DESC, id LIMIT ?4";

/// Leased messages whose lease ran out, in the same order: claimable again.
/// Few, usually none: their index is read from the queue's oldest deadline
/// up to now.
pub(crate) const CLAIM_EXPIRED: &str =
    "SELECT id, payload, headers, msg_key, message_id, deliveries, priority
     FROM messages INDEXED BY messages_leased
     WHERE queue_id = ?1 AND lease IS NOT NULL AND visible_at <= ?3 AND dead = ?2
     ORDER BY priority DESC, id LIMIT ?4";

/// Leases one claimed message (by its row id, in the claim's transaction).
const LEASE: &str = "UPDATE messages SET lease = ?2, visible_at = ?3, deliveries = deliveries + 1, max_deliveries = ?4
     WHERE id = ?1";

/// Claims up to `max` deliverable messages under a new lease. With
/// `max_deliveries`, messages already delivered that often are moved to the
/// dead letters first. Returns the messages and the lease token.
pub(crate) fn claim(
    conn: &mut Connection,
    queue: &str,
    dead: bool,
    max: usize,
    visibility: Duration,
    max_deliveries: Option<u32>,
) -> Result<(Vec<Claimed>, i64)> {
    let now = now_ms();
    let lease = uuid::Uuid::new_v4().as_u64_pair().0 as i64;
    let tx = write_transaction(conn)?;
    let Some(queue_id) = queue_id(&tx, queue)? else {
        // Nothing was published to it: nothing to claim or sweep.
        return Ok((Vec::new(), lease));
    };
    // Expired leases of messages that reached their consumer's limit go to
    // the dead letters before anything is claimed (from the queue or the
    // dead letters), so neither reader sees them in the wrong place.
    sweep_exhausted(&tx, queue_id, now)?;
    // Dead letters are never dead-lettered again.
    let max_deliveries = if dead { None } else { max_deliveries };
    // INDEXED BY: walking the (priority, id) order and skipping the few
    // invisible rows (scheduled, retried later) beats the planner's choice
    // of sorting every visible row. The messages not leased and those whose
    // lease ran out are each read in that order and merged: the first `max`
    // of both.
    let claimed = deliverable(&tx, queue_id, dead, now, max)?;
    if !claimed.is_empty() {
        let deadline = now.saturating_add(visibility.as_millis() as i64);
        let mut stmt = tx.prepare_cached(LEASE).map_err(db_error)?;
        for c in &claimed {
            stmt.execute(params![c.id, lease, deadline, max_deliveries])
                .map_err(db_error)?;
        }
    }
    tx.commit().map_err(db_error)?;
    Ok((claimed, lease))
}

/// Takes up to `max` deliverable messages of `queue` as [`claim`] would,
/// hands them to `plan`, and in the same transaction publishes what `plan`
/// made of each (one `MoveTo` a message, in order) and removes it, or
/// moves it to the dead letters: no lease, no ack, one commit. A message
/// larger than `max_bytes` goes to the dead letters instead
/// (`PayloadTooLarge`, as a publish refuses it). Any failure leaves every
/// message where it was. Returns, in order, whether each message taken was
/// published (`false`: dead-lettered).
pub(crate) fn move_batch(
    conn: &mut Connection,
    queue: &str,
    max: usize,
    max_bytes: usize,
    plan: impl FnOnce(Vec<Claimed>) -> Vec<MoveTo>,
) -> Result<Vec<bool>> {
    let now = now_ms();
    let tx = write_transaction(conn)?;
    let Some(queue_id) = queue_id(&tx, queue)? else {
        return Ok(Vec::new());
    };
    sweep_exhausted(&tx, queue_id, now)?;
    let taken = deliverable(&tx, queue_id, false, now, max)?;
    if taken.is_empty() {
        return Ok(Vec::new());
    }
    let rows: Vec<(i64, Headers)> = taken.iter().map(|c| (c.id, c.headers.clone())).collect();
    let planned = plan(taken);
    if planned.len() != rows.len() {
        return Err(Error::broker(
            "local",
            format!(
                "a move planned {} messages of the {} it took",
                planned.len(),
                rows.len()
            ),
            false,
        ));
    }
    // Publishes by destination queue, in the order they were taken.
    let mut by_queue: Vec<(String, Vec<OutgoingMessage>)> = Vec::new();
    let mut published = Vec::with_capacity(rows.len());
    let mut gone = Vec::with_capacity(rows.len());
    for ((id, mut headers), to) in rows.into_iter().zip(planned) {
        let reason = match to {
            MoveTo::Queue { queue, message } => match message.check_size(max_bytes) {
                Ok(()) => {
                    match by_queue.iter_mut().find(|(q, _)| *q == queue) {
                        Some((_, messages)) => messages.push(message),
                        None => by_queue.push((queue, vec![message])),
                    }
                    published.push(true);
                    gone.push(id);
                    continue;
                }
                Err(e) => {
                    DeadLetterReason::of(ojs_queue::DeadLetterKind::PayloadTooLarge, e.to_string())
                }
            },
            MoveTo::DeadLetter(reason) => reason,
        };
        reason.write_headers(&mut headers);
        move_to_dead(&tx, id, &headers)?;
        published.push(false);
    }
    for (queue, messages) in &by_queue {
        insert_rows(&tx, queue, messages, now)?;
    }
    {
        let mut delete = tx
            .prepare_cached("DELETE FROM messages WHERE id = ?1")
            .map_err(db_error)?;
        for id in gone {
            delete.execute([id]).map_err(db_error)?;
        }
    }
    tx.commit().map_err(db_error)?;
    Ok(published)
}

/// The first `max` messages of a queue (or its dead letters) a claim
/// takes, in delivery order: those not leased and those whose lease ran
/// out, each read in that order from its own index and merged.
fn deliverable(
    tx: &Connection,
    queue_id: i64,
    dead: bool,
    now: i64,
    max: usize,
) -> Result<Vec<Claimed>> {
    let ready = claimable(tx, CLAIM, queue_id, dead, now, max)?;
    let expired = claimable(tx, CLAIM_EXPIRED, queue_id, dead, now, max)?;
    Ok(if expired.is_empty() {
        ready.into_iter().map(|(c, _)| c).collect()
    } else {
        let mut both: Vec<(Claimed, i64)> = ready.into_iter().chain(expired).collect();
        both.sort_by_key(|(c, priority)| (std::cmp::Reverse(*priority), c.id));
        both.into_iter().take(max).map(|(c, _)| c).collect()
    })
}

/// Up to `max` messages of `sql` ([`CLAIM`] or [`CLAIM_EXPIRED`]), each
/// with its priority.
fn claimable(
    conn: &Connection,
    sql: &str,
    queue_id: i64,
    dead: bool,
    now: i64,
    max: usize,
) -> Result<Vec<(Claimed, i64)>> {
    let mut stmt = conn.prepare_cached(sql).map_err(db_error)?;
    let rows = stmt
        .query_map(params![queue_id, dead, now, max as i64], |r| {
            Ok((
                Claimed {
                    id: r.get(0)?,
                    payload: Bytes::from(r.get::<_, Vec<u8>>(1)?),
                    headers: row_headers::decode(r.get_ref(2)?),
                    key: match r.get_ref(3)? {
                        rusqlite::types::ValueRef::Text(b) | rusqlite::types::ValueRef::Blob(b) => {
                            Some(Bytes::copy_from_slice(b))
                        }
                        _ => None,
                    },
                    message_id: r.get(4)?,
                    // This claim is its next delivery.
                    deliveries: u32::try_from(r.get::<_, i64>(5)?.saturating_add(1))
                        .unwrap_or(u32::MAX),
                },
                r.get(6)?,
            ))
        })
        .map_err(db_error)?;
    rows.collect::<rusqlite::Result<_>>().map_err(db_error)
}

fn sweep_exhausted(conn: &Connection, queue_id: i64, now: i64) -> Result<()> {
    let exhausted: Vec<(i64, Headers, i64)> = {
        let mut stmt = conn
            .prepare_cached(
                "SELECT id, headers, deliveries FROM messages INDEXED BY messages_leased
                 WHERE queue_id = ?1 AND lease IS NOT NULL AND visible_at <= ?2 AND dead = 0
                   AND max_deliveries IS NOT NULL AND deliveries >= max_deliveries",
            )
            .map_err(db_error)?;
        let rows = stmt
            .query_map(params![queue_id, now], |r| {
                Ok((r.get(0)?, row_headers::decode(r.get_ref(1)?), r.get(2)?))
            })
            .map_err(db_error)?;
        rows.collect::<rusqlite::Result<_>>().map_err(db_error)?
    };
    for (id, mut headers, deliveries) in exhausted {
        exhausted_reason(deliveries).write_headers(&mut headers);
        move_to_dead(conn, id, &headers)?;
    }
    Ok(())
}

fn exhausted_reason(deliveries: i64) -> DeadLetterReason {
    DeadLetterReason::of(
        ojs_queue::DeadLetterKind::MaxDeliveries,
        format!("delivered {deliveries} times without being acknowledged"),
    )
}

fn move_to_dead(conn: &Connection, id: i64, headers: &Headers) -> Result<()> {
    let stored = row_headers::encode(headers);
    conn.prepare_cached(
        "UPDATE messages SET dead = 1, lease = NULL, max_deliveries = NULL, visible_at = 0, deliveries = 0, headers = ?2 WHERE id = ?1",
    )
    .and_then(|mut s| s.execute(params![id, stored]))
    .map_err(db_error)?;
    Ok(())
}

/// The next message not leased to become deliverable, and the next lease
/// to run out, of a queue: each read from its own index.
pub(crate) const NEXT_VISIBLE: [&str; 2] = [
    "SELECT visible_at FROM messages INDEXED BY messages_waiting
     WHERE queue_id = (SELECT id FROM queues WHERE name = ?1) AND dead = ?2 AND lease IS NULL
       AND visible_at > enqueued_at AND visible_at > ?3
     ORDER BY visible_at LIMIT 1",
    "SELECT visible_at FROM messages INDEXED BY messages_leased
     WHERE queue_id = (SELECT id FROM queues WHERE name = ?1) AND lease IS NOT NULL
       AND visible_at > ?3 AND dead = ?2
     ORDER BY visible_at LIMIT 1",
];

/// The earliest time a message of the queue becomes deliverable.
pub(crate) fn next_visible(conn: &Connection, queue: &str, dead: bool) -> Result<Option<i64>> {
    let now = now_ms();
    let mut earliest: Option<i64> = None;
    for sql in NEXT_VISIBLE {
        let at: Option<i64> = conn
            .prepare_cached(sql)
            .and_then(|mut s| {
                s.query_row(params![queue, dead, now], |r| r.get(0))
                    .optional()
            })
            .map_err(db_error)?;
        earliest = match (earliest, at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
    Ok(earliest)
}

/// Deletes many acked messages in one transaction (group commit); one result
/// per `(id, lease)`, in order.
pub(crate) fn ack_many(conn: &mut Connection, acks: &[(i64, i64)]) -> Result<Vec<Result<()>>> {
    let tx = write_transaction(conn)?;
    let mut results = Vec::with_capacity(acks.len());
    {
        let mut stmt = tx
            .prepare_cached("DELETE FROM messages WHERE id = ?1 AND lease = ?2")
            .map_err(db_error)?;
        for (id, lease) in acks {
            let n = stmt.execute(params![id, lease]).map_err(db_error)?;
            results.push(if n == 1 {
                Ok(())
            } else {
                Err(Error::DeliveryExpired)
            });
        }
    }
    tx.commit().map_err(db_error)?;
    Ok(results)
}

pub(crate) fn retry(conn: &mut Connection, id: i64, lease: i64, delay: Duration) -> Result<()> {
    let tx = write_transaction(conn)?;
    // The headers are read as stored and decoded only for a move to the
    // dead letters: a retry leaves them as they are.
    let row: Option<(rusqlite::types::Value, i64, Option<i64>)> = tx
        .prepare_cached(
            "SELECT headers, deliveries, max_deliveries FROM messages WHERE id = ?1 AND lease = ?2",
        )
        .and_then(|mut s| {
            s.query_row(params![id, lease], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })
            .optional()
        })
        .map_err(db_error)?;
    let Some((stored, deliveries, max_deliveries)) = row else {
        return Err(Error::DeliveryExpired);
    };
    if max_deliveries.is_some_and(|max| deliveries >= max) {
        let mut headers = row_headers::decode((&stored).into());
        exhausted_reason(deliveries).write_headers(&mut headers);
        move_to_dead(&tx, id, &headers)?;
    } else {
        // Rounded up to the next whole millisecond after the truncated clock
        // reading, so a delayed message never becomes visible early.
        let at = now_ms().saturating_add(delay.as_micros().div_ceil(1000) as i64 + 1);
        tx.prepare_cached("UPDATE messages SET lease = NULL, visible_at = ?2 WHERE id = ?1")
            .and_then(|mut s| s.execute(params![id, at]))
            .map_err(db_error)?;
    }
    tx.commit().map_err(db_error)
}

pub(crate) fn dead_letter(
    conn: &mut Connection,
    id: i64,
    lease: i64,
    reason: &DeadLetterReason,
) -> Result<()> {
    let tx = write_transaction(conn)?;
    let headers: Option<Headers> = tx
        .prepare_cached("SELECT headers FROM messages WHERE id = ?1 AND lease = ?2")
        .and_then(|mut s| {
            s.query_row(params![id, lease], |r| {
                Ok(row_headers::decode(r.get_ref(0)?))
            })
            .optional()
        })
        .map_err(db_error)?;
    let Some(mut headers) = headers else {
        return Err(Error::DeliveryExpired);
    };
    reason.write_headers(&mut headers);
    move_to_dead(&tx, id, &headers)?;
    tx.commit().map_err(db_error)
}

pub(crate) fn extend(conn: &Connection, id: i64, lease: i64, by: Duration) -> Result<()> {
    let at = now_ms().saturating_add(by.as_millis() as i64);
    let n = conn
        .prepare_cached("UPDATE messages SET visible_at = ?3 WHERE id = ?1 AND lease = ?2")
        .and_then(|mut s| s.execute(params![id, lease, at]))
        .map_err(db_error)?;
    if n == 1 {
        Ok(())
    } else {
        Err(Error::DeliveryExpired)
    }
}

/// Makes a leased message deliverable now without counting the delivery
/// (`Nack::Release`: it was looked at, not attempted).
pub(crate) fn give_back(conn: &mut Connection, id: i64, lease: i64) -> Result<()> {
    let n = conn
        .prepare_cached(
            "UPDATE messages SET lease = NULL, visible_at = ?3, deliveries = max(deliveries - 1, 0) WHERE id = ?1 AND lease = ?2",
        )
        .and_then(|mut s| s.execute(params![id, lease, now_ms()]))
        .map_err(db_error)?;
    if n == 1 {
        Ok(())
    } else {
        Err(Error::DeliveryExpired)
    }
}

/// Makes leased messages deliverable now (their consumer went away).
pub(crate) fn release(conn: &mut Connection, leases: &[(i64, i64)]) -> Result<()> {
    let tx = write_transaction(conn)?;
    {
        let mut stmt = tx
            .prepare_cached(
                "UPDATE messages SET lease = NULL, visible_at = ?3 WHERE id = ?1 AND lease = ?2",
            )
            .map_err(db_error)?;
        let now = now_ms();
        for (id, lease) in leases {
            stmt.execute(params![id, lease, now]).map_err(db_error)?;
        }
    }
    tx.commit().map_err(db_error)
}

/// Messages waiting in a queue: those not leased and those whose lease ran
/// out, each counted from its own index.
pub(crate) const DEPTH: &str = "SELECT
    (SELECT count(*) FROM messages INDEXED BY messages_ready
     WHERE queue_id = (SELECT id FROM queues WHERE name = ?1) AND dead = 0 AND lease IS NULL)
  + (SELECT count(*) FROM messages INDEXED BY messages_leased
     WHERE queue_id = (SELECT id FROM queues WHERE name = ?1) AND lease IS NOT NULL
       AND visible_at <= ?2 AND dead = 0)";

/// Messages waiting (not leased) in the queue.
pub(crate) fn depth(conn: &Connection, queue: &str) -> Result<u64> {
    conn.prepare_cached(DEPTH)
        .and_then(|mut s| s.query_row(params![queue, now_ms()], |r| r.get::<_, i64>(0)))
        .map(|n| n.max(0) as u64)
        .map_err(db_error)
}

/// A queue's messages not leased and those leased, each found through its
/// own index (no index holds both).
pub(crate) const DELETE_QUEUE: [&str; 2] = [
    "DELETE FROM messages WHERE queue_id = ?1 AND lease IS NULL",
    "DELETE FROM messages WHERE queue_id = ?1 AND lease IS NOT NULL",
];

/// Queues without a message, leased or not.
pub(crate) const DELETE_EMPTY_QUEUES: &str = "DELETE FROM queues
     WHERE NOT EXISTS (SELECT 1 FROM messages WHERE queue_id = queues.id AND lease IS NULL)
       AND NOT EXISTS (SELECT 1 FROM messages WHERE queue_id = queues.id AND lease IS NOT NULL)";

/// Removes everything in `queue`, dead letters and leased messages too (a
/// reply queue its client is done with), and its name.
pub(crate) fn delete_queue(conn: &mut Connection, queue: &str) -> Result<u64> {
    let tx = write_transaction(conn)?;
    let Some(queue_id) = queue_id(&tx, queue)? else {
        return Ok(0);
    };
    let mut deleted = 0;
    for sql in DELETE_QUEUE {
        deleted += tx
            .prepare_cached(sql)
            .and_then(|mut s| s.execute([queue_id]))
            .map_err(db_error)?;
    }
    tx.prepare_cached("DELETE FROM queues WHERE id = ?1")
        .and_then(|mut s| s.execute([queue_id]))
        .map_err(db_error)?;
    tx.commit().map_err(db_error)?;
    Ok(deleted as u64)
}

/// Returns free pages to the file system and folds the WAL back, so that
/// acked messages do not leave the files growing. The WAL is truncated
/// through `checkpoints`, which waits for its thread's pass (a truncation
/// during one did nothing).
pub(crate) fn housekeeping(
    conn: &Connection,
    checkpoints: &ojs_sqlite::Checkpointer,
) -> Result<()> {
    // Names of queues left empty go, so that a stream of short-lived queue
    // names (reply queues) does not grow the table; a queue published to
    // again gets a new id. One statement: atomic against other processes.
    // Its failure does not keep the pages and the WAL from being returned.
    if let Err(e) = conn.execute(DELETE_EMPTY_QUEUES, []) {
        tracing::warn!(error = %e, "the names of empty queues were not removed; the next housekeeping tries again");
    }
    // The pragma frees one page per step: step it until it is done.
    let mut stmt = conn
        .prepare("PRAGMA incremental_vacuum")
        .map_err(db_error)?;
    let mut rows = stmt.query([]).map_err(db_error)?;
    while rows.next().map_err(db_error)?.is_some() {}
    drop(rows);
    drop(stmt);
    if !checkpoints.truncate(conn).map_err(db_error)? {
        tracing::debug!(
            "the WAL was not truncated: a reader still uses it, or a checkpoint pass did not end in time; the next housekeeping tries again"
        );
    }
    Ok(())
}
