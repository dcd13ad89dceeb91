//! Exports, pulls and refusals over `cma` and `xth`, slicing, channel viability and
//! pipe ends.

use super::pull::{read_in_slices, PARALLEL_PULL_MIN};
use std::sync::{Arc, Mutex, PoisonError};

use rdzv_core::device::{Device, DeviceType};
use rdzv_core::negotiate::{ChannelKind, Negotiated, Role};
use rdzv_core::rpc::frame::TensorDescriptor;

use crate::channel::cma::CmaDescriptor;
use crate::channel::xth::XthDescriptor;
use crate::rpc::device::{DeviceError, DeviceOp, Devices, HostBytes, PipeId};
use crate::rpc::transport::OwnedFrame;

use super::*;
use crate::rpc::device::{DevicePlugin, DeviceRuntime};
use rdzv_core::negotiate::{
    accept_answer, answer_brochure, DeviceDescriptors, Offer, TransportKind,
};
use rdzv_core::rpc::frame::FrameKind;

/// Both ends of a pipe offering `channels` (kind, descriptor) and tcp.
pub(super) fn negotiate(channels: &[(ChannelKind, &str)]) -> Negotiated {
    let channels: Vec<_> = channels
        .iter()
        .map(|&(kind, descriptor)| (kind, DeviceDescriptors::cpu(descriptor)))
        .collect();
    negotiate_with(&channels)
}

