//! A good client's latency while the store server is attacked (issue 24): "a good
//! client's request is still answered within 10 ms (p99 over the suite)", on
//! `--io io-uring` and `--io epoll`.
//!
//! Each attack class of the memory-budget suite (a reply too large to build, a peer
//! that never reads, APPEND past the value limit, SET past the store limit, unfinished
//! MULTI_SETs, a burst of clients that reset, the 800-connection burst) runs
//! against a `rdzv store serve` child with small limits, while a good client asks every
//! 2 ms. Each class also asserts what the budget asks (the server's peak RSS under its
//! budget plus a slack, the server alive, every attacker answered or cleanly closed).
//!
//! So that the figure is the server's, not this machine's:
//! - the classes run one after the other, one loop after the other (one lock), in a
//!   test binary of their own, so cargo runs no other test of this file beside them;
//! - the attackers run in threads at the lowest priority (nice 19), so that on a small
//!   machine they do not take the CPU from the server or the good client;
//! - the good client times only its request's round trip.
//!
//! The suite asserts the bound over all classes' samples pooled, per loop
//! ([`SUITE_P99`]); each class keeps a backstop ([`CLASS_P99`]) and prints its
//! p50/p99/max. Both bounds are the server's on a machine with CPUs to spare: where the
//! server and the good client waited for a CPU more than [`OVERCOMMITTED`] of the time
//! (their run delay in `schedstat`, e.g. beside a build on 2 CPUs), the figures are
//! printed with `NOT ASSERTED` instead; without `schedstat` they are asserted.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdzv::uring::{IoMode, Store};

#[macro_use]
mod store_io;
mod store_serve;

use store_serve::{
    closed_by_server, get_frame, set_and_confirm, set_frame, string, Serve, HIGH_WATER, MAX_CONN,
    MAX_STORE, MAX_VALUE, VALIDATE,
};

/// The bound: the good client's p99 over every class's samples, per loop.
const SUITE_P99: Duration = Duration::from_millis(10);
/// A backstop per class: one class much worse than the others fails even when the
/// pooled p99 hides it.
const CLASS_P99: Duration = Duration::from_millis(50);
/// The good client's longest wait in [`a_burst_of_800_large_gets_then_resets`].
/// Measured on the shared 2-vCPU VM with debug servers (2026-11-28), one test at a time,
/// load average 2.5-3.5: epoll 28-42 ms (once 116), io_uring 14-52 ms; under load 10-19
/// (other engineers' builds) up to 194 ms. The bound is about 5x the usual worst and 2x
/// the quiet outlier, and below the 303 ms epoll stalled a good client for before light
/// connections were exempted from its round cap (so that stall would fail it).
const BURST_MAX_WAIT: Duration = Duration::from_millis(250);
/// The share of the suite's time the server and the good client may spend waiting for a
/// CPU (their scheduler run delay, summed) before the latency bounds say more about the
/// machine than about the server: beyond it they are printed, not asserted.
const OVERCOMMITTED: f64 = 0.05;
/// How long the good client asks per class, at least.
const PROBE_FOR: Duration = Duration::from_millis(1500);
/// One suite at a time: the two loops' suites do not run beside each other.
static SUITE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `attack` in a thread at the lowest priority and returns what it returns.
fn niced<T: Send>(attack: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|scope| {
        let thread = scope.spawn(|| {
            // On Linux a thread id names one thread: only the attacker is lowered.
            if let Err(error) =
                rustix::process::setpriority_process(Some(rustix::thread::gettid()), 19)
            {
                println!("the attacker runs at normal priority: setpriority failed: {error}");
            }
            attack()
        });
        thread
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// A good client asking every 2 ms while an attack runs, and for at least
/// [`PROBE_FOR`] in all (so that the p99 is over hundreds of requests); its latencies.
struct Probe {
    started: Instant,
    /// The server's run delay when the probe started.
    server_delay: Option<Duration>,
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<(Vec<Duration>, Option<Duration>)>,
}

/// What the good client saw in one class, and how long it and the server waited for a
/// CPU meanwhile.
struct Sample {
    took: Vec<Duration>,
    /// The server's and the good client's run delay over the class; `None` where the
    /// kernel does not keep it.
    waited: Option<Duration>,
    /// How long the good client asked.
    wall: Duration,
}

fn own_run_delay() -> Option<Duration> {
    store_serve::run_delay_of(std::path::Path::new("/proc/thread-self/schedstat"))
}

impl Probe {
    fn start(serve: &Serve) -> Probe {
        let store = serve.store();
        store.set("precious", b"kept").unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let delay = own_run_delay();
            let mut took = Vec::with_capacity(2048);
            while !flag.load(Ordering::Relaxed) {
                let started = Instant::now();
                let value = store.get("precious");
                took.push(started.elapsed());
                assert_eq!(value.unwrap(), b"kept");
                std::thread::sleep(Duration::from_millis(2));
            }
            let waited = own_run_delay()
                .zip(delay)
                .map(|(end, start)| end.saturating_sub(start));
            (took, waited)
        });
        Probe {
            started: Instant::now(),
            server_delay: serve.run_delay(),
            stop,
            thread,
        }
    }

    /// Stops (after [`PROBE_FOR`] in all) and returns the good client's latencies.
    fn finish(self, serve: &Serve) -> Sample {
        if let Some(left) = PROBE_FOR.checked_sub(self.started.elapsed()) {
            std::thread::sleep(left);
        }
        self.stop.store(true, Ordering::Relaxed);
        let server_waited = serve
            .run_delay()
            .zip(self.server_delay)
            .map(|(end, start)| end.saturating_sub(start));
        let (took, probe_waited) = self.thread.join().expect("the good client");
        Sample {
            took,
            waited: server_waited
                .zip(probe_waited)
                .map(|(server, probe)| server + probe),
            wall: self.started.elapsed(),
        }
    }
}

