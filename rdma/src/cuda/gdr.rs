//! `cuda_gdr`: registering GPU memory with an RDMA NIC (GPUDirect RDMA).
//!
//! Two registration paths exist:
//!
//! - **dma-buf** ([`GdrPath::DmaBuf`]): `cuMemGetHandleForAddressRange` exports the pages
//!   as a dma-buf file descriptor and `ibv_reg_dmabuf_mr` registers it. It needs the device
//!   attribute `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` (usually only with NVIDIA's open
//!   kernel modules), a driver of CUDA 11.7 or later, and a kernel and verbs provider with
//!   dma-buf MRs.
//! - **peer memory** ([`GdrPath::PeerMemory`]): with `nvidia-peermem` (or Mellanox's
//!   `nv_peer_mem`) loaded, plain `ibv_reg_mr` accepts a device pointer.
//!
//! [`choose_registration_path`] prefers dma-buf and falls back to peer memory;
//! [`fall_back_to_peer_memory`] decides whether a failed dma-buf registration is retried on
//! the peer-memory path; [`dma_buf_range`] computes the page-aligned range to export and the
//! offset and IOVA `ibv_reg_dmabuf_mr` needs. These are pure and unit-tested.
//! [`GdrRegistrar`] does the registration: it registers the whole `cuMemAlloc` allocation
//! containing a buffer (as TensorPipe does, so later sub-buffers hit the cache) and caches
//! it by address range ([`crate::ibv::regcache`]). Memory must come from `cuMemAlloc`
//! ([`Gpu::alloc`]), not the stream-ordered pool, which neither path accepts reliably.
//!
//! This module does not create queue pairs or move bytes: the caller posts RDMA work
//! requests with the registration's keys on its own verbs connection. It has not been run
//! against a GPU and NIC (none on the development hosts); only its decision logic is tested.

use std::fmt;
use std::io;
use std::sync::Arc;

use cudarc::driver::sys::CUresult;

use super::memory::{DeviceRange, DriverCode, Gpu};
use super::{yes_no, CudaDevice, DriverVersion, PeerMemory};
use crate::ibv::regcache::RegistrationCache;
use crate::ibv::sys::{AccessFlags, MemoryRegion, ProtectionDomain};
use crate::sys::cuda::{page_size, AllocationExtent};

/// The first driver with `cuMemGetHandleForAddressRange` for dma-buf (CUDA 11.7).
pub const DMA_BUF_MIN_DRIVER: DriverVersion = DriverVersion(11070);

/// How device memory is registered with the NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GdrPath {
    /// `cuMemGetHandleForAddressRange` + `ibv_reg_dmabuf_mr`.
    DmaBuf,
    /// `ibv_reg_mr` on the device pointer, through a peer-memory kernel module.
    PeerMemory,
}

impl fmt::Display for GdrPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GdrPath::DmaBuf => "dma-buf",
            GdrPath::PeerMemory => "peer memory",
        })
    }
}

/// A device with no registration path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "CUDA device {ordinal} cannot register memory for GPUDirect RDMA: dma-buf {dma_buf} \
     (needs CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED and driver 11.7+, driver {driver}), \
     GPUDirect RDMA attribute {gpu_direct_rdma}, peer memory {peer_memory} \
     (load nvidia-peermem, or use NVIDIA's open kernel modules for dma-buf)"
)]
pub struct GdrPathError {
    /// Device ordinal.
    pub ordinal: i32,
    /// `yes`, `no` or `unknown`: the dma-buf attribute.
    pub dma_buf: &'static str,
    /// The driver version, or `unknown`.
    pub driver: String,
    /// `yes`, `no` or `unknown`: `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`.
    pub gpu_direct_rdma: &'static str,
    /// The peer-memory module found (`none` if none).
    pub peer_memory: String,
}

