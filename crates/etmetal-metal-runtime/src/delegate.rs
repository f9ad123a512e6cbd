//! One loaded delegate: weights (uploaded from the named data in steps),
//! arenas, pipelines, bind groups and the input and read-back buffers made
//! once at load; an execute converts the lent inputs into the mapped input
//! buffer, records their copies into the arena and the dispatches into a
//! few command buffers, each submitted as soon as it is recorded (so the
//! GPU starts while the host records the rest), and converts the outputs
//! back, with the status words of the payload's run-time checks (zeroed in
//! the first command buffer): a set bit fails the execute. Mutable buffers the
//! payload marks as [`payload::State`] stay in the arena across
//! executes: written only when the method passes their host value, updated
//! by a GPU copy at the end of each execute, read back only on request.
//! Where the device meets a dispatch's [`payload::Alternative`], the
//! alternative's dispatches run in its place (chosen once, at load; only
//! the kernels that run are built).

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use etmetal_core::{Error, Result, View, ViewMut};
use etmetal_metal::payload::{self, Access, Dispatch, Fault, Location, Payload};
use etmetal_runtime::{trace, DelegateArg, DelegateHandle, NamedData};

use crate::device::GpuDevice;
use crate::select::{self, Choice, Launch, Selection, TuningCache};
use crate::{bound, transfer};

/// What a backend has created on the GPU so far (all its delegates).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuStats {
    pub pipelines_created: u64,
    pub buffers_allocated: u64,
    pub submits: u64,
    /// Bytes written to the GPU by executes (delegate inputs, resident state
    /// when the host copy is newer); weights at load are not counted.
    pub bytes_uploaded: u64,
    /// Bytes copied back from the GPU (outputs, state read on request).
    pub bytes_read_back: u64,
    /// Payload dispatches whose alternative runs in their place.
    pub alternatives_chosen: u64,
}

/// GPU time of one dispatch in a profiled execute, from timestamp queries
/// written at the start and end of its compute pass.
#[derive(Clone, Debug, PartialEq)]
pub struct DispatchTime {
    /// The kernel's name in the payload (`k3_matmul_add_relu`).
    pub kernel: String,
    /// The graph ops fused into the kernel.
    pub ops: Vec<String>,
    /// What the alternative it belongs to needs (`16x16x16 f16->f32,
    /// subgroup 32`); `None` for a payload's own dispatch.
    pub variant: Option<String>,
    pub seconds: f64,
}

#[derive(Default)]
pub(crate) struct Counters {
    pipelines: AtomicU64,
    buffers: AtomicU64,
    submits: AtomicU64,
    uploaded: AtomicU64,
    read_back: AtomicU64,
    alternatives: AtomicU64,
    /// Whether executes write timestamps around every dispatch.
    pub(crate) profiling: AtomicBool,
    /// Dispatch times of profiled executes not yet taken, in execution order.
    pub(crate) times: Mutex<Vec<DispatchTime>>,
}

impl Counters {
    pub(crate) fn stats(&self) -> GpuStats {
        GpuStats {
            pipelines_created: self.pipelines.load(Ordering::Relaxed),
            buffers_allocated: self.buffers.load(Ordering::Relaxed),
            submits: self.submits.load(Ordering::Relaxed),
            bytes_uploaded: self.uploaded.load(Ordering::Relaxed),
            bytes_read_back: self.read_back.load(Ordering::Relaxed),
            alternatives_chosen: self.alternatives.load(Ordering::Relaxed),
        }
    }
}

/// Run `f` inside validation, out-of-memory and internal error scopes; a
/// captured error becomes an `Error` about `what`.
fn scoped<T>(gpu: &GpuDevice, what: impl FnOnce() -> String, f: impl FnOnce() -> T) -> Result<T> {
    let internal = gpu.device.push_error_scope(wgpu::ErrorFilter::Internal);
    let oom = gpu.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
    let validation = gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
    let out = f();
    // Scopes pop innermost first.
    let errors = [
        pollster::block_on(validation.pop()),
        pollster::block_on(oom.pop()),
        pollster::block_on(internal.pop()),
    ];
    match errors.into_iter().flatten().next() {
        None => Ok(out),
        Some(wgpu::Error::OutOfMemory { source }) => Err(Error::limit(format!(
            "{}: GPU out of memory: {}",
            what(),
            one_line(&source.to_string())
        ))),
        // wgpu's `Display` is only "Validation Error"; the description says what.
        Some(
            wgpu::Error::Validation { description, .. } | wgpu::Error::Internal { description, .. },
        ) => Err(Error::internal(format!(
            "{}: {}",
            what(),
            one_line(&description)
        ))),
    }
}

/// A multi-line wgpu message (shader diagnostics) on one line.
fn one_line(text: &str) -> String {
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    lines.join(" ")
}

/// Workgroup memory of a kernel as WebGPU counts it (each `var<workgroup>`
/// rounded up to 16 bytes), or `None` if its WGSL does not parse.
fn workgroup_bytes(wgsl: &str) -> Option<u64> {
    let module = naga::front::wgsl::parse_str(wgsl).ok()?;
    let mut layouter = naga::proc::Layouter::default();
    layouter.update(module.to_ctx()).ok()?;
    Some(
        module
            .global_variables
            .iter()
            .filter(|(_, g)| g.space == naga::AddressSpace::WorkGroup)
            .map(|(_, g)| u64::from(layouter[g.ty].size).next_multiple_of(16))
            .sum(),
    )
}

/// A tensor's place on the GPU: the bytes of a buffer that are bound.
#[derive(Clone, Copy)]
struct Region {
    buffer: usize,
    offset: u64,
    size: u64,
}

/// Timestamp queries around every dispatch (two per dispatch, in query
/// sets of at most `QUERY_SET_MAX_QUERIES`), resolved and read back with
/// the outputs.
struct Profiler {
    sets: Vec<wgpu::QuerySet>,
    resolve: wgpu::Buffer,
    readback: wgpu::Buffer,
    /// Nanoseconds per timestamp tick.
    period_ns: f64,
}

impl Profiler {
    const PER_SET: u32 = wgpu::QUERY_SET_MAX_QUERIES;

    fn new(gpu: &GpuDevice, dispatches: usize) -> Profiler {
        let queries = 2 * dispatches as u64;
        let per_set = u64::from(Self::PER_SET);
        let sets = (0..queries.div_ceil(per_set))
            .map(|i| {
                gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
                    label: Some("etmetal dispatch timestamps"),
                    ty: wgpu::QueryType::Timestamp,
                    count: (queries - i * per_set).min(per_set) as u32,
                })
            })
            .collect();
        // A full set resolves to 32 KiB, a multiple of the 256-byte alignment.
        let bytes = (queries * u64::from(wgpu::QUERY_SIZE)).max(8);
        let buffer = |label, usage| {
            gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes,
                usage,
                mapped_at_creation: false,
            })
        };
        Profiler {
            sets,
            resolve: buffer(
                "timestamp resolve",
                wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            ),
            readback: buffer(
                "timestamp read-back",
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            ),
            period_ns: f64::from(gpu.queue.get_timestamp_period()),
        }
    }

    /// The pass timestamp writes of dispatch `d`.
    fn writes(&self, d: usize) -> wgpu::ComputePassTimestampWrites<'_> {
        let q = 2 * d as u32;
        wgpu::ComputePassTimestampWrites {
            query_set: &self.sets[(q / Self::PER_SET) as usize],
            beginning_of_pass_write_index: Some(q % Self::PER_SET),
            end_of_pass_write_index: Some(q % Self::PER_SET + 1),
        }
    }

    fn resolve(&self, encoder: &mut wgpu::CommandEncoder) {
        for (i, set) in self.sets.iter().enumerate() {
            let offset = i as u64 * u64::from(Self::PER_SET * wgpu::QUERY_SIZE);
            encoder.resolve_query_set(set, 0..set.count(), &self.resolve, offset);
        }
        encoder.copy_buffer_to_buffer(&self.resolve, 0, &self.readback, 0, self.resolve.size());
    }

    /// Seconds per dispatch from the mapped read-back buffer.
    fn seconds(&self) -> Result<Vec<f64>> {
        let view = self
            .readback
            .get_mapped_range(..)
            .map_err(|e| Error::internal(format!("reading the GPU timestamps back: {e}")))?;
        let ticks: Vec<u64> = view
            .chunks_exact(8)
            .map(|c| {
                let mut b = [0; 8];
                b.copy_from_slice(c);
                u64::from_le_bytes(b)
            })
            .collect();
        drop(view);
        self.readback.unmap();
        // A GPU may write an end below its start (a counter reset); 0 then.
        Ok(ticks
            .chunks_exact(2)
            .map(|p| p[1].saturating_sub(p[0]) as f64 * self.period_ns * 1e-9)
            .collect())
    }
}

