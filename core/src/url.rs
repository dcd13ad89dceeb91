//! How a rendezvous URL splits into parts, with the semantics of Python's
//! `urllib.parse.urlparse` for everything `torch.distributed.rendezvous` reads.
//!
//! [`RendezvousUrl::parse`] is zero-copy: every part is a slice of the input, and
//! writing the parts back ([`RendezvousUrl`]'s `Display`, the "unparse") gives back the
//! input byte for byte. The splitting rules are CPython's (3.11.4 and later, unchanged
//! on `main`): the scheme is the text before the first `:` when it starts with an ASCII
//! letter and holds only letters, digits, `+`, `-` and `.`; a `//` starts the netloc, which
//! runs to the first `/`, `?` or `#`; the fragment starts at the first `#`, the query at the
//! first `?` before it; `;params` are split off the last path segment only for the schemes
//! in Python's `uses_params` (never for `tcp`, `env` or `file`). A netloc with one bracket
//! but not the other is `Invalid IPv6 URL`; a bracketed host must be an IPv6 address
//! (optionally with a `%zone`) or an `IPvFuture` (`v1.x`), never an IPv4 address. The
//! derived parts follow `ParseResult`: `username` and `password` come before the last
//! `@`, `hostname` is lowercased up to a `%zone` (the zone keeps its case) and is `None`
//! when empty, and `port` is checked only when asked for, with Python's messages
//! ("Port could not be cast to integer value as 'abc'", "Port out of range 0-65535").
//!
//! Deliberate differences, all so that parse-then-unparse is the identity:
//! - Python silently deletes ASCII tab, CR and LF anywhere in a URL and strips leading C0
//!   controls and spaces. We reject such a URL with [`UrlError::RemovedCharacter`]
//!   instead of parsing text other than the one given.
//! - Python's `urlunparse` normalizes (`env://` becomes `env:`, `file:/x` becomes
//!   `file:///x`, an empty `?` or `#` is dropped, the scheme is lowercased). We keep
//!   what was written; both spellings parse to the same parts.
//! - Python rejects a non-ASCII netloc whose NFKC normalization introduces `/?#@:`. Core
//!   carries no normalization tables and does not make that check.
//!
//! This module does not percent-decode, resolve hostnames or read the environment.

use core::fmt::{self, Write};
use core::net::{Ipv4Addr, Ipv6Addr};
use core::str::FromStr;

use crate::rendezvous::python::PyRepr;

/// Schemes for which Python's `urlparse` splits `;params` off the path (`uses_params`);
/// the empty scheme is among them.
const USES_PARAMS: [&str; 16] = [
    "", "ftp", "hdl", "prospero", "http", "imap", "https", "shttp", "rtsp", "rtsps", "rtspu",
    "sip", "sips", "mms", "sftp", "tel",
];

/// Why a URL could not be split into parts.
///
/// Every variant but [`UrlError::RemovedCharacter`] is a `ValueError` that Python's
/// `urlparse` raises, with the same text.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UrlError<'a> {
    /// The netloc has a `[` without a `]` or the other way round.
    InvalidIpv6,
    /// A bracketed host starts with `v` but is not `v<hex>.<anything>`.
    InvalidIpvFuture,
    /// A bracketed host is an IPv4 address.
    Ipv4InBrackets,
    /// A bracketed host is neither an IPv6 nor an IPv4 address.
    NotAnIpAddress {
        /// The text between the brackets.
        host: &'a str,
    },
    /// The URL holds a character that Python's `urlparse` silently deletes (a tab, CR or
    /// LF anywhere, or a C0 control or space at the start); we refuse to guess.
    RemovedCharacter {
        /// Byte offset of the character in the URL.
        index: usize,
        /// The character.
        character: char,
    },
}

impl fmt::Display for UrlError<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidIpv6 => f.write_str("Invalid IPv6 URL"),
            Self::InvalidIpvFuture => f.write_str("IPvFuture address is invalid"),
            Self::Ipv4InBrackets => f.write_str("An IPv4 address cannot be in brackets"),
            Self::NotAnIpAddress { host } => write!(
                f,
                "{} does not appear to be an IPv4 or IPv6 address",
                PyRepr(host)
            ),
            Self::RemovedCharacter { index, character } => {
                let mut buf = [0u8; 4];
                write!(
                    f,
                    "URL has {} at byte {index}, which Python's urlparse would silently \
                     remove; remove it from the URL",
                    PyRepr(character.encode_utf8(&mut buf))
                )
            }
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for UrlError<'_> {}

