//! The agent's counters and their `get_metrics()` listing.
//!
//! [`AgentMetrics`] holds what PyTorch's `TensorPipeAgent::getMetrics` reports, under the
//! same keys and in a stable order: `agent.thread_pool_size`, `agent.num_idle_threads`,
//! `agent.client_active_calls`, `agent.server_active_calls`,
//! `agent.server_active_async_calls`, and `agent.gil_average_wait_time_us` only while
//! wait-time profiling is on (PyTorch measures the GIL; an rdzv runtime measures whatever
//! its handlers wait for before they run). Values print as PyTorch's `std::to_string`
//! prints them (averages with six decimals).
//!
//! [`NetworkData`] is the per-peer `AggregatedNetworkData` (calls, bytes sent, bytes
//! received, errors) that PyTorch declares, updates in `trackNetworkData` /
//! `trackNetworkError`, and never calls; rdzv's runtime is meant to call them.
//!
//! Nothing here is shared between threads or reads a clock: the runtime owns the values
//! and feeds measured durations in.

use alloc::collections::BTreeMap;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

use super::name::WorkerId;

/// `agent.thread_pool_size`: the handler thread pool's size.
pub const THREAD_POOL_SIZE: &str = "agent.thread_pool_size";
/// `agent.num_idle_threads`: pool threads with nothing to do.
pub const NUM_IDLE_THREADS: &str = "agent.num_idle_threads";
/// `agent.client_active_calls`: calls sent and not yet answered.
pub const CLIENT_ACTIVE_CALLS: &str = "agent.client_active_calls";
/// `agent.server_active_calls`: requests received and not yet answered.
pub const SERVER_ACTIVE_CALLS: &str = "agent.server_active_calls";
/// `agent.server_active_async_calls`: requests whose handler returned a future that is
/// not yet complete.
pub const SERVER_ACTIVE_ASYNC_CALLS: &str = "agent.server_active_async_calls";
/// `agent.gil_average_wait_time_us`: the average wait before a handler runs, in µs.
pub const GIL_AVERAGE_WAIT_TIME_US: &str = "agent.gil_average_wait_time_us";

/// One metric's value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MetricValue {
    /// A count.
    Count(u64),
    /// An average.
    Average(f32),
}

impl fmt::Display for MetricValue {
    /// As `std::to_string`: integers in decimal, floats with six decimals.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetricValue::Count(n) => write!(f, "{n}"),
            MetricValue::Average(x) => write!(f, "{x:.6}"),
        }
    }
}

/// A running average (PyTorch's `TimeSeriesMetricsTracker`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TimeSeriesMetric {
    sum: u64,
    count: u64,
}

impl TimeSeriesMetric {
    /// No data.
    pub const fn new() -> Self {
        TimeSeriesMetric { sum: 0, count: 0 }
    }

    /// Adds one observation (the sum saturates instead of wrapping).
    pub fn add_data(&mut self, point: u64) {
        self.sum = self.sum.saturating_add(point);
        self.count = self.count.saturating_add(1);
    }

    /// The average of the observations; 0 when there are none.
    pub fn average(&self) -> f32 {
        if self.count == 0 {
            0.0
        } else {
            self.sum as f32 / self.count as f32
        }
    }

    /// How many observations were added.
    pub fn count(&self) -> u64 {
        self.count
    }
}

/// The agent's call counters (`clientActiveCalls_`, `serverActiveCalls_`,
/// `serverActiveAsyncCalls_`). A decrement at zero is a bookkeeping bug in the caller; it
/// leaves the counter at zero and returns `false`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CallCounters {
    client_active: u32,
    server_active: u32,
    server_active_async: u32,
}

fn decrement(counter: &mut u32) -> bool {
    match counter.checked_sub(1) {
        Some(n) => {
            *counter = n;
            true
        }
        None => false,
    }
}

impl CallCounters {
    /// All zero.
    pub const fn new() -> Self {
        CallCounters {
            client_active: 0,
            server_active: 0,
            server_active_async: 0,
        }
    }

    /// A call was sent.
    pub fn client_call_started(&mut self) {
        self.client_active = self.client_active.saturating_add(1);
    }

    /// A sent call completed (answered, failed or timed out), after its callbacks ran.
    pub fn client_call_finished(&mut self) -> bool {
        decrement(&mut self.client_active)
    }

