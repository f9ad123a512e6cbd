//! The program handle: a `.pte` loaded from a path (mapped) or from bytes
//! (copied once), on the device `etmetal::device` chooses, as an
//! `etmetal::Model` (every method prepared, their mutable buffers one state).

use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use etmetal::device::{self, DevicePreference, TensorCores, Workload};
use etmetal::summary::{summarize, ProgramSummary};
use etmetal::Model;
use etmetal_core::{Error, Result};
use etmetal_runtime::LoadOptions;

use crate::counters::EtmetalProgramCounters;
use crate::error::{arg, arg_mut, null, status, text, EtmetalStatus};

/// A loaded program. Opaque; made by `etmetal_program_load` or
/// `etmetal_program_load_bytes`, released by `etmetal_program_free`.
pub struct EtmetalProgram {
    pub(crate) shared: Arc<Loaded>,
}

/// What a program's handle and its methods' handles share.
pub(crate) struct Loaded {
    /// Calls of any of its methods take turns: they share the state.
    model: Mutex<Model>,
    pub(crate) method_names: Vec<CString>,
    device: CString,
    warning: Option<CString>,
    pub(crate) summary: ProgramSummary,
}

impl Loaded {
    /// The model, for one call at a time.
    pub(crate) fn lock(&self) -> Result<MutexGuard<'_, Model>> {
        self.model.lock().map_err(|_| {
            Error::internal(
                "the program is unusable: an earlier call on it failed with an internal error \
                 while running",
            )
        })
    }
}

/// `device` (NULL: "auto") as `etmetal run --device` takes it.
///
/// # Safety
/// A non-null `device` is NUL-terminated.
unsafe fn preference(device: *const c_char, function: &str) -> Result<DevicePreference> {
    if device.is_null() {
        return Ok(DevicePreference::Auto);
    }
    // SAFETY: the caller's contract.
    DevicePreference::parse(unsafe { text(device, function, "device") }?)
}

/// Choose the device for `program` (named `origin` in messages), prepare
/// every method on it.
fn load(
    program: etmetal_runtime::Program,
    origin: &Path,
    preference: DevicePreference,
) -> Result<EtmetalProgram> {
    let placement = device::choose(preference, origin, Workload::of_pte(program.file()))?;
    let mut options = LoadOptions::default();
    if let Some(backend) = placement.backend(TensorCores::from_env()?) {
        options.backends.register(backend)?;
    }
    let model = Model::from_pte_program(program, options)
        .map_err(|e| e.context(origin.display().to_string()))?;
    let file = model
        .pte()
        .ok_or_else(|| Error::internal("a program loaded from a .pte has its file"))?;
    let summary = summarize(file)?;
    let c = |s: &str| {
        CString::new(s).map_err(|_| Error::format(format!("a NUL byte in the name `{s}`")))
    };
    let method_names = model
        .method_names()
        .into_iter()
        .map(c)
        .collect::<Result<_>>()?;
    let device = match &placement.gpu {
        Some(gpu) => c(&gpu.adapter)?,
        None => c"cpu".to_owned(),
    };
    Ok(EtmetalProgram {
        shared: Arc::new(Loaded {
            model: Mutex::new(model),
            method_names,
            device,
            warning: placement.warning.as_deref().map(c).transpose()?,
            summary,
        }),
    })
}

fn boxed(program: EtmetalProgram, out: &mut *mut EtmetalProgram) {
    *out = Box::into_raw(Box::new(program));
}

#[cfg(unix)]
fn path_of(bytes: &[u8]) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    PathBuf::from(std::ffi::OsStr::from_bytes(bytes))
}

#[cfg(not(unix))]
fn path_of(bytes: &[u8]) -> PathBuf {
    PathBuf::from(String::from_utf8_lossy(bytes).into_owned())
}

