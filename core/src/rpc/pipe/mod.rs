//! One RPC pipe's protocol after its handshake: which frames a pipe accepts, which
//! replies reach a call, when lent buffers come back, and what must be acked.
//!
//! A pipe joins two workers. The side that opened it (the *client*, TensorPipe's
//! `ClientPipe`) sends this worker's requests and receives their replies; the side that
//! accepted it (the *inbound* pipe) receives the peer's requests and sends this
//! worker's responses. [`ClientPipe`] and [`InboundPipe`] are the two machines. Both
//! are generic over `T`, what a lent buffer is to the runtime (as
//! [`Ledger`] is), and own their pipe's ledger, so the rules
//! below hold per pipe by construction:
//!
//! - **A reply is accepted only on its own pipe.** A `Response` or `Error` answers a
//!   call only if that call's request went out on this pipe and is still waiting for its
//!   reply here; anything else (a duplicate, an id from an earlier pipe, a bogus id) is
//!   *unmatched*: it is dropped, and acked if it lent buffers, so the callee gets them
//!   back. Whether anyone still waits for a matched reply (the call may have timed out)
//!   is the runtime's call table's business, not the pipe's.
//! - **Lent buffers come back once.** A request's buffers come back with its reply; a
//!   response's with the caller's `Ack`; everything still lent is given up by
//!   [`end`](ClientPipe::end), never to be reused (the core's
//!   [`lending`](super::lending) rule). An `Ack` for nothing lent (a duplicate, one
//!   after the buffers were given up, one for an earlier pipe) is ignored.
//! - **A reply that lent buffers is acked exactly once, after the caller is done with
//!   them.** The pipe says so in its [`ClientEvent::Reply`] (`lent`); the runtime reads
//!   the buffers (or decides not to) and calls [`ClientPipe::done_reading`], which queues
//!   the `Ack`. A pipe that ended meanwhile sends nothing and answers
//!   [`ReadError::PipeEnded`]: the callee may have released the buffers while they were
//!   read, so what was read must be refused ("pipe ended during pull").
//! - **A response is sent only for a request received on this pipe**, once, and not
//!   after the pipe ended ([`InboundPipe::respond`]).
//! - **A `Goodbye`, or a frame the pipe's side never receives, closes the pipe**
//!   ([`Closed`]); the runtime then calls `end`.
//!
//! The machines perform no I/O and keep no time, quinn-proto style: the runtime reads
//! a frame, hands its kind, id and whether it lends ([`PipeFrame`]) to `handle_frame`,
//! then drains `poll_event` (what to do: complete a call, pull, release, serve a
//! request) and then `poll_transmit` (frames the protocol itself owes the peer: acks and
//! goodbyes). Commands from the application are `send_request` (and `unsent`, for a
//! send that failed for one call alone) / `respond`, `done_reading`, `goodbye` and
//! `end`. Call deadlines belong to the runtime's call
//! table (see [`timeouts`](super::timeouts)).
//!
//! ```text
//!  a pipe                      handle_frame, send_request / respond, done_reading
//!                                  +-----+
//!                                  v     |
//!             new() ------->  +--------+-+   goodbye()         +---------+
//!                             |  Open  |---------------------->| Closing |
//!                             +--------+   peer Goodbye, or a  +---------+
//!                                  |       frame this side       |  (nothing is sent
//!                                  |       never receives:       |   but the goodbye;
//!                                  |       Closed event          |   replies and acks
//!                                  |                             |   still handled)
//!                                  +----------- end() -----------+
//!                                               |
//!                                               v
//!                                         +-----------+  lent buffers given up,
//!                                         |   Ended   |  calls in flight returned,
//!                                         +-----------+  every frame ignored
//!
//!  a call on a client pipe
//!
//!   send_request      Response/Error     lent: true      done_reading
//!   ------------> Sent ---------------> Reading -----------------------> acked, gone
//!                   |                      |
//!                   | (lent: false)        | end(): done_reading answers PipeEnded
//!                   v                      v
//!                  gone                   gone, nothing acked
//!
//!  a request on an inbound pipe
//!
//!   Request           respond(lent)       Ack
//!   ------> Serving ---------------> Lent -----> released (Release event), gone
//!              |                       |
//!              | (nothing lent)        | end(): given up
//!              v                       v
//!            gone                     gone
//! ```

use alloc::collections::{BTreeMap, BTreeSet, VecDeque};
use alloc::vec::Vec;
use core::fmt;

use super::frame::{FrameKind, TensorDescriptor};
use super::lending::{lends, Ledger, Lender};

