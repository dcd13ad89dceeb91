//! The `shm` transport behind the seam: [`crate::transport::shm`]'s blocking
//! connections, each half driven by a thread of its own that hands frames to and from
//! the agent's executor through a queue (`adapter`).
//!
//! - A listener runs one accept thread (the shm bootstrap, memfds over `SCM_RIGHTS`,
//!   happens there) and queues the connections for [`Listener::accept`].
//! - A connection's halves are each served by an adapter thread during the handshake
//!   (`adapter`); a message must be exactly one frame (`decode`).
//! - Once the pipe's handshake is done, [`FrameSender::into_blocking`] takes both halves
//!   back from their threads and the agent serves the pipe as a lane (`blocking`).
//!
//! Addresses are `shm://@<abstract name>` (or `shm://<socket path>`). The domain
//! descriptor is [`viability`]'s `shm:<boot_id>_<netns>`: two workers negotiate shm only
//! on one host and in one network namespace.
//!
//! This module does not negotiate or decide anything about frames' meaning; large
//! tensors go through the ring like everything else (the `cma` and `xth` channels move
//! large tensors beside it; their descriptors travel in the frame).

use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use rdzv_core::negotiate::TransportKind;

use super::error::TransportError;
use super::transport::{
    Connection, FrameReceiver, FrameSender, Listener, LocalBoxFuture, Transport,
};
use crate::queue::{on_thread, Queue};
use crate::transport::shm::{
    viability, NotViable, ShmAddr, ShmConnection, ShmError, ShmListener, ShmOptions,
};

mod adapter;
mod blocking;
mod decode;

use adapter::{ShmFrameReceiver, ShmFrameSender};

/// The scheme of shm addresses.
pub const SCHEME: &str = "shm://";
/// How many received messages wait for the agent before the receiving thread stops
/// reading (the peer then waits for room in its ring).
const RECEIVE_QUEUE: usize = 64;
/// How often a blocked receiving thread checks whether its half was dropped, handed back
/// or stopped.
const RECEIVE_POLL: Duration = Duration::from_millis(10);

/// Shared memory between processes on one host.
#[derive(Debug, Clone)]
pub struct ShmTransport {
    descriptor: String,
    options: ShmOptions,
}

impl ShmTransport {
    /// The transport if shared memory works in this process ([`viability`]), with the
    /// default [`ShmOptions`].
    ///
    /// # Errors
    /// [`NotViable`] with the reason.
    pub fn new() -> Result<ShmTransport, NotViable> {
        Self::with_options(ShmOptions::default())
    }

    /// Like [`ShmTransport::new`] with chosen options.
    ///
    /// # Errors
    /// [`NotViable`] with the reason.
    pub fn with_options(options: ShmOptions) -> Result<ShmTransport, NotViable> {
        let descriptor = viability()?.as_str().to_string();
        Ok(ShmTransport {
            descriptor,
            options,
        })
    }
}

/// `shm://@name` (or `shm://path`) for a listener address.
pub fn format_address(addr: &ShmAddr) -> String {
    format!("{SCHEME}{addr}")
}

/// The listener address in `shm://@name` or `shm://path`.
///
/// # Errors
/// [`TransportError::BadAddress`] if it does not start with `shm://` or names nothing.
pub fn parse_address(address: &str) -> Result<ShmAddr, TransportError> {
    let bad = |reason| TransportError::BadAddress {
        transport: "shm",
        address: address.to_string(),
        reason,
    };
    let rest = address
        .strip_prefix(SCHEME)
        .ok_or_else(|| bad("it does not start with shm://"))?;
    if rest.is_empty() || rest == "@" {
        return Err(bad("expected shm://@<name> or shm://<path>"));
    }
    Ok(ShmAddr::parse(rest))
}

fn shm_io(error: ShmError) -> std::io::Error {
    std::io::Error::other(error)
}

