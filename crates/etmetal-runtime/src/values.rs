//! The method's values: tensors live in the planned arenas (at their
//! offsets, so values that ExecuTorch lets alias share bytes), in the mapped
//! file (constants), or, when unplanned, as owned tensors; everything else
//! is the program's `EValue`.
//!
//! A dynamic tensor (`DYNAMIC_BOUND`) is planned at its upper bound and
//! carries its current shape, set by each write within that bound. The
//! values also keep the program's `EValue` table with current shapes and
//! the `Int`s computed at run time, from which the calls that depend on them
//! are decoded at every execute.

use etmetal_core::{DType, Error, Result, Scalar, Tensor, TensorSpec};
use etmetal_cpu::{View, ViewMut};
use etmetal_pte::{EValue, PteFile, TensorDataLocation, TensorShapeDynamism};

/// Where a tensor's bytes are.
enum Place {
    Constant(Tensor),
    Arena { memory: usize, offset: usize },
    Unplanned(Option<Tensor>),
}

pub(crate) struct TensorSlot {
    pub dtype: DType,
    /// The current shape; a static tensor's never changes.
    pub shape: Vec<usize>,
    /// The planned shape: for a dynamic tensor, the upper bound of each dim.
    pub bound: Vec<usize>,
    pub dynamic: bool,
    place: Place,
}

impl TensorSlot {
    /// What the tensor may hold: its shape, or its bound per dim.
    pub fn spec(&self) -> TensorSpec {
        TensorSpec {
            dtype: self.dtype,
            shape: self.bound.clone(),
            dynamic: if self.dynamic {
                vec![true; self.bound.len()]
            } else {
                vec![]
            },
        }
    }
}

pub(crate) enum Slot {
    Tensor(TensorSlot),
    Value(EValue),
}

/// Every value of a method plus the arenas that back its planned tensors.
pub(crate) struct Values {
    slots: Vec<Slot>,
    /// The plan's values with current shapes and run-time `Int`s (see the
    /// module docs); changed only with `slots`.
    table: Vec<EValue>,
    /// Indexed by `memory_id`; entry 0 (ExecuTorch's constant placeholder) is empty.
    arenas: Vec<Arena>,
    /// Planned tensors with an initial value (mutable buffers: state kept
    /// in the arena across executes), written at load and by [`Values::reset_state`].
    initial: Vec<(usize, Tensor)>,
    /// The fully qualified name of each `initial` entry, where the file gives one.
    fqns: Vec<Option<String>>,
}

/// Pieces of [`copy_bytes`]'s parallel copy; tensors under 4 of them are
/// copied by one thread.
const COPY_CHUNK: usize = 1 << 20;

