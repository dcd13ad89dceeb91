//! An io_uring whose operations own what the kernel touches: the store server's loop
//! (`server::direct`) submits receives, sends, accepts and polls through it.
//!
//! The `io-uring` crate's `push` is `unsafe` because the kernel reads or writes the
//! buffers an entry points to until its completion is reaped, whatever Rust does with
//! them meanwhile. [`Ring`] makes that a matter of ownership (as tokio-uring does): an
//! operation takes the buffer *by value*, and the file descriptor as a shared
//! [`Arc<OwnedFd>`], keeps both in a slot of its own, and hands the buffer back only in
//! the [`Completion`] of that operation. Safe code therefore cannot read, resize, move
//! the bytes of, or free a buffer the kernel may still write, nor close a descriptor an
//! operation still names. A cancelled operation keeps its buffer until its completion
//! (`-ECANCELED` or not) arrives; a ring dropped with operations still in flight leaks
//! their buffers and descriptors rather than free memory the kernel may still write.
//!
//! The kernel only ever touches the heap bytes of a `Vec<u8>` (through [`RecvBuf`] and
//! [`SendBuf`]): moving the owner, or the slot that holds it, never moves them.
//!
//! Provided buffers ([`Ring::provide_buffers`], kernel 5.19): a pool the ring owns, from
//! which the kernel picks a buffer for each chunk a multishot receive
//! ([`Ring::recv_multi`], kernel 6.0) delivers. A [`Chunk`] names the buffer the kernel
//! handed out; its bytes are read through [`Ring::chunk`] and the buffer goes back to
//! the kernel only through [`Ring::recycle`], which takes the `Chunk` by value: so safe
//! code cannot read a buffer the kernel may be writing. The pool is freed only when no
//! operation is in flight (and leaked otherwise, as buffers are).
//!
//! This module decides nothing about connections, requests or shutdown: that is the
//! caller's loop.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;
use std::time::Duration;

use io_uring::{cqueue, opcode, squeue, types, IoUring};

/// A buffer a receive fills: the kernel writes into `vec[start..vec.len()]` of the
/// vector [`recv_into`](RecvBuf::recv_into) returns (initialised bytes, so the vector's
/// length never changes). The ring owns the value until the completion.
///
/// Implementations return a vector the value owns (the `&mut` borrow of `self` makes
/// that so for any safe implementation); `'static` keeps borrowed memory out.
pub(crate) trait RecvBuf: Send + 'static {
    /// The vector to receive into and where in it the received bytes start.
    fn recv_into(&mut self) -> (&mut Vec<u8>, usize);
}

/// A buffer a send reads: `vec[start..]` of the vector [`send_from`](SendBuf::send_from)
/// returns. The ring owns the value until the completion.
pub(crate) trait SendBuf: Send + 'static {
    /// The vector to send from and the offset of the first byte to send.
    fn send_from(&self) -> (&Vec<u8>, usize);
}

/// Names one submitted operation, to cancel it. A stale id (its operation completed and
/// the slot was reused) cancels nothing: the slot's generation no longer matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OpId {
    index: u32,
    generation: u32,
}

impl OpId {
    fn user_data(self) -> u64 {
        (u64::from(self.generation) << 32) | u64::from(self.index)
    }

    fn from_user_data(data: u64) -> OpId {
        OpId {
            index: data as u32,
            generation: (data >> 32) as u32,
        }
    }
}

/// The user data of cancel requests: their completions are swallowed. (An operation's
/// user data never has it: generations wrap before `u32::MAX` only after 2^32 reuses of
/// one slot, and the index would have to be `u32::MAX` too, which the slab never
/// reaches.)
const CANCEL: u64 = u64::MAX;

/// A finished operation, with what it owned. (`repr(u8)`: a tag byte of its own, so
/// that matching one reads a byte rather than decoding a buffer's capacity niche.)
#[derive(Debug)]
#[repr(u8)]
pub(crate) enum Completion<R, S> {
    /// An accept: the new connection's descriptor, close-on-exec.
    Accepted {
        /// The new descriptor, or why the accept failed (`ECANCELED` when cancelled).
        result: io::Result<OwnedFd>,
        /// A multishot accept goes on (more completions of it will come); false for a
        /// one-shot accept, and for a multishot one's last completion.
        more: bool,
    },
    /// A receive: how many bytes were written at the buffer's start offset (at most the
    /// room it had; 0 is the end of the stream), and the buffer back.
    Received {
        /// The caller's token.
        token: usize,
        /// Bytes received, or why the receive failed.
        result: io::Result<usize>,
        /// The buffer, the kernel done with it.
        buf: R,
    },
    /// A send: how many bytes went out, and the buffer back.
    Sent {
        /// The caller's token.
        token: usize,
        /// Bytes sent, or why the send failed.
        result: io::Result<usize>,
        /// The buffer, the kernel done with it.
        buf: S,
    },
    /// A poll for readability.
    Polled {
        /// Ready, or why the poll failed.
        result: io::Result<()>,
    },
    /// A multishot receive delivered a chunk (`Some`, in a provided buffer: read it with
    /// [`Ring::chunk`], give it back with [`Ring::recycle`]), reached the end of the
    /// stream (`None`), or failed (`ENOBUFS` when the pool was empty).
    Arrived {
        /// The caller's token.
        token: usize,
        /// The chunk, the end of the stream, or why the receive stopped.
        result: io::Result<Option<Chunk>>,
        /// The receive goes on (more completions of it will come); when false it is
        /// over, and must be submitted again to read more.
        more: bool,
    },
}

/// Bytes a multishot receive put in one of the ring's provided buffers. Not `Clone`:
/// [`Ring::recycle`] consumes it, and only then may the kernel write the buffer again.
/// One that is dropped instead takes its buffer out of the pool (never unsafe).
#[derive(Debug)]
#[must_use = "a chunk's buffer returns to the kernel only through Ring::recycle"]
pub(crate) struct Chunk {
    /// The pool it came from (a chunk of another ring's pool reads as empty).
    pool: usize,
    bid: u16,
    len: u32,
}

