//! Fuzz checks for [`crate::url`] and the rendezvous functions that consume URLs.
//!
//! For every input: parsing never panics; a parsed URL writes back to exactly the input
//! and parses again to the same parts; the derived parts (user, host, port) agree with
//! the netloc; rewriting with node parameters either leaves the URL alone or gives a URL
//! with the same parts and the new `rank`/`world_size`; and (with `alloc`) planning never
//! panics.

use super::{displays_as, utf8_prefix};
use crate::env::MapEnv;
use crate::query::QueryView;
use crate::rendezvous::{rewrite_with_node_params, NodeParams};
use crate::url::{RendezvousUrl, UrlError};

/// Parses `data` as a rendezvous URL and checks the invariants every input must keep.
pub fn url(data: &[u8]) {
    let text = utf8_prefix(data);
    let parsed = match RendezvousUrl::parse(text) {
        Ok(parsed) => parsed,
        Err(UrlError::RemovedCharacter { index, character }) => {
            let found = text.get(index..).and_then(|rest| rest.chars().next());
            assert_eq!(found, Some(character), "error points at its character");
            assert!(index == 0 || matches!(character, '\t' | '\r' | '\n'));
            return;
        }
        Err(_) => return,
    };

    // Unparse is the inverse of parse, and parsing is deterministic.
    assert!(displays_as(&parsed, text), "round trip of {text:?}");
    assert_eq!(RendezvousUrl::parse(text), Ok(parsed));
    assert_eq!(parsed.as_str(), text);

    // Derived parts agree with the netloc.
    let netloc = parsed.netloc();
    assert_eq!(parsed.username().is_some(), netloc.contains('@'));
    if parsed.password().is_some() {
        assert!(parsed.username().is_some());
    }
    if let Some(host) = parsed.hostname() {
        assert!(netloc.contains(host.as_written()));
        assert!(!host.is_empty());
        // Exercise the lowercasing writer.
        let _ = displays_as(&host, host.as_written());
    }
    match parsed.port() {
        Ok(Some(port)) => {
            let digits = parsed.port_text().unwrap_or("");
            assert!(digits.bytes().all(|b| b.is_ascii_digit()));
            let _ = port;
        }
        Ok(None) => assert_eq!(parsed.port_text(), None),
        Err(_) => assert!(parsed.port_text().is_some()),
    }

    check_rewrites(text, &parsed);

    #[cfg(feature = "alloc")]
    {
        let env = MapEnv::new(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "29500"),
        ]);
        if let Ok(plan) = crate::rendezvous::plan_static(text, &env, None) {
            if let Some(world_size) = plan.world_size {
                assert!(
                    world_size > 0 || matches!(plan.store, crate::rendezvous::StorePlan::File(_))
                );
            }
        }
    }
}

/// Rewriting keeps every part but the query, which gains exactly the node parameters.
fn check_rewrites(text: &str, parsed: &RendezvousUrl<'_>) {
    let env = MapEnv::new(&[("RANK", "1"), ("WORLD_SIZE", "3")]);
    for params in [
        NodeParams::Given {
            rank: None,
            world_size: None,
        },
        NodeParams::Given {
            rank: Some(1),
            world_size: Some(2),
        },
        NodeParams::Inferred { rank: Some(0) },
    ] {
        let Ok(rewritten) = rewrite_with_node_params(text, params, &env) else {
            continue;
        };
        if rewritten.is_unchanged() {
            assert!(displays_as(&rewritten, text));
            continue;
        }
        // The query was dictionary-shaped; the rest of the URL is untouched.
        assert!(QueryView::parse(parsed.query()).is_ok());
        #[cfg(feature = "alloc")]
        {
            use alloc::string::ToString;
            let new_text = rewritten.to_string();
            assert_eq!(new_text.len(), rewritten.len());
            let reparsed = RendezvousUrl::parse(&new_text).expect("a rewritten URL parses");
            assert_eq!(reparsed.scheme(), parsed.scheme());
            assert_eq!(reparsed.netloc(), parsed.netloc());
            assert_eq!(reparsed.path(), parsed.path());
            assert_eq!(reparsed.params(), parsed.params());
            assert_eq!(reparsed.fragment(), parsed.fragment());
            let query = QueryView::parse(reparsed.query()).expect("a rewritten query parses");
            assert!(query.contains_key("world_size"));
            if let NodeParams::Given { .. } = params {
                assert_eq!(query.get("rank"), Some("1"));
                assert_eq!(query.get("world_size"), Some("2"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

        /// Structured inputs reach the deep checks that random bytes rarely do.
        #[test]
        fn url_like_inputs_keep_the_invariants(
            input in "(tcp|env|file|TCP|http|x)?:?(//)?([a-zA-Z0-9.@:%\\[\\]-]{0,16})?(/[a-z;/]{0,8})?(\\?([a-z_]{0,10}=?[0-9a-z=-]{0,4}&?){0,4})?(#[a-z?:]{0,4})?",
        ) {
            super::url(input.as_bytes());
            crate::fuzzing::query(input.as_bytes());
        }
    }
}
