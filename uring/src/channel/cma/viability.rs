//! Whether the cma channel can work in this process, and with whom: TensorPipe's checks,
//! folded into a domain descriptor that two peers compare for equality
//! (`rdzv_core::negotiate`).
//!
//! A peer can read this process's memory with `process_vm_readv` only if the kernel's
//! ptrace access check passes. So cma is viable here when:
//!
//! - real, effective and saved uid agree, and so do the gids (a process that changed
//!   credentials cannot be read by its peers), and the process is dumpable;
//! - Yama's `ptrace_scope` allows it: absent or 0 is fine; 1 is fine once this process
//!   declared any process its ptracer (`prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`,
//!   which [`viability`] does, for the rest of the process's life); 2 needs
//!   `CAP_SYS_PTRACE` in the effective set; 3 forbids it;
//! - a test `process_vm_readv` of this process's own memory succeeds (seccomp
//!   profiles, such as Docker's default, refuse the call).
//!
//! The descriptor, `cma:<boot id>_<user ns>_<pid ns>_<uid>_<gid>_<permitted caps>`, is
//! equal only for processes of the same boot, user and pid namespaces, uid, gid and
//! permitted capabilities: the remaining conditions of the kernel's check. This module
//! reads `/proc` and calls `prctl`; it does not read any peer.

use std::fmt;
use std::io;

use super::read::{read_pieces, Piece};
use crate::channel::current_identity;
use crate::host::{boot_id, IdentityError};

/// Yama's setting.
const PTRACE_SCOPE_PATH: &str = "/proc/sys/kernel/yama/ptrace_scope";
/// Our credentials and capabilities.
const STATUS_PATH: &str = "/proc/self/status";
/// `CAP_SYS_PTRACE`'s bit in the capability masks.
const CAP_SYS_PTRACE: u32 = 19;

/// Yama's `kernel.yama.ptrace_scope`, which decides who may read whose memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PtraceScope {
    /// Yama is not enabled: only the classic uid and capability checks apply.
    Absent,
    /// 0: classic checks only.
    Classic,
    /// 1: a process may read only its descendants, or processes that declared it (or
    /// any process) their ptracer.
    Restricted,
    /// 2: only processes with `CAP_SYS_PTRACE`.
    AdminOnly,
    /// 3: no process may, whatever its capabilities.
    NoAttach,
    /// The file exists but could not be read or holds another value.
    Unknown,
}

impl PtraceScope {
    /// This host's setting, read now.
    pub fn current() -> PtraceScope {
        match std::fs::read_to_string(PTRACE_SCOPE_PATH) {
            Ok(text) => PtraceScope::parse(&text),
            Err(e) if e.kind() == io::ErrorKind::NotFound => PtraceScope::Absent,
            Err(_) => PtraceScope::Unknown,
        }
    }

    fn parse(text: &str) -> PtraceScope {
        match text.trim() {
            "0" => PtraceScope::Classic,
            "1" => PtraceScope::Restricted,
            "2" => PtraceScope::AdminOnly,
            "3" => PtraceScope::NoAttach,
            _ => PtraceScope::Unknown,
        }
    }
}

impl fmt::Display for PtraceScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PtraceScope::Absent => "Yama is not enabled",
            PtraceScope::Classic => "kernel.yama.ptrace_scope is 0",
            PtraceScope::Restricted => "kernel.yama.ptrace_scope is 1",
            PtraceScope::AdminOnly => "kernel.yama.ptrace_scope is 2",
            PtraceScope::NoAttach => "kernel.yama.ptrace_scope is 3",
            PtraceScope::Unknown => "kernel.yama.ptrace_scope is unreadable or unknown",
        })
    }
}

/// What the Yama setting requires of this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ScopeVerdict {
    /// Nothing.
    Allowed,
    /// Declaring any process our ptracer.
    NeedsPtracerAny,
}

/// The pure part of the Yama check.
fn judge_scope(scope: PtraceScope, cap_sys_ptrace: bool) -> Result<ScopeVerdict, NotViable> {
    match scope {
        PtraceScope::Absent | PtraceScope::Classic => Ok(ScopeVerdict::Allowed),
        PtraceScope::Restricted => Ok(ScopeVerdict::NeedsPtracerAny),
        PtraceScope::AdminOnly if cap_sys_ptrace => Ok(ScopeVerdict::Allowed),
        PtraceScope::AdminOnly | PtraceScope::NoAttach | PtraceScope::Unknown => {
            Err(NotViable::PtraceScope { scope })
        }
    }
}

