//! `cuda_xth`: CUDA tensors between two endpoints of one process.
//!
//! TensorPipe's protocol, with an in-process queue instead of a connection: the sender
//! records a *start* event on its stream and posts `{source range, device, start event}`;
//! the receiver makes its stream wait on the start event, enqueues the copy
//! (`cuMemcpyDtoDAsync`, or `cuMemcpyPeerAsync` between devices), records a *stop* event
//! and replies with it; the sender makes its stream wait on the stop event. Neither side
//! blocks on the GPU: ordering is carried by the two events, so the sender may reuse the
//! source once its stream has passed the stop event, and the receiver may read the
//! destination after its stream.
//!
//! [`pair`] makes the two ends. This module does not negotiate (descriptor: see
//! [`descriptor`](super::descriptor)) and does not check peer access: `cuMemcpyPeerAsync`
//! stages through the host when the devices have none.

use std::marker::PhantomData;
use std::sync::mpsc;

use cudarc::driver::safe::CudaStream;

use super::channel_error::CudaChannelError;
use super::memory::{copy_device_async, DeviceRange, DeviceSource, Gpu, RawEvent};

struct XthRequest {
    src_ptr: u64,
    len: usize,
    src_gpu: Gpu,
    start: RawEvent,
    reply: mpsc::Sender<Result<RawEvent, String>>,
}

/// The sending end of a `cuda_xth` channel.
#[derive(Debug, Clone)]
pub struct XthSender {
    requests: mpsc::Sender<XthRequest>,
}

/// The receiving end of a `cuda_xth` channel.
#[derive(Debug)]
pub struct XthReceiver {
    requests: mpsc::Receiver<XthRequest>,
}

impl std::fmt::Debug for XthRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XthRequest")
            .field("src_ptr", &format_args!("{:#x}", self.src_ptr))
            .field("len", &self.len)
            .field("src_device", &self.src_gpu.ordinal())
            .finish()
    }
}

/// A connected sender and receiver.
pub fn pair() -> (XthSender, XthReceiver) {
    let (requests, incoming) = mpsc::channel();
    (XthSender { requests }, XthReceiver { requests: incoming })
}

/// A send whose copy the receiver has not yet enqueued. The source stays borrowed until
/// [`wait`](Self::wait); dropping it instead blocks until the receiver has handled the
/// request (or is gone) and the copy has finished, so the source is never freed under the
/// copy.
#[derive(Debug)]
#[must_use = "the copy is only ordered with the sender's stream after `wait`"]
pub struct XthPending<'a> {
    reply: Option<mpsc::Receiver<Result<RawEvent, String>>>,
    _src: PhantomData<DeviceRange<'a>>,
}

impl XthSender {
    /// Posts `src` (device memory produced by work on `stream`) to the receiver.
    pub fn send<'a>(
        &self,
        src: DeviceRange<'a>,
        stream: &CudaStream,
    ) -> Result<XthPending<'a>, CudaChannelError> {
        let gpu = Gpu::of_stream(stream);
        let start = RawEvent::new(&gpu, false)?;
        start.record(stream)?;
        let (reply, replies) = mpsc::channel();
        self.requests
            .send(XthRequest {
                src_ptr: src.ptr(),
                len: src.len(),
                src_gpu: gpu,
                start,
                reply,
            })
            .map_err(|_| CudaChannelError::PeerGone)?;
        Ok(XthPending {
            reply: Some(replies),
            _src: PhantomData,
        })
    }
}

impl XthPending<'_> {
    /// Waits for the receiver to enqueue the copy, then makes `stream` wait for the copy
    /// to finish before any later work (such as reusing the source).
    pub fn wait(mut self, stream: &CudaStream) -> Result<(), CudaChannelError> {
        let replies = self.reply.take().ok_or(CudaChannelError::PeerGone)?;
        let stop = replies
            .recv()
            .map_err(|_| CudaChannelError::PeerGone)?
            .map_err(|detail| CudaChannelError::PeerFailed { detail })?;
        stop.wait_on(stream)
    }
}

impl Drop for XthPending<'_> {
    fn drop(&mut self) {
        if let Some(replies) = self.reply.take() {
            if let Ok(Ok(stop)) = replies.recv() {
                let _ = stop.synchronize();
            }
        }
    }
}

impl XthReceiver {
    /// Takes the next posted tensor and enqueues its copy into `dst` on `stream`. The
    /// destination is ready once `stream` has passed this point.
    pub fn recv(&self, dst: DeviceRange<'_>, stream: &CudaStream) -> Result<(), CudaChannelError> {
        let request = self
            .requests
            .recv()
            .map_err(|_| CudaChannelError::PeerGone)?;
        match Self::copy(&request, dst, stream) {
            Ok(stop) => {
                // A sender that is gone no longer needs the event.
                let _ = request.reply.send(Ok(stop));
                Ok(())
            }
            Err(err) => {
                let _ = request
                    .reply
                    .send(Err(crate::report::ErrorChain(&err).to_string()));
                Err(err)
            }
        }
    }

    fn copy(
        request: &XthRequest,
        dst: DeviceRange<'_>,
        stream: &CudaStream,
    ) -> Result<RawEvent, CudaChannelError> {
        if request.len != dst.len() {
            return Err(CudaChannelError::LengthMismatch {
                sent: request.len as u64,
                expected: dst.len() as u64,
            });
        }
        let gpu = Gpu::of_stream(stream);
        request.start.wait_on(stream)?;
        // Only read: the sender borrowed `[src_ptr, src_ptr + len)` for the lifetime of its
        // `XthPending`, which does not end before the stop event recorded below has been
        // waited on (or synchronised on drop).
        let src = DeviceSource::named_by_peer(request.src_ptr, request.len);
        copy_device_async(dst, &gpu, src, &request.src_gpu, stream)?;
        let stop = RawEvent::new(&gpu, false)?;
        stop.record(stream)?;
        Ok(stop)
    }
}
