//! The CUDA driver calls of `rdzv-rdma`, and the owned resources built on them: an opened
//! device ([`Gpu`]), device memory from `cuMemAlloc` ([`DeviceAllocation`]), borrowed
//! device ranges to write ([`DeviceRange`]) or only read ([`DeviceSource`]), pinned host
//! memory ([`PinnedHostBuffer`]) and the staging buffer that fences it with an event
//! ([`StagingBuffer`]), raw events ([`RawEvent`], which unlike cudarc's `CudaEvent` can be
//! created interprocess), opened CUDA IPC mappings ([`IpcMapping`]), the probe's device
//! queries, and the registration of device memory with a NIC for GPUDirect RDMA
//! ([`AllocationExtent`], [`DmaBuf`]).
//!
//! libcuda is loaded at run time through cudarc's `dynamic-loading` (cudarc `dlopen`s it on
//! first use). cudarc panics when the library is missing, so [`Gpu::open`] checks for the
//! library first and runs the context creation under `catch_unwind`. Device memory is
//! always allocated with `cuMemAlloc` (not the stream-ordered pool cudarc's
//! `CudaStream::alloc` uses), because CUDA IPC handles and GPUDirect RDMA registration
//! require it. Every resource binds its device's context before the driver call that needs
//! it and releases itself on drop.
//!
//! # What makes the wrappers safe
//! - Device memory is written only through a [`DeviceRange`], made safely from memory this
//!   crate owns ([`DeviceAllocation::range`]) and otherwise only by the `unsafe`
//!   `DeviceRange::from_raw` (in `sys`'s tests only). A copy that only *reads* device memory takes a
//!   [`DeviceSource`], which may also name an address a peer sent: the driver checks that
//!   it lies in mapped memory and fails the copy otherwise, and reading memory never
//!   invalidates anything Rust holds.
//! - Host memory is written by the driver only inside a [`StagingBuffer`], whose bytes can
//!   be reached only once its last copy's event has completed, and whose drop waits for
//!   that copy (or leaks the buffer if it cannot).
//! - A failed driver call is a [`DriverCode`]: the code's name and what to do, formatted
//!   without calling the driver.
//!
//! This module decides no protocol: the channels and the agent's runtime do. What stays
//! here is what needs `unsafe`: each type above owns a driver resource whose `Drop` (or a
//! `Send`/`Sync`/`ReadTarget` impl) relies on an invariant only its constructor can keep,
//! so moving it out would move `unsafe` with it. Pure logic lives above: a panic's text
//! in `error_chain`, the caches, pools and loan bookkeeping in `cuda::agent`'s channel
//! modules.

use std::ffi::{c_char, c_int, c_void};
use std::io;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::os::fd::{AsFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, OnceLock};

use cudarc::driver::result;
use cudarc::driver::safe::{CudaContext, CudaStream};
use cudarc::driver::sys::{self, CUdevice_attribute, CUresult};

use rdzv_core::channel::cuda::IPC_HANDLE_LEN;

use crate::error_chain::panic_message;

use super::ibv::{AccessFlags, MemoryRegion, ProtectionDomain, ReadTarget};

// --- errors ---------------------------------------------------------------------------

pub use super::driver_code::{CudaCallError, DriverCode};

// --- the probe's queries --------------------------------------------------------------

/// Whether cudarc can load the driver library. Never panics.
pub fn driver_library_present() -> bool {
    // SAFETY: `is_culib_present` `dlopen`s each candidate name of the CUDA driver library
    // and closes it again, which runs the library's ELF constructors and destructors. That
    // is exactly what loading the driver always does; the NVIDIA driver library is made to
    // be `dlopen`ed, and no symbol from these handles is kept.
    unsafe { sys::is_culib_present() }
}

/// The installed driver's version (`cuDriverGetVersion`, `1000 * major + 10 * minor`).
/// Only call once [`driver_library_present`] said yes (cudarc panics otherwise).
pub(crate) fn driver_version() -> Result<c_int, DriverCode> {
    let mut version: c_int = 0;
    // SAFETY: `cuDriverGetVersion` writes one `int` through the pointer, which points to a
    // live local; it may be called before or after `cuInit`.
    unsafe { sys::cuDriverGetVersion(&mut version) }.result()?;
    Ok(version)
}

/// A device's total memory in bytes (`cuDeviceTotalMem`).
pub(crate) fn device_total_memory(device: sys::CUdevice) -> Result<usize, DriverCode> {
    // SAFETY: the call writes one `size_t` into cudarc's local; a device handle that names
    // no device, or a call before `cuInit`, is reported as an error code, not undefined
    // behaviour.
    Ok(unsafe { result::device::total_mem(device) }?)
}

/// One attribute of a device (`cuDeviceGetAttribute`).
pub(crate) fn device_attribute(
    device: sys::CUdevice,
    attribute: CUdevice_attribute,
) -> Result<i32, DriverCode> {
    // SAFETY: as `device_total_memory`: one `int` is written into cudarc's local, and an
    // unknown device or attribute is an error code.
    Ok(unsafe { result::device::get_attribute(device, attribute) }?)
}

// --- devices and memory ---------------------------------------------------------------

/// An opened CUDA device: its primary context, made current on the calling thread by every
/// operation of this crate that needs it.
#[derive(Debug, Clone)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
}

impl Gpu {
    /// Opens device `ordinal` (its primary context). Never panics: without the driver
    /// library it returns [`CudaCallError::DriverLibraryMissing`], and a panic inside cudarc is
    /// returned as [`CudaCallError::Panicked`].
    pub fn open(ordinal: usize) -> Result<Gpu, CudaCallError> {
        if !driver_library_present() {
            return Err(CudaCallError::DriverLibraryMissing);
        }
        match std::panic::catch_unwind(|| CudaContext::new(ordinal)) {
            Ok(Ok(ctx)) => Ok(Gpu { ctx }),
            Ok(Err(err)) if err.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => {
                Err(CudaCallError::NoDevices { source: err.into() })
            }
            Ok(Err(source)) => Err(CudaCallError::Driver {
                call: "cuDevicePrimaryCtxRetain",
                device: ordinal,
                source: source.into(),
            }),
            Err(payload) => Err(CudaCallError::Panicked {
                call: "CudaContext::new",
                message: panic_message(payload.as_ref()),
            }),
        }
    }

