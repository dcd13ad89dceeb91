//! `rdzv bench store simulate --ranks N`: the store's serve step at the scale of a large
//! job, with no sockets. N virtual connections, each a core [`Session`] over one
//! [`Engine`], are driven on this thread with encoded request bytes, in the order a job's
//! ranks would send them:
//!
//! 1. connect and `VALIDATE`;
//! 2. the barrier: `ADD` on a counter key, then `WAIT` on its `done` key; the rank whose
//!    `ADD` reads N sets `done`, which releases every other rank;
//! 3. the all-gather of the job's addresses: every rank `SET`s its address under a key of
//!    its own, then every rank `GET`s the key its neighbour wrote.
//!
//! Each phase's time is this thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`), requests
//! encoded and replies decoded included. Memory is the engine's own account
//! ([`Engine::heap_bytes`]) at three points: idle (validated) connections, every rank but
//! the last waiting, and after the all-gather; the sessions are the runtime's and are
//! reported as `size_of::<Session>()`. Every reply is checked: the counter reads 1..=N,
//! every rank is released exactly once, every address read back is its writer's.
//!
//! What this does not measure: sockets, the event loops and the kernel (`storm` does, up
//! to the descriptor limit).

use std::io::Write as _;

use indicatif::ProgressBar;
use rdzv_core::store::budget::Budget;
use rdzv_core::store::codec::{self, Decoded, Limits, PendingReply, ResponseView};
use rdzv_core::store::engine::Engine;
use rdzv_core::store::session::{Session, Step, Wake};
use rdzv_core::store::{ConnId, KeyList, Request, WaitResponse, VALIDATION_MAGIC};
use rustix::time::{clock_gettime, ClockId};

use crate::conn::one_key_list;
use crate::error::BenchError;
use crate::report::SimulationResult;

const COUNTER_KEY: &[u8] = b"rdzv-sim/barrier";
const DONE_KEY: &[u8] = b"rdzv-sim/barrier/done";

/// Progress is reported every this many ranks of a phase.
const PROGRESS_EVERY: usize = 1 << 14;

