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
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant as StdInstant};

use rdzv_core::env::Env;
use rdzv_core::rendezvous::elastic::{
    ElasticError, ElasticErrorKind, ElasticNode, ElasticSettings, ElasticUrl, Event, Instant,
    LocalEvent, OwnedStoreReply, RoundOutcome, StoreAction, StoreReply,
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
    /// The store did not answer the node's connection (PyTorch:
    /// `RendezvousConnectionError`).
    #[error("elastic:// rendezvous: node '{node}' cannot connect to the store at {host}:{port}: {error}")]
    Unreachable {
        /// This node.
        node: String,
        /// The store's host.
        host: String,
        /// The store's port.
        port: u16,
        /// Why, as the store client said it.
        error: String,
    },
    /// The node left before a round completed.
    #[error("RendezvousClosedError: node '{node}' has left the elastic rendezvous '{run_id}'")]
    Left {
        /// This node.
        node: String,
        /// The run id.
        run_id: String,
    },
    /// This node closed the rendezvous (`set_closed`, `shutdown`).
    #[error("RendezvousClosedError: node '{node}' closed the elastic rendezvous '{run_id}'")]
    ShutDown {
        /// This node.
        node: String,
        /// The run id.
        run_id: String,
    },
    /// No complete round within the time the caller gave.
    #[error("RendezvousTimeoutError: node '{node}': no new complete round within {waited:?}")]
    NotYet {
        /// This node.
        node: String,
        /// How long the caller waited.
        waited: Duration,
    },
    /// Closing the rendezvous took longer than the close timeout.
    #[error(
        "RendezvousTimeoutError: node '{node}' could not close the elastic rendezvous \
         '{run_id}' within the close timeout ({waited:?}); is the store at its address \
         reachable?"
    )]
    CloseTimeout {
        /// This node.
        node: String,
        /// The run id.
        run_id: String,
        /// The close timeout.
        waited: Duration,
    },
}

impl ElasticFailure {
    /// Which of PyTorch's rendezvous exceptions this is (`RendezvousClosedError`,
    /// `RendezvousTimeoutError`, `RendezvousConnectionError`, `RendezvousStateError`,
    /// `RendezvousGracefulExitError`): [`ElasticErrorKind::torch_name`] names the class.
    pub fn kind(&self) -> ElasticErrorKind {
        match self {
            Self::Protocol(error) => error.kind(),
            Self::Store { .. } | Self::Unreachable { .. } => ElasticErrorKind::Connection,
            Self::Left { .. } | Self::ShutDown { .. } => ElasticErrorKind::Closed,
            Self::NotYet { .. } | Self::CloseTimeout { .. } => ElasticErrorKind::Timeout,
        }
    }
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
    /// The open round it waits in for more nodes, as the machine last said.
    open: Option<OpenProgress>,
    ending: Option<Ending>,
}

/// Where the open round a node waits in stands ([`ElasticRendezvous::open_round`]): the
/// core's [`OpenRound`](rdzv_core::rendezvous::elastic::OpenRound) on this process's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenProgress {
    /// The round.
    pub round: u64,
    /// The nodes in it when this node last read its arrivals.
    pub live: u32,
    /// `min_nodes`.
    pub min: u32,
    /// `max_nodes`.
    pub max: u32,
    /// When the last call ends (the round closes with the nodes there then), or `None`
    /// before `min_nodes` have arrived.
    pub last_call_ends: Option<StdInstant>,
}

impl OpenProgress {
    /// The progress line at `now`: "round 2: 3 nodes (min 2, max 4); last call ends in
    /// 12 s", or before `min_nodes` have arrived "round 2: 1 of min 2 nodes; waiting for
    /// 1 more" (the `rdzv rendezvous` command's updating line, the torchrun handler's log).
    pub fn line(&self, now: StdInstant) -> String {
        let round = self.round;
        match self.last_call_ends {
            Some(ends) => format!(
                "round {round}: {} nodes (min {}, max {}); last call ends in {} s",
                self.live,
                self.min,
                self.max,
                ends.saturating_duration_since(now).as_secs_f64().ceil()
            ),
            None => format!(
                "round {round}: {} of min {} nodes; waiting for {} more",
                self.live,
                self.min,
                self.min.saturating_sub(self.live).max(1)
            ),
        }
    }
}

