//! `index_copy` ([`Op::IndexCopy`]): rows of a source written at the
//! positions an index tensor names along one dim of `x`.
//!
//! * In place, where nothing reads `x`'s old value after the node (no later
//!   reader of `x`, of a view of its buffer, of a value fused over it) and
//!   its buffer is the partition's to change (an intermediate, or a
//!   resident state input, whose new value the runtime keeps anyway): one
//!   invocation a written element, so a decode step's KV-cache write touches
//!   the new rows only, not the cache. The write waits
//!   ([`Lowering::defer_scatter`]) until a dispatch binds its buffer (the
//!   attention reading the cache) or the partition ends, and the writes
//!   waiting then are one dispatch: a layer's key and value cache writes
//!   are one kernel.
//! * Else, a few rows of a static count: `where(position == index[m],
//!   source row m, x)` for each row, an expression fused into its readers.
//! * Else: `x` copied, then written in place.
//!
//! An index outside the dim writes nothing (PyTorch raises an error).
//!
//! [`Op::IndexCopy`]: etmetal_core::Op::IndexCopy

use etmetal_core::{BinaryOp, DType, Error, Op, Result, Scalar};
use etmetal_graph::Node;

use crate::preprocess::buffers::{BufferIdx, Place, Storage};
use crate::preprocess::deferred::Scatter;
use crate::preprocess::emit::{entry, grid, unravel, KernelBuilder, FLAT_GROUP, FLAT_WORKGROUP};
use crate::preprocess::expr::{self, Kind, Lazy, LazyRef, Pos};
use crate::preprocess::lowering::Lowering;
use crate::preprocess::pointwise::cast;

/// Rows of a static count up to which a copy that cannot be in place is
/// an expression (a select per row) rather than a copy and a write.
const EXPRESSION_ROWS: usize = 4;

pub(super) fn lower(lw: &mut Lowering, node: &Node) -> Result<()> {
    let Op::IndexCopy { dim } = node.op else {
        return Err(Error::internal(format!(
            "{} is not index_copy",
            node.op.name()
        )));
    };
    let x = lw.input(node, 0)?;
    let index = lw.input(node, 1)?;
    let src = lw.input(node, 2)?;
    let k = index.shape.iter().product::<usize>();
    let index = expr::reshaped(&index, vec![k]);
    let mut rows_shape = x.shape.clone();
    if let Some(d) = rows_shape.get_mut(dim) {
        *d = k;
    }
    if dim >= x.shape.len() || src.shape != rows_shape {
        return Err(Error::invalid_input(format!(
            "index_copy of a source {:?} at {k} positions along dim {dim} of {:?}",
            src.shape, x.shape
        )));
    }
    let index_value = node.inputs[1].ok_or_else(|| Error::invalid_input("no index"))?;
    let rows = match lw.graph.sym_dims(index_value).first() {
        Some(e) if e.as_const().is_none() => {
            Some(lw.sizes.size(&lw.sizes.local(std::slice::from_ref(e))[0])?)
        }
        _ => None,
    };
    let out = node.outputs[0];
    let x_value = node.inputs[0].ok_or_else(|| Error::invalid_input("no input"))?;
    let scatter = |target| Scatter {
        target,
        shape: x.shape.clone(),
        dim,
        index: index.clone(),
        src: src.clone(),
        rows: rows.clone(),
    };
    if let Some(target) = in_place_target(lw, x_value, &x, dim) {
        defer(lw, scatter(target))?;
        let lazy = expr::reshaped(&lw.load(target), x.shape.clone());
        lw.define(out, lazy);
        return Ok(());
    }
    if rows.is_none() && k <= EXPRESSION_ROWS {
        return lw.define_fused(out, selected(&x, dim, &index, &src));
    }
    let target = lw.output_buffer(node, 0)?;
    lw.write_flat(&x, target)?;
    defer(lw, scatter(target))
}

/// Let the in-place row write `s` wait with the others that it may join
/// in one dispatch (after those waiting are dispatched, where it may not).
fn defer(lw: &mut Lowering, s: Scatter) -> Result<()> {
    if !joins(lw, lw.scatters_waiting(), &s) {
        lw.flush_scatters()?;
    }
    lw.defer_scatter(s);
    Ok(())
}

