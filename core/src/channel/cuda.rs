//! The descriptors of the CUDA channels that lend device memory to the peer, who copies
//! out of it: `cuda_ipc` (another process of this host, through a CUDA IPC memory
//! handle), `cuda_xth` (this very process, by address) and `cuda_gdr` (any host, by a
//! one-sided RDMA READ of memory registered with the lender's NIC).
//!
//! The sender keeps the memory unchanged until the peer says it is done (the lending
//! rule of [`crate::rpc::lending`]). The receiver checks the exporting process before it
//! touches anything: an IPC handle or a device address only means something to the
//! process, or the host, that made it.

use super::{DecodeError, FieldReader, FieldWriter, ProcessIdentity};

/// What starts an encoded [`CudaIpcDescriptor`].
const IPC_MAGIC: [u8; 4] = *b"RDCI";
/// What starts an encoded [`CudaXthDescriptor`].
const XTH_MAGIC: [u8; 4] = *b"RDCX";
/// What starts an encoded [`CudaGdrDescriptor`].
const GDR_MAGIC: [u8; 4] = *b"RDCG";

/// The size of a CUDA IPC memory handle (`CUipcMemHandle`).
pub const IPC_HANDLE_LEN: usize = 64;

/// Device memory of another process on this host, lent through a CUDA IPC memory handle
/// of the allocation that holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CudaIpcDescriptor {
    /// The exporting process.
    pub process: ProcessIdentity,
    /// `cuIpcGetMemHandle` of the allocation.
    pub handle: [u8; IPC_HANDLE_LEN],
    /// Where the tensor starts in the allocation.
    pub offset: u64,
    /// The tensor's length in bytes.
    pub length: u64,
    /// The exporter's device ordinal (for messages; the handle names the memory).
    pub device: u32,
    /// The allocation's base address in the exporter. A receiver that keeps opened
    /// handles keys them by it: another handle at a known base means the exporter freed
    /// that allocation and the address was reused, so the old mapping is stale.
    pub base: u64,
    /// `cuIpcGetEventHandle` of an interprocess event the lender recorded after the work
    /// that produced the bytes: the receiver's stream waits on it before its copy, then
    /// records it again after the copy, and the lender waits on that record before the
    /// memory is used again (the lending rule's ack says when to look).
    pub event: [u8; IPC_HANDLE_LEN],
}

impl CudaIpcDescriptor {
    /// The encoded size: a 4-byte tag, the process identity, the memory handle, then
    /// offset and length (little-endian `u64`s), the device (little-endian `u32`), the
    /// base (little-endian `u64`) and the event handle.
    pub const ENCODED_LEN: usize =
        4 + ProcessIdentity::ENCODED_LEN + IPC_HANDLE_LEN + 28 + IPC_HANDLE_LEN;

    /// The wire form of this descriptor.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        let mut writer = FieldWriter::tagged(&mut out, &IPC_MAGIC);
        writer.put(&self.process.encode());
        writer.put(&self.handle);
        writer.put(&self.offset.to_le_bytes());
        writer.put(&self.length.to_le_bytes());
        writer.put(&self.device.to_le_bytes());
        writer.put(&self.base.to_le_bytes());
        writer.put(&self.event);
        out
    }

    /// Parses a descriptor produced by [`CudaIpcDescriptor::encode`].
    ///
    /// # Errors
    /// [`DecodeError`] for another length or tag, or an offset and length that overflow.
    pub fn decode(bytes: &[u8]) -> Result<CudaIpcDescriptor, DecodeError> {
        const WHAT: &str = "cuda_ipc descriptor";
        let mut reader = FieldReader::tagged(bytes, WHAT, Self::ENCODED_LEN, &IPC_MAGIC)?;
        let descriptor = CudaIpcDescriptor {
            process: ProcessIdentity::decode(&reader.take()),
            handle: reader.take(),
            offset: u64::from_le_bytes(reader.take()),
            length: u64::from_le_bytes(reader.take()),
            device: u32::from_le_bytes(reader.take()),
            base: u64::from_le_bytes(reader.take()),
            event: reader.take(),
        };
        match descriptor.offset.checked_add(descriptor.length) {
            Some(_) => Ok(descriptor),
            None => Err(DecodeError::BadTag { what: WHAT }),
        }
    }
}

/// Device memory of this very process, lent by address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CudaXthDescriptor {
    /// The exporting process: the receiver refuses any but itself.
    pub process: ProcessIdentity,
    /// The tensor's device address (`CUdeviceptr`, unified addressing).
    pub address: u64,
    /// The tensor's length in bytes.
    pub length: u64,
    /// The device ordinal the memory is on.
    pub device: u32,
}

