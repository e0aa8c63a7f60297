//! Fuzz target: `engine::fuzzing::superblock`: `Superblock::decode` and `Superblock::read`, on arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| engine::fuzzing::superblock(data));
