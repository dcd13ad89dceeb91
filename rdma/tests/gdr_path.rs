//! The `cuda_gdr` data path with host memory, on a real verbs device: a lender's endpoint
//! lends registered buffers, a borrower bootstraps a queue pair to it and fetches them
//! with one-sided RDMA READs, byte for byte; a wrong key or a range outside the lent
//! registration fails with the work completion status named, and nothing hangs. Lender
//! and borrower are two processes (this binary runs itself as the lender, which hands
//! its loans over as encoded `CudaGdrDescriptor`s), or two threads with separate verbs
//! domains (protection domains) and queue pairs. Skipped (with the reason) on hosts without verbs; run by
//! `rdma/softroce/run` in a Soft-RoCE VM, where a missing device fails them.

mod verbs_env;

use std::io::{BufRead, BufReader, Read};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use rdzv_core::channel::cuda::CudaGdrDescriptor;
use rdzv_rdma::ibv::connection::{ConnectionError, ConnectionOptions, IbvConnection, VerbsDomain};
use rdzv_rdma::ibv::lending::{
    Borrower, HostRegion, LendingEndpoint, LendingError, LendingOptions,
};
use rdzv_rdma::ibv::sys::AccessFlags;
use rdzv_rdma::ibv::IbvSelection;

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
            source: ConnectionError::Completion(failure),
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
        let lent = HostRegion::from_bytes(endpoint.domain(), &bytes, AccessFlags::REMOTE_READ)
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

/// Set in the lender process that [`host_buffers_lent_by_another_process_are_read`]
/// starts.
const ENV_CHILD: &str = "RDZV_GDR_PATH_LENDER";
/// What the lender process lends: (salt, length).
const CHILD_LOANS: [(usize, usize); 3] = [(1, 1), (2, (1 << 20) + 3), (3, 8 << 20)];

