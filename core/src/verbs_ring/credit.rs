//! Ring-buffer placement and credit accounting for small messages.
//!
//! Each direction of a connection has one receive ring of `len` bytes (a power of two) in
//! the receiver's registered memory. The sender places each message right after the
//! previous one, wrapping at the end (a message that crosses the end is written as two
//! pieces), and signals it with one RDMA write-with-immediate whose immediate is the
//! message length. The receiver reads messages in the same order from its own head.
//!
//! Credits: the sender may have at most `len` bytes and `slots` messages (the receive work
//! requests the receiver posted) unacknowledged. The receiver acknowledges consumed
//! messages by count; the sender remembers the length of each message in flight, so a
//! count is enough to free bytes. [`RingSender`] and [`RingReceiver`] hold that state;
//! they detect a peer that breaks the protocol (acks or messages it cannot have) and
//! return an error instead of corrupting the ring. This module decides placement, credit
//! and when to acknowledge; the [`RingEndpoint`](super::RingEndpoint) drives it.

use alloc::collections::VecDeque;
use core::fmt;

/// Where a message goes in the ring: one piece, or two when it wraps past the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// Offset and length of the first piece (from the current head towards the end).
    pub first: (u32, u32),
    /// Length of the second piece, which always starts at offset 0.
    pub wrapped: u32,
}

impl Placement {
    /// Total length of the message.
    pub fn len(&self) -> u32 {
        self.first.1 + self.wrapped
    }

    /// Whether the message is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Places `len` bytes at `head` in a ring of `ring_len` bytes (`len <= ring_len`).
    fn at(head: u64, len: u32, ring_len: u32) -> Placement {
        let offset = (head % u64::from(ring_len)) as u32;
        let to_end = ring_len - offset;
        if len <= to_end {
            Placement {
                first: (offset, len),
                wrapped: 0,
            }
        } else {
            Placement {
                first: (offset, to_end),
                wrapped: len - to_end,
            }
        }
    }
}

/// A peer broke the ring protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RingError {
    /// The ring length is not a nonzero power of two, or there are no slots.
    Geometry {
        /// Ring length.
        len: u32,
        /// Message slots.
        slots: u32,
    },
    /// The peer acknowledged more messages than are in flight.
    OverAck {
        /// Count in the acknowledgement.
        acked: u32,
        /// Messages in flight.
        in_flight: usize,
    },
    /// The peer wrote a message that does not fit the credits it was given.
    Overrun {
        /// Length in the immediate.
        len: u32,
        /// Bytes of credit the peer had.
        free_bytes: u32,
        /// Messages of credit the peer had.
        free_slots: u32,
    },
}

impl fmt::Display for RingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            RingError::Geometry { len, slots } => {
                write!(f, "invalid ring geometry: {len} bytes, {slots} slots")
            }
            RingError::OverAck { acked, in_flight } => write!(
                f,
                "the peer acknowledged {acked} messages but only {in_flight} are in flight"
            ),
            RingError::Overrun {
                len,
                free_bytes,
                free_slots,
            } => write!(
                f,
                "the peer sent a {len}-byte message with {free_bytes} bytes and {free_slots} \
                 slots of credit left"
            ),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for RingError {}

fn check_geometry(len: u32, slots: u32) -> Result<(), RingError> {
    if len.is_power_of_two() && slots > 0 {
        Ok(())
    } else {
        Err(RingError::Geometry { len, slots })
    }
}

/// The sending side of one ring: where the next message goes and how much credit is left.
#[derive(Debug, Clone)]
pub struct RingSender {
    len: u32,
    slots: u32,
    /// Total bytes ever placed.
    head: u64,
    /// Bytes placed but not acknowledged.
    in_flight_bytes: u32,
    /// Length of each unacknowledged message, oldest first.
    in_flight: VecDeque<u32>,
}

impl RingSender {
    /// A sender for a peer ring of `len` bytes with `slots` receive slots.
    pub fn new(len: u32, slots: u32) -> Result<Self, RingError> {
        check_geometry(len, slots)?;
        Ok(RingSender {
            len,
            slots,
            head: 0,
            in_flight_bytes: 0,
            in_flight: VecDeque::new(),
        })
    }

