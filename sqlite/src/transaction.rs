//! A write transaction whose ends are prepared once.

use rusqlite::Connection;

/// A write transaction (`BEGIN IMMEDIATE`, the write lock taken at once)
/// begun and committed through the connection's statement cache:
/// rusqlite's own `Transaction` runs both through `execute_batch`, which
/// parses them again each time (about 1 % of a FETCH + ACK's instructions
/// over the job store's group commits and the embedded broker's claims,
/// acks and publishes). Rolled back when dropped without a commit, or
/// after a commit that failed, as rusqlite's is.
#[derive(Debug)]
pub struct WriteTransaction<'c> {
    conn: &'c Connection,
}

impl<'c> WriteTransaction<'c> {
    /// Begins one on `conn`, which must not be in a transaction already
    /// (callers that can, take the connection `&mut` to make sure).
    pub fn begin(conn: &'c Connection) -> rusqlite::Result<Self> {
        begin_immediate(conn)?;
        Ok(WriteTransaction { conn })
    }

    /// Commits it; a failed commit is rolled back as the value drops.
    pub fn commit(self) -> rusqlite::Result<()> {
        self.conn.prepare_cached("COMMIT")?.execute([]).map(|_| ())
    }
}

/// `BEGIN IMMEDIATE` on `conn`, through its statement cache: for a writer
/// that rolled its transaction back and begins it again inside the same
/// [`WriteTransaction`].
pub fn begin_immediate(conn: &Connection) -> rusqlite::Result<()> {
    conn.prepare_cached("BEGIN IMMEDIATE")?
        .execute([])
        .map(|_| ())
}

impl std::ops::Deref for WriteTransaction<'_> {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        self.conn
    }
}

impl Drop for WriteTransaction<'_> {
    fn drop(&mut self) {
        if !self.conn.is_autocommit() {
            if let Err(error) = self.conn.execute_batch("ROLLBACK") {
                tracing::warn!(%error, "rolling a SQLite write transaction back failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> rusqlite::Result<Connection> {
        let conn = Connection::open_in_memory()?;
        conn.execute_batch("CREATE TABLE t (x INTEGER)")?;
        Ok(conn)
    }

    fn rows(conn: &Connection) -> rusqlite::Result<i64> {
        conn.query_row("SELECT count(*) FROM t", [], |r| r.get(0))
    }

    #[test]
    fn committed_writes_stay_and_dropped_ones_are_rolled_back() -> rusqlite::Result<()> {
        let conn = table()?;
        let tx = WriteTransaction::begin(&conn)?;
        assert!(!tx.is_autocommit());
        tx.execute("INSERT INTO t VALUES (1)", [])?;
        tx.commit()?;
        assert!(conn.is_autocommit());
        assert_eq!(rows(&conn)?, 1);

        let tx = WriteTransaction::begin(&conn)?;
        tx.execute("INSERT INTO t VALUES (2)", [])?;
        drop(tx);
        assert!(conn.is_autocommit(), "dropped: rolled back");
        assert_eq!(rows(&conn)?, 1);

        // Rolled back and begun again inside the same value: its commit
        // keeps only what came after.
        let tx = WriteTransaction::begin(&conn)?;
        tx.execute("INSERT INTO t VALUES (3)", [])?;
        tx.execute_batch("ROLLBACK")?;
        begin_immediate(&tx)?;
        tx.execute("INSERT INTO t VALUES (4)", [])?;
        tx.commit()?;
        let kept: Vec<i64> = conn
            .prepare("SELECT x FROM t ORDER BY x")?
            .query_map([], |r| r.get(0))?
            .collect::<rusqlite::Result<_>>()?;
        assert_eq!(kept, [1, 4]);
        Ok(())
    }

    #[test]
    fn a_commit_that_fails_is_rolled_back() -> rusqlite::Result<()> {
        let conn = table()?;
        conn.execute_batch(
            "CREATE TABLE parent (id INTEGER PRIMARY KEY);
             CREATE TABLE child (p INTEGER REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED);
             PRAGMA foreign_keys = ON;",
        )?;
        let tx = WriteTransaction::begin(&conn)?;
        tx.execute("INSERT INTO t VALUES (1)", [])?;
        // A deferred foreign key fails the commit, leaving the transaction
        // open.
        tx.execute("INSERT INTO child VALUES (7)", [])?;
        assert!(tx.commit().is_err());
        assert!(conn.is_autocommit(), "the failed commit was rolled back");
        assert_eq!(rows(&conn)?, 0);
        Ok(())
    }
}
