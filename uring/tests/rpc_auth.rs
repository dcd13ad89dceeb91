//! Peers that prove they belong (core's `rpc::auth`), with real agents over tcp on a
//! `file://` store: the same given secret works; another secret, or none against one,
//! fails the first call with an error that names authentication, in both directions; a
//! raw client that answers the listener's proof with none or a forged one, or that sends
//! a call before any handshake, is closed before anything else it sent is read, counted,
//! and the agent goes on serving its group.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use rdzv_core::rpc::frame::{
    decode_frame, decode_handshake, Decoded, FrameLimits, Handshake, OutgoingFrame, HEADER_LEN,
};
use rdzv_core::rpc::name::WorkerId;
use rdzv_uring::rpc::{CallError, Message, RpcAgent, RpcOptions, RpcSecret};

mod common;

use common::{loopback_tcp, pair_of};

fn options(url: &str, secret: RpcSecret) -> RpcOptions {
    let mut options = loopback_tcp(url);
    options.channels = Some(vec!["basic".into()]);
    options.secret = secret;
    options
}

fn pair(dir: &tempfile::TempDir, a: RpcSecret, b: RpcSecret) -> (RpcAgent, RpcAgent) {
    pair_of(dir, move |url, rank| {
        options(url, if rank == 0 { a.clone() } else { b.clone() })
    })
}

fn secret(fill: u8) -> RpcSecret {
    RpcSecret::Given(vec![fill; 32])
}

fn call(from: &RpcAgent, to: &str) -> Result<Message, CallError> {
    from.rpc_sync(to, "echo", Message::from_payload(b"hi".to_vec()))
}

#[test]
fn workers_with_the_same_secret_talk() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir, secret(1), secret(1));
    assert_eq!(
        call(&a, "bob").map(|m| m.payload).ok(),
        Some(b"hi".to_vec())
    );
    assert_eq!(
        call(&b, "alice").map(|m| m.payload).ok(),
        Some(b"hi".to_vec())
    );
    assert_eq!((a.handshakes_refused(), b.handshakes_refused()), (0, 0));
    let _ = (a.shutdown(false), b.shutdown(false));
}

#[test]
fn another_secret_or_none_fails_the_call_naming_authentication() {
    for (mine, theirs) in [
        (secret(1), secret(2)),
        (secret(1), RpcSecret::Disabled),
        (RpcSecret::Disabled, secret(2)),
    ] {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let (a, b) = pair(&dir, mine.clone(), theirs.clone());
        for (from, to) in [(&a, "bob"), (&b, "alice")] {
            let error = call(from, to).map(|_| ()).unwrap_err().to_string();
            assert!(
                error.contains("failed authentication") && error.contains(to),
                "{mine:?} against {theirs:?}, {to}: {error}"
            );
        }
        let _ = (a.shutdown(false), b.shutdown(false));
    }
}

/// One handshake frame from the stream.
fn read_handshake(stream: &mut TcpStream) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Ok(Decoded::Complete(_, used)) = decode_frame(&buf, &FrameLimits::HANDSHAKE) {
            buf.truncate(used);
            return buf;
        }
        let n = stream.read(&mut chunk).unwrap_or(0);
        assert!(n > 0, "the agent closed before a whole handshake frame");
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn send(stream: &mut TcpStream, message: &Handshake<'_>) {
    let mut out = Vec::new();
    message
        .encode_to_vec(&mut out)
        .unwrap_or_else(|e| panic!("{e}"));
    stream.write_all(&out).unwrap_or_else(|e| panic!("{e}"));
}

/// Whether the agent closes the connection within 10 s: an end of stream, or a reset
/// (it closed with bytes of ours unread, as it does with the smuggled call).
fn closed(stream: &mut TcpStream) -> bool {
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut rest = Vec::new();
    match stream.read_to_end(&mut rest) {
        Ok(_) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

#[test]
fn a_raw_client_without_the_secret_is_refused_before_any_call_is_read() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir, secret(7), secret(7));
    let address = b
        .address()
        .split(';')
        .find_map(|a| a.strip_prefix("tcp://"))
        .unwrap_or_else(|| panic!("no tcp address in {}", b.address()))
        .to_string();
    let offer = common::tcp_basic_offer();
    for (round, forged) in [None, Some([0x5a; 32])].into_iter().enumerate() {
        let mut stream = TcpStream::connect(&address).unwrap_or_else(|e| panic!("{e}"));
        // It claims to be alice, a member.
        send(
            &mut stream,
            &Handshake::Hello {
                name: "alice",
                id: WorkerId::from_i16(0),
                brochure: offer.brochure(),
                lanes_token: 1,
                challenge: [3; 32],
            },
        );
        let answer = read_handshake(&mut stream);
        let Ok(Decoded::Complete(frame, _)) = decode_frame(&answer, &FrameLimits::HANDSHAKE) else {
            panic!("not a frame");
        };
        assert!(
            matches!(
                decode_handshake(&frame),
                Ok(Handshake::Answer { proof: Some(_), .. })
            ),
            "bob proves its secret first"
        );
        send(&mut stream, &Handshake::Proof { proof: forged });
        // A call right behind the proof: never read, never run.
        let mut request = Vec::new();
        OutgoingFrame::request(1, "echo", b"", b"smuggled")
            .encode_to_vec(&mut request)
            .unwrap_or_else(|e| panic!("{e}"));
        let _ = stream.write_all(&request);
        let refusal = read_handshake(&mut stream);
        let Ok(Decoded::Complete(frame, _)) = decode_frame(&refusal, &FrameLimits::HANDSHAKE)
        else {
            panic!("not a frame");
        };
        match decode_handshake(&frame) {
            Ok(Handshake::Refused { reason }) => {
                assert!(reason.contains("failed authentication"), "{reason}")
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        assert!(closed(&mut stream));
        assert_eq!(b.handshakes_refused(), round as u64 + 1);
    }
    // A call frame where the hello belongs.
    let mut stream = TcpStream::connect(&address).unwrap_or_else(|e| panic!("{e}"));
    let mut request = Vec::new();
    OutgoingFrame::request(1, "echo", b"", b"no hello")
        .encode_to_vec(&mut request)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(request.len() > HEADER_LEN);
    stream.write_all(&request).unwrap_or_else(|e| panic!("{e}"));
    assert!(closed(&mut stream));
    // The group goes on.
    assert_eq!(
        call(&a, "bob").map(|m| m.payload).ok(),
        Some(b"hi".to_vec())
    );
    let _ = (a.shutdown(false), b.shutdown(false));
}
