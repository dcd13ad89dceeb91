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
use std::sync::Arc;

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

/// Why a lending channel is not offered (the "not here" side of
/// [`DeviceRuntime::lending_channels`](super::DeviceRuntime::lending_channels)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum UnavailableReason {
    /// This worker has no runtime for the channel's devices (none was given in
    /// `RpcOptions::device_plugins`, or it did not open: the source says why).
    NoRuntime,
    /// The runtime does not run the channel at all.
    NotRun,
    /// The runtime runs it, but not here: a prerequisite is missing (a driver feature,
    /// an RDMA device, this process's or host's identity); the source says which.
    NotViable,
}

/// A lending channel cannot run here: which, why ([`reason`](Self::reason)), and the
/// runtime's own error as the source where there is one. It is `Clone` (a runtime
/// decides once, when it opens, and answers every ask the same), so the source is
/// shared.
#[derive(Debug, Clone)]
pub struct ChannelUnavailable {
    channel: ChannelKind,
    reason: UnavailableReason,
    source: Option<Arc<dyn Error + Send + Sync + 'static>>,
}

impl ChannelUnavailable {
    /// `channel` is not offered, for `reason`, caused by `source` (an error, or a
    /// `String`/`&str` saying why and what to do).
    pub fn new(
        channel: ChannelKind,
        reason: UnavailableReason,
        source: impl Into<DeviceErrorSource>,
    ) -> ChannelUnavailable {
        ChannelUnavailable {
            channel,
            reason,
            source: Some(Arc::from(source.into())),
        }
    }

    /// `channel` is not offered, for `reason`, with nothing more to say.
    pub fn bare(channel: ChannelKind, reason: UnavailableReason) -> ChannelUnavailable {
        ChannelUnavailable {
            channel,
            reason,
            source: None,
        }
    }

    /// The channel.
    pub fn channel(&self) -> ChannelKind {
        self.channel
    }

    /// Why it is not offered.
    pub fn reason(&self) -> UnavailableReason {
        self.reason
    }
}

impl fmt::Display for ChannelUnavailable {
    /// A missing or refusing runtime says so (then the cause, if any); a channel not
    /// viable here is its cause's text, which names the channel.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let channel = self.channel;
        let cause = self
            .source
            .as_deref()
            .map(|source| crate::rpc::error::error_chain(source));
        match (self.reason, cause) {
            (UnavailableReason::NotViable, Some(cause)) => return f.write_str(&cause),
            (UnavailableReason::NotViable, None) => write!(f, "{channel} is not viable here")?,
            (UnavailableReason::NoRuntime, _) => write!(
                f,
                "{channel} needs a CUDA runtime (RpcOptions::device_plugins), and none opened"
            )?,
            (UnavailableReason::NotRun, _) => write!(f, "the CUDA runtime does not run {channel}")?,
        }
        match self.source.as_deref() {
            Some(source) if self.reason != UnavailableReason::NotViable => {
                write!(f, ": {}", crate::rpc::error::error_chain(source))
            }
            _ => Ok(()),
        }
    }
}

impl Error for ChannelUnavailable {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source
            .as_deref()
            .map(|source| source as &(dyn Error + 'static))
    }
}

/// What the agent found wrong with a device tensor's memory, as the source of the
/// [`DeviceError`] of the operation that met it: a tensor made without its memory or
/// with memory on another device (fix how the tensor is made), or a runtime that made
/// other memory than it was asked for (a runtime's bug).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TensorMemoryError {
    /// A device tensor without device memory.
    #[error("the {device} tensor holds no device memory (a {} tensor is made with Tensor::on_device)", device.kind())]
    Missing {
        /// The device the tensor names.
        device: Device,
    },
    /// A tensor whose memory is on another device than the one it names.
    #[error("the tensor says {device}, but its memory is on {memory}")]
    OtherDevice {
        /// The device the tensor names.
        device: Device,
        /// The device its memory is on.
        memory: Device,
    },
    /// A runtime made memory of another length or on another device than asked.
    #[error("the {} runtime made {made} bytes on {made_on} for {len} bytes on {device}", device.kind())]
    Made {
        /// The device asked for.
        device: Device,
        /// The length asked for.
        len: u64,
        /// The length made.
        made: usize,
        /// The device it was made on.
        made_on: Device,
    },
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
    fn an_unavailable_channel_says_why_once_and_keeps_its_cause() {
        let no_runtime =
            ChannelUnavailable::bare(ChannelKind::CudaIpc, UnavailableReason::NoRuntime);
        assert_eq!(
            no_runtime.to_string(),
            "cuda_ipc needs a CUDA runtime (RpcOptions::device_plugins), and none opened"
        );
        assert!(no_runtime.source().is_none());
        let refused = DeviceError::new(DeviceOp::Open, Driver(Code));
        let no_runtime =
            ChannelUnavailable::new(ChannelKind::CudaGdr, UnavailableReason::NoRuntime, refused);
        let text = "cuda_gdr needs a CUDA runtime (RpcOptions::device_plugins), and none \
                    opened: cannot open the device runtime: cuMemAlloc failed on CUDA device \
                    1: CUDA_ERROR_OUT_OF_MEMORY: free tensors or lower RDZV_CUDA_CACHE_CAP";
        assert_eq!(no_runtime.to_string(), text);
        assert_eq!(crate::rpc::error::error_chain(&no_runtime), text);
        let source = no_runtime.clone().source().map(ToString::to_string);
        assert_eq!(source.as_deref(), Some("cannot open the device runtime"));
        let not_viable = ChannelUnavailable::new(
            ChannelKind::CudaXth,
            UnavailableReason::NotViable,
            "cuda_xth: not viable: no device",
        );
        assert_eq!(not_viable.to_string(), "cuda_xth: not viable: no device");
        assert_eq!(not_viable.reason(), UnavailableReason::NotViable);
        assert_eq!(not_viable.channel(), ChannelKind::CudaXth);
        assert_eq!(
            ChannelUnavailable::bare(ChannelKind::CudaGdr, UnavailableReason::NotRun).to_string(),
            "the CUDA runtime does not run cuda_gdr"
        );
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
