//! Convolution (1-D and 2-D, not transposed: stride, padding, dilation,
//! groups, optional bias) and pooling (max without indices, average,
//! adaptive average; 1-D and 2-D).
//!
//! A convolution with enough output channels per group is an implicit
//! GEMM on the GEMM family ([`super::gemm`]): per group, `weight[cout_g,
//! cin_g·k]` times the input patches `[cin_g·k, n·out_spatial]`, the patch
//! matrix read straight from the input (padding read as zeros, never
//! materialised) by [`ConvArgs`].
//! Depthwise and other narrow convolutions, and every pooling, are direct
//! kernels: one invocation per output element looping over its window.

use std::fmt::Write;

use etmetal_core::sym::SymExpr;
use etmetal_core::{AvgPoolAttrs, ConvAttrs, DType, Error, MaxPoolAttrs, Op, PoolWindow, Result};
use etmetal_graph::Node;

use super::epilogue::Tail;
use super::gemm::{Epilogue, F16Scaling, Gemm, GemmArgs};
use crate::preprocess::emit::{entry, grid, unravel, KernelBuilder, FLAT_GROUP, FLAT_WORKGROUP};
use crate::preprocess::expr::{reshaped, LazyRef};
use crate::preprocess::lowering::Lowering;
use crate::preprocess::pointwise::{cast, float_literal};
use crate::preprocess::sizes::extent;

/// Output channels per group from which a convolution is a GEMM (fewer
/// leave most of a GEMM tile idle).
const GEMM_MIN_COUT: usize = 8;

pub(super) fn lower(lw: &mut Lowering, node: &Node) -> Result<()> {
    match &node.op {
        Op::Convolution(ConvAttrs {
            stride,
            padding,
            dilation,
            groups,
            transposed: false,
            ..
        }) => convolution(lw, node, stride, padding, dilation, *groups),
        Op::MaxPool(MaxPoolAttrs {
            kernel,
            stride,
            padding,
            dilation,
            with_indices: false,
            ..
        }) => {
            let window = Window::new(kernel, stride, padding, dilation)?;
            pool(lw, node, Pool::Max(window))
        }
        Op::AvgPool(AvgPoolAttrs {
            kernel,
            stride,
            padding,
            count_include_pad,
            divisor_override,
            ..
        }) => {
            let window = Window::new(kernel, stride, padding, &[])?;
            if *divisor_override == Some(0) {
                return Err(Error::invalid_input("divisor_override must be non-zero"));
            }
            pool(
                lw,
                node,
                Pool::Avg {
                    window,
                    count_include_pad: *count_include_pad,
                    divisor_override: *divisor_override,
                },
            )
        }
        Op::AdaptiveAvgPool { .. } => pool(lw, node, Pool::Adaptive),
        other => Err(Error::unsupported(format!(
            "{} has no GPU kernel ({other:?})",
            other.name()
        ))),
    }
}

/// The f32 read of a lazy value (floats only: the GPU computes these ops
/// in f32).
fn check_float(x: &LazyRef, what: &str) -> Result<()> {
    if x.dtype.is_float() {
        Ok(())
    } else {
        Err(Error::unsupported(format!(
            "{what} of {} on the GPU (float dtypes only)",
            x.dtype.name()
        )))
    }
}

/// `let` statements naming the multi-index of flat index `lin` in
/// `shape` (`{prefix}0`, …); the names.
fn unravel_lets(s: &mut String, lin: &str, shape: &[usize], prefix: &str) -> Vec<String> {
    unravel(lin, shape)
        .into_iter()
        .enumerate()
        .map(|(d, e)| {
            let name = format!("{prefix}{d}");
            let _ = writeln!(s, "  let {name} = {e};");
            name
        })
        .collect()
}

