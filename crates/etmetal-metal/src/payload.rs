//! The delegate payload: what `preprocess` writes into a `.pte` for one
//! partition and what the GPU runtime executes. Pure data, no native code.
//!
//! Layout on disk: the 4-byte magic `EMTL`, the major and minor version as
//! little-endian `u16`s, then the payload as UTF-8 JSON. A reader rejects a
//! newer major version; a newer minor version only adds fields a reader
//! may ignore.
//!
//! Execution model (what the runtime relies on):
//! - Every tensor the delegate touches is a [`Buffer`]: a weight uploaded
//!   once from the `.pte`'s named data (bound read-only), or a range of an
//!   arena buffer allocated once at load (bound `read_write`, since wgpu
//!   forbids read-only and writable bindings of one buffer in a dispatch).
//! - Delegate inputs are written into their arena ranges, every
//!   [`Dispatch`] is recorded in order into one compute pass of one command
//!   buffer, outputs are copied out of the arena.
//! - A [`State`] (a mutable buffer, such as a KV cache, that only this
//!   delegate reads and writes) stays on the GPU across executes: its input
//!   is written only when the caller passes a host value (the first execute,
//!   after a reset or after another method changed it), and its new value is
//!   copied into the input's range at the end of the command buffer instead
//!   of being read back (nothing to copy where it is the input's own
//!   buffer, which the kernels wrote in place).
//! - A kernel binds its buffers at `@group(0) @binding(i)`, i in the order
//!   of [`Dispatch::buffers`]; static shapes are baked into the WGSL.
//! - Bounded dynamic shapes (payload 1.3): the payload's [`Symbol`]s are
//!   read from delegate input dims at each execute (checked against their
//!   ranges). Every buffer is allocated and laid out at its upper bound
//!   (row-major strides of [`Buffer::shape`]), so index arithmetic stays
//!   static; a delegate input is written into that layout and an output
//!   read out of it at its actual shape ([`Buffer::dims`]). A dispatch's
//!   [`Dispatch::groups`] is its workgroup count at the actual sizes (the
//!   valid part of its grid; counts stop mattering for correctness, only
//!   for time), and a kernel with [`Kernel::sizes`] reads the symbols'
//!   values from one uniform buffer (`array<vec4<u32>, N>`, symbol `i` at
//!   `[i / 4][i % 4]`) bound after its storage buffers.
//! - On the GPU a tensor is stored as [`GpuRepr`] says: int64 narrowed to
//!   i32 (checked when written), bool/u8/i8 widened to one u32 an element,
//!   f16/bf16 packed two a u32 (the host bytes, padded to 4).
//! - Integer arithmetic the GPU computes in i32 for int64 (and integer
//!   division) is checked as it runs: a dispatch with [`Check`]s ORs bits
//!   into its status buffer, which the runtime zeroes before the dispatches
//!   and reads back with the outputs; a set bit fails the execute, naming
//!   the kernel and node, instead of returning a wrapped number.
//! - A dispatch may carry [`Alternative`]s (payload 1.2): dispatches that
//!   compute the same result faster on a device offering what the
//!   alternative [`Needs`] (a cooperative-matrix configuration). The runtime
//!   runs the first alternative its device meets in the dispatch's place,
//!   else the dispatch itself, the portable form every device runs. Kernels
//!   that only alternatives use are built only where an alternative is
//!   chosen; buffers they bind are planned as live at the dispatch.

use std::borrow::Cow;

use etmetal_core::sym::SymExpr;
use etmetal_core::{DType, Error, Result, Tensor};
use serde::{Deserialize, Serialize};

pub const MAGIC: &[u8; 4] = b"EMTL";
/// Bumped when a reader of the previous major version would misread.
pub const VERSION_MAJOR: u16 = 1;
/// 1.1: [`Payload::state`] and [`Payload::checks`]; 1.2:
/// [`Dispatch::alternatives`]; 1.3: [`Payload::symbols`] and the run-time
/// sizes that use them. A payload with no symbol is written as 1.2, so
/// static programs keep their bytes.
pub const VERSION_MINOR: u16 = 3;

/// Workgroup counts covering `groups` workgroups within the per-dimension
/// limit (x first, then y); kernels read the flat index
/// `wid.x + wid.y * nwg.x`.
pub fn grid(groups: u64, max_per_dim: u32) -> Result<[u32; 3]> {
    let max = u64::from(max_per_dim);
    let x = groups.clamp(1, max);
    let y = groups.div_ceil(x);
    if y > max {
        return Err(Error::limit(format!(
            "{groups} workgroups exceed the {max}×{max} dispatch grid"
        )));
    }
    Ok([x as u32, y as u32, 1])
}

/// Offsets of arena ranges are multiples of this (wgpu's default and the
/// largest `min_storage_buffer_offset_alignment` of real adapters).
pub const ARENA_ALIGN: u64 = 256;

pub type BufferId = usize;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Payload {
    pub buffers: Vec<Buffer>,
    /// Distinct shader modules; dispatches refer to them by index, so
    /// repeated layers share one pipeline.
    pub kernels: Vec<Kernel>,
    pub dispatches: Vec<Dispatch>,
    /// Buffers of the delegate call's inputs, in argument order.
    pub inputs: Vec<BufferId>,
    /// Buffers of the delegate call's outputs, in argument order; each is an
    /// arena buffer no other output shares.
    pub outputs: Vec<BufferId>,
    /// Byte size of each arena buffer.
    pub arenas: Vec<u64>,
    pub requirements: Requirements,
    /// Mutable buffers kept on the GPU across executes (payload 1.1).
    #[serde(default)]
    pub state: Vec<State>,
    /// The run-time checks of dispatches that compute int64 in i32 or
    /// divide integers (since 1.1; none in older payloads).
    #[serde(default)]
    pub checks: Vec<Check>,
    /// The run-time sizes of a bounded-dynamic delegate (payload 1.3).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub symbols: Vec<Symbol>,
}

/// A run-time size symbol, read from dim `dim` of delegate input `input`
/// (an index into [`Payload::inputs`]) of size `scale * value + offset`,
/// within `min..=max`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Symbol {
    /// The program's name for it (`s0`), for messages.
    pub name: String,
    pub input: usize,
    pub dim: usize,
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub scale: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub offset: i64,
    pub min: i64,
    pub max: i64,
}