/// The lender process: lends [`CHILD_LOANS`], prints one hex `CudaGdrDescriptor` line per
/// loan (`LOAN <hex>`), then `READY`, and keeps them until its stdin closes. Run only by
/// the test below (it is ignored otherwise, and does nothing without its variable).
#[test]
#[ignore = "the lender process of host_buffers_lent_by_another_process_are_read"]
fn lender_process() {
    if std::env::var_os(ENV_CHILD).is_none() {
        return;
    }
    let sel = verbs_env::selection_or_skip("lender_process").expect("a verbs device");
    let endpoint = lender(&sel);
    let process = rdzv_uring::channel::current_identity().expect("this process's identity");
    let mut loans = Vec::new();
    for (salt, len) in CHILD_LOANS {
        let lent = HostRegion::from_bytes(
            endpoint.domain(),
            &pattern(len, salt),
            AccessFlags::REMOTE_READ,
        )
        .expect("register the lent buffer");
        let descriptor = CudaGdrDescriptor {
            process,
            endpoint_addr: CudaGdrDescriptor::encode_ip(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            endpoint_port: endpoint.local_addr().port(),
            address: lent.addr(),
            rkey: lent.rkey(),
            length: len as u64,
            device: 0,
        };
        let hex: String = descriptor
            .encode()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        println!("LOAN {hex}");
        loans.push(lent);
    }
    println!("READY");
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
    drop(loans);
}

#[test]
fn host_buffers_lent_by_another_process_are_read() {
    let Some(sel) = verbs_env::selection_or_skip("host_buffers_lent_by_another_process_are_read")
    else {
        return;
    };
    let exe = std::env::current_exe().expect("this test binary");
    let mut child = Command::new(exe)
        .args([
            "--exact",
            "lender_process",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ENV_CHILD, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the lender process");
    let stdout = child.stdout.take().expect("the lender's stdout");
    // libtest prints `test lender_process ... ` before the lender's own output, on the
    // same line: look for the markers anywhere in a line.
    let mut lines = BufReader::new(stdout).lines();
    let mut descriptors = Vec::new();
    for line in lines.by_ref() {
        let line = line.expect("a line from the lender");
        if let Some((_, hex)) = line.split_once("LOAN ") {
            let bytes: Vec<u8> = (0..hex.len() / 2)
                .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex"))
                .collect();
            descriptors.push(CudaGdrDescriptor::decode(&bytes).expect("a cuda_gdr descriptor"));
        } else if line.ends_with("READY") {
            break;
        }
    }
    // The rest of its output is drained, so that it never writes into a closed pipe.
    let drain = thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>());
    assert_eq!(
        descriptors.len(),
        CHILD_LOANS.len(),
        "the lender lent everything"
    );
    let borrower = borrower(&sel);
    for (lent, (salt, len)) in descriptors.iter().zip(CHILD_LOANS) {
        assert_eq!(lent.process.pid, child.id(), "lent by the other process");
        let at = SocketAddr::new(lent.endpoint_ip(), lent.endpoint_port);
        let started = Instant::now();
        let got = borrower
            .read_to_host(at, lent.address, lent.rkey, lent.length as usize)
            .unwrap_or_else(|e| panic!("read {len} bytes: {}", chain(&e)));
        println!(
            "read {len} bytes from pid {} in {:?}",
            child.id(),
            started.elapsed()
        );
        assert!(
            got == pattern(len, salt),
            "the {len} bytes read differ from those lent"
        );
    }
    // A key the lender never handed out.
    let first = descriptors[0];
    let at = SocketAddr::new(first.endpoint_ip(), first.endpoint_port);
    let err = borrower
        .read_to_host(at, first.address, first.rkey ^ 0xffff_ff00, 1)
        .expect_err("a wrong key");
    assert_eq!(
        status_of(&err),
        Some("IBV_WC_REM_ACCESS_ERR"),
        "{}",
        chain(&err)
    );
    drop(child.stdin.take());
    let deadline = Instant::now() + BOUND;
    loop {
        match child.try_wait().expect("wait for the lender") {
            Some(status) => {
                let rest = drain.join().expect("drain thread");
                assert!(
                    status.success(),
                    "the lender process failed: {status}: {rest:?}"
                );
                break;
            }
            None if Instant::now() > deadline => {
                let _ = child.kill();
                panic!("the lender process did not end within {BOUND:?}");
            }
            None => thread::sleep(Duration::from_millis(50)),
        }
    }
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
    let lent = HostRegion::from_bytes(endpoint.domain(), &bytes, AccessFlags::REMOTE_READ)
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

/// `IbvConnection::read_remote` directly, on a channel that also carries ring messages: the
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
            IbvConnection::connect_in(&domain, &sel_b, &mut stream, &ConnectionOptions::default())
                .expect("connect B");
        let announced = channel.recv_timeout(BOUND).expect("address and key");
        let (remote, rkey) = (
            u64::from_le_bytes(announced[..8].try_into().expect("8 bytes")),
            u32::from_le_bytes(announced[8..12].try_into().expect("4 bytes")),
        );
        let target = HostRegion::new(&domain, len, AccessFlags::LOCAL_WRITE).expect("target");
        // `target` is registered in `domain`, where the channel was made, with local write
        // access; the channel hands it back when every READ completed.
        let target = channel
            .read_remote(target, remote, rkey, BOUND)
            .expect("read_remote");
        channel.send(b"done").expect("send done");
        channel.flush(BOUND).expect("flush");
        target.to_vec()
    });
    let domain = VerbsDomain::open(&sel).expect("domain A");
    let lent = HostRegion::from_bytes(&domain, &bytes, AccessFlags::REMOTE_READ).expect("lent");
    let (mut stream, _) = listener.accept().expect("accept bootstrap");
    let mut channel =
        IbvConnection::connect_in(&domain, &sel, &mut stream, &ConnectionOptions::default())
            .expect("connect A");
    let mut announce = lent.addr().to_le_bytes().to_vec();
    announce.extend_from_slice(&lent.rkey().to_le_bytes());
    channel.send(&announce).expect("announce");
    assert_eq!(channel.recv_timeout(BOUND).expect("done"), b"done");
    let got = reader.join().expect("reader thread");
    assert!(got == bytes, "read_remote's bytes differ");
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
