//! `mpt`: one tensor split over several TCP connections ("lanes"), TensorPipe's
//! `mpt_uv` channel, so that one large transfer is not limited to what one connection and
//! one core can push.
//!
//! A transfer of `len` bytes is cut into one contiguous stripe per lane
//! ([`stripes`]: equal shares, the first lanes take the remainder); transfers smaller
//! than [`MptOptions::min_striped_len`] use lane 0 only, since starting the other lanes
//! costs more than they save. Each used lane carries a 32-byte stripe header (magic,
//! transfer id, offset, length) and then the stripe's bytes. Both ends know `len` and the
//! transfer id from the descriptor the agent sends over the pipe, so the receiver checks
//! every header against the stripe it expects before it reads a byte of data into place:
//! a peer cannot make it write outside the stripe, and a lane that drifted out of step is
//! an error, not a misplaced tensor.
//!
//! Lanes are plain blocking `TcpStream`s with `TCP_NODELAY`; a transfer runs one scoped
//! thread per used lane on each side. Errors name the lane and its peer. This module does
//! not open the lanes (the agent connects them to the peer's listener) and does not
//! negotiate.

use std::io::{self, Read, Write};
use std::net::TcpStream;

/// What starts every stripe header.
const STRIPE_MAGIC: [u8; 4] = *b"RDMP";
/// Bytes of a stripe header: magic, reserved, transfer id, offset, length.
pub const STRIPE_HEADER_LEN: usize = 32;

/// Tuning of the channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct MptOptions {
    /// Transfers shorter than this go over lane 0 alone.
    pub min_striped_len: usize,
}

impl Default for MptOptions {
    fn default() -> Self {
        MptOptions {
            min_striped_len: 256 * 1024,
        }
    }
}

/// Where each lane's stripe of a `len`-byte transfer lies, as `(offset, len)`: equal
/// shares over `lanes` lanes (the first `len % lanes` get one byte more), all on lane 0
/// below `min_striped_len`. Lanes with nothing to carry are left out.
pub fn stripes(len: usize, lanes: usize, min_striped_len: usize) -> Vec<(usize, usize)> {
    let used = if len < min_striped_len {
        1
    } else {
        lanes.max(1)
    };
    let (share, extra) = (len / used, len % used);
    let mut out = Vec::with_capacity(used);
    let mut offset = 0;
    for lane in 0..used {
        let n = share + usize::from(lane < extra);
        if n > 0 || (lane == 0 && len == 0) {
            out.push((offset, n));
        }
        offset += n;
    }
    out
}

/// A stripe header as sent before the stripe's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StripeHeader {
    /// The transfer this stripe belongs to.
    pub transfer_id: u64,
    /// Offset of the stripe in the tensor.
    pub offset: u64,
    /// Length of the stripe.
    pub len: u64,
}

impl StripeHeader {
    /// The wire form.
    pub fn encode(&self) -> [u8; STRIPE_HEADER_LEN] {
        let mut out = [0u8; STRIPE_HEADER_LEN];
        out[..4].copy_from_slice(&STRIPE_MAGIC);
        out[8..16].copy_from_slice(&self.transfer_id.to_le_bytes());
        out[16..24].copy_from_slice(&self.offset.to_le_bytes());
        out[24..32].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// Parses a header; `None` for a wrong magic or non-zero reserved bytes.
    pub fn decode(bytes: &[u8; STRIPE_HEADER_LEN]) -> Option<StripeHeader> {
        if bytes[..4] != STRIPE_MAGIC || bytes[4..8] != [0; 4] {
            return None;
        }
        let word = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(w)
        };
        Some(StripeHeader {
            transfer_id: word(8),
            offset: word(16),
            len: word(24),
        })
    }
}

/// What can go wrong on a lane.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MptError {
    /// No lanes were given.
    #[error("mpt channel has no lanes")]
    NoLanes,
    /// The two ends disagree on the number of lanes in use.
    #[error("mpt transfer {transfer_id} needs {needed} lanes but only {available} are open")]
    TooFewLanes {
        /// The transfer.
        transfer_id: u64,
        /// Lanes the transfer's stripes need.
        needed: usize,
        /// Lanes open.
        available: usize,
    },
    /// A socket call failed.
    #[error("mpt lane {lane} (peer {peer}): {action} failed: {source}")]
    Io {
        /// The lane index.
        lane: usize,
        /// The lane's peer address.
        peer: String,
        /// What was being done.
        action: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// A stripe header was not the one expected: the peer is out of step or not an mpt
    /// endpoint. The lane can no longer be trusted; the agent should re-create the pipe.
    #[error(
        "mpt lane {lane} (peer {peer}): expected the stripe {expected:?} of transfer \
         {transfer_id}, got {got}"
    )]
    UnexpectedStripe {
        /// The lane index.
        lane: usize,
        /// The lane's peer address.
        peer: String,
        /// The transfer expected.
        transfer_id: u64,
        /// `(offset, len)` expected.
        expected: (usize, usize),
        /// What arrived, described.
        got: String,
    },
    /// A lane's thread panicked (a bug, reported instead of propagated).
    #[error("mpt lane {lane} thread panicked")]
    Panicked {
        /// The lane index.
        lane: usize,
    },
}

