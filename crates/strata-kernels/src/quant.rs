//! Quantized matrix encodings for routed experts, `W[rows = out, cols = in]`:
//! - int8-row: `rows*cols` i8, one f32 scale per row: `w = q * s[r]`;
//! - int4-group(gs): two values a byte (low nibble = even column, high = odd column),
//!   `w = (nibble - 8) * s[r, c / gs]`, `rows * ceil(cols/gs)` scales (per-row int4 is
//!   `gs == cols`), stored as f32 (`int4-gN`), bf16 (`int4-gN-bf16`: half the scale
//!   bytes, which at g128 make an expert 3% smaller) or e4m3 times one power of two a
//!   matrix (`int4-gN-e4m3`: a quarter, so g64 is the size of g128-bf16); the nibbles are
//!   chosen against the rounded scale, so the rounding costs next to nothing;
//! - bf16 / f32: plain little-endian values, no scales;
//! - fp8 (e4m3, DeepSeek/GLM FP8 checkpoints): `rows*cols` bytes and one f32 scale per
//!   block of `block_rows x block_cols`: `w = e4m3(q) * s[r / br, c / bc]`.
//!
//! Quantization is symmetric absmax (int8: s = amax/127; int4: s = amax/7, q in [-8, 7];
//! with e4m3 scales, the e4m3 value near amax/7 that leaves the group the least squared
//! error, see `e4m3_search`).

use half::bf16;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantKind {
    F32,
    Bf16,
    Int8Row,
    Int4Group {
        group: usize,
        scales: ScaleType,
    },
    Fp8 {
        block_rows: usize,
        block_cols: usize,
    },
    /// OCP MXFP4 (gpt-oss's experts): FP4 e2m1 nibbles (low nibble first), one e8m0 scale
    /// (`2^(code - 127)`) for each 32 columns, in int4's layout: `cols / 2` bytes a row,
    /// the scales row-major by (row, group). Columns must be a multiple of 32.
    Mxfp4,
}

/// MXFP4's columns per scale.
pub const MXFP4_GROUP: usize = 32;

/// FP4 e2m1's values by code: sign in bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
pub const FP4_VALUES: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// The FP4 code nearest `v` (at most 6 in magnitude; ties to the even code).
pub fn fp4_code(v: f32) -> u8 {
    let a = v.abs().min(6.0);
    let mut best = 0u8;
    for c in 1..8u8 {
        let (d, db) = ((FP4_VALUES[c as usize] - a).abs(), (FP4_VALUES[best as usize] - a).abs());
        if d < db || (d == db && c % 2 == 0) {
            best = c;
        }
    }
    if v.is_sign_negative() && best != 0 {
        best | 8
    } else {
        best
    }
}

/// The value of e8m0 scale `code`: `2^(code - 127)` (255, NaN in the standard, reads as
/// infinity; no checkpoint stores it).
#[inline(always)]
pub fn e8m0_scale(code: u8) -> f32 {
    if code == 0 {
        f32::from_bits(1 << 22)
    } else {
        f32::from_bits((code as u32) << 23)
    }
}

/// How an encoding's scales are stored (every kernel computes with them as f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum ScaleType {
    #[default]
    F32,
    /// The top half of an f32: exact to widen, 2 bytes a scale.
    Bf16,
    /// One e4m3 byte a scale (sign clear, never NaN) times `2^k`, one `k` a matrix, stored
    /// as an f32 ahead of the bytes (the region's first 4 bytes). `k` is the least with
    /// every scale at most `448 * 2^k`, so the largest lands in e4m3's top binade and the
    /// rest keep its 4 significant bits down to `2^(k-6)` (a range of 2^15, far more than
    /// one matrix's groups span). Exact to widen: `f32(code << 20) * 2^120 * 2^k`.
    E4m3,
    /// One byte a scale, a power of two `2^(code - 127)` (MXFP4's).
    E8m0,
}

/// Bytes ahead of an e4m3 matrix's scale codes: its factor `2^k` as f32.
pub const E4M3_HEADER: usize = 4;

