//! Who may use a store server, and which keys: the pure half of rdzv's access control.
//!
//! PyTorch's TCPStore has none: it listens where it is told and serves anyone who sends
//! the public `VALIDATE` magic. rdzv keeps that default and adds two opt-in layers, both
//! decided here and enforced by the server loops:
//!
//! * **An allowlist** (`--allow CIDR,...`, [`Allowlist`]): a peer whose address is in no
//!   listed network is closed at accept. It works with PyTorch's clients. IPv4 and IPv6
//!   networks; a peer on an IPv4-mapped IPv6 address (`::ffff:10.1.2.3`, what a dual-stack
//!   listener reports for an IPv4 peer) is matched as the IPv4 address, and a rule written
//!   as a mapped network (`::ffff:10.0.0.0/104`) as the IPv4 network it maps. An IPv6
//!   network wider than the mapped range (`::/0`) holds the IPv4 peers it maps.
//! * **Tokens** (`--token-file PATH`, [`TokenTable`]): every connection must first send
//!   rdzv's `AUTH` query ([`crate::store::codec::decode_auth`]) with a token from the
//!   file; a token may be bound to a key prefix, so that one job cannot read or change
//!   another's keys. Only rdzv's own client sends `AUTH`, so in this mode a PyTorch client
//!   is refused (its first request is `VALIDATE`), with a log line saying so
//!   ([`Refusal::NotAuthenticated`]).
//!
//! # The token file
//!
//! UTF-8 text, one token per line: the token, then optionally whitespace and a key
//! prefix. Blank lines and lines starting with `#` are ignored. A token is 16 to 256
//! printable ASCII characters without spaces (generate one with
//! `head -c 24 /dev/urandom | base64`). Each token appears once.
//!
//! ```text
//! # operators: every key
//! 6tq2bX0n8Wc1pFv4LmZs7QyR
//! # job 1: only keys under "/job1/" (rdzv's and PyTorch's clients send a user key k as "/k")
//! f0H3kd8Jq2LmZp5Vw9XyTb1C /job1/
//! ```
//!
//! A prefix is matched against the key **as it is on the wire**: rdzv's and PyTorch's
//! clients put `/` before every user key, so the keys a job names `job1/...` need the
//! prefix `/job1/`.
//!
//! A token whose second field is `@status` ([`STATUS_GRANT`]) may read the status page
//! of `--metrics` (`/status`, `/status.json`, sent as `Authorization: Bearer TOKEN`) and
//! no key: every request that names a key, counts or lists keys is refused as outside
//! its scope. A token of every key may read the page too.
//!
//! # What a prefix-bound token may do
//!
//! | Requests | With a prefix-bound token |
//! |---|---|
//! | `VALIDATE`, `PING`, `CANCEL_WAIT` | allowed: they name no key (`CANCEL_WAIT` cancels the connection's own wait) |
//! | `SET`, `GET`, `ADD`, `COMPARE_SET`, `APPEND`, `DELETE_KEY`, `CHECK`, `WAIT`, `MULTI_GET`, `MULTI_SET`, `BARRIER`, `QUEUE_PUSH`, `QUEUE_POP`, `QUEUE_LEN` | allowed when **every** key (or queue name) the request names starts with the prefix |
//! | `GETNUMKEYS`, `LIST_KEYS` | refused: their answers count or name every tenant's keys |
//! | `STATS` | refused: server-wide figures |
//!
//! A token without a prefix may do everything. A refused request closes the connection
//! (the protocol has no error reply); the server logs [`Refusal`]'s text, which never
//! holds a token, and counts it ([`AccessCounters`]).
//!
//! This module does not read files, hold sockets or log: the runtime hands it the file's
//! bytes, the peer's address and the decoded requests. It gives no confidentiality:
//! tokens travel in clear, so use tokens on trusted networks or together with the
//! allowlist (see docs/operators.md, "Access control").

use core::fmt;
use core::net::{IpAddr, Ipv4Addr};
use core::str::FromStr;

