//! Linear-algebra lowerings: `einsum` as permutes, reshapes, sums and
//! batched matmuls; vector norms and weight normalisation as reductions.

use std::collections::HashMap;

use etmetal_core::shape::normalize_dim;
use etmetal_core::{BinaryOp, Error, Op, ReduceOp, Result, Scalar, UnaryOp};

use super::{Ctx, Lowerer};
use crate::ir::ValueId;

/// Labels of the dims an ellipsis stands for: private-use characters, so
/// they never clash with an equation's letters. `k` counts from the
/// leftmost of the widest ellipsis.
fn ellipsis_label(k: usize) -> char {
    char::from_u32(0xE000 + k as u32).expect("a private-use character")
}

/// An einsum equation, ellipses expanded to labels (see [`ellipsis_label`]).
struct Equation {
    inputs: Vec<Vec<char>>,
    output: Vec<char>,
}

fn parse_einsum(equation: &str, ranks: &[usize]) -> Result<Equation> {
    let eq: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
    let bad = |why: &str| Error::format(format!("einsum equation `{equation}`: {why}"));
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => (l, Some(r)),
        None => (eq.as_str(), None),
    };
    let terms: Vec<&str> = lhs.split(',').collect();
    if terms.len() != ranks.len() {
        return Err(bad(&format!(
            "{} terms for {} operands",
            terms.len(),
            ranks.len()
        )));
    }
    // (letters before the ellipsis, whether there is one, letters after)
    let split = |t: &str| -> Result<(Vec<char>, bool, Vec<char>)> {
        let (pre, post, ell) = match t.split_once("...") {
            Some((a, b)) => (a, b, true),
            None => (t, "", false),
        };
        let letters = |s: &str| -> Result<Vec<char>> {
            s.chars()
                .map(|c| {
                    if c.is_ascii_alphabetic() {
                        Ok(c)
                    } else {
                        Err(bad(&format!("`{c}` is not a letter")))
                    }
                })
                .collect()
        };
        Ok((letters(pre)?, ell, letters(post)?))
    };
    let mut parsed = vec![];
    let mut widest = 0;
    for (t, &rank) in terms.iter().zip(ranks) {
        let (pre, ell, post) = split(t)?;
        let named = pre.len() + post.len();
        let e = if ell {
            rank.checked_sub(named)
                .ok_or_else(|| bad(&format!("`{t}` names more dims than rank {rank}")))?
        } else if named != rank {
            return Err(bad(&format!("`{t}` for an operand of rank {rank}")));
        } else {
            0
        };
        widest = widest.max(e);
        parsed.push((pre, e, post));
    }
    // operands with fewer ellipsis dims broadcast from the right
    let expand = |pre: &[char], e: usize, post: &[char]| -> Vec<char> {
        let mut v = pre.to_vec();
        v.extend((widest - e..widest).map(ellipsis_label));
        v.extend_from_slice(post);
        v
    };
    let inputs: Vec<Vec<char>> = parsed.iter().map(|(a, e, b)| expand(a, *e, b)).collect();
    let output = match rhs {
        Some(r) => {
            let (pre, ell, post) = split(r)?;
            expand(&pre, if ell { widest } else { 0 }, &post)
        }
        None => {
            // implicit: ellipsis dims, then letters used once, alphabetically
            let mut count: HashMap<char, usize> = HashMap::new();
            for c in inputs.iter().flatten().filter(|c| c.is_ascii()) {
                *count.entry(*c).or_default() += 1;
            }
            let mut once: Vec<char> = count
                .into_iter()
                .filter(|&(_, n)| n == 1)
                .map(|(c, _)| c)
                .collect();
            once.sort_unstable();
            let mut out: Vec<char> = (0..widest).map(ellipsis_label).collect();
            out.extend(once);
            out
        }
    };
    for (i, c) in output.iter().enumerate() {
        if output[..i].contains(c) {
            return Err(bad(&format!("output label `{c}` repeats")));
        }
        if !inputs.iter().flatten().any(|x| x == c) {
            return Err(bad(&format!("output label `{c}` is in no operand")));
        }
    }
    Ok(Equation { inputs, output })
}

