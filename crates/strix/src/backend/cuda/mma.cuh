// Warp-level bf16 tensor-core helpers for the prefill kernels (flash_attention.cu,
// deltanet_chunked.cu) and the streamed decode GEMVs (matmul.cu): mma.sync m16n8k16 with f32 accumulation, fragments loaded from shared
// memory with 32-bit loads. Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"),
// with g = lane / 4 and t = lane % 4:
//   A (16x16, row-major): reg0 = (row g, cols 2t..2t+1), reg1 = (row g+8, same cols),
//                         reg2 = (row g, cols 2t+8..), reg3 = (row g+8, cols 2t+8..);
//   B (16x8):             reg0 = (rows 2t..2t+1, col g), reg1 = (rows 2t+8.., col g);
//   C (16x8, f32):        c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g+8, same cols).
// The lower half of each 32-bit register holds the element with the lower index.

// Two floats to a bf16 pair, round to nearest even (lo in the low half).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ bf16_t to_bf16(float x) { return (bf16_t)(pack_bf16x2(x, 0.f) & 0xffffu); }

// d += a * b.
__device__ __forceinline__ void mma_bf16_16816(float* d, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// A fragment of rows r0..r0+15, cols k0..k0+15 of a row-major bf16 matrix with row stride ld.
__device__ __forceinline__ void load_a_frag(u32* a, const bf16_t* m, int ld, int r0, int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bf16_t* p = m + (r0 + g) * ld + k0 + 2 * t;
    a[0] = *reinterpret_cast<const u32*>(p);
    a[1] = *reinterpret_cast<const u32*>(p + 8 * ld);
    a[2] = *reinterpret_cast<const u32*>(p + 8);
    a[3] = *reinterpret_cast<const u32*>(p + 8 * ld + 8);
}

// B fragment (k0..k0+15 by n0..n0+7) of a matrix stored transposed: bt[n * ld + k].
__device__ __forceinline__ void load_b_frag(u32* b, const bf16_t* bt, int ld, int n0, int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bf16_t* p = bt + (n0 + g) * ld + k0 + 2 * t;
    b[0] = *reinterpret_cast<const u32*>(p);
    b[1] = *reinterpret_cast<const u32*>(p + 8);
}

// acc[n] (rows r0 .. r0 + 15, columns 8n .. 8n + 7, n < 4) += A · B over the k-tiles
// 0 .. ktiles - 1 in order: A row-major (row stride lda), B stored transposed (bt[col * ldb + k]).
__device__ __forceinline__ void mma_rows16_cols32(float (&acc)[4][4], const bf16_t* a, int lda, const bf16_t* bt,
                                                  int ldb, int r0, int ktiles) {
    for (int kk = 0; kk < ktiles; kk++) {
        u32 af[4];
        load_a_frag(af, a, lda, r0, kk * 16);
#pragma unroll
        for (int n = 0; n < 4; n++) {
            u32 bf[2];
            load_b_frag(bf, bt, ldb, n * 8, kk * 16);
            mma_bf16_16816(acc[n], af, bf);
        }
    }
}

// Asynchronous 16-byte global -> shared copy (sm_80+), completed by cp_async_wait.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
// The same copy for a chunk that may lie past the matrix: `full` false copies nothing and
// zero-fills the 16 bytes (the source is not read; pass any valid address).
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool full) {
    const u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(full ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- K-split reduction of the streamed decode GEMVs (matmul.cu's gemv_gs/gemv_wg, quant.cu's
// qmma) ----
// A block owns GS_BM weight rows, up to 64 tokens and one of `nsplit` contiguous K ranges of
// its row block; a partial-sum slot holds one block's sums.
#define GS_BM 128
// Floats of one partial-sum slot: GS_BM rows x 64 tokens.
#define GS_SLOT (GS_BM * 64)

// The end of a streamed block (`Unit`: its output `out` of `rows` rows, row block `mblock`, K
// range `split` of `nsplit`, partial slot `pslot`): its NA accumulators per thread (`at(k)`: accumulator k's row
// within the block and token) into `out`; with a K split, into the unit's partial slot (slots
// pslot - split .. belong to its row block), and the last of the row block's blocks to arrive,
// by `counters[pslot - split]`, adds the slots up in range order and writes `out`.
template <int NA, class At, class Unit>
__device__ __forceinline__ void gs_finish(const float (&acc)[NA], At at, const Unit& u, int tokens,
                                          float* partials, unsigned* counters) {
    __shared__ int last;
    const int row0 = u.mblock * GS_BM;
    if (u.nsplit == 1) {
#pragma unroll
        for (int k = 0; k < NA; k++) {
            const int2 p = at(k);
            if (row0 + p.x < u.rows && p.y < tokens) u.out[(i64)p.y * u.rows + row0 + p.x] = acc[k];
        }
        return;
    }
    float* mine = partials + (i64)u.pslot * GS_SLOT;
#pragma unroll
    for (int k = 0; k < NA; k++) {
        const int2 p = at(k);
        mine[p.y * GS_BM + p.x] = acc[k];
    }
    // Release the partials before counting in; the last block acquires everyone's.
    __threadfence();
    __syncthreads();
    unsigned* counter = counters + (u.pslot - u.split);
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == (unsigned)(u.nsplit - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    // Range by range (this block's own read back too, so its accumulators are free), every
    // output's load of a range issued together.
    const float* first = partials + (i64)(u.pslot - u.split) * GS_SLOT;
    float sum[NA];
    for (int q = 0; q < u.nsplit; q++) {
#pragma unroll
        for (int k = 0; k < NA; k++) {
            const int2 p = at(k);
            const float v = __ldcg(first + (i64)q * GS_SLOT + p.y * GS_BM + p.x);
            sum[k] = q == 0 ? v : sum[k] + v;
        }
    }
#pragma unroll
    for (int k = 0; k < NA; k++) {
        const int2 p = at(k);
        if (row0 + p.x < u.rows && p.y < tokens) u.out[(i64)p.y * u.rows + row0 + p.x] = sum[k];
    }
    // Ready for the next launch that splits this row block (kernels on the stream run in order).
    if (threadIdx.x == 0) *counter = 0u;
}

// ---- Shared by the bf16 (matmul.cu), packed (quant.cu) decode GEMVs and moe.cu's grouped experts ----

// x[c], x[c+1] as hi = bf16x2(x) and lo = bf16x2(x - hi).
__device__ __forceinline__ void split_pair(float a, float b, u32& hi, u32& lo) {
    hi = pack_bf16x2(a, b);
    lo = pack_bf16x2(a - bf16_lo(hi), b - bf16_hi(hi));
}

// c += A * B, one m16n8k16 mma with the A and B fragments as registers.
__device__ __forceinline__ void mma_bf16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
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

// acc += one 32-column step of a 16-row tile against one n-tile: the step's weights as this
// thread loaded them (rows g and g + 8, its 8 columns: mma_load_w) and its token's activations
// as hi and lo halves (mma_load_x), the columns 0..3 then 4..7, each hi then lo.
__device__ __forceinline__ void mma_step_hi_lo(float (&acc)[4], const v4u& a, const v4u& b, const u32 (&hi)[4],
                                               const u32 (&lo)[4]) {
    mma_bf16(acc, a.x, b.x, a.y, b.y, hi[0], hi[1]);
    mma_bf16(acc, a.x, b.x, a.y, b.y, lo[0], lo[1]);
    mma_bf16(acc, a.z, b.z, a.w, b.w, hi[2], hi[3]);
    mma_bf16(acc, a.z, b.z, a.w, b.w, lo[2], lo[3]);
}

// The 128-byte-swizzled K-major tile layout of the warpgroup MMA's operands (rows of 64 bf16 =
// 128 bytes, the 16-byte chunk c of row r at c ^ (r % 8), 8-row groups 1024 bytes apart; tiles start 1 KB-aligned).
__device__ __forceinline__ int swz128(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Shared-memory matrix descriptor: start address, leading-byte offset (unused by swizzled
// K-major tiles), stride-byte offset 1024 (between 8-row groups), 128-byte swizzle.
__device__ __forceinline__ unsigned long long wg_desc(u32 addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}

// d (64 x N f32, N / 2 per thread) += A (64 x 16 bf16) * B (16 x N bf16), both from shared memory.
template <int N>
__device__ __forceinline__ void wg_mma(float* d, unsigned long long a, unsigned long long b);
template <>
__device__ __forceinline__ void wg_mma<8>(float* d, unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(a), "l"(b));
}
template <>
__device__ __forceinline__ void wg_mma<16>(float* d, unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(a), "l"(b));
}
template <>
__device__ __forceinline__ void wg_mma<32>(float* d, unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b));
}
template <>
__device__ __forceinline__ void wg_mma<64>(float* d, unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b));
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// This thread's generic-proxy writes to shared memory (cp.async, stores) become visible to
// the async proxy that wgmma reads through.
__device__ __forceinline__ void wg_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
#endif
