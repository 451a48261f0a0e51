// A sparse MoE block's routed experts on the device (Qwen3_5MoeTopKRouter,
// Qwen3_5MoeExperts) and the shared expert's sigmoid gate; the expert kernels here take bf16
// experts (quant.cu's qmoe_* the packed ones, between moe_bucket and moe_combine):
//  - moe_route: per token, softmax of the router logits, the top k (ties to the lower id),
//    renormalised, written in ascending expert id (the order the reference sums them in);
//  - a decode batch: moe_gate_up, per pick, the picked expert's gate and up rows and the
//    SwiGLU; moe_down_sum, each pick's down rows weighted and summed in pick order;
//  - a prompt: moe_bucket lists the picks by expert, and moe_gate_up_grouped /
//    moe_down_grouped run each picked expert once over all its picks (its weights read once
//    per call, not once per pick), then moe_combine sums each token's picks;
//  - add_sigmoid_gated: out += sigmoid(gate) * x per row.
// Every output is one warp's dot product over its own pick's inputs, the chunks of a row taken
// in increasing order from zero whatever kernel runs it, and a token's picks summed in pick
// order, so a token's result is bitwise the same alone or in any batch.
//
// The experts' weight pointers come by value (MoeTable, MoePair of prelude.cu): up to
// MOE_MAX_EXPERTS experts, which a recorded decode step keeps with its launches.
#define MOE_MAX_K 16
#define MOE_WARPS 8
#define MOE_ROUTE_WARPS 4
// 16-byte weight chunks a lane has in flight before its first FMA.
#define MOE_UNROLL 4
// Picks of one expert a warp carries through a row at a time (grouped kernels).
#define MOE_GROUP 8

// A router order key: NaN (a broken model) below every probability, above a taken one (-2).
__device__ __forceinline__ float moe_key(float p) { return p != p ? -1.5f : p; }

// grid ceil(tokens / MOE_ROUTE_WARPS), block MOE_ROUTE_WARPS * 32 (a warp per token), dynamic
// shared memory MOE_ROUTE_WARPS * experts floats. ids / weights: [tokens, k].
extern "C" __global__ void __launch_bounds__(MOE_ROUTE_WARPS * 32)
    moe_route(const float* logits, int tokens, int experts, int k, int* ids, float* weights) {
    extern __shared__ float moe_probs[];
    pdl_enter();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int t = blockIdx.x * MOE_ROUTE_WARPS + warp;
    if (t >= tokens) return;
    float* p = moe_probs + warp * experts;
    const float* row = logits + (i64)t * experts;
    float m = NEG_INF;
    for (int e = lane; e < experts; e += 32) m = fmaxf(m, row[e]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float s = 0.f;
    for (int e = lane; e < experts; e += 32) {
        const float v = expf(row[e] - m);
        p[e] = v;
        s += v;
    }
    s = warp_sum(s);
    for (int e = lane; e < experts; e += 32) p[e] = p[e] / s;
    __syncwarp();
    int chosen[MOE_MAX_K];
    float prob[MOE_MAX_K];
    for (int r = 0; r < k; r++) {
        float best = -3.f;
        int at = experts;
        for (int e = lane; e < experts; e += 32) {
            const float v = moe_key(p[e]);
            if (v > best) best = v, at = e;  // ascending e: a tie keeps the lower id
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oa = __shfl_xor_sync(0xffffffffu, at, o);
            if (ob > best || (ob == best && oa < at)) best = ob, at = oa;
        }
        chosen[r] = at;
        prob[r] = p[at];
        __syncwarp();
        if (lane == 0) p[at] = -2.f;
        __syncwarp();
    }
    if (lane != 0) return;
    // The total in the order picked (largest first), then the picks by ascending id.
    float total = 0.f;
    for (int r = 0; r < k; r++) total += prob[r];
    for (int r = 1; r < k; r++) {
        const int e = chosen[r];
        const float v = prob[r];
        int j = r - 1;
        for (; j >= 0 && chosen[j] > e; j--) chosen[j + 1] = chosen[j], prob[j + 1] = prob[j];
        chosen[j + 1] = e, prob[j + 1] = v;
    }
    for (int r = 0; r < k; r++) {
        ids[(i64)t * k + r] = chosen[r];
        weights[(i64)t * k + r] = prob[r] / total;
    }
}

// Σ_i w[i] * x[i] over one row of `n` bf16 weights for up to MOE_GROUP inputs at once (xs[q],
// q < count), the row streamed once: per lane, chunks lane, lane + 32, ... of 8 weights in
// increasing order (single weights when n % 8 != 0), MOE_UNROLL chunks loaded at a time, then
// the warp's butterfly. An input's sum is the same sequence of operations whatever the other
// inputs and `count` are.
__device__ __forceinline__ void moe_row_dots(const bf16_t* w, const float* const (&xs)[MOE_GROUP], int count, int n,
                                             int lane, float (&out)[MOE_GROUP]) {
    float acc[MOE_GROUP];
#pragma unroll
    for (int q = 0; q < MOE_GROUP; q++) acc[q] = 0.f;
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
#pragma unroll
                for (int q = 0; q < MOE_GROUP; q++)
                    if (i < chunks && q < count) acc[q] += dot8(v[u], xs[q] + 8 * i);
            }
        }
    } else {
        for (int c = lane; c < n; c += 32) {
            const float wv = bf16_to_f32(w[c]);
#pragma unroll
            for (int q = 0; q < MOE_GROUP; q++)
                if (q < count) acc[q] = fmaf(wv, xs[q][c], acc[q]);
        }
    }
