//! What a call carries ([`Message`], [`Tensor`]) and the future a call returns
//! ([`RpcFuture`]); what a handler sees of its caller is [`super::handler`]'s.
//!
//! A message is owned bytes: the agent moves them into frames and out again, and never
//! interprets metadata or payload. The future is completed exactly once (the first
//! result wins, so a reply arriving after a timeout is dropped) and can be waited on from
//! any thread or awaited from any executor.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use rdzv_core::device::Device;

use super::device::{DeviceBuffer, DeviceError};
use super::error::{CallError, UsageError};

mod lent;

pub use crate::rpc::device::LentBytes;

/// A tensor's bytes and the device they live on.
///
/// A CPU tensor holds its bytes in `data`, or, when its owner lends them for the send
/// instead ([`Tensor::lent`], [`LentBytes`]), in `memory` on the CPU device. A tensor on another device (CUDA) holds a
/// [`DeviceBuffer`] in `memory` instead, made by a device runtime plugged into the agent
/// ([`RpcOptions::device_plugins`](super::RpcOptions::device_plugins)), and an empty
/// `data`; received tensors on such a device come the same way.
///
/// **When a received tensor is ready.** A CPU tensor's bytes are complete when the
/// agent hands it over (to a handler, or from `rpc_sync` and the future's wait). So is a
/// device tensor's, unless its runtime hands tensors over with their copy still running
/// (`rdzv_rdma`'s `CudaOptions::pending_hand_over`, for `cuda_ipc` and `cuda_xth`): then
/// [`is_ready`](Self::is_ready) says whether the copy is done, and
/// [`wait_ready`](Self::wait_ready) blocks until it is. Reading the bytes before that
/// (on the host, or on a stream not ordered after the memory's ready event) may see
/// them half copied. CUDA users who would rather not block order their own stream after
/// the copy on the GPU: `memory.downcast_ref::<CudaMemory>()`, then
/// `CudaMemory::wait_ready_on(stream)`. Dropping the tensor is always safe: the runtime
/// waits for the copy before it reuses the memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    /// Where the bytes live.
    pub device: Device,
    /// The bytes, for a CPU tensor.
    pub data: Vec<u8>,
    /// The device memory, for a tensor on another device.
    pub memory: Option<DeviceBuffer>,
}

impl Tensor {
    /// A CPU tensor holding `data`.
    pub fn cpu(data: Vec<u8>) -> Tensor {
        Tensor {
            device: Device::cpu(),
            data,
            memory: None,
        }
    }

    /// A tensor in device memory, on the memory's device.
    pub fn on_device(memory: DeviceBuffer) -> Tensor {
        Tensor {
            device: memory.device(),
            data: Vec::new(),
            memory: Some(memory),
        }
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.memory
            .as_ref()
            .map_or(self.data.len(), DeviceBuffer::len)
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether its bytes are complete now: always for a CPU tensor; for device memory,
    /// its runtime's answer ([`DeviceBuffer::is_ready`]). See the type's docs.
    ///
    /// # Errors
    /// The runtime cannot tell (a driver error, naming the device).
    pub fn is_ready(&self) -> Result<bool, DeviceError> {
        self.memory
            .as_ref()
            .map_or(Ok(true), DeviceBuffer::is_ready)
    }

    /// Blocks until its bytes are complete, at most `timeout`: whether they are (at
    /// once for a CPU tensor).
    ///
    /// # Errors
    /// As [`is_ready`](Self::is_ready).
    pub fn wait_ready(&self, timeout: Duration) -> Result<bool, DeviceError> {
        self.memory
            .as_ref()
            .map_or(Ok(true), |memory| memory.wait_ready(timeout))
    }
}

/// A request or a response: opaque metadata, a payload and tensors.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Message {
    /// Small caller-defined bytes (e.g. a type tag or serialised arguments' schema).
    pub metadata: Vec<u8>,
    /// The payload.
    pub payload: Vec<u8>,
    /// The tensors.
    pub tensors: Vec<Tensor>,
}

