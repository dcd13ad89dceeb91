//! The CUDA limit rows of `--device cuda:N`, measured in the same run as the RPC rows,
//! for each payload size on that GPU:
//!
//! - `cuda-d2d`: one sample copies a buffer to a second one and back
//!   (`cuMemcpyDtoDAsync` twice on one stream, then an event synchronisation);
//! - `h2d-pinned`: one sample copies pinned host memory (`cuMemHostAlloc`) to the device
//!   twice (`cuMemcpyHtoDAsync`);
//! - `d2h-pinned`: the same, device to pinned host memory (`cuMemcpyDtoHAsync`).
//!
//! So that, like an echo, a sample moves the payload twice, and a row's bandwidth counts
//! both copies (for the pinned rows: the bandwidth of that one direction). Each copy is
//! checked once per size. A 0-byte payload has only the `cuda-d2d` row. Without a usable driver or device it reports why, never panics.

use std::time::Instant;

use indicatif::ProgressBar;
use rdzv_rdma::cuda::memory::{
    copy_device_async, CudaCallError, DeviceAllocation, Gpu, RawEvent, StagingBuffer,
};
use rdzv_rdma::cuda::CudaViability;

use super::payload::Payload;
use super::row::{human_size, samples, Row, RunMode, NO_CHANNEL};
use super::viability::error_chain;
use crate::BenchError;

/// The transport name of the device-to-device limit rows.
pub(super) const CUDA_D2D: &str = "cuda-d2d";
/// The transport name of the pinned host-to-device limit rows.
pub(super) const H2D_PINNED: &str = "h2d-pinned";
/// The transport name of the pinned device-to-host limit rows.
pub(super) const D2H_PINNED: &str = "d2h-pinned";

/// Why `cuda:ordinal` cannot be measured here, or `None` when it can. A device that the
/// driver does not have is an error, not a skip.
pub(super) fn not_viable(ordinal: u8) -> Result<Option<String>, BenchError> {
    match rdzv_rdma::cuda::probe() {
        CudaViability::NotViable(reason) => {
            Ok(Some(format!("not viable: {}", error_chain(&reason))))
        }
        CudaViability::Viable(report) => {
            if usize::from(ordinal) < report.devices.len() {
                Ok(None)
            } else {
                Err(BenchError::InvalidArgument(format!(
                    "--device cuda:{ordinal}: this host has {} CUDA device(s)",
                    report.devices.len()
                )))
            }
        }
    }
}

/// Times `iters` samples of `sample` (after one unrecorded warm-up); each enqueues its
/// copies and waits for them.
fn timed(
    iters: usize,
    bar: &ProgressBar,
    mut sample: impl FnMut() -> Result<(), BenchError>,
) -> Result<Vec<std::time::Duration>, BenchError> {
    samples(iters, Some(bar), |_| {
        let started = Instant::now();
        sample()?;
        Ok(started.elapsed())
    })
}

/// For `map_err`: a CUDA call doing `what` failed.
fn cuda<E: std::error::Error + Send + Sync + 'static>(
    what: impl Into<String>,
) -> impl FnOnce(E) -> BenchError {
    let what = what.into();
    move |source| BenchError::Cuda {
        what,
        source: Box::new(source),
    }
}

/// The rows of every limit, one per `(payload bytes, iterations)` on `cuda:ordinal`.
pub(super) fn measure(
    ordinal: u8,
    sizes: &[(usize, usize)],
    mode: RunMode,
    bar: &ProgressBar,
) -> Result<Vec<Row>, BenchError> {
    let on = format!("cuda:{ordinal}");
    let gpu = Gpu::open(usize::from(ordinal)).map_err(cuda(format!("opening {on}")))?;
    let stream = gpu
        .new_stream()
        .map_err(cuda(format!("a stream on {on}")))?;
    let done = RawEvent::new(&gpu, false).map_err(cuda(format!("an event on {on}")))?;
    // The stream's type is cudarc's, which this crate does not name: the calls that
    // take it are closures here.
    let round = |a: &DeviceAllocation, b: &DeviceAllocation| {
        copy_device_async(b.range(), &gpu, a.range(), &gpu, &stream)
            .and_then(|()| copy_device_async(a.range(), &gpu, b.range(), &gpu, &stream))
            .and_then(|()| done.record(&stream))
            .and_then(|()| done.synchronize())
    };
    let upload = |host: &mut StagingBuffer, b: &DeviceAllocation| host.upload(b.range(), &stream);
    let download =
        |host: &mut StagingBuffer, b: &DeviceAllocation| host.download(b.range().source(), &stream);
    let device = Device {
        on: &on,
        gpu: &gpu,
        round: &round,
        upload: &upload,
        download: &download,
    };
    let mut rows = Vec::with_capacity(3 * sizes.len());
    for &(len, iters) in sizes {
        let payload = Payload::new(len);
        let a = gpu
            .alloc(len)
            .map_err(cuda(format!("{len} bytes on {on}")))?;
        let b = gpu
            .alloc(len)
            .map_err(cuda(format!("{len} bytes on {on}")))?;
        bar.inc_length(3 * iters as u64);
        rows.push(device.d2d_row(&payload, (a, &b), iters, mode, bar)?);
        if len == 0 {
            // Pinned memory of 0 bytes cannot be allocated, and nothing would move.
            bar.inc(2 * iters as u64);
            continue;
        }
        rows.extend(device.pinned_rows(&payload, &b, iters, mode, bar)?);
    }
    Ok(rows)
}

