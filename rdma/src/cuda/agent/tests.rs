//! The runtime on a GPU (each test prints why it skips without one), and its option
//! parsing.

use super::*;
use crate::cuda::memory::{Gpu, StagingBuffer};
use rdzv_uring::rpc::DevicePlugin;

#[test]
fn ordinals_are_cuda_only() {
    assert_eq!(cuda_ordinal(Device::cuda(3)).ok(), Some(3));
    assert!(cuda_ordinal(Device::cpu()).is_err());
}

/// The runtime with small staging chunks on `cuda:0`, or `None` (with the reason
/// printed) without CUDA; panics then when `RDZV_REQUIRE_CUDA=1`.
fn gpu_runtime(test: &str) -> Option<CudaRuntime> {
    gpu_runtime_with(
        test,
        CudaOptions {
            staging_chunk_bytes: 64 << 10,
            staging_buffers: 2,
            ..CudaOptions::default()
        },
    )
}

fn gpu_runtime_with(test: &str, options: CudaOptions) -> Option<CudaRuntime> {
    match CudaRuntime::open_with(options) {
        Ok(runtime) => Some(runtime),
        Err(reason) => {
            assert!(
                std::env::var("RDZV_REQUIRE_CUDA").as_deref() != Ok("1"),
                "{test}: RDZV_REQUIRE_CUDA=1 but {reason}"
            );
            println!("SKIPPED {test}: {reason}");
            None
        }
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed ^ (i >> 11) as u8)
        .collect()
}

/// On a GPU: staged copies of more chunks than buffers come back byte for byte, and a
/// dropped tensor's block serves the next one of its class.
#[test]
fn staged_copies_and_cached_blocks_on_a_gpu() {
    let Some(runtime) = gpu_runtime("staged_copies_and_cached_blocks_on_a_gpu") else {
        return;
    };
    let cuda0 = Device::cuda(0);
    for (seed, len) in [0usize, 1, 64 << 10, (64 << 10) + 1, (3 << 20) + 5]
        .into_iter()
        .enumerate()
    {
        let bytes = pattern(len, seed as u8);
        let memory = runtime
            .copy_from_host(cuda0, bytes.clone())
            .unwrap_or_else(|e| panic!("{len} bytes to the device: {e}"));
        assert_eq!(memory.len(), len);
        let back = runtime
            .copy_to_host(&memory)
            .unwrap_or_else(|e| panic!("{len} bytes back: {e}"));
        assert!(back == bytes, "{len} bytes came back different");
        let own = memory.downcast_ref::<CudaMemory>().expect("CudaMemory");
        assert!(own.to_host().is_ok_and(|b| b == bytes));
    }
    let state = runtime.device(cuda0).unwrap_or_else(|e| panic!("{e}"));
    drop(runtime.copy_from_host(cuda0, vec![1; 5 << 20]));
    let before = state.allocator.stats();
    for _ in 0..10 {
        drop(runtime.copy_from_host(cuda0, vec![2; 5 << 20]));
    }
    let after = state.allocator.stats();
    assert_eq!(
        after.backing_allocations, before.backing_allocations,
        "{after:?}"
    );
    assert_eq!(after.reuses, before.reuses + 10);
}

