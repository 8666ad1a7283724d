//! A family's weight map — every tensor a checkpoint holds: name, shape, role, group,
//! and for routed experts which one — and the one rule for what a stored tensor becomes
//! in memory. The map drives loading (shape checks from headers before any weight is
//! read), `inspect` (parameters and bytes by group), `convert` (which tensors are routed
//! experts), the memory plan (bytes as held) and `synth` (initial values by role).

use anyhow::{anyhow, bail, Result};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use strata_backend::HostMatrix;
use strata_kernels::{decode_to_f32, e8m0_scale, ElementType, QuantKind, MXFP4_GROUP};
use strata_storage::WeightStore;

/// What a tensor is for; decides how it is held and how synthetic values are drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A projection `[out, in]`: held in its stored precision.
    Linear,
    /// An embedding table `[vocab, hidden]`: held in its stored precision, read by row.
    Embedding,
    /// A norm's scale (f32).
    NormScale,
    /// A norm's bias (f32).
    NormBias,
    /// A router's score-correction bias (f32).
    RouterBias,
}

/// Groups for accounting (`inspect`, the plan).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorGroup {
    Embeddings,
    Attention,
    Indexer,
    Norms,
    DenseMlp,
    /// Per-layer input embeddings (Gemma 4's PLE: the packed table, its projection and
    /// each layer's gate).
    PerLayerInputs,
    /// A vision tower and its projection into the text model.
    Vision,
    Router,
    SharedExperts,
    RoutedExperts,
    Mtp,
    Other,
}

/// The three matrices of a SwiGLU expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertMatrix {
    Gate,
    Up,
    Down,
}

#[derive(Clone, Debug)]
pub struct WeightSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub role: Role,
    pub group: TensorGroup,
    /// A routed expert's matrix: (layer, expert, which).
    pub expert: Option<(usize, usize, ExpertMatrix)>,
    /// Present in some checkpoints only (the MTP layer).
    pub optional: bool,
}

#[derive(Clone, Debug, Default)]
pub struct WeightMap {
    pub specs: Vec<WeightSpec>,
    /// Where a layer's routed experts are found when stored fused (transformers' runtime
    /// layout: `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`), for families whose names
    /// differ from [`fused_expert_names`] (the default for layers not listed).
    pub fused: Vec<(usize, (String, String))>,
    /// How the fused tensors lay the experts out.
    pub fused_form: FusedForm,
    /// Tensors known by prefix only, and their group (a draft layer that is described,
    /// not run: Qwen3-Next's `mtp.`).
    pub extra_prefixes: Vec<(String, TensorGroup)>,
}

/// How a checkpoint lays out a layer's fused experts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FusedForm {
    /// transformers' runtime layout: `gate_up_proj [E, 2I, H]` (every gate row, then every
    /// up row), `down_proj [E, H, I]`.
    #[default]
    Stacked,
    /// gpt-oss's: gate and up rows interleaved (gate `2i`, up `2i + 1`), either as
    /// `gate_up_proj [E, H, 2I]` and `down_proj [E, I, H]` (in x out, bf16 / f32), or in
    /// MXFP4 as the checkpoints ship: `gate_up_proj_blocks [E, 2I, H/32, 16]` (u8, two
    /// FP4 values a byte) with `gate_up_proj_scales [E, 2I, H/32]` (u8 e8m0), and
    /// `down_proj_blocks [E, H, I/32, 16]` with `down_proj_scales [E, H, I/32]`.
    Interleaved,
}

/// The MXFP4 payload tensor beside fused expert tensor `name` (gpt-oss ships `X_blocks`
/// with `X_scales` where a float checkpoint has `X`).
pub fn mxfp4_blocks(name: &str) -> String {
    format!("{name}_blocks")
}

/// Whether `store` holds fused expert tensor `name`, as floats or as MXFP4 blocks.
fn holds_fused(store: &WeightStore, name: &str) -> bool {
    store.contains(name) || store.contains(&mxfp4_blocks(name))
}

/// Parameters and bytes of one group.
#[derive(Clone, Debug, Default, Serialize)]
pub struct GroupSize {
    pub tensors: usize,
    pub parameters: u64,
    pub bytes: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct WeightSummary {
    pub groups: BTreeMap<TensorGroup, GroupSize>,
    pub total_parameters: u64,
    pub total_bytes: u64,
    /// Parameters a decode token touches in the main model (dense part + top-k experts).
    pub active_parameters: u64,
    /// Bytes of one routed expert (gate + up + down, with scales) as stored.
    pub bytes_per_expert: u64,
}

impl WeightMap {
    pub fn push(&mut self, name: String, shape: Vec<usize>, role: Role, group: TensorGroup) {
        self.specs.push(WeightSpec { name, shape, role, group, expert: None, optional: false });
    }

