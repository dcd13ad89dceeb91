//! The elastic rendezvous at runtime: a thread that drives
//! [`rdzv_core::rendezvous::elastic::ElasticNode`] against any [`Store`], and the
//! `elastic://` scheme.
//!
//! Every protocol decision is the core's (which keys, when a round closes, who is dead);
//! this module performs the store operations the machine asks for, keeps the clock
//! (`std::time::Instant`, monotonic), and hands the outcomes to the caller. One thread per
//! node owns the store connection and the machine; the caller's handle
//! ([`ElasticRendezvous`]) reads the latest outcome and sends local events (leave,
//! shutdown, workers failed) over a channel. Because the driver is blocked in the store
//! while it waits, a local event takes effect when the current wait ends, at most one
//! keep-alive interval later (the core caps every wait at one interval).
//!
//! `rendezvous("elastic://host:port/run_id?nodes=2:8&last_call=5s")` connects to the
//! store at `host:port` (an `rdzv store serve`, or any TCPStore server; the default port
//! is 29400, torchelastic's), joins, and returns the round's store
//! (`PrefixStore("torch.rendezvous.{run_id}.{round}", …)`), rank and world size, with
//! [`Rendezvous::elastic`](super::Rendezvous::elastic) holding the handle to follow the
//! next rounds.

use std::fmt;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant as StdInstant};

use rdzv_core::env::Env;
use rdzv_core::rendezvous::elastic::{
    ElasticError, ElasticNode, ElasticSettings, ElasticUrl, Event, Instant, LocalEvent,
    OwnedStoreReply, RoundOutcome, StoreAction,
};

use super::{Rendezvous, RendezvousError, RendezvousOptions};
use crate::store::tcp::TcpStore;
use crate::store::{PrefixStore, Store, StoreError};

/// Why the elastic rendezvous failed for this node.
#[non_exhaustive]
#[derive(Debug, Clone, thiserror::Error)]
pub enum ElasticFailure {
    /// The protocol failed (closed, timed out, foreign keys): the core's error, whose text
    /// starts with PyTorch's exception name.
    #[error("{0}")]
    Protocol(ElasticError),
    /// A store operation failed (PyTorch: `RendezvousConnectionError`).
    #[error("RendezvousConnectionError: node '{node}': store {op} of key {key} failed: {error}")]
    Store {
        /// This node.
        node: String,
        /// The operation.
        op: &'static str,
        /// The key.
        key: String,
        /// The store's error, as text (the error itself stays with the driver thread).
        error: String,
    },
    /// The node left (or shut the rendezvous down) before a round completed.
    #[error("node '{node}' has left the elastic rendezvous '{run_id}'")]
    Left {
        /// This node.
        node: String,
        /// The run id.
        run_id: String,
    },
    /// No complete round within the time the caller gave.
    #[error("node '{node}': no new complete round within {waited:?}")]
    NotYet {
        /// This node.
        node: String,
        /// How long the caller waited.
        waited: Duration,
    },
}

/// How the node ended, once it has.
#[derive(Debug, Clone)]
enum Ending {
    Left,
    ShutDown,
    Failed(ElasticFailure),
}

#[derive(Debug, Default)]
struct Shared {
    /// The round this node is a member of, while it is.
    current: Option<RoundOutcome>,
    /// The round it waits after, and whether as a hot spare.
    waiting: Option<(u64, bool)>,
    ending: Option<Ending>,
}

/// A node of an elastic rendezvous, driven by its own thread. Dropping it leaves the
/// rendezvous (ending the round it is part of) and joins the thread.
pub struct ElasticRendezvous {
    node: String,
    run_id: String,
    store: Arc<dyn Store>,
    shared: Arc<(Mutex<Shared>, Condvar)>,
    commands: Sender<LocalEvent>,
    thread: Option<JoinHandle<()>>,
}

impl fmt::Debug for ElasticRendezvous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ElasticRendezvous")
            .field("node", &self.node)
            .field("run_id", &self.run_id)
            .finish_non_exhaustive()
    }
}

