//! Top-k, cumulative sums and advanced indexing.
//!
//! Top-k and cumsum are row kernels (one workgroup per line along `dim`,
//! see [`super::rows`]). Top-k selects `k` times the best element after
//! the previous pick in the order (value, then lower index first; NaN the
//! largest, as the CPU kernel), each round a tree reduction: no sort, no
//! per-element state. Cumsum gives each invocation a contiguous segment of
//! the line and scans the segment sums in workgroup memory. Advanced
//! indexing is a flat kernel that reads the index tensors and then `x`.

use etmetal_core::shape::broadcast_shapes;
use etmetal_core::{DType, Error, Op, Result};
use etmetal_graph::Node;

use super::rows::{as_rows, dispatch_rows, row_head, Combine, ROW_WORKGROUP};
use crate::payload::Fault;
use crate::preprocess::emit::{
    entry, grid, linear, unravel, KernelBuilder, FLAT_GROUP, FLAT_WORKGROUP,
};
use crate::preprocess::expr::{GatherAt, Kind, Lazy, LazyRef, Pos};
use crate::preprocess::lowering::Lowering;
use crate::preprocess::pointwise::{cast, compute_type, int_literal};

pub(super) fn lower(lw: &mut Lowering, node: &Node) -> Result<()> {
    match &node.op {
        Op::TopK {
            k, dim, largest, ..
        } => topk(lw, node, *k, *dim, *largest),
        Op::CumSum { dim } => cumsum(lw, node, *dim),
        Op::Index => index(lw, node),
        other => Err(Error::internal(format!(
            "{} is not top-k, cumsum or indexing",
            other.name()
        ))),
    }
}

/// `x` of `shape` as lines along `dim`: `[rows, cols]`, and the linear
/// index in `out_shape` (`dim` resized) of line `row`, position `c`.
fn lines(
    x: &LazyRef,
    dim: usize,
    out_shape: &[usize],
    c: &str,
) -> Result<(LazyRef, usize, usize, String)> {
    let rank = x.shape.len();
    if dim >= rank.max(1) {
        return Err(Error::invalid_input(format!(
            "dim {dim} is out of range for shape {:?}",
            x.shape
        )));
    }
    let reduced: Vec<usize> = if rank == 0 { vec![] } else { vec![dim] };
    let (rows_x, rows, cols) = as_rows(x, &reduced);
    let kept: Vec<usize> = (0..rank)
        .filter(|&d| d != dim)
        .map(|d| x.shape[d])
        .collect();
    let mut idx = unravel("row", &kept);
    if rank > 0 {
        idx.insert(dim, c.into());
    }
    Ok((rows_x, rows, cols, linear(&idx, out_shape)))
}