impl Transport for ShmTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn domain_descriptor(&self) -> &str {
        &self.descriptor
    }

    fn listen(&self) -> Result<Box<dyn Listener>, TransportError> {
        let listener = ShmListener::bind_unnamed(self.options.clone()).map_err(|e| {
            TransportError::Listen {
                address: "an unnamed shm socket".into(),
                source: shm_io(e),
            }
        })?;
        let address = format_address(listener.local_addr());
        let listener = Arc::new(listener);
        let queue = Arc::new(Queue::new(usize::MAX));
        let thread_listener = Arc::clone(&listener);
        let thread_queue = Arc::clone(&queue);
        let shown = address.clone();
        std::thread::Builder::new()
            .name("rdzv-shm-accept".into())
            .spawn(move || accept_thread(&thread_listener, &thread_queue, &shown))
            .map_err(|source| TransportError::Listen {
                address: address.clone(),
                source,
            })?;
        Ok(Box::new(ShmTransportListener {
            listener,
            queue,
            address,
        }))
    }

    fn connect<'a>(
        &'a self,
        address: &'a str,
    ) -> LocalBoxFuture<'a, Result<Box<dyn Connection>, TransportError>> {
        Box::pin(async move {
            let addr = parse_address(address)?;
            let options = self.options.clone();
            let connect_error = |source| TransportError::Connect {
                address: address.to_string(),
                source,
            };
            let connected = on_thread("rdzv-shm-connect", move || {
                ShmConnection::connect(&addr, options)
            })
            .await
            .map_err(connect_error)?;
            match connected {
                Ok(connection) => Ok(ShmPipe::boxed(connection, address.to_string())),
                Err(e) => Err(connect_error(shm_io(e))),
            }
        })
    }
}

