//! The CUDA layer's errors: why CUDA cannot be used on this host ([`CudaNotViable`], a
//! probe's failed driver call [`CudaError`]) and the error every CUDA channel operation
//! returns ([`CudaChannelError`]).
//!
//! For a channel operation, one variant per kind of failure: CUDA missing, a failed call
//! of `sys::cuda` (sys's own [`CudaCallError`], shown as it is: a driver call named with
//! its device and code, or a check sys made before calling, or a panic inside cudarc), a
//! malformed or inconsistent descriptor from the peer, and an event of another process
//! that never completes. Each text is written once, here or in sys. This module decides nothing about
//! retries or fallbacks: a failed transfer is reported to the caller, who fails the
//! pipe's pending work.

use crate::sys::driver_code::{CudaCallError, DriverCode, DRIVER_LIBRARY_MISSING, NO_DEVICE};

/// Why CUDA cannot be used on this host.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaNotViable {
    /// No loadable CUDA driver library (`libcuda.so`, `libcuda.so.1`, ...).
    #[error("{}", DRIVER_LIBRARY_MISSING)]
    DriverLibraryMissing,
    /// The driver loaded but reports no device (`CUDA_ERROR_NO_DEVICE`, or a count of 0).
    #[error("{}", NO_DEVICE)]
    NoDevices {
        /// The driver's error, when `cuInit` reported it.
        #[source]
        source: Option<DriverCode>,
    },
    /// A driver call failed.
    #[error(transparent)]
    Driver(#[from] CudaError),
    /// cudarc panicked while calling the driver (e.g. a symbol missing from an old driver).
    #[error("the CUDA driver bindings panicked: {message}")]
    Panicked {
        /// The panic message.
        message: String,
    },
}

/// A failed CUDA driver call, with the device it was about.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// `cuInit` failed.
    #[error("cuInit failed")]
    Init {
        /// The driver's status: its name and what to do.
        #[source]
        source: DriverCode,
    },
    /// `cuDeviceGetCount` failed.
    #[error("cuDeviceGetCount failed")]
    DeviceCount {
        /// The driver's status: its name and what to do.
        #[source]
        source: DriverCode,
    },
    /// `cuDeviceGet` failed.
    #[error("cuDeviceGet failed for CUDA device {ordinal}")]
    DeviceGet {
        /// Device ordinal.
        ordinal: i32,
        /// The driver's status: its name and what to do.
        #[source]
        source: DriverCode,
    },
    /// `cuDeviceGetName` failed.
    #[error("cuDeviceGetName failed for CUDA device {ordinal}")]
    DeviceName {
        /// Device ordinal.
        ordinal: i32,
        /// The driver's status: its name and what to do.
        #[source]
        source: DriverCode,
    },
    /// `cuDeviceTotalMem` failed.
    #[error("cuDeviceTotalMem failed for CUDA device {ordinal}")]
    TotalMemory {
        /// Device ordinal.
        ordinal: i32,
        /// The driver's status: its name and what to do.
        #[source]
        source: DriverCode,
    },
    /// `cuDeviceGetAttribute` failed for an attribute the probe cannot do without.
    #[error("cuDeviceGetAttribute({attribute}) failed for CUDA device {ordinal}")]
    DeviceAttribute {
        /// Device ordinal.
        ordinal: i32,
        /// Attribute name, e.g. `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR`.
        attribute: &'static str,
        /// The driver's status: its name and what to do.
        #[source]
        source: DriverCode,
    },
}

