//! Scaled dot-product attention as one fused kernel with an online softmax
//! (flash-attention style). A workgroup takes one batch·head and a block of
//! up to [`BLOCK_Q`] query rows (kept in workgroup memory) and walks the
//! keys in tiles of [`TILE`]: each invocation scores one key against every
//! row of the block, the row statistics (running max and sum, f32) are
//! updated once per tile, and each invocation accumulates a few output
//! columns for every row. Decode (one query row) uses a block of one row.
//! As the CPU kernel, a row whose every key is masked gives zeros.

use etmetal_core::shape::broadcast_shapes;
use etmetal_core::{DType, Error, Op, Result};
use etmetal_graph::Node;

use crate::preprocess::emit::{entry, grid, unravel, KernelBuilder, FLAT_GROUP};
use crate::preprocess::expr::LazyRef;
use crate::preprocess::pointwise::{cast, float_literal};
use crate::preprocess::Lowering;

/// Keys per tile, one per invocation of the workgroup.
const TILE: usize = 64;
/// Query rows a workgroup takes at most.
const BLOCK_Q: usize = 8;
/// The largest head dim (of q/k and of v) the kernel takes.
pub(crate) const MAX_HEAD_DIM: usize = 256;

pub(super) fn takes(op: &Op) -> bool {
    matches!(op, Op::Sdpa { .. })
}

