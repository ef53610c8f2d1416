//! A short `corefs soak`: the verified mixed workload runs, every read back matches, and the
//! report has its samples (RSS and descriptors are printed for people, not asserted).

use std::process::Command;

#[test]
fn a_short_soak_verifies_its_reads() {
    let out = Command::new(env!("CARGO_BIN_EXE_corefs"))
        .args([
            "soak",
            "--seconds",
            "2",
            "--interval",
            "0.5",
            "--clients",
            "4",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary = text
        .lines()
        .find(|l| l.starts_with("soak:"))
        .expect("summary line");
    let numbers: Vec<u64> = summary
        .split_whitespace()
        .filter_map(|w| w.trim_end_matches(',').parse().ok())
        .collect();
    assert!(
        numbers.len() >= 2 && numbers[0] > 0 && numbers[1] > 0,
        "{summary}"
    );
    assert!(
        text.lines()
            .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
            .count()
            >= 3,
        "{text}"
    );
}
