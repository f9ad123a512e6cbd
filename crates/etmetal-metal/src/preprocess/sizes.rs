//! Run-time sizes of a bounded-dynamic partition (payload 1.3).
//!
//! Every buffer keeps the layout of its upper bound (row-major strides of
//! the bound shape), so no index expression changes with the size: an
//! element's position is the same at any size, and the elements past the
//! actual size are never read into a valid one by the kernels the
//! partitioner lets through (no reduction or contraction over a dynamic
//! dim, no index counted from a dynamic end). What does change is how much
//! of each grid is worth running: [`Sizes::groups`] gives a dispatch's
//! workgroup count at the actual sizes, and the few kernels that need a
//! size in their arithmetic read it from the sizes uniform
//! ([`Sizes::wgsl`]).

use std::collections::HashMap;

use etmetal_core::sym::SymExpr;
use etmetal_core::{Error, Result};
use etmetal_graph::{Graph, ValueId};

use crate::payload::{Size, Symbol};

/// Symbols one sizes uniform holds (`array<vec4<u32>, 4>`).
pub(crate) const MAX_SYMBOLS: usize = 16;

/// The uniform's declaration, bound at `binding`.
pub(crate) fn uniform_decl(binding: usize) -> String {
    format!(
        "struct Sizes {{ v: array<vec4<u32>, {}> }}\n\
         @group(0) @binding({binding}) var<uniform> sz: Sizes;\n",
        MAX_SYMBOLS / 4
    )
}

/// The symbols of a partition, each read from a dim of one of its inputs.
#[derive(Default)]
pub(crate) struct Sizes {
    pub symbols: Vec<Symbol>,
    names: Vec<String>,
    /// The input dim each symbol is.
    exprs: Vec<SymExpr>,
}

impl Sizes {
    /// A symbol for every distinct dynamic dim of a partition input (its
    /// first such dim): the program's symbol where the dim is one or an
    /// affine size of one (`2*s7`, read back as `(dim - offset) / scale`),
    /// else the dim's expression itself (`(s0 // 2 + -3) // 2`, the size of
    /// a convolution's output), which [`Sizes::local`] puts in place of
    /// that expression wherever a buffer has it as a dim.
    pub fn of_inputs(graph: &Graph, inputs: &[ValueId]) -> Result<Sizes> {
        let mut s = Sizes::default();
        for (k, &v) in inputs.iter().enumerate() {
            let Some(dims) = graph.sym.dims.get(&v) else {
                continue;
            };
            for (d, e) in dims.iter().enumerate() {
                let syms = e.symbols();
                let affine = match syms.as_slice() {
                    [one] => e
                        .affine_in(one)
                        .filter(|&(a, _)| a > 0)
                        .map(|ab| (one.to_string(), ab)),
                    _ => None,
                };
                let (name, expr, (scale, offset)) = match affine {
                    Some((name, ab)) => (name.clone(), SymExpr::sym(name), ab),
                    None if e.as_const().is_some() => continue,
                    None => (e.to_string(), e.clone(), (1, 0)),
                };
                if s.names.contains(&name) {
                    continue;
                }
                let (lo, hi) = expr.bounds(&graph.sym.ranges)?;
                if s.names.len() == MAX_SYMBOLS {
                    return Err(Error::unsupported(format!(
                        "a GPU partition with more than {MAX_SYMBOLS} dynamic sizes"
                    )));
                }
                s.names.push(name.clone());
                s.exprs.push(expr);
                s.symbols.push(Symbol {
                    name,
                    input: k,
                    dim: d,
                    scale,
                    offset,
                    // torch.export writes a range from 2 where the program
                    // was asked for 1 (its 0/1 specialisation), and a size
                    // of 1 runs like any other
                    min: lo.min(1),
                    max: hi,
                });
            }
        }
        Ok(s)
    }

    /// `dims` of a buffer with each dim that is an input dim's expression
    /// written as that input's symbol.
    pub fn local(&self, dims: &[SymExpr]) -> Vec<SymExpr> {
        dims.iter()
            .map(|e| match self.exprs.iter().position(|x| x == e) {
                Some(i) => SymExpr::sym(self.names[i].clone()),
                None => e.clone(),
            })
            .collect()
    }

    /// `e` over the bound symbols; an error naming it when a symbol is not
    /// the size of an input dim of the partition.
    pub fn size(&self, e: &SymExpr) -> Result<Size> {
        Size::of(e, &self.names).ok_or_else(|| {
            Error::unsupported(format!(
                "dynamic size `{e}`: its symbols are not all sizes of the GPU partition's inputs"
            ))
        })
    }

