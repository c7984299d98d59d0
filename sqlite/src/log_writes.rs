//! A commit's log frames written in one call.
//!
//! SQLite's unix VFS writes each frame of its log (WAL) as two calls, the
//! frame's 24-byte header and then its page: a commit of twenty pages is
//! forty `pwrite`s, and each call pays the kernel's entry, the inode's
//! lock, the file's timestamps and a page-cache cycle of its own (a frame
//! is 4,120 bytes: the header and the two pages of the cache a page spans
//! are three cycles). Under FETCH + ACK those calls were 9-11 a job and
//! 13 % of the daemon's CPU.
//!
//! [`open`] opens a file through a VFS that wraps the unix one and, for log
//! files only, holds writes that continue one another and writes them as
//! one call. What SQLite may read or publish is never held:
//!
//! - A write that carries a commit frame's header (its "database size
//!   after commit" field set) is written together with everything held
//!   before it, before it returns, and the write after it (the commit
//!   frame's page) goes straight to the file. SQLite publishes a commit to
//!   other connections (the wal-index header) after the commit frame's page
//!   is written, with no call on the file in between; when it rewrites the
//!   checksums of frames it overwrote in place, the last write before the
//!   publication is the commit frame's header itself, its page already in
//!   the file. Either way nothing of the commit is held when it is seen.
//! - Any other call on the file (a read, a sync, its size, a truncation, a
//!   file control, closing it) writes what is held first, and a write that
//!   does not continue what is held writes that first: the file sees every
//!   byte in the order SQLite wrote it.
//! - At most [`MAX_HELD`] bytes are held (a transaction that spills pages
//!   before its commit writes them as it goes).
//! - What is held when a write transaction ends (SQLite releases the log's
//!   write lock, on the database file's shared memory) is dropped: a commit
//!   left nothing held, so it is frames a transaction spilled and then
//!   rolled back. SQLite may make no call on the log at a rollback, and the
//!   next writer, another connection (another process on the same file),
//!   writes its frames at the same place: written later, those stale bytes
//!   would overwrite its commits. The database file is wrapped for that
//!   alone (every other call goes straight to the unix file), and linked to
//!   its log through the name SQLite opens the log by; a log whose
//!   database file is not found holds nothing.
//!
//! So a commit is two calls up to about 128 KiB of frames (one write of
//! the unix VFS takes at most that), and one more per 128 KiB past it. A
//! crash loses only what a crash between SQLite's own calls could: frames
//! of a transaction not yet committed. The database file's calls reach the
//! unix file as SQLite made them (the lock above is only looked at), and
//! every other file (journals, temporary files) is the unix VFS's own.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::Path;
use std::ptr;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{LazyLock, Mutex, OnceLock};

use rusqlite::ffi;
use rusqlite::{Connection, OpenFlags};

/// The VFS's name, as SQLite knows it.
pub const VFS_NAME: &CStr = c"ojs-log-writes";

/// Bytes of a log frame's header.
const FRAME_HEADER: usize = 24;

/// The most bytes held before they are written anyway.
pub const MAX_HELD: usize = 1 << 20;

/// The most bytes one write of the unix VFS takes: it keeps the low 17
/// bits of a write's length (larger lengths are not its callers'), so what
/// is held goes in pieces of at most this.
const MAX_WRITE: usize = 0x1ffff;

/// Opens `path` with `flags` through this module's VFS, or through
/// SQLite's default one when it could not be registered (logged once),
/// with room for 64 cached statements.
pub fn open(path: &Path, flags: OpenFlags) -> rusqlite::Result<Connection> {
    let conn = match registered() {
        Some(name) => Connection::open_with_flags_and_vfs(path, flags, name),
        None => Connection::open_with_flags(path, flags),
    }?;
    // Every statement a writer uses stays prepared: rusqlite keeps 16 by
    // default, fewer than a claim, an ack and a publish (or a group commit
    // of the job store) use together.
    conn.set_prepared_statement_cache_capacity(64);
    Ok(conn)
}

/// The unix VFS every call ends in.
static UNIX: AtomicPtr<ffi::sqlite3_vfs> = AtomicPtr::new(ptr::null_mut());

/// This module's VFS, registered with SQLite on first use.
fn registered() -> Option<&'static CStr> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        let result = register();
        if let Err(reason) = result {
            tracing::warn!(
                reason,
                "log writes one call per frame: the VFS that groups them is not registered"
            );
        }
        result.is_ok()
    });
    ok.then_some(VFS_NAME)
}

