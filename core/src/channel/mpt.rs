//! The `mpt` channel's records: the descriptor of a tensor in a frame, the header before
//! each stripe on a connection, the hello that opens a connection, and how a transfer is cut into
//! stripes. Both ends compute the same plan ([`stripes`]) from the length, so a receiver
//! checks every header against the stripe it expects before it reads a byte into place.

#[cfg(feature = "alloc")]
use alloc::vec::Vec;

use super::{DecodeError, FieldReader, FieldWriter, Record};

/// A stripe header: its tag, 4 reserved bytes (zero), then the transfer id, the offset
/// and the length.
const STRIPE: Record<4, 3> = Record {
    magic: *b"RDMP",
    what: "mpt stripe header",
};
/// Bytes of a stripe header: magic, reserved, transfer id, offset, length.
pub const STRIPE_HEADER_LEN: usize = 32;

/// Where each connection's stripe of a `len`-byte transfer lies, as `(offset, len)`: equal
/// shares over `len / min_stripe_len` connections, at least one and at most `connections` (the first
/// `len % used` get one byte more). Connections with nothing to carry are left out.
#[cfg(feature = "alloc")]
pub fn stripes(len: usize, connections: usize, min_stripe_len: usize) -> Vec<(usize, usize)> {
    let used = (len / min_stripe_len.max(1)).clamp(1, connections.max(1));
    let (share, extra) = (len / used, len % used);
    let mut out = Vec::with_capacity(used);
    let mut offset = 0;
    for connection in 0..used {
        let n = share + usize::from(connection < extra);
        if n > 0 || (connection == 0 && len == 0) {
            out.push((offset, n));
        }
        offset += n;
    }
    out
}

/// How a receiver reads the stripe `(offset, len)` into a device runtime's staging
/// buffers of `piece_len` bytes (`cuda_basic` carried by mpt): consecutive pieces
/// `(offset, len)`, none crossing a multiple of `piece_len` in the tensor, so that a
/// piece lies within one of the tensor's chunks whichever connection reads it. An empty stripe
/// has no pieces.
pub fn pieces(
    (offset, len): (usize, usize),
    piece_len: usize,
) -> impl Iterator<Item = (usize, usize)> {
    let piece_len = piece_len.max(1);
    let end = offset.saturating_add(len);
    let mut at = offset;
    core::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let boundary = (at / piece_len).saturating_add(1).saturating_mul(piece_len);
        let piece = (at, boundary.min(end) - at);
        at = boundary.min(end);
        Some(piece)
    })
}

/// A stripe header as sent before the stripe's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StripeHeader {
    /// The transfer this stripe belongs to.
    pub transfer_id: u64,
    /// Offset of the stripe in the tensor.
    pub offset: u64,
    /// Length of the stripe.
    pub len: u64,
}

impl StripeHeader {
    /// The wire form.
    pub fn encode(&self) -> [u8; STRIPE_HEADER_LEN] {
        STRIPE.encode(&[0; 4], [self.transfer_id, self.offset, self.len])
    }

    /// Parses a header; `None` for a wrong magic or non-zero reserved bytes.
    pub fn decode(bytes: &[u8; STRIPE_HEADER_LEN]) -> Option<StripeHeader> {
        match STRIPE.decode(bytes) {
            Ok(([0, 0, 0, 0], [transfer_id, offset, len])) => Some(StripeHeader {
                transfer_id,
                offset,
                len,
            }),
            _ => None,
        }
    }
}

/// An encoded [`MptDescriptor`]: its tag and the transfer id.
const DESCRIPTOR: Record<0, 1> = Record {
    magic: *b"RDMT",
    what: "mpt descriptor",
};

/// Where a tensor sent over mpt is: the id of the transfer whose stripes follow the
/// frame on the pipe's connections. The frame's tensor entry carries the length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MptDescriptor {
    /// The transfer id every stripe header of this tensor carries.
    pub transfer_id: u64,
}

impl MptDescriptor {
    /// The encoded size: a 4-byte tag and the little-endian transfer id.
    pub const ENCODED_LEN: usize = 12;

    /// The wire form.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        DESCRIPTOR.encode(&[], [self.transfer_id])
    }

    /// Parses what [`encode`](Self::encode) wrote.
    ///
    /// # Errors
    /// [`DecodeError`] for another length or tag.
    pub fn decode(bytes: &[u8]) -> Result<MptDescriptor, DecodeError> {
        let ([], [transfer_id]) = DESCRIPTOR.decode(bytes)?;
        Ok(MptDescriptor { transfer_id })
    }
}

/// What starts an encoded [`ConnectionHello`].
const HELLO_MAGIC: [u8; 4] = *b"RDML";
/// The most connections one pipe may open.
pub const MAX_CONNECTIONS: u16 = 64;

/// The first bytes on a connection: which set of connections it belongs to and where in
/// it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionHello {
    /// The token of the set (the pipe's, from its handshake).
    pub token: u64,
    /// This connection's index, below `count`.
    pub index: u16,
    /// Connections in the set, 1 to [`MAX_CONNECTIONS`].
    pub count: u16,
}

impl ConnectionHello {
    /// The encoded size: tag, index, count, token.
    pub const ENCODED_LEN: usize = 16;

