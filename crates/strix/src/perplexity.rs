//! Perplexity and KL divergence, as llama.cpp's `llama-perplexity` defines and prints them.
//!
//! **Perplexity.** The text's tokens are cut into `n_chunk = tokens / ctx` non-overlapping
//! windows of `ctx` tokens (a remainder shorter than a window is dropped, and at least two
//! windows are required). Each window is evaluated from a fresh state, and only its second
//! half is scored: the logits at positions `ctx/2 .. ctx-2` predict tokens `ctx/2+1 .. ctx-1`
//! (`ctx - 1 - ctx/2` predictions per window). Per prediction,
//! `nll = log Σ exp(l − max) + max − l[next]` (the max in f32, the sum of f32 `exp` in f64,
//! as llama.cpp does). `PPL = exp(mean nll)`, reported `± PPL · sqrt(var(nll) / (n − 1))`.
//! llama.cpp puts a BOS token first in each window when the vocabulary asks for one; the
//! Qwen3.5 vocabulary does not, and strix never adds one.
//!
//! **KL divergence.** A base run (bf16 weights) saves, for every scored position, its
//! log-probabilities in llama.cpp's `--kl-divergence-base` file format, byte for byte (so
//! either program can read the other's files):
//!
//! ```text
//! "_logits_"  u32 n_ctx  i32 n_vocab  i32 n_chunk  i32 tokens[n_ctx · n_chunk]
//! per window, per scored position (n_ctx − 1 − n_ctx/2 of them), nv = 2·⌈n_vocab/2⌉ + 4 u16:
//!     f32 scale, f32 min_log_prob, u16 q[n_vocab] (+ one pad u16 when n_vocab is odd)
//! ```
//!
//! where `log p_i ≈ scale · q_i + min_log_prob` over the 16 nats below the top logit
//! (`min_logit = max(min, max − 16)`, `scale = (max − min_logit) / 65535`), values below that
//! range stored as 0. A later run over the same tokens (quantized weights) then reports, per
//! llama.cpp: its PPL and the base's, `ln(PPL(Q)/PPL(base))` with its uncertainty from the
//! covariance, the mean KL divergence `Σ_i p_base,i (log p_base,i − log p_i)` (terms with
//! `log p_base < −16` left out) `± stddev / sqrt(n − 1)`, its percentiles, `Δp` of the correct
//! token, and the share of positions where both runs rank the same token first.

use std::io::{Read, Write};
use std::path::Path;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::model::{Logits, Model};

/// Windows of `ctx` tokens that `n_tokens` make, checked as llama.cpp checks them.
pub fn chunk_count(n_tokens: usize, ctx: usize) -> Result<usize> {
    if ctx < 4 {
        return Err(Error::input(format!("a perplexity context of {ctx} tokens is too short (at least 4)")));
    }
    if n_tokens < 2 * ctx {
        return Err(Error::input(format!(
            "perplexity with a context of {ctx} needs at least {} tokens; the text has {n_tokens}",
            2 * ctx
        )));
    }
    Ok(n_tokens / ctx)
}

/// Index of the first position whose logits are scored in a window of `ctx`.
pub fn first_scored(ctx: usize) -> usize {
    ctx / 2
}

/// Predictions scored per window of `ctx`.
pub fn scored_per_chunk(ctx: usize) -> usize {
    ctx - 1 - first_scored(ctx)
}

/// (max logit, index of the first max, log Σ exp(l − max)) with llama.cpp's precision.
fn softmax_stats(logits: &[f32]) -> (f32, usize, f64) {
    let mut max = logits[0];
    let mut imax = 0;
    for (i, &v) in logits.iter().enumerate().skip(1) {
        if v > max {
            max = v;
            imax = i;
        }
    }
    let sum: f64 = logits.iter().map(|&v| (v - max).exp() as f64).sum();
    (max, imax, sum.ln())
}

/// Sums of the negative log-likelihoods of the scored tokens.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PerplexityStats {
    pub nll: f64,
    pub nll2: f64,
    pub count: usize,
}

