//! One loaded delegate: weights, arenas, pipelines and bind groups made
//! once at load; an execute writes the inputs, records every dispatch into
//! one compute pass, submits once and reads the outputs back.

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use etmetal_core::{Error, Result};
use etmetal_metal::payload::{self, Access, Location, Payload};
use etmetal_runtime::{DelegateArg, DelegateHandle, NamedData};
use wgpu::util::DeviceExt;

use crate::device::GpuDevice;

/// What a backend has created on the GPU so far (all its delegates).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuStats {
    pub pipelines_created: u64,
    pub buffers_allocated: u64,
    pub submits: u64,
}

#[derive(Default)]
pub(crate) struct Counters {
    pipelines: AtomicU64,
    buffers: AtomicU64,
    submits: AtomicU64,
}

impl Counters {
    pub(crate) fn stats(&self) -> GpuStats {
        GpuStats {
            pipelines_created: self.pipelines.load(Ordering::Relaxed),
            buffers_allocated: self.buffers.load(Ordering::Relaxed),
            submits: self.submits.load(Ordering::Relaxed),
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

/// A tensor's place on the GPU: a buffer and the range bound.
#[derive(Clone, Copy)]
struct Range {
    buffer: usize,
    offset: u64,
    size: u64,
}

struct Output {
    /// Payload buffer id.
    id: usize,
    range: Range,
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
    ranges: Vec<Range>,
    pipelines: Vec<wgpu::ComputePipeline>,
    bind_groups: Vec<wgpu::BindGroup>,
    outputs: Vec<Output>,
    staging: wgpu::Buffer,
    /// Set when an execute timed out with the read-back still pending.
    stuck: bool,
}

impl GpuDelegate {
    pub(crate) fn load(
        gpu: Arc<GpuDevice>,
        counters: Arc<Counters>,
        timeout: Duration,
        payload: Payload,
        named_data: &dyn NamedData,
    ) -> Result<GpuDelegate> {
        let device = &gpu.device;
        let limits = &gpu.limits;
        let mut buffers = Vec::new();
        // Weight key -> (buffer, bytes), so a weight is uploaded once.
        let mut by_key: HashMap<&str, (usize, u64)> = HashMap::new();
        let mut ranges = Vec::with_capacity(payload.buffers.len());
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
                &gpu,
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
            let range = match &b.location {
                Location::Arena { arena, offset } => Range {
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
                            let buffer = scoped(&gpu, what, || {
                                device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                                    label: Some(key),
                                    contents: data,
                                    usage: wgpu::BufferUsages::STORAGE,
                                })
                            })?;
                            let i = new_buffer(&mut buffers, buffer);
                            by_key.insert(key, (i, size));
                            i
                        }
                    };
                    Range {
                        buffer,
                        offset: 0,
                        size,
                    }
                }
            };
            ranges.push(range);
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

