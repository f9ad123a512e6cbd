//! Reductions over any dims (sum, mean, prod, amax/amin, any/all), variance,
//! argmax/argmin, max/min with indices, softmax and log-softmax: all row
//! kernels (see [`super::rows`]).

use etmetal_core::{DType, Error, Op, ReduceOp, Result, Scalar};
use etmetal_graph::Node;

use super::gemm::GEMV_ROWS;
use super::rows::{
    as_f32, as_rows, col_loop, col_loop_to, dispatch_rows_of, row_head, shared, tree_reduce,
    Combine, ROW_WORKGROUP,
};
use crate::payload::{Fault, Size};
use crate::preprocess::deferred::RowStat;
use crate::preprocess::emit::{entry, linear, unravel, KernelBuilder};
use crate::preprocess::expr::{reshaped, Kind, Lazy, LazyRef};
use crate::preprocess::lowering::Lowering;
use crate::preprocess::pointwise::{cast, compute_type, float_literal};

pub(super) fn lower(lw: &mut Lowering, node: &Node) -> Result<()> {
    if let Op::Reduce { op, dims, .. } = &node.op {
        let x = lw.input(node, 0)?;
        if dims.iter().all(|&d| x.shape.get(d) == Some(&1))
            && (!dims.is_empty() || x.shape.iter().all(|&s| s == 1))
        {
            return unit_reduce(lw, node, *op, x);
        }
    }
    // max/min with indices writes both
    let outputs = node.outputs.len();
    let x = lw.fused_within(node, 0, outputs - 1)?;
    let rank = x.shape.len();
    let all: Vec<usize> = (0..rank).collect();
    let dims_or_all = |dims: &[usize]| {
        if dims.is_empty() {
            all.clone()
        } else {
            dims.to_vec()
        }
    };
    match &node.op {
        Op::Reduce { op, dims, .. } => {
            let reduced = dims_or_all(dims);
            let x = masked(lw, node, x, &reduced, *op)?;
            let (rows_x, rows, cols) = as_rows(&x, &reduced);
            let out = lw.output_buffer(node, 0)?;
            // a few rows' mean over the last dim (an RMSNorm's) waits for
            // its reader: a matrix-vector product computes it itself
            let last = reduced == [rank.max(1) - 1];
            if *op == ReduceOp::Mean && last && rows <= GEMV_ROWS && x.dtype.is_float() {
                lw.pending.push(RowStat {
                    buf: out,
                    x: rows_x,
                    rows,
                    cols,
                    label: lw.op_label(),
                    node: node.name.clone(),
                });
                return Ok(());
            }
            // over one dynamic dim, the columns stop at its run-time size
            let run_cols = match reduced.as_slice() {
                [d] => run_size(lw, node, *d)?,
                _ => None,
            };
            reduce_rows(
                lw,
                *op,
                &rows_x,
                (rows, cols, run_cols),
                out,
                (&node.name, node.op.name()),
            )
        }
        Op::Var {
            dims, correction, ..
        } => {
            let (rows_x, rows, cols) = as_rows(&x, &dims_or_all(dims));
            let rows_x = as_f32(rows_x);
            let out = lw.output_buffer(node, 0)?;
            let out_dtype = lw.buffers.list[out].dtype;
            let mut kb = KernelBuilder::new(&lw.buffers);
            kb.value_fn(&rows_x, "x")?;
            let mut main = shared("red", "f32");
            main.push_str(&entry(ROW_WORKGROUP));
            main.push_str(&row_head(rows));
            main.push_str("  var acc = 0.0;\n");
            main.push_str(&col_loop(cols, "    acc = acc + x(row, c);\n"));
            main.push_str(&tree_reduce("red", "acc", "sum", &|a, b| {
                format!("({a} + {b})")
            }));
            main.push_str(&format!(
                "  let mean = sum / {};\n  var sq = 0.0;\n",
                float_literal(cols as f64)
            ));
            main.push_str(&col_loop(
                cols,
                "    let d = x(row, c) - mean;\n    sq = sq + d * d;\n",
            ));
            main.push_str(&tree_reduce("red", "sq", "total", &|a, b| {
                format!("({a} + {b})")
            }));
            let divisor = float_literal((cols as f64 - correction).max(0.0));
            let store = kb.store(
                out,
                "row",
                &cast(&format!("(total / {divisor})"), DType::F32, out_dtype),
            )?;
            main.push_str(&format!("  if (lid == 0u) {{ {store} }}\n}}\n"));
            dispatch_rows_of(lw, kb.finish(&main), rows, ROW_WORKGROUP * 4, Some(out))
        }
        Op::ArgReduce { max, dim, .. } => {
            let reduced = dim.map_or(all.clone(), |d| vec![d]);
            arg_reduce(lw, node, &x, &reduced, *max, None, 0)
        }
        Op::ReduceWithIndices { max, dim, .. } => {
            let values = lw.output_buffer(node, 0)?;
            arg_reduce(lw, node, &x, &[*dim], *max, Some(values), 1)
        }
        Op::Softmax { dim, log } => softmax(lw, node, &x, *dim, *log),
        other => Err(Error::internal(format!(
            "{} is not a reduction",
            other.name()
        ))),
    }
}

