#!/usr/bin/env bash
# run.sh - run a static x86_64 Linux test binary inside a tiny QEMU (TCG)
# guest that has an emulated NVMe controller, against /dev/ng0n1.
#
# Builds an uncompressed initramfs (static busybox + nvme modules + the test
# binary + an /init script), boots the cached Debian kernel (see prepare.sh,
# which is run automatically if the cache is missing) with one NVMe
# namespace backed by a fresh sparse file, waits for /dev/ng0n1, runs the
# binary (cwd /tmp, stdin /dev/null, stdout+stderr into a pipe), then powers
# off. Guest ports: ttyS0 = kernel console, ttyS1 = test output,
# ttyS2 = status (exit code, insmod warnings, `dmesg | grep -i nvme`).
#
# Usage:
#   run.sh TEST_BINARY [options] [-- ARGS...]
# Options:
#   --lba 512|4096       namespace logical (and physical) block size [512]
#   --poll-queues N      nvme.ko poll_queues=N (0 = don't pass)      [0]
#   --io-timeout S       nvme-core.ko io_timeout=S: seconds before the driver aborts, then
#                        resets, for a command the controller has not completed (0 = the
#                        driver's 30)                                 [0]
#   --ns-mib N           namespace size in MiB                       [64]
#   --timeout S          host-side timeout for the whole run, seconds [120]
#   --smp N              guest vCPUs                                  [1]
#   --mem MIB            guest RAM in MiB                             [256]
#   --env NAME=VALUE     export in the guest before running (repeatable)
#   --dmesg              print the guest's `dmesg | grep -i nvme` to stderr
#   --keep DIR           copy console/output/status logs into DIR
#   --append STR         extra kernel command line (e.g. "loglevel=7")
# Exit status: the test binary's exit status; 124 on host timeout; 125 if
# the guest never reported one (boot/module/device failure); 2 on usage.
# stdout carries only the test's output; harness messages go to stderr.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${COREFS_GUEST_CACHE:-$HOME/.cache/corefs-nvme-guest}"

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
die() { echo "run.sh: error: $*" >&2; exit 2; }
msg() { echo "run.sh: $*" >&2; }
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

LBA=512 POLL_QUEUES=0 IO_TIMEOUT=0 NS_MIB=64 TIMEOUT=120 SMP=1 MEM=256 DMESG=0 KEEP="" APPEND=""
TEST_BIN="" ENVS=() ARGS=()
while (($#)); do
  case "$1" in
    --lba) LBA="${2:?}"; shift ;;
    --poll-queues) POLL_QUEUES="${2:?}"; shift ;;
    --io-timeout) IO_TIMEOUT="${2:?}"; shift ;;
    --ns-mib) NS_MIB="${2:?}"; shift ;;
    --timeout) TIMEOUT="${2:?}"; shift ;;
    --smp) SMP="${2:?}"; shift ;;
    --mem) MEM="${2:?}"; shift ;;
    --env) [[ "${2:?}" == [A-Za-z_]*=* ]] || die "--env wants NAME=VALUE, got '$2'"; ENVS+=("$2"); shift ;;
    --dmesg) DMESG=1 ;;
    --keep) KEEP="${2:?}"; shift ;;
    --append) APPEND="${2?}"; shift ;;
    -h|--help) usage ;;
    --) shift; ARGS=("$@"); break ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [[ -z "$TEST_BIN" ]] || die "unexpected argument '$1' (test args go after --)"; TEST_BIN="$1" ;;
  esac
  shift
done
[[ -n "$TEST_BIN" ]] || usage
[[ "$LBA" == 512 || "$LBA" == 4096 ]] || die "--lba must be 512 or 4096"
for v in POLL_QUEUES IO_TIMEOUT NS_MIB TIMEOUT SMP MEM; do is_uint "${!v}" || die "${v,,} must be a non-negative integer"; done
((NS_MIB > 0 && TIMEOUT > 0 && SMP > 0 && MEM >= 64)) || die "bad --ns-mib/--timeout/--smp/--mem value"
[[ -f "$TEST_BIN" && -r "$TEST_BIN" ]] || die "test binary '$TEST_BIN' not found/readable"

case "$(python3 "$HERE/guestkit.py" elf-kind "$TEST_BIN")" in
  static) ;;
  dynamic) die "$TEST_BIN is dynamically linked; the guest has no libc (build with -static / +crt-static)" ;;
  *) die "$TEST_BIN is not an x86_64 ELF executable" ;;
esac

# ------------------------------------------------------------ guest kernel
if ! { [[ -f "$CACHE/current.env" ]] && "$HERE/prepare.sh" --quiet; }; then
  msg "guest cache missing or stale; running prepare.sh"
  "$HERE/prepare.sh" || die "prepare.sh failed"
fi
# shellcheck source=/dev/null
source "$CACHE/current.env"
for f in "$KERNEL" "$MODDIR/modules.order" "$BUSYBOX"; do
  [[ -f "$f" ]] || die "$f missing; re-run prepare.sh --refresh"
