//! Little-endian encoding helpers for on-disk records, the checksummed record frame, and the
//! check of cached data blocks against their checksums.
//!
//! Invariants: every integer on disk is fixed-width little-endian; `Reader` never panics on
//! short or hostile input (every accessor returns `Option`); a framed record is
//! `magic(8) version(4) crc(4) seq(8) payload_len(8) payload` with the crc32c computed over the
//! whole frame with the crc field zeroed, so a torn or flipped byte anywhere is detected; a
//! cached block's checksum is the crc32c of its bytes alone (`first_bad_block`: what a hit,
//! GC and writeback check what they read from the cache device against).

pub const FRAME_HEADER_BYTES: usize = 32;

/// Appends little-endian values to a byte vector.
#[derive(Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn bytes(&mut self, v: &[u8]) {
        self.buf.extend_from_slice(v);
    }
    /// A string stored in a fixed-size, zero-padded field (truncated at a char boundary).
    pub fn fixed_str(&mut self, s: &str, width: usize) {
        let mut end = s.len().min(width);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.buf.extend_from_slice(&s.as_bytes()[..end]);
        self.buf.extend(std::iter::repeat_n(0u8, width - end));
    }
}

/// Reads little-endian values from a byte slice; `None` when the input is too short.
pub struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Reader { data, pos: 0 }
    }
    pub fn remaining(&self) -> usize {
        self.data.len() - self.pos
    }
    pub fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.data.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }
    pub fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    pub fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    }
    pub fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
    }
    pub fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N).map(|b| b.try_into().unwrap())
    }
    /// A string of `width` bytes, NUL-padded. Bytes that are not UTF-8 read as one `?` each
    /// (not U+FFFD, three bytes long), so the string is never longer than the field and
    /// writing it back reads back the same string.
    pub fn fixed_str(&mut self, width: usize) -> Option<String> {
        let b = self.take(width)?;
        let end = b.iter().position(|&c| c == 0).unwrap_or(width);
        let mut s = String::with_capacity(end);
        for chunk in b[..end].utf8_chunks() {
            s.push_str(chunk.valid());
            s.extend(std::iter::repeat_n('?', chunk.invalid().len()));
        }
        Some(s)
    }
}

/// Builds a checksummed frame around `payload`.
pub fn frame(magic: &[u8; 8], version: u32, seq: u64, payload: &[u8]) -> Vec<u8> {
    let mut w = Writer::default();
    w.bytes(magic);
    w.u32(version);
    w.u32(0); // crc placeholder
    w.u64(seq);
    w.u64(payload.len() as u64);
    w.bytes(payload);
    let crc = crc32c::crc32c(&w.buf);
    w.buf[12..16].copy_from_slice(&crc.to_le_bytes());
    w.buf
}

/// What a frame header claims, before the payload is checked.
pub struct FrameHeader {
    pub version: u32,
    pub seq: u64,
    pub payload_len: u64,
}

/// Parses a frame header; `None` if the magic does not match or the input is short.
pub fn frame_header(magic: &[u8; 8], data: &[u8]) -> Option<FrameHeader> {
    let mut r = Reader::new(data);
    if r.take(8)? != magic {
        return None;
    }
    let version = r.u32()?;
    let _crc = r.u32()?;
    let seq = r.u64()?;
    let payload_len = r.u64()?;
    Some(FrameHeader {
        version,
        seq,
        payload_len,
    })
}

/// Validates a whole frame (magic, version, length, crc) and returns `(seq, payload)`.
pub fn unframe<'a>(
    magic: &[u8; 8],
    version: u32,
    data: &'a [u8],
) -> Result<(u64, &'a [u8]), String> {
    let h = frame_header(magic, data).ok_or("bad magic")?;
    if h.version != version {
        return Err(format!(
            "unsupported version {} (expected {version})",
            h.version
        ));
    }
    let total = (FRAME_HEADER_BYTES as u64)
        .checked_add(h.payload_len)
        .filter(|&t| t <= data.len() as u64)
        .ok_or("length field exceeds the region")? as usize;
    let stored = u32::from_le_bytes(data[12..16].try_into().unwrap());
    // The crc field counts as zero; computed in pieces so a big frame is never copied.
    let crc = crc32c::crc32c(&data[..12]);
    let crc = crc32c::crc32c_append(crc, &[0; 4]);
    if crc32c::crc32c_append(crc, &data[16..total]) != stored {
        return Err("checksum mismatch".into());
    }
    Ok((h.seq, &data[FRAME_HEADER_BYTES..total]))
}

/// Rounds `v` up to a multiple of `align` (a power of two or any positive number).
pub fn round_up(v: u64, align: u64) -> u64 {
    v.div_ceil(align) * align
}

/// The first block of `data` (whole blocks of `bs` bytes) whose crc32c is not its entry in
/// `crcs`. Call it with no lock held.
pub(crate) fn first_bad_block(data: &[u8], crcs: &[u32], bs: u64) -> Option<u32> {
    debug_assert_eq!(data.len() as u64, crcs.len() as u64 * bs);
    data.chunks_exact(bs as usize)
        .zip(crcs)
        .position(|(d, &c)| crc32c::crc32c(d) != c)
        .map(|i| i as u32)
}

#[cfg(test)]
mod tests {
    /// A fixed string with bytes that are not UTF-8 (a corrupt or hostile header) reads the
    /// same after being written back: the fuzzer's backing-header round trip found U+FFFD
    /// replacements growing past the field and being cut.
    #[test]
    fn a_fixed_string_of_invalid_utf8_round_trips() {
        let mut field = vec![0xE0u8; 60];
        field.extend_from_slice(b"ok\xff\0");
        let s = Reader::new(&field).fixed_str(64).unwrap();
        assert_eq!(s.len(), 63, "one ? per byte that is not UTF-8");
        assert!(s.ends_with("ok?"));
        let mut w = Writer::default();
        w.fixed_str(&s, 64);
        assert_eq!(Reader::new(&w.buf).fixed_str(64).unwrap(), s);
    }

    use super::*;

    #[test]
    fn frame_round_trip_and_every_flip_detected() {
        let f = frame(b"TESTMAGC", 3, 42, b"hello world");
        let (seq, p) = unframe(b"TESTMAGC", 3, &f).unwrap();
        assert_eq!((seq, p), (42, &b"hello world"[..]));
        for i in 0..f.len() {
            let mut g = f.clone();
            g[i] ^= 0x10;
            assert!(
                unframe(b"TESTMAGC", 3, &g).is_err(),
                "flip at {i} undetected"
            );
        }
        assert!(unframe(b"TESTMAGC", 4, &f).is_err());
        assert!(unframe(b"TESTMAGC", 3, &f[..f.len() - 1]).is_err());
    }

    #[test]
    fn reader_short_input_is_none() {
        let mut r = Reader::new(&[1, 2, 3]);
        assert_eq!(r.u32(), None);
        assert_eq!(r.u8(), Some(1));
        assert_eq!(r.u64(), None);
    }
}
