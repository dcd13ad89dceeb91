//! The one error of the device seam ([`DeviceError`]): what the agent asked a device
//! runtime to do ([`DeviceOp`]), on which device and over which channel, and why it
//! failed, as a boxed source (a runtime's own typed error, e.g. `rdzv_rdma`'s
//! `CudaChannelError` with its `DriverCode`).
//!
//! The text is made here only: [`Display`](std::fmt::Display) says what failed and
//! where, the source chain says why and what to do, and [`DeviceError::report`] joins
//! them into one line (the agent puts that line into the call's error). This module
//! decides nothing about retries: a failed device operation fails its call.

use std::error::Error;
use std::fmt;

use rdzv_core::device::Device;
use rdzv_core::negotiate::ChannelKind;

/// The cause of a [`DeviceError`]: any error a runtime has, or a text.
pub type DeviceErrorSource = Box<dyn Error + Send + Sync + 'static>;

/// What a device runtime was asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeviceOp {
    /// Opening the runtime ([`DevicePlugin::open`](super::DevicePlugin::open)).
    Open,
    /// Copying a tensor to host memory (`cuda_basic`'s sending side).
    CopyToHost,
    /// Putting received bytes on the device (`cuda_basic`'s receiving side).
    CopyFromHost,
    /// Starting, filling or finishing a chunk-by-chunk receive
    /// ([`StagedReceive`](super::StagedReceive)).
    ReceiveStaged,
    /// Lending memory to a peer.
    Lend,
    /// Copying memory a peer lent.
    Borrow,
    /// Asking whether a tensor's bytes are complete, or waiting for them.
    WaitReady,
}

impl DeviceOp {
    /// What the operation does, as a sentence fragment ("copy a tensor to the host").
    pub fn describe(self) -> &'static str {
        match self {
            DeviceOp::Open => "open the device runtime",
            DeviceOp::CopyToHost => "copy a tensor to the host",
            DeviceOp::CopyFromHost => "put a received tensor on the device",
            DeviceOp::ReceiveStaged => "receive a tensor onto the device chunk by chunk",
            DeviceOp::Lend => "lend a tensor",
            DeviceOp::Borrow => "copy a lent tensor",
            DeviceOp::WaitReady => "wait for a tensor's bytes to be complete",
        }
    }
}

impl fmt::Display for DeviceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.describe())
    }
}

/// A device runtime failed: what it was asked ([`operation`](Self::operation)), where
/// ([`device`](Self::device), [`channel`](Self::channel)), and why (the
/// [`source`](Error::source)).
///
/// Runtimes make one with [`DeviceError::new`] (any error, or a text that says why and
/// what to do) and say where with [`on`](Self::on) and [`over`](Self::over); the agent
/// fills in the device and channel the runtime left out.
#[derive(Debug, thiserror::Error)]
#[error("{}", self.head())]
pub struct DeviceError {
    operation: DeviceOp,
    device: Option<Device>,
    channel: Option<ChannelKind>,
    #[source]
    source: DeviceErrorSource,
}

impl DeviceError {
    /// `operation` failed because of `source` (an error, or a `String`/`&str` saying
    /// why and what to do).
    pub fn new(operation: DeviceOp, source: impl Into<DeviceErrorSource>) -> DeviceError {
        DeviceError {
            operation,
            device: None,
            channel: None,
            source: source.into(),
        }
    }

    /// The same error, on `device`.
    #[must_use]
    pub fn on(mut self, device: Device) -> DeviceError {
        self.device = Some(device);
        self
    }

    /// The same error, over `channel`.
    #[must_use]
    pub fn over(mut self, channel: ChannelKind) -> DeviceError {
        self.channel = Some(channel);
        self
    }

    /// The same error, with `device` and `channel` where the runtime did not say.
    #[must_use]
    pub(crate) fn located(mut self, device: Device, channel: Option<ChannelKind>) -> DeviceError {
        self.device = self.device.or(Some(device));
        self.channel = self.channel.or(channel);
        self
    }

    /// What the runtime was asked to do.
    pub fn operation(&self) -> DeviceOp {
        self.operation
    }

    /// The device, when known.
    pub fn device(&self) -> Option<Device> {
        self.device
    }

    /// The channel, when there is one.
    pub fn channel(&self) -> Option<ChannelKind> {
        self.channel
    }

    /// What failed and where: "cannot copy a lent tensor on cuda:1 over cuda_ipc".
    fn head(&self) -> String {
        let mut head = format!("cannot {}", self.operation);
        if let Some(device) = self.device {
            head.push_str(&format!(" on {device}"));
        }
        if let Some(channel) = self.channel {
            head.push_str(&format!(" over {channel}"));
        }
        head
    }

    /// The whole error on one line: what failed and where, then every cause, each after
    /// a `": "` (the last usually says what to do).
    pub fn report(&self) -> String {
        crate::rpc::error::error_chain(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cuMemAlloc failed on CUDA device 1")]
    struct Driver(#[source] Code);

    #[derive(Debug, thiserror::Error)]
    #[error("CUDA_ERROR_OUT_OF_MEMORY: free tensors or lower RDZV_CUDA_CACHE_CAP")]
    struct Code;

    #[test]
    fn the_text_says_what_failed_where_and_why() {
        let err = DeviceError::new(DeviceOp::Borrow, Driver(Code))
            .on(Device::cuda(1))
            .over(ChannelKind::CudaIpc);
        assert_eq!(
            err.to_string(),
            "cannot copy a lent tensor on cuda:1 over cuda_ipc"
        );
        assert_eq!(
            err.report(),
            "cannot copy a lent tensor on cuda:1 over cuda_ipc: cuMemAlloc failed on CUDA \
             device 1: CUDA_ERROR_OUT_OF_MEMORY: free tensors or lower RDZV_CUDA_CACHE_CAP"
        );
        // The typed source survives for callers that inspect it.
        let source = err.source().expect("a source");
        assert!(source.downcast_ref::<Driver>().is_some());
        assert_eq!(err.operation(), DeviceOp::Borrow);
    }

    #[test]
    fn the_agent_fills_in_only_what_the_runtime_left_out() {
        let err = DeviceError::new(DeviceOp::CopyToHost, "no pinned memory left")
            .on(Device::cuda(0))
            .located(Device::cuda(3), Some(ChannelKind::CudaBasic));
        assert_eq!(err.device(), Some(Device::cuda(0)));
        assert_eq!(err.channel(), Some(ChannelKind::CudaBasic));
        assert_eq!(
            err.report(),
            "cannot copy a tensor to the host on cuda:0 over cuda_basic: no pinned memory left"
        );
        let bare = DeviceError::new(DeviceOp::Open, String::from("no driver"));
        assert_eq!(bare.report(), "cannot open the device runtime: no driver");
    }
}
