//! The static rendezvous plans: what PyTorch's bundled `tcp://`, `env://` and `file://`
//! handlers (and `_create_c10d_store`) would build, decided without building it.
//!
//! A plan names the store (a TCPStore at `host:port`, hosted by this process or not, or
//! a FileStore at a path), this process's rank and the world size. Checks run in
//! PyTorch's order and fail with PyTorch's text ("Error initializing torch.distributed
//! using tcp:// rendezvous: port number missing", ...). Plans own their host and path,
//! hence `alloc`.
//!
//! Where PyTorch would accept a value that cannot work, we refuse it early, with a
//! message in the same style: a negative rank or one above `u32::MAX`, a world size above
//! `u32::MAX`, and a TCPStore world size of 0 (PyTorch's own "TCPStore world size cannot
//! be 0", raised later by the store). A negative world size means "no fixed world size",
//! as `-1` does for PyTorch's stores. A query piece that is not `key=value` is an error
//! where PyTorch crashes. Values read with `int()` accept what Python's `int()` accepts,
//! except non-ASCII digits. The Windows-only `file://` path handling (`url2pathname`) is
//! not done.
//!
//! This module does not rewrite URLs ([`super::rewrite_with_node_params`] does, and its
//! output is what a plan reads), connect, create files or wait for anyone.

use alloc::string::{String, ToString};
use core::fmt;
use core::time::Duration;

use crate::env::Env;
use crate::query::{QueryError, QueryView};
use crate::rendezvous::python::{InvalidIntLiteral, PyInt};
use crate::rendezvous::registry::NoHandler;
use crate::rendezvous::{use_agent_store, use_libuv, StaticScheme, DEFAULT_PG_TIMEOUT};
use crate::url::{PortError, RendezvousUrl, UrlError};

/// What a rendezvous gives this process: the store to use, its rank and the world size.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousPlan {
    /// This process's rank.
    pub rank: u32,
    /// The number of processes, `None` when not fixed (PyTorch's `-1`).
    pub world_size: Option<u32>,
    /// The store to build.
    pub store: StorePlan,
}

/// The store a rendezvous builds.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StorePlan {
    /// A TCPStore (`tcp://`, `env://`).
    Tcp(TcpStorePlan),
    /// A FileStore (`file://`).
    File(FileStorePlan),
}

/// A TCPStore as `_create_c10d_store` would create it.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpStorePlan {
    /// The server's host: the URL's hostname (lowercased, without brackets) or
    /// `MASTER_ADDR` as set.
    pub host: String,
    /// The server's port.
    pub port: u16,
    /// Whether this process hosts the server: rank 0, unless in agent-store mode.
    pub is_server: bool,
    /// The number of processes the server waits for, `None` when not fixed.
    pub world_size: Option<u32>,
    /// The store timeout: the caller's, else [`DEFAULT_PG_TIMEOUT`].
    pub timeout: Duration,
    /// Whether the server is shared by several stores on the same port (`multi_tenant`):
    /// true except in agent-store mode.
    pub multi_tenant: bool,
    /// The libuv flag the store is created with: [`use_libuv`]'s resolution, or `true`
    /// (TCPStore's default) in agent-store mode, where PyTorch does not pass it.
    pub use_libuv: bool,
    /// Agent-store mode (`TORCHELASTIC_USE_AGENT_STORE=True`): the torchelastic agent
    /// already hosts the server, and every rank is a client.
    pub agent_store: bool,
    /// The prefix every key of the store lives under, `None` for the bare store.
    ///
    /// PyTorch 2.4 and later (checked in 2.11 and 2.15) use the bare store, saying the
    /// agent makes a new TCPStore for every restart (2.15's c10d rendezvous handler in
    /// fact keeps one for the whole job unless `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`,
    /// so a restart sees the previous attempt's keys: docs/pytorch.md, "Restarts"). Older
    /// PyTorch (the seeds' `_create_c10d_store`) wrapped the agent's store in
    /// `PrefixStore(f"/worker/attempt_{TORCHELASTIC_RESTART_COUNT}")`; a job that mixes
    /// rdzv ranks with such a PyTorch sets [`ATTEMPT_PREFIX_VAR`]`=1` to get the same
    /// prefix (a key `k` is then `prefix + "/" + k`). The restart count is per node
    /// (only the node whose worker failed counts a restart), so that prefix matches
    /// across nodes only while they have restarted equally often, as in that PyTorch.
    pub prefix: Option<String>,
}

/// The prefix of agent-store mode: `/worker/attempt_{attempt}`, `attempt` as written in
/// `TORCHELASTIC_RESTART_COUNT` (Python formats the string it read, unparsed).
pub fn agent_store_prefix(attempt: &str) -> String {
    let mut prefix = String::with_capacity(AGENT_STORE_PREFIX.len() + attempt.len());
    prefix.push_str(AGENT_STORE_PREFIX);
    prefix.push_str(attempt);
    prefix
}

