//! When buffers lent to the peer come back: the rule both the executor's pipes and the
//! thread-served lanes of `rdzv-uring` follow.
//!
//! A frame whose tensors travel out of band over a *pulling* channel (`cma`, `xth`, and
//! for device memory `cuda_xth`, `cuda_ipc`, `cuda_gdr`: the receiver reads the sender's
//! buffer) lends those buffers to the peer. The sender keeps
//! them unchanged until the peer says it is done:
//!
//! - a **request**'s buffers come back with its reply (a `Response` or `Error` frame for
//!   the same message id): the callee read them before it answered;
//! - a **response**'s buffers come back with the caller's `Ack` frame for that message
//!   id, which the caller sends once it has read them, or at once if it will not (an
//!   error frame, a reply nobody waits for, a late reply: [`must_ack`]);
//! - when the **pipe ends**, every buffer still lent is given up without being reused:
//!   a peer that is still reading must fail, not read something else.
//!
//! `basic` tensors travel in the frame and `mpt` tensors are pushed right after it, so
//! neither lends anything ([`lends`]).
//!
//! [`Ledger`] keeps one pipe's (or one side's) lent buffers by message id and applies
//! the rule to each frame that arrives.

use alloc::collections::BTreeMap;
use alloc::vec::Vec;

use crate::negotiate::ChannelKind;
use crate::rpc::frame::{FrameKind, TensorDescriptor};

/// Which frame lent buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lender {
    /// A request: its reply gives the buffers back.
    Request,
    /// A response: the caller's `Ack` gives them back.
    Response,
}

impl Lender {
    /// The lender whose buffers a frame of `kind` gives back, if any.
    pub const fn released_by(kind: FrameKind) -> Option<Lender> {
        match kind {
            FrameKind::Response | FrameKind::Error => Some(Lender::Request),
            FrameKind::Ack => Some(Lender::Response),
            _ => None,
        }
    }
}

/// Whether a tensor sent over `channel` out of band lends its buffer to the peer (the
/// peer pulls it), as opposed to travelling in or right after the frame.
pub const fn lends(channel: ChannelKind) -> bool {
    !matches!(channel, ChannelKind::Basic | ChannelKind::Mpt)
}

/// Whether `channel` lends *device* memory: the sender's device runtime lends the
/// tensor's memory and the receiver's copies it device to device (`cuda_xth`,
/// `cuda_ipc`, `cuda_gdr`). `cuda_basic` lends nothing of its own: its staged host copy
/// travels over a CPU channel, which may lend it.
pub const fn lends_device_memory(channel: ChannelKind) -> bool {
    matches!(
        channel,
        ChannelKind::CudaXth | ChannelKind::CudaIpc | ChannelKind::CudaGdr
    )
}

/// Whether the receiver of a frame of `kind` with these tensor descriptors must answer
/// with an `Ack`: a reply (response or error) that lent buffers. It must, whatever it
/// does with the reply, so that the sender gets them back.
pub fn must_ack<'a>(
    kind: FrameKind,
    tensors: impl IntoIterator<Item = &'a TensorDescriptor>,
) -> bool {
    Lender::released_by(kind) == Some(Lender::Request)
        && tensors.into_iter().any(|t| lends(t.channel))
}

/// Buffers lent to the peer, by message id.
#[derive(Debug)]
pub struct Ledger<T> {
    lent: BTreeMap<u64, (Lender, T)>,
}

impl<T> Default for Ledger<T> {
    fn default() -> Self {
        Ledger {
            lent: BTreeMap::new(),
        }
    }
}

impl<T> Ledger<T> {
    /// An empty ledger.
    pub fn new() -> Ledger<T> {
        Ledger::default()
    }

    /// Records that the `lender` frame `message_id` lent `buffers`. A message id lends
    /// once; if it was already lending, the earlier buffers come back (to be given up).
    pub fn lend(&mut self, lender: Lender, message_id: u64, buffers: T) -> Option<T> {
        self.lent
            .insert(message_id, (lender, buffers))
            .map(|(_, earlier)| earlier)
    }

    /// A frame of `kind` for `message_id` arrived: the buffers it gives back, to be
    /// reused. `None` when it gives nothing back (another kind of frame, nothing lent
    /// under that id, or lent by the other kind of frame).
    pub fn release(&mut self, kind: FrameKind, message_id: u64) -> Option<T> {
        self.release_if(kind, message_id, |_| true)
    }

    /// As [`release`](Self::release), but only if `owned` says the buffers are the
    /// ones this frame answers (e.g. lent on the pipe it came on).
    pub fn release_if(
        &mut self,
        kind: FrameKind,
        message_id: u64,
        owned: impl FnOnce(&T) -> bool,
    ) -> Option<T> {
        let lender = Lender::released_by(kind)?;
        match self.lent.get(&message_id) {
            Some((lent_by, buffers)) if *lent_by == lender && owned(buffers) => {
                self.lent.remove(&message_id).map(|(_, buffers)| buffers)
            }
            _ => None,
        }
    }

    /// The pipe ended: every buffer still lent, to be given up (never reused).
    pub fn end(&mut self) -> Vec<T> {
        core::mem::take(&mut self.lent)
            .into_values()
            .map(|(_, buffers)| buffers)
            .collect()
    }