impl Chunk {
    /// Bytes received into it.
    pub(crate) fn len(&self) -> usize {
        self.len as usize
    }
}

/// One entry of a provided-buffer ring, as the kernel reads it (`struct io_uring_buf`);
/// the `resv` field of entry 0 is the ring's tail.
#[repr(C)]
struct BufEntry {
    addr: u64,
    len: u32,
    bid: u16,
    resv: u16,
}

/// The buffer group the pool is registered as.
const POOL_GROUP: u16 = 0;
/// Alignment of the entries (the kernel wants them page-aligned) and of the buffers.
const POOL_ALIGN: usize = 4096;

/// A provided-buffer ring registered with the kernel: `count` entries and `count`
/// buffers of `size` bytes. Buffer `bid` is the kernel's from the moment it is published
/// (by the tail) until a completion names it, then the caller's until recycled.
struct Pool {
    entries: NonNull<BufEntry>,
    buffers: NonNull<u8>,
    count: u16,
    size: usize,
    /// The tail the kernel was last told.
    tail: u16,
}

impl Pool {
    fn layouts(count: u16, size: usize) -> Option<(std::alloc::Layout, std::alloc::Layout)> {
        let entries = std::alloc::Layout::from_size_align(
            usize::from(count) * std::mem::size_of::<BufEntry>(),
            POOL_ALIGN,
        )
        .ok()?;
        let buffers =
            std::alloc::Layout::from_size_align(usize::from(count).checked_mul(size)?, POOL_ALIGN)
                .ok()?;
        Some((entries, buffers))
    }

    /// Allocates the entries and buffers and registers them with `ring`; every buffer
    /// is the kernel's afterwards.
    fn new(ring: &IoUring, count: u16, size: usize) -> io::Result<Pool> {
        let invalid = || io::Error::from(io::ErrorKind::InvalidInput);
        if !count.is_power_of_two() || size == 0 || u32::try_from(size).is_err() {
            return Err(invalid());
        }
        let (entries_layout, buffers_layout) = Pool::layouts(count, size).ok_or_else(invalid)?;
        // SAFETY: both layouts have a non-zero size (count >= 1, size >= 1).
        let entries = NonNull::new(unsafe { std::alloc::alloc_zeroed(entries_layout) })
            .ok_or(io::ErrorKind::OutOfMemory)?;
        // SAFETY: as above.
        let Some(buffers) = NonNull::new(unsafe { std::alloc::alloc_zeroed(buffers_layout) })
        else {
            // SAFETY: allocated just above with this layout, never shared.
            unsafe { std::alloc::dealloc(entries.as_ptr(), entries_layout) };
            return Err(io::ErrorKind::OutOfMemory.into());
        };
        let mut pool = Pool {
            entries: entries.cast(),
            buffers,
            count,
            size,
            tail: 0,
        };
        // SAFETY: `entries` is page-aligned memory for `count` entries, owned by the pool
        // until it is unregistered (`Ring`'s drop unregisters it before freeing it, or
        // leaks it while operations are in flight).
        let registered = unsafe {
            ring.submitter().register_buf_ring_with_flags(
                pool.entries.as_ptr() as u64,
                count,
                POOL_GROUP,
                0,
            )
        };
        if let Err(error) = registered {
            pool.free();
            return Err(error);
        }
        for bid in 0..count {
            pool.push(bid);
        }
        pool.publish();
        Ok(pool)
    }

    /// Queues buffer `bid` at the tail (not yet visible to the kernel: see `publish`).
    fn push(&mut self, bid: u16) {
        let index = usize::from(self.tail & (self.count - 1));
        let addr = self.buffers.as_ptr() as u64 + u64::from(bid) * self.size as u64;
        // SAFETY: `index < count`, inside the entries allocation. The entry is past the
        // tail the kernel knows, so the kernel does not read it now; only its `addr`,
        // `len` and `bid` fields are written, never `resv` (entry 0's holds the tail).
        unsafe {
            let entry = self.entries.as_ptr().add(index);
            std::ptr::addr_of_mut!((*entry).addr).write(addr);
            std::ptr::addr_of_mut!((*entry).len).write(self.size as u32);
            std::ptr::addr_of_mut!((*entry).bid).write(bid);
        }
        self.tail = self.tail.wrapping_add(1);
    }

    /// Tells the kernel the new tail: the entries pushed so far are its now.
    fn publish(&self) {
        // SAFETY: the tail is the `resv` field of entry 0, a u16 inside the entries
        // allocation, aligned for an AtomicU16, which the kernel only reads (with an
        // acquire load); this release store makes the entries written before visible.
        let tail =
            unsafe { AtomicU16::from_ptr(std::ptr::addr_of_mut!((*self.entries.as_ptr()).resv)) };
        tail.store(self.tail, Ordering::Release);
    }

    fn id(&self) -> usize {
        self.buffers.as_ptr() as usize
    }

    /// The bytes of a chunk the kernel handed out.
    fn bytes(&self, chunk: &Chunk) -> &[u8] {
        if chunk.pool != self.id() || chunk.bid >= self.count {
            return &[];
        }
        let len = (chunk.len as usize).min(self.size);
        // SAFETY: buffer `bid` is inside the buffers allocation (`bid < count`) and
        // `len <= size`. The kernel finished writing it before posting the completion
        // that made this chunk (read with acquire ordering), and will not write it again
        // until `recycle` consumes the chunk, which needs `&mut` of the ring while this
        // borrow of it lives.
        unsafe {
            std::slice::from_raw_parts(
                self.buffers
                    .as_ptr()
                    .add(usize::from(chunk.bid) * self.size),
                len,
            )
        }
    }

