//! Stable-toolchain fallback for the fuzz targets: feeds random and mutated inputs to the same
//! `nbd_proto::fuzzing` and `engine::fuzzing` entry points for a time budget. Not
//! coverage-guided; it exists so that CI exercises every decoder even where libFuzzer cannot
//! be built.
//!
//! Usage: fallback TARGET SECONDS [SEED]. Prints the seed; a panic aborts with a non-zero exit
//! and the input is printed in hex for a regression test.
//! `fallback write-seeds DIR` writes the engine targets' seeds (`engine::fuzzing::seeds`) to
//! `DIR/TARGET/seed-N`, which is how `fuzz/seeds/` was made.

use std::time::{Duration, Instant};

const INPUT_BYTES_MAX: usize = 4096;

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Valid-looking prefixes so that random tails reach deep states.
fn seeds(target: &str) -> Vec<Vec<u8>> {
    if target.starts_with("engine_") {
        let mut s = engine::fuzzing::seeds(target);
        s.push(Vec::new());
        return s;
    }
    use nbd_proto::wire;
    let mut client = vec![0u8];
    client.extend_from_slice(&3u32.to_be_bytes());
    nbd_proto::OptionRequest::StructuredReply.encode(&mut client);
    nbd_proto::OptionRequest::Go {
        name: "fuzz".into(),
        info_requests: vec![wire::INFO_BLOCK_SIZE],
    }
    .encode(&mut client);
    let mut server = vec![1u8];
    server.extend_from_slice(&wire::NBD_MAGIC.to_be_bytes());
    server.extend_from_slice(&wire::IHAVEOPT.to_be_bytes());
    server.extend_from_slice(&3u16.to_be_bytes());
    let mut request = vec![255, 0xff, 0xff, 3];
    nbd_proto::Request {
        flags: nbd_proto::CommandFlags(0),
        command: nbd_proto::Command::Write,
        cookie: 1,
        offset: 0,
        length: 512,
    }
    .encode(&mut request);
    let mut reply = Vec::new();
    nbd_proto::Chunk::error(nbd_proto::NbdErrno::Eio, "x").encode(1, true, &mut reply);
    vec![client, server, request, reply, Vec::new()]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let (Some("write-seeds"), Some(dir)) = (args.get(1).map(String::as_str), args.get(2)) {
        write_seeds(std::path::Path::new(dir));
        return;
    }
    let (Some(target), Some(seconds)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: fallback TARGET SECONDS [SEED]");
        std::process::exit(2);
    };
    let run: fn(&[u8]) = match target.as_str() {
        "server_handshake" => nbd_proto::fuzzing::server_handshake,
        "client_handshake" => nbd_proto::fuzzing::client_handshake,
        "request_decoder" => nbd_proto::fuzzing::requests,
        "reply_decoder" => nbd_proto::fuzzing::replies,
        other if engine::fuzzing::target(other).is_some() => {
            engine::fuzzing::target(other).expect("checked")
        }
        other => {
            eprintln!("unknown target {other}");
            std::process::exit(2);
        }
    };
    let seconds: u64 = seconds.parse().expect("SECONDS must be an integer");
    let seed = args
        .get(3)
        .map(|s| s.parse().expect("SEED must be an integer"))
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
                | 1
        });
    println!("fallback fuzzing {target} for {seconds}s, seed {seed}");
    let mut rng = XorShift(seed);
    let seeds = seeds(target);
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut runs = 0u64;
    let mut input = Vec::with_capacity(INPUT_BYTES_MAX);
    while Instant::now() < deadline {
        input.clear();
        input.extend_from_slice(&seeds[rng.below(seeds.len())]);
        let mutations = rng.below(8);
        for _ in 0..mutations {
            if input.is_empty() {
                break;
            }
            let at = rng.below(input.len());
            input[at] = rng.next() as u8;
        }
        let tail = rng.below(INPUT_BYTES_MAX - input.len().min(INPUT_BYTES_MAX));
        input.extend((0..tail).map(|_| rng.next() as u8));
        let result = std::panic::catch_unwind(|| run(&input));
        if result.is_err() {
            let hex: String = input.iter().map(|b| format!("{b:02x}")).collect();
            eprintln!("CRASH in {target} (seed {seed}), input hex: {hex}");
            std::process::exit(1);
        }
        runs += 1;
    }
    println!("{target}: {runs} runs, no crash");
}

fn write_seeds(dir: &std::path::Path) {
    for t in engine::fuzzing::TARGETS {
        let d = dir.join(t);
        std::fs::create_dir_all(&d).expect("creating the seed directory");
        let seeds = engine::fuzzing::seeds(t);
        for (i, s) in seeds.iter().filter(|s| !s.is_empty()).enumerate() {
            std::fs::write(d.join(format!("seed-{i}")), s).expect("writing a seed");
        }
    }
}
