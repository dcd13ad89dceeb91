//! Two ring endpoints over a simulated RC queue pair (quinn-proto's `Pair`), stepped by
//! events: no device, no clock, no sleeps. The simulation is what a device does: a posted
//! work request executes at the peer in order (a write lands in the peer's ring and, with
//! an immediate, consumes one of its receives), reads the registered memory it names when
//! it executes (so staged bytes must still be there), and completes locally afterwards.

use super::*;
use alloc::collections::BTreeSet;
use alloc::rc::Rc;
use alloc::vec;
use alloc::vec::Vec;
use core::cell::RefCell;
use proptest::prelude::*;

/// A zero-copy send's buffer, held by the endpoint; dropping it releases the address.
#[derive(Debug)]
struct Held {
    addr: u64,
    released: Rc<RefCell<BTreeSet<u64>>>,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.released.borrow_mut().insert(self.addr);
    }
}

/// The buffer a large message is read into: its address in the receiver's memory.
type Buf = u64;

/// A posted send work request, as it sits in the send queue.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Wr {
    /// Write at `offset` of the peer's ring: `Inline` bytes, or `Staged` bytes read from
    /// the send ring when it executes.
    Write {
        offset: u32,
        source: Source,
        imm: Option<u32>,
    },
    Ack(u32),
    Read(ReadRequest, WorkKind),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    Inline(Vec<u8>),
    Staged { at: u32, len: u32 },
}

/// One side: its endpoint, rings, registered memory, queues and what it received.
struct Side {
    ep: RingEndpoint<Held, Buf>,
    ring: Vec<u8>,
    send_ring: Vec<u8>,
    /// Registered buffers: (address, bytes).
    memory: Vec<(u64, Vec<u8>)>,
    next_addr: u64,
    released: Rc<RefCell<BTreeSet<u64>>>,
    recvs_posted: u32,
    /// Send work requests posted and whose completion was not polled (the QP's count).
    sends_posted: u32,
    max_send_wr: u32,
    queue: VecDeque<Wr>,
    cq: VecDeque<Completion>,
    /// Messages the application wants sent: bytes, and whether zero-copy.
    outbox: VecDeque<(Vec<u8>, bool)>,
    received: Vec<Vec<u8>>,
    /// Which message wrote each byte of this side's ring, and whether it was taken.
    owner: Vec<Option<(u64, bool)>>,
    arrivals_seen: u64,
}

impl Side {
    fn new(config: RingConfig, base: u64) -> Side {
        let depths = QueueDepths::for_slots(config.recv_slots);
        Side {
            ep: RingEndpoint::new(config).expect("geometry"),
            ring: vec![0; config.ring_len as usize],
            send_ring: vec![0; config.peer_ring_len as usize],
            memory: Vec::new(),
            next_addr: base,
            released: Rc::default(),
            recvs_posted: depths.recv,
            sends_posted: 0,
            max_send_wr: config.max_send_wr,
            queue: VecDeque::new(),
            cq: VecDeque::new(),
            outbox: VecDeque::new(),
            received: Vec::new(),
            owner: vec![None; config.ring_len as usize],
            arrivals_seen: 0,
        }
    }

    fn alloc(&mut self, bytes: Vec<u8>) -> u64 {
        let addr = self.next_addr;
        self.next_addr += bytes.len() as u64 + 4096;
        self.memory.push((addr, bytes));
        addr
    }

    /// The registered buffer holding `[addr, addr + len)`: its base, and those bytes.
    fn region(&mut self, addr: u64, len: u32) -> (u64, &mut [u8]) {
        let (base, bytes) = self
            .memory
            .iter_mut()
            .find(|(base, bytes)| {
                addr >= *base && addr + u64::from(len) <= *base + bytes.len() as u64
            })
            .expect("a READ names registered memory");
        let at = (addr - *base) as usize;
        (*base, &mut bytes[at..at + len as usize])
    }

    fn post(&mut self, wr: Wr) {
        self.sends_posted += 1;
        assert!(
            self.sends_posted <= self.max_send_wr,
            "the send queue overflows: {} posted",
            self.sends_posted
        );
        self.queue.push_back(wr);
    }