use alloc::vec::Vec;

use crate::store::message::{QueryType, Request};

/// Shortest token accepted in a token file.
pub const MIN_TOKEN_LEN: usize = 16;
/// Longest token accepted in a token file.
pub const MAX_TOKEN_LEN: usize = 256;

/// One network: an address and how many leading bits of it count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cidr {
    addr: IpAddr,
    prefix_len: u8,
}

/// Why an `--allow` list could not be parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AllowlistError {
    /// The list names no network.
    Empty,
    /// Entry `index` (from 0) is not an address or an `ADDRESS/BITS` network.
    BadAddress {
        /// Which entry.
        index: usize,
    },
    /// Entry `index` has more prefix bits than its address family has.
    BadPrefixLen {
        /// Which entry.
        index: usize,
        /// The bits given.
        prefix_len: u32,
        /// The family's width (32 or 128).
        max: u8,
    },
}

impl fmt::Display for AllowlistError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            AllowlistError::Empty => f.write_str(
                "--allow names no network; give CIDR,... (e.g. 10.0.0.0/8,::1) or leave it out",
            ),
            AllowlistError::BadAddress { index } => write!(
                f,
                "--allow entry {} is not an IP address or ADDRESS/BITS network",
                index + 1
            ),
            AllowlistError::BadPrefixLen {
                index,
                prefix_len,
                max,
            } => write!(
                f,
                "--allow entry {}: /{prefix_len} is longer than the address's {max} bits",
                index + 1
            ),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for AllowlistError {}

/// An IPv4-mapped IPv6 address as its IPv4 address; any other address unchanged.
pub fn canonical(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

fn bits_v4(a: Ipv4Addr) -> u128 {
    u128::from(u32::from(a))
}

fn masked(bits: u128, width: u8, prefix_len: u8) -> u128 {
    if prefix_len == 0 {
        return 0;
    }
    let keep = u32::from(width - prefix_len.min(width));
    (bits >> keep) << keep
}

impl Cidr {
    /// Parses `ADDRESS` (a single host) or `ADDRESS/BITS`; surrounding spaces are
    /// ignored. A mapped IPv6 network (`::ffff:a.b.c.d/96+n`) becomes the IPv4 one.
    fn parse(entry: &str, index: usize) -> Result<Cidr, AllowlistError> {
        let entry = entry.trim();
        let (addr, bits) = match entry.split_once('/') {
            Some((addr, bits)) => (addr, Some(bits)),
            None => (entry, None),
        };
        let addr = addr.trim_start_matches('[').trim_end_matches(']');
        let addr = IpAddr::from_str(addr).map_err(|_| AllowlistError::BadAddress { index })?;
        let max: u8 = if addr.is_ipv4() { 32 } else { 128 };
        let prefix_len = match bits {
            None => u32::from(max),
            Some(bits) => bits
                .parse::<u32>()
                .map_err(|_| AllowlistError::BadAddress { index })?,
        };
        if prefix_len > u32::from(max) {
            return Err(AllowlistError::BadPrefixLen {
                index,
                prefix_len,
                max,
            });
        }
        // prefix_len <= 128 here.
        let prefix_len = prefix_len as u8;
        Ok(match addr {
            IpAddr::V6(v6) if prefix_len >= 96 && v6.to_ipv4_mapped().is_some() => Cidr {
                addr: canonical(addr),
                prefix_len: prefix_len - 96,
            },
            _ => Cidr { addr, prefix_len },
        })
    }

    /// Whether `peer` (already [`canonical`]) is in this network.
    pub fn contains(&self, peer: IpAddr) -> bool {
        match (self.addr, canonical(peer)) {
            (IpAddr::V4(net), IpAddr::V4(peer)) => {
                masked(bits_v4(net), 32, self.prefix_len)
                    == masked(bits_v4(peer), 32, self.prefix_len)
            }
            (IpAddr::V6(net), IpAddr::V6(peer)) => {
                masked(u128::from(net), 128, self.prefix_len)
                    == masked(u128::from(peer), 128, self.prefix_len)
            }
            // An IPv6 network wider than the mapped range (`::/0`, `::ffff:0:0/4`)
            // holds an IPv4 peer as its mapped address `::ffff:a.b.c.d`.
            (IpAddr::V6(net), IpAddr::V4(peer)) => {
                masked(u128::from(net), 128, self.prefix_len)
                    == masked(u128::from(peer.to_ipv6_mapped()), 128, self.prefix_len)
            }
            _ => false,
        }
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}

/// The networks `--allow` admits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allowlist {
    networks: Vec<Cidr>,
}

impl Allowlist {
    /// Parses `CIDR,CIDR,...` (`10.0.0.0/8,192.168.1.7,::1,fd00::/8`).
    pub fn parse(list: &str) -> Result<Allowlist, AllowlistError> {
        let networks = list
            .split(',')
            .filter(|entry| !entry.trim().is_empty())
            .enumerate()
            .map(|(index, entry)| Cidr::parse(entry, index))
            .collect::<Result<Vec<_>, _>>()?;
        if networks.is_empty() {
            return Err(AllowlistError::Empty);
        }
        Ok(Allowlist { networks })
    }

    /// Whether a peer at `peer` may connect.
    pub fn allows(&self, peer: IpAddr) -> bool {
        self.networks.iter().any(|net| net.contains(peer))
    }

    /// The networks, as parsed (mapped IPv6 networks shown as IPv4).
    pub fn networks(&self) -> &[Cidr] {
        &self.networks
    }
}

/// A secret: compared in constant time, never printed.
#[derive(Clone, PartialEq, Eq)]
struct Secret(Vec<u8>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<token>")
    }
}