/// The payload's kernels as pipelines, each built when a launch (or a
/// measurement of the forms, `select`) first needs it.
struct Kernels<'a> {
    gpu: &'a GpuDevice,
    payload: &'a Payload,
    counters: &'a Counters,
    built: Vec<Option<(wgpu::BindGroupLayout, wgpu::ComputePipeline)>>,
}

impl<'a> Kernels<'a> {
    fn new(gpu: &'a GpuDevice, payload: &'a Payload, counters: &'a Counters) -> Kernels<'a> {
        Kernels {
            gpu,
            payload,
            counters,
            built: (0..payload.kernels.len()).map(|_| None).collect(),
        }
    }

    /// Build kernel `i` (of an alternative when `alternative`: its errors
    /// say how to run without them) unless it is built.
    fn build(&mut self, i: usize, alternative: bool) -> Result<()> {
        if self.built[i].is_some() {
            return Ok(());
        }
        let (gpu, k) = (self.gpu, &self.payload.kernels[i]);
        let (device, limits) = (&gpu.device, &gpu.limits);
        if k.bindings.len() as u64 > limits.max_storage_buffers_per_shader_stage.into() {
            return Err(Error::limit(format!(
                "kernel `{}` binds {} storage buffers, the GPU's \
                 max_storage_buffers_per_shader_stage = {}",
                k.name,
                k.bindings.len(),
                limits.max_storage_buffers_per_shader_stage
            )));
        }
        // wgpu does not check workgroup memory against the limit, and a
        // software adapter runs any amount; a GPU's driver would refuse
        // or misbehave, so refuse here. WGSL that does not parse is left
        // to wgpu, which reports it with its diagnostics.
        if let Some(bytes) = workgroup_bytes(&k.wgsl) {
            if bytes > limits.max_compute_workgroup_storage_size.into() {
                return Err(Error::limit(format!(
                    "kernel `{}` uses {bytes} bytes of workgroup memory, the GPU's \
                     max_compute_workgroup_storage_size = {}",
                    k.name, limits.max_compute_workgroup_storage_size
                )));
            }
        }
        let built = scoped(
            gpu,
            || {
                let hint = if alternative {
                    " of a tensor-core alternative (`--coop off` or \
                     `MetalBackend::with_cooperative_matrix(false)` runs the portable kernels)"
                } else {
                    ""
                };
                format!("building kernel `{}`{hint}", k.name)
            },
            || {
                let mut entries: Vec<wgpu::BindGroupLayoutEntry> = k
                    .bindings
                    .iter()
                    .enumerate()
                    .map(|(i, access)| wgpu::BindGroupLayoutEntry {
                        binding: i as u32,
                        visibility: wgpu::ShaderStages::COMPUTE,
                        ty: wgpu::BindingType::Buffer {
                            ty: wgpu::BufferBindingType::Storage {
                                read_only: *access == Access::Read,
                            },
                            has_dynamic_offset: false,
                            min_binding_size: None,
                        },
                        count: None,
                    })
                    .collect();
                if k.sizes {
                    entries.push(wgpu::BindGroupLayoutEntry {
                        binding: k.bindings.len() as u32,
                        visibility: wgpu::ShaderStages::COMPUTE,
                        ty: wgpu::BindingType::Buffer {
                            ty: wgpu::BufferBindingType::Uniform,
                            has_dynamic_offset: false,
                            min_binding_size: NonZeroU64::new(SIZES_BYTES),
                        },
                        count: None,
                    });
                }
                let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                    label: Some(&k.name),
                    entries: &entries,
                });
                let module = gpu.kernel_module(&k.name, &k.wgsl);
                let pipeline_layout =
                    device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                        label: Some(&k.name),
                        bind_group_layouts: &[Some(&layout)],
                        immediate_size: 0,
                    });
                let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(&k.name),
                    layout: Some(&pipeline_layout),
                    module: &module,
                    entry_point: Some(&k.entry_point),
                    compilation_options: Default::default(),
                    cache: None,
                });
                (layout, pipeline)
            },
        )?;
        self.counters.pipelines.fetch_add(1, Ordering::Relaxed);
        self.built[i] = Some(built);
        Ok(())
    }

    fn get(&self, i: usize) -> &(wgpu::BindGroupLayout, wgpu::ComputePipeline) {
        self.built[i]
            .as_ref()
            .expect("a kernel is built before it is bound or run")
    }

    fn pipeline(&self, i: usize) -> &wgpu::ComputePipeline {
        &self.get(i).1
    }

    /// The pipelines of the kernels `launches` run (the rest dropped).
    fn keep(self, launches: &[Launch]) -> Vec<Option<wgpu::ComputePipeline>> {
        self.built
            .into_iter()
            .enumerate()
            .map(|(i, b)| {
                b.filter(|_| launches.iter().any(|s| s.dispatch.kernel == i))
                    .map(|(_, p)| p)
            })
            .collect()
    }
}

/// Bind groups of a delegate's dispatches over its buffers.
struct Binder<'a> {
    gpu: &'a GpuDevice,
    payload: &'a Payload,
    regions: &'a [Region],
    buffers: &'a [wgpu::Buffer],
    sizes: Option<&'a wgpu::Buffer>,
}

impl Binder<'_> {
    /// The bind group of `dispatch` (its kernel built), `what` naming it in errors.
    fn bind(&self, kernels: &Kernels, dispatch: &Dispatch, what: &str) -> Result<wgpu::BindGroup> {
        let (gpu, limits) = (self.gpu, &self.gpu.limits);
        let kernel = &self.payload.kernels[dispatch.kernel];
        let label = format!("{what} (kernel `{}`)", kernel.name);
        for &id in &dispatch.buffers {
            let size = self.regions[id].size;
            if size > limits.max_storage_buffer_binding_size {
                return Err(Error::limit(format!(
                    "{label} binds `{}` of {size} bytes, the GPU's \
                     max_storage_buffer_binding_size = {}",
                    self.payload.buffers[id].name, limits.max_storage_buffer_binding_size
                )));
            }
        }
        scoped(
            gpu,
            || format!("binding the buffers of {label}"),
            || {
                let mut entries: Vec<wgpu::BindGroupEntry> = dispatch
                    .buffers
                    .iter()
                    .enumerate()
                    .map(|(i, &id)| {
                        let r = self.regions[id];
                        wgpu::BindGroupEntry {
                            binding: i as u32,
                            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                                buffer: &self.buffers[r.buffer],
                                offset: r.offset,
                                size: NonZeroU64::new(r.size),
                            }),
                        }
                    })
                    .collect();
                if let (true, Some(u)) = (kernel.sizes, self.sizes) {
                    entries.push(wgpu::BindGroupEntry {
                        binding: dispatch.buffers.len() as u32,
                        resource: u.as_entire_binding(),
                    });
                }
                gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some(&label),
                    layout: &kernels.get(dispatch.kernel).0,
                    entries: &entries,
                })
            },
        )
    }
}

/// Bytes of a weight written per step at load. Each step's staging memory
/// is freed once the GPU has copied it, and the step's pages of the mapped
/// file are given back ([`NamedData::release`]), so that loading holds at
/// most about two steps in host memory beside what the device keeps (on a
/// GPU that shares host memory, as lavapipe does, the weights themselves).
const WEIGHT_STEP: usize = 8 << 20;

/// Write weight `data` (the named data, a multiple of 4 bytes) into `buffer`
/// step by step, waiting for each step's copy.
fn upload_weight(
    gpu: &GpuDevice,
    buffer: &wgpu::Buffer,
    data: &[u8],
    named_data: &dyn NamedData,
    timeout: Duration,
) -> Result<()> {
    for (i, step) in data.chunks(WEIGHT_STEP).enumerate() {
        let index = scoped(
            gpu,
            || format!("uploading bytes {}.. of the weight", i * WEIGHT_STEP),
            || {
                gpu.queue
                    .write_buffer(buffer, (i * WEIGHT_STEP) as u64, step);
                gpu.queue.submit([])
            },
        )?;
        gpu.device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(index),
                timeout: Some(timeout),
            })
            .map_err(|e| Error::internal(format!("waiting for the GPU to take a weight: {e}")))?;
        named_data.release(step);
    }
    Ok(())
}