    /// A request arrived.
    pub fn server_call_started(&mut self) {
        self.server_active = self.server_active.saturating_add(1);
    }

    /// A request's handler returned a future that is not complete yet.
    pub fn server_call_went_async(&mut self) {
        self.server_active_async = self.server_active_async.saturating_add(1);
    }

    /// A request's response is ready to be sent; `was_async` if its handler went async.
    pub fn server_call_finished(&mut self, was_async: bool) -> bool {
        let sync_ok = decrement(&mut self.server_active);
        let async_ok = !was_async || decrement(&mut self.server_active_async);
        sync_ok && async_ok
    }

    /// Calls sent and not yet completed: what `join` waits to reach zero.
    pub fn client_active(&self) -> u32 {
        self.client_active
    }

    /// Requests received and not yet answered.
    pub fn server_active(&self) -> u32 {
        self.server_active
    }

    /// Requests whose handler went async and has not completed.
    pub fn server_active_async(&self) -> u32 {
        self.server_active_async
    }
}

/// Everything `get_metrics()` lists.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AgentMetrics {
    /// The handler pool's size.
    pub thread_pool_size: u32,
    /// Idle pool threads.
    pub num_idle_threads: u32,
    /// The call counters.
    pub calls: CallCounters,
    wait_time_us: Option<TimeSeriesMetric>,
}

impl AgentMetrics {
    /// Metrics for a pool of `thread_pool_size` threads, all idle, no calls, profiling off.
    pub const fn new(thread_pool_size: u32) -> Self {
        AgentMetrics {
            thread_pool_size,
            num_idle_threads: thread_pool_size,
            calls: CallCounters::new(),
            wait_time_us: None,
        }
    }

    /// Turns wait-time profiling on (keeping what was measured) or off (forgetting it),
    /// like `enableGILProfiling`.
    pub fn enable_wait_profiling(&mut self, on: bool) {
        match (on, self.wait_time_us) {
            (true, None) => self.wait_time_us = Some(TimeSeriesMetric::new()),
            (false, _) => self.wait_time_us = None,
            (true, Some(_)) => {}
        }
    }

    /// Whether wait-time profiling is on.
    pub fn wait_profiling_enabled(&self) -> bool {
        self.wait_time_us.is_some()
    }

    /// Records how long a handler waited before it ran (ignored while profiling is off).
    pub fn add_wait_time_us(&mut self, micros: u64) {
        if let Some(series) = &mut self.wait_time_us {
            series.add_data(micros);
        }
    }

    /// `(key, value)` in a fixed order: the five agent counters, then the average wait
    /// when profiling is on.
    pub fn metrics(&self) -> impl Iterator<Item = (&'static str, MetricValue)> {
        let counts = [
            (THREAD_POOL_SIZE, self.thread_pool_size),
            (NUM_IDLE_THREADS, self.num_idle_threads),
            (CLIENT_ACTIVE_CALLS, self.calls.client_active()),
            (SERVER_ACTIVE_CALLS, self.calls.server_active()),
            (SERVER_ACTIVE_ASYNC_CALLS, self.calls.server_active_async()),
        ];
        counts
            .into_iter()
            .map(|(key, n)| (key, MetricValue::Count(u64::from(n))))
            .chain(
                self.wait_time_us
                    .map(|s| (GIL_AVERAGE_WAIT_TIME_US, MetricValue::Average(s.average()))),
            )
    }
}

/// What one peer's calls amounted to (PyTorch's `AggregatedNetworkData`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct AggregatedNetworkData {
    /// Calls to the peer, failed ones included.
    pub num_calls: u64,
    /// Request bytes sent to it.
    pub total_sent_bytes: u64,
    /// Response bytes received from it.
    pub total_recv_bytes: u64,
    /// Calls to it that failed.
    pub total_errors: u64,
}

impl AggregatedNetworkData {
    /// The fields as `(name, value)`, in declaration order.
    pub fn fields(&self) -> [(&'static str, u64); 4] {
        [
            ("num_calls", self.num_calls),
            ("total_sent_bytes", self.total_sent_bytes),
            ("total_recv_bytes", self.total_recv_bytes),
            ("total_errors", self.total_errors),
        ]
    }
}

/// Per-peer network data, keyed by the peer's worker name (PyTorch's `NetworkDataDict`).
/// Counters saturate.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NetworkData {
    by_peer: BTreeMap<String, AggregatedNetworkData>,
}

