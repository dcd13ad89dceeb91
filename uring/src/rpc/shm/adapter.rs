//! The adapter threads that serve an shm connection's halves on the I/O executor during
//! the handshake: each half is driven by a thread of its own that hands frames to and
//! from the executor through a [`Queue`] (whose wake-ups come from any thread).
//!
//! - The sending half is a thread that encodes each [`OwnedFrame`] into one shm message
//!   and sends it; [`FrameSender::send`] resolves as soon as the thread owns the frame
//!   (the frame is moved, so the caller's buffers are free), and a failure of the thread
//!   is reported by the next send.
//! - The receiving half is a thread that receives whole messages into a bounded queue;
//!   [`FrameReceiver::recv`] decodes each with the core's decoder and the caller's
//!   [`FrameLimits`].
//!
//! [`FrameSender::into_blocking`] takes both halves back from their threads (with what
//! the receiving thread had queued) for the lane ([`super::blocking`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rdzv_core::rpc::frame::FrameLimits;

use super::decode::decode_message;
use super::{blocking, RECEIVE_POLL, RECEIVE_QUEUE};
use crate::queue::Queue;
use crate::rpc::error::TransportError;
use crate::rpc::recycle;
use crate::rpc::transport::{
    FrameReceiver, FrameSender, IncomingFrame, IntoBlocking, LocalBoxFuture, NotBlocking,
    OwnedFrame,
};
use crate::transport::shm::{ShmError, ShmReceiver, ShmSender};

/// What the sending thread reports when it stops: its half, or why it failed.
type SendOutcome = Result<ShmSender, ShmError>;

pub(super) struct ShmFrameSender {
    frames: Arc<Queue<OwnedFrame>>,
    /// Holds the thread's error (or its clean end) once it stopped.
    outcome: Arc<Queue<SendOutcome>>,
    peer: Arc<str>,
}

impl ShmFrameSender {
    pub(super) fn start(sender: ShmSender, peer: Arc<str>) -> ShmFrameSender {
        let frames = Arc::new(Queue::new(usize::MAX));
        let outcome = Arc::new(Queue::new(1));
        let (thread_frames, thread_outcome) = (Arc::clone(&frames), Arc::clone(&outcome));
        let spawned = std::thread::Builder::new()
            .name("rdzv-shm-send".into())
            .spawn(move || {
                let result = send_thread(sender, &thread_frames);
                thread_frames.close();
                let _ = thread_outcome.push(result);
                thread_outcome.close();
            });
        if let Err(e) = spawned {
            frames.close();
            let _ = outcome.push(Err(ShmError::Syscall {
                op: "spawn an shm sending thread",
                source: e,
            }));
            outcome.close();
        }
        ShmFrameSender {
            frames,
            outcome,
            peer,
        }
    }

    fn stopped(&self) -> TransportError {
        let reason = match self.outcome.try_pop() {
            Some(Err(e)) => e.to_string(),
            _ => "the pipe is closed".to_string(),
        };
        TransportError::Io {
            op: "send to",
            peer: self.peer.to_string(),
            source: std::io::Error::new(std::io::ErrorKind::BrokenPipe, reason),
        }
    }
}

fn send_thread(mut sender: ShmSender, frames: &Queue<OwnedFrame>) -> SendOutcome {
    let mut buf = Vec::new();
    while let Some(frame) = frames.pop_blocking() {
        send_frame(&mut sender, &frame, &mut buf)?;
        recycle::give_all(frame.tensor_data);
    }
    Ok(sender)
}

/// Encodes `frame` into `buf` and sends it as one shm message.
pub(super) fn send_frame(
    sender: &mut ShmSender,
    frame: &OwnedFrame,
    buf: &mut Vec<u8>,
) -> Result<(), ShmError> {
    let head = frame.encode_head().map_err(|e| ShmError::Handshake {
        detail: format!("cannot encode a frame: {e}"),
    })?;
    buf.clear();
    buf.reserve(frame.encoded_len());
    buf.extend_from_slice(&head);
    for part in frame.body() {
        buf.extend_from_slice(part);
    }
    sender.send(buf)?;
    if buf.capacity() > (1 << 20) {
        *buf = Vec::new();
    }
    Ok(())
}

