# Sourced by the GPU scripts, run from the repository root: the carried binaries' folder
# (C), the results folder (OUT), the CUDA libraries on the path, the binaries unpacked.
# STALL_S is the script's default for STRATA_TEST_STALL_S: a fixture test that stalls
# aborts after that long, naming its phase (and, with STRATA_CUDA_WATCHDOG=SECONDS, the
# kernel that did not finish) instead of eating the timeout.
C=.devcarry
OUT=${OUT:-/tmp/strata-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/lib64:${LD_LIBRARY_PATH:-}
export STRATA_PTX_CACHE=/tmp/strata-ptx STRATA_REQUIRE_GPU=1 STRATA_REPO_ROOT=$PWD RUST_BACKTRACE=1
export STRATA_TEST_STALL_S=${STRATA_TEST_STALL_S:-${STALL_S:-90}} PYTHONUNBUFFERED=1
for f in strata cuda-tests; do
  [ -f "$C/$f.xz" ] && xz -d -k -f "$C/$f.xz" && chmod +x "$C/$f"
done
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
