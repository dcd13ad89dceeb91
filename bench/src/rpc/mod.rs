//! `rdzv bench rpc`: the RPC agent's echo latency and bandwidth per payload size, for each
//! transport and channel side by side, next to a raw TCP ping-pong between the same two
//! processes (the physical limit) and, with `--device cuda:N`, the GPU's device-to-device
//! and pinned host↔device copy bandwidths (the CUDA limits).
//!
//! Two processes take part: a serving side (rank 1: it hosts the store, answers echoes
//! and runs the raw echo server) and a measuring side (rank 0: it times). Locally the
//! command starts the serving side as a child process on 127.0.0.1; between two hosts,
//! `--listen [HOST:]PORT` is the serving side and `--connect HOST:PORT` the measuring one,
//! as with `ib_write_bw`. The measuring side decides what runs and the serving side
//! agrees or says why not (`session`). Rows carry `bench` ("rpc"), `mode` ("local" or
//! "two-host"), `transport`, `channel`, `payload_bytes`, `iters`, `p50_us`, `p99_us` and
//! `gbytes_per_s` (echo bandwidth, both directions counted); a transport that cannot run
//! gets a `skipped` line with its reason instead.
//!
//! | module | does |
//! |---|---|
//! | `session` | the two sides, the plan/reply/done keys, the `rdzvbench://` rendezvous |
//! | `pair` | rank 0's `rpc_sync` echoes over one transport and channel |
//! | `raw` | the raw-tcp echo server and ping-pong |
//! | `cuda` | the CUDA limit rows: device to device, pinned host to device and back |
//! | `viability` | which transports and channels can run here, and why not |
//! | `payload` | the bytes echoed and the check that they came back |
//! | `row` | rows, skips, JSON and the side-by-side table |
//!
//! This module parses options and starts the sides; it measures nothing itself.

mod cuda;
mod pair;
mod payload;
mod raw;
mod row;
mod session;
mod spec;
mod viability;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs as _, UdpSocket};
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use rdzv_core::device::{Device, DeviceType};
use rdzv_core::negotiate::{ChannelKind, TransportKind};

use super::harness::{progress_bar, start_server, write_report, PeerProcess};
use super::BenchError;
use row::{RunMode, Skip};
use session::Measurement;
use spec::{Channels, Pair};

const TWO_HOST_HELP: &str = "\
Two hosts (as with ib_write_bw):
  host A:  rdzv bench rpc --listen 29600
  host B:  rdzv bench rpc --connect hostA:29600 [--transport tcp,ibv] [--json]

