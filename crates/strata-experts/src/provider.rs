//! Where routed experts come from. A model routes on its backend; an [`ExpertProvider`]
//! makes the chosen experts' weights available (all resident, or a slab of slots filled
//! from disk by the engine's runtime) and hands them to the model's compute in batches
//! as they become ready, so resident work overlaps reads.

use anyhow::{bail, Result};
use std::sync::Arc;
use strata_backend::Backend;

/// Experts ready to compute, by index (no slice to build per call).
pub trait ReadyExperts<B: Backend>: Sync {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Expert id and weights of entry `i`.
    fn get(&self, i: usize) -> (u32, B::ExpertRef<'_>);
}

pub trait ExpertProvider<B: Backend>: Send + Sync {
    /// Counts a forward's selections at `layer` (`ids`: rows of `top_k`, every selection,
    /// before deduplication).
    fn record(&self, _layer: usize, _ids: &[u32], _top_k: usize) {}

    /// Makes `experts` (unique, ascending) of `layer` available and calls `compute` with
    /// batches of them as they are ready (hits first, then misses as their reads land);
    /// every expert is handed over exactly once (or not at all, under
    /// [`ExpertProvider::drops_misses`]). `b`: the model's backend (a device tier
    /// copies into its memory on the backend's stream).
    fn run(
        &self,
        b: &B,
        layer: usize,
        experts: &[u32],
        compute: &mut dyn FnMut(&dyn ReadyExperts<B>) -> Result<()>,
    ) -> Result<()>;

    /// Whether [`ExpertProvider::run`] may leave experts out (approximate decode: a
    /// one-row forward's low-ranked experts that would be read from disk); the model then
    /// gives the ones it was not handed a weight of 0. Otherwise every one must come.
    fn drops_misses(&self) -> bool {
        false
    }

    /// Whether the model should predict the next layer's routing (PILOT) for
    /// [`ExpertProvider::predicted`].
    fn wants_prediction(&self) -> bool {
        false
    }

    /// Whether the prediction should first add the current layer's shared expert to the
    /// residual (the two-step predictor).
    fn two_step_prediction(&self) -> bool {
        false
    }

    /// The routing of `layer` predicted one layer ahead. Advisory.
    fn predicted(&self, _layer: usize, _ids: &[u32], _top_k: usize) {}

    /// Where the provider holds every expert of `layer` in place in the backend's memory
    /// and nothing it does needs the routed ids on the host (no usage ledger, no
    /// prediction): the backend's table over them, so the model dispatches a row's experts
    /// by id on the device ([`Backend::experts_by_id`]) with no sync. When it answers, the
    /// provider counts `selections` lookups as served in place. `b`: the model's backend
    /// (the provider may set up its device memory on the first call).
    fn device_table(&self, _b: &B, _layer: usize, _selections: usize) -> Result<Option<&B::ExpertTable>> {
        Ok(None)
    }
}

/// Experts held by the model (an HF checkpoint loaded whole).
pub struct ResidentExperts<B: Backend> {
    /// Per sparse layer (by model layer id): each expert's (gate, up, down).
    layers: Vec<Option<Vec<[B::Mat; 3]>>>,
    /// Per sparse layer: the experts as the backend indexes them by routed id on the
    /// device ([`Backend::experts_by_id`]), where it can.
    tables: Vec<Option<B::ExpertTable>>,
}

impl<B: Backend> ResidentExperts<B> {
    pub fn new(b: &B, layers: Vec<Option<Vec<[B::Mat; 3]>>>) -> Result<Self> {
        let tables = layers
            .iter()
            .map(|l| match l {
                Some(mats) if !mats.is_empty() => b.expert_table(mats),
                _ => Ok(None),
            })
            .collect::<Result<_>>()?;
        Ok(Self { layers, tables })
    }

