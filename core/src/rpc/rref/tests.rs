//! Unit tests of each rule, and a model test over a simulated network of three workers.

use alloc::collections::{BTreeMap, BTreeSet, VecDeque};
use alloc::vec;
use alloc::vec::Vec;

use proptest::prelude::*;

use super::*;

const A: WorkerId = WorkerId::from_i16(0);
const B: WorkerId = WorkerId::from_i16(1);
const C: WorkerId = WorkerId::from_i16(2);
const WORKERS: [WorkerId; 3] = [A, B, C];

fn idx(w: WorkerId) -> usize {
    usize::try_from(w.get()).unwrap_or(0)
}

/// What travels on one ordered pair's wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wire {
    Rref(RRefMessage, u32),
    Fork(ForkData),
}

/// Three workers joined by FIFO wires, under virtual time, plus what each runtime keeps
/// and an independent model of the protocol's tables.
struct Net {
    now: Instant,
    ctx: Vec<RRefContext>,
    /// wires[from][to]
    wires: [[VecDeque<Wire>; 3]; 3],
    /// Handles each worker's application holds (one entry per count).
    held: [Vec<RRefHandle>; 3],
    deleted: Vec<(WorkerId, RRefId)>,
    confirmed: BTreeSet<ForkId>,
    gave_up: usize,
    /// Drops so far per (kind, fork), to stay within the retries.
    drops: BTreeMap<(ControlKind, ForkId), u32>,
    /// Every `remote()` user (worker, fork), and those whose call failed.
    callers: BTreeSet<(WorkerId, ForkId)>,
    failed: BTreeSet<ForkId>,
    model: Model,
}

/// The model: what each worker's tables must hold, derived from the events the
/// simulation sees, not from the machine's fields.
/// A user in the model: its RRef, whether confirmed, its handles, its pending children.
type ModelUser = (RRefId, bool, u32, BTreeSet<ForkId>);

#[derive(Default)]
struct Model {
    /// (worker, rref) -> called, local handles
    slots: BTreeMap<(WorkerId, RRefId), (bool, u32)>,
    forks: BTreeMap<(WorkerId, RRefId), BTreeSet<ForkId>>,
    /// (worker, fork) -> (rref, confirmed, handles, pending children)
    users: BTreeMap<(WorkerId, ForkId), ModelUser>,
    sends: BTreeSet<(WorkerId, ControlKind, ForkId)>,
    /// Every RRef whose slot went live, and whether it was deleted.
    values: BTreeMap<RRefId, bool>,
    /// (owner, rref): the caller's own delete arrived before any slot: the call never
    /// will, so a slot a fork makes later is live at once.
    abandoned: BTreeSet<(WorkerId, RRefId)>,
}

fn options() -> RetryOptions {
    RetryOptions {
        max_retries: 8,
        rpc_retry_duration: Duration::from_millis(10),
        retry_backoff: 1.5,
    }
}

impl Net {
    fn new() -> Net {
        Net {
            now: Instant::ZERO,
            ctx: WORKERS
                .iter()
                .map(|&w| RRefContext::new(w, options()))
                .collect(),
            wires: Default::default(),
            held: Default::default(),
            deleted: Vec::new(),
            confirmed: BTreeSet::new(),
            gave_up: 0,
            drops: BTreeMap::new(),
            callers: BTreeSet::new(),
            failed: BTreeSet::new(),
            model: Model::default(),
        }
    }

    fn remote(&mut self, from: WorkerId, to: WorkerId) -> RRefHandle {
        let h = self.ctx[idx(from)].remote(to);
        self.held[idx(from)].push(h);
        match h.fork {
            None => {
                self.model.slots.insert((from, h.rref), (true, 1));
                self.model.values.insert(h.rref, false);
            }
            Some(fork) => {
                self.callers.insert((from, fork));
                self.model
                    .users
                    .insert((from, fork), (h.rref, false, 1, BTreeSet::new()));
                let call = RRefContext::remote_call(&h).expect("a user has a fork");
                self.wires[idx(from)][idx(to)].push_back(Wire::Rref(call, 0));
            }
        }
        self.pump();
        h
    }

    fn fork(&mut self, from: WorkerId, h: RRefHandle, to: WorkerId) -> ForkData {
        let data = self.ctx[idx(from)]
            .fork(&h, to)
            .expect("fork of a held handle");
        match h.fork {
            None => {
                self.model
                    .forks
                    .entry((from, h.rref))
                    .or_default()
                    .insert(data.fork);
            }
            Some(f) => {
                if let Some(u) = self.model.users.get_mut(&(from, f)) {
                    u.3.insert(data.fork);
                }
            }
        }
        self.wires[idx(from)][idx(to)].push_back(Wire::Fork(data));
        self.pump();
        data
    }

    fn drop_handle(&mut self, w: WorkerId, at: usize) {
        let h = self.held[idx(w)].remove(at);
        self.ctx[idx(w)]
            .drop_handle(self.now, &h)
            .expect("drop of a held handle");
        match h.fork {
            None => {
                if let Some(s) = self.model.slots.get_mut(&(w, h.rref)) {
                    s.1 -= 1;
                }
            }
            Some(f) => {
                if let Some(u) = self.model.users.get_mut(&(w, f)) {
                    u.2 -= 1;
                }
            }
        }
        self.pump();
    }

