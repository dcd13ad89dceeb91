//! The `etcd://` scheme: the elastic rendezvous kept in an etcd cluster, so that it
//! outlives any one machine (an `elastic://` rendezvous dies with its store server).
//!
//! `rendezvous("etcd://h1:2379,h2:2379,h3:2379/run_id?nodes=2:8&last_call=5s")` runs the
//! same machine as `elastic://` ([`rdzv_core::rendezvous::elastic::ElasticNode`], driven
//! by [`ElasticRendezvous`](super::elastic::ElasticRendezvous)) over an [`EtcdStore`]
//! ([`MachineStore`]), and returns the round's store
//! (`PrefixStore("torch.rendezvous.{run_id}.{round}", …)`, plain etcd keys), rank, world
//! size and the handle. The URL is core's ([`EtcdRendezvousUrl`]): `elastic://`'s query
//! keys, plus `etcd_prefix` (default `rdzv`).
//!
//! Which etcd primitive each of the machine's rules uses (the store's module has the
//! whole mapping):
//!
//! | rule | store operation | etcd |
//! |---|---|---|
//! | a round's arrivals and acknowledgements (`ADD` by every node at once) | a tally ([`KeyUse::Tally`]) | one transaction that creates this increment's own key and counts the units' keys after it: never a conflict |
//! | a round's roster (`APPEND` by every node at once, read by the closer) | a log ([`KeyUse::Log`]) | a put of this line's own key; a read is one range in `create_revision` order |
//! | heartbeats (`ADD 1` own, `ADD 0` the watched slot's) | a key bound to the node's lease ([`KeyUse::Beat`]) | the first `ADD 1` a put with the lease (granted at the first heartbeat, TTL the keep-alive timeout), each later one a `/v3/lease/keepalive`; `ADD 0` a count-only range: there, a value that moves; gone (the lease expired or was revoked), [`BEAT_GONE`], and the watcher strikes at once |
//! | the round hint (`ADD`, `COMPARE_SET`) | a counter | one compare-guarded transaction |
//! | the size that closes a round, a slot's strike, the verdict (`COMPARE_SET "" → v`) | create-if-absent | one transaction comparing `create_revision = 0`: exactly one writer wins |
//! | quorum, go, over, closed (`SET`), reads (`GET`, `CHECK`) | put, range | put, range |
//! | waiting for the size, go, over, quorum (`WAIT`) | wait | a range, then a watch from the revision after it: nodes learn of the release by the watch, without polling |
//!
//! So a join and a keep-alive cost O(1) etcd requests per node, whatever N: no key is
//! compare-and-swapped by more than one node at a time except the round hint and the
//! size, which one node each writes per round. A node's liveness is its lease: a node
//! killed outright loses its heartbeat keys when the TTL ends (etcd's own clock), one
//! that leaves revokes the lease and loses them at once, and its watcher strikes it as
//! soon as it sees the key gone.
//!
//! **Key layout.** etcd key = `/{etcd_prefix}/` + the TCPStore key: the machine's keys are
//! `/rdzv/rdzv.elastic.{run_id}/…` (the table in the core's module), and the rounds'
//! stores `/rdzv/torch.rendezvous.{run_id}.{round}/…`. So one `etcdctl get --prefix
//! /rdzv/rdzv.elastic.{run_id}/` shows a run's whole state, as `rdzv store list` does
//! over TCP.
//!
//! **Timeouts.** `read_timeout` (default 60 s) is both the store's default timeout and how
//! long one etcd request keeps failing over across the endpoints (with backoff) before the
//! node fails, so with the whole cluster down every node fails within about
//! `read_timeout` plus one keep-alive interval, with an error naming etcd and every
//! endpoint.
//!
//! Not here: the machine's rules (core), the HTTP and failover (the store's gateway).

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rdzv_core::env::Env;
use rdzv_core::rendezvous::elastic::{
    beat_lease_ttl, key_use, ElasticSettings, EtcdRendezvousUrl, KeyUse, BEAT_GONE,
    DEFAULT_KEEP_ALIVE_INTERVAL, DEFAULT_KEEP_ALIVE_MAX_ATTEMPTS, TALLY_UNITS,
};

use super::elastic::{first_round, node_id};
use super::{Rendezvous, RendezvousError, RendezvousOptions};
use crate::store::etcd::{EtcdConfig, EtcdStore, Lease};
use crate::store::{Store, StoreError};