fn register() -> Result<(), &'static str> {
    // SAFETY: sqlite3_vfs_find takes a NUL-terminated name and returns a
    // VFS SQLite keeps for the process's life, or null.
    let unix = unsafe { ffi::sqlite3_vfs_find(c"unix".as_ptr()) };
    if unix.is_null() {
        return Err("SQLite has no unix VFS");
    }
    UNIX.store(unix, Ordering::Release);
    // SAFETY: `unix` is a live VFS (above); it is copied, not changed.
    let mut ours = unsafe { *unix };
    let real_size = ours.szOsFile;
    ours.szOsFile = c_int::try_from(REAL_AT)
        .ok()
        .and_then(|at| at.checked_add(real_size))
        .ok_or("the unix VFS's file is too large")?;
    ours.zName = VFS_NAME.as_ptr();
    ours.pNext = ptr::null_mut();
    ours.xOpen = Some(open_file);
    // Every other method is the unix VFS's own: they read nothing of the
    // VFS but its maximum path length, copied with it. SQLite keeps the
    // pointer for the process's life: the copy is never freed.
    let ours = Box::leak(Box::new(ours));
    // SAFETY: `ours` is a complete VFS that lives forever; 0 keeps the
    // default VFS as it is.
    let rc = unsafe { ffi::sqlite3_vfs_register(ours, 0) };
    if rc == ffi::SQLITE_OK {
        Ok(())
    } else {
        Err("sqlite3_vfs_register failed")
    }
}

/// A log file (the unix VFS's file and the writes held for it) or a
/// database file (the unix VFS's file and its log).
///
/// SQLite allocates `szOsFile` bytes for every file it opens through the
/// VFS: a log or database file is this struct, then the unix file at
/// [`REAL_AT`]. Any other file (a temporary one) is the unix file alone, at
/// the start of the same bytes.
#[repr(C)]
struct WrappedFile {
    /// What SQLite reads: `pMethods` is [`LOG_METHODS`] or [`DB_METHODS`].
    base: ffi::sqlite3_file,
    /// The unix VFS's file, in the same allocation.
    real: *mut ffi::sqlite3_file,
    /// Bytes written by SQLite and not yet to the file, in order (a log's
    /// only).
    held: Vec<u8>,
    /// Where in the file `held` starts.
    held_at: i64,
    /// The write after a commit frame's header goes straight to the file.
    pass_next: bool,
    /// Whether writes are held: a log linked to its database file.
    holds: bool,
    /// A log's database file, a database file's log, while both are open
    /// (one connection's: used by one thread at a time).
    partner: *mut WrappedFile,
    /// A database file's name as SQLite passed it (its key in [`LINKS`]).
    name: usize,
}

/// The open database files, by the address of the name SQLite opened each
/// by: a log's name is in the same allocation, and
/// `sqlite3_filename_database` finds that address from it.
static LINKS: LazyLock<Mutex<HashMap<usize, usize>>> = LazyLock::new(Mutex::default);

fn links() -> std::sync::MutexGuard<'static, HashMap<usize, usize>> {
    // Only inserts and removals happen under the lock.
    LINKS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where the unix file starts in a wrapped file's bytes.
const REAL_AT: usize = std::mem::size_of::<WrappedFile>().next_multiple_of(16);

#[cfg(test)]
thread_local! {
    /// Writes SQLite made to log files on this thread, and writes that
    /// reached them: what the tests compare.
    pub(crate) static COUNTED: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
}

#[cfg(test)]
fn count(asked: u64, made: u64) {
    COUNTED.with(|c| {
        let (a, m) = c.get();
        c.set((a + asked, m + made));
    });
}

#[cfg(not(test))]
fn count(_asked: u64, _made: u64) {}

unsafe extern "C" fn open_file(
    _vfs: *mut ffi::sqlite3_vfs,
    name: *const c_char,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    let unix = UNIX.load(Ordering::Acquire);
    // SAFETY: set before the VFS was registered, and SQLite's VFSes live
    // for the process's life.
    let Some(unix_open) = (unsafe { (*unix).xOpen }) else {
        return ffi::SQLITE_CANTOPEN;
    };
    let log = flags & ffi::SQLITE_OPEN_WAL != 0;
    let database = flags & ffi::SQLITE_OPEN_MAIN_DB != 0 && !name.is_null();
    if !log && !database {
        // SAFETY: SQLite gave `file` szOsFile bytes, more than the unix
        // file takes; from here the file is the unix VFS's alone.
        return unsafe { unix_open(unix, name, file, flags, out_flags) };
    }
    // SAFETY: `file` has szOsFile bytes, REAL_AT + the unix file's; both
    // parts are written before anything reads them.
    unsafe {
        let real = file.cast::<u8>().add(REAL_AT).cast::<ffi::sqlite3_file>();
        ptr::write(
            real,
            ffi::sqlite3_file {
                pMethods: ptr::null(),
            },
        );
        let rc = unix_open(unix, name, real, flags, out_flags);
        if (*real).pMethods.is_null() {
            // Nothing to close: SQLite sees a file without methods.
            (*file).pMethods = ptr::null();
            return rc;
        }
        if rc != ffi::SQLITE_OK {
            // SQLite closes only files whose open succeeded.
            if let Some(close) = (*(*real).pMethods).xClose {
                close(real);
            }
            (*file).pMethods = ptr::null();
            return rc;
        }
        let this = file.cast::<WrappedFile>();
        ptr::write(
            this,
            WrappedFile {
                base: ffi::sqlite3_file {
                    pMethods: if log { &LOG_METHODS } else { &DB_METHODS },
                },
                real,
                held: Vec::new(),
                held_at: 0,
                pass_next: false,
                holds: false,
                partner: ptr::null_mut(),
                name: if log { 0 } else { name as usize },
            },
        );
        let mut links = links();
        if log {
            // The log's name follows its database's in one allocation.
            let database = ffi::sqlite3_filename_database(name);
            if let Some(&db) = links.get(&(database as usize)) {
                let db = db as *mut WrappedFile;
                (*db).partner = this;
                (*this).partner = db;
                (*this).holds = true;
            }
        } else {
            links.insert(name as usize, this as usize);
        }
        rc
    }
}

