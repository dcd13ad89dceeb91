use super::*;
use std::sync::Condvar;

#[test]
fn first_completion_wins_and_late_ones_are_dropped() {
    let (future, cell) = RpcFuture::new();
    assert!(!future.is_done());
    assert!(cell.complete(Ok(Message::from_payload(b"first".to_vec()))));
    assert!(!cell.complete(Ok(Message::from_payload(b"late".to_vec()))));
    assert!(future.is_done());
    let message = future.wait().map_err(|e| e.to_string());
    assert_eq!(message, Ok(Message::from_payload(b"first".to_vec())));
}

#[test]
fn wait_timeout_gives_the_future_back() {
    let (future, cell) = RpcFuture::new();
    let future = match future.wait_timeout(Duration::from_millis(5)) {
        Ok(_) => panic!("completed without a result"),
        Err(f) => f,
    };
    let waiter = std::thread::spawn(move || future.wait().map(|m| m.payload));
    assert!(cell.complete(Ok(Message::from_payload(vec![7]))));
    let got = waiter
        .join()
        .map_err(|_| "waiter panicked")
        .and_then(|r| r.map_err(|_| "call failed"));
    assert_eq!(got, Ok(vec![7]));
}

#[test]
fn await_in_another_executor() {
    let (future, cell) = RpcFuture::new();
    let t = std::thread::spawn(move || futures_lite::future::block_on(future));
    std::thread::sleep(Duration::from_millis(10));
    cell.complete(Err(CallError::ShutDown { name: "w".into() }));
    let text = t.join().map(|r| r.map_err(|e| e.to_string()).err());
    assert_eq!(
        text.ok().flatten().as_deref(),
        Some("the RPC agent of worker w is shut down; the call did not complete")
    );
}

fn payload(result: Result<Message, CallError>) -> Result<Vec<u8>, String> {
    result.map(|m| m.payload).map_err(|e| e.to_string())
}

#[test]
fn then_chains_run_in_order_on_the_completing_thread() {
    let (future, cell) = RpcFuture::new();
    let chained = future
        .then(|r| {
            r.map(|mut m| {
                m.payload.push(2);
                m
            })
        })
        .then(|r| {
            r.map(|mut m| {
                m.payload.push(3);
                m
            })
        });
    assert!(!chained.is_done());
    let completer = std::thread::spawn(move || cell.complete(Ok(Message::from_payload(vec![1]))));
    assert_eq!(completer.join().ok(), Some(true));
    assert_eq!(payload(chained.wait()), Ok(vec![1, 2, 3]));
}

#[test]
fn then_on_a_completed_future_runs_at_once() {
    let chained = RpcFuture::ready(Ok(Message::from_payload(vec![5])))
        .then(|r| r.map(|m| Message::from_payload(vec![m.payload[0] * 2])));
    assert!(chained.is_done());
    assert_eq!(payload(chained.wait()), Ok(vec![10]));
}

#[test]
fn errors_propagate_through_then_and_can_be_recovered() {
    let (future, cell) = RpcFuture::new();
    let passed = future.then(|r| r);
    cell.complete(Err(CallError::ShutDown { name: "w".into() }));
    assert_eq!(
        payload(passed.wait()).err().as_deref(),
        Some("the RPC agent of worker w is shut down; the call did not complete")
    );
    let recovered = RpcFuture::ready(Err(UsageError::BlockingInline.into()))
        .then(|r| Ok(Message::from_payload(vec![u8::from(r.is_err())])));
    assert_eq!(payload(recovered.wait()), Ok(vec![1]));
}

#[test]
fn a_panicking_callback_fails_the_next_future() {
    let failed = RpcFuture::ready(Ok(Message::default())).then(|_| panic!("boom"));
    let text = payload(failed.wait()).err();
    assert_eq!(
        text.as_deref(),
        Some("an RPC future's callback panicked: boom")
    );
}

