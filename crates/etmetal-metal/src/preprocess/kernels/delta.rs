//! Qwen3.5's gated delta rule ([`Op::GatedDeltaRule`]) on the GPU. Row `r`
//! of a head's state `S [Dv, Dk]` evolves on its own: per step it decays
//! by `g`, reads `mem = S[r]·k`, adds `k * (v[r] - mem) * beta` and gives
//! `y[r] = S[r]·q`. So one invocation runs one state row through all T
//! steps in registers (Dk floats), with no barrier and no workgroup memory,
//! and writes the row's final state once.
//!
//! [`Op::GatedDeltaRule`]: etmetal_core::Op::GatedDeltaRule

use etmetal_core::{Error, Result};
use etmetal_graph::Node;

use crate::preprocess::emit::{entry, grid, KernelBuilder, FLAT_GROUP, FLAT_WORKGROUP};
use crate::preprocess::lowering::Lowering;

pub(super) fn lower(lw: &mut Lowering, node: &Node) -> Result<()> {
    let views = (0..6)
        .map(|i| lw.input_view(node, i))
        .collect::<Result<Vec<_>>>()?;
    let [b, t, hk, dk] = views[0].shape[..] else {
        return Err(Error::invalid_input(format!("q {:?}", views[0].shape)));
    };
    let [_, _, hv, dv] = views[2].shape[..] else {
        return Err(Error::invalid_input(format!("v {:?}", views[2].shape)));
    };
    if hk == 0 || hv % hk != 0 {
        return Err(Error::invalid_input(format!(
            "{hk} key heads for {hv} value heads"
        )));
    }
    let y = lw.output_buffer(node, 0)?;
    let state = lw.output_buffer(node, 1)?;
    let mut kb = KernelBuilder::new(&lw.buffers);
    for (v, name) in views.iter().zip(["q", "k", "v", "g", "beta", "s0"]) {
        kb.value_fn(v, name)?;
    }
    let store_y = kb.store(
        y,
        &format!("((bi * {t}u + ti) * {hv}u + h) * {dv}u + r"),
        "acc",
    )?;
    let store_s = kb.store(
        state,
        &format!("((bi * {hv}u + h) * {dv}u + r) * {dk}u + c"),
        "s[c]",
    )?;
    let rows = b * hv * dv;
    let mut main = entry(FLAT_WORKGROUP);
    main.push_str(&format!(
        "  let id = {FLAT_GROUP} * {FLAT_WORKGROUP}u + lid;\n  if (id >= {rows}u) {{ return; }}\n\
         \x20 let r = id % {dv}u;\n  let h = (id / {dv}u) % {hv}u;\n  let bi = id / ({dv}u * {hv}u);\n\
         \x20 let kh = h / {rep}u;\n\
         \x20 var s: array<f32, {dk}>;\n\
         \x20 for (var c = 0u; c < {dk}u; c = c + 1u) {{ s[c] = s0(bi, h, r, c); }}\n\
         \x20 for (var ti = 0u; ti < {t}u; ti = ti + 1u) {{\n\
         \x20   let gt = g(bi, ti, h);\n    let bt = beta(bi, ti, h);\n\
         \x20   var mem = 0.0;\n\
         \x20   for (var c = 0u; c < {dk}u; c = c + 1u) {{ s[c] = s[c] * gt; mem = mem + s[c] * k(bi, ti, kh, c); }}\n\
         \x20   let delta = (v(bi, ti, h, r) - mem) * bt;\n\
         \x20   var acc = 0.0;\n\
         \x20   for (var c = 0u; c < {dk}u; c = c + 1u) {{\n\
         \x20     s[c] = s[c] + k(bi, ti, kh, c) * delta;\n      acc = acc + s[c] * q(bi, ti, kh, c);\n    }}\n\
         \x20   {store_y}\n\
         \x20 }}\n\
         \x20 for (var c = 0u; c < {dk}u; c = c + 1u) {{ {store_s} }}\n}}\n",
        rep = hv / hk,
    ));
    let workgroups = grid(
        (rows as u64).div_ceil(u64::from(FLAT_WORKGROUP)),
        lw.options.max_workgroups_per_dim,
    )?;
    let ops = vec![lw.op_label()];
    lw.add_dispatch(kb.finish(&main), ops, [FLAT_WORKGROUP, 1, 1], workgroups, 0)
}