impl CudaXthDescriptor {
    /// The encoded size: a 4-byte tag, the process identity, then address and length
    /// (little-endian `u64`s) and the device (little-endian `u32`).
    pub const ENCODED_LEN: usize = 4 + ProcessIdentity::ENCODED_LEN + 20;

    /// The wire form of this descriptor.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        let mut writer = FieldWriter::tagged(&mut out, &XTH_MAGIC);
        writer.put(&self.process.encode());
        writer.put(&self.address.to_le_bytes());
        writer.put(&self.length.to_le_bytes());
        writer.put(&self.device.to_le_bytes());
        out
    }

    /// Parses a descriptor produced by [`CudaXthDescriptor::encode`].
    ///
    /// # Errors
    /// [`DecodeError`] for another length or tag, or an address range that overflows.
    pub fn decode(bytes: &[u8]) -> Result<CudaXthDescriptor, DecodeError> {
        const WHAT: &str = "cuda_xth descriptor";
        let mut reader = FieldReader::tagged(bytes, WHAT, Self::ENCODED_LEN, &XTH_MAGIC)?;
        let descriptor = CudaXthDescriptor {
            process: ProcessIdentity::decode(&reader.take()),
            address: u64::from_le_bytes(reader.take()),
            length: u64::from_le_bytes(reader.take()),
            device: u32::from_le_bytes(reader.take()),
        };
        match descriptor.address.checked_add(descriptor.length) {
            Some(_) => Ok(descriptor),
            None => Err(DecodeError::BadTag { what: WHAT }),
        }
    }
}

/// Memory registered with the lender's RDMA NIC, for the peer to fetch with one RDMA
/// READ over a queue pair it bootstraps through the lender's GDR endpoint (a TCP
/// listener).
///
/// The borrower trusts none of it: the NIC refuses a READ outside the registration
/// (`IBV_WC_REM_ACCESS_ERR`), and the decoder only refuses what cannot be meant (a range
/// that wraps, port 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CudaGdrDescriptor {
    /// The lending process.
    pub process: ProcessIdentity,
    /// The lender's GDR endpoint address: an IPv6 address, or an IPv4 one mapped into
    /// IPv6 (`::ffff:a.b.c.d`); see [`CudaGdrDescriptor::endpoint_ip`].
    pub endpoint_addr: [u8; 16],
    /// The lender's GDR endpoint port (never 0).
    pub endpoint_port: u16,
    /// The lent memory's address in the lender's registration (the device address).
    pub address: u64,
    /// The registration's remote key.
    pub rkey: u32,
    /// The lent length in bytes.
    pub length: u64,
    /// The lender's device ordinal (for messages).
    pub device: u32,
}

impl CudaGdrDescriptor {
    /// The encoded size: a 4-byte tag, the process identity, the endpoint address (16
    /// bytes) and port (little-endian `u16`), then address (`u64`), rkey (`u32`), length
    /// (`u64`) and device (`u32`), little-endian.
    pub const ENCODED_LEN: usize = 4 + ProcessIdentity::ENCODED_LEN + 16 + 2 + 24;

    /// The endpoint address as an IP address (an IPv4-mapped one as IPv4).
    pub fn endpoint_ip(&self) -> core::net::IpAddr {
        core::net::Ipv6Addr::from(self.endpoint_addr).to_canonical()
    }

    /// The endpoint's encoded address for `ip` (IPv4 is mapped into IPv6).
    pub fn encode_ip(ip: core::net::IpAddr) -> [u8; 16] {
        match ip {
            core::net::IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
            core::net::IpAddr::V6(v6) => v6.octets(),
        }
    }

