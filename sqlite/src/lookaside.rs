//! The size of a connection's lookaside: SQLite's pool of small
//! allocations, one per connection, that its statements' values, cursors
//! and expression nodes take before they fall back to `malloc`.
//!
//! SQLite's default pool (100 slots of 1,200 bytes, 120 KiB) is enough for
//! a connection that keeps a few statements prepared. A writer that keeps
//! large ones too (an insert of many rows holds hundreds of values) fills
//! it with what those keep, and every other statement's values then go to
//! `malloc`. A larger pool lets the writer keep them all.
#![allow(unsafe_code)]

use std::ffi::c_int;

use rusqlite::{ffi, Connection};

/// Gives `conn` a lookaside of `slots` slots of `slot_bytes` bytes,
/// allocated by SQLite. SQLite refuses (`SQLITE_BUSY`) while the
/// connection holds lookaside memory, so this is called right after the
/// connection is opened, before its statements are prepared.
pub fn set_lookaside(conn: &Connection, slot_bytes: u16, slots: u16) -> rusqlite::Result<()> {
    // SAFETY: the handle is the open connection `conn` borrows, used on
    // this thread only for this call; a null buffer asks SQLite to allocate
    // the pool itself, and the two sizes are the `int`s this option takes.
    let rc = unsafe {
        ffi::sqlite3_db_config(
            conn.handle(),
            ffi::SQLITE_DBCONFIG_LOOKASIDE,
            std::ptr::null_mut::<std::ffi::c_void>(),
            c_int::from(slot_bytes),
            c_int::from(slots),
        )
    };
    if rc == ffi::SQLITE_OK {
        Ok(())
    } else {
        Err(rusqlite::Error::SqliteFailure(ffi::Error::new(rc), None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_connection_takes_a_larger_pool_and_one_holding_lookaside_is_refused() {
        let conn = Connection::open_in_memory().expect("open");
        set_lookaside(&conn, 1200, 500).expect("a fresh connection takes it");
        let (used, _) = lookaside_used(&conn);
        assert_eq!(used, 0);
        // A statement kept prepared holds lookaside slots: a second change
        // is refused while it lives.
        conn.execute_batch("CREATE TABLE t (a, b, c)")
            .expect("table");
        let held = conn
            .prepare("SELECT a, b, c FROM t WHERE a = ?1 AND b = ?2 ORDER BY c")
            .expect("prepare");
        let (used, highwater) = lookaside_used(&conn);
        assert!(
            used > 0,
            "the statement holds lookaside ({used}, high {highwater})"
        );
        let refused = set_lookaside(&conn, 1200, 100).expect_err("busy");
        assert_eq!(
            refused.sqlite_error_code(),
            Some(rusqlite::ErrorCode::DatabaseBusy)
        );
        drop(held);
    }

    /// Lookaside slots in use now, and the most used.
    fn lookaside_used(conn: &Connection) -> (c_int, c_int) {
        let (mut used, mut highwater) = (0, 0);
        // SAFETY: the open connection's handle and two out-parameters
        // that live for the call.
        let rc = unsafe {
            ffi::sqlite3_db_status(
                conn.handle(),
                ffi::SQLITE_DBSTATUS_LOOKASIDE_USED,
                &mut used,
                &mut highwater,
                0,
            )
        };
        assert_eq!(rc, ffi::SQLITE_OK);
        (used, highwater)
    }
}