fn one() -> i64 {
    1
}
fn is_one(x: &i64) -> bool {
    *x == 1
}
fn is_zero(x: &i64) -> bool {
    *x == 0
}

/// An integer expression over [`Payload::symbols`] (by index), as
/// `etmetal_core::sym::SymExpr` writes it, evaluated at each execute.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Size {
    Const(i64),
    Sym(usize),
    Add(Vec<Size>),
    Mul(Vec<Size>),
    /// Python's `//`.
    FloorDiv(Box<Size>, Box<Size>),
    /// Python's `%`.
    Mod(Box<Size>, Box<Size>),
    Max(Box<Size>, Box<Size>),
    Min(Box<Size>, Box<Size>),
}

impl Size {
    /// `e` with its symbols numbered as in `names`; `None` when it uses
    /// another symbol.
    pub fn of(e: &SymExpr, names: &[String]) -> Option<Size> {
        let two = |a: &SymExpr, b: &SymExpr| {
            Some((Box::new(Size::of(a, names)?), Box::new(Size::of(b, names)?)))
        };
        let all = |xs: &[SymExpr]| {
            xs.iter()
                .map(|x| Size::of(x, names))
                .collect::<Option<Vec<_>>>()
        };
        Some(match e {
            SymExpr::Const(c) => Size::Const(*c),
            SymExpr::Sym(s) => Size::Sym(names.iter().position(|n| n == s)?),
            SymExpr::Add(xs) => Size::Add(all(xs)?),
            SymExpr::Mul(xs) => Size::Mul(all(xs)?),
            SymExpr::FloorDiv(a, b) => two(a, b).map(|(a, b)| Size::FloorDiv(a, b))?,
            SymExpr::Mod(a, b) => two(a, b).map(|(a, b)| Size::Mod(a, b))?,
            SymExpr::Max(a, b) => two(a, b).map(|(a, b)| Size::Max(a, b))?,
            SymExpr::Min(a, b) => two(a, b).map(|(a, b)| Size::Min(a, b))?,
        })
    }

    /// The value with symbol `i` at `values[i]`.
    pub fn eval(&self, values: &[i64]) -> Result<i64> {
        let names: Vec<String> = (0..values.len()).map(|i| format!("{i}")).collect();
        let bindings = names.iter().cloned().zip(values.iter().copied()).collect();
        self.to_sym(&names)?.eval(&bindings)
    }

    /// The expression with symbol `i` named `names[i]`.
    pub fn to_sym(&self, names: &[String]) -> Result<SymExpr> {
        let one = |x: &Size| x.to_sym(names);
        Ok(match self {
            Size::Const(c) => SymExpr::Const(*c),
            Size::Sym(i) => SymExpr::sym(
                names
                    .get(*i)
                    .ok_or_else(|| {
                        Error::format(format!(
                            "EtMetalBackend payload: size symbol {i} does not exist"
                        ))
                    })?
                    .clone(),
            ),
            Size::Add(xs) => xs
                .iter()
                .map(one)
                .try_fold(SymExpr::Const(0), |a, x| Ok::<_, Error>(a + x?))?,
            Size::Mul(xs) => xs
                .iter()
                .map(one)
                .try_fold(SymExpr::Const(1), |a, x| Ok::<_, Error>(a * x?))?,
            Size::FloorDiv(a, b) => SymExpr::floor_div(one(a)?, one(b)?)?,
            Size::Mod(a, b) => SymExpr::modulo(one(a)?, one(b)?)?,
            Size::Max(a, b) => SymExpr::max(one(a)?, one(b)?),
            Size::Min(a, b) => SymExpr::min(one(a)?, one(b)?),
        })
    }
}

/// A mutable buffer the delegate keeps resident: delegate input `input`
/// holds its current value, and arena buffer `new_value` (not a delegate
/// output) its value after the execute, copied into the input's range last
/// (unless `new_value` is the input's own buffer, which the kernels wrote
/// in place).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct State {
    /// The buffer's fully qualified name in the module (`layers.0.k_cache`).
    pub fqn: String,
    /// Index into [`Payload::inputs`].
    pub input: usize,
    pub new_value: BufferId,
}

/// The status buffer of one dispatch: arena words its kernel ORs bits into
/// (`atomicOr`), bit `i` (word `i / 32`) when `sites[i]` fails.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Check {
    pub dispatch: usize,
    pub buffer: BufferId,
    pub sites: Vec<Site>,
}

