//! Fuzz target: `engine::fuzzing::journal`: journal entries and `journal::replay` of a region, on arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| engine::fuzzing::journal(data));
