//! Statuses, the thread's last error, and the guard every entry point runs
//! in: no panic crosses the boundary, and each call either succeeds (the
//! last error cleared) or records what failed.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use etmetal_core::{Error, ErrorKind, Result};

/// What a call came to: `ETMETAL_STATUS_OK`, or the kind of its error
/// (the kinds of etmetal's errors, which decide the `etmetal` command's
/// exit code: `etmetal_status_exit_code`).
///
/// An `int32_t`, so that any value a caller passes back is defined;
/// `etmetal_status_name` names the known ones.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EtmetalStatus(pub i32);

/// Success.
pub const ETMETAL_STATUS_OK: EtmetalStatus = EtmetalStatus(0);
/// Reading a file failed (missing, unreadable).
pub const ETMETAL_STATUS_IO: EtmetalStatus = EtmetalStatus(1);
/// A malformed file or buffer: truncated, wrong identifier, out-of-range index.
pub const ETMETAL_STATUS_FORMAT: EtmetalStatus = EtmetalStatus(2);
/// A valid program etmetal cannot run here (an operator, a delegate, a GPU the
/// program needs and this machine lacks).
pub const ETMETAL_STATUS_UNSUPPORTED: EtmetalStatus = EtmetalStatus(3);
/// Wrong arguments: a null pointer, an input's count, dtype, shape or size,
/// an output buffer too small, an unknown method or device name.
pub const ETMETAL_STATUS_INVALID_INPUT: EtmetalStatus = EtmetalStatus(4);
/// A shape or dtype in the program disagrees with what an operator makes.
pub const ETMETAL_STATUS_SHAPE: EtmetalStatus = EtmetalStatus(5);
/// A resource limit (memory, a GPU limit) would be exceeded.
pub const ETMETAL_STATUS_LIMIT: EtmetalStatus = EtmetalStatus(6);
/// A bug in etmetal (a panic caught at the boundary included) or a failure of
/// the device.
pub const ETMETAL_STATUS_INTERNAL: EtmetalStatus = EtmetalStatus(7);

/// Each error kind's status and name.
const KINDS: [(ErrorKind, EtmetalStatus, &CStr); 7] = [
    (ErrorKind::Io, ETMETAL_STATUS_IO, c"io"),
    (ErrorKind::Format, ETMETAL_STATUS_FORMAT, c"format"),
    (
        ErrorKind::Unsupported,
        ETMETAL_STATUS_UNSUPPORTED,
        c"unsupported",
    ),
    (
        ErrorKind::InvalidInput,
        ETMETAL_STATUS_INVALID_INPUT,
        c"invalid_input",
    ),
    (ErrorKind::Shape, ETMETAL_STATUS_SHAPE, c"shape"),
    (ErrorKind::Limit, ETMETAL_STATUS_LIMIT, c"limit"),
    (ErrorKind::Internal, ETMETAL_STATUS_INTERNAL, c"internal"),
];

impl EtmetalStatus {
    fn of(kind: ErrorKind) -> EtmetalStatus {
        KINDS
            .iter()
            .find(|k| k.0 == kind)
            .map_or(ETMETAL_STATUS_INTERNAL, |k| k.1)
    }

    fn kind(self) -> Option<ErrorKind> {
        KINDS.iter().find(|k| k.1 == self).map(|k| k.0)
    }
}

struct LastError {
    status: EtmetalStatus,
    message: CString,
}

thread_local! {
    static LAST: RefCell<Option<LastError>> = const { RefCell::new(None) };
}

// (`try_with`: a call from a thread-local destructor of the caller's, after
// ours is gone, records nothing rather than panicking)
fn record(status: EtmetalStatus, message: String) -> EtmetalStatus {
    // (a message is one line of text; an interior NUL would cut it short)
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    let _ = LAST.try_with(|l| *l.borrow_mut() = Some(LastError { status, message }));
    status
}

fn clear() {
    let _ = LAST.try_with(|l| *l.borrow_mut() = None);
}

