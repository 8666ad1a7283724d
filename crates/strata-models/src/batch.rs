//! A forward's rows: tokens (or embeddings) of one or more sequences.

/// A sequence in a session (see [`crate::Session::add_sequence`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u32);

/// The token of a row fed the `i`-th greedy pick (in logits-row order) of the session's
/// latest forward that picked ([`Batch::pick_greedy`]): read on the device, so the forward
/// can be queued before the host knows the token.
pub fn fed(i: u32) -> u32 {
    strata_backend::FED | i
}

/// Which rows of a push want logits and hidden states out of the forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    None,
    /// The last row pushed (the usual prefill and decode case).
    Last,
    /// Every row pushed (scoring a prompt, verifying draft tokens).
    All,
    /// Hidden states of every row, logits of the last (a prompt feeding a draft layer).
    HiddenAll,
    /// Hidden states of every row, no logits (a prompt chunk feeding a draft layer
    /// before the prompt's end).
    Hidden,
}

/// (logits, hidden) for a row, last or not, of a push.
fn wants(l: Logits, last: bool) -> (bool, bool) {
    match l {
        Logits::None => (false, false),
        Logits::Last => (last, last),
        Logits::All => (true, true),
        Logits::HiddenAll => (last, true),
        Logits::Hidden => (false, true),
    }
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Row {
    pub seq: SeqId,
    /// Token id, or `u32::MAX` for an embedding row.
    pub token: u32,
    /// Index of the row's embedding in `Batch::embeddings` (embedding rows).
    pub embedding: u32,
    pub logits: bool,
    pub hidden: bool,
}

/// The rows of one forward. Each sequence's rows take consecutive positions after what
/// its cache holds, in the order they are pushed. Reusable: `clear` keeps the capacity.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    pub(crate) rows: Vec<Row>,
    pub(crate) embeddings: Vec<f32>,
    pub(crate) embedding_width: usize,
    /// The logits rows are picked greedily on the device ([`Batch::pick_greedy`]).
    pub(crate) pick: bool,
    /// Logits rows (in logits-row order) read back beside the picks
    /// ([`Batch::read_logits_rows`]).
    pub(crate) read: Vec<u32>,
    /// How each logits row is picked ([`Batch::draw_rows`]); empty: greedily.
    pub(crate) draws: Vec<strata_backend::Draw>,
}

impl Batch {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn clear(&mut self) {
        self.rows.clear();
        self.embeddings.clear();
        self.pick = false;
        self.read.clear();
        self.draws.clear();
    }

    /// The rows that want logits get their greedy pick made on the device instead
    /// ([`crate::Session::take_picks`]); their logits are not read back. A later forward
    /// feeds a pick with the token [`fed`]`(i)`.
    pub fn pick_greedy(&mut self) {
        self.pick = true;
    }

    /// With [`Batch::pick_greedy`]: the logits rows are picked as these draws say, one a
    /// logits row in order (a sample where the temperature is above 0, else greedy), on
    /// the device ([`strata_backend::Backend::pick_rows`]).
    pub fn draw_rows(&mut self, draws: impl IntoIterator<Item = strata_backend::Draw>) {
        self.draws.extend(draws);
    }

    /// With [`Batch::pick_greedy`]: these logits rows (indices in logits-row order, each
    /// once, ascending) also come back, for the samples the device cannot pick; the
    /// session's logits then hold every logits row's place, and only these rows are
    /// valid in it.
    pub fn read_logits_rows(&mut self, rows: impl IntoIterator<Item = u32>) {
        self.read.extend(rows);
    }

    /// Appends `tokens` of `seq`.
    pub fn push(&mut self, seq: SeqId, tokens: &[u32], logits: Logits) {
        let n = tokens.len();
        for (i, &t) in tokens.iter().enumerate() {
            let (logits, hidden) = wants(logits, i + 1 == n);
            self.rows.push(Row { seq, token: t, embedding: 0, logits, hidden });
        }
    }

    /// Appends rows given as input embeddings (`rows x width`, e.g. projected image
    /// features) instead of token ids.
    pub fn push_embeddings(&mut self, seq: SeqId, values: &[f32], width: usize, logits: Logits) {
        assert!(
            width > 0 && values.len().is_multiple_of(width),
            "push_embeddings: {} values are not rows of {width}",
            values.len()
        );
        assert!(self.embedding_width == 0 || self.embedding_width == width || self.embeddings.is_empty());
        self.embedding_width = width;
        let n = values.len() / width;
        for i in 0..n {
            let (logits, hidden) = wants(logits, i + 1 == n);
            let idx = (self.embeddings.len() / width) as u32;
            self.embeddings.extend_from_slice(&values[i * width..(i + 1) * width]);
            self.rows.push(Row { seq, token: u32::MAX, embedding: idx, logits, hidden });
        }
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Rows whose hidden states come back.
    pub fn hidden_rows(&self) -> usize {
        self.rows.iter().filter(|r| r.hidden).count()
    }

    /// Rows that want logits.
    pub fn logit_rows(&self) -> usize {
        self.rows.iter().filter(|r| r.logits).count()
    }

    /// Rows of `seq` in this batch.
    pub fn rows_of(&self, seq: SeqId) -> usize {
        self.rows.iter().filter(|r| r.seq == seq).count()
    }
}
