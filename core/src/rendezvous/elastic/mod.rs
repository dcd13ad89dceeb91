//! The elastic rendezvous: torchelastic's `DynamicRendezvousHandler` semantics as a pure
//! state machine over store operations, laid out so that a node's join and heartbeat cost
//! O(1) store work however many nodes there are.
//!
//! # Semantics (PyTorch's, where it has them)
//! - A rendezvous admits between `min_nodes` and `max_nodes` nodes (`nodes=1:4`, or
//!   `nodes=4` for exactly four, as torchrun's `--nnodes`).
//! - A round is open until it closes. Once `min_nodes` have arrived, a *last call* of
//!   `last_call` runs; when it ends the round closes with everyone who arrived by then
//!   (at most `max_nodes`). The arrival that makes `max_nodes` nodes live closes it at
//!   once.
//! - Ranks are dense, `0..world_size`. A member of the previous round keeps its rank when
//!   it is below the new world size (when two claim one rank, the holder from the later
//!   round wins); newcomers take the free ranks in the order of their node names (PyTorch
//!   sorts participants by node descriptor). Every member of a round gets the same world
//!   size and round number, and the round's store prefix
//!   `torch.rendezvous.{run_id}.{round}` (PyTorch's).
//! - A round holds only live nodes. A node that times out or leaves while its round is
//!   open is struck from it; nodes waiting in an open round heartbeat and watch one
//!   another, and strike a node whose heartbeat stopped; and a closed round is complete
//!   only when every member has acknowledged it: a member that dies between the close
//!   and its acknowledgement makes the round fail (the others rejoin the next one) before
//!   anyone is told a world in which that rank will never show up. The closer's
//!   compare-set of the size is its acknowledgement (it was alive to write it): a closer
//!   that dies right after it is like a member that dies after acknowledging, and its
//!   watcher ends the round within the keep-alive timeout.
//! - A node that arrives after the round closed is *waiting*: when the round has room
//!   (`world_size < max_nodes`) it asks for the next round at once (PyTorch's wait list,
//!   which makes every agent restart); when it is full it is a hot spare (PyTorch's
//!   redundancy list) and joins the next round whenever that starts, without a timeout.
//! - Members heartbeat every `keep_alive_interval`. A member that misses
//!   `keep_alive_max_attempts` intervals is dead, and the round is over: the others rejoin
//!   the next round without it. A member whose workers failed, that leaves, or that asks
//!   to re-rendezvous ends the round the same way (torchelastic's restart).
//! - Closing (`set_closed`, `shutdown`) is for good; every node then fails with
//!   `RendezvousClosedError` (a hot spare with `RendezvousGracefulExitError`), as new
//!   joiners do. A node that is not part of a complete round within `join_timeout` fails
//!   with `RendezvousTimeoutError`. [`ElasticErrorKind`] names the exception.
//!
//! # Key layout (every key under `rdzv.elastic.{run_id}/`)
//! | key | operations | who |
//! |---|---|---|
//! | `closed` | `SET` once; `CHECK` | closing; `is_closed` and every open-round tick check it |
//! | `round` | `ADD 0` to read, `COMPARE_SET r → r+1` (round 0's from missing, or from `0` after a read); `ADD` 2^40 when closed | the lowest round that may still be open; a joiner whose guess of round 0 was wrong reads it, so it also says "closed" |
//! | `{r}/arrivals` | `ADD 1` gives a node its slot `s` (low 32 bits); `ADD 2^32` counts a departure (high bits); `ADD 2^48` marks round 0 closed | each joiner once (a fresh node's first request, in round 0); each slot struck once; round 0's closer when it handed out fewer than `max_nodes` slots (after one that did not, a fresh node's slot above `max_nodes` sends it to `round`), and closing |
//! | `{r}/roster` | `APPEND "+s round:rank contact node"` on arrival (`-` for none), `"-s"` when struck; `GET` | each joiner once; the closer reads it once |
//! | `{r}/gone/{s}` | `COMPARE_SET "" → node` | whoever strikes slot `s` (it, or its watcher) claims it first, so it is counted once |
//! | `{r}/quorum` | `SET` | the arrival that makes `min_nodes` live, and the closer before its compare-set (no arrival may have seen exactly `min_nodes`, and a closer may leave at once); fewer wait on it |
//! | `{r}/size` | `COMPARE_SET "" → "N:c;s0,s1,…[;contact]"` (the closer's slot `c`, slots by rank, rank 0's contact) | **the one key that closes a round**: the first writer wins; everyone `WAIT`s on it, then `GET`s it |
//! | `{r}/ready` | `ADD 1` per member but the closer (low 32 bits); `ADD 2^32` to give up (high bits) | each member but the closer acknowledges once (the closer's compare-set is its acknowledgement, so `N − 1` make the count complete); one that waited in vain for `go`, the closer too, counts itself there before it decides |
//! | `{r}/verdict` | `COMPARE_SET "" → go\|fail` | **the one decision on the confirmation**: a member that waited in vain writes `go` if all N − 1 acknowledged before its give-up, else `fail`; the last ((N − 1)-th) acknowledger writes `go` only when somebody gave up before it; the first writer wins and every member obeys it |
//! | `{r}/go` | `SET`; members `WAIT` (the closer too) | the last acknowledger when nobody gave up before it (then `go` is the only verdict there can be), or whoever's verdict was `go` |
//! | `{r}/hb/{s}` | `ADD 1` own, `ADD 0` the watched slot's | each node once per keep-alive interval, in an open round and as a member; on etcd, a key bound to its node's lease ([`BEAT_GONE`] once the lease expired) |
//! | `{r}/over` | `SET` reason; members `WAIT` on it | whoever ends the round |
//!
//! The size value is written once, so every member reads the same world; slots are
//! distinct, so ranks are the distinct numbers `0..N`. Liveness is a ring, judged by each
//! watcher's own clock (no timestamps are compared across machines): in an open round the
//! node at slot `s` watches the nearest slot below it (round the ring) that it has not
//! struck; a member watches rank `k + 1 mod N`; a hot spare watches one member, so that a
//! round of one, or one whose members all died, ends too.
//!
//! The closer is the arrival that makes `max_nodes` live, or the first node whose last
//! call ends with at least `min_nodes` live. It reads the roster (for an arrival whose
//! line is still in flight, it pauses without a store request — [`StoreAction::Pause`],
//! 5 ms doubling, at most one keep-alive interval in all — and reads it again: a
//! concurrent closer is caught anyway by the compare-set, whose reply is the world that
//! won), leaves out the struck slots, ranks the first `max_nodes` live ones and
//! compare-sets the size, which names its own slot: only the winner finds its own
//! proposal there, so exactly one member counts as acknowledged by closing (a winner
//! left out of its own world counts for nobody: then all N acknowledge). In a round of
//! one the closer's compare-set completes it. A node
//! that leaves an open round strikes itself, then checks whether the round closed with it
//! (and ends it if so). A member struck after the closer's read and before its
//! compare-set (whose own check came first) is in the world but never acknowledges: the
//! confirmation fails after the keep-alive timeout and everyone rejoins
//! (`tests::a_member_struck_between_the_closers_read_and_its_close_fails_the_confirmation`);
//! that rare race costs the timeout, where a second read of the roster would cost every
//! round a request.
//!
//! A member (the closer too) waits for `go` at most the keep-alive timeout. The verdict is one key,
//! compare-set once, because counting alone cannot decide: with the last acknowledgement
//! counted but its `go` still in flight, two members that gave up waiting used to read
//! the same count and decide differently (one took the round as complete, the other
//! ended it; `tests::the_last_confirmation_in_flight_splits_no_round`). A member gives
//! up by adding 2^32 to `ready`, which also reads the acknowledgements, so the
//! acknowledgement that completes the count (the (N − 1)-th: the closer's is its
//! compare-set) knows whether anybody gave up before it. If
//! nobody did, every give-up comes after it, finds all N − 1 acknowledgements and can only
//! decide `go`: it `SET`s `go` without the verdict. If somebody did, that member may have
//! decided `fail`, and it compare-sets the verdict like everyone else
//! (`tests::the_last_acknowledgement_after_a_member_gave_up_obeys_the_verdict`).
//!
//! Each node may give a *contact* ([`ElasticNode::set_contact`]; torchrun's handler gives
//! `addr:port` for `MASTER_ADDR`/`MASTER_PORT`): it rides on the roster line, and the
//! closer appends rank 0's to the size value, so every member learns it with the world
//! ([`RoundOutcome::master`]) where torch's agents spend two more requests each.
//!
//! Store work per node: joining is an `ADD` (arrival; a fresh node guesses round 0, and
//! reads the hint only when round 0 is marked closed or its slot is above `max_nodes`),
//! an `APPEND`, a `WAIT` and a `GET` (the size), the acknowledgement's `ADD` and a `WAIT`
//! for `go`: six for every node but the closer, then a `WAIT` on `over` that lasts until
//! the first heartbeat. The closer's `GET` of the roster and compare-set of the size take
//! the place of the `WAIT` and the `GET`, and the compare-set is its acknowledgement:
//! five; the last acknowledger's `SET` of `go` takes the place of its `WAIT`
//! (`tests::store_work_at_16_nodes_by_operation`). A roster line still in flight costs
//! the closer a pause (no request) and another `GET` per poll; one poll (the usual case
//! when it happens) keeps the round at six per node
//! (`tests::a_roster_line_in_flight_costs_the_closer_a_pause_and_one_get`). Beyond
//! that: with `min_nodes <
//! max_nodes` the closer `SET`s the quorum, and in round 0, closing by last call with
//! fewer than `max_nodes` slots handed out, marks the arrivals; a member that waited in
//! vain for `go` adds its give-up and compare-sets the verdict. A member's heartbeat
//! interval is two `ADD`s and the `WAIT` on `over`. A wait in an open
//! round never outlasts one keep-alive interval; each interval there costs a heartbeat
//! `ADD`, an `ADD 0` of the arrivals, an `ADD 0` of the watched slot and a `CHECK` of
//! `closed`.
//! The roster and the size value grow with N (a few bytes per node), read once per member
//! and by the closer; torchrun's c10d backend instead compare-sets one pickled blob of the
//! whole state for every join and every heartbeat, and re-reads it once a second while
//! waiting, so its traffic grows with N².
//!
//! Keys of finished rounds are not deleted (a few per node per round): a long job with
//! many re-rendezvous grows the store by that much, and a new job should use a new run
//! id (as with torchrun, a closed run id stays closed).
//!
//! # Over other stores
//! The machine asks for seven operations ([`StoreAction`]): a counter `ADD`, `SET`,
//! `APPEND`, `GET` of a key that exists, `COMPARE_SET` against "missing", `CHECK` and a
//! `WAIT` for a key with a deadline; and a [`StoreAction::Pause`], which the runtime
//! answers itself when its time comes, sending nothing to the store. [`key_use`] says how it uses each key, so that a
//! store whose `ADD` and `APPEND` are compare-and-swap loops (etcd) can keep the keys
//! every node writes at once (a round's arrivals, acknowledgements and roster) as one key
//! per write, and resend a heartbeat whose answer was lost: a join then costs O(1)
//! requests there too (`rdzv_uring::rendezvous::etcd`). A store with leases may bind each
//! node's heartbeat keys to that node's lease: the watcher then strikes a slot whose key
//! it saw and finds gone ([`BEAT_GONE`]) at once, instead of counting stalled intervals.
//!
//! # Driving it
//! [`ElasticNode`] performs no I/O and reads no clock. The runtime loops: apply local
//! events ([`ElasticNode::handle_local`]), take [`ElasticNode::poll_action`], perform it
//! on the store and answer with [`ElasticNode::handle_reply`], then drain
//! [`ElasticNode::poll_event`]. Exactly one action is outstanding at a time; a
//! [`StoreAction::Wait`] or [`StoreAction::Pause`] carries its deadline (also
//! [`ElasticNode::poll_timeout`]), answered with [`StoreReply::TimedOut`] when it passes.

