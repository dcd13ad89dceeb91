//! Owned CUDA resources the channels are built from: an opened device ([`Gpu`]), device
//! memory from `cuMemAlloc` ([`DeviceAllocation`]), a borrowed device address range
//! ([`DeviceRange`]), page-locked host memory ([`PinnedHostBuffer`]) and raw events
//! ([`RawEvent`], which unlike cudarc's `CudaEvent` can be created interprocess).
//!
//! Opening a device is where cudarc would panic on a host without the driver library, so
//! [`Gpu::open`] checks for the library first and runs the context creation under
//! `catch_unwind`. Device memory is always allocated with `cuMemAlloc` (not the
//! stream-ordered pool cudarc's `CudaStream::alloc` uses), because CUDA IPC handles and
//! GPUDirect RDMA registration require it. This module moves no bytes and decides no
//! protocol; every resource binds its device's context before the driver call that needs it
//! and releases itself on drop.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};

use cudarc::driver::result;
use cudarc::driver::safe::{CudaContext, CudaStream};
use cudarc::driver::sys;

use rdzv_core::channel::cuda::IPC_HANDLE_LEN;

use super::channel_error::CudaChannelError;
use super::{driver_library_present, panic_message, CudaNotViable};

/// An opened CUDA device: its primary context, made current on the calling thread by every
/// operation of this crate that needs it.
#[derive(Debug, Clone)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
}