/// What the pipe needs of a received frame: its kind, its message id, and whether its
/// tensors lend buffers (travel over a pulling channel). The runtime gets all three from
/// the frame's head, without any I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipeFrame {
    /// The frame's kind.
    pub kind: FrameKind,
    /// The frame's message id.
    pub message_id: u64,
    /// Whether any of its tensors lends the sender's buffer to this side.
    pub lends: bool,
}

impl PipeFrame {
    /// A frame of `kind` for `message_id` whose tensors are `tensors`.
    pub fn new<'a>(
        kind: FrameKind,
        message_id: u64,
        tensors: impl IntoIterator<Item = &'a TensorDescriptor>,
    ) -> PipeFrame {
        PipeFrame {
            kind,
            message_id,
            lends: tensors.into_iter().any(|t| lends(t.channel)),
        }
    }

    /// A frame that lends nothing (no tensors, or none out of band).
    pub const fn bare(kind: FrameKind, message_id: u64) -> PipeFrame {
        PipeFrame {
            kind,
            message_id,
            lends: false,
        }
    }
}

/// A frame the protocol owes the peer, for the runtime to send ([`ClientPipe::poll_transmit`],
/// [`InboundPipe::poll_transmit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transmit {
    /// An `Ack` for the response `message_id`: its lent buffers may be released.
    Ack {
        /// The response's message id.
        message_id: u64,
    },
    /// A `Goodbye`: this side closes the pipe on purpose.
    Goodbye,
}

impl Transmit {
    /// The frame's kind and message id.
    pub const fn frame(self) -> (FrameKind, u64) {
        match self {
            Transmit::Ack { message_id } => (FrameKind::Ack, message_id),
            Transmit::Goodbye => (FrameKind::Goodbye, 0),
        }
    }
}

/// Why a pipe closed on a frame it received; the runtime ends the pipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Closed {
    /// The peer said goodbye: it is shutting down, and the end of the stream is
    /// expected.
    Goodbye,
    /// The peer sent a kind of frame this side of a pipe never receives.
    Unexpected {
        /// The frame's kind.
        kind: FrameKind,
        /// Whether this side is the client side.
        client: bool,
    },
    /// The peer sent a request whose message id is still being served (or still
    /// lending) on this pipe.
    DuplicateRequest {
        /// The message id.
        message_id: u64,
    },
}

impl fmt::Display for Closed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Closed::Goodbye => f.write_str("the peer said goodbye (it is shutting down)"),
            Closed::Unexpected { kind, client } => write!(
                f,
                "the peer sent an unexpected {kind} frame on {} pipe",
                if *client { "a client" } else { "an inbound" }
            ),
            Closed::DuplicateRequest { message_id } => write!(
                f,
                "the peer sent request {message_id} again while it was still being served"
            ),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for Closed {}

/// What the runtime must do after a client pipe handled a frame.
#[derive(Debug, PartialEq, Eq)]
pub enum ClientEvent<T> {
    /// The reply to call `message_id`, whose request went out on this pipe: complete
    /// the call (if the call table still holds it). `released`: what the request lent,
    /// back for reuse (the callee read it before it answered). `lent`: the reply lends
    /// buffers: read them (or not), then call [`ClientPipe::done_reading`] exactly once.
    Reply {
        /// The call's message id.
        message_id: u64,
        /// The request's lent buffers, given back.
        released: Option<T>,
        /// Whether the reply lends buffers, which must be read and acked.
        lent: bool,
    },
    /// A reply for no call waiting on this pipe (a duplicate, or one for another pipe's
    /// call): dropped; `acked` when it lent buffers and an ack is queued.
    Unmatched {
        /// The reply's message id.
        message_id: u64,
        /// Whether an ack is queued for it.
        acked: bool,
    },
    /// The pipe closed; end it ([`ClientPipe::end`]).
    Closed(Closed),
}

/// What the runtime must do after an inbound pipe handled a frame.
#[derive(Debug, PartialEq, Eq)]
pub enum InboundEvent<T> {
    /// Serve request `message_id`; answer with [`InboundPipe::respond`].
    Request {
        /// The request's message id.
        message_id: u64,
    },
    /// The caller acked response `message_id`: what it lent, back for reuse.
    Release {
        /// The response's message id.
        message_id: u64,
        /// The buffers.
        buffers: T,
    },
    /// The pipe closed; end it ([`InboundPipe::end`]).
    Closed(Closed),
}