/// One end of an mpt channel: its lanes, connected to the same peer in the same order on
/// both sides.
#[derive(Debug)]
pub struct MptChannel {
    lanes: Vec<TcpStream>,
    peers: Vec<String>,
    options: MptOptions,
}

impl MptChannel {
    /// An end over `lanes` (lane `i` here must be lane `i` at the peer). Sets
    /// `TCP_NODELAY` on each.
    ///
    /// # Errors
    /// [`MptError::NoLanes`] for an empty list; [`MptError::Io`] if a lane has no peer
    /// (it is not connected).
    pub fn new(lanes: Vec<TcpStream>, options: MptOptions) -> Result<MptChannel, MptError> {
        if lanes.is_empty() {
            return Err(MptError::NoLanes);
        }
        let mut peers = Vec::with_capacity(lanes.len());
        for (lane, stream) in lanes.iter().enumerate() {
            let peer = stream.peer_addr().map_err(|source| MptError::Io {
                lane,
                peer: "?".into(),
                action: "reading the peer address",
                source,
            })?;
            let peer = peer.to_string();
            if let Err(source) = stream.set_nodelay(true) {
                return Err(MptError::Io {
                    lane,
                    peer,
                    action: "setting TCP_NODELAY",
                    source,
                });
            }
            peers.push(peer);
        }
        Ok(MptChannel {
            lanes,
            peers,
            options,
        })
    }

    /// Number of lanes.
    pub fn lanes(&self) -> usize {
        self.lanes.len()
    }

    fn plan(&self, len: usize, transfer_id: u64) -> Result<Vec<(usize, usize)>, MptError> {
        let plan = stripes(len, self.lanes.len(), self.options.min_striped_len);
        if plan.len() > self.lanes.len() {
            return Err(MptError::TooFewLanes {
                transfer_id,
                needed: plan.len(),
                available: self.lanes.len(),
            });
        }
        Ok(plan)
    }

    /// Sends `data` as transfer `transfer_id`, each stripe on its lane in parallel.
    ///
    /// # Errors
    /// The first lane error, naming the lane.
    pub fn send(&mut self, transfer_id: u64, data: &[u8]) -> Result<(), MptError> {
        let plan = self.plan(data.len(), transfer_id)?;
        let peers = &self.peers;
        let work = self.lanes.iter_mut().zip(plan).enumerate();
        run_lanes(work, |lane, stream, (offset, len)| {
            let header = StripeHeader {
                transfer_id,
                offset: offset as u64,
                len: len as u64,
            };
            let io = |action| {
                move |source| MptError::Io {
                    lane,
                    peer: peers.get(lane).cloned().unwrap_or_default(),
                    action,
                    source,
                }
            };
            stream
                .write_all(&header.encode())
                .map_err(io("sending a stripe header"))?;
            let stripe = data.get(offset..offset + len).unwrap_or_default();
            stream.write_all(stripe).map_err(io("sending a stripe"))?;
            stream.flush().map_err(io("flushing a stripe"))
        })
    }

    /// Receives transfer `transfer_id` of `buf.len()` bytes into `buf`.
    ///
    /// # Errors
    /// The first lane error; [`MptError::UnexpectedStripe`] when a header is not the one
    /// this end expects (nothing is written outside that lane's stripe either way).
    pub fn recv(&mut self, transfer_id: u64, buf: &mut [u8]) -> Result<(), MptError> {
        let plan = self.plan(buf.len(), transfer_id)?;
        // Disjoint destination slices, one per used lane.
        let mut parts = Vec::with_capacity(plan.len());
        let mut rest = buf;
        for &(_, len) in &plan {
            let (part, tail) = rest.split_at_mut(len);
            parts.push(part);
            rest = tail;
        }
        let peers = &self.peers;
        let work = self
            .lanes
            .iter_mut()
            .zip(plan.into_iter().zip(parts))
            .enumerate();
        run_lanes(work, |lane, stream, ((offset, len), part)| {
            let peer = || peers.get(lane).cloned().unwrap_or_default();
            let mut raw = [0u8; STRIPE_HEADER_LEN];
            stream.read_exact(&mut raw).map_err(|source| MptError::Io {
                lane,
                peer: peer(),
                action: "receiving a stripe header",
                source,
            })?;
            let expected = StripeHeader {
                transfer_id,
                offset: offset as u64,
                len: len as u64,
            };
            match StripeHeader::decode(&raw) {
                Some(header) if header == expected => {}
                other => {
                    return Err(MptError::UnexpectedStripe {
                        lane,
                        peer: peer(),
                        transfer_id,
                        expected: (offset, len),
                        got: match other {
                            Some(h) => format!(
                                "transfer {} offset {} length {}",
                                h.transfer_id, h.offset, h.len
                            ),
                            None => "bytes that are no stripe header".into(),
                        },
                    })
                }
            }
            stream.read_exact(part).map_err(|source| MptError::Io {
                lane,
                peer: peer(),
                action: "receiving a stripe",
                source,
            })
        })
    }
}

