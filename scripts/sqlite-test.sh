#!/usr/bin/env bash
# sqlite-test.sh - builds the corefs SQLite VFS (bindings/sqlite) and tests it: transactions
# with a second in-process connection in WAL and rollback-journal modes, the stock sqlite3
# shell loading the extension, and a power cut (kill -9 of a process whose image sits behind a
# simulated volatile write cache) in the middle of a write load.
# Needs gcc, libsqlite3-dev and the sqlite3 shell; images live under /var/tmp (O_DIRECT).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD

command -v sqlite3 >/dev/null || { echo "sqlite-test.sh: sqlite3 not found" >&2; exit 1; }
scripts/sqlite-build.sh

test_bin=$root/target/release/test_sqlite
work=$(mktemp -d /var/tmp/corefs-sqlite-test.XXXXXX)
crash_pid=
cleanup() {
  if [[ -n $crash_pid ]]; then kill -9 "$crash_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

failures=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# 1 GiB (sparse): a file's blocks come from one of the 64 shards, 16 MiB each here.
device() { echo "file:$work/$1.img,size=1GiB"; }

# (a) transactions, then a check in a new process.
for mode in wal delete; do
  dev=$(device "txn-$mode")
  if COREFS_DEVICE=$dev COREFS_FORMAT=1 "$test_bin" write "$mode" 2000 >"$work/write-$mode.out" \
      2>"$work/write-$mode.err"; then
    last=$(grep -E '^committed [0-9]+$' "$work/write-$mode.out" | tail -n 1 | cut -d' ' -f2)
    if [[ $last == 2000 ]]; then
      pass "write $mode: 2000 transactions with a second connection ($(tail -n 1 "$work/write-$mode.err" | sed 's/^test_sqlite: //'))"
    else
      fail "write $mode: last committed is '${last}', expected 2000"
    fi
  else
    fail "write $mode exited $?: $(tail -n 5 "$work/write-$mode.err")"
  fi
  if out=$(COREFS_DEVICE=$dev "$test_bin" check 2000 2>"$work/check-$mode.err") &&
      [[ $out == "ok 2000" ]]; then
    pass "check $mode: $out"
  else
    fail "check $mode: '${out:-}' $(tail -n 5 "$work/check-$mode.err")"
  fi
done

# (b) the stock sqlite3 shell with the loadable extension. The shell opens the database named
# on its command line before it runs -cmd, when the corefs VFS is not registered yet ("no such
# vfs"), so it starts on :memory:, loads the extension there and then .opens the database.
dev=$(device shell)
ext=$root/target/release/libcorefs_sqlite
shell_db="file:/shell.db?vfs=corefs"
if out=$(COREFS_DEVICE=$dev COREFS_FORMAT=1 sqlite3 -cmd ".load $ext" -cmd ".open $shell_db" :memory: \
    "create table x(a); insert into x values(42); select a from x;" 2>&1) && [[ $out == 42 ]]; then
  pass "sqlite3 shell: create and insert through .load, prints $out"
else
  fail "sqlite3 shell (write): '$out'"
fi
if out=$(COREFS_DEVICE=$dev sqlite3 -cmd ".load $ext" -cmd ".open $shell_db" :memory: \
    "select a from x;" 2>&1) && [[ $out == 42 ]]; then
  pass "sqlite3 shell: read back in a new process, prints $out"
else
  fail "sqlite3 shell (read back): '$out'"
fi

# (c) a power cut during a write load: the image is used with cache=volatile (unflushed writes
# stay in the process, as in a drive's volatile cache), so kill -9 after at least 300 commits
# (a random number between 300 and 999, so that the kill lands at varying points, e.g. around
# WAL checkpoints) loses exactly what was not flushed; everything reported committed must be
# there when the image is opened again (without the cache).
for mode in wal delete; do
  want=$((300 + RANDOM % 700))
  dev=$(device "crash-$mode")
  out=$work/crash-$mode.out
  COREFS_DEVICE=$dev,cache=volatile COREFS_FORMAT=1 "$test_bin" write "$mode" 100000 >"$out" \
    2>"$work/crash-$mode.err" &
  crash_pid=$!
  deadline=$((SECONDS + 300))
  while :; do
    lines=$(grep -c '^committed ' "$out" || true)
    ((lines >= want)) && break
    if ! kill -0 "$crash_pid" 2>/dev/null || ((SECONDS > deadline)); then break; fi
    sleep 0.05
  done
  if ! kill -9 "$crash_pid" 2>/dev/null; then
    wait "$crash_pid" || true
    crash_pid=
    fail "crash $mode: the writer ended before $want commits: $(tail -n 5 "$work/crash-$mode.err")"
    continue
  fi
  wait "$crash_pid" 2>/dev/null || true
  crash_pid=
  k=$(grep -E '^committed [0-9]+$' "$out" | tail -n 1 | cut -d' ' -f2)
  if [[ -z $k ]] || ((k < 300)); then
    fail "crash $mode: only '${k}' commits before the kill"
    continue
  fi
  if res=$(COREFS_DEVICE=$dev "$test_bin" check "$k" 2>"$work/crash-check-$mode.err"); then
    pass "crash $mode: killed after commit $k, check: $res"
  else
    fail "crash $mode: killed after commit $k, check: '${res:-}' $(tail -n 5 "$work/crash-check-$mode.err")"
  fi
done

if ((failures)); then
  echo "sqlite-test.sh: $failures FAILED"
  exit 1
fi
echo "sqlite-test.sh: all passed"