fn convolution(
    lw: &mut Lowering,
    node: &Node,
    stride: &[usize],
    padding: &[usize],
    dilation: &[usize],
    groups: usize,
) -> Result<()> {
    let x = lw.input_view(node, 0)?;
    let w = lw.input_view(node, 1)?;
    let bias = lw.optional_input_view(node, 2)?;
    let sr = stride.len();
    let (_, _, oshape) = lw.output_info(node, 0)?;
    if w.shape.len() != sr + 2
        || x.shape.len() < sr + 1
        || oshape.len() != x.shape.len()
        || padding.len() != sr
        || dilation.len() != sr
        || groups == 0
        || stride.contains(&0)
        || dilation.contains(&0)
    {
        return Err(Error::invalid_input(format!(
            "convolution of {:?} by {:?} with stride {stride:?}, padding {padding:?}, \
             dilation {dilation:?}, groups {groups}",
            x.shape, w.shape
        )));
    }
    for (v, what) in [
        (Some(&x), "input"),
        (Some(&w), "weight"),
        (bias.as_ref(), "bias"),
    ] {
        if let Some(v) = v {
            check_float(v, &format!("convolution {what}"))?;
        }
    }
    let lead = x.shape.len() - sr - 1;
    let n: usize = x.shape[..lead].iter().product();
    let cin = x.shape[lead];
    let insp = x.shape[lead + 1..].to_vec();
    let cout = w.shape[0];
    let ksp = w.shape[2..].to_vec();
    let osp = oshape[lead + 1..].to_vec();
    if cin != w.shape[1] * groups || cout % groups != 0 || oshape[lead] != cout {
        return Err(Error::invalid_input(format!(
            "convolution input {:?} and weight {:?} disagree on channels with {groups} groups",
            x.shape, w.shape
        )));
    }
    let (cin_g, cout_g) = (cin / groups, cout / groups);
    let (ks, os): (usize, usize) = (ksp.iter().product(), osp.iter().product());
    // the input as [n, cin, spatial…], the weight as [cout, cin_g·k]
    let x = reshaped(&x, [vec![n, cin], insp.clone()].concat());
    let w2 = reshaped(&w, vec![cout, cin_g * ks]);
    let gemm = cout_g >= GEMM_MIN_COUT;
    let coop = F16Scaling::of(lw, &w2)
        .zip(F16Scaling::of(lw, &x))
        .map(|(a, b)| [a, b])
        .filter(|_| gemm);
    let mut reads = vec![];
    for v in [Some(&x), Some(&w), bias.as_ref()].into_iter().flatten() {
        v.buffers(&mut reads);
    }
    // the tensor-core kernel binds the exponents of operands scaled at run time
    let lines = coop.map_or(0, |c| c.iter().filter(|&&s| s == F16Scaling::Lines).count());
    let epilogue = Tail::plan(lw, node, &reads, lines, &[])?;
    if n * cout * os == 0 {
        return Ok(());
    }

    let patch = Patch {
        stride,
        padding,
        dilation,
        input: &insp,
    };
    if gemm {
        let gemm = Gemm {
            batch: groups,
            m: cout_g,
            n: n * os,
            k: cin_g * ks,
            a_k_fast: true,
            b_k_fast: false,
            coop,
            // a dynamic batch: the columns are images × output positions
            dynamic: node.inputs[0].filter(|&v| lw.graph.is_dynamic(v)).map(|v| {
                let dims = lw.sizes.local(&lw.graph.sym_dims(v));
                let bounds = lw.graph.value(v).shape.iter().copied();
                let dims: Vec<(SymExpr, usize)> = dims.into_iter().zip(bounds).collect();
                let images = extent(&dims[..lead]);
                let c = |n: usize| SymExpr::Const(n as i64);
                [c(groups), c(cout_g), images * c(os)]
            }),
        };
        let args = ConvArgs {
            w: w2,
            x,
            bias,
            patch,
            cout,
            cout_g,
            cin_g,
            kernel: &ksp,
            output: &osp,
            epilogue: &epilogue,
        };
        return gemm.lower(lw, &args);
    }

    // direct: one invocation per output element [n, cout, spatial…]
    let mut kb = KernelBuilder::new(&lw.buffers);
    kb.value_fn(&x, "vx")?;
    kb.value_fn(&w, "vw")?;
    let total = n * cout * os;
    let mut s = entry(FLAT_WORKGROUP);
    let _ = writeln!(
        s,
        "  let e = {FLAT_GROUP} * {FLAT_WORKGROUP}u + lid;\n  if (e >= {total}u) {{ return; }}"
    );
    let _ = writeln!(
        s,
        "  let img = e / {}u;\n  let co = (e / {os}u) % {cout}u;\n  let ci0 = co / {cout_g}u * {cin_g}u;",
        cout * os
    );
    unravel_lets(&mut s, &format!("(e % {os}u)"), &osp, "o");
    let _ = writeln!(
        s,
        "  var acc = 0.0;\n  for (var ci = 0u; ci < {cin_g}u; ci = ci + 1u) {{\n\
         \x20 for (var kk = 0u; kk < {ks}u; kk = kk + 1u) {{"
    );
    let ks_names = unravel_lets(&mut s, "kk", &ksp, "k");
    let (at, inside) = patch.emit(&mut s);
    let _ = writeln!(
        s,
        "  if ({inside}) {{ acc = fma(vx(img, ci0 + ci, {}), vw(co, ci, {}), acc); }}\n  }}\n  }}",
        at.join(", "),
        ks_names.join(", ")
    );
    let mut value = "acc".to_string();
    if let Some(b) = &bias {
        kb.value_fn(b, "vbias")?;
        value = "acc + vbias(co)".into();
    }
    let (decls, store) = epilogue.store(&mut kb, "e", &value, "")?;
    let _ = writeln!(s, "  {store}\n}}");
    let built = kb.finish(&format!("{decls}{s}"));
    flat_dispatch(lw, built, total, epilogue.out)
}

