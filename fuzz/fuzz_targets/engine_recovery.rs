//! Fuzz target: `engine::fuzzing::recovery`: a patched cache device image through load, check and open, on arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| engine::fuzzing::recovery(data));
