//! CUDA tensors through the RPC agent with the real CUDA runtime ([`CudaPlugin`]):
//!
//! - two processes: GPU tensors of 0 B to 64 MiB go from `cuda:0` to the peer's `cuda:0`
//!   and back over `cuda_ipc` (the default ranking), then over `cuda_basic` carried by
//!   cma (`channels = cma,basic,cuda_basic`), checked byte for byte on the device by the
//!   peer and on return; each prints its 64 MiB echo time;
//! - two agents in one process: the same over `cuda_xth`;
//! - two processes: 200 echoes of one 64 MiB tensor over `cuda_ipc`, then over
//!   `cuda_basic`, leave the GPU's free memory flat once the caches are warm;
//! - two processes, both runtimes handing received tensors over with their copy still
//!   running (`CudaOptions::pending_hand_over`): the sizes and the echoes over `cuda_ipc`;
//! - two processes: `to_here` of an RRef whose value holds CUDA tensors (1000 B and
//!   64 MiB) arrives as `rpc_sync`'s reply of the same handler does, twice, over
//!   `cuda_ipc` and over `cuda_basic`, and the owner's counts go back to zero once the
//!   RRef is dropped.
//!
//! Every test needs a GPU and prints `SKIPPED <test>: <reason>` without one (or panics
//! when `RDZV_REQUIRE_CUDA=1`, as on a lent GPU machine). The agent's side of these
//! channels is also tested without a GPU, with a fake runtime, in
//! `uring/tests/rpc_cuda.rs`. The peer process is this test binary, re-run with
//! `RDZV_CUDA_AGENT_CHILD` set.

use std::process::Command;
use std::sync::Arc;

use rdzv_test_support::Peer;
use std::time::{Duration, Instant};

use rdzv_core::device::Device;
use rdzv_core::device_map::{DeviceMap, DeviceMaps};
use rdzv_core::negotiate::ChannelKind;
use rdzv_core::rpc::name::WorkerId;
use rdzv_rdma::cuda::agent::{
    ConfiguredCudaPlugin, CudaMemory, CudaOptions, CudaPlugin, ENV_PENDING_HAND_OVER,
};
use rdzv_uring::rpc::{
    init_rpc, CallContext, DeviceBuffer, DevicePlugin, Message, RpcAgent, RpcOptions, Tensor,
};

const CHILD_ENV: &str = "RDZV_CUDA_AGENT_CHILD";
const STORE_ENV: &str = "RDZV_CUDA_AGENT_STORE";
const CHANNELS_ENV: &str = "RDZV_CUDA_AGENT_CHANNELS";
const REQUIRE_ENV: &str = "RDZV_REQUIRE_CUDA";
const SIZES: [usize; 4] = [0, 1, (1 << 20) + 3, 64 << 20];

/// `false` when CUDA can be used here; otherwise prints why `test` is skipped (panics
/// when `RDZV_REQUIRE_CUDA=1`).
fn skipped(test: &str) -> bool {
    let Err(reason) = CudaPlugin.open().map(|_| ()) else {
        return false;
    };
    assert!(
        std::env::var(REQUIRE_ENV).as_deref() != Ok("1"),
        "{test}: {REQUIRE_ENV}=1 but CUDA is not usable: {reason}"
    );
    println!("SKIPPED {test}: {reason}");
    true
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29) ^ seed ^ (i >> 13) as u8)
        .collect()
}

/// The host copy of a CUDA tensor's memory.
fn device_bytes(tensor: &Tensor) -> Result<Vec<u8>, String> {
    let memory = tensor
        .memory
        .as_ref()
        .ok_or_else(|| format!("a {} tensor without device memory", tensor.device))?;
    let memory = memory
        .downcast_ref::<CudaMemory>()
        .ok_or("memory of another runtime")?;
    memory.to_host().map_err(|e| e.to_string())
}

/// Checks each tensor on the device against `pattern(len, seed)` (the payload's first
/// byte) and sends them back.
fn check(_: &CallContext, m: Message) -> Result<Message, String> {
    let seed = m.payload.first().copied().unwrap_or(0);
    for (i, tensor) in m.tensors.iter().enumerate() {
        if tensor.device != Device::cuda(0) {
            return Err(format!("tensor {i} arrived on {}", tensor.device));
        }
        let bytes = device_bytes(tensor)?;
        if bytes != pattern(bytes.len(), seed) {
            return Err(format!("tensor {i} ({} bytes) differs", bytes.len()));
        }
    }
    Ok(m)
}

