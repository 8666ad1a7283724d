//! HF checkpoint -> strata expert container: resident tensors copied as stored into
//! `model.safetensors`; routed experts re-encoded (int4 / int8 / bf16 / f32) into
//! aligned regions, one per expert, described by `strata-experts.json`. Experts already
//! stored in the asked encoding (the public container's) keep their payloads. The MTP layer's
//! experts form their own tier, int8 by default (int4 drafts are known to fail).

use crate::registry::read_arch;
use crate::weights::{fused_expert, mxfp4_blocks, ExpertMatrix, ExpertShape, WeightMap};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;
use strata_kernels::{dequantize, quantize, round_scales, QuantKind, MXFP4_GROUP};
use strata_storage::{ContainerWriter, ExpertLayout, SafetensorsWriter, TensorSpec, TierSpec, WeightStore};

/// Files copied verbatim next to the weights.
const SIDE_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    // Kimi K2's tokenizer (no tokenizer.json).
    "tiktoken.model",
];

#[derive(Clone, Debug)]
pub struct ConvertOptions {
    pub experts: QuantKind,
    pub mtp_experts: QuantKind,
}

#[derive(Clone, Debug, Serialize)]
pub struct ConvertReport {
    pub resident_tensors: usize,
    pub resident_bytes: u64,
    pub main_experts: usize,
    pub mtp_experts: usize,
    pub expert_bytes: u64,
    pub slot_bytes: usize,
    pub seconds: f64,
}

/// Routed-expert tensors by (layer, expert, matrix), from the weight map.
struct ExpertNames<'a>(HashMap<(usize, usize, u8), &'a str>);

impl<'a> ExpertNames<'a> {
    fn new(map: &'a WeightMap) -> Self {
        Self(map.specs.iter().filter_map(|s| s.expert.map(|(l, e, m)| ((l, e, m as u8), s.name.as_str()))).collect())
    }
    fn get(&self, l: usize, e: usize, m: ExpertMatrix) -> Option<&'a str> {
        self.0.get(&(l, e, m as u8)).copied()
    }
    /// Routed-expert tensors (per expert, or fused) leave the resident file.
    fn is_expert(&self, map: &WeightMap, name: &str) -> bool {
        map.is_routed_expert(name)
    }
}

/// A matrix encoded: payload and scales (f32 values, as [`quantize`] gives them).
type Encoded = (Vec<u8>, Vec<f32>);

/// One expert's (gate, up, down) as the source stores them, when that is `kind` up to how
/// the scales are stored (the public container's int4 and int8 experts): payloads kept,
/// scales rounded to `kind`'s scale type. Keeping the nibbles is what re-quantizing would
/// choose against the rounded scale (a bf16 scale moves by at most 2^-8 of itself, an e4m3
/// one by 2^-4, so no nibble in -8..7 moves past half a step; -8 clamps), and it avoids a
/// second rounding of the weights on another grid. `None` when any matrix is stored
/// otherwise.
fn expert_as_stored(
    store: &WeightStore,
    names: &ExpertNames,
    layer: usize,
    e: usize,
    hidden: usize,
    inter: usize,
    kind: QuantKind,
) -> Result<Option<[Encoded; 3]>> {
    let shapes =
        [(ExpertMatrix::Gate, inter, hidden), (ExpertMatrix::Up, inter, hidden), (ExpertMatrix::Down, hidden, inter)];
    let mut out = Vec::with_capacity(3);
    for (m, rows, cols) in shapes {
        let Some(name) = names.get(layer, e, m).filter(|n| store.contains(n)) else { return Ok(None) };
        let Some(stored) = store.load_quantized(name, rows, cols) else { return Ok(None) };
        let mut m = stored?;
        if m.kind != kind.with_f32_scales() {
            return Ok(None);
        }
        round_scales(kind, &mut m.scales);
        out.push((m.payload, m.scales));
    }
    Ok(out.try_into().ok())
}

/// One expert encoded as `kind`: kept as the source stores it where that is `kind` (the
/// public container's int4 and int8, see [`expert_as_stored`]; gpt-oss's fused MXFP4 into
/// an MXFP4 container), else decoded to f32 (per-expert or fused layout) and quantized.
/// Each expert is read once.
#[allow(clippy::too_many_arguments)]
fn encode_expert(
    store: &WeightStore,
    map: &WeightMap,
    names: &ExpertNames,
    layer: usize,
    e: usize,
    shape: ExpertShape,
    kind: QuantKind,
    fp8: Option<(usize, usize)>,
) -> Result<[Encoded; 3]> {
    let (h, inter) = (shape.hidden, shape.inter);
    if let Some(stored) = expert_as_stored(store, names, layer, e, h, inter, kind)? {
        return Ok(stored);
    }
    let [g, u, d] = match names.get(layer, e, ExpertMatrix::Gate).filter(|n| store.contains(n)) {
        Some(gate) => {
            let name = |m| names.get(layer, e, m).expect("every expert matrix is in the map");
            [
                store.load_f32(gate, &[inter, h], fp8)?,
                store.load_f32(name(ExpertMatrix::Up), &[inter, h], fp8)?,
                store.load_f32(name(ExpertMatrix::Down), &[h, inter], fp8)?,
            ]
        }
        None => {
            // Fused: just this expert's rows, from the stored bytes.
            let ms = fused_expert(store, &map.fused_names(layer), map.fused_form, shape, e)?;
            if ms.iter().all(|m| m.kind == kind) {
                return Ok(ms.map(|m| (m.payload, m.scales)));
            }
            ms.map(|m| dequantize(m.kind.with_f32_scales(), &m.payload, &m.scales, m.rows, m.cols))
        }
    };
    Ok([quantize(kind, &g, inter, h), quantize(kind, &u, inter, h), quantize(kind, &d, h, inter)])
}

