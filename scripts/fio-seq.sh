#!/usr/bin/env bash
# fio-seq.sh - issue 37's C-ABI bandwidth rows: fio's 1 MiB sequential write (QD8, end_fsync)
# and read (QD8) of a 1 GiB file (bindings/fio/examples/seqwrite.fio, seqread.fio) through the
# corefs fio engine (libcorefs, a file image) and through fio's io_uring with O_DIRECT on ext4
# on a direct-I/O loop device, both images in /var/tmp on the same disk. Runs are interleaved
# (corefs, ext4, corefs, ...), each on a fresh filesystem; every row prints each run's MiB/s,
# the medians, corefs's median over ext4's (above 1 corefs is faster), and the CPU seconds
# the whole fio process took per GiB moved (user + system, /usr/bin/time: corefs's reactor
# threads and io_uring workers count; the kernel's completion work in interrupts counts for
# neither) and, on a quiet run, the CPU seconds the whole machine was busy meanwhile (every
# core's user, system, irq and softirq time in /proc/stat: ext4's loop-device worker and the
# page-cache work under both images count too, so this is the fairer of the two).
# corefs reads with its data cache off (`corefs_data_cache=0`), as O_DIRECT reads on ext4
# come from the device.
# Needs root (loop devices, mounts), fio, gcc, e2fsprogs and GNU time.
# Usage: scripts/fio-seq.sh [REPEATS=3] [NEIGHBOURS=0]
# NEIGHBOURS=N runs N CPU-bound shell loops beside every run. COREFS_FIO=path uses that
# engine instead of building one (scripts/fio-plugin.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repeats=${1:-3}
neighbours=${2:-0}
[[ $(id -u) == 0 ]] || { echo "fio-seq.sh: needs root" >&2; exit 1; }
for tool in fio mkfs.ext4 /usr/bin/time; do
  command -v "$tool" >/dev/null || { echo "fio-seq.sh: $tool not found (apt-get install fio e2fsprogs time)" >&2; exit 1; }
done
engine=${COREFS_FIO:-}
[[ -n $engine ]] || engine=$(scripts/fio-plugin.sh | tail -1)
work=$(mktemp -d /var/tmp/fio-seq.XXXXXX)
e4=$work/ext4 loopdev="" hogs=()
cleanup() {
  for h in "${hogs[@]}"; do kill "$h" 2>/dev/null || true; done
  mountpoint -q "$e4" && umount "$e4"
  [[ -n $loopdev ]] && losetup -d "$loopdev"
  rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$e4"
for _ in $(seq "$neighbours"); do bash -c 'while :; do :; done' & hogs+=($!); done

# One fio run of job $2 on target $1 (fresh filesystem each time); prints "MiB/s cpu_s_per_gib".
# A read job's file is laid out by an untimed fio run of the same job first (`create_only`).
run() {
  local target=$1 job=bindings/fio/examples/$2.fio out=$work/out.json times=$work/times args
  if [[ $target == corefs ]]; then
    rm -f "$work/corefs.img"
    args=(--ioengine="external:$engine" --corefs_dev="file:$work/corefs.img,size=4GiB"
      --corefs_data_cache=0)
    if [[ $2 == seqread ]]; then
      fio "${args[@]}" --corefs_format=1 --create_only=1 "$job" >/dev/null
    else
      args+=(--corefs_format=1)
    fi
  else
    truncate -s 4G "$work/ext4.img"
    loopdev=$(losetup --direct-io=on --show -f "$work/ext4.img")
    mkfs.ext4 -q "$loopdev"
    mount "$loopdev" "$e4"
    args=(--ioengine=io_uring --direct=1 --directory="$e4")
    [[ $2 == seqread ]] && fio "${args[@]}" --create_only=1 "$job" >/dev/null
  fi
  local before after
  before=$(head -1 /proc/stat)
  /usr/bin/time -o "$times" -f "%U %S" \
    fio --output-format=json --output="$out" "${args[@]}" "$job" >/dev/null
  after=$(head -1 /proc/stat)
  if [[ $target == ext4 ]]; then
    umount "$e4"
    losetup -d "$loopdev"
    loopdev=""
    rm -f "$work/ext4.img"
  fi
  # fio's bandwidth is of the timed part; the CPU is the whole process's, for the 1 GiB the
  # job moves (its file was laid out before).
  local side=write
  [[ $2 == seqread ]] && side=read
  awk -v side="$side" -v cpu="$(cat "$times")" -v before="$before" -v after="$after" \
    -v tick="$(getconf CLK_TCK)" -v quiet="$((neighbours == 0))" '
    function busy(line, f) { split(line, f, " "); return f[2] + f[3] + f[4] + f[7] + f[8] }
    $0 ~ "\"" side "\" : \\{" { want = 1 }
    want && /"bw" :/ { gsub(/,/, ""); bw = $3; want = 0 }
    END {
      split(cpu, c, " ")
      machine = quiet ? sprintf("%.2f", (busy(after) - busy(before)) / tick) : "-"
      printf "%.0f %.2f %s\n", bw / 1024, c[1] + c[2], machine
    }' "$out"
}

median() { tr ' ' '\n' | grep -v '^$' | sort -n | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }

printf '%-22s %-40s %-40s %s\n' "fio, $neighbours neighbours" \
  "corefs MiB/s (median) cpu s/GiB: fio, machine" "ext4 MiB/s (median) cpu s/GiB: fio, machine" \
  "corefs/ext4"
for job in seqwrite seqread; do
  declare -A bw=() cpu=() machine=()
  for _ in $(seq "$repeats"); do
    for target in corefs ext4; do
      read -r b c m < <(run "$target" "$job")
      bw[$target]+="$b "
      cpu[$target]+="$c "
      machine[$target]+="$m "
    done
  done
  mc=$(echo "${bw[corefs]}" | median) me=$(echo "${bw[ext4]}" | median)
  cpus() {
    local m=-
    [[ $neighbours == 0 ]] && m=$(echo "${machine[$1]}" | median)
    echo "$(echo "${cpu[$1]}" | median), $m"
  }
  printf '%-22s %-40s %-40s %.2fx\n' "$job 1MiB QD8" \
    "${bw[corefs]}($mc) $(cpus corefs)" "${bw[ext4]}($me) $(cpus ext4)" \
    "$(awk -v a="$mc" -v b="$me" 'BEGIN { print a / b }')"
done
