//! SplitK-K: when a product's tiles are too few for a large GPU and `k` is
//! deep, `k` is split among workgroups, each writing partial sums that a
//! second kernel adds up before the caller's [`Epilogue`].

use std::fmt::Write;

use etmetal_core::{DType, Result};

use super::spec::Epilogue;
use crate::preprocess::buffers::BufferIdx;
use crate::preprocess::emit::{entry, grid, linear, KernelBuilder, FLAT_GROUP, FLAT_WORKGROUP};
use crate::preprocess::lowering::Lowering;

/// Ways to split `k` among workgroups when `groups` fall short of `fill`:
/// the fewest of 2, 4, 8 that fill the GPU (else the most) whose parts are
/// whole multiples of `align` and at least `min_depth` deep, and no more
/// than `most` (the partials that fit the buffer limit,
/// [`SplitK::most`]); 1 when none.
pub(super) fn split_k(
    groups: u64,
    fill: u64,
    k: usize,
    min_depth: usize,
    align: usize,
    most: usize,
) -> usize {
    let mut best = 1;
    if groups >= fill {
        return best;
    }
    for s in [2, 4, 8] {
        if s > most {
            break;
        }
        if k.is_multiple_of(s * align) && k / s >= min_depth {
            best = s;
            if groups * s as u64 >= fill {
                break;
            }
        }
    }
    best
}

/// The store side of a product split `splits` ways along `k`: each
/// workgroup writes its partial sums to `[splits·batch, m, n]` (split-major)
/// and a second kernel adds them up and applies the caller's store.
pub(super) struct SplitK {
    parts: Option<BufferIdx>,
    pub splits: usize,
    batch: usize,
    m: usize,
    n: usize,
}

impl SplitK {
    /// The most splits whose partial sums (`[splits·batch, m, n]` f32) fit
    /// the buffer limit.
    pub fn most(lw: &Lowering, batch: usize, m: usize, n: usize) -> Result<usize> {
        lw.scratch_parts(batch * m * n)
    }

    pub fn new(
        lw: &mut Lowering,
        splits: usize,
        batch: usize,
        m: usize,
        n: usize,
    ) -> Result<SplitK> {
        let parts = (splits > 1)
            .then(|| {
                let name = format!("{}.split_k", lw.op_label());
                lw.temp(&name, DType::F32, &[splits * batch, m, n])
            })
            .transpose()?;
        Ok(SplitK {
            parts,
            splits,
            batch,
            m,
            n,
        })
    }

    /// The product kernel's `gstore(sb, r, c, v)` (`sb`: split · batch +
    /// batch index): the caller's when not split, else a partial store.
    pub fn store<E: Epilogue + ?Sized>(&self, kb: &mut KernelBuilder, out: &E) -> Result<String> {
        let Some(parts) = self.parts else {
            return out.store(kb);
        };
        let e = linear(
            &["bt".into(), "r".into(), "c".into()],
            &[self.splits * self.batch, self.m, self.n],
        );
        let write = kb.store(parts, "e", "v")?;
        Ok(format!(
            "fn gstore(bt: u32, r: u32, c: u32, v: f32) {{\n  let e = {e};\n  {write}\n}}\n\n"
        ))
    }

    /// The kernel adding the partial sums up (nothing when not split).
    pub fn sum<E: Epilogue + ?Sized>(&self, lw: &mut Lowering, out: &E) -> Result<()> {
        let Some(parts) = self.parts else {
            return Ok(());
        };
        let (m, n) = (self.m, self.n);
        let total = self.batch * m * n;
        let mut kb = KernelBuilder::new(&lw.buffers);
        let mut s = out.store(&mut kb)?;
        s.push_str(&entry(FLAT_WORKGROUP));
        let part = kb.load(parts, &format!("e + p * {total}u"));
        let _ = writeln!(
            s,
            "  let e = {FLAT_GROUP} * {FLAT_WORKGROUP}u + lid;\n  if (e >= {total}u) {{ return; }}\n\
             \x20 var v = 0.0;\n\
             \x20 for (var p = 0u; p < {}u; p = p + 1u) {{ v = v + {part}; }}\n\
             \x20 gstore(e / {}u, (e / {n}u) % {m}u, e % {n}u, v);\n}}",
            self.splits,
            m * n
        );
        let built = kb.finish(&s);
        let groups = (total as u64).div_ceil(u64::from(FLAT_WORKGROUP));
        let workgroups = grid(groups, lw.options.max_workgroups_per_dim)?;
        let ops = vec![lw.op_label()];
        lw.add_dispatch(built, ops, [FLAT_WORKGROUP, 1, 1], workgroups, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::split_k;

    #[test]
    fn deep_k_is_split_when_tiles_are_few() {
        // BERT-base linears at 128 tokens on 32×32 tiles
        let any = usize::MAX;
        assert_eq!(split_k(96, 256, 768, 128, 16, any), 4);
        assert_eq!(split_k(96, 256, 3072, 128, 16, any), 4);
        assert_eq!(split_k(384, 256, 768, 128, 16, any), 1);
        // parts must stay deep and whole slices
        assert_eq!(split_k(1, 256, 256, 128, 16, any), 2);
        assert_eq!(split_k(1, 256, 1000, 128, 16, any), 1);
    }

    #[test]
    fn splits_stay_within_the_partials_that_fit() {
        assert_eq!(split_k(25, 256, 1024, 128, 16, usize::MAX), 8);
        assert_eq!(split_k(25, 256, 1024, 128, 16, 6), 4);
        assert_eq!(split_k(25, 256, 1024, 128, 16, 3), 2);
        assert_eq!(split_k(25, 256, 1024, 128, 16, 1), 1);
    }
}
