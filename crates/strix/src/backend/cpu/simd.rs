//! SIMD primitives on f32 slices for the CPU backend: [`dot`], [`axpy`], [`scale`], plus the
//! run-time instruction-set choice ([`Isa`]) and the AVX2 building blocks that
//! [`super::matmul`] reuses.
//!
//! Every operation has an AVX2+FMA path, chosen at run time, and a portable path written as
//! eight independent lanes so that LLVM vectorises it for whatever the target offers (SSE2,
//! NEON) without needing to reassociate floating-point sums.

/// Lanes per vector: one AVX2 register of f32, and the width the portable code mimics.
pub(crate) const LANES: usize = 8;

/// Which family of kernels to run. Chosen per call by [`Isa::detect`]; tests pass
/// [`Isa::Portable`] explicitly so the fallback stays covered on AVX2 machines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// x86-64 with AVX2, FMA and F16C (every AVX2 CPU in practice has all three).
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// Plain Rust that LLVM auto-vectorises for the compile-time target.
    Portable,
}

impl Isa {
    /// The best kernels this CPU can run. Cached: `dot` and friends run in attention's inner
    /// loops, where three feature queries per call would show.
    #[inline]
    pub(crate) fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            static HAS_AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            let has_avx2 = *HAS_AVX2.get_or_init(|| {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            });
            if has_avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }
}

/// Whether the CPU says it is an Intel one (CPUID leaf 0 vendor string), for the tuning
/// choices that differ between Intel and AMD cores; never for correctness.
pub(crate) fn cpu_vendor_is_intel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let r = std::arch::x86_64::__cpuid(0);
        let mut vendor = [0u8; 12];
        vendor[..4].copy_from_slice(&r.ebx.to_le_bytes());
        vendor[4..8].copy_from_slice(&r.edx.to_le_bytes());
        vendor[8..].copy_from_slice(&r.ecx.to_le_bytes());
        &vendor == b"GenuineIntel"
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// How far ahead (bytes) the one-token GEMVs prefetch their weights: 2 KiB on Intel CPUs,
/// none elsewhere. Decode streams every weight from memory once, and on a 2-core Xeon (KVM)
/// the packed GEMVs streamed Q6_K at ~8.5 GB/s without it and 11.6–13.3 GB/s with it
/// (`examples/qmatmul_bench.rs`, 6144 × 1024, cold); the AMD EPYC the kernels were tuned on
/// keeps what was measured there. A hint only: results never depend on it. Chosen by the CPU
/// alone (the library reads no environment variables).
pub(crate) fn prefetch_distance() -> usize {
    static PF: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PF.get_or_init(|| if cpu_vendor_is_intel() { 2048 } else { 0 })
}

/// Asks for the `bytes` from `p` on (every cache line) to come into L1. `p` may point past
/// the end of the data (the look-ahead of the last rows): a prefetch never faults, and the
/// address is only computed, never dereferenced.
#[inline(always)]
pub(crate) fn prefetch(p: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let mut o = 0;
        while o < bytes {
            // SAFETY: PREFETCHT0 (SSE) is a hint that never faults, whatever the address.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    p.wrapping_add(o).cast(),
                )
            };
            o += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, bytes);
}

/// Σ a[i]·b[i], accumulated in f32.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_with(Isa::detect(), a, b)
}

/// y += alpha·x.
#[inline]
pub fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    axpy_with(Isa::detect(), y, alpha, x)
}

/// y *= alpha.
#[inline]
pub fn scale(y: &mut [f32], alpha: f32) {
    scale_with(Isa::detect(), y, alpha)
}

pub(crate) fn dot_with(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot: length mismatch");
    match isa {
        // SAFETY: `Isa::Avx2` is only produced by `detect` after checking the features.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::dot(a, b) },
        Isa::Portable => portable::dot(a, b),
    }
}

pub(crate) fn axpy_with(isa: Isa, y: &mut [f32], alpha: f32, x: &[f32]) {
    assert_eq!(y.len(), x.len(), "axpy: length mismatch");
    match isa {
        // SAFETY: as in `dot_with`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::axpy(y, alpha, x) },
        Isa::Portable => portable::axpy(y, alpha, x),
    }
}

pub(crate) fn scale_with(isa: Isa, y: &mut [f32], alpha: f32) {
    match isa {
        // SAFETY: as in `dot_with`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::scale(y, alpha) },
        Isa::Portable => portable::scale(y, alpha),
    }
}