fn last_status() -> EtmetalStatus {
    LAST.try_with(|l| l.borrow().as_ref().map_or(ETMETAL_STATUS_OK, |e| e.status))
        .unwrap_or(ETMETAL_STATUS_OK)
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

/// Run entry point `function`'s body: its value, or the status of its
/// error (or of its panic, an internal error), recorded for the thread.
fn run<T>(function: &str, body: impl FnOnce() -> Result<T>) -> Result<T, EtmetalStatus> {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(value)) => {
            clear();
            Ok(value)
        }
        Ok(Err(e)) => Err(record(EtmetalStatus::of(e.kind()), e.to_string())),
        Err(payload) => Err(record(
            ETMETAL_STATUS_INTERNAL,
            format!(
                "{function}: internal error (a panic in etmetal): {}",
                panic_text(payload.as_ref())
            ),
        )),
    }
}

/// [`run`] for an entry point that returns a value: `failed` on failure.
pub(crate) fn guard<T>(function: &str, failed: T, body: impl FnOnce() -> Result<T>) -> T {
    run(function, body).unwrap_or(failed)
}

/// [`run`] for an entry point that returns its status.
pub(crate) fn status(function: &str, body: impl FnOnce() -> Result<()>) -> EtmetalStatus {
    run(function, body).map_or_else(|s| s, |()| ETMETAL_STATUS_OK)
}

/// The error for a null argument `name` of `function`.
pub(crate) fn null(function: &str, name: &str) -> Error {
    Error::invalid_input(format!("{function}: argument `{name}` is null"))
}

/// `*p`, or the error naming a null `p`.
///
/// # Safety
/// A non-null `p` points to a live `T` for `'a`.
pub(crate) unsafe fn arg<'a, T>(p: *const T, function: &str, name: &str) -> Result<&'a T> {
    // SAFETY: the caller's contract.
    unsafe { p.as_ref() }.ok_or_else(|| null(function, name))
}

/// `*p` for writing, or the error naming a null `p`.
///
/// # Safety
/// A non-null `p` points to a live `T` for `'a`, used by nothing else.
pub(crate) unsafe fn arg_mut<'a, T>(p: *mut T, function: &str, name: &str) -> Result<&'a mut T> {
    // SAFETY: the caller's contract.
    unsafe { p.as_mut() }.ok_or_else(|| null(function, name))
}

/// A NUL-terminated UTF-8 argument, or the error naming what is wrong.
///
/// # Safety
/// A non-null `p` points to a NUL-terminated string that lives for `'a`.
pub(crate) unsafe fn text<'a>(p: *const c_char, function: &str, name: &str) -> Result<&'a str> {
    if p.is_null() {
        return Err(null(function, name));
    }
    // SAFETY: non-null and NUL-terminated (the caller's contract).
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| Error::invalid_input(format!("{function}: argument `{name}` is not UTF-8")))
}

/// The status of this thread's last failed call, `ETMETAL_STATUS_OK` when
/// the last call succeeded (every function but these two clears it on
/// success and sets it on failure).
///
/// Thread-safety: any thread; each thread has its own last error.
#[no_mangle]
pub extern "C" fn etmetal_last_error_status() -> EtmetalStatus {
    catch_unwind(last_status).unwrap_or(ETMETAL_STATUS_INTERNAL)
}

/// The message of this thread's last failed call (one line naming the
/// file, method, input or argument at fault), or "" when the last call
/// succeeded. The string belongs to the library and stays valid until the
/// next call of an etmetal function on this thread.
///
/// Thread-safety: any thread; each thread has its own last error.
#[no_mangle]
pub extern "C" fn etmetal_last_error_message() -> *const c_char {
    catch_unwind(|| {
        LAST.try_with(|l| {
            l.borrow()
                .as_ref()
                .map_or(c"".as_ptr(), |e| e.message.as_ptr())
        })
    })
    .ok()
    .and_then(|m| m.ok())
    .unwrap_or(c"".as_ptr())
}

