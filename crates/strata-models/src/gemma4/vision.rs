//! Gemma 4's vision tower (`vision_config`) and its projection into the text model
//! (`embed_vision`), as transformers' `Gemma4VisionModel` + `Gemma4MultimodalEmbedder`:
//!
//! patches in [0, 1] -> `2 (p - 0.5)` -> `input_proj` + the position table's rows for the
//! patch's x and y -> encoder layers (sandwich norms; attention over every patch of the
//! image with q/k RMSNorm, v RMSNorm without scale, 2-D RoPE: the first half of each head
//! rotates by x, the second by y; scaling 1; a GELU-tanh gated MLP) -> average pooling of
//! each `k x k` patch block into one soft token (row-major over the pooled grid) ->
//! `* sqrt(hidden)` -> optional standardisation `(h - bias) * scale` -> RMSNorm without
//! scale -> `embedding_projection` to the text width.
//!
//! Projections run on the backend (stored precision, threaded); attention, norms and
//! pooling on the host in f32: the tower runs once per image.

use super::config::Gemma4Config;
use crate::fields::Fields;
use crate::media::ImagePatches;
use crate::weights::{load_matrix, load_vector, Role, TensorGroup, WeightMap, WeightSpec};
use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;
use strata_backend::{Backend, LinearOut};
use strata_storage::WeightStore;

/// The vision tower's fields.
#[derive(Clone, Debug)]
pub struct VisionConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub patch_size: usize,
    pub pooling: usize,
    pub position_embedding_size: usize,
    pub eps: f64,
    pub rope_theta: f64,
    pub standardize: bool,
    pub clipped: bool,
}

impl VisionConfig {
    pub(super) fn from_fields(f: &Fields) -> Result<Self> {
        if let Some(a) = f.get("hidden_activation") {
            if a.as_str() != Some("gelu_pytorch_tanh") {
                bail!("field `hidden_activation` must be `gelu_pytorch_tanh`, got {a}");
            }
        }
        let rope_theta = match f.get("rope_parameters") {
            None | Some(Value::Null) => 100.0,
            Some(Value::Object(p)) => {
                let t = p.get("rope_type").and_then(Value::as_str).unwrap_or("default");
                // (transformers names the vision tower's 2-D RoPE `axial`.)
                if t != "default" && t != "axial" {
                    bail!("field `rope_parameters.rope_type` is `{t}`; the vision tower runs `default` / `axial`");
                }
                p.get("rope_theta").and_then(Value::as_f64).unwrap_or(100.0)
            }
            Some(v) => bail!("field `rope_parameters` must be an object, got {v}"),
        };
        let hidden_size = f.usize_or("hidden_size", 768)?;
        let heads = f.usize_or("num_attention_heads", 12)?;
        let c = Self {
            hidden_size,
            intermediate_size: f.usize_or("intermediate_size", 3072)?,
            layers: f.usize_or("num_hidden_layers", 16)?,
            heads,
            kv_heads: f.usize_or("num_key_value_heads", heads)?,
            head_dim: f.usize_or("head_dim", hidden_size / heads.max(1))?,
            patch_size: f.usize_or("patch_size", 16)?,
            pooling: f.usize_or("pooling_kernel_size", 3)?,
            position_embedding_size: f.usize_or("position_embedding_size", 10240)?,
            eps: f.f64_or("rms_norm_eps", 1e-6)?,
            rope_theta,
            standardize: f.bool_or("standardize", false)?,
            clipped: f.bool_or("use_clipped_linears", false)?,
        };
        for (name, v) in [
            ("hidden_size", c.hidden_size),
            ("intermediate_size", c.intermediate_size),
            ("num_attention_heads", c.heads),
            ("patch_size", c.patch_size),
            ("pooling_kernel_size", c.pooling),
            ("position_embedding_size", c.position_embedding_size),
        ] {
            ensure!(v > 0 && v <= 1 << 20, "field `{name}` ({v}) must be in 1..=1048576");
        }
        ensure!(c.layers <= 1024, "field `num_hidden_layers` ({}) is out of range", c.layers);
        ensure!(
            c.kv_heads > 0 && c.heads.is_multiple_of(c.kv_heads),
            "field `num_key_value_heads` ({}) must divide `num_attention_heads` ({})",
            c.kv_heads,
            c.heads
        );
        ensure!(
            c.head_dim.is_multiple_of(4) && c.head_dim > 0,
            "field `head_dim` ({}) must be a multiple of 4",
            c.head_dim
        );
        Ok(c)
    }