fn topk(lw: &mut Lowering, node: &Node, k: usize, dim: usize, largest: bool) -> Result<()> {
    let x = lw.input_view(node, 0)?;
    let (_, _, out_shape) = lw.output_info(node, 0)?;
    let (rows_x, rows, cols, at) = lines(&x, dim, &out_shape, "t")?;
    if k > cols {
        return Err(Error::invalid_input(format!(
            "k = {k} exceeds the size {cols} of dim {dim} of shape {:?}",
            x.shape
        )));
    }
    let values = lw.output_buffer(node, 0)?;
    let indices = lw.output_buffer(node, 1)?;
    let mut kb = KernelBuilder::new(&lw.buffers);
    kb.value_fn(&rows_x, "x")?;
    // an order-preserving u32 key: the best element has the largest key
    let key = match compute_type(x.dtype) {
        "f32" => {
            "  let u = bitcast<u32>(v);\n\
             \x20 if ((u & 0x7fffffffu) > 0x7f800000u) { return 0xffffffffu; }\n\
             \x20 if ((u & 0x7fffffffu) == 0u) { return 0x80000000u; }\n\
             \x20 return select(u | 0x80000000u, ~u, (u & 0x80000000u) != 0u);\n"
        }
        _ => "  return bitcast<u32>(v) ^ 0x80000000u;\n",
    };
    let vty = if x.dtype.is_float() { "f32" } else { "i32" };
    let vdtype = if x.dtype.is_float() {
        DType::F32
    } else {
        DType::I32
    };
    let flip = if largest { "" } else { "~" };
    let mut main = format!(
        "fn order_key(v: {vty}) -> u32 {{\n{key}}}\n\n\
         fn key_at(row: u32, c: u32) -> u32 {{ return {flip}order_key({}); }}\n\n\
         var<workgroup> rk: array<u32, {ROW_WORKGROUP}>;\n\
         var<workgroup> rj: array<u32, {ROW_WORKGROUP}>;\n",
        cast("x(row, c)", x.dtype, vdtype)
    );
    main.push_str(&entry(ROW_WORKGROUP));
    main.push_str(&row_head(rows));
    let value = cast(
        &cast("x(row, pj)", x.dtype, vdtype),
        vdtype,
        lw.buffers.list[values].dtype,
    );
    let store_v = kb.store(values, "at", &value)?;
    let store_i = kb.store(
        indices,
        "at",
        &cast("i32(pj)", DType::I32, lw.buffers.list[indices].dtype),
    )?;
    main.push_str(&format!(
        "  var pk = 0u;\n  var pj = 0xffffffffu;\n\
         \x20 for (var t = 0u; t < {k}u; t = t + 1u) {{\n\
         \x20   var bk = 0u;\n    var bj = 0xffffffffu;\n\
         \x20   for (var c = lid; c < {cols}u; c = c + {ROW_WORKGROUP}u) {{\n\
         \x20     let kc = key_at(row, c);\n\
         \x20     let after = t == 0u || kc < pk || (kc == pk && c > pj);\n\
         \x20     if (after && (kc > bk || (kc == bk && c < bj))) {{ bk = kc; bj = c; }}\n\
         \x20   }}\n\
         \x20   rk[lid] = bk;\n    rj[lid] = bj;\n    workgroupBarrier();\n\
         \x20   for (var s = {half}u; s > 0u; s = s >> 1u) {{\n\
         \x20     if (lid < s) {{\n\
         \x20       let ok = rk[lid + s]; let oj = rj[lid + s];\n\
         \x20       if (ok > rk[lid] || (ok == rk[lid] && oj < rj[lid])) {{ rk[lid] = ok; rj[lid] = oj; }}\n\
         \x20     }}\n      workgroupBarrier();\n    }}\n\
         \x20   pk = rk[0];\n    pj = rj[0];\n    workgroupBarrier();\n\
         \x20   if (lid == 0u) {{\n      let at = {at};\n      {store_v}\n      {store_i}\n    }}\n\
         \x20 }}\n}}\n",
        half = ROW_WORKGROUP / 2
    ));
    dispatch_rows(lw, kb.finish(&main), rows, ROW_WORKGROUP * 8)
}

