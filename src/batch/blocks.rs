//! The KV cache of a batch as a pool of fixed-size blocks: each sequence
//! holds a list of blocks (its block table), takes one as it grows past the
//! last and gives them back when it ends. Whole blocks are also kept by the
//! hash of every token up to their end, so that a sequence whose prompt
//! starts with the same tokens (the next turn of a conversation, a shared
//! system prompt) takes them instead of computing them again: a kept block
//! that no sequence holds stays cached until the pool needs it, the least
//! recently used first.

use std::collections::{BTreeMap, HashMap};

/// A block of the pool.
pub(crate) type Block = u32;

/// The hash of a block's tokens and of every token before them.
pub(crate) type PrefixHash = u64;

/// The hash of the block holding `tokens` after the blocks whose hash is
/// `parent` (`None`: the sequence's first block). FNV-1a over the parent
/// and the ids: the same on every run and platform; a match is confirmed on
/// the tokens themselves before a block is shared.
pub(crate) fn block_hash(parent: Option<PrefixHash>, tokens: &[u32]) -> PrefixHash {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: [u8; 8]| {
        for b in bytes {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(parent.map_or(u64::MAX, |p| p).to_le_bytes());
    for &t in tokens {
        eat((t as u64).to_le_bytes());
    }
    h
}

/// What a cached block holds: the hash it is kept under, its parent's and
/// its tokens (to tell a hash collision from a match).
#[derive(Debug, Clone)]
struct Kept {
    hash: PrefixHash,
    parent: Option<PrefixHash>,
    tokens: Vec<u32>,
}

#[derive(Debug)]
pub(crate) struct BlockPool {
    block_size: usize,
    /// Per block: the sequences holding it.
    holders: Vec<u32>,
    /// Blocks nobody holds and nothing is kept in.
    free: Vec<Block>,
    /// Per block: what it is kept as, if its tokens are cached.
    kept: Vec<Option<Kept>>,
    /// Cached blocks by hash.
    by_hash: HashMap<PrefixHash, Block>,
    /// Cached blocks nobody holds, by the tick of their last use: the
    /// first is evicted first.
    idle: BTreeMap<u64, Block>,
    /// Per block: its key in `idle` while it is there.
    idle_since: Vec<Option<u64>>,
    tick: u64,
    /// Blocks taken from the cache instead of computed, and looked for.
    pub hits: u64,
    pub lookups: u64,
}

impl BlockPool {
    pub(crate) fn new(blocks: usize, block_size: usize) -> Self {
        BlockPool {
            block_size,
            holders: vec![0; blocks],
            free: (0..blocks as Block).rev().collect(),
            kept: vec![None; blocks],
            by_hash: HashMap::new(),
            idle: BTreeMap::new(),
            idle_since: vec![None; blocks],
            tick: 0,
            hits: 0,
            lookups: 0,
        }
    }

    pub(crate) fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub(crate) fn len(&self) -> usize {
        self.holders.len()
    }

    /// Blocks a sequence can take now: free ones and cached ones nobody holds.
    pub(crate) fn available(&self) -> usize {
        self.free.len() + self.idle.len()
    }

    /// Blocks some sequence holds.
    pub(crate) fn held(&self) -> usize {
        self.len() - self.available()
    }

    /// Blocks whose tokens are kept for reuse (held or not).
    pub(crate) fn cached(&self) -> usize {
        self.by_hash.len()
    }

    /// A block for a sequence to write: a free one, else the cached block
    /// unused longest (forgotten). `None` when every block is held.
    pub(crate) fn take(&mut self) -> Option<Block> {
        let block = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.idle.pop_first()?;
                self.idle_since[b as usize] = None;
                let kept = self.kept[b as usize].take().expect("an idle block is kept");
                self.by_hash.remove(&kept.hash);
                b
            }
        };
        self.holders[block as usize] = 1;
        Some(block)
    }

    /// A sequence lets go of `block`: free when nobody else holds it,
    /// unless its tokens are kept (then cached until the pool needs it).
    pub(crate) fn release(&mut self, block: Block) {
        let b = block as usize;
        debug_assert!(self.holders[b] > 0, "block {block} released by no holder");
        self.holders[b] -= 1;
        if self.holders[b] > 0 {
            return;
        }
        if self.kept[b].is_some() {
            self.tick += 1;
            self.idle.insert(self.tick, block);
            self.idle_since[b] = Some(self.tick);
        } else {
            self.free.push(block);
        }
    }

    /// The cached block holding `tokens` (a whole block) after the prefix
    /// hashed `parent`, held now by one more sequence; `None` if none is.
    pub(crate) fn lookup(
        &mut self,
        parent: Option<PrefixHash>,
        tokens: &[u32],
    ) -> Option<(Block, PrefixHash)> {
        self.lookups += 1;
        let hash = block_hash(parent, tokens);
        let block = *self.by_hash.get(&hash)?;
        let kept = self.kept[block as usize].as_ref().expect("a block found by hash is kept");
        if kept.parent != parent || kept.tokens != tokens {
            return None;
        }
        if let Some(since) = self.idle_since[block as usize].take() {
            self.idle.remove(&since);
        }
        self.holders[block as usize] += 1;
        self.hits += 1;
        Some((block, hash))
    }

    /// Keeps `block`, now full with `tokens` after the prefix hashed
    /// `parent`, for later sequences; returns its hash. A block already
    /// kept under that hash stays the one found.
    pub(crate) fn keep(&mut self, block: Block, parent: Option<PrefixHash>, tokens: &[u32]) -> PrefixHash {
        debug_assert_eq!(tokens.len(), self.block_size);
        let hash = block_hash(parent, tokens);
        if self.kept[block as usize].is_none() && !self.by_hash.contains_key(&hash) {
            self.by_hash.insert(hash, block);
            self.kept[block as usize] = Some(Kept { hash, parent, tokens: tokens.to_vec() });
        }
        hash
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_taken_given_back_and_shared_by_prefix() {
        let mut pool = BlockPool::new(4, 2);
        let a = [pool.take().unwrap(), pool.take().unwrap()];
        let h0 = pool.keep(a[0], None, &[1, 2]);
        let h1 = pool.keep(a[1], Some(h0), &[3, 4]);
        assert_eq!((pool.available(), pool.cached()), (2, 2));
        // Another sequence with the same prompt shares both blocks.
        assert_eq!(pool.lookup(None, &[1, 2]), Some((a[0], h0)));
        assert_eq!(pool.lookup(Some(h0), &[3, 4]), Some((a[1], h1)));
        // A different second block, or the same tokens after another
        // prefix, is not found.
        assert_eq!(pool.lookup(Some(h0), &[3, 5]), None);
        assert_eq!(pool.lookup(None, &[3, 4]), None);
        for b in a {
            pool.release(b);
        }
        assert_eq!(pool.available(), 2, "still held once");
        for b in a {
            pool.release(b);
        }
        // Cached and idle: available, and found again.
        assert_eq!((pool.available(), pool.cached(), pool.held()), (4, 2, 0));
        assert_eq!(pool.lookup(None, &[1, 2]), Some((a[0], h0)));
        pool.release(a[0]);
        // Free blocks go first, then the idle block unused longest.
        let taken: Vec<Block> = (0..4).map(|_| pool.take().unwrap()).collect();
        assert_eq!(&taken[2..], &[a[1], a[0]], "evicted least recently used first");
        assert_eq!(pool.take(), None);
        assert_eq!(pool.cached(), 0);
        assert_eq!(pool.lookup(None, &[1, 2]), None);
        assert_eq!((pool.hits, pool.lookups), (3, 6));
    }
}
