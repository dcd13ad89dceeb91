//! Which process instance a channel endpoint is, precisely enough that a pid reused by
//! a new process, a pid from another pid namespace or a pid from another boot is never
//! mistaken for the peer.
//!
//! A [`ProcessIdentity`] is the boot id, the pid and user namespaces (inode numbers of
//! `/proc/self/ns/{pid,user}`), the pid and the process start time (field 22 of
//! `/proc/<pid>/stat`, clock ticks since boot). Two processes alive at the same time
//! never share all of them, and a new process given a dead one's pid has a later start
//! time. This module reads `/proc`; it does not open or watch peers.

use std::sync::Mutex;

pub use crate::host::IdentityError;
use crate::host::{boot_id, namespace_inode, PID_NS_PATH, USER_NS_PATH};

/// One process instance on one host: who exported a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ProcessIdentity {
    /// The boot id, as 16 bytes (the UUID in `/proc/sys/kernel/random/boot_id`).
    pub boot_id: [u8; 16],
    /// The inode number of the process's pid namespace.
    pub pid_namespace: u64,
    /// The inode number of the process's user namespace.
    pub user_namespace: u64,
    /// The pid, as seen in that pid namespace.
    pub pid: u32,
    /// When the process started, in clock ticks since boot.
    pub start_time: u64,
}

impl ProcessIdentity {
    /// The encoded size: pid (4), boot id (16), pid namespace, user namespace and start
    /// time (8 each), little-endian.
    pub const ENCODED_LEN: usize = 44;

    /// The identity of this process. It is cached, and recomputed after a `fork` (the
    /// pid changes).
    pub fn current() -> Result<ProcessIdentity, IdentityError> {
        static CACHE: Mutex<Option<ProcessIdentity>> = Mutex::new(None);
        let pid = std::process::id();
        let mut cache = CACHE
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(identity) = *cache {
            if identity.pid == pid {
                return Ok(identity);
            }
        }
        let identity = ProcessIdentity {
            boot_id: boot_id()?.0,
            pid_namespace: namespace_inode(PID_NS_PATH)?,
            user_namespace: namespace_inode(USER_NS_PATH)?,
            pid,
            start_time: start_time_of(pid)?,
        };
        *cache = Some(identity);
        Ok(identity)
    }

    /// Whether `other` lives in the same boot, pid namespace and user namespace as this
    /// one, so that its pid means the same process here. `None` when it does; otherwise
    /// what differs.
    pub fn mismatch(&self, other: &ProcessIdentity) -> Option<&'static str> {
        if self.boot_id != other.boot_id {
            Some("boot id (another host, or another boot)")
        } else if self.pid_namespace != other.pid_namespace {
            Some("pid namespace")
        } else if self.user_namespace != other.user_namespace {
            Some("user namespace")
        } else {
            None
        }
    }

    /// Writes the identity into `out`.
    pub(crate) fn encode_into(&self, out: &mut [u8; Self::ENCODED_LEN]) {
        let (pid, rest) = out.split_at_mut(4);
        pid.copy_from_slice(&self.pid.to_le_bytes());
        let (boot, rest) = rest.split_at_mut(16);
        boot.copy_from_slice(&self.boot_id);
        let (pid_ns, rest) = rest.split_at_mut(8);
        pid_ns.copy_from_slice(&self.pid_namespace.to_le_bytes());
        let (user_ns, start) = rest.split_at_mut(8);
        user_ns.copy_from_slice(&self.user_namespace.to_le_bytes());
        start.copy_from_slice(&self.start_time.to_le_bytes());
    }

    /// Reads an identity written by [`encode_into`](Self::encode_into).
    pub(crate) fn decode_from(bytes: &[u8; Self::ENCODED_LEN]) -> ProcessIdentity {
        let mut reader = FieldReader(bytes);
        let pid = u32::from_le_bytes(reader.take());
        let boot_id = reader.take();
        ProcessIdentity {
            pid,
            boot_id,
            pid_namespace: u64::from_le_bytes(reader.take()),
            user_namespace: u64::from_le_bytes(reader.take()),
            start_time: u64::from_le_bytes(reader.take()),
        }
    }
}

/// Takes fixed-size fields off the front of a byte slice; missing bytes read as zeros
/// (callers check the total length first).
pub(crate) struct FieldReader<'a>(pub(crate) &'a [u8]);

impl<'a> FieldReader<'a> {
    /// A reader over `bytes` once they are exactly `len` long and start with `magic`;
    /// `what` names the record in the error.
    pub(crate) fn tagged(
        bytes: &'a [u8],
        what: &'static str,
        len: usize,
        magic: &[u8; 4],
    ) -> Result<FieldReader<'a>, super::DecodeError> {
        if bytes.len() != len {
            return Err(super::DecodeError::WrongLength {
                what,
                expected: len,
                actual: bytes.len(),
            });
        }
        let mut reader = FieldReader(bytes);
        if reader.take::<4>() != *magic {
            return Err(super::DecodeError::BadTag { what });
        }
        Ok(reader)
    }

    /// The next `N` bytes.
    pub(crate) fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let n = N.min(self.0.len());
        let (head, tail) = self.0.split_at(n);
        out[..n].copy_from_slice(head);
        self.0 = tail;
        out
    }
}

/// The start time of process `pid` (clock ticks since boot). A missing process reads
/// as an [`IdentityError::Read`] whose source is `NotFound`.
pub(crate) fn start_time_of(pid: u32) -> Result<u64, IdentityError> {
    let path = format!("/proc/{pid}/stat");
    let stat = std::fs::read_to_string(&path).map_err(|source| IdentityError::Read {
        path: path.clone(),
        source,
    })?;
    parse_start_time(&stat).ok_or(IdentityError::Malformed {
        path,
        what: "no start time in field 22",
    })
}

/// Field 22 of a `/proc/<pid>/stat` line. The command name (field 2) is in parentheses
/// and may itself hold spaces and parentheses, so fields are counted after the last
/// `)`: the state (field 3) comes first there.
fn parse_start_time(stat: &str) -> Option<u64> {
    let (_, after_comm) = stat.rsplit_once(')')?;
    after_comm
        .split_ascii_whitespace()
        .nth(22 - 3)?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_survives_odd_command_names() {
        let fields = (3..=30)
            .map(|n| n.to_string())
            .collect::<Vec<_>>()
            .join(" ");
        let line = format!("1234 (we) (ird name) {fields}\n");
        assert_eq!(parse_start_time(&line), Some(22));
        assert_eq!(parse_start_time("1234 (short) S 1 2"), None);
        assert_eq!(parse_start_time("no parenthesis"), None);
    }

    #[test]
    fn current_identity_is_stable_and_round_trips() {
        let me = ProcessIdentity::current().expect("identity readable on Linux");
        assert_eq!(me.pid, std::process::id());
        assert_eq!(ProcessIdentity::current().expect("cached"), me);
        assert_eq!(me.mismatch(&me), None);
        let mut bytes = [0u8; ProcessIdentity::ENCODED_LEN];
        me.encode_into(&mut bytes);
        assert_eq!(ProcessIdentity::decode_from(&bytes), me);
        let other = ProcessIdentity {
            pid_namespace: me.pid_namespace ^ 1,
            ..me
        };
        assert_eq!(me.mismatch(&other), Some("pid namespace"));
    }
}
