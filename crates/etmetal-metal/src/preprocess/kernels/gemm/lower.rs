//! A [`Gemm`] as dispatches: the portable kernel, the tensor-core
//! alternative where the operands allow it (which the runtime runs where
//! the device offers cooperative matrices), and the split-K sum.

use etmetal_core::Result;

use super::coop;
use super::spec::{Gemm, GemmArgs, FILL};
use super::split::{split_k, SplitK};
use crate::preprocess::emit::{grid, Built, KernelBuilder};
use crate::preprocess::lowering::Lowering;
use crate::preprocess::sizes::{bucket, ROW_BUCKETS};

impl Gemm {
    /// Validate and append the kernel(s), reading the operands and storing
    /// the results as `args` says. A product of dynamic m (one batch) is
    /// lowered once per row bucket, one of dynamic n (a convolution's
    /// images) once per eighth and half of its bound, each variant gated
    /// to its bucket.
    pub fn lower<A: GemmArgs>(&self, lw: &mut Lowering, args: &A) -> Result<()> {
        let (size, along_m, bound, ends): (_, _, usize, Vec<usize>) = match &self.dynamic {
            Some([_, m, _]) if m.as_const().is_none() && self.batch == 1 => {
                (m.clone(), true, self.m, ROW_BUCKETS.to_vec())
            }
            Some([_, m, n]) if m.as_const().is_some() && n.as_const().is_none() => {
                (n.clone(), false, self.n, vec![self.n / 8, self.n / 2])
            }
            _ => return self.lower_one(lw, args),
        };
        let mut ends: Vec<usize> = ends.into_iter().filter(|&e| e > 0 && e < bound).collect();
        ends.dedup();
        if ends.is_empty() {
            return self.lower_one(lw, args);
        }
        ends.push(bound);
        let mut lo = 0;
        for &hi in &ends {
            let (m, n) = if along_m { (hi, self.n) } else { (self.m, hi) };
            let variant = Gemm {
                m,
                n,
                dynamic: self.dynamic.clone(),
                coop: self.coop,
                ..*self
            };
            let top = (hi < bound).then_some(hi);
            lw.gated(bucket(&size, lo, top)?, |lw| variant.lower_one(lw, args))?;
            lo = hi;
        }
        Ok(())
    }

    fn lower_one<A: GemmArgs>(&self, lw: &mut Lowering, args: &A) -> Result<()> {
        if self.m == 0 || self.n == 0 || self.batch == 0 {
            // nothing to write
            return Ok(());
        }
        let t = self.tile();
        let tiles = self.m.div_ceil(t.bm) as u64 * self.n.div_ceil(t.bn) as u64;
        let most = SplitK::most(lw, self.batch, self.m, self.n)?;
        let splits = split_k(
            tiles * self.batch as u64,
            FILL,
            self.k,
            t.bk * 8,
            t.bk,
            most,
        );
        let split = SplitK::new(lw, splits, self.batch, self.m, self.n)?;
        let mut kb = KernelBuilder::new(&lw.buffers);
        let fns = args.elements(&mut kb)? + &split.store(&mut kb, args)?;
        let main = format!("{fns}\n{}", self.main(&t, splits));
        let built: Built = kb.finish(&main);
        let groups = tiles * (self.batch * splits) as u64;
        let workgroups = grid(groups, lw.options.max_workgroups_per_dim)?;
        let (sa, sb) = t.stage_words();
        // two stages: the next slice is written while this one is read
        let storage = (2 * 4 * (sa + sb)) as u32;
        let ops = vec![lw.op_label()];
        let d = lw.dispatches.len();
        let actual = self.groups(lw, t.bm, t.bn, splits)?;
        let size = [t.threads() as u32, 1, 1];
        lw.add_dispatch_sized(built, ops, size, workgroups, storage, actual)?;
        if coop::worth(self) {
            // the same partial sums or outputs, from the same split of k
            coop::alternatives(lw, d, self, &split, args, true)?;
        }
        split.sum(lw, args)
    }
}
