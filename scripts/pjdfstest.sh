#!/usr/bin/env bash
# pjdfstest, the POSIX conformance suite, on `corefs mount --allow-other` and, for comparison,
# on ext4 (a loop device) with the same configuration; prints both summaries and the tests
# that fail on corefs but pass on ext4, and exits non-zero if there is one that is not a
# listed exception (docs/usage.md, "POSIX conformance").
#
# The suite is pjdfstest's Rust rewrite (crates.io `pjdfstest`, pinned below): the project's
# machines reach package registries only, not the C suite's git repository. It runs as root;
# the test cases that switch users run as nobody and daemon, which the mount admits only
# with --allow-other. The EROFS cases remount the filesystem read-only and back.
#
# Needs root (mount, loop devices, users). Under a minute after the first build.
#   scripts/pjdfstest.sh                 # everything
#   scripts/pjdfstest.sh rename chmod    # test cases whose names contain a pattern
# Environment: COREFS_PJDFSTEST_WORK (default /var/tmp/corefs-pjdfstest) keeps the built
# suite between runs, and the images, mountpoints and logs of the last run.
set -euo pipefail

PJDFSTEST_VERSION=0.2.2
cd "$(dirname "$0")/.."
REPO=$PWD
WORK=${COREFS_PJDFSTEST_WORK:-/var/tmp/corefs-pjdfstest}
# Test cases that may fail or be skipped on corefs although they pass on ext4, each with its
# reason in docs/usage.md ("POSIX conformance"). link_count_max: pjdfstest's own guard skips it
# on FUSE (pathconf answers 127 there); corefs passes the same check through its C ABI.
EXCEPTIONS=(link::link_count_max)

if [ "$(id -u)" -ne 0 ]; then
    echo "pjdfstest.sh: needs root (FUSE and loop mounts, switching users)" >&2
    exit 2
fi
for who in nobody:nogroup daemon:daemon; do
    if ! getent passwd "${who%%:*}" >/dev/null || ! getent group "${who##*:}" >/dev/null; then
        echo "pjdfstest.sh: needs user ${who%%:*} and group ${who##*:}" >&2
        exit 2
    fi
done
# libacl: the suite links it. e2fsprogs: mkfs.ext4. fuse3: /dev/fuse's module and tools.
missing=()
dpkg -s libacl1-dev >/dev/null 2>&1 || missing+=(libacl1-dev)
command -v mkfs.ext4 >/dev/null || missing+=(e2fsprogs)
command -v fusermount3 >/dev/null || missing+=(fuse3)
if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

cargo_cmd=cargo
command -v cargo-locked >/dev/null && cargo_cmd=cargo-locked
mkdir -p "$WORK"
PJDFSTEST=$WORK/bin/pjdfstest
if ! [ -x "$PJDFSTEST" ] || ! "$PJDFSTEST" --version 2>/dev/null | grep -q "$PJDFSTEST_VERSION"; then
    $cargo_cmd install pjdfstest --version "$PJDFSTEST_VERSION" --locked --root "$WORK"
fi
$cargo_cmd build --release -p corefs-cli
COREFS=$REPO/target/release/corefs

# Features Linux has (both filesystems are run with the same); naptime is longer than ext4's
# timestamp granularity (a jiffy), or its time tests fail. Users: see above.
CONFIG=$WORK/pjdfstest.toml
cat >"$CONFIG" <<'EOF'
[features]
posix_fallocate = {}
rename_ctime = {}
utime_now = {}
utimensat = {}

[settings]
naptime = 0.05
allow_remount = true

[dummy_auth]
entries = [
  ["nobody", "nogroup"],
  ["daemon", "daemon"],
]
EOF

SECONDARY=$WORK/secondary # another filesystem, for the EXDEV cases
# The EROFS cases run `mount -o remount,ro` (and rw): with -i, mount(8) asks the kernel
# itself instead of handing a FUSE remount to mount.fuse3, which would look for a program
# named after the mount's source. The same wrapper serves ext4, where it changes nothing.
WRAP=$WORK/wrap
mkdir -p "$WRAP"
printf '#!/bin/sh\nexec %s -i "$@"\n' "$(command -v mount)" >"$WRAP/mount"
chmod 755 "$WRAP/mount"
CMNT=$WORK/corefs-mnt
EMNT=$WORK/ext4-mnt
mkdir -p "$SECONDARY" "$CMNT" "$EMNT"
SERVER=
cleanup() {
    if mountpoint -q "$CMNT"; then umount "$CMNT" || umount -l "$CMNT"; fi
    if mountpoint -q "$EMNT"; then umount "$EMNT" || umount -l "$EMNT"; fi
    if [ -n "$SERVER" ]; then wait "$SERVER" 2>/dev/null || true; fi
}
trap cleanup EXIT

