//! Checks the options that need no peer, probes what this process can run, and lets
//! the core rank the offer: [`init_rpc`](super::init_rpc) and [`RpcOptions::check`]
//! both start here; so does the host guess for listening.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::sync::Arc;

use rdzv_core::negotiate::{rank, RankError, Ranked, Ranking, TransportKind};

use crate::rpc::device::Devices;
use crate::rpc::error::{InitError, TransportError};
use crate::rpc::handler::Handler;
use crate::rpc::options::{RpcOptions, RESERVED_PREFIX};
use crate::rpc::shm_transport::ShmTransport;
use crate::rpc::transport::Transport;

impl RpcOptions {
    /// What [`init_rpc`](crate::rpc::init_rpc) would offer peers with these options in this process, or the
    /// error it would give for them, without joining a group, listening or starting a
    /// thread: the same probes (shm's host identity and a test allocation, the listed
    /// transport plugins opened, the device runtimes, each listed channel's viability)
    /// and the same ranking ([`rdzv_core::negotiate::rank`]). Transports and channels come
    /// highest priority first; [`Ranked::refused`] says what was left out and why.
    /// Options that need the group (`init_method`, device maps) are not checked.
    ///
    /// ```no_run
    /// let mut options = rdzv_uring::rpc::RpcOptions::default();
    /// options.channels = Some(vec!["cma".into(), "basic".into()]);
    /// match options.check() {
    ///     Ok(offer) => println!("offers {:?} and {:?}", offer.transports, offer.channels),
    ///     Err(e) => eprintln!("init_rpc would fail: {e}"),
    /// }
    /// ```
    ///
    /// # Errors
    /// [`InitError::Offer`] / [`InitError::InvalidOption`] for unusable options,
    /// [`InitError::HandlerExists`] for a reserved or repeated handler name, exactly as
    /// [`init_rpc`](crate::rpc::init_rpc) gives them.
    pub fn check(&self) -> Result<Ranked<String>, InitError> {
        probe(self).map(|probed| probed.offer)
    }
}

/// `rank`'s refusal as the error `init_rpc` gives.
fn rank_error(error: RankError) -> InitError {
    let option = error.option();
    match error {
        RankError::Names { source, .. } => InitError::Offer {
            option,
            source: Box::new(source),
        },
        other => InitError::InvalidOption {
            option,
            reason: other.to_string(),
        },
    }
}

/// What probing the options found: the offer, and what was opened to make it.
pub(crate) struct Probed {
    pub(crate) offer: Ranked<String>,
    /// The shm transport, when it is viable and offered.
    pub(crate) shm: Option<ShmTransport>,
    /// The plugged-in transports that are viable and offered.
    pub(crate) plugged: Vec<(TransportKind, Box<dyn Transport + Send>)>,
    pub(crate) devices: Devices,
    pub(crate) handlers: HashMap<String, Arc<dyn Handler>>,
}

