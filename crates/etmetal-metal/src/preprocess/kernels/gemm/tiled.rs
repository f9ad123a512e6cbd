//! The portable GEMM kernel: register-tiled, for any device. Each
//! workgroup computes a `bm × bn` tile of one batch's output; `k` is
//! walked in `bk`-deep slices staged in workgroup memory (two stages, the
//! next slice read into registers while the current one is multiplied),
//! and each invocation keeps a `tm × tn` block of accumulators (f32) in
//! registers, reading the staged slices as `vec4`s. The tile is the
//! largest of 128×128, 64×64 and 32×32 that still gives a large GPU
//! enough workgroups, or a 16-wide one for skinny products.

use std::fmt::Write;

use super::spec::{Gemm, FILL};
use crate::preprocess::emit::FLAT_GROUP;

/// Tile sizes: a workgroup computes `bm × bn` outputs, `(bm/tm)·(bn/tn)`
/// invocations each `tm × tn`, over `bk`-deep slices of k.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RegisterTile {
    pub bm: usize,
    pub bn: usize,
    pub bk: usize,
    pub tm: usize,
    pub tn: usize,
}

impl RegisterTile {
    pub fn threads(&self) -> usize {
        (self.bm / self.tm) * (self.bn / self.tn)
    }

    /// Vector width of an invocation's rows (columns): its `tm` rows are
    /// `tm / wm` runs of `wm` adjacent rows, read from workgroup memory as
    /// one `vec4` (or scalar) each.
    fn widths(&self) -> (usize, usize) {
        let w = |t: usize| if t.is_multiple_of(4) { 4 } else { 1 };
        (w(self.tm), w(self.tn))
    }

    /// Words of one stage of the staged A and B slices.
    pub fn stage_words(&self) -> (usize, usize) {
        (self.bk * self.bm, self.bk * self.bn)
    }
}

impl Gemm {
    pub(super) fn tile(&self) -> RegisterTile {
        let (m, n) = (self.m, self.n);
        let groups =
            |bm: usize, bn: usize| (m.div_ceil(bm) * n.div_ceil(bn)) as u64 * self.batch as u64;
        let t = |bm, bn, bk, tm, tn| RegisterTile { bm, bn, bk, tm, tn };
        if m <= 16 && n > m {
            // matrix-vector-like: few rows, many columns per workgroup
            t(16, 64, 16, 1, 4)
        } else if n <= 16 && m > n {
            t(64, 16, 16, 4, 1)
        } else if m >= 128 && n >= 128 && groups(128, 128) >= FILL {
            t(128, 128, 8, 8, 8)
        } else if groups(64, 64) >= FILL {
            t(64, 64, 16, 8, 4)
        } else {
            t(32, 32, 16, 4, 4)
        }
    }

