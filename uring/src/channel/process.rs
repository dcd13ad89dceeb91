//! Which process instance a channel endpoint is, precisely enough that a pid reused by
//! a new process, a pid from another pid namespace or a pid from another boot is never
//! mistaken for the peer.
//!
//! A [`ProcessIdentity`] is the boot id, the pid and user namespaces (inode numbers of
//! `/proc/self/ns/{pid,user}`), the pid and the process start time (field 22 of
//! `/proc/<pid>/stat`, clock ticks since boot). Two processes alive at the same time
//! never share all of them, and a new process given a dead one's pid has a later start
//! time. The record and its wire form are the core's; this module reads `/proc` for this
//! process and for peers. It does not open or watch peers.

use std::sync::Mutex;

pub use crate::host::IdentityError;
use crate::host::{boot_id, namespace_inode, PID_NS_PATH, USER_NS_PATH};
pub use rdzv_core::channel::ProcessIdentity;

/// The identity of this process. It is cached, and recomputed after a `fork` (the pid
/// changes).
///
/// # Errors
/// [`IdentityError`] when `/proc` cannot be read.
pub fn current_identity() -> Result<ProcessIdentity, IdentityError> {
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
        let me = current_identity().expect("identity readable on Linux");
        assert_eq!(me.pid, std::process::id());
        assert_eq!(current_identity().expect("cached"), me);
        assert_eq!(me.mismatch(&me), None);
        assert_eq!(ProcessIdentity::decode(&me.encode()), me);
        assert_eq!(start_time_of(me.pid).ok(), Some(me.start_time));
    }
}