fn cumsum(lw: &mut Lowering, node: &Node, dim: usize) -> Result<()> {
    let x = lw.input_view(node, 0)?;
    let (_, out_dtype, out_shape) = lw.output_info(node, 0)?;
    let (rows_x, rows, cols, at) = lines(&x, dim, &out_shape, "c")?;
    let out = lw.output_buffer(node, 0)?;
    let (acc, acc_dtype, zero) = if out_dtype.is_float() {
        ("f32", DType::F32, "0.0")
    } else {
        ("i32", DType::I32, "0i")
    };
    let mut kb = KernelBuilder::new(&lw.buffers);
    kb.value_fn(&rows_x, "x")?;
    // int64 sums accumulate in i32, every step checked
    let add: Combine = if out_dtype == DType::I64 {
        let bit = kb.site(&node.name, node.op.name(), Fault::Overflow);
        Box::new(move |a, b| format!("add_ck({a}, {b}, {bit}u)"))
    } else {
        Box::new(|a, b| format!("{a} + {b}"))
    };
    let read = cast("x(row, c)", x.dtype, acc_dtype);
    let y = cast("run", acc_dtype, out_dtype);
    let store = kb.store(out, "at", &y)?;
    let seg = cols.div_ceil(ROW_WORKGROUP as usize).max(1);
    let mut main = format!("var<workgroup> sh: array<{acc}, {ROW_WORKGROUP}>;\n");
    main.push_str(&entry(ROW_WORKGROUP));
    main.push_str(&row_head(rows));
    main.push_str(&format!(
        "  let c0 = min(lid * {seg}u, {cols}u);\n  let c1 = min(c0 + {seg}u, {cols}u);\n\
         \x20 var local: {acc} = {zero};\n\
         \x20 for (var c = c0; c < c1; c = c + 1u) {{ local = {local}; }}\n\
         \x20 sh[lid] = local;\n  workgroupBarrier();\n\
         \x20 for (var o = 1u; o < {ROW_WORKGROUP}u; o = o << 1u) {{\n\
         \x20   let add = select({zero}, sh[max(lid, o) - o], lid >= o);\n\
         \x20   workgroupBarrier();\n    sh[lid] = {scan};\n    workgroupBarrier();\n  }}\n\
         \x20 var run = select({zero}, sh[max(lid, 1u) - 1u], lid > 0u);\n\
         \x20 for (var c = c0; c < c1; c = c + 1u) {{\n\
         \x20   run = {run};\n    let at = {at};\n    {store}\n  }}\n}}\n",
        local = add("local", &read),
        scan = add("sh[lid]", "add"),
        run = add("run", &read),
    ));
    dispatch_rows(lw, kb.finish(&main), rows, ROW_WORKGROUP * 4)
}

