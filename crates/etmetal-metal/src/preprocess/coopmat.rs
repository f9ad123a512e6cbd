//! The cooperative-matrix primitives as the tensor-core kernels write them
//! (`kernels/gemm/coop.rs`, `kernels/attention_coop.rs`,
//! `kernels/attention_flash.rs`): one seam ([`CoopMat`]) through
//! which a kernel declares, loads, multiplies and stores its matrices, in
//! one of two flavours.
//!
//! - Real: naga's `wgpu_cooperative_matrix` (`coop_mat16x16<f16, A>`,
//!   `coopLoad`, `coopMultiplyAdd`, `coopStore`, the subgroup builtins).
//!   These kernels are payload alternatives that the runtime runs where the
//!   adapter reports the configuration.
//! - Emulated (test and reference mode): the same kernels with each
//!   matrix held in plain WGSL arrays, so they run on any adapter
//!   (lavapipe in CI). Only `PreprocessOptions::emulate_coop` selects it,
//!   and `Lowering::alternative` is the one place that reads it (see
//!   there): the emulated kernels then replace the portable dispatch in
//!   the payload, which has no alternatives at all, so no runtime choice
//!   can pick them on a real device.
//!
//! The emulation keeps what the kernels rely on. An emulated subgroup is
//! 32 consecutive invocations (`local_invocation_index / 32`, as the real
//! kernels assume subgroups of exactly 32 in a 1-D workgroup). Lane `l`
//! of it owns `S²/32` elements of each `S×S` accumulator (row `l / G`,
//! columns `(l % G)·E ..` with `E = S²/32`, `G = S/E`), and loads the
//! row of A and the columns of B those need; `coopMultiplyAdd` converts
//! each staged operand element to f32 exactly (f16 operands stay the f16
//! values the kernel staged) and accumulates in f32. A store writes each
//! lane's own elements, so the stored matrix is whole once the
//! invocations of the subgroup are past a barrier, which is what the real
//! kernels already wait for before reading another lane's elements.
//! Loads and stores follow naga's layouts: `coopLoadT`/`coopStoreT` are
//! row-major (element `(r, c)` at `p[r·stride + c]`), `coopLoad`/
//! `coopStore` column-major (`p[c·stride + r]`).

use std::fmt::Write;

use crate::payload::Needs;
use crate::preprocess::emit::KernelBuilder;

/// Invocations of a subgroup the kernels are written for.
pub(crate) const SUBGROUP: usize = 32;

/// The cooperative-matrix configuration a kernel is written for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CoopForm {
    /// `coop_mat16x16`: f16 operands (scaled into f16's range by the GEMM,
    /// see `gemm/coop.rs`), f32 accumulators; NVIDIA GPUs through Vulkan.
    Half16,
    /// `coop_mat8x8`: f32 operands (every f16 or bf16 value converts
    /// exactly, so no scaling) and accumulators; Apple GPUs' simdgroup
    /// matrices through Metal (Apple7 and later, whose simdgroups are 32
    /// wide). No machine here runs its real flavour: lavapipe has no
    /// cooperative matrices and the H200 reports no 8×8 f32 form.
    Float8,
}

impl CoopForm {
    /// The forms in the order the runtime prefers them.
    pub(crate) const ALL: [CoopForm; 2] = [CoopForm::Half16, CoopForm::Float8];

    /// What the real kernels need (their workgroup memory is filled in by
    /// `Lowering::alternative`).
    pub(crate) fn needs(self) -> Needs {
        match self {
            CoopForm::Half16 => Needs::f16_16x16x16(SUBGROUP as u32, 0),
            CoopForm::Float8 => Needs::f32_8x8x8(SUBGROUP as u32, 0),
        }
    }

    /// Rows (and columns, and depth) of one matrix.
    pub(crate) fn size(self) -> usize {
        match self {
            CoopForm::Half16 => 16,
            CoopForm::Float8 => 8,
        }
    }

    /// The operands' WGSL type and its bytes.
    pub(crate) fn elem(self) -> (&'static str, usize) {
        match self {
            CoopForm::Half16 => ("f16", 2),
            CoopForm::Float8 => ("f32", 4),
        }
    }