# Runs the suite once in $1 (a mountpoint) with its output in $2, with the patterns after.
run_once() {
    chmod 755 "$1"
    # Exit status 1 means failed test cases, which the comparison below reports.
    PATH=$WRAP:$PATH NO_COLOR=1 RUST_BACKTRACE=0 "$PJDFSTEST" -c "$CONFIG" -p "$1" -s "$SECONDARY" "${@:3}" \
        >"$2" 2>&1 || true
    grep -q '^Summary: ' "$2" || { echo "pjdfstest did not finish on $1: see $2" >&2; exit 1; }
}

# Each test case's result line in a log: "name ok", "name FAILED", "name skipped".
results() {
    grep -E '^[A-Za-z0-9_]+(::[A-Za-z0-9_]+)+ +[A-Za-z ]+$' "$1" | awk '{print $1, $NF}'
}

# Runs the suite in $1 with its output in $2 and each test case's result in $2.results. The
# read-only cases (erofs) run again in a process of their own, and their results are taken
# from there: in 0.2.2, posix_fallocate::affected_only_create_flags leaves two files open for
# writing until the process exits (raw descriptors it never closes), after which every
# read-only remount is refused ("mount point is busy"), on ext4 as on corefs.
run_suite() {
    run_once "$@"
    if [ $# -eq 2 ]; then
        run_once "$1" "$2.erofs" erofs
        { results "$2" | grep -v '::erofs_'; results "$2.erofs"; } | sort >"$2.results"
    else
        results "$2" | sort >"$2.results"
    fi
}

# "N passed, N failed, N skipped" of a results file.
summary() {
    awk '{n[$2]++} END {printf "%d passed, %d failed, %d skipped (%d test cases)\n",
        n["ok"], n["FAILED"], n["skipped"], NR}' "$1"
}

passed_cases() { awk '$2 == "ok" {print $1}' "$1" | sort -u; }

echo "== corefs (mount --allow-other ${COREFS_MOUNT_ARGS:-})"
IMAGE=$WORK/corefs.img
rm -f "$IMAGE"
"$COREFS" mkfs "file:$IMAGE,size=1GiB" --shards 4 >/dev/null
# COREFS_MOUNT_ARGS adds mount options (e.g. "--atime noatime": opens then make no request).
# shellcheck disable=SC2086 # the options are words
NO_COLOR=1 "$COREFS" mount "file:$IMAGE" "$CMNT" --allow-other ${COREFS_MOUNT_ARGS:-} \
    >"$WORK/corefs-server.log" 2>&1 &
SERVER=$!
for _ in $(seq 300); do
    mountpoint -q "$CMNT" && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/corefs-server.log" >&2; exit 1; }
    sleep 0.1
done
mountpoint -q "$CMNT" || { echo "the corefs mount did not appear" >&2; exit 1; }
run_suite "$CMNT" "$WORK/corefs.log" "$@"
umount "$CMNT"
wait "$SERVER" || { echo "corefs mount exited with $?" >&2; cat "$WORK/corefs-server.log" >&2; exit 1; }
SERVER=
if grep -E ' (ERROR|WARN) ' "$WORK/corefs-server.log" | grep -v 'hugepages'; then
    echo "the corefs server logged the errors or warnings above" >&2
    exit 1
fi
"$COREFS" fsck "file:$IMAGE" >"$WORK/corefs-fsck.log" 2>&1 ||
    { cat "$WORK/corefs-fsck.log" >&2; exit 1; }

echo "== ext4 (loop device)"
EXT4=$WORK/ext4.img
rm -f "$EXT4"
truncate -s 1G "$EXT4"
mkfs.ext4 -q -F "$EXT4"
mount -o loop "$EXT4" "$EMNT"
run_suite "$EMNT" "$WORK/ext4.log" "$@"
umount "$EMNT"

echo
echo "pjdfstest $PJDFSTEST_VERSION (test cases; logs in $WORK):"
echo "  corefs: $(summary "$WORK/corefs.log.results")"
echo "  ext4:   $(summary "$WORK/ext4.log.results")"
# Passed on ext4 but not on corefs (failed, or skipped).
regressions=$(comm -13 <(passed_cases "$WORK/corefs.log.results") <(passed_cases "$WORK/ext4.log.results"))
unexpected=()
for case in $regressions; do
    listed=no
    for e in "${EXCEPTIONS[@]}"; do [ "$e" = "$case" ] && listed=yes; done
    if [ $listed = yes ]; then
        echo "  does not pass on corefs, passes on ext4 (a listed exception): $case"
    else
        echo "  DOES NOT PASS ON COREFS, PASSES ON EXT4: $case"
        unexpected+=("$case")
    fi
done
[ ${#unexpected[@]} -eq 0 ] || exit 1
echo "  every test case that passes on ext4 passes on corefs, but the listed exceptions"
