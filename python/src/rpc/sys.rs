//! The one place where `rdzv.rpc`'s binding reads or writes memory through raw addresses
//! or calls CPython's C API itself: buffers Python lends to the agent for a send
//! ([`LentBuffer`]), received tensor buffers handed to Python without a copy
//! ([`ReceivedBytes`]), and the Python thread state an agent thread keeps
//! ([`keep_thread_state`]).
//!
//! The extension is built for the stable ABI of Python 3.9, which has no buffer
//! protocol, so neither side can ask CPython for a buffer: `rdzv/rpc/_serialize.py` reads
//! a lent buffer's address from numpy's `__array_interface__` (or ctypes), and Python
//! reads a received one through the `__array_interface__` of `ReceivedBuffer`. This
//! module decides nothing else.

use std::cell::RefCell;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use pyo3::ffi;
use pyo3::prelude::*;
use rdzv_uring::rpc::StagedBytes;

/// Cleared at interpreter exit (`rdzv.rpc`'s `atexit` hook): a thread that ends after
/// it leaves its thread state to the interpreter's own clean-up, never waiting for the
/// GIL while the interpreter finalises.
static INTERPRETER_ALIVE: AtomicBool = AtomicBool::new(true);

/// How many threads keep a Python thread state now ([`keep_thread_state`]).
static KEPT_LIVE: AtomicUsize = AtomicUsize::new(0);

/// The interpreter is exiting: see [`INTERPRETER_ALIVE`].
pub(crate) fn interpreter_exiting() {
    INTERPRETER_ALIVE.store(false, Ordering::Release);
}

/// Waits, at most `timeout`, until no thread keeps a Python thread state: after the
/// agent shut down, its threads end and release theirs, and the interpreter must not
/// begin to finalise while one is doing so. Call it without the GIL (they need it).
/// Whether they all did.
pub(crate) fn wait_kept_thread_states_released(timeout: std::time::Duration) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    while KEPT_LIVE.load(Ordering::Acquire) > 0 {
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    true
}

/// A Python thread state this thread made once and keeps, detached, so that each later
/// `Python::attach` here reuses it: attaching afresh made a thread state and mapped a
/// new frame stack, and detaching freed and unmapped it, for every call (the unmapping's
/// TLB shootdown interrupting the other CPUs too).
struct KeptThreadState {
    /// What `PyGILState_Ensure` returned, for its `PyGILState_Release`.
    state: ffi::PyGILState_STATE,
}

impl Drop for KeptThreadState {
    /// At thread exit: attaches once more and releases the state, unless the interpreter
    /// is exiting (its finalisation frees every thread state then).
    fn drop(&mut self) {
        /// Counts this state out however the drop ends.
        struct Released;
        impl Drop for Released {
            fn drop(&mut self) {
                KEPT_LIVE.fetch_sub(1, Ordering::AcqRel);
            }
        }
        let _released = Released;
        if !INTERPRETER_ALIVE.load(Ordering::Acquire) {
            return;
        }
        // SAFETY: this thread keeps a detached thread state with CPython's `Ensure`
        // count at one (`keep_thread_state`), and is not attached now: this runs as the
        // thread exits, from Rust's thread-local destructors, after every
        // `Python::attach` on it returned and before the C library clears the thread's
        // pthread keys, so CPython's own per-thread key still names that state.
        // `PyGILState_Ensure` attaches it again (count two), waiting for the GIL; if the
        // interpreter began to finalise meanwhile, PyO3's wrapper makes this thread hang
        // there instead of unwinding through Rust. Releasing with `LOCKED` takes the
        // count back to one and stays attached; releasing with the state the first
        // `Ensure` returned takes it to zero, so CPython clears and deletes the thread
        // state and lets the GIL go.
        unsafe {
            ffi::PyGILState_Ensure();
            ffi::PyGILState_Release(ffi::PyGILState_STATE::PyGILState_LOCKED);
            ffi::PyGILState_Release(self.state);
        }
    }
}

std::thread_local! {
    static KEPT: RefCell<Option<KeptThreadState>> = const { RefCell::new(None) };
}

/// Makes this thread keep a Python thread state from now until it exits (see
/// [`KeptThreadState`]). Call it on an agent thread that is about to run Python, outside
/// any `Python::attach`; it does nothing on a thread that keeps one already or has one
/// of its own (a thread Python started), or while the interpreter exits.
pub(crate) fn keep_thread_state() {
    let _ = KEPT.try_with(|kept| {
        let mut kept = kept.borrow_mut();
        if kept.is_some() || !INTERPRETER_ALIVE.load(Ordering::Acquire) {
            return;
        }
        // SAFETY: reads CPython's per-thread key only; callable with or without the GIL.
        if !unsafe { ffi::PyGILState_GetThisThreadState() }.is_null() {
            // Python owns this thread's state and deletes it when the thread ends.
            return;
        }
        // SAFETY: the interpreter is initialised (this extension is loaded and the
        // interpreter is not exiting) and this thread is not attached (the caller is
        // outside any `Python::attach`, and an agent thread attaches nowhere else):
        // `PyGILState_Ensure` makes a thread state for it and attaches it, taking the
        // GIL; `PyEval_SaveThread` detaches it again and lets the GIL go, returning
        // that state, which CPython keeps for this thread since the `Ensure` count
        // stays at one. Later `Python::attach` calls on this thread find it and
        // attach it; `KeptThreadState::drop` undoes the `Ensure`.
        let state = unsafe {
            let state = ffi::PyGILState_Ensure();
            ffi::PyEval_SaveThread();
            state
        };
        KEPT_LIVE.fetch_add(1, Ordering::AcqRel);
        *kept = Some(KeptThreadState { state });
    });
}

