//! Unit tests for every query, a model test against a naive `BTreeMap` store, and a
//! many-connection cleanup test.

use super::*;
use crate::store::PairList;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::string::ToString;
use std::vec;
use std::vec::Vec;

// ---------------------------------------------------------------------------------------
// Harness: owned requests and replies.

/// A request with owned bytes, turned into a borrowed [`Request`] on demand.
#[derive(Debug, Clone)]
enum Op {
    Validate(u32),
    Set(Vec<u8>, Vec<u8>),
    CompareSet(Vec<u8>, Vec<u8>, Vec<u8>),
    Get(Vec<u8>),
    Add(Vec<u8>, i64),
    Check(Vec<Vec<u8>>),
    Wait(Vec<Vec<u8>>),
    GetNumKeys,
    DeleteKey(Vec<u8>),
    Append(Vec<u8>, Vec<u8>),
    MultiGet(Vec<Vec<u8>>),
    MultiSet(Vec<(Vec<u8>, Vec<u8>)>),
    CancelWait,
    Ping(u32),
    Push(Vec<u8>, Vec<u8>),
    Pop(Vec<u8>),
    Len(Vec<u8>),
    ListKeys,
    Barrier(Vec<u8>, i64),
}

fn prefixed(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

fn encode_keys(keys: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for key in keys {
        prefixed(&mut out, key);
    }
    out
}

impl Op {
    /// Calls `f` with this op as a borrowed request.
    fn with_request<R>(&self, f: impl FnOnce(Request<'_>) -> R) -> R {
        let list;
        match self {
            Op::Validate(magic) => f(Request::Validate { magic: *magic }),
            Op::Set(key, value) => f(Request::Set { key, value }),
            Op::CompareSet(key, expected, desired) => f(Request::CompareSet {
                key,
                expected,
                desired,
            }),
            Op::Get(key) => f(Request::Get { key }),
            Op::Add(key, delta) => f(Request::Add { key, delta: *delta }),
            Op::Check(keys) | Op::Wait(keys) | Op::MultiGet(keys) => {
                list = encode_keys(keys);
                let keys = KeyList::new(keys.len(), &list).expect("well-formed");
                f(match self {
                    Op::Check(_) => Request::Check { keys },
                    Op::Wait(_) => Request::Wait { keys },
                    _ => Request::MultiGet { keys },
                })
            }
            Op::GetNumKeys => f(Request::GetNumKeys),
            Op::DeleteKey(key) => f(Request::DeleteKey { key }),
            Op::Append(key, value) => f(Request::Append { key, value }),
            Op::MultiSet(pairs) => {
                let mut encoded = Vec::new();
                for (key, value) in pairs {
                    prefixed(&mut encoded, key);
                    prefixed(&mut encoded, value);
                }
                list = encoded;
                let pairs = PairList::new(pairs.len(), &list).expect("well-formed");
                f(Request::MultiSet { pairs })
            }
            Op::CancelWait => f(Request::CancelWait),
            Op::Ping(nonce) => f(Request::Ping { nonce: *nonce }),
            Op::Push(key, value) => f(Request::QueuePush { key, value }),
            Op::Pop(key) => f(Request::QueuePop { key }),
            Op::Len(key) => f(Request::QueueLen { key }),
            Op::ListKeys => f(Request::ListKeys),
            Op::Barrier(key, world_size) => f(Request::Barrier {
                key,
                world_size: *world_size,
            }),
        }
    }
}

/// A reply with owned bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(clippy::large_enum_variant)] // STATS' counters, a rare reply, held inline
enum Reply {
    Pong(u32),
    Value(Vec<u8>),
    Int(i64),
    Check(CheckResponse),
    Wait(WaitResponse),
    Values(Vec<Vec<u8>>),
    QueuePop(i64, Option<Vec<u8>>),
    Keys(Vec<Vec<u8>>),
    Stats(StoreStats),
}

fn owned(response: &Response<'_>) -> Reply {
    match response {
        Response::Pong(nonce) => Reply::Pong(*nonce),
        Response::Value(value) => Reply::Value(value.to_vec()),
        Response::Int(n) => Reply::Int(*n),
        Response::Check(check) => Reply::Check(*check),
        Response::Wait(wait) => Reply::Wait(*wait),
        Response::Values(values) => Reply::Values(values.iter().map(|v| v.to_vec()).collect()),
        Response::QueuePop { len_before, value } => {
            Reply::QueuePop(*len_before, value.map(<[u8]>::to_vec))
        }
        Response::Keys(keys) => Reply::Keys(keys.iter().map(|k| k.to_vec()).collect()),
        Response::Stats(stats) => Reply::Stats(**stats),
    }
}

/// What one request produced: own wake-ups, the reply, and wake-ups for others.
type Step = (Result<(usize, Option<Reply>), Close>, Vec<u64>);

fn step(engine: &mut Engine, conn: u64, op: &Op) -> Step {
    let result = op.with_request(|request| {
        engine
            .handle_request(ConnId(conn), request)
            .map(|outcome| (outcome.own_wakeups, outcome.reply.as_ref().map(owned)))
    });
    (result, drain(engine))
}

fn drain(engine: &mut Engine) -> Vec<u64> {
    let mut woken = Vec::new();
    while let Some((conn, response)) = engine.poll_wakeup() {
        assert_eq!(response, WaitResponse::StopWaiting);
        woken.push(conn.0);
    }
    woken
}

/// Runs `op` and expects no close; returns (own wake-ups, reply, others woken).
fn ok(engine: &mut Engine, conn: u64, op: Op) -> (usize, Option<Reply>, Vec<u64>) {
    let (result, woken) = step(engine, conn, &op);
    let (own, reply) = result.unwrap_or_else(|close| panic!("{op:?} closed: {close}"));
    (own, reply, woken)
}

/// Runs `op` and returns only its reply, expecting no wake-ups at all.
fn reply(engine: &mut Engine, conn: u64, op: Op) -> Option<Reply> {
    let (own, reply, woken) = ok(engine, conn, op);
    assert_eq!((own, woken), (0, vec![]));
    reply
}

fn engine_with(conns: impl IntoIterator<Item = u64>) -> Engine {
    let mut engine = Engine::new();
    for conn in conns {
        assert!(engine.connect(ConnId(conn)));
        assert_eq!(
            reply(&mut engine, conn, Op::Validate(VALIDATION_MAGIC)),
            None
        );
    }
    engine
}

fn k(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

fn ks(keys: &[&str]) -> Vec<Vec<u8>> {
    keys.iter().map(|s| k(s)).collect()
}

const STOP: Option<Reply> = Some(Reply::Wait(WaitResponse::StopWaiting));

// ---------------------------------------------------------------------------------------
// Connection lifecycle.

#[test]
fn validate_must_come_first_with_the_right_magic() {
    let mut engine = Engine::new();
    for conn in 1..=4 {
        assert!(engine.connect(ConnId(conn)));
    }
    assert!(!engine.connect(ConnId(1)), "connect twice changes nothing");
    assert_eq!(engine.connection_count(), 4);

    assert_eq!(reply(&mut engine, 1, Op::Validate(VALIDATION_MAGIC)), None);

    let (result, _) = step(&mut engine, 2, &Op::Validate(0xdead_beef));
    let close = result.unwrap_err();
    assert_eq!(close, Close::IncorrectValidate { magic: 0xdead_beef });
    assert!(close
        .to_string()
        .contains("client with incorrect VALIDATE query"));
    assert!(!engine.is_connected(ConnId(2)));

    let (result, _) = step(&mut engine, 3, &Op::Ping(7));
    let close = result.unwrap_err();
    assert_eq!(
        close,
        Close::MissingValidate {
            query: QueryType::Ping
        }
    );
    assert!(close.to_string().contains("client without VALIDATE query"));
    assert!(close.to_string().contains("PING"));
    assert!(!engine.is_connected(ConnId(3)));

    let (result, _) = step(&mut engine, 1, &Op::Validate(VALIDATION_MAGIC));
    assert_eq!(result.unwrap_err(), Close::RepeatedValidate);
    assert!(!engine.is_connected(ConnId(1)));

    let (result, _) = step(&mut engine, 99, &Op::Get(k("/x")));
    let close = result.unwrap_err();
    assert_eq!(close, Close::UnknownConnection { conn: ConnId(99) });
    assert!(close.to_string().contains("99"));

    // A closed connection is unknown afterwards; disconnecting it is a no-op.
    let (result, _) = step(&mut engine, 1, &Op::Ping(1));
    assert_eq!(
        result.unwrap_err(),
        Close::UnknownConnection { conn: ConnId(1) }
    );
    assert!(!engine.disconnect(ConnId(1)));
    assert!(engine.disconnect(ConnId(4)));
    assert_eq!(engine.connection_count(), 0);
}

#[test]
fn ping_echoes_the_nonce() {
    let mut engine = engine_with([1]);
    assert_eq!(
        reply(&mut engine, 1, Op::Ping(0x1234_5678)),
        Some(Reply::Pong(0x1234_5678))
    );
}

// ---------------------------------------------------------------------------------------
// Key/value queries.

#[test]
fn set_get_delete_and_counts() {
    let mut engine = engine_with([1]);
    assert_eq!(
        reply(&mut engine, 1, Op::Get(k("/missing"))),
        Some(Reply::Value(vec![]))
    );
    assert_eq!(reply(&mut engine, 1, Op::Set(k("/a"), k("1"))), None);
    assert_eq!(reply(&mut engine, 1, Op::Set(k("/a"), k("22"))), None);
    assert_eq!(
        reply(&mut engine, 1, Op::Get(k("/a"))),
        Some(Reply::Value(k("22")))
    );
    assert_eq!(reply(&mut engine, 1, Op::Set(k("/e"), vec![])), None);
    assert_eq!(reply(&mut engine, 1, Op::GetNumKeys), Some(Reply::Int(2)));
    assert_eq!(
        reply(&mut engine, 1, Op::DeleteKey(k("/a"))),
        Some(Reply::Int(1))
    );
    assert_eq!(
        reply(&mut engine, 1, Op::DeleteKey(k("/a"))),
        Some(Reply::Int(0))
    );
    assert_eq!(reply(&mut engine, 1, Op::GetNumKeys), Some(Reply::Int(1)));
    assert_eq!(engine.num_keys(), 1);
    assert_eq!(engine.get(b"/e"), Some(&b""[..]));
    assert_eq!(engine.get(b"/a"), None);
}

#[test]
fn overwrite_reuses_or_shrinks_the_buffer() {
    let mut engine = engine_with([1]);
    reply(&mut engine, 1, Op::Set(k("/v"), vec![7; 100]));
    let before = engine.kv.get(&b"/v"[..]).map(Vec::capacity);
    reply(&mut engine, 1, Op::Set(k("/v"), vec![8; 90]));
    assert_eq!(engine.kv.get(&b"/v"[..]).map(Vec::capacity), before);
    reply(&mut engine, 1, Op::Set(k("/v"), vec![9; 1 << 16]));
    reply(&mut engine, 1, Op::Set(k("/v"), vec![1; 3]));
    let capacity = engine.kv.get(&b"/v"[..]).map_or(0, Vec::capacity);
    assert!(
        capacity < 1 << 10,
        "a tiny value must not pin 64 KiB ({capacity})"
    );
    assert_eq!(engine.get(b"/v"), Some(&[1u8, 1, 1][..]));
}

#[test]
fn add_stores_decimal_and_follows_stoll() {
    let mut engine = engine_with([1, 2]);
    assert_eq!(
        reply(&mut engine, 1, Op::Add(k("/n"), 5)),
        Some(Reply::Int(5))
    );
    assert_eq!(
        reply(&mut engine, 1, Op::Add(k("/n"), -8)),
        Some(Reply::Int(-3))
    );
    assert_eq!(engine.get(b"/n"), Some(&b"-3"[..]));
    reply(&mut engine, 1, Op::Set(k("/s"), k("  12abc")));
    assert_eq!(
        reply(&mut engine, 1, Op::Add(k("/s"), 1)),
        Some(Reply::Int(13))
    );
    assert_eq!(engine.get(b"/s"), Some(&b"13"[..]));
    assert_eq!(
        reply(&mut engine, 1, Op::Add(k("/z"), 0)),
        Some(Reply::Int(0))
    );
    assert_eq!(engine.get(b"/z"), Some(&b"0"[..]));

    // Not a number: that connection only is closed, the value is untouched.
    reply(&mut engine, 2, Op::Set(k("/word"), k("abc")));
    let (result, _) = step(&mut engine, 1, &Op::Add(k("/word"), 1));
    let close = result.unwrap_err();
    assert_eq!(
        close,
        Close::BadCounter {
            query: QueryType::Add,
            key: k("/word"),
            error: CounterError::NotANumber
        }
    );
    assert!(
        close.to_string().contains("ADD on key \"/word\""),
        "{close}"
    );
    assert!(!engine.is_connected(ConnId(1)));
    assert!(engine.is_connected(ConnId(2)));
    assert_eq!(engine.get(b"/word"), Some(&b"abc"[..]));

    // Overflow closes too.
    reply(
        &mut engine,
        2,
        Op::Set(k("/max"), i64::MAX.to_string().into_bytes()),
    );
    let (result, _) = step(&mut engine, 2, &Op::Add(k("/max"), 1));
    assert!(matches!(
        result,
        Err(Close::BadCounter {
            error: CounterError::Overflow,
            ..
        })
    ));
    assert_eq!(engine.connection_count(), 0);
}

#[test]
fn compare_set_four_cases_and_wakes_in_all() {
    let mut engine = engine_with([1, 2]);
    // Missing, expected non-empty: reply `expected`, nothing stored, waiters still woken.
    assert_eq!(reply(&mut engine, 2, Op::Wait(ks(&["/cs"]))), None);
    assert_eq!(
        ok(
            &mut engine,
            1,
            Op::CompareSet(k("/cs"), k("wrong_old_value"), k("new"))
        ),
        (0, Some(Reply::Value(k("wrong_old_value"))), vec![2])
    );
    assert_eq!(engine.get(b"/cs"), None);
    // Missing, expected empty: store and reply `desired`.
    assert_eq!(reply(&mut engine, 2, Op::Wait(ks(&["/cs"]))), None);
    assert_eq!(
        ok(
            &mut engine,
            1,
            Op::CompareSet(k("/cs"), vec![], k("new_value1"))
        ),
        (0, Some(Reply::Value(k("new_value1"))), vec![2])
    );
    assert_eq!(engine.get(b"/cs"), Some(&b"new_value1"[..]));
    // Present and equal: store and reply `desired`.
    assert_eq!(
        reply(
            &mut engine,
            1,
            Op::CompareSet(k("/cs"), k("new_value1"), k("v2"))
        ),
        Some(Reply::Value(k("v2")))
    );
    // Present and different: reply the current value.
    assert_eq!(
        reply(&mut engine, 1, Op::CompareSet(k("/cs"), k("nope"), k("v3"))),
        Some(Reply::Value(k("v2")))
    );
    assert_eq!(engine.get(b"/cs"), Some(&b"v2"[..]));
    assert_eq!(engine.waiter_count(), 0);
}

#[test]
fn append_creates_or_extends_and_wakes() {
    let mut engine = engine_with([1, 2]);
    assert_eq!(reply(&mut engine, 2, Op::Wait(ks(&["/log"]))), None);
    assert_eq!(
        ok(&mut engine, 1, Op::Append(k("/log"), k("ab"))),
        (0, None, vec![2])
    );
    assert_eq!(reply(&mut engine, 1, Op::Append(k("/log"), k("cd"))), None);
    assert_eq!(engine.get(b"/log"), Some(&b"abcd"[..]));
}

#[test]
fn multi_get_and_multi_set() {
    let mut engine = engine_with([1, 2, 3]);
    assert_eq!(reply(&mut engine, 2, Op::Wait(ks(&["/x"]))), None);
    assert_eq!(reply(&mut engine, 3, Op::Wait(ks(&["/y", "/x"]))), None);
    let pairs = vec![(k("/y"), k("1")), (k("/x"), k("2")), (k("/y"), k("3"))];
    // /y then /x arrive: 3 completes on /x, in the same order as 2 (FIFO on /x).
    assert_eq!(
        ok(&mut engine, 1, Op::MultiSet(pairs)),
        (0, None, vec![2, 3])
    );
    assert_eq!(
        reply(&mut engine, 1, Op::MultiGet(ks(&["/y", "/missing", "/x"]))),
        Some(Reply::Values(vec![k("3"), vec![], k("2")]))
    );
    assert_eq!(
        reply(&mut engine, 1, Op::MultiGet(vec![])),
        Some(Reply::Values(vec![]))
    );
    assert_eq!(reply(&mut engine, 1, Op::MultiSet(vec![])), None);
}

#[test]
fn list_keys_is_sorted_and_skips_queues() {
    let mut engine = engine_with([1]);
    assert_eq!(
        reply(&mut engine, 1, Op::ListKeys),
        Some(Reply::Keys(vec![]))
    );
    reply(&mut engine, 1, Op::Set(k("/b"), k("1")));
    reply(&mut engine, 1, Op::Add(k("init/"), 1));
    reply(&mut engine, 1, Op::Set(k("/a"), k("1")));
    reply(&mut engine, 1, Op::Push(k("/q"), k("1")));
    assert_eq!(
        reply(&mut engine, 1, Op::ListKeys),
        Some(Reply::Keys(ks(&["/a", "/b", "init/"])))
    );
    assert_eq!(reply(&mut engine, 1, Op::GetNumKeys), Some(Reply::Int(3)));
}

// ---------------------------------------------------------------------------------------
// CHECK, WAIT, CANCEL_WAIT.

#[test]
fn check_counts_kv_and_non_empty_queues() {
    let mut engine = engine_with([1]);
    let ready = Some(Reply::Check(CheckResponse::Ready));
    let not_ready = Some(Reply::Check(CheckResponse::NotReady));
    assert_eq!(reply(&mut engine, 1, Op::Check(vec![])), ready);
    assert_eq!(reply(&mut engine, 1, Op::Check(ks(&["/a"]))), not_ready);
    reply(&mut engine, 1, Op::Set(k("/a"), k("1")));
    reply(&mut engine, 1, Op::Push(k("/q"), k("1")));
    assert_eq!(reply(&mut engine, 1, Op::Check(ks(&["/a", "/q"]))), ready);
    assert_eq!(
        reply(&mut engine, 1, Op::Check(ks(&["/a", "/b"]))),
        not_ready
    );
    reply(&mut engine, 1, Op::Pop(k("/q")));
    assert_eq!(reply(&mut engine, 1, Op::Check(ks(&["/q"]))), not_ready);
}

#[test]
fn wait_replies_at_once_when_ready_or_empty() {
    let mut engine = engine_with([1]);
    assert_eq!(reply(&mut engine, 1, Op::Wait(vec![])), STOP);
    reply(&mut engine, 1, Op::Set(k("/a"), k("1")));
    assert_eq!(reply(&mut engine, 1, Op::Wait(ks(&["/a", "/a"]))), STOP);
    reply(&mut engine, 1, Op::Push(k("/q"), k("1")));
    assert_eq!(reply(&mut engine, 1, Op::Wait(ks(&["/q", "/a"]))), STOP);
    assert_eq!(engine.waiter_count(), 0);
}

#[test]
fn wait_needs_every_key_and_dedups() {
    let mut engine = engine_with([1, 2]);
    reply(&mut engine, 1, Op::Set(k("/have"), k("1")));
    assert_eq!(
        reply(&mut engine, 2, Op::Wait(ks(&["/a", "/have", "/b", "/a"]))),
        None
    );
    assert_eq!(engine.waiter_count(), 1);
    assert_eq!(engine.waited_key_count(), 2, "only missing keys, once each");
    assert_eq!(
        ok(&mut engine, 1, Op::Set(k("/a"), k("1"))),
        (0, None, vec![])
    );
    assert_eq!(
        ok(&mut engine, 1, Op::Set(k("/a"), k("2"))),
        (0, None, vec![])
    );
    assert_eq!(
        ok(&mut engine, 1, Op::Add(k("/b"), 1)),
        (0, Some(Reply::Int(1)), vec![2])
    );
    assert_eq!(engine.waiter_count(), 0);
    assert_eq!(engine.waited_key_count(), 0);
}

#[test]
fn delete_does_not_wake_and_arrival_survives_deletion() {
    let mut engine = engine_with([1, 2]);
    reply(&mut engine, 1, Op::Set(k("/a"), k("1")));
    assert_eq!(reply(&mut engine, 2, Op::Wait(ks(&["/b", "/c"]))), None);
    assert_eq!(
        ok(&mut engine, 1, Op::DeleteKey(k("/a"))),
        (0, Some(Reply::Int(1)), vec![])
    );
    // /b arrives, then is deleted: it still counts as arrived.
    reply(&mut engine, 1, Op::Set(k("/b"), k("1")));
    reply(&mut engine, 1, Op::DeleteKey(k("/b")));
    assert_eq!(
        ok(&mut engine, 1, Op::Set(k("/c"), k("1"))),
        (0, None, vec![2])
    );
}

#[test]
fn wakeups_are_fifo_and_one_per_wait() {
    let mut engine = engine_with([1, 2, 3, 4]);
    for conn in [3, 2, 4] {
        assert_eq!(reply(&mut engine, conn, Op::Wait(ks(&["/k"]))), None);
    }
    assert_eq!(
        ok(&mut engine, 1, Op::Set(k("/k"), k("v"))),
        (0, None, vec![3, 2, 4])
    );
    assert_eq!(
        ok(&mut engine, 1, Op::Set(k("/k"), k("w"))),
        (0, None, vec![])
    );
}

#[test]
fn wait_registers_only_keys_that_are_not_present() {
    // /q has a queued element, /x is missing: only /x is awaited (libuv would also
    // await /q and hang until another push).
    let mut engine = engine_with([1, 2]);
    reply(&mut engine, 1, Op::Push(k("/q"), k("e")));
    assert_eq!(reply(&mut engine, 2, Op::Wait(ks(&["/q", "/x"]))), None);
    assert_eq!(engine.waited_key_count(), 1);
    assert_eq!(
        ok(&mut engine, 1, Op::Set(k("/x"), k("1"))),
        (0, None, vec![2])
    );
}

#[test]
fn cancel_wait_drops_waits_and_replies_canceled() {
    let mut engine = engine_with([1, 2]);
    assert_eq!(reply(&mut engine, 2, Op::Wait(ks(&["/a", "/b"]))), None);
    assert_eq!(
        reply(&mut engine, 2, Op::CancelWait),
        Some(Reply::Wait(WaitResponse::WaitCanceled))
    );
    assert_eq!(engine.waiter_count(), 0);
    assert_eq!(engine.waited_key_count(), 0);
    assert_eq!(
        ok(&mut engine, 1, Op::Set(k("/a"), k("1"))),
        (0, None, vec![])
    );
    // Cancelling with nothing pending still replies.
    assert_eq!(
        reply(&mut engine, 1, Op::CancelWait),
        Some(Reply::Wait(WaitResponse::WaitCanceled))
    );
    // The connection can wait again afterwards.
    assert_eq!(reply(&mut engine, 2, Op::Wait(ks(&["/c"]))), None);
    assert_eq!(
        ok(&mut engine, 1, Op::Set(k("/c"), k("1"))),
        (0, None, vec![2])
    );
}

#[test]
fn own_wakeups_precede_the_reply() {
    // A pipelining connection completes its own earlier WAIT.
    let mut engine = engine_with([1, 2]);
    assert_eq!(reply(&mut engine, 1, Op::Wait(ks(&["/k"]))), None);
    assert_eq!(reply(&mut engine, 2, Op::Wait(ks(&["/k"]))), None);
    assert_eq!(
        ok(&mut engine, 1, Op::Add(k("/k"), 4)),
        (1, Some(Reply::Int(4)), vec![2])
    );
    // Two pending waits of one connection are answered once each.
    assert_eq!(reply(&mut engine, 1, Op::Wait(ks(&["/m"]))), None);
    assert_eq!(reply(&mut engine, 1, Op::Wait(ks(&["/m", "/n"]))), None);
    assert_eq!(engine.waiter_count(), 2);
    assert_eq!(
        ok(&mut engine, 2, Op::Set(k("/m"), k("1"))),
        (0, None, vec![1])
    );
    assert_eq!(
        ok(&mut engine, 1, Op::Set(k("/n"), k("1"))),
        (1, None, vec![])
    );
    assert_eq!(engine.waiter_count(), 0);
}

// ---------------------------------------------------------------------------------------
// Queues.

#[test]
fn queue_push_pop_len() {
    let mut engine = engine_with([1]);
    assert_eq!(reply(&mut engine, 1, Op::Len(k("/q"))), Some(Reply::Int(0)));
    assert_eq!(
        reply(&mut engine, 1, Op::Pop(k("/q"))),
        Some(Reply::QueuePop(0, None))
    );
    reply(&mut engine, 1, Op::Push(k("/q"), k("first")));
    reply(&mut engine, 1, Op::Push(k("/q"), vec![]));
    reply(&mut engine, 1, Op::Push(k("/q"), k("third")));
    assert_eq!(reply(&mut engine, 1, Op::Len(k("/q"))), Some(Reply::Int(3)));
    assert_eq!(
        reply(&mut engine, 1, Op::Pop(k("/q"))),
        Some(Reply::QueuePop(3, Some(k("first"))))
    );
    assert_eq!(
        reply(&mut engine, 1, Op::Pop(k("/q"))),
        Some(Reply::QueuePop(2, Some(vec![])))
    );
    assert_eq!(
        reply(&mut engine, 1, Op::Pop(k("/q"))),
        Some(Reply::QueuePop(1, Some(k("third"))))
    );
    assert_eq!(
        reply(&mut engine, 1, Op::Pop(k("/q"))),
        Some(Reply::QueuePop(0, None))
    );
    assert_eq!(engine.num_queues(), 0, "emptied queues are removed");
    // Queues and keys are separate namespaces.
    reply(&mut engine, 1, Op::Push(k("/same"), k("q")));
    reply(&mut engine, 1, Op::Set(k("/same"), k("kv")));
    assert_eq!(
        reply(&mut engine, 1, Op::Get(k("/same"))),
        Some(Reply::Value(k("kv")))
    );
    assert_eq!(
        reply(&mut engine, 1, Op::Len(k("/same"))),
        Some(Reply::Int(1))
    );
    assert_eq!(
        reply(&mut engine, 1, Op::DeleteKey(k("/same"))),
        Some(Reply::Int(1))
    );
    assert_eq!(
        reply(&mut engine, 1, Op::Len(k("/same"))),
        Some(Reply::Int(1))
    );
    assert_eq!(engine.queue_len(b"/same"), 1);
}

#[test]
fn queue_push_wakes_one_waiter_per_element() {
    let mut engine = engine_with([1, 2, 3]);
    assert_eq!(reply(&mut engine, 2, Op::Wait(ks(&["/q"]))), None);
    assert_eq!(reply(&mut engine, 3, Op::Wait(ks(&["/q"]))), None);
    assert_eq!(
        ok(&mut engine, 1, Op::Push(k("/q"), k("a"))),
        (0, None, vec![2])
    );
    assert_eq!(engine.waiter_count(), 1);
    assert_eq!(
        ok(&mut engine, 1, Op::Push(k("/q"), k("b"))),
        (0, None, vec![3])
    );
    assert_eq!(
        ok(&mut engine, 1, Op::Push(k("/q"), k("c"))),
        (0, None, vec![])
    );
    assert_eq!(engine.waiter_count(), 0);
    assert_eq!(engine.waited_key_count(), 0);
}

#[test]
fn queue_push_satisfies_earlier_partial_waits_on_its_way() {
    // 2 waits on [/q, /x], 3 on [/q], 4 on [/q]. One push: /q arrives for 2 (not done),
    // then completes 3 and stops; 4 is untouched.
    let mut engine = engine_with([1, 2, 3, 4]);
    assert_eq!(reply(&mut engine, 2, Op::Wait(ks(&["/q", "/x"]))), None);
    assert_eq!(reply(&mut engine, 3, Op::Wait(ks(&["/q"]))), None);
    assert_eq!(reply(&mut engine, 4, Op::Wait(ks(&["/q"]))), None);
    assert_eq!(
        ok(&mut engine, 1, Op::Push(k("/q"), k("a"))),
        (0, None, vec![3])
    );
    // 2 now awaits only /x: another push does not count for it twice, and goes to 4.
    assert_eq!(
        ok(&mut engine, 1, Op::Push(k("/q"), k("b"))),
        (0, None, vec![4])
    );
    assert_eq!(
        ok(&mut engine, 1, Op::Push(k("/q"), k("c"))),
        (0, None, vec![])
    );
    assert_eq!(
        ok(&mut engine, 1, Op::Set(k("/x"), k("1"))),
        (0, None, vec![2])
    );
    assert_eq!(engine.waiter_count(), 0);
}

#[test]
fn blocking_queue_pop_pattern() {
    // PyTorch's queue_pop(block=True) is WAIT(key) then QUEUE_POP(key).
    let mut engine = engine_with([1, 2]);
    assert_eq!(reply(&mut engine, 2, Op::Wait(ks(&["/jobs"]))), None);
    assert_eq!(
        ok(&mut engine, 1, Op::Push(k("/jobs"), k("job-1"))),
        (0, None, vec![2])
    );
    assert_eq!(
        reply(&mut engine, 2, Op::Pop(k("/jobs"))),
        Some(Reply::QueuePop(1, Some(k("job-1"))))
    );
    // The popped element is released on the next request.
    reply(&mut engine, 2, Op::Ping(1));
    assert!(engine.popped.is_empty() && engine.popped.capacity() == 0);
}

// ---------------------------------------------------------------------------------------
// BARRIER.

#[test]
fn barrier_releases_everyone_on_the_last_arrival() {
    let mut engine = engine_with([1, 2, 3, 4]);
    assert_eq!(reply(&mut engine, 4, Op::Wait(ks(&["/bar"]))), None);
    assert_eq!(reply(&mut engine, 1, Op::Barrier(k("/bar"), 3)), None);
    assert_eq!(engine.get(b"/bar"), Some(&b"1"[..]));
    // The counter write does not wake plain waiters before the release.
    assert_eq!(
        ok(&mut engine, 2, Op::Barrier(k("/bar"), 3)),
        (0, None, vec![])
    );
    assert_eq!(engine.waiter_count(), 3);
    assert_eq!(
        ok(&mut engine, 3, Op::Barrier(k("/bar"), 3)),
        (0, STOP, vec![4, 1, 2])
    );
    assert_eq!(engine.get(b"/bar"), Some(&b"3"[..]));
    assert_eq!(engine.waiter_count(), 0);
    // Single use: a later arrival passes at once.
    assert_eq!(reply(&mut engine, 1, Op::Barrier(k("/bar"), 3)), STOP);
    assert_eq!(engine.get(b"/bar"), Some(&b"4"[..]));
}

#[test]
fn barrier_edge_cases() {
    let mut engine = engine_with([1, 2]);
    assert_eq!(reply(&mut engine, 1, Op::Barrier(k("/one"), 1)), STOP);
    assert_eq!(reply(&mut engine, 1, Op::Barrier(k("/zero"), 0)), STOP);
    assert_eq!(reply(&mut engine, 1, Op::Barrier(k("/neg"), -5)), STOP);
    // A SET on the key releases waiting arrivals early (it is an arrival of the key).
    assert_eq!(reply(&mut engine, 2, Op::Barrier(k("/b"), 5)), None);
    assert_eq!(
        ok(&mut engine, 1, Op::Set(k("/b"), k("x"))),
        (0, None, vec![2])
    );
    // ...and then the counter is not a number: BARRIER closes that connection.
    let (result, _) = step(&mut engine, 2, &Op::Barrier(k("/b"), 5));
    let close = result.unwrap_err();
    assert_eq!(
        close,
        Close::BadCounter {
            query: QueryType::Barrier,
            key: k("/b"),
            error: CounterError::NotANumber
        }
    );
    assert!(close.to_string().starts_with("BARRIER on key \"/b\""));
    // A waiting arrival cancelled with CANCEL_WAIT leaves its count behind.
    assert_eq!(reply(&mut engine, 1, Op::Barrier(k("/c"), 2)), None);
    assert_eq!(
        reply(&mut engine, 1, Op::CancelWait),
        Some(Reply::Wait(WaitResponse::WaitCanceled))
    );
    assert_eq!(engine.get(b"/c"), Some(&b"1"[..]));
    assert_eq!(engine.waiter_count(), 0);
}

// ---------------------------------------------------------------------------------------
// Disconnects.

#[test]
fn disconnect_drops_waits_and_unpolled_wakeups() {
    let mut engine = engine_with([1, 2, 3]);
    assert_eq!(reply(&mut engine, 2, Op::Wait(ks(&["/a"]))), None);
    assert_eq!(reply(&mut engine, 3, Op::Wait(ks(&["/a", "/b"]))), None);
    // A runtime that has not drained yet: 2's wake-up is queued when 2 goes away.
    let set = Op::Set(k("/a"), k("1"));
    set.with_request(|request| engine.handle_request(ConnId(1), request).map(|_| ()))
        .expect("set");
    assert_eq!(engine.pending_wakeups(), 1);
    assert!(engine.disconnect(ConnId(2)));
    assert_eq!(engine.pending_wakeups(), 0);
    assert!(engine.disconnect(ConnId(3)));
    assert_eq!(engine.waiter_count(), 0);
    assert_eq!(engine.waited_key_count(), 0);
    assert_eq!(
        ok(&mut engine, 1, Op::Set(k("/b"), k("1"))),
        (0, None, vec![])
    );
}

#[test]
fn many_connections_disconnect_mid_wait_leave_no_waiter() {
    const CONNS: u64 = 2_000;
    let mut engine = engine_with(0..CONNS);
    let key_of = |i: u64| std::format!("/k{}", i % 17).into_bytes();
    for conn in 1..CONNS {
        let op = match conn % 4 {
            0 => Op::Wait(vec![key_of(conn), key_of(conn + 1), key_of(conn)]),
            1 => Op::Wait(vec![key_of(conn)]),
            2 => Op::Barrier(k("/barrier"), i64::MAX),
            _ => Op::Wait(vec![key_of(conn), k("/never")]),
        };
        assert_eq!(reply(&mut engine, conn, op), None);
    }
    assert_eq!(engine.waiter_count(), (CONNS - 1) as usize);
    // Half the waiters vanish mid-wait, a quarter of the rest cancel.
    for conn in (1..CONNS).filter(|c| c % 2 == 0) {
        assert!(engine.disconnect(ConnId(conn)));
    }
    for conn in (1..CONNS).filter(|c| c % 8 == 1) {
        assert_eq!(
            reply(&mut engine, conn, Op::CancelWait),
            Some(Reply::Wait(WaitResponse::WaitCanceled))
        );
    }
    // Writing every key wakes exactly the survivors waiting on keys that exist now.
    let mut woken = Vec::new();
    for i in 0..17 {
        woken.extend(ok(&mut engine, 0, Op::Set(key_of(i), k("v"))).2);
    }
    woken.sort_unstable();
    let expected: Vec<u64> = (1..CONNS).filter(|c| c % 8 == 5).collect();
    assert_eq!(woken, expected);
    // The rest (/never and the barrier) are still pending until their connections go.
    let still: usize = (1..CONNS).filter(|c| c % 4 == 3).count();
    assert_eq!(engine.waiter_count(), still);
    for conn in 0..CONNS {
        engine.disconnect(ConnId(conn));
    }
    assert_eq!(engine.waiter_count(), 0);
    assert_eq!(engine.waited_key_count(), 0);
    assert_eq!(engine.connection_count(), 0);
    assert!(engine.waits.is_empty() && engine.conns.is_empty());
    assert_eq!(engine.pending_wakeups(), 0);
}

#[test]
fn wait_and_cancel_forever_keeps_a_keys_registrations_bounded() {
    // One peer WAITs on a key nobody writes and cancels, again and again, beside a
    // waiter that stays: the stale entries are compacted, never accumulated.
    let mut engine = engine_with([1, 2]);
    assert_eq!(reply(&mut engine, 2, Op::Wait(ks(&["/never"]))), None);
    let before = engine.heap_bytes();
    for _ in 0..10_000 {
        assert_eq!(reply(&mut engine, 1, Op::Wait(ks(&["/never", "/x"]))), None);
        assert_eq!(
            reply(&mut engine, 1, Op::CancelWait),
            Some(Reply::Wait(WaitResponse::WaitCanceled))
        );
        let entry = &engine.waiters[&b"/never"[..]];
        assert!(entry.ids.len() <= 3, "{} entries", entry.ids.len());
    }
    assert!(
        engine.heap_bytes() <= before + 1024,
        "memory grew with cancels"
    );
    assert_eq!(engine.waited_key_count(), 1);
    assert_eq!(ok(&mut engine, 1, Op::Set(k("/never"), k("v"))).2, vec![2]);
    assert_eq!(engine.waited_key_count(), 0);
}

#[test]
fn dropping_a_partly_satisfied_wait_leaves_later_waiters_on_its_key() {
    // Wait 1 on {/q, /other}: a push satisfies its /q registration. Connection 2 then
    // waits on /q; cancelling wait 1 must not count against /q's registrations.
    let mut engine = engine_with([1, 2, 3]);
    assert_eq!(reply(&mut engine, 1, Op::Wait(ks(&["/q", "/other"]))), None);
    assert_eq!(reply(&mut engine, 3, Op::Push(k("/q"), k("e"))), None);
    assert!(reply(&mut engine, 3, Op::Pop(k("/q"))).is_some());
    assert_eq!(reply(&mut engine, 2, Op::Wait(ks(&["/q"]))), None);
    assert_eq!(
        reply(&mut engine, 1, Op::CancelWait),
        Some(Reply::Wait(WaitResponse::WaitCanceled))
    );
    assert_eq!(engine.waited_key_count(), 1);
    assert_eq!(ok(&mut engine, 3, Op::Set(k("/q"), k("v"))).2, vec![2]);
    assert_eq!(engine.waiter_count(), 0);
}

#[test]
fn heap_bytes_per_idle_connection_is_under_a_kibibyte() {
    let mut engine = Engine::new();
    let empty = engine.heap_bytes();
    const CONNS: u64 = 10_000;
    for conn in 0..CONNS {
        assert!(engine.connect(ConnId(conn)));
        assert_eq!(
            reply(&mut engine, conn, Op::Validate(VALIDATION_MAGIC)),
            None
        );
    }
    let per_conn = (engine.heap_bytes() - empty) / CONNS as usize;
    assert!(
        per_conn > 0 && per_conn <= 1024,
        "{per_conn} bytes per connection"
    );
    // A wait adds its registration, its key copy and its table slots.
    for conn in 0..CONNS {
        assert_eq!(reply(&mut engine, conn, Op::Wait(ks(&["/done"]))), None);
    }
    assert!(engine.heap_bytes() > empty + per_conn * CONNS as usize);
    assert_eq!(
        ok(&mut engine, 0, Op::Set(k("/done"), k("1"))).2.len(),
        9_999
    );
}

// ---------------------------------------------------------------------------------------
// Model test: the engine against a naive store built from BTreeMaps and linear scans.

/// The documented semantics, written the simplest way.
#[derive(Debug, Default)]
struct Model {
    kv: BTreeMap<Vec<u8>, Vec<u8>>,
    queues: BTreeMap<Vec<u8>, VecDeque<Vec<u8>>>,
    /// Connection → validated.
    conns: BTreeMap<u64, bool>,
    /// Pending waits in registration order: (connection, keys still awaited).
    waits: Vec<(u64, BTreeSet<Vec<u8>>)>,
    own: usize,
    woken: Vec<u64>,
    requester: u64,
}

/// `std::stoll`: trim C whitespace, the longest `[+-]?[0-9]+` prefix, parsed.
fn model_stoll(value: &[u8]) -> Result<i64, CounterError> {
    let text: Vec<u8> = value
        .iter()
        .copied()
        .skip_while(|b| b" \t\n\x0b\x0c\r".contains(b))
        .collect();
    let sign = usize::from(matches!(text.first(), Some(b'+' | b'-')));
    let digits = text[sign..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .count();
    if digits == 0 {
        return Err(CounterError::NotANumber);
    }
    std::str::from_utf8(&text[..sign + digits])
        .expect("ascii")
        .parse()
        .map_err(|_| CounterError::OutOfRange)
}

impl Model {
    fn connect(&mut self, conn: u64) -> bool {
        if self.conns.contains_key(&conn) {
            return false;
        }
        self.conns.insert(conn, false);
        true
    }

    fn disconnect(&mut self, conn: u64) -> bool {
        self.waits.retain(|(c, _)| *c != conn);
        self.conns.remove(&conn).is_some()
    }

    fn present(&self, key: &[u8]) -> bool {
        self.kv.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    fn emit(&mut self, conn: u64) {
        if conn == self.requester {
            self.own += 1;
        } else {
            self.woken.push(conn);
        }
    }

    fn arrive_all(&mut self, key: &[u8]) {
        let mut i = 0;
        while i < self.waits.len() {
            if self.waits[i].1.remove(key) && self.waits[i].1.is_empty() {
                let (conn, _) = self.waits.remove(i);
                self.emit(conn);
            } else {
                i += 1;
            }
        }
    }

    fn arrive_one(&mut self, key: &[u8]) {
        for i in 0..self.waits.len() {
            if self.waits[i].1.remove(key) && self.waits[i].1.is_empty() {
                let (conn, _) = self.waits.remove(i);
                self.emit(conn);
                return;
            }
        }
    }

    fn counter(&self, key: &[u8], delta: i64) -> Result<i64, CounterError> {
        let base = match self.kv.get(key) {
            Some(value) => model_stoll(value)?,
            None => 0,
        };
        base.checked_add(delta).ok_or(CounterError::Overflow)
    }

    fn request(&mut self, conn: u64, op: &Op) -> Step {
        self.own = 0;
        self.woken.clear();
        self.requester = conn;
        let result = self.apply(conn, op);
        if result.is_err() {
            self.disconnect(conn);
        }
        let result = result.map(|reply| (self.own, reply));
        (result, core::mem::take(&mut self.woken))
    }

    fn apply(&mut self, conn: u64, op: &Op) -> Result<Option<Reply>, Close> {
        let Some(&validated) = self.conns.get(&conn) else {
            return Err(Close::UnknownConnection { conn: ConnId(conn) });
        };
        if !validated {
            return match op {
                Op::Validate(VALIDATION_MAGIC) => {
                    self.conns.insert(conn, true);
                    Ok(None)
                }
                Op::Validate(magic) => Err(Close::IncorrectValidate { magic: *magic }),
                other => Err(Close::MissingValidate {
                    query: other.with_request(|r| r.query_type()),
                }),
            };
        }
        let stop = Some(Reply::Wait(WaitResponse::StopWaiting));
        Ok(match op {
            Op::Validate(_) => return Err(Close::RepeatedValidate),
            Op::Set(key, value) => {
                self.kv.insert(key.clone(), value.clone());
                self.arrive_all(key);
                None
            }
            Op::CompareSet(key, expected, desired) => {
                let reply = match self.kv.get(key) {
                    None if expected.is_empty() => {
                        self.kv.insert(key.clone(), desired.clone());
                        desired.clone()
                    }
                    None => expected.clone(),
                    Some(current) if current == expected => {
                        self.kv.insert(key.clone(), desired.clone());
                        desired.clone()
                    }
                    Some(current) => current.clone(),
                };
                self.arrive_all(key);
                Some(Reply::Value(reply))
            }
            Op::Get(key) => Some(Reply::Value(self.kv.get(key).cloned().unwrap_or_default())),
            Op::Add(key, delta) => {
                let total = self
                    .counter(key, *delta)
                    .map_err(|error| Close::BadCounter {
                        query: QueryType::Add,
                        key: key.clone(),
                        error,
                    })?;
                self.kv.insert(key.clone(), total.to_string().into_bytes());
                self.arrive_all(key);
                Some(Reply::Int(total))
            }
            Op::Check(keys) => Some(Reply::Check(if keys.iter().all(|k| self.present(k)) {
                CheckResponse::Ready
            } else {
                CheckResponse::NotReady
            })),
            Op::Wait(keys) => {
                let missing: BTreeSet<Vec<u8>> =
                    keys.iter().filter(|k| !self.present(k)).cloned().collect();
                if missing.is_empty() {
                    stop
                } else {
                    self.waits.push((conn, missing));
                    None
                }
            }
            Op::GetNumKeys => Some(Reply::Int(self.kv.len() as i64)),
            Op::DeleteKey(key) => Some(Reply::Int(i64::from(self.kv.remove(key).is_some()))),
            Op::Append(key, value) => {
                self.kv
                    .entry(key.clone())
                    .or_default()
                    .extend_from_slice(value);
                self.arrive_all(key);
                None
            }
            Op::MultiGet(keys) => Some(Reply::Values(
                keys.iter()
                    .map(|k| self.kv.get(k).cloned().unwrap_or_default())
                    .collect(),
            )),
            Op::MultiSet(pairs) => {
                for (key, value) in pairs {
                    self.kv.insert(key.clone(), value.clone());
                    self.arrive_all(key);
                }
                None
            }
            Op::CancelWait => {
                self.waits.retain(|(c, _)| *c != conn);
                Some(Reply::Wait(WaitResponse::WaitCanceled))
            }
            Op::Ping(nonce) => Some(Reply::Pong(*nonce)),
            Op::Push(key, value) => {
                self.queues
                    .entry(key.clone())
                    .or_default()
                    .push_back(value.clone());
                self.arrive_one(key);
                None
            }
            Op::Pop(key) => {
                let queue = self.queues.entry(key.clone()).or_default();
                let len = queue.len() as i64;
                Some(Reply::QueuePop(len, queue.pop_front()))
            }
            Op::Len(key) => Some(Reply::Int(
                self.queues.get(key).map_or(0, |q| q.len() as i64),
            )),
            Op::ListKeys => Some(Reply::Keys(self.kv.keys().cloned().collect())),
            Op::Barrier(key, world_size) => {
                let count = self.counter(key, 1).map_err(|error| Close::BadCounter {
                    query: QueryType::Barrier,
                    key: key.clone(),
                    error,
                })?;
                self.kv.insert(key.clone(), count.to_string().into_bytes());
                if count >= *world_size {
                    self.arrive_all(key);
                    stop
                } else {
                    self.waits.push((conn, BTreeSet::from([key.clone()])));
                    None
                }
            }
        })
    }
}

#[derive(Debug, Clone)]
enum Action {
    Connect(u64),
    Disconnect(u64),
    Request(u64, Op),
}

fn key_strategy() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![Just(k("/a")), Just(k("/b")), Just(k("/c")), Just(k("/q"))]
}

fn value_strategy() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(vec![]),
        Just(k("1")),
        Just(k(" -2x")),
        Just(k("abc")),
        Just(k("9223372036854775807")),
        Just(k("99999999999999999999")),
        proptest::collection::vec(any::<u8>(), 0..3),
    ]
}

fn keys_strategy() -> impl Strategy<Value = Vec<Vec<u8>>> {
    proptest::collection::vec(key_strategy(), 0..4)
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let delta = prop_oneof![-3i64..4, Just(i64::MAX), Just(i64::MIN)];
    prop_oneof![
        1 => prop_oneof![Just(VALIDATION_MAGIC), any::<u32>()].prop_map(Op::Validate),
        4 => (key_strategy(), value_strategy()).prop_map(|(k, v)| Op::Set(k, v)),
        3 => (key_strategy(), value_strategy(), value_strategy())
            .prop_map(|(k, e, d)| Op::CompareSet(k, e, d)),
        2 => key_strategy().prop_map(Op::Get),
        3 => (key_strategy(), delta).prop_map(|(k, d)| Op::Add(k, d)),
        2 => keys_strategy().prop_map(Op::Check),
        6 => keys_strategy().prop_map(Op::Wait),
        1 => Just(Op::GetNumKeys),
        2 => key_strategy().prop_map(Op::DeleteKey),
        2 => (key_strategy(), value_strategy()).prop_map(|(k, v)| Op::Append(k, v)),
        1 => keys_strategy().prop_map(Op::MultiGet),
        2 => proptest::collection::vec((key_strategy(), value_strategy()), 0..3)
            .prop_map(Op::MultiSet),
        2 => Just(Op::CancelWait),
        1 => any::<u32>().prop_map(Op::Ping),
        4 => (key_strategy(), value_strategy()).prop_map(|(k, v)| Op::Push(k, v)),
        3 => key_strategy().prop_map(Op::Pop),
        1 => key_strategy().prop_map(Op::Len),
        1 => Just(Op::ListKeys),
        4 => (key_strategy(), -1i64..4).prop_map(|(k, w)| Op::Barrier(k, w)),
    ]
}

fn action_strategy() -> impl Strategy<Value = Action> {
    // Connection 5 is never connected by the preamble.
    let conn = 0u64..6;
    prop_oneof![
        1 => conn.clone().prop_map(Action::Connect),
        1 => conn.clone().prop_map(Action::Disconnect),
        24 => (conn, op_strategy()).prop_map(|(c, op)| Action::Request(c, op)),
    ]
}

fn check_invariants(engine: &Engine, model: &Model) {
    assert_eq!(engine.waiter_count(), model.waits.len());
    let keys: BTreeSet<&Vec<u8>> = model.waits.iter().flat_map(|(_, ks)| ks).collect();
    assert_eq!(engine.waited_key_count(), keys.len());
    assert_eq!(engine.num_keys(), model.kv.len());
    assert_eq!(engine.connection_count(), model.conns.len());
    assert_eq!(engine.pending_wakeups(), 0);
    for (key, value) in &model.kv {
        assert_eq!(engine.get(key), Some(&value[..]));
    }
    let queued = model.queues.values().filter(|q| !q.is_empty()).count();
    assert_eq!(engine.num_queues(), queued);
    // Internal consistency: registrations match each wait's remaining count.
    let mut registrations: BTreeMap<WaitId, usize> = BTreeMap::new();
    for entry in engine.waiters.values() {
        let live: Vec<WaitId> = entry
            .ids
            .iter()
            .filter(|(id, _)| engine.waits.contains_key(id))
            .map(|&(id, _)| id)
            .collect();
        assert!(!live.is_empty(), "an entry without a live registration");
        assert_eq!(entry.ids.len() - live.len(), entry.stale, "stale count");
        assert!(
            entry.stale * 2 <= entry.ids.len(),
            "stale entries compacted"
        );
        assert!(live.windows(2).all(|w| w[0] < w[1]), "registration order");
        for id in live {
            *registrations.entry(id).or_default() += 1;
        }
        for &(id, index) in &entry.ids {
            if let Some(wait) = engine.waits.get(&id) {
                assert!(
                    wait.keys.as_slice()[index].is_some(),
                    "a live entry's key is unsatisfied"
                );
            }
        }
    }
    for (id, wait) in &engine.waits {
        assert!(wait.remaining > 0);
        assert_eq!(registrations.get(id).copied(), Some(wait.remaining));
        assert!(engine.conns[&wait.conn].waits.contains(id));
    }
    assert_eq!(registrations.len(), engine.waits.len());
    assert_eq!(
        engine.held_bytes(),
        recomputed_held(engine),
        "budget accounting"
    );
}

/// What the engine should have charged against its total limit, from what it holds.
fn recomputed_held(engine: &Engine) -> usize {
    let kv: usize = engine
        .kv
        .iter()
        .map(|(k, v)| Budget::entry_cost(k.len(), v.len()))
        .sum();
    let queues: usize = engine
        .queues
        .iter()
        .map(|(k, q)| {
            Budget::entry_cost(k.len(), 0)
                + q.iter()
                    .map(|e| Budget::entry_cost(0, e.len()))
                    .sum::<usize>()
        })
        .sum();
    let waits: usize = engine.waits.values().map(|w| w.cost).sum();
    kv + queues + waits
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn engine_matches_model(actions in proptest::collection::vec(action_strategy(), 0..80)) {
        let mut engine = Engine::new();
        let mut model = Model::default();
        for conn in 0..5 {
            prop_assert!(engine.connect(ConnId(conn)) && model.connect(conn));
            let validate = Op::Validate(VALIDATION_MAGIC);
            prop_assert_eq!(step(&mut engine, conn, &validate), model.request(conn, &validate));
        }
        for action in &actions {
            match action {
                Action::Connect(conn) => {
                    prop_assert_eq!(engine.connect(ConnId(*conn)), model.connect(*conn));
                }
                Action::Disconnect(conn) => {
                    prop_assert_eq!(engine.disconnect(ConnId(*conn)), model.disconnect(*conn));
                }
                Action::Request(conn, op) => {
                    let got = step(&mut engine, *conn, op);
                    let want = model.request(*conn, op);
                    prop_assert_eq!(got, want, "{:?} from {}", op, conn);
                }
            }
            check_invariants(&engine, &model);
        }
        // Everyone leaves: nothing may outlive its connection.
        for conn in 0..6 {
            engine.disconnect(ConnId(conn));
        }
        prop_assert_eq!(engine.waiter_count(), 0);
        prop_assert_eq!(engine.waited_key_count(), 0);
        prop_assert_eq!(engine.connection_count(), 0);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// With a small budget, no sequence of requests makes the store hold more than its
    /// total limit or a value longer than the per-value one, and the accounting always
    /// matches what is held.
    #[test]
    fn no_request_sequence_exceeds_the_budget(
        actions in proptest::collection::vec(action_strategy(), 0..120),
    ) {
        let budget = Budget {
            max_value_bytes: 4,
            max_store_bytes: 600,
            ..Budget::default()
        };
        let mut engine = Engine::with_budget(budget);
        for action in &actions {
            match action {
                Action::Connect(conn) => {
                    engine.connect(ConnId(*conn));
                    let _ = step(&mut engine, *conn, &Op::Validate(VALIDATION_MAGIC));
                }
                Action::Disconnect(conn) => {
                    engine.disconnect(ConnId(*conn));
                }
                Action::Request(conn, op) => {
                    let _ = step(&mut engine, *conn, op);
                }
            }
            prop_assert!(engine.held_bytes() <= budget.max_store_bytes);
            prop_assert_eq!(engine.held_bytes(), recomputed_held(&engine));
            for value in engine.kv.values() {
                prop_assert!(value.len() <= budget.max_value_bytes);
            }
        }
        for conn in 0..6 {
            engine.disconnect(ConnId(conn));
        }
        prop_assert_eq!(engine.held_bytes(), recomputed_held(&engine));
    }
}

#[test]
fn append_is_held_to_the_value_limit_and_refusals_change_nothing() {
    let budget = Budget {
        max_value_bytes: 8,
        max_store_bytes: 1000,
        ..Budget::default()
    };
    let mut engine = Engine::with_budget(budget);
    assert!(engine.connect(ConnId(1)));
    reply(&mut engine, 1, Op::Validate(VALIDATION_MAGIC));
    reply(&mut engine, 1, Op::Append(k("/a"), k("12345")));
    let held = engine.held_bytes();
    let (result, _) = step(&mut engine, 1, &Op::Append(k("/a"), k("6789")));
    match result {
        Err(Close::ValueTooLarge {
            len: 9, limit: 8, ..
        }) => {}
        other => panic!("expected ValueTooLarge, got {other:?}"),
    }
    assert_eq!(engine.get(b"/a"), Some(&b"12345"[..]), "nothing appended");
    assert_eq!(engine.held_bytes(), held);
    assert!(!engine.is_connected(ConnId(1)), "the connection was closed");
}

#[test]
fn the_total_limit_refuses_the_write_that_would_pass_it() {
    let budget = Budget {
        max_value_bytes: 100,
        max_store_bytes: 3 * Budget::entry_cost(2, 100),
        ..Budget::default()
    };
    let mut engine = engine_with_budget(budget, [1]);
    for key in ["/a", "/b", "/c"] {
        reply(&mut engine, 1, Op::Set(k(key), vec![0; 100]));
    }
    assert_eq!(engine.held_bytes(), budget.max_store_bytes);
    // Overwriting in place (same size) or shrinking still works when full.
    reply(&mut engine, 1, Op::Set(k("/a"), vec![1; 100]));
    reply(&mut engine, 1, Op::Set(k("/b"), vec![1; 10]));
    let (result, _) = step(
        &mut engine,
        1,
        &Op::MultiSet(vec![(k("/d"), vec![0; 50]), (k("/e"), vec![0; 50])]),
    );
    assert!(matches!(result, Err(Close::StoreFull { .. })), "{result:?}");
    assert_eq!(
        engine.get(b"/d"),
        None,
        "a refused MULTI_SET writes nothing"
    );
    let mut engine = engine_with_budget(budget, [2]);
    let (result, _) = step(&mut engine, 2, &Op::Push(k("/q"), vec![0; 101]));
    assert!(
        matches!(result, Err(Close::ValueTooLarge { .. })),
        "{result:?}"
    );
}

#[test]
fn uptime_runs_from_the_first_tick() {
    let mut engine = Engine::new();
    assert_eq!(engine.stats().uptime_ms, 0);
    engine.tick(1_000);
    engine.tick(3_500);
    engine.tick(2_000);
    assert_eq!(engine.stats().uptime_ms, 2_500);
}

fn engine_with_budget(budget: Budget, conns: impl IntoIterator<Item = u64>) -> Engine {
    let mut engine = Engine::with_budget(budget);
    for conn in conns {
        assert!(engine.connect(ConnId(conn)));
        reply(&mut engine, conn, Op::Validate(VALIDATION_MAGIC));
    }
    engine
}

#[test]
fn engine_can_move_between_threads() {
    fn assert_send<T: Send>() {}
    assert_send::<Engine>();
    assert_send::<Close>();
}

/// `STATS` reports what the store holds and how many requests of each type it served
/// (the request itself included); traffic is what the runtime reported.
#[test]
fn stats_counts_requests_and_reports_the_store() {
    let mut engine = engine_with([1, 2]);
    engine
        .handle_request(
            ConnId(1),
            Request::Set {
                key: b"a",
                value: b"1",
            },
        )
        .unwrap();
    engine
        .handle_request(
            ConnId(1),
            Request::QueuePush {
                key: b"q",
                value: b"x",
            },
        )
        .unwrap();
    let keys = encode_keys(&ks(&["missing"]));
    engine
        .handle_request(
            ConnId(2),
            Request::Wait {
                keys: KeyList::new(1, &keys).unwrap(),
            },
        )
        .unwrap();
    engine.count_traffic(10, 3);
    let outcome = engine.handle_request(ConnId(1), Request::Stats).unwrap();
    let Some(Response::Stats(stats)) = outcome.reply else {
        panic!("STATS must reply with the counters");
    };
    assert_eq!(
        (stats.connections, stats.keys, stats.waiters, stats.queues),
        (2, 1, 1, 1)
    );
    assert_eq!(
        (stats.bytes_in, stats.bytes_out, stats.uptime_ms),
        (10, 3, 0)
    );
    assert_eq!(stats.requests_of(QueryType::Validate), 2);
    assert_eq!(stats.requests_of(QueryType::Set), 1);
    assert_eq!(stats.requests_of(QueryType::Wait), 1);
    assert_eq!(stats.requests_of(QueryType::Stats), 1);
    assert_eq!(stats.requests_of(QueryType::Get), 0);
}
