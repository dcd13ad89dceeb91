//! What one store connection does with the bytes it reads, whatever runtime moves them:
//! a read buffer that grows only with bytes that really arrived, and the loop that cuts
//! whole requests out of it, runs them through the engine and encodes the replies.
//!
//! Both event loops (`direct` on io_uring, `epoll` on `mio`) call these; neither
//! decides what a request means, and this module does no I/O.

use std::fmt::Display;
use std::sync::OnceLock;
use std::time::Instant;

use rdzv_core::store::codec::{Decoded, RequestDecoder};
use rdzv_core::store::engine::Engine;
use rdzv_core::store::{ConnId, Response, WaitResponse};

use super::metrics::Metrics;

/// When the first store server of this process started: `STATS` reports uptime from
/// here (the engine has no clock). For `rdzv store serve`, one server per process, that
/// is the server's uptime.
static STARTED: OnceLock<Instant> = OnceLock::new();

/// Records the start of the first server (later calls change nothing).
pub(super) fn mark_started() {
    STARTED.get_or_init(Instant::now);
}

/// Milliseconds since [`mark_started`] (0 before it).
pub(super) fn uptime_ms() -> u64 {
    STARTED
        .get()
        .map_or(0, |started| started.elapsed().as_millis() as u64)
}

/// What [`serve_frames`] did with a connection's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Served {
    /// Bytes consumed (whole requests).
    pub(super) used: usize,
    /// The connection must be closed (bad input, or the engine refused it).
    pub(super) close: bool,
    /// At least this many more bytes must arrive before the next request is complete
    /// (0 when nothing is pending): a caller may skip the engine until they have.
    pub(super) needed: usize,
}

/// Serves every complete request at the start of `pending`, encoding replies into `out`.
/// After each request `route_wakeups` hands out the wake-ups the engine owes (its own go
/// into `out`).
///
/// `decoder` is the connection's own: it remembers how far it walked a key list that is
/// still arriving, so a long `WAIT` that comes in many pieces costs O(bytes) in all. The
/// caller must drop exactly the consumed bytes from the front of its buffer before the
/// next call (what [`ReadBuf::consume`] does).
///
/// With `metrics` (`--metrics`), each request's handling time is recorded and the
/// engine's figures are published after the batch.
#[allow(clippy::too_many_arguments)]
pub(super) fn serve_frames(
    metrics: Option<&Metrics>,
    engine: &mut Engine,
    decoder: &mut RequestDecoder,
    id: ConnId,
    peer: &dyn Display,
    pending: &[u8],
    out: &mut Vec<u8>,
    mut route_wakeups: impl FnMut(&mut Engine, &mut Vec<u8>),
) -> Served {
    let mut used = 0;
    let mut needed = 0;
    let close = |used| Served {
        used,
        close: true,
        needed: 0,
    };
    while used < pending.len() {
        let request = match decoder.decode(&pending[used..]) {
            Ok(Decoded::Complete(request, n)) => {
                used += n;
                engine.count_traffic(n as u64, 0);
                request
            }
            Ok(Decoded::Partial(more)) => {
                needed = more;
                break;
            }
            Err(error) => {
                tracing::warn!(%peer, %error, "closing store connection: bad request");
                return close(used);
            }
        };
        let before = out.len();
        let started = metrics.map(|_| (Instant::now(), request.query_type()));
        match engine.handle_request(id, request) {
            Ok(mut outcome) => {
                if let Some(Response::Stats(stats)) = &mut outcome.reply {
                    stats.uptime_ms = uptime_ms();
                }
                // Own wake-ups first, then the reply (the engine's polling order).
                for _ in 0..outcome.own_wakeups {
                    out.push(WaitResponse::StopWaiting as u8);
                }
                if let Some(response) = outcome.reply {
                    if let Err(error) = response.encode_into(out) {
                        // Only an inconsistent QUEUE_POP reply fails to encode, and the
                        // engine never makes one. Close rather than send garbage.
                        tracing::error!(%peer, %error, "cannot encode a reply");
                        return close(used);
                    }
                }
            }
            Err(refusal) => {
                tracing::warn!(%peer, reason = %refusal, "closing store connection");
                return close(used);
            }
        }
        route_wakeups(engine, out);
        engine.count_traffic(0, out.len().saturating_sub(before) as u64);
        if let (Some(metrics), Some((started, query))) = (metrics, started) {
            metrics.record(query, started.elapsed());
        }
    }
    if let Some(metrics) = metrics {
        metrics.publish(engine.stats());
    }
    Served {
        used,
        close: false,
        needed,
    }
}

