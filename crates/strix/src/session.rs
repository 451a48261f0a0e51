//! A session is one sequence's memory: the KV cache of every attention layer, the conv and
//! recurrent state of every Gated DeltaNet layer, and the tokens seen so far.
//!
//! Feeding tokens in any split — all at once, or a prompt and then one token at a time —
//! leaves the session in the same state (to f32 rounding), which is what makes multi-turn
//! chat and streaming decode cheap.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::backend::{Backend, DeltaNetState, KvCache};

/// Source of session ids: unique for the life of the process.
static NEXT_SESSION_ID: AtomicU64 = AtomicU64::new(1);

/// The state one decoder layer carries between calls.
pub enum LayerState<B: Backend> {
    /// `[capacity, kv_dim]` keys and values (post-norm, post-RoPE keys), in the backend's
    /// element type.
    Attention { k: B::Cache, v: B::Cache, capacity: usize },
    /// `[conv_dim, kernel - 1]` last conv inputs and `[v_heads, k_dim, v_dim]` delta-rule state.
    DeltaNet { conv: B::Buf, recurrent: B::Buf },
}

pub struct Session<B: Backend> {
    layers: Vec<LayerState<B>>,
    tokens: Vec<u32>,
    max_context: usize,
    /// Unique per session and bumped whenever a state buffer is reallocated: equal ids mean
    /// the same buffers, which is what a recorded decode step relies on.
    buffers_id: u64,
}

impl<B: Backend> Session<B> {
    pub(crate) fn new(layers: Vec<LayerState<B>>, max_context: usize) -> Session<B> {
        Session {
            layers,
            tokens: Vec::new(),
            max_context,
            buffers_id: NEXT_SESSION_ID.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// Names this session's state buffers as they are now (see [`Backend::decode_step`]).
    pub(crate) fn buffers_id(&self) -> u64 {
        self.buffers_id
    }

    /// Tokens processed so far (the position of the next token).
    pub fn position(&self) -> usize {
        self.tokens.len()
    }

    /// Every token fed to the session, prompt and generated alike.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Tokens that can still be fed before the context is full.
    pub fn remaining(&self) -> usize {
        self.max_context - self.tokens.len()
    }

    /// The state of layer `l`, a Gated DeltaNet layer, as the DeltaNet ops take it.
    pub(crate) fn deltanet_state(&mut self, l: usize) -> DeltaNetState<'_, B::Buf> {
        let LayerState::DeltaNet { conv, recurrent } = &mut self.layers[l] else {
            unreachable!("layer {l}: session layers follow the model's layer_types")
        };
        DeltaNetState { conv, recurrent }
    }

    /// The KV cache of layer `l`, an attention layer, as the attention ops take it.
    pub(crate) fn kv_cache(&mut self, l: usize) -> KvCache<'_, B::Cache> {
        let LayerState::Attention { k, v, .. } = &mut self.layers[l] else {
            unreachable!("layer {l}: session layers follow the model's layer_types")
        };
        KvCache { k, v }
    }

