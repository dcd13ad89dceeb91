//! Host memory a device runtime stages bytes in ([`HostBytes`]), which channels read
//! where it is and give back when done.

use std::fmt;

use crate::channel::StableBytes;

/// Host memory a device runtime staged a tensor into, owned by the runtime (pinned
/// buffers from its pool, say): see [`HostBytes::staged`].
///
/// Contract for implementors: [`bytes`](StagedBytes::bytes) returns the same slice on
/// every call, and the bytes stay at that address, unchanged, while the value lives (a
/// channel lends the address to the peer). Dropping the value gives the memory back to
/// the runtime.
pub trait StagedBytes: Send + Sync + 'static {
    /// The bytes.
    fn bytes(&self) -> &[u8];
}

/// A tensor's bytes in host memory, on their way out: a plain `Vec`, or memory a device
/// runtime staged the tensor into ([`StagedBytes`]). The CPU channels read either where
/// it is (inline frames, `cma`, `xth`, `mpt`), so a `cuda_basic` tensor is copied once,
/// device to host, and never again on the sending side.
pub struct HostBytes(HostRepr);

enum HostRepr {
    Owned(Vec<u8>),
    Staged(Box<dyn StagedBytes>),
}

impl HostBytes {
    /// Bytes a runtime staged into its own memory; dropping the value gives it back.
    pub fn staged(bytes: impl StagedBytes) -> HostBytes {
        HostBytes(HostRepr::Staged(Box::new(bytes)))
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        match &self.0 {
            HostRepr::Owned(bytes) => bytes,
            HostRepr::Staged(staged) => staged.bytes(),
        }
    }

    /// Whether a runtime's memory holds them (not a `Vec`).
    pub fn is_staged(&self) -> bool {
        matches!(self.0, HostRepr::Staged(_))
    }

    /// The `Vec`, when they are one (for the agent's recycled buffers); staged bytes are
    /// dropped, which gives their memory back to the runtime.
    pub fn into_owned(self) -> Option<Vec<u8>> {
        match self.0 {
            HostRepr::Owned(bytes) => Some(bytes),
            HostRepr::Staged(_) => None,
        }
    }

    /// The bytes as a `Vec`: the `Vec` they are, or a copy of staged bytes (which go back
    /// to their runtime).
    pub fn into_vec(self) -> Vec<u8> {
        match self.0 {
            HostRepr::Owned(bytes) => bytes,
            HostRepr::Staged(staged) => staged.bytes().to_vec(),
        }
    }
}

impl From<Vec<u8>> for HostBytes {
    fn from(bytes: Vec<u8>) -> HostBytes {
        HostBytes(HostRepr::Owned(bytes))
    }
}

impl Default for HostBytes {
    fn default() -> HostBytes {
        HostBytes::from(Vec::new())
    }
}

impl std::ops::Deref for HostBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl AsRef<[u8]> for HostBytes {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl StableBytes for HostBytes {
    fn stable_bytes(&self) -> &[u8] {
        // A Vec's heap bytes do not move with it; staged bytes promise the same.
        self.as_slice()
    }
}

/// A copy; staged bytes are copied into a `Vec` (the copy holds no runtime memory).
impl Clone for HostBytes {
    fn clone(&self) -> HostBytes {
        HostBytes::from(self.as_slice().to_vec())
    }
}

impl PartialEq for HostBytes {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for HostBytes {}

impl PartialEq<Vec<u8>> for HostBytes {
    fn eq(&self, other: &Vec<u8>) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl PartialEq<HostBytes> for Vec<u8> {
    fn eq(&self, other: &HostBytes) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl PartialEq<[u8]> for HostBytes {
    fn eq(&self, other: &[u8]) -> bool {
        self.as_slice() == other
    }
}

impl fmt::Debug for HostBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            HostRepr::Owned(bytes) => fmt::Debug::fmt(bytes, f),
            HostRepr::Staged(staged) => f
                .debug_struct("HostBytes")
                .field("staged_len", &staged.bytes().len())
                .finish(),
        }
    }
}

impl crate::rpc::recycle::Recyclable for HostBytes {
    fn into_recyclable(self) -> Option<Vec<u8>> {
        self.into_owned()
    }
}