/// Where a convolution reads its input: spatial dim `d` of the input
/// from output position `o{d}` and kernel offset `k{d}`.
struct Patch<'a> {
    stride: &'a [usize],
    padding: &'a [usize],
    dilation: &'a [usize],
    /// The input's spatial dims.
    input: &'a [usize],
}

impl Patch<'_> {
    /// The statements computing the input position (into `s`), the
    /// clamped index of each dim and the in-range condition.
    fn emit(&self, s: &mut String) -> (Vec<String>, String) {
        let mut names = vec![];
        let mut inside = vec![];
        for d in 0..self.stride.len() {
            let _ = writeln!(
                s,
                "  let p{d} = i32(o{d} * {}u + k{d} * {}u) - {}i;",
                self.stride[d], self.dilation[d], self.padding[d]
            );
            inside.push(format!("p{d} >= 0i && p{d} < {}i", self.input[d]));
            names.push(format!(
                "u32(clamp(p{d}, 0i, {}i))",
                self.input[d].max(1) - 1
            ));
        }
        (names, inside.join(" && "))
    }
}

/// A convolution as an implicit GEMM per group: A is the weight as
/// `[cout, cin_g·k]`, B the input patches `[cin_g·k, n·out_spatial]` read
/// straight from the input (padding read as zeros), and the store adds the
/// bias and writes `[n, cout, spatial…]`.
struct ConvArgs<'a> {
    /// `[cout, cin_g·k]`.
    w: LazyRef,
    /// `[n, cin, spatial…]`.
    x: LazyRef,
    bias: Option<LazyRef>,
    patch: Patch<'a>,
    cout: usize,
    /// Output and input channels of a group.
    cout_g: usize,
    cin_g: usize,
    /// The kernel's and the output's spatial dims.
    kernel: &'a [usize],
    output: &'a [usize],
    /// The store, and the pointwise chain after it.
    epilogue: &'a Tail,
}

impl Epilogue for ConvArgs<'_> {
    fn store(&self, kb: &mut KernelBuilder) -> Result<String> {
        let (cout, cout_g) = (self.cout, self.cout_g);
        let os: usize = self.output.iter().product();
        let mut value = "v".to_string();
        if let Some(b) = &self.bias {
            kb.value_fn(b, "vbias")?;
            value = "v + vbias(co)".into();
        }
        let (decls, store) = self.epilogue.store(kb, "e", &value, "")?;
        Ok(format!(
            "{decls}fn gstore(bt: u32, r: u32, c: u32, v: f32) {{\n\
             \x20 let co = bt * {cout_g}u + r;\n\
             \x20 let e = (c / {os}u * {cout}u + co) * {os}u + c % {os}u;\n  {store}\n}}\n"
        ))
    }
}

