//! An opt-in host trace of an execute: where the wall time of one
//! `Method::execute` goes on the host (each CPU kernel call, and inside a
//! delegate its uploads, encoding, submit, wait and read-backs), so a host
//! cost that only a full-size program on a real GPU shows is seen at once.
//!
//! Off unless the environment variable `ETMETAL_TRACE` is set (to anything
//! but `0`) or [`enable`] is called (`etmetal run --trace`). When off, a
//! [`span`] costs one relaxed atomic load. Spans are kept per thread and
//! printed by `Method::execute` to stderr at the end of the execute that
//! opened them, one line each, nested by indentation.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

/// 0: not decided yet, 1: off, 2: on.
static STATE: AtomicU8 = AtomicU8::new(0);

/// Turn tracing on for the rest of the process.
pub fn enable() {
    STATE.store(2, Ordering::Relaxed);
}

/// Run `f` with tracing on when `on` (and as before otherwise).
pub fn only_if<T>(on: bool, f: impl FnOnce() -> T) -> T {
    if !on {
        return f();
    }
    let before = enabled();
    enable();
    let out = f();
    if !before {
        STATE.store(1, Ordering::Relaxed);
    }
    out
}

/// Whether spans are recorded.
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var_os("ETMETAL_TRACE").is_some_and(|v| v != "0" && !v.is_empty());
            STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
        s => s == 2,
    }
}

struct Span {
    depth: usize,
    what: String,
    bytes: Option<u64>,
    took: Duration,
}

#[derive(Default)]
struct Recorder {
    depth: usize,
    /// Finished spans in the order they opened (a span's slot is reserved
    /// when it opens and filled when it closes).
    spans: Vec<Option<Span>>,
}

thread_local! {
    static RECORDER: RefCell<Recorder> = RefCell::new(Recorder::default());
}

/// Run `f`, recording its wall time under `what` (with the bytes it moves,
/// where it moves any) when tracing is on.
pub fn span<T>(what: impl FnOnce() -> String, bytes: Option<u64>, f: impl FnOnce() -> T) -> T {
    if !enabled() {
        return f();
    }
    let (slot, depth) = RECORDER.with(|r| {
        let mut r = r.borrow_mut();
        r.spans.push(None);
        r.depth += 1;
        (r.spans.len() - 1, r.depth - 1)
    });
    let start = Instant::now();
    let out = f();
    let took = start.elapsed();
    let what = what();
    RECORDER.with(|r| {
        let mut r = r.borrow_mut();
        r.depth -= 1;
        if let Some(s) = r.spans.get_mut(slot) {
            *s = Some(Span {
                depth,
                what,
                bytes,
                took,
            });
        }
    });
    out
}

/// The spans recorded on this thread since the last call, as text (one
/// line a span; empty when none), and forget them.
pub fn take_report() -> String {
    let spans = RECORDER.with(|r| std::mem::take(&mut r.borrow_mut().spans));
    let mut out = String::new();
    for s in spans.into_iter().flatten() {
        let bytes = match s.bytes {
            Some(b) => format!("  {b} B"),
            None => String::new(),
        };
        out.push_str(&format!(
            "trace: {:>10.3} ms  {}{}{bytes}\n",
            s.took.as_secs_f64() * 1e3,
            "  ".repeat(s.depth),
            s.what
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nested spans are reported in the order they opened, indented by
    /// depth, with their bytes; the report empties the recorder.
    #[test]
    fn spans_nest_and_report_once() {
        enable();
        span(
            || "outer".into(),
            None,
            || {
                span(|| "inner".into(), Some(42), || ());
            },
        );
        let report = take_report();
        let lines: Vec<&str> = report.lines().collect();
        assert_eq!(lines.len(), 2, "{report}");
        assert!(lines[0].ends_with(" outer"), "{report}");
        assert!(lines[1].ends_with("   inner  42 B"), "{report}");
        assert!(take_report().is_empty());
    }
}