/// The run-time size of dim `d` of `node`'s input 0 where it is dynamic.
fn run_size(lw: &Lowering, node: &Node, d: usize) -> Result<Option<Size>> {
    let Some(v) = node.inputs[0].filter(|&v| lw.graph.is_dynamic(v)) else {
        return Ok(None);
    };
    let e = lw.sizes.local(&lw.graph.sym_dims(v))[d].clone();
    match e.as_const() {
        Some(_) => Ok(None),
        None => lw.sizes.size(&e).map(Some),
    }
}

/// `x` with each dynamic dim of `reduced` read past its run-time size as
/// the identity of `op`, so the tail of the bound layout adds nothing (the
/// partitioner keeps a mean over a dynamic dim, whose divisor would be the
/// bound, on the CPU).
fn masked(
    lw: &Lowering,
    node: &Node,
    x: LazyRef,
    reduced: &[usize],
    op: ReduceOp,
) -> Result<LazyRef> {
    let Some(v) = node.inputs[0].filter(|&v| lw.graph.is_dynamic(v)) else {
        return Ok(x);
    };
    let dims = lw.sizes.local(&lw.graph.sym_dims(v));
    let valid = reduced
        .iter()
        .filter(|&&d| dims[d].as_const().is_none())
        .map(|&d| Ok((d, lw.sizes.size(&dims[d])?)))
        .collect::<Result<Vec<_>>>()?;
    if valid.is_empty() {
        return Ok(x);
    }
    let float = x.dtype.is_float();
    let fill = match op {
        ReduceOp::Sum | ReduceOp::Mean => Scalar::Int(0),
        ReduceOp::Prod => Scalar::Int(1),
        ReduceOp::Max if float => Scalar::Float(f64::NEG_INFINITY),
        ReduceOp::Max => Scalar::Int(i64::from(i32::MIN)),
        ReduceOp::Min if float => Scalar::Float(f64::INFINITY),
        ReduceOp::Min => Scalar::Int(i64::from(i32::MAX)),
        ReduceOp::Any => Scalar::Bool(false),
        ReduceOp::All => Scalar::Bool(true),
    };
    let kind = Kind::Masked {
        x: x.clone(),
        valid,
        fill,
    };
    Ok(Lazy::new(x.dtype, x.shape.clone(), kind))
}

