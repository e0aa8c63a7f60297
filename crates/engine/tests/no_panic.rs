//! Property tests: the engine's on-disk decoders and recovery survive arbitrary bytes (the
//! same entry points the fuzz targets in `fuzz/` use, see `engine::fuzzing`), from uniform
//! noise and from valid seeds with mutations; plus the inputs fuzzing found, as regressions.

use engine::fuzzing;
use proptest::prelude::*;

/// A seed of `target` (picked by `pick`) with `flips` applied (position modulo the length,
/// then xor) and `tail` appended.
fn mutated(target: &str, pick: usize, flips: &[(usize, u8)], tail: &[u8]) -> Vec<u8> {
    let seeds = fuzzing::seeds(target);
    let mut input = seeds[pick % seeds.len()].clone();
    for &(at, x) in flips {
        if !input.is_empty() {
            let n = input.len();
            input[at % n] ^= x;
        }
    }
    input.extend_from_slice(tail);
    input
}

fn noise() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..1024)
}

fn flips() -> impl Strategy<Value = Vec<(usize, u8)>> {
    proptest::collection::vec((any::<usize>(), 1u8..), 0..6)
}

fn tail() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..64)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn decoders_never_panic_on_noise(data in noise()) {
        for t in fuzzing::TARGETS {
            fuzzing::target(t).unwrap()(&data);
        }
    }

    #[test]
    fn superblock_never_panics(pick: usize, f in flips(), t in tail()) {
        fuzzing::superblock(&mutated("engine_superblock", pick, &f, &t));
    }

    #[test]
    fn backing_header_never_panics(pick: usize, f in flips(), t in tail()) {
        fuzzing::backing_header(&mutated("engine_backing_header", pick, &f, &t));
    }

    #[test]
    fn checkpoint_never_panics(pick: usize, f in flips(), t in tail()) {
        fuzzing::checkpoint(&mutated("engine_checkpoint", pick, &f, &t));
    }

    #[test]
    fn journal_never_panics(pick: usize, f in flips(), t in tail()) {
        fuzzing::journal(&mutated("engine_journal", pick, &f, &t));
    }

    #[test]
    fn recovery_never_panics(pick: usize, f in flips(), t in tail()) {
        fuzzing::recovery(&mutated("engine_recovery", pick, &f, &t));
    }
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Found by the fallback runner on `engine_superblock`: a framed superblock whose data
/// region end overflows (`Layout::validate` added the offsets unchecked).
#[test]
fn regression_superblock_data_end_overflow() {
    let input = hex(concat!(
        "005e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5eddbddddddddddddddddddddddddddddd00b00300f600000000",
        "100000004000000800000000a0030000000000002000000000005c006000000000000000400000000000",
        "e900a0000000000000000001000000000000a0013b0000000001000000050000000000bc0000f1536500",
        "00000066757a7a000000000000004c000000000000000000000000000000000000000000000000000000",
        "00000000000000000000000000000000000000000000000000",
    ));
    fuzzing::superblock(&input);
}

/// Found by the fallback runner on `engine_checkpoint` and `engine_recovery`: a checkpoint
/// header whose device table names a device id past `MAX_DEVS` loaded (here a third device,
/// 300, is added to the table).
#[test]
fn regression_checkpoint_device_id_out_of_range() {
    let seed = fuzzing::seeds("engine_checkpoint")[0].clone();
    let split = usize::from(u16::from_le_bytes([seed[1], seed[2]]));
    let mut header = seed[3..3 + split].to_vec();
    // The header payload: journal position and sequence (16), bucket and device counts
    // (4 + 4), chunks and body bytes (16), then the device table (20 bytes a device).
    header[20..24].copy_from_slice(&3u32.to_le_bytes());
    let mut dev = 300u32.to_le_bytes().to_vec();
    dev.extend_from_slice(&[0x33; 16]);
    header.splice(80..80, dev);
    let mut input = vec![seed[0]];
    input.extend_from_slice(&(header.len() as u16).to_le_bytes());
    input.extend_from_slice(&header);
    input.extend_from_slice(&seed[3 + split..]);
    fuzzing::checkpoint(&input);
}

/// Found by cargo fuzz on `engine_backing_header`: a framed header claiming nearly 2^64 data
/// bytes (`BackingHeader::read` added the data offset unchecked).
#[test]
fn regression_backing_header_data_end_overflow() {
    let input = hex(concat!(
        "06a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a05e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e002000000000000000",
        "e0ffffffffffff00000000000000000000e0ffffffffffff000000000000000000000000000000000000",
        "000000000000000000000000000000000000000000000000000000000000000000000000000000000000",
        "00000000000000000000000000",
    ));
    fuzzing::backing_header(&input);
}
