//! The etmetal Metal backend, run half: executes `EtMetalBackend` delegate
//! payloads (see `etmetal_metal::payload`) through wgpu, on Metal, Vulkan or
//! DX12.
//!
//! Register a [`MetalBackend`] in the runtime's backend registry; the first
//! delegate it initialises opens the device, which later delegates share.
//! Weights, arenas, pipelines and bind groups are made at load; an execute
//! is one command buffer with every dispatch of the delegate.
//!
//! ```no_run
//! # fn main() -> etmetal_core::Result<()> {
//! use std::sync::Arc;
//! use etmetal_metal_runtime::{DeviceChoice, MetalBackend};
//! let mut options = etmetal_runtime::LoadOptions::default();
//! options
//!     .backends
//!     .register(Arc::new(MetalBackend::new(DeviceChoice::Auto)))?;
//! let program = etmetal_runtime::Program::load("model.pte")?.with_options(options);
//! let mut method = program.method("forward")?;
//! # Ok(())
//! # }
//! ```

mod bound;
mod delegate;
mod device;
mod select;
mod transfer;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etmetal_core::{Error, Result};
use etmetal_metal::payload::{Payload, Requirements};
use etmetal_pte::CompileSpec;
use etmetal_runtime::{Backend, DelegateHandle, NamedData};

pub use delegate::{DispatchTime, GpuStats};
pub use device::{describe, select_adapter, CoopOffer, DeviceChoice, GpuDevice};
pub use etmetal_metal::BACKEND_ID;
/// The wgpu this runtime runs on (its adapter and device types appear in
/// this crate's API).
pub use wgpu;

/// How long an execute waits for the GPU before failing.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// The `EtMetalBackend` delegate backend on one device choice.
pub struct MetalBackend {
    choice: DeviceChoice,
    timeout: Duration,
    /// At most what devices are opened with (see `with_limit_cap`).
    cap: Option<Requirements>,
    /// Whether payload alternatives may run (see `with_cooperative_matrix`).
    coop: bool,
    /// Whether forms no real GPU has run may (see `with_untested_forms`).
    untested: bool,
    /// The alternative every dispatch runs (see `with_forced_alternative`).
    forced: Option<usize>,
    device: Mutex<Option<Arc<GpuDevice>>>,
    counters: Arc<delegate::Counters>,
}

impl MetalBackend {
    /// A backend that opens its device at the first delegate it loads.
    pub fn new(choice: DeviceChoice) -> MetalBackend {
        MetalBackend {
            choice,
            timeout: DEFAULT_TIMEOUT,
            cap: None,
            coop: true,
            untested: false,
            forced: None,
            device: Mutex::new(None),
            counters: Arc::default(),
        }
    }

    /// Take the adapter to offer at most `cap` (limits, and shader-f16 only
    /// if `cap.shader_f16`), as a smaller GPU would: a delegate needing more
    /// fails at load naming the limit, what it needs and what is offered.
    pub fn with_limit_cap(mut self, cap: Requirements) -> MetalBackend {
        self.cap = Some(cap);
        self
    }

    /// Whether delegates may run their payload's alternatives (tensor-core
    /// matrix products) where the device offers what they need, each only
    /// where it measures faster than the portable kernel; with `false`
    /// every dispatch runs its portable kernel, as on a device without
    /// them. On by default: a measured form cannot make a program slower
    /// (see the README's Tensor cores). With `true` the device is opened
    /// with cooperative matrices where the adapter has them.
    pub fn with_cooperative_matrix(mut self, on: bool) -> MetalBackend {
        self.coop = on;
        self
    }

    /// Whether the measured choice may also take forms that no real GPU
    /// has run yet (Apple's 8×8 f32 simdgroup matrices:
    /// `etmetal_metal::payload::Needs::has_run`); off by default. Turns
    /// alternatives on.
    pub fn with_untested_forms(mut self, on: bool) -> MetalBackend {
        self.untested = on;
        self.coop |= on;
        self
    }

