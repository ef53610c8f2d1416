#!/usr/bin/env bash
# install-libcorefs.sh PREFIX - builds libcorefs (release) and installs the shared and static
# libraries, corefs.h and corefs.pc under PREFIX (default /usr/local):
#   cc app.c $(pkg-config --cflags --libs corefs)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
prefix=${1:-/usr/local}
cargo build --release --locked -p corefs-bindings >&2
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
install -d "$prefix/lib/pkgconfig" "$prefix/include"
install -m 0755 target/release/libcorefs.so "$prefix/lib/"
install -m 0644 target/release/libcorefs.a "$prefix/lib/"
install -m 0644 bindings/include/corefs.h "$prefix/include/"
sed -e "s|@PREFIX@|$prefix|" -e "s|@VERSION@|$version|" bindings/corefs.pc.in \
  > "$prefix/lib/pkgconfig/corefs.pc"
echo "installed libcorefs $version under $prefix" >&2
