//! Serializing a tree: the dirty nodes at commit, bottom-up ([`Tree::write_dirty`]), and a
//! frozen generation a slice at a time while the next one runs ([`Tree::freeze`],
//! [`Tree::write_frozen`]).

use super::*;

/// A generation's dirty nodes, frozen at its commit's start and serialized a slice at a time
/// while the next generation runs ([`Tree::freeze`], [`Tree::write_frozen`]).
///
/// # Invariants
/// - Every node of `order` is written exactly once, children before parents (post-order), so
///   a parent records its children's final pointers.
/// - Addresses are unique while this lives: each was allocated in the frozen generation, and
///   freeing one (the next generation copying or merging the node) pins it past that
///   generation's superblock, so no node can take it over.
/// - A frozen node the next generation changes or drops is saved first: a leaf is encoded at
///   once (its content needs nothing else), an internal node's entries are copied (its
///   children's checksums are not known yet).
/// - No node is evicted while this lives: a written child's pointer in its parent is fixed
///   up only when the last slice is done ([`Tree::write_frozen`]).
pub(super) struct Frozen {
    pub(super) generation: u64,
    pub(super) root_addr: u64,
    pub(super) root_level: u8,
    /// Post-order: (arena id, address in the frozen generation).
    pub(super) order: Vec<(NodeId, u64)>,
    pub(super) next: usize,
    /// Internal nodes saved when the next generation changed them first, by address.
    pub(super) saved: std::collections::HashMap<u64, (u8, Vec<Child>)>,
    /// Every node written so far (by address): its final pointer.
    pub(super) written: std::collections::HashMap<u64, BlockPtr>,
    /// Blocks encoded ahead (leaves saved) and not yet handed out.
    pub(super) ready: Vec<(u64, bytes::Bytes)>,
}

/// What [`Tree::write_frozen`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrozenProgress {
    /// Nodes remain.
    More,
    /// Every node is written: the frozen generation's root pointer and level (address 0:
    /// empty tree).
    Done(BlockPtr, u8),
}

impl Tree {
    /// Serializes every dirty node bottom-up into `out` as (block address, block bytes), marks
    /// them clean as of `generation`, and returns the new root pointer and level (address 0:
    /// empty tree).
    /// `spare`: block buffers to reuse before allocating.
    pub fn write_dirty(
        &mut self,
        generation: u64,
        out: &mut Vec<(u64, bytes::Bytes)>,
        spare: &mut Vec<Vec<u8>>,
    ) -> (BlockPtr, u8) {
        assert!(
            self.frozen.is_none(),
            "a frozen generation is written before the next one"
        );
        self.emptied = false;
        let Some(root) = self.root.clone() else {
            return (BlockPtr::default(), 0);
        };
        let Some(id) = root.loaded.filter(|&id| self.node(id).dirty) else {
            return (root.ptr, self.root_level);
        };
        let ptr = self.write_node(id, generation, out, spare);
        self.root.as_mut().expect("root checked").ptr = ptr;
        (ptr, self.root_level)
    }

    fn write_node(
        &mut self,
        id: NodeId,
        generation: u64,
        out: &mut Vec<(u64, bytes::Bytes)>,
        spare: &mut Vec<Vec<u8>>,
    ) -> BlockPtr {
        if let Body::Internal(children) = &self.node(id).body {
            let dirty_children: Vec<(usize, NodeId)> = children
                .iter()
                .enumerate()
                .filter_map(|(i, c)| c.loaded.map(|l| (i, l)))
                .filter(|(_, l)| self.node(*l).dirty)
                .collect();
            for (index, child) in dirty_children {
                let ptr = self.write_node(child, generation, out, spare);
                self.node_mut(id).children_mut()[index].ptr = ptr;
            }
        }
        let node = self.node(id);
        assert!(node.dirty, "write_node is only called on dirty nodes");
        let header = NodeHeader {
            addr: node.addr,
            generation,
            owner: self.owner,
            level: node.level,
        };
        let mut block = spare_block(spare);
        let crc = match &node.body {
            Body::Leaf(items) => encode_leaf(&header, items, &mut block),
            Body::Internal(children) => {
                let entries: Vec<(Key, BlockPtr)> =
                    children.iter().map(|c| (c.key, c.ptr)).collect();
                encode_internal(&header, &entries, &mut block)
            }
        };
        out.push((node.addr, block.into()));
        self.node_mut(id).dirty = false;
        self.dirty_count -= 1;
        BlockPtr {
            addr: header.addr,
            generation,
            crc,
        }
    }