/// Checks the options that need no peer and probes what this process can run (shm, the
/// listed transport plugins, the device runtimes, the channels), then lets the core
/// rank the offer ([`rdzv_core::negotiate::rank`]). [`init_rpc`](crate::rpc::init_rpc) and
/// [`RpcOptions::check`] both start here.
pub(crate) fn probe(options: &RpcOptions) -> Result<Probed, InitError> {
    if options.num_worker_threads == 0 {
        return Err(InitError::InvalidOption {
            option: "num_worker_threads",
            reason: "at least one thread must run handlers".into(),
        });
    }
    if options.mpt_connections == 0
        || options.mpt_connections > crate::channel::mpt::MAX_CONNECTIONS
    {
        return Err(InitError::InvalidOption {
            option: "mpt_connections",
            reason: format!(
                "{} connections: a pipe opens 1 to {}",
                options.mpt_connections,
                crate::channel::mpt::MAX_CONNECTIONS
            ),
        });
    }
    // shm's viability: the host identity and a test allocation.
    let shm = ShmTransport::new();
    let plugged = open_plugins(options)?;
    let mut here = vec![(
        TransportKind::Shm,
        shm.as_ref().map(|_| ()).map_err(ToString::to_string),
    )];
    here.extend(plugged.iter().map(|(kind, opened)| {
        (
            *kind,
            opened.as_ref().map(|_| ()).map_err(ToString::to_string),
        )
    }));
    here.push((TransportKind::Tcp, Ok(())));
    // The runtimes open whatever the channels: they also count the devices that the
    // device maps are checked against.
    let devices = Devices::open(&options.device_plugins).map_err(InitError::DevicePlugins)?;
    let offer = rank(
        options.transports.as_deref(),
        options.channels.as_deref(),
        &here,
        &crate::rpc::tensors::RUNNABLE,
        |kind| crate::rpc::tensors::domain_descriptor(kind, &devices),
    )
    .map_err(rank_error)?;
    for refused in &offer.refused {
        tracing::info!(reason = %refused.reason, "the {} is not offered", refused.kind);
    }
    let offered = |kind: TransportKind| offer.transports.iter().any(|&(k, _)| k == kind);
    let shm = shm.ok().filter(|_| offered(TransportKind::Shm));
    let plugged = plugged
        .into_iter()
        .filter_map(|(kind, opened)| Some((kind, opened.ok()?)))
        .filter(|(kind, _)| offered(*kind))
        .collect();

    let mut handlers: HashMap<String, Arc<dyn Handler>> = HashMap::new();
    for (handler_name, handler) in &options.handlers {
        if handler_name.starts_with(RESERVED_PREFIX)
            || handlers
                .insert(handler_name.clone(), Arc::clone(handler))
                .is_some()
        {
            return Err(InitError::HandlerExists {
                name: handler_name.clone(),
            });
        }
    }
    Ok(Probed {
        offer,
        shm,
        plugged,
        devices,
        handlers,
    })
}

/// A plugged-in transport opened for this worker, or why it is not viable.
type Plugged = (
    TransportKind,
    Result<Box<dyn Transport + Send>, TransportError>,
);

/// Opens the plugins whose kind the `transports` option may offer (all of them when it
/// is `None`), first plugin of a kind only.
fn open_plugins(options: &RpcOptions) -> Result<Vec<Plugged>, InitError> {
    let mut opened: Vec<Plugged> = Vec::new();
    let mut host = None;
    for plugin in &options.transport_plugins {
        let kind = plugin.kind();
        if matches!(kind, TransportKind::Tcp | TransportKind::Shm) {
            return Err(InitError::InvalidOption {
                option: "transport_plugins",
                reason: format!("transport {kind} is built in and cannot be plugged in"),
            });
        }
        // A bad option is reported by `rank`, with its reason.
        let listed = Ranking::<TransportKind>::from_option(options.transports.as_deref())
            .is_ok_and(|ranking| ranking.iter().any(|(k, _)| k == kind));
        if !listed || opened.iter().any(|(k, _)| *k == kind) {
            continue;
        }
        let host = *host.get_or_insert_with(|| options.listen_host.unwrap_or_else(guess_host));
        opened.push((kind, plugin.open(host)));
    }
    Ok(opened)
}