    /// The device a stream belongs to.
    pub fn of_stream(stream: &CudaStream) -> Gpu {
        Gpu {
            ctx: Arc::clone(stream.context()),
        }
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The cudarc context (primary context of the device).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A new non-blocking stream on this device.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>, CudaCallError> {
        self.ctx
            .new_stream()
            .map_err(CudaCallError::driver("cuStreamCreate", self.ordinal()))
    }

    /// Checks that `stream` belongs to this device's context.
    pub fn check_stream(&self, stream: &CudaStream) -> Result<(), CudaCallError> {
        if stream.context().cu_ctx() == self.ctx.cu_ctx() {
            Ok(())
        } else {
            Err(CudaCallError::WrongDevice {
                endpoint_device: self.ordinal(),
                stream_device: stream.context().ordinal(),
            })
        }
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<(), CudaCallError> {
        self.ctx
            .bind_to_thread()
            .map_err(CudaCallError::driver("cuCtxSetCurrent", self.ordinal()))
    }

    /// Allocates `len` bytes of device memory with `cuMemAlloc` (a zero-length request
    /// allocates nothing).
    pub fn alloc(&self, len: usize) -> Result<DeviceAllocation, CudaCallError> {
        DeviceAllocation::new(self, len)
    }

    /// Free and total device memory in bytes (`cuMemGetInfo`).
    pub fn memory_info(&self) -> Result<(usize, usize), CudaCallError> {
        self.bind()?;
        result::mem_get_info().map_err(CudaCallError::driver("cuMemGetInfo", self.ordinal()))
    }
}

/// A device address range borrowed for `'a`: the memory a transfer reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRange<'a> {
    ptr: sys::CUdeviceptr,
    len: usize,
    _memory: PhantomData<&'a ()>,
}

impl<'a> DeviceRange<'a> {
    /// A range over memory this crate did not allocate (e.g. a tensor's storage).
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be device memory (or memory the CUDA driver can address,
    /// such as managed memory) that stays allocated, and is not written by anyone else
    /// while a transfer uses it, for `'a`.
    #[cfg(test)]
    pub(in crate::sys) unsafe fn from_raw(ptr: sys::CUdeviceptr, len: usize) -> DeviceRange<'a> {
        DeviceRange::new(ptr, len)
    }

    /// The same range, to read from.
    pub fn source(&self) -> DeviceSource<'a> {
        DeviceSource::new(self.ptr, self.len)
    }
}

/// A device address range a copy only *reads*: a [`DeviceRange`]'s ([`DeviceRange::source`]
/// or `From`), an opened IPC mapping's ([`IpcMapping::source`]), or an address another
/// endpoint named ([`DeviceSource::named_by_peer`]).
///
/// Safe to make from any address: the driver checks that a copy's source lies in memory
/// it has mapped and fails the copy otherwise, and reading memory invalidates nothing Rust
/// holds. Whether the bytes are the ones meant (the lender still holds the memory and
/// does not write it) is the protocol's business, not memory safety's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSource<'a> {
    ptr: sys::CUdeviceptr,
    len: usize,
    _memory: PhantomData<&'a ()>,
}

impl DeviceSource<'static> {
    /// The range `[ptr, ptr + len)` named by another endpoint (a `cuda_xth` sender of this
    /// process), which holds the memory until this side answered.
    pub fn named_by_peer(ptr: sys::CUdeviceptr, len: usize) -> DeviceSource<'static> {
        DeviceSource::new(ptr, len)
    }
}

/// The methods [`DeviceRange`] and [`DeviceSource`] share: what a range is, apart from
/// whether it may be written.
macro_rules! device_span {
    ($span:ident) => {
        impl<'a> $span<'a> {
            /// `[ptr, ptr + len)`; what makes that memory fit the type is the caller's.
            fn new(ptr: sys::CUdeviceptr, len: usize) -> $span<'a> {
                $span {
                    ptr,
                    len,
                    _memory: PhantomData,
                }
            }

            /// Start address.
            pub fn ptr(&self) -> sys::CUdeviceptr {
                self.ptr
            }

            /// Length in bytes.
            pub fn len(&self) -> usize {
                self.len
            }

            /// Whether the range is empty.
            pub fn is_empty(&self) -> bool {
                self.len == 0
            }

            /// The sub-range `[offset, offset + len)`, or `None` if it does not fit (or its
            /// addresses overflow).
            pub fn slice(&self, offset: usize, len: usize) -> Option<$span<'a>> {
                if offset.checked_add(len)? > self.len {
                    return None;
                }
                Some($span::new(self.ptr.checked_add(offset as u64)?, len))
            }
        }
    };
}

device_span!(DeviceRange);
device_span!(DeviceSource);

impl<'a> From<DeviceRange<'a>> for DeviceSource<'a> {
    fn from(range: DeviceRange<'a>) -> Self {
        range.source()
    }
}

/// `Ok` when `fits`; otherwise the mismatch of `sent` bytes against `expected`.
fn check_len(fits: bool, sent: usize, expected: usize) -> Result<(), CudaCallError> {
    if fits {
        return Ok(());
    }
    Err(CudaCallError::LengthMismatch {
        sent: sent as u64,
        expected: expected as u64,
    })
}