impl GemmArgs for ConvArgs<'_> {
    fn elements(&self, kb: &mut KernelBuilder) -> Result<String> {
        let (cout_g, cin_g) = (self.cout_g, self.cin_g);
        let os: usize = self.output.iter().product();
        let ks: usize = self.kernel.iter().product();
        kb.value_fn(&self.w, "vw")?;
        kb.value_fn(&self.x, "vx")?;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "fn ga(bt: u32, r: u32, k: u32) -> f32 {{ return vw(bt * {cout_g}u + r, k); }}"
        );
        s.push_str("fn gb(bt: u32, k: u32, c: u32) -> f32 {\n");
        let _ = writeln!(
            s,
            "  let img = c / {os}u;\n  let ci = bt * {cin_g}u + k / {ks}u;"
        );
        unravel_lets(&mut s, &format!("(c % {os}u)"), self.output, "o");
        unravel_lets(&mut s, &format!("(k % {ks}u)"), self.kernel, "k");
        let (at, inside) = self.patch.emit(&mut s);
        let _ = writeln!(
            s,
            "  return select(0.0, vx(img, ci, {}), {inside});\n}}",
            at.join(", ")
        );
        Ok(s)
    }
}

/// A kernel of one invocation per element of `out` (row-major), `total`
/// of them at the bound.
fn flat_dispatch(
    lw: &mut Lowering,
    built: crate::preprocess::emit::Built,
    total: usize,
    out: usize,
) -> Result<()> {
    let groups = (total as u64).div_ceil(u64::from(FLAT_WORKGROUP));
    let workgroups = grid(groups, lw.options.max_workgroups_per_dim)?;
    let actual = lw
        .sizes
        .groups(&lw.grid_dims(out), FLAT_WORKGROUP as usize)?;
    let ops = vec![lw.op_label()];
    lw.add_dispatch_sized(built, ops, [FLAT_WORKGROUP, 1, 1], workgroups, 0, actual)
}

/// Per-spatial-dim window of a (non-adaptive) pooling.
struct Window {
    kernel: Vec<usize>,
    stride: Vec<usize>,
    padding: Vec<usize>,
    dilation: Vec<usize>,
}

impl Window {
    /// One entry per spatial dim ([`PoolWindow::new`]).
    fn new(
        kernel: &[usize],
        stride: &[usize],
        padding: &[usize],
        dilation: &[usize],
    ) -> Result<Window> {
        let PoolWindow {
            kernel,
            stride,
            padding,
            dilation,
            ..
        } = PoolWindow::new(kernel, stride, padding, dilation, false)
            .map_err(|e| Error::invalid_input(e.message()))?;
        let w = Window {
            kernel,
            stride,
            padding,
            dilation,
        };
        if w.kernel.contains(&0) || w.stride.contains(&0) || w.dilation.contains(&0) {
            return Err(Error::invalid_input(format!(
                "pooling kernel {:?}, stride {:?}, dilation {:?} must be positive",
                w.kernel, w.stride, w.dilation
            )));
        }
        Ok(w)
    }
}

enum Pool {
    Max(Window),
    Avg {
        window: Window,
        count_include_pad: bool,
        divisor_override: Option<i64>,
    },
    Adaptive,
}

