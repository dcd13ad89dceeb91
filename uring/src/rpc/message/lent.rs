//! Host memory that a tensor's owner lends to the agent for a send ([`LentBytes`]), so
//! that a CPU tensor leaves without its bytes being copied into a `Vec` first: a binding
//! (the Python one lends numpy arrays, `bytes` and memoryviews) keeps its object alive
//! inside the value, and the channels read the bytes where they are.
//!
//! This module decides nothing about who may lend what; it only carries the memory
//! through the send path. The memory travels as the tensor's [`DeviceBuffer`] on the CPU
//! device, so no field of [`Tensor`] changed; when the frame is built, it becomes the
//! [`HostBytes`] the channels read (inline, `cma`, `xth`, `mpt`), exactly as bytes a
//! device runtime staged do, and the last channel done with it drops it.

use rdzv_core::device::Device;

use super::Tensor;
use crate::rpc::device::{DeviceBuffer, LentBytes, StagedBytes};

impl Tensor {
    /// A CPU tensor whose bytes are lent, not copied ([`LentBytes`]): the agent reads
    /// them where they are and drops `bytes` when every channel is done with them.
    pub fn lent(bytes: impl StagedBytes) -> Tensor {
        Tensor {
            device: Device::cpu(),
            data: Vec::new(),
            memory: Some(DeviceBuffer::new(LentBytes::new(bytes))),
        }
    }

    /// The lent bytes of a CPU tensor made by [`lent`](Self::lent), if it is one.
    pub fn lent_bytes(&self) -> Option<&[u8]> {
        self.memory
            .as_ref()
            .and_then(DeviceBuffer::downcast_ref::<LentBytes>)
            .map(LentBytes::bytes)
    }

    /// The bytes of a CPU tensor, owned (`data`) or lent; `None` for device memory.
    pub fn host_bytes(&self) -> Option<&[u8]> {
        match &self.memory {
            None => Some(&self.data),
            Some(_) => self.lent_bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;

    struct Counted {
        bytes: Vec<u8>,
        dropped: Arc<AtomicUsize>,
    }

    impl StagedBytes for Counted {
        fn bytes(&self) -> &[u8] {
            &self.bytes
        }
    }

    impl Drop for Counted {
        fn drop(&mut self) {
            self.dropped.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_lent_tensor_is_read_in_place_and_released_with_its_last_reader() {
        let dropped = Arc::new(AtomicUsize::new(0));
        let bytes = vec![3u8; 100];
        let address = bytes.as_ptr();
        let tensor = Tensor::lent(Counted {
            bytes,
            dropped: Arc::clone(&dropped),
        });
        assert!(tensor.device.is_cpu());
        assert_eq!(tensor.len(), 100);
        assert!(tensor.is_ready().unwrap_or(false));
        assert_eq!(tensor.lent_bytes().map(<[u8]>::as_ptr), Some(address));
        assert_eq!(tensor.host_bytes().map(<[u8]>::len), Some(100));
        assert_eq!(Tensor::cpu(vec![1, 2]).host_bytes(), Some(&[1u8, 2][..]));
        assert_eq!(Tensor::cpu(vec![1, 2]).lent_bytes(), None);

        // What the frame builder hands the channels: the bytes where they are.
        let host = crate::rpc::device::Devices::default()
            .stage_out(tensor.device, Vec::new(), tensor.memory.as_ref())
            .unwrap_or_else(|e| panic!("{e}"));
        drop(tensor);
        // The channel's host bytes still hold the loan, at the same address.
        assert_eq!(dropped.load(Ordering::SeqCst), 0);
        assert!(host.is_staged());
        assert_eq!(host.as_slice().as_ptr(), address);
        // Never recycled: the memory is its owner's.
        assert_eq!(host.into_owned(), None);
        assert_eq!(dropped.load(Ordering::SeqCst), 1);
    }
}
