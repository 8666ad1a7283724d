//! The kernels' CUDA C source compiled by NVRTC at run time, the PTX cached on disk
//! (`$STRATA_PTX_CACHE`, else `$XDG_CACHE_HOME/strata/ptx`, else `~/.cache/strata/ptx`),
//! keyed by a hash of the source, the options and the NVRTC version.

use anyhow::{anyhow, Context, Result};
use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::{CompileOptions, Ptx};
use std::path::PathBuf;
use std::sync::Arc;

/// The kernels' source: the parts of `kernels/` in order (one translation unit).
pub(crate) const SOURCE: &str = concat!(
    include_str!("kernels/common.cu"),
    include_str!("kernels/tiles.cu"),
    include_str!("kernels/products.cu"),
    include_str!("kernels/experts.cu"),
    include_str!("kernels/expert_tiles.cu"),
    include_str!("kernels/attention.cu"),
    include_str!("kernels/moe.cu"),
    include_str!("kernels/elementwise.cu"),
    include_str!("kernels/draw.cu"),
);

fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("STRATA_PTX_CACHE") {
        return Some(PathBuf::from(d));
    }
    let base = match std::env::var_os("XDG_CACHE_HOME") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => PathBuf::from(std::env::var_os("HOME")?).join(".cache"),
    };
    Some(base.join("strata").join("ptx"))
}

fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (major, minor)
}

/// Compile options for a device of compute capability `cc`, plus the definitions in
/// `STRATA_CUDA_DEFINES` (space-separated `NAME=VALUE`: kernel tuning experiments, such as
/// `ROW_UNROLL=4`; results stay the same, speed may not).
fn options(cc: (i32, i32)) -> Vec<String> {
    let mut o =
        vec![format!("--gpu-architecture=compute_{}{}", cc.0, cc.1), "--fmad=false".into(), "-std=c++17".into()];
    if let Ok(defs) = std::env::var("STRATA_CUDA_DEFINES") {
        o.extend(defs.split_whitespace().map(|d| format!("-D{d}")));
    }
    o
}

/// PTX of the kernels for compute capability `cc`: from the disk cache, else compiled (and
/// cached). Returns the PTX and whether it came from the cache.
pub(crate) fn ptx(cc: (i32, i32)) -> Result<(String, bool)> {
    let opts = options(cc);
    let (ma, mi) = nvrtc_version();
    let key = fnv1a(&[SOURCE.as_bytes(), opts.join(" ").as_bytes(), format!("nvrtc {ma}.{mi}").as_bytes()]);
    let path = cache_dir().map(|d| d.join(format!("{key:016x}.ptx")));
    if let Some(p) = &path {
        if let Ok(text) = std::fs::read_to_string(p) {
            if text.contains(".entry k_linear_1") {
                return Ok((text, true));
            }
        }
    }
    let co = CompileOptions { options: opts, name: Some("strata_kernels.cu".into()), ..Default::default() };
    let compiled = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, co).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            anyhow!("NVRTC {ma}.{mi} could not compile strata's kernels: {}", log.to_string_lossy())
        }
        other => anyhow!("NVRTC {ma}.{mi}: {other:?}"),
    })?;
    let text = compiled.to_src();
    if let Some(p) = &path {
        // Best effort: a read-only cache only costs the compile next time.
        if let Some(dir) = p.parent() {
            if std::fs::create_dir_all(dir).is_ok() {
                let tmp = p.with_extension(format!("tmp{}", std::process::id()));
                if std::fs::write(&tmp, &text).is_ok() && std::fs::rename(&tmp, p).is_err() {
                    let _ = std::fs::remove_file(&tmp);
                }
            }
        }
    }
    Ok((text, false))
}

/// The kernels loaded into `ctx`.
pub(crate) fn load(ctx: &Arc<CudaContext>, cc: (i32, i32)) -> Result<Arc<CudaModule>> {
    let (text, _) = ptx(cc)?;
    ctx.load_module(Ptx::from_src(text)).context("loading strata's kernels (PTX) into the CUDA context")
}
