//! The `xth` channel's descriptor: which export of this very process to copy from.

use super::{DecodeError, ExportRecord, ProcessIdentity};

/// An encoded [`XthDescriptor`]: its tag, then length and transfer id.
const RECORD: ExportRecord<2> = ExportRecord {
    magic: *b"RDXT",
    what: "xth descriptor",
};

/// A buffer exported within one process: who exported it, its length and its transfer
/// id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct XthDescriptor {
    /// The exporting process.
    pub process: ProcessIdentity,
    /// The buffer's length in bytes.
    pub length: u64,
    /// The export's transfer id, also the key of the table of live exports.
    pub transfer_id: u64,
}

impl XthDescriptor {
    /// The encoded size: a 4-byte tag, the process identity, then length and transfer id
    /// (little-endian `u64`s).
    pub const ENCODED_LEN: usize = ExportRecord::<2>::LEN;

    /// The wire form of this descriptor.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        RECORD.encode(&self.process.encode(), [self.length, self.transfer_id])
    }

    /// Parses a descriptor produced by [`XthDescriptor::encode`].
    ///
    /// # Errors
    /// [`DecodeError`] for another length or tag.
    pub fn decode(bytes: &[u8]) -> Result<XthDescriptor, DecodeError> {
        let (process, [length, transfer_id]) = RECORD.decode(bytes)?;
        Ok(XthDescriptor {
            process: ProcessIdentity::decode(&process),
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
        let d = XthDescriptor {
            process: super::super::tests::someone(),
            length: 1 << 20,
            transfer_id: 3,
        };
        assert_eq!(XthDescriptor::decode(&d.encode()), Ok(d));
        assert!(XthDescriptor::decode(&[0u8; XthDescriptor::ENCODED_LEN]).is_err());
        assert!(XthDescriptor::decode(&d.encode()[..10]).is_err());
    }
}
