//! Which kernel interface the server's event loops use, and whether io_uring can be used
//! at all on this host.
//!
//! io_uring is refused by the default seccomp profiles of Docker ≥ 25 and containerd 2
//! (`io_uring_setup` fails with `EPERM`), by kernels built without it (`ENOSYS`), and by
//! the `kernel.io_uring_disabled` sysctl (RHEL/Rocky/Alma 9: 1 allows only a group, 2
//! nobody; refused calls fail with `EPERM` or `EACCES`). [`IoMode::Auto`] asks the kernel
//! once, with a small throw-away ring, and falls back to epoll when one of those says
//! no. Any other failure (out of locked memory, say) is reported, not hidden.

use std::io;

/// The kernel interface behind the server's event loops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoMode {
    /// Where the host allows io_uring, whichever of io_uring and epoll costs it less CPU
    /// per request (measured once per process, about 0.15 s; module `calibrate`); epoll
    /// where it refuses io_uring (with a log line saying why).
    #[default]
    Auto,
    /// io_uring only: starting fails where it is refused.
    IoUring,
    /// epoll, thread-per-core: runs wherever Linux does.
    Epoll,
}

impl std::str::FromStr for IoMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(IoMode::Auto),
            "io-uring" | "io_uring" | "uring" => Ok(IoMode::IoUring),
            "epoll" => Ok(IoMode::Epoll),
            other => Err(format!(
                "unknown store I/O mode {other:?}: expected `auto`, `io-uring` or `epoll`"
            )),
        }
    }
}

impl std::fmt::Display for IoMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IoMode::Auto => "auto",
            IoMode::IoUring => "io-uring",
            IoMode::Epoll => "epoll",
        })
    }
}

/// Why io_uring cannot be used here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal(pub(crate) String);

/// Whether the errno of a failed `io_uring_setup` means "not here" (fall back) rather
/// than a fault to report.
fn is_refusal(errno: i32) -> bool {
    matches!(errno, libc::EPERM | libc::ENOSYS | libc::EACCES)
}

/// `kernel.io_uring_disabled`, if the kernel has it.
fn disabled_sysctl() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Asks the kernel for a small ring. `Ok(Ok(()))`: io_uring works; `Ok(Err(refusal))`:
/// this host refuses it (fall back); `Err`: it failed for another reason.
pub(crate) fn probe_io_uring() -> io::Result<Result<(), Refusal>> {
    let sysctl = disabled_sysctl();
    if sysctl == Some(2) {
        return Ok(Err(Refusal(
            "kernel.io_uring_disabled=2 forbids io_uring for every process".into(),
        )));
    }
    match io_uring::IoUring::new(2) {
        Ok(_) => Ok(Ok(())),
        Err(e) if e.raw_os_error().is_some_and(is_refusal) => {
            let why = match sysctl {
                Some(1) => format!(
                    "io_uring_setup failed ({e}) and kernel.io_uring_disabled=1 allows it only \
                     to the kernel.io_uring_group group"
                ),
                _ => format!(
                    "io_uring_setup failed ({e}): a seccomp profile (Docker >= 25, containerd 2) \
                     or the kernel refuses io_uring"
                ),
            };
            Ok(Err(Refusal(why)))
        }
        Err(e) => Err(e),
    }
}

/// Hosts with at most this many CPUs run one loop by default.
///
/// There the store's clients share the server's CPUs: on the 2-vCPU development VM,
/// with the load generator on the same host, one io_uring loop served 8–10% more ops/s
/// than two at 64 and 512 connections, at the same latency.
pub(super) const SMALL_HOST_CPUS: usize = 2;

/// How many loops a server runs by default: one per CPU this process may run on
/// (`sched_getaffinity`, and a cgroup CPU quota, as `available_parallelism` reads them),
/// at most `cap`; one on a host of at most [`SMALL_HOST_CPUS`].
pub(super) fn default_loops(cap: usize) -> usize {
    loops_for(
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        cap,
    )
}

/// [`default_loops`] for a host with `cpus` CPUs.
fn loops_for(cpus: usize, cap: usize) -> usize {
    if cpus <= SMALL_HOST_CPUS {
        1
    } else {
        cpus.clamp(1, cap.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_every_mode() {
        for mode in [IoMode::Auto, IoMode::IoUring, IoMode::Epoll] {
            assert_eq!(mode.to_string().parse::<IoMode>(), Ok(mode));
        }
        assert_eq!("io_uring".parse::<IoMode>(), Ok(IoMode::IoUring));
        let err = "kqueue".parse::<IoMode>().unwrap_err();
        assert!(
            err.contains("expected `auto`, `io-uring` or `epoll`"),
            "{err}"
        );
    }

    #[test]
    fn only_refusals_fall_back() {
        assert!(is_refusal(libc::EPERM) && is_refusal(libc::ENOSYS) && is_refusal(libc::EACCES));
        assert!(!is_refusal(libc::ENOMEM) && !is_refusal(libc::EINVAL));
    }

    #[test]
    fn default_loops_is_one_per_cpu_capped_and_one_on_small_hosts() {
        assert_eq!(default_loops(1), 1);
        assert!((1..=16).contains(&default_loops(16)));
        assert_eq!(default_loops(0), 1);
        assert_eq!(loops_for(1, 16), 1);
        assert_eq!(loops_for(2, 16), 1);
        assert_eq!(loops_for(3, 16), 3);
        assert_eq!(loops_for(16, 16), 16);
        assert_eq!(loops_for(128, 16), 16);
        assert_eq!(loops_for(64, 0), 1);
    }
}
