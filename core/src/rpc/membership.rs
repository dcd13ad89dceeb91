//! The messages a dynamic group's members exchange when one joins or leaves
//! (PyTorch's `_update_group_membership`): which internal handlers carry them, and their
//! payloads.
//!
//! A joining worker calls [`GROUP_JOIN`] on every member with a [`JoinAnnouncement`]
//! (postcard); a leaving one calls [`GROUP_LEAVE`] with its name. Decoding checks the
//! bytes are exactly one message and the name is a valid worker name, so a peer's
//! garbage is an error, never a panic or a bogus member. Nothing here sends anything.

use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

use super::name::{validate_worker_name, validate_worker_name_bytes, NameError, WorkerId};
use crate::device_map::WorkerDevices;

/// The internal handler that receives a [`JoinAnnouncement`].
pub const GROUP_JOIN: &str = "__rdzv_group_join";
/// The internal handler that receives a leaving worker's name.
pub const GROUP_LEAVE: &str = "__rdzv_group_leave";

/// What a joining worker tells each member.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct JoinAnnouncement {
    /// The worker's name.
    pub name: String,
    /// Its id (rank).
    pub id: i16,
    /// Its published listening address(es).
    pub address: String,
    /// Its devices and device maps.
    pub devices: WorkerDevices,
}

impl JoinAnnouncement {
    /// The announcement's id as a [`WorkerId`].
    pub fn worker_id(&self) -> WorkerId {
        WorkerId::from(self.id)
    }

    /// The payload bytes.
    ///
    /// # Errors
    /// postcard's error (not expected for these types).
    pub fn encode(&self) -> Result<Vec<u8>, postcard::Error> {
        postcard::to_allocvec(self)
    }

    /// Reads a payload: exactly one announcement with a valid worker name.
    ///
    /// # Errors
    /// [`MembershipError`]: what is wrong with the bytes.
    pub fn decode(payload: &[u8]) -> Result<JoinAnnouncement, MembershipError> {
        let (announcement, rest): (JoinAnnouncement, &[u8]) =
            postcard::take_from_bytes(payload).map_err(MembershipError::Malformed)?;
        if !rest.is_empty() {
            return Err(MembershipError::TrailingBytes { count: rest.len() });
        }
        validate_worker_name(&announcement.name).map_err(MembershipError::JoinName)?;
        Ok(announcement)
    }
}

/// A join or leave announcement that does not decode.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MembershipError {
    /// The join announcement is not postcard of a [`JoinAnnouncement`].
    Malformed(postcard::Error),
    /// Bytes follow the join announcement.
    TrailingBytes {
        /// How many.
        count: usize,
    },
    /// The joining worker's name is invalid.
    JoinName(NameError),
    /// The leave announcement is not a valid worker name.
    LeaveName(NameError),
}

impl fmt::Display for MembershipError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MembershipError::Malformed(e) => write!(f, "bad join announcement: {e}"),
            MembershipError::TrailingBytes { count } => {
                write!(f, "bad join announcement: {count} bytes after the message")
            }
            MembershipError::JoinName(e) => write!(f, "bad join announcement: {e}"),
            MembershipError::LeaveName(e) => write!(f, "bad leave announcement: {e}"),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for MembershipError {}

/// Reads a [`GROUP_LEAVE`] payload: the leaving worker's name.
///
/// # Errors
/// [`MembershipError::LeaveName`]: the payload is not a valid worker name.
pub fn decode_leave(payload: &[u8]) -> Result<&str, MembershipError> {
    validate_worker_name_bytes(payload).map_err(MembershipError::LeaveName)
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;

    fn sample() -> JoinAnnouncement {
        JoinAnnouncement {
            name: "trainer-1".to_string(),
            id: 3,
            address: "tcp://127.0.0.1:4000".to_string(),
            devices: WorkerDevices {
                name: "trainer-1".to_string(),
                device_count: 0,
                device_maps: Default::default(),
                devices: Vec::new(),
            },
        }
    }

    #[test]
    fn round_trip() {
        let a = sample();
        assert_eq!(JoinAnnouncement::decode(&a.encode().unwrap()), Ok(a));
    }

    #[test]
    fn garbage_and_bad_names_are_errors() {
        let mut bytes = sample().encode().unwrap();
        bytes.push(0);
        assert!(JoinAnnouncement::decode(&bytes).is_err());
        assert!(JoinAnnouncement::decode(&[0xff; 7]).is_err());
        let mut bad = sample();
        bad.name = "a b".to_string();
        assert!(JoinAnnouncement::decode(&bad.encode().unwrap()).is_err());
        assert_eq!(decode_leave(b"w1"), Ok("w1"));
        assert!(matches!(
            decode_leave(b""),
            Err(MembershipError::LeaveName(_))
        ));
        let text = JoinAnnouncement::decode(&[0xff; 7])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(text.starts_with("bad join announcement: "), "{text}");
        assert!(decode_leave(&[0xff]).is_err());
    }
}