    /// The workgroup count that covers the valid part of a flat grid laid
    /// out row-major over `dims`, each `(actual count, count at the bound)`,
    /// `per` cells a workgroup: from its first cell to the last valid one.
    /// `None` when every count is static (the fixed counts say it all) or
    /// one is not over the partition's symbols (the grid then runs whole:
    /// counts are for speed only, the bound layout keeps any count right).
    pub fn groups(&self, dims: &[(SymExpr, usize)], per: usize) -> Result<Option<Size>> {
        if dims.iter().all(|(e, _)| e.as_const().is_some()) {
            return Ok(None);
        }
        let per = SymExpr::Const(per as i64);
        let cells = extent(dims);
        let e = SymExpr::floor_div(cells + per.clone() - SymExpr::Const(1), per)?;
        Ok(Size::of(&e, &self.names))
    }

    /// `groups` (none: the `bound` count) times the 0/1 `gate`: a
    /// dispatch that runs only where the gate is 1 (a size bucket's).
    pub fn gated(&self, groups: Option<Size>, bound: u64, gate: &SymExpr) -> Result<Option<Size>> {
        let count = match groups {
            Some(g) => g.to_sym(&self.names)?,
            None => SymExpr::Const(bound as i64),
        };
        self.size(&(count * gate.clone())).map(Some)
    }

    /// The u32 WGSL expression of `size` reading the sizes uniform `sz`.
    pub fn wgsl(size: &Size) -> String {
        format!("u32({})", Self::wgsl_i32(size))
    }

    fn wgsl_i32(size: &Size) -> String {
        let join = |xs: &[Size], op: &str| {
            let parts: Vec<String> = xs.iter().map(Self::wgsl_i32).collect();
            format!("({})", parts.join(op))
        };
        let (a, b) = match size {
            Size::Const(c) => return format!("{c}i"),
            Size::Sym(i) => return format!("i32(sz.v[{}][{}])", i / 4, i % 4),
            Size::Add(xs) => return join(xs, " + "),
            Size::Mul(xs) => return join(xs, " * "),
            Size::FloorDiv(a, b) | Size::Mod(a, b) | Size::Max(a, b) | Size::Min(a, b) => {
                (Self::wgsl_i32(a), Self::wgsl_i32(b))
            }
        };
        let f = match size {
            Size::FloorDiv(..) => "floordiv_i",
            Size::Mod(..) => "rem_i",
            Size::Max(..) => "max",
            _ => "min",
        };
        format!("{f}({a}, {b})")
    }
}

/// Upper ends of the row buckets of a product of dynamic rows and of a
/// prefill's query rows (the last bucket ends at the bound): each bucket
/// gets the kernels a static program of its largest count would, gated
/// to it ([`bucket`]).
pub(crate) const ROW_BUCKETS: [usize; 2] = [64, 256];

/// 1 where `lo < e <= hi` (`lo` 0: no lower end; `hi` `None`: no upper
/// end), else 0, for `e >= 0`: a size bucket's gate.
pub(crate) fn bucket(e: &SymExpr, lo: usize, hi: Option<usize>) -> Result<SymExpr> {
    let (zero, one) = (SymExpr::Const(0), SymExpr::Const(1));
    // min(1, max(0, (e - 1) // t)): 0 for e <= t, else 1
    let above = |t: usize| -> Result<SymExpr> {
        let q = SymExpr::floor_div(e.clone() - one.clone(), SymExpr::Const(t as i64))?;
        Ok(SymExpr::min(one.clone(), SymExpr::max(zero.clone(), q)))
    };
    let over_lo = if lo == 0 { one.clone() } else { above(lo)? };
    let under_hi = match hi {
        Some(h) => one.clone() - above(h)?,
        None => one,
    };
    Ok(over_lo * under_hi)
}

/// The cells of a row-major box of bounds `dims.1` up to and including
/// its last valid cell (`dims.0` the valid counts): where valid cells of a
/// bound layout end (`[2, s]` in `[2, S]`: `S + s`).
pub(crate) fn extent(dims: &[(SymExpr, usize)]) -> SymExpr {
    let mut stride = 1i64;
    let mut last = SymExpr::Const(0);
    for (e, bound) in dims.iter().rev() {
        last = last + (e.clone() - SymExpr::Const(1)) * SymExpr::Const(stride);
        stride *= *bound as i64;
    }
    last + SymExpr::Const(1)
}

/// Each buffer's actual dims where they are dynamic.
pub(crate) type BufferDims = HashMap<super::buffers::BufferIdx, Vec<SymExpr>>;

#[cfg(test)]
mod tests {
    use super::*;
    use etmetal_core::sym::SymRange;

    fn sizes() -> Sizes {
        let mut g = Graph::default();
        g.sym.ranges.insert("s".into(), SymRange { min: 1, max: 8 });
        let x = g.add_value("x", etmetal_core::DType::F32, vec![8, 4]);
        g.sym
            .dims
            .insert(x, vec![SymExpr::sym("s"), SymExpr::Const(4)]);
        Sizes::of_inputs(&g, &[x]).unwrap()
    }

