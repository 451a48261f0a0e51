// out = x · Wᵀ against bf16 weights, f32 activations and accumulation.
//  - gemv_mma_*: the decode GEMV on the tensor cores, one token or a batch alike, weights read
//    once for up to 64 tokens, bitwise batch-invariant (see its section below).
//  - gemv_bf16_s*: one token on CUDA cores (STRIX_CUDA_GEMV=simt). Memory-bound: 1 to 8 warps
//    per weight row, 16-byte streaming loads (8 bf16), GEMV_UNROLL of them in flight per lane
//    before the first FMA.
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

// Where a row's result goes: `out[t * rows + row]`.
struct OutStore {
    float* out;
    int rows;
    __device__ __forceinline__ void operator()(int t, i64 row, float v) const { out[(i64)t * rows + row] = v; }
};

// The body of every CUDA-core GEMV: rows of `w` (one per S warps) against NT tokens of `x`,
// each row's result handed to `store`.
template <int NT, int S, class Store>
__device__ __forceinline__ void gemv_core(const bf16_t* w, const float* x, Store store, int rows, int cols,
                                          int tokens, int blk) {
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
            if (live && lane == 0 && t < tokens) store(t, row, acc);
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
            store(lane, row, sum);
        }
    }
}

template <int NT, int S>
__device__ __forceinline__ void gemv_rows_body(const bf16_t* w, const float* x, float* out, int rows, int cols,
                                               int tokens, int blk) {
    gemv_core<NT, S>(w, x, OutStore{out, rows}, rows, cols, tokens, blk);
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
    // Selected with constant indices only: indexing the parameter struct by a variable copies
    // it to a local stack frame.
    unsigned long long w = segs.w[0], out = segs.out[0];
    int rows = segs.rows[0], first = 0;
#pragma unroll
    for (int k = 1; k < GEMV_MAX_SEGS; k++) {
        if ((int)blockIdx.x >= segs.block_end[k - 1]) {
            w = segs.w[k];
            out = segs.out[k];
            rows = segs.rows[k];
            first = segs.block_end[k - 1];
        }
    }
    const int t0 = blockIdx.y * NT;
    gemv_rows_body<NT, S>(reinterpret_cast<const bf16_t*>(w), x + (i64)t0 * cols,
                          reinterpret_cast<float*>(out) + (i64)t0 * rows, rows, cols, imin(NT, tokens - t0),
                          (int)blockIdx.x - first);
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

// The first half of a gated MLP for one token, act = silu(x·gateᵀ) * (x·upᵀ), in one launch:
// a block computes its gate rows, then the same rows of up, into shared memory (each row with
// the arithmetic gemv_multi_s* gives it for the pair, same S), then their SwiGLU as the swiglu
// kernel does, so the result is bitwise the fused GEMV followed by swiglu.
// grid ceil(rows / (GEMV_WARPS / S)), block GEMV_WARPS * 32.
struct SmemStore {
    float* sm;
    i64 first;
    __device__ __forceinline__ void operator()(int, i64 row, float v) const { sm[row - first] = v; }
};
#define GEMV_GLU(S)                                                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                            \
        gemv_glu_s##S(const bf16_t* gate, const bf16_t* up, const float* x, float* act, int rows, int cols) { \
        __shared__ float g[GEMV_WARPS / S], u[GEMV_WARPS / S];                                               \
        const i64 first = (i64)blockIdx.x * (GEMV_WARPS / S);                                                \
        gemv_core<1, S>(gate, x, SmemStore{g, first}, rows, cols, 1, blockIdx.x);                            \
        __syncthreads(); /* gemv_core's partial sums are reused */                                           \
        gemv_core<1, S>(up, x, SmemStore{u, first}, rows, cols, 1, blockIdx.x);                              \
        __syncthreads();                                                                                     \
        if (threadIdx.x < GEMV_WARPS / S && first + threadIdx.x < rows)                                      \
            act[first + threadIdx.x] = silu_f(g[threadIdx.x]) * u[threadIdx.x];                              \
    }
