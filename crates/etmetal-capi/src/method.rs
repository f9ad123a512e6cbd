//! The method handle: one method of a loaded program, with its input and
//! output specs.

use std::ffi::{c_char, CString};
use std::sync::Arc;

use etmetal_core::{Error, Result, TensorSpec};

use crate::counters::{EtmetalMethodCounters, MethodCounts};
use crate::error::{arg, arg_mut, guard, status, text, EtmetalStatus};
use crate::program::{EtmetalProgram, Loaded};
use crate::tensor::EtmetalTensorSpec;

/// One method of a program. Opaque; made by `etmetal_program_method`,
/// released by `etmetal_method_free`. It keeps what it needs of its
/// program, which may be released first.
pub struct EtmetalMethod {
    pub(crate) program: Arc<Loaded>,
    pub(crate) name: String,
    c_name: CString,
    pub(crate) inputs: Vec<(TensorSpec, EtmetalTensorSpec)>,
    pub(crate) outputs: Vec<(TensorSpec, EtmetalTensorSpec)>,
    pub(crate) counts: MethodCounts,
}

/// Each spec with its C form (`what` and the index name it in errors).
fn specs(specs: Vec<TensorSpec>, what: &str) -> Result<Vec<(TensorSpec, EtmetalTensorSpec)>> {
    specs
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            let c = EtmetalTensorSpec::of(&s, &format!("{what} {i}"))?;
            Ok((s, c))
        })
        .collect()
}

/// Method `name` of `program` (NULL: "forward"). Its delegates were
/// prepared when the program loaded: this only looks it up.
///
/// On success `*out` is the method (release it with `etmetal_method_free`);
/// on failure `*out` is NULL (an unknown name is an
/// `ETMETAL_STATUS_INVALID_INPUT` error listing the methods there are).
///
/// Thread-safety: any thread; waits for a running execute of the program.
///
/// # Safety
/// `program` is a live program; a non-null `name` is NUL-terminated; `out`
/// points to writable memory for one pointer.
#[no_mangle]
pub unsafe extern "C" fn etmetal_program_method(
    program: *const EtmetalProgram,
    name: *const c_char,
    out: *mut *mut EtmetalMethod,
) -> EtmetalStatus {
    const F: &str = "etmetal_program_method";
    status(F, || {
        // SAFETY: the caller's contract, for each argument.
        let out = unsafe { arg_mut(out, F, "out") }?;
        *out = std::ptr::null_mut();
        let program = unsafe { arg(program, F, "program") }?;
        let name = match name.is_null() {
            true => "forward",
            false => unsafe { text(name, F, "name") }?,
        };
        let shared = program.shared.clone();
        let (inputs, outputs) = {
            let model = shared.lock()?;
            (model.method_inputs(name)?, model.method_outputs(name)?)
        };
        let index = shared
            .method_names
            .iter()
            .position(|n| n.to_bytes() == name.as_bytes())
            .ok_or_else(|| Error::internal(format!("method `{name}` has no summary")))?;
        let counts = MethodCounts::of(&shared.summary.methods[index])?;
        let method = EtmetalMethod {
            c_name: shared.method_names[index].clone(),
            program: shared,
            name: name.to_string(),
            inputs: specs(inputs, "input")?,
            outputs: specs(outputs, "output")?,
            counts,
        };
        *out = Box::into_raw(Box::new(method));
        Ok(())
    })
}

/// Release `method`; NULL is ignored.
///
/// Thread-safety: not concurrently with another call on the same `method`.
///
/// # Safety
/// `method` is NULL or a method from `etmetal_program_method` not yet
/// released.
#[no_mangle]
pub unsafe extern "C" fn etmetal_method_free(method: *mut EtmetalMethod) {
    if method.is_null() {
        return;
    }
    // SAFETY: made by Box::into_raw in `etmetal_program_method`, released
    // once (the caller's contract).
    let method = unsafe { Box::from_raw(method) };
    // (the last handle of a program releases its GPU resources)
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(method)));
}

/// The method's name, owned by the method; NULL for NULL.
///
/// Thread-safety: any thread, concurrently with any other call.
///
/// # Safety
/// `method` is NULL or a live method.
#[no_mangle]
pub unsafe extern "C" fn etmetal_method_name(method: *const EtmetalMethod) -> *const c_char {
    const F: &str = "etmetal_method_name";
    guard(F, std::ptr::null(), || {
        // SAFETY: the caller's contract.
        Ok(unsafe { arg(method, F, "method") }?.c_name.as_ptr())
    })
}

/// How many inputs the method takes; 0 for NULL.
///
/// Thread-safety: any thread, concurrently with any other call.
///
/// # Safety
/// `method` is NULL or a live method.
#[no_mangle]
pub unsafe extern "C" fn etmetal_method_input_count(method: *const EtmetalMethod) -> usize {
    const F: &str = "etmetal_method_input_count";
    // SAFETY: the caller's contract.
    guard(F, 0, || {
        Ok(unsafe { arg(method, F, "method") }?.inputs.len())
    })
}

