//! Choosing an adapter and opening a device with everything it offers, and
//! with cooperative matrices where it offers them and the backend runs
//! payload alternatives ([`CoopOffer`]).

use std::sync::{Arc, Mutex};

use etmetal_core::{Error, Result};
use etmetal_metal::payload::{CoopType, Needs, Requirements};

/// Which GPU API to run delegates on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    /// Metal if present, else a discrete GPU, else any other adapter
    /// (integrated, virtual, then software ones such as Mesa lavapipe).
    Auto,
    Metal,
    Vulkan,
    Dx12,
}

impl DeviceChoice {
    pub fn name(self) -> &'static str {
        match self {
            DeviceChoice::Auto => "auto",
            DeviceChoice::Metal => "metal",
            DeviceChoice::Vulkan => "vulkan",
            DeviceChoice::Dx12 => "dx12",
        }
    }

    fn backends(self) -> wgpu::Backends {
        match self {
            DeviceChoice::Auto => {
                wgpu::Backends::METAL | wgpu::Backends::VULKAN | wgpu::Backends::DX12
            }
            DeviceChoice::Metal => wgpu::Backends::METAL,
            DeviceChoice::Vulkan => wgpu::Backends::VULKAN,
            DeviceChoice::Dx12 => wgpu::Backends::DX12,
        }
    }
}

/// An open device, shared (through `Arc`) by every delegate loaded on it.
pub struct GpuDevice {
    pub instance: wgpu::Instance,
    pub adapter: wgpu::Adapter,
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    /// The limits the device was opened with.
    pub limits: wgpu::Limits,
    /// The cooperative-matrix support the device was opened with (none
    /// unless asked for and the adapter has it).
    pub coop: Option<CoopOffer>,
    /// The run-time checks wgpu adds to every kernel on this device
    /// ([`shader_checks`]).
    pub(crate) checks: wgpu::ShaderRuntimeChecks,
    /// How limit errors name it: the adapter, and whether it is capped.
    label: String,
    /// Errors reported outside any error scope, and device loss, kept for
    /// the next check instead of wgpu's default panic.
    pub(crate) uncaptured: Arc<Mutex<Option<String>>>,
}

/// The run-time checks wgpu compiles into every kernel on `backend`.
///
/// Measured on an H100 (Vulkan, 2026-12-06), wgpu's default checks cost
/// 13% of a bf16 Llama-1B decode step, 39% of a bf16 4096³ tensor-core
/// GEMM and 57% of a bf16 flash attention: a counter and a test in every
/// loop iteration (`force_loop_bounding`), and a clamp on every index into
/// a workgroup or private array (`bounds_checks`).
/// - Loop bounding is off everywhere: it only turns an infinite loop into
///   one of 2^64 iterations, so it protects against no hang a payload
///   could cause, and every loop of our kernels has a bound.
/// - Bounds checks are off on Vulkan only, where wgpu enables the
///   driver's robust buffer access, so a kernel still cannot touch memory
///   outside its bound buffers; workgroup arrays are indexed within their
///   sizes by construction. Metal, DX12 and GL keep them until measured
///   there.
/// - Software adapters (lavapipe) keep both: without them its LLVM took
///   6× longer over an emulated tensor-core attention test (unrolling, it
///   seems, what the loop counter kept rolled), and such an adapter is
///   for correctness, not speed.
///
/// `setting` is `ETMETAL_SHADER_CHECKS`: `on` restores wgpu's defaults (to
/// tell a kernel bug from a checked index), `off` drops both checks on any
/// adapter.
fn shader_checks(
    info: &wgpu::AdapterInfo,
    setting: Option<&str>,
) -> Result<wgpu::ShaderRuntimeChecks> {
    let software = info.device_type == wgpu::DeviceType::Cpu;
    let bounds = match setting {
        Some("on") => return Ok(wgpu::ShaderRuntimeChecks::checked()),
        Some("off") => false,
        Some("") | None if software => return Ok(wgpu::ShaderRuntimeChecks::checked()),
        Some("") | None => info.backend != wgpu::Backend::Vulkan,
        Some(other) => {
            return Err(Error::invalid_input(format!(
            "ETMETAL_SHADER_CHECKS={other}: expected `on` or `off` (unset: the backend's default)"
        )))
        }
    };
    Ok(wgpu::ShaderRuntimeChecks {
        bounds_checks: bounds,
        force_loop_bounding: false,
        ..wgpu::ShaderRuntimeChecks::checked()
    })
}

