// Kernels on GGML block formats (Q8_0, Q4_0, Q4_K, Q6_K) kept packed on the device.
//
// Device layout (made by `quant.rs::repack` on upload; the same bits as the GGUF blocks, only
// regrouped so every lane's weight load is one aligned, coalesced 16-byte load): for a
// [rows, cols] matrix, first the quant plane of every row, then the scale planes.
//  - Q8_0: quants row = cols bytes (i8); scales: f16 per 32 weights, [rows][cols/32].
//  - Q4_0: quants row = cols/2 bytes, 16 bytes per block in GGML's nibble order (byte j holds
//    weight j low, j+16 high); scales: f16 per block, [rows][cols/32].
//  - Q4_K: quants row = cols/2 bytes, each super-block's 128 nibble bytes as in GGML; meta:
//    the super-block's first 16 bytes (f16 d, f16 dmin, 12 bytes of 6-bit scales/mins),
//    [rows][cols/256][16].
//  - Q6_K: quants row = 3 planes of cols/4 bytes. A "unit" is 64 weights: super-block sb, half
//    n, sixteenth j (unit = 4 sb + 2 n + j) covers ql[64n+16j..+16] (plane 0),
//    ql[64n+32+16j..+16] (plane 1) and qh[32n+16j..+16] (plane 2); scales: the unit's four
//    i8 scales sc[8n+j+{0,2,4,6}] as one u32, [rows][cols/64]; then f16 d, [rows][cols/256].
//
// Decode GEMV (qgemv_*): activations are quantized per 32 values to int8 with an f32 scale
// (quantize_x, GGML's Q8_0 rule without rounding the scale to f16), then every 32-bit word of
// weights meets 4 activations in one dp4a. Integer sums of a block are exact; the block's
// float contribution and the per-row sum are formed in a fixed order that depends on the shape
// alone, so a token's result is bitwise the same in any batch (see gemv_rows_body in
// matmul.cu for the scheme, which this follows).

typedef signed char i8;
typedef unsigned char u8;
typedef unsigned short u16;

#define QG_WARPS 8

__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Weights are read once per call: stream them past L1.
__device__ __forceinline__ v4u ldq(const void* p) { return ld_stream(reinterpret_cast<const v4u*>(p)); }
// Scales are shared between lanes: read-only path, cached.
__device__ __forceinline__ v4u ldg4(const void* p) {
    v4u r;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ u32 ldg32(const void* p) {
    u32 r;
    asm("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ u16 ldg16(const void* p) {
    u16 r;
    asm("ld.global.nc.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ int word(const v4u& v, int k) { return (int)(k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w); }

// ---------------------------------------------------------------------------------------
// Activation quantization: one warp per 32 values. xq[i] = round(x[i] / d) with
// d = amax / 127 (0 for an all-zero block); xs holds the sum of each 16 quants.

extern "C" __global__ void quantize_x(const float* x, i8* xq,
                                      float* xd, int* xs, int groups) { pdl_enter();
    const int lane = threadIdx.x & 31;
    const i64 g = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (g >= groups) return;
    quantize_group32(x[g * 32 + lane], lane, g, xq, xd, xs);
}

// Activations of one token, quantized.
struct XQ {
    const i8* q;    // [cols]
    const float* d; // [cols / 32]
    const int* s;   // [cols / 16]
};

__device__ __forceinline__ v4u ldx(const i8* p) { return *reinterpret_cast<const v4u*>(p); }

// ---------------------------------------------------------------------------------------
// Formats. `wq` points at the quant planes, `ws` at the scale planes (after all rows' quants).
// Each has a `Raw` (one unit's loaded bytes), `units(cols)`, `load`, `X` / `loadx` (the
// activations a unit meets) and `dotx` (the unit's contribution to a row's sum), and
// `decode` (the exact f32 weights of a unit, as runs of 16 consecutive columns, computed with
// the same float operations as the CPU's dequantize_row).

struct Q8_0F {
    static constexpr int RUNS = 1;
    struct Raw {
        v4u w;
        u16 d;
    };
    static __device__ __forceinline__ int units(int cols) { return cols >> 4; }
    static __device__ __forceinline__ i64 qrow(int cols) { return cols; }
    static __device__ __forceinline__ Raw load(const u8* wq, const u8* ws, i64 row, int rows, int cols, int i) {
        Raw r;
        r.w = ldq(wq + row * qrow(cols) + 16 * i);
        const u16* d = reinterpret_cast<const u16*>(ws);
        r.d = ldg16(d + row * (cols >> 5) + (i >> 1));
        return r;
    }
    // The activations unit i meets, loaded once for all the rows a warp takes.
    struct X {
        v4u a;
        float d;
    };
    static __device__ __forceinline__ X loadx(int i, const XQ& x) { return X{ldx(x.q + 16 * i), x.d[i >> 1]}; }
    static __device__ __forceinline__ float dotx(const Raw& r, int i, const X& a) {
        int s = dp4a((int)r.w.x, (int)a.a.x, 0);
        s = dp4a((int)r.w.y, (int)a.a.y, s);
        s = dp4a((int)r.w.z, (int)a.a.z, s);
        s = dp4a((int)r.w.w, (int)a.a.w, s);
        return __fmul_rn(__fmul_rn(f16_to_f32(r.d), a.d), (float)s);
    }
    static __device__ __forceinline__ void decode(const Raw& r, int i, int* pos, float (*v)[16]) {
        const float d = f16_to_f32(r.d);
        pos[0] = 16 * i;
#pragma unroll
        for (int k = 0; k < 16; k++) {
            const int b = (int)(i8)((word(r.w, k >> 2) >> (8 * (k & 3))) & 0xff);
            v[0][k] = __fmul_rn((float)b, d);
        }
    }
};

struct Q4_0F {
    static constexpr int RUNS = 2;
    struct Raw {
        v4u w;
        u16 d;
    };
    static __device__ __forceinline__ int units(int cols) { return cols >> 5; }
    static __device__ __forceinline__ i64 qrow(int cols) { return cols >> 1; }
    static __device__ __forceinline__ Raw load(const u8* wq, const u8* ws, i64 row, int rows, int cols, int i) {
        Raw r;
        r.w = ldq(wq + row * qrow(cols) + 16 * i);
        const u16* d = reinterpret_cast<const u16*>(ws);
        r.d = ldg16(d + row * (cols >> 5) + i);
        return r;
    }
    struct X {
        v4u a, b;
        float d;
        int sum;
    };
    static __device__ __forceinline__ X loadx(int i, const XQ& x) {
        // Two 4-byte loads: the sums are only 4-byte aligned (quantize_x's buffer layout).
        return X{ldx(x.q + 32 * i), ldx(x.q + 32 * i + 16), x.d[i], x.s[2 * i] + x.s[2 * i + 1]};
    }
    static __device__ __forceinline__ float dotx(const Raw& r, int i, const X& x) {
        int s = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int w = word(r.w, k);
            s = dp4a(w & 0x0f0f0f0f, word(x.a, k), s);
            s = dp4a((w >> 4) & 0x0f0f0f0f, word(x.b, k), s);
        }
        return __fmul_rn(__fmul_rn(f16_to_f32(r.d), x.d), (float)(s - 8 * x.sum));
    }
    static __device__ __forceinline__ void decode(const Raw& r, int i, int* pos, float (*v)[16]) {
        const float d = f16_to_f32(r.d);
        pos[0] = 32 * i;
        pos[1] = 32 * i + 16;
#pragma unroll
        for (int k = 0; k < 16; k++) {
            const int b = (word(r.w, k >> 2) >> (8 * (k & 3))) & 0xff;
            v[0][k] = __fmul_rn((float)((b & 15) - 8), d);
            v[1][k] = __fmul_rn((float)((b >> 4) - 8), d);
        }
    }
};

// Scales and mins of Q4_K sub-blocks 2g and 2g + 1 from the 12 scale bytes held in words a, b,
// c (bytes 0-3, 4-7, 8-11), both at once and without branches (lanes of a warp hold different
// g); the same values as q4_k_scale_min in quant/blocks.rs: sub-blocks 0-3 are the low 6 bits
// of bytes 0-3 (scales) and 4-7 (mins), sub-blocks 4-7 take their low 4 bits from bytes 8-11
// and their top 2 from the top bits of bytes 0-3 / 4-7.
__device__ __forceinline__ void q4k_scale_min2(int g, u32 a, u32 b, u32 c, int& sc1, int& m1, int& sc2,
                                               int& m2) {
    const int sh = 16 * (g & 1);
    const u32 A = (a >> sh) & 0xffff, B = (b >> sh) & 0xffff, C = (c >> sh) & 0xffff;
    const u32 sc = g < 2 ? A & 0x3f3f : (C & 0x0f0f) | ((A >> 2) & 0x3030);
    const u32 m = g < 2 ? B & 0x3f3f : ((C >> 4) & 0x0f0f) | ((B >> 2) & 0x3030);
    sc1 = sc & 0xff;
    sc2 = sc >> 8;
    m1 = m & 0xff;
    m2 = m >> 8;
}

struct Q4_KF {
    static constexpr int RUNS = 2;
    struct Raw {
        v4u w;
        v4u meta;
    };
    static __device__ __forceinline__ int units(int cols) { return cols >> 5; }
    static __device__ __forceinline__ i64 qrow(int cols) { return cols >> 1; }
    static __device__ __forceinline__ Raw load(const u8* wq, const u8* ws, i64 row, int rows, int cols, int i) {
        Raw r;
        r.w = ldq(wq + row * qrow(cols) + 16 * i);
        const v4u* meta = reinterpret_cast<const v4u*>(ws);
        r.meta = ldg4(meta + row * (cols >> 8) + (i >> 3));
        return r;
    }
    // Unit i: chunk c = i % 8 of super-block i / 8; group g = c / 2 holds sub-block 2g in its
    // low nibbles and 2g + 1 in its high ones; half h = c % 2 picks 16 of the group's 32 bytes.
    static __device__ __forceinline__ void scales(const Raw& r, int i, float& d1, float& m1, float& d2,
                                                  float& m2) {
        const int g = (i & 7) >> 1;
        const float d = f16_to_f32((u16)(r.meta.x & 0xffff)), dmin = f16_to_f32((u16)(r.meta.x >> 16));
        int sc1, mn1, sc2, mn2;
        q4k_scale_min2(g, r.meta.y, r.meta.z, r.meta.w, sc1, mn1, sc2, mn2);
        d1 = __fmul_rn(d, (float)sc1);
        m1 = __fmul_rn(dmin, (float)mn1);
        d2 = __fmul_rn(d, (float)sc2);
        m2 = __fmul_rn(dmin, (float)mn2);
    }
    struct X {
        v4u a, b;
        float d1, d2;
        int s1, s2;
    };
    static __device__ __forceinline__ X loadx(int i, const XQ& x) {
        const int p = (i >> 3) * 256 + 64 * ((i & 7) >> 1) + 16 * (i & 1);
        return X{ldx(x.q + p), ldx(x.q + p + 32), x.d[p >> 5], x.d[(p >> 5) + 1], x.s[p >> 4], x.s[(p >> 4) + 2]};
    }
    static __device__ __forceinline__ float dotx(const Raw& r, int i, const X& x) {
        float d1, m1, d2, m2;
        scales(r, i, d1, m1, d2, m2);
        int s1 = 0, s2 = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int w = word(r.w, k);
            s1 = dp4a(w & 0x0f0f0f0f, word(x.a, k), s1);
            s2 = dp4a((w >> 4) & 0x0f0f0f0f, word(x.b, k), s2);
        }
        const float lo = __fsub_rn(__fmul_rn(d1, (float)s1), __fmul_rn(m1, (float)x.s1));
        const float hi = __fsub_rn(__fmul_rn(d2, (float)s2), __fmul_rn(m2, (float)x.s2));
        return __fadd_rn(__fmul_rn(x.d1, lo), __fmul_rn(x.d2, hi));
    }
    static __device__ __forceinline__ void decode(const Raw& r, int i, int* pos, float (*v)[16]) {
        float d1, m1, d2, m2;
        scales(r, i, d1, m1, d2, m2);
        const int g = (i & 7) >> 1, h = i & 1;
        pos[0] = (i >> 3) * 256 + 64 * g + 16 * h;
        pos[1] = pos[0] + 32;
#pragma unroll
        for (int k = 0; k < 16; k++) {
            const int b = (word(r.w, k >> 2) >> (8 * (k & 3))) & 0xff;
            v[0][k] = __fsub_rn(__fmul_rn(d1, (float)(b & 15)), m1);
            v[1][k] = __fsub_rn(__fmul_rn(d2, (float)(b >> 4)), m2);
        }
    }
};

struct Q6_KF {
    static constexpr int RUNS = 4;
    struct Raw {
        v4u l0, l1, h;
        u32 sc;
        u16 d;
    };
    static __device__ __forceinline__ int units(int cols) { return cols >> 6; }
    static __device__ __forceinline__ i64 qrow(int cols) { return 3 * (i64)(cols >> 2); }
    static __device__ __forceinline__ Raw load(const u8* wq, const u8* ws, i64 row, int rows, int cols, int i) {
        Raw r;
        const u8* base = wq + row * qrow(cols) + 16 * i;
        const int plane = cols >> 2;
        r.l0 = ldq(base);
        r.l1 = ldq(base + plane);
        r.h = ldq(base + 2 * plane);
        const u32* sc = reinterpret_cast<const u32*>(ws);
        r.sc = ldg32(sc + row * (cols >> 6) + i);
        const u16* d = reinterpret_cast<const u16*>(sc + (i64)rows * (cols >> 6));
        r.d = ldg16(d + row * (cols >> 8) + (i >> 2));
        return r;
    }
    // The four 6-bit quant words (k = 0..3 for columns +0, +32, +64, +96) of word w.
    static __device__ __forceinline__ int quants(const Raw& r, int k, int w) {
        const int l0 = word(r.l0, w), l1 = word(r.l1, w), h = word(r.h, w);
        switch (k) {
        case 0: return (l0 & 0x0f0f0f0f) | ((h << 4) & 0x30303030);
        case 1: return (l1 & 0x0f0f0f0f) | ((h << 2) & 0x30303030);
        case 2: return ((l0 >> 4) & 0x0f0f0f0f) | (h & 0x30303030);
        default: return ((l1 >> 4) & 0x0f0f0f0f) | ((h >> 2) & 0x30303030);
        }
    }
    // Unit i: super-block i / 4, half n = (i / 2) % 2, sixteenth j = i % 2; its four runs
    // start at columns 256 sb + 128 n + 16 j + 32 k.
    static __device__ __forceinline__ int first(int i) { return (i >> 2) * 256 + 128 * ((i >> 1) & 1) + 16 * (i & 1); }
    struct X {
        v4u a[4];
        float d[4];
        int s[4];
    };
    static __device__ __forceinline__ X loadx(int i, const XQ& x) {
        const int p = first(i);
        X r;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            r.a[k] = ldx(x.q + p + 32 * k);
            r.d[k] = x.d[(p >> 5) + k];
            r.s[k] = x.s[(p >> 4) + 2 * k];
        }
        return r;
    }
    static __device__ __forceinline__ float dotx(const Raw& r, int i, const X& x) {
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int s = 0;
#pragma unroll
            for (int w = 0; w < 4; w++) s = dp4a(quants(r, k, w), word(x.a[k], w), s);
            const int sc = (int)(i8)((r.sc >> (8 * k)) & 0xff);
            const int q = sc * (s - 32 * x.s[k]);
            acc = __fadd_rn(acc, __fmul_rn(x.d[k], (float)q));
        }
        return __fmul_rn(f16_to_f32(r.d), acc);
    }
    static __device__ __forceinline__ void decode(const Raw& r, int i, int* pos, float (*v)[16]) {
        const float d = f16_to_f32(r.d);
        const int p = first(i);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            pos[k] = p + 32 * k;
            const float ds = __fmul_rn(d, (float)(int)(i8)((r.sc >> (8 * k)) & 0xff));
#pragma unroll
            for (int e = 0; e < 16; e++) {
                const int q = (quants(r, k, e >> 2) >> (8 * (e & 3))) & 0xff;
                v[k][e] = __fmul_rn(ds, (float)(q - 32));
            }
        }
    }
};

