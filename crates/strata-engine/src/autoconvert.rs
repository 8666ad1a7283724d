//! `--budget` on an HF checkpoint: its experts are converted once into an expert
//! container kept inside the model directory (`.strata/experts-<encoding>/`) and reused
//! while the checkpoint's files are unchanged. bf16 and FP8 checkpoints convert to bf16
//! experts, f32 checkpoints to f32: no precision is lost that the source had.

use anyhow::{anyhow, Context, Result};
use std::path::{Path, PathBuf};
use strata_kernels::{ElementType, QuantKind};
use strata_models::convert::{convert, ConvertOptions};
use strata_models::Arch;
use strata_storage::WeightStore;

/// Name, size and mtime of every file the conversion reads: the cache key.
fn stamp(dir: &Path) -> Result<String> {
    let mut entries: Vec<String> = Vec::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("{}: cannot list", dir.display()))? {
        let p = e?.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("").to_string();
        if p.is_file() && (name.ends_with(".safetensors") || name.ends_with(".json") || name.ends_with(".jinja")) {
            let m = std::fs::metadata(&p)?;
            let mtime = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            entries.push(format!("{name} {} {mtime}", m.len()));
        }
    }
    entries.sort();
    Ok(entries.join("\n"))
}

/// The routed experts' encoding that keeps the checkpoint's precision.
pub fn lossless_kind(store: &WeightStore) -> QuantKind {
    let f32_experts = store
        .names()
        .filter(|n| n.contains(".mlp.experts."))
        .all(|n| store.get(n).is_some_and(|(_, t)| t.dtype == ElementType::F32));
    if f32_experts {
        QuantKind::F32
    } else {
        QuantKind::Bf16
    }
}

/// The expert-container copy of the HF checkpoint `dir`, made on first use.
pub fn container_for(dir: &Path, arch: &dyn Arch) -> Result<PathBuf> {
    let _ = arch;
    let store = WeightStore::open_dir(dir)?;
    let kind = lossless_kind(&store);
    drop(store);
    let cache = dir.join(".strata");
    let target = cache.join(format!("experts-{}", kind.name()));
    let key = stamp(dir)?;
    let key_file = target.join("source.stamp");
    if std::fs::read_to_string(&key_file).ok().as_deref() == Some(key.as_str()) {
        return Ok(target);
    }
    eprintln!(
        "strata: --budget streams experts from an expert container; converting {} once into {} ({} experts)",
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
    convert(dir, &tmp, &ConvertOptions { experts: kind, mtp_experts: QuantKind::Int8Row }, &mut |_, _| {})?;
    std::fs::write(tmp.join("source.stamp"), &key)?;
    let _ = std::fs::remove_dir_all(&target);
    if std::fs::rename(&tmp, &target).is_err() {
        // Another process finished the same conversion first: use its copy.
        let _ = std::fs::remove_dir_all(&tmp);
    }
    Ok(target)
}
