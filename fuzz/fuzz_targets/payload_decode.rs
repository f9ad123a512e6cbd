//! EtMetalBackend delegate payload bytes -> verified `Payload`; an accepted
//! payload must encode and decode to itself.
#![no_main]

use etmetal_metal::payload::Payload;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(p) = Payload::decode(data) {
        assert_eq!(Payload::decode(&p.encode()).ok().as_ref(), Some(&p));
    }
});
