//! The usage ledger: persistent per-expert selection counts in the C engine's
//! `.coli_usage` text format (version 1), plus session heat and recency for LFRU.
//!
//! File format, one record per line `<layer> <expert> <count>`, sparse (non-zero counts
//! only), preceded by two header records whose negative layer field makes old readers
//! (`while (fscanf("%d %d %u") == 3)` guarded by `layer >= 0`) skip them:
//!
//! ```text
//! -1 <n_layers> <n_experts>
//! -2 <format_version> <engine_id>
//! ```
//!
//! `engine_id` is the 32-bit FNV-1a hash of the engine name (`glm_moe_dsa` for GLM-5.x)
//! and sits in the third field because old readers parse that one with `%u`. `n_layers`
//! is inclusive: rows `0..=n_layers` exist, the last one being the MTP layer. An empty
//! history is written as a zero-byte file, as the C engine does.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use serde::Serialize;

use crate::ExpertKey;

/// The ledger format this build reads and writes.
pub const FORMAT_VERSION: u32 = 1;
/// The engine name whose hash GLM-5.x ledgers carry.
pub const GLM_ENGINE: &str = "glm_moe_dsa";
/// Engine names known to write this format, so a mismatch can name the writer.
const KNOWN_ENGINES: [&str; 4] = ["glm_moe_dsa", "inkling", "olmoe", "kimi_k3"];

/// The explicit-override warning is printed once per process, like the C engine's.
static OVERRIDE_WARNED: AtomicBool = AtomicBool::new(false);
/// Distinguishes concurrent flushes' temp files within one process.
static FLUSH_SEQ: AtomicU64 = AtomicU64::new(0);

/// 32-bit FNV-1a, the C engine's stable engine-id hash.
pub fn fnv1a32(s: &str) -> u32 {
    s.bytes().fold(2_166_136_261u32, |h, b| (h ^ b as u32).wrapping_mul(16_777_619))
}

fn engine_name(id: u32) -> String {
    KNOWN_ENGINES
        .iter()
        .find(|name| fnv1a32(name) == id)
        .map(|name| name.to_string())
        .unwrap_or_else(|| format!("an unknown engine (id {id})"))
}

/// Why a ledger could not be opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LedgerError {
    /// The file declares another model shape, a newer format, or (unless named
    /// explicitly) another engine. The message names both sides.
    Refused(String),
    /// The ledger's own configuration is invalid.
    InvalidConfig(String),
}

impl std::fmt::Display for LedgerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LedgerError::Refused(msg) | LedgerError::InvalidConfig(msg) => f.write_str(msg),
        }
    }
}

impl std::error::Error for LedgerError {}

/// Ledger totals for telemetry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LedgerSnapshot {
    /// Session clock: one tick per recorded selection.
    pub clock: u64,
    /// Selections recorded this session.
    pub session_selections: u64,
    /// Sum of all persistent counts (history + session).
    pub total_selections: u64,
    /// Experts with a non-zero count.
    pub nonzero: usize,
    /// Selections naming an untracked layer or expert, ignored.
    pub ignored_selections: u64,
    /// Whether counts changed since the last flush.
    pub dirty: bool,
}

/// Per tracked layer: persistent counts and session heat/recency.
#[derive(Debug, Clone)]
struct Row {
    counts: Vec<u32>,
    heat: Vec<u32>,
    last: Vec<u64>,
}

/// Persistent expert usage (see the module docs for the file format).
#[derive(Debug, Clone)]
pub struct UsageLedger {
    path: PathBuf,
    engine: String,
    n_layers: usize,
    n_experts: usize,
    /// Indexed by model layer `0..=n_layers`; None for dense (untracked) layers.
    rows: Vec<Option<Row>>,
    clock: u64,
    session_selections: u64,
    ignored_selections: u64,
    dirty: bool,
}

/// How reading a file failed.
enum ReadFailure {
    Damaged(String),
    Refused(String),
}

