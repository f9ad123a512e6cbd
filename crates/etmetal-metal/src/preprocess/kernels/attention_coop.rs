//! Flash attention on tensor cores: a payload alternative (see
//! `payload::Alternative`) of the prefill kernel of `attention.rs` for
//! many query rows (prefill, encoders), head dims 64 and 128 (q, k and v
//! alike). Where the portable kernel splits the keys over workgroups,
//! this one takes the same splits and writes the same partials, which the
//! combine kernel merges; over a run-time length it takes the same row
//! buckets, grid order, workgroup counts and end of keys (`Attn::kend`,
//! `block_lets`, `prefill_groups`). Other attentions keep the portable
//! kernel only.
//!
//! A workgroup takes [`BR`] query rows of one batch·head, [`RS`] rows a
//! subgroup, and walks the keys in tiles of `bc` (32 in the 16×16 form, 16
//! in the 8×8 one, whose f32 stages take twice the bytes of Apple's 32 KiB),
//! causal attention stopping at the block's last row. Per tile:
//! 1. the key tile is staged in workgroup memory (`kv`, rows of the head
//!    dim, padded by 16 bytes);
//! 2. each subgroup multiplies its q rows (staged once, `qs`) by the keys,
//!    `S = Q·Kᵀ` as S×S×S products with f32 accumulators, and stores S;
//! 3. one invocation a row scales and masks its scores (as the portable
//!    kernel, `Attn::score`), updates the row's running max and sum (f32)
//!    and writes `P = exp(S − max)` as an operand; meanwhile the value tile
//!    replaces the key tile;
//! 4. each invocation rescales its share of the output rows (held in
//!    registers, f32) by the rows' `exp(old max − new max)`, and the
//!    subgroups add `P·V`, `bc` output columns at a time, through the
//!    score memory.
//!
//! The 16×16 form takes f16 and bf16 attention (f32 would lose its
//! significand in f16). Its operands are scaled into f16's range by powers
//! of two as the GEMM's are (`gemm/coop.rs`, `expo`): each q row and each
//! key row of a tile by its own largest finite |x| (exact, and undone on
//! the f32 score), each value column of a tile by its own, P (in [0, 1])
//! by 2^14, so nothing overflows f16 whatever the data; a q or k element
//! more than 2^28 below its row's largest, or a p below 2^-28, loses
//! precision (P is also rounded to f16's 11 significant bits, as flash
//! attention rounds it to 16 bits). The 8×8 f32 form (Apple) takes every
//! float dtype as it is.

use std::fmt::Write;

use etmetal_core::sym::SymExpr;
use etmetal_core::Result;

use super::{Attn, KeySplit};
use crate::preprocess::coopmat::{CoopForm, CoopMat, Role, SUBGROUP};
use crate::preprocess::emit::{grid, KernelBuilder, FLAT_GROUP};
use crate::preprocess::kernels::gemm::F16_SCALING_WGSL;
use crate::preprocess::lowering::Lowering;
use crate::preprocess::pointwise::float_literal;

/// Query rows of a subgroup.
const RS: usize = 16;
/// Subgroups of a workgroup.
const SUBGROUPS: usize = 2;
/// Query rows of a workgroup.
const BR: usize = RS * SUBGROUPS;
const THREADS: usize = SUBGROUPS * SUBGROUP;
/// Multiply-adds (batch·heads · rows · keys · head dim) below which the
/// portable kernel alone is kept (as for a GEMM).
const MIN_WORK: usize = 1 << 18;
/// The factor P is scaled by before it becomes f16 (undone on P·V).
const P_EXP: i32 = 14;