/// Enqueues a copy of `src` (on `src_gpu`) into `dst` (on `dst_gpu`) on `stream`:
/// `cuMemcpyDtoDAsync` within one context, `cuMemcpyPeerAsync` across devices. The ranges
/// must have the same length; an empty copy enqueues nothing.
pub fn copy_device_async<'s>(
    dst: DeviceRange<'_>,
    dst_gpu: &Gpu,
    src: impl Into<DeviceSource<'s>>,
    src_gpu: &Gpu,
    stream: &CudaStream,
) -> Result<(), CudaCallError> {
    let src = src.into();
    check_len(dst.len() == src.len(), src.len(), dst.len())?;
    if src.is_empty() {
        return Ok(());
    }
    let ordinal = stream.context().ordinal();
    Gpu::of_stream(stream).bind()?;
    if dst_gpu.context().cu_ctx() == src_gpu.context().cu_ctx() {
        // SAFETY: `dst` is `len` bytes of device memory borrowed for writing (its
        // `DeviceRange` contract); `src` is only read, and the driver fails the copy if it
        // is not mapped. The stream is live (held by the caller).
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst.ptr(), src.ptr(), src.len(), stream.cu_stream()) }
            .result()
            .map_err(CudaCallError::driver("cuMemcpyDtoDAsync", ordinal))
    } else {
        // SAFETY: as above, each range in its own context, both contexts live (held by the
        // `Gpu`s).
        unsafe {
            sys::cuMemcpyPeerAsync(
                dst.ptr(),
                dst_gpu.context().cu_ctx(),
                src.ptr(),
                src_gpu.context().cu_ctx(),
                src.len(),
                stream.cu_stream(),
            )
        }
        .result()
        .map_err(CudaCallError::driver("cuMemcpyPeerAsync", ordinal))
    }
}

/// Enqueues a copy of `src` into `dst` on `stream` with `cuMemcpyAsync`: unified
/// addressing lets the driver find the devices of both (this device's memory, another
/// device's, an opened IPC mapping). The lengths must match; an empty copy enqueues
/// nothing. The caller binds the stream's context and waits for the copy.
pub fn copy_unified_async(
    dst: DeviceRange<'_>,
    src: DeviceSource<'_>,
    stream: &CudaStream,
) -> Result<(), CudaCallError> {
    check_len(dst.len() == src.len(), src.len(), dst.len())?;
    if src.is_empty() {
        return Ok(());
    }
    // SAFETY: `dst` is `len` bytes of device memory borrowed for writing (its
    // `DeviceRange` contract), and stays allocated until the copy is waited for (the
    // caller's); `src` is only read, and the driver fails the copy if it is not mapped.
    unsafe { sys::cuMemcpyAsync(dst.ptr(), src.ptr(), src.len(), stream.cu_stream()) }
        .result()
        .map_err(CudaCallError::driver(
            "cuMemcpyAsync",
            stream.context().ordinal(),
        ))
}

/// Device memory from `cuMemAlloc`, freed with `cuMemFree` on drop.
#[derive(Debug)]
pub struct DeviceAllocation {
    gpu: Gpu,
    ptr: sys::CUdeviceptr,
    len: usize,
    /// Its CUDA IPC memory handle, made on first use: one handle per allocation, which
    /// dies with it (so no handle outlives the memory it names).
    ipc_handle: OnceLock<[u8; IPC_HANDLE_LEN]>,
}

impl DeviceAllocation {
    fn new(gpu: &Gpu, len: usize) -> Result<DeviceAllocation, CudaCallError> {
        let ptr = if len == 0 {
            0
        } else {
            gpu.bind()?;
            // SAFETY: the device's context is current; `cuMemAlloc` only returns memory.
            unsafe { result::malloc_sync(len) }
                .map_err(CudaCallError::driver("cuMemAlloc", gpu.ordinal()))?
        };
        Ok(DeviceAllocation {
            gpu: gpu.clone(),
            ptr,
            len,
            ipc_handle: OnceLock::new(),
        })
    }

    /// The whole allocation as a range.
    pub fn range(&self) -> DeviceRange<'_> {
        DeviceRange::new(self.ptr, self.len)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the allocation is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device it lives on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The allocation's CUDA IPC memory handle (`cuIpcGetMemHandle`), made once and
    /// cached for the allocation's life.
    pub fn ipc_handle(&self) -> Result<[u8; IPC_HANDLE_LEN], CudaCallError> {
        if let Some(handle) = self.ipc_handle.get() {
            return Ok(*handle);
        }
        self.gpu.bind()?;
        let mut handle = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_LEN],
        };
        // SAFETY: `ptr` is a live `cuMemAlloc` pointer of the current context; the driver
        // writes one handle into a live local.
        unsafe { sys::cuIpcGetMemHandle(&mut handle, self.ptr) }
            .result()
            .map_err(CudaCallError::driver(
                "cuIpcGetMemHandle",
                self.gpu.ordinal(),
            ))?;
        let handle = handle_bytes(&handle.reserved);
        Ok(*self.ipc_handle.get_or_init(|| handle))
    }

    /// Copies `src` into the allocation (synchronous `cuMemcpyHtoD`); `src` must have the
    /// allocation's length.
    pub fn copy_from_host(&mut self, src: &[u8]) -> Result<(), CudaCallError> {
        check_len(src.len() == self.len, src.len(), self.len)?;
        if self.len == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        // SAFETY: `self.ptr` is a live allocation of `src.len()` bytes; `src` is a valid
        // host slice; the call is synchronous.
        unsafe { result::memcpy_htod_sync(self.ptr, src) }
            .map_err(CudaCallError::driver("cuMemcpyHtoD", self.gpu.ordinal()))
    }

    /// Copies the allocation into `dst` (synchronous `cuMemcpyDtoH`); `dst` must have the
    /// allocation's length.
    pub fn copy_to_host(&self, dst: &mut [u8]) -> Result<(), CudaCallError> {
        check_len(dst.len() == self.len, self.len, dst.len())?;
        self.copy_prefix_to_host(dst)
    }

    /// Copies the allocation's first `dst.len()` bytes into `dst` (synchronous
    /// `cuMemcpyDtoH`); `dst` may not be longer than the allocation.
    pub fn copy_prefix_to_host(&self, dst: &mut [u8]) -> Result<(), CudaCallError> {
        check_len(dst.len() <= self.len, self.len, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        self.gpu.bind()?;
        // SAFETY: `self.ptr` is a live allocation of at least `dst.len()` bytes (checked
        // above); `dst` is a valid, exclusively borrowed host slice; the call is
        // synchronous.
        unsafe { result::memcpy_dtoh_sync(dst, self.ptr) }
            .map_err(CudaCallError::driver("cuMemcpyDtoH", self.gpu.ordinal()))
    }
}

