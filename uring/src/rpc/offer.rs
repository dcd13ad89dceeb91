//! What this worker offers peers in a pipe's handshake: its ranked transports and
//! channels with their domain descriptors, as the core's [`Offer`].

use rdzv_core::device::DeviceType;
use rdzv_core::negotiate::{ChannelKind, DeviceDescriptors, Offer, OfferError, TransportKind};

/// The ranked transports and channels this worker offers, with their descriptors, and how it uses its
/// channels.
#[derive(Debug, Clone)]
pub(crate) struct OfferSpec {
    pub transports: Vec<(TransportKind, i64, String)>,
    /// Each channel with its priority and its domain descriptor (for CPU memory; for
    /// CUDA memory, `cuda_xth`, `cuda_ipc` and `cuda_gdr`, and `cuda_basic` too when
    /// `serves_cuda`).
    pub channels: Vec<(ChannelKind, i64, String)>,
    /// Whether `cuda_basic` is also offered for CUDA memory (a CUDA runtime is open).
    pub serves_cuda: bool,
}

impl OfferSpec {
    /// The core's offer, borrowing the descriptors.
    pub(crate) fn offer(&self) -> Result<Offer<'_>, OfferError> {
        let mut offer = Offer::new();
        for (kind, priority, descriptor) in &self.transports {
            offer.add_transport(*kind, *priority, descriptor)?;
        }
        for (kind, priority, descriptor) in &self.channels {
            let descriptors = match kind {
                ChannelKind::CudaBasic if self.serves_cuda => {
                    DeviceDescriptors::cpu(descriptor).with(DeviceType::Cuda, descriptor)
                }
                ChannelKind::CudaXth | ChannelKind::CudaIpc | ChannelKind::CudaGdr => {
                    DeviceDescriptors::cuda(descriptor)
                }
                _ => DeviceDescriptors::cpu(descriptor),
            };
            offer.add_channel(*kind, *priority, descriptors)?;
        }
        Ok(offer)
    }
}
