//! Tensors in frames: which of the agent's tensor channels this process can offer (with
//! their domain descriptors), how an outgoing tensor becomes a frame entry (inline bytes,
//! or a channel descriptor plus an export kept until the peer is done), and how a received
//! frame's channel descriptors become tensors again (the pull).
//!
//! The channels themselves are [`crate::channel`]'s `cma` and `xth`; the wire format (a
//! channel descriptor per out-of-band tensor in the frame's data section, and the
//! `Ack` frame) is `rdzv_core::rpc::frame`'s. This module decides, per tensor, between
//! the negotiated channel and `basic`: a tensor below the worker's
//! [`min_channel_bytes`](super::RpcOptions::min_channel_bytes) goes inline, because an
//! out-of-band transfer costs a descriptor, a system call (cma) or a table lookup (xth),
//! and for responses an extra ack frame. Which thread runs a pull is the lanes'
//! business (`lane`): requests are pulled on the handler pool's thread before the
//! handler runs (inline handlers: on the lane's reader), responses on the thread that
//! received them; when exports are released is the core's pipe machine's
//! (`rdzv_core::rpc::pipe`).
//!
//! A `cuda_basic` tensor leaves as the [`HostBytes`](crate::rpc::HostBytes) its device
//! runtime staged it into, which the channels lend, stream or write inline where they are.
//! One pulled over `cma` or `xth` for a device is read chunk by chunk into its runtime's
//! staging (`Devices::receive_into`): each chunk goes to the device while the next is read.
//!
//! A receiver checks, before reading anything, that the channel a tensor names is the
//! one negotiated for its device pair on this pipe, that the descriptor decodes and
//! announces the tensor's length, and (cma) that every descriptor of a pipe names the
//! same process: a pipe reads from one peer process only.
//!
//! `mpt` works the other way round: the sender *pushes*. A tensor sent over mpt is taken
//! from the frame's exports (`FrameExports::take_streamed`) by the lane, which writes its
//! stripes on the pipe's mpt connections right after the frame, under the same send lock;
//! the receiving lane reads them as soon as it has read the frame, under its receive lock,
//! and turns the entry into an inline one. So the stripes on the mpt connections are always
//! in frame order, no buffer is lent and no ack is needed. Only a pipe served by a lane
//! over tcp has mpt connections; any other sends its tensors inline instead.

mod export;
mod pull;
#[cfg(test)]
mod staged_tests;
#[cfg(test)]
mod tests;

use rdzv_core::device::DeviceType;
use rdzv_core::negotiate::{ChannelKind, Negotiated, Role};
pub(crate) use rdzv_core::rpc::lending::lends_device_memory;

use crate::channel::cma::{self};
use crate::channel::xth::{self};
use crate::rpc::device::{Devices, CUDA_BASIC_DESCRIPTOR};

pub(crate) use export::{add_device_tensor, add_tensor, FrameExports, Streamed};
pub(crate) use pull::{PipeReader, ReceivedTensors};

/// The domain descriptor of the basic channel: it runs over any transport.
pub(crate) const BASIC_DESCRIPTOR: &str = "basic:any";

/// Tensors smaller than this travel inline (`basic`) even where `cma` or `xth` was
/// negotiated.
///
/// Measured with `echo_bandwidth_by_channel` in `uring/tests/rpc_channels.rs` (release
/// build; two pairs of local processes over tcp, one sending everything inline and one
/// everything over cma, their echoes of one tensor interleaved; p50 of 51; three runs on
/// the shared 2-vCPU development VM): inline is faster up to 64 KiB (16 KiB: 225–266 µs
/// against 343–414 µs), 256 KiB is the crossover (506–697 against 504–643 µs), and cma
/// wins from there on (1 MiB: 959–1127 against 927–1027 µs; 4 MiB: 4.2–4.6 ms against
/// 3.2–3.6 ms; 64 MiB: 151–172 ms against 42–51 ms). The descriptor, the system call,
/// the extra thread hand-off and (for responses) the ack frame cost about 100–150 µs.
pub const DEFAULT_MIN_CHANNEL_BYTES: u64 = 256 * 1024;

/// The channels the RPC agent runs, in `ChannelKind::ALL` order (the lending CUDA
/// channels when a device runtime runs them: [`super::device`]).
pub(crate) const RUNNABLE: [ChannelKind; ChannelKind::COUNT] = ChannelKind::ALL;

/// The domain descriptor of `mpt`: any two workers that reach each other over tcp can
/// use it (the connector chooses how many connections to open).
pub(crate) const MPT_DESCRIPTOR: &str = "mpt:tcp";

/// The domain descriptor of `kind` in this process, or why it cannot run here. For cma
/// this runs TensorPipe's viability checks (and, under Yama `ptrace_scope` 1, lets any
/// process of this user read this one: call it only for a channel that will be
/// offered). The lending CUDA channels' descriptors are their runtime's, in `devices`.
pub(crate) fn domain_descriptor(kind: ChannelKind, devices: &Devices) -> Result<String, String> {
    match kind {
        ChannelKind::CudaXth | ChannelKind::CudaIpc | ChannelKind::CudaGdr => devices
            .lending_descriptor(kind)
            .map_err(|e| crate::rpc::error::error_chain(&e)),
        ChannelKind::Basic => Ok(BASIC_DESCRIPTOR.to_string()),
        ChannelKind::Mpt => Ok(MPT_DESCRIPTOR.to_string()),
        ChannelKind::CudaBasic => Ok(CUDA_BASIC_DESCRIPTOR.to_string()),
        ChannelKind::Cma => cma::viability()
            .map(|domain| domain.as_str().to_string())
            .map_err(|e| e.to_string()),
        ChannelKind::Xth => xth::viability()
            .map(|domain| domain.as_str().to_string())
            .map_err(|e| format!("xth channel not viable: {e}")),
        // Every channel is in `RUNNABLE`; nothing else asks.
        other => Err(format!(
            "channel {other} is not run by the RPC agent of this build"
        )),
    }
}

/// Bytes moved per channel by one frame's tensors, for the agent's counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ChannelBytes([u64; ChannelKind::COUNT]);

impl ChannelBytes {
    fn add(&mut self, kind: ChannelKind, bytes: u64) {
        if let Some(slot) = self.0.get_mut(kind.index()) {
            *slot = slot.saturating_add(bytes);
        }
    }

    /// Adds these counts to `totals`.
    pub(crate) fn add_to(&self, totals: &mut ChannelBytes) {
        for kind in ChannelKind::ALL {
            totals.add(kind, self.get(kind));
        }
    }

    /// The bytes counted for `kind`.
    pub(crate) fn get(&self, kind: ChannelKind) -> u64 {
        self.0.get(kind.index()).copied().unwrap_or(0)
    }

    /// Every channel with a non-zero count.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (ChannelKind, u64)> + '_ {
        ChannelKind::ALL
            .into_iter()
            .map(|kind| (kind, self.get(kind)))
            .filter(|&(_, bytes)| bytes > 0)
    }
}

/// The channel the pipe uses between two CPUs, for the agent's per-peer accessor.
pub(crate) fn cpu_channel(negotiated: &Negotiated, role: Role) -> Option<ChannelKind> {
    negotiated.channel_for(role, DeviceType::Cpu, DeviceType::Cpu)
}
