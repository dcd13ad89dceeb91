//! The fixed parts on the wire: the 40-byte [`Header`] and the 16-byte [`TensorDescriptor`]
//! (with the data section's entries, [`TensorData`]), how they are read and checked.

use crate::device::Device;
use crate::device::DeviceType;
use crate::negotiate::ChannelKind;

use super::error::{FrameError, FrameField};
use super::limits::FrameLimits;
use super::{FrameKind, DESCRIPTOR_LEN, HEADER_LEN, MAGIC, VERSION};

/// One tensor as a frame announces it: where it comes from, where the receiver must put
/// it, the channel that carries it, its size in bytes, and the size of the channel
/// descriptor that stands for its data in the frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorDescriptor {
    /// The device the data is on at the sender.
    pub source: Device,
    /// The device the receiver allocates it on (PyTorch always sets a target device).
    pub target: Device,
    /// The channel that moves the data; `basic` means inline in the frame.
    pub channel: ChannelKind,
    /// The size in bytes.
    pub len: u64,
    /// The length of the channel descriptor in the frame's data section: 0 for `basic`
    /// (whose data is there instead); for other channels what their receiver needs (0
    /// for a channel that needs nothing).
    pub channel_descriptor_len: u8,
}

impl TensorDescriptor {
    /// A `basic` tensor (data inline in the frame) of `len` bytes.
    pub const fn inline(source: Device, target: Device, len: u64) -> Self {
        TensorDescriptor {
            source,
            target,
            channel: ChannelKind::Basic,
            len,
            channel_descriptor_len: 0,
        }
    }

    /// Whether its data travels inside the frame (the `basic` channel).
    pub fn is_inline(&self) -> bool {
        self.channel == ChannelKind::Basic
    }

    /// The size of its entry in the frame's data section: `len` for `basic`, the channel
    /// descriptor's length otherwise.
    pub fn data_len(&self) -> u64 {
        if self.is_inline() {
            self.len
        } else {
            u64::from(self.channel_descriptor_len)
        }
    }

    pub(super) fn check(&self, tensor: u32) -> Result<(), FrameError> {
        if self.is_inline() && self.channel_descriptor_len != 0 {
            return Err(FrameError::NonZeroReserved {
                offset: 7,
                tensor: Some(tensor),
            });
        }
        if self.channel.carries(self.source.kind(), self.target.kind()) {
            Ok(())
        } else {
            Err(FrameError::ChannelMismatch {
                tensor,
                channel: self.channel,
                source: self.source.kind(),
                target: self.target.kind(),
            })
        }
    }

    /// The 16 wire bytes.
    pub fn to_bytes(&self) -> [u8; DESCRIPTOR_LEN] {
        let mut out = [0u8; DESCRIPTOR_LEN];
        let [s_type, s_has, s_index, t_type, t_has, t_index, channel, descriptor_len, len @ ..] =
            &mut out;
        *s_type = device_type_byte(self.source.kind());
        *s_has = u8::from(self.source.index().is_some());
        *s_index = self.source.index().unwrap_or(0);
        *t_type = device_type_byte(self.target.kind());
        *t_has = u8::from(self.target.index().is_some());
        *t_index = self.target.index().unwrap_or(0);
        *channel = channel_byte(self.channel);
        *descriptor_len = self.channel_descriptor_len;
        *len = self.len.to_le_bytes();
        out
    }

    /// Parses and checks 16 wire bytes; `tensor` is the descriptor's position, for errors.
    ///
    /// # Errors
    /// [`FrameError`] for an invalid device, unknown channel, a `basic` tensor with a
    /// channel descriptor length, or a channel that cannot serve the two device types.
    pub fn from_bytes(bytes: &[u8; DESCRIPTOR_LEN], tensor: u32) -> Result<Self, FrameError> {
        let [s_type, s_has, s_index, t_type, t_has, t_index, channel, descriptor_len, len @ ..] =
            *bytes;
        let source = device_from_bytes(s_type, s_has, s_index)
            .ok_or(FrameError::InvalidDevice { tensor })?;
        let target = device_from_bytes(t_type, t_has, t_index)
            .ok_or(FrameError::InvalidDevice { tensor })?;
        let channel = ChannelKind::ALL.get(usize::from(channel)).copied().ok_or(
            FrameError::UnknownChannel {
                tensor,
                byte: channel,
            },
        )?;
        let descriptor = TensorDescriptor {
            source,
            target,
            channel,
            len: u64::from_le_bytes(len),
            channel_descriptor_len: descriptor_len,
        };
        descriptor.check(tensor)?;
        Ok(descriptor)
    }
}