The --listen side hosts a store on PORT, serves one run and exits when the other side is
done. The --connect side decides what runs: it sends the (transport, channel) pairs it can
run through that store, the listening side answers which of them it can run too (and why
not), and both then run one agent pair per accepted pair, one after the other, on store
prefixes rpc_prefix_0, rpc_prefix_1, ... of the same store. Besides PORT, the agents
listen on ephemeral ports (on the address the connecting side used, and on the connecting
side's address towards it), as does the raw-tcp echo server on the listening side. shm
runs only when both sides share a host.

In --json output, a transport that cannot run prints one line with `skipped` (the reason)
and no measurement fields.";

/// Options of `rdzv bench rpc`.
#[derive(Debug, Args)]
#[command(after_long_help = TWO_HOST_HELP)]
pub struct RpcBenchArgs {
    /// Payload sizes, comma-separated, in bytes or with a K, M or G suffix (powers of 1024:
    /// 4K, 64MiB). Default: 0,64M locally; 0,64,4K,64K,1M,16M,64M with --connect;
    /// 0,4K,1M,16M,64M,256M with a CUDA channel.
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    sizes: Option<Vec<u64>>,
    /// Round trips per size for payloads under 1 MiB.
    #[arg(long, default_value_t = 2_000)]
    iters: usize,
    /// Round trips per size for payloads of 1 MiB or more.
    #[arg(long, default_value_t = 20)]
    big_iters: usize,
    /// Transports to measure: tcp, shm, ibv (repeat the option or comma-separate).
    /// Default: each of them that both sides can run; the others are reported as skipped.
    #[arg(long = "transport", value_name = "TRANSPORT", value_delimiter = ',', value_parser = parse_transport)]
    transports: Vec<TransportKind>,
    /// Channels for the tensors (basic, cma, xth, mpt, cuda_ipc, cuda_basic; repeat or
    /// comma-separate): each transport is measured once per channel. A CUDA channel
    /// echoes a tensor on cuda:0 of each side (skipped, with the reason, without CUDA).
    /// Default: the agent's own default list, as users get it (large tensors over cma
    /// or xth where viable, else mpt over tcp, else inline); the rows then name the
    /// channel the pipe negotiated. `--channel basic` measures inline tensors only.
    /// With a CUDA channel, the default sizes are 0, 4K, 1M, 16M, 64M and 256M.
    #[arg(long = "channel", value_name = "CHANNEL", value_delimiter = ',', value_parser = parse_channel)]
    channels: Vec<ChannelKind>,
    /// Also measure the limits for CUDA tensors on this GPU (`cuda:N`): device-to-device
    /// copies (`cuda-d2d`) and pinned host-to-device and device-to-host copies
    /// (`h2d-pinned`, `d2h-pinned`); skipped, with the reason, when CUDA is not usable.
    #[arg(long, value_name = "cuda:N", value_parser = parse_cuda_device)]
    device: Option<u8>,
    /// Print one JSON object per row instead of a table (and no progress bar).
    #[arg(long)]
    json: bool,
    /// Serve one two-host run: host the store on [HOST:]PORT (all interfaces by default;
    /// port 0 picks one and prints it) and answer the --connect side.
    #[arg(long, value_name = "[HOST:]PORT", conflicts_with_all = ["connect", "sizes", "transports", "channels", "device", "iters", "big_iters"])]
    listen: Option<String>,
    /// Measure against a `--listen` side at HOST:PORT.
    #[arg(long, value_name = "HOST:PORT")]
    connect: Option<String>,
    /// Run as the serving side of a local run: listen on 127.0.0.1, print the port on
    /// stdout (used by the benchmark itself).
    #[arg(long, hide = true, conflicts_with_all = ["listen", "connect"])]
    peer: bool,
}

/// Payloads of a local run when `--sizes` is not given.
const LOCAL_SIZES: [u64; 2] = [0, 64 << 20];
/// Payloads of a two-host run when `--sizes` is not given.
const TWO_HOST_SIZES: [u64; 7] = [0, 64, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20];
/// Payloads when `--sizes` is not given and a CUDA channel is measured.
const CUDA_SIZES: [u64; 6] = [0, 4 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20];
/// How long the local serving side waits for the plan.
const LOCAL_PLAN_WAIT: Duration = Duration::from_secs(60);
const BAR: &str = "{msg:>28} [{bar:40}] {pos}/{len}";

fn parse_size(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    let digits = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(digits);
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        other => return Err(format!("unknown size unit {other:?} (use K, M or G)")),
    };
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size in bytes"))?;
    let bytes = number
        .checked_mul(1 << shift)
        .filter(|&b| b <= raw::MAX_MESSAGE_BYTES)
        .ok_or_else(|| format!("{text} is above the 1 GiB the benchmark supports"))?;
    Ok(bytes)
}

fn parse_transport(text: &str) -> Result<TransportKind, String> {
    text.trim().parse().map_err(|e| format!("{e}"))
}

fn parse_channel(text: &str) -> Result<ChannelKind, String> {
    text.trim().parse().map_err(|e| format!("{e}"))
}

fn parse_cuda_device(text: &str) -> Result<u8, String> {
    let device: Device = text.trim().parse().map_err(|e| format!("{e}"))?;
    if !device.is_cuda() {
        return Err(format!(
            "{text}: only CUDA devices have a limit row (cuda:N)"
        ));
    }
    Ok(device.index().unwrap_or(0))
}