    fn tower(&self) -> &'static str {
        "model.vision_tower."
    }
}

/// A projection, with transformers' optional input/output clamps (`use_clipped_linears`).
struct Linear<B: Backend> {
    w: B::Mat,
    clip: Option<[f32; 4]>,
}

struct VisionLayer<B: Backend> {
    input_norm: Vec<f32>,
    post_attn_norm: Vec<f32>,
    pre_ffn_norm: Vec<f32>,
    post_ffn_norm: Vec<f32>,
    q: Linear<B>,
    k: Linear<B>,
    v: Linear<B>,
    o: Linear<B>,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    gate: Linear<B>,
    up: Linear<B>,
    down: Linear<B>,
}

/// The vision tower and projection on a backend.
pub struct VisionTower<B: Backend> {
    cfg: VisionConfig,
    text_hidden: usize,
    patch: B::Mat,
    /// `[2, position_embedding_size, hidden]`: x rows, then y rows.
    positions: Vec<f32>,
    layers: Vec<VisionLayer<B>>,
    standardize: Option<(Vec<f32>, Vec<f32>)>,
    proj: B::Mat,
}

/// Every tensor name of layer `i` with its shape.
fn layer_tensors(v: &VisionConfig, i: usize) -> Vec<(String, Vec<usize>, Role)> {
    let p = format!("{}encoder.layers.{i}.", v.tower());
    let (h, q, kv, inter) = (v.hidden_size, v.heads * v.head_dim, v.kv_heads * v.head_dim, v.intermediate_size);
    let mut out = Vec::new();
    for n in ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]
    {
        out.push((format!("{p}{n}.weight"), vec![h], Role::NormScale));
    }
    for n in ["q_norm", "k_norm"] {
        out.push((format!("{p}self_attn.{n}.weight"), vec![v.head_dim], Role::NormScale));
    }
    for (n, shape) in [
        ("self_attn.q_proj", [q, h]),
        ("self_attn.k_proj", [kv, h]),
        ("self_attn.v_proj", [kv, h]),
        ("self_attn.o_proj", [h, q]),
        ("mlp.gate_proj", [inter, h]),
        ("mlp.up_proj", [inter, h]),
        ("mlp.down_proj", [h, inter]),
    ] {
        out.push((format!("{p}{n}.linear.weight"), shape.to_vec(), Role::Linear));
    }
    out
}

/// The tower's tensors, for the weight map (shape checks, `inspect`, conversion).
pub(super) fn add_weights(cfg: &Gemma4Config, v: &VisionConfig, map: &mut WeightMap) {
    let t = v.tower();
    let mut add = |name: String, shape: Vec<usize>, role: Role| {
        map.specs.push(WeightSpec { name, shape, role, group: TensorGroup::Vision, expert: None, optional: false });
    };
    add(
        format!("{t}patch_embedder.input_proj.weight"),
        vec![v.hidden_size, 3 * v.patch_size * v.patch_size],
        Role::Linear,
    );
    add(
        format!("{t}patch_embedder.position_embedding_table"),
        vec![2, v.position_embedding_size, v.hidden_size],
        Role::NormScale,
    );
    for i in 0..v.layers {
        for (n, s, r) in layer_tensors(v, i) {
            add(n, s, r);
        }
    }
    if v.standardize {
        add(format!("{t}std_bias"), vec![v.hidden_size], Role::NormBias);
        add(format!("{t}std_scale"), vec![v.hidden_size], Role::NormScale);
    }
    add(
        "model.embed_vision.embedding_projection.weight".into(),
        vec![cfg.text.hidden_size, v.hidden_size],
        Role::Linear,
    );
}