/// A buffer of a Python object, lent to the agent for one send: its address and length,
/// and the object that owns the memory (a `memoryview` of it, which also pins a
/// `bytearray` against resizing), kept alive while the agent reads the bytes.
///
/// The Python object is released when the agent drops the last handle to the loan
/// (`rdzv_uring::rpc::LentBytes`), which happens only after every channel is done with
/// the bytes; on an agent thread (without the GIL) PyO3 defers that reference drop to
/// the next time a thread attaches to the interpreter.
pub(crate) struct LentBuffer {
    address: usize,
    len: usize,
    _owner: Py<PyAny>,
}

impl LentBuffer {
    /// A loan of the `len` bytes at `address`, owned by `owner`.
    ///
    /// The caller is `rdzv/rpc/_serialize.py` (through the private `_rdzv` agent's
    /// `call`, `call_async`, `remote` and the handler's reply), which takes the address
    /// from the object that owns the memory and passes that object as `owner`. The
    /// address is taken on trust: a Python caller of the private entry points who passes
    /// another address makes the agent read whatever is there. What is checked is what
    /// can be: no null address for a non-empty buffer, no range that wraps.
    ///
    /// # Errors
    /// What is wrong with a null or wrapping range.
    pub(crate) fn new(address: usize, len: usize, owner: Py<PyAny>) -> Result<Self, String> {
        if len > 0 && address == 0 {
            return Err(format!("address 0 with length {len}"));
        }
        if address.checked_add(len).is_none() || len > isize::MAX as usize {
            return Err(format!("address {address:#x} + length {len} overflows"));
        }
        Ok(LentBuffer {
            address,
            len,
            _owner: owner,
        })
    }
}

impl StagedBytes for LentBuffer {
    fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `address..address + len` is the buffer of `_owner` (the caller's
        // promise, `LentBuffer::new`): non-null, within one allocation, at most
        // `isize::MAX` bytes (checked there). `_owner` (a `memoryview`, which holds the
        // exporting object and its buffer export) lives as long as `self`, and the agent
        // drops `self` only after every channel finished reading, so the memory stays
        // valid and in place for every slice handed out. Its bytes must not be written
        // while the call is in flight: that is the Python caller's duty, documented in
        // `rdzv/rpc/_serialize.py` as torch documents it for `rpc_async` arguments. (A
        // caller who writes anyway races with these reads, which Rust's memory model
        // leaves undefined; what the channels do with the slice is copy it out, with
        // `memcpy`, `send` or the peer's `process_vm_readv`, so what goes wrong in
        // practice is torn bytes at the peer, the same as with torch.)
        unsafe { std::slice::from_raw_parts(self.address as *const u8, self.len) }
    }
}

/// A received tensor's bytes, owned by a `ReceivedBuffer` and read and written by
/// Python through their address (`__array_interface__`): the parts of the `Vec` the
/// agent received them into, taken apart so that no Rust reference to them exists while
/// Python holds the address.
pub(crate) struct ReceivedBytes {
    pointer: NonNull<u8>,
    len: usize,
    capacity: usize,
}

// SAFETY: `ReceivedBytes` owns its allocation exclusively (it was a `Vec<u8>`, taken
// apart in `from_vec`), as a `Vec<u8>` does, and `Vec<u8>` is `Send`.
unsafe impl Send for ReceivedBytes {}
// SAFETY: through `&ReceivedBytes` Rust only reads the bytes (`with_bytes`, `address`),
// and only under the GIL; writes come from Python code through the address, ordered with
// those reads by the GIL or by the Python program's own synchronisation, exactly as
// writes to a `bytearray` from several threads are.
unsafe impl Sync for ReceivedBytes {}

impl ReceivedBytes {
    /// Takes ownership of `buffer`.
    pub(crate) fn from_vec(buffer: Vec<u8>) -> ReceivedBytes {
        let mut buffer = std::mem::ManuallyDrop::new(buffer);
        ReceivedBytes {
            // A `Vec`'s pointer is never null (dangling when it has no capacity).
            pointer: NonNull::new(buffer.as_mut_ptr()).unwrap_or(NonNull::dangling()),
            len: buffer.len(),
            capacity: buffer.capacity(),
        }
    }

    /// The address of the first byte (dangling but non-null when empty).
    pub(crate) fn address(&self) -> usize {
        self.pointer.as_ptr() as usize
    }

    /// The length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Runs `f` over the bytes (to copy them into a Python object).
    pub(crate) fn with_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> R {
        if self.len == 0 {
            return f(&[]);
        }
        // SAFETY: `pointer..pointer + len` is the initialised part of the allocation
        // this value owns (`from_vec`), alive until `drop`; the slice does not outlive
        // `f`. The caller holds the GIL (a `ReceivedBuffer` method), so Python code that
        // writes through the address concurrently must have released it (a numpy
        // operation without the GIL), a race the Python program owns, as with a
        // `bytearray`.
        let bytes = unsafe { std::slice::from_raw_parts(self.pointer.as_ptr(), self.len) };
        f(bytes)
    }
}

impl Drop for ReceivedBytes {
    fn drop(&mut self) {
        // SAFETY: the parts are those of a `Vec<u8>` taken apart in `from_vec` (same
        // allocator, length and capacity), reassembled once, here: `self` is never
        // used again, and no address Python read is used after the `ReceivedBuffer`
        // that owns `self` is gone (numpy arrays over it hold that object alive).
        let buffer = unsafe { Vec::from_raw_parts(self.pointer.as_ptr(), self.len, self.capacity) };
        // Large buffers go back to the agent, for the next receive to reuse.
        rdzv_uring::rpc::recycle_received(buffer);
    }
}