/// argmax/argmin (first index of the extreme value, as PyTorch), with the
/// values written too when `values` is given.
fn arg_reduce(
    lw: &mut Lowering,
    node: &Node,
    x: &crate::preprocess::expr::LazyRef,
    reduced: &[usize],
    max: bool,
    values: Option<usize>,
    index_output: usize,
) -> Result<()> {
    let (rows_x, rows, cols) = as_rows(x, reduced);
    let indices = lw.output_buffer(node, index_output)?;
    let ty = match compute_type(x.dtype) {
        "bool" => "i32",
        t => t,
    };
    let value_dtype = if ty == "f32" { DType::F32 } else { DType::I32 };
    let mut kb = KernelBuilder::new(&lw.buffers);
    kb.value_fn(&rows_x, "x")?;
    let better = if max { ">" } else { "<" };
    // (v, i) beats the best so far (b, j): NaN wins (first NaN), then the
    // extreme value, then the lower index; 0xffffffff marks "none yet".
    let nan_rule = if ty == "f32" {
        "  let vn = is_nan(v); let bn = is_nan(b);\n  if (vn || bn) { return vn && (!bn || i < j); }\n"
    } else {
        ""
    };
    let mut main = format!(
        "fn beats(v: {ty}, i: u32, b: {ty}, j: u32) -> bool {{\n\
         \x20 if (i == 0xffffffffu) {{ return false; }}\n\
         \x20 if (j == 0xffffffffu) {{ return true; }}\n\
         {nan_rule}  return v {better} b || (v == b && i < j);\n}}\n\n"
    );
    main.push_str(&shared("rv", ty));
    main.push_str(&shared("ri", "u32"));
    main.push_str(&entry(ROW_WORKGROUP));
    main.push_str(&row_head(rows));
    main.push_str(&format!(
        "  var bv: {ty} = {};\n  var bi: u32 = 0xffffffffu;\n",
        if max { lowest(ty) } else { highest(ty) }
    ));
    let read = cast("x(row, c)", x.dtype, value_dtype);
    main.push_str(&col_loop(
        cols,
        &format!("    let v = {read};\n    if (beats(v, c, bv, bi)) {{ bv = v; bi = c; }}\n"),
    ));
    main.push_str(&format!(
        "  rv[lid] = bv;\n  ri[lid] = bi;\n  workgroupBarrier();\n\
         \x20 for (var s = {half}u; s > 0u; s = s >> 1u) {{\n\
         \x20   if (lid < s) {{\n\
         \x20     let ov = rv[lid + s]; let oi = ri[lid + s];\n\
         \x20     if (beats(ov, oi, rv[lid], ri[lid])) {{ rv[lid] = ov; ri[lid] = oi; }}\n\
         \x20   }}\n    workgroupBarrier();\n  }}\n",
        half = ROW_WORKGROUP / 2
    ));
    let out_dtype = lw.buffers.list[indices].dtype;
    let mut stores = kb.store(indices, "row", &cast("i32(ri[0])", DType::I32, out_dtype))?;
    if let Some(values) = values {
        let vd = lw.buffers.list[values].dtype;
        stores.push(' ');
        stores.push_str(&kb.store(values, "row", &cast("rv[0]", value_dtype, vd))?);
    }
    main.push_str(&format!("  if (lid == 0u) {{ {stores} }}\n}}\n"));
    dispatch_rows_of(lw, kb.finish(&main), rows, ROW_WORKGROUP * 8, Some(indices))
}

fn softmax(
    lw: &mut Lowering,
    node: &Node,
    x: &crate::preprocess::expr::LazyRef,
    dim: usize,
    log: bool,
) -> Result<()> {
    let (rows_x, rows, cols) = as_rows(x, &[dim]);
    let rows_x = as_f32(rows_x);
    let out = lw.output_buffer(node, 0)?;
    let out_dtype = lw.buffers.list[out].dtype;
    let shape = x.shape.clone();
    let kept: Vec<usize> = (0..shape.len())
        .filter(|&d| d != dim)
        .map(|d| shape[d])
        .collect();
    // output position of (row, c): the kept dims from the row, dim from c
    let mut idx = unravel("row", &kept);
    idx.insert(dim, "c".into());
    let at = linear(&idx, &shape);
    let mut kb = KernelBuilder::new(&lw.buffers);
    kb.value_fn(&rows_x, "x")?;
    let mut main = shared("red", "f32");
    main.push_str(&entry(ROW_WORKGROUP));
    main.push_str(&row_head(rows));
    main.push_str(&format!("  var m = {};\n", lowest("f32")));
    main.push_str(&col_loop(cols, "    m = max(m, x(row, c));\n"));
    main.push_str(&tree_reduce("red", "m", "mx", &|a, b| {
        format!("max({a}, {b})")
    }));
    main.push_str("  var s = 0.0;\n");
    main.push_str(&col_loop(cols, "    s = s + exp(x(row, c) - mx);\n"));
    main.push_str(&tree_reduce("red", "s", "total", &|a, b| {
        format!("({a} + {b})")
    }));
    let y = if log {
        "x(row, c) - mx - log(total)"
    } else {
        "exp(x(row, c) - mx) / total"
    };
    let store = kb.store(out, "at", &cast(&format!("({y})"), DType::F32, out_dtype))?;
    main.push_str(&col_loop(
        cols,
        &format!("    let at = {at};\n    {store}\n"),
    ));
    main.push_str("}\n");
    // over the last dim a row is a run of the output
    let runs = (dim + 1 == shape.len()).then_some(out);
    dispatch_rows_of(lw, kb.finish(&main), rows, ROW_WORKGROUP * 4, runs)
}