impl Message {
    /// A message with only a payload.
    pub fn from_payload(payload: impl Into<Vec<u8>>) -> Message {
        Message {
            payload: payload.into(),
            ..Message::default()
        }
    }

    /// This message with one more tensor.
    pub fn with_tensor(mut self, tensor: Tensor) -> Message {
        self.tensors.push(tensor);
        self
    }
}

std::thread_local! {
    /// Set on the agent's I/O threads, where a blocking wait would deadlock.
    static ON_IO_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the current thread is an agent I/O thread.
pub(crate) fn on_io_thread() -> bool {
    ON_IO_THREAD.with(std::cell::Cell::get)
}

/// Marks the current thread as an agent I/O thread.
pub(crate) fn mark_io_thread() {
    ON_IO_THREAD.with(|flag| flag.set(true));
}

/// Runs `f` with this thread not counted as an I/O thread: a handler that a lane's
/// reader runs itself may block, since another thread reads the lane on if it runs
/// long (`lane::inbound`).
pub(crate) fn off_io_thread<R>(f: impl FnOnce() -> R) -> R {
    let was = ON_IO_THREAD.with(|flag| flag.replace(false));
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            ON_IO_THREAD.with(|flag| flag.set(self.0));
        }
    }
    let _restore = Restore(was);
    f()
}

/// The error of a blocking wait on an I/O thread, if this is one.
fn blocking_on_io_thread() -> Option<CallError> {
    on_io_thread().then_some(CallError::Usage(UsageError::BlockingInline))
}

/// What runs with a future's result instead of a waiter ([`RpcFuture::then`] and the
/// combinators): it owns the result.
type OnDone = Box<dyn FnOnce(Result<Message, CallError>) + Send>;

/// The callback slot, debug-printable.
#[derive(Default)]
struct Callback(Option<OnDone>);

impl std::fmt::Debug for Callback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Callback(set)"
        } else {
            "Callback(none)"
        })
    }
}

#[derive(Debug, Default)]
struct Slot {
    result: Option<Result<Message, CallError>>,
    /// Set by [`RpcFuture::on_done`]: takes the result when the future completes.
    callback: Callback,
    done: bool,
    waker: Option<Waker>,
    /// Threads asleep on `ready` (completing signals only if there are any: a signal
    /// nobody waits for still costs a system call).
    sleepers: u32,
}

/// The completion cell shared by a future and the agent.
#[derive(Debug, Default)]
pub(crate) struct Completion {
    slot: Mutex<Slot>,
    ready: Condvar,
    /// `slot.done`, readable without the lock, for a waiter that spins.
    done: AtomicBool,
    /// How long [`RpcFuture::wait`] spins.
    spin: Duration,
}

impl Completion {
    fn lock(&self) -> MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Completes the future; returns `false` (and drops `result`) if it was completed
    /// already.
    pub(crate) fn complete(&self, result: Result<Message, CallError>) -> bool {
        self.complete_then(result, || {})
    }

    /// Completes the future and, only if this completed it, runs `first` before any
    /// waiter can see the result (the agent uncounts the call there, so a caller that got
    /// its result never sees the call still counted).
    pub(crate) fn complete_then(
        &self,
        result: Result<Message, CallError>,
        first: impl FnOnce(),
    ) -> bool {
        let (waker, sleepers, callback) = {
            let mut slot = self.lock();
            if slot.done {
                return false;
            }
            first();
            slot.done = true;
            let callback = slot.callback.0.take();
            let result = match callback {
                Some(callback) => Some((callback, result)),
                None => {
                    slot.result = Some(result);
                    None
                }
            };
            self.done.store(true, Ordering::Release);
            (slot.waker.take(), slot.sleepers, result)
        };
        // Outside the lock: a callback may complete other futures, or chain on this one.
        if let Some((callback, result)) = callback {
            callback(result);
        }
        if sleepers > 0 {
            self.ready.notify_all();
        }
        if let Some(waker) = waker {
            waker.wake();
        }
        true
    }

