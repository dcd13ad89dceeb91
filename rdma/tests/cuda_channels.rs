//! The CUDA channels on a real GPU: `cuda_basic` (two endpoints over a Unix socket pair),
//! `cuda_xth` (one process) and `cuda_ipc` (two processes: this test binary re-runs itself
//! as the sending child), each moving 0 B, 1 B, 1 MiB and 64 MiB byte for byte, with a
//! bandwidth table and a device-to-device `cuMemcpy` limit row measured in the same run.
//!
//! On a host without an NVIDIA driver or GPU every test prints `SKIPPED <test>: <reason>`
//! and passes, unless `RDZV_REQUIRE_CUDA=1` is set, in which case it fails (so that a GPU
//! machine enforces them). Run on a GPU host with:
//!
//! ```text
//! RDZV_REQUIRE_CUDA=1 cargo test -p rdzv-rdma --release --test cuda_channels -- --nocapture --test-threads=1
//! ```

use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use rdzv_rdma::cuda::basic::{CudaBasicChannel, PoolConfig};
use rdzv_rdma::cuda::byte_channel::StreamChannel;
use rdzv_rdma::cuda::ipc::{CudaIpcReceiver, CudaIpcSender, DEFAULT_SLOTS, DEFAULT_SLOT_LEN};
use rdzv_rdma::cuda::memory::{copy_device_async, DeviceAllocation, Gpu};
use rdzv_rdma::cuda::{self, xth, CudaViability};

const SIZES: [usize; 4] = [0, 1, 1 << 20, 64 << 20];
const SOCKET_ENV: &str = "RDZV_CUDA_IPC_TEST_SOCKET";
const REQUIRE_ENV: &str = "RDZV_REQUIRE_CUDA";

/// The GPU to test on, or `None` after printing why the test is skipped. Panics instead of
/// skipping when `RDZV_REQUIRE_CUDA=1`.
fn gpu_or_skip(test: &str) -> Option<Gpu> {
    let reason = match cuda::probe() {
        CudaViability::Viable(_) => match Gpu::open(0) {
            Ok(gpu) => return Some(gpu),
            Err(err) => format!("CUDA device 0 cannot be opened: {err}"),
        },
        CudaViability::NotViable(reason) => reason.to_string(),
    };
    assert!(
        std::env::var(REQUIRE_ENV).as_deref() != Ok("1"),
        "{test}: {REQUIRE_ENV}=1 but CUDA is not usable: {reason}"
    );
    println!("SKIPPED {test}: {reason}");
    None
}

/// Deterministic bytes for a transfer of `len` bytes.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u64)
                .wrapping_mul(131)
                .wrapping_add(u64::from(seed) * 7 + (i as u64 >> 16)) as u8
        })
        .collect()
}

fn iterations(len: usize) -> u32 {
    match len {
        0 | 1 => 100,
        l if l <= 1 << 20 => 50,
        _ => 10,
    }
}

fn device_buffer(gpu: &Gpu, bytes: &[u8]) -> DeviceAllocation {
    let mut buffer = gpu.alloc(bytes.len()).expect("cuMemAlloc");
    buffer.copy_from_host(bytes).expect("upload");
    buffer
}

fn assert_device_holds(buffer: &DeviceAllocation, expected: &[u8], what: &str) {
    let mut back = vec![0u8; buffer.len()];
    buffer.copy_to_host(&mut back).expect("download");
    if let Some(at) = back.iter().zip(expected).position(|(a, b)| a != b) {
        panic!("{what}: first differing byte at {at} of {}", expected.len());
    }
    assert_eq!(back.len(), expected.len(), "{what}");
}

fn row(channel: &str, len: usize, iters: u32, elapsed: Duration) {
    let per = elapsed / iters.max(1);
    let gbps = if elapsed.is_zero() {
        0.0
    } else {
        (len as f64 * f64::from(iters)) / elapsed.as_secs_f64() / 1e9
    };
    println!(
        "{channel:<12} {len:>10} B  {iters:>4} iters  {:>10.1} us/transfer  {gbps:>8.2} GB/s",
        per.as_secs_f64() * 1e6
    );
}

