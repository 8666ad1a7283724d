//! `--budget` on an HF checkpoint: its experts are converted once into an expert
//! container kept inside the model directory (`.strata/experts-<encoding>/`) and reused
//! while the weights are unchanged. bf16 and FP8 checkpoints convert to bf16 experts,
//! f32 checkpoints to f32: no precision is lost that the source had.
//!
//! Staleness is decided from what the container is made of, never from timestamps:
//! every `*.safetensors` file's name, size and a content fingerprint (xxh3 of its
//! header plus 16 evenly spaced 64 KiB samples of its data), and the `config.json`
//! fields that shape the conversion. Touching or editing `generation_config.json`, the
//! tokenizer or the chat template reconverts nothing. A reconversion says what changed;
//! a usage ledger an older strata kept in the old container is moved to the model
//! directory (where the ledger lives), never deleted.

use anyhow::{anyhow, Context, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use strata_kernels::{ElementType, QuantKind};
use strata_models::convert::{convert, ConvertOptions};
use strata_models::Arch;
use strata_storage::{region_checksum, WeightStore};

/// The stamp file in a container made by [`container_for`].
pub const STAMP_FILE: &str = "source.stamp";
/// The encoding of the draft (MTP) layer's experts in a converted container (its own
/// small tier, read for drafts only).
pub const MTP_EXPERTS: QuantKind = QuantKind::Int8Row;
const STAMP_HEADER: &str = "strata autoconvert stamp v2";
/// `config.json` fields the conversion's output depends on.
const CONFIG_KEYS: &[&str] = &[
    "num_hidden_layers",
    "n_routed_experts",
    "hidden_size",
    "moe_intermediate_size",
    "mlp_layer_types",
    "first_k_dense_replace",
    "num_nextn_predict_layers",
];
const SAMPLES: u64 = 16;
const SAMPLE_BYTES: u64 = 64 << 10;

/// xxh3 of a safetensors file's header and sampled data bytes.
fn fingerprint(path: &Path) -> Result<(u64, u64)> {
    let f = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let len = f.metadata().with_context(|| format!("{}: cannot stat", path.display()))?.len();
    let mut head = [0u8; 8];
    f.read_exact_at(&mut head, 0).with_context(|| format!("{}: too short for a safetensors header", path.display()))?;
    let header_len = u64::from_le_bytes(head).min(len.saturating_sub(8));
    let mut bytes = vec![0u8; 8 + header_len as usize];
    f.read_exact_at(&mut bytes, 0).with_context(|| format!("{}: cannot read its header", path.display()))?;
    let data_start = 8 + header_len;
    let data_len = len - data_start;
    let mut sample = vec![0u8; SAMPLE_BYTES.min(data_len) as usize];
    for i in 0..SAMPLES {
        let at = data_start + (data_len - sample.len() as u64) * i / (SAMPLES - 1);
        f.read_exact_at(&mut sample, at).with_context(|| format!("{}: cannot read at {at}", path.display()))?;
        bytes.extend_from_slice(&sample);
    }
    Ok((len, region_checksum(&bytes)))
}

/// What the conversion is made of, one line per item (sorted): the cache key.
pub fn stamp(dir: &Path) -> Result<String> {
    let mut lines = Vec::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("{}: cannot list", dir.display()))? {
        let p = e?.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("").to_string();
        if p.is_file() && name.ends_with(".safetensors") {
            let (len, sum) = fingerprint(&p)?;
            lines.push(format!("weights {name} {len} {sum:016x}"));
        }
    }
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).with_context(|| format!("{}: cannot read", cfg_path.display()))?;
    let cfg: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| anyhow!("{}: invalid JSON: {e}", cfg_path.display()))?;
    for key in CONFIG_KEYS {
        lines.push(format!("config {key} {}", cfg.get(key).unwrap_or(&serde_json::Value::Null)));
    }
    lines.sort();
    Ok(format!("{STAMP_HEADER}\n{}\n", lines.join("\n")))
}

/// Why a container stamped `old` is stale for `new` (None: it is current).
pub fn staleness(old: Option<&str>, new: &str) -> Option<String> {
    let Some(old) = old else { return Some("no conversion yet".into()) };
    if old == new {
        return None;
    }
    if !old.starts_with(STAMP_HEADER) {
        return Some("the copy was made by an older strata that stamped file times, not contents".into());
    }
    let item = |line: &str| {
        let mut w = line.splitn(3, ' ');
        (w.next().unwrap_or("").to_string(), w.next().unwrap_or("").to_string(), w.next().unwrap_or("").to_string())
    };
    let olds: Vec<_> = old.lines().skip(1).map(item).collect();
    let news: Vec<_> = new.lines().skip(1).map(item).collect();
    let mut why = Vec::new();
    for (kind, name, value) in &news {
        match olds.iter().find(|(k, n, _)| k == kind && n == name) {
            None => why.push(format!("{name} is new")),
            Some((_, _, v)) if v != value && kind == "config" => {
                why.push(format!("config.json `{name}` {v} -> {value}"))
            }
            Some((_, _, v)) if v != value => {
                let size = |s: &str| s.split(' ').next().unwrap_or("").to_string();
                if size(v) == size(value) {
                    why.push(format!("{name}: contents changed"));
                } else {
                    why.push(format!("{name}: size {} -> {} bytes", size(v), size(value)));
                }
            }
            _ => {}
        }
    }
    for (kind, name, _) in &olds {
        if !news.iter().any(|(k, n, _)| k == kind && n == name) {
            why.push(format!("{name} is gone"));
        }
    }
    Some(if why.is_empty() { "the stamp changed".into() } else { why.join("; ") })
}

