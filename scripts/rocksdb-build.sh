#!/usr/bin/env bash
# rocksdb-build.sh - builds libcorefs (release), the corefs RocksDB FileSystem
# (bindings/rocksdb) as target/release/libcorefs_rocksdb.so, its tests
# (target/release/test_rocksdb) and the benchmark (target/release/corefs_db_bench).
# Needs g++ and librocksdb-dev (Debian 12: RocksDB 7.8). CARGO overrides the cargo command.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cargo=${CARGO:-cargo}
command -v g++ >/dev/null || { echo "rocksdb-build.sh: g++ not found (apt-get install g++)" >&2; exit 1; }
[[ -f /usr/include/rocksdb/file_system.h ]] || {
  echo "rocksdb-build.sh: rocksdb/file_system.h not found (apt-get install librocksdb-dev)" >&2
  exit 1
}
# COREFS_LIB_FEATURES=sim: the library with the test machinery (`cache=volatile`, which
# rocksdb-test.sh's power cuts need); unset, the library as it ships (the benchmark).
features=()
[[ -n ${COREFS_LIB_FEATURES:-} ]] && features=(--features "$COREFS_LIB_FEATURES")
echo "== $cargo build --release -p corefs-bindings ${features[*]}" >&2
$cargo build --release -p corefs-bindings "${features[@]}" >&2
echo "== compiling the RocksDB FileSystem, its tests and corefs_db_bench" >&2
release=$PWD/target/release
flags=(-std=c++17 -O2 -g -Wall -Wextra -Werror -I bindings/include -I bindings/rocksdb)
link=(-L "$release" -lcorefs -Wl,-rpath,"$release" -lrocksdb -lpthread)
# The FileSystem is compiled once (an object file, so that its static registration with
# RocksDB's ObjectLibrary is always linked in) and linked into the library and both programs.
obj=$release/corefs_rocksdb.o
g++ "${flags[@]}" -fPIC -c bindings/rocksdb/corefs_rocksdb.cc -o "$obj"
g++ -shared "$obj" "${link[@]}" -o "$release/libcorefs_rocksdb.so"
g++ "${flags[@]}" bindings/rocksdb/test_rocksdb.cc "$obj" "${link[@]}" -o "$release/test_rocksdb"
g++ "${flags[@]}" bindings/rocksdb/corefs_db_bench.cc "$obj" "${link[@]}" -o "$release/corefs_db_bench"