    fn clone_handle(&mut self, w: WorkerId, at: usize) {
        let h = self.held[idx(w)][at];
        self.ctx[idx(w)]
            .clone_handle(&h)
            .expect("clone of a held handle");
        self.held[idx(w)].push(h);
        match h.fork {
            None => {
                if let Some(s) = self.model.slots.get_mut(&(w, h.rref)) {
                    s.1 += 1;
                }
            }
            Some(f) => {
                if let Some(u) = self.model.users.get_mut(&(w, f)) {
                    u.2 += 1;
                }
            }
        }
        self.pump();
    }

    /// Delivers the head of wire from -> to; `keep` leaves it there (a duplicate).
    fn deliver(&mut self, from: WorkerId, to: WorkerId, keep: bool) -> bool {
        let Some(&wire) = self.wires[idx(from)][idx(to)].front() else {
            return false;
        };
        if !keep {
            self.wires[idx(from)][idx(to)].pop_front();
        }
        match wire {
            Wire::Fork(data) => {
                let h = self.ctx[idx(to)]
                    .receive_fork(self.now, data)
                    .expect("a fork delivered once");
                self.held[idx(to)].push(h);
                if h.is_owner() {
                    let m = &mut self.model;
                    let s = m.slots.entry((to, data.rref)).or_insert_with(|| {
                        let called = m.abandoned.remove(&(to, data.rref));
                        if called {
                            m.values.entry(data.rref).or_insert(false);
                        }
                        (called, 0)
                    });
                    s.1 += 1;
                } else {
                    self.model.users.insert(
                        (to, data.fork),
                        (data.rref, data.parent == data.owner, 1, BTreeSet::new()),
                    );
                }
            }
            Wire::Rref(message, _) => {
                self.model_receive(from, to, message);
                self.ctx[idx(to)].handle_message(self.now, from, message);
            }
        }
        self.pump();
        true
    }

    fn model_receive(&mut self, from: WorkerId, to: WorkerId, message: RRefMessage) {
        let m = &mut self.model;
        match message {
            RRefMessage::RemoteCall { rref, fork } => {
                m.abandoned.remove(&(to, rref));
                let s = m.slots.entry((to, rref)).or_insert((false, 0));
                s.0 = true;
                m.values.entry(rref).or_insert(false);
                m.forks.entry((to, rref)).or_default().insert(fork);
            }
            RRefMessage::RemoteRet { .. } => {}
            RRefMessage::Control { kind, rref, fork } => match kind {
                ControlKind::ForkRequest => {
                    m.forks.entry((to, rref)).or_default().insert(fork);
                }
                ControlKind::ChildAccept => {
                    for ((w, _), u) in m.users.iter_mut() {
                        if *w == to {
                            u.3.remove(&fork);
                        }
                    }
                }
                ControlKind::UserDelete => {
                    // The caller's own delete: its call has arrived, or never will.
                    let callers = rref.created_on == from && fork.created_on == from;
                    if callers {
                        if let Some(s) = m.slots.get_mut(&(to, rref)) {
                            s.0 = true;
                            m.values.entry(rref).or_insert(false);
                        } else {
                            m.abandoned.insert((to, rref));
                        }
                    }
                    if let Some(set) = m.forks.get_mut(&(to, rref)) {
                        set.remove(&fork);
                        if set.is_empty() {
                            m.forks.remove(&(to, rref));
                        }
                    }
                }
            },
            RRefMessage::Ack { kind, fork, .. } => {
                m.sends.remove(&(to, kind, fork));
            }
        }
    }

    /// Drains every worker's outputs onto the wires, checking each deletion.
    fn pump(&mut self) {
        for w in WORKERS {
            while let Some(ev) = self.ctx[idx(w)].poll_event() {
                match ev {
                    RRefEvent::DeleteValue { rref } => {
                        self.check_unreachable(w, rref);
                        self.deleted.push((w, rref));
                        self.model.slots.remove(&(w, rref));
                        let was = self.model.values.insert(rref, true);
                        assert_eq!(was, Some(false), "{rref} deleted twice or never created");
                    }
                    RRefEvent::Confirmed { fork, .. } => {
                        assert!(self.confirmed.insert(fork), "{fork} confirmed twice");
                        if let Some(u) = self.model.users.get_mut(&(w, fork)) {
                            u.1 = true;
                        }
                    }
                    RRefEvent::GaveUp { .. } => self.gave_up += 1,
                }
            }
            while let Some(t) = self.ctx[idx(w)].poll_transmit() {
                if let RRefMessage::Control { kind, fork, .. } = t.message {
                    if t.attempt == 0 {
                        assert!(
                            self.model.sends.insert((w, kind, fork)),
                            "{kind} for {fork} sent twice as new"
                        );
                        if kind == ControlKind::UserDelete {
                            let u = self.model.users.remove(&(w, fork));
                            let (_, confirmed, handles, children) =
                                u.expect("a user deleted that the model does not hold");
                            assert!(confirmed && handles == 0 && children.is_empty());
                        }
                    }
                }
                assert_ne!(t.to, w, "a message to oneself");
                self.wires[idx(w)][idx(t.to)].push_back(Wire::Rref(t.message, t.attempt));
            }
        }
        self.check_counts();
    }

    /// Nothing anywhere can still reach `rref`: no handle, no user, no fork in flight.
    fn check_unreachable(&self, owner: WorkerId, rref: RRefId) {
        for w in WORKERS {
            assert!(
                !self.held[idx(w)].iter().any(|h| h.rref == rref),
                "{rref} deleted on {owner:?} while {w:?} holds a handle"
            );
            for to in WORKERS {
                assert!(
                    !self.wires[idx(w)][idx(to)]
                        .iter()
                        .any(|m| matches!(m, Wire::Fork(d) if d.rref == rref)),
                    "{rref} deleted while a fork of it is in flight"
                );
            }
        }
        assert!(
            !self.model.users.iter().any(|(_, u)| u.0 == rref),
            "{rref} deleted while a user of it is alive"
        );
    }

