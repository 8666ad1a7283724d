//! Checksums for the public Colibri container, which records none: computed once (one
//! read of every expert's covering range) and kept in a sidecar, `<dir>/.strata-colibri.sums`
//! (JSON), keyed by every `out-*` file's name, size and modification time and by the
//! experts' covering ranges, so a changed file or a different model shape invalidates it.
//!
//! When a file changed since the sums were recorded, they are recomputed; experts whose
//! bytes differ from the old record are named in a warning (a re-download of the same
//! model changes nothing; an in-place overwrite shows up there). A read-only directory
//! keeps the sums in memory, with a warning.

use crate::checksum::{parts_checksum, region_checksum, CHECKSUM_ALGORITHM};
use crate::colibri::{ColibriContainer, ColibriExpert};
use crate::container::write_atomic;
use anyhow::{anyhow, Context, Result};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::UNIX_EPOCH;

/// The sidecar's file name in the container directory.
pub const COLIBRI_SUMS_FILE: &str = ".strata-colibri.sums";
const SUMS_FORMAT: &str = "strata-colibri-sums";
const SUMS_VERSION: u32 = 1;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct FileKey {
    name: String,
    len: u64,
    mtime_ns: u128,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct TierSums {
    name: String,
    /// xxh3 of every expert's (file, cover offset, cover length): the layout they cover.
    layout: u64,
    checksums: Vec<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Sidecar {
    format: String,
    version: u32,
    algorithm: String,
    files: Vec<FileKey>,
    tiers: Vec<TierSums>,
}

fn file_keys(c: &ColibriContainer) -> Result<Vec<FileKey>> {
    c.files()
        .iter()
        .map(|f| {
            let meta = std::fs::metadata(&f.path).with_context(|| format!("{}: cannot stat", f.path.display()))?;
            let mtime_ns =
                meta.modified().ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos());
            let name = f.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            Ok(FileKey { name, len: meta.len(), mtime_ns })
        })
        .collect()
}

fn layout_key(experts: &[ColibriExpert]) -> u64 {
    let mut bytes = Vec::with_capacity(experts.len() * 24);
    for e in experts {
        bytes.extend_from_slice(&(e.file as u64).to_le_bytes());
        bytes.extend_from_slice(&e.cover_offset.to_le_bytes());
        bytes.extend_from_slice(&(e.cover_len as u64).to_le_bytes());
    }
    region_checksum(&bytes)
}

/// The checksum of `e`'s six tensors as its covering read puts them in a slot (see
/// [`ColibriExpert::tensor_ranges`]).
fn cover_checksum(files: &[File], lens: &[u64], e: &ColibriExpert, buf: &mut Vec<u8>, path: &Path) -> Result<u64> {
    buf.clear();
    buf.resize(e.cover_len, 0);
    let have = e.cover_len.min(lens[e.file].saturating_sub(e.cover_offset) as usize);
    files[e.file].read_exact_at(&mut buf[..have], e.cover_offset).with_context(|| {
        format!("{}: reading layer {} expert {} for its checksum", path.display(), e.layer, e.expert)
    })?;
    Ok(parts_checksum(e.tensor_ranges().into_iter().map(|(at, len)| &buf[at..at + len])))
}

fn read_sidecar(path: &Path) -> Option<Sidecar> {
    let text = std::fs::read_to_string(path).ok()?;
    let s: Sidecar = serde_json::from_str(&text).ok()?;
    (s.format == SUMS_FORMAT && s.version == SUMS_VERSION && s.algorithm == CHECKSUM_ALGORITHM).then_some(s)
}

impl ColibriContainer {
    /// Gives every tier its experts' checksums: from the sidecar when it matches the
    /// files and layout, else computed (reading every expert once) and saved. Returns
    /// warnings for the user (sums recomputed because files changed, experts whose bytes
    /// differ from the old record, a sidecar that could not be saved).
    pub fn ensure_checksums(&mut self) -> Result<Vec<String>> {
        let sidecar_path = self.dir().join(COLIBRI_SUMS_FILE);
        let keys = file_keys(self)?;
        let layouts: Vec<(String, u64)> =
            self.tiers().iter().map(|t| (t.name.clone(), layout_key(&t.experts))).collect();
        let old = read_sidecar(&sidecar_path);
        let same_layout = |s: &Sidecar| {
            s.tiers.len() == layouts.len()
                && s.tiers.iter().zip(&layouts).all(|(t, (name, layout))| &t.name == name && t.layout == *layout)
        };
        if let Some(s) = old.as_ref().filter(|s| s.files == keys && same_layout(s)) {
            for (tier, sums) in self.tiers_mut().iter_mut().zip(&s.tiers) {
                if sums.checksums.len() == tier.experts.len() {
                    tier.checksums = sums.checksums.clone();
                }
            }
            if self.tiers().iter().all(|t| t.checksums.len() == t.experts.len()) {
                return Ok(Vec::new());
            }
        }
        let mut warnings = Vec::new();
        let experts: usize = self.tiers().iter().map(|t| t.experts.len()).sum();
        eprintln!(
            "strata: recording checksums of {experts} experts in {} (once; kept in {})",
            self.dir().display(),
            sidecar_path.display()
        );
        let files: Vec<File> = self
            .files()
            .iter()
            .map(|f| File::open(&f.path).with_context(|| format!("{}: cannot open", f.path.display())))
            .collect::<Result<_>>()?;
        let lens: Vec<u64> = keys.iter().map(|k| k.len).collect();
        let paths: Vec<_> = self.files().iter().map(|f| f.path.clone()).collect();
        let mut buf = Vec::new();
        let mut tiers = Vec::new();
        for (tier, (name, layout)) in self.tiers().iter().zip(&layouts) {
            let checksums = tier
                .experts
                .iter()
                .map(|e| cover_checksum(&files, &lens, e, &mut buf, &paths[e.file]))
                .collect::<Result<Vec<u64>>>()?;
            tiers.push(TierSums { name: name.clone(), layout: *layout, checksums });
        }
        if let Some(old) = old.as_ref().filter(|s| same_layout(s)) {
            let changed: Vec<String> = keys.iter().filter(|k| !old.files.contains(k)).map(|k| k.name.clone()).collect();
            let mut differ = Vec::new();
            for ((tier, new), old) in self.tiers().iter().zip(&tiers).zip(&old.tiers) {
                for ((e, a), b) in tier.experts.iter().zip(&new.checksums).zip(&old.checksums) {
                    if a != b {
                        differ.push(format!("{} layer {} expert {}", paths[e.file].display(), e.layer, e.expert));
                    }
                }
            }
            if !differ.is_empty() {
                let shown: Vec<&str> = differ.iter().take(5).map(String::as_str).collect();
                warnings.push(format!(
                    "{}: {} expert(s) differ from the checksums recorded before {} changed ({}{}); if these files \
                     were not replaced on purpose they are damaged: re-download them",
                    self.dir().display(),
                    differ.len(),
                    changed.join(", "),
                    shown.join("; "),
                    if differ.len() > shown.len() { "; ..." } else { "" }
                ));
            }
        }
        for (tier, sums) in self.tiers_mut().iter_mut().zip(&tiers) {
            tier.checksums = sums.checksums.clone();
        }
        let sidecar = Sidecar {
            format: SUMS_FORMAT.into(),
            version: SUMS_VERSION,
            algorithm: CHECKSUM_ALGORITHM.into(),
            files: keys,
            tiers,
        };
        let text = serde_json::to_string(&sidecar).map_err(|e| anyhow!("checksum sidecar: {e}"))?;
        if let Err(e) = write_atomic(&sidecar_path, text.as_bytes()) {
            warnings.push(format!(
                "{}: cannot save expert checksums ({e:#}); they are kept in memory and computed again next time",
                sidecar_path.display()
            ));
        }
        Ok(warnings)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::colibri::tests::synthetic;
    use crate::io::{AlignedBuf, IoPool};
    use std::io::{Seek, SeekFrom, Write};

    /// Reads every expert of `c` through a pool, verified; returns the failures.
    fn verified_reads(c: &ColibriContainer) -> Vec<String> {
        let pool = IoPool::open(&c.file_paths(), 1, false).unwrap();
        let mut failures = Vec::new();
        for tier in c.tiers() {
            let mut slot = AlignedBuf::new(tier.slot_bytes).unwrap();
            for e in &tier.experts {
                let check = tier.read_check(e.layer, e.expert).expect("checksums loaded");
                if let Err(err) = pool.read_checked(vec![e.cover_segment(0)], slot.as_mut_slice(), Some(check)) {
                    failures.push(err.to_string());
                }
            }
        }
        failures
    }

    #[test]
    fn sums_are_computed_once_then_loaded_and_catch_in_place_damage() {
        let dir = tempfile::tempdir().unwrap();
        let (dims, _) = synthetic(dir.path());
        let mut c = ColibriContainer::open(dir.path(), &dims).unwrap();
        assert!(c.tier("main").unwrap().read_check(1, 0).is_none(), "no sums before ensure_checksums");
        assert!(c.ensure_checksums().unwrap().is_empty());
        assert!(dir.path().join(COLIBRI_SUMS_FILE).is_file());
        let failures = verified_reads(&c);
        assert!(failures.is_empty(), "{failures:?}");
        let sums: Vec<u64> = c.tier("main").unwrap().checksums.clone();
        assert_eq!(sums.len(), 6);

        // Overwrite one expert's bytes in place (same size) with NaNs, and put the
        // modification time back: the sidecar still matches, so the recorded sums are
        // loaded and the damaged expert fails its read, named.
        let path = dir.path().join("out-00000.safetensors");
        let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
        let victim = c.tier("main").unwrap().expert(2, 1).unwrap().tensors[0];
        let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.seek(SeekFrom::Start(victim.offset)).unwrap();
        f.write_all(&f32::NAN.to_le_bytes().repeat(victim.len / 4)).unwrap();
        f.set_modified(mtime).unwrap();
        drop(f);
        let mut again = ColibriContainer::open(dir.path(), &dims).unwrap();
        assert!(again.ensure_checksums().unwrap().is_empty());
        assert_eq!(again.tier("main").unwrap().checksums, sums, "loaded, not recomputed");
        let failures = verified_reads(&again);
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(failures[0].contains("out-00000.safetensors"), "{}", failures[0]);
        assert!(
            failures[0].contains("layer 2 expert 1") && failures[0].contains("checksum mismatch"),
            "{}",
            failures[0]
        );

        // A changed modification time invalidates the sidecar: the sums are recomputed
        // and the expert whose bytes differ from the record is named.
        std::fs::File::options().write(true).open(&path).unwrap().set_modified(std::time::SystemTime::now()).unwrap();
        let mut third = ColibriContainer::open(dir.path(), &dims).unwrap();
        let warnings = third.ensure_checksums().unwrap();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("1 expert(s) differ") && warnings[0].contains("layer 2 expert 1"), "{warnings:?}");
        assert!(verified_reads(&third).is_empty(), "the new bytes are the new record");
    }

    #[test]
    fn an_unwritable_sidecar_keeps_the_sums_in_memory() {
        let dir = tempfile::tempdir().unwrap();
        let (dims, _) = synthetic(dir.path());
        // A directory where the sidecar should go: it cannot be replaced.
        std::fs::create_dir(dir.path().join(COLIBRI_SUMS_FILE)).unwrap();
        let mut c = ColibriContainer::open(dir.path(), &dims).unwrap();
        let warnings = c.ensure_checksums().unwrap();
        assert!(warnings.len() == 1 && warnings[0].contains("kept in memory"), "{warnings:?}");
        assert!(verified_reads(&c).is_empty());
    }
}
