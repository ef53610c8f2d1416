#!/usr/bin/env bash
# test.sh - runs every corefs test on a fresh Debian machine: installs what the tests need
# (when root), checks formatting and lints, runs the workspace tests (the C ABI's example
# program included), SQLite on corefs through its VFS, RocksDB on corefs through its
# FileSystem, then the NVMe passthrough tests inside a QEMU guest. Fails loudly when a
# required piece is missing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

need_packages=(qemu-system-x86 busybox-static cpio kmod fio libc6-dev gcc binutils pkg-config python3 sqlite3 libsqlite3-dev e2fsprogs fuse3 rsync g++ librocksdb-dev)
missing=()
for p in "${need_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) == 0 ]]; then
    echo "test.sh: installing ${missing[*]}" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  else
    echo "test.sh: missing packages: ${missing[*]}; run as root or: sudo apt-get install ${missing[*]}" >&2
    exit 1
  fi
fi
command -v cargo >/dev/null || { echo "test.sh: cargo not found (install Rust with rustup)" >&2; exit 1; }
rustup component list --installed 2>/dev/null | grep -q rustfmt || rustup component add rustfmt clippy >&2

echo "== cargo fmt --check" >&2
cargo fmt --all -- --check
echo "== cargo clippy -D warnings" >&2
cargo clippy --locked --all-targets -- -D warnings
# The builds without the test machinery (`sim`): libcorefs, and each crate that has the feature.
cargo clippy --locked -p corefs-bindings --lib -- -D warnings
cargo clippy --locked -p corefs-nvme -p corefs-engine -p corefs-reactor --lib --no-default-features -- -D warnings
echo "== no module cycles" >&2
# Modules that import each other in a circle (scripts/module-cycles.py): none in any crate, so
# each crate's modules form layers that only look down (docs/design.md, "Engine layers").
for crate in engine bench reactor nvme bindings cli crashtest; do
  scripts/module-cycles.py "$crate"
done
echo "== libcorefs carries no test machinery" >&2
# Its dependency tree (no dev-dependencies) must enable no crate's `sim` (or `default`, which
# holds it) and pull in no rand.
if leaked=$(cargo tree --locked -p corefs-bindings -e normal --prefix none -f '{p} [{f}]' |
    grep -E '^corefs-.*[[,]( ?)(sim|default)[],]|^rand'); then
  echo "test.sh: libcorefs's build carries test machinery:" >&2
  sort -u <<<"$leaked" >&2
  exit 1
fi
echo "== cargo test" >&2
# The C example links the shared library, which cargo test does not build by itself.
cargo build --locked -p corefs-bindings
# Built without `sim` (a workspace build), libcorefs exports the C ABI and nothing else.
if foreign=$(nm -D --defined-only target/debug/libcorefs.so | awk '{print $3}' | grep -v '^corefs_'); then
  echo "test.sh: libcorefs exports symbols outside the C ABI:" >&2
  echo "$foreign" >&2
  exit 1
fi
cargo test --locked --workspace
# The device layer without `sim`: the simulation options are refused by name.
cargo test --locked -p corefs-nvme --no-default-features --lib
echo "== SQLite on corefs (the VFS, journal and WAL modes, the sqlite3 shell, a crash)" >&2
scripts/sqlite-test.sh
echo "== RocksDB on corefs (its FileSystem: functional test and kill -9 power cuts)" >&2
scripts/rocksdb-test.sh
echo "== NVMe passthrough in a QEMU guest" >&2
scripts/nvme-guest/prepare.sh --quiet
scripts/test-nvme-guest.sh
