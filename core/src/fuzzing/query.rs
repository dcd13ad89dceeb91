//! Fuzz checks for [`crate::query`].
//!
//! For every input: splitting never panics; every piece is either a `key=value` pair that
//! joins back to the piece as written, or an error naming that piece; the checked view
//! fails exactly when some piece is bad, with the first bad piece; and the dictionary
//! views (view and, with `alloc`, `QueryDict`) agree with each other and with "a later key
//! wins, the first position stays".

use super::utf8_prefix;
use crate::query::{pairs, QueryView};

/// Splits `data` as a rendezvous query string and checks the invariants.
pub fn query(data: &[u8]) {
    let text = utf8_prefix(data);

    let mut first_error = None;
    let mut count = 0usize;
    let pieces = text.split('&').filter(|piece| !piece.is_empty());
    for (pair, piece) in pairs(text).zip(pieces) {
        count += 1;
        match pair {
            Ok((key, value)) => {
                // Re-joined, the pair is exactly the piece.
                assert_eq!(piece.len(), key.len() + 1 + value.len());
                assert!(piece.starts_with(key) && piece.ends_with(value));
                assert_eq!(piece.get(key.len()..=key.len()), Some("="));
                assert!(!key.contains('=') && !value.contains('='));
            }
            Err(error) => {
                assert_eq!(error.pair(), piece);
                assert_ne!(piece.matches('=').count(), 1);
                first_error.get_or_insert(error);
            }
        }
    }
    assert_eq!(count, text.split('&').filter(|p| !p.is_empty()).count());

    match QueryView::parse(text) {
        Ok(view) => {
            assert!(first_error.is_none());
            assert_eq!(view.is_empty(), count == 0);
            let mut distinct = 0usize;
            for (index, (key, value)) in view.iter().enumerate() {
                distinct += 1;
                assert_eq!(view.get(key), Some(value));
                // Keys are listed once each.
                assert!(!view.iter().take(index).any(|(k, _)| k == key));
                // The value is the one of the key's last piece.
                let last = pairs(text)
                    .filter_map(Result::ok)
                    .filter(|(k, _)| *k == key)
                    .last()
                    .map(|(_, v)| v);
                assert_eq!(last, Some(value));
            }
            assert_eq!(distinct, view.len());
            assert!(distinct <= count);
            #[cfg(feature = "alloc")]
            {
                use alloc::string::ToString;
                let dict = crate::query::QueryDict::parse(text).expect("same checks as the view");
                assert!(dict.iter().eq(view.iter()));
                let joined = dict.to_string();
                assert!(super::displays_as(&view, &joined));
                // Joining the dictionary gives a query with the same dictionary.
                let again = QueryView::parse(&joined).expect("a joined dictionary parses");
                assert!(again.iter().eq(view.iter()));
            }
        }
        Err(error) => {
            assert_eq!(Some(error), first_error);
            #[cfg(feature = "alloc")]
            assert_eq!(crate::query::QueryDict::parse(text).err(), Some(error));
        }
    }
}