fn scalar(store: &WeightStore, name: &str) -> Result<f32> {
    let (_, t) = store.get(name).with_context(|| format!("missing tensor `{name}` (use_clipped_linears)"))?;
    let shape = t.shape.clone();
    let v = store.load_f32(name, &shape, None)?;
    ensure!(v.len() == 1, "tensor `{name}` must hold one value");
    Ok(v[0])
}

impl<B: Backend> VisionTower<B> {
    pub fn load(b: &B, cfg: &Gemma4Config, v: &VisionConfig, store: &WeightStore) -> Result<Self> {
        let mat = |name: &str, shape: [usize; 2]| -> Result<B::Mat> {
            b.matrix(load_matrix(store, name, shape, Role::Linear, cfg.fp8_block)?)
        };
        let linear = |name: &str, shape: &[usize]| -> Result<Linear<B>> {
            let w = mat(&format!("{name}.linear.weight"), [shape[0], shape[1]])?;
            let clip = match v.clipped {
                false => None,
                true => Some([
                    scalar(store, &format!("{name}.input_min"))?,
                    scalar(store, &format!("{name}.input_max"))?,
                    scalar(store, &format!("{name}.output_min"))?,
                    scalar(store, &format!("{name}.output_max"))?,
                ]),
            };
            Ok(Linear { w, clip })
        };
        let t = v.tower();
        let mut layers = Vec::with_capacity(v.layers);
        for i in 0..v.layers {
            let tensors = layer_tensors(v, i);
            let vec = |k: usize| load_vector(store, &tensors[k].0, tensors[k].1[0]);
            let lin = |k: usize| linear(tensors[k].0.trim_end_matches(".linear.weight"), &tensors[k].1);
            layers.push(VisionLayer {
                input_norm: vec(0)?,
                post_attn_norm: vec(1)?,
                pre_ffn_norm: vec(2)?,
                post_ffn_norm: vec(3)?,
                q_norm: vec(4)?,
                k_norm: vec(5)?,
                q: lin(6)?,
                k: lin(7)?,
                v: lin(8)?,
                o: lin(9)?,
                gate: lin(10)?,
                up: lin(11)?,
                down: lin(12)?,
            });
        }
        let table = format!("{t}patch_embedder.position_embedding_table");
        let positions = store.load_f32(&table, &[2, v.position_embedding_size, v.hidden_size], None)?;
        let standardize = match v.standardize {
            false => None,
            true => Some((
                load_vector(store, &format!("{t}std_bias"), v.hidden_size)?,
                load_vector(store, &format!("{t}std_scale"), v.hidden_size)?,
            )),
        };
        Ok(Self {
            cfg: v.clone(),
            text_hidden: cfg.text.hidden_size,
            patch: mat(
                &format!("{t}patch_embedder.input_proj.weight"),
                [v.hidden_size, 3 * v.patch_size * v.patch_size],
            )?,
            positions,
            layers,
            standardize,
            proj: mat("model.embed_vision.embedding_projection.weight", [cfg.text.hidden_size, v.hidden_size])?,
        })
    }

    /// `x [rows, in] -> [rows, out]` on the backend.
    fn linear(&self, b: &B, x: &[f32], rows: usize, w: &B::Mat) -> Result<Vec<f32>> {
        let out_width = b.mat_shape(w).0;
        let xb = b.upload(x)?;
        let mut yb = b.alloc(rows * out_width)?;
        b.linears(&xb, rows, &mut [LinearOut::new(b, w, &mut yb)]);
        let mut y = vec![0.0; rows * out_width];
        b.read(&yb, 0, &mut y);
        Ok(y)
    }

    fn clipped(&self, b: &B, x: &[f32], rows: usize, l: &Linear<B>) -> Result<Vec<f32>> {
        let Some([lo, hi, out_lo, out_hi]) = l.clip else { return self.linear(b, x, rows, &l.w) };
        let xc: Vec<f32> = x.iter().map(|v| v.clamp(lo, hi)).collect();
        let mut y = self.linear(b, &xc, rows, &l.w)?;
        y.iter_mut().for_each(|v| *v = v.clamp(out_lo, out_hi));
        Ok(y)
    }