    pub fn get(&self, name: &str) -> Option<&WeightSpec> {
        self.specs.iter().find(|s| s.name == name)
    }

    /// The fused expert tensors of `layer` (see [`WeightMap::fused`]).
    pub fn fused_names(&self, layer: usize) -> (String, String) {
        match self.fused.iter().find(|(l, _)| *l == layer) {
            Some((_, names)) => names.clone(),
            None => fused_expert_names(layer),
        }
    }

    /// Layers whose routed experts `store` holds fused.
    pub fn fused_layers(&self, store: &WeightStore) -> Vec<usize> {
        let mut layers = fused_expert_layers(store);
        for (l, (gate_up, _)) in &self.fused {
            if holds_fused(store, gate_up) && !layers.contains(l) {
                layers.push(*l);
            }
        }
        layers
    }

    /// Whether `name` holds routed experts (per expert, or a layer's fused tensors).
    pub fn is_routed_expert(&self, name: &str) -> bool {
        if let Some(s) = self.get(name) {
            // (A mapped tensor under `mlp.experts.` that is not an expert: gpt-oss's biases.)
            return s.expert.is_some();
        }
        // A described-only draft layer's experts stay with the resident tensors.
        if self.extra_group(name).is_some() {
            return false;
        }
        name.contains(".mlp.experts.") || self.fused.iter().any(|(_, (a, b))| a == name || b == name)
    }

    /// The group of a tensor known by prefix only ([`WeightMap::extra_prefixes`]).
    fn extra_group(&self, name: &str) -> Option<TensorGroup> {
        self.extra_prefixes.iter().find(|(p, _)| name.starts_with(p.as_str())).map(|(_, g)| *g)
    }

