//! The `xth` channel: both ends of a pipe live in one process, and the receiver copies
//! the tensor straight out of the sender's buffer.
//!
//! TensorPipe's xth sends a raw pointer and trusts it. Here the descriptor names a
//! transfer id instead, looked up in a process-wide table of live exports, so a stale,
//! forged or foreign descriptor is refused with an error and never dereferenced: the
//! channel needs no `unsafe`. An export keeps its buffer alive in the table until it is
//! completed (with the receiver's [`TransferAck`]), abandoned or dropped; a copy in
//! progress holds the buffer until it ends. A descriptor carries the exporting process's
//! identity, so one read in another process (or in a forked child) is refused by name.
//!
//! This module does not send descriptors or acks and does not negotiate; [`viability`]
//! gives the descriptor to advertise for `rdzv_core::negotiate::ChannelKind::Xth`.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

pub use rdzv_core::channel::xth::XthDescriptor;

use super::process::current_identity;
use super::IdentityError;
use super::{next_transfer_id, StableBytes, TransferAck, UnexpectedAck};

/// Why an xth transfer failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum XthError {
    /// This process's identity could not be read.
    #[error("xth: {0}")]
    Identity(#[from] IdentityError),
    /// The descriptor was exported by another process.
    #[error(
        "xth: descriptor exported by pid {pid} (started at tick {start_time}) read in pid \
         {here}; xth works only within one process"
    )]
    ForeignProcess {
        /// The exporter's pid.
        pid: u32,
        /// The exporter's start time.
        start_time: u64,
        /// This process's pid.
        here: u32,
    },
    /// No live export has this transfer id: it was completed, abandoned or dropped, or
    /// never existed.
    #[error(
        "xth: no live export with transfer id {transfer_id} (completed, abandoned or unknown)"
    )]
    UnknownTransfer {
        /// The id asked for.
        transfer_id: u64,
    },
    /// The part asked for is not inside the exported buffer.
    #[error("xth: bytes {offset}..{offset}+{len} are outside the exported {length} bytes")]
    OutOfRange {
        /// The offset asked for.
        offset: u64,
        /// The number of bytes asked for.
        len: u64,
        /// The exported length.
        length: u64,
    },
    /// The destination's size is not the exported length.
    #[error("xth: the exported buffer has {expected} bytes but the destination has {actual}")]
    LengthMismatch {
        /// The exported length.
        expected: u64,
        /// The destination's length.
        actual: u64,
    },
}

/// An exported buffer as the table sees it.
trait Lent: Send + Sync {
    /// Copies bytes `offset..offset + dst.len()` into `dst`.
    fn copy_out(&self, transfer_id: u64, offset: u64, dst: &mut [u8]) -> Result<(), XthError>;
}

/// The shared state of one export: the buffer and whether it is still lent.
struct Slot<B> {
    buffer: B,
    /// True while exported. Copies hold the read lock; ending the export takes the
    /// write lock, so it waits for copies in progress.
    lent: RwLock<bool>,
}

impl<B: StableBytes + Send + Sync> Lent for Slot<B> {
    fn copy_out(&self, transfer_id: u64, offset: u64, dst: &mut [u8]) -> Result<(), XthError> {
        let lent = self.lent.read().unwrap_or_else(PoisonError::into_inner);
        if !*lent {
            return Err(XthError::UnknownTransfer { transfer_id });
        }
        let bytes = self.buffer.stable_bytes();
        let range = usize::try_from(offset)
            .ok()
            .and_then(|start| Some(start..start.checked_add(dst.len())?));
        match range.and_then(|range| bytes.get(range)) {
            Some(source) => {
                dst.copy_from_slice(source);
                Ok(())
            }
            None => Err(XthError::OutOfRange {
                offset,
                len: dst.len() as u64,
                length: bytes.len() as u64,
            }),
        }
    }
}

/// The live exports of this process, by transfer id.
static EXPORTS: Mutex<BTreeMap<u64, Arc<dyn Lent>>> = Mutex::new(BTreeMap::new());

fn exports() -> std::sync::MutexGuard<'static, BTreeMap<u64, Arc<dyn Lent>>> {
    EXPORTS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Removes an export from the table when dropped.
struct Registration(u64);

impl Drop for Registration {
    fn drop(&mut self) {
        exports().remove(&self.0);
    }
}

