//! The `tcp` transport: `TCP_NODELAY` sockets whose frames are the core's frame format,
//! whose fixed header is the length header.
//!
//! A pipe's handshake runs on the agent's I/O executor, over tokio's sockets (epoll, no
//! io_uring); its lane then gets the same socket in blocking mode (`blocking`). Both
//! use one framing code (`framing`: limits checked before anything is allocated, large
//! inline tensors read straight into their own buffers, small frames coalesced into one
//! write).
//!
//! This module decides nothing about what frames mean.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use rdzv_core::negotiate::TransportKind;
use rdzv_core::rpc::frame::FrameLimits;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::compat::{Compat, TokioAsyncReadCompatExt, TokioAsyncWriteCompatExt};

use super::error::TransportError;
use super::recycle;
use super::transport::{
    Connection, FrameReceiver, FrameSender, IncomingFrame, IntoBlocking, Listener, LocalBoxFuture,
    NotBlocking, OwnedFrame, Transport,
};

mod blocking;
mod framing;

use framing::{TcpReceiver, TcpSender};

/// The scheme of tcp addresses.
pub const SCHEME: &str = "tcp://";
/// The domain descriptor: any two TCP endpoints can try to talk.
pub const DOMAIN_DESCRIPTOR: &str = "tcp:*";
/// Frames up to this size are copied into one buffer and written at once.
pub const COALESCE_LIMIT: usize = 64 * 1024;
/// The listeners' backlog: a large group's peers all connect at once.
const BACKLOG: i32 = 1024;

/// TCP, listening on one host address.
#[derive(Debug, Clone)]
pub struct TcpTransport {
    host: IpAddr,
}

impl TcpTransport {
    /// A transport that listens on `host` (port chosen by the kernel).
    pub fn new(host: IpAddr) -> TcpTransport {
        TcpTransport { host }
    }
}

/// `tcp://host:port` for an address.
pub fn format_address(addr: SocketAddr) -> String {
    format!("{SCHEME}{addr}")
}

/// The socket address in `tcp://host:port`.
///
/// # Errors
/// [`TransportError::BadAddress`] if it is not that shape.
pub fn parse_address(address: &str) -> Result<SocketAddr, TransportError> {
    let bad = |reason| TransportError::BadAddress {
        transport: "tcp",
        address: address.to_string(),
        reason,
    };
    address
        .strip_prefix(SCHEME)
        .ok_or_else(|| bad("it does not start with tcp://"))?
        .parse()
        .map_err(|_| bad("expected tcp://<ip>:<port>"))
}

/// A listening socket on `wanted` (`SO_REUSEPORT`, a backlog of [`BACKLOG`]), registered
/// with the executor this runs on.
fn bind(wanted: SocketAddr) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    // Without a runtime, tokio would panic on registration: say so instead.
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(std::io::Error::other(
            "a tcp listener must be opened on the agent's I/O executor \
             (rdzv_uring::rpc::transport::LocalExecutor)",
        ));
    }
    let socket = Socket::new(
        Domain::for_address(wanted),
        Type::STREAM,
        Some(Protocol::TCP),
    )?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&wanted.into())?;
    socket.listen(BACKLOG)?;
    TcpListener::from_std(socket.into())
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn domain_descriptor(&self) -> &str {
        DOMAIN_DESCRIPTOR
    }

    fn listen(&self) -> Result<Box<dyn Listener>, TransportError> {
        let wanted = SocketAddr::new(self.host, 0);
        let listen_error = |source| TransportError::Listen {
            address: wanted.to_string(),
            source,
        };
        let listener = bind(wanted).map_err(listen_error)?;
        let local = listener.local_addr().map_err(listen_error)?;
        Ok(Box::new(TcpTransportListener {
            listener,
            address: format_address(local),
        }))
    }

    fn connect<'a>(
        &'a self,
        address: &'a str,
    ) -> LocalBoxFuture<'a, Result<Box<dyn Connection>, TransportError>> {
        Box::pin(async move {
            let addr = parse_address(address)?;
            let stream =
                TcpStream::connect(addr)
                    .await
                    .map_err(|source| TransportError::Connect {
                        address: address.to_string(),
                        source,
                    })?;
            Ok(TcpConnection::boxed(stream, address.to_string()))
        })
    }
}

