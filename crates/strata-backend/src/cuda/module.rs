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
    include_str!("kernels/deltanet.cu"),
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

/// Compile options for a device of compute capability `cc`.
fn options(cc: (i32, i32)) -> Vec<String> {
    vec![format!("--gpu-architecture=compute_{}{}", cc.0, cc.1), "--fmad=false".into(), "-std=c++17".into()]
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
    let text = compile(&opts)?;
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

/// The kernels compiled by NVRTC with `opts` (no cache): the runtime's one compile path,
/// which the architecture test below drives for every architecture NVRTC offers.
fn compile(opts: &[String]) -> Result<String> {
    let (ma, mi) = nvrtc_version();
    let co = CompileOptions { options: opts.to_vec(), name: Some("strata_kernels.cu".into()), ..Default::default() };
    let compiled = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, co).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            anyhow!("NVRTC {ma}.{mi} could not compile strata's kernels: {}", log.to_string_lossy())
        }
        other => anyhow!("NVRTC {ma}.{mi}: {other:?}"),
    })?;
    Ok(compiled.to_src())
}

/// The kernels loaded into `ctx`.
pub(crate) fn load(ctx: &Arc<CudaContext>, cc: (i32, i32)) -> Result<Arc<CudaModule>> {
    let (text, _) = ptx(cc)?;
    ctx.load_module(Ptx::from_src(text)).context("loading strata's kernels (PTX) into the CUDA context")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The compute capabilities this NVRTC can target, oldest first.
    fn nvrtc_archs() -> Vec<(i32, i32)> {
        let mut n = 0;
        // SAFETY: plain out-parameters, the array sized by the first call.
        unsafe { cudarc::nvrtc::sys::nvrtcGetNumSupportedArchs(&mut n) }.result().expect("nvrtcGetNumSupportedArchs");
        let mut archs = vec![0; n as usize];
        unsafe { cudarc::nvrtc::sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
            .result()
            .expect("nvrtcGetSupportedArchs");
        archs.into_iter().map(|a| (a / 10, a % 10)).collect()
    }

    /// The kernels compile under NVRTC, as the runtime compiles them (the same source, the
    /// same options), for every architecture the installed NVRTC supports: nvcc accepts
    /// code NVRTC refuses (generic lambdas in device code, b9939d7), so an offline nvcc
    /// check proves nothing about the runtime. Needs libnvrtc only, no GPU (CI installs it
    /// from PyPI); without it the test fails, naming what is missing.
    #[test]
    fn kernels_compile_under_nvrtc_for_every_architecture() {
        // SAFETY: only probes for the library.
        assert!(
            unsafe { cudarc::nvrtc::sys::is_culib_present() },
            "libnvrtc not found: put NVRTC's lib directory on LD_LIBRARY_PATH (CI: pip install nvidia-cuda-nvrtc, see .ci/run)"
        );
        let archs = nvrtc_archs();
        assert!(!archs.is_empty(), "NVRTC lists no architectures");
        let (ma, mi) = nvrtc_version();
        // A compile takes ~30 s on one core: the architectures in parallel.
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(archs.len());
        let next = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(&cc) = archs.get(i) else { break };
                    let ptx = compile(&options(cc)).unwrap_or_else(|e| panic!("compute_{}{}: {e:#}", cc.0, cc.1));
                    for entry in [".entry k_linear_1", ".entry k_pick_rows", ".entry k_mla_attend_tiles"] {
                        assert!(ptx.contains(entry), "compute_{}{}: PTX lacks {entry}", cc.0, cc.1);
                    }
                    eprintln!("NVRTC {ma}.{mi}: compute_{}{} compiled ({} KiB of PTX)", cc.0, cc.1, ptx.len() / 1024);
                });
            }
        });
    }
}
