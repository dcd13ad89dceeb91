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
use rdzv_rdma::cuda::memory::{copy_device_async, Gpu, RawEvent, StagingBuffer};
use rdzv_rdma::cuda::CudaViability;

use super::payload::Payload;
use super::row::{human_size, Row, RunMode, NO_CHANNEL};
use super::viability::error_chain;
use crate::error::CliError;

/// The transport name of the device-to-device limit rows.
pub(super) const CUDA_D2D: &str = "cuda-d2d";
/// The transport name of the pinned host-to-device limit rows.
pub(super) const H2D_PINNED: &str = "h2d-pinned";
/// The transport name of the pinned device-to-host limit rows.
pub(super) const D2H_PINNED: &str = "d2h-pinned";

/// Why `cuda:ordinal` cannot be measured here, or `None` when it can. A device that the
/// driver does not have is an error, not a skip.
pub(super) fn not_viable(ordinal: u8) -> Result<Option<String>, CliError> {
    match rdzv_rdma::cuda::probe() {
        CudaViability::NotViable(reason) => {
            Ok(Some(format!("not viable: {}", error_chain(&reason))))
        }
        CudaViability::Viable(report) => {
            if usize::from(ordinal) < report.devices.len() {
                Ok(None)
            } else {
                Err(format!(
                    "--device cuda:{ordinal}: this host has {} CUDA device(s)",
                    report.devices.len()
                )
                .into())
            }
        }
    }
}

/// Times `iters` samples of `sample` (after one unrecorded warm-up); each enqueues its
/// copies and waits for them.
fn samples(
    iters: usize,
    bar: &ProgressBar,
    mut sample: impl FnMut() -> Result<(), CliError>,
) -> Result<Vec<std::time::Duration>, CliError> {
    let mut samples = Vec::with_capacity(iters);
    for iter in 0..=iters {
        let started = Instant::now();
        sample()?;
        if iter > 0 {
            samples.push(started.elapsed());
            bar.inc(1);
        }
    }
    Ok(samples)
}

/// The rows of every limit, one per `(payload bytes, iterations)` on `cuda:ordinal`.
pub(super) fn measure(
    ordinal: u8,
    sizes: &[(usize, usize)],
    mode: RunMode,
    bar: &ProgressBar,
) -> Result<Vec<Row>, CliError> {
    let gpu = Gpu::open(usize::from(ordinal))?;
    let stream = gpu.new_stream()?;
    let done = RawEvent::new(&gpu, false)?;
    let mut rows = Vec::with_capacity(3 * sizes.len());
    for &(len, iters) in sizes {
        let payload = Payload::new(len);
        let mut a = gpu.alloc(len)?;
        let b = gpu.alloc(len)?;
        a.copy_from_host(&payload.message(0))?;
        bar.inc_length(3 * iters as u64);
        bar.set_message(format!(
            "{CUDA_D2D} cuda:{ordinal} {}",
            human_size(len as u64)
        ));
        let wait = || -> Result<(), CliError> {
            done.record(&stream)?;
            done.synchronize()?;
            Ok(())
        };
        let d2d = samples(iters, bar, || {
            copy_device_async(b.range(), &gpu, a.range(), &gpu, &stream)?;
            copy_device_async(a.range(), &gpu, b.range(), &gpu, &stream)?;
            wait()
        })?;
        let mut back = vec![0u8; len];
        a.copy_to_host(&mut back)?;
        payload
            .check(0, &back)
            .map_err(|e| format!("the device-to-device copy on cuda:{ordinal}: {e}"))?;
        rows.push(Row::from_samples(
            CUDA_D2D, NO_CHANNEL, mode, len as u64, d2d,
        ));
        if len == 0 {
            // Pinned memory of 0 bytes cannot be allocated, and nothing would move.
            bar.inc(2 * iters as u64);
            continue;
        }
        // Pinned memory fenced by its own event: each copy records it, and the sample
        // waits for it.
        let mut host = StagingBuffer::new(&gpu, len)?;
        bar.set_message(format!(
            "{H2D_PINNED} cuda:{ordinal} {}",
            human_size(len as u64)
        ));
        let h2d = samples(iters, bar, || {
            host.upload(b.range(), &stream)?;
            host.upload(b.range(), &stream)?;
            Ok(host.wait()?)
        })?;
        rows.push(Row::from_samples(
            H2D_PINNED, NO_CHANNEL, mode, len as u64, h2d,
        ));
        bar.set_message(format!(
            "{D2H_PINNED} cuda:{ordinal} {}",
            human_size(len as u64)
        ));
        let d2h = samples(iters, bar, || {
            host.download(b.range().source(), &stream)?;
            host.download(b.range().source(), &stream)?;
            Ok(host.wait()?)
        })?;
        rows.push(Row::from_samples(
            D2H_PINNED, NO_CHANNEL, mode, len as u64, d2h,
        ));
        // The pinned copies are checked once: the payload to the device and back.
        let idle = |host: &mut StagingBuffer| -> Result<(), CliError> {
            host.wait()?;
            Ok(())
        };
        idle(&mut host)?;
        if let Some(bytes) = host.bytes_mut() {
            bytes.copy_from_slice(&payload.message(0));
        }
        host.upload(b.range(), &stream)?;
        idle(&mut host)?;
        if let Some(bytes) = host.bytes_mut() {
            bytes.fill(0);
        }
        host.download(b.range().source(), &stream)?;
        idle(&mut host)?;
        payload
            .check(0, host.bytes().unwrap_or_default())
            .map_err(|e| format!("the pinned copies on cuda:{ordinal}: {e}"))?;
    }
    Ok(rows)
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
