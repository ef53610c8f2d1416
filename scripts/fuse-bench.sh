#!/usr/bin/env bash
# fuse-bench.sh - what a user of the FUSE mount sees, beside ext4 on the same disk (issue 37):
# `cp -a /usr/include` made durable (`sync -f` on ext4; `corefs sync` on corefs, since Linux passes
# syncfs to no FUSE server but virtiofs and `sync -f` there returns at once), a 1 GiB `dd bs=1M conv=fsync` write, and a cold 1 GiB
# `dd bs=1M` read (page cache dropped) and the same read again (cache warm), and `find -printf
# '%s %m'` over the copy with the kernel's caches dropped (every name listed and stat-ed), on `corefs mount` of a file image and on ext4 on a
# direct-I/O loop device, both images in /var/tmp. Runs are interleaved (corefs, ext4, corefs,
# ...) and each row prints every run's seconds, the medians and ext4's median over corefs's
# (above 1 corefs is faster). Needs root (mounts, loop devices, drop_caches).
# Usage: scripts/fuse-bench.sh [REPEATS=3] [NEIGHBOURS=0]
# NEIGHBOURS=N runs N CPU-bound shell loops beside every run. COREFS_BIN=path uses that
# corefs binary instead of building one (to compare two builds); COREFS_MOUNT_ARGS adds
# options to `corefs mount` (e.g. "--atime noatime", which keeps the page cache across opens).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repeats=${1:-3}
neighbours=${2:-0}
[[ $(id -u) == 0 ]] || { echo "fuse-bench.sh: needs root" >&2; exit 1; }
command -v mkfs.ext4 >/dev/null || { echo "fuse-bench.sh: needs e2fsprogs" >&2; exit 1; }
bin=${COREFS_BIN:-target/release/corefs}
[[ -n ${COREFS_BIN:-} ]] || cargo build --release --locked -p corefs-cli >&2
work=$(mktemp -d /var/tmp/fuse-bench.XXXXXX)
cf=$work/corefs e4=$work/ext4 loopdev="" server="" hogs=()
cleanup() {
  for h in "${hogs[@]}"; do kill "$h" 2>/dev/null || true; done
  mountpoint -q "$cf" && umount "$cf"
  [[ -n $server ]] && wait "$server" 2>/dev/null
  mountpoint -q "$e4" && umount "$e4"
  [[ -n $loopdev ]] && losetup -d "$loopdev"
  rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$cf" "$e4"
"$bin" mkfs "file:$work/corefs.img" --size 4GiB >/dev/null
# shellcheck disable=SC2086 # the options are words
"$bin" mount "file:$work/corefs.img" "$cf" ${COREFS_MOUNT_ARGS:-} 2>"$work/server.log" &
server=$!
for _ in $(seq 100); do mountpoint -q "$cf" && break; sleep 0.1; done
mountpoint -q "$cf" || { cat "$work/server.log" >&2; exit 1; }
truncate -s 4G "$work/ext4.img"
loopdev=$(losetup --direct-io=on --show -f "$work/ext4.img")
mkfs.ext4 -q "$loopdev"
mount "$loopdev" "$e4"
for _ in $(seq "$neighbours"); do bash -c 'while :; do :; done' & hogs+=($!); done

seconds() { local t0 t1; t0=$(date +%s.%N); "$@" >/dev/null 2>&1; t1=$(date +%s.%N); awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }'; }
# Makes everything under $1 durable: a commit on corefs, syncfs on ext4.
durable() { if [[ $1 == "$cf"* ]]; then "$bin" sync "$1"; else sync -f "$1"; fi; }
copy() { cp -a /usr/include "$1/inc" && durable "$1/inc"; }
write() { dd if=/dev/zero of="$1/big" bs=1M count=1024 conv=fsync; }
# A metadata walk over the copy with the kernel's caches cold, as find, du and backup tools
# make: every name listed and stat-ed.
walk() { sync; echo 3 >/proc/sys/vm/drop_caches; find "$1/inc" -printf '%s %m\n'; }
read_cold() { sync; echo 3 >/proc/sys/vm/drop_caches; dd if="$1/big" of=/dev/null bs=1M; }
read_again() { dd if="$1/big" of=/dev/null bs=1M; }
clean() { rm -rf "$1/inc" "$1/big"; durable "$1"; }

declare -A runs
for _ in $(seq "$repeats"); do
  for target in corefs ext4; do
    dir=$cf; [[ $target == ext4 ]] && dir=$e4
    runs[copy,$target]+="$(seconds copy "$dir") "
    runs[walk,$target]+="$(seconds walk "$dir") "
    runs[write,$target]+="$(seconds write "$dir") "
    runs[read,$target]+="$(seconds read_cold "$dir") "
    runs[again,$target]+="$(seconds read_again "$dir") "
    clean "$dir"
  done
done
median() { tr ' ' '\n' | grep . | sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
printf '%-28s %-22s %-22s %s\n' "FUSE mount, $neighbours neighbours" "corefs s (median)" "ext4 s (median)" "ext4/corefs"
for row in copy walk write read again; do
  c=$(median <<<"${runs[$row,corefs]}") e=$(median <<<"${runs[$row,ext4]}")
  name=$row; case $row in copy) name="cp -a /usr/include + sync";; walk) name="find -printf of it, cold";; write) name="dd 1 GiB write + fsync";; read) name="dd 1 GiB read, cold";; again) name="dd 1 GiB read again";; esac
  printf '%-28s %-22s %-22s %.2fx\n' "$name" "${runs[$row,corefs]}($c)" "${runs[$row,ext4]}($e)" "$(awk -v c="$c" -v e="$e" 'BEGIN { print e / c }')"
done