impl Drop for DeviceAllocation {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        if self.gpu.bind().is_ok() {
            // SAFETY: `ptr` came from `cuMemAlloc` and is freed exactly once, here. Any
            // transfer using it borrowed `self`, so none is still being issued.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

// SAFETY: a `CUdeviceptr` is a plain address valid from any thread of the process once the
// owning context is current, which every method ensures.
unsafe impl Send for DeviceAllocation {}
// SAFETY: shared access only reads the address and issues driver calls, which are
// thread-safe.
unsafe impl Sync for DeviceAllocation {}

/// Page-locked host memory from `cuMemHostAlloc` (portable across contexts), freed with
/// `cuMemFreeHost` on drop. The staging buffers of `cuda_basic`.
#[derive(Debug)]
pub struct PinnedHostBuffer {
    gpu: Gpu,
    ptr: *mut u8,
    len: usize,
}

impl PinnedHostBuffer {
    /// Allocates `len` (> 0) bytes of pinned host memory, zeroed.
    pub fn new(gpu: &Gpu, len: usize) -> Result<PinnedHostBuffer, CudaCallError> {
        if len == 0 {
            return Err(CudaCallError::InvalidPool {
                slots: 1,
                slot_len: 0,
            });
        }
        gpu.bind()?;
        // SAFETY: the context is current; the driver returns `len` bytes of host memory or
        // an error.
        let ptr = unsafe { result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(CudaCallError::driver("cuMemHostAlloc", gpu.ordinal()))?
            .cast::<u8>();
        if ptr.is_null() {
            return Err(CudaCallError::Driver {
                call: "cuMemHostAlloc",
                device: gpu.ordinal(),
                source: DriverCode(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
            });
        }
        // SAFETY: `ptr` points to `len` writable bytes just allocated and owned by us.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(PinnedHostBuffer {
            gpu: gpu.clone(),
            ptr,
            len,
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never: construction refuses 0).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The host address, for `cuMemcpy*Async` (only [`StagingBuffer`] enqueues copies,
    /// and fences the bytes until they are done).
    fn as_ptr(&self) -> *mut c_void {
        self.ptr.cast()
    }

    /// The bytes, to read.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes owned by `self`; writes go
        // through `&mut self` (`as_mut_slice`), or through an asynchronous copy that only a
        // `StagingBuffer` owning this buffer enqueues, and which it waits for before it
        // lets anyone reach the buffer.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points to `len` initialised bytes owned by `self`, borrowed
        // exclusively through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedHostBuffer {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: `ptr` came from `cuMemHostAlloc` and is freed once; the owning pool
            // waits for the buffer's copies before it is dropped.
            let _ = unsafe { result::free_host(self.ptr.cast()) };
        }
    }
}

// SAFETY: pinned host memory is ordinary process memory; `&mut self` guards access.
unsafe impl Send for PinnedHostBuffer {}
// SAFETY: through `&self` the bytes are only read (`as_slice`) or their address taken
// (`as_ptr`, private: only `StagingBuffer` enqueues copies, through `&mut`); writes need
// `&mut self`. So shared references on several threads cannot race.
unsafe impl Sync for PinnedHostBuffer {}

/// A pinned host buffer and the event of its last asynchronous copy: the staging buffer
/// of `cuda_basic`. Its bytes can be reached only when no copy is in flight
/// ([`wait`](Self::wait) first), and dropping it waits for its copy (or leaks the
/// buffer, with a warning, if the wait fails), so the driver never writes host memory
/// that Rust reads or has freed.
#[derive(Debug)]
pub struct StagingBuffer {
    buffer: ManuallyDrop<PinnedHostBuffer>,
    event: RawEvent,
    in_flight: bool,
}

impl StagingBuffer {
    /// `len` (> 0) bytes of pinned host memory on `gpu`, zeroed, and their event.
    pub fn new(gpu: &Gpu, len: usize) -> Result<StagingBuffer, CudaCallError> {
        Ok(StagingBuffer {
            buffer: ManuallyDrop::new(PinnedHostBuffer::new(gpu, len)?),
            event: RawEvent::new(gpu, false)?,
            in_flight: false,
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.buffer.len()
    }

    /// Whether the buffer is empty (never: construction refuses 0).
    pub fn is_empty(&self) -> bool {
        self.buffer.is_empty()
    }

    /// Whether no copy is in flight (the bytes can be reached).
    pub fn is_idle(&self) -> bool {
        !self.in_flight
    }

    /// Enqueues a copy of `src` into the buffer's first `src.len()` bytes on `stream`
    /// (`cuMemcpyDtoHAsync`), and records the buffer's event after it. While an earlier
    /// copy is in flight, `stream` first waits for it on the device (`cuStreamWaitEvent`),
    /// so that the event always covers every copy.
    pub fn download(
        &mut self,
        src: DeviceSource<'_>,
        stream: &CudaStream,
    ) -> Result<(), CudaCallError> {
        check_len(src.len() <= self.len(), src.len(), self.len())?;
        // SAFETY: the buffer holds at least `src.len()` pinned bytes, and no Rust code can
        // reach them until the event recorded next has completed (`in_flight`, set by
        // `enqueue`, gates every accessor and the drop); `src` is only read, and the driver
        // fails the copy if it is not mapped.
        self.enqueue(
            src.len(),
            stream,
            "cuMemcpyDtoHAsync",
            |host, cu_stream| unsafe {
                sys::cuMemcpyDtoHAsync_v2(host, src.ptr(), src.len(), cu_stream)
            },
        )
    }

    /// Enqueues a copy of the buffer's first `dst.len()` bytes into `dst` on `stream`
    /// (`cuMemcpyHtoDAsync`), and records the buffer's event after it, ordered after an
    /// earlier copy still in flight as [`download`](Self::download) is.
    pub fn upload(
        &mut self,
        dst: DeviceRange<'_>,
        stream: &CudaStream,
    ) -> Result<(), CudaCallError> {
        check_len(dst.len() <= self.len(), self.len(), dst.len())?;
        // SAFETY: the buffer holds at least `dst.len()` pinned bytes, which Rust cannot
        // write until the event recorded next has completed (`in_flight`); `dst` is
        // `dst.len()` bytes of device memory borrowed for writing (its `DeviceRange`
        // contract).
        self.enqueue(
            dst.len(),
            stream,
            "cuMemcpyHtoDAsync",
            |host, cu_stream| unsafe {
                sys::cuMemcpyHtoDAsync_v2(dst.ptr(), host, dst.len(), cu_stream)
            },
        )
    }

    /// Enqueues `copy` of `len` (> 0, else nothing) bytes between the buffer's address and
    /// the device on `stream`, marks the buffer in flight first, and records the event
    /// after it. While an earlier copy is in flight, `stream` first waits for it, so that
    /// the event recorded after the next copy also covers it (the pipelines wait before
    /// reusing a buffer, so only back-to-back copies such as the bench's limit rows get
    /// there).
    fn enqueue(
        &mut self,
        len: usize,
        stream: &CudaStream,
        call: &'static str,
        copy: impl FnOnce(*mut c_void, sys::CUstream) -> CUresult,
    ) -> Result<(), CudaCallError> {
        if len == 0 {
            return Ok(());
        }
        if self.in_flight {
            self.event.wait_on(stream)?;
        }
        Gpu::of_stream(stream).bind()?;
        self.in_flight = true;
        copy(self.buffer.as_ptr(), stream.cu_stream())
            .result()
            .map_err(CudaCallError::driver(call, stream.context().ordinal()))?;
        self.event.record(stream)
    }

    /// Waits for the last copy (`cuEventSynchronize`); nothing when none is in flight.
    pub fn wait(&mut self) -> Result<(), CudaCallError> {
        if self.in_flight {
            self.event.synchronize()?;
            self.in_flight = false;
        }
        Ok(())
    }

    /// The bytes, or `None` while a copy is in flight.
    pub fn bytes(&self) -> Option<&[u8]> {
        (!self.in_flight).then(|| self.buffer.as_slice())
    }

    /// The bytes, or `None` while a copy is in flight.
    pub fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        if self.in_flight {
            None
        } else {
            Some(self.buffer.as_mut_slice())
        }
    }
}

impl Drop for StagingBuffer {
    fn drop(&mut self) {
        if let Err(err) = self.wait() {
            tracing::warn!(
                error = %crate::error_chain::ErrorChain(&err),
                "a pinned staging buffer's copy cannot be waited for: the buffer is leaked"
            );
            return;
        }
        // SAFETY: dropped once, here; no copy uses the buffer any more (waited above).
        unsafe { ManuallyDrop::drop(&mut self.buffer) };
    }
}

/// A CUDA event created with explicit flags (`cuEventCreate`), destroyed on drop.
#[derive(Debug)]
pub struct RawEvent {
    gpu: Gpu,
    event: sys::CUevent,
}

impl RawEvent {
    /// An event without timing; `interprocess` adds `CU_EVENT_INTERPROCESS` so that
    /// `cuIpcGetEventHandle` can export it.
    pub fn new(gpu: &Gpu, interprocess: bool) -> Result<RawEvent, CudaCallError> {
        let mut flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        if interprocess {
            flags |= sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32;
        }
        gpu.bind()?;
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: the context is current; the driver writes one handle into `event`.
        unsafe { sys::cuEventCreate(&mut event, flags) }
            .result()
            .map_err(CudaCallError::driver("cuEventCreate", gpu.ordinal()))?;
        Ok(RawEvent {
            gpu: gpu.clone(),
            event,
        })
    }

