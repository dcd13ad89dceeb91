//! The `tcp` transport: `TCP_NODELAY` sockets whose frames are the core's frame format,
//! whose fixed header is the length header.
//!
//! tokio connects and accepts on the agent's handshake executor (epoll, no io_uring); the
//! socket is then put in blocking mode and served by threads (`blocking`), the handshake
//! as the lane after it, with one framing code (`framing`: limits checked before anything
//! is allocated, large inline tensors read straight into their own buffers, small frames
//! coalesced into one write).
//!
//! This module decides nothing about what frames mean.

use std::net::{IpAddr, SocketAddr};

use rdzv_core::negotiate::TransportKind;
use tokio::net::{TcpListener, TcpStream};

use super::error::TransportError;
use super::transport::{not_listening, Connection, LocalBoxFuture, Transport};

mod blocking;
mod framing;

/// The scheme of tcp addresses.
pub const SCHEME: &str = "tcp://";
/// The domain descriptor: any two TCP endpoints can try to talk.
pub const DOMAIN_DESCRIPTOR: &str = "tcp:*";
/// Frames up to this size are copied into one buffer and written at once.
pub const COALESCE_LIMIT: usize = 64 * 1024;
/// The listeners' backlog: a large group's peers all connect at once.
const BACKLOG: i32 = 1024;

/// TCP, listening on one host address.
#[derive(Debug)]
pub struct TcpTransport {
    host: IpAddr,
    /// Once [`Transport::listen`] ran: the socket and its address.
    listening: Option<(TcpListener, String)>,
}

impl TcpTransport {
    /// A transport that listens on `host` (port chosen by the kernel).
    pub fn new(host: IpAddr) -> TcpTransport {
        TcpTransport {
            host,
            listening: None,
        }
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

    fn listen(&mut self) -> Result<String, TransportError> {
        let wanted = SocketAddr::new(self.host, 0);
        let listen_error = |source| TransportError::Listen {
            address: wanted.to_string(),
            source,
        };
        let listener = bind(wanted).map_err(listen_error)?;
        let address = format_address(listener.local_addr().map_err(listen_error)?);
        self.listening = Some((listener, address.clone()));
        Ok(address)
    }

    fn accept(&self) -> LocalBoxFuture<'_, Result<Connection, TransportError>> {
        Box::pin(async move {
            let Some((listener, address)) = &self.listening else {
                return Err(not_listening("tcp"));
            };
            let accept_error = TransportError::accepting(address);
            let (stream, peer) = listener.accept().await.map_err(&accept_error)?;
            let stream = stream.into_std().map_err(&accept_error)?;
            blocking::connection(stream, format_address(peer))
        })
    }

