//! The `ibv` transport behind the agent's seam, without the agent: accepted and
//! connected on one `LocalExecutor` (as the agent runs them), frames of every size
//! byte for byte, both peers sending 8 MiB at each other at once (a large write must not
//! stop reads), more frames than the ring has credit for, and the end of the stream in
//! each direction; a queue pair forced into the error state under frames in flight,
//! which fails both ends' pending work promptly (the aborted end with
//! `IBV_WC_WR_FLUSH_ERR`); and a hostile peer whose zero-copy message is larger than its
//! frame header announced, refused before the receiver allocates it. Skipped (with the
//! reason) on hosts without verbs; run by `rdma/softroce/run` in a Soft-RoCE VM, where a
//! missing device fails them.

mod verbs_env;

use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdzv_core::device::Device;
use rdzv_core::negotiate::TransportKind;
use rdzv_core::rpc::frame::{FrameKind, FrameLimits, TensorDescriptor};
use rdzv_rdma::ibv::connection::{ConnectionOptions, IbvConnection};
use rdzv_rdma::ibv::transport::framing::{split_frame, SEPARATE_MIN};
use rdzv_rdma::ibv::transport::{parse_address, queue_pair_abort, IbvTransport, SCHEME};
use rdzv_uring::rpc::transport::{
    Connection, FrameReceiver, FrameSender, IncomingFrame, LocalExecutor, OwnedFrame, Transport,
};

/// How long a failure may take to reach a pending receive or send: the link notices a
/// failed completion or the peer's gone bootstrap connection at once, so this only
/// leaves room for a slow (emulated) machine.
const PROMPT: Duration = Duration::from_secs(20);

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(131).wrapping_add(seed * 7) as u8 ^ (i >> 13) as u8)
        .collect()
}

fn frame(id: u64, payload: usize, tensors: &[usize]) -> OwnedFrame {
    OwnedFrame {
        handler: "echo".into(),
        metadata: vec![id as u8; 3],
        payload: pattern(payload, id + 1000),
        tensors: tensors
            .iter()
            .map(|&len| TensorDescriptor::inline(Device::cpu(), Device::cpu(), len as u64))
            .collect(),
        tensor_data: tensors
            .iter()
            .enumerate()
            .map(|(i, &len)| pattern(len, id * 10 + i as u64).into())
            .collect(),
        ..OwnedFrame::empty(FrameKind::Request, id)
    }
}

fn expect_frame(rx: &mut Box<dyn FrameReceiver>, want: &OwnedFrame) {
    let got = rx
        .recv(FrameLimits::DEFAULT)
        .unwrap_or_else(|e| panic!("receiving frame {}: {e}", want.message_id))
        .unwrap_or_else(|| panic!("the stream ended before frame {}", want.message_id));
    check_frame(&got, want);
}

fn check_frame(got: &IncomingFrame, want: &OwnedFrame) {
    assert_eq!(got.message_id, want.message_id);
    assert_eq!(got.kind, want.kind);
    assert_eq!(got.handler, want.handler);
    assert_eq!(got.metadata, want.metadata);
    assert!(
        got.payload == want.payload,
        "payload of frame {}",
        want.message_id
    );
    assert_eq!(got.wire_len, want.encoded_len() as u64);
    let datas: Vec<&Vec<u8>> = got.tensors.iter().map(|(_, d)| d).collect();
    let wanted: Vec<&[u8]> = want.tensor_data.iter().map(|d| d.as_slice()).collect();
    let datas: Vec<&[u8]> = datas.into_iter().map(Vec::as_slice).collect();
    assert!(datas == wanted, "tensors of frame {}", want.message_id);
}

/// Fails the process (instead of hanging the VM) when a phase takes too long.
fn watchdog() -> std::sync::mpsc::Sender<&'static str> {
    let (tx, rx) = std::sync::mpsc::channel::<&'static str>();
    std::thread::spawn(move || {
        let mut phase = "start";
        loop {
            match rx.recv_timeout(std::time::Duration::from_secs(90)) {
                Ok(next) => {
                    println!("phase: {next}");
                    phase = next;
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    println!("the test hung in phase {phase}");
                    std::process::exit(101);
                }
            }
        }
    });
    tx
}

/// Runs `f` on the executor the agent runs the seam's futures on.
fn run<T>(f: impl std::future::Future<Output = T>) -> T {
    LocalExecutor::new()
        .map(|executor| executor.run(f))
        .unwrap_or_else(|e| panic!("executor: {e}"))
}

/// Listens, then connects to itself: (the connecting side, the accepting side).
fn pair(transport: &mut IbvTransport) -> (Connection, Connection) {
    let address = transport.listen().unwrap_or_else(|e| panic!("listen: {e}"));
    assert!(address.starts_with(SCHEME), "{address}");
    let transport = &*transport;
    run(async move {
        let (client, server) =
            futures_lite::future::zip(transport.connect(&address), transport.accept()).await;
        (
            client.unwrap_or_else(|e| panic!("connect: {e}")),
            server.unwrap_or_else(|e| panic!("accept: {e}")),
        )
    })
}