    /// Opens another process's interprocess event from its IPC handle
    /// (`cuIpcOpenEventHandle`), in `gpu`'s context.
    pub fn open_ipc(gpu: &Gpu, handle: &[u8; IPC_HANDLE_LEN]) -> Result<RawEvent, CudaCallError> {
        gpu.bind()?;
        let handle = sys::CUipcEventHandle {
            reserved: handle_chars(handle),
        };
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: the driver opens the exporter's event and writes its handle into a live
        // local; a handle that names no event is refused with an error code.
        unsafe { sys::cuIpcOpenEventHandle(&mut event, handle) }
            .result()
            .map_err(CudaCallError::driver("cuIpcOpenEventHandle", gpu.ordinal()))?;
        Ok(RawEvent {
            gpu: gpu.clone(),
            event,
        })
    }

    /// The event's IPC handle (`cuIpcGetEventHandle`); the event must have been created
    /// `interprocess`.
    pub fn ipc_handle(&self) -> Result<[u8; IPC_HANDLE_LEN], CudaCallError> {
        self.gpu.bind()?;
        let mut handle = sys::CUipcEventHandle {
            reserved: [0; IPC_HANDLE_LEN],
        };
        // SAFETY: the event is live (owned by `self`); the driver writes one handle into a
        // live local, and refuses an event made without `CU_EVENT_INTERPROCESS`.
        unsafe { sys::cuIpcGetEventHandle(&mut handle, self.event) }
            .result()
            .map_err(CudaCallError::driver(
                "cuIpcGetEventHandle",
                self.gpu.ordinal(),
            ))?;
        Ok(handle_bytes(&handle.reserved))
    }

    /// The raw handle.
    pub fn handle(&self) -> sys::CUevent {
        self.event
    }

    /// Records the work issued so far on `stream` (`cuEventRecord`).
    pub fn record(&self, stream: &CudaStream) -> Result<(), CudaCallError> {
        self.gpu.bind()?;
        // SAFETY: both handles are live: the event is owned by `self`, the stream by the
        // caller's `Arc`.
        unsafe { result::event::record(self.event, stream.cu_stream()) }
            .map_err(CudaCallError::driver("cuEventRecord", self.gpu.ordinal()))
    }

