// Row-wise and element-wise ops: embedding gather, RMSNorm (plain, fused with the residual add,
// gated), residual add, SwiGLU and the f32 -> bf16 conversion that feeds cuBLAS.

// out[t, :] = table[ids[t], :] widened to f32. grid (x: column blocks, y: tokens).
extern "C" __global__ void embed_rows(const bf16_t* table, const u32* ids,
                                      float* out, int dim) {
    pdl_enter();
    const int t = blockIdx.y;
    const bf16_t* src = table + (i64)ids[t] * dim;
    float* dst = out + (i64)t * dim;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < dim; c += gridDim.x * blockDim.x)
        dst[c] = bf16_to_f32(src[c]);
}

// Qwen3_5RMSNorm, one block per row: out = x / rms(x) * (1 + w).
extern "C" __global__ void rms_norm_rows(const float* x, const float* w,
                                         float* out, int dim, float eps) {
    pdl_enter();
    __shared__ float scratch[32];
    const float* xr = x + (i64)blockIdx.x * dim;
    float* o = out + (i64)blockIdx.x * dim;
    float ss = 0.f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) ss += xr[c] * xr[c];
    ss = block_sum(ss, scratch);
    const float s = 1.f / sqrtf(ss / (float)dim + eps);
    for (int c = threadIdx.x; c < dim; c += blockDim.x) o[c] = xr[c] * s * (1.f + w[c]);
}

// residual += x, then out = rms_norm(residual). Each thread reads back only the elements it
// wrote itself, so no barrier is needed between the add and the norm.
extern "C" __global__ void add_rms_norm_rows(float* residual, const float* x,
                                             const float* w, float* out,
                                             int dim, float eps) {
    pdl_enter();
    __shared__ float scratch[32];
    float* r = residual + (i64)blockIdx.x * dim;
    const float* xr = x + (i64)blockIdx.x * dim;
    float* o = out + (i64)blockIdx.x * dim;
    float ss = 0.f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        const float v = r[c] + xr[c];
        r[c] = v;
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float s = 1.f / sqrtf(ss / (float)dim + eps);
    for (int c = threadIdx.x; c < dim; c += blockDim.x) o[c] = r[c] * s * (1.f + w[c]);
}

// Qwen3_5RMSNormGated in place, one warp per row: x = w * (x / rms(x)) * silu(z).
extern "C" __global__ void gated_rms_norm_rows(float* x, const float* z,
                                               const float* w, int rows, int dim, float eps) {
    pdl_enter();
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    float* xr = x + (i64)row * dim;
    const float* zr = z + (i64)row * dim;
    float ss = 0.f;
    for (int c = lane; c < dim; c += 32) ss += xr[c] * xr[c];
    ss = warp_sum(ss);
    const float s = 1.f / sqrtf(ss / (float)dim + eps);
    for (int c = lane; c < dim; c += 32) xr[c] = w[c] * (xr[c] * s) * silu_f(zr[c]);
}

extern "C" __global__ void add_inplace(float* residual, const float* x, i64 n) {
    pdl_enter();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        residual[i] += x[i];
}

extern "C" __global__ void swiglu(const float* gate, const float* up,
                                  float* out, i64 n) {
    pdl_enter();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = silu_f(gate[i]) * up[i];
}

extern "C" __global__ void f32_to_bf16_copy(const float* x, bf16_t* y, i64 n) {
    pdl_enter();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = f32_to_bf16(x[i]);
}

// x = hi + lo with hi = bf16(x), lo = bf16(x - hi): two bf16 GEMMs on the pair carry ~16
// mantissa bits of the activations instead of 8 (the precise GEMM path).
extern "C" __global__ void f32_to_bf16_split(const float* x, bf16_t* hi,
                                             bf16_t* lo, i64 n) {
    pdl_enter();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const float v = x[i];
        const bf16_t h = f32_to_bf16(v);
        hi[i] = h;
        lo[i] = f32_to_bf16(v - bf16_to_f32(h));
    }
}

// Row-wise argmax of x: [rows, cols] into idx[rows], as the host's greedy pick: NaN counts as
// -inf, ties go to the lowest column, and a row where nothing beats -inf gives 0.
// grid rows, block 1024.
extern "C" __global__ void __launch_bounds__(1024) argmax_rows(const float* x, u32* idx, int cols) {
    pdl_enter();
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* xr = x + (i64)blockIdx.x * cols;
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = xr[c];
        if (v > bv) {  // false for NaN; columns rise, so a tie keeps the lower one
            bv = v;
            bi = c;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) {
            bv = ov;
            bi = oi;
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        const int nw = (blockDim.x + 31) >> 5;
        bv = lane < nw ? sv[lane] : NEG_INF;
        bi = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) idx[blockIdx.x] = bv > NEG_INF ? (u32)bi : 0u;
    }
}