/// A connection's read buffer: bytes `start..filled` of `buf` are unprocessed.
pub(super) struct ReadBuf {
    buf: Vec<u8>,
    start: usize,
    /// End of the bytes read so far.
    pub(super) filled: usize,
}

impl ReadBuf {
    pub(super) fn new() -> Self {
        ReadBuf {
            buf: vec![0; 4096],
            start: 0,
            filled: 0,
        }
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
                let bigger = self.buf.len().saturating_mul(2);
                self.buf.resize(bigger, 0);
            }
        }
    }

    pub(super) fn spare(&mut self) -> &mut [u8] {
        &mut self.buf[self.filled..]
    }
}

/// The io_uring loop receives into the spare bytes, after `filled`.
impl crate::sys::uring::RecvBuf for ReadBuf {
    fn recv_into(&mut self) -> (&mut Vec<u8>, usize) {
        (&mut self.buf, self.filled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdzv_core::store::codec::Limits;
    use rdzv_core::store::{QueryType, VALIDATION_MAGIC};

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
    /// buffer and decoder as a server loop drives them: the decoder walks each key once
    /// (linear work), where re-parsing from the frame start on every piece would walk
    /// about 128Ki x pieces / 2 = 10^10 keys.
    #[test]
    fn a_huge_wait_in_small_pieces_is_decoded_in_linear_work() {
        let count = Limits::default().max_key_count as usize;
        let mut frame = vec![QueryType::Validate as u8];
        frame.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
        frame.extend(wait_frame(count));
        let mut engine = Engine::new();
        let id = ConnId(1);
        assert!(engine.connect(id));
        let mut decoder = RequestDecoder::new(Limits::default());
        let mut input = ReadBuf::new();
        let mut out = Vec::new();
        let mut calls = 0usize;
        for piece in frame.chunks(64) {
            let mut rest = piece;
            while !rest.is_empty() {
                let spare = input.spare();
                let n = spare.len().min(rest.len());
                spare[..n].copy_from_slice(&rest[..n]);
                input.filled += n;
                rest = &rest[n..];
                let Served { used, close, .. } = serve_frames(
                    None,
                    &mut engine,
                    &mut decoder,
                    id,
                    &"test",
                    input.pending(),
                    &mut out,
                    |engine, own| {
                        while let Some((_, wake)) = engine.poll_wakeup() {
                            own.push(wake as u8);
                        }
                    },
                );
                assert!(!close, "the connection was closed");
                input.consume(used);
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
        // Every key is walked exactly once (a piece that ends inside a key re-reads only
        // that key's length prefix, which is not counted as an item).
        assert_eq!(decoder.items_walked(), count as u64);
    }

    /// A request that is refused closes only its connection, and the decoder's error
    /// reaches the caller as a close.
    #[test]
    fn bad_bytes_close_the_connection() {
        let mut engine = Engine::new();
        let id = ConnId(2);
        assert!(engine.connect(id));
        let mut decoder = RequestDecoder::new(Limits::default());
        let mut out = Vec::new();
        let served = serve_frames(
            None,
            &mut engine,
            &mut decoder,
            id,
            &"test",
            &[0xff, 0, 0],
            &mut out,
            |_, _| {},
        );
        assert_eq!((served.used, served.close), (0, true));
    }

    #[test]
    fn grows_only_for_a_request_larger_than_the_buffer() {
        let mut input = ReadBuf::new();
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
    }

    #[test]
    fn compacts_unconsumed_bytes_to_the_front() {
        let mut input = ReadBuf::new();
        let size = input.spare().len();
        input.spare()[size - 3..].copy_from_slice(b"abc");
        input.filled = size;
        input.consume(size - 3);
        assert_eq!(input.pending(), b"abc");
        assert_eq!(input.spare().len(), size - 3);
    }
}