/// A buffer lent to a receiver in this process. It is readable through its descriptor
/// until [`complete`](XthExport::complete) (with the receiver's ack) or
/// [`abandon`](XthExport::abandon) gives it back, or the export is dropped.
#[must_use = "the buffer must stay exported until the receiver acknowledges it"]
pub struct XthExport<B: StableBytes + Send + Sync + 'static> {
    slot: Arc<Slot<B>>,
    descriptor: XthDescriptor,
    registration: Registration,
}

impl<B: StableBytes + Send + Sync + 'static> XthExport<B> {
    /// Exports `buffer`. Fails only if this process's identity cannot be read.
    pub fn new(buffer: B) -> Result<XthExport<B>, XthError> {
        let process = current_identity()?;
        let transfer_id = next_transfer_id();
        let descriptor = XthDescriptor {
            process,
            length: buffer.stable_bytes().len() as u64,
            transfer_id,
        };
        let slot = Arc::new(Slot {
            buffer,
            lent: RwLock::new(true),
        });
        let lent: Arc<dyn Lent> = slot.clone();
        exports().insert(transfer_id, lent);
        Ok(XthExport {
            slot,
            descriptor,
            registration: Registration(transfer_id),
        })
    }

    /// The descriptor to send to the receiver.
    pub fn descriptor(&self) -> &XthDescriptor {
        &self.descriptor
    }

    /// The exported bytes.
    pub fn bytes(&self) -> &[u8] {
        self.slot.buffer.stable_bytes()
    }

    /// Ends the transfer with the receiver's ack and gives the buffer back. An ack for
    /// another transfer gives the export back instead.
    pub fn complete(self, ack: &TransferAck) -> Result<B, UnexpectedAck<XthExport<B>>> {
        if ack.transfer_id == self.descriptor.transfer_id {
            Ok(self.reclaim())
        } else {
            Err(UnexpectedAck {
                expected: self.descriptor.transfer_id,
                received: ack.transfer_id,
                export: self,
            })
        }
    }

    /// Ends the transfer without an ack and gives the buffer back; later reads of its
    /// descriptor fail with [`XthError::UnknownTransfer`].
    pub fn abandon(self) -> B {
        self.reclaim()
    }

    /// Unlends the buffer, waiting for copies in progress, and takes it back.
    fn reclaim(self) -> B {
        let XthExport {
            mut slot,
            registration,
            ..
        } = self;
        *slot.lent.write().unwrap_or_else(PoisonError::into_inner) = false;
        drop(registration);
        // Out of the table and unlent: the only other holders are readers between
        // their lookup and their (failing) check of `lent`, which let go at once.
        loop {
            match Arc::try_unwrap(slot) {
                Ok(owned) => return owned.buffer,
                Err(shared) => {
                    slot = shared;
                    std::thread::yield_now();
                }
            }
        }
    }
}

impl<B: StableBytes + Send + Sync + 'static> fmt::Debug for XthExport<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("XthExport")
            .field("descriptor", &self.descriptor)
            .finish_non_exhaustive()
    }
}

/// Copies the whole exported buffer into `dst` (of the exported length) and returns the
/// ack to send back.
pub fn read(descriptor: &XthDescriptor, dst: &mut [u8]) -> Result<TransferAck, XthError> {
    if dst.len() as u64 != descriptor.length {
        return Err(XthError::LengthMismatch {
            expected: descriptor.length,
            actual: dst.len() as u64,
        });
    }
    read_at(descriptor, 0, dst)?;
    Ok(TransferAck {
        transfer_id: descriptor.transfer_id,
    })
}

/// Copies bytes `offset..offset + dst.len()` of the exported buffer into `dst`.
pub fn read_at(descriptor: &XthDescriptor, offset: u64, dst: &mut [u8]) -> Result<(), XthError> {
    let here = current_identity()?;
    if here != descriptor.process {
        return Err(XthError::ForeignProcess {
            pid: descriptor.process.pid,
            start_time: descriptor.process.start_time,
            here: here.pid,
        });
    }
    let transfer_id = descriptor.transfer_id;
    let lent = exports()
        .get(&transfer_id)
        .cloned()
        .ok_or(XthError::UnknownTransfer { transfer_id })?;
    lent.copy_out(transfer_id, offset, dst)
}