    /// Freezes the running transaction's dirty nodes as generation `generation`'s, to be
    /// written by [`Tree::write_frozen`] a slice at a time while the next generation changes
    /// the tree: from here on the nodes count as clean, so the next change to one copies it
    /// (saving its frozen content first). Costs one walk over the dirty nodes and no
    /// encoding. Returns false (nothing frozen) when nothing is dirty; the caller then uses
    /// the current root.
    pub fn freeze(&mut self, generation: u64) -> bool {
        assert!(self.frozen.is_none(), "one frozen generation at a time");
        let emptied = std::mem::take(&mut self.emptied);
        let Some(root) = self.root.clone() else {
            // Empty (maybe emptied in this generation: its root pointer is simply 0).
            let _ = emptied;
            return false;
        };
        let Some(root_id) = root.loaded.filter(|&id| self.node(id).dirty) else {
            return false;
        };
        let mut order = Vec::with_capacity(self.dirty_count);
        // Iterative post-order over dirty nodes: (node, next child index to look at).
        let mut stack: Vec<(NodeId, usize)> = vec![(root_id, 0)];
        while let Some(&mut (id, ref mut at)) = stack.last_mut() {
            let next_child = match &self.node(id).body {
                Body::Internal(children) => children[*at..]
                    .iter()
                    .position(|c| c.loaded.is_some_and(|l| self.node(l).dirty))
                    .map(|i| *at + i),
                Body::Leaf(_) => None,
            };
            match next_child {
                Some(index) => {
                    *at = index + 1;
                    let child = self.node(id).children()[index]
                        .loaded
                        .expect("a dirty child is loaded");
                    // The parent names the child's frozen address from now on, so a copy of
                    // the parent saved later still finds the child's final pointer by it.
                    let addr = self.node(child).addr;
                    self.node_mut(id).children_mut()[index].ptr.addr = addr;
                    stack.push((child, 0));
                }
                None => {
                    stack.pop();
                    let node = self.node_mut(id);
                    node.dirty = false;
                    node.frozen = true;
                    order.push((id, node.addr));
                }
            }
        }
        self.dirty_count -= order.len();
        assert_eq!(
            self.dirty_count, 0,
            "every dirty node is under a dirty root"
        );
        let root_addr = self.node(root_id).addr;
        self.root.as_mut().expect("root checked").ptr.addr = root_addr;
        self.frozen = Some(Frozen {
            generation,
            root_addr,
            root_level: self.root_level,
            order,
            next: 0,
            saved: Default::default(),
            written: Default::default(),
            ready: Vec::new(),
        });
        true
    }

    /// Frozen nodes not yet written (0 when nothing is frozen).
    pub fn frozen_left(&self) -> usize {
        self.frozen.as_ref().map_or(0, |f| f.order.len() - f.next)
    }

