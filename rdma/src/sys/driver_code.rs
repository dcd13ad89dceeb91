//! The `sys` layer's own CUDA errors: the driver's result code ([`DriverCode`], with the
//! code's name and what to do about it) and [`CudaCallError`], what a call of
//! `sys::cuda` returns (the call, its device and its code, or the check that refused it
//! before the driver was called). `crate::cuda::error` maps it into the channels' error
//! with the same text. A leaf: it names nothing else of the crate.

use std::fmt;

use cudarc::driver::result::DriverError;
use cudarc::driver::sys::CUresult;

/// Why CUDA is not usable when the driver library cannot be loaded (the one text, shown by
/// this module's [`CudaCallError`] and by `crate::cuda::CudaNotViable`).
pub(crate) const DRIVER_LIBRARY_MISSING: &str = "the CUDA driver library (libcuda) cannot be \
     loaded: no NVIDIA driver is installed or it is not on the loader path";

/// Why CUDA is not usable when the driver reports no device.
pub(crate) const NO_DEVICE: &str = "no CUDA device found";

/// A CUDA driver status other than `CUDA_SUCCESS`: its name and what to do about it.
///
/// Unlike cudarc's `DriverError`, whose `Display` asks the driver for a description (and
/// panics when libcuda is not loaded), formatting this never calls the driver.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DriverCode(pub CUresult);

impl DriverCode {
    /// The code's name, e.g. `CUDA_ERROR_OUT_OF_MEMORY`.
    pub fn name(self) -> String {
        format!("{:?}", self.0)
    }

    /// What the user can do about it.
    pub fn advice(self) -> &'static str {
        use CUresult as R;
        match self.0 {
            R::CUDA_SUCCESS => "no error",
            R::CUDA_ERROR_OUT_OF_MEMORY => {
                "the device (or pinned host memory) is exhausted: free tensors, lower \
                 RDZV_CUDA_CACHE_CAP, or stop other processes using this GPU"
            }
            R::CUDA_ERROR_NOT_INITIALIZED | R::CUDA_ERROR_DEINITIALIZED => {
                "the driver is not initialised or is shutting down: do not use CUDA \
                 tensors after the process began to exit"
            }
            R::CUDA_ERROR_NO_DEVICE | R::CUDA_ERROR_INVALID_DEVICE => {
                "no such CUDA device is visible: check CUDA_VISIBLE_DEVICES and nvidia-smi"
            }
            R::CUDA_ERROR_DEVICE_UNAVAILABLE | R::CUDA_ERROR_CONTEXT_ALREADY_IN_USE => {
                "the device is busy or in exclusive-process mode: check nvidia-smi's \
                 compute mode and other processes on this GPU"
            }
            R::CUDA_ERROR_INVALID_CONTEXT | R::CUDA_ERROR_CONTEXT_IS_DESTROYED => {
                "no usable context was current: this is a bug in rdzv, please report it"
            }
            R::CUDA_ERROR_INVALID_VALUE => {
                "the driver refused an argument (an address outside any allocation, or a \
                 length past its end): check the tensor's device and size"
            }
            R::CUDA_ERROR_INVALID_HANDLE => {
                "the handle names no live object: the lending process may have freed the \
                 memory or exited"
            }
            R::CUDA_ERROR_MAP_FAILED | R::CUDA_ERROR_ALREADY_MAPPED => {
                "the CUDA IPC mapping failed: both processes must see the device and the \
                 lender must still hold the memory; use cuda_basic otherwise"
            }
            R::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
            | R::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED
            | R::CUDA_ERROR_TOO_MANY_PEERS => {
                "these GPUs cannot reach each other directly: use cuda_basic between them"
            }
            R::CUDA_ERROR_NOT_SUPPORTED => {
                "this driver, device or system does not support the operation (e.g. CUDA \
                 IPC under MPS, dma-buf with the proprietary kernel modules): use another \
                 channel"
            }
            R::CUDA_ERROR_NOT_PERMITTED | R::CUDA_ERROR_OPERATING_SYSTEM => {
                "the operating system refused: check the container's limits (ulimit -l for \
                 pinned memory, access to /dev/nvidia*)"
            }
            R::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH
            | R::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE
            | R::CUDA_ERROR_STUB_LIBRARY => {
                "the driver library does not match the kernel module (or is a stub): \
                 reinstall the NVIDIA driver, or reboot after upgrading it"
            }
            R::CUDA_ERROR_NOT_FOUND => {
                "the driver lacks this entry point: upgrade the NVIDIA driver"
            }
            R::CUDA_ERROR_NOT_READY => "the work is still running: wait for its event",
            R::CUDA_ERROR_ILLEGAL_ADDRESS
            | R::CUDA_ERROR_LAUNCH_FAILED
            | R::CUDA_ERROR_ECC_UNCORRECTABLE
            | R::CUDA_ERROR_HARDWARE_STACK_ERROR
            | R::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | R::CUDA_ERROR_MISALIGNED_ADDRESS
            | R::CUDA_ERROR_INVALID_ADDRESS_SPACE
            | R::CUDA_ERROR_INVALID_PC
            | R::CUDA_ERROR_ASSERT
            | R::CUDA_ERROR_LAUNCH_TIMEOUT
            | R::CUDA_ERROR_NVLINK_UNCORRECTABLE => {
                "work on this device faulted and its context is unusable: restart the \
                 process (compute-sanitizer finds the faulting kernel)"
            }
            R::CUDA_ERROR_MPS_CONNECTION_FAILED
            | R::CUDA_ERROR_MPS_RPC_FAILURE
            | R::CUDA_ERROR_MPS_SERVER_NOT_READY
            | R::CUDA_ERROR_MPS_MAX_CLIENTS_REACHED
            | R::CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED
            | R::CUDA_ERROR_MPS_CLIENT_TERMINATED => {
                "the MPS server failed or is full: check nvidia-cuda-mps-control"
            }
            _ => "see the CUDA driver API documentation of this code",
        }
    }
}

