//! One store engine shared by several event loops, and the wake-ups that cross between
//! them.
//!
//! Each loop owns its connections and runs their requests to completion itself: it
//! locks the engine, applies the requests it has, and unlocks. A request's engine work
//! is a hash lookup, so the lock is held for microseconds. A wake-up the engine owes a
//! connection of another loop goes into that loop's inbox *while the lock is held*, and
//! a loop empties its own inbox first thing each time it takes the lock: so a
//! connection's wake-up always goes out before the reply to any request it sends later
//! (a `CANCEL_WAIT` racing a `SET` on another loop sees `STOP_WAITING` first, as on one
//! loop). A loop whose inbox went from empty to non-empty is woken once, after the
//! unlock, however many wake-ups it was handed in that turn; the common case (the
//! woken connection is the one that sent the request, or lives on the same loop)
//! crosses nothing.
//!
//! This module does no socket I/O and decides nothing about requests: [`serve_turn`],
//! the step both loops take for a connection with input, hands its bytes to the core
//! serve step (`rdzv_core::store::session`) through `session::serve_requests`, and routes
//! the wake-ups it returns as values; [`Serving`] is what a loop serves with (its index,
//! the engine, the round, `now`, the wake-ups it has to deliver), so that both loops
//! serve a connection, take their inbox and let a connection leave with one call each.
//! It also holds the server's clock origin, from which each turn tells the engine `now`.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use rdzv_core::store::budget::Budget;
use rdzv_core::store::engine::Engine;
use rdzv_core::store::session as step;
use rdzv_core::store::ConnId;

use super::session::{self, ConnInput, Round, Served, Throttle, Turn};
use super::StatsCells;
use rdzv_core::store::access::AccessPolicy;

/// Most loops a server can run: a connection id keeps its loop in 8 bits.
pub(super) const MAX_LOOPS: usize = 256;

/// Bits of a connection id that hold its slot in its loop's table.
const SLOT_BITS: u32 = 24;
/// Most connections one loop can hold at once.
pub(super) const MAX_SLOTS: usize = 1 << SLOT_BITS;

/// A connection id: the slot in the low 24 bits, the loop in the next 8, and a
/// per-loop sequence number above, so that a wake-up for a connection that is gone
/// never reaches the next occupant of its slot.
pub(super) fn conn_id(loop_index: usize, slot: usize, seq: u32) -> ConnId {
    ConnId(
        (u64::from(seq) << 32)
            | ((loop_index as u64 & 0xff) << SLOT_BITS)
            | (slot as u64 & (MAX_SLOTS as u64 - 1)),
    )
}

/// The loop a connection id belongs to.
pub(super) fn loop_of(id: ConnId) -> usize {
    ((id.0 >> SLOT_BITS) & 0xff) as usize
}

/// The slot of a connection id in its loop's table.
pub(super) fn slot_of(id: ConnId) -> usize {
    (id.0 & (MAX_SLOTS as u64 - 1)) as usize
}

/// How a loop is woken when its inbox gets wake-ups.
pub(super) trait LoopWaker: Send + Sync {
    /// Makes the loop's next (or current) wait return.
    fn wake(&self) -> io::Result<()>;
}

/// A wake-up byte owed to a connection.
pub(super) type Wake = (ConnId, u8);

struct Locked {
    engine: Engine,
    /// Wake-ups routed to each loop by the others, in the order the engine owed them.
    inboxes: Vec<Vec<Wake>>,
}

/// The engine behind its lock, the loops' inboxes and their wakers.
pub(super) struct SharedEngine {
    locked: Mutex<Locked>,
    /// The clock origin: `now` for the engine is milliseconds since this.
    started_ms: u64,
    wakers: Vec<Box<dyn LoopWaker>>,
    stats: Arc<StatsCells>,
}

/// What a loop may do with the other loops while it holds the engine.
pub(super) struct Router<'a> {
    me: usize,
    inboxes: &'a mut [Vec<Wake>],
    /// Loops to wake after the unlock.
    to_wake: &'a mut ToWake,
}

/// The loops a turn routed wake-ups to (bit i of word i / 64), woken after the unlock;
/// `any` spares a turn that routed none the look at every word.
#[derive(Default)]
struct ToWake {
    any: bool,
    bits: [u64; MAX_LOOPS / 64],
}

