//! Layout lowerings built from slices, cats and gathers: `diff`, `roll`,
//! `movedim`, and `as_strided` as a gather of the flattened input with an
//! index table computed here (the GPU runs it as index arithmetic, as its
//! other layout ops).

use etmetal_core::shape::{normalize_dim, numel};
use etmetal_core::{BinaryOp, DType, Error, Op, Result, Tensor};

use super::{Ctx, Lowerer};
use crate::ir::ValueId;

impl Lowerer<'_> {
    /// Bind `v` as the node's output; an `Identity` of `x` when nothing was
    /// emitted (`v == x`), so the output is a value of its own.
    pub(super) fn bind_or_copy(&mut self, c: &Ctx, x: ValueId, v: ValueId) -> Result<()> {
        if v == x {
            return self.finish(c, Op::Identity, vec![Some(x)]);
        }
        self.bind(c, 0, v)
    }

    fn slice_of(
        &mut self,
        c: &Ctx,
        x: ValueId,
        dim: usize,
        start: usize,
        end: usize,
    ) -> Result<ValueId> {
        let op = Op::Slice {
            dim,
            start,
            end,
            step: 1,
        };
        self.emit1(c, op, vec![Some(x)])
    }

    /// `diff(x, n, dim, prepend, append)`: `prepend`/`append` joined along
    /// `dim`, then `n` times the difference of neighbours (`!=` on bool, as
    /// PyTorch's logical xor).
    pub(super) fn diff(&mut self, c: &Ctx) -> Result<()> {
        let x = self.t(c, "self")?;
        let (dim, _) = self.sized_dim(c, "dim", -1, &self.shape(x))?;
        let n = c.args.int("n", 1)?;
        let n = usize::try_from(n).map_err(|_| Error::format(format!("diff with n={n}")))?;
        let mut parts = vec![];
        parts.extend(self.opt_t(c, "prepend")?);
        parts.push(x);
        parts.extend(self.opt_t(c, "append")?);
        let mut v = x;
        if parts.len() > 1 {
            v = self.emit1(c, Op::Cat { dim }, parts.into_iter().map(Some).collect())?;
        }
        let op = if self.dtype(v) == DType::Bool {
            BinaryOp::Ne
        } else {
            BinaryOp::Sub
        };
        for _ in 0..n {
            let len = self.shape(v)[dim];
            if len == 0 {
                break;
            }
            let hi = self.slice_of(c, v, dim, 1, len)?;
            let lo = self.slice_of(c, v, dim, 0, len - 1)?;
            v = self.emit1(c, Op::Binary(op), vec![Some(hi), Some(lo)])?;
        }
        self.bind_or_copy(c, x, v)
    }

    /// `roll(x, shifts, dims)`: per dim, the last `shift` entries moved to
    /// the front (a cat of two slices); with no dims, the flattened tensor.
    pub(super) fn roll(&mut self, c: &Ctx) -> Result<()> {
        let x = self.t(c, "self")?;
        let shape = self.shape(x);
        let shifts = self.req_ints(c, "shifts")?;
        let dims = c.args.ints("dims")?.unwrap_or_default();
        if dims.is_empty() {
            if shifts.len() != 1 {
                return Err(Error::format(format!(
                    "roll without dims takes one shift, got {shifts:?}"
                )));
            }
            let flat = self.emit1(
                c,
                Op::Reshape {
                    shape: vec![numel(&shape)?],
                },
                vec![Some(x)],
            )?;
            let rolled = self.roll_dim(c, flat, 0, shifts[0])?;
            return self.finish(c, Op::Reshape { shape }, vec![Some(rolled)]);
        }
        if dims.len() != shifts.len() {
            return Err(Error::format(format!(
                "roll with shifts {shifts:?} for dims {dims:?}"
            )));
        }
        let mut v = x;
        for (&s, &d) in shifts.iter().zip(&dims) {
            let d = normalize_dim(d, shape.len())?;
            v = self.roll_dim(c, v, d, s)?;
        }
        self.bind_or_copy(c, x, v)
    }

    fn roll_dim(&mut self, c: &Ctx, x: ValueId, dim: usize, shift: i64) -> Result<ValueId> {
        let n = self.shape(x)[dim];
        if n == 0 {
            return Ok(x);
        }
        let k = shift.rem_euclid(n as i64) as usize;
        if k == 0 {
            return Ok(x);
        }
        let tail = self.slice_of(c, x, dim, n - k, n)?;
        let head = self.slice_of(c, x, dim, 0, n - k)?;
        self.emit1(c, Op::Cat { dim }, vec![Some(tail), Some(head)])
    }

    /// The storage position of each element of `as_strided` node `c`'s
    /// result (row-major), in a tensor of `len` elements.
    pub(super) fn strided_index(&self, c: &Ctx, len: usize) -> Result<Vec<i64>> {
        let size = self.size_arg(c, "size")?;
        let stride = self.req_ints(c, "stride")?;
        if stride.len() != size.len() {
            return Err(Error::format(format!(
                "as_strided with size {size:?} and stride {stride:?}"
            )));
        }
        let offset = c.args.int("storage_offset", 0)?;
        let total = numel(&size)?;
        let mut index = Vec::with_capacity(total);
        let mut at = vec![0usize; size.len()];
        for _ in 0..total {
            let i = offset
                + at.iter()
                    .zip(&stride)
                    .map(|(&a, &s)| a as i64 * s)
                    .sum::<i64>();
            if !(0..len as i64).contains(&i) {
                return Err(Error::shape(format!(
                    "as_strided(size={size:?}, stride={stride:?}, storage_offset={offset}) \
                     reads element {i} of a tensor of {len}"
                )));
            }
            index.push(i);
            for k in (0..size.len()).rev() {
                at[k] += 1;
                if at[k] < size[k] {
                    break;
                }
                at[k] = 0;
            }
        }
        Ok(index)
    }

    /// `base` with the elements at storage positions `index` (distinct)
    /// replaced by those of `view`, in order: the write back through an
    /// `as_strided` view. Each position's source element is gathered,
    /// `where` the view covers it.
    pub(super) fn strided_scatter(
        &mut self,
        c: &Ctx,
        base: ValueId,
        view: ValueId,
        index: &[i64],
    ) -> Result<ValueId> {
        let shape = self.shape(base);
        let n = numel(&shape)?;
        let mut source = vec![0i64; n];
        let mut hit = vec![0i64; n];
        for (m, &i) in index.iter().enumerate() {
            source[i as usize] = m as i64;
            hit[i as usize] = 1;
        }
        let source = Tensor::from_i64(DType::I64, &[n], &source)?;
        let source = self.add_table(c, "source", source);
        let hit = Tensor::from_i64(DType::Bool, &[n], &hit)?;
        let hit = self.add_table(c, "hit", hit);
        let view = self.cast_to(c, view, self.dtype(base))?;
        let values = self.emit1(
            c,
            Op::Reshape {
                shape: vec![index.len()],
            },
            vec![Some(view)],
        )?;
        let placed = self.emit1(
            c,
            Op::IndexSelect { dim: 0 },
            vec![Some(values), Some(source)],
        )?;
        let flat = self.emit1(c, Op::Reshape { shape: vec![n] }, vec![Some(base)])?;
        let merged = self.emit1(c, Op::Where, vec![Some(hit), Some(placed), Some(flat)])?;
        self.emit1(c, Op::Reshape { shape }, vec![Some(merged)])
    }

    /// `x.unfold(dim, size, step)`: the windows of `dim` gathered by an
    /// index table, split into `[windows, size]` and the `size` dim moved
    /// last, as PyTorch's view lays them out.
    pub(super) fn unfold(&mut self, c: &Ctx) -> Result<()> {
        let x = self.t(c, "self")?;
        let shape = self.shape(x);
        let r = shape.len().max(1);
        let d = normalize_dim(c.args.int("dimension", 0)?, r)?;
        let n = shape.get(d).copied().unwrap_or(1);
        let size = usize::try_from(c.args.int("size", 1)?).ok();
        let step = usize::try_from(c.args.int("step", 1)?)
            .ok()
            .filter(|&s| s > 0);
        let (Some(size), Some(step)) = (size, step) else {
            return Err(Error::format(
                "unfold with a negative size or a step below 1",
            ));
        };
        if size > n {
            return Err(Error::shape(format!(
                "unfold of {size} from dim {d} of size {n}"
            )));
        }
        let windows = (n - size) / step + 1;
        let index: Vec<i64> = (0..windows)
            .flat_map(|w| (0..size).map(move |j| (w * step + j) as i64))
            .collect();
        let table = Tensor::from_i64(DType::I64, &[index.len()], &index)?;
        let table = self.add_table(c, "windows", table);
        let x = if shape.is_empty() {
            self.emit1(c, Op::Reshape { shape: vec![1] }, vec![Some(x)])?
        } else {
            x
        };
        let picked = self.emit1(c, Op::IndexSelect { dim: d }, vec![Some(x), Some(table)])?;
        let mut split = self.shape(x);
        split.splice(d..=d, [windows, size]);
        let split_v = self.emit1(
            c,
            Op::Reshape {
                shape: split.clone(),
            },
            vec![Some(picked)],
        )?;
        let mut dims: Vec<usize> = (0..split.len()).filter(|&k| k != d + 1).collect();
        dims.push(d + 1);
        self.finish(c, Op::Permute { dims }, vec![Some(split_v)])
    }

    /// `movedim(x, source, destination)` as a permute.
    pub(super) fn movedim(&mut self, c: &Ctx) -> Result<()> {
        let x = self.t(c, "self")?;
        let r = self.rank(x);
        let norm = |v: Vec<i64>| -> Result<Vec<usize>> {
            v.into_iter().map(|d| normalize_dim(d, r)).collect()
        };
        let src = norm(self.req_ints(c, "source")?)?;
        let dst = norm(self.req_ints(c, "destination")?)?;
        if src.len() != dst.len() {
            return Err(Error::format(format!("movedim from {src:?} to {dst:?}")));
        }
        // the moved dims take their destinations, the rest keep their order
        let mut dims = vec![None; r];
        for (&s, &d) in src.iter().zip(&dst) {
            if dims[d].replace(s).is_some() {
                return Err(Error::format(format!("movedim destination {d} repeats")));
            }
        }
        let mut rest = (0..r).filter(|d| !src.contains(d));
        let dims = dims
            .into_iter()
            .map(|d| d.or_else(|| rest.next()))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| Error::format(format!("movedim source {src:?} repeats")))?;
        self.finish(c, Op::Permute { dims }, vec![Some(x)])
    }

    /// `as_strided(x, size, stride, storage_offset)`: element `i` of the
    /// result is element `offset + Σ i_k·stride_k` of `x`'s storage. That
    /// storage is `x` itself when the file says `x` is dense (contiguous, at
    /// offset 0), so the view is a gather from the flattened `x` by an index
    /// table made here. Overlapping strides are fine to read; a write
    /// through this view is refused by the in-place tracking (`as_strided`
    /// is an opaque view there).
    pub(super) fn as_strided(&mut self, c: &Ctx) -> Result<()> {
        let x = self.t(c, "self")?;
        let name = c.args.tensor_name("self")?.unwrap_or_default();
        if !self.dense.contains(name) {
            return Err(Error::unsupported(format!(
                "as_strided of `{name}`, whose file layout is not a dense tensor at storage \
                 offset 0 (as_strided reads storage, which etmetal does not keep for views); \
                 call `.contiguous()` before `as_strided`"
            )));
        }
        let size = self.size_arg(c, "size")?;
        let stride = self.req_ints(c, "stride")?;
        if stride.len() != size.len() {
            return Err(Error::format(format!(
                "as_strided with size {size:?} and stride {stride:?}"
            )));
        }
        let len = numel(&self.shape(x))?;
        let index = self.strided_index(c, len)?;
        let total = index.len();
        let flat = self.emit1(c, Op::Reshape { shape: vec![len] }, vec![Some(x)])?;
        let table = Tensor::from_i64(DType::I64, &[total], &index)?;
        let table = self.add_table(c, "index", table);
        let picked = self.emit1(c, Op::IndexSelect { dim: 0 }, vec![Some(flat), Some(table)])?;
        self.finish(c, Op::Reshape { shape: size }, vec![Some(picked)])
    }
}
