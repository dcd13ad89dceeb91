//! `torch.distributed.rendezvous` at runtime: rewrite the URL with this process's rank
//! and world size, pick the handler registered for its scheme, run it, and hand back the
//! store, the rank and the world size.
//!
//! Every decision is the core's: [`rewrite_with_node_params`] rewrites the URL,
//! [`plan_tcp`], [`plan_env`] and [`plan_file`] say which store to build and who hosts it,
//! and [`HandlerRegistry`] keeps the scheme → handler table with PyTorch's messages. This
//! module owns what the core may not touch: the process environment (read only by
//! [`ProcessEnv::snapshot`]), the process-global handler registry (a mutex, pre-populated
//! with `tcp`, `env`, `file` and `elastic`), and building the planned store, which opens sockets,
//! may start a server and blocks until the peers have joined. Like PyTorch's
//! `_create_c10d_store`, rank 0 hosts a multi-tenant server and every rank connects, or,
//! in agent-store mode, every rank is a client of the agent's server, seen through
//! `PrefixStore("/worker/attempt_{TORCHELASTIC_RESTART_COUNT}", …)` as the plan says, so
//! that rdzv and PyTorch ranks of one job share keys and a restarted job starts afresh. The C++ TCPStore's
//! escape hatch is kept too: a rank that fails to bind the planned port continues as a
//! client when `TORCHELASTIC_USE_AGENT_STORE` is truthy and `MASTER_PORT` names that port.
//!
//! The static schemes do not re-rendezvous (PyTorch's handlers refuse to as well) or add
//! prefixes of their own (callers such as process groups do that). `elastic://` is the
//! dynamic rendezvous of [`elastic`]: its outcome carries a handle to follow the next
//! rounds; `etcd://` is the same rendezvous kept in an etcd cluster ([`etcd`]).

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use rdzv_core::env::Env;
use rdzv_core::rendezvous::{
    plan_env, plan_file, plan_tcp, rewrite_with_node_params, FileStorePlan, HandlerRegistry,
    NodeParams, RendezvousPlan, StorePlan, TcpStorePlan, DEFAULT_PG_TIMEOUT,
};
use rdzv_core::store::codec::Limits;
use rdzv_core::url::RendezvousUrl;

use crate::store::file::FileStore;
use crate::store::tcp::{TcpStore, TcpStoreOptions};
use crate::store::{PrefixStore, Store, StoreError};

pub mod elastic;
pub mod etcd;

/// The process environment, snapshotted once: the only place rdzv reads environment
/// variables.
///
/// Names and values that are not UTF-8 are kept lossily converted (a mangled
/// `MASTER_ADDR` then fails to resolve, naming what it read, rather than reading as
/// unset).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessEnv {
    vars: HashMap<String, String>,
}

impl ProcessEnv {
    /// The variables of this process, as they are now.
    pub fn snapshot() -> Self {
        std::env::vars_os()
            .map(|(name, value)| {
                (
                    name.to_string_lossy().into_owned(),
                    value.to_string_lossy().into_owned(),
                )
            })
            .collect()
    }

    /// Every variable, in no particular order.
    pub fn vars(&self) -> impl Iterator<Item = (&str, &str)> + '_ {
        self.vars.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }
}

impl FromIterator<(String, String)> for ProcessEnv {
    fn from_iter<I: IntoIterator<Item = (String, String)>>(iter: I) -> Self {
        ProcessEnv {
            vars: iter.into_iter().collect(),
        }
    }
}

impl Env for ProcessEnv {
    fn var(&self, name: &str) -> Option<&str> {
        self.vars.get(name).map(String::as_str)
    }
}

/// What the caller passes along with the URL (PyTorch's handler keyword arguments).
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousOptions {
    /// The store timeout: connecting, waiting for the workers to join, and the store's
    /// default timeout afterwards. PyTorch's [`DEFAULT_PG_TIMEOUT`] (30 minutes) unless
    /// set.
    pub timeout: Duration,
}

