//! `rdzv status ADDR`: the elastic runs a store holds, as a table per run (round, state,
//! members with rank, host and keep-alive age, waiting and struck nodes), the way
//! `etcdctl endpoint status` and `kubectl get` show theirs; `--watch` redraws, `-o json`
//! prints the data.
//!
//! Where it reads:
//! - `HOST:PORT --metrics MHOST:MPORT`: the server's `/status.json` (the server's figures
//!   too), sending `--token-file`'s token as `Authorization: Bearer` (it needs the
//!   `@status` grant in token mode);
//! - `HOST:PORT` (or `elastic://HOST:PORT/RUN_ID`: that run only): the keys themselves,
//!   through the store client (`LIST_KEYS`, then one `MULTI_GET`), read by
//!   `rdzv_core::rendezvous::elastic::view`;
//! - `etcd://HOST:PORT[,…]/RUN_ID[?etcd_prefix=P]`: that run's keys in etcd, the round
//!   counters and rosters as the rendezvous keeps them there. A heartbeat there is a
//!   lease's keep-alive, which changes no value: keep-alive ages are shown as "at least".
//!
//! Keep-alive ages and formation times come from watching the keys move, so a single
//! look shows them as bounds ("≥") and `--watch` makes them exact.

use std::collections::BTreeSet;
use std::io::{IsTerminal, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use rdzv_core::rendezvous::elastic::view::ElasticView;
use rdzv_core::rendezvous::elastic::{EtcdRendezvousUrl, Instant as CoreInstant};
use rdzv_uring::rendezvous::etcd::machine_store;
use rdzv_uring::store::tcp::{StoreToken, TcpStore, TcpStoreOptions};
use rdzv_uring::Store;
use serde_json::{json, Value};

use crate::args::{seconds, split_addr};
use crate::error::CliError;
use crate::store_client::Output;

/// `rdzv status`'s arguments.
#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    /// The store: HOST:PORT, elastic://HOST:PORT/RUN_ID (that run only), or
    /// etcd://HOST:PORT[,HOST:PORT...]/RUN_ID[?etcd_prefix=P].
    addr: String,
    /// Read the server's /status.json on its --metrics address instead of its keys
    /// (adds the server's figures).
    #[arg(long, value_name = "HOST:PORT")]
    metrics: Option<String>,
    /// Redraw every SECONDS [default: 2] until interrupted.
    #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "2")]
    watch: Option<f64>,
    /// Send the first token of this file: in rdzv's AUTH query to the store, or as
    /// `Authorization: Bearer` to --metrics (which needs the @status grant).
    #[arg(long, value_name = "PATH")]
    token_file: Option<PathBuf>,
    /// Timeout for connecting and for each read, in seconds.
    #[arg(long, default_value_t = 10.0)]
    connect_timeout: f64,
    /// Output format [default: text].
    #[arg(short = 'o', long = "output", value_enum)]
    output: Option<Output>,
}

/// Where the status comes from.
enum Source {
    /// `/status.json` at this address, with this bearer token.
    Metrics(String, Option<String>),
    /// The keys of a TCP store (of one run, if named).
    Tcp(Box<TcpStore>, Option<String>),
    /// One run's keys in etcd.
    Etcd(Box<dyn Store>, String),
}

/// Runs `rdzv status`.
pub(crate) fn run(args: StatusArgs) -> Result<ExitCode, CliError> {
    let timeout = seconds(args.connect_timeout, "--connect-timeout")?;
    let token = match &args.token_file {
        Some(path) => Some(StoreToken::from_file(path)?),
        None => None,
    };
    let source = open(&args, timeout, token)?;
    let json = args.output == Some(Output::Json);
    let started = Instant::now();
    let mut view = ElasticView::new();
    let mut stdout = std::io::stdout().lock();
    let clear = stdout.is_terminal();
    loop {
        let doc = read(&source, &mut view, started, timeout)?;
        let text = if json {
            format!("{doc}\n")
        } else {
            render(&doc)
        };
        if args.watch.is_some() && clear && !json {
            // Home and clear, then the table: a redraw, as `watch` does.
            write!(stdout, "\x1b[H\x1b[2J")?;
        }
        stdout.write_all(text.as_bytes())?;
        stdout.flush()?;
        let Some(every) = args.watch else {
            return Ok(ExitCode::SUCCESS);
        };
        std::thread::sleep(seconds(every, "--watch")?.max(Duration::from_millis(100)));
    }
}