/// The `q`-quantile (0..=1) of sorted samples.
fn quantile(sorted: &[Duration], q: f64) -> Duration {
    let at = ((sorted.len() as f64 * q) as usize).min(sorted.len() - 1);
    sorted[at]
}

fn budget_base(io: IoMode) -> (Serve, u64) {
    let serve = Serve::start(io, None);
    let base = serve.status_kib("VmRSS:");
    (serve, base)
}

/// MULTI_GET naming one 1 MiB key 131072 times (a 128 GiB reply): the connection is
/// closed before anything is built.
fn a_reply_too_large_to_build(io: IoMode) -> Sample {
    let (mut serve, base) = budget_base(io);
    let probe = Probe::start(&serve);
    set_and_confirm(&serve, "big", &vec![1u8; MAX_VALUE]);
    let mut s = serve.raw();
    niced(|| {
        s.write_all(&VALIDATE).unwrap();
        let mut f = vec![10u8];
        f.extend_from_slice(&131_072u64.to_le_bytes());
        for _ in 0..131_072 {
            string(&mut f, b"/big");
        }
        s.write_all(&f).unwrap();
        assert!(closed_by_server(&mut s));
    });
    let took = probe.finish(&serve);
    serve.check("MULTI_GET 128 GiB", base, MAX_VALUE + MAX_CONN);
    took
}

/// 100 pipelined GETs of a 1 MiB value, not read for a while: the server holds at most
/// the mark plus one reply for them, and every reply arrives once the client reads.
fn a_peer_that_does_not_read(io: IoMode) -> Sample {
    let (mut serve, base) = budget_base(io);
    let probe = Probe::start(&serve);
    let value = vec![7u8; MAX_VALUE];
    set_and_confirm(&serve, "big", &value);
    let mut s = serve.raw();
    let count = 100;
    niced(|| {
        s.write_all(&VALIDATE).unwrap();
        let frame = get_frame(b"/big");
        let mut all = Vec::new();
        for _ in 0..count {
            all.extend_from_slice(&frame);
        }
        s.write_all(&all).unwrap();
    });
    std::thread::sleep(Duration::from_millis(500));
    serve.check("100 GETs unread", base, MAX_VALUE + HIGH_WATER + MAX_VALUE);
    niced(|| {
        let mut reply = vec![0u8; 8 + value.len()];
        for i in 0..count {
            s.read_exact(&mut reply)
                .unwrap_or_else(|e| panic!("reply {i}: {e}"));
            assert_eq!(reply[..8], (value.len() as u64).to_le_bytes(), "reply {i}");
        }
    });
    probe.finish(&serve)
}

/// APPENDs of 300 KiB: the one that would pass the 1 MiB value limit closes the
/// connection and is not applied.
fn append_past_the_value_limit(io: IoMode) -> Sample {
    let (mut serve, base) = budget_base(io);
    let probe = Probe::start(&serve);
    let mut s = serve.raw();
    niced(|| {
        s.write_all(&VALIDATE).unwrap();
        for _ in 0..8 {
            let mut f = vec![9u8];
            string(&mut f, b"/grown");
            string(&mut f, &vec![3u8; 300 << 10]);
            if s.write_all(&f).is_err() {
                break;
            }
        }
        assert!(closed_by_server(&mut s));
    });
    let grown = serve.store().get("grown").unwrap();
    assert_eq!(
        grown.len(),
        3 * (300 << 10),
        "three APPENDs fit, the fourth not"
    );
    let took = probe.finish(&serve);
    serve.check("APPEND", base, MAX_VALUE + MAX_CONN);
    took
}