/// The wrapped file behind `file`.
///
/// # Safety
/// `file` is a file [`open_file`] opened as a log or database file and not
/// yet closed, used by one connection (SQLite's connections are used by
/// one thread at a time).
unsafe fn wrapped<'a>(file: *mut ffi::sqlite3_file) -> &'a mut WrappedFile {
    // SAFETY: as the caller promises.
    unsafe { &mut *file.cast::<WrappedFile>() }
}

/// The unix file's methods.
fn real_methods(this: &WrappedFile) -> &'static ffi::sqlite3_io_methods {
    // SAFETY: `real` was opened (its methods set) before `this` existed,
    // and the unix VFS's methods are static.
    unsafe { &*(*this.real).pMethods }
}

impl WrappedFile {
    /// Writes what is held. On failure what was held is dropped, as a
    /// failed write of the unix VFS leaves it: SQLite fails the
    /// transaction it belonged to.
    fn write_held(&mut self) -> c_int {
        if self.held.is_empty() {
            return ffi::SQLITE_OK;
        }
        let rc = self.write_through(self.held.as_ptr(), self.held.len(), self.held_at);
        self.held.clear();
        rc
    }

    /// Writes `len` bytes from `data` at `at`, in pieces the unix VFS takes.
    fn write_through(&mut self, data: *const u8, len: usize, at: i64) -> c_int {
        let Some(write) = real_methods(self).xWrite else {
            return ffi::SQLITE_IOERR_WRITE;
        };
        let mut done = 0;
        while done < len {
            let piece = (len - done).min(MAX_WRITE);
            let (Ok(amount), Ok(offset)) = (c_int::try_from(piece), i64::try_from(done)) else {
                return ffi::SQLITE_IOERR_WRITE;
            };
            count(0, 1);
            // SAFETY: `data` holds `len` bytes (a held buffer or SQLite's),
            // of which `done..done + piece` is a part.
            let rc = unsafe {
                write(
                    self.real,
                    data.add(done).cast::<c_void>(),
                    amount,
                    at + offset,
                )
            };
            if rc != ffi::SQLITE_OK {
                return rc;
            }
            done += piece;
        }
        ffi::SQLITE_OK
    }

    /// SQLite's write of `data` at `at`: held, or written with what is held.
    fn write(&mut self, data: &[u8], at: i64) -> c_int {
        count(1, 0);
        if !self.holds || std::mem::take(&mut self.pass_next) {
            let rc = self.write_held();
            if rc != ffi::SQLITE_OK {
                return rc;
            }
            return self.write_through(data.as_ptr(), data.len(), at);
        }
        let continues = i64::try_from(self.held.len())
            .ok()
            .and_then(|held| self.held_at.checked_add(held))
            == Some(at);
        if !self.held.is_empty() && (!continues || self.held.len() + data.len() > MAX_HELD) {
            let rc = self.write_held();
            if rc != ffi::SQLITE_OK {
                return rc;
            }
        }
        if data.len() > MAX_HELD {
            return self.write_through(data.as_ptr(), data.len(), at);
        }
        if self.held.is_empty() {
            self.held_at = at;
        }
        self.held.extend_from_slice(data);
        if is_commit_header(data) {
            self.pass_next = true;
            return self.write_held();
        }
        ffi::SQLITE_OK
    }
}

/// Whether `data` is a log frame's header that ends a commit: bytes 4-8
/// (big-endian) hold the database's size in pages after the commit, 0 in
/// every other frame. Only frame headers are 24 bytes long (the log's own
/// header is 32, a page 512 or more).
fn is_commit_header(data: &[u8]) -> bool {
    data.len() == FRAME_HEADER && data[4..8] != [0, 0, 0, 0]
}