/// The TTL of a node's heartbeat lease for a rendezvous with `settings`: a little over
/// its keep-alive timeout, so that a live node's slow confirmation never costs it its
/// lease ([`beat_lease_ttl`] says why).
pub fn lease_ttl(settings: &ElasticSettings) -> Duration {
    beat_lease_ttl(
        settings.keep_alive_interval,
        settings.keep_alive_max_attempts,
    )
}

/// The elastic machine's store on etcd: an [`EtcdStore`] that keeps the keys every node
/// of a round writes at once as one etcd key per write ([`KeyUse`]: the round's arrivals
/// and acknowledgements as tallies, its roster as a log; `EtcdStore::tally_add`,
/// `log_append`, `log_read`), so that a join costs O(1) etcd requests where
/// compare-and-swap loops on one key cost O(N) under a burst. Every other key, the
/// rounds' stores included, is the plain `EtcdStore`'s.
///
/// **Heartbeats are lease-bound.** The node's heartbeat keys ([`KeyUse::Beat`]) are bound
/// to one etcd lease of this store's, granted at its first heartbeat with a TTL a little
/// over the keep-alive timeout ([`lease_ttl`], [`MachineStore::with_lease_ttl`]; etcd
/// raises it to its minimum):
/// - `ADD 1` on its own key: the first puts the key bound to the lease (granting a fresh
///   lease if etcd no longer has the old one, as after a long wait as a hot spare: nobody
///   has seen that key yet); each later one is one `/v3/lease/keepalive`. A keep-alive
///   that etcd answers "lease not found" (the node was cut off or stalled past the TTL,
///   and its watchers may have struck it) fails with [`EtcdError::LeaseExpired`]
///   (`RendezvousConnectionError`), so the node rejoins rather than carry on as if alive.
/// - `ADD 0` on the watched slot's key: one count-only range: there, a value that moves on
///   every read; gone, [`BEAT_GONE`], on which the watcher strikes at once.
/// - Dropping the store (the node's driver ends: it left, shut down or failed) revokes the
///   lease, so its keys go at once; a node killed outright loses them when the TTL ends.
///
/// [`EtcdError::LeaseExpired`]: crate::store::etcd::EtcdError::LeaseExpired
pub struct MachineStore {
    etcd: EtcdStore,
    lease_ttl: Duration,
    beats: Mutex<Beats>,
}

/// This store's heartbeat lease and what it holds.
#[derive(Debug, Default)]
struct Beats {
    lease: Option<Lease>,
    /// The heartbeat keys put bound to `lease`.
    own: HashSet<String>,
    /// What a heartbeat or a read of a present key answers: it moves every time.
    moves: i64,
}

impl MachineStore {
    /// The machine's store over `etcd`, with heartbeat leases for PyTorch's default
    /// keep-alive settings (see [`MachineStore::with_lease_ttl`]).
    pub fn new(etcd: EtcdStore) -> MachineStore {
        MachineStore {
            etcd,
            lease_ttl: beat_lease_ttl(DEFAULT_KEEP_ALIVE_INTERVAL, DEFAULT_KEEP_ALIVE_MAX_ATTEMPTS),
            beats: Mutex::new(Beats::default()),
        }
    }

    /// The TTL asked for the node's heartbeat lease ([`lease_ttl`]); etcd grants whole
    /// seconds, at least its minimum (2 s with its default election timeout).
    pub fn with_lease_ttl(mut self, ttl: Duration) -> MachineStore {
        self.lease_ttl = ttl;
        self
    }

    /// The plain store underneath (e.g. for its request count).
    pub fn etcd(&self) -> &EtcdStore {
        &self.etcd
    }

    /// The heartbeat lease this store holds now, if any (granted at the first heartbeat).
    pub fn lease(&self) -> Option<Lease> {
        self.beats().lease
    }

