//! What one store connection does with the bytes it reads, whatever runtime moves them:
//! a read buffer that grows only with bytes that really arrived, and the loop that cuts
//! whole requests out of it, runs them through the engine and encodes the replies.
//!
//! Both event loops (`direct` on io_uring, `epoll` on epoll) call these; neither
//! decides what a request means, and this module does no I/O.

use std::fmt::Display;
use std::time::{Duration, Instant};

use rdzv_core::store::engine::Engine;
use rdzv_core::store::session::{self as step, Session, Step};

use super::metrics::Metrics;

/// Reply bytes one round of a loop (an epoll wait's events, an io_uring batch of
/// completions) produces before the connections not yet served wait for the next round
/// (after a fresh look for events): a burst of clients asking for large values does not
/// hold up a small request for the time it takes to copy all their replies. 1 MiB is
/// about a millisecond of copying (the reply's encoding and the kernel's send) in a
/// debug build; a single larger reply still goes out whole, one per round.
const ROUND_OUT: usize = 1 << 20;

/// A connection whose last turn produced less than this (and owes nothing) is light:
/// the round's cap does not defer it, so that a small request is not queued behind a
/// burst of clients asking for large values. A light connection can overshoot the cap
/// by one turn (the mark plus one bounded reply), after which it is no longer light.
const LIGHT_OUT: usize = 64 << 10;

/// Which part of a round a loop is in. A round serves its light connections first and
/// hands their replies to the kernel, then the heavy ones up to [`ROUND_OUT`]: a small
/// request that arrives beside a burst of large GETs waits for neither their copying nor
/// their sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pass {
    /// Fresh input: light connections are served, heavy ones wait for [`Pass::Heavy`].
    Light,
    /// After the light replies went out: heavy connections, until the round's share.
    Heavy,
}

/// What one round of a loop has produced, against [`ROUND_OUT`]; and which connections
/// are light.
#[derive(Debug, Default)]
pub(super) struct Round {
    out: usize,
}

impl Round {
    /// A new round: nothing produced yet.
    pub(super) fn begin(&mut self) {
        self.out = 0;
    }

    /// Reply bytes produced this round.
    pub(super) fn produced(&self) -> usize {
        self.out
    }

    /// Whether a connection waits (for the heavy pass, or the next round): a heavy one
    /// in the light pass, or once the round has produced its share.
    pub(super) fn defers(&self, light: bool, pass: Pass) -> bool {
        !light && (pass == Pass::Light || self.out >= ROUND_OUT)
    }

    /// Counts a turn; returns whether its connection is light now.
    pub(super) fn count(&mut self, served: &Served) -> bool {
        self.out = self.out.saturating_add(served.produced);
        served.produced < LIGHT_OUT && !served.blocked
    }
}

/// The parts of one connection that [`serve_requests`] serves.
pub(super) struct ConnInput<'a> {
    /// Its serve state (id, decoder, budget).
    pub(super) session: &'a mut Session,
    /// What it sent and was not served yet: its whole requests are served (the caller
    /// drops the [`Served::used`] bytes from its front).
    pub(super) pending: &'a [u8],
    /// Every byte it owes its peer now (`out`'s included).
    pub(super) owed: usize,
    /// Where its replies go.
    pub(super) out: &'a mut Vec<u8>,
    /// The peer, for logs.
    pub(super) peer: &'a dyn Display,
}

/// What a loop brings to a turn besides the connection: the turn's `now`, the metrics
/// it records into (`--metrics`) and its rate-limited log of refusals.
pub(super) struct Turn<'a> {
    /// The engine's clock, in milliseconds.
    pub(super) now_ms: u64,
    /// Where each request's handling time goes, and the engine's figures after a batch.
    pub(super) metrics: Option<&'a Metrics>,
    /// The loop's log of closed connections.
    pub(super) warnings: &'a mut Throttle,
}

