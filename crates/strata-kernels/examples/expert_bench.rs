//! Micro benchmark: one GLM-5 routed expert (gate/up [2048, 6144], down [6144, 2048]) per
//! call of `swiglu_expert`, for int4-g64 (f32, bf16 and e4m3 scales), int4-g128-bf16, int8 and
//! bf16, rows = 1 (decode) and 8 (prefill
//! chunk / verify), next to this machine's memory read bandwidth measured by a plain
//! multi-threaded read loop.
//!
//! "cold": each call uses the next of enough distinct experts to exceed the caches
//! (working set `--mib`, default 1024), so weights stream from DRAM — the streamed-expert
//! case. "hot": the same expert every call (it stays in L2/L3).
//!
//! cargo run --release -p strata-kernels --example expert_bench -- [--mib N] [--iters N]
//!     [--path scalar|avx2|avx512]
//!     [--kind int4-g64|int4-g64-bf16|int4-g64-e4m3|int4-g128-bf16|int8|bf16] [--rows N]

use std::time::{Duration, Instant};

use rayon::prelude::*;
use strata_kernels::{
    swiglu_expert_with, swiglu_experts_with, ExpertCall, KernelPath, QMatrix, QuantKind, ScaleType, Scales,
};

const HIDDEN: usize = 6144;
const INTER: usize = 2048;

struct Matrix {
    kind: QuantKind,
    rows: usize,
    cols: usize,
    payload: Vec<u8>,
    scales: Vec<f32>,
    /// The scales as bf16 bits, for kinds that store them so.
    bf16: Vec<u16>,
    /// The stored e4m3 region (factor, codes), for kinds that store them so.
    e4m3: Vec<u8>,
}

impl Matrix {
    /// Random but well-formed values (no NaN/denormal bf16), filled in parallel.
    fn random(kind: QuantKind, rows: usize, cols: usize, seed: u64) -> Self {
        let mut payload = vec![0u8; kind.payload_bytes(rows, cols)];
        payload.par_chunks_mut(1 << 16).enumerate().for_each(|(i, c)| {
            let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
            match kind {
                QuantKind::Bf16 | QuantKind::F32 => {
                    let step = if kind == QuantKind::Bf16 { 2 } else { 4 };
                    for v in c.chunks_exact_mut(step) {
                        s = xorshift(s);
                        let f = ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1 + 1e-3;
                        let b = f.to_bits().to_le_bytes();
                        v.copy_from_slice(&b[4 - step..]);
                    }
                }
                _ => {
                    for v in c.chunks_mut(8) {
                        s = xorshift(s);
                        let b = s.to_le_bytes();
                        v.copy_from_slice(&b[..v.len()]);
                    }
                }
            }
        });
        // 0.01 in each type (0.00999... as bf16 or e4m3), so every kind multiplies the same.
        let mut scales = vec![0.01f32; kind.scale_count(rows, cols)];
        strata_kernels::round_scales(kind, &mut scales);
        let bf16 = scales.iter().map(|&s| half::bf16::from_f32(s).to_bits()).collect();
        // e4m3's region (factor and codes), or e8m0's codes.
        let e4m3 = match kind.scale_type() {
            ScaleType::E4m3 | ScaleType::E8m0 => {
                strata_kernels::encode_scales(kind, &scales).expect("rounded scales encode")
            }
            _ => Vec::new(),
        };
        Self { kind, rows, cols, payload, scales, bf16, e4m3 }
    }

    fn q(&self) -> QMatrix<'_> {
        let scales = match self.kind.scale_type() {
            ScaleType::F32 => Scales::F32(&self.scales),
            ScaleType::Bf16 => Scales::Bf16(&self.bf16),
            ScaleType::E4m3 => Scales::e4m3(&self.e4m3).expect("an e4m3 region has its factor"),
            ScaleType::E8m0 => Scales::E8m0(&self.e4m3),
        };
        QMatrix::new(self.kind, self.rows, self.cols, &self.payload, scales)
    }
}

fn xorshift(mut s: u64) -> u64 {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    s
}

struct Expert {
    gate: Matrix,
    up: Matrix,
    down: Matrix,
}

impl Expert {
    fn new(kind: QuantKind, seed: u64) -> Self {
        Self {
            gate: Matrix::random(kind, INTER, HIDDEN, seed * 3),
            up: Matrix::random(kind, INTER, HIDDEN, seed * 3 + 1),
            down: Matrix::random(kind, HIDDEN, INTER, seed * 3 + 2),
        }
    }
    fn bytes(&self) -> usize {
        self.gate.q().weight_bytes() + self.up.q().weight_bytes() + self.down.q().weight_bytes()
    }
}