struct Output {
    /// Its payload buffer.
    id: usize,
    region: Region,
    /// Offset into the staging buffer.
    staging_offset: u64,
}

pub(crate) struct GpuDelegate {
    gpu: Arc<GpuDevice>,
    counters: Arc<Counters>,
    timeout: Duration,
    payload: Payload,
    /// Weights (deduplicated by key) then arenas.
    buffers: Vec<wgpu::Buffer>,
    /// Per payload buffer.
    regions: Vec<Region>,
    /// What runs, in order (see [`plan`]), with a bind group per launch.
    launches: Vec<Launch>,
    /// Per payload kernel; built only for kernels a launch runs.
    pipelines: Vec<Option<wgpu::ComputePipeline>>,
    bind_groups: Vec<wgpu::BindGroup>,
    outputs: Vec<Output>,
    /// `(input region, new value region)` of each payload state, by input index.
    state: HashMap<usize, (Region, Region)>,
    /// Per payload check: its status region and offset in the staging buffer.
    statuses: Vec<(Region, u64)>,
    staging: wgpu::Buffer,
    /// Where the inputs' GPU bytes are written (MAP_WRITE, mapped between
    /// executes); `None` when every input is resident state.
    upload: Option<wgpu::Buffer>,
    /// Per input, its offset in `upload` (`None` for resident state, which
    /// is written, when its host copy is newer, through a queue write).
    upload_at: Vec<Option<u64>>,
    /// Whether `upload` is mapped (it is not after a failed execute).
    upload_mapped: bool,
    /// Made at the first profiled execute (on a device with timestamp queries).
    profiler: Option<Profiler>,
    /// Set when an execute timed out with the read-back still pending.
    stuck: bool,
    /// The sizes uniform of a dynamic payload (symbol values, written per
    /// execute) when a kernel reads it.
    sizes: Option<wgpu::Buffer>,
}

/// Write `view` (at its actual shape) into `dst` in the layout of `bound`.
fn upload_bound(
    view: &View,
    bound: &[usize],
    mut dst: wgpu::WriteOnly<'_, [u8]>,
    what: &str,
) -> Result<()> {
    let runs = bound::runs(view.shape, bound);
    if runs.len() <= 1 && runs.first().is_none_or(|r| r.1 == 0) {
        return transfer::upload(view, dst, what);
    }
    let g = bound::element_bytes(view.dtype)?;
    let mut packed = vec![0u8; payload::gpu_bytes(view.dtype, view.numel())? as usize];
    transfer::upload(view, wgpu::WriteOnly::from(&mut packed[..]), what)?;
    for (from, to, len) in runs {
        dst.slice(to * g..(to + len) * g)
            .copy_from_slice(&packed[from * g..(from + len) * g]);
    }
    Ok(())
}

/// Read `out` (at its actual shape) out of `src`, laid out as `bound`.
fn download_bound(src: &[u8], bound: &[usize], out: &mut ViewMut) -> Result<()> {
    let runs = bound::runs(out.shape, bound);
    if runs.len() <= 1 && runs.first().is_none_or(|r| r.1 == 0) {
        return transfer::download(src, out);
    }
    let g = bound::element_bytes(out.dtype)?;
    let mut packed = vec![0u8; payload::gpu_bytes(out.dtype, out.numel())? as usize];
    for (from, to, len) in runs {
        packed[from * g..(from + len) * g].copy_from_slice(&src[to * g..(to + len) * g]);
    }
    transfer::download(&packed, out)
}

/// Bytes of the sizes uniform (`array<vec4<u32>, 4>`, 16 symbols).
const SIZES_BYTES: u64 = 64;

/// Dispatches an execute records before its first submit.
const FIRST_SUBMIT: usize = 8;

/// How much larger each later command buffer is than the one before.
const SUBMIT_GROWTH: usize = 4;

/// The dispatch ranges an execute submits one command buffer each: a
/// first few, then each range [`SUBMIT_GROWTH`] times the one before. The
/// GPU starts on the first while the host records the rest: on an H100's
/// host a submit costs about 0.1 ms and each dispatch recorded about
/// 1.5 µs (0.3–0.8 ms for a decode step, a Whisper or a ViT encoder, which
/// the GPU waited for when one command buffer held them all), and the GPU
/// takes longer than that over each range, so it rarely waits for the
/// next one. A program of at most [`FIRST_SUBMIT`] dispatches submits
/// once; no dispatches still make one (empty) range, for the copies
/// around them.
fn submit_chunks(dispatches: usize) -> Vec<std::ops::Range<usize>> {
    let mut chunks = vec![];
    let (mut start, mut size) = (0, FIRST_SUBMIT);
    loop {
        let end = (start + size).min(dispatches);
        chunks.push(start..end);
        if end == dispatches {
            return chunks;
        }
        (start, size) = (end, size * SUBMIT_GROWTH);
    }
}

/// The delegate's GPU buffers and where each payload buffer lives in them:
/// arenas first (arena `a` is buffer `a`), each weight once per key
/// (uploaded from `named_data`), then a buffer of its own for each
/// resident state.
fn place_buffers(
    gpu: &GpuDevice,
    counters: &Counters,
    payload: &Payload,
    named_data: &dyn NamedData,
    timeout: Duration,
) -> Result<(Vec<wgpu::Buffer>, Vec<Region>)> {
    let device = &gpu.device;
    let limits = &gpu.limits;
    let mut buffers = Vec::new();
    // Weight key -> (buffer, bytes), so a weight is uploaded once.
    let mut by_key: HashMap<&str, (usize, u64)> = HashMap::new();
    let mut regions = Vec::with_capacity(payload.buffers.len());
    let new_buffer = |buffers: &mut Vec<wgpu::Buffer>, b: wgpu::Buffer| {
        counters.buffers.fetch_add(1, Ordering::Relaxed);
        buffers.push(b);
        buffers.len() - 1
    };
    // Arenas first, so arena `a` is buffer `a`.
    for (a, &size) in payload.arenas.iter().enumerate() {
        if size > limits.max_buffer_size {
            return Err(Error::limit(format!(
                "arena {a} of {size} bytes exceeds the GPU's max_buffer_size = {}",
                limits.max_buffer_size
            )));
        }
        let buffer = scoped(
            gpu,
            || format!("allocating arena {a} ({size} bytes)"),
            || {
                device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some(&format!("arena {a}")),
                    size: size.max(4).next_multiple_of(4),
                    usage: wgpu::BufferUsages::STORAGE
                        | wgpu::BufferUsages::COPY_DST
                        | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: false,
                })
            },
        )?;
        new_buffer(&mut buffers, buffer);
    }
    for b in &payload.buffers {
        let size = payload::gpu_bytes(b.dtype, b.shape.iter().product())?;
        let region = match &b.location {
            Location::Arena { arena, offset } => Region {
                buffer: *arena,
                offset: *offset,
                size,
            },
            Location::Weight { key } => {
                let buffer = match by_key.get(key.as_str()) {
                    Some(&(i, bytes)) if bytes == size => i,
                    Some(&(_, bytes)) => {
                        return Err(Error::format(format!(
                            "weight `{}` takes {size} bytes of named data `{key}`, \
                             another buffer of that key {bytes}",
                            b.name
                        )))
                    }
                    None => {
                        let what = || format!("weight `{}` (named data `{key}`)", b.name);
                        let data = named_data.get(key).map_err(|e| e.context(what()))?;
                        if data.len() as u64 != size {
                            return Err(Error::format(format!(
                                "{}: {} bytes, but a {} tensor of shape {:?} takes {size} \
                                 bytes on the GPU",
                                what(),
                                data.len(),
                                b.dtype.name(),
                                b.shape
                            )));
                        }
                        if size > limits.max_buffer_size {
                            return Err(Error::limit(format!(
                                "{}: {size} bytes exceed the GPU's max_buffer_size = {}",
                                what(),
                                limits.max_buffer_size
                            )));
                        }
                        let buffer = scoped(gpu, what, || {
                            device.create_buffer(&wgpu::BufferDescriptor {
                                label: Some(key),
                                size,
                                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                                mapped_at_creation: false,
                            })
                        })?;
                        upload_weight(gpu, &buffer, data, named_data, timeout)
                            .map_err(|e| e.context(what()))?;
                        let i = new_buffer(&mut buffers, buffer);
                        by_key.insert(key, (i, size));
                        i
                    }
                };
                Region {
                    buffer,
                    offset: 0,
                    size,
                }
            }
        };
        regions.push(region);
    }

    // Each resident state gets a GPU buffer of its own (a copy within one
    // buffer is not allowed), which its input binds instead of the arena.
    for st in &payload.state {
        let id = payload.inputs[st.input];
        let size = regions[id].size;
        let buffer = scoped(
            gpu,
            || format!("allocating state `{}` ({size} bytes)", st.fqn),
            || {
                device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some(&st.fqn),
                    size,
                    usage: wgpu::BufferUsages::STORAGE
                        | wgpu::BufferUsages::COPY_DST
                        | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: false,
                })
            },
        )?;
        regions[id] = Region {
            buffer: new_buffer(&mut buffers, buffer),
            offset: 0,
            size,
        };
    }

    // Inputs are written with `write_buffer`, which weights do not allow.
    if let Some((k, &id)) = payload
        .inputs
        .iter()
        .enumerate()
        .find(|(_, &id)| !matches!(payload.buffers[id].location, Location::Arena { .. }))
    {
        return Err(Error::format(format!(
            "EtMetalBackend payload: input {k} (`{}`) is not an arena buffer",
            payload.buffers[id].name
        )));
    }
    Ok((buffers, regions))
}