// ---------------------------------------------------------------------------------------
// Several packed weights of one format that read the same activations (a layer's input
// projections) go in one launch, as gemv_multi in matmul.cu: segment j owns the row blocks
// [block_end[j-1], block_end[j]) along y; unused segments end at the total. Each segment's rows
// are computed by qgemv_body's arithmetic, so a token's result is the same in any batch.
#define QG_NT 8
#define QG_MAX_SEGS 4
struct QSegs {
    unsigned long long wq[QG_MAX_SEGS];
    unsigned long long ws[QG_MAX_SEGS];
    unsigned long long out[QG_MAX_SEGS];
    int rows[QG_MAX_SEGS];
    int block_end[QG_MAX_SEGS];
};

// ---------------------------------------------------------------------------------------
// Decode GEMV. A warp takes R consecutive weight rows (or its 1/S part of them: S
// warps of a block share the rows, S = 1 << log2s, chosen by the launcher from the shape) and
// walks its units: lane `lane` of part `part` takes units i_k = part * 32 + lane + k * 32 S,
// U units of each of the R rows loaded (R * U 16-byte loads per lane in flight) before the
// first dp4a, each activation unit loaded once for the R rows. The first R * U loads are
// issued before the wait on the previous kernel (weights are never written by one), so under
// programmatic dependent launch the weight stream starts while the previous kernel finishes.
//
// Every row's sum is formed in one order that depends on the shape and S alone: per lane
// acc += dot(unit i_k) for k = 0, 1, ..., then the warp's butterfly sum, then the S parts in
// order. R, U and the tokens per block (NT) do not enter it, so the one-token kernel (any R)
// and the batched one agree bitwise.

template <class F, int NT, int R, int U>
__device__ __forceinline__ void qgemv_body(const u8* wq, const u8* ws, const i8* xq, const float* xd,
                                            const int* xs, float* out, int rows, int cols, int tokens,
                                            int blk, int log2s) {
    __shared__ float partial[QG_WARPS][R * NT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int part = warp & ((1 << log2s) - 1);
    const i64 row0 = ((i64)blk * (QG_WARPS >> log2s) + (warp >> log2s)) * R;
    const int t0 = blockIdx.x * NT;
    const int nt = imin(NT, tokens - t0);
    const int n = F::units(cols);
    const int stride = 32 << log2s;
    const int first = part * 32 + lane;
    // Rows past the end load the last row (no branch around the loads) and are not stored.
    i64 rr[R];
#pragma unroll
    for (int r = 0; r < R; r++) rr[r] = row0 + r < rows ? row0 + r : rows - 1;
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[r][t] = 0.f;
    typename F::Raw w[R][U];
    pdl_launch_dependents();
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int i = first + stride * u;
        if (i < n)
#pragma unroll
            for (int r = 0; r < R; r++) w[r][u] = F::load(wq, ws, rr[r], rows, cols, i);
    }
    pdl_wait();
    for (int k0 = 0; first + stride * k0 < n; k0 += U) {
        if (k0 > 0) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int i = first + stride * (k0 + u);
                if (i < n)
#pragma unroll
                    for (int r = 0; r < R; r++) w[r][u] = F::load(wq, ws, rr[r], rows, cols, i);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = first + stride * (k0 + u);
            if (i < n) {
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    // Past the last token, recompute the last one (dropped below).
                    const i64 tt = NT == 1 ? t0 : t0 + imin(t, nt - 1);
                    const XQ x{xq + tt * cols, xd + tt * (cols >> 5), xs + tt * (cols >> 4)};
                    const typename F::X a = F::loadx(i, x);
#pragma unroll
                    for (int r = 0; r < R; r++) acc[r][t] = __fadd_rn(acc[r][t], F::dotx(w[r][u], i, a));
                }
            }
        }
    }
    if (log2s == 0) {
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int t = 0; t < NT; t++) {
                const float a = warp_sum(acc[r][t]);
                if (lane == 0 && row0 + r < rows && t < nt) out[(i64)(t0 + t) * rows + row0 + r] = a;
            }
        return;
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const float a = warp_sum(acc[r][t]);
            if (lane == 0) partial[warp][r * NT + t] = a;
        }
    __syncthreads();
    if (part == 0 && lane < R * NT) {
        const int r = lane / NT, t = lane % NT;
        float sum = partial[warp][lane];
        for (int k = 1; k < (1 << log2s); k++) sum = __fadd_rn(sum, partial[warp + k][lane]);
        if (row0 + r < rows && t < nt) out[(i64)(t0 + t) * rows + row0 + r] = sum;
    }
}

template <class F, int NT, int R, int U>
__device__ __forceinline__ void qgemv_multi_body(const QSegs& segs, const i8* xq, const float* xd,
                                                  const int* xs, int cols, int tokens, int log2s) {
    unsigned long long wq = segs.wq[0], ws = segs.ws[0], out = segs.out[0];
    int rows = segs.rows[0], first = 0;
#pragma unroll
    for (int k = 1; k < QG_MAX_SEGS; k++) {
        if ((int)blockIdx.y >= segs.block_end[k - 1]) {
            wq = segs.wq[k];
            ws = segs.ws[k];
            out = segs.out[k];
            rows = segs.rows[k];
            first = segs.block_end[k - 1];
        }
    }
    qgemv_body<F, NT, R, U>(reinterpret_cast<const u8*>(wq), reinterpret_cast<const u8*>(ws), xq, xd, xs,
                             reinterpret_cast<float*>(out), rows, cols, tokens, (int)blockIdx.y - first, log2s);
}

// One token's gate and up projections, the SwiGLU, and its quantization for the down
// projection's GEMV, in one launch (no gate/up outputs, no swiglu_q kernel between the GEMVs).
// Warp w of block b takes the QG_GLU rows row0 = (b * QG_WARPS + w) * QG_GLU.. of both
// matrices, gate's as rows 0..QG_GLU of qgemv_body's R and up's after them, each row's sum by
// qgemv_body's arithmetic with one warp a row (S = 1: the launcher takes this kernel only where
// the fused gate/up GEMV would split no row, so every sum is bitwise that launch's, and the
// batch's). Then silu(g) * u as swiglu, and warp 0 quantizes the block's QG_WARPS * QG_GLU = 32
// values (one group of quantize_x). grid n / 32, block QG_WARPS * 32.
#define QG_GLU 4
template <class F, int U>
__device__ __forceinline__ void qgemv_glu_body(const u8* gq, const u8* gs, const u8* uq, const u8* us,
                                                const i8* xq, const float* xd, const int* xs, float* act,
                                                i8* aq, float* ad, int* as, int n, int cols) {
    constexpr int R = 2 * QG_GLU;
    static_assert(QG_WARPS * QG_GLU == 32, "a block's values are one quantization group");
    __shared__ float vals[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 row0 = ((i64)blockIdx.x * QG_WARPS + warp) * QG_GLU;
    const int units = F::units(cols);
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.f;
    typename F::Raw w[R][U];
    pdl_launch_dependents();
    // Rows 0..QG_GLU of gate, then the same rows of up; the first units go out before the wait.
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int i = lane + 32 * u;
        if (i < units)
#pragma unroll
            for (int r = 0; r < R; r++)
                w[r][u] = r < QG_GLU ? F::load(gq, gs, row0 + r, n, cols, i) : F::load(uq, us, row0 + r - QG_GLU, n, cols, i);
    }
    pdl_wait();
    const XQ x{xq, xd, xs};
    for (int k0 = 0; lane + 32 * k0 < units; k0 += U) {
        if (k0 > 0) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int i = lane + 32 * (k0 + u);
                if (i < units)
#pragma unroll
                    for (int r = 0; r < R; r++)
                        w[r][u] = r < QG_GLU ? F::load(gq, gs, row0 + r, n, cols, i)
                                             : F::load(uq, us, row0 + r - QG_GLU, n, cols, i);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = lane + 32 * (k0 + u);
            if (i < units) {
                const typename F::X a = F::loadx(i, x);
#pragma unroll
                for (int r = 0; r < R; r++) acc[r] = __fadd_rn(acc[r], F::dotx(w[r][u], i, a));
            }
        }
    }
