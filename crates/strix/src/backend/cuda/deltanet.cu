// Gated DeltaNet: the depthwise causal conv1d + SiLU with its carried state, and the gated delta
// rule, as a per-token recurrence (decode) and in chunks of 64 with the UT transform (prefill).
// Notation as in backend/cpu/deltanet.rs: per value head the state S is k_head_dim x v_head_dim,
// and every token does S <- exp(g) S;  S <- S + k (x) beta (v - S^T k);  o = S^T q.

#define CONV_MAX_HIST 7

// Conv, sequential in time, for channel c of one sequence: qkv [T, C] in place, state [C, K-1].
// The last K-1 raw inputs ride along in registers, so no token reads a value another thread has
// overwritten.
__device__ __forceinline__ void conv_seq(float* qkv, const float* weight,
                                         float* state, int T, int C, int K, int c) {
    const int hist = K - 1;
    float win[CONV_MAX_HIST];
    float w[CONV_MAX_HIST + 1];
#pragma unroll
    for (int i = 0; i < CONV_MAX_HIST; i++) win[i] = i < hist ? state[(i64)c * hist + i] : 0.f;
#pragma unroll
    for (int j = 0; j <= CONV_MAX_HIST; j++) w[j] = j < K ? weight[(i64)c * K + j] : 0.f;
    const float w_last = weight[(i64)c * K + hist];
    for (int t = 0; t < T; t++) {
        const float x = qkv[(i64)t * C + c];
        // win[i] is the input hist - i steps back; weight j = K-1 multiplies the current input.
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < CONV_MAX_HIST; j++)
            if (j < hist) acc += w[j] * win[j];
        acc += w_last * x;
        qkv[(i64)t * C + c] = silu_f(acc);
#pragma unroll
        for (int i = 0; i < CONV_MAX_HIST - 1; i++)
            if (i + 1 < hist) win[i] = win[i + 1];
#pragma unroll
        for (int i = 0; i < CONV_MAX_HIST; i++)
            if (i == hist - 1) win[i] = x;
    }
#pragma unroll
    for (int i = 0; i < CONV_MAX_HIST; i++)
        if (i < hist) state[(i64)c * hist + i] = win[i];
}

// Short runs (decode): one thread per channel. grid ceil(C / block).
extern "C" __global__ void conv1d_silu_seq(float* qkv, const float* weight,
                                           float* state, int T, int C, int K) {
    pdl_enter();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < C) conv_seq(qkv, weight, state, T, C, K, c);
}

// A decode batch: row i of qkv [B, C] is one token of sequence i, whose state is states[i].
// grid (ceil(C / block), B).
extern "C" __global__ void conv1d_silu_rows(float* qkv, const float* weight,
                                            const unsigned long long* states, int C, int K) {
    pdl_enter();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int i = blockIdx.y;
    if (c < C) conv_seq(qkv + (i64)i * C, weight, reinterpret_cast<float*>(states[i]), 1, C, K, c);
}

// Conv for long runs, from the raw inputs into another buffer: a thread takes CONV_TT consecutive
// tokens of one channel and slides along them with the inputs in registers, so each input is
// read once per run of CONV_TT outputs (not K times), all loads issued before the first FMA.
// Each output sums its K taps in the order of conv_seq. grid (ceil(C / block), ceil(T / CONV_TT)).
#define CONV_TT 16
extern "C" __global__ void conv1d_silu_par(const float* raw, float* qkv,
                                           const float* weight, const float* state,
                                           int T, int C, int K) {
    pdl_enter();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int t0 = blockIdx.y * CONV_TT;
    if (c >= C) return;
    const int hist = K - 1;
    float w[CONV_MAX_HIST + 1];
#pragma unroll
    for (int j = 0; j < CONV_MAX_HIST + 1; j++) w[j] = j < K ? weight[(i64)c * K + j] : 0.f;
    // win[i] is the input at token t0 - hist + i (the state's slots before token 0).
    float win[CONV_MAX_HIST + CONV_TT];
#pragma unroll
    for (int i = 0; i < CONV_MAX_HIST + CONV_TT; i++) {
        const int t = t0 - hist + i;
        win[i] = i >= hist + CONV_TT || t >= T ? 0.f
                 : t >= 0                     ? raw[(i64)t * C + c]
                 : i < hist                   ? state[(i64)c * hist + (hist + t)]
                                              : 0.f;
    }
#pragma unroll
    for (int i = 0; i < CONV_TT; i++) {
        const int t = t0 + i;
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < CONV_MAX_HIST + 1; j++)
            if (j < K) acc += w[j] * win[i + j];
        if (t < T) qkv[(i64)t * C + c] = silu_f(acc);
    }
}

