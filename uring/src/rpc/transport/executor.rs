//! The executor that runs the seam's futures: the agent's I/O thread runs one, and a
//! transport's own tests can run its futures the same way.
//!
//! It is a current-thread tokio runtime (epoll through mio, and tokio's timer) with a
//! [`LocalSet`](tokio::task::LocalSet), so that the seam's futures need not be `Send`.
//! It needs no io_uring: the agent runs where a seccomp profile refuses `io_uring_setup`
//! (Docker ≥ 25, containerd 2). Only accepting and connecting run here: every connection
//! is served by threads ([`Connection`](super::Connection)).

use std::future::Future;

/// One thread's executor for the transport seam (see the module documentation).
#[derive(Debug)]
pub struct LocalExecutor {
    runtime: tokio::runtime::Runtime,
    local: tokio::task::LocalSet,
}

impl LocalExecutor {
    /// An executor with sockets and timers.
    ///
    /// # Errors
    /// When the runtime's epoll instance or its wake-up descriptor cannot be created
    /// (the process is out of file descriptors).
    pub fn new() -> std::io::Result<LocalExecutor> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()?;
        Ok(LocalExecutor {
            runtime,
            local: tokio::task::LocalSet::new(),
        })
    }

    /// Runs `future` to completion on this thread, with the tasks it spawns
    /// (`tokio::task::spawn_local`) beside it; tasks still running when it returns are
    /// dropped (their sockets closed) before this returns.
    pub fn run<F: Future>(self, future: F) -> F::Output {
        let LocalExecutor { runtime, local } = self;
        let output = local.block_on(&runtime, future);
        // The tasks left hold sockets registered with the runtime: drop them first.
        drop(local);
        drop(runtime);
        output
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::rc::Rc;
    use std::time::Duration;

    #[test]
    fn runs_local_tasks_and_timers() {
        let executor = LocalExecutor::new().unwrap_or_else(|e| panic!("executor: {e}"));
        let counted = executor.run(async {
            // Not `Send`: local tasks may hold it.
            let count = Rc::new(std::cell::Cell::new(0));
            let tasks: Vec<_> = (0..3)
                .map(|_| {
                    let count = Rc::clone(&count);
                    tokio::task::spawn_local(async move {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        count.set(count.get() + 1);
                    })
                })
                .collect();
            for task in tasks {
                let _ = task.await;
            }
            count.get()
        });
        assert_eq!(counted, 3);
    }

    #[test]
    fn tasks_left_running_are_dropped_when_run_returns() {
        struct Flag(std::sync::Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::Release);
            }
        }
        let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = Flag(std::sync::Arc::clone(&dropped));
        let executor = LocalExecutor::new().unwrap_or_else(|e| panic!("executor: {e}"));
        executor.run(async move {
            tokio::task::spawn_local(async move {
                let _flag = flag;
                std::future::pending::<()>().await;
            });
            tokio::task::yield_now().await;
        });
        assert!(dropped.load(std::sync::atomic::Ordering::Acquire));
    }

    #[test]
    fn wakes_from_other_threads() {
        let queue = std::sync::Arc::new(crate::queue::Queue::unbounded());
        let pusher = std::sync::Arc::clone(&queue);
        let executor = LocalExecutor::new().unwrap_or_else(|e| panic!("executor: {e}"));
        let got = executor.run(async move {
            let thread = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                let _ = pusher.push(7u8);
            });
            let got = queue.pop().await;
            let _ = thread.join();
            got
        });
        assert_eq!(got, Some(7));
    }
}