    #[test]
    fn the_valid_part_of_a_grid_ends_at_its_last_valid_workgroup() {
        let s = sizes();
        assert_eq!(s.symbols[0].name, "s");
        assert_eq!((s.symbols[0].input, s.symbols[0].dim), (0, 0));
        // rows of a [3, s, 5] grid at bound [3, 8, 5]: up to row (2, s-1, 4)
        let g = s
            .groups(
                &[
                    (SymExpr::Const(3), 3),
                    (SymExpr::sym("s"), 8),
                    (SymExpr::Const(5), 5),
                ],
                1,
            )
            .unwrap()
            .unwrap();
        assert_eq!(g.eval(&[2]).unwrap(), 2 * 40 + 5 + 4 + 1);
        assert_eq!(g.eval(&[8]).unwrap(), 120);
        let g4 = s
            .groups(&[(SymExpr::sym("s"), 8), (SymExpr::Const(4), 4)], 8)
            .unwrap()
            .unwrap();
        assert_eq!(g4.eval(&[3]).unwrap(), 2);
        assert!(s.groups(&[(SymExpr::Const(3), 3)], 1).unwrap().is_none());
        let e = s.size(&SymExpr::sym("t")).unwrap_err();
        assert!(e.message().contains("`t`"), "{e}");
    }

    /// A linear layer over a dynamic batch `s` in 1..=256, preprocessed.
    fn dynamic_linear() -> crate::payload::Payload {
        use etmetal_core::{DType, Op, Tensor};
        use etmetal_graph::{InputKind, Node, OutputKind};
        let mut g = Graph::default();
        g.sym
            .ranges
            .insert("s".into(), SymRange { min: 1, max: 256 });
        let x = g.add_value("x", DType::F32, vec![256, 64]);
        let w = g.add_value("w", DType::F32, vec![96, 64]);
        let y = g.add_value("y", DType::F32, vec![256, 96]);
        g.constants
            .insert(w, Tensor::zeros(DType::F32, &[96, 64]).unwrap());
        g.sym
            .dims
            .insert(x, vec![SymExpr::sym("s"), SymExpr::Const(64)]);
        g.sym
            .dims
            .insert(y, vec![SymExpr::sym("s"), SymExpr::Const(96)]);
        g.inputs.push((x, InputKind::User));
        g.outputs.push((y, OutputKind::User));
        g.nodes.push(Node {
            name: "fc".into(),
            target: "test".into(),
            op: Op::Linear,
            inputs: vec![Some(x), Some(w)],
            outputs: vec![y],
        });
        let part = crate::partitioner::Partition {
            id: 0,
            nodes: vec![0],
            inputs: vec![x],
            outputs: vec![y],
            constants: vec![w],
            mutated_buffers: vec![],
        };
        let options = crate::preprocess::PreprocessOptions::default();
        crate::preprocess::preprocess(&g, &part, &options)
            .unwrap()
            .payload
    }

    #[test]
    fn a_dynamic_linear_runs_the_tiles_of_its_actual_rows() {
        let p = dynamic_linear();
        assert_eq!(p.symbols.len(), 1);
        let sym = &p.symbols[0];
        assert_eq!(
            (sym.name.as_str(), sym.input, sym.dim, sym.min, sym.max),
            ("s", 0, 0, 1, 256)
        );
        assert_eq!(
            p.buffers[p.outputs[0]].dims,
            [Size::Sym(0), Size::Const(96)]
        );
        assert_eq!(p.actual_shape(p.outputs[0], &[5]).unwrap(), [5, 96]);
        // one GEMM variant a row bucket (up to 64 rows, up to 256), each
        // running only in its bucket, over the tiles of the actual rows
        let bound: Vec<i64> = p
            .dispatches
            .iter()
            .map(|d| d.workgroups.iter().map(|&w| i64::from(w)).product())
            .collect();
        let run = |rows: i64| -> Vec<i64> {
            let counts = p
                .dispatches
                .iter()
                .zip(&bound)
                .map(|(d, &b)| match &d.groups {
                    Some(g) => g.eval(&[rows]).unwrap(),
                    None => b,
                });
            counts.collect()
        };
        let first = |counts: Vec<i64>| counts.iter().position(|&c| c > 0);
        for rows in [1, 64, 65, 256] {
            let running = run(rows).iter().filter(|&&c| c > 0).count();
            assert_eq!(running, 1, "at {rows} rows: {:?}", run(rows));
        }
        assert_eq!(first(run(1)), first(run(64)));
        assert_eq!(first(run(65)), first(run(256)));
        let big = first(run(256)).unwrap();
        assert_ne!(first(run(1)), Some(big));
        assert_eq!(run(256)[big], bound[big], "at the bound, every workgroup");
        assert!(
            run(65)[big] < bound[big],
            "65 rows run fewer tiles than 256"
        );
        assert_eq!(&p.encode()[4..8], &[1, 0, 3, 0]);
        // a size outside the range names the input, the dim and the range
        let e = p.symbol_values(&[Some(&[300, 64])]).unwrap_err();
        assert!(
            e.message()
                .contains("input 0 (`x`) dim 0 is 300, outside the range 1..=256"),
            "{e}"
        );
    }
}