/// Why [`ClientPipe::done_reading`] refuses what was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReadError {
    /// The pipe ended while the reply's buffers were read: the peer may have released
    /// (and reused) them, so what was read must not be used.
    PipeEnded,
    /// The reply `message_id` was not being read on this pipe (it lent nothing, or it
    /// was finished already).
    NotReading {
        /// The message id.
        message_id: u64,
    },
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::PipeEnded => f.write_str(
                "the pipe ended while the response's tensors were being read; the peer may \
                 have released them",
            ),
            ReadError::NotReading { message_id } => write!(
                f,
                "reply {message_id} is not being read on this pipe (a runtime bug)"
            ),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for ReadError {}

/// Why a request or response may not go out on a pipe; the buffers it would have lent
/// come back in [`Refused::lent`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The pipe ended.
    Ended,
    /// This side said goodbye.
    Closing,
    /// A request with this message id is already waiting on this pipe.
    DuplicateCall,
    /// No request with this message id is being served on this pipe (it came on another
    /// pipe, or was answered already).
    NotServing,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Refusal::Ended => "the pipe has ended",
            Refusal::Closing => "the pipe is closing (this worker said goodbye)",
            Refusal::DuplicateCall => "a call with this message id is already on the pipe",
            Refusal::NotServing => "no request with this message id is served on the pipe",
        })
    }
}

#[cfg(feature = "std")]
impl std::error::Error for Refusal {}

/// A refused send: why, and the buffers it would have lent, back to the runtime.
#[derive(Debug, PartialEq, Eq)]
pub struct Refused<T> {
    /// Why.
    pub reason: Refusal,
    /// What the frame would have lent.
    pub lent: Option<T>,
}

/// What [`end`](ClientPipe::end) gives back.
#[derive(Debug, PartialEq, Eq)]
pub struct Ended<T> {
    /// Every buffer still lent, to be given up (never reused): a peer still reading must
    /// fail, not read something else.
    pub lent: Vec<T>,
    /// The calls whose request went out on this pipe and got no reply (client pipe), or
    /// the requests still being served (inbound pipe): fail them, or drop their
    /// responses.
    pub calls: Vec<u64>,
}

/// Where a pipe is in its life (see the module's diagram).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Life {
    Open,
    /// This side said goodbye, or the peer closed the pipe (a [`Closed`] event).
    Closing {
        said_goodbye: bool,
    },
    Ended,
}

/// A call on a client pipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallState {
    /// The request went out; no reply yet.
    Sent,
    /// The reply came and lent buffers, which the runtime is reading.
    Reading,
}

/// This worker's side of a pipe it opened: its requests go out, their replies come in.
#[derive(Debug)]
pub struct ClientPipe<T> {
    life: Life,
    calls: BTreeMap<u64, CallState>,
    ledger: Ledger<T>,
    events: VecDeque<ClientEvent<T>>,
    transmits: VecDeque<Transmit>,
}

impl<T> Default for ClientPipe<T> {
    fn default() -> Self {
        ClientPipe::new()
    }
}

impl<T> ClientPipe<T> {
    /// An open pipe (its handshake is done).
    pub fn new() -> ClientPipe<T> {
        ClientPipe {
            life: Life::Open,
            calls: BTreeMap::new(),
            ledger: Ledger::new(),
            events: VecDeque::new(),
            transmits: VecDeque::new(),
        }
    }

    /// Whether the pipe ended.
    pub fn is_ended(&self) -> bool {
        self.life == Life::Ended
    }

    /// Whether requests may go out on it.
    pub fn is_open(&self) -> bool {
        self.life == Life::Open
    }

    /// How many calls wait for a reply or are being read.
    pub fn calls_in_flight(&self) -> usize {
        self.calls.len()
    }

    /// How many requests are lending buffers.
    pub fn lending(&self) -> usize {
        self.ledger.len()
    }

    /// The request of call `message_id` goes out on this pipe, lending `lent` until its
    /// reply. Send the frame only on `Ok`; on `Err` the call must fail and `lent` comes
    /// back.
    pub fn send_request(&mut self, message_id: u64, lent: Option<T>) -> Result<(), Refused<T>> {
        let reason = match self.life {
            Life::Open if self.calls.contains_key(&message_id) => Refusal::DuplicateCall,
            Life::Open => {
                self.calls.insert(message_id, CallState::Sent);
                if let Some(lent) = lent {
                    // No earlier loan under this id: the id was not in flight.
                    drop(self.ledger.lend(Lender::Request, message_id, lent));
                }
                return Ok(());
            }
            Life::Closing { .. } => Refusal::Closing,
            Life::Ended => Refusal::Ended,
        };
        Err(Refused { reason, lent })
    }