impl UsageLedger {
    /// A fresh, empty ledger for `engine` (nothing is read).
    ///
    /// `n_layers` is inclusive (rows `0..=n_layers`; GLM-5: the MTP layer's index);
    /// `sparse_layers` lists the rows that exist (MoE layers, plus the MTP layer when it
    /// has experts); records naming any other layer are dropped.
    pub fn new(
        engine: &str,
        path: impl Into<PathBuf>,
        n_layers: usize,
        n_experts: usize,
        sparse_layers: &[usize],
    ) -> Result<Self, LedgerError> {
        if n_experts == 0 || n_experts > u32::MAX as usize {
            return Err(LedgerError::InvalidConfig(format!("usage ledger: n_experts {n_experts} is out of range")));
        }
        if let Some(&bad) = sparse_layers.iter().find(|&&l| l > n_layers) {
            return Err(LedgerError::InvalidConfig(format!(
                "usage ledger: sparse layer {bad} is beyond n_layers {n_layers} (inclusive)"
            )));
        }
        let mut rows = vec![None; n_layers + 1];
        for &l in sparse_layers {
            rows[l] = Some(Row { counts: vec![0; n_experts], heat: vec![0; n_experts], last: vec![0; n_experts] });
        }
        Ok(UsageLedger {
            path: path.into(),
            engine: engine.to_string(),
            n_layers,
            n_experts,
            rows,
            clock: 0,
            session_selections: 0,
            ignored_selections: 0,
            dirty: false,
        })
    }

    /// Opens the GLM-5 (`glm_moe_dsa`) ledger at `path`; see [`Self::open_for_engine`].
    pub fn open(
        path: impl Into<PathBuf>,
        n_layers: usize,
        n_experts: usize,
        sparse_layers: &[usize],
        explicit: bool,
    ) -> Result<(Self, Vec<String>), LedgerError> {
        Self::open_for_engine(GLM_ENGINE, path, n_layers, n_experts, sparse_layers, explicit)
    }

    /// Opens a ledger, loading the file when it exists. Returns the ledger and any
    /// warnings for the user.
    ///
    /// - A missing file gives an empty ledger; a headerless (legacy) file is accepted.
    /// - A damaged or unreadable file gives a warning and an empty ledger (the next
    ///   flush replaces it); never an error.
    /// - Declared dimensions that differ, or a newer format version, are refused
    ///   ([`LedgerError::Refused`], naming both sides).
    /// - Another engine's file is refused unless `explicit` (the user named the path),
    ///   in which case it is used with a warning, once per process.
    /// - Records naming untracked layers or experts are dropped (with a warning);
    ///   other negative layer ids are reserved header records and skipped.
    ///
    /// On refusal the caller decides: stop with the message, or run without a ledger.
    /// Do not flush a fresh ledger over a refused file unless the user asks to.
    pub fn open_for_engine(
        engine: &str,
        path: impl Into<PathBuf>,
        n_layers: usize,
        n_experts: usize,
        sparse_layers: &[usize],
        explicit: bool,
    ) -> Result<(Self, Vec<String>), LedgerError> {
        let mut ledger = Self::new(engine, path, n_layers, n_experts, sparse_layers)?;
        let mut warnings = Vec::new();
        let bytes = match fs::read(&ledger.path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((ledger, warnings)),
            Err(e) => {
                warnings.push(format!("cannot read usage ledger {}: {e}; starting a fresh one", ledger.path.display()));
                return Ok((ledger, warnings));
            }
        };
        match ledger.load(&bytes, explicit, &mut warnings) {
            Ok(()) => Ok((ledger, warnings)),
            Err(ReadFailure::Refused(msg)) => Err(LedgerError::Refused(msg)),
            Err(ReadFailure::Damaged(detail)) => {
                ledger.clear_counts();
                warnings.push(format!(
                    "ignoring damaged usage ledger {}: {detail}; starting a fresh one",
                    ledger.path.display()
                ));
                Ok((ledger, warnings))
            }
        }
    }