/// Writes what `file` holds, then `then`.
///
/// # Safety
/// As [`wrapped`].
unsafe fn after_held(
    file: *mut ffi::sqlite3_file,
    then: impl FnOnce(&mut WrappedFile) -> c_int,
) -> c_int {
    // SAFETY: as the caller promises.
    let this = unsafe { wrapped(file) };
    let rc = this.write_held();
    if rc != ffi::SQLITE_OK {
        return rc;
    }
    then(this)
}

unsafe extern "C" fn file_close(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: SQLite closes a file it opened, once.
    let this = unsafe { wrapped(file) };
    let held = this.write_held();
    // SAFETY: the partner is open (each unlinks the other when it closes),
    // and both are the one connection's.
    unsafe { unlink(this) };
    let closed = match real_methods(this).xClose {
        // SAFETY: the unix file is open; it is closed once, here.
        Some(close) => unsafe { close(this.real) },
        None => ffi::SQLITE_OK,
    };
    // SAFETY: the struct was written by `open_file`; nothing reads it after
    // this close.
    unsafe {
        ptr::drop_in_place(&mut this.held);
        (*file).pMethods = ptr::null();
    }
    if held != ffi::SQLITE_OK {
        held
    } else {
        closed
    }
}

unsafe extern "C" fn file_read(
    file: *mut ffi::sqlite3_file,
    buf: *mut c_void,
    amount: c_int,
    offset: ffi::sqlite3_int64,
) -> c_int {
    // SAFETY: SQLite calls the file's methods on an open file.
    unsafe {
        after_held(file, |this| match real_methods(this).xRead {
            Some(read) => read(this.real, buf, amount, offset),
            None => ffi::SQLITE_IOERR_READ,
        })
    }
}

unsafe extern "C" fn log_write(
    file: *mut ffi::sqlite3_file,
    buf: *const c_void,
    amount: c_int,
    offset: ffi::sqlite3_int64,
) -> c_int {
    let Ok(len) = usize::try_from(amount) else {
        return ffi::SQLITE_IOERR_WRITE;
    };
    // SAFETY: SQLite calls the file's methods on an open file, and its
    // buffer holds `amount` bytes for the call's length.
    unsafe {
        let data = std::slice::from_raw_parts(buf.cast::<u8>(), len);
        wrapped(file).write(data, offset)
    }
}

unsafe extern "C" fn file_truncate(
    file: *mut ffi::sqlite3_file,
    size: ffi::sqlite3_int64,
) -> c_int {
    // SAFETY: SQLite calls the file's methods on an open file.
    unsafe {
        after_held(file, |this| match real_methods(this).xTruncate {
            Some(truncate) => truncate(this.real, size),
            None => ffi::SQLITE_IOERR_TRUNCATE,
        })
    }
}

unsafe extern "C" fn file_sync(file: *mut ffi::sqlite3_file, flags: c_int) -> c_int {
    // SAFETY: SQLite calls the file's methods on an open file.
    unsafe {
        after_held(file, |this| match real_methods(this).xSync {
            Some(sync) => sync(this.real, flags),
            None => ffi::SQLITE_IOERR_FSYNC,
        })
    }
}

unsafe extern "C" fn file_file_size(
    file: *mut ffi::sqlite3_file,
    size: *mut ffi::sqlite3_int64,
) -> c_int {
    // SAFETY: SQLite calls the file's methods on an open file.
    unsafe {
        after_held(file, |this| match real_methods(this).xFileSize {
            Some(file_size) => file_size(this.real, size),
            None => ffi::SQLITE_IOERR_FSTAT,
        })
    }
}

unsafe extern "C" fn file_lock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    // SAFETY: SQLite calls the file's methods on an open file.
    let this = unsafe { wrapped(file) };
    match real_methods(this).xLock {
        // SAFETY: the unix file is open.
        Some(lock) => unsafe { lock(this.real, level) },
        None => ffi::SQLITE_IOERR_LOCK,
    }
}

unsafe extern "C" fn file_unlock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    // SAFETY: SQLite calls the file's methods on an open file.
    let this = unsafe { wrapped(file) };
    match real_methods(this).xUnlock {
        // SAFETY: the unix file is open.
        Some(unlock) => unsafe { unlock(this.real, level) },
        None => ffi::SQLITE_IOERR_UNLOCK,
    }
}

unsafe extern "C" fn file_check_reserved_lock(
    file: *mut ffi::sqlite3_file,
    out: *mut c_int,
) -> c_int {
    // SAFETY: SQLite calls the file's methods on an open file.
    let this = unsafe { wrapped(file) };
    match real_methods(this).xCheckReservedLock {
        // SAFETY: the unix file is open; `out` is SQLite's.
        Some(check) => unsafe { check(this.real, out) },
        None => ffi::SQLITE_IOERR_CHECKRESERVEDLOCK,
    }
}

