//! A sampled token, defined so that a device can draw it where the logits are, with no
//! sort and no copy back: temperature, then top-k, top-p and min-p (transformers' order),
//! then a Gumbel-max draw over what is kept.
//!
//! - Candidates are ordered by `l / T` (f32), ties to the lower id: a total order on
//!   [`order_key`].
//! - A candidate's mass is `exp(v - vmax)` in fixed point ([`mass`], 2^-40 units), so that
//!   every sum is an integer and the same in any order (a device sums in a tree).
//!   Candidates with less than 2^-40 of the top one's probability have no mass and are
//!   never drawn.
//! - top-k keeps the k first; top-p the shortest prefix of those whose mass reaches
//!   `ceil(top_p * Z)`; min-p those with mass >= `ceil(min_p * 2^40)`.
//! - The draw: the kept candidate with the largest `v + g`, `g` Gumbel noise from a
//!   counter-based hash of the draw's key and the token id ([`gumbel`]), which picks each
//!   with probability proportional to `exp(v)`. No sequential random stream: any order,
//!   any device, the same token for the same key.
//!
//! [`pick`] is what the CPU backend and the host sampler ([`sample`]) run, the cuts found by
//! quickselects; the CUDA kernel (`k_pick_rows`) computes the same steps with histograms and
//! a radix select. The tests hold both to a plain sort.

/// A logits row's pick: temperature 0 is greedy (the plain argmax).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Draw {
    pub temperature: f32,
    /// 0 disables.
    pub top_k: u32,
    /// 1 disables.
    pub top_p: f32,
    /// 0 disables.
    pub min_p: f32,
    /// The draw's key ([`draw_key`]): with the token id, it decides the noise.
    pub key: u64,
}

/// Fixed-point units of a unit of mass.
pub const MASS_ONE: f64 = (1u64 << 40) as f64;

impl Draw {
    /// Words a draw takes in a [`crate::Step`]'s `draws`.
    pub const WORDS: usize = 6;

    pub const GREEDY: Draw = Draw { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, key: 0 };

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    pub fn words(&self) -> [u32; Self::WORDS] {
        [
            self.temperature.to_bits(),
            self.top_k,
            self.top_p.to_bits(),
            self.min_p.to_bits(),
            self.key as u32,
            (self.key >> 32) as u32,
        ]
    }

    pub fn from_words(w: &[u32]) -> Self {
        Draw {
            temperature: f32::from_bits(w[0]),
            top_k: w[1],
            top_p: f32::from_bits(w[2]),
            min_p: f32::from_bits(w[3]),
            key: w[4] as u64 | (w[5] as u64) << 32,
        }
    }
}

/// SplitMix64's output function.
#[inline]
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The key of a sampler's `n`-th draw under `seed`.
pub fn draw_key(seed: u64, n: u64) -> u64 {
    mix(mix(seed.wrapping_add(GOLDEN)).wrapping_add(n.wrapping_add(1).wrapping_mul(GOLDEN)))
}