/// Runs `f` for every lane of `work` on its own scoped thread (lane 0 on this one) and
/// returns the first error.
fn run_lanes<'s, T: Send>(
    work: impl Iterator<Item = (usize, (&'s mut TcpStream, T))>,
    f: impl Fn(usize, &mut TcpStream, T) -> Result<(), MptError> + Sync,
) -> Result<(), MptError> {
    let mut work: Vec<(usize, (&mut TcpStream, T))> = work.collect();
    let first = if work.is_empty() {
        None
    } else {
        Some(work.remove(0))
    };
    let f = &f;
    std::thread::scope(|scope| {
        let handles: Vec<_> = work
            .into_iter()
            .map(|(lane, (stream, item))| (lane, scope.spawn(move || f(lane, stream, item))))
            .collect();
        let mut result = match first {
            Some((lane, (stream, item))) => f(lane, stream, item),
            None => Ok(()),
        };
        for (lane, handle) in handles {
            let lane_result = handle.join().unwrap_or(Err(MptError::Panicked { lane }));
            if result.is_ok() {
                result = lane_result;
            }
        }
        result
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::net::TcpListener;

    #[test]
    fn stripes_cover_the_tensor_once() {
        assert_eq!(stripes(0, 4, 1), vec![(0, 0)]);
        assert_eq!(stripes(10, 4, 1), vec![(0, 3), (3, 3), (6, 2), (8, 2)]);
        assert_eq!(stripes(3, 4, 1), vec![(0, 1), (1, 1), (2, 1)]);
        assert_eq!(stripes(100, 4, 1000), vec![(0, 100)]);
    }

    proptest! {
        #[test]
        fn stripes_partition(len in 0usize..1_000_000, lanes in 1usize..16, min in 0usize..10_000) {
            let plan = stripes(len, lanes, min);
            prop_assert!(!plan.is_empty() && plan.len() <= lanes);
            let mut next = 0;
            for (offset, n) in &plan {
                prop_assert_eq!(*offset, next);
                next += n;
            }
            prop_assert_eq!(next, len);
        }

        #[test]
        fn headers_round_trip(id in any::<u64>(), offset in any::<u64>(), len in any::<u64>()) {
            let h = StripeHeader { transfer_id: id, offset, len };
            prop_assert_eq!(StripeHeader::decode(&h.encode()), Some(h));
        }
    }

    #[test]
    fn garbage_is_no_header() {
        assert_eq!(StripeHeader::decode(&[0u8; STRIPE_HEADER_LEN]), None);
        let mut raw = StripeHeader {
            transfer_id: 1,
            offset: 0,
            len: 1,
        }
        .encode();
        raw[5] = 1;
        assert_eq!(StripeHeader::decode(&raw), None);
    }

    fn pair(lanes: usize) -> (MptChannel, MptChannel) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut near = Vec::new();
        let mut far = Vec::new();
        for _ in 0..lanes {
            near.push(TcpStream::connect(addr).unwrap());
            far.push(listener.accept().unwrap().0);
        }
        let options = MptOptions {
            min_striped_len: 1024,
        };
        (
            MptChannel::new(near, options).unwrap(),
            MptChannel::new(far, options).unwrap(),
        )
    }

    #[test]
    fn moves_bytes_over_four_lanes() {
        let (mut a, mut b) = pair(4);
        for (id, len) in [(1u64, 0usize), (2, 1), (3, 5000), (4, 1 << 20)] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
            let mut got = vec![0u8; len];
            std::thread::scope(|s| {
                let sender = s.spawn(|| a.send(id, &data));
                b.recv(id, &mut got).unwrap();
                sender.join().unwrap().unwrap();
            });
            assert_eq!(got, data, "{len} bytes");
        }
    }

    #[test]
    fn a_stripe_of_another_transfer_is_refused() {
        let (mut a, mut b) = pair(2);
        let data = vec![9u8; 4096];
        let mut got = vec![0u8; 4096];
        std::thread::scope(|s| {
            let sender = s.spawn(|| a.send(7, &data));
            let err = b.recv(8, &mut got).unwrap_err();
            assert!(
                matches!(err, MptError::UnexpectedStripe { transfer_id: 8, .. }),
                "{err}"
            );
            let _ = sender.join();
        });
        assert!(got.iter().all(|&b| b == 0), "nothing was written");
    }

    #[test]
    fn a_closed_lane_names_itself() {
        let (a, mut b) = pair(2);
        drop(a);
        let mut got = vec![0u8; 4096];
        let err = b.recv(1, &mut got).unwrap_err().to_string();
        assert!(err.starts_with("mpt lane "), "{err}");
        assert!(err.contains("receiving a stripe header"), "{err}");
        assert!(matches!(
            MptChannel::new(Vec::new(), MptOptions::default()),
            Err(MptError::NoLanes)
        ));
    }
}
