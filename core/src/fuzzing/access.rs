//! Fuzz checks for [`crate::store::access`] and the `AUTH` query's decoder: the token file
//! parser, the `--allow` parser and the `AUTH` frame decoder, fed arbitrary bytes.
//!
//! For every input: no panic; a parsed token file authenticates each of its tokens and
//! never shows one in its `Debug` text; a parsed allowlist admits each network's own
//! address; the `AUTH` decoder gives the same answer whole and in two pieces, a complete
//! frame re-encodes to exactly its bytes, and a partial one asks for at least one byte
//! that the frame really lacks.

use alloc::format;
use alloc::string::String;

use super::split_point;
use crate::store::access::{client_token, Allowlist, TokenTable};
use crate::store::codec::{decode_auth, AuthRequest, Decoded};

/// Drives the access-control parsers with `data`.
pub fn access(data: &[u8]) {
    token_file(data);
    allowlist(data);
    auth_frame(data);
}

fn token_file(data: &[u8]) {
    let parsed = TokenTable::parse(data);
    if let Ok(table) = &parsed {
        assert!(!table.is_empty());
        let text = core::str::from_utf8(data).unwrap_or_default();
        let debug = format!("{table:?}");
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if let Some(token) = line.split_whitespace().next() {
                assert!(
                    table.authenticate(token.as_bytes()).is_some(),
                    "a listed token is refused"
                );
                assert!(!debug.contains(token), "a token shows in Debug");
            }
        }
        assert!(
            client_token(data).is_ok(),
            "a valid server file is no client file"
        );
    }
    if let Err(e) = &parsed {
        super::check_display(e);
    }
}

fn allowlist(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    match Allowlist::parse(&text) {
        Ok(allow) => {
            for net in allow.networks() {
                let shown = format!("{net}");
                let own = shown.split('/').next().and_then(|a| a.parse().ok());
                assert!(own.is_some(), "a network shows as {shown}");
                if let Some(addr) = own {
                    assert!(allow.allows(addr), "{shown} refuses its own address");
                }
            }
        }
        Err(e) => super::check_display(&e),
    }
}

fn auth_frame(data: &[u8]) {
    let limit = u64::from(data.first().copied().unwrap_or(0)) * 4;
    let whole = decode_auth(data, limit);
    match whole {
        Ok(Decoded::Complete(request, used)) => {
            let frame = data.get(..used);
            assert!(frame.is_some(), "used more than given");
            let mut out = alloc::vec::Vec::new();
            request.encode_into(&mut out);
            assert_eq!(Some(out.as_slice()), frame, "re-encoding differs");
            assert_eq!(request.encoded_len(), used);
            assert!(request.token.len() as u64 <= limit);
        }
        Ok(Decoded::Partial(more)) => assert!(more >= 1),
        Err(e) => super::check_display(&e),
    }
    // A prefix decodes to "partial", or to the same error the whole does.
    let cut = split_point(data);
    let head = data.get(..cut).unwrap_or(data);
    match (decode_auth(head, limit), whole) {
        (Ok(Decoded::Complete(a, n)), Ok(Decoded::Complete(b, m))) => {
            assert_eq!((a, n), (b, m));
        }
        (Ok(Decoded::Partial(more)), Ok(Decoded::Complete(_, used))) => {
            assert!(cut + more <= used, "asked for more than the frame lacks");
        }
        (Ok(Decoded::Partial(_)), _) => {}
        (Err(a), Err(b)) => assert_eq!(a, b),
        (head, whole) => panic!("prefix gave {head:?}, whole {whole:?}"),
    }
    let _ = AuthRequest { token: data }.encoded_len();
}
