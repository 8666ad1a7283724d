//! AFL harness: `strata_fuzz::colibri`.
fn main() {
    afl::fuzz!(|data: &[u8]| strata_fuzz::colibri(data));
}
