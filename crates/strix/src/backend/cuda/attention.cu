// Gated full attention: the prologue (q/gate split, per-head q/k RMSNorm, partial rotate-half
// RoPE) and causal GQA softmax attention over the KV cache with the sigmoid output gate.

// One block per (head, token), heads 0..nh-1 being query heads and nh..nh+nkv-1 key heads;
// blockDim.x = head_dim rounded up to a warp; dynamic shared memory head_dim floats.
extern "C" __global__ void attention_prologue(const float* q_and_gate, float* k,
                                              const float* q_norm, const float* k_norm,
                                              const float* inv_freq, float* q,
                                              float* gate, const u32* positions,
                                              int nh, int nkv, int hd, int rot, float eps) {
    pdl_enter();
    extern __shared__ float head[];
    __shared__ float scratch[32];
    const int hh = blockIdx.x, t = blockIdx.y, d = threadIdx.x;
    const bool is_q = hh < nh;
    float x = 0.f;
    float* dst;
    const float* w;
    if (is_q) {
        const float* src = q_and_gate + ((i64)t * nh + hh) * 2 * hd;
        if (d < hd) {
            x = src[d];
            gate[((i64)t * nh + hh) * hd + d] = src[hd + d];
        }
        dst = q + ((i64)t * nh + hh) * hd;
        w = q_norm;
    } else {
        dst = k + ((i64)t * nkv + (hh - nh)) * hd;
        if (d < hd) x = dst[d];
        w = k_norm;
    }
    const float ss = block_sum(x * x, scratch);
    const float s = 1.f / sqrtf(ss / (float)hd + eps);
    float y = d < hd ? x * s * (1.f + w[d]) : 0.f;
    if (d < hd) head[d] = y;
    __syncthreads();
    const int half = rot / 2;
    if (d < rot) {
        // The angle as the reference computes it: position times inv_freq, in f32.
        const float p = (float)positions[t];
        const int i = d < half ? d : d - half;
        const float ang = p * inv_freq[i];
        const float cs = cosf(ang), sn = sinf(ang);
        y = d < half ? head[d] * cs - head[d + half] * sn : head[d] * cs + head[d - half] * sn;
    }
    if (d < hd) dst[d] = y;
}

// Causal attention, split over the keys (flash-decoding): the `visible` keys of a query row are
// cut into att_splits(visible) ranges of equal length, each range is one block, and a second
// kernel merges the ranges' partial softmax results. The split depends on `visible` alone, so a
// row computes the same whether it is alone or in a batch. Inside a block, each warp runs an
// online softmax over a strided share of the range (ATT_KB keys per step, so their dot-product
// reductions overlap), and the warps are merged in shared memory.
// Dynamic shared memory: nwarps * head_dim floats. head_dim <= 32 * ATT_EPL.
#define ATT_EPL 8
#define ATT_KB 4
#define ATT_MAX_WARPS 32
#define ATT_SPLIT_KEYS 64
#define ATT_MAX_SPLITS 32

__device__ __forceinline__ int att_splits(int visible) {
    const int n = (visible + ATT_SPLIT_KEYS - 1) / ATT_SPLIT_KEYS;
    return n < 1 ? 1 : (n > ATT_MAX_SPLITS ? ATT_MAX_SPLITS : n);
}

// Keys [j_begin, j_end) of one head for one query row; writes the range's (m, l, acc[hd]) to
// `part` (hd + 2 floats: m, l, then acc). An empty range writes l = 0.
__device__ __forceinline__ void attend_range(const float* qh, const float* k_cache,
                                             const float* v_cache, int kv_dim, int hd, int j_begin,
                                             int j_end, float scale, float* part, float* warp_acc,
                                             float* warp_m, float* warp_l) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    float qv[ATT_EPL], acc[ATT_EPL];
#pragma unroll
    for (int e = 0; e < ATT_EPL; e++) {
        const int d = e * 32 + lane;
        qv[e] = d < hd ? qh[d] * scale : 0.f;
        acc[e] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    for (int j0 = j_begin + warp * ATT_KB; j0 < j_end; j0 += nwarps * ATT_KB) {
        float sc[ATT_KB];
#pragma unroll
        for (int u = 0; u < ATT_KB; u++) {
            const int j = j0 + u;
            float s = 0.f;
            if (j < j_end) {
                const float* kr = k_cache + (i64)j * kv_dim;
#pragma unroll
                for (int e = 0; e < ATT_EPL; e++) {
                    const int d = e * 32 + lane;
                    if (d < hd) s += qv[e] * kr[d];
                }
            }
            sc[u] = s;
        }
#pragma unroll
        for (int u = 0; u < ATT_KB; u++) sc[u] = warp_sum(sc[u]);
        float mx = m;
#pragma unroll
        for (int u = 0; u < ATT_KB; u++)
            if (j0 + u < j_end) mx = fmaxf(mx, sc[u]);
        const float corr = expf(m - mx);  // 0 on the first step, where m = -inf
        l *= corr;
#pragma unroll
        for (int e = 0; e < ATT_EPL; e++) acc[e] *= corr;
#pragma unroll
        for (int u = 0; u < ATT_KB; u++) {
            const int j = j0 + u;
            if (j < j_end) {
                const float p = expf(sc[u] - mx);
                l += p;
                const float* vr = v_cache + (i64)j * kv_dim;
#pragma unroll
                for (int e = 0; e < ATT_EPL; e++) {
                    const int d = e * 32 + lane;
                    if (d < hd) acc[e] += p * vr[d];
                }
            }
        }
        m = mx;
    }
    if (lane == 0) {
        warp_m[warp] = m;
        warp_l[warp] = l;
    }
#pragma unroll
    for (int e = 0; e < ATT_EPL; e++) {
        const int d = e * 32 + lane;
        if (d < hd) warp_acc[warp * hd + d] = acc[e];
    }
    __syncthreads();
    float mx = NEG_INF;
    for (int w = 0; w < nwarps; w++) mx = fmaxf(mx, warp_m[w]);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.f;
        for (int w = 0; w < nwarps; w++)
            // Warps that saw no key hold l = 0 and m = -inf; skip them rather than form inf - inf.
            if (warp_l[w] > 0.f) o += warp_acc[w * hd + d] * expf(warp_m[w] - mx);
        part[2 + d] = o;
    }
    if (threadIdx.x == 0) {
        float sum = 0.f;
        for (int w = 0; w < nwarps; w++)
            if (warp_l[w] > 0.f) sum += warp_l[w] * expf(warp_m[w] - mx);
        part[0] = mx;
        part[1] = sum;
    }
}

