//! The tree against a `BTreeMap` model, through commits, evictions and reopens from disk, on an
//! in-memory block store that checks the copy-on-write discipline: a committed block is never
//! overwritten while a committed root may still reach it.

use super::*;
use crate::format::{decode_node, ItemKind};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet, HashMap};

#[derive(Default)]
struct MemIo {
    blocks: HashMap<u64, Vec<u8>>,
    next: u64,
    free: Vec<u64>,
    /// Freed in the running transaction but maybe referenced by the committed root.
    pinned: Vec<u64>,
    /// Freed in a frozen generation being written: released when it is (its superblock).
    pinned_frozen: Vec<u64>,
    /// Every block the last committed root reaches: never written over.
    committed: BTreeSet<u64>,
    allocated: BTreeSet<u64>,
    reads: u64,
}

impl NodeIo for MemIo {
    fn read_node(&mut self, ptr: &BlockPtr, owner: u32, level: u8) -> Result<NodeBody> {
        self.reads += 1;
        let block = self
            .blocks
            .get(&ptr.addr)
            .ok_or_else(|| EngineError::corrupt("tree node", ptr.addr, "never written"))?;
        decode_node(block, ptr, owner, Some(level))
            .map(|(_, body)| body)
            .map_err(|why| EngineError::corrupt("tree node", ptr.addr, why))
    }
    fn alloc_block(&mut self) -> Result<u64> {
        let addr = self.free.pop().unwrap_or_else(|| {
            self.next += 1;
            self.next
        });
        assert!(self.allocated.insert(addr), "block {addr} allocated twice");
        Ok(addr)
    }
    fn ensure_free(&mut self, _blocks: u64, _shrinking: bool) -> Result<()> {
        Ok(())
    }
    fn free_block(&mut self, addr: u64, written: bool) -> Result<()> {
        assert!(
            self.allocated.remove(&addr),
            "block {addr} freed but not allocated"
        );
        if written {
            self.pinned.push(addr);
        } else {
            self.free.push(addr);
        }
        Ok(())
    }
}

impl MemIo {
    /// Commits: writes the dirty blocks (never over a block the old root can reach, which the
    /// pinning guarantees), then unpins.
    fn commit(&mut self, tree: &mut Tree, generation: u64) -> (BlockPtr, u8) {
        let mut out = Vec::new();
        let root = tree.write_dirty(generation, &mut out, &mut Vec::new());
        for (addr, block) in out {
            assert!(
                self.allocated.contains(&addr),
                "writing unallocated block {addr}"
            );
            assert!(
                !self.pinned.contains(&addr),
                "writing a pinned block {addr}"
            );
            self.write(addr, block);
        }
        self.free.append(&mut self.pinned);
        self.committed = self.reachable(root.0, tree.owner);
        root
    }

    /// Writes a block of a generation being committed: never one the committed root reaches.
    fn write(&mut self, addr: u64, block: bytes::Bytes) {
        assert!(
            !self.committed.contains(&addr),
            "writing block {addr}, which the committed root reaches"
        );
        assert!(
            !self.pinned_frozen.contains(&addr),
            "writing block {addr}, freed in the frozen generation"
        );
        self.blocks.insert(addr, block.to_vec());
    }

    /// The blocks a root reaches on disk.
    fn reachable(&self, root: BlockPtr, owner: u32) -> BTreeSet<u64> {
        let mut out = BTreeSet::new();
        let mut stack = vec![root];
        while let Some(ptr) = stack.pop() {
            if ptr.addr == 0 {
                continue;
            }
            out.insert(ptr.addr);
            let (_, body) = decode_node(&self.blocks[&ptr.addr], &ptr, owner, None).unwrap();
            if let NodeBody::Internal(entries) = body {
                stack.extend(entries.into_iter().map(|(_, p)| p));
            }
        }
        out
    }
}

fn key(n: u64) -> Key {
    Key::new(n / 7, ItemKind::Test, n)
}

fn value(n: u64, salt: u8) -> Vec<u8> {
    vec![salt ^ n as u8; (n % 97) as usize * 5]
}

