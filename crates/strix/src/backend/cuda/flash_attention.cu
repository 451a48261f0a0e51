// Causal GQA attention for prefill on the tensor cores (flash attention 2 with mma.sync):
// bf16 operands, f32 accumulation and an online softmax in f32 (exp2 domain).
//
// K and V are read as the bf16 cache holds them, [rows][kv_dim] (an f32 cache is first rounded
// into such a copy by kv_rows_to_bf16), in tiles of FA_KT keys streamed with 16-byte cp.async
// copies, double-buffered so the next tile streams in during the math; rows past the visible
// ones are zero-filled by the copy, never read. Both tiles are stored [key][dim] with rows
// padded by 8 bf16, so the K fragments' 32-bit loads and the V fragments' ldmatrix.trans (which
// turns [key][dim] into the B operand of P·V) hit 32 distinct banks.
//
// Block: FA_WARPS warps, each owning 16 query rows of one head. The block covers `hb` heads of
// one kv group (hb = 4, 2 or 1) and 16 * (FA_WARPS / hb) consecutive tokens, so all its warps
// share each K/V tile. grid (ceil(T / tokens per block), nkv * group / hb, splits): split s
// takes keys [s * split_keys, (s + 1) * split_keys). Blocks take their query tiles from the last
// (the most keys, causal) to the first, so the short ones fill the tail. One split: the block
// writes the gated
// output. Several: (m, l, acc) per row into `partial` [T, nh, splits, hd + 2], merged by
// flash_attention_combine (m in the exp2 domain; a row that saw no key writes l = 0).
#define FA_WARPS 4
#define FA_KT 32

// n values of each f32 cache from its first row, rounded to bf16 (nearest even) row-major.
extern "C" __global__ void kv_rows_to_bf16(const float* k_cache, const float* v_cache, bf16_t* kb, bf16_t* vb,
                                           i64 n) {
    pdl_enter();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        kb[i] = f32_to_bf16(k_cache[i]);
        vb[i] = f32_to_bf16(v_cache[i]);
    }
}

// cp_async16 that copies `bytes` (16 or 0) and zero-fills the rest of the 16.
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, int bytes) {
    const u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes) : "memory");
}

// B fragments of two neighbouring n-tiles (n0..n0+7 and n0+8..n0+15) by k0..k0+15 of a matrix
// stored [k][n] (row stride ld): ldmatrix.x4.trans, matrices (k0, n0), (k0+8, n0), (k0, n0+8),
// (k0+8, n0+8), so b[0..1] is the first tile's fragment and b[2..3] the second's.
__device__ __forceinline__ void load_b_frag_x2_trans(u32* b, const bf16_t* m, int ld, int n0, int k0) {
    const int lane = threadIdx.x & 31, mi = lane >> 3, r = lane & 7;
    const bf16_t* p = m + (k0 + (mi & 1) * 8 + r) * ld + n0 + (mi >> 1) * 8;
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                 : "r"(a));
}