impl Default for RendezvousOptions {
    fn default() -> Self {
        RendezvousOptions {
            timeout: DEFAULT_PG_TIMEOUT,
        }
    }
}

impl RendezvousOptions {
    /// The default options with `timeout` as the store timeout.
    pub fn with_timeout(timeout: Duration) -> Self {
        RendezvousOptions { timeout }
    }
}

/// What a rendezvous gives this process: PyTorch's `(store, rank, world_size)` triplet.
#[non_exhaustive]
#[derive(Clone)]
pub struct Rendezvous {
    /// The store every rank shares.
    pub store: Arc<dyn Store>,
    /// This process's rank.
    pub rank: u32,
    /// The number of processes, `None` when not fixed (PyTorch's `-1`).
    pub world_size: Option<u32>,
    /// The plan the store was built from; `None` for handlers that do not plan with
    /// the core (custom ones, `elastic://`).
    pub plan: Option<RendezvousPlan>,
    /// For `elastic://`: the node's handle, to follow the next rounds (the store, rank and
    /// world size above are the first round's), re-rendezvous, leave or shut down.
    pub elastic: Option<Arc<elastic::ElasticRendezvous>>,
}

impl Rendezvous {
    /// The outcome of a custom handler: `store`, `rank` and `world_size`, no plan.
    pub fn new(store: Arc<dyn Store>, rank: u32, world_size: Option<u32>) -> Self {
        Rendezvous {
            store,
            rank,
            world_size,
            plan: None,
            elastic: None,
        }
    }
}

impl fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rendezvous")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("plan", &self.plan)
            .field("elastic", &self.elastic)
            .finish_non_exhaustive()
    }
}

/// What a store built for a rendezvous was doing when it failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreRole {
    /// Hosting the server (rank 0), then connecting to it.
    Server,
    /// Connecting to the server rank 0 hosts.
    Client,
    /// Connecting to the torchelastic agent's server (agent-store mode).
    AgentClient,
    /// Connecting after failing to bind, through the agent-store escape hatch.
    FallbackClient,
}

impl fmt::Display for StoreRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Server => "hosting the TCPStore server of",
            Self::Client => "connecting to the TCPStore at",
            Self::AgentClient => "connecting to the agent's TCPStore at",
            Self::FallbackClient => {
                "connecting (after failing to bind; agent-store escape hatch) to the TCPStore at"
            }
        })
    }
}

/// Why a rendezvous failed. Where PyTorch has a message, `Display` is PyTorch's text.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    /// The URL could not be rewritten with the rank and world size (it does not parse,
    /// `RANK`/`WORLD_SIZE` is not an integer, or it already names `rank`/`world_size`:
    /// "The url: … has node-specific arguments(rank, world_size) already.").
    #[error("{0}")]
    Rewrite(String),
    /// No handler is registered for the URL's scheme.
    #[error("{message}")]
    NoHandler {
        /// The scheme, as looked up (lowercase).
        scheme: String,
        /// "No rendezvous handler for {scheme}://".
        message: String,
    },
    /// A handler is already registered for the scheme.
    #[error("{message}")]
    AlreadyRegistered {
        /// The scheme.
        scheme: String,
        /// "Rendezvous handler for {scheme}:// already registered".
        message: String,
    },
    /// A bundled handler refused the URL or the environment ("Error initializing
    /// torch.distributed using tcp:// rendezvous: port number missing", ...).
    #[error("{0}")]
    Plan(String),
    /// The planned store could not be built.
    #[error("rank {rank}: {role} {host}:{port} failed: {source}")]
    Store {
        /// This process's rank.
        rank: u32,
        /// What the store was doing.
        role: StoreRole,
        /// The server's host.
        host: String,
        /// The server's port.
        port: u16,
        /// The store's error.
        #[source]
        source: StoreError,
    },
    /// The planned file store could not be opened.
    #[error("rank {rank}: opening the file store {path} failed: {source}")]
    FileStore {
        /// This process's rank.
        rank: u32,
        /// The store file, as the URL names it.
        path: String,
        /// The store's error.
        #[source]
        source: StoreError,
    },
    /// The planned store is not available in this build.
    #[error("{0}")]
    Unsupported(String),
    /// A custom handler failed.
    #[error(transparent)]
    Handler(Box<dyn std::error::Error + Send + Sync + 'static>),
}