    fn connect<'a>(
        &'a self,
        address: &'a str,
    ) -> LocalBoxFuture<'a, Result<Connection, TransportError>> {
        Box::pin(async move {
            let addr = parse_address(address)?;
            let connect_error = TransportError::connecting(address);
            let stream = TcpStream::connect(addr).await.map_err(&connect_error)?;
            let stream = stream.into_std().map_err(&connect_error)?;
            blocking::connection(stream, address.to_string())
        })
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

    use crate::rpc::transport::{IncomingFrame, OwnedFrame, TryRecv};
    use rdzv_core::rpc::frame::FrameLimits;

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

    /// A connected pair over loopback, accepted and connected on the executor.
    pub(super) fn pair() -> Result<(Connection, Connection), String> {
        let executor = crate::rpc::transport::LocalExecutor::new().map_err(|e| e.to_string())?;
        executor.run(async {
            let mut transport = TcpTransport::new([127, 0, 0, 1].into());
            let address = transport.listen().map_err(|e| e.to_string())?;
            let (client, server) =
                futures_lite::future::zip(transport.connect(&address), transport.accept()).await;
            Ok((
                client.map_err(|e| e.to_string())?,
                server.map_err(|e| e.to_string())?,
            ))
        })
    }

    /// Frames of every size cross both ways (through the buffer and read directly,
    /// polled and blocking), and a stop ends the stream for the peer.
    #[test]
    fn frames_cross_both_ways_and_stop_ends_the_stream() {
        let (mut client, mut server) = pair().unwrap_or_else(|e| panic!("{e}"));
        let frames: Vec<OwnedFrame> = [(1u64, 0usize), (2, 100), (3, 3 << 20), (4, 10), (5, 20)]
            .into_iter()
            .map(|(id, len)| tensor_frame(id, len))
            .collect();
        let sent = frames.clone();
        let sending = std::thread::spawn(move || {
            for frame in &sent {
                let n = client.sender.send(frame).map_err(|e| e.to_string())?;
                assert_eq!(n, frame.encoded_len() as u64);
            }
            Ok::<_, String>(client)
        });
        for (i, frame) in frames.iter().enumerate() {
            let got = if i % 2 == 0 {
                server.receiver.recv(FrameLimits::DEFAULT)
            } else {
                crate::rpc::transport::recv_within(
                    &mut server,
                    FrameLimits::DEFAULT,
                    std::time::Duration::from_secs(10),
                )
            };
            let got = got.unwrap_or_else(|e| panic!("frame {i}: {e}"));
            assert!(got.is_some_and(|got| same(&got, frame)), "frame {i}");
        }
        let mut client = sending
            .join()
            .unwrap_or_else(|_| Err("the sender panicked".into()))
            .unwrap_or_else(|e| panic!("{e}"));
        let reply = tensor_frame(6, 1 << 20);
        let replying = {
            let reply = reply.clone();
            std::thread::spawn(move || {
                server
                    .sender
                    .send(&reply)
                    .map(|_| server)
                    .map_err(|e| e.to_string())
            })
        };
        let got = client.receiver.recv(FrameLimits::DEFAULT);
        assert!(
            matches!(&got, Ok(Some(got)) if same(got, &reply)),
            "the reply: {got:?}"
        );
        let server = replying
            .join()
            .unwrap_or_else(|_| Err("the replier panicked".into()))
            .unwrap_or_else(|e| panic!("{e}"));
        // Nothing more is there: a poll finds nothing.
        assert!(matches!(
            client.receiver.try_recv(FrameLimits::DEFAULT),
            Ok(TryRecv::Empty)
        ));
        // Stopping one side ends the stream for the peer.
        server.control.stop();
        let end = client.receiver.recv(FrameLimits::DEFAULT);
        assert!(matches!(end, Ok(None)), "{end:?}");
    }

    /// A small frame that arrives in pieces is polled for (`try_recv` says `Empty`, the
    /// wait's deadline holds) instead of waited for with blocking reads; a big one is
    /// read to its end.
    #[test]
    fn a_small_partial_frame_is_polled_for_and_a_big_one_read_through() {
        use std::io::Write;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
        let address = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
        let mut raw = std::net::TcpStream::connect(address).unwrap_or_else(|e| panic!("{e}"));
        let (stream, _) = listener.accept().unwrap_or_else(|e| panic!("{e}"));
        let mut server =
            blocking::connection(stream, "raw".into()).unwrap_or_else(|e| panic!("{e}"));
        let small = tensor_frame(1, 100);
        let mut bytes = small.encode_head().unwrap_or_else(|e| panic!("{e}"));
        for part in small.body() {
            bytes.extend_from_slice(part);
        }
        let (first, rest) = bytes.split_at(bytes.len() / 2);
        raw.write_all(first).unwrap_or_else(|e| panic!("{e}"));
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(matches!(
            server.receiver.try_recv(FrameLimits::DEFAULT),
            Ok(TryRecv::Empty)
        ));
        let start = std::time::Instant::now();
        let waited = crate::rpc::transport::recv_within(
            &mut server,
            FrameLimits::DEFAULT,
            std::time::Duration::from_millis(200),
        );
        assert!(
            waited.is_err(),
            "half a frame within the deadline: {waited:?}"
        );
        assert!(start.elapsed() < std::time::Duration::from_secs(2));
        raw.write_all(rest).unwrap_or_else(|e| panic!("{e}"));
        let got = crate::rpc::transport::recv_within(
            &mut server,
            FrameLimits::DEFAULT,
            std::time::Duration::from_secs(10),
        );
        assert!(
            matches!(&got, Ok(Some(got)) if same(got, &small)),
            "{got:?}"
        );
        // A 3 MiB frame sent in two pieces comes through whole.
        let big = tensor_frame(2, 3 << 20);
        let mut bytes = big.encode_head().unwrap_or_else(|e| panic!("{e}"));
        for part in big.body() {
            bytes.extend_from_slice(part);
        }
        let writer = std::thread::spawn(move || {
            let (first, rest) = bytes.split_at(1 << 21);
            let _ = raw.write_all(first);
            std::thread::sleep(std::time::Duration::from_millis(50));
            let _ = raw.write_all(rest);
            raw
        });
        let got = crate::rpc::transport::recv_within(
            &mut server,
            FrameLimits::DEFAULT,
            std::time::Duration::from_secs(10),
        );
        assert!(
            matches!(&got, Ok(Some(got)) if same(got, &big)),
            "the big frame"
        );
        let _ = writer.join();
    }

    #[test]
    fn listening_off_the_executor_is_an_error_not_a_panic() {
        let refused = TcpTransport::new([127, 0, 0, 1].into()).listen();
        let text = refused.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("LocalExecutor"), "{text}");
    }
}
