//! How the RRef protocol's messages travel inside the RPC agent's calls: each is
//! postcard bytes in a call's payload, and the runtime picks the call's handler name from
//! [`WireKind`]. Decoding checks that the bytes are exactly one value, so a truncated or
//! padded payload is refused rather than half read. It decides nothing about the
//! protocol itself (that is [`super::RRefContext`]).
//!
//! - [`RRefMessage`] (every machine message: `RemoteRet`, the three control messages,
//!   and their `Ack`, which rides back in the control call's response);
//! - [`ForkData`] (an RRef inside a message to another worker);
//! - [`RemoteCallHeader`] (the RRef ids and the handler name in front of a `remote()`
//!   call's own payload);
//! - [`FetchRequest`] (`to_here`: which value, and how long the owner may wait for it).

use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

use super::{ControlKind, ForkData, ForkId, RRefId, RRefMessage};

/// Why bytes are not a valid RRef wire value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WireError {
    /// postcard could not read them.
    Malformed {
        /// What was being read.
        what: &'static str,
    },
    /// A value was read and bytes were left over.
    TrailingBytes {
        /// What was being read.
        what: &'static str,
        /// How many bytes were left.
        left: usize,
    },
    /// The value could not be written (postcard refused it).
    Encode {
        /// What was being written.
        what: &'static str,
    },
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Malformed { what } => {
                write!(f, "malformed {what}: the bytes are not a postcard {what}")
            }
            WireError::TrailingBytes { what, left } => {
                write!(f, "malformed {what}: {left} bytes follow the value")
            }
            WireError::Encode { what } => write!(f, "cannot encode {what}"),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for WireError {}

/// The `remote()` call's prefix: the RRef ids for the owner's machine and the handler
/// that computes the value. The caller's own payload follows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RemoteCallHeader {
    /// The RRef.
    pub rref: RRefId,
    /// The caller's fork.
    pub fork: ForkId,
    /// The handler to run on the owner.
    pub handler: String,
}

/// A `to_here` request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FetchRequest {
    /// The RRef whose value is wanted.
    pub rref: RRefId,
    /// How long the owner may wait for a value that is not ready yet, in milliseconds.
    pub wait_ms: u64,
}

/// Which call carries a machine message: one per kind, so that fault injection can
/// name each control message as PyTorch's faulty agent does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireKind {
    /// [`RRefMessage::RemoteRet`].
    RemoteRet,
    /// A control message.
    Control(ControlKind),
    /// [`RRefMessage::Ack`] (the runtime puts it in a control call's response).
    Ack,
    /// [`RRefMessage::RemoteCall`] (the runtime sends it in the `remote()` call itself).
    RemoteCall,
}

/// The reserved handler names the agent carries RRef traffic on (the agent refuses
/// `__rdzv_` names from applications). Both ends must agree on them, so they are part
/// of the wire format.
pub mod handler {
    /// The `remote()` call ([`RemoteCallHeader`](super::RemoteCallHeader) in front of
    /// the caller's payload).
    pub const REMOTE: &str = "__rdzv_rref_remote";
    /// `to_here` ([`FetchRequest`](super::FetchRequest)).
    pub const FETCH: &str = "__rdzv_rref_fetch";
    /// The owner's `RemoteRet`.
    pub const REMOTE_RET: &str = "__rdzv_rref_remote_ret";
    /// `RREF_FORK_REQUEST`.
    pub const FORK_REQUEST: &str = "__rdzv_rref_fork_request";
    /// `RREF_CHILD_ACCEPT`.
    pub const CHILD_ACCEPT: &str = "__rdzv_rref_child_accept";
    /// `RREF_USER_DELETE`.
    pub const USER_DELETE: &str = "__rdzv_rref_user_delete";
    /// An `Ack` sent on its own (acks normally ride in a control call's response).
    pub const ACK: &str = "__rdzv_rref_ack";
    /// A worker's debug counts (`wait_until_owners_and_forks_on_rank`).
    pub const DEBUG_INFO: &str = "__rdzv_rref_debug_info";
}

impl WireKind {
    /// The reserved handler whose calls carry this kind of message.
    pub const fn handler(self) -> &'static str {
        match self {
            WireKind::RemoteRet => handler::REMOTE_RET,
            WireKind::Control(ControlKind::ForkRequest) => handler::FORK_REQUEST,
            WireKind::Control(ControlKind::ChildAccept) => handler::CHILD_ACCEPT,
            WireKind::Control(ControlKind::UserDelete) => handler::USER_DELETE,
            WireKind::Ack => handler::ACK,
            WireKind::RemoteCall => handler::REMOTE,
        }
    }
}