        let mut pipelines = Vec::with_capacity(payload.kernels.len());
        let mut layouts = Vec::with_capacity(payload.kernels.len());
        for k in &payload.kernels {
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
            let (layout, pipeline) = scoped(
                &gpu,
                || format!("building kernel `{}`", k.name),
                || {
                    let entries: Vec<wgpu::BindGroupLayoutEntry> = k
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
                    let layout =
                        device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                            label: Some(&k.name),
                            entries: &entries,
                        });
                    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                        label: Some(&k.name),
                        source: wgpu::ShaderSource::Wgsl(k.wgsl.as_str().into()),
                    });
                    let pipeline_layout =
                        device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                            label: Some(&k.name),
                            bind_group_layouts: &[Some(&layout)],
                            immediate_size: 0,
                        });
                    let pipeline =
                        device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
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
            counters.pipelines.fetch_add(1, Ordering::Relaxed);
            layouts.push(layout);
            pipelines.push(pipeline);
        }

        let mut bind_groups = Vec::with_capacity(payload.dispatches.len());
        for (d, dispatch) in payload.dispatches.iter().enumerate() {
            let kernel = &payload.kernels[dispatch.kernel];
            let label = format!("dispatch {d} (kernel `{}`)", kernel.name);
            for &id in &dispatch.buffers {
                let size = ranges[id].size;
                if size > limits.max_storage_buffer_binding_size {
                    return Err(Error::limit(format!(
                        "{label} binds `{}` of {size} bytes, the GPU's \
                         max_storage_buffer_binding_size = {}",
                        payload.buffers[id].name, limits.max_storage_buffer_binding_size
                    )));
                }
            }
            let group = scoped(
                &gpu,
                || format!("binding the buffers of {label}"),
                || {
                    let entries: Vec<wgpu::BindGroupEntry> = dispatch
                        .buffers
                        .iter()
                        .enumerate()
                        .map(|(i, &id)| {
                            let r = ranges[id];
                            wgpu::BindGroupEntry {
                                binding: i as u32,
                                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                                    buffer: &buffers[r.buffer],
                                    offset: r.offset,
                                    size: NonZeroU64::new(r.size),
                                }),
                            }
                        })
                        .collect();
                    device.create_bind_group(&wgpu::BindGroupDescriptor {
                        label: Some(&label),
                        layout: &layouts[dispatch.kernel],
                        entries: &entries,
                    })
                },
            )?;
            bind_groups.push(group);
        }

        let mut staging_size = 0;
        let outputs: Vec<Output> = payload
            .outputs
            .iter()
            .map(|&id| {
                let range = ranges[id];
                let out = Output {
                    id,
                    range,
                    staging_offset: staging_size,
                };
                staging_size += range.size;
                out
            })
            .collect();
        let staging = scoped(
            &gpu,
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
        if let Some(e) = gpu.take_uncaptured() {
            return Err(Error::internal(format!("GPU error while loading: {e}")));
        }
        Ok(GpuDelegate {
            gpu,
            counters,
            timeout,
            payload,
            buffers,
            ranges,
            pipelines,
            bind_groups,
            outputs,
            staging,
            stuck: false,
        })
    }

    /// Check the call's arguments against the payload (every one a tensor
    /// of the dtype and shape of its buffer) and return the inputs' GPU bytes.
    fn gpu_inputs(&self, args: &[DelegateArg]) -> Result<Vec<Vec<u8>>> {
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
            let DelegateArg::Tensor(t) = arg else {
                return Err(Error::invalid_input(format!(
                    "delegate {what} {index} (`{}`): expected a tensor, got {arg:?}",
                    b.name
                )));
            };
            if t.dtype() != b.dtype || t.shape() != b.shape.as_slice() {
                return Err(Error::invalid_input(format!(
                    "delegate {what} {index} (`{}`): expected {} {:?}, got {} {:?}",
                    b.name,
                    b.dtype.name(),
                    b.shape,
                    t.dtype().name(),
                    t.shape()
                )));
            }
            if k < ni {
                inputs.push(payload::to_gpu(
                    t,
                    &format!("delegate input {k} (`{}`)", b.name),
                )?);
            }
        }
        Ok(inputs)
    }

    fn execute(&mut self, args: &mut [DelegateArg]) -> Result<()> {
        if self.stuck {
            return Err(Error::internal(
                "a previous execute of this delegate timed out on the GPU; load the program again",
            ));
        }
        let inputs = self.gpu_inputs(args)?;
        let gpu = self.gpu.clone();
        for (&id, bytes) in self.payload.inputs.iter().zip(&inputs) {
            let r = self.ranges[id];
            gpu.queue
                .write_buffer(&self.buffers[r.buffer], r.offset, bytes);
        }
        let index = scoped(
            &gpu,
            || {
                let kernels: Vec<&str> = self
                    .payload
                    .dispatches
                    .iter()
                    .map(|d| self.payload.kernels[d.kernel].name.as_str())
                    .collect();
                format!("running kernels [{}]", kernels.join(", "))
            },
            || {
                let mut encoder =
                    gpu.device
                        .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                            label: Some("etmetal delegate"),
                        });
                {
                    let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: Some("etmetal delegate"),
                        timestamp_writes: None,
                    });
                    for (d, dispatch) in self.payload.dispatches.iter().enumerate() {
                        let [x, y, z] = dispatch.workgroups;
                        pass.set_pipeline(&self.pipelines[dispatch.kernel]);
                        pass.set_bind_group(0, &self.bind_groups[d], &[]);
                        pass.dispatch_workgroups(x, y, z);
                    }
                }
                for o in &self.outputs {
                    encoder.copy_buffer_to_buffer(
                        &self.buffers[o.range.buffer],
                        o.range.offset,
                        &self.staging,
                        o.staging_offset,
                        o.range.size,
                    );
                }
                gpu.queue.submit([encoder.finish()])
            },
        )?;
        self.counters.submits.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        self.staging
            .map_async(wgpu::MapMode::Read, .., move |r| drop(tx.send(r)));
        let polled = gpu.device.poll(wgpu::PollType::Wait {
            submission_index: Some(index),
            timeout: Some(self.timeout),
        });
        if let Some(e) = gpu.take_uncaptured() {
            self.stuck = true;
            return Err(Error::internal(format!("GPU error while running: {e}")));
        }
        match polled {
            Ok(_) => {}
            Err(wgpu::PollError::Timeout) => {
                self.stuck = true;
                return Err(Error::limit(format!(
                    "the GPU did not finish the delegate's {} dispatches within {:?}",
                    self.payload.dispatches.len(),
                    self.timeout
                )));
            }
            Err(e) => return Err(Error::internal(format!("waiting for the GPU: {e}"))),
        }
        // The map callbacks run in the poll that saw the work finish, which
        // may be another thread's poll of the shared device (taken before
        // this thread's poll returned, run after), so wait for them.
        match rx.recv_timeout(self.timeout) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                return Err(Error::internal(format!("reading the outputs back: {e}")));
            }
            Err(_) => {
                self.stuck = true;
                return Err(Error::internal(
                    "the GPU finished but the outputs were not mapped",
                ));
            }
        }
        let result = {
            let view = self
                .staging
                .get_mapped_range(..)
                .map_err(|e| Error::internal(format!("reading the outputs back: {e}")))?;
            let ni = self.payload.inputs.len();
            self.outputs.iter().enumerate().try_for_each(|(k, o)| {
                let b = &self.payload.buffers[o.id];
                let start = o.staging_offset as usize;
                let bytes = &view[start..start + o.range.size as usize];
                args[ni + k] = DelegateArg::Tensor(payload::from_gpu(bytes, b.dtype, &b.shape)?);
                Ok::<(), Error>(())
            })
        };
        self.staging.unmap();
        result
    }
}

impl DelegateHandle for GpuDelegate {
    fn execute(&mut self, args: &mut [DelegateArg]) -> Result<()> {
        GpuDelegate::execute(self, args)
    }
}
