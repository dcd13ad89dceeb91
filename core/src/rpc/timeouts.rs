//! `rpc_timeout`: which pending call expires next, in virtual time.
//!
//! PyTorch's agent keeps `timeoutMap_` (expiry time → calls) and a thread that sleeps
//! until the earliest expiry, then fails those calls with "RPC ran for more than set
//! timeout ({ms} ms) and will now be marked with an error" (`kRpcTimeoutErrorStr`). A call
//! whose timeout is 0 never expires and is not tracked; a call sent without a timeout
//! uses the agent's default (60 s); a response or a pipe error removes the call.
//!
//! [`TimeoutQueue`] is that map without the thread: the runtime [`insert`]s a call with
//! its deadline, [`cancel`]s it when the response arrives, sleeps until
//! [`next_deadline`] and then drains [`poll_expired`]. Cancellation is lazy: a cancelled
//! or rescheduled call leaves a stale heap entry that is skipped when it surfaces, and the
//! heap is rebuilt when stale entries outnumber live ones, so memory stays proportional
//! to the calls in flight. Calls with equal deadlines expire in id order (message ids
//! grow, so that is send order, as in PyTorch's per-expiry vector).
//!
//! There is no clock here. Time is an [`Instant`]: nanoseconds since an epoch the caller
//! picks (process start, a test's zero), so tests run in virtual time.
//!
//! [`insert`]: TimeoutQueue::insert
//! [`cancel`]: TimeoutQueue::cancel
//! [`next_deadline`]: TimeoutQueue::next_deadline
//! [`poll_expired`]: TimeoutQueue::poll_expired

use alloc::collections::{BTreeMap, BinaryHeap};
use core::cmp::Reverse;
use core::fmt;
use core::time::Duration;

/// A point in time: nanoseconds since an epoch chosen by the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Instant {
    nanos: u64,
}

impl Instant {
    /// The epoch.
    pub const ZERO: Instant = Instant { nanos: 0 };

    /// `nanos` nanoseconds after the epoch.
    pub const fn from_nanos(nanos: u64) -> Instant {
        Instant { nanos }
    }

    /// `since_epoch` after the epoch, saturating at about 584 years.
    pub fn from_duration(since_epoch: Duration) -> Instant {
        Instant {
            nanos: u64::try_from(since_epoch.as_nanos()).unwrap_or(u64::MAX),
        }
    }

    /// Nanoseconds since the epoch.
    pub const fn as_nanos(self) -> u64 {
        self.nanos
    }

    /// This instant plus `d`, saturating at the end of time.
    pub fn saturating_add(self, d: Duration) -> Instant {
        Instant {
            nanos: self
                .nanos
                .saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
        }
    }

    /// How long after `earlier` this is (zero if it is not after).
    pub fn saturating_duration_since(self, earlier: Instant) -> Duration {
        Duration::from_nanos(self.nanos.saturating_sub(earlier.nanos))
    }
}

/// PyTorch's default RPC timeout, `kDefaultRpcTimeoutSeconds` (60 s).
pub const DEFAULT_RPC_TIMEOUT: Duration = Duration::from_secs(60);

/// PyTorch's `kUnsetRpcTimeout`: a per-call timeout of -1 s means "the agent's default".
pub const UNSET_RPC_TIMEOUT_SECS: f32 = -1.0;

/// How long a call may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RpcTimeout {
    /// It never expires (a timeout of 0).
    Never,
    /// It expires this long after it was sent.
    After(Duration),
}

/// A timeout that is negative (other than "unset") or not a number: "RPC Timeout must be
/// non-negative".
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NegativeTimeout {
    /// The value given, in seconds.
    pub seconds: f32,
}

impl fmt::Display for NegativeTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RPC Timeout must be non-negative")
    }
}

#[cfg(feature = "std")]
impl std::error::Error for NegativeTimeout {}

impl RpcTimeout {
    /// The agent default, 60 s.
    pub const DEFAULT: RpcTimeout = RpcTimeout::After(DEFAULT_RPC_TIMEOUT);

    /// A timeout of `d`; zero means [`RpcTimeout::Never`].
    pub fn from_duration(d: Duration) -> RpcTimeout {
        if d.is_zero() {
            RpcTimeout::Never
        } else {
            RpcTimeout::After(d)
        }
    }

    /// A timeout given in seconds, as PyTorch takes it: truncated to whole milliseconds
    /// (`static_cast<int>(seconds * 1000)`); 0 (or less than a millisecond) means never.
    ///
    /// # Errors
    /// [`NegativeTimeout`] for a negative or NaN value.
    pub fn from_secs_f32(seconds: f32) -> Result<RpcTimeout, NegativeTimeout> {
        if seconds.is_nan() || seconds < 0.0 {
            return Err(NegativeTimeout { seconds });
        }
        let millis = seconds * 1000.0;
        // `as` saturates for floats too large for u64.
        Ok(RpcTimeout::from_duration(Duration::from_millis(
            millis as u64,
        )))
    }

