#!/usr/bin/env bash
# bench.sh - the main job: the corefs benchmark suite on a default file-backed image. Makes a
# prefilled image in /var/tmp, runs the short suite (append + fdatasync, random overwrites with
# fsync, 64 KiB fsync writers, file creates, a dbench-like mix, random reads at QD1 and QD32) on
# corefs and on the kernel filesystem holding the image, prints the side-by-side table with
# ratios, writes results.json, table.txt and SVG plots to bench-results/, and removes the
# image. By default each workload runs 3 times for 2 s on each target, interleaved, and every
# ratio is the median of the paired repeats with its spread (a single 5-second sample per
# target decided nothing on a noisy disk: ext4's append+fdatasync moved 2,670-14,776 ops/s
# within an hour here). Extra arguments go to `corefs bench suite` (see --help), e.g.
# `--loops` (as root) to add ext4, xfs and btrfs on loop devices, `--repeat 5`,
# `--seconds 10`, `--neighbours 1` (a CPU-bound process beside every run).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ " $* " == *" --loops "* || " $* " == *xfs* || " $* " == *btrfs* ]]; then
  missing=()
  for p in xfsprogs btrfs-progs e2fsprogs; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    if [[ $(id -u) == 0 ]]; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
    else
      echo "bench.sh: loop-device peers need root and ${missing[*]}" >&2
      exit 1
    fi
  fi
fi
cargo build --release --locked -p corefs-cli >&2
defaults=()
[[ " $* " == *" --repeat"* ]] || defaults+=(--repeat 3)
[[ " $* " == *" --seconds"* ]] || defaults+=(--seconds 2)
exec target/release/corefs bench suite "${defaults[@]}" "$@"
