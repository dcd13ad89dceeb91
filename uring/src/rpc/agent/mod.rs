//! The [`RpcAgent`] handle: calls, handlers, metrics, `join` and shutdown. The handle is
//! `Send + Sync`: every method may be called from any thread. Calls are handed to the
//! I/O thread and complete an [`RpcFuture`]; handlers run on a pool of
//! `num_worker_threads` threads. Start-up is `startup`'s ([`init_rpc`](super::init_rpc)).
//!
//! The calls (`rpc_sync`, `rpc_async`, the node-failure probes) are in `calls`, the RRef
//! methods in `rrefs`, `join` without shutdown in `join`.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdzv_core::negotiate::{ChannelKind, TransportKind};
use rdzv_core::rpc::membership::GROUP_LEAVE;
use rdzv_core::rpc::metrics::NetworkData;
use rdzv_core::rpc::name::WorkerInfo;
use rdzv_core::rpc::shutdown::{Join, JoinSequence, Leave};
use rdzv_core::rpc::store_keys::{membership_token, Membership, RpcKeys};

use crate::rpc::client::RpcClient;
use crate::rpc::counters::Counters;
use crate::rpc::deadline::DeadlineStore;
use crate::rpc::dispatch::Dispatch;
use crate::rpc::drive::{acquire_token, drive, release_token};
use crate::rpc::error::{store_error, CallError, ShutdownError, UsageError};
use crate::rpc::handler::Handler;
use crate::rpc::mailbox::Command;
use crate::rpc::message::Message;
use crate::rpc::mpt::MptSetup;
use crate::rpc::options::RESERVED_PREFIX;
use crate::rpc::rref_runtime::{self, RRefs};
use crate::store::Store;

mod calls;
mod join;
mod rrefs;

/// The agent: make calls, register handlers, read metrics, shut down.
///
/// # Joining and shutting down, beside PyTorch
///
/// | PyTorch | here | what it does |
/// |---|---|---|
/// | `rpc.shutdown()`, `rpc.shutdown(graceful=True)` | [`join`](Self::join), [`shutdown(true)`](Self::shutdown) | settles this worker's RRefs, waits until no worker of the group has a call in flight, says goodbye and closes |
/// | `rpc.shutdown(graceful=True, timeout=t)` | [`shutdown_with_timeout(true, t)`](Self::shutdown_with_timeout) | the same, giving up after `t`: then it closes at once and says which workers never joined |
/// | `rpc.shutdown(graceful=False)` | [`shutdown(false)`](Self::shutdown) | closes now; pending futures fail with [`CallError::ShutDown`] |
/// | `agent.join(shutdown=False)` | [`join_without_shutdown(None)`](Self::join_without_shutdown) | waits until no worker of the group has a call in flight (every worker must call it), then goes on serving |
/// | `agent.join(shutdown=False, timeout=t)` | [`join_without_shutdown(Some(t))`](Self::join_without_shutdown) | the same, giving up after `t` (PyTorch's `TensorPipeAgent` ignores its timeout) |
/// | `agent.join(shutdown=True, timeout=t)` | [`join_with(true, t)`](Self::join_with) | a graceful shutdown: unlike PyTorch's agent-level `join`, it also settles RRefs first, as `rpc.shutdown` does before calling it |
///
/// [`join_with(shutdown, timeout)`](Self::join_with) is PyTorch's `join` spelled as it
/// is there. In a dynamic group (no world size) the graceful forms leave the group;
/// `join_without_shutdown` waits only for this worker's own calls (PyTorch's agent
/// leaves the group on any `join`).
///
/// **After a join or graceful shutdown that timed out or failed.** A graceful shutdown
/// closes the agent anyway (as PyTorch's `rpc.shutdown` does in its `finally`). A
/// [`join_without_shutdown`](Self::join_without_shutdown) that stops part-way keeps the
/// agent serving, but this worker's barriers are then out of step with the group's
/// (core's [`JoinSequence`]): every later join or graceful shutdown fails at once with
/// [`ShutdownError::Join`] (core's `JoinError::OutOfStep`) instead of waiting for ever, and
/// the group must end with `shutdown(false)` on every worker. A join that timed out
/// while still waiting for this worker's own calls entered no barrier and may be tried
/// again. A graceful call on an agent whose graceful shutdown gave up says so too,
/// rather than reporting success; `shutdown(false)` after any of these succeeds.
pub struct RpcAgent {
    /// How calls start: this worker, the group and handlers, call counts, the mailbox.
    pub(crate) dispatch: Arc<Dispatch>,
    /// Metrics, network data and channel bytes.
    pub(crate) counters: Arc<Counters>,
    /// The mpt connection listener (closed at shutdown), when this worker offers mpt.
    pub(crate) mpt: Option<Arc<MptSetup>>,
    /// The RRef runtime (also behind `dispatch.rrefs`).
    pub(crate) rrefs: Arc<RRefs>,
    /// `None` for a dynamic group.
    pub(crate) world_size: Option<u32>,
    pub(crate) client: RpcClient,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) keys: RpcKeys,
    pub(crate) io_thread: Mutex<Option<JoinHandle<()>>>,
    pub(crate) workers: Mutex<Vec<JoinHandle<()>>>,
    pub(crate) address: String,
    /// Where this worker's join barriers stand (core's [`JoinSequence`]).
    pub(crate) join_sequence: Mutex<JoinSequence>,
}

