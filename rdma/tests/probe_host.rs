//! Runs the real probes on this host.
//!
//! On hosts without RDMA or CUDA (this project's build machines and CI: no
//! `CONFIG_INFINIBAND`, no NVIDIA driver) the probes must answer "not viable" with the
//! specific reason instead of panicking. Which reason is expected is derived from host facts
//! read independently of the crate (sysfs and `/dev` entries). On a host that has the
//! hardware, the tests check the viable answer for consistency instead, and say so.

use std::path::Path;

use rdzv_rdma::cuda::{self, CudaError, CudaNotViable, CudaViability};
use rdzv_rdma::ibv::{self, IbvConfig, IbvNotViable, IbvViability, SelectError};
use rdzv_rdma::ViabilityReport;

/// libibverbs reads this file first; without it the kernel has no verbs (ENOSYS).
const KERNEL_VERBS_ABI: &str = "/sys/class/infiniband_verbs/abi_version";
/// Present when the NVIDIA kernel driver is loaded.
const NVIDIA_CONTROL_DEVICE: &str = "/dev/nvidiactl";

#[test]
fn ibv_probe_reports_the_specific_reason() {
    let kernel_has_verbs = Path::new(KERNEL_VERBS_ABI).exists();
    let outcome = ibv::probe(&IbvConfig::default());
    println!("ibv probe: {outcome}");
    match &outcome {
        IbvViability::NotViable(IbvNotViable::LibraryUnavailable { library, source }) => {
            assert_eq!(*library, "libibverbs.so.1");
            assert!(
                source.to_string().contains("libibverbs.so.1"),
                "loader message: {source}"
            );
        }
        IbvViability::NotViable(IbvNotViable::KernelWithoutVerbs { source }) => {
            assert_eq!(source.raw_os_error(), Some(libc::ENOSYS));
            assert!(
                !kernel_has_verbs,
                "ENOSYS reported but {KERNEL_VERBS_ABI} exists"
            );
        }
        other => {
            assert!(
                kernel_has_verbs,
                "{KERNEL_VERBS_ABI} is missing, so the probe must report a missing library \
                 or ENOSYS, not: {other}"
            );
            println!("this host has kernel verbs support; checking the answer for consistency");
            if let IbvViability::Viable(selection) = other {
                assert!(!selection.device.is_empty());
                assert!(selection.port >= 1);
            }
        }
    }
}

#[test]
fn ibv_probe_with_a_requested_device_never_panics() {
    let config = IbvConfig {
        device: Some("rdzv_no_such_device0".into()),
        port: Some(1),
        gid_index: Some(0),
    };
    let outcome = ibv::probe(&config);
    println!("ibv probe for a missing device: {outcome}");
    let reason = outcome
        .reason()
        .expect("a device that does not exist cannot be viable");
    assert!(
        matches!(
            reason,
            IbvNotViable::LibraryUnavailable { .. }
                | IbvNotViable::KernelWithoutVerbs { .. }
                | IbvNotViable::Selection(
                    SelectError::NoDevices | SelectError::DeviceNotFound { .. }
                )
                | IbvNotViable::Verbs(_)
        ),
        "{reason}"
    );
}

#[test]
fn cuda_probe_reports_the_specific_reason() {
    let nvidia_driver_loaded = Path::new(NVIDIA_CONTROL_DEVICE).exists();
    let outcome = cuda::probe();
    println!("cuda probe: {outcome}");
    match &outcome {
        CudaViability::NotViable(CudaNotViable::Panicked { message }) => {
            panic!("the CUDA probe must not surface a panic on a normal host: {message}")
        }
        CudaViability::NotViable(reason) if !nvidia_driver_loaded => {
            assert!(
                matches!(
                    reason,
                    CudaNotViable::DriverLibraryMissing
                        | CudaNotViable::NoDevices { .. }
                        | CudaNotViable::Driver(CudaError::Init { .. })
                ),
                "{NVIDIA_CONTROL_DEVICE} is missing, so the reason must be a missing \
                 library, no device or a failed cuInit, not: {reason}"
            );
            assert_eq!(
                matches!(reason, CudaNotViable::DriverLibraryMissing),
                !cuda::driver_library_present()
            );
        }
        CudaViability::NotViable(reason) => {
            println!("this host has an NVIDIA driver but CUDA is not viable: {reason}");
        }
        CudaViability::Viable(report) => {
            assert!(
                nvidia_driver_loaded,
                "CUDA viable without {NVIDIA_CONTROL_DEVICE}"
            );
            assert!(!report.devices.is_empty());
            for (ordinal, device) in report.devices.iter().enumerate() {
                assert_eq!(usize::try_from(device.ordinal).ok(), Some(ordinal));
                assert!(device.total_memory > 0);
                assert!(device.compute_capability.0 >= 3);
            }
        }
    }
}

#[test]
fn combined_report_has_the_stable_leading_keys() {
    let report = ViabilityReport::probe(&IbvConfig::default());
    let text = report.to_string();
    println!("{text}");
    let keys: Vec<String> = report.fields().into_iter().map(|(key, _)| key).collect();
    assert_eq!(keys.first().map(String::as_str), Some("ibv"));
    assert!(keys.iter().any(|k| k == "cuda"));
    let ibv_value = if report.ibv.is_viable() {
        "viable"
    } else {
        "not viable"
    };
    assert!(text.starts_with(&format!("ibv: {ibv_value}\n")), "{text}");
    if !report.cuda.is_viable() {
        assert!(text.contains("\ncuda: not viable\ncuda.reason: "), "{text}");
    }
}
