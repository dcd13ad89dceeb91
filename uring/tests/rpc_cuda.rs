//! CUDA tensors through the RPC agent between two processes, on machines without a GPU:
//! both workers plug in a device runtime whose "CUDA memory" is host memory
//! ([`HostCuda`]). The agent cannot tell it from a GPU:
//!
//! - over `cuda_ipc` it has the sender's runtime lend the memory (the fake's "IPC
//!   handle" is a file holding the bytes, removed when the loan ends) and the receiver's
//!   runtime copy it onto the device the device map chose, and it holds each loan until
//!   the peer is done (a request's until its reply, a response's until the ack);
//! - over `cuda_basic` it has the sender's runtime copy tensors to the host (into
//!   memory of the runtime's own, [`Pinned`], which the CPU channel reads in place),
//!   carries the bytes over the pipe's CPU channel (cma, mpt or inline) and has the
//!   receiver's runtime put them on the target device (chunk by chunk as a cma pull
//!   reads them, [`ChunkedIn`]; whole when they came inline or over mpt).
//!
//! The same holds for the value of a `remote()` call fetched with `to_here`: the owner
//! answers the fetch as it does a reply, devices mapped alike.
//!
//! The real runtime is `rdzv_rdma::cuda::agent::CudaPlugin`, tested where a GPU is lent.
//!
//! The peer is this test binary re-run as a child with `RDZV_RPC_CUDA_CHILD` set;
//! parent and child meet at a `file://` store.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rdzv_core::device::{Device, DeviceType};
use rdzv_core::device_map::{DeviceMap, DeviceMaps};
use rdzv_core::negotiate::ChannelKind;
use rdzv_core::rpc::name::WorkerId;
use rdzv_uring::rpc::{
    init_rpc, CallContext, CallError, ChannelUnavailable, DeviceBuffer, DeviceError, DeviceLoan,
    DeviceMemory, DeviceOp, DevicePlugin, DeviceRuntime, HostBytes, HostMemory, Message,
    PartBuffer, PartedReceive, PipeId, RpcAgent, RpcOptions, StagedBytes, StagedReceive, Tensor,
    UnavailableReason,
};

mod common;

use common::{finish, pattern, serve_until_joined, Peer};

const CHILD_ENV: &str = "RDZV_RPC_CUDA_CHILD";
const STORE_ENV: &str = "RDZV_RPC_CUDA_STORE";
const CHANNELS_ENV: &str = "RDZV_RPC_CUDA_CHANNELS";
const GPUS_ENV: &str = "RDZV_RPC_CUDA_GPUS";

/// A tensor of this length fails to be received (the runtime's `copy_from_host` and
/// `borrow`).
const FAILS_TO_ARRIVE: usize = 13;
/// A tensor of this length fails to leave (the runtime's `copy_to_host` and `lend`).
const FAILS_TO_LEAVE: usize = 17;

/// A tensor of this length arrives over mpt, but the runtime fails it when its parts
/// are finished (a failed copy): only its call fails.
const FAILS_IN_PARTS: usize = 300_001;

/// What starts a fake IPC descriptor; the rest is the path of the file holding the bytes.
const FAKE_IPC: &str = "fake-ipc:";

