//! What travels on the data path besides raw bytes: the 32-bit immediate of each ring
//! message ([`MessageImm`]) and the descriptor of a large message that the receiver
//! fetches with RDMA READ ([`LargeDescriptor`]), with the admission check a receiver
//! applies to a descriptor before it allocates anything ([`admit_large`]).

use core::fmt;

/// Largest ring length: immediates carry ring byte counts in 31 bits.
pub const MAX_RING_LEN: u32 = 1 << 30;

/// Bit of the immediate that marks a large-message descriptor.
const IMM_DESCRIPTOR: u32 = 1 << 31;

/// What the 32-bit immediate of a ring message says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageImm {
    /// The message itself, this many bytes in the ring.
    Inline(u32),
    /// A [`LargeDescriptor`] of this many bytes in the ring: the receiver reads the data.
    Descriptor(u32),
}

impl MessageImm {
    /// The immediate value (host order; the verbs layer converts to network order).
    pub fn encode(self) -> u32 {
        match self {
            MessageImm::Inline(len) => len & !IMM_DESCRIPTOR,
            MessageImm::Descriptor(len) => (len & !IMM_DESCRIPTOR) | IMM_DESCRIPTOR,
        }
    }

    /// Reads an immediate.
    pub fn decode(imm: u32) -> Self {
        if imm & IMM_DESCRIPTOR != 0 {
            MessageImm::Descriptor(imm & !IMM_DESCRIPTOR)
        } else {
            MessageImm::Inline(imm)
        }
    }

    /// Bytes the message occupies in the ring.
    pub fn ring_len(self) -> u32 {
        match self {
            MessageImm::Inline(len) | MessageImm::Descriptor(len) => len,
        }
    }
}

/// Where a large message lies in the sender's registered memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LargeDescriptor {
    /// Virtual address of the first byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key of the registration covering it.
    pub rkey: u32,
}

/// Encoded length of a [`LargeDescriptor`].
pub const DESCRIPTOR_LEN: usize = 20;

impl LargeDescriptor {
    /// Encodes the descriptor (big-endian address, length, rkey).
    pub fn encode(&self) -> [u8; DESCRIPTOR_LEN] {
        let mut out = [0u8; DESCRIPTOR_LEN];
        out[..8].copy_from_slice(&self.addr.to_be_bytes());
        out[8..16].copy_from_slice(&self.len.to_be_bytes());
        out[16..].copy_from_slice(&self.rkey.to_be_bytes());
        out
    }

    /// Decodes a descriptor; `None` unless `bytes` is exactly [`DESCRIPTOR_LEN`] long.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let bytes: &[u8; DESCRIPTOR_LEN] = bytes.try_into().ok()?;
        let (addr, rest) = bytes.split_first_chunk::<8>()?;
        let (len, rkey) = rest.split_first_chunk::<8>()?;
        Some(LargeDescriptor {
            addr: u64::from_be_bytes(*addr),
            len: u64::from_be_bytes(*len),
            rkey: u32::from_be_bytes(rkey.try_into().ok()?),
        })
    }
}

/// A large message the receiver refuses before allocating for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadDescriptor {
    /// Announced length (0 when the descriptor did not parse).
    pub len: u64,
    /// The receiver's limit for this message.
    pub max: u64,
    /// Ring bytes of the descriptor.
    pub descriptor_len: u32,
}

impl fmt::Display for BadDescriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the RDMA peer announced a large message of {} bytes (limit {}, descriptor {} bytes)",
            self.len, self.max, self.descriptor_len
        )
    }
}

#[cfg(feature = "std")]
impl std::error::Error for BadDescriptor {}

/// The length of the zero-copy message that `source` announces, if the receiver may
/// allocate that much: at most `max` bytes, addressable here, and not wrapping around the
/// sender's address space. Called before anything is allocated for the message.
///
/// # Errors
/// [`BadDescriptor`] with the announced length and `max`.
pub fn admit_large(
    source: &LargeDescriptor,
    max: u64,
    descriptor_len: u32,
) -> Result<usize, BadDescriptor> {
    let refused = BadDescriptor {
        len: source.len,
        max,
        descriptor_len,
    };
    if source.len > max || source.addr.checked_add(source.len).is_none() {
        return Err(refused);
    }
    usize::try_from(source.len).map_err(|_| refused)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn layout_is_fixed() {
        assert_eq!(MessageImm::Inline(5).encode(), 5);
        assert_eq!(MessageImm::Descriptor(20).encode(), 0x8000_0014);
        let d = LargeDescriptor {
            addr: 0x0102_0304_0506_0708,
            len: 0x1112_1314_1516_1718,
            rkey: 0xdead_beef,
        };
        assert_eq!(
            d.encode(),
            [
                1, 2, 3, 4, 5, 6, 7, 8, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18, 0xde, 0xad,
                0xbe, 0xef
            ]
        );
    }

    #[test]
    fn admission_refuses_claims_over_the_limit_or_wrapping() {
        let claim = |addr, len| LargeDescriptor { addr, len, rkey: 7 };
        assert_eq!(admit_large(&claim(0x1000, 64), 64, 20), Ok(64));
        assert_eq!(
            admit_large(&claim(0x1000, 65), 64, 20),
            Err(BadDescriptor {
                len: 65,
                max: 64,
                descriptor_len: 20
            })
        );
        assert!(admit_large(&claim(u64::MAX - 10, 64), 64, 20).is_err());
    }

    proptest! {
        #[test]
        fn immediate_roundtrip(len in 0u32..MAX_RING_LEN, descriptor: bool) {
            let imm = if descriptor { MessageImm::Descriptor(len) } else { MessageImm::Inline(len) };
            prop_assert_eq!(MessageImm::decode(imm.encode()), imm);
            prop_assert_eq!(imm.ring_len(), len);
        }

        #[test]
        fn descriptor_roundtrip(addr: u64, len: u64, rkey: u32, extra in 0usize..3) {
            let d = LargeDescriptor { addr, len, rkey };
            prop_assert_eq!(LargeDescriptor::decode(&d.encode()), Some(d));
            let mut longer = d.encode().to_vec();
            longer.extend(core::iter::repeat_n(0, extra + 1));
            prop_assert_eq!(LargeDescriptor::decode(&longer), None);
            prop_assert_eq!(LargeDescriptor::decode(&longer[..DESCRIPTOR_LEN - 1 - extra]), None);
        }
    }
}
