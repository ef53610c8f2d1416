#!/usr/bin/env bash
# fio-plugin.sh [--debug] - builds libcorefs_fio.so, the fio external ioengine for corefs
# (bindings/fio/corefs_fio.c), against the headers of the fio installed here:
#   fio --ioengine=external:target/release/libcorefs_fio.so --corefs_dev=file:/var/tmp/fs.img ...
#
# An external engine is compiled against fio's own headers (fio.h, ioengines.h and the
# config-host.h its ./configure writes), and must see the same structure layouts as the fio
# binary that loads it. So the script takes the source of exactly the installed version: the
# Debian source package of `dpkg-query -W fio` (fio 3.33-3 on Debian 12), fetched once through
# apt with the machine's own mirrors as deb-src entries in a private apt state (the system's
# apt configuration is not changed), unpacked and configured as Debian configures it, cached in
# ~/.cache/corefs-fio/fio-<version>/. Debian's patches touch only configure's log and the
# Makefile, so the upstream tarball is what is unpacked.
#
# libcorefs is built by cargo (release; --debug: the debug build) unless COREFS_LIB_DIR names a
# directory already holding libcorefs.so (the tests pass target/debug). The engine lands beside
# it, linked with an rpath to it: $COREFS_LIB_DIR/libcorefs_fio.so. Prints that path last.
# Needs fio and gcc (the test command installs both); the fetch needs apt, nothing else.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD

profile=release
if [[ ${1:-} == --debug ]]; then
  profile=debug
fi

for tool in fio gcc apt-get tar; do
  command -v "$tool" >/dev/null || { echo "fio-plugin.sh: $tool not found (apt-get install fio gcc)" >&2; exit 1; }
done

# The installed fio's Debian version (3.33-3) and upstream version (3.33).
deb_version=$(dpkg-query -W -f='${Version}' fio 2>/dev/null) || {
  echo "fio-plugin.sh: fio is not installed as a Debian package (apt-get install fio)" >&2
  exit 1
}
upstream=${deb_version%-*}
upstream=${upstream#*:}
if [[ $(fio --version) != "fio-$upstream" ]]; then
  echo "fio-plugin.sh: fio --version says $(fio --version), the package says $deb_version" >&2
  exit 1
fi

cache=${XDG_CACHE_HOME:-$HOME/.cache}/corefs-fio
src=$cache/fio-$upstream
if [[ ! -f $src/config-host.h ]]; then
  echo "fio-plugin.sh: fetching the source of fio $deb_version (once; cached in $cache)" >&2
  apt_dir=$cache/apt
  rm -rf "$apt_dir" "$src"
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/sources.list.d" "$apt_dir/archives/partial"
  # The machine's binary package sources, as source package sources.
  : >"$apt_dir/sources.list"
  if [[ -f /etc/apt/sources.list ]]; then
    sed -n 's/^[[:space:]]*deb[[:space:]]/deb-src /p' /etc/apt/sources.list >>"$apt_dir/sources.list"
  fi
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -f $f ]] || continue
    sed 's/^Types:[[:space:]]*deb[[:space:]]*$/Types: deb-src/' "$f" >"$apt_dir/sources.list.d/$(basename "$f")"
  done
  for f in /etc/apt/sources.list.d/*.list; do
    [[ -f $f ]] || continue
    sed -n 's/^[[:space:]]*deb[[:space:]]/deb-src /p' "$f" >>"$apt_dir/sources.list"
  done
  apt_opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list"
    -o "Dir::Etc::SourceParts=$apt_dir/sources.list.d"
    -o "Dir::State::Lists=$apt_dir/lists"
    -o "Dir::Cache::Archives=$apt_dir/archives"
    -o "APT::Sandbox::User=root")
  apt-get -q "${apt_opts[@]}" update >&2
  work=$(mktemp -d "$cache/fetch.XXXXXX")
  (cd "$work" && apt-get -q "${apt_opts[@]}" source --download-only "fio=$deb_version" >&2)
  orig=$(ls "$work"/fio_"$upstream".orig.tar.* 2>/dev/null | head -n 1)
  [[ -n $orig ]] || { echo "fio-plugin.sh: apt-get source fetched no fio_$upstream.orig tarball" >&2; exit 1; }
  mkdir -p "$src.tmp"
  tar -xf "$orig" -C "$src.tmp" --strip-components=1
  # Debian's configure line (debian/rules) less --enable-gfio and --enable-libnbd, which add
  # engines and a GUI but change no structure an engine sees.
  (cd "$src.tmp" && ./configure --disable-native --prefix=/usr >"$cache/configure.log" 2>&1) || {
    echo "fio-plugin.sh: fio's configure failed; see $cache/configure.log" >&2
    exit 1
  }
  mv "$src.tmp" "$src"
  rm -rf "$work" "$apt_dir"
fi
[[ $(sed -n 's/^#define FIO_IOOPS_VERSION[[:space:]]*//p' "$src/ioengines.h") == 31 ]] || {
  echo "fio-plugin.sh: fio $upstream's ioengine ABI is not version 31, which the engine is written for" >&2
  exit 1
}

if [[ -n ${COREFS_LIB_DIR:-} ]]; then
  lib_dir=$(cd "$COREFS_LIB_DIR" && pwd)
else
  if [[ $profile == release ]]; then
    cargo build --release --locked -p corefs-bindings >&2
  else
    cargo build --locked -p corefs-bindings >&2
  fi
  lib_dir=$root/target/$profile
fi
[[ -f $lib_dir/libcorefs.so ]] || { echo "fio-plugin.sh: $lib_dir/libcorefs.so is missing" >&2; exit 1; }

# fio's headers are not warning-clean under -Wextra; the engine itself is checked with -Wall
# -Werror and fio's include path as system headers.
gcc -O2 -g -Wall -Werror -fPIC -shared -D_GNU_SOURCE -include "$src/config-host.h" \
  -isystem "$src" -I "$root/bindings/include" "$root/bindings/fio/corefs_fio.c" \
  -L "$lib_dir" -lcorefs -Wl,-rpath,"$lib_dir" -lpthread -o "$lib_dir/libcorefs_fio.so"
echo "$lib_dir/libcorefs_fio.so"