impl PerplexityStats {
    /// Scores one position: `logits` predicting `next`. Returns the position's nll.
    pub fn add(&mut self, logits: &[f32], next: u32) -> f64 {
        let (max, _, lse) = softmax_stats(logits);
        let v = -((logits[next as usize] - max) as f64 - lse);
        self.nll += v;
        self.nll2 += v * v;
        self.count += 1;
        v
    }

    pub fn ppl(&self) -> f64 {
        (self.nll / self.count as f64).exp()
    }

    /// llama.cpp's `± PPL · sqrt((E[nll²] − E[nll]²) / (n − 1))`; 0 where that is undefined.
    pub fn ppl_error(&self) -> f64 {
        let n = self.count as f64;
        let mean = self.nll / n;
        let var = self.nll2 / n - mean * mean;
        if var > 0.0 && self.count > 1 {
            (var / (n - 1.0)).sqrt() * self.ppl()
        } else {
            0.0
        }
    }
}

/// u16 words per position in a base file.
pub fn words_per_position(n_vocab: usize) -> usize {
    2 * n_vocab.div_ceil(2) + 4
}

/// GGML's round-to-nearest through the float mantissa (as llama.cpp's `nearest_int`).
fn nearest_int(fval: f32) -> i32 {
    let val = fval + 12_582_912.0;
    (val.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

/// Encodes one position's log-probabilities into `out` (`words_per_position(n_vocab)` words)
/// as llama.cpp does, and returns the nll of `next` (computed from the floats).
pub fn encode_log_probs(logits: &[f32], next: u32, out: &mut [u16]) -> f64 {
    let mut max = logits[0];
    let mut min = logits[0];
    for &v in &logits[1..] {
        max = max.max(v);
        min = min.min(v);
    }
    let min = min.max(max - 16.0);
    let sum: f64 = logits.iter().map(|&v| (v - max).exp() as f64).sum();
    let lse = sum.ln() as f32;
    let min_log_prob = min - max - lse;
    let scale = (max - min) / 65535.0;
    out[..2].copy_from_slice(&words(scale));
    out[2..4].copy_from_slice(&words(min_log_prob));
    let q = &mut out[4..4 + logits.len()];
    if scale != 0.0 {
        let inv = 1.0 / scale;
        for (q, &v) in q.iter_mut().zip(logits) {
            *q = if v > min { nearest_int(inv * (v - min)) as u16 } else { 0 };
        }
    } else {
        q.fill(0);
    }
    out[4 + logits.len()..].fill(0);
    (max + lse - logits[next as usize]) as f64
}

fn words(v: f32) -> [u16; 2] {
    let b = v.to_le_bytes();
    [u16::from_le_bytes([b[0], b[1]]), u16::from_le_bytes([b[2], b[3]])]
}

fn from_words(w: &[u16]) -> f32 {
    let (a, b) = (w[0].to_le_bytes(), w[1].to_le_bytes());
    f32::from_le_bytes([a[0], a[1], b[0], b[1]])
}

/// The sums llama.cpp's `kl_divergence` keeps, and every per-position KL and Δp for the
/// percentiles.
#[derive(Clone, Debug, Default)]
pub struct KlStats {
    pub sum_nll: f64,
    pub sum_nll2: f64,
    pub sum_nll_base: f64,
    pub sum_nll_base2: f64,
    pub sum_nll_nll_base: f64,
    pub sum_kld: f64,
    pub sum_kld2: f64,
    pub sum_p_diff: f64,
    pub sum_p_diff2: f64,
    pub sum_p_diff4: f64,
    pub max_p_diff: f32,
    pub same_top: usize,
    pub count: usize,
    pub kld_values: Vec<f32>,
    pub p_diff_values: Vec<f32>,
}

/// A mean and its uncertainty, llama.cpp's `mean_and_uncertainty`.
fn mean_and_uncertainty(sum: f64, sum2: f64, count: usize) -> (f64, f64) {
    if count < 1 {
        return (0.0, 0.0);
    }
    let n = count as f64;
    let f = sum / n;
    let df = sum2 / n - f * f;
    let df = if df > 0.0 && count > 10 { (df / (n - 1.0)).sqrt() } else { 0.0 };
    (f, df)
}

fn covariance(suma: f64, sumb: f64, sumab: f64, count: usize) -> f64 {
    if count < 10 {
        return 0.0;
    }
    let n = count as f64;
    (sumab / n - (suma / n) * (sumb / n)) / (n - 1.0)
}

/// The figures of a KL run.
#[derive(Clone, Debug, PartialEq)]
pub struct KlReport {
    pub count: usize,
    pub ppl: (f64, f64),
    pub ppl_base: (f64, f64),
    pub ln_ppl_ratio: (f64, f64),
    pub ppl_ratio: (f64, f64),
    pub kld: (f64, f64),
    pub kld_max: f64,
    pub kld_median: f64,
    pub kld_p99: f64,
    pub rms_p_diff: (f64, f64),
    /// Share (0..1) of positions whose top token is the base's.
    pub same_top: (f64, f64),
}

impl KlStats {
    /// Scores one position: this run's `logits` against the base's encoded log-probs.
    pub fn add(&mut self, logits: &[f32], base: &[u16], next: u32) {
        let (max, imax, lse) = softmax_stats(logits);
        let lse = lse as f32;
        let scale = from_words(&base[0..2]);
        let min_log_prob = from_words(&base[2..4]);
        let q = &base[4..4 + logits.len()];
        let nll = max + lse - logits[next as usize];
        self.sum_nll += nll as f64;
        self.sum_nll2 += (nll * nll) as f64;
        let nll_base = -(scale * q[next as usize] as f32 + min_log_prob);
        self.sum_nll_base += nll_base as f64;
        self.sum_nll_base2 += (nll_base * nll_base) as f64;
        self.sum_nll_nll_base += (nll * nll_base) as f64;

        let max_lse = max + lse;
        let mut sum = 0f64;
        let mut imax_base = 0;
        let mut p_log_base_max = 0f32;
        for (i, (&q, &l)) in q.iter().zip(logits).enumerate() {
            let p_log_base = scale * q as f32 + min_log_prob;
            if i == 0 || p_log_base > p_log_base_max {
                p_log_base_max = p_log_base;
                imax_base = i;
            }
            if p_log_base > -16.0 {
                let p_base = p_log_base.exp();
                sum += (p_base * (p_log_base - l + max_lse)) as f64;
            }
        }
        self.sum_kld += sum;
        self.sum_kld2 += sum * sum;
        self.count += 1;
        if imax == imax_base {
            self.same_top += 1;
        }
        let p_diff = (-nll).exp() - (-nll_base).exp();
        self.sum_p_diff += p_diff as f64;
        let p_diff2 = (p_diff * p_diff) as f64;
        self.sum_p_diff2 += p_diff2;
        self.sum_p_diff4 += p_diff2 * p_diff2;
        self.max_p_diff = self.max_p_diff.max(p_diff.abs());
        self.kld_values.push(sum as f32);
        self.p_diff_values.push(p_diff);
    }

    pub fn report(&self) -> KlReport {
        let log_ppl = mean_and_uncertainty(self.sum_nll, self.sum_nll2, self.count);
        let log_ppl_base = mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, self.count);
        let cov = covariance(self.sum_nll, self.sum_nll_base, self.sum_nll_nll_base, self.count);
        let ppl = log_ppl.0.exp();
        let ppl_base = log_ppl_base.0.exp();
        let ratio = log_ppl.0 - log_ppl_base.0;
        let ratio_unc = (log_ppl.1 * log_ppl.1 + log_ppl_base.1 * log_ppl_base.1 - 2.0 * cov).max(0.0).sqrt();
        let kld = mean_and_uncertainty(self.sum_kld, self.sum_kld2, self.count);
        let mse = mean_and_uncertainty(self.sum_p_diff2, self.sum_p_diff4, self.count);
        let rms = mse.0.sqrt();
        let n = self.count as f64;
        let top = self.same_top as f64 / n;
        let top_unc = if self.count > 1 { (top * (1.0 - top) / (n - 1.0)).sqrt() } else { 0.0 };
        let mut sorted = self.kld_values.clone();
        sorted.sort_by(f32::total_cmp);
        KlReport {
            count: self.count,
            ppl: (ppl, ppl * log_ppl.1),
            ppl_base: (ppl_base, ppl_base * log_ppl_base.1),
            ln_ppl_ratio: (ratio, ratio_unc),
            ppl_ratio: (ratio.exp(), ratio.exp() * ratio_unc),
            kld,
            kld_max: sorted.last().copied().unwrap_or(0.0) as f64,
            kld_median: median(&sorted),
            kld_p99: percentile(&sorted, 0.99),
            rms_p_diff: (rms, if rms > 0.0 { 0.5 / rms * mse.1 } else { 0.0 }),
            same_top: (top, top_unc),
        }
    }
}

fn median(sorted: &[f32]) -> f64 {
    let n = sorted.len();
    match n {
        0 => 0.0,
        _ if n.is_multiple_of(2) => 0.5 * (sorted[n / 2] as f64 + sorted[n / 2 - 1] as f64),
        _ => sorted[n / 2] as f64,
    }
}

/// llama.cpp's linear-interpolation percentile of sorted values.
pub fn percentile(sorted: &[f32], fraction: f32) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    if fraction <= 0.0 {
        return sorted[0] as f64;
    }
    if fraction >= 1.0 {
        return sorted[sorted.len() - 1] as f64;
    }
    let p = fraction * (sorted.len() - 1) as f32;
    let ip = p as usize;
    let p = p - ip as f32;
    ((1.0 - p) * sorted[ip] + p * sorted[(ip + 1).min(sorted.len() - 1)]) as f64
}