/// While alive, the calling thread flushes subnormal f32 results to zero and reads subnormal
/// inputs as zero (x86's MXCSR FTZ and DAZ bits); the previous mode comes back on drop.
///
/// Why: the chunked delta rule multiplies by decays `exp(γᵢ − γⱼ)` that underflow into the
/// subnormal range on strongly decaying heads, and on Intel cores every subnormal operand or
/// result of an SSE/AVX op takes a microcode assist of ~100 cycles: with random 0.8B weights
/// that made the prefill's delta rule 5.6× slower on a Xeon (1.57 s → 0.28 s per 512 tokens).
/// The values flushed are below 1.2e-38, so the outputs move by far less than the f32 tolerance
/// the reference tests hold them to. Elsewhere (other architectures) this does nothing.
pub(crate) struct FlushSubnormals {
    #[cfg(target_arch = "x86_64")]
    saved: u32,
}

impl FlushSubnormals {
    /// MXCSR bit 15 (FTZ) and bit 6 (DAZ).
    #[cfg(target_arch = "x86_64")]
    const BITS: u32 = 0x8040;

    pub(crate) fn new() -> FlushSubnormals {
        #[cfg(target_arch = "x86_64")]
        {
            let saved = mxcsr();
            set_mxcsr(saved | Self::BITS);
            FlushSubnormals { saved }
        }
        #[cfg(not(target_arch = "x86_64"))]
        FlushSubnormals {}
    }
}

impl Drop for FlushSubnormals {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        set_mxcsr(self.saved);
    }
}

#[cfg(target_arch = "x86_64")]
fn mxcsr() -> u32 {
    let mut v = 0u32;
    // SAFETY: stmxcsr stores the 4-byte control register at the given address (SSE, which
    // every x86-64 CPU has).
    unsafe { std::arch::asm!("stmxcsr [{}]", in(reg) &mut v, options(nostack, preserves_flags)) };
    v
}

#[cfg(target_arch = "x86_64")]
fn set_mxcsr(v: u32) {
    // SAFETY: ldmxcsr loads the control register; `v` comes from `stmxcsr` with only the FTZ
    // and DAZ bits changed, both valid on every x86-64 CPU with SSE2.
    unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &v, options(nostack, preserves_flags, readonly)) };
}

pub(crate) mod portable {
    use super::LANES;

    /// Four groups of eight lanes: one group alone would serialise on the add latency.
    pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
        const STEP: usize = 4 * LANES;
        let mut acc = [[0.0f32; LANES]; 4];
        let mut ac = a.chunks_exact(STEP);
        let mut bc = b.chunks_exact(STEP);
        for (ab, bb) in (&mut ac).zip(&mut bc) {
            for (g, accg) in acc.iter_mut().enumerate() {
                for l in 0..LANES {
                    accg[l] += ab[g * LANES + l] * bb[g * LANES + l];
                }
            }
        }
        let mut sum = hsum(&add_lanes(&acc));
        for (x, y) in ac.remainder().iter().zip(bc.remainder()) {
            sum += x * y;
        }
        sum
    }

    pub(crate) fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
        for (yi, xi) in y.iter_mut().zip(x) {
            *yi += alpha * xi;
        }
    }

    pub(crate) fn scale(y: &mut [f32], alpha: f32) {
        for yi in y {
            *yi *= alpha;
        }
    }

    #[inline]
    pub(crate) fn add_lanes<const G: usize>(acc: &[[f32; LANES]; G]) -> [f32; LANES] {
        let mut s = [0.0f32; LANES];
        for g in acc {
            for l in 0..LANES {
                s[l] += g[l];
            }
        }
        s
    }

    #[inline]
    pub(crate) fn hsum(v: &[f32; LANES]) -> f32 {
        // Pairwise, like the AVX2 reduction, so both paths round alike.
        let q = [v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]];
        (q[0] + q[2]) + (q[1] + q[3])
    }
}

/// `e^x` within a few ulp (Cephes' `expf`: `x = n ln 2 + r`, a degree-5 polynomial in `r`,
/// `2^n` through the exponent bits), for the elementwise activations, where libm's `expf`
/// was a call per element. Fused multiply-adds and IEEE operations only, so the AVX2 path
/// (where the loops below vectorise) and the portable one give the same bits. NaN stays NaN;
/// `x` is clamped to [−87, 88], so the result is a normal number otherwise.
#[inline(always)]
pub(crate) fn exp_approx(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    let n = x.mul_add(std::f32::consts::LOG2_E, 0.5).floor();
    let r = n.mul_add(-0.693_359_4, x);
    let r = n.mul_add(2.121_944_4e-4, r);
    let mut p = 1.987_569_1e-4f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 0.166_666_66);
    p = p.mul_add(r, 0.5);
    let y = (p * r).mul_add(r, r) + 1.0;
    // n is in [−126, 127] here (NaN casts to 0 and leaves y NaN).
    y * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

