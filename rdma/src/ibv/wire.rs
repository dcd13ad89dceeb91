//! The connection information two RC queue pairs exchange over the bootstrap stream, and its
//! fixed 52-byte wire format.
//!
//! Each side sends one [`ConnectionInfo`] and reads the peer's: what the peer's queue pair
//! needs to reach this one (LID, GID, QP number, first packet sequence number, path MTU) and
//! where to write small messages (the receive ring's address, length and rkey, and how many
//! receive work requests are posted for it). This module only encodes and validates: it
//! does no I/O beyond the caller's `Read + Write` in [`exchange`], and it decides nothing
//! about which device or GID to use.
//!
//! What travels on the data path besides raw bytes, the 32-bit immediate of each ring
//! message ([`MessageImm`]) and the descriptor of a large message ([`LargeDescriptor`]),
//! is core's (`rdzv_core::verbs_ring`), re-exported here.
//!
//! Connection record layout (big-endian): magic `RZIB` (4), version (1), path MTU as `ibv_mtu` (1), LID (2),
//! QP number (4), PSN (4), GID (16), ring address (8), ring length (4), ring rkey (4),
//! receive slots (4).

use std::io::{self, Read, Write};

use super::topology::{Gid, Mtu};

pub use rdzv_core::verbs_ring::{LargeDescriptor, MessageImm, DESCRIPTOR_LEN, MAX_RING_LEN};

/// First bytes of every connection record.
pub const MAGIC: [u8; 4] = *b"RZIB";
/// Version of the record layout.
pub const VERSION: u8 = 1;
/// Encoded length of a [`ConnectionInfo`].
pub const ENCODED_LEN: usize = 52;
/// QP numbers and PSNs are 24-bit quantities.
pub const MAX_24BIT: u32 = 0x00ff_ffff;

/// What a peer needs to connect its RC queue pair to ours and to write into our ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionInfo {
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// GID of the selected port and GID index.
    pub gid: Gid,
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// First packet sequence number this side sends with (24 bits).
    pub psn: u32,
    /// Active MTU of the port; the path MTU is the smaller of both sides'.
    pub mtu: Mtu,
    /// Virtual address of the receive ring.
    pub ring_addr: u64,
    /// Length of the receive ring in bytes (a power of two).
    pub ring_len: u32,
    /// Remote key of the receive ring's memory region.
    pub ring_rkey: u32,
    /// Receive work requests posted for incoming messages: the peer must not have more
    /// unacknowledged messages in flight.
    pub recv_slots: u32,
}

/// Why a received connection record was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The record does not start with [`MAGIC`]: the peer is not an rdzv ibv endpoint.
    #[error("the peer's RDMA connection record has a bad magic {found:02x?} (expected \"RZIB\")")]
    BadMagic {
        /// The first four bytes received.
        found: [u8; 4],
    },
    /// The peer speaks another version of the record.
    #[error("the peer's RDMA connection record has version {found}, expected {VERSION}")]
    Version {
        /// The version received.
        found: u8,
    },
    /// The MTU code is not an `ibv_mtu` value.
    #[error("the peer's RDMA connection record has an invalid MTU code {code}")]
    Mtu {
        /// The code received.
        code: u8,
    },
    /// A QP number or PSN does not fit in 24 bits.
    #[error("the peer's RDMA connection record has {field} = {value:#x}, above 24 bits")]
    Not24Bit {
        /// `qpn` or `psn`.
        field: &'static str,
        /// The value received.
        value: u32,
    },
    /// The ring length is zero, not a power of two, or above [`MAX_RING_LEN`].
    #[error("the peer's RDMA receive ring length {len} is not a power of two from 1 to 2^30")]
    RingLen {
        /// The length received.
        len: u32,
    },
    /// The ring's address range wraps around the address space.
    #[error("the peer's RDMA receive ring at {addr:#x} (+{len}) wraps around the address space")]
    RingRange {
        /// Ring address.
        addr: u64,
        /// Ring length.
        len: u32,
    },
    /// The peer posted no receive slots.
    #[error("the peer's RDMA connection record advertises no receive slots")]
    NoSlots,
}