impl GpuDevice {
    /// A kernel's shader module, with this device's [`shader_checks`].
    pub(crate) fn kernel_module(&self, label: &str, wgsl: &str) -> wgpu::ShaderModule {
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(label),
            source: wgpu::ShaderSource::Wgsl(wgsl.into()),
        };
        // SAFETY: what wgpu asks of a caller dropping its checks: every loop
        // of our kernels is bounded, and without bounds checks (Vulkan) the
        // driver's robust buffer access keeps each kernel within its bound
        // buffers (see `shader_checks`).
        unsafe { self.device.create_shader_module_trusted(desc, self.checks) }
    }
}

fn lower(backends: wgpu::Backends) -> String {
    let names: Vec<String> = backends
        .iter_names()
        .map(|(name, _)| name.to_lowercase())
        .collect();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// A one-line description: `llvmpipe (LLVM 19, 256 bits) (vulkan, cpu)`.
pub fn describe(info: &wgpu::AdapterInfo) -> String {
    format!(
        "{} ({}, {})",
        info.name,
        info.backend.to_str(),
        format!("{:?}", info.device_type).to_lowercase()
    )
}

/// Lower is preferred: Metal first, then by device type.
fn rank(info: &wgpu::AdapterInfo) -> (bool, u8) {
    let kind = match info.device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    };
    (info.backend != wgpu::Backend::Metal, kind)
}

/// The process's instance for `backends` (made at the first call) and its
/// adapters, enumerated under one process-wide lock. NVIDIA's Vulkan driver
/// probes X11 when an instance is made and its adapters enumerated; test
/// binaries that did so on several threads at once died as threads exited
/// (2026-12-06, H100, driver 580.159: `free` inside `xcb_connect`,
/// `_IO_flockfile`: a corrupted heap), 1 run in 2 to 4.
fn enumerate(backends: wgpu::Backends) -> (wgpu::Instance, Vec<wgpu::Adapter>) {
    static INSTANCES: Mutex<Vec<(wgpu::Backends, wgpu::Instance)>> = Mutex::new(Vec::new());
    let mut instances = INSTANCES.lock().unwrap_or_else(|p| p.into_inner());
    let instance = match instances.iter().find(|(b, _)| *b == backends) {
        Some((_, i)) => i.clone(),
        None => {
            let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
            desc.backends = backends;
            let i = wgpu::Instance::new(desc);
            instances.push((backends, i.clone()));
            i
        }
    };
    let adapters = pollster::block_on(instance.enumerate_adapters(backends));
    (instance, adapters)
}

/// The adapter `choice` selects, or an error naming the backends tried and
/// the adapters other backends have.
pub fn select_adapter(choice: DeviceChoice) -> Result<(wgpu::Instance, wgpu::Adapter)> {
    let tried = choice.backends() & wgpu::Instance::enabled_backend_features();
    let (instance, mut adapters) = enumerate(tried);
    adapters.sort_by_key(|a| rank(&a.get_info()));
    if let Some(adapter) = adapters.into_iter().next() {
        return Ok((instance, adapter));
    }
    let others = wgpu::Instance::enabled_backend_features() - tried;
    let found: Vec<String> = if others.is_empty() {
        Vec::new()
    } else {
        enumerate(others)
            .1
            .iter()
            .map(|a| describe(&a.get_info()))
            .collect()
    };
    let found = if found.is_empty() {
        "no adapter on any backend".to_string()
    } else {
        format!("found only {}", found.join("; "))
    };
    let unbuilt = choice.backends() - tried;
    let unbuilt = if unbuilt.is_empty() {
        String::new()
    } else {
        format!(" ({} not built for this platform)", lower(unbuilt))
    };
    Err(Error::unsupported(format!(
        "no GPU adapter found for device `{}` (tried {}{unbuilt}; {found}; on Linux install \
         mesa-vulkan-drivers and libvulkan1 for a software Vulkan)",
        choice.name(),
        lower(tried),
    )))
}