#pragma unroll
    for (int r = 0; r < QG_GLU; r++) {
        const float g = warp_sum(acc[r]);
        const float u = warp_sum(acc[QG_GLU + r]);
        if (lane == 0) vals[warp * QG_GLU + r] = silu_f(g) * u;
    }
    __syncthreads();
    if (warp != 0) return;
    act[(i64)blockIdx.x * 32 + lane] = vals[lane];
    quantize_group32(vals[lane], lane, blockIdx.x, aq, ad, as);
}
#define QGEMV_GLU(NAME, F, U, MINB)                                                                          \
    extern "C" __global__ void __launch_bounds__(QG_WARPS * 32, MINB)                                        \
        qgemv_glu_##NAME(const u8* gq, const u8* gs, const u8* uq, const u8* us, const i8* xq, const float* xd, \
                         const int* xs, float* act, i8* aq, float* ad, int* as, int n, int cols) {             \
        qgemv_glu_body<F, U>(gq, gs, uq, us, xq, xd, xs, act, aq, ad, as, n, cols);                          \
    }
// (U, blocks per SM): the most that fit without spilling.
QGEMV_GLU(q8_0, Q8_0F, 1, 2)
QGEMV_GLU(q4_0, Q4_0F, 1, 2)
QGEMV_GLU(q4_k, Q4_KF, 1, 2)
QGEMV_GLU(q6_k, Q6_KF, 1, 1)

// One token, R rows a warp, held to 65536 / (256 * MINB) registers a thread; and the batch
// (QG_NT tokens a block, RB rows a warp). Grid (ceil(tokens / NT), row blocks), block
// QG_WARPS * 32; a block takes (QG_WARPS >> log2s) * R rows.
#define QGEMV(NAME, F, R, U, MINB)                                                                          \
    extern "C" __global__ void __launch_bounds__(QG_WARPS * 32, MINB)                                        \
        qgemv_##NAME##_r##R(const u8* wq, const u8* ws, const i8* xq, const float* xd, const int* xs,       \
                             float* out, int rows, int cols, int tokens, int log2s) {                        \
        qgemv_body<F, 1, R, U>(wq, ws, xq, xd, xs, out, rows, cols, tokens, blockIdx.y, log2s);             \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(QG_WARPS * 32, MINB)                                        \
        qgemv_multi_##NAME##_r##R(QSegs segs, const i8* xq, const float* xd, const int* xs, int cols,       \
                                   int tokens, int log2s) {                                                  \
        qgemv_multi_body<F, 1, R, U>(segs, xq, xd, xs, cols, tokens, log2s);                                \
    }
#define QGEMV_ROWS(NAME, F, RB, UB)                                                                          \
    extern "C" __global__ void __launch_bounds__(QG_WARPS * 32, 2)                                           \
        qgemv_rows_##NAME(const u8* wq, const u8* ws, const i8* xq, const float* xd, const int* xs,          \
                          float* out, int rows, int cols, int tokens, int log2s) {                           \
        qgemv_body<F, QG_NT, RB, UB>(wq, ws, xq, xd, xs, out, rows, cols, tokens, blockIdx.y, log2s);        \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(QG_WARPS * 32, 2)                                           \
        qgemv_multi_rows_##NAME(QSegs segs, const i8* xq, const float* xd, const int* xs, int cols,          \
                                int tokens, int log2s) {                                                     \
        qgemv_multi_body<F, QG_NT, RB, UB>(segs, xq, xd, xs, cols, tokens, log2s);                           \
    }
// (U, blocks per SM) for 1, 2 and 4 rows a warp (min_blocks_per_sm in quant.rs); (rows a warp,
// U) of the batched kernel (batch_rows_per_warp): the most that fit without spilling.
#define QGEMV_ALL(NAME, F, U1, U2, B2, U4, B4, RB, UB)                                                      \
    QGEMV(NAME, F, 1, U1, 4)                                                                                 \
    QGEMV(NAME, F, 2, U2, B2)                                                                                \
    QGEMV(NAME, F, 4, U4, B4)                                                                                \
    QGEMV_ROWS(NAME, F, RB, UB)
QGEMV_ALL(q8_0, Q8_0F, 4, 4, 3, 2, 2, 4, 1)
QGEMV_ALL(q4_0, Q4_0F, 4, 4, 3, 2, 2, 2, 1)
QGEMV_ALL(q4_k, Q4_KF, 4, 2, 3, 1, 2, 2, 1)
QGEMV_ALL(q6_k, Q6_KF, 2, 2, 2, 1, 1, 2, 1)

// ---------------------------------------------------------------------------------------
// A sparse MoE block's experts on packed weights (moe.rs): moe.cu's grouped kernels on a
// format's units. The picks come listed by expert (moe_bucket); block (rb, j) takes the j-th
// active expert and its warp w row rb * QG_WARPS + w, and carries up to QMOE_GROUP of the
// expert's picks through the row at once, each against its own token's quantized activations.
// A pick's sum is formed as qgemv_body's with one warp a row (units lane, lane + 32, ... in
// order, then the warp's butterfly), so it does not depend on the other picks. Expert e's
// quants start at table[e], its scales after all its rows' quants.
#define QMOE_GROUP 8

template <class F>
__device__ __forceinline__ void qmoe_row_dots(const u8* wq, i64 row, int rows, int cols, const XQ (&xs)[QMOE_GROUP],
                                              int count, int lane, float (&out)[QMOE_GROUP]) {
    const u8* ws = wq + (i64)rows * F::qrow(cols);
    const int n = F::units(cols);
    float acc[QMOE_GROUP];
#pragma unroll
    for (int q = 0; q < QMOE_GROUP; q++) acc[q] = 0.f;
    for (int i0 = lane; i0 < n; i0 += 64) {
        typename F::Raw w[2];
#pragma unroll
        for (int u = 0; u < 2; u++)
            if (i0 + 32 * u < n) w[u] = F::load(wq, ws, row, rows, cols, i0 + 32 * u);
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int i = i0 + 32 * u;
            if (i < n)
#pragma unroll
                for (int q = 0; q < QMOE_GROUP; q++)
                    if (q < count) acc[q] = __fadd_rn(acc[q], F::dotx(w[u], i, F::loadx(i, xs[q])));
        }
    }
#pragma unroll
    for (int q = 0; q < QMOE_GROUP; q++) out[q] = warp_sum(acc[q]);
}

// The quantized activations of row `r` of a [*, cols] quantize_x output.
__device__ __forceinline__ XQ qmoe_x(const i8* q, const float* d, const int* s, i64 r, int cols) {
    return XQ{q + r * cols, d + r * (cols >> 5), s + r * (cols >> 4)};
}

// grid (ceil(inter / QG_WARPS), min(picks, experts)), block QG_WARPS * 32: act[pick][row] =
// silu(gate · x) * (up · x), x the pick's token (pick / k) of quantize_x's [tokens, hidden].
template <class F>
__device__ __forceinline__ void qmoe_gate_up_body(const MoePair& t, const i8* xq, const float* xd, const int* xs,
                                                  int k, int inter, int hidden, const MoeListing& l, float* act) {
    pdl_enter();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int j = blockIdx.y, row = blockIdx.x * QG_WARPS + warp;
    if (j >= *l.active_count || row >= inter) return;
    const int* members = l.members;
    const int e = l.active[j], end = l.start[j + 1];
    const u8* g = reinterpret_cast<const u8*>(t.a[e]);
    const u8* u = reinterpret_cast<const u8*>(t.b[e]);
    for (int p0 = l.start[j]; p0 < end; p0 += QMOE_GROUP) {
        const int count = imin(QMOE_GROUP, end - p0);
        XQ x[QMOE_GROUP];
#pragma unroll
        for (int q = 0; q < QMOE_GROUP; q++) x[q] = qmoe_x(xq, xd, xs, members[p0 + imin(q, count - 1)] / k, hidden);
        float gs[QMOE_GROUP], us[QMOE_GROUP];
        qmoe_row_dots<F>(g, row, inter, hidden, x, count, lane, gs);
        qmoe_row_dots<F>(u, row, inter, hidden, x, count, lane, us);
#pragma unroll
        for (int q = 0; q < QMOE_GROUP; q++)
            if (q < count && lane == 0) act[(i64)members[p0 + q] * inter + row] = silu_f(gs[q]) * us[q];
    }
}

// grid (ceil(hidden / QG_WARPS), min(picks, experts)): y[pick][c] = down_e[c] · act[pick], act
// quantized per pick ([picks, inter]).
template <class F>
__device__ __forceinline__ void qmoe_down_body(const MoeTable& t, const i8* aq, const float* ad, const int* as,
                                               int inter, int hidden, const MoeListing& l, float* y) {
    pdl_enter();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int j = blockIdx.y, c = blockIdx.x * QG_WARPS + warp;
    if (j >= *l.active_count || c >= hidden) return;
    const int* members = l.members;
    const int end = l.start[j + 1];
    const u8* w = reinterpret_cast<const u8*>(t.w[l.active[j]]);
    for (int p0 = l.start[j]; p0 < end; p0 += QMOE_GROUP) {
        const int count = imin(QMOE_GROUP, end - p0);
        XQ x[QMOE_GROUP];
#pragma unroll
        for (int q = 0; q < QMOE_GROUP; q++) x[q] = qmoe_x(aq, ad, as, members[p0 + imin(q, count - 1)], inter);
        float ys[QMOE_GROUP];
        qmoe_row_dots<F>(w, c, hidden, inter, x, count, lane, ys);
#pragma unroll
        for (int q = 0; q < QMOE_GROUP; q++)
            if (q < count && lane == 0) y[(i64)members[p0 + q] * hidden + c] = ys[q];
    }
}

#define QMOE(NAME, F)                                                                                        \
    extern "C" __global__ void __launch_bounds__(QG_WARPS * 32)                                              \
        qmoe_gate_up_##NAME(const __grid_constant__ MoePair t, const i8* xq, const float* xd, const int* xs, \
                            int k, int inter, int hidden, const MoeListing l, float* act) {                   \
        qmoe_gate_up_body<F>(t, xq, xd, xs, k, inter, hidden, l, act);                                       \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(QG_WARPS * 32)                                              \
        qmoe_down_##NAME(const __grid_constant__ MoeTable t, const i8* aq, const float* ad, const int* as,   \
                         int inter, int hidden, const MoeListing l, float* y) {                              \
        qmoe_down_body<F>(t, aq, ad, as, inter, hidden, l, y);                                               \
    }
QMOE(q8_0, Q8_0F)
QMOE(q4_0, Q4_0F)
QMOE(q4_k, Q4_KF)
QMOE(q6_k, Q6_KF)

// ---------------------------------------------------------------------------------------
// Tensor-core GEMV on packed weights (qmma_*): decode batches of 1 to 64 tokens on int8
// mma.sync, for widths that are whole stages of QM_BK = 256 columns (one k-quant super-block).
//
// A block of 4 warps owns GS_BM = 128 weight rows, up to 64 tokens (NT n-tiles of 8) and a
// contiguous range of K. Per stage, the 128 rows' packed quants and their scales, and the
// stage's activations as quantize_x left them (int8, an f32 scale per 32, i32 sums per 16),
// are copied into a ring of shared-memory slots by cp.async, the next stages' bytes in flight
// while the mmas of this one run. Warp w multiplies rows 32w .. 32w + 32 (two m16 tiles) by
// every token: ldmatrix fetches packed quant words straight into the mma's fragment layout
// (GGML's nibble order puts the four weights one lane's register needs in one 32-bit word),
// they are unpacked to signed int8 in registers (Q4_0 - 8 and Q6_K - 32 folded into the
// bytes; Q4_K's min through the activations' sums), and meet the activations in
// mma.sync m16n8k32 — one quantization group of 32 columns per mma, an exact integer sum —
// or, for Q6_K, whose scales change every 16 columns, two m16n8k16. Each group's integer sums
// are scaled into the f32 accumulators right after its mma.
//
// Batch invariance: a token's outputs come from its own activations and a sequence of
// operations fixed by the shape: per (row, token) the 32-column groups in increasing order,
// acc = fma(scale, float(isum), acc) with the format's scale (qm_* below); K split into
// nsplit ranges of whole stages (qm_nsplit in quant.rs, from the shape alone), the ranges'
// sums added in range order by gs_finish. NT, the ring depth and the warp layout do not enter.
// The sums are not the dp4a GEMV's (whose lanes interleave the blocks), so the backend runs
// one kind or the other for every batch size of a matrix (quant.rs, `Kernels::uses_mma`).