    /// Frees the memory (the caller made sure the kernel no longer knows it).
    fn free(self) {
        if let Some((entries, buffers)) = Pool::layouts(self.count, self.size) {
            // SAFETY: both were allocated in `new` with these layouts, and the kernel
            // no longer uses them (the caller's guarantee).
            unsafe {
                std::alloc::dealloc(self.entries.as_ptr().cast(), entries);
                std::alloc::dealloc(self.buffers.as_ptr(), buffers);
            }
        }
    }
}

// SAFETY: the pool's memory is owned by the pool alone (the kernel aside); moving it to
// another thread moves that ownership.
unsafe impl Send for Pool {}

/// What an in-flight operation owns (`repr(u8)`: see [`Completion`]).
#[repr(u8)]
enum Held<R, S> {
    Free,
    Accept {
        _fd: Arc<OwnedFd>,
    },
    Recv {
        token: usize,
        _fd: Arc<OwnedFd>,
        buf: R,
        /// The room the kernel was given (a receive result is clamped to it).
        room: usize,
    },
    Send {
        token: usize,
        _fd: Arc<OwnedFd>,
        buf: S,
        len: usize,
    },
    Poll {
        _fd: Arc<OwnedFd>,
    },
    /// A multishot accept: held until its last completion.
    AcceptMulti {
        _fd: Arc<OwnedFd>,
    },
    /// A multishot receive into the pool: held until its last completion.
    RecvMulti {
        token: usize,
        _fd: Arc<OwnedFd>,
    },
}

struct Slot<R, S> {
    generation: u32,
    held: Held<R, S>,
}

/// An io_uring that owns its operations' buffers and descriptors until they complete.
pub(crate) struct Ring<R: RecvBuf, S: SendBuf> {
    ring: IoUring,
    slots: Vec<Slot<R, S>>,
    free: Vec<u32>,
    in_flight: usize,
    /// Entries that did not fit the submission queue, in order; pushed before any newer
    /// entry.
    backlog: std::collections::VecDeque<squeue::Entry>,
    /// Completions reaped while making room (a full completion queue), not yet handed
    /// out.
    stashed: std::collections::VecDeque<Completion<R, S>>,
    /// Scratch for the completion queue's entries (user data, result, flags).
    cqes: Vec<(u64, i32, u32)>,
    /// Provided buffers for multishot receives, once [`Ring::provide_buffers`] made them.
    pool: Option<Pool>,
    /// Made with one issuer and deferred task work (Linux 6.1), and disabled until
    /// [`Ring::start_here`]: see [`Ring::new`].
    deferred: bool,
}

