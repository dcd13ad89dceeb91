//! The messages a dynamic group's members exchange when one joins or leaves
//! (PyTorch's `_update_group_membership`): which internal handlers carry them, and their
//! payloads.
//!
//! A joining worker calls [`GROUP_JOIN`] on every member with a [`JoinAnnouncement`]
//! (postcard); a leaving one calls [`GROUP_LEAVE`] with its name. Decoding checks the
//! bytes are exactly one message and the name is a valid worker name, so a peer's
//! garbage is an error, never a panic or a bogus member. Nothing here sends anything.

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;

use super::name::{validate_worker_name, validate_worker_name_bytes, WorkerId};
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
    /// postcard's message (not expected for these types).
    pub fn encode(&self) -> Result<Vec<u8>, String> {
        postcard::to_allocvec(self).map_err(|e| format!("{e}"))
    }

    /// Reads a payload: exactly one announcement with a valid worker name.
    ///
    /// # Errors
    /// What is wrong with the bytes.
    pub fn decode(payload: &[u8]) -> Result<JoinAnnouncement, String> {
        let (announcement, rest): (JoinAnnouncement, &[u8]) = postcard::take_from_bytes(payload)
            .map_err(|e| format!("bad join announcement: {e}"))?;
        if !rest.is_empty() {
            return Err(format!(
                "bad join announcement: {} bytes after the message",
                rest.len()
            ));
        }
        validate_worker_name(&announcement.name)
            .map_err(|e| format!("bad join announcement: {e}"))?;
        Ok(announcement)
    }
}

/// Reads a [`GROUP_LEAVE`] payload: the leaving worker's name.
///
/// # Errors
/// The payload is not a valid worker name.
pub fn decode_leave(payload: &[u8]) -> Result<&str, String> {
    validate_worker_name_bytes(payload).map_err(|e| format!("bad leave announcement: {e}"))
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
        assert!(decode_leave(b"").is_err());
        assert!(decode_leave(&[0xff]).is_err());
    }
}