    /// Writes up to `max_nodes` frozen nodes (children first) into `out` as (block address,
    /// block bytes), with any saved ahead. When the last is written, fixes the written
    /// children's pointers in their loaded parents, ends the freeze and returns the frozen
    /// generation's root.
    pub fn write_frozen(
        &mut self,
        max_nodes: usize,
        out: &mut Vec<(u64, bytes::Bytes)>,
        spare: &mut Vec<Vec<u8>>,
    ) -> FrozenProgress {
        let mut f = self.frozen.take().expect("a frozen generation");
        out.append(&mut f.ready);
        let mut budget = max_nodes;
        while f.next < f.order.len() && budget > 0 {
            let (id, addr) = f.order[f.next];
            f.next += 1;
            if f.written.contains_key(&addr) {
                // A leaf encoded when the next generation first changed it.
                continue;
            }
            budget -= 1;
            let mut block = spare_block(spare);
            let ptr = if let Some((level, children)) = f.saved.remove(&addr) {
                encode_frozen_internal(&f, addr, level, &children, self.owner, &mut block)
            } else {
                let node = self.node(id);
                assert!(
                    node.frozen && node.addr == addr,
                    "an unsaved frozen node is still in the arena"
                );
                let ptr = match &node.body {
                    Body::Leaf(items) => {
                        let header = NodeHeader {
                            addr,
                            generation: f.generation,
                            owner: self.owner,
                            level: 0,
                        };
                        BlockPtr {
                            addr,
                            generation: f.generation,
                            crc: encode_leaf(&header, items, &mut block),
                        }
                    }
                    Body::Internal(children) => encode_frozen_internal(
                        &f, addr, node.level, children, self.owner, &mut block,
                    ),
                };
                self.node_mut(id).frozen = false;
                ptr
            };
            f.written.insert(addr, ptr);
            out.push((addr, block.into()));
        }
        if f.next < f.order.len() {
            self.frozen = Some(f);
            return FrozenProgress::More;
        }
        // Every node is written: the loaded parents (frozen ones, now clean, and the next
        // generation's copies) take their written children's final pointers.
        for node in self.nodes.iter_mut().flatten() {
            if let Body::Internal(children) = &mut node.body {
                for child in children.iter_mut() {
                    if let Some(ptr) = f.written.get(&child.ptr.addr) {
                        child.ptr = *ptr;
                    }
                }
            }
        }
        let root = *f.written.get(&f.root_addr).expect("the root is written");
        if let Some(r) = self.root.as_mut() {
            if r.ptr.addr == f.root_addr {
                r.ptr = root;
            }
        }
        FrozenProgress::Done(root, f.root_level)
    }

    /// Saves frozen node `id` before the next generation changes or drops it: a leaf is
    /// encoded now, an internal node's entries are copied until its children are written.
    pub(super) fn save_frozen(&mut self, id: NodeId) {
        let owner = self.owner;
        let node = self.nodes[id as usize].as_mut().expect("live node id");
        node.frozen = false;
        let f = self
            .frozen
            .as_mut()
            .expect("a frozen node has a frozen generation");
        match &node.body {
            Body::Leaf(items) => {
                let mut block = vec![0u8; BLOCK_BYTES];
                let header = NodeHeader {
                    addr: node.addr,
                    generation: f.generation,
                    owner,
                    level: 0,
                };
                let crc = encode_leaf(&header, items, &mut block);
                f.written.insert(
                    node.addr,
                    BlockPtr {
                        addr: node.addr,
                        generation: f.generation,
                        crc,
                    },
                );
                f.ready.push((node.addr, block.into()));
            }
            Body::Internal(children) => {
                f.saved.insert(node.addr, (node.level, children.clone()));
            }
        }
    }
}

/// A zeroed block buffer, reused from `spare` when it has one. A reused buffer is zeroed: the
/// bytes between a leaf's item headers and its data are part of the checksummed block and
/// must not carry an older node's.
pub(super) fn spare_block(spare: &mut Vec<Vec<u8>>) -> Vec<u8> {
    match spare.pop() {
        Some(mut block) => {
            assert_eq!(block.len(), BLOCK_BYTES);
            block.fill(0);
            block
        }
        None => vec![0u8; BLOCK_BYTES],
    }
}

/// Encodes frozen internal node `addr` (its entries `children`), taking each child written in
/// the frozen generation's final pointer; the rest keep theirs (clean children).
fn encode_frozen_internal(
    f: &Frozen,
    addr: u64,
    level: u8,
    children: &[Child],
    owner: u32,
    block: &mut [u8],
) -> BlockPtr {
    let header = NodeHeader {
        addr,
        generation: f.generation,
        owner,
        level,
    };
    let entries: Vec<(Key, BlockPtr)> = children
        .iter()
        .map(|c| (c.key, f.written.get(&c.ptr.addr).copied().unwrap_or(c.ptr)))
        .collect();
    BlockPtr {
        addr,
        generation: f.generation,
        crc: encode_internal(&header, &entries, block),
    }
}
