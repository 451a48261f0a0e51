// A sparse MoE block's routed experts on the device (Qwen3_5MoeTopKRouter,
// Qwen3_5MoeExperts) and the shared expert's sigmoid gate; the expert kernels here take bf16
// experts (quant.cu's qmoe_* the packed ones, between moe_bucket and moe_combine):
//  - moe_route: per token, softmax of the router logits, the top k (ties to the lower id),
//    renormalised, written in ascending expert id (the order the reference sums them in); with
//    the shared expert's gate logits, one more pick per token after those: expert `experts`
//    (the shared expert's slot in the tables), weight sigmoid(logit), so the shared expert
//    runs in the same launches and is added last, as the reference adds it;
//  - a decode batch: moe_gate_up, per pick, the picked expert's gate and up rows and the
//    SwiGLU; moe_down_sum, each pick's down rows weighted and summed in pick order;
//  - a prompt: moe_bucket lists the picks by expert, and moe_mma_gate_up / moe_mma_down run
//    each picked expert once over all its picks on the tensor cores (its weights read once per
//    64 picks, not once per pick), then moe_combine sums each token's picks;
//  - add_sigmoid_gated: out += sigmoid(gate) * x per row.
// A decode batch's outputs are one warp's dot product over its own pick's inputs, the chunks of
// a row taken in increasing order from zero, and a prompt's are one column of a fixed sequence
// of mmas; a token's picks are summed in pick order. So a token's result is bitwise the same
// alone or in any decode batch, and in any prompt pass (decode and prompt differ in the last
// bits, as the dense model's decode GEMVs and prompt GEMMs do).
//
// The experts' weight pointers come by value (MoeTable, MoePair of prelude.cu): up to
// MOE_MAX_EXPERTS experts, which a recorded decode step keeps with its launches.
#define MOE_WARPS 8
#define MOE_ROUTE_WARPS 4
// 16-byte weight chunks a lane has in flight before its first FMA.
#define MOE_UNROLL 4

// Router probabilities a lane holds: experts lane, lane + 32, ... up to MOE_MAX_EXPERTS.
#define MOE_ROUTE_PER_LANE (MOE_MAX_EXPERTS / 32)

