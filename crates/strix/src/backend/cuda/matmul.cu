// out = x · Wᵀ against bf16 weights, f32 activations and accumulation.
//  - gemv_wg_n* (sm_90a), gemv_gs_n*, gemv_mma_*: the decode GEMV on the tensor cores, one
//    token or a batch alike, weights read once for up to 64 tokens, bitwise batch-invariant;
//    the first two stream weight tiles through shared memory (see their sections below), the
//    last is the per-warp fallback.
//  - gemv_bf16_s*: one token on CUDA cores (STRIX_CUDA_GEMV=simt). Memory-bound: 1 to 8 warps
//    per weight row, 16-byte streaming loads (8 bf16), GEMV_UNROLL of them in flight per lane
//    before the first FMA.
//  - gemv_bf16_rows_s*: the same for a decode batch, bit for bit per token.
//  - gemm_bf16_tiled: the fallback for several tokens when cuBLAS is unavailable; a plain
//    16x16 shared-memory tiling, correct on any shape, not fast.

#define GEMV_UNROLL 8

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
                    for (int r = 0; r < RT; r++) mma_step_hi_lo(acc[r][j], wv[u][r][0], wv[u][r][1], hi, lo);
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

// ---- Streamed tensor-core GEMV (decode batches) -----------------------------------------------
// The batched decode product on the tensor cores with the weights streamed through shared
// memory: a block of 4 warps owns GS_BM = 128 weight rows, up to 64 tokens (NT n-tiles of 8)
// and a contiguous range of K. Weights and x go through a STAGES-deep ring of GS_BK-column
// stages by cp.async, so the next stages' bytes are in flight while the mmas of this one run
// (the per-warp kernel above loads into registers and waits for them before its mma chain,
// which left the loads and the mmas of an SM barely overlapping). x is staged as f32 and split
// into hi/lo bf16 at the fragment load, as there.
//
// Batch invariance: a token's outputs come from its own x column and a sequence of mmas and
// additions fixed by the matrix shape alone. K is walked in 32-column steps in increasing order
// (thread t owns columns t*8 .. t*8+7 of a step, the slot -> column map of the per-warp kernel),
// hi then lo per k-half; the split of K into nsplit contiguous ranges of whole stages comes from
// the row count (gs_nsplit in matmul.rs), and the ranges' partial sums are added in range
// order 0, 1, ..., nsplit-1 by the block that finishes its row block last. NT, the warp layout
// and the ring depth decide only which warp computes what and when.
#define GS_BK 64
#define GS_THREADS 128
// Bytes of one weight row / one token's x within a stage.
#define GS_WROW (GS_BK * 2)
#define GS_XROW (GS_BK * 4)

template <int NT>
struct GsStage {
    static constexpr int W = GS_BM * GS_WROW;
    static constexpr int X = NT * 8 * GS_XROW;
    static constexpr int BYTES = W + X;
};

// Shared-memory layout, swizzled so that the fragment loads (8 lanes per phase: rows or tokens
// g and g+1 of one parity each, four 16-byte chunks) hit distinct banks: a weight row's chunk c
// sits at c ^ 4 when the row is odd, a token's x chunk c at c ^ 1 when the token is odd.
__device__ __forceinline__ int gs_wchunk(int row, int c) { return row * GS_WROW + ((c ^ ((row & 1) << 2)) << 4); }
__device__ __forceinline__ int gs_xchunk(int tok, int c) { return tok * GS_XROW + ((c ^ (tok & 1)) << 4); }

// The weights of K stage `kt` (columns kt * GS_BK ..) of rows row0 .. row0 + GS_BM into `slot`,
// zeros past the matrix, laid out for the warpgroup kernel (SW128: swz128) or the streamed one
// (gs_wchunk). AL: cols % 8 == 0 (16-byte chunks, copied asynchronously).
template <bool AL, bool SW128>
__device__ __forceinline__ void gs_load_w(unsigned char* slot, const bf16_t* w, int row0, int rows, int cols, int kt) {
#pragma unroll
    for (int i = 0; i < GS_BM * 8 / GS_THREADS; i++) {
        const int c = threadIdx.x + i * GS_THREADS;
        const int r = c >> 3, ch = c & 7;
        const int row = row0 + r, col = kt * GS_BK + ch * 8;
        unsigned char* dst = slot + (SW128 ? swz128(r, ch) : gs_wchunk(r, ch));
        const bool in = row < rows && col < cols;
        const bf16_t* src = w + (in ? (i64)row * cols + col : 0);
        if (AL) {
            cp_async16_zfill(dst, src, in);
        } else {
            u32 e[8];
#pragma unroll
            for (int k = 0; k < 8; k++) e[k] = in && col + k < cols ? (u32)src[k] : 0u;
            *reinterpret_cast<v4u*>(dst) =
                v4u{e[0] | (e[1] << 16), e[2] | (e[3] << 16), e[4] | (e[5] << 16), e[6] | (e[7] << 16)};
        }
    }
}

