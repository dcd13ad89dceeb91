//! Integration tests of the shm transport: real sockets, memfds, eventfds, threads and
//! processes.
//!
//! The multi-process tests re-run this test binary as the peer: `child_process_entry`
//! (ignored, so it never runs on its own) acts out the role named by `RDZV_SHM_CHILD`.

use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use rdzv_test_support::Peer;
use rdzv_uring::shm::{viability, ShmAddr, ShmConnection, ShmError, ShmListener, ShmOptions};

const CHILD_ROLE: &str = "RDZV_SHM_CHILD";
const CHILD_ADDR: &str = "RDZV_SHM_CHILD_ADDR";
const CHILD_CAPACITY: &str = "RDZV_SHM_CHILD_CAPACITY";

/// A fresh abstract address per test.
fn unique_addr(tag: &str) -> ShmAddr {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    ShmAddr::Abstract(format!("rdzv-shm-test-{}-{tag}-{n}", std::process::id()).into_bytes())
}

fn options(capacity: usize, spin: Duration) -> ShmOptions {
    let mut options = ShmOptions::default();
    options.inbox_capacity = capacity;
    options.spin = spin;
    options
}

/// A message whose bytes depend on its index and length.
fn payload(index: u64, len: usize) -> Vec<u8> {
    let mut state = index.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// Accepts on a fresh listener while `client` connects from another thread.
fn connected_pair(
    server_options: ShmOptions,
    client_options: ShmOptions,
) -> (ShmConnection, ShmConnection) {
    let listener = ShmListener::bind_unnamed(server_options).expect("bind");
    let addr = listener.local_addr().clone();
    let client = thread::spawn(move || ShmConnection::connect(&addr, client_options));
    let server = listener.accept().expect("accept");
    let client = client.join().expect("client thread").expect("connect");
    (server, client)
}

/// The echo loop a peer runs: returns every message until the other side closes.
fn echo(mut conn: ShmConnection) -> Result<u64, ShmError> {
    let mut count = 0;
    loop {
        match conn.recv() {
            Ok(message) => {
                conn.send(&message)?;
                count += 1;
            }
            Err(ShmError::PeerClosed) => return Ok(count),
            Err(e) => return Err(e),
        }
    }
}

#[test]
fn domain_descriptor_is_usable_in_negotiation() {
    use rdzv_core::negotiate::{Offer, TransportKind};
    let descriptor = viability().expect("shm is viable on a Linux test host");
    let mut offer = Offer::new();
    offer
        .add_transport(TransportKind::Shm, 200, descriptor.as_str())
        .expect("add shm");
    assert_eq!(
        offer.transport(TransportKind::Shm),
        Some((200, descriptor.as_str()))
    );
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    assert!(descriptor
        .as_str()
        .starts_with(&format!("shm:{}_", boot_id.trim())));
}

#[test]
fn two_threads_ping_pong_byte_for_byte() {
    let (mut server, client) = connected_pair(ShmOptions::default(), ShmOptions::default());
    let echoer = thread::spawn(move || echo(client));
    for i in 0..5_000u64 {
        let message = payload(i, (i as usize * 37) % 5000);
        server.send(&message).unwrap();
        assert_eq!(server.recv().unwrap(), message, "round trip {i}");
    }
    drop(server);
    assert_eq!(echoer.join().unwrap().unwrap(), 5_000);
}

#[test]
fn sizes_from_empty_to_larger_than_the_ring() {
    // A 64 KiB ring: 1 MiB and 5 MiB messages travel in fragments.
    let small = options(64 << 10, Duration::from_micros(50));
    for (server_options, client_options) in [
        (small.clone(), small.clone()),
        (ShmOptions::default(), ShmOptions::default()),
    ] {
        let (mut server, client) = connected_pair(server_options, client_options);
        let echoer = thread::spawn(move || echo(client));
        let exact = server_options_capacity_minus_header(&small);
        for (i, len) in [0, 1, 7, 8, 4096, exact, 1 << 20, (5 << 20) + 3]
            .into_iter()
            .enumerate()
        {
            let message = payload(i as u64, len);
            server.send(&message).unwrap();
            let echoed = server.recv().unwrap();
            assert_eq!(echoed.len(), len);
            assert!(echoed == message, "{len}-byte message corrupted");
        }
        drop(server);
        echoer.join().unwrap().unwrap();
    }
}

/// The largest single-record message of a ring.
fn server_options_capacity_minus_header(options: &ShmOptions) -> usize {
    options.inbox_capacity - 16
}

#[test]
fn recv_into_copies_and_keeps_what_does_not_fit() {
    let (mut server, mut client) =
        connected_pair(options(4096, Duration::ZERO), options(4096, Duration::ZERO));
    // The 10 000-byte message needs several fragments of the 4 KiB ring, so the sender
    // runs on its own thread while we drain.
    let sender = thread::spawn(move || {
        client.send(b"hello")?;
        client.send(&payload(1, 10_000))?;
        client.send(&[9; 100])?;
        Ok::<_, ShmError>(client)
    });
    let mut buf = [0u8; 16];
    assert_eq!(server.recv_into(&mut buf).unwrap(), 5);
    assert_eq!(&buf[..5], b"hello");
    // Reassembled, does not fit, and is kept.
    match server.recv_into(&mut buf) {
        Err(ShmError::BufferTooSmall {
            needed: 10_000,
            available: 16,
        }) => {}
        other => panic!("expected BufferTooSmall, got {other:?}"),
    }
    let mut big = vec![0u8; 20_000];
    assert_eq!(server.recv_into(&mut big).unwrap(), 10_000);
    assert_eq!(&big[..10_000], &payload(1, 10_000)[..]);
    // A single-record message that does not fit stays in the ring.
    let _client = sender.join().unwrap().unwrap();
    assert!(matches!(
        server.recv_into(&mut buf),
        Err(ShmError::BufferTooSmall { needed: 100, .. })
    ));
    assert_eq!(server.recv().unwrap(), vec![9; 100]);
}

#[test]
fn try_send_and_try_recv_never_block() {
    let (mut server, mut client) =
        connected_pair(options(4096, Duration::ZERO), options(4096, Duration::ZERO));
    assert_eq!(server.try_recv().unwrap(), None);
    let mut sent = 0;
    while client.try_send(&[sent as u8; 1000]).unwrap() {
        sent += 1;
    }
    // 1016-byte records: four fit a 4 KiB ring.
    assert_eq!(sent, 4);
    assert!(matches!(
        client.try_send(&[0; 4096]),
        Err(ShmError::MessageTooLarge {
            len: 4096,
            max: 4080
        })
    ));
    for i in 0..sent {
        assert_eq!(server.try_recv().unwrap(), Some(vec![i as u8; 1000]));
    }
    assert_eq!(server.try_recv().unwrap(), None);
}

#[test]
fn message_over_the_peer_limit_is_refused_before_sending() {
    let mut limited = ShmOptions::default();
    limited.max_message_len = 1000;
    let (mut server, mut client) = connected_pair(limited, ShmOptions::default());
    assert!(matches!(
        client.send(&[0; 1001]),
        Err(ShmError::MessageTooLarge {
            len: 1001,
            max: 1000
        })
    ));
    client.send(&[1; 1000]).unwrap();
    assert_eq!(server.recv().unwrap(), vec![1; 1000]);
}

#[test]
fn recv_timeout_expires() {
    let (mut server, _client) = connected_pair(ShmOptions::default(), ShmOptions::default());
    let start = Instant::now();
    match server.recv_timeout(Duration::from_millis(50)) {
        Err(ShmError::Timeout { ms: 50 }) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
    let elapsed = start.elapsed();
    assert!(elapsed >= Duration::from_millis(50), "{elapsed:?}");
    assert!(elapsed < Duration::from_secs(5), "{elapsed:?}");
}

#[test]
fn orderly_close_delivers_pending_messages_then_reports_closed() {
    let (mut server, mut client) = connected_pair(ShmOptions::default(), ShmOptions::default());
    for i in 0..3u8 {
        client.send(&[i; 10]).unwrap();
    }
    drop(client);
    for i in 0..3u8 {
        assert_eq!(server.recv().unwrap(), vec![i; 10]);
    }
    assert!(matches!(server.recv(), Err(ShmError::PeerClosed)));
    assert!(matches!(server.try_recv(), Err(ShmError::PeerClosed)));
    assert!(matches!(server.send(b"x"), Err(ShmError::PeerClosed)));
}

#[test]
fn blocked_receiver_and_sender_wake_on_close() {
    // Receiver asleep (no spin) when the peer drops.
    let (mut server, client) =
        connected_pair(options(4096, Duration::ZERO), options(4096, Duration::ZERO));
    let dropper = thread::spawn(move || {
        thread::sleep(Duration::from_millis(100));
        drop(client);
    });
    let start = Instant::now();
    assert!(matches!(server.recv(), Err(ShmError::PeerClosed)));
    assert!(start.elapsed() < Duration::from_secs(5));
    dropper.join().unwrap();

    // Sender blocked on a full ring when the peer drops.
    let (server, mut client) =
        connected_pair(options(4096, Duration::ZERO), options(4096, Duration::ZERO));
    let dropper = thread::spawn(move || {
        thread::sleep(Duration::from_millis(100));
        drop(server);
    });
    let start = Instant::now();
    let result = (0..100).try_for_each(|_| client.send(&[0; 1000]));
    assert!(matches!(result, Err(ShmError::PeerClosed)), "{result:?}");
    assert!(start.elapsed() < Duration::from_secs(5));
    dropper.join().unwrap();
}

#[test]
fn split_halves_stream_both_ways_at_once() {
    let (server, client) = connected_pair(ShmOptions::default(), ShmOptions::default());
    let (mut server_tx, mut server_rx) = server.split();
    let (mut client_tx, mut client_rx) = client.split();
    const N: u64 = 20_000;
    let threads = [
        thread::spawn(move || {
            for i in 0..N {
                server_tx.send(&payload(i, (i % 300) as usize)).unwrap();
            }
        }),
        thread::spawn(move || {
            for i in 0..N {
                client_tx.send(&payload(i + N, (i % 500) as usize)).unwrap();
            }
        }),
        thread::spawn(move || {
            for i in 0..N {
                assert_eq!(client_rx.recv().unwrap(), payload(i, (i % 300) as usize));
            }
        }),
        thread::spawn(move || {
            for i in 0..N {
                assert_eq!(
                    server_rx.recv().unwrap(),
                    payload(i + N, (i % 500) as usize)
                );
            }
        }),
    ];
    for t in threads {
        t.join().unwrap();
    }
}

/// How many messages each direction of each stress configuration carries
/// (`RDZV_SHM_STRESS_MESSAGES`, default 50 000; ring-sized messages use a quarter).
fn stress_messages() -> u64 {
    std::env::var("RDZV_SHM_STRESS_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000)
}

/// Pauses for a random while, from nothing to a sleep, so that either side is often
/// found asleep, just going to sleep, or spinning.
fn random_pause(rng: &mut fastrand::Rng) {
    match rng.u32(0..100) {
        0..=69 => {}
        70..=89 => {
            for _ in 0..rng.u32(0..2000) {
                std::hint::spin_loop();
            }
        }
        90..=97 => thread::yield_now(),
        _ => thread::sleep(Duration::from_micros(rng.u64(1..200))),
    }
}

/// A cheap position- and index-dependent stress message, prefixed by its index.
fn stress_message(index: u64, len: usize) -> Vec<u8> {
    let mut message = index.to_le_bytes().to_vec();
    message.extend((0..len).map(|j| (index as usize).wrapping_add(j.wrapping_mul(7)) as u8));
    message
}

/// The wake-up protocol under stress: both directions at once, small rings (so senders
/// block on full rings too), random pauses, spin times from none to long. Two message
/// profiles: small ones (many records in the ring, with an occasional one larger than
/// the ring), and ring-sized ones (one record at a time in the 4 KiB ring, so every
/// send waits for the consumer to empty the ring: the producer-side race).
#[test]
fn stress_wakeups_both_directions() {
    /// Far longer than any honest wait on a loaded machine.
    const STALL: Duration = Duration::from_secs(3);
    let mut round = 0u64;
    for ring_sized in [false, true] {
        let n = if ring_sized {
            stress_messages() / 4
        } else {
            stress_messages()
        };
        for spin in [
            Duration::ZERO,
            Duration::from_micros(1),
            Duration::from_micros(30),
        ] {
            round += 1;
            let (server, client) = connected_pair(options(4096, spin), options(8192, spin));
            let (server_tx, server_rx) = server.split();
            let (client_tx, client_rx) = client.split();
            let mut threads = Vec::new();
            for (direction, mut tx, mut rx) in
                [(0u64, server_tx, client_rx), (1, client_tx, server_rx)]
            {
                let seed = round << 8 | direction;
                threads.push(thread::spawn(move || {
                    let mut rng = fastrand::Rng::with_seed(seed);
                    for i in 0..n {
                        let len = match (ring_sized, rng.u32(0..1000)) {
                            (true, _) => rng.usize(2100..4000),
                            (false, 0) => 6000,
                            (false, _) => rng.usize(0..200),
                        };
                        tx.send(&stress_message(i, len)).unwrap();
                        random_pause(&mut rng);
                    }
                }));
                threads.push(thread::spawn(move || {
                    let mut rng = fastrand::Rng::with_seed(seed ^ 0xFFFF);
                    for i in 0..n {
                        // A lost wake-up leaves the receiver asleep with data in the ring
                        // (or the sender asleep with room) until the timeout's final
                        // look: seen here as a receive that took the whole timeout.
                        let start = Instant::now();
                        let message = rx
                            .recv_timeout(STALL)
                            .unwrap_or_else(|e| panic!("spin {spin:?}, message {i}: {e}"));
                        assert!(
                            start.elapsed() < STALL,
                            "spin {spin:?}, message {i}: stalled {:?}, a lost wake-up",
                            start.elapsed()
                        );
                        assert!(
                            message == stress_message(i, message.len().saturating_sub(8)),
                            "spin {spin:?}: message {i} corrupted or out of order"
                        );
                        random_pause(&mut rng);
                    }
                }));
            }
            for t in threads {
                t.join().unwrap();
            }
        }
    }
}

#[test]
fn path_addresses_work() {
    let dir = tempfile::tempdir().unwrap();
    let addr = ShmAddr::Path(dir.path().join("shm.sock"));
    let listener = ShmListener::bind(&addr, ShmOptions::default()).unwrap();
    assert_eq!(listener.local_addr(), &addr);
    let client = thread::spawn(move || {
        let mut conn = ShmConnection::connect(&addr, ShmOptions::default())?;
        conn.send(b"over a path")?;
        Ok::<_, ShmError>(conn)
    });
    let mut server = listener.accept().unwrap();
    assert_eq!(server.recv().unwrap(), b"over a path");
    assert_eq!(server.peer_pid(), Some(std::process::id()));
    drop(client.join().unwrap().unwrap());
}

#[test]
fn connect_to_nothing_is_an_address_error() {
    let result = ShmConnection::connect(&unique_addr("nobody"), ShmOptions::default());
    assert!(
        matches!(result, Err(ShmError::Address { .. })),
        "{result:?}"
    );
}

#[test]
fn invalid_capacity_is_refused() {
    let result = ShmListener::bind_unnamed(options(5000, Duration::ZERO));
    assert!(matches!(result, Err(ShmError::InvalidOptions { .. })));
}

/// A raw `SOCK_SEQPACKET` client, to play a misbehaving peer.
fn raw_client(addr: &ShmAddr) -> std::os::fd::OwnedFd {
    use rustix::net::{
        connect, socket_with, AddressFamily, SocketAddrUnix, SocketFlags, SocketType,
    };
    let socket = socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    let ShmAddr::Abstract(name) = addr else {
        panic!("abstract address expected");
    };
    connect(&socket, &SocketAddrUnix::new_abstract_name(name).unwrap()).unwrap();
    socket
}

#[test]
fn garbage_hello_fails_the_handshake() {
    let listener = ShmListener::bind_unnamed(ShmOptions::default()).unwrap();
    let socket = raw_client(listener.local_addr());
    rustix::net::send(&socket, &[0xAB; 104], rustix::net::SendFlags::empty()).unwrap();
    let result = listener.accept();
    assert!(
        matches!(result, Err(ShmError::Handshake { .. })),
        "{result:?}"
    );
}

#[test]
fn silent_peer_times_out_the_handshake() {
    let mut opts = ShmOptions::default();
    opts.handshake_timeout = Duration::from_millis(100);
    let listener = ShmListener::bind_unnamed(opts).unwrap();
    let _socket = raw_client(listener.local_addr());
    let start = Instant::now();
    let result = listener.accept();
    assert!(
        matches!(result, Err(ShmError::Handshake { .. })),
        "{result:?}"
    );
    assert!(start.elapsed() < Duration::from_secs(5));
}

/// A peer claiming another boot id is refused, and told why.
#[test]
fn peer_on_another_host_is_rejected_with_a_reason() {
    use rustix::net::{RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let listener = ShmListener::bind_unnamed(ShmOptions::default()).unwrap();
    let socket = raw_client(listener.local_addr());
    let server = thread::spawn(move || listener.accept());

    // The documented hello layout, with a foreign boot id.
    let boot_id = b"00000000-0000-0000-0000-000000000000";
    let mut hello = [0u8; 104];
    hello[..8].copy_from_slice(b"RDZVSHM\0");
    hello[8..10].copy_from_slice(&1u16.to_le_bytes());
    hello[10..12].copy_from_slice(&(boot_id.len() as u16).to_le_bytes());
    hello[16..24].copy_from_slice(&4096u64.to_le_bytes());
    hello[24..32].copy_from_slice(&1024u64.to_le_bytes());
    hello[32..40].copy_from_slice(&1u64.to_le_bytes());
    hello[40..40 + boot_id.len()].copy_from_slice(boot_id);
    let memfd = rustix::fs::memfd_create("fake", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let flags = rustix::event::EventfdFlags::CLOEXEC;
    let (e1, e2) = (
        rustix::event::eventfd(0, flags).unwrap(),
        rustix::event::eventfd(0, flags).unwrap(),
    );
    let fds = [memfd.as_fd(), e1.as_fd(), e2.as_fd()];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(3))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
    rustix::net::sendmsg(
        &socket,
        &[IoSlice::new(&hello)],
        &mut control,
        SendFlags::empty(),
    )
    .unwrap();

    let result = server.join().unwrap();
    assert!(
        matches!(result, Err(ShmError::NotSameHost { .. })),
        "{result:?}"
    );
    // Skip the server's hello, then read its verdict.
    let mut buf = [0u8; 512];
    rustix::net::recv(&socket, &mut buf, RecvFlags::empty()).unwrap();
    let (n, _) = rustix::net::recv(&socket, &mut buf, RecvFlags::empty()).unwrap();
    assert_eq!(buf[0], 1, "a rejection");
    let reason = String::from_utf8_lossy(&buf[1..n]);
    assert!(reason.contains("not on this host"), "{reason}");
}

// ---- two processes ----

/// Starts this test binary as a peer acting out `role`, connecting to `addr`. The peer
/// exits when the returned [`Peer`] is dropped.
fn spawn_child(role: &str, addr: &ShmAddr, capacity: usize) -> Peer {
    let ShmAddr::Abstract(name) = addr else {
        panic!("abstract address expected");
    };
    let mut command = Command::new(std::env::current_exe().expect("test binary path"));
    command
        .args([
            "child_process_entry",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ROLE, role)
        .env(
            CHILD_ADDR,
            String::from_utf8(name.clone()).expect("utf-8 name"),
        )
        .env(CHILD_CAPACITY, capacity.to_string())
        .stdout(Stdio::null());
    Peer::spawn(format!("shm peer process ({role})"), command)
}

/// The peer side of the multi-process tests. Ignored: the tests below run it in a child
/// process with `--ignored --exact`; run on its own it has no role and returns.
#[test]
#[ignore = "entry point of the child process of the multi-process tests"]
fn child_process_entry() {
    let Ok(role) = std::env::var(CHILD_ROLE) else {
        eprintln!("child_process_entry: {CHILD_ROLE} unset; only the multi-process tests run this");
        return;
    };
    rdzv_test_support::exit_when_parent_gone();
    let addr = ShmAddr::Abstract(std::env::var(CHILD_ADDR).unwrap().into_bytes());
    let capacity = std::env::var(CHILD_CAPACITY).unwrap().parse().unwrap();
    let mut conn =
        ShmConnection::connect(&addr, options(capacity, Duration::from_micros(50))).unwrap();
    match role.as_str() {
        "echo" => {
            echo(conn).unwrap();
        }
        "hang" => {
            conn.send(b"ready").unwrap();
            // Never reads or closes: the parent kills us.
            loop {
                thread::sleep(Duration::from_secs(1));
            }
        }
        "send-and-exit" => {
            for i in 0..3u8 {
                conn.send(&[i; 100]).unwrap();
            }
            // Exit without dropping the connection: the parent sees the process go,
            // not an orderly close.
            std::process::exit(0);
        }
        other => panic!("unknown child role {other}"),
    }
}

#[test]
fn two_processes_ping_pong_byte_for_byte() {
    let listener = ShmListener::bind(&unique_addr("pp"), ShmOptions::default()).unwrap();
    let child = spawn_child("echo", listener.local_addr(), 2 << 20);
    let mut conn = listener.accept().unwrap();
    assert_eq!(conn.peer_pid(), Some(child.id()));
    for i in 0..2_000u64 {
        let len = match i % 100 {
            0 => 1 << 20,
            1 => 3 << 20,
            n => (n * 41) as usize,
        };
        let message = payload(i, len);
        conn.send(&message).unwrap();
        let echoed = conn.recv().unwrap();
        assert!(echoed == message, "round trip {i} ({len} bytes) corrupted");
    }
    drop(conn);
    child.expect_success(Duration::from_secs(60));
}

#[test]
fn peer_killed_mid_recv_fails_promptly() {
    let listener = ShmListener::bind(&unique_addr("kill"), ShmOptions::default()).unwrap();
    let mut child = spawn_child("hang", listener.local_addr(), 2 << 20);
    let mut conn = listener.accept().unwrap();
    assert_eq!(conn.recv().unwrap(), b"ready");
    let killed_at = thread::spawn(move || {
        thread::sleep(Duration::from_millis(200));
        child.child_mut().kill().unwrap();
        let at = Instant::now();
        child.wait(Duration::from_secs(60));
        at
    });
    let result = conn.recv();
    let returned_at = Instant::now();
    let killed_at = killed_at.join().unwrap();
    assert!(matches!(result, Err(ShmError::PeerGone)), "{result:?}");
    let delay = returned_at.saturating_duration_since(killed_at);
    assert!(
        delay < Duration::from_secs(1),
        "recv returned {delay:?} after the kill"
    );
    // And it stays failed.
    assert!(matches!(conn.recv(), Err(ShmError::PeerGone)));
}

#[test]
fn sender_blocked_on_full_ring_fails_when_peer_is_killed() {
    let listener = ShmListener::bind(&unique_addr("full"), ShmOptions::default()).unwrap();
    // The child's inbox is 4 KiB and it never reads it.
    let mut child = spawn_child("hang", listener.local_addr(), 4096);
    let mut conn = listener.accept().unwrap();
    assert_eq!(conn.recv().unwrap(), b"ready");
    let killer = thread::spawn(move || {
        thread::sleep(Duration::from_millis(200));
        child.child_mut().kill().unwrap();
        child.wait(Duration::from_secs(60));
    });
    let start = Instant::now();
    let result = (0..1000).try_for_each(|_| conn.send(&[7; 1000]));
    assert!(matches!(result, Err(ShmError::PeerGone)), "{result:?}");
    assert!(start.elapsed() < Duration::from_secs(5));
    killer.join().unwrap();
}

#[test]
fn messages_published_before_the_peer_exits_are_delivered() {
    let listener = ShmListener::bind(&unique_addr("exit"), ShmOptions::default()).unwrap();
    let child = spawn_child("send-and-exit", listener.local_addr(), 2 << 20);
    let mut conn = listener.accept().unwrap();
    child.expect_success(Duration::from_secs(60));
    for i in 0..3u8 {
        assert_eq!(conn.recv().unwrap(), vec![i; 100]);
    }
    assert!(matches!(conn.recv(), Err(ShmError::PeerGone)));
}
