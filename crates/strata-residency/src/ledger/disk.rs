//! The ledger file on disk: a lenient line parser (damage is per line, never the whole
//! file), the sidecar lock, atomic replacement, stale temp-file cleanup and setting a
//! damaged file aside.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Distinguishes concurrent flushes' temp files within one process.
static FLUSH_SEQ: AtomicU64 = AtomicU64::new(0);

/// A temp file older than this is stale even when its owner's pid is alive (pids are
/// reused; a flush takes milliseconds).
pub(crate) const STALE_TEMP_AGE: Duration = Duration::from_secs(60);

/// One integer field: sign and magnitude (saturated at `u64::MAX`), or None when the
/// field is not `[+-]digits`.
fn int_field(s: &str) -> Option<(bool, u64)> {
    let (negative, digits) = match s.as_bytes().first()? {
        b'-' => (true, &s[1..]),
        b'+' => (false, &s[1..]),
        _ => (false, s),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let magnitude = digits.bytes().fold(0u64, |acc, b| acc.saturating_mul(10).saturating_add((b - b'0') as u64));
    Some((negative, magnitude))
}

/// What one line of a ledger file is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Line {
    Blank,
    /// `-1 <n_layers> <n_experts>`; negative values are kept as None (never a match).
    Dims(Option<u64>, Option<u64>),
    /// `-2 <format_version> <engine_id>`.
    Version(Option<u64>, Option<u64>),
    /// Another negative layer id: reserved, skipped.
    Reserved,
    /// `<layer> <expert> <count>`; layer or expert None when negative (dropped, not
    /// damage). Counts saturate at `u32::MAX`, whatever their digit count.
    Record {
        layer: u64,
        expert: Option<u64>,
        count: u32,
    },
}

/// Classifies one line; `Err` says why it is not a record (damage).
pub(crate) fn parse_line(line: &str) -> Result<Line, String> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    if fields.is_empty() {
        return Ok(Line::Blank);
    }
    let [f1, f2, f3] = fields[..] else {
        return Err(format!("expected `<layer> <expert> <count>`, found {} fields", fields.len()));
    };
    let bad = |what: &str, field: &str| format!("invalid {what} {:?}", excerpt(field));
    let (layer_neg, layer) = int_field(f1).ok_or_else(|| bad("layer", f1))?;
    let (second_neg, second) = int_field(f2).ok_or_else(|| bad("second field", f2))?;
    let (third_neg, third) = int_field(f3).ok_or_else(|| bad("third field", f3))?;
    let positive = |neg: bool, v: u64| (!neg).then_some(v);
    if layer_neg {
        return Ok(match layer {
            0 => {
                if third_neg {
                    return Err(format!("negative count {:?}", excerpt(f3)));
                }
                Line::Record { layer: 0, expert: positive(second_neg, second), count: sat_u32(third) }
            }
            1 => Line::Dims(positive(second_neg, second), positive(third_neg, third)),
            2 => Line::Version(positive(second_neg, second), positive(third_neg, third)),
            _ => Line::Reserved,
        });
    }
    if third_neg {
        return Err(format!("negative count {:?}", excerpt(f3)));
    }
    Ok(Line::Record { layer, expert: positive(second_neg, second), count: sat_u32(third) })
}

fn sat_u32(v: u64) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

/// A short, printable excerpt of a damaged line.
pub(crate) fn excerpt(s: &str) -> String {
    const MAX: usize = 40;
    match s.char_indices().nth(MAX) {
        Some((at, _)) => format!("{}...", &s[..at]),
        None => s.to_string(),
    }
}

/// Splits a file into numbered lines (1-based); a line that is not UTF-8 is damage.
pub(crate) fn lines(bytes: &[u8]) -> impl Iterator<Item = (usize, Result<&str, String>)> {
    let trimmed = bytes.strip_suffix(b"\n").unwrap_or(bytes);
    let empty = bytes.is_empty();
    trimmed
        .split(|&b| b == b'\n')
        .enumerate()
        .filter(move |_| !empty)
        .map(|(i, line)| (i + 1, std::str::from_utf8(line).map_err(|e| format!("not text ({e})"))))
}

/// `name` + `suffix` as a hidden sibling name (`.coli_usage` -> `.coli_usage.lock`,
/// `usage` -> `.usage.lock`).
pub(crate) fn hidden(name: &str, suffix: &str) -> String {
    if name.starts_with('.') {
        format!("{name}{suffix}")
    } else {
        format!(".{name}{suffix}")
    }
}

/// The ledger's directory and file name.
pub(crate) fn split(path: &Path) -> io::Result<(PathBuf, String)> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "usage ledger path has no file name"))?
        .to_string_lossy()
        .into_owned();
    Ok((dir, name))
}

/// An exclusive `flock` on the ledger's sidecar lock file, held until dropped. The lock
/// file is never removed (removing it would let two writers lock different files).
pub(crate) struct LedgerLock {
    _file: File,
}

