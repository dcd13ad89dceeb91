//! How a rendezvous query string becomes key/value pairs, as PyTorch's
//! `_query_to_dict` does: split on `&`, drop empty pieces, split each piece on `=`, and a
//! later key wins while the key keeps its first position (a Python `dict`).
//!
//! PyTorch crashes with an unpacking or index error on a piece with no `=` (`a`) or with
//! more than one (`a=b=c`); here that is a [`QueryError`] naming the piece. Keys and
//! values are taken as written: nothing is percent-decoded, `+` stays `+`, an empty key
//! (`=v`) and an empty value (`k=`) are kept.
//!
//! Three views, from cheapest: [`pairs`] iterates over the pieces as written;
//! [`QueryView`] checks every piece once and answers dictionary questions without a
//! heap; [`QueryDict`] (with `alloc`) is the owned, insertion-ordered, mutable dictionary.
//! This module does not decide what any key means (see [`crate::rendezvous`]).

use core::fmt::{self, Write};

use crate::rendezvous::python::PyRepr;

/// A piece of a query string that is not `key=value` with exactly one `=`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueryError<'a> {
    pair: &'a str,
}

impl<'a> QueryError<'a> {
    /// The offending piece, as written between `&`s.
    pub fn pair(&self) -> &'a str {
        self.pair
    }
}

impl fmt::Display for QueryError<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "malformed query parameter {}: expected exactly one '=' between key and value",
            PyRepr(self.pair)
        )
    }
}

#[cfg(feature = "std")]
impl std::error::Error for QueryError<'_> {}

/// The pieces of a query string as `(key, value)`, in the order written, duplicates
/// included; empty pieces (`a=1&&b=2`, a leading or trailing `&`) are skipped.
pub fn pairs(query: &str) -> QueryPairs<'_> {
    QueryPairs {
        pieces: query.split('&'),
    }
}

/// Iterator returned by [`pairs`].
#[derive(Debug, Clone)]
pub struct QueryPairs<'a> {
    pieces: core::str::Split<'a, char>,
}

impl<'a> Iterator for QueryPairs<'a> {
    type Item = Result<(&'a str, &'a str), QueryError<'a>>;

    fn next(&mut self) -> Option<Self::Item> {
        let pair = self.pieces.by_ref().find(|piece| !piece.is_empty())?;
        Some(match pair.split_once('=') {
            Some((key, value)) if !value.contains('=') => Ok((key, value)),
            _ => Err(QueryError { pair }),
        })
    }
}

/// A query string whose every piece is `key=value`, read with the semantics of the
/// Python `dict` that `_query_to_dict` builds, without allocating.
///
/// Lookups scan the string, and [`iter`](Self::iter) is quadratic in the number of
/// pieces; with `alloc`, [`QueryDict`] is the indexed alternative.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueryView<'a> {
    query: &'a str,
}

impl<'a> QueryView<'a> {
    /// Checks every piece of `query`.
    ///
    /// # Errors
    /// The first piece that is not `key=value`.
    pub fn parse(query: &'a str) -> Result<Self, QueryError<'a>> {
        pairs(query).try_for_each(|pair| pair.map(drop))?;
        Ok(Self { query })
    }

    /// The query string as given.
    pub fn as_str(&self) -> &'a str {
        self.query
    }

    fn valid_pairs(&self) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
        pairs(self.query).filter_map(Result::ok)
    }

    /// The value of the last piece with this key (`query_dict[key]`).
    pub fn get(&self, key: &str) -> Option<&'a str> {
        self.valid_pairs()
            .filter(|(k, _)| *k == key)
            .last()
            .map(|(_, v)| v)
    }

    /// Whether some piece has this key (`key in query_dict`).
    pub fn contains_key(&self, key: &str) -> bool {
        self.valid_pairs().any(|(k, _)| k == key)
    }

    /// The number of distinct keys (`len(query_dict)`).
    pub fn len(&self) -> usize {
        self.iter().count()
    }

    /// Whether there are no pieces.
    pub fn is_empty(&self) -> bool {
        self.valid_pairs().next().is_none()
    }

    /// The entries in dictionary order: each key once, at the position of its first
    /// piece, with the value of its last piece.
    pub fn iter(&self) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
        let view = *self;
        self.valid_pairs()
            .enumerate()
            .filter(move |(index, (key, _))| {
                !view.valid_pairs().take(*index).any(|(k, _)| k == *key)
            })
            .map(move |(_, (key, _))| (key, view.get(key).unwrap_or("")))
    }
}

