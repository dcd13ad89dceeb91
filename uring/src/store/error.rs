//! Errors of the store implementations.

use std::io;
use std::path::PathBuf;

/// What a store operation can fail with. The messages follow PyTorch's where PyTorch has
/// one for the same failure, so that users can search for them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A wait (or a get, which waits) ran out of time.
    #[error("wait timeout after {ms}ms, keys: {}", keys.join(", "))]
    Timeout {
        /// The timeout, in milliseconds.
        ms: u128,
        /// The keys waited for, as the store saw them (PyTorch prints the `/` prefix).
        keys: Vec<String>,
    },
    /// A `get` ran out of time (PyTorch's FileStore text).
    #[error("Timeout waiting for key: {key} after {ms} ms")]
    GetTimeout {
        /// The key, as the caller named it.
        key: String,
        /// The timeout, in milliseconds.
        ms: u128,
    },
    /// A barrier ran out of time.
    #[error("barrier timeout after {ms}ms, key: {key}")]
    BarrierTimeout {
        /// The timeout, in milliseconds.
        ms: u128,
        /// The barrier key.
        key: String,
    },
    /// Connecting to a TCP store failed for the whole timeout.
    #[error("The client socket has timed out after {ms}ms while trying to connect to ({host}, {port}): {last_error}")]
    ConnectTimeout {
        /// The store host.
        host: String,
        /// The store port.
        port: u16,
        /// How long we tried.
        ms: u128,
        /// The last error seen.
        last_error: String,
    },
    /// A socket call failed.
    #[error("{op} {peer} failed: {source}")]
    Io {
        /// What we were doing ("send to", "recv from", "connect to", ...).
        op: &'static str,
        /// The peer address or path.
        peer: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The peer closed the connection.
    #[error("Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash? (peer {peer})")]
    Closed {
        /// The peer address.
        peer: String,
    },
    /// The peer sent something that is not the TCPStore protocol.
    #[error("protocol error from {peer}: {detail}")]
    Protocol {
        /// The peer address.
        peer: String,
        /// What was wrong.
        detail: String,
    },
    /// The server closed the connection on an rdzv extension query, which is how
    /// PyTorch's TCPStore refuses a query type it does not know.
    #[error("the server at {peer} does not answer rdzv's {query} query (it closed the connection); is it PyTorch's TCPStore? Only an rdzv store server (`rdzv store serve`) answers it")]
    Unsupported {
        /// The peer address.
        peer: String,
        /// The query's name, e.g. `STATS`.
        query: &'static str,
    },
    /// A file store's file could not be used.
    #[error("{op} {}: {source}", path.display())]
    File {
        /// What we were doing.
        op: &'static str,
        /// The store file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A FileStore file is damaged in the middle: a record's length field claims more
    /// bytes than follow, yet whole records lie behind it, so it is no torn tail. Nothing
    /// is cut or appended.
    #[error("FileStore {} is corrupt at offset {offset}: the record there claims {claimed} bytes but only {present} follow, and a whole record starts at offset {record_at}, so this is no record a crashed writer left at the end. Nothing was cut or written; keys from offset {offset} on are unreadable. Restore the file from a copy, or repair the record at offset {offset} by hand", path.display())]
    CorruptFile {
        /// The store file.
        path: PathBuf,
        /// Where the bad record starts (the end of the last whole record before it).
        offset: u64,
        /// The length its header claims.
        claimed: u64,
        /// The bytes from it to the end of the file.
        present: u64,
        /// Where the first whole record behind it starts.
        record_at: u64,
    },
    /// A request is over a limit the server decodes with, so it was not sent: the server
    /// would close the connection on it (PyTorch's protocol has no error reply).
    #[error("{limit}: not sent to {peer}, whose server would close the connection on it. Split the value (or the key list), or raise the limit on the server and on this client alike")]
    OverLimit {
        /// The server address.
        peer: String,
        /// Which field, its length or count, and the limit.
        limit: rdzv_core::store::codec::DecodeError,
    },
    /// The server closed the connection on rdzv's `AUTH` query: the token is not in its
    /// token file, or the server takes no tokens.
    #[error("the store server at {peer} refused this client's token (it closed the connection on rdzv's AUTH query): the token is not in the server's --token-file, or the server takes no tokens (PyTorch's, or rdzv without --token-file; then unset RDZV_TOKEN / RDZV_TOKEN_FILE). The server's log says which")]
    TokenRefused {
        /// The server address.
        peer: String,
    },
    /// The counter at a key does not hold a decimal integer.
    #[error("value of key {key} is not an integer counter: {detail}")]
    NotACounter {
        /// The key.
        key: String,
        /// What was wrong.
        detail: String,
    },
    /// A non-blocking queue pop found the queue empty.
    #[error("queue is empty")]
    QueueEmpty,
    /// The operation does not exist for this store.
    #[error("{0}")]
    NotImplemented(&'static str),
    /// An argument was out of range.
    #[error("{0}")]
    InvalidArgument(String),
}

impl StoreError {
    /// Whether the operation ran out of time (a wait, get, barrier or connect): the
    /// caller may retry with a longer timeout, where other errors need a fix.
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            StoreError::Timeout { .. }
                | StoreError::GetTimeout { .. }
                | StoreError::BarrierTimeout { .. }
                | StoreError::ConnectTimeout { .. }
        )
    }
}
