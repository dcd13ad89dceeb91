//! Client pipes: connect to a peer, run the hello/answer handshake (over the bootstrap
//! transport, then over the negotiated one: the upgrade), open the mpt connections, and
//! turn the pipe into a lane that takes the calls queued while it opened.

use std::rc::Rc;

use rdzv_core::negotiate::{accept_answer, Negotiated, Role, TransportKind};
use rdzv_core::rpc::auth::{check_peer, prove, Prover, Transcript};
use rdzv_core::rpc::frame::Handshake;

use super::{handshake_frame, with_handshake, Io, Outbound};
use crate::queue::on_thread;
use crate::rpc::error::{CallError, PipeFailure};
use crate::rpc::lane;
use crate::rpc::mpt::{self, ConnectionsError, MptConnections};
use crate::rpc::tensors::cpu_channel;
use crate::rpc::transport::{address_for, Connection, Transport};

/// A pipe's connection after the handshake, what it negotiated, and the token to open
/// its mpt connections with (when it has them).
type OpenedPipe = (Connection, Negotiated, Option<u64>);

/// Why a client pipe could not be opened; every call waiting for it fails with it.
#[derive(Debug, Clone)]
struct OpenFailure {
    address: String,
    reason: PipeFailure,
    connecting: bool,
}

/// What this side found wrong while it opened a pipe.
#[derive(Debug, thiserror::Error)]
enum OpenError {
    /// No transport runs here.
    #[error("this worker runs no transport")]
    NoTransport,
    /// The peer's published address has none for the transport.
    #[error("the worker publishes no {0} address")]
    NoAddress(TransportKind),
    /// The upgrade's handshake negotiated yet another transport.
    #[error("the handshake over {over} negotiated {negotiated}")]
    UpgradeMismatch {
        over: TransportKind,
        negotiated: TransportKind,
    },
    /// The bootstrap handshake negotiated a transport this worker does not run.
    #[error("negotiated {0}, which this worker does not run")]
    NotRun(TransportKind),
    /// The peer answered a hello with a hello.
    #[error("the peer sent a hello, not an answer")]
    HelloNotAnswer,
    /// The peer sent something else where its welcome belonged.
    #[error("the peer sent another handshake message where its welcome belonged")]
    NotWelcome,
    /// No nonce could be drawn.
    #[error("cannot make the handshake's nonce: {0}")]
    Nonce(String),
    /// The pipe's mpt connections could not be opened.
    #[error("cannot open its mpt connections: {0}")]
    Mpt(#[source] ConnectionsError),
    /// The thread that opens them could not run.
    #[error("cannot open its mpt connections: {0}")]
    MptThread(#[source] std::io::Error),
}

impl OpenFailure {
    fn to_error(&self, peer: &str) -> CallError {
        if self.connecting {
            CallError::Connect {
                peer: peer.to_string(),
                address: self.address.clone(),
                reason: self.reason.clone(),
            }
        } else {
            CallError::Handshake {
                peer: peer.to_string(),
                reason: self.reason.clone(),
            }
        }
    }
}

impl Io {
    /// Opens client pipe `id` to `peer`: connect, handshake, mpt connections, then the pipe
    /// becomes a lane and the queued calls go out on it.
    pub(super) async fn connect(self: Rc<Self>, id: u64, peer: String, address: String) {
        let (connection, negotiated, mpt_token) = match self.open_pipe(&peer, &address).await {
            Ok(opened) => opened,
            Err(failure) => {
                tracing::debug!(%peer, reason = %failure.reason, "opening an RPC pipe failed");
                return self.fail_pipe(id, &peer, || failure.to_error(&peer));
            }
        };
        if !self.still_opening(id, &peer) {
            // Reset or closed while connecting: its calls failed already, and dropping
            // the halves closes the connection.
            return;
        }
        self.pieces.counters.pipe_opened(
            &peer,
            negotiated.transport,
            cpu_channel(&negotiated, Role::Connector),
        );
        let mpt = match (mpt_token, &self.pieces.lanes.mpt) {
            (Some(token), Some(setup)) => {
                let (published, lanes) = (address.clone(), setup.connections);
                let opened = on_thread("rdzv-rpc-mpt-connect", move || {
                    mpt::connect(&published, token, lanes)
                })
                .await
                .map_err(OpenError::MptThread)
                .and_then(|opened| opened.map_err(OpenError::Mpt));
                match opened {
                    Ok(lanes) => Some(lanes),
                    Err(error) => {
                        tracing::debug!(%peer, reason = %error, "opening an RPC pipe failed");
                        return self.pipe_ended(id, &peer, PipeFailure::local(error));
                    }
                }
            }
            _ => None,
        };
        self.client_lane(id, peer, negotiated, connection, mpt);
    }

    /// Client pipe `id` to `peer` becomes a lane; the calls queued while it opened go
    /// out on it.
    fn client_lane(
        &self,
        id: u64,
        peer: String,
        negotiated: Negotiated,
        connection: Connection,
        mpt: Option<MptConnections>,
    ) {
        if !self.still_opening(id, &peer) {
            // Reset or closed while its mpt connections opened.
            connection.control.stop();
            if let Some(mpt) = mpt {
                mpt.shutdown();
            }
            return;
        }
        // The lane is registered before this thread forgets the pipe, so that no call
        // in between opens another one.
        let Some(lane) = lane::start_client(
            &self.pieces.lanes,
            (id, peer.clone()),
            negotiated,
            connection,
            mpt,
        ) else {
            return self.pipe_ended(id, &peer, PipeFailure::ShuttingDown);
        };
        let queued = self
            .state
            .borrow_mut()
            .opening
            .remove(&peer)
            .map(|o| o.queued)
            .unwrap_or_default();
        for Outbound {
            message_id,
            handler,
            message,
        } in queued
        {
            lane.send_request(message_id, handler, message);
        }
    }

    /// Opens a pipe: the handshake over the bootstrap (lowest-priority) transport, then,
    /// if a better transport was negotiated, the handshake again over that one, whose
    /// halves replace the bootstrap connection. If the upgrade fails the bootstrap
    /// connection carries the pipe (without mpt connections: the peer's side of it did not
    /// negotiate tcp).
    async fn open_pipe(&self, peer: &str, address: &str) -> Result<OpenedPipe, OpenFailure> {
        let Some(bootstrap) = self.transports.last() else {
            return Err(OpenFailure {
                address: address.to_string(),
                reason: PipeFailure::local(OpenError::NoTransport),
                connecting: true,
            });
        };
        let (connection, negotiated, mpt_token) =
            self.handshake_over(&**bootstrap, peer, address).await?;
        if negotiated.transport == bootstrap.kind() {
            return Ok((connection, negotiated, mpt_token));
        }
        let upgraded = match self
            .transports
            .iter()
            .find(|t| t.kind() == negotiated.transport)
        {
            Some(better) => self
                .handshake_over(&**better, peer, address)
                .await
                .and_then(|(c, n, t)| {
                    if n.transport == better.kind() {
                        Ok((c, n, t))
                    } else {
                        Err(OpenFailure {
                            address: address.to_string(),
                            reason: PipeFailure::handshake(OpenError::UpgradeMismatch {
                                over: better.kind(),
                                negotiated: n.transport,
                            }),
                            connecting: false,
                        })
                    }
                }),
            None => Err(OpenFailure {
                address: address.to_string(),
                reason: PipeFailure::handshake(OpenError::NotRun(negotiated.transport)),
                connecting: false,
            }),
        };
        match upgraded {
            Ok(pipe) => {
                // The bootstrap connection closes; the peer's side of it ends quietly.
                drop(connection);
                Ok(pipe)
            }
            Err(failure) => {
                tracing::warn!(
                    %peer,
                    transport = %negotiated.transport,
                    reason = %failure.reason,
                    "upgrading an RPC pipe failed; it stays on {}",
                    bootstrap.kind()
                );
                let negotiated = Negotiated {
                    transport: bootstrap.kind(),
                    ..negotiated
                };
                Ok((connection, negotiated, None))
            }
        }
    }

    /// Connects with `transport` to its listener in the peer's published `address` and
    /// runs the hello/answer handshake. The token comes back when the pipe is to open
    /// mpt connections with it.
    async fn handshake_over(
        &self,
        transport: &dyn Transport,
        peer: &str,
        address: &str,
    ) -> Result<OpenedPipe, OpenFailure> {
        let Some(address) = address_for(address, transport.kind()) else {
            return Err(OpenFailure {
                address: address.to_string(),
                reason: PipeFailure::local(OpenError::NoAddress(transport.kind())),
                connecting: true,
            });
        };
        let failure = |connecting: bool, reason: PipeFailure| OpenFailure {
            address: address.to_string(),
            reason,
            connecting,
        };
        let mut connection = transport
            .connect(address)
            .await
            .map_err(|e| failure(true, PipeFailure::transport(e)))?;
        let handshake = |reason: PipeFailure| failure(false, reason);
        let offer = self
            .pieces
            .offer
            .offer()
            .map_err(|e| handshake(PipeFailure::local(e)))?;
        let lanes_token = mpt::new_token();
        let challenge =
            super::nonce().map_err(|e| handshake(PipeFailure::local(OpenError::Nonce(e))))?;
        let hello = Handshake::Hello {
            name: self.name(),
            id: self.pieces.me.id(),
            brochure: offer.brochure(),
            lanes_token,
            challenge,
        };
        let hello = handshake_frame(&hello).map_err(|e| handshake(PipeFailure::handshake(e)))?;
        // A small frame into a fresh connection: the send does not wait for the peer.
        connection
            .sender
            .send(&hello)
            .map_err(|e| handshake(PipeFailure::transport(e)))?;
        let (mut connection, reply) = self
            .receive_handshake(connection, super::HANDSHAKE_TIMEOUT)
            .await
            .map_err(handshake)?;
        let reply = reply.ok_or_else(|| handshake(PipeFailure::ClosedInHandshake))?;
        let secret = self.pieces.secret.as_deref();
        let (negotiated, proof) = with_handshake(&reply, |message| match message {
            Handshake::Answer {
                name,
                id,
                answer,
                challenge: theirs,
                proof,
            } if name == peer => {
                // The listener proves first; a listener that cannot is never sent a
                // call.
                let transcript = Transcript {
                    connector: (self.name(), self.pieces.me.id()),
                    listener: (name, id),
                    connector_nonce: &challenge,
                    listener_nonce: &theirs,
                };
                check_peer(secret, Prover::Listener, &transcript, proof.as_ref())
                    .map_err(|e| PipeFailure::Refused(format!("worker {peer}: {e}")))?;
                let mine = secret.map(|s| prove(s, Prover::Connector, &transcript));
                let negotiated = accept_answer(&offer, &answer).map_err(PipeFailure::handshake)?;
                Ok((negotiated, mine))
            }
            Handshake::Answer { name, .. } => Err(PipeFailure::WrongPeer {
                address: address.to_string(),
                found: name.to_string(),
                expected: peer.to_string(),
            }),
            Handshake::Refused { reason } => Err(PipeFailure::Refused(reason.to_string())),
            _ => Err(PipeFailure::handshake(OpenError::HelloNotAnswer)),
        })
        .map_err(PipeFailure::handshake)
        .and_then(|r| r)
        .map_err(handshake)?;
        let proof = handshake_frame(&Handshake::Proof { proof })
            .map_err(|e| handshake(PipeFailure::handshake(e)))?;
        connection
            .sender
            .send(&proof)
            .map_err(|e| handshake(PipeFailure::transport(e)))?;
        // The listener reads nothing else before it has checked the proof: wait for its
        // word, so that a refusal reads as one here.
        let (connection, word) = self
            .receive_handshake(connection, super::HANDSHAKE_TIMEOUT)
            .await
            .map_err(handshake)?;
        let word = word.ok_or_else(|| handshake(PipeFailure::ClosedInHandshake))?;
        with_handshake(&word, |message| match message {
            Handshake::Welcome => Ok(()),
            Handshake::Refused { reason } => Err(PipeFailure::Refused(reason.to_string())),
            _ => Err(PipeFailure::handshake(OpenError::NotWelcome)),
        })
        .map_err(PipeFailure::handshake)
        .and_then(|r| r)
        .map_err(handshake)?;
        let mpt_token = mpt::uses_mpt(&negotiated, Role::Connector).then_some(lanes_token);
        Ok((connection, negotiated, mpt_token))
    }
}