    /// Posts what the endpoint owes.
    fn drain(&mut self) {
        while let Some(t) = self.ep.poll_transmit() {
            match t {
                Transmit::Recv => self.recvs_posted += 1,
                Transmit::Ack { count } => self.post(Wr::Ack(count)),
                Transmit::Read(r) => self.post(Wr::Read(r, WorkKind::Read)),
                Transmit::RemoteRead(r) => self.post(Wr::Read(r, WorkKind::RemoteRead)),
            }
        }
    }

    /// Sends the outbox's head messages while the endpoint places them.
    fn send_pending(&mut self) {
        while let Some((bytes, large)) = self.outbox.front().cloned() {
            let (msg, held) = if large {
                let addr = self.alloc(bytes.clone());
                let descriptor = LargeDescriptor {
                    addr,
                    len: bytes.len() as u64,
                    rkey: 0x77,
                };
                (descriptor.encode().to_vec(), Some(addr))
            } else {
                (bytes, None)
            };
            let Some(writes) = self.ep.send(msg.len(), large).expect("fits") else {
                if let Some(addr) = held {
                    self.memory.retain(|(a, _)| *a != addr);
                }
                return;
            };
            self.outbox.pop_front();
            if let Some(addr) = held {
                let released = Rc::clone(&self.released);
                self.ep.hold(writes.seq, Held { addr, released });
            }
            for piece in writes.pieces() {
                let bytes = &msg[piece.range()];
                let source = if writes.inline {
                    Source::Inline(bytes.to_vec())
                } else {
                    self.send_ring[piece.offset as usize..][..bytes.len()].copy_from_slice(bytes);
                    Source::Staged {
                        at: piece.offset,
                        len: piece.len,
                    }
                };
                let imm = (piece == writes.last).then_some(writes.imm);
                self.post(Wr::Write {
                    offset: piece.offset,
                    source,
                    imm,
                });
            }
        }
    }

    /// Handles one completion, as the runtime's poll does.
    fn poll(&mut self) -> Result<(), Fault> {
        let Some(c) = self.cq.pop_front() else {
            return Ok(());
        };
        if WorkKind::of(c.wr_id) != WorkKind::Recv {
            self.sends_posted -= 1;
        }
        let result = self.ep.handle_completion(c);
        self.drain();
        result
    }

    /// Takes every message that is in, as the runtime's receive does.
    fn take(&mut self) -> Result<(), RingError> {
        while let Some(arrival) = self.ep.poll_arrival()? {
            match arrival {
                Arrival::Message(p) => {
                    let bytes = self.copy_out(p);
                    self.received.push(bytes);
                }
                Arrival::Descriptor(p) => {
                    let bytes = self.copy_out(p);
                    let (source, len) = self.ep.admit(&bytes, u64::MAX).expect("admitted");
                    let addr = self.alloc(vec![0; len]);
                    self.ep.start_read(source, addr, 0x55, addr);
                }
                Arrival::Large(addr) => {
                    let at = self
                        .memory
                        .iter()
                        .position(|(a, _)| *a == addr)
                        .expect("buffer");
                    let (_, bytes) = self.memory.swap_remove(at);
                    self.received.push(bytes);
                }
            }
            self.drain();
        }
        self.drain();
        Ok(())
    }

    /// Copies a message out of the ring, checking that no later message overwrote it.
    fn copy_out(&mut self, p: Placement) -> Vec<u8> {
        let seq = self.arrivals_seen;
        self.arrivals_seen += 1;
        let mut out = Vec::new();
        let ranges = [(p.first.0, p.first.1), (0, p.wrapped)];
        for (at, len) in ranges {
            for i in at..at + len {
                let owner = &mut self.owner[i as usize];
                assert_eq!(
                    owner.map(|o| o.0),
                    Some(seq),
                    "byte {i} of message {seq} was overwritten"
                );
                *owner = Some((seq, true));
            }
            out.extend_from_slice(&self.ring[at as usize..(at + len) as usize]);
        }
        out
    }
}

/// Two sides, `a` and `b`.
struct Pair {
    sides: [Side; 2],
    /// Messages whose immediate has landed in each side's ring: the next one's number.
    written: [u64; 2],
}