/// A base file: its header, the evaluation tokens, and the encoded log-probs.
pub struct BaseLogProbs {
    pub n_ctx: usize,
    pub n_vocab: usize,
    pub n_chunk: usize,
    pub tokens: Vec<u32>,
    /// `n_chunk · scored_per_chunk(n_ctx)` positions of `words_per_position(n_vocab)` words.
    pub log_probs: Vec<u16>,
}

impl BaseLogProbs {
    pub fn read(path: &Path) -> Result<BaseLogProbs> {
        let err = |m: String| Error::input(format!("{}: {m}", path.display()));
        let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let mut header = [0u8; 20];
        f.read_exact(&mut header).map_err(|_| err("too short for a log-probabilities header".into()))?;
        if &header[..8] != b"_logits_" {
            return Err(err("not a log-probabilities file (no `_logits_` magic)".into()));
        }
        let n_ctx = u32::from_le_bytes(header[8..12].try_into().unwrap()) as usize;
        let n_vocab = i32::from_le_bytes(header[12..16].try_into().unwrap());
        let n_chunk = i32::from_le_bytes(header[16..20].try_into().unwrap());
        if n_ctx < 4 || n_vocab <= 0 || n_chunk <= 0 {
            return Err(err(format!("bad header: n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk}")));
        }
        let (n_vocab, n_chunk) = (n_vocab as usize, n_chunk as usize);
        let n_tokens = n_ctx.checked_mul(n_chunk).ok_or_else(|| err("header sizes overflow".into()))?;
        let n_words = n_chunk
            .checked_mul(scored_per_chunk(n_ctx))
            .and_then(|p| p.checked_mul(words_per_position(n_vocab)))
            .ok_or_else(|| err("header sizes overflow".into()))?;
        let want = 20 + 4 * n_tokens as u64 + 2 * n_words as u64;
        let have = f.metadata().map_err(|e| Error::io(path, e))?.len();
        if have != want {
            return Err(err(format!(
                "{have} bytes, but n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk} make {want}"
            )));
        }
        let mut bytes = vec![0u8; 4 * n_tokens];
        f.read_exact(&mut bytes).map_err(|e| Error::io(path, e))?;
        let tokens: Vec<u32> =
            bytes.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32).collect();
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(err(format!("token {bad} is outside the file's vocabulary of {n_vocab}")));
        }
        let mut bytes = vec![0u8; 2 * n_words];
        f.read_exact(&mut bytes).map_err(|e| Error::io(path, e))?;
        let log_probs = bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        Ok(BaseLogProbs { n_ctx, n_vocab, n_chunk, tokens, log_probs })
    }

    /// The encoded log-probs of scored position `i` (over all windows, in order).
    pub fn position(&self, i: usize) -> &[u16] {
        let nv = words_per_position(self.n_vocab);
        &self.log_probs[i * nv..(i + 1) * nv]
    }
}

