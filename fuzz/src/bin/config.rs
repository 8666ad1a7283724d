//! AFL harness: `strata_fuzz::config`.
fn main() {
    afl::fuzz!(|data: &[u8]| strata_fuzz::config(data));
}
