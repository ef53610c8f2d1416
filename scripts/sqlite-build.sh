#!/usr/bin/env bash
# sqlite-build.sh - builds libcorefs (release), the SQLite VFS as a loadable extension
# (target/release/libcorefs_sqlite.so) and the test/bench program (target/release/test_sqlite).
# Sourced or run by sqlite-test.sh and sqlite-bench.sh. Needs gcc and libsqlite3-dev.
#
# The test program links its own SQLite: the amalgamation (sqlite3.c) that the libsqlite3-sys
# crate ships (pinned in bindings/Cargo.toml, fetched by cargo), compiled with
# SQLITE_ENABLE_BATCH_ATOMIC_WRITE, which Debian's libsqlite3 lacks: what a Rust program gets
# through rusqlite's `bundled` feature with LIBSQLITE3_FLAGS=-DSQLITE_ENABLE_BATCH_ATOMIC_WRITE.
# The loadable extension stays built against the system's headers, for the stock shell.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for tool in gcc cargo; do
  command -v "$tool" >/dev/null || { echo "sqlite-build.sh: $tool not found" >&2; exit 1; }
done
[[ -f /usr/include/sqlite3ext.h ]] || {
  echo "sqlite-build.sh: sqlite3ext.h not found (apt-get install libsqlite3-dev)" >&2
  exit 1
}
# cargo-locked (a flock'd cargo) where it exists: builds sharing a machine queue, not race.
cargo_cmd=cargo
command -v cargo-locked >/dev/null && cargo_cmd=cargo-locked
# COREFS_LIB_FEATURES=sim: the library with the test machinery (`cache=volatile`, which
# sqlite-test.sh's power cut needs); unset, the library as it ships (the benchmark).
features=()
[[ -n ${COREFS_LIB_FEATURES:-} ]] && features=(--features "$COREFS_LIB_FEATURES")
echo "== $cargo_cmd build --release --locked -p corefs-bindings ${features[*]}" >&2
$cargo_cmd build --release --locked -p corefs-bindings "${features[@]}" >&2
echo "== compiling the VFS and the test program" >&2
release=$PWD/target/release
$cargo_cmd fetch --locked >&2
# Where cargo keeps libsqlite3-sys's source (an optional dependency: --all-features lists it).
manifest=$(cargo metadata --locked --format-version 1 --all-features |
  grep -o '"manifest_path":"[^"]*/libsqlite3-sys-[^"]*/Cargo.toml"' | head -n 1 | cut -d'"' -f4)
amalgamation=$(dirname "${manifest:-/nonexistent/x}")/sqlite3
[[ -f $amalgamation/sqlite3.c ]] || {
  echo "sqlite-build.sh: libsqlite3-sys's sqlite3.c not found (cargo fetch failed?)" >&2
  exit 1
}
sqlite_flags=(-DSQLITE_ENABLE_BATCH_ATOMIC_WRITE -DSQLITE_THREADSAFE=1)
sqlite_obj=$release/sqlite3-batch-atomic.o
# Rebuilt when its source or this script is newer (about a minute of one core).
if [[ ! -f $sqlite_obj || $amalgamation/sqlite3.c -nt $sqlite_obj || $0 -nt $sqlite_obj ]]; then
  echo "== compiling SQLite $(grep -m1 -o '"3\.[0-9.]*"' "$amalgamation/sqlite3.h") with ${sqlite_flags[*]}" >&2
  gcc -O2 -w -c "${sqlite_flags[@]}" "$amalgamation/sqlite3.c" -o "$sqlite_obj.tmp"
  mv "$sqlite_obj.tmp" "$sqlite_obj"
fi
gcc -O2 -Wall -Wextra -Werror -fPIC -shared bindings/sqlite/corefs_vfs.c -I bindings/include \
  -L "$release" -lcorefs -Wl,-rpath,"$release" -lpthread -o "$release/libcorefs_sqlite.so"
# COREFS_VFS_CFLAGS: more flags for the test program, e.g. -DCOREFS_VFS_MUTATION_UNSTAGED_BATCH
# (the breakage sqlite-test.sh's crash test must catch; see corefs_vfs.c).
# shellcheck disable=SC2086
gcc -O2 -Wall -Wextra -Werror -DCOREFS_VFS_STATIC ${COREFS_VFS_CFLAGS:-} -I "$amalgamation" bindings/sqlite/test_sqlite.c \
  bindings/sqlite/corefs_vfs.c "$sqlite_obj" -I bindings/include -L "$release" -lcorefs \
  -Wl,-rpath,"$release" -lpthread -ldl -lm -o "$release/test_sqlite"
