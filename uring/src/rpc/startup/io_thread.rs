//! The I/O thread's start: its executor, its transports listening, the address they
//! make.

use std::thread::JoinHandle;

use crate::rpc::error::InitError;
use crate::rpc::io::{Io, IoPieces};
use crate::rpc::lane::Job;
use crate::rpc::message::mark_io_thread;
use crate::rpc::transport::{LocalExecutor, Transport};
use rdzv_core::rpc::address::join_addresses;

pub(super) fn spawn_io(
    pieces: IoPieces,
    transports: Vec<Box<dyn Transport + Send>>,
    jobs: crossbeam_channel::Sender<Job>,
) -> Result<(JoinHandle<()>, String), InitError> {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<String, InitError>>();
    let name = format!("rdzv-rpc-io-{}", pieces.me.name());
    let handle = std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            mark_io_thread();
            let built = LocalExecutor::new();
            let executor = match built {
                Ok(executor) => executor,
                Err(e) => {
                    let _ = ready_tx.send(Err(InitError::Thread {
                        thread: "I/O executor",
                        source: e,
                    }));
                    return;
                }
            };
            executor.run(async move {
                let mut transports = transports;
                let mut addresses = Vec::with_capacity(transports.len());
                for transport in &mut transports {
                    match transport.listen() {
                        Ok(address) => addresses.push(address),
                        Err(e) => {
                            let _ = ready_tx.send(Err(InitError::from(e)));
                            return;
                        }
                    }
                }
                let _ = ready_tx.send(Ok(join_addresses(addresses.iter().map(String::as_str))));
                let transports = transports
                    .into_iter()
                    .map(|t| -> Box<dyn Transport> { t })
                    .collect();
                Io::run(pieces, transports, jobs).await;
            });
        })
        .map_err(|source| InitError::Thread {
            thread: "I/O thread",
            source,
        })?;
    match ready_rx.recv() {
        Ok(Ok(address)) => Ok((handle, address)),
        Ok(Err(e)) => {
            let _ = handle.join();
            Err(e)
        }
        Err(_) => {
            let _ = handle.join();
            Err(InitError::Internal("the I/O thread exited during start"))
        }
    }
}
