// Picking tokens from rows of logits next to them (launchers: sample.rs), so that only token
// ids and the few log-probabilities asked for cross to the host: the greedy argmax, prepared
// draws (sampling.rs's sample_prepared, the host's algorithm step for step) and the
// log-probabilities reported beside them. A row that holds NaN or +inf, or nothing above
// -inf, gives NO_TOKEN (sampling.rs's NonFiniteLogits): no token can be drawn from it.

#define NO_TOKEN 0xffffffffu
#define POS_INF __int_as_float(0x7f800000)
#define PENALTY_REPEATED 0x80000000u

typedef unsigned long long u64;

// A logit no token can be drawn beside (sampling.rs's `usable`).
__device__ __forceinline__ bool bad_logit(float v) { return v != v || v == POS_INF; }

// The better of two (value, index) candidates as the host's greedy pick sees it: the higher
// value, ties to the lower index (NaN never wins: it compares false).
__device__ __forceinline__ void argmax_take(float& bv, int& bi, float ov, int oi) {
    if (ov > bv || (ov == bv && oi < bi)) {
        bv = ov;
        bi = oi;
    }
}

// The block's best (value, index), returned to every thread. `sv`, `si`: 32 slots of shared
// memory each.
__device__ __forceinline__ void block_argmax(float& bv, int& bi, float* sv, int* si) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_take(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    const int nw = (blockDim.x + 31) >> 5;
    bv = lane < nw ? sv[lane] : NEG_INF;
    bi = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_take(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
}

// Sum over the block, returned to every thread; `scratch` 32 slots of shared memory.
__device__ __forceinline__ u64 block_sum_u64(u64 v, u64* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int nw = (blockDim.x + 31) >> 5;
    u64 t = lane < nw ? scratch[lane] : 0ull;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}

// Exclusive prefix sum of v over the block (blockDim.x a multiple of 32); `scratch` 32 slots.
// Also returns the block's total in `total`.
template <typename T>
__device__ __forceinline__ T block_exclusive_scan(T v, T* scratch, T& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    T inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += n;
    }
    __syncthreads();
    if (lane == 31) scratch[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        T w = lane < nw ? scratch[lane] : (T)0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const T n = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += n;
        }
        if (lane < nw) scratch[lane] = w;
    }
    __syncthreads();
    total = scratch[(blockDim.x >> 5) - 1];
    return (warp ? scratch[warp - 1] : (T)0) + inc - v;
}

// Larger value, larger key (for non-NaN floats; -0 sorts below +0, so callers add +0 first,
// which turns -0 into +0 and changes nothing else: the host compares them equal).
__device__ __forceinline__ u32 order_key(float v) {
    const u32 u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Sorts key[0..n), id[0..n) (n a power of two, every thread of the block joining) best first:
// the larger key, ties to the smaller id, the host's candidate order. Padding meant to sort
// last needs the smallest key and the largest id. Starts and ends with a barrier.
template <typename K>
__device__ __forceinline__ void bitonic_sort_desc(K* key, u32* id, int n) {
    for (int size = 2; size <= n; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            __syncthreads();
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const int j = i ^ stride;
                if (j > i) {
                    const bool j_first = key[j] > key[i] || (key[j] == key[i] && id[j] < id[i]);
                    const bool ascending = (i & size) == 0;
                    if (j_first == ascending) {
                        const K tk = key[i];
                        const u32 ti = id[i];
                        key[i] = key[j];
                        id[i] = id[j];
                        key[j] = tk;
                        id[j] = ti;
                    }
                }
            }
        }
    }
    __syncthreads();
}

// ---------------------------------------------------------------------------------------------
// Greedy: the row-wise argmax of x: [rows, cols] into idx[rows], as sampling.rs's `greedy`:
// ties go to the lowest column, and a row that holds NaN or +inf, or nothing above -inf, gives
// NO_TOKEN. A vocabulary row (~250k logits) is too long for one block: a block walking it one
// dependent load at a time took 93 µs (ncu, H200), 4 % of a quantized 9B decode step. So two
// stages: each block of argmax_partial takes ARGMAX_SPAN columns with all its loads in flight
// at once, and argmax_finish picks the row's best of those. The pick is exact (comparisons
// only), so the split never changes the answer.
#define ARGMAX_THREADS 256
#define ARGMAX_UNROLL 8
#define ARGMAX_SPAN (ARGMAX_THREADS * ARGMAX_UNROLL)
// Marks a part that saw NaN or +inf, in place of its index.
#define ARGMAX_BAD -1
// Block (p, row): the best (value, index) of columns [p * ARGMAX_SPAN, (p + 1) * ARGMAX_SPAN)
// into part[2 * (row * parts + p)] and the next float (the index's bits, or ARGMAX_BAD);
// nothing better than -inf leaves (-inf, INT_MAX). grid (parts, rows), block ARGMAX_THREADS.
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS) argmax_partial(const float* x, float* part, int cols,
                                                                           int parts) {
    pdl_enter();
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* xr = x + (i64)blockIdx.y * cols;
    const int c0 = blockIdx.x * ARGMAX_SPAN + threadIdx.x;
    float v[ARGMAX_UNROLL];
#pragma unroll
    for (int k = 0; k < ARGMAX_UNROLL; k++) {
        const int c = c0 + k * ARGMAX_THREADS;
        v[k] = c < cols ? xr[c] : NEG_INF;
    }
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    bool bad = false;
#pragma unroll
    for (int k = 0; k < ARGMAX_UNROLL; k++) {
        bad |= bad_logit(v[k]);
        if (v[k] > bv) {  // false for NaN; columns rise, so a tie keeps the lower one
            bv = v[k];
            bi = c0 + k * ARGMAX_THREADS;
        }
    }
    bad = __syncthreads_or(bad);
    block_argmax(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        float* out = part + 2 * ((i64)blockIdx.y * parts + blockIdx.x);
        out[0] = bv;
        out[1] = __int_as_float(bad ? ARGMAX_BAD : bi);
    }
}
// Row `blockIdx.x`: the best of its `parts` partial picks. grid rows, block 128.
extern "C" __global__ void __launch_bounds__(128) argmax_finish(const float* part, u32* idx, int parts) {
    pdl_enter();
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* pr = part + 2 * (i64)blockIdx.x * parts;
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    bool bad = false;
    for (int p = threadIdx.x; p < parts; p += blockDim.x) {
        const int i = __float_as_int(pr[2 * p + 1]);
        bad |= i == ARGMAX_BAD;
        argmax_take(bv, bi, pr[2 * p], i);
    }
    bad = __syncthreads_or(bad);
    block_argmax(bv, bi, sv, si);
    if (threadIdx.x == 0) idx[blockIdx.x] = !bad && bv > NEG_INF ? (u32)bi : NO_TOKEN;
}