// The new conv state after a long run: the last K-1 inputs (older state where T < K-1). One
// thread per channel reads everything before writing, since slots move within a channel.
extern "C" __global__ void conv1d_state_update(const float* raw, float* state,
                                               int T, int C, int K) {
    pdl_enter();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int hist = K - 1;
    float next[CONV_MAX_HIST];
#pragma unroll
    for (int i = 0; i < CONV_MAX_HIST; i++) {
        if (i < hist) {
            const int back = hist - i;
            next[i] = back <= T ? raw[(i64)(T - back) * C + c] : state[(i64)c * hist + (hist - (back - T))];
        }
    }
#pragma unroll
    for (int i = 0; i < CONV_MAX_HIST; i++)
        if (i < hist) state[(i64)c * hist + i] = next[i];
}

// ---------------------------------------------------------------------------------------------
// Recurrent delta rule. The columns of S evolve independently (column j needs only v[j]), so a
// block owns GDN_COLS columns of one head: grid (num_v_heads, ceil(v_head_dim / GDN_COLS)),
// block GDN_COLS * GDN_PARTS threads. Each column is held in registers by GDN_PARTS neighbouring
// lanes, lane part p keeping rows p, p + GDN_PARTS, ...; the dot products over k_head_dim are
// finished with two shuffles. Fuses the q/k L2 norms, the q scale, beta = sigmoid(b) and
// g = -exp(A_log) softplus(a + dt_bias). DK bounds k_head_dim; EXACT means dk == DK.
// Value head h reads key head (h / kh_div) % nk (DeltaNetShape::key_head_divisor).
#define GDN_PARTS 4
#define GDN_COLS 32

__device__ __forceinline__ float parts_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    return v;
}

// One token of the delta rule on the state column a group of GDN_PARTS lanes holds (lane part
// keeps rows part, part + GDN_PARTS, ... in s): q and k (raw, in shared memory) are
// L2-normalised, the column decays and moves by beta (v - S^T k) k, and o = S^T q q_scale is
// returned to every lane of the group.
template <int DK, bool EXACT>
__device__ __forceinline__ float gdn_token(float (&s)[DK / GDN_PARTS], const float* qs, const float* ks, float v,
                                           float decay, float beta, float q_scale, int dk, int part) {
    constexpr int ROWS = DK / GDN_PARTS;
    float sq = 0.f, sk = 0.f;
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int i = r * GDN_PARTS + part;
        if (EXACT || i < dk) {
            sq += qs[i] * qs[i];
            sk += ks[i] * ks[i];
        }
    }
    sq = parts_sum(sq);
    sk = parts_sum(sk);
    const float iq = 1.f / sqrtf(sq + 1e-6f);
    const float ik = 1.f / sqrtf(sk + 1e-6f);
    float kv = 0.f;
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int i = r * GDN_PARTS + part;
        if (EXACT || i < dk) {
            s[r] *= decay;
            kv += s[r] * (ks[i] * ik);
        }
    }
    kv = parts_sum(kv);
    const float delta = (v - kv) * beta;
    float o = 0.f;
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int i = r * GDN_PARTS + part;
        if (EXACT || i < dk) {
            s[r] += (ks[i] * ik) * delta;
            o += s[r] * ((qs[i] * iq) * q_scale);
        }
    }
    return parts_sum(o);
}

