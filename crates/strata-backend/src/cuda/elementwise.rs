//! Host side of the element- and row-wise ops added for Gemma 4 (`kernels/elementwise.cu`):
//! scaling, filling, the logit soft cap, a normalised sublayer output added into the
//! residual, and a GELU gate over a slice of per-row inputs.

use super::{args, CudaBackend, DevBuf};
use cudarc::driver::CudaFunction;

impl CudaBackend {
    /// `f(n, value, x)` over `x[..len]`, grid-strided.
    fn map(&self, f: &CudaFunction, op: &str, len: usize, value: f32, x: &mut DevBuf<f32>) {
        assert!(x.len() >= len, "{op}: {len} values of a buffer of {}", x.len());
        let _g = self.lock();
        let (n, p) = (len as i64, x.ptr());
        let blocks = len.div_ceil(256).clamp(1, 4 * self.sms) as u32;
        self.launch(f, (blocks, 1, 1), 256, 0, &mut args![n, value, p]);
    }

    pub(crate) fn scale_op(&self, len: usize, factor: f32, x: &mut DevBuf<f32>) {
        self.map(&self.f.scale, "scale", len, factor, x);
    }

    pub(crate) fn fill_op(&self, len: usize, value: f32, x: &mut DevBuf<f32>) {
        self.map(&self.f.fill, "fill", len, value, x);
    }

    pub(crate) fn soft_cap_op(&self, len: usize, cap: f32, x: &mut DevBuf<f32>) {
        assert!(cap > 0.0, "soft_cap: a cap of {cap}");
        self.map(&self.f.soft_cap, "soft_cap", len, cap, x);
    }

    /// `x[r] += rms_norm(a[r]) * w`.
    pub(crate) fn add_rms_norm_op(
        &self,
        rows: usize,
        width: usize,
        a: &DevBuf<f32>,
        w: Option<&DevBuf<f32>>,
        eps: f32,
        x: &mut DevBuf<f32>,
    ) {
        assert!(
            a.len() >= rows * width && x.len() >= rows * width,
            "add_rms_norm: buffers smaller than {rows} x {width}"
        );
        assert!(w.is_none_or(|w| w.len() >= width), "add_rms_norm: a weight shorter than {width}");
        let _g = self.lock();
        let (ap, wp, xp, wd) = (a.ptr(), w.map_or(0, |w| w.ptr()), x.ptr(), width as i32);
        let block = super::row_threads(width);
        self.launch(&self.f.add_rms_norm, (rows as u32, 1, 1), block, 0, &mut args![ap, wp, eps, xp, wd]);
    }

    /// `a[r, i] = gelu_tanh(a[r, i]) * b[r * b_stride + b_col + i]`.
    pub(crate) fn gelu_tanh_mul_op(
        &self,
        rows: usize,
        width: usize,
        a: &mut DevBuf<f32>,
        b: &DevBuf<f32>,
        b_stride: usize,
        b_col: usize,
    ) {
        assert!(a.len() >= rows * width, "gelu_tanh_mul: a smaller than {rows} x {width}");
        assert!(
            rows == 0 || b.len() >= (rows - 1) * b_stride + b_col + width,
            "gelu_tanh_mul: b of {} values too small for {rows} rows (stride {b_stride}, col {b_col}, width {width})",
            b.len()
        );
        let _g = self.lock();
        let (wd, ap, bp, stride, col) = (width as i32, a.ptr(), b.ptr(), b_stride as i32, b_col as i32);
        self.launch(&self.f.gelu_mul, (rows as u32, 1, 1), 256, 0, &mut args![wd, ap, bp, stride, col]);
    }
}
