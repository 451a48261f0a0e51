//! Recorded decode steps: a step's launches captured once into a CUDA graph and replayed,
//! so a step costs one launch on the host instead of hundreds.
//!
//! A step is recorded the second time its key is seen (the first runs op by op, which also
//! fills the buffer free list with every size the step allocates, so the capture rarely needs
//! fresh memory). While capturing, ops read the step's ids and positions from the device's
//! step-input buffer rather than uploading them, and every buffer the step allocates stays
//! with the recording, so each replay finds its scratch where the kernels were told it is;
//! small constant uploads (state pointers) are copied synchronously, so a recording holds
//! kernels only, chained by programmatic dependent launch.
//! Before a replay only the ids and positions are copied in.

use std::collections::{HashMap, HashSet, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::driver::CudaGraph;

use super::device::{cuda_error, panic_message, Captured, CudaBuf, Device};
use crate::error::Result;

/// Recordings kept at once; the oldest goes first. A decode loop needs one; a server's batch
/// changes as requests come and go, and a recent composition may come back.
const MAX_RECORDINGS: usize = 8;
/// Keys remembered as seen once (cleared when full).
const MAX_SEEN: usize = 4096;

/// One recorded step: the graph, the buffer its output lands in, and what it must keep alive.
pub(super) struct Recording {
    graph: CudaGraph,
    out: CudaBuf,
    // Dropped after the graph: the buffers go back to the free list once nothing replays them.
    _captured: Captured,
}

// SAFETY: a CUgraphExec may be used from any thread as long as calls on it are serialised:
// recordings are only touched under the backend's `Mutex<Recordings>`.
unsafe impl Send for Recording {}

impl Recording {
    /// Captures the ops `step` issues. Nothing runs: the caller replays the recording.
    pub fn capture(dev: &Device, step: &mut dyn FnMut() -> CudaBuf) -> Result<Recording> {
        dev.begin_capture()?;
        let out = catch_unwind(AssertUnwindSafe(step));
        let (graph, captured) = dev.end_capture();
        match out {
            Ok(out) => Ok(Recording { graph: graph?, out, _captured: captured }),
            Err(payload) => {
                Err(cuda_error(format!("an op failed while recording: {}", panic_message(&*payload))))
            }
        }
    }

    fn replay(&self) -> Result<&CudaBuf> {
        self.graph.launch().map_err(|e| cuda_error(format!("replaying a decode step: {e}")))?;
        Ok(&self.out)
    }
}

/// What to do with a step.
pub(super) enum Plan {
    /// Run it op by op (first sight, or its capture failed before).
    Eager,
    /// Capture it, then replay the capture.
    Record,
    /// Replay its recording.
    Replay,
}

#[derive(Default)]
pub(super) struct Recordings {
    by_key: HashMap<u64, Recording>,
    /// Keys of `by_key`, oldest first.
    order: VecDeque<u64>,
    seen: HashSet<u64>,
    failed: HashSet<u64>,
    last_failure: Option<String>,
}

impl Recordings {
    pub fn plan(&mut self, key: u64) -> Plan {
        if self.by_key.contains_key(&key) {
            Plan::Replay
        } else if self.failed.contains(&key) {
            Plan::Eager
        } else if self.seen.contains(&key) {
            Plan::Record
        } else {
            if self.seen.len() >= MAX_SEEN {
                self.seen.clear();
            }
            self.seen.insert(key);
            Plan::Eager
        }
    }

    pub fn replay(&mut self, key: u64) -> Result<&CudaBuf> {
        // The most recently used goes to the back of the eviction order.
        if let Some(i) = self.order.iter().position(|&k| k == key) {
            self.order.remove(i);
            self.order.push_back(key);
        }
        self.by_key.get(&key).ok_or_else(|| cuda_error("no recording for this step"))?.replay()
    }

    pub fn insert_and_replay(&mut self, key: u64, recording: Recording) -> Result<&CudaBuf> {
        while self.order.len() >= MAX_RECORDINGS {
            if let Some(old) = self.order.pop_front() {
                self.by_key.remove(&old);
            }
        }
        self.by_key.insert(key, recording);
        self.order.push_back(key);
        self.replay(key)
    }

    pub fn mark_failed(&mut self, key: u64, why: String) {
        self.failed.insert(key);
        self.last_failure = Some(why);
    }

    pub fn last_failure(&self) -> Option<&str> {
        self.last_failure.as_deref()
    }
}
