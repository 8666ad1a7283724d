//! Cost of a pool region (dispatch + join) and of a barrier inside one.
//! cargo run --release -p strata-kernels --example pool_bench -- [threads]
use std::time::Instant;
use strata_kernels::pool::ThreadPool;

fn main() {
    let threads: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let pool = ThreadPool::new(threads);
    let n = 20000;
    for _ in 0..3 {
        let t = Instant::now();
        for _ in 0..n {
            pool.run(&|_| {});
        }
        let region = t.elapsed().as_secs_f64() / n as f64 * 1e6;
        let t = Instant::now();
        pool.run(&|c| {
            for _ in 0..n {
                c.barrier();
            }
        });
        let barrier = t.elapsed().as_secs_f64() / n as f64 * 1e6;
        println!("{threads} threads: region {region:.2} us, barrier {barrier:.2} us");
    }
}
