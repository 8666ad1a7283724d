//! The parts of a decoder session every family shares: planning a forward's rows against
//! the KV blocks, embedding them, and the outputs (hidden states and logits of the rows
//! that ask). A family's session adds its caches and layers.

use crate::batch::{Batch, SeqId};
use crate::kv::{KvBlocks, BLOCK_SIZE};
use crate::SessionOptions;
use anyhow::{bail, ensure, Result};
use strata_backend::{Backend, LinearOut, Step};

/// Which rows of a forward go out.
#[derive(Default)]
pub(crate) struct Wants {
    pub hidden: Vec<u32>,
    pub logits: Vec<u32>,
    /// The logits rows are picked on the device (greedily, or as the step's draws say), not read back...
    pub pick: bool,
    /// ...but for these (logits-row indices, ascending).
    pub read: Vec<u32>,
}

/// A forward's rows: the step every op reads, rows per sequence, rows wanted out.
pub(crate) struct Rows {
    pub step: Step,
    pub pending: Vec<(SeqId, usize)>,
    pub want: Wants,
    pub max_rows: usize,
}

impl Rows {
    pub fn new(opts: &SessionOptions, max_blocks: usize) -> Self {
        let rows = opts.max_rows;
        let mut step = Step { block_size: BLOCK_SIZE, ..Default::default() };
        step.tokens.reserve(rows);
        step.positions.reserve(rows);
        step.seq.reserve(rows);
        step.blocks.reserve(opts.max_seqs * max_blocks);
        Self {
            step,
            pending: Vec::with_capacity(opts.max_seqs),
            want: Wants {
                hidden: Vec::with_capacity(rows),
                logits: Vec::with_capacity(rows),
                pick: false,
                read: Vec::with_capacity(rows),
            },
            max_rows: rows,
        }
    }

    /// Fills the step from `batch` against `kv` (each sequence's rows at its next
    /// positions) and reserves their blocks; fed rows may read `picks` greedy picks.
    /// Nothing about a sequence changes on error.
    pub fn plan(&mut self, kv: &mut KvBlocks, batch: &Batch, vocab: usize, picks: usize) -> Result<()> {
        let rows = batch.len();
        ensure!(rows > 0, "forward needs at least one row");
        ensure!(rows <= self.max_rows, "a forward of {rows} rows exceeds the session's {} rows", self.max_rows);
        let (step, pending, want) = (&mut self.step, &mut self.pending, &mut self.want);
        step.clear();
        pending.clear();
        want.hidden.clear();
        want.logits.clear();
        want.pick = batch.pick;
        want.read.clear();
        if batch.pick {
            want.read.extend_from_slice(&batch.read);
        }
        for (r, row) in batch.rows.iter().enumerate() {
            ensure!(kv.contains(row.seq), "sequence {} is not in this session", row.seq.0);
            let i = match pending.iter().position(|(s, _)| *s == row.seq) {
                Some(i) => i,
                None => {
                    pending.push((row.seq, 0));
                    pending.len() - 1
                }
            };
            let pos = kv.len(row.seq) + pending[i].1;
            pending[i].1 += 1;
            step.tokens.push(row.token);
            step.positions.push(pos as u32);
            step.seq.push(row.seq.0);
            if row.hidden || row.logits {
                want.hidden.push(r as u32);
            }
            if row.logits {
                want.logits.push(r as u32);
            }
        }
        step.check_tokens(vocab, picks)?;
        let nl = want.logits.len() as u32;
        if !batch.draws.is_empty() {
            ensure!(batch.pick, "draws given for a forward that does not pick its tokens");
            ensure!(
                batch.draws.len() == nl as usize,
                "{} draws for {nl} rows with logits: one a row",
                batch.draws.len()
            );
            step.draws.extend(batch.draws.iter().flat_map(|d| d.words()));
        }
        if let Some(bad) =
            want.read.windows(2).find(|w| w[0] >= w[1]).map(|w| w[1]).or(want.read.last().copied().filter(|&r| r >= nl))
        {
            bail!("logits row {bad} read beside the picks: rows must be ascending, each once, below the {nl} rows with logits");
        }
        for &(s, n) in pending.iter() {
            kv.reserve(s, n)?;
        }
        kv.write_tables(&mut step.blocks);
        step.max_blocks = kv.max_blocks();
        step.block_size = BLOCK_SIZE;
        Ok(())
    }

    /// Records that the planned rows are in the caches (after a successful forward).
    pub fn commit(&self, kv: &mut KvBlocks) {
        for &(seq, n) in &self.pending {
            let len = kv.len(seq) + n;
            kv.set_len(seq, len);
        }
    }

    /// Embeds the step's rows into `x`: token rows from `table` (fed rows: the greedy
    /// picks in `out`), embedding rows as given.
    pub fn embed<B: Backend>(
        &self,
        b: &B,
        batch: &Batch,
        out: &Outputs<B>,
        table: &B::Mat,
        hidden: usize,
        x: &mut B::Buf,
    ) -> Result<()> {
        b.embed(&self.step, Some(out.picks()), table, x)?;
        self.embed_rows(b, batch, hidden, x)
    }