/// A rendezvous handler: called with the rewritten URL, the environment and the
/// caller's options, it builds the store (PyTorch's handler generators, minus the
/// re-rendezvous they refuse anyway).
pub type RendezvousHandler = Arc<
    dyn Fn(&str, &dyn Env, &RendezvousOptions) -> Result<Rendezvous, RendezvousError> + Send + Sync,
>;

fn registry() -> MutexGuard<'static, HandlerRegistry<RendezvousHandler>> {
    static REGISTRY: OnceLock<Mutex<HandlerRegistry<RendezvousHandler>>> = OnceLock::new();
    REGISTRY
        .get_or_init(|| {
            let mut registry = HandlerRegistry::new();
            let bundled: [(&str, RendezvousHandler); 5] = [
                ("tcp", Arc::new(tcp_rendezvous_handler)),
                ("env", Arc::new(env_rendezvous_handler)),
                ("file", Arc::new(file_rendezvous_handler)),
                ("elastic", Arc::new(elastic::elastic_rendezvous_handler)),
                ("etcd", Arc::new(etcd::etcd_rendezvous_handler)),
            ];
            for (scheme, handler) in bundled {
                // The registry starts empty, so the distinct schemes all register.
                let _ = registry.register(scheme, handler);
            }
            Mutex::new(registry)
        })
        .lock()
        // The registry is only ever inserted into; a panic elsewhere leaves it valid.
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `register_rendezvous_handler(scheme, handler)`: makes `rendezvous` send URLs of
/// `scheme` to `handler`, for the rest of the process.
///
/// URL schemes are looked up lowercase, so a scheme with capitals is never found through
/// a URL (as in PyTorch).
///
/// # Errors
/// [`RendezvousError::AlreadyRegistered`] if `scheme` has a handler (`tcp`, `env` and
/// `file` always do).
pub fn register_rendezvous_handler<F>(scheme: &str, handler: F) -> Result<(), RendezvousError>
where
    F: Fn(&str, &dyn Env, &RendezvousOptions) -> Result<Rendezvous, RendezvousError>
        + Send
        + Sync
        + 'static,
{
    registry()
        .register(scheme, Arc::new(handler))
        .map_err(|error| RendezvousError::AlreadyRegistered {
            scheme: scheme.to_string(),
            message: error.to_string(),
        })
}

/// `torch.distributed.rendezvous(url, rank, world_size)` with the process environment
/// and the default options (`None` is PyTorch's `-1`, "not given").
///
/// Blocks until the store is built: for `tcp://` and `env://` with a fixed world size,
/// rank 0 waits (up to 30 minutes) until every rank has connected.
///
/// # Errors
/// See [`rendezvous_with`].
pub fn rendezvous(
    url: &str,
    rank: Option<u32>,
    world_size: Option<u32>,
) -> Result<Rendezvous, RendezvousError> {
    rendezvous_with(
        url,
        NodeParams::Given { rank, world_size },
        &ProcessEnv::snapshot(),
        &RendezvousOptions::default(),
    )
}

