//! Peers that prove they belong: the pipe handshake's mutual challenge-response over the
//! group secret.
//!
//! Unpickling is code execution, so a worker must not read a call from a peer that cannot
//! show it is one of the group. Each side sends a fresh nonce (the connector's in its
//! `Hello`, the listener's in its `Answer`) and proves it knows the secret with an
//! HMAC-SHA256 over a transcript of both nonces and both workers' names and ids, keyed
//! with the secret and labelled with its role, so that:
//! - the secret never goes on the wire;
//! - a proof cannot be replayed (the other side's nonce is fresh) or reflected (the role
//!   label differs), nor moved to another pair of workers (names and ids are in it).
//!
//! The listener answers with its proof; the connector checks it and sends its own
//! (`Proof`); the listener checks that before it reads anything else from the pipe, and
//! says `Welcome` or `Refused`. A worker without a secret sends no proof and accepts
//! none: two such workers talk as torch's do, and a worker with a secret refuses them.
//!
//! This module decides; the runtime draws the nonces and the secret from the operating
//! system and carries the frames.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::rpc::name::WorkerId;

/// The length of a nonce, and of a proof.
pub const NONCE_LEN: usize = 32;

/// A handshake nonce: 32 random bytes, fresh for every pipe.
pub type Nonce = [u8; NONCE_LEN];

/// An HMAC-SHA256 proof.
pub type Proof = [u8; 32];

/// The least length of a group secret, in bytes.
pub const MIN_SECRET_LEN: usize = 16;

/// Which side of the handshake proves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prover {
    /// The worker that accepted the pipe (it proves first, in its answer).
    Listener,
    /// The worker that opened the pipe (it proves second).
    Connector,
}

impl Prover {
    fn label(self) -> &'static [u8] {
        match self {
            Prover::Listener => b"rdzv rpc pipe v1: listener",
            Prover::Connector => b"rdzv rpc pipe v1: connector",
        }
    }
}

/// What both proofs of one pipe cover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transcript<'a> {
    /// The connector's worker name and id.
    pub connector: (&'a str, WorkerId),
    /// The listener's worker name and id.
    pub listener: (&'a str, WorkerId),
    /// The connector's nonce (from its hello).
    pub connector_nonce: &'a Nonce,
    /// The listener's nonce (from its answer).
    pub listener_nonce: &'a Nonce,
}

/// Why a secret cannot key the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SecretError {
    /// It is shorter than [`MIN_SECRET_LEN`] bytes.
    TooShort {
        /// Its length.
        len: usize,
    },
}

impl core::fmt::Display for SecretError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            SecretError::TooShort { len } => write!(
                f,
                "the RPC group secret is {len} bytes; it must be at least {MIN_SECRET_LEN} \
                 (use 32 random bytes, e.g. `head -c 32 /dev/urandom | base64`)"
            ),
        }
    }
}

/// Checks that `secret` can key the handshake.
///
/// # Errors
/// [`SecretError::TooShort`].
pub fn check_secret(secret: &[u8]) -> Result<(), SecretError> {
    if secret.len() < MIN_SECRET_LEN {
        return Err(SecretError::TooShort { len: secret.len() });
    }
    Ok(())
}

fn mac(secret: &[u8], prover: Prover, t: &Transcript<'_>) -> Hmac<Sha256> {
    // HMAC takes keys of any length; this cannot fail.
    let mut mac = match <Hmac<Sha256> as Mac>::new_from_slice(secret) {
        Ok(mac) => mac,
        Err(_) => unreachable_key(),
    };
    mac.update(prover.label());
    for (name, id) in [t.connector, t.listener] {
        mac.update(&(name.len() as u64).to_le_bytes());
        mac.update(name.as_bytes());
        mac.update(&id.get().to_le_bytes());
    }
    mac.update(t.connector_nonce);
    mac.update(t.listener_nonce);
    mac
}

#[cold]
fn unreachable_key() -> ! {
    panic!("HMAC-SHA256 accepts a key of any length")
}

/// The proof `prover` sends for transcript `t`, keyed with `secret`.
pub fn prove(secret: &[u8], prover: Prover, t: &Transcript<'_>) -> Proof {
    mac(secret, prover, t).finalize().into_bytes().into()
}

/// Whether `proof` is what `prover` had to send for `t` (compared in constant time).
pub fn verify(secret: &[u8], prover: Prover, t: &Transcript<'_>, proof: &Proof) -> bool {
    mac(secret, prover, t).verify_slice(proof).is_ok()
}