unsafe extern "C" fn file_file_control(
    file: *mut ffi::sqlite3_file,
    op: c_int,
    arg: *mut c_void,
) -> c_int {
    // SAFETY: SQLite calls the file's methods on an open file.
    unsafe {
        after_held(file, |this| match real_methods(this).xFileControl {
            Some(control) => control(this.real, op, arg),
            None => ffi::SQLITE_NOTFOUND,
        })
    }
}

unsafe extern "C" fn file_sector_size(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: SQLite calls the file's methods on an open file.
    let this = unsafe { wrapped(file) };
    match real_methods(this).xSectorSize {
        // SAFETY: the unix file is open.
        Some(sector_size) => unsafe { sector_size(this.real) },
        None => 4096,
    }
}

unsafe extern "C" fn file_device_characteristics(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: SQLite calls the file's methods on an open file.
    let this = unsafe { wrapped(file) };
    match real_methods(this).xDeviceCharacteristics {
        // SAFETY: the unix file is open.
        Some(characteristics) => unsafe { characteristics(this.real) },
        None => 0,
    }
}

unsafe extern "C" fn file_shm_map(
    file: *mut ffi::sqlite3_file,
    region: c_int,
    size: c_int,
    extend: c_int,
    out: *mut *mut c_void,
) -> c_int {
    // SAFETY: SQLite calls the file's methods on an open file.
    let this = unsafe { wrapped(file) };
    match real_methods(this).xShmMap {
        // SAFETY: the unix file is open; `out` is SQLite's.
        Some(map) => unsafe { map(this.real, region, size, extend, out) },
        None => ffi::SQLITE_IOERR_SHMMAP,
    }
}

unsafe extern "C" fn file_shm_lock(
    file: *mut ffi::sqlite3_file,
    offset: c_int,
    n: c_int,
    flags: c_int,
) -> c_int {
    // SAFETY: SQLite calls the file's methods on an open file.
    let this = unsafe { wrapped(file) };
    match real_methods(this).xShmLock {
        // SAFETY: the unix file is open.
        Some(lock) => unsafe { lock(this.real, offset, n, flags) },
        None => ffi::SQLITE_IOERR_SHMLOCK,
    }
}

unsafe extern "C" fn file_shm_barrier(file: *mut ffi::sqlite3_file) {
    // SAFETY: SQLite calls the file's methods on an open file.
    let this = unsafe { wrapped(file) };
    if let Some(barrier) = real_methods(this).xShmBarrier {
        // SAFETY: the unix file is open.
        unsafe { barrier(this.real) }
    }
}

unsafe extern "C" fn file_shm_unmap(file: *mut ffi::sqlite3_file, delete: c_int) -> c_int {
    // SAFETY: SQLite calls the file's methods on an open file.
    let this = unsafe { wrapped(file) };
    match real_methods(this).xShmUnmap {
        // SAFETY: the unix file is open.
        Some(unmap) => unsafe { unmap(this.real, delete) },
        None => ffi::SQLITE_OK,
    }
}

unsafe extern "C" fn file_fetch(
    file: *mut ffi::sqlite3_file,
    offset: ffi::sqlite3_int64,
    amount: c_int,
    out: *mut *mut c_void,
) -> c_int {
    // SAFETY: SQLite calls the file's methods on an open file; `out` is
    // SQLite's.
    unsafe {
        after_held(file, |this| match real_methods(this).xFetch {
            Some(fetch) => fetch(this.real, offset, amount, out),
            None => {
                // No memory map: SQLite reads instead.
                *out = ptr::null_mut();
                ffi::SQLITE_OK
            }
        })
    }
}

unsafe extern "C" fn file_unfetch(
    file: *mut ffi::sqlite3_file,
    offset: ffi::sqlite3_int64,
    page: *mut c_void,
) -> c_int {
    // SAFETY: SQLite calls the file's methods on an open file.
    let this = unsafe { wrapped(file) };
    match real_methods(this).xUnfetch {
        // SAFETY: the unix file is open; `page` came from its fetch.
        Some(unfetch) => unsafe { unfetch(this.real, offset, page) },
        None => ffi::SQLITE_OK,
    }
}

/// Ends the link of `file` and its partner, and a database file's entry in
/// [`LINKS`].
///
/// # Safety
/// `file`'s partner, if any, is open.
unsafe fn unlink(file: &mut WrappedFile) {
    if !file.partner.is_null() {
        // SAFETY: as the caller promises.
        unsafe {
            (*file.partner).partner = ptr::null_mut();
            (*file.partner).holds = false;
        }
        file.partner = ptr::null_mut();
    }
    if file.name != 0 {
        let this = ptr::from_mut(file) as usize;
        let mut links = links();
        if links.get(&file.name) == Some(&this) {
            links.remove(&file.name);
        }
    }
}

