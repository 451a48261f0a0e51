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
// row computes the same whether it is alone or in a batch.
//
// A block takes G query heads of one kv group (G = 4, 2 or 1, dividing the group), so each K/V
// row it streams serves all of them: the cache is read once per kv head, not once per query
// head (Qwen3.5's four query heads per kv head used to read every row four times). Inside a
// block each warp runs an online softmax over a strided share of the range, ATT_KB keys per
// step with all their K and V loads issued before any is used, and the warps are merged in
// shared memory. Each lane holds ATT_EPL elements of a head: dims e * 32 + lane of an f32 row
// (coalesced 4-byte loads), dims lane * 8 + e of a bf16 row (one 16-byte load).
// Dynamic shared memory: nwarps * G * head_dim floats. head_dim <= 32 * ATT_EPL.
#define ATT_EPL 8
#define ATT_KB 4
#define ATT_MAX_WARPS 8
#define ATT_MAX_G 4
#define ATT_SPLIT_KEYS 64
#define ATT_MAX_SPLITS 32

__device__ __forceinline__ int att_splits(int visible) {
    const int n = (visible + ATT_SPLIT_KEYS - 1) / ATT_SPLIT_KEYS;
    return n < 1 ? 1 : (n > ATT_MAX_SPLITS ? ATT_MAX_SPLITS : n);
}

// The head dimension element e of a lane holds.
__device__ __forceinline__ int att_dim(const float*, int lane, int e) { return e * 32 + lane; }
__device__ __forceinline__ int att_dim(const bf16_t*, int lane, int e) { return lane * ATT_EPL + e; }

// A lane's ATT_EPL elements of one cached row, widened to f32 (0 past the head).
__device__ __forceinline__ void att_load(const float* row, int lane, int hd, float* x) {
#pragma unroll
    for (int e = 0; e < ATT_EPL; e++) {
        const int d = e * 32 + lane;
        x[e] = d < hd ? row[d] : 0.f;
    }
}
__device__ __forceinline__ void att_load(const bf16_t* row, int lane, int hd, float* x) {
    const int d0 = lane * ATT_EPL;
    if ((hd & 7) == 0) {
        // Rows start on 16 bytes: kv_dim and the head offset are multiples of 8 elements.
        v4u u = {0u, 0u, 0u, 0u};
        if (d0 < hd) u = *reinterpret_cast<const v4u*>(row + d0);
        x[0] = bf16_lo(u.x);
        x[1] = bf16_hi(u.x);
        x[2] = bf16_lo(u.y);
        x[3] = bf16_hi(u.y);
        x[4] = bf16_lo(u.z);
        x[5] = bf16_hi(u.z);
        x[6] = bf16_lo(u.w);
        x[7] = bf16_hi(u.w);
    } else {
#pragma unroll
        for (int e = 0; e < ATT_EPL; e++) x[e] = d0 + e < hd ? bf16_to_f32(row[d0 + e]) : 0.f;
    }
}

// Keys [j_begin, j_end) of kv head `kh` for query heads h0.. h0 + G - 1 of one query row `qrow`
// (`[nh, hd]`); writes each head's (m, l, acc[hd]) to `part + g * part_stride` (m, l, then acc).
// An empty range writes l = 0.
template <typename T, int G>
__device__ __forceinline__ void attend_range(const float* qrow, const T* k_cache, const T* v_cache,
                                             int kv_dim, int hd, int h0, int j_begin, int j_end, float scale,
                                             float* part, i64 part_stride, float* warp_acc, float* warp_m,
                                             float* warp_l) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    float qv[G][ATT_EPL], acc[G][ATT_EPL], m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; g++) {
#pragma unroll
        for (int e = 0; e < ATT_EPL; e++) {
            const int d = att_dim(k_cache, lane, e);
            qv[g][e] = d < hd ? qrow[(h0 + g) * hd + d] * scale : 0.f;
            acc[g][e] = 0.f;
        }
        m[g] = NEG_INF;
        l[g] = 0.f;
    }
    for (int j0 = j_begin + warp * ATT_KB; j0 < j_end; j0 += nwarps * ATT_KB) {
        float kx[ATT_KB][ATT_EPL], vx[ATT_KB][ATT_EPL];
#pragma unroll
        for (int u = 0; u < ATT_KB; u++) {
            // Keys past the range read row j_begin (in bounds) and are masked below.
            const int j = j0 + u < j_end ? j0 + u : j_begin;
            att_load(k_cache + (i64)j * kv_dim, lane, hd, kx[u]);
            att_load(v_cache + (i64)j * kv_dim, lane, hd, vx[u]);
        }
#pragma unroll
        for (int g = 0; g < G; g++) {
            float sc[ATT_KB];
#pragma unroll
            for (int u = 0; u < ATT_KB; u++) {
                float s = 0.f;
#pragma unroll
                for (int e = 0; e < ATT_EPL; e++) s += qv[g][e] * kx[u][e];
                sc[u] = warp_sum(s);
            }
            float mx = m[g];
#pragma unroll
            for (int u = 0; u < ATT_KB; u++)
                if (j0 + u < j_end) mx = fmaxf(mx, sc[u]);
            const float corr = expf(m[g] - mx);  // 0 on the first step, where m = -inf
            l[g] *= corr;
#pragma unroll
            for (int e = 0; e < ATT_EPL; e++) acc[g][e] *= corr;
#pragma unroll
            for (int u = 0; u < ATT_KB; u++) {
                if (j0 + u < j_end) {
                    const float p = expf(sc[u] - mx);
                    l[g] += p;
#pragma unroll
                    for (int e = 0; e < ATT_EPL; e++) acc[g][e] += p * vx[u][e];
                }
            }
            m[g] = mx;
        }
    }