template <int DK, bool EXACT>
__device__ __forceinline__ void gdn_recurrent_body(const float* qkv, const float* a,
                                                   const float* b, const float* a_log,
                                                   const float* dt_bias, float* state,
                                                   float* out, int T, int nk, int nv, int dk, int dv,
                                                   float q_scale, int kh_div) {
    constexpr int ROWS = DK / GDN_PARTS;
    __shared__ float qs[DK];
    __shared__ float ks[DK];
    const int h = blockIdx.x;
    const int part = threadIdx.x & (GDN_PARTS - 1);
    const int j = blockIdx.y * GDN_COLS + threadIdx.x / GDN_PARTS;
    const bool active = j < dv;
    const int kh = (h / kh_div) % nk;  // see DeltaNetShape::key_head
    const int key_dim = nk * dk;
    const int conv_dim = 2 * key_dim + nv * dv;
    const int value_dim = nv * dv;
    float* sg = state + (i64)h * dk * dv;
    float s[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int i = r * GDN_PARTS + part;
        s[r] = (active && (EXACT || i < dk)) ? sg[(i64)i * dv + j] : 0.f;
    }
    const float decay_rate = -expf(a_log[h]);
    const float dtb = dt_bias[h];
    for (int t = 0; t < T; t++) {
        const float* row = qkv + (i64)t * conv_dim;
        __syncthreads();
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            qs[i] = row[kh * dk + i];
            ks[i] = row[key_dim + kh * dk + i];
        }
        __syncthreads();
        const float beta = sigmoid_f(b[(i64)t * nv + h]);
        const float decay = expf(decay_rate * softplus_f(a[(i64)t * nv + h] + dtb));
        const float v = active ? row[2 * key_dim + h * dv + j] : 0.f;
        const float o = gdn_token<DK, EXACT>(s, qs, ks, v, decay, beta, q_scale, dk, part);
        if (active && part == 0) out[(i64)t * value_dim + h * dv + j] = o;
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int i = r * GDN_PARTS + part;
        if (active && (EXACT || i < dk)) sg[(i64)i * dv + j] = s[r];
    }
}

// gdn_recurrent_SUFFIX: one sequence's T tokens. gdn_recurrent_rows_SUFFIX: a decode batch,
// blockIdx.z the sequence, whose row of qkv, a, b and out is its token and whose state is
// states[z]; one token each, the same arithmetic. MAXDK and EXACT: gdn_recurrent_body's.
#define GDN_RECURRENT(SUFFIX, MAXDK, EXACT)                                                                  \
    extern "C" __global__ void __launch_bounds__(GDN_COLS * GDN_PARTS)                                       \
        gdn_recurrent_##SUFFIX(const float* qkv, const float* a, const float* b, const float* a_log,         \
                               const float* dt_bias, float* state, float* out, int T, int nk, int nv, int dk, \
                               int dv, float q_scale, int kh_div) {                                          \
        pdl_enter();                                                                                         \
        gdn_recurrent_body<MAXDK, EXACT>(qkv, a, b, a_log, dt_bias, state, out, T, nk, nv, dk, dv, q_scale,   \
                                         kh_div);                                                            \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(GDN_COLS * GDN_PARTS) gdn_recurrent_rows_##SUFFIX(          \
        const float* qkv, const float* a, const float* b, const float* a_log, const float* dt_bias,          \
        const unsigned long long* states, float* out, int nk, int nv, int dk, int dv, float q_scale,         \
        int kh_div) {                                                                                        \
        pdl_enter();                                                                                         \
        const int i = blockIdx.z;                                                                            \
        const i64 conv_dim = 2 * nk * dk + nv * dv;                                                          \
        gdn_recurrent_body<MAXDK, EXACT>(qkv + i * conv_dim, a + (i64)i * nv, b + (i64)i * nv, a_log,        \
                                         dt_bias, reinterpret_cast<float*>(states[i]),                       \
                                         out + (i64)i * nv * dv, 1, nk, nv, dk, dv, q_scale, kh_div);        \
    }
GDN_RECURRENT(dk128, 128, true)
GDN_RECURRENT(generic, 256, false)

// ---------------------------------------------------------------------------------------------
// Chunked delta rule (prefill). Chunks of CH tokens; within a chunk, with gamma the cumulative g,
//   A = strict_lower(beta_i k_i.k_j exp(gamma_i - gamma_j)),
//   v' = (I + A)^-1 beta (v - exp(gamma) k S)          [= U - W S of the CPU code]
//   o_i = exp(gamma_i) q_i S + sum_{j<=i} q_i.k_j exp(gamma_i - gamma_j) v'_j
//   S <- exp(gamma_L) S + sum_j k_j exp(gamma_L - gamma_j) (x) v'_j.
// Columns of S, v and o are independent again, so a block owns DVB columns of one head (A and
// the normalised q, k are recomputed per block): grid (num_v_heads, ceil(v_head_dim / DVB)),
// block 256 threads, dynamic shared memory gdn_chunked_smem_floats(dk) * 4 bytes.
#define CH 64
#define DVB 32