/// `x[i0, i1, …]`: the index tensors broadcast to B; B replaces the
/// indexed dims when they are adjacent, else comes first (PyTorch's rule).
fn index(lw: &mut Lowering, node: &Node) -> Result<()> {
    let slots = node.inputs.len().saturating_sub(1);
    let x = lw.input_view(node, 0)?;
    let rank = x.shape.len();
    if slots > rank {
        return Err(Error::invalid_input(format!(
            "{slots} indices given for shape {:?}",
            x.shape
        )));
    }
    let mut indexed: Vec<(usize, LazyRef)> = vec![];
    for d in 0..slots {
        if let Some(i) = lw.optional_input(node, d + 1)? {
            if !i.dtype.is_int() {
                return Err(Error::unsupported(format!(
                    "index slot {} has dtype {} (bool masks give data-dependent shapes)",
                    d + 1,
                    i.dtype
                )));
            }
            indexed.push((d, i));
        }
    }
    if indexed.is_empty() {
        lw.define(node.outputs[0], x);
        return Ok(());
    }
    // one 1-D index on the first dim is an index_select: a lazy gather fused
    // into its readers (a rotary table's row at a decode step's position)
    if let [(0, i)] = indexed.as_slice() {
        if i.shape.len() == 1 {
            let (_, dtype, shape) = lw.output_info(node, 0)?;
            let gather = Kind::Gather {
                len: Pos::At(x.shape[0]),
                src: x,
                dim: 0,
                index: i.clone(),
                at: GatherAt::Dim,
            };
            return lw.define_fused(
                node.outputs[0],
                Lazy::of_node(dtype, shape, gather, &node.name),
            );
        }
    }
    let mut b: Vec<usize> = vec![];
    for (_, i) in &indexed {
        b = broadcast_shapes(&b, &i.shape)
            .map_err(|e| Error::invalid_input(format!("index tensors: {}", e.message())))?;
    }
    let dims: Vec<usize> = indexed.iter().map(|(d, _)| *d).collect();
    let (first, last) = (dims[0], dims[dims.len() - 1]);
    // where B starts in the output
    let b_at = if last - first + 1 == dims.len() {
        first
    } else {
        0
    };
    let rest: Vec<usize> = (0..rank).filter(|d| !dims.contains(d)).collect();
    let mut shape: Vec<usize> = rest.iter().map(|&d| x.shape[d]).collect();
    let n_pre = rest.iter().filter(|&&d| d < b_at).count();
    shape.splice(n_pre..n_pre, b.iter().copied());
    let out = lw.output_buffer(node, 0)?;
    if lw.buffers.list[out].shape != shape {
        return Err(Error::invalid_input(format!(
            "indexing gives shape {shape:?}, the node declares {:?}",
            lw.buffers.list[out].shape
        )));
    }
    let mut kb = KernelBuilder::new(&lw.buffers);
    kb.value_fn(&x, "x")?;
    let numel: usize = shape.iter().product();
    let mut main = entry(FLAT_WORKGROUP);
    main.push_str(&format!(
        "  let g = {FLAT_GROUP} * {FLAT_WORKGROUP}u + lid;\n  if (g >= {numel}u) {{ return; }}\n"
    ));
    for (k, o) in unravel("g", &shape).iter().enumerate() {
        main.push_str(&format!("  let o{k} = {o};\n"));
    }
    let mut args = vec![String::new(); rank];
    for (k, &d) in rest.iter().enumerate() {
        let pos = if k < n_pre { k } else { k + b.len() };
        args[d] = format!("o{pos}");
    }
    for (d, i) in &indexed {
        kb.value_fn(i, &format!("idx{d}"))?;
        let lead = b.len() - i.shape.len();
        let at: Vec<String> = i
            .shape
            .iter()
            .enumerate()
            .map(|(j, &n)| {
                if n == 1 {
                    "0u".into()
                } else {
                    format!("o{}", n_pre + lead + j)
                }
            })
            .collect();
        let n = x.shape[*d] as i64;
        let raw = cast(&format!("idx{d}({})", at.join(", ")), i.dtype, DType::I32);
        main.push_str(&format!(
            "  let r{d} = {raw};\n\
             \x20 let a{d} = u32(clamp(select(r{d}, r{d} + {}, r{d} < 0i), 0i, {}));\n",
            int_literal(n)?,
            int_literal((n - 1).max(0))?
        ));
        args[*d] = format!("a{d}");
    }
    let store = kb.store(out, "g", &format!("x({})", args.join(", ")))?;
    main.push_str(&format!("  {store}\n}}\n"));
    let groups = (numel.max(1) as u64).div_ceil(u64::from(FLAT_WORKGROUP));
    let workgroups = grid(groups, lw.options.max_workgroups_per_dim)?;
    let ops = vec![lw.op_label()];
    lw.add_dispatch(kb.finish(&main), ops, [FLAT_WORKGROUP, 1, 1], workgroups, 0)
}

#[cfg(test)]
mod tests {
    use super::super::testing::lower_inputs;
    use etmetal_core::{DType, Op};

    #[test]
    fn topk_cumsum_index_kernels_validate() {
        let f = DType::F32;
        lower_inputs(
            Op::TopK {
                k: 3,
                dim: 1,
                largest: false,
                sorted: true,
            },
            &[Some((DType::BF16, &[4, 9, 2]))],
        )
        .unwrap();
        lower_inputs(Op::CumSum { dim: 0 }, &[Some((DType::I64, &[130, 3]))]).unwrap();
        lower_inputs(
            Op::Index,
            &[
                Some((f, &[4, 5, 6])),
                None,
                Some((DType::I64, &[3, 1])),
                Some((DType::I64, &[2])),
            ],
        )
        .unwrap();
        let e = lower_inputs(Op::Index, &[Some((f, &[4])), Some((DType::Bool, &[4]))]);
        assert!(e.is_err());
    }
}