    pub(crate) fn is_done(&self) -> bool {
        self.lock().done
    }

    /// Whether anyone will see the result: a future still holds the cell (`self` is the
    /// agent's own reference), or a callback ([`RpcFuture::then`], the combinators) waits
    /// for it. A `remote()` call's cell has neither, and its reply can be dropped unread.
    pub(crate) fn is_wanted(self: &Arc<Self>) -> bool {
        Arc::strong_count(self) > 1 || self.lock().callback.0.is_some()
    }

    /// Whether the call completed, without the lock.
    pub(crate) fn is_done_relaxed(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Spins until the call completes or `limit` passes (then the caller sleeps on the
    /// condition variable). A reply that comes back within a few microseconds is seen
    /// without the wake-up of a sleeping thread, the largest cost left in a small call.
    fn spin_until_done(&self, limit: Duration) {
        if limit.is_zero() {
            return;
        }
        let start = std::time::Instant::now();
        let mut round = 0u32;
        while !self.done.load(Ordering::Acquire) {
            round = round.wrapping_add(1);
            if round.is_multiple_of(64) && start.elapsed() >= limit {
                return;
            }
            std::hint::spin_loop();
        }
    }
}

/// How long [`RpcFuture::wait`] spins before it sleeps, on hosts with more than one CPU.
const WAIT_SPIN: Duration = Duration::from_micros(50);

/// How long a thread waiting for a call's result spins before it sleeps: [`WAIT_SPIN`]
/// when the host has another CPU for the thread that completes the call, else none.
pub(crate) fn default_wait_spin() -> Duration {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    if cpus >= 2 {
        WAIT_SPIN
    } else {
        Duration::ZERO
    }
}

/// The result of [`rpc_async`](super::RpcAgent::rpc_async): wait for it with
/// [`wait`](RpcFuture::wait) from any thread, or `.await` it in any executor.
#[derive(Debug)]
#[must_use = "the call's result is only seen through the future"]
pub struct RpcFuture {
    cell: Arc<Completion>,
}

/// The error of a future whose result was taken already (polled after completion).
fn taken() -> CallError {
    UsageError::FutureTaken.into()
}

impl RpcFuture {
    #[cfg(test)]
    pub(crate) fn new() -> (RpcFuture, Arc<Completion>) {
        Self::with_spin(Duration::ZERO)
    }

    /// A future whose [`wait`](Self::wait) spins `spin` before sleeping.
    pub(crate) fn with_spin(spin: Duration) -> (RpcFuture, Arc<Completion>) {
        let cell = Arc::new(Completion {
            spin,
            ..Completion::default()
        });
        (
            RpcFuture {
                cell: Arc::clone(&cell),
            },
            cell,
        )
    }

    /// Whether the call has completed.
    pub fn is_done(&self) -> bool {
        self.cell.is_done()
    }

    /// Blocks until the call completes and returns its result.
    ///
    /// # Errors
    /// The call's [`CallError`].
    pub fn wait(self) -> Result<Message, CallError> {
        if !on_io_thread() {
            self.cell.spin_until_done(self.cell.spin);
        }
        self.wait_sleeping()
    }

    /// The completion cell.
    pub(crate) fn completion(&self) -> &Completion {
        &self.cell
    }

    /// [`wait`](Self::wait) without its spin (the caller spun already).
    pub(crate) fn wait_sleeping(self) -> Result<Message, CallError> {
        let mut slot = self.cell.lock();
        if !slot.done {
            if let Some(error) = blocking_on_io_thread() {
                return Err(error);
            }
        }
        while !slot.done {
            slot.sleepers += 1;
            slot = self
                .cell
                .ready
                .wait(slot)
                .unwrap_or_else(|p| p.into_inner());
            slot.sleepers -= 1;
        }
        slot.result.take().unwrap_or_else(|| Err(taken()))
    }

    /// Blocks until the call completes or `timeout` passes; gives the future back if it
    /// did not complete.
    ///
    /// # Errors
    /// `Err(self)` when `timeout` passed first.
    #[allow(clippy::result_large_err)]
    pub fn wait_timeout(self, timeout: Duration) -> Result<Result<Message, CallError>, RpcFuture> {
        if !self.is_done() {
            if let Some(error) = blocking_on_io_thread() {
                return Ok(Err(error));
            }
        }
        let result = {
            let mut slot = self.cell.lock();
            slot.sleepers += 1;
            let (mut slot, _) = self
                .cell
                .ready
                .wait_timeout_while(slot, timeout, |s| !s.done)
                .unwrap_or_else(|p| p.into_inner());
            slot.sleepers -= 1;
            if slot.done {
                Some(slot.result.take().unwrap_or_else(|| Err(taken())))
            } else {
                None
            }
        };
        result.ok_or(self)
    }
}

/// The completing half of [`RpcFuture::pending`]: whoever holds it answers the future
/// once. Dropping it unkept fails the future with [`UsageError::PromiseDropped`], so
/// that no waiter hangs.
#[derive(Debug)]
pub struct RpcPromise {
    cell: Option<Arc<Completion>>,
}

impl RpcPromise {
    /// Completes the future with `result` (on this thread: callbacks chained on the
    /// future, and an [`Async`](super::Async) handler's response, run here).
    pub fn complete(mut self, result: Result<Message, CallError>) {
        if let Some(cell) = self.cell.take() {
            cell.complete(result);
        }
    }
}

impl Drop for RpcPromise {
    fn drop(&mut self) {
        if let Some(cell) = self.cell.take() {
            cell.complete(Err(UsageError::PromiseDropped.into()));
        }
    }
}

impl RpcFuture {
    /// A future that the returned [`RpcPromise`] completes: for an
    /// [`Async`](super::Async) handler whose answer comes from outside the agent (a
    /// binding's own future, another thread).
    pub fn pending() -> (RpcFuture, RpcPromise) {
        let (future, cell) = Self::with_spin(default_wait_spin());
        (future, RpcPromise { cell: Some(cell) })
    }

    /// A future completed already with `result`.
    pub fn ready(result: Result<Message, CallError>) -> RpcFuture {
        let (future, cell) = Self::with_spin(Duration::ZERO);
        cell.complete(result);
        future
    }

    /// Hands the result to `callback` when the call completes: at once on this thread if
    /// it has, else on the thread that completes it.
    pub(crate) fn on_done(
        self,
        callback: impl FnOnce(Result<Message, CallError>) + Send + 'static,
    ) {
        let ready = {
            let mut slot = self.cell.lock();
            if slot.done {
                Some(slot.result.take().unwrap_or_else(|| Err(taken())))
            } else {
                slot.callback.0 = Some(Box::new(callback));
                return;
            }
        };
        if let Some(result) = ready {
            callback(result);
        }
    }

    /// `torch.futures.Future.then`: a future of what `callback` makes of this call's
    /// result (a value or an error, so a callback can recover from an error or turn a
    /// value into one). The callback runs once, when the call completes: on the thread
    /// that completes it (for a remote call, the agent's I/O or lane thread, so it must
    /// be short and must not block: a blocking wait there fails with
    /// [`UsageError::BlockingInline`]), or at once on this thread if the call has completed
    /// already. A panic in the callback fails the new future with
    /// [`UsageError::CallbackPanicked`].
    pub fn then<F>(self, callback: F) -> RpcFuture
    where
        F: FnOnce(Result<Message, CallError>) -> Result<Message, CallError> + Send + 'static,
    {
        let (next, cell) = Self::with_spin(self.cell.spin);
        self.on_done(move |result| {
            let outcome =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| callback(result)))
                    .unwrap_or_else(|panic| {
                        let what = panic
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| panic.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "a non-text panic".to_string());
                        Err(UsageError::CallbackPanicked { what }.into())
                    });
            cell.complete(outcome);
        });
        next
    }
}

