//! Layout lowerings built from slices, cats and gathers: `diff`, `roll`,
//! `movedim`, and `as_strided` as a gather of the flattened input with an
//! index table computed here (the GPU runs it as index arithmetic, as its
//! other layout ops).

use std::ops::Add;

use etmetal_core::shape::{normalize_dim, numel};
use etmetal_core::{BinaryOp, DType, Error, Op, Result, SymExpr, Tensor};

use super::{usizes, Ctx, Lowerer};
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

    /// `x[start..end]` along `dim`.
    pub(super) fn slice_of(
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

impl Lowerer<'_> {
    /// Lower `c` (ATen op `name`, overload `overload`) if it is a view: a reshape, permute or expand, or a strided view;
    /// `false` when it is not.
    pub(super) fn lower_view(&mut self, c: &Ctx, name: &str, overload: &str) -> Result<bool> {
        let a = &c.args;
        let lowered = match (name, overload) {
            ("as_strided" | "as_strided_copy", "default") => self.as_strided(c),
            ("movedim", "int" | "intlist") => self.movedim(c),
            ("unfold", "default") => self.unfold(c),
            ("numpy_T", "default") => {
                // `x.T`: every dim reversed
                let x = self.t(c, "self")?;
                let dims = (0..self.rank(x)).rev().collect();
                self.finish(c, Op::Permute { dims }, vec![Some(x)])
            }
            ("view_as" | "reshape_as", "default") => {
                let x = self.t(c, "self")?;
                let other = self.t(c, "other")?;
                let size: Vec<i64> = self.shape(other).iter().map(|&d| d as i64).collect();
                self.reshape(c, x, &size)
            }
            ("expand_as", "default") => {
                let x = self.t(c, "self")?;
                let other = self.t(c, "other")?;
                let shape = self.shape(other);
                self.finish(c, Op::Expand { shape }, vec![Some(x)])
            }
            ("view" | "_unsafe_view", "default") => {
                let x = self.t(c, "self")?;
                let size = self.req_ints(c, "size")?;
                self.reshape(c, x, &size)
            }
            ("reshape", "default") => {
                let x = self.t(c, "self")?;
                let size = self.req_ints(c, "shape")?;
                self.reshape(c, x, &size)
            }
            ("flatten", "using_ints") => {
                let x = self.t(c, "self")?;
                let shape = self.shape(x);
                let r = shape.len();
                if r == 0 {
                    return self.reshape(c, x, &[1]).map(|()| true);
                }
                let (s, e) = (
                    self.dim(c, "start_dim", 0, r)?,
                    self.dim(c, "end_dim", -1, r)?,
                );
                if s > e {
                    return Err(Error::shape(format!("flatten start_dim {s} > end_dim {e}")));
                }
                let mut sizes: Vec<i64> = shape[..s].iter().map(|&d| d as i64).collect();
                sizes.push(shape[s..=e].iter().product::<usize>() as i64);
                sizes.extend(shape[e + 1..].iter().map(|&d| d as i64));
                self.reshape(c, x, &sizes)
            }
            ("unflatten", "int") => {
                let x = self.t(c, "self")?;
                let shape = self.shape(x);
                let (d, _) = self.sized_dim(c, "dim", 0, &shape)?;
                let mut sizes: Vec<i64> = shape[..d].iter().map(|&v| v as i64).collect();
                sizes.extend(self.req_ints(c, "sizes")?);
                sizes.extend(shape[d + 1..].iter().map(|&v| v as i64));
                self.reshape(c, x, &sizes)
            }
            ("squeeze", "dim" | "dims" | "default") => {
                let x = self.t(c, "self")?;
                let shape = self.shape(x);
                let dims = match a.get("dim")? {
                    None => (0..shape.len()).collect(),
                    Some(("as_int", _)) => vec![self.dim(c, "dim", 0, shape.len())?],
                    Some(_) => self.dims(c, "dim", shape.len())?,
                };
                let sizes: Vec<i64> = shape
                    .iter()
                    .enumerate()
                    .filter(|(i, &n)| !(n == 1 && dims.contains(i)))
                    .map(|(_, &n)| n as i64)
                    .collect();
                self.reshape(c, x, &sizes)
            }
            ("unsqueeze", "default") => {
                let x = self.t(c, "self")?;
                let mut sizes: Vec<i64> = self.shape(x).iter().map(|&n| n as i64).collect();
                let d = self.dim(c, "dim", 0, sizes.len() + 1)?;
                sizes.insert(d, 1);
                self.reshape(c, x, &sizes)
            }
            ("permute", "default") => {
                let x = self.t(c, "self")?;
                let r = self.rank(x);
                let dims = self
                    .req_ints(c, "dims")?
                    .into_iter()
                    .map(|d| normalize_dim(d, r))
                    .collect::<Result<_>>()?;
                self.finish(c, Op::Permute { dims }, vec![Some(x)])
            }
            ("transpose" | "swapdims", "int" | "default")
            | ("swapaxes", "default")
            | ("t", "default") => {
                let x = self.t(c, "self")?;
                let r = self.rank(x);
                if r < 2 {
                    return self.unary_identity(c, "self").map(|()| true);
                }
                let (n0, n1) = if name == "swapaxes" {
                    ("axis0", "axis1")
                } else {
                    ("dim0", "dim1")
                };
                let (d0, d1) = (self.dim(c, n0, 0, r)?, self.dim(c, n1, 1, r)?);
                let mut dims: Vec<usize> = (0..r).collect();
                dims.swap(d0, d1);
                self.finish(c, Op::Permute { dims }, vec![Some(x)])
            }
            ("expand" | "broadcast_to", "default") => {
                let x = self.t(c, "self")?;
                let from = self.shape(x);
                let size = self.req_ints(c, "size")?;
                let lead = size.len().checked_sub(from.len()).ok_or_else(|| {
                    Error::shape(format!("cannot expand {from:?} to fewer dims {size:?}"))
                })?;
                let shape = size
                    .iter()
                    .enumerate()
                    .map(|(i, &s)| match s {
                        -1 if i >= lead => Ok(from[i - lead]),
                        s if s >= 0 => Ok(s as usize),
                        _ => Err(Error::shape(format!("cannot expand {from:?} to {size:?}"))),
                    })
                    .collect::<Result<_>>()?;
                self.finish(c, Op::Expand { shape }, vec![Some(x)])
            }
            _ => return Ok(false),
        };
        lowered.map(|()| true)
    }
}