#pragma unroll
    for (int g = 0; g < G; g++) {
        if (lane == 0) {
            warp_m[warp * G + g] = m[g];
            warp_l[warp * G + g] = l[g];
        }
#pragma unroll
        for (int e = 0; e < ATT_EPL; e++) {
            const int d = att_dim(k_cache, lane, e);
            if (d < hd) warp_acc[(warp * G + g) * hd + d] = acc[g][e];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * hd; i += blockDim.x) {
        const int g = i / hd, d = i % hd;
        float mx = NEG_INF;
        for (int w = 0; w < nwarps; w++) mx = fmaxf(mx, warp_m[w * G + g]);
        float o = 0.f;
        for (int w = 0; w < nwarps; w++)
            // Warps that saw no key hold l = 0 and m = -inf; skip them rather than form inf - inf.
            if (warp_l[w * G + g] > 0.f) o += warp_acc[(w * G + g) * hd + d] * expf(warp_m[w * G + g] - mx);
        part[g * part_stride + 2 + d] = o;
    }
    if (threadIdx.x < G) {
        const int g = threadIdx.x;
        float mx = NEG_INF;
        for (int w = 0; w < nwarps; w++) mx = fmaxf(mx, warp_m[w * G + g]);
        float sum = 0.f;
        for (int w = 0; w < nwarps; w++)
            if (warp_l[w * G + g] > 0.f) sum += warp_l[w * G + g] * expf(warp_m[w * G + g] - mx);
        part[g * part_stride] = mx;
        part[g * part_stride + 1] = sum;
    }
}

// The key range of split s of a row that sees `visible` keys; false for a split past the row's
// own count (launched only because a recording launches every split a row can have), which
// writes nothing: the merge reads the row's own splits only.
__device__ __forceinline__ bool att_range(int visible, int s, int* begin, int* end) {
    const int n = att_splits(visible);
    const int chunk = (visible + n - 1) / n;
    *begin = s * chunk;
    *end = imin(visible, (s + 1) * chunk);
    return s < n;
}

// One block: query heads h0.. of kv head kh for query row `row`, which sees `visible` keys.
// grid (nkv * group / G, rows, splits); partial [rows, heads, splits, hd + 2].
template <typename T, int G>
__device__ __forceinline__ void attention_block(const float* q, const T* kc, const T* vc, float* partial,
                                                int row, int visible, int nh, int nkv, int hd, float scale) {
    extern __shared__ float warp_acc[];
    __shared__ float warp_m[ATT_MAX_WARPS * ATT_MAX_G];
    __shared__ float warp_l[ATT_MAX_WARPS * ATT_MAX_G];
    const int group = nh / nkv, blocks_per_kv = group / G;
    const int kh = blockIdx.x / blocks_per_kv;
    const int h0 = kh * group + (blockIdx.x % blocks_per_kv) * G;
    const int s = blockIdx.z;
    int begin, end;
    if (!att_range(visible, s, &begin, &end)) return;
    const i64 stride = (i64)gridDim.z * (hd + 2);
    float* part = partial + (((i64)row * nh + h0) * gridDim.z + s) * (hd + 2);
    attend_range<T, G>(q + (i64)row * nh * hd, kc + kh * hd, vc + kh * hd, nkv * hd, hd, h0, begin, end, scale, part,
                       stride, warp_acc, warp_m, warp_l);
}

// One sequence: query t (at position pos0 + t) sees cache rows 0..=pos0 + t.
#define ATT_SEQ(NAME, T, G)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256, 1) NAME(const float* q, const T* k_cache,              \
                                                           const T* v_cache, float* partial, int nh,       \
                                                           int nkv, int hd, int pos0, float scale) {       \
        pdl_enter();                                                                                        \
        const int t = blockIdx.y;                                                                           \
        attention_block<T, G>(q, k_cache, v_cache, partial, t, pos0 + t + 1, nh, nkv, hd, scale);           \
    }
// A decode batch: row i is the token of sequence i at positions[i], over its own caches.
#define ATT_BATCH(NAME, T, G)                                                                               \
    extern "C" __global__ void __launch_bounds__(256, 1) NAME(                                                 \
        const float* q, const unsigned long long* k_caches, const unsigned long long* v_caches,           \
        const u32* positions, float* partial, int nh, int nkv, int hd, float scale) {                       \
        pdl_enter();                                                                                        \
        const int i = blockIdx.y;                                                                           \
        attention_block<T, G>(q, reinterpret_cast<const T*>(k_caches[i]),                                   \
                              reinterpret_cast<const T*>(v_caches[i]), partial, i, (int)positions[i] + 1,  \
                              nh, nkv, hd, scale);                                                          \
    }
