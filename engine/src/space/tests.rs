//! Unit tests of the pool and the shard allocator.

use super::*;
use crate::error::EngineError;
use std::sync::Arc;

/// A pool over `shards` regions of `region` blocks (8 of them log) in groups of `group`.
fn pool(shards: u32, region: u64, group: u64) -> Arc<Pool> {
    Arc::new(Pool::new(Geometry {
        shards,
        region_blocks: region,
        log_blocks: 8,
        group_blocks: group,
        groups_per_region: (region - 8).div_ceil(group),
    }))
}

#[test]
fn the_geometry_maps_blocks_to_groups_and_back() {
    let p = pool(3, 108, 32);
    let geo = *p.geometry();
    assert_eq!(geo.groups_per_region, 4);
    assert_eq!(geo.group_count(), 12);
    // Region 1 starts at 2 + 108 = 110; its log is 110..118; its groups 118.., the last
    // 4 blocks long.
    assert_eq!(geo.group_of(110), None, "a log block");
    assert_eq!(geo.group_of(118), Some(4));
    assert_eq!(geo.group_start(4), 118);
    assert_eq!(geo.group_len(7), 4);
    assert_eq!(geo.group_of(217), Some(7));
    assert_eq!(geo.group_of(218), None, "the next region's log");
    assert_eq!(geo.group_of(2 + 3 * 108), None, "past the last region");
    assert_eq!(geo.group_of(1), None, "a superblock");
    for g in 0..geo.group_count() {
        let start = geo.group_start(g);
        for b in start..start + geo.group_len(g) {
            assert_eq!(geo.group_of(b), Some(g));
        }
    }
    assert!(geo.in_data_area(118, 100) && !geo.in_data_area(118, 101));
    assert!(!geo.in_data_area(u64::MAX, 2));
    assert_eq!(Geometry::auto_group_blocks(245_760, 64), 64);
    assert_eq!(Geometry::auto_group_blocks(1 << 28, 64), 4096);
    assert_eq!(Geometry::auto_group_blocks(100, 64), 16);
    assert_eq!(Geometry::auto_group_blocks(15_360, 64), 16);
}

#[test]
fn frees_are_pinned_until_their_generation_unpins() {
    let p = pool(1, 72, 64);
    let mut space = Space::new(0, p);
    let a = space.alloc_meta().unwrap();
    let b = space.alloc_meta().unwrap();
    assert_eq!((a, b), (10, 11));
    space.free(a, 1, Some(5));
    assert!(!space.is_allocated(a));
    // While pinned, the block is not handed out again.
    let mut got = Vec::new();
    while let Ok(block) = space.alloc_meta() {
        got.push(block);
    }
    assert!(!got.contains(&a), "a pinned block was reused");
    assert_eq!(got.len(), 62);
    assert_eq!(space.unpin(4), 0, "nothing pinned by generation 4");
    assert_eq!(space.unpin(5), 1);
    assert_eq!(
        space.alloc_meta().unwrap(),
        a,
        "unpinned block is free again"
    );
}