/// SETs of 1 MiB on new keys: the one that would pass the 16 MiB store limit closes
/// the connection; everything before it is kept.
fn set_past_the_store_limit(io: IoMode) -> Sample {
    let (mut serve, base) = budget_base(io);
    let probe = Probe::start(&serve);
    let mut s = serve.raw();
    niced(|| {
        s.write_all(&VALIDATE).unwrap();
        let value = vec![5u8; MAX_VALUE];
        for i in 0..64 {
            if s.write_all(&set_frame(format!("/k{i}").as_bytes(), &value))
                .is_err()
            {
                break;
            }
        }
        assert!(closed_by_server(&mut s));
    });
    let store = serve.store();
    assert_eq!(
        store.get("k0").unwrap().len(),
        MAX_VALUE,
        "earlier keys are kept"
    );
    assert!(
        !store.check(&["k20"]).unwrap(),
        "the store stopped at its limit"
    );
    let took = probe.finish(&serve);
    serve.check("SET flood", base, MAX_STORE + MAX_CONN);
    took
}

/// Four MULTI_SETs claiming 128 Ki pairs of 1 MiB values, sent in part and left
/// unfinished: each is closed once it passes the connection budget.
fn unfinished_multi_sets(io: IoMode) -> Sample {
    let (mut serve, base) = budget_base(io);
    let probe = Probe::start(&serve);
    let closed = niced(|| {
        let mut closed = Vec::new();
        for _ in 0..4 {
            let mut s = serve.raw();
            s.write_all(&VALIDATE).unwrap();
            let mut f = vec![11u8];
            f.extend_from_slice(&(128u64 << 10).to_le_bytes());
            s.write_all(&f).unwrap();
            let chunk = vec![0u8; 256 << 10];
            let mut pair = Vec::new();
            string(&mut pair, b"/m");
            pair.extend_from_slice(&(MAX_VALUE as u64).to_le_bytes());
            let mut refused = false;
            'pairs: for _ in 0..16 {
                if s.write_all(&pair).is_err() {
                    refused = true;
                    break;
                }
                for _ in 0..4 {
                    if s.write_all(&chunk).is_err() {
                        refused = true;
                        break 'pairs;
                    }
                }
            }
            closed.push(refused || closed_by_server(&mut s));
        }
        closed
    });
    assert_eq!(closed, [true; 4], "every unfinished MULTI_SET was closed");
    let took = probe.finish(&serve);
    serve.check("unfinished MULTI_SET", base, 4 * MAX_CONN);
    took
}

/// 200 connections that each send 4 GETs of a 1 MiB value and reset: others are still
/// answered promptly (the `--io epoll` stall of issue 24).
fn a_burst_of_resetting_clients(io: IoMode) -> Sample {
    let (mut serve, base) = budget_base(io);
    let probe = Probe::start(&serve);
    set_and_confirm(&serve, "big", &vec![9u8; MAX_VALUE]);
    let port = serve.port;
    niced(|| {
        let mut frames = VALIDATE.to_vec();
        for _ in 0..4 {
            frames.extend_from_slice(&get_frame(b"/big"));
        }
        for _ in 0..4 {
            let mut burst = Vec::new();
            for _ in 0..50 {
                let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
                    continue;
                };
                let _ = s.write_all(&frames);
                burst.push(s);
            }
            std::thread::sleep(Duration::from_millis(20));
            // Unread replies in the receive buffer: close sends RST.
            drop(burst);
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    let took = probe.finish(&serve);
    // Every connection may pin the mark plus one reply until its reset is seen.
    serve.check(
        "resetting burst",
        base,
        MAX_VALUE + 50 * (HIGH_WATER + MAX_VALUE),
    );
    took
}

/// The burst: 800 connections that each pipeline four GETs of a 4 MiB value,
/// then reset (their replies unread): the good client's longest wait stays under
/// [`BURST_MAX_WAIT`], and the server stays up and serves.
fn a_burst_of_800_large_gets_then_resets(io: IoMode) -> Sample {
    const CONNECTIONS: usize = 800;
    const VALUE: usize = 4 << 20;
    let limit = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|limits| {
            limits
                .lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3).map(str::to_string))
        })
        .and_then(|soft| soft.parse::<usize>().ok());
    if limit.is_some_and(|soft| soft < CONNECTIONS + 64) {
        println!(
            "SKIPPED: the burst needs {} descriptors; this process may open {limit:?} (raise ulimit -n)",
            CONNECTIONS + 64
        );
        return Sample {
            took: Vec::new(),
            waited: None,
            wall: Duration::ZERO,
        };
    }
    let mut serve = Serve::start_with(io, None, VALUE, 2 * VALUE);
    let probe = Probe::start(&serve);
    set_and_confirm(&serve, "big", &vec![7u8; VALUE]);
    let port = serve.port;
    let opened = niced(|| {
        let mut frames = VALIDATE.to_vec();
        for _ in 0..4 {
            frames.extend_from_slice(&get_frame(b"/big"));
        }
        let mut burst = Vec::with_capacity(CONNECTIONS);
        for _ in 0..CONNECTIONS {
            let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
                continue;
            };
            let _ = s.write_all(&frames);
            burst.push(s);
        }
        let opened = burst.len();
        std::thread::sleep(Duration::from_millis(50));
        // Unread replies in the receive buffer: close sends RST.
        drop(burst);
        opened
    });
    std::thread::sleep(Duration::from_millis(300));
    println!("burst of {CONNECTIONS}: {opened} connected");
    assert!(opened * 10 >= CONNECTIONS * 9, "only {opened} connected");
    let took = probe.finish(&serve);
    let worst = took.took.iter().max().copied().unwrap_or_default();
    assert!(
        worst <= BURST_MAX_WAIT,
        "burst of 800: the good client waited {worst:?} once"
    );
    assert!(
        serve.peer.child_mut().try_wait().unwrap().is_none(),
        "the server died"
    );
    assert_eq!(serve.store().get("precious").unwrap(), b"kept");
    assert_eq!(serve.store().get("big").unwrap().len(), VALUE);
    took
}