mod etcd_url;
mod key_use;
mod machine;
#[cfg(test)]
mod tests;
pub mod view;

use alloc::string::{String, ToString};
use core::fmt;
use core::time::Duration;

use crate::query::{QueryError, QueryView};
use crate::url::{PortError, RendezvousUrl, UrlError};

pub use crate::rpc::timeouts::Instant;
pub use etcd_url::{EtcdRendezvousUrl, EtcdUrlError, DEFAULT_ETCD_PORT, DEFAULT_ETCD_PREFIX};
pub use key_use::{beat_lease_ttl, key_use, KeyUse, BEAT_GONE, TALLY_UNITS};
pub use machine::{
    ElasticError, ElasticErrorKind, ElasticNode, Event, LocalEvent, OpenRound, OwnedStoreReply,
    RoundOutcome, StoreAction, StoreReply,
};

/// PyTorch's default join timeout (600 s).
pub const DEFAULT_JOIN_TIMEOUT: Duration = Duration::from_secs(600);
/// PyTorch's default last-call window (30 s).
pub const DEFAULT_LAST_CALL: Duration = Duration::from_secs(30);
/// PyTorch's default keep-alive interval (5 s).
pub const DEFAULT_KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// PyTorch's default number of missed keep-alives before a node is dead (3).
pub const DEFAULT_KEEP_ALIVE_MAX_ATTEMPTS: u32 = 3;
/// PyTorch's default close timeout (30 s): how long `set_closed` and `shutdown` may take.
pub const DEFAULT_CLOSE_TIMEOUT: Duration = Duration::from_secs(30);
/// PyTorch's default store read timeout of the c10d backend (60 s).
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(60);
/// torchelastic's c10d default port.
pub const DEFAULT_PORT: u16 = 29400;

