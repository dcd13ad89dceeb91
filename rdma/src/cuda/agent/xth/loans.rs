//! `cuda_xth`'s loans, which never leave the process: how the borrowing agent finds the
//! lender's fence, and how the lender learns when the borrower's copy is done, so that
//! neither side waits on the host on the data path (the same three steps as `cuda_ipc`'s
//! [`super::loan_events`], through memory instead of IPC handles):
//!
//! 1. **lending**: one of the lender's streams waits for the memory's producer (its ready
//!    event) and records the loan's *fence*; the loan is registered here under its key
//!    (device, address, length: what the descriptor names) with [`XthLoans::lend`];
//! 2. **borrowing**: the borrower [`claim`](XthLoans::claim)s one loan of that key, and
//!    [`copy_lent`] makes its stream wait on the fence (on the GPU), copy, and record its
//!    own `done` event. It then says [`copied`](XthLoan::copied) (handing `done` over
//!    when its tensor is handed over with the copy still running, the pending hand-over;
//!    nothing when it waited for `done` itself) or [`abandoned`](XthLoan::abandoned);
//! 3. **release**: when the loan ends (the reply or the ack, or the pipe's end),
//!    [`XthLoans::end`] withdraws it if nobody claimed it, waits for a claimed one's
//!    borrower to say how it went (bounded), then waits on the host for the copy's
//!    `done` (or the fence), before the lender lets go of the memory. The caller may
//!    only reuse or free the memory once `end` returned `Ok`.
//!
//! The borrower's event is recorded on its own stream and device: a `cuda_xth` copy may
//! cross GPUs, and an event can only be recorded on a stream of its own context, so the
//! lender's fence is only ever waited on there, never recorded.
//!
//! Two loans of one tensor (the same memory sent twice at once) share a key: each claim
//! takes one of them. Whichever a borrower took, every loan's `end` waits for one copy,
//! so once all loans of the memory ended, every copy from it is done.
//!
//! This module issues no driver call: it is generic over [`LoanStream`]'s events, which
//! the agent's runtime implements with CUDA events and the tests with a fake GPU whose
//! work completes late.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::cuda::loan_events::{LoanEvent, LoanStream};

/// What a `cuda_xth` descriptor names: the lent memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct XthKey {
    /// The lender's device ordinal.
    pub device: u32,
    /// The memory's device address.
    pub address: u64,
    /// Its length in bytes.
    pub length: u64,
}

/// How far the borrower of one loan got.
#[derive(Debug)]
enum CopyState<E> {
    /// Nobody borrowed it yet.
    Unclaimed,
    /// A borrower took it and has not said how its copy went.
    Claimed,
    /// The copy was enqueued; `Some(done)` completes after it, `None`: already complete.
    Copied(Option<Arc<E>>),
    /// The borrower gave up, with no copy of it left running.
    Abandoned,
}

/// One loan: the lender's fence, and what its borrower did.
#[derive(Debug)]
pub struct XthLoan<E> {
    fence: E,
    state: Mutex<CopyState<E>>,
    changed: Condvar,
}

impl<E> XthLoan<E> {
    /// The fence the borrower's stream waits on before it copies.
    pub fn fence(&self) -> &E {
        &self.fence
    }

    fn state(&self) -> MutexGuard<'_, CopyState<E>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn set(&self, state: CopyState<E>) {
        *self.state() = state;
        self.changed.notify_all();
    }

    /// The borrower's copy is enqueued: `done` completes after it (`None`: the borrower
    /// waited for it already).
    pub fn copied(&self, done: Option<Arc<E>>) {
        self.set(CopyState::Copied(done));
    }

    /// The borrower gave up, and no copy of its is left running (it drained its stream
    /// after a failure).
    pub fn abandoned(&self) {
        self.set(CopyState::Abandoned);
    }

    /// The fence, once the loan is settled (every handle but the caller's dropped).
    pub fn into_fence(self: Arc<Self>) -> Option<E> {
        Arc::try_unwrap(self).ok().map(|loan| loan.fence)
    }
}

/// Why a loan's release could not make sure that no copy reads the memory any more:
/// the caller must then never free or reuse it (leak it).
#[derive(Debug)]
pub enum XthEndError<E> {
    /// The borrower claimed the loan and did not say, within the time given, how its
    /// copy went.
    StillBorrowing {
        /// How long it was waited for.
        waited: Duration,
    },
    /// Waiting for the copy (or the fence) failed.
    Wait(E),
}

