//! Wall time per backend op on the CPU, for `strix bench --verbose`: where a prefill or a
//! decode step spends its time. A [`CpuBackend`](super::CpuBackend) made with
//! [`CpuBackend::with_op_times`](super::CpuBackend::with_op_times) adds the time of every op it
//! runs to an [`OpTimes`] the caller holds; one made with `new` keeps none and pays nothing.
//!
//! The ops run one after another on the calling thread (each spreads its own work over the
//! pool and returns when it is done), so an op's wall time is what it costs the model, and the
//! times of one forward pass add up to its wall time less the model's own bookkeeping.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What an op is filed under: its name and, for matmuls, the weight's dtype and shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct OpKey {
    pub op: &'static str,
    /// The weight's dtype (`bf16`, `q4_k`...), empty for ops without a weight matrix.
    pub dtype: &'static str,
    /// `[rows, cols]` of the weight, `(0, 0)` for ops without one.
    pub shape: (usize, usize),
}

/// Calls and total wall time of one [`OpKey`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpTotal {
    pub calls: u64,
    pub time: Duration,
}

/// The accumulated times, shared between a backend and whoever reads them.
#[derive(Debug, Default)]
pub struct OpTimes {
    totals: Mutex<BTreeMap<OpKey, OpTotal>>,
}

impl OpTimes {
    pub fn new() -> OpTimes {
        OpTimes::default()
    }

    /// Everything recorded so far.
    pub fn snapshot(&self) -> BTreeMap<OpKey, OpTotal> {
        self.totals.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// What was recorded between two snapshots (`before` taken first); keys with no calls in
    /// between are left out.
    pub fn delta(
        before: &BTreeMap<OpKey, OpTotal>,
        after: &BTreeMap<OpKey, OpTotal>,
    ) -> BTreeMap<OpKey, OpTotal> {
        after
            .iter()
            .filter_map(|(k, a)| {
                let b = before.get(k).copied().unwrap_or_default();
                let calls = a.calls - b.calls;
                (calls > 0).then(|| (*k, OpTotal { calls, time: a.time.saturating_sub(b.time) }))
            })
            .collect()
    }

    fn add(&self, key: OpKey, time: Duration) {
        let mut totals = self.totals.lock().unwrap_or_else(|e| e.into_inner());
        let t = totals.entry(key).or_default();
        t.calls += 1;
        t.time += time;
    }
}

/// Adds the time from its creation to its drop to `times` under `key`.
pub(super) struct OpTimer<'a> {
    times: &'a OpTimes,
    key: OpKey,
    start: Instant,
}

impl<'a> OpTimer<'a> {
    pub(super) fn start(times: &'a OpTimes, key: OpKey) -> OpTimer<'a> {
        OpTimer { times, key, start: Instant::now() }
    }
}

impl Drop for OpTimer<'_> {
    fn drop(&mut self) {
        self.times.add(self.key, self.start.elapsed());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timers_add_up_and_deltas_subtract() {
        let times = OpTimes::new();
        let key = |op| OpKey { op, dtype: "", shape: (0, 0) };
        {
            let _t = OpTimer::start(&times, key("add"));
        }
        let before = times.snapshot();
        for _ in 0..3 {
            let _t = OpTimer::start(&times, key("add"));
            let _u = OpTimer::start(&times, key("rms_norm"));
        }
        let after = times.snapshot();
        assert_eq!(after[&key("add")].calls, 4);
        let d = OpTimes::delta(&before, &after);
        assert_eq!(d[&key("add")].calls, 3);
        assert_eq!(d[&key("rms_norm")].calls, 3);
        assert!(OpTimes::delta(&after, &after).is_empty());
    }
}