    /// Checks every tensor against the checkpoint's headers: required ones present, every
    /// present one with the shape the config implies. `skip_experts`: routed experts live
    /// in an expert container instead.
    pub fn check(&self, store: &WeightStore, skip_experts: bool) -> Result<()> {
        let fused = self.fused_layers(store);
        for s in &self.specs {
            if s.expert.is_some() && (skip_experts || fused.contains(&s.expert.unwrap().0)) {
                continue;
            }
            match store.get(&s.name) {
                None if s.optional => {}
                None => {
                    let first = store.files().next().map(|p| p.display().to_string()).unwrap_or_default();
                    if let Some((layer, _, _)) = s.expert {
                        let (gate_up, _) = self.fused_names(layer);
                        bail!("{first}: missing tensor `{}` (and no fused `{gate_up}`)", s.name);
                    }
                    bail!("{first}: missing tensor `{}`", s.name);
                }
                Some((file, t)) => {
                    let quantized = store.contains(&format!("{}.qs", s.name));
                    if !quantized && t.shape != s.shape {
                        bail!(
                            "{}: tensor `{}` has shape {:?} but the config implies {:?}",
                            file.path().display(),
                            s.name,
                            t.shape,
                            s.shape
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Refuses a tensor in `store` that the map does not predict, naming it: a tensor of
    /// the map, one beside it (its FP8 scales, its quantized parts: names that extend a
    /// mapped name), a layer's fused experts, or a rotary table buffer is expected.
    pub fn check_no_strangers(&self, store: &WeightStore) -> Result<()> {
        let mapped: std::collections::BTreeSet<&str> = self.specs.iter().map(|s| s.name.as_str()).collect();
        let fused: Vec<String> = self
            .specs
            .iter()
            .filter_map(|s| s.expert.map(|e| e.0))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .flat_map(|l| {
                let (a, b) = self.fused_names(l);
                [a, b]
            })
            .collect();
        for name in store.names() {
            // A mapped name, or one extended at a `.` or `_` (`x.weight_scale_inv`, `x.weight.qs`).
            let extends = mapped.contains(name)
                || name.char_indices().any(|(i, c)| (c == '.' || c == '_') && mapped.contains(&name[..i]));
            if extends
                || self.extra_group(name).is_some()
                || fused.iter().any(|f| name.starts_with(f.as_str()))
                || name.ends_with("rotary_emb.inv_freq")
            {
                continue;
            }
            let file = store.get(name).map(|(f, _)| f.path().display().to_string()).unwrap_or_default();
            bail!("{file}: tensor `{name}` is not one the config predicts (a different architecture or config?)");
        }
        Ok(())
    }

    /// Bytes the non-expert tensors (main model and, with `mtp`, the MTP layer) take as
    /// held in memory, by [`held_kind`].
    pub fn resident_held_bytes(&self, store: &WeightStore, include_mtp: bool) -> u64 {
        self.specs
            .iter()
            .filter(|s| s.expert.is_none() && (include_mtp || s.group != TensorGroup::Mtp))
            .filter(|s| store.contains(&s.name))
            .map(|s| held_bytes(store, &s.name, &s.shape, s.role).unwrap_or(0))
            .sum()
    }

    /// Bytes of one routed expert of `layer` as stored (gate, up and down payloads): its
    /// per-expert tensors, else its share of the layer's fused tensors
    /// ([`WeightMap::fused_names`]; transformers' runtime layout, as Gemma 4 ships).
    pub fn stored_expert_bytes(&self, store: &WeightStore, layer: usize) -> u64 {
        let per_expert: u64 = self
            .specs
            .iter()
            .filter(|s| s.expert.is_some_and(|(l, e, _)| l == layer && e == 0))
            .filter_map(|s| store.get(&s.name).map(|(_, t)| t.byte_len() as u64))
            .sum();
        if per_expert > 0 {
            return per_expert;
        }
        let (gate_up, down) = self.fused_names(layer);
        [gate_up, down]
            .iter()
            .flat_map(|n| ["", "_blocks", "_scales"].map(|suffix| format!("{n}{suffix}")))
            .filter_map(|n| store.get(&n))
            .map(|(_, t)| t.byte_len() as u64 / t.shape.first().copied().unwrap_or(1).max(1) as u64)
            .sum()
    }

    /// The largest non-expert tensor as stored (the load transient: a tensor's mapped
    /// pages are released once it is copied).
    pub fn largest_stored(&self, store: &WeightStore) -> u64 {
        self.specs
            .iter()
            .filter(|s| s.expert.is_none())
            .filter_map(|s| store.get(&s.name).map(|(_, t)| t.byte_len() as u64))
            .max()
            .unwrap_or(0)
    }

    /// Parameters and stored bytes by group, from the headers. Scale tensors
    /// (`_scale_inv`, `.qs`) count as bytes of their matrix; a quantized payload counts
    /// the parameters of the shape it encodes. `experts_per_token`: top-k times the
    /// sparse layers (for the active count).
    pub fn summarize(&self, store: &WeightStore, experts_per_token: u64, expert_count: u64) -> WeightSummary {
        let by_name: HashMap<&str, &WeightSpec> = self.specs.iter().map(|s| (s.name.as_str(), s)).collect();
        let mut groups: BTreeMap<TensorGroup, GroupSize> = BTreeMap::new();
        for name in store.names() {
            let Some((_, t)) = store.get(name) else { continue };
            // MXFP4's e8m0 scales (`X_scales` beside `X_blocks`) count as bytes of their matrix.
            let mxfp4_scales = name.strip_suffix("_scales").map(mxfp4_blocks).filter(|b| store.contains(b));
            let base = name.strip_suffix(".qs").or_else(|| name.strip_suffix("_scale_inv")).unwrap_or(name);
            let base = mxfp4_scales.as_deref().unwrap_or(base);
            let spec = by_name.get(base);
            let group = match (spec, self.extra_group(base)) {
                (Some(s), _) => s.group,
                (None, Some(g)) => g,
                (None, None) if self.is_routed_expert(base) => TensorGroup::RoutedExperts,
                (None, None) => fused_group(base),
            };
            let g = groups.entry(group).or_default();
            g.bytes += t.byte_len() as u64;
            if base != name {
                continue;
            }
            g.tensors += 1;
            g.parameters += match (store.contains(&format!("{name}.qs")), spec) {
                (true, Some(s)) => s.shape.iter().product::<usize>() as u64,
                // Two FP4 values a byte.
                _ if name.ends_with("_blocks") && t.dtype == ElementType::U8 => 2 * t.numel() as u64,
                _ => t.numel() as u64,
            };
        }
        summarize_groups(groups, experts_per_token, expert_count)
    }
}

/// Routed experts stored fused (transformers' runtime layout `mlp.experts.gate_up_proj`
/// `[E, 2I, H]`) are grouped with the routed experts.
fn fused_group(name: &str) -> TensorGroup {
    if name.contains(".mlp.experts.") {
        TensorGroup::RoutedExperts
    } else {
        TensorGroup::Other
    }
}

/// Layers whose routed experts are stored fused.
pub fn fused_expert_layers(store: &WeightStore) -> Vec<usize> {
    store
        .names()
        .filter(|n| n.ends_with(".mlp.experts.gate_up_proj") || n.ends_with(".mlp.experts.gate_up_proj_blocks"))
        .filter_map(|n| n.strip_prefix("model.layers.")?.split('.').next()?.parse().ok())
        .collect()
}

pub fn summarize_groups(
    groups: BTreeMap<TensorGroup, GroupSize>,
    experts_per_token: u64,
    expert_count: u64,
) -> WeightSummary {
    let total_parameters = groups.values().map(|g| g.parameters).sum();
    let total_bytes = groups.values().map(|g| g.bytes).sum();
    let routed = groups.get(&TensorGroup::RoutedExperts).cloned().unwrap_or_default();
    let expert_count = expert_count.max(1);
    let main_non_expert: u64 = groups
        .iter()
        .filter(|(k, _)| !matches!(k, TensorGroup::RoutedExperts | TensorGroup::Mtp))
        .map(|(_, g)| g.parameters)
        .sum();
    WeightSummary {
        active_parameters: main_non_expert + routed.parameters / expert_count * experts_per_token,
        bytes_per_expert: routed.bytes / expert_count,
        groups,
        total_parameters,
        total_bytes,
    }
}

/// The one rule for what a stored tensor becomes in memory: matrices (projections,
/// embeddings) keep their stored precision — bf16, f32, FP8 e4m3 with its block scales,
/// int8/int4 payloads with `.qs` scales — except f16/f64, held as f32; vectors are f32.
pub fn held_kind(
    store: &WeightStore,
    name: &str,
    shape: &[usize],
    role: Role,
    fp8_block: Option<(usize, usize)>,
) -> Result<QuantKind> {
    let (file, t) = store.get(name).ok_or_else(|| anyhow!("missing tensor `{name}`"))?;
    if !matches!(role, Role::Linear | Role::Embedding) || shape.len() != 2 {
        return Ok(QuantKind::F32);
    }
    let (rows, cols) = (shape[0], shape[1]);
    if let Some(kind) = store.quant_kind(name, rows, cols) {
        return kind;
    }
    Ok(match t.dtype {
        ElementType::BF16 => QuantKind::Bf16,
        ElementType::F8E4M3 => {
            let scale = format!("{name}_scale_inv");
            let (_, s) = store
                .get(&scale)
                .ok_or_else(|| anyhow!("{}: FP8 tensor `{name}` has no `{scale}`", file.path().display()))?;
            if s.shape.len() != 2 {
                bail!("{}: `{scale}` must be 2-D", file.path().display());
            }
            let (br, bc) = fp8_block.unwrap_or((rows.div_ceil(s.shape[0].max(1)), cols.div_ceil(s.shape[1].max(1))));
            QuantKind::Fp8 { block_rows: br, block_cols: bc }
        }
        _ => QuantKind::F32,
    })
}

fn held_bytes(store: &WeightStore, name: &str, shape: &[usize], role: Role) -> Result<u64> {
    let kind = held_kind(store, name, shape, role, None)?;
    let n: usize = shape.iter().product();
    Ok(match (kind, shape) {
        (QuantKind::F32, _) => 4 * n as u64,
        (k, [rows, cols]) => k.stored_bytes(*rows, *cols) as u64,
        _ => 4 * n as u64,
    })
}

/// Loads a matrix in its held precision ([`held_kind`]), checking its shape.
pub fn load_matrix(
    store: &WeightStore,
    name: &str,
    shape: [usize; 2],
    role: Role,
    fp8_block: Option<(usize, usize)>,
) -> Result<HostMatrix> {
    let (file, t) = store.get(name).ok_or_else(|| {
        let first = store.files().next().map(|p| p.display().to_string()).unwrap_or_default();
        anyhow!("{first}: missing tensor `{name}`")
    })?;
    let [rows, cols] = shape;
    let kind = held_kind(store, name, &shape, role, fp8_block)?;
    let quantized = store.contains(&format!("{name}.qs"));
    if !quantized && t.shape != shape {
        bail!("{}: tensor `{name}` has shape {:?} but the config implies {:?}", file.path().display(), t.shape, shape);
    }
    let m = match kind {
        QuantKind::Bf16 => HostMatrix { kind, rows, cols, payload: file.bytes(t)?.to_vec(), scales: Vec::new() },
        QuantKind::F32 => {
            let v = store.load_f32(name, &shape, fp8_block)?;
            HostMatrix::f32(rows, cols, &v)
        }
        QuantKind::Fp8 { .. } => {
            let scale = format!("{name}_scale_inv");
            let (_, s) = store.get(&scale).expect("held_kind checked the scale");
            let scales = store.load_f32(&scale, &s.shape.clone(), None)?;
            if scales.len() != kind.scale_count(rows, cols) {
                bail!(
                    "{}: `{scale}` has {} scales; blocks of {} need {}",
                    file.path().display(),
                    scales.len(),
                    kind.name(),
                    kind.scale_count(rows, cols)
                );
            }
            HostMatrix { kind, rows, cols, payload: file.bytes(t)?.to_vec(), scales }
        }
        QuantKind::Int8Row | QuantKind::Int4Group { .. } => {
            let qs = format!("{name}.qs");
            let (qf, q) = store.get(&qs).expect("quant_kind found the scales");
            let mut scales = vec![0f32; q.numel()];
            decode_to_f32(ElementType::F32, qf.bytes(q)?, &mut scales)
                .map_err(|e| anyhow!("{}: tensor `{qs}`: {e}", qf.path().display()))?;
            HostMatrix { kind, rows, cols, payload: file.bytes(t)?.to_vec(), scales }
        }
        QuantKind::Mxfp4 => bail!("{}: tensor `{name}`: MXFP4 is an expert encoding only", file.path().display()),
    };
    file.release(t);
    Ok(m)
}

/// Loads a vector (norm scale, bias) as f32, checking its length.
pub fn load_vector(store: &WeightStore, name: &str, len: usize) -> Result<Vec<f32>> {
    store.load_f32(name, &[len], None)
}

/// Names of a layer's fused expert tensors (transformers' runtime layout):
/// `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`.
pub fn fused_expert_names(layer: usize) -> (String, String) {
    fused_expert_names_at(&format!("model.layers.{layer}.mlp.experts"))
}

/// The fused expert tensors under `experts` (a family's path to a layer's experts, for
/// families whose names differ from [`fused_expert_names`]).
pub fn fused_expert_names_at(experts: &str) -> (String, String) {
    (format!("{experts}.gate_up_proj"), format!("{experts}.down_proj"))
}

/// The shape of a layer's routed experts.
#[derive(Clone, Copy, Debug)]
pub struct ExpertShape {
    pub experts: usize,
    pub hidden: usize,
    pub inter: usize,
}

/// One routed expert's (gate, up, down) as held: from its per-expert tensors `names`, or
/// out of the layer's fused tensors `fused` laid out as `form` says.
#[allow(clippy::too_many_arguments)]
pub fn load_expert(
    store: &WeightStore,
    names: &[String; 3],
    fused: &(String, String),
    form: FusedForm,
    shape: ExpertShape,
    e: usize,
    fp8_block: Option<(usize, usize)>,
) -> Result<[HostMatrix; 3]> {
    let ExpertShape { hidden: h, inter, .. } = shape;
    if store.contains(&names[0]) {
        return Ok([
            load_matrix(store, &names[0], [inter, h], Role::Linear, fp8_block)?,
            load_matrix(store, &names[1], [inter, h], Role::Linear, fp8_block)?,
            load_matrix(store, &names[2], [h, inter], Role::Linear, fp8_block)?,
        ]);
    }
    if !holds_fused(store, &fused.0) {
        bail!("missing tensor `{}` (and no fused `{}`)", names[0], fused.0);
    }
    fused_expert(store, fused, form, shape, e)
}

/// Expert `e` of a layer's fused tensors, payloads as stored (bf16, f32 or MXFP4; other
/// float types widened to f32). Each tensor's pages for the expert are released once
/// copied, so that a resident load does not hold the whole checkpoint twice until it ends.
pub fn fused_expert(
    store: &WeightStore,
    (gate_up, down): &(String, String),
    form: FusedForm,
    shape: ExpertShape,
    e: usize,
) -> Result<[HostMatrix; 3]> {
    let ExpertShape { experts: n, hidden: h, inter } = shape;
    Ok(match form {
        FusedForm::Stacked => {
            let gu = fused_rows(store, gate_up, [n, 2 * inter, h], e)?;
            let (g, u) = gu.split_rows(inter);
            [g, u, fused_rows(store, down, [n, h, inter], e)?]
        }
        FusedForm::Interleaved if store.contains(&mxfp4_blocks(gate_up)) => {
            let gu = fused_mxfp4(store, gate_up, [n, 2 * inter, h], e)?;
            [gu.rows_where(|r| r % 2 == 0), gu.rows_where(|r| r % 2 == 1), fused_mxfp4(store, down, [n, h, inter], e)?]
        }
        FusedForm::Interleaved => {
            // In x out: the expert's `[H, 2I]` transposed to `[2I, H]`, then split.
            let gu = fused_rows(store, gate_up, [n, h, 2 * inter], e)?.transposed();
            [
                gu.rows_where(|r| r % 2 == 0),
                gu.rows_where(|r| r % 2 == 1),
                fused_rows(store, down, [n, inter, h], e)?.transposed(),
            ]
        }
    })
}

/// Expert `e`'s `[rows, cols]` slice of a fused `[E, rows, cols]` float tensor.
fn fused_rows(store: &WeightStore, name: &str, shape: [usize; 3], e: usize) -> Result<HostMatrix> {
    let (file, t) = store.get(name).ok_or_else(|| anyhow!("missing tensor `{name}`"))?;
    let path = file.path().display();
    if t.shape != shape {
        bail!("{path}: tensor `{name}` has shape {:?} but the config implies {shape:?}", t.shape);
    }
    let (rows, cols) = (shape[1], shape[2]);
    let per = rows * cols * t.dtype.size_bytes();
    let bytes = &file.bytes(t)?[e * per..(e + 1) * per];
    let m = match t.dtype {
        ElementType::BF16 => {
            HostMatrix { kind: QuantKind::Bf16, rows, cols, payload: bytes.to_vec(), scales: Vec::new() }
        }
        ElementType::F32 => {
            HostMatrix { kind: QuantKind::F32, rows, cols, payload: bytes.to_vec(), scales: Vec::new() }
        }
        ElementType::F8E4M3 => bail!("{path}: fused FP8 experts (`{name}`) are not supported"),
        dtype => {
            let mut v = vec![0f32; rows * cols];
            decode_to_f32(dtype, bytes, &mut v).map_err(|m| anyhow!("{path}: tensor `{name}`: {m}"))?;
            HostMatrix::f32(rows, cols, &v)
        }
    };
    file.release_bytes(t, e * per, (e + 1) * per);
    Ok(m)
}

/// Expert `e`'s `[rows, cols]` MXFP4 matrix from `{name}_blocks [E, rows, cols/32, 16]`
/// and `{name}_scales [E, rows, cols/32]`: the nibbles are strata's MXFP4 payload as they
/// are (low nibble first), the e8m0 codes its scales.
fn fused_mxfp4(store: &WeightStore, name: &str, [n, rows, cols]: [usize; 3], e: usize) -> Result<HostMatrix> {
    let part = |suffix: &str, shape: &[usize]| -> Result<Vec<u8>> {
        let tname = format!("{name}_{suffix}");
        let (file, t) = store.get(&tname).ok_or_else(|| anyhow!("missing tensor `{tname}`"))?;
        let path = file.path().display();
        if t.dtype != ElementType::U8 {
            bail!("{path}: tensor `{tname}` is {:?}; MXFP4 {suffix} are u8", t.dtype);
        }
        if t.shape != shape {
            bail!("{path}: tensor `{tname}` has shape {:?} but the config implies {shape:?}", t.shape);
        }
        let per = t.byte_len() / n;
        let bytes = file.bytes(t)?[e * per..(e + 1) * per].to_vec();
        file.release_bytes(t, e * per, (e + 1) * per);
        Ok(bytes)
    };
    if !cols.is_multiple_of(MXFP4_GROUP) {
        bail!("`{name}`: MXFP4 rows of {cols} values are not whole blocks of {MXFP4_GROUP}");
    }
    let groups = cols / MXFP4_GROUP;
    let payload = part("blocks", &[n, rows, groups, MXFP4_GROUP / 2])?;
    let scales = part("scales", &[n, rows, groups])?.into_iter().map(e8m0_scale).collect();
    Ok(HostMatrix { kind: QuantKind::Mxfp4, rows, cols, payload, scales })
}
