//! The CUDA limit row of `--device cuda:N`: device-to-device `cuMemcpy` bandwidth of each
//! payload size on that GPU, measured in the same run as the RPC rows.
//!
//! One sample copies a buffer to a second one and back (`cuMemcpyDtoDAsync` twice on one
//! stream, then an event synchronisation), so that, like an echo, it moves the payload
//! both ways and its bandwidth counts both directions. The copy is checked once per size
//! (host → device, the two copies, device → host). The RPC agent does not move CUDA
//! tensors yet, so there are no CUDA RPC rows to compare with; this module measures only
//! the limit. Without a usable driver or device it reports why, never panics.

use std::time::Instant;

use indicatif::ProgressBar;
use rdzv_rdma::cuda::memory::{copy_device_async, Gpu, RawEvent};
use rdzv_rdma::cuda::CudaViability;

use super::payload::Payload;
use super::row::{human_size, Row, RunMode, NO_CHANNEL};
use super::viability::error_chain;
use crate::cli::CliError;

/// The transport name of the CUDA limit rows.
pub(super) const CUDA_D2D: &str = "cuda-d2d";

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

/// One row per `(payload bytes, iterations)` on `cuda:ordinal`.
pub(super) fn measure(
    ordinal: u8,
    sizes: &[(usize, usize)],
    mode: RunMode,
    bar: &ProgressBar,
) -> Result<Vec<Row>, CliError> {
    let gpu = Gpu::open(usize::from(ordinal))?;
    let stream = gpu.new_stream()?;
    let done = RawEvent::new(&gpu, false)?;
    let mut rows = Vec::with_capacity(sizes.len());
    for &(len, iters) in sizes {
        let payload = Payload::new(len);
        let mut a = gpu.alloc(len)?;
        let b = gpu.alloc(len)?;
        a.copy_from_host(&payload.message(0))?;
        bar.inc_length(iters as u64);
        bar.set_message(format!(
            "{CUDA_D2D} cuda:{ordinal} {}",
            human_size(len as u64)
        ));
        let mut samples = Vec::with_capacity(iters);
        // One unrecorded round warms the copy engines up.
        for iter in 0..=iters {
            let started = Instant::now();
            copy_device_async(b.range(), &gpu, a.range(), &gpu, &stream)?;
            copy_device_async(a.range(), &gpu, b.range(), &gpu, &stream)?;
            done.record(&stream)?;
            done.synchronize()?;
            if iter > 0 {
                samples.push(started.elapsed());
                bar.inc(1);
            }
        }
        let mut back = vec![0u8; len];
        a.copy_to_host(&mut back)?;
        payload
            .check(0, &back)
            .map_err(|e| format!("the device-to-device copy on cuda:{ordinal}: {e}"))?;
        rows.push(Row::from_samples(
            CUDA_D2D, NO_CHANNEL, mode, len as u64, samples,
        ));
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
                assert_eq!(rows.len(), 2);
                assert_eq!(rows[1].iters, 3);
                assert!(rows[1].gbytes_per_s > 0.0);
            }
            Err(e) => panic!("device 0 of a viable driver: {e}"),
        }
        // No host has 256 devices: an error when CUDA works, a skip when it does not.
        if let Ok(None) = not_viable(255) {
            panic!("cuda:255 cannot exist");
        }
    }
}
