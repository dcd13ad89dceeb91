//! [`FrameLimits`]: what a receiver accepts before it allocates or waits for anything.

/// The largest frame a decoder accepts. A claimed size above a limit is an error as soon
/// as its field is complete; a size equal to the limit is accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct FrameLimits {
    /// Longest handler name, in bytes.
    pub max_handler_name: u32,
    /// Longest metadata, in bytes.
    pub max_metadata: u32,
    /// Longest payload, in bytes.
    pub max_payload: u64,
    /// Most tensors in one frame.
    pub max_tensors: u32,
    /// Largest single tensor, in bytes (inline or not: the receiver allocates it).
    pub max_tensor_bytes: u64,
    /// Most bytes in one frame's data section: inline tensor bytes plus channel
    /// descriptors.
    pub max_inline_bytes: u64,
    /// Longest channel descriptor of one tensor, in bytes (the wire field holds at most
    /// 255).
    pub max_channel_descriptor: u32,
}

impl FrameLimits {
    /// rdzv's defaults: 1 KiB handler names, 1 MiB metadata, 1 GiB payloads, 64 Ki
    /// tensors of at most 64 GiB each, 1 GiB of inline tensor data, channel descriptors
    /// up to the wire's 255 bytes.
    pub const DEFAULT: FrameLimits = FrameLimits {
        max_handler_name: 1024,
        max_metadata: 1024 * 1024,
        max_payload: 1 << 30,
        max_tensors: 64 * 1024,
        max_tensor_bytes: 64 << 30,
        max_inline_bytes: 1 << 30,
        max_channel_descriptor: u8::MAX as u32,
    };

    /// For a pipe's first frame: a handshake payload of at most 64 KiB and nothing else.
    pub const HANDSHAKE: FrameLimits = FrameLimits {
        max_handler_name: 0,
        max_metadata: 0,
        max_payload: 64 * 1024,
        max_tensors: 0,
        max_tensor_bytes: 0,
        max_inline_bytes: 0,
        max_channel_descriptor: 0,
    };

    /// No limits. Only for trusted peers.
    pub const UNLIMITED: FrameLimits = FrameLimits {
        max_handler_name: u32::MAX,
        max_metadata: u32::MAX,
        max_payload: u64::MAX,
        max_tensors: u32::MAX,
        max_tensor_bytes: u64::MAX,
        max_inline_bytes: u64::MAX,
        max_channel_descriptor: u32::MAX,
    };

    /// These limits with a different payload limit.
    pub const fn with_max_payload(mut self, bytes: u64) -> FrameLimits {
        self.max_payload = bytes;
        self
    }

    /// These limits with a different tensor count limit.
    pub const fn with_max_tensors(mut self, tensors: u32) -> FrameLimits {
        self.max_tensors = tensors;
        self
    }

    /// These limits with a different inline byte limit.
    pub const fn with_max_inline_bytes(mut self, bytes: u64) -> FrameLimits {
        self.max_inline_bytes = bytes;
        self
    }

    /// These limits with a different per-tensor byte limit.
    pub const fn with_max_tensor_bytes(mut self, bytes: u64) -> FrameLimits {
        self.max_tensor_bytes = bytes;
        self
    }

    /// These limits with a different channel descriptor length limit.
    pub const fn with_max_channel_descriptor(mut self, bytes: u32) -> FrameLimits {
        self.max_channel_descriptor = bytes;
        self
    }
}

impl Default for FrameLimits {
    fn default() -> Self {
        FrameLimits::DEFAULT
    }
}
