//! Fuzz target: `engine::fuzzing::checkpoint`: checkpoint header and body chunks, then `checkpoint::load`, on arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| engine::fuzzing::checkpoint(data));