#[test]
fn a_shard_takes_groups_as_it_grows_and_gives_back_what_it_emptied() {
    let p = pool(2, 264, 64);
    let total = p.stats().free_blocks;
    assert_eq!(total, 512);
    let mut a = Space::new(0, p.clone());
    let mut b = Space::new(1, p.clone());
    // Shard 0 writes past its own region: groups of shard 1's region join it.
    assert!(a.reserve_op(0, 260, MetaNeed::Grow, 0));
    let mut runs = Vec::new();
    let mut got = 0;
    while got < 260 {
        let (start, len) = a.alloc_data(260 - got, 0).unwrap();
        runs.push((start, len));
        got += len;
    }
    a.end_op();
    assert_eq!(a.owned_groups(), 5);
    assert!(
        runs.iter().any(|&(s, _)| s >= 2 + 264),
        "nothing past its region"
    );
    // Shard 1 gets the rest, less the pool's reserve.
    let before = p.available_blocks();
    assert!(b.reserve_op(0, 30, MetaNeed::Grow, 0));
    assert_eq!(b.alloc_data(30, 0).unwrap().1, 30);
    b.end_op();
    assert!(p.available_blocks() < before);
    // Everything freed (pinned by generation 3); the commit gives the empty groups back,
    // and they reach the pool only when generation 3 unpins. The group whose free blocks
    // the commit itself needs (its bitmap items) stays.
    for &(start, len) in &runs {
        a.free(start, len, Some(3));
    }
    assert!(p.reclaimable());
    let free_before = p.stats().free_blocks;
    let released = a.release_empty_groups(3, 0);
    assert_eq!(released, 4, "the four fully pinned groups");
    let changes = a.take_dirty();
    assert!(
        changes.removed.is_empty(),
        "never persisted: no item to delete"
    );
    assert_eq!(changes.items.len(), 1, "the group that stays");
    assert_eq!(
        p.stats().free_blocks,
        free_before,
        "not before the commit is durable"
    );
    a.unpin(3);
    assert_eq!(p.stats().free_blocks, free_before + released as u64 * 64);
    assert_eq!(a.owned_blocks(), 64);
    // The next commit may give back the last one once another group holds its room.
    assert!(b.ensure_meta(b.free_blocks() + 1, MetaNeed::Commit, 0));
    assert_eq!(a.release_empty_groups(4, 0), 0, "its own room");
    p.check(&[&a, &b]).unwrap();
}

#[test]
fn a_refused_reservation_keeps_no_group_and_data_keeps_the_pool_reserve() {
    let p = pool(2, 264, 64);
    let reserve = p.reserve_blocks();
    let mut a = Space::new(0, p.clone());
    assert!(!a.reserve_op(0, 10_000, MetaNeed::Grow, 0));
    assert_eq!(a.owned_groups(), 0, "a refused reservation kept groups");
    assert_eq!(p.stats().free_blocks, 512);
    // Data fills the device down to the pool's reserve (whole groups) and the shard's own.
    let mut data = 0;
    while let Ok((_, len)) = a.alloc_data(64, 0) {
        data += len;
    }
    assert!(p.stats().free_blocks >= reserve);
    assert!(p.stats().free_blocks < reserve + 64);
    assert_eq!(data, a.owned_blocks() - a.keep(MetaNeed::Data, 0));
    // A removal may still get a group.
    assert!(a.ensure_meta(a.free_blocks() + 1, MetaNeed::Shrink, 0));
    p.check(&[&a]).unwrap();
}

#[test]
fn bitmap_items_round_trip_through_a_mount() {
    let p = pool(1, 8 + 5000, 4096);
    let mut space = Space::new(0, p);
    for _ in 0..300 {
        space.alloc_meta().unwrap();
    }
    space.free(50, 20, None);
    let items = space.take_dirty().items;
    assert_eq!(items.len(), 1);
    let p2 = pool(1, 8 + 5000, 4096);
    let mut loaded = Space::new(0, p2.clone());
    loaded.load_group(items[0].0, &items[0].1).unwrap();
    assert_eq!(loaded.allocated_blocks(), 280);
    assert!(loaded.is_allocated(10) && !loaded.is_allocated(55));
    assert_eq!(p2.owner_of(0), Some(0));
    let mut other = Space::new(0, p2.clone());
    assert!(other
        .load_group(items[0].0, &items[0].1)
        .unwrap_err()
        .contains("owned by shard 0 and"));
    let mut bad = items[0].1.clone();
    // Group 1 is 904 blocks: bit 904 is past it.
    let bad_group = vec![0xffu8; 512];
    assert!(Space::new(0, p2.clone())
        .load_group(1, &bad_group)
        .unwrap_err()
        .contains("past the group"));
    bad.truncate(100);
    assert!(Space::new(0, p2).load_group(0, &bad).is_err());
}

