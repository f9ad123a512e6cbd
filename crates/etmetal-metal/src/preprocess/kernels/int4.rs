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
//! the tiled kernel ([`tiled`]).
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
use crate::preprocess::emit::{entry, grid, KernelBuilder, FLAT_GROUP};
use crate::preprocess::expr::LazyRef;
use crate::preprocess::BufferIdx;
use crate::preprocess::Lowering;

/// Activation rows a workgroup takes (decode batches up to 8 read the
/// weight once).
const ROWS: usize = 8;

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
    if !experts && m > ROWS {
        let dims = Gemm {
            m,
            n,
            k,
            group_size,
        };
        let d = lw.dispatches.len();
        tiled(lw, &xr, &packed, &scales, &zeros, out, dims)?;
        // the tensor-core forms, dequantizing as they stage (gemm/dequant.rs)
        let operands = super::gemm::Int4Operands {
            x: &xr,
            packed: &packed,
            scales: &scales,
            zeros: &zeros,
            group_size,
            m,
            n,
            k,
            out,
        };
        return operands.alternatives(lw, d);
    }
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

/// Output tile edge of the tiled kernel, and its K step (one step lies in
/// one group: every group size is a multiple of 32).
const TILE: usize = 32;

struct Gemm {
    m: usize,
    n: usize,
    k: usize,
    group_size: usize,
}

/// Prefill (M > 8): a workgroup of 256 computes a 32x32 tile of `y`, each
/// invocation 2x2. Per K step of 32 it stages the activation tile and the
/// weight tile, dequantizing the weight while staging (4 words a row, one
/// scale and zero: the step lies in one group), so each packed word is read
/// once per tile row of M.
fn tiled(
    lw: &mut Lowering,
    x: &LazyRef,
    packed: &LazyRef,
    scales: &LazyRef,
    zeros: &LazyRef,
    out: BufferIdx,
    d: Gemm,
) -> Result<()> {
    let Gemm {
        m,
        n,
        k,
        group_size,
    } = d;
    let wg = 256u32;
    let mut kb = KernelBuilder::new(&lw.buffers);
    kb.value_fn(x, "x")?;
    kb.value_fn(packed, "wq")?;
    kb.value_fn(scales, "sc")?;
    kb.value_fn(zeros, "ze")?;
    let tiles_n = n.div_ceil(TILE);
    let tiles = m.div_ceil(TILE) * tiles_n;
    let store = kb.store(out, &format!("mm * {n}u + nn"), "acc[a * 2u + b]")?;
    let mut main = format!(
        "var<workgroup> xs: array<f32, {sz}>;\nvar<workgroup> ws: array<f32, {sz}>;\n",
        sz = TILE * (TILE + 1)
    );
    main.push_str(&entry(wg));
    main.push_str(&format!(
        "  let tile = {FLAT_GROUP};\n  if (tile >= {tiles}u) {{ return; }}\n\
         \x20 let n0 = (tile % {tiles_n}u) * {TILE}u;\n  let m0 = (tile / {tiles_n}u) * {TILE}u;\n\
         \x20 let ty = lid / 16u;\n  let tx = lid % 16u;\n\
         \x20 var acc: array<f32, 4>;\n\
         \x20 for (var i = 0u; i < 4u; i = i + 1u) {{ acc[i] = 0.0; }}\n\
         \x20 for (var k0 = 0u; k0 < {k}u; k0 = k0 + {TILE}u) {{\n\
         \x20   for (var i = 0u; i < 4u; i = i + 1u) {{\n\
         \x20     let e = lid + i * {wg}u;\n      let r = e / {TILE}u;\n      let c = e % {TILE}u;\n\
         \x20     xs[r * {TP}u + c] = x(min(m0 + r, {ml}u), k0 + c);\n\
         \x20   }}\n\
         \x20   if (lid < {words}u) {{\n\
         \x20     let r = lid / 4u;\n      let wi = lid % 4u;\n      let nr = min(n0 + r, {nl}u);\n\
         \x20     let q = bitcast<u32>(wq(nr, k0 / 8u + wi));\n\
         \x20     let g = k0 / {group_size}u;\n      let s = sc(nr, g);\n      let z = ze(nr, g);\n\
         \x20     for (var i = 0u; i < 8u; i = i + 1u) {{\n\
         \x20       ws[r * {TP}u + wi * 8u + i] = f32((q >> (4u * i)) & 15u) * s + z;\n\
         \x20     }}\n\
         \x20   }}\n\
         \x20   workgroupBarrier();\n\
         \x20   for (var kk = 0u; kk < {TILE}u; kk = kk + 1u) {{\n\
         \x20     for (var a = 0u; a < 2u; a = a + 1u) {{\n\
         \x20       let xv = xs[(ty * 2u + a) * {TP}u + kk];\n\
         \x20       for (var b = 0u; b < 2u; b = b + 1u) {{\n\
         \x20         acc[a * 2u + b] = acc[a * 2u + b] + xv * ws[(tx * 2u + b) * {TP}u + kk];\n\
         \x20       }}\n\
         \x20     }}\n\
         \x20   }}\n\
         \x20   workgroupBarrier();\n\
         \x20 }}\n\
         \x20 for (var a = 0u; a < 2u; a = a + 1u) {{\n\
         \x20   for (var b = 0u; b < 2u; b = b + 1u) {{\n\
         \x20     let mm = m0 + ty * 2u + a;\n      let nn = n0 + tx * 2u + b;\n\
         \x20     if (mm < {m}u && nn < {n}u) {{ {store} }}\n\
         \x20   }}\n\
         \x20 }}\n}}\n",
        TP = TILE + 1,
        ml = m - 1,
        nl = n - 1,
        words = TILE * TILE / 8,
    ));
    let workgroups = grid(tiles as u64, lw.options.max_workgroups_per_dim)?;
    let ops = vec![lw.op_label()];
    let storage = (2 * TILE * (TILE + 1) * 4) as u32;
    lw.add_dispatch(kb.finish(&main), ops, [wg, 1, 1], workgroups, storage)
}
