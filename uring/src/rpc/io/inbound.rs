//! Inbound pipes: accept a peer's connection, answer its hello (or refuse it), and turn
//! the pipe into an inbound lane.

use std::rc::Rc;
use std::time::{Duration, Instant};

use rdzv_core::negotiate::{answer_brochure, Negotiated, Role};
use rdzv_core::rpc::auth::{check_peer, prove, Nonce, Prover, Transcript};
use rdzv_core::rpc::frame::Handshake;
use rdzv_core::rpc::name::WorkerId;

use super::{handshake_frame, with_handshake, Io, PipeFailure};
use crate::rpc::lane;
use crate::rpc::mpt;
use crate::rpc::transport::{Connection, IncomingFrame, OwnedFrame};

/// The peer's name and id, the negotiation, the token of the pipe's mpt connections, and
/// the two nonces (the peer's, this worker's) its proof must cover.
type Accepted = (String, WorkerId, Negotiated, u64, (Nonce, Nonce));

impl Io {
    /// Accepts connections of transport `index` until the agent closes; while
    /// [`InboundHandshakes::max_in_flight`] accepted peers have not finished their
    /// handshake, it accepts no more (they wait in the kernel's backlog).
    ///
    /// [`InboundHandshakes::max_in_flight`]: crate::rpc::InboundHandshakes::max_in_flight
    pub(super) async fn accept_loop(self: Rc<Self>, index: usize) {
        let Some(transport) = self.transports.get(index) else {
            return;
        };
        let cap = self.pieces.inbound_handshakes.max_in_flight.max(1);
        loop {
            while self.state.borrow().inbound_handshakes >= cap {
                self.handshake_ended.notified().await;
            }
            match transport.accept().await {
                Ok(connection) => {
                    let slot = HandshakeSlot::take(&self);
                    self.spawn(Rc::clone(&self).serve_inbound(connection, slot));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "RPC accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }

    /// Answers a peer's hello; `Ok` carries the peer's name and id and the decision.
    fn answer_hello(
        &self,
        hello: &IncomingFrame,
        from: &str,
    ) -> (Result<Accepted, String>, Option<OwnedFrame>) {
        let offer = match self.pieces.offer.offer() {
            Ok(offer) => offer,
            Err(e) => return (Err(e.to_string()), None),
        };
        let decided = with_handshake(hello, |handshake| match handshake {
            Handshake::Hello {
                name,
                id,
                brochure,
                lanes_token,
                challenge,
            } => {
                let known = self.pieces.registry.group().peers.get(name).map(|p| p.id);
                // A dynamic group's newcomer connects before the members know it.
                if known != Some(id) && !self.pieces.dynamic {
                    return Err(format!(
                        "worker {name} with id {id} is not a member of this group"
                    ));
                }
                let answer = answer_brochure(&offer, &brochure).map_err(|e| e.to_string())?;
                let mine = super::nonce()?;
                let transcript = Transcript {
                    connector: (name, id),
                    listener: (self.name(), self.pieces.me.id()),
                    connector_nonce: &challenge,
                    listener_nonce: &mine,
                };
                let reply = Handshake::Answer {
                    name: self.name(),
                    id: self.pieces.me.id(),
                    answer,
                    challenge: mine,
                    proof: self
                        .pieces
                        .secret
                        .as_deref()
                        .map(|s| prove(s, Prover::Listener, &transcript)),
                };
                let frame = handshake_frame(&reply).map_err(|e| e.to_string())?;
                Ok((
                    name.to_string(),
                    id,
                    answer.negotiated(),
                    lanes_token,
                    (challenge, mine),
                    frame,
                ))
            }
            _ => Err("the first frame of a pipe must be a hello".to_string()),
        });
        match decided {
            Ok(Ok((name, id, negotiated, token, nonces, frame))) => {
                (Ok((name, id, negotiated, token, nonces)), Some(frame))
            }
            Ok(Err(reason)) => {
                let refusal = handshake_frame(&Handshake::Refused { reason: &reason }).ok();
                (Err(reason), refusal)
            }
            Err(e) => (Err(format!("bad handshake from {from}: {e}")), None),
        }
    }

    /// Reads the connector's proof and says welcome, or refuses it (counted, logged at
    /// most once a second) and drops the connection; `None` then.
    async fn check_proof(
        &self,
        connection: Connection,
        (peer, peer_id): (&str, WorkerId),
        (theirs, mine): (Nonce, Nonce),
        (from, deadline): (&str, Instant),
    ) -> Option<Connection> {
        let received = self.receive_handshake_until(connection, deadline).await;
        let (mut connection, frame) = match received {
            Ok((connection, Some(frame))) => (connection, frame),
            Ok((_, None)) => return None,
            Err(e) => {
                let reason = format!("no proof: {e}");
                self.pieces
                    .counters
                    .handshake_refused(from, Some(peer), &reason);
                return None;
            }
        };
        let transcript = Transcript {
            connector: (peer, peer_id),
            listener: (self.name(), self.pieces.me.id()),
            connector_nonce: &theirs,
            listener_nonce: &mine,
        };
        let secret = self.pieces.secret.as_deref();
        let checked = with_handshake(&frame, |message| match message {
            Handshake::Proof { proof } => {
                check_peer(secret, Prover::Connector, &transcript, proof.as_ref())
                    .map_err(|e| e.to_string())
            }
            _ => Err("the third frame of a pipe must be the connector's proof".to_string()),
        })
        .unwrap_or_else(|e| Err(format!("bad handshake: {e}")));
        let reply = match &checked {
            Ok(()) => handshake_frame(&Handshake::Welcome),
            Err(reason) => handshake_frame(&Handshake::Refused { reason }),
        };
        if let Ok(reply) = reply {
            if let Err(e) = connection.sender.send(&reply) {
                tracing::debug!(%from, error = %e, "sending the RPC handshake's last word failed");
                return None;
            }
        }
        match checked {
            Ok(()) => Some(connection),
            Err(reason) => {
                self.pieces
                    .counters
                    .handshake_refused(from, Some(peer), &reason);
                None
            }
        }
    }

    /// Answers a peer's hello; the pipe then becomes an inbound lane. The whole handshake
    /// must end within [`InboundHandshakes::timeout`]; a pipe that fails it is counted
    /// and closed.
    ///
    /// [`InboundHandshakes::timeout`]: crate::rpc::InboundHandshakes::timeout
    async fn serve_inbound(self: Rc<Self>, connection: Connection, slot: HandshakeSlot) {
        let from = connection.peer.clone();
        let deadline = Instant::now() + self.pieces.inbound_handshakes.timeout;
        let (mut connection, hello) = match self.receive_handshake_until(connection, deadline).await
        {
            Ok((connection, Some(frame))) => (connection, frame),
            Ok((_, None)) => return,
            Err(e) => {
                let reason = format!("no hello: {e}");
                self.pieces.counters.handshake_refused(&from, None, &reason);
                return;
            }
        };
        let (decided, reply) = self.answer_hello(&hello, &from);
        if let Some(reply) = reply {
            // A small frame into a connection whose peer waits for it: the send does
            // not wait.
            if let Err(e) = connection.sender.send(&reply) {
                tracing::debug!(%from, error = %e, "sending the RPC handshake answer failed");
                return;
            }
        }
        let (peer, peer_id, negotiated, lanes_token, nonces) = match decided {
            Ok(d) => d,
            Err(reason) => {
                // Dropping the connection closes it after the refusal.
                self.pieces.counters.handshake_refused(&from, None, &reason);
                return;
            }
        };
        // Nothing else the peer sends is read before its proof holds.
        let Some(connection) = self
            .check_proof(connection, (&peer, peer_id), nonces, (&from, deadline))
            .await
        else {
            return;
        };
        drop(slot);
        let pipe = {
            let mut state = self.state.borrow_mut();
            let id = state.next_pipe;
            state.next_pipe += 1;
            id
        };
        let jobs = self.jobs.borrow().clone();
        match jobs {
            Some(jobs) => lane::start_inbound(
                (&self.pieces.lanes, &self.pieces.server),
                (pipe, (peer, peer_id)),
                negotiated,
                connection,
                jobs,
                mpt::uses_mpt(&negotiated, Role::Listener).then_some(lanes_token),
            ),
            None => connection.control.stop(),
        }
    }

    /// The time left of an inbound handshake that must end at `deadline`.
    async fn receive_handshake_until(
        &self,
        connection: Connection,
        deadline: Instant,
    ) -> Result<(Connection, Option<IncomingFrame>), PipeFailure> {
        self.receive_handshake(
            connection,
            deadline.saturating_duration_since(Instant::now()),
        )
        .await
    }
}

/// One of the [`InboundHandshakes::max_in_flight`] places of accepted peers whose
/// handshake is not done; given back (and a waiting accept loop woken) when dropped,
/// which also happens when the agent's close cancels the task holding it.
///
/// [`InboundHandshakes::max_in_flight`]: crate::rpc::InboundHandshakes::max_in_flight
pub(super) struct HandshakeSlot(Rc<Io>);

impl HandshakeSlot {
    fn take(io: &Rc<Io>) -> HandshakeSlot {
        io.state.borrow_mut().inbound_handshakes += 1;
        io.pieces.counters.inbound_handshake(true);
        HandshakeSlot(Rc::clone(io))
    }
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        let mut state = self.0.state.borrow_mut();
        state.inbound_handshakes = state.inbound_handshakes.saturating_sub(1);
        drop(state);
        self.0.pieces.counters.inbound_handshake(false);
        self.0.handshake_ended.notify_one();
    }
}
