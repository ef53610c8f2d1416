//! The tree's own checker ([`Tree::check`]): key order and bounds, levels, fill limits, and
//! that dirty nodes have dirty ancestors.

use super::*;

impl Tree {
    /// Checks the tree's invariants over every node, loading all of it: key order and bounds,
    /// levels, fill limits, and that dirty nodes have dirty ancestors. Returns the item count
    /// and every block address the tree uses.
    pub fn check(&mut self, io: &mut dyn NodeIo) -> Result<(u64, Vec<u64>)> {
        let mut blocks = Vec::new();
        let Some(root) = self.root_id(io)? else {
            return Ok((0, blocks));
        };
        let items = self.check_node(io, root, None, None, &mut blocks)?;
        Ok((items, blocks))
    }

    fn check_node(
        &mut self,
        io: &mut dyn NodeIo,
        id: NodeId,
        low: Option<Key>,
        high: Option<Key>,
        blocks: &mut Vec<u64>,
    ) -> Result<u64> {
        let addr = self.node(id).addr;
        blocks.push(addr);
        let bad = |why: String| EngineError::corrupt("tree node", addr, why);
        if self.node(id).overfull() {
            return Err(bad("overfull".into()));
        }
        let keys: Vec<Key> = match &self.node(id).body {
            Body::Leaf(items) => items.iter().map(|(k, _)| *k).collect(),
            Body::Internal(children) => children.iter().map(|c| c.key).collect(),
        };
        if keys.windows(2).any(|w| w[0] >= w[1]) {
            return Err(bad("keys out of order".into()));
        }
        if keys.first().zip(low).is_some_and(|(k, l)| *k < l)
            || keys.last().zip(high).is_some_and(|(k, h)| *k >= h)
        {
            return Err(bad(format!(
                "keys outside the parent's bounds {low:?}..{high:?}"
            )));
        }
        if self.node(id).level == 0 {
            return Ok(keys.len() as u64);
        }
        if keys.is_empty() {
            return Err(bad("internal node without children".into()));
        }
        let parent_dirty = self.node(id).dirty;
        let mut items = 0;
        for index in 0..keys.len() {
            let child = self.child_id(io, id, index)?;
            if self.node(child).level + 1 != self.node(id).level {
                return Err(bad("child level mismatch".into()));
            }
            if self.node(child).dirty && !parent_dirty {
                return Err(bad("dirty child under a clean parent".into()));
            }
            let child_low = Some(keys[index]);
            let child_high = keys.get(index + 1).copied().or(high);
            items += self.check_node(io, child, child_low, child_high, blocks)?;
        }
        Ok(items)
    }
}