    fn load(&mut self, bytes: &[u8], explicit: bool, warnings: &mut Vec<String>) -> Result<(), ReadFailure> {
        let path = self.path.display().to_string();
        let text = std::str::from_utf8(bytes).map_err(|e| ReadFailure::Damaged(format!("not text ({e})")))?;
        let mut dropped = 0u64;
        for (index, line) in text.lines().enumerate() {
            let n = index + 1;
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.is_empty() {
                continue;
            }
            let [f1, f2, f3] = fields[..] else {
                return Err(ReadFailure::Damaged(format!(
                    "line {n}: expected `<layer> <expert> <count>`, found {line:?}"
                )));
            };
            let bad = |what: &str, field: &str| ReadFailure::Damaged(format!("line {n}: invalid {what} {field:?}"));
            let layer: i64 = f1.parse().map_err(|_| bad("layer", f1))?;
            let second: i64 = f2.parse().map_err(|_| bad("second field", f2))?;
            let third: u64 = f3.parse().map_err(|_| bad("third field", f3))?;
            match layer {
                -1 => {
                    if second != self.n_layers as i64 || third != self.n_experts as u64 {
                        return Err(ReadFailure::Refused(format!(
                            "usage ledger {path}: history is {second} layers x {third} experts, this model \
                             is {} x {}; refusing rather than misreading it",
                            self.n_layers, self.n_experts
                        )));
                    }
                }
                -2 => {
                    if second > FORMAT_VERSION as i64 {
                        return Err(ReadFailure::Refused(format!(
                            "usage ledger {path}: format version {second}, this build reads {FORMAT_VERSION}; \
                             refusing rather than misreading it"
                        )));
                    }
                    let ours = fnv1a32(&self.engine);
                    if third != ours as u64 {
                        let writer = u32::try_from(third)
                            .map(engine_name)
                            .unwrap_or_else(|_| format!("an unknown engine (id {third})"));
                        if !explicit {
                            return Err(ReadFailure::Refused(format!(
                                "usage ledger {path}: written by {writer}, this engine is {}; refusing \
                                 (name the file explicitly to use it anyway)",
                                self.engine
                            )));
                        }
                        if !OVERRIDE_WARNED.swap(true, Ordering::Relaxed) {
                            warnings.push(format!(
                                "usage ledger {path}: written by {writer}, this engine is {}; honouring \
                                 it because you named it explicitly (placement only; expert ids do not \
                                 transfer between engines)",
                                self.engine
                            ));
                        }
                    }
                }
                l if l < 0 => {} // reserved for future header records
                l => {
                    let expert = usize::try_from(second).ok().filter(|&e| e < self.n_experts);
                    let row = usize::try_from(l).ok().and_then(|l| self.rows.get_mut(l)).and_then(Option::as_mut);
                    match (row, expert) {
                        (Some(row), Some(e)) => {
                            let add = u32::try_from(third).unwrap_or(u32::MAX);
                            row.counts[e] = row.counts[e].saturating_add(add);
                        }
                        _ => dropped += 1,
                    }
                }
            }
        }
        if dropped > 0 {
            warnings.push(format!(
                "usage ledger {path}: dropped {dropped} records naming layers or experts this model \
                 does not track"
            ));
        }
        Ok(())
    }