/// The row kernel of `op` over `[rows, cols]` `x` into `out` (`node`
/// and its op name its checks).
fn reduce_rows(
    lw: &mut Lowering,
    op: ReduceOp,
    x: &LazyRef,
    (rows, cols, run_cols): (usize, usize, Option<Size>),
    out: usize,
    (node, op_name): (&str, &str),
) -> Result<()> {
    let out_dtype = lw.buffers.list[out].dtype;
    let acc_dtype = match op {
        ReduceOp::Mean => DType::F32,
        ReduceOp::Sum | ReduceOp::Prod => out_dtype,
        ReduceOp::Max | ReduceOp::Min => x.dtype,
        ReduceOp::Any | ReduceOp::All => DType::I32,
    };
    let ty = compute_type(acc_dtype);
    let acc_ty = if ty == "bool" { "i32" } else { ty };
    let acc_dtype = if ty == "bool" { DType::I32 } else { acc_dtype };
    let mut kb = KernelBuilder::new(&lw.buffers);
    kb.value_fn(x, "x")?;
    // int64 sums and products accumulate in i32, every step checked
    let checked = acc_dtype == DType::I64 && matches!(op, ReduceOp::Sum | ReduceOp::Prod);
    let bit = if checked {
        kb.site(node, op_name, Fault::Overflow)
    } else {
        0
    };
    let (init, combine): (String, Combine) = match op {
        ReduceOp::Sum if checked => (
            zero(acc_ty),
            Box::new(move |a, b| format!("add_ck({a}, {b}, {bit}u)")),
        ),
        ReduceOp::Prod if checked => (
            one(acc_ty),
            Box::new(move |a, b| format!("mul_ck({a}, {b}, {bit}u)")),
        ),
        ReduceOp::Sum | ReduceOp::Mean => (zero(acc_ty), Box::new(|a, b| format!("({a} + {b})"))),
        ReduceOp::Prod => (one(acc_ty), Box::new(|a, b| format!("({a} * {b})"))),
        ReduceOp::Max if acc_ty == "f32" => (
            lowest(acc_ty),
            Box::new(|a, b| format!("max_nan({a}, {b})")),
        ),
        ReduceOp::Min if acc_ty == "f32" => (
            highest(acc_ty),
            Box::new(|a, b| format!("min_nan({a}, {b})")),
        ),
        ReduceOp::Max => (lowest(acc_ty), Box::new(|a, b| format!("max({a}, {b})"))),
        ReduceOp::Min => (highest(acc_ty), Box::new(|a, b| format!("min({a}, {b})"))),
        ReduceOp::Any => ("0i".into(), Box::new(|a, b| format!("max({a}, {b})"))),
        ReduceOp::All => ("1i".into(), Box::new(|a, b| format!("min({a}, {b})"))),
    };
    let read = match op {
        ReduceOp::Any | ReduceOp::All => cast(
            &cast("x(row, c)", x.dtype, DType::Bool),
            DType::Bool,
            DType::I32,
        ),
        _ => cast("x(row, c)", x.dtype, acc_dtype),
    };
    let mut main = shared("red", acc_ty);
    main.push_str(&entry(ROW_WORKGROUP));
    main.push_str(&row_head(rows));
    main.push_str(&format!("  var acc: {acc_ty} = {init};\n"));
    let end = match &run_cols {
        Some(n) => kb.size(n),
        None => format!("{cols}u"),
    };
    main.push_str(&col_loop_to(
        &end,
        &format!("    acc = {};\n", combine("acc", &read)),
    ));
    main.push_str(&tree_reduce("red", "acc", "total", &|a, b| combine(a, b)));
    let mut total = "total".to_string();
    if op == ReduceOp::Mean {
        total = format!("(total / {})", float_literal(cols as f64));
    }
    let store = kb.store(out, "row", &cast(&total, acc_dtype, out_dtype))?;
    main.push_str(&format!("  if (lid == 0u) {{ {store} }}\n}}\n"));
    dispatch_rows_of(lw, kb.finish(&main), rows, ROW_WORKGROUP * 4, Some(out))
}

/// Dispatch a deferred row mean.
pub(crate) fn row_mean(lw: &mut Lowering, st: &RowStat) -> Result<()> {
    let site = (st.node.as_str(), st.label.as_str());
    reduce_rows(
        lw,
        ReduceOp::Mean,
        &st.x,
        (st.rows, st.cols, None),
        st.buf,
        site,
    )
}

