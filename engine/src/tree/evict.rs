//! Keeping the loaded nodes within the cache's bound: clean subtrees are unloaded, bottom-up
//! ([`Tree::evict_clean`]); dirty and frozen nodes stay.

use super::*;

impl Tree {
    /// Unloads clean subtrees until at most `max_nodes` nodes are loaded (the root and dirty
    /// nodes always stay).
    pub fn evict_clean(&mut self, max_nodes: usize) {
        if self.frozen.is_some() {
            // Written children's pointers in their parents are fixed up only at the end.
            return;
        }
        let Some(root) = self.root.as_ref().and_then(|r| r.loaded) else {
            return;
        };
        let mut loaded = self.loaded_count;
        // Unload from the bottom: clean children of level-1 nodes first, then higher levels.
        for level in 1..=self.root_level {
            if loaded <= max_nodes {
                return;
            }
            self.evict_at(root, level, &mut loaded, max_nodes);
        }
    }

    fn evict_at(&mut self, id: NodeId, level: u8, loaded: &mut usize, max_nodes: usize) {
        let node = self.node(id);
        if node.level < level || matches!(node.body, Body::Leaf(_)) {
            return;
        }
        let children: Vec<(usize, NodeId)> = node
            .children()
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.loaded.map(|l| (i, l)))
            .collect();
        for (index, child) in children {
            if *loaded <= max_nodes {
                return;
            }
            if node_level_is(self, id, level) {
                if !self.subtree_dirty(child) {
                    *loaded -= self.unload(child);
                    self.node_mut(id).children_mut()[index].loaded = None;
                }
            } else {
                self.evict_at(child, level, loaded, max_nodes);
            }
        }

        fn node_level_is(tree: &Tree, id: NodeId, level: u8) -> bool {
            tree.node(id).level == level
        }
    }

    fn subtree_dirty(&self, id: NodeId) -> bool {
        let node = self.node(id);
        node.dirty
            || node.frozen
            || matches!(&node.body, Body::Internal(children) if children.iter().filter_map(|c| c.loaded).any(|c| self.subtree_dirty(c)))
    }

    fn unload(&mut self, id: NodeId) -> usize {
        let node = self.drop_node(id);
        let mut count = 1;
        if let Body::Internal(children) = node.body {
            for child in children.into_iter().filter_map(|c| c.loaded) {
                count += self.unload(child);
            }
        }
        count
    }
}
