#!/usr/bin/env bash
# sqlite-bench.sh - SQLite transactions per second with synchronous=FULL, one 100-byte row per
# transaction (autocommit INSERTs), with each transaction's latency (p50, p99), in three modes:
#   wal     journal_mode=WAL
#   delete  journal_mode=DELETE (a rollback journal written, synced and deleted per transaction)
#   batch   journal_mode=DELETE with batch atomic writes: no journal, each transaction one
#           corefs atomic batch (SQLITE_ENABLE_BATCH_ATOMIC_WRITE; corefs only: on ext4 SQLite
#           has no batch atomic writes, and batch would be delete again)
# through the corefs VFS (a 1 GiB image in /var/tmp, written whole once so that the kernel
# filesystem allocates nothing during the run) and through SQLite's unix VFS on ext4: as root,
# an ext4 made for the run on a loop device (direct I/O, as corefs opens its image) over a file
# in /var/tmp, on the same disk as corefs's image; otherwise /var/tmp itself.
#   scripts/sqlite-bench.sh [SECONDS]     (default 5 per run)
# REPEAT=n runs each configuration n times (interleaved) and reports the run with the median
# tx/s, and the median of the n paired ratios (corefs and ext4 runs of one round, seconds
# apart, see the same load: steadier than the ratio of medians on a shared machine).
# KERNEL_DIR=/mnt/x compares with the filesystem mounted there instead of making one.
# NEIGHBOURS=n spins n CPU-bound processes (`while :; do :; done`, unpinned) beside every run,
# as `corefs bench suite --neighbours n` does: a user's machine is never empty.
# Prints the load average before and after (the machine may be shared: figures are noisy).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
seconds=${1:-5}
repeat=${REPEAT:-1}
neighbours=${NEIGHBOURS:-0}
dir=/var/tmp

command -v dd >/dev/null || { echo "sqlite-bench.sh: dd not found" >&2; exit 1; }
scripts/sqlite-build.sh
test_bin=$root/target/release/test_sqlite

image=$(mktemp "$dir/corefs-sqlite-bench.XXXXXX.img")
loop_img= loop_dev= loop_mnt=
spinners=()
cleanup() {
  for pid in "${spinners[@]}"; do kill "$pid" 2>/dev/null || true; done
  rm -f "$image"
  if [[ -n $loop_mnt ]]; then umount "$loop_mnt" 2>/dev/null || true; rmdir "$loop_mnt"; fi
  if [[ -n $loop_dev ]]; then losetup -d "$loop_dev" 2>/dev/null || true; fi
  if [[ -n $loop_img ]]; then rm -f "$loop_img"; fi
}
trap cleanup EXIT
echo "== writing the 1 GiB image $image" >&2
dd if=/dev/zero of="$image" bs=1M count=1024 oflag=direct conv=fsync status=none

if [[ -n ${KERNEL_DIR:-} ]]; then
  kernel_dir=$KERNEL_DIR
  kernel_name="$(findmnt -n -o FSTYPE -T "$kernel_dir" 2>/dev/null || echo "?") ($kernel_dir)"
elif [[ $(id -u) == 0 ]] && command -v losetup >/dev/null && command -v mkfs.ext4 >/dev/null; then
  loop_img=$(mktemp "$dir/ext4-sqlite-bench.XXXXXX.img")
  dd if=/dev/zero of="$loop_img" bs=1M count=1024 oflag=direct conv=fsync status=none
  mkfs.ext4 -q -F "$loop_img"
  loop_dev=$(losetup --direct-io=on --show -f "$loop_img")
  loop_mnt=$(mktemp -d "$dir/ext4-sqlite-bench.XXXXXX")
  mount "$loop_dev" "$loop_mnt"
  kernel_dir=$loop_mnt
  kernel_name="ext4 (loop, direct I/O)"
else
  kernel_dir=$dir
  kernel_name="$(findmnt -n -o FSTYPE -T "$dir" 2>/dev/null || echo "?") ($dir; not root: no loop device)"
fi

