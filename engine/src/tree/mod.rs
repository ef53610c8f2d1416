//! The copy-on-write B+tree of one shard.
//!
//! Nodes live in an arena and are loaded lazily from disk through [`NodeIo`]. The first change
//! to a clean node in a transaction copies it on write: it gets a new block address from the
//! allocator and its old address is freed *pinned* (reusable only after the superblock that no
//! longer references it is durable; [`crate::space`] enforces that). Every ancestor of a
//! changed node is copied too, because its pointer to the child changes. At commit,
//! [`Tree::write_dirty`] serializes dirty nodes bottom-up, so each parent records its child's
//! final crc32c, and returns the new root pointer.
//!
//! # Invariants
//! - Internal entry `i` has a key ≤ every key in child `i`'s subtree and < entry `i + 1`'s key.
//! - A dirty node's ancestors are dirty; a clean node's loaded children are clean or dirty, and
//!   a dirty child forces its parent dirty (checked by [`Tree::check`]).
//! - Leaves fit one block ([`node::LEAF_SPACE_BYTES`]); internal nodes hold at most
//!   [`node::INTERNAL_FANOUT`] children; no item exceeds [`node::MAX_ITEM_BYTES`].
//! - The loaded node count is bounded by [`Tree::evict_clean`], which unloads clean subtrees.

use crate::error::{EngineError, Result};
use crate::format::node::{
    self, leaf_used_bytes, NodeHeader, INTERNAL_FANOUT, LEAF_SPACE_BYTES, MAX_ITEM_BYTES,
};
use crate::format::node::{encode_internal, encode_leaf};
use crate::format::{BlockPtr, Key, NodeBody, BLOCK_BYTES};

mod check;
mod evict;
mod keys;
mod write;

use keys::{prefetch, Prefetched};
use write::Frozen;
pub use write::FrozenProgress;

/// How the tree reaches the disk and the allocator.
pub trait NodeIo {
    /// Reads and verifies the node `ptr` points at (see [`crate::format::decode_node`]).
    fn read_node(&mut self, ptr: &BlockPtr, owner: u32, level: u8) -> Result<NodeBody>;
    /// A block for a new or copied node, inside the shard's region.
    fn alloc_block(&mut self) -> Result<u64>;
    /// Fails with NoSpace unless `blocks` more blocks can be allocated. Changes call it first,
    /// so an allocation never fails halfway through a change.
    /// `shrinking`: the change frees space overall (a removal) and may use more of the reserve.
    fn ensure_free(&mut self, blocks: u64, shrinking: bool) -> Result<()>;
    /// Frees `addr`. `written` says whether a committed tree may still reference it: such a
    /// block stays pinned until the next super-commit; an unwritten one is free at once. Fails
    /// (corruption) when the allocator does not hold `addr` as allocated: a node read from
    /// disk whose block the space bitmap says is free, or that two parents point at.
    fn free_block(&mut self, addr: u64, written: bool) -> Result<()>;
    /// A hint, given when a node read would have to wait ([`EngineError::WouldBlock`]) in
    /// what looks like a walk: these nodes will likely be wanted next, so a caller that
    /// fetches in the background may start their reads now. The default ignores it.
    fn read_ahead(&mut self, _ptrs: &[BlockPtr]) {}
}

/// Siblings read ahead when a walk misses the cache ([`NodeIo::read_ahead`]): a readdir of
/// a cold directory used to park once per leaf, and a request parks a bounded number of times
/// before it runs waiting on the device (holding the reactor).
pub const READ_AHEAD_NODES: usize = 16;

type NodeId = u32;

#[derive(Debug, Clone)]
struct Child {
    key: Key,
    ptr: BlockPtr,
    loaded: Option<NodeId>,
}

#[derive(Debug)]
enum Body {
    Leaf(Vec<(Key, Vec<u8>)>),
    Internal(Vec<Child>),
}

#[derive(Debug)]
struct Node {
    level: u8,
    body: Body,
    addr: u64,
    /// Changed in the running transaction: `addr` was allocated in it and is not yet written.
    dirty: bool,
    /// Changed in the generation being committed and not yet serialized ([`Tree::freeze`]):
    /// its content is that generation's until the serializer writes it or the running
    /// transaction, first changing it, saves it ([`Tree::save_frozen`]).
    frozen: bool,
}