/// Credentials and capabilities from `/proc/self/status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Credentials {
    /// Real, effective, saved and filesystem uid.
    uids: [u32; 4],
    /// Real, effective, saved and filesystem gid.
    gids: [u32; 4],
    /// Permitted capabilities.
    permitted: u64,
    /// Effective capabilities.
    effective: u64,
}

fn parse_status(status: &str) -> Option<Credentials> {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
    };
    let ids = |name: &str| -> Option<[u32; 4]> {
        let mut out = [0u32; 4];
        let mut values = field(name)?.split_ascii_whitespace();
        for slot in &mut out {
            *slot = values.next()?.parse().ok()?;
        }
        Some(out)
    };
    let caps = |name: &str| u64::from_str_radix(field(name)?, 16).ok();
    Some(Credentials {
        uids: ids("Uid")?,
        gids: ids("Gid")?,
        permitted: caps("CapPrm")?,
        effective: caps("CapEff")?,
    })
}

/// The cma channel's domain descriptor (see the module docs): pass
/// [`CmaDomain::as_str`] to `rdzv_core::negotiate::Offer::add_channel` for
/// `ChannelKind::Cma` as the CPU descriptor.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CmaDomain(String);

impl CmaDomain {
    /// The descriptor text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for CmaDomain {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for CmaDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why the cma channel cannot be used in this process.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NotViable {
    /// The boot id or a namespace could not be read.
    #[error("cma channel not viable: {0}")]
    Identity(#[from] IdentityError),
    /// `/proc/self/status` could not be read or parsed.
    #[error("cma channel not viable: cannot read credentials from {STATUS_PATH}: {source}")]
    Status {
        /// What failed.
        #[source]
        source: io::Error,
    },
    /// Real, effective and saved ids differ, so peers with this uid may not read us.
    #[error(
        "cma channel not viable: real, effective and saved ids differ (uids {uids:?}, \
         gids {gids:?}); the kernel refuses to let peers read such a process"
    )]
    MixedCredentials {
        /// Real, effective, saved and filesystem uid.
        uids: [u32; 4],
        /// Real, effective, saved and filesystem gid.
        gids: [u32; 4],
    },
    /// The process is not dumpable (set-uid, or `PR_SET_DUMPABLE` 0), so peers may not
    /// read it.
    #[error("cma channel not viable: this process is not dumpable (prctl PR_GET_DUMPABLE)")]
    NotDumpable,
    /// Yama forbids it.
    #[error(
        "cma channel not viable: {scope}; reading another process's memory needs \
         CAP_SYS_PTRACE with scope 2 and is impossible with scope 3"
    )]
    PtraceScope {
        /// The setting found.
        scope: PtraceScope,
    },
    /// `prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)` failed under ptrace_scope 1.
    #[error(
        "cma channel not viable: kernel.yama.ptrace_scope is 1 and \
         prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) failed: {source}"
    )]
    SetPtracer {
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A `process_vm_readv` of this process's own memory failed (a seccomp policy such
    /// as Docker's default, or a kernel without CMA).
    #[error(
        "cma channel not viable: test process_vm_readv on this process failed: {}",
        match .source { Some(e) => e.to_string(), None => "no bytes moved".to_owned() }
    )]
    SelfTest {
        /// The OS error, if one was reported.
        #[source]
        source: Option<io::Error>,
    },
}