/// Add the tensor-core forms of prefill dispatch `d` (the portable kernel
/// writing `a`'s output, or with `split` the partials of key splits of
/// `span` keys each, which the combine kernel then merges) where they apply.
pub(super) fn alternatives(
    lw: &mut Lowering,
    a: &Attn,
    d: usize,
    split: &Option<KeySplit>,
    span: usize,
) -> Result<()> {
    let g = &a.g;
    let dtypes = [a.q.dtype, a.k.dtype, a.v.dtype];
    if g.e != g.ev
        || !matches!(g.e, 64 | 128)
        || g.l < BR
        || a.nb * g.l * g.s * g.e < MIN_WORK
        || dtypes.iter().any(|&t| t != dtypes[0])
        // (an alternative has no run-time checks to report)
        || [&a.q, &a.k, &a.v].into_iter().chain(&a.mask).any(|x| x.has_checks())
    {
        return Ok(());
    }
    for form in CoopForm::ALL {
        match form {
            CoopForm::Half16 if super::flash::applies(a) => {
                super::flash::alternatives(lw, a, d, split, span)?
            }
            CoopForm::Half16 => {}
            CoopForm::Float8 => lw.alternative(d, form, |lw| kernel(lw, a, form, split, span))?,
        }
    }
    Ok(())
}