/// The MTP layers that carry routed experts in this checkpoint.
fn mtp_layers(candidates: &[usize], map: &WeightMap, names: &ExpertNames, store: &WeightStore) -> Vec<usize> {
    candidates
        .iter()
        .copied()
        .filter(|&l| {
            names.get(l, 0, ExpertMatrix::Gate).is_some_and(|n| store.contains(n))
                || store.contains(&map.fused_names(l).0)
        })
        .collect()
}

/// How the source stores its first routed expert's gate (`None`: not quantized, as an HF
/// checkpoint's bf16 or FP8 experts; `Some`: the public container's int4 or int8), so that a
/// caller can pick defaults that keep those payloads well.
pub fn stored_expert_kind(src: &Path) -> Result<Option<QuantKind>> {
    let arch = read_arch(src)?;
    let Some(moe) = arch.moe() else { return Ok(None) };
    let store = WeightStore::open_dir(src)?;
    let map = arch.weight_map();
    let names = ExpertNames::new(&map);
    let Some(&layer) = moe.layers.first() else { return Ok(None) };
    if store.contains(&mxfp4_blocks(&map.fused_names(layer).0)) {
        return Ok(Some(QuantKind::Mxfp4));
    }
    let Some(name) = names.get(layer, 0, ExpertMatrix::Gate) else { return Ok(None) };
    store.quant_kind(name, moe.inter, moe.hidden).transpose()
}

pub fn convert(
    src: &Path,
    out: &Path,
    opts: &ConvertOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ConvertReport> {
    let t0 = Instant::now();
    let arch = read_arch(src)?;
    let Some(moe) = arch.moe() else {
        bail!("{}: the model has no routed experts to convert", src.display());
    };
    let store = WeightStore::open_dir(src)?;
    let map = arch.weight_map();
    map.check(&store, false)?;
    let names = ExpertNames::new(&map);
    let (h, inter) = (moe.hidden, moe.inter);
    for kind in [opts.experts, opts.mtp_experts] {
        if kind == QuantKind::Mxfp4 && (h % MXFP4_GROUP != 0 || inter % MXFP4_GROUP != 0) {
            bail!(
                "{}: mxfp4 needs the experts' widths to be multiples of {MXFP4_GROUP} (hidden {h}, intermediate {inter})",
                src.display()
            );
        }
    }
    if src.canonicalize().ok() == out.canonicalize().ok() {
        bail!("{}: --out must differ from --model", out.display());
    }
    std::fs::create_dir_all(out).with_context(|| format!("{}: cannot create", out.display()))?;
    for f in SIDE_FILES {
        if src.join(f).exists() {
            std::fs::copy(src.join(f), out.join(f))
                .with_context(|| format!("{}: cannot copy", src.join(f).display()))?;
        }
    }

    // Resident tensors, bytes as stored.
    let resident: Vec<&str> = store.names().filter(|n| !names.is_expert(&map, n)).collect();
    let specs = resident
        .iter()
        .map(|n| {
            let (_, t) = store.get(n).unwrap();
            TensorSpec { name: n.to_string(), dtype: t.dtype, shape: t.shape.clone() }
        })
        .collect::<Vec<_>>();
    let resident_bytes = specs.iter().map(|s| s.byte_len() as u64).sum();
    let mut w = SafetensorsWriter::create(&out.join("model.safetensors"), specs)?;
    for n in &resident {
        let (file, t) = store.get(n).unwrap();
        w.write_next(file.bytes(t)?)?;
    }
    w.finish()?;

    let (h, inter, n) = (moe.hidden, moe.inter, moe.experts_per_layer);
    let shape = ExpertShape { experts: n, hidden: h, inter };
    let main_layers = moe.layers.clone();
    let mtp = mtp_layers(&moe.mtp_layers, &map, &names, &store);
    let mut tiers = vec![TierSpec {
        name: "main".into(),
        layout: ExpertLayout::new(opts.experts, opts.experts, h, inter),
        layers: main_layers.clone(),
        experts_per_layer: n,
    }];
    if !mtp.is_empty() {
        tiers.push(TierSpec {
            name: "mtp".into(),
            layout: ExpertLayout::new(opts.mtp_experts, opts.mtp_experts, h, inter),
            layers: mtp.clone(),
            experts_per_layer: n,
        });
    }
    let slot_bytes = tiers[0].layout.slot_bytes;
    let mut writer = ContainerWriter::create(out, tiers)?;
    let total = ((main_layers.len() + mtp.len()) * n) as u64;
    let mut done = 0u64;
    for (tier, layers, kind) in [("main", &main_layers, opts.experts), ("mtp", &mtp, opts.mtp_experts)] {
        for &layer in layers {
            for e in 0..n {
                let [(gq, gs), (uq, us), (dq, ds)] =
                    encode_expert(&store, &map, &names, layer, e, shape, kind, arch.fp8_block())?;
                writer.add_expert(tier, layer, e, [(&gq, &gs), (&uq, &us), (&dq, &ds)])?;
                done += 1;
                progress(done, total);
            }
        }
    }
    let manifest = writer.finish()?;
    Ok(ConvertReport {
        resident_tensors: resident.len(),
        resident_bytes,
        main_experts: main_layers.len() * n,
        mtp_experts: mtp.len() * n,
        expert_bytes: manifest.total_expert_bytes(),
        slot_bytes,
        seconds: t0.elapsed().as_secs_f64(),
    })
}
