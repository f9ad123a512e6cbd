//! ATen ops that `run_decompositions` would split, lowered here as the same
//! compositions of existing ops (so a program saved straight from
//! `torch.export.export` imports): softplus and its relatives, logsumexp,
//! addcmul/addcdiv/baddbmm, NaN and infinity tests, flip, glu, pixel
//! shuffles, histc, eye, and the grouped matmul of mixture-of-experts layers.

use etmetal_core::{BinaryOp, DType, Error, Op, ReduceOp, Result, Scalar, Tensor, UnaryOp};

use super::{Ctx, Lowerer};
use crate::ir::ValueId;

impl Lowerer<'_> {
    fn un(&mut self, c: &Ctx, u: UnaryOp, x: ValueId) -> Result<ValueId> {
        self.emit1(c, Op::Unary(u), vec![Some(x)])
    }
    fn bin(&mut self, c: &Ctx, b: BinaryOp, x: ValueId, y: ValueId) -> Result<ValueId> {
        self.emit1(c, Op::Binary(b), vec![Some(x), Some(y)])
    }
    /// `x op k` for a float `k`, in `x`'s dtype.
    fn bin_k(&mut self, c: &Ctx, b: BinaryOp, x: ValueId, k: f64) -> Result<ValueId> {
        let k = self.constant(c, "k", Scalar::Float(k), self.dtype(x))?;
        self.bin(c, b, x, k)
    }
    fn select3(&mut self, c: &Ctx, cond: ValueId, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.emit1(c, Op::Where, vec![Some(cond), Some(a), Some(b)])
    }

    /// `log(1 + exp(beta x)) / beta`, or `x` where `beta x > threshold`.
    fn softplus_of(&mut self, c: &Ctx, x: ValueId, beta: f64, threshold: f64) -> Result<ValueId> {
        let bx = self.bin_k(c, BinaryOp::Mul, x, beta)?;
        let e = self.un(c, UnaryOp::Exp, bx)?;
        let e1 = self.bin_k(c, BinaryOp::Add, e, 1.0)?;
        let l = self.un(c, UnaryOp::Log, e1)?;
        let soft = self.bin_k(c, BinaryOp::Div, l, beta)?;
        let big = self.bin_k(c, BinaryOp::Gt, bx, threshold)?;
        self.select3(c, big, x, soft)
    }

    /// A size argument (an int, not negative).
    fn size_int(&self, c: &Ctx, arg: &str) -> Result<usize> {
        let v = c
            .args
            .opt_int(arg)?
            .ok_or_else(|| Error::format(format!("missing int argument `{arg}`")))?;
        usize::try_from(v).map_err(|_| Error::shape(format!("`{arg}` = {v} is negative")))
    }

    fn sum(&mut self, c: &Ctx, x: ValueId, dim: usize) -> Result<ValueId> {
        let op = Op::Reduce {
            op: ReduceOp::Sum,
            dims: vec![dim],
            keepdim: false,
        };
        self.emit1(c, op, vec![Some(x)])
    }
    /// `0..n` in `dtype`.
    fn iota(&mut self, c: &Ctx, n: usize, dtype: DType) -> Result<ValueId> {
        let op = Op::Arange {
            start: Scalar::Int(0),
            end: Scalar::Int(n as i64),
            step: Scalar::Int(1),
            dtype: DType::I64,
        };
        let v = self.emit1(c, op, vec![])?;
        if dtype == DType::I64 {
            return Ok(v);
        }
        self.emit1(c, Op::Cast { dtype }, vec![Some(v)])
    }

    /// `out[s] = input[s] @ weight[e]` for the expert `e` whose rows
    /// `offs[e-1]..offs[e]` hold row `s` (rows from `offs[E-1]` on are zero):
    /// the grouped matmul of transformers' mixture-of-experts layers
    /// (`transformers::grouped_mm_fallback`, and `aten._grouped_mm` of a
    /// 2-D input and 3-D weights). With fewer rows than experts (a decode
    /// step's routed rows, both counts static; [`crate::moe`]) each row's expert's weights
    /// are gathered and multiplied by that row alone ([`Self::grouped_mm_sparse`]),
    /// so only the routed experts' weights are read; with as many rows or
    /// more (a prefill) every expert's product is computed and each row
    /// keeps its own ([`Self::grouped_mm_dense`]): memory grows as
    /// E x S x N, never as a copy of the weights per row.
    pub(super) fn grouped_mm(
        &mut self,
        c: &Ctx,
        input: &str,
        weight: &str,
        offs: &str,
    ) -> Result<()> {
        let (x, w) = (self.t(c, input)?, self.t(c, weight)?);
        let Some(offs) = self.opt_t(c, offs)? else {
            return Err(Error::unsupported(
                "grouped matmul without `offs` (a batched matmul)",
            ));
        };
        let (xs, ws, os) = (self.shape(x), self.shape(w), self.shape(offs));
        let (&[s, k], &[e, k2, n], &[e2]) = (&xs[..], &ws[..], &os[..]) else {
            return Err(Error::unsupported(format!(
                "grouped matmul of {xs:?} by {ws:?} with offsets {os:?} (only a 2-D input by 3-D expert weights)"
            )));
        };
        if k != k2 || e != e2 {
            return Err(Error::shape(format!(
                "grouped matmul of {xs:?} by {ws:?} with offsets {os:?}"
            )));
        }
        if self.dtype(x) != self.dtype(w) {
            return Err(Error::unsupported(format!(
                "grouped matmul of {:?} by {:?}",
                self.dtype(x),
                self.dtype(w)
            )));
        }
        let static_rows = self.graph.sym_dims(x)[0].as_const().is_some();
        let out = if static_rows && 0 < s && s < e {
            self.grouped_mm_sparse(c, (x, w, offs), [s, k, e, n])?
        } else {
            self.grouped_mm_dense(c, (x, w, offs), [s, k, e, n])?
        };
        self.bind(c, 0, out)
    }

    /// [`Self::grouped_mm`] of `S < E` rows: row `s`'s expert
    /// `e(s) = #{e < E-1 : offs[e] <= s}` (the last offset left out, so a
    /// row past every group still names an expert, `E-1`, and its gather
    /// stays in range), its weights gathered (`[S, K, N]`: fewer than the
    /// `E` experts', and only the routed ones) and multiplied by the row; the rows from `offs[E-1]`
    /// on are then zeroed by a product with `s < offs[E-1]`, right after
    /// the matmul and of its shape, so a GPU product stores it in its
    /// epilogue.
    fn grouped_mm_sparse(
        &mut self,
        c: &Ctx,
        (x, w, offs): (ValueId, ValueId, ValueId),
        [s, k, e, n]: [usize; 4],
    ) -> Result<ValueId> {
        let dtype = self.dtype(x);
        let rows = self.iota(c, s, self.dtype(offs))?;
        let rows = self.reshaped(c, rows, vec![s, 1])?;
        let starts = self.slice_of(c, offs, 0, 0, e - 1)?;
        let starts = self.reshaped(c, starts, vec![1, e - 1])?;
        let before = self.bin(c, BinaryOp::Le, starts, rows)?;
        let before = self.emit1(c, Op::Cast { dtype: DType::I64 }, vec![Some(before)])?;
        let expert = self.sum(c, before, 1)?;
        let last = self.slice_of(c, offs, 0, e - 1, e)?;
        let last = self.reshaped(c, last, vec![1, 1])?;
        let keep = self.bin(c, BinaryOp::Lt, rows, last)?;
        let keep = self.emit1(c, Op::Cast { dtype }, vec![Some(keep)])?;
        let keep = self.reshaped(c, keep, vec![s, 1, 1])?;
        let mine = self.emit1(c, Op::IndexSelect { dim: 0 }, vec![Some(w), Some(expert)])?;
        let x3 = self.reshaped(c, x, vec![s, 1, k])?;
        let product = self.emit1(c, Op::MatMul, vec![Some(x3), Some(mine)])?;
        let kept = self.bin(c, BinaryOp::Mul, product, keep)?;
        self.reshaped(c, kept, vec![s, n])
    }

    /// [`Self::grouped_mm`] of every expert: `E` products of all rows, of
    /// which each row keeps its own expert's (`E` past the last group:
    /// none, so zero).
    fn grouped_mm_dense(
        &mut self,
        c: &Ctx,
        (x, w, offs): (ValueId, ValueId, ValueId),
        [s, k, e, n]: [usize; 4],
    ) -> Result<ValueId> {
        let ot = self.dtype(offs);
        // expert(s) = #{e : offs[e] <= s}, E for the rows past the last group
        let rows = self.iota(c, s, ot)?;
        let rows = self.reshaped(c, rows, vec![s, 1])?;
        let ends = self.reshaped(c, offs, vec![1, e])?;
        let before = self.bin(c, BinaryOp::Le, ends, rows)?;
        let before = self.emit1(c, Op::Cast { dtype: DType::I64 }, vec![Some(before)])?;
        let expert = self.sum(c, before, 1)?;
        let expert = self.reshaped(c, expert, vec![s, 1])?;
        let ids = self.iota(c, e, DType::I64)?;
        let ids = self.reshaped(c, ids, vec![1, e])?;
        let mine = self.bin(c, BinaryOp::Eq, expert, ids)?;
        let mine = self.emit1(
            c,
            Op::Cast {
                dtype: self.dtype(x),
            },
            vec![Some(mine)],
        )?;
        let mine = self.emit1(c, Op::Permute { dims: vec![1, 0] }, vec![Some(mine)])?;
        let mine = self.reshaped(c, mine, vec![e, s, 1])?;
        let x3 = self.reshaped(c, x, vec![1, s, k])?;
        let x3 = self.emit1(
            c,
            Op::Expand {
                shape: vec![e, s, k],
            },
            vec![Some(x3)],
        )?;
        let all = self.emit1(c, Op::MatMul, vec![Some(x3), Some(w)])?;
        let kept = self.bin(c, BinaryOp::Mul, all, mine)?;
        let out = self.sum(c, kept, 0)?;
        debug_assert_eq!(self.shape(out), [s, n]);
        Ok(out)
    }

    /// `histc`: counts of `x`'s elements in `bins` equal bins over
    /// `[min, max]` (PyTorch's bin arithmetic: `(x - min) * bins / (max - min)`,
    /// `max` itself in the last bin, elements outside and NaN not counted).
    fn histc(&mut self, c: &Ctx) -> Result<ValueId> {
        let a = &c.args;
        let x = self.t(c, "self")?;
        let dtype = self.dtype(x);
        if !dtype.is_float() {
            return Err(Error::unsupported(format!(
                "histc of {dtype:?} (PyTorch takes floats only)"
            )));
        }
        let bins = a.int("bins", 100)?;
        let (lo, hi) = (a.float("min", 0.0)?, a.float("max", 0.0)?);
        if bins <= 0 || lo > hi {
            return Err(Error::format(format!(
                "histc of {bins} bins over [{lo}, {hi}]"
            )));
        }
        if lo == hi {
            return Err(Error::unsupported(
                "histc with min == max (its range would be taken from the data)",
            ));
        }
        let bins = bins as usize;
        let count = self.shape(x).iter().product();
        let flat = self.reshaped(c, x, vec![count, 1])?;
        let off = self.bin_k(c, BinaryOp::Sub, flat, lo)?;
        let scaled = self.bin_k(c, BinaryOp::Mul, off, bins as f64)?;
        let pos = self.bin_k(c, BinaryOp::Div, scaled, hi - lo)?;
        let pos = self.un(c, UnaryOp::Floor, pos)?;
        let bin = self.bin_k(c, BinaryOp::Minimum, pos, (bins - 1) as f64)?;
        let above = self.bin_k(c, BinaryOp::Ge, flat, lo)?;
        let below = self.bin_k(c, BinaryOp::Le, flat, hi)?;
        let inside = self.bin(c, BinaryOp::LogicalAnd, above, below)?;
        let ids = self.iota(c, bins, dtype)?;
        let ids = self.reshaped(c, ids, vec![1, bins])?;
        let hit = self.bin(c, BinaryOp::Eq, bin, ids)?;
        let hit = self.bin(c, BinaryOp::LogicalAnd, hit, inside)?;
        let hit = self.emit1(c, Op::Cast { dtype }, vec![Some(hit)])?;
        self.sum(c, hit, 0)
    }

    /// The composite ops of this module (`name` as in `lower_node`);
    /// `Ok(false)` when `name` is not one of them.
    pub(super) fn composite(&mut self, c: &Ctx, name: &str, overload: &str) -> Result<bool> {
        let v = match self.pointwise_composite(c, name, overload)? {
            Some(v) => v,
            None => match self.structural_composite(c, name, overload)? {
                Some(v) => v,
                None => return Ok(false),
            },
        };
        self.bind(c, 0, v)?;
        Ok(true)
    }

    /// Composites computed elementwise (activations, `log1p`, `lerp`, …)
    /// and `logsumexp`, `glu`: the value to bind, or `None`.
    fn pointwise_composite(
        &mut self,
        c: &Ctx,
        name: &str,
        overload: &str,
    ) -> Result<Option<ValueId>> {
        let a = &c.args;
        Ok(Some(match (name, overload) {
            ("softplus", "default") => {
                let x = self.t(c, "self")?;
                self.softplus_of(c, x, a.float("beta", 1.0)?, a.float("threshold", 20.0)?)?
            }
            ("mish", "default") => {
                let x = self.t(c, "self")?;
                let sp = self.softplus_of(c, x, 1.0, 20.0)?;
                let t = self.un(c, UnaryOp::Tanh, sp)?;
                self.bin(c, BinaryOp::Mul, x, t)?
            }
            ("log_sigmoid", "default") => {
                let x = self.t(c, "self")?;
                let n = self.un(c, UnaryOp::Neg, x)?;
                let sp = self.softplus_of(c, n, 1.0, 20.0)?;
                self.un(c, UnaryOp::Neg, sp)?
            }
            ("elu" | "selu" | "celu", "default") => {
                // scale * (x if x > 0 else alpha * (exp(x / input_scale) - 1))
                let x = self.t(c, "self")?;
                let (alpha, scale, input_scale) = match name {
                    "selu" => (1.673_263_242_354_377_3, 1.050_700_987_355_480_5, 1.0),
                    "celu" => {
                        let alpha = a.float("alpha", 1.0)?;
                        (alpha, 1.0, 1.0 / alpha)
                    }
                    _ => (
                        a.float("alpha", 1.0)?,
                        a.float("scale", 1.0)?,
                        a.float("input_scale", 1.0)?,
                    ),
                };
                let xs = self.bin_k(c, BinaryOp::Mul, x, input_scale)?;
                let e = self.un(c, UnaryOp::Exp, xs)?;
                let em1 = self.bin_k(c, BinaryOp::Sub, e, 1.0)?;
                let neg = self.bin_k(c, BinaryOp::Mul, em1, alpha)?;
                let pos = self.bin_k(c, BinaryOp::Gt, x, 0.0)?;
                let y = self.select3(c, pos, x, neg)?;
                self.bin_k(c, BinaryOp::Mul, y, scale)?
            }
            ("expm1", "default") => {
                let x = self.t(c, "self")?;
                let e = self.un(c, UnaryOp::Exp, x)?;
                self.bin_k(c, BinaryOp::Sub, e, 1.0)?
            }
            ("log1p", "default") => {
                let x = self.t(c, "self")?;
                let x1 = self.bin_k(c, BinaryOp::Add, x, 1.0)?;
                self.un(c, UnaryOp::Log, x1)?
            }
            ("logsumexp", "default") => {
                // m + log(sum(exp(x - m))), m the max (0 where it is infinite)
                let x = self.t(c, "self")?;
                let dims = self.dims(c, "dim", self.rank(x))?;
                let keepdim = a.bool("keepdim", false)?;
                let reduce = |op, keepdim| Op::Reduce {
                    op,
                    dims: dims.clone(),
                    keepdim,
                };
                let m = self.emit1(c, reduce(ReduceOp::Max, true), vec![Some(x)])?;
                let abs = self.un(c, UnaryOp::Abs, m)?;
                let inf = self.bin_k(c, BinaryOp::Eq, abs, f64::INFINITY)?;
                let zero = self.constant(c, "zero", Scalar::Float(0.0), self.dtype(x))?;
                let m = self.select3(c, inf, zero, m)?;
                let d = self.bin(c, BinaryOp::Sub, x, m)?;
                let e = self.un(c, UnaryOp::Exp, d)?;
                let s = self.emit1(c, reduce(ReduceOp::Sum, keepdim), vec![Some(e)])?;
                let l = self.un(c, UnaryOp::Log, s)?;
                let m = if keepdim {
                    m
                } else {
                    let shape = self.shape(l);
                    self.emit1(c, Op::Reshape { shape }, vec![Some(m)])?
                };
                self.bin(c, BinaryOp::Add, l, m)?
            }
            ("addcmul" | "addcdiv", "default") => {
                let x = self.t(c, "self")?;
                let (t1, t2) = (self.t(c, "tensor1")?, self.t(c, "tensor2")?);
                let op = if name == "addcmul" {
                    BinaryOp::Mul
                } else {
                    BinaryOp::Div
                };
                let p = self.bin(c, op, t1, t2)?;
                let value = a.scalar("value")?.unwrap_or(Scalar::Int(1));
                let p = if value.to_f64() == 1.0 {
                    p
                } else {
                    let k = self.constant(c, "value", value, self.dtype(p))?;
                    self.bin(c, BinaryOp::Mul, p, k)?
                };
                self.bin(c, BinaryOp::Add, x, p)?
            }
            ("isnan", "default") => {
                let x = self.t(c, "self")?;
                self.bin(c, BinaryOp::Ne, x, x)?
            }
            ("isinf", "default") => {
                let x = self.t(c, "self")?;
                let abs = self.un(c, UnaryOp::Abs, x)?;
                self.bin_k(c, BinaryOp::Eq, abs, f64::INFINITY)?
            }
            ("isfinite", "default") => {
                // |x| < inf is false for NaN and for infinities
                let x = self.t(c, "self")?;
                let abs = self.un(c, UnaryOp::Abs, x)?;
                self.bin_k(c, BinaryOp::Lt, abs, f64::INFINITY)?
            }
            ("nan_to_num", "default") => {
                let x = self.t(c, "self")?;
                let dtype = self.dtype(x);
                let max = match dtype {
                    DType::F16 => 65504.0,
                    DType::BF16 => 3.389_531_389_251_535_5e38,
                    _ => f32::MAX as f64,
                };
                let nan = a.opt_float("nan")?.unwrap_or(0.0);
                let pos = a.opt_float("posinf")?.unwrap_or(max);
                let neg = a.opt_float("neginf")?.unwrap_or(-max);
                let mut y = x;
                for (k, v) in [(f64::INFINITY, pos), (f64::NEG_INFINITY, neg)] {
                    let hit = self.bin_k(c, BinaryOp::Eq, x, k)?;
                    let v = self.constant(c, "value", Scalar::Float(v), dtype)?;
                    y = self.select3(c, hit, v, y)?;
                }
                let is_nan = self.bin(c, BinaryOp::Ne, x, x)?;
                let v = self.constant(c, "nan", Scalar::Float(nan), dtype)?;
                self.select3(c, is_nan, v, y)?
            }
            ("hardshrink" | "softshrink", "default") => {
                let x = self.t(c, "self")?;
                let l = a.float("lambd", 0.5)?;
                let abs = self.un(c, UnaryOp::Abs, x)?;
                let small = self.bin_k(c, BinaryOp::Le, abs, l)?;
                let kept = if name == "softshrink" {
                    // x - l * sign(x)
                    let s = self.un(c, UnaryOp::Sign, x)?;
                    let ls = self.bin_k(c, BinaryOp::Mul, s, l)?;
                    self.bin(c, BinaryOp::Sub, x, ls)?
                } else {
                    x
                };
                let zero = self.constant(c, "zero", Scalar::Float(0.0), self.dtype(x))?;
                self.select3(c, small, zero, kept)?
            }
            ("threshold", "default") => {
                let x = self.t(c, "self")?;
                let th = self.req_scalar(c, "threshold")?;
                let value = self.req_scalar(c, "value")?;
                let th = self.constant(c, "threshold", th, self.dtype(x))?;
                let le = self.bin(c, BinaryOp::Le, x, th)?;
                let v = self.constant(c, "value", value, self.dtype(x))?;
                self.select3(c, le, v, x)?
            }
            ("lerp", "Scalar" | "Tensor") => {
                // start + weight * (end - start)
                let start = self.t(c, "self")?;
                let end = self.t(c, "end")?;
                let w = self.operand(c, "weight", Some(start))?;
                let d = self.bin(c, BinaryOp::Sub, end, start)?;
                let wd = self.bin(c, BinaryOp::Mul, w, d)?;
                self.bin(c, BinaryOp::Add, start, wd)?
            }
            ("glu", "default") => {
                let x = self.t(c, "self")?;
                let (dim, n) = self.sized_dim(c, "dim", -1, &self.shape(x))?;
                if n % 2 != 0 {
                    return Err(Error::shape(format!(
                        "glu halves dim {dim} of odd size {n}"
                    )));
                }
                let half = |start, end| Op::Slice {
                    dim,
                    start,
                    end,
                    step: 1,
                };
                let first = self.emit1(c, half(0, n / 2), vec![Some(x)])?;
                let second = self.emit1(c, half(n / 2, n), vec![Some(x)])?;
                let g = self.un(c, UnaryOp::Sigmoid, second)?;
                self.bin(c, BinaryOp::Mul, first, g)?
            }
            ("prelu" | "_prelu_kernel", "default") => {
                // x where x > 0, else weight * x; the weight runs along dim 1
                let x = self.t(c, "self")?;
                let w = self.t(c, "weight")?;
                let r = self.rank(x);
                let n = self.shape(w).iter().product::<usize>();
                let w = if n > 1 && r >= 2 {
                    let mut shape = vec![1; r - 1];
                    shape[0] = n;
                    self.emit1(c, Op::Reshape { shape }, vec![Some(w)])?
                } else {
                    w
                };
                let wx = self.bin(c, BinaryOp::Mul, w, x)?;
                let pos = self.bin_k(c, BinaryOp::Gt, x, 0.0)?;
                self.select3(c, pos, x, wx)?
            }
            ("trunc" | "fix", "default") | ("frac", "default") => {
                // sign(x) * floor(|x|); frac is x minus that
                let x = self.t(c, "self")?;
                let abs = self.un(c, UnaryOp::Abs, x)?;
                let f = self.un(c, UnaryOp::Floor, abs)?;
                let s = self.un(c, UnaryOp::Sign, x)?;
                let t = self.bin(c, BinaryOp::Mul, s, f)?;
                if name == "frac" {
                    self.bin(c, BinaryOp::Sub, x, t)?
                } else {
                    t
                }
            }
            _ => return Ok(None),
        }))
    }

    /// Composites that move or make elements (`flip`, `eye`, `outer`,
    /// `pixel_shuffle`, `histc`, `baddbmm`): the value to bind, or `None`.
    fn structural_composite(
        &mut self,
        c: &Ctx,
        name: &str,
        overload: &str,
    ) -> Result<Option<ValueId>> {
        let a = &c.args;
        Ok(Some(match (name, overload) {
            ("histc", "default") => self.histc(c)?,
            ("eye", "default" | "m") => {
                // (row index == column index), cast to the dtype asked for
                let n = self.size_int(c, "n")?;
                let m = match overload {
                    "m" => self.size_int(c, "m")?,
                    _ => n,
                };
                let dtype = a.scalar_type("dtype")?.unwrap_or(DType::F32);
                let rows = self.iota(c, n, DType::I64)?;
                let rows = self.reshaped(c, rows, vec![n, 1])?;
                let cols = self.iota(c, m, DType::I64)?;
                let cols = self.reshaped(c, cols, vec![1, m])?;
                let diagonal = self.bin(c, BinaryOp::Eq, rows, cols)?;
                if dtype == DType::Bool {
                    diagonal
                } else {
                    self.emit1(c, Op::Cast { dtype }, vec![Some(diagonal)])?
                }
            }
            ("baddbmm", "default") => {
                let x = self.t(c, "self")?;
                let (b1, b2) = (self.t(c, "batch1")?, self.t(c, "batch2")?);
                let m = self.emit1(c, Op::MatMul, vec![Some(b1), Some(b2)])?;
                let (beta, alpha) = (a.float("beta", 1.0)?, a.float("alpha", 1.0)?);
                let m = if alpha == 1.0 {
                    m
                } else {
                    self.bin_k(c, BinaryOp::Mul, m, alpha)?
                };
                if beta == 0.0 {
                    m
                } else {
                    let x = if beta == 1.0 {
                        x
                    } else {
                        self.bin_k(c, BinaryOp::Mul, x, beta)?
                    };
                    self.bin(c, BinaryOp::Add, m, x)?
                }
            }
            ("flip", "default") => {
                let x = self.t(c, "self")?;
                let shape = self.shape(x);
                let mut y = self.emit1(c, Op::Identity, vec![Some(x)])?;
                for d in self.dims(c, "dims", shape.len())? {
                    let n = shape[d];
                    let rev: Vec<i64> = (0..n as i64).rev().collect();
                    let rev = Tensor::from_i64(DType::I64, &[n], &rev)?;
                    let rev = self.add_table(c, "rev", rev);
                    y = self.emit1(c, Op::IndexSelect { dim: d }, vec![Some(y), Some(rev)])?;
                }
                y
            }
            ("outer" | "ger", "default") => {
                let x = self.t(c, "self")?;
                let y = self.t(c, "vec2")?;
                let n = self.shape(x).iter().product();
                let col = self.emit1(c, Op::Reshape { shape: vec![n, 1] }, vec![Some(x)])?;
                self.bin(c, BinaryOp::Mul, col, y)?
            }
            ("mT" | "mH" | "adjoint", "default") => {
                let x = self.t(c, "self")?;
                let r = self.rank(x);
                if r < 2 {
                    return Err(Error::shape(format!("{name} of a {r}-D tensor")));
                }
                let mut dims: Vec<usize> = (0..r).collect();
                dims.swap(r - 2, r - 1);
                self.emit1(c, Op::Permute { dims }, vec![Some(x)])?
            }
            ("pixel_shuffle" | "pixel_unshuffle", "default") => {
                let x = self.t(c, "self")?;
                let shape = self.shape(x);
                let arg = if name == "pixel_shuffle" {
                    "upscale_factor"
                } else {
                    "downscale_factor"
                };
                let f = usize::try_from(a.int(arg, 1)?)
                    .ok()
                    .filter(|&f| f > 0)
                    .ok_or_else(|| Error::format(format!("`{arg}` must be positive")))?;
                let [ref lead @ .., ch, h, w] = shape[..] else {
                    return Err(Error::shape(format!("{name} of {shape:?}")));
                };
                let l = lead.len();
                let (split, dims, out) = if name == "pixel_shuffle" {
                    if ch % (f * f) != 0 {
                        return Err(Error::shape(format!("{name} by {f} of {shape:?}")));
                    }
                    let c2 = ch / (f * f);
                    // [.., c, f, f, h, w] -> [.., c, h, f, w, f]
                    (
                        vec![c2, f, f, h, w],
                        vec![0, 3, 1, 4, 2],
                        vec![c2, h * f, w * f],
                    )
                } else {
                    if h % f != 0 || w % f != 0 {
                        return Err(Error::shape(format!("{name} by {f} of {shape:?}")));
                    }
                    // [.., c, h, f, w, f] -> [.., c, f, f, h, w]
                    (
                        vec![ch, h / f, f, w / f, f],
                        vec![0, 2, 4, 1, 3],
                        vec![ch * f * f, h / f, w / f],
                    )
                };
                let lead_shape = lead.to_vec();
                let s = [lead_shape.clone(), split].concat();
                let v = self.emit1(c, Op::Reshape { shape: s }, vec![Some(x)])?;
                let perm: Vec<usize> = (0..l).chain(dims.iter().map(|d| d + l)).collect();
                let v = self.emit1(c, Op::Permute { dims: perm }, vec![Some(v)])?;
                let o = [lead_shape, out].concat();
                self.emit1(c, Op::Reshape { shape: o }, vec![Some(v)])?
            }
            _ => return Ok(None),
        }))
    }
}
