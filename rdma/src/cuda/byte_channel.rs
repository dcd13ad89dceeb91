//! The CPU byte channel the CUDA channels talk over.
//!
//! `cuda_basic` moves the staged tensor bytes through it, and `cuda_ipc` its descriptors
//! and acknowledgements. [`ByteChannel`] is deliberately small (send these bytes, receive
//! exactly this many) so that any CPU channel or transport connection can carry it: a TCP
//! or Unix stream through [`StreamChannel`], the shm or ibv transports through their own
//! adapters. This module frames nothing; each channel defines its own messages.

use std::io::{self, Read, Write};

/// A reliable, ordered, bidirectional byte pipe.
pub trait ByteChannel {
    /// Sends all of `bytes`.
    fn send_bytes(&mut self, bytes: &[u8]) -> io::Result<()>;
    /// Receives exactly `buf.len()` bytes (an early end of stream is `UnexpectedEof`).
    fn recv_bytes(&mut self, buf: &mut [u8]) -> io::Result<()>;
}

impl<T: ByteChannel + ?Sized> ByteChannel for &mut T {
    fn send_bytes(&mut self, bytes: &[u8]) -> io::Result<()> {
        (**self).send_bytes(bytes)
    }

    fn recv_bytes(&mut self, buf: &mut [u8]) -> io::Result<()> {
        (**self).recv_bytes(buf)
    }
}

/// A [`ByteChannel`] over any `Read + Write` stream (TCP, Unix socket, ...).
#[derive(Debug)]
pub struct StreamChannel<S> {
    stream: S,
}

impl<S: Read + Write> StreamChannel<S> {
    /// Wraps `stream`.
    pub fn new(stream: S) -> Self {
        StreamChannel { stream }
    }

    /// The stream back.
    pub fn into_inner(self) -> S {
        self.stream
    }
}

impl<S: Read + Write> ByteChannel for StreamChannel<S> {
    fn send_bytes(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes)?;
        self.stream.flush()
    }

    fn recv_bytes(&mut self, buf: &mut [u8]) -> io::Result<()> {
        self.stream.read_exact(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn stream_channel_moves_bytes_both_ways() {
        let (a, b) = UnixStream::pair().expect("socketpair");
        let (mut a, mut b) = (StreamChannel::new(a), StreamChannel::new(b));
        a.send_bytes(b"hello").expect("send");
        let mut buf = [0u8; 5];
        b.recv_bytes(&mut buf).expect("recv");
        assert_eq!(&buf, b"hello");
        fn send_through<C: ByteChannel>(mut channel: C) -> io::Result<()> {
            channel.send_bytes(b"!")
        }
        send_through(&mut b).expect("send back through &mut");
        let mut one = [0u8; 1];
        a.recv_bytes(&mut one).expect("recv back");
        assert_eq!(one, [b'!']);
        drop(b);
        let err = a.recv_bytes(&mut one).expect_err("peer closed");
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }
}
