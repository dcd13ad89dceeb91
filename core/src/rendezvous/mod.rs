//! Rendezvous as `torch.distributed.rendezvous` does it, minus the I/O: rewriting a URL
//! with the caller's rank and world size, the scheme → handler registry, and the static
//! plans for `tcp://`, `env://` and `file://`.
//!
//! Everything here is a pure function of its inputs: the URL, the node parameters, an
//! [`Env`] the caller supplies (core never reads the process
//! environment) and, for plans, an optional timeout (core has no clock; a timeout is a
//! [`Duration`]). A plan says which store to build and who hosts it; this module does not
//! open sockets or files, create stores or wait for peers: the runtime crates do that with
//! the plan in hand. Error texts are PyTorch's, so that users can search for them.
//!
//! - [`rewrite_with_node_params`]: `_rendezvous_helper`'s URL rewriting (no heap).
//! - [`FixedHandlerRegistry`] (no heap) and `HandlerRegistry` (with `alloc`): the
//!   `register_rendezvous_handler` registry, generic over the handler type.
//! - `plan_static`, `plan_tcp`, `plan_env`, `plan_file` (with `alloc`, because plans own
//!   their host and path strings): the bundled handlers' decisions.
//! - [`use_libuv`] and [`use_agent_store`]: the two environment-driven switches.
//! - `elastic` (with `alloc`): torchelastic's dynamic rendezvous as a state machine over
//!   store operations, O(1) store work per node per join and per heartbeat.

use core::fmt;
use core::time::Duration;

use crate::env::Env;
use crate::url::RendezvousUrl;

#[cfg(feature = "alloc")]
pub mod elastic;
pub(crate) mod python;
mod registry;
mod rewrite;

#[cfg(feature = "alloc")]
mod plan;

pub use python::PyInt;
pub use registry::{FixedHandlerRegistry, NoHandler, RegisterError};
pub use rewrite::{rewrite_with_node_params, NodeParams, RewriteError, RewrittenUrl};

#[cfg(feature = "alloc")]
pub use plan::{
    agent_store_prefix, plan_env, plan_file, plan_static, plan_tcp, FileStorePlan, PlanError,
    RendezvousPlan, StorePlan, TcpStorePlan, ValueOrigin,
};
#[cfg(feature = "alloc")]
pub use registry::HandlerRegistry;

/// PyTorch's `default_pg_timeout`: 30 minutes, the store timeout when the caller gives
/// none.
pub const DEFAULT_PG_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The schemes PyTorch registers handlers for out of the box.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StaticScheme {
    /// `tcp://host:port?rank=R&world_size=W`.
    Tcp,
    /// `env://`, with `MASTER_ADDR`, `MASTER_PORT`, `RANK` and `WORLD_SIZE`.
    Env,
    /// `file:///path?rank=R&world_size=W`.
    File,
}

impl StaticScheme {
    /// The scheme as written before `://`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Env => "env",
            Self::File => "file",
        }
    }

    /// The bundled scheme of `url` (compared lowercase, as Python's parsed scheme).
    pub fn of(url: &RendezvousUrl<'_>) -> Option<Self> {
        [Self::Tcp, Self::Env, Self::File]
            .into_iter()
            .find(|scheme| url.scheme() == scheme.as_str())
    }
}

impl fmt::Display for StaticScheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `_get_use_libuv_from_query_dict`: the query's `use_libuv` value, else `USE_LIBUV`, else
/// `"1"`; the flag is on exactly when that string is `"1"`.
///
/// `query_value` is the query dictionary's `use_libuv` entry, if any.
pub fn use_libuv<E: Env + ?Sized>(query_value: Option<&str>, env: &E) -> bool {
    query_value.or_else(|| env.var("USE_LIBUV")).unwrap_or("1") == "1"
}

/// `_torchelastic_use_agent_store`: whether `TORCHELASTIC_USE_AGENT_STORE` is exactly
/// `"True"` (`"true"`, `"1"` and the like do not count, as in PyTorch's Python code).
pub fn use_agent_store<E: Env + ?Sized>(env: &E) -> bool {
    env.var("TORCHELASTIC_USE_AGENT_STORE") == Some("True")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::MapEnv;

    #[test]
    fn libuv_resolution_order() {
        let unset = MapEnv::new(&[]);
        let off = MapEnv::new(&[("USE_LIBUV", "0")]);
        let on = MapEnv::new(&[("USE_LIBUV", "1")]);
        let odd = MapEnv::new(&[("USE_LIBUV", "true")]);
        assert!(use_libuv(None, &unset));
        assert!(!use_libuv(None, &off));
        assert!(use_libuv(None, &on));
        assert!(!use_libuv(None, &odd));
        assert!(use_libuv(Some("1"), &off));
        assert!(!use_libuv(Some("0"), &on));
        assert!(!use_libuv(Some(""), &on));
        assert!(!use_libuv(Some(" 1"), &unset));
    }

    #[test]
    fn agent_store_needs_exactly_true() {
        for (value, expected) in [("True", true), ("true", false), ("1", false), ("", false)] {
            let vars = [("TORCHELASTIC_USE_AGENT_STORE", value)];
            assert_eq!(use_agent_store(&MapEnv::new(&vars)), expected, "{value:?}");
        }
        assert!(!use_agent_store(&MapEnv::new(&[])));
    }

    #[test]
    fn static_schemes_compare_lowercase() {
        let url = RendezvousUrl::parse("TCP://h:1").expect("valid");
        assert_eq!(StaticScheme::of(&url), Some(StaticScheme::Tcp));
        let url = RendezvousUrl::parse("etcd://h:1").expect("valid");
        assert_eq!(StaticScheme::of(&url), None);
        assert_eq!(DEFAULT_PG_TIMEOUT.as_secs(), 1800);
    }
}