/// `min_nodes..=max_nodes`, parsed from `MIN:MAX` or `N` (torchrun's `--nnodes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRange {
    /// The fewest nodes a round may close with.
    pub min: u32,
    /// The most nodes a round admits.
    pub max: u32,
}

impl NodeRange {
    /// A checked range.
    ///
    /// # Errors
    /// [`SettingsError::MinNodes`] for 0, [`SettingsError::MaxNodes`] for `max < min`.
    pub fn new(min: u32, max: u32) -> Result<Self, SettingsError<'static>> {
        if min < 1 {
            return Err(SettingsError::MinNodes { min });
        }
        if max < min {
            return Err(SettingsError::MaxNodes { min, max });
        }
        Ok(NodeRange { min, max })
    }

    /// `parse_min_max_nnodes`: `"MIN:MAX"` or `"N"` (both ends equal).
    ///
    /// # Errors
    /// [`SettingsError::NodesFormat`] when it is neither, else [`NodeRange::new`]'s.
    pub fn parse(text: &str) -> Result<Self, SettingsError<'_>> {
        let bad = SettingsError::NodesFormat { text };
        let number = |t: &str| -> Result<u32, SettingsError<'_>> {
            if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad);
            }
            t.parse().map_err(|_| bad)
        };
        let (min, max) = match text.split_once(':') {
            Some((min, max)) => (number(min)?, number(max)?),
            None => {
                let n = number(text)?;
                (n, n)
            }
        };
        NodeRange::new(min, max)
    }
}