/// Chooses how `device`'s memory is registered: dma-buf when the device and driver support
/// it, else peer memory when a module is loaded and the device does not deny GPUDirect
/// RDMA.
pub fn choose_registration_path(
    device: &CudaDevice,
    driver: Option<DriverVersion>,
    peer_memory: &PeerMemory,
) -> Result<GdrPath, GdrPathError> {
    let driver_ok = driver.is_some_and(|v| v >= DMA_BUF_MIN_DRIVER);
    if device.dma_buf == Some(true) && driver_ok {
        return Ok(GdrPath::DmaBuf);
    }
    if peer_memory.is_loaded() && device.gpu_direct_rdma != Some(false) {
        return Ok(GdrPath::PeerMemory);
    }
    Err(GdrPathError {
        ordinal: device.ordinal,
        dma_buf: yes_no(device.dma_buf),
        driver: driver.map_or_else(|| "unknown".to_owned(), |v| v.to_string()),
        gpu_direct_rdma: yes_no(device.gpu_direct_rdma),
        peer_memory: peer_memory.to_string(),
    })
}

/// Whether a failed dma-buf registration (its `errno`) should be retried with `ibv_reg_mr`
/// through peer memory: only when a peer-memory module is loaded and the error says the
/// kernel or provider lacks dma-buf MRs (`EOPNOTSUPP`, `EPROTONOSUPPORT`, `ENOSYS`,
/// `EINVAL` from old providers), not for errors that would fail the same way (`ENOMEM`,
/// `EFAULT`, `EACCES`).
pub fn fall_back_to_peer_memory(errno: Option<i32>, peer_memory_loaded: bool) -> bool {
    peer_memory_loaded
        && matches!(
            errno,
            Some(libc::EOPNOTSUPP | libc::EPROTONOSUPPORT | libc::ENOSYS | libc::EINVAL)
        )
}

/// The range handed to `cuMemGetHandleForAddressRange` and the arguments of
/// `ibv_reg_dmabuf_mr` for a buffer `[ptr, ptr + len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaBufRange {
    /// Start of the exported range: `ptr` rounded down to the host page size.
    pub export_start: u64,
    /// Length of the exported range: up to `ptr + len` rounded up to the page size.
    pub export_len: u64,
    /// `ibv_reg_dmabuf_mr`'s `offset`: where the buffer starts inside the dma-buf.
    pub offset: u64,
    /// `ibv_reg_dmabuf_mr`'s `iova`: the buffer's device address, so that work requests
    /// use device pointers; it has the same page offset as `offset`, as the verbs require.
    pub iova: u64,
    /// Bytes to register.
    pub len: u64,
}

/// A buffer range that cannot be exported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("cannot export [{ptr:#x}, +{len}) as a dma-buf with {page_size}-byte pages: {why}")]
pub struct DmaBufRangeError {
    /// Buffer start.
    pub ptr: u64,
    /// Buffer length.
    pub len: u64,
    /// Host page size.
    pub page_size: u64,
    /// What is wrong.
    pub why: &'static str,
}

/// Computes the page-aligned export range for `[ptr, ptr + len)`; `page_size` must be a
/// power of two and `len` non-zero.
pub fn dma_buf_range(ptr: u64, len: u64, page_size: u64) -> Result<DmaBufRange, DmaBufRangeError> {
    let err = |why| DmaBufRangeError {
        ptr,
        len,
        page_size,
        why,
    };
    if page_size == 0 || !page_size.is_power_of_two() {
        return Err(err("the page size is not a power of two"));
    }
    if len == 0 {
        return Err(err("the range is empty"));
    }
    let end = ptr.checked_add(len).ok_or(err("the range wraps around"))?;
    let mask = page_size - 1;
    let export_start = ptr & !mask;
    let export_end = end
        .checked_add(mask)
        .ok_or(err("the range ends in the last page of the address space"))?
        & !mask;
    Ok(DmaBufRange {
        export_start,
        export_len: export_end - export_start,
        offset: ptr - export_start,
        iova: ptr,
        len,
    })
}

