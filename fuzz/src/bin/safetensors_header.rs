//! AFL harness: `strata_fuzz::safetensors_header`.
fn main() {
    afl::fuzz!(|data: &[u8]| strata_fuzz::safetensors_header(data));
}