/// The sizes of the CUDA tensors [`make_value`] answers with.
const VALUE_SIZES: [usize; 2] = [1000, 64 << 20];

/// Answers with the payload "value" and a tensor on cuda:0 of each of [`VALUE_SIZES`],
/// `pattern(len, seed)` (the seed is the request's first byte).
fn make_value(_: &CallContext, m: Message) -> Result<Message, String> {
    let seed = m.payload.first().copied().unwrap_or(0);
    let mut value = Message::from_payload(b"value".to_vec());
    for len in VALUE_SIZES {
        let memory = CudaMemory::upload(Device::cuda(0), &pattern(len, seed))
            .map_err(|e| format!("upload of {len} bytes: {e}"))?;
        value = value.with_tensor(Tensor::on_device(DeviceBuffer::new(memory)));
    }
    Ok(value)
}

fn options(url: &str, channels: Option<&str>) -> RpcOptions {
    let mut options = RpcOptions::new(url)
        .with_handler("check", check)
        .with_handler("make_value", make_value);
    options.listen_host = Some([127, 0, 0, 1].into());
    options.init_counter = Some(0);
    options.num_worker_threads = 2;
    options.rpc_timeout = Duration::from_secs(120);
    options.transports = Some(vec!["tcp".into()]);
    options.device_plugins = vec![Arc::new(CudaPlugin) as Arc<dyn DevicePlugin>];
    options.channels = channels.map(|list| list.split(',').map(str::to_string).collect());
    options
}

/// The calling side's options: `options` with its cuda:0 mapped to the peer's cuda:0
/// (the peer's reverse map comes from it).
fn caller_options(url: &str, channels: Option<&str>) -> RpcOptions {
    let mut options = options(url, channels);
    let mut maps = DeviceMaps::new();
    maps.insert(
        "peer",
        DeviceMap::from_iter([(Device::cuda(0), Device::cuda(0))]),
    );
    options.device_maps = maps;
    options
}

/// Sends every size to `peer` and checks what comes back; prints the 64 MiB echo time.
/// `inline_below`: `None` when `channel` lends device memory (every tensor goes over
/// it); `Some(min_channel_bytes)` when it carries staged bytes (`cuda_basic` over a CPU
/// channel), so that smaller tensors travel inline and are counted on `basic`.
fn round_trips(agent: &RpcAgent, channel: ChannelKind, inline_below: Option<u64>) {
    let seed = 77;
    for &len in &SIZES {
        let memory = CudaMemory::upload(Device::cuda(0), &pattern(len, seed))
            .unwrap_or_else(|e| panic!("upload of {len} bytes: {e}"));
        let tensor = Tensor::on_device(DeviceBuffer::new(memory));
        let started = Instant::now();
        let reply = agent
            .rpc_sync(
                "peer",
                "check",
                Message::from_payload(vec![seed]).with_tensor(tensor),
            )
            .unwrap_or_else(|e| panic!("{len} bytes over {channel}: {e}"));
        let elapsed = started.elapsed();
        let back = reply.tensors.first().expect("a tensor back");
        assert_eq!(back.device, Device::cuda(0));
        let bytes = device_bytes(back).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            bytes == pattern(len, seed),
            "{len} bytes came back different"
        );
        if len == 64 << 20 {
            let gbps = 2.0 * len as f64 / elapsed.as_secs_f64() / 1e9;
            println!("{channel}: 64 MiB echo in {elapsed:?} ({gbps:.2} GB/s both ways)");
        }
    }
    let expected = expected_bytes(channel, inline_below);
    let moved = agent.tensor_bytes_by_channel();
    for &(kind, bytes) in &expected {
        let counted = moved
            .iter()
            .find(|&&(moved_kind, _)| moved_kind == kind)
            .map_or(0, |&(_, bytes)| bytes);
        assert!(
            counted >= bytes,
            "{kind} moved {counted} bytes, expected at least {bytes}: {moved:?}"
        );
    }
}