fn config(ring_len: u32, slots: u32, max_inline: u32, max_read_len: u64) -> RingConfig {
    RingConfig {
        ring_len,
        recv_slots: slots,
        peer_ring_len: ring_len,
        peer_recv_slots: slots,
        max_send_wr: QueueDepths::for_slots(slots).send,
        max_inline,
        max_read_len,
        max_large_message: u64::MAX,
    }
}

impl Pair {
    fn new(config: RingConfig) -> Pair {
        Pair {
            sides: [
                Side::new(config, 0x1000_0000),
                Side::new(config, 0x9000_0000),
            ],
            written: [0, 0],
        }
    }

    /// Executes the oldest work request side `from` posted, at the peer.
    fn deliver(&mut self, from: usize) -> bool {
        let to = 1 - from;
        let Some(wr) = self.sides[from].queue.pop_front() else {
            return false;
        };
        let [a, b] = &mut self.sides;
        let (src, dst) = if from == 0 { (a, b) } else { (b, a) };
        let wr_id = match wr {
            Wr::Write {
                offset,
                source,
                imm,
            } => {
                let bytes = match source {
                    Source::Inline(bytes) => bytes,
                    Source::Staged { at, len } => {
                        src.send_ring[at as usize..][..len as usize].to_vec()
                    }
                };
                let seq = self.written[to];
                for (i, byte) in bytes.iter().enumerate() {
                    let at = offset as usize + i;
                    if let Some((owner, taken)) = dst.owner[at] {
                        assert!(
                            taken || owner == seq,
                            "message {seq} overwrites unread message {owner}"
                        );
                    }
                    dst.owner[at] = Some((seq, false));
                    dst.ring[at] = *byte;
                }
                if let Some(imm) = imm {
                    self.written[to] += 1;
                    receive(dst, Received::WriteImm(imm));
                }
                WorkKind::Data.wr_id()
            }
            Wr::Ack(count) => {
                receive(dst, Received::SendImm(count));
                WorkKind::Ack.wr_id()
            }
            Wr::Read(r, kind) => {
                let (base, _) = dst.region(r.remote_addr, r.len);
                assert!(
                    !dst.released.borrow().contains(&base),
                    "a READ of the released buffer at {base:#x}"
                );
                let bytes = dst.region(r.remote_addr, r.len).1.to_vec();
                src.region(r.local_addr, r.len).1.copy_from_slice(&bytes);
                kind.wr_id()
            }
        };
        src.cq.push_back(ok(wr_id, Received::Other));
        true
    }

    /// Steps until nothing moves; fails on any fault.
    fn settle(&mut self) {
        for _ in 0..100_000 {
            let mut moved = false;
            for i in 0..2 {
                self.sides[i].send_pending();
                moved |= self.deliver(i);
                while !self.sides[i].cq.is_empty() {
                    self.sides[i].poll().expect("no fault");
                    moved = true;
                }
                let before = self.sides[i].received.len();
                self.sides[i].take().expect("no overrun");
                moved |= self.sides[i].received.len() != before;
            }
            if !moved
                && self
                    .sides
                    .iter()
                    .all(|s| s.queue.is_empty() && s.outbox.is_empty())
            {
                return;
            }
        }
        panic!("the pair never settles");
    }
}

fn receive(side: &mut Side, received: Received) {
    assert!(
        side.recvs_posted > 0,
        "receiver not ready: no receive posted"
    );
    side.recvs_posted -= 1;
    side.cq.push_back(ok(WorkKind::Recv.wr_id(), received));
}

fn ok(wr_id: u64, received: Received) -> Completion {
    Completion {
        wr_id,
        status: 0,
        vendor_err: 0,
        received,
    }
}

fn bytes(n: usize, tag: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31) ^ tag).collect()
}