    /// The kernel's main. Invocation `(ty, tx)` owns rows
    /// `g·(bm·wm/tm) + ty·wm + i` and columns `h·(bn·wn/tn) + tx·wn + j`, so
    /// its reads of a staged k-row are `tm/wm + tn/wn` vector loads shared
    /// by neighbours (broadcasts, no bank conflicts). Slices of k are staged
    /// in two alternating halves of workgroup memory (A transposed: k-major)
    /// and the next slice's global reads are issued into registers before
    /// the current one is multiplied, so one barrier per slice suffices and
    /// memory latency hides behind the FMAs.
    pub(super) fn main(&self, t: &RegisterTile, splits: usize) -> String {
        let RegisterTile { bm, bn, bk, tm, tn } = *t;
        let threads = t.threads();
        let (wm, wn) = t.widths();
        let (m, n, k) = (self.m, self.n, self.k);
        let (tiles_m, tiles_n) = (m.div_ceil(bm), n.div_ceil(bn));
        let tiles = tiles_m * tiles_n;
        let per = tiles * self.batch;
        let (gm, gn) = (tm / wm, tn / wn);
        // rows (columns) between an invocation's runs, and vectors per k-row
        let (rg, cg) = (bm / gm, bn / gn);
        let (va, vb) = (bm / wm, bn / wn);
        let (sa, sb) = t.stage_words();
        let vty = |w: usize| if w == 4 { "vec4<f32>" } else { "f32" };
        let lane = |x: &str, w: usize, i: usize| {
            if w == 4 {
                format!("{x}[{i}]")
            } else {
                x.to_string()
            }
        };
        // k per split (a multiple of bk when split)
        let nt = (k / splits).div_ceil(bk);
        let mut s = String::new();
        let _ = writeln!(s, "var<workgroup> ta: array<{}, {}>;", vty(wm), 2 * sa / wm);
        let _ = writeln!(s, "var<workgroup> tb: array<{}, {}>;", vty(wn), 2 * sb / wn);
        let _ = writeln!(
            s,
            "@compute @workgroup_size({threads})\n\
             fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, \
             @builtin(local_invocation_index) lid: u32) {{"
        );
        let _ = writeln!(
            s,
            "  let g = {FLAT_GROUP};\n  if (g >= {}u) {{ return; }}\n\
             \x20 let ks = g / {per}u;\n  let sb = g / {tiles}u;\n\
             \x20 let bt = sb % {}u;\n  let tile = g % {tiles}u;\n\
             \x20 let kbase = ks * {}u;\n{}\
             \x20 let tx = lid % {}u;\n  let ty = lid / {}u;",
            per * splits,
            self.batch,
            k / splits,
            self.tile_origin(bm, bn),
            bn / tn,
            bn / tn,
        );
        for i in 0..tm {
            for h in 0..gn {
                let _ = writeln!(s, "  var c{i}_{h} = {}(0.0);", vty(wn));
            }
        }
        // the elements of a slice each invocation reads: element
        // e = lid + j·threads of the tile, walked k-fastest when the operand
        // is adjacent along k (coalesced reads)
        let per_a = bm * bk / threads;
        let per_b = bn * bk / threads;
        let coords = |e: &str, k_fast: bool, len: usize| -> (String, String) {
            if k_fast {
                (format!("({e}) / {bk}u"), format!("({e}) % {bk}u"))
            } else {
                (format!("({e}) % {len}u"), format!("({e}) / {len}u"))
            }
        };
        // bounds checks only where the tile can overhang
        let check = |idx: &str, len: usize, tile: usize| -> Option<(String, String)> {
            (!len.is_multiple_of(tile)).then(|| {
                (
                    format!("{idx} < {len}u"),
                    format!("min({idx}, {}u)", len - 1),
                )
            })
        };
        let read = |s: &mut String, k0: &str| {
            for j in 0..per_a {
                let (r, kk) = coords(&format!("lid + {}u", j * threads), self.a_k_fast, bm);
                let gr = format!("(m0 + {r})");
                let gk = format!("({k0} + {kk})");
                let _ = writeln!(
                    s,
                    "    {}",
                    guarded(
                        &format!("pa{j}"),
                        "ga",
                        &[
                            ("bt".into(), None),
                            (gr.clone(), check(&gr, m, bm)),
                            (gk.clone(), check(&gk, k, bk))
                        ]
                    )
                );
            }
            for j in 0..per_b {
                let (c, kk) = coords(&format!("lid + {}u", j * threads), self.b_k_fast, bn);
                let gc = format!("(n0 + {c})");
                let gk = format!("({k0} + {kk})");
                let _ = writeln!(
                    s,
                    "    {}",
                    guarded(
                        &format!("pb{j}"),
                        "gb",
                        &[
                            ("bt".into(), None),
                            (gk.clone(), check(&gk, k, bk)),
                            (gc.clone(), check(&gc, n, bn))
                        ]
                    )
                );
            }
        };
        let write = |s: &mut String, stage: &str| {
            for (name, per, k_fast, len, w, v, arr) in [
                ("pa", per_a, self.a_k_fast, bm, wm, va, "ta"),
                ("pb", per_b, self.b_k_fast, bn, wn, vb, "tb"),
            ] {
                for j in 0..per {
                    let (r, kk) = coords(&format!("lid + {}u", j * threads), k_fast, len);
                    let at = format!("{stage} * {}u + ({kk}) * {v}u + ({r}) / {w}u", v * bk);
                    let dst = if w == 4 {
                        format!("{arr}[{at}][({r}) % 4u]")
                    } else {
                        format!("{arr}[{at}]")
                    };
                    let _ = writeln!(s, "    {dst} = {name}{j};");
                }
            }
        };
        if nt > 0 {
            for j in 0..per_a {
                let _ = writeln!(s, "  var pa{j} = 0.0;");
            }
            for j in 0..per_b {
                let _ = writeln!(s, "  var pb{j} = 0.0;");
            }
            s.push_str("  {\n");
            read(&mut s, "kbase");
            write(&mut s, "0u");
            s.push_str("  }\n  workgroupBarrier();\n");
            let _ = writeln!(s, "  for (var t = 0u; t < {nt}u; t = t + 1u) {{");
            s.push_str("    let cur = t & 1u;\n    let more = t + 1u < ");
            let _ = writeln!(s, "{nt}u;\n    if (more) {{");
            read(&mut s, &format!("kbase + (t + 1u) * {bk}u"));
            s.push_str("    }\n");
            let _ = writeln!(
                s,
                "    let oa = cur * {}u + ty;\n    let ob = cur * {}u + tx;",
                va * bk,
                vb * bk
            );
            for kk in 0..bk {
                s.push_str("    {\n");
                for g in 0..gm {
                    let _ = writeln!(s, "    let a{g} = ta[oa + {}u];", kk * va + g * rg / wm);
                }
                for h in 0..gn {
                    let _ = writeln!(s, "    let b{h} = tb[ob + {}u];", kk * vb + h * cg / wn);
                }
                for i in 0..tm {
                    let a = lane(&format!("a{}", i / wm), wm, i % wm);
                    let a = if wn == 4 {
                        format!("vec4<f32>({a})")
                    } else {
                        a
                    };
                    for h in 0..gn {
                        let _ = writeln!(s, "    c{i}_{h} = fma({a}, b{h}, c{i}_{h});");
                    }
                }
                s.push_str("    }\n");
            }
            s.push_str("    if (more) {\n");
            write(&mut s, "(1u - cur)");
            s.push_str("    }\n    workgroupBarrier();\n  }\n");
        }
        for i in 0..tm {
            let _ = writeln!(
                s,
                "  let r{i} = m0 + ty * {wm}u + {}u;",
                (i / wm) * rg + i % wm
            );
        }
        for j in 0..tn {
            let _ = writeln!(
                s,
                "  let q{j} = n0 + tx * {wn}u + {}u;",
                (j / wn) * cg + j % wn
            );
        }
        for i in 0..tm {
            for j in 0..tn {
                let v = lane(&format!("c{i}_{}", j / wn), wn, j % wn);
                let _ = writeln!(
                    s,
                    "  if (r{i} < {m}u && q{j} < {n}u) {{ gstore(sb, r{i}, q{j}, {v}); }}"
                );
            }
        }
        s.push_str("}\n");
        s
    }
}

