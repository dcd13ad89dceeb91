//! Messages into frames: which channel carries each tensor of an outgoing request or
//! response (inline, lent over a pulling channel, streamed over mpt, device memory lent
//! or staged through host memory), the buffers the frame lends, and the check that the
//! frame passes every receiver's limits. Used by the lanes (`super::lane`) as they send;
//! what happens to lent buffers afterwards is the pipe machine's (`rdzv_core::rpc::pipe`).

use std::sync::Arc;

use rdzv_core::negotiate::{ChannelKind, Negotiated, Role};
use rdzv_core::rpc::frame::{FrameKind, FrameLimits};

use super::counters::Counters;
use super::device::Devices;
use super::error::CallError;
use super::message::{Message, Tensor};
use super::registry::Registry;
use super::tensors::{
    add_device_tensor, add_tensor, lends_device_memory, ChannelBytes, FrameExports,
};
use super::transport::OwnedFrame;

/// What building a frame reads and counts: the group's device maps, the device
/// runtimes, the inline threshold, and the bytes each channel moved.
pub(crate) struct Framer {
    pub registry: Arc<Registry>,
    pub devices: Devices,
    /// Tensors below this size go inline even where a channel was negotiated.
    pub min_channel_bytes: u64,
    pub counters: Arc<Counters>,
}

/// Builds the frame's tensors: each tensor's target device is the device map's image
/// of its device (or the same device), and it goes over the channel negotiated for the
/// pair on the pipe (a `cuda_xth`, `cuda_ipc` or `cuda_gdr` tensor's device memory is
/// lent; a
/// `cuda_basic` tensor is first copied to host memory and then carried by the pipe's CPU
/// channel; this side plays `role`; inline below `min_channel_bytes`,
/// when that channel is `basic`, or when it is `mpt` and the pipe has no mpt connections,
/// `!streams`); the buffers lent to the peer and the tensors to stream join `exports`.
/// The frame must then pass the receiver's limits.
pub(crate) fn tensor_frame(
    framer: &Framer,
    frame: &mut OwnedFrame,
    exports: &mut FrameExports,
    tensors: Vec<Tensor>,
    peer: &str,
    (role, negotiated, streams): (Role, &Negotiated, bool),
    reverse: bool,
) -> Result<(), CallError> {
    let map = {
        let group = framer.registry.group();
        if reverse {
            group.reverse_device_maps.get(peer).cloned()
        } else {
            group.device_maps.get(peer).cloned()
        }
    };
    let mut moved = ChannelBytes::default();
    for (index, tensor) in tensors.into_iter().enumerate() {
        let target = map
            .as_ref()
            .and_then(|m| m.get(&tensor.device))
            .unwrap_or(tensor.device);
        let (source_kind, target_kind) = (tensor.device.kind(), target.kind());
        let (Some(negotiated_channel), Some(carrier)) = (
            negotiated.channel_for(role, source_kind, target_kind),
            negotiated.carrier_for(role, source_kind, target_kind),
        ) else {
            return Err(CallError::NoChannel {
                peer: peer.to_string(),
                source_device: tensor.device.to_string(),
                target_device: target.to_string(),
            });
        };
        // cuda_xth, cuda_ipc, cuda_gdr: the device memory is lent.
        if lends_device_memory(carrier) {
            add_device_tensor(
                frame,
                exports,
                &mut moved,
                &framer.devices,
                (index, tensor.memory.as_ref()),
                (tensor.device, target),
                carrier,
                peer,
            )?;
            continue;
        }
        // cuda_basic: the bytes in host memory, carried by the CPU channel.
        let data = framer
            .devices
            .stage_out(tensor.device, tensor.data, tensor.memory.as_ref())
            .map_err(|e| CallError::Device {
                channel: negotiated_channel.name(),
                peer: peer.to_string(),
                index,
                source: Box::new(e),
            })?;
        let channel = match carrier {
            ChannelKind::Mpt if !streams => ChannelKind::Basic,
            other => other,
        };
        add_tensor(
            frame,
            exports,
            &mut moved,
            data,
            tensor.device,
            target,
            channel,
            framer.min_channel_bytes,
            peer,
        )?;
    }
    framer.counters.add_channel_bytes(&moved);
    frame
        .check(&FrameLimits::DEFAULT)
        .map_err(|source| CallError::Encode {
            peer: peer.to_string(),
            source: Box::new(source),
        })
}

/// The frame answering request `message_id` on an inbound pipe from `peer`, with the
/// buffers it lends: the response, or an error frame with the handler's error (or why
/// the response could not be built).
pub(crate) fn response_frame(
    framer: &Framer,
    message_id: u64,
    result: Result<Message, String>,
    peer: &str,
    pipe: (Role, &Negotiated, bool),
) -> (OwnedFrame, FrameExports) {
    let mut exports = FrameExports::default();
    let frame = match result {
        Ok(message) => {
            let mut frame = OwnedFrame {
                metadata: message.metadata,
                payload: message.payload,
                ..OwnedFrame::empty(FrameKind::Response, message_id)
            };
            match tensor_frame(
                framer,
                &mut frame,
                &mut exports,
                message.tensors,
                peer,
                pipe,
                true,
            ) {
                Ok(()) => frame,
                // Dropping the exports releases them: the frame is never sent.
                Err(e) => {
                    exports = FrameExports::default();
                    OwnedFrame::error(message_id, &format!("the response failed: {e}"))
                }
            }
        }
        Err(text) => OwnedFrame::error(message_id, &text),
    };
    (frame, exports)
}

/// A frame's bytes on the wire plus those of its tensors that travel beside it.
pub(crate) fn sent_bytes(frame: &OwnedFrame) -> u64 {
    frame
        .tensors
        .iter()
        .filter(|t| !t.is_inline())
        .map(|t| t.len)
        .fold(frame.encoded_len() as u64, u64::saturating_add)
}
