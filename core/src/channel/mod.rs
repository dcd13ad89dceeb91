//! The wire records of the tensor channels: what a peer sends beside a pipe's frames to
//! say where a tensor's bytes are, and what the receiver answers. Pure encodings; the
//! channels that move the bytes (and read `/proc`, open pidfds, copy memory) live in
//! `rdzv-uring`.
//!
//! | record | channel | what it says |
//! |---|---|---|
//! | [`ProcessIdentity`] | cma, xth | one process instance on one host (boot, namespaces, pid, start time) |
//! | [`CmaDescriptor`](cma::CmaDescriptor) | cma | read this many bytes at this address of that process |
//! | [`XthDescriptor`](xth::XthDescriptor) | xth | read the export with this id in this process |
//! | [`TransferAck`] | cma, xth | the receiver is done with a transfer |
//! | [`MptDescriptor`](mpt::MptDescriptor), [`StripeHeader`](mpt::StripeHeader), [`ConnectionHello`](mpt::ConnectionHello) | mpt | which transfer, which stripe, which connection |
//! | [`CudaIpcDescriptor`](cuda::CudaIpcDescriptor) | cuda_ipc | copy this range of the allocation behind this IPC handle, lent by that process, once the IPC event it names has fired; record that event after the copy |
//! | [`CudaXthDescriptor`](cuda::CudaXthDescriptor) | cuda_xth | copy this device address range of this very process |
//! | [`CudaGdrDescriptor`](cuda::CudaGdrDescriptor) | cuda_gdr | RDMA-READ this range with this rkey, through the lender's GDR endpoint at this address |
//!
//! Every record has a fixed size and starts with a 4-byte tag; decoding checks the
//! length and the tag and never panics (the `channel_descriptors` fuzz target).

pub mod cma;
pub mod cuda;
pub mod mpt;
pub mod xth;

use core::fmt;

/// Why bytes received from a peer are not the record expected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecodeError {
    /// The message has the wrong size.
    WrongLength {
        /// What was being decoded.
        what: &'static str,
        /// The size of a valid encoding.
        expected: usize,
        /// The size received.
        actual: usize,
    },
    /// The message does not start with the expected tag (another record, or garbage),
    /// or a field is out of range.
    BadTag {
        /// What was being decoded.
        what: &'static str,
    },
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::WrongLength {
                what,
                expected,
                actual,
            } => write!(
                f,
                "malformed {what}: expected {expected} bytes, got {actual}"
            ),
            DecodeError::BadTag { what } => write!(f, "malformed {what}: unknown tag"),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for DecodeError {}

/// Takes fixed-size fields off the front of a byte slice; missing bytes read as zeros
/// (callers check the total length first).
pub(crate) struct FieldReader<'a>(&'a [u8]);

impl<'a> FieldReader<'a> {
    /// A reader over `bytes` once they are exactly `len` long and start with `magic`;
    /// `what` names the record in the error.
    pub(crate) fn tagged(
        bytes: &'a [u8],
        what: &'static str,
        len: usize,
        magic: &[u8; 4],
    ) -> Result<FieldReader<'a>, DecodeError> {
        if bytes.len() != len {
            return Err(DecodeError::WrongLength {
                what,
                expected: len,
                actual: bytes.len(),
            });
        }
        let mut reader = FieldReader(bytes);
        if reader.take::<4>() != *magic {
            return Err(DecodeError::BadTag { what });
        }
        Ok(reader)
    }

    /// The next `N` bytes.
    pub(crate) fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let n = N.min(self.0.len());
        let (head, tail) = self.0.split_at(n);
        out[..n].copy_from_slice(head);
        self.0 = tail;
        out
    }
}

/// Writes fixed-size fields one after the other.
pub(crate) struct FieldWriter<'a>(&'a mut [u8]);

impl<'a> FieldWriter<'a> {
    /// A writer over `out`, starting with the 4-byte `magic`.
    pub(crate) fn tagged(out: &'a mut [u8], magic: &[u8; 4]) -> FieldWriter<'a> {
        let mut writer = FieldWriter(out);
        writer.put(magic);
        writer
    }

    /// Appends `bytes` (whatever does not fit is dropped; callers size `out` first).
    pub(crate) fn put(&mut self, bytes: &[u8]) {
        let n = bytes.len().min(self.0.len());
        let (head, tail) = core::mem::take(&mut self.0).split_at_mut(n);
        head.copy_from_slice(&bytes[..n]);
        self.0 = tail;
    }
}

/// The layout most records share: a 4-byte tag, a head of `H` bytes (the exporting
/// process for cma and xth, reserved bytes, or nothing), then `K` little-endian `u64`
/// fields, `4 + H + 8 K` bytes in all.
pub(crate) struct Record<const H: usize, const K: usize> {
    /// The tag.
    pub(crate) magic: [u8; 4],
    /// The record's name, for errors.
    pub(crate) what: &'static str,
}

/// The records of cma and xth: headed by the exporting process.
pub(crate) type ExportRecord<const K: usize> = Record<{ ProcessIdentity::ENCODED_LEN }, K>;

impl<const H: usize, const K: usize> Record<H, K> {
    /// The encoded size.
    pub(crate) const LEN: usize = 4 + H + 8 * K;

    /// The record, `N` ([`Self::LEN`]) bytes long.
    pub(crate) fn encode<const N: usize>(&self, head: &[u8; H], fields: [u64; K]) -> [u8; N] {
        let mut out = [0u8; N];
        let mut writer = FieldWriter::tagged(&mut out, &self.magic);
        writer.put(head);
        for field in fields {
            writer.put(&field.to_le_bytes());
        }
        out
    }

