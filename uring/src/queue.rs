//! One queue between threads and executor tasks, used wherever the runtime hands work
//! or data across: the RPC agent's command mailbox, the shm transport's frame and
//! message queues, and `rdzv-rdma`'s ibv link.
//!
//! A [`Queue`] has any number of producers. Consumers take items with a blocking pop (a
//! thread), an async pop (a task on an executor: the waker is kept and woken from any
//! thread), a non-blocking pop, or all at once. Closing refuses pushes; pops drain what is
//! left, then see the end. Threads that wait are counted, so a push or close costs no
//! system call when nobody sleeps on the condition variable.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

struct State<T> {
    items: VecDeque<T>,
    waker: Option<Waker>,
    closed: bool,
    /// Threads blocked on `changed` (signalled only when there are).
    sleepers: usize,
    /// Set by [`Queue::kick`]: the next [`Queue::wait_ready`] returns at once.
    kicked: bool,
}

/// A queue between threads and one executor task (see the module documentation).
pub struct Queue<T> {
    state: Mutex<State<T>>,
    changed: Condvar,
    /// [`push_blocking`](Queue::push_blocking) waits while this many items are queued.
    bound: usize,
    closed: AtomicBool,
}

impl<T> std::fmt::Debug for Queue<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("len", &self.len())
            .field("closed", &self.is_closed())
            .finish()
    }
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Queue::unbounded()
    }
}

impl<T> Queue<T> {
    /// An open queue whose [`push_blocking`](Self::push_blocking) waits while `bound`
    /// items are queued (at least 1).
    pub fn new(bound: usize) -> Queue<T> {
        Queue {
            state: Mutex::new(State {
                items: VecDeque::new(),
                waker: None,
                closed: false,
                sleepers: 0,
                kicked: false,
            }),
            changed: Condvar::new(),
            bound: bound.max(1),
            closed: AtomicBool::new(false),
        }
    }

    /// An open queue without a bound.
    pub fn unbounded() -> Queue<T> {
        Queue::new(usize::MAX)
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Releases `state` and wakes the task and the threads waiting on it.
    fn signal(&self, mut state: MutexGuard<'_, State<T>>) {
        let waker = state.waker.take();
        let sleeping = state.sleepers > 0;
        drop(state);
        if let Some(waker) = waker {
            waker.wake();
        }
        if sleeping {
            self.changed.notify_all();
        }
    }

    /// Releases `state` after a pop and wakes the threads waiting on it (a pusher
    /// waiting for room); the consumer's task is the one popping.
    fn signal_threads(&self, state: MutexGuard<'_, State<T>>) {
        let sleeping = state.sleepers > 0;
        drop(state);
        if sleeping {
            self.changed.notify_all();
        }
    }

    /// Waits on the condition variable once (counted as a sleeper).
    fn sleep<'a>(
        &self,
        mut state: MutexGuard<'a, State<T>>,
        deadline: Option<Instant>,
    ) -> MutexGuard<'a, State<T>> {
        state.sleepers += 1;
        let mut state = match deadline {
            None => self
                .changed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner),
            Some(deadline) => {
                let left = deadline.saturating_duration_since(Instant::now());
                self.changed
                    .wait_timeout(state, left)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0
            }
        };
        state.sleepers -= 1;
        state
    }

    /// Appends `item` (even past the bound); gives it back once closed.
    pub fn push(&self, item: T) -> Result<(), T> {
        let mut state = self.lock();
        if state.closed {
            return Err(item);
        }
        state.items.push_back(item);
        self.signal(state);
        Ok(())
    }

    /// Appends `item`, waiting while the queue holds its bound; gives it back once
    /// closed.
    pub fn push_blocking(&self, item: T) -> Result<(), T> {
        let mut state = self.lock();
        while !state.closed && state.items.len() >= self.bound {
            state = self.sleep(state, None);
        }
        if state.closed {
            return Err(item);
        }
        state.items.push_back(item);
        self.signal(state);
        Ok(())
    }

    /// The next item, if one is there.
    pub fn try_pop(&self) -> Option<T> {
        let mut state = self.lock();
        let item = state.items.pop_front();
        if item.is_some() {
            // Room for a blocked pusher.
            self.signal_threads(state);
        }
        item
    }

    /// The next item, blocking the calling thread until one comes; `None` once closed
    /// and drained.
    pub fn pop_blocking(&self) -> Option<T> {
        let mut state = self.lock();
        loop {
            if let Some(item) = state.items.pop_front() {
                self.signal_threads(state);
                return Some(item);
            }
            if state.closed {
                return None;
            }
            state = self.sleep(state, None);
        }
    }

    /// The next item, as a future for an executor's task; `None` once closed and
    /// drained.
    pub fn pop(&self) -> impl Future<Output = Option<T>> + '_ {
        Pop { queue: self }
    }

    /// Everything queued, as a future that waits until something is (or the queue is
    /// closed: then what is left, possibly nothing).
    pub fn pop_all(&self) -> impl Future<Output = VecDeque<T>> + '_ {
        PopAll { queue: self }
    }

    /// Blocks until an item is waiting, the queue is closed, [`kick`](Self::kick) was
    /// called, or `timeout` passed; takes nothing.
    pub fn wait_ready(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut state = self.lock();
        while state.items.is_empty() && !state.closed && !state.kicked {
            if Instant::now() >= deadline {
                break;
            }
            state = self.sleep(state, Some(deadline));
        }
        state.kicked = false;
    }

    /// Wakes a thread in [`wait_ready`](Self::wait_ready) (or makes the next call return
    /// at once).
    pub fn kick(&self) {
        let mut state = self.lock();
        state.kicked = true;
        self.signal(state);
    }

    /// Refuses further pushes and wakes every waiter.
    pub fn close(&self) {
        let mut state = self.lock();
        state.closed = true;
        self.closed.store(true, Ordering::Release);
        self.signal(state);
    }

    /// Closes the queue and takes what was still in it.
    pub fn close_and_take(&self) -> VecDeque<T> {
        let mut state = self.lock();
        state.closed = true;
        self.closed.store(true, Ordering::Release);
        let items = std::mem::take(&mut state.items);
        self.signal(state);
        items
    }

    /// Whether it was closed.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Items waiting.
    pub fn len(&self) -> usize {
        self.lock().items.len()
    }

    /// Whether no item is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether nothing is waiting and the queue is open: the next push will signal.
    pub fn is_idle(&self) -> bool {
        let state = self.lock();
        state.items.is_empty() && !state.closed
    }
}

