//! The reactor's tracing spans: each fsync group it starts opens a span `fsync_group_start`
//! with the group's size as a field. A process-wide subscriber (this test binary holds only
//! this test), as the reactor's threads are not the test's.

use engine::MkfsOptions;
use reactor::{Config, Op, Reply, Runtime};
#[path = "../../engine/tests/support/span_recorder.rs"]
mod span_recorder;
use span_recorder::SpanRecorder;

const ROOT: u64 = 256;

#[test]
fn an_fsync_group_opens_a_span_with_its_size() {
    let recorder = SpanRecorder::default();
    tracing::subscriber::set_global_default(recorder.clone()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let runtime = Runtime::start(Config {
        device: format!("file:{}/fs.img,size=64MiB", dir.path().display()),
        mkfs: Some(MkfsOptions {
            shards: 4,
            label: "spans".into(),
            ..Default::default()
        }),
        ..Default::default()
    })
    .unwrap();
    let mut client = runtime.client(4);
    let ino = match client
        .call(Op::Create {
            dir: ROOT,
            name: b"f".to_vec(),
            mode: 0o644,
            owner: reactor::Owner::ROOT,
        })
        .unwrap()
    {
        Reply::Stat(s) => s.ino,
        other => panic!("expected a stat, got {other:?}"),
    };
    client
        .call(Op::Write {
            ino,
            offset: 0,
            data: vec![7; 4096].into(),
        })
        .unwrap();
    client.call(Op::Fsync { ino }).unwrap();
    drop(client);
    runtime.shutdown().unwrap();
    let spans = recorder.spans();
    assert!(
        spans.iter().any(|s| s == "fsync_group_start{members=1}"),
        "no fsync group span in {spans:?}"
    );
}
