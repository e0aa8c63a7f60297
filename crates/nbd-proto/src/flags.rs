//! Transmission flags, command flags, export capabilities and block-size constraints.
//!
//! Owns: the computation of the 16-bit transmission flags from what an export can do
//! ([`ExportCaps::transmission_flags`]).
//!
//! Invariants: `HAS_FLAGS` is always set; `SEND_DF` is set only when structured replies were
//! negotiated; `SEND_FAST_ZERO` only together with `SEND_WRITE_ZEROES`.
//!
//! Fault model: pure values, no failure modes.

/// Transmission flags sent with the export size (a 16-bit set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TransmissionFlags(pub u16);

impl TransmissionFlags {
    pub const HAS_FLAGS: u16 = 1 << 0;
    pub const READ_ONLY: u16 = 1 << 1;
    pub const SEND_FLUSH: u16 = 1 << 2;
    pub const SEND_FUA: u16 = 1 << 3;
    pub const ROTATIONAL: u16 = 1 << 4;
    pub const SEND_TRIM: u16 = 1 << 5;
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    pub const SEND_DF: u16 = 1 << 7;
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    pub const SEND_CACHE: u16 = 1 << 10;
    pub const SEND_FAST_ZERO: u16 = 1 << 11;

    pub fn contains(self, flag: u16) -> bool {
        self.0 & flag == flag
    }
}

/// Command flags of a request (a 16-bit set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CommandFlags(pub u16);

impl CommandFlags {
    pub const FUA: u16 = 1 << 0;
    pub const NO_HOLE: u16 = 1 << 1;
    pub const DF: u16 = 1 << 2;
    pub const REQ_ONE: u16 = 1 << 3;
    pub const FAST_ZERO: u16 = 1 << 4;

    pub fn contains(self, flag: u16) -> bool {
        self.0 & flag == flag
    }
}

/// What an export supports; the server advertises exactly this.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExportCaps {
    pub read_only: bool,
    pub flush: bool,
    pub fua: bool,
    pub trim: bool,
    pub write_zeroes: bool,
    /// Write-zeroes with `FAST_ZERO` fails fast with `ENOTSUP` when zeroing would be slow.
    pub fast_zero: bool,
    pub cache: bool,
    /// Flush and FUA are visible across all connections to the export.
    pub multi_conn: bool,
    pub rotational: bool,
}

impl ExportCaps {
    /// Everything on: a writable, non-rotational export that takes every command.
    pub const ALL: ExportCaps = ExportCaps {
        read_only: false,
        flush: true,
        fua: true,
        trim: true,
        write_zeroes: true,
        fast_zero: true,
        cache: true,
        multi_conn: true,
        rotational: false,
    };

    /// The transmission flags to advertise, given whether structured replies were negotiated.
    pub fn transmission_flags(&self, structured_replies: bool) -> TransmissionFlags {
        let mut flags = TransmissionFlags::HAS_FLAGS;
        let mut set = |cond: bool, flag: u16| {
            if cond {
                flags |= flag;
            }
        };
        set(self.read_only, TransmissionFlags::READ_ONLY);
        set(self.flush, TransmissionFlags::SEND_FLUSH);
        set(self.fua, TransmissionFlags::SEND_FUA);
        set(self.rotational, TransmissionFlags::ROTATIONAL);
        set(self.trim, TransmissionFlags::SEND_TRIM);
        set(self.write_zeroes, TransmissionFlags::SEND_WRITE_ZEROES);
        set(structured_replies, TransmissionFlags::SEND_DF);
        set(self.multi_conn, TransmissionFlags::CAN_MULTI_CONN);
        set(self.cache, TransmissionFlags::SEND_CACHE);
        set(
            self.write_zeroes && self.fast_zero,
            TransmissionFlags::SEND_FAST_ZERO,
        );
        TransmissionFlags(flags)
    }
}

/// Block size constraints (`NBD_INFO_BLOCK_SIZE`), in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockSize {
    pub min: u32,
    pub preferred: u32,
    pub max: u32,
}

impl BlockSize {
    /// The constraints tiercache advertises: 512-byte sectors, 4 KiB preferred, 32 MiB payloads.
    pub const TIERCACHE: BlockSize = BlockSize {
        min: 512,
        preferred: 4096,
        max: 32 * 1024 * 1024,
    };

    /// Checks the spec's rules: powers of two, `min <= preferred`, `min <= max`, `min <= 64 KiB`,
    /// `preferred >= 512`, and `max` a multiple of `min`.
    pub fn is_valid(&self) -> bool {
        self.min.is_power_of_two()
            && self.preferred.is_power_of_two()
            && self.min <= 65536
            && self.preferred >= 512
            && self.min <= self.preferred
            && self.min <= self.max
            && self.max.is_multiple_of(self.min)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps() -> ExportCaps {
        ExportCaps::ALL
    }

    #[test]
    fn flags_follow_caps() {
        let f = caps().transmission_flags(true);
        for flag in [
            TransmissionFlags::HAS_FLAGS,
            TransmissionFlags::SEND_FLUSH,
            TransmissionFlags::SEND_FUA,
            TransmissionFlags::SEND_TRIM,
            TransmissionFlags::SEND_WRITE_ZEROES,
            TransmissionFlags::SEND_FAST_ZERO,
            TransmissionFlags::SEND_CACHE,
            TransmissionFlags::CAN_MULTI_CONN,
            TransmissionFlags::SEND_DF,
        ] {
            assert!(f.contains(flag), "missing {flag:#x}");
        }
        assert!(!f.contains(TransmissionFlags::READ_ONLY));
        assert!(!f.contains(TransmissionFlags::ROTATIONAL));
        let simple = caps().transmission_flags(false);
        assert!(!simple.contains(TransmissionFlags::SEND_DF));
        let ro = ExportCaps {
            read_only: true,
            rotational: true,
            write_zeroes: false,
            ..caps()
        }
        .transmission_flags(false);
        assert!(ro.contains(TransmissionFlags::READ_ONLY | TransmissionFlags::ROTATIONAL));
        assert!(!ro.contains(TransmissionFlags::SEND_FAST_ZERO));
    }

    #[test]
    fn block_size_rules() {
        assert!(BlockSize::TIERCACHE.is_valid());
        let bad = BlockSize {
            min: 3,
            preferred: 4096,
            max: 4096,
        };
        assert!(!bad.is_valid());
    }
}