fn open(
    args: &StatusArgs,
    timeout: Duration,
    token: Option<StoreToken>,
) -> Result<Source, CliError> {
    if let Some(metrics) = &args.metrics {
        let bearer = match &args.token_file {
            Some(path) => {
                let bytes = std::fs::read(path)
                    .map_err(|e| format!("cannot read the token file {}: {e}", path.display()))?;
                let token = rdzv_core::store::access::client_token(&bytes)
                    .map_err(|e| format!("token file {}: {e}", path.display()))?;
                Some(token.to_string())
            }
            None => None,
        };
        return Ok(Source::Metrics(metrics.clone(), bearer));
    }
    if args
        .addr
        .get(..7)
        .is_some_and(|s| s.eq_ignore_ascii_case("etcd://"))
    {
        let mut url =
            EtcdRendezvousUrl::parse(&args.addr).map_err(|e| format!("{}: {e}", args.addr))?;
        url.elastic.read_timeout = timeout;
        let run = url.elastic.settings.run_id.clone();
        if run.is_empty() {
            return Err(format!("{}: name the run: etcd://HOST:PORT/RUN_ID", args.addr).into());
        }
        return Ok(Source::Etcd(Box::new(machine_store(&url)), run));
    }
    let (addr, run) = match args.addr.strip_prefix("elastic://") {
        Some(rest) => {
            let rest = rest.split_once('?').map_or(rest, |(path, _)| path);
            let (addr, run) = rest.split_once('/').unwrap_or((rest, ""));
            let run = run.trim_matches('/');
            (addr, (!run.is_empty()).then(|| run.to_string()))
        }
        None => (args.addr.as_str(), None),
    };
    let (host, port) = split_addr(addr)?;
    let mut options = TcpStoreOptions::client(host, port);
    options.timeout = timeout;
    options.token = token;
    let store =
        TcpStore::new(options).map_err(|e| format!("cannot reach the store at {addr}: {e}"))?;
    Ok(Source::Tcp(Box::new(store), run))
}

/// One reading: `/status.json`'s document, or one made from the keys.
fn read(
    source: &Source,
    view: &mut ElasticView,
    started: Instant,
    timeout: Duration,
) -> Result<Value, CliError> {
    let (store, run, etcd): (&dyn Store, Option<&str>, bool) = match source {
        Source::Metrics(addr, token) => return fetch_status(addr, token.as_deref(), timeout),
        Source::Tcp(store, run) => (store.as_ref(), run.as_deref(), false),
        Source::Etcd(store, run) => (store.as_ref(), Some(run.as_str()), true),
    };
    let entries = run_keys(store, run, etcd)?;
    let pairs: Vec<(&[u8], &[u8])> = entries
        .iter()
        .map(|(k, v)| (k.as_bytes(), v.as_slice()))
        .collect();
    let now = CoreInstant::from_duration(started.elapsed());
    let runs: Vec<_> = view
        .observe(&pairs, now)
        .into_iter()
        .filter(|r| run.is_none_or(|id| r.run_id == id))
        .collect();
    Ok(json!({ "schema": 1, "runs": runs }))
}

