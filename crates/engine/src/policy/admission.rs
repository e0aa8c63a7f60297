//! Admission of read misses into a full cache ([`admit_miss`]): the ghost history's rule.
//!
//! Invariant: pure; the same inputs give the same decisions.

/// Which read misses a full cache admits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Admission {
    /// A miss enters a full cache only if its block missed before within the ghost history
    /// (`admit::Ghost`, about one cache's worth of misses): one-hit wonders and one-pass scans
    /// stay out and evict nothing (2Q's ghost queue, kept as TinyLFU's sketch).
    #[default]
    Ghost,
    /// Every miss enters (bcache's rule).
    All,
}

impl Admission {
    pub const ALL: [Admission; 2] = [Admission::Ghost, Admission::All];

    pub fn name(self) -> &'static str {
        match self {
            Admission::Ghost => "ghost",
            Admission::All => "all",
        }
    }

    pub fn parse(s: &str) -> Option<Admission> {
        Self::ALL.into_iter().find(|a| a.name() == s)
    }
}

/// A measured share of miss-filled blocks read later (`fillhits`) at or above which every
/// miss of the device is admitted: its misses are local (a stream, or reads that move through
/// a region), so what one brings in is read soon, in the same pass.
pub const ADMIT_FILL_SHARE: f64 = 0.5;

/// Whether a read miss is promoted (`earlier`: the ghost history's count of the block's
/// earlier misses; `fill_share`: the device's measured share of miss-filled blocks read
/// later, None until measured). While the cache has room nothing is refused: a promotion then
/// evicts nothing, and refusing would only slow the warm-up. Nor where misses are measured to
/// be local (`ADMIT_FILL_SHARE`): the filter is for one-time reads scattered over the disk,
/// and refusing a stream's misses would refuse their fills, which the stream reads next.
pub fn admit_miss(
    policy: Admission,
    cache_full: bool,
    earlier: u8,
    fill_share: Option<f64>,
) -> bool {
    match policy {
        Admission::All => true,
        Admission::Ghost => {
            !cache_full || earlier > 0 || fill_share.is_some_and(|s| s >= ADMIT_FILL_SHARE)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_cache_admits_a_miss_only_when_it_missed_before() {
        assert!(
            admit_miss(Admission::Ghost, false, 0, None),
            "room: no eviction"
        );
        assert!(
            !admit_miss(Admission::Ghost, true, 0, None),
            "a one-hit wonder"
        );
        assert!(
            !admit_miss(Admission::Ghost, true, 0, Some(0.1)),
            "scattered misses"
        );
        assert!(
            admit_miss(Admission::Ghost, true, 0, Some(0.9)),
            "local misses"
        );
        assert!(admit_miss(Admission::Ghost, true, 1, None));
        assert!(admit_miss(Admission::All, true, 0, None));
        for a in Admission::ALL {
            assert_eq!(Admission::parse(a.name()), Some(a));
        }
    }
}
