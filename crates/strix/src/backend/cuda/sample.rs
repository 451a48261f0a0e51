//! Launchers for `sample.cu`: picking tokens from rows of logits on the device, so that only
//! the token ids (and the few log-probabilities asked for) cross to the host. The greedy
//! argmax, and prepared draws (`sampling.rs`'s `sample_prepared`, the host's algorithm step
//! for step) with their log-probabilities:
//!
//! - first, constrained rows get their grammar mask (`draw_mask`: one packed bitmask of the
//!   vocabulary per constrained row, uploaded once per step; unconstrained rows are not
//!   touched and cost nothing), the tokens it does not allow set to −∞;
//! - then, rows with a logit bias or penalties get them (`draw_adjust`: only the few listed
//!   `(id, bias)` and `(id, flags)` pairs are uploaded; rows with neither are not touched);
//! - rows with a top-k of 2..=[`PREPARED_TOP_K_MAX`] below the vocabulary go to `sample_topk`,
//!   one block a row, which sorts the top-k and walks them as the host does;
//! - every other row goes to the full-vocabulary pipeline, several blocks a row, which sums
//!   probability mass in fixed point (the same sums in any order, so a row's draw does not
//!   depend on its batch): greedy rows, rows with no top-k (or one not below the vocabulary:
//!   temperature alone, top-p, min-p), which it walks in id order as the host does, and the rows
//!   the host sorts (a larger top-k below the vocabulary; top-p in a vocabulary of at most 2048),
//!   whose top-k, top-p and draw in the host's sorted order it finds by radix selects (`sel_*`);
//!   every row that asks for log-probabilities goes through its last two kernels;
//! - the rare rows the pipeline flags are drawn on the host from the downloaded row: top-p
//!   without a top-k over at most 2048 finite logits of a larger vocabulary (which the host
//!   sorts), or with a crossing bucket of more than 4096 tokens.

use cudarc::driver::CudaFunction;

use super::device::{kernel_args, CudaBuf, Device};
use crate::error::Result;
use crate::sampling::{
    sample_prepared, Draw, NonFiniteLogits, PreparedSample, SamplingParams, TokenLogprobs, PREPARED_TOP_K_MAX,
};

pub(super) const SOURCE: &str = include_str!("sample.cu");

/// `NO_TOKEN` of `sample.cu`: the row's logits hold NaN or +∞, or nothing above −∞.
const NO_TOKEN: u32 = u32::MAX;

/// `ARGMAX_THREADS` and `ARGMAX_UNROLL` of `sample.cu`: a block of the argmax's first stage,
/// and the columns each of its threads reads; the block scans `ARGMAX_SPAN` columns.
const ARGMAX_THREADS: u32 = 256;
const ARGMAX_UNROLL: usize = 8;
const ARGMAX_SPAN: usize = ARGMAX_THREADS as usize * ARGMAX_UNROLL;

/// `FULL_THREADS`, `TOPP_BUCKETS`, `TOPP_CAP` and `TOP_N_MAX` of `sample.cu`.
const FULL_THREADS: u32 = 256;
const TOPP_BUCKETS: usize = 4096;
const TOPP_CAP: usize = 4096;
const TOP_N_MAX: usize = 20;
/// Blocks of the full pipeline a row is split into, at most.
const MAX_PARTS: usize = 64;

/// `FULL_GREEDY`, `FULL_DRAW`, `FULL_LOGPROBS_ONLY` of `sample.cu`: what the full pipeline
/// does with a row.
const FULL_GREEDY: i32 = 0;
const FULL_DRAW: i32 = 1;
const FULL_LOGPROBS_ONLY: i32 = 2;
/// `FULL_HOST` of `sample.cu`: the row's draw is left to the host.
const FULL_HOST: i32 = 2;
/// `SEL_TOPK`, `SEL_TOPP`, `SEL_DRAW` and `SEL_BUCKETS` of `sample.cu`: the radix selects of a
/// row with a top-k above [`PREPARED_TOP_K_MAX`], and the digits of a pass.
const SEL_TOPK: i32 = 0;
const SEL_TOPP: i32 = 1;
const SEL_DRAW: i32 = 2;
const SEL_BUCKETS: usize = 2048;
/// The select's passes over the 32-bit key (11, 11 and 10 bits).
const SEL_PASSES: i32 = 3;
/// `SORT_BELOW` of `sample.cu` (and `sampling.rs`): the host sorts a top-p row's candidates
/// when there are at most this many.
const SORT_BELOW: usize = 2048;