    /// The machine's counts equal the model's, and the model deletes what it deletes.
    fn check_counts(&self) {
        for w in WORKERS {
            let m = &self.model;
            let info = self.ctx[idx(w)].debug_info();
            let slots = m.slots.keys().filter(|(o, _)| *o == w).count();
            let forks: usize = m
                .forks
                .iter()
                .filter(|((o, _), _)| *o == w)
                .map(|(_, s)| s.len())
                .sum();
            let users: Vec<_> = m.users.iter().filter(|((o, _), _)| *o == w).collect();
            let pending = users.iter().filter(|(_, u)| !u.1).count();
            let sends = m.sends.iter().filter(|(o, _, _)| *o == w).count();
            let want = DebugInfo {
                num_owner_rrefs: slots,
                num_pending_futures: sends,
                num_pending_users: pending,
                num_forks: forks,
            };
            assert_eq!(info, want, "debug info of {w:?}");
            assert_eq!(self.ctx[idx(w)].num_users(), users.len());
            // Every slot the model would delete is gone.
            for (&(o, rref), &(called, handles)) in &m.slots {
                if o == w {
                    let forked = m.forks.contains_key(&(o, rref));
                    assert!(
                        !called || handles > 0 || forked,
                        "{rref} should have been deleted on {o:?}"
                    );
                }
            }
        }
    }

    /// The application's handles on `w` are gone (released at shutdown): forget them
    /// in the simulation and the model, then pump.
    fn pump_forget(&mut self, w: WorkerId) {
        self.held[idx(w)].clear();
        for ((o, _), s) in self.model.slots.iter_mut() {
            if *o == w {
                s.1 = 0;
            }
        }
        for ((o, _), u) in self.model.users.iter_mut() {
            if *o == w && u.1 && u.3.is_empty() {
                u.2 = 0;
            }
        }
        self.pump();
    }

    fn advance(&mut self, d: Duration) {
        self.now = self.now.saturating_add(d);
        for w in WORKERS {
            self.ctx[idx(w)].handle_timeout(self.now);
        }
        self.pump();
    }

    /// Delivers everything, retrying as needed, until the network is idle.
    fn drain(&mut self) {
        for _ in 0..10_000 {
            let mut moved = false;
            for from in WORKERS {
                for to in WORKERS {
                    while self.deliver(from, to, false) {
                        moved = true;
                    }
                }
            }
            if moved {
                continue;
            }
            match WORKERS
                .iter()
                .filter_map(|&w| self.ctx[idx(w)].poll_timeout())
                .min()
            {
                Some(at) => {
                    let d = at.saturating_duration_since(self.now);
                    self.advance(d);
                }
                None => return,
            }
        }
        panic!("the network did not drain");
    }

    fn drop_all(&mut self) {
        for w in WORKERS {
            while !self.held[idx(w)].is_empty() {
                self.drop_handle(w, 0);
            }
        }
    }

    fn assert_empty(&self) {
        for w in WORKERS {
            let c = &self.ctx[idx(w)];
            assert_eq!(c.debug_info(), DebugInfo::default(), "{w:?} not empty");
            assert_eq!(c.num_users(), 0);
            assert!(c.is_settled());
            assert_eq!(c.leaks().count(), 0);
            assert_eq!(c.poll_timeout(), None);
        }
        for (rref, deleted) in &self.model.values {
            assert!(deleted, "{rref} was never deleted");
        }
    }
}

// ---- unit tests ---------------------------------------------------------------------

#[test]
fn remote_to_another_worker_is_pending_until_remote_ret() {
    let mut net = Net::new();
    let h = net.remote(A, B);
    assert!(!net.ctx[0].confirmed_by_owner(&h));
    assert_eq!(net.ctx[0].debug_info().num_pending_users, 1);
    assert!(net.deliver(A, B, false)); // RemoteCall
    assert_eq!(net.ctx[1].debug_info().num_owner_rrefs, 1);
    assert_eq!(net.ctx[1].debug_info().num_forks, 1);
    assert!(net.deliver(B, A, false)); // RemoteRet
    assert!(net.ctx[0].confirmed_by_owner(&h));
    assert!(net.confirmed.contains(&h.fork.expect("a user")));
    assert_eq!(net.ctx[1].value_ready(h.rref, true), ValueOutcome::Store);
    assert_eq!(
        net.ctx[1].owner_rref(h.rref).map(|o| o.value),
        Some(ValueState::Ready)
    );
    net.drop_handle(A, 0);
    // USER_DELETE is in flight: the value is still there.
    assert_eq!(net.ctx[1].debug_info().num_owner_rrefs, 1);
    assert_eq!(net.ctx[0].debug_info().num_pending_futures, 1);
    net.drain();
    assert_eq!(net.deleted, [(B, h.rref)]);
    net.assert_empty();
}

/// A control message that arrived as a call is answered by its `Ack`, returned for the
/// call's response; nothing of it is queued as a call of its own.
#[test]
fn a_control_calls_ack_is_its_response() {
    let mut owner = RRefContext::new(B, options());
    let rref = RRefId {
        created_on: A,
        local_id: 0,
    };
    let fork = ForkId {
        created_on: A,
        local_id: 1,
    };
    let control = RRefMessage::Control {
        kind: ControlKind::ForkRequest,
        rref,
        fork,
    };
    let answer = owner.handle_call(Instant::ZERO, C, control);
    assert_eq!(
        answer,
        Some(RRefMessage::Ack {
            kind: ControlKind::ForkRequest,
            rref,
            fork
        })
    );
    assert_eq!(owner.poll_transmit(), None);
    assert_eq!(owner.debug_info().num_forks, 1);
    // As a plain message, the same answer is queued to the sender instead.
    let mut queued = RRefContext::new(B, options());
    queued.handle_message(Instant::ZERO, C, control);
    let sent = queued.poll_transmit().map(|t| (t.to, t.message));
    assert_eq!(sent, Some((C, answer.unwrap_or(control))));
}