#define QM_BK 256
#define QM_THREADS 128

__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const void* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm_x2(u32 (&r)[2], const void* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}

// c = a * b (int8 in, exact int32 sums out). Fragments (PTX ISA, m16n8k32 / m16n8k16 .s8), with
// g = lane / 4, t = lane % 4: A a0 = (row g, cols 4t..4t+3), a1 = (row g+8, the same), a2 / a3
// = the same rows at cols 16 + 4t.. (k32 only); B b0 = (k 4t..4t+3, token g), b1 = (k 16 + 4t..,
// token g) (k32 only); C c0, c1 = (row g, tokens 2t, 2t+1), c2, c3 = (row g+8, the same).
#define QM_MAGIC 0x4B400000
// The sums come out offset by QM_MAGIC, the bits of 1.5 * 2^23 (the accumulator's input), so
// that each is already the float 1.5 * 2^23 + sum: see magic_to_float.
__device__ __forceinline__ void mma_s8_k32(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(QM_MAGIC));
}
__device__ __forceinline__ void mma_s8_k16(int (&c)[4], u32 a0, u32 a1, u32 b0) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %7, %7, %7};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(QM_MAGIC));
}

// Bytewise v - k for bytes 0..127 minus k <= 128 without borrows between bytes: the top bit
// of each byte set first, so no byte goes below zero, then flipped back.
__device__ __forceinline__ u32 sub_bytes(u32 v, u32 k) { return ((v | 0x80808080u) - k) ^ 0x80808080u; }

// float(v), exactly, for |v| < 2^22 (every integer sum of one mma here), without the
// conversion unit, whose quarter rate on sm_90 bounds the scaling after each mma: v added to
// 1.5 * 2^23 in the float's bits, then 1.5 * 2^23 taken off.
__device__ __forceinline__ float small_int_to_float(int v) {
    return __fsub_rn(__int_as_float(v + QM_MAGIC), 12582912.0f);
}
// small_int_to_float of an mma's sum that came out with QM_MAGIC already added: the mma's own
// accumulator input does the integer add, one instruction an output a group fewer (the
// scaling is most of what qmma_*'s warps issue at 64 tokens; 5-8 % off Q8_0 / Q4_0 / Q6_K
// launches there on an H200).
__device__ __forceinline__ float magic_to_float(int v) { return __fsub_rn(__int_as_float(v), 12582912.0f); }

// 32-column groups of a stage unrolled at once (G), and Q6_K's halves of 128 (HALVES) and runs
// in a half (RUNS): all of them up to two n-tiles, fewer where the accumulators take most
// registers (four and eight n-tiles), which keeps those from spilling. (Two groups at two
// n-tiles too, which spill nothing, ran batches of 16 up to 30 % slower on an H200.)
template <int NT>
struct QmUnroll {
    static constexpr int G = NT >= 4 ? 2 : 8;
    static constexpr int HALVES = NT >= 4 ? 1 : 2;
    static constexpr int RUNS = NT >= 8 ? 2 : 4;
};

// Byte offset of 16-byte chunk c of row r in a tile of CPR chunks a row, swizzled so that the
// 8 rows an ldmatrix phase reads (same c) land on distinct banks.
template <int CPR>
__device__ __forceinline__ int qm_at(int r, int c) {
    const int sw = CPR >= 8 ? (r & 7) : ((r >> 1) & 3);
    return r * CPR * 16 + ((c ^ sw) << 4);
}

// Per format: QB quant bytes of a row per stage in PLANES planes, whether the activations'
// sums are needed (XSUMS), and where a row's stage starts in the device layout (quant.cu's
// header). Every format has 16 bytes of scales per row per stage at ws + row * cols / 16 +
// 16 * kt (Q8_0 / Q4_0: eight f16; Q4_K: the super-block's d, dmin and 6-bit scales; Q6_K:
// the four units' i8 scales), and Q6_K an f16 d per row per stage after those.
struct Q8_0M {
    static constexpr int QB = 256, PLANES = 1, XSUMS = 0;
    static __device__ __forceinline__ i64 qrow(int cols) { return cols; }
};
struct Q4_0M {
    static constexpr int QB = 128, PLANES = 1, XSUMS = 0;
    static __device__ __forceinline__ i64 qrow(int cols) { return cols >> 1; }
};
struct Q4_KM {
    static constexpr int QB = 128, PLANES = 1, XSUMS = 1;
    static __device__ __forceinline__ i64 qrow(int cols) { return cols >> 1; }
};
struct Q6_KM {
    static constexpr int QB = 192, PLANES = 3, XSUMS = 0;
    static __device__ __forceinline__ i64 qrow(int cols) { return 3 * (i64)(cols >> 2); }
};

// One ring slot: weight quants (PLANES tiles of GS_BM rows), weight scales (16 B a row), x
// quants (256 B a token), x scales (32 B a token), x sums (64 B a token, Q4_K). The launcher
// computes the same size (qm_smem_bytes in quant.rs).
template <class F, int NT>
struct QmStage {
    static constexpr int CPR = F::QB / F::PLANES / 16;
    static constexpr int PLANE = GS_BM * CPR * 16;
    static constexpr int WS = GS_BM * F::QB;
    static constexpr int XQ = WS + GS_BM * 16;
    static constexpr int XD = XQ + NT * 8 * QM_BK;
    static constexpr int XS = XD + NT * 8 * 32;
    static constexpr int BYTES = XS + (F::XSUMS ? NT * 8 * 64 : 0);
};

// The weights of stage kt of rows row0 .. row0 + GS_BM into `slot` (zeros past the matrix).
template <class F, int NT>
__device__ __forceinline__ void qm_load_w(unsigned char* slot, const u8* wq, const u8* ws, int row0, int rows,
                                          int cols, int kt) {
    using S = QmStage<F, NT>;
    constexpr int CHUNKS = GS_BM * S::CPR * F::PLANES;
    static_assert(CHUNKS % QM_THREADS == 0, "whole chunks a thread");
#pragma unroll
    for (int i = 0; i < CHUNKS / QM_THREADS; i++) {
        const int k = threadIdx.x + i * QM_THREADS;
        const int p = k / (GS_BM * S::CPR), r = (k / S::CPR) % GS_BM, c = k % S::CPR;
        const bool in = row0 + r < rows;
        const u8* src = wq + (in ? (i64)(row0 + r) * F::qrow(cols) + (i64)p * (cols >> 2) * (F::PLANES > 1) +
                                       (i64)kt * S::CPR * 16 + 16 * c
                                 : 0);
        cp_async16_zfill(slot + p * S::PLANE + qm_at<S::CPR>(r, c), src, in);
    }
    // Scales: 16 bytes a row.
    const int r = threadIdx.x;
    const bool in = row0 + r < rows;
    cp_async16_zfill(slot + S::WS + 16 * r, ws + (in ? (i64)(row0 + r) * (cols >> 4) + 16 * kt : 0), in);
}

// The activations of stage kt for tokens 0 .. NT * 8 (zeros past the batch).
template <class F, int NT>
__device__ __forceinline__ void qm_load_x(unsigned char* slot, const i8* xq, const float* xd, const int* xs,
                                          int tokens, int cols, int kt) {
    using S = QmStage<F, NT>;
    constexpr int PER_TOKEN = 16 + 2 + (F::XSUMS ? 4 : 0);
    for (int k = threadIdx.x; k < NT * 8 * PER_TOKEN; k += QM_THREADS) {
        const int tok = k / PER_TOKEN, c = k % PER_TOKEN;
        const bool in = tok < tokens;
        const i64 t = in ? tok : 0;
        if (c < 16) {
            cp_async16_zfill(slot + S::XQ + qm_at<16>(tok, c), xq + t * cols + (i64)kt * QM_BK + 16 * c, in);
        } else if (c < 18) {
            cp_async16_zfill(slot + S::XD + 32 * tok + 16 * (c - 16), xd + t * (cols >> 5) + 8 * kt + 4 * (c - 16),
                             in);
        } else {
            cp_async16_zfill(slot + S::XS + 64 * tok + 16 * (c - 18), xs + t * (cols >> 4) + 16 * kt + 4 * (c - 18),
                             in);
        }
    }
}

// The B fragments (b0, b1) of 32-column group G for every n-tile.
template <int NT>
__device__ __forceinline__ void qm_xfrag(const unsigned char* xt, int G, int lane, u32 (&b)[NT][2]) {
    const int m = lane >> 3, i = lane & 7;
    if (NT == 1) {
        u32 r[2];
        ldsm_x2(r, xt + qm_at<16>(i, 2 * G + (m & 1)));
        b[0][0] = r[0];
        b[0][1] = r[1];
    } else {
#pragma unroll
        for (int j = 0; j < NT; j += 2) {
            u32 r[4];
            ldsm_x4(r, xt + qm_at<16>(8 * (j + (m >> 1)) + i, 2 * G + (m & 1)));
            b[j][0] = r[0];
            b[j][1] = r[1];
            b[j + 1][0] = r[2];
            b[j + 1][1] = r[3];
        }
    }
}

// Raw quant words of rows R0 + g, R0 + 8 + g at chunks c0 (r[0], r[1]) and c1 (r[2], r[3]).
template <int CPR>
__device__ __forceinline__ void qm_wfrag(const unsigned char* plane, int R0, int c0, int c1, int lane, u32 (&r)[4]) {
    const int m = lane >> 3, i = lane & 7;
    ldsm_x4(r, plane + qm_at<CPR>(R0 + i + 8 * (m & 1), m < 2 ? c0 : c1));
}

// The tokens' x scales (and Q4_K sums) of group G for n-tile j: tokens 8j + 2t, 8j + 2t + 1.
template <class F, int NT>
__device__ __forceinline__ float2 qm_xd(const unsigned char* slot, int j, int t, int G) {
    using S = QmStage<F, NT>;
    const float* d = reinterpret_cast<const float*>(slot + S::XD);
    const int tok = 8 * j + 2 * t;
    return make_float2(d[8 * tok + G], d[8 * (tok + 1) + G]);
}

// The 16 scale bytes of a stage (`ws`: its weight-scale tile) of this lane's rows: g and g + 8
// of each of warp `warp`'s two m-tiles, [m-tile][row half].
__device__ __forceinline__ void qm_row_scales(const unsigned char* ws, int warp, int g, v4u (&sc)[2][2]) {
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) sc[mt][h] = *reinterpret_cast<const v4u*>(ws + 16 * (32 * warp + 16 * mt + 8 * h + g));
}

// One stage's mmas for warp `warp`: acc[m-tile][n-tile][c].
template <class F, int NT>
struct QmCompute;

// One 32-column group G of an m tile whose rows carry one f16 scale a group (Q8_0, Q4_0):
// acc[j] += weight scale * activation scale * (a · b[j]) for every n-tile j, the integer
// product exact (mma_s8_k32), the row's scales `sc` as qm_row_scales left them.
template <class F, int NT>
__device__ __forceinline__ void qm_group_f16(float (&acc)[NT][4], const u32 (&a)[4], const u32 (&b)[NT][2],
                                             const v4u (&sc)[2], const unsigned char* slot, int t, int G) {
    float wd[2];
#pragma unroll
    for (int h = 0; h < 2; h++) wd[h] = f16_to_f32((u16)(word(sc[h], G >> 1) >> (16 * (G & 1))));
#pragma unroll
    for (int j = 0; j < NT; j++) {
        int c[4];
        mma_s8_k32(c, a[0], a[1], a[2], a[3], b[j][0], b[j][1]);
        const float2 xd = qm_xd<F, NT>(slot, j, t, G);
#pragma unroll
        for (int e = 0; e < 4; e++)
            acc[j][e] = __fmaf_rn(__fmul_rn(wd[e >> 1], (e & 1) ? xd.y : xd.x), magic_to_float(c[e]), acc[j][e]);
    }
}

