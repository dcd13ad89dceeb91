//! Whether CUDA can be used on this host, which GPUs there are, and whether the
//! prerequisites of GPUDirect RDMA are present.
//!
//! [`probe`] answers with a [`CudaViability`]. The CUDA driver (`libcuda`) is loaded at run
//! time through cudarc's `dynamic-loading`, so this crate builds and runs on hosts without
//! it. cudarc *panics* when the library is missing, so [`probe`] first asks
//! `is_culib_present`, and also runs every driver call under `catch_unwind` (a missing
//! symbol in an old driver panics the same way). Viable means: the library loads, `cuInit`
//! succeeds and there is at least one device.
//!
//! GPUDirect RDMA is reported as separate facts, not folded into viability: per device the
//! `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED` and `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`
//! attributes (the dma-buf route: `cuMemGetHandleForAddressRange` + `ibv_reg_dmabuf_mr`),
//! and per host whether a peer-memory kernel module is loaded ([`peer_memory`]; the
//! `ibv_reg_mr`-on-device-pointer route). The probe creates no context, allocates no
//! memory and registers nothing.
//!
//! [`agent`] is the one implementation of the CUDA channels (`cuda_xth`, `cuda_ipc`,
//! `cuda_gdr` and `cuda_basic`): the RPC agent's CUDA runtime, one module per channel
//! holding its lender, borrower, caches and per-device state (`agent::{xth, ipc, gdr,
//! basic}`). [`gdr`] registers device memory with a NIC (dma-buf, falling back to peer
//! memory), for `cuda_gdr` and for the probe's choice of a registration path; the RDMA
//! data path is [`crate::ibv::lending`].
//!
//! What the channels share is here, pure and tested with fakes: [`caching_allocator`]
//! (device memory of received tensors, pinned blocks) and [`loan_events`] (the order in
//! which a loan's lender, borrower and release use its event: `cuda_ipc`'s IPC events and
//! `cuda_xth`'s fences).
//!
//! [`viability`] decides which of them can be offered, with reasons, and [`descriptor`]
//! computes their negotiation descriptors. [`memory`] holds the owned CUDA resources
//! (device, `cuMemAlloc` memory, pinned memory, events, IPC mappings) and opens a device
//! without ever panicking when the driver is absent.
//!
//! No module here contains `unsafe` code: every CUDA driver call is made by the crate's
//! `sys::cuda` module, whose safe types [`memory`] re-exports.

pub mod agent;
pub mod caching_allocator;
pub mod descriptor;
pub(crate) mod error;
pub mod gdr;
pub mod loan_events;
pub mod memory;
pub mod peer_memory;
pub mod viability;

use std::fmt;

use cudarc::driver::result;
use cudarc::driver::sys::{self, CUdevice_attribute};
use tracing::{debug, info};

use crate::error_chain::panic_message;
use crate::sys::cuda as driver;

pub use crate::sys::cuda::driver_library_present;
pub use agent::basic::chunk_plan;
pub use agent::ipc::mappings as ipc_mappings;
pub use agent::xth::loans as xth_loans;
pub use error::{CudaChannelError, CudaError, CudaNotViable};
pub use peer_memory::{PeerMemory, PeerMemoryClient};

/// Outcome of [`probe`].
#[derive(Debug)]
pub enum CudaViability {
    /// CUDA can be used.
    Viable(CudaReport),
    /// CUDA cannot be used, and why.
    NotViable(CudaNotViable),
}

impl CudaViability {
    /// Whether CUDA can be used.
    pub fn is_viable(&self) -> bool {
        matches!(self, CudaViability::Viable(_))
    }

    /// The report, when viable.
    pub fn report(&self) -> Option<&CudaReport> {
        match self {
            CudaViability::Viable(report) => Some(report),
            CudaViability::NotViable(_) => None,
        }
    }

    /// The reason, when not viable.
    pub fn reason(&self) -> Option<&CudaNotViable> {
        match self {
            CudaViability::Viable(_) => None,
            CudaViability::NotViable(reason) => Some(reason),
        }
    }
}

/// What a viable CUDA probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaReport {
    /// Version of the installed driver (`cuDriverGetVersion`), if it could be read.
    pub driver_version: Option<DriverVersion>,
    /// The devices, in ordinal order (as numbered under `CUDA_VISIBLE_DEVICES`).
    pub devices: Vec<CudaDevice>,
    /// The peer-memory kernel module, if one is loaded.
    pub peer_memory: PeerMemory,
}