impl ScaleType {
    /// Bytes of one scale (not counting an e4m3 matrix's header).
    pub fn bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
            Self::E4m3 | Self::E8m0 => 1,
        }
    }

    /// Bytes of a matrix's `count` scales as stored.
    pub fn region_bytes(self, count: usize) -> usize {
        count * self.bytes() + if self == Self::E4m3 { E4M3_HEADER } else { 0 }
    }

    /// Scales in a stored region of `len` bytes (the inverse of `region_bytes`).
    pub fn count(self, len: usize) -> usize {
        len.saturating_sub(if self == Self::E4m3 { E4M3_HEADER } else { 0 }) / self.bytes()
    }

    /// The name `--scales` takes and an encoding's suffix carries.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::E4m3 => "e4m3",
            Self::E8m0 => "e8m0",
        }
    }

    /// Parses `f32`, `bf16` or `e4m3`.
    pub fn parse(s: &str) -> Result<Self, String> {
        [Self::F32, Self::Bf16, Self::E4m3]
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| format!("unknown scale type `{s}` (f32, bf16 or e4m3; e8m0 comes with mxfp4 only)"))
    }

    /// A matrix's scales as this type stores them: to nearest bf16; to nearest e4m3 times
    /// the matrix's factor (from their largest, see [`e4m3_factor`]); f32 as they are.
    pub fn round_all(self, scales: &mut [f32]) {
        let factor = self.factor_of(scales);
        scales.iter_mut().for_each(|s| *s = self.round(*s, factor));
    }

    /// The matrix factor of a matrix's `scales` (from their largest; 1 but for e4m3).
    pub fn factor_of(self, scales: &[f32]) -> f32 {
        self.factor(scales.iter().fold(0f32, |a, &s| a.max(s)))
    }

    /// The matrix factor for a largest scale of `max` (1 but for e4m3).
    fn factor(self, max: f32) -> f32 {
        if self == Self::E4m3 {
            e4m3_factor(max)
        } else {
            1.0
        }
    }

    /// One scale as stored, in a matrix of factor `factor` (see `factor`).
    fn round(self, s: f32, factor: f32) -> f32 {
        match self {
            Self::F32 => s,
            Self::Bf16 => bf16::from_f32(s).to_f32(),
            Self::E4m3 => e4m3_round(s, factor),
            Self::E8m0 => e8m0_scale(e8m0_code(s)),
        }
    }
}

/// The factor `2^k` of an e4m3-scaled matrix whose largest scale is `max`: the least `k`
/// with `max <= 448 * 2^k` (1 for no positive scale).
pub fn e4m3_factor(max: f32) -> f32 {
    if !(max > 0.0 && max.is_finite()) {
        return 1.0;
    }
    // f32 powers of two run from 2^-149 to 2^127: k stays inside (448 * 2^-149 is above
    // every subnormal max, f32::MAX / 448 below 2^120).
    let mut k = (max / 448.0).log2().ceil() as i32;
    while k > -149 && max <= 448.0 * pow2(k - 1) {
        k -= 1;
    }
    while max > 448.0 * pow2(k) {
        k += 1;
    }
    pow2(k)
}

/// `2^k` as f32 for `k` in -149..=127 (subnormal below -126).
fn pow2(k: i32) -> f32 {
    if k >= -126 {
        f32::from_bits(((k + 127) as u32) << 23)
    } else {
        f32::from_bits(1u32 << (k + 149))
    }
}

/// The value of e4m3 scale `code` in a matrix of factor `factor`, as every kernel widens it.
#[inline(always)]
pub fn e4m3_scale(code: u8, factor: f32) -> f32 {
    f32::from_bits((code as u32) << 20) * E4M3_WIDEN * factor
}

/// `2^120`: an e4m3 byte shifted into an f32's exponent and mantissa fields is its value
/// times `2^-120` (subnormals included).
pub const E4M3_WIDEN: f32 = f32::from_bits((120 + 127) << 23);

/// `s` to the nearest e4m3 multiple of `factor` (ties to the even code; at most 448
/// times it). A negative or non-finite `s` is returned as it is, for the encoder to refuse.
pub fn e4m3_round(s: f32, factor: f32) -> f32 {
    if !(s >= 0.0 && s.is_finite()) {
        return s;
    }
    e4m3_scale(e4m3_code(s, factor), factor)
}

/// The e8m0 code of the least power of two at or above `s` (`s` positive and finite;
/// clamped to the codes 0..=254).
pub fn e8m0_code(s: f32) -> u8 {
    if !(s > 0.0 && s.is_finite()) {
        return 127;
    }
    let e = s.log2().ceil() as i32;
    let mut c = (e + 127).clamp(0, 254);
    // log2 rounds: step to the least code whose scale reaches `s`.
    while c > 0 && e8m0_scale((c - 1) as u8) >= s {
        c -= 1;
    }
    while c < 254 && e8m0_scale(c as u8) < s {
        c += 1;
    }
    c as u8
}

/// The int4 level (-8..=7) nearest `v` at scale `s`: the nibble minus 8, as `quantize`
/// stores it and `e4m3_search` prices it.
#[inline]
fn int4_level(v: f32, s: f32) -> f32 {
    (v / s).round().clamp(-8.0, 7.0)
}

