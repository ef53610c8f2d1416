#!/usr/bin/env bash
# test-nvme-guest.sh - the NVMe passthrough backend tested for real: builds the static
# nvme-guest-test binary and runs it inside a QEMU guest with an emulated NVMe controller
# (scripts/nvme-guest/run.sh), over a matrix of LBA formats, poll queues and hugepages.
# Prints one line per configuration and a closing "N passed, M failed" line; exits non-zero
# if any configuration failed. Never skips: a missing piece is a failure.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

target=x86_64-unknown-linux-gnu
echo "nvme-guest: building the static test binary..." >&2
RUSTFLAGS="-C target-feature=+crt-static" cargo build --release --locked --target "$target" \
  -p corefs-nvme --bin nvme-guest-test >&2
bin="target/$target/release/nvme-guest-test"

# lba  poll_queues  expect_polled  kernel_args       expected_pool
configs=(
  "4096 0 no  -                 anonymous"
  "512  0 no  -                 anonymous"
  "4096 2 yes hugepages=16      hugepages"
  "512  1 yes -                 anonymous"
)
passed=0 failed=0
# run.sh warns when the emulated controller left commands uncompleted until the driver's
# timeout; a passing run says so too, so the logs show how often the emulator stalls.
stall_mark='warning: the emulated controller'
stalled() { grep -h "$stall_mark" "$1" | sed 's/^run.sh: warning: /     note: /; s/:$//' || true; }
# The emulated controller (QEMU 7.2 under TCG) now and then leaves commands of an I/O queue
# uncompleted, most often just after a controller reset (in about one guest run of six here).
# Should that meet the reset the device test makes, the driver, still waiting for the queue to
# drain, times the command out, gives the controller up and removes /dev/ng0n1: the reset
# check reads ENODEV and every check after it fails. That is the emulator's fault, not the
# backend's, so a configuration that failed *and* whose guest logged such a stall runs once
# more, and says so; a failure without a stall, or a second failure, fails.
for config in "${configs[@]}"; do
  read -r lba pq polled append pool <<<"$config"
  [[ $append == - ]] && append=""
  name="lba=$lba poll_queues=$pq${append:+ $append}"
  log=$(mktemp)
  for attempt in 1 2; do
    if scripts/nvme-guest/run.sh "$bin" --lba "$lba" --poll-queues "$pq" --append "$append" \
        -- /dev/ng0n1 "$lba" "$polled" "$pool" >"$log" 2>&1; then
      passed=$((passed + 1))
      echo "ok   nvme passthrough in guest ($name): $(grep -c '^ok ' "$log") checks"
      stalled "$log"
      break
    elif ((attempt == 1)) && grep -q "$stall_mark" "$log"; then
      echo "rerun nvme passthrough in guest ($name): it failed after the emulator stalled:"
      grep -E '^(FAIL|run\.sh: +\[)' "$log" | sed 's/^/    /'
    else
      failed=$((failed + 1))
      echo "FAIL nvme passthrough in guest ($name):"
      sed 's/^/    /' "$log"
      break
    fi
  done
  rm -f "$log"
done

# The benchmark suite on NVMe passthrough (issue 7: corefs on each backend through its public
# API): every workload must run and report on the corefs-nvme target. Speeds under TCG mean
# nothing; this checks that the suite works on the backend.
# The emulated controller's stalls (above) hit this run too (in about one randread-qd32 run of
# four, 4 to 32 reads never complete until the driver resets the controller). The backend
# sends the commands a reset cancels again (nvme/src/backend/passthrough/retry.rs), so the run
# passes; a 5 s I/O timeout (the driver's default is 30 s) keeps such a run to ~11 s, not ~65 s.
echo "nvme-guest: building the static corefs tool..." >&2
RUSTFLAGS="-C target-feature=+crt-static" cargo build --release --locked --target "$target" \
  -p corefs-cli >&2
log=$(mktemp)
if scripts/nvme-guest/run.sh "target/$target/release/corefs" --lba 4096 --ns-mib 512 --mem 1024 \
    --io-timeout 5 --timeout 400 -- bench suite --targets corefs:nvme:/dev/ng0n1 --seconds 0.3 \
    --write-file-size 1MiB --read-file-size 8MiB --seq-file-size 32MiB --writers 2 \
    --dbench-clients 2 --create-clients 2 --out /tmp/out --dir /tmp >"$log" 2>&1 &&
  rows=$(grep -cE '^(append-fdatasync|randwrite-4k-fsync8|fsync-writers-64k|creates|dbench|abi-open-close|abi-stat|randread-qd1|randread-qd32|seq-write-1m|seq-read-1m|copy-tree) +corefs-nvme +[0-9]' "$log") &&
  [[ $rows == 12 ]]; then
  passed=$((passed + 1))
  echo "ok   bench suite on NVMe passthrough in guest: 12 workloads reported"
  stalled "$log"
else
  failed=$((failed + 1))
  echo "FAIL bench suite on NVMe passthrough in guest:"
  sed 's/^/    /' "$log"
fi
rm -f "$log"
echo "nvme-guest: $passed passed, $failed failed"
[[ $failed == 0 ]]
