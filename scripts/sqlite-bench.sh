#!/usr/bin/env bash
# sqlite-bench.sh - SQLite transactions per second with synchronous=FULL, one 100-byte row per
# transaction, through the corefs VFS (a 1 GiB image in /var/tmp, written whole once so that
# the kernel filesystem allocates nothing during the run) and through the default VFS on
# /var/tmp itself, in WAL and rollback-journal (DELETE) modes.
#   scripts/sqlite-bench.sh [SECONDS]     (default 5 per run)
# KERNEL_DIR=/mnt/x compares with the kernel filesystem mounted there instead (for example an
# ext4, xfs or btrfs on a loop device over a file on the same disk).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
seconds=${1:-5}
dir=/var/tmp
kernel_dir=${KERNEL_DIR:-$dir}

command -v dd >/dev/null || { echo "sqlite-bench.sh: dd not found" >&2; exit 1; }
scripts/sqlite-build.sh
test_bin=$root/target/release/test_sqlite

image=$(mktemp "$dir/corefs-sqlite-bench.XXXXXX.img")
trap 'rm -f "$image"' EXIT
echo "== writing the 1 GiB image $image" >&2
dd if=/dev/zero of="$image" bs=1M count=1024 oflag=direct conv=fsync status=none

tps() { # tps MODE WHERE [env...]
  local mode=$1 where=$2 out
  shift 2
  out=$(env "$@" "$test_bin" bench "$mode" "$seconds" "$where") || {
    echo "sqlite-bench.sh: bench $mode $where failed" >&2
    exit 1
  }
  [[ $out =~ ^tps\ ([0-9]+)$ ]] || { echo "sqlite-bench.sh: unexpected output '$out'" >&2; exit 1; }
  echo "${BASH_REMATCH[1]}"
}

fstype=$(findmnt -n -o FSTYPE -T "$kernel_dir" 2>/dev/null || echo "?")
echo "SQLite $(sqlite3 --version 2>/dev/null | cut -d' ' -f1), synchronous=FULL, one 100-byte row per transaction, ${seconds} s per run"
printf '%-8s %12s %12s %8s\n' mode "corefs tps" "$fstype tps" ratio
for mode in wal delete; do
  c=$(tps "$mode" corefs COREFS_DEVICE="file:$image,size=1GiB" COREFS_FORMAT=1)
  k=$(tps "$mode" "$kernel_dir")
  ratio=$(awk -v c="$c" -v k="$k" 'BEGIN { if (k > 0) printf "%.2f", c / k; else print "-" }')
  printf '%-8s %12s %12s %8s\n' "$mode" "$c" "$k" "$ratio"
done