/// What every node of one rendezvous must agree on, and its own timing.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ElasticSettings {
    /// The run id; it names the keys (`rdzv.elastic.{run_id}/…`).
    pub run_id: String,
    /// How many nodes a round admits.
    pub nodes: NodeRange,
    /// How long a node may take to become a member of a complete round.
    pub join_timeout: Duration,
    /// How long a round stays open once `min_nodes` have arrived.
    pub last_call: Duration,
    /// How often a member heartbeats.
    pub keep_alive_interval: Duration,
    /// How many intervals without a heartbeat make a member dead.
    pub keep_alive_max_attempts: u32,
    /// How long closing the rendezvous (`set_closed`, `shutdown`) may take.
    pub close_timeout: Duration,
}

impl ElasticSettings {
    /// PyTorch's defaults for `run_id` and `nodes`.
    pub fn new(run_id: impl Into<String>, nodes: NodeRange) -> Self {
        ElasticSettings {
            run_id: run_id.into(),
            nodes,
            join_timeout: DEFAULT_JOIN_TIMEOUT,
            last_call: DEFAULT_LAST_CALL,
            keep_alive_interval: DEFAULT_KEEP_ALIVE_INTERVAL,
            keep_alive_max_attempts: DEFAULT_KEEP_ALIVE_MAX_ATTEMPTS,
            close_timeout: DEFAULT_CLOSE_TIMEOUT,
        }
    }