/// The kernel of `form` (see the module comment).
fn kernel(
    lw: &mut Lowering,
    a: &Attn,
    form: CoopForm,
    split: &Option<KeySplit>,
    span: usize,
) -> Result<()> {
    let (l, s, dh) = (a.g.l, a.g.s, a.g.e);
    let size = form.size();
    let (elem, bytes) = form.elem();
    let scaled = form == CoopForm::Half16;
    // keys a tile, and output columns a P·V round (the score memory's width)
    let bc = if scaled { 32 } else { 16 };
    let pad = 16 / bytes;
    let (qp, pp) = (dh + pad, bc + pad);
    let blocks = l.div_ceil(BR);
    let nsplit = split.as_ref().map_or(1, |sp| sp.n);
    let total = a.nb * blocks * nsplit;
    // output elements of a lane per round: row `sl / 2`, half the columns
    let (per_row, oe) = (SUBGROUP / RS, RS * bc / SUBGROUP);
    let rounds = dh / bc;
    let ninf = float_literal(f64::NEG_INFINITY);
    let mut cm = lw.coop_mat(form);
    let mut kb: KernelBuilder = a.builder(lw)?;
    cm.enable(&mut kb);

    let mut m = String::new();
    let _ = writeln!(
        m,
        "var<workgroup> qs: array<{elem}, {}>;\nvar<workgroup> kv: array<{elem}, {}>;\n\
         var<workgroup> sc: array<f32, {}>;\nvar<workgroup> pp: array<{elem}, {}>;\n\
         var<workgroup> rowf: array<f32, {BR}>;",
        BR * qp,
        bc * qp,
        BR * bc,
        BR * pp
    );
    if scaled {
        let _ = writeln!(
            m,
            "var<workgroup> qe: array<i32, {BR}>;\nvar<workgroup> ke: array<i32, {bc}>;\n\
             var<workgroup> ve: array<i32, {dh}>;"
        );
    }
    let _ = writeln!(
        m,
        "@compute @workgroup_size({THREADS})\n\
         fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, \
         @builtin(local_invocation_index) lid: u32{}) {{",
        cm.params()
    );
    m.push_str(&cm.prologue());
    let kend = a.kend(&mut kb, span, BR);
    let _ = write!(
        m,
        "  let g0 = {FLAT_GROUP};\n  if (g0 >= {total}u) {{ return; }}\n\
         \x20 let sp = g0 % {nsplit}u;\n  let g1 = g0 / {nsplit}u;\n  let kbeg = sp * {span}u;\n\
         {}{}\
         \x20 let kend = {kend};\n  let lrow = sl / {per_row}u;\n\
         \x20 let lcol = (sl % {per_row}u) * {oe}u;\n",
        a.block_lets("g1", BR, blocks),
        a.batch_lets()
    );
    // q rows, once
    let qrow = format!("min(i0 + lid, {}u)", l - 1);
    m.push_str(&stage_rows(
        &|col| a.q_at(&qrow, col),
        "qs",
        BR,
        qp,
        dh,
        scaled.then_some("qe"),
        "true",
        elem,
    ));
    let _ = writeln!(
        m,
        "  var m = {ninf};\n  var l = 0.0;\n  var o: array<f32, {}>;",
        rounds * oe
    );
    let _ = writeln!(
        m,
        "  for (var t0 = kbeg; t0 < kend; t0 = t0 + {bc}u) {{\n    workgroupBarrier();"
    );
    // 1. the key tile
    let krow = format!("min(t0 + lid, {}u)", s - 1);
    m.push_str(&indent(&stage_rows(
        &|col| a.k_at(&krow, col),
        "kv",
        bc,
        qp,
        dh,
        scaled.then_some("ke"),
        "t0 + lid < kend",
        elem,
    )));
    m.push_str("    workgroupBarrier();\n");
    // 2. S = Q·Kᵀ, each subgroup its rows
    let (fr, fc) = (RS / size, bc / size);
    m.push_str("    {\n");
    for i in 0..fr {
        for j in 0..fc {
            let _ = writeln!(m, "      var s{i}_{j} = {};", cm.zero());
        }
    }
    let _ = writeln!(
        m,
        "      for (var d0 = 0u; d0 < {dh}u; d0 = d0 + {size}u) {{"
    );
    for i in 0..fr {
        let at = format!("(sg * {RS}u + {}u) * {qp}u + d0", i * size);
        let ld = cm.load(Role::A, "qs", elem, &at, &format!("{qp}u"), true);
        let _ = writeln!(m, "        let qa{i} = {ld};");
    }
    for j in 0..fc {
        let at = format!("{}u + d0", j * size * qp);
        let ld = cm.load(Role::B, "kv", elem, &at, &format!("{qp}u"), false);
        let _ = writeln!(m, "        let kb{j} = {ld};");
    }
    let tiles = Tiles { fr, fc, size, bc };
    tiles.multiply(&mut m, &mut cm, "qa", "kb", "s");
    m.push_str("    }\n    workgroupBarrier();\n");
    // 3. online softmax, one invocation a row; the value tile into kv
    let unscale = if scaled {
        "      x = unscale(x, qe[lid], ke[j]);\n"
    } else {
        ""
    };
    let score = a.score(
        "x",
        &format!("min(i0 + lid, {}u)", l - 1),
        "key",
        "key < kend",
    );
    let p_factor = if scaled {
        float_literal(2f64.powi(P_EXP))
    } else {
        "1.0".into()
    };
    let _ = write!(
        m,
        "    if (lid < {BR}u) {{\n      var mx = m;\n\
         \x20     for (var j = 0u; j < {bc}u; j = j + 1u) {{\n\
         \x20       let key = t0 + j;\n        var x = sc[lid * {bc}u + j];\n{unscale}{}\
         \x20       sc[lid * {bc}u + j] = x;\n        mx = max(mx, x);\n      }}\n\
         \x20     let ms = select(mx, 0.0, mx == {ninf});\n      var sum = 0.0;\n\
         \x20     for (var j = 0u; j < {bc}u; j = j + 1u) {{\n\
         \x20       let p = exp(sc[lid * {bc}u + j] - ms);\n        sum = sum + p;\n\
         \x20       pp[lid * {pp}u + j] = {elem}(p * {p_factor});\n      }}\n\
         \x20     let al = exp(m - ms);\n      l = l * al + sum;\n      m = mx;\n\
         \x20     rowf[lid] = al;\n    }}\n",
        score
            .lines()
            .map(|line| format!("        {line}\n"))
            .collect::<String>()
    );
    m.push_str(&indent(&stage_columns(a, bc, qp, dh, scaled, elem)));
    m.push_str("    workgroupBarrier();\n");
    // 4. the output rows rescaled, plus P·V a round of bc columns at a time
    // (constant indices into `o`: a dynamic one would put it in memory)
    let _ = writeln!(m, "    let al = rowf[sg * {RS}u + lrow];");
    for x in 0..rounds * oe {
        let _ = writeln!(m, "    o[{x}] = o[{x}] * al;");
    }
    for r in 0..rounds {
        m.push_str("    {\n");
        for i in 0..fr {
            for j in 0..fc {
                let _ = writeln!(m, "      var u{i}_{j} = {};", cm.zero());
            }
        }
        let _ = writeln!(
            m,
            "      for (var j0 = 0u; j0 < {bc}u; j0 = j0 + {size}u) {{"
        );
        for i in 0..fr {
            let at = format!("(sg * {RS}u + {}u) * {pp}u + j0", i * size);
            let ld = cm.load(Role::A, "pp", elem, &at, &format!("{pp}u"), true);
            let _ = writeln!(m, "        let pa{i} = {ld};");
        }
        for j in 0..fc {
            let at = format!("j0 * {qp}u + {}u", r * bc + j * size);
            let ld = cm.load(Role::B, "kv", elem, &at, &format!("{qp}u"), true);
            let _ = writeln!(m, "        let vb{j} = {ld};");
        }
        tiles.multiply(&mut m, &mut cm, "pa", "vb", "u");
        m.push_str("    }\n    workgroupBarrier();\n");
        for x in 0..oe {
            let pv = format!("sc[(sg * {RS}u + lrow) * {bc}u + lcol + {x}u]");
            let pv = if scaled {
                format!("unscale({pv}, {P_EXP}, ve[{}u + lcol + {x}u])", r * bc)
            } else {
                pv
            };
            let o = r * oe + x;
            let _ = writeln!(m, "    o[{o}] = o[{o}] + {pv};");
        }
        m.push_str("    workgroupBarrier();\n");
    }
    m.push_str("  }\n");
    // 1 / sum per row (a split's max and sum), then each lane writes its share
    let stats = a.store_stats(&mut kb, split, "i0 + lid")?;
    let _ = writeln!(
        m,
        "  workgroupBarrier();\n  if (lid < {BR}u) {{\n    rowf[lid] = select(0.0, 1.0 / l, l > 0.0);\n\
         \x20   if (i0 + lid < {l}u) {{ {stats} }}\n  }}\n\
         \x20 workgroupBarrier();\n  let inv = rowf[sg * {RS}u + lrow];\n\
         \x20 let orow = i0 + sg * {RS}u + lrow;\n  if (orow < {l}u) {{"
    );
    for r in 0..rounds {
        for x in 0..oe {
            let col = format!("{}u + lcol + {x}u", r * bc);
            let st = a.store_col(&mut kb, split, "orow", &col, &format!("o[{}]", r * oe + x))?;
            let _ = writeln!(m, "    {st}");
        }
    }
    m.push_str("  }\n}\n");
    let helpers = if scaled { F16_SCALING_WGSL } else { "" };
    let built = kb
        .finish(&format!("{helpers}{}{m}", cm.helpers()))
        .tagged(cm.tag());
    let mut storage = bytes * (BR * qp + bc * qp + BR * pp) + 4 * (BR * bc + BR);
    if scaled {
        storage += 4 * (BR + bc + dh);
    }
    let workgroups = grid(total as u64, lw.options.max_workgroups_per_dim)?;
    let splits = (SymExpr::Const(nsplit as i64), nsplit);
    let actual = a.prefill_groups(lw, BR, blocks, &[splits])?;
    let ops = vec![lw.op_label()];
    lw.add_dispatch_sized(
        built,
        ops,
        [THREADS as u32, 1, 1],
        workgroups,
        storage as u32,
        actual,
    )
}

