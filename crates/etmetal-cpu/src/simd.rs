//! Plain loops compiled for the widest vector instructions the CPU has.
//!
//! The binary targets baseline x86-64 (SSE2), so a loop written as scalar
//! Rust vectorises to 4 lanes at most. [`dispatch`] runs a closure inside a
//! function compiled with AVX-512 or AVX2+FMA when the CPU has them, which
//! lets the compiler vectorise the (inlined) closure body for that width.
//! Closures passed here, and helpers they call, should be `#[inline(always)]`
//! so that they are compiled into the wide function. Rayon workers run
//! outside it: dispatch inside each parallel task, not around the whole loop.

/// Run `f`, compiled for the widest vector extension this CPU offers.
#[inline(always)]
pub fn dispatch<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
        {
            // SAFETY: the CPU has the features the function is compiled for.
            return unsafe { x86::v4(f) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: as above.
            return unsafe { x86::v3(f) };
        }
    }
    f()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    pub unsafe fn v4<R>(f: impl FnOnce() -> R) -> R {
        f()
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn v3<R>(f: impl FnOnce() -> R) -> R {
        f()
    }
}