/// One checked operation of a kernel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Site {
    /// The graph node it computes.
    pub node: String,
    /// The node's op name, as `--skip-op` takes it.
    pub op: String,
    pub fault: Fault,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Fault {
    /// A result outside the i32 range that int64 values are computed in.
    Overflow,
    /// An integer division or remainder by zero (an error on the CPU too).
    ZeroDivision,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Buffer {
    /// The graph value it holds, for messages.
    pub name: String,
    /// The host dtype (what the `.pte` declares for the tensor).
    #[serde(with = "dtype_name")]
    pub dtype: DType,
    /// The size at the upper bound where dynamic (the layout on the GPU).
    pub shape: Vec<usize>,
    pub location: Location,
    /// The actual size of each dim (payload 1.3): empty when static.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dims: Vec<Size>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Location {
    /// Named data of the `.pte`, already in [`GpuRepr`] form.
    Weight { key: String },
    /// `offset` bytes into arena `arena`, [`ARENA_ALIGN`]-aligned.
    Arena { arena: usize, offset: u64 },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Kernel {
    /// Unique within the payload (`k3_matmul_add_relu`).
    pub name: String,
    /// The graph ops fused into it, in order (`["mat_mul", "add", "relu"]`).
    pub ops: Vec<String>,
    pub wgsl: String,
    /// naga's MSL translation of `wgsl` (opt-in passthrough on Metal).
    pub msl: String,
    pub entry_point: String,
    /// One entry per binding: whether the kernel writes it.
    pub bindings: Vec<Access>,
    pub workgroup_size: [u32; 3],
    /// Binds the sizes uniform after its storage buffers (payload 1.3).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sizes: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Access {
    Read,
    ReadWrite,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Dispatch {
    pub kernel: usize,
    /// The graph nodes this dispatch computes, for messages and `inspect`.
    pub nodes: Vec<String>,
    pub buffers: Vec<BufferId>,
    /// At the upper bound where sizes are dynamic.
    pub workgroups: [u32; 3],
    /// The flat workgroup count at the actual sizes (payload 1.3), spread
    /// over the grid as [`grid`] does; none: `workgroups` always.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub groups: Option<Size>,
    /// Faster forms of this dispatch for devices that offer more, in order
    /// of preference (payload 1.2; none in older payloads). Their own
    /// dispatches have no alternatives.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub alternatives: Vec<Alternative>,
}

/// Dispatches that replace one dispatch, writing what it writes, on a
/// device that offers [`Alternative::needs`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Alternative {
    pub needs: Needs,
    pub dispatches: Vec<Dispatch>,
}

/// What an [`Alternative`]'s kernels need beyond the payload's
/// [`Requirements`]: a cooperative-matrix configuration the adapter reports
/// (`C[m×n] += A[m×k]·B[k×n]` in one subgroup, the kernels also use
/// `shader-f16` and the subgroup builtins), subgroups of exactly
/// `subgroup_size` invocations (each subgroup of a workgroup owns its own
/// tiles), and workgroup memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Needs {
    pub m: u32,
    pub n: u32,
    pub k: u32,
    /// Element type of A and B.
    pub ab: CoopType,
    /// Element type of C and the result.
    pub cr: CoopType,
    pub subgroup_size: u32,
    pub workgroup_storage: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CoopType {
    F16,
    F32,
}

impl Needs {
    /// 16×16×16 f16 × f16 → f32 matrices (the configuration NVIDIA GPUs
    /// report) in subgroups of `subgroup_size`, with `workgroup_storage`
    /// bytes of workgroup memory.
    pub const fn f16_16x16x16(subgroup_size: u32, workgroup_storage: u32) -> Needs {
        Needs {
            m: 16,
            n: 16,
            k: 16,
            ab: CoopType::F16,
            cr: CoopType::F32,
            subgroup_size,
            workgroup_storage,
        }
    }

    /// Whether kernels of this form have run on a real GPU, their results
    /// checked against PyTorch's there: the 16×16×16 f16 form has (NVIDIA
    /// GPUs through Vulkan, README "Tensor cores"), the 8×8×8 f32 form has
    /// not (no Apple GPU is part of the test setup). The runtime's default
    /// measured choice offers only forms that have.
    pub fn has_run(&self) -> bool {
        (self.m, self.n, self.k, self.ab) == (16, 16, 16, CoopType::F16)
    }

    /// 8×8×8 f32 × f32 → f32 matrices (Apple GPUs' simdgroup matrices
    /// through Metal) in subgroups of `subgroup_size`, with
    /// `workgroup_storage` bytes of workgroup memory.
    pub const fn f32_8x8x8(subgroup_size: u32, workgroup_storage: u32) -> Needs {
        Needs {
            m: 8,
            n: 8,
            k: 8,
            ab: CoopType::F32,
            cr: CoopType::F32,
            subgroup_size,
            workgroup_storage,
        }
    }

    /// `16x16x16 f16->f32, subgroup 32`
    pub fn describe(&self) -> String {
        let ty = |t: CoopType| match t {
            CoopType::F16 => "f16",
            CoopType::F32 => "f32",
        };
        format!(
            "{}x{}x{} {}->{}, subgroup {}",
            self.m,
            self.n,
            self.k,
            ty(self.ab),
            ty(self.cr),
            self.subgroup_size
        )
    }
}

/// What the device must offer; the runtime requests these limits and
/// refuses to load, naming the limit, when the adapter has less.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Requirements {
    pub max_storage_buffer_binding_size: u64,
    pub max_buffer_size: u64,
    pub max_storage_buffers_per_shader_stage: u32,
    pub max_compute_workgroup_storage_size: u32,
    pub max_compute_invocations_per_workgroup: u32,
    pub max_compute_workgroups_per_dimension: u32,
    pub shader_f16: bool,
}

impl Default for Requirements {
    /// wgpu's default limits, which every adapter meets.
    fn default() -> Self {
        Requirements {
            max_storage_buffer_binding_size: 128 << 20,
            max_buffer_size: 256 << 20,
            max_storage_buffers_per_shader_stage: 8,
            max_compute_workgroup_storage_size: 16384,
            max_compute_invocations_per_workgroup: 256,
            max_compute_workgroups_per_dimension: 65535,
            shader_f16: false,
        }
    }
}

impl Requirements {
    /// Per field, the larger of the two: what a device must offer to load
    /// delegates needing `self` and `other`.
    pub fn union(&self, other: &Requirements) -> Requirements {
        Requirements {
            max_storage_buffer_binding_size: self
                .max_storage_buffer_binding_size
                .max(other.max_storage_buffer_binding_size),
            max_buffer_size: self.max_buffer_size.max(other.max_buffer_size),
            max_storage_buffers_per_shader_stage: self
                .max_storage_buffers_per_shader_stage
                .max(other.max_storage_buffers_per_shader_stage),
            max_compute_workgroup_storage_size: self
                .max_compute_workgroup_storage_size
                .max(other.max_compute_workgroup_storage_size),
            max_compute_invocations_per_workgroup: self
                .max_compute_invocations_per_workgroup
                .max(other.max_compute_invocations_per_workgroup),
            max_compute_workgroups_per_dimension: self
                .max_compute_workgroups_per_dimension
                .max(other.max_compute_workgroups_per_dimension),
            shader_f16: self.shader_f16 || other.shader_f16,
        }
    }
}

/// How a host dtype is stored in a GPU buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuRepr {
    F32,
    I32,
    /// int64 on the host, i32 on the GPU.
    I64AsI32,
    /// bool/u8/i8 on the host, one `u32` (bool, u8) or `i32` (i8) an element.
    Widened,
    /// f16/bf16: the host bytes, two elements a `u32`.
    Packed16,
}