/// The tensor bytes `round_trips` sends per channel (see its `inline_below`).
fn expected_bytes(channel: ChannelKind, inline_below: Option<u64>) -> Vec<(ChannelKind, u64)> {
    let (mut carried, mut inline) = (0u64, 0u64);
    for &len in &SIZES {
        let len = len as u64;
        match inline_below {
            Some(min) if len < min => inline += len,
            _ => carried += len,
        }
    }
    if channel == ChannelKind::Basic {
        return vec![(channel, carried + inline)];
    }
    vec![(channel, carried), (ChannelKind::Basic, inline)]
}

/// Runs without a GPU: the expectation `cuda_basic` failed on the H100 (the 1-byte
/// tensor went inline, `[(Cma, 68157443), (Basic, 1)]`).
#[test]
fn staged_tensors_below_min_channel_bytes_are_expected_inline() {
    let min = options("", None).min_channel_bytes;
    assert!(
        min > 1 && min <= (1 << 20) + 3,
        "SIZES no longer straddle {min}"
    );
    assert_eq!(
        expected_bytes(ChannelKind::Cma, Some(min)),
        [(ChannelKind::Cma, 68_157_443), (ChannelKind::Basic, 1)]
    );
    assert_eq!(
        expected_bytes(ChannelKind::Basic, Some(min)),
        [(ChannelKind::Basic, 68_157_444)]
    );
    assert_eq!(
        expected_bytes(ChannelKind::CudaIpc, None),
        [(ChannelKind::CudaIpc, 68_157_444), (ChannelKind::Basic, 0)]
    );
}

/// In the child: serves as "peer" until the parent leaves, then exits.
fn serve_if_child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    rdzv_test_support::exit_when_parent_gone();
    let url = std::env::var(STORE_ENV).unwrap_or_default();
    let channels = std::env::var(CHANNELS_ENV).ok();
    let agent = init_rpc("peer", 1, Some(2), options(&url, channels.as_deref()))
        .unwrap_or_else(|e| panic!("child init: {e}"));
    agent.join().unwrap_or_else(|e| panic!("child join: {e}"));
    std::process::exit(0);
}

/// Runs `test` in this process (the parent, "main") against a child serving as
/// "peer", both with `channels`: `run` makes the calls.
fn two_processes(test: &str, channels: Option<&str>, run: impl FnOnce(&RpcAgent)) {
    two_processes_with(test, channels, false, run);
}

/// As [`two_processes`]; with `pending`, both runtimes hand received `cuda_ipc` tensors
/// over with their copy still running (`CudaOptions::pending_hand_over`).
fn two_processes_with(
    test: &str,
    channels: Option<&str>,
    pending: bool,
    run: impl FnOnce(&RpcAgent),
) {
    serve_if_child();
    if skipped(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let url = format!("file://{}", dir.path().join("store").display());
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("{e}"));
    let mut command = Command::new(exe);
    command
        .args([test, "--exact", "--nocapture"])
        .env(CHILD_ENV, "1")
        .env(STORE_ENV, &url);
    if let Some(list) = channels {
        command.env(CHANNELS_ENV, list);
    }
    command.env(ENV_PENDING_HAND_OVER, if pending { "1" } else { "0" });
    // The child exits as soon as this Peer is dropped, also when this test panics.
    let child = Peer::spawn(format!("peer process for test {test}"), command);
    let mut options = caller_options(&url, channels);
    let cuda = CudaOptions {
        pending_hand_over: pending,
        ..CudaOptions::from_env().unwrap_or_else(|e| panic!("{e}"))
    };
    options.device_plugins = vec![Arc::new(ConfiguredCudaPlugin(cuda)) as Arc<dyn DevicePlugin>];
    let agent =
        init_rpc("main", 0, Some(2), options).unwrap_or_else(|e| panic!("parent init: {e}"));
    run(&agent);
    agent.join().unwrap_or_else(|e| panic!("parent join: {e}"));
    child.expect_success(Duration::from_secs(120));
}