/// The routed experts' encoding that keeps the checkpoint's precision.
pub fn lossless_kind(store: &WeightStore) -> QuantKind {
    // gpt-oss's MXFP4 experts move into the container as they are.
    if store.names().any(|n| n.ends_with(".mlp.experts.gate_up_proj_blocks")) {
        return QuantKind::Mxfp4;
    }
    let f32_experts = store
        .names()
        .filter(|n| n.contains(".experts.") && !n.contains("shared_experts.") && !n.ends_with("_bias"))
        .all(|n| store.get(n).is_some_and(|(_, t)| t.dtype == ElementType::F32));
    if f32_experts {
        QuantKind::F32
    } else {
        QuantKind::Bf16
    }
}

/// The expert-container copy of the HF checkpoint `dir`, made on first use and again
/// when its weights (or the config fields that shape them) change.
pub fn container_for(dir: &Path, arch: &dyn Arch) -> Result<PathBuf> {
    let _ = arch;
    let store = WeightStore::open_dir(dir)?;
    let kind = lossless_kind(&store);
    drop(store);
    let cache = dir.join(".strata");
    let target = cache.join(format!("experts-{}", kind.name()));
    let key = stamp(dir)?;
    let key_file = target.join(STAMP_FILE);
    let old = std::fs::read_to_string(&key_file).ok();
    let Some(why) = staleness(old.as_deref(), &key) else { return Ok(target) };
    eprintln!(
        "strata: --budget streams experts from an expert container; converting {} into {} ({} experts): {why}",
        dir.display(),
        target.display(),
        kind.name()
    );
    std::fs::create_dir_all(&cache).map_err(|e| {
        anyhow!(
            "{}: cannot create the expert cache ({e}); run `strata convert --model {} --out DIR` and use DIR",
            cache.display(),
            dir.display()
        )
    })?;
    let tmp = cache.join(format!("tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    convert(dir, &tmp, &ConvertOptions { experts: kind, mtp_experts: MTP_EXPERTS }, &mut |_, _| {})?;
    std::fs::write(tmp.join(STAMP_FILE), &key)?;
    rescue_ledgers(&target, dir)?;
    let _ = std::fs::remove_dir_all(&target);
    if std::fs::rename(&tmp, &target).is_err() {
        // Another process finished the same conversion first: use its copy.
        let _ = std::fs::remove_dir_all(&tmp);
    }
    Ok(target)
}

/// Moves usage ledgers an older strata kept inside the container (`.coli_usage`, and
/// damaged copies) to the model directory, where the ledger lives now, before the old
/// container is replaced: a reconversion never deletes usage history. A ledger already
/// in the model directory is left as it is; the container's is then kept beside it as
/// `.coli_usage.from-container-<unix time>` (merge by hand, or delete, at will).
fn rescue_ledgers(container: &Path, model_dir: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(container) else { return Ok(()) };
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name != ".coli_usage" && !name.starts_with(".coli_usage.damaged-") {
            continue;
        }
        let mut to = model_dir.join(&name);
        if to.exists() {
            to = model_dir.join(format!("{name}.from-container-{secs}"));
        }
        std::fs::rename(e.path(), &to)
            .or_else(|_| std::fs::copy(e.path(), &to).map(|_| ()))
            .with_context(|| format!("{}: cannot keep the usage ledger across reconversion", e.path().display()))?;
        eprintln!("strata: kept the usage ledger {} as {}", e.path().display(), to.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp_with(lines: &[&str]) -> String {
        format!("{STAMP_HEADER}\n{}\n", lines.join("\n"))
    }

    #[test]
    fn staleness_names_what_changed() {
        let a = stamp_with(&["config n_routed_experts 8", "weights model.safetensors 100 00000000000000aa"]);
        assert_eq!(staleness(Some(&a), &a), None);
        assert_eq!(staleness(None, &a).unwrap(), "no conversion yet");
        let b = stamp_with(&["config n_routed_experts 16", "weights model.safetensors 100 00000000000000bb"]);
        let why = staleness(Some(&a), &b).unwrap();
        assert!(
            why.contains("`n_routed_experts` 8 -> 16") && why.contains("model.safetensors: contents changed"),
            "{why}"
        );
        let c = stamp_with(&["config n_routed_experts 8", "weights model-2.safetensors 7 00000000000000aa"]);
        let why = staleness(Some(&a), &c).unwrap();
        assert!(why.contains("model-2.safetensors is new") && why.contains("model.safetensors is gone"), "{why}");
        let why = staleness(Some("model.safetensors 100 12345\n"), &a).unwrap();
        assert!(why.contains("older strata"), "{why}");
    }
}