impl std::fmt::Debug for RpcAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcAgent")
            .field("me", &self.dispatch.me)
            .field("world_size", &self.world_size)
            .field("address", &self.address)
            .finish()
    }
}

impl RpcAgent {
    /// This worker.
    pub fn worker_info(&self) -> &WorkerInfo {
        &self.dispatch.me
    }

    /// The group's size.
    pub fn world_size(&self) -> Option<u32> {
        self.world_size
    }

    /// The address peers reach this worker at: its listeners' addresses, highest
    /// priority first, joined by `;` (`shm://@name;tcp://ip:port`).
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Every member of the group, this worker included, in id order.
    pub fn worker_infos(&self) -> Vec<WorkerInfo> {
        let mut infos: Vec<WorkerInfo> = self
            .dispatch
            .registry
            .group()
            .peers
            .iter()
            .filter_map(|(name, peer)| WorkerInfo::with_id(name, peer.id).ok())
            .collect();
        infos.sort_by_key(|w| w.id().get());
        infos
    }

    /// `rpc.get_worker_infos()`: [`worker_infos`](Self::worker_infos).
    pub fn get_worker_infos(&self) -> Vec<WorkerInfo> {
        self.worker_infos()
    }

    /// `rpc.get_worker_info(name)`: the member named `name` (this worker included).
    ///
    /// # Errors
    /// [`UsageError::UnknownWorker`] if no member has that name.
    pub fn get_worker_info(&self, name: &str) -> Result<WorkerInfo, UsageError> {
        let group = self.dispatch.registry.group();
        group
            .peers
            .get(name)
            .and_then(|peer| WorkerInfo::with_id(name, peer.id).ok())
            .ok_or_else(|| UsageError::UnknownWorker {
                name: name.to_string(),
            })
    }

    /// The member whose id is `id` (PyTorch's `agent.get_worker_info(id)`).
    ///
    /// # Errors
    /// [`UsageError::UnknownWorkerId`] if no member has that id.
    pub fn get_worker_info_by_id(&self, id: i64) -> Result<WorkerInfo, UsageError> {
        self.worker_infos()
            .into_iter()
            .find(|w| i64::from(w.id().get()) == id)
            .ok_or(UsageError::UnknownWorkerId { id })
    }

    /// Registers `handler` under `name`; peers calling `name` before this get an error.
    ///
    /// # Errors
    /// [`UsageError::HandlerExists`] if the name is taken (names starting with `__rdzv_`
    /// are the agent's own).
    pub fn register_handler(&self, name: &str, handler: impl Handler) -> Result<(), UsageError> {
        let mut handlers = self.dispatch.registry.handlers_mut();
        if handlers.contains_key(name) || name.starts_with(RESERVED_PREFIX) {
            return Err(UsageError::HandlerExists {
                name: name.to_string(),
            });
        }
        handlers.insert(name.to_string(), Arc::new(handler));
        Ok(())
    }

    /// The transport that the last pipe this worker opened to `peer` runs on (`shm`
    /// between workers on one host unless `transports` leaves it out, else `tcp`);
    /// `None` before the first call to `peer`.
    pub fn pipe_transport(&self, peer: &str) -> Option<TransportKind> {
        self.counters.pipe_transport(peer)
    }

    /// The channel that the last pipe this worker opened to `peer` uses for CPU tensors
    /// of at least [`RpcOptions::min_channel_bytes`](crate::rpc::RpcOptions::min_channel_bytes) (`xth` within one process, `cma`
    /// between processes of one host that pass its checks, else `basic`); `None` before
    /// the first call to `peer`, or when no channel serves CPU tensors on that pipe.
    pub fn pipe_channel(&self, peer: &str) -> Option<ChannelKind> {
        self.counters.pipe_channel(peer)
    }

    /// How many inbound pipes this worker closed because the peer failed the handshake,
    /// before reading anything else it sent: no proof of the group secret or a wrong
    /// one, a hello from a worker not in the group, a malformed frame, or no hello or
    /// proof within [`InboundHandshakes::timeout`](crate::rpc::InboundHandshakes).
    pub fn handshakes_refused(&self) -> u64 {
        self.counters.handshakes_refused()
    }