/// A failed GPUDirect RDMA registration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GdrError {
    /// A CUDA driver call failed.
    #[error("{call} failed for [{ptr:#x}, +{len}) on CUDA device {device}")]
    Driver {
        /// The entry point.
        call: &'static str,
        /// Device ordinal.
        device: usize,
        /// Start of the range.
        ptr: u64,
        /// Length of the range.
        len: u64,
        /// The driver's status: its name and what to do.
        #[source]
        source: DriverCode,
    },
    /// A verbs registration failed.
    #[error("{verb} failed for [{ptr:#x}, +{len}) ({path})")]
    Register {
        /// `ibv_reg_dmabuf_mr` or `ibv_reg_mr`.
        verb: &'static str,
        /// The path tried.
        path: GdrPath,
        /// Start of the range.
        ptr: u64,
        /// Length of the range.
        len: u64,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The range cannot be exported.
    #[error(transparent)]
    Range(#[from] DmaBufRangeError),
    /// The buffer is empty.
    #[error("cannot register an empty buffer")]
    Empty,
    /// A registration was paired with memory it does not cover.
    #[error("the registration of [{base:#x}, +{registered}) does not cover [{ptr:#x}, +{len}): register the memory's own allocation")]
    NotCovered {
        /// Start of the memory.
        ptr: u64,
        /// Its length.
        len: u64,
        /// Start of the registered range.
        base: u64,
        /// Length of the registered range.
        registered: u64,
    },
}

/// A registered device allocation.
#[derive(Debug)]
pub struct GdrRegistration {
    mr: MemoryRegion,
    path: GdrPath,
    base: u64,
    len: u64,
}

impl GdrRegistration {
    /// The local key, for work requests that read or write this memory locally.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// The remote key, to hand to the peer for one-sided access.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// How it was registered.
    pub fn path(&self) -> GdrPath {
        self.path
    }

    /// The registered device address range (the whole allocation).
    pub fn range(&self) -> (u64, u64) {
        (self.base, self.len)
    }
}

/// Registers device allocations with one protection domain, caching them by range.
#[derive(Debug)]
pub struct GdrRegistrar {
    pd: Arc<ProtectionDomain>,
    gpu: Gpu,
    path: GdrPath,
    peer_memory_loaded: bool,
    access: AccessFlags,
    cache: RegistrationCache<Arc<GdrRegistration>>,
}

impl GdrRegistrar {
    /// A registrar for `gpu`'s memory on `pd`, trying `path` first (from
    /// [`choose_registration_path`]) with `access` rights.
    pub fn new(
        pd: Arc<ProtectionDomain>,
        gpu: &Gpu,
        path: GdrPath,
        peer_memory: &PeerMemory,
        access: AccessFlags,
        cache_entries: usize,
    ) -> GdrRegistrar {
        GdrRegistrar {
            pd,
            gpu: gpu.clone(),
            path,
            peer_memory_loaded: peer_memory.is_loaded(),
            access,
            cache: RegistrationCache::new(cache_entries),
        }
    }

    /// The registration covering `buffer` (its whole allocation), registering it on a
    /// miss. The allocation must stay alive while the registration is cached: call
    /// [`forget_all`](Self::forget_all) before freeing registered memory, or a new
    /// allocation at the same addresses would hit the stale registration.
    pub fn register(&mut self, buffer: DeviceRange<'_>) -> Result<Arc<GdrRegistration>, GdrError> {
        if buffer.is_empty() {
            return Err(GdrError::Empty);
        }
        if let Some(hit) = self.cache.lookup(buffer.ptr(), buffer.len() as u64) {
            return Ok(Arc::clone(hit));
        }
        let extent = self.allocation_range(buffer)?;
        let registration = Arc::new(self.register_range(extent)?);
        // Displaced registrations are dropped here; work requests using them hold their
        // own `Arc`.
        drop(
            self.cache
                .insert(extent.base(), extent.len(), Arc::clone(&registration)),
        );
        Ok(registration)
    }

    /// Drops every cached registration (registrations still held by callers stay valid
    /// until they drop them).
    pub fn forget_all(&mut self) {
        drop(self.cache.clear());
    }

    fn allocation_range(&self, buffer: DeviceRange<'_>) -> Result<AllocationExtent, GdrError> {
        let driver_err = |source| GdrError::Driver {
            call: "cuMemGetAddressRange",
            device: self.gpu.ordinal(),
            ptr: buffer.ptr(),
            len: buffer.len() as u64,
            source,
        };
        self.gpu
            .bind()
            .map_err(|_| driver_err(DriverCode(CUresult::CUDA_ERROR_INVALID_CONTEXT)))?;
        AllocationExtent::of(buffer).map_err(driver_err)
    }

    fn register_range(&self, extent: AllocationExtent) -> Result<GdrRegistration, GdrError> {
        let (base, len) = (extent.base(), extent.len());
        let registered = |mr, path| GdrRegistration {
            mr,
            path,
            base,
            len,
        };
        if self.path == GdrPath::DmaBuf {
            match self.register_dma_buf(extent) {
                Ok(mr) => return Ok(registered(mr, GdrPath::DmaBuf)),
                Err(GdrError::Register { source, .. })
                    if fall_back_to_peer_memory(source.raw_os_error(), self.peer_memory_loaded) =>
                {
                    tracing::info!(
                        error = %source,
                        "ibv_reg_dmabuf_mr unsupported here; falling back to peer memory"
                    );
                }
                Err(err) => return Err(err),
            }
        }
        usize::try_from(len).map_err(|_| GdrError::Empty)?;
        let mr = extent
            .register_peer_memory(&self.pd, self.access)
            .map_err(|source| GdrError::Register {
                verb: "ibv_reg_mr",
                path: GdrPath::PeerMemory,
                ptr: base,
                len,
                source,
            })?;
        Ok(registered(mr, GdrPath::PeerMemory))
    }

    fn register_dma_buf(&self, extent: AllocationExtent) -> Result<MemoryRegion, GdrError> {
        let (base, len) = (extent.base(), extent.len());
        let range = dma_buf_range(base, len, page_size())?;
        let export_len = usize::try_from(range.export_len).map_err(|_| GdrError::Empty)?;
        let reg_len = usize::try_from(range.len).map_err(|_| GdrError::Empty)?;
        // The exported range is page-aligned as the call requires, in an allocation of
        // this context (made current by `allocation_range`).
        let dma_buf = extent
            .export_dma_buf(range.export_start, export_len)
            .map_err(|source| GdrError::Driver {
                call: "cuMemGetHandleForAddressRange",
                device: self.gpu.ordinal(),
                ptr: range.export_start,
                len: range.export_len,
                source,
            })?;
        // `[offset, offset + len)` lies in the exported range and `iova` has the page
        // offset of `offset`; the kernel keeps its own reference on the dma-buf, whose
        // descriptor is closed when `dma_buf` drops.
        dma_buf
            .register(&self.pd, range.offset, reg_len, range.iova, self.access)
            .map_err(|source| GdrError::Register {
                verb: "ibv_reg_dmabuf_mr",
                path: GdrPath::DmaBuf,
                ptr: base,
                len,
                source,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::PeerMemoryClient;

    fn device(dma_buf: Option<bool>, gdr: Option<bool>) -> CudaDevice {
        CudaDevice {
            ordinal: 2,
            name: "NVIDIA A100-SXM4-80GB".into(),
            compute_capability: (8, 0),
            total_memory: 85_899_345_920,
            pci_bus_id: None,
            gpu_direct_rdma: gdr,
            dma_buf,
        }
    }

    const NO_PEER: PeerMemory = PeerMemory {
        client: None,
        evidence: None,
    };
    const PEER: PeerMemory = PeerMemory {
        client: Some(PeerMemoryClient::NvidiaPeermem),
        evidence: Some("/sys/kernel/mm/memory_peers/nvidia-peermem/version"),
    };

    #[test]
    fn path_choice() {
        let new = Some(DriverVersion(12080));
        let old = Some(DriverVersion(11060));
        assert_eq!(
            choose_registration_path(&device(Some(true), Some(true)), new, &NO_PEER),
            Ok(GdrPath::DmaBuf)
        );
        assert_eq!(
            choose_registration_path(&device(Some(true), Some(true)), new, &PEER),
            Ok(GdrPath::DmaBuf)
        );
        // An old driver cannot export dma-bufs even if the attribute claims support.
        assert_eq!(
            choose_registration_path(&device(Some(true), Some(true)), old, &PEER),
            Ok(GdrPath::PeerMemory)
        );
        assert!(choose_registration_path(&device(Some(true), Some(true)), old, &NO_PEER).is_err());
        assert!(choose_registration_path(&device(Some(true), None), None, &NO_PEER).is_err());
        assert_eq!(
            choose_registration_path(&device(Some(false), None), new, &PEER),
            Ok(GdrPath::PeerMemory)
        );
        // A device that denies GPUDirect RDMA gets nothing from peer memory.
        assert!(choose_registration_path(&device(Some(false), Some(false)), new, &PEER).is_err());
    }

    #[test]
    fn path_error_says_what_to_do() {
        let err = choose_registration_path(
            &device(Some(false), Some(true)),
            Some(DriverVersion(12080)),
            &NO_PEER,
        )
        .expect_err("no path");
        assert_eq!(
            err.to_string(),
            "CUDA device 2 cannot register memory for GPUDirect RDMA: dma-buf no (needs \
             CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED and driver 11.7+, driver 12.8), GPUDirect \
             RDMA attribute yes, peer memory none (load nvidia-peermem, or use NVIDIA's open \
             kernel modules for dma-buf)"
        );
    }

    #[test]
    fn fallback_decision() {
        assert!(fall_back_to_peer_memory(Some(libc::EOPNOTSUPP), true));
        assert!(fall_back_to_peer_memory(Some(libc::EPROTONOSUPPORT), true));
        assert!(!fall_back_to_peer_memory(Some(libc::EOPNOTSUPP), false));
        assert!(!fall_back_to_peer_memory(Some(libc::ENOMEM), true));
        assert!(!fall_back_to_peer_memory(None, true));
    }

    #[test]
    fn verbs_errors_keep_their_errno_for_the_fallback() {
        let source = io::Error::from_raw_os_error(libc::EOPNOTSUPP);
        assert!(fall_back_to_peer_memory(source.raw_os_error(), true));
        // A failure without an errno (the library could not be loaded) is not retried.
        let source = io::Error::other("libibverbs.so.1 cannot be loaded");
        assert_eq!(source.raw_os_error(), None);
        assert!(!fall_back_to_peer_memory(source.raw_os_error(), true));
        let err = GdrError::Register {
            verb: "ibv_reg_dmabuf_mr",
            path: GdrPath::DmaBuf,
            ptr: 0x7f00_0000_0000,
            len: 1 << 21,
            source,
        };
        assert_eq!(
            err.to_string(),
            "ibv_reg_dmabuf_mr failed for [0x7f0000000000, +2097152) (dma-buf)"
        );
    }

    #[test]
    fn dma_buf_ranges_are_page_aligned() {
        let r = dma_buf_range(0x7f00_0000_1234, 0x3000, 4096).expect("valid");
        assert_eq!(r.export_start, 0x7f00_0000_1000);
        assert_eq!(r.export_len, 0x4000);
        assert_eq!(r.offset, 0x234);
        assert_eq!(r.iova, 0x7f00_0000_1234);
        assert_eq!(r.iova % 4096, r.offset % 4096);
        assert_eq!(r.len, 0x3000);
        let aligned = dma_buf_range(0x20_0000, 0x20_0000, 4096).expect("valid");
        assert_eq!(
            (aligned.export_start, aligned.export_len, aligned.offset),
            (0x20_0000, 0x20_0000, 0)
        );
        let big_pages = dma_buf_range(0x1_0001, 1, 65536).expect("valid");
        assert_eq!(
            (
                big_pages.export_start,
                big_pages.export_len,
                big_pages.offset
            ),
            (0x1_0000, 65536, 1)
        );
    }

    #[test]
    fn dma_buf_range_errors() {
        let e = dma_buf_range(0x1000, 0, 4096).expect_err("empty");
        assert_eq!(
            e.to_string(),
            "cannot export [0x1000, +0) as a dma-buf with 4096-byte pages: the range is empty"
        );
        assert!(dma_buf_range(0x1000, 1, 3000).is_err());
        assert!(dma_buf_range(0x1000, 1, 0).is_err());
        assert!(dma_buf_range(u64::MAX - 10, 100, 4096).is_err());
        assert!(
            dma_buf_range(u64::MAX - 100, 10, 4096).is_err(),
            "rounding up overflows"
        );
    }

    proptest::proptest! {
        #[test]
        fn dma_buf_range_covers_the_buffer(ptr in 0u64..(1 << 48), len in 1u64..(1 << 32), shift in 12u32..22) {
            let page = 1u64 << shift;
            let r = dma_buf_range(ptr, len, page).expect("in range");
            proptest::prop_assert_eq!(r.export_start % page, 0);
            proptest::prop_assert_eq!(r.export_len % page, 0);
            proptest::prop_assert!(r.export_start <= ptr);
            proptest::prop_assert!(r.export_start + r.export_len >= ptr + len);
            proptest::prop_assert!(r.export_start + r.export_len - (ptr + len) < page);
            proptest::prop_assert_eq!(r.export_start + r.offset, ptr);
            proptest::prop_assert_eq!(r.iova % page, r.offset % page);
        }
    }
}