/// `DrawRow` of `sample.cu`: one row the device takes.
#[repr(C)]
#[derive(Clone, Copy)]
struct DrawRow {
    uniform: f64,
    row: i64,
    slot: i64,
    pen_at: i64,
    pen_count: i32,
    top_k: i32,
    mode: i32,
    top_n: i32,
    temperature: f32,
    top_p: f32,
    min_p_ln: f32,
    rep: f32,
    presence: f32,
    frequency: f32,
    bias_at: i32,
    bias_count: i32,
}

/// `PartStat` of `sample.cu`.
#[repr(C)]
struct PartStat {
    max: f32,
    arg: i32,
    bad: i32,
    finite: u32,
    all: u64,
    kept: u64,
}

/// `RowState` of `sample.cu`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RowState {
    max: f32,
    arg: i32,
    status: i32,
    finite: u32,
    bucket: u32,
    collected: u32,
    cut_key: u32,
    cut_id: u32,
    hist_total: u64,
    above: u64,
    offset: u64,
    part: i32,
    pad: i32,
    topk_key: u32,
    topk_id: u32,
}

/// `SelectState` of `sample.cu`.
#[repr(C)]
struct SelectState {
    before: u64,
    need: u64,
    prefix: u32,
    done: i32,
}

/// `LogprobEntry` of `sample.cu`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct LogprobEntry {
    id: u32,
    logprob: f32,
}

/// Where a prepared draw is finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    /// `sample_topk` (and the full pipeline's log-probabilities, when asked for).
    TopK,
    /// The full-vocabulary pipeline (which may still leave a top-p row to the host).
    Full,
}

fn route(p: &PreparedSample, vocab: usize) -> Route {
    let k = p.params.top_k;
    match p.uniform {
        Some(_) if (2..=PREPARED_TOP_K_MAX).contains(&k) && k < vocab => Route::TopK,
        _ => Route::Full,
    }
}

/// The top-k a kernel sees. `sample_topk` takes the host's. In the full pipeline, a drawing
/// row with a top-k is walked in the host's sorted order (`sel_*`), one without in id order;
/// `sampling.rs`'s `truncate` sorts exactly when there is a top-k below the vocabulary, or a
/// top-p over at most `SORT_BELOW` candidates, which every top-p row of a vocabulary that small
/// is: such a row gets the top-k that keeps everything, the vocabulary. (A top-p row of a larger
/// vocabulary with that few finite logits is flagged by the pipeline and left to the host.)
fn kernel_top_k(p: &SamplingParams, vocab: usize) -> i32 {
    let k = if p.top_k > 0 && p.top_k < vocab {
        p.top_k
    } else if p.top_p < 1.0 && vocab <= SORT_BELOW {
        vocab
    } else {
        0
    };
    k.min(i32::MAX as usize) as i32
}

/// Bits of fixed point for a row's probability mass: each token's weight is at most
/// 2^bits, and a whole row sums below 2^62.
fn mass_bits(vocab: usize) -> u32 {
    62 - (vocab.max(2) - 1).ilog2().min(60) - 1
}