impl fmt::Display for QueryView<'_> {
    /// Writes the entries as `_rendezvous_helper` rebuilds a query:
    /// `'&'.join(f'{k}={v}' for k, v in query_dict.items())`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_entries(f, self.iter())
    }
}

/// Writes `k=v` entries joined with `&`.
fn write_entries<'e, W: Write + ?Sized>(
    out: &mut W,
    entries: impl Iterator<Item = (&'e str, &'e str)>,
) -> fmt::Result {
    for (index, (key, value)) in entries.enumerate() {
        if index > 0 {
            out.write_char('&')?;
        }
        out.write_str(key)?;
        out.write_char('=')?;
        out.write_str(value)?;
    }
    Ok(())
}

#[cfg(feature = "alloc")]
pub use dict::QueryDict;

#[cfg(feature = "alloc")]
mod dict {
    use alloc::borrow::Cow;
    use alloc::collections::BTreeMap;
    use alloc::vec::Vec;
    use core::fmt;

    use super::{pairs, write_entries, QueryError};

    /// An insertion-ordered query dictionary (requires `alloc`): a later key overwrites
    /// the value but keeps the first position, like a Python `dict`. Keys and values
    /// borrow from the parsed string until replaced.
    #[derive(Debug, Clone, Default)]
    pub struct QueryDict<'a> {
        entries: Vec<(Cow<'a, str>, Cow<'a, str>)>,
        positions: BTreeMap<Cow<'a, str>, usize>,
    }

    impl<'a> QueryDict<'a> {
        /// An empty dictionary.
        pub fn new() -> Self {
            Self::default()
        }

        /// `_query_to_dict(query)`.
        ///
        /// # Errors
        /// The first piece that is not `key=value`.
        pub fn parse(query: &'a str) -> Result<Self, QueryError<'a>> {
            let mut dict = Self::new();
            for pair in pairs(query) {
                let (key, value) = pair?;
                dict.insert(key, value);
            }
            Ok(dict)
        }

        /// The value for `key`.
        pub fn get(&self, key: &str) -> Option<&str> {
            let position = *self.positions.get(key)?;
            self.entries.get(position).map(|(_, value)| value.as_ref())
        }

        /// Whether `key` is present.
        pub fn contains_key(&self, key: &str) -> bool {
            self.positions.contains_key(key)
        }

        /// Sets `key` to `value`, keeping the key's position if present (appending it
        /// otherwise), and returns the previous value.
        pub fn insert(
            &mut self,
            key: impl Into<Cow<'a, str>>,
            value: impl Into<Cow<'a, str>>,
        ) -> Option<Cow<'a, str>> {
            let key = key.into();
            let value = value.into();
            if let Some(&position) = self.positions.get(key.as_ref()) {
                if let Some((_, slot)) = self.entries.get_mut(position) {
                    return Some(core::mem::replace(slot, value));
                }
            }
            self.positions.insert(key.clone(), self.entries.len());
            self.entries.push((key, value));
            None
        }

        /// The number of keys.
        pub fn len(&self) -> usize {
            self.entries.len()
        }

        /// Whether there are no keys.
        pub fn is_empty(&self) -> bool {
            self.entries.is_empty()
        }

        /// The entries in insertion order.
        pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> + '_ {
            self.entries.iter().map(|(k, v)| (k.as_ref(), v.as_ref()))
        }
    }

    impl fmt::Display for QueryDict<'_> {
        /// `'&'.join(f'{k}={v}' for k, v in query_dict.items())`.
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write_entries(f, self.iter())
        }
    }
}

