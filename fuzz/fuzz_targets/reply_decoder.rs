//! Fuzz target: `nbd_proto::fuzzing::replies` on arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nbd_proto::fuzzing::replies(data));
