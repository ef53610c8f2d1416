#!/usr/bin/env bash
# fuzz.sh - runs the cargo-fuzz targets (fuzz/): mount_image (mount + fsck + reads of images
# made from arbitrary bytes), log_record (record decoding and replay of arbitrary log bytes),
# structured_image (a valid image with one node, superblock or log record mutated field by
# field and re-checksummed, then mounted, checked, read, changed and remounted), c_abi (the C
# ABI under arbitrary call programs). Usage: scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...].
# Needs a nightly toolchain (rustup toolchain install nightly) and cargo-fuzz (installed here
# if missing). Crashes are saved under fuzz/artifacts/<target>/; the corpus
# grows in fuzz/corpus/<target>/. The seeded regression tests of the same harnesses
# (engine/tests/fuzz_inputs.rs, bindings/tests/fuzz_abi.rs) run in scripts/test.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
seconds=${1:-60}
shift || true
targets=("$@")
((${#targets[@]})) || targets=(mount_image log_record structured_image c_abi)
rustup toolchain list | grep -q nightly || {
  echo "fuzz.sh: needs a nightly toolchain: rustup toolchain install nightly" >&2
  exit 1
}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked >&2
for t in "${targets[@]}"; do
  echo "== fuzzing $t for ${seconds}s" >&2
  log=$(mktemp)
  if cargo +nightly fuzz run "$t" --fuzz-dir fuzz -- -max_total_time="$seconds" -rss_limit_mb=4096 \
      -max_len=65536 >"$log" 2>&1; then
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || true)
    [[ -n $execs ]] || execs=$(grep -oE '#[0-9]+' "$log" | tail -1 | tr -d '#')
    echo "ok   $t: ${execs:-?} executions in ${seconds}s, no crash"
  else
    echo "FAIL $t: see below (the input is in fuzz/artifacts/$t/)"
    tail -40 "$log"
    rm -f "$log"
    exit 1
  fi
  rm -f "$log"
done
