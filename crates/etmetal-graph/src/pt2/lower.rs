//! Lowering torch.export nodes (`torch.ops.aten.*` targets) to typed [`Op`]
//! nodes, following the conventions on `op.rs`: dims normalised, Python
//! scalars as 0-d constants with PyTorch's promotion dtype, view-like
//! multi-output ops split into one node per output, and unused extra outputs
//! (batch-norm statistics, layer-norm mean/rstd) dropped.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap, HashSet};

use etmetal_core::dtype::{result_type, Operand};
use etmetal_core::shape::{normalize_dim, numel};
use etmetal_core::{
    BinaryOp, ConvAttrs, DType, Error, ErrorKind, Op, ReduceOp, Result, Scalar, SymExpr, Tensor,
    UnaryOp,
};

use super::json::Args;
use crate::infer::infer;
use crate::infer_sym::assign_sym;
use crate::ir::{Graph, Node, ValueId};

mod composite;
mod create;
mod elementwise;
mod fold;
mod hints;
mod index;
mod inplace;
mod layout;
mod linalg;
mod nn;
mod quant;
mod reduce;
mod resize;
mod scatter;
pub(crate) use inplace::functional_target;

/// What a source value name stands for.
enum Bound {
    Value(ValueId),
    /// An extra output that the lowered op does not produce.
    Dropped {
        node: String,
        target: String,
    },
    /// An output of a node that could not be lowered (already reported).
    Failed,
    /// A tensor whose data an in-place write changed in a way etmetal does
    /// not follow (why, in words).
    Stale(String),
}

/// One source node being lowered.
pub(crate) struct Ctx<'j> {
    pub name: String,
    pub target: String,
    pub args: Args<'j>,
    /// Output value names (`None` for `as_none` outputs).
    pub outputs: Vec<Option<String>>,
    emitted: Cell<usize>,
}

impl<'j> Ctx<'j> {
    pub fn new(
        name: String,
        target: String,
        args: Args<'j>,
        outputs: Vec<Option<String>>,
    ) -> Ctx<'j> {
        Ctx {
            name,
            target,
            args,
            outputs,
            emitted: Cell::new(0),
        }
    }
}

pub(crate) struct Lowerer<'m> {
    pub graph: Graph,
    names: HashMap<String, Bound>,
    /// `tensor_values` of the source graph: the shapes the file promises
    /// (dynamic sizes at their upper bounds).
    meta: &'m HashMap<String, (DType, Vec<usize>)>,
    /// The symbolic sizes of the file's dynamic tensors.
    sym_meta: &'m HashMap<String, Vec<SymExpr>>,
    /// Values of the node being lowered whose symbolic sizes inference
    /// could not give (why): the file's must, when the value is bound.
    sym_pending: BTreeMap<ValueId, String>,
    /// Names that some node or graph output reads.
    used: HashSet<String>,
    /// Set when a node read an output of a failed node.
    hit_failed: bool,
    /// Names that alias another's memory (see [`inplace`]).
    views: inplace::Views,
    /// The graph inputs' source names, in signature order.
    placeholders: Vec<String>,
    /// Pairs of graph inputs whose data overlap in one storage without
    /// being one tensor (see [`inplace`]: neither may be written).
    overlaps: Vec<(String, String)>,
    /// Names whose file layout is dense (see [`super::json::is_dense`]).
    dense: HashSet<String>,
    /// Names whose file strides are contiguous.
    contiguous: HashSet<String>,
    /// `dequantize_affine` results awaiting the linear they fuse into.
    dequant: HashMap<String, quant::Dequant>,
    /// `aten.t` of a constant int8 weight, by output name (see
    /// [`quant`]: torchao's `Int8WeightOnlyConfig`).
    int8_t: HashMap<String, ValueId>,
}

/// The dtype of a Python scalar operand next to a tensor of dtype `t`: the
/// dtype PyTorch computes `t op s` in.
fn promoted_scalar_dtype(s: Scalar, t: DType) -> DType {
    result_type(Operand::Tensor(t), Operand::Scalar(s))
}

fn scalar_tensor(s: Scalar, dtype: DType, shape: &[usize]) -> Result<Tensor> {
    let n = numel(shape)?;
    match s {
        Scalar::Int(v) if !dtype.is_float() => Tensor::from_i64(dtype, shape, &vec![v; n]),
        _ => Tensor::from_f64(dtype, shape, &vec![s.to_f64(); n]),
    }
}

fn usizes(v: &[i64], what: &str) -> Result<Vec<usize>> {
    v.iter()
        .map(|&x| {
            usize::try_from(x)
                .map_err(|_| Error::format(format!("{what} has a negative entry: {v:?}")))
        })
        .collect()
}

