#!/usr/bin/env bash
# Coverage-guided fuzzing with AFL++ (cargo-afl, stable Rust) of one target of
# crates/strata-fuzz, for SECONDS seconds, at the lowest CPU priority.
#
#   scripts/fuzz.sh TARGET SECONDS
#
# Targets: safetensors_header container_manifest colibri ledger config chat_template
# http_body tiktoken. Needs `cargo install cargo-afl` (the first run builds AFL++'s runtime).
# Seeds: fuzz/corpus/TARGET; dictionary (if any): fuzz/dict/TARGET.dict; findings: fuzz/out/TARGET/default/{crashes,hangs}; a run
# resumes where the last one stopped. Turn every crash into fuzz/regressions/TARGET/<name>
# (replayed by `cargo test -p strata-fuzz`) and fix it. Set STRATA_CARGO_LOCK to a lock
# file to serialise the build with other cargo runs (flock).
set -euo pipefail
if [ $# -ne 2 ]; then
    echo "usage: $0 TARGET SECONDS" >&2
    exit 2
fi
target=$1
seconds=$2
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root/fuzz"
if [ ! -f "src/bin/$target.rs" ]; then
    echo "error: unknown target '$target' (have: $(ls src/bin | sed 's/\.rs$//' | tr '\n' ' '))" >&2
    exit 2
fi
build=(cargo afl build --release --bin "$target")
if [ -n "${STRATA_CARGO_LOCK:-}" ]; then
    flock "$STRATA_CARGO_LOCK" nice -n 19 "${build[@]}"
else
    nice -n 19 "${build[@]}"
fi
out="$root/fuzz/out/$target"
mkdir -p "$out"
dict=()
if [ -f "dict/$target.dict" ]; then
    dict=(-x "dict/$target.dict")
fi
AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_NO_UI=1 AFL_AUTORESUME=1 \
    AFL_NO_AFFINITY=1 nice -n 19 cargo afl fuzz -V "$seconds" -t 2000 -m 4096 \
    "${dict[@]}" -i "corpus/$target" -o "$out" "target/release/$target" >"$out/afl.log" 2>&1 || {
    echo "afl-fuzz failed; see $out/afl.log" >&2
    tail -20 "$out/afl.log" >&2
    exit 1
}
stats="$out/default/fuzzer_stats"
echo "$target: $(grep -E '^(execs_done|execs_per_sec|saved_crashes|saved_hangs|corpus_count)' "$stats" | tr -s ' ' | tr '\n' ' ')"