pub(super) fn lower(lw: &mut Lowering, node: &Node) -> Result<()> {
    let Op::Sdpa {
        is_causal,
        scale,
        enable_gqa,
    } = node.op
    else {
        return Err(Error::internal(format!(
            "{} is not attention",
            node.op.name()
        )));
    };
    let q = lw.input_view(node, 0)?;
    let k = lw.input_view(node, 1)?;
    let v = lw.input_view(node, 2)?;
    let mask = lw.optional_input_view(node, 3)?;
    let g = Geometry::new(&q, &k, &v, enable_gqa)?;
    if is_causal && mask.is_some() {
        return Err(Error::invalid_input(
            "an explicit mask cannot be combined with is_causal",
        ));
    }
    let out = lw.output_buffer(node, 0)?;
    let desc = &lw.buffers.list[out];
    let expected: Vec<usize> = [&g.batch[..], &[g.l, g.ev]].concat();
    if desc.shape != expected || !desc.dtype.is_float() {
        return Err(Error::invalid_input(format!(
            "attention output is {} {:?}, expected a float tensor of shape {expected:?}",
            desc.dtype, desc.shape
        )));
    }
    let out_dtype = desc.dtype;
    let scale = scale.unwrap_or(1.0 / (g.e as f64).sqrt());
    let (l, s, e, ev) = (g.l, g.s, g.e, g.ev);
    let bq = l.min(BLOCK_Q);
    let blocks = l.div_ceil(bq);
    let nb: usize = g.batch.iter().product();
    let cp = ev.div_ceil(TILE);

    let mut kb = KernelBuilder::new(&lw.buffers);
    kb.value_fn(&q, "q")?;
    kb.value_fn(&k, "k")?;
    kb.value_fn(&v, "v")?;
    if let Some(m) = &mask {
        kb.value_fn(m, "mask")?;
    }
    let ninf = float_literal(f64::NEG_INFINITY);
    let mut main = format!(
        "var<workgroup> qs: array<f32, {}>;\n\
         var<workgroup> ps: array<f32, {}>;\n\
         var<workgroup> alpha: array<f32, {bq}>;\n",
        bq * e,
        bq * TILE
    );
    main.push_str(&entry(TILE as u32));
    main.push_str(&format!(
        "  let g = {FLAT_GROUP};\n  if (g >= {}u) {{ return; }}\n\
         \x20 let b = g / {blocks}u;\n  let i0 = (g % {blocks}u) * {bq}u;\n",
        nb * blocks
    ));
    // the batch index of each operand (broadcast dims read 0, GQA heads share)
    let bidx = unravel("b", &g.batch);
    for (d, name) in bidx.iter().enumerate() {
        main.push_str(&format!("  let bi{d} = {name};\n"));
    }
    let batch_of = |shape: &[usize], rep: usize| -> Vec<String> {
        let lead = g.batch.len() - (shape.len() - 2);
        (0..shape.len() - 2)
            .map(|d| {
                let full = lead + d;
                if shape[d] == 1 {
                    "0u".to_string()
                } else if rep > 1 && full + 1 == g.batch.len() {
                    format!("bi{full} / {rep}u")
                } else {
                    format!("bi{full}")
                }
            })
            .collect()
    };
    let call = |name: &str, batch: &[String], row: &str, col: &str| {
        let mut args = batch.to_vec();
        args.push(row.into());
        args.push(col.into());
        format!("{name}({})", args.join(", "))
    };
    let qcall = call(
        "q",
        &batch_of(&q.shape, 1),
        &format!("min(i0 + r, {}u)", l - 1),
        "e",
    );
    let kcall = call(
        "k",
        &batch_of(&k.shape, g.rep),
        &format!("min(j, {}u)", s.max(1) - 1),
        "e",
    );
    let vcall = call("v", &batch_of(&v.shape, g.rep), "t0 + jj", "c");
    main.push_str(&format!(
        "  for (var t = lid; t < {}u; t = t + {TILE}u) {{\n\
         \x20   let r = t / {e}u; let e = t % {e}u;\n    qs[t] = {qcall};\n  }}\n\
         \x20 workgroupBarrier();\n",
        bq * e
    ));
    let kend = if is_causal {
        format!("min({s}u, i0 + {bq}u)")
    } else {
        format!("{s}u")
    };
    main.push_str(&format!(
        "  var m = {ninf};\n  var l = 0.0;\n  var acc: array<f32, {}>;\n\
         \x20 let kend = {kend};\n\
         \x20 for (var t0 = 0u; t0 < kend; t0 = t0 + {TILE}u) {{\n\
         \x20   let j = t0 + lid;\n    var sc: array<f32, {bq}>;\n\
         \x20   for (var e = 0u; e < {e}u; e = e + 1u) {{\n\
         \x20     let kv = {kcall};\n\
         \x20     for (var r = 0u; r < {bq}u; r = r + 1u) {{ sc[r] = sc[r] + qs[r * {e}u + e] * kv; }}\n\
         \x20   }}\n\
         \x20   for (var r = 0u; r < {bq}u; r = r + 1u) {{\n\
         \x20     let i = i0 + r;\n      var x = sc[r] * {};\n      var keep = j < kend;\n",
        bq * cp,
        float_literal(scale)
    ));
    if is_causal {
        main.push_str("      keep = keep && j <= i;\n");
    }
    if let Some(m) = &mask {
        let full: Vec<String> = (0..g.batch.len())
            .map(|d| format!("bi{d}"))
            .chain([
                format!("min(i, {}u)", l - 1),
                format!("min(j, {}u)", s.max(1) - 1),
            ])
            .collect();
        let lead = full.len() - m.shape.len();
        let args: Vec<String> = m
            .shape
            .iter()
            .enumerate()
            .map(|(d, &n)| {
                if n == 1 {
                    "0u".into()
                } else {
                    full[lead + d].clone()
                }
            })
            .collect();
        let at = format!("mask({})", args.join(", "));
        match m.dtype {
            DType::Bool => main.push_str(&format!("      keep = keep && {at};\n")),
            d if d.is_float() => main.push_str(&format!("      x = x + {at};\n")),
            d => {
                return Err(Error::invalid_input(format!(
                    "mask dtype {d} must be bool or floating point"
                )))
            }
        }
    }
    main.push_str(&format!(
        "      ps[r * {TILE}u + lid] = select({ninf}, x, keep);\n    }}\n\
         \x20   workgroupBarrier();\n\
         \x20   if (lid < {bq}u) {{\n\
         \x20     let o = lid * {TILE}u;\n      var mx = m;\n\
         \x20     for (var jj = 0u; jj < {TILE}u; jj = jj + 1u) {{ mx = max(mx, ps[o + jj]); }}\n\
         \x20     var a = 1.0;\n      var sum = 0.0;\n\
         \x20     if (mx == {ninf}) {{\n\
         \x20       for (var jj = 0u; jj < {TILE}u; jj = jj + 1u) {{ ps[o + jj] = 0.0; }}\n\
         \x20     }} else {{\n\
         \x20       a = exp(m - mx);\n\
         \x20       for (var jj = 0u; jj < {TILE}u; jj = jj + 1u) {{\n\
         \x20         let p = exp(ps[o + jj] - mx);\n          ps[o + jj] = p;\n          sum = sum + p;\n\
         \x20       }}\n      }}\n\
         \x20     l = l * a + sum;\n      m = mx;\n      alpha[lid] = a;\n    }}\n\
         \x20   workgroupBarrier();\n\
         \x20   let nj = min({TILE}u, kend - t0);\n\
         \x20   for (var ci = 0u; ci < {cp}u; ci = ci + 1u) {{\n\
         \x20     let c = lid + ci * {TILE}u;\n\
         \x20     if (c < {ev}u) {{\n\
         \x20       for (var r = 0u; r < {bq}u; r = r + 1u) {{ acc[r * {cp}u + ci] = acc[r * {cp}u + ci] * alpha[r]; }}\n\
         \x20       for (var jj = 0u; jj < nj; jj = jj + 1u) {{\n\
         \x20         let vv = {vcall};\n\
         \x20         for (var r = 0u; r < {bq}u; r = r + 1u) {{ acc[r * {cp}u + ci] = acc[r * {cp}u + ci] + ps[r * {TILE}u + jj] * vv; }}\n\
         \x20       }}\n      }}\n    }}\n\
         \x20   workgroupBarrier();\n  }}\n\
         \x20 if (lid < {bq}u) {{ alpha[lid] = select(0.0, 1.0 / l, l > 0.0); }}\n\
         \x20 workgroupBarrier();\n"
    ));
    let y = cast(
        &format!("(acc[r * {cp}u + ci] * alpha[r])"),
        DType::F32,
        out_dtype,
    );
    let store = kb.store(out, &format!("(b * {l}u + i0 + r) * {ev}u + c"), &y)?;
    main.push_str(&format!(
        "  for (var r = 0u; r < {bq}u; r = r + 1u) {{\n\
         \x20   for (var ci = 0u; ci < {cp}u; ci = ci + 1u) {{\n\
         \x20     let c = lid + ci * {TILE}u;\n\
         \x20     if (i0 + r < {l}u && c < {ev}u) {{ {store} }}\n    }}\n  }}\n}}\n"
    ));
    let workgroups = grid((nb * blocks) as u64, lw.options.max_workgroups_per_dim)?;
    let ops = vec![lw.op_label()];
    let storage = 4 * (bq * e + bq * TILE + bq) as u32;
    lw.add_dispatch(
        kb.finish(&main),
        ops,
        [TILE as u32, 1, 1],
        workgroups,
        storage,
    )
}