/// Equal lengths and bytes, in time that depends only on the lengths.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Which keys a token reaches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Every key, and every query.
    All,
    /// Only keys that start with these bytes (wire keys: user keys carry a leading `/`).
    Prefix(Vec<u8>),
    /// The `@status` grant: reading `--metrics`' status page, and no key.
    Status,
}

/// Why a token file could not be read. Never holds a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TokenFileError {
    /// The file is not UTF-8 (line of the first bad byte).
    NotUtf8 {
        /// The line, from 1.
        line: usize,
    },
    /// A token is shorter than [`MIN_TOKEN_LEN`] or longer than [`MAX_TOKEN_LEN`].
    BadLength {
        /// The line, from 1.
        line: usize,
        /// Its length.
        len: usize,
    },
    /// A token holds a character outside printable ASCII.
    BadCharacter {
        /// The line, from 1.
        line: usize,
    },
    /// A line has more than a token and a prefix.
    TrailingText {
        /// The line, from 1.
        line: usize,
    },
    /// The token of this line already appeared on `first`.
    Duplicate {
        /// The line, from 1.
        line: usize,
        /// Where it appeared first.
        first: usize,
    },
    /// The file holds no token.
    Empty,
}

impl fmt::Display for TokenFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            TokenFileError::NotUtf8 { line } => write!(f, "line {line}: not UTF-8 text"),
            TokenFileError::BadLength { line, len } => write!(
                f,
                "line {line}: a token has {MIN_TOKEN_LEN} to {MAX_TOKEN_LEN} characters, this one {len}"
            ),
            TokenFileError::BadCharacter { line } => write!(
                f,
                "line {line}: a token holds only printable ASCII characters"
            ),
            TokenFileError::TrailingText { line } => write!(
                f,
                "line {line}: expected TOKEN [PREFIX], found more (comments start a line with #)"
            ),
            TokenFileError::Duplicate { line, first } => {
                write!(f, "line {line}: the token of line {first} again")
            }
            TokenFileError::Empty => f.write_str("the token file holds no token"),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for TokenFileError {}

/// The second field of a token line that grants the status page (and no key).
pub const STATUS_GRANT: &str = "@status";