    /// The layer's device-side expert table, if the backend dispatches by id.
    pub fn table(&self, layer: usize) -> Option<&B::ExpertTable> {
        self.tables.get(layer).and_then(Option::as_ref)
    }
}

struct ResidentReady<'a, B: Backend> {
    b: &'a B,
    experts: &'a [u32],
    mats: &'a [[B::Mat; 3]],
}

impl<B: Backend> ReadyExperts<B> for ResidentReady<'_, B> {
    fn len(&self) -> usize {
        self.experts.len()
    }
    fn get(&self, i: usize) -> (u32, B::ExpertRef<'_>) {
        let e = self.experts[i];
        let [g, u, d] = &self.mats[e as usize];
        (e, self.b.expert_ref(g, u, d))
    }
}

impl<B: Backend> ResidentExperts<B> {
    /// Runs with the backend to build expert views.
    pub fn run(
        &self,
        b: &B,
        layer: usize,
        experts: &[u32],
        compute: &mut dyn FnMut(&dyn ReadyExperts<B>) -> Result<()>,
    ) -> Result<()> {
        let mats = self.layers.get(layer).and_then(Option::as_ref).expect("resident experts of a sparse layer");
        compute(&ResidentReady { b, experts, mats })
    }
}

/// One forward's routing at one layer, deduplicated: unique experts in ascending id, the
/// rows that chose each (in row order), and where each (row, rank) finds its expert's
/// output row. Reused across forwards (no allocation once grown).
#[derive(Default, Debug)]
pub struct Union {
    pub experts: Vec<u32>,
    /// `rows[offsets[i]..offsets[i + 1]]`: the rows of expert `experts[i]`.
    pub offsets: Vec<u32>,
    pub rows: Vec<u32>,
    /// Per (row, rank): the output row (`offsets[i] + position of the row`).
    pub src: Vec<u32>,
    counts: Vec<u32>,
    index: Vec<u32>,
}

impl Union {
    /// After [`ExpertProvider::run`] handed over only `handed` of these experts: refused
    /// unless the provider [`drops_misses`](ExpertProvider::drops_misses); else each
    /// (row, rank) of `ids` whose expert was left out reads `zero_row`, an output row no
    /// expert writes (zero since allocation), so it adds `w * 0 = 0` to its row. Only the
    /// host's `src` changes (it goes up with the forward's other indices): no read of the
    /// weights, no sync, no allocation.
    pub fn drop_left_out<B: Backend>(
        &mut self,
        provider: Option<&Arc<dyn ExpertProvider<B>>>,
        layer: usize,
        ids: &[u32],
        handed: &[u32],
        zero_row: u32,
    ) -> Result<()> {
        let left_out = |e: &u32| !handed.contains(e);
        if !provider.is_some_and(|p| p.drops_misses()) {
            let missing: Vec<u32> = self.experts.iter().copied().filter(left_out).collect();
            bail!("layer {layer}: the expert provider did not hand over experts {missing:?}");
        }
        for (src, e) in self.src.iter_mut().zip(ids) {
            if left_out(e) {
                *src = zero_row;
            }
        }
        Ok(())
    }

    /// From `ids` (`rows x top_k`, distinct within a row) over `n_experts` experts.
    pub fn build(&mut self, ids: &[u32], rows: usize, top_k: usize, n_experts: usize) {
        self.counts.clear();
        self.counts.resize(n_experts, 0);
        for &e in &ids[..rows * top_k] {
            self.counts[e as usize] += 1;
        }
        self.experts.clear();
        self.offsets.clear();
        self.index.clear();
        self.index.resize(n_experts, u32::MAX);
        let mut at = 0u32;
        for (e, &c) in self.counts.iter().enumerate() {
            if c > 0 {
                self.index[e] = self.experts.len() as u32;
                self.experts.push(e as u32);
                self.offsets.push(at);
                at += c;
            }
        }
        self.offsets.push(at);
        self.rows.clear();
        self.rows.resize(at as usize, 0);
        self.src.clear();
        self.src.resize(rows * top_k, 0);
        // Fill in row order: each expert's rows come out ascending.
        self.counts.iter_mut().for_each(|c| *c = 0);
        for r in 0..rows {
            for k in 0..top_k {
                let e = ids[r * top_k + k] as usize;
                let i = self.index[e] as usize;
                let pos = self.offsets[i] + self.counts[e];
                self.rows[pos as usize] = r as u32;
                self.src[r * top_k + k] = pos;
                self.counts[e] += 1;
            }
        }
    }