#[test]
fn a_reservation_is_all_or_nothing_and_its_allocations_cannot_fail() {
    let p = pool(1, 1008, 1000);
    p.set_ballast(false);
    let mut space = Space::new(0, p.clone());
    assert!(space.ensure_meta(1, MetaNeed::Commit, 0));
    p.set_ballast(true);
    let reserve = space.reserve_blocks;
    let floor = 10;
    let keep = floor + space.bitmap_floor_blocks();
    // Growing changes keep the floor and half of the reserve.
    let room = 1000 - keep - reserve / 2;
    assert!(!space.reserve_op(room + 1, 0, MetaNeed::Grow, floor));
    assert_eq!(
        space.free_blocks(),
        1000,
        "a refused reservation holds nothing"
    );
    assert!(space.reserve_op(room, 0, MetaNeed::Grow, floor));
    assert_eq!(space.free_blocks(), 1000 - room);
    // Nobody else may take reserved blocks, not even a removal.
    assert!(!space.ensure_meta(reserve / 2 + 1, MetaNeed::Shrink, floor));
    for _ in 0..room {
        space.alloc_meta().unwrap();
    }
    assert_eq!(space.overrun_blocks(), 0);
    space.alloc_meta().unwrap();
    assert_eq!(
        space.overrun_blocks(),
        1,
        "past the reservation is an overrun"
    );
    space.end_op();
    assert!(!space.in_op());
}

#[test]
fn ballast_shrinks_the_free_space_without_allocating() {
    let p = pool(1, 108, 100);
    let mut space = Space::new(0, p.clone());
    assert!(space.ensure_meta(1, MetaNeed::Commit, 0));
    p.set_ballast(true);
    space.set_ballast(99);
    assert_eq!(space.free_blocks(), 1);
    space.alloc_meta().unwrap();
    assert_eq!(space.alloc_meta(), Err(EngineError::NoSpace));
    space.set_ballast(0);
    assert_eq!(space.allocated_blocks(), 1);
}

#[test]
fn frees_and_claims_that_disk_contents_ask_for_are_checked_first() {
    let p = pool(2, 72, 64);
    let mut space = Space::new(0, p.clone());
    let mut other = Space::new(1, p.clone());
    let a = space.alloc_meta().unwrap();
    assert!(space.check_allocated(a, 1).is_ok());
    assert!(space
        .check_allocated(a, 2)
        .unwrap_err()
        .contains("says free"));
    assert!(space.check_allocated(9, 1).unwrap_err().contains("outside"));
    assert!(space
        .check_allocated(u64::MAX, 2)
        .unwrap_err()
        .contains("outside"));
    assert!(!space.contains(70, 5) && space.contains(70, 4));
    space.free(a, 1, Some(3));
    // Freed once: a second free (a node reachable twice) is refused, not asserted.
    assert!(space.check_allocated(a, 1).is_err());
    // Pinned: busy, so replay may not claim it either.
    assert!(space.check_claimable(a).unwrap_err().contains("in use"));
    assert!(space.check_claimable(a + 1).is_ok());
    assert!(space.check_claimable(5).unwrap_err().contains("outside"));
    // A block of a free group: the claim takes the group; of another shard's: refused.
    assert!(other.check_claimable(2 + 72 + 8).is_ok());
    assert_eq!(p.owner_of(1), Some(1));
    assert!(space
        .check_claimable(2 + 72 + 9)
        .unwrap_err()
        .contains("shard 1 owns"));
}