    /// The key whose presence means the rendezvous is closed for good:
    /// `rdzv.elastic.{run_id}/closed` (`set_closed` writes it, `is_closed` checks it).
    pub fn closed_key(&self) -> String {
        alloc::format!("rdzv.elastic.{}/closed", self.run_id)
    }

    /// How long a member's heartbeat counter may stand still before it is dead.
    pub fn keep_alive_timeout(&self) -> Duration {
        self.keep_alive_interval
            .saturating_mul(self.keep_alive_max_attempts)
    }

    /// What closing the rendezvous writes, for a runtime that closes it without a node
    /// (`rdzv rendezvous --close`, a handle whose node has ended): the `closed` key (which
    /// `is_closed` checks), the mark on the round hint that joiners and advancing nodes
    /// read, and the mark on round 0's arrivals that a fresh node's first guess reads.
    /// Perform them in order; `by` says who closed it.
    pub fn close_actions(&self, by: &str) -> [StoreAction; 3] {
        [
            StoreAction::Set {
                key: self.closed_key(),
                value: alloc::format!("closed by {by}").into_bytes(),
            },
            StoreAction::Add {
                key: alloc::format!("rdzv.elastic.{}/round", self.run_id),
                delta: machine::CLOSED_MARK,
            },
            StoreAction::Add {
                key: self.live_count_key(0),
                delta: machine::ARRIVALS_CLOSED,
            },
        ]
    }

    /// The counter of round `round`'s arrivals: `rdzv.elastic.{run_id}/{round}/arrivals`
    /// (`ADD 0` reads it; [`ElasticSettings::live_count`] decodes the value).
    pub fn live_count_key(&self, round: u64) -> String {
        alloc::format!("rdzv.elastic.{}/{round}/arrivals", self.run_id)
    }

    /// How many nodes that arrived in a round are still there, from its arrivals counter:
    /// the low 32 bits count arrivals, the high bits departures.
    pub fn live_count(value: i64) -> u32 {
        let arrived = (value & 0xffff_ffff) as u32;
        let departed = u32::try_from(value >> 32).unwrap_or(0);
        arrived.saturating_sub(departed)
    }

    /// Checks what the constructor cannot: a non-empty run id and positive timeouts.
    ///
    /// # Errors
    /// [`SettingsError::RunId`], [`SettingsError::NotPositive`].
    pub fn check(&self) -> Result<(), SettingsError<'static>> {
        if self.run_id.is_empty() {
            return Err(SettingsError::RunId);
        }
        for (name, value) in [
            ("join_timeout", self.join_timeout),
            ("last_call", self.last_call),
            ("keep_alive_interval", self.keep_alive_interval),
            ("close_timeout", self.close_timeout),
        ] {
            if value.is_zero() {
                return Err(SettingsError::NotPositive { name });
            }
        }
        if self.keep_alive_max_attempts == 0 {
            return Err(SettingsError::NotPositive {
                name: "keep_alive_max_attempts",
            });
        }
        Ok(())
    }
}

/// `elastic://host:port/run_id?nodes=2:8&last_call=5s&…`, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ElasticUrl {
    /// The store's host.
    pub host: String,
    /// The store's port ([`DEFAULT_PORT`] when the URL has none).
    pub port: u16,
    /// The settings; `run_id` is the URL's path without its `/`.
    pub settings: ElasticSettings,
    /// `node_id`, if the query names one.
    pub node_id: Option<String>,
    /// `read_timeout`: the store client's timeout for one operation.
    pub read_timeout: Duration,
    /// `is_host`, if the query says: whether this node hosts the store server (torchrun's
    /// c10d backend guesses from the endpoint's host when it is not given).
    pub is_host: Option<bool>,
}