/// The requirement fields as (name, needed, available on `limits`).
fn limit_rows(req: &Requirements, limits: &wgpu::Limits) -> [(&'static str, u64, u64); 6] {
    [
        (
            "max_storage_buffer_binding_size",
            req.max_storage_buffer_binding_size,
            limits.max_storage_buffer_binding_size,
        ),
        (
            "max_buffer_size",
            req.max_buffer_size,
            limits.max_buffer_size,
        ),
        (
            "max_storage_buffers_per_shader_stage",
            req.max_storage_buffers_per_shader_stage.into(),
            limits.max_storage_buffers_per_shader_stage.into(),
        ),
        (
            "max_compute_workgroup_storage_size",
            req.max_compute_workgroup_storage_size.into(),
            limits.max_compute_workgroup_storage_size.into(),
        ),
        (
            "max_compute_invocations_per_workgroup",
            req.max_compute_invocations_per_workgroup.into(),
            limits.max_compute_invocations_per_workgroup.into(),
        ),
        (
            "max_compute_workgroups_per_dimension",
            req.max_compute_workgroups_per_dimension.into(),
            limits.max_compute_workgroups_per_dimension.into(),
        ),
    ]
}

/// An error naming the first limit or feature `req` needs beyond what
/// `limits`/`features` of adapter `name` offer.
fn check(
    req: &Requirements,
    limits: &wgpu::Limits,
    features: wgpu::Features,
    name: &str,
) -> Result<()> {
    for (limit, need, have) in limit_rows(req, limits) {
        if need > have {
            return Err(Error::limit(format!(
                "the GPU `{name}` offers {limit} = {have}, the delegate needs {need}"
            )));
        }
    }
    if req.shader_f16 && !features.contains(wgpu::Features::SHADER_F16) {
        return Err(Error::limit(format!(
            "the GPU `{name}` lacks the shader-f16 feature the delegate's kernels use"
        )));
    }
    Ok(())
}

/// What an adapter offers payload alternatives (see
/// `etmetal_metal::payload::Needs`): its cooperative-matrix configurations
/// (with shader-f16 and subgroups, which the kernels also use), its
/// subgroup sizes and workgroup memory.
#[derive(Clone, Debug, PartialEq)]
pub struct CoopOffer {
    pub configurations: Vec<wgpu::CooperativeMatrixProperties>,
    pub subgroup_min_size: u32,
    pub subgroup_max_size: u32,
    pub workgroup_storage: u32,
}

impl CoopOffer {
    /// Features a device needs for the alternatives' kernels.
    const FEATURES: wgpu::Features = wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX
        .union(wgpu::Features::SHADER_F16)
        .union(wgpu::Features::SUBGROUP);

    /// The adapter's offer within `cap` (none without the features, with
    /// no configuration, or when the cap takes shader-f16 away).
    fn of(adapter: &wgpu::Adapter, cap: Option<&Requirements>) -> Option<CoopOffer> {
        let info = adapter.get_info();
        let mut storage = adapter.limits().max_compute_workgroup_storage_size;
        if let Some(cap) = cap {
            if !cap.shader_f16 {
                return None;
            }
            storage = storage.min(cap.max_compute_workgroup_storage_size);
        }
        let configurations = adapter.cooperative_matrix_properties();
        let offered = adapter.features().contains(Self::FEATURES) && !configurations.is_empty();
        let (subgroup_min_size, subgroup_max_size) = Self::subgroup_sizes(&info);
        offered.then_some(CoopOffer {
            configurations,
            subgroup_min_size,
            subgroup_max_size,
            workgroup_storage: storage,
        })
    }

    /// The subgroup sizes of an adapter that offers cooperative matrices:
    /// what it reports, except on Metal, where wgpu reports 4..64 for every
    /// GPU while those with simdgroup matrices (Apple7 and later, the only
    /// ones wgpu offers them on) run 32-wide simdgroups, as the 8×8 kernels
    /// assume (unchecked here: no Apple hardware).
    fn subgroup_sizes(info: &wgpu::AdapterInfo) -> (u32, u32) {
        if info.backend == wgpu::Backend::Metal {
            (32, 32)
        } else {
            (info.subgroup_min_size, info.subgroup_max_size)
        }
    }

    /// Whether kernels needing `needs` run here: the configuration is
    /// reported, every subgroup has exactly the size the kernels assume,
    /// and their workgroup memory fits.
    pub fn meets(&self, needs: &Needs) -> bool {
        let ty = |t: wgpu::CooperativeScalarType| match t {
            wgpu::CooperativeScalarType::F16 => Some(CoopType::F16),
            wgpu::CooperativeScalarType::F32 => Some(CoopType::F32),
            _ => None,
        };
        self.subgroup_min_size == needs.subgroup_size
            && self.subgroup_max_size == needs.subgroup_size
            && needs.workgroup_storage <= self.workgroup_storage
            && self.configurations.iter().any(|c| {
                (c.m_size, c.n_size, c.k_size) == (needs.m, needs.n, needs.k)
                    && ty(c.ab_type) == Some(needs.ab)
                    && ty(c.cr_type) == Some(needs.cr)
            })
    }
}

/// Set each limit a payload states to `pick` of the device's value and
/// `req`'s: `u64::min` lowers a device to a cap, `u64::max` raises a request
/// to what the payload needs.
fn merge_limits(limits: &mut wgpu::Limits, req: &Requirements, pick: fn(u64, u64) -> u64) {
    // the u32 limits come back as u32: min and max of two u32s fit
    let pick32 = |a: u32, b: u32| pick(a.into(), b.into()) as u32;
    let l = limits;
    l.max_storage_buffer_binding_size = pick(
        l.max_storage_buffer_binding_size,
        req.max_storage_buffer_binding_size,
    );
    l.max_buffer_size = pick(l.max_buffer_size, req.max_buffer_size);
    l.max_storage_buffers_per_shader_stage = pick32(
        l.max_storage_buffers_per_shader_stage,
        req.max_storage_buffers_per_shader_stage,
    );
    l.max_compute_workgroup_storage_size = pick32(
        l.max_compute_workgroup_storage_size,
        req.max_compute_workgroup_storage_size,
    );
    l.max_compute_invocations_per_workgroup = pick32(
        l.max_compute_invocations_per_workgroup,
        req.max_compute_invocations_per_workgroup,
    );
    l.max_compute_workgroups_per_dimension = pick32(
        l.max_compute_workgroups_per_dimension,
        req.max_compute_workgroups_per_dimension,
    );
}

impl GpuDevice {
    /// Open the adapter `choice` selects with the limits `req` asks for
    /// (wgpu's defaults where it asks for less, never beyond the adapter's).
    pub fn open(choice: DeviceChoice, req: &Requirements) -> Result<Arc<GpuDevice>> {
        GpuDevice::open_capped(choice, Some(req), None, false)
    }

    /// The process's device for `choice` within `cap`, with cooperative
    /// matrices when `coop` and the adapter has them: opened once, with
    /// every limit the adapter offers within the cap, and kept for the life
    /// of the process. Every backend and delegate asking the same shares
    /// it, so no device is ever opened beside work on another or destroyed
    /// while others build pipelines: on the H200, a test binary whose
    /// backend re-opened its device for larger requirements (and dropped
    /// the old one as its delegates finished) crashed NVIDIA's driver in
    /// 2 of 5 multi-threaded runs, and serialising every pipeline build did
    /// not help (7 of 10 crashed), so the crash was not the builds' own.
    pub fn shared(
        choice: DeviceChoice,
        cap: Option<&Requirements>,
        coop: bool,
    ) -> Result<Arc<GpuDevice>> {
        type Key = (DeviceChoice, Option<Requirements>, bool);
        static DEVICES: Mutex<Vec<(Key, Arc<GpuDevice>)>> = Mutex::new(Vec::new());
        let key = (choice, cap.cloned(), coop);
        let mut devices = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, d)) = devices.iter().find(|(k, _)| *k == key) {
            return Ok(d.clone());
        }
        let d = GpuDevice::open_capped(choice, None, cap, coop)?;
        devices.push((key, d.clone()));
        Ok(d)
    }

    /// [`GpuDevice::open`] on an adapter taken to offer at most `cap`, as a
    /// smaller GPU would: the device is opened with no more than `cap`, and
    /// a `req` beyond it fails as it would on that GPU; with no `req`, with
    /// every limit the adapter offers within the cap. With `coop`, the
    /// device is also opened with the adapter's cooperative matrices (and
    /// its largest workgroup memory), where it has them.
    pub fn open_capped(
        choice: DeviceChoice,
        req: Option<&Requirements>,
        cap: Option<&Requirements>,
        coop: bool,
    ) -> Result<Arc<GpuDevice>> {
        let (instance, adapter) = select_adapter(choice)?;
        let info = adapter.get_info();
        let setting = std::env::var("ETMETAL_SHADER_CHECKS").ok();
        let checks = shader_checks(&info, setting.as_deref())?;
        let mut available = adapter.limits();
        let mut features = adapter.features();
        let mut name = describe(&info);
        if let Some(cap) = cap {
            merge_limits(&mut available, cap, u64::min);
            if !cap.shader_f16 {
                features.remove(wgpu::Features::SHADER_F16);
            }
            name.push_str(" with capped limits");
        }
        let (mut limits, f16) = match req {
            Some(req) => {
                check(req, &available, features, &name)?;
                let mut limits = wgpu::Limits::default().or_worse_values_from(&available);
                merge_limits(&mut limits, req, u64::max);
                (limits, req.shader_f16)
            }
            None => (
                available.clone(),
                features.contains(wgpu::Features::SHADER_F16),
            ),
        };
        let mut required_features = if f16 {
            wgpu::Features::SHADER_F16
        } else {
            wgpu::Features::empty()
        };
        // Timestamps cost nothing unless written; profiled executes use them.
        required_features |= adapter.features() & wgpu::Features::TIMESTAMP_QUERY;
        let coop = CoopOffer::of(&adapter, cap).filter(|_| coop);
        let mut experimental_features = wgpu::ExperimentalFeatures::disabled();
        if let Some(offer) = &coop {
            required_features |= CoopOffer::FEATURES;
            limits.max_compute_workgroup_storage_size = offer.workgroup_storage;
            // SAFETY: wgpu marks cooperative matrices experimental (its
            // implementation may still have bugs). Only the kernels of
            // payload alternatives use them; naga validated those at
            // compile time and wgpu validates them again here, and they
            // read and write in-bounds workgroup memory only.
            experimental_features = unsafe { wgpu::ExperimentalFeatures::enabled() };
        }
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("etmetal"),
            required_features,
            required_limits: limits.clone(),
            experimental_features,
            ..Default::default()
        }))
        .map_err(|e| {
            Error::unsupported(format!(
                "opening a device on `{}` failed: {e}",
                describe(&info)
            ))
        })?;
        let uncaptured = Arc::new(Mutex::new(None));
        let slot = uncaptured.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| record(&slot, e.to_string())));
        let slot = uncaptured.clone();
        device.set_device_lost_callback(move |reason, message| {
            record(&slot, format!("device lost ({reason:?}): {message}"))
        });
        Ok(Arc::new(GpuDevice {
            instance,
            adapter,
            device,
            queue,
            info,
            limits,
            coop,
            checks,
            label: name,
            uncaptured,
        }))
    }

    /// Whether a delegate needing `req` can load on this device.
    pub fn satisfies(&self, req: &Requirements) -> bool {
        self.check(req).is_ok()
    }

    /// An error naming the first limit or feature `req` needs beyond this
    /// device.
    pub fn check(&self, req: &Requirements) -> Result<()> {
        check(req, &self.limits, self.device.features(), &self.label)
    }

    /// `describe` of the adapter.
    pub fn description(&self) -> String {
        describe(&self.info)
    }

    /// The first error wgpu reported outside an error scope (or the device
    /// loss), if any, taken out so it is reported once.
    pub(crate) fn take_uncaptured(&self) -> Option<String> {
        self.uncaptured.lock().ok().and_then(|mut s| s.take())
    }
}

