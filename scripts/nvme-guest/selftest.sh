#!/usr/bin/env bash
# selftest.sh - end-to-end check of the NVMe guest harness.
#
# Compiles selftest.c statically and runs it through run.sh:
#   1. --lba 512  expecting LBA size 512          (must exit 0)
#   2. --lba 4096 expecting LBA size 4096         (must exit 0)
#   3. --lba 4096 expecting 512                   (must exit 1: exit-code propagation)
#   4. --poll-queues 2 --dmesg                    (must exit 0 and the guest dmesg
#      must report ".../2 default/read/poll queues")
# Exits 0 iff all checks pass.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/nvme-selftest.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
command -v gcc >/dev/null || { echo "selftest.sh: gcc not found" >&2; exit 1; }
gcc -static -O2 -Wall -Wextra -Werror -o "$WORK/selftest" "$HERE/selftest.c"

fails=0
check() { # check NAME EXPECTED_RC RUN_ARGS... -- TEST_ARGS...
  local name=$1 want=$2 rc=0; shift 2
  "$HERE/run.sh" "$WORK/selftest" "$@" >"$WORK/$name.out" 2>"$WORK/$name.err" || rc=$?
  sed "s/^/  [$name] /" "$WORK/$name.out"
  grep -h 'boot+test+poweroff' "$WORK/$name.err" | sed "s/^run.sh: /  [$name] /" || true
  if [[ $rc != "$want" ]]; then
    echo "selftest.sh: FAIL $name: exit $rc, expected $want" >&2
    sed "s/^/  [$name] /" "$WORK/$name.err" >&2
    fails=$((fails + 1))
    return 1
  fi
  echo "selftest.sh: ok   $name"
}

check lba512 0 --lba 512 -- 512 || true
check lba4096 0 --lba 4096 -- 4096 || true
check mismatch 1 --lba 4096 -- 512 || true
if check poll 0 --poll-queues 2 --dmesg -- 512; then
  if grep -Eq '[0-9]+/[0-9]+/2 default/read/poll queues' "$WORK/poll.err"; then
    echo "selftest.sh: ok   poll queues: $(grep -Eo '[0-9]+/[0-9]+/[0-9]+ default/read/poll queues' "$WORK/poll.err")"
  else
    echo "selftest.sh: FAIL poll: guest dmesg does not show 2 poll queues:" >&2
    sed 's/^/  [poll] /' "$WORK/poll.err" >&2
    fails=$((fails + 1))
  fi
fi
if ((fails)); then echo "selftest.sh: $fails check(s) FAILED" >&2; exit 1; fi
echo "selftest.sh: all checks passed"