extern "C" __global__ void __launch_bounds__(256) gdn_chunked(
    const float* qkv, const float* a, const float* b,
    const float* a_log, const float* dt_bias, float* state,
    float* out, int T, int nk, int nv, int dk, int dv, float q_scale, int kh_div) {
    pdl_enter();
    extern __shared__ float sm[];
    const int ldk = dk + 1;  // padded rows: threads walking different rows hit different banks
    const int lda = CH + 1;
    float* Qs = sm;                // [CH][ldk]
    float* Ks = Qs + CH * ldk;     // [CH][ldk]
    float* S = Ks + CH * ldk;      // [dk][DVB]
    float* R = S + dk * DVB;       // [CH][DVB]: beta v, then v'
    float* A = R + CH * DVB;       // [CH][lda]
    float* gam = A + CH * lda;     // [CH]
    float* bet = gam + CH;         // [CH]
    float* eL = bet + CH;          // [CH]: exp(gamma_L - gamma_j)

    const int h = blockIdx.x;
    const int c0 = blockIdx.y * DVB;
    const int kh = (h / kh_div) % nk;  // see DeltaNetShape::key_head
    const int key_dim = nk * dk;
    const int conv_dim = 2 * key_dim + nv * dv;
    const int value_dim = nv * dv;
    const int tid = threadIdx.x, nthr = blockDim.x;
    const int lane = tid & 31, warp = tid >> 5, nwarps = nthr >> 5;

    float* sg = state + (i64)h * dk * dv;
    for (int p = tid; p < dk * DVB; p += nthr) {
        const int i = p / DVB, c = p % DVB;
        S[p] = c0 + c < dv ? sg[(i64)i * dv + c0 + c] : 0.f;
    }
    const float decay_rate = -expf(a_log[h]);
    const float dtb = dt_bias[h];

    for (int start = 0; start < T; start += CH) {
        const int L = imin(CH, T - start);
        __syncthreads();
        for (int p = tid; p < L * dk; p += nthr) {
            const int i = p / dk, d = p % dk;
            const float* row = qkv + (i64)(start + i) * conv_dim;
            Qs[i * ldk + d] = row[kh * dk + d];
            Ks[i * ldk + d] = row[key_dim + kh * dk + d];
        }
        for (int p = tid; p < L * DVB; p += nthr) {
            const int i = p / DVB, c = p % DVB;
            R[i * DVB + c] =
                c0 + c < dv ? qkv[(i64)(start + i) * conv_dim + 2 * key_dim + h * dv + c0 + c] : 0.f;
        }
        if (tid < L) {
            bet[tid] = sigmoid_f(b[(i64)(start + tid) * nv + h]);
            gam[tid] = decay_rate * softplus_f(a[(i64)(start + tid) * nv + h] + dtb);
        }
        __syncthreads();
        for (int i = warp; i < L; i += nwarps) {
            float sq = 0.f, sk = 0.f;
            for (int d = lane; d < dk; d += 32) {
                const float q = Qs[i * ldk + d], k = Ks[i * ldk + d];
                sq += q * q;
                sk += k * k;
            }
            sq = warp_sum(sq);
            sk = warp_sum(sk);
            const float iq = 1.f / sqrtf(sq + 1e-6f), ik = 1.f / sqrtf(sk + 1e-6f);
            for (int d = lane; d < dk; d += 32) {
                Qs[i * ldk + d] = (Qs[i * ldk + d] * iq) * q_scale;
                Ks[i * ldk + d] *= ik;
            }
        }
        if (tid == 0) {
            float acc = 0.f;
            for (int i = 0; i < L; i++) {
                acc += gam[i];
                gam[i] = acc;
            }
        }
        __syncthreads();
        if (tid < L) eL[tid] = expf(gam[L - 1] - gam[tid]);
        // A (strictly lower), and R_i = beta_i (v_i - exp(gamma_i) k_i S).
        for (int p = tid; p < L * L; p += nthr) {
            const int i = p / L, j = p % L;
            float v = 0.f;
            if (j < i) {
                float s = 0.f;
                for (int d = 0; d < dk; d++) s += Ks[i * ldk + d] * Ks[j * ldk + d];
                v = s * bet[i] * expf(gam[i] - gam[j]);
            }
            A[i * lda + j] = v;
        }
        for (int p = tid; p < L * DVB; p += nthr) {
            const int i = p / DVB, c = p % DVB;
            float s = 0.f;
            for (int d = 0; d < dk; d++) s += Ks[i * ldk + d] * S[d * DVB + c];
            R[i * DVB + c] = bet[i] * (R[i * DVB + c] - expf(gam[i]) * s);
        }
        __syncthreads();
        // Forward substitution through the unit lower-triangular I + A, one column per lane of
        // warp 0: row i needs every earlier row, so this part is sequential in i.
        if (warp == 0) {
            const int c = lane;
            for (int i = 1; i < L; i++) {
                float s0 = 0.f, s1 = 0.f;
                int j = 0;
                for (; j + 1 < i; j += 2) {
                    s0 += A[i * lda + j] * R[j * DVB + c];
                    s1 += A[i * lda + j + 1] * R[(j + 1) * DVB + c];
                }
                if (j < i) s0 += A[i * lda + j] * R[j * DVB + c];
                R[i * DVB + c] -= s0 + s1;
            }
        }
        __syncthreads();
        // A <- causal (q_i . k_j) exp(gamma_i - gamma_j), j <= i.
        for (int p = tid; p < L * L; p += nthr) {
            const int i = p / L, j = p % L;
            float v = 0.f;
            if (j <= i) {
                float s = 0.f;
                for (int d = 0; d < dk; d++) s += Qs[i * ldk + d] * Ks[j * ldk + d];
                v = s * expf(gam[i] - gam[j]);
            }
            A[i * lda + j] = v;
        }
        __syncthreads();
        for (int p = tid; p < L * DVB; p += nthr) {
            const int i = p / DVB, c = p % DVB;
            float s = 0.f;
            for (int d = 0; d < dk; d++) s += Qs[i * ldk + d] * S[d * DVB + c];
            float o = expf(gam[i]) * s;
            for (int j = 0; j <= i; j++) o += A[i * lda + j] * R[j * DVB + c];
            if (c0 + c < dv) out[(i64)(start + i) * value_dim + h * dv + c0 + c] = o;
        }
        __syncthreads();
        const float el = expf(gam[L - 1]);
        for (int p = tid; p < dk * DVB; p += nthr) {
            const int d = p / DVB, c = p % DVB;
            float s = S[p] * el;
            for (int j = 0; j < L; j++) s += (Ks[j * ldk + d] * eL[j]) * R[j * DVB + c];
            S[p] = s;
        }
    }
    __syncthreads();
    for (int p = tid; p < dk * DVB; p += nthr) {
        const int i = p / DVB, c = p % DVB;
        if (c0 + c < dv) sg[(i64)i * dv + c0 + c] = S[p];
    }
}

