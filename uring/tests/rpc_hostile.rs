//! Hostile clients of an RPC agent's listener, with real agents over tcp on a `file://`
//! store: connections that send nothing, dribble a hello, send garbage, a header that
//! claims a huge frame, half a hello, or a stranger's hello. Each is closed (counted where
//! it failed the handshake), no more than `InboundHandshakes::max_in_flight` of them hold
//! a waiting thread, and the group's own calls go through during and after the flood.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::thread;
use std::time::{Duration, Instant};

use rdzv_core::rpc::frame::{
    decode_frame, decode_handshake, Decoded, FrameLimits, Handshake, OutgoingFrame, HEADER_LEN,
};
use rdzv_core::rpc::name::WorkerId;
use rdzv_uring::rpc::{InboundHandshakes, Message, RpcAgent, RpcOptions, RpcSecret};

mod common;

use common::{loopback_tcp, pair_of};

/// The limits bob's listener runs under here: short, so that the test is.
const LIMITS: InboundHandshakes = InboundHandshakes {
    timeout: Duration::from_millis(1500),
    max_in_flight: 4,
};

fn options(url: &str) -> RpcOptions {
    let mut options = loopback_tcp(url);
    options.channels = Some(vec!["basic".into()]);
    options.secret = RpcSecret::Given(vec![9; 32]);
    options.inbound_handshakes = LIMITS;
    options
}

/// The tests count this process's handshake threads, so they run one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

fn pair(dir: &tempfile::TempDir) -> (RpcAgent, RpcAgent) {
    pair_of(dir, |url, _| options(url))
}

fn tcp_address(agent: &RpcAgent) -> String {
    agent
        .address()
        .split(';')
        .find_map(|a| a.strip_prefix("tcp://"))
        .unwrap_or_else(|| panic!("no tcp address in {}", agent.address()))
        .to_string()
}

fn call_works(from: &RpcAgent, to: &str) {
    let reply = from
        .rpc_sync(to, "echo", Message::from_payload(b"hi".to_vec()))
        .unwrap_or_else(|e| panic!("the group's own call to {to} failed: {e}"));
    assert_eq!(reply.payload, b"hi");
}

/// This process's threads whose name starts with `prefix`.
fn threads_named(prefix: &str) -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(|t| t.ok())
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .filter(|name| name.starts_with(prefix))
        .count()
}

/// How long the agent takes to close `stream` (an end of stream or a reset), at most
/// `within`; `None` if it is still open then.
fn closed_within(stream: &mut TcpStream, within: Duration) -> Option<Duration> {
    let start = Instant::now();
    stream
        .set_read_timeout(Some(within))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut rest = Vec::new();
    let closed = match stream.read_to_end(&mut rest) {
        Ok(_) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    };
    closed.then(|| start.elapsed())
}

fn hello_bytes(name: &str, id: i16) -> Vec<u8> {
    let offer = common::tcp_basic_offer();
    let mut out = Vec::new();
    Handshake::Hello {
        name,
        id: WorkerId::from_i16(id),
        brochure: offer.brochure(),
        lanes_token: 1,
        challenge: [3; 32],
    }
    .encode_to_vec(&mut out)
    .unwrap_or_else(|e| panic!("{e}"));
    out
}

/// Waits up to 10 s for `agent` to have counted at least `n` refused handshakes.
fn wait_refused(agent: &RpcAgent, n: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    while agent.handshakes_refused() < n && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
    }
    agent.handshakes_refused()
}

#[test]
fn a_flood_of_silent_connections_holds_at_most_the_cap_and_times_out() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (alice, bob) = pair(&dir);
    // The group's pipes, before the flood.
    call_works(&alice, "bob");
    call_works(&bob, "alice");
    let address = tcp_address(&bob);
    let before = threads_named("rdzv-rpc-handsh");
    let flood = 24;
    let mut silent: Vec<TcpStream> = (0..flood)
        .map(|_| TcpStream::connect(&address).unwrap_or_else(|e| panic!("{e}")))
        .collect();
    // Watch the handshake threads while the flood is served: never above the cap.
    let mut most = 0;
    let watch_until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < watch_until {
        most = most.max(threads_named("rdzv-rpc-handsh").saturating_sub(before));
        thread::sleep(Duration::from_millis(5));
    }
    assert!(most >= 1, "no handshake thread ever waited on the flood");
    // The agent's own count of handshakes in flight: the flood fills the cap, and no
    // more.
    let cap = LIMITS.max_in_flight;
    assert_eq!(
        bob.most_inbound_handshakes(),
        cap as u64,
        "the most handshakes at once, against the cap"
    );
    // Threads are seen from outside: one whose handshake just ended may still be
    // exiting when the next begins (its result is handed over before it is gone), so a
    // sample can count it beside a full cap. More than that would be a leak.
    assert!(
        most <= cap + 2,
        "{most} handshake threads at once, the cap is {cap} (and 2 ending)"
    );
    // Each is closed, the last ones after waiting in the backlog (6 rounds of 1.5 s).
    for (i, stream) in silent.iter_mut().enumerate() {
        assert!(
            closed_within(stream, Duration::from_secs(30)).is_some(),
            "silent connection {i} is still open"
        );
    }
    assert!(
        wait_refused(&bob, flood) >= flood,
        "bob counted {} of {flood} silent connections",
        bob.handshakes_refused()
    );
    // Established pipes went on serving; threads are back where they were.
    call_works(&alice, "bob");
    let deadline = Instant::now() + Duration::from_secs(5);
    while threads_named("rdzv-rpc-handsh") > before && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
    }
    // (At most: a thread of an earlier test's agents may have ended meanwhile.)
    assert!(threads_named("rdzv-rpc-handsh") <= before);
    let _ = (alice.shutdown(false), bob.shutdown(false));
}

