//! Fuzz checks for [`crate::rpc::restricted`]: restricted mode's payload decoder, fed
//! arbitrary bytes.
//!
//! The first byte picks the mode: odd, the rest follows [`MAGIC`] (so the fuzzer reaches
//! the fields behind it); even, the rest is taken as it is. For every input: no panic;
//! an error's text is not empty; an accepted payload re-encodes to exactly the bytes
//! given (the encoding is canonical), and tighter limits never accept something else.

use super::check_display;
use alloc::vec::Vec;

use crate::rpc::restricted::{decode, encode, encoded_len, Limits, MAGIC};

/// Decodes `data` (after the mode byte) as a restricted payload.
pub fn rpc_restricted(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        let _ = decode(data, &Limits::default());
        return;
    };
    let mut input = Vec::new();
    if mode & 1 == 1 {
        input.extend_from_slice(MAGIC);
    }
    input.extend_from_slice(rest);
    let limits = Limits::default();
    match decode(&input, &limits) {
        Err(e) => check_display(&e),
        Ok(payload) => {
            let mut again = Vec::new();
            encode((&payload).into(), &mut again).expect("a decoded payload re-encodes");
            // Compared as bytes, so NaNs (which are not == themselves) compare too.
            assert_eq!(again, input, "re-encoding differs from the accepted bytes");
            assert_eq!(encoded_len((&payload).into()), Ok(again.len()));
            let tight = Limits {
                max_depth: usize::from(mode >> 4),
                max_items: usize::from(mode),
                max_len: input.len(),
            };
            if let Ok(tighter) = decode(&input, &tight) {
                let mut third = Vec::new();
                encode((&tighter).into(), &mut third).expect("re-encodes");
                assert_eq!(third, input, "tighter limits accepted something else");
            }
        }
    }
}