impl Lowerer<'_> {
    pub(super) fn reshaped(&mut self, c: &Ctx, x: ValueId, shape: Vec<usize>) -> Result<ValueId> {
        if self.shape(x) == shape {
            return Ok(x);
        }
        self.emit1(c, Op::Reshape { shape }, vec![Some(x)])
    }

    fn permuted(&mut self, c: &Ctx, x: ValueId, dims: Vec<usize>) -> Result<ValueId> {
        if dims.iter().enumerate().all(|(i, &d)| i == d) {
            return Ok(x);
        }
        self.emit1(c, Op::Permute { dims }, vec![Some(x)])
    }

    fn summed(&mut self, c: &Ctx, x: ValueId, dims: Vec<usize>) -> Result<ValueId> {
        if dims.is_empty() {
            return Ok(x);
        }
        let op = Op::Reduce {
            op: ReduceOp::Sum,
            dims,
            keepdim: false,
        };
        self.emit1(c, op, vec![Some(x)])
    }

    /// `x` (labelled `labels`) with its dims ordered as `order`, a
    /// permutation of `labels`.
    fn ordered(&mut self, c: &Ctx, x: ValueId, labels: &[char], order: &[char]) -> Result<ValueId> {
        let dims = order
            .iter()
            .map(|l| labels.iter().position(|m| m == l).expect("label of x"))
            .collect();
        self.permuted(c, x, dims)
    }

    /// `einsum(equation, tensors)`: repeated labels of one operand become
    /// diagonals (a strided slice of the two dims merged), labels no one
    /// else needs are summed, then operands are contracted left to right as
    /// batched matmuls `[batch, left, k] @ [batch, k, right]`.
    pub(super) fn einsum(&mut self, c: &Ctx) -> Result<()> {
        let equation = c
            .args
            .string("equation")?
            .ok_or_else(|| Error::format("einsum without an equation"))?;
        let xs = self.tensor_list(c, "tensors")?;
        let ranks: Vec<usize> = xs.iter().map(|&x| self.rank(x)).collect();
        let eq = parse_einsum(equation, &ranks)?;
        let mut sizes: HashMap<char, usize> = HashMap::new();
        for (labels, &x) in eq.inputs.iter().zip(&xs) {
            for (l, &n) in labels.iter().zip(&self.shape(x)) {
                let s = sizes.entry(*l).or_insert(n);
                if *s != n && *s != 1 && n != 1 {
                    return Err(Error::shape(format!(
                        "einsum `{equation}`: label `{l}` is {s} and {n}"
                    )));
                }
                *s = (*s).max(n);
            }
        }
        let mut operands = vec![];
        for (i, (labels, &x)) in eq.inputs.iter().zip(&xs).enumerate() {
            let (mut v, mut labels) = self.diagonals(c, x, labels.clone())?;
            // labels in no other operand and not in the output are summed now
            let elsewhere = |l: &char| {
                eq.output.contains(l)
                    || eq
                        .inputs
                        .iter()
                        .enumerate()
                        .any(|(j, o)| j != i && o.contains(l))
            };
            let gone: Vec<usize> = (0..labels.len())
                .filter(|&d| !elsewhere(&labels[d]))
                .collect();
            v = self.summed(c, v, gone.clone())?;
            labels = labels
                .into_iter()
                .enumerate()
                .filter(|(d, _)| !gone.contains(d))
                .map(|(_, l)| l)
                .collect();
            operands.push((v, labels));
        }
        let mut rest = operands.into_iter();
        let (mut acc, mut acc_labels) = rest
            .next()
            .ok_or_else(|| Error::format("einsum of no tensors"))?;
        let rest: Vec<_> = rest.collect();
        for (k, (b, b_labels)) in rest.iter().enumerate() {
            let later = |l: &char| {
                eq.output.contains(l) || rest[k + 1..].iter().any(|(_, o)| o.contains(l))
            };
            let shared: Vec<char> = acc_labels
                .iter()
                .filter(|l| b_labels.contains(l))
                .copied()
                .collect();
            let batch: Vec<char> = shared.iter().filter(|l| later(l)).copied().collect();
            let contract: Vec<char> = shared.iter().filter(|l| !later(l)).copied().collect();
            let left: Vec<char> = acc_labels
                .iter()
                .filter(|l| !shared.contains(l))
                .copied()
                .collect();
            let right: Vec<char> = b_labels
                .iter()
                .filter(|l| !shared.contains(l))
                .copied()
                .collect();
            let size = |ls: &[char]| ls.iter().map(|l| sizes[l]).product::<usize>();
            let a_order: Vec<char> = [&batch[..], &left, &contract].concat();
            let b_order: Vec<char> = [&batch[..], &contract, &right].concat();
            let a = self.ordered(c, acc, &acc_labels, &a_order)?;
            let a = self.broadcast_labels(c, a, &a_order, &sizes)?;
            let a = self.reshaped(c, a, vec![size(&batch), size(&left), size(&contract)])?;
            let bb = self.ordered(c, *b, b_labels, &b_order)?;
            let bb = self.broadcast_labels(c, bb, &b_order, &sizes)?;
            let bb = self.reshaped(c, bb, vec![size(&batch), size(&contract), size(&right)])?;
            let m = self.emit1(c, Op::MatMul, vec![Some(a), Some(bb)])?;
            acc_labels = [&batch[..], &left, &right].concat();
            let shape = acc_labels.iter().map(|l| sizes[l]).collect();
            acc = self.reshaped(c, m, shape)?;
        }
        let gone: Vec<usize> = (0..acc_labels.len())
            .filter(|&d| !eq.output.contains(&acc_labels[d]))
            .collect();
        acc = self.summed(c, acc, gone.clone())?;
        acc_labels = acc_labels
            .into_iter()
            .enumerate()
            .filter(|(d, _)| !gone.contains(d))
            .map(|(_, l)| l)
            .collect();
        let v = self.ordered(c, acc, &acc_labels, &eq.output)?;
        let v = self.broadcast_labels(c, v, &eq.output, &sizes)?;
        self.bind_or_copy(c, xs[0], v)
    }

    /// `x` with size-1 dims expanded to their label's size.
    fn broadcast_labels(
        &mut self,
        c: &Ctx,
        x: ValueId,
        labels: &[char],
        sizes: &HashMap<char, usize>,
    ) -> Result<ValueId> {
        let shape: Vec<usize> = labels.iter().map(|l| sizes[l]).collect();
        if self.shape(x) == shape {
            return Ok(x);
        }
        self.emit1(c, Op::Expand { shape }, vec![Some(x)])
    }

    /// `x` with each label that repeats replaced by one dim, the diagonal:
    /// the two dims moved last, merged, and every `n + 1`th element taken.
    fn diagonals(
        &mut self,
        c: &Ctx,
        mut x: ValueId,
        mut labels: Vec<char>,
    ) -> Result<(ValueId, Vec<char>)> {
        while let Some(j) = (1..labels.len()).find(|&j| labels[..j].contains(&labels[j])) {
            let i = labels
                .iter()
                .position(|l| *l == labels[j])
                .expect("earlier label");
            let shape = self.shape(x);
            let n = shape[i];
            if shape[j] != n {
                return Err(Error::shape(format!(
                    "einsum label `{}` repeats with sizes {n} and {}",
                    labels[i], shape[j]
                )));
            }
            let mut dims: Vec<usize> = (0..labels.len()).filter(|&d| d != i && d != j).collect();
            dims.extend([i, j]);
            let l = labels[i];
            labels = dims[..dims.len() - 2].iter().map(|&d| labels[d]).collect();
            labels.push(l);
            let p = self.permuted(c, x, dims.clone())?;
            let mut merged: Vec<usize> = dims[..dims.len() - 2].iter().map(|&d| shape[d]).collect();
            merged.push(n * n);
            let flat = self.reshaped(c, p, merged.clone())?;
            let op = Op::Slice {
                dim: merged.len() - 1,
                start: 0,
                end: n * n,
                step: n + 1,
            };
            x = self.emit1(c, op, vec![Some(flat)])?;
        }
        Ok((x, labels))
    }

    /// `linalg_vector_norm(x, ord, dim, keepdim, dtype)` (and `norm`, whose
    /// order is `p`): `sqrt(sum(x²))`, `sum|x|`, `max|x|`, `min|x|`, the
    /// count of non-zeros, or `(sum|x|^p)^(1/p)`.
    pub(super) fn vector_norm(&mut self, c: &Ctx, ord_arg: &str) -> Result<()> {
        let x = self.t(c, "self")?;
        let x = self.with_dtype(c, x)?;
        if !self.dtype(x).is_float() {
            return Err(Error::unsupported(format!(
                "vector norm of a {} tensor (PyTorch takes floating point)",
                self.dtype(x)
            )));
        }
        let ord = c.args.scalar(ord_arg)?.map_or(2.0, Scalar::to_f64);
        let dims = match c.args.get("dim")? {
            Some(("as_int", _)) => vec![self.dim(c, "dim", 0, self.rank(x))?],
            _ => self.dims(c, "dim", self.rank(x))?,
        };
        let keepdim = c.args.bool("keepdim", false)?;
        let reduce = |op| Op::Reduce {
            op,
            dims: dims.clone(),
            keepdim,
        };
        let abs = self.emit1(c, Op::Unary(UnaryOp::Abs), vec![Some(x)])?;
        if ord.is_infinite() {
            let op = if ord > 0.0 {
                ReduceOp::Max
            } else {
                ReduceOp::Min
            };
            return self.finish(c, reduce(op), vec![Some(abs)]);
        }
        if ord == 0.0 {
            let zero = self.constant(c, "zero", Scalar::Int(0), self.dtype(x))?;
            let nz = self.emit1(c, Op::Binary(BinaryOp::Ne), vec![Some(x), Some(zero)])?;
            let nz = self.cast_to(c, nz, self.dtype(x))?;
            return self.finish(c, reduce(ReduceOp::Sum), vec![Some(nz)]);
        }
        if ord == 1.0 {
            return self.finish(c, reduce(ReduceOp::Sum), vec![Some(abs)]);
        }
        let pow = |p: f64| Op::Unary(UnaryOp::PowScalar { exponent: p });
        let powered = if ord == 2.0 {
            self.emit1(c, Op::Binary(BinaryOp::Mul), vec![Some(x), Some(x)])?
        } else {
            self.emit1(c, pow(ord), vec![Some(abs)])?
        };
        let s = self.emit1(c, reduce(ReduceOp::Sum), vec![Some(powered)])?;
        let root = if ord == 2.0 {
            Op::Unary(UnaryOp::Sqrt)
        } else {
            pow(1.0 / ord)
        };
        self.finish(c, root, vec![Some(s)])
    }

    /// `_weight_norm(v, g, dim)` / `_weight_norm_interface`: `v * (g / n)`
    /// with `n` the 2-norm of `v` over every dim but `dim` (over all of `v`
    /// when `dim` is -1); the interface's second output is `n`.
    pub(super) fn weight_norm(&mut self, c: &Ctx) -> Result<()> {
        let v = self.t(c, "v")?;
        let g = self.t(c, "g")?;
        let r = self.rank(v);
        let dim = c.args.int("dim", 0)?;
        let dims: Vec<usize> = if dim == -1 {
            (0..r).collect()
        } else {
            let d = normalize_dim(dim, r)?;
            (0..r).filter(|&k| k != d).collect()
        };
        let sq = self.emit1(c, Op::Binary(BinaryOp::Mul), vec![Some(v), Some(v)])?;
        let sum = Op::Reduce {
            op: ReduceOp::Sum,
            dims,
            keepdim: true,
        };
        let s = self.emit1(c, sum, vec![Some(sq)])?;
        let n = self.emit1(c, Op::Unary(UnaryOp::Sqrt), vec![Some(s)])?;
        let scale = self.emit1(c, Op::Binary(BinaryOp::Div), vec![Some(g), Some(n)])?;
        let w = self.emit1(c, Op::Binary(BinaryOp::Mul), vec![Some(v), Some(scale)])?;
        if self.is_used(c, 1) {
            self.bind(c, 1, n)?;
        }
        self.bind(c, 0, w)
    }
}