// A router order key as an unsigned integer that orders as the floats do: NaN (a broken model)
// below every probability, above a taken one (-2); every key above 0u.
__device__ __forceinline__ unsigned moe_key(float p) {
    const unsigned u = __float_as_uint(p != p ? -1.5f : p);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// grid ceil(tokens / MOE_ROUTE_WARPS), block MOE_ROUTE_WARPS * 32: a warp per token, its
// probabilities in registers. ids / weights: [tokens, k], or [tokens, k + 1] when
// shared_logits ([tokens], the shared expert's gate logits) is not null. Each of the k rounds
// is one warp max of the keys and one warp min of the ids holding it (the lower id wins a tie);
// pick r stays in lane r (so k <= 32; moe.rs's MAX_TOP_K is 16), and the lanes place their
// picks by rank at the end.
extern "C" __global__ void __launch_bounds__(MOE_ROUTE_WARPS * 32)
    moe_route(const float* logits, int tokens, int experts, int k, const float* shared_logits, int* ids,
              float* weights) {
    pdl_enter();
    const unsigned all = 0xffffffffu;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int t = blockIdx.x * MOE_ROUTE_WARPS + warp;
    if (t >= tokens) return;
    const float* row = logits + (i64)t * experts;
    float p[MOE_ROUTE_PER_LANE];
    float m = NEG_INF;
#pragma unroll
    for (int j = 0; j < MOE_ROUTE_PER_LANE; j++) {
        const int e = lane + 32 * j;
        p[j] = e < experts ? row[e] : NEG_INF;
        m = fmaxf(m, p[j]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(all, m, o));
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < MOE_ROUTE_PER_LANE; j++) {
        if (lane + 32 * j < experts) {
            p[j] = expf(p[j] - m);
            s += p[j];
        }
    }
    s = warp_sum(s);
    unsigned key[MOE_ROUTE_PER_LANE];
#pragma unroll
    for (int j = 0; j < MOE_ROUTE_PER_LANE; j++) {
        p[j] = p[j] / s;
        key[j] = lane + 32 * j < experts ? moe_key(p[j]) : 0u;
    }
    const unsigned taken = moe_key(-2.f);
    // The total in the order picked (largest first); lane r keeps pick r.
    float total = 0.f, mine_p = 0.f;
    int mine = 0;
    for (int r = 0; r < k; r++) {
        unsigned best = 0u;
        int at = experts;
#pragma unroll
        for (int j = 0; j < MOE_ROUTE_PER_LANE; j++)
            if (key[j] > best) best = key[j], at = lane + 32 * j;  // ascending id: a tie keeps the lower
        const unsigned top = __reduce_max_sync(all, best);
        const int id = __reduce_min_sync(all, best == top ? at : 0x7fffffff);
        float held = 0.f;
#pragma unroll
        for (int j = 0; j < MOE_ROUTE_PER_LANE; j++)
            if (lane + 32 * j == id) held = p[j], key[j] = taken;
        const float prob = __shfl_sync(all, held, id & 31);
        total += prob;
        if (lane == r) mine = id, mine_p = prob;
    }
    // The picks by ascending id: pick r's place is the number of picks with a lower id.
    int rank = 0;
    for (int r = 0; r < k; r++) rank += __shfl_sync(all, mine, r) < mine;
    const int stride = k + (shared_logits != nullptr);
    if (lane < k) {
        ids[(i64)t * stride + rank] = mine;
        weights[(i64)t * stride + rank] = mine_p / total;
    }
    if (shared_logits != nullptr && lane == 0) {
        ids[(i64)t * stride + k] = experts;
        weights[(i64)t * stride + k] = sigmoid_f(shared_logits[t]);
    }
}

// Σ_i w[i] * x[i] over one row of `n` bf16 weights, the row streamed once: per lane, chunks
// lane, lane + 32, ... of 8 weights in increasing order (single weights when n % 8 != 0),
// MOE_UNROLL chunks loaded at a time, then the warp's butterfly.
__device__ __forceinline__ float moe_row_dot(const bf16_t* w, const float* x, int n, int lane) {
    float acc = 0.f;
    if ((n & 7) == 0) {
        const v4u* w4 = reinterpret_cast<const v4u*>(w);
        const int chunks = n >> 3;
        for (int base = lane; base < chunks; base += 32 * MOE_UNROLL) {
            v4u v[MOE_UNROLL];
#pragma unroll
            for (int u = 0; u < MOE_UNROLL; u++) {
                const int i = base + 32 * u;
                v[u] = i < chunks ? ld_stream(w4 + i) : v4u{0u, 0u, 0u, 0u};
            }
#pragma unroll
            for (int u = 0; u < MOE_UNROLL; u++) {
                const int i = base + 32 * u;
                if (i < chunks) acc += dot8(v[u], x + 8 * i);
            }
        }
    } else {
        for (int c = lane; c < n; c += 32) acc = fmaf(bf16_to_f32(w[c]), x[c], acc);
    }
    return warp_sum(acc);
}

// grid (ceil(inter / MOE_WARPS), tokens * k), block MOE_WARPS * 32: warp w of block (rb, pick)
// writes act[pick][rb * MOE_WARPS + w] = silu(gate · x) * (up · x) for the pick's expert and
// token (pick / k). x: [tokens, hidden]; act: [tokens * k, inter].
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    moe_gate_up(const __grid_constant__ MoePair gate_up, const float* x, const int* ids, int k, int inter,
                int hidden, float* act) {
    pdl_enter();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int pick = blockIdx.y, row = blockIdx.x * MOE_WARPS + warp;
    if (row >= inter) return;
    const int e = ids[pick];
    const float* xr = x + (i64)(pick / k) * hidden;
    const float g = moe_row_dot(reinterpret_cast<const bf16_t*>(gate_up.a[e]) + (i64)row * hidden, xr, hidden, lane);
    const float u = moe_row_dot(reinterpret_cast<const bf16_t*>(gate_up.b[e]) + (i64)row * hidden, xr, hidden, lane);
    if (lane == 0) act[(i64)pick * inter + row] = silu_f(g) * u;
}

// grid (ceil(hidden / MOE_WARPS), tokens), block MOE_WARPS * 32: warp w of block (cb, t) writes
// out[t][c], c = cb * MOE_WARPS + w, = Σ over the token's picks in order (ascending expert id),
// from zero, of weight * (down_e[c] · act[pick]), as the reference's index_add_ adds them.
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    moe_down_sum(const __grid_constant__ MoeTable down, const float* act, const int* ids, const float* weights,
                 int k, int inter, int hidden, float* out) {
    pdl_enter();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int t = blockIdx.y, c = blockIdx.x * MOE_WARPS + warp;
    if (c >= hidden) return;
    float sum = 0.f;
    for (int r = 0; r < k; r++) {
        const i64 pick = (i64)t * k + r;
        const bf16_t* w = reinterpret_cast<const bf16_t*>(down.w[ids[pick]]) + (i64)c * inter;
        const float y = moe_row_dot(w, act + pick * inter, inter, lane);
        sum = __fadd_rn(sum, __fmul_rn(y, weights[pick]));
    }
    if (lane == 0) out[(i64)t * hidden + c] = sum;
}

// The picks of a batch listed by expert: the `*active_count` experts picked, ascending, in
// active[0 ..], the picks of active[j] (ids / k: their token) in members[start[j] .. start[j +
// 1]]. grid 1, block 1024.
extern "C" __global__ void __launch_bounds__(1024)
    moe_bucket(const int* ids, int picks, int experts, int* active_count, int* active, int* start, int* members) {
    __shared__ int count[MOE_MAX_EXPERTS], next[MOE_MAX_EXPERTS];
    pdl_enter();
    for (int e = threadIdx.x; e < experts; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < picks; p += blockDim.x) atomicAdd(&count[ids[p]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int n = 0, at = 0;
        for (int e = 0; e < experts; e++) {
            next[e] = at;
            if (count[e] > 0) active[n] = e, start[n] = at, n++;
            at += count[e];
        }
        start[n] = at;
        *active_count = n;
    }
    __syncthreads();
    // Any order within an expert: each pick's outputs go to its own rows.
    for (int p = threadIdx.x; p < picks; p += blockDim.x) members[atomicAdd(&next[ids[p]], 1)] = p;
}

// ---- A prompt's bf16 experts on the tensor cores ----
// Each picked expert runs once over its picks (the listing of moe_bucket): a warp owns one
// 16-row tile of the expert's matrix (the mma's A operand, read once per MOE_MMA_PICKS picks)
// and the picks are the N dimension, 8 per n-tile, as the dense decode GEMV (matmul.cu) takes
// its tokens: x enters as hi and lo bf16 halves, K is walked in steps of 32 columns in
// increasing order, each thread's 8 consecutive columns feeding two mmas. A pick's column goes
// through the same mmas whichever picks share its tiles, so a token's result does not depend on
// the rest of the pass (though it differs in the last bits from the per-pick CUDA-core kernels
// of a decode batch, as the dense prompt GEMMs differ from the decode GEMVs).
#define MOE_MMA_NT 8
#define MOE_MMA_PICKS (8 * MOE_MMA_NT)
// k-steps of weights in flight per warp.
#define MOE_MMA_U 4

// acc[m][j] += W_m[row0 .. row0 + 16) · x over K = cols for the NM matrices `w` (rows x cols
// each) sharing the inputs; this lane's column of n-tile j reads the row xr[j] (null: a zero
// column). Only the first `ntiles` n-tiles are computed.
template <int NM, bool AL>
__device__ __forceinline__ void moe_mma_tile(const bf16_t* const (&w)[NM], int rows, int cols, int row0,
                                             const float* const (&xr)[MOE_MMA_NT], int ntiles,
                                             float (&acc)[NM][MOE_MMA_NT][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int nsteps = (cols + 31) >> 5;
    for (int s0 = 0; s0 < nsteps; s0 += MOE_MMA_U) {
        v4u wv[MOE_MMA_U][NM][2];
#pragma unroll
        for (int u = 0; u < MOE_MMA_U; u++)
#pragma unroll
            for (int m = 0; m < NM; m++)
#pragma unroll
                for (int h = 0; h < 2; h++)
                    wv[u][m][h] = s0 + u < nsteps ? mma_load_w<AL>(w[m], row0 + g + 8 * h, (s0 + u) * 32 + t * 8, rows, cols)
                                                  : v4u{0u, 0u, 0u, 0u};
#pragma unroll
        for (int u = 0; u < MOE_MMA_U; u++) {
            if (s0 + u >= nsteps) break;
            const int c0 = (s0 + u) * 32 + t * 8;
#pragma unroll
            for (int j = 0; j < MOE_MMA_NT; j++) {
                if (j >= ntiles) break;
                u32 hi[4], lo[4];
                mma_load_x<AL>(xr[j], 0, xr[j] != nullptr, c0, cols, hi, lo);
#pragma unroll
                for (int m = 0; m < NM; m++) mma_step_hi_lo(acc[m][j], wv[u][m][0], wv[u][m][1], hi, lo);
            }
        }
    }
}

// The picks [begin, end) of an expert's listing through the 16-row tile at row0 of its NM
// matrices `w` (rows x cols each), MOE_MMA_PICKS at a time: pick p's input is the row
// in + (members[p] / div) * cols, and store(members[p], row, sums) gets each output's NM sums.
template <int NM, bool AL, class Store>
__device__ __forceinline__ void moe_mma_picks(const bf16_t* const (&w)[NM], int rows, int cols, int row0,
                                              const float* in, int div, const int* members, int begin, int end,
                                              Store store) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int p0 = begin; p0 < end; p0 += MOE_MMA_PICKS) {
        const int n = imin(MOE_MMA_PICKS, end - p0);
        const float* xr[MOE_MMA_NT];
#pragma unroll
        for (int q = 0; q < MOE_MMA_NT; q++)
            xr[q] = 8 * q + g < n ? in + (i64)(members[p0 + 8 * q + g] / div) * cols : nullptr;
        float acc[NM][MOE_MMA_NT][4] = {};
        moe_mma_tile<NM, AL>(w, rows, cols, row0, xr, (n + 7) >> 3, acc);
        // C fragment: acc[.][q][0..1] rows row0 + g, picks 8q + 2t, + 1; [2..3] row0 + g + 8.
#pragma unroll
        for (int q = 0; q < MOE_MMA_NT; q++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int row = row0 + g + 8 * (c >> 1), pick = 8 * q + 2 * t + (c & 1);
                float sums[NM];
#pragma unroll
                for (int m = 0; m < NM; m++) sums[m] = acc[m][q][c];
                if (row < rows && pick < n) store(members[p0 + pick], row, sums);
            }
    }
}

// grid (ceil(inter / (16 MOE_WARPS)), min(picks, experts)), block MOE_WARPS * 32: block (rb, j)
// takes the j-th active expert (none past *active_count), its warp w the rows
// (rb * MOE_WARPS + w) * 16 .. + 16, and writes act[pick][row] = silu(gate · x) * (up · x) for
// every pick of that expert (x: the pick's token's row). AL: hidden % 8 == 0.
template <bool AL>
__device__ __forceinline__ void moe_mma_gate_up(const MoePair& gate_up, const float* x, int k, int inter, int hidden,
                                                const MoeListing& l, float* act) {
    pdl_enter();
    const int j = blockIdx.y, row0 = (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5)) * 16;
    if (j >= *l.active_count || row0 >= inter) return;
    const int e = l.active[j];
    const bf16_t* const w[2] = {reinterpret_cast<const bf16_t*>(gate_up.a[e]),
                                reinterpret_cast<const bf16_t*>(gate_up.b[e])};
    moe_mma_picks<2, AL>(w, inter, hidden, row0, x, k, l.members, l.start[j], l.start[j + 1],
                         [&](int pick, int row, const float(&v)[2]) {
                             act[(i64)pick * inter + row] = silu_f(v[0]) * v[1];
                         });
}

