//! Fuzz target: `engine::fuzzing::backing_header`: `BackingHeader::decode` and `BackingHeader::read`, on arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| engine::fuzzing::backing_header(data));