/// A tensor's entry in a decoded frame's data section.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorData<'a> {
    /// The tensor's bytes (`basic` channel).
    Inline(&'a [u8]),
    /// The descriptor its channel's receiver uses to fetch the bytes.
    Channel(&'a [u8]),
}

impl<'a> TensorData<'a> {
    /// The entry's bytes, whichever kind it is.
    pub fn bytes(&self) -> &'a [u8] {
        match *self {
            TensorData::Inline(bytes) | TensorData::Channel(bytes) => bytes,
        }
    }

    /// The inline data, if the tensor is `basic`.
    pub fn inline(&self) -> Option<&'a [u8]> {
        match *self {
            TensorData::Inline(bytes) => Some(bytes),
            TensorData::Channel(_) => None,
        }
    }
}

fn device_type_byte(kind: DeviceType) -> u8 {
    // Two device types: the index always fits.
    u8::try_from(kind.index()).unwrap_or(u8::MAX)
}

fn channel_byte(kind: ChannelKind) -> u8 {
    u8::try_from(kind.index()).unwrap_or(u8::MAX)
}

fn device_from_bytes(kind: u8, has_index: u8, index: u8) -> Option<Device> {
    let kind = DeviceType::ALL.get(usize::from(kind)).copied()?;
    let index = match has_index {
        0 if index == 0 => None,
        1 => Some(index),
        _ => return None,
    };
    Device::new(kind, index).ok()
}

/// The fixed header, parsed and checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Header {
    /// The frame kind.
    pub kind: FrameKind,
    /// The message id.
    pub message_id: u64,
    /// The handler name's length.
    pub handler_len: u32,
    /// The metadata's length.
    pub metadata_len: u32,
    /// The payload's length.
    pub payload_len: u64,
    /// The number of tensors.
    pub tensor_count: u32,
}

fn le_u32(bytes: &[u8], at: usize) -> Option<u32> {
    let field: [u8; 4] = bytes.get(at..at + 4)?.try_into().ok()?;
    Some(u32::from_le_bytes(field))
}

fn le_u64(bytes: &[u8], at: usize) -> Option<u64> {
    let field: [u8; 8] = bytes.get(at..at + 8)?.try_into().ok()?;
    Some(u64::from_le_bytes(field))
}

fn le_u16(bytes: &[u8], at: usize) -> Option<u16> {
    let field: [u8; 2] = bytes.get(at..at + 2)?.try_into().ok()?;
    Some(u16::from_le_bytes(field))
}

