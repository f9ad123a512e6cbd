//! A gated MLP's two products of one input, `act(x·Wg) * (x·Wu)` (Llama's,
//! Qwen's and Mistral's SiLU gate, Gemma's GELU gate), as one
//! matrix-vector dispatch that stores only the gated value: a workgroup
//! computes column `c` of both products, so its store has both sums and
//! writes `act(g) * u` once. The down product then reads a plain vector,
//! where it would otherwise evaluate the gate and the multiply in every one
//! of its workgroups (staging them in workgroup memory), and the gate and
//! up outputs make no round trip through memory.
//!
//! Two forms reach it: float linears, which stay two products sharing an
//! input ([`Gated::of_siblings`], lowered by [`Gemv::lower_pair`]), and
//! quantized ones, which the graph merged into one product of both
//! weights whose halves are sliced ([`Gated::of_halves`], lowered by the
//! quantized kernel, `int4.rs`).
//!
//! The products' own outputs are never written: the store evaluates the
//! pointwise nodes with their loads replaced by the sums, rounded to the
//! products' dtype as PyTorch stores them ([`GatedStore`]).

use etmetal_core::{BinaryOp, DType, Error, Op, Result};
use etmetal_graph::{Node, ValueId};

use super::gemm::{Epilogue, Gemv, GemvArgs, GEMV_ROWS};
use super::matmul::{add_reads, chunk_reader, product, MatmulArgs};
use crate::preprocess::buffers::BufferIdx;
use crate::preprocess::emit::{linear, unravel, KernelBuilder};
use crate::preprocess::expr::LazyRef;
use crate::preprocess::lowering::Lowering;