impl Node {
    fn leaf(&self) -> &Vec<(Key, Vec<u8>)> {
        match &self.body {
            Body::Leaf(items) => items,
            Body::Internal(_) => panic!("expected a leaf"),
        }
    }
    fn leaf_mut(&mut self) -> &mut Vec<(Key, Vec<u8>)> {
        match &mut self.body {
            Body::Leaf(items) => items,
            Body::Internal(_) => panic!("expected a leaf"),
        }
    }
    fn children(&self) -> &Vec<Child> {
        match &self.body {
            Body::Internal(children) => children,
            Body::Leaf(_) => panic!("expected an internal node"),
        }
    }
    fn children_mut(&mut self) -> &mut Vec<Child> {
        match &mut self.body {
            Body::Internal(children) => children,
            Body::Leaf(_) => panic!("expected an internal node"),
        }
    }
    fn first_key(&self) -> Option<Key> {
        match &self.body {
            Body::Leaf(items) => items.first().map(|(k, _)| *k),
            Body::Internal(children) => children.first().map(|c| c.key),
        }
    }
    /// True when the node no longer fits a block and must split.
    fn overfull(&self) -> bool {
        match &self.body {
            Body::Leaf(items) => leaf_used_bytes(items) > LEAF_SPACE_BYTES,
            Body::Internal(children) => children.len() > INTERNAL_FANOUT,
        }
    }
    /// True when the node is small enough to try merging with a sibling.
    fn underfull(&self) -> bool {
        match &self.body {
            Body::Leaf(items) => leaf_used_bytes(items) < LEAF_SPACE_BYTES / 4,
            Body::Internal(children) => children.len() < INTERNAL_FANOUT / 4,
        }
    }
}

/// Counters for tests and statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TreeStats {
    pub nodes_loaded: usize,
    pub dirty_nodes: usize,
    pub reads: u64,
    pub cow_copies: u64,
    pub splits: u64,
    pub merges: u64,
}

pub struct Tree {
    owner: u32,
    nodes: Vec<Option<Node>>,
    free_ids: Vec<NodeId>,
    /// The root: a loaded node, or the on-disk pointer and level, or nothing (empty tree).
    root: Option<Child>,
    root_level: u8,
    /// The tree became empty in this transaction (its old root must be committed away).
    emptied: bool,
    /// Nodes in the arena, and how many of them are dirty (kept current, so the cache bound
    /// and the dirty limit cost nothing to check).
    loaded_count: usize,
    dirty_count: usize,
    stats: TreeStats,
    /// Keys inserted or removed since the owner last took them ([`Tree::take_changed`]), when
    /// the owner asked for them (the fsync log's change tracking).
    changed: Vec<Key>,
    record_changes: bool,
    /// Inserts and removals that changed the tree, ever: whoever drives an operation
    /// compares it before and after a step to know whether the step changed anything.
    changes: u64,
    /// The generation being serialized in slices, when one is ([`Tree::freeze`]).
    frozen: Option<Frozen>,
    /// The children of one parent a miss asked for or read ahead, as (parent, first, last)
    /// indexes: a miss at the next index is a walk, and reads ahead ([`Tree::note_miss`]).
    walk: Option<(NodeId, usize, usize)>,
}

impl Tree {
    /// An empty tree for shard `owner`.
    pub fn empty(owner: u32) -> Tree {
        Tree {
            owner,
            nodes: Vec::new(),
            free_ids: Vec::new(),
            root: None,
            root_level: 0,
            emptied: false,
            loaded_count: 0,
            dirty_count: 0,
            stats: TreeStats::default(),
            changed: Vec::new(),
            record_changes: false,
            changes: 0,
            frozen: None,
            walk: None,
        }
    }

    /// A tree whose root is on disk at `root` (address 0 = empty).
    pub fn open(owner: u32, root: BlockPtr, level: u8) -> Tree {
        let mut tree = Tree::empty(owner);
        if root.addr != 0 {
            tree.root = Some(Child {
                key: Key::MIN,
                ptr: root,
                loaded: None,
            });
            tree.root_level = level;
        }
        tree
    }

