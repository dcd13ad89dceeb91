//! The `ibv` transport of the RPC agent: the agent's transport seam
//! (`rdzv_uring::rpc::transport`) over an RC queue pair ([`IbvConnection`]), plugged into
//! the agent with [`IbvPlugin`].
//!
//! ```no_run
//! use rdzv_rdma::ibv::transport::IbvPlugin;
//! use rdzv_uring::rpc::{init_rpc, RpcOptions};
//!
//! let mut options = RpcOptions::new("env://");
//! options.transports = Some(vec!["ibv".into(), "tcp".into()]);
//! options.transport_plugins = vec![IbvPlugin::default().into()];
//! let agent = init_rpc("worker0", 0, Some(2), options)?;
//! # Ok::<(), rdzv_uring::rpc::InitError>(())
//! ```
//!
//! - **Viability**: [`IbvPlugin::open`] (what its
//!   [`TransportPlugin`] runs) runs [`probe`] with the plugin's [`IbvConfig`] (default: the
//!   `RDZV_IB_DEVICE` / `RDZV_IB_PORT` / `RDZV_IB_GID_INDEX` environment); when RDMA is not
//!   viable (libibverbs missing, a kernel without verbs, no active port, ...) it returns
//!   the probe's reason, which the agent logs before leaving ibv out.
//! - **Addresses**: a listener is a TCP socket on the agent's host, published as
//!   `ibv://<ip>:<port>` (`ibv://[v6]:port` for IPv6). A connection is a TCP connection to
//!   it, over which [`IbvConnection::connect`] exchanges the queue pairs' records; it stays
//!   open afterwards only to see the peer go.
//! - **Domain descriptor** ([`domain_descriptor`]): two workers negotiate ibv only when
//!   their ports can address each other: `ibv:ib:<subnet prefix>` for InfiniBand (LID
//!   routing works inside one subnet), `ibv:roce-v2` for RoCE v2 (routed over UDP/IP:
//!   reachability is IP's business, which no descriptor can tell; a pipe whose upgrade
//!   fails stays on the bootstrap transport), `ibv:roce-v1:<GID prefix>` for RoCE v1
//!   (one Ethernet segment). Device names, ports, MTUs and speeds do not matter: each
//!   side uses its own, and the path MTU is the smaller one.
//! - **Frames** ([`framing`]): a frame's head, name, metadata and small parts (up to
//!   [`framing::FIRST_PARTS_MAX`] bytes of them) travel as one first message; the
//!   payload and every tensor of at least [`framing::SEPARATE_MIN`] bytes travel alone
//!   and zero-copy (the peer reads the sender's buffer with RDMA READ into the buffer it
//!   hands to the agent). A link allocates for a message no more than the frame limits
//!   allow a first message, or, for a part, than its frame's checked header announced
//!   ([`framing::ReceiveGate`]).
//! - **Threads** ([`link`]): each pipe's verbs connection is driven by one thread, which
//!   also owns every buffer posted to the NIC until the peer has read it; errors carry
//!   the verb or the work completion's status (`IBV_WC_RETRY_EXC_ERR`, ...). A failed
//!   link fails the pipe, and the agent re-creates it on the next call, as for tcp.
//! - **Lanes**: a connection is served by threads from the start: callers' threads
//!   queue their frames for the link's thread directly (handing over the buffers,
//!   which stay owned until read). The receiver is polled: a caller in `rpc_sync` takes
//!   its reply off the link's queue of received messages itself while the lane's
//!   reader thread sleeps on that queue.
//!
//! Not here: one shared completion queue or receive queue for all of a worker's pipes
//! (each pipe has its own queue pair, rings and thread), receiving into caller-provided
//! or GPU memory, and negotiation (the agent's, with the core).

pub mod framing;
pub mod link;

use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use rdzv_core::negotiate::TransportKind;
use rdzv_core::rpc::frame::FrameLimits;
use rdzv_uring::rpc::transport::{
    accept_next, Connection, Control, FrameReceiver, FrameSender, IncomingFrame, Listening,
    LocalBoxFuture, OwnedFrame, Transport, TransportPlugin, TryRecv,
};
use rdzv_uring::rpc::TransportError;

use self::framing::{Assembler, Fed};
use self::link::{Link, LinkError};
use super::connection::{ConnectionOptions, IbvConnection};
use super::select::IbvSelection;
use super::topology::{GidType, LinkLayer};
use super::{probe, IbvConfig, IbvNotViable, IbvViability};
use crate::error_chain::ErrorChain;
use rdzv_uring::queue::{on_thread, Queue};

