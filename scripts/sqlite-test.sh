#!/usr/bin/env bash
# sqlite-test.sh - builds the corefs SQLite VFS (bindings/sqlite) and tests it: transactions
# with a second in-process connection in WAL and rollback-journal modes, the stock sqlite3
# shell loading the extension, and a power cut (kill -9 of a process whose image sits behind a
# simulated volatile write cache) in the middle of a write load.
# Then four sqlite3 processes sharing one database through `corefs serve`.
# Modes: wal, delete (rollback journal) and batch (rollback journal with batch atomic writes:
# no journal, each transaction one corefs atomic batch; test_sqlite checks that they were used).
# Needs gcc, libsqlite3-dev and the sqlite3 shell; images live under /var/tmp (O_DIRECT).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD

command -v sqlite3 >/dev/null || { echo "sqlite-test.sh: sqlite3 not found" >&2; exit 1; }
# The power cuts sit behind the simulated volatile cache (`cache=volatile`), which only a
# library built with the `sim` feature has.
COREFS_LIB_FEATURES=sim scripts/sqlite-build.sh

test_bin=$root/target/release/test_sqlite
work=$(mktemp -d /var/tmp/corefs-sqlite-test.XXXXXX)
crash_pid=
serve_pid=
cleanup() {
  if [[ -n $crash_pid ]]; then kill -9 "$crash_pid" 2>/dev/null || true; fi
  if [[ -n $serve_pid ]]; then kill -9 "$serve_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

failures=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# 1 GiB (sparse): a file's blocks come from one of the 64 shards, 16 MiB each here.
device() { echo "file:$work/$1.img,size=1GiB"; }

# (a) transactions, then a check in a new process.
for mode in wal delete batch; do
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

# (c) a power cut inside a batch, at the worst moment: test_sqlite commits 20 transactions in
# batch mode, then, in the 21st's batch, right after its 2nd page write, commits the filesystem
# (as the commit timer may at any time) and exits without flushing the volatile cache. The
# batch's staged writes are not in that commit, so the image must hold exactly the 20
# transactions. Deterministic: with the VFS writing a batch's pages one by one
# (-DCOREFS_VFS_MUTATION_UNSTAGED_BATCH) the commit persists the new row without its agg
# update and check fails every time.
dev=$(device tear)
if out=$(COREFS_DEVICE=$dev,cache=volatile COREFS_FORMAT=1 "$test_bin" tear 20 2     2>"$work/tear.err") && [[ $out == *"torn after write 2 of a batch (corefs_sync: 0)" ]] &&
    [[ $(grep -c '^committed ' <<<"$out") == 20 ]]; then
  if res=$(COREFS_DEVICE=$dev "$test_bin" check 20 2>"$work/tear-check.err") &&
      [[ $res == "ok 20" ]]; then
    pass "power cut inside a batch after its 2nd write and a filesystem commit: check: $res"
  else
    fail "power cut inside a batch: check: '${res:-}' $(tail -n 5 "$work/tear-check.err")"
  fi
else
  fail "tear: '$(tail -n 2 <<<"${out:-}")' $(tail -n 5 "$work/tear.err")"
fi

# (d) a power cut during a write load: the image is used with cache=volatile (unflushed writes
# stay in the process, as in a drive's volatile cache), so kill -9 after at least 300 commits
# (a random number between 300 and 999, so that the kill lands at varying points, e.g. around
# WAL checkpoints) loses exactly what was not flushed; everything reported committed must be
# there when the image is opened again (without the cache).
# batch runs with a 1 ms commit interval, so transaction commits land between any two
# operations of the reactor, and three times: with the pages of a batch written one by one
# (-DCOREFS_VFS_MUTATION_UNSTAGED_BATCH) a kill finds the database torn only when it lands
# between such a commit and the transaction's fsync (3 of 14 runs did; (c) is the
# deterministic check).
for mode in wal delete batch batch batch; do
  want=$((300 + RANDOM % 700))
  run=$((${run:-0} + 1))
  dev=$(device "crash-$run-$mode")
  # Made before the writer starts: the wait below must not read an earlier run's output.
  out=$work/crash-$run-$mode.out
  : >"$out"
  interval=
  [[ $mode == batch ]] && interval=1
  COREFS_DEVICE=$dev,cache=volatile COREFS_FORMAT=1 COREFS_COMMIT_INTERVAL_MS=$interval \
    "$test_bin" write "$mode" 100000 >"$out" 2>"$work/crash-$run-$mode.err" &
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
    fail "crash $mode: the writer ended before $want commits: $(tail -n 5 "$work/crash-$run-$mode.err")"
    continue
  fi
  wait "$crash_pid" 2>/dev/null || true
  crash_pid=
  k=$(grep -E '^committed [0-9]+$' "$out" | tail -n 1 | cut -d' ' -f2)
  if [[ -z $k ]] || ((k < 300)); then
    fail "crash $mode: only '${k}' commits before the kill"
    continue
  fi
  if res=$(COREFS_DEVICE=$dev "$test_bin" check "$k" 2>"$work/crash-check-$run-$mode.err"); then
    pass "crash $mode: killed after commit $k, check: $res"
  else
    fail "crash $mode: killed after commit $k, check: '${res:-}' $(tail -n 5 "$work/crash-check-$run-$mode.err")"
  fi
done

# (e) through a corefs server (`corefs serve`, COREFS_DEVICE=serve:SOCKET): four sqlite3 shell
# processes write one database at once, each transaction under its own lock; every row must
# land once. The VFS takes SQLite's process-level locks with corefs_setlk, which the server
# keeps across its clients. Rollback journal first (the default mode), then (f) WAL, whose
# index the processes share through a POSIX shared memory object.
[[ -n ${COREFS_BIN:-} ]] || cargo build --release --locked -p corefs-cli >&2
corefs_bin=${COREFS_BIN:-$root/target/release/corefs}
srv_dev="file:$work/served.img"
"$corefs_bin" mkfs "$srv_dev" --size 256MiB >/dev/null 2>&1
sock=$work/corefs.sock
"$corefs_bin" serve "$srv_dev" --socket "$sock" 2>"$work/serve.err" &
serve_pid=$!
for _ in $(seq 100); do [[ -S $sock ]] && break; sleep 0.1; done
served() {
  COREFS_DEVICE=serve:$sock sqlite3 -cmd ".load $ext" -cmd ".open file:/shared.db?vfs=corefs" \
    -cmd ".timeout 30000" :memory: "$@"
}
served "create table t(k, r, v);" >/dev/null
writers=()
for k in 1 2 3 4; do
  (for r in $(seq 1 10); do
    served "begin immediate; insert into t select $k, $r, randomblob(100) from generate_series(1,50); commit;" \
      >>"$work/served-$k.out" 2>&1
  done) &
  writers+=($!)
done
wait "${writers[@]}" || true
out=$(served "pragma integrity_check; select count(*), count(distinct k * 100 + r) from t; pragma journal_mode;" 2>&1)
errors=$(cat "$work"/served-*.out)
if [[ $out == $'ok\n2000|40\ndelete' && -z $errors ]]; then
  pass "through corefs serve: 4 sqlite3 processes x 10 transactions, all 2000 rows once, integrity ok (rollback journal)"
else
  fail "through corefs serve: '$out' ${errors:0:300}"
fi

# (f) WAL across processes: four writer processes (10 transactions of 50 rows each, in one
# process each), a reader process counting all along (every count it sees is whole
# transactions: multiples of 10 rows), and a writer of 10-row transactions killed with
# SIGKILL a second into its 100,000 (its committed transactions stay, none half, its locks go
# with it); then one more writer and the checks. The WAL index is shared memory of the client processes
# (/dev/shm/corefs-wal-*), gone once the last of them closes the database.
shm_before=$(ls /dev/shm | grep '^corefs-wal-' | sort || true)
served "create table w(k, r, v); pragma journal_mode=wal;" >"$work/wal-mode.out" 2>&1
writers=()
for k in 1 2 3 4; do
  (for r in $(seq 1 10); do
    echo "begin immediate; insert into w select $k, $r, randomblob(100) from generate_series(1,50); commit;"
  done | served >>"$work/wal-$k.out" 2>&1) &
  writers+=($!)
done
seq 1 100000 | awk '{ print "begin immediate; insert into w select 9, " $1 ", randomblob(10) from generate_series(1,10); commit;" }' >"$work/wal-killed.sql"
COREFS_DEVICE=serve:$sock sqlite3 -cmd ".load $ext" -cmd ".open file:/shared.db?vfs=corefs" \
  -cmd ".timeout 30000" :memory: <"$work/wal-killed.sql" >"$work/wal-killed.out" 2>&1 &
killed=$!
(for _ in $(seq 1 40); do echo "select count(*) from w;"; done | served >"$work/wal-reads.out" 2>&1) &
reader=$!
sleep 1
kill -KILL "$killed" 2>/dev/null || true
wait "$killed" 2>/dev/null || true
wait "${writers[@]}" "$reader" || true
served "insert into w select 5, 1, randomblob(100) from generate_series(1,50);" >"$work/wal-5.out" 2>&1
out=$(served "pragma integrity_check; select count(*), count(distinct k * 100000 + r) from w where k < 9; select count(*) % 10, count(*) / 10 from w where k = 9; pragma journal_mode;" 2>&1)
errors=$(cat "$work"/wal-[1-5].out)
bad_reads=$(awk '$1 % 10 != 0' "$work/wal-reads.out")
killed_rows=$(echo "$out" | sed -n 3p)
# The last process to close the database removed its WAL index (SQLite closes it with
# deletion once it checkpointed everything).
shm_left=$(comm -13 <(echo "$shm_before") <(ls /dev/shm | grep '^corefs-wal-' | sort || true))
if [[ $(echo "$out" | sed -n 1,2p) == $'ok\n2050|41' && ${killed_rows%%|*} == 0 &&
      ${killed_rows#*|} -gt 0 && ${killed_rows#*|} -lt 100000 &&
      $(echo "$out" | sed -n 4p) == wal && $(cat "$work/wal-mode.out") == wal &&
      -z $errors && -z $bad_reads && -s $work/wal-reads.out && -z $shm_left ]]; then
  pass "WAL through corefs serve: 4 writer processes x 10 transactions and a reader, a writer killed after ${killed_rows#*|} transactions: all rows once, reads whole transactions, integrity ok"
else
  fail "WAL through corefs serve: '$out' mode '$(cat "$work/wal-mode.out")' reads '${bad_reads:0:100}' left in /dev/shm '$shm_left' ${errors:0:300}"
fi
kill -TERM "$serve_pid"
stopped=0
wait "$serve_pid" || stopped=$?
serve_pid=
if ((stopped == 0)) && "$corefs_bin" fsck "$srv_dev" >/dev/null 2>&1; then
  pass "corefs serve stopped cleanly; fsck clean"
else
  fail "corefs serve stop or fsck: $(tail -n 3 "$work/serve.err")"
fi

if ((failures)); then
  echo "sqlite-test.sh: $failures FAILED"
  exit 1
fi
echo "sqlite-test.sh: all passed"
