//! The steps of a shutdown and a join behind [`RpcAgent::shutdown`] and
//! [`RpcAgent::join_with`]: the graceful protocol (settle the RRefs, core's join rounds
//! over the store, or a dynamic member's leave), then closing the I/O thread, the mpt
//! listener and the pool.

use super::*;

impl RpcAgent {
    /// A shutdown: with `graceful`, the join protocol first (ended by `timeout`), then
    /// the close; a failed protocol still closes, and later joins fail at once.
    pub(super) fn shutdown_by(
        &self,
        graceful: bool,
        timeout: Option<Duration>,
    ) -> Result<(), ShutdownError> {
        let running = self
            .io_thread
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some();
        if !running {
            return if graceful {
                self.join_start().map(drop)
            } else {
                Ok(())
            };
        }
        let protocol = if graceful {
            let deadline = timeout.map(|t| Instant::now() + t);
            self.join_start().and_then(|_| {
                rref_runtime::settle_for_join(&self.rrefs, deadline);
                self.run_join(deadline.map(|d| d.saturating_duration_since(Instant::now())))
                    .map_err(|e| join::timeout_as_asked(e, timeout))
            })
        } else {
            Ok(())
        };
        if graceful && protocol.is_err() {
            self.join_gave_up();
        }
        self.close(graceful && protocol.is_ok());
        protocol
    }

    /// Stops the I/O thread (saying goodbye to the peers when `goodbye`), the mpt
    /// listener and, when every call in the group is over, the pool's threads.
    pub(super) fn close(&self, goodbye: bool) {
        let _ = self.shared.mailbox.push(Command::Close { goodbye });
        let io = self
            .io_thread
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(io) = io {
            let _ = io.join();
        }
        if let Some(mpt) = &self.shared.mpt {
            mpt.listener.close();
        }
        let workers = std::mem::take(&mut *self.workers.lock().unwrap_or_else(|p| p.into_inner()));
        if goodbye {
            // Every call in the group is over: the pool's threads exit at once.
            for worker in workers {
                let _ = worker.join();
            }
        }
        // Otherwise a handler may still be running; its thread exits when it returns.
    }

    /// A graceful shutdown's protocol: the join rounds of a static group, a dynamic
    /// member's leave.
    fn run_join(&self, timeout: Option<Duration>) -> Result<(), ShutdownError> {
        let Some(world_size) = self.world_size else {
            return self.run_leave();
        };
        self.run_join_rounds(world_size, true, timeout)
    }

    /// Core's `join` rounds over the store, from the next barrier id on; with a
    /// `timeout`, every wait (this worker's calls, the store's barriers) ends by it.
    pub(super) fn run_join_rounds(
        &self,
        world_size: u32,
        shutdown: bool,
        timeout: Option<Duration>,
    ) -> Result<(), ShutdownError> {
        let first = self.join_start()?;
        let me = self.shared.me.name();
        let entry = self.keys.join_entry(first, me);
        self.store
            .set(&entry, b"")
            .map_err(store_error("set", &entry))?;
        let mut join = Join::new(self.keys.clone(), world_size, first, shutdown);
        let result = match timeout {
            None => drive(&*self.store, Some(&self.shared.gate), me, &mut join),
            Some(timeout) => {
                let deadline = Instant::now() + timeout;
                if self.shared.gate.await_flushed(timeout) > 0 {
                    return Err(self.join_timeout(timeout, Vec::new()));
                }
                let store = DeadlineStore::new(&*self.store, deadline);
                match drive(&store, Some(&self.shared.gate), me, &mut join) {
                    Err(_) if store.expired() => {
                        Err(self.join_timeout(timeout, self.missing_from_join(first)))
                    }
                    result => result,
                }
            }
        };
        self.join_finished(first, join.next_barrier_id(), result.is_ok());
        if result.is_err() {
            self.release_calls();
        }
        result
    }

    /// The other members that never entered the join whose first barrier is `first`.
    fn missing_from_join(&self, first: u64) -> Vec<String> {
        let me = self.shared.me.name();
        self.worker_infos()
            .into_iter()
            .map(|w| w.name().to_string())
            .filter(|name| name != me)
            .filter(|name| {
                let key = self.keys.join_entry(first, name);
                !matches!(self.store.check(&[&key]), Ok(true))
            })
            .collect()
    }

    pub(super) fn join_timeout(&self, timeout: Duration, missing: Vec<String>) -> ShutdownError {
        ShutdownError::JoinTimeout {
            name: self.shared.me.name().to_string(),
            timeout,
            missing,
        }
    }

    fn release_calls(&self) {
        self.shared.gate.release();
    }

    /// A dynamic member's graceful leave, under the group token: tell every other
    /// member, then the core's `Leave` (no calls in flight, unlist, mark shutting down).
    fn run_leave(&self) -> Result<(), ShutdownError> {
        let me = self.shared.me.clone();
        let token = membership_token(me.name(), Membership::Leave);
        acquire_token::<ShutdownError>(&*self.store, &self.keys, &token, me.name())?;
        let left = (|| -> Result<(), ShutdownError> {
            let others: Vec<String> = self
                .shared
                .registry
                .group()
                .peers
                .keys()
                .filter(|name| name.as_str() != me.name())
                .cloned()
                .collect();
            for name in others {
                self.rpc_sync(
                    &name,
                    GROUP_LEAVE,
                    Message::from_payload(me.name().as_bytes().to_vec()),
                )?;
            }
            let mut leave = Leave::new(&self.keys, me.clone());
            drive(&*self.store, Some(&self.shared.gate), me.name(), &mut leave)
        })();
        if left.is_err() {
            self.release_calls();
        }
        release_token(&*self.store, &self.keys, &token, me.name()).and(left)
    }
}