    /// Makes `stream` wait for the work this event recorded (`cuStreamWaitEvent`).
    pub fn wait_on(&self, stream: &CudaStream) -> Result<(), CudaCallError> {
        stream
            .context()
            .bind_to_thread()
            .map_err(CudaCallError::driver("cuCtxSetCurrent", self.gpu.ordinal()))?;
        // SAFETY: both handles are live; waiting on an event of another context is allowed.
        unsafe {
            result::stream::wait_event(
                stream.cu_stream(),
                self.event,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(CudaCallError::driver(
            "cuStreamWaitEvent",
            stream.context().ordinal(),
        ))
    }

    /// Blocks the calling thread until the recorded work is done (`cuEventSynchronize`).
    pub fn synchronize(&self) -> Result<(), CudaCallError> {
        self.gpu.bind()?;
        // SAFETY: the event is live.
        unsafe { result::event::synchronize(self.event) }.map_err(CudaCallError::driver(
            "cuEventSynchronize",
            self.gpu.ordinal(),
        ))
    }
    /// Whether the recorded work is done (`cuEventQuery`), without blocking.
    pub fn query(&self) -> Result<bool, CudaCallError> {
        self.gpu.bind()?;
        // SAFETY: the event is live.
        match unsafe { result::event::query(self.event) } {
            Ok(()) => Ok(true),
            Err(err) if err.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(err) => Err(CudaCallError::driver("cuEventQuery", self.gpu.ordinal())(
                err,
            )),
        }
    }

    /// Waits at most `timeout` for the recorded work (polling `cuEventQuery`, yielding
    /// the thread, then sleeping up to 1 ms between polls): whether it is done. For an
    /// event another process records, whose work might never end if that process dies.
    pub fn wait_for(&self, timeout: std::time::Duration) -> Result<bool, CudaCallError> {
        let started = std::time::Instant::now();
        let mut pause = std::time::Duration::from_micros(1);
        loop {
            if self.query()? {
                return Ok(true);
            }
            if started.elapsed() >= timeout {
                return Ok(false);
            }
            if pause < std::time::Duration::from_micros(50) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(pause);
            }
            pause = (pause * 2).min(std::time::Duration::from_millis(1));
        }
    }
}

impl Drop for RawEvent {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: the event is destroyed once; the driver defers the release of an
            // event that still has pending work.
            let _ = unsafe { result::event::destroy(self.event) };
        }
    }
}

// SAFETY: CUDA event handles may be used from any thread of the process.
unsafe impl Send for RawEvent {}
// SAFETY: every method is a thread-safe driver call on the handle.
unsafe impl Sync for RawEvent {}

/// An IPC handle's bytes, as the wire carries them.
fn handle_bytes(raw: &[c_char; IPC_HANDLE_LEN]) -> [u8; IPC_HANDLE_LEN] {
    raw.map(|c| c as u8)
}

/// An IPC handle for the driver, from its wire bytes.
fn handle_chars(bytes: &[u8; IPC_HANDLE_LEN]) -> [c_char; IPC_HANDLE_LEN] {
    bytes.map(|b| b as c_char)
}

// --- CUDA IPC -------------------------------------------------------------------------

/// Another process's allocation mapped into this process by `cuIpcOpenMemHandle` (with
/// lazy peer access), closed with `cuIpcCloseMemHandle` on drop. Only read from
/// ([`source`](Self::source)).
#[derive(Debug)]
pub struct IpcMapping {
    gpu: Gpu,
    base: sys::CUdeviceptr,
    /// The mapped allocation (`cuMemGetAddressRange` of `base`).
    allocation_base: sys::CUdeviceptr,
    allocation_len: usize,
}

impl IpcMapping {
    /// Opens `handle` in `gpu`'s context and reads the extent of the allocation it maps.
    /// A handle that names nothing is refused by the driver.
    pub fn open(gpu: &Gpu, handle: &[u8; IPC_HANDLE_LEN]) -> Result<IpcMapping, CudaCallError> {
        gpu.bind()?;
        let ordinal = gpu.ordinal();
        let raw = sys::CUipcMemHandle {
            reserved: handle_chars(handle),
        };
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: the driver maps the exporter's allocation and writes its address into a
        // live local; a handle that names nothing is refused with an error code.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(CudaCallError::driver("cuIpcOpenMemHandle", ordinal))?;
        // From here on, dropping `mapping` closes it.
        let mut mapping = IpcMapping {
            gpu: gpu.clone(),
            base,
            allocation_base: base,
            allocation_len: 0,
        };
        let mut allocation_base: sys::CUdeviceptr = 0;
        let mut allocation_len: usize = 0;
        // SAFETY: the driver writes one address and one size into two live locals; `base`
        // is a live mapping of the current context.
        unsafe { sys::cuMemGetAddressRange_v2(&mut allocation_base, &mut allocation_len, base) }
            .result()
            .map_err(CudaCallError::driver("cuMemGetAddressRange", ordinal))?;
        mapping.allocation_base = allocation_base;
        mapping.allocation_len = allocation_len;
        Ok(mapping)
    }

    /// Where the mapping starts.
    pub fn base(&self) -> sys::CUdeviceptr {
        self.base
    }

    /// Whether the handle maps the start of its allocation (a handle names a whole
    /// `cuMemAlloc` allocation; anything else is a malformed or hostile handle).
    pub fn starts_its_allocation(&self) -> bool {
        self.allocation_base == self.base
    }

    /// Bytes mapped from [`base`](Self::base) to the end of the allocation.
    pub fn len(&self) -> usize {
        let end = self
            .allocation_base
            .saturating_add(self.allocation_len as u64);
        usize::try_from(end.saturating_sub(self.base)).unwrap_or(usize::MAX)
    }