/// A database file's write goes straight to the file.
unsafe extern "C" fn db_write(
    file: *mut ffi::sqlite3_file,
    buf: *const c_void,
    amount: c_int,
    offset: ffi::sqlite3_int64,
) -> c_int {
    // SAFETY: SQLite calls the file's methods on an open file.
    let db = unsafe { wrapped(file) };
    match real_methods(db).xWrite {
        // SAFETY: the unix file is open; the buffer is SQLite's.
        Some(write) => unsafe { write(db.real, buf, amount, offset) },
        None => ffi::SQLITE_IOERR_WRITE,
    }
}

/// The log's write lock (slot 0 of the shared memory's locks) released: a
/// write transaction ended, and what its log holds was rolled back.
unsafe extern "C" fn db_shm_lock(
    file: *mut ffi::sqlite3_file,
    offset: c_int,
    n: c_int,
    flags: c_int,
) -> c_int {
    const WRITE_LOCK: c_int = 0;
    // SAFETY: SQLite calls the file's methods on an open file.
    let db = unsafe { wrapped(file) };
    if flags == ffi::SQLITE_SHM_UNLOCK | ffi::SQLITE_SHM_EXCLUSIVE
        && offset <= WRITE_LOCK
        && WRITE_LOCK < offset.saturating_add(n)
        && !db.partner.is_null()
    {
        // SAFETY: the log is open while linked, and the connection's.
        let log = unsafe { &mut *db.partner };
        log.held.clear();
        log.pass_next = false;
    }
    match real_methods(db).xShmLock {
        // SAFETY: the unix file is open.
        Some(lock) => unsafe { lock(db.real, offset, n, flags) },
        None => ffi::SQLITE_IOERR_SHMLOCK,
    }
}

/// A database file's methods: the unix file's, but for its writes (never
/// held), its shared memory's locks ([`db_shm_lock`]) and its close.
static DB_METHODS: ffi::sqlite3_io_methods = ffi::sqlite3_io_methods {
    iVersion: 3,
    xClose: Some(file_close),
    xRead: Some(file_read),
    xWrite: Some(db_write),
    xTruncate: Some(file_truncate),
    xSync: Some(file_sync),
    xFileSize: Some(file_file_size),
    xLock: Some(file_lock),
    xUnlock: Some(file_unlock),
    xCheckReservedLock: Some(file_check_reserved_lock),
    xFileControl: Some(file_file_control),
    xSectorSize: Some(file_sector_size),
    xDeviceCharacteristics: Some(file_device_characteristics),
    xShmMap: Some(file_shm_map),
    xShmLock: Some(db_shm_lock),
    xShmBarrier: Some(file_shm_barrier),
    xShmUnmap: Some(file_shm_unmap),
    xFetch: Some(file_fetch),
    xUnfetch: Some(file_unfetch),
};

static LOG_METHODS: ffi::sqlite3_io_methods = ffi::sqlite3_io_methods {
    iVersion: 3,
    xClose: Some(file_close),
    xRead: Some(file_read),
    xWrite: Some(log_write),
    xTruncate: Some(file_truncate),
    xSync: Some(file_sync),
    xFileSize: Some(file_file_size),
    xLock: Some(file_lock),
    xUnlock: Some(file_unlock),
    xCheckReservedLock: Some(file_check_reserved_lock),
    xFileControl: Some(file_file_control),
    xSectorSize: Some(file_sector_size),
    xDeviceCharacteristics: Some(file_device_characteristics),
    xShmMap: Some(file_shm_map),
    xShmLock: Some(file_shm_lock),
    xShmBarrier: Some(file_shm_barrier),
    xShmUnmap: Some(file_shm_unmap),
    xFetch: Some(file_fetch),
    xUnfetch: Some(file_unfetch),
};

#[cfg(test)]
mod tests {
    use super::*;
    use rusqlite::params;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    use crate::ScratchDir as Scratch;

