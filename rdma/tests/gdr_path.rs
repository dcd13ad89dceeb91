//! The `cuda_gdr` data path with host memory, on a real verbs device: a lender's endpoint
//! lends registered buffers, a borrower bootstraps a queue pair to it and fetches them
//! with one-sided RDMA READs, byte for byte; a wrong key or a range outside the lent
//! registration fails with the work completion status named, and nothing hangs. Lender
//! and borrower are two threads with separate verbs domains (protection domains) and
//! queue pairs. Skipped (with the reason) on hosts without verbs; run by
//! `rdma/softroce/run` in a Soft-RoCE VM, where a missing device fails them.

mod verbs_env;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use rdzv_rdma::ibv::channel::{ChannelError, ChannelOptions, IbvChannel, VerbsDomain};
use rdzv_rdma::ibv::lending::{
    Borrower, HostRegion, LendingEndpoint, LendingError, LendingOptions,
};
use rdzv_rdma::ibv::IbvSelection;
use sideway::ibverbs::AccessFlags;

/// Far above what any of these takes, even on Soft-RoCE under TCG.
const BOUND: Duration = Duration::from_secs(30);

fn pattern(len: usize, salt: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i * 131 + salt * 17 + (i >> 11)) as u8)
        .collect()
}

fn options() -> LendingOptions {
    LendingOptions {
        bootstrap_timeout: Duration::from_secs(5),
        read_timeout: Duration::from_secs(60),
    }
}

fn lender(sel: &IbvSelection) -> LendingEndpoint {
    let domain = VerbsDomain::open(sel).expect("open the lender's domain");
    let bind: SocketAddr = "127.0.0.1:0".parse().expect("address");
    LendingEndpoint::start(sel, domain, bind, &options()).expect("start the lending endpoint")
}

fn borrower(sel: &IbvSelection) -> Borrower {
    let domain = VerbsDomain::open(sel).expect("open the borrower's domain");
    Borrower::new(sel, domain, options())
}

/// The READ's work completion status, from a failed read.
fn status_of(err: &LendingError) -> Option<&'static str> {
    match err {
        LendingError::Read {
            source: ChannelError::Completion(failure),
            ..
        } => failure.status_name(),
        _ => None,
    }
}

#[test]
fn lent_host_buffers_are_read_byte_for_byte() {
    let Some(sel) = verbs_env::selection_or_skip("lent_host_buffers_are_read_byte_for_byte") else {
        return;
    };
    let endpoint = lender(&sel);
    let borrower = borrower(&sel);
    for (salt, len) in [1usize, (1 << 20) + 3, 8 << 20].into_iter().enumerate() {
        let bytes = pattern(len, salt);
        let lent = HostRegion::from_bytes(endpoint.domain(), &bytes, AccessFlags::RemoteRead)
            .expect("register the lent buffer");
        let started = Instant::now();
        let got = borrower
            .read_to_host(endpoint.local_addr(), lent.addr(), lent.rkey(), len)
            .unwrap_or_else(|e| panic!("read {len} bytes: {}", chain(&e)));
        println!("read {len} bytes in {:?}", started.elapsed());
        assert!(got == bytes, "the {len} bytes read differ from those lent");
        // A part of the lent range too (what an offset into an allocation reads).
        if len > 10 {
            let part = borrower
                .read_to_host(
                    endpoint.local_addr(),
                    lent.addr() + 7,
                    lent.rkey(),
                    len - 10,
                )
                .unwrap_or_else(|e| panic!("read part of {len} bytes: {}", chain(&e)));
            assert!(part == bytes[7..len - 3], "the part read differs");
        }
    }
    assert_eq!(
        borrower.connections(),
        1,
        "one cached connection per lender"
    );
    // Nothing to read: no connection needed, nothing read.
    let none = borrower
        .read_to_host(endpoint.local_addr(), 0, 0, 0)
        .expect("empty read");
    assert!(none.is_empty());
}

#[test]
fn a_wrong_key_or_range_fails_with_the_status_named_and_the_next_read_reconnects() {
    let Some(sel) = verbs_env::selection_or_skip("a_wrong_key_or_range_fails") else {
        return;
    };
    let endpoint = lender(&sel);
    let borrower = borrower(&sel);
    let at = endpoint.local_addr();
    let bytes = pattern(4096, 9);
    let lent = HostRegion::from_bytes(endpoint.domain(), &bytes, AccessFlags::RemoteRead)
        .expect("register the lent buffer");

    let cases = [
        ("wrong rkey", lent.addr(), lent.rkey() ^ 0xffff_ff00, 64),
        ("past the end", lent.addr() + 4096 - 10, lent.rkey(), 20),
        ("before the start", lent.addr() - 4096, lent.rkey(), 4096),
    ];
    for (what, addr, rkey, len) in cases {
        let started = Instant::now();
        let err = borrower.read_to_host(at, addr, rkey, len).expect_err(what);
        let elapsed = started.elapsed();
        let text = chain(&err);
        println!("{what}: {text} after {elapsed:?}");
        assert!(elapsed < BOUND, "{what}: took {elapsed:?}");
        assert_eq!(
            status_of(&err),
            Some("IBV_WC_REM_ACCESS_ERR"),
            "{what}: {text}"
        );
        assert!(text.contains("IBV_WC_REM_ACCESS_ERR"), "{what}: {text}");
        assert_eq!(
            borrower.connections(),
            0,
            "{what}: the failed connection is dropped"
        );
        // The next read makes a new queue pair and succeeds.
        let got = borrower
            .read_to_host(at, lent.addr(), lent.rkey(), 4096)
            .unwrap_or_else(|e| panic!("read after {what}: {}", chain(&e)));
        assert!(got == bytes, "read after {what} differs");
        assert_eq!(borrower.connections(), 1);
    }
}

