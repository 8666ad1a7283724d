//! One forward step's rows as every op sees them.

/// The rows of one forward: which sequence each belongs to, at which position, with which
/// token, and the sequences' KV block tables. Built on the host by the session (cleared
/// and refilled each step: no allocation once the vectors have grown).
#[derive(Clone, Debug, Default)]
pub struct Step {
    /// Token id per row (`u32::MAX` for a row fed by an embedding, `FED | i` for a row
    /// fed the device's greedy pick `i` of the forward before).
    pub tokens: Vec<u32>,
    /// Position of each row in its sequence.
    pub positions: Vec<u32>,
    /// Per row: the index of its sequence's block table.
    pub seq: Vec<u32>,
    /// Positions per KV block.
    pub block_size: usize,
    /// Block tables, `max_blocks` entries per sequence index.
    pub blocks: Vec<u32>,
    pub max_blocks: usize,
    /// Per row, one past the last position it may attend (for rows that see later rows of
    /// the same forward: an image block attended bidirectionally); empty: every row sees
    /// up to its own position.
    pub visible_to: Vec<u32>,
    /// Per logits row, how [`crate::Backend::pick_rows`] picks it ([`crate::Draw::words`],
    /// [`crate::Draw::WORDS`] words a row); empty: every row greedy.
    pub draws: Vec<u32>,
}

/// A token row `FED | i` takes its id on the device: the greedy pick of logits row `i` of
/// the forward before ([`crate::Backend::pick_rows`]). A decode step can then be queued
/// before the host has read the token it embeds.
pub const FED: u32 = 0x8000_0000;
/// A greedy pick with this bit set (`NON_FINITE | j`) met a non-finite logit at id `j`.
pub const NON_FINITE: u32 = 0x8000_0000;

/// Whether `tok` is a fed row (`FED | i`; not an embedding row).
#[inline]
pub fn is_fed(tok: u32) -> bool {
    tok != u32::MAX && tok & FED != 0
}

impl Step {
    /// Checks the step's token ids against a table of `vocab` rows and fed rows against
    /// `picks` greedy picks of the forward before (an embedding row passes).
    pub fn check_tokens(&self, vocab: usize, picks: usize) -> anyhow::Result<()> {
        for &tok in &self.tokens {
            if is_fed(tok) {
                let i = (tok & !FED) as usize;
                anyhow::ensure!(
                    i < picks,
                    "a row fed greedy pick {i} of the forward before, which picked {picks} token{}",
                    if picks == 1 { "" } else { "s" }
                );
            } else if tok != u32::MAX && tok as usize >= vocab {
                anyhow::bail!("token id {tok} is outside the vocabulary ({vocab})");
            }
        }
        Ok(())
    }

    pub fn rows(&self) -> usize {
        self.positions.len()
    }

    /// Positions row `r` may attend to (its own included).
    #[inline]
    pub fn visible(&self, r: usize) -> usize {
        match self.visible_to.get(r) {
            Some(&v) => v as usize,
            None => self.positions[r] as usize + 1,
        }
    }

    /// The cache slot holding position `pos` of row `r`'s sequence.
    #[inline]
    pub fn slot(&self, r: usize, pos: usize) -> usize {
        let table = self.seq[r] as usize * self.max_blocks;
        self.blocks[table + pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }

    /// The longest visible context of any row.
    pub fn max_visible(&self) -> usize {
        (0..self.rows()).map(|r| self.visible(r)).max().unwrap_or(0)
    }

    pub fn clear(&mut self) {
        self.tokens.clear();
        self.positions.clear();
        self.seq.clear();
        self.visible_to.clear();
        self.draws.clear();
    }
}
