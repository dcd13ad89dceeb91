//! `_rendezvous_helper`'s URL rewriting: putting the caller's rank and world size into the
//! query string before a handler sees the URL.
//!
//! The rules, exactly as PyTorch's:
//! - When the caller gives a world size (even "none", `-1`), it is used as given. When it
//!   gives no world-size argument at all (`world_size_opt=None`, the path
//!   `_create_store_from_options` takes), the world size starts as `-1` and, for `env://`
//!   only, `RANK` (if set) replaces the rank and `WORLD_SIZE` (if set) the world size.
//! - The URL is rewritten when the rank is not `-1`, or the world size is not `-1`, or no
//!   world-size argument was given. Then the query must not already hold `rank` or
//!   `world_size` ("The url: {url} has node-specific arguments(rank, world_size)
//!   already."), `rank=R` is added unless the rank is `-1`, and `world_size=W` is added
//!   unless it is `-1` *and* a world-size argument was given (so `world_size=-1` is written
//!   when none was given and none was found).
//! - The new query is the query dictionary joined again: duplicate keys collapse to one
//!   entry at the first position with the last value, and empty pieces disappear.
//!
//! This module writes the new URL lazily (it implements `Display`), so it needs no heap.
//! It keeps every other part of the URL as written, where Python's `urlunparse` would
//! also respell it (`env://` as `env:`); the handler parses both the same way. It does
//! not look up a handler (see [`super::FixedHandlerRegistry`]) nor check the values a
//! handler will read from the query (see the plans).

use core::fmt::{self, Write};

use crate::env::Env;
use crate::query::{QueryError, QueryView};
use crate::rendezvous::python::{InvalidIntLiteral, PyInt};
use crate::url::{RendezvousUrl, UrlError};

/// The rank and world size the caller passes along with the URL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NodeParams {
    /// `rendezvous(url, rank, world_size)`: `None` is Python's `-1`, "not given".
    Given {
        /// This process's rank, if known.
        rank: Option<u32>,
        /// The number of processes, if known.
        world_size: Option<u32>,
    },
    /// `_rendezvous_helper(url, rank, None)`, as `_create_store_from_options` calls it:
    /// no world-size argument; for `env://` the rank and world size come from `RANK` and
    /// `WORLD_SIZE` when set, and a `world_size` is always written.
    Inferred {
        /// This process's rank, if known (`RANK` overrides it for `env://`).
        rank: Option<u32>,
    },
}

impl NodeParams {
    /// The parameters for Python-style integers: any negative value means "not given"
    /// (Python itself only treats `-1` so), and `world_size: None` is
    /// [`NodeParams::Inferred`]. Values above `u32::MAX` are also "not given".
    pub fn from_python(rank: i64, world_size: Option<i64>) -> Self {
        let given = |value: i64| u32::try_from(value).ok();
        match world_size {
            Some(world_size) => Self::Given {
                rank: given(rank),
                world_size: given(world_size),
            },
            None => Self::Inferred { rank: given(rank) },
        }
    }
}

/// Why a URL could not be rewritten.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RewriteError<'a> {
    /// The URL does not parse (Python's `urlparse` raises).
    Url(UrlError<'a>),
    /// A query piece is not `key=value` (PyTorch crashes with an unpacking error).
    Query(QueryError<'a>),
    /// The query already holds `rank` or `world_size`.
    NodeParamsPresent {
        /// The URL as given.
        url: &'a str,
    },
    /// `RANK` or `WORLD_SIZE` is set to something `int()` rejects.
    EnvNotAnInteger {
        /// The variable's name.
        var: &'static str,
        /// Its value.
        value: &'a str,
    },
}

impl fmt::Display for RewriteError<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Url(error) => error.fmt(f),
            Self::Query(error) => error.fmt(f),
            Self::NodeParamsPresent { url } => write!(
                f,
                "The url: {url} has node-specific arguments(rank, world_size) already."
            ),
            Self::EnvNotAnInteger { var, value } => {
                write!(
                    f,
                    "environment variable {var}: {}",
                    InvalidIntLiteral(value)
                )
            }
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for RewriteError<'_> {}

impl<'a> From<UrlError<'a>> for RewriteError<'a> {
    fn from(error: UrlError<'a>) -> Self {
        Self::Url(error)
    }
}