# run MODE WHERE [env...]: prints "tps p50_us p99_us".
run() {
  local mode=$1 where=$2 out
  shift 2
  out=$(env "$@" "$test_bin" bench "$mode" "$seconds" "$where") || {
    echo "sqlite-bench.sh: bench $mode $where failed" >&2
    exit 1
  }
  [[ $out =~ ^tps\ ([0-9]+)\ p50_us\ ([0-9.]+)\ p99_us\ ([0-9.]+)$ ]] ||
    { echo "sqlite-bench.sh: unexpected output '$out'" >&2; exit 1; }
  echo "${BASH_REMATCH[1]} ${BASH_REMATCH[2]} ${BASH_REMATCH[3]}"
}

declare -A runs
wal_ratios= best_ratios=
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for ((i = 0; i < neighbours; i++)); do
  sh -c 'while :; do :; done' &
  spinners+=($!)
done
for ((r = 0; r < repeat; r++)); do
  declare -A tps=()
  for mode in wal delete batch; do
    out=$(run "$mode" corefs COREFS_DEVICE="file:$image,size=1GiB" COREFS_FORMAT=1)
    runs[corefs-$mode]+="$out"$'\n'
    tps[corefs-$mode]=${out%% *}
    # On ext4 batch would be delete once more (no batch atomic writes there).
    if [[ $mode != batch ]]; then
      out=$(run "$mode" "$kernel_dir")
      runs[kernel-$mode]+="$out"$'\n'
      tps[kernel-$mode]=${out%% *}
    fi
  done
  wal_ratios+=$(awk -v c="${tps[corefs-wal]}" -v k="${tps[kernel-wal]}" 'BEGIN { printf "%.2f", c / k }')$'\n'
  best_ratios+=$(awk -v a="${tps[corefs-wal]}" -v b="${tps[corefs-delete]}" -v c="${tps[corefs-batch]}" \
    -v x="${tps[kernel-wal]}" -v y="${tps[kernel-delete]}" 'BEGIN {
      c1 = a; if (b > c1) c1 = b; if (c > c1) c1 = c; k1 = x; if (y > k1) k1 = y
      printf "%.2f", c1 / k1 }')$'\n'
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
# The median of a newline-separated list of numbers.
median_of() { sort -n <<<"$1" | sed '/^$/d' | awk '{ a[NR] = $0 } END { print a[int((NR + 1) / 2)] }'; }

# The run with the median tx/s of a configuration: "tps p50 p99", or "- - -".
median() { sort -n <<<"${runs[$1]:-}" | sed '/^$/d' | awk '{ a[NR] = $0 } END { print (NR ? a[int((NR + 1) / 2)] : "- - -") }'; }

echo "SQLite $("$test_bin" version) (test_sqlite), synchronous=FULL, one 100-byte row per transaction, ${seconds} s per run, median of $repeat"
echo "corefs: file:$image (1 GiB, O_DIRECT); kernel: $kernel_name"
echo "load average before: $load_before; after: $load_after; $(nproc) cores; $neighbours CPU-bound neighbour(s)"
printf '%-7s | %9s %9s %9s | %9s %9s %9s | %6s\n' mode "corefs tx/s" p50_us p99_us "ext4 tx/s" p50_us p99_us ratio
best_c=0 best_c_mode= best_k=0 best_k_mode=
for mode in wal delete batch; do
  read -r c c50 c99 <<<"$(median "corefs-$mode")"
  read -r k k50 k99 <<<"$(median "kernel-$mode")"
  ratio=$(awk -v c="$c" -v k="$k" 'BEGIN { if (k + 0 > 0) printf "%.2f", c / k; else print "-" }')
  printf '%-7s | %11s %9s %9s | %9s %9s %9s | %6s\n' "$mode" "$c" "$c50" "$c99" "$k" "$k50" "$k99" "$ratio"
  if ((c > best_c)); then best_c=$c best_c_mode=$mode; fi
  if [[ $k != - ]] && ((k > best_k)); then best_k=$k best_k_mode=$mode; fi
  [[ $mode == wal ]] && wal_ratio=$ratio
done
best_ratio=$(awk -v c="$best_c" -v k="$best_k" 'BEGIN { printf "%.2f", c / k }')
echo "best corefs ($best_c_mode) / best ext4 ($best_k_mode): $best_ratio; paired, median of $repeat: $(median_of "$best_ratios") [$(echo $best_ratios)] (issue 21 target >= 1.5)"
echo "corefs wal / ext4 wal: $wal_ratio; paired, median of $repeat: $(median_of "$wal_ratios") [$(echo $wal_ratios)] (issue 21 target >= 1.0)"