#[derive(Debug, Clone)]
enum Step {
    Insert(u64, u8),
    Remove(u64),
    Get(u64),
    Seek(u64),
    Commit,
    Reopen,
    Evict(usize),
    /// A commit starts: the dirty nodes freeze, written later by slices.
    Freeze,
    /// A slice of the frozen generation (this many nodes at most).
    Slice(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        10 => (0..800u64, any::<u8>()).prop_map(|(k, s)| Step::Insert(k, s)),
        6 => (0..800u64).prop_map(Step::Remove),
        3 => (0..800u64).prop_map(Step::Get),
        2 => (0..850u64).prop_map(Step::Seek),
        1 => Just(Step::Commit),
        1 => Just(Step::Reopen),
        1 => (1..20usize).prop_map(Step::Evict),
        1 => Just(Step::Freeze),
        3 => (1..8usize).prop_map(Step::Slice),
    ]
}

/// A generation frozen and being written in slices, beside the running one.
struct Freezing {
    generation: u64,
    model: BTreeMap<Key, Vec<u8>>,
}

/// Writes one slice; when the last node is written, the frozen generation is committed: its
/// root read back from disk alone must hold exactly what the tree held when it froze.
#[allow(clippy::too_many_arguments)]
fn slice(
    io: &mut MemIo,
    tree: &mut Tree,
    freezing: &mut Option<Freezing>,
    max: usize,
    committed: &mut (BlockPtr, u8),
    committed_model: &mut BTreeMap<Key, Vec<u8>>,
) {
    let Some(f) = freezing.as_ref() else {
        return;
    };
    let mut out = Vec::new();
    let progress = tree.write_frozen(max, &mut out, &mut Vec::new());
    for (addr, block) in out {
        assert!(
            io.allocated.contains(&addr) || io.pinned.contains(&addr),
            "writing block {addr}, neither allocated nor freed after the freeze"
        );
        io.write(addr, block);
    }
    if let FrozenProgress::Done(root, level) = progress {
        let mut alone = Tree::open(0, root, level);
        assert_eq!(
            alone.range(io, Key::MIN, Key::MAX).unwrap(),
            f.model.clone().into_iter().collect::<Vec<_>>(),
            "generation {} as written differs from the tree it froze",
            f.generation
        );
        *committed = (root, level);
        *committed_model = f.model.clone();
        io.committed = io.reachable(root, 0);
        io.free.append(&mut io.pinned_frozen);
        *freezing = None;
    }
}

