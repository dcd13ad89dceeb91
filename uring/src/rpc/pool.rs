//! The worker pool: `num_worker_threads` threads that run handlers and send their
//! responses ([`Job::run`]), each in one of the worker slots it shares with the readers
//! that run handlers themselves. (A `to_here` on the owner never comes here: the RRef
//! runtime answers it from the inbound lane, now or once its value exists.)

use crossbeam_channel::Receiver;
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::rpc::error::InitError;
use crate::rpc::lane::{Job, Runner};

pub(crate) fn spawn_pool(
    runner: Arc<Runner>,
    jobs: Receiver<Job>,
    threads: usize,
) -> Result<Vec<JoinHandle<()>>, InitError> {
    let mut handles = Vec::with_capacity(threads);
    for index in 0..threads {
        let jobs = jobs.clone();
        let runner = Arc::clone(&runner);
        let handle = std::thread::Builder::new()
            .name(format!("rdzv-rpc-worker-{index}"))
            .spawn(move || loop {
                // Ends when the I/O thread and every lane dropped their senders.
                let Ok(job) = jobs.recv() else { return };
                runner.slots.take();
                job.run(&runner);
                runner.slots.give();
            })
            .map_err(|source| InitError::Thread {
                thread: "worker threads",
                source,
            })?;
        handles.push(handle);
    }
    Ok(handles)
}