/// `_rendezvous_helper(url, rank, world_size, timeout=…)` with an explicit environment:
/// rewrites `url` with `params`, picks the handler of its scheme and runs it.
///
/// [`NodeParams::Inferred`] is the `world_size=None` path of
/// `_create_store_from_options` (for `env://`, `RANK` and `WORLD_SIZE` fill in).
///
/// # Errors
/// [`RendezvousError::Rewrite`] and [`RendezvousError::NoHandler`] before any handler
/// runs, then the handler's: [`RendezvousError::Plan`] for a URL or environment the
/// bundled handlers refuse, [`RendezvousError::Store`] when the store cannot be built
/// (bind or connect failure, timeout waiting for the workers),
/// [`RendezvousError::Unsupported`] for `file://` in a build without `FileStore`.
pub fn rendezvous_with<E: Env + ?Sized>(
    url: &str,
    params: NodeParams,
    env: &E,
    options: &RendezvousOptions,
) -> Result<Rendezvous, RendezvousError> {
    let rewritten = rewrite_with_node_params(url, params, env)
        .map_err(|error| RendezvousError::Rewrite(error.to_string()))?
        .to_string();
    let parsed = RendezvousUrl::parse(&rewritten)
        .map_err(|error| RendezvousError::Rewrite(error.to_string()))?;
    // Take the handler out and release the registry before running it: a handler blocks
    // until its peers join, and those may be threads of this process.
    let handler = registry()
        .handler_for(&parsed)
        .map(Arc::clone)
        .map_err(|error| RendezvousError::NoHandler {
            scheme: error.scheme().to_string(),
            message: error.to_string(),
        })?;
    tracing::debug!(url = %rewritten, "rendezvous");
    handler(&rewritten, &EnvRef(env), options)
}

/// Lets a `?Sized` environment travel as `&dyn Env`.
struct EnvRef<'e, E: ?Sized>(&'e E);

impl<E: Env + ?Sized> Env for EnvRef<'_, E> {
    fn var(&self, name: &str) -> Option<&str> {
        self.0.var(name)
    }
}

/// `_tcp_rendezvous_handler`.
fn tcp_rendezvous_handler(
    url: &str,
    env: &dyn Env,
    options: &RendezvousOptions,
) -> Result<Rendezvous, RendezvousError> {
    let plan = plan_tcp(url, env, Some(options.timeout))
        .map_err(|error| RendezvousError::Plan(error.to_string()))?;
    finish(plan, env)
}

/// `_env_rendezvous_handler`.
fn env_rendezvous_handler(
    url: &str,
    env: &dyn Env,
    options: &RendezvousOptions,
) -> Result<Rendezvous, RendezvousError> {
    let plan = plan_env(url, env, Some(options.timeout))
        .map_err(|error| RendezvousError::Plan(error.to_string()))?;
    finish(plan, env)
}

/// `_file_rendezvous_handler`.
fn file_rendezvous_handler(
    url: &str,
    env: &dyn Env,
    _options: &RendezvousOptions,
) -> Result<Rendezvous, RendezvousError> {
    let plan = plan_file(url).map_err(|error| RendezvousError::Plan(error.to_string()))?;
    finish(plan, env)
}

fn finish(plan: RendezvousPlan, env: &dyn Env) -> Result<Rendezvous, RendezvousError> {
    let store = open_store(&plan, env)?;
    Ok(Rendezvous {
        store,
        rank: plan.rank,
        world_size: plan.world_size,
        plan: Some(plan),
        elastic: None,
    })
}

/// Builds the store `plan` names, as PyTorch's bundled handlers do; `env` is read only
/// for the agent-store escape hatch (see [`open_tcp_store`]).
///
/// # Errors
/// See [`open_tcp_store`]; [`RendezvousError::FileStore`] when the store file cannot be
/// opened; [`RendezvousError::Unsupported`] for a store kind this version does not know.
pub fn open_store(plan: &RendezvousPlan, env: &dyn Env) -> Result<Arc<dyn Store>, RendezvousError> {
    match &plan.store {
        StorePlan::Tcp(tcp) => open_tcp_store(tcp, plan.rank, env),
        StorePlan::File(file) => open_file_store(file, plan.rank),
        other => Err(RendezvousError::Unsupported(format!(
            "this build of rdzv cannot build the store {other:?}"
        ))),
    }
}

