//! `rdzv store <op>`: every operation of the [`Store`] trait as a subcommand, the way
//! etcdctl and redis-cli expose theirs.
//!
//! - **Address:** `--addr HOST:PORT`, else `RDZV_ADDR`, else `MASTER_ADDR:MASTER_PORT`
//!   (what a torchrun worker already has in its environment).
//! - **Binary-safe values:** a value comes from the command line, from `--value-file
//!   PATH` (`-` for standard input), or as hex with `--hex`; `get --out PATH` writes
//!   the raw bytes to a file.
//! - **Output:** text by default (a value and a newline, as before), or `-o json`: one
//!   JSON object per result on its own line; a value that is not UTF-8 is given as
//!   `value_base64` instead of `value`.
//! - **Server counters:** `stats` sends rdzv's `STATS` query (type byte 0x52, outside
//!   PyTorch's range); a PyTorch TCPStore closes the connection on it, which is reported
//!   as "does not answer rdzv's STATS query".
//! - **Exit codes:** 0 on success; 1 for an error, a missing key (`get --no-wait`) or a
//!   failed `check`; 2 for a timeout.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use base64::Engine as _;
use clap::{Args, Subcommand, ValueEnum};
use rdzv_core::store::{QueryType, StoreStats};
use rdzv_uring::store::etcd::{EtcdConfig, EtcdStore};
use rdzv_uring::store::tcp::{StoreToken, TcpStore, TcpStoreOptions};
use rdzv_uring::{Store, StoreError};
use serde_json::{json, Map, Value};

use crate::args::{seconds, split_addr};
use crate::error::CliError;

/// How results are printed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub(crate) enum Output {
    /// Values as they are, one per line; counts and flags as words.
    #[default]
    Text,
    /// One JSON object per result, one per line.
    Json,
}

/// Options every client operation shares.
#[derive(Debug, Args)]
pub(crate) struct ClientArgs {
    /// The store, as HOST:PORT, or etcd://HOST:PORT[,HOST:PORT...]/PREFIX for a store
    /// kept in etcd. Default: $RDZV_ADDR, else $MASTER_ADDR:$MASTER_PORT.
    #[arg(long, global = true)]
    pub addr: Option<String>,
    /// Timeout for connecting and for blocking calls, in seconds [default: 30].
    // No clap default: `store serve` must tell a flag given from one left out (cli.rs).
    #[arg(long, global = true)]
    pub connect_timeout: Option<f64>,
    /// Send the first token of this file in rdzv's AUTH query, for a server with tokens
    /// (default: $RDZV_TOKEN, else the file $RDZV_TOKEN_FILE; else none).
    #[arg(long, global = true, value_name = "PATH")]
    pub token_file: Option<PathBuf>,
    /// Values on the command line and in text output are hex (binary-safe).
    #[arg(long, global = true)]
    pub hex: bool,
    /// Output format [default: text].
    #[arg(short = 'o', long = "output", global = true, value_enum)]
    pub output: Option<Output>,
}

/// A value to store: the argument, or the contents of `--value-file`.
#[derive(Debug, Args)]
pub(crate) struct ValueIn {
    /// The value (hex with --hex). Omit it to use --value-file.
    #[arg(required_unless_present = "value_file", allow_hyphen_values = true)]
    value: Option<String>,
    /// Read the value from this file (`-`: standard input), byte for byte.
    #[arg(long, conflicts_with = "value")]
    value_file: Option<PathBuf>,
}