    /// Gives up the buffers for which `ended` is true (lent on a pipe that ended) and
    /// returns them.
    pub fn end_where(&mut self, mut ended: impl FnMut(&T) -> bool) -> Vec<T> {
        let ids: Vec<u64> = self
            .lent
            .iter()
            .filter(|(_, (_, buffers))| ended(buffers))
            .map(|(&id, _)| id)
            .collect();
        ids.into_iter()
            .filter_map(|id| self.lent.remove(&id).map(|(_, buffers)| buffers))
            .collect()
    }

    /// Whether `message_id` is lending.
    pub fn is_lending(&self, message_id: u64) -> bool {
        self.lent.contains_key(&message_id)
    }

    /// How many frames are lending.
    pub fn len(&self) -> usize {
        self.lent.len()
    }

    /// Whether nothing is lent.
    pub fn is_empty(&self) -> bool {
        self.lent.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use proptest::prelude::*;

    fn tensor(channel: ChannelKind) -> TensorDescriptor {
        TensorDescriptor {
            channel,
            ..TensorDescriptor::inline(Device::CPU, Device::CPU, 10)
        }
    }

    #[test]
    fn replies_release_requests_and_acks_release_responses() {
        let mut ledger = Ledger::new();
        assert_eq!(ledger.lend(Lender::Request, 1, "req1"), None);
        assert_eq!(ledger.lend(Lender::Response, 2, "resp2"), None);
        // The wrong kind of frame gives nothing back.
        assert_eq!(ledger.release(FrameKind::Ack, 1), None);
        assert_eq!(ledger.release(FrameKind::Response, 2), None);
        assert_eq!(ledger.release(FrameKind::Request, 1), None);
        assert_eq!(ledger.release(FrameKind::Goodbye, 1), None);
        assert_eq!(ledger.len(), 2);
        // The right one does, once.
        assert_eq!(ledger.release(FrameKind::Error, 1), Some("req1"));
        assert_eq!(ledger.release(FrameKind::Response, 1), None);
        assert_eq!(ledger.release_if(FrameKind::Ack, 2, |_| false), None);
        assert_eq!(ledger.release(FrameKind::Ack, 2), Some("resp2"));
        assert!(ledger.is_empty());
    }

    #[test]
    fn an_ended_pipe_gives_up_what_it_lent() {
        let mut ledger = Ledger::new();
        ledger.lend(Lender::Request, 1, (7, "a"));
        ledger.lend(Lender::Request, 2, (8, "b"));
        ledger.lend(Lender::Response, 3, (7, "c"));
        assert_eq!(ledger.lend(Lender::Request, 2, (8, "b2")), Some((8, "b")));
        let mut gone = ledger.end_where(|&(pipe, _)| pipe == 7);
        gone.sort();
        assert_eq!(gone, [(7, "a"), (7, "c")]);
        assert_eq!(ledger.end(), [(8, "b2")]);
        assert!(ledger.is_empty());
    }

    #[test]
    fn only_pulled_channels_lend_and_only_lending_replies_are_acked() {
        assert!(lends(ChannelKind::Cma) && lends(ChannelKind::Xth));
        assert!(lends(ChannelKind::CudaIpc));
        assert!(!lends(ChannelKind::Basic) && !lends(ChannelKind::Mpt));
        // Device memory is lent exactly by the lending channels that serve CUDA memory
        // only (cuda_basic also serves the CPU side: it stages).
        for kind in ChannelKind::ALL {
            let cuda_only = kind.device_types() == [crate::device::DeviceType::Cuda];
            assert_eq!(
                lends_device_memory(kind),
                lends(kind) && cuda_only,
                "{kind}"
            );
        }
        assert!(!lends_device_memory(ChannelKind::CudaBasic));
        let cma = [tensor(ChannelKind::Basic), tensor(ChannelKind::Cma)];
        let streamed = [tensor(ChannelKind::Mpt), tensor(ChannelKind::Basic)];
        assert!(must_ack(FrameKind::Response, &cma));
        assert!(must_ack(FrameKind::Error, &cma));
        assert!(!must_ack(FrameKind::Request, &cma));
        assert!(!must_ack(FrameKind::Response, &streamed));
        assert!(!must_ack(FrameKind::Response, &[]));
    }

    proptest! {
        /// Whatever the order of frames, each lent entry comes back at most once, and
        /// only through the frame kind that answers its lender.
        #[test]
        fn each_lend_comes_back_at_most_once(
            lends in proptest::collection::vec((any::<bool>(), 0u64..8), 0..16),
            frames in proptest::collection::vec((0usize..6, 0u64..8), 0..64),
        ) {
            let kinds = [
                FrameKind::Request,
                FrameKind::Response,
                FrameKind::Error,
                FrameKind::Ack,
                FrameKind::Goodbye,
                FrameKind::Handshake,
            ];
            let mut ledger = Ledger::new();
            let mut expected: BTreeMap<u64, Lender> = BTreeMap::new();
            for (request, id) in lends {
                let lender = if request { Lender::Request } else { Lender::Response };
                ledger.lend(lender, id, (lender, id));
                expected.insert(id, lender);
            }
            for (k, id) in frames {
                let kind = kinds[k];
                match ledger.release(kind, id) {
                    Some((lender, got)) => {
                        prop_assert_eq!(got, id);
                        prop_assert_eq!(Lender::released_by(kind), Some(lender));
                        prop_assert_eq!(expected.remove(&id), Some(lender));
                    }
                    None => prop_assert!(
                        expected.get(&id).copied() != Lender::released_by(kind)
                            || !expected.contains_key(&id)
                    ),
                }
            }
            prop_assert_eq!(ledger.len(), expected.len());
        }
    }
}