/// What an accepted token grants: an index into its [`TokenTable`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Grant(usize);

/// The tokens of a token file and what each reaches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenTable {
    entries: Vec<(Secret, Scope)>,
}

/// The lines of a token file that hold a token: (line number from 1, token, rest).
fn token_lines(text: &str) -> impl Iterator<Item = (usize, &str, Option<&str>, bool)> {
    text.lines().enumerate().filter_map(|(i, line)| {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            return None;
        }
        let mut fields = line.split_whitespace();
        let token = fields.next()?;
        let prefix = fields.next();
        let trailing = fields.next().is_some();
        Some((i + 1, token, prefix, trailing))
    })
}

fn check_token(line: usize, token: &str) -> Result<(), TokenFileError> {
    if !(MIN_TOKEN_LEN..=MAX_TOKEN_LEN).contains(&token.len()) {
        return Err(TokenFileError::BadLength {
            line,
            len: token.len(),
        });
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(TokenFileError::BadCharacter { line });
    }
    Ok(())
}

fn utf8(bytes: &[u8]) -> Result<&str, TokenFileError> {
    core::str::from_utf8(bytes).map_err(|e| {
        let upto = bytes.get(..e.valid_up_to()).unwrap_or_default();
        TokenFileError::NotUtf8 {
            line: 1 + upto.iter().filter(|&&b| b == b'\n').count(),
        }
    })
}

impl TokenTable {
    /// Parses a token file's bytes (see the module docs for the format).
    pub fn parse(bytes: &[u8]) -> Result<TokenTable, TokenFileError> {
        let text = utf8(bytes)?;
        let mut entries: Vec<(Secret, Scope)> = Vec::new();
        let mut lines: Vec<usize> = Vec::new();
        for (line, token, prefix, trailing) in token_lines(text) {
            check_token(line, token)?;
            if trailing {
                return Err(TokenFileError::TrailingText { line });
            }
            if let Some(i) = entries
                .iter()
                .position(|(known, _)| same_secret(&known.0, token.as_bytes()))
            {
                return Err(TokenFileError::Duplicate {
                    line,
                    first: lines.get(i).copied().unwrap_or(0),
                });
            }
            let scope = match prefix {
                Some(STATUS_GRANT) => Scope::Status,
                Some(prefix) => Scope::Prefix(prefix.as_bytes().to_vec()),
                None => Scope::All,
            };
            entries.push((Secret(token.as_bytes().to_vec()), scope));
            lines.push(line);
        }
        if entries.is_empty() {
            return Err(TokenFileError::Empty);
        }
        Ok(TokenTable { entries })
    }

    /// How many tokens the file holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Always `false`: a parsed table holds at least one token.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The grant of `token`, if it is in the table. Every entry is compared, each in
    /// time that depends only on the lengths.
    pub fn authenticate(&self, token: &[u8]) -> Option<Grant> {
        let mut found = None;
        for (i, (secret, _)) in self.entries.iter().enumerate() {
            if same_secret(&secret.0, token) && found.is_none() {
                found = Some(Grant(i));
            }
        }
        found
    }

    /// What `grant` reaches.
    pub fn scope(&self, grant: Grant) -> &Scope {
        // A grant from another table reaches nothing.
        const NO_KEYS: &Scope = &Scope::Prefix(Vec::new());
        self.entries
            .get(grant.0)
            .map_or(NO_KEYS, |(_, scope)| scope)
    }
}

/// The token a client sends, from a client's token file: the first token line's token
/// (a job can be handed its own line of the server's file, prefix and all).
pub fn client_token(bytes: &[u8]) -> Result<&str, TokenFileError> {
    let text = utf8(bytes)?;
    let (line, token, _, _) = token_lines(text).next().ok_or(TokenFileError::Empty)?;
    check_token(line, token)?;
    Ok(token)
}