impl<'a> From<QueryError<'a>> for RewriteError<'a> {
    fn from(error: QueryError<'a>) -> Self {
        Self::Query(error)
    }
}

/// A rank or world size on its way into the query: Python's `-1`, a typed value, or an
/// integer read from the environment (written as `str(int(text))`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NodeValue<'a> {
    MinusOne,
    Value(u32),
    Text(PyInt<'a>),
}

impl<'a> NodeValue<'a> {
    fn from_option(value: Option<u32>) -> Self {
        value.map_or(Self::MinusOne, Self::Value)
    }

    /// `int(os.environ.get(var, default))`.
    fn from_env<E: Env + ?Sized>(
        env: &'a E,
        var: &'static str,
        default: Self,
    ) -> Result<Self, RewriteError<'a>> {
        let Some(value) = env.var(var) else {
            return Ok(default);
        };
        let parsed = PyInt::parse(value).ok_or(RewriteError::EnvNotAnInteger { var, value })?;
        Ok(if parsed.is_minus_one() {
            Self::MinusOne
        } else {
            Self::Text(parsed)
        })
    }

    fn is_minus_one(&self) -> bool {
        matches!(self, Self::MinusOne)
    }
}

impl fmt::Display for NodeValue<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MinusOne => f.write_str("-1"),
            Self::Value(value) => value.fmt(f),
            Self::Text(value) => value.fmt(f),
        }
    }
}

/// The new query: the old entries, then `rank` and `world_size` where they are due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct NodeQuery<'a> {
    entries: QueryView<'a>,
    rank: Option<NodeValue<'a>>,
    world_size: Option<NodeValue<'a>>,
}

impl fmt::Display for NodeQuery<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = self.entries.is_empty();
        self.entries.fmt(f)?;
        for (key, value) in [("rank", self.rank), ("world_size", self.world_size)] {
            if let Some(value) = value {
                if !first {
                    f.write_char('&')?;
                }
                first = false;
                write!(f, "{key}={value}")?;
            }
        }
        Ok(())
    }
}

/// The URL a handler receives: the original, or the original with a new query.
///
/// It is written lazily through `Display` (`to_string()` with `alloc`, `write!` into a
/// fixed buffer without); [`len`](Self::len) says how many bytes that takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RewrittenUrl<'a> {
    url: RendezvousUrl<'a>,
    query: Option<NodeQuery<'a>>,
}

impl<'a> RewrittenUrl<'a> {
    /// Whether the URL is passed on unchanged.
    pub fn is_unchanged(&self) -> bool {
        self.query.is_none()
    }

    /// The URL as given, before rewriting.
    pub fn original(&self) -> RendezvousUrl<'a> {
        self.url
    }

    /// The length in bytes of the rewritten URL.
    pub fn len(&self) -> usize {
        struct Count(usize);
        impl Write for Count {
            fn write_str(&mut self, s: &str) -> fmt::Result {
                self.0 += s.len();
                Ok(())
            }
        }
        let mut count = Count(0);
        // Count never fails, and neither do the Display impls it drives.
        let _ = write!(count, "{self}");
        count.0
    }

    /// Whether the rewritten URL is empty (only when the original is).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl fmt::Display for RewrittenUrl<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.query {
            None => f.write_str(self.url.as_str()),
            Some(query) => self.url.write_with_query(f, Some(query)),
        }
    }
}

