// Row-wise and element-wise ops: embedding gather, RMSNorm (plain, fused with the residual add,
// gated), residual add, SwiGLU and the f32 -> bf16 conversion that feeds cuBLAS.

// out[t, :] = table[ids[t], :] widened to f32. grid (x: column blocks, y: tokens).
extern "C" __global__ void embed_rows(const bf16_t* table, const u32* ids,
                                      float* out, int dim) {
    pdl_enter();
    const int t = blockIdx.y;
    const bf16_t* src = table + (i64)ids[t] * dim;
    float* dst = out + (i64)t * dim;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < dim; c += gridDim.x * blockDim.x)
        dst[c] = bf16_to_f32(src[c]);
}

// The row norms keep a thread's elements in registers: up to NORM_VECS float4s of each operand
// (the launcher keeps dim <= 4 * NORM_VECS * blockDim). Every load of a row is issued before
// the first use, so a row costs one memory round trip, not one per element (stores through
// pointers that may alias would otherwise order each load after the previous store), and the
// weights, which no kernel writes, are fetched before waiting on the previous kernel. `vec`
// (set by the launcher) says dim % 4 == 0 and every pointer 16-byte aligned; the scalar loop
// otherwise.
#define NORM_VECS 4

__device__ __forceinline__ float sum_squares4(v4f v) { return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w; }
__device__ __forceinline__ v4f norm_scale4(v4f v, float s, v4f w) {
    return v4f{v.x * s * (1.f + w.x), v.y * s * (1.f + w.y), v.z * s * (1.f + w.z), v.w * s * (1.f + w.w)};
}

// The int8 activations a packed GEMV reads (quant.cu's `quantize_x`: per 32 values
// d = amax / 127, q = round(v / d) by the same float operations, an f32 scale per 32 and the
// sum of each 16 quants), made by the kernel that writes the values: eight consecutive threads
// hold a group of 32 as one float4 each (`i` the float4's index, `on` false past the row, for
// lanes that only join the shuffles). Bitwise what quantize_x makes of the stored values.
__device__ __forceinline__ void quantize4(v4f v, int i, bool on, signed char* xq, float* xd, int* xs) {
    float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    const int q0 = (int)roundf(__fmul_rn(v.x, id)), q1 = (int)roundf(__fmul_rn(v.y, id));
    const int q2 = (int)roundf(__fmul_rn(v.z, id)), q3 = (int)roundf(__fmul_rn(v.w, id));
    int s = q0 + q1 + q2 + q3;
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if (on) {
        ((u32*)xq)[i] = (u32)(q0 & 0xff) | (u32)(q1 & 0xff) << 8 | (u32)(q2 & 0xff) << 16 | (u32)(q3 & 0xff) << 24;
        if ((i & 7) == 0) xd[i >> 3] = d;
        if ((i & 3) == 0) xs[i >> 2] = s;
    }
}

// One row of either norm: v = x (ADD: residual + x, stored back into the residual), then
// out = v / rms(v) * (1 + w). Without ADD, `r` is unused. In the scalar loop each thread
// reads back only the elements it wrote itself: no barrier between the add and the norm.
// With QX (vec only, dim % 32 == 0) the row is also written quantized for a packed GEMV.
template <bool ADD, bool QX = false>
__device__ __forceinline__ void norm_row(float* r, const float* xr, const float* w, float* o, int dim, float eps,
                                         int vec, signed char* xq = nullptr, float* xd = nullptr,
                                         int* xs = nullptr) {
    __shared__ float scratch[32];
    if (vec) {
        const int nv = dim >> 2;
        v4f wv[NORM_VECS], v[NORM_VECS];
#pragma unroll
        for (int k = 0; k < NORM_VECS; ++k) {
            const int i = threadIdx.x + k * blockDim.x;
            if (i < nv) wv[k] = ((const v4f*)w)[i];
        }
        pdl_wait();
        v4f rv[NORM_VECS];
#pragma unroll
        for (int k = 0; k < NORM_VECS; ++k) {
            const int i = threadIdx.x + k * blockDim.x;
            if (i < nv) {
                if (ADD) rv[k] = ((const v4f*)r)[i];
                v[k] = ((const v4f*)xr)[i];
            }
        }
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < NORM_VECS; ++k) {
            const int i = threadIdx.x + k * blockDim.x;
            if (i < nv) {
                if (ADD) {
                    v[k] = v4f{rv[k].x + v[k].x, rv[k].y + v[k].y, rv[k].z + v[k].z, rv[k].w + v[k].w};
                    ((v4f*)r)[i] = v[k];
                }
                ss += sum_squares4(v[k]);
            }
        }
        ss = block_sum(ss, scratch);
        const float s = 1.f / sqrtf(ss / (float)dim + eps);
#pragma unroll
        for (int k = 0; k < NORM_VECS; ++k) {
            const int i = threadIdx.x + k * blockDim.x;
            if (QX) {
                // Every lane of a warp joins the shuffles; nv % 8 == 0, so a group of eight
                // float4s is wholly inside the row or wholly past it.
                if (k * blockDim.x >= nv) break;
                const v4f ov = i < nv ? norm_scale4(v[k], s, wv[k]) : v4f{0.f, 0.f, 0.f, 0.f};
                if (i < nv) ((v4f*)o)[i] = ov;
                quantize4(ov, i, i < nv, xq, xd, xs);
            } else if (i < nv) {
                ((v4f*)o)[i] = norm_scale4(v[k], s, wv[k]);
            }
        }
        return;
    }
    pdl_wait();
    const float* in = ADD ? r : xr;
    float ss = 0.f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        if (ADD) r[c] += xr[c];
        ss += in[c] * in[c];
    }
    ss = block_sum(ss, scratch);
    const float s = 1.f / sqrtf(ss / (float)dim + eps);
    for (int c = threadIdx.x; c < dim; c += blockDim.x) o[c] = in[c] * s * (1.f + w[c]);
}

