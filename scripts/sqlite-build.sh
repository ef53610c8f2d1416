#!/usr/bin/env bash
# sqlite-build.sh - builds libcorefs (release), the SQLite VFS as a loadable extension
# (target/release/libcorefs_sqlite.so) and the test/bench program (target/release/test_sqlite).
# Sourced or run by sqlite-test.sh and sqlite-bench.sh. Needs gcc and libsqlite3-dev.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for tool in gcc cargo; do
  command -v "$tool" >/dev/null || { echo "sqlite-build.sh: $tool not found" >&2; exit 1; }
done
[[ -f /usr/include/sqlite3ext.h ]] || {
  echo "sqlite-build.sh: sqlite3ext.h not found (apt-get install libsqlite3-dev)" >&2
  exit 1
}
echo "== cargo build --release -p corefs-bindings" >&2
cargo build --release -p corefs-bindings >&2
echo "== compiling the VFS and the test program" >&2
release=$PWD/target/release
gcc -O2 -Wall -Wextra -Werror -fPIC -shared bindings/sqlite/corefs_vfs.c -I bindings/include \
  -L "$release" -lcorefs -Wl,-rpath,"$release" -lpthread -o "$release/libcorefs_sqlite.so"
gcc -O2 -Wall -Wextra -Werror -DCOREFS_VFS_STATIC bindings/sqlite/test_sqlite.c \
  bindings/sqlite/corefs_vfs.c -I bindings/include -L "$release" -lcorefs \
  -Wl,-rpath,"$release" -lsqlite3 -lpthread -o "$release/test_sqlite"