// x of K stage `kt` for tokens 0 .. NT * 8 (zeros past the batch or the row).
template <int NT, bool AL>
__device__ __forceinline__ void gs_load_x(unsigned char* slot, const float* x, int tokens, int cols, int kt) {
#pragma unroll
    for (int i = 0; i < NT * 8 * 16 / GS_THREADS; i++) {
        const int c = threadIdx.x + i * GS_THREADS;
        const int tok = c >> 4, ch = c & 15;
        const int col = kt * GS_BK + ch * 4;
        unsigned char* dst = slot + GsStage<NT>::W + gs_xchunk(tok, ch);
        const bool in = tok < tokens && col < cols;
        const float* src = x + (in ? (i64)tok * cols + col : 0);
        if (AL) {
            cp_async16_zfill(dst, src, in);
        } else {
            float e[4];
#pragma unroll
            for (int k = 0; k < 4; k++) e[k] = in && col + k < cols ? src[k] : 0.f;
            *reinterpret_cast<v4f*>(dst) = v4f{e[0], e[1], e[2], e[3]};
        }
    }
}

// The mmas of one stage: warp (wm, wn) takes row tiles wm * RT .. and n-tiles wn * NTW ...
template <int NT, int WM>
__device__ __forceinline__ void gs_compute(const unsigned char* slot, float (&acc)[GS_BM / 16 / WM][NT / (4 / WM)][4],
                                           int wm, int wn, int g, int t) {
    constexpr int RT = GS_BM / 16 / WM, NTW = NT / (4 / WM);
    const unsigned char* xs = slot + GsStage<NT>::W;
#pragma unroll
    for (int st = 0; st < GS_BK / 32; st++) {
        v4u a[RT][2];
#pragma unroll
        for (int r = 0; r < RT; r++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int row = (wm * RT + r) * 16 + g + 8 * h;
                a[r][h] = *reinterpret_cast<const v4u*>(slot + gs_wchunk(row, st * 4 + t));
            }
#pragma unroll
        for (int j = 0; j < NTW; j++) {
            const int tok = (wn * NTW + j) * 8 + g;
            const v4f p = *reinterpret_cast<const v4f*>(xs + gs_xchunk(tok, st * 8 + 2 * t));
            const v4f q = *reinterpret_cast<const v4f*>(xs + gs_xchunk(tok, st * 8 + 2 * t + 1));
            u32 hi[4], lo[4];
            split_pair(p.x, p.y, hi[0], lo[0]);
            split_pair(p.z, p.w, hi[1], lo[1]);
            split_pair(q.x, q.y, hi[2], lo[2]);
            split_pair(q.z, q.w, hi[3], lo[3]);
#pragma unroll
            for (int r = 0; r < RT; r++) mma_step_hi_lo(acc[r][j], a[r][0], a[r][1], hi, lo);
        }
    }
}

// Up to GEMV_MAX_SEGS weights that read the same x in one launch (one weight is one segment):
// segment j owns the units [unit_end[j-1], unit_end[j]) along x, a unit being (row block,
// K range), K ranges fastest; its split is the one its matrix gets alone, and its partial
// slots start at pslot0[j]. Unused segments end at the total.
struct GsSegs {
    unsigned long long w[GEMV_MAX_SEGS];
    unsigned long long out[GEMV_MAX_SEGS];
    int rows[GEMV_MAX_SEGS];
    int unit_end[GEMV_MAX_SEGS];
    int nsplit[GEMV_MAX_SEGS];
    int pslot0[GEMV_MAX_SEGS];
};