// Qwen3_5RMSNorm, one block per row: out = x / rms(x) * (1 + w).
extern "C" __global__ void __launch_bounds__(1024)
    rms_norm_rows(const float* x, const float* w, float* out, int dim, float eps, int vec) {
    pdl_launch_dependents();
    const i64 row = (i64)blockIdx.x * dim;
    norm_row<false>(nullptr, x + row, w, out + row, dim, eps, vec);
}

// residual += x, then out = rms_norm(residual), one block per row.
extern "C" __global__ void __launch_bounds__(1024)
    add_rms_norm_rows(float* residual, const float* x, const float* w, float* out, int dim, float eps, int vec) {
    pdl_launch_dependents();
    const i64 row = (i64)blockIdx.x * dim;
    norm_row<true>(residual + row, x + row, w, out + row, dim, eps, vec);
}

// One row of each norm above, also written quantized for the packed GEMV that reads it next
// (`xq` [dim] i8, `xd` [dim / 32] scales, `xs` [dim / 16] sums); the launcher guarantees the
// `vec` layout and dim % 32 == 0.
extern "C" __global__ void __launch_bounds__(1024) rms_norm_row_q(const float* x, const float* w, float* out,
                                                                  signed char* xq, float* xd, int* xs, int dim,
                                                                  float eps) {
    pdl_launch_dependents();
    norm_row<false, true>(nullptr, x, w, out, dim, eps, 1, xq, xd, xs);
}

extern "C" __global__ void __launch_bounds__(1024)
    add_rms_norm_row_q(float* residual, const float* x, const float* w, float* out, signed char* xq, float* xd,
                       int* xs, int dim, float eps) {
    pdl_launch_dependents();
    norm_row<true, true>(residual, x, w, out, dim, eps, 1, xq, xd, xs);
}

// Qwen3_5RMSNormGated in place, one warp per row: x = w * (x / rms(x)) * silu(z).
extern "C" __global__ void gated_rms_norm_rows(float* x, const float* z,
                                               const float* w, int rows, int dim, float eps) {
    pdl_enter();
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    float* xr = x + (i64)row * dim;
    const float* zr = z + (i64)row * dim;
    float ss = 0.f;
    for (int c = lane; c < dim; c += 32) ss += xr[c] * xr[c];
    ss = warp_sum(ss);
    const float s = 1.f / sqrtf(ss / (float)dim + eps);
    for (int c = lane; c < dim; c += 32) xr[c] = w[c] * (xr[c] * s) * silu_f(zr[c]);
}

extern "C" __global__ void add_inplace(float* residual, const float* x, i64 n) {
    pdl_enter();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        residual[i] += x[i];
}

extern "C" __global__ void swiglu(const float* gate, const float* up,
                                  float* out, i64 n) {
    pdl_enter();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = silu_f(gate[i]) * up[i];
}

