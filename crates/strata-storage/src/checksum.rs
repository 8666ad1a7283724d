//! Expert-region checksums: xxh3-64 over the bytes one expert read brings into a slot
//! (its segments' bytes in segment order, a covering read's overhang past the end of
//! the file included as the zeros the I/O pool writes there).
//!
//! strata's container records them per region when converting (manifest field
//! `checksums`, absent in older manifests, which still open unverified). The public
//! Colibri container has none: they are computed once on first use and kept in a
//! sidecar file (see [`crate::colibri`]). The I/O pool verifies a read carrying a
//! [`ReadCheck`] after its bytes land and fails the read on a mismatch, naming the file
//! and the expert, so a damaged expert never reaches compute.

use xxhash_rust::xxh3::{xxh3_64, Xxh3};

/// The algorithm's name in manifests and sidecars.
pub const CHECKSUM_ALGORITHM: &str = "xxh3-64";

/// The checksum of one region held in one slice.
pub fn region_checksum(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

/// The checksum of a region held in several slices, in order (equal to
/// [`region_checksum`] of their concatenation).
pub fn parts_checksum<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    let mut h = Xxh3::new();
    for p in parts {
        h.update(p);
    }
    h.digest()
}

/// What a read must hash to, and what to call it in an error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadCheck {
    pub expected: u64,
    /// E.g. `layer 3 expert 17` (the pool adds the file).
    pub label: String,
    /// The destination ranges `(offset, len)` hashed, in order; empty: the segments'
    /// destination bytes in segment order. (A Colibri covering read also brings in
    /// neighbouring bytes; only the expert's own tensors are checked.)
    pub ranges: Vec<(usize, usize)>,
}

impl ReadCheck {
    pub fn new(expected: u64, label: impl Into<String>) -> Self {
        Self { expected, label: label.into(), ranges: Vec::new() }
    }

    /// Checks only `ranges` of the destination.
    pub fn with_ranges(mut self, ranges: Vec<(usize, usize)>) -> Self {
        self.ranges = ranges;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_hash_like_the_whole() {
        let bytes: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let whole = region_checksum(&bytes);
        assert_eq!(parts_checksum([&bytes[..10], &bytes[10..4096], &bytes[4096..]]), whole);
        assert_ne!(region_checksum(&bytes[1..]), whole);
    }
}
