//! Response ids (`chatcmpl-…`, `call_…`) and timestamps: what the API handlers and the output
//! parser both stamp on what they make.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// A unique id with a prefix (`chatcmpl-`, `call_`): a per-process random salt and a counter.
pub fn fresh_id(prefix: &str) -> String {
    static SALT: OnceLock<u64> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let salt = *SALT.get_or_init(|| std::collections::hash_map::RandomState::new().build_hasher().finish());
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(salt ^ n);
    format!("{prefix}{:016x}{:08x}", h.finish(), n as u32)
}

pub fn unix_time() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
