//! The decoders of what a peer sends beside a pipe (`cma`, `xth`, `mpt`, `cuda_ipc`,
//! `cuda_xth` and `cuda_gdr` descriptors, transfer acks, `mpt` stripe headers and connection hellos) never
//! panic, and whatever they accept encodes back to the very same bytes (a connection hello's
//! index also lies in its set; a CUDA descriptor's range does not overflow).

use crate::channel::cma::CmaDescriptor;
use crate::channel::cuda::{CudaGdrDescriptor, CudaIpcDescriptor, CudaXthDescriptor};
use crate::channel::mpt::{
    ConnectionHello, MptDescriptor, StripeHeader, MAX_CONNECTIONS, STRIPE_HEADER_LEN,
};
use crate::channel::xth::XthDescriptor;
use crate::channel::TransferAck;

/// Feeds `data` to every channel record decoder.
///
/// # Panics
/// When a decoder breaks its contract (that is the finding).
pub fn channel_descriptors(data: &[u8]) {
    if let Ok(ack) = TransferAck::decode(data) {
        assert_eq!(ack.encode().as_slice(), data, "ack round trip");
    }
    if let Ok(descriptor) = XthDescriptor::decode(data) {
        assert_eq!(
            descriptor.encode().as_slice(),
            data,
            "xth descriptor round trip"
        );
    }
    if let Ok(descriptor) = CmaDescriptor::decode(data) {
        assert_eq!(
            descriptor.encode().as_slice(),
            data,
            "cma descriptor round trip"
        );
    }
    if let Ok(descriptor) = MptDescriptor::decode(data) {
        assert_eq!(
            descriptor.encode().as_slice(),
            data,
            "mpt descriptor round trip"
        );
    }
    if let Ok(descriptor) = CudaIpcDescriptor::decode(data) {
        assert_eq!(
            descriptor.encode().as_slice(),
            data,
            "cuda_ipc descriptor round trip"
        );
        assert!(descriptor.offset.checked_add(descriptor.length).is_some());
    }
    if let Ok(descriptor) = CudaXthDescriptor::decode(data) {
        assert_eq!(
            descriptor.encode().as_slice(),
            data,
            "cuda_xth descriptor round trip"
        );
        assert!(descriptor.address.checked_add(descriptor.length).is_some());
    }
    if let Ok(descriptor) = CudaGdrDescriptor::decode(data) {
        assert_eq!(
            descriptor.encode().as_slice(),
            data,
            "cuda_gdr descriptor round trip"
        );
        assert!(descriptor.address.checked_add(descriptor.length).is_some());
        assert_ne!(descriptor.endpoint_port, 0);
    }
    if let Ok(hello) = ConnectionHello::decode(data) {
        assert_eq!(
            hello.encode().as_slice(),
            data,
            "mpt connection hello round trip"
        );
        assert!(
            hello.index < hello.count && hello.count <= MAX_CONNECTIONS,
            "an accepted connection hello lies in its set"
        );
    }
    if let Some(raw) = data
        .get(..STRIPE_HEADER_LEN)
        .and_then(|b| <&[u8; STRIPE_HEADER_LEN]>::try_from(b).ok())
    {
        if let Some(header) = StripeHeader::decode(raw) {
            assert_eq!(&header.encode(), raw, "mpt stripe header round trip");
        }
    }
}