/// `torch.futures.collect_all`: one future that completes when every one of `futures`
/// has, with each one's result in the same order (errors included: nothing is lost).
pub fn collect_all(futures: Vec<RpcFuture>) -> AllFuture {
    let shared = Arc::new(AllShared {
        state: Mutex::new(AllState {
            results: futures.iter().map(|_| None).collect(),
            left: futures.len(),
            waker: None,
        }),
        ready: Condvar::new(),
    });
    for (index, future) in futures.into_iter().enumerate() {
        let shared = Arc::clone(&shared);
        future.on_done(move |result| shared.put(index, result));
    }
    AllFuture { shared }
}

/// `torch.futures.wait_all`: waits until every one of `futures` completes and returns
/// their values in order.
///
/// # Errors
/// The error of the first future in `futures`' order that failed (every future is
/// waited for first, as in PyTorch).
pub fn wait_all(futures: Vec<RpcFuture>) -> Result<Vec<Message>, CallError> {
    collect_all(futures).wait().into_iter().collect()
}

#[derive(Debug)]
struct AllState {
    results: Vec<Option<Result<Message, CallError>>>,
    left: usize,
    waker: Option<Waker>,
}

#[derive(Debug)]
struct AllShared {
    state: Mutex<AllState>,
    ready: Condvar,
}

