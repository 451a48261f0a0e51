// out = x · Wᵀ against bf16 weights, f32 activations and accumulation.
//  - gemv_bf16_s*: one token (decode). Memory-bound: 1 to 8 warps per weight row, 16-byte
//    streaming loads (8 bf16), GEMV_UNROLL of them in flight per lane before the first FMA.
//  - gemv_bf16_rows_s*: the same for a decode batch, bit for bit per token.
//  - gemm_bf16_tiled: the fallback for several tokens when cuBLAS is unavailable; a plain
//    16x16 shared-memory tiling, correct on any shape, not fast.

#define GEMV_UNROLL 8

// Weights are read exactly once per call: keep them out of L1 so x stays cached there.
__device__ __forceinline__ v4u ld_stream(const v4u* p) {
    v4u r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

__device__ __forceinline__ float dot8(v4u w, const float* x) {
    const v4f a = *reinterpret_cast<const v4f*>(x);
    const v4f b = *reinterpret_cast<const v4f*>(x + 4);
    float s = bf16_lo(w.x) * a.x;
    s = fmaf(bf16_hi(w.x), a.y, s);
    s = fmaf(bf16_lo(w.y), a.z, s);
    s = fmaf(bf16_hi(w.y), a.w, s);
    s = fmaf(bf16_lo(w.z), b.x, s);
    s = fmaf(bf16_hi(w.z), b.y, s);
    s = fmaf(bf16_lo(w.w), b.z, s);
    s = fmaf(bf16_hi(w.w), b.w, s);
    return s;
}

// GEMV blocks are GEMV_WARPS warps. S warps share one weight row (S = 1, 2, 4 or 8, chosen from
// the row count so that short matrices still spread over the whole GPU): warp part s takes the
// 16-byte chunks s*32 + lane, s*32 + lane + 32*S, ... of the row, and the S partial sums are
// added in a fixed order. Each token's arithmetic is the same sequence of operations whatever NT
// and `tokens` are, so a token's result does not depend on what else is in the batch (and the
// batched kernel matches the one-token kernel bit for bit, given the same S).
#define GEMV_WARPS 8

template <int NT, int S>
__device__ __forceinline__ void gemv_rows_body(const bf16_t* w, const float* x,
                                               float* out, int rows, int cols, int tokens, int blk) {
    __shared__ float partial[GEMV_WARPS][NT];
    pdl_launch_dependents();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int part = warp % S;
    const i64 row = (i64)blk * (GEMV_WARPS / S) + warp / S;
    const bool live = row < rows;
    float acc0[NT], acc1[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc0[t] = acc1[t] = 0.f;
    // The weights never depend on the previous kernel: the first loads go out before the wait.
    bool waited = false;
    if (live) {
        const bf16_t* wr = w + row * cols;
        if ((cols & 7) == 0) {
            // Rows start 16-byte aligned: the allocation is, and a row is a multiple of 16 bytes.
            const v4u* w4 = reinterpret_cast<const v4u*>(wr);
            const int n = cols >> 3;
            for (int base = part * 32 + lane; base < n; base += 32 * S * GEMV_UNROLL) {
                v4u v[GEMV_UNROLL];
#pragma unroll
                for (int u = 0; u < GEMV_UNROLL; u++) {
                    const int i = base + 32 * S * u;
                    if (i < n) v[u] = ld_stream(w4 + i);
                    else v[u] = v4u{0u, 0u, 0u, 0u};
                }
                if (!waited) {
                    pdl_wait();
                    waited = true;
                }
#pragma unroll
                for (int u = 0; u < GEMV_UNROLL; u++) {
                    const int i = base + 32 * S * u;
                    if (i < n) {
#pragma unroll
                        for (int t = 0; t < NT; t++) {
                            if (t < tokens) {
                                const float d = dot8(v[u], x + (i64)t * cols + 8 * i);
                                if (u & 1) acc1[t] += d;
                                else acc0[t] += d;
                            }
                        }
                    }
                }
            }
        } else {
            pdl_wait();
            waited = true;
            for (int c = part * 32 + lane; c < cols; c += 32 * S) {
                const float wv = bf16_to_f32(wr[c]);
#pragma unroll
                for (int t = 0; t < NT; t++)
                    if (t < tokens) acc0[t] += wv * x[(i64)t * cols + c];
            }
        }
    }
    if (!waited) pdl_wait();
#pragma unroll
    for (int t = 0; t < NT; t++) {
        const float acc = warp_sum(acc0[t] + acc1[t]);
        if (S == 1) {
            if (live && lane == 0 && t < tokens) out[(i64)t * rows + row] = acc;
        } else if (lane == 0) {
            partial[warp][t] = acc;
        }
    }
    if (S > 1) {
        __syncthreads();
        if (live && part == 0 && lane < NT && lane < tokens) {
            float sum = partial[warp][lane];
#pragma unroll
            for (int k = 1; k < S; k++) sum += partial[warp + k][lane];
            out[(i64)lane * rows + row] = sum;
        }
    }
}

// One token: grid ceil(rows / (GEMV_WARPS / S)), block GEMV_WARPS * 32.
#define GEMV_ONE(S)                                                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                            \
        gemv_bf16_s##S(const bf16_t* w, const float* x, float* out,   \
                       int rows, int cols) {                                                                 \
        gemv_rows_body<1, S>(w, x, out, rows, cols, 1, blockIdx.x);                                          \
    }
// A decode batch, batch-invariant: grid (ceil(rows / (GEMV_WARPS / S)), ceil(tokens / GEMV_NT)).
#define GEMV_NT 4
#define GEMV_ROWS(S)                                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                            \
        gemv_bf16_rows_s##S(const bf16_t* w, const float* x,                       \
                            float* out, int rows, int cols, int tokens) {                       \
        const int t0 = blockIdx.y * GEMV_NT;                                                                 \
        gemv_rows_body<GEMV_NT, S>(w, x + (i64)t0 * cols, out + (i64)t0 * rows, rows, cols,                  \
                                   imin(GEMV_NT, tokens - t0), blockIdx.x);                                  \
    }