// ---------------------------------------------------------------------------------------------
// A decode token's whole Gated DeltaNet core in one kernel: causal conv1d + SiLU (with the conv
// state), the q/k L2 norms, the recurrent delta rule and the gated RMSNorm, for one token of each
// of a batch of sequences. A block owns COLS columns of one value head (a tile), held as in the
// recurrent kernel (GDN_PARTS lanes a column), so the state streams through many SMs; the blocks
// of one key head (its value heads, all their tiles) form a thread-block cluster. At batch 1 the
// kernel is a chain of latencies, so it is built to wait as few times as it can:
//  - before `pdl_wait` it loads everything no kernel still in flight can write: the weights, and
//    this layer's f32 state and conv state. Only this kernel writes those, once per step, and a
//    recorded step (the only place launches overlap, Device::launch) starts after the previous
//    step has completed; within a step nothing before this layer's launch touches them. Their
//    loads go out while the previous kernel is still running;
//  - after it, one round of loads (the token's qkv, a, b, z), all independent;
//  - every block convolves its key head's q and k channels from the old conv state; the new q/k
//    conv state is written only after the one cluster barrier (all blocks have read the old one),
//    each block a share; a block's value channels are its own and are updated at once;
//  - the gated norm's sum of squares: each warp (8 columns) sums its columns' o^2 and pushes the
//    partial into the shared memory of every block of its value head (DSMEM), then the cluster
//    barrier; each block adds the head's partials in column order. The order of every sum is
//    that of the columns alone, so the result is the same whatever the tiling (COLS), which the
//    launcher picks per batch: a sequence's result never depends on the batch it is in.
// grid (num_v_heads * tiles, batch), cluster (heads per key head * tiles), block
// COLS * GDN_PARTS; tiles = ceil(v_head_dim / COLS). KC > 0 is the conv kernel size of the
// register-prefetching fast path (it needs dk == DK); KC == 0 takes any conv kernel size.
#define GDN_WARP_COLS (32 / GDN_PARTS)
// Partial sums of o^2 a value head has: v_head_dim / GDN_WARP_COLS (the launcher bounds it).
#define GDN_MAX_GROUPS 32

