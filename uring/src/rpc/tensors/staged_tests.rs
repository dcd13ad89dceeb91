//! `cuda_basic` tensors staged through host memory: lent in place, pulled chunk by
//! chunk into a fake device runtime, failures in the middle, streamed over mpt.

use super::export::Export;
use super::tests::{entries, negotiate_with, pattern};
use std::sync::{Arc, Mutex, PoisonError};

use rdzv_core::device::{Device, DeviceType};
use rdzv_core::negotiate::{ChannelKind, Negotiated, Role};

use crate::rpc::device::{DeviceError, DeviceOp, Devices, HostBytes, CUDA_BASIC_DESCRIPTOR};
use crate::rpc::error::CallError;
use crate::rpc::message::Tensor;
use crate::rpc::recycle;
use crate::rpc::transport::OwnedFrame;

use super::*;
use crate::rpc::device::{
    DeviceBuffer, DevicePlugin, DeviceRuntime, HostMemory, StagedBytes, StagedReceive,
};
use rdzv_core::negotiate::DeviceDescriptors;
use rdzv_core::rpc::frame::FrameKind;

/// What the fake staging runtime did, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Chunk `chunk`'s buffer `buffer` was handed to the pull.
    Handed { chunk: usize, buffer: usize },
    /// Its copy to the device started.
    Started { chunk: usize, buffer: usize },
    /// Its copy to the device completed.
    Done { chunk: usize, buffer: usize },
}

/// The fake runtime's books, shared with the test.
#[derive(Debug, Default)]
struct Books {
    log: Vec<Step>,
    /// Pinned receive buffers handed to receives and not yet given back.
    buffers_out: usize,
    /// Staged-out tensors alive.
    staged_out: usize,
    /// The chunk whose copy fails to start.
    fail_chunk: Option<usize>,
}

/// A runtime whose "device" memory is on the host, that stages out into "pinned"
/// buffers of its own and receives in chunks (when `chunked`) through `buffers`
/// buffers of `chunk` bytes whose copies land only when waited for: a buffer handed
/// out again before its copy completed would put the wrong bytes on the device.
struct ChunkRuntime {
    books: Arc<Mutex<Books>>,
    chunk: usize,
    buffers: usize,
    chunked: bool,
}

fn lock_books(books: &Mutex<Books>) -> std::sync::MutexGuard<'_, Books> {
    books.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Staged-out bytes of the fake runtime.
struct FakePinned {
    bytes: Vec<u8>,
    books: Arc<Mutex<Books>>,
}

