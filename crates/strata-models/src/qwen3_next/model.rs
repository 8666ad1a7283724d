//! The whole model: embedding -> layers (gated DeltaNet or gated full attention, then a
//! dense SwiGLU or the routed MoE with its sigmoid-gated shared expert) -> final norm ->
//! LM head, and its session: block KV for the attention layers, and per sequence the
//! DeltaNet layers' convolution and recurrent state.
//!
//! The recurrent state is the sequence's state like its KV, but it holds the whole prefix
//! at once: a sequence keeps exactly the positions it was fed, a truncation to fewer
//! starts it over (the caller feeds the prefix again), and the session shares no
//! prefixes (a cached KV block says nothing of the state).

use super::Qwen3NextConfig;
use crate::batch::{Batch, SeqId};
use crate::blocks::{ExpertSource, Ffn, FfnBufs, GqaScratch, GqaWeights, MoeScratch};
use crate::kv::KvBlocks;
use crate::session::{session_parts, Outputs, Rows};
use crate::{Model, ModelInfo, Session, SessionOptions};
use anyhow::{bail, ensure, Result};
use strata_backend::{Backend, DeltaNet, GqaDims, LinearOut};
use strata_experts::Routes;

/// A DeltaNet layer's weights (the input projections reordered head-major, see `load.rs`).
pub(super) struct DeltaWeights<B: Backend> {
    pub qkvz: B::Mat,
    pub ba: B::Mat,
    pub conv: B::Buf,
    pub dt_bias: B::Buf,
    pub a_log: B::Buf,
    pub norm: B::Buf,
    pub out: B::Mat,
    /// Its index among the DeltaNet layers (its state buffers).
    pub slot: usize,
}

pub(super) enum Mixer<B: Backend> {
    /// `cache`: its index among the attention layers.
    Attention {
        attn: GqaWeights<B>,
        cache: usize,
    },
    Delta(DeltaWeights<B>),
}

pub(super) struct Layer<B: Backend> {
    pub input_norm: B::Buf,
    pub post_norm: B::Buf,
    pub mixer: Mixer<B>,
    pub ffn: Ffn<B>,
}

pub struct Qwen3Next<B: Backend> {
    pub(super) b: B,
    pub(super) cfg: Qwen3NextConfig,
    pub(super) info: ModelInfo,
    pub(super) dims: GqaDims,
    pub(super) embed: B::Mat,
    pub(super) lm_head: Option<B::Mat>,
    pub(super) norm: B::Buf,
    pub(super) layers: Vec<Layer<B>>,
    pub(super) experts: ExpertSource<B>,
    pub(super) rope_inv: Vec<f32>,
    pub(super) attn_layers: usize,
    pub(super) delta_layers: usize,
}

impl<B: Backend> Model for Qwen3Next<B> {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn device(&self) -> String {
        self.b.describe()
    }

    fn prefill_chunk(&self) -> usize {
        self.b.prefill_chunk()
    }

    fn new_session(&self, opts: SessionOptions) -> Result<Box<dyn Session + '_>> {
        Ok(Box::new(Qwen3NextSession::new(self, opts)?))
    }
}

/// Activations of one forward, shared by every layer.
struct Scratch<B: Backend> {
    x: B::Buf,
    xn: B::Buf,
    y: B::Buf,
    cos: B::Buf,
    sin: B::Buf,
    gqa: GqaScratch<B>,
    moe: Option<MoeScratch<B>>,
    qkvz: B::Buf,
    ba: B::Buf,
    delta: B::Buf,
}

pub struct Qwen3NextSession<'m, B: Backend> {
    m: &'m Qwen3Next<B>,
    kv: KvBlocks,
    /// Per attention layer: `[slots, 2 * kv_heads * head_dim]`.
    caches: Vec<B::Buf>,
    /// Per DeltaNet layer: every sequence's convolution and recurrent state.
    conv_states: Vec<B::Buf>,
    states: Vec<B::Buf>,
    /// Per sequence: the positions its state holds, and will after this forward.
    held: Vec<usize>,
    next: Vec<usize>,
    rows: Rows,
    s: Scratch<B>,
    out: Outputs<B>,
    routes: Routes,
}

impl<'m, B: Backend> Qwen3NextSession<'m, B> {
    fn new(m: &'m Qwen3Next<B>, opts: SessionOptions) -> Result<Self> {
        let (b, cfg) = (&m.b, &m.cfg);
        ensure!(opts.max_rows > 0 && opts.max_seqs > 0, "a session needs room for at least one row and one sequence");
        let max_len = opts.max_len.min(cfg.max_position_embeddings).max(1);
        let kv = KvBlocks::new(opts.kv_tokens.max(1), opts.max_seqs, max_len);
        let caches = (0..m.attn_layers).map(|_| b.alloc(kv.slots() * m.dims.cache_width())).collect::<Result<_>>()?;
        let d = &cfg.delta;
        let conv_states =
            (0..m.delta_layers).map(|_| b.alloc(opts.max_seqs * d.conv_state_len())).collect::<Result<_>>()?;
        let states = (0..m.delta_layers).map(|_| b.alloc(opts.max_seqs * d.state_len())).collect::<Result<_>>()?;
        let (rows, h) = (opts.max_rows, cfg.hidden_size);
        let moe = match cfg.sparse_layers() > 0 {
            true => Some(MoeScratch::new(b, rows, h, cfg.num_experts, cfg.num_experts_per_tok, true)?),
            false => None,
        };
        b.reserve_workspace(cfg.num_attention_heads / cfg.num_key_value_heads, max_len, max_len);
        let s = Scratch {
            x: b.alloc(rows * h)?,
            xn: b.alloc(rows * h)?,
            y: b.alloc(rows * h)?,
            cos: b.alloc(rows * m.dims.rotary / 2)?,
            sin: b.alloc(rows * m.dims.rotary / 2)?,
            gqa: GqaScratch::new(b, &m.dims, rows, false, true)?,
            moe,
            qkvz: b.alloc(rows * d.qkvz_width())?,
            ba: b.alloc(rows * 2 * d.v_heads)?,
            delta: b.alloc(rows * d.value_dim())?,
        };
        Ok(Self {
            m,
            caches,
            conv_states,
            states,
            held: vec![0; opts.max_seqs],
            next: vec![0; opts.max_seqs],
            rows: Rows::new(&opts, kv.max_blocks()),
            s,
            out: Outputs::new(b, opts.max_seqs.min(rows).max(1), h, cfg.vocab_size)?,
            routes: Routes::default(),
            kv,
        })
    }

