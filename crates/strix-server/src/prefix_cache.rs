//! The prefix cache: copies of sessions' state at the prefill's pass boundaries, so that a
//! request whose prompt starts like an earlier one resumes there instead of prefilling it again.
//!
//! A prompt is cut into blocks of [`strix::model::Model::pass_tokens`] tokens counted from
//! position 0 — the pieces the engine's prefill feeds anyway. Block `i`'s key hashes its tokens
//! together with block `i - 1`'s key (vLLM's chained block hashes), so one key names a whole
//! prefix. Each cached block is a [`SessionBlock`]: the attention layers' keys and values of its
//! positions and the DeltaNet conv and recurrent states after its last position (a DeltaNet
//! layer keeps one running state, not a per-token cache, so a prefix can only be resumed where
//! that state was saved). A session resumes from a chain of blocks by copying their rows and
//! the last block's states into itself; the cached copies are never written again, so a
//! sequence that extends a shared prefix never changes it for another.
//!
//! Exactness: on the CPU a prefill is not split-invariant (the same tokens fed in other pieces
//! give other last bits), and a decode step computes differently from a prefill pass. A
//! session's state is bitwise what a request without the cache computes only at the pass
//! boundaries of its prompt, so blocks are saved only there: never at the end of a prompt that
//! is not a boundary, nor at the end of a finished sequence (its generated tokens were fed by
//! decode steps). A request resumes at the longest cached boundary strictly inside its prompt
//! (its last piece must still be fed to draw the first token), and its tokens and
//! log-probabilities are then bit for bit those it gets with the cache off.
//!
//! Memory: the blocks' bytes count against the cache's own budget, apart from the running
//! sequences' state budget, so admission is unchanged. When a new block does not fit, the
//! least recently used blocks that no other block continues are evicted (a block is useless
//! without the ones before it). Restores copy synchronously on the engine thread, so nothing
//! can be evicted while a restore reads it.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};

use strix::backend::Backend;
use strix::model::Model;
use strix::session::{Session, SessionBlock};

/// A key naming a prefix of whole blocks: block `i`'s tokens hashed with block `i - 1`'s key.
pub type BlockKey = u64;

/// The chained keys of `prompt`'s whole blocks of `block_tokens` tokens.
pub fn block_keys(prompt: &[u32], block_tokens: usize) -> Vec<BlockKey> {
    let mut parent: Option<BlockKey> = None;
    prompt
        .chunks_exact(block_tokens.max(1))
        .map(|block| {
            // SipHash with fixed keys: the same prompt gives the same keys for the process's
            // life. Keys only find candidates; a hit is confirmed on the tokens themselves.
            let mut h = DefaultHasher::new();
            parent.hash(&mut h);
            block.hash(&mut h);
            let key = h.finish();
            parent = Some(key);
            key
        })
        .collect()
}

struct Node<B: Backend> {
    parent: Option<BlockKey>,
    block: SessionBlock<B>,
    /// Cached blocks that continue this one (it can be evicted only when there are none).
    children: usize,
    /// The cache's clock when a lookup or insert last went through this block.
    last_used: u64,
}

pub struct PrefixCache<B: Backend> {
    block_tokens: usize,
    /// Device bytes one block holds (its KV rows and DeltaNet states).
    block_bytes: u64,
    budget_bytes: u64,
    bytes: u64,
    nodes: HashMap<BlockKey, Node<B>>,
    clock: u64,
}

