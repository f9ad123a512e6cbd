//! Running a method on the caller's buffers: inputs are read where they
//! are and outputs written where the caller wants them, each copied once,
//! between the caller's memory and the method's planned memory
//! (`etmetal::Model::execute_method_borrowed`).

use std::ffi::c_void;

use etmetal_core::{Error, Result, View};

use crate::error::{arg, null, status, EtmetalStatus};
use crate::method::EtmetalMethod;
use crate::tensor::{EtmetalDtype, ETMETAL_MAX_DIMS};

/// An input of an execute: a contiguous (C order) tensor in the caller's
/// memory, read during the call only.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EtmetalInput {
    /// Exactly the input's dtype (nothing is converted).
    pub dtype: EtmetalDtype,
    pub rank: usize,
    /// The input's shape; a dynamic dim may take any size up to its bound.
    pub shape: [usize; ETMETAL_MAX_DIMS],
    /// `nbytes` bytes, which must be what `dtype` and `shape` need; no
    /// alignment is required. May be NULL when `nbytes` is 0.
    pub data: *const c_void,
    pub nbytes: usize,
}

/// An output of an execute: the caller's buffer, and what was written to it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EtmetalOutput {
    /// Set by the caller: `capacity` writable bytes, which overlap no input
    /// and no other output (the output spec's `nbytes` always fits; no
    /// alignment is required).
    pub data: *mut c_void,
    pub capacity: usize,
    /// Written by a successful execute: the output's dtype, its actual
    /// shape (a dynamic output's size of this call) and the bytes written.
    pub dtype: EtmetalDtype,
    pub rank: usize,
    pub shape: [usize; ETMETAL_MAX_DIMS],
    pub nbytes: usize,
}

/// `len` items at `p`, NULL allowed for none.
///
/// # Safety
/// A non-null `p` points to `len` live items.
unsafe fn items<'a, T>(p: *const T, len: usize, function: &str, name: &str) -> Result<&'a [T]> {
    match (p.is_null(), len) {
        (_, 0) => Ok(&[]),
        (true, _) => Err(null(function, name)),
        // SAFETY: the caller's contract.
        (false, _) => Ok(unsafe { std::slice::from_raw_parts(p, len) }),
    }
}

/// `t` seen as a tensor (`i` names it in errors).
///
/// # Safety
/// A non-null `t.data` points to `t.nbytes` readable bytes.
unsafe fn view<'a>(i: usize, t: &'a EtmetalInput, function: &str) -> Result<View<'a>> {
    let what = format!("input {i}");
    if t.rank > ETMETAL_MAX_DIMS {
        return Err(Error::invalid_input(format!(
            "{what}: rank {}, above ETMETAL_MAX_DIMS ({ETMETAL_MAX_DIMS})",
            t.rank
        )));
    }
    let dtype = t.dtype.dtype(&what)?;
    // SAFETY: the caller's contract.
    let name = format!("inputs[{i}].data");
    let bytes = unsafe { items(t.data.cast::<u8>(), t.nbytes, function, &name) }?;
    Ok(View {
        dtype,
        shape: &t.shape[..t.rank],
        bytes,
    })
}

/// Refuse an output buffer that overlaps an input or another output: the
/// outputs are written while the inputs are still borrowed.
fn check_disjoint(inputs: &[EtmetalInput], outputs: &[EtmetalOutput]) -> Result<()> {
    let span = |p: usize, n: usize| (n > 0).then(|| p..p.saturating_add(n));
    let ins = inputs
        .iter()
        .enumerate()
        .filter_map(|(i, t)| Some((format!("input {i}"), span(t.data as usize, t.nbytes)?)));
    let outs: Vec<_> = outputs
        .iter()
        .enumerate()
        .filter_map(|(i, t)| Some((i, span(t.data as usize, t.capacity)?)))
        .collect();
    let all = ins.chain(outs.iter().map(|(i, r)| (format!("output {i}"), r.clone())));
    for (name, r) in all {
        if let Some((i, _)) = outs
            .iter()
            .find(|(i, o)| name != format!("output {i}") && o.start < r.end && r.start < o.end)
        {
            return Err(Error::invalid_input(format!(
                "output {i}: its buffer overlaps {name}'s"
            )));
        }
    }
    Ok(())
}

/// Write `view` (output `i`) into the caller's buffer `o`.
fn write_output(i: usize, view: View<'_>, o: &mut EtmetalOutput, function: &str) -> Result<()> {
    let n = view.bytes.len();
    if n > o.capacity {
        return Err(Error::invalid_input(format!(
            "output {i}: {} {:?} needs {n} bytes, its buffer has {}",
            view.dtype, view.shape, o.capacity
        )));
    }
    if view.shape.len() > ETMETAL_MAX_DIMS {
        return Err(Error::unsupported(format!(
            "output {i}: rank {}, above ETMETAL_MAX_DIMS",
            view.shape.len()
        )));
    }
    if n > 0 {
        if o.data.is_null() {
            return Err(null(function, &format!("outputs[{i}].data")));
        }
        // SAFETY: `capacity` >= n writable bytes (the caller's contract),
        // overlapping no input and no other output (checked).
        let dst = unsafe { std::slice::from_raw_parts_mut(o.data.cast::<u8>(), n) };
        etmetal_runtime::copy_bytes(dst, view.bytes);
    }
    o.dtype = EtmetalDtype::of(view.dtype);
    o.rank = view.shape.len();
    o.shape = [0; ETMETAL_MAX_DIMS];
    o.shape[..o.rank].copy_from_slice(view.shape);
    o.nbytes = n;
    Ok(())
}