/// On a GPU: a chunked receive lands every byte; a staged-out tensor is a pinned
/// block the channel reads in place, back in its cache when dropped (and reused);
/// one over the cap is staged into a `Vec`; a receive abandoned midway gives its
/// slots and memory back.
#[test]
fn pinned_staging_out_and_chunked_receives_on_a_gpu() {
    let test = "pinned_staging_out_and_chunked_receives_on_a_gpu";
    let Some(runtime) = gpu_runtime(test) else {
        return;
    };
    let cuda0 = Device::cuda(0);
    let state = runtime.device(cuda0).unwrap_or_else(|e| panic!("{e}"));
    for round in 0..2u8 {
        for (seed, len) in [1usize, 64 << 10, (64 << 10) + 1, (3 << 20) + 5]
            .into_iter()
            .enumerate()
        {
            let bytes = pattern(len, seed as u8 + round);
            let mut staging = runtime
                .receive_staged(cuda0, len)
                .unwrap_or_else(|e| panic!("{e}"))
                .expect("the CUDA runtime receives in chunks");
            let chunk = staging.chunk_len();
            for k in 0..len.div_ceil(chunk) {
                let buffer = staging
                    .chunk_buffer(k)
                    .unwrap_or_else(|e| panic!("{len} bytes, chunk {k}: {e}"));
                let offset = k * chunk;
                buffer.copy_from_slice(&bytes[offset..offset + buffer.len()]);
                staging
                    .chunk_filled(k)
                    .unwrap_or_else(|e| panic!("{len} bytes, chunk {k}: {e}"));
            }
            let memory = staging.finish().unwrap_or_else(|e| panic!("{len}: {e}"));
            let own = memory.downcast_ref::<CudaMemory>().expect("CudaMemory");
            assert!(own.to_host().is_ok_and(|b| b == bytes), "{len} bytes in");
            let out = runtime
                .copy_to_host(&memory)
                .unwrap_or_else(|e| panic!("{len} bytes out: {e}"));
            assert!(out.is_staged(), "{len} bytes staged in pinned memory");
            assert!(out == bytes, "{len} bytes out");
            drop(out);
            assert_eq!(state.basic.pinned.stats().in_use, 0);
        }
    }
    assert!(
        state.basic.pinned.stats().reuses >= 4,
        "{:?}",
        state.basic.pinned.stats()
    );

    // Abandoned after two chunks: the slots and the memory go back.
    let slots_before = lock(&state.basic.staging).len();
    let in_use_before = state.allocator.stats().in_use;
    let mut staging = runtime
        .receive_staged(cuda0, 1 << 20)
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("chunked");
    for k in 0..2 {
        let buffer = staging.chunk_buffer(k).unwrap_or_else(|e| panic!("{e}"));
        buffer.fill(k as u8);
        staging.chunk_filled(k).unwrap_or_else(|e| panic!("{e}"));
    }
    assert!(staging.chunk_buffer(5).is_err(), "out of order");
    drop(staging);
    assert!(lock(&state.basic.staging).len() >= slots_before);
    assert_eq!(state.allocator.stats().in_use, in_use_before);

    // Over the pinned cap: staged through the slots into a Vec.
    let Some(capped) = gpu_runtime_with(
        test,
        CudaOptions {
            staged_out_cap_bytes: 1024,
            ..CudaOptions::default()
        },
    ) else {
        return;
    };
    let bytes = pattern(64 << 10, 9);
    let memory = capped
        .copy_from_host(cuda0, bytes.clone())
        .unwrap_or_else(|e| panic!("{e}"));
    let out = capped
        .copy_to_host(&memory)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(!out.is_staged() && out == bytes);
}

/// On a GPU: a tensor lent over cuda_xth is copied device to device on the
/// runtime's stream, and the copy is complete when `borrow` returns.
#[test]
fn xth_loans_are_copied_on_the_runtimes_stream() {
    let Some(runtime) = gpu_runtime("xth_loans_are_copied_on_the_runtimes_stream") else {
        return;
    };
    let cuda0 = Device::cuda(0);
    let bytes = pattern((8 << 20) + 3, 9);
    let lent =
        DeviceBuffer::new(CudaMemory::upload(cuda0, &bytes).unwrap_or_else(|e| panic!("{e}")));
    let loan = runtime
        .lend(ChannelKind::CudaXth, &lent)
        .unwrap_or_else(|e| panic!("{e}"));
    let copy = runtime
        .borrow(
            ChannelKind::CudaXth,
            cuda0,
            bytes.len() as u64,
            &loan.descriptor,
        )
        .unwrap_or_else(|e| panic!("{e}"));
    let own = copy.downcast_ref::<CudaMemory>().expect("CudaMemory");
    assert!(own.to_host().is_ok_and(|b| b == bytes));
    // A descriptor that lends another length is refused before any copy.
    let err = runtime
        .borrow(ChannelKind::CudaXth, cuda0, 5, &loan.descriptor)
        .expect_err("wrong length")
        .report();
    assert!(
        err.starts_with("cannot copy a lent tensor on cuda:0 over cuda_xth: ")
            && err.contains("lends"),
        "{err}"
    );
}