// ---------------------------------------------------------------------------------------------
// Prepared draws. Every row the device takes is described by a DrawRow (DrawRow in sample.rs).
// The launcher runs, on the stream:
//  0. draw_mask: a constrained row's grammar mask (constraint.rs), the tokens it does not allow
//     set to -inf before anything else, only for rows that have one;
//  1. draw_adjust: each listed token's logit bias, then its penalties (separate roundings: no
//     FMA, as the host), only for rows that have either;
//  2. sample_topk: rows with a top-k of 2..SAMPLE_MAX_K below the vocabulary, one block each,
//     the host's candidates and order exactly (their logits are left normalised in place);
//  3. the full-vocabulary pipeline (full_*, sel_*), several blocks a row: greedy rows, rows
//     with no top-k, rows with a top-k above SAMPLE_MAX_K, and the log-probabilities of every
//     row that asked for them.
struct DrawRow {
    double uniform;  // the draw's uniform in [0, 1); < 0: greedy
    i64 row;         // the logits row
    i64 slot;        // where the token goes in `out` (and the log-probabilities in `lp`)
    i64 pen_at;      // first (token, flags) pair of this row in `penalties`
    int pen_count;
    int top_k;       // sample_topk: k; full pipeline: > 0 draws in sorted order (kernel_top_k, sample.rs)
    int mode;        // full pipeline: FULL_GREEDY, FULL_DRAW or FULL_LOGPROBS_ONLY
    int top_n;       // log-probabilities: alternatives to report; -1: none
    float temperature;  // 1 for greedy rows and for rows sample_topk normalised already
    float top_p, min_p_ln, rep, presence, frequency;
    int bias_at;     // first (token, bias bits) pair of this row in `bias`
    int bias_count;
};

// The grammar masks of constrained rows: masked row `blockIdx.y` is logits row
// `mask_rows[blockIdx.y]`, its mask the `words` packed words at `masks + blockIdx.y * words`
// (bit c % 32 of word c / 32 allows token c; tokens past the mask's words are not allowed); every
// token it does not allow gets -inf (sampling.rs's apply_mask). Each thread takes one word of
// 32 columns, so a mask word is read once. grid (ceil(ceil(vocab / 32) / 256), masked rows),
// block 256.
extern "C" __global__ void __launch_bounds__(256) draw_mask(float* logits, int vocab, const u32* mask_rows,
                                                            const u32* masks, int words) {
    pdl_enter();
    const int w = blockIdx.x * blockDim.x + threadIdx.x;
    const int first = w * 32;
    if (first >= vocab) return;
    const u32 bits = w < words ? masks[(i64)blockIdx.y * words + w] : 0u;
    if (bits == 0xffffffffu) return;
    float* l = logits + (i64)mask_rows[blockIdx.y] * vocab;
    const int last = min(first + 32, vocab);
    for (int c = first; c < last; ++c) {
        if (!((bits >> (c - first)) & 1u)) l[c] = NEG_INF;
    }
}

// Block `blockIdx.x`: the logit bias, then the penalties, of rows[blockIdx.x], in place (the
// host's order: sampling.rs's sample_prepared). Each list names a token at most once
// (Sampler::prepare and SamplingParams::validate see to it), so its threads never meet; a
// token in both lists gets its bias before its penalty. grid rows, block 256.
extern "C" __global__ void __launch_bounds__(256) draw_adjust(float* logits, int vocab, const DrawRow* rows,
                                                             const u32* penalties, const u32* bias) {
    pdl_enter();
    const DrawRow r = rows[blockIdx.x];
    float* l = logits + r.row * vocab;
    for (int e = threadIdx.x; e < r.bias_count; e += blockDim.x) {
        const u32 t = bias[2 * (r.bias_at + e)];
        if (t < (u32)vocab) l[t] = __fadd_rn(l[t], __uint_as_float(bias[2 * (r.bias_at + e) + 1]));
    }
    if (r.bias_count > 0 && r.pen_count > 0) __syncthreads();
    for (int e = threadIdx.x; e < r.pen_count; e += blockDim.x) {
        const u32 t = penalties[2 * (r.pen_at + e)], flags = penalties[2 * (r.pen_at + e) + 1];
        if (t < (u32)vocab) {
            float v = l[t];
            if (flags & PENALTY_REPEATED) v = v > 0.f ? __fdiv_rn(v, r.rep) : __fmul_rn(v, r.rep);
            const u32 count = flags & ~PENALTY_REPEATED;
            if (count > 0) v = __fsub_rn(v, __fadd_rn(__fmul_rn(r.frequency, (float)count), r.presence));
            l[t] = v;
        }
    }
}