/// One operation on a running store.
#[derive(Debug, Subcommand)]
pub(crate) enum ClientOp {
    /// Set KEY to VALUE.
    Set {
        /// The key.
        key: String,
        #[command(flatten)]
        value: ValueIn,
    },
    /// Print the value of KEY (waits for it up to the timeout, unless --no-wait).
    Get {
        /// The key.
        key: String,
        /// Answer at once: a missing key exits with code 1.
        #[arg(long)]
        no_wait: bool,
        /// Write the raw value to this file instead of printing it.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Add N to the counter KEY and print the result.
    Add {
        /// The counter.
        key: String,
        /// How much to add (may be negative).
        #[arg(allow_hyphen_values = true)]
        n: i64,
    },
    /// Set KEY to DESIRED if it holds EXPECTED (or is missing and EXPECTED is empty);
    /// print the value KEY holds afterwards.
    CompareSet {
        /// The key.
        key: String,
        /// The value KEY must hold (hex with --hex; "" for a missing key).
        #[arg(allow_hyphen_values = true)]
        expected: String,
        /// The value to store (hex with --hex).
        #[arg(allow_hyphen_values = true)]
        desired: String,
    },
    /// Append VALUE to KEY (creating it).
    Append {
        /// The key.
        key: String,
        #[command(flatten)]
        value: ValueIn,
    },
    /// Print the values of several keys, in order (waits for all of them).
    MultiGet {
        /// The keys.
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// Set several keys at once, given as KEY=VALUE.
    MultiSet {
        /// KEY=VALUE pairs (VALUE in hex with --hex).
        #[arg(required = true)]
        pairs: Vec<String>,
    },
    /// The queue operations of PyTorch's store.
    #[command(subcommand)]
    Queue(QueueOp),
    /// Wait until WORLD_SIZE callers have reached the barrier KEY.
    Barrier {
        /// The barrier's key.
        key: String,
        /// How many callers the barrier waits for.
        #[arg(long)]
        world_size: i64,
        /// Seconds to wait (default: the connect timeout).
        #[arg(long)]
        timeout: Option<f64>,
    },
    /// Show the server's counters (rdzv's STATS query; PyTorch's TCPStore does not
    /// answer it): connections, keys, waiters, queues, requests by query type, bytes in
    /// and out, uptime.
    Stats,
    /// Measure a PING round trip to the server.
    Ping {
        /// How many pings.
        #[arg(long, default_value_t = 1)]
        count: u32,
    },
    /// Wait until every KEY exists.
    Wait {
        /// The keys.
        #[arg(required = true)]
        keys: Vec<String>,
        /// Seconds to wait (default: the connect timeout).
        #[arg(long)]
        timeout: Option<f64>,
    },
    /// Print `true` if every KEY exists, else `false` (exit code 1).
    Check {
        /// The keys.
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// Delete KEY; prints whether it existed.
    Delete {
        /// The key.
        key: String,
    },
    /// List the user keys.
    Keys {
        /// Only the keys that start with this.
        #[arg(long)]
        prefix: Option<String>,
    },
    /// Print the number of keys (PyTorch counts internal keys too).
    NumKeys,
}

/// `rdzv store queue …`.
#[derive(Debug, Subcommand)]
pub(crate) enum QueueOp {
    /// Push VALUE to the back of the queue KEY.
    Push {
        /// The queue.
        key: String,
        #[command(flatten)]
        value: ValueIn,
    },
    /// Pop the front of the queue KEY (waits for an element unless --no-wait).
    Pop {
        /// The queue.
        key: String,
        /// Answer at once: an empty queue exits with code 1.
        #[arg(long)]
        no_wait: bool,
    },
    /// Print the length of the queue KEY.
    Len {
        /// The queue.
        key: String,
    },
}

/// The store's address: `--addr`, else `RDZV_ADDR`, else `MASTER_ADDR:MASTER_PORT`.
pub(crate) fn resolve_addr(
    addr: Option<String>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<String, CliError> {
    if let Some(addr) = addr.or_else(|| env("RDZV_ADDR").filter(|a| !a.is_empty())) {
        return Ok(addr);
    }
    match (env("MASTER_ADDR"), env("MASTER_PORT")) {
        (Some(host), Some(port)) if !host.is_empty() && !port.is_empty() => {
            Ok(if host.contains(':') && !host.starts_with('[') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            })
        }
        (Some(_), _) | (_, Some(_)) => Err("MASTER_ADDR and MASTER_PORT must both be set to \
                                            name the store; or pass --addr HOST:PORT"
            .into()),
        _ => Err(
            "this command needs the store's address: --addr HOST:PORT, or RDZV_ADDR, \
                  or MASTER_ADDR and MASTER_PORT"
                .into(),
        ),
    }
}

/// The store a command talks to.
enum Opened {
    /// An rdzv store server or PyTorch's TCPStore.
    Tcp(TcpStore),
    /// A store kept in etcd (`etcd://…`).
    Etcd(EtcdStore),
}

/// Runs one client operation.
pub(crate) fn run(args: ClientArgs, op: ClientOp) -> Result<ExitCode, CliError> {
    let timeout = seconds(
        args.connect_timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT_S),
        "--connect-timeout",
    )?;
    let addr = resolve_addr(args.addr, |name| std::env::var(name).ok())?;
    // `etcd://HOST:PORT[,HOST:PORT…]/PREFIX`: the store kept in an etcd cluster.
    let opened = if addr.starts_with("etcd://") {
        let mut config = EtcdConfig::parse(&addr).map_err(|e| e.to_string())?;
        config.timeout = timeout;
        config.request_timeout = timeout;
        Opened::Etcd(EtcdStore::new(config))
    } else {
        let (host, port) = split_addr(&addr)?;
        let mut options = TcpStoreOptions::client(host, port);
        options.timeout = timeout;
        options.token = match &args.token_file {
            Some(path) => Some(StoreToken::from_file(path)?),
            None => None,
        };
        let store = TcpStore::new(options).map_err(|e| match e {
            // Says what to do by itself; the address is in it.
            StoreError::TokenRefused { .. } => CliError::from(e),
            e => format!("cannot reach the store at {addr}: {e}").into(),
        })?;
        Opened::Tcp(store)
    };
    let (store, tcp): (&dyn Store, _) = match &opened {
        Opened::Tcp(tcp) => (tcp, Some(tcp)),
        Opened::Etcd(etcd) => (etcd, None),
    };
    let out = Printer {
        format: args.output.unwrap_or_default(),
        hex: args.hex,
    };
    let input = Input { hex: args.hex };
    let mut stdout = std::io::stdout().lock();
    let what = op_name(&op);
    let code = execute(store, tcp, op, &out, &input, &mut stdout)
        .map_err(|e| explain_refusal(e, what, &addr))?;
    stdout.flush()?;
    Ok(code)
}

/// `--connect-timeout` when not given, in seconds.
const DEFAULT_CONNECT_TIMEOUT_S: f64 = 30.0;

/// The subcommand, as typed, for error messages.
fn op_name(op: &ClientOp) -> &'static str {
    match op {
        ClientOp::Set { .. } => "set",
        ClientOp::Get { .. } => "get",
        ClientOp::Add { .. } => "add",
        ClientOp::CompareSet { .. } => "compare-set",
        ClientOp::Append { .. } => "append",
        ClientOp::MultiGet { .. } => "multi-get",
        ClientOp::MultiSet { .. } => "multi-set",
        ClientOp::Queue(QueueOp::Push { .. }) => "queue push",
        ClientOp::Queue(QueueOp::Pop { .. }) => "queue pop",
        ClientOp::Queue(QueueOp::Len { .. }) => "queue len",
        ClientOp::Barrier { .. } => "barrier",
        ClientOp::Stats => "stats",
        ClientOp::Ping { .. } => "ping",
        ClientOp::Wait { .. } => "wait",
        ClientOp::Check { .. } => "check",
        ClientOp::Delete { .. } => "delete",
        ClientOp::Keys { .. } => "keys",
        ClientOp::NumKeys => "num-keys",
    }
}

/// A connection the server closed in the middle of an operation becomes a sentence that
/// says why a server does that and where to look; other errors pass unchanged.
/// PyTorch's protocol has no error reply, so a refusal reaches a client only as a close.
fn explain_refusal(e: CliError, what: &str, addr: &str) -> CliError {
    match e.downcast_ref::<StoreError>() {
        Some(StoreError::Closed { .. }) => closed_sentence(what, addr).into(),
        _ => e,
    }
}

fn closed_sentence(what: &str, addr: &str) -> String {
    let likely = match what {
        "add" => {
            "here most likely because the key holds a value that is not an integer \
                  (ADD counts in decimal text); "
        }
        "append" | "set" | "compare-set" | "multi-set" | "queue push" => {
            "here most likely because the result would exceed one of its limits (a value \
             of at most 8 MiB by default, or its memory budget); "
        }
        _ => "",
    };
    format!(
        "the store server at {addr} closed the connection during `{what}` without an answer. \
         A TCPStore server does that to refuse a request (PyTorch's protocol has no error \
         reply): ADD on a value that is not an integer, a key, value or key count over its \
         limits, or a client it does not admit; {likely}or it stopped. The server's log \
         says which, one line per refused connection"
    )
}

/// How values are read from the command line.
struct Input {
    hex: bool,
}

impl Input {
    fn text(&self, text: &str, what: &str) -> Result<Vec<u8>, CliError> {
        if self.hex {
            decode_hex(text).ok_or_else(|| {
                format!("{what} {text:?} is not hex (two digits per byte, as --hex asks)").into()
            })
        } else {
            Ok(text.as_bytes().to_vec())
        }
    }

