//! Lazy values: what a graph value is before it is written to a buffer.
//!
//! Pointwise ops, casts, constants and every layout op (permute, expand,
//! reshape, slice, select, cat, pad, gathers, …) are not kernels of their
//! own: they become a [`Lazy`] tree over the buffers that exist, and the
//! tree is inlined into the kernel that reads it. Reading a lazy value at
//! a logical index emits WGSL that maps the index through every layout op
//! down to buffer loads — layout ops fold into index arithmetic, pointwise
//! chains fuse into their consumer.

use std::rc::Rc;

use etmetal_core::{BinaryOp, DType, Scalar, UnaryOp};

use super::buffers::BufferIdx;
use super::pointwise;

pub(crate) type LazyRef = Rc<Lazy>;

#[derive(Debug)]
pub(crate) struct Lazy {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub kind: Kind,
    /// The graph node it is the value of, which a run-time check of its
    /// integer arithmetic names (none for a template's own sub-values).
    pub node: Option<String>,
}

/// Two lazy values are equal where they compute the same elements the same
/// way (the nodes they are named after aside): a partition's outputs that
/// are one computation are written once.
impl PartialEq for Lazy {
    fn eq(&self, other: &Lazy) -> bool {
        self.dtype == other.dtype && self.shape == other.shape && self.kind == other.kind
    }
}

/// (So that comparing two handles of one value is a pointer comparison; a
/// NaN literal is only unequal to itself, which at worst writes a value
/// twice.)
impl Eq for Lazy {}

/// How the element at a logical index of an [`Lazy`] is computed. Children
/// of pointwise kinds already have the node's shape (broadcasts are
/// explicit [`Kind::Expand`]s).
#[derive(Debug, PartialEq)]
pub(crate) enum Kind {
    /// Element of a contiguous buffer of the same shape.
    Load(BufferIdx),
    Literal(Scalar),
    /// `start + step * index` along the only dim (arange).
    Iota {
        start: Scalar,
        step: Scalar,
    },
    Unary(UnaryOp, LazyRef),
    /// Computed in `compute` (the promoted dtype), result in `dtype`.
    Binary {
        op: BinaryOp,
        compute: DType,
        a: LazyRef,
        b: LazyRef,
    },
    Where(LazyRef, LazyRef, LazyRef),
    Cast(LazyRef),
    /// `y.shape[i] = x.shape[dims[i]]`
    Permute(LazyRef, Vec<usize>),
    /// Broadcast of a lower- or equal-rank value (size-1 dims stretch).
    Expand(LazyRef),
    /// Same elements in row-major order, other shape.
    Reshape(LazyRef),
    Slice {
        x: LazyRef,
        dim: usize,
        start: Pos,
        step: usize,
    },
    Select {
        x: LazyRef,
        dim: usize,
        index: Pos,
    },
    /// Concatenation along `dim`.
    Cat(Vec<LazyRef>, usize),
    /// `before[d]` elements of `value` ahead of dim d (negative: cropped).
    Pad {
        x: LazyRef,
        before: Vec<i64>,
        value: f64,
    },
    /// `x` where `col - row` is on the kept side of `diagonal`, else 0.
    Triangle {
        x: LazyRef,
        upper: bool,
        diagonal: i64,
    },
    /// `repeat`: index modulo the source size.
    Repeat(LazyRef),
    /// Data-dependent index along `dim` of `src`: the index value is read
    /// from `index` at a position given by `at`.
    Gather {
        src: LazyRef,
        dim: usize,
        index: LazyRef,
        at: GatherAt,
        /// The size of `dim` that negative indices count back from.
        len: Pos,
    },
    /// `x` where the index along each `(dim, size)` is below the run-time
    /// size, else `fill` (a reduction's identity past a dynamic end).
    Masked {
        x: LazyRef,
        valid: Vec<(usize, crate::payload::Size)>,
        fill: Scalar,
    },
}

/// A position along a dim: fixed, or counted from a dynamic end and read
/// from the sizes uniform at run time (payload 1.3).
#[derive(Debug, PartialEq)]
pub(crate) enum Pos {
    At(usize),
    Run(crate::payload::Size),
}

/// Where in the output index the index tensor is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GatherAt {
    /// `gather`: same position as the output element.
    Same,
    /// `index_select`: the output's index along `dim`.
    Dim,
    /// `embedding`: the output's leading dims (all but the last).
    Leading,
}

impl Lazy {
    pub fn new(dtype: DType, shape: Vec<usize>, kind: Kind) -> LazyRef {
        Rc::new(Lazy {
            dtype,
            shape,
            kind,
            node: None,
        })
    }

    /// The value of graph node `node`.
    pub fn of_node(dtype: DType, shape: Vec<usize>, kind: Kind, node: &str) -> LazyRef {
        Rc::new(Lazy {
            dtype,
            shape,
            kind,
            node: Some(node.to_string()),
        })
    }

    /// Whether reading it runs integer arithmetic checked at run time
    /// (int64 computed in i32, integer division), so the kernel that
    /// inlines it binds a status buffer.
    pub fn has_checks(&self) -> bool {
        let here = match &self.kind {
            Kind::Unary(op, _) => pointwise::checks_unary(*op, self.dtype),
            Kind::Binary { op, compute, .. } => pointwise::checks_binary(*op, *compute),
            Kind::Cast(x) => pointwise::checks_cast(x.dtype, self.dtype),
            _ => false,
        };
        here || self.children().into_iter().any(|c| c.has_checks())
    }