impl GpuRepr {
    pub fn of(dtype: DType) -> Result<GpuRepr> {
        Ok(match dtype {
            DType::F32 => GpuRepr::F32,
            DType::I32 => GpuRepr::I32,
            DType::I64 => GpuRepr::I64AsI32,
            DType::Bool | DType::U8 | DType::I8 => GpuRepr::Widened,
            DType::F16 | DType::BF16 => GpuRepr::Packed16,
            DType::I16 | DType::F64 => {
                return Err(Error::unsupported(format!(
                    "{} tensors have no GPU storage",
                    dtype.name()
                )))
            }
        })
    }
}

/// Where a delegate keeps a value, which decides its GPU form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A delegate input, output or weight: the host's values in their
    /// [`GpuRepr`] (16-bit floats packed two a word).
    Boundary,
    /// Written and read on the GPU only: 16-bit floats are kept in f32
    /// (kernels compute in f32 and do not round between ops).
    Intermediate,
}

/// The dtype a payload buffer declares for values of `dtype` kept in
/// `role`.
pub fn buffer_dtype(dtype: DType, role: Role) -> DType {
    match role {
        Role::Intermediate if dtype.is_float() => DType::F32,
        _ => dtype,
    }
}

/// The most bytes a value of `dtype` with `numel` elements takes in a
/// delegate, whichever [`Role`] it has: the size the partitioner checks
/// against the binding limit, and so a bound on every buffer preprocess
/// makes for the value.
pub fn value_gpu_bytes(dtype: DType, numel: usize) -> Result<u64> {
    let boundary = gpu_bytes(buffer_dtype(dtype, Role::Boundary), numel)?;
    let intermediate = gpu_bytes(buffer_dtype(dtype, Role::Intermediate), numel)?;
    Ok(boundary.max(intermediate))
}

/// Bytes a tensor of `dtype` and `numel` elements takes on the GPU (a
/// multiple of 4, at least 4 so empty tensors still bind).
pub fn gpu_bytes(dtype: DType, numel: usize) -> Result<u64> {
    let n = numel as u64;
    let words = match GpuRepr::of(dtype)? {
        GpuRepr::Packed16 => n.div_ceil(2),
        _ => n,
    };
    // Checked: a payload's shape may be anything up to usize::MAX elements.
    let bytes = words.checked_mul(4).ok_or_else(|| {
        Error::limit(format!(
            "{numel} {} elements take more than u64::MAX bytes on the GPU",
            dtype.name()
        ))
    })?;
    Ok(bytes.max(4))
}

impl GpuRepr {
    /// Host bytes and GPU bytes of one conversion unit: `(host, gpu)`.
    /// Layout-preserving forms convert byte for byte (16-bit floats keep the
    /// host bytes, two elements a word), so a unit is one byte there.
    pub fn unit(self, dtype: DType) -> (usize, usize) {
        match self {
            GpuRepr::F32 | GpuRepr::I32 | GpuRepr::Packed16 => (1, 1),
            GpuRepr::I64AsI32 => (8, 4),
            GpuRepr::Widened => (dtype.size(), 4),
        }
    }

    /// Whether host and GPU bytes are the same (a copy converts).
    pub fn same_layout(self) -> bool {
        matches!(self, GpuRepr::F32 | GpuRepr::I32 | GpuRepr::Packed16)
    }
}

/// The GPU words of the host elements `src` of `dtype`, for the forms that
/// change layout (int64 narrowed, bool/u8/i8 widened). An int64 that does not
/// fit the GPU's 32-bit integers gives `Err((its index in src, value))`.
pub fn gpu_words(
    dtype: DType,
    src: &[u8],
) -> impl Iterator<Item = std::result::Result<[u8; 4], (usize, i64)>> + '_ {
    let narrow = dtype == DType::I64;
    let signed = dtype == DType::I8;
    let width = if narrow { 8 } else { 1 };
    src.chunks_exact(width).enumerate().map(move |(i, c)| {
        if narrow {
            let v = i64::from_le_bytes(c.try_into().expect("8-byte chunk"));
            i32::try_from(v).map(i32::to_le_bytes).map_err(|_| (i, v))
        } else if signed {
            Ok(i32::from(c[0] as i8).to_le_bytes())
        } else {
            Ok(u32::from(c[0]).to_le_bytes())
        }
    })
}

/// The error of an int64 element `value` at `index` of tensor `what` that
/// does not fit the GPU's 32-bit integers.
pub fn int64_does_not_fit(what: &str, index: usize, value: i64) -> Error {
    Error::limit(format!(
        "{what}: int64 element {index} = {value} does not fit the GPU's 32-bit integers"
    ))
}

/// The GPU bytes of a host tensor, borrowed when the host layout already is
/// the GPU's (f32, i32, and 16-bit floats of even length); `what` names it
/// in the error raised when an int64 value does not fit in i32.
pub fn to_gpu<'t>(tensor: &'t Tensor, what: &str) -> Result<Cow<'t, [u8]>> {
    let bytes = tensor.bytes();
    let size = gpu_bytes(tensor.dtype(), tensor.numel())? as usize;
    let repr = GpuRepr::of(tensor.dtype())?;
    if repr.same_layout() && bytes.len() == size {
        return Ok(Cow::Borrowed(bytes));
    }
    let mut out = Vec::with_capacity(size);
    if repr.same_layout() {
        out.extend_from_slice(bytes);
    } else {
        for word in gpu_words(tensor.dtype(), bytes) {
            out.extend_from_slice(&word.map_err(|(i, v)| int64_does_not_fit(what, i, v))?);
        }
    }
    out.resize(size, 0);
    Ok(Cow::Owned(out))
}

/// Convert whole GPU units `src` into host elements `dst` of `dtype`
/// ([`GpuRepr::unit`] bytes each side): int64 widened back from i32,
/// bool/u8/i8 narrowed from a word (a bool is any non-zero word).
pub fn host_from_gpu(dtype: DType, src: &[u8], dst: &mut [u8]) {
    let word = |c: &[u8]| i32::from_le_bytes(c.try_into().expect("4-byte chunk"));
    match GpuRepr::of(dtype) {
        Ok(GpuRepr::I64AsI32) => {
            for (d, s) in dst.chunks_exact_mut(8).zip(src.chunks_exact(4)) {
                d.copy_from_slice(&i64::from(word(s)).to_le_bytes());
            }
        }
        Ok(GpuRepr::Widened) => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = match dtype {
                    DType::Bool => u8::from(word(s) != 0),
                    _ => word(s) as u8,
                };
            }
        }
        _ => dst.copy_from_slice(&src[..dst.len()]),
    }
}