template <int NT>
struct QmCompute<Q8_0M, NT> {
    static __device__ __forceinline__ void run(const unsigned char* slot, float (&acc)[2][NT][4], int warp, int lane,
                                               u16, u16, u16, u16) {
        using S = QmStage<Q8_0M, NT>;
        const int g = lane >> 2, t = lane & 3;
        v4u sc[2][2];
        qm_row_scales(slot + S::WS, warp, g, sc);
#pragma unroll QmUnroll<NT>::G
        for (int G = 0; G < 8; G++) {
            u32 b[NT][2];
            qm_xfrag<NT>(slot + S::XQ, G, lane, b);
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                u32 a[4];
                qm_wfrag<S::CPR>(slot, 32 * warp + 16 * mt, 2 * G, 2 * G + 1, lane, a);
                qm_group_f16<Q8_0M, NT>(acc[mt], a, b, sc[mt], slot, t, G);
            }
        }
    }
};

template <int NT>
struct QmCompute<Q4_0M, NT> {
    static __device__ __forceinline__ void run(const unsigned char* slot, float (&acc)[2][NT][4], int warp, int lane,
                                               u16, u16, u16, u16) {
        using S = QmStage<Q4_0M, NT>;
        const int g = lane >> 2, t = lane & 3;
        v4u sc[2][2];
        qm_row_scales(slot + S::WS, warp, g, sc);
#pragma unroll QmUnroll<NT>::G / 2
        for (int G2 = 0; G2 < 8; G2 += 2) {
            u32 raw[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++) qm_wfrag<S::CPR>(slot, 32 * warp + 16 * mt, G2, G2 + 1, lane, raw[mt]);
#pragma unroll
            for (int G = G2; G < G2 + 2; G++) {
                u32 b[NT][2];
                qm_xfrag<NT>(slot + S::XQ, G, lane, b);
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    const u32 w0 = raw[mt][2 * (G - G2)], w1 = raw[mt][2 * (G - G2) + 1];
                    const u32 a[4] = {sub_bytes(w0 & 0x0f0f0f0fu, 0x08080808u), sub_bytes(w1 & 0x0f0f0f0fu, 0x08080808u),
                                      sub_bytes((w0 >> 4) & 0x0f0f0f0fu, 0x08080808u),
                                      sub_bytes((w1 >> 4) & 0x0f0f0f0fu, 0x08080808u)};
                    qm_group_f16<Q4_0M, NT>(acc[mt], a, b, sc[mt], slot, t, G);
                }
            }
        }
    }
};

template <int NT>
struct QmCompute<Q4_KM, NT> {
    static __device__ __forceinline__ void run(const unsigned char* slot, float (&acc)[2][NT][4], int warp, int lane,
                                               u16, u16, u16, u16) {
        using S = QmStage<Q4_KM, NT>;
        const int g = lane >> 2, t = lane & 3;
        const int* xsum = reinterpret_cast<const int*>(slot + S::XS);
        v4u meta[2][2];
        qm_row_scales(slot + S::WS, warp, g, meta);
#pragma unroll QmUnroll<NT>::G / 2
        for (int p = 0; p < 4; p++) {
            // Sub-blocks 2p (low nibbles) and 2p + 1 (high nibbles) of chunks 2p, 2p + 1.
            u32 raw[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++) qm_wfrag<S::CPR>(slot, 32 * warp + 16 * mt, 2 * p, 2 * p + 1, lane, raw[mt]);
            float dsc[2][2][2], dm[2][2][2];  // [m-tile][row half][sub-block of the pair]
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const v4u& m = meta[mt][h];
                    const float d = f16_to_f32((u16)(m.x & 0xffff)), dmin = f16_to_f32((u16)(m.x >> 16));
                    int sc1, mn1, sc2, mn2;
                    q4k_scale_min2(p, m.y, m.z, m.w, sc1, mn1, sc2, mn2);
                    dsc[mt][h][0] = __fmul_rn(d, (float)sc1);
                    dm[mt][h][0] = __fmul_rn(dmin, (float)mn1);
                    dsc[mt][h][1] = __fmul_rn(d, (float)sc2);
                    dm[mt][h][1] = __fmul_rn(dmin, (float)mn2);
                }
#pragma unroll
            for (int s = 0; s < 2; s++) {
                const int G = 2 * p + s;
                u32 b[NT][2];
                qm_xfrag<NT>(slot + S::XQ, G, lane, b);
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    u32 a[4];
#pragma unroll
                    for (int k = 0; k < 4; k++) a[k] = (raw[mt][k] >> (4 * s)) & 0x0f0f0f0fu;
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        int c[4];
                        mma_s8_k32(c, a[0], a[1], a[2], a[3], b[j][0], b[j][1]);
                        const float2 xd = qm_xd<Q4_KM, NT>(slot, j, t, G);
                        const int tok = 8 * j + 2 * t;
                        const float xs0 = (float)(xsum[16 * tok + 2 * G] + xsum[16 * tok + 2 * G + 1]);
                        const float xs1 = (float)(xsum[16 * (tok + 1) + 2 * G] + xsum[16 * (tok + 1) + 2 * G + 1]);
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const int h = e >> 1;
                            const float v = __fmaf_rn(dsc[mt][h][s], magic_to_float(c[e]),
                                                      -__fmul_rn(dm[mt][h][s], (e & 1) ? xs1 : xs0));
                            acc[mt][j][e] = __fmaf_rn((e & 1) ? xd.y : xd.x, v, acc[mt][j][e]);
                        }
                    }
                }
            }
        }
    }
};

// The 6-bit quants of run k (columns +32k of the unit) of packed words l0 / l1 / h, minus 32.
__device__ __forceinline__ u32 q6_run(u32 l0, u32 l1, u32 h, int k) {
    u32 q;
    switch (k) {
    case 0: q = (l0 & 0x0f0f0f0fu) | ((h << 4) & 0x30303030u); break;
    case 1: q = (l1 & 0x0f0f0f0fu) | ((h << 2) & 0x30303030u); break;
    case 2: q = ((l0 >> 4) & 0x0f0f0f0fu) | (h & 0x30303030u); break;
    default: q = ((l1 >> 4) & 0x0f0f0f0fu) | ((h >> 2) & 0x30303030u); break;
    }
    return sub_bytes(q, 0x20202020u);
}

template <int NT>
struct QmCompute<Q6_KM, NT> {
    // d: the stage's f16 d of rows g, g + 8 of m-tile 0 and of m-tile 1.
    static __device__ __forceinline__ void run(const unsigned char* slot, float (&acc)[2][NT][4], int warp, int lane,
                                               u16 d00, u16 d01, u16 d10, u16 d11) {
        using S = QmStage<Q6_KM, NT>;
        const int g = lane >> 2, t = lane & 3;
        const float d[2][2] = {{f16_to_f32(d00), f16_to_f32(d01)}, {f16_to_f32(d10), f16_to_f32(d11)}};
        v4u sc[2][2];
        qm_row_scales(slot + S::WS, warp, g, sc);
#pragma unroll QmUnroll<NT>::HALVES
        for (int n = 0; n < 2; n++) {
            // Units (n, 0) and (n, 1): chunks 2n, 2n + 1 of each plane.
            u32 l0[2][4], l1[2][4], hb[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                qm_wfrag<S::CPR>(slot, 32 * warp + 16 * mt, 2 * n, 2 * n + 1, lane, l0[mt]);
                qm_wfrag<S::CPR>(slot + S::PLANE, 32 * warp + 16 * mt, 2 * n, 2 * n + 1, lane, l1[mt]);
                qm_wfrag<S::CPR>(slot + 2 * S::PLANE, 32 * warp + 16 * mt, 2 * n, 2 * n + 1, lane, hb[mt]);
            }
#pragma unroll QmUnroll<NT>::RUNS
            for (int k = 0; k < 4; k++) {
                const int G = 4 * n + k;
                u32 b[NT][2];
                qm_xfrag<NT>(slot + S::XQ, G, lane, b);
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    u32 a[4];  // (row g, unit j0), (row g + 8, j0), (row g, j1), (row g + 8, j1)
#pragma unroll
                    for (int q = 0; q < 4; q++) a[q] = q6_run(l0[mt][q], l1[mt][q], hb[mt][q], k);
                    // d times the scales of runs (n, 0, k) and (n, 1, k) of rows g and g + 8.
                    float s0[2], s1[2];
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        s0[h] = __fmul_rn(d[mt][h], (float)(int)(i8)((word(sc[mt][h], 2 * n) >> (8 * k)) & 0xff));
                        s1[h] = __fmul_rn(d[mt][h], (float)(int)(i8)((word(sc[mt][h], 2 * n + 1) >> (8 * k)) & 0xff));
                    }
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        int c0[4], c1[4];
                        mma_s8_k16(c0, a[0], a[1], b[j][0]);
                        mma_s8_k16(c1, a[2], a[3], b[j][1]);
                        const float2 xd = qm_xd<Q6_KM, NT>(slot, j, t, G);
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const int h = e >> 1;
                            const float v = __fmaf_rn(s1[h], magic_to_float(c1[e]),
                                                      __fmul_rn(s0[h], magic_to_float(c0[e])));
                            acc[mt][j][e] = __fmaf_rn((e & 1) ? xd.y : xd.x, v, acc[mt][j][e]);
                        }
                    }
                }
            }
        }
    }
};

// Up to QG_MAX_SEGS packed weights of one format that read the same activations, in one
// launch: segment j owns the units [unit_end[j-1], unit_end[j]) along x, a unit being (row
// block, K range), K ranges fastest; its split is the one its matrix gets alone, and its
// partial slots start at pslot0[j].
struct QmSegs {
    unsigned long long wq[QG_MAX_SEGS];
    unsigned long long ws[QG_MAX_SEGS];
    unsigned long long out[QG_MAX_SEGS];
    int rows[QG_MAX_SEGS];
    int unit_end[QG_MAX_SEGS];
    int nsplit[QG_MAX_SEGS];
    int pslot0[QG_MAX_SEGS];
};

struct QmUnit {
    const u8* wq;
    const u8* ws;
    float* out;
    int rows, mblock, split, nsplit, pslot;
};
__device__ __forceinline__ QmUnit qm_unit(const QmSegs& segs) {
    const int u = blockIdx.x;
    unsigned long long wq = segs.wq[0], ws = segs.ws[0], o = segs.out[0];
    int rows = segs.rows[0], nsplit = segs.nsplit[0], pslot0 = segs.pslot0[0], first = 0;
#pragma unroll
    for (int j = 1; j < QG_MAX_SEGS; j++) {
        if (u >= segs.unit_end[j - 1]) {
            wq = segs.wq[j], ws = segs.ws[j], o = segs.out[j], rows = segs.rows[j], nsplit = segs.nsplit[j];
            pslot0 = segs.pslot0[j], first = segs.unit_end[j - 1];
        }
    }
    const int local = u - first;
    return QmUnit{reinterpret_cast<const u8*>(wq), reinterpret_cast<const u8*>(ws), reinterpret_cast<float*>(o),
                  rows, local / nsplit, local % nsplit, nsplit, pslot0 + local};
}

// Q6_K's f16 d of `row` (clamped into the matrix) for stage kt; 0 for the other formats.
template <class F>
__device__ __forceinline__ u16 qm_d(const QmUnit& u, int row, int cols, int kt) {
    if (F::PLANES == 1) return 0;
    const u8* d = u.ws + (i64)u.rows * (cols >> 4);
    return ldg16(d + 2 * ((i64)imin(row, u.rows - 1) * (cols >> 8) + kt));
}