impl<'m> Lowerer<'m> {
    pub fn new(
        graph: Graph,
        meta: &'m HashMap<String, (DType, Vec<usize>)>,
        sym_meta: &'m HashMap<String, Vec<SymExpr>>,
        used: HashSet<String>,
        dense: HashSet<String>,
        contiguous: HashSet<String>,
    ) -> Lowerer<'m> {
        Lowerer {
            graph,
            names: HashMap::new(),
            meta,
            sym_meta,
            sym_pending: BTreeMap::new(),
            used,
            hit_failed: false,
            views: inplace::Views::new(),
            placeholders: vec![],
            overlaps: vec![],
            dense,
            contiguous,
            dequant: HashMap::new(),
            int8_t: HashMap::new(),
        }
    }

    /// Bind graph input `name` (call in signature order, with `graph.inputs`).
    pub fn bind_input(&mut self, name: &str, id: ValueId) {
        self.names.insert(name.to_string(), Bound::Value(id));
        self.placeholders.push(name.to_string());
    }

    pub fn lookup(&mut self, name: &str) -> Result<ValueId> {
        match self.names.get(name) {
            Some(Bound::Value(v)) => Ok(*v),
            Some(Bound::Dropped { node, target }) => Err(Error::unsupported(format!(
                "value `{name}` is an extra output of node `{node}` ({target}) that etmetal does not compute"
            ))),
            Some(Bound::Failed) => {
                self.hit_failed = true;
                Err(Error::unsupported(format!("value `{name}` comes from an unsupported node")))
            }
            Some(Bound::Stale(why)) => Err(Error::unsupported(format!(
                "value `{name}` is read after {why}"
            ))),
            None => Err(Error::format(format!("value `{name}` is used before it is defined"))),
        }
    }

    /// Lower one node; on an unsupported node, the error says so and its
    /// outputs are marked failed. Returns `Ok(false)` when the node only
    /// failed because an input came from a failed node. `in_place`: `c` is
    /// the functional form of an in-place node (see [`inplace`]).
    pub fn lower(&mut self, c: &Ctx, in_place: bool) -> Result<bool> {
        self.hit_failed = false;
        self.sym_pending.clear();
        let first_value = self.graph.values.len();
        let lowered = self
            .lower_node(c)
            .and_then(|()| self.track_aliases(c, in_place))
            .and_then(|()| self.check_dynamic(c, first_value));
        match lowered {
            Ok(()) => {
                // the source name goes to the last node, which gives the
                // source output; helpers before it are `name.0`, `name.1`…
                let n = c.emitted.get();
                let first = self.graph.nodes.len() - n;
                for (k, node) in self.graph.nodes[first..].iter_mut().enumerate() {
                    node.name = if k + 1 == n {
                        c.name.clone()
                    } else {
                        format!("{}.{k}", c.name)
                    };
                }
                Ok(true)
            }
            Err(e) => {
                for name in c.outputs.iter().flatten() {
                    self.names.insert(name.clone(), Bound::Failed);
                }
                if self.hit_failed {
                    Ok(false)
                } else {
                    Err(e)
                }
            }
        }
    }

    /// What a lowering of a dynamic-shape node may not do, since its
    /// result would hold only at the upper bound: leave a size unknown,
    /// read a SymInt into an op whose int arguments the emitter does not
    /// recompute from sizes, or make a constant from a dynamic shape.
    fn check_dynamic(&self, c: &Ctx, first_value: usize) -> Result<()> {
        if let Some(why) = self.sym_pending.values().next() {
            return Err(Error::unsupported(why.clone()));
        }
        let n = c.emitted.get();
        let nodes = &self.graph.nodes[self.graph.nodes.len() - n..];
        if c.args.read_sym() {
            // the emitter derives these ops' ints from their symbolic sizes
            let derived = |op: &Op| {
                matches!(
                    op,
                    Op::Reshape { .. }
                        | Op::Expand { .. }
                        | Op::Full { .. }
                        | Op::Arange { .. }
                        | Op::Slice { .. }
                        | Op::Select { .. }
                        | Op::Identity
                )
            };
            if let Some(node) = nodes.iter().find(|n| !derived(&n.op)) {
                return Err(Error::unsupported(format!(
                    "a symbolic int argument read by {} (only sizes of view, reshape, expand, \
                     slice, select, arange and full/zeros/ones may be symbolic)",
                    node.op.name()
                )));
            }
        }
        let reads_dynamic = nodes
            .iter()
            .any(|n| n.inputs.iter().flatten().any(|&v| self.graph.is_dynamic(v)));
        let mut made = self.graph.constants.range(ValueId(first_value)..);
        let sized = |(_, t): &(&ValueId, &Tensor)| !t.shape().is_empty();
        if let (true, Some((v, t))) = (reads_dynamic, made.find(sized)) {
            return Err(Error::unsupported(format!(
                "its lowering makes the constant `{}` of shape {:?} for a dynamic shape",
                self.graph.value(*v).name,
                t.shape()
            )));
        }
        Ok(())
    }

    /// Keep the program's own int arguments of the node just lowered (see
    /// [`crate::ir::SymShapes::args`]) when its dim `dim` of `x` is dynamic
    /// or an argument is symbolic.
    fn keep_sym_args(&mut self, x: ValueId, dim: usize, args: Vec<SymExpr>) -> Result<()> {
        let dynamic = self.graph.sym_dims(x)[dim].as_const().is_none()
            || args.iter().any(|a| a.as_const().is_none());
        let out = self.graph.nodes.last().and_then(|n| n.outputs.first());
        if let (true, Some(&out)) = (dynamic, out) {
            self.graph.sym.args.insert(out, args);
        }
        Ok(())
    }

    fn rank(&self, v: ValueId) -> usize {
        self.graph.value(v).shape.len()
    }
    fn shape(&self, v: ValueId) -> Vec<usize> {
        self.graph.value(v).shape.clone()
    }
    fn dtype(&self, v: ValueId) -> DType {
        self.graph.value(v).dtype
    }

    fn t(&mut self, c: &Ctx, arg: &str) -> Result<ValueId> {
        let name = c
            .args
            .tensor_name(arg)?
            .ok_or_else(|| Error::format(format!("missing tensor argument `{arg}`")))?;
        self.lookup(name)
    }
    fn opt_t(&mut self, c: &Ctx, arg: &str) -> Result<Option<ValueId>> {
        c.args.tensor_name(arg)?.map(|n| self.lookup(n)).transpose()
    }
    fn req_ints(&self, c: &Ctx, arg: &str) -> Result<Vec<i64>> {
        c.args
            .ints(arg)?
            .ok_or_else(|| Error::format(format!("missing int list argument `{arg}`")))
    }
    fn req_scalar(&self, c: &Ctx, arg: &str) -> Result<Scalar> {
        c.args
            .scalar(arg)?
            .ok_or_else(|| Error::format(format!("missing scalar argument `{arg}`")))
    }
    fn dim(&self, c: &Ctx, arg: &str, default: i64, rank: usize) -> Result<usize> {
        normalize_dim(c.args.int(arg, default)?, rank)
    }
    /// A dim argument of a tensor that must have that dim (not 0-d), with
    /// the dim's size.
    fn sized_dim(
        &self,
        c: &Ctx,
        arg: &str,
        default: i64,
        shape: &[usize],
    ) -> Result<(usize, usize)> {
        let d = normalize_dim(c.args.int(arg, default)?, shape.len())?;
        let n = shape
            .get(d)
            .copied()
            .ok_or_else(|| Error::shape(format!("`{arg}` of a 0-d tensor")))?;
        Ok((d, n))
    }
    fn dims(&self, c: &Ctx, arg: &str, rank: usize) -> Result<Vec<usize>> {
        let mut dims: Vec<usize> = c
            .args
            .ints(arg)?
            .unwrap_or_default()
            .into_iter()
            .map(|d| normalize_dim(d, rank))
            .collect::<Result<_>>()?;
        dims.sort_unstable();
        dims.dedup();
        Ok(dims)
    }

    /// A constant made while lowering node `c`, named after it; the name
    /// is unique (a node may make several of one kind, and names key the
    /// weights of a compiled program).
    fn add_table(&mut self, c: &Ctx, what: &str, t: Tensor) -> ValueId {
        let name = format!("{}.{what}.{}", c.name, self.graph.values.len());
        self.graph.add_constant(name, t)
    }

    /// A helper node of symbolic output sizes `dims` (`Full`, `Arange`:
    /// ops whose sizes come from attributes, which the emitter recomputes
    /// from these).
    fn emit_sized(&mut self, c: &Ctx, op: Op, dims: Vec<SymExpr>) -> Result<ValueId> {
        let v = self.emit1(c, op, vec![])?;
        if dims.iter().any(|d| d.as_const().is_none()) {
            self.graph.set_sym_dims(v, dims)?;
        }
        Ok(v)
    }

    /// A 0-d int64 tensor holding the SymInt `e` (a scalar operand such as
    /// the sequence length a KV cache's fill counter adds): its lower
    /// bound plus the sum of `e - lower` ones, so it follows the size at
    /// run time.
    fn sym_scalar(&mut self, c: &Ctx, e: SymExpr) -> Result<ValueId> {
        let (lo, hi) = e.bounds(&self.graph.sym.ranges)?;
        let full = Op::Full {
            shape: vec![(hi - lo) as usize],
            value: Scalar::Int(1),
            dtype: DType::I64,
        };
        let ones = self.emit_sized(c, full, vec![e - SymExpr::Const(lo)])?;
        let sum = Op::Reduce {
            op: ReduceOp::Sum,
            dims: vec![0],
            keepdim: false,
        };
        let sum = self.emit1(c, sum, vec![Some(ones)])?;
        if lo == 0 {
            return Ok(sum);
        }
        let lo = self.constant(c, "lower", Scalar::Int(lo), DType::I64)?;
        self.emit1(c, Op::Binary(BinaryOp::Add), vec![Some(sum), Some(lo)])
    }

    /// A 0-d constant for a Python scalar operand.
    fn constant(&mut self, c: &Ctx, what: &str, s: Scalar, dtype: DType) -> Result<ValueId> {
        let t = scalar_tensor(s, dtype, &[])?;
        Ok(self.add_table(c, what, t))
    }

    /// Add a node computing `op`; its outputs get inferred dtypes and shapes.
    fn emit(&mut self, c: &Ctx, op: Op, inputs: Vec<Option<ValueId>>) -> Result<Vec<ValueId>> {
        let k = c.emitted.get();
        c.emitted.set(k + 1);
        let name = format!("{}.{k}", c.name);
        let mut node = Node {
            name,
            target: c.target.clone(),
            op,
            inputs,
            outputs: vec![],
        };
        for (i, (dtype, shape)) in infer(&self.graph, &node)?.into_iter().enumerate() {
            node.outputs.push(
                self.graph
                    .add_value(format!("{}.out{i}", node.name), dtype, shape),
            );
        }
        if let Err(e) = assign_sym(&mut self.graph, &node) {
            // the file's sizes may settle it (see `bind`)
            for &v in &node.outputs {
                self.sym_pending.insert(v, e.message().to_string());
            }
        }
        let outs = node.outputs.clone();
        self.graph.nodes.push(node);
        Ok(outs)
    }

    fn emit1(&mut self, c: &Ctx, op: Op, inputs: Vec<Option<ValueId>>) -> Result<ValueId> {
        Ok(self.emit(c, op, inputs)?[0])
    }

    /// Give source output `index` the value `v`, checking it against the
    /// file's metadata.
    fn bind(&mut self, c: &Ctx, index: usize, v: ValueId) -> Result<()> {
        let Some(Some(name)) = c.outputs.get(index) else {
            return Ok(());
        };
        if let Some((dtype, shape)) = self.meta.get(name) {
            let info = self.graph.value(v);
            if info.dtype != *dtype || info.shape != *shape {
                return Err(Error::shape(format!(
                    "output `{name}`: the file says {dtype} {shape:?}, inference gives {} {:?}",
                    info.dtype, info.shape
                )));
            }
            // the file's symbolic sizes are the truth for its values
            if self.graph.is_dynamic(v) || self.sym_meta.contains_key(name) {
                let dims = match self.sym_meta.get(name) {
                    Some(d) => d.clone(),
                    None => shape.iter().map(|&n| SymExpr::Const(n as i64)).collect(),
                };
                self.graph.set_sym_dims(v, dims)?;
            }
            self.sym_pending.remove(&v);
        }
        self.graph.values[v.0].name = name.clone();
        self.names.insert(name.clone(), Bound::Value(v));
        Ok(())
    }

    /// Emit the single node of a source node and bind its outputs; extra
    /// source outputs are dropped (an error later if something reads them).
    fn finish(&mut self, c: &Ctx, op: Op, inputs: Vec<Option<ValueId>>) -> Result<()> {
        let outs = self.emit(c, op, inputs)?;
        for (i, v) in outs.iter().enumerate() {
            self.bind(c, i, *v)?;
        }
        for name in c.outputs.iter().skip(outs.len()).flatten() {
            self.names.insert(
                name.clone(),
                Bound::Dropped {
                    node: c.name.clone(),
                    target: c.target.clone(),
                },
            );
        }
        Ok(())
    }

    fn is_used(&self, c: &Ctx, index: usize) -> bool {
        matches!(c.outputs.get(index), Some(Some(n)) if self.used.contains(n))
    }

    /// Tensor argument `arg`, or a constant for a scalar given there whose
    /// dtype follows the tensor `other` (see [`promoted_scalar_dtype`]).
    fn operand(&mut self, c: &Ctx, arg: &str, other: Option<ValueId>) -> Result<ValueId> {
        if c.args.is_tensor(arg)? {
            return self.t(c, arg);
        }
        let read_before = c.args.read_sym();
        let symbolic =
            matches!(c.args.get(arg)?, Some(("as_sym_int", v)) if v.get("as_name").is_some());
        if let Some(e) = symbolic.then(|| c.args.sym_int(arg)).transpose()?.flatten() {
            // read here at run time, not at the bound
            c.args.set_read_sym(read_before);
            let v = self.sym_scalar(c, e)?;
            let dtype = match other {
                Some(o) => promoted_scalar_dtype(Scalar::Int(0), self.dtype(o)),
                None => DType::I64,
            };
            return self.cast_to(c, v, dtype);
        }
        let s = self.req_scalar(c, arg)?;
        let dtype = match other {
            Some(o) => promoted_scalar_dtype(s, self.dtype(o)),
            None => s.dtype(),
        };
        self.constant(c, arg, s, dtype)
    }

    /// `a op b` where either may be a scalar; `alpha` scales `b`.
    fn binary(&mut self, c: &Ctx, op: BinaryOp, a_arg: &str, b_arg: &str) -> Result<()> {
        let (a, b) = if c.args.is_tensor(a_arg)? {
            let a = self.t(c, a_arg)?;
            (a, self.operand(c, b_arg, Some(a))?)
        } else {
            let b = self.t(c, b_arg)?;
            (self.operand(c, a_arg, Some(b))?, b)
        };
        let b = match c.args.scalar("alpha")? {
            Some(alpha) if alpha.to_f64() != 1.0 => {
                let k = self.constant(
                    c,
                    "alpha",
                    alpha,
                    promoted_scalar_dtype(alpha, self.dtype(b)),
                )?;
                self.emit1(c, Op::Binary(BinaryOp::Mul), vec![Some(b), Some(k)])?
            }
            _ => b,
        };
        self.finish(c, Op::Binary(op), vec![Some(a), Some(b)])
    }

    fn unary(&mut self, c: &Ctx, arg: &str, op: UnaryOp) -> Result<()> {
        let x = self.t(c, arg)?;
        self.finish(c, Op::Unary(op), vec![Some(x)])
    }

    /// Cast `x` first when a `dtype=` argument asks for it.
    fn with_dtype(&mut self, c: &Ctx, x: ValueId) -> Result<ValueId> {
        match c.args.scalar_type("dtype")? {
            Some(d) if d != self.dtype(x) => self.emit1(c, Op::Cast { dtype: d }, vec![Some(x)]),
            _ => Ok(x),
        }
    }

    fn reshape(&mut self, c: &Ctx, x: ValueId, sizes: &[i64]) -> Result<()> {
        let total = numel(&self.shape(x))?;
        let known: usize = sizes
            .iter()
            .filter(|&&s| s >= 0)
            .map(|&s| s as usize)
            .product();
        let shape = sizes
            .iter()
            .map(|&s| match s {
                -1 if known != 0 && total % known == 0 => Ok(total / known),
                s if s >= 0 => Ok(s as usize),
                _ => Err(Error::shape(format!(
                    "cannot view {:?} as {sizes:?}",
                    self.shape(x)
                ))),
            })
            .collect::<Result<Vec<_>>>()?;
        self.finish(c, Op::Reshape { shape }, vec![Some(x)])
    }

    /// `start..end` of a dim as PyTorch clamps it.
    fn clamp_range(start: Option<i64>, end: Option<i64>, size: usize) -> (usize, usize) {
        let n = size as i64;
        let fix = |v: i64| (if v < 0 { v + n } else { v }).clamp(0, n) as usize;
        let s = fix(start.unwrap_or(0));
        let e = fix(end.unwrap_or(n));
        (s, e.max(s))
    }

    /// Outputs `i` of a split along `dim` into pieces of `sizes`.
    fn split(&mut self, c: &Ctx, x: ValueId, dim: usize, sizes: &[usize]) -> Result<()> {
        let total: usize = sizes.iter().sum();
        if Some(&total) != self.shape(x).get(dim) {
            return Err(Error::shape(format!(
                "split sizes {sizes:?} do not add up to dim {dim} of {:?}",
                self.shape(x)
            )));
        }
        let mut start = 0;
        for (i, &n) in sizes.iter().enumerate() {
            let v = self.emit1(
                c,
                Op::Slice {
                    dim,
                    start,
                    end: start + n,
                    step: 1,
                },
                vec![Some(x)],
            )?;
            self.bind(c, i, v)?;
            start += n;
        }
        Ok(())
    }

    /// `torch.tensor_split`: pieces of `self` along `dim` between split
    /// indices (clamped as slice bounds, so a piece may be empty), or
    /// `sections` pieces whose first `n % sections` are one longer; the
    /// tensor form takes a constant 0-d tensor (sections) or 1-d tensor
    /// (indices). Only the pieces something reads are computed (Mamba's
    /// scan splits off an empty tail it never reads).
    fn tensor_split(&mut self, c: &Ctx, overload: &str) -> Result<()> {
        let x = self.t(c, "self")?;
        let shape = self.shape(x);
        let (dim, n) = self.sized_dim(c, "dim", 0, &shape)?;
        let sections = |k: i64| -> Result<Vec<(usize, usize)>> {
            let k = usize::try_from(k)
                .ok()
                .filter(|&k| k > 0)
                .ok_or_else(|| Error::shape(format!("tensor_split into {k} sections")))?;
            let (piece, extra) = (n / k, n % k);
            let mut start = 0;
            Ok((0..k)
                .map(|i| {
                    let len = piece + usize::from(i < extra);
                    start += len;
                    (start - len, start)
                })
                .collect())
        };
        let indices = |ix: &[i64]| -> Vec<(usize, usize)> {
            let mut bounds = vec![None];
            bounds.extend(ix.iter().map(|&i| Some(i)));
            bounds.push(None);
            bounds
                .windows(2)
                .map(|w| Self::clamp_range(w[0], w[1], n))
                .collect()
        };
        let pieces = match overload {
            "sections" => sections(c.args.int("sections", 1)?)?,
            "indices" => indices(&self.req_ints(c, "indices")?),
            _ => {
                let t = self.t(c, "tensor_indices_or_sections")?;
                let Some(table) = self.known_constant(t) else {
                    return Err(Error::unsupported(
                        "tensor_split by a tensor computed at run time (its values set the \
                         output shapes): pass a list of ints",
                    ));
                };
                let v = table.to_i64_vec();
                match table.shape().len() {
                    0 => sections(v[0])?,
                    1 => indices(&v),
                    r => {
                        return Err(Error::shape(format!(
                            "tensor_split by a {r}-d tensor (0-d sections or 1-d indices expected)"
                        )))
                    }
                }
            }
        };
        if pieces.len() != c.outputs.len() {
            return Err(Error::format(format!(
                "tensor_split into {} pieces, but the node has {} outputs",
                pieces.len(),
                c.outputs.len()
            )));
        }
        // where the dim or an index is symbolic, each piece keeps its bounds
        // for the emitter to evaluate at run time: indices as the program
        // states them (a negative one counts from the run-time end), and
        // sections (whose sizes follow the run-time size) from the pieces'
        // symbolic sizes in the file
        let dynamic_dim = self.graph.sym_dims(x)[dim].as_const().is_none();
        let bounds = match overload {
            "indices" => {
                let ix = c.args.sym_ints("indices")?.unwrap_or_default();
                let mut b = vec![SymExpr::Const(0)];
                b.extend(ix);
                b.push(SymExpr::Const(i64::MAX));
                Some(b)
            }
            _ if dynamic_dim => {
                let mut b = vec![SymExpr::Const(0)];
                for name in &c.outputs {
                    let size = name
                        .as_ref()
                        .and_then(|n| self.sym_meta.get(n))
                        .and_then(|d| d.get(dim))
                        .ok_or_else(|| {
                            Error::unsupported(format!(
                                "tensor_split along dynamic dim {dim}: the file gives no \
                                 symbolic size for each piece"
                            ))
                        })?;
                    let start = b.last().cloned().unwrap_or(SymExpr::Const(0));
                    b.push(start + size.clone());
                }
                Some(b)
            }
            _ => None,
        };
        for (i, (start, end)) in pieces.into_iter().enumerate() {
            if !self.is_used(c, i) {
                continue;
            }
            let op = Op::Slice {
                dim,
                start,
                end,
                step: 1,
            };
            let v = self.emit1(c, op, vec![Some(x)])?;
            if let Some(b) = &bounds {
                self.keep_sym_args(x, dim, vec![b[i].clone(), b[i + 1].clone()])?;
            }
            self.bind(c, i, v)?;
        }
        Ok(())
    }

    /// The data of `v` where it is a constant or an identity of one (a
    /// `torch.tensor(4)` in the module exports as a lifted constant read
    /// through `lift_fresh_copy`).
    fn known_constant(&self, mut v: ValueId) -> Option<&Tensor> {
        loop {
            if let Some(t) = self.graph.constants.get(&v) {
                return Some(t);
            }
            let node = self
                .graph
                .nodes
                .iter()
                .rev()
                .find(|n| n.outputs.contains(&v))?;
            match (&node.op, node.inputs.as_slice()) {
                (Op::Identity, [Some(x)]) => v = *x,
                _ => return None,
            }
        }
    }

    fn conv_attr(&self, c: &Ctx, arg: &str, spatial: usize, default: usize) -> Result<Vec<usize>> {
        let v = usizes(&c.args.ints(arg)?.unwrap_or_default(), arg)?;
        Ok(match v.len() {
            0 => vec![default; spatial],
            1 => vec![v[0]; spatial],
            _ => v,
        })
    }

    fn convolution(&mut self, c: &Ctx, transposed: bool) -> Result<()> {
        let x = self.t(c, "input")?;
        let w = self.t(c, "weight")?;
        let bias = self.opt_t(c, "bias")?;
        let wshape = self.shape(w);
        let spatial = wshape.len().saturating_sub(2);
        let stride = self.conv_attr(c, "stride", spatial, 1)?;
        let dilation = self.conv_attr(c, "dilation", spatial, 1)?;
        let mode = match c.args.get("padding")? {
            Some(("as_string", _)) => c.args.string("padding")?,
            _ => None,
        };
        let padding = match mode {
            Some("valid") => vec![0; spatial],
            Some("same") => (0..spatial)
                .map(|i| {
                    let d = dilation.get(i).copied().unwrap_or(1);
                    let total = d * wshape[2 + i].saturating_sub(1);
                    if !total.is_multiple_of(2) {
                        return Err(Error::unsupported(
                            "padding='same' that needs asymmetric padding",
                        ));
                    }
                    Ok(total / 2)
                })
                .collect::<Result<_>>()?,
            Some(other) => return Err(Error::format(format!("unknown padding mode `{other}`"))),
            None => self.conv_attr(c, "padding", spatial, 0)?,
        };
        let transposed = transposed || c.args.bool("transposed", false)?;
        let output_padding = self.conv_attr(c, "output_padding", spatial, 0)?;
        let groups = usize::try_from(c.args.int("groups", 1)?)
            .map_err(|_| Error::format("negative groups"))?;
        let op = Op::Convolution(ConvAttrs {
            stride,
            padding,
            dilation,
            transposed,
            output_padding,
            groups,
        });
        self.finish(c, op, vec![Some(x), Some(w), bias])
    }

    /// A pool's kernel, stride and padding over `x`, whose dilation is
    /// `dilation` (1 for an average pool).
    fn pool_attrs(
        &self,
        c: &Ctx,
        x: ValueId,
        dilation: Option<&[usize]>,
    ) -> Result<(Vec<usize>, Vec<usize>, Vec<usize>)> {
        let mut kernel = usizes(&self.req_ints(c, "kernel_size")?, "kernel_size")?;
        let n = kernel.len();
        let stride = usizes(&c.args.ints("stride")?.unwrap_or_default(), "stride")?;
        let stride = match stride.len() {
            0 => kernel.clone(),
            1 => vec![stride[0]; n],
            _ => stride,
        };
        let padding = self.conv_attr(c, "padding", n, 0)?;
        // In ceil mode PyTorch takes a kernel longer than the padded input
        // as one window over all of it (transformers' EfficientNet pools
        // with a kernel of its channel count): that kernel, clipped
        let shape = self.shape(x);
        let spatial = &shape[shape.len().saturating_sub(n)..];
        let undilated = dilation.is_none_or(|d| d.iter().all(|&d| d == 1));
        if c.args.bool("ceil_mode", false)? && undilated && spatial.len() == n {
            for i in 0..n {
                let padded = spatial[i] + 2 * padding[i];
                if kernel[i] > padded && kernel[i] - padded < stride[i] {
                    kernel[i] = padded;
                }
            }
        }
        Ok((kernel, stride, padding))
    }

    fn reduce(&mut self, c: &Ctx, op: ReduceOp, dim_arg: &str) -> Result<()> {
        let x = self.t(c, "self")?;
        let x = self.with_dtype(c, x)?;
        let dims = match c.args.get(dim_arg)? {
            Some(("as_int", _)) => vec![self.dim(c, dim_arg, 0, self.rank(x))?],
            _ => self.dims(c, dim_arg, self.rank(x))?,
        };
        let keepdim = c.args.bool("keepdim", false)?;
        self.finish(c, Op::Reduce { op, dims, keepdim }, vec![Some(x)])
    }

    fn variance(&mut self, c: &Ctx, std: bool) -> Result<()> {
        let x = self.t(c, "self")?;
        let dims = self.dims(c, "dim", self.rank(x))?;
        let correction = match c.args.opt_float("correction")? {
            Some(v) => v,
            None => c.args.bool("unbiased", true)? as i64 as f64,
        };
        let keepdim = c.args.bool("keepdim", false)?;
        let op = Op::Var {
            dims,
            correction,
            keepdim,
        };
        if std {
            let v = self.emit1(c, op, vec![Some(x)])?;
            self.finish(c, Op::Unary(UnaryOp::Sqrt), vec![Some(v)])
        } else {
            self.finish(c, op, vec![Some(x)])
        }
    }

    fn full(&mut self, c: &Ctx, shape: Vec<usize>, value: Scalar, default: DType) -> Result<()> {
        let dtype = c.args.scalar_type("dtype")?.unwrap_or(default);
        self.finish(
            c,
            Op::Full {
                shape,
                value,
                dtype,
            },
            vec![],
        )
    }

    fn size_arg(&self, c: &Ctx, arg: &str) -> Result<Vec<usize>> {
        usizes(&self.req_ints(c, arg)?, arg)
    }

    fn lower_node(&mut self, c: &Ctx) -> Result<()> {
        if let Some(lowered) = self.lower_quant(c) {
            return lowered;
        }
        let unknown = || {
            Error::unsupported(match hints::hint(&c.target) {
                Some(h) => format!("no etmetal lowering for this target; {h}"),
                None => "no etmetal lowering for this target".to_string(),
            })
        };
        if c.target == "torch.ops.transformers.grouped_mm_fallback.default" {
            return self.grouped_mm(c, "input", "weight", "offs");
        }
        let Some(short) = c.target.strip_prefix("torch.ops.aten.") else {
            return Err(unknown());
        };
        let (name, overload) = short.split_once('.').unwrap_or((short, "default"));
        // each family lowers the ATen ops it knows; no two take the same one
        let lowered = self.lower_elementwise(c, name, overload)?
            || self.lower_reduction(c, name, overload)?
            || self.lower_linalg(c, name, overload)?
            || self.lower_nn(c, name, overload)?
            || self.lower_view(c, name, overload)?
            || self.lower_layout(c, name, overload)?
            || self.lower_indexing(c, name, overload)?
            || self.lower_creation(c, name, overload)?
            || self.composite(c, name, overload)?
            || self.upsample(c, name, overload)?
            || (overload == "default" && self.fold(c, name)?);
        if lowered {
            Ok(())
        } else {
            Err(unknown())
        }
    }

    /// `v` as `dtype` (no node when it already is).
    fn cast_to(&mut self, c: &Ctx, v: ValueId, dtype: DType) -> Result<ValueId> {
        if self.dtype(v) == dtype {
            return Ok(v);
        }
        self.emit1(c, Op::Cast { dtype }, vec![Some(v)])
    }

    /// `v` broadcast to `shape` and cast to `dtype`.
    fn broadcast_to(
        &mut self,
        c: &Ctx,
        v: ValueId,
        shape: &[usize],
        dtype: DType,
    ) -> Result<ValueId> {
        let v = self.cast_to(c, v, dtype)?;
        if self.shape(v) == shape {
            return Ok(v);
        }
        let shape = shape.to_vec();
        self.emit1(c, Op::Expand { shape }, vec![Some(v)])
    }

    /// `x` with positions `start..end` (every `step`th) of dim `dim` taken
    /// from the rows of `src` (`slice_scatter`): the source row of each
    /// position gathered, `where` the slice covers it.
    fn slice_scatter(
        &mut self,
        c: &Ctx,
        x: ValueId,
        src: ValueId,
        dim: usize,
        (start, end, step): (usize, usize, usize),
    ) -> Result<ValueId> {
        let shape = self.shape(x);
        let n = shape[dim];
        let hit: Vec<bool> = (0..n)
            .map(|j| j >= start && j < end && (j - start) % step == 0)
            .collect();
        if !hit.contains(&true) {
            return self.emit1(c, Op::Identity, vec![Some(x)]);
        }
        // position j of the dim takes source row (j - start) / step; row 0
        // (a valid index, masked off) where the slice does not cover it
        let rows: Vec<i64> = (0..n)
            .map(|j| {
                if hit[j] {
                    ((j - start) / step) as i64
                } else {
                    0
                }
            })
            .collect();
        let hit: Vec<i64> = hit.into_iter().map(i64::from).collect();
        let rows = Tensor::from_i64(DType::I64, &[n], &rows)?;
        let rows = self.add_table(c, "rows", rows);
        let mut mask_shape = vec![1; shape.len()];
        mask_shape[dim] = n;
        let mask = Tensor::from_i64(DType::Bool, &mask_shape, &hit)?;
        let mask = self.add_table(c, "mask", mask);
        let src = self.cast_to(c, src, self.dtype(x))?;
        let placed = self.emit1(c, Op::IndexSelect { dim }, vec![Some(src), Some(rows)])?;
        self.emit1(c, Op::Where, vec![Some(mask), Some(placed), Some(x)])
    }

    /// `x` with position `index` of dim `dim` replaced by `src`, which lacks
    /// that dim (`select_scatter`).
    fn select_scatter(
        &mut self,
        c: &Ctx,
        x: ValueId,
        src: ValueId,
        dim: usize,
        index: usize,
    ) -> Result<ValueId> {
        let mut one = self.shape(x);
        one[dim] = 1;
        let mut dropped = one.clone();
        dropped.remove(dim);
        let src = self.broadcast_to(c, src, &dropped, self.dtype(x))?;
        let src = self.emit1(c, Op::Reshape { shape: one }, vec![Some(src)])?;
        self.slice_scatter(c, x, src, dim, (index, index + 1, 1))
    }

    /// `x` with row `index[m]` of dim `dim` replaced by row `m` of `rows`
    /// (`index_copy`): one [`Op::IndexCopy`], which a backend writes in
    /// place (`to_portable` decomposes it for the portable kernels).
    fn scatter_rows(
        &mut self,
        c: &Ctx,
        x: ValueId,
        dim: usize,
        index: ValueId,
        rows: ValueId,
    ) -> Result<()> {
        let shape = self.shape(x);
        let k = self.shape(index).first().copied().unwrap_or(1);
        if self.rank(index) > 1 || self.shape(rows).get(dim) != Some(&k) {
            return Err(Error::shape(format!(
                "index {:?} and source {:?} for dim {dim} of {shape:?}",
                self.shape(index),
                self.shape(rows)
            )));
        }
        if self.graph.sym_dims(x)[dim].as_const().is_none() {
            return Err(Error::unsupported(format!(
                "index_copy into dim {dim} of dynamic size"
            )));
        }
        let rows = self.cast_to(c, rows, self.dtype(x))?;
        self.finish(
            c,
            Op::IndexCopy { dim },
            vec![Some(x), Some(index), Some(rows)],
        )
    }

    fn unary_identity(&mut self, c: &Ctx, arg: &str) -> Result<()> {
        let x = self.t(c, arg)?;
        self.finish(c, Op::Identity, vec![Some(x)])
    }

    fn tensor_list(&mut self, c: &Ctx, arg: &str) -> Result<Vec<ValueId>> {
        let names = c.args.tensor_names(arg)?;
        names
            .into_iter()
            .map(|n| {
                n.ok_or_else(|| Error::format(format!("`{arg}` holds a None")))
                    .and_then(|n| self.lookup(n))
            })
            .collect()
    }
}

/// Whether an error means "etmetal cannot lower this" (collected and
/// reported together) rather than "the file is wrong" (reported at once).
pub(crate) fn is_unsupported(e: &Error) -> bool {
    e.kind() == ErrorKind::Unsupported
}