    /// The wire form of this descriptor.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        let mut writer = FieldWriter::tagged(&mut out, &GDR_MAGIC);
        writer.put(&self.process.encode());
        writer.put(&self.endpoint_addr);
        writer.put(&self.endpoint_port.to_le_bytes());
        writer.put(&self.address.to_le_bytes());
        writer.put(&self.rkey.to_le_bytes());
        writer.put(&self.length.to_le_bytes());
        writer.put(&self.device.to_le_bytes());
        out
    }

    /// Parses a descriptor produced by [`CudaGdrDescriptor::encode`].
    ///
    /// # Errors
    /// [`DecodeError`] for another length or tag, port 0, or an address range that
    /// overflows.
    pub fn decode(bytes: &[u8]) -> Result<CudaGdrDescriptor, DecodeError> {
        const WHAT: &str = "cuda_gdr descriptor";
        let mut reader = FieldReader::tagged(bytes, WHAT, Self::ENCODED_LEN, &GDR_MAGIC)?;
        let descriptor = CudaGdrDescriptor {
            process: ProcessIdentity::decode(&reader.take()),
            endpoint_addr: reader.take(),
            endpoint_port: u16::from_le_bytes(reader.take()),
            address: u64::from_le_bytes(reader.take()),
            rkey: u32::from_le_bytes(reader.take()),
            length: u64::from_le_bytes(reader.take()),
            device: u32::from_le_bytes(reader.take()),
        };
        let range_ok = descriptor.address.checked_add(descriptor.length).is_some();
        if range_ok && descriptor.endpoint_port != 0 {
            Ok(descriptor)
        } else {
            Err(DecodeError::BadTag { what: WHAT })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ipc() -> CudaIpcDescriptor {
        CudaIpcDescriptor {
            process: super::super::tests::someone(),
            handle: [7; IPC_HANDLE_LEN],
            offset: 512,
            length: 1 << 20,
            device: 3,
            base: 0x7f00_0020_0000,
            event: [9; IPC_HANDLE_LEN],
        }
    }

    fn xth() -> CudaXthDescriptor {
        CudaXthDescriptor {
            process: super::super::tests::someone(),
            address: 0x7f00_0000_0000,
            length: 4096,
            device: 1,
        }
    }

    fn gdr() -> CudaGdrDescriptor {
        CudaGdrDescriptor {
            process: super::super::tests::someone(),
            endpoint_addr: CudaGdrDescriptor::encode_ip(core::net::IpAddr::V4(
                core::net::Ipv4Addr::new(10, 1, 2, 3),
            )),
            endpoint_port: 29_500,
            address: 0x7f00_0000_1000,
            rkey: 0xdead_beef,
            length: (8 << 20) + 3,
            device: 2,
        }
    }

    #[test]
    fn gdr_descriptor_round_trips_and_refuses_garbage() {
        let g = gdr();
        assert_eq!(CudaGdrDescriptor::decode(&g.encode()), Ok(g));
        assert_eq!(
            g.endpoint_ip(),
            core::net::IpAddr::V4(core::net::Ipv4Addr::new(10, 1, 2, 3))
        );
        let v6 = core::net::IpAddr::V6(core::net::Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1));
        let g6 = CudaGdrDescriptor {
            endpoint_addr: CudaGdrDescriptor::encode_ip(v6),
            ..g
        };
        assert_eq!(
            CudaGdrDescriptor::decode(&g6.encode()).map(|d| d.endpoint_ip()),
            Ok(v6)
        );
        // Other descriptors, short input, zeros, port 0 and a wrapping range are refused.
        assert!(CudaGdrDescriptor::decode(&xth().encode()).is_err());
        assert!(CudaXthDescriptor::decode(&g.encode()).is_err());
        assert!(CudaGdrDescriptor::decode(&g.encode()[..50]).is_err());
        assert!(CudaGdrDescriptor::decode(&[0u8; CudaGdrDescriptor::ENCODED_LEN]).is_err());
        let no_port = CudaGdrDescriptor {
            endpoint_port: 0,
            ..g
        };
        assert!(CudaGdrDescriptor::decode(&no_port.encode()).is_err());
        let wraps = CudaGdrDescriptor {
            address: u64::MAX - 2,
            ..g
        };
        assert!(CudaGdrDescriptor::decode(&wraps.encode()).is_err());
        assert!(CudaGdrDescriptor::ENCODED_LEN <= usize::from(u8::MAX));
    }

    #[test]
    fn descriptors_round_trip_and_refuse_garbage() {
        let (i, x) = (ipc(), xth());
        assert_eq!(CudaIpcDescriptor::decode(&i.encode()), Ok(i));
        assert_eq!(CudaXthDescriptor::decode(&x.encode()), Ok(x));
        // Each refuses the other's encoding, short input and zeros.
        assert!(CudaIpcDescriptor::decode(&x.encode()).is_err());
        assert!(CudaXthDescriptor::decode(&i.encode()).is_err());
        assert!(CudaIpcDescriptor::decode(&i.encode()[..100]).is_err());
        assert!(CudaXthDescriptor::decode(&[0u8; CudaXthDescriptor::ENCODED_LEN]).is_err());
        // Both fit a frame's one-byte descriptor length.
        assert!(CudaIpcDescriptor::ENCODED_LEN <= usize::from(u8::MAX));
    }

    #[test]
    fn ranges_that_overflow_are_refused() {
        let wraps = CudaIpcDescriptor {
            offset: u64::MAX,
            ..ipc()
        };
        assert!(CudaIpcDescriptor::decode(&wraps.encode()).is_err());
        let wraps = CudaXthDescriptor {
            address: u64::MAX - 1,
            ..xth()
        };
        assert!(CudaXthDescriptor::decode(&wraps.encode()).is_err());
    }
}