/// `[HOST:]PORT` of `--listen`.
fn parse_listen(text: &str) -> Result<SocketAddr, BenchError> {
    if let Ok(port) = text.parse::<u16>() {
        return Ok(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)));
    }
    resolve("--listen", text)
}

/// The first address `text` resolves to (`option` is the option that gave it).
fn resolve(option: &str, text: &str) -> Result<SocketAddr, BenchError> {
    text.to_socket_addrs()
        .map_err(|e| BenchError::InvalidArgument(format!("{option} {text}: {e}")))?
        .next()
        .ok_or_else(|| BenchError::InvalidArgument(format!("{option} {text}: no address")))
}

/// The pairs to measure, in column order: each transport with each channel.
fn pairs(args: &RpcBenchArgs) -> Result<Vec<Pair>, BenchError> {
    let transports = if args.transports.is_empty() {
        viability::DEFAULT_TRANSPORTS.to_vec()
    } else {
        args.transports.clone()
    };
    let channels = if args.channels.is_empty() {
        vec![Channels::Default]
    } else {
        args.channels.iter().copied().map(Channels::Only).collect()
    };
    let mut pairs = Vec::new();
    for &transport in &transports {
        for &channel in &channels {
            let pair = Pair { transport, channel };
            if pairs.contains(&pair) {
                return Err(BenchError::InvalidArgument(format!(
                    "--transport/--channel name {pair} twice"
                )));
            }
            pairs.push(pair);
        }
    }
    Ok(pairs)
}

/// `(payload bytes, iterations)` per size.
fn sizes(args: &RpcBenchArgs, mode: RunMode) -> Result<Vec<(usize, usize)>, BenchError> {
    let cuda = args
        .channels
        .iter()
        .any(|channel| channel.device_types().contains(&DeviceType::Cuda));
    let default: &[u64] = match mode {
        _ if cuda => &CUDA_SIZES,
        RunMode::Local => &LOCAL_SIZES,
        RunMode::TwoHost => &TWO_HOST_SIZES,
    };
    let given = args.sizes.as_deref().unwrap_or(default);
    if given.is_empty() {
        return Err(BenchError::invalid("--sizes lists no size"));
    }
    given
        .iter()
        .map(|&size| {
            let iters = if size >= 1 << 20 {
                args.big_iters
            } else {
                args.iters
            };
            if iters == 0 {
                return Err(BenchError::invalid(
                    "--iters and --big-iters must be at least 1",
                ));
            }
            let size = usize::try_from(size).map_err(|_| {
                BenchError::InvalidArgument(format!("--sizes: {size} bytes do not fit in memory"))
            })?;
            Ok((size, iters))
        })
        .collect()
}

/// Runs `rdzv bench rpc`.
///
/// # Errors
/// When an option is invalid, the other side cannot be started or reached, an agent
/// cannot start, a call fails, or an echo comes back different from what was sent.
pub(super) fn run(args: RpcBenchArgs) -> Result<ExitCode, BenchError> {
    if args.peer {
        return listen(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), Role::LocalPeer);
    }
    if let Some(text) = &args.listen {
        let role = if args.json {
            Role::Quiet
        } else {
            Role::Listener
        };
        return listen(parse_listen(text)?, role);
    }
    let (mode, measured) = match &args.connect {
        Some(text) => (RunMode::TwoHost, connect(&args, text)?),
        None => (RunMode::Local, local(&args)?),
    };
    let session::Outcome {
        mut rows,
        mut skips,
    } = measured;
    if let Some(ordinal) = args.device {
        let sizes = sizes(&args, mode)?;
        match cuda::not_viable(ordinal)? {
            Some(reason) => {
                for limit in [cuda::CUDA_D2D, cuda::H2D_PINNED, cuda::D2H_PINNED] {
                    skips.push(Skip {
                        transport: limit.into(),
                        channel: row::NO_CHANNEL.into(),
                        mode,
                        reason: reason.clone(),
                    });
                }
            }
            None => {
                let bar = progress_bar(args.json, BAR, Some(0));
                rows.extend(cuda::measure(ordinal, &sizes, mode, &bar)?);
                bar.finish_and_clear();
            }
        }
    }
    // Per payload: each pair in column order, then raw-tcp, then the CUDA limit.
    rows.sort_by_key(|row| row.payload_bytes);
    let report = if args.json {
        let lines = rows.iter().map(|row| row.json());
        let lines = lines.chain(skips.iter().map(|skip| skip.json()));
        lines.map(|line| format!("{line}\n")).collect()
    } else {
        row::table(&rows, &skips)
    };
    write_report(&report)?;
    Ok(ExitCode::SUCCESS)
}