/// Where process `pid`'s fake IPC files are: one per live loan.
fn loan_files(pid: u32) -> Vec<PathBuf> {
    let prefix = format!("rdzv-fake-ipc-{pid}-");
    std::fs::read_dir(std::env::temp_dir())
        .map(|dir| {
            dir.filter_map(Result::ok)
                .map(|entry| entry.path())
                .filter(|path| {
                    path.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(&prefix))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A loan of fake device memory: the file the peer copies from, removed when the loan
/// ends.
struct LoanFile(PathBuf);

impl Drop for LoanFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Borrowed and ended pipes.
type Pipes = (BTreeSet<PipeId>, BTreeSet<PipeId>);

/// Per store URL (one per test, as tests run in parallel in one process): the pipes the
/// runtimes of that test's agent borrowed on, and those they were told ended.
static PIPES: Mutex<BTreeMap<String, Pipes>> = Mutex::new(BTreeMap::new());

/// Runs `f` on the pipes of the agents of store `store`.
fn with_pipes<T>(store: &str, f: impl FnOnce(&mut Pipes) -> T) -> T {
    let mut all = PIPES.lock().unwrap_or_else(PoisonError::into_inner);
    f(all.entry(store.to_string()).or_default())
}

/// Per store URL: the bytes the runtimes of that test's agent borrowed (copied from
/// the peer's loans).
static BORROWED: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());

/// The bytes the runtimes of the agents of store `store` borrowed so far.
fn borrowed_bytes(store: &str) -> u64 {
    let all = BORROWED.lock().unwrap_or_else(PoisonError::into_inner);
    all.get(store).copied().unwrap_or(0)
}

/// A CUDA runtime with `gpus` devices of host memory, for an agent of store `store`.
struct HostCuda {
    gpus: u8,
    store: String,
}

impl DeviceRuntime for HostCuda {
    fn device_count(&self) -> usize {
        usize::from(self.gpus)
    }

    fn copy_to_host(&self, memory: &DeviceBuffer) -> Result<HostBytes, DeviceError> {
        let memory = memory
            .downcast_ref::<HostMemory>()
            .ok_or_else(|| DeviceError::new(DeviceOp::CopyToHost, "not memory of this runtime"))?;
        if memory.bytes().len() == FAILS_TO_LEAVE {
            return Err(DeviceError::new(
                DeviceOp::CopyToHost,
                format!("fake cuMemcpyDtoH failed on {}", memory.device()),
            ));
        }
        // Staged into memory of the runtime's own, which the CPU channel reads in place.
        Ok(HostBytes::staged(Pinned(memory.bytes().to_vec())))
    }

    fn lending_channels(&self) -> Vec<(ChannelKind, Result<String, ChannelUnavailable>)> {
        vec![
            (ChannelKind::CudaIpc, Ok("cuda_ipc:fake-host".to_string())),
            (
                ChannelKind::CudaXth,
                Err(ChannelUnavailable::new(
                    ChannelKind::CudaXth,
                    UnavailableReason::NotViable,
                    "the fake runtime lends across processes only",
                )),
            ),
        ]
    }

    fn lend(&self, channel: ChannelKind, memory: &DeviceBuffer) -> Result<DeviceLoan, DeviceError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let failed = |why: String| DeviceError::new(DeviceOp::Lend, why);
        if channel != ChannelKind::CudaIpc {
            return Err(failed(format!(
                "asked to lend over {channel}, which was not offered"
            )));
        }
        let memory = memory
            .downcast_ref::<HostMemory>()
            .ok_or_else(|| failed("not memory of this runtime".into()))?;
        if memory.bytes().len() == FAILS_TO_LEAVE {
            return Err(failed(format!(
                "fake cuIpcGetMemHandle failed on {}",
                memory.device()
            )));
        }
        let path = std::env::temp_dir().join(format!(
            "rdzv-fake-ipc-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, memory.bytes()).map_err(|e| DeviceError::new(DeviceOp::Lend, e))?;
        Ok(DeviceLoan {
            descriptor: format!("{FAKE_IPC}{}", path.display()).into_bytes(),
            hold: Box::new(LoanFile(path)),
        })
    }

    fn borrow(
        &self,
        channel: ChannelKind,
        device: Device,
        len: u64,
        descriptor: &[u8],
    ) -> Result<DeviceBuffer, DeviceError> {
        let failed = |why: String| DeviceError::new(DeviceOp::Borrow, why);
        if channel != ChannelKind::CudaIpc {
            return Err(failed(format!(
                "asked to borrow over {channel}, which was not offered"
            )));
        }
        let path = std::str::from_utf8(descriptor)
            .ok()
            .and_then(|d| d.strip_prefix(FAKE_IPC))
            .ok_or_else(|| failed("not a fake IPC descriptor".into()))?;
        // The loan is still held: the file is there until the peer gets its answer.
        let bytes =
            std::fs::read(path).map_err(|e| failed(format!("fake cuIpcOpenMemHandle: {e}")))?;
        if bytes.len() as u64 != len {
            return Err(failed(format!(
                "the loan holds {} bytes, not {len}",
                bytes.len()
            )));
        }
        *BORROWED
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(self.store.clone())
            .or_default() += len;
        self.copy_from_host(device, bytes)
    }

    fn borrow_on(
        &self,
        pipe: PipeId,
        channel: ChannelKind,
        device: Device,
        len: u64,
        descriptor: &[u8],
    ) -> Result<DeviceBuffer, DeviceError> {
        with_pipes(&self.store, |(borrowed, ended)| {
            assert!(
                !ended.contains(&pipe),
                "{pipe:?} borrowed on after it ended"
            );
            borrowed.insert(pipe);
        });
        self.borrow(channel, device, len, descriptor)
    }

    fn pipe_ended(&self, pipe: PipeId) {
        with_pipes(&self.store, |(borrowed, ended)| {
            assert!(
                borrowed.contains(&pipe),
                "{pipe:?} ended but never borrowed"
            );
            assert!(ended.insert(pipe), "{pipe:?} reported ended twice");
        });
    }

    fn receive_staged(
        &self,
        device: Device,
        len: usize,
    ) -> Result<Option<Box<dyn StagedReceive>>, DeviceError> {
        Ok(Some(Box::new(ChunkedIn {
            runtime: HostCuda {
                gpus: self.gpus,
                store: self.store.clone(),
            },
            device,
            bytes: vec![0; len],
            buffer: vec![0; CHUNK],
            filled: 0,
        })))
    }

    fn receive_parts(
        &self,
        device: Device,
        len: usize,
    ) -> Result<Option<Box<dyn PartedReceive>>, DeviceError> {
        if len == FAILS_TO_ARRIVE {
            // Refused: the agent reads the bytes whole, and `copy_from_host` fails them.
            return Err(DeviceError::new(
                DeviceOp::ReceiveStaged,
                "fake cuMemAlloc: out of memory",
            ));
        }
        Ok(Some(Box::new(PartsIn {
            runtime: HostCuda {
                gpus: self.gpus,
                store: self.store.clone(),
            },
            device,
            memory: Mutex::new((vec![0; len], 0)),
        })))
    }

    fn copy_from_host(&self, device: Device, bytes: Vec<u8>) -> Result<DeviceBuffer, DeviceError> {
        let failed = |why: String| DeviceError::new(DeviceOp::CopyFromHost, why);
        if !device.is_cuda() || device.index().is_none_or(|i| i >= self.gpus) {
            return Err(failed(format!("this process has no {device}")));
        }
        if bytes.len() == FAILS_TO_ARRIVE {
            return Err(failed(format!(
                "fake cuMemAlloc: out of memory on {device}"
            )));
        }
        Ok(gpu_tensor(device, bytes))
    }
}

/// The fake runtime's "pinned" memory holding a staged-out tensor.
struct Pinned(Vec<u8>);

impl StagedBytes for Pinned {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// The fake runtime's chunk size for received tensors.
const CHUNK: usize = 64 << 10;

/// A tensor received by the fake runtime chunk by chunk through one buffer, each chunk
/// "copied to the device" when filled.
struct ChunkedIn {
    runtime: HostCuda,
    device: Device,
    bytes: Vec<u8>,
    buffer: Vec<u8>,
    filled: usize,
}

impl StagedReceive for ChunkedIn {
    fn chunk_len(&self) -> usize {
        CHUNK
    }
    fn chunk_buffer(&mut self, k: usize) -> Result<&mut [u8], DeviceError> {
        if k != self.filled {
            return Err(DeviceError::new(
                DeviceOp::ReceiveStaged,
                format!("chunk {k} asked for, {} expected", self.filled),
            ));
        }
        let len = CHUNK.min(self.bytes.len() - k * CHUNK);
        Ok(&mut self.buffer[..len])
    }
    fn chunk_filled(&mut self, k: usize) -> Result<(), DeviceError> {
        let offset = k * CHUNK;
        let len = CHUNK.min(self.bytes.len() - offset);
        self.bytes[offset..offset + len].copy_from_slice(&self.buffer[..len]);
        self.filled += 1;
        Ok(())
    }
    fn finish(self: Box<Self>) -> Result<DeviceBuffer, DeviceError> {
        if self.filled != self.bytes.len().div_ceil(CHUNK) {
            return Err(DeviceError::new(
                DeviceOp::ReceiveStaged,
                "not every chunk was filled",
            ));
        }
        self.runtime.copy_from_host(self.device, self.bytes)
    }
}

/// Parts of received tensors the fake runtime took (`cuda_basic` over mpt), in this
/// process.
static PARTS_TAKEN: AtomicU64 = AtomicU64::new(0);

/// A tensor received by the fake runtime in parts from mpt's lane threads, each "copied
/// to the device" (into place) when filled; the byte count catches overlaps and gaps.
struct PartsIn {
    runtime: HostCuda,
    device: Device,
    /// The memory, and the bytes filled so far.
    memory: Mutex<(Vec<u8>, usize)>,
}

/// A part's host buffer.
struct Part {
    offset: usize,
    bytes: Vec<u8>,
}

impl PartBuffer for Part {
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.bytes
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

impl PartedReceive for PartsIn {
    fn part_len(&self) -> usize {
        CHUNK
    }
    fn part(&self, offset: usize, len: usize) -> Result<Box<dyn PartBuffer>, DeviceError> {
        let total = self
            .memory
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .0
            .len();
        let crosses = offset / CHUNK != (offset + len).saturating_sub(1) / CHUNK;
        if offset + len > total || crosses {
            return Err(DeviceError::new(
                DeviceOp::ReceiveStaged,
                format!("part {offset}+{len} of a {total}-byte tensor is out of place"),
            ));
        }
        PARTS_TAKEN.fetch_add(1, Ordering::Relaxed);
        Ok(Box::new(Part {
            offset,
            bytes: vec![0xaa; len],
        }))
    }
    fn part_filled(&self, part: Box<dyn PartBuffer>) -> Result<(), DeviceError> {
        let part = part
            .into_any()
            .downcast::<Part>()
            .map_err(|_| DeviceError::new(DeviceOp::ReceiveStaged, "a part of another runtime"))?;
        let mut memory = self.memory.lock().unwrap_or_else(PoisonError::into_inner);
        memory.0[part.offset..part.offset + part.bytes.len()].copy_from_slice(&part.bytes);
        memory.1 += part.bytes.len();
        Ok(())
    }
    fn finish(self: Box<Self>) -> Result<DeviceBuffer, DeviceError> {
        let (bytes, filled) = self
            .memory
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        if bytes.len() == FAILS_IN_PARTS {
            return Err(DeviceError::new(
                DeviceOp::ReceiveStaged,
                "fake cuMemcpyHtoDAsync failed",
            ));
        }
        if filled != bytes.len() {
            return Err(DeviceError::new(
                DeviceOp::ReceiveStaged,
                format!("{filled} of {} bytes filled", bytes.len()),
            ));
        }
        self.runtime.copy_from_host(self.device, bytes)
    }
}

struct HostCudaPlugin(u8, String);

impl DevicePlugin for HostCudaPlugin {
    fn device_type(&self) -> DeviceType {
        DeviceType::Cuda
    }
    fn open(&self) -> Result<Arc<dyn DeviceRuntime>, DeviceError> {
        Ok(Arc::new(HostCuda {
            gpus: self.0,
            store: self.1.clone(),
        }))
    }
}

fn gpu_tensor(device: Device, bytes: Vec<u8>) -> DeviceBuffer {
    DeviceBuffer::new(HostMemory::new(device, bytes))
}

/// A tensor's bytes: a CPU tensor's, or those of its fake device memory.
fn bytes_of(tensor: &Tensor) -> Result<&[u8], String> {
    match &tensor.memory {
        None if tensor.device.is_cpu() => Ok(&tensor.data),
        None => Err(format!("a {} tensor without memory", tensor.device)),
        Some(memory) => {
            if memory.device() != tensor.device || !tensor.data.is_empty() {
                return Err(format!("a {} tensor with {memory:?}", tensor.device));
            }
            memory
                .downcast_ref::<HostMemory>()
                .map(|m| m.bytes())
                .ok_or_else(|| "memory of another runtime".to_string())
        }
    }
}

/// Checks every request tensor against `pattern(len, seed)` (the seed is the payload's
/// first byte), answers with "device len" per tensor, and sends the tensors back.
fn inspect(_: &CallContext, m: Message) -> Result<Message, String> {
    let seed = m.payload.first().copied().unwrap_or(0);
    let mut seen = Vec::new();
    for (i, tensor) in m.tensors.iter().enumerate() {
        let bytes = bytes_of(tensor).map_err(|e| format!("tensor {i}: {e}"))?;
        if bytes != pattern(bytes.len(), seed) {
            return Err(format!("tensor {i} differs"));
        }
        seen.push(format!("{} {}", tensor.device, bytes.len()));
    }
    Ok(Message {
        payload: seen.join(",").into_bytes(),
        tensors: m.tensors,
        ..Message::default()
    })
}

/// Answers with one tensor on `cuda:1` of the length in the payload (8 bytes LE).
fn make_on_gpu(_: &CallContext, m: Message) -> Result<Message, String> {
    let (len, _) = rdzv_test_support::parse_make_request(&m.payload)?;
    let memory = gpu_tensor(Device::cuda(1), pattern(len, 7));
    Ok(Message::default().with_tensor(Tensor::on_device(memory)))
}

/// The tensors of [`make_value`]'s answer: (device on the peer, length).
const VALUE_TENSORS: [(Device, usize); 4] = [
    (Device::cuda(0), 1000),
    (Device::cuda(0), 64 << 20),
    (Device::cpu(), 5),
    (Device::cuda(1), (1 << 20) + 3),
];

/// Answers with the payload "value" and [`VALUE_TENSORS`], each `pattern(len, seed)`
/// (the seed is the request's first byte): device tensors on both GPUs and a CPU one.
fn make_value(_: &CallContext, m: Message) -> Result<Message, String> {
    let seed = m.payload.first().copied().unwrap_or(0);
    let tensors = VALUE_TENSORS
        .iter()
        .map(|&(device, len)| {
            if device.is_cpu() {
                Tensor::cpu(pattern(len, seed))
            } else {
                Tensor::on_device(gpu_tensor(device, pattern(len, seed)))
            }
        })
        .collect();
    Ok(Message {
        payload: b"value".to_vec(),
        tensors,
        ..Message::default()
    })
}

fn options(url: &str, channels: Option<&str>, gpus: u8) -> RpcOptions {
    let mut options = RpcOptions::new(url)
        .with_handler("inspect", inspect)
        .with_handler("make_on_gpu", make_on_gpu)
        .with_handler("make_value", make_value);
    options.listen_host = Some([127, 0, 0, 1].into());
    options.init_counter = Some(0);
    options.num_worker_threads = 2;
    options.transports = Some(vec!["tcp".into()]);
    options.channels = channels.map(|list| list.split(',').map(str::to_string).collect());
    if gpus > 0 {
        options.device_plugins = vec![Arc::new(HostCudaPlugin(gpus, url.to_string()))];
    }
    options
}

/// The parent's and the child's configuration.
#[derive(Clone, Copy)]
struct Setup<'a> {
    /// `channels` of both sides (`None`: the default).
    channels: Option<&'a str>,
    /// The child's `channels`, when it differs.
    child_channels: Option<&'a str>,
    /// How many fake GPUs each side has (0: no device plugin).
    parent_gpus: u8,
    child_gpus: u8,
    /// The parent's device map to the child.
    map: &'a [(Device, Device)],
}

const GPU0_TO_GPU1: &[(Device, Device)] = &[(Device::cuda(0), Device::cuda(1))];

/// In the child, serves as "peer" and never returns. In the parent, starts the child
/// for `test` and the parent's agent ("main") with `setup`.
fn start(test: &str, setup: Setup<'_>) -> (RpcAgent, Peer, tempfile::TempDir) {
    if std::env::var_os(CHILD_ENV).is_some() {
        let url = std::env::var(STORE_ENV).unwrap_or_default();
        let channels = std::env::var(CHANNELS_ENV).ok();
        let gpus = std::env::var(GPUS_ENV)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let options = options(&url, channels.as_deref(), gpus);
        serve_until_joined(init_rpc("peer", 1, Some(2), options));
    }
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let url = store_url(&dir);
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("{e}"));
    let mut command = Command::new(exe);
    command
        .args([test, "--exact", "--nocapture"])
        .env(CHILD_ENV, "1")
        .env(STORE_ENV, &url)
        .env(GPUS_ENV, setup.child_gpus.to_string());
    match setup.child_channels.or(setup.channels) {
        Some(list) => command.env(CHANNELS_ENV, list),
        None => command.env_remove(CHANNELS_ENV),
    };
    let child = Peer::spawn(format!("peer process for test {test}"), command);
    let mut options = options(&url, setup.channels, setup.parent_gpus);
    let mut maps = DeviceMaps::new();
    maps.insert("peer", DeviceMap::from_iter(setup.map.iter().copied()));
    options.device_maps = maps;
    let agent =
        init_rpc("main", 0, Some(2), options).unwrap_or_else(|e| panic!("parent init: {e}"));
    (agent, child, dir)
}

/// The store URL of the test whose directory is `dir`.
fn store_url(dir: &tempfile::TempDir) -> String {
    format!("file://{}", dir.path().join("store").display())
}

fn bytes_on(agent: &RpcAgent, channel: ChannelKind) -> u64 {
    agent
        .tensor_bytes_by_channel()
        .into_iter()
        .find(|&(kind, _)| kind == channel)
        .map_or(0, |(_, bytes)| bytes)
}

/// Sends `tensors` (made with `pattern(len, seed)`) to the peer's `inspect`; returns
/// what the peer saw and the tensors that came back.
fn round_trip(agent: &RpcAgent, tensors: Vec<Tensor>, seed: u8) -> (String, Vec<Tensor>) {
    let message = Message {
        payload: vec![seed],
        tensors,
        ..Message::default()
    };
    let reply = agent
        .rpc_sync("peer", "inspect", message)
        .unwrap_or_else(|e| panic!("inspect: {e}"));
    (
        String::from_utf8_lossy(&reply.payload).into_owned(),
        reply.tensors,
    )
}

const SIZES: [usize; 4] = [0, 1, (1 << 20) + 3, 8 << 20];

/// GPU tensors of every size from cuda:0 land on the peer's cuda:1 and come back on
/// cuda:0 (the reverse map), byte for byte; a CPU tensor in the same message stays on
/// the CPU. Then a tensor the peer makes on its cuda:1 arrives on cuda:0.
fn gpu_to_gpu(agent: &RpcAgent) {
    let seed = 42;
    let mut tensors: Vec<Tensor> = SIZES
        .iter()
        .map(|&len| Tensor::on_device(gpu_tensor(Device::cuda(0), pattern(len, seed))))
        .collect();
    tensors.push(Tensor::cpu(pattern(5, seed)));
    let (seen, back) = round_trip(agent, tensors, seed);
    let expected: Vec<String> = SIZES
        .iter()
        .map(|len| format!("cuda:1 {len}"))
        .chain(["cpu 5".to_string()])
        .collect();
    assert_eq!(seen, expected.join(","));
    assert_eq!(back.len(), SIZES.len() + 1);
    for (tensor, &len) in back.iter().zip(SIZES.iter().chain([5].iter())) {
        let device = if len == 5 {
            Device::cpu()
        } else {
            Device::cuda(0)
        };
        assert_eq!(tensor.device, device, "{len} bytes");
        let bytes = bytes_of(tensor).unwrap_or_else(|e| panic!("{len} bytes: {e}"));
        assert!(
            bytes == pattern(len, seed),
            "{len} bytes came back different"
        );
    }
    let reply = agent
        .rpc_sync(
            "peer",
            "make_on_gpu",
            Message::from_payload((3u64 << 20).to_le_bytes()),
        )
        .unwrap_or_else(|e| panic!("make_on_gpu: {e}"));
    let made = reply.tensors.first().expect("a tensor");
    assert_eq!(made.device, Device::cuda(0));
    assert!(bytes_of(made).is_ok_and(|b| b == pattern(3 << 20, 7)));
}

/// GPU tensors go over cuda_ipc when both runtimes lend (the default ranking puts it
/// above cuda_basic); every loan ends once the peer is done with it.
#[test]
fn gpu_tensors_cross_over_cuda_ipc_and_every_loan_ends() {
    let (agent, child, dir) = start(
        "gpu_tensors_cross_over_cuda_ipc_and_every_loan_ends",
        two_gpus(None),
    );
    gpu_to_gpu(&agent);
    // Every non-empty request tensor was lent; the empty one went inline.
    let lent: usize = SIZES.iter().sum();
    assert!(
        bytes_on(&agent, ChannelKind::CudaIpc) >= lent as u64,
        "{:?}",
        agent.tensor_bytes_by_channel()
    );
    assert_eq!(bytes_on(&agent, ChannelKind::CudaBasic), 0);
    // Requests' loans end with their replies, responses' with the caller's acks.
    assert_loans_end(&agent, &child);
    finish(agent, child);
    // The responses were borrowed on a pipe, and its end was reported once the agent
    // shut down (so a runtime's per-pipe mappings are closed). Only this test's agent
    // counts: the others of this process may still hold their pipes.
    let (borrowed, ended) = with_pipes(&store_url(&dir), |pipes| pipes.clone());
    assert!(!borrowed.is_empty(), "the responses were borrowed");
    assert_eq!(
        borrowed, ended,
        "every pipe that borrowed was reported ended"
    );
}

/// Both sides with two fake GPUs, the parent's cuda:0 mapped to the peer's cuda:1, and
/// `channels` on both.
fn two_gpus(channels: Option<&str>) -> Setup<'_> {
    Setup {
        channels,
        child_channels: None,
        parent_gpus: 2,
        child_gpus: 2,
        map: GPU0_TO_GPU1,
    }
}

/// The error of a call to the peer's `inspect` with `tensor` ("" if it succeeded).
fn error_of(agent: &RpcAgent, tensor: Tensor) -> String {
    agent
        .rpc_sync("peer", "inspect", Message::default().with_tensor(tensor))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default()
}

/// Waits (up to 10 s) until neither process holds a loan.
fn assert_loans_end(agent: &RpcAgent, child: &Peer) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let held: Vec<PathBuf> = [std::process::id(), child.id()]
            .into_iter()
            .flat_map(loan_files)
            .collect();
        if held.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "loans still held: {held:?} ({:?})",
            agent.tensor_bytes_by_channel()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A tensor that cannot be lent, or cannot be copied by the receiver, fails only its
/// call, saying what and where; no loan outlives it and the pipe goes on.
#[test]
fn lending_failures_fail_only_their_call() {
    let (agent, child, _dir) = start("lending_failures_fail_only_their_call", two_gpus(None));
    let call = |tensor: Tensor| error_of(&agent, tensor);
    let text = call(Tensor::on_device(gpu_tensor(
        Device::cuda(0),
        vec![0; FAILS_TO_LEAVE],
    )));
    // What failed, where (the device and channel), then the runtime's reason.
    assert!(
        text.contains(
            "tensor 0 over the cuda_ipc channel with peer: cannot lend a tensor on cuda:0 over cuda_ipc: fake cuIpcGetMemHandle \
             failed on cuda:0"
        ),
        "{text}"
    );
    let text = call(Tensor::on_device(gpu_tensor(
        Device::cuda(0),
        vec![0; FAILS_TO_ARRIVE],
    )));
    assert!(
        text.contains("cuda_ipc") && text.contains("out of memory on cuda:1"),
        "{text}"
    );
    assert!(text.contains("tensor 0"), "{text}");
    // A CUDA tensor must hold device memory: its bytes are never dropped silently.
    let text = call(Tensor {
        device: Device::cuda(0),
        data: vec![1, 2, 3],
        memory: None,
    });
    assert!(
        text.contains("cuda_ipc") && text.contains("Tensor::on_device"),
        "{text}"
    );
    assert_loans_end(&agent, &child);
    gpu_to_gpu(&agent);
    assert_loans_end(&agent, &child);
    finish(agent, child);
}

#[test]
fn gpu_tensors_cross_over_cuda_basic_carried_by_cma() {
    let (agent, child, _dir) = start(
        "gpu_tensors_cross_over_cuda_basic_carried_by_cma",
        two_gpus(Some("cma,basic,cuda_basic")),
    );
    let cma = rdzv_uring::channel::cma::viability().is_ok();
    gpu_to_gpu(&agent);
    let carrier = agent.pipe_channel("peer");
    if cma {
        assert_eq!(carrier, Some(ChannelKind::Cma));
        // The two large tensors went over cma, the small ones inline.
        assert!(
            bytes_on(&agent, ChannelKind::Cma) >= ((1 << 20) + 3 + (8 << 20)),
            "{:?}",
            agent.tensor_bytes_by_channel()
        );
    } else {
        eprintln!("cma is not viable here; the staged bytes went over {carrier:?}");
    }
    finish(agent, child);
}

#[test]
fn gpu_tensors_cross_over_cuda_basic_carried_by_mpt() {
    let (agent, child, _dir) = start(
        "gpu_tensors_cross_over_cuda_basic_carried_by_mpt",
        two_gpus(Some("mpt,basic,cuda_basic")),
    );
    let parts_before = PARTS_TAKEN.load(Ordering::Relaxed);
    gpu_to_gpu(&agent);
    assert!(
        bytes_on(&agent, ChannelKind::Mpt) >= ((1 << 20) + 3 + (8 << 20)),
        "{:?}",
        agent.tensor_bytes_by_channel()
    );
    // The replies' stripes went piece by piece into the runtime's parts (8 MiB in 64 KiB
    // parts alone is 128), never whole.
    let parts = PARTS_TAKEN.load(Ordering::Relaxed) - parts_before;
    assert!(parts >= 128 + 16, "{parts} parts");
    // A tensor whose parts the receiver's runtime fails fails its call only, saying
    // what and where; the lanes stay in step and the pipe goes on.
    let text = error_of(
        &agent,
        Tensor::on_device(gpu_tensor(Device::cuda(0), vec![0; FAILS_IN_PARTS])),
    );
    assert!(
        text.contains("tensor 0")
            && text.contains("on cuda:1 over cuda_basic")
            && text.contains("fake cuMemcpyHtoDAsync failed"),
        "{text}"
    );
    gpu_to_gpu(&agent);
    finish(agent, child);
}

#[test]
fn gpu_tensors_cross_over_cuda_basic_inline() {
    let (agent, child, _dir) = start(
        "gpu_tensors_cross_over_cuda_basic_inline",
        two_gpus(Some("basic,cuda_basic")),
    );
    gpu_to_gpu(&agent);
    let by_channel = agent.tensor_bytes_by_channel();
    assert!(
        by_channel
            .iter()
            .all(|&(kind, _)| kind == ChannelKind::Basic),
        "{by_channel:?}"
    );
    finish(agent, child);
}

/// A worker without a GPU runtime sends CPU tensors onto the peer's GPU (map
/// `cpu → cuda:1`) and gets them back on the CPU.
#[test]
fn a_cpu_only_worker_reaches_a_gpu_worker() {
    let setup = Setup {
        channels: None,
        child_channels: None,
        parent_gpus: 0,
        child_gpus: 2,
        map: &[(Device::cpu(), Device::cuda(1))],
    };
    let (agent, child, _dir) = start("a_cpu_only_worker_reaches_a_gpu_worker", setup);
    let tensors = vec![Tensor::cpu(pattern(1 << 20, 9)), Tensor::cpu(Vec::new())];
    let (seen, back) = round_trip(&agent, tensors, 9);
    assert_eq!(seen, "cuda:1 1048576,cuda:1 0");
    assert!(back.iter().all(|t| t.device.is_cpu() && t.memory.is_none()));
    assert!(back[0].data == pattern(1 << 20, 9));
    // A GPU tensor has nowhere to come from on this side: no runtime.
    let gpu = Tensor::on_device(gpu_tensor(Device::cuda(0), vec![1, 2]));
    let text = agent
        .rpc_sync("peer", "inspect", Message::default().with_tensor(gpu))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(text.contains("no negotiated channel serves"), "{text}");
    finish(agent, child);
}

/// A GPU worker sends to a worker without one (map `cuda:0 → cpu`): the peer gets CPU
/// tensors, and the reverse map puts the replies back on cuda:0.
#[test]
fn a_gpu_worker_reaches_a_cpu_only_worker() {
    let setup = Setup {
        channels: None,
        child_channels: None,
        parent_gpus: 1,
        child_gpus: 0,
        map: &[(Device::cuda(0), Device::cpu())],
    };
    let (agent, child, _dir) = start("a_gpu_worker_reaches_a_cpu_only_worker", setup);
    let tensor = Tensor::on_device(gpu_tensor(Device::cuda(0), pattern(300_000, 3)));
    let (seen, back) = round_trip(&agent, vec![tensor], 3);
    assert_eq!(seen, "cpu 300000");
    assert_eq!(back[0].device, Device::cuda(0));
    assert!(bytes_of(&back[0]).is_ok_and(|b| b == pattern(300_000, 3)));
    finish(agent, child);
}

/// What fails says what and where, and the pipe goes on working.
#[test]
fn staging_failures_fail_only_their_call() {
    let (agent, child, _dir) = start(
        "staging_failures_fail_only_their_call",
        two_gpus(Some("cma,basic,cuda_basic")),
    );
    let call = |tensor: Tensor| error_of(&agent, tensor);
    // The sender's runtime cannot copy the tensor out.
    let text = call(Tensor::on_device(gpu_tensor(
        Device::cuda(0),
        vec![0; FAILS_TO_LEAVE],
    )));
    assert!(
        text.contains(
            "tensor 0 over the cuda_basic channel with peer: cannot copy a tensor to the host on cuda:0 over cuda_basic: fake \
             cuMemcpyDtoH failed on cuda:0"
        ),
        "{text}"
    );
    // The receiver's runtime cannot allocate it.
    let text = call(Tensor::on_device(gpu_tensor(
        Device::cuda(0),
        vec![0; FAILS_TO_ARRIVE],
    )));
    assert!(
        text.contains("out of memory on cuda:1") && text.contains("tensor 0"),
        "{text}"
    );
    // A CUDA tensor must hold device memory.
    let text = call(Tensor {
        device: Device::cuda(0),
        data: vec![1, 2, 3],
        memory: None,
    });
    assert!(text.contains("Tensor::on_device"), "{text}");
    // Memory on another device than the tensor says.
    let text = call(Tensor {
        device: Device::cuda(0),
        data: Vec::new(),
        memory: Some(gpu_tensor(Device::cuda(1), vec![1])),
    });
    assert!(text.contains("its memory is on cuda:1"), "{text}");
    // The pipe still works.
    gpu_to_gpu(&agent);
    finish(agent, child);
}

/// A peer that does not offer cuda_basic gets no GPU tensors, and the caller is told
/// why; CPU tensors still flow.
#[test]
fn no_cuda_basic_on_the_peer_is_a_clear_error() {
    let setup = Setup {
        channels: None,
        child_channels: Some("cma,basic"),
        parent_gpus: 2,
        child_gpus: 2,
        map: GPU0_TO_GPU1,
    };
    let (agent, child, _dir) = start("no_cuda_basic_on_the_peer_is_a_clear_error", setup);
    let gpu = Tensor::on_device(gpu_tensor(Device::cuda(0), vec![1]));
    match agent.rpc_sync("peer", "inspect", Message::default().with_tensor(gpu)) {
        Err(CallError::NoChannel {
            source_device,
            target_device,
            ..
        }) => assert_eq!(
            (source_device.as_str(), target_device.as_str()),
            ("cuda:0", "cuda:1")
        ),
        other => panic!("expected NoChannel, got {other:?}"),
    }
    let (seen, _) = round_trip(&agent, vec![Tensor::cpu(pattern(10, 1))], 1);
    assert_eq!(seen, "cpu 10");
    finish(agent, child);
}

/// Three GPUs a side, the parent's cuda:0, cuda:1 and cuda:2 being the peer's cuda:1,
/// cuda:2 and cuda:0: the reverse map (the peer's cuda:0 on the parent's cuda:2, its
/// cuda:1 on cuda:0) differs from no map and from the parent's map itself, so an answer
/// mapped either way would show.
const GPUS_ROTATED: &[(Device, Device)] = &[
    (Device::cuda(0), Device::cuda(1)),
    (Device::cuda(1), Device::cuda(2)),
    (Device::cuda(2), Device::cuda(0)),
];

/// The parent's setup for the `to_here` tests: [`GPUS_ROTATED`], `channels` on both.
fn rotated(channels: Option<&str>) -> Setup<'_> {
    Setup {
        parent_gpus: 3,
        child_gpus: 3,
        map: GPUS_ROTATED,
        ..two_gpus(channels)
    }
}

/// How long an RRef's value or counts may take.
const PATIENCE: Duration = Duration::from_secs(20);

/// Checks a [`make_value`] answer made with `seed`: its payload, and each tensor's
/// bytes and device, that of the peer's mapped by the reverse of [`GPUS_ROTATED`].
fn check_value(value: &Message, seed: u8, what: &str) {
    assert_eq!(value.payload, b"value", "{what}");
    let devices: Vec<Device> = value.tensors.iter().map(|t| t.device).collect();
    let expected: Vec<Device> = VALUE_TENSORS
        .iter()
        .map(|&(device, _)| match device.index() {
            Some(0) => Device::cuda(2),
            Some(1) => Device::cuda(0),
            _ => device,
        })
        .collect();
    assert_eq!(devices, expected, "{what}: the devices");
    for (i, (tensor, &(_, len))) in value.tensors.iter().zip(VALUE_TENSORS.iter()).enumerate() {
        let bytes = bytes_of(tensor).unwrap_or_else(|e| panic!("{what}: tensor {i}: {e}"));
        assert!(
            bytes == pattern(len, seed),
            "{what}: tensor {i} ({len} bytes on {}) came back different",
            tensor.device
        );
    }
}

/// `remote()` of a handler whose value holds device tensors (1000 bytes and 64 MiB on
/// the peer's cuda:0, 1 MiB + 3 on its cuda:1) and a CPU tensor: `to_here` returns the
/// payload and the tensors, each on the device an `rpc_sync` reply of the same handler
/// puts it (the reverse device map), byte for byte, twice (the owner keeps the value);
/// once the RRef is dropped, the owner's counts go back to zero and no loan is left.
fn to_here_of_device_tensors(agent: &RpcAgent, child: &Peer, seed: u8) {
    let reply = agent
        .rpc_sync("peer", "make_value", Message::from_payload([seed]))
        .unwrap_or_else(|e| panic!("rpc_sync make_value: {e}"));
    check_value(&reply, seed, "rpc_sync's reply");
    let rref = agent
        .remote("peer", "make_value", Message::from_payload([seed]))
        .unwrap_or_else(|e| panic!("remote make_value: {e}"));
    let value = rref
        .to_here(PATIENCE)
        .unwrap_or_else(|e| panic!("to_here: {e}"));
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
    assert_loans_end(agent, child);
}

/// [`to_here_of_device_tensors`] over cuda_ipc: the owner lends the value's device
/// memory as it does a reply's, and every loan ends.
#[test]
fn to_here_of_device_tensors_over_cuda_ipc() {
    let setup = rotated(None);
    let (agent, child, dir) = start("to_here_of_device_tensors_over_cuda_ipc", setup);
    to_here_of_device_tensors(&agent, &child, 21);
    // Every device tensor of the rpc_sync reply and of both to_here answers was lent by
    // the peer and borrowed here.
    let device_bytes: usize = VALUE_TENSORS
        .iter()
        .filter(|(device, _)| device.is_cuda())
        .map(|&(_, len)| len)
        .sum();
    assert_eq!(
        borrowed_bytes(&store_url(&dir)),
        3 * device_bytes as u64,
        "bytes borrowed over cuda_ipc"
    );
    finish(agent, child);
}

/// [`to_here_of_device_tensors`] over cuda_basic, the staged bytes carried by cma (or
/// inline where cma is not viable).
#[test]
fn to_here_of_device_tensors_over_cuda_basic() {
    let setup = rotated(Some("cma,basic,cuda_basic"));
    let (agent, child, dir) = start("to_here_of_device_tensors_over_cuda_basic", setup);
    to_here_of_device_tensors(&agent, &child, 22);
    // Staged through host memory, nothing lent.
    assert_eq!(borrowed_bytes(&store_url(&dir)), 0);
    let carrier = agent.pipe_channel("peer");
    if rdzv_uring::channel::cma::viability().is_ok() {
        assert_eq!(carrier, Some(ChannelKind::Cma));
    } else {
        eprintln!("cma is not viable here; the staged bytes went over {carrier:?}");
    }
    finish(agent, child);
}
