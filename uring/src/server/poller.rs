//! The epoll loop's readiness: one epoll instance per loop and the eventfd other loops
//! wake it with, as raw system calls (rustix). `mio` did this before; its `poll` goes
//! through libc's `epoll_wait`, a cancellation point that costs as much again in user
//! space as the call itself, and converts every event (about 90 instructions a turn
//! between them, a twentieth of an ADD's whole cost on one connection).
//!
//! Every registration is edge-triggered, with the flags `mio` used: a connection asks
//! for input, the peer's end of stream and output; the listener and the waker for input.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use rustix::buffer::spare_capacity;
use rustix::event::epoll::{self, CreateFlags, Event, EventData, EventFlags};
use rustix::event::{eventfd, EventfdFlags, Timespec};

use super::shared_engine::LoopWaker;

/// The listener's token; connections use their slot.
pub(super) const LISTENER: u64 = u64::MAX - 1;
/// The waker's token.
pub(super) const WAKER: u64 = u64::MAX - 2;

/// One loop's epoll instance.
pub(super) struct Poller {
    epoll: OwnedFd,
}

/// Wakes the loop whose [`Poller`] it was made with: an eventfd in its epoll set.
pub(super) struct Waker {
    fd: OwnedFd,
}

/// What a connection's readiness event says, as `mio` read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Readiness {
    /// Input, or the peer's end of stream, or an error: read.
    pub(super) readable: bool,
    /// Room for output, or the connection is gone, or an error: write.
    pub(super) writable: bool,
    /// The peer's end of stream or an error: no further edge comes; read to the end.
    pub(super) read_closed: bool,
}

impl Readiness {
    /// Reads an event's flags.
    pub(super) fn of(flags: EventFlags) -> Readiness {
        let input = flags.intersects(EventFlags::IN | EventFlags::PRI);
        let output = flags.contains(EventFlags::OUT);
        let error = flags.contains(EventFlags::ERR);
        let hung_up = flags.contains(EventFlags::HUP);
        let read_closed = hung_up
            || error
            || (flags.contains(EventFlags::IN) && flags.contains(EventFlags::RDHUP));
        let write_closed = hung_up || error;
        Readiness {
            readable: input || read_closed,
            writable: output || write_closed,
            read_closed,
        }
    }
}

impl Poller {
    /// A new epoll instance and the waker registered in it.
    pub(super) fn new() -> io::Result<(Poller, Waker)> {
        let poller = Poller {
            epoll: epoll::create(CreateFlags::CLOEXEC)?,
        };
        let waker = Waker {
            fd: eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?,
        };
        poller.add(&waker.fd, WAKER, EventFlags::IN)?;
        Ok((poller, waker))
    }

    /// Registers `fd` under `token`, edge-triggered, for `interest` (`IN` for input,
    /// which adds the peer's end of stream; `OUT` for output).
    pub(super) fn add(&self, fd: impl AsFd, token: u64, interest: EventFlags) -> io::Result<()> {
        let mut flags = EventFlags::ET | interest;
        if interest.contains(EventFlags::IN) {
            flags |= EventFlags::RDHUP;
        }
        Ok(epoll::add(
            &self.epoll,
            fd,
            EventData::new_u64(token),
            flags,
        )?)
    }

    /// Takes `fd` out of the set.
    pub(super) fn delete(&self, fd: impl AsFd) -> io::Result<()> {
        Ok(epoll::delete(&self.epoll, fd)?)
    }

    /// Waits up to `timeout` (rounded up to a millisecond) for events, which replace
    /// what `events` held; at most its capacity are taken.
    pub(super) fn wait(&self, events: &mut Vec<Event>, timeout: Duration) -> io::Result<()> {
        events.clear();
        let timeout = Timespec {
            tv_sec: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
            tv_nsec: i64::from(timeout.subsec_nanos()),
        };
        epoll::wait(&self.epoll, spare_capacity(events), Some(&timeout))?;
        Ok(())
    }
}

impl LoopWaker for Waker {
    fn wake(&self) -> io::Result<()> {
        let one = 1u64.to_ne_bytes();
        match rustix::io::write(&self.fd, &one) {
            Ok(_) => Ok(()),
            Err(rustix::io::Errno::AGAIN) => {
                // The counter is full (it is never read otherwise): empty it, which
                // raises no event, then write again for a fresh edge.
                let mut sink = [0u8; 8];
                let _ = rustix::io::read(&self.fd, &mut sink);
                rustix::io::write(&self.fd, &one)?;
                Ok(())
            }
            Err(error) => Err(error.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_reads_flags_as_mio_did() {
        let of = |flags| Readiness::of(flags);
        assert_eq!(
            of(EventFlags::IN),
            Readiness {
                readable: true,
                writable: false,
                read_closed: false
            }
        );
        assert_eq!(
            of(EventFlags::OUT),
            Readiness {
                readable: false,
                writable: true,
                read_closed: false
            }
        );
        let end = of(EventFlags::IN | EventFlags::RDHUP);
        assert!(end.readable && end.read_closed && !end.writable);
        for gone in [EventFlags::HUP, EventFlags::ERR] {
            let all = of(gone);
            assert!(all.readable && all.writable && all.read_closed, "{gone:?}");
        }
    }

    #[test]
    fn a_wake_ends_a_wait_and_each_wake_raises_an_edge() {
        let (poller, waker) = Poller::new().unwrap();
        let mut events = Vec::with_capacity(8);
        poller.wait(&mut events, Duration::ZERO).unwrap();
        assert!(events.is_empty(), "nothing happened yet");
        for _ in 0..3 {
            waker.wake().unwrap();
            poller.wait(&mut events, Duration::from_secs(5)).unwrap();
            assert_eq!(events.len(), 1);
            assert_eq!(events[0].data.u64(), WAKER);
            poller.wait(&mut events, Duration::ZERO).unwrap();
            assert!(events.is_empty(), "edge-triggered: one event per wake");
        }
    }

    #[test]
    fn a_connection_reports_input_then_its_peers_end() {
        use std::io::Write;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let (poller, _waker) = Poller::new().unwrap();
        poller
            .add(&server, 7, EventFlags::IN | EventFlags::OUT)
            .unwrap();
        let mut events = Vec::with_capacity(8);
        poller.wait(&mut events, Duration::from_secs(5)).unwrap();
        assert_eq!(events[0].data.u64(), 7);
        assert!(Readiness::of(events[0].flags).writable);
        client.write_all(b"x").unwrap();
        drop(client);
        let mut closed = false;
        for _ in 0..50 {
            poller
                .wait(&mut events, Duration::from_millis(100))
                .unwrap();
            if events.iter().any(|e| Readiness::of(e.flags).read_closed) {
                closed = true;
                break;
            }
        }
        assert!(closed, "the peer's end of stream is reported");
        poller.delete(&server).unwrap();
    }
}