/// This thread's CPU time, in seconds.
fn thread_cpu_seconds() -> f64 {
    let t = clock_gettime(ClockId::ThreadCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// The simulated runtime: the engine, every rank's session, and the buffers a loop
/// reuses from request to request.
struct Driver {
    engine: Engine,
    sessions: Vec<Session>,
    limits: Limits,
    input: Vec<u8>,
    out: Vec<u8>,
    wakes: Vec<Wake>,
    ranks: usize,
}

impl Driver {
    fn fail(&self, rank: usize, what: impl Into<String>) -> BenchError {
        BenchError::Simulation {
            ranks: self.ranks,
            rank,
            what: what.into(),
        }
    }

    /// Serves `request` from `rank` whole: its reply (if any) is left in `out`, the
    /// wake-ups it owes other ranks in `wakes`.
    fn serve(&mut self, rank: usize, request: &Request<'_>) -> Result<(), BenchError> {
        self.input.clear();
        request.encode_into(&mut self.input);
        self.out.clear();
        let session = &mut self.sessions[rank];
        match session.serve(
            &mut self.engine,
            &self.input,
            0,
            &mut self.out,
            &mut self.wakes,
            0,
        ) {
            Step::Served { used, .. } if used == self.input.len() => Ok(()),
            other => Err(self.fail(
                rank,
                format!(
                    "{} was not served whole: {other:?}",
                    request.query_type().name()
                ),
            )),
        }
    }

    /// The reply to `request` that `serve` left in `out`.
    fn reply(&self, rank: usize, request: &Request<'_>) -> Result<ResponseView<'_>, BenchError> {
        let name = request.query_type().name();
        let Some(pending) = PendingReply::for_request(request) else {
            return Err(self.fail(rank, format!("{name} has no reply")));
        };
        match codec::decode_response_view(pending, &self.out, &self.limits) {
            Ok(Decoded::Complete(view, used)) if used == self.out.len() => Ok(view),
            other => Err(self.fail(rank, format!("bad reply to {name}: {other:?}"))),
        }
    }
}

/// `rank`'s address key, written into `buf` (reused: the simulation allocates nothing per
/// request of its own, so that its time is the step's).
fn address_key(buf: &mut Vec<u8>, rank: usize) -> &[u8] {
    buf.clear();
    let _ = write!(buf, "rdzv-sim/addr/{rank}");
    buf
}

/// `rank`'s address, written into `buf`.
fn address(buf: &mut Vec<u8>, rank: usize) -> &[u8] {
    buf.clear();
    let (a, b, c) = ((rank >> 16) & 255, (rank >> 8) & 255, rank & 255);
    let _ = write!(buf, "10.{a}.{b}.{c}:29500");
    buf
}

fn tick(bar: &ProgressBar, done: usize) {
    if done.is_multiple_of(PROGRESS_EVERY) {
        bar.set_position(done as u64);
    }
}

/// Runs the simulation for `ranks` ranks under the server's default budget.
pub(super) fn simulate(ranks: usize, bar: &ProgressBar) -> Result<SimulationResult, BenchError> {
    if ranks < 2 {
        return Err(BenchError::invalid(
            "--ranks must list counts of at least 2",
        ));
    }
    let limits = Limits::default();
    let budget = Budget::default();
    let mut sim = Driver {
        engine: Engine::with_budget(budget),
        sessions: Vec::new(),
        limits,
        input: Vec::new(),
        out: Vec::new(),
        wakes: Vec::new(),
        ranks,
    };
    let empty_bytes = sim.engine.heap_bytes();
    bar.set_length(ranks as u64 * 4);

    // 1. Connect and VALIDATE.
    bar.set_message(format!("{ranks}: connect"));
    let start = thread_cpu_seconds();
    sim.sessions.reserve_exact(ranks);
    let validate = Request::Validate {
        magic: VALIDATION_MAGIC,
    };
    for rank in 0..ranks {
        let id = ConnId(rank as u64);
        if !sim.engine.connect(id) {
            return Err(sim.fail(rank, "connected twice"));
        }
        sim.sessions.push(Session::new(id, limits, budget));
        sim.serve(rank, &validate)?;
        if !sim.out.is_empty() {
            return Err(sim.fail(rank, "VALIDATE was answered"));
        }
        tick(bar, rank);
    }
    let connect_s = thread_cpu_seconds() - start;
    let idle_bytes = sim.engine.heap_bytes() - empty_bytes;

    // 2. The barrier.
    bar.set_message(format!("{ranks}: barrier"));
    let start = thread_cpu_seconds();
    let keys = one_key_list(DONE_KEY);
    let done_list = KeyList::new(1, &keys).ok_or_else(|| sim.fail(0, "bad key list"))?;
    let wait = Request::Wait { keys: done_list };
    let add = Request::Add {
        key: COUNTER_KEY,
        delta: 1,
    };
    let mut released = vec![false; ranks];
    let mut waiting_bytes = 0;
    for rank in 0..ranks {
        sim.serve(rank, &add)?;
        let count = match sim.reply(rank, &add)? {
            ResponseView::Int(count) => count,
            other => return Err(sim.fail(rank, format!("ADD answered {other:?}"))),
        };
        if count != rank as i64 + 1 {
            return Err(sim.fail(rank, format!("ADD read {count}, not {}", rank + 1)));
        }
        if count == ranks as i64 {
            waiting_bytes = sim.engine.heap_bytes() - empty_bytes;
            sim.serve(
                rank,
                &Request::Set {
                    key: DONE_KEY,
                    value: b"1",
                },
            )?;
        }
        sim.serve(rank, &wait)?;
        if !sim.out.is_empty() {
            match sim.reply(rank, &wait)? {
                ResponseView::Wait(WaitResponse::StopWaiting) => released[rank] = true,
                other => return Err(sim.fail(rank, format!("WAIT answered {other:?}"))),
            }
        }
        for (target, _) in sim.wakes.drain(..) {
            let seen = usize::try_from(target.0)
                .ok()
                .and_then(|t| released.get_mut(t));
            let what = match seen.map(|seen| std::mem::replace(seen, true)) {
                None => format!("a wake-up for unknown connection {}", target.0),
                Some(true) => format!("connection {} released twice", target.0),
                Some(false) => continue,
            };
            return Err(BenchError::Simulation { ranks, rank, what });
        }
        tick(bar, ranks + rank);
    }
    let barrier_s = thread_cpu_seconds() - start;
    if let Some(rank) = released.iter().position(|r| !r) {
        return Err(sim.fail(rank, "never released"));
    }
    if sim.engine.waiter_count() != 0 {
        return Err(sim.fail(0, "waits left after the release"));
    }

    // 3. The all-gather: every rank publishes its address, then reads its neighbour's.
    bar.set_message(format!("{ranks}: all-gather"));
    let start = thread_cpu_seconds();
    let (mut key_buf, mut value_buf) = (Vec::new(), Vec::new());
    for rank in 0..ranks {
        let set = Request::Set {
            key: address_key(&mut key_buf, rank),
            value: address(&mut value_buf, rank),
        };
        sim.serve(rank, &set)?;
        tick(bar, 2 * ranks + rank);
    }
    for rank in 0..ranks {
        let peer = (rank + 1) % ranks;
        let get = Request::Get {
            key: address_key(&mut key_buf, peer),
        };
        sim.serve(rank, &get)?;
        let expected = address(&mut value_buf, peer);
        match sim.reply(rank, &get)? {
            ResponseView::Value(value) if value == expected => {}
            other => return Err(sim.fail(rank, format!("GET of rank {peer} read {other:?}"))),
        }
        tick(bar, 3 * ranks + rank);
    }
    let allgather_s = thread_cpu_seconds() - start;
    let stored_bytes = sim.engine.heap_bytes() - empty_bytes;
    bar.set_position(ranks as u64 * 4);

    let per_rank_us = |s: f64| s * 1e6 / ranks as f64;
    Ok(SimulationResult {
        ranks,
        connect_cpu_s: connect_s,
        barrier_cpu_s: barrier_s,
        allgather_cpu_s: allgather_s,
        total_cpu_s: connect_s + barrier_s + allgather_s,
        barrier_us_per_rank: per_rank_us(barrier_s),
        total_us_per_rank: per_rank_us(connect_s + barrier_s + allgather_s),
        engine_bytes_per_idle_conn: idle_bytes / ranks,
        engine_bytes_per_waiting_conn: waiting_bytes / ranks,
        engine_bytes_after_allgather: stored_bytes,
        session_bytes: std::mem::size_of::<Session>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_job_is_released_and_gathers_every_address() {
        let result = simulate(1000, &ProgressBar::hidden()).unwrap();
        assert_eq!(result.ranks, 1000);
        assert!(result.engine_bytes_per_idle_conn > 0);
        assert!(result.engine_bytes_per_idle_conn <= 1024);
        assert!(result.engine_bytes_per_waiting_conn > result.engine_bytes_per_idle_conn);
        assert!(result.engine_bytes_after_allgather > 1000 * 20);
        assert!(result.total_cpu_s >= result.barrier_cpu_s);
    }

    #[test]
    fn fewer_than_two_ranks_is_refused() {
        assert!(matches!(
            simulate(1, &ProgressBar::hidden()),
            Err(BenchError::InvalidArgument(_))
        ));
    }
}
