// The chunked gated delta rule for prefill with its sequential part on the tensor cores.
// Notation of deltanet.cu: chunks of 64 tokens, gamma the cumulative log decay in a chunk,
//   A = strict_lower(beta_i k_i.k_j exp(gamma_i - gamma_j)),  T = (I + A)^-1,
//   W = T (beta exp(gamma) k),  U = T (beta v)                      [v' = U - W S]
//   o_i = exp(gamma_i) q_i S + sum_{j<=i} q_i.k_j exp(gamma_i - gamma_j) v'_j
//   S <- exp(gamma_L) S + sum_j k_j exp(gamma_L - gamma_j) (x) v'_j.
// Everything that does not depend on S is computed for all chunks at once (gdn_tc_prep, grid
// (chunks, value heads), in f32 on the CUDA cores); the scan over chunks (gdn_tc_scan, grid
// (value heads, dv / 32)) then needs only four small matrix products per chunk, on mma.sync with
// bf16 operands: S is kept in f32 accumulators and rounded to bf16 only as an operand.
// Per chunk and head the prep writes (padding rows past the prompt are zeros):
//   W bf16 [64][dk], Qe = q exp(gamma) bf16 [64][dk], KdT = (k exp(gamma_L - gamma))^T bf16
//   [dk][64], Aqk = causal q_i.k_j exp(gamma_i - gamma_j) bf16 [64][64], U f32 [64][dv],
//   eL = exp(gamma_L) f32.
#define TC_CH 64
#define TC_DVB 32
#define TC_SCAN_WARPS 4
#define TC_MAX_MT 4  // m tiles of S per warp: dk <= 16 * TC_SCAN_WARPS * TC_MAX_MT

// Element offsets of the prep outputs of chunk c, head h (nv heads).
__device__ __forceinline__ i64 tc_slot(int c, int h, int nv) { return (i64)c * nv + h; }