    /// Zeroes sequence `i`'s state (a new sequence, or one started over).
    fn reset(&mut self, i: usize) {
        let (b, d) = (&self.m.b, &self.m.cfg.delta);
        let (cl, sl) = (d.conv_state_len(), d.state_len());
        for (c, s) in self.conv_states.iter_mut().zip(self.states.iter_mut()) {
            b.write(c, i * cl, &vec![0.0; cl]);
            b.write(s, i * sl, &vec![0.0; sl]);
        }
        self.held[i] = 0;
    }
}

impl<B: Backend> Session for Qwen3NextSession<'_, B> {
    fn add_sequence(&mut self) -> Result<SeqId> {
        let seq = self.kv.add()?;
        self.reset(seq.0 as usize);
        Ok(seq)
    }

    fn remove_sequence(&mut self, seq: SeqId) {
        self.kv.remove(seq)
    }

    fn len(&self, seq: SeqId) -> usize {
        self.kv.len(seq)
    }

    fn truncate(&mut self, seq: SeqId, len: usize) {
        if len < self.kv.len(seq) {
            // The state holds every position: fewer means starting over.
            self.kv.truncate(seq, 0);
            self.reset(seq.0 as usize);
        }
    }

    fn max_len(&self) -> usize {
        self.kv.max_len()
    }

    fn max_rows(&self) -> usize {
        self.rows.max_rows
    }

    fn shares_prefixes(&self) -> bool {
        false
    }

    fn forward(&mut self, batch: &Batch) -> Result<()> {
        let m = self.m;
        let (b, cfg) = (&m.b, &m.cfg);
        self.rows.plan(&mut self.kv, batch, cfg.vocab_size, self.out.picked())?;
        let step = &self.rows.step;
        // Each row must continue its sequence's state where it stands.
        let next = &mut self.next;
        next.copy_from_slice(&self.held);
        for r in 0..step.rows() {
            let (s, pos) = (step.seq[r] as usize, step.positions[r] as usize);
            if pos != next[s] {
                bail!(
                    "qwen3_next: sequence {s} holds {} positions of recurrent state, but a row comes at position {pos} \
                     (its KV was attached or moved outside the session)",
                    next[s]
                );
            }
            next[s] += 1;
        }
        let (rows, h, eps) = (batch.len(), cfg.hidden_size, cfg.rms_norm_eps as f32);
        b.rope_tables(step, &m.rope_inv, &mut self.s.cos, &mut self.s.sin);
        self.rows.embed(b, batch, &self.out, &m.embed, h, &mut self.s.x)?;
        let step = &self.rows.step;
        let s = &mut self.s;
        self.routes.clear(rows, cfg.num_experts_per_tok);
        for layer in &m.layers {
            b.rms_norm(rows, h, &s.x, Some(&layer.input_norm), eps, &mut s.xn);
            match &layer.mixer {
                Mixer::Attention { attn, cache } => {
                    let cache = &mut self.caches[*cache];
                    attn.forward_add(b, step, m.dims, eps, &s.xn, &s.cos, &s.sin, cache, &mut s.gqa, &mut s.x);
                }
                Mixer::Delta(w) => {
                    b.linears(
                        &s.xn,
                        rows,
                        &mut [LinearOut::new(b, &w.qkvz, &mut s.qkvz), LinearOut::new(b, &w.ba, &mut s.ba)],
                    );
                    b.gated_delta_net(
                        step,
                        DeltaNet {
                            dims: cfg.delta,
                            qkvz: &s.qkvz,
                            ba: &s.ba,
                            conv: &w.conv,
                            a_log: &w.a_log,
                            dt_bias: &w.dt_bias,
                            norm: &w.norm,
                            eps,
                            conv_state: &mut self.conv_states[w.slot],
                            state: &mut self.states[w.slot],
                            out: &mut s.delta,
                        },
                    );
                    b.linears(&s.delta, rows, &mut [LinearOut::add(b, &w.out, &mut s.x)]);
                }
            }
            b.rms_norm(rows, h, &s.x, Some(&layer.post_norm), eps, &mut s.xn);
            let bufs = FfnBufs { y: &mut s.y, moe: s.moe.as_mut() };
            layer.ffn.forward_add(b, &m.experts, &s.xn, rows, h, bufs, &mut self.routes, &mut s.x)?;
        }
        self.held.copy_from_slice(&self.next);
        self.rows.commit(&mut self.kv);
        self.out.compute(b, &self.rows, &self.s.x, &m.norm, eps, m.lm_head.as_ref().unwrap_or(&m.embed))
    }

    session_parts!();
}
