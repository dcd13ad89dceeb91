//! The `mpt` channel in the agent: a pipe's extra TCP connections (its "mpt connections")
//! and the rule for when a pipe has them.
//!
//! A worker that offers mpt runs an [`MptListener`] and publishes its address as
//! `mpt://ip:port` beside its transports'. A pipe has mpt connections when its handshake
//! negotiated `tcp` and, for CPU tensors, `mpt` ([`uses_mpt`]: both sides compute the same
//! answer from the same negotiation). The connector then opens
//! [`RpcOptions::mpt_connections`](super::RpcOptions::mpt_connections) connections to the
//! peer's mpt listener, each presenting the token its hello carried
//! (`Handshake::Hello::lanes_token`); the listener's side claims that set before it reads
//! the pipe's first frame. A pipe whose connections cannot be opened fails like a pipe that
//! cannot connect, and the next call opens a new one.
//!
//! On a pipe with connections, [`MptConnections::push`] writes a frame's mpt tensors right
//! after the frame (the lane holds its send lock) and [`MptConnections::fill`] reads them
//! as soon as the frame has been received (the lane holds its receive lock), so the stripes
//! on the connections are in frame order. Each direction has its own duplicated sockets and
//! lock. Pipes over other transports (shm, ibv) and pipes on the I/O executor (fault
//! injection) never have mpt connections: their tensors go inline.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use rdzv_core::negotiate::{ChannelKind, Negotiated, Role, TransportKind};
use rdzv_core::rpc::address::after_scheme;
use rdzv_core::rpc::frame::TensorDescriptor;

use super::device::{Devices, HostBytes};
use super::recycle;
use super::tensors::{cpu_channel, PipeReader};
use super::transport::IncomingFrame;
use crate::channel::mpt::{
    open_connections, MptChannel, MptDescriptor, MptError, MptListener, MptOptions,
};

/// Why a pipe's mpt connections failed: one variant per step, each naming what it needs.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnectionsError {
    /// The peer's published address has no mpt listener.
    #[error("the worker publishes no {SCHEME} address ('{published}')")]
    NoAddress { published: String },
    /// The mpt listener's address is malformed.
    #[error("bad {SCHEME} address '{entry}': expected <ip>:<port>")]
    BadAddress { entry: String },
    /// Opening the connections to the peer failed.
    #[error("cannot open mpt connections to {address}: {source}")]
    Connect {
        address: SocketAddr,
        #[source]
        source: MptError,
    },
    /// This worker has no mpt listener to claim connections from.
    #[error("this worker runs no mpt connection listener")]
    NoListener,
    /// The connections the peer opened for the pipe did not arrive.
    #[error("{source}")]
    Claim {
        #[source]
        source: MptError,
    },
    /// The connections could not be set up (split into a send and a receive end).
    #[error("{source}")]
    Open {
        #[source]
        source: MptError,
    },
    /// The pipe ended while its connections were being opened.
    #[error("the pipe ended while its mpt connections were opened")]
    PipeEnded,
    /// A frame has mpt tensors, but its pipe has no connections.
    #[error("the frame has mpt tensors, but the pipe has no mpt connections")]
    NoConnections,
    /// Writing a tensor's stripes failed.
    #[error("{source}")]
    Send {
        #[source]
        source: MptError,
    },
    /// Reading a tensor's stripes failed.
    #[error("{source}")]
    Receive {
        #[source]
        source: MptError,
    },
    /// The peer streamed a tensor that this pipe did not negotiate mpt for.
    #[error("the peer streamed a {source_kind} to {target_kind} tensor over mpt, which this pipe did not negotiate for it")]
    NotNegotiated {
        source_kind: rdzv_core::device::DeviceType,
        target_kind: rdzv_core::device::DeviceType,
    },
    /// An mpt tensor's descriptor does not decode.
    #[error("mpt tensor: {source}")]
    Descriptor {
        #[source]
        source: rdzv_core::channel::DecodeError,
    },
    /// An mpt tensor is larger than this process can address.
    #[error("an mpt tensor does not fit in memory")]
    TooLarge,
    /// No buffer for an mpt tensor.
    #[error("mpt tensor of {len} bytes: {source}")]
    Alloc {
        len: usize,
        #[source]
        source: recycle::AllocFailed,
    },
}