/// Why the port of a URL is not usable, as Python's `ParseResult.port` reports it.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortError<'a> {
    /// The port is not made of ASCII digits only.
    NotAnInteger {
        /// The port text after the `:`.
        port: &'a str,
    },
    /// The port is a number above 65535.
    OutOfRange {
        /// The port text after the `:`.
        port: &'a str,
    },
}

impl fmt::Display for PortError<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotAnInteger { port } => write!(
                f,
                "Port could not be cast to integer value as {}",
                PyRepr(port)
            ),
            Self::OutOfRange { .. } => f.write_str("Port out of range 0-65535"),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for PortError<'_> {}

/// A borrowed string that reads as its lowercase form, as Python's `str.lower()` would
/// give it, without copying: the scheme of a URL and its hostname (lowercased up to a
/// `%zone`).
///
/// `Display`, [`chars`](Self::chars) and the comparisons with `str` use the lowercase
/// form; [`as_written`](Self::as_written) gives the original text. Non-ASCII letters are
/// lowercased one character at a time (`char::to_lowercase`), so a final capital sigma
/// becomes `σ` where Python's `str.lower()` gives `ς`.
#[derive(Debug, Clone, Copy)]
pub struct LowercaseStr<'a> {
    raw: &'a str,
    /// Bytes of `raw` before this offset are lowercased; the rest is kept as is.
    fold_end: usize,
}

impl<'a> LowercaseStr<'a> {
    /// All of `raw`, lowercased.
    pub fn new(raw: &'a str) -> Self {
        Self {
            raw,
            fold_end: raw.len(),
        }
    }

    /// `raw`, shown exactly as written.
    pub(crate) fn verbatim(raw: &'a str) -> Self {
        Self { raw, fold_end: 0 }
    }

    /// A hostname: lowercased up to the first `%` (the IPv6 zone keeps its case).
    fn hostname(raw: &'a str) -> Self {
        Self {
            raw,
            fold_end: raw.find('%').unwrap_or(raw.len()),
        }
    }

    /// The text as written in the URL.
    pub fn as_written(&self) -> &'a str {
        self.raw
    }

    /// Whether the string is empty.
    pub fn is_empty(&self) -> bool {
        self.raw.is_empty()
    }

    fn split(&self) -> (&'a str, &'a str) {
        self.raw.split_at(self.fold_end)
    }

    /// The characters of the lowercase form.
    pub fn chars(&self) -> impl Iterator<Item = char> + 'a {
        let (folded, kept) = self.split();
        folded
            .chars()
            .flat_map(char::to_lowercase)
            .chain(kept.chars())
    }

    /// The lowercase form as a borrowed `str`, when writing it needs no change.
    pub fn as_lowercase(&self) -> Option<&'a str> {
        let (folded, _) = self.split();
        let unchanged = folded.chars().all(|c| {
            let mut lower = c.to_lowercase();
            lower.next() == Some(c) && lower.next().is_none()
        });
        unchanged.then_some(self.raw)
    }
}

impl PartialEq for LowercaseStr<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.chars().eq(other.chars())
    }
}

impl Eq for LowercaseStr<'_> {}

impl PartialEq<str> for LowercaseStr<'_> {
    fn eq(&self, other: &str) -> bool {
        self.chars().eq(other.chars())
    }
}

impl PartialEq<&str> for LowercaseStr<'_> {
    fn eq(&self, other: &&str) -> bool {
        self.chars().eq(other.chars())
    }
}

impl fmt::Display for LowercaseStr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(text) = self.as_lowercase() {
            return f.write_str(text);
        }
        self.chars().try_for_each(|c| f.write_char(c))
    }
}

/// A URL split into the parts of Python's `urlparse` result, borrowing from the input.
///
/// Accessors return `""` for an absent part, as Python does; `Display` writes the URL
/// back exactly as it was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RendezvousUrl<'a> {
    url: &'a str,
    scheme: Option<&'a str>,
    netloc: Option<&'a str>,
    path: &'a str,
    params: Option<&'a str>,
    query: Option<&'a str>,
    fragment: Option<&'a str>,
}

