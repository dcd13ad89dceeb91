//! One store connection's serve step, shaped like smoltcp's `poll`: the runtime hands it
//! the connection's unserved bytes, how many reply bytes it still owes the peer, and
//! `now`; the step serves at most one request and says what happened as a value
//! ([`Step`]): a request served (its reply appended to the caller's buffer, the wake-ups
//! owed to *other* connections appended to the caller's list), more bytes needed, no
//! more serving until the peer reads (backpressure), or close, and why.
//!
//! It decides the per-connection account of [`Budget`]: a connection whose unsent
//! replies are over the high-water mark is not served; a request whose bytes would not
//! fit the budget closes the connection before the runtime buffers them; a reply's size
//! is computed before any room is reserved for it, and one that would not fit closes the
//! connection instead (so a `MULTI_GET` naming one 8 MiB key 131072 times costs nothing).
//! Reply room is reserved fallibly.
//!
//! It does no I/O, keeps no clock and routes nothing between threads: which thread owns
//! a woken connection is the runtime's business.
//!
//! Access control: a session built [`Session::with_access`] under a policy that requires
//! tokens first takes rdzv's `AUTH` frame (answering [`AUTH_ACCEPTED`]) and then checks
//! every request against the token's scope ([`Session::admits`]) before the engine sees
//! it; the policy decides ([`AccessPolicy`]), this step only carries the connection's
//! [`ConnAccess`]. Without a policy (or one without tokens) that costs one `Option`
//! check per request. Who may connect at all is decided at accept, by the runtime.

use alloc::sync::Arc;
use alloc::vec::Vec;
use core::fmt;

use super::access::{self, AccessPolicy, ConnAccess};
use super::codec::{decode_auth, AUTH_ACCEPTED, MAX_AUTH_TOKEN_LEN};

use super::budget::Budget;
use super::codec::{AuthDecodeError, DecodeError, Decoded, EncodeError, Limits, RequestDecoder};
use super::engine::{Close, Engine};
use super::{ConnId, QueryType, Request, WaitResponse};

/// A wake-up owed to another connection.
pub type Wake = (ConnId, WaitResponse);

/// What one call of [`Session::serve`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// One request was served from the front of the input: drop `used` bytes from it.
    /// Its own wake-ups and its reply (if any) were appended to `out`, wake-ups owed to
    /// other connections to `wakes`. Call again for the next request.
    Served {
        /// Bytes consumed.
        used: usize,
        /// The request's query.
        query: QueryType,
    },
    /// The connection's `AUTH` frame was accepted: drop `used` bytes from the input;
    /// [`AUTH_ACCEPTED`] was appended to `out`. Call again for the next request.
    Authenticated {
        /// Bytes consumed.
        used: usize,
    },
    /// No whole request is in the input: at least `needed` more bytes must arrive.
    Partial {
        /// Bytes still missing (at least 1).
        needed: usize,
    },
    /// The connection owes more than the high-water mark: serve it again once the peer
    /// has read some (its input stays where it is).
    Blocked,
    /// Close the connection (after writing what `out` holds), for this reason; the
    /// runtime logs it and takes the connection out of the engine.
    Close(Refusal),
}

/// Why a connection is closed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The bytes are not a request (or claim more than the wire limits allow).
    BadRequest(DecodeError),
    /// The engine refused the request (see [`Close`]).
    Engine(Close),
    /// The request needs more bytes than the per-connection budget leaves.
    RequestOverBudget {
        /// Bytes the request needs in all (at least).
        needed: usize,
        /// Reply bytes the connection owed meanwhile.
        owed: usize,
        /// The per-connection budget.
        limit: usize,
    },
    /// The reply would not fit the per-connection budget.
    ReplyOverBudget {
        /// The query answered.
        query: QueryType,
        /// The reply's size.
        len: usize,
        /// Bytes the connection held already (owed replies and unserved input).
        held: usize,
        /// The per-connection budget.
        limit: usize,
    },
    /// Access control refused the connection: no or a bad token, or a request outside
    /// the token's scope.
    Access(access::Refusal),
    /// The reply could not be encoded (the allocator refused its room).
    Encode(EncodeError),
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::BadRequest(error) => write!(f, "bad request: {error}"),
            Refusal::Engine(close) => fmt::Display::fmt(close, f),
            Refusal::RequestOverBudget {
                needed,
                owed,
                limit,
            } => write!(
                f,
                "a request of at least {needed} bytes (with {owed} reply bytes unsent) is \
                 over the server's limit of {limit} bytes per connection \
                 (--max-conn-bytes)"
            ),
            Refusal::ReplyOverBudget {
                query,
                len,
                held,
                limit,
            } => write!(
                f,
                "the {} reply of {len} bytes (with {held} bytes already held) is over the \
                 server's limit of {limit} bytes per connection (--max-conn-bytes)",
                query.name()
            ),
            Refusal::Access(refusal) => fmt::Display::fmt(refusal, f),
            Refusal::Encode(error) => write!(f, "cannot encode a reply: {error}"),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for Refusal {}

