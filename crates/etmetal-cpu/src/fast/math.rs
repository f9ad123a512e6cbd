//! f32 functions without branches or library calls, so that loops over
//! them vectorise (see [`crate::simd`]): `exp` to about 1 ulp, and `erf`
//! by the approximation PyTorch's vectorised CPU kernels use.

/// e^x: 2^n · p(r) with x = n·ln 2 + r, |r| ≤ ln 2 / 2 (Cephes' `expf`
/// polynomial). Overflows to +inf above 88.72, flushes to 0 below -87.33
/// (where e^x is subnormal), keeps NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(-87.33, 88.72);
    // round to nearest by adding and removing 1.5·2^23 (no rounding
    // instruction before SSE4.1); 2^n must stay a normal f32: n ≤ 127
    const ROUND: f32 = 12_582_912.0;
    let n = ((xc * std::f32::consts::LOG2_E + ROUND) - ROUND).min(127.0);
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4_f32;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let p = (p * r) * r + r + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    let y = p * scale;
    if x.is_nan() {
        x
    } else if x > 88.72 {
        f32::INFINITY
    } else if x < -87.33 {
        0.0
    } else {
        y
    }
}

/// erf(x) = 1 − t·q(t)·e^(−x²), t = 1 / (1 + 0.3275911·|x|) (Abramowitz and
/// Stegun 7.1.26: absolute error 1.5e-7, under 4e-7 in f32 arithmetic),
/// with the sign of x.
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / (0.327_591_1 * a + 1.0);
    let q = 1.061_405_4_f32;
    let q = q * t - 1.453_152_1;
    let q = q * t + 1.421_413_7;
    let q = q * t - 0.284_496_74;
    let q = q * t + 0.254_829_6;
    let y = 1.0 - t * q * exp(-a * a);
    y.copysign(x)
}

/// Σ v, in 16 lanes so that it vectorises (the order of the additions
/// differs from a left fold's).
#[inline(always)]
pub fn sum(v: &[f32]) -> f32 {
    lanes(v, 0.0, |a, x| a + x).iter().sum()
}

/// Σ v², in lanes as [`sum`].
#[inline(always)]
pub fn sum_sq(v: &[f32]) -> f32 {
    lanes(v, 0.0, |a, x| a + x * x).iter().sum()
}

/// The largest element (−inf for none), NaN if there is one.
#[inline(always)]
pub fn max(v: &[f32]) -> f32 {
    let pick = |a: f32, x: f32| if x > a || x.is_nan() { x } else { a };
    lanes(v, f32::NEG_INFINITY, pick)
        .into_iter()
        .fold(f32::NEG_INFINITY, pick)
}

/// `f` folded over `v` in 16 interleaved lanes.
#[inline(always)]
fn lanes(v: &[f32], init: f32, f: impl Fn(f32, f32) -> f32) -> [f32; 16] {
    let mut acc = [init; 16];
    let mut chunks = v.chunks_exact(16);
    for c in &mut chunks {
        for l in 0..16 {
            acc[l] = f(acc[l], c[l]);
        }
    }
    for (l, &x) in chunks.remainder().iter().enumerate() {
        acc[l] = f(acc[l], x);
    }
    acc
}

/// 1 / (1 + e^−x).
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_and_keeps_specials() {
        for i in -8800..=8800 {
            let x = i as f32 * 0.00987;
            let (got, want) = (exp(x), (x as f64).exp());
            let ulp = (want as f32).abs() * f32::EPSILON;
            assert!(
                ((got as f64) - want).abs() <= 2.0 * ulp as f64 + 1e-38,
                "exp({x}) = {got}, want {want}"
            );
        }
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn lane_reductions() {
        let v: Vec<f32> = (0..37).map(|i| (i % 11) as f32 - 3.0).collect();
        assert_eq!(sum(&v), v.iter().sum::<f32>());
        assert_eq!(sum_sq(&v), v.iter().map(|x| x * x).sum::<f32>());
        assert_eq!(max(&v), 7.0);
        assert_eq!(max(&[]), f32::NEG_INFINITY);
        assert_eq!(sum(&[]), 0.0);
        let mut w = v.clone();
        w[20] = f32::NAN;
        assert!(max(&w).is_nan());
    }

    #[test]
    fn erf_and_sigmoid_are_close() {
        for i in -700..=700 {
            let x = i as f32 * 0.01;
            let want = crate::elementwise::erf(x as f64);
            assert!(
                ((erf(x) as f64) - want).abs() < 4e-7,
                "erf({x}) = {} vs {want}",
                erf(x)
            );
            let s = 1.0 / (1.0 + (-(x as f64)).exp());
            assert!(
                ((sigmoid(x) as f64) - s).abs() < 1e-7 * (1.0 + s),
                "sigmoid({x})"
            );
        }
        assert!(erf(f32::NAN).is_nan());
        assert_eq!(erf(f32::INFINITY), 1.0);
        assert_eq!(erf(f32::NEG_INFINITY), -1.0);
        assert_eq!(sigmoid(-200.0), 0.0);
        assert_eq!(sigmoid(200.0), 1.0);
    }
}