/// The xth channel's domain descriptor, `xth:<boot id>_<pid ns>_<pid>_<start time>`: equal
/// only within one process (TensorPipe's `<boot_id>_<pidns>_<pid>`, plus the start time
/// so that a recycled pid never matches).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct XthDomain(String);

impl XthDomain {
    /// The descriptor text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for XthDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The xth channel is always viable where this process can name itself; returns its
/// domain descriptor.
pub fn viability() -> Result<XthDomain, IdentityError> {
    let me = current_identity()?;
    let (_, boot) = crate::host::boot_id()?;
    Ok(XthDomain(format!(
        "xth:{boot}_{}_{}_{}",
        me.pid_namespace, me.pid, me.start_time
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::{DecodeError, ProcessIdentity};

    #[test]
    fn copies_and_completes() {
        let source: Vec<u8> = (0..4096u32).map(|i| (i % 253) as u8).collect();
        let export = XthExport::new(source.clone()).expect("export");
        let encoded = export.descriptor().encode();
        let descriptor = XthDescriptor::decode(&encoded).expect("decodes");
        let mut dst = vec![0u8; 4096];
        let ack = read(&descriptor, &mut dst).expect("read");
        assert_eq!(dst, source);
        let mut tail = [0u8; 96];
        read_at(&descriptor, 4000, &mut tail).expect("tail");
        assert_eq!(&tail[..], &source[4000..]);
        assert!(matches!(
            read_at(&descriptor, 4095, &mut tail),
            Err(XthError::OutOfRange { .. })
        ));
        let wrong = TransferAck {
            transfer_id: ack.transfer_id + 1,
        };
        let export = export.complete(&wrong).expect_err("wrong ack").export;
        assert_eq!(export.complete(&ack).expect("own ack"), source);
        assert!(matches!(
            read(&descriptor, &mut dst),
            Err(XthError::UnknownTransfer { .. })
        ));
    }

    #[test]
    fn dropped_or_foreign_exports_are_refused() {
        let export = XthExport::new(Arc::<[u8]>::from(vec![1u8; 10])).expect("export");
        let descriptor = *export.descriptor();
        drop(export);
        let mut dst = [0u8; 10];
        assert!(matches!(
            read(&descriptor, &mut dst),
            Err(XthError::UnknownTransfer { .. })
        ));
        let export = XthExport::new(vec![2u8; 10]).expect("export");
        let foreign = XthDescriptor {
            process: ProcessIdentity {
                pid: export.descriptor().process.pid.wrapping_add(1),
                ..export.descriptor().process
            },
            ..*export.descriptor()
        };
        let err = read(&foreign, &mut dst).expect_err("other process");
        assert!(err.to_string().contains("only within one process"), "{err}");
        let forged = XthDescriptor {
            transfer_id: u64::MAX,
            ..*export.descriptor()
        };
        assert!(matches!(
            read(&forged, &mut dst),
            Err(XthError::UnknownTransfer { .. })
        ));
        assert_eq!(export.abandon(), vec![2u8; 10]);
        assert!(matches!(
            XthDescriptor::decode(&[0u8; 5]),
            Err(DecodeError::WrongLength { .. })
        ));
    }

    #[test]
    fn concurrent_readers_and_completion() {
        let source = vec![9u8; 1 << 20];
        let export = XthExport::new(source.clone()).expect("export");
        let descriptor = *export.descriptor();
        let readers: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(move || {
                    let mut dst = vec![0u8; 1 << 20];
                    for _ in 0..20 {
                        match read(&descriptor, &mut dst) {
                            Ok(_) => assert!(dst.iter().all(|&b| b == 9)),
                            Err(XthError::UnknownTransfer { .. }) => return,
                            Err(other) => panic!("unexpected error: {other}"),
                        }
                    }
                })
            })
            .collect();
        let ack = TransferAck {
            transfer_id: descriptor.transfer_id,
        };
        assert_eq!(export.complete(&ack).expect("completes"), source);
        for reader in readers {
            reader.join().expect("reader thread");
        }
    }

    #[test]
    fn domain_is_per_process() {
        let domain = viability().expect("viable");
        assert!(domain.as_str().starts_with("xth:"));
        assert!(domain
            .as_str()
            .contains(&format!("_{}_", std::process::id())));
    }
}
