//! What the engine learned about speculating on a model and device, kept across runs.
//!
//! Whether drafting pays is measured ([`super::draft_epochs`]), and measuring costs: the
//! first speculating try of a request that drafting cannot repay (a launch-bound model on a
//! GPU) slows a short generation by a few percent. So the two rates an engine measured
//! (tokens a second with and without speculation) are written to the model directory's
//! `.strata/speculation.json`, keyed by the device and the batch size, and a later engine
//! there starts by keeping the faster side instead of trying both. Every
//! [`RECHECK_RUNS`]-th engine ignores what is kept and measures again, so a changed
//! machine or build is noticed. Writing is best effort: a directory that cannot be
//! written (a read-only model store) only loses the memory, never a request.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Engines that start from a kept verdict before one measures again.
pub const RECHECK_RUNS: u32 = 8;

/// Tokens a second decoding without and with speculation, as last measured.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rates {
    pub plain_tokens_per_s: f64,
    pub speculating_tokens_per_s: f64,
    /// Engines started from these rates since they were measured.
    #[serde(default)]
    pub runs: u32,
}

/// The file and this engine's key in it.
#[derive(Debug)]
pub struct SpeculationMemory {
    path: PathBuf,
    key: String,
}

impl SpeculationMemory {
    /// The memory of `model_dir` for engines on `device` running up to `max_batch`
    /// requests at once.
    pub fn new(model_dir: &Path, device: &str, max_batch: usize) -> Self {
        Self { path: model_dir.join(".strata").join("speculation.json"), key: format!("{device}; batch {max_batch}") }
    }

    fn read_all(&self) -> BTreeMap<String, Rates> {
        let Ok(text) = std::fs::read_to_string(&self.path) else { return BTreeMap::new() };
        // A damaged or foreign file is ignored (and replaced at the next write).
        serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| serde_json::from_value(v.get("rates")?.clone()).ok())
            .unwrap_or_default()
    }

    fn write_all(&self, all: &BTreeMap<String, Rates>) {
        let body =
            serde_json::json!({"about": "strata: decode rates with and without speculation, per device", "rates": all});
        let tmp = self.path.with_extension("json.tmp");
        let ok = self.path.parent().is_some_and(|d| std::fs::create_dir_all(d).is_ok())
            && std::fs::write(&tmp, format!("{body:#}\n")).is_ok()
            && std::fs::rename(&tmp, &self.path).is_ok();
        if !ok {
            let _ = std::fs::remove_file(&tmp);
        }
    }

    /// The kept rates an engine starts from, counting this start; `None` when there are
    /// none, or when it is time to measure again.
    pub fn start(&self) -> Option<Rates> {
        let mut all = self.read_all();
        let r = all.get_mut(&self.key)?;
        if r.runs + 1 >= RECHECK_RUNS || !(r.plain_tokens_per_s > 0.0 && r.speculating_tokens_per_s > 0.0) {
            return None;
        }
        r.runs += 1;
        let kept = *r;
        self.write_all(&all);
        Some(kept)
    }

    /// Keeps rates just measured (both sides).
    pub fn keep(&self, plain_tokens_per_s: f64, speculating_tokens_per_s: f64) {
        let mut all = self.read_all();
        all.insert(self.key.clone(), Rates { plain_tokens_per_s, speculating_tokens_per_s, runs: 0 });
        self.write_all(&all);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_kept_per_device_and_measured_again_now_and_then() {
        let dir = std::env::temp_dir().join(format!("strata-spec-mem-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let gpu = SpeculationMemory::new(&dir, "cuda:0 (H100)", 1);
        let cpu = SpeculationMemory::new(&dir, "cpu (2 threads)", 1);
        assert_eq!(gpu.start(), None, "nothing kept yet");
        gpu.keep(2000.0, 1500.0);
        assert_eq!(cpu.start(), None, "another device's rates are not this one's");
        assert_eq!(SpeculationMemory::new(&dir, "cuda:0 (H100)", 16).start(), None, "nor another batch size's");
        let starts: Vec<Option<Rates>> = (0..RECHECK_RUNS).map(|_| gpu.start()).collect();
        assert!(starts[..RECHECK_RUNS as usize - 1].iter().all(|s| s.is_some_and(|r| r.plain_tokens_per_s == 2000.0)));
        assert_eq!(starts[RECHECK_RUNS as usize - 1], None, "the eighth engine measures again");
        gpu.keep(2100.0, 2500.0);
        assert_eq!(gpu.start().map(|r| r.speculating_tokens_per_s), Some(2500.0));
        // A damaged file is as good as none, and is replaced.
        std::fs::write(dir.join(".strata/speculation.json"), "{not json").unwrap();
        assert_eq!(gpu.start(), None);
        gpu.keep(1.0, 2.0);
        assert!(gpu.start().is_some());
        // A directory that cannot be written loses the memory, nothing else.
        let blocked = SpeculationMemory::new(&dir.join(".strata/speculation.json/x"), "cpu", 1);
        blocked.keep(1.0, 2.0);
        assert_eq!(blocked.start(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