    /// The timeout of one call: `seconds` if given, the agent's `default` for PyTorch's
    /// "unset" value (-1).
    ///
    /// # Errors
    /// [`NegativeTimeout`] for any other negative value or NaN.
    pub fn for_call(seconds: f32, default: RpcTimeout) -> Result<RpcTimeout, NegativeTimeout> {
        if seconds == UNSET_RPC_TIMEOUT_SECS {
            Ok(default)
        } else {
            RpcTimeout::from_secs_f32(seconds)
        }
    }

    /// When a call sent at `now` expires; `None` for [`RpcTimeout::Never`].
    pub fn deadline(self, now: Instant) -> Option<Instant> {
        match self {
            RpcTimeout::Never => None,
            RpcTimeout::After(d) => Some(now.saturating_add(d)),
        }
    }

    /// The error a call with this timeout fails with when it expires.
    pub fn error(self) -> RpcTimeoutError {
        RpcTimeoutError {
            timeout_ms: match self {
                RpcTimeout::Never => 0,
                RpcTimeout::After(d) => u64::try_from(d.as_millis()).unwrap_or(u64::MAX),
            },
        }
    }
}

/// A call ran past its timeout: "RPC ran for more than set timeout ({ms} ms) and will now
/// be marked with an error".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RpcTimeoutError {
    /// The call's timeout, in milliseconds.
    pub timeout_ms: u64,
}

impl fmt::Display for RpcTimeoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RPC ran for more than set timeout ({} ms) and will now be marked with an error",
            self.timeout_ms
        )
    }
}

#[cfg(feature = "std")]
impl std::error::Error for RpcTimeoutError {}

/// Pending calls ordered by deadline, with lazy cancellation. `Id` is the call's
/// identifier (PyTorch's message id, a `u64`).
#[derive(Debug, Clone)]
pub struct TimeoutQueue<Id = u64> {
    heap: BinaryHeap<Reverse<(Instant, Id)>>,
    live: BTreeMap<Id, Instant>,
}

impl<Id: Ord + Copy> Default for TimeoutQueue<Id> {
    fn default() -> Self {
        Self::new()
    }
}

/// Rebuild the heap once it holds more than this many stale entries beyond twice the
/// live ones.
const COMPACT_SLACK: usize = 64;

impl<Id: Ord + Copy> TimeoutQueue<Id> {
    /// An empty queue.
    pub const fn new() -> Self {
        TimeoutQueue {
            heap: BinaryHeap::new(),
            live: BTreeMap::new(),
        }
    }

    /// Tracks `id`, expiring at `deadline`. If `id` was tracked already its deadline is
    /// replaced; the previous one is returned.
    pub fn insert(&mut self, id: Id, deadline: Instant) -> Option<Instant> {
        let previous = self.live.insert(id, deadline);
        self.heap.push(Reverse((deadline, id)));
        if previous.is_some() {
            self.maybe_compact();
        }
        previous
    }

    /// Tracks `id` sent at `now` with `timeout`; a call that never expires is not tracked
    /// (and any earlier deadline of `id` is dropped). Returns the deadline.
    pub fn schedule(&mut self, id: Id, now: Instant, timeout: RpcTimeout) -> Option<Instant> {
        match timeout.deadline(now) {
            Some(deadline) => {
                self.insert(id, deadline);
                Some(deadline)
            }
            None => {
                self.cancel(id);
                None
            }
        }
    }

    /// Stops tracking `id` (its response arrived, or its pipe failed). Returns whether it
    /// was tracked.
    pub fn cancel(&mut self, id: Id) -> bool {
        let was = self.live.remove(&id).is_some();
        if was {
            self.maybe_compact();
        }
        was
    }

    /// Whether `id` is tracked.
    pub fn contains(&self, id: Id) -> bool {
        self.live.contains_key(&id)
    }

    /// `id`'s deadline.
    pub fn deadline_of(&self, id: Id) -> Option<Instant> {
        self.live.get(&id).copied()
    }

