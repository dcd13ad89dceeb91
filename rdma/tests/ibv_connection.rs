//! The verbs connection on a real device: connection setup over a TCP bootstrap, small
//! messages byte for byte, ring wrap-around, credit exhaustion and a queue pair forced
//! into the error state. Skipped (with the reason) on hosts without verbs; run by
//! `rdma/softroce/run` in a Soft-RoCE VM, where a missing device fails them.

mod verbs_env;

use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use rdzv_rdma::ibv::connection::{
    ConnectionError, ConnectionOptions, IbvConnection, ZERO_COPY_THRESHOLD,
};
use rdzv_rdma::ibv::wc_status::{WC_RETRY_EXC_ERR, WC_WR_FLUSH_ERR};
use rdzv_rdma::ibv::IbvSelection;

const LONG: Duration = Duration::from_secs(60);

/// Runs `a` and `b` on two threads, each with a connection connected to the other's.
fn pair<A, B, RA, RB>(selection: &IbvSelection, options: ConnectionOptions, a: A, b: B) -> (RA, RB)
where
    A: FnOnce(IbvConnection) -> RA + Send + 'static,
    B: FnOnce(IbvConnection) -> RB + Send + 'static,
    RA: Send + 'static,
    RB: Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind bootstrap listener");
    let addr = listener.local_addr().expect("listener address");
    let (sel_b, opt_b) = (selection.clone(), options.clone());
    let peer = thread::spawn(move || {
        let mut stream = TcpStream::connect(addr).expect("connect bootstrap");
        let connection = IbvConnection::connect(&sel_b, &mut stream, &opt_b).expect("connect B");
        b(connection)
    });
    let (mut stream, _) = listener.accept().expect("accept bootstrap");
    let connection = IbvConnection::connect(selection, &mut stream, &options).expect("connect A");
    let ra = a(connection);
    let rb = peer.join().expect("peer thread panicked");
    (ra, rb)
}

/// Deterministic message content: position and message number mixed.
fn pattern(n: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i * 31 + n * 7 + (i >> 8)) as u8)
        .collect()
}

#[test]
fn connects_and_moves_small_messages_both_ways() {
    let Some(sel) = verbs_env::selection_or_skip("connects_and_moves_small_messages") else {
        return;
    };
    let sizes = [0usize, 1, 7, 64, 200, 1000, 4000, 65536];
    let ((max_inline, peer_qpn), b_qpn) = pair(
        &sel,
        ConnectionOptions::default(),
        move |mut a| {
            for (n, &len) in sizes.iter().enumerate() {
                a.send(&pattern(n, len)).unwrap();
                let echo = a.recv_timeout(LONG).unwrap();
                assert_eq!(
                    echo,
                    pattern(n + 100, len),
                    "echo of message {n} ({len} bytes)"
                );
            }
            let too_big = vec![0u8; a.max_message_len() + 1];
            assert!(matches!(
                a.send(&too_big),
                Err(ConnectionError::MessageTooLarge { .. })
            ));
            (a.max_inline(), a.peer().qpn)
        },
        move |mut b| {
            for (n, &len) in sizes.iter().enumerate() {
                let got = b.recv_timeout(LONG).unwrap();
                assert_eq!(got, pattern(n, len), "message {n} ({len} bytes)");
                b.send(&pattern(n + 100, len)).unwrap();
            }
            b.flush(LONG).unwrap();
            b.qp_number()
        },
    );
    println!("max_inline {max_inline}, peer QP {peer_qpn:#x}");
    assert_eq!(peer_qpn, b_qpn);
}

#[test]
fn ring_wraps_around_byte_for_byte() {
    let Some(sel) = verbs_env::selection_or_skip("ring_wraps_around") else {
        return;
    };
    let options = ConnectionOptions {
        ring_len: 4096,
        recv_slots: 8,
        ..ConnectionOptions::default()
    };
    // Sizes prime to the ring length, inline and staged, so that messages straddle the
    // end of the ring at many offsets.
    let sizes: Vec<usize> = (0..60)
        .map(|n| [1000, 1500, 97, 4096, 3, 333][n % 6])
        .collect();
    let expected = sizes.clone();
    let (sent, received) = pair(
        &sel,
        options,
        move |mut a| {
            for (n, &len) in sizes.iter().enumerate() {
                a.send(&pattern(n, len)).unwrap();
            }
            a.flush(LONG).unwrap();
            sizes.len()
        },
        move |mut b| {
            for (n, &len) in expected.iter().enumerate() {
                let got = b.recv_timeout(LONG).unwrap();
                assert_eq!(got.len(), len, "message {n}");
                assert!(got == pattern(n, len), "message {n} ({len} bytes) differs");
            }
            expected.len()
        },
    );
    assert_eq!(sent, received);
}

