//! Helpers shared by the blockdev tests that run real NBD servers. Invariant: a missing
//! external tool fails the test under `CI=true` and is a printed skip otherwise.

/// Whether nbdkit is installed (panics under `CI=true` when it is not).
pub fn have_nbdkit() -> bool {
    test_support::have("nbdkit")
}