fn is_scheme_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'+' | b'-' | b'.')
}

/// Python's `_check_bracketed_host`: IPvFuture or an IPv6 address (with zone).
fn check_bracketed_host(host: &str) -> Result<(), UrlError<'_>> {
    if let Some(future) = host.strip_prefix('v') {
        // `\Av[a-fA-F0-9]+\..+\Z`
        let hex = future.bytes().take_while(u8::is_ascii_hexdigit).count();
        let rest = future.get(hex..).unwrap_or("");
        return match rest.strip_prefix('.') {
            Some(tail) if hex > 0 && !tail.is_empty() => Ok(()),
            _ => Err(UrlError::InvalidIpvFuture),
        };
    }
    if Ipv4Addr::from_str(host).is_ok() {
        return Err(UrlError::Ipv4InBrackets);
    }
    // `ipaddress.IPv6Address`: an optional `%scope` that is non-empty and has no `%`.
    let address = match host.split_once('%') {
        Some((address, scope)) if !scope.is_empty() && !scope.contains('%') => address,
        Some(_) => return Err(UrlError::NotAnIpAddress { host }),
        None => host,
    };
    match Ipv6Addr::from_str(address) {
        Ok(_) => Ok(()),
        Err(_) => Err(UrlError::NotAnIpAddress { host }),
    }
}

impl<'a> RendezvousUrl<'a> {
    /// Splits `url` into parts the way Python's `urlparse(url)` does.
    ///
    /// # Errors
    /// [`UrlError`] where `urlparse` raises `ValueError` (bracket and IP checks), and for
    /// text `urlparse` would silently delete (see the module docs).
    pub fn parse(url: &'a str) -> Result<Self, UrlError<'a>> {
        if let Some(first) = url.chars().next() {
            if first <= ' ' {
                return Err(UrlError::RemovedCharacter {
                    index: 0,
                    character: first,
                });
            }
        }
        if let Some(index) = url.find(['\t', '\r', '\n']) {
            let character = url.get(index..).and_then(|s| s.chars().next());
            return Err(UrlError::RemovedCharacter {
                index,
                character: character.unwrap_or('\n'),
            });
        }

        let mut rest = url;
        let mut scheme = None;
        if let Some((candidate, after)) = rest.split_once(':') {
            let bytes = candidate.as_bytes();
            if bytes.first().is_some_and(u8::is_ascii_alphabetic)
                && bytes.iter().copied().all(is_scheme_byte)
            {
                scheme = Some(candidate);
                rest = after;
            }
        }

        let mut netloc = None;
        if let Some(after) = rest.strip_prefix("//") {
            let end = after.find(['/', '?', '#']).unwrap_or(after.len());
            let (found, tail) = after.split_at(end);
            let open = found.contains('[');
            let close = found.contains(']');
            if open != close {
                return Err(UrlError::InvalidIpv6);
            }
            if open {
                let bracketed = found.split_once('[').map_or("", |(_, b)| b);
                let host = bracketed.split_once(']').map_or(bracketed, |(h, _)| h);
                check_bracketed_host(host)?;
            }
            netloc = Some(found);
            rest = tail;
        }

        let mut fragment = None;
        if let Some((before, after)) = rest.split_once('#') {
            fragment = Some(after);
            rest = before;
        }
        let mut query = None;
        if let Some((before, after)) = rest.split_once('?') {
            query = Some(after);
            rest = before;
        }

        let mut path = rest;
        let mut params = None;
        let scheme_uses_params = USES_PARAMS
            .iter()
            .any(|known| LowercaseStr::new(scheme.unwrap_or("")) == *known);
        if scheme_uses_params {
            // `_splitparams`: the first `;` after the last `/` (or anywhere without `/`).
            let search_from = path.rfind('/').unwrap_or(0);
            if let Some(offset) = path.get(search_from..).and_then(|s| s.find(';')) {
                let at = search_from + offset;
                params = path.get(at + 1..);
                path = path.get(..at).unwrap_or(path);
            }
        }

        Ok(Self {
            url,
            scheme,
            netloc,
            path,
            params,
            query,
            fragment,
        })
    }

    /// The URL as given to [`parse`](Self::parse).
    pub fn as_str(&self) -> &'a str {
        self.url
    }