__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// Arrive (no ordering) and wait: used once so that every block of the cluster is known to be
// running before any writes into its shared memory.
__device__ __forceinline__ void cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Stores v at `*local` as it is in the shared memory of the cluster's block `rank`.
__device__ __forceinline__ void st_cluster_peer(float* local, u32 rank, float v) {
    u32 addr, remote;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(addr) : "l"(local));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory");
}

// silu(conv) of one channel's new input x over its state (the K-1 inputs before it), by
// conv_seq's arithmetic.
__device__ __forceinline__ float conv_step(float x, const float* w, const float* st, int K) {
    float acc = 0.f;
    for (int j = 0; j < K - 1; j++) acc += w[j] * st[j];
    acc += w[K - 1] * x;
    return silu_f(acc);
}
// The channel's state after input x: the oldest input drops out.
__device__ __forceinline__ void conv_push(float* st, float x, int K) {
    for (int i = 0; i + 1 < K - 1; i++) st[i] = st[i + 1];
    if (K > 1) st[K - 2] = x;
}

// One channel of the fast path: its weights and old state in registers, loaded before the wait.
template <int KC>
struct ConvChan {
    float w[KC];
    float st[KC - 1];
    float x;
    __device__ __forceinline__ void load(const float* conv_w, const float* conv_state, i64 ch) {
#pragma unroll
        for (int j = 0; j < KC; j++) w[j] = conv_w[ch * KC + j];
#pragma unroll
        for (int j = 0; j < KC - 1; j++) st[j] = conv_state[ch * (KC - 1) + j];
    }
    // conv_step's arithmetic, in its order.
    __device__ __forceinline__ float out() const {
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < KC - 1; j++) acc += w[j] * st[j];
        acc += w[KC - 1] * x;
        return silu_f(acc);
    }
    // The channel's new state (the oldest input drops out) to `dst`.
    __device__ __forceinline__ void push(float* dst) const {
#pragma unroll
        for (int j = 0; j + 1 < KC - 1; j++) dst[j] = st[j + 1];
        dst[KC - 2] = x;
    }
};
template <>
struct ConvChan<0> {  // unused: the generic path convolves straight from memory
    __device__ __forceinline__ void load(const float*, const float*, i64) {}
};

// The block's COLS outputs (part 0 of each column holds one; `first` is the first one's index
// in the token's row) quantized as quantize_x does, COLS / 32 groups.
template <int COLS>
__device__ __forceinline__ void gdn_quantize_out(float res, i64 first, signed char* xq, float* xd, int* xs) {
    __shared__ float qv[COLS];
    if ((threadIdx.x & (GDN_PARTS - 1)) == 0) qv[threadIdx.x / GDN_PARTS] = res;
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (warp < COLS / 32) quantize_group32(qv[warp * 32 + lane], lane, first / 32 + warp, xq, xd, xs);
}