// The unit of the launch this block computes: its segment's weight, output and rows, its row
// block and K range, and its partial-sum slot.
struct GsUnit {
    const bf16_t* w;
    float* out;
    int rows, mblock, split, nsplit, pslot;
};
// Selected with constant indices only: indexing the by-value struct with a run-time index
// would copy it to local memory.
__device__ __forceinline__ GsUnit gs_unit(const GsSegs& segs) {
    const int u = blockIdx.x;
    unsigned long long w = segs.w[0], o = segs.out[0];
    int rows = segs.rows[0], nsplit = segs.nsplit[0], pslot0 = segs.pslot0[0], first = 0;
#pragma unroll
    for (int j = 1; j < GEMV_MAX_SEGS; j++) {
        if (u >= segs.unit_end[j - 1]) {
            w = segs.w[j], o = segs.out[j], rows = segs.rows[j], nsplit = segs.nsplit[j];
            pslot0 = segs.pslot0[j], first = segs.unit_end[j - 1];
        }
    }
    const int local = u - first;
    return GsUnit{reinterpret_cast<const bf16_t*>(w), reinterpret_cast<float*>(o), rows, local / nsplit,
                  local % nsplit, nsplit, pslot0 + local};
}

// One block: unit `u` (rows u.mblock * GS_BM .., K range u.split of u.nsplit), tokens 0 ..
// min(tokens, NT * 8); the sums go out through gs_finish.
template <int NT, int WM, int STAGES, bool AL>
__device__ __forceinline__ void gs_body(const GsUnit& u, const float* x, int cols, int tokens, float* partials,
                                        unsigned* counters) {
    constexpr int RT = GS_BM / 16 / WM, NTW = NT / (4 / WM), STAGE = GsStage<NT>::BYTES;
    extern __shared__ __align__(128) unsigned char gs_smem[];
    pdl_launch_dependents();
    const bf16_t* w = u.w;
    const int rows = u.rows, split = u.split, nsplit = u.nsplit;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int wm = warp % WM, wn = warp / WM;
    const int row0 = u.mblock * GS_BM;
    const int nk = (cols + GS_BK - 1) / GS_BK;
    const int kb = (int)((i64)nk * split / nsplit);
    const int n = (int)((i64)nk * (split + 1) / nsplit) - kb;
    float acc[RT][NTW][4];
#pragma unroll
    for (int r = 0; r < RT; r++)
#pragma unroll
        for (int j = 0; j < NTW; j++) acc[r][j][0] = acc[r][j][1] = acc[r][j][2] = acc[r][j][3] = 0.f;
    // The weights never depend on the previous kernel: the first stages' go out before the wait
    // (in the first commit group, with x's first stage).
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++)
        if (s < n) gs_load_w<AL, false>(gs_smem + s * STAGE, w, row0, rows, cols, kb + s);
    pdl_wait();
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < n) gs_load_x<NT, AL>(gs_smem + s * STAGE, x, tokens, cols, kb + s);
        cp_async_commit();
    }
    for (int i = 0; i < n; i++) {
        cp_async_wait<STAGES - 2>();
        // Stage i has landed for every thread, and every warp is done with stage i - 1's slot.
        __syncthreads();
        const int next = i + STAGES - 1;
        if (next < n) {
            unsigned char* slot = gs_smem + (next % STAGES) * STAGE;
            gs_load_w<AL, false>(slot, w, row0, rows, cols, kb + next);
            gs_load_x<NT, AL>(slot, x, tokens, cols, kb + next);
        }
        cp_async_commit();
        gs_compute<NT, WM>(gs_smem + (i % STAGES) * STAGE, acc, wm, wn, g, t);
    }
    cp_async_wait<0>();
    // C fragment: acc[r][j][0..1] row g, tokens 2t, 2t+1; [2..3] row g + 8, the same tokens.
    const auto at = [&](int k) {
        const int r = k / (NTW * 4), j = (k / 4) % NTW, e = k % 4;
        return make_int2((wm * RT + r) * 16 + g + 8 * (e >> 1), (wn * NTW + j) * 8 + 2 * t + (e & 1));
    };
    gs_finish(reinterpret_cast<const float(&)[RT * NTW * 4]>(acc), at, u, tokens, partials, counters);
}

// grid (units), block GS_THREADS, dynamic shared memory STAGES * GsStage<NT>::BYTES; x and the
// outputs start at the launch's first token, `tokens` <= NT * 8.
#define GS_GEMV(NT, WM, STAGES, AL, SUFFIX)                                                                  \
    extern "C" __global__ void __launch_bounds__(GS_THREADS, 2)                                              \
        gemv_gs_n##NT##SUFFIX(GsSegs segs, const float* x, int cols, int tokens, float* partials,            \
                              unsigned* counters) {                                                          \
        gs_body<NT, WM, STAGES, AL>(gs_unit(segs), x, cols, tokens, partials, counters);                     \
    }