/// The e4m3 scale for a group `chunk` whose absmax scale is `s0`: of the codes from two
/// below the nearest to one above, the one whose nibbles leave the least squared error.
/// A step of e4m3 is 6-12%, so absmax / 7 rounded is often not the best value on its grid,
/// and a smaller one that clips the largest weight a little often beats it. On
/// strata-tiny (docs/performance.md, "Measured alternatives") this search takes g64's mean KL
/// from 0.0261 (nearest) to 0.0210, below int4-g64-bf16's 0.0253.
fn e4m3_search(chunk: &[f32], s0: f32, factor: f32) -> f32 {
    let err = |s: f32| -> f64 {
        chunk
            .iter()
            .map(|v| {
                let d = (v - int4_level(*v, s) * s) as f64;
                d * d
            })
            .sum()
    };
    let near = e4m3_code(s0, factor);
    let mut best = (err(e4m3_scale(near, factor)), near);
    for c in [near as i32 - 2, near as i32 - 1, near as i32 + 1] {
        if (1..=0x7e).contains(&c) {
            let e = err(e4m3_scale(c as u8, factor));
            if e < best.0 {
                best = (e, c as u8);
            }
        }
    }
    e4m3_scale(best.1, factor)
}

/// The e4m3 code nearest `s` in a matrix of factor `factor` (see [`e4m3_round`]).
pub(crate) fn e4m3_code(s: f32, factor: f32) -> u8 {
    // Codes 0..=0x7e increase with their values: find the first at or above `s`.
    let (mut lo, mut hi) = (0u8, 0x7fu8);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if e4m3_scale(mid, factor) < s {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    match lo {
        0 => 0,
        0x7f => 0x7e,
        c => {
            let (below, above) = (s - e4m3_scale(c - 1, factor), e4m3_scale(c, factor) - s);
            if below < above || (below == above && (c - 1) % 2 == 0) {
                c - 1
            } else {
                c
            }
        }
    }
}

impl QuantKind {
    /// int4 with groups of `group` inputs and f32 scales.
    pub const fn int4(group: usize) -> Self {
        Self::Int4Group { group, scales: ScaleType::F32 }
    }

    /// int4 with groups of `group` inputs and bf16 scales.
    pub const fn int4_bf16(group: usize) -> Self {
        Self::Int4Group { group, scales: ScaleType::Bf16 }
    }

    /// int4 with groups of `group` inputs and e4m3 scales (one power of two a matrix).
    pub const fn int4_e4m3(group: usize) -> Self {
        Self::Int4Group { group, scales: ScaleType::E4m3 }
    }

    /// How the scales are stored (f32 for every encoding but `int4-gN-bf16` and
    /// `int4-gN-e4m3`).
    pub fn scale_type(self) -> ScaleType {
        match self {
            Self::Int4Group { scales, .. } => scales,
            Self::Mxfp4 => ScaleType::E8m0,
            _ => ScaleType::F32,
        }
    }

    /// The same encoding with f32 scales (same values: bf16 and e4m3 scales widen exactly).
    pub fn with_f32_scales(self) -> Self {
        match self {
            Self::Int4Group { group, .. } => Self::int4(group),
            k => k,
        }
    }

    /// Bytes of the stored scales.
    pub fn scale_bytes(self, rows: usize, cols: usize) -> usize {
        self.scale_type().region_bytes(self.scale_count(rows, cols))
    }

    /// Bytes of payload and scales.
    pub fn stored_bytes(self, rows: usize, cols: usize) -> usize {
        self.payload_bytes(rows, cols) + self.scale_bytes(rows, cols)
    }

    /// Bytes of the payload (without scales).
    pub fn payload_bytes(self, rows: usize, cols: usize) -> usize {
        match self {
            Self::F32 => rows * cols * 4,
            Self::Bf16 => rows * cols * 2,
            Self::Int8Row => rows * cols,
            Self::Int4Group { .. } | Self::Mxfp4 => rows * cols.div_ceil(2),
            Self::Fp8 { .. } => rows * cols,
        }
    }

    /// Number of scales.
    pub fn scale_count(self, rows: usize, cols: usize) -> usize {
        match self {
            Self::F32 | Self::Bf16 => 0,
            Self::Int8Row => rows,
            Self::Int4Group { group, .. } => rows * cols.div_ceil(group),
            Self::Mxfp4 => rows * cols.div_ceil(MXFP4_GROUP),
            Self::Fp8 { block_rows, block_cols } => rows.div_ceil(block_rows) * cols.div_ceil(block_cols),
        }
    }

    pub fn name(self) -> String {
        match self {
            Self::F32 => "f32".into(),
            Self::Bf16 => "bf16".into(),
            Self::Int8Row => "int8".into(),
            Self::Int4Group { group, scales: ScaleType::F32 } => format!("int4-g{group}"),
            Self::Int4Group { group, scales } => format!("int4-g{group}-{}", scales.name()),
            Self::Fp8 { block_rows, block_cols } => format!("fp8-b{block_rows}x{block_cols}"),
            Self::Mxfp4 => "mxfp4".into(),
        }
    }

    /// Parses `f32`, `bf16`, `int8`, `int4-gN`, `int4-gN-bf16`, `int4-gN-e4m3`, `fp8-bRxC`,
    /// `mxfp4`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Self::F32),
            "mxfp4" => Ok(Self::Mxfp4),
            "bf16" => Ok(Self::Bf16),
            "int8" => Ok(Self::Int8Row),
            _ if s.starts_with("fp8-b") => {
                let dims =
                    s["fp8-b".len()..].split_once('x').and_then(|(r, c)| Some((r.parse().ok()?, c.parse().ok()?)));
                match dims {
                    Some((br, bc)) if br > 0 && bc > 0 => Ok(Self::Fp8 { block_rows: br, block_cols: bc }),
                    _ => Err(format!("unknown encoding `{s}` (fp8 is written fp8-bRxC with positive R and C)")),
                }
            }
            _ => {
                let (rest, scales) = [ScaleType::Bf16, ScaleType::E4m3]
                    .into_iter()
                    .find_map(|t| Some((s.strip_suffix(&format!("-{}", t.name()))?, t)))
                    .unwrap_or((s, ScaleType::F32));
                let group = rest
                    .strip_prefix("int4-g")
                    .and_then(|g| g.parse::<usize>().ok())
                    .filter(|&g| g >= 2 && g % 2 == 0)
                    .ok_or_else(|| {
                        format!(
                            "unknown expert encoding `{s}` (f32, bf16, int8, int4-gN, int4-gN-bf16 or int4-gN-e4m3 with even N, mxfp4)"
                        )
                    })?;
                Ok(Self::Int4Group { group, scales })
            }
        }
    }
}

