//! WGSL emission for one kernel: buffer bindings, load/store functions per
//! storage type, and lazy values turned into functions of their logical
//! index (`fn x(i0: u32, i1: u32) -> f32`) that kernel templates call.

use std::collections::HashMap;
use std::fmt::Write;

use etmetal_core::{DType, Error, Op, Result};

use super::buffers::{BufferIdx, Buffers, Storage};
use super::expr::{GatherAt, Kind, LazyRef, Pos};
use super::pointwise::{self, compute_type};
use super::sizes::{uniform_decl, Sizes};
use crate::payload::{Access, Fault, Site, Size};

/// [`KernelBuilder`]'s binding flavours of f16 buffers read and written
/// as halves ([`KernelBuilder::halves`], [`KernelBuilder::halves4`]).
const HALVES: u8 = 1;
const HALVES4: u8 = 2;

/// Elements handled by one invocation of a flat kernel's workgroup.
pub(crate) const FLAT_WORKGROUP: u32 = 256;

pub(crate) struct KernelBuilder<'a> {
    buffers: &'a Buffers,
    /// Buffers in binding order.
    pub bindings: Vec<BufferIdx>,
    /// Per binding: bound as an array of chunks of this many elements
    /// ([`Self::load4`], [`Self::load8`], [`Self::load_words4`]), 0 when
    /// element by element.
    chunked: Vec<u8>,
    functions: String,
    /// Pointwise ops inlined from lazy values, for the kernel's op list.
    fused: Vec<String>,
    /// Run-time checks, bit `i` of the status buffer for `sites[i]`.
    sites: Vec<Site>,
    /// WGSL extensions the kernel enables (`f16`).
    extensions: Vec<&'static str>,
    /// Buffers read from workgroup memory instead (a row statistic the
    /// kernel computes itself), by the array's name.
    substitutes: HashMap<BufferIdx, String>,
    /// Buffers read as one value, whatever the index (the element a
    /// template's store is writing, before its epilogue).
    elements: HashMap<BufferIdx, String>,
    /// Reads the sizes uniform ([`Self::size`]).
    sizes: bool,
    /// Emitting a [`Self::row_fn`]: loads give their index instead.
    offsets: bool,
}

/// The statements of one function being emitted, with its memo of values
/// already computed at an index.
struct FnBody {
    lines: String,
    memo: HashMap<(usize, Vec<String>), String>,
    temps: usize,
}

impl FnBody {
    fn bind(&mut self, ty: &str, expr: String) -> String {
        let name = format!("t{}", self.temps);
        self.temps += 1;
        let _ = writeln!(self.lines, "  let {name}: {ty} = {expr};");
        name
    }
    /// A name for a u32 index expression (bound when not already simple).
    fn index(&mut self, expr: String) -> String {
        if expr.chars().all(|c| c.is_alphanumeric() || c == '_') {
            expr
        } else {
            self.bind("u32", expr)
        }
    }
}