impl AllShared {
    fn lock(&self) -> MutexGuard<'_, AllState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn put(&self, index: usize, result: Result<Message, CallError>) {
        let waker = {
            let mut state = self.lock();
            if let Some(slot) = state.results.get_mut(index) {
                *slot = Some(result);
            }
            state.left = state.left.saturating_sub(1);
            if state.left > 0 {
                return;
            }
            state.waker.take()
        };
        self.ready.notify_all();
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    fn take(state: &mut AllState) -> Vec<Result<Message, CallError>> {
        state
            .results
            .iter_mut()
            .map(|r| r.take().unwrap_or_else(|| Err(taken())))
            .collect()
    }
}

/// The result of [`collect_all`]: every future's result, in order, once all completed.
/// Wait for it from any thread or `.await` it in any executor.
#[derive(Debug)]
#[must_use = "the results are only seen through the future"]
pub struct AllFuture {
    shared: Arc<AllShared>,
}

impl AllFuture {
    /// Whether every future has completed.
    pub fn is_done(&self) -> bool {
        self.shared.lock().left == 0
    }

    /// Blocks until every future completes; their results, in order. On an agent I/O
    /// thread (an inline handler) a wait that would block returns
    /// [`UsageError::BlockingInline`] for each unfinished future instead.
    pub fn wait(self) -> Vec<Result<Message, CallError>> {
        let mut state = self.shared.lock();
        if state.left > 0 && on_io_thread() {
            return state
                .results
                .iter_mut()
                .map(|r| r.take().unwrap_or(Err(UsageError::BlockingInline.into())))
                .collect();
        }
        while state.left > 0 {
            state = self
                .shared
                .ready
                .wait(state)
                .unwrap_or_else(|p| p.into_inner());
        }
        AllShared::take(&mut state)
    }
}

impl Future for AllFuture {
    type Output = Vec<Result<Message, CallError>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.shared.lock();
        if state.left == 0 {
            Poll::Ready(AllShared::take(&mut state))
        } else {
            state.waker = Some(cx.waker().clone());
            Poll::Pending
        }
    }
}

impl Future for RpcFuture {
    type Output = Result<Message, CallError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut slot = self.cell.lock();
        if slot.done {
            Poll::Ready(slot.result.take().unwrap_or_else(|| Err(taken())))
        } else {
            slot.waker = Some(cx.waker().clone());
            Poll::Pending
        }
    }
}

#[cfg(test)]
mod tests;