    fn clear_counts(&mut self) {
        for row in self.rows.iter_mut().flatten() {
            row.counts.fill(0);
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Inclusive: rows `0..=n_layers`.
    pub fn n_layers(&self) -> usize {
        self.n_layers
    }

    pub fn n_experts(&self) -> usize {
        self.n_experts
    }

    /// The tracked (sparse) layers, ascending.
    pub fn layers(&self) -> Vec<usize> {
        (0..self.rows.len()).filter(|&l| self.rows[l].is_some()).collect()
    }

    fn row(&self, layer: usize) -> Option<&Row> {
        self.rows.get(layer).and_then(Option::as_ref)
    }

    /// Counts every selection of one router call (all rows' top-k, before batch-union
    /// dedup): count and heat +1 each (saturating at u32::MAX), clock +1 per selection.
    /// Selections naming an untracked layer or expert are ignored (counted in the
    /// snapshot).
    pub fn record(&mut self, layer: usize, experts: &[usize]) {
        let n_experts = self.n_experts;
        let Some(row) = self.rows.get_mut(layer).and_then(Option::as_mut) else {
            self.ignored_selections += experts.len() as u64;
            return;
        };
        for &e in experts {
            if e >= n_experts {
                self.ignored_selections += 1;
                continue;
            }
            self.clock += 1;
            row.counts[e] = row.counts[e].saturating_add(1);
            row.heat[e] = row.heat[e].saturating_add(1);
            row.last[e] = self.clock;
            self.session_selections += 1;
            self.dirty = true;
        }
    }

    /// Persistent count (history + session); 0 for untracked keys.
    pub fn count(&self, layer: usize, expert: usize) -> u32 {
        self.row(layer).and_then(|r| r.counts.get(expert)).copied().unwrap_or(0)
    }

    /// Session heat; 0 for untracked keys.
    pub fn heat(&self, layer: usize, expert: usize) -> u32 {
        self.row(layer).and_then(|r| r.heat.get(expert)).copied().unwrap_or(0)
    }

    /// The clock at the expert's last selection (0: never this session).
    pub fn last_access(&self, layer: usize, expert: usize) -> u64 {
        self.row(layer).and_then(|r| r.last.get(expert)).copied().unwrap_or(0)
    }

    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// LFRU score = `heat * 256 + max(0, 255 - age)`, age = clock - last access.
    pub fn lfru_score(&self, key: ExpertKey) -> u64 {
        let (layer, expert) = key;
        let age = self.clock - self.last_access(layer, expert);
        self.heat(layer, expert) as u64 * 256 + 255u64.saturating_sub(age)
    }

    /// Turn boundary: every heat halves.
    pub fn decay_heat(&mut self) {
        for row in self.rows.iter_mut().flatten() {
            for h in &mut row.heat {
                *h >>= 1;
            }
        }
    }

    /// Sum of all persistent counts: the history auto-pin judges confidence by.
    pub fn total_selections(&self) -> u64 {
        self.rows.iter().flatten().flat_map(|r| r.counts.iter()).map(|&c| c as u64).sum()
    }

    pub fn snapshot(&self) -> LedgerSnapshot {
        LedgerSnapshot {
            clock: self.clock,
            session_selections: self.session_selections,
            total_selections: self.total_selections(),
            nonzero: self.rows.iter().flatten().flat_map(|r| r.counts.iter()).filter(|&&c| c > 0).count(),
            ignored_selections: self.ignored_selections,
            dirty: self.dirty,
        }
    }

    /// Every non-zero count, by descending count, then layer, then expert.
    pub fn ranked_counts(&self) -> Vec<(ExpertKey, u32)> {
        let mut ranked: Vec<(ExpertKey, u32)> = self
            .rows
            .iter()
            .enumerate()
            .filter_map(|(l, r)| r.as_ref().map(|r| (l, r)))
            .flat_map(|(l, r)| r.counts.iter().enumerate().filter(|(_, &c)| c > 0).map(move |(e, &c)| ((l, e), c)))
            .collect();
        ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        ranked
    }

    /// The file contents: headers and sparse records, or nothing for an empty history.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        if self.rows.iter().flatten().all(|r| r.counts.iter().all(|&c| c == 0)) {
            return out;
        }
        use std::fmt::Write as _;
        let _ = writeln!(out, "-1 {} {}", self.n_layers, self.n_experts);
        let _ = writeln!(out, "-2 {} {}", FORMAT_VERSION, fnv1a32(&self.engine));
        for (layer, row) in self.rows.iter().enumerate() {
            for (expert, &count) in row.iter().flat_map(|r| r.counts.iter().enumerate()) {
                if count > 0 {
                    let _ = writeln!(out, "{layer} {expert} {count}");
                }
            }
        }
        out
    }

    /// Writes the ledger atomically if counts changed since the last flush: a temp file
    /// in the same directory, written and fsynced, renamed over the ledger, then the
    /// directory fsynced. A crash at any moment leaves the old or the new file whole
    /// (a killed process may leave a `.NAME.tmp.*` file behind). Returns whether it wrote.
    pub fn flush(&mut self) -> io::Result<bool> {
        if !self.dirty {
            return Ok(false);
        }
        self.write_atomically()?;
        self.dirty = false;
        Ok(true)
    }

    /// Like [`Self::flush`] but writes even when nothing changed.
    pub fn write_atomically(&self) -> io::Result<()> {
        let dir = match self.path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = self
            .path
            .file_name()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "usage ledger path has no file name"))?;
        let temp = dir.join(format!(
            ".{}.tmp.{}.{}",
            name.to_string_lossy(),
            std::process::id(),
            FLUSH_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let result = (|| {
            let mut file = File::create(&temp)?;
            file.write_all(self.to_text().as_bytes())?;
            file.sync_all()?;
            drop(file);
            fs::rename(&temp, &self.path)?;
            // Make the rename itself durable.
            File::open(&dir)?.sync_all()
        })();
        if result.is_err() {
            let _ = fs::remove_file(&temp);
        }
        result.map_err(|e| io::Error::new(e.kind(), format!("writing usage ledger {}: {e}", self.path.display())))
    }
}

#[cfg(test)]
mod tests;