// The key range of split s of a row that sees `visible` keys.
__device__ __forceinline__ void att_range(int visible, int s, int* begin, int* end) {
    const int n = att_splits(visible);
    const int chunk = (visible + n - 1) / n;
    *begin = s < n ? s * chunk : visible;
    *end = s < n ? imin(visible, (s + 1) * chunk) : visible;
}

// One sequence: query t (at position pos0 + t) sees cache rows 0..=pos0 + t.
// grid (heads, tokens, splits), block ATT_WARPS * 32; partial [tokens, heads, splits, hd + 2].
extern "C" __global__ void __launch_bounds__(256) attention_partial_seq(
    const float* q, const float* k_cache, const float* v_cache,
    float* partial, int nh, int nkv, int hd, int pos0, float scale) {
    pdl_enter();
    extern __shared__ float warp_acc[];
    __shared__ float warp_m[ATT_MAX_WARPS];
    __shared__ float warp_l[ATT_MAX_WARPS];
    const int h = blockIdx.x, t = blockIdx.y, s = blockIdx.z;
    const int kh = h / (nh / nkv);
    int begin, end;
    att_range(pos0 + t + 1, s, &begin, &end);
    float* part = partial + (((i64)t * nh + h) * gridDim.z + s) * (hd + 2);
    attend_range(q + ((i64)t * nh + h) * hd, k_cache + kh * hd, v_cache + kh * hd, nkv * hd, hd, begin, end, scale,
                 part, warp_acc, warp_m, warp_l);
}

// A decode batch: row i is the token of sequence i at positions[i], over its own caches.
extern "C" __global__ void __launch_bounds__(256) attention_partial_batch(
    const float* q, const unsigned long long* k_caches,
    const unsigned long long* v_caches, const u32* positions, float* partial,
    int nh, int nkv, int hd, float scale) {
    pdl_enter();
    extern __shared__ float warp_acc[];
    __shared__ float warp_m[ATT_MAX_WARPS];
    __shared__ float warp_l[ATT_MAX_WARPS];
    const int h = blockIdx.x, i = blockIdx.y, s = blockIdx.z;
    const int kh = h / (nh / nkv);
    int begin, end;
    att_range((int)positions[i] + 1, s, &begin, &end);
    const float* kc = reinterpret_cast<const float*>(k_caches[i]);
    const float* vc = reinterpret_cast<const float*>(v_caches[i]);
    float* part = partial + (((i64)i * nh + h) * gridDim.z + s) * (hd + 2);
    attend_range(q + ((i64)i * nh + h) * hd, kc + kh * hd, vc + kh * hd, nkv * hd, hd, begin, end, scale, part,
                 warp_acc, warp_m, warp_l);
}

// Merges the splits of every (row, head) in split order and applies the sigmoid gate.
// grid (heads, rows), block head_dim rounded up to a warp.
extern "C" __global__ void attention_combine(const float* partial, const float* gate,
                                             float* out, int nh, int hd, int splits) {
    pdl_enter();
    const int h = blockIdx.x, r = blockIdx.y, d = threadIdx.x;
    if (d >= hd) return;
    const float* p = partial + ((i64)r * nh + h) * splits * (hd + 2);
    float mx = NEG_INF;
    for (int s = 0; s < splits; s++)
        if (p[s * (hd + 2) + 1] > 0.f) mx = fmaxf(mx, p[s * (hd + 2)]);
    float sum = 0.f, o = 0.f;
    for (int s = 0; s < splits; s++) {
        const float* ps = p + s * (hd + 2);
        if (ps[1] > 0.f) {
            const float f = expf(ps[0] - mx);
            sum += ps[1] * f;
            o += ps[2 + d] * f;
        }
    }
    const i64 at = ((i64)r * nh + h) * hd + d;
    out[at] = o / sum * sigmoid_f(gate[at]);
}

// Writes row i of k and v ([batch, kv_dim]) into sequence i's caches at row positions[i].
extern "C" __global__ void kv_scatter(const float* k, const float* v,
                                      const unsigned long long* k_caches,
                                      const unsigned long long* v_caches,
                                      const u32* positions, int kv_dim) {
    pdl_enter();
    const int i = blockIdx.x;
    float* kc = reinterpret_cast<float*>(k_caches[i]) + (i64)positions[i] * kv_dim;
    float* vc = reinterpret_cast<float*>(v_caches[i]) + (i64)positions[i] * kv_dim;
    for (int d = threadIdx.x; d < kv_dim; d += blockDim.x) {
        kc[d] = k[(i64)i * kv_dim + d];
        vc[d] = v[(i64)i * kv_dim + d];
    }
}