/// The scheme of a mpt listener's address in a worker's published address.
pub(crate) const SCHEME: &str = "mpt";

/// Connections per pipe unless
/// [`RpcOptions::mpt_connections`](super::RpcOptions::mpt_connections) says otherwise.
pub const DEFAULT_MPT_CONNECTIONS: u16 = 4;

/// How long one side waits for the other's connections: connecting them, and, on the
/// listener's side, for all of them to arrive.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A worker's mpt set-up: its mpt listener and how many connections its pipes open.
#[derive(Debug)]
pub(crate) struct MptSetup {
    pub listener: MptListener,
    pub connections: u16,
}

impl MptSetup {
    /// Starts the mpt listener on `host`.
    pub(crate) fn start(host: IpAddr, connections: u16) -> std::io::Result<MptSetup> {
        Ok(MptSetup {
            listener: MptListener::bind(host)?,
            connections,
        })
    }

    /// The listener's entry in the published address.
    pub(crate) fn published(&self) -> String {
        format!("{SCHEME}://{}", self.listener.address())
    }
}

/// Whether a pipe that negotiated `negotiated` (this side playing `role`) streams CPU
/// tensors over mpt connections.
pub(crate) fn uses_mpt(negotiated: &Negotiated, role: Role) -> bool {
    negotiated.transport == TransportKind::Tcp
        && cpu_channel(negotiated, role) == Some(ChannelKind::Mpt)
}

/// A fresh token for a pipe's hello: unique in this process (a counter) and unlikely to
/// collide with another process's (mixed with a randomly keyed hash).
pub(crate) fn new_token() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let count = NEXT.fetch_add(1, Ordering::Relaxed);
    RandomState::new().hash_one((count, std::process::id()))
}

/// The mpt listener's address in a worker's published address.
pub(crate) fn listener_address(published: &str) -> Result<SocketAddr, ConnectionsError> {
    let entry = after_scheme(published, SCHEME).ok_or_else(|| ConnectionsError::NoAddress {
        published: published.to_string(),
    })?;
    entry.parse().map_err(|_| ConnectionsError::BadAddress {
        entry: entry.to_string(),
    })
}

/// Opens the connector's connections of a pipe to the worker that published `published`.
pub(crate) fn connect(
    published: &str,
    token: u64,
    connections: u16,
) -> Result<MptConnections, ConnectionsError> {
    let address = listener_address(published)?;
    let streams = open_connections(address, token, connections, CONNECT_TIMEOUT)
        .map_err(|source| ConnectionsError::Connect { address, source })?;
    MptConnections::new(streams)
}

/// One pipe's mpt connections: an end to send with and one to receive with.
pub(crate) struct MptConnections {
    send: Mutex<MptChannel>,
    recv: Mutex<MptChannel>,
    /// Shuts the sockets down without taking a lock a blocked transfer holds.
    stopper: MptChannel,
}

impl std::fmt::Debug for MptConnections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MptConnections")
            .field("connections", &self.stopper.connections())
            .finish()
    }
}

impl MptConnections {
    /// Connections over `streams` (in index order, the same at both ends).
    pub(crate) fn new(
        streams: Vec<std::net::TcpStream>,
    ) -> Result<MptConnections, ConnectionsError> {
        let open = |source| ConnectionsError::Open { source };
        let channel = MptChannel::new(streams, MptOptions::default()).map_err(open)?;
        let (send, rest) = channel.split().map_err(open)?;
        let (recv, stopper) = rest.split().map_err(open)?;
        Ok(MptConnections {
            send: Mutex::new(send),
            recv: Mutex::new(recv),
            stopper,
        })
    }

    /// Writes a frame's mpt tensors, in order. The caller holds the pipe's send lock
    /// and has just sent the frame.
    pub(crate) fn push(&self, streamed: &[(u64, HostBytes)]) -> Result<(), ConnectionsError> {
        let mut send = self.send.lock().unwrap_or_else(PoisonError::into_inner);
        for (transfer_id, data) in streamed {
            send.send(*transfer_id, data)
                .map_err(|source| ConnectionsError::Send { source })?;
        }
        Ok(())
    }