/// Load the `.pte` at `path` (memory-mapped: weights stay in the mapping
/// or go to the GPU from it) and prepare every method on the device named
/// by `device`: "auto" (or NULL), "metal", "vulkan", "dx12" or "cpu", as
/// `etmetal run --device`. "auto" prefers Metal, then a discrete GPU, then
/// any adapter; a program with GPU (`EtMetalBackend`) delegates and no
/// adapter of the kind asked for (or "cpu") is an
/// `ETMETAL_STATUS_UNSUPPORTED` error, never a silent fallback; a program
/// without them runs on the CPU whatever is asked
/// (`etmetal_program_warning` says so). A `.pt2` archive is refused:
/// compile it with `etmetal compile`. Tensor-core forms of f16/bf16
/// products run where they measured faster on the device, as with
/// `etmetal run`; the environment variable `ETMETAL_COOP` (`auto`, `all`
/// or `off`) sets them as `--coop` does.
///
/// On success `*out` is the program (release it with
/// `etmetal_program_free`); on failure `*out` is NULL.
///
/// Thread-safety: any thread, concurrently with any other call.
///
/// # Safety
/// `path` and a non-null `device` are NUL-terminated strings; `out` points
/// to writable memory for one pointer.
#[no_mangle]
pub unsafe extern "C" fn etmetal_program_load(
    path: *const c_char,
    device: *const c_char,
    out: *mut *mut EtmetalProgram,
) -> EtmetalStatus {
    const F: &str = "etmetal_program_load";
    status(F, || {
        // SAFETY: the caller's contract, for each argument.
        let out = unsafe { arg_mut(out, F, "out") }?;
        *out = std::ptr::null_mut();
        if path.is_null() {
            return Err(null(F, "path"));
        }
        // SAFETY: non-null and NUL-terminated (the caller's contract).
        let path = path_of(unsafe { std::ffi::CStr::from_ptr(path) }.to_bytes());
        let preference = unsafe { preference(device, F) }?;
        if !etmetal::is_pte(&path)? {
            return Err(Error::format(format!(
                "{}: not an ExecuTorch program (no `ET` identifier at bytes 4..8); \
                 the C API runs .pte files: compile a .pt2 with `etmetal compile`",
                path.display()
            )));
        }
        let program = etmetal_runtime::Program::load(&path)?;
        boxed(load(program, &path, preference)?, out);
        Ok(())
    })
}

/// Load a `.pte` held in memory, `len` bytes at `data` (copied once: the
/// caller may release them when the call returns), on `device` as
/// `etmetal_program_load` takes it.
///
/// On success `*out` is the program (release it with
/// `etmetal_program_free`); on failure `*out` is NULL.
///
/// Thread-safety: any thread, concurrently with any other call.
///
/// # Safety
/// `data` points to `len` readable bytes; a non-null `device` is a
/// NUL-terminated string; `out` points to writable memory for one pointer.
#[no_mangle]
pub unsafe extern "C" fn etmetal_program_load_bytes(
    data: *const u8,
    len: usize,
    device: *const c_char,
    out: *mut *mut EtmetalProgram,
) -> EtmetalStatus {
    const F: &str = "etmetal_program_load_bytes";
    status(F, || {
        // SAFETY: the caller's contract, for each argument.
        let out = unsafe { arg_mut(out, F, "out") }?;
        *out = std::ptr::null_mut();
        if data.is_null() {
            return Err(null(F, "data"));
        }
        // SAFETY: non-null, `len` readable bytes (the caller's contract).
        let bytes = unsafe { std::slice::from_raw_parts(data, len) };
        let preference = unsafe { preference(device, F) }?;
        let program = etmetal_runtime::Program::from_bytes(bytes)
            .map_err(|e| e.context("the program in memory"))?;
        boxed(
            load(program, Path::new("the program in memory"), preference)?,
            out,
        );
        Ok(())
    })
}

/// Release `program`. Method handles made from it stay usable (they keep
/// what they need); NULL is ignored.
///
/// Thread-safety: not concurrently with another call on the same
/// `program`.
///
/// # Safety
/// `program` is NULL or a program from `etmetal_program_load*` not yet
/// released.
#[no_mangle]
pub unsafe extern "C" fn etmetal_program_free(program: *mut EtmetalProgram) {
    if program.is_null() {
        return;
    }
    // SAFETY: made by Box::into_raw in `boxed`, released once (the
    // caller's contract).
    let program = unsafe { Box::from_raw(program) };
    // (the GPU's resources are released by drop: a panic there stays here)
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(program)));
}