impl StagedBytes for FakePinned {
    fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for FakePinned {
    fn drop(&mut self) {
        lock_books(&self.books).staged_out -= 1;
    }
}

/// A chunked receive of the fake runtime.
struct FakeReceive {
    books: Arc<Mutex<Books>>,
    device: Device,
    chunk: usize,
    memory: Vec<u8>,
    buffers: Vec<Vec<u8>>,
    /// Per buffer: the copy started and not completed (chunk, offset, len).
    pending: Vec<Option<(usize, usize, usize)>>,
    next: usize,
}

impl FakeReceive {
    fn complete(&mut self, buffer: usize) {
        if let Some((chunk, offset, len)) = self.pending[buffer].take() {
            self.memory[offset..offset + len].copy_from_slice(&self.buffers[buffer][..len]);
            lock_books(&self.books)
                .log
                .push(Step::Done { chunk, buffer });
        }
    }
}

impl StagedReceive for FakeReceive {
    fn chunk_len(&self) -> usize {
        self.chunk
    }
    fn chunk_buffer(&mut self, k: usize) -> Result<&mut [u8], DeviceError> {
        if k != self.next {
            return Err(DeviceError::new(
                DeviceOp::ReceiveStaged,
                format!("chunk {k} out of order"),
            ));
        }
        let buffer = k % self.buffers.len();
        self.complete(buffer);
        lock_books(&self.books)
            .log
            .push(Step::Handed { chunk: k, buffer });
        let len = self.chunk.min(self.memory.len() - k * self.chunk);
        // Stale bytes, so that a chunk not filled shows.
        self.buffers[buffer].fill(0xee);
        Ok(&mut self.buffers[buffer][..len])
    }
    fn chunk_filled(&mut self, k: usize) -> Result<(), DeviceError> {
        if lock_books(&self.books).fail_chunk == Some(k) {
            return Err(DeviceError::new(
                DeviceOp::ReceiveStaged,
                format!("fake cuMemcpyHtoDAsync failed for chunk {k}"),
            ));
        }
        let buffer = k % self.buffers.len();
        let offset = k * self.chunk;
        let len = self.chunk.min(self.memory.len() - offset);
        assert!(self.pending[buffer].is_none(), "buffer {buffer} busy");
        self.pending[buffer] = Some((k, offset, len));
        lock_books(&self.books)
            .log
            .push(Step::Started { chunk: k, buffer });
        self.next += 1;
        Ok(())
    }
    fn finish(mut self: Box<Self>) -> Result<DeviceBuffer, DeviceError> {
        for buffer in 0..self.buffers.len() {
            self.complete(buffer);
        }
        if self.next != self.memory.len().div_ceil(self.chunk) {
            return Err(DeviceError::new(
                DeviceOp::ReceiveStaged,
                "not every chunk was filled",
            ));
        }
        let memory = std::mem::take(&mut self.memory);
        Ok(DeviceBuffer::new(HostMemory::new(self.device, memory)))
    }
}

impl Drop for FakeReceive {
    fn drop(&mut self) {
        for buffer in 0..self.buffers.len() {
            self.complete(buffer);
        }
        lock_books(&self.books).buffers_out -= self.buffers.len();
    }
}

impl DeviceRuntime for ChunkRuntime {
    fn device_count(&self) -> usize {
        1
    }
    fn copy_to_host(&self, memory: &DeviceBuffer) -> Result<HostBytes, DeviceError> {
        let memory = memory
            .downcast_ref::<HostMemory>()
            .ok_or_else(|| DeviceError::new(DeviceOp::CopyToHost, "foreign memory"))?;
        lock_books(&self.books).staged_out += 1;
        Ok(HostBytes::staged(FakePinned {
            bytes: memory.bytes().to_vec(),
            books: Arc::clone(&self.books),
        }))
    }
    fn copy_from_host(&self, device: Device, bytes: Vec<u8>) -> Result<DeviceBuffer, DeviceError> {
        Ok(DeviceBuffer::new(HostMemory::new(device, bytes)))
    }
    fn receive_staged(
        &self,
        device: Device,
        len: usize,
    ) -> Result<Option<Box<dyn StagedReceive>>, DeviceError> {
        if !self.chunked {
            return Ok(None);
        }
        lock_books(&self.books).buffers_out += self.buffers;
        Ok(Some(Box::new(FakeReceive {
            books: Arc::clone(&self.books),
            device,
            chunk: self.chunk,
            memory: vec![0; len],
            buffers: vec![vec![0; self.chunk]; self.buffers],
            pending: vec![None; self.buffers],
            next: 0,
        })))
    }
}

struct ChunkPlugin(Arc<ChunkRuntime>);

impl DevicePlugin for ChunkPlugin {
    fn device_type(&self) -> DeviceType {
        DeviceType::Cuda
    }
    fn open(&self) -> Result<Arc<dyn DeviceRuntime>, DeviceError> {
        Ok(Arc::clone(&self.0) as Arc<dyn DeviceRuntime>)
    }
}

/// The fake runtime, opened as a worker's devices.
fn chunk_devices(chunk: usize, buffers: usize, chunked: bool) -> (Devices, Arc<Mutex<Books>>) {
    let books = Arc::new(Mutex::new(Books::default()));
    let runtime = Arc::new(ChunkRuntime {
        books: Arc::clone(&books),
        chunk,
        buffers,
        chunked,
    });
    let plugin: Arc<dyn DevicePlugin> = Arc::new(ChunkPlugin(runtime));
    let devices = Devices::open(&[plugin]).unwrap_or_else(|e| panic!("{e}"));
    (devices, books)
}

/// Both ends offering `kind` (CPU memory) and `cuda_basic` for CPU and CUDA memory.
fn negotiate_cuda_basic(kind: ChannelKind, descriptor: &str) -> Negotiated {
    negotiate_with(&[
        (kind, DeviceDescriptors::cpu(descriptor)),
        (
            ChannelKind::CudaBasic,
            DeviceDescriptors::cpu(CUDA_BASIC_DESCRIPTOR)
                .with(DeviceType::Cuda, CUDA_BASIC_DESCRIPTOR),
        ),
    ])
}

/// A `cuda:0` tensor of `bytes` staged out by `devices` and put in a frame over
/// `kind` (always out of band).
fn staged_frame(devices: &Devices, bytes: &[u8], kind: ChannelKind) -> (OwnedFrame, FrameExports) {
    let memory = DeviceBuffer::new(HostMemory::new(Device::cuda(0), bytes.to_vec()));
    let staged = devices
        .stage_out(Device::cuda(0), Vec::new(), Some(&memory))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(staged.is_staged());
    let mut frame = OwnedFrame::empty(FrameKind::Request, 1);
    let mut exports = FrameExports::default();
    add_tensor(
        &mut frame,
        &mut exports,
        &mut ChannelBytes::default(),
        staged,
        Device::cuda(0),
        Device::cuda(0),
        kind,
        1,
        "peer",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    (frame, exports)
}

/// The address of the bytes the frame's first export lends.
fn lent_address(exports: &FrameExports) -> usize {
    match exports.exports.first() {
        Some(Export::Cma(export)) => export.descriptor().address as usize,
        Some(Export::Xth(export)) => export.bytes().as_ptr() as usize,
        _ => panic!("no cma or xth export"),
    }
}

/// Receives `frame` on a pipe that `negotiated`, with `devices`.
fn pull_with(
    frame: &OwnedFrame,
    negotiated: &Negotiated,
    devices: &Devices,
) -> Result<Vec<Tensor>, CallError> {
    let reader = Arc::new(PipeReader::default());
    ReceivedTensors::sort(
        entries(frame),
        negotiated,
        Role::Listener,
        (&reader, devices),
        "peer",
    )?
    .pull()
}

fn device_bytes(tensor: &Tensor) -> Vec<u8> {
    tensor
        .memory
        .as_ref()
        .and_then(|m| m.downcast_ref::<HostMemory>())
        .map(|m| m.bytes().to_vec())
        .unwrap_or_else(|| panic!("no host-memory tensor: {tensor:?}"))
}

/// Staged out, the CPU channel lends the runtime's own bytes (no copy), and they go
/// back to the runtime when the exports are released; staged in, the pull fills
/// the runtime's chunks in order, each chunk's copy starts as soon as it is filled
/// and runs while the next chunk is read, and no buffer is handed out again before
/// its copy completed. Every byte arrives.
#[test]
fn staged_tensors_are_lent_in_place_and_pulled_chunk_by_chunk() {
    let xth =
        domain_descriptor(ChannelKind::Xth, &Devices::default()).unwrap_or_else(|e| panic!("{e}"));
    let negotiated = negotiate_cuda_basic(ChannelKind::Xth, &xth);
    assert_eq!(
        negotiated.carrier_for(Role::Listener, DeviceType::Cuda, DeviceType::Cuda),
        Some(ChannelKind::Xth)
    );
    let mut kinds = vec![(ChannelKind::Xth, negotiated)];
    if let Ok(cma) = domain_descriptor(ChannelKind::Cma, &Devices::default()) {
        kinds.push((
            ChannelKind::Cma,
            negotiate_cuda_basic(ChannelKind::Cma, &cma),
        ));
    } else {
        eprintln!("cma is not viable here: only xth carries the staged tensors");
    }
    for (kind, negotiated) in &kinds {
        for (len, chunk, buffers) in [(1000, 64, 3), (1000, 100, 2), (64, 64, 2), (7, 64, 1)] {
            let (devices, books) = chunk_devices(chunk, buffers, true);
            let source = pattern(len);
            let (frame, exports) = staged_frame(&devices, &source, *kind);
            // The export lends the staged bytes themselves.
            let staged = match exports.exports.first() {
                Some(Export::Cma(export)) => export.bytes().as_ptr() as usize,
                Some(Export::Xth(export)) => export.bytes().as_ptr() as usize,
                _ => panic!("{kind}: not exported"),
            };
            assert_eq!(lent_address(&exports), staged);
            assert_eq!(lock_books(&books).staged_out, 1);

            let tensors = pull_with(&frame, negotiated, &devices)
                .unwrap_or_else(|e| panic!("{kind} {len}/{chunk}/{buffers}: {e}"));
            assert_eq!(tensors.len(), 1);
            assert_eq!(tensors[0].device, Device::cuda(0));
            assert!(tensors[0].data.is_empty());
            assert!(
                device_bytes(&tensors[0]) == source,
                "{kind} {len}: bytes differ"
            );
            exports.recycle();
            let books = lock_books(&books);
            assert_eq!(books.staged_out, 0, "the staged bytes went back");
            assert_eq!(books.buffers_out, 0, "the receive buffers went back");

            // The order: every chunk handed, started and done once, in order; a
            // buffer handed again only after its previous chunk's copy was done;
            // and (with two buffers or more) chunk k's copy still running while
            // chunk k + 1 is read.
            let at = |step: Step| {
                books
                    .log
                    .iter()
                    .position(|s| *s == step)
                    .unwrap_or_else(|| panic!("{step:?} missing: {:?}", books.log))
            };
            let chunks = len.div_ceil(chunk);
            assert_eq!(books.log.len(), 3 * chunks, "{:?}", books.log);
            for k in 0..chunks {
                let buffer = k % buffers;
                let handed = at(Step::Handed { chunk: k, buffer });
                let started = at(Step::Started { chunk: k, buffer });
                let done = at(Step::Done { chunk: k, buffer });
                assert!(handed < started && started < done, "{:?}", books.log);
                if k >= buffers {
                    let before = at(Step::Done {
                        chunk: k - buffers,
                        buffer,
                    });
                    assert!(before < handed, "buffer {buffer} reused early");
                }
                if buffers >= 2 && k + 1 < chunks {
                    let next = at(Step::Handed {
                        chunk: k + 1,
                        buffer: (k + 1) % buffers,
                    });
                    assert!(started < next && next < done, "no overlap: {:?}", books.log);
                }
            }
        }
    }
}

/// A runtime without chunked receives gets the pulled bytes whole, as before; an
/// empty staged tensor needs no chunk.
#[test]
fn a_runtime_without_chunks_gets_the_bytes_whole() {
    let xth =
        domain_descriptor(ChannelKind::Xth, &Devices::default()).unwrap_or_else(|e| panic!("{e}"));
    let negotiated = negotiate_cuda_basic(ChannelKind::Xth, &xth);
    let (devices, books) = chunk_devices(64, 2, false);
    let source = pattern(1000);
    let (frame, exports) = staged_frame(&devices, &source, ChannelKind::Xth);
    let tensors = pull_with(&frame, &negotiated, &devices).unwrap_or_else(|e| panic!("{e}"));
    assert!(device_bytes(&tensors[0]) == source);
    assert!(lock_books(&books).log.is_empty());
    drop(exports);
    assert_eq!(lock_books(&books).staged_out, 0);

    let (devices, books) = chunk_devices(64, 2, true);
    let mut staging = devices
        .receive_into(Device::cuda(0), 0)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(staging.chunks().is_empty());
    assert!(staging.chunk_buffer(0).is_err());
    let memory = staging.finish().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((memory.device(), memory.len()), (Device::cuda(0), 0));
    assert_eq!(lock_books(&books).buffers_out, 0);
}

/// A copy failing in the middle, or a read failing, fails that pull alone, naming
/// the channel and the tensor, and gives every buffer back; the next pull works.
#[test]
fn a_failure_in_the_middle_fails_only_that_pull_and_returns_every_buffer() {
    let xth =
        domain_descriptor(ChannelKind::Xth, &Devices::default()).unwrap_or_else(|e| panic!("{e}"));
    let negotiated = negotiate_cuda_basic(ChannelKind::Xth, &xth);
    let (devices, books) = chunk_devices(100, 3, true);
    let source = pattern(1000);

    lock_books(&books).fail_chunk = Some(4);
    let (frame, exports) = staged_frame(&devices, &source, ChannelKind::Xth);
    let err = pull_with(&frame, &negotiated, &devices).expect_err("chunk 4 fails");
    let text = err.to_string();
    assert!(
        text.contains("cuda_basic")
            && text.contains("tensor 0")
            && text.contains("failed for chunk 4"),
        "{text}"
    );
    assert_eq!(lock_books(&books).buffers_out, 0, "every buffer went back");
    assert!(lock_books(&books)
        .log
        .iter()
        .all(|s| !matches!(s, Step::Started { chunk, .. } if *chunk >= 4)));

    // A read failing after some chunks: the export is gone.
    lock_books(&books).fail_chunk = None;
    drop(exports);
    let err = pull_with(&frame, &negotiated, &devices).expect_err("export released");
    assert!(err.to_string().contains("xth"), "{err}");
    assert_eq!(lock_books(&books).buffers_out, 0, "every buffer went back");
    assert_eq!(lock_books(&books).staged_out, 0);

    // The next tensor goes through.
    let (frame, exports) = staged_frame(&devices, &source, ChannelKind::Xth);
    let tensors = pull_with(&frame, &negotiated, &devices).unwrap_or_else(|e| panic!("{e}"));
    assert!(device_bytes(&tensors[0]) == source);
    drop(exports);
    assert_eq!(lock_books(&books).buffers_out, 0);
    assert_eq!(lock_books(&books).staged_out, 0);
}

/// Over mpt the staged bytes are streamed, and inline they are written with the
/// frame, from where the runtime staged them; they go back to it once sent.
#[test]
fn staged_bytes_stream_over_mpt_and_go_inline_in_place() {
    let (devices, books) = chunk_devices(64, 2, true);
    let source = pattern(500);
    let (frame, mut exports) = staged_frame(&devices, &source, ChannelKind::Mpt);
    assert_eq!(frame.tensors[0].channel, ChannelKind::Mpt);
    let streamed = exports.take_streamed();
    assert_eq!(streamed.len(), 1);
    assert!(streamed[0].1.is_staged() && streamed[0].1 == source);
    assert_eq!(lock_books(&books).staged_out, 1);
    recycle::give_all(streamed.into_iter().map(|(_, data)| data).collect());
    assert_eq!(lock_books(&books).staged_out, 0);

    let (frame, exports) = staged_frame(&devices, &source, ChannelKind::Basic);
    assert!(frame.tensors[0].is_inline() && exports.is_empty());
    assert!(frame.tensor_data[0].is_staged() && frame.tensor_data[0] == source);
    let body: Vec<&[u8]> = frame.body().collect();
    assert_eq!(
        body.last().map(|part| part.as_ptr()),
        Some(frame.tensor_data[0].as_ptr()),
        "the frame writes the staged bytes themselves"
    );
    assert_eq!(lock_books(&books).staged_out, 1);
    recycle::give_all(frame.tensor_data);
    assert_eq!(lock_books(&books).staged_out, 0);
}