/// Where a connection stands with the server's access rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnAccess {
    /// No tokens are configured: every request is allowed (PyTorch's behaviour).
    Open,
    /// Tokens are configured and this connection has not sent `AUTH` yet: its first
    /// frame must be one ([`crate::store::codec::decode_auth`]).
    AwaitingAuth,
    /// It authenticated with a token; requests are checked against its scope.
    Granted(Grant),
}

/// Why a peer, a token or a request was refused: the server closes the connection and
/// logs this text (which never holds a token).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The peer's address is in no `--allow` network.
    PeerNotAllowed {
        /// The peer's address.
        peer: IpAddr,
    },
    /// Tokens are required and the first request was not `AUTH` (a PyTorch client).
    NotAuthenticated {
        /// The first byte it sent.
        byte: u8,
    },
    /// The `AUTH` token is not in the token file (or its frame was malformed).
    BadToken,
    /// A second `AUTH` on an authenticated connection.
    AuthTwice,
    /// The request names a key outside the token's prefix.
    KeyOutsidePrefix {
        /// The query.
        query: QueryType,
    },
    /// The query is not allowed to a prefix-bound token.
    QueryNotAllowed {
        /// The query.
        query: QueryType,
    },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Refusal::PeerNotAllowed { peer } => {
                write!(f, "peer {peer} is not in any --allow network; closed at accept")
            }
            Refusal::NotAuthenticated { byte } => write!(
                f,
                "this server requires a token (--token-file) and the client's first request \
                 was query type {byte}, not rdzv's AUTH: a PyTorch client, or an rdzv client \
                 without RDZV_TOKEN / RDZV_TOKEN_FILE; closed"
            ),
            Refusal::BadToken => f.write_str("the client's AUTH token is not in the token file; closed"),
            Refusal::AuthTwice => f.write_str("a second AUTH on an authenticated connection; closed"),
            Refusal::KeyOutsidePrefix { query } => write!(
                f,
                "{} names a key outside the client's token prefix; closed",
                query.name()
            ),
            Refusal::QueryNotAllowed { query } => write!(
                f,
                "{} is not allowed to a prefix-bound token (it reaches every tenant's keys); closed",
                query.name()
            ),
        }
    }
}

/// The refusals a server counts, for `STATS` and `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AccessCounters {
    /// Peers closed at accept by the allowlist.
    pub refused_peers: u64,
    /// Connections closed for a missing or unknown token.
    pub refused_tokens: u64,
    /// Connections closed for a request outside their token's scope.
    pub refused_requests: u64,
}

impl AccessCounters {
    /// Counts one refusal.
    pub fn record(&mut self, refusal: &Refusal) {
        let counter = match refusal {
            Refusal::PeerNotAllowed { .. } => &mut self.refused_peers,
            Refusal::NotAuthenticated { .. } | Refusal::BadToken | Refusal::AuthTwice => {
                &mut self.refused_tokens
            }
            Refusal::KeyOutsidePrefix { .. } | Refusal::QueryNotAllowed { .. } => {
                &mut self.refused_requests
            }
        };
        *counter = counter.saturating_add(1);
    }
}

/// A server's access rules: the allowlist and the tokens, each optional.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AccessPolicy {
    allow: Option<Allowlist>,
    tokens: Option<TokenTable>,
}

impl AccessPolicy {
    /// PyTorch's default: anyone, every key.
    pub fn open() -> AccessPolicy {
        AccessPolicy::default()
    }

    /// The rules of `--allow` and `--token-file`, each optional.
    pub fn new(allow: Option<Allowlist>, tokens: Option<TokenTable>) -> AccessPolicy {
        AccessPolicy { allow, tokens }
    }

    /// Whether neither an allowlist nor tokens are set (PyTorch's default).
    pub fn is_open(&self) -> bool {
        self.allow.is_none() && self.tokens.is_none()
    }

    /// Whether tokens are required.
    pub fn requires_tokens(&self) -> bool {
        self.tokens.is_some()
    }