/// The machine's keys of `run` (of every run, if `None`), with their values: the newest
/// two rounds of each run, which is all the view reads.
fn run_keys(
    store: &dyn Store,
    run: Option<&str>,
    etcd: bool,
) -> Result<Vec<(String, Vec<u8>)>, CliError> {
    let listed = store.list_keys().map_err(|e| {
        format!(
            "cannot list the store's keys ({e}); a token bound to a key prefix may not list \
             keys: use --metrics with a token of the @status grant, or a token of every key"
        )
    })?;
    let prefix = run.map(|id| format!("rdzv.elastic.{id}/"));
    let mine: Vec<String> = listed
        .into_iter()
        .filter(|k| match &prefix {
            Some(prefix) => k.starts_with(prefix.as_str()),
            None => k.starts_with("rdzv.elastic."),
        })
        .collect();
    // Each run's newest two rounds (`rdzv.elastic.{run}/{round}/…`).
    let mut rounds: BTreeSet<(String, u64)> = BTreeSet::new();
    for key in &mine {
        let mut parts = key.splitn(3, '/');
        if let (Some(base), Some(round), Some(_)) = (parts.next(), parts.next(), parts.next()) {
            if let Ok(round) = round.parse() {
                rounds.insert((base.to_string(), round));
            }
        }
    }
    let mut newest: BTreeSet<(String, u64)> = BTreeSet::new();
    for (base, round) in &rounds {
        let top = rounds
            .iter()
            .filter(|(b, _)| b == base)
            .map(|(_, r)| *r)
            .max()
            .unwrap_or(0);
        if round + 1 >= top {
            newest.insert((base.clone(), *round));
        }
    }
    let keep = |key: &str| {
        let mut parts = key.splitn(3, '/');
        match (
            parts.next(),
            parts.next().and_then(|r| r.parse::<u64>().ok()),
        ) {
            (Some(base), Some(round)) => newest.contains(&(base.to_string(), round)),
            _ => true,
        }
    };
    let mut keys: Vec<String> = mine.into_iter().filter(|k| keep(k)).collect();
    if etcd {
        // A round's counters and roster are kept as one etcd key per write, which a
        // listing skips; read them by name. Heartbeats are leases: present, no value.
        for (base, round) in &newest {
            keys.push(format!("{base}/{round}/arrivals"));
            keys.push(format!("{base}/{round}/roster"));
        }
        let mut out = Vec::new();
        for key in keys {
            if key.contains("/hb/") {
                out.push((key, Vec::new()));
                continue;
            }
            match store.get(&key) {
                Ok(value) => out.push((key, value)),
                Err(e) if e.is_timeout() => {}
                Err(e) => return Err(format!("cannot read {key} from etcd: {e}").into()),
            }
        }
        return Ok(out);
    }
    let names: Vec<&str> = keys.iter().map(String::as_str).collect();
    let values = if names.is_empty() {
        Vec::new()
    } else {
        store
            .multi_get(&names)
            .map_err(|e| format!("cannot read the run's {} keys: {e}", names.len()))?
    };
    Ok(keys.into_iter().zip(values).collect())
}

/// `GET /status.json` from `addr` with an optional bearer token.
fn fetch_status(addr: &str, token: Option<&str>, timeout: Duration) -> Result<Value, CliError> {
    let fail = |what: String| -> CliError {
        format!("cannot read http://{addr}/status.json: {what}").into()
    };
    let target = std::net::ToSocketAddrs::to_socket_addrs(addr)
        .map_err(|e| fail(e.to_string()))?
        .next()
        .ok_or_else(|| fail("no address".into()))?;
    let mut stream =
        TcpStream::connect_timeout(&target, timeout).map_err(|e| fail(e.to_string()))?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| fail(e.to_string()))?;
    let auth = token.map_or_else(String::new, |t| format!("Authorization: Bearer {t}\r\n"));
    let request =
        format!("GET /status.json HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .map_err(|e| fail(e.to_string()))?;
    let mut reply = Vec::new();
    stream
        .read_to_end(&mut reply)
        .map_err(|e| fail(e.to_string()))?;
    let reply = String::from_utf8_lossy(&reply);
    let (head, body) = reply
        .split_once("\r\n\r\n")
        .ok_or_else(|| fail("not an HTTP reply".into()))?;
    let code = head.split_whitespace().nth(1).unwrap_or("");
    match code {
        "200" => serde_json::from_str(body).map_err(|e| fail(format!("not JSON: {e}"))),
        "401" => Err(fail(format!(
            "refused (401): {}; pass --token-file with a token of the @status grant",
            body.trim()
        ))),
        "404" => Err(fail(
            "not served (404): is this rdzv's --metrics address, of a version with /status?".into(),
        )),
        other => Err(fail(format!("HTTP {other}: {}", body.trim()))),
    }
}

fn ms(v: &Value) -> String {
    match v.as_u64() {
        None => "-".into(),
        Some(ms) if ms < 1000 => format!("{ms}ms"),
        Some(ms) => format!("{:.1}s", ms as f64 / 1000.0),
    }
}

fn age(node: &Value) -> String {
    let bound = if node["beat_age_at_least"] == true {
        "≥"
    } else {
        ""
    };
    match node["beat_age_ms"].as_u64() {
        None => "-".into(),
        Some(_) => format!("{bound}{}", ms(&node["beat_age_ms"])),
    }
}