/// Accepts until the listener is shut down, queueing connections (or errors).
fn accept_thread(
    listener: &ShmListener,
    queue: &Queue<Result<ShmConnection, ShmError>>,
    address: &str,
) {
    loop {
        let accepted = listener.accept();
        if queue.is_closed() {
            return;
        }
        if let Err(e) = &accepted {
            // Handshake failures concern one peer; anything else repeats: slow down.
            if !matches!(
                e,
                ShmError::Handshake { .. }
                    | ShmError::Rejected { .. }
                    | ShmError::NotSameHost { .. }
            ) {
                tracing::debug!(%address, error = %e, "shm accept failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        if queue.push(accepted).is_err() {
            return;
        }
    }
}

struct ShmTransportListener {
    listener: Arc<ShmListener>,
    queue: Arc<Queue<Result<ShmConnection, ShmError>>>,
    address: String,
}

impl Listener for ShmTransportListener {
    fn address(&self) -> &str {
        &self.address
    }

    fn accept(&self) -> LocalBoxFuture<'_, Result<Box<dyn Connection>, TransportError>> {
        Box::pin(async move {
            let accept_error = |source| TransportError::Accept {
                address: self.address.clone(),
                source,
            };
            match self.queue.pop().await {
                Some(Ok(connection)) => {
                    let peer = connection
                        .peer_pid()
                        .map_or_else(|| "an shm peer".to_string(), |pid| format!("shm pid {pid}"));
                    Ok(ShmPipe::boxed(connection, peer))
                }
                Some(Err(e)) => Err(accept_error(shm_io(e))),
                None => Err(accept_error(std::io::Error::other(
                    "the listener is closed",
                ))),
            }
        })
    }
}

impl Drop for ShmTransportListener {
    fn drop(&mut self) {
        self.queue.close();
        // Wakes the accept thread: accept on a shut-down socket fails at once.
        if let Err(e) = rustix::net::shutdown(self.listener.as_fd(), rustix::net::Shutdown::Both) {
            tracing::debug!(address = %self.address, error = %e, "shutting an shm listener down failed");
        }
    }
}

struct ShmPipe {
    connection: ShmConnection,
    peer: String,
}

impl ShmPipe {
    fn boxed(connection: ShmConnection, peer: String) -> Box<dyn Connection> {
        Box::new(ShmPipe { connection, peer })
    }
}

impl Connection for ShmPipe {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn split(self: Box<Self>) -> (Box<dyn FrameSender>, Box<dyn FrameReceiver>) {
        let ShmPipe { connection, peer } = *self;
        let (sender, receiver) = connection.split();
        let peer: Arc<str> = Arc::from(peer.as_str());
        (
            Box::new(ShmFrameSender::start(sender, Arc::clone(&peer))),
            Box::new(ShmFrameReceiver::start(receiver, peer)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::transport::{LocalExecutor, OwnedFrame};
    use decode::IN_PLACE_MIN;
    use rdzv_core::device::Device;
    use rdzv_core::rpc::frame::{FrameKind, FrameLimits, TensorDescriptor};

    #[test]
    fn addresses_round_trip() {
        let addr = ShmAddr::Abstract(b"rdzv-1f2e3".to_vec());
        let text = format_address(&addr);
        assert_eq!(text, "shm://@rdzv-1f2e3");
        assert_eq!(parse_address(&text).ok(), Some(addr));
        assert_eq!(
            parse_address("shm:///tmp/x.sock").ok(),
            Some(ShmAddr::Path("/tmp/x.sock".into()))
        );
        assert!(parse_address("tcp://127.0.0.1:1").is_err());
        assert!(parse_address("shm://").is_err());
        assert!(parse_address("shm://@").is_err());
    }

    fn tensor_frame(id: u64, len: usize) -> OwnedFrame {
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        OwnedFrame {
            handler: "echo".into(),
            metadata: vec![7],
            payload: b"payload".to_vec(),
            tensors: vec![TensorDescriptor::inline(
                Device::cpu(),
                Device::cpu(),
                len as u64,
            )],
            tensor_data: vec![data.into()],
            ..OwnedFrame::empty(FrameKind::Request, id)
        }
    }

    fn run<T>(f: impl std::future::Future<Output = T>) -> T {
        LocalExecutor::new()
            .map(|executor| executor.run(f))
            .unwrap_or_else(|e| panic!("executor: {e}"))
    }

    #[test]
    fn frames_cross_the_seam_both_ways_and_the_end_is_seen() {
        let outcome = run(async {
            let transport = ShmTransport::new().map_err(|e| e.to_string())?;
            assert_eq!(transport.kind(), TransportKind::Shm);
            assert!(transport.domain_descriptor().starts_with("shm:"));
            let listener = transport.listen().map_err(|e| e.to_string())?;
            let address = listener.address().to_string();
            assert!(address.starts_with(SCHEME), "{address}");
            let (client, server) =
                futures_lite::future::zip(transport.connect(&address), listener.accept()).await;
            let (mut tx, mut client_rx) = client.map_err(|e| e.to_string())?.split();
            let (mut server_tx, mut rx) = server.map_err(|e| e.to_string())?.split();
            for (id, len) in [(1u64, 0usize), (2, 1), (3, 1 << 20), (4, 5 << 20)] {
                let frame = tensor_frame(id, len);
                let sent = tx.send(frame.clone()).await.map_err(|e| e.to_string())?;
                assert_eq!(sent, frame.encoded_len() as u64);
                let got = rx
                    .recv(FrameLimits::DEFAULT)
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or("early end")?;
                assert_eq!(got.message_id, id);
                assert_eq!(got.handler, "echo");
                assert_eq!(got.payload, b"payload".to_vec());
                assert_eq!(got.wire_len, sent);
                let data = got.tensors.first().map(|t| t.1.clone()).unwrap_or_default();
                let sent: Vec<u8> = frame.tensor_data.iter().flat_map(|d| d.to_vec()).collect();
                assert!(data == sent, "tensor {id} differs");
            }
            // Several tensors, the largest (moved in place) in the middle.
            let parts = [
                vec![1u8, 2, 3],
                vec![9u8; IN_PLACE_MIN + 5],
                Vec::new(),
                vec![4u8; 70_000],
            ];
            let mut many = OwnedFrame::empty(FrameKind::Request, 6);
            for part in &parts {
                many.tensors.push(TensorDescriptor::inline(
                    Device::cpu(),
                    Device::cpu(),
                    part.len() as u64,
                ));
                many.tensor_data.push(part.clone().into());
            }
            tx.send(many).await.map_err(|e| e.to_string())?;
            let got = rx
                .recv(FrameLimits::DEFAULT)
                .await
                .map_err(|e| e.to_string())?
                .ok_or("early end")?;
            let datas: Vec<Vec<u8>> = got.tensors.into_iter().map(|t| t.1).collect();
            assert!(datas == parts, "tensors differ");
            server_tx
                .send(OwnedFrame::empty(FrameKind::Goodbye, 0))
                .await
                .map_err(|e| e.to_string())?;
            let goodbye = client_rx.recv(FrameLimits::DEFAULT).await;
            assert!(matches!(goodbye, Ok(Some(f)) if f.kind == FrameKind::Goodbye));
            // Limits apply: a request is too big for the handshake limits.
            tx.send(tensor_frame(5, 16))
                .await
                .map_err(|e| e.to_string())?;
            assert!(rx.recv(FrameLimits::HANDSHAKE).await.is_err());
            tx.close().await;
            drop(tx);
            // The end of the stream, after which the receiver stays ended.
            assert!(matches!(rx.recv(FrameLimits::DEFAULT).await, Ok(None)));
            assert!(matches!(rx.recv(FrameLimits::DEFAULT).await, Ok(None)));
            Ok::<(), String>(())
        });
        assert_eq!(outcome, Ok(()));
    }

    #[test]
    fn connecting_to_nothing_fails() {
        let outcome = run(async {
            let transport = ShmTransport::new().map_err(|e| e.to_string())?;
            let result = transport
                .connect("shm://@rdzv-test-nobody-listens-here")
                .await;
            Ok::<bool, String>(matches!(result, Err(TransportError::Connect { .. })))
        });
        assert_eq!(outcome, Ok(true));
    }
}