/// The uniform of run-time sizes, where a kernel reads them.
fn sizes_uniform(gpu: &GpuDevice, payload: &Payload) -> Result<Option<wgpu::Buffer>> {
    let device = &gpu.device;
    payload
        .kernels
        .iter()
        .any(|k| k.sizes)
        .then(|| {
            scoped(
                gpu,
                || "allocating the sizes uniform".to_string(),
                || {
                    device.create_buffer(&wgpu::BufferDescriptor {
                        label: Some("sizes"),
                        size: SIZES_BYTES,
                        usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                        mapped_at_creation: false,
                    })
                },
            )
        })
        .transpose()
}

/// Which form each dispatch runs (`None`: the portable kernel), as
/// `selection` asks: measured forms are built and timed here through
/// `kernels` and `binder`, the choice cached per adapter and payload.
fn choose_forms(
    gpu: &GpuDevice,
    (payload, payload_hash): (&Payload, u64),
    selection: Selection,
    timeout: Duration,
    kernels: &mut Kernels,
    binder: &Binder,
) -> Result<Vec<Choice>> {
    let offer = gpu
        .coop
        .as_ref()
        .filter(|_| selection != Selection::Portable);
    // (a forced alternative runs whatever its form: tests reach each)
    let untested = !matches!(selection, Selection::Measured { untested: false });
    let eligible = select::eligible(
        payload,
        offer,
        gpu.limits.max_storage_buffers_per_shader_stage,
        untested,
    );
    Ok(match selection {
        Selection::Portable => vec![None; payload.dispatches.len()],
        Selection::Forced(k) => eligible
            .iter()
            .map(|e| e.contains(&k).then_some(k))
            .collect(),
        Selection::Measured { .. } if eligible.iter().all(Vec::is_empty) => {
            vec![None; payload.dispatches.len()]
        }
        Selection::Measured { .. } => {
            let mut cache = TuningCache::open(&gpu.adapter.get_info(), payload_hash);
            // (kernels reading the run-time sizes run at their bounds)
            if let Some(u) = binder.sizes {
                let words: Vec<u8> = payload
                    .symbols
                    .iter()
                    .flat_map(|s| (s.max as u32).to_le_bytes())
                    .collect();
                if !words.is_empty() {
                    gpu.queue.write_buffer(u, 0, &words);
                }
            }
            let choices = trace::span(
                || "gpu: measure the kernels' forms".into(),
                None,
                || {
                    select::measured(payload, &eligible, &mut cache, |d, alts| {
                        time_forms_of(gpu, (payload, d, alts), kernels, binder, timeout)
                    })
                },
            )?;
            cache.save();
            choices
        }
    })
}

/// The GPU milliseconds of dispatch `d` of `payload` in each of its forms:
/// its portable kernel, then alternatives `alts`. An alternative the driver
/// will not build or bind is left out, its time infinite (named in the
/// trace): it is a speed-up, never a reason for a load to fail; the
/// portable form's errors are the load's.
fn time_forms_of(
    gpu: &GpuDevice,
    (payload, d, alts): (&Payload, usize, &[usize]),
    kernels: &mut Kernels,
    binder: &Binder,
    timeout: Duration,
) -> Result<Vec<f64>> {
    let main = &payload.dispatches[d];
    let mut forms: Vec<Vec<&Dispatch>> = vec![vec![main]];
    forms.extend(
        alts.iter()
            .map(|&a| main.alternatives[a].dispatches.iter().collect::<Vec<_>>()),
    );
    let mut groups: Vec<Option<Vec<wgpu::BindGroup>>> = vec![];
    for (f, form) in forms.iter().enumerate() {
        let ready = form
            .iter()
            .map(|x| {
                kernels.build(x.kernel, f > 0)?;
                binder.bind(kernels, x, "timing")
            })
            .collect::<Result<Vec<_>>>();
        groups.push(match (ready, f) {
            (Ok(g), _) => Some(g),
            (Err(e), 0) => return Err(e),
            (Err(e), _) => {
                let left_out = || format!("gpu: form {f} of dispatch {d} left out: {e}");
                trace::span(left_out, None, || ());
                None
            }
        });
    }
    let timed: Vec<select::Form> = forms
        .iter()
        .zip(&groups)
        .filter_map(|(form, groups)| {
            let groups = groups.as_ref()?;
            Some(
                form.iter()
                    .zip(groups)
                    .map(|(x, g)| (kernels.pipeline(x.kernel), g, x.workgroups))
                    .collect(),
            )
        })
        .collect();
    let mut times = scoped(
        gpu,
        || format!("timing the forms of dispatch {d}"),
        || select::time_forms(&gpu.device, &gpu.queue, &timed, timeout),
    )??
    .into_iter();
    Ok(groups
        .iter()
        .map(|g| match g {
            Some(_) => times.next().unwrap_or(f64::INFINITY),
            None => f64::INFINITY,
        })
        .collect())
}

/// The host side of an execute: each input's place in the mapped upload
/// buffer (`None` for resident state), each output's and status check's in
/// the read-back buffer, and the two buffers.
struct HostBuffers {
    state: HashMap<usize, (Region, Region)>,
    upload: Option<wgpu::Buffer>,
    upload_at: Vec<Option<u64>>,
    outputs: Vec<Output>,
    statuses: Vec<(Region, u64)>,
    staging: wgpu::Buffer,
}

fn host_buffers(
    gpu: &GpuDevice,
    counters: &Counters,
    payload: &Payload,
    regions: &[Region],
) -> Result<HostBuffers> {
    let device = &gpu.device;
    let state: HashMap<usize, (Region, Region)> = payload
        .state
        .iter()
        .map(|st| {
            let input = regions[payload.inputs[st.input]];
            (st.input, (input, regions[st.new_value]))
        })
        .collect();
    let mut upload_size = 0;
    let upload_at: Vec<Option<u64>> = payload
        .inputs
        .iter()
        .enumerate()
        .map(|(k, &id)| {
            let at = upload_size;
            (!state.contains_key(&k)).then(|| {
                upload_size += regions[id].size;
                at
            })
        })
        .collect();
    let upload = (upload_size > 0)
        .then(|| {
            scoped(
                gpu,
                || format!("allocating the {upload_size}-byte input buffer"),
                || {
                    device.create_buffer(&wgpu::BufferDescriptor {
                        label: Some("inputs"),
                        size: upload_size,
                        usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
                        mapped_at_creation: true,
                    })
                },
            )
        })
        .transpose()?;
    counters
        .buffers
        .fetch_add(u64::from(upload.is_some()), Ordering::Relaxed);
    let mut staging_size = 0;
    let outputs: Vec<Output> = payload
        .outputs
        .iter()
        .map(|&id| {
            let region = regions[id];
            let out = Output {
                id,
                region,
                staging_offset: staging_size,
            };
            staging_size += region.size;
            out
        })
        .collect();
    let mut statuses = Vec::with_capacity(payload.checks.len());
    for check in &payload.checks {
        let region = regions[check.buffer];
        statuses.push((region, staging_size));
        staging_size += region.size;
    }
    let staging = scoped(
        gpu,
        || format!("allocating the {staging_size}-byte read-back buffer"),
        || {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("outputs"),
                size: staging_size.max(4),
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        },
    )?;
    counters.buffers.fetch_add(1, Ordering::Relaxed);
    Ok(HostBuffers {
        state,
        upload,
        upload_at,
        outputs,
        statuses,
        staging,
    })
}