// (n-tiles, warps along the rows, ring depth): the launcher's table (GS_CONFIGS in matmul.rs).
#define GS_CONFIG(NT, WM, STAGES)                                                                            \
    GS_GEMV(NT, WM, STAGES, true, )                                                                          \
    GS_GEMV(NT, WM, STAGES, false, _any)
GS_CONFIG(1, 4, 6)
GS_CONFIG(2, 4, 5)
GS_CONFIG(4, 2, 4)
GS_CONFIG(8, 2, 3)

// ---- Warpgroup tensor-core GEMV (decode batches, sm_90a) ---------------------------------------
// The batched decode product on Hopper's warpgroup MMA: `wgmma` m64nNk16 reads both operands
// from shared memory, so no warp stages fragments through its registers, and it runs
// asynchronously beside the copies of the next stages. A block (one warpgroup, 4 warps) owns
// WG_BM = 128 weight rows (two m64 tiles), N = 8, 16, 32 or 64 tokens (the fewest that hold
// the launch's batch; zero columns past it) and a contiguous range of K (the split of
// gs_nsplit, partial sums added in range order as in the streamed kernel above). x is split
// into hi/lo bf16 B tiles once per launch by wg_split_x; weights and those tiles go through a
// cp.async ring of stages.
//
// Shared-memory tiles are K-major with the 128-byte swizzle (rows of 64 bf16 = 128 bytes; the
// 16-byte chunk c of row r at c ^ (r % 8); 8-row groups 1024 bytes apart), the layout the
// wgmma descriptors below describe; the k16 steps of a stage advance the start address 32 bytes.
// wg_split_x writes x's tiles in that layout already, so they are copied as they are.
//
// Batch invariance: a column's outputs come from the same instruction sequence (k16 steps in
// order, hi then lo, then the K ranges in order) whatever N is; the columns of a wgmma are
// independent, so a token's outputs depend on its own column of B and the matrix shape alone
// (the tests check every batch against the one-token call bitwise).
#define WG_BM 128
#define WG_BK 64
#define WG_THREADS 128
#define WG_WTILE (WG_BM * WG_BK * 2)
// x's tile of NT tokens (one of hi, lo); a stage is the weight tile, then x's hi and lo tiles.
#define WG_XTILE(NT) ((NT) * WG_BK * 2)
#define WG_STAGE(NT) (WG_WTILE + 2 * WG_XTILE(NT))