/// How many outputs the method gives; 0 for NULL.
///
/// Thread-safety: any thread, concurrently with any other call.
///
/// # Safety
/// `method` is NULL or a live method.
#[no_mangle]
pub unsafe extern "C" fn etmetal_method_output_count(method: *const EtmetalMethod) -> usize {
    const F: &str = "etmetal_method_output_count";
    // SAFETY: the caller's contract.
    guard(F, 0, || {
        Ok(unsafe { arg(method, F, "method") }?.outputs.len())
    })
}

/// Write the spec of `list`'s entry `index` (`what` names it) to `out`.
fn spec_of(
    list: &[(TensorSpec, EtmetalTensorSpec)],
    index: usize,
    what: &str,
    out: &mut EtmetalTensorSpec,
) -> Result<()> {
    let (_, c) = list.get(index).ok_or_else(|| {
        Error::invalid_input(format!(
            "{what} {index} does not exist (the method has {})",
            list.len()
        ))
    })?;
    *out = *c;
    Ok(())
}

/// Write input `index`'s spec (dtype, shape with each dynamic dim's upper
/// bound, which dims are dynamic, bytes at the bound) to `*spec`.
///
/// Thread-safety: any thread, concurrently with any other call.
///
/// # Safety
/// `method` is a live method; `spec` points to a writable
/// `EtmetalTensorSpec`.
#[no_mangle]
pub unsafe extern "C" fn etmetal_method_input_spec(
    method: *const EtmetalMethod,
    index: usize,
    spec: *mut EtmetalTensorSpec,
) -> EtmetalStatus {
    const F: &str = "etmetal_method_input_spec";
    status(F, || {
        // SAFETY: the caller's contract, for each argument.
        let method = unsafe { arg(method, F, "method") }?;
        let spec = unsafe { arg_mut(spec, F, "spec") }?;
        spec_of(&method.inputs, index, "input", spec)
    })
}

/// Write output `index`'s spec to `*spec`, as `etmetal_method_input_spec`
/// does. A dynamic output's `nbytes` is what a buffer needs to hold it at
/// any size.
///
/// Thread-safety: any thread, concurrently with any other call.
///
/// # Safety
/// `method` is a live method; `spec` points to a writable
/// `EtmetalTensorSpec`.
#[no_mangle]
pub unsafe extern "C" fn etmetal_method_output_spec(
    method: *const EtmetalMethod,
    index: usize,
    spec: *mut EtmetalTensorSpec,
) -> EtmetalStatus {
    const F: &str = "etmetal_method_output_spec";
    status(F, || {
        // SAFETY: the caller's contract, for each argument.
        let method = unsafe { arg(method, F, "method") }?;
        let spec = unsafe { arg_mut(spec, F, "spec") }?;
        spec_of(&method.outputs, index, "output", spec)
    })
}

/// Write the method's counts to `*counters`.
///
/// Thread-safety: any thread, concurrently with any other call.
///
/// # Safety
/// `method` is a live method; `counters` points to a writable
/// `EtmetalMethodCounters`.
#[no_mangle]
pub unsafe extern "C" fn etmetal_method_counters(
    method: *const EtmetalMethod,
    counters: *mut EtmetalMethodCounters,
) -> EtmetalStatus {
    const F: &str = "etmetal_method_counters";
    status(F, || {
        // SAFETY: the caller's contract, for each argument.
        let method = unsafe { arg(method, F, "method") }?;
        *unsafe { arg_mut(counters, F, "counters") }? = method.counts.counters();
        Ok(())
    })
}

/// The CPU operator `index` (0 to `cpu_operators` - 1, most calls first)
/// that the method calls: its name (`aten::add.out`, owned by the method)
/// in `*name` and its calls in `*calls`.
///
/// Thread-safety: any thread, concurrently with any other call.
///
/// # Safety
/// `method` is a live method; `name` and `calls` point to writable memory.
#[no_mangle]
pub unsafe extern "C" fn etmetal_method_cpu_operator(
    method: *const EtmetalMethod,
    index: usize,
    name: *mut *const c_char,
    calls: *mut usize,
) -> EtmetalStatus {
    const F: &str = "etmetal_method_cpu_operator";
    status(F, || {
        // SAFETY: the caller's contract, for each argument.
        let method = unsafe { arg(method, F, "method") }?;
        let name = unsafe { arg_mut(name, F, "name") }?;
        let calls = unsafe { arg_mut(calls, F, "calls") }?;
        let ops = method.counts.cpu_operators();
        let (op, n) = ops.get(index).ok_or_else(|| {
            Error::invalid_input(format!(
                "{F}: operator {index} does not exist (the method calls {})",
                ops.len()
            ))
        })?;
        *name = op.as_ptr();
        *calls = *n;
        Ok(())
    })
}
