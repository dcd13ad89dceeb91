//! The monotonic clock as one `clock_gettime` (libc's, through the vDSO): what a store
//! loop reads once per turn, without `Instant`'s conversions.

/// `CLOCK_MONOTONIC` in milliseconds (0 if the call fails, which it does not for this
/// clock on Linux).
pub(crate) fn monotonic_ms() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable `timespec` for the duration of the call, and
    // CLOCK_MONOTONIC is a clock every Linux kernel has.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) } != 0 {
        return 0;
    }
    u64::try_from(now.tv_sec)
        .unwrap_or(0)
        .saturating_mul(1000)
        .saturating_add(u64::try_from(now.tv_nsec / 1_000_000).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_monotonic_clock_moves_forward_in_milliseconds() {
        let first = super::monotonic_ms();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let later = super::monotonic_ms();
        assert!(first > 0);
        assert!(later >= first + 19, "{first} then {later}");
    }
}
