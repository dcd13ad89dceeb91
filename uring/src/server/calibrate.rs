//! How [`IoMode::Auto`] picks a loop where the host allows io_uring: by measuring, once
//! per process, what each loop costs this host per request.
//!
//! io_uring is not cheaper everywhere. On the 2-vCPU development VM its loop spends more
//! user-space instructions per request than epoll's (`docs/performance.md`), while
//! elsewhere its batched submissions save system calls. So rather than trust either, the
//! first `Auto` server of a process starts one throw-away server of each kind on
//! loopback, drives the same ADD load through both ([`CONNS`] connections in lockstep,
//! so that a loop serves several per turn; client and loop pinned to one CPU), and
//! reads the CPU time (user and kernel) each loop thread spent per request from
//! `/proc/self/task/TID/schedstat`. The cheaper one
//! is the default from then on; the two figures are logged at info. The whole
//! measurement takes about 0.15 s. Where it cannot be made (no schedstat,
//! loopback refused), `Auto` keeps io_uring and says why.
//!
//! With client and loop on one CPU the measurement cannot see a cost that crosses CPUs:
//! before the ring deferred its task work to the loop's own waits (Linux 6.1,
//! `sys::uring::Ring::new`), each packet for a running io_uring loop interrupted it,
//! and under 64 connections io_uring served a third fewer requests than epoll while this
//! measurement still preferred it (`docs/performance.md`, 2026-12-03).
//!
//! An explicit `--io io-uring` or `--io epoll` measures nothing.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

use rdzv_core::store::{Request, VALIDATION_MAGIC};

use super::{IdleSpin, IoMode, ServerOptions, StoreServer};

/// Connections driven in lockstep: each round sends one ADD on each, then reads the
/// replies.
const CONNS: usize = 4;
/// Rounds before the measured ones (first allocations, caches).
const WARM_UP_ROUNDS: usize = 250;
/// Measured rounds per sample.
const ROUNDS: usize = 100;
/// Samples per loop, alternating between the two; the lowest of each counts (noise only
/// ever adds CPU time).
const SAMPLES: usize = 4;
/// How long one client read may wait before the measurement is given up.
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// What the measurement found: CPU time per request of each loop's thread.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Costs {
    /// Nanoseconds per request on io_uring.
    pub(crate) io_uring_ns: f64,
    /// Nanoseconds per request on epoll.
    pub(crate) epoll_ns: f64,
}

impl Costs {
    /// The cheaper loop; a tie goes to io_uring.
    pub(crate) fn choice(&self) -> IoMode {
        if self.epoll_ns < self.io_uring_ns {
            IoMode::Epoll
        } else {
            IoMode::IoUring
        }
    }
}

/// The loop `Auto` runs on in this process (measured at the first call, then
/// remembered), where io_uring is allowed.
pub(super) fn auto_choice() -> IoMode {
    static CHOICE: OnceLock<IoMode> = OnceLock::new();
    *CHOICE.get_or_init(|| match measure() {
        Ok(costs) => {
            let choice = costs.choice();
            tracing::info!(
                io_uring_ns_per_request = costs.io_uring_ns.round() as u64,
                epoll_ns_per_request = costs.epoll_ns.round() as u64,
                "store I/O measured: {choice} costs this host less CPU per request \
                 (`--io io-uring` or `--io epoll` chooses without measuring)"
            );
            choice
        }
        Err(error) => {
            tracing::info!(
                %error,
                "cannot measure which store loop is cheaper here; the store server runs \
                 on io_uring"
            );
            IoMode::IoUring
        }
    })
}

/// Measures both loops (see the module's documentation), on a thread of its own pinned
/// to the CPU the caller runs on: the probe loops inherit the pin, so client and loop
/// share one CPU. Unpinned, the figures depend on where the scheduler puts the two
/// threads: on the development VM io_uring's loop then read anywhere from 1.8 to 11 µs
/// per request from one run to the next, epoll's 2.0 to 2.3 µs.
pub(crate) fn measure() -> io::Result<Costs> {
    let cpu = rustix::thread::sched_getcpu();
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("rdzv-store-calibrate".into())
            .spawn_scoped(scope, move || {
                let mut set = rustix::thread::CpuSet::new();
                set.set(cpu);
                rustix::thread::sched_setaffinity(None, &set)
                    .map_err(|error| io::Error::other(format!("pinning to CPU {cpu}: {error}")))?;
                // The throw-away servers' start-up lines would read as real servers.
                let quiet = tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default());
                tracing::dispatcher::with_default(&quiet, measure_here)
            })?
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("the measurement panicked")))
    })
}

/// [`measure`] on the calling thread.
fn measure_here() -> io::Result<Costs> {
    let uring = Probe::start(IoMode::IoUring)?;
    let epoll = Probe::start(IoMode::Epoll)?;
    let (mut io_uring_ns, mut epoll_ns) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..SAMPLES {
        io_uring_ns = io_uring_ns.min(uring.sample()?);
        epoll_ns = epoll_ns.min(epoll.sample()?);
    }
    std::thread::scope(|scope| {
        scope.spawn(|| uring.server.shutdown());
        epoll.server.shutdown();
    });
    Ok(Costs {
        io_uring_ns,
        epoll_ns,
    })
}

/// One throw-away server of one kind, its clients connected and validated.
struct Probe {
    server: StoreServer,
    conns: Vec<TcpStream>,
    /// One ADD frame, sent on every connection every round.
    add: Vec<u8>,
}