    /// Run alternative `n` of every dispatch that has one the device can
    /// run, instead of measuring which form is fastest (as
    /// `ETMETAL_COOP_FORCE=n` does): for tests that must reach a
    /// tensor-core kernel on a GPU that has them, and for timing each
    /// variant. Turns alternatives on.
    pub fn with_forced_alternative(mut self, n: usize) -> MetalBackend {
        self.coop = true;
        self.forced = Some(n);
        self
    }

    /// Fail an execute the GPU has not finished after `timeout`.
    pub fn with_timeout(mut self, timeout: Duration) -> MetalBackend {
        self.timeout = timeout;
        self
    }

    /// Time every dispatch of later executes with GPU timestamp queries,
    /// where the device has them (see [`MetalBackend::take_dispatch_times`]),
    /// or stop. A profiled execute gives each dispatch a compute pass of its
    /// own, so it runs slightly slower than a plain one.
    pub fn set_profiling(&self, on: bool) {
        self.counters.profiling.store(on, Ordering::Relaxed);
    }

    /// Whether the device has the timestamp queries profiling needs (false
    /// before the first delegate opens it).
    pub fn can_profile(&self) -> bool {
        self.device().is_some_and(|d| {
            d.device
                .features()
                .contains(wgpu::Features::TIMESTAMP_QUERY)
        })
    }

    /// The dispatch times of profiled executes since the last call, in
    /// execution order (empty without profiling or timestamp queries).
    pub fn take_dispatch_times(&self) -> Vec<DispatchTime> {
        self.counters
            .times
            .lock()
            .map(|mut t| std::mem::take(&mut *t))
            .unwrap_or_default()
    }

    /// Counters over every delegate this backend loaded and ran.
    pub fn stats(&self) -> GpuStats {
        self.counters.stats()
    }

    /// The largest tensor a delegate may bind on this backend's adapter
    /// (its storage-binding and buffer-size limits, within the cap): what
    /// the compiler may give the GPU when compiling for this adapter.
    pub fn max_binding_bytes(&self) -> Result<u64> {
        let (_, adapter) = select_adapter(self.choice)?;
        let limits = adapter.limits();
        let mut bytes = limits
            .max_storage_buffer_binding_size
            .min(limits.max_buffer_size);
        if let Some(cap) = &self.cap {
            bytes = bytes.min(cap.max_storage_buffer_binding_size);
        }
        Ok(bytes)
    }

    /// The device delegates currently load on (none before the first).
    pub fn device(&self) -> Option<Arc<GpuDevice>> {
        self.device.lock().ok().and_then(|d| d.clone())
    }

    /// The backend's device (the process's for its choice, cap and
    /// cooperative-matrix setting, see [`GpuDevice::shared`]), or an error
    /// naming the first limit `req` needs beyond it.
    fn device_for(&self, req: &Requirements) -> Result<Arc<GpuDevice>> {
        let mut slot = self
            .device
            .lock()
            .map_err(|_| Error::internal("the GPU device lock is poisoned"))?;
        let d = match slot.as_ref() {
            Some(d) => d.clone(),
            None => GpuDevice::shared(self.choice, self.cap.as_ref(), self.coop)?,
        };
        d.check(req)?;
        *slot = Some(d.clone());
        Ok(d)
    }
}

impl Backend for MetalBackend {
    fn id(&self) -> &str {
        etmetal_metal::BACKEND_ID
    }

    fn init(
        &self,
        processed: &[u8],
        _compile_specs: &[CompileSpec],
        named_data: &dyn NamedData,
    ) -> Result<Box<dyn DelegateHandle>> {
        let payload = Payload::decode(processed)?;
        let gpu = self.device_for(&payload.requirements)?;
        Ok(Box::new(delegate::GpuDelegate::load(
            gpu,
            self.counters.clone(),
            self.timeout,
            (payload, select::fnv64(&[processed])),
            named_data,
            select::Selection::of(self.coop, self.untested, self.forced)?,
        )?))
    }
}