    /// From now on, remember every key inserted or removed until [`Tree::take_changed`].
    pub fn record_changes(&mut self) {
        self.record_changes = true;
    }

    /// The keys inserted or removed since the last call (in change order, repeats kept).
    pub fn take_changed(&mut self, out: &mut Vec<Key>) {
        out.append(&mut self.changed);
    }

    pub fn stats(&self) -> TreeStats {
        let loaded = self.nodes.iter().flatten();
        TreeStats {
            nodes_loaded: loaded.clone().count(),
            dirty_nodes: loaded.filter(|n| n.dirty).count(),
            ..self.stats
        }
    }

    pub fn is_dirty(&self) -> bool {
        self.emptied
            || self
                .root
                .as_ref()
                .and_then(|r| r.loaded)
                .is_some_and(|id| self.node(id).dirty)
    }

    fn node(&self, id: NodeId) -> &Node {
        self.nodes[id as usize].as_ref().expect("live node id")
    }
    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.nodes[id as usize].as_mut().expect("live node id")
    }
    /// Inserts and removals so far (see the field).
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// The root's level (0: the root is a leaf, or the tree is empty).
    pub fn level(&self) -> u8 {
        self.root_level
    }

    /// Nodes in memory.
    pub fn loaded_nodes(&self) -> usize {
        self.loaded_count
    }

    /// Nodes changed in the running transaction.
    pub fn dirty_nodes(&self) -> usize {
        self.dirty_count
    }

    fn add_node(&mut self, node: Node) -> NodeId {
        self.loaded_count += 1;
        self.dirty_count += node.dirty as usize;
        match self.free_ids.pop() {
            Some(id) => {
                self.nodes[id as usize] = Some(node);
                id
            }
            None => {
                self.nodes.push(Some(node));
                (self.nodes.len() - 1) as NodeId
            }
        }
    }
    fn drop_node(&mut self, id: NodeId) -> Node {
        if self.node(id).frozen {
            // The frozen generation still needs what this node held (a merge drops it).
            self.save_frozen(id);
        }
        let node = self.nodes[id as usize].take().expect("live node id");
        self.loaded_count -= 1;
        self.dirty_count -= node.dirty as usize;
        self.free_ids.push(id);
        node
    }

    fn load(&mut self, io: &mut dyn NodeIo, ptr: &BlockPtr, level: u8) -> Result<NodeId> {
        let body = io.read_node(ptr, self.owner, level)?;
        self.stats.reads += 1;
        let body = match body {
            NodeBody::Leaf(items) => Body::Leaf(items),
            NodeBody::Internal(entries) => Body::Internal(
                entries
                    .into_iter()
                    .map(|(key, ptr)| Child {
                        key,
                        ptr,
                        loaded: None,
                    })
                    .collect(),
            ),
        };
        Ok(self.add_node(Node {
            level,
            body,
            addr: ptr.addr,
            dirty: false,
            frozen: false,
        }))
    }

    /// The root node, loaded.
    fn root_id(&mut self, io: &mut dyn NodeIo) -> Result<Option<NodeId>> {
        let Some(root) = self.root.clone() else {
            return Ok(None);
        };
        if let Some(id) = root.loaded {
            return Ok(Some(id));
        }
        let id = self.load(io, &root.ptr, self.root_level)?;
        self.root.as_mut().expect("root checked").loaded = Some(id);
        Ok(Some(id))
    }

    /// Child `index` of `parent`, loaded.
    /// A miss of child `index` of `parent`: when it follows the last miss (or read-ahead) under
    /// the same parent, the walk goes on, and the next [`READ_AHEAD_NODES`] siblings not in
    /// memory are handed to [`NodeIo::read_ahead`]. A miss inside the window read ahead (a
    /// read still in flight) keeps the window.
    fn note_miss(&mut self, io: &mut dyn NodeIo, parent: NodeId, index: usize) {
        let walking = match self.walk {
            Some((p, first, last)) if p == parent && (first..=last).contains(&index) => return,
            Some((p, _, last)) => p == parent && index == last + 1,
            None => false,
        };
        self.walk = Some((parent, index, index));
        if !walking {
            return;
        }
        let children = self.node(parent).children();
        let end = (index + 1 + READ_AHEAD_NODES).min(children.len());
        let ahead: Vec<BlockPtr> = children[index + 1..end]
            .iter()
            .filter(|c| c.loaded.is_none())
            .map(|c| c.ptr)
            .collect();
        self.walk = Some((parent, index, end - 1));
        if !ahead.is_empty() {
            io.read_ahead(&ahead);
        }
    }

    fn child_id(&mut self, io: &mut dyn NodeIo, parent: NodeId, index: usize) -> Result<NodeId> {
        let child = self.node(parent).children()[index].clone();
        if let Some(id) = child.loaded {
            return Ok(id);
        }
        let level = self.node(parent).level - 1;
        let next = self.node(parent).children().get(index + 1).map(|c| c.key);
        let id = match self.load(io, &child.ptr, level) {
            Ok(id) => id,
            Err(EngineError::WouldBlock) => {
                self.note_miss(io, parent, index);
                return Err(EngineError::WouldBlock);
            }
            Err(e) => return Err(e),
        };
        // A child's keys lie in its parent's bounds [key i, key i + 1): the walks route by
        // them, and a split copies them up, so a node outside them would spread disorder.
        let first = self.node(id).first_key();
        let last = match &self.node(id).body {
            Body::Leaf(items) => items.last().map(|(k, _)| *k),
            Body::Internal(children) => children.last().map(|c| c.key),
        };
        let below = first.is_some_and(|k| k < child.key);
        let above = last.zip(next).is_some_and(|(k, n)| k >= n);
        if below || above {
            self.drop_node(id);
            return Err(EngineError::corrupt(
                "tree node",
                child.ptr.addr,
                if below {
                    "holds a key below its parent's bound"
                } else {
                    "holds a key at or above its parent's next bound"
                },
            ));
        }
        self.node_mut(parent).children_mut()[index].loaded = Some(id);
        Ok(id)
    }

    /// Makes `id` writable in this transaction: a clean node moves to a new block.
    fn cow(&mut self, io: &mut dyn NodeIo, id: NodeId) -> Result<()> {
        if self.node(id).dirty {
            return Ok(());
        }
        let new_addr = io.alloc_block()?;
        // Freed first: a block disk contents claim twice fails here, before the node changes.
        // A frozen node's block is the committing generation's: pinned like any written one.
        io.free_block(self.node(id).addr, true)?;
        if self.node(id).frozen {
            self.save_frozen(id);
        }
        let node = self.node_mut(id);
        node.addr = new_addr;
        node.dirty = true;
        self.stats.cow_copies += 1;
        self.dirty_count += 1;
        Ok(())
    }

    /// Index of the child whose subtree may hold `key`.
    fn child_index(children: &[Child], key: &Key) -> usize {
        prefetch(children);
        children
            .partition_point(|c| c.key <= *key)
            .saturating_sub(1)
    }

    /// Looks `key` up.
    pub fn get(&mut self, io: &mut dyn NodeIo, key: &Key) -> Result<Option<Vec<u8>>> {
        self.get_with(io, key, |value| value.to_vec())
    }

    /// Looks `key` up and hands its value to `f` in place (no copy).
    pub fn get_with<T>(
        &mut self,
        io: &mut dyn NodeIo,
        key: &Key,
        f: impl FnOnce(&[u8]) -> T,
    ) -> Result<Option<T>> {
        let Some(mut id) = self.root_id(io)? else {
            return Ok(None);
        };
        loop {
            match &self.node(id).body {
                Body::Leaf(items) => {
                    return Ok(items
                        .prefetched()
                        .binary_search_by(|(k, _)| k.cmp(key))
                        .ok()
                        .map(|i| f(&items[i].1)));
                }
                Body::Internal(children) => {
                    let index = Self::child_index(children, key);
                    id = self.child_id(io, id, index)?;
                }
            }
        }
    }

    /// The first item with a key ≥ `key`, if any.
    pub fn seek(&mut self, io: &mut dyn NodeIo, key: &Key) -> Result<Option<(Key, Vec<u8>)>> {
        let Some(root) = self.root_id(io)? else {
            return Ok(None);
        };
        let Some((leaf, index)) = self.seek_position(io, root, key)? else {
            return Ok(None);
        };
        match &self.node(leaf).body {
            Body::Leaf(items) => Ok(Some(items[index].clone())),
            Body::Internal(_) => unreachable!("seek_position names a leaf"),
        }
    }

    /// The last item with a key ≤ `key`, if any.
    pub fn seek_le(&mut self, io: &mut dyn NodeIo, key: &Key) -> Result<Option<(Key, Vec<u8>)>> {
        self.seek_le_with(io, key, |k, v| (*k, v.to_vec()))
    }

    /// As [`Tree::seek_le`], passing the item to `f` in place instead of copying it out (a
    /// reader that needs a few bytes of a large item).
    pub fn seek_le_with<T>(
        &mut self,
        io: &mut dyn NodeIo,
        key: &Key,
        f: impl FnOnce(&Key, &[u8]) -> T,
    ) -> Result<Option<T>> {
        let Some(root) = self.root_id(io)? else {
            return Ok(None);
        };
        Ok(self.seek_le_in(io, root, key)?.map(|(leaf, i)| {
            let (k, v) = &self.node(leaf).leaf()[i];
            f(k, v)
        }))
    }

    /// The leaf and index of the last item with a key ≤ `key` under node `id`.
    fn seek_le_in(
        &mut self,
        io: &mut dyn NodeIo,
        id: NodeId,
        key: &Key,
    ) -> Result<Option<(NodeId, usize)>> {
        match &self.node(id).body {
            Body::Leaf(items) => {
                let i = items.partition_point(|(k, _)| k <= key);
                Ok(i.checked_sub(1).map(|i| (id, i)))
            }
            Body::Internal(children) => {
                // Entry keys are lower bounds, so the subtree an entry names may hold only
                // larger keys: fall back to earlier subtrees until one has a key ≤ `key`.
                let last = children.partition_point(|c| c.key <= *key);
                for index in (0..last).rev() {
                    let child = self.child_id(io, id, index)?;
                    if let Some(found) = self.seek_le_in(io, child, key)? {
                        return Ok(Some(found));
                    }
                }
                Ok(None)
            }
        }
    }

    /// Every item with `start` ≤ key < `end`, in key order. One descent per leaf, not per
    /// item: the items of a leaf are taken together.
    pub fn range(
        &mut self,
        io: &mut dyn NodeIo,
        start: Key,
        end: Key,
    ) -> Result<Vec<(Key, Vec<u8>)>> {
        let mut out = Vec::new();
        let Some(root) = self.root_id(io)? else {
            return Ok(out);
        };
        let mut at = start;
        while let Some((leaf, first)) = self.seek_position(io, root, &at)? {
            let items = self.node(leaf).leaf();
            let mut last = None;
            for (key, value) in &items[first..] {
                if *key >= end {
                    return Ok(out);
                }
                out.push((*key, value.clone()));
                last = Some(*key);
            }
            // The leaf ran out inside the range: go on after its last key.
            match last.and_then(|k| k.successor()) {
                Some(next) => at = next,
                None => break,
            }
        }
        Ok(out)
    }

    /// The leaf and index of the first item with a key ≥ `key` under `id`, if any.
    fn seek_position(
        &mut self,
        io: &mut dyn NodeIo,
        id: NodeId,
        key: &Key,
    ) -> Result<Option<(NodeId, usize)>> {
        match &self.node(id).body {
            Body::Leaf(items) => {
                let i = items.partition_point(|(k, _)| k < key);
                Ok((i < items.len()).then_some((id, i)))
            }
            Body::Internal(children) => {
                let count = children.len();
                for index in Self::child_index(children, key)..count {
                    let child = self.child_id(io, id, index)?;
                    if let Some(found) = self.seek_position(io, child, key)? {
                        return Ok(Some(found));
                    }
                }
                Ok(None)
            }
        }
    }

    /// The most blocks one change can allocate: a copy and a split per level, and a new root.
    fn worst_case_blocks(&self) -> u64 {
        2 * (self.root_level as u64 + 1) + 2
    }

    /// How many leaves hold keys in `start..end`.
    pub fn leaves_holding(&mut self, io: &mut dyn NodeIo, start: Key, end: Key) -> Result<u64> {
        let Some(root) = self.root_id(io)? else {
            return Ok(0);
        };
        self.count_leaves(io, root, &start, &end)
    }

    fn count_leaves(
        &mut self,
        io: &mut dyn NodeIo,
        id: NodeId,
        start: &Key,
        end: &Key,
    ) -> Result<u64> {
        match &self.node(id).body {
            Body::Leaf(items) => Ok(items.iter().any(|(k, _)| k >= start && k < end) as u64),
            Body::Internal(children) => {
                let keys: Vec<Key> = children.iter().map(|c| c.key).collect();
                let mut total = 0;
                for index in 0..keys.len() {
                    let child_end = keys.get(index + 1);
                    if keys[index] >= *end || child_end.is_some_and(|k| k <= start) {
                        continue;
                    }
                    let child = self.child_id(io, id, index)?;
                    total += self.count_leaves(io, child, start, end)?;
                }
                Ok(total)
            }
        }
    }

    /// Inserts or replaces `key`'s value. Returns the previous value.
    pub fn insert(
        &mut self,
        io: &mut dyn NodeIo,
        key: Key,
        value: Vec<u8>,
    ) -> Result<Option<Vec<u8>>> {
        let result = self.insert_item(io, key, value);
        if result.is_ok() {
            self.changes += 1;
            if self.record_changes {
                self.changed.push(key);
            }
        }
        result
    }

    fn insert_item(
        &mut self,
        io: &mut dyn NodeIo,
        key: Key,
        value: Vec<u8>,
    ) -> Result<Option<Vec<u8>>> {
        if value.len() > MAX_ITEM_BYTES {
            return Err(EngineError::Invalid(format!(
                "item of {} bytes exceeds {MAX_ITEM_BYTES}",
                value.len()
            )));
        }
        io.ensure_free(self.worst_case_blocks(), false)?;
        let root = match self.root_id(io)? {
            Some(root) => root,
            None => {
                let addr = io.alloc_block()?;
                let id = self.add_node(Node {
                    level: 0,
                    body: Body::Leaf(Vec::new()),
                    addr,
                    dirty: true,
                    frozen: false,
                });
                self.root = Some(Child {
                    key: Key::MIN,
                    ptr: BlockPtr::default(),
                    loaded: Some(id),
                });
                self.root_level = 0;
                id
            }
        };
        self.cow(io, root)?;
        let previous = self.insert_in(io, root, key, value)?;
        if self.node(root).overfull() {
            // Grow: a new root above the old one, then split the old one under it.
            let addr = io.alloc_block()?;
            let level = self.node(root).level + 1;
            let first = self.node(root).first_key().unwrap_or(Key::MIN);
            let new_root = self.add_node(Node {
                level,
                body: Body::Internal(vec![Child {
                    key: first,
                    ptr: BlockPtr::default(),
                    loaded: Some(root),
                }]),
                addr,
                dirty: true,
                frozen: false,
            });
            self.split_child(io, new_root, 0, &key)?;
            self.root = Some(Child {
                key: Key::MIN,
                ptr: BlockPtr::default(),
                loaded: Some(new_root),
            });
            self.root_level = level;
        }
        Ok(previous)
    }

    /// Inserts into the subtree of `id`, which is already copied on write.
    fn insert_in(
        &mut self,
        io: &mut dyn NodeIo,
        id: NodeId,
        key: Key,
        value: Vec<u8>,
    ) -> Result<Option<Vec<u8>>> {
        if self.node(id).level == 0 {
            let items = self.node_mut(id).leaf_mut();
            return Ok(
                match items.prefetched().binary_search_by(|(k, _)| k.cmp(&key)) {
                    Ok(i) => Some(std::mem::replace(&mut items[i].1, value)),
                    Err(i) => {
                        items.insert(i, (key, value));
                        None
                    }
                },
            );
        }
        let index = Self::child_index(self.node(id).children(), &key);
        let child = self.child_id(io, id, index)?;
        self.cow(io, child)?;
        let children = self.node_mut(id).children_mut();
        if key < children[index].key {
            // Only child 0 can be asked to hold a key below its bound; lower the bound.
            children[index].key = key;
        }
        let previous = self.insert_in(io, child, key, value)?;
        if self.node(child).overfull() {
            self.split_child(io, id, index, &key)?;
        }
        Ok(previous)
    }

    /// Splits child `index` of `parent` in two (by bytes for leaves, by count otherwise).
    /// When `key`, the key just inserted, is the node's last (an append, as sequential
    /// directory indexes and file extents are), the left node stays full and the right one
    /// starts with the new key alone, so appends fill leaves instead of leaving them half
    /// empty; likewise when it ends a run of its object and kind.
    fn split_child(
        &mut self,
        io: &mut dyn NodeIo,
        parent: NodeId,
        index: usize,
        key: &Key,
    ) -> Result<()> {
        let child = self.node(parent).children()[index]
            .loaded
            .expect("split child is loaded");
        let addr = io.alloc_block()?;
        let node = self.node_mut(child);
        let level = node.level;
        let right_body = match &mut node.body {
            Body::Leaf(items) if items.last().is_some_and(|(k, _)| k == key) => {
                let cut = items.len() - 1;
                Body::Leaf(items.split_off(cut))
            }
            // The key ends a run of its (object, kind), as a directory's next index item
            // does in front of the new inodes' items: cut right after it, so the run keeps
            // filling the left leaf's successor instead of splitting every leaf in half.
            Body::Leaf(items)
                if items.iter().position(|(k, _)| k == key).is_some_and(|at| {
                    at + 1 < items.len()
                        && (items[at + 1].0.objectid, items[at + 1].0.kind)
                            != (key.objectid, key.kind)
                        && (LEAF_SPACE_BYTES / 4..=LEAF_SPACE_BYTES)
                            .contains(&leaf_used_bytes(&items[..=at]))
                        && leaf_used_bytes(&items[at + 1..]) <= LEAF_SPACE_BYTES
                }) =>
            {
                let cut = items
                    .iter()
                    .position(|(k, _)| k == key)
                    .expect("guard found it")
                    + 1;
                Body::Leaf(items.split_off(cut))
            }
            Body::Internal(children)
                if children.last().is_some_and(|c| c.key <= *key) && children.len() > 1 =>
            {
                let cut = children.len() - 1;
                Body::Internal(children.split_off(cut))
            }
            Body::Leaf(items) => {
                let total = leaf_used_bytes(items);
                let mut used = 0;
                let mut cut = 0;
                while cut < items.len()
                    && used + node::LEAF_ITEM_HEADER_BYTES + items[cut].1.len() <= total / 2
                {
                    used += node::LEAF_ITEM_HEADER_BYTES + items[cut].1.len();
                    cut += 1;
                }
                let mut cut = cut.clamp(1, items.len() - 1);
                // The halfway cut can leave the right half overfull when a large item follows
                // it (left 1 KiB, then 2 KiB items): move the cut right while the left half
                // still fits. Some cut always fits both, as no item is over half a leaf.
                while cut + 1 < items.len()
                    && leaf_used_bytes(&items[cut..]) > LEAF_SPACE_BYTES
                    && leaf_used_bytes(&items[..=cut]) <= LEAF_SPACE_BYTES
                {
                    cut += 1;
                }
                Body::Leaf(items.split_off(cut))
            }
            Body::Internal(children) => {
                let cut = children.len() / 2;
                Body::Internal(children.split_off(cut))
            }
        };
        let right = Node {
            level,
            body: right_body,
            addr,
            dirty: true,
            frozen: false,
        };
        let right_key = right.first_key().expect("a split half is not empty");
        let right_id = self.add_node(right);
        self.node_mut(parent).children_mut().insert(
            index + 1,
            Child {
                key: right_key,
                ptr: BlockPtr::default(),
                loaded: Some(right_id),
            },
        );
        self.stats.splits += 1;
        // A leaf split can still leave one half overfull only if items are huge; MAX_ITEM_BYTES
        // makes any two items fit, and a byte-balanced cut keeps both halves within a block.
        assert!(
            !self.node(child).overfull() && !self.node(right_id).overfull(),
            "split left a node overfull"
        );
        Ok(())
    }

    /// Removes `key`. Returns its value, if it was there.
    pub fn remove(&mut self, io: &mut dyn NodeIo, key: &Key) -> Result<Option<Vec<u8>>> {
        let result = self.remove_item(io, key);
        if matches!(result, Ok(Some(_))) {
            self.changes += 1;
            if self.record_changes {
                self.changed.push(*key);
            }
        }
        result
    }

    fn remove_item(&mut self, io: &mut dyn NodeIo, key: &Key) -> Result<Option<Vec<u8>>> {
        let Some(root) = self.root_id(io)? else {
            return Ok(None);
        };
        // Look first, so a miss copies nothing.
        if self.get(io, key)?.is_none() {
            return Ok(None);
        }
        io.ensure_free(self.worst_case_blocks(), true)?;
        self.cow(io, root)?;
        let removed = self.remove_in(io, root, key)?;
        // Shrink: a root with one child hands over to it; an empty leaf root empties the tree.
        loop {
            let root = self
                .root
                .as_ref()
                .and_then(|r| r.loaded)
                .expect("root is loaded");
            let node = self.node(root);
            match &node.body {
                Body::Internal(children) if children.len() == 1 => {
                    let only = children[0].loaded.expect("the path child is loaded");
                    // Freed before the node leaves the arena, so a failure leaves the tree
                    // whole (here and below).
                    io.free_block(node.addr, false)?;
                    let old = self.drop_node(root);
                    self.root = Some(Child {
                        key: Key::MIN,
                        ptr: BlockPtr::default(),
                        loaded: Some(only),
                    });
                    self.root_level = old.level - 1;
                }
                Body::Leaf(items) if items.is_empty() => {
                    io.free_block(node.addr, false)?;
                    self.drop_node(root);
                    self.root = None;
                    self.root_level = 0;
                    self.emptied = true;
                    break;
                }
                _ => break,
            }
        }
        Ok(removed)
    }

    fn remove_in(&mut self, io: &mut dyn NodeIo, id: NodeId, key: &Key) -> Result<Option<Vec<u8>>> {
        if self.node(id).level == 0 {
            let items = self.node_mut(id).leaf_mut();
            return Ok(items
                .binary_search_by(|(k, _)| k.cmp(key))
                .ok()
                .map(|i| items.remove(i).1));
        }
        let index = Self::child_index(self.node(id).children(), key);
        let child = self.child_id(io, id, index)?;
        self.cow(io, child)?;
        let removed = self.remove_in(io, child, key)?;
        if self.node(child).underfull() {
            self.rebalance(io, id, index)?;
        }
        Ok(removed)
    }

    /// Merges an underfull child with a neighbour when both fit one node; drops empty leaves.
    fn rebalance(&mut self, io: &mut dyn NodeIo, parent: NodeId, index: usize) -> Result<()> {
        let count = self.node(parent).children().len();
        let child = self.node(parent).children()[index]
            .loaded
            .expect("path child is loaded");
        if self.node(child).level == 0 && self.node(child).leaf().is_empty() && count > 1 {
            io.free_block(self.node(child).addr, false)?;
            self.drop_node(child);
            self.node_mut(parent).children_mut().remove(index);
            self.stats.merges += 1;
            return Ok(());
        }
        if count < 2 {
            return Ok(());
        }
        let (left_index, right_index) = if index + 1 < count {
            (index, index + 1)
        } else {
            (index - 1, index)
        };
        let left = self.child_id(io, parent, left_index)?;
        let right = self.child_id(io, parent, right_index)?;
        let fits = match (&self.node(left).body, &self.node(right).body) {
            (Body::Leaf(a), Body::Leaf(b)) => {
                leaf_used_bytes(a) + leaf_used_bytes(b) <= LEAF_SPACE_BYTES
            }
            (Body::Internal(a), Body::Internal(b)) => a.len() + b.len() <= INTERNAL_FANOUT,
            _ => unreachable!("siblings share a level"),
        };
        if !fits {
            return Ok(());
        }
        self.cow(io, left)?;
        // The right node was copied on write before (it is on the path) or is clean: free its
        // block, pinned if a committed tree may reference it.
        io.free_block(self.node(right).addr, !self.node(right).dirty)?;
        let gone = self.drop_node(right);
        match (&mut self.node_mut(left).body, gone.body) {
            (Body::Leaf(a), Body::Leaf(mut b)) => a.append(&mut b),
            (Body::Internal(a), Body::Internal(mut b)) => a.append(&mut b),
            _ => unreachable!("siblings share a level"),
        }
        self.node_mut(parent).children_mut().remove(right_index);
        self.stats.merges += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
