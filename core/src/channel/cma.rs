//! The `cma` channel's descriptor: where in which process to read a tensor with
//! `process_vm_readv`.

use super::{DecodeError, ExportRecord, ProcessIdentity};

/// An encoded [`CmaDescriptor`]: its tag, then address, length and transfer id.
const RECORD: ExportRecord<3> = ExportRecord {
    magic: *b"RDCM",
    what: "cma descriptor",
};

/// Where and what to read: an exported buffer, named by the process that holds it, its
/// address there, its length and the transfer id to acknowledge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CmaDescriptor {
    /// The exporting process.
    pub process: ProcessIdentity,
    /// The buffer's address in that process.
    pub address: u64,
    /// The buffer's length in bytes.
    pub length: u64,
    /// The id the ack must carry.
    pub transfer_id: u64,
}

impl CmaDescriptor {
    /// The encoded size: a 4-byte tag, the process identity, then address, length and
    /// transfer id (little-endian `u64`s).
    pub const ENCODED_LEN: usize = ExportRecord::<3>::LEN;

    /// The wire form of this descriptor.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        RECORD.encode(
            &self.process.encode(),
            [self.address, self.length, self.transfer_id],
        )
    }

    /// Parses a descriptor produced by [`CmaDescriptor::encode`]. Decoding checks only
    /// the form; the reader checks the contents (the process is the pipe's, alive and
    /// the same instance) before it reads.
    ///
    /// # Errors
    /// [`DecodeError`] for another length or tag.
    pub fn decode(bytes: &[u8]) -> Result<CmaDescriptor, DecodeError> {
        let (process, [address, length, transfer_id]) = RECORD.decode(bytes)?;
        Ok(CmaDescriptor {
            process: ProcessIdentity::decode(&process),
            address,
            length,
            transfer_id,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_round_trip_and_refuse_garbage() {
        let d = CmaDescriptor {
            process: super::super::tests::someone(),
            address: 0x7f00_0000_1000,
            length: 64 << 20,
            transfer_id: 9,
        };
        assert_eq!(CmaDescriptor::decode(&d.encode()), Ok(d));
        assert!(CmaDescriptor::decode(&d.encode()[1..]).is_err());
        let mut bad = d.encode();
        bad[0] ^= 1;
        assert!(matches!(
            CmaDescriptor::decode(&bad),
            Err(DecodeError::BadTag { .. })
        ));
    }
}