/// A `remote()` call's `RemoteRet` is that call's response; another `RemoteCall`
/// handled as a plain message still queues its own. An `Ack` or a `RemoteRet` has no
/// answer.
#[test]
fn a_remote_calls_remote_ret_is_its_response() {
    let mut owner = RRefContext::new(B, options());
    let id = |local_id| RRefId {
        created_on: A,
        local_id,
    };
    let (rref, fork) = (id(0), id(1));
    let answer = owner.handle_call(Instant::ZERO, A, RRefMessage::RemoteCall { rref, fork });
    assert_eq!(answer, Some(RRefMessage::RemoteRet { rref, fork }));
    owner.handle_message(
        Instant::ZERO,
        A,
        RRefMessage::RemoteCall {
            rref: id(2),
            fork: id(3),
        },
    );
    let rest: Vec<_> = core::iter::from_fn(|| owner.poll_transmit())
        .map(|t| (t.to, t.message))
        .collect();
    assert_eq!(
        rest,
        [(
            A,
            RRefMessage::RemoteRet {
                rref: id(2),
                fork: id(3)
            }
        )]
    );
    assert_eq!(owner.debug_info().num_forks, 2);
    let ack = RRefMessage::Ack {
        kind: ControlKind::UserDelete,
        rref,
        fork,
    };
    assert_eq!(owner.handle_call(Instant::ZERO, A, ack), None);
    assert_eq!(
        owner.handle_call(Instant::ZERO, A, RRefMessage::RemoteRet { rref, fork }),
        None
    );
}

#[test]
fn remote_to_self_is_an_owner_handle() {
    let mut net = Net::new();
    let h = net.remote(A, A);
    assert!(h.is_owner());
    assert!(net.ctx[0].confirmed_by_owner(&h));
    net.drop_handle(A, 0);
    assert_eq!(net.deleted, [(A, h.rref)]);
    net.assert_empty();
}

#[test]
fn a_user_dropped_before_the_value_exists() {
    let mut net = Net::new();
    let h = net.remote(A, B);
    net.drop_handle(A, 0);
    // Still pending: nothing is sent until the owner confirms.
    assert_eq!(net.ctx[0].debug_info().num_pending_users, 1);
    assert!(net.wires[0][1].len() == 1);
    net.drain();
    assert_eq!(net.deleted, [(B, h.rref)]);
    // The handler finishes after the slot went: its value is dropped.
    assert_eq!(net.ctx[1].value_ready(h.rref, true), ValueOutcome::Discard);
    net.assert_empty();
}

#[test]
fn fork_from_a_user_to_a_third_worker_goes_through_the_owner() {
    // A is the user, B the owner, C the child.
    let mut net = Net::new();
    let h = net.remote(A, B);
    net.drain();
    let data = net.fork(A, h, C);
    net.drop_handle(A, 0);
    // A's user is held by its pending child: no USER_DELETE yet.
    assert_eq!(net.ctx[0].num_users(), 1);
    assert!(!net.ctx[0].is_settled());
    assert!(net.deliver(A, C, false)); // the message carrying the fork
    assert_eq!(net.ctx[2].debug_info().num_pending_users, 1);
    assert!(net.deliver(C, B, false)); // FORK_REQUEST
    assert_eq!(net.ctx[1].debug_info().num_forks, 2);
    assert!(net.deliver(B, C, false)); // Ack: C confirmed, CHILD_ACCEPT to A
    assert!(net.confirmed.contains(&data.fork));
    assert!(matches!(
        net.wires[2][0].front(),
        Some(Wire::Rref(
            RRefMessage::Control {
                kind: ControlKind::ChildAccept,
                ..
            },
            0
        ))
    ));
    assert!(net.deliver(C, A, false)); // CHILD_ACCEPT: A deletes its user
    assert_eq!(net.ctx[0].num_users(), 0);
    net.drain();
    assert!(net.deleted.is_empty(), "C still holds the RRef");
    assert_eq!(net.ctx[1].debug_info().num_forks, 1);
    net.drop_handle(C, 0);
    net.drain();
    assert_eq!(net.deleted, [(B, h.rref)]);
    net.assert_empty();
}

#[test]
fn fork_from_the_owner_is_confirmed_on_arrival() {
    let mut net = Net::new();
    let h = net.remote(B, B);
    let data = net.fork(B, h, C);
    assert_eq!(net.ctx[1].debug_info().num_forks, 1);
    net.drop_handle(B, 0);
    assert!(net.deleted.is_empty(), "the fork in flight holds the value");
    net.drain();
    let child = RRefHandle {
        rref: h.rref,
        owner: B,
        fork: Some(data.fork),
    };
    assert!(net.ctx[2].confirmed_by_owner(&child));
    assert_eq!(net.ctx[2].debug_info().num_pending_futures, 0);
    net.drop_handle(C, 0);
    net.drain();
    assert_eq!(net.deleted, [(B, h.rref)]);
    net.assert_empty();
}