impl<E> std::fmt::Display for XthEndError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            XthEndError::StillBorrowing { waited } => write!(
                f,
                "a cuda_xth loan's borrower did not finish within {waited:?}: its copy may \
                 still read the lent memory"
            ),
            XthEndError::Wait(_) => f.write_str("cannot wait for a cuda_xth loan's copy"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for XthEndError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            XthEndError::Wait(error) => Some(error),
            XthEndError::StillBorrowing { .. } => None,
        }
    }
}

/// The process's `cuda_xth` loans not yet ended, by key.
#[derive(Debug)]
pub struct XthLoans<E> {
    unclaimed: Mutex<BTreeMap<XthKey, Vec<Arc<XthLoan<E>>>>>,
}

impl<E> Default for XthLoans<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E> XthLoans<E> {
    /// No loans.
    pub const fn new() -> XthLoans<E> {
        XthLoans {
            unclaimed: Mutex::new(BTreeMap::new()),
        }
    }

    fn unclaimed(&self) -> MutexGuard<'_, BTreeMap<XthKey, Vec<Arc<XthLoan<E>>>>> {
        self.unclaimed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Step 1: registers a loan of `key`'s memory, fenced by `fence` (recorded after the
    /// producer on a stream of the lender's).
    pub fn lend(&self, key: XthKey, fence: E) -> Arc<XthLoan<E>> {
        let loan = Arc::new(XthLoan {
            fence,
            state: Mutex::new(CopyState::Unclaimed),
            changed: Condvar::new(),
        });
        self.unclaimed()
            .entry(key)
            .or_default()
            .push(Arc::clone(&loan));
        loan
    }

    /// Step 2, first half: takes one unclaimed loan of `key`, or `None` when none is
    /// lent (it ended, or the descriptor names memory this process did not lend).
    pub fn claim(&self, key: XthKey) -> Option<Arc<XthLoan<E>>> {
        let mut unclaimed = self.unclaimed();
        let loans = unclaimed.get_mut(&key)?;
        let loan = loans.pop();
        if loans.is_empty() {
            unclaimed.remove(&key);
        }
        let loan = loan?;
        *loan.state() = CopyState::Claimed;
        Some(loan)
    }

    /// How many loans wait to be claimed.
    #[cfg(test)]
    pub fn unclaimed_count(&self) -> usize {
        self.unclaimed().values().map(Vec::len).sum()
    }

    /// Step 3: the loan ended. Withdraws it if unclaimed, waits at most `timeout` for a
    /// claimed one's borrower to say how it went, then for its copy (or the fence).
    ///
    /// # Errors
    /// [`XthEndError`]: a copy may still read the memory; never free or reuse it.
    pub fn end(
        &self,
        key: XthKey,
        loan: &Arc<XthLoan<E>>,
        timeout: Duration,
    ) -> Result<(), XthEndError<E::Error>>
    where
        E: LoanEvent,
    {
        {
            let mut unclaimed = self.unclaimed();
            if let Some(loans) = unclaimed.get_mut(&key) {
                loans.retain(|other| !Arc::ptr_eq(other, loan));
                if loans.is_empty() {
                    unclaimed.remove(&key);
                }
            }
        }
        let deadline = Instant::now() + timeout;
        let mut state = loan.state();
        while matches!(*state, CopyState::Claimed) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(XthEndError::StillBorrowing { waited: timeout });
            }
            state = loan
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        let done = match &*state {
            CopyState::Copied(Some(done)) => Some(Arc::clone(done)),
            _ => None,
        };
        drop(state);
        match done {
            Some(done) => done.host_wait(),
            None => loan.fence.host_wait(),
        }
        .map_err(XthEndError::Wait)
    }
}