    /// The scheme, which reads lowercase as in Python (`TCP://h` has scheme `tcp`);
    /// empty when the URL has none.
    pub fn scheme(&self) -> LowercaseStr<'a> {
        LowercaseStr::new(self.scheme.unwrap_or(""))
    }

    /// The network location (`user:password@host:port`), `""` without a `//`.
    pub fn netloc(&self) -> &'a str {
        self.netloc.unwrap_or("")
    }

    /// The path, without `;params`.
    pub fn path(&self) -> &'a str {
        self.path
    }

    /// The `;params` of the last path segment (only for Python's `uses_params` schemes).
    pub fn params(&self) -> &'a str {
        self.params.unwrap_or("")
    }

    /// The query, without the `?`.
    pub fn query(&self) -> &'a str {
        self.query.unwrap_or("")
    }

    /// The fragment, without the `#`.
    pub fn fragment(&self) -> &'a str {
        self.fragment.unwrap_or("")
    }

    /// `user:password@host` (the part after the last `@` of the netloc), as `_hostinfo`.
    fn host_and_port(&self) -> (&'a str, Option<&'a str>) {
        let netloc = self.netloc();
        let hostinfo = netloc.rsplit_once('@').map_or(netloc, |(_, h)| h);
        let (hostname, port) = match hostinfo.split_once('[') {
            Some((_, bracketed)) => {
                let (hostname, after) = bracketed.split_once(']').unwrap_or((bracketed, ""));
                (hostname, after.split_once(':').map_or("", |(_, p)| p))
            }
            None => hostinfo.split_once(':').unwrap_or((hostinfo, "")),
        };
        (hostname, (!port.is_empty()).then_some(port))
    }

    /// The user name: the text before the last `@` of the netloc, up to the first `:`.
    pub fn username(&self) -> Option<&'a str> {
        let (userinfo, _) = self.netloc().rsplit_once('@')?;
        Some(userinfo.split_once(':').map_or(userinfo, |(user, _)| user))
    }

    /// The password: after the first `:` of the text before the last `@`.
    pub fn password(&self) -> Option<&'a str> {
        let (userinfo, _) = self.netloc().rsplit_once('@')?;
        userinfo.split_once(':').map(|(_, password)| password)
    }

    /// The host without brackets, reading lowercase (an IPv6 `%zone` keeps its case);
    /// `None` when empty, as Python's `hostname`.
    pub fn hostname(&self) -> Option<LowercaseStr<'a>> {
        let (hostname, _) = self.host_and_port();
        (!hostname.is_empty()).then(|| LowercaseStr::hostname(hostname))
    }

    /// The port text after the host's `:`, unchecked; `None` when absent or empty.
    pub fn port_text(&self) -> Option<&'a str> {
        self.host_and_port().1
    }

    /// The port, checked as Python's `port` property does: `Ok(None)` without one.
    ///
    /// # Errors
    /// [`PortError::NotAnInteger`] unless the port is ASCII digits only (no sign, no
    /// spaces), [`PortError::OutOfRange`] above 65535.
    pub fn port(&self) -> Result<Option<u16>, PortError<'a>> {
        let Some(port) = self.port_text() else {
            return Ok(None);
        };
        if !port.bytes().all(|b| b.is_ascii_digit()) {
            return Err(PortError::NotAnInteger { port });
        }
        let mut value: u32 = 0;
        for digit in port.bytes() {
            value = value
                .saturating_mul(10)
                .saturating_add(u32::from(digit - b'0'));
        }
        u16::try_from(value)
            .map(Some)
            .map_err(|_| PortError::OutOfRange { port })
    }

    /// Writes the URL with its query replaced by `query` (a `?` is added when the URL had
    /// none); every other part is written as it was given.
    pub(crate) fn write_with_query<W: Write + ?Sized>(
        &self,
        out: &mut W,
        query: Option<&dyn fmt::Display>,
    ) -> fmt::Result {
        if let Some(scheme) = self.scheme {
            out.write_str(scheme)?;
            out.write_char(':')?;
        }
        if let Some(netloc) = self.netloc {
            out.write_str("//")?;
            out.write_str(netloc)?;
        }
        out.write_str(self.path)?;
        if let Some(params) = self.params {
            out.write_char(';')?;
            out.write_str(params)?;
        }
        if let Some(query) = query {
            write!(out, "?{query}")?;
        }
        if let Some(fragment) = self.fragment {
            out.write_char('#')?;
            out.write_str(fragment)?;
        }
        Ok(())
    }
}