/// The buffer of `x` (the value of graph value `v`), when the node may
/// write it in place: see the module docs.
fn in_place_target(
    lw: &Lowering,
    v: etmetal_graph::ValueId,
    x: &LazyRef,
    dim: usize,
) -> Option<BufferIdx> {
    let Kind::Load(target) = x.kind else {
        return None;
    };
    let desc = &lw.buffers.list[target];
    let ours = match desc.place {
        Place::Temp => true,
        Place::Input(_) => lw.is_resident(target),
        _ => false,
    };
    // a 16-bit packed buffer is written a word (two elements of a row) at a time
    let inner: usize = x.shape[dim + 1..].iter().product();
    let pairs = desc.storage != Storage::Packed16 || inner.is_multiple_of(2);
    if !ours || !pairs || lw.readers(v) != 1 {
        return None;
    }
    (!lw.read_later(target, v)).then_some(target)
}

/// `x` with each of the `k` rows of `src` selected where the position along
/// `dim` is its index (the last of repeated positions wins).
fn selected(x: &LazyRef, dim: usize, index: &LazyRef, src: &LazyRef) -> LazyRef {
    let shape = x.shape.clone();
    let expand = |v: LazyRef| Lazy::new(v.dtype, shape.clone(), Kind::Expand(v));
    let mut at = vec![1; shape.len()];
    at[dim] = shape[dim];
    let iota = Kind::Iota {
        start: Scalar::Int(0),
        step: Scalar::Int(1),
    };
    let positions = Lazy::new(index.dtype, vec![shape[dim]], iota);
    let positions = expand(expr::reshaped(&positions, at));
    let mut row_shape = shape.clone();
    row_shape[dim] = 1;
    let mut acc = x.clone();
    for m in 0..index.shape[0] {
        let select = |v: &LazyRef, d: usize, kept: Vec<usize>| {
            let kind = Kind::Select {
                x: v.clone(),
                dim: d,
                index: Pos::At(m),
            };
            Lazy::new(v.dtype, kept, kind)
        };
        let i = expand(select(index, 0, vec![]));
        let hit = Kind::Binary {
            op: BinaryOp::Eq,
            compute: index.dtype,
            a: positions.clone(),
            b: i,
        };
        let hit = Lazy::new(DType::Bool, shape.clone(), hit);
        let mut kept = src.shape.clone();
        kept.remove(dim);
        let row = expand(expr::reshaped(&select(src, dim, kept), row_shape.clone()));
        acc = Lazy::new(x.dtype, shape.clone(), Kind::Where(hit, row, acc));
    }
    acc
}

/// Whether `s` may join the writes waiting in `waiting` (one dispatch):
/// none writes its buffer or reads what another writes, and all bind
/// within the limit.
fn joins(lw: &Lowering, waiting: &[Scatter], s: &Scatter) -> bool {
    let apart = waiting
        .iter()
        .all(|w| w.target != s.target && !w.reads(s.target) && !s.reads(w.target));
    let mut bufs = vec![];
    let mut checks = false;
    for w in waiting.iter().chain([s]) {
        if !bufs.contains(&w.target) {
            bufs.push(w.target);
        }
        w.index.buffers(&mut bufs);
        w.src.buffers(&mut bufs);
        checks |= w.index.has_checks() || w.src.has_checks();
    }
    apart && bufs.len() + usize::from(checks) <= lw.options.max_bindings
}