impl Payload {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&VERSION_MAJOR.to_le_bytes());
        let minor = if self.symbols.is_empty() {
            2
        } else {
            VERSION_MINOR
        };
        out.extend_from_slice(&minor.to_le_bytes());
        out.extend_from_slice(
            &serde_json::to_vec(self).expect("a payload always serialises to JSON"),
        );
        out
    }

    /// Parse and check a payload: version, and every index and range it
    /// holds, so the runtime can trust it.
    pub fn decode(bytes: &[u8]) -> Result<Payload> {
        if bytes.len() < 8 || &bytes[..4] != MAGIC {
            return Err(Error::format(
                "EtMetalBackend payload: missing the `EMTL` magic at offset 0 (not an etmetal payload)",
            ));
        }
        let major = u16::from_le_bytes([bytes[4], bytes[5]]);
        let minor = u16::from_le_bytes([bytes[6], bytes[7]]);
        if major != VERSION_MAJOR {
            return Err(Error::unsupported(format!(
                "EtMetalBackend payload version {major}.{minor} is not readable by this etmetal \
                 (reads {VERSION_MAJOR}.x); recompile the model with this etmetal"
            )));
        }
        let payload: Payload = serde_json::from_slice(&bytes[8..]).map_err(|e| {
            Error::format(format!(
                "EtMetalBackend payload: bad JSON at byte {} of the body: {e}",
                e.column()
            ))
        })?;
        payload.verify()?;
        Ok(payload)
    }

    fn verify(&self) -> Result<()> {
        let bad = |m: String| Error::format(format!("EtMetalBackend payload: {m}"));
        for (i, b) in self.buffers.iter().enumerate() {
            let numel = b
                .shape
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .ok_or_else(|| bad(format!("buffer {i} `{}`: shape overflows", b.name)))?;
            let bytes = gpu_bytes(b.dtype, numel)?;
            if let Location::Arena { arena, offset } = b.location {
                let size = *self.arenas.get(arena).ok_or_else(|| {
                    bad(format!(
                        "buffer {i} `{}`: arena {arena} does not exist",
                        b.name
                    ))
                })?;
                if offset % ARENA_ALIGN != 0 || offset.checked_add(bytes).is_none_or(|e| e > size) {
                    return Err(bad(format!(
                        "buffer {i} `{}`: {bytes} bytes at offset {offset} do not fit arena {arena} \
                         ({size} bytes) at {ARENA_ALIGN}-byte alignment",
                        b.name
                    )));
                }
            }
        }
        let buffer = |id: BufferId, what: &str| {
            self.buffers.get(id).ok_or_else(|| {
                bad(format!(
                    "{what} refers to buffer {id}, which does not exist"
                ))
            })
        };
        for (k, &id) in self.inputs.iter().chain(&self.outputs).enumerate() {
            buffer(id, &format!("delegate argument {k}"))?;
        }
        for (k, &id) in self.outputs.iter().enumerate() {
            if !matches!(buffer(id, "output")?.location, Location::Arena { .. }) {
                return Err(bad(format!("output {k} is not an arena buffer")));
            }
        }
        for (k, st) in self.state.iter().enumerate() {
            let what = format!("state {k} `{}`", st.fqn);
            let &id = self
                .inputs
                .get(st.input)
                .ok_or_else(|| bad(format!("{what}: input {} does not exist", st.input)))?;
            let (old, new) = (buffer(id, &what)?, buffer(st.new_value, &what)?);
            if !matches!(new.location, Location::Arena { .. })
                || (old.dtype, &old.shape) != (new.dtype, &new.shape)
            {
                return Err(bad(format!(
                    "{what}: new value `{}` is not an arena buffer of the input's dtype and shape",
                    new.name
                )));
            }
            if self.state[..k].iter().any(|o| o.input == st.input) {
                return Err(bad(format!("{what}: input {} is state twice", st.input)));
            }
        }
        for (d, dispatch) in self.dispatches.iter().enumerate() {
            self.verify_dispatch(dispatch, &format!("dispatch {d}"))?;
            for (a, alt) in dispatch.alternatives.iter().enumerate() {
                let what = format!("dispatch {d} alternative {a}");
                let n = alt.needs;
                let sizes = [n.m, n.n, n.k].iter().all(|s| [8, 16].contains(s));
                if !sizes || !(4..=128).contains(&n.subgroup_size) || alt.dispatches.is_empty() {
                    return Err(bad(format!(
                        "{what} needs {} with {} dispatches, which no device offers",
                        n.describe(),
                        alt.dispatches.len()
                    )));
                }
                for (i, inner) in alt.dispatches.iter().enumerate() {
                    let what = format!("{what} dispatch {i}");
                    if !inner.alternatives.is_empty() {
                        return Err(bad(format!("{what} has alternatives of its own")));
                    }
                    self.verify_dispatch(inner, &what)?;
                }
            }
        }
        self.verify_sizes()?;
        for (c, check) in self.checks.iter().enumerate() {
            let dispatch = self.dispatches.get(check.dispatch).ok_or_else(|| {
                bad(format!(
                    "check {c} is of dispatch {}, which does not exist",
                    check.dispatch
                ))
            })?;
            let b = buffer(check.buffer, &format!("check {c}"))?;
            let words: usize = b.shape.iter().product();
            if !matches!(b.location, Location::Arena { .. })
                || !dispatch.buffers.contains(&check.buffer)
                || words.saturating_mul(32) < check.sites.len()
                || !dispatch.alternatives.is_empty()
            {
                return Err(bad(format!(
                    "check {c}: status buffer `{}` is not an arena buffer of dispatch {} (one \
                     without alternatives) with a bit for each of its {} sites",
                    b.name,
                    check.dispatch,
                    check.sites.len()
                )));
            }
        }
        Ok(())
    }

    /// The symbols and every run-time size: symbols read from dims of
    /// delegate inputs that exist, sizes over symbols that exist.
    fn verify_sizes(&self) -> Result<()> {
        let bad = |m: String| Error::format(format!("EtMetalBackend payload: {m}"));
        let names: Vec<String> = self.symbols.iter().map(|s| s.name.clone()).collect();
        for (i, s) in self.symbols.iter().enumerate() {
            let rank = self
                .inputs
                .get(s.input)
                .and_then(|&b| self.buffers.get(b))
                .map(|b| b.shape.len());
            if rank.is_none_or(|r| s.dim >= r) || s.min < 0 || s.min > s.max || s.scale <= 0 {
                return Err(bad(format!(
                    "symbol {i} `{}` is dim {} of input {} in {}..={}, which does not exist",
                    s.name, s.dim, s.input, s.min, s.max
                )));
            }
        }
        for (i, b) in self.buffers.iter().enumerate() {
            if !b.dims.is_empty() && b.dims.len() != b.shape.len() {
                return Err(bad(format!(
                    "buffer {i} `{}`: dims of another rank",
                    b.name
                )));
            }
            for d in &b.dims {
                d.to_sym(&names)?;
            }
        }
        let all = self.dispatches.iter().chain(
            self.dispatches
                .iter()
                .flat_map(|d| d.alternatives.iter().flat_map(|a| &a.dispatches)),
        );
        for d in all {
            if let Some(g) = &d.groups {
                g.to_sym(&names)?;
            }
        }
        if self.kernels.iter().any(|k| k.sizes) && self.symbols.is_empty() {
            return Err(bad(
                "a kernel reads run-time sizes, but the payload has no symbols".into(),
            ));
        }
        Ok(())
    }

    /// A dispatch's kernel, bindings and workgroup counts; `what` names it.
    fn verify_dispatch(&self, dispatch: &Dispatch, what: &str) -> Result<()> {
        let bad = |m: String| Error::format(format!("EtMetalBackend payload: {what} {m}"));
        let kernel = self.kernels.get(dispatch.kernel).ok_or_else(|| {
            bad(format!(
                "uses kernel {}, which does not exist",
                dispatch.kernel
            ))
        })?;
        if kernel.bindings.len() != dispatch.buffers.len() {
            return Err(bad(format!(
                "binds {} buffers to kernel `{}`, which has {} bindings",
                dispatch.buffers.len(),
                kernel.name,
                kernel.bindings.len()
            )));
        }
        for (&id, access) in dispatch.buffers.iter().zip(&kernel.bindings) {
            let b = self
                .buffers
                .get(id)
                .ok_or_else(|| bad(format!("refers to buffer {id}, which does not exist")))?;
            let writable = matches!(b.location, Location::Arena { .. });
            if (*access == Access::ReadWrite) != writable {
                return Err(bad(format!(
                    "binds `{}` as {access:?}, but arena buffers bind read_write and weights \
                     read-only",
                    b.name
                )));
            }
        }
        if dispatch.workgroups.contains(&0)
            || dispatch
                .workgroups
                .iter()
                .any(|&w| w > self.requirements.max_compute_workgroups_per_dimension)
        {
            return Err(bad(format!(
                "(`{}`) has workgroup counts {:?} outside 1..={}",
                kernel.name,
                dispatch.workgroups,
                self.requirements.max_compute_workgroups_per_dimension
            )));
        }
        Ok(())
    }

    /// Keep the mutable buffer `fqn` on the GPU: delegate input `input`
    /// holds it, and output `output` (its new value) stops being an output.
    pub fn keep_resident(&mut self, fqn: &str, input: usize, output: usize) -> Result<()> {
        if input >= self.inputs.len() || output >= self.outputs.len() {
            return Err(Error::internal(format!(
                "state `{fqn}`: input {input} or output {output} is not in the payload"
            )));
        }
        let new_value = self.outputs.remove(output);
        self.state.push(State {
            fqn: fqn.to_string(),
            input,
            new_value,
        });
        self.verify()
    }

    /// The value of each symbol, read from the delegate inputs' shapes
    /// (`None` for an input given no tensor: resident state), each checked
    /// against its range.
    pub fn symbol_values(&self, inputs: &[Option<&[usize]>]) -> Result<Vec<i64>> {
        self.symbols
            .iter()
            .map(|s| {
                let name = self
                    .inputs
                    .get(s.input)
                    .map_or("?", |&b| self.buffers[b].name.as_str());
                let shape = inputs.get(s.input).copied().flatten().ok_or_else(|| {
                    Error::invalid_input(format!(
                        "delegate input {} (`{name}`) gives size `{}` but is not passed",
                        s.input, s.name
                    ))
                })?;
                let dim = shape.get(s.dim).map_or(-1, |&n| n as i64);
                let n = match s.scale {
                    0 => -1,
                    k if (dim - s.offset) % k != 0 => -1,
                    k => (dim - s.offset) / k,
                };
                if dim < 0 || n < s.min || n > s.max {
                    let n = dim;
                    return Err(Error::invalid_input(format!(
                        "delegate input {} (`{name}`) dim {} is {n}, outside the range {}..={} \
                         of its dynamic size `{}` the program was compiled for",
                        s.input,
                        s.dim,
                        s.scale * s.min + s.offset,
                        s.scale * s.max + s.offset,
                        s.name
                    )));
                }
                Ok(n)
            })
            .collect()
    }

    /// The actual shape of buffer `id` at symbol values `values`.
    pub fn actual_shape(&self, id: BufferId, values: &[i64]) -> Result<Vec<usize>> {
        let b = &self.buffers[id];
        if b.dims.is_empty() {
            return Ok(b.shape.clone());
        }
        b.dims
            .iter()
            .zip(&b.shape)
            .map(|(d, &bound)| {
                let n = d.eval(values)?;
                usize::try_from(n)
                    .ok()
                    .filter(|&n| n <= bound)
                    .ok_or_else(|| {
                        Error::invalid_input(format!(
                            "`{}`: size {n} is outside 0..={bound} at these sizes",
                            b.name
                        ))
                    })
            })
            .collect()
    }

    /// Names of the weights the payload needs from the named data.
    pub fn weight_keys(&self) -> impl Iterator<Item = &str> {
        self.buffers.iter().filter_map(|b| match &b.location {
            Location::Weight { key } => Some(key.as_str()),
            Location::Arena { .. } => None,
        })
    }
}