    /// Reads what [`encode`](Self::encode) wrote.
    pub(crate) fn decode(&self, bytes: &[u8]) -> Result<([u8; H], [u64; K]), DecodeError> {
        let mut reader = FieldReader::tagged(bytes, self.what, Self::LEN, &self.magic)?;
        let head = reader.take();
        Ok((
            head,
            core::array::from_fn(|_| u64::from_le_bytes(reader.take())),
        ))
    }
}

/// One process instance on one host: who exported a buffer. Two processes alive at the
/// same time never share all of these, and a new process given a dead one's pid has a
/// later start time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ProcessIdentity {
    /// The boot id, as 16 bytes (the UUID in `/proc/sys/kernel/random/boot_id`).
    pub boot_id: [u8; 16],
    /// The inode number of the process's pid namespace.
    pub pid_namespace: u64,
    /// The inode number of the process's user namespace.
    pub user_namespace: u64,
    /// The pid, as seen in that pid namespace.
    pub pid: u32,
    /// When the process started, in clock ticks since boot.
    pub start_time: u64,
}

impl ProcessIdentity {
    /// The encoded size: pid (4), boot id (16), pid namespace, user namespace and start
    /// time (8 each), little-endian.
    pub const ENCODED_LEN: usize = 44;

    /// Whether `other` lives in the same boot, pid namespace and user namespace as this
    /// one, so that its pid means the same process here. `None` when it does; otherwise
    /// what differs.
    pub fn mismatch(&self, other: &ProcessIdentity) -> Option<&'static str> {
        if self.boot_id != other.boot_id {
            Some("boot id (another host, or another boot)")
        } else if self.pid_namespace != other.pid_namespace {
            Some("pid namespace")
        } else if self.user_namespace != other.user_namespace {
            Some("user namespace")
        } else {
            None
        }
    }

    /// The wire form.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        let mut writer = FieldWriter(&mut out);
        writer.put(&self.pid.to_le_bytes());
        writer.put(&self.boot_id);
        writer.put(&self.pid_namespace.to_le_bytes());
        writer.put(&self.user_namespace.to_le_bytes());
        writer.put(&self.start_time.to_le_bytes());
        out
    }

    /// Reads what [`encode`](Self::encode) wrote (any 44 bytes are an identity).
    pub fn decode(bytes: &[u8; Self::ENCODED_LEN]) -> ProcessIdentity {
        let mut reader = FieldReader(bytes);
        let pid = u32::from_le_bytes(reader.take());
        let boot_id = reader.take();
        ProcessIdentity {
            pid,
            boot_id,
            pid_namespace: u64::from_le_bytes(reader.take()),
            user_namespace: u64::from_le_bytes(reader.take()),
            start_time: u64::from_le_bytes(reader.take()),
        }
    }
}

/// An encoded [`TransferAck`]: its tag and the transfer id.
const ACK: Record<0, 1> = Record {
    magic: *b"RDAK",
    what: "transfer ack",
};

/// The receiver's word that it finished reading an exported buffer: the export with
/// this transfer id may now give its buffer back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TransferAck {
    /// The transfer id of the descriptor that was read.
    pub transfer_id: u64,
}

impl TransferAck {
    /// The encoded size: a 4-byte tag and the little-endian transfer id.
    pub const ENCODED_LEN: usize = 12;

    /// The wire form of this ack.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        ACK.encode(&[], [self.transfer_id])
    }

    /// Parses an ack produced by [`TransferAck::encode`].
    ///
    /// # Errors
    /// [`DecodeError`] for another length or tag.
    pub fn decode(bytes: &[u8]) -> Result<TransferAck, DecodeError> {
        let ([], [transfer_id]) = ACK.decode(bytes)?;
        Ok(TransferAck { transfer_id })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn someone() -> ProcessIdentity {
        ProcessIdentity {
            boot_id: *b"0123456789abcdef",
            pid_namespace: 4026531836,
            user_namespace: 4026531837,
            pid: 4242,
            start_time: 123_456,
        }
    }

    #[test]
    fn identities_round_trip_and_name_what_differs() {
        let me = someone();
        assert_eq!(ProcessIdentity::decode(&me.encode()), me);
        assert_eq!(me.mismatch(&me), None);
        let other = ProcessIdentity {
            pid_namespace: me.pid_namespace ^ 1,
            ..me
        };
        assert_eq!(me.mismatch(&other), Some("pid namespace"));
        let elsewhere = ProcessIdentity {
            boot_id: [0; 16],
            ..me
        };
        assert!(me
            .mismatch(&elsewhere)
            .is_some_and(|m| m.starts_with("boot id")));
    }

    #[test]
    fn acks_round_trip_and_refuse_garbage() {
        let ack = TransferAck {
            transfer_id: 0x0102_0304_0506_0708,
        };
        assert_eq!(TransferAck::decode(&ack.encode()), Ok(ack));
        assert_eq!(
            TransferAck::decode(&[0u8; 3]),
            Err(DecodeError::WrongLength {
                what: "transfer ack",
                expected: 12,
                actual: 3
            })
        );
        assert_eq!(
            TransferAck::decode(&[0u8; 12]),
            Err(DecodeError::BadTag {
                what: "transfer ack"
            })
        );
    }
}