impl GpuDelegate {
    pub(crate) fn load(
        gpu: Arc<GpuDevice>,
        counters: Arc<Counters>,
        timeout: Duration,
        (payload, payload_hash): (Payload, u64),
        named_data: &dyn NamedData,
        selection: Selection,
    ) -> Result<GpuDelegate> {
        let (buffers, regions) = place_buffers(&gpu, &counters, &payload, named_data, timeout)?;
        let sizes = sizes_uniform(&gpu, &payload)?;
        let mut kernels = Kernels::new(&gpu, &payload, &counters);
        let binder = Binder {
            gpu: &gpu,
            payload: &payload,
            regions: &regions,
            buffers: &buffers,
            sizes: sizes.as_ref(),
        };
        let choices = choose_forms(
            &gpu,
            (&payload, payload_hash),
            selection,
            timeout,
            &mut kernels,
            &binder,
        )?;
        let launches = select::launches(&payload, &choices);
        // each payload dispatch is one portable launch or its alternative's
        let portable = launches.iter().filter(|s| s.variant.is_none()).count();
        let chosen = (payload.dispatches.len() - portable) as u64;
        counters.alternatives.fetch_add(chosen, Ordering::Relaxed);
        for s in &launches {
            kernels.build(s.dispatch.kernel, s.variant.is_some())?;
        }
        let mut bind_groups = Vec::with_capacity(launches.len());
        for (d, launch) in launches.iter().enumerate() {
            bind_groups.push(binder.bind(&kernels, &launch.dispatch, &format!("dispatch {d}"))?);
        }
        // (kernels only measured are dropped)
        let pipelines = kernels.keep(&launches);

        let HostBuffers {
            state,
            upload,
            upload_at,
            outputs,
            statuses,
            staging,
        } = host_buffers(&gpu, &counters, &payload, &regions)?;
        if let Some(e) = gpu.take_uncaptured() {
            return Err(Error::internal(format!("GPU error while loading: {e}")));
        }
        Ok(GpuDelegate {
            gpu,
            counters,
            timeout,
            payload,
            buffers,
            regions,
            launches,
            pipelines,
            bind_groups,
            outputs,
            state,
            statuses,
            staging,
            upload,
            upload_at,
            upload_mapped: true,
            profiler: None,
            stuck: false,
            sizes,
        })
    }

    /// The symbol values of this execute (none for a static payload), from
    /// the input tensors' shapes, each checked against its range.
    fn symbol_values(&self, args: &[DelegateArg]) -> Result<Vec<i64>> {
        if self.payload.symbols.is_empty() {
            return Ok(vec![]);
        }
        let shapes: Vec<Option<&[usize]>> = args
            .iter()
            .take(self.payload.inputs.len())
            .map(|a| match a {
                DelegateArg::Tensor(t) => Some(t.shape),
                _ => None,
            })
            .collect();
        self.payload.symbol_values(&shapes)
    }

