//! Fault injection for tests (PyTorch's `FaultyTensorPipeAgent`), as a decorator on a
//! client lane's blocking sender: it hooks `send` the way PyTorch's faulty agent does,
//! so faulty workers run the same lanes, channels and pipe protocol as any other.
//!
//! Only requests are touched: the first `num_fail_sends` requests to each handler in
//! `fail_handlers` fail with [`TransportError::InjectedFault`] (the lane fails that call
//! alone), and a request to a handler in `delays` is held that long before it is sent
//! (the sending thread sleeps, as PyTorch's `pipeWrite` does). The agent's own RRef
//! calls may be named by PyTorch's message types instead (`RREF_USER_DELETE`,
//! `PYTHON_REMOTE_CALL`, ...: core's `message_type_names`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdzv_core::rpc::frame::FrameKind;

use super::error::TransportError;
use super::options::FaultInjection;
use super::transport::{FrameSender, OwnedFrame};

/// A worker's fault injection: what to inject, and how many sends of each failing
/// handler failed so far (shared by all its lanes).
#[derive(Debug)]
pub(crate) struct Faults {
    config: FaultInjection,
    failed: Mutex<HashMap<String, u32>>,
}

impl Faults {
    /// The faults `config` asks for; `None` when it injects nothing.
    pub(crate) fn new(config: &FaultInjection) -> Option<Arc<Faults>> {
        (!config.is_empty()).then(|| {
            Arc::new(Faults {
                config: config.clone(),
                failed: Mutex::new(HashMap::new()),
            })
        })
    }

    /// Whether this send of a request to `handler` must fail (and counts it).
    fn should_fail(&self, handler: &str) -> bool {
        if !self.config.fail_handlers.iter().any(|h| names(h, handler)) {
            return false;
        }
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        let count = failed.entry(handler.to_string()).or_insert(0);
        if *count < self.config.num_fail_sends {
            *count += 1;
            true
        } else {
            false
        }
    }

    /// How long to hold a request to `handler` before sending it.
    fn delay(&self, handler: &str) -> Option<Duration> {
        self.config
            .delays
            .iter()
            .find(|(h, _)| names(h, handler))
            .map(|&(_, d)| d)
    }

    /// Wraps `sender` so that its requests suffer these faults.
    pub(crate) fn wrap(self: &Arc<Self>, sender: Box<dyn FrameSender>) -> Box<dyn FrameSender> {
        Box::new(FaultySender {
            inner: sender,
            faults: Arc::clone(self),
        })
    }
}

/// Whether `name`, from the fault options, names the handler `handler`: the handler's
/// own name, or one of PyTorch's message-type names for what it carries
/// (`RREF_USER_DELETE`, `PYTHON_REMOTE_CALL`, ...; core's `message_type_names`).
fn names(name: &str, handler: &str) -> bool {
    name == handler || rdzv_core::rpc::rref::wire::message_type_names(handler).contains(&name)
}

/// A blocking sender whose requests suffer [`Faults`].
struct FaultySender {
    inner: Box<dyn FrameSender>,
    faults: Arc<Faults>,
}

impl FaultySender {
    /// Fails or delays `frame` as the faults say.
    fn inject(&self, frame: &OwnedFrame) -> Result<(), TransportError> {
        if frame.kind != FrameKind::Request {
            return Ok(());
        }
        if self.faults.should_fail(&frame.handler) {
            return Err(TransportError::InjectedFault {
                handler: frame.handler.clone(),
            });
        }
        if let Some(delay) = self.faults.delay(&frame.handler) {
            std::thread::sleep(delay);
        }
        Ok(())
    }
}

impl FrameSender for FaultySender {
    fn send(&mut self, frame: &OwnedFrame) -> Result<u64, TransportError> {
        self.inject(frame)?;
        self.inner.send(frame)
    }

    fn send_owned(
        &mut self,
        frame: OwnedFrame,
    ) -> Result<(u64, Option<OwnedFrame>), TransportError> {
        self.inject(&frame)?;
        self.inner.send_owned(frame)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts what reaches the wrapped sender.
    struct Counting(Arc<Mutex<Vec<(FrameKind, String)>>>);

    impl FrameSender for Counting {
        fn send(&mut self, frame: &OwnedFrame) -> Result<u64, TransportError> {
            self.0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((frame.kind, frame.handler.clone()));
            Ok(1)
        }
    }

    fn request(handler: &str) -> OwnedFrame {
        OwnedFrame {
            handler: handler.into(),
            ..OwnedFrame::empty(FrameKind::Request, 1)
        }
    }

    #[test]
    fn chosen_requests_fail_a_number_of_times_then_go_through() {
        assert!(Faults::new(&FaultInjection::default()).is_none());
        let faults = Faults::new(&FaultInjection {
            fail_handlers: vec!["echo".into()],
            num_fail_sends: 2,
            delays: vec![("slow".into(), Duration::from_millis(20))],
        })
        .unwrap_or_else(|| panic!("faults expected"));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut sender = faults.wrap(Box::new(Counting(Arc::clone(&seen))));
        for _ in 0..2 {
            let err = sender.send(&request("echo")).err().map(|e| e.to_string());
            assert_eq!(
                err.as_deref(),
                Some("Send attempt failed intentionally for echo")
            );
        }
        assert!(sender.send(&request("echo")).is_ok());
        // Responses and other frames are never touched, other handlers neither.
        let response = OwnedFrame {
            handler: "echo".into(),
            ..OwnedFrame::empty(FrameKind::Response, 1)
        };
        assert!(sender.send_owned(response).is_ok());
        let started = std::time::Instant::now();
        assert!(sender.send(&request("slow")).is_ok());
        assert!(started.elapsed() >= Duration::from_millis(20));
        let seen = seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
        assert_eq!(
            seen,
            [
                (FrameKind::Request, "echo".to_string()),
                (FrameKind::Response, "echo".to_string()),
                (FrameKind::Request, "slow".to_string()),
            ]
        );
    }

    #[test]
    fn pytorch_message_type_names_choose_the_agents_own_calls() {
        use rdzv_core::rpc::rref::wire::handler;
        let faults = Faults::new(&FaultInjection {
            fail_handlers: vec!["PYTHON_REMOTE_CALL".into(), "RREF_USER_DELETE".into()],
            num_fail_sends: 1,
            delays: vec![("SCRIPT_RREF_FETCH_CALL".into(), Duration::from_millis(20))],
        })
        .unwrap_or_else(|| panic!("faults expected"));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut sender = faults.wrap(Box::new(Counting(Arc::clone(&seen))));
        for name in [handler::REMOTE, handler::USER_DELETE] {
            assert!(sender.send(&request(name)).is_err(), "{name}");
            assert!(sender.send(&request(name)).is_ok(), "{name}");
        }
        assert!(sender.send(&request(handler::FORK_REQUEST)).is_ok());
        let started = std::time::Instant::now();
        assert!(sender.send(&request(handler::FETCH)).is_ok());
        assert!(started.elapsed() >= Duration::from_millis(20));
    }
}
