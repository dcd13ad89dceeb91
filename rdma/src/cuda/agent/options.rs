//! How the runtime is configured ([`CudaOptions`], from the environment for
//! [`CudaPlugin`]) and the two plugins that open it for the agent.

use std::sync::Arc;

use rdzv_core::device::DeviceType;
use rdzv_uring::rpc::{DeviceError, DeviceOp, DevicePlugin, DeviceRuntime};

use super::CudaRuntime;
use crate::cuda::CudaNotViable;
use crate::error_chain::ErrorChain;

/// The environment variable that sets [`CudaOptions::cache_cap_bytes`] for
/// [`CudaPlugin`] (a byte count).
pub const ENV_CACHE_CAP: &str = "RDZV_CUDA_CACHE_CAP";

/// The environment variable that sets [`CudaOptions::pending_hand_over`] for
/// [`CudaPlugin`] (`1` or `0`).
pub const ENV_PENDING_HAND_OVER: &str = "RDZV_CUDA_PENDING_HAND_OVER";

/// How the CUDA runtime uses memory and streams. [`CudaPlugin`] takes the defaults
/// (with [`ENV_CACHE_CAP`] and [`ENV_PENDING_HAND_OVER`]); [`ConfiguredCudaPlugin`]
/// takes these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    /// The most bytes of received tensors' device memory one device's caching allocator
    /// holds (in use plus cached). A tensor that does not fit while the others are alive
    /// fails with an error naming the device, its size, the cap and the bytes in use.
    pub cache_cap_bytes: usize,
    /// `cuda_basic`'s staging chunk: the bytes one pinned buffer holds.
    pub staging_chunk_bytes: usize,
    /// Pinned buffers one staged copy cycles through (2 = double buffering).
    pub staging_buffers: usize,
    /// The most bytes of pinned host memory one device holds for tensors on their way
    /// out over `cuda_basic` (in use by the CPU channels plus cached). A tensor that
    /// does not fit is staged in chunks into pageable memory instead (one more host
    /// copy).
    pub staged_out_cap_bytes: usize,
    /// Streams per device the copies are spread over.
    pub streams_per_device: usize,
    /// The most `cuda_ipc` mappings a device keeps open (least recently used closed
    /// first).
    pub ipc_mappings_per_device: usize,
    /// The most bytes those mappings may map (an open mapping keeps the lender's memory
    /// alive even after the lender freed it).
    pub ipc_mapped_bytes_per_device: usize,
    /// Hand a tensor received over `cuda_ipc` or `cuda_xth` to the agent while its copy
    /// may still run (no host wait at all on the data path): users ask
    /// `Tensor::is_ready` / `Tensor::wait_ready` (`rdzv_uring::rpc`), or order their
    /// work after the memory's ready event on the GPU
    /// ([`wait_ready_on`](super::CudaMemory::wait_ready_on)); the runtime's own uses do
    /// so themselves, and dropping the memory waits for it. Off by default: a received
    /// tensor is complete when it is handed over.
    pub pending_hand_over: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            cache_cap_bytes: 8 << 30,
            staging_chunk_bytes: 4 << 20,
            staging_buffers: 3,
            staged_out_cap_bytes: 2 << 30,
            streams_per_device: 2,
            ipc_mappings_per_device: 256,
            ipc_mapped_bytes_per_device: 4 << 30,
            pending_hand_over: false,
        }
    }
}

impl CudaOptions {
    /// The defaults, with the cap from [`ENV_CACHE_CAP`] and the hand-over from
    /// [`ENV_PENDING_HAND_OVER`] when they are set.
    ///
    /// # Errors
    /// A variable is set to something it cannot mean.
    pub fn from_env() -> Result<CudaOptions, CudaOptionsError> {
        let mut options = Self::with_cache_cap(std::env::var(ENV_CACHE_CAP).ok().as_deref())?;
        if let Ok(text) = std::env::var(ENV_PENDING_HAND_OVER) {
            options.pending_hand_over = pending_hand_over(&text)?;
        }
        Ok(options)
    }