impl fmt::Display for DriverCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.0, self.advice())
    }
}

impl fmt::Debug for DriverCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl std::error::Error for DriverCode {}

impl From<DriverError> for DriverCode {
    fn from(err: DriverError) -> Self {
        DriverCode(err.0)
    }
}

/// A failed call of `sys::cuda`, with the texts of the `crate::cuda::CudaChannelError`
/// variant it maps to.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaCallError {
    /// No loadable CUDA driver library.
    #[error("CUDA is not usable on this host: {}", DRIVER_LIBRARY_MISSING)]
    DriverLibraryMissing,
    /// The driver reports no device.
    #[error("CUDA is not usable on this host: {}", NO_DEVICE)]
    NoDevices {
        /// The driver's status.
        #[source]
        source: DriverCode,
    },
    /// A CUDA driver call failed.
    #[error("{call} failed on CUDA device {device}")]
    Driver {
        /// The driver entry point, e.g. `cuMemcpyDtoHAsync`.
        call: &'static str,
        /// Ordinal of the device whose context was current.
        device: usize,
        /// The driver's status: its name and what to do.
        #[source]
        source: DriverCode,
    },
    /// A copy's source and destination differ in length.
    #[error("length mismatch: the sender transfers {sent} bytes but the receiving buffer holds {expected}")]
    LengthMismatch {
        /// Bytes of the source.
        sent: u64,
        /// Bytes of the destination.
        expected: u64,
    },
    /// A staging buffer was asked for with no bytes.
    #[error("invalid staging pool: {slots} slot(s) of {slot_len} bytes")]
    InvalidPool {
        /// Number of slots.
        slots: usize,
        /// Bytes per slot.
        slot_len: usize,
    },
    /// A stream of one device was given for memory or events of another.
    #[error("the stream belongs to CUDA device {stream_device} but this endpoint's staging memory and events are on device {endpoint_device}")]
    WrongDevice {
        /// Device of the memory or events.
        endpoint_device: usize,
        /// Device of the stream passed in.
        stream_device: usize,
    },
    /// cudarc panicked inside a driver call.
    #[error("the CUDA driver bindings panicked in {call}: {message}")]
    Panicked {
        /// What was being called.
        call: &'static str,
        /// The panic message.
        message: String,
    },
}

impl CudaCallError {
    /// A `Driver` error for `call` on `device` (from cudarc's `DriverError` or a
    /// [`DriverCode`]).
    pub(crate) fn driver<E: Into<DriverCode>>(
        call: &'static str,
        device: usize,
    ) -> impl FnOnce(E) -> Self {
        move |source| CudaCallError::Driver {
            call,
            device,
            source: source.into(),
        }
    }
}