#[test]
fn sender_blocks_on_credits_and_loses_nothing() {
    let Some(sel) = verbs_env::selection_or_skip("sender_blocks_on_credits") else {
        return;
    };
    let options = ConnectionOptions {
        ring_len: 4096,
        recv_slots: 4,
        ..ConnectionOptions::default()
    };
    let count = 40;
    let stall = Duration::from_millis(400);
    let (first_burst, got) = pair(
        &sel,
        options,
        move |mut a| {
            // The peer reads nothing yet: credits run out after 4 messages or 4 KiB, and
            // send_timeout gives up without sending.
            let mut first_burst = 0;
            loop {
                match a.send_timeout(&pattern(first_burst, 1500), Duration::from_millis(100)) {
                    Ok(()) => first_burst += 1,
                    Err(ConnectionError::Timeout {
                        operation: "send", ..
                    }) => break,
                    Err(err) => panic!("{err}"),
                }
                assert!(first_burst < count, "credits never ran out");
            }
            // Blocking sends wait for the peer to read, and lose nothing.
            for n in 0..count {
                a.send(&pattern(1000 + n, 1500)).unwrap();
            }
            a.send(b"").unwrap();
            a.flush(LONG).unwrap();
            first_burst
        },
        move |mut b| {
            thread::sleep(stall);
            let mut got = Vec::new();
            loop {
                let msg = b.recv_timeout(LONG).unwrap();
                if msg.is_empty() {
                    break got;
                }
                got.push(msg);
            }
        },
    );
    assert!(
        (2..count).contains(&first_burst),
        "first burst {first_burst}"
    );
    assert_eq!(got.len(), first_burst + count);
    for (i, msg) in got.iter().enumerate() {
        let n = if i < first_burst {
            i
        } else {
            1000 + i - first_burst
        };
        assert!(*msg == pattern(n, 1500), "message {i} (number {n}) differs");
    }
    println!("credits ran out after {first_burst} messages; {count} more went through");
}

#[test]
fn queue_pair_forced_to_error_fails_pending_work() {
    let Some(sel) = verbs_env::selection_or_skip("queue_pair_forced_to_error") else {
        return;
    };
    let options = ConnectionOptions {
        ack_timeout: 10,
        retry_count: 1,
        ..ConnectionOptions::default()
    };
    let (a_err, b_err) = pair(
        &sel,
        options,
        move |mut a| {
            a.send(b"before").unwrap();
            // "ready" comes after the peer's credit ack for "before" (RC keeps order), so
            // nothing of the peer's is in flight when this side aborts.
            assert_eq!(a.recv_timeout(LONG).unwrap(), b"ready");
            a.abort().unwrap();
            // Pending receives are flushed: recv fails at once and names the status.
            let err = a.recv_timeout(LONG).unwrap_err();
            // The failure is sticky.
            let again = a.send(b"after").unwrap_err();
            assert_eq!(err.to_string(), again.to_string());
            err
        },
        move |mut b| {
            assert_eq!(b.recv_timeout(LONG).unwrap(), b"before");
            b.send(b"ready").unwrap();
            b.flush(LONG).unwrap();
            // Give the peer time to abort, then write into its dead queue pair.
            thread::sleep(Duration::from_millis(300));
            b.send(b"into the void").unwrap();
            b.flush(LONG).unwrap_err()
        },
    );
    println!("aborted side: {a_err}\npeer: {b_err}");
    let ConnectionError::Completion(a_fail) = &a_err else {
        panic!("expected a completion failure, got {a_err}")
    };
    assert_eq!(a_fail.status, WC_WR_FLUSH_ERR, "{a_err}");
    assert!(a_err.to_string().contains("IBV_WC_WR_FLUSH_ERR"), "{a_err}");
    let ConnectionError::Completion(b_fail) = &b_err else {
        panic!("expected a completion failure, got {b_err}")
    };
    assert_eq!(b_fail.operation, "RDMA write with immediate");
    assert_eq!(b_fail.status, WC_RETRY_EXC_ERR, "{b_err}");
}

