//! The store serve step (`store::session`) driven with arbitrary bytes as a runtime
//! drives it: input arriving in pieces, a peer that reads its replies slowly, and the
//! per-connection and total budgets checked after every step.

use alloc::vec::Vec;

use crate::store::budget::Budget;
use crate::store::codec::Limits;
use crate::store::engine::Engine;
use crate::store::session::{Session, Step};
use crate::store::{ConnId, QueryType, VALIDATION_MAGIC};

/// A small budget, so that arbitrary input reaches every limit quickly.
const BUDGET: Budget = Budget {
    max_value_bytes: 1 << 10,
    max_store_bytes: 1 << 16,
    max_conn_bytes: 8 << 10,
    out_high_water: 2 << 10,
};

/// The fuzz target: the first byte picks whether a `VALIDATE` is prepended and the next
/// four how fast the peer reads; the rest is the connection's input.
pub fn serve_step(data: &[u8]) {
    let (head, body) = data.split_at(data.len().min(5));
    let mut input = Vec::new();
    if head.first().is_none_or(|b| b & 1 == 0) {
        input.push(QueryType::Validate as u8);
        input.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
    }
    input.extend_from_slice(body);
    let reads: Vec<usize> = head.iter().skip(1).map(|&b| usize::from(b) * 64).collect();
    serve_step_with(&input, &reads, BUDGET);
}

/// Feeds `data` to one connection in pieces of 1 to 997 bytes, serving after each as a
/// runtime does, with the peer reading `reads[i % len]` owed bytes (at least 512) between
/// pieces; asserts that the connection never holds more than `budget` allows (the mark
/// plus one reply owed, a request that fits), nor the store.
pub fn serve_step_with(data: &[u8], reads: &[usize], budget: Budget) {
    let mut engine = Engine::with_budget(budget);
    let id = ConnId(1);
    assert!(engine.connect(id));
    let mut session = Session::new(id, Limits::default(), budget);
    let mut input: Vec<u8> = Vec::new();
    let mut out: Vec<u8> = Vec::new();
    let mut wakes = Vec::new();
    let mut fed = 0;
    let mut round = 0usize;
    let mut blocked = false;
    loop {
        if !blocked && fed < data.len() {
            let size = 1 + (round * 131 + fed) % 997;
            let end = data.len().min(fed + size);
            input.extend_from_slice(&data[fed..end]);
            fed = end;
        }
        blocked = false;
        loop {
            let owed = out.len();
            let step = session.serve(
                &mut engine,
                &input,
                owed,
                &mut out,
                &mut wakes,
                round as u64,
            );
            match step {
                Step::Served { used, .. } | Step::Authenticated { used } => {
                    assert!(used > 0 && used <= input.len());
                    input.drain(..used);
                    assert!(
                        out.len() <= budget.max_conn_bytes,
                        "owed {} over the budget",
                        out.len()
                    );
                }
                Step::Partial { needed } => {
                    assert!(needed >= 1);
                    assert!(
                        input.len().saturating_add(out.len()) <= budget.max_conn_bytes,
                        "an unfinished request of {} bytes beside {} owed",
                        input.len(),
                        out.len()
                    );
                    break;
                }
                Step::Blocked => {
                    assert!(out.len() > budget.out_high_water);
                    blocked = true;
                    break;
                }
                Step::Close(refusal) => {
                    super::check_display(&refusal);
                    return;
                }
            }
        }
        assert!(engine.held_bytes() <= budget.max_store_bytes);
        assert!(out.len() <= budget.out_high_water.saturating_add(budget.max_conn_bytes));
        let read = reads
            .get(round % reads.len().max(1))
            .copied()
            .unwrap_or(usize::MAX)
            .max(512);
        out.drain(..out.len().min(read));
        round += 1;
        if fed >= data.len() && !blocked {
            return;
        }
    }
}
