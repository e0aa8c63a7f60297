//! Property tests: every decoder survives arbitrary bytes (the same entry points the fuzz
//! targets use), and request headers survive an encode/decode round trip.

use nbd_proto::fuzzing;
use nbd_proto::{Command, CommandFlags, Decoded, Request};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn server_handshake_never_panics(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        fuzzing::server_handshake(&data);
    }

    #[test]
    fn client_handshake_never_panics(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        fuzzing::client_handshake(&data);
    }

    #[test]
    fn request_decoder_never_panics(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        fuzzing::requests(&data);
    }

    #[test]
    fn reply_decoder_never_panics(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        fuzzing::replies(&data);
    }

    #[test]
    fn request_round_trips(flags: u16, kind: u16, cookie: u64, offset: u64, length: u32) {
        let req = Request { flags: CommandFlags(flags), command: Command::from_wire(kind), cookie, offset, length };
        let mut buf = Vec::new();
        req.encode(&mut buf);
        prop_assert_eq!(Request::decode(&buf), Ok(Decoded::Done { value: req, consumed: 28 }));
    }
}

/// Structured prefixes reach deeper states than uniform noise: a valid greeting/flags followed
/// by random option bytes.
#[test]
fn handshakes_survive_noise_after_valid_prefix() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    for _ in 0..2000 {
        let mut data = vec![7u8, 0, 0, 0, 3];
        data.extend_from_slice(&nbd_proto::wire::IHAVEOPT.to_be_bytes());
        data.extend_from_slice(&rng.gen_range(0u32..12).to_be_bytes());
        let len = rng.gen_range(0u32..64);
        data.extend_from_slice(&len.to_be_bytes());
        data.extend((0..rng.gen_range(0..96)).map(|_| rng.gen::<u8>()));
        fuzzing::server_handshake(&data);
    }
}