/// The nodes after a product that make its output one of a gated pair.
pub(super) struct Gated<'g> {
    /// The nodes the dispatch takes before the chains: the sibling product
    /// (float), or the two slices of the merged output (quantized, the
    /// first half's first).
    parts: Vec<(usize, &'g Node)>,
    /// The unary ops from either value to the multiply (each the sole
    /// reader of the value before it), in order.
    chains: Vec<usize>,
    /// The multiply, whose output the dispatch stores.
    mul: (usize, &'g Node),
}

/// The unary ops after `v` of its shape and dtype, each the sole reader of
/// the one before, and the last value.
fn unary_chain(lw: &Lowering, v: ValueId) -> (Vec<usize>, ValueId) {
    let info = lw.graph.value(v);
    let (mut nodes, mut end) = (vec![], v);
    while let Some((n, next)) = lw.sole_reader(end) {
        let Some(&y) = next.outputs.first() else {
            break;
        };
        let out = lw.graph.value(y);
        if !matches!(next.op, Op::Unary(_))
            || next.outputs.len() != 1
            || out.dtype != info.dtype
            || out.shape != info.shape
        {
            break;
        }
        nodes.push(n);
        end = y;
    }
    (nodes, end)
}

/// The multiply where unary chains from `gate` and from `up` (float values
/// of one shape and dtype) meet as its two inputs, its output of that shape
/// and dtype, and the chains' nodes.
fn meet<'g>(
    lw: &Lowering<'g>,
    gate: ValueId,
    up: ValueId,
) -> Option<(Vec<usize>, (usize, &'g Node))> {
    let info = lw.graph.value(gate);
    let same = |v: ValueId| {
        let other = lw.graph.value(v);
        other.dtype == info.dtype && other.shape == info.shape
    };
    if gate == up || !info.dtype.is_float() || !same(up) {
        return None;
    }
    let (mut chains, a) = unary_chain(lw, gate);
    let (more, b) = unary_chain(lw, up);
    let (m, mul) = lw.sole_reader(a)?;
    let inputs = mul.inputs.as_slice();
    let pair = inputs == [Some(a), Some(b)] || inputs == [Some(b), Some(a)];
    if mul.op != Op::Binary(BinaryOp::Mul) || !pair || mul.outputs.len() != 1 {
        return None;
    }
    if !same(mul.outputs[0]) || lw.sole_reader(b)?.0 != m {
        return None;
    }
    chains.extend(more);
    Some((chains, (m, mul)))
}

impl<'g> Gated<'g> {
    /// The gated pair float linear `gate` begins, where there is one: a
    /// later linear of the same input, both of at most [`GEMV_ROWS`] rows
    /// with constant weights of one shape and dtype, each output read by a
    /// chain of unary ops into one multiply ([`meet`]); and the dispatch's
    /// bindings hold all of it.
    pub(super) fn of_siblings(lw: &Lowering<'g>, gate: &Node) -> Option<Gated<'g>> {
        if gate.op != Op::Linear || gate.outputs.len() != 1 {
            return None;
        }
        let x = lw.input(gate, 0).ok()?;
        let k = *x.shape.last()?;
        if x.shape.len() < 2 || x.shape.iter().product::<usize>() / k.max(1) > GEMV_ROWS {
            return None;
        }
        let operands = |node: &Node| -> Option<Vec<(DType, Vec<usize>)>> {
            let ready = |v: ValueId| lw.value(v).ok().filter(|w| w.is_view());
            let w = ready(node.inputs.get(1).copied().flatten()?)?;
            let mut found = vec![(w.dtype, w.shape.clone())];
            if let Some(b) = node.inputs.get(2).copied().flatten() {
                found.push((ready(b)?.dtype, vec![]));
            }
            (w.shape.len() == 2 && w.shape[1] == k).then_some(found)
        };
        let theirs = operands(gate)?;
        let (chains, mul, up) = lw.nodes_after(gate).into_iter().find_map(|(u, up)| {
            let sibling = up.op == Op::Linear
                && up.inputs.first() == gate.inputs.first()
                && up.outputs.len() == 1
                && operands(up)?.first() == theirs.first();
            let (chains, mul) = sibling.then(|| meet(lw, gate.outputs[0], up.outputs[0]))??;
            Some((chains, mul, (u, up)))
        })?;
        // the input's and the operands' buffers, the output and a status
        let mut bufs = vec![];
        add_reads(lw, &x, &mut bufs);
        for node in [gate, up.1] {
            for v in node.inputs[1..].iter().flatten() {
                add_reads(lw, &lw.value(*v).ok()?, &mut bufs);
            }
        }
        if bufs.len() + 1 + usize::from(x.has_checks()) > lw.options.max_bindings {
            return None;
        }
        Some(Gated {
            parts: vec![up],
            chains,
            mul,
        })
    }

    /// The gated pair of quantized product `node`'s two halves `[0, n/2)`
    /// and `[n/2, n)` along its output's last dim (the output's only
    /// readers, slices), where unary chains from them meet in one multiply
    /// ([`meet`]).
    pub(super) fn of_halves(lw: &Lowering<'g>, node: &Node) -> Option<Gated<'g>> {
        let y = *node.outputs.first()?;
        let shape = &lw.graph.value(y).shape;
        let (last, n) = (shape.len().checked_sub(1)?, *shape.last()?);
        if n % 2 != 0 || lw.readers(y) != 2 {
            return None;
        }
        let later = lw.nodes_after(node);
        let half = |start: usize| {
            let slice = Op::Slice {
                dim: last,
                start,
                end: start + n / 2,
                step: 1,
            };
            later.iter().copied().find(|(_, s)| {
                s.inputs.as_slice() == [Some(y)] && s.op == slice && s.outputs.len() == 1
            })
        };
        let parts = vec![half(0)?, half(n / 2)?];
        let (chains, mul) = meet(lw, parts[0].1.outputs[0], parts[1].1.outputs[0])?;
        Some(Gated { parts, chains, mul })
    }

    /// Lower float linear `gate` (the node [`Gated::of_siblings`] was given),
    /// its sibling and the nodes up to the multiply as one dispatch.
    pub(super) fn lower_siblings(self, lw: &mut Lowering, gate: &Node) -> Result<()> {
        let up = self.parts[0];
        lw.absorb(up.0, &[]);
        // (each product's value a load of its own buffer, which the store
        // substitutes: no kernel binds it)
        let (first, k) = product(lw, gate, String::new(), &[], false)?;
        let (second, _) = product(lw, up.1, "_1".into(), &[], false)?;
        let (value, out) = self.lower_chains(lw, &gate.name)?;
        let gemv = Gemv {
            batch: 1,
            m: first.m,
            n: first.n,
            k,
        };
        gemv.lower_pair(
            lw,
            &Pair {
                first,
                second,
                store: GatedStore { value, out },
            },
        )
    }

    /// Take the merged product `node`'s two slices (their values loads of
    /// buffers the store substitutes, returned in the halves' order) and
    /// the nodes up to the multiply: the store of the gated value.
    pub(super) fn lower_halves(
        self,
        lw: &mut Lowering,
        node: &Node,
    ) -> Result<(GatedStore, [BufferIdx; 2])> {
        let mut bufs = [0; 2];
        for (b, &(n, slice)) in bufs.iter_mut().zip(&self.parts) {
            *b = lw.output_buffer(slice, 0)?;
            lw.absorb(n, &[]);
        }
        let (value, out) = self.lower_chains(lw, &node.name)?;
        Ok((GatedStore { value, out }, bufs))
    }

    /// Lower the chains and the multiply ahead (their inputs are loads the
    /// store substitutes): the multiply's value and its output buffer.
    fn lower_chains(&self, lw: &mut Lowering, product: &str) -> Result<(LazyRef, BufferIdx)> {
        let dispatched = lw.dispatches.len();
        for &n in self.chains.iter().chain([&self.mul.0]) {
            lw.lower_ahead(n)?;
        }
        let value = lw.value(self.mul.1.outputs[0])?;
        let out = lw.output_buffer(self.mul.1, 0)?;
        if lw.dispatches.len() != dispatched {
            return Err(Error::internal(format!(
                "the gated value of `{product}` was written out before its store"
            )));
        }
        Ok((value, out))
    }
}

/// The store of a gated pair: the multiply's value, evaluated with the
/// loads of the products' buffers replaced by their sums.
pub(super) struct GatedStore {
    /// The multiply's value, reading the products' buffers.
    value: LazyRef,
    out: BufferIdx,
}

impl GatedStore {
    /// WGSL storing element `e` (`[rows, n]` flat) of the gated value from
    /// `parts`: each product's buffer and its value there (f32, rounded to
    /// its dtype): module-scope declarations, and the statements.
    pub(super) fn store(
        &self,
        kb: &mut KernelBuilder,
        e: &str,
        parts: [(BufferIdx, String); 2],
    ) -> Result<(String, String)> {
        let (mut decls, mut s) = (String::new(), String::new());
        for (i, (buf, value)) in parts.into_iter().enumerate() {
            let var = format!("gated{i}");
            kb.substitute_element(buf, &var);
            decls += &format!("var<private> {var}: f32;\n");
            s += &format!("{var} = {value};\n  ");
        }
        kb.value_fn(&self.value, "vgated")?;
        let at = unravel(e, &self.value.shape).join(", ");
        s += &kb.store(self.out, e, &format!("vgated({at})"))?;
        Ok((decls, s))
    }
}

/// The operands and store of a float [`Gated`] pair's dispatch.
struct Pair {
    first: MatmulArgs,
    second: MatmulArgs,
    store: GatedStore,
}

impl Epilogue for Pair {
    /// `gstore(bt, r, c, v, u)`: both products' sums at `(r, c)` (no batch).
    fn store(&self, kb: &mut KernelBuilder) -> Result<String> {
        let (m, n) = (self.first.m, self.first.n);
        let parts = [
            self.first.stored_value(kb, "v")?,
            self.second.stored_value(kb, "u")?,
        ];
        let (decls, store) = self.store.store(kb, "e", parts)?;
        let e = linear(&["r".into(), "c".into()], &[m, n]);
        Ok(format!(
            "{decls}\nfn gstore(bt: u32, r: u32, c: u32, v: f32, u: f32) {{\n  let e = {e};\n  {store}\n}}\n\n"
        ))
    }
}

impl GemvArgs for Pair {
    fn k_chunks(&self, kb: &mut KernelBuilder, lanes: usize) -> Result<String> {
        let second = &self.second;
        Ok(self.first.k_chunks(kb, lanes)?
            + &chunk_reader(kb, &second.b, "xb_1", &second.batch, true, lanes)?)
    }

    fn b_dtype(&self) -> DType {
        self.first.b_dtype()
    }

    fn a_is_plain(&self) -> bool {
        self.first.a_is_plain()
    }

    fn prologue(&self, kb: &mut KernelBuilder, threads: usize) -> Result<(String, String)> {
        self.first.prologue(kb, threads)
    }

    fn prologue_bytes(&self) -> usize {
        self.first.prologue_bytes()
    }
}