    /// Whether nothing is mapped.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The mapped bytes, to copy from while the mapping is open.
    pub fn source(&self) -> DeviceSource<'_> {
        DeviceSource::new(self.base, self.len())
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: `base` came from `cuIpcOpenMemHandle` in this device's context and is
            // closed once, here; copies out of it borrowed `self` (`source`), and their
            // owners wait for them before they let the mapping go.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.base) };
        }
    }
}

// SAFETY: a mapped device address is valid from any thread once the context is current,
// which `Drop` ensures; the struct is otherwise plain data.
unsafe impl Send for IpcMapping {}
// SAFETY: shared access only reads the fields.
unsafe impl Sync for IpcMapping {}

// --- GPUDirect RDMA -------------------------------------------------------------------

/// The host's page size (`sysconf(_SC_PAGESIZE)`), 4096 if it cannot be read.
pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).unwrap_or(4096)
}

/// The whole `cuMemAlloc` allocation a [`DeviceRange`] lies in (`cuMemGetAddressRange`):
/// device memory, which is what makes registering it with a NIC safe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AllocationExtent {
    base: sys::CUdeviceptr,
    len: u64,
}

impl AllocationExtent {
    /// The allocation `range` lies in; `gpu`'s context must be current.
    pub(crate) fn of(range: DeviceRange<'_>) -> Result<AllocationExtent, DriverCode> {
        let mut base: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        // SAFETY: the driver writes one address and one size through live locals.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, range.ptr()) }.result()?;
        Ok(AllocationExtent {
            base,
            len: size as u64,
        })
    }

    /// Start address.
    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Registers the allocation with `ibv_reg_mr` on its device addresses: the
    /// peer-memory path (a peer-memory kernel module resolves them to GPU pages; without
    /// one the verb fails).
    pub(crate) fn register_peer_memory(
        &self,
        pd: &Arc<ProtectionDomain>,
        access: AccessFlags,
    ) -> io::Result<MemoryRegion> {
        let len =
            usize::try_from(self.len).map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
        // SAFETY: `[base, base + len)` is device memory (a `cuMemAlloc` allocation, found
        // from a `DeviceRange`), never host memory Rust holds: whatever the NIC writes
        // there lands in GPU pages, which the peer-memory module pins (and invalidates if
        // the allocation is freed). The MR keeps the PD alive.
        unsafe { pd.reg_mr(self.base, len, access) }
    }

    /// Exports `[start, start + len)` (page-aligned, in this allocation's context, which
    /// must be current) as a dma-buf (`cuMemGetHandleForAddressRange`).
    pub(crate) fn export_dma_buf(&self, start: u64, len: usize) -> Result<DmaBuf, DriverCode> {
        let mut fd: RawFd = -1;
        // SAFETY: the driver writes one file descriptor (an `int`) through the pointer, a
        // live local; a range it cannot export is refused with an error code.
        unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut RawFd).cast::<c_void>(),
                start,
                len,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        }
        .result()?;
        if fd < 0 {
            return Err(DriverCode(CUresult::CUDA_ERROR_INVALID_HANDLE));
        }
        // SAFETY: the driver just created `fd` for us; nobody else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(DmaBuf { fd })
    }
}

/// A dma-buf of device memory, from [`AllocationExtent::export_dma_buf`]; its file
/// descriptor is closed on drop (a registration keeps its own reference).
#[derive(Debug)]
pub(crate) struct DmaBuf {
    fd: OwnedFd,
}

impl DmaBuf {
    /// Registers `[offset, offset + len)` of the dma-buf with `ibv_reg_dmabuf_mr`, at
    /// `iova` (the address work requests use).
    pub(crate) fn register(
        &self,
        pd: &Arc<ProtectionDomain>,
        offset: u64,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> io::Result<MemoryRegion> {
        // SAFETY: the dma-buf exports device memory (it only comes from
        // `cuMemGetHandleForAddressRange`), so the NIC can only reach GPU pages through
        // it, never host memory Rust holds; the kernel rejects a range outside the
        // dma-buf and takes its own reference on it, so `fd` may be closed afterwards
        // (as NCCL does).
        unsafe { pd.reg_dmabuf_mr(offset, len, iova, self.fd.as_fd(), access) }
    }
}

/// A registration an RDMA READ target uses: its local key and the device address range it
/// registers. Implemented in this crate only by registrations the NIC made of whole
/// `cuMemAlloc` allocations (`crate::cuda::gdr::GdrRegistration`).
pub(crate) trait DeviceRegistration {
    /// The local key.
    fn lkey(&self) -> u32;
    /// The registered `(base, len)` device address range.
    fn registered(&self) -> (u64, u64);
}

/// Device memory an RDMA READ target owns. Implemented in this crate only by owners of
/// device memory from the driver (`crate::cuda::agent::CudaMemory`).
pub(crate) trait OwnedDeviceMemory {
    /// The memory's device range.
    fn device_range(&self) -> DeviceRange<'_>;
}

/// Device memory and a registration that covers it: what an RDMA READ of device memory
/// lands in (`crate::cuda::agent::gdr::GdrTarget`). The check that the registration
/// covers the memory is made here, beside the `unsafe impl` that relies on it. Field
/// order: the registration goes before the memory.
#[derive(Debug)]
pub struct CoveredDeviceMemory<R, M> {
    registration: R,
    memory: M,
}

impl<R, M> CoveredDeviceMemory<R, M> {
    /// `memory` under `registration`, or both back (with the ranges, `(base, registered)`
    /// and `(ptr, len)`) when the registration does not cover the memory.
    #[allow(clippy::type_complexity)]
    pub(crate) fn covering(
        registration: R,
        memory: M,
    ) -> Result<Self, (R, M, (u64, u64), (u64, u64))>
    where
        R: DeviceRegistration,
        M: OwnedDeviceMemory,
    {
        let range = memory.device_range();
        let (ptr, len) = (range.ptr(), range.len() as u64);
        let registered = registration.registered();
        if !covers(registered, (ptr, len)) {
            return Err((registration, memory, registered, (ptr, len)));
        }
        Ok(CoveredDeviceMemory {
            registration,
            memory,
        })
    }