    fn beats(&self) -> MutexGuard<'_, Beats> {
        self.beats.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `ADD` on a heartbeat key (see the type's docs).
    fn beat(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        if delta == 0 {
            let there = self.etcd.exists(key)?;
            let mut beats = self.beats();
            beats.moves += 1;
            return Ok(if there { beats.moves } else { BEAT_GONE });
        }
        let mut beats = self.beats();
        match beats.lease {
            Some(lease) if beats.own.contains(key) => {
                if !self.etcd.lease_keep_alive(&lease)? {
                    beats.lease = None;
                    beats.own.clear();
                    return Err(self.etcd.lease_expired(&lease, key));
                }
            }
            held => {
                let mut lease = match held {
                    Some(lease) => lease,
                    None => self.etcd.lease_grant(self.lease_ttl)?,
                };
                beats.lease = Some(lease);
                let mut tries = 0;
                while !self.etcd.put_leased(key, b"1", &lease)? {
                    // The lease ended while the node did not beat (a hot spare, a long
                    // confirmation): its old keys are gone, this one nobody has seen yet.
                    tries += 1;
                    beats.own.clear();
                    if tries > 1 {
                        beats.lease = None;
                        return Err(self.etcd.lease_expired(&lease, key));
                    }
                    lease = self.etcd.lease_grant(self.lease_ttl)?;
                    beats.lease = Some(lease);
                }
                beats.own.insert(key.to_string());
            }
        }
        beats.moves += 1;
        Ok(beats.moves)
    }

    fn refuse(key: &str, op: &str, use_: KeyUse) -> StoreError {
        StoreError::InvalidArgument(format!(
            "etcd rendezvous store: key {key} is the elastic machine's {use_:?}, kept as one etcd \
             key per write; {op} is not an operation on it (only ADD for a tally, APPEND and a \
             read for a log)"
        ))
    }
}

impl Store for MachineStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        match key_use(key) {
            KeyUse::Value | KeyUse::Beat => self.etcd.set(key, value),
            other => Err(Self::refuse(key, "SET", other)),
        }
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        match key_use(key) {
            KeyUse::Log => self.etcd.log_read(key),
            KeyUse::Tally => self
                .etcd
                .tally_add(key, 0, &TALLY_UNITS)
                .map(|v| v.to_string().into_bytes()),
            KeyUse::Value | KeyUse::Beat => self.etcd.get(key),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        match key_use(key) {
            KeyUse::Tally => self.etcd.tally_add(key, delta, &TALLY_UNITS),
            KeyUse::Beat => self.beat(key, delta),
            KeyUse::Value => self.etcd.add(key, delta),
            other => Err(Self::refuse(key, "ADD", other)),
        }
    }

    /// On a log, only a read: the machine reads a key that exists with a compare-set
    /// whose expected value it never writes; one that would match is refused.
    fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        match key_use(key) {
            KeyUse::Value | KeyUse::Beat => self.etcd.compare_set(key, expected, desired),
            KeyUse::Log => {
                let log = self.etcd.log_read(key)?;
                if log.is_empty() {
                    // What the TCP store answers for a missing key.
                    Ok(expected.to_vec())
                } else if log != expected {
                    Ok(log)
                } else {
                    Err(Self::refuse(
                        key,
                        "a COMPARE_SET that could write",
                        KeyUse::Log,
                    ))
                }
            }
            other => Err(Self::refuse(key, "COMPARE_SET", other)),
        }
    }

    fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        self.etcd.check(keys)
    }

    fn wait(&self, keys: &[&str], timeout: Option<Duration>) -> Result<(), StoreError> {
        self.etcd.wait(keys, timeout)
    }

    fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        self.etcd.delete_key(key)
    }

    fn num_keys(&self) -> Result<i64, StoreError> {
        self.etcd.num_keys()
    }

    fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        match key_use(key) {
            KeyUse::Log => self.etcd.log_append(key, value),
            KeyUse::Value | KeyUse::Beat => self.etcd.append(key, value),
            other => Err(Self::refuse(key, "APPEND", other)),
        }
    }

    fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError> {
        self.etcd.multi_get(keys)
    }

    fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), StoreError> {
        self.etcd.multi_set(pairs)
    }

    fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.etcd.queue_push(key, value)
    }

    fn queue_pop(&self, key: &str, block: bool) -> Result<Vec<u8>, StoreError> {
        self.etcd.queue_pop(key, block)
    }

    fn queue_len(&self, key: &str) -> Result<i64, StoreError> {
        self.etcd.queue_len(key)
    }

    fn list_keys(&self) -> Result<Vec<String>, StoreError> {
        self.etcd.list_keys()
    }

    fn timeout(&self) -> Duration {
        self.etcd.timeout()
    }

    fn set_timeout(&self, timeout: Duration) {
        self.etcd.set_timeout(timeout)
    }

    fn clone_store(&self) -> Result<Box<dyn Store>, StoreError> {
        Ok(Box::new(
            MachineStore::new(self.etcd.duplicate()).with_lease_ttl(self.lease_ttl),
        ))
    }
}

