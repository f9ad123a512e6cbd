//! The lowering context ([`Lowering`]): the record of one partition as
//! its nodes are lowered (buffers, lazy values, kernels, dispatches,
//! run-time checks, sizes) and the rules of recording (the buffer limit,
//! the binding budget, sharing identical kernels, alternatives, size
//! gates). Kernel templates (`kernels`) read their inputs and record their
//! dispatches through it; it names none of them. Work it defers
//! (`deferred`: row means, in-place row writes) and the lowering of a node
//! ahead of its turn are the driver's: the context calls the driver's
//! functions ([`Driver`]) at the moment it sees they are due.

use std::collections::{HashMap, HashSet};

use etmetal_core::sym::SymExpr;
use etmetal_core::{DType, Error, Result, Scalar};
use etmetal_graph::{Graph, Node, ValueId};

use super::budget;
use super::buffers::{BufferDesc, BufferIdx, Buffers, Place, Storage};
use super::coopmat::{CoopForm, CoopMat};
use super::deferred::{RowStat, Scatter};
use super::emit::{entry, grid, unravel, Built, KernelBuilder, FLAT_GROUP, FLAT_WORKGROUP};
use super::expr::{self, Kind, Lazy, LazyRef};
use super::options::{Boundary, PreprocessOptions};
use super::{arena, sizes, validate};
use crate::partitioner::Partition;
use crate::payload::{
    self, Access, Alternative, Check, Dispatch, Kernel, Location, Needs, Payload, Requirements,
};

/// What the context asks of the driver, as functions, so that it names no
/// kernel module (they import the context, never the other way round):
/// lower a node (ahead of its turn, [`Lowering::lower_ahead`]), and
/// dispatch deferred work just before the first kernel that binds its
/// buffer.
#[derive(Clone, Copy)]
pub(crate) struct Driver {
    pub lower_node: fn(&mut Lowering, &Node) -> Result<()>,
    /// Dispatch a row mean's kernel ([`RowStat`]).
    pub row_mean: fn(&mut Lowering, &RowStat) -> Result<()>,
    /// Dispatch waiting in-place row writes, as one kernel ([`Scatter`]).
    pub scatter: fn(&mut Lowering, &[Scatter]) -> Result<()>,
}

/// What preprocess makes of one partition.
#[derive(Clone, Debug)]
pub struct Preprocessed {
    pub payload: Payload,
    /// Weights in GPU form, keyed as the payload names them (by
    /// [`Boundary::weight_key`]: graph value names unless the compile driver
    /// decides otherwise, so a weight read by several partitions is stored
    /// once).
    pub named_data: Vec<(String, Vec<u8>)>,
}

/// An integer constant holding 0, 1, 2, … in row-major order (a decoder's
/// `positions` buffer, the importer's position table of `index_copy_`) as
/// an index expression: no buffer to bind or store.
fn counting(t: &etmetal_core::Tensor) -> Option<LazyRef> {
    if !matches!(t.dtype(), DType::I32 | DType::I64)
        || t.numel() == 0
        || t.numel() > i32::MAX as usize
    {
        return None;
    }
    // element by element, stopping at the first that is not its index: an
    // int4 model's packed weights (int32) are not widened whole
    let b = t.bytes();
    let counts = match t.dtype() {
        DType::I32 => b.chunks_exact(4).enumerate().all(|(i, c)| {
            i64::from(i32::from_le_bytes(c.try_into().expect("4 bytes"))) == i as i64
        }),
        _ => b
            .chunks_exact(8)
            .enumerate()
            .all(|(i, c)| i64::from_le_bytes(c.try_into().expect("8 bytes")) == i as i64),
    };
    if !counts {
        return None;
    }
    let iota = Kind::Iota {
        start: Scalar::Int(0),
        step: Scalar::Int(1),
    };
    let flat = Lazy::new(t.dtype(), vec![t.numel()], iota);
    Some(expr::reshaped(&flat, t.shape().to_vec()))
}

/// Lowering state of one partition: what the kernels of the nodes lowered
/// so far recorded (buffers, values, kernels, dispatches, checks) and the
/// work deferred.
pub(crate) struct Lowering<'g> {
    /// What only the driver does, called back at the moments the context
    /// sees ([`Driver`]).
    driver: Driver,
    pub graph: &'g Graph,
    pub options: &'g PreprocessOptions,
    pub buffers: Buffers,
    values: HashMap<ValueId, LazyRef>,
    /// Reads of each value by partition nodes still to be lowered, plus one
    /// for a partition output.
    readers: HashMap<ValueId, usize>,
    outputs: Vec<ValueId>,
    kernels: Vec<Kernel>,
    pub dispatches: Vec<Dispatch>,
    checks: Vec<Check>,
    named_data: Vec<(String, Vec<u8>)>,
    requirements: Requirements,
    /// While an alternative is built ([`Lowering::alternative`]): the
    /// workgroup memory its kernels need (kept out of `requirements`).
    alternative_storage: Option<u32>,
    /// While an emulated tensor-core form is built (see [`Self::alternative`]).
    emulating: bool,
    /// The node being lowered, for dispatch records.
    current: String,
    /// The partition's nodes, in lowering order (for a template looking
    /// at the readers of its output, [`Lowering::sole_reader`]).
    nodes: &'g [usize],
    /// Nodes a template has computed with its own (a product's sibling, the
    /// pointwise tail its store computes): their turn only consumes reads.
    absorbed: HashSet<usize>,
    /// Row means not dispatched yet ([`RowStat`]).
    pub pending: Vec<RowStat>,
    /// The partition's run-time sizes (payload 1.3).
    pub sizes: sizes::Sizes,
    /// The actual dims of buffers holding dynamic graph values.
    pub dims: sizes::BufferDims,
    /// While a size bucket's variant is lowered: its 0/1 gate, by which
    /// every dispatch's run-time count is multiplied (set by [`Lowering::gated`]).
    gate: Option<SymExpr>,
    /// The buffers of resident state inputs ([`Boundary::resident`]): the
    /// partition may write them in place.
    resident: HashSet<BufferIdx>,
    /// The input buffer of each resident state, by its new value: where
    /// the new value is that buffer, written in place, nothing is copied.
    in_place: HashMap<ValueId, BufferIdx>,
    /// In-place row writes not dispatched yet ([`Scatter`]).
    scatters: Vec<Scatter>,
}