GEMV_ONE(1)
GEMV_ONE(2)
GEMV_ONE(4)
GEMV_ONE(8)
GEMV_ROWS(1)
GEMV_ROWS(2)
GEMV_ROWS(4)
GEMV_ROWS(8)

// Several weights that read the same x (a layer's input projections) in one launch: segment j
// owns blocks [block_end[j-1], block_end[j]) along x; unused segments end at the total. Each
// segment's rows are computed exactly as gemv_rows_body computes them, for any batch.
#define GEMV_MAX_SEGS 4
struct GemvSegs {
    unsigned long long w[GEMV_MAX_SEGS];
    unsigned long long out[GEMV_MAX_SEGS];
    int rows[GEMV_MAX_SEGS];
    int block_end[GEMV_MAX_SEGS];
};
template <int NT, int S>
__device__ __forceinline__ void gemv_multi_body(const GemvSegs& segs, const float* x, int cols,
                                                int tokens) {
    int seg = 0;
    while (seg < GEMV_MAX_SEGS - 1 && (int)blockIdx.x >= segs.block_end[seg]) seg++;
    const int blk = blockIdx.x - (seg ? segs.block_end[seg - 1] : 0);
    const int t0 = blockIdx.y * NT;
    const int rows = segs.rows[seg];
    gemv_rows_body<NT, S>(reinterpret_cast<const bf16_t*>(segs.w[seg]), x + (i64)t0 * cols,
                          reinterpret_cast<float*>(segs.out[seg]) + (i64)t0 * rows, rows, cols,
                          imin(NT, tokens - t0), blk);
}
// grid (total blocks, ceil(tokens / NT)); NT = 1 for one token, GEMV_NT for a batch (a token's
// arithmetic is the same either way).
#define GEMV_MULTI(S)                                                                                        \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                            \
        gemv_multi_s##S(GemvSegs segs, const float* x, int cols, int tokens) {                  \
        gemv_multi_body<1, S>(segs, x, cols, tokens);                                                        \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                            \
        gemv_multi_rows_s##S(GemvSegs segs, const float* x, int cols, int tokens) {             \
        gemv_multi_body<GEMV_NT, S>(segs, x, cols, tokens);                                                  \
    }
GEMV_MULTI(1)
GEMV_MULTI(2)
GEMV_MULTI(4)
GEMV_MULTI(8)

// grid (ceil(rows / 16), ceil(tokens / 16)), block (16, 16).
extern "C" __global__ void gemm_bf16_tiled(const bf16_t* w, const float* x,
                                           float* out, int tokens, int rows, int cols) {
    pdl_enter();
    __shared__ float xs[16][17];
    __shared__ float ws[16][17];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int t = blockIdx.y * 16 + ty;   // this thread's output token
    const int r = blockIdx.x * 16 + tx;   // this thread's output row (weight row)
    const int wrow = blockIdx.x * 16 + ty; // the weight row this thread loads
    float acc = 0.f;
    for (int k0 = 0; k0 < cols; k0 += 16) {
        const int k = k0 + tx;
        xs[ty][tx] = (t < tokens && k < cols) ? x[(i64)t * cols + k] : 0.f;
        ws[ty][tx] = (wrow < rows && k < cols) ? bf16_to_f32(w[(i64)wrow * cols + k]) : 0.f;
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < 16; kk++) acc = fmaf(xs[ty][kk], ws[tx][kk], acc);
        __syncthreads();
    }
    if (t < tokens && r < rows) out[(i64)t * rows + r] = acc;
}