/// Sends `frame` (queued for the link's thread: it does not wait for the peer).
fn send(tx: &mut Box<dyn FrameSender>, frame: &OwnedFrame) -> u64 {
    tx.send_owned(frame.clone())
        .unwrap_or_else(|e| panic!("sending frame {}: {e}", frame.message_id))
        .0
}

#[test]
fn frames_cross_the_ibv_seam_both_ways() {
    let Some(selection) = verbs_env::selection_or_skip("frames_cross_the_ibv_seam_both_ways")
    else {
        return;
    };
    let phase = watchdog();
    if std::env::var_os("RDZV_IBV_TRACE").is_some() || verbs_env::in_softroce_vm() {
        let _ = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_writer(std::io::stdout)
            .try_init();
    }
    let mut transport = IbvTransport::with_selection(
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        selection,
        // A small ring: credits run out and the ring wraps.
        ConnectionOptions {
            ring_len: 4096,
            recv_slots: 8,
            ..ConnectionOptions::default()
        },
    );
    assert_eq!(transport.kind(), TransportKind::Ibv);
    assert!(transport.domain_descriptor().starts_with("ibv:"));
    let _ = phase.send("connect");
    let (a, b) = pair(&mut transport);
    let (mut a_tx, mut a_rx, mut b_tx, mut b_rx) = (a.sender, a.receiver, b.sender, b.receiver);

    // Every size class, one direction.
    let frames = [
        frame(1, 0, &[]),
        frame(2, 1, &[0, 1]),
        frame(3, 20_000, &[3000, 1 << 20]),
        frame(4, 5, &[8 << 20]),
    ];
    let _ = phase.send("one direction");
    for f in &frames {
        assert_eq!(send(&mut a_tx, f), f.encoded_len() as u64);
    }
    for f in &frames {
        expect_frame(&mut b_rx, f);
    }

    let _ = phase.send("both directions");
    // Both sides send 8 MiB and many small frames at once, then read.
    let big_a = frame(10, 0, &[8 << 20]);
    let big_b = frame(20, 0, &[8 << 20]);
    let small: Vec<OwnedFrame> = (100..140).map(|id| frame(id, 700, &[900])).collect();
    for f in std::iter::once(&big_a).chain(&small) {
        send(&mut a_tx, f);
    }
    for f in std::iter::once(&big_b).chain(&small) {
        send(&mut b_tx, f);
    }
    for f in std::iter::once(&big_a).chain(&small) {
        expect_frame(&mut b_rx, f);
    }
    for f in std::iter::once(&big_b).chain(&small) {
        expect_frame(&mut a_rx, f);
    }

    let _ = phase.send("ends");
    // The end of one direction (the sender dropped); the other still works; then the
    // other ends.
    drop(a_tx);
    assert!(matches!(b_rx.recv(FrameLimits::DEFAULT), Ok(None)));
    assert!(matches!(b_rx.recv(FrameLimits::DEFAULT), Ok(None)));
    let last = frame(30, 3, &[40_000]);
    send(&mut b_tx, &last);
    expect_frame(&mut a_rx, &last);
    // Limits apply before a frame is accepted.
    send(&mut b_tx, &frame(31, 0, &[16]));
    assert!(a_rx.recv(FrameLimits::HANDSHAKE).is_err());
    let _ = phase.send("second end");
    drop((a_rx, b_tx, b_rx));
    let _ = phase.send("refused connection");

    // Connecting to a port nobody listens on fails with the address.
    let dead = format!("{SCHEME}127.0.0.1:1");
    let failed = run(transport.connect(&dead)).err().map(|e| e.to_string());
    assert!(
        failed.as_deref().is_some_and(|t| t.contains("127.0.0.1:1")),
        "{failed:?}"
    );
    let _ = phase.send("done");
}

