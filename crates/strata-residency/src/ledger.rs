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
//!
//! Trust rules (issue #10):
//! - Damage is per line: a line that is not a record (wrong field count, not integers, a
//!   negative count, not text) is reported with its line number; every readable record
//!   is kept, and the damaged file is kept next to the ledger as
//!   `<name>.damaged-<unix time>` before a cleaned file replaces it.
//! - Counts of any size saturate at `u32::MAX`.
//! - A ledger without write permission is left alone: flushes become no-ops (the first
//!   one returns an error the caller prints as a warning).
//! - Another engine's ledger is refused unless the caller asks to import it
//!   ([`LedgerOpen::allow_foreign`]); naming the file is not enough.
//! - Flushes merge: under an `flock` on a sidecar `<name>.lock`, the file on disk is
//!   read, this process's counts since its last flush are added, and the result
//!   replaces the file atomically (same-directory temp file, fsync, rename, directory
//!   fsync). Concurrent processes on one model lose no count. Temp files left by killed
//!   flushes (`<name>.tmp.<pid>.<seq>`) are removed by the next flush when their owner
//!   is dead or they are older than a minute.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::ExpertKey;

/// The ledger format this build reads and writes.
pub const FORMAT_VERSION: u32 = 1;
/// The engine name whose hash GLM-5.x ledgers carry.
pub const GLM_ENGINE: &str = "glm_moe_dsa";
/// Engine names known to write this format, so a mismatch can name the writer.
const KNOWN_ENGINES: [&str; 4] = ["glm_moe_dsa", "inkling", "olmoe", "kimi_k3"];

mod disk;

use disk::Line;

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
    /// The file declares another model shape, a newer format, or another engine (unless
    /// importing). The message names both sides.
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

/// How to open a ledger.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LedgerOpen {
    /// The user named the file (`--usage PATH`); only changes the wording of messages.
    pub explicit: bool,
    /// Import a ledger another engine wrote (`--usage-import`): its counts are used, with
    /// a warning, and the next flush rewrites the file under this engine's id. Without
    /// it such a file is refused.
    pub allow_foreign: bool,
}

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

/// Per tracked layer: persistent counts, this process's counts since its last flush,
/// and session heat/recency.
#[derive(Debug, Clone)]
struct Row {
    counts: Vec<u32>,
    delta: Vec<u32>,
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
    opts: LedgerOpen,
    /// Indexed by model layer `0..=n_layers`; None for dense (untracked) layers.
    rows: Vec<Option<Row>>,
    clock: u64,
    session_selections: u64,
    ignored_selections: u64,
    dirty: bool,
    /// The file is left alone (no write permission, or unreadable).
    read_only: bool,
    read_only_reported: bool,
    /// Warnings raised by flushes, for [`Self::take_warnings`].
    warnings: Vec<String>,
}

