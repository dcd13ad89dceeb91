//! The I/O thread's start: its executor, its listeners, the address they make.

use std::sync::Arc;
use std::thread::JoinHandle;

use glommio::{LocalExecutorBuilder, Placement};

use crate::rpc::error::RpcError;
use crate::rpc::io::Io;
use crate::rpc::lane::Job;
use crate::rpc::lane::Shared;
use crate::rpc::message::mark_io_thread;
use crate::rpc::transport::Transport;
use rdzv_core::rpc::address::join_addresses;

/// `Some(reason)` when this host refuses io_uring, which the I/O thread's glommio
/// executor needs (glommio panics there rather than returning an error): the store
/// server falls back to epoll on such hosts, the agent's I/O thread has no fallback yet.
fn io_uring_refused() -> Option<String> {
    match crate::server::io_mode::probe_io_uring() {
        Ok(Err(refusal)) => Some(format!(
            "the RPC agent's I/O thread runs on io_uring, and this host refuses it ({}); \
             allow io_uring_setup (e.g. a seccomp profile that permits it) to run the agent \
             here; unlike the store server (`--io epoll`), the agent has no epoll fallback yet",
            refusal.0
        )),
        _ => None,
    }
}

pub(super) fn spawn_io(
    shared: &Arc<Shared>,
    transports: Vec<Box<dyn Transport + Send>>,
    jobs: std::sync::mpsc::Sender<Job>,
) -> Result<(JoinHandle<()>, String), RpcError> {
    if let Some(reason) = io_uring_refused() {
        return Err(RpcError::Executor(reason));
    }
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<String, RpcError>>();
    let shared = Arc::clone(shared);
    let name = format!("rdzv-rpc-io-{}", shared.me.name());
    let handle = std::thread::Builder::new()
        .name(name.clone())
        .spawn(move || {
            mark_io_thread();
            let built = LocalExecutorBuilder::new(Placement::Unbound)
                .name(&name)
                .io_memory(1 << 20)
                .make();
            let executor = match built {
                Ok(executor) => executor,
                Err(e) => {
                    let _ = ready_tx.send(Err(RpcError::Executor(e.to_string())));
                    return;
                }
            };
            executor.run(async move {
                let mut listeners = Vec::with_capacity(transports.len());
                for transport in &transports {
                    match transport.listen() {
                        Ok(listener) => listeners.push(listener),
                        Err(e) => {
                            let _ = ready_tx.send(Err(RpcError::from(e)));
                            return;
                        }
                    }
                }
                let address = join_addresses(listeners.iter().map(|l| l.address()));
                let _ = ready_tx.send(Ok(address));
                let transports = transports
                    .into_iter()
                    .map(|t| -> Box<dyn Transport> { t })
                    .collect();
                Io::run(shared, transports, listeners, jobs).await;
            });
        })
        .map_err(|e| RpcError::Executor(e.to_string()))?;
    match ready_rx.recv() {
        Ok(Ok(address)) => Ok((handle, address)),
        Ok(Err(e)) => {
            let _ = handle.join();
            Err(e)
        }
        Err(_) => {
            let _ = handle.join();
            Err(RpcError::Executor(
                "the I/O thread exited during start".into(),
            ))
        }
    }
}
