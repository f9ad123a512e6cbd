//! Writes at positions held in an index tensor (`scatter`, `scatter_add`,
//! `one_hot`): each output position is matched against every index along
//! the dim (a one-hot comparison), so the kernels are compares, sums and
//! `where`s whatever the index values.

use etmetal_core::shape::normalize_dim;
use etmetal_core::{BinaryOp, DType, Error, Op, ReduceOp, Result, Scalar, Tensor};

use super::{Ctx, Lowerer};
use crate::ir::ValueId;

impl Lowerer<'_> {
    /// `[.., k, n, ..]` bool: whether `index[.., k, ..] == j` for each
    /// position `j < n` (the new dim sits after `dim`).
    fn one_hot_at(&mut self, c: &Ctx, index: ValueId, dim: usize, n: usize) -> Result<ValueId> {
        let mut shape = self.shape(index);
        shape.insert(dim + 1, 1);
        let index = self.cast_to(c, index, DType::I64)?;
        let u = self.emit1(
            c,
            Op::Reshape {
                shape: shape.clone(),
            },
            vec![Some(index)],
        )?;
        let mut pshape = vec![1; shape.len()];
        pshape[dim + 1] = n;
        let positions = Tensor::from_i64(DType::I64, &pshape, &(0..n as i64).collect::<Vec<_>>())?;
        let positions = self.add_table(c, "positions", positions);
        self.emit1(c, Op::Binary(BinaryOp::Eq), vec![Some(u), Some(positions)])
    }

    /// `scatter(x, dim, index, src|value)` and `scatter_add`: position `j`
    /// of `dim` takes (or adds) the source elements whose index is `j`.
    /// Distinct indices per row, as PyTorch's `scatter` needs for a
    /// defined result.
    pub(super) fn scatter(&mut self, c: &Ctx, add: bool) -> Result<()> {
        let x = self.t(c, "self")?;
        let shape = self.shape(x);
        let dim = normalize_dim(c.args.int("dim", 0)?, shape.len().max(1))?;
        let index = self.t(c, "index")?;
        let ishape = self.shape(index);
        let same_rest = ishape.len() == shape.len()
            && ishape
                .iter()
                .zip(&shape)
                .enumerate()
                .all(|(d, (a, b))| d == dim || a == b);
        if !same_rest {
            return Err(Error::unsupported(format!(
                "scatter of an index {ishape:?} into {shape:?} along dim {dim} (etmetal takes an \
                 index of the tensor's sizes but along `dim`)"
            )));
        }
        if let Some(r) = c.args.string("reduce")? {
            return Err(Error::unsupported(format!("scatter with reduce='{r}'")));
        }
        let n = shape[dim];
        let hits = self.one_hot_at(c, index, dim, n)?;
        let dtype = self.dtype(x);
        let any = Op::Reduce {
            op: ReduceOp::Any,
            dims: vec![dim],
            keepdim: false,
        };
        if !c.args.is_tensor("src")? && !add {
            // a value: every named position takes it, however often named
            let v = c
                .args
                .scalar("value")?
                .ok_or_else(|| Error::format("scatter without src or value"))?;
            let v = self.constant(c, "value", v, dtype)?;
            let named = self.emit1(c, any, vec![Some(hits)])?;
            return self.finish(c, Op::Where, vec![Some(named), Some(v), Some(x)]);
        }
        // only the index's region of src is read
        let mut src = self.t(c, "src")?;
        for (d, &k) in ishape.iter().enumerate() {
            if self.shape(src)[d] != k {
                let op = Op::Slice {
                    dim: d,
                    start: 0,
                    end: k,
                    step: 1,
                };
                src = self.emit1(c, op, vec![Some(src)])?;
            }
        }
        let src = self.cast_to(c, src, dtype)?;
        let mut ushape = ishape.clone();
        ushape.insert(dim + 1, 1);
        let src = self.emit1(c, Op::Reshape { shape: ushape }, vec![Some(src)])?;
        let zero = self.constant(c, "zero", Scalar::Int(0), dtype)?;
        let picked = self.emit1(c, Op::Where, vec![Some(hits), Some(src), Some(zero)])?;
        let sum = Op::Reduce {
            op: ReduceOp::Sum,
            dims: vec![dim],
            keepdim: false,
        };
        let placed = self.emit1(c, sum, vec![Some(picked)])?;
        let placed = self.cast_to(c, placed, dtype)?;
        if add {
            return self.finish(c, Op::Binary(BinaryOp::Add), vec![Some(x), Some(placed)]);
        }
        let named = self.emit1(c, any, vec![Some(hits)])?;
        self.finish(c, Op::Where, vec![Some(named), Some(placed), Some(x)])
    }

    /// `x` plus, at row `index[m]` of `dim`, row `m` of `rows` times
    /// `alpha` (`index_add`, `index_put(accumulate=True)`): repeated
    /// indices add up. The sums are a matmul of the transposed one-hot
    /// `[n, k]` with the rows flattened to `[k, rest]`.
    pub(super) fn add_rows(
        &mut self,
        c: &Ctx,
        (x, dim): (ValueId, usize),
        index: ValueId,
        rows: ValueId,
        alpha: Option<Scalar>,
    ) -> Result<()> {
        let shape = self.shape(x);
        let n = shape[dim];
        let k: usize = self.shape(index).iter().product();
        let rshape = self.shape(rows);
        if self.rank(index) > 1 || rshape.len() != shape.len() || rshape[dim] != k {
            return Err(Error::shape(format!(
                "index {:?} and source {rshape:?} for dim {dim} of {shape:?}",
                self.shape(index)
            )));
        }
        let index = self.emit1(c, Op::Reshape { shape: vec![k] }, vec![Some(index)])?;
        let dtype = self.dtype(x);
        let hits = self.one_hot_at(c, index, 0, n)?;
        let hits = self.cast_to(c, hits, dtype)?;
        let hits_t = self.emit1(c, Op::Permute { dims: vec![1, 0] }, vec![Some(hits)])?;
        let order: Vec<usize> = std::iter::once(dim)
            .chain((0..shape.len()).filter(|&d| d != dim))
            .collect();
        let rows = self.cast_to(c, rows, dtype)?;
        let front = self.emit1(
            c,
            Op::Permute {
                dims: order.clone(),
            },
            vec![Some(rows)],
        )?;
        let rest: usize = shape
            .iter()
            .enumerate()
            .filter(|&(d, _)| d != dim)
            .map(|(_, &s)| s)
            .product();
        let flat = self.emit1(
            c,
            Op::Reshape {
                shape: vec![k, rest],
            },
            vec![Some(front)],
        )?;
        let sums = self.emit1(c, Op::MatMul, vec![Some(hits_t), Some(flat)])?;
        let unflat: Vec<usize> = order
            .iter()
            .map(|&d| if d == dim { n } else { shape[d] })
            .collect();
        let sums = self.emit1(c, Op::Reshape { shape: unflat }, vec![Some(sums)])?;
        let back: Vec<usize> = (0..shape.len())
            .map(|d| order.iter().position(|&o| o == d).expect("a dim"))
            .collect();
        let mut sums = self.emit1(c, Op::Permute { dims: back }, vec![Some(sums)])?;
        if let Some(a) = alpha.filter(|a| a.to_f64() != 1.0) {
            let a = self.constant(c, "alpha", a, dtype)?;
            sums = self.emit1(c, Op::Binary(BinaryOp::Mul), vec![Some(sums), Some(a)])?;
        }
        self.finish(c, Op::Binary(BinaryOp::Add), vec![Some(x), Some(sums)])
    }

    /// `one_hot(x, num_classes)`: `x[..., None] == arange(num_classes)` as int64.
    pub(super) fn one_hot(&mut self, c: &Ctx) -> Result<()> {
        let x = self.t(c, "self")?;
        let n = c.args.int("num_classes", -1)?;
        let n = usize::try_from(n).map_err(|_| {
            Error::unsupported(
                "one_hot without num_classes (the class count would come from the data); \
                 pass num_classes",
            )
        })?;
        let mut shape = self.shape(x);
        let x = if shape.is_empty() {
            self.emit1(c, Op::Reshape { shape: vec![1] }, vec![Some(x)])?
        } else {
            x
        };
        let hits = self.one_hot_at(c, x, self.rank(x) - 1, n)?;
        shape.push(n);
        let hits = self.emit1(c, Op::Reshape { shape }, vec![Some(hits)])?;
        self.finish(c, Op::Cast { dtype: DType::I64 }, vec![Some(hits)])
    }
}
