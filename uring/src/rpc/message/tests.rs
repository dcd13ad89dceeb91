use super::*;

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