struct TcpTransportListener {
    listener: TcpListener,
    address: String,
}

impl Listener for TcpTransportListener {
    fn address(&self) -> &str {
        &self.address
    }

    fn accept(&self) -> LocalBoxFuture<'_, Result<Box<dyn Connection>, TransportError>> {
        Box::pin(async move {
            let (stream, peer) =
                self.listener
                    .accept()
                    .await
                    .map_err(|source| TransportError::Accept {
                        address: self.address.clone(),
                        source,
                    })?;
            Ok(TcpConnection::boxed(stream, format_address(peer)))
        })
    }
}

struct TcpConnection {
    stream: TcpStream,
    peer: String,
}

impl TcpConnection {
    fn boxed(stream: TcpStream, peer: String) -> Box<dyn Connection> {
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(%peer, error = %e, "TCP_NODELAY failed");
        }
        Box::new(TcpConnection { stream, peer })
    }
}

impl Connection for TcpConnection {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn split(self: Box<Self>) -> (Box<dyn FrameSender>, Box<dyn FrameReceiver>) {
        let (read, write) = self.stream.into_split();
        let peer: Arc<str> = Arc::from(self.peer.as_str());
        (
            Box::new(TcpSender {
                write: write.compat_write(),
                peer: Arc::clone(&peer),
                scratch: Vec::new(),
            }),
            Box::new(TcpReceiver {
                read: read.compat(),
                peer,
                buf: Vec::new(),
                filled: 0,
            }),
        )
    }
}

/// The executor's halves.
type AsyncSender = TcpSender<Compat<OwnedWriteHalf>>;
type AsyncReceiver = TcpReceiver<Compat<OwnedReadHalf>>;

impl FrameSender for AsyncSender {
    fn send(&mut self, frame: OwnedFrame) -> LocalBoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(async move {
            let sent = self.send_frame(&frame).await;
            recycle::give_all(frame.tensor_data);
            sent
        })
    }

    fn close(&mut self) -> LocalBoxFuture<'_, ()> {
        Box::pin(async move {
            use futures_lite::io::AsyncWriteExt;
            if let Err(e) = self.write.close().await {
                tracing::debug!(peer = %self.peer, error = %e, "closing a TCP pipe failed");
            }
        })
    }

    fn into_blocking(
        self: Box<Self>,
        receiver: Box<dyn FrameReceiver>,
    ) -> LocalBoxFuture<'static, IntoBlocking> {
        Box::pin(async move {
            match receiver.into_any().downcast::<AsyncReceiver>() {
                Ok(receiver) => {
                    blocking::thread_halves(*self, *receiver).map_err(NotBlocking::Failed)
                }
                Err(_) => Err(NotBlocking::Failed(TransportError::Io {
                    op: "take off the executor the pipe to",
                    peer: self.peer.to_string(),
                    source: std::io::Error::other("the halves belong to different transports"),
                })),
            }
        })
    }
}

