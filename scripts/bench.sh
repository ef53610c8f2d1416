#!/usr/bin/env bash
# bench.sh - the main job: corefs's latency benchmarks on a default file-backed image: 4 KiB
# append + fsync next to the raw device's write + flush and the kernel filesystem holding the
# image, then the device layer with the same workloads through fio on the same file. Installs
# fio when root. Extra arguments go to `corefs bench device` (see --help).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ! command -v fio >/dev/null; then
  if [[ $(id -u) == 0 ]]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio >&2
  else
    echo "bench.sh: fio is not installed; the comparison with fio is skipped (sudo apt-get install fio)" >&2
  fi
fi
cargo build --release --locked -p corefs-cli >&2
target/release/corefs bench fsync
exec target/release/corefs bench device "$@"