template <class F, int NT, int STAGES>
__device__ __forceinline__ void qm_body(const QmUnit& u, const i8* xq, const float* xd, const int* xs, int cols,
                                        int tokens, float* partials, unsigned* counters) {
    using S = QmStage<F, NT>;
    extern __shared__ __align__(128) unsigned char qm_smem[];
    pdl_launch_dependents();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int row0 = u.mblock * GS_BM;
    const int nk = cols / QM_BK;
    const int kb = (int)((i64)nk * u.split / u.nsplit);
    const int n = (int)((i64)nk * (u.split + 1) / u.nsplit) - kb;
    float acc[2][NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int j = 0; j < NT; j++) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.f;
    // Weights never depend on the previous kernel: the first stages' go out before the wait.
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++)
        if (s < n) qm_load_w<F, NT>(qm_smem + s * S::BYTES, u.wq, u.ws, row0, u.rows, cols, kb + s);
    const int r0 = row0 + 32 * warp + g;
    u16 dn[4];
#pragma unroll
    for (int q = 0; q < 4; q++) dn[q] = qm_d<F>(u, r0 + 8 * q, cols, kb);
    pdl_wait();
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < n) qm_load_x<F, NT>(qm_smem + s * S::BYTES, xq, xd, xs, tokens, cols, kb + s);
        cp_async_commit();
    }
    for (int i = 0; i < n; i++) {
        cp_async_wait<STAGES - 2>();
        // Stage i has landed for every thread, and every warp is done with stage i - 1's slot.
        __syncthreads();
        const int next = i + STAGES - 1;
        if (next < n) {
            unsigned char* slot = qm_smem + (next % STAGES) * S::BYTES;
            qm_load_w<F, NT>(slot, u.wq, u.ws, row0, u.rows, cols, kb + next);
            qm_load_x<F, NT>(slot, xq, xd, xs, tokens, cols, kb + next);
        }
        cp_async_commit();
        const u16 d0 = dn[0], d1 = dn[1], d2 = dn[2], d3 = dn[3];
        if (i + 1 < n)
#pragma unroll
            for (int q = 0; q < 4; q++) dn[q] = qm_d<F>(u, r0 + 8 * q, cols, kb + i + 1);
        // dn[q]: rows r0 + 8q, i.e. (m-tile q / 2, half q % 2).
        QmCompute<F, NT>::run(qm_smem + (i % STAGES) * S::BYTES, acc, warp, lane, d0, d1, d2, d3);
    }
    cp_async_wait<0>();
    const auto at = [&](int k) {
        const int mt = k / (NT * 4), j = (k / 4) % NT, e = k % 4;
        return make_int2(32 * warp + 16 * mt + g + 8 * (e >> 1), 8 * j + 2 * t + (e & 1));
    };
    gs_finish(reinterpret_cast<const float(&)[2 * NT * 4]>(acc), at, u, tokens, partials, counters);
}

// grid (units), block QM_THREADS, dynamic shared memory STAGES * QmStage<F, NT>::BYTES; the
// activations and the outputs start at the launch's first token, `tokens` <= NT * 8.
#define QMMA(NAME, F, NT, STAGES)                                                                            \
    extern "C" __global__ void __launch_bounds__(QM_THREADS, 2)                                              \
        qmma_##NAME##_n##NT(QmSegs segs, const i8* xq, const float* xd, const int* xs, int cols, int tokens, \
                            float* partials, unsigned* counters) {                                           \
        qm_body<F, NT, STAGES>(qm_unit(segs), xq, xd, xs, cols, tokens, partials, counters);                 \
    }
// (format, n-tiles, ring depth): the launcher's table (QM_STAGES in quant.rs).
#define QMMA_ALL(NAME, F, S1, S2, S4, S8)                                                                    \
    QMMA(NAME, F, 1, S1)                                                                                     \
    QMMA(NAME, F, 2, S2)                                                                                     \
    QMMA(NAME, F, 4, S4)                                                                                     \
    QMMA(NAME, F, 8, S8)
QMMA_ALL(q8_0, Q8_0M, 3, 2, 2, 2)
QMMA_ALL(q4_0, Q4_0M, 5, 4, 4, 3)
QMMA_ALL(q4_k, Q4_KM, 5, 4, 3, 2)
QMMA_ALL(q6_k, Q6_KM, 3, 3, 3, 2)

// ---------------------------------------------------------------------------------------
// Packed weights on the warpgroup MMA (decode batches, sm_90a): `qwg_*`. The bf16 wgmma GEMV
// of matmul.cu (gemv_wg_n*) with the weight tiles dequantized in shared memory: each stage's
// packed bytes (and scales) of 128 rows stream through a cp.async ring with x's bf16 tiles;
// each thread turns one row's packed stage into 64 bf16 weights (the CPU's exact dequantized
// f32 values, rounded to nearest even) in a swizzled A tile, double-buffered, so the MMAs of
// stage i run while stage i + 1 is dequantized. x enters rounded to bf16 from qwg_split_x,
// which writes its tiles in the format's stage order (x as hi + lo pairs, the bf16 GEMV's
// precision, measured slower at every batch for no gain worth it over 4-8 bit weights).
//
// A stage is 64 weights of a row in unit order: units i = 64 kt / (16 RUNS) .., each giving
// RUNS runs of 16 weights (F::decode); tile column 16 (RUNS ui + k) + l holds weight l of run
// k of the stage's unit ui, which sits at column qwg_col<F>(i, k) + l of the matrix. (Natural
// order for Q8_0 and Q4_0; Q4_K's and Q6_K's units interleave their runs, and x follows.)
//
// Batch invariance: as gemv_wg_n* (the columns of a wgmma are independent, and a column's
// instruction sequence does not depend on N), so a token's outputs are bitwise the same in any
// batch, the one-token call included.
#define QW_THREADS 128

template <class F> __device__ __forceinline__ int qwg_col(int i, int k);
template <> __device__ __forceinline__ int qwg_col<Q8_0F>(int i, int) { return 16 * i; }
template <> __device__ __forceinline__ int qwg_col<Q4_0F>(int i, int k) { return 32 * i + 16 * k; }
template <> __device__ __forceinline__ int qwg_col<Q4_KF>(int i, int k) {
    return (i >> 3) * 256 + 64 * ((i & 7) >> 1) + 16 * (i & 1) + 32 * k;
}
template <> __device__ __forceinline__ int qwg_col<Q6_KF>(int i, int k) { return Q6_KF::first(i) + 32 * k; }

// A stage's packed bytes in shared memory: QB quant bytes then SB scale bytes per row, rows
// one after another (quants of all 128 rows, then their scales).
template <class F> struct QwStage;
template <> struct QwStage<Q8_0F> { static constexpr int QB = 64, SB = 4; };
template <> struct QwStage<Q4_0F> { static constexpr int QB = 32, SB = 4; };
template <> struct QwStage<Q4_KF> { static constexpr int QB = 32, SB = 16; };
template <> struct QwStage<Q6_KF> { static constexpr int QB = 48, SB = 8; };
// Bytes of a stage's packed part, rounded up to the swizzle's 1 KB period.
template <class F> __device__ __host__ constexpr int qwg_packed_bytes() {
    return (GS_BM * (QwStage<F>::QB + QwStage<F>::SB) + 1023) / 1024 * 1024;
}

// The cp.asyncs of stage kt's packed bytes of one row (`row`, clamped into the matrix: rows
// past it compute garbage that gs_finish drops) into its places in `dst`.
template <class F>
__device__ __forceinline__ void qwg_load_row(unsigned char* q, unsigned char* s, const u8* wq, const u8* ws,
                                             int row, int rows, int cols, int kt);
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
    const u32 a = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(a), "l"(gmem) : "memory");
}
template <>
__device__ __forceinline__ void qwg_load_row<Q8_0F>(unsigned char* q, unsigned char* s, const u8* wq, const u8* ws,
                                                    int row, int, int cols, int kt) {
    const u8* src = wq + (i64)row * cols + 64 * kt;
#pragma unroll
    for (int c = 0; c < 4; c++) cp_async16(q + 16 * c, src + 16 * c);
    cp_async4(s, ws + 2 * ((i64)row * (cols >> 5) + 2 * kt));
}
template <>
__device__ __forceinline__ void qwg_load_row<Q4_0F>(unsigned char* q, unsigned char* s, const u8* wq, const u8* ws,
                                                    int row, int, int cols, int kt) {
    const u8* src = wq + (i64)row * (cols >> 1) + 32 * kt;
    cp_async16(q, src);
    cp_async16(q + 16, src + 16);
    cp_async4(s, ws + 2 * ((i64)row * (cols >> 5) + 2 * kt));
}
template <>
__device__ __forceinline__ void qwg_load_row<Q4_KF>(unsigned char* q, unsigned char* s, const u8* wq, const u8* ws,
                                                    int row, int, int cols, int kt) {
    const u8* src = wq + (i64)row * (cols >> 1) + 32 * kt;
    cp_async16(q, src);
    cp_async16(q + 16, src + 16);
    cp_async16(s, ws + 16 * ((i64)row * (cols >> 8) + (kt >> 2)));
}
template <>
__device__ __forceinline__ void qwg_load_row<Q6_KF>(unsigned char* q, unsigned char* s, const u8* wq, const u8* ws,
                                                    int row, int rows, int cols, int kt) {
    const u8* src = wq + (i64)row * 3 * (cols >> 2) + 16 * kt;
    const int plane = cols >> 2;
#pragma unroll
    for (int p = 0; p < 3; p++) cp_async16(q + 16 * p, src + (i64)p * plane);
    cp_async4(s, ws + 4 * ((i64)row * (cols >> 6) + kt));
    // d (f16, per super-block) by the aligned word that holds it.
    const i64 di = (i64)rows * (cols >> 6) * 4 + 2 * ((i64)row * (cols >> 8) + (kt >> 2));
    cp_async4(s + 4, ws + (di & ~3ll));
}

// Unit ui of the stage (unit index i of the row) from its packed bytes in shared memory.
template <class F>
__device__ __forceinline__ typename F::Raw qwg_raw(const unsigned char* q, const unsigned char* s, int ui, int i,
                                                   int row, int cols);
template <>
__device__ __forceinline__ Q8_0F::Raw qwg_raw<Q8_0F>(const unsigned char* q, const unsigned char* s, int ui, int,
                                                     int, int) {
    return Q8_0F::Raw{*reinterpret_cast<const v4u*>(q + 16 * ui), reinterpret_cast<const u16*>(s)[ui >> 1]};
}
template <>
__device__ __forceinline__ Q4_0F::Raw qwg_raw<Q4_0F>(const unsigned char* q, const unsigned char* s, int ui, int,
                                                     int, int) {
    return Q4_0F::Raw{*reinterpret_cast<const v4u*>(q + 16 * ui), reinterpret_cast<const u16*>(s)[ui]};
}
template <>
__device__ __forceinline__ Q4_KF::Raw qwg_raw<Q4_KF>(const unsigned char* q, const unsigned char* s, int ui, int,
                                                     int, int) {
    return Q4_KF::Raw{*reinterpret_cast<const v4u*>(q + 16 * ui), *reinterpret_cast<const v4u*>(s)};
}
template <>
__device__ __forceinline__ Q6_KF::Raw qwg_raw<Q6_KF>(const unsigned char* q, const unsigned char* s, int, int i,
                                                     int row, int cols) {
    Q6_KF::Raw r;
    r.l0 = *reinterpret_cast<const v4u*>(q);
    r.l1 = *reinterpret_cast<const v4u*>(q + 16);
    r.h = *reinterpret_cast<const v4u*>(q + 32);
    r.sc = *reinterpret_cast<const u32*>(s);
    const u32 dw = *reinterpret_cast<const u32*>(s + 4);
    // Which half of the word: the parity of d's index (the d array starts 4-byte aligned).
    r.d = (u16)(dw >> (16 * (int)(((i64)row * (cols >> 8) + (i >> 2)) & 1)));
    return r;
}