/// A reduction over dims of size 1 (a decode step's one position: an
/// `index_copy_` of one row matches it against the cache): each output is
/// its one input element, so it is a lazy cast fused into its readers, not
/// a kernel.
fn unit_reduce(lw: &mut Lowering, node: &Node, op: ReduceOp, x: LazyRef) -> Result<()> {
    let (_, dtype, shape) = lw.output_info(node, 0)?;
    let x = reshaped(&x, shape.clone());
    let x = match op {
        // `any` of a uint8 tensor is a uint8 0 or 1
        ReduceOp::Any | ReduceOp::All => Lazy::new(DType::Bool, shape.clone(), Kind::Cast(x)),
        _ => x,
    };
    let lazy = Lazy::of_node(dtype, shape, Kind::Cast(x), &node.name);
    lw.define_fused(node.outputs[0], lazy)
}

fn zero(ty: &str) -> String {
    if ty == "f32" {
        "0.0".into()
    } else {
        "0i".into()
    }
}
fn one(ty: &str) -> String {
    if ty == "f32" {
        "1.0".into()
    } else {
        "1i".into()
    }
}
fn lowest(ty: &str) -> String {
    if ty == "f32" {
        float_literal(f64::NEG_INFINITY)
    } else {
        "(-2147483647i - 1i)".into()
    }
}
fn highest(ty: &str) -> String {
    if ty == "f32" {
        float_literal(f64::INFINITY)
    } else {
        "2147483647i".into()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::lower_inputs;
    use crate::payload::{Fault, Site};
    use etmetal_core::{BinaryOp, DType, Op, ReduceOp, UnaryOp};

    /// The sites of the only check of a one-node payload.
    fn sites(op: Op, inputs: &[Option<(DType, &[usize])>]) -> Vec<Site> {
        let p = lower_inputs(op, inputs).unwrap().payload;
        match &p.checks[..] {
            [] => vec![],
            [c] => {
                let d = &p.dispatches[c.dispatch];
                // the status buffer binds last, read_write
                assert_eq!(d.buffers.last(), Some(&c.buffer));
                c.sites.clone()
            }
            more => panic!("{} checks", more.len()),
        }
    }

    fn site(op: &str, fault: Fault) -> Site {
        Site {
            node: "n0".into(),
            op: op.into(),
            fault,
        }
    }

    #[test]
    fn int64_arithmetic_is_checked_and_exact_ops_are_not() {
        let l: Option<(DType, &[usize])> = Some((DType::I64, &[3, 5]));
        let i: Option<(DType, &[usize])> = Some((DType::I32, &[3, 5]));
        let f: Option<(DType, &[usize])> = Some((DType::F32, &[3, 5]));
        let bin = |b| Op::Binary(b);
        assert_eq!(
            sites(bin(BinaryOp::Mul), &[l, l]),
            [site("mul", Fault::Overflow)]
        );
        assert_eq!(
            sites(bin(BinaryOp::FloorDiv), &[l, l]),
            [
                site("floor_div", Fault::ZeroDivision),
                site("floor_div", Fault::Overflow)
            ]
        );
        // int32 wraps as PyTorch's, but still may not divide by zero
        assert_eq!(sites(bin(BinaryOp::Add), &[i, i]), []);
        assert_eq!(
            sites(bin(BinaryOp::Remainder), &[i, i]),
            [site("remainder", Fault::ZeroDivision)]
        );
        for exact in [BinaryOp::Le, BinaryOp::Maximum, BinaryOp::Eq] {
            assert_eq!(sites(bin(exact), &[l, l]), [], "{exact:?}");
        }
        assert_eq!(
            sites(Op::Unary(UnaryOp::Neg), &[l]),
            [site("neg", Fault::Overflow)]
        );
        assert_eq!(sites(Op::Unary(UnaryOp::Sign), &[l]), []);
        assert_eq!(
            sites(Op::Cast { dtype: DType::I64 }, &[f]),
            [site("cast", Fault::Overflow)]
        );
        assert_eq!(sites(Op::Cast { dtype: DType::F32 }, &[l]), []);
        let sum = Op::Reduce {
            op: ReduceOp::Sum,
            dims: vec![1],
            keepdim: false,
        };
        assert_eq!(sites(sum, &[l]), [site("reduce_sum", Fault::Overflow)]);
        assert_eq!(
            sites(Op::CumSum { dim: 0 }, &[i]),
            [site("cum_sum", Fault::Overflow)]
        );
    }
}
