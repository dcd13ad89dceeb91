//! Leases: keys that live only while their owner keeps a lease alive, so that a client
//! that dies (or is cut off from etcd) past the lease's TTL loses its keys without anyone
//! deleting them. The elastic rendezvous binds each node's heartbeat keys to the node's
//! lease (`rdzv_uring::rendezvous::etcd::MachineStore`).
//!
//! Each call is one request through the [`Gateway`](super::gateway) (`/v3/lease/grant`,
//! `/v3/lease/keepalive`, `/v3/lease/revoke`, a put with `lease`, a count-only range),
//! with its failover, backoff and errors. etcd's answer "lease not found" is not an error
//! here but a value ([`EtcdStore::lease_keep_alive`] and [`EtcdStore::put_leased`] say
//! `false`): what it means (a node that must rejoin, or a lease to grant again) is the
//! caller's to decide. Nothing here keeps a lease alive by itself: no thread, no timer.

use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::json;

use super::error::EtcdError;
use super::gateway::b64;
use super::{EtcdStore, StoreError};

/// etcd's gRPC code for "not found" (`etcdserver: requested lease not found`).
const NOT_FOUND: i64 = 5;

/// A lease granted by etcd: its id and the TTL etcd gave it (etcd raises a TTL below its
/// minimum, 2 s with its default election timeout, and counts in whole seconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// etcd's lease id.
    pub id: i64,
    /// The TTL etcd granted.
    pub ttl: Duration,
}

#[derive(Debug, Default, Deserialize)]
struct GrantReply {
    #[serde(default, rename = "ID", deserialize_with = "super::gateway::int")]
    id: i64,
    #[serde(default, rename = "TTL", deserialize_with = "super::gateway::int")]
    ttl: i64,
    #[serde(default)]
    error: String,
}

#[derive(Debug, Default, Deserialize)]
struct KeepAliveReply {
    /// Left out (zero) when the lease is not found.
    #[serde(default, rename = "TTL", deserialize_with = "super::gateway::int")]
    ttl: i64,
}

/// The keep-alive is a stream on the gateway: one `{"result": …}` line per request.
#[derive(Debug, Default, Deserialize)]
struct KeepAliveLine {
    #[serde(default)]
    result: Option<KeepAliveReply>,
}

/// The gateway's reply to a put or a revoke: nothing we read.
#[derive(Debug, Default, Deserialize)]
struct Empty {}

fn lease_not_found(err: &EtcdError) -> bool {
    matches!(err, EtcdError::Server { code, message, .. }
        if *code == NOT_FOUND && message.contains("lease not found"))
}

impl EtcdStore {
    /// Grants a lease of `ttl` (rounded up to whole seconds, at least 1; etcd may raise
    /// it to its minimum). One request; a grant resent after a lost answer may leave an
    /// unused lease behind, which expires by itself.
    pub fn lease_grant(&self, ttl: Duration) -> Result<Lease, StoreError> {
        let secs = ttl.as_secs_f64().ceil().max(1.0) as i64;
        let reply: GrantReply = self
            .gateway
            .call(
                "lease grant",
                "/v3/lease/grant",
                &json!({ "TTL": secs }),
                self.request_deadline(),
            )
            .map_err(|e| self.error(e))?;
        if !reply.error.is_empty() || reply.id == 0 || reply.ttl <= 0 {
            return Err(self.error(EtcdError::BadReply {
                endpoint: self.gateway.endpoints(),
                op: "lease grant",
                detail: format!(
                    "no lease granted (id {}, TTL {}): {}",
                    reply.id, reply.ttl, reply.error
                ),
            }));
        }
        Ok(Lease {
            id: reply.id,
            ttl: Duration::from_secs(reply.ttl.unsigned_abs()),
        })
    }