/// Echoes the same 64 MiB tensor again and again (each reply is sent next) over
/// `expected` and checks that device memory use stays flat once the caches are warm
/// (the receivers' caching allocators and the borrowers' opened mappings).
fn memory_stays_flat(agent: &RpcAgent, expected: ChannelKind) {
    const WARM: usize = 5;
    const ECHOES: usize = 200;
    let len = 64 << 20;
    let seed = 5;
    let gpu = rdzv_rdma::cuda::memory::Gpu::open(0).unwrap_or_else(|e| panic!("{e}"));
    let memory = CudaMemory::upload(Device::cuda(0), &pattern(len, seed))
        .unwrap_or_else(|e| panic!("upload: {e}"));
    let mut tensor = Tensor::on_device(DeviceBuffer::new(memory));
    let mut free_when_warm = 0;
    let started = Instant::now();
    for echo in 0..WARM + ECHOES {
        if echo == WARM {
            free_when_warm = gpu.memory_info().unwrap_or_else(|e| panic!("{e}")).0;
        }
        let reply = agent
            .rpc_sync(
                "peer",
                "check",
                Message::from_payload(vec![seed]).with_tensor(tensor),
            )
            .unwrap_or_else(|e| panic!("echo {echo} over {expected}: {e}"));
        tensor = reply.tensors.into_iter().next().expect("a tensor back");
    }
    let free_at_end = gpu.memory_info().unwrap_or_else(|e| panic!("{e}")).0;
    let drift = free_when_warm.saturating_sub(free_at_end);
    println!(
        "{expected}: {ECHOES} echoes of 64 MiB in {:?}; device memory free {} MiB when warm, {} MiB at the end",
        started.elapsed(),
        free_when_warm >> 20,
        free_at_end >> 20
    );
    assert!(
        drift <= 2 * len,
        "{ECHOES} echoes took {} MiB more device memory",
        drift >> 20
    );
    assert!(device_bytes(&tensor).is_ok_and(|b| b == pattern(len, seed)));
}

#[test]
fn echoes_over_cuda_ipc_leave_device_memory_flat() {
    two_processes(
        "echoes_over_cuda_ipc_leave_device_memory_flat",
        None,
        |agent| memory_stays_flat(agent, ChannelKind::CudaIpc),
    );
}

#[test]
fn echoes_over_cuda_basic_leave_device_memory_flat() {
    two_processes(
        "echoes_over_cuda_basic_leave_device_memory_flat",
        Some("cma,basic,cuda_basic"),
        |agent| memory_stays_flat(agent, ChannelKind::CudaBasic),
    );
}

#[test]
fn cuda_tensors_cross_two_processes_over_cuda_ipc() {
    two_processes(
        "cuda_tensors_cross_two_processes_over_cuda_ipc",
        None,
        |agent| round_trips(agent, ChannelKind::CudaIpc, None),
    );
}

/// As above, both runtimes handing received tensors over while their copy may still
/// run: the handler's and the caller's `to_host` wait for the ready event, each loan's
/// release for the borrower's record of its IPC event.
#[test]
fn cuda_tensors_cross_two_processes_over_cuda_ipc_handed_over_pending() {
    let test = "cuda_tensors_cross_two_processes_over_cuda_ipc_handed_over_pending";
    two_processes_with(test, None, true, |agent| {
        round_trips(agent, ChannelKind::CudaIpc, None);
        memory_stays_flat(agent, ChannelKind::CudaIpc);
    });
}

#[test]
fn cuda_tensors_cross_two_processes_over_cuda_basic() {
    let carrier = if rdzv_uring::channel::cma::viability().is_ok() {
        ChannelKind::Cma
    } else {
        ChannelKind::Basic
    };
    two_processes(
        "cuda_tensors_cross_two_processes_over_cuda_basic",
        Some("cma,basic,cuda_basic"),
        |agent| round_trips(agent, carrier, Some(options("", None).min_channel_bytes)),
    );
}

/// How long an RRef's value or counts may take.
const PATIENCE: Duration = Duration::from_secs(60);

/// Checks a [`make_value`] answer made with `seed`: its payload, and each tensor's
/// device (the peer's cuda:0 mapped back to this cuda:0) and bytes on the device.
fn check_value(value: &Message, seed: u8, what: &str) {
    assert_eq!(value.payload, b"value", "{what}");
    let devices: Vec<Device> = value.tensors.iter().map(|t| t.device).collect();
    assert_eq!(
        devices,
        [Device::cuda(0); VALUE_SIZES.len()],
        "{what}: the devices"
    );
    for (i, (tensor, &len)) in value.tensors.iter().zip(VALUE_SIZES.iter()).enumerate() {
        let bytes = device_bytes(tensor).unwrap_or_else(|e| panic!("{what}: tensor {i}: {e}"));
        assert!(
            bytes == pattern(len, seed),
            "{what}: tensor {i} ({len} bytes on {}) came back different",
            tensor.device
        );
    }
}

