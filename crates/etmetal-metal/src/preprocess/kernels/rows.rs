//! The row kernel shape shared by reductions, softmax and norms: the
//! reduced dims are moved last and flattened, one workgroup takes one row,
//! its invocations stride over the columns and combine their partial
//! results through workgroup memory (no subgroup size is assumed).

use etmetal_core::{DType, Result};

use crate::preprocess::emit::{grid, Built};
use crate::preprocess::lowering::Lowering;

use crate::preprocess::expr::{Kind, Lazy, LazyRef};

/// Invocations of a row workgroup (a power of two).
pub(crate) const ROW_WORKGROUP: u32 = 64;

/// `x` as `[rows, cols]`: kept dims (in order) then `reduced` dims.
pub(crate) fn as_rows(x: &LazyRef, reduced: &[usize]) -> (LazyRef, usize, usize) {
    let rank = x.shape.len();
    let kept: Vec<usize> = (0..rank).filter(|d| !reduced.contains(d)).collect();
    let rows: usize = kept.iter().map(|&d| x.shape[d]).product();
    let cols: usize = reduced.iter().map(|&d| x.shape[d]).product();
    let order: Vec<usize> = kept.iter().chain(reduced).copied().collect();
    let permuted = if order.iter().enumerate().all(|(i, &d)| i == d) {
        x.clone()
    } else {
        let shape = order.iter().map(|&d| x.shape[d]).collect();
        Lazy::new(x.dtype, shape, Kind::Permute(x.clone(), order))
    };
    let flat = Lazy::new(x.dtype, vec![rows, cols], Kind::Reshape(permuted));
    (flat, rows, cols)
}

/// `x` cast to f32 (`[rows, cols]` views of any dtype).
pub(crate) fn as_f32(x: LazyRef) -> LazyRef {
    if x.dtype == DType::F32 {
        x
    } else {
        let shape = x.shape.clone();
        Lazy::new(DType::F32, shape, Kind::Cast(x))
    }
}

/// How two partial results combine: a WGSL expression of two operands.
pub(crate) type Combine = Box<dyn Fn(&str, &str) -> String>;

/// Declaration of a workgroup array for the tree reduction.
pub(crate) fn shared(name: &str, ty: &str) -> String {
    format!("var<workgroup> {name}: array<{ty}, {ROW_WORKGROUP}>;\n")
}

/// Statements: store `value` into `name[lid]`, combine pairwise down to
/// `name[0]` with `combine(a, b)` (a WGSL expression of two elements),
/// and leave the result in a `let` called `result` for every invocation.
pub(crate) fn tree_reduce(
    name: &str,
    value: &str,
    result: &str,
    combine: &dyn Fn(&str, &str) -> String,
) -> String {
    let step = combine(&format!("{name}[lid]"), &format!("{name}[lid + s]"));
    format!(
        "  {name}[lid] = {value};\n  workgroupBarrier();\n\
         \x20 for (var s = {half}u; s > 0u; s = s >> 1u) {{\n\
         \x20   if (lid < s) {{ {name}[lid] = {step}; }}\n\
         \x20   workgroupBarrier();\n  }}\n\
         \x20 let {result} = {name}[0];\n  workgroupBarrier();\n",
        half = ROW_WORKGROUP / 2
    )
}

/// The head of a row kernel: `row` is the workgroup's row; a loop over
/// the row's columns follows (`for (var c = lid; c < COLS; …)`).
pub(crate) fn row_head(rows: usize) -> String {
    format!(
        "  let row = {};\n  if (row >= {rows}u) {{ return; }}\n",
        crate::preprocess::emit::FLAT_GROUP
    )
}

pub(crate) fn col_loop(cols: usize, body: &str) -> String {
    col_loop_to(&format!("{cols}u"), body)
}

/// [`col_loop`] to the u32 WGSL expression `end` (a run-time size).
pub(crate) fn col_loop_to(end: &str, body: &str) -> String {
    format!("  for (var c = lid; c < {end}; c = c + {ROW_WORKGROUP}u) {{\n{body}  }}\n")
}

/// Dispatch a row kernel: one workgroup a row, `storage` bytes of
/// workgroup memory.
pub(crate) fn dispatch_rows(
    lw: &mut Lowering,
    built: Built,
    rows: usize,
    storage: u32,
) -> Result<()> {
    dispatch_rows_of(lw, built, rows, storage, None)
}

/// [`dispatch_rows`] of a kernel whose rows are, in order, consecutive
/// runs of `out` (a norm's rows, a reduction's outputs): at run time only
/// the rows up to `out`'s last valid element run.
pub(crate) fn dispatch_rows_of(
    lw: &mut Lowering,
    built: Built,
    rows: usize,
    storage: u32,
    out: Option<usize>,
) -> Result<()> {
    let workgroups = grid(rows as u64, lw.options.max_workgroups_per_dim)?;
    let actual = match out {
        Some(out) => {
            let per = lw.buffers.list[out].numel() / rows.max(1);
            lw.sizes.groups(&lw.grid_dims(out), per.max(1))?
        }
        None => None,
    };
    let ops = vec![lw.op_label()];
    lw.add_dispatch_sized(
        built,
        ops,
        [ROW_WORKGROUP, 1, 1],
        workgroups,
        storage,
        actual,
    )
}