#[test]
fn collect_all_keeps_every_result_in_order() {
    let (a, cell_a) = RpcFuture::new();
    let (b, cell_b) = RpcFuture::new();
    let c = RpcFuture::ready(Ok(Message::from_payload(vec![3])));
    let all = collect_all(vec![a, b, c]);
    assert!(!all.is_done());
    cell_b.complete(Err(CallError::FlushTimeout { pending: 1 }));
    assert!(!all.is_done());
    let t = std::thread::spawn(move || cell_a.complete(Ok(Message::from_payload(vec![1]))));
    let results: Vec<_> = all.wait().into_iter().map(payload).collect();
    assert_eq!(t.join().ok(), Some(true));
    assert_eq!(results.len(), 3);
    assert_eq!(results[0], Ok(vec![1]));
    assert!(results[1]
        .as_ref()
        .is_err_and(|e| e.contains("1 pending futures")));
    assert_eq!(results[2], Ok(vec![3]));
    assert!(collect_all(Vec::new()).wait().is_empty());
}

#[test]
fn collect_all_can_be_awaited() {
    let (a, cell) = RpcFuture::new();
    let t = std::thread::spawn(move || futures_lite::future::block_on(collect_all(vec![a])));
    std::thread::sleep(Duration::from_millis(10));
    cell.complete(Ok(Message::from_payload(vec![9])));
    let got = t
        .join()
        .ok()
        .map(|v| v.into_iter().map(payload).collect::<Vec<_>>());
    assert_eq!(got, Some(vec![Ok(vec![9])]));
}

#[test]
fn wait_all_returns_values_or_the_first_error_in_order() {
    let ok = wait_all(vec![
        RpcFuture::ready(Ok(Message::from_payload(vec![1]))),
        RpcFuture::ready(Ok(Message::from_payload(vec![2]))),
    ]);
    let payloads: Result<Vec<_>, _> = ok.map(|v| v.into_iter().map(|m| m.payload).collect());
    assert_eq!(
        payloads.map_err(|e| e.to_string()),
        Ok(vec![vec![1], vec![2]])
    );
    let (late, cell) = RpcFuture::new();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(5));
        cell.complete(Err(CallError::ShutDown {
            name: "late".into(),
        }))
    });
    let first = wait_all(vec![
        RpcFuture::ready(Ok(Message::default())),
        RpcFuture::ready(Err(CallError::FlushTimeout { pending: 2 })),
        late,
    ]);
    assert_eq!(
        t.join().ok(),
        Some(true),
        "wait_all waited for every future"
    );
    assert_eq!(
        first.err().map(|e| e.to_string()).as_deref(),
        Some("Timed out waiting to flush pending futures, had 2 pending futures")
    );
}

/// "Device" memory whose copy lands only when the test says so, as a runtime's
/// pending hand-over leaves it: the bytes read before that are the stale ones.
#[derive(Debug)]
struct Landing {
    bytes: Mutex<Vec<u8>>,
    pending: Mutex<Option<Vec<u8>>>,
    landed: Condvar,
    broken: bool,
}

impl Landing {
    fn new(copied: Vec<u8>) -> Landing {
        Landing {
            bytes: Mutex::new(vec![0; copied.len()]),
            pending: Mutex::new(Some(copied)),
            landed: Condvar::new(),
            broken: false,
        }
    }

