//! The worker pool: `num_worker_threads` threads that run handlers and send their
//! responses. A `to_here` on the owner is the RRef runtime's to answer, now or once its
//! value exists (`rref_runtime::take_fetch`), without holding a pool thread.

use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::rpc::error::RpcError;
use crate::rpc::handler::run_handler;
use crate::rpc::lane::Job;
use crate::rpc::lane::Shared;
use crate::rpc::message::Message;
use crate::rpc::rref_runtime::{take_fetch, RRefs};

pub(crate) fn spawn_pool(
    shared: &Arc<Shared>,
    rrefs: &Arc<RRefs>,
    jobs: Receiver<Job>,
    threads: usize,
) -> Result<Vec<JoinHandle<()>>, RpcError> {
    let jobs = Arc::new(Mutex::new(jobs));
    let mut handles = Vec::with_capacity(threads);
    for index in 0..threads {
        let jobs = Arc::clone(&jobs);
        let shared = Arc::clone(shared);
        let rrefs = Arc::clone(rrefs);
        let handle = std::thread::Builder::new()
            .name(format!("rdzv-rpc-worker-{index}"))
            .spawn(move || loop {
                let job = {
                    let receiver = jobs.lock().unwrap_or_else(|p| p.into_inner());
                    receiver.recv()
                };
                let Ok(job) = job else { return };
                if let Some(job) = take_fetch(&rrefs, &shared, job) {
                    run_job(&shared, job);
                }
            })
            .map_err(|e| RpcError::Executor(format!("worker thread: {e}")))?;
        handles.push(handle);
    }
    Ok(handles)
}

fn run_job(shared: &Shared, job: Job) {
    shared.counters.worker_busy();
    let Job {
        responder,
        ctx,
        message,
        tensors,
    } = job;
    // Out-of-band tensors are read here, off the I/O thread, before the handler runs.
    let result = match (tensors.pull(), shared.registry.handler(&ctx.handler)) {
        (Err(e), _) => Err(e.to_string()),
        (Ok(tensors), Some(handler)) => {
            run_handler(handler.as_ref(), &ctx, Message { tensors, ..message })
        }
        (Ok(_), None) => Err(format!(
            "no RPC handler named {} is registered on worker {}; register it before peers call it",
            ctx.handler,
            shared.me.name()
        )),
    };
    shared.gate.server_call_finished();
    shared.counters.worker_idle();
    responder.respond(shared, ctx.message_id, result);
}