    /// Check the call's arguments against the payload (every one a tensor
    /// of the dtype and shape of its buffer at the symbol values `values`,
    /// or `Resident` for state) and return the inputs to write (`None` for
    /// resident state kept current).
    fn gpu_inputs<'a, 'b>(
        &self,
        args: &'a [DelegateArg<'b>],
        values: &[i64],
    ) -> Result<Vec<Option<&'a View<'b>>>> {
        let (ni, no) = (self.payload.inputs.len(), self.payload.outputs.len());
        if args.len() != ni + no {
            return Err(Error::invalid_input(format!(
                "EtMetalBackend delegate takes {ni} inputs and {no} outputs, got {} arguments",
                args.len()
            )));
        }
        let ids = self.payload.inputs.iter().chain(&self.payload.outputs);
        let mut inputs = Vec::with_capacity(ni);
        for (k, (arg, &id)) in args.iter().zip(ids).enumerate() {
            let (what, index) = if k < ni {
                ("input", k)
            } else {
                ("output", k - ni)
            };
            let b = &self.payload.buffers[id];
            if k < ni && self.state.contains_key(&k) && matches!(arg, DelegateArg::Resident) {
                inputs.push(None);
                continue;
            }
            let (dtype, shape) = match arg {
                DelegateArg::Tensor(t) if k < ni => {
                    inputs.push(Some(t));
                    (t.dtype, t.shape)
                }
                DelegateArg::Output(t) if k >= ni => (t.dtype, t.shape),
                _ => {
                    let want = if k < ni { "a tensor" } else { "an output" };
                    return Err(Error::invalid_input(format!(
                        "delegate {what} {index} (`{}`): expected {want}, got {arg:?}",
                        b.name
                    )));
                }
            };
            let want = self.payload.actual_shape(id, values)?;
            if dtype != b.dtype || shape != want.as_slice() {
                return Err(Error::invalid_input(format!(
                    "delegate {what} {index} (`{}`): expected {} {:?}, got {} {:?}",
                    b.name,
                    b.dtype.name(),
                    want,
                    dtype.name(),
                    shape
                )));
            }
        }
        Ok(inputs)
    }

    /// Convert the inputs given (`None`: resident state kept current)
    /// straight into GPU memory: the mapped input buffer (unmapped here, for
    /// the execute's command buffer to copy), or, for state, a queue write.
    fn write_inputs(&mut self, inputs: &[Option<&View>]) -> Result<()> {
        let gpu = self.gpu.clone();
        if let (Some(upload), false) = (&self.upload, self.upload_mapped) {
            // a failed execute left it unmapped
            let index = gpu.queue.submit([]);
            Self::wait_mapped(
                &gpu,
                self.timeout,
                &mut self.stuck,
                index,
                &[(upload, wgpu::MapMode::Write)],
            )?;
            self.upload_mapped = true;
        }
        let mut mapped = match &self.upload {
            Some(b) => Some(
                b.get_mapped_range_mut(..)
                    .map_err(|e| Error::internal(format!("writing the inputs: {e}")))?,
            ),
            None => None,
        };
        for (k, (input, &id)) in inputs.iter().zip(&self.payload.inputs).enumerate() {
            let Some(view) = input else { continue };
            let r = self.regions[id];
            let what = format!("delegate input {k} (`{}`)", self.payload.buffers[id].name);
            let bound = self.payload.buffers[id].shape.clone();
            match (self.upload_at[k], mapped.as_mut()) {
                (Some(at), Some(m)) => {
                    let (at, size) = (at as usize, r.size as usize);
                    upload_bound(view, &bound, m.slice(at..at + size), &what)?;
                }
                _ => {
                    let size = wgpu::BufferSize::new(r.size)
                        .ok_or_else(|| Error::internal(format!("{what}: an empty GPU region")))?;
                    let mut staged = scoped(
                        &gpu,
                        || format!("writing {what}"),
                        || {
                            gpu.queue
                                .write_buffer_with(&self.buffers[r.buffer], r.offset, size)
                        },
                    )?
                    .ok_or_else(|| Error::internal(format!("{what}: the GPU refused the write")))?;
                    upload_bound(view, &bound, staged.slice(..), &what)?;
                }
            }
            self.counters.uploaded.fetch_add(r.size, Ordering::Relaxed);
        }
        drop(mapped);
        if let Some(upload) = &self.upload {
            upload.unmap();
            self.upload_mapped = false;
        }
        Ok(())
    }

    /// The commands that open an execute's first command buffer: the
    /// inputs' copies from the upload buffer into the arena (`copies`: each
    /// offset in the upload buffer and its region), and the status words
    /// zeroed.
    fn start_commands(&self, encoder: &mut wgpu::CommandEncoder, copies: &[(u64, Region)]) {
        if let Some(upload) = &self.upload {
            for (at, r) in copies {
                encoder.copy_buffer_to_buffer(
                    upload,
                    *at,
                    &self.buffers[r.buffer],
                    r.offset,
                    r.size,
                );
            }
        }
        for (r, _) in &self.statuses {
            encoder.clear_buffer(&self.buffers[r.buffer], r.offset, Some(r.size));
        }
    }

    /// Record launches `range` (`counts`: each launch's workgroups at this
    /// execute's sizes; none where zero) in one compute pass, or where
    /// `profiler` times them, each in its own: pass-boundary timestamps
    /// need only TIMESTAMP_QUERY (Apple GPUs have no timestamps inside
    /// passes).
    fn record(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        range: std::ops::Range<usize>,
        counts: &[[u32; 3]],
        profiler: Option<&Profiler>,
    ) {
        let dispatch = |pass: &mut wgpu::ComputePass, d: usize| {
            let [x, y, z] = counts[d];
            if x == 0 {
                return;
            }
            let pipeline = self.pipelines[self.launches[d].dispatch.kernel]
                .as_ref()
                .expect("a pipeline for every kernel a launch runs");
            pass.set_pipeline(pipeline);
            pass.set_bind_group(0, &self.bind_groups[d], &[]);
            pass.dispatch_workgroups(x, y, z);
        };
        match profiler {
            None => {
                let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("etmetal delegate"),
                    timestamp_writes: None,
                });
                range.for_each(|d| dispatch(&mut pass, d));
            }
            Some(p) => {
                for d in range {
                    let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: Some("etmetal delegate (profiled)"),
                        timestamp_writes: Some(p.writes(d)),
                    });
                    dispatch(&mut pass, d);
                }
            }
        }
    }

    /// The commands that end an execute's last command buffer: the new
    /// state becomes the next execute's input, on the GPU (nothing to copy
    /// where the kernels wrote the input in place), and the outputs
    /// (`reads`: each region and its offset in the read-back buffer) and
    /// status words go into the read-back buffer.
    fn finish_commands(&self, encoder: &mut wgpu::CommandEncoder, reads: &[(Region, u64)]) {
        for (input, new) in self.state.values().filter(|(i, n)| i.buffer != n.buffer) {
            encoder.copy_buffer_to_buffer(
                &self.buffers[new.buffer],
                new.offset,
                &self.buffers[input.buffer],
                input.offset,
                input.size,
            );
        }
        let reads = reads.iter().map(|(r, at)| (r, *at));
        for (r, at) in reads.chain(self.statuses.iter().map(|(r, at)| (r, *at))) {
            encoder.copy_buffer_to_buffer(
                &self.buffers[r.buffer],
                r.offset,
                &self.staging,
                at,
                r.size,
            );
        }
    }

    fn execute(&mut self, args: &mut [DelegateArg]) -> Result<()> {
        if self.stuck {
            return Err(Error::internal(
                "a previous execute of this delegate timed out on the GPU; load the program again",
            ));
        }
        let values = self.symbol_values(args)?;
        let inputs = self.gpu_inputs(args, &values)?;
        let given: u64 = inputs.iter().flatten().map(|v| v.bytes.len() as u64).sum();
        trace::span(
            || "gpu: inputs converted into the upload buffer".into(),
            Some(given),
            || self.write_inputs(&inputs),
        )?;
        if let Some(u) = &self.sizes {
            let mut words = [0u32; SIZES_BYTES as usize / 4];
            for (w, &v) in words.iter_mut().zip(&values) {
                *w = v as u32;
            }
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            self.gpu.queue.write_buffer(u, 0, &bytes);
        }
        // each launch's workgroup counts at this execute's sizes
        let counts = self
            .launches
            .iter()
            .map(|l| match &l.dispatch.groups {
                None => Ok(l.dispatch.workgroups),
                Some(g) => {
                    let [x, y, z] = l.dispatch.workgroups;
                    let n = u64::try_from(g.eval(&values)?).unwrap_or(0);
                    if n > u64::from(x) * u64::from(y) * u64::from(z) {
                        return Err(Error::internal(format!(
                            "dispatch of kernel `{}`: {n} workgroups at these sizes, more than \
                             its {x}x{y}x{z} at the bound",
                            self.payload.kernels[l.dispatch.kernel].name
                        )));
                    }
                    let max = self.gpu.limits.max_compute_workgroups_per_dimension;
                    Ok(match n {
                        0 => [0, 0, 0],
                        n => payload::grid(n, max)?,
                    })
                }
            })
            .collect::<Result<Vec<[u32; 3]>>>()?;
        // what the command buffer copies from the input buffer into the arena
        // (of a dynamic tensor, only the bytes up to its last valid element)
        let valid = |id: usize, dtype, shape: &[usize], r: Region| -> Result<Region> {
            let bound = &self.payload.buffers[id].shape;
            let size = bound::valid_bytes(dtype, shape, bound, r.size)?;
            Ok(Region { size, ..r })
        };
        let copies: Vec<(u64, Region)> = inputs
            .iter()
            .zip(&self.payload.inputs)
            .zip(&self.upload_at)
            .filter_map(|((given, &id), at)| {
                let (view, at) = (given.as_ref()?, (*at)?);
                Some(valid(id, view.dtype, view.shape, self.regions[id]).map(|r| (at, r)))
            })
            .collect::<Result<_>>()?;
        let reads: Vec<(Region, u64)> = self
            .outputs
            .iter()
            .map(|o| {
                let shape = self.payload.actual_shape(o.id, &values)?;
                let dtype = self.payload.buffers[o.id].dtype;
                Ok((valid(o.id, dtype, &shape, o.region)?, o.staging_offset))
            })
            .collect::<Result<_>>()?;
        drop(inputs);
        let gpu = self.gpu.clone();
        let profile = self.counters.profiling.load(Ordering::Relaxed)
            && gpu
                .device
                .features()
                .contains(wgpu::Features::TIMESTAMP_QUERY);
        if profile && self.profiler.is_none() {
            let n = self.launches.len();
            self.profiler = Some(scoped(
                &gpu,
                || format!("creating timestamp queries for {n} dispatches"),
                || Profiler::new(&gpu, n),
            )?);
        }
        let profiler = self.profiler.as_ref().filter(|_| profile);
        let chunks = submit_chunks(self.launches.len());
        let index = trace::span(
            || format!("gpu: record and submit {} dispatches", self.launches.len()),
            None,
            || {
                scoped(
                    &gpu,
                    || {
                        let kernels: Vec<&str> = self
                            .launches
                            .iter()
                            .map(|s| self.payload.kernels[s.dispatch.kernel].name.as_str())
                            .collect();
                        format!("running kernels [{}]", kernels.join(", "))
                    },
                    || {
                        let last = chunks.len() - 1;
                        let mut index = None;
                        for (c, range) in chunks.iter().enumerate() {
                            let mut encoder = gpu.device.create_command_encoder(
                                &wgpu::CommandEncoderDescriptor {
                                    label: Some("etmetal delegate"),
                                },
                            );
                            if c == 0 {
                                self.start_commands(&mut encoder, &copies);
                            }
                            self.record(&mut encoder, range.clone(), &counts, profiler);
                            if c == last {
                                if let Some(p) = profiler {
                                    p.resolve(&mut encoder);
                                }
                                self.finish_commands(&mut encoder, &reads);
                            }
                            index = Some(trace::span(
                                || format!("gpu: submit dispatches {}..{}", range.start, range.end),
                                None,
                                || gpu.queue.submit([encoder.finish()]),
                            ));
                        }
                        index.expect("at least one chunk")
                    },
                )
            },
        )?;
        self.counters
            .submits
            .fetch_add(chunks.len() as u64, Ordering::Relaxed);
        let staged = self.outputs.iter().map(|o| o.region.size).sum::<u64>();
        self.counters.read_back.fetch_add(staged, Ordering::Relaxed);
        let read = wgpu::MapMode::Read;
        let mut mapped = vec![(&self.staging, read)];
        mapped.extend(profiler.map(|p| (&p.readback, read)));
        // the input buffer is mapped again for the next execute
        mapped.extend(self.upload.iter().map(|b| (b, wgpu::MapMode::Write)));
        trace::span(
            || "gpu: wait for the GPU and map the read-back".into(),
            None,
            || Self::wait_mapped(&gpu, self.timeout, &mut self.stuck, index, &mapped),
        )?;
        self.upload_mapped = self.upload.is_some();
        if let Some(p) = profiler {
            let times = p
                .seconds()?
                .into_iter()
                .zip(&self.launches)
                .map(|(seconds, launch)| {
                    let k = &self.payload.kernels[launch.dispatch.kernel];
                    DispatchTime {
                        kernel: k.name.clone(),
                        ops: k.ops.clone(),
                        variant: launch
                            .variant
                            .map(|(i, n)| format!("{} (alternative {i})", n.describe())),
                        seconds,
                    }
                });
            self.counters
                .times
                .lock()
                .map_err(|_| Error::internal("the GPU timing lock is poisoned"))?
                .extend(times);
        }
        let result = trace::span(
            || "gpu: outputs converted out of the read-back".into(),
            Some(staged),
            || {
                let view = self
                    .staging
                    .get_mapped_range(..)
                    .map_err(|e| Error::internal(format!("reading the outputs back: {e}")))?;
                let ni = self.payload.inputs.len();
                // (no `?` here: the staging buffer must be unmapped on every path)
                self.check_statuses(&view).and_then(|()| {
                    self.outputs
                        .iter()
                        .zip(&mut args[ni..])
                        .try_for_each(|(o, arg)| {
                            let start = o.staging_offset as usize;
                            let bytes = &view[start..start + o.region.size as usize];
                            let bound = &self.payload.buffers[o.id].shape;
                            match arg {
                                DelegateArg::Output(out) => download_bound(bytes, bound, out),
                                _ => Err(Error::internal("delegate output argument changed")),
                            }
                        })
                })
            },
        );
        self.staging.unmap();
        result
    }

    /// Map `buffers` (each for reading or writing) once submission `index`
    /// is done, waiting at most `timeout`; `stuck` is set when the GPU did
    /// not finish (the delegate then refuses later executes).
    fn wait_mapped(
        gpu: &GpuDevice,
        timeout: Duration,
        stuck: &mut bool,
        index: wgpu::SubmissionIndex,
        buffers: &[(&wgpu::Buffer, wgpu::MapMode)],
    ) -> Result<()> {
        let (tx, rx) = mpsc::channel();
        for (b, mode) in buffers {
            let tx = tx.clone();
            b.map_async(*mode, .., move |r| drop(tx.send(r)));
        }
        let polled = gpu.device.poll(wgpu::PollType::Wait {
            submission_index: Some(index),
            timeout: Some(timeout),
        });
        if let Some(e) = gpu.take_uncaptured() {
            *stuck = true;
            return Err(Error::internal(format!("GPU error while running: {e}")));
        }
        match polled {
            Ok(_) => {}
            Err(wgpu::PollError::Timeout) => {
                *stuck = true;
                return Err(Error::limit(format!(
                    "the GPU did not finish the delegate's work within {timeout:?}"
                )));
            }
            Err(e) => return Err(Error::internal(format!("waiting for the GPU: {e}"))),
        }
        // The map callbacks run in the poll that saw the work finish, which
        // may be another thread's poll of the shared device (taken before
        // this thread's poll returned, run after), so wait for them.
        for _ in buffers {
            match rx.recv_timeout(timeout) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    return Err(Error::internal(format!("reading the outputs back: {e}")));
                }
                Err(_) => {
                    *stuck = true;
                    return Err(Error::internal(
                        "the GPU finished but the outputs were not mapped",
                    ));
                }
            }
        }
        Ok(())
    }

    /// Read resident state input `input` back from the arena.
    fn read_state(&mut self, input: usize) -> Result<etmetal_core::Tensor> {
        if self.stuck {
            return Err(Error::internal(
                "a previous execute of this delegate timed out on the GPU; load the program again",
            ));
        }
        let Some(&(region, _)) = self.state.get(&input) else {
            return Err(Error::invalid_input(format!(
                "EtMetalBackend delegate input {input} is not resident state"
            )));
        };
        let gpu = self.gpu.clone();
        let (readback, index) = scoped(
            &gpu,
            || format!("reading state input {input} back"),
            || {
                let readback = gpu.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("state read-back"),
                    size: region.size,
                    usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                let mut encoder =
                    gpu.device
                        .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                            label: Some("etmetal state read-back"),
                        });
                encoder.copy_buffer_to_buffer(
                    &self.buffers[region.buffer],
                    region.offset,
                    &readback,
                    0,
                    region.size,
                );
                let index = gpu.queue.submit([encoder.finish()]);
                (readback, index)
            },
        )?;
        self.counters.submits.fetch_add(1, Ordering::Relaxed);
        self.counters
            .read_back
            .fetch_add(region.size, Ordering::Relaxed);
        Self::wait_mapped(
            &gpu,
            self.timeout,
            &mut self.stuck,
            index,
            &[(&readback, wgpu::MapMode::Read)],
        )?;
        let b = &self.payload.buffers[self.payload.inputs[input]];
        let view = readback
            .get_mapped_range(..)
            .map_err(|e| Error::internal(format!("reading state back: {e}")))?;
        let mut t = etmetal_core::Tensor::zeros(b.dtype, &b.shape)?;
        transfer::download(&view, &mut ViewMut::of(&mut t))?;
        Ok(t)
    }
}

