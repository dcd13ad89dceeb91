//! The order in which a `cuda_ipc` loan's lender, borrower and release use the loan's
//! interprocess event, so that completion crosses processes on the GPU (TensorPipe's
//! outbox events, kept from the standalone channel this runtime replaced), never through
//! a device-wide synchronisation nor a host wait for the producer:
//!
//! 1. **lending** ([`fence_loan`]): one of the lender's streams waits for the memory's
//!    producer (its ready event, when the producer recorded one) and records the loan's
//!    event, whose IPC handle travels in the descriptor;
//! 2. **borrowing** ([`copy_after_loan`]): the borrower's stream waits on that event
//!    (`cuStreamWaitEvent`), copies, records the same event again for the lender, and
//!    its own event for the received memory. Should anything fail once the copy was
//!    enqueued, the stream is drained before the error is returned, so no copy can read
//!    lent memory after the lender was told the loan is over;
//! 3. **release** ([`settle_loan`]): the lending rule ends the loan with the reply or the
//!    ack, which the borrower sends after step 2 returned; the lender then waits (on the
//!    host, for this one event) for the event's last record, the borrower's copy, before
//!    the memory or the event is used again. It is usually complete already; the
//!    runtime bounds the wait, since a borrower that died may never finish.
//!
//! A CUDA event wait applies to the record made last before the wait was issued; the
//! steps above only issue a wait after the record it must see. This module issues no
//! driver call: it is generic over [`LoanStream`], which the agent's runtime implements
//! with its streams and events, and the tests here with a fake GPU whose work completes
//! late, so the ordering rules are checked without a GPU.

/// An event of a [`LoanStream`].
pub trait LoanEvent {
    /// Why a wait failed.
    type Error;
    /// Blocks until the work the event recorded last is done (`cuEventSynchronize`).
    ///
    /// # Errors
    /// The driver's.
    fn host_wait(&self) -> Result<(), Self::Error>;
}

/// A stream work is enqueued on.
pub trait LoanStream {
    /// Why an operation failed.
    type Error;
    /// The stream's events.
    type Event: LoanEvent<Error = Self::Error>;
    /// Later work on the stream waits for `event`'s last record (`cuStreamWaitEvent`).
    ///
    /// # Errors
    /// The driver's.
    fn wait(&mut self, event: &Self::Event) -> Result<(), Self::Error>;
    /// Records the work enqueued so far on `event` (`cuEventRecord`).
    ///
    /// # Errors
    /// The driver's.
    fn record(&mut self, event: &Self::Event) -> Result<(), Self::Error>;
    /// Blocks until the work enqueued so far is done (`cuStreamSynchronize`: this stream
    /// only).
    ///
    /// # Errors
    /// The driver's.
    fn drain(&mut self) -> Result<(), Self::Error>;
}

/// Step 1, the lender's: `stream` waits for `ready` (the producer's event, if any) and
/// records `loan`, the event whose handle the descriptor carries.
///
/// # Errors
/// The stream's; the loan must not be handed out then.
pub fn fence_loan<S: LoanStream>(
    stream: &mut S,
    ready: Option<&S::Event>,
    loan: &S::Event,
) -> Result<(), S::Error> {
    if let Some(ready) = ready {
        stream.wait(ready)?;
    }
    stream.record(loan)
}

/// Step 2, the borrower's: `stream` waits on `loan`, runs `copy` (which enqueues the
/// copy on it), records `loan` for the lender and `done` for the received memory.
///
/// # Errors
/// The stream's or `copy`'s. If the copy may have been enqueued, the stream was drained
/// first (or that failed too, and the error says the stream's state is unknown).
pub fn copy_after_loan<S: LoanStream, T>(
    stream: &mut S,
    loan: &S::Event,
    done: &S::Event,
    copy: impl FnOnce(&mut S) -> Result<T, S::Error>,
) -> Result<T, S::Error> {
    stream.wait(loan)?;
    let enqueued = copy(stream).and_then(|value| {
        stream.record(loan)?;
        stream.record(done)?;
        Ok(value)
    });
    enqueued.or_else(|error| {
        // A copy may be in flight: it must end before the lender hears of this.
        stream.drain()?;
        Err(error)
    })
}

/// Step 3, the lender's, when the loan ended: waits for `loan`'s last record (the
/// borrower's, after its copy; the lender's own when the borrower never got to it).
///
/// # Errors
/// The driver's: the memory may still be read, so the caller must not reuse it.
pub fn settle_loan<E: LoanEvent>(loan: &E) -> Result<(), E::Error> {
    loan.host_wait()
}