impl<'g> Lowering<'g> {
    /// The context of `partition`, its inputs and constants recorded.
    pub(crate) fn new(
        graph: &'g Graph,
        partition: &'g Partition,
        options: &'g PreprocessOptions,
        boundary: &Boundary,
        driver: Driver,
    ) -> Result<Lowering<'g>> {
        let weight_key = boundary.weight_key;
        let mut lw = Lowering {
            driver,
            graph,
            options,
            buffers: Buffers::default(),
            values: HashMap::new(),
            readers: HashMap::new(),
            outputs: partition.outputs.clone(),
            kernels: vec![],
            dispatches: vec![],
            checks: vec![],
            named_data: vec![],
            requirements: Requirements {
                max_storage_buffers_per_shader_stage: 1,
                max_compute_invocations_per_workgroup: FLAT_WORKGROUP,
                max_compute_workgroup_storage_size: 0,
                max_storage_buffer_binding_size: 4,
                max_buffer_size: 4,
                ..Requirements::default()
            },
            alternative_storage: None,
            emulating: false,
            current: String::new(),
            nodes: &partition.nodes,
            absorbed: HashSet::new(),
            pending: vec![],
            sizes: sizes::Sizes::of_inputs(graph, &partition.inputs)?,
            dims: HashMap::new(),
            gate: None,
            resident: HashSet::new(),
            in_place: HashMap::new(),
            scatters: vec![],
        };
        for &n in &partition.nodes {
            for v in graph.nodes[n].inputs.iter().flatten() {
                *lw.readers.entry(*v).or_default() += 1;
            }
        }
        for v in &partition.outputs {
            *lw.readers.entry(*v).or_default() += 1;
        }
        for (k, &v) in partition.inputs.iter().enumerate() {
            let info = graph.value(v);
            let buf = lw.add_buffer(BufferDesc::new(
                &info.name,
                info.dtype,
                &info.shape,
                Place::Input(k),
            )?)?;
            lw.record_dims(buf, v);
            lw.values.insert(v, lw.load(buf));
            if let Some(r) = boundary.resident.iter().find(|r| r.buffer == v) {
                lw.resident.insert(buf);
                lw.in_place.insert(r.new_value, buf);
            }
        }
        for &v in &partition.constants {
            let info = graph.value(v);
            let tensor = graph
                .constants
                .get(&v)
                .ok_or_else(|| Error::internal(format!("constant `{}` has no data", info.name)))?;
            let lazy = if info.shape.is_empty() {
                // 0-d constants (scalars of binary ops) are inlined literals
                let value = if info.dtype.is_float() {
                    Scalar::Float(tensor.to_f64_vec()[0])
                } else if info.dtype == DType::Bool {
                    Scalar::Bool(tensor.bytes()[0] != 0)
                } else {
                    Scalar::Int(tensor.to_i64_vec()[0])
                };
                Lazy::new(info.dtype, vec![], Kind::Literal(value))
            } else if let Some(iota) = counting(tensor) {
                iota
            } else {
                let bytes =
                    payload::to_gpu(tensor, &format!("weight `{}`", info.name))?.into_owned();
                let key = weight_key(&info.name, &bytes);
                lw.named_data.push((key.clone(), bytes));
                let buf = lw.add_buffer(BufferDesc::new(
                    &info.name,
                    info.dtype,
                    &info.shape,
                    Place::Weight(key),
                )?)?;
                lw.load(buf)
            };
            lw.values.insert(v, lazy);
        }
        Ok(lw)
    }

    /// `buf` holds graph value `v`: its actual dims, where dynamic.
    pub fn record_dims(&mut self, buf: BufferIdx, v: ValueId) {
        if let Some(d) = self.graph.sym.dims.get(&v) {
            self.dims.insert(buf, self.sizes.local(d));
        }
    }

    /// `(actual, bound)` of each dim of buffer `buf` (constants where static).
    pub fn grid_dims(&self, buf: BufferIdx) -> Vec<(SymExpr, usize)> {
        let shape = &self.buffers.list[buf].shape;
        match self.dims.get(&buf) {
            Some(d) => d.iter().cloned().zip(shape.iter().copied()).collect(),
            None => shape
                .iter()
                .map(|&n| (SymExpr::Const(n as i64), n))
                .collect(),
        }
    }

    /// The GPU bytes of weight buffer `buf` (none for other buffers).
    pub fn weight_bytes(&self, buf: BufferIdx) -> Option<&[u8]> {
        let Place::Weight(key) = &self.buffers.list[buf].place else {
            return None;
        };
        self.named_data
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, bytes)| bytes.as_slice())
    }

    /// Add a buffer, which must fit the buffer limit: a payload never
    /// needs a larger binding than the partitioner checked.
    pub fn add_buffer(&mut self, desc: BufferDesc) -> Result<BufferIdx> {
        let bytes = desc.gpu_bytes()?;
        if bytes > self.options.max_buffer_bytes {
            let by = if self.current.is_empty() {
                String::new()
            } else {
                format!(" of the `{}` kernel", self.current)
            };
            return Err(Error::limit(format!(
                "buffer `{}`{by} ({} {:?}) takes {bytes} bytes on the GPU, over the {} byte \
                 buffer limit",
                desc.name,
                desc.payload_dtype().name(),
                desc.shape,
                self.options.max_buffer_bytes
            )));
        }
        self.buffers.list.push(desc);
        Ok(self.buffers.list.len() - 1)
    }

    /// How many f32 scratch parts of `numel` elements each one buffer holds
    /// within the buffer limit (0 when not even one does).
    pub fn scratch_parts(&self, numel: usize) -> Result<usize> {
        // f32 takes 4 bytes an element: n parts take n times one part
        let part = payload::gpu_bytes(DType::F32, numel)?;
        Ok(usize::try_from(self.options.max_buffer_bytes / part).unwrap_or(usize::MAX))
    }

    /// A lazy read of the whole of `buf`.
    pub fn load(&self, buf: BufferIdx) -> LazyRef {
        let d = &self.buffers.list[buf];
        Lazy::new(d.dtype, d.shape.clone(), Kind::Load(buf))
    }

    /// A new intermediate buffer for a value of `dtype` and `shape`.
    pub fn temp(&mut self, name: &str, dtype: DType, shape: &[usize]) -> Result<BufferIdx> {
        let desc = BufferDesc::new(name, dtype, shape, Place::Temp)?;
        self.add_buffer(desc)
    }

    /// A new intermediate buffer of f16 values kept two a word, as a
    /// kernel's 16-bit operands are (`attention_flash.rs`).
    pub fn temp16(&mut self, name: &str, shape: &[usize]) -> Result<BufferIdx> {
        let mut desc = BufferDesc::new(name, DType::F16, shape, Place::Temp)?;
        desc.storage = Storage::Packed16;
        self.add_buffer(desc)
    }

    /// The lazy value of graph value `v`.
    pub fn value(&self, v: ValueId) -> Result<LazyRef> {
        self.values.get(&v).cloned().ok_or_else(|| {
            Error::internal(format!(
                "value `{}` is read before the partition computes it",
                self.graph.value(v).name
            ))
        })
    }

    /// Input slot `slot` of `node`, as a lazy value.
    pub fn input(&self, node: &Node, slot: usize) -> Result<LazyRef> {
        let v = node
            .inputs
            .get(slot)
            .copied()
            .flatten()
            .ok_or_else(|| Error::invalid_input(format!("input {slot} is missing")))?;
        self.value(v)
    }

    pub fn optional_input(&self, node: &Node, slot: usize) -> Result<Option<LazyRef>> {
        match node.inputs.get(slot).copied().flatten() {
            Some(v) => self.value(v).map(Some),
            None => Ok(None),
        }
    }

    /// Input `slot` as something a template may read many times per
    /// element: a view of a buffer (materialised when it is more).
    pub fn input_view(&mut self, node: &Node, slot: usize) -> Result<LazyRef> {
        let lazy = self.input(node, slot)?;
        if lazy.is_view() {
            return Ok(lazy);
        }
        let v = node.inputs[slot].expect("input() checked the slot");
        self.materialize_value(v, lazy)
    }

    pub fn optional_input_view(&mut self, node: &Node, slot: usize) -> Result<Option<LazyRef>> {
        match node.inputs.get(slot).copied().flatten() {
            Some(_) => self.input_view(node, slot).map(Some),
            None => Ok(None),
        }
    }

    /// Output `k` of `node`: `(name, dtype, shape)`.
    pub fn output_info(&self, node: &Node, k: usize) -> Result<(String, DType, Vec<usize>)> {
        let v = *node
            .outputs
            .get(k)
            .ok_or_else(|| Error::internal(format!("output {k} is missing")))?;
        let info = self.graph.value(v);
        Ok((info.name.clone(), info.dtype, info.shape.clone()))
    }

    /// A buffer for output `k` of `node` that a template writes, recorded
    /// as the value's home.
    pub fn output_buffer(&mut self, node: &Node, k: usize) -> Result<BufferIdx> {
        let (name, dtype, shape) = self.output_info(node, k)?;
        let buf = self.temp(&name, dtype, &shape)?;
        self.record_dims(buf, node.outputs[k]);
        let lazy = self.load(buf);
        self.values.insert(node.outputs[k], lazy);
        Ok(buf)
    }

    /// Record `lazy` as the value of graph value `v`.
    pub fn define(&mut self, v: ValueId, lazy: LazyRef) {
        self.values.insert(v, lazy);
    }

    /// Reads of graph value `v` still to come (by nodes not yet lowered,
    /// and one for a partition output).
    pub(crate) fn readers(&self, v: ValueId) -> usize {
        self.readers.get(&v).copied().unwrap_or(0)
    }

    /// Whether buffer `buf` is a resident state input, which the partition
    /// may write in place ([`Boundary::resident`]).
    pub(crate) fn is_resident(&self, buf: BufferIdx) -> bool {
        self.resident.contains(&buf)
    }

    /// Whether anything still to come reads buffer `buf`: the value of a
    /// graph value other than `except` that a node still reads, or
    /// deferred work (a row mean, a row write).
    pub(crate) fn read_later(&self, buf: BufferIdx, except: ValueId) -> bool {
        let reads = |lazy: &LazyRef| {
            let mut b = vec![];
            lazy.buffers(&mut b);
            b.contains(&buf)
        };
        let live = (self.values.iter())
            .any(|(w, lazy)| *w != except && self.readers(*w) > 0 && reads(lazy));
        let waiting = self.pending.iter().any(|st| reads(&st.x))
            || self.scatters.iter().any(|s| s.reads(buf));
        live || waiting
    }

    /// The one partition node that reads `v` (once; `v` is no partition
    /// output), with its index, so a template can compute it too.
    pub fn sole_reader(&self, v: ValueId) -> Option<(usize, &'g Node)> {
        if self.readers.get(&v) != Some(&1) {
            return None;
        }
        let graph = self.graph;
        self.nodes
            .iter()
            .map(|&n| (n, &graph.nodes[n]))
            .find(|(_, node)| node.inputs.contains(&Some(v)))
    }

    /// The partition's nodes after `node`, not yet computed.
    pub fn nodes_after(&self, node: &Node) -> Vec<(usize, &'g Node)> {
        let graph = self.graph;
        let at = self
            .nodes
            .iter()
            .position(|&n| std::ptr::eq(&graph.nodes[n], node));
        let Some(at) = at else { return vec![] };
        self.nodes[at + 1..]
            .iter()
            .filter(|n| !self.absorbed.contains(n))
            .map(|&n| (n, &graph.nodes[n]))
            .collect()
    }

    /// Whether node `n` was computed by a template with its own (its turn
    /// only consumes its reads).
    pub(crate) fn is_absorbed(&self, n: usize) -> bool {
        self.absorbed.contains(&n)
    }

    /// Node `n`'s outputs are computed (by the template lowering the node
    /// before it): `values` are their lazy values; lowering it does nothing.
    pub fn absorb(&mut self, n: usize, values: &[(ValueId, LazyRef)]) {
        self.absorbed.insert(n);
        for (v, lazy) in values {
            self.values.insert(*v, lazy.clone());
        }
    }

    /// Lower node `n` now, ahead of its turn (a template's store computes
    /// it: its inputs are computed); its turn only consumes its reads.
    pub fn lower_ahead(&mut self, n: usize) -> Result<()> {
        let node = &self.graph.nodes[n];
        let counts: Vec<(ValueId, Option<usize>)> = node
            .inputs
            .iter()
            .flatten()
            .map(|v| (*v, self.readers.get(v).copied()))
            .collect();
        let lowered = self.labelled(String::new(), |lw| (lw.driver.lower_node)(lw, node));
        for (v, c) in counts.into_iter().filter_map(|(v, c)| Some((v, c?))) {
            self.readers.insert(v, c);
        }
        self.absorbed.insert(n);
        lowered
    }

    /// Record `lazy` as the value of `v`, to be fused into its readers
    /// (materialised first when that would bind or inline too much).
    pub fn define_fused(&mut self, v: ValueId, lazy: LazyRef) -> Result<()> {
        let lazy = self.bound_fusion(v, lazy)?;
        self.values.insert(v, lazy);
        Ok(())
    }

    /// Write `lazy` to a buffer (once: later readers load it).
    fn materialize_value(&mut self, v: ValueId, lazy: LazyRef) -> Result<LazyRef> {
        let name = self.graph.value(v).name.clone();
        let mut desc = BufferDesc::new(&name, lazy.dtype, &lazy.shape, Place::Temp)?;
        if self.outputs.contains(&v) {
            // a partition output (a new KV cache) is written in its host
            // form (16-bit packed), so `finish` takes this buffer as it is
            // instead of copying it
            desc.storage =
                BufferDesc::new(&name, lazy.dtype, &lazy.shape, Place::Output(0))?.storage;
        }
        let buf = self.add_buffer(desc)?;
        self.record_dims(buf, v);
        self.write_flat(&lazy, buf)?;
        let loaded = self.load(buf);
        self.values.insert(v, loaded.clone());
        Ok(loaded)
    }

    /// A flat kernel writing every element of `lazy` to `buf` (a cat
    /// over the binding budget: a kernel per slice of it).
    pub fn write_flat(&mut self, lazy: &LazyRef, buf: BufferIdx) -> Result<()> {
        match budget::cat_slices(lazy, self.options.max_bindings) {
            Some(slices) => slices
                .iter()
                .try_for_each(|s| self.write_flat_at(&s.value, buf, Some((s.dim, s.start)))),
            None => self.write_flat_at(lazy, buf, None),
        }
    }

    /// [`Self::write_flat`] of one kernel; `slice` `(dim, start)`: `lazy`
    /// is the part of `buf` from `start` along `dim` (a cat's slice).
    fn write_flat_at(
        &mut self,
        lazy: &LazyRef,
        buf: BufferIdx,
        slice: Option<(usize, usize)>,
    ) -> Result<()> {
        let numel = match slice {
            None => self.buffers.list[buf].numel(),
            Some(_) => lazy.shape.iter().product(),
        }
        .max(1);
        let packed = self.buffers.list[buf].storage == Storage::Packed16;
        let mut kb = KernelBuilder::new(&self.buffers);
        kb.value_fn(lazy, "value")?;
        let mut main = entry(FLAT_WORKGROUP);
        let rank = lazy.shape.len();
        let call = |e: &str| {
            let idx = unravel(e, &lazy.shape);
            format!("value({})", idx.join(", "))
        };
        let mut grid_dims = self.grid_dims(buf);
        let per = if packed { 2 } else { 1 };
        // the slice is `runs` runs of `len` elements `stride` apart in `buf`
        let (runs, len, stride, offset) = match slice {
            None => (1, numel, numel, 0),
            Some((dim, start)) => {
                let out = &self.buffers.list[buf].shape;
                let inner: usize = out[dim + 1..].iter().product();
                let runs = out[..dim].iter().product();
                (
                    runs,
                    lazy.shape[dim] * inner,
                    out[dim] * inner,
                    start * inner,
                )
            }
        };
        // a packed slice: `words` word slots a run, enough for any
        // alignment; the words at its ends keep the other slice's half
        let words = len / 2 + 1;
        let items = match (slice, packed) {
            (None, _) => numel.div_ceil(per),
            (Some(_), false) => numel,
            (Some(_), true) => runs * words,
        };
        main.push_str(&format!(
            "  let g = {FLAT_GROUP} * {FLAT_WORKGROUP}u + lid;\n  if (g >= {items}u) {{ return; }}\n"
        ));
        if let (Some((dim, _)), true) = (slice, packed) {
            let (lo, hi) = (call("k0"), call("k1"));
            main.push_str(&format!(
                "  let o = g / {words}u;\n  let base = o * {stride}u + {offset}u;\n\
                 \x20 let w = base / 2u + g % {words}u;\n  let e0 = 2u * w;\n\
                 \x20 let in0 = e0 >= base && e0 < base + {len}u;\n\
                 \x20 let in1 = e0 + 1u >= base && e0 + 1u < base + {len}u;\n\
                 \x20 if (!(in0 || in1)) {{ return; }}\n\
                 \x20 let k0 = o * {len}u + select(0u, e0 - base, in0);\n\
                 \x20 let k1 = o * {len}u + select(0u, e0 + 1u - base, in1);\n\
                 \x20 let lo = {lo};\n  let hi = {hi};\n"
            ));
            let store = kb.store_pair_where(buf, "w", "lo", "hi", "in0", "in1");
            main.push_str(&format!("{store}}}\n"));
            grid_dims.truncate(dim);
            grid_dims.push((SymExpr::Const(words as i64), words));
        } else if packed {
            let lo = call("e0");
            let hi = call("e1");
            main.push_str("  let e0 = 2u * g;\n  let e1 = min(e0 + 1u, ");
            main.push_str(&format!("{}u);\n", numel - 1));
            let store = kb.store_pair(buf, "g", "lo", "hi");
            main.push_str(&format!(
                "  let lo = {lo};\n  let hi = select(0.0, {hi}, e0 + 1u < {numel}u);\n  {store}\n}}\n"
            ));
        } else {
            let v = if rank == 0 {
                "value()".to_string()
            } else {
                call("g")
            };
            let at = match slice {
                None => "g".to_string(),
                Some((dim, _)) => {
                    let n = lazy.shape[dim];
                    grid_dims[dim] = (SymExpr::Const(n as i64), n);
                    format!("g / {len}u * {stride}u + g % {len}u + {offset}u")
                }
            };
            let store = kb.store(buf, &at, &v)?;
            main.push_str(&format!("  {store}\n}}\n"));
        }
        let groups = (items as u64).div_ceil(u64::from(FLAT_WORKGROUP));
        let workgroups = grid(groups, self.options.max_workgroups_per_dim)?;
        let unit = if slice.is_some() { 1 } else { per };
        let actual = self
            .sizes
            .groups(&grid_dims, unit * FLAT_WORKGROUP as usize)?;
        // named by the pointwise ops it inlines (`copy` when it only moves data)
        let built = kb.finish(&main);
        self.add_dispatch_sized(built, vec![], [FLAT_WORKGROUP, 1, 1], workgroups, 0, actual)
    }

    /// The op being lowered, which names the dispatches it adds.
    pub(crate) fn op_label(&self) -> String {
        self.current.clone()
    }

    /// Name the dispatches added from now on after op `label`.
    pub(crate) fn set_op_label(&mut self, label: &str) {
        self.current = label.to_string();
    }

    /// Run `f` with the dispatches it adds named after `label` (work done
    /// on another node's behalf), the current name back afterwards.
    fn labelled<T>(&mut self, label: String, f: impl FnOnce(&mut Lowering) -> T) -> T {
        let outer = std::mem::replace(&mut self.current, label);
        let done = f(self);
        self.current = outer;
        done
    }

    /// Finish a kernel: validate it, share it with an identical earlier
    /// kernel, and append its dispatch.
    pub fn add_dispatch(
        &mut self,
        built: Built,
        ops: Vec<String>,
        workgroup_size: [u32; 3],
        workgroups: [u32; 3],
        workgroup_storage: u32,
    ) -> Result<()> {
        self.add_dispatch_sized(
            built,
            ops,
            workgroup_size,
            workgroups,
            workgroup_storage,
            None,
        )
    }

    /// [`Self::add_dispatch`] with `groups` workgroups at the actual sizes
    /// (`workgroups` are the counts at the bound).
    pub fn add_dispatch_sized(
        &mut self,
        built: Built,
        ops: Vec<String>,
        workgroup_size: [u32; 3],
        workgroups: [u32; 3],
        workgroup_storage: u32,
        groups: Option<payload::Size>,
    ) -> Result<()> {
        let groups = match &self.gate {
            Some(gate) => {
                let bound = workgroups.iter().map(|&w| u64::from(w)).product();
                self.sizes.gated(groups, bound, gate)?
            }
            None => groups,
        };
        // a row mean this kernel reads is dispatched first
        self.dispatch_row_means(&built.bindings)?;
        // as are the row writes into a buffer it binds (and those waiting with them)
        if self
            .scatters
            .iter()
            .any(|s| built.bindings.contains(&s.target))
        {
            self.flush_scatters()?;
        }
        let Built {
            wgsl,
            mut bindings,
            fused,
            sites,
            sizes,
            tag,
            f16,
        } = built;
        let coop = self.alternative_storage.is_some();
        if !sites.is_empty() {
            if coop {
                // an alternative would skip the base dispatch's checks
                return Err(Error::internal(
                    "a kernel of an alternative has run-time checks",
                ));
            }
            let dispatch = self.dispatches.len();
            let buffer = self.add_buffer(BufferDesc::new(
                &format!("status of dispatch {dispatch}"),
                DType::I32,
                &[sites.len().div_ceil(32)],
                Place::Status,
            )?)?;
            bindings.push(buffer);
            self.checks.push(Check {
                dispatch,
                buffer,
                sites,
            });
        }
        let mut ops = ops;
        for f in fused {
            if !ops.contains(&f) {
                ops.push(f);
            }
        }
        if ops.is_empty() {
            ops.push("copy".into());
        }
        budget::check(&self.current, &bindings, self.options.max_bindings)?;
        let access: Vec<Access> = bindings.iter().map(|&b| self.buffers.access(b)).collect();
        let kernel = match self.kernels.iter().position(|k| k.wgsl == wgsl) {
            Some(i) => i,
            None => {
                let mut name = format!("k{}_{}", self.kernels.len(), ops.join("_"));
                if let Some(tag) = tag {
                    name = format!("{name}_{tag}");
                }
                let writable: Vec<bool> = access.iter().map(|a| *a == Access::ReadWrite).collect();
                let msl = validate::validate_and_translate(&name, &wgsl, &writable, coop, sizes)?;
                self.kernels.push(Kernel {
                    name,
                    ops,
                    wgsl,
                    msl,
                    entry_point: "main".into(),
                    bindings: access,
                    workgroup_size,
                    sizes,
                });
                self.kernels.len() - 1
            }
        };
        match &mut self.alternative_storage {
            Some(storage) => *storage = (*storage).max(workgroup_storage),
            None => {
                let r = &mut self.requirements;
                r.max_storage_buffers_per_shader_stage = r
                    .max_storage_buffers_per_shader_stage
                    .max(bindings.len() as u32);
                r.max_compute_invocations_per_workgroup = r
                    .max_compute_invocations_per_workgroup
                    .max(workgroup_size.iter().product());
                r.max_compute_workgroup_storage_size =
                    r.max_compute_workgroup_storage_size.max(workgroup_storage);
                r.shader_f16 |= f16;
            }
        }
        self.dispatches.push(Dispatch {
            kernel,
            nodes: vec![self.current.clone()],
            buffers: bindings,
            workgroups,
            groups,
            alternatives: vec![],
        });
        Ok(())
    }

    /// Give dispatch `d` an alternative for devices offering tensor-core
    /// form `form`: the dispatches `build` adds (after `d`, which it must
    /// not outlive). Its kernels write their primitives through
    /// [`Self::coop_mat`], may use cooperative matrices and subgroup
    /// builtins, bind at most `max_bindings` buffers and stay within the
    /// default invocation count; their workgroup memory goes into the
    /// alternative's [`Needs`], not into the payload's requirements.
    ///
    /// The one home of the emulation rule: with
    /// [`PreprocessOptions::emulate_coop`] set, only that form is built, with
    /// emulated primitives, as ordinary dispatches (validated without
    /// cooperative-matrix or subgroup capabilities) that replace `d`, the
    /// last dispatch; the payload gets no alternative.
    pub fn alternative(
        &mut self,
        d: usize,
        form: CoopForm,
        build: impl FnOnce(&mut Lowering) -> Result<()>,
    ) -> Result<()> {
        // (a row write an alternative's kernel flushed would run only with it)
        if self.alternative_storage.is_none() {
            self.flush_scatters()?;
        }
        let start = self.dispatches.len();
        if d >= start || self.alternative_storage.is_some() || self.emulating {
            return Err(Error::internal(format!(
                "an alternative to dispatch {d} of {start} (or inside another)"
            )));
        }
        if let Some(emulated) = self.options.emulate_coop {
            if emulated != form {
                return Ok(());
            }
            if d + 1 != start || self.checks.iter().any(|c| c.dispatch == d) {
                return Err(Error::internal(format!(
                    "an emulated tensor-core form replaces dispatch {d} of {start}, \
                     which is not the last or has run-time checks"
                )));
            }
            self.emulating = true;
            let built = build(self);
            self.emulating = false;
            built?;
            self.dispatches.remove(d);
            for c in &mut self.checks {
                c.dispatch -= usize::from(c.dispatch > d);
            }
            return Ok(());
        }
        let needs = form.needs();
        self.alternative_storage = Some(0);
        let built = build(self);
        let storage = self.alternative_storage.take().unwrap_or(0);
        built?;
        let dispatches: Vec<Dispatch> = self.dispatches.drain(start..).collect();
        let limits = Requirements::default();
        for inner in &dispatches {
            let k = &self.kernels[inner.kernel];
            if k.workgroup_size.iter().product::<u32>()
                > limits.max_compute_invocations_per_workgroup
            {
                return Err(Error::internal(format!(
                    "kernel `{}` of an alternative runs workgroups of {:?}",
                    k.name, k.workgroup_size
                )));
            }
        }
        self.dispatches[d].alternatives.push(Alternative {
            needs: Needs {
                workgroup_storage: storage,
                ..needs
            },
            dispatches,
        });
        Ok(())
    }

    /// Whether a dispatch may gain more than one alternative of a form
    /// (variants the runtime measures): not while emulating, where the one
    /// emulated form replaces the dispatch.
    pub(crate) fn variants(&self) -> bool {
        self.options.emulate_coop.is_none()
    }

    /// The cooperative-matrix primitives for a kernel of tensor-core form
    /// `form` built inside [`Self::alternative`]: emulated exactly when
    /// that is emulating.
    pub(crate) fn coop_mat(&self, form: CoopForm) -> CoopMat {
        CoopMat::new(form, self.emulating)
    }

    /// One node's reads are done: a value no later node reads is dropped.
    pub(crate) fn consume(&mut self, node: &Node) {
        for v in node.inputs.iter().flatten() {
            if let Some(n) = self.readers.get_mut(v) {
                *n = n.saturating_sub(1);
            }
        }
    }

    /// Lazy input of a pointwise or layout node, materialised first when
    /// another node also reads it (computing it twice would cost more than
    /// a load; a view of it, e.g. each layer's `unsqueeze` of the rotary
    /// table, then reads the one copy).
    pub(crate) fn fused(&mut self, node: &Node, slot: usize) -> Result<LazyRef> {
        let lazy = self.input(node, slot)?;
        let v = node.inputs[slot].expect("input() checked the slot");
        let shared = self.readers.get(&v).copied().unwrap_or(0) > 1;
        if !lazy.is_cheap() && shared {
            return self.materialize_value(v, lazy);
        }
        Ok(lazy)
    }
    /// Materialise the inputs of expression node `node` (whose value is
    /// `lazy`), the ones reading the most buffers first, until a kernel
    /// writing it fits the budget. Whether any was: then `node` is lowered
    /// again over them. A cat is split instead ([`budget::cat_slices`]).
    pub(crate) fn split_inputs(&mut self, node: &Node, lazy: &LazyRef) -> Result<bool> {
        let budget = self.options.max_bindings;
        if matches!(lazy.kind, Kind::Cat(..)) || budget::flat_bindings(lazy) <= budget {
            return Ok(false);
        }
        // the output and a status buffer besides the reads
        let fixed = budget::flat_bindings(lazy) - budget::read_count(lazy);
        let mut inputs: Vec<ValueId> = node.inputs.iter().flatten().copied().collect();
        inputs.sort();
        inputs.dedup();
        // materialising a view of one buffer would bind no fewer
        inputs.retain(|v| {
            self.values
                .get(v)
                .is_some_and(|x| budget::read_count(x) > 1)
        });
        inputs.sort_by_key(|v| std::cmp::Reverse(budget::read_count(&self.values[v])));
        let mut split = false;
        for v in inputs {
            let mut union = vec![];
            for w in node.inputs.iter().flatten() {
                if let Some(x) = self.values.get(w) {
                    x.buffers(&mut union);
                }
            }
            if union.len() + fixed <= budget {
                break;
            }
            let x = self.values[&v].clone();
            self.materialize_value(v, x)?;
            split = true;
        }
        Ok(split)
    }

    /// Input `slot` of `node` fused into a template that binds `extra`
    /// buffers more than a flat kernel writing it would (a second output):
    /// materialised when that would bind over the budget.
    pub(crate) fn fused_within(
        &mut self,
        node: &Node,
        slot: usize,
        extra: usize,
    ) -> Result<LazyRef> {
        let x = self.fused(node, slot)?;
        if budget::flat_bindings(&x) + extra <= self.options.max_bindings {
            return Ok(x);
        }
        let v = node.inputs[slot].expect("fused() checked the slot");
        self.materialize_value(v, x)
    }

    /// Materialise `lazy` (the value of `v`) when inlining it further would
    /// bind more buffers or inline more code than a kernel should.
    fn bound_fusion(&mut self, v: ValueId, lazy: LazyRef) -> Result<LazyRef> {
        // the kernel that inlines it binds its output too, and a status
        // buffer for its checks
        let bindings = budget::flat_bindings(&lazy);
        if bindings > self.options.max_bindings || lazy.size() > self.options.max_fused_size {
            return self.materialize_value(v, lazy);
        }
        Ok(lazy)
    }

    /// The in-place row writes waiting to be dispatched together.
    pub(crate) fn scatters_waiting(&self) -> &[Scatter] {
        &self.scatters
    }

    /// Let the in-place row write `s` wait with those waiting (the
    /// caller has dispatched them first where `s` may not join them).
    pub(crate) fn defer_scatter(&mut self, s: Scatter) {
        self.scatters.push(s);
    }

    /// Take the row writes waiting at `indices` (of [`Self::scatters_waiting`])
    /// for the kernel about to be added to write itself, which it may only
    /// where it runs at every size ([`Self::is_gated`]).
    pub(crate) fn take_scatters(&mut self, indices: &[usize]) -> Vec<Scatter> {
        let mut taken = vec![];
        let mut kept = vec![];
        for (i, s) in std::mem::take(&mut self.scatters).into_iter().enumerate() {
            match indices.contains(&i) {
                true => taken.push(s),
                false => kept.push(s),
            }
        }
        self.scatters = kept;
        taken
    }

    /// Whether the dispatches added now run only at some sizes (a bucket's).
    pub(crate) fn is_gated(&self) -> bool {
        self.gate.is_some()
    }

    /// Dispatch the row writes waiting (one kernel), outside any size gate.
    pub(crate) fn flush_scatters(&mut self) -> Result<()> {
        let waiting = std::mem::take(&mut self.scatters);
        if waiting.is_empty() {
            return Ok(());
        }
        self.with_gate(None, |lw| {
            lw.labelled("index_copy".into(), |lw| (lw.driver.scatter)(lw, &waiting))
        })
    }

    /// Dispatch the row means waiting ([`RowStat`]) that a kernel binding
    /// `buffers` reads, each named after its own node.
    pub(crate) fn dispatch_row_means(&mut self, buffers: &[BufferIdx]) -> Result<()> {
        while let Some(i) = self.pending.iter().position(|st| buffers.contains(&st.buf)) {
            let stat = self.pending.remove(i);
            self.labelled(stat.label.clone(), |lw| (lw.driver.row_mean)(lw, &stat))?;
        }
        Ok(())
    }

    /// Run `lower` with every dispatch it adds gated to `gate` (a bucket of
    /// a run-time size: the dispatch runs only where the size falls in it),
    /// the previous gate back afterwards, whatever `lower` returns.
    pub fn gated<T>(
        &mut self,
        gate: SymExpr,
        lower: impl FnOnce(&mut Lowering) -> Result<T>,
    ) -> Result<T> {
        self.with_gate(Some(gate), lower)
    }

    /// Run `f` under `gate` (`None`: ungated), the previous gate back
    /// afterwards.
    fn with_gate<T>(
        &mut self,
        gate: Option<SymExpr>,
        f: impl FnOnce(&mut Lowering) -> Result<T>,
    ) -> Result<T> {
        let outer = std::mem::replace(&mut self.gate, gate);
        let done = f(self);
        self.gate = outer;
        done
    }

    /// The record made into the payload: the partition outputs written
    /// (where no kernel wrote one in its place already), arenas planned.
    /// The driver has dispatched the deferred work first.
    pub(crate) fn finish(mut self) -> Result<Preprocessed> {
        self.current = "output".into();
        let mut outputs = vec![];
        // outputs written here, by their values: another output that is
        // the same computation (the recipe's per-layer cache lengths, each
        // `cache_position[0] + 1`) is the same buffer, not one more kernel
        let mut written: Vec<(LazyRef, BufferIdx)> = vec![];
        for (k, &v) in self.outputs.clone().iter().enumerate() {
            let lazy = self.value(v)?;
            let info = self.graph.value(v);
            let desc = BufferDesc::new(&info.name, info.dtype, &info.shape, Place::Output(k))?;
            if let Some((_, b)) = written.iter().find(|(w, _)| *w == lazy) {
                outputs.push(*b);
                continue;
            }
            let reuse = match lazy.kind {
                Kind::Load(b)
                    if self.buffers.list[b].place == Place::Temp
                        && self.buffers.list[b].storage == desc.storage =>
                {
                    Some(b)
                }
                // resident state written in place: its input is its new value
                Kind::Load(b)
                    if matches!(self.buffers.list[b].place, Place::Input(_))
                        && self.in_place.get(&v) == Some(&b) =>
                {
                    outputs.push(b);
                    continue;
                }
                _ => None,
            };
            let buf = match reuse {
                Some(b) => {
                    self.buffers.list[b].place = Place::Output(k);
                    b
                }
                None => {
                    let b = self.add_buffer(desc)?;
                    self.record_dims(b, v);
                    self.write_flat(&lazy, b)?;
                    written.push((lazy, b));
                    b
                }
            };
            self.record_dims(buf, v);
            outputs.push(buf);
        }
        let arenas = arena::plan(&self.buffers, &self.dispatches)?;
        let mut buffers = vec![];
        let mut inputs = vec![];
        for (i, b) in self.buffers.list.iter().enumerate() {
            let bytes = b.gpu_bytes()?;
            let r = &mut self.requirements;
            r.max_storage_buffer_binding_size = r.max_storage_buffer_binding_size.max(bytes);
            r.max_buffer_size = r.max_buffer_size.max(bytes);
            let location = match &b.place {
                Place::Weight(key) => Location::Weight { key: key.clone() },
                _ => {
                    let (arena, offset) = arenas.offsets[i].ok_or_else(|| {
                        Error::internal(format!("buffer `{}` has no arena range", b.name))
                    })?;
                    Location::Arena { arena, offset }
                }
            };
            if let Place::Input(k) = b.place {
                inputs.push((k, i));
            }
            let dims = match self.dims.get(&i) {
                Some(d) => d
                    .iter()
                    .map(|e| self.sizes.size(e))
                    .collect::<Result<_>>()?,
                None => vec![],
            };
            buffers.push(payload::Buffer {
                name: b.name.clone(),
                dtype: b.payload_dtype(),
                shape: b.shape.clone(),
                location,
                dims,
            });
        }
        inputs.sort();
        for &size in &arenas.sizes {
            self.requirements.max_buffer_size = self.requirements.max_buffer_size.max(size);
        }
        let payload = Payload {
            buffers,
            kernels: self.kernels,
            dispatches: self.dispatches,
            inputs: inputs.into_iter().map(|(_, i)| i).collect(),
            outputs,
            arenas: arenas.sizes,
            requirements: self.requirements,
            state: vec![],
            checks: self.checks,
            symbols: self.sizes.symbols,
        };
        Ok(Preprocessed {
            payload,
            named_data: self.named_data,
        })
    }
}
