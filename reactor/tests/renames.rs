//! Renames of directories across reactors, generated: a seeded tree of directories (spread
//! over every shard by mkdir's placement), files and symlinks, then random renames — of
//! directories over empty and non-empty directories, into their own subtrees, exchanges of
//! directories with files and symlinks, RENAME_NOREPLACE — run on one reactor and on two.
//! Every result (or errno) and the final tree must be the same: where an inode, its old and
//! new parents and their ancestors are placed decides only which reactor runs a rename,
//! never what it answers. (Run on two reactors alone, about one rename of a directory in
//! 300 failed with EINVAL: a rename planned on one reactor walked up from the new parent
//! into a directory another reactor holds.) `COREFS_SEED=N` replays a seed.

use engine::{EngineError, MkfsOptions, RenameFlags};
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use reactor::{Client, Config, Op, Owner, Reply, Runtime};
use std::collections::BTreeMap;

fn start(reactors: usize) -> Runtime {
    Runtime::start(Config {
        device: "mem:64MiB".into(),
        mkfs: Some(MkfsOptions {
            shards: 8,
            label: "renames".into(),
            ..Default::default()
        }),
        reactors,
        ..Default::default()
    })
    .unwrap()
}

fn resolve(c: &mut Client, path: &str) -> Result<u64, EngineError> {
    match c.call(Op::resolve(path))? {
        Reply::Stat(s) => Ok(s.ino),
        other => panic!("{other:?}"),
    }
}

/// Splits `a/b/c` into its directory and name.
fn split(path: &str) -> (&str, &str) {
    match path.rfind('/') {
        Some(i) => (&path[..i], &path[i + 1..]),
        None => ("", path),
    }
}

/// One runtime's answer to an operation: the errno, or 0.
fn run(c: &mut Client, op: &Shape) -> i32 {
    let outcome = (|| -> Result<(), EngineError> {
        match op {
            Shape::Mkdir(path) => {
                let (dir, name) = split(path);
                let dir = resolve(c, dir)?;
                c.call(Op::Mkdir {
                    dir,
                    name: name.into(),
                    mode: 0o700,
                    owner: Owner::ROOT,
                })?;
            }
            Shape::File(path) => {
                let (dir, name) = split(path);
                let dir = resolve(c, dir)?;
                c.call(Op::Create {
                    dir,
                    name: name.into(),
                    mode: 0o600,
                    owner: Owner::ROOT,
                })?;
            }
            Shape::Symlink(path) => {
                let (dir, name) = split(path);
                let dir = resolve(c, dir)?;
                c.call(Op::Symlink {
                    dir,
                    name: name.into(),
                    target: b"somewhere".to_vec(),
                    owner: Owner::ROOT,
                })?;
            }
            Shape::Rename(from, to, flags) => {
                let (from_dir, from_name) = split(from);
                let (to_dir, to_name) = split(to);
                let from_dir = resolve(c, from_dir)?;
                let to_dir = resolve(c, to_dir)?;
                c.call(Op::Rename {
                    from_dir,
                    from: from_name.into(),
                    to_dir,
                    to: to_name.into(),
                    flags: *flags,
                })?;
            }
        }
        Ok(())
    })();
    match outcome {
        Ok(()) => 0,
        Err(e) => e.errno(),
    }
}

#[derive(Debug, Clone)]
enum Shape {
    Mkdir(String),
    File(String),
    Symlink(String),
    Rename(String, String, RenameFlags),
}

/// Every path under `dir` (`prefix` its path) with its kind: 'd', 'f' or 'l'.
fn tree(c: &mut Client, dir: u64, prefix: &str, out: &mut BTreeMap<String, char>) {
    let entries = match c
        .call(Op::Readdir {
            dir,
            cookie: 0,
            max: 10_000,
        })
        .unwrap()
    {
        Reply::Entries(e) => e,
        other => panic!("{other:?}"),
    };
    for e in entries {
        let path = format!("{prefix}{}", String::from_utf8_lossy(&e.name));
        let kind = match e.kind as u32 {
            k if k == libc::S_IFDIR >> 12 => 'd',
            k if k == libc::S_IFLNK >> 12 => 'l',
            _ => 'f',
        };
        out.insert(path.clone(), kind);
        if kind == 'd' {
            tree(c, e.ino, &format!("{path}/"), out);
        }
    }
}

