//! How long a lane's waiter spins before it sleeps, learned from its own waits.
//!
//! Spinning pays when the reply (or the next request) comes within the spin: the waiter
//! catches it without a wake-up. When waits run longer (a Python handler, a slow peer),
//! the spin only burns the CPU the peer needs to answer, which on a small host slows every
//! call. So a lane keeps a running average of its spinning waits and stops spinning when
//! that average passes the spin. While it does not spin, every [`PROBE_EVERY`]th wait
//! spins anyway, and one that catches its frame within the spin turns spinning back on.
//! Waits that did not spin never count: their time includes the wake-up, which on a
//! loaded host can pass the spin even when the peer is quick.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// While not spinning, one wait in this many spins to see whether it would pay again.
const PROBE_EVERY: u32 = 16;
/// A wait counts as at most this long, so that one idle spell (a lane unused for minutes)
/// weighs no more than a slow call.
const LONGEST: Duration = Duration::from_millis(1);

/// The spin of one kind of wait on one lane.
#[derive(Debug, Default)]
pub(crate) struct AdaptiveSpin {
    /// The running average of the spinning waits, in nanoseconds (0: none yet).
    typical_ns: AtomicU64,
    /// Whether waits stopped spinning (their average passed the spin).
    off: AtomicBool,
    waits: AtomicU32,
}

impl AdaptiveSpin {
    /// How long the next wait spins, given the configured `limit`: `limit`, or zero
    /// while spinning is off and this wait is no probe.
    pub(crate) fn spin(&self, limit: Duration) -> Duration {
        if !self.off.load(Ordering::Relaxed) {
            return limit;
        }
        let probe = self
            .waits
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(PROBE_EVERY);
        if probe {
            limit
        } else {
            Duration::ZERO
        }
    }

    /// A wait that spun `spun` (what [`spin`](Self::spin) said) took `waited`.
    pub(crate) fn record(&self, spun: Duration, waited: Duration) {
        if spun.is_zero() {
            return;
        }
        let new = u64::try_from(waited.min(LONGEST).as_nanos()).unwrap_or(u64::MAX);
        if self.off.load(Ordering::Relaxed) {
            // A probe: caught within the spin, spinning pays again.
            if waited <= spun {
                self.typical_ns.store(new.max(1), Ordering::Relaxed);
                self.off.store(false, Ordering::Relaxed);
            }
            return;
        }
        let old = self.typical_ns.load(Ordering::Relaxed);
        let average = if old == 0 {
            new
        } else {
            old - old / 4 + new / 4
        };
        // Racing recorders may lose one sample: an average needs no more.
        self.typical_ns.store(average.max(1), Ordering::Relaxed);
        let limit = u64::try_from(spun.as_nanos()).unwrap_or(u64::MAX);
        if average > limit {
            self.off.store(true, Ordering::Relaxed);
        }
    }
}

// The tests sit at the file's level (no `use super::`, which the layering test reads
// as naming the parent).
#[cfg(test)]
const LIMIT: Duration = Duration::from_micros(50);

#[cfg(test)]
fn wait(spin: &AdaptiveSpin, took: Duration) -> Duration {
    let spun = spin.spin(LIMIT);
    // A wait that sleeps takes at least its wake-up.
    let waited = if took <= spun {
        took
    } else {
        took.max(Duration::from_micros(80))
    };
    spin.record(spun, waited);
    spun
}

#[cfg(test)]
#[test]
fn quick_peers_spin_slow_ones_do_not_but_probe() {
    let spin = AdaptiveSpin::default();
    assert_eq!(spin.spin(LIMIT), LIMIT, "no waits yet: spin");
    let quick = Duration::from_micros(8);
    assert!((0..40).all(|_| wait(&spin, quick) == LIMIT));
    let slow = Duration::from_micros(200);
    let spun = (0..PROBE_EVERY * 4 + 4)
        .filter(|_| !wait(&spin, slow).is_zero())
        .count();
    assert!(
        (4..=8).contains(&spun),
        "slow waits spin only on probes: {spun}"
    );
    // Quick again: the next probe catches its frame and spinning is back.
    for _ in 0..PROBE_EVERY {
        wait(&spin, quick);
    }
    assert!((0..40).all(|_| wait(&spin, quick) == LIMIT));
}

#[cfg(test)]
#[test]
fn sleeping_waits_with_slow_wake_ups_do_not_keep_spinning_off() {
    let spin = AdaptiveSpin::default();
    // Off after slow waits; then the peer is quick again, but each sleeping wait pays an
    // 80 µs wake-up (past the spin): only the probes count, and the first turns it on.
    for _ in 0..8 {
        wait(&spin, Duration::from_micros(300));
    }
    assert!(spin.off.load(std::sync::atomic::Ordering::Relaxed));
    for _ in 0..PROBE_EVERY {
        wait(&spin, Duration::from_micros(8));
    }
    assert!(!spin.off.load(std::sync::atomic::Ordering::Relaxed));
}

#[cfg(test)]
#[test]
fn a_zero_limit_never_spins() {
    let spin = AdaptiveSpin::default();
    spin.record(Duration::ZERO, Duration::from_micros(1));
    assert!((0..40).all(|_| spin.spin(Duration::ZERO).is_zero()));
}
