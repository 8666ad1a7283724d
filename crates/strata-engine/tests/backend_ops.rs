//! Every op of the device seam (`strata_backend::Backend`) is run on CUDA against the CPU
//! backend on random inputs by the CUDA suite (`tests/cuda/`: attention, elementwise, moe,
//! products, graphs, tiers; run on the GPU machine by scripts/device/gpu-check.sh), as
//! llama.cpp's test-backend-ops does. This test, which needs no GPU, keeps that true: each
//! method of the trait is either called there or named below as a query with nothing to
//! compute, so a new op cannot land without its CUDA comparison.

use std::path::Path;

/// Methods that compute nothing (names, sizes, host views): no device comparison applies.
const QUERIES: [&str; 6] = ["describe", "prefill_chunk", "parallelism", "reserve_workspace", "mat_shape", "host"];

#[test]
fn every_backend_op_has_a_cuda_comparison() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = std::fs::read_to_string(root.join("../strata-backend/src/lib.rs")).unwrap();
    let body = &lib[lib.find("pub trait Backend").expect("the Backend trait")..];
    let body = &body[..body.find("\n}\n").expect("the trait's end")];
    let ops: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("    fn "))
        .map(|l| l.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).next().unwrap())
        .collect();
    assert!(ops.len() > 30, "parsed {} methods of Backend: {ops:?}", ops.len());
    let mut tests = String::new();
    for e in std::fs::read_dir(root.join("tests/cuda")).unwrap() {
        tests += &std::fs::read_to_string(e.unwrap().path()).unwrap();
    }
    let missing: Vec<&&str> =
        ops.iter().filter(|op| !QUERIES.contains(op) && !tests.contains(&format!(".{op}("))).collect();
    assert!(missing.is_empty(), "Backend ops without a CUDA comparison in tests/cuda: {missing:?}");
    for q in QUERIES {
        assert!(ops.contains(&q), "QUERIES names {q}, which Backend no longer has");
    }
}
