//! An shm pipe served by threads: blocking sends, polling of the ring by a waiting
//! caller ([`TryRecv`]), and a [`Control`] on the data eventfd and the control socket
//! (whose end means the peer process is gone) for the reader thread's sleep and for
//! stopping the pipe.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdzv_core::rpc::frame::FrameLimits;

use super::decode::{decode_message, shm_io};
use crate::rpc::error::TransportError;
use crate::rpc::transport::{
    poll_two, Connection, Control, FrameReceiver, FrameSender, IncomingFrame, OwnedFrame, TryRecv,
};
use crate::shm::{ShmConnection, ShmError, ShmReceiver, ShmSender};

/// How often a blocked receiving thread checks whether its pipe was stopped.
const RECEIVE_POLL: Duration = Duration::from_millis(10);

/// An shm connection as a connection served by threads.
pub(super) fn connection(
    connection: ShmConnection,
    peer: String,
) -> Result<Connection, TransportError> {
    let (sender, receiver) = connection.split();
    let duplicate = |op: &'static str| {
        let peer = peer.clone();
        move |source| TransportError::Io { op, peer, source }
    };
    let control = ShmControl {
        socket: sender
            .control_fd()
            .try_clone_to_owned()
            .map_err(duplicate("duplicate the control socket of the shm pipe to"))?,
        data: receiver
            .data_event_fd()
            .try_clone_to_owned()
            .map_err(duplicate("duplicate the data eventfd of the shm pipe to"))?,
        peer_end: receiver
            .control_fd()
            .try_clone_to_owned()
            .map_err(duplicate("duplicate the control socket of the shm pipe to"))?,
        stopped: Arc::new(AtomicBool::new(false)),
    };
    let shared: Arc<str> = Arc::from(peer.as_str());
    Ok(Connection {
        sender: Box::new(ShmThreadSender {
            sender,
            buf: Vec::new(),
            peer: Arc::clone(&shared),
        }),
        receiver: Box::new(ShmThreadReceiver {
            receiver,
            peer: shared,
            stopped: Arc::clone(&control.stopped),
            ended: false,
        }),
        control: Arc::new(control),
        peer,
    })
}

/// Encodes `frame` into `buf` and sends it as one shm message.
fn send_frame(
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

/// The sending half of a thread-served shm pipe.
struct ShmThreadSender {
    sender: ShmSender,
    buf: Vec<u8>,
    peer: Arc<str>,
}

impl FrameSender for ShmThreadSender {
    fn send(&mut self, frame: &OwnedFrame) -> Result<u64, TransportError> {
        send_frame(&mut self.sender, frame, &mut self.buf).map_err(|e| TransportError::Io {
            op: "send to",
            peer: self.peer.to_string(),
            source: shm_io(e),
        })?;
        Ok(frame.encoded_len() as u64)
    }
}

/// The receiving half of a thread-served shm pipe.
struct ShmThreadReceiver {
    receiver: ShmReceiver,
    peer: Arc<str>,
    stopped: Arc<AtomicBool>,
    ended: bool,
}

impl FrameReceiver for ShmThreadReceiver {
    fn try_recv(&mut self, limits: FrameLimits) -> Result<TryRecv, TransportError> {
        if self.ended {
            return Ok(TryRecv::Closed);
        }
        let received: Result<Vec<u8>, ShmError> = match self.receiver.try_recv() {
            Ok(Some(message)) => Ok(message),
            Ok(None) if self.stopped.load(Ordering::Acquire) => {
                self.ended = true;
                return Ok(TryRecv::Closed);
            }
            Ok(None) => return Ok(TryRecv::Empty),
            Err(e) => Err(e),
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
        if self.ended || self.stopped.load(Ordering::Acquire) {
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
        let received = loop {
            if self.stopped.load(Ordering::Acquire) {
                self.ended = true;
                return Ok(None);
            }
            match self.receiver.recv_timeout(RECEIVE_POLL) {
                Err(ShmError::Timeout { .. }) => continue,
                other => break other,
            }
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

/// Sleeps on a thread-served shm pipe's data eventfd and the peer's end of the control
/// socket, and stops the pipe: the control socket is shut down (the peer sees the close)
/// and the receiver sees the flag within [`RECEIVE_POLL`].
struct ShmControl {
    /// This side's control socket, shut down to stop.
    socket: std::os::fd::OwnedFd,
    data: std::os::fd::OwnedFd,
    /// The control socket as the receiver watches it: readable means its end.
    peer_end: std::os::fd::OwnedFd,
    stopped: Arc<AtomicBool>,
}

impl Control for ShmControl {
    fn wait(&self, timeout: Duration) -> bool {
        use std::os::fd::AsFd;
        let [_, control] = poll_two(self.data.as_fd(), self.peer_end.as_fd(), timeout);
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

    fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        // Fails only on a socket already shut down.
        let _ = rustix::net::shutdown(&self.socket, rustix::net::Shutdown::Both);
    }
}