impl Lowerer<'_> {
    /// Lower `c` (ATen op `name`, overload `overload`) if it is a slice, split, cat, pad, repeat or triangle;
    /// `false` when it is not.
    pub(super) fn lower_layout(&mut self, c: &Ctx, name: &str, overload: &str) -> Result<bool> {
        let a = &c.args;
        let lowered = match (name, overload) {
            ("diff", "default") => self.diff(c),
            ("roll", "default") => self.roll(c),
            ("slice", "Tensor") => {
                let x = self.t(c, "self")?;
                let shape = self.shape(x);
                let (dim, size) = self.sized_dim(c, "dim", 0, &shape)?;
                let step = usize::try_from(a.int("step", 1)?)
                    .ok()
                    .filter(|&s| s > 0)
                    .ok_or_else(|| Error::format("slice step must be positive"))?;
                let (start, end) = Self::clamp_range(a.opt_int("start")?, a.opt_int("end")?, size);
                self.finish(
                    c,
                    Op::Slice {
                        dim,
                        start,
                        end,
                        step,
                    },
                    vec![Some(x)],
                )?;
                let start = a.sym_int("start")?.unwrap_or(SymExpr::Const(0));
                let end = a.sym_int("end")?.unwrap_or(SymExpr::Const(i64::MAX));
                self.keep_sym_args(x, dim, vec![start, end])
            }
            ("narrow", "default") => {
                let x = self.t(c, "self")?;
                let shape = self.shape(x);
                let (dim, n) = self.sized_dim(c, "dim", 0, &shape)?;
                let n = n as i64;
                let start = a.int("start", 0)?;
                let start = if start < 0 { start + n } else { start };
                let len = a.int("length", 0)?;
                if start < 0 || len < 0 || start + len > n {
                    return Err(Error::shape(format!(
                        "narrow({dim}, {start}, {len}) of {shape:?}"
                    )));
                }
                let op = Op::Slice {
                    dim,
                    start: start as usize,
                    end: (start + len) as usize,
                    step: 1,
                };
                self.finish(c, op, vec![Some(x)])?;
                let start = a.sym_int("start")?.unwrap_or(SymExpr::Const(0));
                let len = a.sym_int("length")?.unwrap_or(SymExpr::Const(0));
                // a negative start counts from the end, so its end does too
                let end = match start.as_const() {
                    Some(s) if s < 0 && s + len.as_const().unwrap_or(0) == 0 => {
                        SymExpr::Const(i64::MAX)
                    }
                    _ => SymExpr::add(start.clone(), len),
                };
                self.keep_sym_args(x, dim, vec![start, end])
            }
            ("select", "int") => {
                let x = self.t(c, "self")?;
                let shape = self.shape(x);
                let (dim, n) = self.sized_dim(c, "dim", 0, &shape)?;
                let i = a.int("index", 0)?;
                let index =
                    usize::try_from(if i < 0 { i + n as i64 } else { i }).map_err(|_| {
                        Error::shape(format!("select index {i} of dim {dim} of {shape:?}"))
                    })?;
                self.finish(c, Op::Select { dim, index }, vec![Some(x)])?;
                let index = a.sym_int("index")?.unwrap_or(SymExpr::Const(0));
                self.keep_sym_args(x, dim, vec![index])
            }
            ("split", "Tensor") | ("split_with_sizes", "default") | ("chunk", "default") => {
                let x = self.t(c, "self")?;
                let shape = self.shape(x);
                let (dim, n) = self.sized_dim(c, "dim", 0, &shape)?;
                let sizes = match name {
                    "split_with_sizes" => usizes(&self.req_ints(c, "split_sizes")?, "split_sizes")?,
                    _ => {
                        let piece = if name == "chunk" {
                            let chunks = usize::try_from(a.int("chunks", 1)?)
                                .ok()
                                .filter(|&k| k > 0)
                                .ok_or_else(|| Error::format("chunks must be positive"))?;
                            n.div_ceil(chunks)
                        } else {
                            usize::try_from(a.int("split_size", 1)?)
                                .ok()
                                .filter(|&k| k > 0)
                                .ok_or_else(|| Error::format("split_size must be positive"))?
                        };
                        let mut sizes = vec![piece; n / piece.max(1)];
                        if !n.is_multiple_of(piece) {
                            sizes.push(n % piece);
                        }
                        sizes
                    }
                };
                self.split(c, x, dim, &sizes)
            }
            ("tensor_split", "indices" | "sections" | "tensor_indices_or_sections") => {
                self.tensor_split(c, overload)
            }
            ("unbind", "int") => {
                let x = self.t(c, "self")?;
                let shape = self.shape(x);
                let (dim, n) = self.sized_dim(c, "dim", 0, &shape)?;
                for index in 0..n {
                    let v = self.emit1(c, Op::Select { dim, index }, vec![Some(x)])?;
                    self.bind(c, index, v)?;
                }
                Ok(())
            }
            ("meshgrid", "default" | "indexing") => {
                let parts = self.tensor_list(c, "tensors")?;
                let xy = match a.string("indexing")? {
                    None | Some("ij") => false,
                    Some("xy") => true,
                    Some(m) => return Err(Error::format(format!("meshgrid indexing `{m}`"))),
                };
                let mut sizes = Vec::with_capacity(parts.len());
                for &p in &parts {
                    match self.shape(p)[..] {
                        [] => sizes.push(1),
                        [n] => sizes.push(n),
                        ref s => {
                            return Err(Error::shape(format!(
                                "meshgrid of a {s:?} tensor (1-D only)"
                            )))
                        }
                    }
                }
                // "xy": the first two inputs vary along the output's dims 1 and 0
                let place = |i: usize| match i {
                    0 | 1 if xy && sizes.len() > 1 => 1 - i,
                    _ => i,
                };
                let mut out = vec![0; sizes.len()];
                for (i, &n) in sizes.iter().enumerate() {
                    out[place(i)] = n;
                }
                for (i, &p) in parts.iter().enumerate() {
                    let mut shape = vec![1; sizes.len()];
                    shape[place(i)] = sizes[i];
                    let v = self.emit1(c, Op::Reshape { shape }, vec![Some(p)])?;
                    let v = self.emit1(c, Op::Expand { shape: out.clone() }, vec![Some(v)])?;
                    self.bind(c, i, v)?;
                }
                Ok(())
            }
            ("cat" | "concat" | "concatenate", "default") => {
                let parts = self.tensor_list(c, "tensors")?;
                // legacy 1-D empty tensors do not decide the rank
                let rank = parts
                    .iter()
                    .map(|&p| self.shape(p))
                    .find(|s| s != &[0])
                    .map_or(1, |s| s.len());
                let dim = self.dim(c, "dim", 0, rank)?;
                self.finish(c, Op::Cat { dim }, parts.into_iter().map(Some).collect())
            }
            ("stack", "default") => {
                let parts = self.tensor_list(c, "tensors")?;
                let first = parts
                    .first()
                    .ok_or_else(|| Error::shape("stack of no tensors"))?;
                let mut shape = self.shape(*first);
                let dim = self.dim(c, "dim", 0, shape.len() + 1)?;
                shape.insert(dim, 1);
                let mut unsqueezed = vec![];
                for p in parts {
                    unsqueezed.push(Some(self.emit1(
                        c,
                        Op::Reshape {
                            shape: shape.clone(),
                        },
                        vec![Some(p)],
                    )?));
                }
                self.finish(c, Op::Cat { dim }, unsqueezed)
            }
            ("triu" | "tril", "default") => {
                let x = self.t(c, "self")?;
                let op = Op::Triangle {
                    upper: name == "triu",
                    diagonal: a.int("diagonal", 0)?,
                };
                self.finish(c, op, vec![Some(x)])
            }
            ("repeat", "default") => {
                let x = self.t(c, "self")?;
                let repeats = usizes(&self.req_ints(c, "repeats")?, "repeats")?;
                self.finish(c, Op::Repeat { repeats }, vec![Some(x)])
            }
            ("repeat_interleave", "self_int") => {
                // each element `repeats` times along `dim` (flattened when
                // absent): unsqueeze after `dim`, expand, merge the two dims
                let mut x = self.t(c, "self")?;
                let repeats = usizes(&[c.args.int("repeats", 1)?], "repeats")?[0];
                let d = match c.args.opt_int("dim")? {
                    Some(d) => normalize_dim(d, self.rank(x))?,
                    None => {
                        let n = self.shape(x).iter().product();
                        x = self.emit1(c, Op::Reshape { shape: vec![n] }, vec![Some(x)])?;
                        0
                    }
                };
                let shape = self.shape(x);
                let mut expanded = shape.clone();
                expanded.insert(d + 1, 1);
                let u = self.emit1(
                    c,
                    Op::Reshape {
                        shape: expanded.clone(),
                    },
                    vec![Some(x)],
                )?;
                expanded[d + 1] = repeats;
                let e = self.emit1(c, Op::Expand { shape: expanded }, vec![Some(u)])?;
                let mut sizes: Vec<i64> = shape.iter().map(|&n| n as i64).collect();
                sizes[d] *= repeats as i64;
                self.reshape(c, e, &sizes)
            }
            ("constant_pad_nd", "default") | ("pad", "default") => {
                if let Some(mode) = a.string("mode")? {
                    if mode != "constant" {
                        return Err(Error::unsupported(format!(
                            "pad mode `{mode}` (only constant)"
                        )));
                    }
                }
                let x = self.t(c, "self")?;
                let pad = self.req_ints(c, "pad")?;
                self.finish(
                    c,
                    Op::ConstantPad {
                        pad,
                        value: a.float("value", 0.0)?,
                    },
                    vec![Some(x)],
                )
            }
            _ => return Ok(false),
        };
        lowered.map(|()| true)
    }
}