#[test]
fn work_request_ids_keep_their_values() {
    let ids = [
        (WorkKind::Recv, 1u64 << 56),
        (WorkKind::Data, 2 << 56),
        (WorkKind::Ack, 3 << 56),
        (WorkKind::Read, 4 << 56),
        (WorkKind::RemoteRead, 5 << 56),
    ];
    for (kind, id) in ids {
        assert_eq!(kind.wr_id(), id);
        assert_eq!(WorkKind::of(id | 0x1234), kind);
    }
    assert_eq!(WorkKind::of(9 << 56), WorkKind::Unknown);
    assert_eq!(
        QueueDepths::for_slots(64),
        QueueDepths {
            recv: 128,
            send: 194
        }
    );
}

#[test]
fn a_wrapping_message_is_two_writes_the_last_with_the_immediate() {
    let mut ep: RingEndpoint<(), ()> = RingEndpoint::new(config(64, 8, 16, 4096)).unwrap();
    let first = ep.send(40, false).unwrap().unwrap();
    assert_eq!((first.seq, first.inline, first.to_end), (0, false, None));
    assert_eq!(
        first.last,
        Piece {
            offset: 0,
            start: 0,
            len: 40
        }
    );
    assert_eq!(first.imm, 40);
    ep.handle_completion(ok(WorkKind::Recv.wr_id(), Received::SendImm(1)))
        .unwrap();
    let second = ep.send(30, false).unwrap().unwrap();
    assert_eq!(
        second.to_end,
        Some(Piece {
            offset: 40,
            start: 0,
            len: 24
        })
    );
    assert_eq!(
        second.last,
        Piece {
            offset: 0,
            start: 24,
            len: 6
        }
    );
    assert!(!second.inline, "24 bytes exceed 16 inline");
    assert_eq!(ep.sends_in_flight(), 3);
    assert_eq!(
        ep.poll_transmit(),
        Some(Transmit::Recv),
        "the ack's receive comes back"
    );
    let descriptor = ep.send(DESCRIPTOR_LEN, true).unwrap().unwrap();
    assert_eq!(descriptor.imm, 0x8000_0014);
    assert!(!descriptor.inline, "20 bytes exceed 16 inline");
    assert_eq!(
        ep.send(65, false),
        Err(MessageTooLarge { len: 65, max: 64 })
    );
}

#[test]
fn sending_waits_for_credit_and_send_queue_room() {
    let mut ep: RingEndpoint<(), ()> = RingEndpoint::new(config(64, 2, 0, 4096)).unwrap();
    assert!(ep.send(10, false).unwrap().is_some());
    assert!(ep.send(10, false).unwrap().is_some());
    assert!(!ep.can_send(0), "no slot left");
    assert_eq!(ep.send(0, false), Ok(None));
    ep.handle_completion(ok(WorkKind::Recv.wr_id(), Received::SendImm(2)))
        .unwrap();
    assert!(ep.can_send(64));
    // Five send work requests: a message needs three free (two writes and an ack).
    let mut small: RingEndpoint<(), ()> = RingEndpoint::new(RingConfig {
        max_send_wr: 5,
        ..config(64, 8, 0, 4096)
    })
    .unwrap();
    for _ in 0..3 {
        assert!(small.send(1, false).unwrap().is_some());
    }
    assert!(!small.can_send(1));
    assert_eq!(small.send(1, false), Ok(None));
    small
        .handle_completion(ok(WorkKind::Data.wr_id(), Received::Other))
        .unwrap();
    assert!(small.can_send(1));
}

#[test]
fn a_failed_work_request_fails_the_endpoint_for_good() {
    let mut ep: RingEndpoint<(), ()> = RingEndpoint::new(config(64, 2, 0, 4096)).unwrap();
    ep.send(4, false).unwrap().unwrap();
    let failed = Completion {
        status: 12,
        vendor_err: 0x81,
        ..ok(WorkKind::Data.wr_id(), Received::Other)
    };
    let failure = WorkFailure {
        kind: WorkKind::Data,
        status: 12,
        vendor_err: 0x81,
    };
    assert_eq!(
        ep.handle_completion(failed),
        Err(Fault::Completion(failure))
    );
    assert_eq!(ep.sends_in_flight(), 0);
    let flushed = Completion {
        status: 5,
        ..ok(WorkKind::Recv.wr_id(), Received::Other)
    };
    assert_eq!(
        ep.handle_completion(flushed),
        Err(Fault::Completion(failure)),
        "the first failure stays"
    );
    assert_eq!(ep.failure(), Some(failure));
    assert_eq!(WorkKind::Data.operation(), "RDMA write with immediate");
    assert_eq!(ep.poll_transmit(), None, "a failed receive is not reposted");
}