#pragma unroll
    for (int q = 0; q < MOE_GROUP; q++) out[q] = warp_sum(acc[q]);
}

// One input: the sum moe_row_dots gives it in any group.
__device__ __forceinline__ float moe_row_dot(const bf16_t* w, const float* x, int n, int lane) {
    const float* const xs[MOE_GROUP] = {x, x, x, x, x, x, x, x};
    float out[MOE_GROUP];
    moe_row_dots(w, xs, 1, n, lane, out);
    return out[0];
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

// grid (ceil(inter / MOE_WARPS), min(picks, experts)), block MOE_WARPS * 32: block (rb, j)
// takes the j-th active expert (none past *active_count); its warp w writes
// act[pick][rb * MOE_WARPS + w] for every pick of that expert, as moe_gate_up does.
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    moe_gate_up_grouped(const __grid_constant__ MoePair gate_up, const float* x, int k, int inter, int hidden,
                        const int* active_count, const int* active, const int* start, const int* members,
                        float* act) {
    pdl_enter();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int j = blockIdx.y, row = blockIdx.x * MOE_WARPS + warp;
    if (j >= *active_count || row >= inter) return;
    const int e = active[j], end = start[j + 1];
    const bf16_t* g = reinterpret_cast<const bf16_t*>(gate_up.a[e]) + (i64)row * hidden;
    const bf16_t* u = reinterpret_cast<const bf16_t*>(gate_up.b[e]) + (i64)row * hidden;
    for (int p0 = start[j]; p0 < end; p0 += MOE_GROUP) {
        const int count = imin(MOE_GROUP, end - p0);
        const float* xs[MOE_GROUP];
#pragma unroll
        for (int q = 0; q < MOE_GROUP; q++) xs[q] = x + (i64)(members[p0 + imin(q, count - 1)] / k) * hidden;
        float gs[MOE_GROUP], us[MOE_GROUP];
        moe_row_dots(g, xs, count, hidden, lane, gs);
        moe_row_dots(u, xs, count, hidden, lane, us);
#pragma unroll
        for (int q = 0; q < MOE_GROUP; q++)
            if (q < count && lane == 0) act[(i64)members[p0 + q] * inter + row] = silu_f(gs[q]) * us[q];
    }
}

// grid (ceil(hidden / MOE_WARPS), min(picks, experts)), block MOE_WARPS * 32: y[pick][c] =
// down_e[c] · act[pick] for every pick of the j-th active expert e.
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    moe_down_grouped(const __grid_constant__ MoeTable down, const float* act, int inter, int hidden,
                     const int* active_count, const int* active, const int* start, const int* members, float* y) {
    pdl_enter();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int j = blockIdx.y, c = blockIdx.x * MOE_WARPS + warp;
    if (j >= *active_count || c >= hidden) return;
    const int end = start[j + 1];
    const bf16_t* w = reinterpret_cast<const bf16_t*>(down.w[active[j]]) + (i64)c * inter;
    for (int p0 = start[j]; p0 < end; p0 += MOE_GROUP) {
        const int count = imin(MOE_GROUP, end - p0);
        const float* xs[MOE_GROUP];
#pragma unroll
        for (int q = 0; q < MOE_GROUP; q++) xs[q] = act + (i64)members[p0 + imin(q, count - 1)] * inter;
        float ys[MOE_GROUP];
        moe_row_dots(w, xs, count, inter, lane, ys);
#pragma unroll
        for (int q = 0; q < MOE_GROUP; q++)
            if (q < count && lane == 0) y[(i64)members[p0 + q] * hidden + c] = ys[q];
    }
}

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