// grid (chunks, nv), block 256, dynamic shared memory gdn_tc_prep_smem_floats(dk) * 4 bytes.
extern "C" __global__ void __launch_bounds__(256, 2) gdn_tc_prep(
    const float* qkv, const float* a, const float* b, const float* a_log, const float* dt_bias,
    bf16_t* Wg, bf16_t* Qeg, bf16_t* KdTg, bf16_t* Aqkg, float* Ug, float* eLg,
    int T, int nk, int nv, int dk, int dv, float q_scale, int kh_div) {
    pdl_enter();
    extern __shared__ float sm[];
    const int ld = dk + 1;
    const int ldt = ld > TC_CH + 1 ? ld : TC_CH + 1;
    float* Qn = sm;                 // [64][ld], later T [64][65]
    float* Kn = Qn + TC_CH * ldt;   // [64][ld]
    float* A = Kn + TC_CH * ld;     // [64][65]
    float* gam = A + TC_CH * 65;    // [64]
    float* bet = gam + TC_CH;       // [64]
    float* eg = bet + TC_CH;        // [64] exp(gamma)

    const int c = blockIdx.x, h = blockIdx.y;
    const int start = c * TC_CH, L = imin(TC_CH, T - start);
    const int kh = (h / kh_div) % nk;  // see DeltaNetShape::key_head
    const int key_dim = nk * dk;
    const int conv_dim = 2 * key_dim + nv * dv;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nthr = blockDim.x;
    const i64 slot = tc_slot(c, h, nv);

    // Eight loads in flight per thread before the first store.
    for (int p0 = tid; p0 < TC_CH * dk; p0 += 8 * nthr) {
        float qv[8], kv[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int p = p0 + u * nthr, i = p / dk, d = p % dk;
            qv[u] = kv[u] = 0.f;
            if (p < TC_CH * dk && i < L) {
                const float* row = qkv + (i64)(start + i) * conv_dim;
                qv[u] = row[kh * dk + d];
                kv[u] = row[key_dim + kh * dk + d];
            }
        }
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int p = p0 + u * nthr, i = p / dk, d = p % dk;
            if (p < TC_CH * dk) {
                Qn[i * ldt + d] = qv[u];
                Kn[i * ld + d] = kv[u];
            }
        }
    }
    if (tid < TC_CH) {
        const bool in = tid < L;
        bet[tid] = in ? sigmoid_f(b[(i64)(start + tid) * nv + h]) : 0.f;
        gam[tid] = in ? -expf(a_log[h]) * softplus_f(a[(i64)(start + tid) * nv + h] + dt_bias[h]) : 0.f;
    }
    __syncthreads();
    // The L2 norms as the recurrent kernel computes them; rows past the prompt stay zero.
    for (int i = warp; i < TC_CH; i += nthr / 32) {
        float sq = 0.f, sk = 0.f;
        for (int d = lane; d < dk; d += 32) {
            const float qv = Qn[i * ldt + d], kv = Kn[i * ld + d];
            sq += qv * qv;
            sk += kv * kv;
        }
        sq = warp_sum(sq);
        sk = warp_sum(sk);
        const float iq = 1.f / sqrtf(sq + 1e-6f), ik = 1.f / sqrtf(sk + 1e-6f);
        for (int d = lane; d < dk; d += 32) {
            Qn[i * ldt + d] = (Qn[i * ldt + d] * iq) * q_scale;
            Kn[i * ld + d] *= ik;
        }
    }
    if (tid == 0) {
        float acc = 0.f;
        for (int i = 0; i < TC_CH; i++) {
            acc += gam[i];
            gam[i] = acc;
        }
    }
    __syncthreads();
    const float gL = gam[TC_CH - 1];  // = gamma of the last real row (padding adds nothing)
    if (tid < TC_CH) eg[tid] = expf(gam[tid]);
    if (tid == 0) eLg[slot] = expf(gL);
    __syncthreads();
    for (int p = tid; p < TC_CH * dk; p += nthr) {
        const int i = p / dk, d = p % dk;
        Qeg[slot * TC_CH * dk + p] = to_bf16(Qn[i * ldt + d] * eg[i]);
    }
    for (int p = tid; p < TC_CH * dk; p += nthr) {
        const int d = p / TC_CH, j = p % TC_CH;
        KdTg[slot * TC_CH * dk + p] = to_bf16(Kn[j * ld + d] * expf(gL - gam[j]));
    }
    // q.k and k.k products, a 4x4 tile per thread.
    {
        const int ti = tid / 16, tj = tid % 16;
        float aq[4][4], ak[4][4];
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int s = 0; s < 4; s++) aq[r][s] = ak[r][s] = 0.f;
        for (int d = 0; d < dk; d++) {
            float qi[4], ki[4], kj[4];
#pragma unroll
            for (int r = 0; r < 4; r++) {
                qi[r] = Qn[(4 * ti + r) * ldt + d];
                ki[r] = Kn[(4 * ti + r) * ld + d];
                kj[r] = Kn[(4 * tj + r) * ld + d];
            }
#pragma unroll
            for (int r = 0; r < 4; r++)
#pragma unroll
                for (int s = 0; s < 4; s++) {
                    aq[r][s] += qi[r] * kj[s];
                    ak[r][s] += ki[r] * kj[s];
                }
        }
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int s = 0; s < 4; s++) {
                const int i = 4 * ti + r, j = 4 * tj + s;
                const float dec = j <= i ? expf(gam[i] - gam[j]) : 0.f;
                Aqkg[slot * TC_CH * TC_CH + i * TC_CH + j] = to_bf16(j <= i ? aq[r][s] * dec : 0.f);
                A[i * 65 + j] = j < i ? bet[i] * ak[r][s] * dec : 0.f;
            }
    }
    __syncthreads();
    // T = (I + A)^-1, unit lower triangular, by forward substitution over rows; T overwrites Qn.
    float* Tm = Qn;
    for (int p = tid; p < TC_CH * TC_CH; p += nthr) {
        const int i = p / TC_CH, j = p % TC_CH;
        Tm[i * 65 + j] = i == j ? 1.f : 0.f;
    }
    __syncthreads();
    for (int i = 1; i < TC_CH; i++) {
        const int col = tid >> 2, part = tid & 3;  // 64 columns x 4 partial sums
        float s = 0.f;
        if (col < i)
            for (int j = col + part; j < i; j += 4) s += A[i * 65 + j] * Tm[j * 65 + col];
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (part == 0 && col < i) Tm[i * 65 + col] = -s;
        __syncthreads();
    }
    // W = T (beta exp(gamma) k) and U = T (beta v): a thread owns one column and 32 rows.
    for (int p = tid; p < 2 * (dk + dv); p += nthr) {
        const bool is_w = p < 2 * dk;
        const int q = is_w ? p : p - 2 * dk;
        const int ncol = is_w ? dk : dv;
        const int col = q % ncol, half = q / ncol;
        const int i0 = 32 * half;
        float acc[32];
#pragma unroll
        for (int r = 0; r < 32; r++) acc[r] = 0.f;
        // Rows i0.. need columns j < i0 + 32 of T (T is lower triangular), 32 at a time, their
        // inputs loaded together first.
        for (int jb = 0; jb <= i0; jb += 32) {
            float x[32];
#pragma unroll
            for (int u = 0; u < 32; u++) {
                const int j = jb + u;
                if (is_w) {
                    x[u] = bet[j] * eg[j] * Kn[j * ld + col];
                } else {
                    x[u] = j < L ? bet[j] * qkv[(i64)(start + j) * conv_dim + 2 * key_dim + h * dv + col] : 0.f;
                }
            }
#pragma unroll
            for (int u = 0; u < 32; u++)
#pragma unroll
                for (int r = 0; r < 32; r++) acc[r] += Tm[(i0 + r) * 65 + jb + u] * x[u];
        }
        if (is_w) {
#pragma unroll
            for (int r = 0; r < 32; r++) Wg[slot * TC_CH * dk + (i64)(i0 + r) * dk + col] = to_bf16(acc[r]);
        } else {
#pragma unroll
            for (int r = 0; r < 32; r++) Ug[slot * TC_CH * dv + (i64)(i0 + r) * dv + col] = acc[r];
        }
    }
}