/// Run `method` on `n_inputs` inputs, writing its `n_outputs` outputs into
/// the caller's buffers. Inputs must match the input specs in count, dtype
/// (exactly: nothing is converted), shape (a dynamic dim up to its bound)
/// and bytes; `n_outputs` must be the output count, and each buffer hold
/// its output (a static output's size is checked before anything runs, a
/// dynamic output's once it is known). Each input is copied once into the
/// method's memory and each output once out of it; the GPU delegates run
/// in the same call. State (mutable buffers) carries over to the next
/// execute of any method of the program (`etmetal_program_reset_state`).
///
/// On failure (`ETMETAL_STATUS_INVALID_INPUT` for wrong arguments) the
/// outputs' buffers and fields are unspecified.
///
/// Thread-safety: any thread. Executes of methods of one program take
/// turns (they share its state and memory); different programs run in
/// parallel.
///
/// # Safety
/// `method` is a live method; `inputs` points to `n_inputs` inputs whose
/// `data` point to `nbytes` readable bytes, and `outputs` to `n_outputs`
/// writable outputs whose `data` point to `capacity` writable bytes (either
/// array may be NULL when its count is 0).
#[no_mangle]
pub unsafe extern "C" fn etmetal_method_execute(
    method: *const EtmetalMethod,
    inputs: *const EtmetalInput,
    n_inputs: usize,
    outputs: *mut EtmetalOutput,
    n_outputs: usize,
) -> EtmetalStatus {
    const F: &str = "etmetal_method_execute";
    status(F, || {
        // SAFETY: the caller's contract, for each argument.
        let method = unsafe { arg(method, F, "method") }?;
        let inputs = unsafe { items(inputs, n_inputs, F, "inputs") }?;
        unsafe { items(outputs.cast_const(), n_outputs, F, "outputs") }?;
        let outputs: &mut [EtmetalOutput] = match n_outputs {
            0 => &mut [],
            // SAFETY: non-null (checked above), `n_outputs` writable items.
            _ => unsafe { std::slice::from_raw_parts_mut(outputs, n_outputs) },
        };
        let views = inputs
            .iter()
            .enumerate()
            // SAFETY: the caller's contract for each input's data.
            .map(|(i, t)| unsafe { view(i, t, F) })
            .collect::<Result<Vec<_>>>()?;
        if outputs.len() != method.outputs.len() {
            return Err(Error::invalid_input(format!(
                "method `{}` gives {} output(s), {} given",
                method.name,
                method.outputs.len(),
                outputs.len()
            )));
        }
        for (i, (o, (spec, c))) in outputs.iter().zip(&method.outputs).enumerate() {
            if !spec.is_dynamic() && o.capacity < c.nbytes {
                return Err(Error::invalid_input(format!(
                    "output {i}: {} {} needs {} bytes, its buffer has {}",
                    spec.dtype,
                    spec.shape_text(),
                    c.nbytes,
                    o.capacity
                )));
            }
        }
        check_disjoint(inputs, outputs)?;
        let mut model = method.program.lock()?;
        model.execute_method_borrowed(&method.name, &views, &mut |i, view| {
            let o = outputs
                .get_mut(i)
                .ok_or_else(|| Error::internal(format!("output {i} beyond the method's")))?;
            write_output(i, view, o, F)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(data: &[u8]) -> EtmetalInput {
        EtmetalInput {
            dtype: crate::tensor::ETMETAL_DTYPE_UINT8,
            rank: 1,
            shape: [data.len(); ETMETAL_MAX_DIMS],
            data: data.as_ptr().cast(),
            nbytes: data.len(),
        }
    }

    fn output(data: &mut [u8]) -> EtmetalOutput {
        EtmetalOutput {
            data: data.as_mut_ptr().cast(),
            capacity: data.len(),
            dtype: EtmetalDtype(0),
            rank: 0,
            shape: [0; ETMETAL_MAX_DIMS],
            nbytes: 0,
        }
    }

    #[test]
    fn overlapping_output_buffers_are_refused() {
        let mut a = [0u8; 16];
        let b = [0u8; 8];
        assert!(check_disjoint(&[input(&b)], &[output(&mut a[..8])]).is_ok());
        let mut whole = output(&mut a);
        let first = output(&mut a[..4]);
        let e = check_disjoint(&[], &[first, whole])
            .unwrap_err()
            .to_string();
        assert!(e.contains("overlaps output"), "{e}");
        whole.capacity = 0;
        assert!(check_disjoint(&[], &[first, whole]).is_ok());
        let e = check_disjoint(&[input(&a[2..6])], &[first])
            .unwrap_err()
            .to_string();
        assert_eq!(e, "output 0: its buffer overlaps input 0's");
    }

    #[test]
    fn an_output_too_large_for_its_buffer_is_refused() {
        let mut small = [0u8; 3];
        let mut o = output(&mut small);
        let v = View {
            dtype: etmetal_core::DType::U8,
            shape: &[4],
            bytes: &[1, 2, 3, 4],
        };
        let e = write_output(0, v, &mut o, "f").unwrap_err().to_string();
        assert_eq!(e, "output 0: uint8 [4] needs 4 bytes, its buffer has 3");
        let mut big = [0u8; 6];
        let mut o = output(&mut big);
        write_output(1, v, &mut o, "f").unwrap();
        assert_eq!((o.rank, o.shape[0], o.nbytes), (1, 4, 4));
        assert_eq!(big, [1, 2, 3, 4, 0, 0]);
    }
}