    /// Reads the mpt tensors of `frame`, just received, into buffers of their own and makes
    /// their entries inline. Each must be a tensor whose bytes the pipe (this side playing
    /// `role`) negotiated to carry over mpt (CPU to CPU, or staged by `cuda_basic`). A
    /// tensor for a device whose runtime takes parts in any order
    /// (`Devices::receive_parts`) is read piece by piece into the runtime's staging
    /// instead, each piece going to the device while the connections read on, and its
    /// memory (or the runtime's error, which fails only its call) is left with `reader` for
    /// the frame's sort; its entry stays an mpt one. An error leaves the connections out of
    /// step: the pipe must end.
    pub(crate) fn fill(
        &self,
        frame: &mut IncomingFrame,
        (negotiated, role): (&Negotiated, Role),
        (reader, devices): (&PipeReader, &Devices),
    ) -> Result<(), ConnectionsError> {
        if !frame
            .tensors
            .iter()
            .any(|(d, _)| d.channel == ChannelKind::Mpt)
        {
            return Ok(());
        }
        let mut recv = self.recv.lock().unwrap_or_else(PoisonError::into_inner);
        for (descriptor, data) in &mut frame.tensors {
            if descriptor.channel != ChannelKind::Mpt {
                continue;
            }
            // mpt also carries cuda_basic's staged bytes.
            let agreed =
                negotiated.carrier_for(role, descriptor.source.kind(), descriptor.target.kind());
            if agreed != Some(ChannelKind::Mpt) {
                return Err(ConnectionsError::NotNegotiated {
                    source_kind: descriptor.source.kind(),
                    target_kind: descriptor.target.kind(),
                });
            }
            let transfer_id = MptDescriptor::decode(data)
                .map_err(|source| ConnectionsError::Descriptor { source })?
                .transfer_id;
            let len = usize::try_from(descriptor.len).map_err(|_| ConnectionsError::TooLarge)?;
            let parts = if descriptor.target.is_cpu() {
                None
            } else {
                // A runtime that cannot take parts now gets the bytes whole later.
                devices
                    .receive_parts(descriptor.target, len)
                    .unwrap_or_else(|e| {
                        tracing::debug!(error = %e.report(), "mpt tensor staged whole");
                        None
                    })
            };
            if let Some(parts) = parts {
                recv.recv_with(transfer_id, len, &parts)
                    .map_err(|source| ConnectionsError::Receive { source })?;
                reader.arrived(transfer_id, parts.finish());
                frame.wire_len = frame.wire_len.saturating_add(descriptor.len);
                continue;
            }
            let mut bytes =
                recycle::try_take(len).map_err(|source| ConnectionsError::Alloc { len, source })?;
            recv.recv(transfer_id, &mut bytes)
                .map_err(|source| ConnectionsError::Receive { source })?;
            *descriptor =
                TensorDescriptor::inline(descriptor.source, descriptor.target, descriptor.len);
            *data = bytes;
            // The stripes count as received with the frame.
            frame.wire_len = frame.wire_len.saturating_add(descriptor.len);
        }
        Ok(())
    }

    /// Shuts the connections down: a transfer blocked on one fails at once.
    pub(crate) fn shutdown(&self) {
        self.stopper.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_address_round_trips() {
        let setup =
            MptSetup::start(IpAddr::from([127, 0, 0, 1]), 2).unwrap_or_else(|e| panic!("{e}"));
        let published = format!("shm://@x;tcp://127.0.0.1:1;{}", setup.published());
        assert!(matches!(listener_address(&published), Ok(a) if a == setup.listener.address()));
        let err = listener_address("tcp://127.0.0.1:1").expect_err("no mpt entry");
        assert!(err.to_string().contains("no mpt address"), "{err}");
        assert!(matches!(
            listener_address("mpt://nonsense"),
            Err(ConnectionsError::BadAddress { .. })
        ));
        assert!(listener_address("mpt://nonsense").is_err());
    }

    #[test]
    fn tokens_differ() {
        assert_ne!(new_token(), new_token());
    }
}