impl GpuDelegate {
    /// The first failed run-time check (in dispatch order) of the mapped
    /// staging buffer `view`, as the execute's error.
    fn check_statuses(&self, view: &[u8]) -> Result<()> {
        for (check, (r, at)) in self.payload.checks.iter().zip(&self.statuses) {
            let words = &view[*at as usize..(*at + r.size) as usize];
            let failed = check.sites.iter().enumerate().find(|(i, _)| {
                let w = i / 32 * 4;
                let word = u32::from_le_bytes(words[w..w + 4].try_into().expect("4 bytes"));
                word & (1 << (i % 32)) != 0
            });
            let Some((_, site)) = failed else { continue };
            let kernel = &self.payload.kernels[self.payload.dispatches[check.dispatch].kernel].name;
            return Err(match site.fault {
                Fault::Overflow => Error::limit(format!(
                    "int64 arithmetic in kernel {kernel} (node `{}`) overflowed the GPU's \
                     32-bit integers; compile with --skip-op {} or --backend cpu",
                    site.node, site.op
                )),
                Fault::ZeroDivision => Error::invalid_input(format!(
                    "integer division by zero in kernel {kernel} (node `{}`)",
                    site.node
                )),
            });
        }
        Ok(())
    }
}

impl DelegateHandle for GpuDelegate {
    fn execute(&mut self, args: &mut [DelegateArg]) -> Result<()> {
        GpuDelegate::execute(self, args)
    }

    fn output_count(&self) -> usize {
        self.payload.outputs.len()
    }

    fn output_shapes(&self, inputs: &[Option<&[usize]>]) -> Option<Result<Vec<Vec<usize>>>> {
        if self.payload.symbols.is_empty() {
            return None;
        }
        Some(self.payload.symbol_values(inputs).and_then(|values| {
            self.payload
                .outputs
                .iter()
                .map(|&id| self.payload.actual_shape(id, &values))
                .collect()
        }))
    }

    fn resident_args(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.state.keys().copied().collect();
        v.sort_unstable();
        v
    }

    fn read_state(&mut self, position: usize) -> Result<etmetal_core::Tensor> {
        GpuDelegate::read_state(self, position)
    }
}

#[cfg(test)]
mod tests {
    use etmetal_metal::payload::{Alternative, CoopType, Needs, Requirements};

    use super::*;
    use crate::device::CoopOffer;

    const fn needs(subgroup_size: u32, workgroup_storage: u32) -> Needs {
        Needs::f16_16x16x16(subgroup_size, workgroup_storage)
    }

    #[test]
    fn submits_cover_every_dispatch_once_growing() {
        assert_eq!(submit_chunks(0), vec![0..0]);
        assert_eq!(submit_chunks(5), vec![0..5]);
        assert_eq!(submit_chunks(8), vec![0..8]);
        assert_eq!(submit_chunks(9), [0..8, 8..9]);
        // a Llama-1B decode step's 115 dispatches: three command buffers
        assert_eq!(submit_chunks(115), [0..8, 8..40, 40..115]);
        for n in 0..2000 {
            let chunks = submit_chunks(n);
            let mut at = 0;
            for c in &chunks {
                assert_eq!(c.start, at);
                assert!(c.end > c.start || n == 0);
                at = c.end;
            }
            assert_eq!(at, n);
        }
    }