/// What [`serve_requests`] did with a connection's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Served {
    /// Bytes consumed (whole requests).
    pub(super) used: usize,
    /// The connection must be closed (bad input, a limit, or the engine refused it).
    pub(super) close: bool,
    /// At least this many more bytes must arrive before the next request is complete
    /// (0 when nothing is pending): a caller may skip the engine until they have.
    pub(super) needed: usize,
    /// The connection owes more than its high-water mark: no more of its requests are
    /// served (and none read) until the peer has read some; then call again.
    pub(super) blocked: bool,
    /// Bytes this turn added to the connection's output (replies, its wake-ups).
    pub(super) produced: usize,
}

/// Runs the core serve step over every whole request at the start of the connection's
/// pending bytes until it needs more bytes, blocks or closes: replies go into its `out`,
/// wake-ups owed to other connections into `wakes`. The caller consumes what was served
/// ([`ReadBuf::served`], or the part of a chunk not served is kept: [`ReadBuf::keep`]).
///
/// With `turn.metrics` (`--metrics`), each request's handling time is recorded and the
/// engine's figures are published after the batch. A refusal is logged through
/// `turn.warnings` (rate-limited).
#[inline]
pub(super) fn serve_requests(
    engine: &mut Engine,
    conn: ConnInput<'_>,
    wakes: &mut Vec<step::Wake>,
    turn: &mut Turn<'_>,
) -> Served {
    let ConnInput {
        session,
        pending,
        owed,
        out,
        peer,
    } = conn;
    let Turn {
        now_ms,
        metrics,
        ref mut warnings,
    } = *turn;
    let mut used = 0;
    let base = out.len();
    let mut served = loop {
        if used == pending.len() {
            // What the step says of no input, without the call.
            break Served {
                used,
                close: false,
                needed: 1,
                blocked: false,
                produced: 0,
            };
        }
        let owing = owed.saturating_add(out.len() - base);
        let started = metrics.map(|_| Instant::now());
        match session.serve(engine, &pending[used..], owing, out, wakes, now_ms) {
            Step::Served { used: n, query } => {
                used += n;
                if let (Some(metrics), Some(started)) = (metrics, started) {
                    metrics.record(query, started.elapsed());
                }
            }
            Step::Authenticated { used: n } => used += n,
            Step::Partial { needed } => {
                break Served {
                    used,
                    close: false,
                    needed,
                    blocked: false,
                    produced: 0,
                }
            }
            Step::Blocked => {
                break Served {
                    used,
                    close: false,
                    needed: 0,
                    blocked: true,
                    produced: 0,
                }
            }
            Step::Close(refusal) => {
                if let step::Refusal::Access(refusal) = &refusal {
                    engine.count_refusal(refusal);
                }
                if let Some(suppressed) = warnings.allow(Instant::now()) {
                    tracing::warn!(%peer, reason = %refusal, suppressed, "closing store connection");
                }
                break Served {
                    used,
                    close: true,
                    needed: 0,
                    blocked: false,
                    produced: 0,
                };
            }
        }
    };
    if let Some(metrics) = metrics {
        metrics.publish(engine.stats());
    }
    served.produced = out.len() - base;
    served
}

/// Lets one log line through per [`Throttle::WINDOW`] and counts the rest, so that one
/// bad client (or a storm of them) cannot flood the log: the line that gets through says
/// how many were suppressed before it.
#[derive(Debug, Default)]
pub(super) struct Throttle {
    last: Option<Instant>,
    suppressed: u64,
}

impl Throttle {
    /// One line per second.
    pub(super) const WINDOW: Duration = Duration::from_secs(1);