/// Sizes of one attention: batch dims (broadcast, k/v heads repeated to
/// q's), query and key lengths, head dims, and the GQA repeat.
struct Geometry {
    batch: Vec<usize>,
    l: usize,
    s: usize,
    e: usize,
    ev: usize,
    rep: usize,
}

impl Geometry {
    fn new(q: &LazyRef, k: &LazyRef, v: &LazyRef, enable_gqa: bool) -> Result<Geometry> {
        let (qs, ks, vs) = (&q.shape, &k.shape, &v.shape);
        let r = qs.len();
        if r < 2 || ks.len() != r || vs.len() != r {
            return Err(Error::invalid_input(format!(
                "q {qs:?}, k {ks:?}, v {vs:?} need one rank of at least 2"
            )));
        }
        let (l, e, s, ev) = (qs[r - 2], qs[r - 1], ks[r - 2], vs[r - 1]);
        if ks[r - 1] != e || vs[r - 2] != s {
            return Err(Error::invalid_input(format!(
                "q {qs:?}, k {ks:?}, v {vs:?} disagree on the embedding or sequence size"
            )));
        }
        if e > MAX_HEAD_DIM || ev > MAX_HEAD_DIM {
            return Err(Error::unsupported(format!(
                "attention head dims {e} and {ev} (the GPU kernel takes at most {MAX_HEAD_DIM})"
            )));
        }
        if l == 0 || e == 0 || ev == 0 {
            return Err(Error::unsupported(format!(
                "empty attention (q {qs:?}, v {vs:?})"
            )));
        }
        let (qb, mut kb, mut vb) = (
            qs[..r - 2].to_vec(),
            ks[..r - 2].to_vec(),
            vs[..r - 2].to_vec(),
        );
        let mut rep = 1;
        if enable_gqa && r >= 3 && kb[r - 3] != qb[r - 3] {
            let (hq, hk) = (qb[r - 3], kb[r - 3]);
            if hk == 0 || hq % hk != 0 || vb[r - 3] != hk {
                return Err(Error::invalid_input(format!(
                    "{hq} query heads cannot share {hk} key/value heads"
                )));
            }
            rep = hq / hk;
            kb[r - 3] = hq;
            vb[r - 3] = hq;
        }
        let batch = broadcast_shapes(&qb, &kb)
            .and_then(|b| broadcast_shapes(&b, &vb))
            .map_err(|err| {
                Error::invalid_input(format!("attention batch dims: {}", err.message()))
            })?;
        Ok(Geometry {
            batch,
            l,
            s,
            e,
            ev,
            rep,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::norm::tests::lower_one;
    use etmetal_core::{DType, Op};

    #[test]
    fn attention_kernels_validate() {
        let f = DType::F32;
        let op = |is_causal, enable_gqa| Op::Sdpa {
            is_causal,
            scale: None,
            enable_gqa,
        };
        // decode with GQA and a bool mask
        lower_one(
            op(false, true),
            &[
                Some((f, &[1, 4, 1, 8])),
                Some((f, &[1, 2, 19, 8])),
                Some((f, &[1, 2, 19, 6])),
                Some((DType::Bool, &[1, 19])),
            ],
        )
        .unwrap();
        // causal prefill in bf16, head dim 256
        lower_one(
            op(true, false),
            &[
                Some((DType::BF16, &[2, 13, 256])),
                Some((DType::BF16, &[2, 13, 256])),
                Some((DType::BF16, &[2, 13, 256])),
            ],
        )
        .unwrap();
        let e = lower_one(
            op(false, false),
            &[
                Some((f, &[2, 3, 300])),
                Some((f, &[2, 5, 300])),
                Some((f, &[2, 5, 4])),
            ],
        )
        .unwrap_err();
        assert!(e.to_string().contains("at most 256"), "{e}");
    }
}