// swiglu of one token's [32 * groups] values, also written quantized for the down projection's
// packed GEMV: one warp per 32, the values and operations of swiglu and quantize_x.
extern "C" __global__ void swiglu_q(const float* gate, const float* up, float* out, signed char* xq, float* xd,
                                    int* xs, int groups) {
    pdl_enter();
    const int lane = threadIdx.x & 31;
    const i64 g = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (g >= groups) return;
    const i64 i = g * 32 + lane;
    const float v = silu_f(gate[i]) * up[i];
    out[i] = v;
    quantize_group32(v, lane, g, xq, xd, xs);
}

// SwiGLU straight into a GEMM's bf16 input: silu(gate) * up rounded as f32_to_bf16_copy (with
// `lo`, as f32_to_bf16_split) rounds swiglu's f32 result, without storing that.
extern "C" __global__ void swiglu_to_bf16(const float* gate, const float* up, bf16_t* hi, bf16_t* lo, i64 n) {
    pdl_enter();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const float v = silu_f(gate[i]) * up[i];
        const bf16_t h = f32_to_bf16(v);
        hi[i] = h;
        if (lo) lo[i] = f32_to_bf16(v - bf16_to_f32(h));
    }
}

extern "C" __global__ void f32_to_bf16_copy(const float* x, bf16_t* y, i64 n) {
    pdl_enter();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = f32_to_bf16(x[i]);
}

// x = hi + lo with hi = bf16(x), lo = bf16(x - hi): two bf16 GEMMs on the pair carry ~16
// mantissa bits of the activations instead of 8 (the precise GEMM path).
extern "C" __global__ void f32_to_bf16_split(const float* x, bf16_t* hi,
                                             bf16_t* lo, i64 n) {
    pdl_enter();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const float v = x[i];
        const bf16_t h = f32_to_bf16(v);
        hi[i] = h;
        lo[i] = f32_to_bf16(v - bf16_to_f32(h));
    }
}

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

// Row-wise argmax of x: [rows, cols] into idx[rows], as the host's greedy pick: NaN counts as
// -inf, ties go to the lowest column, and a row where nothing beats -inf gives 0. A vocabulary
// row (~250k logits) is too long for one block: a block walking it one dependent load at a
// time took 93 µs (ncu, H200), 4 % of a quantized 9B decode step. So two stages: each block of
// argmax_partial takes ARGMAX_SPAN columns with all its loads in flight at once, and
// argmax_finish picks the row's best of those. The pick is exact (comparisons only), so the
// split never changes the answer.
#define ARGMAX_THREADS 256
#define ARGMAX_UNROLL 8
#define ARGMAX_SPAN (ARGMAX_THREADS * ARGMAX_UNROLL)
// Block (p, row): the best (value, index) of columns [p * ARGMAX_SPAN, (p + 1) * ARGMAX_SPAN)
// into part[2 * (row * parts + p)] and the next float (the index's bits); nothing better than
// -inf leaves (-inf, INT_MAX). grid (parts, rows), block ARGMAX_THREADS.
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
#pragma unroll
    for (int k = 0; k < ARGMAX_UNROLL; k++) {
        if (v[k] > bv) {  // false for NaN; columns rise, so a tie keeps the lower one
            bv = v[k];
            bi = c0 + k * ARGMAX_THREADS;
        }
    }
    block_argmax(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        float* out = part + 2 * ((i64)blockIdx.y * parts + blockIdx.x);
        out[0] = bv;
        out[1] = __int_as_float(bi);
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
    for (int p = threadIdx.x; p < parts; p += blockDim.x) argmax_take(bv, bi, pr[2 * p], __float_as_int(pr[2 * p + 1]));
    block_argmax(bv, bi, sv, si);
    if (threadIdx.x == 0) idx[blockIdx.x] = bv > NEG_INF ? (u32)bi : 0u;
}

// ---------------------------------------------------------------------------------------------
// Prepared draws finished next to the logits: sampling.rs's sample_prepared, step for step.
// One block of SAMPLE_THREADS threads per row:
//  1. penalties, each listed token once (separate roundings: no FMA, as on the host);
//  2. greedy rows: the argmax (NaN as -inf, ties to the lowest id, 0 when nothing beats -inf);
//  3. normalise (l - max) / temperature, computed on the fly from the penalised logits;
//  4. top-k: a radix select (4 passes of 8 bits) finds the k-th best key, then the better
//     tokens are gathered and the tied ones taken in id order, and the k are bitonic-sorted by
//     (value descending, id ascending), the host's order;
//  5. trailing -inf dropped, top-p over the sorted candidates (f64 running sum), min-p, and the
//     draw walking them in that order (f64 sums of f32 exp weights).
// Host and device may differ in the last bit of exp: a uniform within that of a boundary
// between two tokens is the only way they can disagree.
#define SAMPLE_THREADS 1024
#define SAMPLE_MAX_K 1024
#define PENALTY_REPEATED 0x80000000u