    fn value(&self, value: ValueIn) -> Result<Vec<u8>, CliError> {
        match (value.value, value.value_file) {
            (Some(text), _) => self.text(&text, "the value"),
            (None, Some(path)) if path.as_os_str() == "-" => {
                let mut bytes = Vec::new();
                std::io::stdin()
                    .read_to_end(&mut bytes)
                    .map_err(|e| format!("reading the value from standard input: {e}"))?;
                Ok(bytes)
            }
            (None, Some(path)) => std::fs::read(&path)
                .map_err(|e| format!("reading the value from {}: {e}", path.display()).into()),
            (None, None) => Err("give a VALUE or --value-file PATH".into()),
        }
    }
}

/// How results are written.
struct Printer {
    format: Output,
    hex: bool,
}

impl Printer {
    /// A key's value: raw bytes (or hex) and a newline, or `{"key", "value"}`.
    fn value(&self, w: &mut dyn Write, key: &str, value: &[u8]) -> std::io::Result<()> {
        match self.format {
            Output::Text if self.hex => writeln!(w, "{}", encode_hex(value)),
            Output::Text => {
                w.write_all(value)?;
                w.write_all(b"\n")
            }
            Output::Json => {
                let mut object = Map::new();
                object.insert("key".into(), key.into());
                insert_value(&mut object, value);
                writeln!(w, "{}", Value::Object(object))
            }
        }
    }

