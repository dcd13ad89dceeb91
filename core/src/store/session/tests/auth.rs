//! The serve step's `AUTH` gate in virtual time: the first frame must be `AUTH` with a
//! token of the table, then every request is checked against the token's scope before
//! the engine sees it; each refusal closes and is counted once. A property test drives
//! random connections (a token or none, then requests) against a model of the table and
//! of the keys stored.

use alloc::collections::BTreeSet;
use alloc::sync::Arc;
use std::string::ToString;
use std::vec;
use std::vec::Vec;

use proptest::prelude::*;

use crate::store::access::{AccessCounters, AccessPolicy, Refusal as AccessRefusal, TokenTable};
use crate::store::budget::Budget;
use crate::store::codec::{AuthRequest, Limits, AUTH_ACCEPTED};
use crate::store::engine::Engine;
use crate::store::session::{Refusal, Session, Step, Wake};
use crate::store::{ConnId, QueryType, Request, VALIDATION_MAGIC};

const ALL: &str = "6tq2bX0n8Wc1pFv4LmZs7QyR";
const JOB1: &str = "f0H3kd8Jq2LmZp5Vw9XyTb1C";
const BAD: &str = "0000000000000000wrong";

fn policy() -> Arc<AccessPolicy> {
    let file = std::format!("# operators\n{ALL}\n{JOB1} /job1/\n");
    let tokens = TokenTable::parse(file.as_bytes()).expect("a valid token file");
    Arc::new(AccessPolicy::new(None, Some(tokens)))
}

fn auth(token: &str) -> Vec<u8> {
    let mut frame = Vec::new();
    AuthRequest {
        token: token.as_bytes(),
    }
    .encode_into(&mut frame);
    frame
}

fn frame(request: &Request<'_>) -> Vec<u8> {
    let mut frame = Vec::new();
    request.encode_into(&mut frame);
    frame
}

fn validate() -> Vec<u8> {
    frame(&Request::Validate {
        magic: VALIDATION_MAGIC,
    })
}

/// One connection under `policy`, driven as a runtime drives it.
struct Conn {
    session: Session,
    input: Vec<u8>,
    out: Vec<u8>,
    wakes: Vec<Wake>,
}

impl Conn {
    fn new(engine: &mut Engine, id: u64, policy: &Arc<AccessPolicy>) -> Conn {
        assert!(engine.connect(ConnId(id)));
        Conn {
            session: Session::new(ConnId(id), Limits::default(), Budget::default())
                .with_access(policy),
            input: Vec::new(),
            out: Vec::new(),
            wakes: Vec::new(),
        }
    }

    /// Feeds `bytes` and serves one frame; a served frame's bytes are consumed.
    fn send(&mut self, engine: &mut Engine, bytes: &[u8]) -> Step {
        self.input.extend_from_slice(bytes);
        let step = self.session.serve(
            engine,
            &self.input,
            self.out.len(),
            &mut self.out,
            &mut self.wakes,
            0,
        );
        if let Step::Served { used, .. } | Step::Authenticated { used } = step {
            self.input.drain(..used);
        }
        step
    }
}

fn access_refusal(step: &Step) -> Option<AccessRefusal> {
    match step {
        Step::Close(Refusal::Access(refusal)) => Some(*refusal),
        _ => None,
    }
}

#[test]
fn a_good_token_is_accepted_and_answered() {
    let policy = policy();
    let mut engine = Engine::new();
    let mut conn = Conn::new(&mut engine, 1, &policy);
    let auth = auth(ALL);
    // In pieces: the step waits for the whole frame and answers nothing before it.
    let step = conn.send(&mut engine, &auth[..3]);
    assert!(matches!(step, Step::Partial { .. }), "{step:?}");
    assert!(conn.out.is_empty());
    let step = conn.send(&mut engine, &auth[3..]);
    assert_eq!(step, Step::Authenticated { used: auth.len() });
    assert_eq!(conn.out, vec![AUTH_ACCEPTED]);
    // PyTorch's handshake follows, then any key and any query: no prefix.
    let step = conn.send(&mut engine, &validate());
    assert!(
        matches!(
            step,
            Step::Served {
                query: QueryType::Validate,
                ..
            }
        ),
        "{step:?}"
    );
    let set = frame(&Request::Set {
        key: b"/anywhere",
        value: b"1",
    });
    assert!(matches!(conn.send(&mut engine, &set), Step::Served { .. }));
    let list = frame(&Request::ListKeys);
    assert!(matches!(conn.send(&mut engine, &list), Step::Served { .. }));
    assert_eq!(engine.get(b"/anywhere"), Some(&b"1"[..]));
}