/// A subgroup's `fr × fc` accumulators of `size`-square tiles over `bc`
/// columns of the score array `sc`.
struct Tiles {
    fr: usize,
    fc: usize,
    size: usize,
    bc: usize,
}

impl Tiles {
    /// The products `{acc}i_j += {a}i · {b}j` closing the loop over the
    /// shared dim, then each accumulator stored into the subgroup's rows
    /// of `sc`.
    fn multiply(&self, m: &mut String, cm: &mut CoopMat, a: &str, b: &str, acc: &str) {
        let Tiles { fr, fc, size, bc } = *self;
        for i in 0..fr {
            for j in 0..fc {
                let c = format!("{acc}{i}_{j}");
                let product = cm.mma(&format!("{a}{i}"), &format!("{b}{j}"), &c);
                let _ = writeln!(m, "        {c} = {product};");
            }
        }
        m.push_str("      }\n");
        for i in 0..fr {
            for j in 0..fc {
                let at = format!("(sg * {RS}u + {}u) * {bc}u + {}u", i * size, j * size);
                let st = cm.store(&format!("{acc}{i}_{j}"), "sc", &at, &format!("{bc}u"), true);
                let _ = writeln!(m, "      {st}");
            }
        }
    }
}

/// Statements staging `rows` rows of `dh` columns (`at(col)`, `lid` the
/// row) into workgroup array `dst` (rows `pitch` apart) as `elem`; with
/// `exps`, one invocation a row, scaled into f16's range by 2^expo of its
/// largest finite |x| (written to `exps`); `valid`: the row is in range
/// (else zeros).
#[allow(clippy::too_many_arguments)]
fn stage_rows(
    at: &dyn Fn(&str) -> String,
    dst: &str,
    rows: usize,
    pitch: usize,
    dh: usize,
    exps: Option<&str>,
    valid: &str,
    elem: &str,
) -> String {
    match exps {
        Some(exps) => format!(
            "  if (lid < {rows}u) {{\n    let ok = {valid};\n    var mx = 0u;\n\
             \x20   for (var d = 0u; d < {dh}u; d = d + 1u) {{ mx = max(mx, finite_bits(vec4<f32>({})).x); }}\n\
             \x20   let e = expo(mx);\n    {exps}[lid] = e;\n    let f = pow2(e);\n\
             \x20   for (var d = 0u; d < {dh}u; d = d + 1u) {{ {dst}[lid * {pitch}u + d] = {elem}(select(0.0, {} * f, ok)); }}\n  }}\n",
            at("d"),
            at("d")
        ),
        // (the f32 form: every invocation, a column each)
        None => format!(
            "  for (var t = lid; t < {}u; t = t + {THREADS}u) {{\n\
             \x20   let lid = t / {dh}u;\n    let d = t % {dh}u;\n    let ok = {valid};\n\
             \x20   {dst}[lid * {pitch}u + d] = {elem}(select(0.0, {}, ok));\n  }}\n",
            rows * dh,
            at("d")
        ),
    }
}

