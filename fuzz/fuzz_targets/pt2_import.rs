//! `.pt2` (zip) bytes -> typed graph.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = etmetal_graph::import_pt2(data, "fuzz");
});