// sample_topk: sampling.rs's sample_prepared for rows with a top-k of 2..SAMPLE_MAX_K below the
// vocabulary (penalties applied already), one block of SAMPLE_THREADS threads per row:
//  1. the max (a row holding NaN or +inf, or nothing above -inf, gives NO_TOKEN);
//  2. normalise (l - max) / temperature, in place;
//  3. top-k: a radix select (4 passes of 8 bits) finds the k-th best key, then the better
//     tokens are gathered and the tied ones taken in id order, and the k are bitonic-sorted by
//     (value descending, id ascending), the host's order;
//  4. trailing -inf dropped, top-p over the sorted candidates (f64 running sum), min-p, and the
//     draw walking them in that order (f64 sums of f32 exp weights).
// Host and device may differ in the last bit of exp: a uniform within that of a boundary
// between two tokens is the only way they can disagree.
#define SAMPLE_THREADS 1024
#define SAMPLE_MAX_K 1024

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_topk(float* logits, int vocab,
                                                                         const DrawRow* rows, u32* out) {
    pdl_enter();
    __shared__ u32 hist[256];
    __shared__ u32 ckey[SAMPLE_MAX_K];
    __shared__ u32 cid[SAMPLE_MAX_K];
    __shared__ float cval[SAMPLE_MAX_K];
    __shared__ double cw[SAMPLE_MAX_K];
    __shared__ u32 scan[32];
    __shared__ float bv_s[32];
    __shared__ int bi_s[32];
    __shared__ u32 s_prefix, s_remaining, s_count;
    const DrawRow r = rows[blockIdx.x];
    float* l = logits + r.row * vocab;
    const int tid = threadIdx.x;

    // The max, which normalising subtracts; a row no token can be drawn from stops here.
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    bool bad = false;
    for (int c = tid; c < vocab; c += blockDim.x) {
        const float v = l[c];
        bad |= bad_logit(v);
        if (v > bv) {
            bv = v;
            bi = c;
        }
    }
    bad = __syncthreads_or(bad);
    block_argmax(bv, bi, bv_s, bi_s);
    if (bad || !(bv > NEG_INF)) {
        if (tid == 0) out[r.slot] = NO_TOKEN;
        return;
    }
    const float mx = bv;
    const float temperature = r.temperature;
    // sampling.rs's normalise, one value at a time (the row holds no NaN and no +inf).
    auto norm = [mx, temperature](float v) -> float { return __fdiv_rn(__fsub_rn(v, mx), temperature); };

    // Normalised once, in place (the passes below read each value several times).
    for (int c = tid; c < vocab; c += blockDim.x) l[c] = norm(l[c]);
    __syncthreads();

    // Top-k: the k-th best key, 8 bits at a time from the top.
    const int k = r.top_k;
    u32 prefix = 0, remaining = (u32)k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const u32 high = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
        for (int c = tid; c < vocab; c += blockDim.x) {
            const u32 key = order_key(l[c]);
            if ((key & high) == (prefix & high)) atomicAdd(&hist[(key >> shift) & 0xffu], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            u32 above = 0;
            int b = 255;
            for (; b > 0; b--) {
                if (above + hist[b] >= remaining) break;
                above += hist[b];
            }
            s_prefix = prefix | ((u32)b << shift);
            s_remaining = remaining - above;
            s_count = 0;
        }
        __syncthreads();
        prefix = s_prefix;
        remaining = s_remaining;
    }
    // The better ones (any slot order: sorted below), then the tied ones by id.
    const u32 better = (u32)k - remaining;
    for (int c = tid; c < vocab; c += blockDim.x) {
        const u32 key = order_key(l[c]);
        if (key > prefix) {
            const u32 slot = atomicAdd(&s_count, 1u);
            ckey[slot] = key;
            cid[slot] = (u32)c;
        }
    }
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    const int c0 = tid * chunk, c1 = imin(vocab, c0 + chunk);
    u32 ties = 0;
    for (int c = c0; c < c1; c++) ties += order_key(l[c]) == prefix;
    u32 ties_total;
    u32 at = block_exclusive_scan(ties, scan, ties_total);
    for (int c = c0; c < c1 && at < remaining; c++) {
        if (order_key(l[c]) == prefix) {
            ckey[better + at] = prefix;
            cid[better + at] = (u32)c;
            at++;
        }
    }
    // The k candidates sorted best first; padding sorts last.
    int n = 1;
    while (n < k) n <<= 1;
    for (int i = k + tid; i < n; i += blockDim.x) {
        ckey[i] = 0u;
        cid[i] = 0xffffffffu;
    }
    bitonic_sort_desc(ckey, cid, n);
    for (int i = tid; i < k; i += blockDim.x) {
        cval[i] = l[cid[i]];
        cw[i] = (double)expf(cval[i]);
    }
    __syncthreads();
    if (tid == 0) {
        int m = 0;  // candidates past top-k's trailing -inf
        while (m < k && cval[m] > NEG_INF) m++;
        if (r.top_p < 1.f) {
            double total = 0.0;
            for (int i = 0; i < m; i++) total += cw[i];
            const double target = (double)r.top_p * total;
            double cum = 0.0;
            for (int i = 0; i < m; i++) {
                cum += cw[i];
                if (cum >= target) {
                    m = i + 1;
                    break;
                }
            }
        }
        int kept = 0;  // min-p: a prefix, since the values are sorted
        while (kept < m && cval[kept] >= r.min_p_ln) kept++;
        double total = 0.0;
        for (int i = 0; i < kept; i++) total += cw[i];
        const double target = r.uniform * total;
        double cum = 0.0;
        int pick = -1;
        for (int i = 0; i < kept; i++) {
            cum += cw[i];
            if (target < cum) {
                pick = i;
                break;
            }
        }
        if (pick < 0) {
            // Rounding left the target at the top: the last token with any weight owns it.
            for (int i = kept - 1; i >= 0 && pick < 0; i--)
                if (cw[i] > 0.0) pick = i;
            if (pick < 0 && kept > 0) pick = 0;
        }
        out[r.slot] = pick < 0 ? 0u : cid[pick];
    }
}

// ---------------------------------------------------------------------------------------------
// The full-vocabulary pipeline: several blocks per row (a "part" of the row each), so one row
// (decode of a single stream) is spread over the GPU like the argmax above.
//
// FULL_GREEDY rows take the argmax; FULL_DRAW rows draw as sampling.rs's truncate + draw do
// without a top-k: normalise, top-p's nucleus (the host's 4096 buckets of 1/64 nat, then the
// crossing bucket's tokens sorted), min-p, and a walk over the kept tokens in id order. Every
// row with top_n >= 0 then gets its log-probabilities (FULL_LOGPROBS_ONLY rows come from
// sample_topk, whose logits are normalised in place already: temperature 1, max 0).
//
// "Sorted" FULL_DRAW rows (top_k > 0: a top-k above SAMPLE_MAX_K below the vocabulary, or the
// vocabulary itself for a top-p row of a vocabulary of at most SORT_BELOW tokens, which the host
// always sorts) are the host's sorted walk: top-k's k best, top-p over them in sorted order, min-p, and a draw walking the
// kept tokens best first (value descending, ties to the lower id). Each of those three steps is
// one question, "at which token of the sorted order does a running sum first reach a need?",
// answered without sorting by the radix select of sel_* below (counts for top-k, fixed-point
// mass for top-p and the draw). Nothing of such a row is left to the host.
//
// Probability mass is summed in fixed point: exp(n) of a normalised logit n <= 0 is at most 1,
// scaled by 2^mass_bits (chosen so a whole row's sum fits in 63 bits) and rounded to an
// integer. Integer sums do not depend on their order, so the result is the same however a row
// is split into parts, and a row's draw does not depend on the batch around it. Against the
// host's f64 sums the weights differ by at most 2^-mass_bits each (2^-44 for Qwen's 248,320
// tokens): a uniform within that of a boundary between two tokens is the only way the two
// can disagree.
//
// Rows the pipeline cannot finish exactly as the host does are flagged FULL_HOST and drawn on
// the host from the (biased, penalised) logits: top-p without a top-k over at most SORT_BELOW
// finite logits of a larger vocabulary (the host sorts them and walks them sorted), and a
// crossing bucket of more than TOPP_CAP tokens.
#define FULL_THREADS 256
#define FULL_GREEDY 0
#define FULL_DRAW 1
#define FULL_LOGPROBS_ONLY 2
#define FULL_OK 0
#define FULL_BAD 1
#define FULL_HOST 2
#define TOPP_BUCKETS 4096
#define TOPP_PER_NAT 64.f
#define TOPP_CAP 4096
#define SORT_BELOW 2048
#define TOP_N_MAX 20