impl Router<'_> {
    /// Moves the wake-ups other loops routed here into `into` (which it leaves in the
    /// order they were owed, after what `into` held).
    pub(super) fn take_inbox(&mut self, into: &mut Vec<Wake>) {
        if let Some(inbox) = self.inboxes.get_mut(self.me) {
            if inbox.is_empty() {
                return;
            }
            if into.is_empty() {
                std::mem::swap(inbox, into);
            } else {
                into.append(inbox);
            }
        }
    }

    /// Hands out the wake-ups a serve step returned (none for `requester`, whose own
    /// went into its output): those for other connections of this loop into `local`, the
    /// rest into their loop's inbox (that loop is woken after the unlock).
    fn route_values(&mut self, wakes: &mut Vec<step::Wake>, local: &mut Vec<Wake>) {
        if wakes.is_empty() {
            return;
        }
        for (target, wake) in wakes.drain(..) {
            self.send(target, wake as u8, local);
        }
    }

    fn send(&mut self, target: ConnId, byte: u8, local: &mut Vec<Wake>) {
        let owner = loop_of(target);
        if owner == self.me {
            local.push((target, byte));
        } else if let Some(inbox) = self.inboxes.get_mut(owner) {
            if inbox.is_empty() {
                self.to_wake.any = true;
                self.to_wake.bits[owner / 64] |= 1 << (owner % 64);
            }
            inbox.push((target, byte));
        }
    }

    /// Hands out every wake-up the engine owes: those for `requester` go into `own`,
    /// those for other connections of this loop into `local`, the rest into their
    /// loop's inbox (that loop is woken after the unlock).
    pub(super) fn route(
        &mut self,
        engine: &mut Engine,
        requester: ConnId,
        own: &mut Vec<u8>,
        local: &mut Vec<Wake>,
    ) {
        while let Some((target, wake)) = engine.poll_wakeup() {
            let byte = wake as u8;
            if target == requester {
                own.push(byte);
                continue;
            }
            self.send(target, byte, local);
        }
    }
}

/// One loop's turn for one connection, the same on io_uring and epoll: with the engine
/// locked, first the wake-ups other loops routed here (those for this connection onto
/// its output at once, so they go out before any reply decided after them; the rest
/// left in `wakes`), then the connection's whole requests through the core serve step.
/// Wake-ups it owes this loop's other connections are appended to `wakes`, after those:
/// the caller delivers `wakes`, in order, to its connections.
#[inline]
pub(super) fn serve_turn(
    shared: &SharedEngine,
    me: usize,
    mut conn: ConnInput<'_>,
    inbox: &mut Vec<Wake>,
    turn: &mut Turn<'_>,
) -> Served {
    let id = conn.session.id();
    shared.turn(me, |engine, router| {
        router.take_inbox(inbox);
        let before = conn.out.len();
        if !inbox.is_empty() {
            let out = &mut *conn.out;
            inbox.retain(|&(target, byte)| {
                let mine = target == id;
                if mine {
                    out.push(byte);
                }
                !mine
            });
        }
        let from_inbox = conn.out.len() - before;
        conn.owed = conn.owed.saturating_add(from_inbox);
        let mut wakes = Vec::new();
        let served = session::serve_requests(engine, conn, &mut wakes, turn);
        router.route_values(&mut wakes, inbox);
        // The wake-ups put on its output count as produced too.
        Served {
            produced: served.produced + from_inbox,
            ..served
        }
    })
}

/// What a loop serves its connections with, the same on io_uring and epoll: its index,
/// the shared engine, its counters, its log of refusals, the round's account, the `now`
/// its requests are served at, and the wake-ups being handed to its connections (each
/// loop's `deliver` empties [`Serving::wakes`] into them).
pub(super) struct Serving {
    /// The loop's index: its connection ids carry it.
    pub(super) index: usize,
    pub(super) shared: Arc<SharedEngine>,
    pub(super) stats: Arc<StatsCells>,
    /// Per-connection warnings, rate-limited.
    pub(super) warnings: Throttle,
    /// Reply bytes produced this round, against the cap.
    pub(super) round: Round,
    /// When this round began, in the engine's milliseconds.
    pub(super) now_ms: u64,
    /// Wake-ups for this loop's connections, in the order they were owed.
    pub(super) wakes: Vec<Wake>,
}

impl Serving {
    pub(super) fn new(index: usize, shared: Arc<SharedEngine>, stats: Arc<StatsCells>) -> Self {
        Serving {
            index,
            shared,
            stats,
            warnings: Throttle::default(),
            round: Round::default(),
            now_ms: 0,
            wakes: Vec::new(),
        }
    }