/// `_create_c10d_store` + the TCPStore constructor: in agent-store mode a plain client
/// of the agent's server, wrapped in a [`PrefixStore`] with the plan's prefix
/// (`/worker/attempt_N`); else rank 0 hosts the (multi-tenant) server and connects to
/// it, and every other rank connects. With a fixed world size every rank counts itself
/// in, and the host waits until all have, up to the plan's timeout.
///
/// If hosting fails because the port is taken, the rank continues as a client when
/// `TORCHELASTIC_USE_AGENT_STORE` is truthy by the C++ rules (`y`, `yes`, `1`, `t`,
/// `true`, any case) and `MASTER_PORT` is the planned port, as the C++ TCPStore does.
///
/// # Errors
/// [`RendezvousError::Store`], naming the rank, what it was doing and `host:port`.
pub fn open_tcp_store(
    plan: &TcpStorePlan,
    rank: u32,
    env: &dyn Env,
) -> Result<Arc<dyn Store>, RendezvousError> {
    tracing::debug!(
        use_libuv = plan.use_libuv,
        "use_libuv only picks PyTorch's server back-end; rdzv's server chooses its own event loop"
    );
    let mut options = TcpStoreOptions {
        host: plan.host.clone(),
        port: plan.port,
        is_master: plan.is_server,
        world_size: plan.world_size,
        wait_for_workers: true,
        timeout: plan.timeout,
        multi_tenant: plan.multi_tenant,
        limits: Limits::PYTORCH,
        token: None,
        ping: true,
    };
    let role = match (plan.agent_store, plan.is_server) {
        (true, _) => StoreRole::AgentClient,
        (false, true) => StoreRole::Server,
        (false, false) => StoreRole::Client,
    };
    let error = |role, source| RendezvousError::Store {
        rank,
        role,
        host: plan.host.clone(),
        port: plan.port,
        source,
    };
    let wrap = |store: TcpStore| -> Arc<dyn Store> {
        let store: Arc<dyn Store> = Arc::new(store);
        match &plan.prefix {
            Some(prefix) => Arc::new(PrefixStore::new(prefix.clone(), store)),
            None => store,
        }
    };
    match TcpStore::new(options.clone()) {
        Ok(store) => Ok(wrap(store)),
        Err(source) if role == StoreRole::Server && is_addr_in_use(&source) => {
            if !agent_store_escape_hatch(env, plan.port) {
                return Err(error(role, source));
            }
            tracing::warn!(
                port = plan.port,
                rank,
                error = %source,
                "The server socket on {} has failed to bind. TORCHELASTIC_USE_AGENT_STORE is \
                 enabled so ignoring the error.",
                plan.port
            );
            options.is_master = false;
            TcpStore::new(options)
                .map(wrap)
                .map_err(|source| error(StoreRole::FallbackClient, source))
        }
        Err(source) => Err(error(role, source)),
    }
}

/// Whether `error` is a failure to bind because the port is taken.
fn is_addr_in_use(error: &StoreError) -> bool {
    matches!(error, StoreError::Io { source, .. } if source.kind() == io::ErrorKind::AddrInUse)
}

/// The C++ TCPStore's condition for ignoring a bind failure: `TORCHELASTIC_USE_AGENT_STORE`
/// truthy by `getCvarBool` and `MASTER_PORT` equal to `port`.
fn agent_store_escape_hatch(env: &dyn Env, port: u16) -> bool {
    let enabled = env
        .var("TORCHELASTIC_USE_AGENT_STORE")
        .is_some_and(cvar_bool);
    let master_port = env
        .var("MASTER_PORT")
        .and_then(|value| value.trim().parse::<i64>().ok());
    enabled && master_port == Some(i64::from(port))
}

/// C++ `getCvarBool`'s true values: `y`, `yes`, `1`, `t`, `true`, in any case.
fn cvar_bool(value: &str) -> bool {
    ["y", "yes", "1", "t", "true"]
        .iter()
        .any(|truthy| value.eq_ignore_ascii_case(truthy))
}