/// The paths of the tree's directories (the root as "").
fn dirs_of(tree: &BTreeMap<String, char>) -> Vec<String> {
    std::iter::once(String::new())
        .chain(
            tree.iter()
                .filter(|(_, k)| **k == 'd')
                .map(|(p, _)| p.clone()),
        )
        .collect()
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

fn generated(seed: u64) {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let one = start(1);
    let two = start(2);
    let (mut a, mut b) = (one.client(4), two.client(4));
    // The starting tree: directories three deep, each made where mkdir's round robin puts
    // it (so on either reactor), and files and symlinks among them.
    let mut setup = Vec::new();
    let mut dirs = vec![String::new()];
    for i in 0..14 {
        let parent = dirs[rng.random_range(0..dirs.len())].clone();
        if parent.matches('/').count() >= 2 {
            continue;
        }
        let path = join(&parent, &format!("d{i}"));
        setup.push(Shape::Mkdir(path.clone()));
        dirs.push(path);
    }
    for i in 0..10 {
        let parent = dirs[rng.random_range(0..dirs.len())].clone();
        setup.push(if i % 3 == 0 {
            Shape::Symlink(join(&parent, &format!("l{i}")))
        } else {
            Shape::File(join(&parent, &format!("f{i}")))
        });
    }
    for op in &setup {
        assert_eq!(run(&mut a, op), 0, "seed {seed}: {op:?}");
        assert_eq!(run(&mut b, op), 0, "seed {seed}: {op:?}");
    }
    let mut renamed_dirs = 0;
    for step in 0..300 {
        let mut now = BTreeMap::new();
        tree(&mut a, engine::inode::ROOT_INO, "", &mut now);
        let dirs = dirs_of(&now);
        let names: Vec<&String> = now.keys().collect();
        if names.is_empty() {
            break;
        }
        // Mostly directories as the source, over existing entries or to new names.
        let dir_names: Vec<&String> = now
            .iter()
            .filter(|(_, k)| **k == 'd')
            .map(|(p, _)| p)
            .collect();
        let from = if !dir_names.is_empty() && rng.random_bool(0.7) {
            dir_names[rng.random_range(0..dir_names.len())].clone()
        } else {
            names[rng.random_range(0..names.len())].clone()
        };
        let to = if rng.random_bool(0.6) {
            names[rng.random_range(0..names.len())].clone()
        } else {
            join(&dirs[rng.random_range(0..dirs.len())], &format!("n{step}"))
        };
        let flags = match rng.random_range(0..4) {
            0 => RenameFlags {
                noreplace: true,
                ..Default::default()
            },
            1 => RenameFlags {
                exchange: true,
                ..Default::default()
            },
            _ => RenameFlags::default(),
        };
        let op = Shape::Rename(from.clone(), to, flags);
        let (got_one, got_two) = (run(&mut a, &op), run(&mut b, &op));
        assert_eq!(
            got_one, got_two,
            "seed {seed} step {step}: {op:?}: one reactor says {got_one}, two say {got_two}"
        );
        if got_one == 0 && now.get(&from) == Some(&'d') {
            renamed_dirs += 1;
        }
        // An occasional new directory keeps the tree from collapsing into one chain.
        if step % 10 == 0 {
            let parent = &dirs[rng.random_range(0..dirs.len())];
            if parent.matches('/').count() < 3 {
                let op = Shape::Mkdir(join(parent, &format!("m{step}")));
                assert_eq!(run(&mut a, &op), run(&mut b, &op), "seed {seed}: {op:?}");
            }
        }
    }
    let (mut tree_one, mut tree_two) = (BTreeMap::new(), BTreeMap::new());
    tree(&mut a, engine::inode::ROOT_INO, "", &mut tree_one);
    tree(&mut b, engine::inode::ROOT_INO, "", &mut tree_two);
    assert_eq!(tree_one, tree_two, "seed {seed}: the trees differ");
    assert!(
        renamed_dirs > 10,
        "seed {seed}: only {renamed_dirs} directories moved"
    );
    drop((a, b));
    one.shutdown().unwrap();
    two.shutdown().unwrap();
}

#[test]
fn renames_of_directories_answer_the_same_on_one_reactor_and_on_two() {
    let first = nvme::wrap::seed_from_env();
    let seeds = if std::env::var("COREFS_SEED").is_ok() {
        1
    } else {
        6
    };
    for seed in first..first + seeds {
        eprintln!("renames: seed {seed} (COREFS_SEED={seed} replays it)");
        generated(seed);
    }
}