#[test]
fn an_ack_for_messages_never_sent_is_a_protocol_fault() {
    let mut ep: RingEndpoint<(), ()> = RingEndpoint::new(config(64, 2, 0, 4096)).unwrap();
    assert_eq!(
        ep.handle_completion(ok(WorkKind::Recv.wr_id(), Received::SendImm(1))),
        Err(Fault::Protocol(RingError::OverAck {
            acked: 1,
            in_flight: 0
        }))
    );
    assert_eq!(ep.failure(), None);
}

#[test]
fn a_peer_that_ignores_its_credits_is_caught() {
    // 10 bytes consumed and not yet acknowledged (under a quarter), so the peer had 54.
    let mut ep: RingEndpoint<(), ()> = RingEndpoint::new(config(64, 8, 0, 4096)).unwrap();
    for imm in [MessageImm::Inline(10), MessageImm::Inline(60)] {
        ep.handle_completion(ok(WorkKind::Recv.wr_id(), Received::WriteImm(imm.encode())))
            .unwrap();
    }
    assert!(matches!(ep.poll_arrival(), Ok(Some(Arrival::Message(_)))));
    assert!(matches!(
        ep.poll_arrival(),
        Err(RingError::Overrun { len: 60, .. })
    ));
}

#[test]
fn acks_come_at_a_quarter_or_when_idle() {
    let mut ep: RingEndpoint<(), ()> = RingEndpoint::new(config(1024, 8, 0, 4096)).unwrap();
    for _ in 0..3 {
        ep.handle_completion(ok(WorkKind::Recv.wr_id(), Received::WriteImm(1)))
            .unwrap();
    }
    let mut transmits = Vec::new();
    while let Some(Arrival::Message(_)) = ep.poll_arrival().unwrap() {
        while let Some(t) = ep.poll_transmit() {
            transmits.push(t);
        }
    }
    // Three receives back; an ack at two messages (a quarter of 8 slots), one when idle.
    assert_eq!(
        transmits,
        [
            Transmit::Recv,
            Transmit::Recv,
            Transmit::Recv,
            Transmit::Ack { count: 2 },
            Transmit::Ack { count: 1 }
        ]
    );
}

#[test]
fn a_large_message_is_read_in_chunks_and_acked_when_in() {
    let mut ep: RingEndpoint<(), &str> = RingEndpoint::new(config(64, 1, 0, 1000)).unwrap();
    let descriptor = LargeDescriptor {
        addr: 0x5000,
        len: 4500,
        rkey: 9,
    };
    let imm = MessageImm::Descriptor(DESCRIPTOR_LEN as u32).encode();
    ep.handle_completion(ok(WorkKind::Recv.wr_id(), Received::WriteImm(imm)))
        .unwrap();
    assert_eq!(ep.poll_transmit(), Some(Transmit::Recv));
    let Ok(Some(Arrival::Descriptor(p))) = ep.poll_arrival() else {
        panic!("a descriptor");
    };
    assert_eq!(p.len(), DESCRIPTOR_LEN as u32);
    assert_eq!(
        ep.admit(&descriptor.encode(), 4000),
        Err(BadDescriptor {
            len: 4500,
            max: 4000,
            descriptor_len: 20
        })
    );
    assert_eq!(
        ep.admit(&[0; 3], 4000),
        Err(BadDescriptor {
            len: 0,
            max: 4000,
            descriptor_len: 3
        })
    );
    let (source, len) = ep.admit(&descriptor.encode(), u64::MAX).unwrap();
    assert_eq!(len, 4500);
    ep.start_read(source, 0x8000, 3, "buffer");
    // Five work requests in the send queue (3 * 1 + 2): four READs keep room for an ack.
    let reads: Vec<_> = core::iter::from_fn(|| ep.poll_transmit()).collect();
    assert_eq!(reads.len(), 4, "{reads:?}");
    assert_eq!(
        reads[1],
        Transmit::Read(ReadRequest {
            remote_addr: 0x5000 + 1000,
            rkey: 9,
            local_addr: 0x8000 + 1000,
            lkey: 3,
            len: 1000
        })
    );
    assert_eq!(ep.poll_arrival(), Ok(None));
    for _ in 0..4 {
        ep.handle_completion(ok(WorkKind::Read.wr_id(), Received::Other))
            .unwrap();
    }
    assert_eq!(ep.poll_arrival(), Ok(None), "a chunk is left");
    let last: Vec<_> = core::iter::from_fn(|| ep.poll_transmit()).collect();
    assert!(matches!(
        last[..],
        [Transmit::Read(ReadRequest { len: 500, .. })]
    ));
    ep.handle_completion(ok(WorkKind::Read.wr_id(), Received::Other))
        .unwrap();
    assert_eq!(ep.poll_arrival(), Ok(Some(Arrival::Large("buffer"))));
    assert_eq!(ep.poll_transmit(), Some(Transmit::Ack { count: 1 }));
}