/// A failed CUDA channel operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaChannelError {
    /// CUDA cannot be used on this host at all.
    #[error("CUDA is not usable on this host: {0}")]
    NotViable(#[source] CudaNotViable),
    /// A CUDA driver call failed, or `sys::cuda` refused it before calling (lengths that
    /// differ, an empty pool, a stream of another device, a panic inside cudarc): sys's
    /// own error, whose text is the one this error shows.
    #[error(transparent)]
    Call(CudaCallError),
    /// The peer sent bytes that do not form a valid message of this channel.
    #[error("malformed {what} from the peer: {detail}")]
    Protocol {
        /// The message kind, e.g. `cuda_ipc chunk descriptor`.
        what: &'static str,
        /// What is wrong with it.
        detail: String,
    },
    /// CUDA memory was asked for on a device that is not a CUDA device.
    #[error("{device} is not a CUDA device")]
    NotCuda {
        /// The device named.
        device: String,
    },
    /// An event recorded by another process did not complete in time (that process may
    /// have died with the work queued).
    #[error(
        "a CUDA event of {what} did not complete within {waited:?}: the peer process may \
         have died with its copy queued"
    )]
    EventTimeout {
        /// Whose event, e.g. `a cuda_ipc loan`.
        what: &'static str,
        /// How long it was waited for.
        waited: std::time::Duration,
    },
}

impl CudaChannelError {
    /// A failed driver `call` on `device` (sys's `CudaCallError::Driver`), from cudarc's
    /// `DriverError` or a [`DriverCode`].
    pub(crate) fn driver<E: Into<DriverCode>>(
        call: &'static str,
        device: usize,
    ) -> impl FnOnce(E) -> Self {
        let call_error = CudaCallError::driver(call, device);
        move |source| CudaChannelError::Call(call_error(source))
    }

    /// A `Protocol` error about `what`.
    pub(crate) fn protocol(what: &'static str, detail: impl Into<String>) -> Self {
        CudaChannelError::Protocol {
            what,
            detail: detail.into(),
        }
    }
}

/// `sys::cuda`'s error, mapped variant by variant (the texts are the same).
impl From<CudaCallError> for CudaChannelError {
    /// A call refused because CUDA is missing is [`CudaChannelError::NotViable`], with the
    /// probe's reason; every other failed call is [`CudaChannelError::Call`].
    fn from(error: CudaCallError) -> Self {
        match error {
            CudaCallError::DriverLibraryMissing => {
                CudaChannelError::NotViable(CudaNotViable::DriverLibraryMissing)
            }
            CudaCallError::NoDevices { source } => {
                CudaChannelError::NotViable(CudaNotViable::NoDevices {
                    source: Some(source),
                })
            }
            other => CudaChannelError::Call(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error_chain::ErrorChain;
    use cudarc::driver::result::DriverError;
    use cudarc::driver::sys::CUresult;

    #[test]
    fn messages_name_the_call_and_the_device() {
        let err = CudaChannelError::driver("cuMemcpyDtoHAsync", 3)(DriverError(
            CUresult::CUDA_ERROR_INVALID_VALUE,
        ));
        assert_eq!(err.to_string(), "cuMemcpyDtoHAsync failed on CUDA device 3");
        // The whole chain names the code and what to do, without calling the driver
        // (there is none on most test hosts).
        let chain = ErrorChain(&err).to_string();
        assert!(
            chain.starts_with(
                "cuMemcpyDtoHAsync failed on CUDA device 3: CUDA_ERROR_INVALID_VALUE: "
            ),
            "{chain}"
        );
        assert!(
            chain.contains("check the tensor's device and size"),
            "{chain}"
        );
        let err = CudaChannelError::driver("cuMemAlloc", 0)(DriverCode(
            CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        ));
        assert!(
            ErrorChain(&err).to_string().contains("RDZV_CUDA_CACHE_CAP"),
            "{}",
            ErrorChain(&err)
        );
        let err = CudaChannelError::from(CudaCallError::LengthMismatch {
            sent: 10,
            expected: 12,
        });
        assert_eq!(
            err.to_string(),
            "length mismatch: the sender transfers 10 bytes but the receiving buffer holds 12"
        );
        let err = CudaChannelError::EventTimeout {
            what: "a cuda_ipc loan",
            waited: std::time::Duration::from_secs(60),
        };
        assert_eq!(
            err.to_string(),
            "a CUDA event of a cuda_ipc loan did not complete within 60s: the peer process \
             may have died with its copy queued"
        );
    }
}