const AGENT_STORE_PREFIX: &str = "/worker/attempt_";

/// `RDZV_TORCHELASTIC_ATTEMPT_PREFIX=1`: agent-store mode as PyTorch before 2.4 did it,
/// every key under `/worker/attempt_{TORCHELASTIC_RESTART_COUNT}` (see
/// [`TcpStorePlan::prefix`]).
pub const ATTEMPT_PREFIX_VAR: &str = "RDZV_TORCHELASTIC_ATTEMPT_PREFIX";

/// `_agent_store_serves(hostname, port)` of PyTorch 2.15: agent-store mode applies only
/// to the agent's own `MASTER_ADDR:MASTER_PORT` (Python compares the strings, the port
/// as `str(port)`); for any other endpoint no agent promised a server there.
fn agent_store_serves<E: Env + ?Sized>(host: &str, port: u16, env: &E) -> bool {
    use_agent_store(env)
        && env.var("MASTER_ADDR") == Some(host)
        && env
            .var("MASTER_PORT")
            .is_some_and(|text| is_decimal_of(text, port))
}

/// Whether `text` is exactly `str(port)`: the decimal digits, no sign, no leading zero.
fn is_decimal_of(text: &str, port: u16) -> bool {
    let canonical = !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit())
        && (text == "0" || !text.starts_with('0'));
    canonical && text.parse::<u16>() == Ok(port)
}

/// A FileStore as `_file_rendezvous_handler` would create it.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileStorePlan {
    /// The file's path, the URL's path as written (not percent-decoded).
    pub path: String,
    /// The number of processes sharing the file, `None` when not fixed.
    pub world_size: Option<u32>,
}

/// Where an integer was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueOrigin {
    /// A query parameter (`rank`, `world_size`).
    Query(&'static str),
    /// An environment variable (`RANK`, `WORLD_SIZE`, `MASTER_PORT`).
    Env(&'static str),
}

impl fmt::Display for ValueOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Query(name) => write!(f, "query parameter {name}"),
            Self::Env(name) => write!(f, "environment variable {name}"),
        }
    }
}

