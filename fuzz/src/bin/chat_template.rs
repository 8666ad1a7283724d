//! AFL harness: `strata_fuzz::chat_template`.
fn main() {
    afl::fuzz!(|data: &[u8]| strata_fuzz::chat_template(data));
}