/// The scheme of ibv listener addresses.
pub const SCHEME: &str = "ibv://";
/// How long connecting the bootstrap TCP connection may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long each read or write of the queue pair setup may take.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(30);

/// Which peers this port can reach with RC queue pairs; see the [module](self) docs.
pub fn domain_descriptor(selection: &IbvSelection) -> String {
    let prefix = |gid: [u8; 16]| -> String {
        gid.get(..8)
            .unwrap_or_default()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    };
    match (selection.link_layer, selection.gid_type) {
        (link, _) if link.is_infiniband() => format!("ibv:ib:{}", prefix(selection.gid.0)),
        (LinkLayer::Ethernet, GidType::RoceV2) => "ibv:roce-v2".to_string(),
        (LinkLayer::Ethernet, GidType::RoceV1) => {
            format!("ibv:roce-v1:{}", prefix(selection.gid.0))
        }
        (LinkLayer::Ethernet, other) => format!("ibv:roce-{other}"),
        (other, _) => format!("ibv:{other}"),
    }
}

/// `ibv://ip:port` for a listener's socket address.
pub fn format_address(addr: SocketAddr) -> String {
    format!("{SCHEME}{addr}")
}

/// The socket address in `ibv://ip:port` (`ibv://[v6]:port` for IPv6).
///
/// # Errors
/// [`TransportError::BadAddress`] when it is anything else.
pub fn parse_address(address: &str) -> Result<SocketAddr, TransportError> {
    let bad = |reason| TransportError::BadAddress {
        transport: "ibv",
        address: address.to_string(),
        reason,
    };
    let rest = address
        .strip_prefix(SCHEME)
        .ok_or_else(|| bad("it does not start with ibv://"))?;
    let addr: SocketAddr = rest
        .parse()
        .map_err(|_| bad("expected ibv://<ip>:<port> (ibv://[<ipv6>]:<port>)"))?;
    if addr.port() == 0 {
        return Err(bad("port 0 is not a listener's port"));
    }
    Ok(addr)
}

/// The widest limits the agent receives frames under: what a link's thread lets through
/// before the agent checks a frame against the limits of the moment (see
/// [`framing::ReceiveGate`]).
pub const RECEIVE_LIMITS: FrameLimits = FrameLimits::DEFAULT;

/// The largest frame part the agent accepts ([`RECEIVE_LIMITS`]' payload and inline
/// bounds).
const MAX_PART: u64 = {
    let limits = RECEIVE_LIMITS;
    if limits.max_payload > limits.max_inline_bytes {
        limits.max_payload
    } else {
        limits.max_inline_bytes
    }
};

/// The `ibv` transport: RC queue pairs on the selected device, port and GID.
#[derive(Debug)]
pub struct IbvTransport {
    host: IpAddr,
    selection: IbvSelection,
    options: ConnectionOptions,
    descriptor: String,
    /// Once [`Transport::listen`] ran: the accept thread's set-up links (or errors).
    listening: Option<Listening<Accepted>>,
}

impl IbvTransport {
    /// The transport for a worker listening on `host`, if [`probe`] finds RDMA viable
    /// with `config`.
    ///
    /// # Errors
    /// [`IbvNotViable`] with the reason.
    pub fn new(host: IpAddr, config: &IbvConfig) -> Result<IbvTransport, IbvNotViable> {
        Self::probed(host, config, ConnectionOptions::default())
    }

    /// [`new`](Self::new) with `options`.
    fn probed(
        host: IpAddr,
        config: &IbvConfig,
        options: ConnectionOptions,
    ) -> Result<IbvTransport, IbvNotViable> {
        match probe(config) {
            IbvViability::Viable(selection) => Ok(Self::with_selection(host, selection, options)),
            IbvViability::NotViable(reason) => Err(reason),
        }
    }

    /// The transport over an already probed device, port and GID.
    pub fn with_selection(
        host: IpAddr,
        selection: IbvSelection,
        mut options: ConnectionOptions,
    ) -> IbvTransport {
        // A backstop: the link's thread admits a part only at the length a checked frame
        // header announced (framing::ReceiveGate), never more than a frame the agent
        // would accept.
        options.max_large_message = options.max_large_message.min(MAX_PART);
        let descriptor = domain_descriptor(&selection);
        IbvTransport {
            host,
            selection,
            options,
            descriptor,
            listening: None,
        }
    }