impl FrameReceiver for AsyncReceiver {
    fn recv(
        &mut self,
        limits: FrameLimits,
    ) -> LocalBoxFuture<'_, Result<Option<IncomingFrame>, TransportError>> {
        Box::pin(self.recv_frame(limits))
    }

    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any> {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip() {
        let addr: SocketAddr = ([127, 0, 0, 1], 4242).into();
        let text = format_address(addr);
        assert_eq!(text, "tcp://127.0.0.1:4242");
        assert_eq!(parse_address(&text).ok(), Some(addr));
        let v6: SocketAddr = "[::1]:80".parse().unwrap_or(addr);
        assert_eq!(parse_address(&format_address(v6)).ok(), Some(v6));
        assert!(parse_address("uv://127.0.0.1:1").is_err());
        assert!(parse_address("tcp://localhost").is_err());
    }

    fn tensor_frame(id: u64, len: usize) -> OwnedFrame {
        use rdzv_core::device::Device;
        use rdzv_core::rpc::frame::{FrameKind, TensorDescriptor};
        OwnedFrame {
            handler: "echo".into(),
            payload: vec![id as u8; 5],
            tensors: vec![TensorDescriptor::inline(
                Device::cpu(),
                Device::cpu(),
                len as u64,
            )],
            tensor_data: vec![(0..len)
                .map(|i| (i % 251) as u8 ^ id as u8)
                .collect::<Vec<_>>()
                .into()],
            ..OwnedFrame::empty(FrameKind::Request, id)
        }
    }

    fn same(got: &IncomingFrame, want: &OwnedFrame) -> bool {
        let data: Vec<u8> = want.tensor_data.iter().flat_map(|d| d.to_vec()).collect();
        got.message_id == want.message_id
            && got.payload == want.payload
            && got.tensors.first().map(|t| &t.1) == Some(&data)
            && got.wire_len == want.encoded_len() as u64
    }

    /// Frames on the executor (through the buffer and read directly), then the pipe
    /// taken off it with a frame already buffered, which the blocking half delivers.
    #[test]
    fn frames_cross_on_the_executor_and_after_into_blocking() {
        let executor =
            crate::rpc::transport::LocalExecutor::new().unwrap_or_else(|e| panic!("{e}"));
        let outcome = executor.run(async {
            let transport = TcpTransport::new([127, 0, 0, 1].into());
            let listener = transport.listen().map_err(|e| e.to_string())?;
            let (client, server) =
                futures_lite::future::zip(transport.connect(listener.address()), listener.accept())
                    .await;
            let (mut tx, mut client_rx) = client.map_err(|e| e.to_string())?.split();
            let (server_tx, mut rx) = server.map_err(|e| e.to_string())?.split();
            for (id, len) in [(1u64, 0usize), (2, 100), (3, 3 << 20)] {
                let frame = tensor_frame(id, len);
                let sent = tx.send(frame.clone()).await.map_err(|e| e.to_string())?;
                assert_eq!(sent, frame.encoded_len() as u64);
                let got = rx
                    .recv(FrameLimits::DEFAULT)
                    .await
                    .map_err(|e| e.to_string())?;
                assert!(got.is_some_and(|got| same(&got, &frame)), "frame {id}");
            }
            // Two small frames in one write's worth: the second is buffered by the
            // executor's receiver when the pipe is taken off it.
            let (first, second) = (tensor_frame(4, 10), tensor_frame(5, 20));
            tx.send(first.clone()).await.map_err(|e| e.to_string())?;
            tx.send(second.clone()).await.map_err(|e| e.to_string())?;
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            let got = rx
                .recv(FrameLimits::DEFAULT)
                .await
                .map_err(|e| e.to_string())?;
            assert!(got.is_some_and(|got| same(&got, &first)));
            let mut halves = match server_tx.into_blocking(rx).await {
                Ok(halves) => halves,
                Err(_) => return Err("into_blocking failed".to_string()),
            };
            let got = halves
                .receiver
                .recv(FrameLimits::DEFAULT)
                .map_err(|e| e.to_string())?;
            assert!(
                got.is_some_and(|got| same(&got, &second)),
                "the buffered frame"
            );
            let reply = tensor_frame(6, 1 << 20);
            halves.sender.send(&reply).map_err(|e| e.to_string())?;
            let got = client_rx
                .recv(FrameLimits::DEFAULT)
                .await
                .map_err(|e| e.to_string())?;
            assert!(
                got.is_some_and(|got| same(&got, &reply)),
                "the lane's reply"
            );
            // Stopping the lane ends the stream for the peer.
            halves.stop.stop();
            let end = client_rx.recv(FrameLimits::DEFAULT).await;
            assert!(matches!(end, Ok(None)), "{end:?}");
            Ok::<(), String>(())
        });
        assert_eq!(outcome, Ok(()));
    }

    #[test]
    fn listening_off_the_executor_is_an_error_not_a_panic() {
        let refused = TcpTransport::new([127, 0, 0, 1].into()).listen();
        let text = refused.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("LocalExecutor"), "{text}");
    }
}