    /// The request of call `message_id` did not go out after all (its send failed for
    /// this call alone, as an injected fault does): the call leaves the pipe, and what
    /// it would have lent comes back, never seen by the peer. `None` when the call is
    /// not waiting on this pipe or lent nothing.
    pub fn unsent(&mut self, message_id: u64) -> Option<T> {
        if self.calls.get(&message_id) != Some(&CallState::Sent) {
            return None;
        }
        self.calls.remove(&message_id);
        // A reply is what releases a request's loan; none will come.
        self.ledger.release(FrameKind::Response, message_id)
    }

    /// A frame arrived on this pipe. Drain [`poll_event`](Self::poll_event), then
    /// [`poll_transmit`](Self::poll_transmit). An ended pipe ignores it, and so does a
    /// closing one unless it is a reply.
    pub fn handle_frame(&mut self, frame: PipeFrame) {
        let closing = match self.life {
            Life::Open => false,
            Life::Closing { .. } => true,
            Life::Ended => return,
        };
        let PipeFrame {
            kind,
            message_id,
            lends,
        } = frame;
        match kind {
            FrameKind::Response | FrameKind::Error => {
                if self.calls.get(&message_id) == Some(&CallState::Sent) {
                    let released = self.ledger.release(kind, message_id);
                    if lends {
                        self.calls.insert(message_id, CallState::Reading);
                    } else {
                        self.calls.remove(&message_id);
                    }
                    self.events.push_back(ClientEvent::Reply {
                        message_id,
                        released,
                        lent: lends,
                    });
                } else {
                    if lends {
                        // Nobody reads its buffers: let the callee release them.
                        self.transmits.push_back(Transmit::Ack { message_id });
                    }
                    self.events.push_back(ClientEvent::Unmatched {
                        message_id,
                        acked: lends,
                    });
                }
            }
            FrameKind::Goodbye if !closing => self.close(Closed::Goodbye),
            FrameKind::Request | FrameKind::Ack | FrameKind::Handshake if !closing => {
                self.close(Closed::Unexpected { kind, client: true })
            }
            _ => {}
        }
    }

    fn close(&mut self, why: Closed) {
        self.life = Life::Closing {
            said_goodbye: false,
        };
        self.events.push_back(ClientEvent::Closed(why));
    }

    /// The next thing to do, oldest first.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<ClientEvent<T>> {
        self.events.pop_front()
    }

    /// The next frame the protocol owes the peer.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The runtime is done with the buffers reply `message_id` lent (read, or never to
    /// be read): an ack is queued. `Err(PipeEnded)` when the pipe ended after the reply
    /// came: what was read must be refused, and nothing is acked (the end released the
    /// buffers).
    pub fn done_reading(&mut self, message_id: u64) -> Result<(), ReadError> {
        if self.life == Life::Ended {
            return Err(ReadError::PipeEnded);
        }
        match self.calls.get(&message_id) {
            Some(CallState::Reading) => {
                self.calls.remove(&message_id);
                self.transmits.push_back(Transmit::Ack { message_id });
                Ok(())
            }
            _ => Err(ReadError::NotReading { message_id }),
        }
    }

    /// Closes the pipe on purpose: a goodbye is queued (once), and no request goes out
    /// any more. Replies still arrive and are handled until [`end`](Self::end).
    pub fn goodbye(&mut self) {
        if self.life == Life::Open {
            self.life = Life::Closing { said_goodbye: true };
            self.transmits.push_back(Transmit::Goodbye);
        }
    }

    /// Whether this side said goodbye.
    pub fn said_goodbye(&self) -> bool {
        self.life == Life::Closing { said_goodbye: true }
    }

    /// The pipe ended (the connection is gone or about to be closed): every buffer still
    /// lent is given up and the calls still waiting for a reply are returned, to fail.
    /// Events and transmits not yet polled are dropped, except the `Reply` events,
    /// which stay: a reply already received completes its call. Calling it again
    /// returns nothing.
    pub fn end(&mut self) -> Ended<T> {
        self.life = Life::Ended;
        self.transmits.clear();
        self.events
            .retain(|e| matches!(e, ClientEvent::Reply { .. }));
        let calls = core::mem::take(&mut self.calls)
            .into_iter()
            .filter(|(_, state)| *state == CallState::Sent)
            .map(|(id, _)| id)
            .collect();
        Ended {
            lent: self.ledger.end(),
            calls,
        }
    }
}

/// This worker's side of a pipe a peer opened: the peer's requests come in, this
/// worker's responses go out.
#[derive(Debug)]
pub struct InboundPipe<T> {
    life: Life,
    /// Requests received and not yet answered.
    serving: BTreeSet<u64>,
    ledger: Ledger<T>,
    events: VecDeque<InboundEvent<T>>,
    transmits: VecDeque<Transmit>,
}