impl ConnectionInfo {
    /// Encodes the record.
    pub fn encode(&self) -> [u8; ENCODED_LEN] {
        let mut out = [0u8; ENCODED_LEN];
        let mut at = 0;
        let mut put = |bytes: &[u8]| {
            if let Some(dst) = out.get_mut(at..at + bytes.len()) {
                dst.copy_from_slice(bytes);
            }
            at += bytes.len();
        };
        put(&MAGIC);
        put(&[VERSION, mtu_code(self.mtu)]);
        put(&self.lid.to_be_bytes());
        put(&self.qpn.to_be_bytes());
        put(&self.psn.to_be_bytes());
        put(&self.gid.0);
        put(&self.ring_addr.to_be_bytes());
        put(&self.ring_len.to_be_bytes());
        put(&self.ring_rkey.to_be_bytes());
        put(&self.recv_slots.to_be_bytes());
        out
    }

    /// Decodes and validates a record.
    pub fn decode(bytes: &[u8; ENCODED_LEN]) -> Result<Self, WireError> {
        let mut reader = Fields { bytes, at: 0 };
        let magic: [u8; 4] = reader.take();
        if magic != MAGIC {
            return Err(WireError::BadMagic { found: magic });
        }
        let [version, mtu] = reader.take();
        if version != VERSION {
            return Err(WireError::Version { found: version });
        }
        let mtu = Mtu::from_raw(u32::from(mtu)).ok_or(WireError::Mtu { code: mtu })?;
        let lid = u16::from_be_bytes(reader.take());
        let qpn = u32::from_be_bytes(reader.take());
        let psn = u32::from_be_bytes(reader.take());
        let gid = Gid(reader.take());
        let ring_addr = u64::from_be_bytes(reader.take());
        let ring_len = u32::from_be_bytes(reader.take());
        let ring_rkey = u32::from_be_bytes(reader.take());
        let recv_slots = u32::from_be_bytes(reader.take());
        for (field, value) in [("qpn", qpn), ("psn", psn)] {
            if value > MAX_24BIT {
                return Err(WireError::Not24Bit { field, value });
            }
        }
        if !ring_len.is_power_of_two() || ring_len > MAX_RING_LEN {
            return Err(WireError::RingLen { len: ring_len });
        }
        if ring_addr.checked_add(u64::from(ring_len)).is_none() {
            return Err(WireError::RingRange {
                addr: ring_addr,
                len: ring_len,
            });
        }
        if recv_slots == 0 {
            return Err(WireError::NoSlots);
        }
        Ok(ConnectionInfo {
            lid,
            gid,
            qpn,
            psn,
            mtu,
            ring_addr,
            ring_len,
            ring_rkey,
            recv_slots,
        })
    }
}

/// Sequential fixed-size reads from a record of known length.
struct Fields<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Fields<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        if let Some(src) = self.bytes.get(self.at..self.at + N) {
            out.copy_from_slice(src);
        }
        self.at += N;
        out
    }
}

/// The `ibv_mtu` code of an MTU (1 = 256 … 5 = 4096).
fn mtu_code(mtu: Mtu) -> u8 {
    match mtu {
        Mtu::B256 => 1,
        Mtu::B512 => 2,
        Mtu::B1024 => 3,
        Mtu::B2048 => 4,
        Mtu::B4096 => 5,
    }
}