pub(super) struct Kernels {
    argmax_partial: CudaFunction,
    argmax_finish: CudaFunction,
    draw_mask: CudaFunction,
    draw_adjust: CudaFunction,
    sample_topk: CudaFunction,
    full_max: CudaFunction,
    full_combine: CudaFunction,
    full_mass: CudaFunction,
    topp_find_bucket: CudaFunction,
    topp_collect: CudaFunction,
    topp_cut: CudaFunction,
    full_kept: CudaFunction,
    full_target: CudaFunction,
    full_pick: CudaFunction,
    sel_hist: CudaFunction,
    sel_find: CudaFunction,
    sel_ties: CudaFunction,
    sel_pick: CudaFunction,
    full_top: CudaFunction,
    full_logprobs: CudaFunction,
}

/// The prepared draws of a launch, how many of them the host finished, and how many the
/// device drew in sorted order (a top-k above [`PREPARED_TOP_K_MAX`]).
pub(super) struct Drawn {
    pub draws: Vec<Result<Draw, NonFiniteLogits>>,
    pub on_host: usize,
    pub sorted: usize,
}

impl Kernels {
    pub fn load(module: &std::sync::Arc<cudarc::driver::CudaModule>) -> Result<Kernels> {
        let f = |n: &str| {
            module.load_function(n).map_err(|e| super::device::cuda_error(format!("kernel {n}: {e}")))
        };
        Ok(Kernels {
            argmax_partial: f("argmax_partial")?,
            argmax_finish: f("argmax_finish")?,
            draw_mask: f("draw_mask")?,
            draw_adjust: f("draw_adjust")?,
            sample_topk: f("sample_topk")?,
            full_max: f("full_max")?,
            full_combine: f("full_combine")?,
            full_mass: f("full_mass")?,
            topp_find_bucket: f("topp_find_bucket")?,
            topp_collect: f("topp_collect")?,
            topp_cut: f("topp_cut")?,
            full_kept: f("full_kept")?,
            full_target: f("full_target")?,
            full_pick: f("full_pick")?,
            sel_hist: f("sel_hist")?,
            sel_find: f("sel_find")?,
            sel_ties: f("sel_ties")?,
            sel_pick: f("sel_pick")?,
            full_top: f("full_top")?,
            full_logprobs: f("full_logprobs")?,
        })
    }

    /// The greedy token of each `[cols]` row of `x` (`sampling::greedy`), only the indices
    /// crossing to the host.
    pub fn argmax_rows(
        &self,
        dev: &Device,
        x: &CudaBuf,
        rows: usize,
        cols: usize,
    ) -> Vec<Result<u32, NonFiniteLogits>> {
        assert!(x.len() >= rows * cols && cols <= i32::MAX as usize, "argmax_rows: x too short");
        if rows == 0 {
            return Vec::new();
        }
        let parts = cols.div_ceil(ARGMAX_SPAN).max(1);
        let part = dev.alloc(2 * rows * parts).unwrap_or_else(|e| panic!("{e}"));
        let idx = dev.alloc(rows).unwrap_or_else(|e| panic!("{e}"));
        dev.launch(
            "argmax_partial",
            &self.argmax_partial,
            (parts as u32, rows as u32, 1),
            (ARGMAX_THREADS, 1, 1),
            0,
            kernel_args![x.ptr(), part.ptr(), cols as i32, parts as i32],
        );
        dev.launch(
            "argmax_finish",
            &self.argmax_finish,
            (rows as u32, 1, 1),
            (128, 1, 1),
            0,
            kernel_args![part.ptr(), idx.ptr(), parts as i32],
        );
        let mut out = vec![0u32; rows];
        dev.copy_dtoh(&mut out, idx.ptr()).unwrap_or_else(|e| panic!("{e}"));
        out.into_iter().map(|t| if t == NO_TOKEN { Err(NonFiniteLogits) } else { Ok(t) }).collect()
    }