/// Who runs the serving side, and what it prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// `--listen`: says where it listens and what it served, on stderr.
    Listener,
    /// `--listen --json`: says only where it listens.
    Quiet,
    /// The child of a local run: prints its port on stdout, then nothing.
    LocalPeer,
}

fn listen(bind: SocketAddr, role: Role) -> Result<ExitCode, BenchError> {
    let server = start_server(bind)?;
    let addr = server.local_addr();
    match role {
        Role::LocalPeer => write_report(&format!("{}\n", addr.port()))?,
        Role::Listener | Role::Quiet => eprintln!(
            "rdzv bench rpc: listening on {addr}; on the other host run \
             `rdzv bench rpc --connect <this host>:{}`",
            addr.port()
        ),
    }
    // This side reaches its own store over loopback when it listens everywhere.
    let own = if addr.ip().is_unspecified() {
        SocketAddr::from((Ipv4Addr::LOCALHOST, addr.port()))
    } else {
        addr
    };
    let plan_wait = (role == Role::LocalPeer).then_some(LOCAL_PLAN_WAIT);
    let served = session::serve(own, plan_wait, role == Role::Listener);
    server.shutdown();
    let served = served?;
    if role == Role::Listener {
        eprintln!("rdzv bench rpc: the run is over ({served} transport pair(s) served)");
    }
    Ok(ExitCode::SUCCESS)
}

/// A local run: a child process serves on 127.0.0.1, this one measures.
fn local(args: &RpcBenchArgs) -> Result<session::Outcome, BenchError> {
    let mut peer = PeerProcess::spawn(&["bench", "rpc", "--peer"])?;
    let localhost = IpAddr::from(Ipv4Addr::LOCALHOST);
    let measured = peer.port().and_then(|port| {
        let store = SocketAddr::new(localhost, port);
        measure(args, store, localhost, RunMode::Local)
    });
    let status = peer.finish(measured.is_ok());
    let outcome = measured?;
    status?;
    Ok(outcome)
}

/// `--connect HOST:PORT`: measures against a `--listen` side.
fn connect(args: &RpcBenchArgs, text: &str) -> Result<session::Outcome, BenchError> {
    let store = resolve("--connect", text)?;
    let local_ip = route_source(store).map_err(BenchError::io(
        "find the local address that routes to the --connect host",
    ))?;
    measure(args, store, local_ip, RunMode::TwoHost)
}

/// The measuring side against the serving side's `store`, its agents listening on
/// `local_ip`.
fn measure(
    args: &RpcBenchArgs,
    store: SocketAddr,
    local_ip: IpAddr,
    mode: RunMode,
) -> Result<session::Outcome, BenchError> {
    let bar = progress_bar(args.json, BAR, Some(0));
    let outcome = Measurement {
        store,
        local_ip,
        serving_ip: store.ip(),
        mode,
        pairs: pairs(args)?,
        sizes: sizes(args, mode)?,
        bar: &bar,
    }
    .run();
    bar.finish_and_clear();
    outcome
}