    /// The wire form.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        let mut writer = FieldWriter::tagged(&mut out, &HELLO_MAGIC);
        writer.put(&self.index.to_le_bytes());
        writer.put(&self.count.to_le_bytes());
        writer.put(&self.token.to_le_bytes());
        out
    }

    /// Parses what [`encode`](Self::encode) wrote, checking that the index lies in a
    /// set of 1 to [`MAX_CONNECTIONS`] connections.
    ///
    /// # Errors
    /// [`DecodeError`] for another length or tag, or an index outside its set.
    pub fn decode(bytes: &[u8]) -> Result<ConnectionHello, DecodeError> {
        let what = "mpt connection hello";
        let mut reader = FieldReader::tagged(bytes, what, Self::ENCODED_LEN, &HELLO_MAGIC)?;
        let index = u16::from_le_bytes(reader.take());
        let count = u16::from_le_bytes(reader.take());
        let token = u64::from_le_bytes(reader.take());
        if count == 0 || count > MAX_CONNECTIONS || index >= count {
            return Err(DecodeError::BadTag { what });
        }
        Ok(ConnectionHello {
            token,
            index,
            count,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn stripes_cover_the_tensor_once() {
        assert_eq!(stripes(0, 4, 1), [(0, 0)]);
        assert_eq!(stripes(10, 4, 1), [(0, 3), (3, 3), (6, 2), (8, 2)]);
        assert_eq!(stripes(3, 4, 1), [(0, 1), (1, 1), (2, 1)]);
        assert_eq!(stripes(100, 4, 1000), [(0, 100)]);
        assert_eq!(
            stripes(3000, 4, 1000),
            [(0, 1000), (1000, 1000), (2000, 1000)]
        );
    }

    #[test]
    fn pieces_stop_at_every_multiple_of_the_piece_length() {
        let cut = |stripe, piece| pieces(stripe, piece).collect::<Vec<_>>();
        assert_eq!(cut((0, 10), 4), [(0, 4), (4, 4), (8, 2)]);
        assert_eq!(cut((3, 10), 4), [(3, 1), (4, 4), (8, 4), (12, 1)]);
        assert_eq!(cut((8, 4), 4), [(8, 4)]);
        assert!(cut((5, 0), 4).is_empty());
        assert_eq!(cut((2, 3), 0), [(2, 1), (3, 1), (4, 1)]);
    }

    proptest! {
        #[test]
        fn pieces_partition_a_stripe(offset in 0usize..100_000, len in 0usize..100_000, piece in 1usize..5_000) {
            let mut next = offset;
            for (at, n) in pieces((offset, len), piece) {
                prop_assert_eq!(at, next);
                prop_assert!(n > 0 && n <= piece);
                prop_assert_eq!(at / piece, (at + n - 1) / piece, "crosses a multiple");
                next += n;
            }
            prop_assert_eq!(next, offset + len);
        }

        #[test]
        fn stripes_partition(len in 0usize..1_000_000, connections in 1usize..16, min in 0usize..10_000) {
            let plan = stripes(len, connections, min);
            prop_assert!(!plan.is_empty() && plan.len() <= connections);
            if plan.len() > 1 {
                prop_assert!(plan.iter().all(|&(_, n)| n >= min), "{:?}", plan);
            }
            let mut next = 0;
            for (offset, n) in &plan {
                prop_assert_eq!(*offset, next);
                next += n;
            }
            prop_assert_eq!(next, len);
        }

        #[test]
        fn headers_round_trip(id in any::<u64>(), offset in any::<u64>(), len in any::<u64>()) {
            let h = StripeHeader { transfer_id: id, offset, len };
            prop_assert_eq!(StripeHeader::decode(&h.encode()), Some(h));
        }
    }

    #[test]
    fn garbage_is_no_header() {
        assert_eq!(StripeHeader::decode(&[0u8; STRIPE_HEADER_LEN]), None);
        let mut raw = StripeHeader {
            transfer_id: 1,
            offset: 0,
            len: 1,
        }
        .encode();
        raw[5] = 1;
        assert_eq!(StripeHeader::decode(&raw), None);
    }

    #[test]
    fn descriptors_and_hellos_round_trip_and_refuse_garbage() {
        let d = MptDescriptor { transfer_id: 77 };
        assert_eq!(MptDescriptor::decode(&d.encode()), Ok(d));
        assert!(MptDescriptor::decode(&[0u8; MptDescriptor::ENCODED_LEN]).is_err());
        assert!(MptDescriptor::decode(&d.encode()[..11]).is_err());
        let h = ConnectionHello {
            token: 9,
            index: 3,
            count: 4,
        };
        assert_eq!(ConnectionHello::decode(&h.encode()), Ok(h));
        for bad in [
            ConnectionHello { index: 4, ..h },
            ConnectionHello {
                count: 0,
                index: 0,
                ..h
            },
            ConnectionHello {
                count: MAX_CONNECTIONS + 1,
                ..h
            },
        ] {
            assert!(ConnectionHello::decode(&bad.encode()).is_err(), "{bad:?}");
        }
        assert!(ConnectionHello::decode(&[0u8; ConnectionHello::ENCODED_LEN]).is_err());
    }
}