    /// Writes the batch's embedding rows (given as values, not token ids) into `x`.
    pub fn embed_rows<B: Backend>(&self, b: &B, batch: &Batch, hidden: usize, x: &mut B::Buf) -> Result<()> {
        for (r, row) in batch.rows.iter().enumerate() {
            if row.token == u32::MAX {
                ensure!(
                    batch.embedding_width == hidden,
                    "embedding rows of width {} for a model of width {hidden}",
                    batch.embedding_width
                );
                let e = row.embedding as usize;
                b.write(x, r * hidden, &batch.embeddings[e * hidden..(e + 1) * hidden]);
            }
        }
        Ok(())
    }
}

/// Hidden states and logits of the rows that ask, on the device and (for a device whose
/// memory the host cannot read) copied back.
pub(crate) struct Outputs<B: Backend> {
    hidden_size: usize,
    vocab: usize,
    hidden: B::Buf,
    normed: B::Buf,
    gathered: B::Buf,
    logits: B::Buf,
    /// Greedy picks of the latest forward that asked ([`Batch::pick_greedy`]): how many,
    /// on the device (fed rows read them), and reads back not yet taken, oldest first.
    picks: B::Idx,
    picked: usize,
    reads: std::collections::VecDeque<B::IdxRead>,
    hidden_cap: usize,
    logits_cap: usize,
    host_logits: Vec<f32>,
    /// Hidden states are copied back when first asked for (only a draft model reads them;
    /// a copy back costs a sync): this forward's copy, and the previous one's vector.
    host_hidden: std::cell::OnceCell<Vec<f32>>,
    spare_hidden: std::cell::Cell<Vec<f32>>,
    last_logits: usize,
    last_hidden: usize,
    /// Final logit soft cap `c * tanh(l / c)` (Gemma), if the family has one.
    softcap: Option<f32>,
}

impl<B: Backend> Outputs<B> {
    /// Room for `rows` rows of each to start with (one a sequence is the decode case).
    pub fn new(b: &B, rows: usize, hidden_size: usize, vocab: usize) -> Result<Self> {
        Ok(Self {
            hidden_size,
            vocab,
            hidden: b.alloc(rows * hidden_size)?,
            normed: b.alloc(rows * hidden_size)?,
            gathered: b.alloc(rows * hidden_size)?,
            logits: b.alloc(rows * vocab)?,
            picks: b.alloc_idx(rows)?,
            picked: 0,
            reads: std::collections::VecDeque::with_capacity(4),
            hidden_cap: rows,
            logits_cap: rows,
            host_logits: Vec::new(),
            host_hidden: std::cell::OnceCell::new(),
            spare_hidden: std::cell::Cell::new(Vec::new()),
            last_logits: 0,
            last_hidden: 0,
            softcap: None,
        })
    }

    /// Logits come out soft-capped at `cap` (`cap * tanh(l / cap)`).
    pub fn with_softcap(mut self, cap: Option<f32>) -> Self {
        self.softcap = cap;
        self
    }

    /// Grows the buffers for `hidden` hidden-state rows and `logits` logit rows.
    fn ensure(&mut self, b: &B, hidden: usize, logits: usize) -> Result<()> {
        let h = self.hidden_size;
        if hidden > self.hidden_cap {
            self.hidden = b.alloc(hidden * h)?;
            self.hidden_cap = hidden;
        }
        if logits > self.logits_cap {
            self.normed = b.alloc(logits * h)?;
            self.gathered = b.alloc(logits * h)?;
            self.logits = b.alloc(logits * self.vocab)?;
            self.picks = b.alloc_idx(logits)?;
            self.picked = 0;
            self.logits_cap = logits;
        }
        Ok(())
    }