/// Writes a base file as the windows are evaluated.
pub struct BaseWriter<W: Write> {
    out: W,
    n_vocab: usize,
    buf: Vec<u16>,
}

impl<W: Write> BaseWriter<W> {
    /// Writes the header and the tokens of the `n_chunk` windows.
    pub fn new(
        mut out: W,
        n_ctx: usize,
        n_vocab: usize,
        n_chunk: usize,
        tokens: &[u32],
    ) -> std::io::Result<Self> {
        out.write_all(b"_logits_")?;
        out.write_all(&(n_ctx as u32).to_le_bytes())?;
        out.write_all(&(n_vocab as i32).to_le_bytes())?;
        out.write_all(&(n_chunk as i32).to_le_bytes())?;
        for &t in &tokens[..n_ctx * n_chunk] {
            out.write_all(&(t as i32).to_le_bytes())?;
        }
        Ok(BaseWriter { out, n_vocab, buf: vec![0; words_per_position(n_vocab)] })
    }

    /// Encodes and writes one scored position; returns its nll.
    pub fn push(&mut self, logits: &[f32], next: u32) -> std::io::Result<f64> {
        let nll = encode_log_probs(logits, next, &mut self.buf);
        let bytes: Vec<u8> = self.buf.iter().flat_map(|w| w.to_le_bytes()).collect();
        self.out.write_all(&bytes)?;
        Ok(nll)
    }

