//! SwiGLU feed-forward: `down(silu(gate x) * up x)`.

use strata_backend::{Backend, ExpertTask};

pub struct SwiGlu<B: Backend> {
    pub gate: B::Mat,
    pub up: B::Mat,
    pub down: B::Mat,
}

impl<B: Backend> SwiGlu<B> {
    /// `x += mlp(xn)` over `rows` rows; `y` is scratch of `rows x hidden`.
    pub fn forward_add(&self, b: &B, xn: &B::Buf, rows: usize, hidden: usize, y: &mut B::Buf, x: &mut B::Buf) {
        let weights = b.expert_ref(&self.gate, &self.up, &self.down);
        b.experts(xn, rows, 1, &|_| ExpertTask { weights, rows: None, out_row: 0, bias: None }, y);
        b.add(rows * hidden, y, x);
    }

    /// `out = x + mlp(xn)`, leaving `x` as it is.
    pub fn forward_add_into(&self, b: &B, xn: &B::Buf, rows: usize, hidden: usize, x: &B::Buf, out: &mut B::Buf) {
        let weights = b.expert_ref(&self.gate, &self.up, &self.down);
        b.experts(xn, rows, 1, &|_| ExpertTask { weights, rows: None, out_row: 0, bias: None }, out);
        b.add(rows * hidden, x, out);
    }
}