/// The host buffer's copy between pinned memory and `b`, on the device's stream.
type Staged<'a> = &'a dyn Fn(&mut StagingBuffer, &DeviceAllocation) -> Result<(), CudaCallError>;

/// One device's handles while its limits are measured.
struct Device<'a> {
    /// `cuda:N`, for messages.
    on: &'a str,
    gpu: &'a Gpu,
    /// `b` to `a` and back on the stream, then wait for both.
    round: &'a dyn Fn(&DeviceAllocation, &DeviceAllocation) -> Result<(), CudaCallError>,
    /// Pinned memory to `b`.
    upload: Staged<'a>,
    /// `b` to pinned memory.
    download: Staged<'a>,
}

impl Device<'_> {
    /// The device-to-device row: `b` to `a` and back per sample, checked once after.
    fn d2d_row(
        &self,
        payload: &Payload,
        (mut a, b): (DeviceAllocation, &DeviceAllocation),
        iters: usize,
        mode: RunMode,
        bar: &ProgressBar,
    ) -> Result<Row, BenchError> {
        let on = self.on;
        let len = payload.len();
        a.copy_from_host(&payload.message(0))
            .map_err(cuda(format!("filling {len} bytes on {on}")))?;
        bar.set_message(format!("{CUDA_D2D} {on} {}", human_size(len as u64)));
        let d2d = timed(iters, bar, || {
            (self.round)(&a, b).map_err(cuda(format!("a device-to-device copy on {on}")))
        })?;
        let mut back = vec![0u8; len];
        a.copy_to_host(&mut back)
            .map_err(cuda(format!("reading {len} bytes back from {on}")))?;
        payload.check(0, &back).map_err(|source| BenchError::Echo {
            what: format!("the device-to-device copy on {on}"),
            source: Box::new(source),
        })?;
        Ok(Row::from_samples(
            CUDA_D2D, NO_CHANNEL, mode, len as u64, d2d,
        ))
    }

    /// The pinned host-to-device and device-to-host rows, through pinned memory fenced
    /// by its own event (each copy records it, and the sample waits for it); the copies
    /// are checked once after: the payload to the device and back.
    fn pinned_rows(
        &self,
        payload: &Payload,
        b: &DeviceAllocation,
        iters: usize,
        mode: RunMode,
        bar: &ProgressBar,
    ) -> Result<[Row; 2], BenchError> {
        let (on, upload, download) = (self.on, self.upload, self.download);
        let len = payload.len();
        let pinned = |what: &str| cuda(format!("{what} {len} bytes of pinned memory on {on}"));
        let mut host = StagingBuffer::new(self.gpu, len).map_err(pinned("allocating"))?;
        bar.set_message(format!("{H2D_PINNED} {on} {}", human_size(len as u64)));
        let h2d = timed(iters, bar, || {
            upload(&mut host, b)
                .and_then(|()| upload(&mut host, b))
                .and_then(|()| host.wait())
                .map_err(pinned("uploading"))
        })?;
        bar.set_message(format!("{D2H_PINNED} {on} {}", human_size(len as u64)));
        let d2h = timed(iters, bar, || {
            download(&mut host, b)
                .and_then(|()| download(&mut host, b))
                .and_then(|()| host.wait())
                .map_err(pinned("downloading"))
        })?;
        host.wait().map_err(pinned("waiting for"))?;
        if let Some(bytes) = host.bytes_mut() {
            bytes.copy_from_slice(&payload.message(0));
        }
        upload(&mut host, b)
            .and_then(|()| host.wait())
            .map_err(pinned("uploading"))?;
        if let Some(bytes) = host.bytes_mut() {
            bytes.fill(0);
        }
        download(&mut host, b)
            .and_then(|()| host.wait())
            .map_err(pinned("downloading"))?;
        payload
            .check(0, host.bytes().unwrap_or_default())
            .map_err(|source| BenchError::Echo {
                what: format!("the pinned copies on {on}"),
                source: Box::new(source),
            })?;
        Ok([
            Row::from_samples(H2D_PINNED, NO_CHANNEL, mode, len as u64, h2d),
            Row::from_samples(D2H_PINNED, NO_CHANNEL, mode, len as u64, d2h),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_is_measured_or_skipped_with_a_reason() {
        match not_viable(0) {
            Ok(Some(reason)) => {
                eprintln!("SKIP: the CUDA limit row: {reason}");
                assert!(reason.starts_with("not viable: "), "{reason}");
            }
            Ok(None) => {
                let bar =
                    ProgressBar::with_draw_target(Some(0), indicatif::ProgressDrawTarget::hidden());
                let rows = measure(0, &[(0, 2), (1 << 20, 3)], RunMode::Local, &bar).unwrap();
                let names: Vec<&str> = rows.iter().map(|r| r.transport.as_str()).collect();
                assert_eq!(names, [CUDA_D2D, CUDA_D2D, H2D_PINNED, D2H_PINNED]);
                assert!(rows[1..]
                    .iter()
                    .all(|r| r.iters == 3 && r.gbytes_per_s > 0.0));
            }
            Err(e) => panic!("device 0 of a viable driver: {e}"),
        }
        // No host has 256 devices: an error when CUDA works, a skip when it does not.
        if let Ok(None) = not_viable(255) {
            panic!("cuda:255 cannot exist");
        }
    }
}