fn run(steps: &[Step]) {
    let mut io = MemIo::default();
    let mut tree = Tree::empty(0);
    let mut model: BTreeMap<Key, Vec<u8>> = BTreeMap::new();
    let mut generation = 1;
    let mut committed: (BlockPtr, u8) = (BlockPtr::default(), 0);
    let mut committed_model = model.clone();
    let mut freezing: Option<Freezing> = None;
    for step in steps {
        match *step {
            Step::Insert(n, salt) => {
                let previous = tree.insert(&mut io, key(n), value(n, salt)).unwrap();
                assert_eq!(previous, model.insert(key(n), value(n, salt)));
            }
            Step::Remove(n) => assert_eq!(
                tree.remove(&mut io, &key(n)).unwrap(),
                model.remove(&key(n))
            ),
            Step::Get(n) => assert_eq!(
                tree.get(&mut io, &key(n)).unwrap(),
                model.get(&key(n)).cloned()
            ),
            Step::Seek(n) => {
                let want = model.range(key(n)..).next().map(|(k, v)| (*k, v.clone()));
                assert_eq!(tree.seek(&mut io, &key(n)).unwrap(), want);
                let want_le = model
                    .range(..=key(n))
                    .next_back()
                    .map(|(k, v)| (*k, v.clone()));
                assert_eq!(tree.seek_le(&mut io, &key(n)).unwrap(), want_le);
            }
            Step::Freeze | Step::Commit if freezing.is_some() => {
                // One generation in flight at a time: the last one's slices finish first.
                slice(
                    &mut io,
                    &mut tree,
                    &mut freezing,
                    usize::MAX,
                    &mut committed,
                    &mut committed_model,
                );
            }
            Step::Freeze => {
                if tree.freeze(generation) {
                    io.pinned_frozen = std::mem::take(&mut io.pinned);
                    freezing = Some(Freezing {
                        generation,
                        model: model.clone(),
                    });
                } else {
                    committed = io.commit(&mut tree, generation);
                    committed_model = model.clone();
                }
                generation += 1;
            }
            Step::Slice(max) => slice(
                &mut io,
                &mut tree,
                &mut freezing,
                max,
                &mut committed,
                &mut committed_model,
            ),
            Step::Commit => {
                committed = io.commit(&mut tree, generation);
                committed_model = model.clone();
                generation += 1;
                assert!(!tree.is_dirty());
            }
            Step::Reopen => {
                // A crash: drop everything in memory and read the last committed tree back.
                freezing = None;
                let (root, level) = committed;
                tree = Tree::open(0, root, level);
                model = committed_model.clone();
                // The uncommitted tree's blocks are gone with it; rebuild the allocator view.
                let (_, blocks) = tree.check(&mut io).unwrap();
                io.allocated = blocks.into_iter().collect();
                io.free.clear();
                io.pinned.clear();
                io.pinned_frozen.clear();
                io.next = io.blocks.keys().max().copied().unwrap_or(0);
                generation += 1;
            }
            Step::Evict(max) => tree.evict_clean(max),
        }
    }
    slice(
        &mut io,
        &mut tree,
        &mut freezing,
        usize::MAX,
        &mut committed,
        &mut committed_model,
    );
    let (count, blocks) = tree.check(&mut io).unwrap();
    assert_eq!(count, model.len() as u64);
    let used: BTreeSet<u64> = blocks.into_iter().collect();
    assert_eq!(
        used, io.allocated,
        "allocated blocks and tree blocks differ: a leak or a double use"
    );
    assert_eq!(
        tree.range(&mut io, Key::MIN, Key::MAX).unwrap(),
        model.into_iter().collect::<Vec<_>>()
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn tree_matches_model(steps in proptest::collection::vec(step(), 1..1500)) {
        run(&steps);
    }
}

#[test]
fn sequential_inserts_fill_leaves_and_survive_reopen() {
    let mut io = MemIo::default();
    let mut tree = Tree::empty(3);
    let n = 100_000u64;
    for i in 0..n {
        tree.insert(&mut io, Key::new(i, ItemKind::DirIndex, 0), vec![1u8; 40])
            .unwrap();
    }
    let (root, level) = io.commit(&mut tree, 1);
    let stats = tree.stats();
    let leaves = stats.nodes_loaded as u64 - 1;
    let per_leaf = n as f64 / leaves as f64;
    // 61-byte items in a 4032-byte leaf: 66 fit; splits of an append-only workload leave
    // half-full leaves unless the split favours the right edge.
    eprintln!("{per_leaf:.1} items per leaf over {leaves} leaves, {level} levels, {stats:?}");
    assert!(
        per_leaf > 60.0,
        "{per_leaf:.1} items per leaf over {leaves} leaves"
    );
    assert!(level >= 2);
    let mut reopened = Tree::open(3, root, level);
    for i in (0..n).step_by(997) {
        assert_eq!(
            reopened
                .get(&mut io, &Key::new(i, ItemKind::DirIndex, 0))
                .unwrap(),
            Some(vec![1u8; 40])
        );
    }
    assert!(
        reopened.stats().nodes_loaded < 200,
        "point lookups load only their paths"
    );
    reopened.evict_clean(1);
    assert!(reopened.stats().nodes_loaded <= level as usize + 1);
    let (count, _) = reopened.check(&mut io).unwrap();
    assert_eq!(count, n);
    // Delete everything: the tree empties and frees every block.
    for i in 0..n {
        assert!(reopened
            .remove(&mut io, &Key::new(i, ItemKind::DirIndex, 0))
            .unwrap()
            .is_some());
    }
    let (root, _) = io.commit(&mut reopened, 2);
    assert_eq!(root.addr, 0, "an emptied tree commits as empty");
    assert!(
        io.allocated.is_empty(),
        "{} blocks leaked",
        io.allocated.len()
    );
}

#[test]
fn corrupt_child_is_reported_not_followed() {
    let mut io = MemIo::default();
    let mut tree = Tree::empty(0);
    for i in 0..2000 {
        tree.insert(&mut io, key(i), value(i, 1)).unwrap();
    }
    let (root, level) = io.commit(&mut tree, 1);
    let victim = *io.blocks.keys().find(|&&a| a != root.addr).unwrap();
    io.blocks.get_mut(&victim).unwrap()[2000] ^= 0x10;
    let mut reopened = Tree::open(0, root, level);
    let err = reopened.check(&mut io).unwrap_err();
    assert!(
        matches!(&err, EngineError::Corrupt { block, .. } if *block == victim),
        "{err}"
    );
    assert!(err.to_string().contains("checksum"), "{err}");
}

#[test]
fn successor_orders_after_the_key() {
    let k = Key::new(5, ItemKind::DirItem, u64::MAX);
    let next = k.successor().unwrap();
    assert!(next > k);
    assert_eq!(next, Key::new(5, ItemKind::DirIndex, 0));
    let last = Key::new(5, ItemKind::Test, u64::MAX);
    assert_eq!(
        last.successor().unwrap(),
        Key::new(6, ItemKind::InodeItem, 0)
    );
    assert_eq!(Key::MAX.successor(), None);
}

#[test]
fn deletes_merge_nodes_and_keep_the_model() {
    use rand::{Rng, SeedableRng};
    let seed = nvme::wrap::seed_from_env();
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut io = MemIo::default();
    let mut tree = Tree::empty(0);
    let mut model = BTreeMap::new();
    for round in 0..6u64 {
        for _ in 0..4000 {
            let n = rng.random_range(0..20_000u64);
            tree.insert(&mut io, key(n), value(n, round as u8)).unwrap();
            model.insert(key(n), value(n, round as u8));
        }
        io.commit(&mut tree, round * 2 + 1);
        let keys: Vec<Key> = model.keys().copied().collect();
        for k in keys {
            if rng.random_bool(0.85) {
                assert_eq!(
                    tree.remove(&mut io, &k).unwrap(),
                    model.remove(&k),
                    "seed {seed}"
                );
            }
        }
        io.commit(&mut tree, round * 2 + 2);
        let (count, blocks) = tree.check(&mut io).unwrap();
        assert_eq!(count, model.len() as u64, "seed {seed}");
        assert_eq!(
            blocks.into_iter().collect::<BTreeSet<_>>(),
            io.allocated,
            "seed {seed}"
        );
    }
    assert!(
        tree.stats().merges > 100,
        "seed {seed}: only {} merges",
        tree.stats().merges
    );
    assert_eq!(
        tree.range(&mut io, Key::MIN, Key::MAX).unwrap(),
        model.into_iter().collect::<Vec<_>>()
    );
}

/// Items of 1009, 2016 and 1007 bytes (headers included) fill a leaf exactly; a 2016-byte
/// item inserted second makes the halfway cut fall after the first item, leaving 5039 bytes on
/// the right. The cut must move right until both halves fit.
#[test]
fn a_split_among_large_items_leaves_both_halves_fitting() {
    let header = node::LEAF_ITEM_HEADER_BYTES;
    let mut io = MemIo::default();
    let mut tree = Tree::empty(0);
    let k = |n| Key::new(1, ItemKind::Test, n);
    tree.insert(&mut io, k(10), vec![1; 1009 - header]).unwrap();
    tree.insert(&mut io, k(30), vec![3; MAX_ITEM_BYTES])
        .unwrap();
    tree.insert(&mut io, k(40), vec![4; 1007 - header]).unwrap();
    assert_eq!(tree.stats().splits, 0, "three items fill one leaf");
    tree.insert(&mut io, k(20), vec![2; MAX_ITEM_BYTES])
        .unwrap();
    assert_eq!(tree.stats().splits, 1);
    io.commit(&mut tree, 1);
    let (count, _) = tree.check(&mut io).unwrap();
    assert_eq!(count, 4);
}

/// A child whose keys reach its right neighbour's bound (a checksum-valid parent with a
/// lowered key) is reported when it is loaded, before a walk or a split spreads the disorder.
#[test]
fn a_child_past_its_parents_next_bound_is_reported() {
    let mut io = MemIo::default();
    let mut tree = Tree::empty(0);
    for i in 0..400 {
        tree.insert(&mut io, key(i), value(i, 1)).unwrap();
    }
    let (root, level) = io.commit(&mut tree, 1);
    assert_eq!(level, 1, "one internal node over the leaves");
    let (header, body) = decode_node(&io.blocks[&root.addr], &root, 0, Some(1)).unwrap();
    let NodeBody::Internal(mut entries) = body else {
        panic!("the root is internal");
    };
    // Entry 1's bound moves just above entry 0's: leaf 0's later keys are now past it.
    entries[1].0 = Key {
        offset: entries[0].0.offset + 1,
        ..entries[0].0
    };
    let mut block = vec![0u8; BLOCK_BYTES];
    let crc = node::encode_node(&header, &NodeBody::Internal(entries), &mut block);
    io.blocks.insert(root.addr, block);
    let mut reopened = Tree::open(0, BlockPtr { crc, ..root }, level);
    let err = reopened.check(&mut io).unwrap_err();
    assert!(err.to_string().contains("next bound"), "{err}");
    let mut reopened = Tree::open(0, BlockPtr { crc, ..root }, level);
    let err = reopened.get(&mut io, &key(0)).unwrap_err();
    assert!(err.to_string().contains("next bound"), "{err}");
}