    /// Ring length: the largest message that can ever be sent.
    pub fn ring_len(&self) -> u32 {
        self.len
    }

    /// Bytes of credit left.
    pub fn free_bytes(&self) -> u32 {
        self.len - self.in_flight_bytes
    }

    /// Messages of credit left.
    pub fn free_slots(&self) -> u32 {
        self.slots
            .saturating_sub(u32::try_from(self.in_flight.len()).unwrap_or(u32::MAX))
    }

    /// Messages sent and not yet acknowledged.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Reserves room for a `len`-byte message, or `None` while credits are short (the
    /// caller waits for an acknowledgement). `len` above [`ring_len`](Self::ring_len) never
    /// fits; callers reject it before.
    pub fn reserve(&mut self, len: u32) -> Option<Placement> {
        if len > self.free_bytes() || self.free_slots() == 0 {
            return None;
        }
        let placement = Placement::at(self.head, len, self.len);
        self.head += u64::from(len);
        self.in_flight_bytes += len;
        self.in_flight.push_back(len);
        Some(placement)
    }

    /// Applies an acknowledgement of the `count` oldest messages in flight.
    pub fn acknowledge(&mut self, count: u32) -> Result<(), RingError> {
        let n = usize::try_from(count).unwrap_or(usize::MAX);
        if n > self.in_flight.len() {
            return Err(RingError::OverAck {
                acked: count,
                in_flight: self.in_flight.len(),
            });
        }
        for len in self.in_flight.drain(..n) {
            self.in_flight_bytes -= len;
        }
        Ok(())
    }
}

/// The receiving side of one ring: where the next message is and when to acknowledge.
#[derive(Debug, Clone)]
pub struct RingReceiver {
    len: u32,
    slots: u32,
    /// Total bytes ever consumed.
    head: u64,
    /// Messages consumed and not yet acknowledged, and their bytes.
    unacked: u32,
    unacked_bytes: u32,
}

impl RingReceiver {
    /// A receiver for a ring of `len` bytes with `slots` receive slots posted.
    pub fn new(len: u32, slots: u32) -> Result<Self, RingError> {
        check_geometry(len, slots)?;
        Ok(RingReceiver {
            len,
            slots,
            head: 0,
            unacked: 0,
            unacked_bytes: 0,
        })
    }

    /// Where the next `len`-byte message (in arrival order) lies; marks it consumed, to be
    /// acknowledged. A message that cannot fit the credits the sender still had (the ring
    /// minus what is consumed but not acknowledged) means the sender ignored its credits.
    pub fn accept(&mut self, len: u32) -> Result<Placement, RingError> {
        let free_bytes = self.len - self.unacked_bytes;
        let free_slots = self.slots - self.unacked;
        if len > free_bytes || free_slots == 0 {
            return Err(RingError::Overrun {
                len,
                free_bytes,
                free_slots,
            });
        }
        let placement = Placement::at(self.head, len, self.len);
        self.head += u64::from(len);
        self.unacked += 1;
        self.unacked_bytes += len;
        Ok(placement)
    }

    /// Messages consumed and not acknowledged yet.
    pub fn unacked(&self) -> u32 {
        self.unacked
    }