impl ElasticRendezvous {
    /// Starts node `node` of the rendezvous `settings` describe, over `store` (the driver
    /// takes a connection of its own with [`Store::clone_store`]; `store` itself serves the
    /// rounds' prefixed stores). Returns at once; [`ElasticRendezvous::next_round`] waits
    /// for a round.
    ///
    /// # Errors
    /// [`ElasticFailure::Store`] when the store cannot be cloned.
    pub fn start(
        store: Arc<dyn Store>,
        settings: ElasticSettings,
        node: impl Into<String>,
    ) -> Result<Self, ElasticFailure> {
        let node = node.into();
        let driver_store = store.clone_store().map_err(|e| ElasticFailure::Store {
            node: node.clone(),
            op: "connect",
            key: String::new(),
            error: e.to_string(),
        })?;
        let run_id = settings.run_id.clone();
        let mut machine = ElasticNode::new(settings, node.clone());
        machine.handle_local(LocalEvent::Join);
        let shared = Arc::new((Mutex::new(Shared::default()), Condvar::new()));
        let (commands, inbox) = mpsc::channel();
        let driver = Driver {
            machine,
            store: driver_store,
            inbox,
            shared: Arc::clone(&shared),
            epoch: StdInstant::now(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("rdzv-elastic-{node}"))
            .spawn(move || driver.run())
            .map_err(|e| ElasticFailure::Store {
                node: node.clone(),
                op: "spawn the driver thread for",
                key: String::new(),
                error: e.to_string(),
            })?;
        Ok(ElasticRendezvous {
            node,
            run_id,
            store,
            shared,
            commands,
            thread: Some(thread),
        })
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The round this node is a member of now, if any.
    pub fn current(&self) -> Option<RoundOutcome> {
        lock(&self.shared.0).current.clone()
    }

    /// The round this node arrived too late for, and whether it waits as a hot spare.
    pub fn waiting(&self) -> Option<(u64, bool)> {
        lock(&self.shared.0).waiting
    }

    /// Waits up to `timeout` for this node to be a member of a complete round later than
    /// `after` (any round for `None`), and returns it.
    ///
    /// # Errors
    /// [`ElasticFailure::Protocol`] (closed, join timeout, …), [`ElasticFailure::Store`],
    /// [`ElasticFailure::Left`] once the node has left, [`ElasticFailure::NotYet`] when
    /// `timeout` passes first.
    pub fn next_round(
        &self,
        after: Option<u64>,
        timeout: Duration,
    ) -> Result<RoundOutcome, ElasticFailure> {
        let deadline = StdInstant::now() + timeout;
        let (mutex, condvar) = &*self.shared;
        let mut shared = lock(mutex);
        loop {
            if let Some(current) = &shared.current {
                if after.is_none_or(|after| current.round > after) {
                    return Ok(current.clone());
                }
            }
            match &shared.ending {
                Some(Ending::Failed(failure)) => return Err(failure.clone()),
                Some(Ending::Left | Ending::ShutDown) => {
                    return Err(ElasticFailure::Left {
                        node: self.node.clone(),
                        run_id: self.run_id.clone(),
                    })
                }
                None => {}
            }
            let left = deadline.saturating_duration_since(StdInstant::now());
            if left.is_zero() {
                return Err(ElasticFailure::NotYet {
                    node: self.node.clone(),
                    waited: timeout,
                });
            }
            shared = condvar
                .wait_timeout(shared, left)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|poisoned| poisoned.into_inner().0);
        }
    }

    /// The store of `round`: `PrefixStore("torch.rendezvous.{run_id}.{round}", store)`.
    pub fn round_store(&self, round: &RoundOutcome) -> Arc<dyn Store> {
        Arc::new(PrefixStore::new(
            round.store_prefix.clone(),
            Arc::clone(&self.store),
        ))
    }

    /// This node's workers failed: end the round; the node rejoins the next one.
    pub fn worker_failed(&self) {
        let _ = self.commands.send(LocalEvent::WorkerFailed);
    }

    /// Closes the rendezvous for good (PyTorch's `shutdown`), then waits up to `timeout`
    /// for the driver to finish. Returns whether it did (PyTorch returns `False` when
    /// closing failed).
    pub fn shutdown(mut self, timeout: Duration) -> bool {
        let _ = self.commands.send(LocalEvent::Shutdown);
        let done = self.wait_ending(timeout);
        let shut = matches!(done, Some(Ending::ShutDown));
        if done.is_some() {
            self.join_thread();
        }
        shut
    }

    /// Leaves the rendezvous (ending the round this node is part of), waiting up to
    /// `timeout` for the driver to finish.
    pub fn leave(mut self, timeout: Duration) -> bool {
        let _ = self.commands.send(LocalEvent::Leave);
        let done = self.wait_ending(timeout).is_some();
        if done {
            self.join_thread();
        }
        done
    }

    fn wait_ending(&self, timeout: Duration) -> Option<Ending> {
        let (mutex, condvar) = &*self.shared;
        let shared = lock(mutex);
        let (shared, _) = condvar
            .wait_timeout_while(shared, timeout, |s| s.ending.is_none())
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        shared.ending.clone()
    }

    fn join_thread(&mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for ElasticRendezvous {
    fn drop(&mut self) {
        if self.thread.is_some() {
            let _ = self.commands.send(LocalEvent::Leave);
            // The driver sees the event within one keep-alive interval; don't block a
            // dropping caller longer than that would take, but don't leak the thread
            // either when it ends in time.
            if self.wait_ending(Duration::from_secs(30)).is_some() {
                self.join_thread();
            }
        }
    }
}

fn lock(mutex: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The driver thread: the machine, a store connection, the clock.
struct Driver {
    machine: ElasticNode,
    store: Box<dyn Store>,
    inbox: Receiver<LocalEvent>,
    shared: Arc<(Mutex<Shared>, Condvar)>,
    epoch: StdInstant,
}

impl Driver {
    fn now(&self) -> Instant {
        Instant::from_duration(self.epoch.elapsed())
    }

    fn run(mut self) {
        loop {
            loop {
                match self.inbox.try_recv() {
                    Ok(event) => self.machine.handle_local(event),
                    Err(TryRecvError::Empty) => break,
                    // The handle is gone without leaving (it always sends Leave first);
                    // leave anyway.
                    Err(TryRecvError::Disconnected) => {
                        self.machine.handle_local(LocalEvent::Leave);
                        break;
                    }
                }
            }
            let Some(action) = self.machine.poll_action(self.now()) else {
                if self.machine.is_done() {
                    self.publish();
                    return;
                }
                // Idle: only a local event can move it.
                match self.inbox.recv() {
                    Ok(event) => self.machine.handle_local(event),
                    Err(_) => self.machine.handle_local(LocalEvent::Leave),
                }
                continue;
            };
            match self.perform(&action) {
                Ok(reply) => {
                    let reply = reply.as_reply();
                    self.machine.handle_reply(reply, self.now());
                }
                Err(error) => {
                    let failure = ElasticFailure::Store {
                        node: self.machine.node().to_string(),
                        op: action.name(),
                        key: action.key().to_string(),
                        error: error.to_string(),
                    };
                    tracing::warn!(%failure, "elastic rendezvous");
                    self.finish(Ending::Failed(failure));
                    return;
                }
            }
            self.publish();
            if self.machine.is_done() {
                return;
            }
        }
    }

    fn perform(&self, action: &StoreAction) -> Result<OwnedStoreReply, StoreError> {
        Ok(match action {
            StoreAction::Check { key } => OwnedStoreReply::Checked(self.store.check(&[key])?),
            StoreAction::Add { key, delta } => OwnedStoreReply::Added(self.store.add(key, *delta)?),
            StoreAction::Set { key, value } => {
                self.store.set(key, value)?;
                OwnedStoreReply::Set
            }
            StoreAction::CompareSet {
                key,
                expected,
                desired,
            } => OwnedStoreReply::Value(self.store.compare_set(key, expected, desired)?),
            StoreAction::Get { key } => OwnedStoreReply::Value(self.store.get(key)?),
            StoreAction::Wait { key, until } => {
                let left = until
                    .saturating_duration_since(self.now())
                    .max(Duration::from_millis(1));
                match self.store.wait(&[key], Some(left)) {
                    Ok(()) => OwnedStoreReply::Waited,
                    Err(StoreError::Timeout { .. }) => OwnedStoreReply::TimedOut,
                    Err(error) => return Err(error),
                }
            }
        })
    }

    /// Hands the machine's events to the handle.
    fn publish(&mut self) {
        let (mutex, condvar) = &*self.shared;
        let mut shared = lock(mutex);
        let mut changed = false;
        while let Some(event) = self.machine.poll_event() {
            changed = true;
            tracing::debug!(node = self.machine.node(), ?event, "elastic rendezvous");
            match event {
                Event::Complete(outcome) => {
                    shared.waiting = None;
                    shared.current = Some(outcome);
                }
                Event::Waiting { round, hot_spare } => {
                    shared.waiting = Some((round, hot_spare));
                }
                Event::RoundOver { .. } => shared.current = None,
                Event::Left => shared.ending = Some(Ending::Left),
                Event::ShutDown => shared.ending = Some(Ending::ShutDown),
                Event::Failed(error) => {
                    shared.current = None;
                    shared.ending = Some(Ending::Failed(ElasticFailure::Protocol(error)));
                }
                _ => {}
            }
        }
        if changed {
            condvar.notify_all();
        }
    }

    fn finish(&mut self, ending: Ending) {
        let (mutex, condvar) = &*self.shared;
        let mut shared = lock(mutex);
        shared.current = None;
        shared.ending = Some(ending);
        condvar.notify_all();
    }
}

/// PyTorch's `_NodeDesc` text: `{host}_{pid}_{local_id}`, `local_id` counting this
/// process's nodes.
pub fn default_node_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_string())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".to_string());
    format!(
        "{host}_{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// The `elastic://` handler: connects to the store, joins, and waits for the first round
/// (up to the join timeout). The node id is the URL's `node_id`, else `RDZV_NODE_ID`,
/// else [`default_node_id`].
pub(super) fn elastic_rendezvous_handler(
    url: &str,
    env: &dyn Env,
    options: &RendezvousOptions,
) -> Result<Rendezvous, RendezvousError> {
    let parsed = ElasticUrl::parse(url).map_err(|e| RendezvousError::Plan(e.to_string()))?;
    let node = parsed
        .node_id
        .clone()
        .or_else(|| env.var("RDZV_NODE_ID").map(String::from))
        .unwrap_or_else(default_node_id);
    // No rank yet: the error names the node.
    let store = TcpStore::connect(&parsed.host, parsed.port, options.timeout).map_err(|e| {
        RendezvousError::Handler(
            format!(
                "elastic:// rendezvous: node '{node}' cannot connect to the store at {}:{}: {e}",
                parsed.host, parsed.port
            )
            .into(),
        )
    })?;
    let join_timeout = parsed.settings.join_timeout;
    let handle = ElasticRendezvous::start(Arc::new(store), parsed.settings, node)
        .map_err(|e| RendezvousError::Handler(Box::new(e)))?;
    // The machine fails with RendezvousTimeoutError at the join timeout; wait a little
    // longer so that its error, not ours, is what the caller sees.
    let round = handle
        .next_round(None, join_timeout + Duration::from_secs(5))
        .map_err(|e| RendezvousError::Handler(Box::new(e)))?;
    let mut rendezvous = Rendezvous::new(
        handle.round_store(&round),
        round.rank,
        Some(round.world_size),
    );
    rendezvous.elastic = Some(Arc::new(handle));
    Ok(rendezvous)
}