template <int DK, bool EXACT, int COLS, int KC, bool QX>
__device__ __forceinline__ void gdn_decode_fused_body(
    const float* qkv, const float* z, const float* a, const float* b, const float* conv_w,
    const float* a_log, const float* dt_bias, const float* norm_w, const unsigned long long* conv_states,
    const unsigned long long* states, float* out, int nk, int nv, int dk, int dv, int K, float q_scale,
    int kh_div, float eps, signed char* xq, float* xd, int* xs) {
    constexpr int ROWS = DK / GDN_PARTS;
    constexpr int THREADS = COLS * GDN_PARTS;
    constexpr int WARPS = COLS / GDN_WARP_COLS;
    // Fast path: each thread convolves (up to) NCH of the key head's 2 * DK q/k channels.
    constexpr int NCH = KC > 0 ? (2 * DK + THREADS - 1) / THREADS : 1;
    static_assert(KC == 0 || (2 * DK) % THREADS == 0 || THREADS > 2 * DK, "q/k channels split evenly");
    static_assert(KC == 0 || EXACT, "the fast path needs dk == DK");
    __shared__ float qs[DK];
    __shared__ float ks[DK];
    __shared__ float vs[COLS];
    __shared__ float ssp[GDN_MAX_GROUPS];
    // Fast path: the new q/k conv state, held here until the cluster barrier lets it out (in
    // shared memory rather than registers, which the state needs).
    __shared__ float qk_next[KC > 0 ? 2 * DK * (KC - 1) : 1];

    pdl_launch_dependents();
    cluster_arrive_relaxed();
    const int seq = blockIdx.y;
    const i64 conv_dim = 2 * (i64)nk * dk + (i64)nv * dv;
    const i64 value_dim = (i64)nv * dv;
    const int per_key = nv / nk;
    const int tiles = (dv + COLS - 1) / COLS;
    const int tile = blockIdx.x % tiles;
    const int member = (blockIdx.x / tiles) % per_key;
    const int kh = blockIdx.x / (tiles * per_key);
    // The member-th value head that reads key head kh (see DeltaNetShape::key_head).
    const int h = kh_div == 1 ? kh + member * nk : kh * per_key + member;
    const int key_dim = nk * dk;
    const int hist = K - 1;
    const int part = threadIdx.x & (GDN_PARTS - 1);
    const int col = threadIdx.x / GDN_PARTS;
    const int j = tile * COLS + col;
    const bool active = j < dv;
    float* conv_state = reinterpret_cast<float*>(conv_states[seq]);
    float* sg = reinterpret_cast<float*>(states[seq]) + (i64)h * dk * dv;
    qkv += seq * conv_dim;

    // Before the wait: the state, the conv state and the weights (see above).
    float s[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int i = r * GDN_PARTS + part;
        s[r] = (active && (EXACT || i < dk)) ? sg[(i64)i * dv + j] : 0.f;
    }
    ConvChan<KC> qk[NCH];
    ConvChan<KC> vc;
    const bool v_owner = threadIdx.x < COLS && tile * COLS + (int)threadIdx.x < dv;
    const i64 v_ch = 2 * (i64)key_dim + (i64)h * dv + tile * COLS + threadIdx.x;
    if (KC > 0) {
#pragma unroll
        for (int n = 0; n < NCH; n++) {
            const int c = n * THREADS + threadIdx.x;
            const i64 ch = c < DK ? kh * DK + c : key_dim + kh * DK + (c - DK);
            if (THREADS <= 2 * DK || c < 2 * DK) qk[n].load(conv_w, conv_state, ch);
        }
        if (v_owner) vc.load(conv_w, conv_state, v_ch);
    }
    const float decay_rate = -expf(a_log[h]);
    const float dtb = dt_bias[h];
    const float nw = active ? norm_w[j] : 0.f;

    pdl_wait();
    // One round of loads: the token's inputs.
    const float a_h = a[(i64)seq * nv + h];
    const float b_h = b[(i64)seq * nv + h];
    const float zj = active ? z[seq * value_dim + h * dv + j] : 0.f;
    if constexpr (KC > 0) {
#pragma unroll
        for (int n = 0; n < NCH; n++) {
            const int c = n * THREADS + threadIdx.x;
            const i64 ch = c < DK ? kh * DK + c : key_dim + kh * DK + (c - DK);
            if (THREADS <= 2 * DK || c < 2 * DK) qk[n].x = qkv[ch];
        }
        if (v_owner) vc.x = qkv[v_ch];
#pragma unroll
        for (int n = 0; n < NCH; n++) {
            const int c = n * THREADS + threadIdx.x;
            if (THREADS <= 2 * DK || c < 2 * DK) {
                const float o = qk[n].out();
                if ((n + 1) * THREADS <= DK || (n * THREADS < DK && c < DK)) qs[c] = o;
                else ks[c - DK] = o;
                qk[n].push(&qk_next[c * (KC - 1)]);
            }
        }
        if (v_owner) {
            vs[threadIdx.x] = vc.out();
            vc.push(conv_state + v_ch * (KC - 1));
        }
    } else {
        for (int c = threadIdx.x; c < 2 * dk; c += THREADS) {
            const int ch = c < dk ? kh * dk + c : key_dim + kh * dk + (c - dk);
            const float v = conv_step(qkv[ch], conv_w + (i64)ch * K, conv_state + (i64)ch * hist, K);
            if (c < dk) qs[c] = v;
            else ks[c - dk] = v;
        }
        if (v_owner) {
            float* st = conv_state + v_ch * hist;
            const float x = qkv[v_ch];
            vs[threadIdx.x] = conv_step(x, conv_w + v_ch * K, st, K);
            conv_push(st, x, K);
        }
    }
    __syncthreads();

    // The delta rule, as gdn_recurrent_body does one token.
    const float beta = sigmoid_f(b_h);
    const float decay = expf(decay_rate * softplus_f(a_h + dtb));
    const float v = active ? vs[col] : 0.f;
    const float o = gdn_token<DK, EXACT>(s, qs, ks, v, decay, beta, q_scale, dk, part);
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int i = r * GDN_PARTS + part;
        if (active && (EXACT || i < dk)) sg[(i64)i * dv + j] = s[r];
    }

    // This warp's columns' sum of o^2, into every block of the value head.
    const float ss = warp_sum(active && part == 0 ? o * o : 0.f);
    cluster_wait();  // every block of the cluster is running
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane < tiles) st_cluster_peer(&ssp[tile * WARPS + warp], (u32)(member * tiles + lane), ss);
    cluster_sync();  // the old q/k conv state is read everywhere; the partials have landed
    const u32 rank = cluster_rank();
    const int csize = per_key * tiles;
    if constexpr (KC > 0) {
        // Block `rank` writes its share of the new q/k conv state, which is two runs of
        // contiguous floats (the key head's q channels, then its k channels).
        constexpr int HALF = DK * (KC - 1);
        const int per = (2 * HALF + csize - 1) / csize;
        const int end = imin(2 * HALF, ((int)rank + 1) * per);
        for (int e = (int)rank * per + threadIdx.x; e < end; e += THREADS) {
            const i64 at = e < HALF ? (i64)kh * HALF + e : (i64)key_dim * (KC - 1) + (i64)kh * HALF + (e - HALF);
            conv_state[at] = qk_next[e];
        }
    } else {
        for (int c = (int)(rank * THREADS + threadIdx.x); c < 2 * dk; c += csize * THREADS) {
            const int ch = c < dk ? kh * dk + c : key_dim + kh * dk + (c - dk);
            conv_push(conv_state + (i64)ch * hist, qkv[ch], K);
        }
    }
    const int groups = (dv + GDN_WARP_COLS - 1) / GDN_WARP_COLS;
    float total = 0.f;
    for (int g = 0; g < groups; g++) total += ssp[g];
    const float inv = 1.f / sqrtf(total / (float)dv + eps);
    const float res = nw * (o * inv) * silu_f(zj);
    if (active && part == 0) out[seq * value_dim + h * dv + j] = res;
    // QX: one token's output also quantized for the packed out_proj GEMV (quant.rs,
    // "activations quantized by their producer"); the launcher takes a QX kernel only for one
    // token with dv a multiple of COLS, so the block's columns are COLS / 32 whole groups.
    if constexpr (QX) gdn_quantize_out<COLS>(res, (i64)h * dv + tile * COLS, xq, xd, xs);
}