/// One connection's serving state: its id, its decoder (which remembers how far it
/// walked a key list still arriving) and its budget.
#[derive(Debug, Clone)]
pub struct Session {
    id: ConnId,
    decoder: RequestDecoder,
    budget: Budget,
    /// The policy and where this connection stands with it; `None` when no tokens are
    /// required (every request allowed).
    access: Option<(Arc<AccessPolicy>, ConnAccess)>,
    /// The engine accepted this connection's `VALIDATE`: later requests skip its check
    /// ([`Engine::handle_validated_request`]).
    validated: bool,
}

impl Session {
    /// A session for connection `id` (already [`Engine::connect`]ed), decoding with
    /// `limits` and held to `budget`'s per-connection account.
    pub fn new(id: ConnId, limits: Limits, budget: Budget) -> Session {
        Session {
            id,
            decoder: RequestDecoder::new(limits),
            budget,
            access: None,
            validated: false,
        }
    }

    /// This session held to `policy`'s tokens (a policy without tokens changes nothing:
    /// its allowlist is the runtime's to apply at accept).
    pub fn with_access(mut self, policy: &Arc<AccessPolicy>) -> Session {
        self.access = policy
            .requires_tokens()
            .then(|| (Arc::clone(policy), policy.new_connection()));
        self
    }

    /// The connection's id.
    pub fn id(&self) -> ConnId {
        self.id
    }

    /// The budget this session enforces.
    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// How many list items the decoder walked in all (a measure of decoding work).
    pub fn items_walked(&self) -> u64 {
        self.decoder.items_walked()
    }

