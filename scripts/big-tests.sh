#!/usr/bin/env bash
# big-tests.sh - the tests too long for every CI run, in release builds: a million names in
# one directory (engine/tests/pool.rs). Listed as ignored by `cargo test`, never skipped
# silently; run them here. COREFS_SEED=N replays a layout.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cargo test --locked --release -p corefs-engine --test pool -- --ignored --nocapture