#[test]
fn a_queue_pair_forced_into_error_fails_pending_frames() {
    let test = "a_queue_pair_forced_into_error_fails_pending_frames";
    let Some(selection) = verbs_env::selection_or_skip(test) else {
        return;
    };
    let phase = watchdog();
    let mut transport = IbvTransport::with_selection(
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        selection,
        ConnectionOptions::default(),
    );
    let _ = phase.send("connect");
    let (a, b) = pair(&mut transport);
    let (mut a_tx, mut a_rx, mut b_tx, mut b_rx) = (a.sender, a.receiver, b.sender, b.receiver);
    let Some(abort) = queue_pair_abort(&*a_rx) else {
        panic!("the receiving half of an ibv connection is not an ibv one")
    };

    let _ = phase.send("both ways");
    let request = frame(1, 10, &[100, 64 << 10]);
    send(&mut a_tx, &request);
    expect_frame(&mut b_rx, &request);
    let reply = frame(2, 10, &[]);
    send(&mut b_tx, &reply);
    expect_frame(&mut a_rx, &reply);

    let _ = phase.send("in flight");
    // Requests with zero-copy tensors that the peer has not read (or not all), while A
    // waits for a reply that never comes: its queue pair fails meanwhile.
    let requests: Vec<OwnedFrame> = (10..14).map(|id| frame(id, 64, &[4 << 20])).collect();
    for f in &requests {
        send(&mut a_tx, f);
    }
    let started = Instant::now();
    let aborting = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        abort.abort();
    });
    let pending = a_rx.recv(FrameLimits::DEFAULT);
    let a_took = started.elapsed();
    let _ = aborting.join();
    let a_err = match pending {
        Err(e) => e.to_string(),
        Ok(got) => panic!("A's pending receive gave {got:?} instead of failing"),
    };
    println!("aborted side, after {a_took:?}: {a_err}");
    assert!(a_err.contains("IBV_WC_WR_FLUSH_ERR"), "{a_err}");
    assert!(
        a_took < PROMPT,
        "A's pending receive failed after {a_took:?}"
    );
    // Later sends fail at once, with the same status.
    let sent = a_tx.send(&frame(20, 1, &[]));
    let a_send_err = sent.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(a_send_err.contains("IBV_WC_WR_FLUSH_ERR"), "{a_send_err:?}");

    let _ = phase.send("peer");
    // The peer: the frames that arrived whole are intact, then its pipe fails (it is not
    // a graceful end), without waiting for any timer of the agent.
    let started = Instant::now();
    let mut intact = 0;
    let b_err = loop {
        match b_rx.recv(FrameLimits::DEFAULT) {
            Ok(Some(got)) => {
                let want = requests
                    .get(intact)
                    .unwrap_or_else(|| panic!("frame {} was never sent", got.message_id));
                check_frame(&got, want);
                intact += 1;
            }
            Ok(None) => panic!("the peer saw a graceful end after {intact} frames"),
            Err(e) => break e.to_string(),
        }
    };
    let b_took = started.elapsed();
    println!("peer, after {b_took:?} and {intact} whole frames: {b_err}");
    assert!(
        b_took < PROMPT,
        "the peer's receive failed after {b_took:?}"
    );
    assert!(b_tx.send(&frame(21, 1, &[])).is_err());

    let _ = phase.send("close");
    // Dropping the failed halves returns at once.
    let started = Instant::now();
    drop((a_tx, a_rx, b_tx, b_rx, a.control, b.control));
    assert!(started.elapsed() < PROMPT);
    let _ = phase.send("done");
}

#[test]
fn a_part_larger_than_its_header_announced_is_refused_before_it_is_read() {
    let test = "a_part_larger_than_its_header_announced_is_refused_before_it_is_read";
    let Some(selection) = verbs_env::selection_or_skip(test) else {
        return;
    };
    let phase = watchdog();
    let mut transport = IbvTransport::with_selection(
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        selection.clone(),
        ConnectionOptions::default(),
    );
    let address = transport.listen().unwrap_or_else(|e| panic!("listen: {e}"));
    let addr = parse_address(&address).unwrap_or_else(|e| panic!("listener address: {e}"));
    {
        let announced = 2 * SEPARATE_MIN;
        let claimed = 1usize << 20;
        let _ = phase.send("hostile peer");
        // A bare channel: a first message announcing a 32 KiB payload, then a 1 MiB
        // zero-copy message in its place.
        let hostile = std::thread::spawn(move || {
            let mut stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("{e}"));
            let mut channel =
                IbvConnection::connect(&selection, &mut stream, &ConnectionOptions::default())
                    .unwrap_or_else(|e| panic!("hostile connect: {e}"));
            let messages = split_frame(frame(1, announced, &[])).unwrap_or_default();
            assert_eq!(messages.get(1).map(Vec::len), Some(announced));
            let first = messages.first().cloned().unwrap_or_default();
            channel.send(&first).unwrap_or_else(|e| panic!("{e}"));
            channel
                .send_buffer(Arc::new(vec![7u8; claimed]))
                .unwrap_or_else(|e| panic!("{e}"));
            // Until the receiver gives up: its link closes the bootstrap connection.
            let _ = stream.set_read_timeout(Some(Duration::from_secs(60)));
            let mut buf = [0u8; 16];
            let _ = stream.read(&mut buf);
        });
        let mut server = run(transport.accept()).unwrap_or_else(|e| panic!("accept: {e}"));
        let _ = phase.send("refusal");
        let started = Instant::now();
        let refused = match server.receiver.recv(FrameLimits::DEFAULT) {
            Err(e) => e.to_string(),
            Ok(got) => panic!("the hostile frame gave {got:?}"),
        };
        println!("after {:?}: {refused}", started.elapsed());
        assert!(started.elapsed() < PROMPT);
        for what in [
            format!("large message of {claimed} bytes"),
            format!("limit {announced}"),
            format!("announced {announced} bytes"),
        ] {
            assert!(refused.contains(&what), "{what:?} not in {refused}");
        }
        let _ = phase.send("hostile peer ends");
        hostile
            .join()
            .unwrap_or_else(|_| panic!("the hostile peer's thread panicked"));
        let _ = phase.send("done");
    }
}