/// Statements staging the value tile (keys `t0 …`) into `kv`, rows of
/// `dh` columns `pitch` apart; scaled, one invocation a column, each
/// column by 2^expo of its largest finite |x| in the tile (into `ve`).
fn stage_columns(a: &Attn, bc: usize, pitch: usize, dh: usize, scaled: bool, elem: &str) -> String {
    let vr = format!("min(t0 + j, {}u)", a.g.s - 1);
    let v = a.v_at(&vr, "c");
    if scaled {
        format!(
            "  for (var c = lid; c < {dh}u; c = c + {THREADS}u) {{\n    var mx = 0u;\n\
             \x20   for (var j = 0u; j < {bc}u; j = j + 1u) {{\n\
             \x20     if (t0 + j < kend) {{ mx = max(mx, finite_bits(vec4<f32>({v})).x); }}\n    }}\n\
             \x20   let e = expo(mx);\n    ve[c] = e;\n    let f = pow2(e);\n\
             \x20   for (var j = 0u; j < {bc}u; j = j + 1u) {{\n\
             \x20     kv[j * {pitch}u + c] = {elem}(select(0.0, {v} * f, t0 + j < kend));\n    }}\n  }}\n"
        )
    } else {
        format!(
            "  for (var t = lid; t < {}u; t = t + {THREADS}u) {{\n\
             \x20   let j = t / {dh}u;\n    let c = t % {dh}u;\n\
             \x20   kv[j * {pitch}u + c] = {elem}(select(0.0, {v}, t0 + j < kend));\n  }}\n",
            bc * dh
        )
    }
}

fn indent(s: &str) -> String {
    s.lines().map(|line| format!("  {line}\n")).collect()
}

#[cfg(test)]
mod tests {
    use super::super::super::testing::{
        alternatives_gated_alike, dynamic_input, input, lower_one, lower_one_with, Operand,
    };
    use crate::preprocess::coopmat::CoopForm;
    use crate::preprocess::options::PreprocessOptions;
    use etmetal_core::{DType, Op};

    fn sdpa(is_causal: bool, enable_gqa: bool) -> Op {
        Op::Sdpa {
            is_causal,
            scale: None,
            enable_gqa,
        }
    }

    /// Kernel name tags of the payload's dispatches and of its
    /// alternatives, lowered with `emulate`.
    fn tags(op: Op, operands: Vec<Option<Operand>>, emulate: Option<CoopForm>) -> Vec<String> {
        let options = PreprocessOptions {
            emulate_coop: emulate,
            ..PreprocessOptions::default()
        };
        let p = lower_one_with(op, operands, &options).unwrap().payload;
        let alts = p.dispatches.iter().flat_map(|d| &d.alternatives);
        p.dispatches
            .iter()
            .chain(alts.flat_map(|a| &a.dispatches))
            .map(|d| {
                p.kernels[d.kernel]
                    .name
                    .rsplit('_')
                    .next()
                    .unwrap()
                    .to_string()
            })
            .collect()
    }