/// A node of an elastic rendezvous, driven by its own thread. Dropping it leaves the
/// rendezvous (ending the round it is part of) and joins the thread.
///
/// Every method takes `&self` (the handle is shared, e.g. from
/// [`Rendezvous::elastic`](super::Rendezvous::elastic) or a Python object), and those of
/// torchelastic's `RendezvousHandler` are here under its names:
/// [`next_rendezvous`](Self::next_rendezvous), [`is_closed`](Self::is_closed),
/// [`set_closed`](Self::set_closed), [`num_nodes_waiting`](Self::num_nodes_waiting),
/// [`run_id`](Self::run_id) and [`shutdown`](Self::shutdown). Failures carry
/// [`ElasticFailure::kind`], the PyTorch exception to raise.
pub struct ElasticRendezvous {
    node: String,
    settings: ElasticSettings,
    store: HandleStore,
    /// A new contact for the driver to hand its machine ([`ElasticRendezvous::set_contact`]).
    contact: Arc<Mutex<Option<String>>>,
    shared: Arc<(Mutex<Shared>, Condvar)>,
    commands: Mutex<Sender<LocalEvent>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The last round [`ElasticRendezvous::next_rendezvous`] handed out.
    taken: Mutex<Option<u64>>,
}

impl fmt::Debug for ElasticRendezvous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ElasticRendezvous")
            .field("node", &self.node)
            .field("run_id", &self.settings.run_id)
            .finish_non_exhaustive()
    }
}

/// What this node offers the others as rank 0's contact (torchrun's `MASTER_ADDR` and
/// `MASTER_PORT`), given at start so that its first arrival carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Contact {
    /// The same text at every arrival, until [`ElasticRendezvous::set_contact`].
    Fixed(String),
    /// `{host}:{port}`, with a port free at each arrival: bound on the wildcard address
    /// and released, as c10d's `get_free_port`. Every round's rank 0 then offers a fresh
    /// `MASTER_PORT`, as torchrun's c10d backend does, even though a node rejoins the
    /// next round on its own as soon as it sees its round end.
    FreePort {
        /// What the others reach this node by: `MASTER_ADDR`.
        host: String,
    },
}

impl Contact {
    /// The contact to offer now: `Fixed`'s text, or `host` and a port free now.
    ///
    /// # Errors
    /// When no port can be bound, with the address tried.
    pub fn offer(&self) -> Result<String, std::io::Error> {
        match self {
            Contact::Fixed(text) => Ok(text.clone()),
            Contact::FreePort { host } => {
                let listener = std::net::TcpListener::bind((std::net::Ipv6Addr::UNSPECIFIED, 0))
                    .or_else(|_| std::net::TcpListener::bind((std::net::Ipv4Addr::UNSPECIFIED, 0)))
                    .map_err(|e| {
                        std::io::Error::new(
                            e.kind(),
                            format!("cannot find a free port to offer as {host}:PORT: bind [::]:0 and 0.0.0.0:0 failed: {e}"),
                        )
                    })?;
                Ok(format!("{host}:{}", listener.local_addr()?.port()))
            }
        }
    }
}

/// Opens the handle's own store connection, on first use.
pub type StoreConnector = Box<dyn Fn() -> Result<Arc<dyn Store>, StoreError> + Send + Sync>;