    /// The registration and the memory, apart.
    pub(crate) fn into_parts(self) -> (R, M) {
        (self.registration, self.memory)
    }
}

/// Whether `[base, base + registered)` holds `[ptr, ptr + len)` (no address overflows).
pub(crate) fn covers((base, registered): (u64, u64), (ptr, len): (u64, u64)) -> bool {
    match (base.checked_add(registered), ptr.checked_add(len)) {
        (Some(reg_end), Some(end)) => ptr >= base && end <= reg_end,
        _ => false,
    }
}

// SAFETY: the registration covers the memory (`covering` checks it; GdrRegistrar
// registers the whole containing `cuMemAlloc` allocation) at its device addresses; a
// registration of another domain or without local write access only makes the NIC fail
// the read. The target owns the memory and hands it out only by value. The memory is
// device memory, so the NIC's writes never land in host memory Rust holds.
unsafe impl<R: DeviceRegistration + Send, M: OwnedDeviceMemory + Send> ReadTarget
    for CoveredDeviceMemory<R, M>
{
    fn lkey(&self) -> u32 {
        self.registration.lkey()
    }

    fn addr(&self) -> u64 {
        self.memory.device_range().ptr()
    }

    fn len(&self) -> u64 {
        self.memory.device_range().len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::result::DriverError;

    #[test]
    fn device_range_slices_are_checked() {
        // SAFETY: the range is never handed to the driver.
        let range = unsafe { DeviceRange::from_raw(0x1000, 100) };
        let sub = range.slice(10, 20).expect("fits");
        assert_eq!((sub.ptr(), sub.len()), (0x100a, 20));
        assert!(range.slice(90, 10).is_some());
        assert!(range.slice(90, 11).is_none());
        assert!(range.slice(usize::MAX, 2).is_none());
        // SAFETY: never handed to the driver.
        let top = unsafe { DeviceRange::from_raw(u64::MAX - 1, 8) };
        assert!(top.slice(4, 1).is_none(), "address overflow is refused");
        assert!(range.slice(100, 0).is_some_and(|r| r.is_empty()));
    }

    #[test]
    fn device_sources_slice_like_ranges() {
        // SAFETY: the range is never handed to the driver.
        let range = unsafe { DeviceRange::from_raw(0x2000, 64) };
        let source = DeviceSource::from(range);
        assert_eq!((source.ptr(), source.len()), (0x2000, 64));
        let sub = source.slice(8, 8).expect("fits");
        assert_eq!((sub.ptr(), sub.len()), (0x2008, 8));
        assert!(source.slice(60, 5).is_none());
        let named = DeviceSource::named_by_peer(u64::MAX - 1, 8);
        assert!(named.slice(4, 1).is_none(), "address overflow is refused");
        assert!(DeviceSource::named_by_peer(0x10, 0).is_empty());
    }

    #[test]
    fn driver_codes_name_themselves_and_what_to_do_without_the_driver() {
        // Formatting must not call libcuda (absent on most test hosts).
        let code = DriverCode(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        assert_eq!(code.name(), "CUDA_ERROR_OUT_OF_MEMORY");
        let text = code.to_string();
        assert!(
            text.starts_with("CUDA_ERROR_OUT_OF_MEMORY: ") && text.contains("RDZV_CUDA_CACHE_CAP"),
            "{text}"
        );
        assert_eq!(format!("{code:?}"), "CUDA_ERROR_OUT_OF_MEMORY");
        let from_cudarc = DriverCode::from(DriverError(CUresult::CUDA_ERROR_INVALID_HANDLE));
        assert!(from_cudarc.to_string().contains("exited"), "{from_cudarc}");
        // A code without specific advice still says where to look.
        let rare = DriverCode(CUresult::CUDA_ERROR_INVALID_PTX).to_string();
        assert!(rare.contains("CUDA driver API documentation"), "{rare}");
    }

    /// On a GPU: a staging buffer's bytes are out of reach while its copy runs, and a
    /// round trip through device memory brings them back. Skips without CUDA (panics
    /// then under `RDZV_REQUIRE_CUDA=1`).
    #[test]
    fn staging_buffers_fence_their_bytes_on_a_gpu() {
        let gpu = match Gpu::open(0) {
            Ok(gpu) => gpu,
            Err(reason) => {
                // `NotViable`'s message already carries its reason.
                assert!(
                    std::env::var("RDZV_REQUIRE_CUDA").as_deref() != Ok("1"),
                    "RDZV_REQUIRE_CUDA=1 but {reason}"
                );
                println!("SKIPPED staging_buffers_fence_their_bytes_on_a_gpu: {reason}");
                return;
            }
        };
        let len = 1 << 20;
        let stream = gpu.new_stream().expect("stream");
        let device = gpu.alloc(len).expect("device memory");
        let mut up = StagingBuffer::new(&gpu, len).expect("pinned");
        let pattern: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        up.bytes_mut().expect("idle").copy_from_slice(&pattern);
        up.upload(device.range(), &stream).expect("upload");
        if !up.is_idle() {
            assert!(up.bytes().is_none(), "bytes are fenced while the copy runs");
        }
        up.wait().expect("upload done");
        let mut down = StagingBuffer::new(&gpu, len).expect("pinned");
        down.download(device.range().source(), &stream)
            .expect("download");
        down.wait().expect("download done");
        assert_eq!(down.bytes().expect("idle"), &pattern[..]);
        let mut whole = vec![0u8; len];
        device.copy_to_host(&mut whole).expect("synchronous copy");
        assert_eq!(whole, pattern);
    }

    #[test]
    fn open_without_a_driver_is_an_error_not_a_panic() {
        if driver_library_present() {
            println!("SKIPPED open_without_a_driver_is_an_error_not_a_panic: libcuda is present");
            return;
        }
        match Gpu::open(0) {
            Err(CudaCallError::DriverLibraryMissing) => {}
            other => panic!("expected DriverLibraryMissing, got {other:?}"),
        }
    }
}
