//! The method's values: tensors live in the planned arenas (at their
//! offsets, so values that ExecuTorch lets alias share bytes), in the mapped
//! file (constants), or, when unplanned, as owned tensors; everything else
//! is the program's `EValue`.

use etmetal_core::{DType, Error, Result, Tensor};
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
    pub shape: Vec<usize>,
    place: Place,
}

pub(crate) enum Slot {
    Tensor(TensorSlot),
    Value(EValue),
}

/// Every value of a method plus the arenas that back its planned tensors.
pub(crate) struct Values {
    slots: Vec<Slot>,
    /// Indexed by `memory_id`; entry 0 (ExecuTorch's constant placeholder) is empty.
    arenas: Vec<Arena>,
    /// Planned tensors with an initial value (mutable buffers: state kept
    /// in the arena across executes), written at load and by [`Values::reset_state`].
    initial: Vec<(usize, Tensor)>,
    /// The fully qualified name of each `initial` entry, where the file gives one.
    fqns: Vec<Option<String>>,
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
        if t.shape_dynamism != TensorShapeDynamism::Static {
            return Err(Error::unsupported(format!(
                "{}: dynamic shape {:?}",
                at(),
                t.shape_dynamism
            )));
        }
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
            shape,
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
            Place::Constant(c) => Ok(c.clone()),
            Place::Unplanned(Some(c)) => Ok(c.clone()),
            Place::Unplanned(None) => Err(Error::invalid_input(format!(
                "value {v} is read before it is written"
            ))),
            Place::Arena { memory, offset } => {
                let n = etmetal_core::shape::numel(&t.shape)? * t.dtype.size();
                let bytes = self.arenas[*memory]
                    .bytes()
                    .get(*offset..*offset + n)
                    .ok_or_else(|| {
                        Error::internal(format!("value {v} lies outside planned memory {memory}"))
                    })?;
                Tensor::from_bytes(t.dtype, &t.shape, bytes)
            }
        }
    }

    /// Store `tensor` as value `v`: dtype and shape must be the value's.
    pub fn write(&mut self, v: usize, tensor: &Tensor) -> Result<()> {
        let Some(Slot::Tensor(t)) = self.slots.get_mut(v) else {
            return Err(Error::format(format!(
                "value {v} is not a tensor and cannot be written"
            )));
        };
        if tensor.dtype() != t.dtype || tensor.shape() != t.shape.as_slice() {
            return Err(Error::shape(format!(
                "value {v} is {} {:?}, the result is {} {:?}",
                t.dtype,
                t.shape,
                tensor.dtype(),
                tensor.shape()
            )));
        }
        match &mut t.place {
            Place::Constant(_) => Err(Error::format(format!(
                "value {v} is a constant and cannot be written"
            ))),
            Place::Unplanned(slot) => {
                *slot = Some(tensor.clone());
                Ok(())
            }
            Place::Arena { memory, offset } => {
                let src = tensor.bytes();
                let dst = self.arenas[*memory]
                    .bytes_mut()
                    .get_mut(*offset..*offset + src.len())
                    .ok_or_else(|| {
                        Error::internal(format!("value {v} lies outside planned memory {memory}"))
                    })?;
                dst.copy_from_slice(src);
                Ok(())
            }
        }
    }

    /// Whether `a` and `b` are the same bytes of planned memory with the
    /// same dtype and shape.
    pub fn same_tensor(&self, a: usize, b: usize) -> bool {
        match (self.slots.get(a), self.slots.get(b)) {
            (Some(Slot::Tensor(x)), Some(Slot::Tensor(y))) => {
                matches!((&x.place, &y.place), (Place::Arena { memory: m, offset: o }, Place::Arena { memory: n, offset: p }) if m == n && o == p)
                    && x.dtype == y.dtype
                    && x.shape == y.shape
            }
            _ => false,
        }
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
                        *slot = Slot::Value(e);
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
