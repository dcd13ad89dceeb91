//! The process's RPC backend registry (`torch.distributed.rpc.backend_registry`):
//! [`register_backend`], [`backend_registered`] and [`init_rpc_with_backend`], over the
//! core's [`BackendRegistry`], which decides the names and messages.
//!
//! `TENSORPIPE` (the agent of [`init_rpc`]) and `FAULTY_TENSORPIPE` (the same agent; its
//! faults come from [`RpcOptions::fault_injection`](super::RpcOptions)) are registered
//! from the start.

use std::sync::{Mutex, MutexGuard, OnceLock};

use rdzv_core::rpc::backend::{BackendRegistry, FAULTY_TENSORPIPE, TENSORPIPE};

use super::agent::RpcAgent;
use super::error::InitError;
use super::options::RpcOptions;
use super::startup::init_rpc;

/// What a backend does: `init_rpc(name, rank, world_size, options)`.
pub type BackendInit = fn(&str, u32, Option<u32>, RpcOptions) -> Result<RpcAgent, InitError>;

fn registry() -> MutexGuard<'static, BackendRegistry<BackendInit>> {
    static REGISTRY: OnceLock<Mutex<BackendRegistry<BackendInit>>> = OnceLock::new();
    REGISTRY
        .get_or_init(|| {
            let mut registry = BackendRegistry::new();
            for name in [TENSORPIPE, FAULTY_TENSORPIPE] {
                // Cannot fail: the registry is empty and the names differ.
                let _ = registry.register_backend(name, init_rpc as BackendInit);
            }
            Mutex::new(registry)
        })
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// `rpc.backend_registry.register_backend(name, ...)`.
///
/// # Errors
/// [`InitError::Backend`] ("RPC backend {name}: already registered") if the name is taken.
pub fn register_backend(name: &str, init: BackendInit) -> Result<(), InitError> {
    registry()
        .register_backend(name, init)
        .map_err(InitError::Backend)
}

/// `rpc.backend_registry.backend_registered(name)`.
pub fn backend_registered(name: &str) -> bool {
    registry().backend_registered(name)
}

/// The registered backend names, newest first (`BackendType`'s member order).
pub fn backend_names() -> Vec<String> {
    registry().names().map(str::to_string).collect()
}

/// `rpc.init_rpc(name, backend=backend, ...)`: starts the agent of the backend
/// registered as `backend`.
///
/// # Errors
/// [`InitError::UnknownBackend`] ("Argument backend must be a member of BackendType") for an
/// unknown backend, else the backend's errors.
pub fn init_rpc_with_backend(
    backend: &str,
    name: &str,
    rank: u32,
    world_size: Option<u32>,
    options: RpcOptions,
) -> Result<RpcAgent, InitError> {
    // Release the registry before starting: init blocks until the whole group is up.
    let init = *registry()
        .backend(backend)
        .map_err(InitError::UnknownBackend)?;
    init(name, rank, world_size, options)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refuse(_: &str, _: u32, _: Option<u32>, _: RpcOptions) -> Result<RpcAgent, InitError> {
        Err(InitError::InvalidOption {
            option: "init_method",
            reason: "refused by the test backend".into(),
        })
    }

    #[test]
    fn builtin_backends_and_registration() {
        assert!(backend_registered("TENSORPIPE"));
        assert!(backend_registered("FAULTY_TENSORPIPE"));
        assert!(!backend_registered("tensorpipe"));
        let text = register_backend("TENSORPIPE", refuse)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(text, "RPC backend TENSORPIPE: already registered");
        assert!(register_backend("TEST_REFUSE", refuse).is_ok());
        assert!(backend_registered("TEST_REFUSE"));
        assert_eq!(
            backend_names().first().map(String::as_str),
            Some("TEST_REFUSE")
        );
        let text = init_rpc_with_backend("TEST_REFUSE", "w", 0, Some(1), RpcOptions::default())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(text.ends_with("refused by the test backend"), "{text}");
        let text = init_rpc_with_backend("NOPE", "w", 0, Some(1), RpcOptions::default())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(text, "Argument backend must be a member of BackendType");
    }
}