    /// The rows of expert `e` and where its outputs start, if it was chosen.
    pub fn rows_of(&self, e: u32) -> Option<(&[u32], usize)> {
        let i = *self.index.get(e as usize)? as usize;
        if i == u32::MAX as usize {
            return None;
        }
        let (a, b) = (self.offsets[i] as usize, self.offsets[i + 1] as usize);
        Some((&self.rows[a..b], a))
    }

    /// Output rows in all (selections).
    pub fn total(&self) -> usize {
        self.rows.len()
    }
}

/// The routing of a forward, per MoE layer: the ids (best first) of every row. Reused
/// across forwards. (The gate weights stay on the device: nothing on the host needs them,
/// and reading them back would cost a sync a layer.)
#[derive(Default, Debug, Clone)]
pub struct Routes {
    pub rows: usize,
    pub top_k: usize,
    /// Model layer ids of the MoE layers, in order.
    pub layers: Vec<usize>,
    ids: Vec<u32>,
    /// Not recording: a layer whose experts are dispatched on the device then leaves its
    /// ids there (no sync). Layers that bring ids to the host anyway still record.
    off: bool,
}

impl Routes {
    pub fn clear(&mut self, rows: usize, top_k: usize) {
        self.rows = rows;
        self.top_k = top_k;
        self.layers.clear();
        self.ids.clear();
    }

    pub fn push(&mut self, layer: usize, ids: &[u32]) {
        let n = self.rows * self.top_k;
        self.layers.push(layer);
        self.ids.extend_from_slice(&ids[..n]);
    }

    /// The `i`-th MoE layer's layer id and ids (`rows x top_k`).
    pub fn layer(&self, i: usize) -> (usize, &[u32]) {
        let n = self.rows * self.top_k;
        (self.layers[i], &self.ids[i * n..(i + 1) * n])
    }

    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Whether forwards record every layer (the default).
    pub fn recording(&self) -> bool {
        !self.off
    }

    pub fn set_recording(&mut self, on: bool) {
        self.off = !on;
    }

    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_backend::cpu::CpuBackend;

    /// Hands over what it is told to, and says whether it may leave experts out.
    struct Partial(bool);

    impl ExpertProvider<CpuBackend> for Partial {
        fn run(
            &self,
            _b: &CpuBackend,
            _layer: usize,
            _experts: &[u32],
            _compute: &mut dyn FnMut(&dyn ReadyExperts<CpuBackend>) -> Result<()>,
        ) -> Result<()> {
            Ok(())
        }

        fn drops_misses(&self) -> bool {
            self.0
        }
    }

    #[test]
    fn experts_left_out_read_the_zero_row() {
        // Two rows of top-3: row 0 = [5, 2, 9], row 1 = [2, 7, 5]; 9 and 7 left out.
        let ids = [5u32, 2, 9, 2, 7, 5];
        let mut u = Union::default();
        u.build(&ids, 2, 3, 10);
        let before = u.src.clone();
        let handed = [2u32, 5];
        let may: Arc<dyn ExpertProvider<CpuBackend>> = Arc::new(Partial(true));
        u.drop_left_out(Some(&may), 3, &ids, &handed, 99).unwrap();
        // The handed ranks keep their rows; the others read the zero row.
        assert_eq!(u.src, [before[0], before[1], 99, before[3], 99, before[5]]);
        // A provider that may not leave experts out is refused, naming them; so is a
        // model with resident experts (no provider).
        let may_not: Arc<dyn ExpertProvider<CpuBackend>> = Arc::new(Partial(false));
        let err = u.drop_left_out(Some(&may_not), 3, &ids, &handed, 99).unwrap_err();
        assert!(err.to_string().contains("layer 3") && err.to_string().contains("[7, 9]"), "{err}");
        assert!(u.drop_left_out::<CpuBackend>(None, 3, &ids, &handed, 99).is_err());
    }

