//! AFL harness: `strata_fuzz::ledger`.
fn main() {
    afl::fuzz!(|data: &[u8]| strata_fuzz::ledger(data));
}