/// Copy `src` into `dst` (equal lengths). Large tensors are copied by all
/// threads: a method's inputs and outputs cross planned memory once each
/// execute, and one thread's memcpy (with the page faults of a fresh output)
/// is what made large inputs slower than PyTorch's host-to-device copy.
pub fn copy_bytes(dst: &mut [u8], src: &[u8]) {
    use rayon::prelude::*;
    if src.len() < 4 * COPY_CHUNK {
        dst.copy_from_slice(src);
        return;
    }
    dst.par_chunks_mut(COPY_CHUNK)
        .zip(src.par_chunks(COPY_CHUNK))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

/// An owned copy of `view`, written once: a small tensor straight from its
/// bytes, a large one zeroed and then copied by all threads
/// ([`copy_bytes`]).
fn owned_copy(view: &View) -> Result<Tensor> {
    if view.bytes.len() < 4 * COPY_CHUNK {
        return Tensor::from_bytes(view.dtype, view.shape, view.bytes);
    }
    let mut out = Tensor::zeros(view.dtype, view.shape)?;
    copy_bytes(out.bytes_mut(), view.bytes);
    Ok(out)
}

/// The initial value of a planned tensor with data: offset `data_buffer_idx`
/// of mutable data segment `mutable_data_segments_idx` (the verifier
/// checked both are in range).
fn mutable_initial(file: &PteFile, t: &etmetal_pte::Tensor, what: &str) -> Result<Tensor> {
    let m = t
        .extra_tensor_info
        .as_ref()
        .map_or(0, |e| e.mutable_data_segments_idx);
    let seg = usize::try_from(m)
        .ok()
        .and_then(|m| file.program.mutable_data_segments.get(m))
        .ok_or_else(|| Error::format(format!("{what}: mutable data segment {m} does not exist")))?;
    let offset = seg
        .offsets
        .get(t.data_buffer_idx as usize)
        .and_then(|&o| usize::try_from(o).ok())
        .ok_or_else(|| {
            Error::format(format!(
                "{what}: mutable data offset {} does not exist",
                t.data_buffer_idx
            ))
        })?;
    let nbytes = etmetal_pte::verify::tensor_nbytes(t, what)? as usize;
    let bytes = file
        .segment(seg.segment_index as usize)?
        .get(offset..offset.saturating_add(nbytes))
        .ok_or_else(|| Error::format(format!("{what}: initial value outside its segment")))?;
    let shape: Vec<usize> = t.sizes.iter().map(|&s| s.max(0) as usize).collect();
    Tensor::from_bytes(t.scalar_type, &shape, bytes)
}

/// A kernel call's input slots and outputs, borrowed in place.
pub(crate) type KernelViews<'a> = (Vec<Option<View<'a>>>, Vec<ViewMut<'a>>);

/// One planned memory: zeroed bytes, 8-byte aligned so that kernels can
/// view any dtype in place.
#[derive(Default)]
struct Arena {
    words: Vec<u64>,
    len: usize,
}

impl Arena {
    /// Allocate without aborting when the system refuses.
    fn new(size: usize, memory: usize) -> Result<Arena> {
        let mut words = Vec::new();
        words.try_reserve_exact(size.div_ceil(8)).map_err(|_| {
            Error::limit(format!(
                "cannot allocate {size} bytes for planned memory {memory}"
            ))
        })?;
        words.resize(size.div_ceil(8), 0);
        Ok(Arena { words, len: size })
    }

    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }
}

impl Values {
    /// Build the values of `execution_plan[plan]`, allocating its arenas once.
    pub fn new(file: &PteFile, plan: usize, max_arena_bytes: u64) -> Result<Values> {
        let p = &file.program.execution_plan[plan];
        // Sizes were checked non-negative by the reader.
        let sizes: Vec<u64> = p
            .non_const_buffer_sizes
            .iter()
            .map(|&s| s.max(0) as u64)
            .collect();
        let total = sizes
            .iter()
            .skip(1)
            .try_fold(0u64, |acc, &s| acc.checked_add(s));
        match total {
            Some(t) if t <= max_arena_bytes => {}
            _ => {
                return Err(Error::limit(format!(
                    "planned memory of {} bytes (non_const_buffer_sizes {:?}) exceeds the limit of {max_arena_bytes} bytes",
                    total.map_or("more than u64::MAX".to_string(), |t| t.to_string()),
                    p.non_const_buffer_sizes
                )))
            }
        }
        // Allocate only what planned tensors reach: a file may declare more
        // (the reader checked every tensor lies inside its declared arena),
        // and bytes no tensor covers are never read or written.
        let mut used = vec![0u64; sizes.len()];
        for (v, value) in p.values.iter().enumerate() {
            if let EValue::Tensor(t) = value {
                if let Some(a) = &t.allocation_info {
                    let end = a.memory_offset()
                        + etmetal_pte::verify::tensor_nbytes(t, &format!("value {v}"))?;
                    if let Some(u) = used.get_mut(a.memory_id as usize) {
                        *u = (*u).max(end);
                    }
                }
            }
        }
        let mut arenas = vec![Arena::default()];
        for (memory, &size) in used.iter().enumerate().skip(1) {
            let size = usize::try_from(size).map_err(|_| {
                Error::limit(format!(
                    "planned memory {memory} of {size} bytes does not fit in memory"
                ))
            })?;
            arenas.push(Arena::new(size, memory)?);
        }
        let slots = p
            .values
            .iter()
            .enumerate()
            .map(|(v, value)| Values::slot(file, plan, v, value, max_arena_bytes))
            .collect::<Result<Vec<_>>>()?;
        let mut initial = vec![];
        let mut fqns = vec![];
        for (v, value) in p.values.iter().enumerate() {
            if let EValue::Tensor(t) = value {
                if t.allocation_info.is_some() && t.data_buffer_idx > 0 {
                    initial.push((v, mutable_initial(file, t, &format!("value {v}"))?));
                    fqns.push(
                        t.extra_tensor_info
                            .as_ref()
                            .map(|e| e.fully_qualified_name.clone())
                            .filter(|n| !n.is_empty()),
                    );
                }
            }
        }
        let mut values = Values {
            slots,
            table: p.values.clone(),
            arenas,
            initial,
            fqns,
        };
        values.reset_state()?;
        Ok(values)
    }

