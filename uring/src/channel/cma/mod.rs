//! The `cma` channel: a receiver pulls a tensor's bytes straight out of another process
//! on the same host with `process_vm_readv` (cross-memory attach), one copy, no socket.
//!
//! The protocol is TensorPipe's, receiver-driven:
//!
//! 1. The sender wraps its buffer in a [`CmaExport`], which keeps it (owned or
//!    borrowed, and unchanged) until the transfer is acknowledged, and sends
//!    [`CmaExport::descriptor`] ([`CmaDescriptor::encode`], 72 bytes) over the pipe.
//! 2. The receiver decodes it, opens the peer once ([`CmaPeer::open`]: checks that the
//!    peer shares this host's boot, pid namespace and user namespace, holds a pidfd on
//!    it and verifies its start time, so a recycled pid is never read), reads into its
//!    own buffer ([`CmaPeer::read`], in chunks within the kernel's limits) and sends the
//!    returned [`TransferAck`] back.
//! 3. The sender hands the ack to [`CmaExport::complete`] and gets its buffer back.
//!
//! Reading another process's memory needs ptrace access to it: same uid and gid, the
//! target dumpable, and Yama's `ptrace_scope` allowing it. With scope 1 the *exporting*
//! process must declare any process its ptracer with `prctl(PR_SET_PTRACER,
//! PR_SET_PTRACER_ANY)`; [`viability`] does that (as TensorPipe's cma channel does), so
//! every process that advertises cma must call it before exporting. Failures name the
//! cause: `EPERM` explains ptrace permissions, `ESRCH` means the peer is gone, `EFAULT`
//! means the descriptor's range is not mapped in the peer.
//!
//! This module does not send descriptors or acks (the agent does, over its pipe), does
//! not negotiate, and does not decide when to give up on a peer.

mod read;
mod viability;

pub use viability::{viability, CmaDomain, NotViable, PtraceScope};

use std::fmt;
use std::io;
use std::os::fd::OwnedFd;

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::process::{Pid, PidfdFlags};

pub use rdzv_core::channel::cma::CmaDescriptor;

use super::process::{current_identity, start_time_of};
use super::{next_transfer_id, StableBytes, TransferAck, UnexpectedAck};
use super::{IdentityError, ProcessIdentity};
use read::{read_pieces, Piece, ReadFailure};

/// A buffer lent to a cma receiver. The export owns (or borrows) the buffer and gives
/// it back only through [`complete`](CmaExport::complete), with the receiver's ack, or
/// [`abandon`](CmaExport::abandon), once the receiver can no longer read (its pipe is
/// closed). Dropping an export is like abandoning it.
#[must_use = "the buffer must stay exported until the receiver acknowledges it"]
pub struct CmaExport<B: StableBytes> {
    buffer: B,
    descriptor: CmaDescriptor,
}

impl<B: StableBytes> CmaExport<B> {
    /// Exports `buffer`. Fails only if this process's identity cannot be read from
    /// `/proc`.
    pub fn new(buffer: B) -> Result<CmaExport<B>, CmaError> {
        let process = current_identity()?;
        let bytes = buffer.stable_bytes();
        let descriptor = CmaDescriptor {
            process,
            address: bytes.as_ptr() as usize as u64,
            length: bytes.len() as u64,
            transfer_id: next_transfer_id(),
        };
        Ok(CmaExport { buffer, descriptor })
    }

    /// The descriptor to send to the receiver.
    pub fn descriptor(&self) -> &CmaDescriptor {
        &self.descriptor
    }

    /// The exported bytes (read-only while exported).
    pub fn bytes(&self) -> &[u8] {
        self.buffer.stable_bytes()
    }

    /// Ends the transfer with the receiver's ack and gives the buffer back. An ack for
    /// another transfer gives the export back instead.
    pub fn complete(self, ack: &TransferAck) -> Result<B, UnexpectedAck<CmaExport<B>>> {
        if ack.transfer_id == self.descriptor.transfer_id {
            Ok(self.buffer)
        } else {
            Err(UnexpectedAck {
                expected: self.descriptor.transfer_id,
                received: ack.transfer_id,
                export: self,
            })
        }
    }

    /// Ends the transfer without an ack and gives the buffer back. Call it only when
    /// the receiver can no longer read it (the pipe is closed or the peer is gone):
    /// otherwise the receiver may read bytes that were since changed or freed (this
    /// cannot corrupt either process, but the tensor it receives would be wrong).
    pub fn abandon(self) -> B {
        self.buffer
    }
}