impl ElasticUrl {
    /// Parses the URL. Query keys (torchrun's `--rdzv-conf` names, and ours where they
    /// differ): `nodes` (`MIN:MAX` or `N`, default `1:1`); durations `join_timeout`,
    /// `last_call_timeout` (or `last_call`), `close_timeout`, `keep_alive_interval`,
    /// `read_timeout` (`500ms`, `5s`, `2m`, or a number of seconds such as `30` or `0.5`,
    /// as torchrun's); `keep_alive_max_attempt` (or `keep_alive_max_attempts`); `is_host`
    /// (`true`/`false`, `1`/`0`, `yes`/`no`); `node_id`. `rank` and `world_size` (added by
    /// URL rewriting) are ignored: the rendezvous assigns them.
    ///
    /// # Errors
    /// [`SettingsError`] naming what is wrong.
    pub fn parse(url: &str) -> Result<Self, SettingsError<'_>> {
        let parsed = RendezvousUrl::parse(url).map_err(SettingsError::Url)?;
        let host = parsed.hostname().ok_or(SettingsError::HostMissing)?;
        let port = parsed
            .port()
            .map_err(SettingsError::Port)?
            .unwrap_or(DEFAULT_PORT);
        let run_id = parsed.path().trim_start_matches('/');
        let query = QueryView::parse(parsed.query()).map_err(SettingsError::Query)?;
        let nodes = NodeRange::parse(query.get("nodes").unwrap_or("1:1"))?;
        let mut url = ElasticUrl {
            host: host.to_string(),
            port,
            settings: ElasticSettings::new(run_id, nodes),
            node_id: None,
            read_timeout: DEFAULT_READ_TIMEOUT,
            is_host: None,
        };
        for (key, value) in query.iter() {
            url.set(key, value)?;
        }
        url.settings.check()?;
        Ok(url)
    }

    /// Applies one option, by torchrun's `--rdzv-conf` name or ours (see
    /// [`ElasticUrl::parse`]); `nodes` here too. Call [`ElasticSettings::check`] after the
    /// last one.
    ///
    /// # Errors
    /// [`SettingsError::BadValue`], [`SettingsError::UnknownKey`], or `nodes`' errors.
    pub fn set<'a>(&mut self, key: &'a str, value: &'a str) -> Result<(), SettingsError<'a>> {
        let s = &mut self.settings;
        match key {
            "nodes" => s.nodes = NodeRange::parse(value)?,
            "join_timeout" => s.join_timeout = parse_duration(key, value)?,
            "last_call" | "last_call_timeout" => s.last_call = parse_duration(key, value)?,
            "close_timeout" => s.close_timeout = parse_duration(key, value)?,
            "keep_alive_interval" => s.keep_alive_interval = parse_duration(key, value)?,
            "read_timeout" => self.read_timeout = parse_duration(key, value)?,
            "keep_alive_max_attempts" | "keep_alive_max_attempt" => {
                s.keep_alive_max_attempts = value
                    .parse()
                    .map_err(|_| SettingsError::BadValue { key, value })?
            }
            "is_host" => self.is_host = Some(parse_bool(key, value)?),
            "node_id" => self.node_id = Some(String::from(value)),
            "rank" | "world_size" => {}
            _ => return Err(SettingsError::UnknownKey { key }),
        }
        Ok(())
    }
}

/// torchrun's booleans (`RendezvousParameters.get_as_bool`): `1`, `true`, `t`, `yes`, `y`
/// and `0`, `false`, `f`, `no`, `n`, in any case.
fn parse_bool<'a>(key: &'a str, value: &'a str) -> Result<bool, SettingsError<'a>> {
    let is = |names: &[&str]| names.iter().any(|n| value.eq_ignore_ascii_case(n));
    if is(&["1", "true", "t", "yes", "y"]) {
        Ok(true)
    } else if is(&["0", "false", "f", "no", "n"]) {
        Ok(false)
    } else {
        Err(SettingsError::BadValue { key, value })
    }
}