    fn mat(self) -> &'static str {
        match self {
            CoopForm::Half16 => "coop_mat16x16",
            CoopForm::Float8 => "coop_mat8x8",
        }
    }

    /// A kernel's name tag (`…_coop`, `…_coop8x8`).
    pub(crate) fn tag(self) -> &'static str {
        match self {
            CoopForm::Half16 => "coop",
            CoopForm::Float8 => "coop8x8",
        }
    }

    /// The name tag of its emulated kernels (`…_coopemu`, `…_coop8x8emu`).
    pub fn emulated_tag(self) -> &'static str {
        match self {
            CoopForm::Half16 => "coopemu",
            CoopForm::Float8 => "coop8x8emu",
        }
    }
}

/// The role of a matrix in `C += A·B`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    A,
    B,
    C,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::A => "A",
            Role::B => "B",
            Role::C => "C",
        }
    }
}

/// The primitives of one kernel in one flavour (see the module comment).
/// The kernel's entry point binds `@builtin(local_invocation_index) lid`,
/// takes [`CoopMat::params`] and starts with [`CoopMat::prologue`]; after
/// that, `sg` is its subgroup and `sl` its lane in it. Module-scope text
/// the calls need comes from [`CoopMat::helpers`], asked once the kernel
/// is written.
pub(crate) struct CoopMat {
    pub form: CoopForm,
    emulated: bool,
    /// Emulation helpers used so far: (name, WGSL).
    helpers: Vec<(String, String)>,
}

impl CoopMat {
    pub(crate) fn new(form: CoopForm, emulated: bool) -> CoopMat {
        CoopMat {
            form,
            emulated,
            helpers: vec![],
        }
    }