impl Lowerer<'_> {
    /// Lower `c` (ATen op `name`, overload `overload`) if it is a matrix product (grouped too), `einsum` or a vector norm;
    /// `false` when it is not.
    pub(super) fn lower_linalg(&mut self, c: &Ctx, name: &str, overload: &str) -> Result<bool> {
        let a = &c.args;
        let lowered = match (name, overload) {
            ("einsum", "default") => self.einsum(c),
            ("linalg_vector_norm", "default") => self.vector_norm(c, "ord"),
            ("norm", "Scalar" | "ScalarOpt_dim" | "ScalarOpt_dim_dtype" | "ScalarOpt_dtype") => {
                self.vector_norm(c, "p")
            }
            ("_weight_norm" | "_weight_norm_interface", "default") => self.weight_norm(c),
            ("matmul", "default") => {
                let (x, y) = (self.t(c, "self")?, self.t(c, "other")?);
                self.finish(c, Op::MatMul, vec![Some(x), Some(y)])
            }
            ("mm" | "bmm", "default") => {
                let (x, y) = (self.t(c, "self")?, self.t(c, "mat2")?);
                let want = if name == "mm" { 2 } else { 3 };
                if self.rank(x) != want || self.rank(y) != want {
                    return Err(Error::shape(format!("{name} needs {want}-D operands")));
                }
                self.finish(c, Op::MatMul, vec![Some(x), Some(y)])
            }
            ("addmm", "default") => {
                let bias = self.t(c, "self")?;
                let (x, y) = (self.t(c, "mat1")?, self.t(c, "mat2")?);
                let op = Op::Addmm {
                    beta: a.float("beta", 1.0)?,
                    alpha: a.float("alpha", 1.0)?,
                };
                self.finish(c, op, vec![Some(bias), Some(x), Some(y)])
            }
            ("linear", "default") => {
                let (x, w, b) = (
                    self.t(c, "input")?,
                    self.t(c, "weight")?,
                    self.opt_t(c, "bias")?,
                );
                self.finish(c, Op::Linear, vec![Some(x), Some(w), b])
            }
            ("_grouped_mm", "default") => {
                if let Some(d) = a.scalar_type("out_dtype")? {
                    let x = self.t(c, "self")?;
                    if d != self.dtype(x) {
                        return Err(Error::unsupported(format!(
                            "_grouped_mm to out_dtype {d:?}"
                        )));
                    }
                }
                if a.tensor_name("bias")?.is_some() {
                    return Err(Error::unsupported("_grouped_mm with a bias"));
                }
                self.grouped_mm(c, "self", "mat2", "offs")
            }
            _ => return Ok(false),
        };
        lowered.map(|()| true)
    }
}