    /// The most peers that connected here were ever in their handshake at once (at most
    /// [`InboundHandshakes::max_in_flight`](crate::rpc::InboundHandshakes::max_in_flight)).
    pub fn most_inbound_handshakes(&self) -> u64 {
        self.counters.most_inbound_handshakes()
    }

    /// Tensor bytes this worker has sent (in requests and responses) per channel, for
    /// every channel that moved any.
    pub fn tensor_bytes_by_channel(&self) -> Vec<(ChannelKind, u64)> {
        self.counters.channel_bytes()
    }

    /// `get_metrics()`: PyTorch's agent keys (`agent.client_active_calls`,
    /// `agent.server_active_calls`, ...) with their values as text, in a fixed order.
    pub fn get_metrics(&self) -> Vec<(String, String)> {
        self.counters
            .metrics(&self.dispatch.gate)
            .metrics()
            .map(|(key, value)| (key.to_string(), value.to_string()))
            .collect()
    }

    /// Turns the handler queue wait metric on or off (PyTorch's
    /// `agent.enable_gil_profiling`). While on, [`get_metrics`](Self::get_metrics) also
    /// lists `agent.gil_average_wait_time_us`: the average time, in µs, a request handed
    /// to the worker pool waited for a pool thread (PyTorch measures the wait for the
    /// GIL there; ours is the queue wait). Switching it off forgets what was measured.
    /// Inline handlers run where the request arrived and are not counted.
    pub fn enable_wait_profiling(&self, on: bool) {
        self.counters.enable_wait_profiling(on);
    }

    /// Per-peer network data: calls made to each peer, bytes sent and received, errors.
    pub fn network_data(&self) -> NetworkData {
        self.counters.network()
    }

    /// PyTorch's `wait_until_pending_futures_and_users_flushed` test helper: waits until
    /// this worker has no call in flight.
    ///
    /// # Errors
    /// [`CallError::FlushTimeout`] naming the calls left after `timeout`.
    pub fn wait_until_pending_futures_flushed(&self, timeout: Duration) -> Result<(), CallError> {
        match self.dispatch.gate.await_flushed(timeout) {
            0 => Ok(()),
            pending => Err(CallError::FlushTimeout { pending }),
        }
    }

    /// Closes every pipe now (e.g. after a network change): calls in flight on them fail
    /// with [`CallError::PipeBroken`], and the next call to each peer opens a new pipe.
    pub fn reset_pipes(&self) {
        let _ = self.dispatch.mailbox.push(Command::ResetPipes);
    }

    /// Graceful shutdown: `shutdown(true)`.
    ///
    /// # Errors
    /// As [`shutdown`](Self::shutdown).
    pub fn join(&self) -> Result<(), ShutdownError> {
        self.shutdown(true)
    }

    /// The agent's `join(shutdown, timeout)`, spelled as in PyTorch (see the table on
    /// [`RpcAgent`]; [`join_without_shutdown`](Self::join_without_shutdown) is the clearer
    /// name for `shutdown = false`). With `shutdown`, a graceful
    /// [`shutdown_with_timeout`](Self::shutdown_with_timeout) (or
    /// [`shutdown`](Self::shutdown) without a timeout). Without: waits until no worker of the group has a
    /// call in flight (the same barriers as a graceful shutdown, every worker must call
    /// it), then goes on serving: calls may be made again at once, and the agent is shut
    /// down later. In a dynamic group, where members come and go, it waits only for this
    /// worker's own calls.
    ///
    /// # Errors
    /// [`ShutdownError::Store`] or [`ShutdownError::Join`] if the protocol fails (the agent keeps
    /// running), [`ShutdownError::JoinTimeout`] naming the workers that never joined when
    /// `timeout` passes first, or as [`shutdown`](Self::shutdown). After either, if the
    /// join had entered its barriers, every later join fails at once with
    /// [`ShutdownError::Join`] saying to shut down with `shutdown(false)` (see [`RpcAgent`]).
    pub fn join_with(
        &self,
        shutdown: bool,
        timeout: Option<Duration>,
    ) -> Result<(), ShutdownError> {
        if shutdown {
            return self.shutdown_by(true, timeout);
        }
        let running = self
            .io_thread
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some();
        if !running {
            return Err(ShutdownError::ShutDown {
                name: self.dispatch.me.name().to_string(),
            });
        }
        match self.world_size {
            Some(world_size) => self.run_join_rounds(world_size, false, timeout),
            None => match timeout {
                None => {
                    self.dispatch.gate.await_no_client_calls();
                    Ok(())
                }
                Some(timeout) => match self.dispatch.gate.await_flushed(timeout) {
                    0 => Ok(()),
                    _ => Err(self.join_timeout(timeout, Vec::new())),
                },
            },
        }
    }