    /// The mutable buffers: value index and fully qualified name (if any).
    pub fn states(&self) -> impl Iterator<Item = (usize, Option<&str>)> {
        self.initial
            .iter()
            .zip(&self.fqns)
            .map(|((v, _), n)| (*v, n.as_deref()))
    }

    /// Write every mutable buffer's initial value back.
    pub fn reset_state(&mut self) -> Result<()> {
        let initial = std::mem::take(&mut self.initial);
        let done = initial.iter().try_for_each(|(v, t)| self.write(*v, t));
        self.initial = initial;
        done
    }

    /// `max_bytes` bounds an unplanned tensor, allocated when it is given
    /// or made (all-ones inputs), like the arenas.
    fn slot(file: &PteFile, plan: usize, v: usize, value: &EValue, max_bytes: u64) -> Result<Slot> {
        let EValue::Tensor(t) = value else {
            return Ok(Slot::Value(value.clone()));
        };
        let at = || format!("value {v}");
        let shape: Vec<usize> = t.sizes.iter().map(|&s| s.max(0) as usize).collect();
        if t.dim_order
            .iter()
            .enumerate()
            .any(|(i, &d)| d as usize != i)
        {
            return Err(Error::unsupported(format!(
                "{}: dim_order {:?} (only contiguous tensors are supported)",
                at(),
                t.dim_order
            )));
        }
        let dynamic = match t.shape_dynamism {
            TensorShapeDynamism::Static => false,
            TensorShapeDynamism::DynamicBound => true,
            TensorShapeDynamism::DynamicUnbound => {
                return Err(Error::unsupported(format!(
                    "{}: an unbounded dynamic shape (DYNAMIC_UNBOUND, sizes {:?}); etmetal \
                     runs dynamic shapes with an upper bound only (torch.export Dim with max=)",
                    at(),
                    t.sizes
                )))
            }
        };
        if t.extra_tensor_info
            .as_ref()
            .is_some_and(|e| e.location == TensorDataLocation::External)
        {
            return Err(Error::unsupported(format!(
                "{}: data in an external .ptd file",
                at()
            )));
        }
        let place = match (&t.allocation_info, t.data_buffer_idx) {
            (None, 0) => {
                let nbytes = etmetal_pte::verify::tensor_nbytes(t, &at())?;
                if nbytes > max_bytes {
                    return Err(Error::limit(format!(
                        "{}: unplanned tensor of {nbytes} bytes (sizes {:?}) exceeds the limit of {max_bytes} bytes",
                        at(),
                        t.sizes
                    )));
                }
                Place::Unplanned(None)
            }
            (None, _) => Place::Constant(file.constant_tensor(plan, v)?),
            // The reader checked memory_id and that the bytes fit the buffer;
            // an initial value (data_buffer_idx > 0) is written by `new`.
            (Some(a), _) => Place::Arena {
                memory: a.memory_id as usize,
                offset: a.memory_offset() as usize,
            },
        };
        Ok(Slot::Tensor(TensorSlot {
            dtype: t.scalar_type,
            bound: shape.clone(),
            shape,
            dynamic,
            place,
        }))
    }

