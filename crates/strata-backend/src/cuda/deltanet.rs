//! Host side of Qwen3-Next's ops (`kernels/deltanet.cu`): the gated DeltaNet over a
//! step's rows, and the gated attention output.

use super::{args, CudaBackend, DevBuf};
use crate::{DeltaNet, Step};

impl CudaBackend {
    pub(crate) fn gated_delta_net_op(&self, step: &Step, a: DeltaNet<'_, Self>) {
        let d = a.dims;
        let rows = step.rows();
        let (w, cd, vd) = (d.qkvz_width(), d.conv_dim(), d.value_dim());
        assert!(
            d.k_heads > 0 && d.v_heads.is_multiple_of(d.k_heads) && d.kernel > 0,
            "gated_delta_net: {} value heads over {} key heads, convolution {}",
            d.v_heads,
            d.k_heads,
            d.kernel
        );
        assert!(d.v_dim <= 1024, "gated_delta_net: value heads of {} (at most 1024)", d.v_dim);
        assert!(a.qkvz.len() >= rows * w && a.ba.len() >= rows * 2 * d.v_heads, "gated_delta_net: inputs too small");
        assert!(a.out.len() >= rows * vd, "gated_delta_net: output too small");
        assert!(a.conv.len() >= cd * d.kernel, "gated_delta_net: convolution weight too small");
        assert!(a.a_log.len() >= d.v_heads && a.dt_bias.len() >= d.v_heads && a.norm.len() >= d.v_dim);
        let seqs = step.seq.iter().max().map_or(0, |&s| s as usize + 1);
        assert!(
            a.conv_state.len() >= seqs * d.conv_state_len() && a.state.len() >= seqs * d.state_len(),
            "gated_delta_net: states for fewer than {seqs} sequences"
        );
        let mut st = self.lock();
        let sd = self.step_desc(&mut st, step);
        let mixed = self.ensure(&mut st.work.delta_mixed, rows * cd).ptr();
        let (n, width, channels, kernel) = (rows as i32, w as i32, cd as i32, d.kernel as i32);
        let (qkvz, ba, conv, cs, s, out) =
            (a.qkvz.ptr(), a.ba.ptr(), a.conv.ptr(), a.conv_state.ptr(), a.state.ptr(), a.out.ptr());
        self.launch(
            &self.f.delta_conv,
            (cd.div_ceil(128) as u32, 1, 1),
            128,
            0,
            &mut args![sd, n, qkvz, width, conv, channels, kernel, cs, mixed],
        );
        let (kh, vh, kdim, vdim) = (d.k_heads as i32, d.v_heads as i32, d.k_dim as i32, d.v_dim as i32);
        let (al, dt, nw, eps) = (a.a_log.ptr(), a.dt_bias.ptr(), a.norm.ptr(), a.eps);
        let block = d.v_dim.next_multiple_of(32) as u32;
        let smem = (2 * d.k_dim * std::mem::size_of::<f32>()) as u32;
        self.launch(
            &self.f.delta_rule,
            (d.v_heads as u32, 1, 1),
            block,
            smem,
            &mut args![sd, n, mixed, qkvz, width, ba, kh, vh, kdim, vdim, al, dt, nw, eps, s, out],
        );
    }

    pub(crate) fn sigmoid_mul_op(&self, len: usize, gate: &DevBuf<f32>, x: &mut DevBuf<f32>) {
        assert!(
            gate.len() >= len && x.len() >= len,
            "sigmoid_mul: {len} values of buffers of {} and {}",
            gate.len(),
            x.len()
        );
        let _g = self.lock();
        let (n, g, p) = (len as i64, gate.ptr(), x.ptr());
        let blocks = len.div_ceil(256).clamp(1, 4 * self.sms) as u32;
        self.launch(&self.f.sigmoid_mul, (blocks, 1, 1), 256, 0, &mut args![n, g, p]);
    }
}