    /// The prepared draws of `picks` (each naming a row of `logits`, `[_, vocab]`): what
    /// `sampling::sample_prepared` makes of each row, on the device but for the rows the
    /// module documentation names. The rows' logits are modified in place.
    pub fn draw_rows(
        &self,
        dev: &Device,
        logits: &CudaBuf,
        vocab: usize,
        picks: &[(usize, &PreparedSample)],
    ) -> Drawn {
        assert!(vocab > 0 && vocab <= i32::MAX as usize, "draw_rows: vocabulary of {vocab}");
        for &(row, _) in picks {
            assert!((row + 1) * vocab <= logits.len(), "draw_rows: row {row} outside the logits");
        }
        let routes: Vec<Route> = picks.iter().map(|(_, p)| route(p, vocab)).collect();
        let row_of = |slot: usize, mode: i32| -> DrawRow {
            let (row, p) = picks[slot];
            let q = &p.params;
            let temperature =
                if mode == FULL_LOGPROBS_ONLY || q.temperature == 0.0 { 1.0 } else { q.temperature };
            DrawRow {
                uniform: p.uniform.unwrap_or(-1.0),
                row: row as i64,
                slot: slot as i64,
                pen_at: 0,
                pen_count: 0,
                top_k: kernel_top_k(q, vocab),
                mode,
                top_n: p.logprobs.map_or(-1, |n| n.min(TOP_N_MAX) as i32),
                temperature,
                top_p: q.top_p,
                min_p_ln: if q.min_p > 0.0 { q.min_p.ln() } else { f32::NEG_INFINITY },
                rep: q.repetition_penalty,
                presence: q.presence_penalty,
                frequency: q.frequency_penalty,
                bias_at: 0,
                bias_count: 0,
            }
        };

        let ids = dev.upload_u32(&vec![NO_TOKEN; picks.len().max(1)]).unwrap_or_else(|e| panic!("{e}")).0;

        // 0. Grammar masks, for the constrained rows: their packed words in one upload.
        let masked: Vec<(usize, &crate::constraint::TokenMask)> =
            picks.iter().filter_map(|&(row, p)| p.allowed.as_ref().map(|m| (row, m))).collect();
        if !masked.is_empty() {
            let words = vocab.div_ceil(32);
            let mut packed = vec![0u32; masked.len() * words];
            for (chunk, (_, mask)) in packed.chunks_mut(words).zip(&masked) {
                // A mask of another vocabulary size allows nothing past its own words.
                let n = mask.words().len().min(words);
                chunk[..n].copy_from_slice(&mask.words()[..n]);
            }
            let rows: Vec<u32> = masked.iter().map(|&(row, _)| row as u32).collect();
            let (_rows, rows_ptr) = dev.upload_u32(&rows).unwrap_or_else(|e| panic!("{e}"));
            let (_masks, masks_ptr) = dev.upload_u32(&packed).unwrap_or_else(|e| panic!("{e}"));
            dev.launch(
                "draw_mask",
                &self.draw_mask,
                (words.div_ceil(256) as u32, masked.len() as u32, 1),
                (256, 1, 1),
                0,
                kernel_args![logits.ptr(), vocab as i32, rows_ptr, masks_ptr, words as i32],
            );
        }

        // 1. Logit bias and penalties, for the rows that have either: only their (id, bias) and
        // (id, flags) pairs cross to the device.
        let mut adjusted = Vec::new();
        let (mut penalties, mut bias): (Vec<u32>, Vec<u32>) = (Vec::new(), Vec::new());
        for (slot, &(_, p)) in picks.iter().enumerate() {
            if p.penalties.is_empty() && p.params.logit_bias.is_empty() {
                continue;
            }
            let mut r = row_of(slot, FULL_DRAW);
            r.pen_at = (penalties.len() / 2) as i64;
            r.pen_count = p.penalties.len() as i32;
            penalties.extend(p.penalties.iter().flat_map(|&(t, f)| [t, f]));
            r.bias_at = (bias.len() / 2) as i32;
            r.bias_count = p.params.logit_bias.len() as i32;
            bias.extend(p.params.logit_bias.iter().flat_map(|&(t, b)| [t, b.to_bits()]));
            adjusted.push(r);
        }
        if !adjusted.is_empty() {
            let (_rows, rows_ptr) = dev.upload_words(&adjusted).unwrap_or_else(|e| panic!("{e}"));
            // An empty list still needs a valid pointer.
            penalties.extend([0, 0]);
            bias.extend([0, 0]);
            let (_pen, pen_ptr) = dev.upload_u32(&penalties).unwrap_or_else(|e| panic!("{e}"));
            let (_bias, bias_ptr) = dev.upload_u32(&bias).unwrap_or_else(|e| panic!("{e}"));
            dev.launch(
                "draw_adjust",
                &self.draw_adjust,
                (adjusted.len() as u32, 1, 1),
                (256, 1, 1),
                0,
                kernel_args![logits.ptr(), vocab as i32, rows_ptr, pen_ptr, bias_ptr],
            );
        }

        // 2. Top-k rows, one block each.
        let topk: Vec<DrawRow> =
            (0..picks.len()).filter(|&s| routes[s] == Route::TopK).map(|s| row_of(s, FULL_DRAW)).collect();
        if !topk.is_empty() {
            let (_rows, rows_ptr) = dev.upload_words(&topk).unwrap_or_else(|e| panic!("{e}"));
            dev.launch(
                "sample_topk",
                &self.sample_topk,
                (topk.len() as u32, 1, 1),
                (1024, 1, 1),
                0,
                kernel_args![logits.ptr(), vocab as i32, rows_ptr, ids.ptr()],
            );
        }

        // 3. The full pipeline: its own rows, and the top-k rows' log-probabilities.
        let full: Vec<DrawRow> = (0..picks.len())
            .filter_map(|s| {
                let p = picks[s].1;
                match routes[s] {
                    Route::Full if p.uniform.is_none() => Some(row_of(s, FULL_GREEDY)),
                    Route::Full => Some(row_of(s, FULL_DRAW)),
                    Route::TopK if p.logprobs.is_some() => Some(row_of(s, FULL_LOGPROBS_ONLY)),
                    _ => None,
                }
            })
            .collect();
        let any_logprobs = picks.iter().any(|(_, p)| p.logprobs.is_some());
        let lp = any_logprobs
            .then(|| dev.alloc(picks.len() * (1 + TOP_N_MAX) * 2).unwrap_or_else(|e| panic!("{e}")));
        let states = if full.is_empty() {
            Vec::new()
        } else {
            self.full(dev, logits, vocab, &full, &ids, lp.as_ref())
        };

        // Results; rows left to the host are drawn from their downloaded logits.
        let mut tokens = vec![0u32; picks.len()];
        if !picks.is_empty() {
            dev.copy_dtoh(&mut tokens, ids.ptr()).unwrap_or_else(|e| panic!("{e}"));
        }
        let mut entries =
            vec![LogprobEntry::default(); if any_logprobs { picks.len() * (1 + TOP_N_MAX) } else { 0 }];
        if let Some(lp) = &lp {
            dev.copy_dtoh(&mut entries, lp.ptr()).unwrap_or_else(|e| panic!("{e}"));
        }
        let mut on_host = vec![false; picks.len()];
        for (r, state) in full.iter().zip(&states) {
            on_host[r.slot as usize] |= state.status == FULL_HOST && r.mode == FULL_DRAW;
        }
        let mut draws = Vec::with_capacity(picks.len());
        let mut host_count = 0;
        for (slot, &(row, p)) in picks.iter().enumerate() {
            if on_host[slot] {
                host_count += 1;
                let mut values = vec![0f32; vocab];
                dev.download_f32(&mut values, logits.at(row * vocab)).unwrap_or_else(|e| panic!("{e}"));
                // The mask, bias and penalties applied on the device already stay applied.
                let mut host = p.clone();
                host.penalties.clear();
                host.params.logit_bias.clear();
                host.allowed = None;
                draws.push(sample_prepared(&mut values, &host));
                continue;
            }
            let token = tokens[slot];
            if token == NO_TOKEN {
                draws.push(Err(NonFiniteLogits));
                continue;
            }
            let logprobs = p.logprobs.map(|n| {
                let e = &entries[slot * (1 + TOP_N_MAX)..(slot + 1) * (1 + TOP_N_MAX)];
                // A vocabulary smaller than n has only that many alternatives, as on the host.
                let top = e[1..=n.min(TOP_N_MAX).min(vocab)].iter().map(|t| (t.id, t.logprob)).collect();
                TokenLogprobs { token, logprob: e[0].logprob, top }
            });
            draws.push(Ok(Draw { token, logprobs }));
        }
        let sorted = full.iter().filter(|r| r.mode == FULL_DRAW && r.top_k > 0).count();
        Drawn { draws, on_host: host_count, sorted }
    }