/// Both ends of a pipe offering `channels` (kind, descriptors by device) and tcp.
pub(super) fn negotiate_with(channels: &[(ChannelKind, DeviceDescriptors<'_>)]) -> Negotiated {
    let build = || {
        let mut offer = Offer::new();
        offer
            .add_transport(TransportKind::Tcp, 0, "tcp:*")
            .map_err(|e| e.to_string())?;
        for (kind, descriptors) in channels {
            offer
                .add_channel(*kind, kind.default_priority(), *descriptors)
                .map_err(|e| e.to_string())?;
        }
        Ok::<_, String>(offer)
    };
    let (listener, connector) = match (build(), build()) {
        (Ok(l), Ok(c)) => (l, c),
        (Err(e), _) | (_, Err(e)) => panic!("offer: {e}"),
    };
    let answer =
        answer_brochure(&listener, &connector.brochure()).unwrap_or_else(|e| panic!("{e}"));
    accept_answer(&connector, &answer).unwrap_or_else(|e| panic!("{e}"))
}

pub(super) fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

/// A sent frame's tensor entries, as the receiving side gets them.
pub(super) fn entries(frame: &OwnedFrame) -> Vec<(TensorDescriptor, Vec<u8>)> {
    frame
        .tensors
        .iter()
        .copied()
        .zip(frame.tensor_data.iter().map(|d| d.to_vec()))
        .collect()
}

/// Why `entries` are refused as the client side of `negotiated`, from `w1`, reading
/// through `reader`: when sorting them, or (`pull`) when pulling them.
fn refusal(
    entries: Vec<(TensorDescriptor, Vec<u8>)>,
    negotiated: &Negotiated,
    reader: &Arc<PipeReader>,
    pull: bool,
) -> String {
    let sorted = ReceivedTensors::sort(
        entries,
        negotiated,
        Role::Connector,
        (reader, &Devices::default()),
        "w1",
    );
    let result = if pull {
        sorted.and_then(ReceivedTensors::pull).map(|_| ())
    } else {
        sorted.map(|_| ())
    };
    match result {
        Err(e) => e.to_string(),
        Ok(()) => panic!("the tensors were accepted"),
    }
}

#[test]
fn small_tensors_stay_inline_and_large_ones_are_exported() {
    let xth =
        domain_descriptor(ChannelKind::Xth, &Devices::default()).unwrap_or_else(|e| panic!("{e}"));
    let negotiated = negotiate(&[(ChannelKind::Xth, &xth), (ChannelKind::Basic, "basic:any")]);
    assert_eq!(
        cpu_channel(&negotiated, Role::Connector),
        Some(ChannelKind::Xth)
    );
    let mut frame = OwnedFrame::empty(FrameKind::Request, 1);
    let mut exports = FrameExports::default();
    let mut moved = ChannelBytes::default();
    for data in [Vec::new(), pattern(10), pattern(5000)] {
        add_tensor(
            &mut frame,
            &mut exports,
            &mut moved,
            data.into(),
            Device::cpu(),
            Device::cpu(),
            ChannelKind::Xth,
            100,
            "peer",
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
    assert_eq!(frame.tensors.len(), 3);
    assert!(frame.tensors[0].is_inline() && frame.tensors[1].is_inline());
    assert_eq!(frame.tensors[2].channel, ChannelKind::Xth);
    assert_eq!(
        usize::from(frame.tensors[2].channel_descriptor_len),
        XthDescriptor::ENCODED_LEN
    );
    assert_eq!(moved.get(ChannelKind::Basic), 10);
    assert_eq!(moved.get(ChannelKind::Xth), 5000);
    assert!(!exports.is_empty());
    assert!(frame.encode_head().is_ok());

    // The receiving side pulls the exported one and gets every tensor back in order.
    let reader = Arc::new(PipeReader::default());
    let received = ReceivedTensors::sort(
        entries(&frame),
        &negotiated,
        Role::Listener,
        (&reader, &Devices::default()),
        "peer",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(received.has_out_of_band());
    assert_eq!(received.pull_bytes(), 5000);
    let tensors = received.pull().unwrap_or_else(|e| panic!("{e}"));
    let datas: Vec<Vec<u8>> = tensors.into_iter().map(|t| t.data).collect();
    assert_eq!(datas, vec![Vec::new(), pattern(10), pattern(5000)]);

    // Once the exports are released, the descriptor no longer reads.
    drop(exports);
    let again = ReceivedTensors::sort(
        entries(&frame),
        &negotiated,
        Role::Listener,
        (&reader, &Devices::default()),
        "peer",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let err = again.pull().map(|_| ()).expect_err("released export");
    let text = err.to_string();
    assert!(text.contains("xth") && text.contains("peer"), "{text}");
    // A lender releases what it lent only when its pipe ends: the call failed with the
    // pipe, and may be made again.
    assert_eq!(err.kind(), crate::rpc::CallErrorKind::PipeBroken, "{text}");
    assert!(
        err.is_retryable() && text.contains("released a tensor it lent"),
        "{text}"
    );
}

#[test]
fn cma_round_trip_and_refusals() {
    let cma = match domain_descriptor(ChannelKind::Cma, &Devices::default()) {
        Ok(cma) => cma,
        Err(reason) => {
            eprintln!("skipped: cma is not viable here: {reason}");
            return;
        }
    };
    let negotiated = negotiate(&[(ChannelKind::Cma, &cma), (ChannelKind::Basic, "basic:any")]);
    let mut frame = OwnedFrame::empty(FrameKind::Response, 3);
    let mut exports = FrameExports::default();
    let mut moved = ChannelBytes::default();
    add_tensor(
        &mut frame,
        &mut exports,
        &mut moved,
        pattern(1 << 20).into(),
        Device::cpu(),
        Device::cpu(),
        ChannelKind::Cma,
        DEFAULT_MIN_CHANNEL_BYTES,
        "peer",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(frame.tensors[0].channel, ChannelKind::Cma);
    let entries = entries(&frame);
    let reader = Arc::new(PipeReader::default());
    let received = ReceivedTensors::sort(
        entries.clone(),
        &negotiated,
        Role::Connector,
        (&reader, &Devices::default()),
        "w1",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let tensors = received.pull().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        tensors.first().map(|t| t.data.clone()),
        Some(pattern(1 << 20))
    );

    // A channel this pipe did not negotiate is refused before anything is read.
    let basic_only = negotiate(&[(ChannelKind::Basic, "basic:any")]);
    let err = refusal(entries.clone(), &basic_only, &reader, false);
    assert!(err.contains("negotiated basic"), "{err}");

    // A descriptor announcing another length is refused.
    let mut lying = entries.clone();
    lying[0].0.len += 1;
    refusal(lying, &negotiated, &reader, false);

    // A descriptor naming another process than the pipe's is refused by name.
    let mut other = CmaDescriptor::decode(&entries[0].1).unwrap_or_else(|e| panic!("{e}"));
    other.process.pid = other.process.pid.wrapping_add(1);
    let mut forged = entries.clone();
    forged[0].1 = other.encode().to_vec();
    let text = refusal(forged, &negotiated, &reader, true);
    assert!(
        text.contains("cma") && text.contains("w1") && text.contains("pid"),
        "{text}"
    );

    // A gone peer fails with the channel, the peer and the reason.
    let fresh = Arc::new(PipeReader::default());
    let mut gone = CmaDescriptor::decode(&entries[0].1).unwrap_or_else(|e| panic!("{e}"));
    gone.process.start_time = gone.process.start_time.wrapping_add(1);
    let mut dead = entries;
    dead[0].1 = gone.encode().to_vec();
    let text = refusal(dead, &negotiated, &fresh, true);
    assert!(
        text.contains("cma") && text.contains("w1") && text.contains("gone"),
        "{text}"
    );
    drop(exports);
}

#[test]
fn slices_cover_the_buffer_once() {
    for len in [
        0,
        10,
        PARALLEL_PULL_MIN - 1,
        PARALLEL_PULL_MIN,
        3 * PARALLEL_PULL_MIN + 7,
    ] {
        let mut dst = vec![0u8; len];
        let calls = std::sync::atomic::AtomicUsize::new(0);
        read_in_slices(&mut dst, |offset, part| {
            calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            for (i, byte) in part.iter_mut().enumerate() {
                *byte = byte.wrapping_add(((offset as usize + i) % 251) as u8 + 1);
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let expected: Vec<u8> = (0..len).map(|i| (i % 251) as u8 + 1).collect();
        assert!(dst == expected, "{len} bytes");
        assert!(calls.into_inner() >= usize::from(len > 0).max(1));
    }
    let mut dst = vec![0u8; 2 * PARALLEL_PULL_MIN];
    let failed = read_in_slices(&mut dst, |offset, _| {
        if offset > 0 {
            Err(format!("slice at {offset} failed").into())
        } else {
            Ok(())
        }
    });
    let parallel = std::thread::available_parallelism().map_or(1, usize::from) > 1;
    assert_eq!(failed.is_err(), parallel);
}

#[test]
fn unknown_channels_are_not_viable() {
    let none = Devices::default();
    assert_eq!(
        domain_descriptor(ChannelKind::Basic, &none).as_deref(),
        Ok(BASIC_DESCRIPTOR)
    );
    assert_eq!(
        domain_descriptor(ChannelKind::Mpt, &none).as_deref(),
        Ok(MPT_DESCRIPTOR)
    );
    let err = domain_descriptor(ChannelKind::CudaGdr, &none).expect_err("no runtime");
    assert!(err.contains("device_plugins"), "{err}");
    let err = domain_descriptor(ChannelKind::CudaIpc, &none).expect_err("no runtime");
    assert!(err.contains("device_plugins"), "{err}");
}

/// Counts the pipes the runtime was told ended.
#[derive(Default)]
struct EndCounting(Mutex<Vec<PipeId>>);

impl DeviceRuntime for EndCounting {
    fn device_count(&self) -> usize {
        1
    }
    fn copy_to_host(&self, _: &crate::rpc::DeviceBuffer) -> Result<HostBytes, DeviceError> {
        Err(DeviceError::new(DeviceOp::CopyToHost, "unused"))
    }
    fn copy_from_host(
        &self,
        _: Device,
        _: Vec<u8>,
    ) -> Result<crate::rpc::DeviceBuffer, DeviceError> {
        Err(DeviceError::new(DeviceOp::CopyFromHost, "unused"))
    }
    fn pipe_ended(&self, pipe: PipeId) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(pipe);
    }
}

struct Plugin(Arc<EndCounting>);

impl DevicePlugin for Plugin {
    fn device_type(&self) -> DeviceType {
        DeviceType::Cuda
    }
    fn open(&self) -> Result<Arc<dyn DeviceRuntime>, DeviceError> {
        Ok(Arc::clone(&self.0) as Arc<dyn DeviceRuntime>)
    }
}

#[test]
fn a_pipe_that_borrowed_tells_the_runtime_when_it_ends() {
    let runtime = Arc::new(EndCounting::default());
    let plugin: Arc<dyn DevicePlugin> = Arc::new(Plugin(Arc::clone(&runtime)));
    let devices = Devices::open(&[plugin]).unwrap_or_else(|e| panic!("{e}"));
    let ended = |r: &EndCounting| r.0.lock().unwrap_or_else(PoisonError::into_inner).clone();

    let idle = PipeReader::default();
    drop(idle);
    assert!(
        ended(&runtime).is_empty(),
        "a pipe that borrowed nothing is not reported"
    );

    let reader = PipeReader::default();
    let pipe = reader.borrowing_pipe(&devices);
    assert_eq!(reader.borrowing_pipe(&devices), pipe, "one id per pipe");
    let other = PipeReader::default();
    assert_ne!(other.borrowing_pipe(&devices), pipe);
    drop(reader);
    assert_eq!(ended(&runtime), [pipe], "reported once, when it ends");
}

/// Device memory the mpt connections received for a frame waits in the pipe's reader until
/// the frame is sorted; a refused frame drops it rather than leaving it to the pipe's end.
#[test]
fn a_refused_frame_drops_what_its_mpt_connections_received() {
    use crate::channel::mpt::MptDescriptor;
    use crate::rpc::device::{DeviceBuffer, HostMemory};
    let negotiated = negotiate(&[
        (ChannelKind::Mpt, "mpt:tcp"),
        (ChannelKind::Basic, "basic:any"),
    ]);
    let reader = Arc::new(PipeReader::default());
    let streamed = |transfer_id: u64| {
        let data = MptDescriptor { transfer_id }.encode().to_vec();
        let descriptor = TensorDescriptor {
            channel: ChannelKind::Mpt,
            channel_descriptor_len: data.len() as u8,
            ..TensorDescriptor::inline(Device::cpu(), Device::cpu(), 4)
        };
        (descriptor, data)
    };
    let memory = || {
        Ok(DeviceBuffer::new(HostMemory::new(
            Device::cpu(),
            vec![9; 4],
        )))
    };
    // Sorted: the tensor is the memory the mpt connections put there.
    reader.arrived(7, memory());
    let received = ReceivedTensors::sort(
        vec![streamed(7)],
        &negotiated,
        Role::Connector,
        (&reader, &Devices::default()),
        "w1",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let tensors = received.pull().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(tensors.first().map(|t| t.len()), Some(4));
    assert!(reader.take_arrived(7).is_none());
    // Refused (its first tensor names a channel not negotiated): the memory goes.
    reader.arrived(8, memory());
    let mut cma = streamed(0);
    cma.0.channel = ChannelKind::Cma;
    let err = refusal(vec![cma, streamed(8)], &negotiated, &reader, false);
    assert!(err.contains("tensor 0"), "{err}");
    assert!(reader.take_arrived(8).is_none(), "left for the pipe's end");
}