/// Runs blocking `work` on a new thread named `name` and waits for its result without
/// blocking the executor (a connect that may take seconds, say).
///
/// # Errors
/// The thread could not be started, or it ended without a result (it panicked).
pub async fn on_thread<T: Send + 'static>(
    name: &str,
    work: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<T> {
    /// Closes the queue when the thread ends, result or panic.
    struct CloseOnDrop<T>(std::sync::Arc<Queue<T>>);
    impl<T> Drop for CloseOnDrop<T> {
        fn drop(&mut self) {
            self.0.close();
        }
    }
    let done = std::sync::Arc::new(Queue::new(1));
    let thread_done = CloseOnDrop(std::sync::Arc::clone(&done));
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            let _ = thread_done.0.push(work());
        })?;
    let result = done.pop().await;
    result.ok_or_else(|| std::io::Error::other(format!("the {name} thread stopped")))
}

struct Pop<'a, T> {
    queue: &'a Queue<T>,
}

impl<T> Future for Pop<'_, T> {
    type Output = Option<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let mut state = self.queue.lock();
        if let Some(item) = state.items.pop_front() {
            self.queue.signal_threads(state);
            return Poll::Ready(Some(item));
        }
        if state.closed {
            return Poll::Ready(None);
        }
        state.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

struct PopAll<'a, T> {
    queue: &'a Queue<T>,
}

impl<T> Future for PopAll<'_, T> {
    type Output = VecDeque<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<VecDeque<T>> {
        let mut state = self.queue.lock();
        if !state.items.is_empty() || state.closed {
            let items = std::mem::take(&mut state.items);
            self.queue.signal_threads(state);
            return Poll::Ready(items);
        }
        state.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn block_on<F: Future>(future: F) -> F::Output {
        futures_lite::future::block_on(future)
    }

    #[test]
    fn work_on_a_thread_comes_back() {
        assert_eq!(block_on(on_thread("rdzv-test", || 6 * 7)).ok(), Some(42));
        let died = block_on(on_thread("rdzv-test", || -> u8 { panic!("boom") }));
        assert!(died.is_err_and(|e| e.to_string().contains("rdzv-test")));
    }

    #[test]
    fn drains_after_close_and_refuses_pushes() {
        let queue = Queue::unbounded();
        assert!(queue.push(1).is_ok());
        assert!(queue.push(2).is_ok());
        queue.close();
        assert_eq!(queue.push(3), Err(3));
        assert_eq!(block_on(queue.pop()), Some(1));
        assert_eq!(queue.pop_blocking(), Some(2));
        assert_eq!(block_on(queue.pop()), None);
        assert_eq!(queue.pop_blocking(), None);
        assert!(block_on(queue.pop_all()).is_empty());
    }

    #[test]
    fn blocking_pushes_wait_for_room_and_pops_for_items() {
        let queue = Arc::new(Queue::new(1));
        assert!(queue.push_blocking(0).is_ok());
        let producer = {
            let queue = Arc::clone(&queue);
            std::thread::spawn(move || (1..100).all(|i| queue.push_blocking(i).is_ok()))
        };
        let got: Vec<i32> = (0..100).filter_map(|_| queue.pop_blocking()).collect();
        assert_eq!(got, (0..100).collect::<Vec<_>>());
        assert!(producer.join().unwrap_or(false));
        // A pusher blocked on a full queue is released by close.
        assert!(queue.push_blocking(7).is_ok());
        let blocked = {
            let queue = Arc::clone(&queue);
            std::thread::spawn(move || queue.push_blocking(8))
        };
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(queue.close_and_take(), VecDeque::from([7]));
        assert_eq!(blocked.join().ok(), Some(Err(8)));
    }

    #[test]
    fn wait_ready_returns_on_an_item_a_kick_or_the_timeout() {
        let queue = Arc::new(Queue::unbounded());
        assert!(queue.is_idle());
        let started = Instant::now();
        queue.wait_ready(Duration::from_millis(30));
        assert!(started.elapsed() >= Duration::from_millis(30));
        queue.kick();
        let started = Instant::now();
        queue.wait_ready(Duration::from_secs(10));
        assert!(started.elapsed() < Duration::from_secs(5));
        let pusher = {
            let queue = Arc::clone(&queue);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                queue.push(5)
            })
        };
        queue.wait_ready(Duration::from_secs(10));
        assert_eq!(pusher.join().ok(), Some(Ok(())));
        assert!(!queue.is_idle());
        assert_eq!(block_on(queue.pop_all()), VecDeque::from([5]));
        assert_eq!(queue.try_pop(), None);
    }
}
