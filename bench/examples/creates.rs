//! Profiling aid: only the engine's create loop (300,000 empty files over 16 directories on
//! the memory backend), for `perf record` or `valgrind --tool=callgrind`.

use engine::{Filesystem, MkfsOptions, MountOptions};

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(300_000);
    let dev = nvme::open_device("mem:8GiB,buf=1MiB,bufs=64", &Default::default()).unwrap();
    let dev = Filesystem::mkfs(
        dev,
        &MkfsOptions {
            shards: 16,
            label: String::new(),
            ..Default::default()
        },
    )
    .unwrap();
    let mut fs = Filesystem::mount(
        dev,
        MountOptions {
            cache_nodes: 1 << 20,
            ..Default::default()
        },
    )
    .unwrap();
    let root = fs.root();
    let dirs: Vec<u64> = (0..16)
        .map(|i| {
            fs.mkdir(root, format!("d{i}").as_bytes(), 0o755, 0, 0)
                .unwrap()
                .ino
        })
        .collect();
    let start = std::time::Instant::now();
    for i in 0..n {
        fs.create(
            dirs[(i % 16) as usize],
            format!("f{i}").as_bytes(),
            0o644,
            0,
            0,
        )
        .unwrap();
    }
    println!("{:.0} creates/s", n as f64 / start.elapsed().as_secs_f64());
}