#[test]
fn a_member_opens_its_pipe_while_silent_connections_fill_the_cap() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (alice, bob) = pair(&dir);
    let address = tcp_address(&bob);
    let _silent: Vec<TcpStream> = (0..8)
        .map(|_| TcpStream::connect(&address).unwrap_or_else(|e| panic!("{e}")))
        .collect();
    thread::sleep(Duration::from_millis(100));
    // alice's first call opens a pipe behind the flood: it waits its turn in the
    // backlog, then goes through.
    let start = Instant::now();
    call_works(&alice, "bob");
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "the member's pipe took {:?}",
        start.elapsed()
    );
    let _ = (alice.shutdown(false), bob.shutdown(false));
}

#[test]
fn a_dribbled_hello_is_cut_off_at_the_deadline_not_per_byte() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (alice, bob) = pair(&dir);
    let mut stream = TcpStream::connect(tcp_address(&bob)).unwrap_or_else(|e| panic!("{e}"));
    let hello = hello_bytes("alice", 0);
    let start = Instant::now();
    let mut cut = false;
    for byte in &hello {
        if stream.write_all(std::slice::from_ref(byte)).is_err() {
            cut = true;
            break;
        }
        thread::sleep(Duration::from_millis(100));
        if start.elapsed() > Duration::from_secs(10) {
            break;
        }
    }
    let waited = start.elapsed()
        + closed_within(&mut stream, Duration::from_secs(10))
            .unwrap_or_else(|| panic!("the dribbler is still connected"));
    assert!(
        cut || waited < Duration::from_secs(10),
        "the dribbler was served for {waited:?}"
    );
    assert!(
        waited >= LIMITS.timeout.mul_f32(0.9),
        "closed after {waited:?}, before its deadline"
    );
    assert!(wait_refused(&bob, 1) >= 1);
    call_works(&alice, "bob");
    let _ = (alice.shutdown(false), bob.shutdown(false));
}

#[test]
fn garbage_huge_headers_half_hellos_and_strangers_are_closed_and_the_group_goes_on() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (alice, bob) = pair(&dir);
    let address = tcp_address(&bob);
    let mut huge = Vec::new();
    OutgoingFrame::request(1, "", b"", &vec![0u8; 128 * 1024])
        .encode_to_vec(&mut huge)
        .unwrap_or_else(|e| panic!("{e}"));
    huge.truncate(HEADER_LEN);
    let garbage: Vec<u8> = (0..65_536u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let cases: [(&str, Vec<u8>); 4] = [
        ("garbage", garbage),
        ("a header claiming a 128 KiB handshake", huge),
        (
            "a pickle where the hello belongs",
            b"\x80\x04\x95cos\nsystem\n".to_vec(),
        ),
        ("a stranger's hello", hello_bytes("mallory", 7)),
    ];
    let mut refused = bob.handshakes_refused();
    for (what, bytes) in cases {
        let mut stream = TcpStream::connect(&address).unwrap_or_else(|e| panic!("{e}"));
        let _ = stream.write_all(&bytes);
        // Closed at once, well before the handshake's deadline: nothing waits for more.
        let took = closed_within(&mut stream, Duration::from_secs(10))
            .unwrap_or_else(|| panic!("{what}: still open"));
        assert!(took < LIMITS.timeout, "{what}: closed after {took:?}");
        refused += 1;
        assert!(
            wait_refused(&bob, refused) >= refused,
            "{what}: not counted"
        );
        call_works(&alice, "bob");
    }
    // The stranger was told why.
    let mut stream = TcpStream::connect(&address).unwrap_or_else(|e| panic!("{e}"));
    stream
        .write_all(&hello_bytes("mallory", 7))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut buf = Vec::new();
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let _ = stream.read_to_end(&mut buf);
    match decode_frame(&buf, &FrameLimits::HANDSHAKE) {
        Ok(Decoded::Complete(frame, _)) => match decode_handshake(&frame) {
            Ok(Handshake::Refused { reason }) => assert!(
                reason.contains("mallory") && reason.contains("not a member"),
                "{reason}"
            ),
            other => panic!("expected a refusal, got {other:?}"),
        },
        other => panic!("expected a refusal frame, got {other:?}"),
    }
    // Half a hello, then the client goes: closed, nothing to count, nothing held.
    let mut half = TcpStream::connect(&address).unwrap_or_else(|e| panic!("{e}"));
    let hello = hello_bytes("alice", 0);
    half.write_all(&hello[..hello.len() / 2])
        .unwrap_or_else(|e| panic!("{e}"));
    drop(half);
    call_works(&alice, "bob");
    call_works(&bob, "alice");
    let _ = (alice.shutdown(false), bob.shutdown(false));
}