#[test]
fn a_sent_large_message_holds_its_buffer_until_acked() {
    let released = Rc::new(RefCell::new(BTreeSet::new()));
    let mut ep: RingEndpoint<Held, ()> = RingEndpoint::new(config(64, 4, 0, 4096)).unwrap();
    for addr in [1, 2] {
        let w = ep.send(DESCRIPTOR_LEN, true).unwrap().unwrap();
        let released = Rc::clone(&released);
        ep.hold(w.seq, Held { addr, released });
    }
    ep.send(3, false).unwrap().unwrap();
    assert_eq!(ep.large_in_flight(), 2);
    ep.handle_completion(ok(WorkKind::Recv.wr_id(), Received::SendImm(1)))
        .unwrap();
    assert_eq!(*released.borrow(), BTreeSet::from([1]));
    ep.handle_completion(ok(WorkKind::Recv.wr_id(), Received::SendImm(2)))
        .unwrap();
    assert_eq!(*released.borrow(), BTreeSet::from([1, 2]));
    assert_eq!(ep.large_in_flight(), 0);
    assert!(!ep.is_flushed(), "the writes have not completed");
    for _ in 0..3 {
        ep.handle_completion(ok(WorkKind::Data.wr_id(), Received::Other))
            .unwrap();
    }
    assert!(ep.is_flushed());
}

#[test]
fn a_one_sided_read_is_chunked_and_counted_until_its_completions() {
    let mut ep: RingEndpoint<(), ()> = RingEndpoint::new(config(64, 1, 0, 100)).unwrap();
    ep.start_remote_read(ReadRange {
        remote_addr: 0x100,
        rkey: 1,
        local_addr: 0x200,
        lkey: 2,
        len: 650,
    });
    assert!(!ep.poll_remote_read());
    assert_eq!(
        ep.remote_reads_in_flight(),
        4,
        "five send work requests, one kept free"
    );
    let posted: Vec<_> = core::iter::from_fn(|| ep.poll_transmit()).collect();
    assert!(posted.iter().all(|t| matches!(t, Transmit::RemoteRead(_))));
    ep.handle_completion(ok(WorkKind::RemoteRead.wr_id(), Received::Other))
        .unwrap();
    assert!(!ep.poll_remote_read());
    let last: Vec<_> = core::iter::from_fn(|| ep.poll_transmit()).collect();
    assert_eq!(
        last,
        [Transmit::RemoteRead(ReadRequest {
            remote_addr: 0x100 + 400,
            rkey: 1,
            local_addr: 0x200 + 400,
            lkey: 2,
            len: 100
        })]
    );
    // A failure: posting stops, the chunks in flight still count until flushed.
    ep.stop_remote_read();
    assert_eq!(ep.remote_reads_in_flight(), 4);
    for _ in 0..4 {
        let _ = ep.handle_completion(Completion {
            status: 5,
            ..ok(WorkKind::RemoteRead.wr_id(), Received::Other)
        });
    }
    assert_eq!(ep.remote_reads_in_flight(), 0);
    assert!(ep.poll_remote_read());
}