    /// The device, port and GID in use.
    pub fn selection(&self) -> &IbvSelection {
        &self.selection
    }
}

/// What gives the RPC agent the `ibv` transport: as a [`TransportPlugin`]
/// (`IbvPlugin::default().into()`) in `RpcOptions::transport_plugins`.
#[derive(Debug, Clone, Default)]
pub struct IbvPlugin {
    /// The device, port and GID to use; `None` reads `RDZV_IB_DEVICE`, `RDZV_IB_PORT` and
    /// `RDZV_IB_GID_INDEX` when the agent starts.
    pub config: Option<IbvConfig>,
    /// The connections' tunables.
    pub options: ConnectionOptions,
}

impl IbvPlugin {
    /// The transport for a worker listening on `host`.
    ///
    /// # Errors
    /// [`TransportError::Unavailable`], with the probe's [`IbvNotViable`] as its source,
    /// when RDMA is not viable here.
    pub fn open(&self, host: IpAddr) -> Result<Box<dyn Transport + Send>, TransportError> {
        let config = match &self.config {
            Some(config) => config.clone(),
            None => IbvConfig::from_process_env().map_err(|e| not_viable(e.into()))?,
        };
        let transport = IbvTransport::probed(host, &config, self.options.clone());
        Ok(Box::new(transport.map_err(not_viable)?))
    }
}

impl From<IbvPlugin> for TransportPlugin {
    fn from(plugin: IbvPlugin) -> TransportPlugin {
        TransportPlugin::new(TransportKind::Ibv, move |host| plugin.open(host))
    }
}

fn not_viable(reason: IbvNotViable) -> TransportError {
    TransportError::Unavailable {
        transport: TransportKind::Ibv,
        source: Box::new(reason),
    }
}

/// Sets the queue pair up over `stream` and starts its link.
fn establish(
    mut stream: TcpStream,
    selection: &IbvSelection,
    options: &ConnectionOptions,
    peer: &str,
) -> io::Result<Arc<Link>> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(SETUP_TIMEOUT))?;
    stream.set_write_timeout(Some(SETUP_TIMEOUT))?;
    let connection = IbvConnection::connect(selection, &mut stream, options)
        .map_err(|e| io::Error::other(ErrorChain(&e).to_string()))?;
    link::start(connection, stream, peer, RECEIVE_LIMITS)
}

impl Transport for IbvTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Ibv
    }

    fn domain_descriptor(&self) -> &str {
        &self.descriptor
    }

    fn listen(&mut self) -> Result<String, TransportError> {
        let bind = SocketAddr::new(self.host, 0);
        let listen_error = |source| TransportError::Listen {
            address: format_address(bind),
            source,
        };
        let listener = TcpListener::bind(bind).map_err(listen_error)?;
        let address = format_address(listener.local_addr().map_err(listen_error)?);
        let (selection, options, shown) = (
            self.selection.clone(),
            self.options.clone(),
            address.clone(),
        );
        self.listening = Some(Listening::start(
            "rdzv-ibv-accept",
            listener,
            address.clone(),
            move |listener, queue| accept_thread(listener, queue, &selection, &options, &shown),
        )?);
        Ok(address)
    }

    fn accept(&self) -> LocalBoxFuture<'_, Result<Connection, TransportError>> {
        Box::pin(async move {
            let (link, peer) = accept_next(self.listening.as_ref(), "ibv", |e| e).await?;
            Ok(connection(link, peer))
        })
    }

    fn connect<'a>(
        &'a self,
        address: &'a str,
    ) -> LocalBoxFuture<'a, Result<Connection, TransportError>> {
        Box::pin(async move {
            let addr = parse_address(address)?;
            let connect_error = |source| TransportError::Connect {
                address: address.to_string(),
                source,
            };
            let (selection, options, peer) = (
                self.selection.clone(),
                self.options.clone(),
                address.to_string(),
            );
            let link = on_thread("rdzv-ibv-connect", move || {
                TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
                    .and_then(|stream| establish(stream, &selection, &options, &peer))
            })
            .await
            .and_then(|linked| linked)
            .map_err(connect_error)?;
            Ok(connection(link, address.to_string()))
        })
    }
}

/// What the accept thread hands over: a set-up connection (with its peer), or an error.
type Accepted = io::Result<(Arc<Link>, String)>;

