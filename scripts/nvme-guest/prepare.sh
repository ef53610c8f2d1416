#!/usr/bin/env bash
# prepare.sh - one-time (idempotent) setup for the NVMe QEMU test guest.
#
# * installs qemu-system-x86, busybox-static, cpio, kmod if missing
#   (--no-install-recommends; on bookworm this may remove a backported
#   qemu-utils, which is accepted);
# * fetches the Debian kernel that linux-image-amd64 depends on with
#   `apt-get download` (the meta package itself is NOT installed: it would
#   pull udev/systemd), unpacks it with dpkg-deb -x into a scratch dir;
# * extracts the ELF vmlinux out of the bzImage (PVH boot is ~2.5 s faster
#   under TCG than booting the bzImage);
# * resolves the nvme module load order via depmod + modprobe --show-depends
#   and copies the (decompressed) modules into the cache.
#
# Result: $CACHE/current.env (sourced by run.sh) pointing at
#   $CACHE/<kver>/{vmlinux,vmlinuz,modules/NN-name.ko,modules.order}.
# A second run does no downloads. Use --refresh to re-resolve the kernel
# (e.g. after a Debian kernel ABI bump). COREFS_GUEST_KPKG overrides the
# kernel package name (e.g. linux-image-6.1.0-57-amd64).
#
# Usage: prepare.sh [--refresh] [--quiet]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${COREFS_GUEST_CACHE:-$HOME/.cache/corefs-nvme-guest}"
PACKAGES=(qemu-system-x86 busybox-static cpio kmod)
REFRESH=0
QUIET=0

die() { echo "prepare.sh: error: $*" >&2; exit 1; }
log() { [[ $QUIET == 1 ]] || echo "prepare.sh: $*" >&2; }

while (($#)); do
  case "$1" in
    --refresh) REFRESH=1 ;;
    --quiet) QUIET=1 ;;
    -h|--help) sed -n '2,22p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) die "unknown argument: $1" ;;
  esac
  shift
done

mkdir -p "$CACHE"
# Serialise concurrent prepare runs (e.g. two cold run.sh invocations).
exec 9>"$CACHE/.lock"
flock 9