GEMV_GLU(1)
GEMV_GLU(2)
GEMV_GLU(4)
GEMV_GLU(8)

// ---- Tensor-core GEMV (one token or a decode batch) -------------------------------------------
// out[t, r] = sum_k W[r, k] x[t, k] with mma.sync m16n8k16 (bf16 in, f32 accumulate): the
// weights are the A operand (16 rows per tile), the tokens the N dimension (8 per n-tile,
// padded with zeros), and x enters as two bf16 halves, hi = bf16(x) and lo = bf16(x - hi), one
// mma each, so a product keeps ~16 of x's mantissa bits (the f32 tests' 1e-4 holds).
//
// Batch invariance: the columns of an mma are independent, so a token's outputs depend only on
// its own x and on the sequence of mmas its column went through. That sequence is fixed by the
// matrix shape alone: K is walked in steps of 32 columns (each thread owns 8 consecutive
// columns of a step, t*8 .. t*8+7: one 16-byte load per row, whose k-slots feed two mmas with
// the same slot -> column map for A and B), the S warps that share a row tile take the steps
// s = part, part + S, ... in increasing order, and the S partial sums are added in order
// part 0, 1, ..., S-1. S comes from the row count only (mma_split_log2 in matmul.rs).
// NT (n-tiles per warp), RT (row tiles per warp) and U (steps in flight) only decide which
// warp does which tile and how many loads are in flight, never a column's arithmetic: every
// batch size, the one-token call included, gives a token bitwise the same outputs.
#define MMA_WARPS 8

__device__ __forceinline__ void mma_bf16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two floats as bf16x2, round to nearest even: `a` in the low half (the lower k), `b` high.
__device__ __forceinline__ u32 pack_bf16x2(float a, float b) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
}

// x[c], x[c+1] as hi = bf16x2(x) and lo = bf16x2(x - hi).
__device__ __forceinline__ void split_pair(float a, float b, u32& hi, u32& lo) {
    hi = pack_bf16x2(a, b);
    lo = pack_bf16x2(a - bf16_lo(hi), b - bf16_hi(hi));
}

// Eight bf16 weights of `row` from column c0 (zeros past the matrix). AL: cols % 8 == 0, so a
// chunk is all in or all out and 16-byte aligned.
template <bool AL>
__device__ __forceinline__ v4u mma_load_w(const bf16_t* w, int row, int c0, int rows, int cols) {
    if (row >= rows || c0 >= cols) return v4u{0u, 0u, 0u, 0u};
    const bf16_t* p = w + (i64)row * cols + c0;
    if (AL) return ld_stream(reinterpret_cast<const v4u*>(p));
    u32 e[8];
#pragma unroll
    for (int i = 0; i < 8; i++) e[i] = c0 + i < cols ? (u32)p[i] : 0u;
    return v4u{e[0] | (e[1] << 16), e[2] | (e[3] << 16), e[4] | (e[5] << 16), e[6] | (e[7] << 16)};
}

// Eight activations of token `tok` from column c0, split into hi/lo bf16x2 pairs (zeros past
// the batch or the row).
template <bool AL>
__device__ __forceinline__ void mma_load_x(const float* x, int tok, int tokens, int c0, int cols, u32 (&hi)[4],
                                           u32 (&lo)[4]) {
    float v[8];
    if (tok < tokens && c0 < cols) {
        const float* p = x + (i64)tok * cols + c0;
        if (AL) {
            const v4f a = *reinterpret_cast<const v4f*>(p);
            const v4f b = *reinterpret_cast<const v4f*>(p + 4);
            v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) v[i] = c0 + i < cols ? p[i] : 0.f;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < 4; i++) split_pair(v[2 * i], v[2 * i + 1], hi[i], lo[i]);
}