/// `dst = f(args)` with each checked argument clamped into range for the
/// call and the value 0 where any is out of range.
fn guarded(dst: &str, f: &str, args: &[(String, Option<(String, String)>)]) -> String {
    let conds: Vec<&str> = args
        .iter()
        .filter_map(|(_, c)| c.as_ref().map(|c| c.0.as_str()))
        .collect();
    let call = format!(
        "{f}({})",
        args.iter()
            .map(|(a, c)| c.as_ref().map_or(a.as_str(), |c| c.1.as_str()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if conds.is_empty() {
        format!("{dst} = {call};")
    } else {
        format!("{dst} = select(0.0, {call}, {});", conds.join(" && "))
    }
}

#[cfg(test)]
mod tests {
    use super::Gemm;

    #[test]
    fn tiles_follow_the_shape() {
        let tile = |batch, m, n| {
            let g = Gemm {
                batch,
                m,
                n,
                k: 64,
                a_k_fast: true,
                b_k_fast: false,
                coop: None,
                dynamic: None,
            };
            let t = g.tile();
            // every invocation stages whole elements of both slices
            assert_eq!((t.bm * t.bk) % t.threads(), 0);
            assert_eq!((t.bn * t.bk) % t.threads(), 0);
            assert!(2 * 4 * (t.bm + t.bn) * t.bk <= 16384, "{t:?}");
            (t.bm, t.bn)
        };
        assert_eq!(tile(1, 4096, 4096), (128, 128));
        assert_eq!(tile(64, 129, 129), (128, 128));
        assert_eq!(tile(1, 1024, 1024), (64, 64));
        assert_eq!(tile(1, 512, 512), (32, 32));
        assert_eq!(tile(1, 1, 4096), (16, 64));
        assert_eq!(tile(1, 4096, 3), (64, 16));
    }
}
