//! What the agent counts, in two pieces with a lock each:
//! - [`Counters`]: PyTorch's agent metrics (the pool's idle threads), per-peer network
//!   data, tensor bytes per channel, and the transport and channel of each peer's last
//!   client pipe; written as calls complete and pipes open, read by the agent's getters;
//! - [`JoinGate`]: the calls in flight, which `join` waits on and freezes (a new client
//!   call waits while frozen), and whether this worker is shutting down.
//!
//! Locks are held only for bookkeeping, never across I/O or a handler.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdzv_core::negotiate::{ChannelKind, TransportKind};
use rdzv_core::rpc::metrics::{AgentMetrics, CallCounters, NetworkData};

use super::message::on_io_thread;
use super::tensors::ChannelBytes;

#[derive(Debug)]
struct Tallies {
    metrics: AgentMetrics,
    network: NetworkData,
    /// Tensor bytes this worker sent, per channel (requests and responses).
    channel_bytes: ChannelBytes,
    /// The transport of the last client pipe opened to each peer.
    pipe_transports: HashMap<String, TransportKind>,
    /// The CPU-to-CPU channel of the last client pipe opened to each peer (`None`: no
    /// channel serves CPU tensors on it).
    pipe_channels: HashMap<String, Option<ChannelKind>>,
}

/// Metrics, network data, tensor bytes and the pipes' kinds.
#[derive(Debug)]
pub(crate) struct Counters {
    tallies: Mutex<Tallies>,
    /// Inbound pipes closed because the peer failed the handshake.
    handshakes_refused: AtomicU64,
    /// Accepted peers whose handshake is not done now, and the most there ever were.
    inbound_handshakes: AtomicU64,
    most_inbound_handshakes: AtomicU64,
    /// When a refusal was last logged (at most one a second is).
    refusal_logged: Mutex<Option<Instant>>,
}

/// How often a refused handshake is logged at most (the others are only counted).
const REFUSALS_LOGGED_EVERY: Duration = Duration::from_secs(1);

impl Counters {
    /// No calls yet, with a worker pool of `pool_size` threads.
    pub(crate) fn new(pool_size: u32) -> Counters {
        Counters {
            tallies: Mutex::new(Tallies {
                metrics: AgentMetrics::new(pool_size),
                network: NetworkData::new(),
                channel_bytes: ChannelBytes::default(),
                pipe_transports: HashMap::new(),
                pipe_channels: HashMap::new(),
            }),
            handshakes_refused: AtomicU64::new(0),
            inbound_handshakes: AtomicU64::new(0),
            most_inbound_handshakes: AtomicU64::new(0),
            refusal_logged: Mutex::new(None),
        }
    }

    /// A peer at `from` (calling itself `peer`, once its hello was read) failed the
    /// handshake: a bad or missing proof, a stranger's hello, a malformed frame, or no
    /// frame in time. Counted, and logged unless another refusal was within the last
    /// second.
    pub(crate) fn handshake_refused(&self, from: &str, peer: Option<&str>, reason: &str) {
        let count = self.handshakes_refused.fetch_add(1, Ordering::Relaxed) + 1;
        let mut logged = self
            .refusal_logged
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        if logged.is_none_or(|at| now.duration_since(at) >= REFUSALS_LOGGED_EVERY) {
            *logged = Some(now);
            tracing::warn!(
                %from,
                peer = peer.unwrap_or("(no hello read)"),
                refused = count,
                "refused an RPC pipe before reading any call: {reason}"
            );
        }
    }

    /// How many inbound pipes were closed for failing the handshake.
    pub(crate) fn handshakes_refused(&self) -> u64 {
        self.handshakes_refused.load(Ordering::Relaxed)
    }