impl NetworkData {
    /// No data.
    pub const fn new() -> Self {
        NetworkData {
            by_peer: BTreeMap::new(),
        }
    }

    fn entry(&mut self, peer: &str) -> &mut AggregatedNetworkData {
        self.by_peer.entry(String::from(peer)).or_default()
    }

    /// A call to `peer` completed: `trackNetworkData(requestSize, responseSize, peer)`.
    pub fn track_network_data(&mut self, request_size: u64, response_size: u64, peer: &str) {
        let e = self.entry(peer);
        e.num_calls = e.num_calls.saturating_add(1);
        e.total_sent_bytes = e.total_sent_bytes.saturating_add(request_size);
        e.total_recv_bytes = e.total_recv_bytes.saturating_add(response_size);
    }

    /// A call to `peer` failed: `trackNetworkError(requestSize, peer)`.
    pub fn track_network_error(&mut self, request_size: u64, peer: &str) {
        let e = self.entry(peer);
        e.num_calls = e.num_calls.saturating_add(1);
        e.total_sent_bytes = e.total_sent_bytes.saturating_add(request_size);
        e.total_errors = e.total_errors.saturating_add(1);
    }

    /// The data for `peer`.
    pub fn get(&self, peer: &str) -> Option<&AggregatedNetworkData> {
        self.by_peer.get(peer)
    }

    /// Forgets `peer` (it left a dynamic group); returns its data.
    pub fn remove(&mut self, peer: &str) -> Option<AggregatedNetworkData> {
        self.by_peer.remove(peer)
    }

    /// `(peer, data)` in peer-name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &AggregatedNetworkData)> + '_ {
        self.by_peer.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Every counter as `(peer, field, value)`, in peer then field order.
    pub fn listing(&self) -> Vec<(&str, &'static str, u64)> {
        self.iter()
            .flat_map(|(peer, data)| {
                data.fields()
                    .into_iter()
                    .map(move |(field, value)| (peer, field, value))
            })
            .collect()
    }
}