/// Every class in sequence against one loop: each class's p50/p99/max printed and its
/// p99 under [`CLASS_P99`]; all samples pooled, p99 under [`SUITE_P99`]. The latency
/// bounds are asserted where the CPUs were not overcommitted (see [`OVERCOMMITTED`]);
/// the rest (RSS, liveness, the burst's longest wait) always.
fn a_good_client_is_answered_within_10_ms_under_every_attack(io: IoMode) {
    type Class = fn(IoMode) -> Sample;
    let classes: [(&str, Class); 7] = [
        ("MULTI_GET 128 GiB", a_reply_too_large_to_build),
        ("100 GETs unread", a_peer_that_does_not_read),
        ("APPEND", append_past_the_value_limit),
        ("SET flood", set_past_the_store_limit),
        ("unfinished MULTI_SET", unfinished_multi_sets),
        ("resetting burst", a_burst_of_resetting_clients),
        (
            "burst of 800 x 4 GETs of 4 MiB",
            a_burst_of_800_large_gets_then_resets,
        ),
    ];
    let _one = SUITE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let mut pooled = Vec::new();
    let mut over = Vec::new();
    let mut waited = Some(Duration::ZERO);
    let mut wall = Duration::ZERO;
    for (name, class) in classes {
        let mut sample = class(io);
        if sample.took.is_empty() {
            continue;
        }
        let took = &mut sample.took;
        took.sort();
        let p99 = quantile(took, 0.99);
        println!(
            "{io:?} {name}: good client p50 {:?} p99 {p99:?} max {:?} over {} requests; \
             server and client waited for a CPU {}",
            quantile(took, 0.5),
            took[took.len() - 1],
            took.len(),
            share(sample.waited, sample.wall)
        );
        if p99 > CLASS_P99 {
            over.push(format!("{name}: p99 {p99:?}"));
        }
        waited = waited.zip(sample.waited).map(|(a, b)| a + b);
        wall += sample.wall;
        pooled.append(took);
    }
    assert!(!pooled.is_empty(), "no class ran");
    pooled.sort();
    let p99 = quantile(&pooled, 0.99);
    println!(
        "{io:?} suite: good client p50 {:?} p99 {p99:?} max {:?} over {} requests; \
         server and client waited for a CPU {}",
        quantile(&pooled, 0.5),
        pooled[pooled.len() - 1],
        pooled.len(),
        share(waited, wall)
    );
    let overcommitted =
        waited.is_some_and(|w| w.as_secs_f64() > OVERCOMMITTED * wall.as_secs_f64());
    if overcommitted {
        println!(
            "NOT ASSERTED: p99 <= {SUITE_P99:?} over the suite and <= {CLASS_P99:?} per class: \
             the server and the good client waited for a CPU more than {:.0}% of the time \
             (this machine's CPUs are overcommitted; the bound is the server's on spare CPUs)",
            OVERCOMMITTED * 100.0
        );
        return;
    }
    assert!(over.is_empty(), "classes over {CLASS_P99:?}: {over:?}");
    assert!(
        p99 <= SUITE_P99,
        "{io:?}: the good client's p99 over the suite is {p99:?}"
    );
}

/// `waited` as a share of `wall`, for the report.
fn share(waited: Option<Duration>, wall: Duration) -> String {
    match waited {
        Some(waited) => format!(
            "{waited:.1?} ({:.1}%)",
            100.0 * waited.as_secs_f64() / wall.as_secs_f64().max(1e-9)
        ),
        None => "(unknown: no schedstat)".to_string(),
    }
}

on_every_io!(a_good_client_is_answered_within_10_ms_under_every_attack);