/// Accepts until the listener is shut down; each connection is set up on a thread of its
/// own, so that a slow or broken peer delays no other.
fn accept_thread(
    listener: &TcpListener,
    queue: &Arc<Queue<Accepted>>,
    selection: &IbvSelection,
    options: &ConnectionOptions,
    address: &str,
) {
    loop {
        let accepted = listener.accept();
        if queue.is_closed() {
            return;
        }
        match accepted {
            Ok((stream, from)) => {
                let peer = format!("ibv peer {from}");
                let (setup_queue, selection, options) =
                    (Arc::clone(queue), selection.clone(), options.clone());
                let spawned = std::thread::Builder::new()
                    .name("rdzv-ibv-setup".into())
                    .spawn(move || {
                        let linked =
                            establish(stream, &selection, &options, &peer).map(|link| (link, peer));
                        let _ = setup_queue.push(linked);
                    });
                if let Err(e) = spawned {
                    let _ = queue.push(Err(e));
                }
            }
            Err(e) => {
                tracing::debug!(%address, error = %e, "ibv accept failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// A set-up link as a connection: callers' threads queue frames for the link's thread,
/// the reader takes what it received.
fn connection(link: Arc<Link>, peer: String) -> Connection {
    let shared: Arc<str> = Arc::from(peer.as_str());
    Connection {
        sender: Box::new(IbvSender {
            link: Arc::clone(&link),
            peer: Arc::clone(&shared),
        }),
        receiver: Box::new(IbvReceiver {
            link: Arc::clone(&link),
            assembler: Assembler::new(&peer),
            peer: shared,
        }),
        control: Arc::new(IbvControl { link }),
        peer,
    }
}

/// Moves one connection's queue pair to the error state, from any thread, as a failing
/// device or link would (see [`Link::abort_queue_pair`]). A test hook.
#[doc(hidden)]
#[derive(Clone)]
pub struct QueuePairAbort {
    link: Arc<Link>,
}

impl QueuePairAbort {
    /// Has the link's thread move the queue pair to the error state; pending work then
    /// fails with `IBV_WC_WR_FLUSH_ERR`.
    pub fn abort(&self) {
        self.link.abort_queue_pair();
    }
}

/// The [`QueuePairAbort`] of an ibv connection's receiving half; `None` when it is not
/// an ibv one. A test hook.
#[doc(hidden)]
pub fn queue_pair_abort(receiver: &dyn FrameReceiver) -> Option<QueuePairAbort> {
    let receiver = receiver.as_any()?.downcast_ref::<IbvReceiver>()?;
    Some(QueuePairAbort {
        link: Arc::clone(&receiver.link),
    })
}

/// Queues `frame` for the link's thread, which keeps its buffers until the peer read
/// them; the bytes it puts on the wire.
fn queue_frame(link: &Link, peer: &str, frame: OwnedFrame) -> Result<u64, TransportError> {
    // Refuse a frame the core would not decode here, with the frame's error.
    if let Err(source) = frame.encode_head() {
        return Err(TransportError::Encode {
            peer: peer.to_string(),
            source,
        });
    }
    let len = frame.encoded_len() as u64;
    if link.failure().is_some() {
        return Err(stopped(link, peer));
    }
    match link.outgoing.push(frame) {
        Ok(()) => {
            link.wake();
            Ok(len)
        }
        Err(_) => Err(stopped(link, peer)),
    }
}

fn stopped(link: &Link, peer: &str) -> TransportError {
    let source = match link.failure() {
        Some(failure) => io::Error::new(io::ErrorKind::BrokenPipe, failure),
        None => io::Error::new(io::ErrorKind::BrokenPipe, "the pipe is closed"),
    };
    TransportError::Io {
        op: "send to",
        peer: peer.to_string(),
        source,
    }
}

/// The link's next message, as the assembler takes it.
fn link_message(
    link: &Link,
    peer: &str,
    message: Option<Result<Vec<u8>, LinkError>>,
) -> Result<Option<Vec<u8>>, TransportError> {
    link.took_message();
    match message {
        Some(Ok(message)) => Ok(Some(message)),
        Some(Err(reason)) => Err(TransportError::Io {
            op: "receive from",
            peer: peer.to_string(),
            source: io::Error::new(io::ErrorKind::ConnectionAborted, reason),
        }),
        None => Ok(None),
    }
}

/// The sending half: any thread queues frames for the link's thread.
struct IbvSender {
    link: Arc<Link>,
    peer: Arc<str>,
}

impl FrameSender for IbvSender {
    fn send(&mut self, frame: &OwnedFrame) -> Result<u64, TransportError> {
        // Only small frames come this way (acks, goodbyes): the lane hands over the
        // frames it owns with `send_owned`.
        queue_frame(&self.link, &self.peer, frame.clone())
    }

    fn send_owned(
        &mut self,
        frame: OwnedFrame,
    ) -> Result<(u64, Option<OwnedFrame>), TransportError> {
        // The link's thread keeps the buffers until the peer read them (zero-copy).
        queue_frame(&self.link, &self.peer, frame).map(|sent| (sent, None))
    }
}

impl Drop for IbvSender {
    fn drop(&mut self) {
        self.link.finish_sending();
    }
}

/// The receiving half: its reader thread blocks on the link's queue, or a caller polls
/// it.
struct IbvReceiver {
    link: Arc<Link>,
    peer: Arc<str>,
    assembler: Assembler,
}

impl FrameReceiver for IbvReceiver {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn recv(&mut self, limits: FrameLimits) -> Result<Option<IncomingFrame>, TransportError> {
        while !self.assembler.ended() {
            let message = self.link.incoming.pop_blocking();
            let message = link_message(&self.link, &self.peer, message);
            match self.assembler.feed(message, limits)? {
                Fed::Frame(frame) => return Ok(Some(frame)),
                Fed::More => {}
                Fed::End => break,
            }
        }
        Ok(None)
    }

    fn try_recv(&mut self, limits: FrameLimits) -> Result<TryRecv, TransportError> {
        while !self.assembler.ended() {
            let message = match self.link.incoming.try_pop() {
                Some(message) => Some(message),
                // Closed: nothing is pushed any more, so a second look is final (the
                // last message may have come between the two).
                None if self.link.incoming.is_closed() => self.link.incoming.try_pop(),
                None => return Ok(TryRecv::Empty),
            };
            let message = link_message(&self.link, &self.peer, message);
            match self.assembler.feed(message, limits)? {
                Fed::Frame(frame) => return Ok(TryRecv::Frame(frame)),
                Fed::More => {}
                Fed::End => break,
            }
        }
        Ok(TryRecv::Closed)
    }

    fn arm(&mut self) -> Result<bool, TransportError> {
        // Every push signals a sleeper, so "armed" only means nothing is there yet.
        Ok(!self.assembler.ended() && self.link.incoming.is_idle())
    }
}

impl Drop for IbvReceiver {
    fn drop(&mut self) {
        self.link.drop_receiver();
    }
}

/// How a reader sleeps until the link's thread hands it a message, and how the link
/// ends from any thread: queued frames still go, then the end of the stream; the
/// reader sees the end at once.
struct IbvControl {
    link: Arc<Link>,
}

impl Control for IbvControl {
    fn wait(&self, timeout: Duration) -> bool {
        self.link.incoming.wait_ready(timeout);
        // A gone peer shows as a failure message or the end of the queue.
        false
    }

    fn kick(&self) {
        self.link.incoming.kick();
    }

    fn stop(&self) {
        self.link.outgoing.close();
        drop(self.link.incoming.close_and_take());
        self.link.drop_receiver();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ibv::topology::{Gid, Mtu};
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn selection(link_layer: LinkLayer, gid_type: GidType, gid: Gid) -> IbvSelection {
        IbvSelection {
            device: "mlx5_0".into(),
            port: 1,
            link_layer,
            lid: 7,
            gid,
            gid_index: 3,
            gid_type,
            active_mtu: Some(Mtu::B4096),
            max_msg_size: 1 << 30,
            speed: None,
        }
    }

    #[test]
    fn a_part_is_never_larger_than_a_frame_the_agent_accepts() {
        let gid = Gid::default();
        let transport = IbvTransport::with_selection(
            IpAddr::from([127, 0, 0, 1]),
            selection(LinkLayer::InfiniBand, GidType::InfiniBand, gid),
            ConnectionOptions::default(),
        );
        assert_eq!(transport.options.max_large_message, 1 << 30);
        let small = ConnectionOptions {
            max_large_message: 4096,
            ..ConnectionOptions::default()
        };
        let transport = IbvTransport::with_selection(
            IpAddr::from([127, 0, 0, 1]),
            selection(LinkLayer::InfiniBand, GidType::InfiniBand, gid),
            small,
        );
        assert_eq!(transport.options.max_large_message, 4096);
    }

    #[test]
    fn descriptors_say_which_ports_can_reach_each_other() {
        let ib_gid = Gid([
            0xfe, 0x80, 0, 0, 0, 0, 0, 0x12, 0xaa, 0xbb, 0, 0, 0, 0, 0, 2,
        ]);
        let ib = selection(LinkLayer::InfiniBand, GidType::InfiniBand, ib_gid);
        assert_eq!(domain_descriptor(&ib), "ibv:ib:fe80000000000012");
        // Another port of the same subnet, on another device: the same domain.
        let other = IbvSelection {
            device: "mlx5_3".into(),
            port: 2,
            gid: Gid([
                0xfe, 0x80, 0, 0, 0, 0, 0, 0x12, 0x11, 0x22, 0, 0, 0, 0, 0, 9,
            ]),
            ..ib.clone()
        };
        assert_eq!(domain_descriptor(&ib), domain_descriptor(&other));
        let unspecified = selection(LinkLayer::Unspecified, GidType::InfiniBand, ib_gid);
        assert_eq!(domain_descriptor(&unspecified), "ibv:ib:fe80000000000012");
        let v2 = selection(
            LinkLayer::Ethernet,
            GidType::RoceV2,
            Gid::from(Ipv4Addr::new(10, 0, 2, 15)),
        );
        assert_eq!(domain_descriptor(&v2), "ibv:roce-v2");
        let v1 = selection(
            LinkLayer::Ethernet,
            GidType::RoceV1,
            Gid::from(Ipv6Addr::new(0xfe80, 0, 0, 0, 1, 2, 3, 4)),
        );
        assert_eq!(domain_descriptor(&v1), "ibv:roce-v1:fe80000000000000");
        let unknown = selection(LinkLayer::Ethernet, GidType::Unknown, ib_gid);
        assert_eq!(domain_descriptor(&unknown), "ibv:roce-unknown");
        let odd = selection(LinkLayer::Unknown(9), GidType::Unknown, ib_gid);
        assert_eq!(domain_descriptor(&odd), "ibv:unknown(9)");
    }

    #[test]
    fn addresses_round_trip() {
        let v4: SocketAddr = "10.0.2.15:40123".parse().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(format_address(v4), "ibv://10.0.2.15:40123");
        assert_eq!(parse_address("ibv://10.0.2.15:40123").ok(), Some(v4));
        let v6: SocketAddr = "[fe80::1]:7".parse().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(parse_address(&format_address(v6)).ok(), Some(v6));
        for bad in [
            "tcp://10.0.2.15:1",
            "ibv://",
            "ibv://10.0.2.15",
            "ibv://host:1",
            "ibv://10.0.2.15:0",
            "ibv://10.0.2.15:99999",
            "ibv://fe80::1:7",
        ] {
            assert!(
                matches!(
                    parse_address(bad),
                    Err(TransportError::BadAddress {
                        transport: "ibv",
                        ..
                    })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn not_viable_here_says_why() {
        // On hosts with a verbs device this checks nothing but the kind.
        let plugin = TransportPlugin::from(IbvPlugin::default());
        assert_eq!(plugin.kind(), TransportKind::Ibv);
        match plugin.open(IpAddr::V4(Ipv4Addr::LOCALHOST)) {
            Ok(transport) => {
                assert_eq!(transport.kind(), TransportKind::Ibv);
                assert!(transport.domain_descriptor().starts_with("ibv:"));
            }
            Err(error) => {
                let reason = error.to_string();
                assert!(
                    reason.starts_with("the ibv transport is not viable here: "),
                    "{reason}"
                );
                println!("ibv not viable here: {reason}");
            }
        }
        // A configuration that names no existing device is never viable.
        let missing = IbvPlugin {
            config: Some(IbvConfig {
                device: Some("rdzv-no-such-device".into()),
                ..IbvConfig::default()
            }),
            ..IbvPlugin::default()
        };
        let reason = missing
            .open(IpAddr::V4(Ipv4Addr::LOCALHOST))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            reason.starts_with("the ibv transport is not viable here: "),
            "{reason}"
        );
        assert!(IbvTransport::new(
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            missing.config.as_ref().unwrap_or(&IbvConfig::default())
        )
        .is_err());
    }
}
