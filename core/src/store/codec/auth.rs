//! rdzv's `AUTH` extension query: a client's shared-secret token, sent once, first, on a
//! connection to a server that has tokens (`store serve --token-file`).
//!
//! Frame: the byte [`AUTH_QUERY`] (`0x41`, `'A'`: like `STATS`' `0x52`, far above
//! PyTorch's query types 0..=18, so no PyTorch client ever sends it), then the token as
//! a TCPStore string (`u64` little-endian length, then the bytes). Reply: the single byte
//! [`AUTH_ACCEPTED`]. A refused token gets no reply: the server closes the connection,
//! as it refuses anything else (PyTorch's protocol has no error reply).
//!
//! The decoder is a push decoder like [`super::decode_request`]: it reports
//! [`Decoded::Partial`] with a lower bound on the bytes still missing, checks the claimed
//! length against its limit as soon as the length field is whole, and allocates nothing.
//! What a token grants is decided in [`crate::store::access`], not here.

use core::fmt;

use super::{Decoded, EncodeError};

/// The query type byte of `AUTH`.
pub const AUTH_QUERY: u8 = 0x41;

/// The reply byte that accepts a token.
pub const AUTH_ACCEPTED: u8 = 0;

/// Longest token a server decodes ([`crate::store::access`] accepts 16 to 256 bytes;
/// the codec's limit is looser so that a too-long token is refused by name there).
pub const MAX_AUTH_TOKEN_LEN: u64 = 1024;

const LEN_WIDTH: usize = 8;

/// `AUTH(token)`, borrowing the token from the frame.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct AuthRequest<'a> {
    /// The token as sent.
    pub token: &'a [u8],
}

impl fmt::Debug for AuthRequest<'_> {
    /// Never prints the token.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AuthRequest {{ token: <{} bytes> }}", self.token.len())
    }
}

/// Why bytes are not an `AUTH` frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AuthDecodeError {
    /// The first byte is not [`AUTH_QUERY`] (a PyTorch client sends `VALIDATE`, 0).
    NotAuth {
        /// The byte received.
        byte: u8,
    },
    /// The claimed token length is over the limit.
    TokenTooLong {
        /// The length claimed.
        claimed: u64,
        /// The limit.
        limit: u64,
    },
}

impl fmt::Display for AuthDecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            AuthDecodeError::NotAuth { byte } => write!(
                f,
                "the first request is query type {byte} (0x{byte:02x}), not rdzv's AUTH \
                 (0x41): this server requires a token, which only rdzv's client sends \
                 (a PyTorch client cannot)"
            ),
            AuthDecodeError::TokenTooLong { claimed, limit } => write!(
                f,
                "AUTH token length {claimed} exceeds the limit of {limit} bytes"
            ),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for AuthDecodeError {}

/// Decodes an `AUTH` frame at the start of `buf`, with tokens of at most `max_token_len`
/// bytes. `Complete` carries the bytes used; bytes after them are the next request.
pub fn decode_auth(
    buf: &[u8],
    max_token_len: u64,
) -> Result<Decoded<AuthRequest<'_>>, AuthDecodeError> {
    let Some((&byte, rest)) = buf.split_first() else {
        return Ok(Decoded::Partial(1 + LEN_WIDTH));
    };
    if byte != AUTH_QUERY {
        return Err(AuthDecodeError::NotAuth { byte });
    }
    let Some(field) = rest.get(..LEN_WIDTH) else {
        return Ok(Decoded::Partial(LEN_WIDTH - rest.len()));
    };
    let mut raw = [0u8; LEN_WIDTH];
    raw.copy_from_slice(field);
    let claimed = u64::from_le_bytes(raw);
    if claimed > max_token_len {
        return Err(AuthDecodeError::TokenTooLong {
            claimed,
            limit: max_token_len,
        });
    }
    // claimed <= max_token_len, which callers keep far below usize::MAX; a limit that
    // does not fit usize is clamped, and the bytes given decide the rest.
    let len = usize::try_from(claimed).unwrap_or(usize::MAX);
    let body = rest.get(LEN_WIDTH..).unwrap_or_default();
    match body.get(..len) {
        Some(token) => Ok(Decoded::Complete(
            AuthRequest { token },
            1 + LEN_WIDTH + len,
        )),
        None => Ok(Decoded::Partial(len - body.len())),
    }
}

impl AuthRequest<'_> {
    /// How many bytes [`AuthRequest::encode`] writes.
    pub fn encoded_len(&self) -> usize {
        1 + LEN_WIDTH + self.token.len()
    }

    /// Writes the frame at the start of `out`; returns its length, or
    /// [`EncodeError::InsufficientSize`] (writing nothing) if `out` is too short.
    pub fn encode(&self, out: &mut [u8]) -> Result<usize, EncodeError> {
        let needed = self.encoded_len();
        let Some(out) = out.get_mut(..needed) else {
            return Err(EncodeError::InsufficientSize { needed });
        };
        let (head, token) = out.split_at_mut(1 + LEN_WIDTH);
        let (query, len) = head.split_at_mut(1);
        query.copy_from_slice(&[AUTH_QUERY]);
        len.copy_from_slice(&(self.token.len() as u64).to_le_bytes());
        token.copy_from_slice(self.token);
        Ok(needed)
    }

    /// Appends the frame to `out`.
    #[cfg(feature = "alloc")]
    pub fn encode_into(&self, out: &mut alloc::vec::Vec<u8>) {
        out.reserve(self.encoded_len());
        out.push(AUTH_QUERY);
        out.extend_from_slice(&(self.token.len() as u64).to_le_bytes());
        out.extend_from_slice(self.token);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{format, string::ToString};

    #[test]
    fn frames_round_trip_and_decode_in_pieces() {
        let request = AuthRequest {
            token: b"0123456789abcdef",
        };
        let mut buf = [0u8; 64];
        let n = request.encode(&mut buf).unwrap();
        assert_eq!(n, 25);
        assert_eq!(&buf[..9], b"\x41\x10\x00\x00\x00\x00\x00\x00\x00");
        assert_eq!(
            decode_auth(&buf[..n], MAX_AUTH_TOKEN_LEN),
            Ok(Decoded::Complete(request, n))
        );
        for cut in 0..n {
            match decode_auth(&buf[..cut], MAX_AUTH_TOKEN_LEN) {
                Ok(Decoded::Partial(more)) => assert!(more >= 1 && cut + more <= n, "{cut}"),
                other => panic!("cut {cut}: {other:?}"),
            }
        }
        assert_eq!(
            request.encode(&mut buf[..5]),
            Err(EncodeError::InsufficientSize { needed: 25 })
        );
        assert!(!format!("{request:?}").contains("0123"));
    }

    #[test]
    fn other_queries_and_long_claims_are_refused() {
        assert_eq!(
            decode_auth(b"\x00\xce\xf7\x85\x3c", 64),
            Err(AuthDecodeError::NotAuth { byte: 0 })
        );
        let mut frame = [0u8; 9];
        frame[0] = AUTH_QUERY;
        frame[1..].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(
            decode_auth(&frame, 64),
            Err(AuthDecodeError::TokenTooLong {
                claimed: u64::MAX,
                limit: 64
            })
        );
        assert!(AuthDecodeError::NotAuth { byte: 0 }
            .to_string()
            .contains("PyTorch"));
    }
}