// One block: MMA_WARPS warps; S = 1 << split_log2 warps per row group, MMA_WARPS / S groups,
// each group RT row tiles of 16 rows; NT n-tiles of 8 tokens from token 0 of `x`/`out`.
template <int NT, int RT, int U, bool AL>
__device__ __forceinline__ void mma_gemv_body(const bf16_t* w, const float* x, float* out, int rows, int cols,
                                              int tokens, int split_log2, int blk) {
    // U: k-steps in flight per row tile, 2 * U * RT 16-byte loads per lane.
    __shared__ float red[MMA_WARPS][32][4];
    pdl_launch_dependents();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int S = 1 << split_log2;
    const int part = warp & (S - 1);
    const int tile0 = (blk * (MMA_WARPS >> split_log2) + (warp >> split_log2)) * RT;
    const int nsteps = (cols + 31) >> 5;
    float acc[RT][NT][4];
#pragma unroll
    for (int r = 0; r < RT; r++)
#pragma unroll
        for (int j = 0; j < NT; j++) acc[r][j][0] = acc[r][j][1] = acc[r][j][2] = acc[r][j][3] = 0.f;
    bool waited = false;
    if (tile0 * 16 < rows) {
        for (int s0 = part; s0 < nsteps; s0 += S * U) {
            // The weights never depend on the previous kernel: the first loads go out before the wait.
            v4u wv[U][RT][2];
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int r = 0; r < RT; r++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int step = s0 + u * S;
                        wv[u][r][h] = step < nsteps
                                          ? mma_load_w<AL>(w, (tile0 + r) * 16 + g + 8 * h, step * 32 + t * 8, rows, cols)
                                          : v4u{0u, 0u, 0u, 0u};
                    }
            if (!waited) {
                pdl_wait();
                waited = true;
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int step = s0 + u * S;
                if (step >= nsteps) break;
                const int c0 = step * 32 + t * 8;
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    u32 hi[4], lo[4];
                    mma_load_x<AL>(x, j * 8 + g, tokens, c0, cols, hi, lo);
#pragma unroll
                    for (int r = 0; r < RT; r++) {
                        const v4u& a = wv[u][r][0];
                        const v4u& b = wv[u][r][1];
                        mma_bf16(acc[r][j], a.x, b.x, a.y, b.y, hi[0], hi[1]);
                        mma_bf16(acc[r][j], a.x, b.x, a.y, b.y, lo[0], lo[1]);
                        mma_bf16(acc[r][j], a.z, b.z, a.w, b.w, hi[2], hi[3]);
                        mma_bf16(acc[r][j], a.z, b.z, a.w, b.w, lo[2], lo[3]);
                    }
                }
            }
        }
    }
    if (!waited) pdl_wait();
    // C fragment: acc[.][.][0..1] row g, tokens 2t, 2t+1; [2..3] row g + 8, the same tokens.
#pragma unroll
    for (int r = 0; r < RT; r++)
#pragma unroll
        for (int j = 0; j < NT; j++) {
            if (S > 1) {
                if (part != 0) {
#pragma unroll
                    for (int e = 0; e < 4; e++) red[warp][lane][e] = acc[r][j][e];
                }
                __syncthreads();
                if (part == 0) {
                    for (int q = 1; q < S; q++)
#pragma unroll
                        for (int e = 0; e < 4; e++) acc[r][j][e] += red[warp + q][lane][e];
                }
                __syncthreads();
            }
            if (part == 0) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int row = (tile0 + r) * 16 + g + 8 * (e >> 1);
                    const int tok = j * 8 + 2 * t + (e & 1);
                    if (row < rows && tok < tokens) out[(i64)tok * rows + row] = acc[r][j][e];
                }
            }
        }
}