    /// A result that is one word or number in text, and `fields` in JSON.
    fn fact(
        &self,
        w: &mut dyn Write,
        text: &dyn std::fmt::Display,
        fields: Value,
    ) -> std::io::Result<()> {
        match self.format {
            Output::Text => writeln!(w, "{text}"),
            Output::Json => writeln!(w, "{fields}"),
        }
    }

    /// An operation without a result: nothing in text, `{"ok": true, …}` in JSON.
    fn done(&self, w: &mut dyn Write, fields: Value) -> std::io::Result<()> {
        match self.format {
            Output::Text => Ok(()),
            Output::Json => {
                let mut object = Map::new();
                object.insert("ok".into(), true.into());
                if let Value::Object(more) = fields {
                    object.extend(more);
                }
                writeln!(w, "{}", Value::Object(object))
            }
        }
    }
}

/// `value` as UTF-8 text, or as `value_base64` when it is not UTF-8.
fn insert_value(object: &mut Map<String, Value>, value: &[u8]) {
    match std::str::from_utf8(value) {
        Ok(text) => object.insert("value".into(), text.into()),
        Err(_) => object.insert(
            "value_base64".into(),
            base64::engine::general_purpose::STANDARD
                .encode(value)
                .into(),
        ),
    };
}

fn execute(
    store: &dyn Store,
    tcp: Option<&TcpStore>,
    op: ClientOp,
    out: &Printer,
    input: &Input,
    w: &mut dyn Write,
) -> Result<ExitCode, CliError> {
    match op {
        ClientOp::Set { key, value } => {
            store.set(&key, &input.value(value)?)?;
            // SET has no reply; a round trip makes sure the server has applied it.
            store.check(&[&key])?;
            out.done(w, json!({ "key": key }))?;
        }
        ClientOp::Get {
            key,
            no_wait,
            out: path,
        } => {
            if no_wait && !store.check(&[&key])? {
                eprintln!("rdzv: key {key:?} is not in the store");
                return Ok(ExitCode::FAILURE);
            }
            let value = match store.get(&key) {
                Err(e) if e.is_timeout() => return timed_out(&e),
                other => other?,
            };
            match path {
                Some(path) => {
                    std::fs::write(&path, &value)
                        .map_err(|e| format!("writing the value to {}: {e}", path.display()))?;
                    out.done(w, json!({ "key": key, "bytes": value.len() }))?;
                }
                None => out.value(w, &key, &value)?,
            }
        }
        ClientOp::Add { key, n } => {
            let total = store.add(&key, n)?;
            out.fact(w, &total, json!({ "key": key, "value": total }))?;
        }
        ClientOp::CompareSet {
            key,
            expected,
            desired,
        } => {
            let expected = input.text(&expected, "EXPECTED")?;
            let desired = input.text(&desired, "DESIRED")?;
            let now = store.compare_set(&key, &expected, &desired)?;
            out.value(w, &key, &now)?;
        }
        ClientOp::Append { key, value } => {
            store.append(&key, &input.value(value)?)?;
            out.done(w, json!({ "key": key }))?;
        }
        ClientOp::MultiGet { keys } => {
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let values = match store.multi_get(&refs) {
                Err(e) if e.is_timeout() => return timed_out(&e),
                other => other?,
            };
            for (key, value) in keys.iter().zip(values) {
                out.value(w, key, &value)?;
            }
        }
        ClientOp::MultiSet { pairs } => {
            let mut parsed = Vec::with_capacity(pairs.len());
            for pair in &pairs {
                let (key, value) = pair
                    .split_once('=')
                    .ok_or_else(|| format!("{pair:?} is not KEY=VALUE"))?;
                parsed.push((key, input.text(value, "the value")?));
            }
            let refs: Vec<(&str, &[u8])> = parsed.iter().map(|(k, v)| (*k, v.as_slice())).collect();
            store.multi_set(&refs)?;
            out.done(w, json!({ "keys": parsed.len() }))?;
        }
        ClientOp::Queue(QueueOp::Push { key, value }) => {
            store.queue_push(&key, &input.value(value)?)?;
            out.done(w, json!({ "key": key }))?;
        }
        ClientOp::Queue(QueueOp::Pop { key, no_wait }) => match store.queue_pop(&key, !no_wait) {
            Ok(value) => out.value(w, &key, &value)?,
            Err(StoreError::QueueEmpty) => {
                eprintln!("rdzv: the queue {key:?} is empty");
                return Ok(ExitCode::FAILURE);
            }
            Err(e) if e.is_timeout() => return timed_out(&e),
            Err(e) => return Err(e.into()),
        },
        ClientOp::Queue(QueueOp::Len { key }) => {
            let len = store.queue_len(&key)?;
            out.fact(w, &len, json!({ "key": key, "len": len }))?;
        }
        ClientOp::Barrier {
            key,
            world_size,
            timeout,
        } => {
            if world_size < 1 {
                return Err(format!("--world-size must be at least 1, got {world_size}").into());
            }
            let t = timeout.map(|t| seconds(t, "--timeout")).transpose()?;
            match store.barrier(&key, world_size, t) {
                Ok(()) => out.done(w, json!({ "key": key, "world_size": world_size }))?,
                Err(e) if e.is_timeout() => return timed_out(&e),
                Err(e) => return Err(e.into()),
            }
        }
        ClientOp::Ping { count } => {
            for _ in 0..count.max(1) {
                let started = Instant::now();
                match tcp {
                    Some(tcp) => tcp.ping()?,
                    // etcd: one linearizable read (a count-only range) is the round trip.
                    None => drop(store.check(&["rdzv-ping"])?),
                }
                let us = started.elapsed().as_secs_f64() * 1e6;
                out.fact(
                    w,
                    &format_args!("pong in {us:.1} µs"),
                    json!({ "rtt_us": (us * 10.0).round() / 10.0 }),
                )?;
            }
        }
        ClientOp::Wait { keys, timeout } => {
            let t = timeout.map(|t| seconds(t, "--timeout")).transpose()?;
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            match store.wait(&refs, t) {
                Ok(()) => out.done(w, json!({ "keys": keys }))?,
                Err(e) if e.is_timeout() => return timed_out(&e),
                Err(e) => return Err(e.into()),
            }
        }
        ClientOp::Check { keys } => {
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let ready = store.check(&refs)?;
            out.fact(w, &ready, json!({ "keys": keys, "ready": ready }))?;
            if !ready {
                return Ok(ExitCode::FAILURE);
            }
        }
        ClientOp::Delete { key } => {
            let existed = store.delete_key(&key)?;
            out.fact(w, &existed, json!({ "key": key, "deleted": existed }))?;
        }
        ClientOp::Keys { prefix } => {
            let prefix = prefix.unwrap_or_default();
            for key in store.list_keys()? {
                if key.starts_with(&prefix) {
                    out.fact(w, &key, json!({ "key": key }))?;
                }
            }
        }
        ClientOp::NumKeys => {
            let n = store.num_keys()?;
            out.fact(w, &n, json!({ "num_keys": n }))?;
        }
        ClientOp::Stats => {
            let tcp = tcp.ok_or(
                "stats is the rdzv store server's STATS query; for etcd, ask etcd: \
                 ETCDCTL_API=3 etcdctl --endpoints=... endpoint status -w table",
            )?;
            let stats = tcp.stats()?;
            out.fact(w, &StatsText(&stats), stats_json(&stats))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A `STATS` reply as one JSON object; `requests` names every query type.
fn stats_json(stats: &StoreStats) -> Value {
    let requests: Map<String, Value> = QueryType::ALL
        .iter()
        .map(|&query| (query.name().to_string(), stats.requests_of(query).into()))
        .collect();
    json!({
        "connections": stats.connections,
        "keys": stats.keys,
        "waiters": stats.waiters,
        "queues": stats.queues,
        "bytes_in": stats.bytes_in,
        "bytes_out": stats.bytes_out,
        "uptime_ms": stats.uptime_ms,
        "requests": requests,
    })
}

/// A `STATS` reply as aligned `name value` lines; request counts only for the query
/// types the server has seen.
struct StatsText<'a>(&'a StoreStats);

impl std::fmt::Display for StatsText<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.0;
        writeln!(f, "connections  {}", s.connections)?;
        writeln!(f, "keys         {}", s.keys)?;
        writeln!(f, "waiters      {}", s.waiters)?;
        writeln!(f, "queues       {}", s.queues)?;
        writeln!(f, "bytes_in     {}", s.bytes_in)?;
        writeln!(f, "bytes_out    {}", s.bytes_out)?;
        write!(f, "uptime       {:.3} s", s.uptime_ms as f64 / 1000.0)?;
        for &query in &QueryType::ALL {
            let n = s.requests_of(query);
            if n > 0 {
                write!(f, "\nrequests     {:<12} {n}", query.name())?;
            }
        }
        Ok(())
    }
}

/// A timeout: one line on stderr, exit code 2.
fn timed_out(e: &StoreError) -> Result<ExitCode, CliError> {
    eprintln!("rdzv: timeout: {e}");
    Ok(ExitCode::from(2))
}

fn encode_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn decode_hex(text: &str) -> Option<Vec<u8>> {
    let text = text.strip_prefix("0x").unwrap_or(text);
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// A stand-in environment for the tests of address lookups (here and `cli`'s): `vars`
/// looked up by name.
#[cfg(test)]
pub(crate) fn test_env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
    move |name| {
        vars.iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::test_env as env;
    use super::*;

    #[test]
    fn a_closed_connection_is_explained() {
        let closed: CliError = Box::new(StoreError::Closed {
            peer: "127.0.0.1:1".into(),
        });
        let text = explain_refusal(closed, "add", "h:1").to_string();
        assert!(text.contains("not an integer"), "{text}");
        assert!(text.contains("log"), "{text}");
        assert!(!text.contains("Did the remote server shutdown"), "{text}");
        let other: CliError = "kept".into();
        assert_eq!(explain_refusal(other, "add", "h:1").to_string(), "kept");
    }

    #[test]
    fn the_address_comes_from_the_flag_then_rdzv_addr_then_master() {
        let all = [
            ("RDZV_ADDR", "a:1"),
            ("MASTER_ADDR", "m"),
            ("MASTER_PORT", "2"),
        ];
        assert_eq!(
            resolve_addr(Some("f:3".into()), env(&all)).ok(),
            Some("f:3".into())
        );
        assert_eq!(resolve_addr(None, env(&all)).ok(), Some("a:1".into()));
        assert_eq!(resolve_addr(None, env(&all[1..])).ok(), Some("m:2".into()));
        let v6 = [("MASTER_ADDR", "::1"), ("MASTER_PORT", "29500")];
        assert_eq!(
            resolve_addr(None, env(&v6)).ok(),
            Some("[::1]:29500".into())
        );
        let half = resolve_addr(None, env(&all[1..2])).map_err(|e| e.to_string());
        assert!(
            half.as_ref().is_err_and(|e| e.contains("MASTER_PORT")),
            "{half:?}"
        );
        let none = resolve_addr(None, env(&[])).map_err(|e| e.to_string());
        assert!(
            none.as_ref().is_err_and(|e| e.contains("--addr")),
            "{none:?}"
        );
    }

    #[test]
    fn hex_round_trips_and_refuses_odd_or_foreign_text() {
        let bytes = [0u8, 1, 0xfe, 0xff, b'a'];
        assert_eq!(decode_hex(&encode_hex(&bytes)), Some(bytes.to_vec()));
        assert_eq!(decode_hex("0x00ff"), Some(vec![0, 0xff]));
        assert_eq!(decode_hex("abc"), None);
        assert_eq!(decode_hex("zz"), None);
        assert_eq!(decode_hex("é1"), None);
    }

    #[test]
    fn json_values_are_text_or_base64() {
        let mut object = Map::new();
        insert_value(&mut object, b"plain");
        assert_eq!(Value::Object(object).to_string(), r#"{"value":"plain"}"#);
        let mut object = Map::new();
        insert_value(&mut object, &[0xff, 0x00]);
        assert_eq!(
            Value::Object(object).to_string(),
            r#"{"value_base64":"/wA="}"#
        );
    }
}
