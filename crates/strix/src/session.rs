//! A session is one sequence's memory: the KV cache of every attention layer, the conv and
//! recurrent state of every Gated DeltaNet layer, and the tokens seen so far.
//!
//! Feeding tokens in any split — all at once, or a prompt and then one token at a time —
//! leaves the session in the same state (to f32 rounding), which is what makes multi-turn
//! chat and streaming decode cheap.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::backend::Backend;

/// Source of session ids: unique for the life of the process.
static NEXT_SESSION_ID: AtomicU64 = AtomicU64::new(1);

/// The state one decoder layer carries between calls.
pub enum LayerState<B: Backend> {
    /// `[capacity, kv_dim]` keys and values (post-norm, post-RoPE keys).
    Attention { k: B::Buf, v: B::Buf, capacity: usize },
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

    pub(crate) fn layer_mut(&mut self, l: usize) -> &mut LayerState<B> {
        &mut self.layers[l]
    }

    /// Makes every KV cache hold at least `needed` positions. Caches grow geometrically (capped
    /// at the context) so a long decode reallocates only a logarithmic number of times.
    pub(crate) fn reserve(&mut self, backend: &B, needed: usize, kv_dim: usize) {
        for layer in &mut self.layers {
            if let LayerState::Attention { k, v, capacity } = layer {
                if *capacity < needed {
                    let grown = needed.max(*capacity * 2).max(256).min(self.max_context.max(needed));
                    backend.resize(k, grown * kv_dim);
                    backend.resize(v, grown * kv_dim);
                    *capacity = grown;
                    self.buffers_id = NEXT_SESSION_ID.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    pub(crate) fn advance(&mut self, ids: &[u32]) {
        self.tokens.extend_from_slice(ids);
    }
}