impl FrameSender for ShmFrameSender {
    fn send(&mut self, frame: OwnedFrame) -> LocalBoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(async move {
            // Refuse a frame the core would not decode here, with the frame's error.
            if let Err(source) = frame.encode_head() {
                return Err(TransportError::Encode {
                    peer: self.peer.to_string(),
                    source,
                });
            }
            let len = frame.encoded_len() as u64;
            match self.frames.push(frame) {
                Ok(()) => Ok(len),
                Err(_) => Err(self.stopped()),
            }
        })
    }

    fn close(&mut self) -> LocalBoxFuture<'_, ()> {
        Box::pin(async move {
            self.frames.close();
            // Wait until the queued frames are in the peer's ring.
            if let Some(Err(e)) = self.outcome.pop().await {
                tracing::debug!(peer = %self.peer, error = %e, "an shm pipe's sender failed");
            }
        })
    }

    fn into_blocking(
        self: Box<Self>,
        receiver: Box<dyn FrameReceiver>,
    ) -> LocalBoxFuture<'static, IntoBlocking> {
        Box::pin(async move {
            let peer = Arc::clone(&self.peer);
            let failed = |reason: String| {
                NotBlocking::Failed(TransportError::Io {
                    op: "take off the executor the shm pipe to",
                    peer: peer.to_string(),
                    source: std::io::Error::other(reason),
                })
            };
            let receiver = receiver
                .into_any()
                .downcast::<ShmFrameReceiver>()
                .map_err(|_| failed("the halves belong to different transports".into()))?;
            // Both threads hand their halves back: the sender once its queue is sent.
            self.frames.close();
            let sender = match self.outcome.pop().await {
                Some(Ok(sender)) => sender,
                Some(Err(e)) => return Err(failed(e.to_string())),
                None => return Err(failed("the sending thread stopped".into())),
            };
            let (shm_receiver, leftover) = receiver.hand_back().await.map_err(failed)?;
            blocking::thread_halves(sender, shm_receiver, leftover, peer.clone())
                .map_err(NotBlocking::Failed)
        })
    }
}

impl Drop for ShmFrameSender {
    fn drop(&mut self) {
        // The thread sends what is queued, then drops its half (the peer sees the close).
        self.frames.close();
    }
}

/// What the receiving thread hands over: a whole message, or why it stopped.
pub(super) type Received = Result<Vec<u8>, ShmError>;

pub(super) struct ShmFrameReceiver {
    messages: Arc<Queue<Received>>,
    /// Where the thread puts its half back when asked to (by closing `messages` with
    /// `hand_back` set).
    handed_back: Arc<Queue<ShmReceiver>>,
    hand_back: Arc<AtomicBool>,
    peer: Arc<str>,
    ended: bool,
}

impl ShmFrameReceiver {
    pub(super) fn start(receiver: ShmReceiver, peer: Arc<str>) -> ShmFrameReceiver {
        let messages = Arc::new(Queue::new(RECEIVE_QUEUE));
        let handed_back = Arc::new(Queue::new(1));
        let hand_back = Arc::new(AtomicBool::new(false));
        let thread_messages = Arc::clone(&messages);
        let thread_handed_back = Arc::clone(&handed_back);
        let thread_hand_back = Arc::clone(&hand_back);
        let spawned = std::thread::Builder::new()
            .name("rdzv-shm-recv".into())
            .spawn(move || {
                if let Some(receiver) =
                    receive_thread(receiver, &thread_messages, &thread_hand_back)
                {
                    let _ = thread_handed_back.push(receiver);
                }
                thread_handed_back.close();
            });
        if let Err(e) = spawned {
            let _ = messages.push(Err(ShmError::Syscall {
                op: "spawn an shm receiving thread",
                source: e,
            }));
            messages.close();
            handed_back.close();
        }
        ShmFrameReceiver {
            messages,
            handed_back,
            hand_back,
            peer,
            ended: false,
        }
    }

    /// Stops the thread and takes its half back, with the messages it had received.
    async fn hand_back(self: Box<Self>) -> Result<(ShmReceiver, VecDeque<Received>), String> {
        self.hand_back.store(true, Ordering::Release);
        let receiver = self.handed_back.pop().await;
        let mut leftover = VecDeque::new();
        while let Some(received) = self.messages.try_pop() {
            leftover.push_back(received);
        }
        receiver
            .map(|r| (r, leftover))
            .ok_or_else(|| "the receiving thread stopped".to_string())
    }
}

/// Receives into `messages` until it is closed (the half is dropped: `None`) or
/// `hand_back` is set (the half is returned), checking both every [`RECEIVE_POLL`].
fn receive_thread(
    mut receiver: ShmReceiver,
    messages: &Queue<Received>,
    hand_back: &AtomicBool,
) -> Option<ShmReceiver> {
    loop {
        if hand_back.load(Ordering::Acquire) {
            return Some(receiver);
        }
        let received = match receiver.recv_timeout(RECEIVE_POLL) {
            Err(ShmError::Timeout { .. }) => {
                if messages.is_closed() {
                    return None;
                }
                continue;
            }
            other => other,
        };
        let last = received.is_err();
        if queue(messages, received, hand_back).is_err() || last {
            messages.close();
            return None;
        }
    }
}