/// Why no plan could be made. `Display` gives PyTorch's text where PyTorch has one.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanError<'a> {
    /// The URL does not parse.
    Url(UrlError<'a>),
    /// The URL's port is not a number in 0..=65535 (Python's `port` property raises).
    Port(PortError<'a>),
    /// A query piece is not `key=value`.
    Query {
        /// The handler's scheme.
        scheme: StaticScheme,
        /// The bad piece.
        error: QueryError<'a>,
    },
    /// `tcp://` without a port, or with port 0.
    PortMissing,
    /// No `rank` in the query (nor, for `env://`, `RANK` set).
    RankMissing {
        /// The handler's scheme.
        scheme: StaticScheme,
    },
    /// No `world_size` in the query.
    WorldSizeMissing {
        /// The handler's scheme.
        scheme: StaticScheme,
    },
    /// An `env://` variable is unset or empty.
    EnvVarMissing {
        /// The variable.
        var: &'static str,
    },
    /// `file://` without a path.
    PathMissing,
    /// `tcp://` without a host.
    HostnameMissing,
    /// `MASTER_PORT` is outside 0..=65535.
    PortOutOfRange {
        /// The port as read.
        port: PyInt<'a>,
    },
    /// A value `int()` rejects.
    NotAnInteger {
        /// The handler's scheme.
        scheme: StaticScheme,
        /// Where the value was read.
        origin: ValueOrigin,
        /// The value.
        value: &'a str,
    },
    /// A rank below 0 or above `u32::MAX`.
    RankOutOfRange {
        /// The handler's scheme.
        scheme: StaticScheme,
        /// Where the value was read.
        origin: ValueOrigin,
        /// The value.
        value: PyInt<'a>,
    },
    /// A world size above `u32::MAX`.
    WorldSizeOutOfRange {
        /// The handler's scheme.
        scheme: StaticScheme,
        /// Where the value was read.
        origin: ValueOrigin,
        /// The value.
        value: PyInt<'a>,
    },
    /// A TCPStore world size of 0.
    WorldSizeZero,
    /// Agent-store mode with the attempt prefix ([`ATTEMPT_PREFIX_VAR`]) but without
    /// `TORCHELASTIC_RESTART_COUNT` (that PyTorch raised
    /// `KeyError: 'TORCHELASTIC_RESTART_COUNT'`).
    RestartCountMissing,
    /// The URL's scheme is not one of the bundled ones.
    NoHandler(NoHandler<'a>),
}

impl fmt::Display for PlanError<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const PREFIX: &str = "Error initializing torch.distributed using ";
        match self {
            Self::Url(error) => error.fmt(f),
            Self::Port(error) => error.fmt(f),
            Self::Query { scheme, error } => {
                write!(f, "{PREFIX}{scheme}:// rendezvous: {error}")
            }
            Self::PortMissing => write!(f, "{PREFIX}tcp:// rendezvous: port number missing"),
            Self::RankMissing { scheme } => {
                write!(f, "{PREFIX}{scheme}:// rendezvous: rank parameter missing")
            }
            Self::WorldSizeMissing { scheme } => {
                write!(
                    f,
                    "{PREFIX}{scheme}:// rendezvous: world size parameter missing"
                )
            }
            Self::EnvVarMissing { var } => write!(
                f,
                "{PREFIX}env:// rendezvous: environment variable {var} expected, but not set"
            ),
            Self::PathMissing => write!(f, "{PREFIX}file:// rendezvous: path missing"),
            Self::HostnameMissing => f.write_str("hostname cannot be None"),
            Self::PortOutOfRange { port } => {
                write!(f, "port must have value from 0 to 65535 but was {port}.")
            }
            Self::NotAnInteger {
                scheme,
                origin,
                value,
            } => write!(
                f,
                "{PREFIX}{scheme}:// rendezvous: {origin}: {}",
                InvalidIntLiteral(value)
            ),
            Self::RankOutOfRange {
                scheme,
                origin,
                value,
            } => write!(
                f,
                "{PREFIX}{scheme}:// rendezvous: {origin} must have value from 0 to {} but \
                 was {value}.",
                u32::MAX
            ),
            Self::WorldSizeOutOfRange {
                scheme,
                origin,
                value,
            } => write!(
                f,
                "{PREFIX}{scheme}:// rendezvous: {origin} must have value from 0 to {} (or \
                 negative for no fixed world size) but was {value}.",
                u32::MAX
            ),
            Self::WorldSizeZero => f.write_str("TCPStore world size cannot be 0"),
            Self::RestartCountMissing => f.write_str(
                "KeyError: 'TORCHELASTIC_RESTART_COUNT': agent-store mode with \
                 RDZV_TORCHELASTIC_ATTEMPT_PREFIX=1 needs the restart count that the \
                 torchelastic agent sets for its workers; set TORCHELASTIC_RESTART_COUNT \
                 (0 for the first attempt), or unset RDZV_TORCHELASTIC_ATTEMPT_PREFIX to \
                 follow PyTorch 2.4 and later",
            ),
            Self::NoHandler(error) => error.fmt(f),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for PlanError<'_> {}

impl<'a> From<UrlError<'a>> for PlanError<'a> {
    fn from(error: UrlError<'a>) -> Self {
        Self::Url(error)
    }
}

/// `int(text)`, with the failure reported for `origin`.
fn read_int<'a>(
    scheme: StaticScheme,
    origin: ValueOrigin,
    text: &'a str,
) -> Result<PyInt<'a>, PlanError<'a>> {
    PyInt::parse(text).ok_or(PlanError::NotAnInteger {
        scheme,
        origin,
        value: text,
    })
}

fn read_rank<'a>(
    scheme: StaticScheme,
    origin: ValueOrigin,
    text: &'a str,
) -> Result<u32, PlanError<'a>> {
    let value = read_int(scheme, origin, text)?;
    value
        .to_i64()
        .and_then(|v| u32::try_from(v).ok())
        .ok_or(PlanError::RankOutOfRange {
            scheme,
            origin,
            value,
        })
}

fn read_world_size<'a>(
    scheme: StaticScheme,
    origin: ValueOrigin,
    text: &'a str,
) -> Result<Option<u32>, PlanError<'a>> {
    let value = read_int(scheme, origin, text)?;
    if value.is_negative() {
        return Ok(None);
    }
    value
        .to_i64()
        .and_then(|v| u32::try_from(v).ok())
        .map(Some)
        .ok_or(PlanError::WorldSizeOutOfRange {
            scheme,
            origin,
            value,
        })
}

fn parse_query<'a>(
    scheme: StaticScheme,
    url: &RendezvousUrl<'a>,
) -> Result<QueryView<'a>, PlanError<'a>> {
    QueryView::parse(url.query()).map_err(|error| PlanError::Query { scheme, error })
}

/// The `rank` and `world_size` query parameters that `tcp://` and `file://` require.
fn rank_and_world_size<'a>(
    scheme: StaticScheme,
    query: &QueryView<'a>,
) -> Result<(u32, Option<u32>), PlanError<'a>> {
    let rank = query.get("rank").ok_or(PlanError::RankMissing { scheme })?;
    let world_size = query
        .get("world_size")
        .ok_or(PlanError::WorldSizeMissing { scheme })?;
    Ok((
        read_rank(scheme, ValueOrigin::Query("rank"), rank)?,
        read_world_size(scheme, ValueOrigin::Query("world_size"), world_size)?,
    ))
}