    /// The defaults, with the cap from `cap` (the value of [`ENV_CACHE_CAP`]) when given.
    fn with_cache_cap(cap: Option<&str>) -> Result<CudaOptions, CudaOptionsError> {
        let mut options = CudaOptions::default();
        if let Some(text) = cap {
            options.cache_cap_bytes =
                text.trim()
                    .parse()
                    .map_err(|_| CudaOptionsError::CacheCap {
                        value: text.to_owned(),
                    })?;
        }
        Ok(options)
    }
}

/// [`CudaOptions::pending_hand_over`] from the value of [`ENV_PENDING_HAND_OVER`].
fn pending_hand_over(text: &str) -> Result<bool, CudaOptionsError> {
    match text.trim() {
        "1" | "true" | "yes" => Ok(true),
        "0" | "false" | "no" | "" => Ok(false),
        _ => Err(CudaOptionsError::PendingHandOver {
            value: text.to_owned(),
        }),
    }
}

/// An environment variable of [`CudaOptions::from_env`] is set to something it cannot
/// mean: fix or unset it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaOptionsError {
    /// [`ENV_CACHE_CAP`] is not a byte count.
    #[error("{}={value:?} is not a byte count (e.g. 8589934592)", ENV_CACHE_CAP)]
    CacheCap {
        /// The variable's value.
        value: String,
    },
    /// [`ENV_PENDING_HAND_OVER`] is neither yes nor no.
    #[error(
        "{}={value:?} is neither 1 (hand received tensors over with their copy running) nor 0",
        ENV_PENDING_HAND_OVER
    )]
    PendingHandOver {
        /// The variable's value.
        value: String,
    },
}

/// Why the CUDA runtime cannot open in this process ([`CudaRuntime::open`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaOpenError {
    /// The CUDA probe found CUDA unusable (no driver library, `cuInit` failed, no
    /// device).
    #[error("CUDA is not viable: {}", ErrorChain(.0))]
    NotViable(#[source] CudaNotViable),
}

/// The CUDA device plugin of the RPC agent, with [`CudaOptions::from_env`].
#[derive(Debug, Clone, Copy, Default)]
pub struct CudaPlugin;

impl DevicePlugin for CudaPlugin {
    fn device_type(&self) -> DeviceType {
        DeviceType::Cuda
    }

    fn open(&self) -> Result<Arc<dyn DeviceRuntime>, DeviceError> {
        let options = CudaOptions::from_env().map_err(|e| DeviceError::new(DeviceOp::Open, e))?;
        ConfiguredCudaPlugin(options).open()
    }
}

/// The CUDA device plugin of the RPC agent, with the given options.
#[derive(Debug, Clone, Copy, Default)]
pub struct ConfiguredCudaPlugin(pub CudaOptions);

impl DevicePlugin for ConfiguredCudaPlugin {
    fn device_type(&self) -> DeviceType {
        DeviceType::Cuda
    }

    fn open(&self) -> Result<Arc<dyn DeviceRuntime>, DeviceError> {
        CudaRuntime::open_with(self.0)
            .map(|runtime| Arc::new(runtime) as Arc<dyn DeviceRuntime>)
            .map_err(|e| DeviceError::new(DeviceOp::Open, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pending_hand_over_is_a_yes_or_no() {
        assert_eq!(pending_hand_over(" 1\n"), Ok(true));
        assert_eq!(pending_hand_over("0"), Ok(false));
        assert_eq!(pending_hand_over(""), Ok(false));
        let err = pending_hand_over("maybe").expect_err("neither");
        assert_eq!(
            err,
            CudaOptionsError::PendingHandOver {
                value: "maybe".into()
            }
        );
        let err = err.to_string();
        assert!(
            err.contains(ENV_PENDING_HAND_OVER) && err.contains("maybe"),
            "{err}"
        );
    }

    #[test]
    fn the_cache_cap_is_a_byte_count() {
        assert_eq!(
            CudaOptions::with_cache_cap(Some(" 1048576\n")).map(|o| o.cache_cap_bytes),
            Ok(1 << 20)
        );
        let err = CudaOptions::with_cache_cap(Some("lots"))
            .expect_err("not a number")
            .to_string();
        assert_eq!(
            err,
            "RDZV_CUDA_CACHE_CAP=\"lots\" is not a byte count (e.g. 8589934592)"
        );
        assert_eq!(
            CudaOptions::with_cache_cap(None),
            Ok(CudaOptions::default())
        );
    }
}
