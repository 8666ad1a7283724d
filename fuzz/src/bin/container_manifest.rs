//! AFL harness: `strata_fuzz::container_manifest`.
fn main() {
    afl::fuzz!(|data: &[u8]| strata_fuzz::container_manifest(data));
}