/// `_create_c10d_store(host, port, rank, world_size, timeout, use_libuv)`, after its
/// port check (callers turn their port into a `u16` first). Agent-store mode follows
/// PyTorch 2.15 (only at the agent's own `MASTER_ADDR:MASTER_PORT`, the bare store);
/// with [`ATTEMPT_PREFIX_VAR`] it follows PyTorch before 2.4 (the flag alone, and the
/// restart count read first, before the TCPStore is made).
fn c10d_store<E: Env + ?Sized>(
    host: String,
    port: u16,
    rank: u32,
    world_size: Option<u32>,
    timeout: Option<Duration>,
    use_libuv: bool,
    env: &E,
) -> Result<StorePlan, PlanError<'static>> {
    let legacy = env.var(ATTEMPT_PREFIX_VAR) == Some("1");
    let agent_store = if legacy {
        use_agent_store(env)
    } else {
        agent_store_serves(&host, port, env)
    };
    let prefix = if agent_store && legacy {
        let attempt = env
            .var("TORCHELASTIC_RESTART_COUNT")
            .ok_or(PlanError::RestartCountMissing)?;
        Some(agent_store_prefix(attempt))
    } else {
        None
    };
    if world_size == Some(0) {
        return Err(PlanError::WorldSizeZero);
    }
    Ok(StorePlan::Tcp(TcpStorePlan {
        host,
        port,
        is_server: !agent_store && rank == 0,
        world_size,
        timeout: timeout.unwrap_or(DEFAULT_PG_TIMEOUT),
        multi_tenant: !agent_store,
        use_libuv: agent_store || use_libuv,
        agent_store,
        prefix,
    }))
}

/// The plan of `_tcp_rendezvous_handler` for `tcp://host:port?rank=R&world_size=W`.
///
/// `env` supplies `USE_LIBUV` and `TORCHELASTIC_USE_AGENT_STORE`; `timeout` defaults to
/// [`DEFAULT_PG_TIMEOUT`].
///
/// # Errors
/// [`PlanError`], in PyTorch's order: URL, port (missing or 0 is "port number missing"),
/// query, rank, world size, hostname, store checks.
pub fn plan_tcp<'a, E: Env + ?Sized>(
    url: &'a str,
    env: &'a E,
    timeout: Option<Duration>,
) -> Result<RendezvousPlan, PlanError<'a>> {
    const SCHEME: StaticScheme = StaticScheme::Tcp;
    let url = RendezvousUrl::parse(url)?;
    let port = match url.port().map_err(PlanError::Port)? {
        None | Some(0) => return Err(PlanError::PortMissing),
        Some(port) => port,
    };
    let query = parse_query(SCHEME, &url)?;
    let (rank, world_size) = rank_and_world_size(SCHEME, &query)?;
    let use_libuv = use_libuv(query.get("use_libuv"), env);
    let host = url.hostname().ok_or(PlanError::HostnameMissing)?;
    let store = c10d_store(
        host.to_string(),
        port,
        rank,
        world_size,
        timeout,
        use_libuv,
        env,
    )?;
    Ok(RendezvousPlan {
        rank,
        world_size,
        store,
    })
}

/// `_get_env_or_raise`: the variable's value, which must be set and non-empty.
fn required_env<'a, E: Env + ?Sized>(
    env: &'a E,
    var: &'static str,
) -> Result<&'a str, PlanError<'a>> {
    env.var(var)
        .filter(|value| !value.is_empty())
        .ok_or(PlanError::EnvVarMissing { var })
}