// One part of one row (PartStat in sample.rs).
struct PartStat {
    float max;
    int arg;
    int bad;
    u32 finite;
    u64 all;   // fixed-point mass of every token
    u64 kept;  // fixed-point mass of the tokens the draw keeps
};

// One row (RowState in sample.rs); zeroed before the pipeline.
struct RowState {
    float max;
    int arg;
    int status;
    u32 finite;
    u32 bucket;      // top-p: the bucket where the mass reaches top_p
    u32 collected;   // top-p: tokens of that bucket gathered
    u32 cut_key;     // top-p: the nucleus's last token (key, id)
    u32 cut_id;
    u64 hist_total;  // top-p: the whole row's mass
    u64 above;       // top-p: mass of the buckets before `bucket`
    u64 offset;      // the draw: the target's offset in part `part`
    int part;
    int pad;
    u32 topk_key;    // sorted rows: top-k's last token (key, id); (0, ~0) keeps every token
    u32 topk_id;
};

// A log-probability entry (LogprobEntry in sample.rs): token 0 of a row is the drawn one.
struct LogprobEntry {
    u32 id;
    float logprob;
};

// The row's normalised logit, with -0 made +0 (the host compares them equal).
__device__ __forceinline__ float full_norm(float v, float mx, float temperature) {
    return __fadd_rn(__fdiv_rn(__fsub_rn(v, mx), temperature), 0.f);
}

// exp(n) in fixed point.
__device__ __forceinline__ u64 full_weight(float n, double scale) {
    return __double2ull_rn((double)expf(n) * scale);
}

// sampling.rs's `bucket`: the host's top-p histogram bucket of a normalised logit (<= 0).
__device__ __forceinline__ u32 topp_bucket(float n) {
    const float t = -n * TOPP_PER_NAT;
    return t >= (float)(TOPP_BUCKETS - 1) ? (u32)(TOPP_BUCKETS - 1) : (u32)t;
}

// The columns of part `p` of a row split into `parts`.
__device__ __forceinline__ void part_span(int vocab, int parts, int p, int& c0, int& c1) {
    const int span = (vocab + parts - 1) / parts;
    c0 = imin(vocab, p * span);
    c1 = imin(vocab, c0 + span);
}

// A drawing row walked in sorted order (see above): the sel_* kernels truncate and draw it.
__device__ __forceinline__ bool full_sorted(const DrawRow& r) { return r.mode == FULL_DRAW && r.top_k > 0; }

// A drawing row with top-p and no top-k: the topp_* kernels find its nucleus.
__device__ __forceinline__ bool full_topp(const DrawRow& r) {
    return r.mode == FULL_DRAW && r.top_p < 1.f && !full_sorted(r);
}

// Whether a FULL_DRAW row keeps token c (normalised logit n, finite): in the nucleus and above
// min-p.
__device__ __forceinline__ bool full_keeps(const DrawRow& r, const RowState& s, float n, int c) {
    if (full_topp(r)) {
        const u32 key = order_key(n);
        if (key < s.cut_key || (key == s.cut_key && (u32)c > s.cut_id)) return false;
    }
    return n >= r.min_p_ln;
}

// Block (p, i): the max, argmax, NaN/+inf and count of finite logits of part p of row i.
// grid (parts, rows), block FULL_THREADS.
extern "C" __global__ void __launch_bounds__(FULL_THREADS) full_max(const float* logits, int vocab, const DrawRow* rows,
                                                                   PartStat* stats, int parts) {
    pdl_enter();
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ u64 su[32];
    const DrawRow r = rows[blockIdx.y];
    const float* l = logits + r.row * vocab;
    int c0, c1;
    part_span(vocab, parts, blockIdx.x, c0, c1);
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    bool bad = false;
    u64 finite = 0;
    for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
        const float v = l[c];
        bad |= bad_logit(v);
        finite += v > NEG_INF;
        if (v > bv) {
            bv = v;
            bi = c;
        }
    }
    bad = __syncthreads_or(bad);
    block_argmax(bv, bi, sv, si);
    finite = block_sum_u64(finite, su);
    if (threadIdx.x == 0) {
        PartStat& out = stats[(i64)blockIdx.y * parts + blockIdx.x];
        out.max = bv;
        out.arg = bi;
        out.bad = bad;
        out.finite = (u32)finite;
    }
}

// Row i: its parts combined; decides whether the row is bad, or left to the host. Greedy rows
// get their token here. grid rows, block 64.
extern "C" __global__ void __launch_bounds__(64) full_combine(const DrawRow* rows, PartStat* stats, RowState* state,
                                                             int parts, u32* out) {
    pdl_enter();
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ u64 su[32];
    const DrawRow r = rows[blockIdx.x];
    const PartStat* ps = stats + (i64)blockIdx.x * parts;
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    bool bad = false;
    u64 finite = 0;
    for (int p = threadIdx.x; p < parts; p += blockDim.x) {
        argmax_take(bv, bi, ps[p].max, ps[p].arg);
        bad |= ps[p].bad != 0;
        finite += ps[p].finite;
    }
    bad = __syncthreads_or(bad);
    block_argmax(bv, bi, sv, si);
    finite = block_sum_u64(finite, su);
    if (threadIdx.x == 0) {
        RowState& s = state[blockIdx.x];
        s.max = bv;
        s.arg = bi;
        s.finite = (u32)finite;
        int status = FULL_OK;
        if (bad || !(bv > NEG_INF)) {
            status = FULL_BAD;
        } else if (full_topp(r) && finite <= SORT_BELOW) {
            status = FULL_HOST;
        }
        s.status = status;
        if (status == FULL_BAD) out[r.slot] = NO_TOKEN;
        else if (r.mode == FULL_GREEDY) out[r.slot] = (u32)bi;
    }
}