    pub fn finish(mut self) -> std::io::Result<W> {
        self.out.flush()?;
        Ok(self.out)
    }

    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }
}

/// Logits of the scored half of window `w` (`ctx - ctx/2` rows of `vocab`), evaluated from a
/// fresh session. The unscored first half is fed in passes of `batch` tokens without
/// computing its logits.
pub fn window_logits<B: Backend>(model: &Model<B>, window: &[u32], batch: usize) -> Result<Vec<f32>> {
    let ctx = window.len();
    let first = first_scored(ctx);
    let batch = batch.max(1);
    let mut session = model.try_new_session(ctx)?;
    for piece in window[..first].chunks(batch) {
        model.forward(&mut session, piece, Logits::Last)?;
    }
    let mut logits = Vec::with_capacity((ctx - first) * model.config.vocab_size);
    for piece in window[first..].chunks(batch) {
        logits.extend(model.forward(&mut session, piece, Logits::All)?);
    }
    Ok(logits)
}

/// Perplexity of `tokens` in windows of `ctx`. `on_chunk(i, stats)` runs after each window
/// (for llama.cpp's running `[i]ppl,` line). With `save`, every scored position is also
/// written to a base file.
pub fn perplexity<B: Backend, W: Write>(
    model: &Model<B>,
    tokens: &[u32],
    ctx: usize,
    batch: usize,
    mut save: Option<&mut BaseWriter<W>>,
    mut on_chunk: impl FnMut(usize, &PerplexityStats),
) -> Result<PerplexityStats> {
    let n_chunk = chunk_count(tokens.len(), ctx)?;
    let vocab = model.config.vocab_size;
    let mut stats = PerplexityStats::default();
    for i in 0..n_chunk {
        let window = &tokens[i * ctx..(i + 1) * ctx];
        let logits = window_logits(model, window, batch)?;
        let first = first_scored(ctx);
        for j in 0..scored_per_chunk(ctx) {
            let row = &logits[j * vocab..(j + 1) * vocab];
            let next = window[first + j + 1];
            stats.add(row, next);
            if let Some(w) = save.as_deref_mut() {
                w.push(row, next).map_err(|e| Error::input(format!("writing the base log-probs: {e}")))?;
            }
        }
        on_chunk(i, &stats);
    }
    Ok(stats)
}