/// The plan of `_env_rendezvous_handler` for `env://`: rank and world size from the query
/// or from `RANK` and `WORLD_SIZE`, the server at `MASTER_ADDR:MASTER_PORT`.
///
/// # Errors
/// [`PlanError`], in PyTorch's order: URL, query, rank, world size, `MASTER_ADDR`,
/// `MASTER_PORT`, store checks (port range, world size 0).
pub fn plan_env<'a, E: Env + ?Sized>(
    url: &'a str,
    env: &'a E,
    timeout: Option<Duration>,
) -> Result<RendezvousPlan, PlanError<'a>> {
    const SCHEME: StaticScheme = StaticScheme::Env;
    let url = RendezvousUrl::parse(url)?;
    let query = parse_query(SCHEME, &url)?;
    let rank = match query.get("rank") {
        Some(text) => read_rank(SCHEME, ValueOrigin::Query("rank"), text)?,
        None => read_rank(SCHEME, ValueOrigin::Env("RANK"), required_env(env, "RANK")?)?,
    };
    let world_size = match query.get("world_size") {
        Some(text) => read_world_size(SCHEME, ValueOrigin::Query("world_size"), text)?,
        None => read_world_size(
            SCHEME,
            ValueOrigin::Env("WORLD_SIZE"),
            required_env(env, "WORLD_SIZE")?,
        )?,
    };
    let master_addr = required_env(env, "MASTER_ADDR")?;
    let master_port = read_int(
        SCHEME,
        ValueOrigin::Env("MASTER_PORT"),
        required_env(env, "MASTER_PORT")?,
    )?;
    let use_libuv = use_libuv(query.get("use_libuv"), env);
    let master_port = master_port
        .to_i64()
        .and_then(|port| u16::try_from(port).ok())
        .ok_or(PlanError::PortOutOfRange { port: master_port })?;
    let store = c10d_store(
        master_addr.to_string(),
        master_port,
        rank,
        world_size,
        timeout,
        use_libuv,
        env,
    )?;
    Ok(RendezvousPlan {
        rank,
        world_size,
        store,
    })
}

/// The plan of `_file_rendezvous_handler` for `file:///path?rank=R&world_size=W`.
///
/// # Errors
/// [`PlanError`], in PyTorch's order: URL, path, query, rank, world size.
pub fn plan_file(url: &str) -> Result<RendezvousPlan, PlanError<'_>> {
    const SCHEME: StaticScheme = StaticScheme::File;
    let url = RendezvousUrl::parse(url)?;
    if url.path().is_empty() {
        return Err(PlanError::PathMissing);
    }
    let query = parse_query(SCHEME, &url)?;
    let (rank, world_size) = rank_and_world_size(SCHEME, &query)?;
    Ok(RendezvousPlan {
        rank,
        world_size,
        store: StorePlan::File(FileStorePlan {
            path: url.path().to_string(),
            world_size,
        }),
    })
}