template <int HD>
__device__ __forceinline__ void flash_body(const float* q, const bf16_t* kb, const bf16_t* vb,
                                           const float* gate, float* out, float* partial, int T, int nh,
                                           int nkv, int pos0, int hb, int split_keys, float scale_log2) {
    constexpr int LDQ = HD + 8;       // Qs / Ks / Vs row stride (bf16)
    constexpr int NT = FA_KT / 8;     // n tiles of S
    constexpr int OT = HD / 8;        // n tiles of O
    constexpr int KS = FA_KT * LDQ;   // one K or V buffer
    extern __shared__ __align__(16) unsigned char fa_smem[];
    bf16_t* Qs = reinterpret_cast<bf16_t*>(fa_smem);    // [FA_WARPS][16][LDQ]
    bf16_t* Ks = Qs + FA_WARPS * 16 * LDQ;                // 2 x [FA_KT][LDQ]
    bf16_t* Vs = Ks + 2 * KS;                             // 2 x [FA_KT][LDQ]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int group = nh / nkv;
    const int nhb = group / hb;
    const int kh = blockIdx.y / nhb;
    const int h = kh * group + (blockIdx.y % nhb) * hb + warp % hb;
    const int qt = 16 * (FA_WARPS / hb);  // tokens per block
    const int t0 = (gridDim.x - 1 - blockIdx.x) * qt;
    const int tw0 = t0 + 16 * (warp / hb);  // this warp's first token
    const int kv_dim = nkv * HD;
    const int splits = gridDim.z, s = blockIdx.z;

    // Keys this block may need: up to the last token it holds (causal), within its split.
    const int visible = pos0 + imin(T, t0 + qt);
    const int rows = pos0 + T;  // cache rows written
    const int begin = s * split_keys;
    const int end = imin(visible, begin + split_keys);

    // Streams keys kt0.. of this kv head into buffer b; rows from `visible` on (past the prompt,
    // perhaps past the cache) are zero-filled without a read.
    auto load_tile = [&](int b, int kt0) {
        bf16_t* kd = Ks + b * KS;
        bf16_t* vd = Vs + b * KS;
        for (int p = tid; p < FA_KT * (HD / 8); p += FA_WARPS * 32) {
            const int r = p / (HD / 8), x = p % (HD / 8);
            const int row = kt0 + r;
            const int bytes = row < rows ? 16 : 0;
            const i64 at = (i64)(row < rows ? row : 0) * kv_dim + kh * HD + 8 * x;
            cp_async16_zfill(kd + r * LDQ + 8 * x, kb + at, bytes);
            cp_async16_zfill(vd + r * LDQ + 8 * x, vb + at, bytes);
        }
        cp_async_commit();
    };
    if (begin < end) load_tile(0, begin);

    // This warp's 16 query rows, unscaled, as bf16.
    bf16_t* Qw = Qs + warp * 16 * LDQ;
    for (int p = lane; p < 16 * (HD / 4); p += 32) {
        const int r = p / (HD / 4), dq = p % (HD / 4);
        const int t = tw0 + r;
        v4f x = {0.f, 0.f, 0.f, 0.f};
        if (t < T) x = *reinterpret_cast<const v4f*>(q + ((i64)t * nh + h) * HD + 4 * dq);
        uint2 w;
        w.x = pack_bf16x2(x.x, x.y);
        w.y = pack_bf16x2(x.z, x.w);
        *reinterpret_cast<uint2*>(Qw + r * LDQ + 4 * dq) = w;
    }

    float o[OT][4];
#pragma unroll
    for (int i = 0; i < OT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
    const int row0 = tw0 + g, row1 = tw0 + g + 8;         // tokens of this thread's two rows
    const int lim0 = pos0 + row0, lim1 = pos0 + row1;    // last key each row sees
    const int warp_last = pos0 + imin(tw0 + 15, T - 1);  // last key any row of the warp sees

    int it = 0;
    for (int kt0 = begin; kt0 < end; kt0 += FA_KT, it++) {
        if (kt0 + FA_KT < end) {
            load_tile((it + 1) & 1, kt0 + FA_KT);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // tile `it` (and, the first time, Qs) is visible to every warp
        const bf16_t* Kt = Ks + (it & 1) * KS;
        const bf16_t* Vt = Vs + (it & 1) * KS;
        // Warps whose rows all lie before this tile, or past the end of the prompt, skip it.
        if (tw0 < T && kt0 <= warp_last) {
            float sc[NT][4];
#pragma unroll
            for (int n = 0; n < NT; n++) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                u32 a[4];
                load_a_frag(a, Qw, LDQ, 0, kk * 16);
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    u32 b[2];
                    load_b_frag(b, Kt, LDQ, n * 8, kk * 16);
                    mma_bf16_16816(sc[n], a, b);
                }
            }
            // Scale into the exp2 domain and mask: key j is visible to a row at token t when
            // j <= pos0 + t and j < end.
            float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
            for (int n = 0; n < NT; n++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int j = kt0 + n * 8 + 2 * t4 + e;
                    sc[n][e] = (j < end && j <= lim0) ? sc[n][e] * scale_log2 : NEG_INF;
                    sc[n][2 + e] = (j < end && j <= lim1) ? sc[n][2 + e] * scale_log2 : NEG_INF;
                    mx0 = fmaxf(mx0, sc[n][e]);
                    mx1 = fmaxf(mx1, sc[n][2 + e]);
                }
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
            // A row that has seen no key yet keeps m = -inf; subtract 0 then (exp2 gives 0, not NaN).
            const float b0 = mn0 == NEG_INF ? 0.f : mn0, b1 = mn1 == NEG_INF ? 0.f : mn1;
            const float c0 = exp2f(m0 - b0), c1 = exp2f(m1 - b1);
            m0 = mn0;
            m1 = mn1;
            l0 *= c0;
            l1 *= c1;
#pragma unroll
            for (int i = 0; i < OT; i++) {
                o[i][0] *= c0;
                o[i][1] *= c0;
                o[i][2] *= c1;
                o[i][3] *= c1;
            }
#pragma unroll
            for (int n = 0; n < NT; n++) {
                sc[n][0] = exp2f(sc[n][0] - b0);
                sc[n][1] = exp2f(sc[n][1] - b0);
                sc[n][2] = exp2f(sc[n][2] - b1);
                sc[n][3] = exp2f(sc[n][3] - b1);
                l0 += sc[n][0] + sc[n][1];
                l1 += sc[n][2] + sc[n][3];
            }
            // O += P V: the C fragments of two neighbouring S tiles are the A fragment of a k step.
#pragma unroll
            for (int kk = 0; kk < FA_KT / 16; kk++) {
                u32 a[4];
                a[0] = pack_bf16x2(sc[2 * kk][0], sc[2 * kk][1]);
                a[1] = pack_bf16x2(sc[2 * kk][2], sc[2 * kk][3]);
                a[2] = pack_bf16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
                a[3] = pack_bf16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
                for (int i = 0; i < OT; i += 2) {
                    u32 b[4];
                    load_b_frag_x2_trans(b, Vt, LDQ, i * 8, kk * 16);
                    mma_bf16_16816(o[i], a, b);
                    mma_bf16_16816(o[i + 1], a, b + 2);
                }
            }
        }
        __syncthreads();  // every warp is done with this buffer before it is refilled
    }
    if (tw0 >= T) return;
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    if (splits == 1) {
        // Every row sees at least key 0 here, so l > 0.
        const float i0 = 1.f / l0, i1 = 1.f / l1;
#pragma unroll
        for (int i = 0; i < OT; i++) {
            const int d = i * 8 + 2 * t4;
            if (row0 < T) {
                const i64 at = ((i64)row0 * nh + h) * HD + d;
                out[at] = o[i][0] * i0 * sigmoid_f(gate[at]);
                out[at + 1] = o[i][1] * i0 * sigmoid_f(gate[at + 1]);
            }
            if (row1 < T) {
                const i64 at = ((i64)row1 * nh + h) * HD + d;
                out[at] = o[i][2] * i1 * sigmoid_f(gate[at]);
                out[at + 1] = o[i][3] * i1 * sigmoid_f(gate[at + 1]);
            }
        }
        return;
    }
    float* p0 = partial + (((i64)row0 * nh + h) * splits + s) * (HD + 2);
    float* p1 = partial + (((i64)row1 * nh + h) * splits + s) * (HD + 2);
    if (t4 == 0) {
        if (row0 < T) {
            p0[0] = m0;
            p0[1] = l0;
        }
        if (row1 < T) {
            p1[0] = m1;
            p1[1] = l1;
        }
    }
#pragma unroll
    for (int i = 0; i < OT; i++) {
        const int d = 2 + i * 8 + 2 * t4;
        if (row0 < T) {
            p0[d] = o[i][0];
            p0[d + 1] = o[i][1];
        }
        if (row1 < T) {
            p1[d] = o[i][2];
            p1[d + 1] = o[i][3];
        }
    }
}

#define FA_KERNEL(HD, MINB)                                                                               \
    extern "C" __global__ void __launch_bounds__(FA_WARPS * 32, MINB) flash_attention_hd##HD(             \
        const float* q, const bf16_t* kb, const bf16_t* vb, const float* gate, float* out,             \
        float* partial, int T, int nh, int nkv, int pos0, int hb, int split_keys, float scale_log2) {    \
        pdl_enter();                                                                                      \
        flash_body<HD>(q, kb, vb, gate, out, partial, T, nh, nkv, pos0, hb, split_keys, scale_log2);      \
    }
FA_KERNEL(32, 2)
FA_KERNEL(64, 2)
FA_KERNEL(128, 2)
FA_KERNEL(256, 2)

// Merges the splits of every (token, head) and applies the sigmoid gate.
// grid (heads, tokens), block head_dim rounded up to a warp.
extern "C" __global__ void flash_attention_combine(const float* partial, const float* gate, float* out,
                                                   int nh, int hd, int splits) {
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
            const float f = exp2f(ps[0] - mx);
            sum += ps[1] * f;
            o += ps[2 + d] * f;
        }
    }
    const i64 at = ((i64)r * nh + h) * hd + d;
    out[at] = o / sum * sigmoid_f(gate[at]);
}