    /// The count to acknowledge now, if any, and resets it. An acknowledgement is due when
    /// a quarter of the slots or of the bytes is waiting, or whenever `idle` (no further
    /// message has arrived): a sender blocked on credits is then always released.
    pub fn take_ack(&mut self, idle: bool) -> Option<u32> {
        let due = self.unacked > 0
            && (idle
                || self.unacked >= (self.slots / 4).max(1)
                || self.unacked_bytes >= (self.len / 4).max(1));
        if !due {
            return None;
        }
        let count = self.unacked;
        self.unacked = 0;
        self.unacked_bytes = 0;
        Some(count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::vec;

    #[test]
    fn geometry_is_checked() {
        assert!(RingSender::new(0, 1).is_err());
        assert!(RingSender::new(96, 1).is_err());
        assert!(RingReceiver::new(64, 0).is_err());
        assert!(RingReceiver::new(64, 1).is_ok());
    }

    #[test]
    fn wraps_into_two_pieces() {
        let mut tx = RingSender::new(16, 8).unwrap();
        assert_eq!(
            tx.reserve(10),
            Some(Placement {
                first: (0, 10),
                wrapped: 0
            })
        );
        tx.acknowledge(1).unwrap();
        let p = tx.reserve(10).unwrap();
        assert_eq!(
            p,
            Placement {
                first: (10, 6),
                wrapped: 4
            }
        );
        assert_eq!(p.len(), 10);
        assert_eq!(tx.free_bytes(), 6);
    }

    #[test]
    fn credits_exhaust_by_bytes_and_by_slots() {
        let mut tx = RingSender::new(16, 2).unwrap();
        assert!(tx.reserve(12).is_some());
        assert_eq!(tx.reserve(5), None, "4 bytes left");
        assert!(tx.reserve(4).is_some());
        assert_eq!(tx.reserve(0), None, "no slot left");
        tx.acknowledge(1).unwrap();
        assert_eq!(tx.free_bytes(), 12);
        assert_eq!(
            tx.acknowledge(2),
            Err(RingError::OverAck {
                acked: 2,
                in_flight: 1
            })
        );
    }

    #[test]
    fn receiver_catches_overrun_and_acks_when_idle() {
        let mut rx = RingReceiver::new(16, 8).unwrap();
        rx.accept(10).unwrap();
        assert_eq!(rx.take_ack(false), Some(1), "10 bytes >= a quarter");
        rx.accept(1).unwrap();
        assert_eq!(rx.take_ack(false), None);
        assert_eq!(rx.take_ack(true), Some(1));
        assert_eq!(rx.take_ack(true), None);
        rx.accept(16).unwrap();
        assert!(matches!(rx.accept(1), Err(RingError::Overrun { .. })));
    }

    proptest! {
        /// A sender and receiver driven by random sizes and ack timing agree on every
        /// placement, never exceed the ring, and never lose a message.
        #[test]
        fn sender_and_receiver_agree(
            shift in 2u32..10, slots in 1u32..8,
            ops in proptest::collection::vec((0u32..1024, any::<bool>()), 1..200),
        ) {
            let len = 1u32 << shift;
            let mut tx = RingSender::new(len, slots).unwrap();
            let mut rx = RingReceiver::new(len, slots).unwrap();
            let mut sent = 0usize;
            let mut received = 0usize;
            // Model of the ring contents: which message owns each byte.
            let mut owner = vec![usize::MAX; len as usize];
            for (size, deliver) in ops {
                let size = size % (len + 1);
                if let Some(p) = tx.reserve(size) {
                    for i in 0..p.first.1 { owner[(p.first.0 + i) as usize] = sent; }
                    for i in 0..p.wrapped { owner[i as usize] = sent; }
                    // Deliver it at once: the receiver sees the same placement.
                    let q = rx.accept(size).unwrap();
                    prop_assert_eq!(p, q);
                    for i in 0..q.first.1 { prop_assert_eq!(owner[(q.first.0 + i) as usize], sent); }
                    for i in 0..q.wrapped { prop_assert_eq!(owner[i as usize], sent); }
                    sent += 1;
                    received += 1;
                } else {
                    prop_assert!(size > tx.free_bytes() || tx.free_slots() == 0);
                }
                if let Some(count) = rx.take_ack(deliver) {
                    tx.acknowledge(count).unwrap();
                }
                prop_assert!(tx.free_bytes() <= len);
                prop_assert!(tx.in_flight() <= slots as usize);
            }
            // Idle acks always release everything.
            if let Some(count) = rx.take_ack(true) { tx.acknowledge(count).unwrap(); }
            prop_assert_eq!(tx.free_bytes(), len);
            prop_assert_eq!(tx.in_flight(), 0);
            prop_assert_eq!(sent, received);
        }
    }
}
