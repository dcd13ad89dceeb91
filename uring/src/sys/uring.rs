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
//! This module decides nothing about connections, requests or shutdown: that is the
//! caller's loop.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use io_uring::{opcode, squeue, types, IoUring};

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

/// A finished operation, with what it owned.
#[derive(Debug)]
pub(crate) enum Completion<R, S> {
    /// An accept: the new connection's descriptor, close-on-exec.
    Accepted {
        /// The new descriptor, or why the accept failed (`ECANCELED` when cancelled).
        result: io::Result<OwnedFd>,
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
}

/// What an in-flight operation owns.
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
    stashed: Vec<Completion<R, S>>,
    /// Scratch for the completion queue's entries (user data, result).
    cqes: Vec<(u64, i32)>,
}

impl<R: RecvBuf, S: SendBuf> Ring<R, S> {
    /// A ring with `sq_entries` submission and `cq_entries` completion entries.
    pub(crate) fn new(sq_entries: u32, cq_entries: u32) -> io::Result<Self> {
        let ring = IoUring::builder()
            .setup_cqsize(cq_entries)
            .build(sq_entries)?;
        Ok(Ring {
            ring,
            slots: Vec::new(),
            free: Vec::new(),
            in_flight: 0,
            backlog: std::collections::VecDeque::new(),
            stashed: Vec::new(),
            cqes: Vec::new(),
        })
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
    /// (the completion queue is in shared memory and [`reap`](Ring::reap) reads it).
    pub(crate) fn submit(&mut self) -> io::Result<()> {
        self.flush_backlog()?;
        if self.ring.submission().is_empty() {
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

    /// Moves every completion there is into `out` (in order); returns how many.
    pub(crate) fn reap(&mut self, out: &mut Vec<Completion<R, S>>) -> usize {
        let before = out.len();
        out.append(&mut self.stashed);
        self.reap_queue(out);
        out.len() - before
    }

    fn reap_queue(&mut self, out: &mut Vec<Completion<R, S>>) {
        let mut cqes = std::mem::take(&mut self.cqes);
        loop {
            // Copied out first: the queue borrows the ring, `finish` the slots.
            cqes.extend(
                self.ring
                    .completion()
                    .map(|cqe| (cqe.user_data(), cqe.result())),
            );
            if cqes.is_empty() {
                break;
            }
            for (data, result) in cqes.drain(..) {
                if let Some(done) = self.finish(data, result) {
                    out.push(done);
                }
            }
        }
        self.cqes = cqes;
    }

    /// Takes the slot of a completed operation and builds its completion.
    fn finish(&mut self, data: u64, result: i32) -> Option<Completion<R, S>> {
        if data == CANCEL {
            return None;
        }
        let op = OpId::from_user_data(data);
        let slot = self.slots.get_mut(op.index as usize)?;
        if slot.generation != op.generation {
            return None;
        }
        let held = std::mem::replace(&mut slot.held, Held::Free);
        let error = || io::Error::from_raw_os_error(result.saturating_neg());
        let done = match held {
            Held::Free => return None,
            Held::Accept { .. } => Completion::Accepted {
                result: if result < 0 {
                    Err(error())
                } else {
                    Ok(adopt_accepted(result))
                },
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
        };
        slot.generation = slot.generation.wrapping_add(1);
        self.free.push(op.index);
        self.in_flight -= 1;
        Some(done)
    }

    /// Stores `held` in a free slot and queues `entry` for it.
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
        slot.held = held;
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
    fn flush_backlog(&mut self) -> io::Result<()> {
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
        match Ring::new(8, 16) {
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
                Completion::Accepted { result } => {
                    let fd = result.expect("accepted");
                    let flags = rustix::io::fcntl_getfd(&fd).expect("getfd");
                    assert!(flags.contains(rustix::io::FdFlags::CLOEXEC));
                }
                Completion::Received { .. } => panic!("no receive was submitted"),
            }
        }
        let mut sent = [0u8; 7];
        std::io::Read::read_exact(&mut peer, &mut sent).expect("read");
        assert_eq!(&sent, b"payload");
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