    /// Serves at most one request from the front of `input`.
    ///
    /// `owed` is how many reply bytes the connection owes its peer, `out`'s included:
    /// the caller adds what this call appends before the next one. `input` must be the
    /// unconsumed bytes, as for [`RequestDecoder::decode`]: after `Served { used, .. }`
    /// the caller drops exactly `used` bytes from its front. `now_ms` is the runtime's
    /// clock (for `STATS` uptime).
    #[inline]
    pub fn serve(
        &mut self,
        engine: &mut Engine,
        input: &[u8],
        owed: usize,
        out: &mut Vec<u8>,
        wakes: &mut Vec<Wake>,
        now_ms: u64,
    ) -> Step {
        if input.is_empty() {
            return Step::Partial { needed: 1 };
        }
        if !self.budget.may_serve(owed) {
            return Step::Blocked;
        }
        if let Some((policy, ConnAccess::AwaitingAuth)) = &mut self.access {
            return match decode_auth(input, MAX_AUTH_TOKEN_LEN) {
                Ok(Decoded::Partial(needed)) => Step::Partial { needed },
                Ok(Decoded::Complete(auth, used)) => {
                    match policy.authenticate(ConnAccess::AwaitingAuth, Some(auth.token)) {
                        Ok(state) => {
                            if out.try_reserve(1).is_err() {
                                return Step::Close(Refusal::Encode(EncodeError::OutOfMemory {
                                    needed: 1,
                                }));
                            }
                            out.push(AUTH_ACCEPTED);
                            if let Some((_, access)) = &mut self.access {
                                *access = state;
                            }
                            Step::Authenticated { used }
                        }
                        Err(refusal) => Step::Close(Refusal::Access(refusal)),
                    }
                }
                Err(AuthDecodeError::NotAuth { byte }) => {
                    Step::Close(Refusal::Access(access::Refusal::NotAuthenticated { byte }))
                }
                Err(_) => Step::Close(Refusal::Access(access::Refusal::BadToken)),
            };
        }
        let (request, used) = match self.decoder.decode(input) {
            Ok(Decoded::Complete(request, used)) => (request, used),
            Ok(Decoded::Partial(more)) => {
                let needed = input.len().saturating_add(more);
                if !self.budget.request_fits(owed, needed) {
                    return Step::Close(Refusal::RequestOverBudget {
                        needed,
                        owed,
                        limit: self.budget.max_conn_bytes,
                    });
                }
                return Step::Partial { needed: more };
            }
            Err(error) => return Step::Close(Refusal::BadRequest(error)),
        };
        let query = request.query_type();
        if let Err(refusal) = self.admits(&request) {
            return Step::Close(Refusal::Access(refusal));
        }
        engine.tick(now_ms);
        let before = out.len();
        // Read where it was returned (an outcome can hold a `STATS` reply of 240 bytes:
        // moving it out costs a copy per request).
        let result = if self.validated {
            engine.handle_validated_request(self.id, request)
        } else {
            let result = engine.handle_request(self.id, request);
            // Only `VALIDATE` passes for a connection not validated yet.
            self.validated = result.is_ok();
            result
        };
        let outcome = match result {
            Ok(ref outcome) => outcome,
            Err(ref close) => {
                let close = close.clone();
                engine.count_traffic(used as u64, 0);
                drain_wakes(engine, self.id, out, wakes);
                return Step::Close(Refusal::Engine(close));
            }
        };
        let len = outcome
            .own_wakeups
            .saturating_add(outcome.reply.as_ref().map_or(0, |r| r.encoded_len()));
        let held = owed.saturating_add(input.len() - used);
        if !self.budget.reply_fits(owed, input.len() - used, len) {
            engine.count_traffic(used as u64, 0);
            drain_wakes(engine, self.id, out, wakes);
            return Step::Close(Refusal::ReplyOverBudget {
                query,
                len,
                held,
                limit: self.budget.max_conn_bytes,
            });
        }
        // Own wake-ups first, then the reply (the engine's polling order), in room
        // reserved for both at once.
        if out.try_reserve(len).is_err() {
            engine.count_traffic(used as u64, 0);
            return Step::Close(Refusal::Encode(EncodeError::OutOfMemory { needed: len }));
        }
        out.resize(
            before + outcome.own_wakeups,
            WaitResponse::StopWaiting as u8,
        );
        if let Some(reply) = &outcome.reply {
            if let Err(error) = reply.encode_reserved(out) {
                out.truncate(before);
                engine.count_traffic(used as u64, 0);
                drain_wakes(engine, self.id, out, wakes);
                return Step::Close(Refusal::Encode(error));
            }
        }
        drain_wakes(engine, self.id, out, wakes);
        // Counted once, in and out together (each refusal above counts its input).
        engine.count_traffic(used as u64, (out.len() - before) as u64);
        Step::Served { used, query }
    }

    /// Whether this connection may make `request`: the one place each request passes
    /// before the engine. Without tokens everything is allowed, as PyTorch's server
    /// allows it.
    #[inline]
    fn admits(&self, request: &Request<'_>) -> Result<(), access::Refusal> {
        match &self.access {
            None => Ok(()),
            Some((policy, state)) => policy.authorize(*state, request),
        }
    }
}

/// Moves the wake-ups the engine owes into `wakes` (the requester's own, which the
/// engine counts in `own_wakeups`, never appear here; one that did would go to `out`).
fn drain_wakes(engine: &mut Engine, me: ConnId, out: &mut Vec<u8>, wakes: &mut Vec<Wake>) {
    while let Some((target, wake)) = engine.poll_wakeup() {
        if target == me {
            out.push(wake as u8);
        } else {
            wakes.push((target, wake));
        }
    }
}

#[cfg(test)]
mod tests;