impl fmt::Display for RendezvousUrl<'_> {
    /// Unparses: writes the parts back, which gives the URL exactly as parsed.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.query {
            Some(query) => self.write_with_query(f, Some(query)),
            None => self.write_with_query(f, None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::string::{String, ToString};

    /// One row of vectors printed by CPython 3.11.7:
    /// `(url, scheme, netloc, path, params, query, fragment, username, password,
    ///   hostname, port)` where the port column is the value or Python's error text.
    type Row = (
        &'static str,
        &'static str,
        &'static str,
        &'static str,
        &'static str,
        &'static str,
        &'static str,
        Option<&'static str>,
        Option<&'static str>,
        Option<&'static str>,
        Result<Option<u16>, &'static str>,
    );

    #[rustfmt::skip]
    const CPYTHON: &[Row] = &[
        ("tcp://127.0.0.1:29500?rank=0&world_size=2", "tcp", "127.0.0.1:29500", "", "", "rank=0&world_size=2", "", None, None, Some("127.0.0.1"), Ok(Some(29500))),
        ("env://", "env", "", "", "", "", "", None, None, None, Ok(None)),
        ("env://?rank=1", "env", "", "", "", "rank=1", "", None, None, None, Ok(None)),
        ("env:", "env", "", "", "", "", "", None, None, None, Ok(None)),
        ("file:///tmp/x?rank=1&world_size=2", "file", "", "/tmp/x", "", "rank=1&world_size=2", "", None, None, None, Ok(None)),
        ("file://tmp/x", "file", "tmp", "/x", "", "", "", None, None, Some("tmp"), Ok(None)),
        ("file:", "file", "", "", "", "", "", None, None, None, Ok(None)),
        ("file:/tmp/x", "file", "", "/tmp/x", "", "", "", None, None, None, Ok(None)),
        ("tcp://[::1]:23456", "tcp", "[::1]:23456", "", "", "", "", None, None, Some("::1"), Ok(Some(23456))),
        ("tcp://[::1]", "tcp", "[::1]", "", "", "", "", None, None, Some("::1"), Ok(None)),
        ("tcp://[FE80::1%Eth0]:1", "tcp", "[FE80::1%Eth0]:1", "", "", "", "", None, None, Some("fe80::1%Eth0"), Ok(Some(1))),
        ("tcp://[::ffff:1.2.3.4]:5", "tcp", "[::ffff:1.2.3.4]:5", "", "", "", "", None, None, Some("::ffff:1.2.3.4"), Ok(Some(5))),
        ("tcp://[v1F.anything]:7", "tcp", "[v1F.anything]:7", "", "", "", "", None, None, Some("v1f.anything"), Ok(Some(7))),
        ("TCP://HoSt:1", "tcp", "HoSt:1", "", "", "", "", None, None, Some("host"), Ok(Some(1))),
        ("tcp://h:abc", "tcp", "h:abc", "", "", "", "", None, None, Some("h"), Err("Port could not be cast to integer value as 'abc'")),
        ("tcp://h:70000", "tcp", "h:70000", "", "", "", "", None, None, Some("h"), Err("Port out of range 0-65535")),
        ("tcp://h:+1", "tcp", "h:+1", "", "", "", "", None, None, Some("h"), Err("Port could not be cast to integer value as '+1'")),
        ("tcp://h:-1", "tcp", "h:-1", "", "", "", "", None, None, Some("h"), Err("Port could not be cast to integer value as '-1'")),
        ("tcp://h: 1", "tcp", "h: 1", "", "", "", "", None, None, Some("h"), Err("Port could not be cast to integer value as ' 1'")),
        ("tcp://h:", "tcp", "h:", "", "", "", "", None, None, Some("h"), Ok(None)),
        ("tcp://h:0", "tcp", "h:0", "", "", "", "", None, None, Some("h"), Ok(Some(0))),
        ("tcp://:23456?rank=0", "tcp", ":23456", "", "", "rank=0", "", None, None, None, Ok(Some(23456))),
        ("tcp://user:pw@Host:80/p", "tcp", "user:pw@Host:80", "/p", "", "", "", Some("user"), Some("pw"), Some("host"), Ok(Some(80))),
        ("tcp://user@host", "tcp", "user@host", "", "", "", "", Some("user"), None, Some("host"), Ok(None)),
        ("tcp://a:b:c@h:1", "tcp", "a:b:c@h:1", "", "", "", "", Some("a"), Some("b:c"), Some("h"), Ok(Some(1))),
        ("tcp://u@v@h:2", "tcp", "u@v@h:2", "", "", "", "", Some("u@v"), None, Some("h"), Ok(Some(2))),
        ("tcp://h:1#frag?x", "tcp", "h:1", "", "", "", "frag?x", None, None, Some("h"), Ok(Some(1))),
        ("tcp://h:1/path;p?q#f", "tcp", "h:1", "/path;p", "", "q", "f", None, None, Some("h"), Ok(Some(1))),
        ("http://a/b;c?d#e", "http", "a", "/b", "c", "d", "e", None, None, Some("a"), Ok(None)),
        ("http://a/b/c;d;e", "http", "a", "/b/c", "d;e", "", "", None, None, Some("a"), Ok(None)),
        ("http://a/b;c/d", "http", "a", "/b;c/d", "", "", "", None, None, Some("a"), Ok(None)),
        (";x", "", "", "", "x", "", "", None, None, None, Ok(None)),
        ("a;b/c;d", "", "", "a;b/c", "d", "", "", None, None, None, Ok(None)),
        ("http://a/b;", "http", "a", "/b", "", "", "", None, None, Some("a"), Ok(None)),
        ("path/only", "", "", "path/only", "", "", "", None, None, None, Ok(None)),
        ("localhost:80", "localhost", "", "80", "", "", "", None, None, None, Ok(None)),
        ("1abc:def", "", "", "1abc:def", "", "", "", None, None, None, Ok(None)),
        ("a+b-c.d:x", "a+b-c.d", "", "x", "", "", "", None, None, None, Ok(None)),
        ("ab_c:x", "", "", "ab_c:x", "", "", "", None, None, None, Ok(None)),
        ("//netloc/path", "", "netloc", "/path", "", "", "", None, None, Some("netloc"), Ok(None)),
        ("///x", "", "", "/x", "", "", "", None, None, None, Ok(None)),
        ("", "", "", "", "", "", "", None, None, None, Ok(None)),
        ("?", "", "", "", "", "", "", None, None, None, Ok(None)),
        ("#", "", "", "", "", "", "", None, None, None, Ok(None)),
        ("tcp://h:1?", "tcp", "h:1", "", "", "", "", None, None, Some("h"), Ok(Some(1))),
        ("tcp://h:1#", "tcp", "h:1", "", "", "", "", None, None, Some("h"), Ok(Some(1))),
        ("tcp://h?a=b=c", "tcp", "h", "", "", "a=b=c", "", None, None, Some("h"), Ok(None)),
        ("tcp://[::1]x:80", "tcp", "[::1]x:80", "", "", "", "", None, None, Some("::1"), Ok(Some(80))),
        ("tcp://[::1]abc", "tcp", "[::1]abc", "", "", "", "", None, None, Some("::1"), Ok(None)),
        ("tcp://a[::1]:9", "tcp", "a[::1]:9", "", "", "", "", None, None, Some("::1"), Ok(Some(9))),
        ("tcp://h:\u{ff11}", "tcp", "h:\u{ff11}", "", "", "", "", None, None, Some("h"), Err("Port could not be cast to integer value as '\u{ff11}'")),
        ("tcp://\u{e9}.EXAMPLE:1", "tcp", "\u{e9}.EXAMPLE:1", "", "", "", "", None, None, Some("\u{e9}.example"), Ok(Some(1))),
        ("mailto:x@y", "mailto", "", "x@y", "", "", "", None, None, None, Ok(None)),
        ("tcp:/x", "tcp", "", "/x", "", "", "", None, None, None, Ok(None)),
        ("tcp:x", "tcp", "", "x", "", "", "", None, None, None, Ok(None)),
        ("tcp://h/p?q?r#s#t", "tcp", "h", "/p", "", "q?r", "s#t", None, None, Some("h"), Ok(None)),
        ("tcp://h:8080:9090", "tcp", "h:8080:9090", "", "", "", "", None, None, Some("h"), Err("Port could not be cast to integer value as '8080:9090'")),
        ("tcp://[::1]:8080:9", "tcp", "[::1]:8080:9", "", "", "", "", None, None, Some("::1"), Err("Port could not be cast to integer value as '8080:9'")),
        ("Tcp://H", "tcp", "H", "", "", "", "", None, None, Some("h"), Ok(None)),
        ("tcp://[1:2:3:4:5:6:7::]:1", "tcp", "[1:2:3:4:5:6:7::]:1", "", "", "", "", None, None, Some("1:2:3:4:5:6:7::"), Ok(Some(1))),
        ("tcp://[::]:1", "tcp", "[::]:1", "", "", "", "", None, None, Some("::"), Ok(Some(1))),
        ("tcp://[1::2:3:4:5:6:7]", "tcp", "[1::2:3:4:5:6:7]", "", "", "", "", None, None, Some("1::2:3:4:5:6:7"), Ok(None)),
        ("tcp://[vAF.:]:1", "tcp", "[vAF.:]:1", "", "", "", "", None, None, Some("vaf.:"), Ok(Some(1))),
        ("tcp://%41:1", "tcp", "%41:1", "", "", "", "", None, None, Some("%41"), Ok(Some(1))),
        ("tcp://h:1?world_size=2&rank=0&use_libuv=0", "tcp", "h:1", "", "", "world_size=2&rank=0&use_libuv=0", "", None, None, Some("h"), Ok(Some(1))),

    ];

    #[test]
    fn matches_cpython_vectors() {
        for (url, scheme, netloc, path, params, query, fragment, user, password, host, port) in
            CPYTHON.iter().copied()
        {
            let parsed = RendezvousUrl::parse(url).unwrap_or_else(|e| panic!("{url:?}: {e}"));
            assert_eq!(parsed.scheme().to_string(), scheme, "scheme of {url:?}");
            assert_eq!(parsed.netloc(), netloc, "netloc of {url:?}");
            assert_eq!(parsed.path(), path, "path of {url:?}");
            assert_eq!(parsed.params(), params, "params of {url:?}");
            assert_eq!(parsed.query(), query, "query of {url:?}");
            assert_eq!(parsed.fragment(), fragment, "fragment of {url:?}");
            assert_eq!(parsed.username(), user, "username of {url:?}");
            assert_eq!(parsed.password(), password, "password of {url:?}");
            assert_eq!(
                parsed.hostname().map(|h| h.to_string()).as_deref(),
                host,
                "hostname of {url:?}"
            );
            let got_port = parsed.port().map_err(|e| e.to_string());
            assert_eq!(
                got_port,
                port.map_err(ToString::to_string),
                "port of {url:?}"
            );
            assert_eq!(parsed.to_string(), url, "round trip of {url:?}");
        }
    }

    #[test]
    fn rejects_what_cpython_rejects() {
        // (url, CPython 3.11.7's ValueError text)
        let cases = [
            ("tcp://[::1", "Invalid IPv6 URL"),
            ("tcp://::1]:80", "Invalid IPv6 URL"),
            (
                "tcp://[1.2.3.4]:80",
                "An IPv4 address cannot be in brackets",
            ),
            ("tcp://[vz.x]", "IPvFuture address is invalid"),
            ("tcp://[v1.]", "IPvFuture address is invalid"),
            ("tcp://[v.x]", "IPvFuture address is invalid"),
            (
                "tcp://[::1%]:80",
                "'::1%' does not appear to be an IPv4 or IPv6 address",
            ),
            (
                "tcp://[::1%a%b]",
                "'::1%a%b' does not appear to be an IPv4 or IPv6 address",
            ),
            (
                "tcp://[host]:80",
                "'host' does not appear to be an IPv4 or IPv6 address",
            ),
            (
                "tcp://[]:80",
                "'' does not appear to be an IPv4 or IPv6 address",
            ),
            (
                "tcp://u[x]@h",
                "'x' does not appear to be an IPv4 or IPv6 address",
            ),
            (
                "tcp://[1:2:3:4:5:6:7:8:9]",
                "'1:2:3:4:5:6:7:8:9' does not appear to be an IPv4 or IPv6 address",
            ),
        ];
        for (url, message) in cases {
            let err = RendezvousUrl::parse(url).expect_err(url);
            assert_eq!(err.to_string(), message, "{url:?}");
        }
    }

    #[test]
    fn rejects_text_python_would_silently_rewrite() {
        for (url, index, character) in [
            (" tcp://h:1", 0, ' '),
            ("\u{0}tcp://h:1", 0, '\u{0}'),
            ("tcp://h:1\n", 9, '\n'),
            ("tcp://h\t:1", 7, '\t'),
            ("tcp://h:1?a=\rb", 12, '\r'),
        ] {
            assert_eq!(
                RendezvousUrl::parse(url),
                Err(UrlError::RemovedCharacter { index, character }),
                "{url:?}"
            );
        }
        assert_eq!(
            RendezvousUrl::parse("tcp://h:1\n")
                .map_err(|e| e.to_string())
                .expect_err("newline"),
            "URL has '\\n' at byte 9, which Python's urlparse would silently remove; \
             remove it from the URL"
        );
    }

    #[test]
    fn port_errors_carry_python_text() {
        let port = |url| RendezvousUrl::parse(url).map(|u| u.port().map_err(|e| e.to_string()));
        assert_eq!(
            port("tcp://h:abc"),
            Ok(Err(
                "Port could not be cast to integer value as 'abc'".to_string()
            ))
        );
        assert_eq!(
            port("tcp://h:70000"),
            Ok(Err("Port out of range 0-65535".to_string()))
        );
        assert_eq!(
            port("tcp://h:99999999999999999999999"),
            Ok(Err("Port out of range 0-65535".to_string()))
        );
        assert_eq!(port("tcp://h:65535"), Ok(Ok(Some(65535))));
        assert_eq!(port("tcp://h:00080"), Ok(Ok(Some(80))));
        assert_eq!(port("tcp://h:"), Ok(Ok(None)));
    }

    #[test]
    fn lowercase_views() {
        let url = RendezvousUrl::parse("TCP://HoSt.Example:1").expect("valid");
        assert!(url.scheme() == "tcp");
        assert!(url.scheme() != "TCP");
        assert_eq!(url.scheme().as_written(), "TCP");
        assert_eq!(url.scheme().as_lowercase(), None);
        let host = url.hostname().expect("host");
        assert_eq!(host.to_string(), "host.example");
        assert_eq!(host.as_written(), "HoSt.Example");
        let zoned = RendezvousUrl::parse("tcp://[FE80::1%Eth0]:1").expect("valid");
        assert_eq!(
            zoned.hostname().map(|h| h.to_string()).as_deref(),
            Some("fe80::1%Eth0")
        );
        let plain = RendezvousUrl::parse("tcp://h:1").expect("valid");
        assert_eq!(plain.scheme().as_lowercase(), Some("tcp"));
    }

    #[test]
    fn replacing_the_query_keeps_everything_else() {
        let url = RendezvousUrl::parse("Env://#frag").expect("valid");
        let mut out = String::new();
        url.write_with_query(&mut out, Some(&"rank=0"))
            .expect("write");
        assert_eq!(out, "Env://?rank=0#frag");
    }

    /// Strings over the characters that matter to the splitter.
    fn url_like() -> impl Strategy<Value = String> {
        proptest::string::string_regex(
            "[a-zA-Z0-9+.:/?#@;\\[\\]%&=_ é-]{0,40}|[a-z]{1,5}://[a-zA-Z0-9.:@\\[\\]]{0,20}[/?#]?[a-z0-9=&;/?#]{0,20}",
        )
        .expect("regex")
    }

    proptest! {
        #[test]
        fn parse_then_unparse_is_identity(url in url_like()) {
            if let Ok(parsed) = RendezvousUrl::parse(&url) {
                prop_assert_eq!(parsed.to_string(), url.clone());
                // Every part is a slice of the input.
                let start = url.as_ptr() as usize;
                let end = start + url.len();
                for part in [parsed.netloc(), parsed.path(), parsed.params(), parsed.query(), parsed.fragment()] {
                    if !part.is_empty() {
                        let at = part.as_ptr() as usize;
                        prop_assert!(at >= start && at + part.len() <= end);
                    }
                }
                let _ = parsed.port();
                let _ = parsed.hostname().map(|h| h.to_string());
            }
        }
    }
}