    /// The kernel's name tag.
    pub(crate) fn tag(&self) -> &'static str {
        if self.emulated {
            self.form.emulated_tag()
        } else {
            self.form.tag()
        }
    }

    /// Enable what the kernel's WGSL uses.
    pub(crate) fn enable(&self, kb: &mut KernelBuilder) {
        if self.form == CoopForm::Half16 {
            kb.enable("f16");
        }
        if !self.emulated {
            kb.enable("wgpu_cooperative_matrix");
        }
    }

    /// The entry point's parameters after `lid` (with a leading comma).
    pub(crate) fn params(&self) -> &'static str {
        if self.emulated {
            ""
        } else {
            ", @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) sl: u32"
        }
    }

    /// The entry point's first statements.
    pub(crate) fn prologue(&self) -> String {
        if self.emulated {
            format!(
                "  let sg = lid / {SUBGROUP}u;\n  let sl = lid % {SUBGROUP}u;\n  coop_lane = sl;\n"
            )
        } else {
            String::new()
        }
    }

    /// Elements an emulating lane holds of one accumulator, and lanes per row.
    fn share(&self) -> (usize, usize) {
        let s = self.form.size();
        let e = s * s / SUBGROUP;
        (e, s / e)
    }

    /// The WGSL type of a matrix of `role` with elements `elem`.
    fn ty(&self, role: Role, elem: &str) -> String {
        let s = self.form.size();
        let (e, _) = self.share();
        if !self.emulated {
            return format!("{}<{elem}, {}>", self.form.mat(), role.name());
        }
        let len = match role {
            Role::A => s,
            Role::B => s * e,
            Role::C => e,
        };
        format!("array<{elem}, {len}>")
    }

    /// A zero f32 accumulator.
    pub(crate) fn zero(&self) -> String {
        format!("{}()", self.ty(Role::C, "f32"))
    }

    /// A matrix of `role` read from workgroup array `array` of `elem`s
    /// (f32 for C, the form's operand type for A and B) at element
    /// `offset`, rows `stride` apart when `row_major`, else columns.
    pub(crate) fn load(
        &mut self,
        role: Role,
        array: &str,
        elem: &str,
        offset: &str,
        stride: &str,
        row_major: bool,
    ) -> String {
        if !self.emulated {
            let f = if row_major { "coopLoadT" } else { "coopLoad" };
            return format!("{f}<{}>(&{array}[{offset}], {stride})", self.ty(role, elem));
        }
        let name = format!(
            "coop_ld_{}_{array}_{}",
            role.name().to_lowercase(),
            if row_major { "r" } else { "c" }
        );
        if !self.has(&name) {
            let ty = self.ty(role, elem);
            let (count, r, c) = self.element(role);
            let src = if row_major {
                format!("o + ({r}) * s + {c}")
            } else {
                format!("o + ({c}) * s + {r}")
            };
            let mut f = format!(
                "fn {name}(o: u32, s: u32) -> {ty} {{\n{}  var m: {ty};\n",
                self.lane()
            );
            // B's share (a lane's whole columns) in a loop: a software
            // adapter's compiler took a minute over a flash attention
            // kernel's unrolled copies; the small shares unrolled
            if role == Role::B {
                let _ = writeln!(
                    f,
                    "  for (var x = 0u; x < {count}u; x = x + 1u) {{ m[x] = {array}[{src}]; }}"
                );
            } else {
                for x in 0..count {
                    let at = src.replace('x', &format!("{x}u"));
                    let _ = writeln!(f, "  m[{x}] = {array}[{at}];");
                }
            }
            f.push_str("  return m;\n}\n\n");
            self.helpers.push((name.clone(), f));
        }
        format!("{name}({offset}, {stride})")
    }

    /// The elements an emulating lane holds of a matrix of `role`: how
    /// many, and the row and column of its element `x` (a WGSL u32 named
    /// `x`; the lane's row `i` and first column `j0`).
    fn element(&self, role: Role) -> (usize, String, String) {
        let s = self.form.size();
        let (e, _) = self.share();
        match role {
            Role::A => (s, "i".into(), "x".into()),
            Role::B => (s * e, format!("x / {e}u"), format!("j0 + x % {e}u")),
            Role::C => (e, "i".into(), "j0 + x".into()),
        }
    }

    /// `a·b + c` (f32 accumulation).
    pub(crate) fn mma(&mut self, a: &str, b: &str, c: &str) -> String {
        if !self.emulated {
            return format!("coopMultiplyAdd({a}, {b}, {c})");
        }
        let name = "coop_mma";
        if !self.has(name) {
            let s = self.form.size();
            let (e, _) = self.share();
            let elem = self.form.elem().0;
            let (ta, tb, tc) = (
                self.ty(Role::A, elem),
                self.ty(Role::B, elem),
                self.ty(Role::C, "f32"),
            );
            let mut f = format!("fn {name}(a: {ta}, b: {tb}, c: {tc}) -> {tc} {{\n  var r = c;\n");
            for x in 0..s {
                for y in 0..e {
                    let _ = writeln!(
                        f,
                        "  r[{y}] = r[{y}] + f32(a[{x}]) * f32(b[{}]);",
                        x * e + y
                    );
                }
            }
            f.push_str("  return r;\n}\n\n");
            self.helpers.push((name.into(), f));
        }
        format!("{name}({a}, {b}, {c})")
    }

    /// The statement storing accumulator `c` into workgroup array `array`
    /// of f32 at element `offset`, rows `stride` apart when `row_major`.
    pub(crate) fn store(
        &mut self,
        c: &str,
        array: &str,
        offset: &str,
        stride: &str,
        row_major: bool,
    ) -> String {
        if !self.emulated {
            let f = if row_major { "coopStoreT" } else { "coopStore" };
            return format!("{f}({c}, &{array}[{offset}], {stride});");
        }
        let name = format!("coop_st_{array}_{}", if row_major { "r" } else { "c" });
        if !self.has(&name) {
            let (e, _) = self.share();
            let tc = self.ty(Role::C, "f32");
            // element y of the lane's share
            let dst = |y: usize| {
                if row_major {
                    format!("o + i * s + j0 + {y}u")
                } else {
                    format!("o + (j0 + {y}u) * s + i")
                }
            };
            let mut f = format!("fn {name}(m: {tc}, o: u32, s: u32) {{\n{}", self.lane());
            for y in 0..e {
                let _ = writeln!(f, "  {array}[{}] = m[{y}];", dst(y));
            }
            f.push_str("}\n\n");
            self.helpers.push((name.clone(), f));
        }
        format!("{name}({c}, {offset}, {stride});")
    }

    /// Module-scope WGSL the calls so far need.
    pub(crate) fn helpers(&self) -> String {
        if !self.emulated {
            return String::new();
        }
        let mut s = String::from("var<private> coop_lane: u32;\n\n");
        for (_, f) in &self.helpers {
            s.push_str(f);
        }
        s
    }

    fn has(&self, name: &str) -> bool {
        self.helpers.iter().any(|(n, _)| n == name)
    }

    /// The emulating lane's row `i` and first column `j0`.
    fn lane(&self) -> String {
        let (e, g) = self.share();
        let mut s = String::new();
        let _ = writeln!(
            s,
            "  let i = coop_lane / {g}u;\n  let j0 = (coop_lane % {g}u) * {e}u;"
        );
        s
    }
}