struct SampleRow {
    double uniform;  // < 0: greedy
    i64 row;         // the logits row
    i64 pen_at;      // first (token, flags) pair of this row in `penalties`
    int pen_count;
    int top_k;
    float temperature, top_p, min_p_ln, rep, presence, frequency;
};

// Larger value, larger key (for non-NaN floats; -0 sorts below +0, which compare equal on the
// host: normalised logits are never -0 unless a logit equals the max, and then all are 0).
__device__ __forceinline__ u32 order_key(float v) {
    const u32 u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum of v over the block (blockDim.x a multiple of 32); `scratch` 32 ints.
__device__ __forceinline__ u32 block_exclusive_scan(u32 v, u32* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += n;
    }
    __syncthreads();
    if (lane == 31) scratch[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        u32 w = lane < nw ? scratch[lane] : 0u;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const u32 n = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += n;
        }
        if (lane < nw) scratch[lane] = w;
    }
    __syncthreads();
    return (warp ? scratch[warp - 1] : 0u) + inc - v;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_rows(
    float* logits, int vocab, const SampleRow* rows, const u32* penalties, u32* out) {
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
    const SampleRow r = rows[blockIdx.x];
    float* l = logits + r.row * vocab;
    const int tid = threadIdx.x;

    for (int e = tid; e < r.pen_count; e += blockDim.x) {
        const u32 t = penalties[2 * (r.pen_at + e)], flags = penalties[2 * (r.pen_at + e) + 1];
        if (t < (u32)vocab) {
            float v = l[t];
            if (flags & PENALTY_REPEATED) v = v > 0.f ? __fdiv_rn(v, r.rep) : __fmul_rn(v, r.rep);
            const u32 count = flags & ~PENALTY_REPEATED;
            if (count > 0) v = __fsub_rn(v, __fadd_rn(__fmul_rn(r.frequency, (float)count), r.presence));
            l[t] = v;
        }
    }
    __syncthreads();

    // The argmax, which is also the max that normalising subtracts.
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int c = tid; c < vocab; c += blockDim.x) {
        const float v = l[c];
        if (v > bv) {
            bv = v;
            bi = c;
        }
    }
    block_argmax(bv, bi, bv_s, bi_s);
    if (r.uniform < 0.0 || !(bv > NEG_INF)) {
        if (tid == 0) out[blockIdx.x] = bv > NEG_INF ? (u32)bi : 0u;
        return;
    }
    const float mx = bv;
    const float temperature = r.temperature;
    // sampling.rs's normalise, one value at a time.
    auto norm = [mx, temperature](float v) -> float {
        if (v != v) return NEG_INF;
        if (mx == __int_as_float(0x7f800000)) return v == mx ? 0.f : NEG_INF;
        return __fdiv_rn(__fsub_rn(v, mx), temperature);
    };

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
    u32 at = block_exclusive_scan(ties, scan);
    for (int c = c0; c < c1 && at < remaining; c++) {
        if (order_key(l[c]) == prefix) {
            ckey[better + at] = prefix;
            cid[better + at] = (u32)c;
            at++;
        }
    }
    // Bitonic sort of the k candidates, best first; padding sorts last.
    int n = 1;
    while (n < k) n <<= 1;
    for (int i = k + tid; i < n; i += blockDim.x) {
        ckey[i] = 0u;
        cid[i] = 0xffffffffu;
    }
    for (int size = 2; size <= n; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            __syncthreads();
            for (int i = tid; i < n; i += blockDim.x) {
                const int j = i ^ stride;
                if (j > i) {
                    const bool j_first = ckey[j] > ckey[i] || (ckey[j] == ckey[i] && cid[j] < cid[i]);
                    const bool ascending = (i & size) == 0;
                    if (j_first == ascending) {
                        const u32 tk = ckey[i], ti = cid[i];
                        ckey[i] = ckey[j];
                        cid[i] = cid[j];
                        ckey[j] = tk;
                        cid[j] = ti;
                    }
                }
            }
        }
    }
    __syncthreads();
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
        out[blockIdx.x] = pick < 0 ? 0u : cid[pick];
    }
}
