//! rdzv's client side of store tokens: `TcpStore` sends its token in rdzv's `AUTH` query
//! right after connecting, before PyTorch's `VALIDATE` and `PING`, and a refused token
//! fails at once with an error that says so (no 30 s of retries).
//!
//! The server here is a stand-in over a real socket that speaks just the handshake,
//! decoding `AUTH` with the same codec a server uses, so that what the client sends is
//! seen byte by byte. The real server's side (`store serve --token-file`) is
//! `tests/store_access.rs`.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::thread;
use std::time::{Duration, Instant};

use rdzv::core::store::codec::{decode_auth, Decoded, AUTH_ACCEPTED, MAX_AUTH_TOKEN_LEN};
use rdzv::uring::store::tcp::{StoreToken, TcpStore, TcpStoreOptions};
use rdzv::uring::StoreError;

const TOKEN: &str = "f0H3kd8Jq2LmZp5Vw9XyTb1C";

/// Accepts one connection; if `want` is set, it must start with `AUTH(want)` (else the
/// connection is closed, as a server refuses); then answers `VALIDATE` + `PING`. Returns
/// the first byte the client sent and whether the token was accepted.
fn stand_in(listener: TcpListener, want: Option<&'static str>) -> thread::JoinHandle<(u8, bool)> {
    thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut buf = Vec::new();
        let mut chunk = [0u8; 256];
        let mut accepted = false;
        if let Some(want) = want {
            loop {
                match decode_auth(&buf, MAX_AUTH_TOKEN_LEN) {
                    Ok(Decoded::Complete(auth, used)) => {
                        accepted = auth.token == want.as_bytes();
                        let first = buf[0];
                        if !accepted {
                            return (first, false);
                        }
                        buf.drain(..used);
                        stream.write_all(&[AUTH_ACCEPTED]).unwrap();
                        break;
                    }
                    Ok(Decoded::Partial(_)) => {
                        let n = stream.read(&mut chunk).unwrap();
                        assert!(n > 0, "client closed during AUTH");
                        buf.extend_from_slice(&chunk[..n]);
                    }
                    // Not AUTH (a PyTorch-style client): refused by closing.
                    Err(_) => return (buf[0], false),
                }
            }
        }
        while buf.len() < 10 {
            let n = stream.read(&mut chunk).unwrap();
            assert!(n > 0, "client closed during VALIDATE/PING");
            buf.extend_from_slice(&chunk[..n]);
        }
        let first = if want.is_some() { 0x41 } else { buf[0] };
        assert_eq!(buf[0], 0, "VALIDATE follows");
        assert_eq!(buf[5], 13, "then PING");
        stream.write_all(&buf[6..10]).unwrap();
        (first, accepted)
    })
}

fn options(port: u16, token: Option<StoreToken>) -> TcpStoreOptions {
    let mut options = TcpStoreOptions::client("127.0.0.1", port);
    options.timeout = Duration::from_secs(30);
    options.token = token;
    options
}

#[test]
fn the_token_goes_first_and_is_accepted() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = stand_in(listener, Some(TOKEN));
    let store = TcpStore::new(options(port, Some(StoreToken::new(TOKEN).unwrap()))).unwrap();
    assert_eq!(server.join().unwrap(), (0x41, true));
    drop(store);
}

#[test]
fn a_refused_token_fails_at_once_and_says_so() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = stand_in(listener, Some(TOKEN));
    let started = Instant::now();
    let wrong = StoreToken::new("0000000000000000wrong").unwrap();
    let err = TcpStore::new(options(port, Some(wrong))).unwrap_err();
    assert!(matches!(err, StoreError::TokenRefused { .. }), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "retried a refused token"
    );
    let text = err.to_string();
    assert!(text.contains("token") && text.contains("log"), "{text}");
    assert!(!text.contains("0000000000000000wrong"), "{text}");
    assert_eq!(server.join().unwrap(), (0x41, false));
}

#[test]
fn without_a_token_the_handshake_is_pytorch_s() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = stand_in(listener, None);
    // The environment may name a token; the option's absence then reads it, so only run
    // the check when it does not.
    if std::env::var_os("RDZV_TOKEN").is_some() || std::env::var_os("RDZV_TOKEN_FILE").is_some() {
        eprintln!("skipped: RDZV_TOKEN or RDZV_TOKEN_FILE is set in this environment");
        drop(TcpStore::new(options(port, StoreToken::new(TOKEN).ok())));
        return;
    }
    let store = TcpStore::new(options(port, None)).unwrap();
    assert_eq!(server.join().unwrap(), (0, false));
    drop(store);
}

#[test]
fn tokens_come_from_text_or_a_file_and_never_show() {
    assert!(StoreToken::new("short").is_err());
    assert!(StoreToken::new("has a space in it, so no").is_err());
    let token = StoreToken::new(TOKEN).unwrap();
    assert!(!format!("{token:?}").contains(TOKEN));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("token");
    std::fs::write(
        &path,
        format!("# job 1's line of the server's file\n{TOKEN} /job1/\n"),
    )
    .unwrap();
    assert_eq!(StoreToken::from_file(&path).unwrap(), token);
    std::fs::write(&path, "# nothing\n").unwrap();
    let err = StoreToken::from_file(&path).unwrap_err().to_string();
    assert!(err.contains("no token"), "{err}");
    let err = StoreToken::from_file(&dir.path().join("missing")).unwrap_err();
    assert!(matches!(err, StoreError::File { .. }), "{err}");
}