/// The device-to-device `cuMemcpy` bandwidth on one GPU: the limit row.
fn d2d_limit(gpu: &Gpu) {
    let len = 64 << 20;
    let stream = gpu.new_stream().expect("stream");
    let src = gpu.alloc(len).expect("cuMemAlloc");
    let dst = gpu.alloc(len).expect("cuMemAlloc");
    copy_device_async(dst.range(), gpu, src.range(), gpu, &stream).expect("warm-up copy");
    stream.synchronize().expect("sync");
    let iters = 20;
    let start = Instant::now();
    for _ in 0..iters {
        copy_device_async(dst.range(), gpu, src.range(), gpu, &stream).expect("copy");
    }
    stream.synchronize().expect("sync");
    row("d2d limit", len, iters, start.elapsed());
}

#[test]
fn cuda_basic_moves_bytes_between_two_endpoints() {
    let Some(gpu) = gpu_or_skip("cuda_basic_moves_bytes_between_two_endpoints") else {
        return;
    };
    let (a, b) = UnixStream::pair().expect("socketpair");
    let sender_gpu = gpu.clone();
    let sender = std::thread::spawn(move || {
        let stream = sender_gpu.new_stream().expect("stream");
        let mut channel =
            CudaBasicChannel::new(&sender_gpu, StreamChannel::new(a), PoolConfig::default())
                .expect("sender channel");
        for (seed, len) in SIZES.into_iter().enumerate() {
            let src = device_buffer(&sender_gpu, &pattern(len, seed as u8));
            for _ in 0..=iterations(len) {
                channel.send(src.range(), &stream).expect("send");
            }
        }
    });
    let stream = gpu.new_stream().expect("stream");
    let mut channel = CudaBasicChannel::new(&gpu, StreamChannel::new(b), PoolConfig::default())
        .expect("receiver channel");
    d2d_limit(&gpu);
    for (seed, len) in SIZES.into_iter().enumerate() {
        let dst = gpu.alloc(len).expect("cuMemAlloc");
        channel.recv(dst.range(), &stream).expect("first recv");
        stream.synchronize().expect("sync");
        assert_device_holds(
            &dst,
            &pattern(len, seed as u8),
            &format!("cuda_basic {len} B"),
        );
        let iters = iterations(len);
        let start = Instant::now();
        for _ in 0..iters {
            channel.recv(dst.range(), &stream).expect("recv");
        }
        stream.synchronize().expect("sync");
        row("cuda_basic", len, iters, start.elapsed());
    }
    sender.join().expect("sender thread");
}

#[test]
fn cuda_basic_host_and_device_ends_interoperate() {
    let Some(gpu) = gpu_or_skip("cuda_basic_host_and_device_ends_interoperate") else {
        return;
    };
    let (a, b) = UnixStream::pair().expect("socketpair");
    let data = pattern(3 << 20, 9);
    let expected = data.clone();
    let sender_gpu = gpu.clone();
    let sender = std::thread::spawn(move || {
        let mut channel =
            CudaBasicChannel::new(&sender_gpu, StreamChannel::new(a), PoolConfig::default())
                .expect("sender channel");
        channel.send_host(&data).expect("send host bytes");
    });
    let stream = gpu.new_stream().expect("stream");
    let mut channel = CudaBasicChannel::new(&gpu, StreamChannel::new(b), PoolConfig::default())
        .expect("receiver channel");
    let dst = gpu.alloc(expected.len()).expect("cuMemAlloc");
    channel.recv(dst.range(), &stream).expect("recv");
    stream.synchronize().expect("sync");
    assert_device_holds(&dst, &expected, "host → device");
    sender.join().expect("sender thread");
}