impl<T> Default for InboundPipe<T> {
    fn default() -> Self {
        InboundPipe::new()
    }
}

impl<T> InboundPipe<T> {
    /// An open pipe (its handshake is done).
    pub fn new() -> InboundPipe<T> {
        InboundPipe {
            life: Life::Open,
            serving: BTreeSet::new(),
            ledger: Ledger::new(),
            events: VecDeque::new(),
            transmits: VecDeque::new(),
        }
    }

    /// Whether the pipe ended.
    pub fn is_ended(&self) -> bool {
        self.life == Life::Ended
    }

    /// How many requests are being served.
    pub fn serving(&self) -> usize {
        self.serving.len()
    }

    /// How many responses are lending buffers.
    pub fn lending(&self) -> usize {
        self.ledger.len()
    }

    /// A frame arrived on this pipe. Drain [`poll_event`](Self::poll_event), then
    /// [`poll_transmit`](Self::poll_transmit). An ended pipe ignores it; a closing one
    /// still takes acks.
    pub fn handle_frame(&mut self, frame: PipeFrame) {
        let closing = match self.life {
            Life::Open => false,
            Life::Closing { .. } => true,
            Life::Ended => return,
        };
        let PipeFrame {
            kind, message_id, ..
        } = frame;
        match kind {
            FrameKind::Ack => {
                // An ack for nothing lent (a duplicate, or after an end) is ignored.
                if let Some(buffers) = self.ledger.release(kind, message_id) {
                    self.events.push_back(InboundEvent::Release {
                        message_id,
                        buffers,
                    });
                }
            }
            _ if closing => {}
            FrameKind::Request => {
                if self.serving.contains(&message_id) || self.ledger.is_lending(message_id) {
                    self.close(Closed::DuplicateRequest { message_id });
                } else {
                    self.serving.insert(message_id);
                    self.events.push_back(InboundEvent::Request { message_id });
                }
            }
            FrameKind::Goodbye => self.close(Closed::Goodbye),
            FrameKind::Response | FrameKind::Error | FrameKind::Handshake => {
                self.close(Closed::Unexpected {
                    kind,
                    client: false,
                })
            }
        }
    }

    fn close(&mut self, why: Closed) {
        self.life = Life::Closing {
            said_goodbye: false,
        };
        self.events.push_back(InboundEvent::Closed(why));
    }

    /// The next thing to do, oldest first.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<InboundEvent<T>> {
        self.events.pop_front()
    }

    /// The next frame the protocol owes the peer.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The response to request `message_id` goes out, lending `lent` until the caller's
    /// ack. Send the frame only on `Ok`; on `Err` (the pipe ended, this side said
    /// goodbye, or the request did not come on this pipe) the response is dropped and
    /// `lent` comes back.
    pub fn respond(&mut self, message_id: u64, lent: Option<T>) -> Result<(), Refused<T>> {
        let reason = match self.life {
            Life::Ended => Refusal::Ended,
            Life::Closing { said_goodbye: true } => Refusal::Closing,
            _ if !self.serving.remove(&message_id) => Refusal::NotServing,
            _ => {
                if let Some(lent) = lent {
                    // The id was served, so nothing is lent under it yet.
                    drop(self.ledger.lend(Lender::Response, message_id, lent));
                }
                return Ok(());
            }
        };
        Err(Refused { reason, lent })
    }

    /// Closes the pipe on purpose: a goodbye is queued (once), and no response goes out
    /// any more. Acks are still handled until [`end`](Self::end).
    pub fn goodbye(&mut self) {
        if !matches!(
            self.life,
            Life::Ended | Life::Closing { said_goodbye: true }
        ) {
            self.life = Life::Closing { said_goodbye: true };
            self.transmits.push_back(Transmit::Goodbye);
        }
    }

    /// The pipe ended: every buffer responses still lend is given up, and the requests
    /// still being served are returned (their responses will be refused). Events and
    /// transmits not yet polled are dropped, except the `Release` events (their buffers
    /// came back before the end). Calling it again returns nothing.
    pub fn end(&mut self) -> Ended<T> {
        self.life = Life::Ended;
        self.transmits.clear();
        self.events
            .retain(|e| matches!(e, InboundEvent::Release { .. }));
        Ended {
            lent: self.ledger.end(),
            calls: core::mem::take(&mut self.serving).into_iter().collect(),
        }
    }
}

#[cfg(test)]
mod tests;