/// The plan of the bundled handler for `url`'s scheme (`tcp`, `env` or `file`, read
/// lowercase); pass it the output of [`super::rewrite_with_node_params`].
///
/// # Errors
/// [`PlanError::NoHandler`] for any other scheme, else the handler's errors.
pub fn plan_static<'a, E: Env + ?Sized>(
    url: &'a str,
    env: &'a E,
    timeout: Option<Duration>,
) -> Result<RendezvousPlan, PlanError<'a>> {
    let parsed = RendezvousUrl::parse(url)?;
    match StaticScheme::of(&parsed) {
        Some(StaticScheme::Tcp) => plan_tcp(url, env, timeout),
        Some(StaticScheme::Env) => plan_env(url, env, timeout),
        Some(StaticScheme::File) => plan_file(url),
        None => Err(PlanError::NoHandler(NoHandler::for_url(&parsed))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::{EmptyEnv, MapEnv};
    use crate::rendezvous::{rewrite_with_node_params, NodeParams};
    use proptest::prelude::*;
    use std::string::ToString;

    fn tcp(host: &str, port: u16, is_server: bool, world_size: Option<u32>) -> TcpStorePlan {
        TcpStorePlan {
            host: host.into(),
            port,
            is_server,
            world_size,
            timeout: DEFAULT_PG_TIMEOUT,
            multi_tenant: true,
            use_libuv: true,
            agent_store: false,
            prefix: None,
        }
    }

    fn error_text(result: Result<RendezvousPlan, PlanError<'_>>) -> String {
        result
            .map(|plan| std::format!("unexpected plan {plan:?}"))
            .unwrap_or_else(|e| e.to_string())
    }

    #[test]
    fn tcp_nominal() {
        // RendezvousTCPTest.test_nominal: `tcp://addr:port?world_size=2` + `&rank=N`.
        let env = EmptyEnv;
        for rank in [0u32, 1] {
            let url = std::format!("tcp://127.0.0.1:29500?world_size=2&rank={rank}");
            let plan = plan_static(&url, &env, None).expect("nominal");
            assert_eq!(
                plan,
                RendezvousPlan {
                    rank,
                    world_size: Some(2),
                    store: StorePlan::Tcp(tcp("127.0.0.1", 29500, rank == 0, Some(2))),
                }
            );
        }
        // Hostnames are lowercased and unbracketed; the caller's timeout is kept.
        let plan = plan_tcp(
            "tcp://[FE80::1%Eth0]:23456?rank=1&world_size=-1",
            &env,
            Some(Duration::from_secs(1)),
        )
        .expect("ipv6");
        let mut expected = tcp("fe80::1%Eth0", 23456, false, None);
        expected.timeout = Duration::from_secs(1);
        assert_eq!(plan.store, StorePlan::Tcp(expected));
        assert_eq!(plan.world_size, None);
    }

    #[test]
    fn tcp_libuv_flag() {
        // RendezvousTCPTest.test_tcp_store_url_with_libuv and
        // InitPgWithNonUvStore.test_with_url_param.
        let env = MapEnv::new(&[("USE_LIBUV", "0")]);
        let libuv = |url: &str| match plan_tcp(url, &env, None).map(|p| p.store) {
            Ok(StorePlan::Tcp(store)) => store.use_libuv,
            other => panic!("{other:?}"),
        };
        assert!(libuv("tcp://h:1?world_size=1&rank=0&use_libuv=1"));
        assert!(!libuv("tcp://h:1?world_size=1&rank=0&use_libuv=0"));
        assert!(!libuv("tcp://h:1?world_size=1&rank=0"));
        let plan = plan_tcp("tcp://h:1?world_size=1&rank=0", &EmptyEnv, None).expect("ok");
        assert!(matches!(
            plan.store,
            StorePlan::Tcp(TcpStorePlan {
                use_libuv: true,
                ..
            })
        ));
    }

    #[test]
    fn tcp_common_errors() {
        let env = EmptyEnv;
        let prefix = "Error initializing torch.distributed using tcp:// rendezvous: ";
        for (url, message) in [
            ("tcp://127.0.0.1?rank=0&world_size=1", "port number missing"),
            (
                "tcp://127.0.0.1:0?rank=0&world_size=1",
                "port number missing",
            ),
            (
                "tcp://127.0.0.1:23456?world_size=1",
                "rank parameter missing",
            ),
            (
                "tcp://127.0.0.1:23456?rank=0",
                "world size parameter missing",
            ),
            (
                "tcp://h:1?rank=zero&world_size=1",
                "query parameter rank: invalid literal for int() with base 10: 'zero'",
            ),
            (
                "tcp://h:1?rank=0&world_size=1.5",
                "query parameter world_size: invalid literal for int() with base 10: '1.5'",
            ),
            (
                "tcp://h:1?rank=-1&world_size=2",
                "query parameter rank must have value from 0 to 4294967295 but was -1.",
            ),
            (
                "tcp://h:1?rank=0&world_size=99999999999",
                "query parameter world_size must have value from 0 to 4294967295 (or negative \
                 for no fixed world size) but was 99999999999.",
            ),
            (
                "tcp://h:1?rank=0&world_size=1&bare",
                "malformed query parameter 'bare': expected exactly one '=' between key and \
                 value",
            ),
        ] {
            assert_eq!(
                error_text(plan_tcp(url, &env, None)),
                std::format!("{prefix}{message}"),
                "{url}"
            );
        }
        for (url, message) in [
            (
                "tcp://:23456?rank=0&world_size=1",
                "hostname cannot be None",
            ),
            (
                "tcp://u@:23456?rank=0&world_size=1",
                "hostname cannot be None",
            ),
            (
                "tcp://h:1?rank=0&world_size=0",
                "TCPStore world size cannot be 0",
            ),
            (
                "tcp://h:abc?rank=0&world_size=1",
                "Port could not be cast to integer value as 'abc'",
            ),
            (
                "tcp://h:65536?rank=0&world_size=1",
                "Port out of range 0-65535",
            ),
            ("tcp://[::1?rank=0&world_size=1", "Invalid IPv6 URL"),
            ("unknown://h:1", "No rendezvous handler for unknown://"),
        ] {
            assert_eq!(error_text(plan_static(url, &env, None)), message, "{url}");
        }
    }

    #[test]
    fn env_nominal() {
        // RendezvousEnvTest.test_nominal: rendezvous("env://") with the four variables.
        let env = MapEnv::new(&[
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29501"),
            ("RANK", "0"),
        ]);
        let given = NodeParams::Given {
            rank: None,
            world_size: None,
        };
        let url = rewrite_with_node_params("env://", given, &env)
            .expect("rewrite")
            .to_string();
        assert_eq!(url, "env://");
        let plan = plan_static(&url, &env, None).expect("nominal");
        assert_eq!(
            plan,
            RendezvousPlan {
                rank: 0,
                world_size: Some(1),
                store: StorePlan::Tcp(tcp("127.0.0.1", 29501, true, Some(1))),
            }
        );
        // The query overrides RANK and WORLD_SIZE; MASTER_ADDR is kept as written.
        let env = MapEnv::new(&[("MASTER_ADDR", "Node-A"), ("MASTER_PORT", "0")]);
        let plan = plan_env("env://?rank=3&world_size=4", &env, None).expect("query");
        assert_eq!(plan.rank, 3);
        assert_eq!(plan.store, StorePlan::Tcp(tcp("Node-A", 0, false, Some(4))));
    }

    #[test]
    fn env_with_libuv_off_and_agent_store() {
        // InitPgWithNonUvStore.test_with_env_var.
        let vars = [
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("RANK", "0"),
            ("USE_LIBUV", "0"),
        ];
        let env = MapEnv::new(&vars);
        let plan = plan_env("env://", &env, None).expect("ok");
        let mut expected = tcp("10.0.0.1", 29500, true, Some(2));
        expected.use_libuv = false;
        assert_eq!(plan.store, StorePlan::Tcp(expected));

        let mut agent_vars = vars.to_vec();
        agent_vars.push(("TORCHELASTIC_USE_AGENT_STORE", "True"));
        // PyTorch 2.4 and later: every rank is a client of the agent's bare store, and no
        // restart count is needed.
        let agent_plan = |prefix: Option<&str>| {
            StorePlan::Tcp(TcpStorePlan {
                host: "10.0.0.1".into(),
                port: 29500,
                is_server: false,
                world_size: Some(2),
                timeout: Duration::from_secs(5),
                multi_tenant: false,
                use_libuv: true,
                agent_store: true,
                prefix: prefix.map(Into::into),
            })
        };
        let env = MapEnv::new(&agent_vars);
        let plan = plan_env("env://", &env, Some(Duration::from_secs(5))).expect("ok");
        assert_eq!(plan.store, agent_plan(None));
        // PyTorch 2.15's _agent_store_serves: only at the agent's own endpoint (compared
        // as strings, the port as str(port)); elsewhere rank 0 hosts as usual.
        let url = "tcp://10.0.0.2:29500?rank=0&world_size=2";
        let plan = plan_tcp(url, &env, None).expect("other host");
        assert!(matches!(
            plan.store,
            StorePlan::Tcp(TcpStorePlan {
                agent_store: false,
                is_server: true,
                ..
            })
        ));
        for (text, port, same) in [
            ("29500", 29500, true),
            ("029500", 29500, false),
            ("0", 0, true),
            ("", 0, false),
            ("+1", 1, false),
        ] {
            assert_eq!(is_decimal_of(text, port), same, "{text:?}");
        }

        // Before 2.4 (RDZV_TORCHELASTIC_ATTEMPT_PREFIX=1): _create_c10d_store read
        // os.environ["TORCHELASTIC_RESTART_COUNT"], a KeyError when missing.
        agent_vars.push((ATTEMPT_PREFIX_VAR, "1"));
        let env = MapEnv::new(&agent_vars);
        assert_eq!(
            error_text(plan_env("env://", &env, None)),
            "KeyError: 'TORCHELASTIC_RESTART_COUNT': agent-store mode with \
             RDZV_TORCHELASTIC_ATTEMPT_PREFIX=1 needs the restart count that the torchelastic \
             agent sets for its workers; set TORCHELASTIC_RESTART_COUNT (0 for the first \
             attempt), or unset RDZV_TORCHELASTIC_ATTEMPT_PREFIX to follow PyTorch 2.4 and later"
        );
        // It is read before the TCPStore is made, so before the world size check.
        let zero: std::vec::Vec<_> = agent_vars
            .iter()
            .map(|&(k, v)| if k == "WORLD_SIZE" { (k, "0") } else { (k, v) })
            .collect();
        assert_eq!(
            plan_env("env://", &MapEnv::new(&zero), None),
            Err(PlanError::RestartCountMissing)
        );
        agent_vars.push(("TORCHELASTIC_RESTART_COUNT", "3"));
        let env = MapEnv::new(&agent_vars);
        let plan = plan_env("env://", &env, Some(Duration::from_secs(5))).expect("ok");
        assert_eq!(plan.store, agent_plan(Some("/worker/attempt_3")));
        // The count is formatted as read, unparsed, like Python's f-string; an empty
        // value is set (os.environ has it), so it is not an error.
        assert_eq!(agent_store_prefix("0"), "/worker/attempt_0");
        assert_eq!(agent_store_prefix(" 07"), "/worker/attempt_ 07");
        let mut empty = agent_vars.clone();
        empty.pop();
        empty.push(("TORCHELASTIC_RESTART_COUNT", ""));
        let plan = plan_env("env://", &MapEnv::new(&empty), None).expect("empty is set");
        assert!(matches!(
            plan.store,
            StorePlan::Tcp(TcpStorePlan { prefix: Some(ref p), .. }) if p == "/worker/attempt_"
        ));
    }

    #[test]
    fn env_errors() {
        let prefix = "Error initializing torch.distributed using env:// rendezvous: ";
        let full = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ];
        for missing in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
            let unset: std::vec::Vec<_> = full
                .iter()
                .copied()
                .filter(|(k, _)| *k != missing)
                .collect();
            let empty: std::vec::Vec<_> = full
                .iter()
                .map(|&(k, v)| if k == missing { (k, "") } else { (k, v) })
                .collect();
            for vars in [unset, empty] {
                assert_eq!(
                    error_text(plan_env("env://", &MapEnv::new(&vars), None)),
                    std::format!("{prefix}environment variable {missing} expected, but not set")
                );
            }
        }
        let with = |var: &'static str, value: &'static str| {
            let vars: std::vec::Vec<_> = full
                .iter()
                .map(|&(k, v)| if k == var { (k, value) } else { (k, v) })
                .collect();
            error_text(plan_env("env://", &MapEnv::new(&vars), None))
        };
        assert_eq!(
            with("MASTER_PORT", "70000"),
            "port must have value from 0 to 65535 but was 70000."
        );
        assert_eq!(
            with("MASTER_PORT", " -0_5 "),
            "port must have value from 0 to 65535 but was -5."
        );
        assert_eq!(
            with("MASTER_PORT", "http"),
            std::format!(
                "{prefix}environment variable MASTER_PORT: invalid literal for int() with base \
                 10: 'http'"
            )
        );
        assert_eq!(
            with("RANK", "x"),
            std::format!(
                "{prefix}environment variable RANK: invalid literal for int() with base 10: 'x'"
            )
        );
        assert_eq!(with("WORLD_SIZE", "0"), "TCPStore world size cannot be 0");
        assert_eq!(
            error_text(plan_env("env://?rank=a=b", &MapEnv::new(&full), None)),
            std::format!(
                "{prefix}malformed query parameter 'rank=a=b': expected exactly one '=' \
                 between key and value"
            )
        );
    }

    #[test]
    fn file_nominal_and_errors() {
        // RendezvousFileTest.test_nominal: `file:///` + path, two ranks share the file.
        for rank in [0u32, 1] {
            let url = std::format!("file:////tmp/store?world_size=2&rank={rank}");
            let plan = plan_static(&url, &EmptyEnv, None).expect("nominal");
            assert_eq!(
                plan,
                RendezvousPlan {
                    rank,
                    world_size: Some(2),
                    store: StorePlan::File(FileStorePlan {
                        path: "//tmp/store".into(),
                        world_size: Some(2),
                    }),
                }
            );
        }
        let plan = plan_file("FILE:///tmp/a%20b?rank=0&world_size=-1").expect("dynamic");
        assert_eq!(
            plan.store,
            StorePlan::File(FileStorePlan {
                path: "/tmp/a%20b".into(),
                world_size: None,
            })
        );
        // RendezvousFileTest.test_common_errors.
        let prefix = "Error initializing torch.distributed using file:// rendezvous: ";
        for (url, message) in [
            ("file://?rank=0&world_size=1", "path missing"),
            ("file://host?rank=0&world_size=1", "path missing"),
            ("file:///tmp/foo?world_size=1", "rank parameter missing"),
            ("file:///tmp/foo?rank=0", "world size parameter missing"),
        ] {
            assert_eq!(
                error_text(plan_file(url)),
                std::format!("{prefix}{message}"),
                "{url}"
            );
        }
    }

    #[test]
    fn rewrite_then_plan() {
        // dist.rendezvous("tcp://h:1", rank=1, world_size=2) and the
        // _create_store_from_options path (world_size_opt=None).
        let env = EmptyEnv;
        let url = rewrite_with_node_params("tcp://H:1", NodeParams::from_python(1, Some(2)), &env)
            .expect("rewrite")
            .to_string();
        let plan = plan_static(&url, &env, None).expect("plan");
        assert_eq!((plan.rank, plan.world_size), (1, Some(2)));
        let url = rewrite_with_node_params("tcp://h:1", NodeParams::from_python(0, None), &env)
            .expect("rewrite")
            .to_string();
        assert_eq!(url, "tcp://h:1?rank=0&world_size=-1");
        let plan = plan_static(&url, &env, None).expect("plan");
        assert_eq!(plan.store, StorePlan::Tcp(tcp("h", 1, true, None)));
    }

    proptest! {
        #[test]
        fn tcp_plans_reflect_their_url(
            host in "[a-zA-Z][a-zA-Z0-9.-]{0,10}",
            port in 1u16..,
            rank in 0u32..1000,
            world_size in 1u32..1000,
        ) {
            let url = std::format!("tcp://{host}:{port}?rank={rank}&world_size={world_size}");
            let plan = plan_static(&url, &EmptyEnv, None).expect("valid");
            let lower = host.to_ascii_lowercase();
            prop_assert_eq!(plan.rank, rank);
            prop_assert_eq!(plan.world_size, Some(world_size));
            prop_assert_eq!(
                plan.store,
                StorePlan::Tcp(tcp(&lower, port, rank == 0, Some(world_size)))
            );
        }
    }
}