impl<B: Backend> PrefixCache<B> {
    /// An empty cache of blocks of `block_tokens` tokens, `block_bytes` each, holding at most
    /// `budget_bytes`.
    pub fn new(block_tokens: usize, block_bytes: u64, budget_bytes: u64) -> Self {
        PrefixCache {
            block_tokens: block_tokens.max(1),
            block_bytes,
            budget_bytes,
            bytes: 0,
            nodes: HashMap::new(),
            clock: 0,
        }
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Device bytes the cached blocks hold.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Blocks cached.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Extends `session`, which has been fed `prompt[..session.position()]` (a block boundary),
    /// by the longest run of cached blocks that continues it and ends strictly inside
    /// `prompt`; `keys` are `prompt`'s [`block_keys`]. Returns the tokens restored (0: none).
    pub fn resume(
        &mut self,
        model: &Model<B>,
        session: &mut Session<B>,
        prompt: &[u32],
        keys: &[BlockKey],
    ) -> strix::Result<usize> {
        let at = session.position();
        if !at.is_multiple_of(self.block_tokens) {
            return Ok(0);
        }
        let first = at / self.block_tokens;
        let mut chain = Vec::new();
        for (i, key) in keys.iter().enumerate().skip(first) {
            let end = (i + 1) * self.block_tokens;
            if end >= prompt.len() {
                break;
            }
            match self.nodes.get(key) {
                Some(node)
                    if node.block.start() == i * self.block_tokens
                        && node.block.tokens() == &prompt[i * self.block_tokens..end] =>
                {
                    chain.push(*key)
                }
                _ => break,
            }
        }
        let Some(&last) = chain.last() else { return Ok(0) };
        let blocks: Vec<&SessionBlock<B>> = chain.iter().map(|k| &self.nodes[k].block).collect();
        model.restore_blocks(session, &blocks)?;
        self.touch(last);
        Ok(session.position() - at)
    }

    /// Saves the block of `session`'s last `block_tokens` positions, when the session has just
    /// been fed `prompt[..session.position()]` up to a block boundary in whole passes and the
    /// block before it is cached (or it is the first). `keys` are `prompt`'s [`block_keys`].
    /// Evicts least recently used blocks to stay within the budget; a block larger than the
    /// whole budget is not kept. On a device with memory of its own, the block is not saved
    /// unless `headroom` bytes (what the running sequences may still allocate) stay free
    /// beside it, so the cache never takes memory that admission has promised.
    pub fn insert(
        &mut self,
        model: &Model<B>,
        session: &Session<B>,
        prompt: &[u32],
        keys: &[BlockKey],
        headroom: u64,
    ) -> strix::Result<()> {
        let end = session.position();
        if end == 0 || !end.is_multiple_of(self.block_tokens) || end > prompt.len() {
            return Ok(());
        }
        let i = end / self.block_tokens - 1;
        let key = keys[i];
        let parent = i.checked_sub(1).map(|p| keys[p]);
        if self.nodes.contains_key(&key) {
            // Cached already (or a different prefix whose key collides: left as it is).
            self.touch(key);
            return Ok(());
        }
        if parent.is_some_and(|p| !self.nodes.contains_key(&p)) {
            // Its prefix was evicted: the block could never be resumed from.
            return Ok(());
        }
        // A block larger than the whole budget, or one the device has no room for, is not
        // copied at all.
        let needed = self.block_bytes.saturating_add(headroom);
        if self.block_bytes > self.budget_bytes
            || model.backend().free_memory().is_some_and(|free| (free as u64) < needed)
        {
            return Ok(());
        }
        let block = model.save_block(session, end - self.block_tokens)?;
        let bytes = block.bytes() as u64;
        if let Some(p) = parent {
            if let Some(node) = self.nodes.get_mut(&p) {
                node.children += 1;
            }
        }
        self.nodes.insert(key, Node { parent, block, children: 0, last_used: 0 });
        self.bytes += bytes;
        self.touch(key);
        while self.bytes > self.budget_bytes {
            if !self.evict_one(key) {
                // Only the new block's own prefix is left, which it needs: it goes instead.
                self.remove(key);
            }
        }
        Ok(())
    }

    /// Marks `key` and every block before it as just used.
    fn touch(&mut self, key: BlockKey) {
        self.clock += 1;
        let mut next = Some(key);
        while let Some(k) = next {
            let Some(node) = self.nodes.get_mut(&k) else { break };
            node.last_used = self.clock;
            next = node.parent;
        }
    }

    /// Evicts the least recently used block that no block continues, other than `keep`.
    fn evict_one(&mut self, keep: BlockKey) -> bool {
        let victim = self
            .nodes
            .iter()
            .filter(|(k, n)| n.children == 0 && **k != keep)
            .min_by_key(|(_, n)| n.last_used)
            .map(|(k, _)| *k);
        let Some(victim) = victim else { return false };
        self.remove(victim);
        true
    }

    /// Drops a block that no block continues.
    fn remove(&mut self, key: BlockKey) {
        let Some(node) = self.nodes.remove(&key) else { return };
        debug_assert_eq!(node.children, 0, "a block was removed before the blocks that continue it");
        self.bytes -= node.block.bytes() as u64;
        if let Some(parent) = node.parent.and_then(|p| self.nodes.get_mut(&p)) {
            parent.children -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use strix::backend::cpu::CpuBackend;

    fn model(pass: usize) -> Model<CpuBackend> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/vlm-f32-gdn2x");
        let mut model = Model::load(&dir, CpuBackend::new(), None).unwrap();
        model.set_pass_tokens(pass).unwrap();
        model
    }

    fn block_bytes(m: &Model<CpuBackend>) -> u64 {
        crate::engine::StateSizes::of(m).for_tokens(m.pass_tokens())
    }

    fn prompt(len: usize, seed: u32) -> Vec<u32> {
        (0..len as u32).map(|i| (i * 7 + seed * 13) % 300).collect()
    }

    /// Feeds `prompt[..end]` in the engine's pieces (whole passes from 0), inserting each block.
    fn feed(
        m: &Model<CpuBackend>,
        cache: &mut PrefixCache<CpuBackend>,
        s: &mut Session<CpuBackend>,
        p: &[u32],
        end: usize,
    ) {
        let keys = block_keys(p, cache.block_tokens());
        while s.position() < end {
            let at = s.position();
            let next = end.min((at / m.pass_tokens() + 1) * m.pass_tokens());
            m.prefill(s, &p[at..next]).unwrap();
            cache.insert(m, s, p, &keys, 0).unwrap();
        }
    }

    #[test]
    fn keys_chain_the_blocks_before() {
        let a = prompt(200, 1);
        let mut b = a.clone();
        b[70] += 1;
        let (ka, kb) = (block_keys(&a, 64), block_keys(&b, 64));
        assert_eq!(ka.len(), 3);
        assert_eq!(ka[0], kb[0]);
        assert_ne!(ka[1], kb[1]);
        assert_ne!(ka[2], kb[2], "a later block's key depends on every token before it");
        assert_ne!(block_keys(&a[64..], 64)[0], ka[1], "the same tokens after another prefix");
    }

    /// A session resumed from cached blocks is bitwise the session that was fed the tokens:
    /// same next-token logits, here after a block that diverges inside.
    #[test]
    fn a_resumed_session_is_bitwise_the_fed_one() {
        let m = model(64);
        let mut cache = PrefixCache::new(64, block_bytes(&m), u64::MAX);
        let a = prompt(200, 1);
        let mut s = m.new_session(1024);
        feed(&m, &mut cache, &mut s, &a, a.len());
        assert_eq!(cache.len(), 3, "blocks end at 64, 128 and 192");

        let mut b = a[..150].to_vec();
        b.extend(prompt(40, 5));
        let keys = block_keys(&b, 64);
        let mut resumed = m.new_session(1024);
        assert_eq!(cache.resume(&m, &mut resumed, &b, &keys).unwrap(), 128, "block 3 diverges at 150");
        assert_eq!(resumed.tokens(), &b[..128]);
        let mut fed = m.new_session(1024);
        feed(&m, &mut PrefixCache::new(64, block_bytes(&m), 0), &mut fed, &b, 128);
        let rest = &b[128..];
        let want = m.forward(&mut fed, rest, strix::model::Logits::Last).unwrap();
        let got = m.forward(&mut resumed, rest, strix::model::Logits::Last).unwrap();
        assert!(want.iter().zip(&got).all(|(x, y)| x.to_bits() == y.to_bits()));

        // Blocks must continue the session they extend, and a block must hold positions.
        let second = m.save_block(&fed, 64).unwrap();
        let err = m.restore_blocks(&mut m.new_session(1024), &[&second]).unwrap_err();
        assert!(err.to_string().contains("starts at position 64"), "{err}");
        assert!(m.save_block(&fed, fed.position()).is_err());
    }

    /// A prompt resumes only strictly inside itself: its last piece is left to feed.
    #[test]
    fn a_prompt_is_never_resumed_to_its_end() {
        let m = model(64);
        let mut cache = PrefixCache::new(64, block_bytes(&m), u64::MAX);
        let a = prompt(128, 2);
        let mut s = m.new_session(1024);
        feed(&m, &mut cache, &mut s, &a, a.len());
        assert_eq!(cache.len(), 2);
        let mut again = m.new_session(1024);
        assert_eq!(cache.resume(&m, &mut again, &a, &block_keys(&a, 64)).unwrap(), 64);
    }

    /// The budget holds: the least recently used block that no other continues goes first,
    /// and nothing is kept in a budget smaller than one block.
    #[test]
    fn eviction_keeps_the_budget_and_takes_the_oldest_leaf() {
        let m = model(64);
        let mut probe = PrefixCache::new(64, block_bytes(&m), u64::MAX);
        let mut s = m.new_session(1024);
        feed(&m, &mut probe, &mut s, &prompt(64, 0), 64);
        let one = probe.bytes();
        assert!(one > 0);

        let mut cache = PrefixCache::new(64, block_bytes(&m), 3 * one);
        let (a, b) = (prompt(140, 1), prompt(140, 2));
        feed(&m, &mut cache, &mut m.new_session(1024), &a, 140);
        feed(&m, &mut cache, &mut m.new_session(1024), &b, 64);
        assert_eq!((cache.len(), cache.bytes()), (3, 3 * one));
        // `a`'s second block is the oldest leaf: it goes when `b`'s second block comes in.
        feed(&m, &mut cache, &mut m.new_session(1024), &b, 128);
        assert_eq!((cache.len(), cache.bytes()), (3, 3 * one));
        let mut r = m.new_session(1024);
        assert_eq!(cache.resume(&m, &mut r, &a, &block_keys(&a, 64)).unwrap(), 64);
        let mut r = m.new_session(1024);
        assert_eq!(cache.resume(&m, &mut r, &b, &block_keys(&b, 64)).unwrap(), 128);
        // A chain longer than the budget keeps its first blocks: a block needs those before it.
        let mut two = PrefixCache::new(64, block_bytes(&m), 2 * one);
        feed(&m, &mut two, &mut m.new_session(1024), &prompt(200, 3), 200);
        assert_eq!((two.len(), two.bytes()), (2, 2 * one));
        // Nothing fits in a budget smaller than a block.
        let mut tiny = PrefixCache::new(64, block_bytes(&m), one - 1);
        feed(&m, &mut tiny, &mut m.new_session(1024), &a, 140);
        assert!(tiny.is_empty());
    }
}