#[test]
fn fork_back_to_the_owner_is_a_phantom_fork() {
    let mut net = Net::new();
    let h = net.remote(A, B);
    net.drain();
    net.fork(A, h, B);
    net.drop_handle(A, 0);
    assert!(net.deliver(A, B, false));
    // The owner holds a local handle, counts no new fork, and accepts to A at once.
    let info = net.ctx[1].debug_info();
    assert_eq!((info.num_forks, info.num_pending_futures), (1, 1));
    net.drain();
    assert!(net.deleted.is_empty(), "the owner's handle holds it");
    assert_eq!(net.ctx[1].debug_info().num_forks, 0);
    net.drop_handle(B, 0);
    assert_eq!(net.deleted, [(B, h.rref)]);
    net.assert_empty();
}

#[test]
fn fork_back_to_the_owner_before_its_remote_call() {
    // A calls remote() on C and forks its pending user to B; B forks it on to C. B's fork
    // reaches C (the owner) before A's call does: the early slot must outlive C's
    // handle until the call arrives and counts A's fork.
    let mut net = Net::new();
    let h = net.remote(A, C);
    net.fork(A, h, B);
    assert!(net.deliver(A, B, false));
    let at_b = *net.held[1].last().expect("B holds the fork");
    net.fork(B, at_b, C);
    net.drop_handle(A, 0);
    net.drop_handle(B, 0);
    assert!(net.deliver(B, C, false)); // FORK_REQUEST, before the call
    assert!(net.deliver(B, C, false)); // the fork: a phantom slot on C
    assert_eq!(net.ctx[2].owner_rref(h.rref).map(|o| o.called), Some(false));
    net.drop_handle(C, 0);
    // B's fork settles and is deleted while A's call is still on its wire.
    while net.deliver(C, B, false) || net.deliver(B, C, false) {}
    assert_eq!(net.ctx[1].num_users(), 0);
    assert_eq!(net.ctx[2].debug_info().num_forks, 0);
    assert!(net.deleted.is_empty(), "A's call is still in flight");
    assert_eq!(net.ctx[2].debug_info().num_owner_rrefs, 1);
    net.drain();
    assert_eq!(net.deleted, [(C, h.rref)]);
    net.assert_empty();
}

#[test]
fn a_failed_remote_call_is_no_longer_pending_and_is_deleted_when_dropped() {
    for lost in [true, false] {
        let mut net = Net::new();
        let h = net.remote(A, B);
        net.fail_remote(A, h, lost);
        let a = &net.ctx[0];
        assert_eq!(a.user_state(&h), Some(UserState::Failed));
        assert!(!a.confirmed_by_owner(&h));
        assert_eq!(a.debug_info().num_pending_users, 0);
        assert!(a.is_settled());
        assert_eq!(a.leaks().count(), 0);
        assert_eq!(
            net.ctx[0].fork(&h, C),
            Err(RRefError::CreationFailed { rref: h.rref })
        );
        // A late call (not lost) confirms nothing: the failure stays.
        net.drain();
        assert_eq!(net.ctx[0].user_state(&h), Some(UserState::Failed));
        // Dropped, it tells the owner, which deletes what the call made, if anything.
        net.drop_handle(A, 0);
        assert_eq!(net.ctx[0].debug_info().num_pending_futures, 1);
        net.drain();
        let made: &[(WorkerId, RRefId)] = if lost { &[] } else { &[(B, h.rref)] };
        assert_eq!(net.deleted, made, "lost: {lost}");
        net.assert_empty();
    }
}

#[test]
fn the_callers_delete_releases_an_early_slot_whose_call_was_lost() {
    // A forks its user back to the owner C, then its call fails without reaching C:
    // the fork makes an early slot on C, which A's delete releases.
    let mut net = Net::new();
    let h = net.remote(A, C);
    net.fork(A, h, C);
    net.fail_remote(A, h, true);
    net.drain();
    assert_eq!(net.ctx[2].owner_rref(h.rref).map(|o| o.called), Some(false));
    net.drop_handle(C, 0);
    assert_eq!(
        net.ctx[2].debug_info().num_owner_rrefs,
        1,
        "waits for the call"
    );
    net.drop_handle(A, 0);
    net.drain();
    assert_eq!(net.deleted, [(C, h.rref)]);
    net.assert_empty();
}

#[test]
fn a_remote_failure_of_a_fork_or_an_unknown_user_changes_nothing() {
    let mut net = Net::new();
    let h = net.remote(A, C);
    net.fork(A, h, B);
    net.drain();
    let at_b = *net.held[1].last().expect("B holds the fork");
    let fork = at_b.fork.expect("a user");
    // B's user was not made by B's remote(): no failure applies to it.
    net.ctx[1].remote_failed(net.now, h.rref, fork);
    assert_eq!(net.ctx[1].user_state(&at_b), Some(UserState::Confirmed));
    net.ctx[0].remote_failed(net.now, h.rref, fork);
    net.pump();
    net.drop_all();
    net.drain();
    assert_eq!(net.deleted, [(C, h.rref)]);
    net.assert_empty();
}

#[test]
fn every_arrangement_of_three_workers() {
    for &caller in &WORKERS {
        for &owner in &WORKERS {
            for &child in &WORKERS {
                if child == caller {
                    continue;
                }
                let mut net = Net::new();
                let h = net.remote(caller, owner);
                net.fork(caller, h, child);
                net.drain();
                assert!(net.deleted.is_empty(), "{caller:?} {owner:?} {child:?}");
                net.drop_all();
                net.drain();
                assert_eq!(net.deleted, [(owner, h.rref)]);
                net.assert_empty();
            }
        }
    }
}

