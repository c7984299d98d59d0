//! A temporary directory removed when dropped.

use std::path::{Path, PathBuf};

/// A fresh directory under the system temp dir, deleted on drop.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// Creates `…/ojs-{prefix}-{random}`.
    pub fn new(prefix: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("ojs-{prefix}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
