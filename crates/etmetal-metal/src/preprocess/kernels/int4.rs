//! The int4 weight-only linear ([`Op::Int4Linear`]): `y [M, N] = x [M, K]
//! @ W.T` with `W` in the int4 layout of `etmetal_core::int4`, read as int32
//! words (8 codes a word; the passes give the GPU that view, since a uint8
//! buffer is widened to a word an element).
//!
//! One workgroup takes one output channel `n` for a block of up to
//! [`ROWS`] activation rows: its invocations stride over the packed row a
//! word at a time (consecutive invocations read consecutive words), and per
//! word apply `scale * dot(x, q) + zero * sum(x)` for every row of the
//! block, so each packed row is streamed from memory once per block. For
//! decode (M <= 8) that is once: the kernel is bound by the weight bytes.
//! The partial sums meet in a workgroup-memory tree reduction, which
//! assumes no subgroup size (lavapipe has 8, NVIDIA 32). Larger M takes
//! ceil(M / 8) blocks, each re-reading the row: correct, but not the tiled
//! GEMM prefill wants (not written yet).
//!
//! `metal::gather_qmv` ([`Op::GatherQmv`]) is the same kernel with a block
//! of one row, whose expert index picks the weight (an index out of range
//! is clamped to the last expert; the CPU kernel reports it as an error).
//!
//! [`Op::Int4Linear`]: etmetal_core::Op::Int4Linear
//! [`Op::GatherQmv`]: etmetal_core::Op::GatherQmv

use etmetal_core::{DType, Error, Op, Result};
use etmetal_graph::Node;

use super::rows::{as_rows, dispatch_rows, row_head, ROW_WORKGROUP};
use crate::preprocess::emit::{entry, KernelBuilder};
use crate::preprocess::Lowering;

/// Activation rows a workgroup takes (decode batches up to 8 read the
/// weight once).
const ROWS: usize = 8;

pub(super) fn takes(op: &Op) -> bool {
    matches!(op, Op::Int4Linear { .. } | Op::GatherQmv { .. })
}

pub(super) fn lower(lw: &mut Lowering, node: &Node) -> Result<()> {
    let (group_size, experts) = match node.op {
        Op::Int4Linear { group_size } => (group_size, false),
        Op::GatherQmv { group_size } => (group_size, true),
        _ => {
            return Err(Error::internal(format!(
                "{} is not an int4 op",
                node.op.name()
            )))
        }
    };
    let x = lw.input_view(node, 0)?;
    let packed = lw.input_view(node, 1)?;
    let scales = lw.input_view(node, 2)?;
    let zeros = lw.input_view(node, 3)?;
    let lead = usize::from(experts);
    if packed.dtype != DType::I32 || packed.shape.len() != 2 + lead {
        return Err(Error::unsupported(format!(
            "int4 packed weight {} {:?}: the GPU kernel reads int32 words [.., N, K/8]",
            packed.dtype, packed.shape
        )));
    }
    let rank = x.shape.len();
    let (xr, m, k) = as_rows(&x, &[rank.saturating_sub(1)]);
    let (n, words) = (packed.shape[lead], packed.shape[lead + 1]);
    if words * 8 != k || group_size % 8 != 0 || k % group_size != 0 {
        return Err(Error::invalid_input(format!(
            "int4 weight of {n}x{words} words, group {group_size}, for K = {k}"
        )));
    }
    let idx = if experts {
        Some(lw.input_view(node, 4)?)
    } else {
        None
    };
    let out = lw.output_buffer(node, 0)?;
    let mut kb = KernelBuilder::new(&lw.buffers);
    kb.value_fn(&xr, "x")?;
    kb.value_fn(&packed, "wq")?;
    kb.value_fn(&scales, "sc")?;
    kb.value_fn(&zeros, "ze")?;
    // gather_qmv: each row its own expert, so a block is one row
    let (mb, expert, at_e) = if let Some(idx) = idx {
        kb.value_fn(&idx, "ex")?;
        let count = packed.shape[0];
        (
            1,
            format!("  let e = u32(clamp(i32(ex(m0)), 0i, {}i));\n", count - 1),
            "e, ",
        )
    } else {
        (m.clamp(1, ROWS), String::new(), "")
    };
    let blocks = m.div_ceil(mb);
    let at = format!("(m0 + j) * {n}u + n");
    let store = kb.store(out, &at, &format!("red[j * {ROW_WORKGROUP}u]"))?;
    let wpg = group_size / 8;
    let mut main = format!(
        "var<workgroup> red: array<f32, {}>;\n",
        ROW_WORKGROUP as usize * mb
    );
    main.push_str(&entry(ROW_WORKGROUP));
    main.push_str(&row_head(n * blocks));
    main.push_str(&format!(
        "  let n = row % {n}u;\n  let m0 = (row / {n}u) * {mb}u;\n"
    ));
    main.push_str(&expert);
    main.push_str(&format!(
        "  var acc: array<f32, {mb}>;\n\
         \x20 for (var j = 0u; j < {mb}u; j = j + 1u) {{ acc[j] = 0.0; }}\n\
         \x20 for (var w = lid; w < {words}u; w = w + {ROW_WORKGROUP}u) {{\n\
         \x20   let q = bitcast<u32>(wq({at_e}n, w));\n\
         \x20   let g = w / {wpg}u;\n\
         \x20   let s = sc({at_e}n, g);\n    let z = ze({at_e}n, g);\n\
         \x20   for (var j = 0u; j < {mb}u; j = j + 1u) {{\n\
         \x20     let mr = min(m0 + j, {last}u);\n\
         \x20     var dq = 0.0;\n      var sx = 0.0;\n\
         \x20     for (var i = 0u; i < 8u; i = i + 1u) {{\n\
         \x20       let xv = x(mr, w * 8u + i);\n\
         \x20       dq = dq + xv * f32((q >> (4u * i)) & 15u);\n\
         \x20       sx = sx + xv;\n\
         \x20     }}\n\
         \x20     acc[j] = acc[j] + s * dq + z * sx;\n\
         \x20   }}\n\
         \x20 }}\n\
         \x20 for (var j = 0u; j < {mb}u; j = j + 1u) {{ red[j * {wg}u + lid] = acc[j]; }}\n\
         \x20 workgroupBarrier();\n\
         \x20 for (var h = {half}u; h > 0u; h = h >> 1u) {{\n\
         \x20   if (lid < h) {{\n\
         \x20     for (var j = 0u; j < {mb}u; j = j + 1u) {{\n\
         \x20       red[j * {wg}u + lid] = red[j * {wg}u + lid] + red[j * {wg}u + lid + h];\n\
         \x20     }}\n\
         \x20   }}\n\
         \x20   workgroupBarrier();\n\
         \x20 }}\n\
         \x20 if (lid == 0u) {{\n\
         \x20   for (var j = 0u; j < {mb}u; j = j + 1u) {{\n\
         \x20     if (m0 + j < {m}u) {{ {store} }}\n\
         \x20   }}\n\
         \x20 }}\n}}\n",
        last = m - 1,
        wg = ROW_WORKGROUP,
        half = ROW_WORKGROUP / 2,
    ));
    dispatch_rows(
        lw,
        kb.finish(&main),
        n * blocks,
        ROW_WORKGROUP * 4 * mb as u32,
    )
}
