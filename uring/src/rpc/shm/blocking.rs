//! An shm pipe served by threads (a lane): both halves taken back from the adapter
//! threads; blocking sends, polling of the ring by a waiting caller ([`TryRecv`]), and a
//! [`Wake`] on the data eventfd and the control socket (whose end means the peer process
//! is gone) for the lane's reader thread.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdzv_core::rpc::frame::FrameLimits;

use super::adapter::{send_frame, Received};
use super::decode::decode_message;
use super::{shm_io, RECEIVE_POLL};
use crate::rpc::error::TransportError;
use crate::rpc::transport::{
    poll_two, BlockingHalves, BlockingReceiver, BlockingSender, IncomingFrame, OwnedFrame,
    StopConnection, TryRecv, Wake,
};
use crate::transport::shm::{ShmError, ShmReceiver, ShmSender};

/// The halves of a pipe whose adapter threads handed `sender` and `receiver` back, with
/// the messages the receiving thread had queued (`leftover`).
pub(super) fn thread_halves(
    sender: ShmSender,
    receiver: ShmReceiver,
    leftover: VecDeque<Received>,
    peer: Arc<str>,
) -> Result<BlockingHalves, TransportError> {
    let duplicate = |op: &'static str| {
        let peer = peer.to_string();
        move |source| TransportError::Io { op, peer, source }
    };
    let control = sender
        .control_fd()
        .try_clone_to_owned()
        .map_err(duplicate("duplicate the control socket of the shm pipe to"))?;
    let stopped = Arc::new(AtomicBool::new(false));
    let wake = ShmWake {
        data: receiver
            .data_event_fd()
            .try_clone_to_owned()
            .map_err(duplicate("duplicate the data eventfd of the shm pipe to"))?,
        control: receiver
            .control_fd()
            .try_clone_to_owned()
            .map_err(duplicate("duplicate the control socket of the shm pipe to"))?,
    };
    Ok(BlockingHalves {
        sender: Box::new(ShmThreadSender {
            sender,
            buf: Vec::new(),
            peer: Arc::clone(&peer),
        }),
        receiver: Box::new(ShmThreadReceiver {
            receiver,
            leftover,
            peer,
            stopped: Arc::clone(&stopped),
            ended: false,
        }),
        stop: Arc::new(ShmStop { control, stopped }),
        wake: Some(Arc::new(wake)),
    })
}

/// The sending half of a thread-served shm pipe.
struct ShmThreadSender {
    sender: ShmSender,
    buf: Vec<u8>,
    peer: Arc<str>,
}

impl BlockingSender for ShmThreadSender {
    fn send(&mut self, frame: &OwnedFrame) -> Result<u64, TransportError> {
        send_frame(&mut self.sender, frame, &mut self.buf).map_err(|e| TransportError::Io {
            op: "send to",
            peer: self.peer.to_string(),
            source: shm_io(e),
        })?;
        Ok(frame.encoded_len() as u64)
    }
}

/// The receiving half of a thread-served shm pipe: first what the adapter thread had
/// received, then the ring.
struct ShmThreadReceiver {
    receiver: ShmReceiver,
    leftover: VecDeque<Received>,
    peer: Arc<str>,
    stopped: Arc<AtomicBool>,
    ended: bool,
}

impl BlockingReceiver for ShmThreadReceiver {
    fn try_recv(&mut self, limits: FrameLimits) -> Result<TryRecv, TransportError> {
        if self.ended {
            return Ok(TryRecv::Closed);
        }
        let received = match self.leftover.pop_front() {
            Some(received) => received,
            None => match self.receiver.try_recv() {
                Ok(Some(message)) => Ok(message),
                Ok(None) if self.stopped.load(Ordering::Acquire) => {
                    self.ended = true;
                    return Ok(TryRecv::Closed);
                }
                Ok(None) => return Ok(TryRecv::Empty),
                Err(e) => Err(e),
            },
        };
        match decode_message(received, limits, &self.peer) {
            Ok(Some(frame)) => Ok(TryRecv::Frame(frame)),
            Ok(None) => {
                self.ended = true;
                Ok(TryRecv::Closed)
            }
            Err(e) => {
                self.ended = true;
                Err(e)
            }
        }
    }

    fn arm(&mut self) -> Result<bool, TransportError> {
        if self.ended || !self.leftover.is_empty() || self.stopped.load(Ordering::Acquire) {
            return Ok(false);
        }
        self.receiver
            .arm_wakeup()
            .map_err(|e| self.message_error(e))
    }

    fn disarm(&mut self) {
        // Draining fails only on a broken eventfd; the next receive reports the pipe.
        let _ = self.receiver.disarm_wakeup();
    }

    fn withdraw(&mut self) {
        self.receiver.withdraw_wakeup();
    }

    fn recv(&mut self, limits: FrameLimits) -> Result<Option<IncomingFrame>, TransportError> {
        if self.ended {
            return Ok(None);
        }
        let received = match self.leftover.pop_front() {
            Some(received) => received,
            None => loop {
                if self.stopped.load(Ordering::Acquire) {
                    self.ended = true;
                    return Ok(None);
                }
                match self.receiver.recv_timeout(RECEIVE_POLL) {
                    Err(ShmError::Timeout { .. }) => continue,
                    other => break other,
                }
            },
        };
        let decoded = decode_message(received, limits, &self.peer);
        if !matches!(decoded, Ok(Some(_))) {
            self.ended = true;
        }
        decoded
    }
}

impl ShmThreadReceiver {
    fn message_error(&self, error: ShmError) -> TransportError {
        TransportError::Io {
            op: "receive from",
            peer: self.peer.to_string(),
            source: shm_io(error),
        }
    }
}

/// Sleeps on a thread-served shm pipe's data eventfd and control socket.
struct ShmWake {
    data: std::os::fd::OwnedFd,
    control: std::os::fd::OwnedFd,
}

impl Wake for ShmWake {
    fn wait(&self, timeout: Duration) -> bool {
        use std::os::fd::AsFd;
        let [_, control] = poll_two(self.data.as_fd(), self.control.as_fd(), timeout);
        // Nothing is ever sent on the control socket: readable means its end.
        control.intersects(
            rustix::event::PollFlags::IN
                | rustix::event::PollFlags::HUP
                | rustix::event::PollFlags::ERR,
        )
    }

    fn kick(&self) {
        // Fails only when the counter would overflow: it is signalled then anyway.
        let _ = rustix::io::write(&self.data, &1u64.to_ne_bytes());
    }
}

/// Stops a thread-served shm pipe: the control socket is shut down (the peer sees the
/// close) and the receiver sees the flag within [`RECEIVE_POLL`].
struct ShmStop {
    control: std::os::fd::OwnedFd,
    stopped: Arc<AtomicBool>,
}

impl StopConnection for ShmStop {
    fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        // Fails only on a socket already shut down.
        let _ = rustix::net::shutdown(&self.control, rustix::net::Shutdown::Both);
    }
}