/// Encodes `w` (row-major `rows x cols`) as `kind`: (payload, scales as f32 values; with
/// bf16 scales each is a bf16 value, stored by [`encode_scales`]). Large matrices are
/// cut into bands of rows (whole FP8 blocks) encoded on every core; payload and scales are
/// row-major, so the bands' outputs concatenate to the same bytes as one pass.
pub fn quantize(kind: QuantKind, w: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    assert_eq!(w.len(), rows * cols, "quantize: {} values for {rows}x{cols}", w.len());
    let threads = crate::pool::default_threads();
    let unit = match kind {
        QuantKind::Fp8 { block_rows, .. } => block_rows,
        _ => 1,
    };
    let band = rows.div_ceil(threads).div_ceil(unit) * unit;
    let factor = quantize_factor(kind, w);
    if threads == 1 || rows * cols < 1 << 20 || band >= rows {
        return quantize_band(kind, w, rows, cols, factor);
    }
    let parts: Vec<(Vec<u8>, Vec<f32>)> = std::thread::scope(|s| {
        let handles: Vec<_> = w
            .chunks(band * cols)
            .map(|b| s.spawn(move || quantize_band(kind, b, b.len() / cols, cols, factor)))
            .collect();
        handles.into_iter().map(|h| h.join().expect("a quantize band panicked")).collect()
    });
    let (mut payload, mut scales) = (Vec::with_capacity(kind.payload_bytes(rows, cols)), Vec::new());
    for (p, sc) in parts {
        payload.extend_from_slice(&p);
        scales.extend_from_slice(&sc);
    }
    (payload, scales)
}

/// An e4m3-scaled matrix's one factor, from its largest scale (absmax / 7), for every
/// band (1 for other encodings).
fn quantize_factor(kind: QuantKind, w: &[f32]) -> f32 {
    kind.scale_type().factor(w.iter().fold(0f32, |a, v| a.max(v.abs())) / 7.0)
}

