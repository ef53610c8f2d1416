#!/usr/bin/env bash
# rocksdb-test.sh - builds the corefs RocksDB FileSystem (bindings/rocksdb) and tests it:
# a functional test (the corefs:// URI, put/get/delete, iteration, flush and compaction, which
# make RocksDB create, rename and delete files, direct reads, a reopen after a full unmount)
# and power cuts: a child writes with sync=true on an image behind the simulated volatile
# write cache (cache=volatile) and is killed with SIGKILL at a random point; every key it had
# acknowledged must be there with its value after reopening; and two processes sharing one
# database through `corefs serve` (the LOCK file keeps the second out while the first has it
# open, and goes with a killed holder). Each crash run prints its seed;
# COREFS_ROCKSDB_SEEDS="1 2 3" repeats given ones. Needs g++ and librocksdb-dev; images live
# under /var/tmp (O_DIRECT).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD

# The power cuts sit behind the simulated volatile cache (`cache=volatile`), which only a
# library built with the `sim` feature has.
COREFS_LIB_FEATURES=sim scripts/rocksdb-build.sh

test_bin=$root/target/release/test_rocksdb
work=$(mktemp -d /var/tmp/corefs-rocksdb-test.XXXXXX)
trap 'rm -rf "$work"' EXIT

passed=0
failed=0
run() {
  local name=$1
  shift
  if "$@" >"$work/$name.out" 2>"$work/$name.err"; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    echo "FAIL: $name exited $?: $(tail -n 5 "$work/$name.err")"
  fi
  cat "$work/$name.out"
}

run functional "$test_bin" functional "file:$work/functional.img,size=1GiB"
seeds=${COREFS_ROCKSDB_SEEDS:-"$RANDOM$RANDOM $RANDOM$RANDOM $RANDOM$RANDOM"}
for seed in $seeds; do
  run "crash-$seed" "$test_bin" crash "file:$work/crash-$seed.img,size=1GiB" "$seed"
  rm -f "$work/crash-$seed.img"
done

# Through a corefs server: two processes, one database (the LOCK file's lock reaches across
# processes and goes with a killed holder), then the server stops cleanly and fsck is clean.
[[ -n ${COREFS_BIN:-} ]] || cargo build --release --locked -p corefs-cli >&2
corefs_bin=${COREFS_BIN:-$root/target/release/corefs}
"$corefs_bin" mkfs "file:$work/served.img" --size 1GiB --shards 4 >/dev/null
"$corefs_bin" serve "file:$work/served.img" --socket "$work/corefs.sock" 2>"$work/serve.err" &
serve_pid=$!
for _ in $(seq 100); do [[ -S $work/corefs.sock ]] && break; sleep 0.1; done
run served "$test_bin" served "$work/corefs.sock"
kill -TERM "$serve_pid"
if wait "$serve_pid" && "$corefs_bin" fsck "file:$work/served.img" >/dev/null 2>&1; then
  passed=$((passed + 1))
  echo "PASS the server stopped cleanly; fsck clean"
else
  failed=$((failed + 1))
  echo "FAIL server stop or fsck: $(tail -n 3 "$work/serve.err")"
fi

echo "rocksdb-test.sh: $passed passed, $failed failed"
((failed == 0))