/// A CUDA driver version, as `cuDriverGetVersion` encodes it (`1000 * major + 10 * minor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct DriverVersion(pub i32);

impl DriverVersion {
    /// Major version, e.g. 12.
    pub fn major(self) -> i32 {
        self.0 / 1000
    }

    /// Minor version, e.g. 8.
    pub fn minor(self) -> i32 {
        (self.0 % 1000) / 10
    }
}

impl fmt::Display for DriverVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major(), self.minor())
    }
}

/// One CUDA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaDevice {
    /// Device ordinal.
    pub ordinal: i32,
    /// Marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Total device memory in bytes.
    pub total_memory: usize,
    /// PCI address (`domain:bus:device.0`), used later to pair GPUs with nearby NICs;
    /// `None` if the driver did not report it.
    pub pci_bus_id: Option<String>,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`; `None` if the driver does not know
    /// the attribute.
    pub gpu_direct_rdma: Option<bool>,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` (driver 11.7+; often 0 with NVIDIA's
    /// proprietary kernel modules and 1 with the open ones); `None` if unknown.
    pub dma_buf: Option<bool>,
}

impl fmt::Display for CudaDevice {
    /// E.g. `0: NVIDIA H100 (sm_90, 79.6 GiB, PCI 0000:3b:00.0, GPUDirect RDMA yes, dma-buf no)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (major, minor) = self.compute_capability;
        write!(
            f,
            "{}: {} (sm_{major}{minor}, {}",
            self.ordinal,
            self.name,
            GibiBytes(self.total_memory)
        )?;
        if let Some(pci) = &self.pci_bus_id {
            write!(f, ", PCI {pci}")?;
        }
        write!(
            f,
            ", GPUDirect RDMA {}, dma-buf {})",
            yes_no(self.gpu_direct_rdma),
            yes_no(self.dma_buf)
        )
    }
}

/// `yes`, `no` or `unknown`.
pub(crate) fn yes_no(flag: Option<bool>) -> &'static str {
    match flag {
        Some(true) => "yes",
        Some(false) => "no",
        None => "unknown",
    }
}

/// A byte count shown in GiB with one decimal.
struct GibiBytes(usize);

impl fmt::Display for GibiBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const GIB: u128 = 1 << 30;
        // Tenths of a GiB, rounded down; u128 cannot overflow for any usize.
        let tenths = (self.0 as u128) * 10 / GIB;
        write!(f, "{}.{} GiB", tenths / 10, tenths % 10)
    }
}

impl fmt::Display for CudaViability {
    /// `viable: driver 12.8, 1 device(s), peer memory none` or `not viable: <reason>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CudaViability::Viable(report) => {
                f.write_str("viable: driver ")?;
                match report.driver_version {
                    Some(version) => write!(f, "{version}")?,
                    None => f.write_str("unknown")?,
                }
                write!(
                    f,
                    ", {} device(s), peer memory {}",
                    report.devices.len(),
                    report.peer_memory
                )?;
                for device in &report.devices {
                    write!(f, "; {device}")?;
                }
                Ok(())
            }
            CudaViability::NotViable(reason) => {
                write!(f, "not viable: {}", crate::error_chain::ErrorChain(reason))
            }
        }
    }
}

/// Probes the CUDA driver and its devices. Never panics (unless the binary is built with
/// `panic = "abort"`, where a panic inside cudarc cannot be caught; the library check that
/// runs first still avoids the common one).
pub fn probe() -> CudaViability {
    let outcome = if driver_library_present() {
        match std::panic::catch_unwind(probe_driver) {
            Ok(outcome) => outcome,
            Err(payload) => Err(CudaNotViable::Panicked {
                message: panic_message(payload.as_ref()),
            }),
        }
    } else {
        Err(CudaNotViable::DriverLibraryMissing)
    };
    match outcome {
        Ok(report) => {
            info!(
                devices = report.devices.len(),
                driver = ?report.driver_version.map(|v| v.to_string()),
                peer_memory = %report.peer_memory,
                "CUDA viable"
            );
            CudaViability::Viable(report)
        }
        Err(reason) => {
            info!(reason = %crate::error_chain::ErrorChain(&reason), "CUDA not viable");
            CudaViability::NotViable(reason)
        }
    }
}

