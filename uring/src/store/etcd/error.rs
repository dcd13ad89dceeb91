//! What talking to etcd can fail with.
//!
//! Every variant names the endpoint (or all endpoints tried) and carries etcd's own error
//! text or the transport's error as its source, so a message read in a log says which
//! member failed and how. [`EtcdError`] reaches [`crate::StoreError`] callers as the
//! source of a `StoreError::Io` whose operation is `etcd`, or as an `InvalidArgument`
//! for a request etcd would refuse (too large, too many operations).

/// A failure of one etcd operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EtcdError {
    /// etcd answered with an error (the gateway's `{"error", "code"}` body).
    #[error("etcd at {endpoint}: {op} failed: {message} (gRPC code {code}, HTTP {status})")]
    Server {
        /// The member that answered (`host:port`).
        endpoint: String,
        /// What was asked (`range`, `txn`, `watch`, ...).
        op: &'static str,
        /// etcd's gRPC status code.
        code: i64,
        /// The HTTP status of the reply.
        status: u16,
        /// etcd's own message, e.g. `etcdserver: no leader`.
        message: String,
    },
    /// The HTTP exchange with one member failed (refused, reset, timed out).
    #[error("etcd at {endpoint}: {op} failed: {source}")]
    Transport {
        /// The member (`host:port`).
        endpoint: String,
        /// What was asked.
        op: &'static str,
        /// The HTTP client's error.
        #[source]
        source: ureq::Error,
    },
    /// A request was cut off after it was sent (a copy of a [`EtcdError::Transport`],
    /// kept as the cause of an [`EtcdError::OutcomeUnknown`]).
    #[error("etcd at {endpoint}: {op} was cut off after it was sent: {detail}")]
    Interrupted {
        /// The member (`host:port`).
        endpoint: String,
        /// What was asked.
        op: &'static str,
        /// The transport's error, as text.
        detail: String,
    },
    /// A member's reply was not the JSON the gateway sends.
    #[error("etcd at {endpoint}: {op}: unreadable reply: {detail}")]
    BadReply {
        /// The member (`host:port`).
        endpoint: String,
        /// What was asked.
        op: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// No member answered within the operation's time, after retries with backoff on
    /// every endpoint.
    #[error("etcd {op} failed on every endpoint ({endpoints}) within {ms} ms ({attempts} attempts); is the etcd cluster up? last error: {last}")]
    Unavailable {
        /// What was asked.
        op: &'static str,
        /// Every endpoint given, comma-separated.
        endpoints: String,
        /// How long we tried.
        ms: u128,
        /// How many requests were sent or tried.
        attempts: u32,
        /// The last member's error.
        #[source]
        last: Box<EtcdError>,
    },
    /// A write that is not idempotent failed after it was sent: etcd may have applied it.
    /// It is not retried, since applying an `add` twice would count twice.
    #[error("etcd {op}: the request reached etcd but failed without a definite answer, so it may or may not have been applied (read the key to find out): {source}")]
    OutcomeUnknown {
        /// What was asked.
        op: &'static str,
        /// What went wrong after the request was sent.
        #[source]
        source: Box<EtcdError>,
    },
    /// etcd no longer has a lease this client keeps alive: it was not renewed within its
    /// TTL (the client was cut off from etcd, or stalled, that long), so etcd deleted the
    /// keys bound to it, and whoever watches them counts the client as gone.
    #[error("etcd at {endpoints}: lease {lease:x} (TTL {ttl_secs} s, holding key {key}) is gone: it was not kept alive within its TTL (this node was cut off from etcd or stalled that long), so etcd deleted its keys and the others count this node as dead; rejoin the rendezvous")]
    LeaseExpired {
        /// The endpoints.
        endpoints: String,
        /// etcd's lease id.
        lease: i64,
        /// The lease's TTL.
        ttl_secs: u64,
        /// A key that was bound to it.
        key: String,
    },
    /// A value (with its key) would exceed etcd's request-size limit.
    #[error("{op} of {bytes} bytes (key {key}) exceeds etcd's request-size limit of {limit} bytes (etcd's --max-request-bytes, 1.5 MiB by default); store less, or raise the limit on every member and in EtcdConfig::max_request_bytes")]
    TooLarge {
        /// What was asked.
        op: &'static str,
        /// The (first) user key.
        key: String,
        /// The request's size, keys and values together.
        bytes: usize,
        /// The limit.
        limit: usize,
    },
    /// A MULTI_SET or MULTI_GET with more keys than one etcd transaction may hold.
    #[error("{op} of {count} keys exceeds etcd's limit of {limit} operations per transaction (etcd's --max-txn-ops, 128 by default); split the call, or raise the limit on every member and in EtcdConfig::max_txn_ops")]
    TooManyOps {
        /// What was asked.
        op: &'static str,
        /// How many keys.
        count: usize,
        /// The limit.
        limit: usize,
    },
    /// A user key holds a NUL byte, which `EtcdStore` uses to put a queue beside its key.
    #[error("key {key:?} contains a NUL byte, which EtcdStore reserves (it separates a key from its queue's elements)")]
    NulInKey {
        /// The key.
        key: String,
    },
    /// An `etcd://` address could not be read.
    #[error(
        "bad etcd address {addr:?}: {detail}; expected etcd://HOST:PORT[,HOST:PORT...]/PREFIX"
    )]
    BadAddress {
        /// The address given.
        addr: String,
        /// What was wrong.
        detail: &'static str,
    },
}

impl EtcdError {
    /// A copy to keep as the cause of a later error (a transport error, which cannot be
    /// cloned, becomes [`EtcdError::Interrupted`] with its text).
    pub(crate) fn clone_for_report(&self) -> EtcdError {
        match self {
            EtcdError::Server {
                endpoint,
                op,
                code,
                status,
                message,
            } => EtcdError::Server {
                endpoint: endpoint.clone(),
                op,
                code: *code,
                status: *status,
                message: message.clone(),
            },
            EtcdError::Transport {
                endpoint,
                op,
                source,
            } => EtcdError::Interrupted {
                endpoint: endpoint.clone(),
                op,
                detail: source.to_string(),
            },
            other => EtcdError::Interrupted {
                endpoint: String::new(),
                op: "request",
                detail: other.to_string(),
            },
        }
    }
}