/// PyTorch's message-type name (`RREF_FORK_REQUEST`, `RREF_CHILD_ACCEPT`,
/// `RREF_USER_DELETE`) of the control message that calls to `handler` carry, which
/// fault injection accepts in place of the handler name; `None` for any other handler.
pub fn control_message_name(handler: &str) -> Option<&'static str> {
    [
        ControlKind::ForkRequest,
        ControlKind::ChildAccept,
        ControlKind::UserDelete,
    ]
    .into_iter()
    .find(|&kind| WireKind::Control(kind).handler() == handler)
    .map(ControlKind::name)
}

/// PyTorch's message-type names of what calls to `handler` carry, which fault injection
/// accepts in place of the handler name (PyTorch's faulty agent's `messages_to_fail`
/// and `messages_to_delay`): the three control messages, `REMOTE_RET`, the `remote()`
/// call (`PYTHON_REMOTE_CALL` and `SCRIPT_REMOTE_CALL`: one call carries both kinds
/// here) and `to_here` (`PYTHON_RREF_FETCH_CALL`, `SCRIPT_RREF_FETCH_CALL`); none for
/// any other handler.
pub fn message_type_names(handler: &str) -> &'static [&'static str] {
    match handler {
        handler::REMOTE => &["PYTHON_REMOTE_CALL", "SCRIPT_REMOTE_CALL"],
        handler::FETCH => &["PYTHON_RREF_FETCH_CALL", "SCRIPT_RREF_FETCH_CALL"],
        handler::REMOTE_RET => &["REMOTE_RET"],
        handler::FORK_REQUEST => &["RREF_FORK_REQUEST"],
        handler::CHILD_ACCEPT => &["RREF_CHILD_ACCEPT"],
        handler::USER_DELETE => &["RREF_USER_DELETE"],
        _ => &[],
    }
}

impl RRefMessage {
    /// The call that carries it.
    pub const fn wire_kind(&self) -> WireKind {
        match self {
            RRefMessage::RemoteCall { .. } => WireKind::RemoteCall,
            RRefMessage::RemoteRet { .. } => WireKind::RemoteRet,
            RRefMessage::Control { kind, .. } => WireKind::Control(*kind),
            RRefMessage::Ack { .. } => WireKind::Ack,
        }
    }

    /// Its bytes.
    ///
    /// # Errors
    /// [`WireError::Encode`] (postcard refuses nothing of this type in practice).
    pub fn to_bytes(&self) -> Result<Vec<u8>, WireError> {
        to_bytes(self, "RRef message")
    }

    /// Reads one message.
    ///
    /// # Errors
    /// [`WireError`] for bytes that are not exactly one message.
    pub fn from_bytes(bytes: &[u8]) -> Result<RRefMessage, WireError> {
        from_bytes(bytes, "RRef message")
    }
}

impl ForkData {
    /// Its bytes, to put inside a message.
    ///
    /// # Errors
    /// [`WireError::Encode`] (never in practice).
    pub fn to_bytes(&self) -> Result<Vec<u8>, WireError> {
        to_bytes(self, "RRef fork")
    }

    /// Reads one fork.
    ///
    /// # Errors
    /// [`WireError`] for bytes that are not exactly one fork.
    pub fn from_bytes(bytes: &[u8]) -> Result<ForkData, WireError> {
        from_bytes(bytes, "RRef fork")
    }
}

impl FetchRequest {
    /// Its bytes.
    ///
    /// # Errors
    /// [`WireError::Encode`] (never in practice).
    pub fn to_bytes(&self) -> Result<Vec<u8>, WireError> {
        to_bytes(self, "RRef fetch request")
    }

    /// Reads one request.
    ///
    /// # Errors
    /// [`WireError`] for bytes that are not exactly one request.
    pub fn from_bytes(bytes: &[u8]) -> Result<FetchRequest, WireError> {
        from_bytes(bytes, "RRef fetch request")
    }
}

impl RemoteCallHeader {
    /// The header followed by `payload`.
    ///
    /// # Errors
    /// [`WireError::Encode`] (never in practice).
    pub fn prepend(&self, payload: &[u8]) -> Result<Vec<u8>, WireError> {
        let mut out = to_bytes(self, "remote() call header")?;
        out.extend_from_slice(payload);
        Ok(out)
    }

    /// Splits a `remote()` call's payload into its header and the caller's payload.
    ///
    /// # Errors
    /// [`WireError::Malformed`] when no header can be read.
    pub fn split(bytes: &[u8]) -> Result<(RemoteCallHeader, &[u8]), WireError> {
        postcard::take_from_bytes(bytes).map_err(|_| WireError::Malformed {
            what: "remote() call header",
        })
    }
}