#[test]
fn lost_control_messages_are_retried_with_backoff() {
    let mut net = Net::new();
    let h = net.remote(A, B);
    net.drain();
    net.drop_handle(A, 0);
    let first = net.ctx[0].poll_timeout().expect("a retry is scheduled");
    assert_eq!(first, Instant::ZERO.saturating_add(options().delay(0)));
    // Lose USER_DELETE three times; each retry waits 1.5 times longer.
    let mut waits = Vec::new();
    for attempt in 1..=3u32 {
        assert!(net.wires[0][1].pop_front().is_some());
        let at = net.ctx[0].poll_timeout().expect("a retry is scheduled");
        waits.push(at.saturating_duration_since(net.now));
        net.advance(at.saturating_duration_since(net.now));
        assert!(matches!(
            net.wires[0][1].front(),
            Some(Wire::Rref(_, n)) if *n == attempt
        ));
    }
    assert_eq!(
        waits,
        [options().delay(0), options().delay(1), options().delay(2)]
    );
    assert_eq!(options().delay(1), Duration::from_millis(15));
    net.drain();
    assert_eq!(net.deleted, [(B, h.rref)]);
    net.assert_empty();
}

#[test]
fn gives_up_after_max_retries_and_reports_the_leak() {
    let mut net = Net::new();
    net.remote(A, B);
    net.drain();
    net.drop_handle(A, 0);
    for _ in 0..=options().max_retries {
        assert!(net.wires[0][1].pop_front().is_some());
        let at = net.ctx[0].poll_timeout().expect("a retry is scheduled");
        net.advance(at.saturating_duration_since(net.now));
    }
    assert_eq!(net.gave_up, 1);
    assert_eq!(net.ctx[0].poll_timeout(), None);
    let leaks: Vec<_> = net.ctx[0].leaks().collect();
    assert!(matches!(
        leaks[..],
        [Leak::Unanswered {
            to: B,
            kind: ControlKind::UserDelete,
            ..
        }]
    ));
    assert_eq!(net.ctx[1].debug_info().num_owner_rrefs, 1);
}

#[test]
fn duplicated_control_messages_are_idempotent() {
    let mut net = Net::new();
    let h = net.remote(A, B);
    net.fork(A, h, C);
    net.deliver(A, B, true); // RemoteCall, handled once (kept for its own delivery below)
    net.deliver(A, B, false);
    net.deliver(B, A, true); // RemoteRet twice
    net.deliver(B, A, false);
    net.deliver(A, C, false); // the fork
    for _ in 0..3 {
        net.deliver(C, B, true); // FORK_REQUEST three times
    }
    net.deliver(C, B, false);
    assert_eq!(net.ctx[1].debug_info().num_forks, 2);
    for _ in 0..4 {
        net.deliver(B, C, true); // four acks
    }
    net.drain();
    net.drop_all();
    // USER_DELETEs twice each.
    net.deliver(A, B, true);
    net.deliver(C, B, true);
    net.drain();
    assert_eq!(net.deleted, [(B, h.rref)]);
    net.assert_empty();
}

#[test]
fn graceful_shutdown_releases_what_the_application_still_holds() {
    let mut net = Net::new();
    let h = net.remote(A, B);
    net.fork(A, h, C);
    let own = net.remote(B, B);
    net.clone_handle(A, 0);
    // Not settled yet: the fork is pending, and releasing keeps what is pending.
    assert!(!net.ctx[0].is_settled());
    assert_eq!(net.ctx[0].release_all(net.now), 1);
    assert!(matches!(
        net.ctx[0].leaks().next(),
        Some(Leak::PendingUser { owner: B, .. })
    ));
    net.drain();
    for w in WORKERS {
        assert!(net.ctx[idx(w)].is_settled());
        net.ctx[idx(w)].release_all(net.now);
        net.pump_forget(w);
    }
    net.drain();
    let mut deleted = net.deleted.clone();
    deleted.sort();
    let mut want = [(B, h.rref), (B, own.rref)];
    want.sort();
    assert_eq!(deleted, want);
    for w in WORKERS {
        assert_eq!(net.ctx[idx(w)].debug_info(), DebugInfo::default());
        assert_eq!(net.ctx[idx(w)].num_users(), 0);
    }
    assert!(matches!(
        net.ctx[0].drop_handle(net.now, &h),
        Err(RRefError::UnknownHandle { .. })
    ));
}

#[test]
fn local_mistakes_are_errors() {
    let mut ctx = RRefContext::new(A, options());
    let h = ctx.remote(B);
    assert!(matches!(ctx.fork(&h, A), Err(RRefError::ForkToSelf { .. })));
    assert_eq!(ctx.drop_handle(Instant::ZERO, &h), Ok(()));
    assert!(matches!(
        ctx.drop_handle(Instant::ZERO, &h),
        Err(RRefError::UnknownHandle { .. })
    ));
    assert!(matches!(
        ctx.clone_handle(&h),
        Err(RRefError::UnknownHandle { .. })
    ));
    let data = ForkData {
        owner: C,
        rref: h.rref,
        fork: h.rref,
        parent: B,
    };
    assert!(ctx.receive_fork(Instant::ZERO, data).is_ok());
    assert!(matches!(
        ctx.receive_fork(Instant::ZERO, data),
        Err(RRefError::DuplicateFork { .. })
    ));
    // Messages about unknown ids change nothing and are acked.
    let mut owner = RRefContext::new(B, options());
    owner.handle_message(
        Instant::ZERO,
        A,
        RRefMessage::Control {
            kind: ControlKind::UserDelete,
            rref: h.rref,
            fork: h.rref,
        },
    );
    assert!(matches!(
        owner.poll_transmit(),
        Some(Transmit {
            message: RRefMessage::Ack { .. },
            ..
        })
    ));
    assert_eq!(owner.debug_info(), DebugInfo::default());
    assert!(RetryOptions::default().delay(u32::MAX) > Duration::ZERO);
}