fn record(slot: &Mutex<Option<String>>, message: String) {
    if let Ok(mut s) = slot.lock() {
        s.get_or_insert(message);
    }
}

#[cfg(test)]
mod tests {
    use super::CoopOffer;

    #[test]
    fn metal_simdgroups_are_taken_as_32_wide() {
        let info = |backend, min, max| wgpu::AdapterInfo {
            subgroup_min_size: min,
            subgroup_max_size: max,
            ..wgpu::AdapterInfo::new(wgpu::DeviceType::IntegratedGpu, backend)
        };
        let metal = info(wgpu::Backend::Metal, 4, 64);
        assert_eq!(CoopOffer::subgroup_sizes(&metal), (32, 32));
        let vulkan = info(wgpu::Backend::Vulkan, 32, 64);
        assert_eq!(CoopOffer::subgroup_sizes(&vulkan), (32, 64));
    }

    #[test]
    fn kernels_drop_the_checks_only_where_safe_and_measured() {
        use wgpu::{Backend, DeviceType};
        let checks = |kind, backend, setting| {
            let info = wgpu::AdapterInfo::new(kind, backend);
            let c = super::shader_checks(&info, setting).unwrap();
            (c.bounds_checks, c.force_loop_bounding)
        };
        let gpu = (DeviceType::DiscreteGpu, Backend::Vulkan);
        assert_eq!(checks(gpu.0, gpu.1, None), (false, false));
        assert_eq!(checks(gpu.0, gpu.1, Some("")), (false, false));
        assert_eq!(
            checks(DeviceType::IntegratedGpu, Backend::Metal, None),
            (true, false)
        );
        assert_eq!(
            checks(DeviceType::DiscreteGpu, Backend::Dx12, None),
            (true, false)
        );
        assert_eq!(checks(DeviceType::Cpu, Backend::Vulkan, None), (true, true));
        // the override decides, whatever the adapter
        assert_eq!(checks(gpu.0, gpu.1, Some("on")), (true, true));
        assert_eq!(
            checks(DeviceType::Cpu, Backend::Vulkan, Some("off")),
            (false, false)
        );
        let info = wgpu::AdapterInfo::new(gpu.0, gpu.1);
        let err = super::shader_checks(&info, Some("maybe"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("ETMETAL_SHADER_CHECKS=maybe") && err.contains("`on` or `off`"),
            "{err}"
        );
    }
}
