//! The server's counters, gauges and histograms, and their Prometheus text exposition
//! (`GET /metrics`). Written by hand: a dozen atomics need no metrics crate.
//!
//! The engine thread and the HTTP handlers update them lock-free, except the per-route
//! request counts, which sit behind a mutex taken once per response.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Latency buckets in seconds, from a fast decode step on a small model to a long prefill.
const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0];
/// Scheduler-step buckets in seconds: from the host's share of a step (tens of microseconds)
/// to a step with a long prefill chunk.
const STEP_BUCKETS: &[f64] =
    &[0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5];

pub struct Histogram {
    bounds: &'static [f64],
    /// Non-cumulative counts per bucket; the last slot counts what lies past every bound.
    counts: Vec<AtomicU64>,
    sum_nanos: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        let counts = (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect();
        Histogram { bounds, counts, sum_nanos: AtomicU64::new(0) }
    }

    pub fn observe(&self, d: Duration) {
        let seconds = d.as_secs_f64();
        let slot = self.bounds.iter().position(|&b| seconds <= b).unwrap_or(self.bounds.len());
        self.counts[slot].fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (i, bound) in self.bounds.iter().enumerate() {
            cumulative += self.counts[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        cumulative += self.counts[self.bounds.len()].load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cumulative}");
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {cumulative}");
    }
}

pub struct Metrics {
    /// `(route, status)` → responses.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    /// Requests that ended because their client went away.
    pub cancelled: AtomicU64,
    /// Requests that ran to a finish reason.
    pub finished: AtomicU64,
    pub queue_depth: AtomicU64,
    pub running: AtomicU64,
    /// Bytes of KV cache and DeltaNet state reserved by the running sequences (their
    /// prompt plus `max_tokens`, at the model's per-token and per-sequence sizes).
    pub reserved_bytes: AtomicU64,
    pub steps: AtomicU64,
    /// Prompt tokens of the requests looked up in the prefix cache.
    pub prefix_cache_queries_tokens: AtomicU64,
    /// Prompt tokens restored from the prefix cache instead of prefilled.
    pub prefix_cache_hit_tokens: AtomicU64,
    /// Device bytes the prefix cache holds.
    pub prefix_cache_bytes: AtomicU64,
    pub ttft: Histogram,
    pub itl: Histogram,
    /// Whole scheduler steps that did work.
    pub step: Histogram,
    /// The part of each step outside the model's calls: scheduling, sampling bookkeeping,
    /// detokenizing, stop strings and handing tokens to the HTTP side.
    pub step_host: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::new(BTreeMap::new()),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            queue_depth: AtomicU64::new(0),
            running: AtomicU64::new(0),
            reserved_bytes: AtomicU64::new(0),
            steps: AtomicU64::new(0),
            prefix_cache_queries_tokens: AtomicU64::new(0),
            prefix_cache_hit_tokens: AtomicU64::new(0),
            prefix_cache_bytes: AtomicU64::new(0),
            ttft: Histogram::new(LATENCY_BUCKETS),
            itl: Histogram::new(LATENCY_BUCKETS),
            step: Histogram::new(STEP_BUCKETS),
            step_host: Histogram::new(STEP_BUCKETS),
        }
    }
}

impl Metrics {
    pub fn count_response(&self, route: &str, status: u16) {
        // A poisoned lock only means a panic elsewhere mid-update; the map is still usable.
        let mut requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *requests.entry((route.to_owned(), status)).or_insert(0) += 1;
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP strix_requests_total HTTP responses by route and status.\n# TYPE strix_requests_total counter"
        );
        let requests = self.requests.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for ((route, status), n) in requests {
            let _ = writeln!(out, "strix_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}");
        }
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let scalars: [(&str, &str, &str, u64); 12] = [
            ("strix_prompt_tokens_total", "counter", "Prompt tokens prefilled.", get(&self.prompt_tokens)),
            ("strix_generation_tokens_total", "counter", "Tokens generated.", get(&self.generation_tokens)),
            (
                "strix_requests_finished_total",
                "counter",
                "Generations that ran to a finish reason.",
                get(&self.finished),
            ),
            (
                "strix_requests_cancelled_total",
                "counter",
                "Generations cancelled by their client.",
                get(&self.cancelled),
            ),
            ("strix_engine_steps_total", "counter", "Scheduler steps.", get(&self.steps)),
            (
                "strix_queue_depth",
                "gauge",
                "Requests waiting for a place in the batch.",
                get(&self.queue_depth),
            ),
            (
                "strix_running_sequences",
                "gauge",
                "Sequences in the batch (prefilling or decoding).",
                get(&self.running),
            ),
            (
                "strix_reserved_state_bytes",
                "gauge",
                "KV cache and DeltaNet state bytes reserved by running sequences.",
                get(&self.reserved_bytes),
            ),
            (
                "strix_prefix_cache_queries_tokens_total",
                "counter",
                "Prompt tokens of the requests looked up in the prefix cache.",
                get(&self.prefix_cache_queries_tokens),
            ),
            (
                "strix_prefix_cache_hit_tokens_total",
                "counter",
                "Prompt tokens restored from the prefix cache instead of prefilled.",
                get(&self.prefix_cache_hit_tokens),
            ),
            (
                "strix_prefix_cache_bytes",
                "gauge",
                "Bytes of KV rows and DeltaNet states the prefix cache holds.",
                get(&self.prefix_cache_bytes),
            ),
            ("strix_up", "gauge", "1 while the server runs.", 1),
        ];
        for (name, kind, help, value) in scalars {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
        }
        self.ttft.render(
            &mut out,
            "strix_time_to_first_token_seconds",
            "From submission to the first token.",
        );
        self.itl.render(
            &mut out,
            "strix_inter_token_latency_seconds",
            "Between consecutive tokens of a sequence.",
        );
        self.step.render(
            &mut out,
            "strix_engine_step_seconds",
            "One scheduler step that did work: admission, prompt chunks, a decode step, streaming its tokens.",
        );
        self.step_host.render(
            &mut out,
            "strix_engine_step_host_seconds",
            "The part of a step outside the model's calls (scheduling, detokenizing, stop strings, sending tokens).",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_has_every_family() {
        let m = Metrics::default();
        m.count_response("/v1/completions", 200);
        m.ttft.observe(Duration::from_millis(3));
        m.ttft.observe(Duration::from_secs(100));
        let text = m.render();
        assert!(text.contains("strix_requests_total{route=\"/v1/completions\",status=\"200\"} 1"));
        assert!(text.contains("strix_time_to_first_token_seconds_bucket{le=\"0.0025\"} 0"));
        assert!(text.contains("strix_time_to_first_token_seconds_bucket{le=\"0.005\"} 1"));
        assert!(text.contains("strix_time_to_first_token_seconds_bucket{le=\"+Inf\"} 2"));
        assert!(text.contains("strix_time_to_first_token_seconds_count 2"));
        assert!(text.contains("strix_running_sequences 0"));
        m.step.observe(Duration::from_micros(300));
        m.step_host.observe(Duration::from_micros(40));
        let text = m.render();
        assert!(text.contains("strix_engine_step_seconds_bucket{le=\"0.00025\"} 0"));
        assert!(text.contains("strix_engine_step_seconds_bucket{le=\"0.0005\"} 1"));
        assert!(text.contains("strix_engine_step_host_seconds_bucket{le=\"0.0001\"} 1"));
    }
}