    /// Prefill of head dims 64 and 128 gains the tensor-core forms (the
    /// 16×16 one for 16-bit dtypes only), real and emulated, validated by
    /// naga (causal, an additive mask, GQA, split keys); decode, head dim
    /// 80 and small products keep the portable kernel only.
    #[test]
    fn prefill_attention_gains_tensor_core_forms() {
        let (h, b, f) = (DType::F16, DType::BF16, DType::F32);
        let qkv = |t, heads: usize, kv: usize, l: usize, s: usize, d: usize| {
            vec![
                input(t, &[1, heads, l, d]),
                input(t, &[1, kv, s, d]),
                input(t, &[1, kv, s, d]),
            ]
        };
        let mut masked = qkv(b, 4, 4, 100, 150, 128);
        masked.push(input(b, &[1, 1, 100, 150]));
        let cases = [
            (sdpa(false, false), qkv(b, 8, 8, 150, 150, 64), true),
            (sdpa(true, true), qkv(h, 8, 2, 130, 130, 128), true),
            (sdpa(false, false), masked, true),
            (sdpa(true, false), qkv(f, 8, 8, 150, 150, 64), false),
        ];
        for (op, operands, sixteen) in cases {
            let name = format!("{op:?} {}", operands[0].as_ref().unwrap().dtype);
            let real = tags(op.clone(), operands.clone(), None);
            let want: &[&str] = if sixteen {
                &["coop", "coop8x8"]
            } else {
                &["coop8x8"]
            };
            assert!(
                real.ends_with(&want.iter().map(|s| s.to_string()).collect::<Vec<_>>()),
                "{name}: {real:?}"
            );
            for form in CoopForm::ALL {
                let emulated = tags(op.clone(), operands.clone(), Some(form));
                let expect = (form == CoopForm::Float8 || sixteen).then_some(form.emulated_tag());
                assert_eq!(
                    emulated
                        .iter()
                        .find(|t| t.ends_with("emu"))
                        .map(|s| s.as_str()),
                    expect,
                    "{name} {form:?}: {emulated:?}"
                );
            }
        }
        for operands in [
            qkv(b, 8, 8, 3, 1500, 64),
            qkv(b, 8, 8, 150, 150, 80),
            qkv(b, 1, 1, 40, 40, 64),
            qkv(b, 1, 1, 31, 4096, 64),
        ] {
            let got = tags(sdpa(false, false), operands, None);
            assert!(got.iter().all(|t| !t.starts_with("coop")), "{got:?}");
        }
    }
    /// Causal GQA prefill over a run-time length: each row bucket's
    /// portable kernel gains both forms, running in its bucket only, their
    /// keys ending at the run-time length (the sizes uniform).
    #[test]
    fn dynamic_prefill_gains_tensor_core_forms() {
        let b = DType::BF16;
        let operands = vec![
            dynamic_input(b, &[1, 8, 512, 64], 2),
            dynamic_input(b, &[1, 2, 512, 64], 2),
            dynamic_input(b, &[1, 2, 512, 64], 2),
        ];
        let p = lower_one(sdpa(true, true), operands).unwrap().payload;
        let sizes = [1, 64, 65, 256, 257, 512];
        assert_eq!(alternatives_gated_alike(&p, &sizes), 3, "buckets");
        for d in p.dispatches.iter().filter(|d| !d.alternatives.is_empty()) {
            // the 16×16 form's variants, then the 8×8 form
            assert!(d.alternatives.len() >= 2, "{}", d.alternatives.len());
            assert!(d.alternatives.iter().any(|a| a.needs.m == 16));
            for alt in &d.alternatives {
                let k = &p.kernels[alt.dispatches.last().unwrap().kernel];
                assert!(k.wgsl.contains("sz.v"), "{}", k.name);
                assert!(alt.dispatches.last().unwrap().groups.is_some());
            }
        }
    }
}