/// Checks that the cma channel can work in this process and returns its domain
/// descriptor. Under Yama `ptrace_scope` 1 it also calls `prctl(PR_SET_PTRACER,
/// PR_SET_PTRACER_ANY)`, which lets any process of this user read this process's memory
/// for the rest of its life: call it only in processes that export buffers over cma.
pub fn viability() -> Result<CmaDomain, NotViable> {
    let identity = current_identity()?;
    let (_, boot_text) = boot_id()?;
    let status =
        std::fs::read_to_string(STATUS_PATH).map_err(|source| NotViable::Status { source })?;
    let credentials = parse_status(&status).ok_or_else(|| NotViable::Status {
        source: io::Error::new(io::ErrorKind::InvalidData, "no Uid/Gid/CapPrm/CapEff lines"),
    })?;
    let [uid, euid, suid, _] = credentials.uids;
    let [gid, egid, sgid, _] = credentials.gids;
    if uid != euid || uid != suid || gid != egid || gid != sgid {
        return Err(NotViable::MixedCredentials {
            uids: credentials.uids,
            gids: credentials.gids,
        });
    }
    match rustix::process::dumpable_behavior() {
        Ok(rustix::process::DumpableBehavior::Dumpable) => {}
        Ok(_) => return Err(NotViable::NotDumpable),
        Err(errno) => {
            return Err(NotViable::Status {
                source: errno.into(),
            })
        }
    }
    let cap_sys_ptrace = credentials.effective & (1 << CAP_SYS_PTRACE) != 0;
    if judge_scope(PtraceScope::current(), cap_sys_ptrace)? == ScopeVerdict::NeedsPtracerAny {
        rustix::process::set_ptracer(rustix::process::PTracer::Any).map_err(|errno| {
            NotViable::SetPtracer {
                source: errno.into(),
            }
        })?;
    }
    self_test()?;
    Ok(CmaDomain(format!(
        "cma:{boot_text}_{}_{}_{uid}_{gid}_{:016x}",
        identity.user_namespace, identity.pid_namespace, credentials.permitted
    )))
}

/// Reads a few bytes of this process through `process_vm_readv`.
fn self_test() -> Result<(), NotViable> {
    let source: [u8; 8] = *b"rdzv-cma";
    let mut target = [0u8; 8];
    let pid = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
    let mut pieces = [Piece {
        remote: source.as_ptr() as usize as u64,
        local: &mut target,
    }];
    read_pieces(pid, &mut pieces).map_err(|failure| NotViable::SelfTest {
        source: failure.source,
    })?;
    if target == source {
        Ok(())
    } else {
        Err(NotViable::SelfTest { source: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yama_rules() {
        assert_eq!(
            judge_scope(PtraceScope::Absent, false).ok(),
            Some(ScopeVerdict::Allowed)
        );
        assert_eq!(
            judge_scope(PtraceScope::Classic, false).ok(),
            Some(ScopeVerdict::Allowed)
        );
        assert_eq!(
            judge_scope(PtraceScope::Restricted, false).ok(),
            Some(ScopeVerdict::NeedsPtracerAny)
        );
        assert_eq!(
            judge_scope(PtraceScope::AdminOnly, true).ok(),
            Some(ScopeVerdict::Allowed)
        );
        let refused = judge_scope(PtraceScope::AdminOnly, false).expect_err("scope 2, no cap");
        assert!(
            refused.to_string().contains("ptrace_scope is 2"),
            "{refused}"
        );
        assert!(judge_scope(PtraceScope::NoAttach, true).is_err());
        assert!(judge_scope(PtraceScope::Unknown, true).is_err());
        assert_eq!(PtraceScope::parse("1\n"), PtraceScope::Restricted);
        assert_eq!(PtraceScope::parse("7"), PtraceScope::Unknown);
    }

    #[test]
    fn status_parsing() {
        let status = "Name:\tx\nUid:\t1000\t1000\t1000\t1000\nGid:\t100\t101\t100\t100\n\
                      CapInh:\t0000000000000000\nCapPrm:\t0000000000080000\n\
                      CapEff:\t0000000000080000\n";
        let parsed = parse_status(status).expect("parses");
        assert_eq!(parsed.uids, [1000; 4]);
        assert_eq!(parsed.gids, [100, 101, 100, 100]);
        assert_eq!(parsed.effective, 1 << CAP_SYS_PTRACE);
        assert_eq!(parse_status("Uid:\t1\t2\n"), None);
    }

    #[test]
    fn this_host_is_viable_and_stable() {
        match viability() {
            Ok(domain) => {
                assert!(domain.as_str().starts_with("cma:"));
                assert_eq!(viability().ok(), Some(domain));
            }
            // A sandbox may forbid CMA; the reason must then say why.
            Err(reason) => {
                eprintln!("cma not viable on this host, checked only the reason: {reason}");
                assert!(reason.to_string().starts_with("cma channel not viable"));
            }
        }
    }
}
