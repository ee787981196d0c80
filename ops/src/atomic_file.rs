//! Files that appear whole or not at all: written to a temporary file beside the target, synced,
//! then renamed over it. A crash or an error leaves the previous file (or none) in place. Every file
//! the project writes (checkpoints, profiles, strategies, traces, charts) goes through here.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A file created next to its final path and removed on drop unless committed.
pub struct AtomicFile {
    path: PathBuf,
    file: File,
    committed: bool,
}

impl AtomicFile {
    pub fn create_beside(target: &Path) -> io::Result<AtomicFile> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let file_name = target
            .file_name()
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{} does not name a file", target.display()),
                )
            })?
            .to_string_lossy();
        let dir = parent_dir(target);
        loop {
            let unique = COUNTER.fetch_add(1, Ordering::Relaxed);
            let path = dir.join(format!(".{file_name}.tmp-{}-{unique}", std::process::id()));
            match File::options().write(true).create_new(true).open(&path) {
                Ok(file) => {
                    return Ok(AtomicFile {
                        path,
                        file,
                        committed: false,
                    });
                }
                // A leftover from a crashed run with the same pid and counter: try the next name.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// The temporary file's path (for error messages).
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    /// Syncs the data and renames the file over `target`.
    pub fn commit(mut self, target: &Path) -> io::Result<()> {
        self.file.sync_all()?;
        fs::rename(&self.path, target)?;
        self.committed = true;
        sync_parent_dir(target);
        Ok(())
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.committed {
            // Best effort: the error that got us here is more useful than a failure to clean up.
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Writes `bytes` to `target` atomically.
pub fn write(target: &Path, bytes: &[u8]) -> io::Result<()> {
    let temp = AtomicFile::create_beside(target)?;
    temp.file().write_all(bytes)?;
    temp.commit(target)
}

fn parent_dir(target: &Path) -> &Path {
    match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Makes the rename itself durable. Failure is ignored: the data is already synced, and some
/// filesystems (or platforms) do not support syncing a directory.
fn sync_parent_dir(target: &Path) {
    #[cfg(unix)]
    if let Ok(d) = File::open(parent_dir(target)) {
        let _ = d.sync_all();
    }
    #[cfg(not(unix))]
    let _ = target;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_whole_and_leaves_no_temporary_behind() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("f.json");
        write(&target, b"old").unwrap();
        write(&target, b"new").unwrap();
        assert_eq!(fs::read(&target).unwrap(), b"new");
        let abandoned = AtomicFile::create_beside(&target).unwrap();
        drop(abandoned);
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["f.json"]);
        assert!(write(Path::new("/"), b"x").is_err());
    }
}