mod dtype_name {
    use etmetal_core::DType;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &DType, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(d.name())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DType, D::Error> {
        let name = String::deserialize(d)?;
        DType::from_name(&name)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown dtype `{name}`")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Payload {
        let wgsl = "@group(0) @binding(0) var<storage, read> w: array<f32>;\n\
                    @group(0) @binding(1) var<storage, read_write> y: array<f32>;\n\
                    @compute @workgroup_size(64) fn main(@builtin(global_invocation_id) g: vec3<u32>) {\n\
                    if (g.x < 6u) { y[g.x] = w[g.x] * 2.0; } }";
        Payload {
            buffers: vec![
                Buffer {
                    name: "w".into(),
                    dtype: DType::F32,
                    shape: vec![2, 3],
                    location: Location::Weight { key: "p0.w".into() },
                    dims: vec![],
                },
                Buffer {
                    name: "y".into(),
                    dtype: DType::F32,
                    shape: vec![2, 3],
                    location: Location::Arena {
                        arena: 0,
                        offset: 0,
                    },
                    dims: vec![],
                },
            ],
            kernels: vec![Kernel {
                name: "k0_mul".into(),
                ops: vec!["mul".into()],
                wgsl: wgsl.into(),
                msl: String::new(),
                entry_point: "main".into(),
                bindings: vec![Access::Read, Access::ReadWrite],
                workgroup_size: [64, 1, 1],
                sizes: false,
            }],
            dispatches: vec![Dispatch {
                kernel: 0,
                nodes: vec!["mul".into()],
                buffers: vec![0, 1],
                workgroups: [1, 1, 1],
                groups: None,
                alternatives: vec![],
            }],
            inputs: vec![],
            outputs: vec![1],
            arenas: vec![256],
            requirements: Requirements::default(),
            state: vec![],
            checks: vec![],
            symbols: vec![],
        }
    }