impl<B: StableBytes> fmt::Debug for CmaExport<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmaExport")
            .field("descriptor", &self.descriptor)
            .finish_non_exhaustive()
    }
}

/// Why a cma transfer failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CmaError {
    /// This process's identity could not be read.
    #[error("cma: {0}")]
    Identity(#[from] IdentityError),
    /// The descriptor names a process of another host, boot or namespace, whose pid
    /// means nothing (or someone else) here.
    #[error("cma: peer pid {pid} is in another {differs}; its memory cannot be read from here")]
    ForeignProcess {
        /// The peer's pid in its own namespace.
        pid: u32,
        /// What differs.
        differs: &'static str,
    },
    /// The peer process no longer exists (`ESRCH`, or it exited during the read).
    #[error("cma: peer process {pid} is gone (ESRCH)")]
    PeerGone {
        /// The peer's pid.
        pid: u32,
    },
    /// The pid now belongs to another process than the one that exported the buffer.
    #[error(
        "cma: pid {pid} was reused: the exporting process started at tick {expected}, \
         the current one at tick {found}; the peer is gone"
    )]
    PeerReplaced {
        /// The pid.
        pid: u32,
        /// The exporter's start time (clock ticks since boot).
        expected: u64,
        /// The current holder's start time.
        found: u64,
    },
    /// The descriptor was exported by another process than this peer.
    #[error("cma: descriptor from pid {descriptor_pid} given to the reader of pid {peer_pid}")]
    WrongPeer {
        /// The pid this peer reads from.
        peer_pid: u32,
        /// The pid the descriptor names.
        descriptor_pid: u32,
    },
    /// The kernel refused to let this process read the peer (`EPERM`).
    #[error(
        "cma: process_vm_readv on pid {pid} was refused (EPERM). Reading another process's \
         memory needs ptrace access: same uid and gid, the target dumpable, and Yama \
         allowing it ({scope}). With ptrace_scope 1 the exporting process must call \
         prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) (rdzv_uring::channel::cma::viability \
         does) or the reader must be its ancestor; with 2 the reader needs CAP_SYS_PTRACE; \
         with 3 cma cannot work. Use the basic channel otherwise"
    )]
    PermissionDenied {
        /// The peer's pid.
        pid: u32,
        /// This host's Yama setting, as read when the error happened.
        scope: PtraceScope,
    },
    /// Part of the range is not mapped in the peer (`EFAULT`): a stale or forged
    /// descriptor, or a buffer freed before the ack.
    #[error(
        "cma: bad address: bytes {address:#x}..{address:#x}+{length} are not mapped in \
         pid {pid} (EFAULT; failed at offset {offset})"
    )]
    BadAddress {
        /// The peer's pid.
        pid: u32,
        /// The start of the range read.
        address: u64,
        /// The range's length.
        length: u64,
        /// How far into the range the failing call started.
        offset: u64,
    },
    /// The descriptor's range wraps around the address space.
    #[error("cma: descriptor range {address:#x}+{length} overflows the address space")]
    RangeOverflow {
        /// The start address.
        address: u64,
        /// The length.
        length: u64,
    },
    /// The part asked for is not inside the exported buffer.
    #[error("cma: bytes {offset}..{offset}+{len} are outside the exported {length} bytes")]
    OutOfRange {
        /// The offset asked for.
        offset: u64,
        /// The number of bytes asked for.
        len: u64,
        /// The exported length.
        length: u64,
    },
    /// The destination buffer's size is not the exported length.
    #[error("cma: the exported buffer has {expected} bytes but the destination has {actual}")]
    LengthMismatch {
        /// The exported length.
        expected: u64,
        /// The destination's length.
        actual: u64,
    },
    /// `process_vm_readv` moved no byte without reporting an error.
    #[error("cma: process_vm_readv on pid {pid} made no progress at {address:#x}")]
    NoProgress {
        /// The peer's pid.
        pid: u32,
        /// Where the call started.
        address: u64,
    },
    /// Another system call failed.
    #[error("cma: {call} on pid {pid} failed: {source}")]
    Syscall {
        /// The call.
        call: &'static str,
        /// The peer's pid.
        pid: u32,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

impl CmaError {
    /// Whether the error means the peer process is gone (so the pipe to it is dead too).
    pub fn is_peer_gone(&self) -> bool {
        matches!(
            self,
            CmaError::PeerGone { .. } | CmaError::PeerReplaced { .. }
        )
    }
}

/// A process whose exported buffers this process reads. Open it once per peer and
/// reuse it: it holds a pidfd on the peer (where the kernel has `pidfd_open`, 5.3+), so
/// a read never reaches a process that merely inherited the peer's pid.
#[derive(Debug)]
pub struct CmaPeer {
    process: ProcessIdentity,
    pid: libc::pid_t,
    pidfd: Option<OwnedFd>,
}

impl CmaPeer {
    /// Opens the process named by `process` (from a descriptor): it must share this
    /// process's boot, pid namespace and user namespace, be alive, and have the start
    /// time recorded in `process`.
    pub fn open(process: &ProcessIdentity) -> Result<CmaPeer, CmaError> {
        let local = current_identity()?;
        if let Some(differs) = local.mismatch(process) {
            return Err(CmaError::ForeignProcess {
                pid: process.pid,
                differs,
            });
        }
        let gone = CmaError::PeerGone { pid: process.pid };
        // A pid that is not a positive `pid_t` names no process.
        let raw = libc::pid_t::try_from(process.pid).unwrap_or(0);
        let Some(pid) = Pid::from_raw(raw.max(0)) else {
            return Err(gone);
        };
        // Take the pidfd first, then check the start time: if it matches, the pidfd
        // refers to the exporter (a pid is not reused while a process holds it).
        let pidfd = match rustix::process::pidfd_open(pid, PidfdFlags::empty()) {
            Ok(fd) => Some(fd),
            Err(rustix::io::Errno::SRCH) => return Err(gone),
            Err(rustix::io::Errno::NOSYS) => None,
            Err(errno) => {
                return Err(CmaError::Syscall {
                    call: "pidfd_open",
                    pid: process.pid,
                    source: errno.into(),
                })
            }
        };
        let peer = CmaPeer {
            process: *process,
            pid: raw,
            pidfd,
        };
        peer.check_same_process()?;
        Ok(peer)
    }

    /// The process this peer reads from.
    pub fn process(&self) -> &ProcessIdentity {
        &self.process
    }

    /// Whether the peer is still alive (and, without pidfd support, still holds its
    /// pid).
    pub fn is_alive(&self) -> bool {
        self.check_alive().is_ok()
    }

    /// Reads the whole exported buffer into `dst`, whose length must be the descriptor's
    /// length, and returns the ack to send back.
    pub fn read(
        &self,
        descriptor: &CmaDescriptor,
        dst: &mut [u8],
    ) -> Result<TransferAck, CmaError> {
        if dst.len() as u64 != descriptor.length {
            return Err(CmaError::LengthMismatch {
                expected: descriptor.length,
                actual: dst.len() as u64,
            });
        }
        self.read_at(descriptor, 0, dst)?;
        Ok(TransferAck {
            transfer_id: descriptor.transfer_id,
        })
    }

    /// Reads bytes `offset..offset + dst.len()` of the exported buffer into `dst`. An
    /// agent can read a large tensor in slices this way, yielding between them; it
    /// sends the ack ([`TransferAck`] with the descriptor's transfer id) after the last.
    pub fn read_at(
        &self,
        descriptor: &CmaDescriptor,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), CmaError> {
        let mut items = [(descriptor, offset, dst)];
        self.read_many(&mut items)
    }

    /// Reads several ranges of this peer's exports in as few system calls as possible
    /// (up to 1024 ranges per call): each item is a descriptor, an offset into its
    /// buffer and the destination for the bytes from there.
    pub fn read_many(
        &self,
        items: &mut [(&CmaDescriptor, u64, &mut [u8])],
    ) -> Result<(), CmaError> {
        let starts: Vec<(u64, u64, u64)> = items
            .iter()
            .map(|(d, offset, _)| (d.address, d.length, *offset))
            .collect();
        let mut pieces = Vec::with_capacity(items.len());
        for (descriptor, offset, dst) in items.iter_mut() {
            let descriptor: &CmaDescriptor = descriptor;
            if descriptor.process != self.process {
                return Err(CmaError::WrongPeer {
                    peer_pid: self.process.pid,
                    descriptor_pid: descriptor.process.pid,
                });
            }
            if descriptor.address.checked_add(descriptor.length).is_none() {
                return Err(CmaError::RangeOverflow {
                    address: descriptor.address,
                    length: descriptor.length,
                });
            }
            let len = dst.len() as u64;
            let inside = offset
                .checked_add(len)
                .is_some_and(|end| end <= descriptor.length);
            if !inside {
                return Err(CmaError::OutOfRange {
                    offset: *offset,
                    len,
                    length: descriptor.length,
                });
            }
            pieces.push(Piece {
                remote: descriptor.address + *offset,
                local: dst,
            });
        }
        if let Err(failure) = read_pieces(self.pid, &mut pieces) {
            return Err(self.explain(failure, &starts));
        }
        // The read succeeded; make sure it was the exporter we read from all along.
        self.check_alive()
    }

    /// Turns a failed copy into the error that says why.
    fn explain(&self, failure: ReadFailure, starts: &[(u64, u64, u64)]) -> CmaError {
        let pid = self.process.pid;
        let (address, length, offset) = starts
            .get(failure.at.piece)
            .map(|&(address, length, offset)| (address, length, offset + failure.at.offset as u64))
            .unwrap_or((0, 0, 0));
        let Some(source) = failure.source else {
            return CmaError::NoProgress {
                pid,
                address: address.wrapping_add(offset),
            };
        };
        match source.raw_os_error() {
            Some(libc::ESRCH) => CmaError::PeerGone { pid },
            Some(libc::EPERM) => match self.check_alive() {
                // A process that exits becomes unreadable before it disappears.
                Err(gone) => gone,
                Ok(()) => CmaError::PermissionDenied {
                    pid,
                    scope: PtraceScope::current(),
                },
            },
            Some(libc::EFAULT) => match self.check_alive() {
                Err(gone) => gone,
                Ok(()) => CmaError::BadAddress {
                    pid,
                    address,
                    length,
                    offset,
                },
            },
            _ => CmaError::Syscall {
                call: "process_vm_readv",
                pid,
                source,
            },
        }
    }

    /// Fails if the peer exited, or (without a pidfd) its pid now names another process.
    fn check_alive(&self) -> Result<(), CmaError> {
        let Some(pidfd) = &self.pidfd else {
            return self.check_same_process();
        };
        // A pidfd polls readable once the process has exited.
        let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
        let now = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        match rustix::event::poll(&mut fds, Some(&now)) {
            Ok(0) => Ok(()),
            Ok(_) => Err(CmaError::PeerGone {
                pid: self.process.pid,
            }),
            Err(errno) => Err(CmaError::Syscall {
                call: "poll(pidfd)",
                pid: self.process.pid,
                source: errno.into(),
            }),
        }
    }

    /// Fails unless the process holding the pid started when the exporter did.
    fn check_same_process(&self) -> Result<(), CmaError> {
        let pid = self.process.pid;
        let found = match start_time_of(pid) {
            Ok(found) => found,
            Err(IdentityError::Read { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                return Err(CmaError::PeerGone { pid })
            }
            Err(other) => return Err(other.into()),
        };
        if found == self.process.start_time {
            Ok(())
        } else {
            Err(CmaError::PeerReplaced {
                pid,
                expected: self.process.start_time,
                found,
            })
        }
    }
}

/// Reads a whole exported buffer with a one-off [`CmaPeer`]; prefer keeping a peer
/// open when reading many buffers from one process.
pub fn read(descriptor: &CmaDescriptor, dst: &mut [u8]) -> Result<TransferAck, CmaError> {
    CmaPeer::open(&descriptor.process)?.read(descriptor, dst)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::{DecodeError, ProcessIdentity};

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn descriptor_round_trips_and_rejects_garbage() {
        let export = CmaExport::new(pattern(100, 1)).expect("export");
        let descriptor = *export.descriptor();
        let bytes = descriptor.encode();
        assert_eq!(bytes.len(), 72);
        assert_eq!(CmaDescriptor::decode(&bytes), Ok(descriptor));
        assert!(matches!(
            CmaDescriptor::decode(&bytes[..10]),
            Err(DecodeError::WrongLength { actual: 10, .. })
        ));
        let mut bad = bytes;
        bad[0] = b'X';
        assert!(matches!(
            CmaDescriptor::decode(&bad),
            Err(DecodeError::BadTag { .. })
        ));
        let _ = export.abandon();
    }

    #[test]
    fn reads_own_export_and_completes() {
        let source = pattern(10_000, 7);
        let export = CmaExport::new(source.as_slice()).expect("export");
        let mut dst = vec![0u8; 10_000];
        let ack = read(export.descriptor(), &mut dst).expect("self read");
        assert_eq!(dst, source);
        let other = TransferAck {
            transfer_id: ack.transfer_id + 1,
        };
        let export = match export.complete(&other) {
            Ok(_) => panic!("a foreign ack must not complete the export"),
            Err(mismatch) => {
                assert_eq!(mismatch.received, ack.transfer_id + 1);
                mismatch.export
            }
        };
        let back = export.complete(&ack).expect("own ack completes");
        assert_eq!(back.as_ptr(), source.as_ptr());
    }

    #[test]
    fn slices_and_batches() {
        let a = pattern(5000, 1);
        let b = pattern(300, 2);
        let ea = CmaExport::new(a.as_slice()).expect("export a");
        let eb = CmaExport::new(b.as_slice()).expect("export b");
        let peer = CmaPeer::open(&ea.descriptor().process).expect("open self");
        assert!(peer.is_alive());
        let mut tail = vec![0u8; 1000];
        let mut whole_b = vec![0u8; 300];
        let mut empty: [u8; 0] = [];
        peer.read_many(&mut [
            (ea.descriptor(), 4000, &mut tail[..]),
            (eb.descriptor(), 0, &mut whole_b[..]),
            (ea.descriptor(), 5000, &mut empty[..]),
        ])
        .expect("batched read");
        assert_eq!(&tail[..], &a[4000..]);
        assert_eq!(whole_b, b);
        let mut over = vec![0u8; 2];
        assert!(matches!(
            peer.read_at(ea.descriptor(), 4999, &mut over),
            Err(CmaError::OutOfRange {
                offset: 4999,
                len: 2,
                length: 5000
            })
        ));
        assert!(matches!(
            peer.read(ea.descriptor(), &mut over),
            Err(CmaError::LengthMismatch {
                expected: 5000,
                actual: 2
            })
        ));
    }

    #[test]
    fn bad_ranges_are_explained() {
        let me = current_identity().expect("identity");
        let peer = CmaPeer::open(&me).expect("open self");
        let unmapped = CmaDescriptor {
            process: me,
            address: 0x1000,
            length: 64,
            transfer_id: 1,
        };
        let mut dst = [0u8; 64];
        let err = peer.read(&unmapped, &mut dst).expect_err("unmapped");
        assert!(
            matches!(
                err,
                CmaError::BadAddress {
                    address: 0x1000,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("EFAULT"));
        let wrapping = CmaDescriptor {
            address: u64::MAX - 3,
            ..unmapped
        };
        assert!(matches!(
            peer.read(&wrapping, &mut dst),
            Err(CmaError::RangeOverflow { .. })
        ));
        let stranger = CmaDescriptor {
            process: ProcessIdentity {
                pid: me.pid.wrapping_add(1),
                ..me
            },
            ..unmapped
        };
        assert!(matches!(
            peer.read(&stranger, &mut dst),
            Err(CmaError::WrongPeer { .. })
        ));
    }

    #[test]
    fn foreign_and_recycled_processes_are_refused() {
        let me = current_identity().expect("identity");
        let elsewhere = ProcessIdentity {
            boot_id: [0xab; 16],
            ..me
        };
        assert!(matches!(
            CmaPeer::open(&elsewhere),
            Err(CmaError::ForeignProcess { .. })
        ));
        let older = ProcessIdentity {
            start_time: me.start_time.wrapping_add(1),
            ..me
        };
        let err = CmaPeer::open(&older).expect_err("start time differs");
        assert!(matches!(err, CmaError::PeerReplaced { .. }), "{err}");
        assert!(err.is_peer_gone());
        for pid in [0, u32::MAX] {
            let nobody = ProcessIdentity { pid, ..me };
            assert!(matches!(
                CmaPeer::open(&nobody),
                Err(CmaError::PeerGone { .. })
            ));
        }
    }

    #[test]
    fn permission_message_explains_ptrace() {
        let err = CmaError::PermissionDenied {
            pid: 42,
            scope: PtraceScope::Restricted,
        };
        let text = err.to_string();
        assert!(text.contains("EPERM"));
        assert!(text.contains("PR_SET_PTRACER"));
        assert!(text.contains("CAP_SYS_PTRACE"));
        assert!(text.contains("ptrace_scope 1"));
    }
}