/// The store the handle reads (`num_nodes_waiting`, `is_closed`) and builds the rounds'
/// stores on: given, or opened on first use.
enum HandleStore {
    Ready(Arc<dyn Store>),
    Lazy {
        connect: StoreConnector,
        opened: OnceLock<Arc<dyn Store>>,
        /// Serializes connecting, so that two first uses open one connection.
        connecting: Mutex<()>,
    },
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
        Self::start_with_contact(store, settings, node, None)
    }

    /// As [`ElasticRendezvous::start`], with this node's contact given before the driver
    /// starts (see [`ElasticRendezvous::start_lazy_with_contact`] for why).
    ///
    /// # Errors
    /// [`ElasticFailure::Store`] when the store cannot be cloned.
    pub fn start_with_contact(
        store: Arc<dyn Store>,
        settings: ElasticSettings,
        node: impl Into<String>,
        contact: Option<Contact>,
    ) -> Result<Self, ElasticFailure> {
        let node = node.into();
        let driver_store = store.clone_store().map_err(|e| ElasticFailure::Store {
            node: node.clone(),
            op: "connect",
            key: String::new(),
            error: e.to_string(),
        })?;
        Self::start_with(
            driver_store,
            HandleStore::Ready(store),
            settings,
            node,
            contact,
        )
    }

    /// As [`ElasticRendezvous::start`], with one connection: the driver takes `store`, and
    /// the handle opens its own with `connect` only when it first needs one (a
    /// `num_nodes_waiting` after the round ended, `is_closed`, a round's store). A join
    /// then costs one connection's handshake instead of two.
    ///
    /// # Errors
    /// [`ElasticFailure::Store`] when the driver thread cannot be started.
    pub fn start_lazy(
        store: Box<dyn Store>,
        connect: StoreConnector,
        settings: ElasticSettings,
        node: impl Into<String>,
    ) -> Result<Self, ElasticFailure> {
        Self::start_lazy_with_contact(store, connect, settings, node, None)
    }

    /// As [`ElasticRendezvous::start_lazy`], with this node's contact
    /// ([`ElasticRendezvous::set_contact`]) given before the driver starts, so that its
    /// first arrival carries it: a `set_contact` called after a start races the driver,
    /// whose first roster line may already be on its way without it (and then, were this
    /// node rank 0, no member would get [`RoundOutcome::master`]). With
    /// [`Contact::FreePort`], every arrival offers a port free at that moment.
    ///
    /// # Errors
    /// [`ElasticFailure::Store`] when the driver thread cannot be started.
    pub fn start_lazy_with_contact(
        store: Box<dyn Store>,
        connect: StoreConnector,
        settings: ElasticSettings,
        node: impl Into<String>,
        contact: Option<Contact>,
    ) -> Result<Self, ElasticFailure> {
        let handle = HandleStore::Lazy {
            connect,
            opened: OnceLock::new(),
            connecting: Mutex::new(()),
        };
        Self::start_with(store, handle, settings, node.into(), contact)
    }

    fn start_with(
        driver_store: Box<dyn Store>,
        store: HandleStore,
        settings: ElasticSettings,
        node: String,
        contact: Option<Contact>,
    ) -> Result<Self, ElasticFailure> {
        let mut machine = ElasticNode::new(settings.clone(), node.clone());
        let mut fresh = None;
        if let Some(contact) = contact {
            let first = contact.offer().map_err(|e| ElasticFailure::Store {
                node: node.clone(),
                op: "offer a contact for",
                key: String::new(),
                error: e.to_string(),
            })?;
            machine.set_contact(&first);
            if matches!(contact, Contact::FreePort { .. }) {
                fresh = Some(contact);
            }
        }
        machine.handle_local(LocalEvent::Join);
        let shared = Arc::new((Mutex::new(Shared::default()), Condvar::new()));
        let (commands, inbox) = mpsc::channel();
        let contact = Arc::new(Mutex::new(None));
        let driver = Driver {
            machine,
            store: driver_store,
            inbox,
            shared: Arc::clone(&shared),
            contact: Arc::clone(&contact),
            fresh,
            epoch: StdInstant::now(),
            last_call_logged: None,
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
            settings,
            store,
            contact,
            shared,
            commands: Mutex::new(commands),
            thread: Mutex::new(Some(thread)),
            taken: Mutex::new(None),
        })
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The run id (`get_run_id`).
    pub fn run_id(&self) -> &str {
        &self.settings.run_id
    }

    /// The settings this node runs with.
    pub fn settings(&self) -> &ElasticSettings {
        &self.settings
    }

    /// What this node tells the others when it is rank 0 (torchrun: `addr:port` for
    /// `MASTER_ADDR` and `MASTER_PORT`); it goes with this node's next arrival, and rank
    /// 0's comes with every member's [`RoundOutcome::master`]
    /// ([`ElasticNode::set_contact`]). A node rejoins on its own as soon as it sees its
    /// round end, often before its caller hears of it, so a contact set then may come a
    /// round late: for a fresh one in every round, start with [`Contact::FreePort`].
    pub fn set_contact(&self, contact: &str) {
        *lock_any(&self.contact) = Some(contact.to_string());
    }

    /// The handle's store connection, opened now if it is opened lazily.
    fn store(&self) -> Result<Arc<dyn Store>, ElasticFailure> {
        match &self.store {
            HandleStore::Ready(store) => Ok(Arc::clone(store)),
            HandleStore::Lazy {
                connect,
                opened,
                connecting,
            } => {
                if let Some(store) = opened.get() {
                    return Ok(Arc::clone(store));
                }
                let _one = lock_any(connecting);
                if let Some(store) = opened.get() {
                    return Ok(Arc::clone(store));
                }
                let store = connect().map_err(|e| self.store_failure("connect", "", &e))?;
                Ok(Arc::clone(opened.get_or_init(|| store)))
            }
        }
    }

    /// torchelastic's `next_rendezvous`: the first call waits for this node's first round;
    /// a later call, made while the round it returned last is still going (the agent
    /// restarts its workers), ends that round for everyone and waits for the next one; a
    /// call after that round ended waits for the round that follows. Waits up to the join
    /// timeout (the machine fails with `RendezvousTimeoutError` then).
    ///
    /// # Errors
    /// As [`ElasticRendezvous::next_round`]; [`ElasticFailure::kind`] says which of
    /// PyTorch's exceptions to raise.
    pub fn next_rendezvous(&self) -> Result<RoundOutcome, ElasticFailure> {
        let mut taken = lock_any(&self.taken);
        if let (Some(last), Some(current)) = (*taken, self.current()) {
            if current.round == last {
                self.send(LocalEvent::WorkerFailed);
            }
        }
        // The machine's own join timeout fires first; its error is the one to show.
        let round = self.next_round(*taken, self.settings.join_timeout + Duration::from_secs(5))?;
        *taken = Some(round.round);
        Ok(round)
    }

    /// torchelastic's `num_nodes_waiting`: how many nodes wait to join a round after the
    /// one [`ElasticRendezvous::next_rendezvous`] returned last; more than 0 tells the
    /// agent to restart its workers and call `next_rendezvous`. A node that arrives while a
    /// round with room is going ends that round at once, so this is the count of live
    /// nodes that have arrived in the next round, and at least 1 once the round is over.
    /// Hot spares (the round is full) are not counted, as PyTorch's redundancy list.
    ///
    /// # Errors
    /// [`ElasticFailure::Store`] when the store cannot be read.
    pub fn num_nodes_waiting(&self) -> Result<u32, ElasticFailure> {
        let Some(last) = *lock_any(&self.taken) else {
            return Ok(0);
        };
        let still = lock_any(&self.shared.0)
            .current
            .as_ref()
            .is_some_and(|current| current.round == last);
        if still {
            return Ok(0);
        }
        let key = self.settings.live_count_key(last.saturating_add(1));
        let value = self
            .store()?
            .add(&key, 0)
            .map_err(|e| self.store_failure("add", &key, &e))?;
        let others = ElasticSettings::live_count(value).saturating_sub(1);
        Ok(others.max(1))
    }

    /// torchelastic's `is_closed`: whether the rendezvous has been closed for good (by any
    /// node's [`ElasticRendezvous::set_closed`] or `shutdown`).
    ///
    /// # Errors
    /// [`ElasticFailure::Store`] when the store cannot be read.
    pub fn is_closed(&self) -> Result<bool, ElasticFailure> {
        let key = self.settings.closed_key();
        self.store()?
            .check(&[&key])
            .map_err(|e| self.store_failure("check", &key, &e))
    }

    /// torchelastic's `set_closed`: closes the rendezvous for good. Every node's next
    /// `next_rendezvous` fails with `RendezvousClosedError` (a hot spare's with
    /// `RendezvousGracefulExitError`), and so does this node's; nodes waiting in an open
    /// round are woken. Takes at most the close timeout (`close_timeout`).
    ///
    /// # Errors
    /// [`ElasticFailure::CloseTimeout`], or [`ElasticFailure::Store`] when this node's
    /// driver had already ended and writing the key failed.
    pub fn set_closed(&self) -> Result<(), ElasticFailure> {
        let timeout = self.settings.close_timeout;
        if lock_any(&self.shared.0).ending.is_none() {
            self.send(LocalEvent::Shutdown);
        }
        match self.wait_ending(timeout) {
            Some(Ending::ShutDown) => {
                self.join_thread();
                Ok(())
            }
            Some(_) => {
                // The driver had ended (left or failed) before it could close: close
                // through the handle's own connection, as the core says.
                self.join_thread();
                let by = format!("node '{}'", self.node);
                let store = self.store()?;
                for action in self.settings.close_actions(&by) {
                    perform(&*store, &action, Duration::ZERO)
                        .map_err(|e| self.store_failure(action.name(), action.key(), &e))?;
                }
                Ok(())
            }
            None => Err(ElasticFailure::CloseTimeout {
                node: self.node.clone(),
                run_id: self.settings.run_id.clone(),
                waited: timeout,
            }),
        }
    }

    fn send(&self, event: LocalEvent) {
        let _ = lock_any(&self.commands).send(event);
    }

    fn store_failure(&self, op: &'static str, key: &str, error: &StoreError) -> ElasticFailure {
        ElasticFailure::Store {
            node: self.node.clone(),
            op,
            key: key.to_string(),
            error: error.to_string(),
        }
    }

    /// The round this node is a member of now, if any.
    pub fn current(&self) -> Option<RoundOutcome> {
        lock_any(&self.shared.0).current.clone()
    }

    /// The round this node arrived too late for, and whether it waits as a hot spare.
    pub fn waiting(&self) -> Option<(u64, bool)> {
        lock_any(&self.shared.0).waiting
    }

    /// The open round this node waits in for more nodes, if any: for a progress line
    /// ("3 of min 4 nodes; last call ends in 12 s"). No store request.
    pub fn open_round(&self) -> Option<OpenProgress> {
        lock_any(&self.shared.0).open
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
        let mut shared = lock_any(mutex);
        loop {
            if let Some(current) = &shared.current {
                if after.is_none_or(|after| current.round > after) {
                    return Ok(current.clone());
                }
            }
            match &shared.ending {
                Some(Ending::Failed(failure)) => return Err(failure.clone()),
                Some(Ending::Left) => {
                    return Err(ElasticFailure::Left {
                        node: self.node.clone(),
                        run_id: self.settings.run_id.clone(),
                    })
                }
                Some(Ending::ShutDown) => {
                    return Err(ElasticFailure::ShutDown {
                        node: self.node.clone(),
                        run_id: self.settings.run_id.clone(),
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
    ///
    /// # Errors
    /// [`ElasticFailure::Store`] when the handle's connection, opened lazily
    /// ([`ElasticRendezvous::start_lazy`]), cannot be opened.
    pub fn round_store(&self, round: &RoundOutcome) -> Result<Arc<dyn Store>, ElasticFailure> {
        Ok(Arc::new(PrefixStore::new(
            round.store_prefix.clone(),
            self.store()?,
        )))
    }

    /// This node's workers failed: end the round; the node rejoins the next one.
    pub fn worker_failed(&self) {
        self.send(LocalEvent::WorkerFailed);
    }

    /// torchelastic's `shutdown`: closes the rendezvous for good
    /// ([`ElasticRendezvous::set_closed`]) and stops this node's driver (its heartbeats).
    /// Returns whether closing succeeded within the close timeout (PyTorch returns
    /// `False` when it did not).
    pub fn shutdown(&self) -> bool {
        match self.set_closed() {
            Ok(()) => true,
            Err(failure) => {
                tracing::warn!(%failure, "elastic rendezvous shutdown");
                false
            }
        }
    }

    /// Leaves the rendezvous (ending the round this node is part of), waiting up to
    /// `timeout` for the driver to finish. Returns whether it did.
    pub fn leave(&self, timeout: Duration) -> bool {
        self.send(LocalEvent::Leave);
        let done = self.wait_ending(timeout).is_some();
        if done {
            self.join_thread();
        }
        done
    }

    fn wait_ending(&self, timeout: Duration) -> Option<Ending> {
        let (mutex, condvar) = &*self.shared;
        let shared = lock_any(mutex);
        let (shared, _) = condvar
            .wait_timeout_while(shared, timeout, |s| s.ending.is_none())
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        shared.ending.clone()
    }

    fn join_thread(&self) {
        if let Some(thread) = lock_any(&self.thread).take() {
            let _ = thread.join();
        }
    }
}

impl Drop for ElasticRendezvous {
    fn drop(&mut self) {
        if lock_any(&self.thread).is_some() {
            self.send(LocalEvent::Leave);
            // The driver sees the event within one keep-alive interval; don't block a
            // dropping caller longer than that would take, but don't leak the thread
            // either when it ends in time.
            if self.wait_ending(Duration::from_secs(30)).is_some() {
                self.join_thread();
            }
        }
    }
}

fn lock_any<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
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
    contact: Arc<Mutex<Option<String>>>,
    /// Offers a fresh contact at each arrival ([`Contact::FreePort`]).
    fresh: Option<Contact>,
    epoch: StdInstant,
    /// The last round whose last call this node logged.
    last_call_logged: Option<u64>,
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
            if let Some(contact) = lock_any(&self.contact).take() {
                self.machine.set_contact(&contact);
            }
            if let Some(fresh) = self.fresh.as_ref().filter(|_| self.machine.wants_contact()) {
                match fresh.offer() {
                    Ok(contact) => self.machine.set_contact(&contact),
                    // The old contact goes out instead: its port was free when it was
                    // picked, and may still be.
                    Err(error) => {
                        tracing::warn!(node = self.machine.node(), %error, "elastic rendezvous: keeping the last contact")
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
            if let StoreAction::Pause { until } = action {
                self.pause(until);
                self.machine.handle_reply(StoreReply::TimedOut, self.now());
                self.publish();
                continue;
            }
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

    /// Waits until `until` without a store request (the machine's [`StoreAction::Pause`]),
    /// taking local events meanwhile: they act once the pause is answered.
    fn pause(&mut self, until: Instant) {
        loop {
            let left = until.saturating_duration_since(self.now());
            if left.is_zero() {
                return;
            }
            match self.inbox.recv_timeout(left) {
                Ok(event) => self.machine.handle_local(event),
                Err(RecvTimeoutError::Timeout) => return,
                // The loop's next look at the inbox turns this into a leave.
                Err(RecvTimeoutError::Disconnected) => {
                    std::thread::sleep(left);
                    return;
                }
            }
        }
    }

    fn perform(&self, action: &StoreAction) -> Result<OwnedStoreReply, StoreError> {
        let left = match action {
            StoreAction::Wait { until, .. } | StoreAction::Pause { until } => until
                .saturating_duration_since(self.now())
                .max(Duration::from_millis(1)),
            _ => Duration::ZERO,
        };
        perform(&*self.store, action, left)
    }

    /// Hands the machine's events to the handle.
    fn publish(&mut self) {
        let open = self.open_progress();
        let (mutex, condvar) = &*self.shared;
        let mut shared = lock_any(mutex);
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
        shared.open = open;
        if changed {
            condvar.notify_all();
        }
    }

    /// The machine's open round on the wall clock; logs a round's last call once.
    fn open_progress(&mut self) -> Option<OpenProgress> {
        let open = self.machine.open_round()?;
        let (now, wall) = (self.now(), StdInstant::now());
        let last_call_ends = open
            .last_call_ends
            .map(|at| wall + at.saturating_duration_since(now));
        if last_call_ends.is_some() && self.last_call_logged != Some(open.round) {
            self.last_call_logged = Some(open.round);
            tracing::info!(
                node = self.machine.node(),
                round = open.round,
                "last call: waiting up to {} s for more nodes (last_call_timeout; {} of max {} here)",
                self.machine.settings().last_call.as_secs_f64(),
                open.live,
                open.max,
            );
        }
        Some(OpenProgress {
            round: open.round,
            live: open.live,
            min: open.min,
            max: open.max,
            last_call_ends,
        })
    }

    fn finish(&mut self, ending: Ending) {
        let (mutex, condvar) = &*self.shared;
        let mut shared = lock_any(mutex);
        shared.current = None;
        shared.ending = Some(ending);
        condvar.notify_all();
    }
}

/// A value no elastic key ever holds (the protocol writes text): see [`perform`]'s `Get`.
const NEVER_WRITTEN: &[u8] = b"\0rdzv: a read, never written\0";

/// Performs one of the core's store actions on `store`; a wait waits up to `left`.
fn perform(
    store: &dyn Store,
    action: &StoreAction,
    left: Duration,
) -> Result<OwnedStoreReply, StoreError> {
    Ok(match action {
        StoreAction::Check { key } => OwnedStoreReply::Checked(store.check(&[key])?),
        StoreAction::Add { key, delta } => OwnedStoreReply::Added(store.add(key, *delta)?),
        StoreAction::Set { key, value } => {
            store.set(key, value)?;
            OwnedStoreReply::Set
        }
        StoreAction::Append { key, value } => {
            store.append(key, value)?;
            OwnedStoreReply::Set
        }
        StoreAction::CompareSet {
            key,
            expected,
            desired,
        } => OwnedStoreReply::Value(store.compare_set(key, expected, desired)?),
        // The machine reads only keys that exist. `Store::get` would wait for the key
        // first (torch's client sends WAIT, then GET: two requests); a compare-set whose
        // expected value the protocol never writes changes nothing and answers with the
        // value, in one request on every store.
        StoreAction::Get { key } => {
            OwnedStoreReply::Value(store.compare_set(key, NEVER_WRITTEN, NEVER_WRITTEN)?)
        }
        StoreAction::Wait { key, .. } => match store.wait(&[key], Some(left)) {
            Ok(()) => OwnedStoreReply::Waited,
            Err(StoreError::Timeout { .. }) => OwnedStoreReply::TimedOut,
            Err(error) => return Err(error),
        },
        // No store request: only the time passes.
        StoreAction::Pause { .. } => {
            std::thread::sleep(left);
            OwnedStoreReply::TimedOut
        }
    })
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
    let node = node_id(parsed.node_id.as_ref(), env);
    // No rank yet: the error names the node. A join ends by the join timeout, connecting
    // included.
    let connect_timeout = options.timeout.min(parsed.settings.join_timeout);
    let store = TcpStore::connect_without_ping(&parsed.host, parsed.port, connect_timeout)
        .map_err(|e| {
            RendezvousError::Handler(Box::new(ElasticFailure::Unreachable {
                node: node.clone(),
                host: parsed.host.clone(),
                port: parsed.port,
                error: e.to_string(),
            }))
        })?;
    // torchrun's c10d backend gives its store client the read timeout; the rounds' stores
    // are prefixes of that client.
    store.set_timeout(parsed.read_timeout);
    first_round(Arc::new(store), parsed.settings, node)
}

/// A node's id: the URL's `node_id`, else `RDZV_NODE_ID`, else [`default_node_id`].
pub(super) fn node_id(given: Option<&String>, env: &dyn Env) -> String {
    given
        .cloned()
        .or_else(|| env.var("RDZV_NODE_ID").map(String::from))
        .unwrap_or_else(default_node_id)
}

/// Starts node `node` over `store` and waits for its first round (up to the join
/// timeout): the round's store, rank and world size, with the handle to follow the next
/// rounds (`elastic://` and `etcd://` alike).
pub(super) fn first_round(
    store: Arc<dyn Store>,
    settings: ElasticSettings,
    node: String,
) -> Result<Rendezvous, RendezvousError> {
    let handle = ElasticRendezvous::start(store, settings, node)
        .map_err(|e| RendezvousError::Handler(Box::new(e)))?;
    let round = handle
        .next_rendezvous()
        .map_err(|e| RendezvousError::Handler(Box::new(e)))?;
    let round_store = handle
        .round_store(&round)
        .map_err(|e| RendezvousError::Handler(Box::new(e)))?;
    let mut rendezvous = Rendezvous::new(round_store, round.rank, Some(round.world_size));
    rendezvous.elastic = Some(Arc::new(handle));
    Ok(rendezvous)
}