/// The exit code the `etmetal` command gives for `status`: 0 for
/// `ETMETAL_STATUS_OK`, 1 for `ETMETAL_STATUS_INTERNAL` (and unknown
/// values), 2 for the others (bad input).
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn etmetal_status_exit_code(status: EtmetalStatus) -> c_int {
    match status.kind() {
        _ if status == ETMETAL_STATUS_OK => 0,
        // the command's rule: bad input 2, internal failure 1
        Some(kind) if Error::new(kind, String::new()).is_user_error() => 2,
        _ => 1,
    }
}

/// The name of `status` ("ok", "io", "format", "unsupported",
/// "invalid_input", "shape", "limit", "internal"; "unknown" otherwise), a
/// static string.
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn etmetal_status_name(status: EtmetalStatus) -> *const c_char {
    let name = match status {
        ETMETAL_STATUS_OK => c"ok",
        _ => KINDS
            .iter()
            .find(|k| k.1 == status)
            .map_or(c"unknown", |k| k.2),
    };
    name.as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message() -> String {
        // SAFETY: a NUL-terminated string owned by the thread's last error.
        unsafe { CStr::from_ptr(etmetal_last_error_message()) }
            .to_str()
            .unwrap()
            .to_string()
    }

    #[test]
    fn a_panic_becomes_an_internal_error_and_success_clears_it() {
        let s = status("etmetal_test", || panic!("boom {}", 7));
        assert_eq!(s, ETMETAL_STATUS_INTERNAL);
        assert_eq!(etmetal_last_error_status(), ETMETAL_STATUS_INTERNAL);
        let m = message();
        assert!(m.contains("etmetal_test") && m.contains("boom 7"), "{m}");
        assert_eq!(status("etmetal_test", || Ok(())), ETMETAL_STATUS_OK);
        assert_eq!(etmetal_last_error_status(), ETMETAL_STATUS_OK);
        assert_eq!(message(), "");
    }

    #[test]
    fn kinds_map_to_statuses_and_exit_codes_as_the_cli_does() {
        let s = status("f", || Err(Error::format("bad magic").context("m.pte")));
        assert_eq!(s, ETMETAL_STATUS_FORMAT);
        assert_eq!(message(), "m.pte: bad magic");
        for (kind, want) in [
            (ErrorKind::Io, 2),
            (ErrorKind::Format, 2),
            (ErrorKind::Unsupported, 2),
            (ErrorKind::InvalidInput, 2),
            (ErrorKind::Shape, 2),
            (ErrorKind::Limit, 2),
            (ErrorKind::Internal, 1),
        ] {
            let e = Error::new(kind, "x");
            assert_eq!(
                etmetal_status_exit_code(EtmetalStatus::of(kind)),
                want,
                "{kind:?}"
            );
            assert_eq!(want == 2, e.is_user_error(), "{kind:?}");
        }
        assert_eq!(etmetal_status_exit_code(ETMETAL_STATUS_OK), 0);
        assert_eq!(etmetal_status_exit_code(EtmetalStatus(99)), 1);
        // SAFETY: static strings.
        let name = |s| unsafe { CStr::from_ptr(etmetal_status_name(s)) };
        assert_eq!(name(ETMETAL_STATUS_INVALID_INPUT), c"invalid_input");
        assert_eq!(name(EtmetalStatus(-3)), c"unknown");
    }

    #[test]
    fn null_and_non_utf8_arguments_are_named() {
        let e = unsafe { text(std::ptr::null(), "etmetal_f", "path") }.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        assert_eq!(e.to_string(), "etmetal_f: argument `path` is null");
        let bad = c"\xff\xfe";
        let e = unsafe { text(bad.as_ptr(), "etmetal_f", "device") }.unwrap_err();
        assert!(e.to_string().contains("`device` is not UTF-8"), "{e}");
    }
}
