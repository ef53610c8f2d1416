//! The engine's tracing spans: mount, log replay, and a commit's phases (start, each slice,
//! superblock write) each open a span named for the phase, with the generation as a field
//! (not in a formatted message), so a subscriber can time and filter them.

use engine::format::{ItemKind, Key};
use engine::{Filesystem, MkfsOptions, MountOptions};
use nvme::backend::mem::{MemConfig, MemDevice};
#[path = "support/span_recorder.rs"]
mod span_recorder;
use span_recorder::SpanRecorder;

#[test]
fn mount_replay_and_commit_phases_open_spans_with_their_generation() {
    let dev = MemDevice::new(MemConfig {
        capacity_bytes: 8 << 20,
        ..Default::default()
    })
    .unwrap();
    let options = MkfsOptions {
        shards: 2,
        label: "spans".into(),
        ..Default::default()
    };
    let dev = Filesystem::mkfs(Box::new(dev), &options).unwrap();
    let recorder = SpanRecorder::default();
    tracing::subscriber::with_default(recorder.clone(), || {
        let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
        fs.insert_item(1, Key::new(300, ItemKind::Test, 0), vec![1])
            .unwrap();
        assert_eq!(fs.commit().unwrap(), 3, "mkfs committed generation 2");
    });
    let spans = recorder.spans();
    let has = |prefix: &str| spans.iter().any(|s| s.starts_with(prefix));
    for expected in [
        "mount{device_blocks=2048}",
        "replay_logs{shards=2}",
        "commit_start{generation=3}",
        "commit_slice{generation=3 shard=",
        "super_write{generation=3 ",
    ] {
        assert!(has(expected), "no span {expected} in {spans:?}");
    }
    let positions: Vec<usize> = ["mount{", "replay_logs{", "commit_start{", "super_write{"]
        .iter()
        .map(|p| spans.iter().position(|s| s.starts_with(p)).unwrap())
        .collect();
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "spans out of order: {spans:?}"
    );
}