    /// The full-vocabulary pipeline over `rows`; returns each row's final state when a row may
    /// have been left to the host (a top-p row), else nothing.
    fn full(
        &self,
        dev: &Device,
        logits: &CudaBuf,
        vocab: usize,
        rows: &[DrawRow],
        ids: &CudaBuf,
        lp: Option<&CudaBuf>,
    ) -> Vec<RowState> {
        let n = rows.len();
        // Enough blocks to cover the GPU twice, at least a few hundred columns each.
        let parts =
            (2 * dev.sm_count as usize).div_ceil(n).clamp(1, MAX_PARTS).min(vocab.div_ceil(256)).max(1);
        let bits = mass_bits(vocab);
        let scale = (1u64 << bits) as f64;
        let log_scale = f64::from(bits) * std::f64::consts::LN_2;
        let words = |bytes: usize| bytes.div_ceil(4).max(1);
        let alloc = |bytes: usize| dev.alloc(words(bytes)).unwrap_or_else(|e| panic!("{e}"));
        let zeros = |bytes: usize| dev.zeros(words(bytes)).unwrap_or_else(|e| panic!("{e}"));
        // Drawing rows with a top-k (above `PREPARED_TOP_K_MAX`) are drawn by the radix selects
        // in sorted order; the others walk their kept tokens in id order.
        let sorted = |r: &DrawRow| r.mode == FULL_DRAW && r.top_k > 0;
        let any_sorted = rows.iter().any(sorted);
        let any_sorted_topp = rows.iter().any(|r| sorted(r) && r.top_p < 1.0);
        let walks_ids = |r: &DrawRow| r.mode == FULL_DRAW && !sorted(r);
        let any_topp = rows.iter().any(|r| walks_ids(r) && r.top_p < 1.0);
        let any_draw = rows.iter().any(walks_ids);
        let any_mass = rows.iter().any(|r| walks_ids(r) || r.top_n >= 0);
        let any_top = rows.iter().any(|r| r.top_n > 0);

        let (_rows, rows_ptr) = dev.upload_words(rows).unwrap_or_else(|e| panic!("{e}"));
        let stats = alloc(n * parts * std::mem::size_of::<PartStat>());
        let state = zeros(n * std::mem::size_of::<RowState>());
        let hist = if any_topp { zeros(n * TOPP_BUCKETS * 8) } else { alloc(8) };
        let list = if any_topp { alloc(n * TOPP_CAP * 4) } else { alloc(4) };
        let tops = if any_top { alloc(n * parts * TOP_N_MAX * 8) } else { alloc(8) };
        let grid = (parts as u32, n as u32, 1);
        let (l, v, p) = (logits.ptr(), vocab as i32, parts as i32);

        dev.launch(
            "full_max",
            &self.full_max,
            grid,
            (FULL_THREADS, 1, 1),
            0,
            kernel_args![l, v, rows_ptr, stats.ptr(), p],
        );
        dev.launch(
            "full_combine",
            &self.full_combine,
            (n as u32, 1, 1),
            (64, 1, 1),
            0,
            kernel_args![rows_ptr, stats.ptr(), state.ptr(), p, ids.ptr()],
        );
        if any_mass {
            dev.launch(
                "full_mass",
                &self.full_mass,
                grid,
                (FULL_THREADS, 1, 1),
                0,
                kernel_args![l, v, rows_ptr, state.ptr(), stats.ptr(), hist.ptr(), p, scale],
            );
        }
        if any_topp {
            dev.launch(
                "topp_find_bucket",
                &self.topp_find_bucket,
                (n as u32, 1, 1),
                (1024, 1, 1),
                0,
                kernel_args![rows_ptr, state.ptr(), hist.ptr()],
            );
            dev.launch(
                "topp_collect",
                &self.topp_collect,
                grid,
                (FULL_THREADS, 1, 1),
                0,
                kernel_args![l, v, rows_ptr, state.ptr(), list.ptr(), p],
            );
            dev.launch(
                "topp_cut",
                &self.topp_cut,
                (n as u32, 1, 1),
                (1024, 1, 1),
                0,
                kernel_args![l, v, rows_ptr, state.ptr(), list.ptr(), scale],
            );
            dev.launch(
                "full_kept",
                &self.full_kept,
                grid,
                (FULL_THREADS, 1, 1),
                0,
                kernel_args![l, v, rows_ptr, state.ptr(), stats.ptr(), p, scale],
            );
        }
        if any_sorted {
            let sel_hist = zeros(n * SEL_BUCKETS * 8);
            let sel = zeros(n * std::mem::size_of::<SelectState>());
            let ties = alloc(n * parts * 8);
            let stages: &[i32] =
                if any_sorted_topp { &[SEL_TOPK, SEL_TOPP, SEL_DRAW] } else { &[SEL_TOPK, SEL_DRAW] };
            for &stage in stages {
                for pass in 0..SEL_PASSES {
                    dev.launch(
                        "sel_hist",
                        &self.sel_hist,
                        grid,
                        (FULL_THREADS, 1, 1),
                        0,
                        kernel_args![
                            l,
                            v,
                            rows_ptr,
                            state.ptr(),
                            sel.ptr(),
                            sel_hist.ptr(),
                            p,
                            stage,
                            pass,
                            scale
                        ],
                    );
                    dev.launch(
                        "sel_find",
                        &self.sel_find,
                        (n as u32, 1, 1),
                        (SEL_BUCKETS as u32 / 2, 1, 1),
                        0,
                        kernel_args![rows_ptr, state.ptr(), sel.ptr(), sel_hist.ptr(), stage, pass],
                    );
                }
                dev.launch(
                    "sel_ties",
                    &self.sel_ties,
                    grid,
                    (FULL_THREADS, 1, 1),
                    0,
                    kernel_args![l, v, rows_ptr, state.ptr(), sel.ptr(), ties.ptr(), p, stage, scale],
                );
                dev.launch(
                    "sel_pick",
                    &self.sel_pick,
                    (n as u32, 1, 1),
                    (1024, 1, 1),
                    0,
                    kernel_args![
                        l,
                        v,
                        rows_ptr,
                        state.ptr(),
                        sel.ptr(),
                        ties.ptr(),
                        p,
                        stage,
                        scale,
                        ids.ptr()
                    ],
                );
            }
        }
        if any_draw {
            dev.launch(
                "full_target",
                &self.full_target,
                (n as u32, 1, 1),
                (32, 1, 1),
                0,
                kernel_args![rows_ptr, state.ptr(), stats.ptr(), p],
            );
            dev.launch(
                "full_pick",
                &self.full_pick,
                (n as u32, 1, 1),
                (1024, 1, 1),
                0,
                kernel_args![l, v, rows_ptr, state.ptr(), p, scale, ids.ptr()],
            );
        }
        if let Some(lp) = lp {
            if any_top {
                dev.launch(
                    "full_top",
                    &self.full_top,
                    grid,
                    (FULL_THREADS, 1, 1),
                    0,
                    kernel_args![l, v, rows_ptr, state.ptr(), tops.ptr(), p],
                );
            }
            dev.launch(
                "full_logprobs",
                &self.full_logprobs,
                (n as u32, 1, 1),
                (256, 1, 1),
                0,
                kernel_args![
                    l,
                    v,
                    rows_ptr,
                    state.ptr(),
                    stats.ptr(),
                    tops.ptr(),
                    p,
                    log_scale,
                    ids.ptr(),
                    lp.ptr()
                ],
            );
        }
        // Only a top-p row can be left to the host: without one, the states stay on the device
        // (one copy and wait fewer a step).
        if !any_topp {
            return Vec::new();
        }
        let mut states = vec![RowState::default(); n];
        dev.copy_dtoh(&mut states, state.ptr()).unwrap_or_else(|e| panic!("{e}"));
        states
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structs_match_the_kernels() {
        assert_eq!(std::mem::size_of::<DrawRow>(), 80);
        assert_eq!(std::mem::size_of::<PartStat>(), 32);
        assert_eq!(std::mem::size_of::<RowState>(), 72);
        assert_eq!(std::mem::size_of::<SelectState>(), 24);
        assert_eq!(std::mem::size_of::<LogprobEntry>(), 8);
    }

    /// Every top-k has a device route: 2..=1024 below the vocabulary to `sample_topk`, the rest
    /// to the full pipeline, which sees a top-k only when it is below the vocabulary.
    #[test]
    fn every_top_k_is_routed_to_the_device() {
        let draw = |top_k: usize, greedy: bool| {
            let params = crate::sampling::SamplingParams {
                temperature: if greedy { 0.0 } else { 1.0 },
                top_k,
                ..Default::default()
            };
            crate::sampling::Sampler::new(params).unwrap().prepare(&[], &[], None)
        };
        let vocab = 248_320;
        for (k, want) in [
            (0, Route::Full),
            (2, Route::TopK),
            (1024, Route::TopK),
            (1025, Route::Full),
            (vocab - 1, Route::Full),
            (vocab, Route::Full),
        ] {
            assert_eq!(route(&draw(k, false), vocab), want, "top-k {k}");
            assert_eq!(route(&draw(k, true), vocab), Route::Full, "greedy, top-k {k}");
        }
        assert_eq!(route(&draw(1, false), vocab), Route::Full, "top-k 1 is greedy");
        // A small vocabulary: a top-k of 2..=1024 not below it keeps everything.
        assert_eq!(route(&draw(300, false), 257), Route::Full);
        assert_eq!(route(&draw(256, false), 257), Route::TopK);
        // The full pipeline walks in sorted order exactly where the host sorts.
        let with = |top_k: usize, top_p: f32| SamplingParams { top_k, top_p, ..Default::default() };
        for (params, vocab, want) in [
            (with(0, 1.0), 10, 0),
            (with(9, 1.0), 10, 9),
            (with(10, 1.0), 10, 0),
            (with(11, 1.0), 10, 0),
            (with(1025, 0.5), 4097, 1025),
            (with(0, 0.5), 2048, 2048),
            (with(0, 0.5), 2049, 0),
            (with(5000, 0.5), 2048, 2048),
            (with(0, 0.5), 1, 1),
        ] {
            assert_eq!(kernel_top_k(&params, vocab), want, "{params:?} of {vocab}");
        }
    }

    #[test]
    fn a_rows_mass_fits_in_63_bits() {
        for vocab in [1usize, 2, 3, 1000, 4096, 4097, 248_320, 1 << 20] {
            let bits = mass_bits(vocab);
            let max = (vocab as u128) << bits;
            assert!(max <= 1u128 << 62, "vocab {vocab}: {bits} bits");
            assert!(bits >= 40 || vocab > 1 << 20, "vocab {vocab}: only {bits} bits");
        }
    }
}
