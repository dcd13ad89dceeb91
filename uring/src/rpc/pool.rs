//! The worker pool: `num_worker_threads` threads that run handlers and send their
//! responses. (A `to_here` on the owner never comes here: the RRef runtime answers it
//! from the inbound lane, now or once its value exists.)

use crossbeam_channel::Receiver;
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::rpc::counters::{Counters, JoinGate};
use crate::rpc::error::InitError;
use crate::rpc::handler::{run_handler_reply, Reply};
use crate::rpc::lane::Job;
use crate::rpc::message::{on_io_thread, Message};
use crate::rpc::registry::Registry;

/// What the pool's threads read: the handlers, the server call counts, the pool's
/// counters (busy threads, queue wait).
pub(crate) struct Pool {
    /// This worker's name (in errors).
    pub name: String,
    pub registry: Arc<Registry>,
    pub gate: Arc<JoinGate>,
    pub counters: Arc<Counters>,
}

pub(crate) fn spawn_pool(
    pool: Pool,
    jobs: Receiver<Job>,
    threads: usize,
) -> Result<Vec<JoinHandle<()>>, InitError> {
    let pool = Arc::new(pool);
    let mut handles = Vec::with_capacity(threads);
    for index in 0..threads {
        let jobs = jobs.clone();
        let pool = Arc::clone(&pool);
        let handle = std::thread::Builder::new()
            .name(format!("rdzv-rpc-worker-{index}"))
            .spawn(move || loop {
                // Ends when the I/O thread and every lane dropped their senders.
                let Ok(job) = jobs.recv() else { return };
                run_job(&pool, job);
            })
            .map_err(|source| InitError::Thread {
                thread: "worker threads",
                source,
            })?;
        handles.push(handle);
    }
    Ok(handles)
}

fn run_job(pool: &Pool, job: Job) {
    let Job {
        responder,
        ctx,
        message,
        tensors,
        queued,
    } = job;
    // The handler queue wait (PyTorch's `agent.gil_average_wait_time_us`, measured
    // there around taking the GIL): from the hand-off to this thread taking the job.
    pool.counters.worker_busy(queued.elapsed());
    // Out-of-band tensors are read here, off the I/O thread, before the handler runs.
    let reply = match (tensors.pull(), pool.registry.handler(&ctx.handler)) {
        (Err(e), _) => Reply::Now(Err(e.to_string())),
        (Ok(tensors), Some(handler)) => {
            run_handler_reply(handler.as_ref(), &ctx, Message { tensors, ..message })
        }
        (Ok(_), None) => Reply::Now(Err(format!(
            "no RPC handler named {} is registered on worker {}; register it before peers call it",
            ctx.handler, pool.name
        ))),
    };
    let message_id = ctx.message_id;
    match reply {
        Reply::Now(result) => {
            pool.gate.server_call_finished();
            pool.counters.worker_idle();
            responder.respond(message_id, result);
        }
        Reply::Later(future) => {
            // The pool thread goes on; the response leaves when the future completes.
            pool.gate.server_call_went_async();
            pool.counters.worker_idle();
            let gate = Arc::clone(&pool.gate);
            future.on_done(move |result| {
                let send = move || {
                    gate.async_server_call_finished();
                    responder.respond(message_id, result.map_err(|e| e.to_string()));
                };
                // The future may complete on the I/O thread (a nested call that failed
                // while its pipe was opening); a response's blocking send must not stall
                // the handshakes there, so it leaves from a thread of its own.
                if !on_io_thread() {
                    return send();
                }
                let (tx, rx) = std::sync::mpsc::channel::<Box<dyn FnOnce() + Send>>();
                let spawned = std::thread::Builder::new()
                    .name("rdzv-rpc-respond".into())
                    .spawn(move || {
                        if let Ok(send) = rx.recv() {
                            send();
                        }
                    });
                match spawned {
                    Ok(_) => {
                        let _ = tx.send(Box::new(send));
                    }
                    Err(e) => {
                        tracing::debug!(%e, "no thread for an async response; sent from the I/O thread");
                        send();
                    }
                }
            });
        }
    }
}