/// Without a driver (this crate's CI hosts) opening says why and never panics;
/// with one, the runtime counts devices and offers the lending channels.
#[test]
fn opening_says_why_cuda_cannot_be_used() {
    match CudaPlugin.open() {
        Ok(runtime) => {
            assert!(runtime.device_count() > 0);
            let kinds: Vec<ChannelKind> = runtime
                .lending_channels()
                .into_iter()
                .map(|(kind, _)| kind)
                .collect();
            assert_eq!(
                kinds,
                [
                    ChannelKind::CudaXth,
                    ChannelKind::CudaIpc,
                    ChannelKind::CudaGdr
                ]
            );
        }
        Err(e) => {
            let reason = e.report();
            eprintln!("CUDA is not usable here: {reason}");
            assert!(
                reason.starts_with("cannot open the device runtime: CUDA is not viable"),
                "{reason}"
            );
            assert_eq!(e.operation(), DeviceOp::Open);
        }
    }
}

/// On a GPU: memory written asynchronously on a stream of the caller's and marked with
/// `record_ready` (no synchronisation) is complete for every use the runtime makes of
/// it: a `cuda_xth` loan, `cuda_basic`'s staging and `to_host`.
#[test]
fn a_ready_event_orders_the_runtimes_use_of_the_memory() {
    let Some(runtime) = gpu_runtime("a_ready_event_orders_the_runtimes_use_of_the_memory") else {
        return;
    };
    let cuda0 = Device::cuda(0);
    let bytes = pattern((8 << 20) + 3, 5);
    let gpu = Gpu::open(0).unwrap_or_else(|e| panic!("{e}"));
    let stream = gpu.new_stream().unwrap_or_else(|e| panic!("{e}"));
    let memory = CudaMemory::alloc(cuda0, bytes.len()).unwrap_or_else(|e| panic!("{e}"));
    let mut staging = StagingBuffer::new(&gpu, bytes.len()).unwrap_or_else(|e| panic!("{e}"));
    staging
        .bytes_mut()
        .expect("an idle staging buffer")
        .copy_from_slice(&bytes);
    staging
        .upload(memory.range(), &stream)
        .unwrap_or_else(|e| panic!("{e}"));
    memory
        .record_ready(&stream)
        .unwrap_or_else(|e| panic!("{e}"));
    let lent = DeviceBuffer::new(memory);
    let loan = runtime
        .lend(ChannelKind::CudaXth, &lent)
        .unwrap_or_else(|e| panic!("{e}"));
    let copy = runtime
        .borrow(
            ChannelKind::CudaXth,
            cuda0,
            bytes.len() as u64,
            &loan.descriptor,
        )
        .unwrap_or_else(|e| panic!("{e}"));
    let own = copy.downcast_ref::<CudaMemory>().expect("CudaMemory");
    assert!(own.to_host().is_ok_and(|b| b == bytes), "cuda_xth copy");
    let staged = runtime
        .copy_to_host(&lent)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(staged == bytes, "cuda_basic staging");
    let own = lent.downcast_ref::<CudaMemory>().expect("CudaMemory");
    assert!(own.to_host().is_ok_and(|b| b == bytes), "to_host");
    drop(staging);
}

