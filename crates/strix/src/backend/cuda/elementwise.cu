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

// The row norms keep a thread's elements in registers: up to NORM_VECS float4s of each operand
// (the launcher keeps dim <= 4 * NORM_VECS * blockDim). Every load of a row is issued before
// the first use, so a row costs one memory round trip, not one per element (stores through
// pointers that may alias would otherwise order each load after the previous store), and the
// weights, which no kernel writes, are fetched before waiting on the previous kernel. `vec`
// (set by the launcher) says dim % 4 == 0 and every pointer 16-byte aligned; the scalar loop
// otherwise.
#define NORM_VECS 4

__device__ __forceinline__ float sum_squares4(v4f v) { return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w; }
__device__ __forceinline__ v4f norm_scale4(v4f v, float s, v4f w) {
    return v4f{v.x * s * (1.f + w.x), v.y * s * (1.f + w.y), v.z * s * (1.f + w.z), v.w * s * (1.f + w.w)};
}

// The int8 activations a packed GEMV reads (quant.cu's `quantize_x`: per 32 values
// d = amax / 127, q = round(v / d) by the same float operations, an f32 scale per 32 and the
// sum of each 16 quants), made by the kernel that writes the values: eight consecutive threads
// hold a group of 32 as one float4 each (`i` the float4's index, `on` false past the row, for
// lanes that only join the shuffles). Bitwise what quantize_x makes of the stored values.
__device__ __forceinline__ void quantize4(v4f v, int i, bool on, signed char* xq, float* xd, int* xs) {
    float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    const int q0 = (int)roundf(__fmul_rn(v.x, id)), q1 = (int)roundf(__fmul_rn(v.y, id));
    const int q2 = (int)roundf(__fmul_rn(v.z, id)), q3 = (int)roundf(__fmul_rn(v.w, id));
    int s = q0 + q1 + q2 + q3;
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if (on) {
        ((u32*)xq)[i] = (u32)(q0 & 0xff) | (u32)(q1 & 0xff) << 8 | (u32)(q2 & 0xff) << 16 | (u32)(q3 & 0xff) << 24;
        if ((i & 7) == 0) xd[i >> 3] = d;
        if ((i & 3) == 0) xs[i >> 2] = s;
    }
}

// One row of either norm: v = x (ADD: residual + x, stored back into the residual), then
// out = v / rms(v) * (1 + w). Without ADD, `r` is unused. In the scalar loop each thread
// reads back only the elements it wrote itself: no barrier between the add and the norm.
// With QX (vec only, dim % 32 == 0) the row is also written quantized for a packed GEMV.
template <bool ADD, bool QX = false>
__device__ __forceinline__ void norm_row(float* r, const float* xr, const float* w, float* o, int dim, float eps,
                                         int vec, signed char* xq = nullptr, float* xd = nullptr,
                                         int* xs = nullptr) {
    __shared__ float scratch[32];
    if (vec) {
        const int nv = dim >> 2;
        v4f wv[NORM_VECS], v[NORM_VECS];
#pragma unroll
        for (int k = 0; k < NORM_VECS; ++k) {
            const int i = threadIdx.x + k * blockDim.x;
            if (i < nv) wv[k] = ((const v4f*)w)[i];
        }
        pdl_wait();
        v4f rv[NORM_VECS];
#pragma unroll
        for (int k = 0; k < NORM_VECS; ++k) {
            const int i = threadIdx.x + k * blockDim.x;
            if (i < nv) {
                if (ADD) rv[k] = ((const v4f*)r)[i];
                v[k] = ((const v4f*)xr)[i];
            }
        }
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < NORM_VECS; ++k) {
            const int i = threadIdx.x + k * blockDim.x;
            if (i < nv) {
                if (ADD) {
                    v[k] = v4f{rv[k].x + v[k].x, rv[k].y + v[k].y, rv[k].z + v[k].z, rv[k].w + v[k].w};
                    ((v4f*)r)[i] = v[k];
                }
                ss += sum_squares4(v[k]);
            }
        }
        ss = block_sum(ss, scratch);
        const float s = 1.f / sqrtf(ss / (float)dim + eps);
#pragma unroll
        for (int k = 0; k < NORM_VECS; ++k) {
            const int i = threadIdx.x + k * blockDim.x;
            if (QX) {
                // Every lane of a warp joins the shuffles; nv % 8 == 0, so a group of eight
                // float4s is wholly inside the row or wholly past it.
                if (k * blockDim.x >= nv) break;
                const v4f ov = i < nv ? norm_scale4(v[k], s, wv[k]) : v4f{0.f, 0.f, 0.f, 0.f};
                if (i < nv) ((v4f*)o)[i] = ov;
                quantize4(ov, i, i < nv, xq, xd, xs);
            } else if (i < nv) {
                ((v4f*)o)[i] = norm_scale4(v[k], s, wv[k]);
            }
        }
        return;
    }
    pdl_wait();
    const float* in = ADD ? r : xr;
    float ss = 0.f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        if (ADD) r[c] += xr[c];
        ss += in[c] * in[c];
    }
    ss = block_sum(ss, scratch);
    const float s = 1.f / sqrtf(ss / (float)dim + eps);
    for (int c = threadIdx.x; c < dim; c += blockDim.x) o[c] = in[c] * s * (1.f + w[c]);
}