    /// One connection's turn ([`serve_turn`]), counted in the round: what it did, and
    /// whether the connection is light now. The wake-ups it owes this loop's other
    /// connections are left in [`Serving::wakes`].
    pub(super) fn serve(&mut self, conn: ConnInput<'_>) -> (Served, bool) {
        let mut turn = Turn {
            now_ms: self.now_ms,
            metrics: self.stats.metrics.as_ref(),
            warnings: &mut self.warnings,
        };
        let served = serve_turn(&self.shared, self.index, conn, &mut self.wakes, &mut turn);
        let light = self.round.count(&served);
        (served, light)
    }

    /// Moves the wake-ups other loops routed here into [`Serving::wakes`].
    pub(super) fn take_inbox(&mut self) {
        let wakes = &mut self.wakes;
        self.shared
            .turn(self.index, |_, router| router.take_inbox(wakes));
    }

    /// Takes connection `id` out of the engine (its waiters go); the wake-ups that
    /// releases for this loop's connections are left in [`Serving::wakes`].
    pub(super) fn leave(&mut self, id: ConnId) {
        let wakes = &mut self.wakes;
        let mut own = Vec::new();
        self.shared.turn(self.index, |engine, router| {
            engine.disconnect(id);
            router.route(engine, id, &mut own, wakes);
        });
    }
}

/// A free slot in a loop's connection table: a freed one, or a new one at the end;
/// `None` (with a warning) when loop `me` holds [`MAX_SLOTS`] connections already.
pub(super) fn free_slot<C>(
    free: &mut Vec<usize>,
    conns: &mut Vec<Option<C>>,
    me: usize,
) -> Option<usize> {
    if let Some(slot) = free.pop() {
        return Some(slot);
    }
    if conns.len() < MAX_SLOTS {
        conns.push(None);
        return Some(conns.len() - 1);
    }
    tracing::warn!("store loop {me} holds {MAX_SLOTS} connections; refusing more");
    None
}

impl SharedEngine {
    /// An empty engine for `wakers.len()` loops (loop i is woken by `wakers[i]`).
    pub(super) fn new(
        wakers: Vec<Box<dyn LoopWaker>>,
        stats: Arc<StatsCells>,
        budget: Budget,
    ) -> SharedEngine {
        let loops = wakers.len();
        SharedEngine {
            locked: Mutex::new(Locked {
                engine: Engine::with_budget(budget),
                inboxes: (0..loops).map(|_| Vec::new()).collect(),
            }),
            started_ms: crate::sys::clock::monotonic_ms(),
            wakers,
            stats,
        }
    }

    /// Milliseconds since the server started, read now: what each turn gives the engine
    /// (a loop reads it at most once per turn). One read of the monotonic clock, without
    /// `Instant`'s conversions.
    pub(super) fn clock_ms(&self) -> u64 {
        crate::sys::clock::monotonic_ms().saturating_sub(self.started_ms)
    }

    /// Runs `f` with the engine locked, on behalf of loop `me`; then publishes the
    /// engine's counts, unlocks, and wakes the loops that `f` routed wake-ups to.
    /// At accept: whether a peer at `peer` may connect under `policy`. A refused one is
    /// counted (`STATS`) and logged through `warnings` (rate-limited); the caller closes
    /// it.
    pub(super) fn admit(
        &self,
        me: usize,
        policy: &AccessPolicy,
        peer: std::net::IpAddr,
        warnings: &mut Throttle,
    ) -> bool {
        let Err(refusal) = policy.admit(peer) else {
            return true;
        };
        self.turn(me, |engine, _| {
            engine.count_refusal(&refusal);
            // No request follows to publish the count: `--metrics` sees it now.
            if let Some(metrics) = &self.stats.metrics {
                metrics.publish(engine.stats());
            }
        });
        if let Some(suppressed) = warnings.allow(std::time::Instant::now()) {
            tracing::warn!(%peer, reason = %refusal, suppressed, "refusing store connection");
        }
        false
    }