// Block (p, i): the fixed-point mass of part p of row i: of every token (for the
// log-probabilities), of the tokens the draw keeps when there is no top-p, and top-p's bucket
// histogram (in shared memory, then added to the row's in `hist`). grid (parts, rows), block
// FULL_THREADS.
extern "C" __global__ void __launch_bounds__(FULL_THREADS) full_mass(const float* logits, int vocab, const DrawRow* rows,
                                                                    const RowState* state, PartStat* stats, u64* hist,
                                                                    int parts, double scale) {
    pdl_enter();
    __shared__ u64 h[TOPP_BUCKETS];
    __shared__ u64 su[32];
    const DrawRow r = rows[blockIdx.y];
    const RowState s = state[blockIdx.y];
    // Sorted rows find their kept mass in sel_*: here only the log-probabilities' mass.
    const bool walks_ids = r.mode == FULL_DRAW && !full_sorted(r);
    if (s.status != FULL_OK || (!walks_ids && r.top_n < 0)) return;
    const bool topp = full_topp(r);
    if (topp) {
        for (int b = threadIdx.x; b < TOPP_BUCKETS; b += blockDim.x) h[b] = 0;
        __syncthreads();
    }
    const float* l = logits + r.row * vocab;
    int c0, c1;
    part_span(vocab, parts, blockIdx.x, c0, c1);
    u64 all = 0, kept = 0;
    for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
        const float n = full_norm(l[c], s.max, r.temperature);
        if (!(n > NEG_INF)) continue;
        const u64 w = full_weight(n, scale);
        all += w;
        if (topp) {
            atomicAdd(&h[topp_bucket(n)], w);
        } else if (walks_ids && n >= r.min_p_ln) {
            kept += w;
        }
    }
    all = block_sum_u64(all, su);
    kept = block_sum_u64(kept, su);
    if (threadIdx.x == 0) {
        PartStat& out = stats[(i64)blockIdx.y * parts + blockIdx.x];
        out.all = all;
        out.kept = kept;
    }
    if (topp) {
        __syncthreads();
        u64* row_hist = hist + (i64)blockIdx.y * TOPP_BUCKETS;
        for (int b = threadIdx.x; b < TOPP_BUCKETS; b += blockDim.x)
            if (h[b]) atomicAdd(&row_hist[b], h[b]);
    }
}

// Row i with top-p: the bucket where the cumulative mass (from the highest bucket) first
// reaches top_p of the whole, and the mass before it. grid rows, block 1024.
extern "C" __global__ void __launch_bounds__(1024) topp_find_bucket(const DrawRow* rows, RowState* state,
                                                                   const u64* hist) {
    pdl_enter();
    __shared__ u64 scan[32];
    const DrawRow r = rows[blockIdx.x];
    RowState& s = state[blockIdx.x];
    if (s.status != FULL_OK || !full_topp(r)) return;
    const u64* h = hist + (i64)blockIdx.x * TOPP_BUCKETS;
    const int per = TOPP_BUCKETS / 1024;
    const int b0 = threadIdx.x * per;
    u64 mine = 0;
    for (int b = b0; b < b0 + per; b++) mine += h[b];
    u64 total;
    u64 before = block_exclusive_scan(mine, scan, total);
    const double target = (double)r.top_p * (double)total;
    for (int b = b0; b < b0 + per; b++) {
        const u64 after = before + h[b];
        if ((double)before < target && (double)after >= target) {
            s.bucket = (u32)b;
            s.above = before;
            s.hist_total = total;
        }
        before = after;
    }
}

// Block (p, i): gathers part p's tokens of row i's crossing bucket. grid (parts, rows), block
// FULL_THREADS.
extern "C" __global__ void __launch_bounds__(FULL_THREADS) topp_collect(const float* logits, int vocab,
                                                                       const DrawRow* rows, RowState* state,
                                                                       u32* list, int parts) {
    pdl_enter();
    const DrawRow r = rows[blockIdx.y];
    RowState& s = state[blockIdx.y];
    if (s.status != FULL_OK || !full_topp(r)) return;
    const float* l = logits + r.row * vocab;
    const float mx = s.max;
    const u32 bucket = s.bucket;
    int c0, c1;
    part_span(vocab, parts, blockIdx.x, c0, c1);
    for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
        const float n = full_norm(l[c], mx, r.temperature);
        if (n > NEG_INF && topp_bucket(n) == bucket) {
            const u32 slot = atomicAdd(&s.collected, 1u);
            if (slot < TOPP_CAP) list[(i64)blockIdx.y * TOPP_CAP + slot] = (u32)c;
        }
    }
}

// Row i with top-p: the crossing bucket's tokens sorted (value descending, id ascending), then
// walked from the mass before the bucket until the cumulative mass reaches top_p: that token
// is the nucleus's last (the whole bucket when rounding leaves the target unreached, as on the
// host). More than TOPP_CAP tokens leave the row to the host. grid rows, block 1024.
extern "C" __global__ void __launch_bounds__(1024) topp_cut(const float* logits, int vocab, const DrawRow* rows,
                                                           RowState* state, const u32* list, double scale) {
    pdl_enter();
    __shared__ u32 key[TOPP_CAP];
    __shared__ u32 cid[TOPP_CAP];
    __shared__ u64 scan[32];
    __shared__ int first;
    const DrawRow r = rows[blockIdx.x];
    RowState& s = state[blockIdx.x];
    if (s.status != FULL_OK || !full_topp(r)) return;
    const u32 count = s.collected;
    if (count == 0 || count > TOPP_CAP) {
        if (threadIdx.x == 0) s.status = FULL_HOST;
        return;
    }
    const float* l = logits + r.row * vocab;
    const float mx = s.max;
    int n2 = 1;
    while (n2 < (int)count) n2 <<= 1;
    for (int i = threadIdx.x; i < n2; i += blockDim.x) {
        if (i < (int)count) {
            const u32 c = list[(i64)blockIdx.x * TOPP_CAP + i];
            key[i] = order_key(full_norm(l[c], mx, r.temperature));
            cid[i] = c;
        } else {
            key[i] = 0u;
            cid[i] = 0xffffffffu;
        }
    }
    if (threadIdx.x == 0) first = 0x7fffffff;
    // Best first; padding sorts last.
    bitonic_sort_desc(key, cid, n2);
    // Each thread takes TOPP_CAP / 1024 consecutive sorted tokens.
    const int per = TOPP_CAP / 1024;
    const int i0 = threadIdx.x * per;
    u64 w[TOPP_CAP / 1024];
    u64 mine = 0;
    for (int k = 0; k < per; k++) {
        const int i = i0 + k;
        w[k] = i < (int)count ? full_weight(full_norm(l[cid[i]], mx, r.temperature), scale) : 0ull;
        mine += w[k];
    }
    u64 total;
    u64 cum = s.above + block_exclusive_scan(mine, scan, total);
    const double target = (double)r.top_p * (double)s.hist_total;
    for (int k = 0; k < per; k++) {
        const int i = i0 + k;
        cum += w[k];
        if (i < (int)count && (double)cum >= target) {
            atomicMin(&first, i);
            break;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const int last = first < (int)count ? first : (int)count - 1;
        s.cut_key = key[last];
        s.cut_id = cid[last];
    }
}

// Block (p, i): the fixed-point mass of the tokens a top-p row keeps in part p. grid (parts,
// rows), block FULL_THREADS.
extern "C" __global__ void __launch_bounds__(FULL_THREADS) full_kept(const float* logits, int vocab,
                                                                    const DrawRow* rows, const RowState* state,
                                                                    PartStat* stats, int parts, double scale) {
    pdl_enter();
    __shared__ u64 su[32];
    const DrawRow r = rows[blockIdx.y];
    const RowState s = state[blockIdx.y];
    if (s.status != FULL_OK || !full_topp(r)) return;
    const float* l = logits + r.row * vocab;
    int c0, c1;
    part_span(vocab, parts, blockIdx.x, c0, c1);
    u64 kept = 0;
    for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
        const float n = full_norm(l[c], s.max, r.temperature);
        if (n > NEG_INF && full_keeps(r, s, n, c)) kept += full_weight(n, scale);
    }
    kept = block_sum_u64(kept, su);
    if (threadIdx.x == 0) stats[(i64)blockIdx.y * parts + blockIdx.x].kept = kept;
}