#[cfg(all(test, feature = "alloc"))]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::string::{String, ToString};
    use std::vec::Vec;

    #[test]
    fn splits_like_query_to_dict() {
        let view = QueryView::parse("&rank=0&&world_size=2&rank=3&=e&k=&").expect("valid");
        assert_eq!(view.get("rank"), Some("3"));
        assert_eq!(view.get("world_size"), Some("2"));
        assert_eq!(view.get(""), Some("e"));
        assert_eq!(view.get("k"), Some(""));
        assert_eq!(view.get("missing"), None);
        assert_eq!(view.len(), 4);
        assert_eq!(
            view.iter().collect::<Vec<_>>(),
            [("rank", "3"), ("world_size", "2"), ("", "e"), ("k", "")]
        );
        assert_eq!(view.to_string(), "rank=3&world_size=2&=e&k=");
        assert!(QueryView::parse("").expect("empty").is_empty());
        assert!(QueryView::parse("&&").expect("only separators").is_empty());
    }

    #[test]
    fn names_the_bad_pair() {
        for (query, bad) in [
            ("a=b=c", "a=b=c"),
            ("x=1&a", "a"),
            ("a&a=b=c", "a"),
            ("==", "=="),
        ] {
            let err = QueryView::parse(query).expect_err(query);
            assert_eq!(err.pair(), bad);
            assert_eq!(QueryDict::parse(query).expect_err(query), err);
        }
        assert_eq!(
            QueryView::parse("rank=0&a=b=c")
                .expect_err("bad")
                .to_string(),
            "malformed query parameter 'a=b=c': expected exactly one '=' between key and value"
        );
    }

    #[test]
    fn dict_keeps_first_position_and_last_value() {
        let mut dict = QueryDict::parse("a=1&b=2&a=3").expect("valid");
        assert_eq!(dict.iter().collect::<Vec<_>>(), [("a", "3"), ("b", "2")]);
        assert_eq!(dict.insert("b", String::from("9")).as_deref(), Some("2"));
        assert_eq!(dict.insert("rank", "0"), None);
        assert_eq!(dict.to_string(), "a=3&b=9&rank=0");
        assert_eq!(dict.len(), 3);
        assert!(dict.contains_key("rank"));
        assert!(!QueryDict::new().contains_key("rank"));
    }

    /// A model of `_query_to_dict` over a list of well-formed pairs.
    fn model(pieces: &[(String, String)]) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = Vec::new();
        for (k, v) in pieces {
            match out.iter_mut().find(|(key, _)| key == k) {
                Some(entry) => entry.1 = v.clone(),
                None => out.push((k.clone(), v.clone())),
            }
        }
        out
    }

    proptest! {
        #[test]
        fn dict_semantics_match_the_model(
            pieces in proptest::collection::vec(("[a-c]{0,2}", "[a-c0-9+%]{0,3}"), 0..12),
            empties in proptest::collection::vec(0usize..3, 0..13),
        ) {
            // Join the pairs, sprinkling empty pieces between them.
            let mut query = String::new();
            for (index, (k, v)) in pieces.iter().enumerate() {
                for _ in 0..empties.get(index).copied().unwrap_or(0) {
                    query.push('&');
                }
                if index > 0 { query.push('&'); }
                query.push_str(k);
                query.push('=');
                query.push_str(v);
            }
            let expected = model(&pieces);
            let view = QueryView::parse(&query).expect("well-formed");
            let dict = QueryDict::parse(&query).expect("well-formed");
            let from_view: Vec<(String, String)> =
                view.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            let from_dict: Vec<(String, String)> =
                dict.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            prop_assert_eq!(&from_view, &expected);
            prop_assert_eq!(&from_dict, &expected);
            prop_assert_eq!(view.to_string(), dict.to_string());
            for (k, v) in &expected {
                prop_assert_eq!(view.get(k), Some(v.as_str()));
                prop_assert_eq!(dict.get(k), Some(v.as_str()));
            }
            // Re-joining the pieces as written gives back the query without empty pieces.
            let rejoined: Vec<String> = pairs(&query)
                .map(|p| p.map(|(k, v)| std::format!("{k}={v}")))
                .collect::<Result<_, _>>()
                .expect("well-formed");
            let nonempty: Vec<&str> = query.split('&').filter(|p| !p.is_empty()).collect();
            prop_assert_eq!(rejoined.join("&"), nonempty.join("&"));
        }
    }
}