/// One dispatch writing every waiting row of `scatters`: each takes a
/// range of the invocations, one element (a word of two when 16-bit
/// packed) each.
pub(crate) fn dispatch(lw: &mut Lowering, scatters: &[Scatter]) -> Result<()> {
    let mut kb = KernelBuilder::new(&lw.buffers);
    let mut main = entry(FLAT_WORKGROUP);
    main.push_str(&format!(
        "  let g = {FLAT_GROUP} * {FLAT_WORKGROUP}u + lid;\n"
    ));
    let mut start = 0usize;
    for (i, s) in scatters.iter().enumerate() {
        let Some(write) = element_write(&mut kb, lw, s, i, None, 0)? else {
            continue;
        };
        main.push_str(&format!(
            "  if (g >= {start}u && g < {end}u) {{\n    let t = g - {start}u;\n{}  }}\n",
            write.body,
            end = start + write.items,
        ));
        start += write.items;
    }
    if start == 0 {
        // no rows to write
        return Ok(());
    }
    main.push_str("}\n");
    let groups = (start as u64).div_ceil(u64::from(FLAT_WORKGROUP));
    let workgroups = grid(groups, lw.options.max_workgroups_per_dim)?;
    let ops = vec![lw.op_label()];
    lw.add_dispatch(kb.finish(&main), ops, [FLAT_WORKGROUP, 1, 1], workgroups, 0)
}

/// The elements of a row write, as one invocation writes each.
pub(crate) struct ElementWrite {
    /// How many: one a written element, or a word of two where 16-bit
    /// packed.
    pub items: usize,
    /// WGSL statements writing element `t` (a `u32` below `items`, in
    /// scope), with `j`, its position along the dim, an `i32`.
    pub body: String,
}

/// How a kernel writes the rows of `s` (its functions tagged `i`): element
/// `t` is written where its position is inside the dim, inside the run-time
/// row count, and meets `keep` where given (a WGSL condition on `j`). An
/// element is one value (a word of two where 16-bit packed), or with
/// `chunk` 4 or 8 that many (a divisor of a row), stored as the kernel's
/// chunked reads load them ([`KernelBuilder::store_chunk`]). None where
/// there are no rows.
pub(crate) fn element_write(
    kb: &mut KernelBuilder,
    lw: &Lowering,
    s: &Scatter,
    i: usize,
    keep: Option<&str>,
    chunk: usize,
) -> Result<Option<ElementWrite>> {
    let (outer, k, inner) = s.geometry();
    let n = s.shape[s.dim];
    let packed = lw.buffers.list[s.target].storage == Storage::Packed16;
    let per = match (chunk, packed) {
        (0, true) => 2,
        (0, false) => 1,
        _ => chunk,
    };
    let items = outer * k * inner / per;
    if items == 0 {
        return Ok(None);
    }
    let (src, ix) = (format!("src{i}"), format!("ix{i}"));
    kb.value_fn(&s.src, &src)?;
    kb.value_fn(&s.index, &ix)?;
    let inner_items = inner / per;
    let mut valid = match &s.rows {
        Some(rows) => format!(" && m < {}", kb.size(rows)),
        None => String::new(),
    };
    if let Some(keep) = keep {
        valid += &format!(" && {keep}");
    }
    let at = |c: &str| -> String {
        let mut idx = unravel("o", &s.shape[..s.dim]);
        idx.push("m".into());
        idx.extend(unravel(c, &s.shape[s.dim + 1..]));
        format!("{src}({})", idx.join(", "))
    };
    let position = cast(&format!("{ix}(m)"), s.index.dtype, DType::I32);
    let e = format!("(o * {n}u + u32(j)) * {inner}u + c");
    // (a 16-bit word's halves are rounded as they are packed)
    let stored = |c: &str| match packed {
        true => at(c),
        false => cast(&at(c), s.src.dtype, lw.buffers.list[s.target].dtype),
    };
    let store = match (chunk, packed) {
        (0, true) => kb.store_pair(
            s.target,
            &format!("({e}) / 2u"),
            &stored("c"),
            &stored("(c + 1u)"),
        ),
        (0, false) => kb.store(s.target, &e, &stored("c"))?,
        _ => {
            let values: Vec<String> = (0..chunk).map(|q| stored(&format!("(c + {q}u)"))).collect();
            kb.store_chunk(s.target, &format!("({e}) / {chunk}u"), &values)?
        }
    };
    let body = format!(
        "    let c = (t % {inner_items}u) * {per}u;\n\
         \x20   let m = (t / {inner_items}u) % {k}u;\n\
         \x20   let o = t / {row_items}u;\n\
         \x20   let j = {position};\n\
         \x20   if (j >= 0i && j < {n}i{valid}) {{ {store} }}\n",
        row_items = inner_items * k,
    );
    Ok(Some(ElementWrite { items, body }))
}