impl<'a> KernelBuilder<'a> {
    pub fn new(buffers: &'a Buffers) -> KernelBuilder<'a> {
        KernelBuilder {
            buffers,
            bindings: vec![],
            chunked: vec![],
            functions: String::new(),
            fused: vec![],
            sites: vec![],
            extensions: vec![],
            substitutes: HashMap::new(),
            elements: HashMap::new(),
            sizes: false,
            offsets: false,
        }
    }

    /// The u32 WGSL expression of run-time size `s` (the kernel binds the
    /// sizes uniform).
    pub fn size(&mut self, s: &Size) -> String {
        self.sizes = true;
        Sizes::wgsl(s)
    }

    /// The u32 position a gather reads along a dim of `n` elements, from
    /// `raw`, an index value of `dtype`: a negative index counts from the
    /// end `len` (the run-time one of a dynamic dim); out of range clamps
    /// into `0..n`, so the read stays inside the buffer.
    pub fn gather_index(&mut self, raw: &str, dtype: DType, n: usize, len: &Pos) -> Result<String> {
        let raw = pointwise::cast(raw, dtype, DType::I32);
        let end = match len {
            Pos::At(n) => pointwise::int_literal(*n as i64)?,
            Pos::Run(n) => format!("i32({})", self.size(n)),
        };
        Ok(format!(
            "u32(clamp(select({raw}, {raw} + {end}, {raw} < 0i), 0i, {}))",
            pointwise::int_literal(n.max(1) as i64 - 1)?
        ))
    }

    /// Read `buf` from the workgroup array `name` (same elements), not
    /// from a binding.
    pub fn substitute(&mut self, buf: BufferIdx, name: &str) {
        self.substitutes.insert(buf, name.to_string());
    }

    /// Read `buf` as the WGSL value `name` at any index: the expression
    /// reading it reads only the element being stored (an epilogue).
    pub fn substitute_element(&mut self, buf: BufferIdx, name: &str) {
        self.elements.insert(buf, name.to_string());
    }

    /// Enable WGSL extension `name` (`enable name;` heads the module).
    pub fn enable(&mut self, name: &'static str) {
        if !self.extensions.contains(&name) {
            self.extensions.push(name);
        }
    }

    /// The status bit of a check of `node` (op `op`) for `fault`; the
    /// kernel binds its status buffer (named `st`) last.
    pub fn site(&mut self, node: &str, op: &str, fault: Fault) -> u32 {
        let site = Site {
            node: node.to_string(),
            op: op.to_string(),
            fault,
        };
        let i = match self.sites.iter().position(|s| *s == site) {
            Some(i) => i,
            None => {
                self.sites.push(site);
                self.sites.len() - 1
            }
        };
        i as u32
    }

    /// The binding index of `buf`, adding it on first use.
    pub fn binding(&mut self, buf: BufferIdx) -> usize {
        self.bind_as(buf, 0)
    }

    fn bind_as(&mut self, buf: BufferIdx, chunked: u8) -> usize {
        let found = (0..self.bindings.len())
            .find(|&i| self.bindings[i] == buf && self.chunked[i] == chunked);
        found.unwrap_or_else(|| {
            self.bindings.push(buf);
            self.chunked.push(chunked);
            self.bindings.len() - 1
        })
    }

    /// A `vec4<f32>` expression reading elements `4·c … 4·c + 3` of float
    /// buffer `buf` in one load (`c` a u32 expression): the buffer is bound
    /// as `array<vec4<f32>>`, or `array<vec2<u32>>` when 16-bit packed.
    /// The caller ensures the chunk lies inside the buffer.
    pub fn load4(&mut self, buf: BufferIdx, c: &str) -> Result<String> {
        let desc = &self.buffers.list[buf];
        let (storage, dtype, name) = (desc.storage, desc.dtype, desc.name.clone());
        let b = self.bind_as(buf, 4);
        let unpack = match storage {
            Storage::F32 => return Ok(format!("b{b}[{c}]")),
            Storage::Packed16 => unpack4(dtype, "w.x", "w.y"),
            Storage::I32 => {
                return Err(Error::internal(format!(
                    "buffer `{name}` holds integers: no float chunks"
                )))
            }
        };
        let f = format!("ld4_b{b}");
        if !self.functions.contains(&format!("fn {f}(")) {
            let _ = write!(
                self.functions,
                "fn {f}(c: u32) -> vec4<f32> {{\n  let w = b{b}[c];\n  return {unpack};\n}}\n\n"
            );
        }
        Ok(format!("{f}({c})"))
    }

    /// An `array<vec4<f32>, 2>` expression reading elements `8·c … 8·c + 7`
    /// of float buffer `buf` in 16-byte loads (`c` a u32 expression): one
    /// `vec4<u32>` when 16-bit packed, else two `vec4<f32>`. The caller
    /// ensures the chunk lies inside the buffer.
    pub fn load8(&mut self, buf: BufferIdx, c: &str) -> Result<String> {
        let desc = &self.buffers.list[buf];
        let (storage, dtype, name) = (desc.storage, desc.dtype, desc.name.clone());
        let (b, body) = match (storage, dtype) {
            (Storage::F32, _) => {
                let b = self.bind_as(buf, 4);
                (
                    b,
                    format!("array<vec4<f32>, 2>(b{b}[2u * c], b{b}[2u * c + 1u])"),
                )
            }
            (Storage::Packed16, _) => {
                let b = self.bind_as(buf, 8);
                (
                    b,
                    format!(
                        "array<vec4<f32>, 2>({}, {})",
                        unpack4(dtype, "w.x", "w.y"),
                        unpack4(dtype, "w.z", "w.w")
                    ),
                )
            }
            (Storage::I32, _) => {
                return Err(Error::internal(format!(
                    "buffer `{name}` holds integers: no float chunks"
                )))
            }
        };
        let f = format!("ld8_b{b}");
        if !self.functions.contains(&format!("fn {f}(")) {
            let read = match storage {
                Storage::F32 => String::new(),
                _ => format!("  let w = b{b}[c];\n"),
            };
            let _ = write!(
                self.functions,
                "fn {f}(c: u32) -> array<vec4<f32>, 2> {{\n{read}  return {body};\n}}\n\n"
            );
        }
        Ok(format!("{f}({c})"))
    }

    /// A `vec4<u32>` expression reading words `4·c … 4·c + 3` of 32-bit
    /// integer buffer `buf` in one 16-byte load (`c` a u32 expression).
    pub fn load_words4(&mut self, buf: BufferIdx, c: &str) -> Result<String> {
        let desc = &self.buffers.list[buf];
        if desc.storage != Storage::I32 {
            return Err(Error::internal(format!(
                "buffer `{}` does not hold 32-bit integers",
                desc.name
            )));
        }
        let b = self.bind_as(buf, 4);
        Ok(format!("bitcast<vec4<u32>>(b{b}[{c}])"))
    }

    /// The name of f16 buffer `buf` (16-bit packed) bound as `array<f16>`,
    /// for kernels that move its halves themselves.
    pub fn halves(&mut self, buf: BufferIdx) -> Result<String> {
        self.f16_binding(buf, HALVES)
    }

    /// The name of f16 buffer `buf` bound as `array<vec4<f16>>` (8-byte
    /// chunks).
    pub fn halves4(&mut self, buf: BufferIdx) -> Result<String> {
        self.f16_binding(buf, HALVES4)
    }

    fn f16_binding(&mut self, buf: BufferIdx, chunked: u8) -> Result<String> {
        let desc = &self.buffers.list[buf];
        if desc.storage != Storage::Packed16 || desc.dtype != DType::F16 {
            return Err(Error::internal(format!(
                "buffer `{}` does not hold packed f16",
                desc.name
            )));
        }
        self.enable("f16");
        Ok(format!("b{}", self.bind_as(buf, chunked)))
    }

    /// A WGSL expression reading element `e` (a u32 expression) of `buf`
    /// as its compute type.
    pub fn load(&mut self, buf: BufferIdx, e: &str) -> String {
        if let Some(name) = self.elements.get(&buf) {
            return name.clone();
        }
        if let Some(name) = self.substitutes.get(&buf) {
            return format!("{name}[{e}]");
        }
        let b = self.binding(buf);
        let desc = &self.buffers.list[buf];
        match desc.storage {
            Storage::F32 => format!("b{b}[{e}]"),
            Storage::I32 if desc.dtype == DType::Bool => format!("(b{b}[{e}] != 0i)"),
            Storage::I32 => format!("b{b}[{e}]"),
            Storage::Packed16 if desc.dtype == DType::BF16 => {
                format!("bitcast<f32>((b{b}[({e}) >> 1u] >> ((({e}) & 1u) * 16u)) << 16u)")
            }
            Storage::Packed16 => format!("f16dec(b{b}[({e}) >> 1u] >> ((({e}) & 1u) * 16u))"),
        }
    }

    /// A statement storing compute value `v` as element `e` of `buf`
    /// (16-bit float buffers are written by [`Self::store_pair`]).
    pub fn store(&mut self, buf: BufferIdx, e: &str, v: &str) -> Result<String> {
        let b = self.binding(buf);
        let desc = &self.buffers.list[buf];
        Ok(match desc.storage {
            Storage::F32 => format!("b{b}[{e}] = {v};"),
            Storage::I32 if desc.dtype == DType::Bool => {
                format!("b{b}[{e}] = select(0i, 1i, {v});")
            }
            Storage::I32 => format!("b{b}[{e}] = {v};"),
            Storage::Packed16 => {
                return Err(Error::internal(format!(
                    "buffer `{}` is 16-bit packed: written in pairs only",
                    desc.name
                )))
            }
        })
    }

    /// A statement storing two consecutive elements `lo`, `hi` at word `w`
    /// of a 16-bit packed buffer.
    pub fn store_pair(&mut self, buf: BufferIdx, w: &str, lo: &str, hi: &str) -> String {
        let b = self.binding(buf);
        format!("b{b}[{w}] = {};", self.pair(buf, lo, hi))
    }

    /// A statement storing `values` (f32 WGSL expressions, 4 or 8, each
    /// already of the buffer's dtype where it is stored as f32) as elements
    /// `n·c … n·c + n - 1` of float buffer `buf` (`c` a u32 expression, `n`
    /// the count), through the binding [`Self::load4`] (4) or
    /// [`Self::load8`] (8) reads chunks by: a kernel reading the buffer so
    /// writes it without binding it twice.
    pub fn store_chunk(&mut self, buf: BufferIdx, c: &str, values: &[String]) -> Result<String> {
        let storage = self.buffers.list[buf].storage;
        let pairs = |kb: &Self| -> Vec<String> {
            values
                .chunks(2)
                .map(|p| kb.pair(buf, &p[0], &p[1]))
                .collect()
        };
        Ok(match (storage, values.len()) {
            (Storage::F32, 4) => {
                let b = self.bind_as(buf, 4);
                format!("b{b}[{c}] = vec4<f32>({});", values.join(", "))
            }
            (Storage::F32, 8) => {
                let b = self.bind_as(buf, 4);
                format!(
                    "b{b}[2u * ({c})] = vec4<f32>({}); b{b}[2u * ({c}) + 1u] = vec4<f32>({});",
                    values[..4].join(", "),
                    values[4..].join(", ")
                )
            }
            (Storage::Packed16, 4) => {
                let words = pairs(self);
                let b = self.bind_as(buf, 4);
                format!("b{b}[{c}] = vec2<u32>({});", words.join(", "))
            }
            (Storage::Packed16, 8) => {
                let words = pairs(self);
                let b = self.bind_as(buf, 8);
                format!("b{b}[{c}] = vec4<u32>({});", words.join(", "))
            }
            _ => {
                return Err(Error::internal(format!(
                    "no store of {} elements of buffer `{}` at once",
                    values.len(),
                    self.buffers.list[buf].name
                )))
            }
        })
    }

    /// Statements storing [`Self::store_pair`]'s `lo` where WGSL bool
    /// `in_lo` holds and `hi` where `in_hi` does, keeping the word's other
    /// half (written by another dispatch: a slice ending mid-word).
    pub fn store_pair_where(
        &mut self,
        buf: BufferIdx,
        w: &str,
        lo: &str,
        hi: &str,
        in_lo: &str,
        in_hi: &str,
    ) -> String {
        let b = self.binding(buf);
        format!(
            "  let word = {};\n  let old = b{b}[{w}];\n\
             \x20 b{b}[{w}] = select(old & 0xffffu, word & 0xffffu, {in_lo}) | \
             select(old & 0xffff0000u, word & 0xffff0000u, {in_hi});\n",
            self.pair(buf, lo, hi)
        )
    }

    /// The word of two 16-bit floats `lo`, `hi` as `buf` stores them.
    fn pair(&self, buf: BufferIdx, lo: &str, hi: &str) -> String {
        if self.buffers.list[buf].dtype == DType::BF16 {
            format!(
                "(bitcast<u32>(rbf16({lo})) >> 16u) | (bitcast<u32>(rbf16({hi})) & 0xffff0000u)"
            )
        } else {
            format!("f16enc({lo}) | (f16enc({hi}) << 16u)")
        }
    }

    /// Emit `fn name(i0: u32, …) -> T` computing `v` at a logical index
    /// (out-of-range indices are clamped into the buffers read).
    pub fn value_fn(&mut self, v: &LazyRef, name: &str) -> Result<()> {
        self.function(v, name, v.shape.len(), compute_type(v.dtype))
    }

    /// Emit `fn name(i0: u32, …) -> u32` over all but the last index of
    /// `v`: the element of `v.row_source()` where that row of `v` starts.
    pub fn row_fn(&mut self, v: &LazyRef, name: &str) -> Result<()> {
        if v.row_source().is_none() {
            return Err(Error::internal(format!(
                "`{name}` does not read whole rows of one buffer"
            )));
        }
        self.offsets = true;
        let made = self.function(v, name, v.shape.len() - 1, "u32");
        self.offsets = false;
        made
    }

    /// Emit `fn name(i0: u32, … i{params - 1}: u32) -> ret` computing `v`
    /// at that index (the dims past `params` at 0).
    fn function(&mut self, v: &LazyRef, name: &str, params: usize, ret: &str) -> Result<()> {
        let params: Vec<String> = (0..params).map(|d| format!("i{d}")).collect();
        let sig = params
            .iter()
            .map(|p| format!("{p}: u32"))
            .collect::<Vec<_>>()
            .join(", ");
        let mut idx = params;
        idx.resize(v.shape.len(), "0u".into());
        let mut body = FnBody {
            lines: String::new(),
            memo: HashMap::new(),
            temps: 0,
        };
        let result = self.emit(&mut body, v, &idx)?;
        let _ = write!(
            self.functions,
            "fn {name}({sig}) -> {ret} {{\n{}  return {result};\n}}\n\n",
            body.lines
        );
        Ok(())
    }

    fn emit(&mut self, f: &mut FnBody, v: &LazyRef, idx: &[String]) -> Result<String> {
        let key = (std::rc::Rc::as_ptr(v) as usize, idx.to_vec());
        if let Some(name) = f.memo.get(&key) {
            return Ok(name.clone());
        }
        let ty = compute_type(v.dtype);
        let op = match &v.kind {
            Kind::Unary(u, _) => Some(Op::Unary(*u).name().to_string()),
            Kind::Binary { op, .. } => Some(Op::Binary(*op).name().to_string()),
            Kind::Where(..) => Some("where".to_string()),
            _ => None,
        };
        if let Some(op) = op.filter(|o| !self.fused.contains(o)) {
            self.fused.push(op);
        }
        let expr = match &v.kind {
            Kind::Load(buf) => {
                let n = v.shape.iter().product::<usize>().max(1);
                let lin = linear(idx, &v.shape);
                let at = format!("min({lin}, {}u)", n - 1);
                if self.offsets {
                    let name = f.bind("u32", at);
                    f.memo.insert(key, name.clone());
                    return Ok(name);
                }
                self.load(*buf, &at)
            }
            Kind::Literal(s) => pointwise::literal(*s, v.dtype)?,
            Kind::Iota { start, step } => {
                let i = idx.first().cloned().unwrap_or_else(|| "0u".into());
                let conv = format!("{ty}({i})");
                pointwise::round_to(
                    format!(
                        "({} + {} * {conv})",
                        pointwise::literal(*start, v.dtype)?,
                        pointwise::literal(*step, v.dtype)?
                    ),
                    v.dtype,
                )
            }
            Kind::Unary(op, x) => {
                let a = self.emit(f, x, idx)?;
                let name = Op::Unary(*op).name();
                let e = pointwise::unary_checked(*op, &a, v.dtype, &mut |fault| {
                    self.site(node_of(v), name, fault)
                })?;
                pointwise::round_to(e, v.dtype)
            }
            Kind::Binary { op, compute, a, b } => {
                let xa = self.emit(f, a, idx)?;
                let xb = self.emit(f, b, idx)?;
                let ca = pointwise::convert(&xa, a.dtype, *compute);
                let cb = pointwise::convert(&xb, b.dtype, *compute);
                let name = Op::Binary(*op).name();
                let e = pointwise::binary_checked(*op, &ca, &cb, *compute, &mut |fault| {
                    self.site(node_of(v), name, fault)
                })?;
                // (the op's f32 or i32 result, cast to `v`'s dtype: rounded
                // or wrapped once)
                if op.is_predicate() {
                    e
                } else {
                    pointwise::cast(&e, *compute, v.dtype)
                }
            }
            Kind::Where(c, a, b) => {
                let xc = self.emit(f, c, idx)?;
                let xa = self.emit(f, a, idx)?;
                let xb = self.emit(f, b, idx)?;
                let xc = pointwise::cast(&xc, c.dtype, DType::Bool);
                let xa = pointwise::convert(&xa, a.dtype, v.dtype);
                let xb = pointwise::convert(&xb, b.dtype, v.dtype);
                format!("select({xb}, {xa}, {xc})")
            }
            Kind::Cast(x) => {
                let a = self.emit(f, x, idx)?;
                pointwise::cast_checked(&a, x.dtype, v.dtype, &mut |fault| {
                    self.site(node_of(v), "cast", fault)
                })
            }
            Kind::Permute(x, dims) => {
                let mut inner = vec![String::new(); dims.len()];
                for (i, &d) in dims.iter().enumerate() {
                    inner[d] = idx[i].clone();
                }
                return self.emit_as(f, v, key, x, &inner);
            }
            Kind::Expand(x) => {
                let inner = expanded_index(idx, &x.shape);
                return self.emit_as(f, v, key, x, &inner);
            }
            Kind::Reshape(x) => {
                let lin = f.index(linear(idx, &v.shape));
                let inner = unravel(&lin, &x.shape);
                return self.emit_as(f, v, key, x, &inner);
            }
            Kind::Repeat(x) => {
                let lead = v.shape.len() - x.shape.len();
                let inner: Vec<String> = x
                    .shape
                    .iter()
                    .enumerate()
                    .map(|(d, &n)| modulo(&idx[lead + d], n))
                    .collect();
                return self.emit_as(f, v, key, x, &inner);
            }
            Kind::Slice {
                x,
                dim,
                start,
                step,
            } => {
                let mut inner = idx.to_vec();
                let at = match start {
                    Pos::At(start) => affine(&idx[*dim], *step, *start),
                    Pos::Run(start) => {
                        format!("{} + {}", affine(&idx[*dim], *step, 0), self.size(start))
                    }
                };
                inner[*dim] = f.index(at);
                return self.emit_as(f, v, key, x, &inner);
            }
            Kind::Select { x, dim, index } => {
                let mut inner = idx.to_vec();
                let at = match index {
                    Pos::At(index) => format!("{index}u"),
                    Pos::Run(index) => f.index(self.size(index)),
                };
                inner.insert(*dim, at);
                return self.emit_as(f, v, key, x, &inner);
            }
            Kind::Cat(parts, dim) => {
                // the last part that starts at or before the index
                let mut start = 0usize;
                let mut e = String::new();
                for (k, p) in parts.iter().enumerate() {
                    let mut inner = idx.to_vec();
                    let n = p.shape[*dim];
                    inner[*dim] = f.index(format!(
                        "min({} - min({}, {start}u), {}u)",
                        idx[*dim],
                        idx[*dim],
                        n.max(1) - 1
                    ));
                    let x = self.emit(f, p, &inner)?;
                    let x = pointwise::convert(&x, p.dtype, v.dtype);
                    e = if k == 0 {
                        x
                    } else {
                        format!("select({e}, {x}, {} >= {start}u)", idx[*dim])
                    };
                    start += n;
                }
                e
            }
            Kind::Pad { x, before, value } => {
                let mut inner = vec![];
                let mut inside = vec![];
                for (d, (&n, &b)) in x.shape.iter().zip(before).enumerate() {
                    // a dim padded only after its end (`F.pad(x, [0, 0, 0, 1])`)
                    // still needs the bounds check: only an unpadded dim reads through
                    if b == 0 && v.shape[d] == n {
                        inner.push(idx[d].clone());
                        continue;
                    }
                    let p = f.bind(
                        "i32",
                        format!("i32({}) - {}", idx[d], pointwise::int_literal(b)?),
                    );
                    inside.push(format!("({p} >= 0i && {p} < {}i)", n));
                    inner.push(f.index(format!("u32(clamp({p}, 0i, {}i))", n.max(1) - 1)));
                }
                let a = self.emit(f, x, &inner)?;
                let a = pointwise::convert(&a, x.dtype, v.dtype);
                if inside.is_empty() {
                    a
                } else {
                    let fill = pointwise::literal(etmetal_core::Scalar::Float(*value), v.dtype)?;
                    format!("select({fill}, {a}, {})", inside.join(" && "))
                }
            }
            Kind::Triangle { x, upper, diagonal } => {
                let r = idx.len();
                let a = self.emit(f, x, idx)?;
                let zero = pointwise::literal(etmetal_core::Scalar::Int(0), v.dtype)?;
                let diff = format!("(i32({}) - i32({}))", idx[r - 1], idx[r - 2]);
                let keep = if *upper {
                    format!("{diff} >= {}", pointwise::int_literal(*diagonal)?)
                } else {
                    format!("{diff} <= {}", pointwise::int_literal(*diagonal)?)
                };
                format!("select({zero}, {a}, {keep})")
            }
            Kind::Masked { x, valid, fill } => {
                let a = self.emit(f, x, idx)?;
                let a = pointwise::convert(&a, x.dtype, v.dtype);
                let inside: Vec<String> = valid
                    .iter()
                    .map(|(d, n)| format!("{} < {}", idx[*d], self.size(n)))
                    .collect();
                let fill = pointwise::literal(*fill, v.dtype)?;
                format!("select({fill}, {a}, {})", inside.join(" && "))
            }
            Kind::Gather {
                src,
                dim,
                index,
                at,
                len,
            } => {
                let at_idx: Vec<String> = match at {
                    GatherAt::Same => idx.to_vec(),
                    GatherAt::Dim => vec![idx[*dim].clone()],
                    GatherAt::Leading => idx[..idx.len() - 1].to_vec(),
                };
                let raw = self.emit(f, index, &at_idx)?;
                let i = f.index(self.gather_index(&raw, index.dtype, src.shape[*dim], len)?);
                let inner: Vec<String> = match at {
                    GatherAt::Leading => vec![i, idx[idx.len() - 1].clone()],
                    _ => {
                        let mut inner = idx.to_vec();
                        inner[*dim] = i;
                        inner
                    }
                };
                return self.emit_as(f, v, key, src, &inner);
            }
        };
        let name = f.bind(ty, expr);
        f.memo.insert(key, name.clone());
        Ok(name)
    }

    /// `v` is `x` read at `inner` (a layout op): same value, maybe recast.
    fn emit_as(
        &mut self,
        f: &mut FnBody,
        v: &LazyRef,
        key: (usize, Vec<String>),
        x: &LazyRef,
        inner: &[String],
    ) -> Result<String> {
        let a = self.emit(f, x, inner)?;
        let name = if x.dtype == v.dtype {
            a
        } else {
            f.bind(compute_type(v.dtype), pointwise::cast(&a, x.dtype, v.dtype))
        };
        f.memo.insert(key, name.clone());
        Ok(name)
    }

    /// The kernel: bindings, helpers, generated functions, then `main`.
    pub fn finish(self, main: &str) -> Built {
        Built {
            wgsl: self.module(main),
            f16: self.extensions.contains(&"f16"),
            bindings: self.bindings,
            fused: self.fused,
            sites: self.sites,
            sizes: self.sizes,
            tag: None,
        }
    }

    fn module(&self, main: &str) -> String {
        let mut s = String::new();
        for ext in &self.extensions {
            let _ = writeln!(s, "enable {ext};");
        }
        for (i, &buf) in self.bindings.iter().enumerate() {
            let desc = &self.buffers.list[buf];
            let access = match self.buffers.access(buf) {
                Access::Read => "read",
                Access::ReadWrite => "read_write",
            };
            let elem = match (desc.storage, self.chunked[i]) {
                (Storage::F32, 0) => "f32",
                (Storage::F32, _) => "vec4<f32>",
                (Storage::I32, 0) => "i32",
                (Storage::I32, _) => "vec4<i32>",
                (Storage::Packed16, 0) => "u32",
                (Storage::Packed16, HALVES) => "f16",
                (Storage::Packed16, HALVES4) => "vec4<f16>",
                (Storage::Packed16, 4) => "vec2<u32>",
                (Storage::Packed16, _) => "vec4<u32>",
            };
            let _ = writeln!(
                s,
                "@group(0) @binding({i}) var<storage, {access}> b{i}: array<{elem}>;"
            );
        }
        if !self.sites.is_empty() {
            let _ = writeln!(
                s,
                "@group(0) @binding({}) var<storage, read_write> st: array<atomic<u32>>;",
                self.bindings.len()
            );
        }
        if self.sizes {
            s.push_str(&uniform_decl(
                self.bindings.len() + usize::from(!self.sites.is_empty()),
            ));
        }
        s.push('\n');
        // helpers the code calls; a helper may call one listed before it
        let mut text = format!("{}{main}", self.functions);
        let mut included = vec![];
        for (name, code) in pointwise::HELPERS.iter().rev() {
            if text.contains(&format!("{name}(")) {
                text.push_str(code);
                included.push(*code);
            }
        }
        for code in included.into_iter().rev() {
            s.push_str(code);
            s.push('\n');
        }
        s.push_str(&self.functions);
        s.push_str(main);
        s
    }
}

/// A kernel's WGSL and the buffers it binds, in binding order.
pub(crate) struct Built {
    pub wgsl: String,
    pub bindings: Vec<BufferIdx>,
    /// Pointwise ops inlined into it.
    pub fused: Vec<String>,
    /// Its run-time checks; with any, a status buffer binds after
    /// `bindings`.
    pub sites: Vec<Site>,
    /// Reads the sizes uniform, bound after the status buffer.
    pub sizes: bool,
    /// Appended to the kernel's name (`k7_mat_mul_coop`).
    pub tag: Option<&'static str>,
    /// Uses `shader-f16`.
    pub f16: bool,
}

impl Built {
    pub fn tagged(self, tag: &'static str) -> Built {
        Built {
            tag: Some(tag),
            ..self
        }
    }
}

/// The node a check of `v` names.
/// The four 16-bit floats (`dtype` bf16 or f16) packed two a word in u32
/// expressions `lo` and `hi`, as a `vec4<f32>` (low halves first).
fn unpack4(dtype: DType, lo: &str, hi: &str) -> String {
    match dtype {
        DType::BF16 => format!(
            "bitcast<vec4<f32>>(vec4<u32>({lo} << 16u, {lo} & 0xffff0000u, {hi} << 16u, {hi} & 0xffff0000u))"
        ),
        _ => format!("vec4<f32>(f16dec({lo}), f16dec({lo} >> 16u), f16dec({hi}), f16dec({hi} >> 16u))"),
    }
}

fn node_of(v: &LazyRef) -> &str {
    v.node.as_deref().unwrap_or("(unnamed)")
}

/// Row-major linear index of `idx` in `shape`.
/// The index into a value of `shape` that an expand of it reads at `idx`
/// (the expanded rank): leading dims dropped, broadcast dims at 0.
pub(crate) fn expanded_index(idx: &[String], shape: &[usize]) -> Vec<String> {
    let lead = idx.len() - shape.len();
    shape
        .iter()
        .enumerate()
        .map(|(d, &n)| match n {
            1 => "0u".to_string(),
            _ => idx[lead + d].clone(),
        })
        .collect()
}

pub(crate) fn linear(idx: &[String], shape: &[usize]) -> String {
    let mut terms = vec![];
    let mut stride = 1usize;
    for (i, &n) in idx.iter().zip(shape).rev() {
        if n != 1 {
            terms.push(if stride == 1 {
                i.clone()
            } else {
                format!("{i} * {stride}u")
            });
        }
        stride *= n;
    }
    if terms.is_empty() {
        "0u".into()
    } else {
        terms.reverse();
        terms.join(" + ")
    }
}

/// The multi-index of linear index `lin` (a u32 name) in `shape`.
pub(crate) fn unravel(lin: &str, shape: &[usize]) -> Vec<String> {
    let mut stride: usize = shape.iter().product();
    shape
        .iter()
        .map(|&n| {
            stride /= n.max(1);
            if n == 1 {
                "0u".to_string()
            } else if stride == 1 {
                modulo(lin, n)
            } else {
                modulo(&format!("({lin} / {stride}u)"), n)
            }
        })
        .collect()
}

fn modulo(x: &str, n: usize) -> String {
    if n == 1 {
        "0u".into()
    } else {
        format!("({x} % {n}u)")
    }
}

fn affine(i: &str, step: usize, start: usize) -> String {
    match (step, start) {
        (1, 0) => i.to_string(),
        (1, s) => format!("{i} + {s}u"),
        (k, 0) => format!("{i} * {k}u"),
        (k, s) => format!("{i} * {k}u + {s}u"),
    }
}

pub(crate) use crate::payload::grid;

/// The flat workgroup index in a kernel dispatched with [`grid`].
pub(crate) const FLAT_GROUP: &str = "(wid.x + wid.y * nwg.x)";

/// The signature of a kernel's entry point with the builtins templates use.
pub(crate) fn entry(workgroup_size: u32) -> String {
    format!(
        "@compute @workgroup_size({workgroup_size})\n\
         fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, \
         @builtin(local_invocation_index) lid: u32) {{\n"
    )
}

/// Strided loops of at most this many trips are written out
/// ([`lane_strided`]).
const UNROLLED_TRIPS: usize = 8;

/// Statements running `body` (statements reading `var`) for `var` = `lid`,
/// `lid + step`, … below `count`, in that order: written out trip by trip
/// where that takes at most [`UNROLLED_TRIPS`] trips (the last one guarded
/// where `count` is not a multiple of `step`), so that every trip's loads
/// can be issued before the first one's value is used (on an H100, writing
/// out a decode step's staging fills and RMSNorm sums took a bf16
/// Llama-1B step from 1.95 to 1.88 ms of GPU time); else a loop.
pub(crate) fn lane_strided(var: &str, count: usize, step: usize, body: &str) -> String {
    let trips = count.div_ceil(step.max(1));
    if trips > UNROLLED_TRIPS {
        return format!(
            "  for (var {var} = lid; {var} < {count}u; {var} = {var} + {step}u) {{\n{body}  }}\n"
        );
    }
    let mut s = String::new();
    for j in 0..trips {
        let _ = writeln!(s, "  {{\n    let {var} = lid + {}u;", j * step);
        let _ = match (j + 1) * step <= count {
            true => writeln!(s, "{body}  }}"),
            false => writeln!(s, "    if ({var} < {count}u) {{\n{body}    }}\n  }}"),
        };
    }
    s
}

#[cfg(test)]
mod tests {
    use super::lane_strided;

    #[test]
    fn short_strided_loops_are_written_out_and_the_last_partial_trip_guarded() {
        let body = "    s = s + a[i];\n";
        let exact = lane_strided("i", 512, 256, body);
        assert!(!exact.contains("for") && !exact.contains("if"), "{exact}");
        assert!(exact.contains("let i = lid + 0u;") && exact.contains("let i = lid + 256u;"));
        let partial = lane_strided("i", 300, 256, body);
        assert!(
            partial.contains("let i = lid + 256u;\n    if (i < 300u)"),
            "{partial}"
        );
        assert_eq!(partial.matches("if (").count(), 1);
        let long = lane_strided("i", 9 * 256, 256, body);
        assert!(
            long.starts_with("  for (var i = lid; i < 2304u; i = i + 256u)"),
            "{long}"
        );
    }
}