    /// The copy completes.
    fn land(&self) {
        if let Some(copied) = self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            *self.bytes.lock().unwrap_or_else(|p| p.into_inner()) = copied;
        }
        self.landed.notify_all();
    }

    fn bytes(&self) -> Vec<u8> {
        self.bytes.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl crate::rpc::device::DeviceMemory for Landing {
    fn device(&self) -> Device {
        Device::cuda(1)
    }
    fn len(&self) -> usize {
        self.bytes().len()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn is_ready(&self) -> Result<bool, DeviceError> {
        if self.broken {
            return Err(DeviceError::new(
                crate::rpc::device::DeviceOp::WaitReady,
                "fake cuEventQuery: CUDA_ERROR_LAUNCH_FAILED",
            ));
        }
        Ok(self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none())
    }
    fn wait_ready_for(&self, timeout: Duration) -> Result<bool, DeviceError> {
        let pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let (pending, _) = self
            .landed
            .wait_timeout_while(pending, timeout, |p| p.is_some())
            .unwrap_or_else(|p| p.into_inner());
        Ok(pending.is_none())
    }
}

#[test]
fn a_tensor_handed_over_with_its_copy_running_says_when_it_is_ready() {
    let tensor = Tensor::on_device(DeviceBuffer::new(Landing::new(vec![7; 4])));
    fn landing(t: &Tensor) -> Option<&Landing> {
        t.memory.as_ref()?.downcast_ref()
    }
    let seen = |t: &Tensor| landing(t).map(Landing::bytes);
    // Not ready: a consumer that reads now sees the bytes half copied (the hazard).
    assert_eq!(tensor.is_ready().ok(), Some(false));
    assert_eq!(
        tensor.wait_ready(Duration::from_millis(1)).ok(),
        Some(false)
    );
    assert_eq!(seen(&tensor), Some(vec![0; 4]));
    // A consumer that waits sees the bytes once the copy lands.
    let consumer = {
        let tensor = tensor.clone();
        std::thread::spawn(move || {
            let ready = tensor.wait_ready(Duration::from_secs(30)).ok();
            (ready, landing(&tensor).map(Landing::bytes))
        })
    };
    landing(&tensor).map(Landing::land);
    let (ready, bytes) = consumer.join().unwrap_or((None, None));
    assert_eq!((ready, bytes), (Some(true), Some(vec![7; 4])));
    assert_eq!(tensor.is_ready().ok(), Some(true));
    // A CPU tensor is always ready.
    let cpu = Tensor::cpu(vec![1, 2]);
    assert_eq!(cpu.is_ready().ok(), Some(true));
    assert_eq!(cpu.wait_ready(Duration::ZERO).ok(), Some(true));
}

#[test]
fn a_runtime_that_cannot_tell_readiness_names_the_device() {
    let broken = Landing {
        broken: true,
        ..Landing::new(vec![1])
    };
    let tensor = Tensor::on_device(DeviceBuffer::new(broken));
    let err = tensor.is_ready().expect_err("the driver failed");
    assert_eq!(
        err.report(),
        "cannot wait for a tensor's bytes to be complete on cuda:1: fake cuEventQuery: \
         CUDA_ERROR_LAUNCH_FAILED"
    );
    // Memory that says nothing of readiness is ready when handed over.
    let plain = Tensor::on_device(DeviceBuffer::new(crate::rpc::device::HostMemory::new(
        Device::cuda(0),
        vec![1],
    )));
    assert_eq!(plain.is_ready().ok(), Some(true));
}

#[test]
fn a_promise_completes_its_future_and_a_dropped_one_fails_it() {
    let (future, promise) = RpcFuture::pending();
    let waiter = std::thread::spawn(move || future.wait().map(|m| m.payload));
    promise.complete(Ok(Message::from_payload(vec![4])));
    assert_eq!(waiter.join().ok().and_then(Result::ok), Some(vec![4]));
    let (future, promise) = RpcFuture::pending();
    drop(promise);
    let text = future.wait().map_err(|e| e.to_string()).err();
    assert!(text.is_some_and(|t| t.contains("dropped without completing")));
}

#[test]
fn a_result_is_wanted_by_a_future_or_a_callback_only() {
    let (future, cell) = RpcFuture::new();
    assert!(cell.is_wanted(), "the future holds the cell");
    let chained = future.then(|r| r);
    assert!(cell.is_wanted(), "then's callback waits for the result");
    drop(chained);
    assert!(
        cell.is_wanted(),
        "the callback still runs when the chained future is gone"
    );
    assert!(cell.complete(Ok(Message::from_payload(vec![1]))));
    let (future, cell) = RpcFuture::new();
    drop(future);
    assert!(!cell.is_wanted(), "nobody sees a dropped future's result");
}