/// Best-of-N multi-threaded read bandwidth over a buffer of `mib` MiB, in GB/s.
fn read_bandwidth(mib: usize, passes: usize) -> f64 {
    let buf: Vec<u64> = (0..mib * (1 << 20) / 8).into_par_iter().map(|i| i as u64).collect();
    let mut best = f64::MAX;
    let mut sink = 0u64;
    for _ in 0..passes {
        let t = Instant::now();
        sink ^= buf
            .par_chunks(1 << 17)
            .map(|c| {
                // Eight independent lanes so the loop is load-bound, not add-bound.
                let mut acc = [0u64; 8];
                for v in c.chunks_exact(8) {
                    for j in 0..8 {
                        acc[j] = acc[j].wrapping_add(v[j]);
                    }
                }
                acc.iter().fold(0u64, |a, b| a ^ b)
            })
            .reduce(|| 0, |a, b| a ^ b);
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(sink);
    (buf.len() * 8) as f64 / best / 1e9
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str, default: usize| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let mib = arg("--mib", 1024);
    let iters = arg("--iters", 40);
    let only_kind =
        args.iter().position(|a| a == "--kind").and_then(|i| args.get(i + 1)).map(|k| QuantKind::parse(k).unwrap());
    let only_rows =
        args.iter().position(|a| a == "--rows").and_then(|i| args.get(i + 1)).map(|r| r.parse::<usize>().unwrap());
    let hot_only = args.iter().any(|a| a == "--hot-only");
    let inside = args.iter().any(|a| a == "--inside");
    let path = match args.iter().position(|a| a == "--path").and_then(|i| args.get(i + 1)).map(|s| s.as_str()) {
        Some("scalar") => KernelPath::Scalar,
        Some("avx2") => KernelPath::Avx2Fma,
        Some("avx512") => KernelPath::Avx512,
        Some(p) => panic!("--path scalar|avx2|avx512, not {p}"),
        None => KernelPath::best(),
    };
    assert!(path.is_available(), "{} is not available on this CPU", path.name());

    let threads = rayon::current_num_threads();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    println!("cpu: {cpu}, {} logical cpus", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0));
    println!("strata expert_bench: path {}, {threads} rayon threads, working set {mib} MiB", path.name());
    let bw = if hot_only { 1.0 } else { read_bandwidth(mib, 5) };
    let bw1 = if hot_only {
        1.0
    } else {
        rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap().install(|| read_bandwidth(mib, 3))
    };
    println!("memory read bandwidth: {bw:.1} GB/s ({threads} threads), {bw1:.1} GB/s (1 thread)");
    // What one parallel region costs here (a SwiGLU expert runs two).
    let fork: Vec<Duration> = (0..2000)
        .map(|_| {
            let t = Instant::now();
            (0..96usize).into_par_iter().for_each(|i| {
                std::hint::black_box(i);
            });
            t.elapsed()
        })
        .collect();
    // The same from inside the pool (a caller that is itself a rayon task).
    let fork_in: Vec<Duration> = rayon::ThreadPoolBuilder::new().build().unwrap().install(|| {
        (0..2000)
            .map(|_| {
                let t = Instant::now();
                (0..96usize).into_par_iter().for_each(|i| {
                    std::hint::black_box(i);
                });
                t.elapsed()
            })
            .collect()
    });
    println!(
        "rayon fork-join of 96 empty tasks: {:.1} us from outside the pool, {:.1} us from inside (median)",
        median(fork).as_secs_f64() * 1e6,
        median(fork_in).as_secs_f64() * 1e6
    );
    println!(
        "{:<9} {:>4} {:>5} {:>9} {:>9} {:>8} {:>9} {:>9} {:>8}",
        "kind", "rows", "MB", "cold ms", "cold GB/s", "/floor", "hot ms", "hot GB/s", "floor ms"
    );

    for kind in [
        QuantKind::int4(64),
        QuantKind::int4_bf16(64),
        QuantKind::int4_e4m3(64),
        QuantKind::int4_bf16(128),
        QuantKind::Int8Row,
        QuantKind::Bf16,
    ] {
        if only_kind.is_some_and(|k| k != kind) {
            continue;
        }
        let one = Expert::new(kind, 1).bytes();
        let n = if hot_only { 1 } else { (mib * (1 << 20)).div_ceil(one).max(2) };
        let experts: Vec<Expert> = (0..n as u64).map(|s| Expert::new(kind, s + 1)).collect();
        for rows in [1usize, 8] {
            if only_rows.is_some_and(|r| r != rows) {
                continue;
            }
            let x: Vec<f32> = (0..rows * HIDDEN).map(|i| ((i % 97) as f32 - 48.0) / 100.0 + 1e-3).collect();
            let mut y = vec![0f32; rows * HIDDEN];
            let mut call = |e: &Expert| {
                let t = Instant::now();
                swiglu_expert_with(path, &x, rows, &e.gate.q(), &e.up.q(), &e.down.q(), &mut y);
                t.elapsed()
            };
            // Warm up (page faults, thread pool), then cold: cycle through all experts.
            for e in experts.iter().take(if hot_only { 1 } else { n }) {
                call(e);
            }
            let cold_iters = if hot_only { 1 } else { iters.max(n) };
            let cold: Vec<Duration> = (0..cold_iters).map(|i| call(&experts[i % n])).collect();
            let hot: Vec<Duration> = if inside {
                // Caller inside the pool (what an engine running its forward in
                // `pool.install` gets): no injection / wake-up of the calling thread.
                rayon::ThreadPoolBuilder::new()
                    .build()
                    .unwrap()
                    .install(|| (0..iters).map(|_| call(&experts[0])).collect())
            } else {
                (0..iters).map(|_| call(&experts[0])).collect()
            };
            let (cold, hot) = (median(cold).as_secs_f64(), median(hot).as_secs_f64());
            let gbs = |t: f64| one as f64 / t / 1e9;
            let floor = one as f64 / (bw * 1e9);
            println!(
                "{:<9} {:>4} {:>5.1} {:>9.3} {:>9.1} {:>8.2} {:>9.3} {:>9.1} {:>8.3}",
                kind.name(),
                rows,
                one as f64 / 1e6,
                cold * 1e3,
                gbs(cold),
                cold / floor,
                hot * 1e3,
                gbs(hot),
                floor * 1e3
            );
            std::hint::black_box(&y);
        }
        if n >= 16 && only_rows.is_none_or(|r| r == 1) {
            // A layer's 8 routed experts for one token: 8 calls vs one batched call.
            let x: Vec<f32> = (0..HIDDEN).map(|i| ((i % 97) as f32 - 48.0) / 100.0 + 1e-3).collect();
            let mut ys = vec![vec![0f32; HIDDEN]; 8];
            let (mut single, mut batched) = (Vec::new(), Vec::new());
            for it in 0..iters.max(n / 8) {
                let set: Vec<&Expert> = (0..8).map(|j| &experts[(it * 8 + j) % n]).collect();
                let t = Instant::now();
                for (e, y) in set.iter().zip(ys.iter_mut()) {
                    swiglu_expert_with(path, &x, 1, &e.gate.q(), &e.up.q(), &e.down.q(), y);
                }
                single.push(t.elapsed());
                let set: Vec<&Expert> = (0..8).map(|j| &experts[(it * 8 + j + n / 2) % n]).collect();
                let mut calls: Vec<ExpertCall> = set
                    .iter()
                    .zip(ys.iter_mut())
                    .map(|(e, y)| ExpertCall { x: &x, rows: 1, gate: e.gate.q(), up: e.up.q(), down: e.down.q(), y })
                    .collect();
                let t = Instant::now();
                swiglu_experts_with(path, &mut calls);
                batched.push(t.elapsed());
            }
            let (a, b) = (median(single).as_secs_f64() * 1e3, median(batched).as_secs_f64() * 1e3);
            println!(
                "{:<9}    1  8 experts, cold: {a:.3} ms as 8 calls, {b:.3} ms as one swiglu_experts call",
                kind.name()
            );
        }
    }
    println!("(GB/s = expert weight bytes incl. scales / median time; /floor = cold time over bytes / read bandwidth)");

    if args.iter().any(|a| a == "--scaling") {
        // Hot int4-g64 expert against the thread count.
        let e = Expert::new(QuantKind::int4(64), 1);
        let max = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        println!("scaling, hot int4-g64 expert (ms per expert; speed-up over 1 thread):");
        let mut base = [0f64; 2];
        let mut t = 1;
        while t <= max {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build().unwrap();
            let mut line = format!("  {t:>3} threads:");
            for (i, rows) in [1usize, 8].into_iter().enumerate() {
                let x: Vec<f32> = (0..rows * HIDDEN).map(|i| ((i % 97) as f32 - 48.0) / 100.0 + 1e-3).collect();
                let mut y = vec![0f32; rows * HIDDEN];
                let times: Vec<Duration> = (0..iters + 5)
                    .map(|_| {
                        let t0 = Instant::now();
                        pool.install(|| {
                            swiglu_expert_with(path, &x, rows, &e.gate.q(), &e.up.q(), &e.down.q(), &mut y)
                        });
                        t0.elapsed()
                    })
                    .collect();
                let ms = median(times[5..].to_vec()).as_secs_f64() * 1e3;
                if t == 1 {
                    base[i] = ms;
                }
                line += &format!("  rows={rows}: {ms:.3} ms ({:.1}x)", base[i] / ms);
            }
            println!("{line}");
            t = if t == max { t + 1 } else { (t * 2).min(max) };
        }
    }
}