/// On a GPU, with the pending hand-over: a tensor borrowed over cuda_xth is handed over
/// with its copy running; `is_ready`/`wait_ready_for` (what `Tensor::wait_ready` asks)
/// say when it is complete, and the lender's release waits for the copy. A second
/// borrow of the same loan is refused (each loan is copied once).
#[test]
fn xth_pending_hand_over_is_ready_when_its_event_says_so() {
    let test = "xth_pending_hand_over_is_ready_when_its_event_says_so";
    let Some(runtime) = gpu_runtime_with(
        test,
        CudaOptions {
            pending_hand_over: true,
            ..CudaOptions::default()
        },
    ) else {
        return;
    };
    let cuda0 = Device::cuda(0);
    let bytes = pattern((64 << 20) + 3, 2);
    let lent =
        DeviceBuffer::new(CudaMemory::upload(cuda0, &bytes).unwrap_or_else(|e| panic!("{e}")));
    let loan = runtime
        .lend(ChannelKind::CudaXth, &lent)
        .unwrap_or_else(|e| panic!("{}", e.report()));
    let copy = runtime
        .borrow(
            ChannelKind::CudaXth,
            cuda0,
            bytes.len() as u64,
            &loan.descriptor,
        )
        .unwrap_or_else(|e| panic!("{}", e.report()));
    let ready = copy
        .wait_ready(std::time::Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{}", e.report()));
    assert!(ready, "the copy did not complete in 30 s");
    assert!(copy.is_ready().unwrap_or(false));
    let own = copy.downcast_ref::<CudaMemory>().expect("CudaMemory");
    assert!(own.to_host().is_ok_and(|b| b == bytes));
    let again = runtime
        .borrow(
            ChannelKind::CudaXth,
            cuda0,
            bytes.len() as u64,
            &loan.descriptor,
        )
        .expect_err("claimed already")
        .report();
    assert!(again.contains("no loan of"), "{again}");
    drop(loan);
}

/// On a GPU: a tensor received in parts from several threads at once, as mpt's lanes
/// hand them over (each lane its own stripe, piece by piece), lands byte for byte; one
/// abandoned midway gives its slots and memory back.
#[test]
fn parts_from_several_threads_land_on_a_gpu() {
    let Some(runtime) = gpu_runtime("parts_from_several_threads_land_on_a_gpu") else {
        return;
    };
    let cuda0 = Device::cuda(0);
    let state = runtime.device(cuda0).unwrap_or_else(|e| panic!("{e}"));
    let len = (3 << 20) + 5;
    let bytes = pattern(len, 4);
    let parted = runtime
        .receive_parts(cuda0, len)
        .unwrap_or_else(|e| panic!("{}", e.report()))
        .expect("the CUDA runtime receives in parts");
    let chunk = parted.part_len();
    let stripes = rdzv_core::channel::mpt::stripes(len, 3, 1 << 20);
    std::thread::scope(|s| {
        for stripe in stripes {
            let (parted, bytes) = (&parted, &bytes);
            s.spawn(move || {
                for (offset, n) in rdzv_core::channel::mpt::pieces(stripe, chunk) {
                    let mut part = parted
                        .part(offset, n)
                        .unwrap_or_else(|e| panic!("{}", e.report()));
                    part.bytes_mut().copy_from_slice(&bytes[offset..offset + n]);
                    parted
                        .part_filled(part)
                        .unwrap_or_else(|e| panic!("{}", e.report()));
                }
            });
        }
    });
    let memory = parted.finish().unwrap_or_else(|e| panic!("{}", e.report()));
    let own = memory.downcast_ref::<CudaMemory>().expect("CudaMemory");
    assert!(
        own.to_host().is_ok_and(|b| b == bytes),
        "parts landed wrong"
    );

    // Abandoned after one part: slots and memory go back.
    let in_use = state.allocator.stats().in_use;
    let parted = runtime
        .receive_parts(cuda0, len)
        .unwrap_or_else(|e| panic!("{}", e.report()))
        .expect("parts");
    let mut part = parted
        .part(0, chunk)
        .unwrap_or_else(|e| panic!("{}", e.report()));
    part.bytes_mut().fill(1);
    parted
        .part_filled(part)
        .unwrap_or_else(|e| panic!("{}", e.report()));
    assert!(parted.part(chunk - 1, 2).is_err(), "crosses a chunk");
    drop(parted);
    assert_eq!(state.allocator.stats().in_use, in_use);
}