/// `x / (1 + e^−x)` with [`exp_approx`].
#[inline(always)]
pub(crate) fn silu_approx(x: f32) -> f32 {
    x / (1.0 + exp_approx(-x))
}

/// An elementwise function taking the [`Isa`] to run: the body compiled for AVX2 + FMA (where
/// it vectorises) or portable; the two give the same bits (see [`exp_approx`]).
macro_rules! elementwise {
    ($(#[$doc:meta])* $name:ident($($arg:ident: $ty:ty),*) $body:block) => {
        $(#[$doc])*
        pub(crate) fn $name(isa: Isa, $($arg: $ty),*) {
            #[inline(always)]
            fn body($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            fn fast($($arg: $ty),*) {
                body($($arg),*)
            }
            match isa {
                // SAFETY: `Isa::Avx2` is only produced after detecting AVX2 and FMA.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { fast($($arg),*) },
                Isa::Portable => body($($arg),*),
            }
        }
    };
}

elementwise! {
    /// `x = silu(x)` in place.
    silu_in_place(x: &mut [f32]) {
        for v in x.iter_mut() {
            *v = silu_approx(*v);
        }
    }
}

elementwise! {
    /// `out = silu(gate) · up` (SwiGLU).
    swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = silu_approx(g) * u;
        }
    }
}

elementwise! {
    /// `x = w · (x · s) · silu(z)` (the gated RMSNorm's output, `s` the row's RMS scale).
    gated_scale(x: &mut [f32], z: &[f32], w: &[f32], s: f32) {
        for ((x, &z), &w) in x.iter_mut().zip(z).zip(w) {
            *x = w * (*x * s) * silu_approx(z);
        }
    }
}

elementwise! {
    /// The delta rule's first pass over a state row: `row *= decay`, then
    /// `kv += k · row` (one read of the row instead of two).
    decay_and_read(row: &mut [f32], decay: f32, k: f32, kv: &mut [f32]) {
        for (r, kv) in row.iter_mut().zip(kv.iter_mut()) {
            *r *= decay;
            *kv = k.mul_add(*r, *kv);
        }
    }
}

elementwise! {
    /// The delta rule's second pass over a state row: `row += k · delta`, then
    /// `out += q · row`.
    update_and_read(row: &mut [f32], k: f32, delta: &[f32], q: f32, out: &mut [f32]) {
        for ((r, &d), o) in row.iter_mut().zip(delta).zip(out.iter_mut()) {
            *r = k.mul_add(d, *r);
            *o = q.mul_add(*r, *o);
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    //! Every function here requires AVX2, FMA and F16C; callers check [`super::Isa`] first.

    use std::arch::x86_64::*;

    /// Sum of the eight lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        // Four accumulators cover the 4-cycle FMA latency at one FMA per cycle.
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (g, accg) in acc.iter_mut().enumerate() {
                let o = i + 8 * g;
                *accg = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(o)), _mm256_loadu_ps(pb.add(o)), *accg);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc[0]);
            i += 8;
        }
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut sum = hsum(s);
        while i < n {
            sum += *pa.add(i) * *pb.add(i);
            i += 1;
        }
        sum
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
        let n = y.len().min(x.len());
        let (py, px) = (y.as_mut_ptr(), x.as_ptr());
        let va = _mm256_set1_ps(alpha);
        let mut i = 0;
        while i + 8 <= n {
            let v = _mm256_fmadd_ps(va, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i)));
            _mm256_storeu_ps(py.add(i), v);
            i += 8;
        }
        while i < n {
            *py.add(i) += alpha * *px.add(i);
            i += 1;
        }
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn scale(y: &mut [f32], alpha: f32) {
        let n = y.len();
        let py = y.as_mut_ptr();
        let va = _mm256_set1_ps(alpha);
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(py.add(i), _mm256_mul_ps(va, _mm256_loadu_ps(py.add(i))));
            i += 8;
        }
        while i < n {
            *py.add(i) *= alpha;
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    /// The guard flushes subnormal results (x86) and gives the previous mode back on drop.
    #[test]
    fn flush_subnormals_is_scoped() {
        use std::hint::black_box;
        let product = || black_box(f32::MIN_POSITIVE) * black_box(0.5f32);
        assert!(product() > 0.0, "subnormals are kept by default");
        {
            let _ftz = FlushSubnormals::new();
            #[cfg(target_arch = "x86_64")]
            assert_eq!(product(), 0.0);
        }
        assert!(product() > 0.0, "the mode is restored");
    }

    /// [`exp_approx`] against f64 `exp` (relative error within 4 ulp over the whole clamped
    /// range), and every elementwise function bitwise the same on each ISA.
    #[test]
    fn exp_approx_is_accurate_and_isa_independent() {
        let mut worst = 0f64;
        let mut v = -87.0f32;
        while v <= 88.0 {
            let e = exp_approx(v) as f64;
            let want = (v as f64).exp();
            worst = worst.max((e - want).abs() / want);
            v += 0.013;
        }
        assert!(worst < 4.0 * f32::EPSILON as f64, "max rel err {worst:e}");
        assert_eq!(exp_approx(0.0), 1.0);
        assert!(exp_approx(f32::NAN).is_nan());
        assert!(exp_approx(-1000.0) > 0.0 && exp_approx(1000.0).is_finite());
        let x: Vec<f32> = (0..1003).map(|i| (i as f32 * 0.37).sin() * 30.0).collect();
        let z: Vec<f32> = (0..1003).map(|i| (i as f32 * 0.11).cos() * 12.0).collect();
        let mut runs = Vec::new();
        let mut isas = vec![Isa::Portable];
        if Isa::detect() != Isa::Portable {
            isas.push(Isa::detect());
        }
        for isa in isas {
            let mut a = x.clone();
            silu_in_place(isa, &mut a);
            let mut b = vec![0.0; x.len()];
            swiglu(isa, &x, &z, &mut b);
            let mut c = x.clone();
            gated_scale(isa, &mut c, &z, &x, 0.7);
            for (i, &v) in x.iter().enumerate() {
                let silu = v as f64 / (1.0 + (-v as f64).exp());
                assert!((a[i] as f64 - silu).abs() <= 1e-6 * silu.abs().max(1.0), "silu({v})");
            }
            runs.push([a, b, c].map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()));
        }
        assert!(runs.iter().all(|r| r == &runs[0]), "the ISAs differ");
    }

    fn isas() -> Vec<Isa> {
        let mut v = vec![Isa::Portable];
        if Isa::detect() != Isa::Portable {
            v.push(Isa::detect());
        }
        v
    }

    const LENS: [usize; 10] = [0, 1, 5, 7, 8, 9, 31, 33, 100, 1027];

    #[test]
    fn dot_matches_f64() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for isa in isas() {
            for n in LENS {
                let (a, b) = (rng.vec(n), rng.vec(n));
                let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
                let scale: f64 = a.iter().zip(&b).map(|(&x, &y)| (x as f64 * y as f64).abs()).sum();
                let got = dot_with(isa, &a, &b) as f64;
                assert!((got - want).abs() <= 1e-6 * scale.max(1.0), "{isa:?} n={n}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn axpy_and_scale_match_scalar() {
        let mut rng = Rng(42);
        for isa in isas() {
            for n in LENS {
                let (x, y0) = (rng.vec(n), rng.vec(n));
                let alpha = rng.f32() * 3.0;
                let mut y = y0.clone();
                axpy_with(isa, &mut y, alpha, &x);
                for i in 0..n {
                    let want = y0[i] as f64 + alpha as f64 * x[i] as f64;
                    assert!((y[i] as f64 - want).abs() <= 1e-6, "{isa:?} axpy n={n} i={i}");
                }
                scale_with(isa, &mut y, alpha);
                for i in 0..n {
                    let want = (y0[i] as f64 + alpha as f64 * x[i] as f64) * alpha as f64;
                    assert!((y[i] as f64 - want).abs() <= 1e-5, "{isa:?} scale n={n} i={i}");
                }
            }
        }
    }
}

/// A `&mut [f32]` as a raw pointer that parallel work items share, each touching only its
/// own elements (rows, columns or channels that interleave in memory, so the slice cannot be
/// split). The function that makes one holds the `&mut [f32]` while any item runs; each use
/// site states which elements its items own.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut(*mut f32);
// SAFETY: see the type's doc: the items write disjoint elements of a slice borrowed mutably for
// as long as they run.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

impl SharedMut {
    pub(crate) fn new(out: &mut [f32]) -> SharedMut {
        SharedMut(out.as_mut_ptr())
    }

    /// The pointer to element `i` (a method, so closures capture the whole `Sync` value
    /// rather than its field).
    #[inline]
    pub(crate) fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }

    /// # Safety
    /// `i` must be inside the slice and owned by the calling item.
    #[inline]
    pub(crate) unsafe fn write(self, i: usize, v: f32) {
        *self.0.add(i) = v;
    }
}