/// Who this worker is on the network (PyTorch's `NetworkSourceInfo`): its rank and the
/// address it published under `addrs/<name>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NetworkSourceInfo {
    /// This worker's id.
    pub src_rank: WorkerId,
    /// Its published address, as stored.
    pub src_machine_addr: Vec<u8>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;
    use alloc::vec;
    use proptest::prelude::*;

    #[test]
    fn agent_metrics_use_pytorchs_keys_in_a_stable_order() {
        let mut m = AgentMetrics::new(16);
        m.num_idle_threads = 14;
        m.calls.client_call_started();
        m.calls.client_call_started();
        m.calls.server_call_started();
        m.calls.server_call_went_async();
        let listed: Vec<_> = m.metrics().map(|(k, v)| (k, v.to_string())).collect();
        assert_eq!(
            listed,
            vec![
                ("agent.thread_pool_size", "16".to_string()),
                ("agent.num_idle_threads", "14".to_string()),
                ("agent.client_active_calls", "2".to_string()),
                ("agent.server_active_calls", "1".to_string()),
                ("agent.server_active_async_calls", "1".to_string()),
            ]
        );
        m.enable_wait_profiling(true);
        m.add_wait_time_us(10);
        m.add_wait_time_us(15);
        let last = m.metrics().last().map(|(k, v)| (k, v.to_string()));
        assert_eq!(
            last,
            Some(("agent.gil_average_wait_time_us", "12.500000".to_string()))
        );
        m.enable_wait_profiling(true);
        assert!(m.wait_profiling_enabled());
        assert_eq!(m.metrics().count(), 6);
        m.enable_wait_profiling(false);
        m.add_wait_time_us(1000);
        assert_eq!(m.metrics().count(), 5);
        m.enable_wait_profiling(true);
        assert_eq!(
            m.metrics().last().map(|(_, v)| v),
            Some(MetricValue::Average(0.0))
        );
    }

    #[test]
    fn counters_never_underflow() {
        let mut c = CallCounters::new();
        assert!(!c.client_call_finished());
        assert_eq!(c.client_active(), 0);
        c.server_call_started();
        assert!(!c.server_call_finished(true), "async count was zero");
        assert_eq!(c.server_active(), 0);
        c.server_call_started();
        c.server_call_went_async();
        assert!(c.server_call_finished(true));
        assert_eq!((c.server_active(), c.server_active_async()), (0, 0));
    }

    #[test]
    fn time_series() {
        let mut s = TimeSeriesMetric::new();
        assert_eq!(s.average(), 0.0);
        s.add_data(1);
        s.add_data(2);
        assert_eq!(s.average(), 1.5);
        assert_eq!(s.count(), 2);
        s.add_data(u64::MAX);
        assert_eq!(s.count(), 3);
        assert_eq!(MetricValue::Average(1.0 / 3.0).to_string(), "0.333333");
    }

    #[test]
    fn network_data_per_peer() {
        let mut n = NetworkData::new();
        n.track_network_data(100, 20, "worker1");
        n.track_network_data(50, 5, "worker1");
        n.track_network_error(7, "worker2");
        assert_eq!(
            n.get("worker1"),
            Some(&AggregatedNetworkData {
                num_calls: 2,
                total_sent_bytes: 150,
                total_recv_bytes: 25,
                total_errors: 0
            })
        );
        assert_eq!(n.get("worker2").map(|d| d.total_errors), Some(1));
        assert_eq!(
            n.listing(),
            vec![
                ("worker1", "num_calls", 2),
                ("worker1", "total_sent_bytes", 150),
                ("worker1", "total_recv_bytes", 25),
                ("worker1", "total_errors", 0),
                ("worker2", "num_calls", 1),
                ("worker2", "total_sent_bytes", 7),
                ("worker2", "total_recv_bytes", 0),
                ("worker2", "total_errors", 1),
            ]
        );
        assert!(n.remove("worker1").is_some());
        assert_eq!(n.iter().count(), 1);
        let info = NetworkSourceInfo {
            src_rank: WorkerId::from(3),
            src_machine_addr: b"tcp://10.0.0.1:1234".to_vec(),
        };
        assert_eq!(info.src_rank.get(), 3);
    }

    proptest! {
        #[test]
        fn balanced_calls_return_to_zero(ops in proptest::collection::vec(0u8..4, 0..200)) {
            let mut c = CallCounters::new();
            let (mut client, mut server, mut asyncs) = (0u32, 0u32, 0u32);
            for op in ops {
                match op {
                    0 => { c.client_call_started(); client += 1; }
                    1 => { prop_assert_eq!(c.client_call_finished(), client > 0); client = client.saturating_sub(1); }
                    2 => { c.server_call_started(); c.server_call_went_async(); server += 1; asyncs += 1; }
                    _ => {
                        prop_assert_eq!(c.server_call_finished(true), server > 0 && asyncs > 0);
                        server = server.saturating_sub(1);
                        asyncs = asyncs.saturating_sub(1);
                    }
                }
                prop_assert_eq!((c.client_active(), c.server_active(), c.server_active_async()), (client, server, asyncs));
            }
        }

        #[test]
        fn network_totals_add_up(calls in proptest::collection::vec((0u8..3, 0u32..1000, 0u32..1000, any::<bool>()), 0..100)) {
            let mut n = NetworkData::new();
            let mut sent = 0u64;
            let mut errors = 0u64;
            for (peer, req, resp, failed) in &calls {
                let name = ["a", "b", "c"][usize::from(*peer)];
                if *failed {
                    n.track_network_error(u64::from(*req), name);
                    errors += 1;
                } else {
                    n.track_network_data(u64::from(*req), u64::from(*resp), name);
                }
                sent += u64::from(*req);
            }
            let total: AggregatedNetworkData = n.iter().fold(Default::default(), |acc, (_, d)| AggregatedNetworkData {
                num_calls: acc.num_calls + d.num_calls,
                total_sent_bytes: acc.total_sent_bytes + d.total_sent_bytes,
                total_recv_bytes: acc.total_recv_bytes + d.total_recv_bytes,
                total_errors: acc.total_errors + d.total_errors,
            });
            prop_assert_eq!(total.num_calls, calls.len() as u64);
            prop_assert_eq!(total.total_sent_bytes, sent);
            prop_assert_eq!(total.total_errors, errors);
        }
    }
}