// Row i drawing in id order: the target floor(uniform * kept mass) and the part it falls in.
// grid rows, block 32.
extern "C" __global__ void __launch_bounds__(32) full_target(const DrawRow* rows, RowState* state,
                                                            const PartStat* stats, int parts) {
    pdl_enter();
    const DrawRow r = rows[blockIdx.x];
    RowState& s = state[blockIdx.x];
    if (s.status != FULL_OK || r.mode != FULL_DRAW || full_sorted(r) || threadIdx.x != 0) return;
    const PartStat* ps = stats + (i64)blockIdx.x * parts;
    u64 total = 0;
    for (int p = 0; p < parts; p++) total += ps[p].kept;
    u64 target = __double2ull_rz(r.uniform * (double)total);
    if (target >= total) target = total - 1;  // total > 0: the best token is always kept
    u64 before = 0;
    int p = 0;
    while (p < parts - 1 && before + ps[p].kept <= target) {
        before += ps[p].kept;
        p++;
    }
    s.part = p;
    s.offset = target - before;
}

// Row i drawing in id order: walks its target's part to the first token whose cumulative mass
// passes the target. grid rows, block 1024.
extern "C" __global__ void __launch_bounds__(1024) full_pick(const float* logits, int vocab, const DrawRow* rows,
                                                            const RowState* state, int parts, double scale,
                                                            u32* out) {
    pdl_enter();
    __shared__ u64 scan[32];
    const DrawRow r = rows[blockIdx.x];
    const RowState s = state[blockIdx.x];
    if (s.status != FULL_OK || r.mode != FULL_DRAW || full_sorted(r)) return;
    const float* l = logits + r.row * vocab;
    int c0, c1;
    part_span(vocab, parts, s.part, c0, c1);
    const int per = (c1 - c0 + blockDim.x - 1) / blockDim.x;
    const int t0 = imin(c1, c0 + threadIdx.x * per), t1 = imin(c1, t0 + per);
    u64 mine = 0;
    for (int c = t0; c < t1; c++) {
        const float n = full_norm(l[c], s.max, r.temperature);
        if (n > NEG_INF && full_keeps(r, s, n, c)) mine += full_weight(n, scale);
    }
    u64 total;
    u64 cum = block_exclusive_scan(mine, scan, total);
    if (cum <= s.offset && s.offset < cum + mine) {
        for (int c = t0; c < t1; c++) {
            const float n = full_norm(l[c], s.max, r.temperature);
            if (n > NEG_INF && full_keeps(r, s, n, c)) {
                cum += full_weight(n, scale);
                if (cum > s.offset) {
                    out[r.slot] = (u32)c;
                    break;
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Sorted rows (full_sorted): the radix select. Each stage answers "which token of the row, in
// the host's sorted order (key descending, id ascending), is the first at which the running
// sum of a weight reaches `need`?":
//  SEL_TOPK  weight 1 per finite token, need k: top-k's last token (none when the row has at
//            most k finite tokens: all are kept, as the host's trailing -inf are dropped);
//  SEL_TOPP  weight the fixed-point mass of the tokens top-k keeps, need top_p of their total:
//            the nucleus's last token (the host's `cumulative >= target` on the sorted list);
//  SEL_DRAW  weight the mass of the tokens top-k, top-p and min-p keep, need floor(uniform *
//            total) + 1: the drawn token (the host's walk of the sorted candidates).
// Three passes over the 32-bit order key, 11, 11 and 10 bits from the top: sel_hist sums the
// weights of the tokens that match the key's prefix so far into a histogram of the next digit
// (several blocks a row), sel_find picks the digit where the sum reaches `need` (one block a
// row). After the third pass the key is known; sel_ties sums the weight of each part's tokens
// of that key, and sel_pick walks the tied tokens in id order. Integer sums, so the answer
// does not depend on how the row is split or on the batch. A stage's histogram is zeroed by
// sel_find as it is read, ready for the next pass.
#define SEL_TOPK 0
#define SEL_TOPP 1
#define SEL_DRAW 2
#define SEL_BUCKETS 2048

// One row's select in progress (SelectState in sample.rs).
struct SelectState {
    u64 before;  // weight of the tokens whose key is above the prefix
    u64 need;
    u32 prefix;  // the key's digits found so far
    int done;    // nothing to select (SEL_TOPK keeps every token)
};

__device__ __forceinline__ int sel_shift(int pass) { return pass == 0 ? 21 : pass == 1 ? 10 : 0; }
// The key bits the passes before `pass` fixed.
__device__ __forceinline__ u32 sel_high(int pass) { return pass == 0 ? 0u : pass == 1 ? 0xffe00000u : 0xfffffc00u; }
__device__ __forceinline__ u32 sel_digit(u32 key, int pass) {
    return (key >> sel_shift(pass)) & (pass == 2 ? 0x3ffu : 0x7ffu);
}

// Whether token (key, c) comes at or before the cut (cut_key, cut_id) in the sorted order.
__device__ __forceinline__ bool sel_within(u32 key, int c, u32 cut_key, u32 cut_id) {
    return key > cut_key || (key == cut_key && (u32)c <= cut_id);
}

__device__ __forceinline__ bool sel_active(const DrawRow& r, const RowState& s, int stage) {
    return s.status == FULL_OK && full_sorted(r) && (stage != SEL_TOPP || r.top_p < 1.f);
}

// The weight of token c (normalised logit n > -inf, key its order key) in `stage`.
__device__ __forceinline__ u64 sel_weight(const DrawRow& r, const RowState& s, int stage, float n, u32 key, int c,
                                          double scale) {
    if (stage == SEL_TOPK) return 1ull;
    if (!sel_within(key, c, s.topk_key, s.topk_id)) return 0ull;
    if (stage == SEL_DRAW) {
        if (r.top_p < 1.f && !sel_within(key, c, s.cut_key, s.cut_id)) return 0ull;
        if (!(n >= r.min_p_ln)) return 0ull;
    }
    return full_weight(n, scale);
}

// Block (p, i): part p's histogram of the next key digit of row i's tokens that match the
// prefix, weighted for `stage`, added to the row's. grid (parts, rows), block FULL_THREADS.
extern "C" __global__ void __launch_bounds__(FULL_THREADS) sel_hist(const float* logits, int vocab, const DrawRow* rows,
                                                                   const RowState* state, const SelectState* sel,
                                                                   u64* hist, int parts, int stage, int pass,
                                                                   double scale) {
    pdl_enter();
    __shared__ u64 h[SEL_BUCKETS];
    const DrawRow r = rows[blockIdx.y];
    const RowState s = state[blockIdx.y];
    if (!sel_active(r, s, stage)) return;
    const SelectState q = sel[blockIdx.y];
    if (pass > 0 && q.done) return;
    for (int b = threadIdx.x; b < SEL_BUCKETS; b += blockDim.x) h[b] = 0;
    __syncthreads();
    const float* l = logits + r.row * vocab;
    const u32 high = sel_high(pass), prefix = pass > 0 ? q.prefix : 0u;
    int c0, c1;
    part_span(vocab, parts, blockIdx.x, c0, c1);
    for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
        const float n = full_norm(l[c], s.max, r.temperature);
        if (!(n > NEG_INF)) continue;
        const u32 key = order_key(n);
        if ((key & high) != prefix) continue;
        const u64 w = sel_weight(r, s, stage, n, key, c, scale);
        if (w) atomicAdd(&h[sel_digit(key, pass)], w);
    }
    __syncthreads();
    u64* row_hist = hist + (i64)blockIdx.y * SEL_BUCKETS;
    for (int b = threadIdx.x; b < SEL_BUCKETS; b += blockDim.x)
        if (h[b]) atomicAdd(&row_hist[b], h[b]);
}

// Row i: the digit of this pass where the running sum (from the highest digit down) reaches
// `need` (set on the first pass from the stage's total); zeroes the histogram. grid rows, block
// SEL_BUCKETS / 2.
extern "C" __global__ void __launch_bounds__(SEL_BUCKETS / 2) sel_find(const DrawRow* rows, RowState* state,
                                                                      SelectState* sel, u64* hist, int stage,
                                                                      int pass) {
    pdl_enter();
    __shared__ u64 scan[32];
    const DrawRow r = rows[blockIdx.x];
    RowState& s = state[blockIdx.x];
    SelectState& q = sel[blockIdx.x];
    if (!sel_active(r, s, stage)) return;
    if (pass > 0 && q.done) return;
    u64 before = pass > 0 ? q.before : 0ull, need = pass > 0 ? q.need : 0ull;
    const u32 prefix = pass > 0 ? q.prefix : 0u;
    u64* h = hist + (i64)blockIdx.x * SEL_BUCKETS;
    // Thread t holds digits d0 = 2047 - 2t and d0 - 1: thread order is descending digit order.
    const int d0 = SEL_BUCKETS - 1 - 2 * (int)threadIdx.x;
    const u64 h0 = h[d0], h1 = h[d0 - 1];
    u64 total;
    const u64 above = block_exclusive_scan(h0 + h1, scan, total);  // ends with a barrier
    h[d0] = 0;
    h[d0 - 1] = 0;
    if (pass == 0) {
        if (stage == SEL_TOPK) {
            need = (u64)r.top_k;
            if (total <= need) {  // at most k finite tokens: top-k keeps them all
                if (threadIdx.x == 0) {
                    s.topk_key = 0u;
                    s.topk_id = 0xffffffffu;
                    q.done = 1;
                }
                return;
            }
        } else if (stage == SEL_TOPP) {
            // The host's `cumulative >= top_p * total`, in integers.
            need = __double2ull_ru((double)r.top_p * (double)total);
            need = need < 1ull ? 1ull : need > total ? total : need;
        } else {
            // The host's `target < cumulative` with target = uniform * total (full_target's).
            u64 target = __double2ull_rz(r.uniform * (double)total);
            if (target >= total) target = total - 1;  // total > 0: the best token is kept
            need = target + 1;
        }
    }
    const u64 at0 = before + above, at1 = at0 + h0;
    int digit = -1;
    u64 at = 0;
    if (at0 < need && need <= at1) {
        digit = d0;
        at = at0;
    } else if (at1 < need && need <= at1 + h1) {
        digit = d0 - 1;
        at = at1;
    }
    if (digit >= 0) {
        q.prefix = prefix | ((u32)digit << sel_shift(pass));
        q.before = at;
        q.need = need;
        q.done = 0;
    }
}

// Block (p, i): the weight of part p's tokens of row i whose key is the selected one, into
// ties[i * parts + p]. grid (parts, rows), block FULL_THREADS.
extern "C" __global__ void __launch_bounds__(FULL_THREADS) sel_ties(const float* logits, int vocab, const DrawRow* rows,
                                                                   const RowState* state, const SelectState* sel,
                                                                   u64* ties, int parts, int stage, double scale) {
    pdl_enter();
    __shared__ u64 su[32];
    const DrawRow r = rows[blockIdx.y];
    const RowState s = state[blockIdx.y];
    if (!sel_active(r, s, stage)) return;
    const SelectState q = sel[blockIdx.y];
    if (q.done) return;
    const float* l = logits + r.row * vocab;
    int c0, c1;
    part_span(vocab, parts, blockIdx.x, c0, c1);
    u64 mine = 0;
    for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
        const float n = full_norm(l[c], s.max, r.temperature);
        if (n > NEG_INF && order_key(n) == q.prefix) mine += sel_weight(r, s, stage, n, q.prefix, c, scale);
    }
    mine = block_sum_u64(mine, su);
    if (threadIdx.x == 0) ties[(i64)blockIdx.y * parts + blockIdx.x] = mine;
}

// Row i: the tied token where the running sum reaches `need`, walking the parts and then the
// part's tokens in id order; the stage's answer goes to the row state (top-k's and top-p's
// cuts) or to out[slot] (the draw). grid rows, block 1024.
extern "C" __global__ void __launch_bounds__(1024) sel_pick(const float* logits, int vocab, const DrawRow* rows,
                                                           RowState* state, const SelectState* sel,
                                                           const u64* ties, int parts, int stage, double scale,
                                                           u32* out) {
    pdl_enter();
    __shared__ u64 scan[32];
    __shared__ int s_part;
    __shared__ u64 s_before;
    const DrawRow r = rows[blockIdx.x];
    RowState& st = state[blockIdx.x];
    const RowState s = st;
    if (!sel_active(r, s, stage)) return;
    const SelectState q = sel[blockIdx.x];
    if (q.done) return;
    if (threadIdx.x == 0) {
        const u64* tp = ties + (i64)blockIdx.x * parts;
        u64 before = q.before;
        int p = 0;
        while (p < parts - 1 && before + tp[p] < q.need) {
            before += tp[p];
            p++;
        }
        s_part = p;
        s_before = before;
    }
    __syncthreads();
    const float* l = logits + r.row * vocab;
    int c0, c1;
    part_span(vocab, parts, s_part, c0, c1);
    const int per = (c1 - c0 + blockDim.x - 1) / blockDim.x;
    const int t0 = imin(c1, c0 + threadIdx.x * per), t1 = imin(c1, t0 + per);
    u64 mine = 0;
    for (int c = t0; c < t1; c++) {
        const float n = full_norm(l[c], s.max, r.temperature);
        if (n > NEG_INF && order_key(n) == q.prefix) mine += sel_weight(r, s, stage, n, q.prefix, c, scale);
    }
    u64 total;
    u64 cum = s_before + block_exclusive_scan(mine, scan, total);
    if (cum < q.need && q.need <= cum + mine) {
        for (int c = t0; c < t1; c++) {
            const float n = full_norm(l[c], s.max, r.temperature);
            if (n > NEG_INF && order_key(n) == q.prefix) {
                cum += sel_weight(r, s, stage, n, q.prefix, c, scale);
                if (cum >= q.need) {
                    if (stage == SEL_TOPK) {
                        st.topk_key = q.prefix;
                        st.topk_id = (u32)c;
                    } else if (stage == SEL_TOPP) {
                        st.cut_key = q.prefix;
                        st.cut_id = (u32)c;
                    } else {
                        out[r.slot] = (u32)c;
                    }
                    break;
                }
            }
        }
    }
}

// Block (p, i), rows with log-probabilities: part p's top_n tokens by normalised logit
// (descending, ties to the lower id), found one at a time, each the best after the previous.
// Fewer than TOP_N_MAX leave (-inf, INT_MAX) in the rest. grid (parts, rows), block
// FULL_THREADS.
extern "C" __global__ void __launch_bounds__(FULL_THREADS) full_top(const float* logits, int vocab,
                                                                   const DrawRow* rows, const RowState* state,
                                                                   LogprobEntry* tops, int parts) {
    pdl_enter();
    __shared__ float sv[32];
    __shared__ int si[32];
    const DrawRow r = rows[blockIdx.y];
    const RowState s = state[blockIdx.y];
    if (s.status != FULL_OK || r.top_n <= 0) return;
    const float* l = logits + r.row * vocab;
    int c0, c1;
    part_span(vocab, parts, blockIdx.x, c0, c1);
    LogprobEntry* out = tops + ((i64)blockIdx.y * parts + blockIdx.x) * TOP_N_MAX;
    float pv = POS_INF;
    int pi = -1;
    for (int k = 0; k < r.top_n; k++) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
            const float n = full_norm(l[c], s.max, r.temperature);
            if (n < pv || (n == pv && c > pi)) argmax_take(bv, bi, n, c);
        }
        block_argmax(bv, bi, sv, si);
        if (threadIdx.x == 0) out[k] = LogprobEntry{(u32)bi, bv};
        pv = bv;
        pi = bi;
    }
}

// Row i with log-probabilities: log Z from the parts' mass, the drawn token's log-probability
// and the best top_n of the parts' candidates, into lp[slot * (1 + TOP_N_MAX)]. grid rows,
// block 256.
#define MERGE_MAX 2048
extern "C" __global__ void __launch_bounds__(256) full_logprobs(const float* logits, int vocab, const DrawRow* rows,
                                                               const RowState* state, const PartStat* stats,
                                                               const LogprobEntry* tops, int parts,
                                                               double log_scale, const u32* out,
                                                               LogprobEntry* lp) {
    pdl_enter();
    __shared__ float cv[MERGE_MAX];
    __shared__ u32 ci[MERGE_MAX];
    const DrawRow r = rows[blockIdx.x];
    const RowState s = state[blockIdx.x];
    if (s.status != FULL_OK || r.top_n < 0) return;
    const float* l = logits + r.row * vocab;
    const PartStat* ps = stats + (i64)blockIdx.x * parts;
    u64 all = 0;
    for (int p = 0; p < parts; p++) all += ps[p].all;
    const float log_z = (float)(log((double)all) - log_scale);
    LogprobEntry* dst = lp + r.slot * (1 + TOP_N_MAX);
    if (threadIdx.x == 0) {
        const u32 token = out[r.slot];
        const float n = token < (u32)vocab ? full_norm(l[token], s.max, r.temperature) : NEG_INF;
        dst[0] = LogprobEntry{token, n - log_z};
    }
    if (r.top_n <= 0) return;
    const int count = parts * r.top_n;
    int n2 = 1;
    while (n2 < count) n2 <<= 1;
    for (int i = threadIdx.x; i < n2; i += blockDim.x) {
        if (i < count) {
            const LogprobEntry e = tops[((i64)blockIdx.x * parts + i / r.top_n) * TOP_N_MAX + i % r.top_n];
            cv[i] = e.logprob;
            ci[i] = e.id;
        } else {
            cv[i] = NEG_INF;
            ci[i] = 0xffffffffu;
        }
    }
    // Best first (value descending, id ascending); padding sorts last.
    bitonic_sort_desc(cv, ci, n2);
    for (int k = threadIdx.x; k < r.top_n; k += blockDim.x) dst[1 + k] = LogprobEntry{ci[k], cv[k] - log_z};
}