/// The local address the kernel would send from to reach `to` (no packet is sent).
fn route_source(to: SocketAddr) -> std::io::Result<IpAddr> {
    let any: SocketAddr = if to.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = UdpSocket::bind(any)?;
    socket.connect(to)?;
    Ok(socket.local_addr()?.ip())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Result<RpcBenchArgs, clap::Error> {
        use clap::Parser as _;
        #[derive(Debug, clap::Parser)]
        struct Wrapper {
            #[command(flatten)]
            args: RpcBenchArgs,
        }
        let mut argv = vec!["rpc"];
        argv.extend_from_slice(list);
        Wrapper::try_parse_from(argv).map(|w| w.args)
    }

    #[test]
    fn sizes_take_binary_suffixes_and_refuse_nonsense() {
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("64"), Ok(64));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size(" 64MiB "), Ok(64 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        for bad in ["", "K", "-1", "4X", "2G", "99999999999999999999", "1.5M"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_cuda_channel_sweeps_4k_to_256m() {
        for mode in [RunMode::Local, RunMode::TwoHost] {
            let a = args(&["--channel", "cma,cuda_ipc"]).unwrap();
            let swept: Vec<usize> = sizes(&a, mode).unwrap().iter().map(|&(s, _)| s).collect();
            assert_eq!(swept, [0, 4 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]);
        }
        let a = args(&["--channel", "cuda_basic", "--sizes", "1M"]).unwrap();
        assert_eq!(sizes(&a, RunMode::Local).unwrap(), vec![(1 << 20, 20)]);
    }

    #[test]
    fn defaults_depend_on_the_mode() {
        let a = args(&[]).unwrap();
        let local = sizes(&a, RunMode::Local).unwrap();
        assert_eq!(local, vec![(0, 2_000), (64 << 20, 20)]);
        let two_host = sizes(&a, RunMode::TwoHost).unwrap();
        assert_eq!(two_host.len(), 7);
        assert_eq!(two_host[4], (1 << 20, 20));
        assert_eq!(two_host[3], (64 << 10, 2_000));
        assert_eq!(
            pairs(&a).unwrap(),
            viability::DEFAULT_TRANSPORTS
                .iter()
                .map(|&transport| Pair {
                    transport,
                    channel: Channels::Default
                })
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn transports_and_channels_are_lists() {
        let a = args(&[
            "--transport",
            "shm,tcp",
            "--channel",
            "basic",
            "--channel",
            "cma",
        ])
        .unwrap();
        let names: Vec<String> = pairs(&a).unwrap().iter().map(Pair::to_string).collect();
        assert_eq!(names, ["shm/basic", "shm/cma", "tcp/basic", "tcp/cma"]);
        let a = args(&["--transport", "tcp"]).unwrap();
        let names: Vec<String> = pairs(&a).unwrap().iter().map(Pair::to_string).collect();
        assert_eq!(names, ["tcp/default"]);
        let a = args(&["--transport", "tcp", "--transport", "tcp"]).unwrap();
        assert!(pairs(&a).is_err());
        assert!(args(&["--transport", "carrier-pigeon"]).is_err());
        assert!(args(&["--channel", "nope"]).is_err());
    }

    #[test]
    fn devices_and_modes_are_checked_when_parsing() {
        assert_eq!(args(&["--device", "cuda:3"]).unwrap().device, Some(3));
        assert_eq!(args(&["--device", "cuda"]).unwrap().device, Some(0));
        assert!(args(&["--device", "cpu"]).is_err());
        assert!(args(&["--device", "cuda:x"]).is_err());
        assert!(args(&["--listen", "1", "--connect", "h:1"]).is_err());
        assert!(args(&["--listen", "1", "--transport", "tcp"]).is_err());
        args(&["--listen", "1", "--json"]).unwrap();
        let zero = args(&["--iters", "0"]).unwrap();
        assert!(sizes(&zero, RunMode::Local).is_err());
    }

    #[test]
    fn listen_addresses() {
        assert_eq!(
            parse_listen("29600").unwrap(),
            SocketAddr::from((Ipv4Addr::UNSPECIFIED, 29600))
        );
        assert_eq!(
            parse_listen("127.0.0.1:0").unwrap(),
            SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
        );
        assert!(parse_listen("nowhere:").is_err());
    }

    #[test]
    fn the_route_to_loopback_starts_on_loopback() {
        let ip = route_source(SocketAddr::from((Ipv4Addr::LOCALHOST, 9))).unwrap();
        assert!(ip.is_loopback());
    }
}