    /// Whether `token` (an HTTP `Authorization: Bearer` token, `None` if none was sent)
    /// may read the status page: always without tokens; else a token of the
    /// [`STATUS_GRANT`] or of every key.
    pub fn grants_status(&self, token: Option<&[u8]>) -> bool {
        let Some(tokens) = &self.tokens else {
            return true;
        };
        token
            .and_then(|token| tokens.authenticate(token))
            .is_some_and(|grant| matches!(tokens.scope(grant), Scope::All | Scope::Status))
    }

    /// At accept: whether a peer at `peer` may connect.
    pub fn admit(&self, peer: IpAddr) -> Result<(), Refusal> {
        match &self.allow {
            Some(allow) if !allow.allows(peer) => Err(Refusal::PeerNotAllowed {
                peer: canonical(peer),
            }),
            _ => Ok(()),
        }
    }

    /// A newly accepted connection's state.
    pub fn new_connection(&self) -> ConnAccess {
        if self.tokens.is_some() {
            ConnAccess::AwaitingAuth
        } else {
            ConnAccess::Open
        }
    }

    /// An `AUTH` frame's token (or `None` for a malformed frame) on a connection in
    /// `state`: the new state, or the refusal to close it with.
    pub fn authenticate(
        &self,
        state: ConnAccess,
        token: Option<&[u8]>,
    ) -> Result<ConnAccess, Refusal> {
        match (state, &self.tokens) {
            (ConnAccess::AwaitingAuth, Some(tokens)) => token
                .and_then(|token| tokens.authenticate(token))
                .map(ConnAccess::Granted)
                .ok_or(Refusal::BadToken),
            (ConnAccess::Granted(_), _) => Err(Refusal::AuthTwice),
            // AUTH to a server without tokens: PyTorch's unknown query; refused as such.
            _ => Err(Refusal::BadToken),
        }
    }

    /// Per request: whether a connection in `state` may make `request`. A connection
    /// still [`ConnAccess::AwaitingAuth`] is refused whatever it asks; the server calls
    /// this only for requests decoded after the `AUTH` frame.
    pub fn authorize(&self, state: ConnAccess, request: &Request<'_>) -> Result<(), Refusal> {
        let grant = match state {
            ConnAccess::Open => return Ok(()),
            ConnAccess::AwaitingAuth => {
                return Err(Refusal::NotAuthenticated {
                    byte: request.query_type().as_u8(),
                })
            }
            ConnAccess::Granted(grant) => grant,
        };
        let prefix = match self.tokens.as_ref().map(|t| t.scope(grant)) {
            Some(Scope::All) => return Ok(()),
            Some(Scope::Prefix(prefix)) => Some(prefix.as_slice()),
            Some(Scope::Status) => None,
            None => return Ok(()),
        };
        let query = request.query_type();
        let inside = |key: &[u8]| prefix.is_some_and(|prefix| key.starts_with(prefix));
        let keys_inside = match *request {
            Request::Validate { .. } | Request::Ping { .. } | Request::CancelWait => true,
            Request::GetNumKeys | Request::ListKeys | Request::Stats => {
                return Err(Refusal::QueryNotAllowed { query })
            }
            Request::Set { key, .. }
            | Request::CompareSet { key, .. }
            | Request::Get { key }
            | Request::Add { key, .. }
            | Request::DeleteKey { key }
            | Request::Append { key, .. }
            | Request::QueuePush { key, .. }
            | Request::QueuePop { key }
            | Request::QueueLen { key }
            | Request::Barrier { key, .. } => inside(key),
            Request::Check { keys } | Request::Wait { keys } | Request::MultiGet { keys } => {
                keys.iter().all(inside)
            }
            Request::MultiSet { pairs } => pairs.iter().all(|(key, _)| inside(key)),
        };
        if keys_inside {
            Ok(())
        } else {
            Err(Refusal::KeyOutsidePrefix { query })
        }
    }
}

#[cfg(test)]
mod tests;