    /// Whether reading it costs only index arithmetic and loads (no math
    /// worth materialising before a kernel reads it many times).
    pub fn is_view(&self) -> bool {
        match &self.kind {
            Kind::Load(_) | Kind::Literal(_) | Kind::Iota { .. } => true,
            Kind::Permute(x, _)
            | Kind::Expand(x)
            | Kind::Reshape(x)
            | Kind::Slice { x, .. }
            | Kind::Select { x, .. }
            | Kind::Repeat(x) => x.is_view(),
            _ => false,
        }
    }

    /// Whether reading it again costs less than a dispatch writing it once:
    /// a view, or a view of a gather from a view at indices that are one
    /// (a rotary table's row at a decode step's position), or a float
    /// rounding of one (a bf16 model's f32 rotary table).
    pub fn is_cheap(&self) -> bool {
        match &self.kind {
            Kind::Gather { src, index, .. } => src.is_view() && index.is_view(),
            Kind::Cast(x) if x.dtype.is_float() && self.dtype.is_float() => x.is_cheap(),
            Kind::Permute(x, _)
            | Kind::Expand(x)
            | Kind::Reshape(x)
            | Kind::Slice { x, .. }
            | Kind::Select { x, .. }
            | Kind::Repeat(x) => x.is_cheap(),
            _ => self.is_view(),
        }
    }

    /// The buffer it reads in its own row-major order, element `i` at `i`:
    /// a load through reshapes and permutes that move only dims of size 1
    /// (an attention's `[1, heads, 1, d]` output transposed and flattened
    /// for the next linear), so readers take it in vector loads.
    pub fn contiguous_source(&self) -> Option<BufferIdx> {
        match &self.kind {
            Kind::Load(b) => Some(*b),
            Kind::Reshape(x) if x.dtype == self.dtype => x.contiguous_source(),
            Kind::Permute(x, dims) if x.dtype == self.dtype => {
                let moved: Vec<usize> = dims.iter().copied().filter(|&d| x.shape[d] != 1).collect();
                moved.is_sorted().then(|| x.contiguous_source())?
            }
            _ => None,
        }
    }

    /// Where its rows lie whole and in order in one buffer: the buffer,
    /// when reading it costs only index arithmetic and one load and every
    /// layout op keeps the last dim as it is (so element `(…, c)` is the
    /// `c`-th after `(…, 0)`, and a row starts at a multiple of the row
    /// length: the buffer's rows are the same). Kernels read such rows
    /// in wide chunks.
    pub fn row_source(&self) -> Option<BufferIdx> {
        let last = self.shape.last()?;
        let same = |x: &Lazy| x.dtype == self.dtype && x.shape.last() == Some(last);
        let inner = self.shape.len() - 1;
        match &self.kind {
            Kind::Load(b) => Some(*b),
            Kind::Permute(x, dims) if dims[inner] == inner && same(x) => x.row_source(),
            Kind::Expand(x) | Kind::Reshape(x) | Kind::Repeat(x) if same(x) => x.row_source(),
            Kind::Slice { x, dim, .. } if *dim < inner && same(x) => x.row_source(),
            Kind::Select { x, dim, .. } if *dim < inner + 1 && same(x) => x.row_source(),
            _ => None,
        }
    }

    /// Whether every element is zero by its form alone (a literal 0,
    /// `arange(1)`, views and casts of one).
    pub fn is_zero(&self) -> bool {
        match &self.kind {
            Kind::Literal(v) => v.to_f64() == 0.0,
            Kind::Iota { start, .. } => {
                start.to_f64() == 0.0 && self.shape.iter().product::<usize>() == 1
            }
            Kind::Expand(x) | Kind::Reshape(x) | Kind::Cast(x) => x.is_zero(),
            _ => false,
        }
    }

    /// The lazy values it reads, in order.
    fn children(&self) -> Vec<&LazyRef> {
        match &self.kind {
            Kind::Load(_) | Kind::Literal(_) | Kind::Iota { .. } => vec![],
            Kind::Unary(_, x)
            | Kind::Cast(x)
            | Kind::Permute(x, _)
            | Kind::Expand(x)
            | Kind::Reshape(x)
            | Kind::Slice { x, .. }
            | Kind::Select { x, .. }
            | Kind::Pad { x, .. }
            | Kind::Triangle { x, .. }
            | Kind::Masked { x, .. }
            | Kind::Repeat(x) => vec![x],
            Kind::Binary { a, b, .. } => vec![a, b],
            Kind::Where(c, a, b) => vec![c, a, b],
            Kind::Cat(parts, _) => parts.iter().collect(),
            Kind::Gather { src, index, .. } => vec![src, index],
        }
    }

    /// The buffers it reads, each once, in first-read order.
    pub fn buffers(&self, out: &mut Vec<BufferIdx>) {
        if let Kind::Load(b) = self.kind {
            if !out.contains(&b) {
                out.push(b)
            }
        }
        self.children().into_iter().for_each(|c| c.buffers(out));
    }

    /// Number of tree nodes (a bound on the WGSL a kernel inlines).
    pub fn size(&self) -> usize {
        1 + self.children().into_iter().map(|c| c.size()).sum::<usize>()
    }
}

/// `x` with the same elements in row-major order under `shape` (a load of
/// a contiguous buffer stays a plain load).
pub(crate) fn reshaped(x: &LazyRef, shape: Vec<usize>) -> LazyRef {
    if x.shape == shape {
        return x.clone();
    }
    match x.kind {
        Kind::Load(buf) => Lazy::new(x.dtype, shape, Kind::Load(buf)),
        _ => Lazy::new(x.dtype, shape, Kind::Reshape(x.clone())),
    }
}