/// Standard Gumbel noise of `token` under `key`: `-ln(-ln(u))`, `u` in (0, 1) from 53 bits
/// of the hash.
#[inline]
pub fn gumbel(key: u64, token: u32) -> f64 {
    let h = mix(key.wrapping_add((token as u64 + 1).wrapping_mul(GOLDEN)));
    let u = ((h >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64);
    -(-u.ln()).ln()
}

/// The candidate order: a larger key comes first (larger value, then lower id). `v` is
/// finite.
#[inline]
pub fn order_key(v: f32, id: u32) -> u64 {
    let b = v.to_bits();
    let ordered = if b & 0x8000_0000 != 0 { !b } else { b | 0x8000_0000 };
    (ordered as u64) << 32 | (!id) as u64
}

/// `exp(v - vmax)` in 2^-40 units (truncated; the difference is taken in f32).
#[inline]
pub fn mass(v: f32, vmax: f32) -> u64 {
    (((v - vmax) as f64).exp() * MASS_ONE) as u64
}

/// The top-p target mass of a total `z`: at least 1.
#[inline]
pub fn top_p_target(top_p: f32, z: u64) -> u64 {
    ((top_p as f64 * z as f64).ceil() as u64).max(1)
}

/// The least mass min-p keeps.
#[inline]
pub fn min_p_mass(min_p: f32) -> u64 {
    (min_p as f64 * MASS_ONE).ceil() as u64
}

/// Candidates (order key, id, mass) of a row after the cut, in no particular order, into
/// `kept`; the scaled values into `v`. `row` holds no NaN or +inf; -inf has no mass. No
/// sort: the cuts are selects (expected linear time).
fn cut(row: &[f32], d: &Draw, v: &mut Vec<f32>, kept: &mut Vec<(u64, u32, u64)>) {
    v.clear();
    v.extend(row.iter().map(|&l| l / d.temperature));
    let vmax = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    kept.clear();
    kept.extend(v.iter().enumerate().map(|(i, &x)| (order_key(x, i as u32), i as u32, mass(x, vmax))));
    if d.top_k > 0 && (d.top_k as usize) < kept.len() {
        let k = d.top_k as usize;
        kept.select_nth_unstable_by_key(k - 1, |c| std::cmp::Reverse(c.0));
        kept.truncate(k);
    }
    if d.top_p < 1.0 {
        let z: u64 = kept.iter().map(|c| c.2).sum();
        let n = shortest_prefix_reaching(kept, top_p_target(d.top_p, z));
        kept.truncate(n);
    }
    let floor = min_p_mass(d.min_p).max(1);
    kept.retain(|c| c.2 >= floor);
}

/// The fewest candidates, taken best first, whose masses reach `target` (all of them where
/// the whole falls short); reorders `c` so that they come first. A quickselect on the
/// summed mass: each round splits the undecided range at its middle key.
fn shortest_prefix_reaching(c: &mut [(u64, u32, u64)], target: u64) -> usize {
    // c[..lo] are the lo best, of mass `acc` < target; the answer is in lo + 1..=hi, and
    // everything in c[hi..] ranks below everything before it.
    let (mut lo, mut hi, mut acc) = (0usize, c.len(), 0u64);
    while hi - lo > 1 {
        let mid = lo + (hi - lo - 1) / 2;
        c[lo..hi].select_nth_unstable_by_key(mid - lo, |x| std::cmp::Reverse(x.0));
        let upper: u64 = c[lo..=mid].iter().map(|x| x.2).sum();
        if acc + upper >= target {
            hi = mid + 1;
        } else {
            acc += upper;
            lo = mid + 1;
        }
    }
    hi
}

/// Reusable buffers for [`pick`] and [`distribution`].
#[derive(Default)]
pub struct DrawScratch {
    v: Vec<f32>,
    kept: Vec<(u64, u32, u64)>,
}

/// The token `d` picks from `row`: the argmax for a greedy draw; `NON_FINITE | j` for the
/// lowest non-finite `j` (what a device's pick reports of damaged logits).
pub fn pick(row: &[f32], d: &Draw, s: &mut DrawScratch) -> u32 {
    match row.iter().position(|x| !x.is_finite()) {
        Some(j) => crate::NON_FINITE | j as u32,
        None => sample(row, d, s),
    }
}

/// [`pick`] for a row that may hold -inf (tokens masked out, never drawn) but no NaN or
/// +inf. Where nothing has mass, the argmax.
pub fn sample(row: &[f32], d: &Draw, s: &mut DrawScratch) -> u32 {
    if d.is_greedy() {
        return strata_kernels::ops::argmax(row) as u32;
    }
    cut(row, d, &mut s.v, &mut s.kept);
    let mut best = (f64::NEG_INFINITY, u32::MAX);
    for &(_, id, _) in &s.kept {
        let score = s.v[id as usize] as f64 + gumbel(d.key, id);
        if score > best.0 || (score == best.0 && id < best.1) {
            best = (score, id);
        }
    }
    match best.1 {
        u32::MAX => strata_kernels::ops::argmax(row) as u32,
        t => t,
    }
}

/// The distribution [`sample`] draws from (its kept candidates and their probabilities,
/// summing to 1), into `out`; a greedy draw is its argmax with probability 1. The tests'
/// reference for the draws.
#[cfg(test)]
fn distribution(row: &[f32], d: &Draw, s: &mut DrawScratch, out: &mut Vec<(u32, f64)>) {
    out.clear();
    if !d.is_greedy() {
        cut(row, d, &mut s.v, &mut s.kept);
        s.kept.sort_unstable_by_key(|c| std::cmp::Reverse(c.0));
    }
    let Some(first) = s.kept.first().filter(|_| !d.is_greedy()) else {
        out.push((strata_kernels::ops::argmax(row) as u32, 1.0));
        return;
    };
    let vmax = s.v[first.1 as usize];
    let e = |id: u32| ((s.v[id as usize] - vmax) as f64).exp();
    let total: f64 = s.kept.iter().map(|c| e(c.1)).sum();
    out.extend(s.kept.iter().map(|c| (c.1, e(c.1) / total)));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(n: usize, seed: u64, spread: f32) -> Vec<f32> {
        (0..n).map(|i| ((mix(seed ^ i as u64) >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * spread).collect()
    }

    #[test]
    fn words_round_trip_and_order_keys_sort_by_value_then_lower_id() {
        let d = Draw { temperature: 0.7, top_k: 40, top_p: 0.9, min_p: 0.05, key: 0x0123_4567_89ab_cdef };
        assert_eq!(Draw::from_words(&d.words()), d);
        let vals = [-3.5f32, 0.0, 1e-30, 2.0, 2.0, f32::MAX, -f32::MAX, -1e-30];
        for (i, &a) in vals.iter().enumerate() {
            for (j, &b) in vals.iter().enumerate() {
                let want = a.total_cmp(&b).then((j as u32).cmp(&(i as u32)));
                assert_eq!(order_key(a, i as u32).cmp(&order_key(b, j as u32)), want, "{a} #{i} vs {b} #{j}");
            }
        }
    }

    /// Draws follow the kept candidates' softmax: counts over many keys against the
    /// probabilities `distribution` reports.
    #[test]
    fn draws_follow_the_distribution() {
        let logits = [2.0f32, 1.0, 0.5, 0.0, -1.0, -5.0];
        let mut s = DrawScratch::default();
        for (top_k, top_p, min_p) in [(0, 1.0, 0.0), (3, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.2), (4, 0.9, 0.1)] {
            let d = Draw { temperature: 0.9, top_k, top_p, min_p, key: 0 };
            let mut dist = Vec::new();
            distribution(&logits, &d, &mut s, &mut dist);
            let n = 40_000;
            let mut counts = [0usize; 6];
            for k in 0..n {
                counts[pick(&logits, &Draw { key: draw_key(7, k), ..d }, &mut s) as usize] += 1;
            }
            for (t, &c) in counts.iter().enumerate() {
                let p = dist.iter().find(|x| x.0 == t as u32).map_or(0.0, |x| x.1);
                let got = c as f64 / n as f64;
                // 5 standard deviations of a binomial share.
                let tol = 5.0 * (p * (1.0 - p) / n as f64).sqrt() + 1e-9;
                assert!((got - p).abs() <= tol, "top_k {top_k} top_p {top_p} min_p {min_p}: token {t} {got} vs {p}");
            }
        }
    }

    /// The cuts on random rows (some tied: values on a grid) against a plain
    /// implementation: sort, truncate, prefix by mass, floor.
    #[test]
    fn cuts_match_a_plain_reference() {
        let mut s = DrawScratch::default();
        for (n, seed, grid) in
            [(10usize, 1u64, false), (1000, 2, false), (5000, 3, false), (20_000, 4, true), (3, 5, true)]
        {
            let mut r = row(n, seed, 12.0);
            if grid {
                r.iter_mut().for_each(|x| *x = (*x * 2.0).round() / 2.0);
            }
            for (top_k, top_p, min_p) in [
                (0, 1.0, 0.0),
                (7, 1.0, 0.0),
                (0, 0.5, 0.0),
                (0, 0.05, 0.0),
                (0, 0.999, 0.0),
                (0, 1.0, 0.3),
                (50, 0.95, 0.01),
                (2000, 0.9, 0.0),
            ] {
                let d = Draw { temperature: 0.8, top_k, top_p, min_p, key: 0 };
                let v: Vec<f32> = r.iter().map(|l| l / d.temperature).collect();
                let mut ids: Vec<u32> = (0..n as u32).collect();
                ids.sort_by(|&a, &b| v[b as usize].total_cmp(&v[a as usize]).then(a.cmp(&b)));
                let vmax = v[ids[0] as usize];
                let m = |i: u32| (((v[i as usize] - vmax) as f64).exp() * MASS_ONE) as u64;
                let mut keep: Vec<u32> = ids.clone();
                if top_k > 0 && (top_k as usize) < n {
                    keep.truncate(top_k as usize);
                }
                if top_p < 1.0 {
                    let z: u64 = keep.iter().map(|&i| m(i)).sum();
                    let target = ((top_p as f64 * z as f64).ceil() as u64).max(1);
                    let mut acc = 0;
                    let mut k = keep.len();
                    for (j, &i) in keep.iter().enumerate() {
                        acc += m(i);
                        if acc >= target {
                            k = j + 1;
                            break;
                        }
                    }
                    keep.truncate(k);
                }
                let floor = ((min_p as f64 * MASS_ONE).ceil() as u64).max(1);
                keep.retain(|&i| m(i) >= floor);
                let mut dist = Vec::new();
                distribution(&r, &d, &mut s, &mut dist);
                let got: Vec<u32> = dist.iter().map(|x| x.0).collect();
                assert_eq!(got, keep, "n {n} top_k {top_k} top_p {top_p} min_p {min_p}");
                assert!((dist.iter().map(|x| x.1).sum::<f64>() - 1.0).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn greedy_and_non_finite_rows() {
        let mut s = DrawScratch::default();
        assert_eq!(pick(&[1.0, 3.0, 3.0, 2.0], &Draw::GREEDY, &mut s), 1);
        let d = Draw { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, key: 5 };
        assert_eq!(pick(&[1.0, f32::NAN, f32::INFINITY], &d, &mut s), crate::NON_FINITE | 1);
        // One candidate carries all but 2^-40 of the mass: it is always drawn.
        for k in 0..100 {
            assert_eq!(pick(&[0.0, 40.0, 1.0], &Draw { key: draw_key(1, k), ..d }, &mut s), 1);
        }
        // -inf is never drawn (a masked token); all masked: the argmax.
        for k in 0..100 {
            let t =
                sample(&[f32::NEG_INFINITY, 0.5, f32::NEG_INFINITY, 0.4], &Draw { key: draw_key(3, k), ..d }, &mut s);
            assert!(t == 1 || t == 3, "{t}");
        }
        assert_eq!(sample(&[f32::NEG_INFINITY; 3], &d, &mut s), 0);
        // The same key draws the same token; draw keys differ.
        let r = row(500, 9, 4.0);
        assert_eq!(pick(&r, &d, &mut s), pick(&r, &d, &mut s));
        assert_ne!(draw_key(1, 0), draw_key(1, 1));
        assert_ne!(draw_key(1, 0), draw_key(2, 0));
    }
}