impl LedgerLock {
    pub(crate) fn acquire(dir: &Path, name: &str) -> io::Result<Self> {
        let path = dir.join(hidden(name, ".lock"));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| io::Error::new(e.kind(), format!("cannot open lock file {}: {e}", path.display())))?;
        loop {
            // SAFETY: plain syscall on a descriptor we own; released when it closes.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(LedgerLock { _file: file });
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(io::Error::new(err.kind(), format!("cannot lock {}: {err}", path.display())));
            }
        }
    }
}

/// The temp-file name prefix of a ledger called `name`; the full name is
/// `<prefix><pid>.<seq>`.
pub(crate) fn temp_prefix(name: &str) -> String {
    hidden(name, ".tmp.")
}

/// The pid that owns temp file `file_name`, when it is one of ours for `name`.
pub(crate) fn temp_owner(name: &str, file_name: &str) -> Option<u32> {
    let rest = file_name.strip_prefix(&temp_prefix(name))?;
    let (pid, seq) = rest.split_once('.')?;
    if seq.is_empty() || !seq.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok()
}

fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks for existence and permission.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Removes temp files left by killed flushes: ours by name, and either owned by a dead
/// process, by this process (the caller holds the lock, so none of ours is in flight),
/// or older than [`STALE_TEMP_AGE`]. Returns how many were removed.
pub(crate) fn remove_stale_temps(dir: &Path, name: &str) -> usize {
    let Ok(entries) = fs::read_dir(dir) else { return 0 };
    let me = std::process::id();
    let mut removed = 0;
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(owner) = temp_owner(name, &file_name.to_string_lossy()) else { continue };
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .is_some_and(|age| age > STALE_TEMP_AGE);
        if (owner == me || !pid_alive(owner) || old) && fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Keeps a copy of a damaged ledger next to it as `<name>.damaged-<unix time>` (a hard
/// link, else a copy); returns its path.
pub(crate) fn set_aside(path: &Path) -> io::Result<PathBuf> {
    let (dir, name) = split(path)?;
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let mut aside = dir.join(format!("{name}.damaged-{secs}"));
    let mut n = 1;
    while aside.symlink_metadata().is_ok() {
        aside = dir.join(format!("{name}.damaged-{secs}-{n}"));
        n += 1;
    }
    if fs::hard_link(path, &aside).is_err() {
        fs::copy(path, &aside)?;
    }
    Ok(aside)
}

/// Whether the file exists and has no write permission bit at all (a user's way of
/// saying "leave it alone"; root could write it anyway).
pub(crate) fn is_read_only(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o222 == 0)
}

/// Replaces `path` with `text`: a temp file in the same directory, written and fsynced,
/// given the old file's mode, renamed over the ledger, then the directory fsynced.
/// Call with the lock held.
pub(crate) fn replace(path: &Path, text: &[u8]) -> io::Result<()> {
    let (dir, name) = split(path)?;
    let temp =
        dir.join(format!("{}{}.{}", temp_prefix(&name), std::process::id(), FLUSH_SEQ.fetch_add(1, Ordering::Relaxed)));
    let mode = fs::metadata(path).ok().map(|m| m.permissions().mode() & 0o7777);
    let result = (|| {
        let mut file = File::create(&temp)?;
        file.write_all(text)?;
        if let Some(mode) = mode {
            file.set_permissions(fs::Permissions::from_mode(mode))?;
        }
        file.sync_all()?;
        drop(file);
        fs::rename(&temp, path)?;
        // Make the rename itself durable.
        File::open(&dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = fs::remove_file(&temp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_saturate_and_signs_are_read() {
        assert_eq!(int_field("12"), Some((false, 12)));
        assert_eq!(int_field("+12"), Some((false, 12)));
        assert_eq!(int_field("-3"), Some((true, 3)));
        assert_eq!(int_field("99999999999999999999999999"), Some((false, u64::MAX)));
        for bad in ["", "-", "+", "1x", "0x10", "1.0", "--1"] {
            assert_eq!(int_field(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn temp_names_are_recognised() {
        assert_eq!(temp_owner(".coli_usage", ".coli_usage.tmp.123.4"), Some(123));
        assert_eq!(temp_owner("usage", ".usage.tmp.9.0"), Some(9));
        for other in [".coli_usage", ".coli_usage.tmp.", ".coli_usage.tmp.1", ".coli_usage.tmp.1.x", "x.tmp.1.2"] {
            assert_eq!(temp_owner(".coli_usage", other), None, "{other}");
        }
    }

    #[test]
    fn lines_are_numbered_and_non_text_is_damage() {
        let got: Vec<_> = lines(b"a\n\xff\nb").map(|(n, l)| (n, l.is_ok())).collect();
        assert_eq!(got, vec![(1, true), (2, false), (3, true)]);
        assert_eq!(lines(b"").count(), 0);
        assert_eq!(lines(b"x\n").count(), 1);
    }
}