// x [tokens, cols] as the bf16 B tiles of nt tokens (nt one of 8, 16, 32, 64) of every stage,
// in F's stage order (stage kt at kt * nt * 128 bytes, wg_split_x's swizzled layout; values
// rounded to nearest even), zeros past the batch. grid (stages), block QW_THREADS.
template <class F>
__device__ __forceinline__ void qwg_split_x_body(const float* x, int tokens, int nt, int cols, unsigned char* xs) {
    pdl_enter();
    constexpr int U = 4 / F::RUNS;
    const int kt = blockIdx.x;
    unsigned char* tile = xs + (i64)kt * nt * 128;
    for (int c = threadIdx.x; c < nt * 16; c += QW_THREADS) {
        const int tok = c >> 4, q = c & 15;  // tile columns 4q .. 4q + 3: run q / 4, from 4 (q % 4)
        const int r = q >> 2, ui = r / F::RUNS, k = r % F::RUNS;
        const int col = qwg_col<F>(kt * U + ui, k) + 4 * (q & 3);
        float e[4];
#pragma unroll
        for (int j = 0; j < 4; j++) e[j] = tok < tokens ? x[(i64)tok * cols + col + j] : 0.f;
        const int off = swz128(tok, q >> 1) + (q & 1) * 8;
        *reinterpret_cast<uint2*>(tile + off) = make_uint2(pack_bf16x2(e[0], e[1]), pack_bf16x2(e[2], e[3]));
    }
}
#define QWG_SPLIT_X(NAME, F)                                                                                 \
    extern "C" __global__ void __launch_bounds__(QW_THREADS)                                                 \
        qwg_split_x_##NAME(const float* x, int tokens, int nt, int cols, unsigned char* xs) {               \
        qwg_split_x_body<F>(x, tokens, nt, cols, xs);                                                        \
    }
QWG_SPLIT_X(q8_0, Q8_0F)
QWG_SPLIT_X(q4_0, Q4_0F)
QWG_SPLIT_X(q4_k, Q4_KF)
QWG_SPLIT_X(q6_k, Q6_KF)

// Byte j of `w` (0..255) as the float 2^23 + byte: one byte permute instead of an
// int-to-float conversion (which issues at a quarter of the rate); the caller subtracts 2^23
// plus any offset in one exact add.
__device__ __forceinline__ float qwg_byte(u32 w, int j) {
    return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540 | j));
}

// Run k of unit i (16 weights) as f32, the same values F::decode gives (bitwise: the integer
// reaches f32 exactly through qwg_byte, then the same products and differences), written
// as eight bf16 pairs (rounded to nearest even).
template <class F>
__device__ __forceinline__ void qwg_decode(const typename F::Raw& r, int i, u32 (&out)[F::RUNS][8]);
template <>
__device__ __forceinline__ void qwg_decode<Q8_0F>(const Q8_0F::Raw& r, int, u32 (&out)[1][8]) {
    const float d = f16_to_f32(r.d);
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const u32 w = word(r.w, k >> 1) ^ 0x80808080u;  // bytes + 128, unsigned
        const int j = 2 * (k & 1);
        out[0][k] = pack_bf16x2(__fmul_rn(qwg_byte(w, j) - 8388736.f, d), __fmul_rn(qwg_byte(w, j + 1) - 8388736.f, d));
    }
}
template <>
__device__ __forceinline__ void qwg_decode<Q4_0F>(const Q4_0F::Raw& r, int, u32 (&out)[2][8]) {
    const float d = f16_to_f32(r.d);
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const u32 w = word(r.w, k >> 1), lo = w & 0x0f0f0f0fu, hi = (w >> 4) & 0x0f0f0f0fu;
        const int j = 2 * (k & 1);
        out[0][k] = pack_bf16x2(__fmul_rn(qwg_byte(lo, j) - 8388616.f, d), __fmul_rn(qwg_byte(lo, j + 1) - 8388616.f, d));
        out[1][k] = pack_bf16x2(__fmul_rn(qwg_byte(hi, j) - 8388616.f, d), __fmul_rn(qwg_byte(hi, j + 1) - 8388616.f, d));
    }
}
template <>
__device__ __forceinline__ void qwg_decode<Q4_KF>(const Q4_KF::Raw& r, int i, u32 (&out)[2][8]) {
    float d1, m1, d2, m2;
    Q4_KF::scales(r, i, d1, m1, d2, m2);
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const u32 w = word(r.w, k >> 1), lo = w & 0x0f0f0f0fu, hi = (w >> 4) & 0x0f0f0f0fu;
        const int j = 2 * (k & 1);
        const auto v = [](u32 x, int b, float dd, float mm) {
            return __fsub_rn(__fmul_rn(dd, qwg_byte(x, b) - 8388608.f), mm);
        };
        out[0][k] = pack_bf16x2(v(lo, j, d1, m1), v(lo, j + 1, d1, m1));
        out[1][k] = pack_bf16x2(v(hi, j, d2, m2), v(hi, j + 1, d2, m2));
    }
}
template <>
__device__ __forceinline__ void qwg_decode<Q6_KF>(const Q6_KF::Raw& r, int, u32 (&out)[4][8]) {
    const float d = f16_to_f32(r.d);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float ds = __fmul_rn(d, (float)(int)(i8)((r.sc >> (8 * k)) & 0xff));
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const u32 q = (u32)Q6_KF::quants(r, k, e >> 1);
            const int j = 2 * (e & 1);
            out[k][e] = pack_bf16x2(__fmul_rn(ds, qwg_byte(q, j) - 8388640.f), __fmul_rn(ds, qwg_byte(q, j + 1) - 8388640.f));
        }
    }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// This thread's row of stage kt (unit indices from U kt), dequantized into the A tile `a`
// (128 rows x 64 bf16, swizzled) at row `r`.
template <class F>
__device__ __forceinline__ void qwg_dequant(const unsigned char* slot_q, const unsigned char* slot_s, unsigned char* a,
                                            int r, int row, int cols, int kt) {
    constexpr int U = 4 / F::RUNS, QB = QwStage<F>::QB, SB = QwStage<F>::SB;
    const unsigned char* q = slot_q + r * QB;
    const unsigned char* s = slot_s + r * SB;
#pragma unroll
    for (int ui = 0; ui < U; ui++) {
        const int i = kt * U + ui;
        u32 v[F::RUNS][8];
        qwg_decode<F>(qwg_raw<F>(q, s, ui, i, row, cols), i, v);
#pragma unroll
        for (int k = 0; k < F::RUNS; k++) {
            const int chunk = 2 * (F::RUNS * ui + k);  // tile columns 8 chunk .. + 15
#pragma unroll
            for (int h = 0; h < 2; h++)
                *reinterpret_cast<v4u*>(a + swz128(r, chunk + h)) =
                    v4u{v[k][4 * h], v[k][4 * h + 1], v[k][4 * h + 2], v[k][4 * h + 3]};
        }
    }
}
#endif

// One block: unit `u` (rows u.mblock * 128 .., K range u.split of u.nsplit), tokens 0 ..
// min(tokens, NT) from qwg_split_x's tiles `xs`. Shared memory (1 KB-aligned): two A tiles of
// 16 KB, then a STAGES-deep ring of slots [x tile][packed quants][scales].
template <class F, int NT, int STAGES>
__device__ __forceinline__ void qwg_body(const QmUnit& u, const unsigned char* xs, int cols, int tokens,
                                         float* partials, unsigned* counters) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char qwg_smem_raw[];
    pdl_launch_dependents();
    constexpr int XB = NT * 128, SLOT = XB + qwg_packed_bytes<F>(), ATILE = GS_BM * 128;
    constexpr int QB = QwStage<F>::QB;
    unsigned char* smem = reinterpret_cast<unsigned char*>(((unsigned long long)qwg_smem_raw + 1023) & ~1023ull);
    unsigned char* ring = smem + 2 * ATILE;
    const u32 smem_a = (u32)__cvta_generic_to_shared(smem);
    const u32 ring_a = smem_a + 2 * ATILE;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int row0 = u.mblock * GS_BM;
    const int row = imin(row0 + tid, u.rows - 1);
    const int nk = cols / 64;
    const int kb = (int)((i64)nk * u.split / u.nsplit);
    const int n = (int)((i64)nk * (u.split + 1) / u.nsplit) - kb;
    constexpr int NA = NT / 2;
    float acc[2][NA];
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int i = 0; i < NA; i++) acc[m][i] = 0.f;
    const auto load_w = [&](int s, int kt) {
        unsigned char* slot = ring + s * SLOT + XB;
        qwg_load_row<F>(slot + tid * QB, slot + GS_BM * QB + tid * QwStage<F>::SB, u.wq, u.ws, row, u.rows, cols, kt);
    };
    const auto load_x = [&](int s, int kt) {
        const unsigned char* src = xs + (i64)kt * XB;
        unsigned char* dst = ring + s * SLOT;
        for (int c = tid * 16; c < XB; c += QW_THREADS * 16) cp_async16(dst + c, src + c);
    };
    const auto dequant = [&](int i) {
        const unsigned char* slot = ring + (i % STAGES) * SLOT + XB;
        qwg_dequant<F>(slot, slot + GS_BM * QB, smem + (i & 1) * ATILE, tid, row, cols, kb + i);
    };
    // The weights never depend on the previous kernel: the first stages' go out before the wait.
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++)
        if (s < n) load_w(s, kb + s);
    pdl_wait();
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < n) load_x(s, kb + s);
        cp_async_commit();
    }
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (n > 0) dequant(0);
    wg_proxy_fence();
    __syncthreads();
    for (int i = 0; i < n; i++) {
        const u32 wa = smem_a + (i & 1) * ATILE, xa = ring_a + (i % STAGES) * SLOT;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
#pragma unroll
            for (int m = 0; m < 2; m++) {
                wg_mma<NT>(acc[m], wg_desc(wa + m * (ATILE / 2) + kk * 32), wg_desc(xa + kk * 32));
            }
        }
        wg_commit();
        // Stage i - 1's MMAs are done in every warp: its slot and its A tile are free.
        wg_wait<1>();
        __syncthreads();
        const int next = i + STAGES - 1;
        if (next < n) {
            load_w(next % STAGES, kb + next);
            load_x(next % STAGES, kb + next);
        }
        cp_async_commit();
        if (i + 1 < n) {
            // Stage i + 1 has landed (everyone's copies): dequantize it beside stage i's MMAs.
            cp_async_wait<STAGES - 2>();
            __syncthreads();
            dequant(i + 1);
            wg_proxy_fence();
            __syncthreads();
        }
    }
    wg_wait<0>();
    cp_async_wait<0>();
    // Accumulator layout as gemv_wg_n*'s.
    const auto at = [&](int k) {
        const int m = k / NA, i = k % NA;
        return make_int2(m * 64 + warp * 16 + (lane >> 2) + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * (lane & 3) + (i & 1));
    };
    gs_finish(reinterpret_cast<const float(&)[2 * NA]>(acc), at, u, tokens, partials, counters);
#endif
}

// grid (units), block QW_THREADS, dynamic shared memory qwg_smem_bytes (quant.rs: 2 A tiles,
// STAGES slots, 1 KB of alignment); segments as qmma_*.
#define QWG(NAME, F, NT, STAGES)                                                                             \
    extern "C" __global__ void __launch_bounds__(QW_THREADS, 2)                                              \
        qwg_##NAME##_n##NT(QmSegs segs, const unsigned char* xs, int cols, int tokens, float* partials,      \
                           unsigned* counters) {                                                             \
        qwg_body<F, NT, STAGES>(qm_unit(segs), xs, cols, tokens, partials, counters);                       \
    }
// (format; ring depth at N = 8, 16, 32, 64): QWG_STAGES in quant.rs.
#define QWG_ALL(NAME, F)                                                                                     \
    QWG(NAME, F, 8, 6)                                                                                       \
    QWG(NAME, F, 16, 5)                                                                                      \
    QWG(NAME, F, 32, 4)                                                                                      \
    QWG(NAME, F, 64, 4)
QWG_ALL(q8_0, Q8_0F)
QWG_ALL(q4_0, Q4_0F)
QWG_ALL(q4_k, Q4_KF)
QWG_ALL(q6_k, Q6_KF)