fn quantize_band(kind: QuantKind, w: &[f32], rows: usize, cols: usize, factor: f32) -> (Vec<u8>, Vec<f32>) {
    match kind {
        QuantKind::F32 => (w.iter().flat_map(|v| v.to_le_bytes()).collect(), vec![]),
        QuantKind::Bf16 => (w.iter().flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes()).collect(), vec![]),
        QuantKind::Int8Row => {
            let mut payload = Vec::with_capacity(rows * cols);
            let mut scales = Vec::with_capacity(rows);
            for row in w.chunks_exact(cols) {
                let amax = row.iter().fold(0f32, |a, v| a.max(v.abs()));
                let s = if amax > 0.0 { amax / 127.0 } else { 1.0 };
                scales.push(s);
                payload.extend(row.iter().map(|v| (v / s).round().clamp(-127.0, 127.0) as i8 as u8));
            }
            (payload, scales)
        }
        QuantKind::Int4Group { group, scales: stype } => {
            let groups = cols.div_ceil(group);
            let mut payload = vec![0u8; rows * cols.div_ceil(2)];
            let mut scales = Vec::with_capacity(rows * groups);
            for (r, row) in w.chunks_exact(cols).enumerate() {
                let dst = &mut payload[r * cols.div_ceil(2)..(r + 1) * cols.div_ceil(2)];
                for (g, chunk) in row.chunks(group).enumerate() {
                    let amax = chunk.iter().fold(0f32, |a, v| a.max(v.abs()));
                    // The nibbles below are chosen against the scale as stored.
                    let s = match stype {
                        ScaleType::E4m3 if amax > 0.0 => e4m3_search(chunk, amax / 7.0, factor),
                        t => t.round(amax / 7.0, factor),
                    };
                    // A zero group (or one below e4m3's least step) takes any stored scale.
                    let s = match stype {
                        _ if s > 0.0 && s.is_finite() => s,
                        ScaleType::E4m3 => e4m3_scale(1, factor),
                        _ => 1.0,
                    };
                    scales.push(s);
                    for (j, v) in chunk.iter().enumerate() {
                        let c = g * group + j;
                        let nib = (int4_level(*v, s) as i32 + 8) as u8;
                        dst[c / 2] |= if c % 2 == 0 { nib } else { nib << 4 };
                    }
                }
            }
            (payload, scales)
        }
        QuantKind::Mxfp4 => {
            let (half, groups) = (cols.div_ceil(2), cols.div_ceil(MXFP4_GROUP));
            let mut payload = vec![0u8; rows * half];
            let mut scales = Vec::with_capacity(rows * groups);
            for (r, row) in w.chunks_exact(cols).enumerate() {
                let dst = &mut payload[r * half..(r + 1) * half];
                for (g, chunk) in row.chunks(MXFP4_GROUP).enumerate() {
                    // The least power of two that keeps the group within FP4's +-6.
                    let amax = chunk.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let s = e8m0_scale(if amax > 0.0 { e8m0_code(amax / 6.0) } else { 127 });
                    scales.push(s);
                    for (j, v) in chunk.iter().enumerate() {
                        let c = g * MXFP4_GROUP + j;
                        let nib = fp4_code(v / s);
                        dst[c / 2] |= if c.is_multiple_of(2) { nib } else { nib << 4 };
                    }
                }
            }
            (payload, scales)
        }
        QuantKind::Fp8 { block_rows, block_cols } => {
            let (nrb, ncb) = (rows.div_ceil(block_rows), cols.div_ceil(block_cols));
            let mut scales = vec![1f32; nrb * ncb];
            for (b, s) in scales.iter_mut().enumerate() {
                let (rb, cb) = (b / ncb, b % ncb);
                let mut amax = 0f32;
                for r in rb * block_rows..((rb + 1) * block_rows).min(rows) {
                    for c in cb * block_cols..((cb + 1) * block_cols).min(cols) {
                        amax = amax.max(w[r * cols + c].abs());
                    }
                }
                if amax > 0.0 {
                    *s = amax / 448.0;
                }
            }
            let payload = (0..rows * cols)
                .map(|i| {
                    let (r, c) = (i / cols, i % cols);
                    crate::fp8::f32_to_e4m3(w[i] / scales[(r / block_rows) * ncb + c / block_cols])
                })
                .collect();
            (payload, scales)
        }
    }
}

/// Rounds a matrix's scales to `kind`'s scale type (see [`ScaleType::round_all`]).
pub fn round_scales(kind: QuantKind, scales: &mut [f32]) {
    kind.scale_type().round_all(scales);
}

/// The stored bytes of a matrix's `scales` (f32 values from [`quantize`]) in `kind`'s
/// scale type, little-endian (e4m3: the matrix factor, then a byte a scale). A bf16 or
/// e4m3 scale must be exact in its type (the nibbles were chosen against that value):
/// otherwise an error names the first that is not.
pub fn encode_scales(kind: QuantKind, scales: &[f32]) -> Result<Vec<u8>, String> {
    let t = kind.scale_type();
    let mut out = Vec::with_capacity(t.region_bytes(scales.len()));
    let not = |i: usize, v: f32, what: &str| format!("{}: scale {i} ({v:e}) is not {what}", kind.name());
    match t {
        ScaleType::F32 => scales.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        ScaleType::Bf16 => {
            for (i, &v) in scales.iter().enumerate() {
                let b = bf16::from_f32(v);
                if b.to_f32().to_bits() != v.to_bits() {
                    return Err(not(i, v, "a bf16 value"));
                }
                out.extend_from_slice(&b.to_bits().to_le_bytes());
            }
        }
        ScaleType::E4m3 => {
            let factor = t.factor_of(scales);
            out.extend_from_slice(&factor.to_le_bytes());
            for (i, &v) in scales.iter().enumerate() {
                let c = e4m3_code(v, factor);
                if e4m3_scale(c, factor).to_bits() != v.to_bits() {
                    return Err(not(i, v, &format!("an e4m3 value times the matrix factor {factor:e}")));
                }
                out.push(c);
            }
        }
        ScaleType::E8m0 => {
            for (i, &v) in scales.iter().enumerate() {
                let c = e8m0_code(v);
                if e8m0_scale(c).to_bits() != v.to_bits() {
                    return Err(not(i, v, "a power of two"));
                }
                out.push(c);
            }
        }
    }
    Ok(out)
}