/// `_rendezvous_helper`'s rewriting of `url` with the caller's `params` (see the module
/// docs for the rules); `env` supplies `RANK` and `WORLD_SIZE` for `env://`.
///
/// # Errors
/// [`RewriteError`]: the URL does not parse, `RANK`/`WORLD_SIZE` is not an integer, or,
/// when the URL is to be rewritten, a query piece is malformed or the query already names
/// `rank` or `world_size`.
pub fn rewrite_with_node_params<'a, E: Env + ?Sized>(
    url: &'a str,
    params: NodeParams,
    env: &'a E,
) -> Result<RewrittenUrl<'a>, RewriteError<'a>> {
    let parsed = RendezvousUrl::parse(url)?;
    let (rank, world_size, inferred) = match params {
        NodeParams::Given { rank, world_size } => (
            NodeValue::from_option(rank),
            NodeValue::from_option(world_size),
            false,
        ),
        NodeParams::Inferred { rank } => {
            let rank = NodeValue::from_option(rank);
            if parsed.scheme() == "env" {
                let rank = NodeValue::from_env(env, "RANK", rank)?;
                let world_size = NodeValue::from_env(env, "WORLD_SIZE", NodeValue::MinusOne)?;
                (rank, world_size, true)
            } else {
                (rank, NodeValue::MinusOne, true)
            }
        }
    };

    if rank.is_minus_one() && world_size.is_minus_one() && !inferred {
        return Ok(RewrittenUrl {
            url: parsed,
            query: None,
        });
    }
    let entries = QueryView::parse(parsed.query())?;
    if entries.contains_key("rank") || entries.contains_key("world_size") {
        return Err(RewriteError::NodeParamsPresent { url });
    }
    let query = NodeQuery {
        entries,
        rank: (!rank.is_minus_one()).then_some(rank),
        world_size: (!world_size.is_minus_one() || inferred).then_some(world_size),
    };
    Ok(RewrittenUrl {
        url: parsed,
        query: Some(query),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::{EmptyEnv, MapEnv};
    use proptest::prelude::*;
    use std::string::{String, ToString};

    fn rewrite(url: &str, params: NodeParams, vars: &[(&str, &str)]) -> Result<String, String> {
        let env = MapEnv::new(vars);
        rewrite_with_node_params(url, params, &env)
            .map(|r| r.to_string())
            .map_err(|e| e.to_string())
    }

    const NONE: NodeParams = NodeParams::Given {
        rank: None,
        world_size: None,
    };

    fn given(rank: Option<u32>, world_size: Option<u32>) -> NodeParams {
        NodeParams::Given { rank, world_size }
    }

    #[test]
    fn adds_rank_and_world_size() {
        assert_eq!(
            rewrite("tcp://127.0.0.1:23456", given(Some(0), Some(2)), &[]),
            Ok("tcp://127.0.0.1:23456?rank=0&world_size=2".into())
        );
        assert_eq!(
            rewrite("tcp://h:1?b=2&a=1&b=3&&", given(Some(1), None), &[]),
            Ok("tcp://h:1?b=3&a=1&rank=1".into())
        );
        assert_eq!(
            rewrite("file:///tmp/f#frag", given(None, Some(4)), &[]),
            Ok("file:///tmp/f?world_size=4#frag".into())
        );
    }

    #[test]
    fn leaves_the_url_alone_without_node_params() {
        let env = EmptyEnv;
        // Even a malformed query is left for the handler to reject.
        let url = "tcp://h:1?rank=0&world_size=1&a=b=c";
        let rewritten = rewrite_with_node_params(url, NONE, &env).expect("untouched");
        assert!(rewritten.is_unchanged());
        assert_eq!(rewritten.to_string(), url);
        assert_eq!(rewritten.len(), url.len());
    }

    #[test]
    fn refuses_urls_with_node_params() {
        // RendezvousTest.test_url_with_node_params
        let url = "file:///tmp/x?rank=0";
        let expected = "The url: file:///tmp/x?rank=0 has node-specific arguments(rank, \
                        world_size) already.";
        assert_eq!(
            rewrite(url, given(Some(0), Some(1)), &[]),
            Err(expected.into())
        );
        assert_eq!(
            rewrite(
                "tcp://h:1?world_size=2",
                NodeParams::Inferred { rank: None },
                &[]
            ),
            Err(
                "The url: tcp://h:1?world_size=2 has node-specific arguments(rank, world_size) \
                 already."
                    .into()
            )
        );
        assert_eq!(
            rewrite("tcp://h:1?a=b=c", given(Some(0), None), &[]),
            Err(
                "malformed query parameter 'a=b=c': expected exactly one '=' between key and \
                 value"
                    .into()
            )
        );
    }

    #[test]
    fn inferred_params_read_env_for_env_scheme_only() {
        let vars = [("RANK", "3"), ("WORLD_SIZE", " 008 ")];
        let inferred = |rank| NodeParams::Inferred { rank };
        assert_eq!(
            rewrite("env://", inferred(Some(0)), &vars),
            Ok("env://?rank=3&world_size=8".into())
        );
        assert_eq!(
            rewrite("ENV://", inferred(Some(0)), &[]),
            Ok("ENV://?rank=0&world_size=-1".into())
        );
        assert_eq!(
            rewrite("env://", inferred(None), &[("RANK", "-1")]),
            Ok("env://?world_size=-1".into())
        );
        // tcp:// ignores RANK/WORLD_SIZE but always gets a world_size.
        assert_eq!(
            rewrite("tcp://h:1", inferred(Some(2)), &vars),
            Ok("tcp://h:1?rank=2&world_size=-1".into())
        );
        assert_eq!(
            rewrite("tcp://h:1", inferred(None), &vars),
            Ok("tcp://h:1?world_size=-1".into())
        );
        assert_eq!(
            rewrite("env://", inferred(None), &[("WORLD_SIZE", "two")]),
            Err(
                "environment variable WORLD_SIZE: invalid literal for int() with base 10: 'two'"
                    .into()
            )
        );
        // A given world size (even "none") bypasses the environment.
        assert_eq!(
            rewrite("env://", given(Some(1), None), &vars),
            Ok("env://?rank=1".into())
        );
    }

    #[test]
    fn python_style_integers() {
        assert_eq!(NodeParams::from_python(-1, Some(-1)), NONE);
        assert_eq!(NodeParams::from_python(-7, Some(4)), given(None, Some(4)));
        assert_eq!(
            NodeParams::from_python(2, None),
            NodeParams::Inferred { rank: Some(2) }
        );
        assert_eq!(
            NodeParams::from_python(i64::MAX, Some(1)),
            given(None, Some(1))
        );
    }

    #[test]
    fn writes_into_a_fixed_buffer() {
        let env = EmptyEnv;
        let rewritten =
            rewrite_with_node_params("tcp://h:1", given(Some(0), Some(1)), &env).expect("ok");
        let mut small: heapless::String<8> = heapless::String::new();
        assert!(write!(small, "{rewritten}").is_err());
        assert_eq!(rewritten.len(), "tcp://h:1?rank=0&world_size=1".len());
        let mut big: heapless::String<64> = heapless::String::new();
        write!(big, "{rewritten}").expect("fits");
        assert_eq!(big.as_str(), "tcp://h:1?rank=0&world_size=1");
    }

    proptest! {
        #[test]
        fn rewritten_urls_carry_exactly_the_given_params(
            host in "[a-z]{1,8}",
            port in 1u16..,
            extra in proptest::collection::vec(("[a-c]{1,2}", "[0-9]{0,2}"), 0..4),
            rank in proptest::option::of(0u32..64),
            world_size in proptest::option::of(1u32..64),
        ) {
            let query: std::vec::Vec<String> =
                extra.iter().map(|(k, v)| std::format!("{k}={v}")).collect();
            let url = std::format!("tcp://{host}:{port}?{}", query.join("&"));
            let env = EmptyEnv;
            let rewritten = rewrite_with_node_params(&url, given(rank, world_size), &env)
                .expect("valid");
            let text = rewritten.to_string();
            prop_assert_eq!(rewritten.len(), text.len());
            let parsed = RendezvousUrl::parse(&text).expect("reparses");
            prop_assert_eq!(parsed.netloc(), RendezvousUrl::parse(&url).expect("valid").netloc());
            let view = QueryView::parse(parsed.query()).expect("well-formed");
            let rank_text = rank.map(|r| r.to_string());
            let world_text = world_size.map(|w| w.to_string());
            prop_assert_eq!(view.get("rank"), rank_text.as_deref());
            prop_assert_eq!(view.get("world_size"), world_text.as_deref());
            for (k, _) in &extra {
                prop_assert!(view.contains_key(k));
            }
        }
    }
}