/// Step 2, second half: `stream` waits on `loan`'s fence, runs `copy` (which enqueues the
/// copy on it) and records `done`. On failure the loan is marked abandoned, after the
/// stream was drained if a copy may have been enqueued; on success the caller says
/// [`XthLoan::copied`].
///
/// # Errors
/// The stream's or `copy`'s.
pub fn copy_lent<S: LoanStream>(
    stream: &mut S,
    loan: &XthLoan<S::Event>,
    done: &S::Event,
    copy: impl FnOnce(&mut S) -> Result<(), S::Error>,
) -> Result<(), S::Error> {
    if let Err(error) = stream.wait(loan.fence()) {
        loan.abandoned();
        return Err(error);
    }
    let enqueued = copy(stream).and_then(|()| stream.record(done));
    if let Err(error) = enqueued {
        // A copy may be in flight: it must end before the lender hears of this. If the
        // drain fails too, the loan stays claimed and its release gives up on the memory.
        stream.drain()?;
        loan.abandoned();
        return Err(error);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::loan_events::fake_gpu::{Event, Gpu, Op, Stream};
    use crate::cuda::loan_events::fence_loan;
    use std::sync::atomic::{AtomicBool, Ordering};

    const KEY: XthKey = XthKey {
        device: 0,
        address: 0x7f00_0000_0000,
        length: 4,
    };

    /// The producer writes `bytes` late on the user's stream and records the memory's
    /// ready event; the lender's stream fences the loan after it.
    fn lent(
        gpu: &Gpu,
        loans: &XthLoans<Event>,
        bytes: &[u8],
    ) -> (Stream, Stream, Arc<XthLoan<Event>>) {
        let mut user = gpu.stream();
        let mut lender = gpu.stream();
        let (ready, fence) = (gpu.event(), gpu.event());
        gpu.put("lent", &[0; 4]);
        user.push(Op::Write("lent", bytes.to_vec()));
        user.record(&ready).expect("record");
        fence_loan(&mut lender, Some(&ready), &fence).expect("fence");
        (user, lender, loans.lend(KEY, fence))
    }

    /// The borrower claims the loan and enqueues its copy with the pending hand-over:
    /// the returned event is the received tensor's ready event.
    fn borrowed_pending(gpu: &Gpu, loans: &XthLoans<Event>) -> (Stream, Arc<Event>) {
        let loan = loans.claim(KEY).expect("a loan to claim");
        let mut borrower = gpu.stream();
        // The fake GPU is single-threaded (`Rc`); the registry's `Arc`s are for the real one.
        #[allow(clippy::arc_with_non_send_sync)]
        let done = Arc::new(gpu.event());
        copy_lent(&mut borrower, &loan, &done, |s| {
            s.push(Op::Copy("lent", "received"));
            Ok(())
        })
        .expect("borrow");
        loan.copied(Some(Arc::clone(&done)));
        (borrower, done)
    }

    #[test]
    fn a_consumer_that_waits_on_ready_sees_the_bytes_and_one_that_does_not_may_not() {
        let (gpu, loans) = (Gpu::new(), XthLoans::new());
        let (user, lender, _loan) = lent(&gpu, &loans, &[1, 2, 3, 4]);
        let (borrower, done) = borrowed_pending(&gpu, &loans);
        // Handed over: the borrower's stream ran as far as it can, the producer has not.
        gpu.run(&[&borrower, &lender]);
        assert!(!done.is_done(), "ready before the producer finished");
        // The documented hazard: reading now sees what was there before the copy.
        assert!(gpu.buffer("received").is_empty());
        // The producer finishes; a consumer that waits on the ready event sees the bytes.
        gpu.run(&[&user]);
        done.host_wait().expect("ready");
        assert!(done.is_done());
        assert_eq!(gpu.buffer("received"), [1, 2, 3, 4]);
    }

    #[test]
    fn the_lenders_release_waits_for_the_borrowers_copy_before_reuse() {
        let (gpu, loans) = (Gpu::new(), XthLoans::new());
        let (user, lender, loan) = lent(&gpu, &loans, &[5; 4]);
        gpu.run(&[&user, &lender]);
        let (borrower, _done) = borrowed_pending(&gpu, &loans);
        assert!(!borrower.is_idle(), "the copy is still queued");
        // The reply came: the release returns only once the copy has run, and only then
        // may the lender's user overwrite the memory.
        loans.end(KEY, &loan, Duration::from_secs(1)).expect("end");
        assert!(borrower.is_idle());
        gpu.put("lent", &[6; 4]);
        assert_eq!(gpu.buffer("received"), [5; 4]);
        assert_eq!(loans.unclaimed_count(), 0);
    }

    #[test]
    fn a_loan_never_borrowed_is_withdrawn_and_cannot_be_claimed_after_it_ended() {
        let (gpu, loans) = (Gpu::new(), XthLoans::new());
        let (_user, _lender, loan) = lent(&gpu, &loans, &[7; 4]);
        assert_eq!(loans.unclaimed_count(), 1);
        // The pipe ended first: the release waits for the producer and the fence only.
        loans.end(KEY, &loan, Duration::from_secs(1)).expect("end");
        assert_eq!(gpu.buffer("lent"), [7; 4]);
        assert!(loans.claim(KEY).is_none(), "an ended loan was claimed");
        // Memory this process never lent cannot be claimed either.
        let other = XthKey { length: 5, ..KEY };
        assert!(loans.claim(other).is_none());
        assert!(Arc::clone(&loan).into_fence().is_none(), "still held here");
        assert!(loan.into_fence().is_some(), "the fence back for the pool");
    }

    #[test]
    fn two_loans_of_one_tensor_are_claimed_once_each_and_both_wait_for_a_copy() {
        let (gpu, loans) = (Gpu::new(), XthLoans::new());
        let (user, lender, first) = lent(&gpu, &loans, &[8; 4]);
        let second_fence = gpu.event();
        let mut lender2 = gpu.stream();
        lender2.record(&second_fence).expect("record");
        let second = loans.lend(KEY, second_fence);
        let (one, _) = borrowed_pending(&gpu, &loans);
        let (two, _) = borrowed_pending(&gpu, &loans);
        assert!(loans.claim(KEY).is_none(), "a third claim of two loans");
        gpu.run(&[&user, &lender, &lender2]);
        loans
            .end(KEY, &first, Duration::from_secs(1))
            .expect("first");
        loans
            .end(KEY, &second, Duration::from_secs(1))
            .expect("second");
        assert!(one.is_idle() && two.is_idle(), "a copy outlived both loans");
    }

    #[test]
    fn a_copy_that_fails_after_enqueueing_is_drained_and_abandoned() {
        let (gpu, loans) = (Gpu::new(), XthLoans::new());
        let (user, lender, loan) = lent(&gpu, &loans, &[9; 4]);
        let claimed = loans.claim(KEY).expect("claim");
        let mut borrower = gpu.stream();
        let done = gpu.event();
        let failed = copy_lent(&mut borrower, &claimed, &done, |s| {
            s.push(Op::Copy("lent", "received"));
            s.gpu.0.borrow_mut().fail_records = true;
            Ok(())
        });
        assert_eq!(failed, Err("cuEventRecord failed".to_string()));
        assert!(borrower.is_idle(), "drained before the error was returned");
        gpu.0.borrow_mut().fail_records = false;
        gpu.run(&[&user, &lender]);
        loans.end(KEY, &loan, Duration::from_secs(1)).expect("end");
    }

    /// An event whose work is done when its flag is set (shared across threads).
    #[derive(Debug, Default)]
    struct Flag(AtomicBool);

    impl LoanEvent for Flag {
        type Error = std::io::Error;
        fn host_wait(&self) -> Result<(), std::io::Error> {
            if self.0.load(Ordering::Acquire) {
                Ok(())
            } else {
                Err(std::io::Error::other("waited on a copy that never ran"))
            }
        }
    }

    #[test]
    fn a_release_while_the_borrower_copies_waits_for_it_and_gives_up_when_it_never_says() {
        let loans = Arc::new(XthLoans::new());
        let loan = loans.lend(KEY, Flag(AtomicBool::new(true)));
        let claimed = loans.claim(KEY).expect("claim");
        let ending = {
            let (loans, loan) = (Arc::clone(&loans), Arc::clone(&loan));
            std::thread::spawn(move || loans.end(KEY, &loan, Duration::from_secs(30)).is_ok())
        };
        // The release waits for the borrower, then for its copy's event (done before the
        // borrower says so: `Flag` does not block, so a flag set after `copied` would race
        // the releasing thread's wait).
        let done = Arc::new(Flag::default());
        done.0.store(true, Ordering::Release);
        claimed.copied(Some(Arc::clone(&done)));
        assert!(ending.join().unwrap_or(false), "the release failed");

        // A borrower that never says: the release gives up, and the memory is leaked.
        let stuck = loans.lend(KEY, Flag(AtomicBool::new(true)));
        let _claimed = loans.claim(KEY).expect("claim");
        let err = loans
            .end(KEY, &stuck, Duration::from_millis(20))
            .expect_err("no word from the borrower");
        assert!(matches!(err, XthEndError::StillBorrowing { .. }), "{err}");
    }
}