    /// How many calls are tracked.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// Whether no call is tracked.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    fn is_stale(&self, deadline: Instant, id: Id) -> bool {
        self.live.get(&id) != Some(&deadline)
    }

    fn drop_stale_top(&mut self) {
        while let Some(&Reverse((deadline, id))) = self.heap.peek() {
            if self.is_stale(deadline, id) {
                self.heap.pop();
            } else {
                break;
            }
        }
    }

    fn maybe_compact(&mut self) {
        if self.heap.len() > 2 * self.live.len() + COMPACT_SLACK {
            self.heap = self
                .live
                .iter()
                .map(|(&id, &deadline)| Reverse((deadline, id)))
                .collect();
        }
    }

    /// The earliest deadline of a tracked call: sleep until then. `None` when nothing is
    /// tracked (sleep until a call is inserted).
    pub fn next_deadline(&mut self) -> Option<Instant> {
        self.drop_stale_top();
        self.heap.peek().map(|Reverse((deadline, _))| *deadline)
    }

    /// The next call whose deadline is at or before `now`, no longer tracked; `None` when
    /// no call has expired. Call until `None` after each wake-up.
    pub fn poll_expired(&mut self, now: Instant) -> Option<Id> {
        self.drop_stale_top();
        match self.heap.peek() {
            Some(&Reverse((deadline, id))) if deadline <= now => {
                self.heap.pop();
                self.live.remove(&id);
                self.maybe_compact();
                Some(id)
            }
            _ => None,
        }
    }

    /// The number of heap entries, stale ones included (for tests of the compaction
    /// bound).
    pub fn heap_len(&self) -> usize {
        self.heap.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;
    use alloc::vec::Vec;
    use proptest::prelude::*;

    const MS: u64 = 1_000_000;

    fn at(ms: u64) -> Instant {
        Instant::from_nanos(ms * MS)
    }

    #[test]
    fn pytorch_timeout_values() {
        assert_eq!(
            RpcTimeout::DEFAULT,
            RpcTimeout::After(Duration::from_secs(60))
        );
        assert_eq!(RpcTimeout::from_secs_f32(0.0), Ok(RpcTimeout::Never));
        assert_eq!(RpcTimeout::from_secs_f32(0.0004), Ok(RpcTimeout::Never));
        assert_eq!(
            RpcTimeout::from_secs_f32(1.5),
            Ok(RpcTimeout::After(Duration::from_millis(1500)))
        );
        assert_eq!(
            RpcTimeout::for_call(-1.0, RpcTimeout::DEFAULT),
            Ok(RpcTimeout::DEFAULT)
        );
        assert_eq!(
            RpcTimeout::for_call(2.0, RpcTimeout::DEFAULT),
            Ok(RpcTimeout::After(Duration::from_secs(2)))
        );
        let e = RpcTimeout::for_call(-2.0, RpcTimeout::DEFAULT).unwrap_err();
        assert_eq!(e.to_string(), "RPC Timeout must be non-negative");
        assert!(RpcTimeout::from_secs_f32(f32::NAN).is_err());
        assert!(matches!(
            RpcTimeout::from_secs_f32(f32::INFINITY),
            Ok(RpcTimeout::After(_))
        ));
        assert_eq!(RpcTimeout::from_duration(Duration::ZERO), RpcTimeout::Never);
        assert_eq!(RpcTimeout::Never.deadline(at(5)), None);
        assert_eq!(
            RpcTimeout::After(Duration::from_millis(10)).deadline(at(5)),
            Some(at(15))
        );
        assert_eq!(
            RpcTimeout::After(Duration::MAX).deadline(at(5)),
            Some(Instant::from_nanos(u64::MAX))
        );
    }

    #[test]
    fn timeout_error_text_is_pytorchs() {
        assert_eq!(
            RpcTimeout::After(Duration::from_millis(1500))
                .error()
                .to_string(),
            "RPC ran for more than set timeout (1500 ms) and will now be marked with an error"
        );
    }

    #[test]
    fn instants() {
        assert_eq!(Instant::from_duration(Duration::from_millis(3)), at(3));
        assert_eq!(
            Instant::from_duration(Duration::MAX),
            Instant::from_nanos(u64::MAX)
        );
        assert_eq!(
            at(10).saturating_duration_since(at(4)),
            Duration::from_millis(6)
        );
        assert_eq!(at(4).saturating_duration_since(at(10)), Duration::ZERO);
        assert_eq!(Instant::ZERO.as_nanos(), 0);
    }

    #[test]
    fn expires_in_deadline_then_id_order() {
        let mut q = TimeoutQueue::new();
        assert_eq!(q.next_deadline(), None);
        q.insert(5, at(30));
        q.insert(3, at(10));
        q.insert(9, at(10));
        q.insert(1, at(20));
        assert_eq!(q.next_deadline(), Some(at(10)));
        assert_eq!(q.poll_expired(at(9)), None);
        // A deadline equal to now has expired (PyTorch: now >= expiry).
        assert_eq!(q.poll_expired(at(10)), Some(3));
        assert_eq!(q.poll_expired(at(10)), Some(9));
        assert_eq!(q.poll_expired(at(10)), None);
        assert_eq!(q.next_deadline(), Some(at(20)));
        assert_eq!(q.poll_expired(at(100)), Some(1));
        assert_eq!(q.poll_expired(at(100)), Some(5));
        assert_eq!(q.poll_expired(at(100)), None);
        assert!(q.is_empty());
    }

    #[test]
    fn cancelled_and_rescheduled_calls() {
        let mut q = TimeoutQueue::new();
        q.insert(1, at(10));
        q.insert(2, at(20));
        assert!(q.cancel(1));
        assert!(!q.cancel(1));
        assert_eq!(q.next_deadline(), Some(at(20)));
        assert_eq!(q.insert(2, at(5)), Some(at(20)));
        assert_eq!(q.deadline_of(2), Some(at(5)));
        assert_eq!(q.poll_expired(at(5)), Some(2));
        // The stale entry at 20 never surfaces.
        assert_eq!(q.poll_expired(at(50)), None);
        assert_eq!(q.next_deadline(), None);
        // Timeout 0 is never tracked, and drops an earlier deadline.
        q.insert(4, at(1));
        assert_eq!(q.schedule(4, at(0), RpcTimeout::Never), None);
        assert!(!q.contains(4));
        assert_eq!(
            q.schedule(6, at(2), RpcTimeout::After(Duration::from_millis(3))),
            Some(at(5))
        );
        assert_eq!(q.len(), 1);
    }

    #[test]
    fn stale_entries_stay_bounded() {
        let mut q = TimeoutQueue::new();
        for id in 0..10_000u64 {
            q.insert(id, at(id));
            q.cancel(id);
            assert!(q.heap_len() <= 2 * q.len() + COMPACT_SLACK + 1);
        }
        for id in 0..100u64 {
            q.insert(id, at(1000));
        }
        for round in 0..1000u64 {
            q.insert(round % 100, at(2000 + round));
            assert!(q.heap_len() <= 2 * q.len() + COMPACT_SLACK + 1);
        }
        assert_eq!(q.len(), 100);
    }

    #[test]
    fn many_calls_in_virtual_time() {
        // 1000 calls sent 1 ms apart with 50 ms timeouts; every third answered after 20 ms.
        let mut q = TimeoutQueue::new();
        let mut expired = Vec::new();
        for t in 0..1100u64 {
            let now = at(t);
            if t < 1000 {
                q.schedule(t, now, RpcTimeout::After(Duration::from_millis(50)));
            }
            if t >= 20 && (t - 20) % 3 == 0 && t - 20 < 1000 {
                assert!(q.cancel(t - 20));
            }
            while let Some(id) = q.poll_expired(now) {
                assert_eq!(id + 50, t, "expired exactly at its deadline");
                expired.push(id);
            }
        }
        let expected: Vec<u64> = (0..1000).filter(|id| id % 3 != 0).collect();
        assert_eq!(expired, expected);
        assert!(q.is_empty());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u8, u16),
        Cancel(u8),
        Poll(u16),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (any::<u8>(), 0u16..200).prop_map(|(id, d)| Op::Insert(id % 32, d)),
            any::<u8>().prop_map(|id| Op::Cancel(id % 32)),
            (0u16..200).prop_map(Op::Poll),
        ]
    }

    proptest! {
        #[test]
        fn agrees_with_a_sorted_model(ops in proptest::collection::vec(op(), 0..300)) {
            let mut q = TimeoutQueue::new();
            let mut model: BTreeMap<u8, Instant> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Insert(id, d) => {
                        prop_assert_eq!(q.insert(id, at(d.into())), model.insert(id, at(d.into())));
                    }
                    Op::Cancel(id) => {
                        prop_assert_eq!(q.cancel(id), model.remove(&id).is_some());
                    }
                    Op::Poll(now) => {
                        let now = at(now.into());
                        loop {
                            let expected = model
                                .iter()
                                .map(|(&id, &d)| (d, id))
                                .min()
                                .filter(|&(d, _)| d <= now)
                                .map(|(_, id)| id);
                            let got = q.poll_expired(now);
                            prop_assert_eq!(got, expected);
                            match got {
                                Some(id) => { model.remove(&id); }
                                None => break,
                            }
                        }
                    }
                }
                prop_assert_eq!(q.len(), model.len());
                prop_assert_eq!(q.next_deadline(), model.values().min().copied());
                prop_assert!(q.heap_len() <= 2 * q.len() + COMPACT_SLACK + 1);
            }
        }
    }
}