/// Failure of [`exchange`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExchangeError {
    /// Writing our record or reading the peer's failed.
    #[error("RDMA connection exchange over the bootstrap stream failed")]
    Io(#[from] io::Error),
    /// The peer's record is invalid.
    #[error(transparent)]
    Wire(#[from] WireError),
}

/// Sends `ours` and reads the peer's record. Both sides write first: the record is far
/// smaller than any stream's buffer, so this cannot deadlock.
pub fn exchange<S: Read + Write + ?Sized>(
    stream: &mut S,
    ours: &ConnectionInfo,
) -> Result<ConnectionInfo, ExchangeError> {
    stream.write_all(&ours.encode())?;
    stream.flush()?;
    let mut theirs = [0u8; ENCODED_LEN];
    stream.read_exact(&mut theirs)?;
    Ok(ConnectionInfo::decode(&theirs)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::net::Ipv4Addr;

    fn sample() -> ConnectionInfo {
        ConnectionInfo {
            lid: 0,
            gid: Gid::from(Ipv4Addr::new(10, 0, 2, 15)),
            qpn: 0x11,
            psn: 0xabcdef,
            mtu: Mtu::B1024,
            ring_addr: 0x7f00_1234_5000,
            ring_len: 1 << 16,
            ring_rkey: 0xdead_beef,
            recv_slots: 64,
        }
    }

    #[test]
    fn layout_is_fixed() {
        let bytes = sample().encode();
        assert_eq!(&bytes[..4], b"RZIB");
        assert_eq!(bytes[4], 1);
        assert_eq!(bytes[5], 3, "IBV_MTU_1024");
        assert_eq!(&bytes[8..12], &[0, 0, 0, 0x11]);
        assert_eq!(&bytes[12..16], &[0, 0xab, 0xcd, 0xef]);
        assert_eq!(&bytes[26..32], &[0xff, 0xff, 10, 0, 2, 15]);
        assert_eq!(&bytes[44..48], &[0xde, 0xad, 0xbe, 0xef]);
        assert_eq!(&bytes[48..52], &[0, 0, 0, 64]);
    }

    #[test]
    fn rejects_invalid_records() {
        let good = sample().encode();
        let mut bad = good;
        bad[0] = b'X';
        assert!(matches!(
            ConnectionInfo::decode(&bad),
            Err(WireError::BadMagic { .. })
        ));
        let mut bad = good;
        bad[4] = 2;
        assert_eq!(
            ConnectionInfo::decode(&bad),
            Err(WireError::Version { found: 2 })
        );
        let mut bad = good;
        bad[5] = 9;
        assert_eq!(
            ConnectionInfo::decode(&bad),
            Err(WireError::Mtu { code: 9 })
        );
        let mut bad = good;
        bad[8] = 1;
        assert_eq!(
            ConnectionInfo::decode(&bad),
            Err(WireError::Not24Bit {
                field: "qpn",
                value: 0x0100_0011
            })
        );
        let mut bad = good;
        bad[40..44].copy_from_slice(&3u32.to_be_bytes());
        assert_eq!(
            ConnectionInfo::decode(&bad),
            Err(WireError::RingLen { len: 3 })
        );
        let mut bad = good;
        bad[32..40].copy_from_slice(&u64::MAX.to_be_bytes());
        assert!(matches!(
            ConnectionInfo::decode(&bad),
            Err(WireError::RingRange { .. })
        ));
        let mut bad = good;
        bad[48..52].copy_from_slice(&[0; 4]);
        assert_eq!(ConnectionInfo::decode(&bad), Err(WireError::NoSlots));
    }

    #[test]
    fn exchange_over_a_stream_pair() {
        let (mut a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        let ours = sample();
        let theirs = ConnectionInfo {
            qpn: 0x22,
            ..sample()
        };
        let peer = std::thread::spawn(move || exchange(&mut b, &theirs).unwrap());
        let got = exchange(&mut a, &ours).unwrap();
        assert_eq!(got.qpn, 0x22);
        assert_eq!(peer.join().unwrap(), ours);
    }

    #[test]
    fn exchange_reports_a_closed_stream() {
        let (mut a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        drop(b);
        assert!(matches!(
            exchange(&mut a, &sample()),
            Err(ExchangeError::Io(_))
        ));
    }

    fn mtu() -> impl Strategy<Value = Mtu> {
        prop_oneof![
            Just(Mtu::B256),
            Just(Mtu::B512),
            Just(Mtu::B1024),
            Just(Mtu::B2048),
            Just(Mtu::B4096)
        ]
    }

    proptest! {
        #[test]
        fn roundtrip(
            lid: u16, gid: [u8; 16], qpn in 0..=MAX_24BIT, psn in 0..=MAX_24BIT, mtu in mtu(),
            ring_addr in 0..=u64::MAX - (1 << 30), ring_shift in 0u32..=30, ring_rkey: u32, recv_slots in 1u32..,
        ) {
            let info = ConnectionInfo {
                lid, gid: Gid(gid), qpn, psn, mtu, ring_addr,
                ring_len: 1 << ring_shift, ring_rkey, recv_slots,
            };
            prop_assert_eq!(ConnectionInfo::decode(&info.encode()), Ok(info));
        }

        #[test]
        fn decode_never_panics(bytes in proptest::array::uniform32(any::<u8>()), tail: [u8; 20]) {
            let mut record = [0u8; ENCODED_LEN];
            record[..32].copy_from_slice(&bytes);
            record[32..].copy_from_slice(&tail);
            let _ = ConnectionInfo::decode(&record);
        }
    }
}
