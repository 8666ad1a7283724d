//! AFL harness: `strata_fuzz::tiktoken`.
fn main() {
    afl::fuzz!(|data: &[u8]| strata_fuzz::tiktoken(data));
}