/// The `file://` store.
fn open_file_store(plan: &FileStorePlan, rank: u32) -> Result<Arc<dyn Store>, RendezvousError> {
    // `_file_rendezvous_handler`: `FileStore(path, world_size)` with the default timeout.
    FileStore::new(&plan.path, plan.world_size)
        .map(|store| Arc::new(store) as Arc<dyn Store>)
        .map_err(|source| RendezvousError::FileStore {
            rank,
            path: plan.path.clone(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdzv_core::env::MapEnv;

    #[test]
    fn cvar_bool_follows_cpp() {
        for value in ["y", "YES", "1", "t", "True", "tRuE"] {
            assert!(cvar_bool(value), "{value}");
        }
        for value in ["", "0", "no", "false", "on", " 1", "2", "truth"] {
            assert!(!cvar_bool(value), "{value}");
        }
    }

    #[test]
    fn escape_hatch_needs_both_variables() {
        let on = |vars: &[(&str, &str)]| agent_store_escape_hatch(&MapEnv::new(vars), 29500);
        assert!(on(&[
            ("TORCHELASTIC_USE_AGENT_STORE", "1"),
            ("MASTER_PORT", "29500")
        ]));
        assert!(on(&[
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("MASTER_PORT", " 29500 ")
        ]));
        assert!(!on(&[
            ("TORCHELASTIC_USE_AGENT_STORE", "1"),
            ("MASTER_PORT", "29501")
        ]));
        assert!(!on(&[("TORCHELASTIC_USE_AGENT_STORE", "1")]));
        assert!(!on(&[
            ("TORCHELASTIC_USE_AGENT_STORE", "0"),
            ("MASTER_PORT", "29500")
        ]));
        assert!(!on(&[("MASTER_PORT", "29500")]));
        assert!(!on(&[
            ("TORCHELASTIC_USE_AGENT_STORE", "1"),
            ("MASTER_PORT", "port")
        ]));
    }

    #[test]
    fn addr_in_use_is_recognised() {
        let busy = StoreError::Io {
            op: "start the store server on port",
            peer: "1".into(),
            source: io::Error::new(io::ErrorKind::AddrInUse, "in use"),
        };
        assert!(is_addr_in_use(&busy));
        let other = StoreError::Io {
            op: "start the store server on port",
            peer: "1".into(),
            source: io::Error::other("no"),
        };
        assert!(!is_addr_in_use(&other));
        assert!(!is_addr_in_use(&StoreError::QueueEmpty));
    }

    #[test]
    fn process_env_reads_what_it_holds() {
        let env: ProcessEnv = [("RANK".to_string(), "3".to_string())]
            .into_iter()
            .collect();
        assert_eq!(env.var("RANK"), Some("3"));
        assert_eq!(env.var("WORLD_SIZE"), None);
        assert_eq!(env.vars().count(), 1);
        // The snapshot holds what std::env sees (PATH is set wherever tests run, but do
        // not rely on any one variable: compare counts).
        let snapshot = ProcessEnv::snapshot();
        assert_eq!(snapshot.vars().count(), std::env::vars_os().count());
    }

    #[test]
    fn bundled_schemes_are_registered_once() {
        for scheme in ["tcp", "env", "file", "elastic", "etcd"] {
            let error = register_rendezvous_handler(scheme, |_: &str, _: &dyn Env, _: &_| {
                Err(RendezvousError::Unsupported("never called".into()))
            })
            .map(|()| "registered".to_string())
            .unwrap_or_else(|e| e.to_string());
            assert_eq!(
                error,
                format!("Rendezvous handler for {scheme}:// already registered")
            );
        }
    }

    #[test]
    fn file_plan_opens_a_file_store() {
        let dir = std::env::temp_dir().join(format!("rdzv-rdv-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("store");
        let url = format!("file://{}?rank=0&world_size=1", path.display());
        let plan = plan_file(&url).expect("plan");
        let store = open_store(&plan, &MapEnv::new(&[])).expect("file store");
        store.set("k", b"v").expect("set");
        assert_eq!(store.get("k").expect("get"), b"v");
        assert!(path.exists());
        drop(store);
        assert!(
            !path.exists(),
            "world_size=1: the only handle removes the file"
        );
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