#[test]
fn a_bad_token_a_missing_token_and_a_second_auth_are_refused() {
    let policy = policy();
    let mut engine = Engine::new();
    let mut counters = AccessCounters::default();

    let mut bad = Conn::new(&mut engine, 1, &policy);
    let step = bad.send(&mut engine, &auth(BAD));
    assert_eq!(
        access_refusal(&step),
        Some(AccessRefusal::BadToken),
        "{step:?}"
    );
    assert!(bad.out.is_empty(), "nothing is answered to a bad token");
    counters.record(&AccessRefusal::BadToken);

    // A PyTorch client: VALIDATE first; the refusal's text says why.
    let mut pytorch = Conn::new(&mut engine, 2, &policy);
    let step = pytorch.send(&mut engine, &validate());
    let refusal = access_refusal(&step).expect("refused");
    assert_eq!(
        refusal,
        AccessRefusal::NotAuthenticated {
            byte: QueryType::Validate as u8
        }
    );
    let text = refusal.to_string();
    assert!(text.contains("requires a token"), "{text}");
    counters.record(&refusal);

    // A request before AUTH is refused and reaches no engine state.
    let mut early = Conn::new(&mut engine, 3, &policy);
    let set = frame(&Request::Set {
        key: b"/job1/x",
        value: b"1",
    });
    let refusal = access_refusal(&early.send(&mut engine, &set)).expect("refused");
    assert!(matches!(refusal, AccessRefusal::NotAuthenticated { .. }));
    counters.record(&refusal);
    assert_eq!(engine.num_keys(), 0, "the refused SET stored nothing");

    let mut twice = Conn::new(&mut engine, 4, &policy);
    let step = twice.send(&mut engine, &auth(JOB1));
    assert!(matches!(step, Step::Authenticated { .. }), "{step:?}");
    let step = twice.send(&mut engine, &auth(JOB1));
    assert!(matches!(step, Step::Close(_)), "{step:?}");

    assert_eq!(
        counters,
        AccessCounters {
            refused_peers: 0,
            refused_tokens: 3,
            refused_requests: 0,
        }
    );
}

#[test]
fn a_prefix_token_is_held_to_its_prefix() {
    let policy = policy();
    let mut engine = Engine::new();
    let mut conn = Conn::new(&mut engine, 1, &policy);
    let step = conn.send(&mut engine, &auth(JOB1));
    assert!(matches!(step, Step::Authenticated { .. }), "{step:?}");
    for request in [
        Request::Validate {
            magic: VALIDATION_MAGIC,
        },
        Request::Set {
            key: b"/job1/a",
            value: b"5",
        },
        Request::Get { key: b"/job1/a" },
        Request::Add {
            key: b"/job1/n",
            delta: 2,
        },
        Request::DeleteKey { key: b"/job1/a" },
    ] {
        let step = conn.send(&mut engine, &frame(&request));
        assert!(matches!(step, Step::Served { .. }), "{request:?}: {step:?}");
    }
    // Outside the prefix, and the queries that see every tenant: each closes.
    let mut counters = AccessCounters::default();
    let refused = [
        Request::Get { key: b"/job2/a" },
        Request::Set {
            key: b"/job10",
            value: b"x",
        },
        Request::GetNumKeys,
        Request::ListKeys,
        Request::Stats,
    ];
    for (id, request) in refused.iter().enumerate() {
        let mut conn = Conn::new(&mut engine, 10 + id as u64, &policy);
        conn.send(&mut engine, &auth(JOB1));
        let refusal = access_refusal(&conn.send(&mut engine, &frame(request))).expect("refused");
        let query = request.query_type();
        match query {
            QueryType::GetNumKeys | QueryType::ListKeys | QueryType::Stats => {
                assert_eq!(refusal, AccessRefusal::QueryNotAllowed { query })
            }
            _ => assert_eq!(refusal, AccessRefusal::KeyOutsidePrefix { query }),
        }
        counters.record(&refusal);
    }
    assert_eq!(counters.refused_requests, refused.len() as u64);
    assert_eq!(counters.refused_tokens, 0);
    // The ADD's counter is the one key left; "/job10" was never stored.
    assert_eq!(engine.num_keys(), 1);
    assert_eq!(engine.get(b"/job1/n"), Some(&b"2"[..]));
    assert_eq!(engine.get(b"/job10"), None);
}

/// What a connection sends first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Opening {
    NoToken,
    All,
    Job1,
    Bad,
}

/// One request of the property test, on one of [`KEYS`].
#[derive(Debug, Clone, Copy)]
enum Op {
    Set(usize),
    Get(usize),
    Add(usize),
    Delete(usize),
    NumKeys,
}

