# Sourced by the GPU scripts, run from the repository root: the carried binaries' folder
# (C), the results folder (OUT), the CUDA libraries on the path, the binaries unpacked.
# STALL_S is the script's default for STRATA_TEST_STALL_S: a fixture test that stalls
# aborts after that long, naming its phase (and, with STRATA_TEST_WATCHDOG_S=SECONDS, the
# kernel that did not finish) instead of eating the timeout.
C=.devcarry
OUT=${OUT:-/tmp/strata-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/lib64:${LD_LIBRARY_PATH:-}
export STRATA_PTX_CACHE=/tmp/strata-ptx STRATA_REQUIRE_GPU=1 STRATA_REPO_ROOT=$PWD RUST_BACKTRACE=1
export STRATA_TEST_STALL_S=${STRATA_TEST_STALL_S:-${STALL_S:-90}} PYTHONUNBUFFERED=1
for f in strata strata-bench cuda-tests; do
  [ -f "$C/$f.xz" ] && xz -d -k -f "$C/$f.xz" && chmod +x "$C/$f"
done
# A GLM-5-shaped slice at $1 (1 dense + 1 MoE layer of GLM-5-sized experts, bf16; $2 the
# vocabulary, 16384, $3 the experts, 48) and its int4-expert conversion at $1-int4, each
# written unless it is there.
glm5_slice() {
  [ -d "$1" ] || timeout 200 $C/strata-bench synth --out "$1" --preset glm5 --layers 2 --dense-layers 1 \
    --experts "${3:-48}" --vocab "${2:-16384}" >>"$OUT/side.log" 2>&1
  [ -d "$1-int4" ] || timeout 200 $C/strata convert --model "$1" --out "$1-int4" --experts int4 --scales f32 >>"$OUT/side.log" 2>&1
}
# The path of another carried binary, .devcarry/$1 (unpacked from $1.xz), for A/B variants
# (BIN=NAME); an error line naming it when it is not carried.
carried_bin() {
  local b=$C/$1
  [ -f "$b.xz" ] && [ ! -f "$b" ] && xz -d -k "$b.xz" && chmod +x "$b"
  [ -x "$b" ] || { echo "BIN=$1: no binary $b (nor $b.xz)" >&2; return 1; }
  echo "$b"
}
# Progress lines: seconds since the script started.
t_start=$(date +%s)
since() { echo "[$(($(date +%s) - t_start)) s] $*"; }
# The CUDA test suite into $OUT/tests.log (strata-tiny skipped with TINY=0, and each name
# in SKIP_TESTS_MATCHING); prints the lines matching $1 (default: failures and results).
cuda_tests() {
  local skip=() s
  [ "${TINY:-1}" = 1 ] || skip+=(--skip strata_tiny)
  for s in ${SKIP_TESTS_MATCHING:-}; do skip+=(--skip "$s"); done
  since "tests"
  timeout 300 $C/cuda-tests --test-threads=1 --nocapture "${skip[@]}" 2>&1 | tee "$OUT/tests.log" |
    grep -E "${1:-^test .*FAILED|test result|panicked|STALL}"
}
# The CUDA tests (unless TESTS=0), then the GLM-5-shaped slice at $slice (/tmp/slice48;
# with VOCAB=N other than 16384, /tmp/slice48-vN of that vocabulary) and its int4 conversion.
tests_then_slice() {
  [ "${TESTS:-1}" = 1 ] && cuda_tests | head -20
  local v=${VOCAB:-16384}
  slice=/tmp/slice48
  [ "$v" = 16384 ] || slice=/tmp/slice48-v$v
  since "slices"
  glm5_slice $slice "$v"
}