/// PyTorch's `guessAddress`: an address of the host name that can be bound, else
/// 127.0.0.1.
pub(crate) fn guess_host() -> IpAddr {
    let fallback = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let host = match std::fs::read_to_string("/proc/sys/kernel/hostname") {
        Ok(host) => host.trim().to_string(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the host name; RPC listens on 127.0.0.1");
            return fallback;
        }
    };
    let found = (host.as_str(), 0)
        .to_socket_addrs()
        .ok()
        .into_iter()
        .flatten()
        .find(|addr| std::net::TcpListener::bind(SocketAddr::new(addr.ip(), 0)).is_ok());
    match found {
        Some(addr) => addr.ip(),
        None => {
            tracing::warn!(%host, "no bindable address for the host name; RPC listens on 127.0.0.1");
            fallback
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::message::Message;
    use crate::rpc::tcp_transport::TcpTransport;
    use crate::rpc::transport::TransportPlugin;
    use rdzv_core::negotiate::ChannelKind;

    /// The transports `rank` offers (with `basic` as the only channel), as `init_rpc`
    /// reports them.
    fn ranked_transports(
        names: Option<&[String]>,
        shm_viable: Result<(), &str>,
        plugins: &[(TransportKind, Option<&str>)],
    ) -> Result<Vec<(TransportKind, i64)>, InitError> {
        let mut here = vec![(TransportKind::Shm, shm_viable.map_err(str::to_string))];
        here.extend(
            plugins
                .iter()
                .map(|&(kind, reason)| (kind, reason.map_or(Ok(()), |r| Err(r.to_string())))),
        );
        here.push((TransportKind::Tcp, Ok(())));
        let basic = ["basic".to_string()];
        rank(
            names,
            Some(&basic[..]),
            &here,
            &crate::rpc::tensors::RUNNABLE,
            Ok::<_, String>,
        )
        .map(|offer| offer.transports)
        .map_err(rank_error)
    }

    /// The channels `rank` offers (over tcp), as `init_rpc` reports them.
    fn ranked_channels(
        names: Option<&[String]>,
        viability: impl Fn(ChannelKind) -> Result<String, String>,
    ) -> Result<Vec<(ChannelKind, i64, String)>, InitError> {
        let here = [(TransportKind::Tcp, Ok(()))];
        rank(
            None,
            names,
            &here,
            &crate::rpc::tensors::RUNNABLE,
            viability,
        )
        .map(|offer| offer.channels)
        .map_err(rank_error)
    }

    #[test]
    fn transports_option() {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let viable = Ok(());
        // By default shm comes first where it works (TensorPipe's priorities).
        assert!(matches!(
            ranked_transports(None, viable, &[]).as_deref(),
            Ok([(TransportKind::Shm, _), (TransportKind::Tcp, 0)])
        ));
        assert!(matches!(
            ranked_transports(None, Err("no memfd here"), &[]).as_deref(),
            Ok([(TransportKind::Tcp, 0)])
        ));
        assert!(matches!(
            ranked_transports(Some(&names(&["uv"])), viable, &[]).as_deref(),
            Ok([(TransportKind::Tcp, 0)])
        ));
        assert!(matches!(
            ranked_transports(Some(&names(&["tcp", "shm"])), viable, &[]).as_deref(),
            Ok([(TransportKind::Tcp, _), (TransportKind::Shm, _)])
        ));
        assert!(matches!(
            ranked_transports(Some(&names(&["shm"])), viable, &[]).as_deref(),
            Ok([(TransportKind::Shm, _)])
        ));
        let unknown = ranked_transports(Some(&names(&["carrier-pigeon"])), viable, &[]);
        assert!(matches!(unknown, Err(InitError::Offer { .. })));
        let text = unknown.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("carrier-pigeon"), "{text}");
        assert!(matches!(
            ranked_transports(Some(&names(&["ibv", "tcp"])), viable, &[]),
            Err(InitError::InvalidOption { .. })
        ));
        assert!(matches!(
            ranked_transports(Some(&names(&[])), viable, &[]),
            Err(InitError::InvalidOption { .. })
        ));
    }

    #[test]
    fn shm_that_is_not_viable_is_not_offered() {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let not_viable = Err("no /proc/sys/kernel/random/boot_id");
        assert!(matches!(
            ranked_transports(None, not_viable, &[]).as_deref(),
            Ok([(TransportKind::Tcp, 0)])
        ));
        assert!(matches!(
            ranked_transports(Some(&names(&["shm", "tcp"])), not_viable, &[]).as_deref(),
            Ok([(TransportKind::Tcp, _)])
        ));
        let only_shm = ranked_transports(Some(&names(&["shm"])), not_viable, &[]);
        let text = only_shm.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("no transport left"), "{text}");
        assert!(text.contains("boot_id"), "{text}");
    }

    /// A plugin of `kind` that opens a tcp transport, or is not viable with `reason`.
    fn fake_plugin(kind: TransportKind, viable: Result<(), &'static str>) -> TransportPlugin {
        TransportPlugin::new(kind, move |host| {
            viable.map_err(|reason| TransportError::Unavailable {
                transport: kind,
                source: reason.into(),
            })?;
            Ok(Box::new(TcpTransport::new(host)))
        })
    }

    #[test]
    fn plugged_in_transports_count_as_implemented() {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let ibv = [(TransportKind::Ibv, None)];
        assert!(matches!(
            ranked_transports(Some(&names(&["ibv", "tcp"])), Ok(()), &ibv).as_deref(),
            Ok([(TransportKind::Ibv, _), (TransportKind::Tcp, _)])
        ));
        assert!(matches!(
            ranked_transports(None, Ok(()), &ibv).as_deref(),
            Ok([
                (TransportKind::Shm, 200),
                (TransportKind::Ibv, 100),
                (TransportKind::Tcp, 0)
            ])
        ));
        let not_viable = [(TransportKind::Ibv, Some("no verbs here"))];
        assert!(matches!(
            ranked_transports(Some(&names(&["ibv", "tcp"])), Ok(()), &not_viable).as_deref(),
            Ok([(TransportKind::Tcp, _)])
        ));
        let only_ibv = ranked_transports(Some(&names(&["ibv"])), Ok(()), &not_viable);
        let text = only_ibv.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("no transport left: no verbs here"), "{text}");
    }

    #[test]
    fn plugins_are_opened_when_listed() {
        let mut options = RpcOptions::new("file:///nonexistent");
        options.listen_host = Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
        options.transport_plugins = vec![
            fake_plugin(TransportKind::Ibv, Err("no verbs here")),
            fake_plugin(TransportKind::Ibv, Ok(())),
        ];
        let debug = format!("{options:?}");
        assert!(debug.contains("transport_plugins: [Ibv, Ibv]"), "{debug}");
        // The first plugin of a kind wins.
        let opened = open_plugins(&options).unwrap_or_default();
        assert!(matches!(
            opened.as_slice(),
            [(TransportKind::Ibv, Err(reason))] if reason.to_string() == "the ibv transport is not viable here: no verbs here"
        ));
        options.transports = Some(vec!["tcp".into()]);
        assert!(open_plugins(&options).is_ok_and(|o| o.is_empty()));
        options.transports = Some(vec!["ibv".into(), "tcp".into()]);
        options.transport_plugins = vec![fake_plugin(TransportKind::Ibv, Ok(()))];
        assert!(open_plugins(&options)
            .is_ok_and(|o| matches!(o.as_slice(), [(TransportKind::Ibv, Ok(_))])));
        options.transport_plugins = vec![fake_plugin(TransportKind::Tcp, Ok(()))];
        assert!(matches!(
            open_plugins(&options),
            Err(InitError::InvalidOption {
                option: "transport_plugins",
                ..
            })
        ));
    }

    #[test]
    fn channels_option() {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let viable = |kind: ChannelKind| Ok(format!("{kind}:here"));
        let kinds = |r: Result<Vec<(ChannelKind, i64, String)>, InitError>| {
            r.map(|v| v.into_iter().map(|(k, p, _)| (k, p)).collect::<Vec<_>>())
        };
        assert!(matches!(
            kinds(ranked_channels(None, viable)).as_deref(),
            Ok([
                (ChannelKind::Xth, 1300),
                (ChannelKind::Cma, 1200),
                (ChannelKind::Mpt, 1100),
                (ChannelKind::Basic, 1000),
                (ChannelKind::CudaXth, 400),
                (ChannelKind::CudaIpc, 300),
                (ChannelKind::CudaGdr, 200),
                (ChannelKind::CudaBasic, 0)
            ])
        ));
        assert!(matches!(
            kinds(ranked_channels(Some(&names(&["basic"])), viable)).as_deref(),
            Ok([(ChannelKind::Basic, 0)])
        ));
        assert!(matches!(
            kinds(ranked_channels(Some(&names(&["cma", "basic"])), viable)).as_deref(),
            Ok([(ChannelKind::Cma, 1), (ChannelKind::Basic, 0)])
        ));
        assert!(matches!(
            ranked_channels(Some(&names(&["basic", "basic"])), viable),
            Err(InitError::Offer { .. })
        ));
        // Unknown names, and channels this build does not run, are errors.
        assert!(matches!(
            ranked_channels(Some(&names(&["carrier-pigeon"])), viable),
            Err(InitError::Offer { .. })
        ));
        let unknown = ranked_channels(Some(&names(&["cuda_magic", "basic"])), viable);
        assert!(matches!(unknown, Err(InitError::Offer { .. })));
        // A channel that cannot work here is left out; if nothing is left, that is an
        // error that says why.
        let no_cma = |kind: ChannelKind| match kind {
            ChannelKind::Cma => Err("cma channel not viable: ptrace_scope is 3".to_string()),
            other => Ok(format!("{other}:here")),
        };
        assert!(matches!(
            kinds(ranked_channels(None, no_cma)).as_deref(),
            Ok([
                (ChannelKind::Xth, _),
                (ChannelKind::Mpt, _),
                (ChannelKind::Basic, _),
                (ChannelKind::CudaXth, _),
                (ChannelKind::CudaIpc, _),
                (ChannelKind::CudaGdr, _),
                (ChannelKind::CudaBasic, _)
            ])
        ));
        let only_cma = ranked_channels(Some(&names(&["cma"])), no_cma);
        let text = only_cma.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("no channel left"), "{text}");
        assert!(text.contains("ptrace_scope is 3"), "{text}");
        // Descriptors come from the viability check.
        let offered = ranked_channels(Some(&names(&["xth"])), viable).unwrap_or_default();
        assert_eq!(offered, vec![(ChannelKind::Xth, 0, "xth:here".to_string())]);
    }

    #[test]
    fn check_gives_the_error_init_rpc_gives() {
        let bad: [fn(&mut RpcOptions); 7] = [
            |o| o.channels = Some(vec!["carrier-pigeon".into()]),
            |o| o.transports = Some(vec!["ibv".into()]),
            |o| o.transports = Some(Vec::new()),
            |o| o.channels = Some(vec!["cuda_ipc".into()]),
            |o| o.num_worker_threads = 0,
            |o| o.mpt_connections = 0,
            |o| {
                o.transports = Some(vec!["shm".into()]);
                o.channels = Some(vec!["mpt".into()]);
            },
        ];
        for (i, spoil) in bad.iter().enumerate() {
            let mut options = RpcOptions::new("file:///nonexistent");
            options.listen_host = Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
            spoil(&mut options);
            let checked = options.check().map(|_| ()).map_err(|e| e.to_string());
            let started = super::super::init_rpc("w", 0, Some(1), options)
                .map(|_| ())
                .map_err(|e| e.to_string());
            assert!(checked.is_err(), "case {i}: check passed");
            assert_eq!(checked, started, "case {i}");
        }
        let reserved = RpcOptions::new("file:///nonexistent").with_handler(
            "__rdzv_group_join",
            |_: &crate::rpc::CallContext, m: Message| -> Result<Message, String> { Ok(m) },
        );
        assert!(matches!(
            reserved.check(),
            Err(InitError::HandlerExists { .. })
        ));
    }

    #[test]
    fn check_offers_what_is_viable_by_priority() {
        let mut options = RpcOptions::new("file:///nonexistent");
        options.listen_host = Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
        let offer = options
            .check()
            .unwrap_or_else(|e| panic!("default options: {e}"));
        assert_eq!(offer.transports.last(), Some(&(TransportKind::Tcp, 0)));
        assert!(offer
            .channels
            .iter()
            .any(|(k, _, d)| *k == ChannelKind::Basic && !d.is_empty()));
        for pair in offer.channels.windows(2) {
            assert!(pair[0].1 > pair[1].1, "{:?}", offer.channels);
        }
        // No CUDA runtime was given: the lending CUDA channels are refused, saying why.
        assert!(offer.refused.iter().any(|r| {
            r.kind == rdzv_core::negotiate::Refusable::Channel(ChannelKind::CudaIpc)
                && r.reason.contains("CUDA")
        }));
        options.transports = Some(vec!["tcp".into()]);
        options.channels = Some(vec!["mpt".into(), "basic".into()]);
        let offer = options.check().unwrap_or_else(|e| panic!("tcp, mpt: {e}"));
        assert_eq!(offer.transports, vec![(TransportKind::Tcp, 0)]);
        assert_eq!(
            offer
                .channels
                .iter()
                .map(|&(k, p, _)| (k, p))
                .collect::<Vec<_>>(),
            vec![(ChannelKind::Mpt, 1), (ChannelKind::Basic, 0)]
        );
    }
}