fn to_bytes<T: serde::Serialize>(value: &T, what: &'static str) -> Result<Vec<u8>, WireError> {
    postcard::to_allocvec(value).map_err(|_| WireError::Encode { what })
}

fn from_bytes<'a, T: serde::Deserialize<'a>>(
    bytes: &'a [u8],
    what: &'static str,
) -> Result<T, WireError> {
    let (value, rest) =
        postcard::take_from_bytes(bytes).map_err(|_| WireError::Malformed { what })?;
    if !rest.is_empty() {
        return Err(WireError::TrailingBytes {
            what,
            left: rest.len(),
        });
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::name::WorkerId;

    fn id(worker: i16, local_id: u64) -> RRefId {
        RRefId {
            created_on: WorkerId::from(worker),
            local_id,
        }
    }

    #[test]
    fn messages_round_trip_and_name_their_call() {
        let messages = [
            RRefMessage::RemoteCall {
                rref: id(1, 2),
                fork: id(1, 3),
            },
            RRefMessage::RemoteRet {
                rref: id(1, 2),
                fork: id(1, 3),
            },
            RRefMessage::Control {
                kind: ControlKind::UserDelete,
                rref: id(1, 2),
                fork: id(4, u64::MAX),
            },
            RRefMessage::Ack {
                kind: ControlKind::ForkRequest,
                rref: id(1, 2),
                fork: id(4, 0),
            },
        ];
        for m in messages {
            let bytes = m.to_bytes().unwrap_or_default();
            assert_eq!(RRefMessage::from_bytes(&bytes), Ok(m));
        }
        assert_eq!(
            messages[2].wire_kind(),
            WireKind::Control(ControlKind::UserDelete)
        );
        assert_eq!(messages[3].wire_kind(), WireKind::Ack);
    }

    #[test]
    fn truncated_or_padded_bytes_are_refused() {
        let fork = ForkData {
            owner: WorkerId::from(2),
            rref: id(1, 9),
            fork: id(3, 1),
            parent: WorkerId::from(3),
        };
        let mut bytes = fork.to_bytes().unwrap_or_default();
        assert_eq!(ForkData::from_bytes(&bytes), Ok(fork));
        bytes.push(0);
        assert_eq!(
            ForkData::from_bytes(&bytes),
            Err(WireError::TrailingBytes {
                what: "RRef fork",
                left: 1
            })
        );
        bytes.truncate(3);
        assert!(matches!(
            ForkData::from_bytes(&bytes),
            Err(WireError::Malformed { .. })
        ));
        assert!(RRefMessage::from_bytes(&[]).is_err());
        assert!(FetchRequest::from_bytes(&[0xff; 40]).is_err());
    }

    #[test]
    fn fault_injection_names_the_control_messages_as_pytorch() {
        assert_eq!(
            control_message_name(handler::FORK_REQUEST),
            Some("RREF_FORK_REQUEST")
        );
        assert_eq!(
            control_message_name(handler::CHILD_ACCEPT),
            Some("RREF_CHILD_ACCEPT")
        );
        assert_eq!(
            control_message_name(handler::USER_DELETE),
            Some("RREF_USER_DELETE")
        );
        assert_eq!(control_message_name(handler::REMOTE_RET), None);
        assert_eq!(control_message_name("echo"), None);
        for kind in [
            ControlKind::ForkRequest,
            ControlKind::ChildAccept,
            ControlKind::UserDelete,
        ] {
            let handler = WireKind::Control(kind).handler();
            assert_eq!(message_type_names(handler), [kind.name()]);
        }
        assert_eq!(
            message_type_names(handler::REMOTE),
            ["PYTHON_REMOTE_CALL", "SCRIPT_REMOTE_CALL"]
        );
        assert!(message_type_names(handler::FETCH).contains(&"SCRIPT_RREF_FETCH_CALL"));
        assert_eq!(message_type_names(handler::REMOTE_RET), ["REMOTE_RET"]);
        assert!(message_type_names("echo").is_empty());
    }

    #[test]
    fn the_remote_header_is_split_from_the_callers_payload() {
        let header = RemoteCallHeader {
            rref: id(0, 1),
            fork: id(0, 2),
            handler: "make".into(),
        };
        let bytes = header.prepend(b"args").unwrap_or_default();
        let (read, rest) = RemoteCallHeader::split(&bytes).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(read, header);
        assert_eq!(rest, b"args");
        let fetch = FetchRequest {
            rref: id(0, 1),
            wait_ms: 1500,
        };
        let bytes = fetch.to_bytes().unwrap_or_default();
        assert_eq!(FetchRequest::from_bytes(&bytes), Ok(fetch));
    }
}