#[test]
fn unreachable_or_silent_lenders_fail_within_the_bootstrap_timeout() {
    let Some(sel) = verbs_env::selection_or_skip("unreachable_or_silent_lenders") else {
        return;
    };
    let borrower = borrower(&sel);
    // Nobody listens there.
    let closed = TcpListener::bind("127.0.0.1:0").expect("bind");
    let gone = closed.local_addr().expect("address");
    drop(closed);
    let err = borrower
        .read_to_host(gone, 0x1000, 1, 8)
        .expect_err("no lender");
    assert!(
        matches!(err, LendingError::Connect { .. }),
        "{}",
        chain(&err)
    );

    // A listener that accepts and then says nothing.
    let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
    let at = silent.local_addr().expect("address");
    let holder = thread::spawn(move || {
        let accepted = silent.accept().map(|(stream, _)| stream);
        thread::sleep(Duration::from_secs(8));
        drop(accepted);
    });
    let started = Instant::now();
    let err = borrower
        .read_to_host(at, 0x1000, 1, 8)
        .expect_err("silent lender");
    let elapsed = started.elapsed();
    println!("silent lender: {} after {elapsed:?}", chain(&err));
    assert!(
        matches!(err, LendingError::Bootstrap { .. }),
        "{}",
        chain(&err)
    );
    assert!(elapsed < Duration::from_secs(7), "took {elapsed:?}");
    holder.join().expect("holder thread");
}

/// `IbvChannel::read_remote` directly, on a channel that also carries ring messages: the
/// read lands byte for byte and the message protocol goes on afterwards.
#[test]
fn read_remote_leaves_the_channel_protocol_intact() {
    let Some(sel) = verbs_env::selection_or_skip("read_remote_leaves_the_channel_protocol_intact")
    else {
        return;
    };
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind bootstrap listener");
    let addr = listener.local_addr().expect("listener address");
    let len = (1 << 20) + 3;
    let bytes = pattern(len, 5);
    let sel_b = sel.clone();
    let reader = thread::spawn(move || {
        let domain = VerbsDomain::open(&sel_b).expect("domain B");
        let mut stream = TcpStream::connect(addr).expect("connect bootstrap");
        let mut channel =
            IbvChannel::connect_in(&domain, &sel_b, &mut stream, &ChannelOptions::default())
                .expect("connect B");
        let announced = channel.recv_timeout(BOUND).expect("address and key");
        let (remote, rkey) = (
            u64::from_le_bytes(announced[..8].try_into().expect("8 bytes")),
            u32::from_le_bytes(announced[8..12].try_into().expect("4 bytes")),
        );
        let target = HostRegion::new(&domain, len, AccessFlags::LocalWrite).expect("target");
        // SAFETY: `target` is registered in `domain`, where the channel was made, with local
        // write access, and is not touched until the call returns.
        unsafe {
            channel.read_remote(
                sel_b_lkey(&target),
                target.addr(),
                remote,
                rkey,
                len as u64,
                BOUND,
            )
        }
        .expect("read_remote");
        channel.send(b"done").expect("send done");
        channel.flush(BOUND).expect("flush");
        target.to_vec()
    });
    let domain = VerbsDomain::open(&sel).expect("domain A");
    let lent = HostRegion::from_bytes(&domain, &bytes, AccessFlags::RemoteRead).expect("lent");
    let (mut stream, _) = listener.accept().expect("accept bootstrap");
    let mut channel =
        IbvChannel::connect_in(&domain, &sel, &mut stream, &ChannelOptions::default())
            .expect("connect A");
    let mut announce = lent.addr().to_le_bytes().to_vec();
    announce.extend_from_slice(&lent.rkey().to_le_bytes());
    channel.send(&announce).expect("announce");
    assert_eq!(channel.recv_timeout(BOUND).expect("done"), b"done");
    let got = reader.join().expect("reader thread");
    assert!(got == bytes, "read_remote's bytes differ");
}

/// The local key of a read target (the trait method, named for the call above).
fn sel_b_lkey(region: &HostRegion) -> u32 {
    rdzv_rdma::ibv::lending::ReadTarget::lkey(region)
}

/// An error with its causes, as the agent reports it.
fn chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