/// One invocation per output element of `[planes, out_spatial…]`, looping
/// over its window of the input `[planes, in_spatial…]`.
fn pool(lw: &mut Lowering, node: &Node, kind: Pool) -> Result<()> {
    let x = lw.input_view(node, 0)?;
    check_float(&x, "pooling")?;
    let (_, _, oshape) = lw.output_info(node, 0)?;
    let sr = match &kind {
        Pool::Max(w) | Pool::Avg { window: w, .. } => w.kernel.len(),
        Pool::Adaptive => match &node.op {
            Op::AdaptiveAvgPool { output_size } => output_size.len(),
            _ => 0,
        },
    };
    if sr == 0 || x.shape.len() < sr + 1 || oshape.len() != x.shape.len() {
        return Err(Error::invalid_input(format!(
            "{sr}-d pooling of {:?} into {oshape:?}",
            x.shape
        )));
    }
    let lead = x.shape.len() - sr;
    let planes: usize = x.shape[..lead].iter().product();
    let insp = x.shape[lead..].to_vec();
    let osp = oshape[lead..].to_vec();
    let x = reshaped(&x, [vec![planes], insp.clone()].concat());
    let out = lw.output_buffer(node, 0)?;
    let out_dtype = lw.buffers.list[out].dtype;
    if !out_dtype.is_float() {
        return Err(Error::unsupported("pooling into a non-float dtype"));
    }
    let os: usize = osp.iter().product();
    let total = planes * os;
    if total == 0 {
        return Ok(());
    }
    let mut kb = KernelBuilder::new(&lw.buffers);
    kb.value_fn(&x, "vx")?;
    let mut s = String::new();
    s.push_str(&entry(FLAT_WORKGROUP));
    let _ = writeln!(
        s,
        "  let e = {FLAT_GROUP} * {FLAT_WORKGROUP}u + lid;\n  if (e >= {total}u) {{ return; }}\n\
         \x20 let plane = e / {os}u;"
    );
    unravel_lets(&mut s, &format!("(e % {os}u)"), &osp, "o");
    // window bounds lo{d}..hi{d} (i32) over the input of each spatial dim
    let step = |d: usize, kind: &Pool| match kind {
        Pool::Max(w) => w.dilation[d],
        _ => 1,
    };
    match &kind {
        Pool::Max(w) | Pool::Avg { window: w, .. } => {
            for d in 0..sr {
                let _ = writeln!(
                    s,
                    "  let st{d} = i32(o{d} * {}u) - {}i;\n  let en{d} = st{d} + {}i;",
                    w.stride[d],
                    w.padding[d],
                    w.dilation[d] * (w.kernel[d] - 1) + 1
                );
            }
        }
        Pool::Adaptive => {
            for d in 0..sr {
                let (i, o) = (insp[d], osp[d]);
                let _ = writeln!(
                    s,
                    "  let st{d} = i32(o{d} * {i}u / {o}u);\n  let en{d} = i32(((o{d} + 1u) * {i}u + {}u) / {o}u);",
                    o - 1
                );
            }
        }
    }
    for (d, n) in insp.iter().enumerate() {
        // max pool: first in-range tap of the dilated window
        let st = step(d, &kind);
        let lo = if st == 1 {
            format!("max(st{d}, 0i)")
        } else {
            format!(
                "select(st{d}, st{d} + ((-st{d} + {}i) / {st}i) * {st}i, st{d} < 0i)",
                st - 1
            )
        };
        let _ = writeln!(s, "  let lo{d} = {lo};\n  let hi{d} = min(en{d}, {n}i);");
    }
    let (init, body) = match &kind {
        Pool::Max(_) => (
            float_literal(f64::NEG_INFINITY),
            // NaN wins and stays, as in PyTorch; tested on the bits, as
            // drivers may fold `v != v` to false
            "if (!is_nan(acc) && (v > acc || is_nan(v))) { acc = v; }",
        ),
        _ => ("0.0".to_string(), "acc = acc + v;"),
    };
    let _ = writeln!(s, "  var acc = {init};");
    let idx: Vec<String> = (0..sr).map(|d| format!("u32(j{d})")).collect();
    for d in 0..sr {
        let _ = writeln!(
            s,
            "  for (var j{d} = lo{d}; j{d} < hi{d}; j{d} = j{d} + {}i) {{",
            step(d, &kind)
        );
    }
    let _ = writeln!(s, "  let v = vx(plane, {});\n  {body}", idx.join(", "));
    for _ in 0..sr {
        s.push_str("  }\n");
    }
    let result = match &kind {
        Pool::Max(_) => "acc".to_string(),
        Pool::Avg {
            window,
            count_include_pad,
            divisor_override,
        } => {
            let divisor = match divisor_override {
                Some(v) => float_literal(*v as f64),
                None => {
                    // count_include_pad: the window clipped to the padded
                    // input; otherwise to the input
                    let terms: Vec<String> = insp
                        .iter()
                        .zip(&window.padding)
                        .enumerate()
                        .map(|(d, (n, p))| {
                            if *count_include_pad {
                                format!("(min(en{d}, {}i) - st{d})", n + p)
                            } else {
                                format!("(hi{d} - lo{d})")
                            }
                        })
                        .collect();
                    format!("f32({})", terms.join(" * "))
                }
            };
            format!("acc / {divisor}")
        }
        Pool::Adaptive => {
            let terms: Vec<String> = (0..sr).map(|d| format!("(en{d} - st{d})")).collect();
            format!("acc / f32({})", terms.join(" * "))
        }
    };
    let value = cast(&format!("({result})"), DType::F32, out_dtype);
    let store = kb.store(out, "e", &value)?;
    let _ = writeln!(s, "  {store}\n}}");
    let built = kb.finish(&s);
    flat_dispatch(lw, built, total, out)
}