impl Probe {
    fn start(io: IoMode) -> io::Result<Probe> {
        let server = StoreServer::start(ServerOptions {
            host: Some("127.0.0.1".into()),
            port: 0,
            threads: 1,
            io,
            spin_before_park: IdleSpin::Off,
            drain_timeout: Duration::from_millis(100),
            ..ServerOptions::default()
        })
        .map_err(|error| io::Error::other(format!("starting a {io} server: {error}")))?;
        let mut validate = Vec::new();
        Request::Validate {
            magic: VALIDATION_MAGIC,
        }
        .encode_into(&mut validate);
        let mut add = Vec::new();
        Request::Add {
            key: b"rdzv/calibrate",
            delta: 1,
        }
        .encode_into(&mut add);
        let conns = (0..CONNS)
            .map(|_| connect(server.local_addr(), &validate))
            .collect::<io::Result<Vec<_>>>()?;
        let probe = Probe { server, conns, add };
        probe.rounds(WARM_UP_ROUNDS)?;
        Ok(probe)
    }

    /// `rounds` rounds of one ADD per connection.
    fn rounds(&self, rounds: usize) -> io::Result<()> {
        let mut reply = [0u8; 8];
        for _ in 0..rounds {
            for mut conn in &self.conns {
                conn.write_all(&self.add)?;
            }
            for mut conn in &self.conns {
                conn.read_exact(&mut reply)?;
            }
        }
        Ok(())
    }

    /// The loop thread's CPU nanoseconds per request over [`ROUNDS`] rounds.
    fn sample(&self) -> io::Result<f64> {
        let before = self.settled_cpu_ns()?;
        self.rounds(ROUNDS)?;
        let after = self.settled_cpu_ns()?;
        Ok(after.saturating_sub(before) as f64 / (ROUNDS * CONNS) as f64)
    }

    /// The loop's CPU time once it is asleep again (it may still be finishing the turn
    /// that sent the last reply): read until two reads a millisecond apart agree.
    fn settled_cpu_ns(&self) -> io::Result<u64> {
        let mut last = self.server.loop_cpu_ns()?;
        for _ in 0..20 {
            std::thread::sleep(Duration::from_millis(1));
            let now = self.server.loop_cpu_ns()?;
            if now == last {
                break;
            }
            last = now;
        }
        Ok(last)
    }
}

fn connect(addr: SocketAddr, validate: &[u8]) -> io::Result<TcpStream> {
    let mut conn = TcpStream::connect_timeout(&addr, IO_TIMEOUT)?;
    conn.set_nodelay(true)?;
    conn.set_read_timeout(Some(IO_TIMEOUT))?;
    conn.set_write_timeout(Some(IO_TIMEOUT))?;
    conn.write_all(validate)?;
    Ok(conn)
}

/// The CPU time, in nanoseconds, thread `tid` of this process has run: the first field
/// of its `schedstat`. Exact once the thread is asleep (the kernel adds a running
/// thread's time when it stops).
pub(super) fn thread_cpu_ns(tid: i32) -> io::Result<u64> {
    let path = format!("/proc/self/task/{tid}/schedstat");
    let text = std::fs::read_to_string(&path)
        .map_err(|error| io::Error::new(error.kind(), format!("reading {path}: {error}")))?;
    text.split_whitespace()
        .next()
        .and_then(|field| field.parse().ok())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{path} does not start with a count of nanoseconds: {text:?}"),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cheaper_loop_is_chosen_and_a_tie_keeps_io_uring() {
        let costs = |io_uring_ns, epoll_ns| Costs {
            io_uring_ns,
            epoll_ns,
        };
        assert_eq!(costs(5_000.0, 4_000.0).choice(), IoMode::Epoll);
        assert_eq!(costs(3_000.0, 4_000.0).choice(), IoMode::IoUring);
        assert_eq!(costs(4_000.0, 4_000.0).choice(), IoMode::IoUring);
    }

    #[test]
    fn a_threads_cpu_time_is_read_and_grows_with_work() {
        let tid = rustix::thread::gettid().as_raw_nonzero().get();
        let before = thread_cpu_ns(tid).expect("schedstat");
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
        }
        // Asleep for a moment, so that the kernel has added the time it ran.
        std::thread::sleep(Duration::from_millis(5));
        let after = thread_cpu_ns(tid).expect("schedstat");
        assert!(after > before, "{before} -> {after} ({x})");
        assert!(thread_cpu_ns(i32::MAX).is_err());
    }

    /// Both loops serve the measurement's load and cost something; which is cheaper
    /// depends on the host, so only the figures' sanity is checked.
    #[test]
    fn both_loops_are_measured() {
        if super::super::io_mode::probe_io_uring().map_or(true, |ok| ok.is_err()) {
            eprintln!("skipped: io_uring is refused here, so Auto never measures");
            return;
        }
        let costs = measure().expect("measured");
        eprintln!("measured: {costs:?}");
        for ns in [costs.io_uring_ns, costs.epoll_ns] {
            assert!(ns.is_finite() && ns > 0.0 && ns < 10_000_000.0, "{costs:?}");
        }
        // A server left to `Auto` runs on the process's measured choice.
        let server = StoreServer::start(ServerOptions {
            host: Some("127.0.0.1".into()),
            port: 0,
            threads: 1,
            ..ServerOptions::default()
        })
        .expect("an Auto server");
        assert_eq!(server.io_mode(), auto_choice());
        server.shutdown();
    }
}