#define GDN_FUSED(NAME, DK, EXACT, COLS, KC, MINB, QX)                                                       \
    extern "C" __global__ void __launch_bounds__(COLS * GDN_PARTS, MINB) NAME(                          \
        const float* qkv, const float* z, const float* a, const float* b, const float* conv_w,       \
        const float* a_log, const float* dt_bias, const float* norm_w,                               \
        const unsigned long long* conv_states, const unsigned long long* states, float* out, int nk, \
        int nv, int dk, int dv, int K, float q_scale, int kh_div, float eps, signed char* xq, float* xd, \
        int* xs) {                                                                                   \
        gdn_decode_fused_body<DK, EXACT, COLS, KC, QX>(qkv, z, a, b, conv_w, a_log, dt_bias, norm_w,    \
                                                   conv_states, states, out, nk, nv, dk, dv, K,      \
                                                   q_scale, kh_div, eps, xq, xd, xs);                \
    }
GDN_FUSED(gdn_decode_fused_dk128_k4_c32, 128, true, 32, 4, 7, false)
GDN_FUSED(gdn_decode_fused_dk128_k4_c16, 128, true, 16, 4, 10, false)
GDN_FUSED(gdn_decode_fused_dk128_k4_c64, 128, true, 64, 4, 3, false)
GDN_FUSED(gdn_decode_fused_dk128_k4_c128, 128, true, 128, 4, 1, false)
GDN_FUSED(gdn_decode_fused_generic, 256, false, 32, 0, 3, false)
// One token (the batch-1 tiling of 32 columns: one block an SM, so no register bound), its
// output also quantized (xq, xd, xs).
GDN_FUSED(gdn_decode_fused_dk128_k4_c32_q, 128, true, 32, 4, 1, true)