    /// Hidden states of the wanted rows of `x`, and logits (through `norm`, `head`, and a
    /// final soft cap `c * tanh(l / c)` where the family has one) of the rows that want
    /// them.
    pub fn compute(&mut self, b: &B, rows: &Rows, x: &B::Buf, norm: &B::Buf, eps: f32, head: &B::Mat) -> Result<()> {
        let want = &rows.want;
        let h = self.hidden_size;
        let (nh, nl) = (want.hidden.len(), want.logits.len());
        self.last_hidden = nh;
        self.last_logits = nl;
        self.ensure(b, nh, nl)?;
        if nh > 0 {
            b.gather_rows(x, h, &want.hidden, &mut self.hidden);
        }
        if nl > 0 {
            // Every row that wants logits also wants its hidden state (`Rows::plan`): when
            // they are the same rows (decode), the rows gathered above feed the head.
            let rows_in = match want.logits == want.hidden {
                true => &self.hidden,
                false => {
                    b.gather_rows(x, h, &want.logits, &mut self.gathered);
                    &self.gathered
                }
            };
            let head_out = &mut [LinearOut::new(b, head, &mut self.logits)];
            b.norm_linears(nl, h, rows_in, norm, eps, &mut self.normed, head_out);
            if let Some(cap) = self.softcap {
                b.soft_cap(nl * self.vocab, cap, &mut self.logits);
            }
            if want.pick {
                b.pick_rows(&rows.step, nl, self.vocab, &self.logits, &mut self.picks);
                self.reads.push_back(b.start_read_idx(&self.picks, nl));
                self.picked = nl;
                // The picks are the output, and the logits rows asked for beside them
                // (their places kept: row i at i * vocab).
                self.last_logits = if want.read.is_empty() { 0 } else { nl };
            }
        }
        if let Some(v) = self.host_hidden.take() {
            self.spare_hidden.set(v);
        }
        // Off the host, the logits come back: all of them, or beside picks the rows asked
        // for (runs of consecutive rows, one copy each).
        if b.host(&self.logits).is_none() && (!want.pick || !want.read.is_empty()) {
            let v = self.vocab;
            self.host_logits.resize(nl * v, 0.0);
            match want.pick {
                false => b.read(&self.logits, 0, &mut self.host_logits),
                true => {
                    for (r0, r1) in row_runs(&want.read) {
                        b.read(&self.logits, r0 * v, &mut self.host_logits[r0 * v..r1 * v]);
                    }
                }
            }
        }
        Ok(())
    }

    /// The greedy picks on the device (fed rows read them).
    pub fn picks(&self) -> &B::Idx {
        &self.picks
    }

    /// How many greedy picks the latest picking forward made.
    pub fn picked(&self) -> usize {
        self.picked
    }

    /// Whether picks stay on the device (the logits live off the host).
    pub fn picks_on_device(&self, b: &B) -> bool {
        b.host(&self.logits).is_none()
    }

    /// Waits for the oldest picking forward's picks not yet taken, into `dst`.
    pub fn take_picks(&mut self, b: &B, dst: &mut Vec<u32>) -> Result<()> {
        match self.reads.pop_front() {
            Some(r) => {
                b.finish_read_idx(r, dst);
                Ok(())
            }
            None => bail!("no greedy picks to take: no forward since the last take asked for them"),
        }
    }

    pub fn logits<'a>(&'a self, b: &B) -> &'a [f32] {
        let n = self.last_logits * self.vocab;
        match b.host(&self.logits) {
            Some(l) => &l[..n],
            None => &self.host_logits[..n],
        }
    }

    pub fn hidden<'a>(&'a self, b: &B) -> &'a [f32] {
        let n = self.last_hidden * self.hidden_size;
        match b.host(&self.hidden) {
            Some(l) => &l[..n],
            None => &self.host_hidden.get_or_init(|| {
                let mut v = self.spare_hidden.take();
                v.resize(n, 0.0);
                b.read(&self.hidden, 0, &mut v);
                v
            })[..n],
        }
    }
}

/// Ascending rows as runs of consecutive ones, `[start, end)` each.
fn row_runs(rows: &[u32]) -> impl Iterator<Item = (usize, usize)> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        let r0 = *rows.get(i)? as usize;
        let mut r1 = r0 + 1;
        i += 1;
        while rows.get(i).is_some_and(|&r| r as usize == r1) {
            (i, r1) = (i + 1, r1 + 1);
        }
        Some((r0, r1))
    })
}

/// The [`crate::Session`] methods every family's session answers alike from its parts: the
/// output stage (`self.out` on the model's backend `self.m.b`: logits, device picks, hidden
/// states), the routing record (`self.routes`) and the block pool (`self.kv`). Expanded
/// inside each family's `impl Session`.
macro_rules! session_parts {
    () => {
        fn logits(&self) -> &[f32] {
            self.out.logits(&self.m.b)
        }

        fn take_picks(&mut self, dst: &mut Vec<u32>) -> Result<()> {
            self.out.take_picks(&self.m.b, dst)
        }

        fn picks_on_device(&self) -> bool {
            self.out.picks_on_device(&self.m.b)
        }

        fn hidden(&self) -> &[f32] {
            self.out.hidden(&self.m.b)
        }

        fn routes(&self) -> &Routes {
            &self.routes
        }

        fn record_routes(&mut self, on: bool) {
            self.routes.set_recording(on);
        }

        fn kv(&self) -> Option<&KvBlocks> {
            Some(&self.kv)
        }

        fn kv_mut(&mut self) -> Option<&mut KvBlocks> {
            Some(&mut self.kv)
        }
    };
}
pub(crate) use session_parts;

#[cfg(test)]
mod tests {
    #[test]
    fn row_runs_group_consecutive_rows() {
        let runs = |r: &[u32]| super::row_runs(r).collect::<Vec<_>>();
        assert_eq!(runs(&[]), vec![]);
        assert_eq!(runs(&[4]), vec![(4, 5)]);
        assert_eq!(runs(&[0, 1, 2]), vec![(0, 3)]);
        assert_eq!(runs(&[0, 2, 3, 7, 8, 9, 11]), vec![(0, 1), (2, 4), (7, 10), (11, 12)]);
    }
}
