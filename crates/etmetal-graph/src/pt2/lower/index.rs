//! Indexing: gathers, advanced indexing, and writes at indexed positions
//! (`index_put`, `index_copy`, slice/select scatters; the one-hot
//! scatters are `scatter.rs`'s).

use etmetal_core::{BinaryOp, DType, Error, Op, Result, Scalar};

use super::{Ctx, Lowerer};

impl Lowerer<'_> {
    /// Lower `c` (ATen op `name`, overload `overload`) if it is a gather, an index, or a write at indexed positions;
    /// `false` when it is not.
    pub(super) fn lower_indexing(&mut self, c: &Ctx, name: &str, overload: &str) -> Result<bool> {
        let a = &c.args;
        let lowered = match (name, overload) {
            ("scatter", "src" | "value") => self.scatter(c, false),
            ("scatter_add", "default") => self.scatter(c, true),
            ("one_hot", "default") => self.one_hot(c),
            ("embedding", "default") => {
                let (w, i) = (self.t(c, "weight")?, self.t(c, "indices")?);
                self.finish(c, Op::Embedding, vec![Some(w), Some(i)])
            }
            // The functional forms of buffer updates (what `run_decompositions`
            // makes of `copy_`, slice assignment, `index_copy_`, `index_put_`),
            // as selects and `where`: ops every backend has.
            ("copy", "default") => {
                let x = self.t(c, "self")?;
                let src = self.t(c, "src")?;
                let v = self.broadcast_to(c, src, &self.shape(x), self.dtype(x))?;
                self.finish(c, Op::Identity, vec![Some(v)])
            }
            ("slice_scatter", "default") => {
                let x = self.t(c, "self")?;
                let src = self.t(c, "src")?;
                let (dim, n) = self.sized_dim(c, "dim", 0, &self.shape(x))?;
                let step = usize::try_from(a.int("step", 1)?)
                    .ok()
                    .filter(|&s| s > 0)
                    .ok_or_else(|| Error::format("slice_scatter step must be positive"))?;
                let (start, end) = Self::clamp_range(a.opt_int("start")?, a.opt_int("end")?, n);
                let v = self.slice_scatter(c, x, src, dim, (start, end, step))?;
                self.bind(c, 0, v)
            }
            ("select_scatter", "default") => {
                let x = self.t(c, "self")?;
                let src = self.t(c, "src")?;
                let (dim, n) = self.sized_dim(c, "dim", 0, &self.shape(x))?;
                let i = a.int("index", 0)?;
                let index = usize::try_from(if i < 0 { i + n as i64 } else { i })
                    .ok()
                    .filter(|&i| i < n)
                    .ok_or_else(|| {
                        Error::shape(format!("select_scatter index {i} of dim {dim} of size {n}"))
                    })?;
                let v = self.select_scatter(c, x, src, dim, index)?;
                self.bind(c, 0, v)
            }
            ("index_copy", "default") => {
                let x = self.t(c, "self")?;
                let dim = self.dim(c, "dim", 0, self.rank(x))?;
                let index = self.t(c, "index")?;
                let source = self.t(c, "source")?;
                self.scatter_rows(c, x, dim, index, source)
            }
            ("index_add", "default") => {
                let x = self.t(c, "self")?;
                let dim = self.dim(c, "dim", 0, self.rank(x))?;
                let index = self.t(c, "index")?;
                let source = self.t(c, "source")?;
                self.add_rows(c, (x, dim), index, source, a.scalar("alpha")?)
            }
            ("index_put", "default") => {
                let x = self.t(c, "self")?;
                let shape = self.shape(x);
                let names = a.tensor_names("indices")?;
                let mut given = names
                    .iter()
                    .enumerate()
                    .filter_map(|(d, n)| n.map(|n| (d, n)));
                let (dim, index) = match (given.next(), given.next()) {
                    (Some((d, n)), None) if d < shape.len() => (d, self.lookup(n)?),
                    _ => {
                        return Err(Error::unsupported(
                            "index_put with other than one index tensor",
                        ))
                    }
                };
                if self.rank(index) > 1 || self.dtype(index) == DType::Bool {
                    return Err(Error::unsupported(
                        "index_put with a boolean or multi-dimensional index",
                    ));
                }
                // negative indices count from the end
                let n = self.constant(c, "n", Scalar::Int(shape[dim] as i64), self.dtype(index))?;
                let index = self.emit1(
                    c,
                    Op::Binary(BinaryOp::Remainder),
                    vec![Some(index), Some(n)],
                )?;
                let k = self.shape(index).first().copied().unwrap_or(1);
                let mut rows_shape = shape.clone();
                rows_shape[dim] = k;
                let values = self.t(c, "values")?;
                let values = if self.rank(index) == 0 {
                    // a 0-d index drops the dim: broadcast without it, then put it back
                    let mut dropped = shape.clone();
                    dropped.remove(dim);
                    let v = self.broadcast_to(c, values, &dropped, self.dtype(x))?;
                    self.emit1(c, Op::Reshape { shape: rows_shape }, vec![Some(v)])?
                } else {
                    self.broadcast_to(c, values, &rows_shape, self.dtype(x))?
                };
                if a.bool("accumulate", false)? {
                    return self
                        .add_rows(c, (x, dim), index, values, None)
                        .map(|()| true);
                }
                self.scatter_rows(c, x, dim, index, values)
            }
            ("index_select", "default") => {
                let x = self.t(c, "self")?;
                let dim = self.dim(c, "dim", 0, self.rank(x))?;
                let i = self.t(c, "index")?;
                self.finish(c, Op::IndexSelect { dim }, vec![Some(x), Some(i)])
            }
            ("gather", "default") => {
                let x = self.t(c, "self")?;
                let dim = self.dim(c, "dim", 0, self.rank(x))?;
                let i = self.t(c, "index")?;
                self.finish(c, Op::Gather { dim }, vec![Some(x), Some(i)])
            }
            ("index", "Tensor") => {
                let x = self.t(c, "self")?;
                let mut inputs = vec![Some(x)];
                for name in a.tensor_names("indices")? {
                    inputs.push(name.map(|n| self.lookup(n)).transpose()?);
                }
                self.finish(c, Op::Index, inputs)
            }
            _ => return Ok(false),
        };
        lowered.map(|()| true)
    }
}