/// The driver calls; only run once the library is known to load.
fn probe_driver() -> Result<CudaReport, CudaNotViable> {
    match result::init() {
        Ok(()) => {}
        Err(err) if err.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => {
            return Err(CudaNotViable::NoDevices {
                source: Some(err.into()),
            })
        }
        Err(source) => {
            return Err(CudaError::Init {
                source: source.into(),
            }
            .into())
        }
    }
    let driver_version = driver_version();
    let count = result::device::get_count().map_err(|source| CudaError::DeviceCount {
        source: source.into(),
    })?;
    debug!(count, ?driver_version, "CUDA driver initialised");
    if count <= 0 {
        return Err(CudaNotViable::NoDevices { source: None });
    }
    let devices = (0..count).map(read_device).collect::<Result<Vec<_>, _>>()?;
    Ok(CudaReport {
        driver_version,
        devices,
        peer_memory: peer_memory::detect(),
    })
}

fn driver_version() -> Option<DriverVersion> {
    match driver::driver_version() {
        Ok(version) => Some(DriverVersion(version)),
        Err(err) => {
            debug!(error = %err, "cuDriverGetVersion failed");
            None
        }
    }
}

fn read_device(ordinal: i32) -> Result<CudaDevice, CudaError> {
    let device = result::device::get(ordinal).map_err(|source| CudaError::DeviceGet {
        ordinal,
        source: source.into(),
    })?;
    let name = result::device::get_name(device).map_err(|source| CudaError::DeviceName {
        ordinal,
        source: source.into(),
    })?;
    let total_memory = driver::device_total_memory(device)
        .map_err(|source| CudaError::TotalMemory { ordinal, source })?;
    let attribute = |attribute: CUdevice_attribute| driver::device_attribute(device, attribute);
    let required = |attr: CUdevice_attribute, attribute_name: &'static str| {
        attribute(attr).map_err(|source| CudaError::DeviceAttribute {
            ordinal,
            attribute: attribute_name,
            source,
        })
    };
    let major = required(
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR",
    )?;
    let minor = required(
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
        "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR",
    )?;
    // Optional facts: an old driver may not know the attribute.
    let flag = |attr: CUdevice_attribute| match attribute(attr) {
        Ok(value) => Some(value != 0),
        Err(err) => {
            debug!(ordinal, ?attr, error = %err, "optional CUDA attribute unavailable");
            None
        }
    };
    let gpu_direct_rdma = flag(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED);
    let dma_buf = flag(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED);
    let pci_bus_id = match (
        attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID),
        attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID),
        attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID),
    ) {
        (Ok(domain), Ok(bus), Ok(dev)) => Some(format!("{domain:04x}:{bus:02x}:{dev:02x}.0")),
        _ => None,
    };
    let device = CudaDevice {
        ordinal,
        name,
        compute_capability: (major, minor),
        total_memory,
        pci_bus_id,
        gpu_direct_rdma,
        dma_buf,
    };
    debug!(%device, "CUDA device read");
    Ok(device)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(dma_buf: Option<bool>) -> CudaDevice {
        CudaDevice {
            ordinal: 0,
            name: "NVIDIA H100 80GB HBM3".into(),
            compute_capability: (9, 0),
            total_memory: 85_520_809_984,
            pci_bus_id: Some("0000:3b:00.0".into()),
            gpu_direct_rdma: Some(true),
            dma_buf,
        }
    }

    #[test]
    fn driver_version_decoding() {
        let v = DriverVersion(12080);
        assert_eq!((v.major(), v.minor()), (12, 8));
        assert_eq!(v.to_string(), "12.8");
        assert_eq!(DriverVersion(11070).to_string(), "11.7");
        assert_eq!(DriverVersion(13000).to_string(), "13.0");
    }

    #[test]
    fn device_display() {
        assert_eq!(
            device(None).to_string(),
            "0: NVIDIA H100 80GB HBM3 (sm_90, 79.6 GiB, PCI 0000:3b:00.0, GPUDirect RDMA yes, dma-buf unknown)"
        );
    }

    #[test]
    fn panic_payloads_become_messages() {
        let caught = std::panic::catch_unwind(|| panic!("missing symbol {}", "cuFoo"));
        let payload = caught.expect_err("the closure panics");
        assert_eq!(panic_message(payload.as_ref()), "missing symbol cuFoo");
        let caught = std::panic::catch_unwind(|| std::panic::panic_any(7_u8));
        let payload = caught.expect_err("the closure panics");
        assert_eq!(panic_message(payload.as_ref()), "non-string panic payload");
    }

    #[test]
    fn not_viable_display() {
        let v = CudaViability::NotViable(CudaNotViable::DriverLibraryMissing);
        assert!(!v.is_viable());
        assert!(v
            .to_string()
            .starts_with("not viable: the CUDA driver library (libcuda) cannot be loaded"));
    }
}
