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