// ---------------------------------------------------------------------------------------
// One token on the tensor-core GEMV's arithmetic (qmv1_*, Q4_0 and Q4_K): bitwise what
// qmma_* gives a token, and faster there than qmma_* for one token (quant.rs, ONE_TOKEN). The integer sums of a 32-column group are exact in
// any order, so lanes form them in parallel: lane l of a warp takes group l % 8 of a stage
// for row l / 8 (four rows a warp), forms the group's integer sums with dp4a and the two
// factors of qmma's scaling step acc = fma(a, b, acc) (Qv*::term, the same float operations);
// the row's chain then runs in group order in lane 8j, fetching the factors by shuffles. A
// warp walks one of the K ranges of the matrix's split (qm_nsplit) for its four rows, the
// block's warps cover every range of 8 / nsplit row groups, and the first warp of each adds
// the ranges' sums in order, as gs_finish does.

#define QV_WARPS 8

// Activations of one token, for group G of stage kt.
struct QvX {
    v4u lo, hi;  // the group's 32 int8
    float d;
    int sum;  // of the 32 quants (Q4_K)
};
__device__ __forceinline__ QvX qv_x(const XQ& x, int kt, int G, bool sums) {
    const int p = kt * QM_BK + 32 * G;
    QvX r;
    r.lo = ldx(x.q + p);
    r.hi = ldx(x.q + p + 16);
    r.d = x.d[p >> 5];
    r.sum = sums ? x.s[p >> 4] + x.s[(p >> 4) + 1] : 0;
    return r;
}

struct Qv4_0 {
    static constexpr bool SUMS = false;
    struct Raw {
        v4u w;
        u16 d;
    };
    static __device__ __forceinline__ Raw load(const u8* wq, const u8* ws, i64 row, int rows, int cols, int kt,
                                               int G) {
        return Raw{ldq(wq + row * (cols >> 1) + kt * (QM_BK / 2) + 16 * G),
                   ldg16(ws + 2 * (row * (cols >> 5) + 8 * kt + G))};
    }
    static __device__ __forceinline__ float2 term(const Raw& r, int, const QvX& x) {
        int s = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const u32 w = (u32)word(r.w, k);
            s = dp4a((int)sub_bytes(w & 0x0f0f0f0fu, 0x08080808u), word(x.lo, k), s);
            s = dp4a((int)sub_bytes((w >> 4) & 0x0f0f0f0fu, 0x08080808u), word(x.hi, k), s);
        }
        return make_float2(__fmul_rn(f16_to_f32(r.d), x.d), small_int_to_float(s));
    }
};

struct Qv4_K {
    static constexpr bool SUMS = true;
    struct Raw {
        v4u a, b;  // the 32 bytes of sub-block pair G / 2
        v4u meta;
    };
    static __device__ __forceinline__ Raw load(const u8* wq, const u8* ws, i64 row, int rows, int cols, int kt,
                                               int G) {
        const u8* q = wq + row * (cols >> 1) + kt * (QM_BK / 2) + 32 * (G >> 1);
        return Raw{ldg4(q), ldg4(q + 16), ldg4(ws + 16 * (row * (cols >> 8) + kt))};
    }
    static __device__ __forceinline__ float2 term(const Raw& r, int G, const QvX& x) {
        const int sh = 4 * (G & 1);
        int s = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            s = dp4a((int)(((u32)word(r.a, k) >> sh) & 0x0f0f0f0fu), word(x.lo, k), s);
            s = dp4a((int)(((u32)word(r.b, k) >> sh) & 0x0f0f0f0fu), word(x.hi, k), s);
        }
        const float d = f16_to_f32((u16)(r.meta.x & 0xffff)), dmin = f16_to_f32((u16)(r.meta.x >> 16));
        int sc1, mn1, sc2, mn2;
        q4k_scale_min2(G >> 1, r.meta.y, r.meta.z, r.meta.w, sc1, mn1, sc2, mn2);
        const float dsc = __fmul_rn(d, (float)((G & 1) ? sc2 : sc1));
        const float dm = __fmul_rn(dmin, (float)((G & 1) ? mn2 : mn1));
        const float v = __fmaf_rn(dsc, small_int_to_float(s), -__fmul_rn(dm, (float)x.sum));
        return make_float2(x.d, v);
    }
};

// Block: QV_WARPS warps = (QV_WARPS / nsplit) row groups of four rows x nsplit K ranges.
template <class F, int U>
__device__ __forceinline__ void qv_body(const u8* wq, const u8* ws, float* out, int rows, int nsplit, int blk,
                                        const XQ& x, int cols) {
    __shared__ float part[QV_WARPS][4];
    pdl_launch_dependents();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rg = warp / nsplit, q = warp % nsplit, G = lane & 7, j = lane >> 3;
    const i64 row = ((i64)blk * (QV_WARPS / nsplit) + rg) * 4 + j;
    const i64 rr = row < rows ? row : rows - 1;
    const int nk = cols / QM_BK;
    const int kb = (int)((i64)nk * q / nsplit), ke = (int)((i64)nk * (q + 1) / nsplit);
    float acc = 0.f;
    typename F::Raw raw[U];
#pragma unroll
    for (int u = 0; u < U; u++)
        if (kb + u < ke) raw[u] = F::load(wq, ws, rr, rows, cols, kb + u, G);
    pdl_wait();
    for (int k0 = kb; k0 < ke; k0 += U) {
        if (k0 > kb) {
#pragma unroll
            for (int u = 0; u < U; u++)
                if (k0 + u < ke) raw[u] = F::load(wq, ws, rr, rows, cols, k0 + u, G);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (k0 + u < ke) {
                const float2 ab = F::term(raw[u], G, qv_x(x, k0 + u, G, F::SUMS));
                // Row j's chain in lane 8j, groups in order.
#pragma unroll
                for (int g = 0; g < 8; g++) {
                    const float a = __shfl_sync(0xffffffffu, ab.x, (lane & ~7) + g);
                    const float b = __shfl_sync(0xffffffffu, ab.y, (lane & ~7) + g);
                    acc = __fmaf_rn(a, b, acc);
                }
            }
        }
    }
    if (G == 0) part[warp][j] = acc;
    __syncthreads();
    if (q == 0 && G == 0 && row < rows) {
        float sum = part[warp][j];
        for (int p = 1; p < nsplit; p++) sum = sum + part[warp + p][j];
        out[row] = sum;
    }
}

// grid (blocks of every segment), block QV_WARPS * 32: segment j's blocks are
// [unit_end[j-1], unit_end[j]) (the launcher's block count, not qmma's units).
#define QMV1(NAME, F, U)                                                                                     \
    extern "C" __global__ void __launch_bounds__(QV_WARPS * 32)                                              \
        qmv1_##NAME(QmSegs segs, const i8* xq, const float* xd, const int* xs, int cols) {                   \
        unsigned long long wq = segs.wq[0], ws = segs.ws[0], o = segs.out[0];                                \
        int rows = segs.rows[0], nsplit = segs.nsplit[0], first = 0;                                         \
        _Pragma("unroll") for (int j = 1; j < QG_MAX_SEGS; j++) {                                            \
            if ((int)blockIdx.x >= segs.unit_end[j - 1]) {                                                   \
                wq = segs.wq[j], ws = segs.ws[j], o = segs.out[j], rows = segs.rows[j];                      \
                nsplit = segs.nsplit[j], first = segs.unit_end[j - 1];                                       \
            }                                                                                                \
        }                                                                                                    \
        qv_body<F, U>(reinterpret_cast<const u8*>(wq), reinterpret_cast<const u8*>(ws),                      \
                      reinterpret_cast<float*>(o), rows, nsplit, (int)blockIdx.x - first, XQ{xq, xd, xs}, cols); \
    }
QMV1(q4_0, Qv4_0, 4)
QMV1(q4_k, Qv4_K, 2)

// ---------------------------------------------------------------------------------------
// Dequantization: the exact f32 weights (bit-identical to the CPU's dequantize_row), as bf16
// (rounded to nearest even) for a tensor-core GEMM, or as f32 for the embedding gather.

__device__ __forceinline__ void store16(bf16_t* dst, const float* v) {
    u32 p[8];
#pragma unroll
    for (int k = 0; k < 8; k++) p[k] = (u32)f32_to_bf16(v[2 * k]) | ((u32)f32_to_bf16(v[2 * k + 1]) << 16);
    v4u* d = reinterpret_cast<v4u*>(dst);
    d[0] = v4u{p[0], p[1], p[2], p[3]};
    d[1] = v4u{p[4], p[5], p[6], p[7]};
}

__device__ __forceinline__ void store16(float* dst, const float* v) {
    v4f* d = reinterpret_cast<v4f*>(dst);
#pragma unroll
    for (int k = 0; k < 4; k++) d[k] = v4f{v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]};
}

template <class F, class T>
__device__ __forceinline__ void decode_unit(const u8* wq, const u8* ws, i64 row, int rows, int cols, int i,
                                            T* dst_row) {
    const typename F::Raw r = F::load(wq, ws, row, rows, cols, i);
    int pos[F::RUNS];
    float v[F::RUNS][16];
    F::decode(r, i, pos, v);
#pragma unroll
    for (int k = 0; k < F::RUNS; k++) store16(dst_row + pos[k], v[k]);
}

// Rows [r0, r0 + nrows) into dst [nrows, cols] bf16; grid-stride over (row, unit).
#define DEQUANT(NAME, F)                                                                                     \
    extern "C" __global__ void dequant_bf16_##NAME(const u8* wq, const u8* ws,     \
                                                   bf16_t* dst, int rows, int cols, int r0,     \
                                                   int nrows) { pdl_enter();                                              \
        const int n = F::units(cols);                                                                        \
        const i64 total = (i64)nrows * n;                                                                    \
        for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (i64)gridDim.x * blockDim.x) { \
            const i64 r = k / n;                                                                             \
            decode_unit<F>(wq, ws, r0 + r, rows, cols, (int)(k - r * n), dst + r * cols);                    \
        }                                                                                                    \
    }                                                                                                        \
    extern "C" __global__ void embed_##NAME(const u8* wq, const u8* ws,            \
                                            const u32* ids, float* out, int rows,  \
                                            int cols) { pdl_enter();                                                      \
        const int n = F::units(cols);                                                                        \
        const int t = blockIdx.y;                                                                            \
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)              \
            decode_unit<F>(wq, ws, (i64)ids[t], rows, cols, i, out + (i64)t * cols);                         \
    }
DEQUANT(q8_0, Q8_0F)
DEQUANT(q4_0, Q4_0F)
DEQUANT(q4_k, Q4_KF)
DEQUANT(q6_k, Q6_KF)

// A MoE layer's packed experts as bf16, for moe.cu's tensor-core prompt kernels: block (x, j)
// takes the j-th active expert e of moe_bucket's listing (none past *active_count) and writes
// its [rows, cols] weights to dst + e * rows * cols, grid-stride over (row, unit). Expert e's
// quants start at t.w[e], its scales after all its rows' quants (as qmoe_* read them).
#define DEQUANT_MOE(NAME, F)                                                                                 \
    extern "C" __global__ void dequant_moe_bf16_##NAME(const __grid_constant__ MoeTable t, const MoeListing l, \
                                                       bf16_t* dst, int rows, int cols) {                    \
        pdl_enter();                                                                                         \
        if ((int)blockIdx.y >= *l.active_count) return;                                                      \
        const int e = l.active[blockIdx.y];                                                                  \
        const u8* wq = reinterpret_cast<const u8*>(t.w[e]);                                                  \
        const u8* ws = wq + (i64)rows * F::qrow(cols);                                                       \
        bf16_t* out = dst + (i64)e * rows * cols;                                                            \
        const int n = F::units(cols);                                                                        \
        const i64 total = (i64)rows * n;                                                                     \
        for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (i64)gridDim.x * blockDim.x) { \
            const i64 r = k / n;                                                                             \
            decode_unit<F>(wq, ws, r, rows, cols, (int)(k - r * n), out + r * cols);                         \
        }                                                                                                    \
    }
DEQUANT_MOE(q8_0, Q8_0F)
DEQUANT_MOE(q4_0, Q4_0F)
DEQUANT_MOE(q4_k, Q4_KF)
DEQUANT_MOE(q6_k, Q6_KF)