/// `remote()` of [`make_value`] on the peer: `to_here` returns the payload and the CUDA
/// tensors, each on the device an `rpc_sync` reply of the same handler puts it (the
/// reverse device map), byte for byte, twice (the owner keeps the value); once the RRef
/// is dropped, the counts go back to zero on both ranks.
fn to_here_of_cuda_tensors(agent: &RpcAgent, seed: u8) {
    let reply = agent
        .rpc_sync("peer", "make_value", Message::from_payload(vec![seed]))
        .unwrap_or_else(|e| panic!("rpc_sync make_value: {e}"));
    check_value(&reply, seed, "rpc_sync's reply");
    let rref = agent
        .remote("peer", "make_value", Message::from_payload(vec![seed]))
        .unwrap_or_else(|e| panic!("remote make_value: {e}"));
    let started = Instant::now();
    let value = rref
        .to_here(PATIENCE)
        .unwrap_or_else(|e| panic!("to_here: {e}"));
    println!("to_here of 1000 B + 64 MiB in {:?}", started.elapsed());
    let devices = |m: &Message| m.tensors.iter().map(|t| t.device).collect::<Vec<_>>();
    assert_eq!(devices(&value), devices(&reply), "to_here and rpc_sync");
    check_value(&value, seed, "to_here");
    drop(value);
    let again = rref
        .to_here(PATIENCE)
        .unwrap_or_else(|e| panic!("to_here again: {e}"));
    check_value(&again, seed, "the second to_here");
    drop(again);
    agent
        .wait_until_owners_and_forks_on_rank(1, 1, WorkerId::from(1), PATIENCE)
        .unwrap_or_else(|e| panic!("one user of one value on the peer: {e}"));
    drop(rref);
    for rank in [1, 0] {
        agent
            .wait_until_owners_and_forks_on_rank(0, 0, WorkerId::from(rank), PATIENCE)
            .unwrap_or_else(|e| panic!("the RRef dropped, on rank {rank}: {e}"));
    }
}

/// [`to_here_of_cuda_tensors`] over `cuda_ipc` (the default ranking): the owner lends
/// the value's device memory as it does a reply's.
#[test]
fn to_here_of_cuda_tensors_over_cuda_ipc() {
    two_processes("to_here_of_cuda_tensors_over_cuda_ipc", None, |agent| {
        to_here_of_cuda_tensors(agent, 31);
    });
}

/// [`to_here_of_cuda_tensors`] over `cuda_basic`, the staged bytes carried by cma (or
/// inline where cma is not viable).
#[test]
fn to_here_of_cuda_tensors_over_cuda_basic() {
    two_processes(
        "to_here_of_cuda_tensors_over_cuda_basic",
        Some("cma,basic,cuda_basic"),
        |agent| {
            to_here_of_cuda_tensors(agent, 32);
            let carrier = agent.pipe_channel("peer");
            if rdzv_uring::channel::cma::viability().is_ok() {
                assert_eq!(carrier, Some(ChannelKind::Cma));
            } else {
                println!("cma is not viable here; the staged bytes went over {carrier:?}");
            }
        },
    );
}

#[test]
fn two_agents_in_one_process_use_cuda_xth() {
    let test = "two_agents_in_one_process_use_cuda_xth";
    if std::env::var_os(CHILD_ENV).is_some() || skipped(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let url = format!("file://{}", dir.path().join("store").display());
    let peer_url = url.clone();
    let peer = std::thread::spawn(move || {
        let agent = init_rpc("peer", 1, Some(2), options(&peer_url, None))
            .unwrap_or_else(|e| panic!("peer init: {e}"));
        agent.join().unwrap_or_else(|e| panic!("peer join: {e}"));
    });
    let agent = init_rpc("main", 0, Some(2), caller_options(&url, None))
        .unwrap_or_else(|e| panic!("main init: {e}"));
    round_trips(&agent, ChannelKind::CudaXth, None);
    agent.join().unwrap_or_else(|e| panic!("main join: {e}"));
    peer.join()
        .unwrap_or_else(|_| panic!("the peer thread panicked"));
}

/// The probe behind every CUDA channel's offer says why a channel is not viable (moved
/// here from the standalone channels' tests): without CUDA each verdict carries its
/// reason; under `RDZV_REQUIRE_CUDA=1` some channel must be viable.
#[test]
fn channel_viability_is_reported_with_reasons() {
    let report = rdzv_rdma::cuda::viability::probe();
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