#[cfg(test)]
mod tests {
    use etmetal_core::{AvgPoolAttrs, ConvAttrs, DType, MaxPoolAttrs, Op};

    use super::super::testing::{input, lower_one, weight};

    fn conv(stride: &[usize], padding: &[usize], dilation: &[usize], groups: usize) -> Op {
        Op::Convolution(ConvAttrs {
            stride: stride.to_vec(),
            padding: padding.to_vec(),
            dilation: dilation.to_vec(),
            transposed: false,
            output_padding: vec![0; stride.len()],
            groups,
        })
    }

    #[test]
    fn convolutions_and_pools_validate() {
        let f = DType::F32;
        let cases = vec![
            // direct (depthwise) and implicit GEMM, 1-D and 2-D
            (
                conv(&[1, 2], &[1, 0], &[1, 2], 3),
                vec![
                    input(f, &[2, 3, 9, 11]),
                    weight(f, &[3, 1, 3, 2]),
                    weight(f, &[3]),
                ],
            ),
            (
                conv(&[2], &[1], &[1], 2),
                vec![
                    input(DType::BF16, &[1, 4, 17]),
                    weight(DType::BF16, &[16, 2, 3]),
                    None,
                ],
            ),
            (
                Op::MaxPool(MaxPoolAttrs {
                    kernel: vec![3, 2],
                    stride: vec![2, 1],
                    padding: vec![1, 1],
                    dilation: vec![2, 1],
                    ceil_mode: true,
                    with_indices: false,
                }),
                vec![input(f, &[2, 3, 9, 8])],
            ),
            (
                Op::AvgPool(AvgPoolAttrs {
                    kernel: vec![3],
                    stride: vec![2],
                    padding: vec![1],
                    ceil_mode: false,
                    count_include_pad: false,
                    divisor_override: None,
                }),
                vec![input(f, &[3, 10])],
            ),
            (
                Op::AdaptiveAvgPool {
                    output_size: vec![3, 2],
                },
                vec![input(f, &[1, 2, 7, 5])],
            ),
        ];
        for (op, operands) in cases {
            let name = format!("{op:?}");
            lower_one(op, operands).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }

    /// What the partitioner refuses (transposed convolution, pooling with
    /// indices) is a typed error here too, never a wrong kernel.
    #[test]
    fn transposed_convolution_and_indices_are_errors() {
        let f = DType::F32;
        let mut op = conv(&[1], &[0], &[1], 1);
        if let Op::Convolution(ConvAttrs { transposed, .. }) = &mut op {
            *transposed = true;
        }
        let err = lower_one(op, vec![input(f, &[1, 2, 5]), weight(f, &[2, 2, 1])]).unwrap_err();
        assert_eq!(err.kind(), etmetal_core::ErrorKind::Unsupported, "{err}");
        let pool = Op::MaxPool(MaxPoolAttrs {
            kernel: vec![2],
            stride: vec![2],
            padding: vec![0],
            dilation: vec![1],
            ceil_mode: false,
            with_indices: true,
        });
        let err = lower_one(pool, vec![input(f, &[1, 2, 6])]).unwrap_err();
        assert_eq!(err.kind(), etmetal_core::ErrorKind::Unsupported, "{err}");
    }
}