done

WORK="$(mktemp -d "${TMPDIR:-/tmp}/nvme-guest.XXXXXX")"
QPID=""
# shellcheck disable=SC2317  # invoked via trap
cleanup() {
  if [[ -n "$QPID" ]] && kill -0 "$QPID" 2>/dev/null; then kill "$QPID" 2>/dev/null || true; wait "$QPID" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'msg "interrupted"; exit 130' INT
trap 'msg "terminated"; exit 143' TERM

# ------------------------------------------------------------ initramfs
# Quote a string for POSIX sh (busybox ash) as '...'.
shq() { local s=${1//\'/\'\\\'\'}; printf "'%s'" "$s"; }

# Static part (busybox + applet symlinks + modules) is built once and cached
# as base-<hash>.cpio; the per-run part (/init, test binary, config) is a
# second newc archive appended to it (the kernel unpacks concatenated cpios).
mkcpio() { ( cd "$1" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --quiet -R 0:0 ); }
mapfile -t MODS <"$MODDIR/modules.order"
base_key="$(sha256sum "$BUSYBOX" "$MODDIR/modules.order" "${MODS[@]/#/$MODDIR/}" | sha256sum | cut -c1-16)"
BASE_CPIO="$(dirname "$MODDIR")/base-$base_key.cpio"
if [[ ! -f "$BASE_CPIO" ]]; then
  B="$WORK/base"
  mkdir -p "$B"/{bin,sbin,usr/bin,usr/sbin,dev,proc,sys,tmp,root,etc,modules,test}
  cp "$BUSYBOX" "$B/bin/busybox"
  while read -r applet; do
    [[ "$applet" == bin/busybox || -e "$B/$applet" ]] && continue
    mkdir -p "$B/${applet%/*}"
    ln -s /bin/busybox "$B/$applet"
  done < <("$BUSYBOX" --list-full)
  for m in "${MODS[@]}"; do cp "$MODDIR/$m" "$B/modules/$m"; done
  cp "$MODDIR/modules.order" "$B/modules/modules.order"
  mkcpio "$B" >"$BASE_CPIO.tmp.$$" || die "building base initramfs failed"
  mv -f "$BASE_CPIO.tmp.$$" "$BASE_CPIO"
fi

R="$WORK/root"
mkdir -p "$R/test"
TEST_NAME="$(basename "$TEST_BIN")"
[[ "$TEST_NAME" =~ ^[A-Za-z0-9._+-]+$ ]] || TEST_NAME=testbin
cp "$TEST_BIN" "$R/test/$TEST_NAME"
chmod 0755 "$R/test/$TEST_NAME"
{
  printf 'TEST_NAME=%s\nPOLL_QUEUES=%s\nIO_TIMEOUT=%s\nDEV_TIMEOUT_DS=%s\n' "$(shq "$TEST_NAME")" "$POLL_QUEUES" "$IO_TIMEOUT" 200
  printf 'set --'; for a in ${ARGS[@]+"${ARGS[@]}"}; do printf ' %s' "$(shq "$a")"; done; printf '\n'
  for e in ${ENVS[@]+"${ENVS[@]}"}; do printf 'export %s=%s\n' "${e%%=*}" "$(shq "${e#*=}")"; done
} >"$R/test/config.sh"

cat >"$R/init" <<'INIT'
#!/bin/sh
# Generated by scripts/nvme-guest/run.sh: PID 1 of the NVMe test guest.
export PATH=/bin:/sbin:/usr/bin:/usr/sbin HOME=/root TMPDIR=/tmp
mount -t devtmpfs devtmpfs /dev
exec </dev/null >/dev/console 2>&1
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t tmpfs tmpfs /tmp
OUT=/dev/ttyS1 ST=/dev/ttyS2
stty -F $OUT raw -echo 2>/dev/null
stty -F $ST raw -echo 2>/dev/null
st() { echo "$*" >$ST; echo "nvme-guest: $*"; }
finish() { sync; poweroff -f; sleep 10; }
# shellcheck source=/dev/null
. /test/config.sh
while read -r m; do
  p=""
  [ "${m#*-}" = nvme.ko ] && [ "$POLL_QUEUES" -gt 0 ] && p="poll_queues=$POLL_QUEUES"
  [ "${m#*-}" = nvme-core.ko ] && [ "$IO_TIMEOUT" -gt 0 ] && p="io_timeout=$IO_TIMEOUT"
  if ! insmod "/modules/$m" ${p:+"$p"}; then
    case "$m" in
      *-nvme.ko|*-nvme-core.ko) st "error: insmod $m $p failed"; DEV_TIMEOUT_DS=0 ;;
      *) st "warning: insmod $m $p failed" ;;
    esac
  fi
done </modules/modules.order
i=0
while [ ! -c /dev/ng0n1 ]; do
  i=$((i + 1))
  if [ $i -gt "$DEV_TIMEOUT_DS" ]; then
    st "error: /dev/ng0n1 did not appear"
    ls -l /dev/nvme* /dev/ng* >$ST 2>&1
    dmesg | grep -i nvme >$ST
    finish
  fi
  sleep 0.1
done
cd /tmp || finish
echo 255 >/tmp/.rc
{ "/test/$TEST_NAME" "$@"; echo $? >/tmp/.rc; } 2>&1 | cat >$OUT
st "exit=$(cat /tmp/.rc)"
{ echo "--- dmesg | grep -i nvme ---"; dmesg | grep -i nvme; } >$ST
finish
INIT
chmod 0755 "$R/init"
{ cat "$BASE_CPIO" && mkcpio "$R"; } >"$WORK/initramfs.cpio" || die "building initramfs failed"

# ------------------------------------------------------------ run QEMU
# nvme.ko (6.1) rejects poll_queues > num_possible_cpus(); make enough CPUs
# "possible" (hot-pluggable, not started) without paying for extra vCPUs.
MAXCPUS=$SMP
((POLL_QUEUES > MAXCPUS)) && MAXCPUS=$POLL_QUEUES
truncate -s "${NS_MIB}M" "$WORK/ns1.raw"
: >"$WORK/console.log"; : >"$WORK/output.log"; : >"$WORK/status.log"
# cryptomgr.notests skips the crypto self-tests run when the crc/t10dif
# modules register (saves ~0.5 s of TCG time per boot).
# shellcheck disable=SC2054  # commas inside -device/-drive values are intended
QEMU=(
  qemu-system-x86_64 -nodefaults -no-user-config -display none -no-reboot
  -accel "tcg,thread=multi" -cpu max -smp "$SMP,maxcpus=$MAXCPUS" -m "${MEM}M"
  -kernel "$KERNEL" -initrd "$WORK/initramfs.cpio"
  -append "console=ttyS0 quiet panic=-1 cryptomgr.notests rdinit=/init${APPEND:+ $APPEND}"
  -serial "file:$WORK/console.log" -serial "file:$WORK/output.log" -serial "file:$WORK/status.log"
  -device nvme,id=nvme0,serial=deadbeef
  -drive "file=$WORK/ns1.raw,if=none,id=nvm1,format=raw,cache=unsafe,discard=unmap"
  -device "nvme-ns,drive=nvm1,bus=nvme0,nsid=1,logical_block_size=$LBA,physical_block_size=$LBA"
)
t0=$(date +%s.%N)
timeout --kill-after=5 "$TIMEOUT" "${QEMU[@]}" </dev/null >"$WORK/qemu.log" 2>&1 &
QPID=$!
qrc=0
wait "$QPID" || qrc=$?
QPID=""
t1=$(date +%s.%N)
elapsed=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')

cat "$WORK/output.log"
rc="$(tr -d '\r' <"$WORK/status.log" | sed -n 's/^exit=\([0-9][0-9]*\)$/\1/p' | tail -n 1)"
grep -a '^warning:\|^error:' "$WORK/status.log" | sed 's/^/run.sh: guest: /' >&2 || true
if [[ $DMESG == 1 ]]; then
  sed -n '/^--- dmesg/,$p' "$WORK/status.log" | tr -d '\r' >&2
fi
if [[ -n "$KEEP" ]]; then
  mkdir -p "$KEEP" && cp "$WORK"/{console,output,status,qemu}.log "$KEEP/"
fi

# A command the emulated controller never completed: the run measured the emulator, and a
# failure after it may be the emulator's. Said on every run so the logs show how often.
if stalls=$(tr -d '\r' <"$WORK/status.log" | grep -E 'nvme[0-9]+: I/O [0-9]+ .*timeout'); then
  msg "warning: the emulated controller did not complete $(wc -l <<<"$stalls") command(s) in time:"
  sed 's/^/run.sh:   /' <<<"$stalls" >&2
fi

final=0
if [[ $qrc == 124 || $qrc == 137 ]]; then
  msg "TIMEOUT: guest did not finish within ${TIMEOUT}s; qemu killed"
  final=124
elif [[ -z "$rc" ]]; then
  msg "FAILED: guest never reported an exit status (qemu exit $qrc)"
  final=125
else
  final=$rc
fi
if ((final != 0)); then
  msg "--- qemu stderr ---"; tail -n 20 "$WORK/qemu.log" >&2 || true
  msg "--- tail of guest kernel console ---"; tail -n 40 "$WORK/console.log" | tr -d '\r' >&2 || true
  # The console is quiet (errors only); the driver's warnings (timeouts, resets, a
  # controller removed) are in the dmesg the guest wrote to its status port.
  if [[ $DMESG != 1 ]]; then
    msg "--- guest dmesg | grep -i nvme ---"
    sed -n '/^--- dmesg/,$p' "$WORK/status.log" | tr -d '\r' | sed 1d | tail -n 60 >&2 || true
  fi
fi
msg "kernel $KVER, lba $LBA, poll_queues $POLL_QUEUES: test exit ${rc:-none}; boot+test+poweroff ${elapsed}s"
exit "$final"