/// A file's contents as far as they are readable.
struct Parsed {
    /// Tracked (layer, expert, count) records.
    records: Vec<(usize, usize, u32)>,
    /// (line number, why) of every line that is not a record.
    damaged: Vec<(usize, String)>,
    /// Records naming layers or experts this model does not track.
    dropped: u64,
    /// The engine id of a foreign writer, when imported.
    foreign: Option<String>,
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
        let zeros = || vec![0; n_experts];
        for &l in sparse_layers {
            rows[l] = Some(Row { counts: zeros(), delta: zeros(), heat: zeros(), last: vec![0; n_experts] });
        }
        Ok(UsageLedger {
            path: path.into(),
            engine: engine.to_string(),
            n_layers,
            n_experts,
            opts: LedgerOpen::default(),
            rows,
            clock: 0,
            session_selections: 0,
            ignored_selections: 0,
            dirty: false,
            read_only: false,
            read_only_reported: false,
            warnings: Vec::new(),
        })
    }

    /// Opens the GLM-5 (`glm_moe_dsa`) ledger at `path`, refusing other engines' files;
    /// see [`Self::open_with`].
    pub fn open(
        path: impl Into<PathBuf>,
        n_layers: usize,
        n_experts: usize,
        sparse_layers: &[usize],
        explicit: bool,
    ) -> Result<(Self, Vec<String>), LedgerError> {
        Self::open_for_engine(GLM_ENGINE, path, n_layers, n_experts, sparse_layers, explicit)
    }

    /// [`Self::open_with`] without importing foreign files.
    pub fn open_for_engine(
        engine: &str,
        path: impl Into<PathBuf>,
        n_layers: usize,
        n_experts: usize,
        sparse_layers: &[usize],
        explicit: bool,
    ) -> Result<(Self, Vec<String>), LedgerError> {
        let opts = LedgerOpen { explicit, allow_foreign: false };
        Self::open_with(engine, path, n_layers, n_experts, sparse_layers, opts)
    }

    /// Opens a ledger, loading the file when it exists. Returns the ledger and warnings
    /// for the caller to print.
    ///
    /// - A missing file gives an empty ledger; a headerless (legacy) file is accepted.
    /// - Lines that are not records are reported by number; the readable records are
    ///   kept; the damaged file is kept as `<name>.damaged-<time>` and replaced by the
    ///   readable records (under the lock; skipped, with a warning, when read-only).
    /// - An unreadable file or one without write permission is left alone: the ledger
    ///   works in memory and never writes it.
    /// - Declared dimensions that differ, or a newer format version, are refused
    ///   ([`LedgerError::Refused`], naming both sides).
    /// - Another engine's file is refused unless `opts.allow_foreign`.
    /// - Records naming untracked layers or experts are dropped (with a warning);
    ///   other negative layer ids are reserved header records and skipped.
    pub fn open_with(
        engine: &str,
        path: impl Into<PathBuf>,
        n_layers: usize,
        n_experts: usize,
        sparse_layers: &[usize],
        opts: LedgerOpen,
    ) -> Result<(Self, Vec<String>), LedgerError> {
        let mut ledger = Self::new(engine, path, n_layers, n_experts, sparse_layers)?;
        ledger.opts = opts;
        let mut warnings = Vec::new();
        let shown = ledger.path.display().to_string();
        let bytes = match fs::read(&ledger.path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((ledger, warnings)),
            Err(e) => {
                ledger.read_only = true;
                ledger.read_only_reported = true;
                warnings
                    .push(format!("cannot read usage ledger {shown}: {e}; counting in memory, the file is left alone"));
                return Ok((ledger, warnings));
            }
        };
        let parsed = ledger.absorb(&bytes, &mut warnings)?;
        ledger.read_only = disk::is_read_only(&ledger.path);
        if !parsed.damaged.is_empty() {
            warnings.push(damage_message(&shown, &parsed));
            if ledger.read_only {
                warnings.push(format!("usage ledger {shown} is read-only: the damaged file is left as it is"));
            } else {
                // Set it aside and write back what was readable, under the lock.
                match ledger.merge_and_write() {
                    Ok(mut w) => warnings.append(&mut w),
                    Err(e) => warnings.push(format!("usage ledger {shown}: could not set the damaged file aside: {e}")),
                }
            }
        }
        Ok((ledger, warnings))
    }

    /// A ledger from file contents held in memory (fuzzing, tests): the rules of
    /// [`Self::open_with`], but nothing is read or written (damage is reported, not set
    /// aside). The ledger's path is `path`, for messages and later flushes.
    pub fn from_bytes(
        engine: &str,
        path: impl Into<PathBuf>,
        n_layers: usize,
        n_experts: usize,
        sparse_layers: &[usize],
        opts: LedgerOpen,
        bytes: &[u8],
    ) -> Result<(Self, Vec<String>), LedgerError> {
        let mut ledger = Self::new(engine, path, n_layers, n_experts, sparse_layers)?;
        ledger.opts = opts;
        let mut warnings = Vec::new();
        let parsed = ledger.absorb(bytes, &mut warnings)?;
        if !parsed.damaged.is_empty() {
            warnings.push(damage_message(&ledger.path.display().to_string(), &parsed));
        }
        Ok((ledger, warnings))
    }

    /// Parses `bytes` and adds their counts; warns about foreign writers and dropped
    /// records (not damage: the caller decides what to do with it).
    fn absorb(&mut self, bytes: &[u8], warnings: &mut Vec<String>) -> Result<Parsed, LedgerError> {
        let shown = self.path.display().to_string();
        let parsed = self.parse(bytes).map_err(LedgerError::Refused)?;
        if let Some(writer) = &parsed.foreign {
            warnings.push(format!(
                "usage ledger {shown}: written by {writer}, this engine is {}; importing its counts as asked \
                 (expert ids may not mean the same experts); the next save writes it as {}'s",
                self.engine, self.engine
            ));
        }
        if parsed.dropped > 0 {
            warnings.push(format!(
                "usage ledger {shown}: dropped {} records naming layers or experts this model does not track",
                parsed.dropped
            ));
        }
        for &(l, e, c) in &parsed.records {
            let row = self.rows[l].as_mut().expect("parse keeps tracked rows only");
            row.counts[e] = row.counts[e].saturating_add(c);
        }
        Ok(parsed)
    }

    /// Reads a file's records leniently; `Err` only for a refusal (another model's
    /// shape, a newer format, another engine unless importing).
    fn parse(&self, bytes: &[u8]) -> Result<Parsed, String> {
        let path = self.path.display();
        let mut parsed = Parsed { records: Vec::new(), damaged: Vec::new(), dropped: 0, foreign: None };
        for (n, line) in disk::lines(bytes) {
            let line = match line.and_then(disk::parse_line) {
                Ok(line) => line,
                Err(why) => {
                    parsed.damaged.push((n, why));
                    continue;
                }
            };
            match line {
                Line::Blank | Line::Reserved => {}
                Line::Dims(layers, experts) => {
                    if layers != Some(self.n_layers as u64) || experts != Some(self.n_experts as u64) {
                        let show = |v: Option<u64>| v.map_or("a negative number of".to_string(), |v| v.to_string());
                        return Err(format!(
                            "usage ledger {path}: history is {} layers x {} experts, this model is {} x {}; \
                             refusing rather than misreading it",
                            show(layers),
                            show(experts),
                            self.n_layers,
                            self.n_experts
                        ));
                    }
                }
                Line::Version(version, engine) => {
                    if version.is_none_or(|v| v > FORMAT_VERSION as u64) {
                        let v = version.map_or("negative".to_string(), |v| v.to_string());
                        return Err(format!(
                            "usage ledger {path}: format version {v}, this build reads {FORMAT_VERSION}; \
                             refusing rather than misreading it"
                        ));
                    }
                    let ours = fnv1a32(&self.engine) as u64;
                    if engine != Some(ours) {
                        let writer = engine
                            .and_then(|id| u32::try_from(id).ok())
                            .map(engine_name)
                            .unwrap_or_else(|| "an unknown engine (invalid id)".to_string());
                        if !self.opts.allow_foreign {
                            return Err(format!(
                                "usage ledger {path}: written by {writer}, this engine is {}; refusing \
                                 (import its counts with --usage-import, or name another file with --usage)",
                                self.engine
                            ));
                        }
                        parsed.foreign = Some(writer);
                    }
                }
                Line::Record { layer, expert, count } => {
                    let layer = usize::try_from(layer).ok().filter(|&l| self.rows.get(l).is_some_and(Option::is_some));
                    let expert = expert.and_then(|e| usize::try_from(e).ok()).filter(|&e| e < self.n_experts);
                    match (layer, expert) {
                        (Some(l), Some(e)) => parsed.records.push((l, e, count)),
                        _ => parsed.dropped += 1,
                    }
                }
            }
        }
        Ok(parsed)
    }

    /// Under the lock: reads the file on disk, adds this process's counts since its last
    /// flush, replaces the file atomically, and takes the merged counts as its own.
    /// A damaged file on disk is set aside first. Returns warnings.
    fn merge_and_write(&mut self) -> io::Result<Vec<String>> {
        let (dir, name) = disk::split(&self.path)?;
        let _lock = disk::LedgerLock::acquire(&dir, &name)?;
        let removed = disk::remove_stale_temps(&dir, &name);
        let shown = self.path.display().to_string();
        let mut warnings = Vec::new();
        if removed > 0 {
            warnings.push(format!("usage ledger {shown}: removed {removed} temp files left by killed runs"));
        }
        if disk::is_read_only(&self.path) {
            self.read_only = true;
            return Err(io::Error::new(io::ErrorKind::PermissionDenied, "the file is read-only"));
        }
        let mut merged: Vec<Option<Vec<u32>>> =
            self.rows.iter().map(|r| r.as_ref().map(|_| vec![0u32; self.n_experts])).collect();
        match fs::read(&self.path) {
            Ok(bytes) => {
                let parsed = self.parse(&bytes).map_err(io::Error::other)?;
                if !parsed.damaged.is_empty() {
                    let aside = disk::set_aside(&self.path)?;
                    warnings.push(format!(
                        "{}; the damaged file is kept as {}",
                        damage_message(&shown, &parsed),
                        aside.display()
                    ));
                }
                for (l, e, c) in parsed.records {
                    let row = merged[l].as_mut().expect("tracked");
                    row[e] = row[e].saturating_add(c);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        for (m, row) in merged.iter_mut().zip(&self.rows) {
            if let (Some(m), Some(row)) = (m.as_mut(), row) {
                for (c, d) in m.iter_mut().zip(&row.delta) {
                    *c = c.saturating_add(*d);
                }
            }
        }
        let text = render(&self.engine, self.n_layers, self.n_experts, &merged);
        disk::replace(&self.path, text.as_bytes())?;
        for (m, row) in merged.into_iter().zip(self.rows.iter_mut()) {
            if let (Some(m), Some(row)) = (m, row.as_mut()) {
                row.counts = m;
                row.delta.fill(0);
            }
        }
        self.dirty = false;
        Ok(warnings)
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
            row.delta[e] = row.delta[e].saturating_add(1);
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

    /// The file contents of the in-memory counts: headers and sparse records, or
    /// nothing for an empty history.
    pub fn to_text(&self) -> String {
        let counts: Vec<Option<Vec<u32>>> = self.rows.iter().map(|r| r.as_ref().map(|r| r.counts.clone())).collect();
        render(&self.engine, self.n_layers, self.n_experts, &counts)
    }

    /// Whether the file is left alone (no write permission, or unreadable at open).
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Warnings raised by flushes (a damaged file set aside, temp files removed); print
    /// them after [`Self::flush`].
    pub fn take_warnings(&mut self) -> Vec<String> {
        std::mem::take(&mut self.warnings)
    }

    /// Saves the counts if they changed since the last flush, merging with the file:
    /// under the sidecar lock, read the file, add this process's counts since its last
    /// flush, and replace the file atomically (same-directory temp file, fsync, rename,
    /// directory fsync). A crash at any moment leaves the old or the new file whole;
    /// concurrent processes lose no count. Returns whether it wrote.
    ///
    /// A read-only (or unreadable) ledger is never written: the first flush with
    /// something to save returns an error saying so (print it as a warning), later ones
    /// return `Ok(false)`. Other errors leave the counts pending for the next flush.
    pub fn flush(&mut self) -> io::Result<bool> {
        if !self.dirty {
            return Ok(false);
        }
        self.save()
    }

    /// Like [`Self::flush`] but writes even when nothing changed.
    pub fn write_atomically(&mut self) -> io::Result<()> {
        self.save().map(|_| ())
    }

    fn save(&mut self) -> io::Result<bool> {
        let shown = self.path.display().to_string();
        if self.read_only {
            if std::mem::replace(&mut self.read_only_reported, true) {
                return Ok(false);
            }
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("usage ledger {shown} is read-only; leaving it alone (this session's counts are not saved)"),
            ));
        }
        match self.merge_and_write() {
            Ok(mut warnings) => {
                self.warnings.append(&mut warnings);
                Ok(true)
            }
            Err(e) if self.read_only || matches!(e.kind(), io::ErrorKind::PermissionDenied) => {
                self.read_only = true;
                self.read_only_reported = true;
                Err(io::Error::new(
                    e.kind(),
                    format!(
                        "usage ledger {shown}: {e}; leaving it alone from now on (this session's counts are not saved)"
                    ),
                ))
            }
            Err(e) => Err(io::Error::new(e.kind(), format!("writing usage ledger {shown}: {e}"))),
        }
    }
}

/// One warning for a file's damaged lines (the first few by number).
fn damage_message(path: &str, parsed: &Parsed) -> String {
    const SHOWN: usize = 5;
    let mut lines: Vec<String> = parsed.damaged.iter().take(SHOWN).map(|(n, why)| format!("line {n}: {why}")).collect();
    if parsed.damaged.len() > SHOWN {
        lines.push(format!("and {} more", parsed.damaged.len() - SHOWN));
    }
    format!(
        "damaged usage ledger {path}: {} not a record ({}); kept the {} readable records",
        if parsed.damaged.len() == 1 { "1 line is".to_string() } else { format!("{} lines are", parsed.damaged.len()) },
        lines.join("; "),
        parsed.records.len()
    )
}

/// The file format: headers and sparse records, or nothing for an empty history.
fn render(engine: &str, n_layers: usize, n_experts: usize, rows: &[Option<Vec<u32>>]) -> String {
    let mut out = String::new();
    if rows.iter().flatten().all(|r| r.iter().all(|&c| c == 0)) {
        return out;
    }
    use std::fmt::Write as _;
    let _ = writeln!(out, "-1 {n_layers} {n_experts}");
    let _ = writeln!(out, "-2 {} {}", FORMAT_VERSION, fnv1a32(engine));
    for (layer, row) in rows.iter().enumerate() {
        for (expert, &count) in row.iter().flat_map(|r| r.iter().enumerate()) {
            if count > 0 {
                let _ = writeln!(out, "{layer} {expert} {count}");
            }
        }
    }
    out
}

#[cfg(test)]
mod tests;