    pub(super) fn turn<R>(
        &self,
        me: usize,
        f: impl FnOnce(&mut Engine, &mut Router<'_>) -> R,
    ) -> R {
        let mut to_wake = ToWake::default();
        let result = {
            // A panic while locked cannot leave the engine half-updated in a way that
            // matters more than stopping the server would; keep serving.
            let mut guard = self.locked.lock().unwrap_or_else(|p| p.into_inner());
            let Locked { engine, inboxes } = &mut *guard;
            let mut router = Router {
                me,
                inboxes,
                to_wake: &mut to_wake,
            };
            let result = f(engine, &mut router);
            self.stats
                .waiters
                .store(engine.waiter_count(), Ordering::Relaxed);
            self.stats.keys.store(engine.num_keys(), Ordering::Relaxed);
            result
        };
        if !to_wake.any {
            return result;
        }
        for (word, bits) in to_wake.bits.iter().enumerate() {
            let mut bits = *bits;
            while bits != 0 {
                let index = word * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                if let Some(waker) = self.wakers.get(index) {
                    if let Err(error) = waker.wake() {
                        tracing::error!(%error, loop_index = index, "cannot wake a store loop");
                    }
                }
            }
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use rdzv_core::store::{Request, VALIDATION_MAGIC};

    use super::*;

    #[test]
    fn conn_ids_carry_loop_and_slot() {
        for loop_index in [0usize, 1, 15, 255] {
            for slot in [0usize, 1, 4095, MAX_SLOTS - 1] {
                for seq in [0u32, 1, u32::MAX] {
                    let id = conn_id(loop_index, slot, seq);
                    assert_eq!(loop_of(id), loop_index);
                    assert_eq!(slot_of(id), slot);
                }
            }
        }
        assert_ne!(conn_id(1, 7, 1), conn_id(1, 7, 2));
        assert_ne!(conn_id(1, 7, 1), conn_id(2, 7, 1));
    }

    #[derive(Default)]
    struct CountingWaker(AtomicUsize);

    impl LoopWaker for Arc<CountingWaker> {
        fn wake(&self) -> io::Result<()> {
            self.0.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
    }

    fn validate(engine: &mut Engine, id: ConnId) {
        assert!(engine.connect(id));
        engine
            .handle_request(
                id,
                Request::Validate {
                    magic: VALIDATION_MAGIC,
                },
            )
            .unwrap();
    }

    /// Two waiters on loop 1 and one on loop 0, released by one ADD on loop 0: the local
    /// one stays local, loop 1 gets both in its inbox and is woken once.
    #[test]
    fn wake_ups_cross_to_their_loop_batched_with_one_wake() {
        let wakers: Vec<Arc<CountingWaker>> = (0..2).map(|_| Arc::default()).collect();
        let shared = SharedEngine::new(
            wakers
                .iter()
                .map(|w| Box::new(Arc::clone(w)) as Box<dyn LoopWaker>)
                .collect(),
            Arc::new(StatsCells::default()),
            Budget::default(),
        );
        let setter = conn_id(0, 0, 1);
        let near = conn_id(0, 1, 1);
        let far = [conn_id(1, 0, 1), conn_id(1, 1, 1)];
        let wait = rdzv_core::store::codec::decode_request(
            b"\x06\x01\0\0\0\0\0\0\0\x01\0\0\0\0\0\0\0k",
            &Default::default(),
        )
        .unwrap()
        .complete()
        .unwrap();
        shared.turn(0, |engine, _| {
            for id in [setter, near, far[0], far[1]] {
                validate(engine, id);
            }
            for id in [near, far[0], far[1]] {
                let outcome = engine.handle_request(id, wait).unwrap();
                assert!(outcome.reply.is_none(), "the key is missing: they wait");
            }
        });
        let mut own = Vec::new();
        let mut local = Vec::new();
        shared.turn(0, |engine, router| {
            engine
                .handle_request(
                    setter,
                    Request::Add {
                        key: b"k",
                        delta: 1,
                    },
                )
                .unwrap();
            router.route(engine, setter, &mut own, &mut local);
        });
        assert!(own.is_empty());
        assert_eq!(local, [(near, 0)]);
        assert_eq!(
            wakers[0].0.load(Ordering::Relaxed),
            0,
            "nothing crossed to 0"
        );
        assert_eq!(wakers[1].0.load(Ordering::Relaxed), 1, "one wake for two");
        let mut inbox = Vec::new();
        shared.turn(1, |_, router| router.take_inbox(&mut inbox));
        assert_eq!(inbox, [(far[0], 0), (far[1], 0)]);
        let mut again = Vec::new();
        shared.turn(1, |_, router| router.take_inbox(&mut again));
        assert!(again.is_empty());
    }
}