// x [tokens, cols] (tokens <= nt, nt one of 8, 16, 32, 64) as the B tiles of nt tokens of
// every K stage: stage kt at kt * 2 * WG_XTILE(nt), its hi tile then its lo tile, zeros past the
// batch or the row. grid (stages), block WG_THREADS.
extern "C" __global__ void __launch_bounds__(WG_THREADS)
    wg_split_x(const float* x, int tokens, int nt, int cols, unsigned char* xs) {
    pdl_enter();
    const int kt = blockIdx.x;
    unsigned char* hi = xs + (i64)kt * 2 * WG_XTILE(nt);
    for (int c = threadIdx.x; c < nt * 16; c += WG_THREADS) {
        const int tok = c >> 4, q = c & 15, col = kt * WG_BK + q * 4;
        float e[4];
#pragma unroll
        for (int k = 0; k < 4; k++) e[k] = tok < tokens && col + k < cols ? x[(i64)tok * cols + col + k] : 0.f;
        u32 h0, l0, h1, l1;
        split_pair(e[0], e[1], h0, l0);
        split_pair(e[2], e[3], h1, l1);
        const int off = swz128(tok, q >> 1) + (q & 1) * 8;
        *reinterpret_cast<uint2*>(hi + off) = make_uint2(h0, h1);
        *reinterpret_cast<uint2*>(hi + WG_XTILE(nt) + off) = make_uint2(l0, l1);
    }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// x's hi and lo tiles of K stage `kt` (wg_split_x's layout) into the slot after its weights.
template <int NT>
__device__ __forceinline__ void wg_load_x(unsigned char* slot, const unsigned char* xs, int kt) {
    const unsigned char* src = xs + (i64)kt * 2 * WG_XTILE(NT);
#pragma unroll
    for (int i = 0; i < 2 * WG_XTILE(NT) / 16 / WG_THREADS; i++) {
        const int c = (threadIdx.x + i * WG_THREADS) * 16;
        cp_async16(slot + WG_WTILE + c, src + c);
    }
}
#endif

// One block: unit `u` (rows u.mblock * WG_BM .., K range u.split of u.nsplit), tokens 0 ..
// min(tokens, NT) from wg_split_x's tiles `xs`, a STAGES-deep ring; the sums go out through
// gs_finish.
template <int NT, int STAGES, bool AL>
__device__ __forceinline__ void wg_body(const GsUnit& u, const unsigned char* xs, int cols, int tokens,
                                        float* partials, unsigned* counters) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char wg_raw[];
    pdl_launch_dependents();
    const bf16_t* w = u.w;
    const int rows = u.rows, split = u.split, nsplit = u.nsplit;
    unsigned char* smem = reinterpret_cast<unsigned char*>(((unsigned long long)wg_raw + 1023) & ~1023ull);
    const u32 smem_a = (u32)__cvta_generic_to_shared(smem);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = u.mblock * WG_BM;
    const int nk = (cols + WG_BK - 1) / WG_BK;
    const int kb = (int)((i64)nk * split / nsplit);
    const int n = (int)((i64)nk * (split + 1) / nsplit) - kb;
    constexpr int NA = NT / 2, STAGE = WG_STAGE(NT);
    float acc[2][NA];
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int i = 0; i < NA; i++) acc[m][i] = 0.f;
    // The weights never depend on the previous kernel: the first stages' go out before the
    // wait (in the first commit group, with x's first stage).
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++)
        if (s < n) gs_load_w<AL, true>(smem + s * STAGE, w, row0, rows, cols, kb + s);
    pdl_wait();
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < n) wg_load_x<NT>(smem + s * STAGE, xs, kb + s);
        cp_async_commit();
    }
    for (int i = 0; i < n; i++) {
        cp_async_wait<STAGES - 2>();
        wg_proxy_fence();
        // Stage i's tiles are in place for the whole warpgroup.
        __syncthreads();
        const u32 wa = smem_a + (i % STAGES) * STAGE, xa = wa + WG_WTILE;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < WG_BK / 16; kk++) {
            const unsigned long long bh = wg_desc(xa + kk * 32), bl = wg_desc(xa + WG_XTILE(NT) + kk * 32);
#pragma unroll
            for (int m = 0; m < 2; m++) {
                const unsigned long long a = wg_desc(wa + m * (WG_WTILE / 2) + kk * 32);
                wg_mma<NT>(acc[m], a, bh);
                wg_mma<NT>(acc[m], a, bl);
            }
        }
        wg_commit();
        // Stage i - 1's MMAs are done in every warp: its slot takes stage i + STAGES - 1.
        wg_wait<1>();
        __syncthreads();
        const int next = i + STAGES - 1;
        if (next < n) {
            unsigned char* slot = smem + (next % STAGES) * STAGE;
            gs_load_w<AL, true>(slot, w, row0, rows, cols, kb + next);
            wg_load_x<NT>(slot, xs, kb + next);
        }
        cp_async_commit();
    }
    wg_wait<0>();
    cp_async_wait<0>();
    // Accumulator layout: acc[m][i] is row m * 64 + warp * 16 + lane / 4 + 8 * ((i / 2) % 2),
    // token 8 * (i / 4) + 2 * (lane % 4) + i % 2.
    const auto at = [&](int k) {
        const int m = k / NA, i = k % NA;
        return make_int2(m * 64 + warp * 16 + (lane >> 2) + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * (lane & 3) + (i & 1));
    };
    gs_finish(reinterpret_cast<const float(&)[2 * NA]>(acc), at, u, tokens, partials, counters);
#endif
}

// grid (units), block WG_THREADS, dynamic shared memory STAGES * WG_STAGE(NT) + 1 KB (to align
// the ring to the swizzle's 1 KB period); segments as gemv_gs_n*; `xs` from wg_split_x.
#define WG_GEMV(NT, STAGES, AL, SUFFIX)                                                                       \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 2)                                              \
        gemv_wg_n##NT##SUFFIX(GsSegs segs, const unsigned char* xs, int cols, int tokens, float* partials,   \
                              unsigned* counters) {                                                          \
        wg_body<NT, STAGES, AL>(gs_unit(segs), xs, cols, tokens, partials, counters);                        \
    }
// (tokens of the launch's N, ring depth): the launcher's table (WG_CONFIGS in matmul.rs).
#define WG_CONFIG(NT, STAGES)                                                                                \
    WG_GEMV(NT, STAGES, true, )                                                                              \
    WG_GEMV(NT, STAGES, false, _any)
WG_CONFIG(8, 5)
WG_CONFIG(16, 5)
WG_CONFIG(32, 4)
WG_CONFIG(64, 3)

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