// grid (ceil(tokens / (8 NT)), row blocks), block MMA_WARPS * 32: the blocks that share weight
// rows are neighbours in launch order, so a second token group finds the rows in L2. MINB:
// blocks per SM the registers are held to.
#define MMA_GEMV(NT, RT, U, MINB, AL, SUFFIX)                                                               \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32, MINB)                                       \
        gemv_mma_n##NT##_r##RT##_u##U##SUFFIX(const bf16_t* w, const float* x, float* out, int rows,         \
                                              int cols, int tokens, int split_log2) {                       \
        const int t0 = blockIdx.x * (8 * NT);                                                                \
        mma_gemv_body<NT, RT, U, AL>(w, x + (i64)t0 * cols, out + (i64)t0 * rows, rows, cols, tokens - t0,      \
                                  split_log2, blockIdx.y);                                                  \
    }

// Several weights that read the same x (a layer's input projections) in one launch: segment j
// owns row blocks [block_end[j-1], block_end[j]) along y, each with its own split (the one its
// matrix gets alone, so a fused projection is bitwise the separate one); unused segments end at
// the total.
struct MmaSegs {
    unsigned long long w[GEMV_MAX_SEGS];
    unsigned long long out[GEMV_MAX_SEGS];
    int rows[GEMV_MAX_SEGS];
    int block_end[GEMV_MAX_SEGS];
    int split_log2[GEMV_MAX_SEGS];
};
// The segment's fields by an unrolled search: indexing the by-value struct with a run-time
// index would copy it to local memory.
#define MMA_MULTI(NT, RT, U, MINB)                                                                           \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32, MINB)                                       \
        gemv_mma_multi_n##NT##_r##RT##_u##U(MmaSegs segs, const float* x, int cols, int tokens) {            \
        const int by = blockIdx.y;                                                                           \
        unsigned long long w = segs.w[0], o = segs.out[0];                                                   \
        int rows = segs.rows[0], split = segs.split_log2[0], blk = by;                                       \
        _Pragma("unroll") for (int j = 1; j < GEMV_MAX_SEGS; j++) {                                          \
            if (by >= segs.block_end[j - 1]) {                                                               \
                w = segs.w[j], o = segs.out[j], rows = segs.rows[j], split = segs.split_log2[j];             \
                blk = by - segs.block_end[j - 1];                                                            \
            }                                                                                                \
        }                                                                                                    \
        const int t0 = blockIdx.x * (8 * NT);                                                                \
        mma_gemv_body<NT, RT, U, true>(reinterpret_cast<const bf16_t*>(w), x + (i64)t0 * cols,                  \
                                    reinterpret_cast<float*>(o) + (i64)t0 * rows, rows, cols, tokens - t0,   \
                                    split, blk);                                                            \
    }
// Configurations (NT, RT, U, MINB) the launcher picks from (MMA_CONFIGS in matmul.rs); the
// `_any` kernels (any width, unaligned rows) only with RT = 1.
MMA_GEMV(1, 1, 8, 1, false, _any)
MMA_GEMV(2, 1, 8, 1, false, _any)
MMA_GEMV(4, 1, 8, 1, false, _any)
MMA_GEMV(8, 1, 8, 1, false, _any)
#define MMA_ALIGNED(NT, RT, U, MINB)                                                                         \
    MMA_GEMV(NT, RT, U, MINB, true, )                                                                        \
    MMA_MULTI(NT, RT, U, MINB)
MMA_ALIGNED(1, 1, 8, 1)
MMA_ALIGNED(2, 1, 8, 1)
MMA_ALIGNED(4, 1, 8, 1)
MMA_ALIGNED(8, 1, 8, 1)
MMA_ALIGNED(1, 2, 4, 1)
MMA_ALIGNED(2, 2, 4, 1)
MMA_ALIGNED(4, 2, 4, 1)
MMA_ALIGNED(8, 2, 4, 1)
MMA_ALIGNED(1, 4, 2, 1)
MMA_ALIGNED(2, 4, 2, 1)
MMA_ALIGNED(4, 4, 2, 1)
// Fewer loads in flight per warp, registers held to 64 for four blocks (32 warps) per SM.
MMA_ALIGNED(1, 1, 4, 4)
MMA_ALIGNED(1, 2, 2, 4)
MMA_ALIGNED(1, 4, 1, 4)

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