impl Header {
    /// Checks the header fields present in `bytes` (a prefix of a frame), in wire order,
    /// against the format and `limits`. Returns the header once all 40 bytes are there.
    pub(super) fn check_prefix(
        bytes: &[u8],
        limits: &FrameLimits,
    ) -> Result<Option<Header>, FrameError> {
        if let Some(magic) = bytes.get(..4) {
            if magic != MAGIC {
                return Err(FrameError::BadMagic);
            }
        } else if !MAGIC.starts_with(bytes) {
            // Garbage is rejected from its first wrong byte.
            return Err(FrameError::BadMagic);
        }
        if let Some(&version) = bytes.get(4) {
            if version != VERSION {
                return Err(FrameError::UnsupportedVersion { version });
            }
        }
        let kind = match bytes.get(5) {
            Some(&byte) => {
                Some(FrameKind::from_byte(byte).ok_or(FrameError::UnknownKind { byte })?)
            }
            None => None,
        };
        if let Some(flags) = le_u16(bytes, 6) {
            if flags != 0 {
                return Err(FrameError::NonZeroReserved {
                    offset: 6,
                    tensor: None,
                });
            }
        }
        let not_allowed = |field| FrameError::NotAllowed {
            kind: kind.unwrap_or(FrameKind::Request),
            field,
        };
        let allows = |field| kind.is_none_or(|k| k.allows(field));
        let message_id = le_u64(bytes, 8);
        if let Some(id) = message_id {
            if id != 0 && !allows(FrameField::MessageId) {
                return Err(not_allowed(FrameField::MessageId));
            }
        }
        let handler_len = le_u32(bytes, 16);
        if let Some(len) = handler_len {
            check_len(
                FrameField::HandlerName,
                len.into(),
                limits.max_handler_name.into(),
            )?;
            if len != 0 && !allows(FrameField::HandlerName) {
                return Err(not_allowed(FrameField::HandlerName));
            }
        }
        let metadata_len = le_u32(bytes, 20);
        if let Some(len) = metadata_len {
            check_len(FrameField::Metadata, len.into(), limits.max_metadata.into())?;
            if len != 0 && !allows(FrameField::Metadata) {
                return Err(not_allowed(FrameField::Metadata));
            }
        }
        let payload_len = le_u64(bytes, 24);
        if let Some(len) = payload_len {
            check_len(FrameField::Payload, len, limits.max_payload)?;
            if len != 0 && !allows(FrameField::Payload) {
                return Err(not_allowed(FrameField::Payload));
            }
        }
        let tensor_count = le_u32(bytes, 32);
        if let Some(count) = tensor_count {
            check_len(FrameField::Tensors, count.into(), limits.max_tensors.into())?;
            if count != 0 && !allows(FrameField::Tensors) {
                return Err(not_allowed(FrameField::Tensors));
            }
        }
        if let Some(reserved) = le_u32(bytes, 36) {
            if reserved != 0 {
                return Err(FrameError::NonZeroReserved {
                    offset: 36,
                    tensor: None,
                });
            }
        }
        Ok(
            match (
                kind,
                message_id,
                handler_len,
                metadata_len,
                payload_len,
                tensor_count,
            ) {
                (Some(kind), Some(message_id), Some(h), Some(m), Some(p), Some(t))
                    if bytes.len() >= HEADER_LEN =>
                {
                    Some(Header {
                        kind,
                        message_id,
                        handler_len: h,
                        metadata_len: m,
                        payload_len: p,
                        tensor_count: t,
                    })
                }
                _ => None,
            },
        )
    }

    /// Parses and checks a complete header.
    ///
    /// # Errors
    /// [`FrameError`] for a bad field or a length over `limits`.
    pub fn parse(bytes: &[u8; HEADER_LEN], limits: &FrameLimits) -> Result<Header, FrameError> {
        Header::check_prefix(bytes, limits)?.ok_or(FrameError::BadMagic)
    }

    /// The 40 wire bytes.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        let parts: [(usize, &[u8]); 8] = [
            (0, &MAGIC),
            (4, &[VERSION, self.kind.to_byte()]),
            (8, &self.message_id.to_le_bytes()),
            (16, &self.handler_len.to_le_bytes()),
            (20, &self.metadata_len.to_le_bytes()),
            (24, &self.payload_len.to_le_bytes()),
            (32, &self.tensor_count.to_le_bytes()),
            (36, &[0; 4]),
        ];
        for (at, bytes) in parts {
            if let Some(dst) = out.get_mut(at..at + bytes.len()) {
                dst.copy_from_slice(bytes);
            }
        }
        out
    }

    /// Bytes from the start of the frame to the end of the payload: header, descriptors,
    /// handler name, metadata and payload (everything but inline tensor data).
    pub fn fixed_len(&self) -> u64 {
        // At most 40 + 16 * (2^32 - 1) + 2 * (2^32 - 1) + payload: saturate on payload.
        (HEADER_LEN as u64)
            .saturating_add(u64::from(self.tensor_count) * DESCRIPTOR_LEN as u64)
            .saturating_add(u64::from(self.handler_len))
            .saturating_add(u64::from(self.metadata_len))
            .saturating_add(self.payload_len)
    }

    pub(super) fn descriptors_end(&self) -> u64 {
        HEADER_LEN as u64 + u64::from(self.tensor_count) * DESCRIPTOR_LEN as u64
    }
}

pub(super) fn check_len(field: FrameField, claimed: u64, limit: u64) -> Result<(), FrameError> {
    if claimed > limit {
        Err(FrameError::OverLimit {
            field,
            claimed,
            limit,
        })
    } else {
        Ok(())
    }
}