#[test]
fn cuda_xth_moves_bytes_within_the_process() {
    let Some(gpu) = gpu_or_skip("cuda_xth_moves_bytes_within_the_process") else {
        return;
    };
    // A second device, when there is one, exercises the peer copy.
    let peer = Gpu::open(1).ok();
    let targets: Vec<(&str, Gpu)> = std::iter::once(("cuda_xth", gpu.clone()))
        .chain(peer.map(|p| ("cuda_xth 0→1", p)))
        .collect();
    d2d_limit(&gpu);
    let (tx, rx) = xth::pair();
    let send_stream = gpu.new_stream().expect("stream");
    for (name, dst_gpu) in targets {
        let recv_stream = dst_gpu.new_stream().expect("stream");
        for (seed, len) in SIZES.into_iter().enumerate() {
            let expected = pattern(len, seed as u8 + 20);
            let src = device_buffer(&gpu, &expected);
            let dst = dst_gpu.alloc(len).expect("cuMemAlloc");
            let pending = tx.send(src.range(), &send_stream).expect("send");
            rx.recv(dst.range(), &recv_stream).expect("recv");
            pending.wait(&send_stream).expect("wait");
            recv_stream.synchronize().expect("sync");
            assert_device_holds(&dst, &expected, &format!("{name} {len} B"));
            let iters = iterations(len);
            let start = Instant::now();
            for _ in 0..iters {
                let pending = tx.send(src.range(), &send_stream).expect("send");
                rx.recv(dst.range(), &recv_stream).expect("recv");
                pending.wait(&send_stream).expect("wait");
            }
            recv_stream.synchronize().expect("sync");
            send_stream.synchronize().expect("sync");
            row(name, len, iters, start.elapsed());
        }
    }
    // A length mismatch fails both ends instead of copying.
    let src = gpu.alloc(8).expect("cuMemAlloc");
    let dst = gpu.alloc(9).expect("cuMemAlloc");
    let pending = tx.send(src.range(), &send_stream).expect("send");
    assert!(rx.recv(dst.range(), &send_stream).is_err());
    assert!(pending.wait(&send_stream).is_err());
}

/// The sending half of `cuda_ipc_moves_bytes_between_two_processes`, run in a child
/// process (a CUDA IPC handle cannot be opened by the process that created it). Does
/// nothing unless the parent set the socket variable.
#[test]
fn cuda_ipc_child_process() {
    let Some(path) = rdzv_test_support::peer_env(SOCKET_ENV) else {
        return;
    };
    let gpu = Gpu::open(0).expect("child: open CUDA device 0");
    let stream = gpu.new_stream().expect("child: stream");
    let socket = UnixStream::connect(&path).expect("child: connect");
    let mut sender = CudaIpcSender::new(
        &gpu,
        StreamChannel::new(socket),
        DEFAULT_SLOTS,
        DEFAULT_SLOT_LEN,
    )
    .expect("child: outbox");
    for (seed, len) in SIZES.into_iter().enumerate() {
        let src = device_buffer(&gpu, &pattern(len, seed as u8 + 40));
        for _ in 0..=iterations(len) {
            sender.send(src.range(), &stream).expect("child: send");
        }
    }
    stream.synchronize().expect("child: sync");
}

#[test]
fn cuda_ipc_moves_bytes_between_two_processes() {
    let Some(gpu) = gpu_or_skip("cuda_ipc_moves_bytes_between_two_processes") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("rdzv-cuda-ipc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("socket");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).expect("bind");
    let child = rdzv_test_support::Peer::spawn_test(
        "cuda_ipc_child_process",
        &["--test-threads=1"],
        &[(SOCKET_ENV, &path)],
    );
    let (socket, _) = listener.accept().expect("accept the child");
    let stream = gpu.new_stream().expect("stream");
    let mut receiver = CudaIpcReceiver::new(&gpu, StreamChannel::new(socket));
    d2d_limit(&gpu);
    for (seed, len) in SIZES.into_iter().enumerate() {
        let dst = gpu.alloc(len).expect("cuMemAlloc");
        receiver.recv(dst.range(), &stream).expect("first recv");
        stream.synchronize().expect("sync");
        assert_device_holds(
            &dst,
            &pattern(len, seed as u8 + 40),
            &format!("cuda_ipc {len} B"),
        );
        let iters = iterations(len);
        let start = Instant::now();
        for _ in 0..iters {
            receiver.recv(dst.range(), &stream).expect("recv");
        }
        stream.synchronize().expect("sync");
        row("cuda_ipc", len, iters, start.elapsed());
    }
    child.expect_success(Duration::from_secs(120));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn channel_viability_is_reported_with_reasons() {
    let report = cuda::viability::probe();
    println!("{report}");
    let any_viable = report.verdicts.iter().any(|(_, v)| v.is_viable());
    if !any_viable {
        assert!(
            std::env::var(REQUIRE_ENV).as_deref() != Ok("1"),
            "{REQUIRE_ENV}=1 but no CUDA channel is viable:\n{report}"
        );
        for (channel, verdict) in &report.verdicts {
            assert!(
                verdict.to_string().starts_with("not viable: "),
                "{channel}: {verdict}"
            );
        }
    }
}
