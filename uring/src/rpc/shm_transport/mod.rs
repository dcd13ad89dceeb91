//! The `shm` transport behind the seam: [`crate::shm`]'s blocking
//! connections, served by threads from the start (`blocking`).
//!
//! - Listening runs one accept thread (the shm bootstrap, memfds over `SCM_RIGHTS`,
//!   happens there) and queues the connections for [`Transport::accept`].
//! - A message is exactly one frame (`decode`, below `blocking`, which receives with it).
//!
//! Addresses are `shm://@<abstract name>` (or `shm://<socket path>`). The domain
//! descriptor is [`viability`]'s `shm:<boot_id>_<netns>`: two workers negotiate shm only
//! on one host and in one network namespace.
//!
//! This module does not negotiate or decide anything about frames' meaning; large
//! tensors go through the ring like everything else (the `cma` and `xth` channels move
//! large tensors beside it; their descriptors travel in the frame).

use std::time::Duration;

use rdzv_core::negotiate::TransportKind;

use super::error::TransportError;
use super::transport::{accept_next, Connection, Listening, LocalBoxFuture, Transport};
use crate::queue::{on_thread, Queue};
use crate::shm::{viability, NotViable, ShmAddr, ShmConnection, ShmError, ShmListener, ShmOptions};

mod blocking;
mod decode;
use decode::shm_io;

/// The scheme of shm addresses.
pub const SCHEME: &str = "shm://";

/// Shared memory between processes on one host.
#[derive(Debug)]
pub struct ShmTransport {
    descriptor: String,
    options: ShmOptions,
    /// Once [`Transport::listen`] ran: the accept thread's connections (or errors).
    listening: Option<Listening<Result<ShmConnection, ShmError>>>,
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
            listening: None,
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

impl Transport for ShmTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn domain_descriptor(&self) -> &str {
        &self.descriptor
    }

    fn listen(&mut self) -> Result<String, TransportError> {
        let listener = ShmListener::bind_unnamed(self.options.clone()).map_err(|e| {
            TransportError::Listen {
                address: "an unnamed shm socket".into(),
                source: shm_io(e),
            }
        })?;
        let address = format_address(listener.local_addr());
        let shown = address.clone();
        self.listening = Some(Listening::start(
            "rdzv-shm-accept",
            listener,
            address.clone(),
            move |listener, queue| accept_thread(listener, queue, &shown),
        )?);
        Ok(address)
    }

    fn accept(&self) -> LocalBoxFuture<'_, Result<Connection, TransportError>> {
        Box::pin(async move {
            let connection = accept_next(self.listening.as_ref(), "shm", shm_io).await?;
            let peer = connection
                .peer_pid()
                .map_or_else(|| "an shm peer".to_string(), |pid| format!("shm pid {pid}"));
            blocking::connection(connection, peer)
        })
    }

    fn connect<'a>(
        &'a self,
        address: &'a str,
    ) -> LocalBoxFuture<'a, Result<Connection, TransportError>> {
        Box::pin(async move {
            let addr = parse_address(address)?;
            let options = self.options.clone();
            let connect_error = TransportError::connecting(address);
            let connected = on_thread("rdzv-shm-connect", move || {
                ShmConnection::connect(&addr, options)
            })
            .await
            .map_err(&connect_error)?;
            match connected {
                Ok(connection) => blocking::connection(connection, address.to_string()),
                Err(e) => Err(connect_error(shm_io(e))),
            }
        })
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::transport::{IncomingFrame, LocalExecutor, OwnedFrame};
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

    /// A connected pair, accepted and connected on the executor.
    fn pair() -> Result<(Connection, Connection), String> {
        run(async {
            let mut transport = ShmTransport::new().map_err(|e| e.to_string())?;
            assert_eq!(transport.kind(), TransportKind::Shm);
            assert!(transport.domain_descriptor().starts_with("shm:"));
            let address = transport.listen().map_err(|e| e.to_string())?;
            assert!(address.starts_with(SCHEME), "{address}");
            let (client, server) =
                futures_lite::future::zip(transport.connect(&address), transport.accept()).await;
            Ok((
                client.map_err(|e| e.to_string())?,
                server.map_err(|e| e.to_string())?,
            ))
        })
    }

    fn expect(got: Result<Option<IncomingFrame>, TransportError>) -> IncomingFrame {
        match got {
            Ok(Some(frame)) => frame,
            other => panic!("expected a frame, got {other:?}"),
        }
    }

    #[test]
    fn frames_cross_the_seam_both_ways_and_the_end_is_seen() {
        let (mut client, mut server) = pair().unwrap_or_else(|e| panic!("{e}"));
        let sizes = [(1u64, 0usize), (2, 1), (3, 1 << 20), (4, 5 << 20)];
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
        let sending = std::thread::spawn(move || {
            let mut sent = Vec::new();
            for (id, len) in sizes {
                let frame = tensor_frame(id, len);
                sent.push(client.sender.send(&frame).map_err(|e| e.to_string())?);
            }
            client.sender.send(&many).map_err(|e| e.to_string())?;
            Ok::<_, String>((client, sent))
        });
        let mut wire = Vec::new();
        for (id, len) in sizes {
            let got = expect(server.receiver.recv(FrameLimits::DEFAULT));
            assert_eq!(got.message_id, id);
            assert_eq!(got.handler, "echo");
            assert_eq!(got.payload, b"payload".to_vec());
            wire.push(got.wire_len);
            let data = got.tensors.first().map(|t| t.1.clone()).unwrap_or_default();
            let want: Vec<u8> = tensor_frame(id, len)
                .tensor_data
                .iter()
                .flat_map(|d| d.to_vec())
                .collect();
            assert!(data == want, "tensor {id} differs");
        }
        let got = expect(server.receiver.recv(FrameLimits::DEFAULT));
        let datas: Vec<Vec<u8>> = got.tensors.into_iter().map(|t| t.1).collect();
        assert!(datas == parts, "tensors differ");
        let (mut client, sent) = sending
            .join()
            .unwrap_or_else(|_| Err("the sender panicked".into()))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(wire, sent);
        server
            .sender
            .send(&OwnedFrame::empty(FrameKind::Goodbye, 0))
            .unwrap_or_else(|e| panic!("{e}"));
        let goodbye = crate::rpc::transport::recv_within(
            &mut client,
            FrameLimits::DEFAULT,
            std::time::Duration::from_secs(10),
        );
        assert!(matches!(goodbye, Ok(Some(f)) if f.kind == FrameKind::Goodbye));
        // Limits apply: a request is too big for the handshake limits.
        client
            .sender
            .send(&tensor_frame(5, 16))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(server.receiver.recv(FrameLimits::HANDSHAKE).is_err());
        // After an invalid frame the receiver stays ended.
        assert!(matches!(
            server.receiver.recv(FrameLimits::DEFAULT),
            Ok(None)
        ));
    }

    #[test]
    fn a_dropped_sender_or_a_stop_ends_the_stream() {
        let (client, mut server) = pair().unwrap_or_else(|e| panic!("{e}"));
        drop(client.sender);
        assert!(matches!(
            server.receiver.recv(FrameLimits::DEFAULT),
            Ok(None)
        ));
        let (mut client, server) = pair().unwrap_or_else(|e| panic!("{e}"));
        server.control.stop();
        let end = crate::rpc::transport::recv_within(
            &mut client,
            FrameLimits::DEFAULT,
            std::time::Duration::from_secs(10),
        );
        assert!(matches!(end, Ok(None)), "{end:?}");
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