    /// The soft tokens of one image, projected to the text width: `[soft, text_hidden]`.
    pub fn encode(&self, b: &B, img: &ImagePatches) -> Result<Vec<f32>> {
        let v = &self.cfg;
        let (n, h, eps) = (img.positions.len(), v.hidden_size, v.eps as f32);
        let k = v.pooling;
        ensure!(
            n > 0 && img.pixels.len() == n * 3 * v.patch_size * v.patch_size,
            "image patches do not match the tower"
        );
        let (max_x, max_y) = img.positions.iter().fold((0, 0), |(a, c), &(x, y)| (a.max(x), c.max(y)));
        let (gw, gh) = (max_x as usize + 1, max_y as usize + 1);
        ensure!(
            gw * gh == n && gw.is_multiple_of(k) && gh.is_multiple_of(k),
            "the image's {gw} x {gh} patch grid must be whole {k} x {k} blocks"
        );
        ensure!(
            gw.max(gh) <= v.position_embedding_size,
            "the image is {gw} x {gh} patches; the position table holds {}",
            v.position_embedding_size
        );
        let pixels: Vec<f32> = img.pixels.iter().map(|p| 2.0 * (p - 0.5)).collect();
        let mut x = self.linear(b, &pixels, n, &self.patch)?;
        let table = v.position_embedding_size * h;
        for (r, &(px, py)) in img.positions.iter().enumerate() {
            let row = &mut x[r * h..(r + 1) * h];
            let (tx, ty) = (&self.positions[px as usize * h..][..h], &self.positions[table + py as usize * h..][..h]);
            for j in 0..h {
                row[j] += tx[j] + ty[j];
            }
        }
        let rope = Rope2d::new(v, &img.positions);
        for l in &self.layers {
            let xn = rms_norm(&x, h, Some(&l.input_norm), eps);
            let a = self.attention(b, l, &xn, n, &rope)?;
            add_normed(&mut x, &a, h, &l.post_attn_norm, eps);
            let xn = rms_norm(&x, h, Some(&l.pre_ffn_norm), eps);
            let mut g = self.clipped(b, &xn, n, &l.gate)?;
            let u = self.clipped(b, &xn, n, &l.up)?;
            for (gi, ui) in g.iter_mut().zip(&u) {
                *gi = gelu_tanh(*gi) * ui;
            }
            let m = self.clipped(b, &g, n, &l.down)?;
            add_normed(&mut x, &m, h, &l.post_ffn_norm, eps);
        }
        // Average each k x k block of patches (row-major over the pooled grid).
        let (pw, ph) = (gw / k, gh / k);
        let mut pooled = vec![0.0f32; pw * ph * h];
        for (r, &(px, py)) in img.positions.iter().enumerate() {
            let t = (px as usize / k) + pw * (py as usize / k);
            for j in 0..h {
                pooled[t * h + j] += x[r * h + j] / (k * k) as f32;
            }
        }
        let root = (h as f32).sqrt();
        pooled.iter_mut().for_each(|p| *p *= root);
        if let Some((bias, scale)) = &self.standardize {
            for row in pooled.chunks_mut(h) {
                for j in 0..h {
                    row[j] = (row[j] - bias[j]) * scale[j];
                }
            }
        }
        let normed = rms_norm(&pooled, h, None, eps);
        let out = self.linear(b, &normed, pw * ph, &self.proj)?;
        debug_assert_eq!(out.len(), pw * ph * self.text_hidden);
        Ok(out)
    }