    /// `rpc.shutdown(graceful)`. Graceful: settle this worker's RRefs first (wait until
    /// its users are confirmed, release them, report leaks by owner: see
    /// [`rref_shutdown_report`](Self::rref_shutdown_report)); wait until this worker has
    /// no calls in flight,
    /// then run the store barriers that sum every worker's in-flight calls until the
    /// total is zero (the core's `join` protocol), then say goodbye on every pipe and
    /// close. Not graceful: close at once. Either way every pending future fails with
    /// [`CallError::ShutDown`] rather than hang. Calling it again does nothing, except
    /// that a graceful call after a graceful shutdown or join that gave up fails (see
    /// [`RpcAgent`]).
    ///
    /// # Errors
    /// [`ShutdownError::Store`] or [`ShutdownError::Join`] if the graceful protocol fails; the
    /// agent is closed anyway. [`ShutdownError::Join`] at once, closing the agent without the
    /// group, if an earlier join stopped part-way or a graceful shutdown gave up.
    pub fn shutdown(&self, graceful: bool) -> Result<(), ShutdownError> {
        self.shutdown_by(graceful, None)
    }

    /// `rpc.shutdown(graceful, timeout)`: [`shutdown`](Self::shutdown), whose graceful
    /// protocol gives up after `timeout` (then the agent closes at once, as if not
    /// graceful, and pending futures fail with [`CallError::ShutDown`]).
    ///
    /// # Errors
    /// [`ShutdownError::JoinTimeout`] when `timeout` passed first, naming the workers that
    /// never reached the shutdown barrier; otherwise as [`shutdown`](Self::shutdown).
    pub fn shutdown_with_timeout(
        &self,
        graceful: bool,
        timeout: Duration,
    ) -> Result<(), ShutdownError> {
        self.shutdown_by(graceful, Some(timeout))
    }

    fn shutdown_by(&self, graceful: bool, timeout: Option<Duration>) -> Result<(), ShutdownError> {
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

    fn close(&self, goodbye: bool) {
        let _ = self.dispatch.mailbox.push(Command::Close { goodbye });
        let io = self
            .io_thread
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(io) = io {
            let _ = io.join();
        }
        if let Some(mpt) = &self.mpt {
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

    fn run_join(&self, timeout: Option<Duration>) -> Result<(), ShutdownError> {
        let Some(world_size) = self.world_size else {
            return self.run_leave();
        };
        self.run_join_rounds(world_size, true, timeout)
    }

    /// Core's `join` rounds over the store, from the next barrier id on; with a
    /// `timeout`, every wait (this worker's calls, the store's barriers) ends by it.
    fn run_join_rounds(
        &self,
        world_size: u32,
        shutdown: bool,
        timeout: Option<Duration>,
    ) -> Result<(), ShutdownError> {
        let first = self.join_start()?;
        let me = self.dispatch.me.name();
        let entry = self.keys.join_entry(first, me);
        self.store
            .set(&entry, b"")
            .map_err(store_error("set", &entry))?;
        let mut join = Join::new(self.keys.clone(), world_size, first, shutdown);
        let result = match timeout {
            None => drive(&*self.store, Some(&self.dispatch.gate), me, &mut join),
            Some(timeout) => {
                let deadline = Instant::now() + timeout;
                if self.dispatch.gate.await_flushed(timeout) > 0 {
                    return Err(self.join_timeout(timeout, Vec::new()));
                }
                let store = DeadlineStore::new(&*self.store, deadline);
                match drive(&store, Some(&self.dispatch.gate), me, &mut join) {
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
        let me = self.dispatch.me.name();
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

    fn join_timeout(&self, timeout: Duration, missing: Vec<String>) -> ShutdownError {
        ShutdownError::JoinTimeout {
            name: self.dispatch.me.name().to_string(),
            timeout,
            missing,
        }
    }

    fn release_calls(&self) {
        self.dispatch.gate.release();
    }

    /// A dynamic member's graceful leave, under the group token: tell every other
    /// member, then the core's `Leave` (no calls in flight, unlist, mark shutting down).
    fn run_leave(&self) -> Result<(), ShutdownError> {
        let me = self.dispatch.me.clone();
        let token = membership_token(me.name(), Membership::Leave);
        acquire_token::<ShutdownError>(&*self.store, &self.keys, &token, me.name())?;
        let left = (|| -> Result<(), ShutdownError> {
            let others: Vec<String> = self
                .dispatch
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
            let gate = Some(&*self.dispatch.gate);
            drive(&*self.store, gate, me.name(), &mut leave)
        })();
        if left.is_err() {
            self.release_calls();
        }
        release_token(&*self.store, &self.keys, &token, me.name()).and(left)
    }
}

impl Drop for RpcAgent {
    fn drop(&mut self) {
        let running = self
            .io_thread
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some();
        if running {
            self.close(false);
        }
    }
}
