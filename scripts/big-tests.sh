#!/usr/bin/env bash
# big-tests.sh - the tests too long for every CI run, in release builds: a million names in
# one directory (engine/tests/pool.rs), listed as ignored by `cargo test` and never skipped
# silently; and the differential runs against the kernel, through the C ABI
# (bindings/tests/differential.rs) and through the FUSE mount (cli/tests/differential.rs, as
# root), at 200,000 operations per reactor count instead of CI's 3,000 (COREFS_DIFF_OPS).
# COREFS_SEED=N replays a layout or a sequence.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cargo test --locked --release -p corefs-engine --test pool -- --ignored --nocapture
export COREFS_DIFF_OPS=${COREFS_DIFF_OPS:-200000}
cargo test --locked --release -p corefs-bindings --test differential -- --nocapture
cargo test --locked --release -p corefs-cli --test differential -- --nocapture