/// `500ms`, `5s`, `2m` or a bare number of seconds.
fn parse_duration<'a>(key: &'a str, value: &'a str) -> Result<Duration, SettingsError<'a>> {
    let bad = SettingsError::BadValue { key, value };
    let (digits, unit): (&str, fn(u64) -> Duration) = if let Some(d) = value.strip_suffix("ms") {
        (d, Duration::from_millis)
    } else if let Some(d) = value.strip_suffix('s') {
        (d, Duration::from_secs)
    } else if let Some(d) = value.strip_suffix('m') {
        (d, |m| Duration::from_secs(m.saturating_mul(60)))
    } else {
        (value, Duration::from_secs)
    };
    if let Some((whole, fraction)) = digits.split_once('.') {
        // Seconds with a fraction (`0.5`, `1.25s`), as torchrun's float timeouts.
        let all_digits = |t: &str| t.bytes().all(|b| b.is_ascii_digit());
        if value.ends_with("ms")
            || value.ends_with('m')
            || (whole.is_empty() && fraction.is_empty())
            || !all_digits(whole)
            || !all_digits(fraction)
        {
            return Err(bad);
        }
        let whole: u64 = if whole.is_empty() {
            0
        } else {
            whole.parse().map_err(|_| bad)?
        };
        let mut nanos: u32 = 0;
        for (i, b) in fraction.bytes().take(9).enumerate() {
            nanos += u32::from(b - b'0') * 10u32.pow(8 - i as u32);
        }
        return Ok(Duration::new(whole, nanos));
    }
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad);
    }
    digits.parse().map(unit).map_err(|_| bad)
}

/// Why elastic settings or an `elastic://` URL were refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SettingsError<'a> {
    /// `nodes` is neither `MIN:MAX` nor `N`.
    NodesFormat {
        /// The text given.
        text: &'a str,
    },
    /// `min_nodes` is 0.
    MinNodes {
        /// The value.
        min: u32,
    },
    /// `max_nodes < min_nodes`.
    MaxNodes {
        /// `min_nodes`.
        min: u32,
        /// `max_nodes`.
        max: u32,
    },
    /// The run id is empty.
    RunId,
    /// A timeout or count is zero.
    NotPositive {
        /// The setting.
        name: &'static str,
    },
    /// The URL does not parse.
    Url(UrlError<'a>),
    /// The URL's port is not a number in 0..=65535.
    Port(PortError<'a>),
    /// The URL has no host.
    HostMissing,
    /// A query piece is not `key=value`.
    Query(QueryError<'a>),
    /// A query value does not parse.
    BadValue {
        /// The key.
        key: &'a str,
        /// The value.
        value: &'a str,
    },
    /// A query key this rendezvous does not know.
    UnknownKey {
        /// The key.
        key: &'a str,
    },
}

impl fmt::Display for SettingsError<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NodesFormat { text } => write!(f, "nnodes={text} is not in \"MIN:MAX\" format"),
            Self::MinNodes { min } => write!(
                f,
                "The minimum number of rendezvous nodes ({min}) must be greater than zero."
            ),
            Self::MaxNodes { min, max } => write!(
                f,
                "The maximum number of rendezvous nodes ({max}) must be greater than or equal \
                 to the minimum number of rendezvous nodes ({min})."
            ),
            Self::RunId => f.write_str("The run id must be a non-empty string."),
            Self::NotPositive { name } => {
                write!(f, "The {name} of the elastic rendezvous must be positive.")
            }
            Self::Url(e) => e.fmt(f),
            Self::Port(e) => e.fmt(f),
            Self::HostMissing => f.write_str(
                "elastic:// rendezvous: the URL names no store host (elastic://host:port/run_id)",
            ),
            Self::Query(e) => write!(f, "elastic:// rendezvous: {e}"),
            Self::BadValue { key, value } => write!(
                f,
                "elastic:// rendezvous: {key}={value} is not valid (durations: 500ms, 5s, 2m, \
                 or seconds; counts: a positive integer; is_host: true or false)"
            ),
            Self::UnknownKey { key } => write!(
                f,
                "elastic:// rendezvous: unknown query key {key} (known: nodes, join_timeout, \
                 last_call_timeout, close_timeout, keep_alive_interval, \
                 keep_alive_max_attempt, read_timeout, is_host, node_id)"
            ),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for SettingsError<'_> {}