/// f32 values of stored scale bytes (the inverse of [`encode_scales`]; a region too short
/// for an e4m3 header has no scales).
pub fn decode_scales(kind: QuantKind, bytes: &[u8]) -> Vec<f32> {
    match kind.scale_type() {
        ScaleType::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        ScaleType::Bf16 => {
            bytes.chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect()
        }
        ScaleType::E4m3 => match bytes.split_first_chunk::<E4M3_HEADER>() {
            Some((f, codes)) => codes.iter().map(|&c| e4m3_scale(c, f32::from_le_bytes(*f))).collect(),
            None => Vec::new(),
        },
        ScaleType::E8m0 => bytes.iter().map(|&c| e8m0_scale(c)).collect(),
    }
}

/// The plain reference decoder: f32 values of an encoded matrix.
pub fn dequantize(kind: QuantKind, payload: &[u8], scales: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    assert_eq!(payload.len(), kind.payload_bytes(rows, cols), "dequantize: payload size");
    assert_eq!(scales.len(), kind.scale_count(rows, cols), "dequantize: scale count");
    let mut out = vec![0f32; rows * cols];
    match kind {
        QuantKind::F32 => {
            for (o, c) in out.iter_mut().zip(payload.chunks_exact(4)) {
                *o = f32::from_le_bytes(c.try_into().unwrap());
            }
        }
        QuantKind::Bf16 => {
            for (o, c) in out.iter_mut().zip(payload.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        QuantKind::Int8Row => {
            for r in 0..rows {
                for c in 0..cols {
                    out[r * cols + c] = payload[r * cols + c] as i8 as f32 * scales[r];
                }
            }
        }
        QuantKind::Int4Group { group, .. } => {
            let (half, groups) = (cols.div_ceil(2), cols.div_ceil(group));
            for r in 0..rows {
                for c in 0..cols {
                    let byte = payload[r * half + c / 2];
                    let nib = if c % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                    out[r * cols + c] = (nib as f32 - 8.0) * scales[r * groups + c / group];
                }
            }
        }
        QuantKind::Mxfp4 => {
            let (half, groups) = (cols.div_ceil(2), cols.div_ceil(MXFP4_GROUP));
            for r in 0..rows {
                for c in 0..cols {
                    let byte = payload[r * half + c / 2];
                    let nib = if c % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                    out[r * cols + c] = FP4_VALUES[nib as usize] * scales[r * groups + c / MXFP4_GROUP];
                }
            }
        }
        QuantKind::Fp8 { block_rows, block_cols } => {
            let ncb = cols.div_ceil(block_cols);
            for r in 0..rows {
                for c in 0..cols {
                    let q = crate::fp8::fp8_e4m3_to_f32(payload[r * cols + c]);
                    out[r * cols + c] = q * scales[(r / block_rows) * ncb + c / block_cols];
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn sizes_names_and_parse() {
        let k = QuantKind::int4(64);
        assert_eq!(k.payload_bytes(2048, 6144), 2048 * 3072);
        assert_eq!(k.scale_count(2048, 6144), 2048 * 96);
        assert_eq!(QuantKind::parse(&k.name()).unwrap(), k);
        let f = QuantKind::Fp8 { block_rows: 128, block_cols: 64 };
        assert_eq!(f.scale_count(300, 130), 3 * 3);
        assert_eq!(QuantKind::parse(&f.name()).unwrap(), f);
        assert!(QuantKind::parse("fp8-b0x4").is_err());
        for s in ["f32", "bf16", "int8"] {
            assert_eq!(QuantKind::parse(s).unwrap().name(), s);
        }
        assert!(QuantKind::parse("int4-g3").is_err());
        let b = QuantKind::int4_bf16(128);
        assert_eq!(b.name(), "int4-g128-bf16");
        assert_eq!(QuantKind::parse("int4-g128-bf16").unwrap(), b);
        assert_eq!(b.scale_bytes(2048, 6144), 2048 * 48 * 2);
        assert_eq!(b.stored_bytes(2048, 6144), 2048 * 3072 + 2048 * 48 * 2);
        assert_eq!(b.with_f32_scales(), QuantKind::int4(128));
        assert!(QuantKind::parse("int4-g3-bf16").is_err());
        assert!(QuantKind::parse("int8-bf16").is_err());
        assert!(QuantKind::parse("q4").unwrap_err().contains("unknown expert encoding"));
    }

    #[test]
    fn banded_quantize_equals_one_pass() {
        // Large enough to be cut into bands; 517 rows is no multiple of the cores or of
        // the FP8 block, so the last band is short.
        let (rows, cols) = (517, 2080);
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        for kind in [
            QuantKind::Bf16,
            QuantKind::Int8Row,
            QuantKind::int4(64),
            QuantKind::int4_e4m3(64),
            QuantKind::Fp8 { block_rows: 128, block_cols: 128 },
            QuantKind::Fp8 { block_rows: 3, block_cols: 7 },
        ] {
            assert_eq!(
                quantize(kind, &w, rows, cols),
                quantize_band(kind, &w, rows, cols, quantize_factor(kind, &w)),
                "{}",
                kind.name()
            );
        }
    }

    #[test]
    fn roundtrip_error_is_within_half_a_step() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let (rows, cols) = (7usize, 150usize);
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        for kind in [
            QuantKind::Int8Row,
            QuantKind::int4(32),
            QuantKind::int4(150),
            QuantKind::int4_bf16(32),
            // (e4m3 scales may clip the largest weight: see the e4m3 test for their bound.)
        ] {
            let (p, s) = quantize(kind, &w, rows, cols);
            let d = dequantize(kind, &p, &s, rows, cols);
            for r in 0..rows {
                for c in 0..cols {
                    let scale = match kind {
                        QuantKind::Int8Row => s[r],
                        QuantKind::Int4Group { group, .. } => s[r * cols.div_ceil(group) + c / group],
                        _ => unreachable!(),
                    };
                    assert!((d[r * cols + c] - w[r * cols + c]).abs() <= scale * 0.5 + 1e-6, "{kind:?}");
                }
            }
        }
        let (p, s) = quantize(QuantKind::Bf16, &w, rows, cols);
        let d = dequantize(QuantKind::Bf16, &p, &s, rows, cols);
        assert!(d.iter().zip(&w).all(|(a, b)| (a - b).abs() <= b.abs() / 128.0));
    }

    #[test]
    fn bf16_scales_are_bf16_values_and_round_trip() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (rows, cols) = (9usize, 256usize);
        // Magnitudes from 1e-30 to 1e30: bf16 keeps f32's range.
        let w: Vec<f32> =
            (0..rows * cols).map(|i| rng.random_range(-1.0f32..1.0) * 10f32.powi((i / cols) as i32 * 7 - 30)).collect();
        let kind = QuantKind::int4_bf16(64);
        let (p, s) = quantize(kind, &w, rows, cols);
        let bytes = encode_scales(kind, &s).unwrap();
        assert_eq!(bytes.len(), kind.scale_bytes(rows, cols));
        assert_eq!(decode_scales(kind, &bytes), s);
        // Chosen against the rounded scale, the nibbles stay within half a step of it.
        let d = dequantize(kind, &p, &s, rows, cols);
        for (i, (a, b)) in d.iter().zip(&w).enumerate() {
            assert!((a - b).abs() <= s[(i / cols) * 4 + (i % cols) / 64] * 0.5 * (1.0 + 1e-6), "{i}: {a} {b}");
        }
        let f = QuantKind::int4(64);
        assert_eq!(decode_scales(f, &encode_scales(f, &s).unwrap()), s);
        let err = encode_scales(kind, &[1.0, 1.0 + 1.0 / 1024.0]).unwrap_err();
        assert!(err.contains("int4-g64-bf16: scale 1 (1.0009766e0) is not a bf16 value"), "{err}");
    }

    #[test]
    fn e4m3_scales_round_to_nearest_and_round_trip() {
        // The kernels' widening is the e4m3 table; rounding is to the nearest code.
        for c in 0u8..0x7f {
            assert_eq!(e4m3_scale(c, 1.0), crate::fp8::fp8_e4m3_to_f32(c), "code {c:#x}");
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(17);
        for _ in 0..2000 {
            let f = pow2(rng.random_range(-30..10));
            let s = rng.random_range(0.0f32..460.0) * f;
            let r = e4m3_round(s, f);
            let best = (0u8..0x7f).map(|c| (e4m3_scale(c, f) - s).abs()).fold(f32::INFINITY, f32::min);
            assert_eq!((r - s).abs(), best, "{s:e} at factor {f:e}");
        }
        assert_eq!(e4m3_round(-1.0, 1.0), -1.0, "a negative scale is left for the encoder to refuse");
        // The factor puts the largest scale in the top binade: 2^k * 224 < max <= 2^k * 448.
        for max in [1e-30f32, 3e-3, 0.07, 1.0, 448.0, 449.0, 1e30, f32::MIN_POSITIVE / 4.0] {
            let f = e4m3_factor(max);
            assert!(max <= 448.0 * f && (f < 2f32.powi(-140) || max > 224.0 * f), "{max:e}: {f:e}");
        }
        assert_eq!(e4m3_factor(0.0), 1.0);

        let (rows, cols) = (9usize, 256usize);
        let kind = QuantKind::int4_e4m3(64);
        assert_eq!(kind.name(), "int4-g64-e4m3");
        assert_eq!(QuantKind::parse("int4-g64-e4m3").unwrap(), kind);
        assert_eq!(kind.scale_bytes(2048, 6144), 4 + 2048 * 96);
        assert_eq!(kind.stored_bytes(6144, 2048), QuantKind::int4_bf16(128).stored_bytes(6144, 2048) + 4);
        assert_eq!(ScaleType::E4m3.count(kind.scale_bytes(rows, cols)), rows * 4);
        // Magnitudes over 2^12 within the matrix, and a zero group.
        let mut w: Vec<f32> = (0..rows * cols)
            .map(|i| rng.random_range(-1.0f32..1.0) * 2f32.powi((i / cols) as i32 + (i % 7) as i32 - 4))
            .collect();
        w[64..128].fill(0.0);
        let (p, s) = quantize(kind, &w, rows, cols);
        let bytes = encode_scales(kind, &s).unwrap();
        assert_eq!(bytes.len(), kind.scale_bytes(rows, cols));
        assert_eq!(decode_scales(kind, &bytes), s);
        // The searched scale leaves each group no more squared error than absmax / 7
        // rounded to the nearest e4m3, and sometimes less.
        let d = dequantize(kind, &p, &s, rows, cols);
        let factor = ScaleType::E4m3.factor_of(&s);
        let (mut better, mut groups) = (0, 0);
        for (gw, gd) in w.chunks(64).zip(d.chunks(64)) {
            let amax = gw.iter().fold(0f32, |a, v| a.max(v.abs()));
            if amax == 0.0 {
                assert!(gd.iter().all(|v| *v == 0.0));
                continue;
            }
            let near = e4m3_round(amax / 7.0, factor);
            let sq =
                |d: &mut dyn Iterator<Item = f32>| -> f64 { d.zip(gw).map(|(a, b)| ((a - b) as f64).powi(2)).sum() };
            let got = sq(&mut gd.iter().copied());
            let plain = sq(&mut gw.iter().map(|&v| int4_level(v, near) * near));
            assert!(got <= plain, "group {groups}: {got} > {plain}");
            better += (got < plain) as usize;
            groups += 1;
        }
        assert!(better > 0, "the search never found a better scale in {groups} groups");
        let mut again = s.clone();
        round_scales(kind, &mut again);
        assert_eq!(again, s, "rounding e4m3 scales is idempotent");
        let err = encode_scales(kind, &[1.0, 1.0 + 1.0 / 64.0]).unwrap_err();
        assert!(
            err.contains("int4-g64-e4m3: scale 1 (1.015625e0) is not an e4m3 value times the matrix factor"),
            "{err}"
        );
        assert!(encode_scales(kind, &[1.0, -1.0]).unwrap_err().contains("scale 1 (-1e0)"));
        assert!(encode_scales(kind, &[1.0, f32::NAN]).is_err());
        assert!(QuantKind::parse("int4-g64-e5m2").unwrap_err().contains("unknown expert encoding"));
    }

    #[test]
    fn mxfp4_codes_and_scales() {
        assert_eq!(QuantKind::parse("mxfp4"), Ok(QuantKind::Mxfp4));
        assert_eq!(QuantKind::Mxfp4.name(), "mxfp4");
        assert_eq!(QuantKind::Mxfp4.stored_bytes(4, 64), 4 * 32 + 4 * 2);
        for (c, v) in FP4_VALUES.iter().enumerate() {
            let want = if *v == 0.0 { 0 } else { c as u8 };
            assert_eq!(fp4_code(*v), want, "{v}");
        }
        // Between grid points: nearest, ties to the even code; beyond 6 saturates.
        assert_eq!((fp4_code(0.25), fp4_code(0.26), fp4_code(2.5), fp4_code(5.0), fp4_code(9.0)), (0, 1, 4, 6, 7));
        assert_eq!(fp4_code(-1.2), 8 | 2);
        for k in [-127i32, -20, -1, 0, 1, 30, 127] {
            let s = 2f32.powi(k);
            assert_eq!(e8m0_code(s) as i32, k + 127, "2^{k}");
            assert_eq!(e8m0_scale(e8m0_code(s)), s);
        }
        assert_eq!(e8m0_scale(e8m0_code(3.0)), 4.0, "the least power of two at or above");
        assert!(encode_scales(QuantKind::Mxfp4, &[3.0]).unwrap_err().contains("power of two"));
    }

    #[test]
    fn int4_nibble_order() {
        // Column 0 in the low nibble, column 1 in the high nibble.
        let (p, s) = quantize(QuantKind::int4(2), &[7.0, -7.0], 1, 2);
        assert_eq!(s, vec![1.0]);
        assert_eq!(p, vec![0x0f | (0x01 << 4)]);
    }
}
