//! The pipe handshake: the connector's brochure and the listener's answer, carried with
//! postcard in the payload of a [`FrameKind::Handshake`] frame.
//!
//! The connector sends [`Handshake::Hello`] (its worker name and id, its [`Brochure`],
//! a token for its `mpt` lanes and a fresh nonce); the listener replies
//! [`Handshake::Answer`] (its own name and id, the [`BrochureAnswer`] of
//! [`crate::negotiate::answer_brochure`], its nonce and its proof of the group secret) or
//! [`Handshake::Refused`] with a reason; the connector sends its [`Handshake::Proof`],
//! and the listener says [`Handshake::Welcome`] or [`Handshake::Refused`]
//! ([`crate::rpc::auth`] decides the proofs). Decoding borrows every string from the frame, so nothing is allocated,
//! and it checks that the postcard bytes are exactly one message and that worker names
//! are valid. It decides nothing about the negotiation itself.

use alloc::vec::Vec;
use core::fmt;

use super::{EncodeError, Frame, FrameKind, OutgoingFrame, HEADER_LEN};
use crate::negotiate::{Brochure, BrochureAnswer};
use crate::rpc::auth::{Nonce, Proof};
use crate::rpc::name::{validate_worker_name, NameError, WorkerId};

/// One handshake message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Handshake<'a> {
    /// The connector introduces itself and what it can use.
    Hello {
        /// Its worker name.
        name: &'a str,
        /// Its worker id.
        id: WorkerId,
        /// Its transports and channels.
        #[serde(borrow)]
        brochure: Brochure<'a>,
        /// A token, unique to this pipe, that the connector's extra connections (the
        /// `mpt` channel's lanes) present to the listener, so that it can tell which
        /// pipe they belong to. Unused unless the pipe negotiates `mpt`.
        lanes_token: u64,
        /// The connector's fresh nonce, which the listener's proof covers.
        challenge: Nonce,
    },
    /// The listener's choice.
    Answer {
        /// Its worker name.
        name: &'a str,
        /// Its worker id.
        id: WorkerId,
        /// The negotiated transport and channels.
        #[serde(borrow)]
        answer: BrochureAnswer<'a>,
        /// The listener's fresh nonce, which the connector's proof covers.
        challenge: Nonce,
        /// The listener's proof of the group secret; `None` when it has none.
        proof: Option<Proof>,
    },
    /// The listener will not talk (e.g. no common transport, a failed proof); the pipe
    /// closes after it.
    Refused {
        /// Why, for the connector's error message.
        reason: &'a str,
    },
    /// The connector's proof of the group secret, after it accepted the answer; `None`
    /// when it has none.
    Proof {
        /// The proof.
        proof: Option<Proof>,
    },
    /// The listener accepted the proof: the pipe is open.
    Welcome,
}

/// Why a frame does not hold a valid handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The frame is not a handshake frame.
    NotAHandshake {
        /// Its kind.
        kind: FrameKind,
    },
    /// postcard could not read the payload.
    Malformed(postcard::Error),
    /// The payload holds more bytes than one message.
    TrailingBytes {
        /// How many.
        count: usize,
    },
    /// The peer's worker name is invalid.
    InvalidName(NameError),
}

impl fmt::Display for HandshakeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Invalid RPC handshake: ")?;
        match self {
            HandshakeError::NotAHandshake { kind } => {
                write!(f, "expected a handshake frame, got a {kind} frame")
            }
            HandshakeError::Malformed(e) => write!(f, "{e}"),
            HandshakeError::TrailingBytes { count } => {
                write!(f, "{count} bytes after the message")
            }
            HandshakeError::InvalidName(e) => write!(f, "{e}"),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for HandshakeError {}

impl<'a> Handshake<'a> {
    /// The size of the postcard encoding, i.e. the frame's payload length.
    ///
    /// # Errors
    /// [`EncodeError::Handshake`] if postcard cannot serialize it.
    pub fn payload_len(&self) -> Result<usize, EncodeError> {
        postcard::experimental::serialized_size(self).map_err(EncodeError::Handshake)
    }

    /// The size of the whole handshake frame.
    ///
    /// # Errors
    /// As [`payload_len`](Self::payload_len).
    pub fn encoded_len(&self) -> Result<usize, EncodeError> {
        Ok(HEADER_LEN + self.payload_len()?)
    }

    /// Writes the handshake frame into `buf`; returns the bytes written.
    ///
    /// # Errors
    /// [`EncodeError::InsufficientSize`] naming the size needed.
    pub fn encode(&self, buf: &mut [u8]) -> Result<usize, EncodeError> {
        let needed = self.encoded_len()?;
        let available = buf.len();
        let out = buf
            .get_mut(..needed)
            .ok_or(EncodeError::InsufficientSize { needed, available })?;
        let (head, body) = out.split_at_mut(HEADER_LEN);
        let written = postcard::to_slice(self, body)
            .map_err(EncodeError::Handshake)?
            .len();
        let frame = OutgoingFrame {
            payload: body.get(..written).unwrap_or_default(),
            ..OutgoingFrame::empty(FrameKind::Handshake, 0)
        };
        frame.encode_head(head)?;
        Ok(HEADER_LEN + written)
    }

    /// Appends the handshake frame to `out`.
    ///
    /// # Errors
    /// [`EncodeError::Handshake`] if postcard cannot serialize it.
    pub fn encode_to_vec(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        let needed = self.encoded_len()?;
        let start = out.len();
        out.resize(start + needed, 0);
        let result = match out.get_mut(start..) {
            Some(tail) => self.encode(tail).map(|_| ()),
            None => Ok(()),
        };
        if result.is_err() {
            out.truncate(start);
        }
        result
    }

    fn check_names(&self) -> Result<(), HandshakeError> {
        match self {
            Handshake::Hello { name, .. } | Handshake::Answer { name, .. } => {
                validate_worker_name(name).map_err(HandshakeError::InvalidName)
            }
            Handshake::Refused { .. } | Handshake::Proof { .. } | Handshake::Welcome => Ok(()),
        }
    }
}

/// Reads the handshake in a decoded frame.
///
/// # Errors
/// [`HandshakeError`] if the frame is not a handshake, its payload is not exactly one
/// postcard [`Handshake`], or a worker name in it is invalid.
pub fn decode_handshake<'a>(frame: &Frame<'a>) -> Result<Handshake<'a>, HandshakeError> {
    if frame.kind() != FrameKind::Handshake {
        return Err(HandshakeError::NotAHandshake { kind: frame.kind() });
    }
    let (message, rest): (Handshake<'a>, &[u8]) =
        postcard::take_from_bytes(frame.payload()).map_err(HandshakeError::Malformed)?;
    if !rest.is_empty() {
        return Err(HandshakeError::TrailingBytes { count: rest.len() });
    }
    message.check_names()?;
    Ok(message)
}