/// KL divergence of `model` against a base file, over the base's own tokens and windows.
pub fn kl_divergence<B: Backend>(
    model: &Model<B>,
    base: &BaseLogProbs,
    batch: usize,
    mut on_chunk: impl FnMut(usize, &KlStats),
) -> Result<KlStats> {
    let vocab = model.config.vocab_size;
    if base.n_vocab != vocab {
        return Err(Error::input(format!(
            "the base log-probs are over a vocabulary of {}, the model's is {vocab}",
            base.n_vocab
        )));
    }
    let ctx = base.n_ctx;
    let per = scored_per_chunk(ctx);
    let mut stats = KlStats::default();
    for i in 0..base.n_chunk {
        let window = &base.tokens[i * ctx..(i + 1) * ctx];
        let logits = window_logits(model, window, batch)?;
        let first = first_scored(ctx);
        for j in 0..per {
            stats.add(&logits[j * vocab..(j + 1) * vocab], base.position(i * per + j), window[first + j + 1]);
        }
        on_chunk(i, &stats);
    }
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_logits_have_perplexity_vocab() {
        for vocab in [2usize, 7, 384, 248_320] {
            let mut s = PerplexityStats::default();
            for t in 0..5 {
                s.add(&vec![0.25; vocab], (t * 13 % vocab) as u32);
            }
            assert!((s.ppl() / vocab as f64 - 1.0).abs() < 1e-12, "vocab {vocab}: {}", s.ppl());
            // The variance is zero up to the rounding of Σ nll².
            assert!(s.ppl_error() < 1e-6 * s.ppl(), "{}", s.ppl_error());
        }
    }

    /// Logits (0, ln 2, ln 5): p = (1/8, 2/8, 5/8). Tokens 2, 1, 0 give nll ln(8/5), ln 4,
    /// ln 8; PPL = (8/5 · 4 · 8)^(1/3) and the error by the formula by hand.
    #[test]
    fn hand_computed_case() {
        let logits = [0.0f32, 2f32.ln(), 5f32.ln()];
        let mut s = PerplexityStats::default();
        for t in [2, 1, 0] {
            s.add(&logits, t);
        }
        let nll = [(8.0f64 / 5.0).ln(), 4f64.ln(), 8f64.ln()];
        let ppl = (8.0f64 / 5.0 * 4.0 * 8.0).powf(1.0 / 3.0);
        assert!((s.ppl() - ppl).abs() < 1e-6 * ppl, "{} vs {ppl}", s.ppl());
        let mean = nll.iter().sum::<f64>() / 3.0;
        let var = nll.iter().map(|v| v * v).sum::<f64>() / 3.0 - mean * mean;
        let err = (var / 2.0).sqrt() * ppl;
        assert!((s.ppl_error() - err).abs() < 1e-5 * err, "{} vs {err}", s.ppl_error());
    }

    #[test]
    fn chunking_follows_llama_cpp() {
        assert_eq!(chunk_count(1024, 512).unwrap(), 2);
        assert_eq!(chunk_count(1535, 512).unwrap(), 2);
        assert!(chunk_count(1023, 512).unwrap_err().to_string().contains("1024"));
        assert_eq!((first_scored(512), scored_per_chunk(512)), (256, 255));
        assert_eq!((first_scored(7), scored_per_chunk(7)), (3, 3));
    }

    fn random_logits(seed: u64, n: usize, spread: f32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * spread
            })
            .collect()
    }

    /// A run against its own base: KL ~ 0 (the u16 encoding's rounding only), top-1 100 %,
    /// PPL ratio 1. The logits span 12 nats, inside the 16 the encoding keeps (beyond them
    /// llama.cpp's format clamps, and a target token down there would count as more likely).
    #[test]
    fn kl_of_a_run_against_itself() {
        let vocab = 1001;
        let mut kl = KlStats::default();
        let mut buf = vec![0u16; words_per_position(vocab)];
        for i in 0..200u64 {
            let logits = random_logits(i, vocab, 12.0);
            let next = (i * 37 % vocab as u64) as u32;
            encode_log_probs(&logits, next, &mut buf);
            kl.add(&logits, &buf, next);
        }
        let r = kl.report();
        assert_eq!(r.count, 200);
        assert_eq!(r.same_top.0, 1.0);
        assert!(r.kld.0.abs() < 1e-6, "{:?}", r.kld);
        assert!(r.ln_ppl_ratio.0.abs() < 1e-4, "{:?}", r.ln_ppl_ratio);
        assert!((r.ppl.0 / r.ppl_base.0 - 1.0).abs() < 1e-4);
    }

    /// KL against a different distribution matches the direct f64 sum, and top-1 counts
    /// disagreements.
    #[test]
    fn kl_matches_direct_computation() {
        let vocab = 300;
        let mut kl = KlStats::default();
        let mut buf = vec![0u16; words_per_position(vocab)];
        let mut want = 0f64;
        let mut agree = 0;
        let n = 50;
        for i in 0..n as u64 {
            let base = random_logits(1000 + i, vocab, 8.0);
            let noise = random_logits(2000 + i, vocab, 1.0);
            let q: Vec<f32> = base.iter().zip(&noise).map(|(b, n)| b + n).collect();
            encode_log_probs(&base, 0, &mut buf);
            kl.add(&q, &buf, 0);
            let lp = |l: &[f32]| {
                let m = l.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
                let s: f64 = l.iter().map(|&v| (v as f64 - m).exp()).sum();
                l.iter().map(|&v| v as f64 - m - s.ln()).collect::<Vec<f64>>()
            };
            let (pb, pq) = (lp(&base), lp(&q));
            want += pb.iter().zip(&pq).map(|(b, q)| b.exp() * (b - q)).sum::<f64>();
            let top = |l: &[f32]| l.iter().enumerate().fold(0, |m, (i, &v)| if v > l[m] { i } else { m });
            agree += (top(&base) == top(&q)) as usize;
        }
        let r = kl.report();
        let want = want / n as f64;
        assert!(want > 1e-3, "the test distributions should differ");
        assert!((r.kld.0 - want).abs() < 1e-3 * want + 1e-6, "{} vs {want}", r.kld.0);
        assert_eq!(kl.same_top, agree);
        assert!(agree < n, "noise should move some top tokens");
    }

    #[test]
    fn base_files_round_trip_and_bad_ones_are_named() {
        let dir = std::env::temp_dir().join(format!("strix-ppl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("base.bin");
        let (ctx, vocab, n_chunk) = (8, 5, 2);
        let tokens: Vec<u32> = (0..16).map(|i| i % 5).collect();
        let mut w =
            BaseWriter::new(std::fs::File::create(&path).unwrap(), ctx, vocab, n_chunk, &tokens).unwrap();
        for i in 0..n_chunk * scored_per_chunk(ctx) {
            w.push(&random_logits(i as u64, vocab, 4.0), 1).unwrap();
        }
        w.finish().unwrap();
        let b = BaseLogProbs::read(&path).unwrap();
        assert_eq!((b.n_ctx, b.n_vocab, b.n_chunk), (ctx, vocab, n_chunk));
        assert_eq!(b.tokens, tokens);
        let mut want = vec![0u16; words_per_position(vocab)];
        encode_log_probs(&random_logits(2, vocab, 4.0), 1, &mut want);
        assert_eq!(b.position(2), &want[..]);
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 2]).unwrap();
        let e = BaseLogProbs::read(&path).err().unwrap().to_string();
        assert!(e.contains("base.bin") && e.contains("bytes"), "{e}");
        std::fs::write(&path, b"nonsense-and-more-bytes").unwrap();
        let e = BaseLogProbs::read(&path).err().unwrap().to_string();
        assert!(e.contains("_logits_"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
