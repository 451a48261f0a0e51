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

    /// xorshift64*: enough randomness for kernels, no dependency.
    struct Rng(u64);
    impl Rng {
        fn f32(&mut self) -> f32 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            let bits = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
            bits as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
        fn vec(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.f32()).collect()
        }
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