// Qwen3_5RMSNorm, one block per row: out = x / rms(x) * (1 + w).
extern "C" __global__ void __launch_bounds__(1024)
    rms_norm_rows(const float* x, const float* w, float* out, int dim, float eps, int vec) {
    pdl_launch_dependents();
    const i64 row = (i64)blockIdx.x * dim;
    norm_row<false>(nullptr, x + row, w, out + row, dim, eps, vec);
}

// residual += x, then out = rms_norm(residual), one block per row.
extern "C" __global__ void __launch_bounds__(1024)
    add_rms_norm_rows(float* residual, const float* x, const float* w, float* out, int dim, float eps, int vec) {
    pdl_launch_dependents();
    const i64 row = (i64)blockIdx.x * dim;
    norm_row<true>(residual + row, x + row, w, out + row, dim, eps, vec);
}

// One row of each norm above, also written quantized for the packed GEMV that reads it next
// (`xq` [dim] i8, `xd` [dim / 32] scales, `xs` [dim / 16] sums); the launcher guarantees the
// `vec` layout and dim % 32 == 0.
extern "C" __global__ void __launch_bounds__(1024) rms_norm_row_q(const float* x, const float* w, float* out,
                                                                  signed char* xq, float* xd, int* xs, int dim,
                                                                  float eps) {
    pdl_launch_dependents();
    norm_row<false, true>(nullptr, x, w, out, dim, eps, 1, xq, xd, xs);
}

extern "C" __global__ void __launch_bounds__(1024)
    add_rms_norm_row_q(float* residual, const float* x, const float* w, float* out, signed char* xq, float* xd,
                       int* xs, int dim, float eps) {
    pdl_launch_dependents();
    norm_row<true, true>(residual, x, w, out, dim, eps, 1, xq, xd, xs);
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

extern "C" __global__ void swiglu(const float* gate, const float* up,
                                  float* out, i64 n) {
    pdl_enter();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = silu_f(gate[i]) * up[i];
}

// swiglu of one token's [32 * groups] values, also written quantized for the down projection's
// packed GEMV: one warp per 32, the values and operations of swiglu and quantize_x.
extern "C" __global__ void swiglu_q(const float* gate, const float* up, float* out, signed char* xq, float* xd,
                                    int* xs, int groups) {
    pdl_enter();
    const int lane = threadIdx.x & 31;
    const i64 g = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (g >= groups) return;
    const i64 i = g * 32 + lane;
    const float v = silu_f(gate[i]) * up[i];
    out[i] = v;
    quantize_group32(v, lane, g, xq, xd, xs);
}

// SwiGLU straight into a GEMM's bf16 input: silu(gate) * up rounded as f32_to_bf16_copy (with
// `lo`, as f32_to_bf16_split) rounds swiglu's f32 result, without storing that.
extern "C" __global__ void swiglu_to_bf16(const float* gate, const float* up, bf16_t* hi, bf16_t* lo, i64 n) {
    pdl_enter();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const float v = silu_f(gate[i]) * up[i];
        const bf16_t h = f32_to_bf16(v);
        hi[i] = h;
        if (lo) lo[i] = f32_to_bf16(v - bf16_to_f32(h));
    }
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
