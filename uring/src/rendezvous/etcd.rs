//! The `etcd://` scheme: the elastic rendezvous kept in an etcd cluster, so that it
//! outlives any one machine (an `elastic://` rendezvous dies with its store server).
//!
//! `rendezvous("etcd://h1:2379,h2:2379,h3:2379/run_id?nodes=2:8&last_call=5s")` runs the
//! same machine as `elastic://` ([`rdzv_core::rendezvous::elastic::ElasticNode`], driven by
//! [`ElasticRendezvous`]) over an [`EtcdStore`], and returns the round's store
//! (`PrefixStore("torch.rendezvous.{run_id}.{round}", EtcdStore)`), rank, world size and
//! the handle. The URL is core's ([`EtcdRendezvousUrl`]): `elastic://`'s query keys, plus
//! `etcd_prefix` (default `rdzv`).
//!
//! Which etcd primitive each of the machine's rules uses (the store's module has the
//! whole mapping):
//!
//! | rule | store operation | etcd |
//! |---|---|---|
//! | round hint, arrivals, acknowledgements, heartbeats (`ADD`) | a counter | one transaction comparing the key's `mod_revision` (two when another node moved it first) |
//! | roster lines (`APPEND`) | append | the same compare-guarded transaction |
//! | the size that closes a round, a slot's strike (`COMPARE_SET "" → v`) | create-if-absent | one transaction comparing `create_revision = 0`: exactly one writer wins |
//! | quorum, go, over, closed (`SET`), reads (`GET`, `CHECK`) | put, range | put, range |
//! | waiting for the size, go, over, quorum (`WAIT`) | wait | a range, then a watch from the revision after it: nodes learn of the release by the watch, without polling |
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

use std::sync::Arc;

use rdzv_core::env::Env;
use rdzv_core::rendezvous::elastic::EtcdRendezvousUrl;

use super::elastic::{default_node_id, ElasticRendezvous};
use super::{Rendezvous, RendezvousError, RendezvousOptions};
use crate::store::etcd::{EtcdConfig, EtcdStore};

/// The [`EtcdStore`] an `etcd://` rendezvous keeps its keys in: the URL's endpoints and
/// prefix, with `read_timeout` as the store's timeout and as the time one request may take
/// over every endpoint.
pub fn etcd_store(url: &EtcdRendezvousUrl) -> EtcdStore {
    let mut config = EtcdConfig::new(url.endpoints.clone(), &url.prefix);
    config.timeout = url.elastic.read_timeout;
    config.request_timeout = url.elastic.read_timeout;
    EtcdStore::new(config)
}

/// The `etcd://` handler: joins through etcd and waits for the first round (up to the
/// join timeout). The node id is the URL's `node_id`, else `RDZV_NODE_ID`, else
/// [`default_node_id`].
pub(super) fn etcd_rendezvous_handler(
    url: &str,
    env: &dyn Env,
    _options: &RendezvousOptions,
) -> Result<Rendezvous, RendezvousError> {
    let parsed = EtcdRendezvousUrl::parse(url).map_err(|e| RendezvousError::Plan(e.to_string()))?;
    let node = parsed
        .elastic
        .node_id
        .clone()
        .or_else(|| env.var("RDZV_NODE_ID").map(String::from))
        .unwrap_or_else(default_node_id);
    let store = etcd_store(&parsed);
    let handle = ElasticRendezvous::start(Arc::new(store), parsed.elastic.settings.clone(), node)
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