    /// Combining with left-out ranks on the zero row equals combining with their weights
    /// set to 0, bit for bit, on random values.
    #[test]
    fn the_zero_row_adds_what_a_zero_weight_adds() {
        let b = CpuBackend::new();
        let (rows, k, hidden) = (2usize, 3usize, 5usize);
        let ids = [5u32, 2, 9, 2, 7, 5];
        let mut u = Union::default();
        u.build(&ids, rows, k, 10);
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        // rows * k routed rows, `rows` shared rows, then the zero row.
        let zero_row = (rows * (k + 1)) as u32;
        let mut yv: Vec<f32> = (0..rows * (k + 1) * hidden).map(|_| next()).collect();
        yv.extend(std::iter::repeat_n(0.0, hidden));
        let wv: Vec<f32> = (0..rows * k).map(|_| next().abs()).collect();
        let x0: Vec<f32> = (0..rows * hidden).map(|_| next()).collect();
        let (y, dev_ids) = (b.upload(&yv).unwrap(), {
            let mut i = b.alloc_idx(rows * k).unwrap();
            b.write_idx(&mut i, 0, &ids);
            i
        });
        let combine = |weights: &[f32], src: &[u32]| {
            let w = b.upload(weights).unwrap();
            let mut s = b.alloc_idx(rows * k).unwrap();
            b.write_idx(&mut s, 0, src);
            let mut x = b.upload(&x0).unwrap();
            b.moe_combine(
                rows,
                hidden,
                k,
                &dev_ids,
                &w,
                &s,
                &y,
                Some(strata_backend::SharedRows::at(rows * k)),
                &mut x,
            );
            let mut out = vec![0f32; rows * hidden];
            b.read(&x, 0, &mut out);
            out
        };
        let handed = [2u32, 5];
        let zeroed: Vec<f32> = wv.iter().zip(&ids).map(|(&w, e)| if handed.contains(e) { w } else { 0.0 }).collect();
        let want = combine(&zeroed, &u.src);
        let may: Arc<dyn ExpertProvider<CpuBackend>> = Arc::new(Partial(true));
        u.drop_left_out(Some(&may), 3, &ids, &handed, zero_row).unwrap();
        let got = combine(&wv, &u.src);
        assert_eq!(got, want);
        assert_ne!(
            got,
            combine(&wv, &{
                let mut full = Union::default();
                full.build(&ids, rows, k, 10);
                full.src
            })
        );
    }

    #[test]
    fn union_groups_rows_by_ascending_expert() {
        // Two rows of top-3: row 0 = [5, 2, 9], row 1 = [2, 7, 5].
        let mut u = Union::default();
        u.build(&[5, 2, 9, 2, 7, 5], 2, 3, 10);
        assert_eq!(u.experts, vec![2, 5, 7, 9]);
        assert_eq!(u.rows_of(2).unwrap(), (&[0u32, 1][..], 0));
        assert_eq!(u.rows_of(5).unwrap(), (&[0u32, 1][..], 2));
        assert_eq!(u.rows_of(7).unwrap(), (&[1u32][..], 4));
        assert!(u.rows_of(3).is_none());
        // (row, rank) -> output row.
        assert_eq!(u.src, vec![2, 0, 5, 1, 4, 3]);
        assert_eq!(u.total(), 6);
        u.build(&[1], 1, 1, 10);
        assert_eq!(u.experts, vec![1]);
        assert_eq!(u.src, vec![0]);
    }
}