// Both forms for each cache type and query-head group size.
#define ATT_ALL(KIND, T, G)                                                                                  \
    ATT_SEQ(attention_partial_seq_##KIND##_g##G, T, G)                                                       \
    ATT_BATCH(attention_partial_batch_##KIND##_g##G, T, G)
ATT_ALL(f32, float, 1)
ATT_ALL(f32, float, 2)
ATT_ALL(f32, float, 4)
ATT_ALL(bf16, bf16_t, 1)
ATT_ALL(bf16, bf16_t, 2)
ATT_ALL(bf16, bf16_t, 4)

// Merges the splits of every (row, head) in split order and applies the sigmoid gate. A row
// reads its own att_splits(visible) splits (visible = positions[r] + 1 for a decode batch,
// pos0 + r + 1 for one sequence), with the m/l pairs staged in shared memory and the
// accumulator loads independent of each other. With xq (one row, head_dim a multiple of 32: the
// launcher checks) the row is also written quantized for the packed o_proj GEMV, a warp's 32
// values one group of quantize_x (quant.rs, "activations quantized by their producer").
// grid (heads, rows), block head_dim rounded up to a warp.
extern "C" __global__ void attention_combine(const float* partial, const float* gate, float* out,
                                             const u32* positions, int pos0, int nh, int hd, int splits,
                                             signed char* xq, float* xd, int* xs) {
    pdl_enter();
    __shared__ float sm[ATT_MAX_SPLITS], sl[ATT_MAX_SPLITS];
    const int h = blockIdx.x, r = blockIdx.y, d = threadIdx.x;
    const int visible = (positions ? (int)positions[r] : pos0 + r) + 1;
    const int n = imin(att_splits(visible), splits);
    const float* p = partial + ((i64)r * nh + h) * splits * (hd + 2);
    for (int s = threadIdx.x; s < n; s += blockDim.x) {
        sm[s] = p[s * (hd + 2)];
        sl[s] = p[s * (hd + 2) + 1];
    }
    __syncthreads();
    if (d >= hd) return;
    float mx = NEG_INF;
    for (int s = 0; s < n; s++)
        if (sl[s] > 0.f) mx = fmaxf(mx, sm[s]);
    float sum = 0.f, o = 0.f;
#pragma unroll 8
    for (int s = 0; s < n; s++) {
        // A split without keys holds l = 0 and acc = 0: it adds exactly nothing.
        const float f = sl[s] > 0.f ? expf(sm[s] - mx) : 0.f;
        sum += sl[s] * f;
        o += p[s * (hd + 2) + 2 + d] * f;
    }
    const i64 at = ((i64)r * nh + h) * hd + d;
    const float res = o / sum * sigmoid_f(gate[at]);
    out[at] = res;
    if (xq != nullptr) quantize_group32(res, threadIdx.x & 31, at / 32, xq, xd, xs);
}

// A value as a cache of element type T stores it: f32 as is, bf16 rounded to nearest even.
__device__ __forceinline__ void cache_store(float* dst, float x) { *dst = x; }
__device__ __forceinline__ void cache_store(bf16_t* dst, float x) { *dst = f32_to_bf16(x); }

// Writes row i of k and v ([batch, kv_dim]) into sequence i's caches at row positions[i].
template <typename T>
__device__ __forceinline__ void kv_scatter_row(const float* k, const float* v, const unsigned long long* k_caches,
                                               const unsigned long long* v_caches, const u32* positions,
                                               int kv_dim) {
    pdl_enter();
    const int i = blockIdx.x;
    T* kc = reinterpret_cast<T*>(k_caches[i]) + (i64)positions[i] * kv_dim;
    T* vc = reinterpret_cast<T*>(v_caches[i]) + (i64)positions[i] * kv_dim;
    for (int d = threadIdx.x; d < kv_dim; d += blockDim.x) {
        cache_store(kc + d, k[(i64)i * kv_dim + d]);
        cache_store(vc + d, v[(i64)i * kv_dim + d]);
    }
}
extern "C" __global__ void kv_scatter(const float* k, const float* v, const unsigned long long* k_caches,
                                      const unsigned long long* v_caches, const u32* positions, int kv_dim) {
    kv_scatter_row<float>(k, v, k_caches, v_caches, positions, kv_dim);
}
extern "C" __global__ void kv_scatter_bf16(const float* k, const float* v, const unsigned long long* k_caches,
                                           const unsigned long long* v_caches, const u32* positions, int kv_dim) {
    kv_scatter_row<bf16_t>(k, v, k_caches, v_caches, positions, kv_dim);
}

// n consecutive values of k and v into bf16 cache rows (a prompt's rows, from its first),
// rounded to nearest even.
extern "C" __global__ void kv_store_bf16(const float* k, const float* v, bf16_t* kc, bf16_t* vc, i64 n) {
    pdl_enter();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        kc[i] = f32_to_bf16(k[i]);
        vc[i] = f32_to_bf16(v[i]);
    }
}