    fn attention(&self, b: &B, l: &VisionLayer<B>, xn: &[f32], n: usize, rope: &Rope2d) -> Result<Vec<f32>> {
        let v = &self.cfg;
        let (hd, heads, kvh) = (v.head_dim, v.heads, v.kv_heads);
        let eps = v.eps as f32;
        let mut q = self.clipped(b, xn, n, &l.q)?;
        let mut k = self.clipped(b, xn, n, &l.k)?;
        let vv = self.clipped(b, xn, n, &l.v)?;
        q = rms_norm(&q, hd, Some(&l.q_norm), eps);
        k = rms_norm(&k, hd, Some(&l.k_norm), eps);
        let vv = rms_norm(&vv, hd, None, eps);
        rope.apply(&mut q, heads, hd);
        rope.apply(&mut k, kvh, hd);
        let group = heads / kvh;
        let mut out = vec![0.0f32; n * heads * hd];
        let mut scores = vec![0.0f32; n];
        for i in 0..n {
            for hh in 0..heads {
                let qi = &q[(i * heads + hh) * hd..][..hd];
                let kh = hh / group;
                let mut max = f32::NEG_INFINITY;
                for (j, s) in scores.iter_mut().enumerate() {
                    let kj = &k[(j * kvh + kh) * hd..][..hd];
                    *s = qi.iter().zip(kj).map(|(a, c)| a * c).sum::<f32>();
                    max = max.max(*s);
                }
                let mut sum = 0.0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                let o = &mut out[(i * heads + hh) * hd..][..hd];
                for (j, s) in scores.iter().enumerate() {
                    let w = s / sum;
                    let vj = &vv[(j * kvh + kh) * hd..][..hd];
                    for d in 0..hd {
                        o[d] += w * vj[d];
                    }
                }
            }
        }
        self.clipped(b, &out, n, &l.o)
    }
}

/// 2-D RoPE tables: per patch, cos/sin of `x * f` and `y * f` over the
/// `head_dim / 4` frequencies `theta^(-2i / (head_dim / 2))`.
struct Rope2d {
    quarter: usize,
    /// `[patches, 2, quarter]`.
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope2d {
    fn new(v: &VisionConfig, positions: &[(u32, u32)]) -> Self {
        let half = v.head_dim / 2;
        let quarter = half / 2;
        let inv: Vec<f32> =
            (0..quarter).map(|i| (1.0 / v.rope_theta.powf((2 * i) as f64 / half as f64)) as f32).collect();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &(x, y) in positions {
            for p in [x, y] {
                for f in &inv {
                    let a = p as f32 * f;
                    cos.push(a.cos());
                    sin.push(a.sin());
                }
            }
        }
        Self { quarter, cos, sin }
    }

    /// Rotates each head of `t` (`[patches, heads, head_dim]`): its first half by x and
    /// its second by y, each half as `x * cos + rotate_half(x) * sin`.
    fn apply(&self, t: &mut [f32], heads: usize, hd: usize) {
        let q = self.quarter;
        for (r, row) in t.chunks_mut(heads * hd).enumerate() {
            for head in row.chunks_mut(hd) {
                for part in 0..2 {
                    let c = &self.cos[(r * 2 + part) * q..][..q];
                    let s = &self.sin[(r * 2 + part) * q..][..q];
                    let seg = &mut head[part * 2 * q..(part + 1) * 2 * q];
                    for i in 0..q {
                        let (a, bb) = (seg[i], seg[i + q]);
                        seg[i] = a * c[i] - bb * s[i];
                        seg[i + q] = bb * c[i] + a * s[i];
                    }
                }
            }
        }
    }
}

/// RMSNorm of each `width` slice: `x * (mean(x^2) + eps)^-0.5 * w`.
fn rms_norm(x: &[f32], width: usize, w: Option<&[f32]>, eps: f32) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for (o, row) in out.chunks_mut(width).zip(x.chunks(width)) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / width as f32;
        let inv = (ms + eps).powf(-0.5);
        for j in 0..width {
            o[j] = row[j] * inv * w.map_or(1.0, |w| w[j]);
        }
    }
    out
}

/// `x += rms_norm(y) * w`.
fn add_normed(x: &mut [f32], y: &[f32], width: usize, w: &[f32], eps: f32) {
    for (xi, ni) in x.iter_mut().zip(rms_norm(y, width, Some(w), eps)) {
        *xi += ni;
    }
}

fn gelu_tanh(x: f32) -> f32 {
    0.5 * x * (1.0 + ((2.0 / std::f32::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}
