// Device helpers shared by every kernel source: prepended to each `.cu` file before NVRTC
// compiles it. No `#include`s anywhere: NVRTC's built-in headers differ between releases and
// bf16 only needs bit shifts, so the sources stay self-contained.

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef long long i64;

struct alignas(16) v4u {
    u32 x, y, z, w;
};
struct alignas(16) v4f {
    float x, y, z, w;
};

__device__ __forceinline__ float bf16_to_f32(bf16_t b) { return __uint_as_float(((u32)b) << 16); }
// The low / high bf16 of a little-endian pair packed in a u32.
__device__ __forceinline__ float bf16_lo(u32 u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16_hi(u32 u) { return __uint_as_float(u & 0xffff0000u); }

// Round to nearest even, as torch and the `half` crate do; NaN stays a (quiet) NaN.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block, returned to every thread. `scratch` holds 32 floats of shared memory;
// the leading barrier lets a caller reuse it for consecutive reductions.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? scratch[lane] : 0.f;
    return warp_sum(t);
}

// The activations exactly as the CPU backend writes them (expf, not __expf: the f32 paths are
// compared to the CPU at 1e-4).
__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float silu_f(float x) { return x / (1.f + expf(-x)); }
// torch.nn.functional.softplus with beta 1 and threshold 20.
__device__ __forceinline__ float softplus_f(float x) { return x > 20.f ? x : log1pf(expf(x)); }

#define NEG_INF __int_as_float(0xff800000)
__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

// Programmatic dependent launch (Hopper): in a recorded decode step, a kernel that follows
// another may start while that one is still running (Device::launch). So no kernel marks its
// pointers __restrict__: NVVM treats loads through `const __restrict__` parameters as
// invariant and may hoist them above the wait, reading activations the previous kernel has
// not written yet (seen on an H200: the first replayed step came out wrong). Weights are
// streamed with explicit ld.global.nc (ld_stream), which does not need the qualifier. `pdl_enter` lets the next
// kernel be scheduled early and then waits until the previous one has completed and its writes
// are visible; a kernel reads activations and writes anything only after it. GEMVs stream their
// first weights in before waiting. Before sm_90 both are no-ops (launches serialise as usual).
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_enter() {
    pdl_launch_dependents();
    pdl_wait();
}

// quantize_x's arithmetic for one group of 32 activations, a lane each (every lane of the warp
// joins; `v` is lane `lane`'s value): d = amax / 127 (0 for an all-zero group), q = round(v / d)
// into xq[32 * g + lane], d into xd[g], and the sums of each 16 quants into xs[2 * g], xs[2 * g + 1].
// Every producer that quantizes a group this way writes bitwise what quantize_x would.
__device__ __forceinline__ void quantize_group32(float v, int lane, i64 g, signed char* xq, float* xd, int* xs) {
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    const int q = (int)roundf(__fmul_rn(v, id));
    xq[g * 32 + lane] = (signed char)q;
    int s = q;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) xd[g] = d;
    if ((lane & 15) == 0) xs[g * 2 + (lane >> 4)] = s;
}

// Weights are read exactly once per call: keep them out of L1 so x stays cached there.
__device__ __forceinline__ v4u ld_stream(const v4u* p) {
    v4u r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

__device__ __forceinline__ float dot8(v4u w, const float* x) {
    const v4f a = *reinterpret_cast<const v4f*>(x);
    const v4f b = *reinterpret_cast<const v4f*>(x + 4);
    float s = bf16_lo(w.x) * a.x;
    s = fmaf(bf16_hi(w.x), a.y, s);
    s = fmaf(bf16_lo(w.y), a.z, s);
    s = fmaf(bf16_hi(w.y), a.w, s);
    s = fmaf(bf16_lo(w.z), b.x, s);
    s = fmaf(bf16_hi(w.z), b.y, s);
    s = fmaf(bf16_lo(w.w), b.z, s);
    s = fmaf(bf16_hi(w.w), b.w, s);
    return s;
}

// A MoE layer's expert weights, one pointer per expert, passed to a kernel by value as a
// `__grid_constant__` parameter (indexing it by the picked expert then reads the parameter
// bank instead of copying the table to local memory): moe.cu's and quant.cu's expert kernels.
#define MOE_MAX_EXPERTS 512
struct MoeTable {
    unsigned long long w[MOE_MAX_EXPERTS];
};
// The gate and up pointers per expert.
struct MoePair {
    unsigned long long a[MOE_MAX_EXPERTS];
    unsigned long long b[MOE_MAX_EXPERTS];
};
// moe_bucket's listing of a batch's picks by expert, passed by value: the *active_count
// experts picked, ascending, in active[0 ..], the picks of active[j] in members[start[j] ..
// start[j + 1]].
struct MoeListing {
    const int* active_count;
    const int* active;
    const int* start;
    const int* members;
};