impl<R: RecvBuf, S: SendBuf> Ring<R, S> {
    /// A ring with `sq_entries` submission and `cq_entries` completion entries.
    ///
    /// Where the kernel has them (Linux 6.1), the ring has one issuer and defers its
    /// completions' task work to the issuer's own waits (`IORING_SETUP_SINGLE_ISSUER`,
    /// `DEFER_TASKRUN`, `TASKRUN_FLAG`): a packet that arrives while the loop runs does
    /// not interrupt it, and the loop runs the work of a whole batch in its next
    /// `io_uring_enter`. Such a ring starts disabled, so that the thread that made it
    /// is not its issuer: the thread that uses it calls [`Ring::start_here`] first.
    /// Elsewhere the ring is a plain one, and `start_here` does nothing.
    pub(crate) fn new(sq_entries: u32, cq_entries: u32) -> io::Result<Self> {
        let deferred = IoUring::builder()
            .setup_cqsize(cq_entries)
            .setup_single_issuer()
            .setup_defer_taskrun()
            .setup_taskrun_flag()
            .setup_r_disabled()
            .build(sq_entries);
        let (ring, deferred) = match deferred {
            Ok(ring) => (ring, true),
            // An older kernel refuses the flags it lacks.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => (
                IoUring::builder()
                    .setup_cqsize(cq_entries)
                    .build(sq_entries)?,
                false,
            ),
            Err(e) => return Err(e),
        };
        Ok(Ring {
            ring,
            slots: Vec::new(),
            free: Vec::new(),
            in_flight: 0,
            backlog: std::collections::VecDeque::new(),
            stashed: std::collections::VecDeque::new(),
            cqes: Vec::new(),
            pool: None,
            deferred,
        })
    }

    /// Makes the calling thread the ring's only issuer and enables it (a ring made with
    /// deferred task work, [`Ring::new`]); nothing for a plain ring. Call it once, on the
    /// thread that submits, before anything else.
    pub(crate) fn start_here(&mut self) -> io::Result<()> {
        if self.deferred {
            self.ring.submitter().register_enable_rings()?;
        }
        Ok(())
    }

    /// Whether the ring defers task work to its issuer's waits (Linux 6.1).
    pub(crate) fn deferred(&self) -> bool {
        self.deferred
    }

    /// Registers a pool of `count` (a power of two) provided buffers of `size` bytes for
    /// [`Ring::recv_multi`]. Fails where the kernel has no provided-buffer rings (before
    /// 5.19); the ring is unchanged then.
    pub(crate) fn provide_buffers(&mut self, count: u16, size: usize) -> io::Result<()> {
        if self.pool.is_some() {
            return Err(io::ErrorKind::AlreadyExists.into());
        }
        self.pool = Some(Pool::new(&self.ring, count, size)?);
        Ok(())
    }

    /// Bytes of the pool (0 without one).
    #[cfg(test)]
    fn pool_bytes(&self) -> usize {
        self.pool
            .as_ref()
            .map_or(0, |pool| usize::from(pool.count) * pool.size)
    }

    /// Receives from `fd` into provided buffers until cancelled, the end of the stream,
    /// an error or an empty pool: each chunk comes as a [`Completion::Arrived`]. `None`
    /// without a pool. (Kernels before 6.0 fail it with `EINVAL`.)
    pub(crate) fn recv_multi(&mut self, fd: &Arc<OwnedFd>, token: usize) -> Option<OpId> {
        self.pool.as_ref()?;
        let entry = opcode::RecvMulti::new(types::Fd(fd.as_raw_fd()), POOL_GROUP).build();
        Some(self.submit_held(
            entry,
            Held::RecvMulti {
                token,
                _fd: Arc::clone(fd),
            },
        ))
    }

    /// The bytes of `chunk` (empty for a chunk of another ring).
    pub(crate) fn chunk(&self, chunk: &Chunk) -> &[u8] {
        self.pool.as_ref().map_or(&[], |pool| pool.bytes(chunk))
    }

    /// Gives `chunk`'s buffer back to the kernel.
    #[inline(always)]
    pub(crate) fn recycle(&mut self, chunk: Chunk) {
        if let Some(pool) = self.pool.as_mut() {
            if chunk.pool == pool.id() && chunk.bid < pool.count {
                pool.push(chunk.bid);
                pool.publish();
            }
        }
    }

    /// Operations submitted (or queued) whose completion has not been handed out.
    #[cfg(test)]
    fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Accepts a connection on `listener` (close-on-exec, the peer's address not asked
    /// for).
    pub(crate) fn accept(&mut self, listener: &Arc<OwnedFd>) -> OpId {
        let entry = opcode::Accept::new(
            types::Fd(listener.as_raw_fd()),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
        .flags(libc::SOCK_CLOEXEC)
        .build();
        self.submit_held(
            entry,
            Held::Accept {
                _fd: Arc::clone(listener),
            },
        )
    }

    /// Accepts on `listener` until cancelled or a failure (Linux 5.19): each connection
    /// comes as a [`Completion::Accepted`] with `more` set, the last one (a failure, or
    /// `ECANCELED`) without. Kernels before 5.19 fail it at once with `EINVAL`.
    pub(crate) fn accept_multi(&mut self, listener: &Arc<OwnedFd>) -> OpId {
        let entry = opcode::AcceptMulti::new(types::Fd(listener.as_raw_fd()))
            .flags(libc::SOCK_CLOEXEC)
            .build();
        self.submit_held(
            entry,
            Held::AcceptMulti {
                _fd: Arc::clone(listener),
            },
        )
    }

    /// Receives from `fd` into `buf` (see [`RecvBuf`]); `buf` comes back in the
    /// [`Completion::Received`] of this operation.
    pub(crate) fn recv(&mut self, fd: &Arc<OwnedFd>, mut buf: R, token: usize) -> OpId {
        let (vec, start) = buf.recv_into();
        let start = start.min(vec.len());
        let room = vec.len() - start;
        let len = u32::try_from(room).unwrap_or(u32::MAX);
        // `start <= len`, so this is in bounds (one past the end when there is no room,
        // which the kernel then never writes).
        let ptr = vec[start..].as_mut_ptr();
        let entry = opcode::Recv::new(types::Fd(fd.as_raw_fd()), ptr, len).build();
        self.submit_held(
            entry,
            Held::Recv {
                token,
                _fd: Arc::clone(fd),
                buf,
                room: len as usize,
            },
        )
    }

    /// Sends from `buf` (see [`SendBuf`]) on `fd`, without `SIGPIPE`; `buf` comes back
    /// in the [`Completion::Sent`] of this operation.
    pub(crate) fn send(&mut self, fd: &Arc<OwnedFd>, buf: S, token: usize) -> OpId {
        let (vec, start) = buf.send_from();
        let rest = vec.get(start..).unwrap_or_default();
        let len = u32::try_from(rest.len()).unwrap_or(u32::MAX);
        let entry = opcode::Send::new(types::Fd(fd.as_raw_fd()), rest.as_ptr(), len)
            .flags(libc::MSG_NOSIGNAL)
            .build();
        self.submit_held(
            entry,
            Held::Send {
                token,
                _fd: Arc::clone(fd),
                buf,
                len: len as usize,
            },
        )
    }

    /// Polls `fd` until it is readable (one shot).
    pub(crate) fn poll_readable(&mut self, fd: &Arc<OwnedFd>) -> OpId {
        let entry = opcode::PollAdd::new(types::Fd(fd.as_raw_fd()), libc::POLLIN as u32).build();
        self.submit_held(
            entry,
            Held::Poll {
                _fd: Arc::clone(fd),
            },
        )
    }

    /// Asks the kernel to cancel `op`. Its completion still comes (usually with
    /// `ECANCELED`), and with it the buffer: until then the kernel may write it. Does
    /// nothing if `op` already completed.
    pub(crate) fn cancel(&mut self, op: OpId) {
        let live = self.slots.get(op.index as usize).is_some_and(|slot| {
            slot.generation == op.generation && !matches!(slot.held, Held::Free)
        });
        if live {
            let entry = opcode::AsyncCancel::new(op.user_data())
                .build()
                .user_data(CANCEL);
            self.push(entry);
        }
    }

    /// Submits what is queued without waiting; no system call when nothing is queued
    /// and no deferred task work waits (the completion queue is in shared memory and
    /// [`reap`](Ring::reap) reads it; the kernel flags deferred work in the submission
    /// queue, and the call then runs it).
    pub(crate) fn submit(&mut self) -> io::Result<()> {
        self.flush_backlog()?;
        let idle = {
            let queue = self.ring.submission();
            queue.is_empty() && !queue.taskrun()
        };
        if idle {
            return Ok(());
        }
        tolerate(self.ring.submit().map(drop))
    }

    /// Submits what is queued and waits for one completion, or `timeout`, or a signal.
    pub(crate) fn submit_and_wait(&mut self, timeout: Duration) -> io::Result<()> {
        self.flush_backlog()?;
        let timeout = types::Timespec::from(timeout);
        let args = types::SubmitArgs::new().timespec(&timeout);
        tolerate(self.ring.submitter().submit_with_args(1, &args).map(drop))
    }

    /// The next completion there is, if any (in order): what [`Ring::reap`] would move
    /// first, without a batch in between.
    #[inline]
    pub(crate) fn next_completion(&mut self) -> Option<Completion<R, S>> {
        if let Some(done) = self.stashed.pop_front() {
            return Some(done);
        }
        loop {
            let (data, result, flags) = {
                let cqe = self.ring.completion().next()?;
                (cqe.user_data(), cqe.result(), cqe.flags())
            };
            if let Some(done) = self.finish(data, result, flags) {
                return Some(done);
            }
        }
    }

    /// Moves every completion there is into `out` (in order); returns how many.
    #[cfg(test)]
    fn reap(&mut self, out: &mut Vec<Completion<R, S>>) -> usize {
        let before = out.len();
        while let Some(done) = self.next_completion() {
            out.push(done);
        }
        out.len() - before
    }

    /// Moves the completion queue's entries into `out` (to make room in it).
    fn reap_queue(&mut self, out: &mut std::collections::VecDeque<Completion<R, S>>) {
        let mut cqes = std::mem::take(&mut self.cqes);
        loop {
            // Copied out first: the queue borrows the ring, `finish` the slots.
            cqes.extend(
                self.ring
                    .completion()
                    .map(|cqe| (cqe.user_data(), cqe.result(), cqe.flags())),
            );
            if cqes.is_empty() {
                break;
            }
            for (data, result, flags) in cqes.drain(..) {
                if let Some(done) = self.finish(data, result, flags) {
                    out.push_back(done);
                }
            }
        }
        self.cqes = cqes;
    }

    /// Takes the slot of a completed operation and builds its completion. Inlined
    /// into the loop that reaps, so that the completion is built where it is matched.
    #[inline(always)]
    fn finish(&mut self, data: u64, result: i32, flags: u32) -> Option<Completion<R, S>> {
        if data == CANCEL {
            return None;
        }
        let op = OpId::from_user_data(data);
        let slot = self.slots.get_mut(op.index as usize)?;
        if slot.generation != op.generation {
            return None;
        }
        let error = || io::Error::from_raw_os_error(result.saturating_neg());
        if let Held::AcceptMulti { .. } = slot.held {
            let more = cqueue::more(flags);
            if !more {
                self.release_slot(op);
            }
            return Some(Completion::Accepted {
                result: if result < 0 {
                    Err(error())
                } else {
                    Ok(adopt_accepted(result))
                },
                more,
            });
        }
        if let Held::RecvMulti { token, .. } = slot.held {
            let more = cqueue::more(flags);
            let chunk = match (cqueue::buffer_select(flags), self.pool.as_ref()) {
                (Some(bid), Some(pool)) => Some(Chunk {
                    pool: pool.id(),
                    bid,
                    len: u32::try_from(result.max(0)).unwrap_or(0),
                }),
                _ => None,
            };
            let result = match chunk {
                // A buffer is the caller's whatever the result says.
                Some(chunk) if result >= 0 => Ok(Some(chunk)),
                Some(chunk) => {
                    self.recycle(chunk);
                    Err(error())
                }
                None if result == 0 => Ok(None),
                None if result < 0 => Err(error()),
                // Bytes without a buffer: not something a receive into the pool does.
                None => Err(io::ErrorKind::InvalidData.into()),
            };
            if !more {
                self.release_slot(op);
            }
            return Some(Completion::Arrived {
                token,
                result,
                more,
            });
        }
        let held = std::mem::replace(&mut slot.held, Held::Free);
        let done = match held {
            Held::Free => return None,
            Held::Accept { .. } => Completion::Accepted {
                result: if result < 0 {
                    Err(error())
                } else {
                    Ok(adopt_accepted(result))
                },
                more: false,
            },
            Held::Recv {
                token, buf, room, ..
            } => Completion::Received {
                token,
                result: if result < 0 {
                    Err(error())
                } else {
                    Ok((result as usize).min(room))
                },
                buf,
            },
            Held::Send {
                token, buf, len, ..
            } => Completion::Sent {
                token,
                result: if result < 0 {
                    Err(error())
                } else {
                    Ok((result as usize).min(len))
                },
                buf,
            },
            Held::Poll { .. } => Completion::Polled {
                result: if result < 0 { Err(error()) } else { Ok(()) },
            },
            Held::RecvMulti { .. } | Held::AcceptMulti { .. } => return None,
        };
        slot.generation = slot.generation.wrapping_add(1);
        self.free.push(op.index);
        self.in_flight -= 1;
        Some(done)
    }

    /// Frees the slot of an operation that completed for the last time.
    fn release_slot(&mut self, op: OpId) {
        if let Some(slot) = self.slots.get_mut(op.index as usize) {
            slot.held = Held::Free;
            slot.generation = slot.generation.wrapping_add(1);
            self.free.push(op.index);
            self.in_flight -= 1;
        }
    }

    /// Stores `held` in a free slot and queues `entry` for it.
    #[inline(always)]
    fn submit_held(&mut self, entry: squeue::Entry, held: Held<R, S>) -> OpId {
        let index = match self.free.pop() {
            Some(index) => index,
            None => {
                // Never reaches u32::MAX: each slot is an operation the kernel holds.
                self.slots.push(Slot {
                    generation: 0,
                    held: Held::Free,
                });
                (self.slots.len() - 1) as u32
            }
        };
        let slot = &mut self.slots[index as usize];
        // A free slot holds `Held::Free` (nothing to drop): replaced without the drop
        // glue an assignment would run on it.
        let free = std::mem::replace(&mut slot.held, held);
        debug_assert!(matches!(free, Held::Free));
        std::mem::forget(free);
        let op = OpId {
            index,
            generation: slot.generation,
        };
        self.in_flight += 1;
        self.push(entry.user_data(op.user_data()));
        op
    }

    /// Queues `entry`, or keeps it for later when the queue is full (or older entries
    /// wait): order is kept, so a cancel never overtakes what it cancels.
    fn push(&mut self, entry: squeue::Entry) {
        if self.backlog.is_empty() && push_entry(&mut self.ring, &entry) {
            return;
        }
        self.backlog.push_back(entry);
    }

    /// Moves the backlog into the submission queue, submitting (and reaping, when the
    /// completion queue is full) to make room.
    #[inline]
    fn flush_backlog(&mut self) -> io::Result<()> {
        if self.backlog.is_empty() {
            return Ok(());
        }
        self.flush_backlog_slow()
    }

    #[inline(never)]
    fn flush_backlog_slow(&mut self) -> io::Result<()> {
        while let Some(entry) = self.backlog.front() {
            if push_entry(&mut self.ring, entry) {
                self.backlog.pop_front();
                continue;
            }
            match self.ring.submit() {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EINTR)) => {
                    // The completion queue is full: reap before submitting more.
                    let mut stashed = std::mem::take(&mut self.stashed);
                    self.reap_queue(&mut stashed);
                    self.stashed = stashed;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

impl<R: RecvBuf, S: SendBuf> Drop for Ring<R, S> {
    /// Operations still in flight are leaked, buffers and descriptors: the kernel may
    /// still write them after the ring is closed (it cancels them asynchronously).
    fn drop(&mut self) {
        for slot in self.slots.drain(..) {
            if !matches!(slot.held, Held::Free) {
                std::mem::forget(slot.held);
            }
        }
        if let Some(pool) = self.pool.take() {
            // With nothing in flight no receive can pick a buffer: unregistered, the
            // pool is the process's again. Otherwise it is leaked with the buffers.
            if self.in_flight == 0
                && self
                    .ring
                    .submitter()
                    .unregister_buf_ring(POOL_GROUP)
                    .is_ok()
            {
                pool.free();
            }
        }
    }
}

/// `ETIME` (the timeout), `EINTR` (a signal) and `EBUSY` (completions to reap first)
/// are not failures of the ring.
fn tolerate(result: io::Result<()>) -> io::Result<()> {
    match result {
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ETIME | libc::EINTR | libc::EBUSY)
            ) =>
        {
            Ok(())
        }
        other => other,
    }
}

/// Pushes `entry` onto the submission queue; false when it is full.
fn push_entry(ring: &mut IoUring, entry: &squeue::Entry) -> bool {
    // SAFETY: every entry this module builds points only at memory its operation's
    // slot owns until the completion is reaped (`finish` is the only place a slot's
    // `Held` is released, and `Drop` leaks what is still held): the heap bytes of the
    // `Vec<u8>` of a `RecvBuf`/`SendBuf` it took by value, which nothing else can reach
    // (moving the owner does not move them). Descriptors are kept open by the slot's
    // `Arc<OwnedFd>`. Accept passes null address pointers, poll and cancel point at no
    // memory.
    unsafe { ring.submission().push(entry) }.is_ok()
}

/// The descriptor a successful accept completion returned.
fn adopt_accepted(fd: i32) -> OwnedFd {
    // SAFETY: a non-negative accept result is a new descriptor the kernel just
    // installed in this process's table for this completion; nothing else owns it.
    unsafe { OwnedFd::from_raw_fd(fd as RawFd) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A receive buffer that counts its drops.
    struct Counted {
        bytes: Vec<u8>,
        drops: Arc<AtomicUsize>,
    }

    impl RecvBuf for Counted {
        fn recv_into(&mut self) -> (&mut Vec<u8>, usize) {
            (&mut self.bytes, 0)
        }
    }

    impl Drop for Counted {
        fn drop(&mut self) {
            self.drops.fetch_add(1, Ordering::SeqCst);
        }
    }

    struct Bytes(Vec<u8>, usize);

    impl SendBuf for Bytes {
        fn send_from(&self) -> (&Vec<u8>, usize) {
            (&self.0, self.1)
        }
    }

    impl RecvBuf for Bytes {
        fn recv_into(&mut self) -> (&mut Vec<u8>, usize) {
            (&mut self.0, self.1)
        }
    }

    fn pair() -> (Arc<OwnedFd>, UnixStream) {
        let (ours, theirs) = UnixStream::pair().expect("socketpair");
        (Arc::new(OwnedFd::from(ours)), theirs)
    }

    fn ring<R: RecvBuf, S: SendBuf>() -> Option<Ring<R, S>> {
        match Ring::new(8, 16).and_then(|mut ring| ring.start_here().map(|()| ring)) {
            Ok(ring) => Some(ring),
            Err(error) => {
                eprintln!("skipped: io_uring is not available here ({error})");
                None
            }
        }
    }

    /// Waits (bounded) for `count` completions.
    fn wait_for<R: RecvBuf, S: SendBuf>(
        ring: &mut Ring<R, S>,
        count: usize,
    ) -> Vec<Completion<R, S>> {
        let mut done = Vec::new();
        for _ in 0..200 {
            ring.submit_and_wait(Duration::from_millis(10))
                .expect("submit");
            ring.reap(&mut done);
            if done.len() >= count {
                break;
            }
        }
        done
    }

    #[test]
    fn a_receive_hands_its_buffer_back_only_with_the_completion() {
        let Some(mut ring) = ring::<Bytes, Bytes>() else {
            return;
        };
        let (fd, mut peer) = pair();
        let buf = Bytes(vec![0xaa; 16], 4);
        let heap = buf.0.as_ptr();
        let op = ring.recv(&fd, buf, 7);
        ring.submit().expect("submit");
        let mut done = Vec::new();
        assert_eq!(
            ring.reap(&mut done),
            0,
            "no data yet: the kernel keeps the buffer"
        );
        assert_eq!(ring.in_flight(), 1);
        peer.write_all(b"hello").expect("write");
        let done = wait_for(&mut ring, 1);
        let [Completion::Received { token, result, buf }] = &done[..] else {
            panic!("one receive completion expected, got {}", done.len());
        };
        assert_eq!(*token, 7);
        assert_eq!(result.as_ref().expect("received"), &5);
        assert_eq!(buf.0.as_ptr(), heap, "the very buffer, never moved");
        assert_eq!(&buf.0[..4], &[0xaa; 4], "bytes before the start untouched");
        assert_eq!(&buf.0[4..9], b"hello");
        assert_eq!(ring.in_flight(), 0);
        // The operation is over: cancelling it now queues nothing.
        ring.cancel(op);
        ring.submit_and_wait(Duration::from_millis(1))
            .expect("submit");
        let mut done = Vec::new();
        assert_eq!(ring.reap(&mut done), 0);
    }

    #[test]
    fn a_spinning_loop_sees_completions_without_waiting() {
        // A loop that spins calls `submit` (never a wait) and reads the completion
        // queue; with deferred task work the completion exists only once an enter has
        // run that work, which `submit` does when the kernel flags it.
        let Some(mut ring) = ring::<Bytes, Bytes>() else {
            return;
        };
        eprintln!("deferred task work: {}", ring.deferred());
        let (fd, mut peer) = pair();
        ring.recv(&fd, Bytes(vec![0; 8], 0), 3);
        ring.submit().expect("submit");
        peer.write_all(b"spin").expect("write");
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let completion = loop {
            ring.submit().expect("submit");
            if let Some(done) = ring.next_completion() {
                break done;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no completion reached a loop that only spins"
            );
            std::hint::spin_loop();
        };
        let Completion::Received { token, result, buf } = completion else {
            panic!("a receive completion expected");
        };
        assert_eq!(token, 3);
        assert_eq!(result.expect("received"), 4);
        assert_eq!(&buf.0[..4], b"spin");
    }

    #[test]
    fn a_ring_with_deferred_work_is_refused_to_another_thread() {
        let Some(mut ring) = ring::<Bytes, Bytes>() else {
            return;
        };
        if !ring.deferred() {
            eprintln!("skipped: this kernel has no deferred task work (Linux 6.1)");
            return;
        }
        // Started on this thread, it is this thread's: another thread's submission is
        // refused by the kernel rather than run unordered beside ours.
        let (fd, _peer) = pair();
        let refused = std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    ring.recv(&fd, Bytes(vec![0; 8], 0), 1);
                    ring.submit()
                })
                .join()
                .expect("thread")
        });
        assert_eq!(
            refused.expect_err("another thread's submit").raw_os_error(),
            Some(libc::EEXIST)
        );
    }

    #[test]
    fn a_cancelled_receive_keeps_its_buffer_until_its_completion() {
        let Some(mut ring) = ring::<Counted, Bytes>() else {
            return;
        };
        let (fd, _peer) = pair();
        let drops = Arc::new(AtomicUsize::new(0));
        let op = ring.recv(
            &fd,
            Counted {
                bytes: vec![0; 64],
                drops: Arc::clone(&drops),
            },
            1,
        );
        ring.submit().expect("submit");
        ring.cancel(op);
        // Before the cancel's effect is reaped, the ring still owns the buffer.
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        assert_eq!(ring.in_flight(), 1);
        let done = wait_for(&mut ring, 1);
        let [Completion::Received { result, .. }] = &done[..] else {
            panic!("one receive completion expected, got {}", done.len());
        };
        let error = result.as_ref().expect_err("cancelled");
        assert_eq!(error.raw_os_error(), Some(libc::ECANCELED));
        assert_eq!(drops.load(Ordering::SeqCst), 0, "handed back, not dropped");
        drop(done);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_ring_dropped_with_a_receive_in_flight_leaks_its_buffer() {
        let Some(mut ring) = ring::<Counted, Bytes>() else {
            return;
        };
        let (fd, _peer) = pair();
        let drops = Arc::new(AtomicUsize::new(0));
        ring.recv(
            &fd,
            Counted {
                bytes: vec![0; 64],
                drops: Arc::clone(&drops),
            },
            1,
        );
        ring.submit().expect("submit");
        drop(ring);
        assert_eq!(
            drops.load(Ordering::SeqCst),
            0,
            "the kernel may still write it: never freed"
        );
        // The descriptor's Arc was leaked with it.
        assert_eq!(Arc::strong_count(&fd), 2);
    }

    #[test]
    fn a_multishot_accept_takes_every_connection_until_cancelled() {
        let Some(mut ring) = ring::<Bytes, Bytes>() else {
            return;
        };
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let listener = Arc::new(OwnedFd::from(listener));
        let op = ring.accept_multi(&listener);
        let clients: Vec<_> = (0..5)
            .map(|_| std::net::TcpStream::connect(addr).expect("connect"))
            .collect();
        let done = wait_for(&mut ring, clients.len());
        if let [Completion::Accepted {
            result: Err(error),
            more: false,
        }] = &done[..]
        {
            if error.raw_os_error() == Some(libc::EINVAL) {
                eprintln!("skipped: this kernel has no multishot accept (Linux 5.19)");
                return;
            }
        }
        assert_eq!(done.len(), clients.len(), "one completion per connection");
        for completion in done {
            let Completion::Accepted { result, more } = completion else {
                panic!("only accepts were submitted");
            };
            let fd = result.expect("accepted");
            assert!(more, "the accept goes on");
            let flags = rustix::io::fcntl_getfd(&fd).expect("getfd");
            assert!(flags.contains(rustix::io::FdFlags::CLOEXEC));
        }
        assert_eq!(ring.in_flight(), 1, "one operation for all of them");
        ring.cancel(op);
        let done = wait_for(&mut ring, 1);
        let [Completion::Accepted { result, more }] = &done[..] else {
            panic!("the last completion of the accept expected");
        };
        assert!(!more);
        assert_eq!(
            result
                .as_ref()
                .map(drop)
                .expect_err("cancelled")
                .raw_os_error(),
            Some(libc::ECANCELED)
        );
        assert_eq!(ring.in_flight(), 0);
    }

    #[test]
    fn sends_accepts_and_polls_complete_with_what_they_owned() {
        let Some(mut ring) = ring::<Bytes, Bytes>() else {
            return;
        };
        let (fd, mut peer) = pair();
        ring.send(&fd, Bytes(b"xxpayload".to_vec(), 2), 3);
        ring.poll_readable(&fd);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let listener = Arc::new(OwnedFd::from(listener));
        ring.accept(&listener);
        let _client = std::net::TcpStream::connect(addr).expect("connect");
        peer.write_all(b"!").expect("write");
        let done = wait_for(&mut ring, 3);
        assert_eq!(done.len(), 3);
        for completion in done {
            match completion {
                Completion::Sent { token, result, buf } => {
                    assert_eq!(token, 3);
                    assert_eq!(result.expect("sent"), 7);
                    assert_eq!(buf.0, b"xxpayload");
                }
                Completion::Polled { result } => {
                    result.expect("readable");
                }
                Completion::Accepted { result, .. } => {
                    let fd = result.expect("accepted");
                    let flags = rustix::io::fcntl_getfd(&fd).expect("getfd");
                    assert!(flags.contains(rustix::io::FdFlags::CLOEXEC));
                }
                Completion::Received { .. } | Completion::Arrived { .. } => {
                    panic!("no receive was submitted")
                }
            }
        }
        let mut sent = [0u8; 7];
        std::io::Read::read_exact(&mut peer, &mut sent).expect("read");
        assert_eq!(&sent, b"payload");
    }

    /// A ring with a pool of `count` buffers of `size` bytes, or why not (printed).
    fn pooled(count: u16, size: usize) -> Option<Ring<Bytes, Bytes>> {
        let mut ring = ring::<Bytes, Bytes>()?;
        match ring.provide_buffers(count, size) {
            Ok(()) => Some(ring),
            Err(error) => {
                eprintln!("skipped: no provided buffer rings here (Linux 5.19): {error}");
                None
            }
        }
    }

    /// The next `Arrived`, or `None` (printed) where the kernel has no multishot receive.
    fn arrival(ring: &mut Ring<Bytes, Bytes>) -> Option<(io::Result<Option<Chunk>>, bool)> {
        let mut next = None;
        for _ in 0..200 {
            next = ring.next_completion();
            if next.is_some() {
                break;
            }
            ring.submit_and_wait(Duration::from_millis(10))
                .expect("submit");
        }
        let Some(Completion::Arrived {
            token,
            result,
            more,
        }) = next
        else {
            panic!("an arrival expected");
        };
        assert_eq!(token, 9);
        if matches!(&result, Err(e) if e.raw_os_error() == Some(libc::EINVAL)) {
            eprintln!("skipped: no multishot receive here (Linux 6.0)");
            return None;
        }
        Some((result, more))
    }

    #[test]
    fn a_multishot_receive_delivers_chunks_until_cancelled() {
        let Some(mut ring) = pooled(4, 64) else {
            return;
        };
        assert_eq!(ring.pool_bytes(), 256);
        let (fd, mut peer) = pair();
        let op = ring.recv_multi(&fd, 9).expect("a pool");
        for word in [&b"hello"[..], b"world"] {
            peer.write_all(word).expect("write");
            let Some((result, more)) = arrival(&mut ring) else {
                return;
            };
            let chunk = result.expect("a chunk").expect("bytes, not the end");
            assert!(more, "the receive goes on");
            assert_eq!(ring.chunk(&chunk), word);
            ring.recycle(chunk);
        }
        assert_eq!(ring.in_flight(), 1, "one receive for both chunks");
        ring.cancel(op);
        let (result, more) = arrival(&mut ring).expect("multishot ran above");
        assert_eq!(
            result.expect_err("cancelled").raw_os_error(),
            Some(libc::ECANCELED)
        );
        assert!(!more);
        assert_eq!(ring.in_flight(), 0);
    }

    #[test]
    fn an_empty_pool_stops_a_multishot_receive_and_the_end_of_stream_comes_as_none() {
        let Some(mut ring) = pooled(1, 8) else {
            return;
        };
        let (fd, mut peer) = pair();
        ring.recv_multi(&fd, 9).expect("a pool");
        peer.write_all(&[7; 12]).expect("write");
        let Some((result, more)) = arrival(&mut ring) else {
            return;
        };
        let chunk = result.expect("a chunk").expect("bytes");
        assert_eq!(ring.chunk(&chunk), &[7; 8]);
        if more {
            // The kernel stops the receive once it finds the pool empty.
            let (result, more) = arrival(&mut ring).expect("multishot ran above");
            assert_eq!(
                result.expect_err("no buffer").raw_os_error(),
                Some(libc::ENOBUFS)
            );
            assert!(!more);
        }
        ring.recycle(chunk);
        assert_eq!(ring.in_flight(), 0);
        // Again, with the buffer back: the rest, then the end of the stream.
        ring.recv_multi(&fd, 9).expect("a pool");
        let (result, _) = arrival(&mut ring).expect("multishot ran above");
        let chunk = result.expect("a chunk").expect("bytes");
        assert_eq!(ring.chunk(&chunk), &[7; 4]);
        ring.recycle(chunk);
        drop(peer);
        let (result, more) = arrival(&mut ring).expect("multishot ran above");
        assert!(matches!(result, Ok(None)), "the end of the stream");
        assert!(!more);
        assert_eq!(ring.in_flight(), 0);
    }

    #[test]
    fn more_operations_than_the_queue_holds_are_all_submitted() {
        let Some(mut ring) = ring::<Bytes, Bytes>() else {
            return;
        };
        let (fd, mut peer) = pair();
        for i in 0..40 {
            ring.send(&fd, Bytes(vec![i as u8], 0), i);
        }
        let done = wait_for(&mut ring, 40);
        assert_eq!(done.len(), 40);
        let mut got = [0u8; 40];
        std::io::Read::read_exact(&mut peer, &mut got).expect("read");
        got.sort_unstable();
        let want: Vec<u8> = (0..40).collect();
        assert_eq!(&got[..], &want[..], "every byte sent once");
    }
}
