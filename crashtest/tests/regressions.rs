//! The classic fsync bugs of btrfs and ext4 as named crash workloads (xfstests generic/ and
//! CrashMonkey cases; the rules they check are listed, numbered, in docs/durability.md). Each
//! crash state at every persistence point and flush is mounted and checked by the oracle, as
//! in the ACE runs. fsync of an unlinked *open* file (rule 12) needs a handle the workloads do
//! not have: engine/tests/posix_objects.rs checks it.

use crashtest::workload::{Falloc, Step};

/// Runs `ops` from each base (clean, and recovering: after a crash and its replay) under
/// every schedule.
fn check(name: &str, ops: &[Step]) {
    let seed = nvme::wrap::seed_from_env();
    for kind in crashtest::BaseKind::ALL {
        let outcome = crashtest::run(crashtest::Base::get(kind), ops, seed)
            .unwrap_or_else(|why| panic!("{name} ({} base): {why}", kind.name()));
        assert!(
            outcome.persistence_points > 0 && outcome.crash_states > 0,
            "{name}: nothing was checked"
        );
    }
}

const APPEND: Step = Step::Write {
    path: "foo",
    offset: 0,
    len: 4096,
    append: true,
};

#[test]
fn fsync_after_linking_into_a_new_directory() {
    // CM 7, generic/520: both names exist, nlink 2.
    check(
        "link into new dir",
        &[
            Step::Mkdir("B/D"),
            Step::Link("foo", "B/D/foo"),
            Step::Fsync("foo"),
        ],
    );
}

#[test]
fn rename_then_fsync_of_the_new_name() {
    // generic/322: bar has the data, foo is gone.
    check(
        "rename then fsync",
        &[
            APPEND,
            Step::Fsync("foo"),
            Step::Rename("foo", "bar"),
            Step::Fsync("bar"),
        ],
    );
}

#[test]
fn rename_over_an_existing_name() {
    check(
        "rename over",
        &[
            Step::Creat("bar"),
            Step::Write {
                path: "bar",
                offset: 0,
                len: 3000,
                append: false,
            },
            Step::Sync,
            Step::Rename("foo", "bar"),
            Step::Fsync("bar"),
        ],
    );
}

#[test]
fn a_new_file_with_the_old_name_after_a_rename() {
    // generic/341, 342: both exist, nothing lost.
    check(
        "old name reused",
        &[
            Step::Rename("foo", "bar"),
            Step::Creat("foo"),
            Step::Fsync("foo"),
        ],
    );
    check(
        "old name reused, fsync the renamed",
        &[
            Step::Rename("foo", "bar"),
            Step::Creat("foo"),
            Step::Fsync("bar"),
        ],
    );
}

#[test]
fn directory_fsync_after_creating_entries() {
    // CM 6, generic/321: fsync of a directory persists its entries.
    check(
        "dir fsync",
        &[
            Step::Creat("A/bar"),
            Step::Creat("A/C/bar"),
            Step::Fsync("A"),
        ],
    );
}

#[test]
fn unlink_of_a_hard_link_then_fsync_of_the_other_name() {
    // generic/039, 106: bar gone, nlink right, parent removable.
    check(
        "unlink link",
        &[
            Step::Link("foo", "bar"),
            Step::Sync,
            Step::Unlink("bar"),
            Step::Fsync("foo"),
        ],
    );
}

#[test]
fn truncate_down_then_up_then_fsync() {
    // generic/101: the gap reads as zeroes.
    check(
        "truncate down up",
        &[
            Step::Truncate("foo", 2500),
            Step::Truncate("foo", 20_000),
            Step::Fsync("foo"),
        ],
    );
}

#[test]
fn fallocate_keep_size_past_eof_then_fdatasync() {
    // generic/468, 483; CM 8, 9: blocks and size preserved.
    check(
        "falloc keep size",
        &[
            Step::Falloc {
                path: "foo",
                mode: Falloc::KeepSize,
                offset: 16_384,
                len: 8192,
            },
            Step::Fdatasync("foo"),
        ],
    );
}

#[test]
fn punch_hole_then_fsync() {
    // generic/059: holes and data exact.
    check(
        "punch",
        &[
            Step::Falloc {
                path: "foo",
                mode: Falloc::PunchHole,
                offset: 2048,
                len: 6000,
            },
            Step::Fsync("foo"),
        ],
    );
}

#[test]
fn xattr_removal_then_fsync() {
    // generic/066: the xattr is gone.
    check(
        "xattr removal",
        &[
            Step::SetXattr("foo", 3),
            Step::Sync,
            Step::RemoveXattr("foo"),
            Step::Fsync("foo"),
        ],
    );
}

#[test]
fn rename_of_a_synced_directory_then_fsync_of_a_new_child() {
    // CM 4, 10: mkdir; sync; mv; touch child; fsync(child) → the child exists under the new name.
    check(
        "renamed dir child",
        &[
            Step::Mkdir("B/D"),
            Step::Sync,
            Step::Rename("B/D", "A/D"),
            Step::Creat("A/D/foo"),
            Step::Fsync("A/D/foo"),
        ],
    );
}

#[test]
fn rename_of_an_ancestor_then_fsync_of_an_old_file_by_its_new_path() {
    // The file's own name did not change, its parent's did: fsync must make the path it was
    // reached by durable (btrfs logs the renamed ancestor, or commits).
    for persist in [Step::Fsync("B/D/foo"), Step::Fdatasync("B/D/foo")] {
        check(
            "renamed ancestor",
            &[
                Step::Rename("A", "B/D"),
                Step::Write {
                    path: "B/D/foo",
                    offset: 0,
                    len: 4096,
                    append: true,
                },
                persist,
            ],
        );
    }
}

#[test]
fn rename_two_levels_above_a_file_then_fsync_of_it_by_its_new_path() {
    // Issue 36's smallest case: `create A/C/foo; sync; rename A B/D; fsync B/D/C/foo`. Neither
    // the file nor its parent `C` changed; the directory above `C` moved, so the walk up must
    // pass `C` (whose own name is durable) to log `A`'s move. Three levels too, and a new
    // file below the moved directory.
    for tail in [
        vec![Step::Fsync("B/D/C/foo")],
        vec![Step::Fsync("B/D/C/E/baz")],
        vec![Step::Creat("B/D/C/E/qux"), Step::Fsync("B/D/C/E/qux")],
        vec![
            Step::SetXattr("B/D/C/E/baz", 4),
            Step::Fdatasync("B/D/C/E/baz"),
            Step::Fsync("B/D/C/E/baz"),
        ],
    ] {
        let mut ops = vec![Step::Creat("A/C/foo"), Step::Sync, Step::Rename("A", "B/D")];
        ops.extend(tail);
        check("deep renamed ancestor", &ops);
    }
}

#[test]
fn fsync_of_the_parent_after_an_undone_xattr_change() {
    // A length-two ACE run found it (an oracle gap): the prelude fsyncs foo without the xattr;
    // the xattr is set and synced, then removed, and the root is fsynced. The removal was
    // never fsynced, so the synced xattr may be there after a crash; the prelude's promise
    // no longer binds although foo looks as it did then.
    check(
        "undone xattr, parent fsynced",
        &[
            Step::SetXattr("foo", 1),
            Step::Sync,
            Step::RemoveXattr("foo"),
            Step::Fsync(""),
        ],
    );
}