/// Keys inside and just outside `/job1/`.
const KEYS: [&[u8]; 4] = [b"/job1/a", b"/job1/", b"/job2/a", b"/job1"];

fn request(op: Op) -> Request<'static> {
    match op {
        Op::Set(k) => Request::Set {
            key: KEYS[k],
            value: b"1",
        },
        Op::Get(k) => Request::Get { key: KEYS[k] },
        Op::Add(k) => Request::Add {
            key: KEYS[k],
            delta: 1,
        },
        Op::Delete(k) => Request::DeleteKey { key: KEYS[k] },
        Op::NumKeys => Request::GetNumKeys,
    }
}

/// The model: whether a connection opened with `opening` may make `op`.
fn model_allows(opening: Opening, op: Op) -> bool {
    match opening {
        Opening::NoToken | Opening::Bad => false,
        Opening::All => true,
        Opening::Job1 => match op {
            Op::Set(k) | Op::Get(k) | Op::Add(k) | Op::Delete(k) => KEYS[k].starts_with(b"/job1/"),
            Op::NumKeys => false,
        },
    }
}

/// The model's stored keys after `op` was served.
fn model_apply(stored: &mut BTreeSet<usize>, op: Op) {
    match op {
        Op::Set(k) | Op::Add(k) => {
            stored.insert(k);
        }
        Op::Delete(k) => {
            stored.remove(&k);
        }
        Op::Get(_) | Op::NumKeys => {}
    }
}

fn opening() -> impl Strategy<Value = Opening> {
    prop_oneof![
        Just(Opening::NoToken),
        Just(Opening::All),
        Just(Opening::Job1),
        Just(Opening::Bad)
    ]
}

fn op() -> impl Strategy<Value = Op> {
    // SET writes "1", an integer, so an ADD on the same key is always served.
    prop_oneof![
        (0..KEYS.len()).prop_map(Op::Set),
        (0..KEYS.len()).prop_map(Op::Get),
        (0..KEYS.len()).prop_map(Op::Add),
        (0..KEYS.len()).prop_map(Op::Delete),
        Just(Op::NumKeys),
    ]
}

proptest! {
    /// A request is served iff the model says its connection's token reaches its keys;
    /// the first refusal closes the connection (the test sends nothing after it), the
    /// counters count exactly the refusals made, and the engine holds exactly the keys
    /// the model's served requests stored.
    #[test]
    fn requests_are_served_iff_the_model_allows_them(
        conns in proptest::collection::vec(
            (opening(), proptest::collection::vec(op(), 0..8)),
            1..6,
        )
    ) {
        let policy = policy();
        let mut engine = Engine::new();
        let mut counters = AccessCounters::default();
        let mut expected = AccessCounters::default();
        let mut stored = BTreeSet::new();
        for (index, (opening, ops)) in conns.iter().enumerate() {
            let id = ConnId(index as u64 + 1);
            let mut conn = Conn::new(&mut engine, id.0, &policy);
            let token = match opening {
                Opening::NoToken => None,
                Opening::All => Some(ALL),
                Opening::Job1 => Some(JOB1),
                Opening::Bad => Some(BAD),
            };
            let mut closed = false;
            if let Some(token) = token {
                let step = conn.send(&mut engine, &auth(token));
                if *opening == Opening::Bad {
                    prop_assert_eq!(access_refusal(&step), Some(AccessRefusal::BadToken));
                    counters.record(&AccessRefusal::BadToken);
                    expected.refused_tokens += 1;
                    closed = true;
                } else {
                    prop_assert!(matches!(step, Step::Authenticated { .. }), "{:?}", step);
                    // PyTorch's handshake, which the engine asks before any key.
                    let step = conn.send(&mut engine, &validate());
                    prop_assert!(matches!(step, Step::Served { .. }), "{:?}", step);
                }
            }
            for &op in ops {
                if closed {
                    break;
                }
                let step = conn.send(&mut engine, &frame(&request(op)));
                if model_allows(*opening, op) {
                    prop_assert!(matches!(step, Step::Served { .. }), "{:?} {:?}", op, step);
                    model_apply(&mut stored, op);
                    continue;
                }
                let refusal = access_refusal(&step);
                prop_assert!(refusal.is_some(), "{:?} {:?} {:?}", opening, op, step);
                if let Some(refusal) = refusal {
                    counters.record(&refusal);
                }
                if token.is_none() {
                    expected.refused_tokens += 1;
                } else {
                    expected.refused_requests += 1;
                }
                closed = true;
            }
            engine.disconnect(id);
        }
        prop_assert_eq!(counters, expected);
        for (k, key) in KEYS.iter().enumerate() {
            prop_assert_eq!(engine.get(key).is_some(), stored.contains(&k), "{:?}", key);
        }
    }
}