// The scan: one block per (value head, 32 state columns), 4 warps, sequential over chunks.
// Warp w owns output rows 16w..16w+15 of a chunk and the state rows of m tiles w, w+4, ...
// Shared memory (bf16 unless noted), two buffers of the chunk inputs for cp.async prefetch:
//   Wsm, Qsm [64][dk+8], KdTsm [dk][72], Asm [64][72], Usm f32 [64][32]; then
//   Sb [32][dk+8] (S^T as a B operand), Vb [32][72] (v'^T as a B operand).
__device__ __forceinline__ int tc_scan_buf_bytes(int dk) {
    return 2 * (2 * TC_CH * (dk + 8) + dk * (TC_CH + 8) + TC_CH * (TC_CH + 8)) + 4 * TC_CH * TC_DVB;
}

extern "C" __global__ void __launch_bounds__(TC_SCAN_WARPS * 32, 1) gdn_tc_scan(
    const bf16_t* Wg, const bf16_t* Qeg, const bf16_t* KdTg, const bf16_t* Aqkg, const float* Ug,
    const float* eLg, float* state, float* out, int T, int nv, int dk, int dv) {
    pdl_enter();
    extern __shared__ __align__(16) unsigned char tc_smem[];
    const int h = blockIdx.x, c0 = blockIdx.y * TC_DVB;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int ldk = dk + 8, lda = TC_CH + 8;
    const int buf_bytes = tc_scan_buf_bytes(dk);
    bf16_t* Sb = reinterpret_cast<bf16_t*>(tc_smem + 2 * buf_bytes);  // [32][ldk]
    bf16_t* Vb = Sb + TC_DVB * ldk;                                    // [32][lda]
    const int mtiles = dk / 16;
    const int nchunks = (T + TC_CH - 1) / TC_CH;
    const int value_dim = nv * dv;

    // Queues chunk c's inputs into buffer c & 1.
    auto prefetch = [&](int c) {
        unsigned char* base = tc_smem + (c & 1) * buf_bytes;
        bf16_t* Wsm = reinterpret_cast<bf16_t*>(base);
        bf16_t* Qsm = Wsm + TC_CH * ldk;
        bf16_t* Ksm = Qsm + TC_CH * ldk;
        bf16_t* Asm = Ksm + dk * lda;
        float* Usm = reinterpret_cast<float*>(Asm + TC_CH * lda);
        const i64 slot = tc_slot(c, h, nv);
        const int row_chunks = dk / 8;  // 16-byte pieces of a [dk] bf16 row
        for (int p = tid; p < TC_CH * row_chunks; p += blockDim.x) {
            const int r = p / row_chunks, x = p % row_chunks;
            cp_async16(Wsm + r * ldk + 8 * x, Wg + slot * TC_CH * dk + (i64)r * dk + 8 * x);
            cp_async16(Qsm + r * ldk + 8 * x, Qeg + slot * TC_CH * dk + (i64)r * dk + 8 * x);
        }
        for (int p = tid; p < dk * (TC_CH / 8); p += blockDim.x) {
            const int r = p / (TC_CH / 8), x = p % (TC_CH / 8);
            cp_async16(Ksm + r * lda + 8 * x, KdTg + slot * TC_CH * dk + (i64)r * TC_CH + 8 * x);
        }
        for (int p = tid; p < TC_CH * (TC_CH / 8); p += blockDim.x) {
            const int r = p / (TC_CH / 8), x = p % (TC_CH / 8);
            cp_async16(Asm + r * lda + 8 * x, Aqkg + slot * TC_CH * TC_CH + (i64)r * TC_CH + 8 * x);
        }
        for (int p = tid; p < TC_CH * (TC_DVB / 4); p += blockDim.x) {
            const int r = p / (TC_DVB / 4), x = p % (TC_DVB / 4);
            cp_async16(Usm + r * TC_DVB + 4 * x, Ug + slot * TC_CH * dv + (i64)r * dv + c0 + 4 * x);
        }
        cp_async_commit();
    };

    // The state columns c0..c0+31 as C fragments: m tile mt = warp + 4 i (rows 16 mt..), n tile n.
    float S[TC_MAX_MT][4][4];
    float* sg = state + (i64)h * dk * dv;
#pragma unroll
    for (int i = 0; i < TC_MAX_MT; i++) {
        const int mt = warp + TC_SCAN_WARPS * i;
#pragma unroll
        for (int n = 0; n < 4; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = mt * 16 + g + (e >= 2 ? 8 : 0), col = c0 + n * 8 + 2 * t4 + (e & 1);
                S[i][n][e] = mt < mtiles ? sg[(i64)r * dv + col] : 0.f;
            }
        }
    }

    prefetch(0);
    float eL_next = eLg[tc_slot(0, h, nv)];
    for (int c = 0; c < nchunks; c++) {
        // exp(gamma_L) of this chunk, the next one's loaded a chunk ahead.
        const float eL = eL_next;
        if (c + 1 < nchunks) eL_next = eLg[tc_slot(c + 1, h, nv)];
        __syncthreads();  // every warp is done with chunk c - 1 (its buffer, Sb, Vb)
        if (c + 1 < nchunks) {
            prefetch(c + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        unsigned char* base = tc_smem + (c & 1) * buf_bytes;
        const bf16_t* Wsm = reinterpret_cast<const bf16_t*>(base);
        const bf16_t* Qsm = Wsm + TC_CH * ldk;
        const bf16_t* Ksm = Qsm + TC_CH * ldk;
        const bf16_t* Asm = Ksm + dk * lda;
        const float* Usm = reinterpret_cast<const float*>(Asm + TC_CH * lda);
        // S^T to shared memory as bf16.
#pragma unroll
        for (int i = 0; i < TC_MAX_MT; i++) {
            const int mt = warp + TC_SCAN_WARPS * i;
            if (mt < mtiles) {
#pragma unroll
                for (int n = 0; n < 4; n++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int r = mt * 16 + g + (e >= 2 ? 8 : 0), col = n * 8 + 2 * t4 + (e & 1);
                        Sb[col * ldk + r] = to_bf16(S[i][n][e]);
                    }
            }
        }
        __syncthreads();  // Sb and this chunk's inputs are visible to every warp
        // v' = U - W S for rows 16 warp.., all 32 columns.
        const int r0 = 16 * warp;
        {
            float ws[4][4];
#pragma unroll
            for (int n = 0; n < 4; n++) ws[n][0] = ws[n][1] = ws[n][2] = ws[n][3] = 0.f;
            mma_rows16_cols32(ws, Wsm, ldk, Sb, ldk, r0, mtiles);
#pragma unroll
            for (int n = 0; n < 4; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = r0 + g + (e >= 2 ? 8 : 0), col = n * 8 + 2 * t4 + (e & 1);
                    Vb[col * lda + r] = to_bf16(Usm[r * TC_DVB + col] - ws[n][e]);
                }
        }
        __syncthreads();  // v' is complete
        // o = Qe S + Aqk v' for rows 16 warp.. (Aqk is causal: key blocks 0..warp).
        {
            float o[4][4];
#pragma unroll
            for (int n = 0; n < 4; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
            mma_rows16_cols32(o, Qsm, ldk, Sb, ldk, r0, mtiles);
            mma_rows16_cols32(o, Asm, lda, Vb, lda, r0, warp + 1);
#pragma unroll
            for (int n = 0; n < 4; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = r0 + g + (e >= 2 ? 8 : 0), col = c0 + n * 8 + 2 * t4 + (e & 1);
                    const int t = c * TC_CH + r;
                    if (t < T && col < dv) out[(i64)t * value_dim + h * dv + col] = o[n][e];
                }
        }
        // S <- exp(gamma_L) S + KdT v'.
#pragma unroll
        for (int i = 0; i < TC_MAX_MT; i++) {
            const int mt = warp + TC_SCAN_WARPS * i;
            if (mt < mtiles) {
#pragma unroll
                for (int n = 0; n < 4; n++)
#pragma unroll
                    for (int e = 0; e < 4; e++) S[i][n][e] *= eL;
#pragma unroll
                for (int kk = 0; kk < TC_CH / 16; kk++) {
                    u32 af[4];
                    load_a_frag(af, Ksm, lda, mt * 16, kk * 16);
#pragma unroll
                    for (int n = 0; n < 4; n++) {
                        u32 bf[2];
                        load_b_frag(bf, Vb, lda, n * 8, kk * 16);
                        mma_bf16_16816(S[i][n], af, bf);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < TC_MAX_MT; i++) {
        const int mt = warp + TC_SCAN_WARPS * i;
        if (mt < mtiles) {
#pragma unroll
            for (int n = 0; n < 4; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = mt * 16 + g + (e >= 2 ? 8 : 0), col = c0 + n * 8 + 2 * t4 + (e & 1);
                    sg[(i64)r * dv + col] = S[i][n][e];
                }
        }
    }
}