    /// Renews `lease` for its TTL: one `/v3/lease/keepalive`. `Ok(false)` when etcd no
    /// longer has it (it expired: it was not renewed within its TTL, or it was revoked).
    pub fn lease_keep_alive(&self, lease: &Lease) -> Result<bool, StoreError> {
        let line: KeepAliveLine = self
            .gateway
            .call(
                "lease keepalive",
                "/v3/lease/keepalive",
                &json!({ "ID": lease.id.to_string() }),
                self.request_deadline(),
            )
            .map_err(|e| self.error(e))?;
        Ok(line.result.is_some_and(|r| r.ttl > 0))
    }

    /// Revokes `lease`, deleting every key bound to it at once; one already gone is no
    /// error. Tries until `deadline` (a caller that is leaving need not wait long: the
    /// lease expires by itself anyway).
    pub fn lease_revoke(&self, lease: &Lease, deadline: Instant) -> Result<(), StoreError> {
        let revoked: Result<Empty, EtcdError> = self.gateway.call(
            "lease revoke",
            "/v3/lease/revoke",
            &json!({ "ID": lease.id.to_string() }),
            deadline,
        );
        match revoked {
            Ok(_) => Ok(()),
            Err(err) if lease_not_found(&err) => Ok(()),
            Err(err) => Err(self.error(err)),
        }
    }

    /// Puts `value` at `key`, bound to `lease` (the key is deleted when the lease ends).
    /// One request; `Ok(false)` when etcd no longer has the lease.
    pub fn put_leased(&self, key: &str, value: &[u8], lease: &Lease) -> Result<bool, StoreError> {
        let full = self.key(key)?;
        self.check_size("put", &[(key, value)])?;
        let put: Result<Empty, EtcdError> = self.gateway.call(
            "put",
            "/v3/kv/put",
            &json!({"key": b64(&full), "value": b64(value), "lease": lease.id.to_string()}),
            self.request_deadline(),
        );
        match put {
            Ok(_) => Ok(true),
            Err(err) if lease_not_found(&err) => Ok(false),
            Err(err) => Err(self.error(err)),
        }
    }

    /// Whether `key` (the key itself, not a queue beside it) is there: one count-only
    /// range.
    pub fn exists(&self, key: &str) -> Result<bool, StoreError> {
        let full = self.key(key)?;
        let body = json!({"key": b64(&full), "count_only": true});
        let reply = self.range(body, self.request_deadline())?;
        Ok(reply.count > 0 || !reply.kvs.is_empty())
    }

    /// The error for a node whose `lease` (of `key`) etcd no longer has: its keys are gone.
    pub fn lease_expired(&self, lease: &Lease, key: &str) -> StoreError {
        self.error(EtcdError::LeaseExpired {
            endpoints: self.gateway.endpoints(),
            lease: lease.id,
            ttl_secs: lease.ttl.as_secs(),
            key: key.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_alive_replies_say_whether_the_lease_is_there() {
        let alive: KeepAliveLine =
            serde_json::from_slice(br#"{"result":{"header":{"revision":"2"},"ID":"7","TTL":"3"}}"#)
                .unwrap();
        assert!(alive.result.is_some_and(|r| r.ttl == 3));
        // etcd 3.4's answer for a lease it does not have: no TTL.
        let gone: KeepAliveLine =
            serde_json::from_slice(br#"{"result":{"header":{"revision":"2"},"ID":"12345"}}"#)
                .unwrap();
        assert!(gone.result.is_some_and(|r| r.ttl == 0));
        let grant: GrantReply =
            serde_json::from_slice(br#"{"header":{},"ID":"7587899214808206597","TTL":"2"}"#)
                .unwrap();
        assert_eq!((grant.id, grant.ttl), (7587899214808206597, 2));
    }

    #[test]
    fn only_a_missing_lease_is_lease_not_found() {
        let server = |code, message: &str| EtcdError::Server {
            endpoint: "127.0.0.1:2379".into(),
            op: "put",
            code,
            status: 404,
            message: message.into(),
        };
        assert!(lease_not_found(&server(
            5,
            "etcdserver: requested lease not found"
        )));
        assert!(!lease_not_found(&server(5, "etcdserver: key not found")));
        assert!(!lease_not_found(&server(14, "etcdserver: no leader")));
    }
}