#[cfg(test)]
pub(crate) mod fake_gpu;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::loan_events::fake_gpu::{Event, Gpu, Op, Stream};

    /// The producer's write on the user's stream, its ready event, the loan fenced on the
    /// lender's runtime stream.
    fn lent(gpu: &Gpu, bytes: &[u8]) -> (Stream, Stream, Event) {
        let mut user = gpu.stream();
        let mut lender = gpu.stream();
        let (ready, loan) = (gpu.event(), gpu.event());
        gpu.put("lent", &[0; 4]);
        user.push(Op::Write("lent", bytes.to_vec()));
        user.record(&ready).expect("record");
        fence_loan(&mut lender, Some(&ready), &loan).expect("fence");
        (user, lender, loan)
    }

    #[test]
    fn the_borrowers_copy_waits_for_a_producer_that_completes_late() {
        let gpu = Gpu::new();
        let (user, lender, loan) = lent(&gpu, &[1, 2, 3, 4]);
        let mut borrower = gpu.stream();
        let done = gpu.event();
        copy_after_loan(&mut borrower, &loan, &done, |s| {
            s.push(Op::Copy("lent", "received"));
            Ok(())
        })
        .expect("borrow");
        // The borrower and the lender's runtime stream run; the producer has not.
        gpu.run(&[&borrower, &lender]);
        assert!(
            gpu.buffer("received").is_empty(),
            "copied before the producer"
        );
        assert!(!borrower.is_idle() && !lender.is_idle());
        // The producer completes: the chain runs through, and the copy sees its bytes.
        gpu.run(&[&user]);
        gpu.run(&[&borrower, &lender]);
        assert_eq!(gpu.buffer("received"), [1, 2, 3, 4]);
        assert!(done.host_wait().is_ok());
    }

    #[test]
    fn the_release_waits_for_the_borrowers_copy() {
        let gpu = Gpu::new();
        let (user, lender, loan) = lent(&gpu, &[5; 4]);
        gpu.run(&[&user, &lender]);
        let mut borrower = gpu.stream();
        let done = gpu.event();
        copy_after_loan(&mut borrower, &loan, &done, |s| {
            s.push(Op::Copy("lent", "received"));
            Ok(())
        })
        .expect("borrow");
        assert!(
            gpu.buffer("received").is_empty(),
            "the copy is still queued"
        );
        // The ack arrived: the release returns only once the copy has run.
        settle_loan(&loan).expect("settle");
        assert_eq!(gpu.buffer("received"), [5; 4]);
        assert!(borrower.is_idle());
    }

    #[test]
    fn a_loan_never_borrowed_settles_on_the_lenders_record() {
        let gpu = Gpu::new();
        let (_user, _lender, loan) = lent(&gpu, &[7; 4]);
        // The pipe ended before the peer copied: the release waits for the producer and
        // the fence only.
        settle_loan(&loan).expect("settle");
        assert_eq!(gpu.buffer("lent"), [7; 4]);
    }

    #[test]
    fn a_copy_enqueued_before_a_failure_is_drained_first() {
        let gpu = Gpu::new();
        let (user, lender, loan) = lent(&gpu, &[9; 4]);
        gpu.run(&[&user, &lender]);
        let mut borrower = gpu.stream();
        let done = gpu.event();
        let failed = copy_after_loan(&mut borrower, &loan, &done, |s| {
            s.push(Op::Copy("lent", "received"));
            s.gpu.0.borrow_mut().fail_records = true;
            Ok(())
        });
        assert_eq!(failed, Err("cuEventRecord failed".to_string()));
        // The copy ran before the error reached the caller (who acks with it).
        assert_eq!(gpu.buffer("received"), [9; 4]);
        assert_eq!(gpu.0.borrow().drains, 1);
        assert!(borrower.is_idle());
    }

    #[test]
    fn a_copy_that_fails_to_enqueue_leaves_the_loan_to_the_lenders_record() {
        let gpu = Gpu::new();
        let (user, lender, loan) = lent(&gpu, &[3; 4]);
        let mut borrower = gpu.stream();
        let done = gpu.event();
        let failed: Result<(), String> =
            copy_after_loan(&mut borrower, &loan, &done, |_| Err("cuMemcpyAsync".into()));
        assert_eq!(failed, Err("cuMemcpyAsync".to_string()));
        gpu.run(&[&user, &lender, &borrower]);
        assert!(gpu.buffer("received").is_empty());
        assert!(settle_loan(&loan).is_ok());
    }

    #[test]
    fn the_fake_reports_a_wait_that_can_never_complete() {
        // The fake's host wait is honest: a record queued behind a wait that nothing
        // satisfies is reported, not assumed done.
        let gpu = Gpu::new();
        let mut stream = gpu.stream();
        let (never, event) = (gpu.event(), gpu.event());
        stream.push(Op::Wait(never.id, 1));
        stream.record(&event).expect("record");
        assert!(event.host_wait().is_err());
    }
}