    fn dispatch(kernel: usize, buffers: usize) -> Dispatch {
        Dispatch {
            kernel,
            nodes: vec![],
            buffers: (0..buffers).collect(),
            workgroups: [1, 1, 1],
            groups: None,
            alternatives: vec![],
        }
    }

    /// What the H200 reported through Vulkan (coop_probe), in part.
    fn h200() -> CoopOffer {
        let config = |n_size, cr_type| wgpu::CooperativeMatrixProperties {
            m_size: 16,
            n_size,
            k_size: 16,
            ab_type: wgpu::CooperativeScalarType::F16,
            cr_type,
            saturating_accumulation: false,
        };
        CoopOffer {
            configurations: vec![
                config(8, wgpu::CooperativeScalarType::F32),
                config(16, wgpu::CooperativeScalarType::F16),
                config(16, wgpu::CooperativeScalarType::F32),
            ],
            subgroup_min_size: 32,
            subgroup_max_size: 32,
            workgroup_storage: 49152,
        }
    }

    /// An Apple GPU's offer through Metal: 8×8 f32 simdgroup matrices.
    fn apple() -> CoopOffer {
        CoopOffer {
            configurations: vec![wgpu::CooperativeMatrixProperties {
                m_size: 8,
                n_size: 8,
                k_size: 8,
                ab_type: wgpu::CooperativeScalarType::F32,
                cr_type: wgpu::CooperativeScalarType::F32,
                saturating_accumulation: false,
            }],
            ..h200()
        }
    }

    /// A payload of `dispatches` and nothing else.
    fn payload_of(dispatches: Vec<Dispatch>) -> Payload {
        Payload {
            buffers: vec![],
            kernels: vec![],
            dispatches,
            inputs: vec![],
            outputs: vec![],
            arenas: vec![],
            requirements: Requirements::default(),
            state: vec![],
            checks: vec![],
            symbols: vec![],
        }
    }

    /// A kernel of no bindings named `name` with `wgsl` as its source.
    fn bare_kernel(name: &str, wgsl: &str) -> etmetal_metal::payload::Kernel {
        etmetal_metal::payload::Kernel {
            name: name.into(),
            ops: vec![],
            wgsl: wgsl.into(),
            msl: String::new(),
            entry_point: "main".into(),
            bindings: vec![],
            workgroup_size: [1, 1, 1],
            sizes: false,
        }
    }

    /// An alternative the driver will not build (here: not WGSL) is timed
    /// as infinitely slow, so it is never chosen, and the load goes on with
    /// the others; the portable kernel's own failure stays the load's.
    #[test]
    fn an_alternative_the_driver_refuses_is_left_out() {
        let gpu = GpuDevice::shared(crate::DeviceChoice::Auto, None, false)
            .unwrap_or_else(|e| panic!("GPU tests need an adapter (Mesa lavapipe): {e}"));
        let fine = "@compute @workgroup_size(1) fn main() {}";
        let mut main = dispatch(0, 0);
        main.alternatives = [1, 2]
            .map(|kernel| Alternative {
                needs: needs(32, 0),
                dispatches: vec![dispatch(kernel, 0)],
            })
            .into();
        let mut payload = payload_of(vec![main]);
        payload.kernels = vec![
            bare_kernel("portable", fine),
            bare_kernel("refused", "this is not a kernel"),
            bare_kernel("alternative", fine),
        ];
        let counters = Counters::default();
        let measure = |payload: &Payload, alts: &[usize]| {
            let binder = Binder {
                gpu: &gpu,
                payload,
                regions: &[],
                buffers: &[],
                sizes: None,
            };
            let mut kernels = Kernels::new(&gpu, payload, &counters);
            let timeout = Duration::from_secs(60);
            time_forms_of(&gpu, (payload, 0, alts), &mut kernels, &binder, timeout)
        };
        let ms = measure(&payload, &[0, 1]).unwrap();
        assert_eq!(ms.len(), 3, "{ms:?}");
        assert!(ms[0].is_finite() && ms[2].is_finite(), "{ms:?}");
        assert_eq!(ms[1], f64::INFINITY, "{ms:?}");
        assert_ne!(select::fastest(&ms, &[0, 1]), Some(0));
        // a portable kernel the driver refuses fails the load, naming it
        payload.kernels[0] = bare_kernel("portable", "not WGSL either");
        let e = measure(&payload, &[1]).unwrap_err().to_string();
        assert!(e.contains("`portable`"), "{e}");
    }

    #[test]
    fn offers_meet_needs_by_configuration_subgroup_and_memory() {
        let o = h200();
        assert!(o.meets(&needs(32, 49152)));
        assert!(!o.meets(&needs(32, 49153)), "workgroup memory");
        assert!(!o.meets(&needs(64, 0)), "subgroup size");
        assert!(
            !o.meets(&Needs {
                k: 8,
                ..needs(32, 0)
            }),
            "configuration"
        );
        assert!(
            !o.meets(&Needs {
                ab: CoopType::F32,
                ..needs(32, 0)
            }),
            "types"
        );
        // subgroups of 32 or 64 (AMD RDNA): a kernel assuming 32 may get 64
        let varying = CoopOffer {
            subgroup_max_size: 64,
            ..h200()
        };
        assert!(!varying.meets(&needs(32, 0)));
        // an Apple GPU's 8×8 f32 matrices do not run 16×16 kernels
        let apple = apple();
        assert!(!apple.meets(&needs(32, 0)));
        // the 8×8 f32 alternative runs there, and not on the H200
        let apple8 = etmetal_metal::payload::Needs::f32_8x8x8(32, 24576);
        assert!(apple.meets(&apple8));
        assert!(!h200().meets(&apple8));
    }

    /// The measured choice offers a form no real GPU has run (Apple's 8×8)
    /// only when asked (`with_untested_forms`, `--coop all`); the 16×16
    /// form, run on NVIDIA's, always.
    #[test]
    fn untested_forms_are_eligible_only_when_asked() {
        let mut with = dispatch(0, 2);
        with.alternatives = vec![
            Alternative {
                needs: needs(32, 0),
                dispatches: vec![dispatch(1, 2)],
            },
            Alternative {
                needs: Needs::f32_8x8x8(32, 0),
                dispatches: vec![dispatch(2, 2)],
            },
        ];
        let payload = payload_of(vec![with]);
        let none: Vec<usize> = vec![];
        assert_eq!(select::eligible(&payload, Some(&apple()), 8, false), [none]);
        assert_eq!(
            select::eligible(&payload, Some(&apple()), 8, true),
            [vec![1]]
        );
        for untested in [false, true] {
            assert_eq!(
                select::eligible(&payload, Some(&h200()), 8, untested),
                [vec![0]]
            );
        }
    }

    #[test]
    fn eligible_alternatives_and_the_launches_of_a_choice() {
        let mut with = dispatch(0, 2);
        with.alternatives = vec![
            Alternative {
                needs: needs(32, 1 << 20),
                dispatches: vec![dispatch(1, 2)],
            },
            Alternative {
                needs: needs(32, 1024),
                dispatches: vec![dispatch(2, 3), dispatch(3, 3)],
            },
        ];
        let payload = payload_of(vec![dispatch(4, 1), with]);
        let kernels = |launches: &[Launch]| -> Vec<usize> {
            launches.iter().map(|s| s.dispatch.kernel).collect()
        };
        let offer = h200();
        // (the first alternative needs more workgroup memory than offered)
        let none: Vec<usize> = vec![];
        assert_eq!(
            select::eligible(&payload, Some(&offer), 8, false),
            [none.clone(), vec![1]]
        );
        assert_eq!(
            select::eligible(&payload, None, 8, false),
            [none.clone(), none.clone()]
        );
        // an alternative binding more than the device allows is passed over
        assert_eq!(
            select::eligible(&payload, Some(&offer), 2, false),
            [none.clone(), none]
        );
        let launches = select::launches(&payload, &[None, Some(1)]);
        assert_eq!(kernels(&launches), [4, 2, 3]);
        assert_eq!(launches[1].variant, Some((1, needs(32, 1024))));
        assert!(launches.iter().all(|s| s.dispatch.alternatives.is_empty()));
        assert_eq!(kernels(&select::launches(&payload, &[None, None])), [4, 0]);
    }
}
