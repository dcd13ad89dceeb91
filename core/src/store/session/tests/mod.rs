//! The serve step in virtual time: the per-connection budget, backpressure, wake-ups as
//! values, and a property test that no input makes the step exceed its budget.

use super::*;
use crate::store::VALIDATION_MAGIC;
use proptest::prelude::*;
use std::vec;
use std::vec::Vec;

fn prefixed(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

fn validate() -> Vec<u8> {
    let mut f = vec![QueryType::Validate as u8];
    f.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
    f
}

fn set(key: &[u8], value: &[u8]) -> Vec<u8> {
    let mut f = vec![QueryType::Set as u8];
    prefixed(&mut f, key);
    prefixed(&mut f, value);
    f
}

fn get(key: &[u8]) -> Vec<u8> {
    let mut f = vec![QueryType::Get as u8];
    prefixed(&mut f, key);
    f
}

fn multi_get(key: &[u8], times: usize) -> Vec<u8> {
    let mut f = vec![QueryType::MultiGet as u8];
    f.extend_from_slice(&(times as u64).to_le_bytes());
    for _ in 0..times {
        prefixed(&mut f, key);
    }
    f
}

fn wait(key: &[u8]) -> Vec<u8> {
    let mut f = vec![QueryType::Wait as u8];
    f.extend_from_slice(&1u64.to_le_bytes());
    prefixed(&mut f, key);
    f
}

const SMALL: Budget = Budget {
    max_value_bytes: 1 << 10,
    max_store_bytes: 1 << 16,
    max_conn_bytes: 4 << 10,
    out_high_water: 2 << 10,
};

/// A connection as a runtime drives it: its input buffer, its owed output, its session.
struct Conn {
    session: Session,
    input: Vec<u8>,
    out: Vec<u8>,
    wakes: Vec<Wake>,
}

impl Conn {
    fn new(engine: &mut Engine, id: u64, budget: Budget) -> Conn {
        assert!(engine.connect(ConnId(id)));
        Conn {
            session: Session::new(ConnId(id), Limits::default(), budget),
            input: Vec::new(),
            out: Vec::new(),
            wakes: Vec::new(),
        }
    }

    /// Serves until the step stops serving; returns the step that stopped it.
    fn pump(&mut self, engine: &mut Engine, now: u64) -> Step {
        loop {
            let owed = self.out.len();
            let step = self.session.serve(
                engine,
                &self.input,
                owed,
                &mut self.out,
                &mut self.wakes,
                now,
            );
            match step {
                Step::Served { used, .. } => {
                    self.input.drain(..used);
                }
                other => return other,
            }
        }
    }
}

#[test]
fn a_reply_over_the_budget_closes_before_anything_is_reserved() {
    let budget = Budget {
        max_conn_bytes: 4 << 20,
        ..SMALL
    };
    let mut engine = Engine::with_budget(budget);
    let mut conn = Conn::new(&mut engine, 1, budget);
    conn.input = validate();
    conn.input.extend(set(b"big", &[7; 1 << 10]));
    assert_eq!(conn.pump(&mut engine, 0), Step::Partial { needed: 1 });
    // 131072 copies of a 1 KiB value: 128 MiB of reply, never built.
    conn.input.extend(multi_get(b"big", 131_072));
    let step = conn.pump(&mut engine, 0);
    match step {
        Step::Close(Refusal::ReplyOverBudget {
            query: QueryType::MultiGet,
            len,
            ..
        }) => assert!(len > 128 << 20),
        other => panic!("expected ReplyOverBudget, got {other:?}"),
    }
    assert_eq!(conn.out.capacity(), 0, "nothing reserved");
}

#[test]
fn an_owed_connection_is_not_served_until_it_drains() {
    let mut engine = Engine::with_budget(SMALL);
    let mut conn = Conn::new(&mut engine, 1, SMALL);
    conn.input = validate();
    conn.input.extend(set(b"v", &[1; 1000]));
    for _ in 0..100 {
        conn.input.extend(get(b"v"));
    }
    assert_eq!(conn.pump(&mut engine, 0), Step::Blocked);
    // The mark plus one reply at most.
    assert!(
        conn.out.len() <= SMALL.out_high_water + 1008,
        "{}",
        conn.out.len()
    );
    let left = conn.input.len();
    assert!(left > 0, "the rest waits in the input");
    // The peer reads everything: serving resumes where it stopped.
    let mut replies = conn.out.len() / 1008;
    while replies < 100 {
        conn.out.clear();
        let step = conn.pump(&mut engine, 0);
        replies += conn.out.len() / 1008;
        assert!(conn.out.len() <= SMALL.out_high_water + 1008);
        if replies < 100 {
            assert_eq!(step, Step::Blocked);
        } else {
            assert_eq!(step, Step::Partial { needed: 1 });
        }
    }
    assert!(conn.input.is_empty());
}

#[test]
fn a_request_larger_than_the_budget_closes_while_it_arrives() {
    let mut engine = Engine::with_budget(SMALL);
    let mut conn = Conn::new(&mut engine, 1, SMALL);
    conn.input = validate();
    // A MULTI_SET of 64 pairs of 1000-byte values, arriving pair by pair: refused once
    // the bytes it needs pass the budget, before the runtime holds them.
    conn.input.push(QueryType::MultiSet as u8);
    conn.input.extend_from_slice(&64u64.to_le_bytes());
    let mut step = conn.pump(&mut engine, 0);
    for _ in 0..64 {
        if !matches!(step, Step::Partial { .. }) {
            break;
        }
        assert!(conn.input.len() <= SMALL.max_conn_bytes);
        prefixed(&mut conn.input, b"k");
        prefixed(&mut conn.input, &[0; 1000]);
        step = conn.pump(&mut engine, 0);
    }
    assert!(
        matches!(step, Step::Close(Refusal::RequestOverBudget { .. })),
        "{step:?}"
    );
    assert!(conn.input.len() <= SMALL.max_conn_bytes + 1016);
}

#[test]
fn wake_ups_for_others_come_back_as_values_and_stats_report_uptime() {
    let mut engine = Engine::with_budget(SMALL);
    let mut waiter = Conn::new(&mut engine, 1, SMALL);
    let mut setter = Conn::new(&mut engine, 2, SMALL);
    waiter.input = validate();
    waiter.input.extend(wait(b"k"));
    assert_eq!(waiter.pump(&mut engine, 5), Step::Partial { needed: 1 });
    assert!(waiter.out.is_empty());
    setter.input = validate();
    setter.input.extend(set(b"k", b"v"));
    setter.input.push(QueryType::Stats as u8);
    setter.pump(&mut engine, 1_005);
    assert_eq!(setter.wakes, [(ConnId(1), WaitResponse::StopWaiting)]);
    assert_eq!(engine.stats().uptime_ms, 1_000);
    assert!(!setter.out.is_empty(), "the STATS reply");
}

#[test]
fn bad_bytes_and_engine_refusals_close() {
    let mut engine = Engine::with_budget(SMALL);
    let mut conn = Conn::new(&mut engine, 1, SMALL);
    conn.input = vec![0xff, 0, 0];
    assert!(matches!(
        conn.pump(&mut engine, 0),
        Step::Close(Refusal::BadRequest(_))
    ));
    let mut conn = Conn::new(&mut engine, 2, SMALL);
    conn.input = get(b"k");
    assert!(matches!(
        conn.pump(&mut engine, 0),
        Step::Close(Refusal::Engine(Close::MissingValidate { .. }))
    ));
}

#[test]
fn a_validated_session_is_answered_as_the_engine_answers() {
    // After its VALIDATE a session skips the engine's check (handle_validated_request):
    // its replies and the engine's counts are those of a connection checked every time.
    let (mut engine, mut checked) = (Engine::with_budget(SMALL), Engine::with_budget(SMALL));
    let mut conn = Conn::new(&mut engine, 1, SMALL);
    assert!(checked.connect(ConnId(1)));
    let requests = [validate(), set(b"k", b"v"), get(b"k"), get(b"missing")];
    for bytes in &requests {
        conn.input.extend_from_slice(bytes);
    }
    assert!(matches!(conn.pump(&mut engine, 0), Step::Partial { .. }));
    let mut expected = Vec::new();
    for bytes in &requests {
        let mut decoder = crate::store::codec::RequestDecoder::new(Limits::default());
        let Ok(Decoded::Complete(request, _)) = decoder.decode(bytes) else {
            panic!("a whole request");
        };
        let outcome = checked.handle_request(ConnId(1), request).expect("served");
        if let Some(reply) = &outcome.reply {
            reply.encode_into(&mut expected).expect("encoded");
        }
    }
    assert_eq!(conn.out, expected);
    assert_eq!(engine.stats().requests, checked.stats().requests);
    // A second VALIDATE is refused as it is for a checked connection.
    conn.input = validate();
    assert!(matches!(
        conn.pump(&mut engine, 0),
        Step::Close(Refusal::Engine(Close::RepeatedValidate))
    ));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Arbitrary bytes, after a VALIDATE, never make a connection hold more than its
    /// budget: the input it keeps, what it owes, and the store.
    #[test]
    fn no_input_exceeds_the_budget(
        pieces in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..32),
        reads in proptest::collection::vec(0usize..4096, 0..32),
    ) {
        let mut data = validate();
        for piece in &pieces {
            data.extend_from_slice(piece);
        }
        check_budget(&data, &reads);
    }
}

/// Feeds `data` through a session in pieces, with the peer reading `reads[i]` owed
/// bytes between pieces; asserts every bound (the fuzz target's checks).
fn check_budget(data: &[u8], reads: &[usize]) {
    crate::fuzzing::serve_step_with(data, reads, SMALL);
}

mod auth;