#[test]
fn a_pair_moves_small_wrapping_and_large_messages_both_ways() {
    let mut pair = Pair::new(config(64, 2, 8, 700));
    let mut expected = [Vec::new(), Vec::new()];
    for (i, (n, large)) in [
        (10, false),
        (60, false),
        (0, false),
        (3000, true),
        (33, false),
    ]
    .into_iter()
    .enumerate()
    {
        for side in 0..2 {
            let msg = bytes(n, (i * 2 + side) as u8);
            pair.sides[side].outbox.push_back((msg.clone(), large));
            expected[1 - side].push(msg);
        }
    }
    pair.settle();
    for (s, expected) in pair.sides.iter().zip(expected) {
        assert_eq!(s.received, expected);
        assert!(s.ep.is_flushed());
        assert_eq!(s.ep.tx.free_bytes(), 64);
    }
}

/// What the application does next in the model test.
#[derive(Debug, Clone)]
enum Op {
    /// Side queues a message of this size (zero-copy when `large`).
    Send {
        side: usize,
        len: usize,
        large: bool,
    },
    /// The oldest work request of a side executes at the peer.
    Deliver(usize),
    /// A side polls one completion.
    Poll(usize),
    /// A side takes the messages that are in.
    Take(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let side = 0usize..2;
    prop_oneof![
        (side.clone(), 0usize..=512, prop::bool::weighted(0.2))
            .prop_map(|(side, len, large)| Op::Send { side, len, large }),
        side.clone().prop_map(Op::Deliver),
        side.clone().prop_map(Op::Poll),
        side.prop_map(Op::Take),
    ]
}

proptest! {
    /// Two endpoints under random interleavings of sends, deliveries, completions and
    /// receives, against a model (each direction a queue of messages in order): every
    /// message arrives once, in order, with its bytes; no write lands on bytes not yet
    /// read; the send queue never overflows and a receive is always posted for what
    /// arrives; no READ touches a released buffer; and once settled, every credit and
    /// every held buffer is back.
    #[test]
    fn a_pair_agrees_with_the_model(
        shift in 5u32..=9, slots in 1u32..6, max_inline in prop_oneof![Just(0u32), Just(8), Just(64)],
        max_read_len in 1u64..2000,
        ops in proptest::collection::vec(op(), 1..300),
    ) {
        let ring_len = 1u32 << shift;
        let mut pair = Pair::new(config(ring_len, slots, max_inline, max_read_len));
        let mut model: [VecDeque<Vec<u8>>; 2] = [VecDeque::new(), VecDeque::new()];
        let mut tag = 0u8;
        for op in ops {
            match op {
                Op::Send { side, len, large } => {
                    let len = if large { len * 7 } else { len % (ring_len as usize + 1) };
                    tag = tag.wrapping_add(1);
                    let msg = bytes(len, tag);
                    model[1 - side].push_back(msg.clone());
                    pair.sides[side].outbox.push_back((msg, large));
                    pair.sides[side].send_pending();
                }
                Op::Deliver(side) => { pair.deliver(side); }
                Op::Poll(side) => {
                    pair.sides[side].poll().expect("no fault");
                    pair.sides[side].send_pending();
                }
                Op::Take(side) => pair.sides[side].take().expect("no overrun"),
            }
            for (s, model) in pair.sides.iter_mut().zip(&mut model) {
                for got in s.received.drain(..) {
                    prop_assert_eq!(Some(got), model.pop_front());
                }
                prop_assert!(s.ep.sends_in_flight() <= s.max_send_wr);
                prop_assert!(s.ep.tx.in_flight() <= slots as usize);
            }
        }
        pair.settle();
        for (s, model) in pair.sides.iter_mut().zip(&mut model) {
            for got in s.received.drain(..) {
                prop_assert_eq!(Some(got), model.pop_front());
            }
            prop_assert!(model.is_empty());
            prop_assert!(s.ep.is_flushed());
            prop_assert_eq!(s.ep.tx.free_bytes(), ring_len);
            prop_assert_eq!(s.ep.rx.unacked(), 0);
            prop_assert_eq!(s.recvs_posted, QueueDepths::for_slots(slots).recv);
            prop_assert_eq!(s.sends_posted, 0);
        }
    }
}