// ---- the model test -----------------------------------------------------------------

#[derive(Debug, Clone)]
enum Op {
    Remote(usize, usize),
    Fork(usize, usize, usize),
    Clone(usize, usize),
    Drop(usize, usize),
    Value(usize, usize, bool),
    Deliver(usize, usize),
    Duplicate(usize, usize),
    Lose(usize, usize),
    /// Delivers everything but the wire a -> b, which stays delayed.
    Starve(usize, usize),
    Advance(u64),
    /// The `remote()` call of worker a's user h fails; `true`: it never left (it is
    /// taken off the wire if still there), else it may still arrive.
    FailRemote(usize, usize, bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => (0..3usize, 0..3usize).prop_map(|(a, b)| Op::Remote(a, b)),
        4 => (0..3usize, 0..8usize, 0..3usize).prop_map(|(a, h, b)| Op::Fork(a, h, b)),
        1 => (0..3usize, 0..8usize).prop_map(|(a, h)| Op::Clone(a, h)),
        3 => (0..3usize, 0..8usize).prop_map(|(a, h)| Op::Drop(a, h)),
        1 => (0..3usize, 0..8usize, any::<bool>()).prop_map(|(a, h, ok)| Op::Value(a, h, ok)),
        6 => (0..3usize, 0..3usize).prop_map(|(a, b)| Op::Deliver(a, b)),
        2 => (0..3usize, 0..3usize).prop_map(|(a, b)| Op::Duplicate(a, b)),
        2 => (0..3usize, 0..3usize).prop_map(|(a, b)| Op::Lose(a, b)),
        2 => (0..3usize, 0..3usize).prop_map(|(a, b)| Op::Starve(a, b)),
        2 => (1..40u64).prop_map(Op::Advance),
        1 => (0..3usize, 0..8usize, any::<bool>()).prop_map(|(a, h, l)| Op::FailRemote(a, h, l)),
    ]
}

