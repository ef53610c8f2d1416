//! The pool checked against the shards' allocators (the checker, `fsck`): above both, so the
//! pool needs to know nothing of them.

use super::pool::FREE;
use super::{Pool, Space};

impl Pool {
    /// Why the pool disagrees with the shards' allocators, if it does: a group owned by a
    /// shard whose allocator does not hold it, or held by an allocator the table does not
    /// name, or free and owned at once (the checker).
    pub fn check(&self, spaces: &[&Space]) -> std::result::Result<(), String> {
        let p = self.lock();
        let mut seen = vec![false; p.owner.len()];
        for space in spaces {
            space.check_counts()?;
            for &group in space.groups.keys() {
                if p.owner[group as usize] != space.shard as u8 {
                    return Err(format!(
                        "group {group} is held by shard {}'s allocator but the pool says {}",
                        space.shard,
                        match p.owner[group as usize] {
                            FREE => "free".to_string(),
                            o => format!("shard {o}"),
                        }
                    ));
                }
                seen[group as usize] = true;
            }
            for (_, groups) in &space.releasing {
                for &group in groups {
                    seen[group as usize] = true;
                }
            }
        }
        let mut free_blocks = 0;
        for (group, &owner) in p.owner.iter().enumerate() {
            let group = group as u64;
            if owner == FREE {
                if !p.free.contains(&group) {
                    return Err(format!("group {group} is free but not in the free set"));
                }
                free_blocks += self.geo.group_len(group);
            } else if !seen[group as usize] && spaces.iter().any(|s| s.shard == owner as u32) {
                return Err(format!(
                    "group {group} is owned by shard {owner}, whose allocator does not hold it"
                ));
            }
        }
        if free_blocks != p.free_blocks
            || p.free.len() != p.owner.iter().filter(|&&o| o == FREE).count()
        {
            return Err(format!(
                "the pool counts {} free blocks, its groups hold {free_blocks}",
                p.free_blocks
            ));
        }
        Ok(())
    }
}