/// What a side with `secret` (or none) makes of the other side's `proof` (or none).
///
/// # Errors
/// [`AuthFailure`] naming what was missing or wrong.
pub fn check_peer(
    secret: Option<&[u8]>,
    prover: Prover,
    t: &Transcript<'_>,
    proof: Option<&Proof>,
) -> Result<(), AuthFailure> {
    match (secret, proof) {
        (None, None) => Ok(()),
        (None, Some(_)) => Err(AuthFailure::UnexpectedProof),
        (Some(_), None) => Err(AuthFailure::NoProof),
        (Some(secret), Some(proof)) if verify(secret, prover, t, proof) => Ok(()),
        (Some(_), Some(_)) => Err(AuthFailure::WrongProof),
    }
}

/// Why a peer failed the handshake's authentication.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AuthFailure {
    /// This side has a secret; the peer sent no proof (it has none).
    NoProof,
    /// The peer's proof is not the secret's (another secret, or a forgery).
    WrongProof,
    /// The peer sent a proof, and this side has no secret to check it with.
    UnexpectedProof,
}

impl core::fmt::Display for AuthFailure {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            AuthFailure::NoProof => {
                "RPC peer failed authentication: it sent no proof of the group secret \
                 (it runs without one; give every worker the same secret)"
            }
            AuthFailure::WrongProof => {
                "RPC peer failed authentication: its proof does not match this worker's \
                 group secret (the workers were given different secrets)"
            }
            AuthFailure::UnexpectedProof => {
                "RPC peer failed authentication: it proves a group secret and this worker \
                 has none (give every worker the same secret)"
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use alloc::string::ToString;

    use super::*;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn id(n: i64) -> WorkerId {
        WorkerId::new(n).unwrap()
    }

    fn transcript<'a>(a: &'a Nonce, b: &'a Nonce) -> Transcript<'a> {
        Transcript {
            connector: ("w0", id(0)),
            listener: ("w1", id(1)),
            connector_nonce: a,
            listener_nonce: b,
        }
    }

    #[test]
    fn both_sides_prove_with_the_same_secret() {
        let (a, b) = ([1; 32], [2; 32]);
        let t = transcript(&a, &b);
        for prover in [Prover::Listener, Prover::Connector] {
            let proof = prove(SECRET, prover, &t);
            assert!(verify(SECRET, prover, &t, &proof));
            assert_eq!(check_peer(Some(SECRET), prover, &t, Some(&proof)), Ok(()));
        }
    }

    #[test]
    fn another_secret_fails() {
        let (a, b) = ([1; 32], [2; 32]);
        let t = transcript(&a, &b);
        let proof = prove(b"another secret, 32 bytes long...", Prover::Listener, &t);
        assert_eq!(
            check_peer(Some(SECRET), Prover::Listener, &t, Some(&proof)),
            Err(AuthFailure::WrongProof)
        );
    }

    #[test]
    fn a_proof_is_bound_to_its_role_nonces_and_names() {
        let (a, b, c) = ([1; 32], [2; 32], [3; 32]);
        let t = transcript(&a, &b);
        let listener = prove(SECRET, Prover::Listener, &t);
        // Reflected: the listener's proof sent back as the connector's.
        assert!(!verify(SECRET, Prover::Connector, &t, &listener));
        // Replayed into a pipe with a fresh nonce.
        assert!(!verify(
            SECRET,
            Prover::Listener,
            &transcript(&c, &b),
            &listener
        ));
        assert!(!verify(
            SECRET,
            Prover::Listener,
            &transcript(&a, &c),
            &listener
        ));
        // Moved to another pair of workers.
        let other = Transcript {
            connector: ("w2", id(2)),
            ..t
        };
        assert!(!verify(SECRET, Prover::Listener, &other, &listener));
        let renumbered = Transcript {
            listener: ("w1", id(5)),
            ..t
        };
        assert!(!verify(SECRET, Prover::Listener, &renumbered, &listener));
        // One bit flipped.
        let mut flipped = listener;
        flipped[7] ^= 1;
        assert!(!verify(SECRET, Prover::Listener, &t, &flipped));
    }

    #[test]
    fn a_side_without_a_secret_neither_proves_nor_accepts_a_proof() {
        let (a, b) = ([1; 32], [2; 32]);
        let t = transcript(&a, &b);
        assert_eq!(check_peer(None, Prover::Listener, &t, None), Ok(()));
        assert_eq!(
            check_peer(Some(SECRET), Prover::Connector, &t, None),
            Err(AuthFailure::NoProof)
        );
        let proof = prove(SECRET, Prover::Connector, &t);
        assert_eq!(
            check_peer(None, Prover::Connector, &t, Some(&proof)),
            Err(AuthFailure::UnexpectedProof)
        );
        assert!(AuthFailure::NoProof
            .to_string()
            .contains("failed authentication"));
    }

    #[test]
    fn short_secrets_are_refused() {
        assert_eq!(
            check_secret(b"short"),
            Err(SecretError::TooShort { len: 5 })
        );
        assert_eq!(check_secret(SECRET), Ok(()));
    }
}