/// Random allocations, frees (pinned and not), commits (give back, unpin) and reserved
/// operations by three shards on one pool, against a model of who holds which block:
/// no block is handed out twice or while pinned, a pinned block comes back only with
/// its generation, groups change hands only through the pool, and every count agrees
/// with the bits after every step. `COREFS_SEED` replays.
#[test]
fn random_hand_overs_keep_every_block_with_one_owner() {
    use std::collections::HashMap;
    let seed = nvme::wrap::seed_from_env();
    let mut rng = seed | 1;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n.max(1)
    };
    let p = pool(3, 8 + 200, 16);
    let mut spaces: Vec<Space> = (0..3).map(|s| Space::new(s, p.clone())).collect();
    // block -> (shard, allocated?) for allocated and pinned blocks; pins per generation.
    let mut held: HashMap<u64, u32> = HashMap::new();
    let mut pinned: HashMap<u64, (u32, u64)> = HashMap::new();
    let mut generation = 1u64;
    for step in 0..20_000 {
        let s = next(3) as usize;
        match next(10) {
            0..=3 => {
                let want = 1 + next(20);
                let meta = next(2) == 0;
                let got = if meta {
                    spaces[s].alloc_meta().map(|b| (b, 1))
                } else {
                    spaces[s].alloc_data(want, 0)
                };
                if let Ok((start, len)) = got {
                    for b in start..start + len {
                        assert!(
                            !held.contains_key(&b) && !pinned.contains_key(&b),
                            "seed {seed} step {step}: block {b} handed out twice"
                        );
                        held.insert(b, s as u32);
                    }
                }
            }
            4..=6 => {
                let mine: Vec<u64> = held
                    .iter()
                    .filter(|(_, &o)| o == s as u32)
                    .map(|(&b, _)| b)
                    .collect();
                if !mine.is_empty() {
                    let b = mine[next(mine.len() as u64) as usize];
                    held.remove(&b);
                    if next(2) == 0 {
                        spaces[s].free(b, 1, Some(generation));
                        pinned.insert(b, (s as u32, generation));
                    } else {
                        spaces[s].free(b, 1, None);
                    }
                }
            }
            7 => {
                // A reservation, used in part, or refused with nothing taken.
                let before = spaces[s].owned_groups();
                let (meta, data) = (next(8), next(60));
                if spaces[s].reserve_op(meta, data, MetaNeed::Grow, 4) {
                    if data > 0 {
                        let (start, len) = spaces[s].alloc_data(data, 4).unwrap();
                        for b in start..start + len {
                            assert!(!held.contains_key(&b) && !pinned.contains_key(&b));
                            held.insert(b, s as u32);
                        }
                    }
                    spaces[s].end_op();
                } else {
                    assert_eq!(spaces[s].owned_groups(), before, "seed {seed}");
                }
            }
            _ => {
                // A commit of `generation`: every shard gives back its empty groups;
                // then it is durable and unpins.
                for space in spaces.iter_mut() {
                    space.release_empty_groups(generation, next(4));
                    space.take_dirty();
                }
                for space in spaces.iter_mut() {
                    space.unpin(generation);
                }
                pinned.retain(|_, &mut (_, g)| g != generation);
                generation += 1;
            }
        }
        for (i, space) in spaces.iter().enumerate() {
            space
                .check_counts()
                .unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
            assert_eq!(
                space.allocated_blocks(),
                held.values().filter(|&&o| o == i as u32).count() as u64,
                "seed {seed} step {step}"
            );
        }
        for (&b, &o) in &held {
            assert!(
                spaces[o as usize].is_allocated(b),
                "seed {seed} step {step}"
            );
            assert_eq!(p.owner_of(p.geometry().group_of(b).unwrap()), Some(o));
        }
        let refs: Vec<&Space> = spaces.iter().collect();
        p.check(&refs)
            .unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
    }
    assert!(
        p.stats().taken > 20 && p.stats().returned > 10,
        "{:?}",
        p.stats()
    );
}

#[test]
#[should_panic(expected = "unpinning generation 6 before 5")]
fn unpin_out_of_order_is_a_bug() {
    let p = pool(1, 108, 100);
    let mut space = Space::new(0, p);
    let a = space.alloc_meta().unwrap();
    let b = space.alloc_meta().unwrap();
    space.free(a, 1, Some(5));
    space.free(b, 1, Some(6));
    space.unpin(6);
}