impl Gpu {
    /// Opens device `ordinal` (its primary context). Never panics: without the driver
    /// library it returns [`CudaChannelError::NotViable`], and a panic inside cudarc is
    /// returned as [`CudaChannelError::Panicked`].
    pub fn open(ordinal: usize) -> Result<Gpu, CudaChannelError> {
        if !driver_library_present() {
            return Err(CudaChannelError::NotViable(
                CudaNotViable::DriverLibraryMissing,
            ));
        }
        match std::panic::catch_unwind(|| CudaContext::new(ordinal)) {
            Ok(Ok(ctx)) => Ok(Gpu { ctx }),
            Ok(Err(err)) if err.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => {
                Err(CudaChannelError::NotViable(CudaNotViable::NoDevices {
                    source: Some(err),
                }))
            }
            Ok(Err(source)) => Err(CudaChannelError::Driver {
                call: "cuDevicePrimaryCtxRetain",
                device: ordinal,
                source,
            }),
            Err(payload) => Err(CudaChannelError::Panicked {
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
    pub fn new_stream(&self) -> Result<Arc<CudaStream>, CudaChannelError> {
        self.ctx
            .new_stream()
            .map_err(CudaChannelError::driver("cuStreamCreate", self.ordinal()))
    }

    /// Checks that `stream` belongs to this device's context.
    pub fn check_stream(&self, stream: &CudaStream) -> Result<(), CudaChannelError> {
        if stream.context().cu_ctx() == self.ctx.cu_ctx() {
            Ok(())
        } else {
            Err(CudaChannelError::WrongDevice {
                endpoint_device: self.ordinal(),
                stream_device: stream.context().ordinal(),
            })
        }
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<(), CudaChannelError> {
        self.ctx
            .bind_to_thread()
            .map_err(CudaChannelError::driver("cuCtxSetCurrent", self.ordinal()))
    }

    /// Allocates `len` bytes of device memory with `cuMemAlloc` (a zero-length request
    /// allocates nothing).
    pub fn alloc(&self, len: usize) -> Result<DeviceAllocation, CudaChannelError> {
        DeviceAllocation::new(self, len)
    }

    /// Free and total device memory in bytes (`cuMemGetInfo`).
    pub fn memory_info(&self) -> Result<(usize, usize), CudaChannelError> {
        self.bind()?;
        result::mem_get_info().map_err(CudaChannelError::driver("cuMemGetInfo", self.ordinal()))
    }

    /// The device's PCI bus id (`cuDeviceGetPCIBusId`), e.g. `0000:3B:00.0`.
    pub fn pci_bus_id(&self) -> Result<String, CudaChannelError> {
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: the driver writes a NUL-terminated string of at most `len` bytes into
        // `buf`, which is a live local array of that length; the device handle comes from
        // the context, created after `cuInit`.
        unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), 32, self.ctx.cu_device()) }
            .result()
            .map_err(CudaChannelError::driver(
                "cuDeviceGetPCIBusId",
                self.ordinal(),
            ))?;
        let bytes: Vec<u8> = buf
            .iter()
            .take_while(|c| **c != 0)
            .map(|c| *c as u8)
            .collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The device's UUID, formatted as NVIDIA does (`GPU-xxxxxxxx-xxxx-...`).
    pub fn uuid(&self) -> Result<String, CudaChannelError> {
        let uuid = self
            .ctx
            .uuid()
            .map_err(CudaChannelError::driver("cuDeviceGetUuid", self.ordinal()))?;
        let bytes: Vec<u8> = uuid.bytes.iter().map(|b| *b as u8).collect();
        Ok(super::descriptor::format_gpu_uuid(&bytes))
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
    pub unsafe fn from_raw(ptr: sys::CUdeviceptr, len: usize) -> DeviceRange<'a> {
        DeviceRange {
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

    /// The sub-range `[offset, offset + len)`, or `None` if it does not fit.
    pub fn slice(&self, offset: usize, len: usize) -> Option<DeviceRange<'a>> {
        let end = offset.checked_add(len)?;
        if end > self.len {
            return None;
        }
        Some(DeviceRange {
            ptr: self.ptr.checked_add(offset as u64)?,
            len,
            _memory: PhantomData,
        })
    }
}

/// Enqueues a copy of `src` (on `src_gpu`) into `dst` (on `dst_gpu`) on `stream`:
/// `cuMemcpyDtoDAsync` within one context, `cuMemcpyPeerAsync` across devices. The ranges
/// must have the same length; an empty copy enqueues nothing.
pub fn copy_device_async(
    dst: DeviceRange<'_>,
    dst_gpu: &Gpu,
    src: DeviceRange<'_>,
    src_gpu: &Gpu,
    stream: &CudaStream,
) -> Result<(), CudaChannelError> {
    if dst.len() != src.len() {
        return Err(CudaChannelError::LengthMismatch {
            sent: src.len() as u64,
            expected: dst.len() as u64,
        });
    }
    if src.is_empty() {
        return Ok(());
    }
    let ordinal = stream.context().ordinal();
    Gpu::of_stream(stream).bind()?;
    if dst_gpu.context().cu_ctx() == src_gpu.context().cu_ctx() {
        // SAFETY: both ranges are borrowed device memory of `len` bytes in this context
        // (their `DeviceRange` contracts); the stream is live.
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst.ptr(), src.ptr(), src.len(), stream.cu_stream()) }
            .result()
            .map_err(CudaChannelError::driver("cuMemcpyDtoDAsync", ordinal))
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
        .map_err(CudaChannelError::driver("cuMemcpyPeerAsync", ordinal))
    }
}

/// Enqueues a copy of the first `dst.len()` bytes of pinned `src` into `dst` on `stream`
/// (`cuMemcpyHtoDAsync`). The buffer must not be written, nor `dst` used, until the
/// stream's work up to here is done (wait with an event recorded after it).
pub fn copy_to_device_async(
    dst: DeviceRange<'_>,
    src: &PinnedHostBuffer,
    stream: &CudaStream,
) -> Result<(), CudaChannelError> {
    if dst.len() > src.len() {
        return Err(CudaChannelError::LengthMismatch {
            sent: src.len() as u64,
            expected: dst.len() as u64,
        });
    }
    if dst.is_empty() {
        return Ok(());
    }
    let ordinal = stream.context().ordinal();
    Gpu::of_stream(stream).bind()?;
    // SAFETY: `src` is pinned memory of at least `dst.len()` bytes owned by the caller,
    // `dst` borrowed device memory of that length (its `DeviceRange` contract); the
    // caller waits for the stream before touching either (this function's contract).
    unsafe { sys::cuMemcpyHtoDAsync_v2(dst.ptr(), src.as_ptr(), dst.len(), stream.cu_stream()) }
        .result()
        .map_err(CudaChannelError::driver("cuMemcpyHtoDAsync", ordinal))
}

/// Enqueues a copy of `src` into the first `src.len()` bytes of pinned `dst` on
/// `stream` (`cuMemcpyDtoHAsync`). The buffer must not be read until the stream's work
/// up to here is done.
pub fn copy_to_host_async(
    dst: &mut PinnedHostBuffer,
    src: DeviceRange<'_>,
    stream: &CudaStream,
) -> Result<(), CudaChannelError> {
    if src.len() > dst.len() {
        return Err(CudaChannelError::LengthMismatch {
            sent: src.len() as u64,
            expected: dst.len() as u64,
        });
    }
    if src.is_empty() {
        return Ok(());
    }
    let ordinal = stream.context().ordinal();
    Gpu::of_stream(stream).bind()?;
    // SAFETY: as `copy_to_device_async`, the other way round; `dst` is borrowed
    // exclusively for the call and read only after the stream's work is done.
    unsafe { sys::cuMemcpyDtoHAsync_v2(dst.as_ptr(), src.ptr(), src.len(), stream.cu_stream()) }
        .result()
        .map_err(CudaChannelError::driver("cuMemcpyDtoHAsync", ordinal))
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
    fn new(gpu: &Gpu, len: usize) -> Result<DeviceAllocation, CudaChannelError> {
        let ptr = if len == 0 {
            0
        } else {
            gpu.bind()?;
            // SAFETY: the device's context is current; `cuMemAlloc` only returns memory.
            unsafe { result::malloc_sync(len) }
                .map_err(CudaChannelError::driver("cuMemAlloc", gpu.ordinal()))?
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
        DeviceRange {
            ptr: self.ptr,
            len: self.len,
            _memory: PhantomData,
        }
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
    pub fn ipc_handle(&self) -> Result<[u8; IPC_HANDLE_LEN], CudaChannelError> {
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
            .map_err(CudaChannelError::driver(
                "cuIpcGetMemHandle",
                self.gpu.ordinal(),
            ))?;
        let handle = handle.reserved.map(|c| c as u8);
        Ok(*self.ipc_handle.get_or_init(|| handle))
    }

    /// Copies `src` into the allocation (synchronous `cuMemcpyHtoD`); `src` must have the
    /// allocation's length.
    pub fn copy_from_host(&mut self, src: &[u8]) -> Result<(), CudaChannelError> {
        if src.len() != self.len {
            return Err(CudaChannelError::LengthMismatch {
                sent: src.len() as u64,
                expected: self.len as u64,
            });
        }
        if self.len == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        // SAFETY: `self.ptr` is a live allocation of `src.len()` bytes; `src` is a valid
        // host slice; the call is synchronous.
        unsafe { result::memcpy_htod_sync(self.ptr, src) }
            .map_err(CudaChannelError::driver("cuMemcpyHtoD", self.gpu.ordinal()))
    }

    /// Copies the allocation into `dst` (synchronous `cuMemcpyDtoH`); `dst` must have the
    /// allocation's length.
    pub fn copy_to_host(&self, dst: &mut [u8]) -> Result<(), CudaChannelError> {
        if dst.len() != self.len {
            return Err(CudaChannelError::LengthMismatch {
                sent: self.len as u64,
                expected: dst.len() as u64,
            });
        }
        if self.len == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        // SAFETY: `self.ptr` is a live allocation of `dst.len()` bytes; `dst` is a valid,
        // exclusively borrowed host slice; the call is synchronous.
        unsafe { result::memcpy_dtoh_sync(dst, self.ptr) }
            .map_err(CudaChannelError::driver("cuMemcpyDtoH", self.gpu.ordinal()))
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
    pub fn new(gpu: &Gpu, len: usize) -> Result<PinnedHostBuffer, CudaChannelError> {
        if len == 0 {
            return Err(CudaChannelError::InvalidPool {
                slots: 1,
                slot_len: 0,
            });
        }
        gpu.bind()?;
        // SAFETY: the context is current; the driver returns `len` bytes of host memory or
        // an error.
        let ptr = unsafe { result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(CudaChannelError::driver("cuMemHostAlloc", gpu.ordinal()))?
            .cast::<u8>();
        if ptr.is_null() {
            return Err(CudaChannelError::Driver {
                call: "cuMemHostAlloc",
                device: gpu.ordinal(),
                source: result::DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY),
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

    /// The host address, for `cuMemcpy*Async`.
    pub fn as_ptr(&self) -> *mut c_void {
        self.ptr.cast()
    }

    /// The bytes, to read. Callers must not hold this while an asynchronous copy into
    /// the buffer is in flight (the runtime waits for its event first).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes owned by `self`; writes go
        // through `&mut self` (`as_mut_slice`) or through an asynchronous copy that the
        // caller waits for before reading (this method's contract).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes. Callers must not hold this while an asynchronous copy into or out of
    /// the buffer is in flight (the staging pipeline waits on the slot's event first).
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
// (`as_ptr`, whose users enqueue copies under their own `unsafe` contract); writes in
// safe code need `&mut self`. So shared references on several threads cannot race.
unsafe impl Sync for PinnedHostBuffer {}

/// A CUDA event created with explicit flags (`cuEventCreate`), destroyed on drop.
#[derive(Debug)]
pub struct RawEvent {
    gpu: Gpu,
    event: sys::CUevent,
}

impl RawEvent {
    /// An event without timing; `interprocess` adds `CU_EVENT_INTERPROCESS` so that
    /// `cuIpcGetEventHandle` can export it.
    pub fn new(gpu: &Gpu, interprocess: bool) -> Result<RawEvent, CudaChannelError> {
        let mut flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        if interprocess {
            flags |= sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32;
        }
        gpu.bind()?;
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: the context is current; the driver writes one handle into `event`.
        unsafe { sys::cuEventCreate(&mut event, flags) }
            .result()
            .map_err(CudaChannelError::driver("cuEventCreate", gpu.ordinal()))?;
        Ok(RawEvent {
            gpu: gpu.clone(),
            event,
        })
    }

    /// Wraps an event opened from another process's IPC handle.
    pub(crate) fn from_ipc(gpu: &Gpu, event: sys::CUevent) -> RawEvent {
        RawEvent {
            gpu: gpu.clone(),
            event,
        }
    }

    /// The raw handle.
    pub fn handle(&self) -> sys::CUevent {
        self.event
    }

    /// Records the work issued so far on `stream` (`cuEventRecord`).
    pub fn record(&self, stream: &CudaStream) -> Result<(), CudaChannelError> {
        self.gpu.bind()?;
        // SAFETY: both handles are live: the event is owned by `self`, the stream by the
        // caller's `Arc`.
        unsafe { result::event::record(self.event, stream.cu_stream()) }.map_err(
            CudaChannelError::driver("cuEventRecord", self.gpu.ordinal()),
        )
    }

    /// Makes `stream` wait for the work this event recorded (`cuStreamWaitEvent`).
    pub fn wait_on(&self, stream: &CudaStream) -> Result<(), CudaChannelError> {
        stream
            .context()
            .bind_to_thread()
            .map_err(CudaChannelError::driver(
                "cuCtxSetCurrent",
                self.gpu.ordinal(),
            ))?;
        // SAFETY: both handles are live; waiting on an event of another context is allowed.
        unsafe {
            result::stream::wait_event(
                stream.cu_stream(),
                self.event,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(CudaChannelError::driver(
            "cuStreamWaitEvent",
            stream.context().ordinal(),
        ))
    }

    /// Blocks the calling thread until the recorded work is done (`cuEventSynchronize`).
    pub fn synchronize(&self) -> Result<(), CudaChannelError> {
        self.gpu.bind()?;
        // SAFETY: the event is live.
        unsafe { result::event::synchronize(self.event) }.map_err(CudaChannelError::driver(
            "cuEventSynchronize",
            self.gpu.ordinal(),
        ))
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn open_without_a_driver_is_an_error_not_a_panic() {
        if driver_library_present() {
            println!("SKIPPED open_without_a_driver_is_an_error_not_a_panic: libcuda is present");
            return;
        }
        match Gpu::open(0) {
            Err(CudaChannelError::NotViable(CudaNotViable::DriverLibraryMissing)) => {}
            other => panic!("expected DriverLibraryMissing, got {other:?}"),
        }
    }
}