impl Drop for MachineStore {
    /// Revokes the heartbeat lease, so that the node's keys go at once (a node that left
    /// is struck without waiting for the TTL). Tries for at most a second: the lease
    /// expires by itself anyway.
    fn drop(&mut self) {
        if let Some(lease) = self.beats().lease.take() {
            let deadline = Instant::now() + REVOKE_WAIT.min(self.etcd.config().request_timeout);
            if let Err(error) = self.etcd.lease_revoke(&lease, deadline) {
                tracing::debug!(%error, "etcd rendezvous: revoking the heartbeat lease");
            }
        }
    }
}

/// How long dropping a [`MachineStore`] tries to revoke its lease.
const REVOKE_WAIT: Duration = Duration::from_secs(1);

/// The [`EtcdStore`] an `etcd://` rendezvous keeps its keys in: the URL's endpoints and
/// prefix, with `read_timeout` as the store's timeout and as the time one request may take
/// over every endpoint.
pub fn etcd_store(url: &EtcdRendezvousUrl) -> EtcdStore {
    let mut config = EtcdConfig::new(url.endpoints.clone(), &url.prefix);
    config.timeout = url.elastic.read_timeout;
    config.request_timeout = url.elastic.read_timeout;
    EtcdStore::new(config)
}

/// The store an `etcd://` rendezvous' machine runs on: [`etcd_store`] as a
/// [`MachineStore`].
pub fn machine_store(url: &EtcdRendezvousUrl) -> MachineStore {
    MachineStore::new(etcd_store(url)).with_lease_ttl(lease_ttl(&url.elastic.settings))
}

/// The `etcd://` handler: joins through etcd and waits for the first round (up to the
/// join timeout). The node id is the URL's `node_id`, else `RDZV_NODE_ID`, else
/// [`default_node_id`](super::elastic::default_node_id).
pub(super) fn etcd_rendezvous_handler(
    url: &str,
    env: &dyn Env,
    _options: &RendezvousOptions,
) -> Result<Rendezvous, RendezvousError> {
    let parsed = EtcdRendezvousUrl::parse(url).map_err(|e| RendezvousError::Plan(e.to_string()))?;
    let node = node_id(parsed.elastic.node_id.as_ref(), env);
    first_round(
        Arc::new(machine_store(&parsed)),
        parsed.elastic.settings.clone(),
        node,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    use rdzv_core::env::MapEnv;

    #[test]
    fn the_store_takes_the_urls_endpoints_prefix_and_timeout() {
        let url = EtcdRendezvousUrl::parse(
            "etcd://127.0.0.1:1,127.0.0.1:2/job?read_timeout=3s&etcd_prefix=team",
        )
        .expect("parse");
        let store = etcd_store(&url);
        let config = store.config();
        assert_eq!(config.endpoints, ["127.0.0.1:1", "127.0.0.1:2"]);
        assert_eq!(config.prefix, "team");
        assert_eq!(config.timeout, Duration::from_secs(3));
        assert_eq!(config.request_timeout, Duration::from_secs(3));
        assert_eq!(store.requests(), 0, "no request before the first operation");
    }

    #[test]
    fn an_unreachable_cluster_fails_the_rendezvous_naming_etcd_and_the_endpoints() {
        // Port 1 on loopback refuses at once; the node fails once read_timeout has passed.
        let started = Instant::now();
        let error = super::super::rendezvous_with(
            "etcd://127.0.0.1:1/unit?read_timeout=1s&keep_alive_interval=1s&join_timeout=20s",
            rdzv_core::rendezvous::NodeParams::Given {
                rank: None,
                world_size: None,
            },
            &MapEnv::new(&[("RDZV_NODE_ID", "n0")]),
            &RendezvousOptions::default(),
        )
        .expect_err("no etcd on port 1");
        let text = error.to_string();
        assert!(text.contains("etcd"), "{text}");
        assert!(text.contains("127.0.0.1:1"), "{text}");
        assert!(text.contains("node 'n0'"), "{text}");
        assert!(started.elapsed() < Duration::from_secs(15), "{text}");
    }
}