// grid (ceil(hidden / (16 MOE_WARPS)), min(picks, experts)), block MOE_WARPS * 32: y[pick][c] =
// down_e[c] · act[pick] for every pick of the j-th active expert e, rows as moe_mma_gate_up
// takes them. AL: inter % 8 == 0.
template <bool AL>
__device__ __forceinline__ void moe_mma_down(const MoeTable& down, const float* act, int inter, int hidden,
                                             const MoeListing& l, float* y) {
    pdl_enter();
    const int j = blockIdx.y, row0 = (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5)) * 16;
    if (j >= *l.active_count || row0 >= hidden) return;
    const bf16_t* const w[1] = {reinterpret_cast<const bf16_t*>(down.w[l.active[j]])};
    moe_mma_picks<1, AL>(w, hidden, inter, row0, act, 1, l.members, l.start[j], l.start[j + 1],
                         [&](int pick, int row, const float(&v)[1]) { y[(i64)pick * hidden + row] = v[0]; });
}

#define MOE_MMA_KERNELS(AL, SUFFIX)                                                                          \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32, 1) moe_mma_gate_up##SUFFIX(                 \
        const __grid_constant__ MoePair gate_up, const float* x, int k, int inter, int hidden,               \
        const MoeListing l, float* act) {                                                                    \
        moe_mma_gate_up<AL>(gate_up, x, k, inter, hidden, l, act);                                           \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32, 1) moe_mma_down##SUFFIX(                    \
        const __grid_constant__ MoeTable down, const float* act, int inter, int hidden, const MoeListing l,   \
        float* y) {                                                                                          \
        moe_mma_down<AL>(down, act, inter, hidden, l, y);                                                    \
    }
MOE_MMA_KERNELS(true, _al)
MOE_MMA_KERNELS(false, _any)

// out[t][c] = Σ over the token's picks in order, from zero, of weight * y[pick][c]: the sum
// moe_down_sum makes. Grid-stride over tokens * hidden.
extern "C" __global__ void moe_combine(const float* y, const float* weights, int k, int tokens, int hidden, float* out) {
    pdl_enter();
    const i64 n = (i64)tokens * hidden;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 t = i / hidden, c = i % hidden;
        float sum = 0.f;
        for (int r = 0; r < k; r++) {
            const i64 pick = t * k + r;
            sum = __fadd_rn(sum, __fmul_rn(y[pick * hidden + c], weights[pick]));
        }
        out[i] = sum;
    }
}

// out[r][i] += sigmoid(gate[r]) * x[r][i] for rows of `dim`; grid-stride over rows * dim.
extern "C" __global__ void add_sigmoid_gated(float* out, const float* x, const float* gate, int rows, int dim) {
    pdl_enter();
    const i64 n = (i64)rows * dim;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = __fadd_rn(out[i], __fmul_rn(sigmoid_f(gate[i / dim]), x[i]));
}