    /// `sample` with `y` an input of dynamic first dim `s` in 1..=2.
    fn dynamic() -> Payload {
        let mut p = sample();
        p.inputs = vec![1];
        p.outputs = vec![];
        p.symbols = vec![Symbol {
            name: "s".into(),
            input: 0,
            dim: 0,
            scale: 1,
            offset: 0,
            min: 1,
            max: 2,
        }];
        p.buffers[1].dims = vec![Size::Sym(0), Size::Const(3)];
        p.dispatches[0].groups = Some(Size::FloorDiv(
            Box::new(Size::Add(vec![
                Size::Mul(vec![Size::Const(3), Size::Sym(0)]),
                Size::Const(63),
            ])),
            Box::new(Size::Const(64)),
        ));
        p.kernels[0].sizes = true;
        p
    }

    #[test]
    fn dynamic_payloads_are_1_3_and_static_ones_stay_1_2() {
        let p = dynamic();
        let bytes = p.encode();
        assert_eq!(&bytes[4..8], &[1, 0, 3, 0]);
        let back = Payload::decode(&bytes).unwrap();
        assert_eq!(back, p);
        let groups = back.dispatches[0].groups.as_ref().unwrap();
        assert_eq!(
            (groups.eval(&[1]).unwrap(), groups.eval(&[30]).unwrap()),
            (1, 2)
        );
        assert_eq!(&sample().encode()[4..8], &[1, 0, 2, 0]);
        let text = String::from_utf8(sample().encode()[8..].to_vec()).unwrap();
        for field in ["\"symbols\"", "\"dims\"", "\"groups\"", "\"sizes\""] {
            assert!(
                !text.contains(field),
                "a static payload writes {field}: {text}"
            );
        }
    }

    #[test]
    fn bad_sizes_are_format_errors() {
        let mut p = dynamic();
        p.symbols[0].dim = 2;
        let e = Payload::decode(&p.encode()).unwrap_err();
        assert!(
            e.message().contains("symbol 0 `s` is dim 2 of input 0"),
            "{e}"
        );
        let mut p = dynamic();
        p.buffers[1].dims = vec![Size::Sym(1), Size::Const(3)];
        let e = Payload::decode(&p.encode()).unwrap_err();
        assert!(e.message().contains("size symbol 1 does not exist"), "{e}");
        let mut p = dynamic();
        p.symbols.clear();
        p.buffers[1].dims.clear();
        p.dispatches[0].groups = None;
        let e = Payload::decode(&p.encode()).unwrap_err();
        assert!(e.message().contains("reads run-time sizes"), "{e}");
    }

    #[test]
    fn decode_inverts_encode() {
        let p = sample();
        assert_eq!(Payload::decode(&p.encode()).unwrap(), p);
        assert_eq!(p.weight_keys().collect::<Vec<_>>(), ["p0.w"]);
    }

