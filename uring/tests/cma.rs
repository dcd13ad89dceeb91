//! The cma channel between two real processes: this test binary re-runs itself as the
//! exporting child (`RDZV_CMA_CHILD` set, only the `child_role` test), which prints its
//! descriptor on stdout and waits for the ack on stdin.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use rdzv_uring::channel::cma::{self, CmaDescriptor, CmaError, CmaExport, CmaPeer};
use rdzv_uring::channel::TransferAck;

/// Set in the child: `<mode>:<size>`.
const CHILD_ENV: &str = "RDZV_CMA_CHILD";

/// Byte `i` of the test pattern of stream `seed`.
fn pattern_byte(i: usize, seed: u64) -> u8 {
    ((i as u64 ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len).map(|i| pattern_byte(i, seed)).collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    let text = text.trim();
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The child's side. Not a test of its own: it does nothing unless spawned by one.
#[test]
fn child_role() {
    let Ok(role) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (mode, size) = role.split_once(':').expect("role is mode:size");
    let size: usize = size.parse().expect("size");
    // Sets PR_SET_PTRACER_ANY under Yama scope 1, as an exporting process must.
    let domain = cma::viability().map(|d| d.to_string());
    println!("DOMAIN {}", domain.as_deref().unwrap_or("not-viable"));
    let source = pattern(size, size as u64);
    let export = CmaExport::new(source.as_slice()).expect("export");
    println!("DESCRIPTOR {}", hex(&export.descriptor().encode()));
    std::io::stdout().flush().expect("flush");
    if mode == "exit" {
        std::process::exit(0);
    }
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).expect("ack line");
    let ack = line
        .strip_prefix("ACK ")
        .and_then(unhex)
        .and_then(|bytes| TransferAck::decode(&bytes).ok())
        .expect("an ack");
    let back = export.complete(&ack).expect("the ack matches");
    assert_eq!(back, pattern(size, size as u64).as_slice());
    println!("DONE");
}

/// A running child that exported `size` bytes.
struct Exporter {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    domain: String,
    descriptor: CmaDescriptor,
}

impl Exporter {
    fn spawn(mode: &str, size: usize) -> Exporter {
        let mut child = Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", "child_role", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, format!("{mode}:{size}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn child");
        let stdin = child.stdin.take().expect("stdin piped");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout piped"));
        let domain = expect_line(&mut stdout, "DOMAIN ");
        let descriptor = unhex(&expect_line(&mut stdout, "DESCRIPTOR "))
            .and_then(|bytes| CmaDescriptor::decode(&bytes).ok())
            .expect("a descriptor");
        Exporter {
            child,
            stdin,
            stdout,
            domain,
            descriptor,
        }
    }

    /// Sends the ack and checks that the child got its buffer back intact.
    fn finish(mut self, ack: &TransferAck) {
        writeln!(self.stdin, "ACK {}", hex(&ack.encode())).expect("send ack");
        expect_line(&mut self.stdout, "DONE");
        let status = self.child.wait().expect("child exit");
        assert!(status.success(), "child failed: {status}");
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What follows `prefix` on the first line holding it (libtest prints its own lines).
fn expect_line(stdout: &mut BufReader<ChildStdout>, prefix: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        let n = stdout.read_line(&mut line).expect("read child stdout");
        assert!(n > 0, "child closed stdout before printing {prefix:?}");
        // libtest may print "test child_role ... " on the same line first.
        if let Some(at) = line.find(prefix) {
            return line[at + prefix.len()..].trim().to_owned();
        }
    }
}

/// Whether cma works here; prints why not when it does not (the test then checks
/// nothing more and says so).
fn viable_or_skip(test: &str) -> bool {
    match cma::viability() {
        Ok(_) => true,
        Err(reason) => {
            eprintln!("SKIPPED {test}: {reason}");
            false
        }
    }
}

#[test]
fn transfers_are_byte_exact() {
    if !viable_or_skip("transfers_are_byte_exact") {
        return;
    }
    for size in [0usize, 1, 1 << 20, 64 << 20] {
        let exporter = Exporter::spawn("serve", size);
        assert_eq!(exporter.descriptor.length, size as u64);
        let mut dst = vec![0xA5u8; size];
        let peer = CmaPeer::open(&exporter.descriptor.process).expect("open peer");
        let ack = peer.read(&exporter.descriptor, &mut dst).expect("cma read");
        assert_eq!(ack.transfer_id, exporter.descriptor.transfer_id);
        if let Some(i) = (0..size).find(|&i| dst[i] != pattern_byte(i, size as u64)) {
            panic!("{size} B transfer differs at byte {i}");
        }
        exporter.finish(&ack);
    }
}

#[test]
fn slices_of_a_remote_buffer() {
    if !viable_or_skip("slices_of_a_remote_buffer") {
        return;
    }
    let size = 3 << 20;
    let exporter = Exporter::spawn("serve", size);
    let peer = CmaPeer::open(&exporter.descriptor.process).expect("open peer");
    let mut dst = vec![0u8; size];
    for (i, chunk) in dst.chunks_mut(1 << 20).enumerate() {
        peer.read_at(&exporter.descriptor, (i << 20) as u64, chunk)
            .expect("slice read");
    }
    assert!(dst == pattern(size, size as u64));
    let ack = TransferAck {
        transfer_id: exporter.descriptor.transfer_id,
    };
    exporter.finish(&ack);
}

#[test]
fn peer_exit_is_reported_quickly() {
    if !viable_or_skip("peer_exit_is_reported_quickly") {
        return;
    }
    // Opened while alive, then killed: the next read says the peer is gone.
    let exporter = Exporter::spawn("serve", 4096);
    let descriptor = exporter.descriptor;
    let peer = CmaPeer::open(&descriptor.process).expect("open peer");
    exporter.kill();
    let mut dst = vec![0u8; 4096];
    let started = Instant::now();
    let err = peer.read(&descriptor, &mut dst).expect_err("peer is dead");
    assert!(err.is_peer_gone(), "{err}");
    assert!(!peer.is_alive());
    assert!(started.elapsed() < Duration::from_secs(1));

    // Exited before anyone opened it.
    let exporter = Exporter::spawn("exit", 4096);
    let descriptor = exporter.descriptor;
    exporter.kill();
    let started = Instant::now();
    let err = cma::read(&descriptor, &mut dst).expect_err("peer exited");
    assert!(err.is_peer_gone(), "{err}");
    assert!(started.elapsed() < Duration::from_secs(1));
}

#[test]
fn bad_address_is_explained() {
    if !viable_or_skip("bad_address_is_explained") {
        return;
    }
    let exporter = Exporter::spawn("serve", 4096);
    let peer = CmaPeer::open(&exporter.descriptor.process).expect("open peer");
    let forged = CmaDescriptor {
        address: 0x1000,
        ..exporter.descriptor
    };
    let mut dst = vec![0u8; 4096];
    let err = peer.read(&forged, &mut dst).expect_err("unmapped");
    assert!(
        matches!(
            err,
            CmaError::BadAddress {
                address: 0x1000,
                length: 4096,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("EFAULT"), "{err}");
    // The real descriptor still works afterwards.
    let ack = peer
        .read(&exporter.descriptor, &mut dst)
        .expect("real read");
    exporter.finish(&ack);
}

#[test]
fn viability_on_this_host() {
    match cma::viability() {
        Ok(domain) => {
            // Another process of the same user on this host advertises the same domain.
            let exporter = Exporter::spawn("serve", 0);
            assert_eq!(exporter.domain, domain.to_string());
            assert!(domain.as_str().starts_with("cma:"));
            println!("cma viable here: {domain}");
            let ack = TransferAck {
                transfer_id: exporter.descriptor.transfer_id,
            };
            exporter.finish(&ack);
        }
        Err(reason) => {
            println!("SKIPPED viability_on_this_host (cma not viable): {reason}");
            assert!(reason.to_string().starts_with("cma channel not viable"));
        }
    }
}

/// Bandwidth of 64 MiB cma reads between two processes (printed, not asserted):
/// `cargo test -p rdzv-uring --test cma bandwidth -- --nocapture`.
#[test]
fn bandwidth_64mib() {
    if !viable_or_skip("bandwidth_64mib") {
        return;
    }
    const SIZE: usize = 64 << 20;
    const ROUNDS: u32 = 8;
    let exporter = Exporter::spawn("serve", SIZE);
    let peer = CmaPeer::open(&exporter.descriptor.process).expect("open peer");
    let mut dst = vec![0u8; SIZE];
    peer.read(&exporter.descriptor, &mut dst)
        .expect("warm-up read");
    let started = Instant::now();
    for _ in 0..ROUNDS {
        peer.read(&exporter.descriptor, &mut dst)
            .expect("timed read");
    }
    let elapsed = started.elapsed();
    let gbytes_per_s = (SIZE as f64 * f64::from(ROUNDS)) / elapsed.as_secs_f64() / 1e9;
    println!(
        "cma bandwidth: {ROUNDS} x 64 MiB in {:.1} ms = {gbytes_per_s:.2} GB/s",
        elapsed.as_secs_f64() * 1e3
    );
    // The ceiling for comparison: one in-process memcpy of the same size.
    let source = pattern(SIZE, 1);
    let mut copy = vec![0u8; SIZE];
    copy.copy_from_slice(&source);
    let started = Instant::now();
    for _ in 0..ROUNDS {
        copy.copy_from_slice(std::hint::black_box(&source));
    }
    let memcpy = (SIZE as f64 * f64::from(ROUNDS)) / started.elapsed().as_secs_f64() / 1e9;
    println!("in-process memcpy of 64 MiB for reference: {memcpy:.2} GB/s");
    assert!(dst == pattern(SIZE, SIZE as u64));
    let ack = TransferAck {
        transfer_id: exporter.descriptor.transfer_id,
    };
    exporter.finish(&ack);
}