    /// Makes every KV cache hold at least `needed` positions. Caches grow geometrically (capped
    /// at the context) so a long decode reallocates only a logarithmic number of times.
    pub(crate) fn reserve(&mut self, backend: &B, needed: usize, kv_dim: usize) {
        for layer in &mut self.layers {
            if let LayerState::Attention { k, v, capacity } = layer {
                if *capacity < needed {
                    let grown = needed.max(*capacity * 2).max(256).min(self.max_context.max(needed));
                    backend.cache_resize(k, grown * kv_dim);
                    backend.cache_resize(v, grown * kv_dim);
                    *capacity = grown;
                    self.buffers_id = NEXT_SESSION_ID.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    pub(crate) fn advance(&mut self, ids: &[u32]) {
        self.tokens.extend_from_slice(ids);
    }

    /// Copies positions `start..position()` out of the session: their keys and values in every
    /// attention layer, and every DeltaNet layer's states as they are now (after the last
    /// position). `start` must be below the position. `kv_dim` is the attention layers' row,
    /// `states` the DeltaNet layers' conv and recurrent state lengths.
    pub(crate) fn save_block(
        &self,
        backend: &B,
        start: usize,
        kv_dim: usize,
        states: (usize, usize),
    ) -> SessionBlock<B> {
        let end = self.position();
        assert!(start < end, "save_block: positions {start}..{end} are empty");
        let rows = (end - start) * kv_dim;
        let cache_bytes = backend.kv_cache_type().bytes();
        let mut bytes = 0usize;
        let layers = self
            .layers
            .iter()
            .map(|layer| match layer {
                LayerState::Attention { k, v, .. } => {
                    let (mut k_rows, mut v_rows) = (backend.cache_zeros(rows), backend.cache_zeros(rows));
                    backend.cache_copy(k, start * kv_dim, &mut k_rows, 0, rows);
                    backend.cache_copy(v, start * kv_dim, &mut v_rows, 0, rows);
                    bytes += 2 * rows * cache_bytes;
                    SavedLayer::Attention { k: k_rows, v: v_rows }
                }
                LayerState::DeltaNet { conv, recurrent } => {
                    bytes += 4 * (states.0 + states.1);
                    SavedLayer::DeltaNet {
                        conv: copy_of(backend, conv, states.0),
                        recurrent: copy_of(backend, recurrent, states.1),
                    }
                }
            })
            .collect();
        SessionBlock { start, tokens: self.tokens[start..].to_vec(), layers, bytes }
    }

    /// Extends the session by `blocks`, which continue each other from its position: copies
    /// their keys and values into its attention caches and the last block's DeltaNet states
    /// into its own, so the session is bitwise the session the blocks were saved from.
    pub(crate) fn restore_blocks(
        &mut self,
        backend: &B,
        blocks: &[&SessionBlock<B>],
        kv_dim: usize,
        states: (usize, usize),
    ) -> Result<(), String> {
        let Some(last) = blocks.last() else { return Ok(()) };
        let mut at = self.position();
        for block in blocks {
            if block.start != at {
                return Err(format!(
                    "a saved block starts at position {}, the session is at {at}",
                    block.start
                ));
            }
            if block.layers.len() != self.layers.len() {
                return Err(format!(
                    "a saved block has {} layers, the session {}",
                    block.layers.len(),
                    self.layers.len()
                ));
            }
            at = block.end();
        }
        if at > self.max_context {
            return Err(format!(
                "the saved blocks reach position {at}; the session holds {}",
                self.max_context
            ));
        }
        self.reserve(backend, at, kv_dim);
        for block in blocks {
            let rows = block.tokens.len() * kv_dim;
            for (layer, saved) in self.layers.iter_mut().zip(&block.layers) {
                if let (LayerState::Attention { k, v, .. }, SavedLayer::Attention { k: k_rows, v: v_rows }) =
                    (layer, saved)
                {
                    backend.cache_copy(k_rows, 0, k, block.start * kv_dim, rows);
                    backend.cache_copy(v_rows, 0, v, block.start * kv_dim, rows);
                }
            }
            self.tokens.extend_from_slice(&block.tokens);
        }
        for (layer, saved) in self.layers.iter_mut().zip(&last.layers) {
            match (layer, saved) {
                (
                    LayerState::DeltaNet { conv, recurrent },
                    SavedLayer::DeltaNet { conv: c, recurrent: r },
                ) => {
                    backend.copy(c, 0, conv, 0, states.0);
                    backend.copy(r, 0, recurrent, 0, states.1);
                }
                (LayerState::Attention { .. }, SavedLayer::Attention { .. }) => {}
                _ => return Err("a saved block's layers are not the session's kinds".into()),
            }
        }
        Ok(())
    }
}

/// A copy of a run of one session's history, positions `start..end`: the keys and values the
/// attention layers cached for them and the DeltaNet states after `end`. Blocks that continue
/// each other from position 0 rebuild the session they were saved from
/// ([`crate::model::Model::restore_blocks`]); the copy is never written again, so sessions that
/// share a prefix share its block without one changing it for another.
pub struct SessionBlock<B: Backend> {
    start: usize,
    tokens: Vec<u32>,
    layers: Vec<SavedLayer<B>>,
    bytes: usize,
}

enum SavedLayer<B: Backend> {
    /// `[end - start, kv_dim]` keys and values.
    Attention {
        k: B::Cache,
        v: B::Cache,
    },
    DeltaNet {
        conv: B::Buf,
        recurrent: B::Buf,
    },
}

impl<B: Backend> SessionBlock<B> {
    /// The first position the block holds.
    pub fn start(&self) -> usize {
        self.start
    }

    /// The position after its last one.
    pub fn end(&self) -> usize {
        self.start + self.tokens.len()
    }

    /// The tokens at its positions.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Device bytes it holds: its KV rows in the cache's element type and the f32 DeltaNet
    /// states.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// A new buffer holding a copy of the `len` floats of `buf`.
fn copy_of<B: Backend>(backend: &B, buf: &B::Buf, len: usize) -> B::Buf {
    let mut out = backend.scratch(len);
    backend.copy(buf, 0, &mut out, 0, len);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    /// Growing the caches keeps every row written so far, zeroes the new ones, and renames the
    /// buffers (a recorded decode step must not replay over the old ones).
    #[test]
    fn reserve_grows_caches_keeping_rows() {
        let cpu = CpuBackend::new();
        let kv = 3;
        let layers = vec![
            LayerState::Attention { k: cpu.cache_zeros(0), v: cpu.cache_zeros(0), capacity: 0 },
            LayerState::DeltaNet { conv: cpu.zeros(2), recurrent: cpu.zeros(2) },
        ];
        let mut s = Session::new(layers, 1000);
        s.reserve(&cpu, 5, kv);
        let id = s.buffers_id();
        let LayerState::Attention { k, capacity, .. } = &mut s.layers[0] else { unreachable!() };
        assert_eq!((*capacity, k.len()), (256, 256 * kv));
        let rows: Vec<f32> = (0..5 * kv).map(|i| i as f32 + 0.5).collect();
        k[..5 * kv].copy_from_slice(&rows);
        s.reserve(&cpu, 200, kv);
        assert_eq!(s.buffers_id(), id, "no growth, same buffers");
        s.reserve(&cpu, 300, kv);
        assert_ne!(s.buffers_id(), id);
        let LayerState::Attention { k, capacity, .. } = &mut s.layers[0] else { unreachable!() };
        assert_eq!(*capacity, 512);
        assert_eq!(cpu.cache_download(k, 0, 5 * kv), rows);
        assert!(cpu.cache_download(k, 5 * kv, 507 * kv).iter().all(|&x| x == 0.0));
    }
}