fn cell(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

/// Left-aligned columns, two spaces apart.
fn columns(rows: &[Vec<String>]) -> String {
    let width = |i: usize| {
        rows.iter()
            .map(|r| r.get(i).map_or(0, |c| c.chars().count()))
            .max()
            .unwrap_or(0)
    };
    let n = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..n).map(width).collect();
    let mut out = String::new();
    for row in rows {
        let mut line = String::from("  ");
        for (i, c) in row.iter().enumerate() {
            line.push_str(c);
            if i + 1 < row.len() {
                line.push_str(&" ".repeat(widths[i] - c.chars().count() + 2));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// The text tables of a status document.
fn render(doc: &Value) -> String {
    let mut out = String::new();
    let s = &doc["server"];
    if s.is_object() {
        let rps = s["requests_per_second"]
            .as_f64()
            .map_or("-".into(), |r| format!("{r:.1}"));
        out.push_str(&format!(
            "server  rdzv {}  up {:.0}s  io {} x{}  {} connections  {} keys  {rps} req/s  refused: {} peers, {} tokens, {} requests\n",
            cell(&s["version"]),
            s["uptime_s"].as_f64().unwrap_or(0.0),
            cell(&s["io"]),
            cell(&s["loops"]),
            cell(&s["connections"]),
            cell(&s["keys"]),
            cell(&s["refusals"]["peers"]),
            cell(&s["refusals"]["tokens"]),
            cell(&s["refusals"]["requests"]),
        ));
        let mut rows = vec![vec!["LIMIT".into(), "IN USE".into(), "OF".into()]];
        for l in s["limits"].as_array().into_iter().flatten() {
            rows.push(vec![
                cell(&l["name"]),
                cell(&l["in_use"]),
                cell(&l["limit"]),
            ]);
        }
        out.push_str(&columns(&rows));
        out.push('\n');
    }
    let runs = doc["runs"].as_array().map_or(&[][..], Vec::as_slice);
    if runs.is_empty() {
        out.push_str("no elastic runs\n");
    }
    for run in runs {
        let state = cell(&run["state"]).replace('_', " ");
        let mut head = format!(
            "run {}  round {}  {state}",
            cell(&run["run_id"]),
            cell(&run["round"])
        );
        if let Some(n) = run["world_size"].as_u64() {
            head.push_str(&format!("  world size {n}"));
        }
        if run["formed_ago_ms"].is_u64() {
            head.push_str(&format!("  formed {} ago", ms(&run["formed_ago_ms"])));
            if run["formed_in_ms"].is_u64() {
                head.push_str(&format!(" in {}", ms(&run["formed_in_ms"])));
            }
        }
        out.push_str(&head);
        out.push('\n');
        let members = run["members"].as_array().map_or(&[][..], Vec::as_slice);
        if !members.is_empty() {
            let mut rows = vec![vec![
                "RANK".into(),
                "NODE".into(),
                "HOST".into(),
                "KEEP-ALIVE".into(),
            ]];
            for m in members {
                rows.push(vec![
                    cell(&m["rank"]),
                    cell(&m["node"]),
                    cell(&m["host"]),
                    age(m),
                ]);
            }
            out.push_str(&columns(&rows));
        }
        let label = if members.is_empty() {
            "arrived"
        } else {
            "waiting"
        };
        for w in run["waiting"].as_array().into_iter().flatten() {
            out.push_str(&format!(
                "  {label}: {} (slot {}, keep-alive {})\n",
                cell(&w["node"]),
                cell(&w["slot"]),
                age(w)
            ));
        }
        for s in run["struck"].as_array().into_iter().flatten() {
            out.push_str(&format!(
                "  struck: {} from round {}: {}\n",
                cell(&s["node"]),
                cell(&s["round"]),
                cell(&s["why"])
            ));
        }
        if let Some(over) = run["over"].as_str() {
            out.push_str(&format!("  last round ended: {over}\n"));
        }
        out.push('\n');
    }
    if let Some(top) = doc["keys"]["top_prefixes"].as_array() {
        out.push_str(&format!(
            "keys: {} ({} bytes)\n",
            cell(&doc["keys"]["total"]),
            cell(&doc["keys"]["bytes"])
        ));
        let mut rows = vec![vec!["PREFIX".into(), "KEYS".into(), "BYTES".into()]];
        for p in top {
            rows.push(vec![
                cell(&p["prefix"]),
                cell(&p["keys"]),
                cell(&p["bytes"]),
            ]);
        }
        out.push_str(&columns(&rows));
    }
    out
}