    /// Bytes allocated for planned memory.
    pub fn arena_bytes(&self) -> usize {
        self.arenas.iter().map(|a| a.len).sum()
    }

    pub fn get(&self, v: usize) -> Result<&Slot> {
        self.slots.get(v).ok_or_else(|| {
            Error::format(format!(
                "value {v} does not exist ({} values)",
                self.slots.len()
            ))
        })
    }

    pub fn tensor_slot(&self, v: usize) -> Result<&TensorSlot> {
        match self.get(v)? {
            Slot::Tensor(t) => Ok(t),
            Slot::Value(e) => Err(Error::format(format!("value {v} is {e:?}, not a tensor"))),
        }
    }

    /// A copy of tensor `v` (constants are shared, not copied).
    pub fn read(&self, v: usize) -> Result<Tensor> {
        let t = self.tensor_slot(v)?;
        match &t.place {
            Place::Constant(c) | Place::Unplanned(Some(c)) => Ok(c.clone()),
            _ => owned_copy(&self.view(v)?),
        }
    }

    /// Tensor `v` where it is, with its current shape.
    pub fn view(&self, v: usize) -> Result<View<'_>> {
        let t = self.tensor_slot(v)?;
        let bytes = match &t.place {
            Place::Constant(c) | Place::Unplanned(Some(c)) => c.bytes(),
            Place::Unplanned(None) => {
                return Err(Error::invalid_input(format!(
                    "value {v} is read before it is written"
                )))
            }
            Place::Arena { memory, offset } => {
                let n = etmetal_core::shape::numel(&t.shape)? * t.dtype.size();
                self.arenas[*memory]
                    .bytes()
                    .get(*offset..*offset + n)
                    .ok_or_else(|| {
                        Error::internal(format!("value {v} lies outside planned memory {memory}"))
                    })?
            }
        };
        Ok(View {
            dtype: t.dtype,
            shape: &t.shape,
            bytes,
        })
    }

    /// The program's values with current shapes and run-time scalars.
    pub fn table(&self) -> &[EValue] {
        &self.table
    }

    /// Give dynamic tensor `v` the shape `shape`, which must lie within its
    /// bound (a static tensor keeps its shape).
    pub fn set_shape(&mut self, v: usize, shape: &[usize]) -> Result<()> {
        let Some(Slot::Tensor(t)) = self.slots.get_mut(v) else {
            return Err(Error::format(format!("value {v} is not a tensor")));
        };
        if t.shape == shape {
            return Ok(());
        }
        if let Some(why) = t.spec().mismatch(shape) {
            return Err(Error::shape(format!(
                "value {v} ({}): {why}",
                if t.dynamic {
                    "dynamic, planned at its bound"
                } else {
                    "static"
                }
            )));
        }
        t.shape = shape.to_vec();
        if let Some(EValue::Tensor(e)) = self.table.get_mut(v) {
            e.sizes = shape.iter().map(|&s| s as i32).collect();
        }
        Ok(())
    }

    /// Store scalar `s` as value `v` (the result of a symbolic-int call).
    pub fn set_scalar(&mut self, v: usize, s: Scalar) -> Result<()> {
        let e = match s {
            Scalar::Int(i) => EValue::Int(i),
            Scalar::Float(f) => EValue::Double(f),
            Scalar::Bool(b) => EValue::Bool(b),
        };
        match self.slots.get_mut(v) {
            Some(Slot::Value(slot @ (EValue::Int(_) | EValue::Double(_) | EValue::Bool(_)))) => {
                *slot = e.clone();
                self.table[v] = e;
                Ok(())
            }
            Some(other) => Err(Error::format(format!(
                "value {v} is {}, not an Int, Double or Bool to write a scalar into",
                match other {
                    Slot::Tensor(_) => "a tensor".to_string(),
                    Slot::Value(e) => format!("{e:?}"),
                }
            ))),
            None => Err(Error::format(format!("value {v} does not exist"))),
        }
    }

    /// Store `tensor` as value `v`: dtype must be the value's, and shape
    /// too (for a dynamic tensor: within its bound, which it then takes).
    pub fn write(&mut self, v: usize, tensor: &Tensor) -> Result<()> {
        self.store(v, View::of(tensor), || Ok(tensor.clone()))
    }

    /// [`Values::write`] from borrowed memory, which is copied; its length
    /// must be its shape's.
    pub fn write_view(&mut self, v: usize, tensor: View<'_>) -> Result<()> {
        let len = etmetal_core::shape::numel(tensor.shape)?.checked_mul(tensor.dtype.size());
        if len != Some(tensor.bytes.len()) {
            return Err(Error::invalid_input(format!(
                "value {v}: {} bytes given for {} {:?}",
                tensor.bytes.len(),
                tensor.dtype,
                tensor.shape
            )));
        }
        self.store(v, tensor, || {
            Tensor::from_bytes(tensor.dtype, tensor.shape, tensor.bytes)
        })
    }

    /// Write `tensor` into value `v`; an unplanned value keeps `owned()`.
    fn store(
        &mut self,
        v: usize,
        tensor: View<'_>,
        owned: impl FnOnce() -> Result<Tensor>,
    ) -> Result<()> {
        let Some(Slot::Tensor(t)) = self.slots.get(v) else {
            return Err(Error::format(format!(
                "value {v} is not a tensor and cannot be written"
            )));
        };
        if tensor.dtype != t.dtype {
            return Err(Error::shape(format!(
                "value {v} is {} {}, the result is {} {:?}",
                t.dtype,
                t.spec().shape_text(),
                tensor.dtype,
                tensor.shape
            )));
        }
        self.set_shape(v, tensor.shape)?;
        let Some(Slot::Tensor(t)) = self.slots.get_mut(v) else {
            unreachable!("checked to be a tensor above");
        };
        match &mut t.place {
            Place::Constant(_) => Err(Error::format(format!(
                "value {v} is a constant and cannot be written"
            ))),
            Place::Unplanned(slot) => {
                *slot = Some(owned()?);
                Ok(())
            }
            Place::Arena { memory, offset } => {
                let src = tensor.bytes;
                let dst = self.arenas[*memory]
                    .bytes_mut()
                    .get_mut(*offset..*offset + src.len())
                    .ok_or_else(|| {
                        Error::internal(format!("value {v} lies outside planned memory {memory}"))
                    })?;
                copy_bytes(dst, src);
                Ok(())
            }
        }
    }

    /// Whether `a` and `b` start at the same byte of planned memory with
    /// the same dtype (a view ExecuTorch planned in place).
    pub fn same_start(&self, a: usize, b: usize) -> bool {
        match (self.slots.get(a), self.slots.get(b)) {
            (Some(Slot::Tensor(x)), Some(Slot::Tensor(y))) => {
                matches!((&x.place, &y.place), (Place::Arena { memory: m, offset: o }, Place::Arena { memory: n, offset: p }) if m == n && o == p)
                    && x.dtype == y.dtype
            }
            _ => false,
        }
    }

    /// Whether `a` and `b` are the same bytes of planned memory with the
    /// same dtype and shape.
    pub fn same_tensor(&self, a: usize, b: usize) -> bool {
        self.same_start(a, b)
            && matches!((self.slots.get(a), self.slots.get(b)), (Some(Slot::Tensor(x)), Some(Slot::Tensor(y))) if x.shape == y.shape)
    }

    /// Tensors `inputs` read in place and `outputs` written in place, for
    /// one kernel call; `None` (and nothing borrowed) when the call must run
    /// on copies: an output is not planned, overlaps an input or another
    /// output (an in-place call), or an input has no value yet.
    pub fn views(
        &mut self,
        inputs: &[Option<usize>],
        outputs: &[usize],
    ) -> Result<Option<KernelViews<'_>>> {
        // (memory, byte range) of each planned tensor
        let span = |slots: &[Slot], v: usize| -> Result<Option<(usize, std::ops::Range<usize>)>> {
            let Some(Slot::Tensor(t)) = slots.get(v) else {
                return Err(Error::format(format!("value {v} is not a tensor")));
            };
            Ok(match t.place {
                Place::Arena { memory, offset } => {
                    let n = etmetal_core::shape::numel(&t.shape)? * t.dtype.size();
                    Some((memory, offset..offset + n))
                }
                _ => None,
            })
        };
        let mut written = Vec::with_capacity(outputs.len());
        for &v in outputs {
            let Some((memory, range)) = span(&self.slots, v)? else {
                return Ok(None);
            };
            if range.end > self.arenas[memory].len {
                return Err(Error::internal(format!(
                    "value {v} lies outside planned memory {memory}"
                )));
            }
            written.push((memory, range));
        }
        let overlaps = |m: usize, r: &std::ops::Range<usize>, skip: usize| {
            written
                .iter()
                .enumerate()
                .any(|(i, (wm, w))| i != skip && *wm == m && w.start < r.end && r.start < w.end)
        };
        if (0..written.len()).any(|i| overlaps(written[i].0, &written[i].1, i)) {
            return Ok(None);
        }
        for &v in inputs.iter().flatten() {
            match span(&self.slots, v)? {
                Some((m, r)) if overlaps(m, &r, usize::MAX) => return Ok(None),
                Some((m, r)) if r.end > self.arenas[m].len => {
                    return Err(Error::internal(format!(
                        "value {v} lies outside planned memory {m}"
                    )))
                }
                _ => {}
            }
            if let Some(Slot::Tensor(TensorSlot {
                place: Place::Unplanned(None),
                ..
            })) = self.slots.get(v)
            {
                return Ok(None);
            }
        }
        let base: Vec<*mut u8> = self
            .arenas
            .iter_mut()
            .map(|a| bytemuck::cast_slice_mut::<u64, u8>(&mut a.words).as_mut_ptr())
            .collect();
        let slots = &self.slots;
        let tensor = |v: usize| match &slots[v] {
            Slot::Tensor(t) => t,
            Slot::Value(_) => unreachable!("checked to be a tensor above"),
        };
        let ins = inputs
            .iter()
            .map(|slot| {
                slot.map(|v| {
                    let t = tensor(v);
                    let bytes: &[u8] = match &t.place {
                        Place::Constant(c) | Place::Unplanned(Some(c)) => c.bytes(),
                        Place::Arena { memory, offset } => {
                            let n = t.dtype.size() * t.shape.iter().product::<usize>();
                            // SAFETY: inside the arena (checked above) and
                            // overlapping no output; `&mut self` keeps every
                            // other access out while the views live.
                            unsafe { std::slice::from_raw_parts(base[*memory].add(*offset), n) }
                        }
                        Place::Unplanned(None) => unreachable!("refused above"),
                    };
                    View {
                        dtype: t.dtype,
                        shape: &t.shape,
                        bytes,
                    }
                })
            })
            .collect();
        let outs = outputs
            .iter()
            .zip(written)
            .map(|(&v, (memory, range))| {
                let t = tensor(v);
                // SAFETY: inside the arena, disjoint from every other view
                // (checked above); `&mut self` is held while the views live.
                let bytes = unsafe {
                    std::slice::from_raw_parts_mut(base[memory].add(range.start), range.len())
                };
                ViewMut {
                    dtype: t.dtype,
                    shape: &t.shape,
                    bytes,
                }
            })
            .collect();
        Ok(Some((ins, outs)))
    }

    /// `values[to] = values[from]` (a data copy for tensors).
    pub fn assign(&mut self, from: usize, to: usize) -> Result<()> {
        match self.get(from)? {
            Slot::Tensor(_) => {
                let t = self.read(from)?;
                self.write(to, &t)
            }
            Slot::Value(e) => {
                let e = e.clone();
                match self.slots.get_mut(to) {
                    Some(slot @ Slot::Value(_)) => {
                        *slot = Slot::Value(e.clone());
                        self.table[to] = e;
                        Ok(())
                    }
                    _ => Err(Error::format(format!(
                        "cannot move value {from} ({e:?}) into tensor value {to}"
                    ))),
                }
            }
        }
    }
}