    /// `Some(lines suppressed since the last one)` when a line may be written now.
    pub(super) fn allow(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(last) if now.saturating_duration_since(last) < Self::WINDOW => {
                self.suppressed = self.suppressed.saturating_add(1);
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

/// A connection's read buffer: bytes `start..filled` of `buf` are unprocessed. It never
/// grows past `cap` (the per-connection budget), and grows fallibly. It also knows how
/// many bytes the serve step still waits for, so that a loop asks the engine only when
/// a request may be complete.
pub(super) struct ReadBuf {
    buf: Vec<u8>,
    start: usize,
    /// End of the bytes read so far.
    pub(super) filled: usize,
    cap: usize,
    /// Bytes received since the serve step last looked (compared to `needed`).
    arrived: usize,
    /// At least this many bytes must arrive before the next request is complete.
    needed: usize,
}

impl ReadBuf {
    pub(super) fn new(cap: usize) -> Self {
        ReadBuf {
            buf: vec![0; 4096.min(cap.max(1))],
            start: 0,
            filled: 0,
            cap: cap.max(1),
            arrived: 0,
            needed: 1,
        }
    }

    /// `n` bytes were received into [`ReadBuf::spare`]: whether the next request may be
    /// complete now (serve it); if not, room is made for more (growing the buffer when
    /// one request is larger than it).
    pub(super) fn received(&mut self, n: usize) -> bool {
        self.filled = self.filled.saturating_add(n).min(self.buf.len());
        self.arrived = self.arrived.saturating_add(n);
        if self.arrived >= self.needed {
            return true;
        }
        self.consume(0);
        false
    }

    /// Copies the front of `bytes` (a chunk the io_uring loop received into its
    /// provided buffers) into the spare room, after making room as a receive does
    /// (compacting; growing, to the cap, only while the next request is incomplete):
    /// how many bytes it took (0 when there is no room).
    pub(super) fn take_from(&mut self, bytes: &[u8]) -> usize {
        if bytes.is_empty() {
            return 0;
        }
        if self.filled == self.buf.len() && (self.start > 0 || !self.ready()) {
            self.consume(0);
        }
        let n = (self.buf.len() - self.filled).min(bytes.len());
        self.buf[self.filled..self.filled + n].copy_from_slice(&bytes[..n]);
        self.filled += n;
        self.arrived = self.arrived.saturating_add(n);
        n
    }

    /// Keeps what the serve step left of a chunk it served in place (the buffer held
    /// nothing): copies the front of `rest` as [`ReadBuf::take_from`] does. The step saw
    /// the first `seen` bytes of `rest` and needs `needed` more than those (see
    /// [`Served::needed`]); the bytes kept past them count as arrived since. Returns how
    /// many bytes it took.
    pub(super) fn keep(&mut self, rest: &[u8], seen: usize, needed: usize) -> usize {
        let n = self.take_from(rest);
        self.arrived = n.saturating_sub(seen);
        self.needed = needed.max(1);
        n
    }

    /// Whether the next request may be complete (enough bytes arrived since the serve
    /// step last looked).
    pub(super) fn ready(&self) -> bool {
        self.arrived >= self.needed
    }

    /// Unserved bytes held.
    pub(super) fn held(&self) -> usize {
        self.filled - self.start
    }

    /// The serve step used `served.used` bytes and needs `served.needed` more before
    /// the next request is complete.
    #[inline]
    pub(super) fn served(&mut self, served: &Served) {
        if self.start.saturating_add(served.used) == self.filled {
            // Everything held was served (the common case), inline.
            self.start = 0;
            self.filled = 0;
        } else {
            self.consume(served.used);
        }
        self.arrived = 0;
        self.needed = served.needed.max(1);
    }

    pub(super) fn pending(&self) -> &[u8] {
        &self.buf[self.start..self.filled]
    }

    /// Makes room after `consumed` bytes were used: compacts, or grows when one request
    /// is larger than the buffer. Growth follows the bytes that really arrived (the
    /// decoder already checked the claimed lengths against the limits).
    pub(super) fn consume(&mut self, consumed: usize) {
        self.start += consumed;
        if self.start == self.filled {
            self.start = 0;
            self.filled = 0;
        } else if self.filled == self.buf.len() {
            if self.start > 0 {
                self.buf.copy_within(self.start..self.filled, 0);
                self.filled -= self.start;
                self.start = 0;
            } else {
                let bigger = self.buf.len().saturating_mul(2).min(self.cap);
                // A fresh zeroed buffer (the kernel's zero pages, nothing written) and
                // one copy of the bytes held, rather than writing every new zero: a few
                // MiB of `resize` cost a debug server tens of milliseconds in one turn.
                // A refused allocation leaves the buffer full: the serve step then sees a
                // request that does not fit and closes the connection.
                let grown = (bigger > self.buf.len())
                    .then(|| crate::sys::memory::try_zeroed(bigger))
                    .flatten();
                if let Some(mut grown) = grown {
                    grown[..self.filled].copy_from_slice(&self.buf[..self.filled]);
                    self.buf = grown;
                }
            }
        }
    }

    pub(super) fn spare(&mut self) -> &mut [u8] {
        &mut self.buf[self.filled..]
    }

    /// Whether no byte more can be read into the buffer.
    pub(super) fn is_full(&self) -> bool {
        self.filled == self.buf.len()
    }

    /// Bytes the buffer holds (its capacity): the most it takes at once.
    pub(super) fn size(&self) -> usize {
        self.buf.len()
    }
}

/// The io_uring loop receives into the spare bytes, after `filled`.
impl crate::sys::uring::RecvBuf for ReadBuf {
    fn recv_into(&mut self) -> (&mut Vec<u8>, usize) {
        (&mut self.buf, self.filled)
    }
}

/// As boxed by the io_uring loop (the ring then moves a pointer).
impl crate::sys::uring::RecvBuf for Box<ReadBuf> {
    fn recv_into(&mut self) -> (&mut Vec<u8>, usize) {
        (&mut self.buf, self.filled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdzv_core::store::budget::Budget;
    use rdzv_core::store::codec::Limits;
    use rdzv_core::store::{ConnId, QueryType, VALIDATION_MAGIC};

    /// A `WAIT` naming `count` keys, in PyTorch's framing.
    fn wait_frame(count: usize) -> Vec<u8> {
        let mut frame = vec![QueryType::Wait as u8];
        frame.extend_from_slice(&(count as u64).to_le_bytes());
        for i in 0..count {
            let key = format!("k{i}");
            frame.extend_from_slice(&(key.len() as u64).to_le_bytes());
            frame.extend_from_slice(key.as_bytes());
        }
        frame
    }

    /// A 128 Ki-key `WAIT` arriving 64 bytes at a time, through a connection's read
    /// buffer and session as a server loop drives them: the decoder walks each key once
    /// (linear work), where re-parsing from the frame start on every piece would walk
    /// about 128Ki x pieces / 2 = 10^10 keys.
    #[test]
    fn a_huge_wait_in_small_pieces_is_decoded_in_linear_work() {
        let count = Limits::default().max_key_count as usize;
        let mut frame = vec![QueryType::Validate as u8];
        frame.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
        frame.extend(wait_frame(count));
        let budget = Budget::default();
        let mut engine = Engine::with_budget(budget);
        let id = ConnId(1);
        assert!(engine.connect(id));
        let mut session = Session::new(id, Limits::default(), budget);
        let mut input = ReadBuf::new(budget.max_conn_bytes);
        let mut out = Vec::new();
        let mut wakes = Vec::new();
        let mut warnings = Throttle::default();
        let mut turn = Turn {
            now_ms: 0,
            metrics: None,
            warnings: &mut warnings,
        };
        let mut calls = 0usize;
        for piece in frame.chunks(64) {
            let mut rest = piece;
            while !rest.is_empty() {
                let spare = input.spare();
                let n = spare.len().min(rest.len());
                spare[..n].copy_from_slice(&rest[..n]);
                input.received(n);
                rest = &rest[n..];
                let conn = ConnInput {
                    session: &mut session,
                    pending: input.pending(),
                    owed: 0,
                    out: &mut out,
                    peer: &"test",
                };
                let served = serve_requests(&mut engine, conn, &mut wakes, &mut turn);
                input.served(&served);
                assert!(!served.close, "the connection was closed");
                calls += 1;
            }
        }
        assert!(
            calls > 10_000,
            "the frame must arrive in many pieces: {calls}"
        );
        assert!(input.pending().is_empty(), "the whole WAIT was consumed");
        assert!(out.is_empty(), "nothing is owed before a key is set");
        assert_eq!(engine.waiter_count(), 1, "the WAIT is registered");
        assert_eq!(session.items_walked(), count as u64);
    }

    /// A request that is refused closes only its connection.
    #[test]
    fn bad_bytes_close_the_connection() {
        let mut engine = Engine::new();
        let id = ConnId(2);
        assert!(engine.connect(id));
        let mut session = Session::new(id, Limits::default(), Budget::default());
        let mut input = ReadBuf::new(64);
        let bad = [0xff, 0, 0];
        input.spare()[..bad.len()].copy_from_slice(&bad);
        input.received(bad.len());
        let conn = ConnInput {
            session: &mut session,
            pending: input.pending(),
            owed: 0,
            out: &mut Vec::new(),
            peer: &"test",
        };
        let mut warnings = Throttle::default();
        let mut turn = Turn {
            now_ms: 0,
            metrics: None,
            warnings: &mut warnings,
        };
        let served = serve_requests(&mut engine, conn, &mut Vec::new(), &mut turn);
        input.served(&served);
        assert_eq!((served.used, served.close), (0, true));
        assert_eq!(input.pending(), &bad[..], "nothing was consumed");
    }

    #[test]
    fn a_round_serves_light_connections_first_and_heavy_ones_up_to_its_share() {
        let mut round = Round::default();
        let heavy = Served {
            used: 0,
            close: false,
            needed: 0,
            blocked: false,
            produced: ROUND_OUT,
        };
        let small = Served {
            produced: LIGHT_OUT - 1,
            ..heavy
        };
        assert!(
            round.defers(false, Pass::Light),
            "heavy ones wait for their pass"
        );
        assert!(
            !round.defers(true, Pass::Light),
            "light ones are served first"
        );
        assert!(!round.defers(false, Pass::Heavy), "nothing produced yet");
        assert!(round.count(&small), "a small turn is light");
        assert!(!round.defers(false, Pass::Heavy));
        assert!(!round.count(&heavy), "a large turn is not light");
        assert_eq!(round.produced(), ROUND_OUT + LIGHT_OUT - 1);
        assert!(
            round.defers(false, Pass::Heavy),
            "its share is produced: heavy ones wait"
        );
        assert!(!round.defers(true, Pass::Heavy), "light ones do not");
        round.begin();
        assert!(!round.defers(false, Pass::Heavy), "a new round");
        let blocked = Served {
            blocked: true,
            ..small
        };
        assert!(!round.count(&blocked), "a blocked connection is not light");
    }

    #[test]
    fn the_throttle_lets_one_line_a_second_through_and_counts_the_rest() {
        let mut throttle = Throttle::default();
        let t0 = Instant::now();
        assert_eq!(throttle.allow(t0), Some(0));
        for _ in 0..5 {
            assert_eq!(throttle.allow(t0 + Duration::from_millis(10)), None);
        }
        assert_eq!(throttle.allow(t0 + Throttle::WINDOW), Some(5));
    }

    #[test]
    fn grows_only_for_a_request_larger_than_the_buffer_and_never_past_its_cap() {
        let mut input = ReadBuf::new(10_000);
        let size = input.spare().len();
        input.filled = size;
        input.consume(0);
        assert_eq!(
            input.spare().len(),
            size,
            "a full buffer with nothing used doubles"
        );
        input.consume(size);
        assert!(input.pending().is_empty());
        assert_eq!(input.spare().len(), 2 * size);
        input.filled = 2 * size;
        input.consume(0);
        assert_eq!(input.size(), 10_000, "capped");
        input.filled = 10_000;
        input.consume(0);
        assert!(input.is_full(), "a full buffer at its cap stays full");
    }

    #[test]
    fn compacts_unconsumed_bytes_to_the_front() {
        let mut input = ReadBuf::new(1 << 20);
        let size = input.spare().len();
        input.spare()[size - 3..].copy_from_slice(b"abc");
        input.filled = size;
        input.consume(size - 3);
        assert_eq!(input.pending(), b"abc");
        assert_eq!(input.spare().len(), size - 3);
    }
}
