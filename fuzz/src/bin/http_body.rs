//! AFL harness: `strata_fuzz::http_body`.
fn main() {
    afl::fuzz!(|data: &[u8]| strata_fuzz::http_body(data));
}