# ---------------------------------------------------------------- packages
pkg_installed() {
  [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true)" == "install ok installed" ]]
}
missing=()
for p in "${PACKAGES[@]}"; do pkg_installed "$p" || missing+=("$p"); done
if ((${#missing[@]})); then
  log "installing missing packages: ${missing[*]}"
  [[ $EUID -eq 0 ]] || die "need root to install: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >&2; then
    log "apt-get install failed; running apt-get update and retrying"
    apt-get update -q >&2 || die "apt-get update failed"
    apt-get install -y -q --no-install-recommends "${missing[@]}" >&2 \
      || die "apt-get install ${missing[*]} failed"
  fi
fi
for tool in qemu-system-x86_64 busybox cpio depmod modprobe python3 dpkg-deb apt-get; do
  command -v "$tool" >/dev/null || die "required tool '$tool' not found in PATH"
done
BUSYBOX="$(command -v busybox)"
if command -v readelf >/dev/null && readelf -l "$BUSYBOX" 2>/dev/null | grep -q INTERP; then
  die "$BUSYBOX is dynamically linked; install busybox-static"
fi

# ---------------------------------------------------------------- kernel
env_ok() {
  [[ -f "$CACHE/current.env" ]] || return 1
  # shellcheck source=/dev/null
  ( source "$CACHE/current.env" && [[ -f "$KERNEL" && -f "$MODDIR/modules.order" && -f "$MODDIR/.complete" ]] )
}
if [[ $REFRESH == 0 ]] && env_ok; then
  log "cache ok: $(grep '^KVER=' "$CACHE/current.env")"
  exit 0
fi

KPKG="${COREFS_GUEST_KPKG:-}"
if [[ -z "$KPKG" ]]; then
  KPKG="$(apt-cache depends linux-image-amd64 2>/dev/null \
          | awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9].*-amd64$/ { print $2; exit }')"
  if [[ -z "$KPKG" ]]; then
    log "linux-image-amd64 not known to apt; running apt-get update"
    apt-get update -q >&2 || die "apt-get update failed"
    KPKG="$(apt-cache depends linux-image-amd64 2>/dev/null \
            | awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9].*-amd64$/ { print $2; exit }')"
  fi
  [[ -n "$KPKG" ]] || die "could not resolve the linux-image-<kver>-amd64 package behind linux-image-amd64"
fi
KVER="${KPKG#linux-image-}"
[[ "$KVER" != "$KPKG" && -n "$KVER" ]] || die "unexpected kernel package name '$KPKG'"
log "kernel package: $KPKG (kver $KVER)"

DEBDIR="$CACHE/debs"
OUT="$CACHE/$KVER"
mkdir -p "$DEBDIR"
deb="$(find "$DEBDIR" -maxdepth 1 -name "${KPKG}_*_amd64.deb" -print -quit)"
if [[ -z "$deb" ]]; then
  log "downloading $KPKG (~70 MB)"
  dl="$(mktemp -d "$DEBDIR/.dl.XXXXXX")"
  ( cd "$dl" && apt-get download -q -o APT::Sandbox::User=root "$KPKG" >&2 ) \
    || { rm -rf "$dl"; die "apt-get download $KPKG failed (try apt-get update?)"; }
  mv "$dl"/*.deb "$DEBDIR/" && rmdir "$dl"
  deb="$(find "$DEBDIR" -maxdepth 1 -name "${KPKG}_*_amd64.deb" -print -quit)"
  [[ -n "$deb" ]] || die "download of $KPKG produced no .deb"
else
  log "using cached $(basename "$deb")"
fi

scratch="$(mktemp -d "${TMPDIR:-/tmp}/nvme-guest-prep.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
root="$scratch/root"
log "unpacking $(basename "$deb")"
dpkg-deb -x "$deb" "$root" || die "dpkg-deb -x failed on $deb"
bzimage="$root/boot/vmlinuz-$KVER"
[[ -f "$bzimage" ]] || die "$deb has no boot/vmlinuz-$KVER"
moddir_src="$root/lib/modules/$KVER"
[[ -d "$moddir_src" ]] || die "$deb has no lib/modules/$KVER"

rm -rf "$OUT.new"
mkdir -p "$OUT.new/modules"
cp "$bzimage" "$OUT.new/vmlinuz"
python3 "$HERE/guestkit.py" extract-vmlinux "$bzimage" "$OUT.new/vmlinux" >&2 \
  || die "could not extract vmlinux from $bzimage"
if python3 "$HERE/guestkit.py" has-pvh-note "$OUT.new/vmlinux"; then
  KERNEL="$OUT/vmlinux"; KERNEL_KIND=pvh-elf
else
  log "warning: vmlinux has no PVH entry note; will boot the (slower) bzImage"
  rm -f "$OUT.new/vmlinux"
  KERNEL="$OUT/vmlinuz"; KERNEL_KIND=bzimage
fi

log "resolving nvme module dependencies"
depmod -b "$root" "$KVER" || die "depmod -b $root $KVER failed"
# crc64-rocksoft (needed by t10-pi) asks the crypto API for "crc64-rocksoft"
# at init time via request_module(); that crypto driver is not a (soft)dep,
# so modprobe would not list it. There is no modprobe/modules.dep in the
# guest, so preload it explicitly (optional: ignored if the alias is absent).
extra_deps=""
for alias in ${COREFS_GUEST_EXTRA_MODULES-crypto-crc64-rocksoft}; do
  if d="$(modprobe -d "$root" -S "$KVER" --show-depends -a "$alias" 2>/dev/null)"; then
    extra_deps+="$d"$'\n'
  else
    log "note: optional module/alias '$alias' not found, skipping"
  fi
done
deps="$(modprobe -d "$root" -S "$KVER" --show-depends -a nvme)" \
  || die "modprobe --show-depends -a nvme failed"
deps="$extra_deps$deps"
n=0
declare -A seen=()
: >"$OUT.new/modules/modules.order"
while read -r verb path _rest; do
  case "$verb" in
    insmod) ;;
    builtin|"") continue ;;        # compiled in / blank: nothing to load
    *) die "unexpected modprobe output: $verb $path" ;;
  esac
  # --show-depends -a repeats shared deps (and softdeps); keep first occurrence.
  [[ -z "${seen[$path]:-}" ]] || continue
  seen[$path]=1
  [[ -f "$path" ]] || die "module file $path missing"
  name="$(basename "$path")"; name="${name%%.ko*}"
  dst="$(printf '%02d-%s.ko' "$n" "$name")"
  python3 "$HERE/guestkit.py" decompress "$path" "$OUT.new/modules/$dst" \
    || die "could not decompress $path"
  echo "$dst" >>"$OUT.new/modules/modules.order"
  n=$((n + 1))
done <<<"$deps"
((n > 0)) || grep -q '^builtin nvme' <<<"$deps" || die "no nvme modules resolved"
grep -q -- '-nvme\.ko$' "$OUT.new/modules/modules.order" || grep -q '^builtin nvme' <<<"$deps" \
  || die "nvme.ko not in resolved module list"
touch "$OUT.new/modules/.complete"

rm -rf "$OUT"
mv "$OUT.new" "$OUT"
{
  printf 'KVER=%q\n' "$KVER"
  printf 'KPKG=%q\n' "$KPKG"
  printf 'KERNEL=%q\n' "$KERNEL"
  printf 'KERNEL_KIND=%q\n' "$KERNEL_KIND"
  printf 'MODDIR=%q\n' "$OUT/modules"
  printf 'BUSYBOX=%q\n' "$BUSYBOX"
} >"$CACHE/current.env.tmp"
mv "$CACHE/current.env.tmp" "$CACHE/current.env"
log "kernel $KVER ($KERNEL_KIND); module order: $(sed 's/^[0-9]*-//; s/\.ko$//' "$OUT/modules/modules.order" | paste -sd' ')"