    /// An accepted peer's handshake began (`true`) or ended.
    pub(crate) fn inbound_handshake(&self, began: bool) {
        if began {
            let now = self.inbound_handshakes.fetch_add(1, Ordering::Relaxed) + 1;
            self.most_inbound_handshakes
                .fetch_max(now, Ordering::Relaxed);
        } else {
            self.inbound_handshakes.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// The most accepted peers that were ever in their handshake at once.
    pub(crate) fn most_inbound_handshakes(&self) -> u64 {
        self.most_inbound_handshakes.load(Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, Tallies> {
        self.tallies.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A call to `peer` that sent `sent` bytes failed.
    pub(crate) fn network_error(&self, sent: u64, peer: &str) {
        self.lock().network.track_network_error(sent, peer);
    }

    /// A call to `peer` sent `sent` bytes and received `received`.
    pub(crate) fn network_data(&self, sent: u64, received: u64, peer: &str) {
        self.lock().network.track_network_data(sent, received, peer);
    }

    /// Per-peer network data so far.
    pub(crate) fn network(&self) -> NetworkData {
        self.lock().network.clone()
    }

    /// Adds the tensor bytes a frame moved.
    pub(crate) fn add_channel_bytes(&self, moved: &ChannelBytes) {
        moved.add_to(&mut self.lock().channel_bytes);
    }

    /// Every channel that moved tensor bytes, with the bytes.
    pub(crate) fn channel_bytes(&self) -> Vec<(ChannelKind, u64)> {
        self.lock().channel_bytes.iter().collect()
    }

    /// A client pipe to `peer` opened over `transport`, with `channel` for CPU tensors.
    pub(crate) fn pipe_opened(
        &self,
        peer: &str,
        transport: TransportKind,
        channel: Option<ChannelKind>,
    ) {
        let mut tallies = self.lock();
        tallies.pipe_transports.insert(peer.to_string(), transport);
        tallies.pipe_channels.insert(peer.to_string(), channel);
    }

    /// The transport of the last client pipe opened to `peer`.
    pub(crate) fn pipe_transport(&self, peer: &str) -> Option<TransportKind> {
        self.lock().pipe_transports.get(peer).copied()
    }

    /// The CPU channel of the last client pipe opened to `peer`.
    pub(crate) fn pipe_channel(&self, peer: &str) -> Option<ChannelKind> {
        self.lock().pipe_channels.get(peer).copied().flatten()
    }

    /// A pool thread took a job that waited `queued` for it (recorded while wait
    /// profiling is on).
    pub(crate) fn worker_busy(&self, queued: Duration) {
        let mut tallies = self.lock();
        tallies.metrics.num_idle_threads = tallies.metrics.num_idle_threads.saturating_sub(1);
        if tallies.metrics.wait_profiling_enabled() {
            let micros = u64::try_from(queued.as_micros()).unwrap_or(u64::MAX);
            tallies.metrics.add_wait_time_us(micros);
        }
    }

    /// Turns the handler queue wait metric on (keeping what was measured) or off
    /// (forgetting it).
    pub(crate) fn enable_wait_profiling(&self, on: bool) {
        self.lock().metrics.enable_wait_profiling(on);
    }

    /// A pool thread finished its job.
    pub(crate) fn worker_idle(&self) {
        let mut tallies = self.lock();
        tallies.metrics.num_idle_threads = tallies.metrics.num_idle_threads.saturating_add(1);
    }

    /// The metrics, with the call counts of `gate`.
    pub(crate) fn metrics(&self, gate: &JoinGate) -> AgentMetrics {
        let mut metrics = self.lock().metrics;
        metrics.calls = gate.counts();
        metrics
    }
}

#[derive(Debug, Default)]
struct GateState {
    calls: CallCounters,
    /// `join` froze the client call count.
    frozen: bool,
    /// Client calls that finished while frozen, to subtract on release.
    deferred_finishes: u32,
    /// Threads waiting on `changed`.
    waiters: u32,
    /// Peers closing pipes is expected from now on.
    shutting_down: bool,
}

/// The calls in flight, and `join`'s freeze of them.
#[derive(Debug, Default)]
pub(crate) struct JoinGate {
    state: Mutex<GateState>,
    changed: Condvar,
}

impl JoinGate {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits once on `changed`, counted in `waiters` so that finishing calls only
    /// signal when someone waits.
    fn wait<'a>(&self, mut state: MutexGuard<'a, GateState>) -> MutexGuard<'a, GateState> {
        state.waiters += 1;
        let mut state = self.changed.wait(state).unwrap_or_else(|p| p.into_inner());
        state.waiters -= 1;
        state
    }

    /// Counts a new client call, waiting while `join` has the count frozen; on an I/O
    /// thread (an inline handler), where waiting would deadlock, returns `false` instead
    /// of waiting and counts nothing.
    pub(crate) fn start_client_call(&self) -> bool {
        let mut state = self.lock();
        if state.frozen && on_io_thread() {
            return false;
        }
        while state.frozen {
            state = self.wait(state);
        }
        state.calls.client_call_started();
        true
    }

    /// A client call completed (answered, failed or timed out).
    pub(crate) fn finish_client_call(&self) {
        let mut state = self.lock();
        if state.frozen {
            state.deferred_finishes = state.deferred_finishes.saturating_add(1);
        } else {
            state.calls.client_call_finished();
        }
        let waiters = state.waiters;
        drop(state);
        // Waking nobody still costs a system call, on every call's critical path.
        if waiters > 0 {
            self.changed.notify_all();
        }
    }

    /// A request from a peer started.
    pub(crate) fn server_call_started(&self) {
        self.lock().calls.server_call_started();
    }

    /// A request from a peer was answered.
    pub(crate) fn server_call_finished(&self) {
        self.lock().calls.server_call_finished(false);
    }

    /// A request from a peer will be answered later, without holding a thread (an
    /// async server call, such as a `to_here` waiting for its value).
    pub(crate) fn server_call_went_async(&self) {
        self.lock().calls.server_call_went_async();
    }

    /// A request that went async was answered.
    pub(crate) fn async_server_call_finished(&self) {
        self.lock().calls.server_call_finished(true);
    }

    /// The call counts.
    pub(crate) fn counts(&self) -> CallCounters {
        self.lock().calls
    }

    /// Waits until this worker has no client call in flight.
    pub(crate) fn await_no_client_calls(&self) {
        let mut state = self.lock();
        while state.calls.client_active() > 0 {
            state = self.wait(state);
        }
    }

    /// Waits up to `timeout` until this worker has no client call in flight; the
    /// number left.
    pub(crate) fn await_flushed(&self, timeout: Duration) -> u32 {
        let mut state = self.lock();
        state.waiters += 1;
        let (mut state, _) = self
            .changed
            .wait_timeout_while(state, timeout, |s| s.calls.client_active() > 0)
            .unwrap_or_else(|p| p.into_inner());
        state.waiters -= 1;
        state.calls.client_active()
    }

    /// Freezes the client call count (new calls wait); the calls in flight.
    pub(crate) fn hold(&self) -> u32 {
        let mut state = self.lock();
        state.frozen = true;
        state.calls.client_active()
    }

    /// Thaws the count: the calls that finished meanwhile are uncounted, and waiting
    /// callers go on.
    pub(crate) fn release(&self) {
        let mut state = self.lock();
        state.frozen = false;
        for _ in 0..std::mem::take(&mut state.deferred_finishes) {
            state.calls.client_call_finished();
        }
        drop(state);
        self.changed.notify_all();
    }

    /// From now on peers closing pipes is expected.
    pub(crate) fn mark_shutting_down(&self) {
        self.lock().shutting_down = true;
    }

    /// Whether [`mark_shutting_down`](Self::mark_shutting_down) was called.
    pub(crate) fn is_shutting_down(&self) -> bool {
        self.lock().shutting_down
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_count_defers_finishes_until_release() {
        let gate = JoinGate::default();
        assert!(gate.start_client_call());
        assert!(gate.start_client_call());
        assert_eq!(gate.hold(), 2);
        gate.finish_client_call();
        assert_eq!(gate.counts().client_active(), 2, "deferred while held");
        gate.release();
        assert_eq!(gate.counts().client_active(), 1);
        gate.finish_client_call();
        assert_eq!(gate.await_flushed(Duration::ZERO), 0);
    }

    #[test]
    fn a_call_started_around_a_release_is_counted_once() {
        let gate = std::sync::Arc::new(JoinGate::default());
        gate.hold();
        let caller = {
            let gate = std::sync::Arc::clone(&gate);
            std::thread::spawn(move || gate.start_client_call())
        };
        // Whether the caller waited for the thaw or came after it, it counts once.
        gate.release();
        assert_eq!(caller.join().ok(), Some(true));
        assert_eq!(gate.counts().client_active(), 1);
    }

    #[test]
    fn an_io_thread_is_refused_instead_of_waiting_while_held() {
        let gate = std::sync::Arc::new(JoinGate::default());
        gate.hold();
        let on_io = {
            let gate = std::sync::Arc::clone(&gate);
            std::thread::spawn(move || {
                crate::rpc::message::mark_io_thread();
                gate.start_client_call()
            })
        };
        assert_eq!(
            on_io.join().ok(),
            Some(false),
            "waiting would deadlock join"
        );
        assert_eq!(gate.counts().client_active(), 0);
        gate.release();
    }

    #[test]
    fn metrics_carry_the_gate_counts_and_idle_threads() {
        let (counters, gate) = (Counters::new(4), JoinGate::default());
        counters.worker_busy(Duration::from_micros(40));
        gate.server_call_started();
        let metrics = counters.metrics(&gate);
        assert_eq!(metrics.num_idle_threads, 3);
        assert!(!metrics.wait_profiling_enabled(), "off until switched on");
        counters.enable_wait_profiling(true);
        counters.worker_idle();
        counters.worker_busy(Duration::from_micros(10));
        counters.worker_busy(Duration::from_micros(30));
        let waits: Vec<_> = counters
            .metrics(&gate)
            .metrics()
            .filter(|(key, _)| *key == "agent.gil_average_wait_time_us")
            .map(|(_, value)| value.to_string())
            .collect();
        assert_eq!(waits, ["20.000000"]);
        counters.enable_wait_profiling(false);
        assert!(!counters.metrics(&gate).wait_profiling_enabled());
        counters.worker_idle();
        assert_eq!(metrics.calls.server_active(), 1);
        counters.pipe_opened("b", TransportKind::Tcp, None);
        assert_eq!(counters.pipe_transport("b"), Some(TransportKind::Tcp));
        assert_eq!(counters.pipe_channel("b"), None);
    }
}