/// Queues `received`, waiting while the queue holds [`RECEIVE_QUEUE`] messages, but not
/// once `hand_back` is set: the executor drains the queue only after the half is back,
/// so waiting for room then would never end (a burst of requests right after the
/// handshake filled it). Past the bound, the message joins what is handed over.
fn queue(
    messages: &Queue<Received>,
    received: Received,
    hand_back: &AtomicBool,
) -> Result<(), Received> {
    while messages.len() >= RECEIVE_QUEUE && !hand_back.load(Ordering::Acquire) {
        if messages.is_closed() {
            return Err(received);
        }
        std::thread::sleep(FULL_POLL);
    }
    messages.push(received)
}

/// How often a receiving thread facing a full queue looks for room or a hand-back.
const FULL_POLL: std::time::Duration = std::time::Duration::from_millis(1);

impl FrameReceiver for ShmFrameReceiver {
    fn recv(
        &mut self,
        limits: FrameLimits,
    ) -> LocalBoxFuture<'_, Result<Option<IncomingFrame>, TransportError>> {
        Box::pin(async move {
            if self.ended {
                return Ok(None);
            }
            let received = match self.messages.pop().await {
                Some(received) => received,
                None => {
                    self.ended = true;
                    return Ok(None);
                }
            };
            let decoded = decode_message(received, limits, &self.peer);
            if !matches!(decoded, Ok(Some(_))) {
                self.ended = true;
            }
            decoded
        })
    }

    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any> {
        self
    }
}

impl Drop for ShmFrameReceiver {
    fn drop(&mut self) {
        // The thread sees it within `RECEIVE_POLL` and drops its half.
        self.messages.close();
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use rdzv_core::rpc::frame::FrameKind;

    use super::super::ShmTransport;
    use super::*;
    use crate::rpc::transport::{LocalExecutor, Transport};

    /// A burst larger than the receiving queue arrives between the handshake and the
    /// hand-over (a caller's first calls on a pipe the peer has not taken off its
    /// executor yet): the half still comes back, with every message, in order.
    #[test]
    fn a_full_queue_does_not_stop_the_hand_over() {
        const BURST: u64 = RECEIVE_QUEUE as u64 + 36;
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let outcome = LocalExecutor::new()
                .map_err(|e| e.to_string())
                .and_then(|executor| {
                    executor.run(async {
                        let transport = ShmTransport::new().map_err(|e| e.to_string())?;
                        let listener = transport.listen().map_err(|e| e.to_string())?;
                        let address = listener.address().to_string();
                        let (client, server) = futures_lite::future::zip(
                            transport.connect(&address),
                            listener.accept(),
                        )
                        .await;
                        let (mut tx, _client_rx) = client.map_err(|e| e.to_string())?.split();
                        let (server_tx, rx) = server.map_err(|e| e.to_string())?.split();
                        for id in 1..=BURST {
                            tx.send(OwnedFrame::empty(FrameKind::Request, id))
                                .await
                                .map_err(|e| e.to_string())?;
                        }
                        // Until the receiving thread waits for room.
                        let rx = rx
                            .into_any()
                            .downcast::<ShmFrameReceiver>()
                            .map_err(|_| "not an shm receiver")?;
                        let deadline = Instant::now() + Duration::from_secs(10);
                        while rx.messages.len() < RECEIVE_QUEUE {
                            if Instant::now() > deadline {
                                return Err("the receiving queue never filled".to_string());
                            }
                            std::thread::yield_now();
                        }
                        let halves = match server_tx.into_blocking(rx).await {
                            Ok(halves) => halves,
                            Err(NotBlocking::Failed(e)) => return Err(e.to_string()),
                            Err(NotBlocking::Unsupported(..)) => {
                                return Err("shm halves refused to block".into())
                            }
                        };
                        let mut receiver = halves.receiver;
                        for id in 1..=BURST {
                            let frame = receiver
                                .recv(FrameLimits::DEFAULT)
                                .map_err(|e| e.to_string())?
                                .ok_or("early end")?;
                            if frame.message_id != id {
                                return Err(format!("got {} for {id}", frame.message_id));
                            }
                        }
                        Ok::<(), String>(())
                    })
                });
            let _ = done_tx.send(outcome);
        });
        let outcome = done_rx
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| Err("the hand-over hangs".to_string()));
        assert_eq!(outcome, Ok(()));
    }
}
