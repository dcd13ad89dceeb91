//! How long a lane's waiter spins before it sleeps, learned from its own waits.
//!
//! Spinning pays when the reply (or the next request) comes within the spin: the waiter
//! catches it without a wake-up. When waits run longer (a slow handler, a slow peer),
//! the spin only burns the CPU the peer needs to answer, which on a small host slows every
//! call. So a lane keeps the share of its recent spinning waits that caught their frame
//! within the spin, and stops spinning when fewer than half did (three misses in a row
//! from a run of catches; a lone long gap, such as the pause between two bursts of calls,
//! does not turn it off). While it does not spin, every [`PROBE_EVERY`]th wait spins
//! anyway, and one that catches its frame within the spin turns spinning back on. Waits
//! that did not spin never count: their time includes the wake-up, which on a loaded
//! host can pass the spin even when the peer is quick.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

/// While not spinning, one wait in this many spins to see whether it would pay again.
const PROBE_EVERY: u32 = 16;
/// The share of spinning waits caught is kept in 1/`WHOLE`ths.
const WHOLE: u32 = 1024;
/// Spinning stops when the caught share falls below this.
const ENOUGH: u32 = WHOLE / 2;
/// Where the share starts again when a probe catches its frame.
const AFTER_PROBE: u32 = WHOLE * 3 / 4;

/// The spin of one kind of wait on one lane.
#[derive(Debug)]
pub(crate) struct AdaptiveSpin {
    /// The share of recent spinning waits that caught their frame within the spin, in
    /// 1/[`WHOLE`]ths (each new wait weighs a quarter).
    caught: AtomicU32,
    /// Whether waits stopped spinning (too few were caught).
    off: AtomicBool,
    waits: AtomicU32,
}

impl Default for AdaptiveSpin {
    fn default() -> Self {
        AdaptiveSpin {
            caught: AtomicU32::new(WHOLE),
            off: AtomicBool::new(false),
            waits: AtomicU32::new(0),
        }
    }
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
        let hit = waited <= spun;
        if self.off.load(Ordering::Relaxed) {
            // A probe: caught within the spin, spinning pays again.
            if hit {
                self.caught.store(AFTER_PROBE, Ordering::Relaxed);
                self.off.store(false, Ordering::Relaxed);
            }
            return;
        }
        let old = self.caught.load(Ordering::Relaxed);
        let share = old - old / 4 + if hit { WHOLE / 4 } else { 0 };
        // Racing recorders may lose one sample: a share needs no more.
        self.caught.store(share, Ordering::Relaxed);
        if share < ENOUGH {
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

#[cfg(test)]
#[test]
fn a_lone_long_gap_among_quick_waits_keeps_spinning_on() {
    // Bursts of 64 calls: the replies within a burst come quickly, the first of the next
    // burst after the caller's pause.
    let spin = AdaptiveSpin::default();
    for _ in 0..10 {
        for _ in 0..63 {
            assert_eq!(wait(&spin, Duration::from_micros(5)), LIMIT);
        }
        assert_eq!(
            wait(&spin, Duration::from_millis(2)),
            LIMIT,
            "the gap spun too"
        );
    }
    // Two long gaps in a row are still not enough; three are.
    wait(&spin, Duration::from_millis(2));
    wait(&spin, Duration::from_millis(2));
    assert_eq!(spin.spin(LIMIT), LIMIT);
    wait(&spin, Duration::from_millis(2));
    assert!(spin.off.load(std::sync::atomic::Ordering::Relaxed));
}