impl Net {
    /// The `remote()` call of `w`'s user `h` failed; `lost`: it never reached the
    /// owner.
    fn fail_remote(&mut self, w: WorkerId, h: RRefHandle, lost: bool) {
        let Some(fork) = h.fork else {
            return;
        };
        if !self.callers.contains(&(w, fork)) || !self.failed.insert(fork) {
            return;
        }
        if lost {
            self.wires[idx(w)][idx(h.owner)].retain(|m| {
                !matches!(m, Wire::Rref(RRefMessage::RemoteCall { rref, .. }, _) if *rref == h.rref)
            });
        }
        self.ctx[idx(w)].remote_failed(self.now, h.rref, fork);
        if let Some(u) = self.model.users.get_mut(&(w, fork)) {
            u.1 = true;
        }
        self.pump();
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Remote(a, b) => {
                self.remote(WORKERS[a], WORKERS[b]);
            }
            Op::Fork(a, h, b) => {
                let (from, to) = (WORKERS[a], WORKERS[b]);
                if from == to || self.held[a].is_empty() {
                    return;
                }
                let handle = self.held[a][h % self.held[a].len()];
                if self.ctx[a].user_state(&handle) == Some(UserState::Failed) {
                    assert_eq!(
                        self.ctx[a].fork(&handle, to),
                        Err(RRefError::CreationFailed { rref: handle.rref })
                    );
                    return;
                }
                self.fork(from, handle, to);
            }
            Op::Clone(a, h) => {
                if !self.held[a].is_empty() {
                    let at = h % self.held[a].len();
                    self.clone_handle(WORKERS[a], at);
                }
            }
            Op::Drop(a, h) => {
                if !self.held[a].is_empty() {
                    let at = h % self.held[a].len();
                    self.drop_handle(WORKERS[a], at);
                }
            }
            Op::Value(a, h, ok) => {
                if let Some(handle) = self.held[a].get(h % self.held[a].len().max(1)) {
                    if handle.is_owner() {
                        let _ = self.ctx[a].value_ready(handle.rref, ok);
                    }
                }
            }
            Op::Deliver(a, b) => {
                self.deliver(WORKERS[a], WORKERS[b], false);
            }
            Op::Duplicate(a, b) => {
                // Only what a retry or a re-sent answer can duplicate: RRef control
                // messages and answers, not the call or the application message.
                if let Some(Wire::Rref(m, _)) = self.wires[a][b].front() {
                    if !matches!(m, RRefMessage::RemoteCall { .. }) {
                        self.deliver(WORKERS[a], WORKERS[b], true);
                    }
                }
            }
            Op::Lose(a, b) => {
                // Only control messages and their acks are lost (their sender retries),
                // at most three times each, within `max_retries`.
                let key = match self.wires[a][b].front() {
                    Some(Wire::Rref(RRefMessage::Control { kind, fork, .. }, _))
                    | Some(Wire::Rref(RRefMessage::Ack { kind, fork, .. }, _)) => (*kind, *fork),
                    _ => return,
                };
                let n = self.drops.entry(key).or_insert(0);
                if *n < 3 {
                    *n += 1;
                    self.wires[a][b].pop_front();
                }
            }
            Op::Starve(a, b) => {
                let mut moved = true;
                while moved {
                    moved = false;
                    for from in WORKERS {
                        for to in WORKERS {
                            if (idx(from), idx(to)) != (a, b) {
                                moved |= self.deliver(from, to, false);
                            }
                        }
                    }
                }
            }
            Op::Advance(ms) => self.advance(Duration::from_millis(ms)),
            Op::FailRemote(a, h, lost) => {
                if let Some(&handle) = self.held[a].get(h % self.held[a].len().max(1)) {
                    self.fail_remote(WORKERS[a], handle, lost);
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Arbitrary interleavings, delays, duplicates and lost (then retried) sends: an
    /// owner value is never deleted while reachable (checked at each deletion), the debug
    /// counts always equal the model's (checked after every step), and once every handle
    /// is dropped and the network drains, every value is deleted and every table empty.
    #[test]
    fn model_three_workers(ops in proptest::collection::vec(op(), 0..200)) {
        let mut net = Net::new();
        for op in &ops {
            net.apply(op);
        }
        net.drain();
        net.drop_all();
        net.drain();
        prop_assert_eq!(net.gave_up, 0);
        net.assert_empty();
    }
}

fn one_rref_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3usize, 0..4usize, 0..3usize).prop_map(|(a, h, b)| Op::Fork(a, h, b)),
        1 => (0..3usize, 0..4usize).prop_map(|(a, h)| Op::Clone(a, h)),
        3 => (0..3usize, 0..4usize).prop_map(|(a, h)| Op::Drop(a, h)),
        6 => (0..3usize, 0..3usize).prop_map(|(a, b)| Op::Deliver(a, b)),
        1 => (0..3usize, 0..3usize).prop_map(|(a, b)| Op::Duplicate(a, b)),
        1 => (0..3usize, 0..3usize).prop_map(|(a, b)| Op::Lose(a, b)),
        2 => (0..3usize, 0..3usize).prop_map(|(a, b)| Op::Starve(a, b)),
        1 => (1..40u64).prop_map(Op::Advance),
        1 => (0..3usize, 0..4usize, any::<bool>()).prop_map(|(a, h, l)| Op::FailRemote(a, h, l)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    /// One RRef, forked along arbitrary chains between three workers, with the same
    /// faults: a small state space, so deep orders (a fork reaching the owner before
    /// the call that creates it, a parent's delete racing its child's request) are hit.
    #[test]
    fn model_one_rref(
        to_self in any::<bool>(),
        ops in proptest::collection::vec(one_rref_op(), 0..24),
        late in (0..3usize, 0..3usize),
    ) {
        let mut net = Net::new();
        // The machine is symmetric in the workers' ids, so A calling C (or itself)
        // stands for every arrangement.
        net.remote(A, if to_self { A } else { C });
        for op in &ops {
            net.apply(op);
        }
        // Let go of everything while one wire stays delayed to the very end.
        for _ in 0..3 {
            net.drop_all();
            net.apply(&Op::Starve(late.0, late.1));
        }
        net.drain();
        net.drop_all();
        net.drain();
        prop_assert_eq!(net.gave_up, 0);
        net.assert_empty();
    }
}

#[test]
fn soak_many_rrefs_leave_every_table_empty() {
    // 20,000 RRefs created, forked and dropped across three workers, in batches of 50
    // left alive together, with every arrangement of caller, owner and child.
    let mut net = Net::new();
    for batch in 0..400u32 {
        for i in 0..50u32 {
            let n = batch * 50 + i;
            let caller = WORKERS[(n % 3) as usize];
            let owner = WORKERS[((n / 3) % 3) as usize];
            let child = WORKERS[((n % 3 + 1 + (n / 9) % 2) % 3) as usize];
            let h = net.remote(caller, owner);
            net.fork(caller, h, child);
        }
        net.drop_all();
        net.drain();
        net.drop_all();
        net.drain();
    }
    assert_eq!(net.model.values.len(), 20_000);
    assert_eq!(net.deleted.len(), 20_000);
    net.assert_empty();
}

#[test]
fn messages_and_fork_data_round_trip_through_postcard() {
    let id = |w: WorkerId, n: u64| GloballyUniqueId {
        created_on: w,
        local_id: n,
    };
    let messages = [
        RRefMessage::RemoteCall {
            rref: id(A, 0),
            fork: id(A, 1),
        },
        RRefMessage::RemoteRet {
            rref: id(A, 0),
            fork: id(A, 1),
        },
        RRefMessage::Control {
            kind: ControlKind::ForkRequest,
            rref: id(A, 0),
            fork: id(B, u64::MAX),
        },
        RRefMessage::Ack {
            kind: ControlKind::UserDelete,
            rref: id(C, 7),
            fork: id(B, 3),
        },
    ];
    for m in messages {
        let bytes = postcard::to_allocvec(&m).expect("encodes");
        assert_eq!(postcard::from_bytes::<RRefMessage>(&bytes), Ok(m));
        // A truncated message is an error, never a panic.
        assert!(postcard::from_bytes::<RRefMessage>(&bytes[..bytes.len() - 1]).is_err());
    }
    let data = ForkData {
        owner: B,
        rref: id(A, 0),
        fork: id(C, 9),
        parent: C,
    };
    let bytes = postcard::to_allocvec(&data).expect("encodes");
    assert_eq!(postcard::from_bytes::<ForkData>(&bytes), Ok(data));
    assert!(postcard::from_bytes::<RRefMessage>(&[9, 0, 0]).is_err());
    assert_eq!(
        alloc::string::ToString::to_string(&ControlKind::ChildAccept),
        "RREF_CHILD_ACCEPT"
    );
}