    #[test]
    fn version_1_0_payloads_have_no_checks() {
        let p = sample();
        let text = String::from_utf8(p.encode()[8..].to_vec()).unwrap();
        let old = text.replace(",\"checks\":[]", "");
        assert_ne!(old, text);
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&1u16.to_le_bytes());
        bytes.extend_from_slice(&0u16.to_le_bytes());
        bytes.extend_from_slice(old.as_bytes());
        assert_eq!(Payload::decode(&bytes).unwrap(), p);
    }

    #[test]
    fn newer_major_version_is_refused() {
        let mut bytes = sample().encode();
        bytes[4..6].copy_from_slice(&(VERSION_MAJOR + 1).to_le_bytes());
        let e = Payload::decode(&bytes).unwrap_err();
        assert!(e.message().contains("version 2.2"), "{e}");
        let mut minor = sample().encode();
        minor[6..8].copy_from_slice(&7u16.to_le_bytes());
        assert!(Payload::decode(&minor).is_ok());
    }

    #[test]
    fn bad_payloads_are_format_errors() {
        assert!(Payload::decode(b"EMT").is_err());
        let bytes = sample().encode();
        assert!(Payload::decode(&bytes[..bytes.len() - 3]).is_err());
        let mut p = sample();
        p.dispatches[0].buffers = vec![0, 9];
        assert!(Payload::decode(&p.encode())
            .unwrap_err()
            .message()
            .contains("buffer 9"));
        let mut p = sample();
        p.arenas = vec![8];
        assert!(Payload::decode(&p.encode()).is_err());
        let mut p = sample();
        p.kernels[0].bindings = vec![Access::ReadWrite, Access::ReadWrite];
        assert!(Payload::decode(&p.encode()).is_err());
        let mut p = sample();
        p.dispatches[0].workgroups = [0, 1, 1];
        assert!(Payload::decode(&p.encode()).is_err());
        // a check's status buffer must be an arena buffer its dispatch binds
        let site = Site {
            node: "mul_2".into(),
            op: "mul".into(),
            fault: Fault::Overflow,
        };
        let mut p = sample();
        p.checks = vec![Check {
            dispatch: 0,
            buffer: 1,
            sites: vec![site.clone()],
        }];
        assert_eq!(Payload::decode(&p.encode()).unwrap(), p);
        // `y` has 6 words, 192 bits
        for (dispatch, buffer, sites) in [(3, 1, 1), (0, 0, 1), (0, 1, 193)] {
            p.checks = vec![Check {
                dispatch,
                buffer,
                sites: vec![site.clone(); sites],
            }];
            assert!(Payload::decode(&p.encode())
                .unwrap_err()
                .message()
                .contains("check 0"));
        }
    }

    /// `sample` with an alternative to its dispatch: the same kernel, on a
    /// device offering 16×16×16 f16 matrices.
    fn with_alternative() -> Payload {
        let mut p = sample();
        let mut inner = p.dispatches[0].clone();
        inner.workgroups = [2, 1, 1];
        p.dispatches[0].alternatives = vec![Alternative {
            needs: Needs::f16_16x16x16(32, 32768),
            dispatches: vec![inner],
        }];
        p
    }

    #[test]
    fn alternatives_round_trip_and_older_payloads_have_none() {
        let p = with_alternative();
        assert_eq!(Payload::decode(&p.encode()).unwrap(), p);
        // a 1.1 payload: no `alternatives` key at all
        let text = String::from_utf8(sample().encode()[8..].to_vec()).unwrap();
        assert!(!text.contains("alternatives"));
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&1u16.to_le_bytes());
        bytes.extend_from_slice(&1u16.to_le_bytes());
        bytes.extend_from_slice(text.as_bytes());
        assert_eq!(Payload::decode(&bytes).unwrap(), sample());
    }

    #[test]
    fn bad_alternatives_are_format_errors() {
        let fails = |p: Payload, what: &str| {
            let e = Payload::decode(&p.encode()).unwrap_err();
            assert!(e.message().contains(what), "{e}");
        };
        let mut p = with_alternative();
        p.dispatches[0].alternatives[0].dispatches[0].kernel = 5;
        fails(p, "dispatch 0 alternative 0 dispatch 0 uses kernel 5");
        let mut p = with_alternative();
        p.dispatches[0].alternatives[0].dispatches[0].buffers = vec![0, 7];
        fails(p, "refers to buffer 7");
        let mut p = with_alternative();
        p.dispatches[0].alternatives[0].dispatches[0].workgroups = [1, 0, 1];
        fails(p, "workgroup counts");
        let mut p = with_alternative();
        p.dispatches[0].alternatives[0].needs.k = 12;
        fails(p, "which no device offers");
        let mut p = with_alternative();
        p.dispatches[0].alternatives[0].needs.subgroup_size = 0;
        fails(p, "which no device offers");
        let mut p = with_alternative();
        p.dispatches[0].alternatives[0].dispatches.clear();
        fails(p, "with 0 dispatches");
        let mut p = with_alternative();
        let nested = p.dispatches[0].clone();
        p.dispatches[0].alternatives[0].dispatches[0] = nested;
        fails(p, "has alternatives of its own");
        // the checks of a dispatch with alternatives would not run
        let mut p = with_alternative();
        p.checks = vec![Check {
            dispatch: 0,
            buffer: 1,
            sites: vec![Site {
                node: "n".into(),
                op: "add".into(),
                fault: Fault::Overflow,
            }],
        }];
        fails(p, "without alternatives");
    }

    #[test]
    fn gpu_repr_round_trips_host_tensors() {
        // the host tensor of GPU bytes `g`, shaped like `like`
        let back = |g: &[u8], like: &Tensor| {
            let mut t = Tensor::zeros(like.dtype(), like.shape()).unwrap();
            host_from_gpu(like.dtype(), g, t.bytes_mut());
            t
        };
        let t = Tensor::from_i64(DType::I64, &[3], &[-5, 0, 1 << 30]).unwrap();
        let g = to_gpu(&t, "x").unwrap();
        assert_eq!(g.len(), 12);
        assert_eq!(back(&g, &t).to_i64_vec(), [-5, 0, 1 << 30]);
        let big = Tensor::from_i64(DType::I64, &[1], &[1 << 40]).unwrap();
        assert!(to_gpu(&big, "input 0")
            .unwrap_err()
            .message()
            .contains("input 0"));
        let b = Tensor::from_bytes(DType::Bool, &[3], &[1, 0, 1]).unwrap();
        let g = to_gpu(&b, "m").unwrap();
        assert_eq!(g[..], [1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]);
        assert_eq!(back(&g, &b).bytes(), [1, 0, 1]);
        let h = Tensor::from_f32(DType::BF16, &[3], &[1.0, -2.0, 0.5]).unwrap();
        let g = to_gpu(&h, "h").unwrap();
        assert_eq!(g.len(), 8);
        assert_eq!(back(&g, &h).to_f32_vec(), [1.0, -2.0, 0.5]);
        let i8s = Tensor::from_bytes(DType::I8, &[1], &[0xff]).unwrap();
        assert_eq!(to_gpu(&i8s, "c").unwrap()[..], [0xff; 4]);
        // f32 of the GPU's layout is not copied
        let f = Tensor::from_f32(DType::F32, &[2], &[1.0, 2.0]).unwrap();
        assert!(matches!(to_gpu(&f, "f").unwrap(), Cow::Borrowed(_)));
    }
}