#[test]
fn large_messages_go_zero_copy_and_stay_owned_until_read() {
    let Some(sel) = verbs_env::selection_or_skip("large_messages_go_zero_copy") else {
        return;
    };
    let options = ConnectionOptions {
        ring_len: 4096,
        ..ConnectionOptions::default()
    };
    // Above the threshold, above the ring but below the threshold, odd sizes, and one
    // buffer sent twice (a registration cache hit).
    let sizes = [ZERO_COPY_THRESHOLD, 8192, 100_003, (1 << 20) + 3, 2 << 20];
    let expected: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(n, &len)| pattern(n, len))
        .chain(std::iter::once(pattern(2, sizes[2])))
        .collect();
    let to_check = expected.clone();
    let (cached, received) = pair(
        &sel,
        options,
        move |mut a| {
            let buffers: Vec<Arc<Vec<u8>>> = expected.into_iter().map(Arc::new).collect();
            // The receiver is not reading yet: the connection must hold the buffers.
            for buf in buffers.iter().take(sizes.len()) {
                a.send_buffer(Arc::clone(buf)).unwrap();
            }
            assert_eq!(a.large_in_flight(), sizes.len());
            // Same allocation again: served from the registration cache.
            a.send_buffer(Arc::clone(&buffers[2])).unwrap();
            assert_eq!(a.cached_registrations(), sizes.len());
            // The caller gives up its handles; the connection still owns the memory.
            drop(buffers);
            a.flush(LONG).unwrap();
            assert_eq!(a.large_in_flight(), 0);
            a.cached_registrations()
        },
        move |mut b| {
            thread::sleep(Duration::from_millis(200));
            let mut received = 0;
            for (n, want) in to_check.iter().enumerate() {
                let got = b.recv_timeout(LONG).unwrap();
                assert_eq!(got.len(), want.len(), "message {n}");
                assert!(got == *want, "message {n} ({} bytes) differs", want.len());
                received += 1;
            }
            received
        },
    );
    assert_eq!(cached, sizes.len());
    assert_eq!(received, sizes.len() + 1);
}

#[test]
fn receiver_refuses_an_oversized_zero_copy_message() {
    let Some(sel) = verbs_env::selection_or_skip("receiver_refuses_oversized") else {
        return;
    };
    let options = ConnectionOptions {
        max_large_message: 1 << 20,
        ..ConnectionOptions::default()
    };
    let (_, err) = pair(
        &sel,
        options,
        |mut a| {
            a.send_buffer(Arc::new(vec![7u8; 2 << 20])).unwrap();
        },
        |mut b| b.recv_timeout(LONG).unwrap_err(),
    );
    assert!(
        matches!(err, ConnectionError::BadDescriptor { len, max, .. } if len == 2 << 20 && max == 1 << 20),
        "{err}"
    );
}

/// CPU time this thread has used.
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: one valid timespec to fill.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[test]
fn idle_receiver_sleeps_on_the_completion_channel_and_wakes() {
    let Some(sel) = verbs_env::selection_or_skip("idle_receiver_sleeps") else {
        return;
    };
    let idle = Duration::from_millis(600);
    let ((waited, cpu, timed_out_cpu), ()) = pair(
        &sel,
        ConnectionOptions::default(),
        move |mut a| {
            // Nothing arrives: the timeout is honoured without spinning all along.
            let cpu0 = thread_cpu_time();
            assert!(matches!(
                a.recv_timeout(Duration::from_millis(300)),
                Err(ConnectionError::Timeout {
                    operation: "recv",
                    ..
                })
            ));
            let timed_out_cpu = thread_cpu_time() - cpu0;
            // A message that arrives while blocked wakes the receiver.
            a.send(b"go").unwrap();
            let (start, cpu0) = (Instant::now(), thread_cpu_time());
            assert_eq!(a.recv_timeout(LONG).unwrap(), b"late");
            (start.elapsed(), thread_cpu_time() - cpu0, timed_out_cpu)
        },
        move |mut b| {
            assert_eq!(b.recv_timeout(LONG).unwrap(), b"go");
            thread::sleep(idle);
            b.send(b"late").unwrap();
            b.flush(LONG).unwrap();
        },
    );
    println!("blocked {waited:?} using {cpu:?} of CPU; timed-out wait used {timed_out_cpu:?}");
    assert!(waited >= idle / 2, "woke after {waited:?}");
    assert!(cpu < waited / 4, "spun: {cpu:?} of CPU in {waited:?}");
    assert!(
        timed_out_cpu < Duration::from_millis(100),
        "{timed_out_cpu:?}"
    );
}