/// How many methods the program has (`forward`, and `prefill`, ... where
/// the file has more); 0 for NULL.
///
/// Thread-safety: any thread, concurrently with any other call.
///
/// # Safety
/// `program` is NULL or a live program.
#[no_mangle]
pub unsafe extern "C" fn etmetal_program_method_count(program: *const EtmetalProgram) -> usize {
    const F: &str = "etmetal_program_method_count";
    crate::error::guard(F, 0, || {
        // SAFETY: the caller's contract.
        Ok(unsafe { arg(program, F, "program") }?
            .shared
            .method_names
            .len())
    })
}

/// The name of method `index` (in the file's order), owned by the program
/// and valid while it lives; NULL (and an error) for NULL or an index out
/// of range.
///
/// Thread-safety: any thread, concurrently with any other call.
///
/// # Safety
/// `program` is NULL or a live program.
#[no_mangle]
pub unsafe extern "C" fn etmetal_program_method_name(
    program: *const EtmetalProgram,
    index: usize,
) -> *const c_char {
    const F: &str = "etmetal_program_method_name";
    crate::error::guard(F, std::ptr::null(), || {
        // SAFETY: the caller's contract.
        let names = &unsafe { arg(program, F, "program") }?.shared.method_names;
        names.get(index).map(|n| n.as_ptr()).ok_or_else(|| {
            Error::invalid_input(format!(
                "{F}: method {index} does not exist ({} methods)",
                names.len()
            ))
        })
    })
}

/// Where the program's GPU delegates run: the adapter (name, backend and
/// driver, as `etmetal run` prints it), or "cpu" for a program without
/// them. Owned by the program; NULL for NULL.
///
/// Thread-safety: any thread, concurrently with any other call.
///
/// # Safety
/// `program` is NULL or a live program.
#[no_mangle]
pub unsafe extern "C" fn etmetal_program_device(program: *const EtmetalProgram) -> *const c_char {
    const F: &str = "etmetal_program_device";
    crate::error::guard(F, std::ptr::null(), || {
        // SAFETY: the caller's contract.
        Ok(unsafe { arg(program, F, "program") }?
            .shared
            .device
            .as_ptr())
    })
}

/// The warning the load left, if any (the device asked for is not used:
/// the program has no GPU delegates), which `etmetal run` prints; NULL
/// when there is none. Owned by the program.
///
/// Thread-safety: any thread, concurrently with any other call.
///
/// # Safety
/// `program` is NULL or a live program.
#[no_mangle]
pub unsafe extern "C" fn etmetal_program_warning(program: *const EtmetalProgram) -> *const c_char {
    const F: &str = "etmetal_program_warning";
    crate::error::guard(F, std::ptr::null(), || {
        // SAFETY: the caller's contract.
        let shared = &unsafe { arg(program, F, "program") }?.shared;
        Ok(shared
            .warning
            .as_ref()
            .map_or(std::ptr::null(), |w| w.as_ptr()))
    })
}

/// Put every mutable buffer (KV caches, counters) of every method back to
/// its initial value; otherwise state carries from one execute to the
/// next, and from one method to another (a decoder's `prefill` fills the
/// cache its `forward` reads).
///
/// Thread-safety: any thread; waits for a running execute of the program.
///
/// # Safety
/// `program` is NULL or a live program.
#[no_mangle]
pub unsafe extern "C" fn etmetal_program_reset_state(
    program: *const EtmetalProgram,
) -> EtmetalStatus {
    const F: &str = "etmetal_program_reset_state";
    status(F, || {
        // SAFETY: the caller's contract.
        unsafe { arg(program, F, "program") }?
            .shared
            .lock()?
            .reset_state()
    })
}

/// Write the program's counts to `*counters`.
///
/// Thread-safety: any thread, concurrently with any other call.
///
/// # Safety
/// `program` is a live program; `counters` points to a writable
/// `EtmetalProgramCounters`.
#[no_mangle]
pub unsafe extern "C" fn etmetal_program_counters(
    program: *const EtmetalProgram,
    counters: *mut EtmetalProgramCounters,
) -> EtmetalStatus {
    const F: &str = "etmetal_program_counters";
    status(F, || {
        // SAFETY: the caller's contract, for each argument.
        let program = unsafe { arg(program, F, "program") }?;
        let counters = unsafe { arg_mut(counters, F, "counters") }?;
        *counters = EtmetalProgramCounters::of(&program.shared.summary);
        Ok(())
    })
}