    /// A writer through this VFS, in WAL mode with `sync`.
    fn writer(path: &Path, sync: &str) -> rusqlite::Result<Connection> {
        let conn = open(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE,
        )?;
        conn.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))?;
        conn.execute_batch(&format!("PRAGMA synchronous = {sync};"))?;
        Ok(conn)
    }

    /// A reader through SQLite's own unix VFS: a file descriptor of its own,
    /// nothing of this module between it and the file.
    fn plain_reader(path: &Path) -> rusqlite::Result<Connection> {
        Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_WRITE)
    }

    fn counted() -> (u64, u64) {
        COUNTED.with(std::cell::Cell::get)
    }

    /// Rows and their bytes, as a connection reads them.
    fn contents(conn: &Connection) -> rusqlite::Result<(i64, i64)> {
        conn.query_row(
            "SELECT count(*), coalesce(sum(length(body)), 0) FROM t",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
    }

    /// A writer whose cache holds 8 pages (a larger transaction writes
    /// pages to the log before it commits) and that never checkpoints (a
    /// copy of the files recovers from the log), with the table `t`.
    fn spilling_writer(path: &Path) -> rusqlite::Result<Connection> {
        let conn = writer(path, "NORMAL")?;
        conn.execute_batch(
            "PRAGMA wal_autocheckpoint = 0; PRAGMA cache_size = 8;
             CREATE TABLE t (id INTEGER PRIMARY KEY, body BLOB NOT NULL);",
        )?;
        Ok(conn)
    }

    /// Inserts `rows` rows of 1,000 bytes into `t`.
    fn insert(conn: &Connection, rows: usize, seed: usize) -> rusqlite::Result<()> {
        for i in 0..rows {
            conn.execute(
                "INSERT INTO t (body) VALUES (?1)",
                params![vec![(seed + i) as u8; 1000]],
            )?;
        }
        Ok(())
    }

    /// `integrity_check`'s answer.
    fn integrity(conn: &Connection) -> rusqlite::Result<String> {
        conn.query_row("PRAGMA integrity_check", [], |r| r.get(0))
    }

    /// The rows of a copy of `path` and its log taken now, as a crash
    /// leaves them: SQLite recovers the copy from the log, checking each
    /// frame's checksum, and the copy must be intact.
    fn recovered(path: &Path) -> Result<(i64, i64), Box<dyn std::error::Error>> {
        let copy = Scratch::new("copy")?;
        std::fs::copy(path, copy.file("t.sqlite"))?;
        let mut log = path.as_os_str().to_owned();
        log.push("-wal");
        std::fs::copy(log, copy.file("t.sqlite-wal"))?;
        let conn = plain_reader(&copy.file("t.sqlite"))?;
        assert_eq!(integrity(&conn)?, "ok");
        Ok(contents(&conn)?)
    }

    /// Every commit of many pages reaches the log in two writes (what is
    /// held up to the commit frame's header, then its page), and another
    /// connection, on a file descriptor of its own, reads each commit right
    /// after it: nothing published was still held. With `FULL` the log is
    /// synced at each commit, after what was held is written.
    #[test]
    fn a_commit_reaches_the_log_in_two_writes_and_is_read_by_others_at_once() -> TestResult {
        for sync in ["NORMAL", "FULL"] {
            let scratch = Scratch::new(sync)?;
            let path = scratch.file("t.sqlite");
            let mut writer = writer(&path, sync)?;
            writer.execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, body BLOB NOT NULL)")?;
            let reader = plain_reader(&path)?;
            let mut rows = 0;
            for round in 0..60 {
                let before = counted();
                let tx = writer.transaction()?;
                insert(&tx, 40, round)?;
                tx.commit()?;
                rows += 40;
                let (asked, made) = counted();
                let (asked, made) = (asked - before.0, made - before.1);
                assert_eq!(made, 2, "{sync}, round {round}: {asked} writes asked");
                assert!(asked >= 20, "{sync}, round {round}: {asked} writes asked");
                assert_eq!(
                    contents(&reader)?,
                    (rows, rows * 1000),
                    "{sync}, round {round}"
                );
            }
            // The checkpoints SQLite ran meanwhile (its threshold, 1,000
            // pages, was crossed) started the log over: its header and the
            // first frames again in one write, counted above.
            assert_eq!(integrity(&reader)?, "ok");
        }
        Ok(())
    }

    /// A transaction larger than its page cache writes pages to the log
    /// before it commits, then overwrites some of them in place and, at its
    /// commit, rewrites the checksums of the frames from there (SQLite's
    /// read of each frame, then its header). What commits is read whole by
    /// another connection, and a copy of the files taken with the writer
    /// still open (a crash) recovers every committed row from the log,
    /// whose checksums SQLite then checks frame by frame; a spilled
    /// transaction rolled back leaves nothing.
    #[test]
    fn spilled_and_rewritten_pages_commit_whole_and_recover_after_a_crash() -> TestResult {
        let scratch = Scratch::new("spill")?;
        let path = scratch.file("t.sqlite");
        let mut writer = spilling_writer(&path)?;
        let mut expected = (0, 0);
        for round in 0..4 {
            let rolled_back = round == 2;
            let tx = writer.transaction()?;
            let first: i64 =
                tx.query_row("SELECT coalesce(max(id), 0) + 1 FROM t", [], |r| r.get(0))?;
            insert(&tx, 300, 0)?;
            // The first rows' pages went to the log already (8 pages of
            // cache): changed again, they are overwritten in place.
            let changed = tx.execute(
                "UPDATE t SET body = zeroblob(1200) WHERE id BETWEEN ?1 AND ?1 + 39",
                [first],
            )?;
            assert_eq!(changed, 40);
            if rolled_back {
                tx.rollback()?;
            } else {
                tx.commit()?;
                expected = (expected.0 + 300, expected.1 + 260 * 1000 + 40 * 1200);
            }
            assert_eq!(contents(&plain_reader(&path)?)?, expected, "round {round}");
        }
        assert_eq!(recovered(&path)?, expected);
        drop(writer);
        Ok(())
    }

    /// Frames a transaction spilled and then rolled back are dropped at
    /// its end, never written later: another connection (another process
    /// on the same file, as `ojs-bridge send` beside a daemon) commits over
    /// the same part of the log, then the first connection reads, which
    /// writes what it holds first. The other's commits stay whole, read and
    /// recovered.
    #[test]
    fn a_rolled_back_transactions_frames_are_never_written_over_another_writers() -> TestResult {
        let scratch = Scratch::new("stale")?;
        let path = scratch.file("t.sqlite");
        let mut first = spilling_writer(&path)?;
        let mut second = writer(&path, "NORMAL")?;
        second.execute_batch("PRAGMA wal_autocheckpoint = 0;")?;
        // Every page in the file, the log empty: the rollback reads the
        // pages it keeps (the first one at least) from the file, not the
        // log, so nothing on the log is called before the other writer.
        first.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
        let tx = first.transaction()?;
        insert(&tx, 300, 0)?;
        tx.rollback()?;
        // Well past where the rolled-back frames ended.
        for round in 0..30 {
            let tx = second.transaction()?;
            insert(&tx, 40, round)?;
            tx.commit()?;
        }
        let expected = (1200, 1200 * 1000);
        assert_eq!(contents(&first)?, expected);
        let reader = plain_reader(&path)?;
        assert_eq!(contents(&reader)?, expected);
        assert_eq!(integrity(&reader)?, "ok");
        assert_eq!(recovered(&path)?, expected);
        Ok(())
    }

    /// Readers on both VFSes, racing a writer that moves amounts between
    /// accounts spread over many pages, only ever see whole commits: the
    /// total never changes and no page reads as damaged.
    #[test]
    fn readers_racing_the_writer_see_only_whole_commits() -> TestResult {
        const ACCOUNTS: i64 = 400;
        const TOTAL: i64 = ACCOUNTS * 1000;
        let scratch = Scratch::new("race")?;
        let path = scratch.file("t.sqlite");
        let mut writer = writer(&path, "NORMAL")?;
        writer.execute_batch(
            "CREATE TABLE accounts (id INTEGER PRIMARY KEY, amount INTEGER NOT NULL, pad BLOB NOT NULL)",
        )?;
        {
            let tx = writer.transaction()?;
            for id in 0..ACCOUNTS {
                tx.execute(
                    "INSERT INTO accounts (id, amount, pad) VALUES (?1, 1000, zeroblob(300))",
                    [id],
                )?;
            }
            tx.commit()?;
        }
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let readers: Vec<_> = [true, false]
            .into_iter()
            .map(|plain| {
                let path = path.clone();
                let done = done.clone();
                std::thread::spawn(move || -> rusqlite::Result<u64> {
                    let conn = if plain {
                        plain_reader(&path)?
                    } else {
                        open(&path, OpenFlags::SQLITE_OPEN_READ_WRITE)?
                    };
                    let mut reads = 0;
                    while !done.load(std::sync::atomic::Ordering::Relaxed) {
                        let total: i64 =
                            conn.query_row("SELECT sum(amount) FROM accounts", [], |r| r.get(0))?;
                        assert_eq!(total, TOTAL, "a reader saw part of a commit");
                        reads += 1;
                    }
                    Ok(reads)
                })
            })
            .collect();
        for n in 0..3000_i64 {
            let from = (n * 7919) % ACCOUNTS;
            let to = (n * 104_729 + 13) % ACCOUNTS;
            let tx = writer.transaction()?;
            tx.execute(
                "UPDATE accounts SET amount = amount - 5 WHERE id = ?1",
                [from],
            )?;
            tx.execute(
                "UPDATE accounts SET amount = amount + 5 WHERE id = ?1",
                [to],
            )?;
            tx.commit()?;
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        for reader in readers {
            let reads = reader.join().map_err(|_| "a reader panicked")??;
            assert!(reads > 0, "a reader never read");
        }
        Ok(())
    }

    /// What tells a commit frame: its header's size field, only in a
    /// header's length.
    #[test]
    fn only_a_frame_header_with_a_size_ends_a_commit() {
        let mut header = [0_u8; FRAME_HEADER];
        assert!(!is_commit_header(&header));
        header[7] = 1;
        assert!(is_commit_header(&header));
        let mut page = vec![0_u8; 4096];
        page[7] = 1;
        assert!(!is_commit_header(&page));
        assert!(!is_commit_header(&[0, 0, 0, 0, 0, 0, 0, 1]));
    }
}
