//! Criterion benchmarks of the store engine's hot paths: `SET`, `ADD`, `GET`, a `WAIT`
//! that is ready at once, and a `WAIT` that registers and is woken by a `SET`.
//!
//! `cargo bench --bench engine`; `cargo test` only builds this file.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use rdzv_core::store::engine::Engine;
use rdzv_core::store::{ConnId, KeyList, Request, VALIDATION_MAGIC};

const KEY: &[u8] = b"/torch.distributed/rank_17/counter";

fn one_key_list(key: &[u8]) -> Vec<u8> {
    let mut list = (key.len() as u64).to_le_bytes().to_vec();
    list.extend_from_slice(key);
    list
}

/// An engine with `n` validated connections, `ConnId(0..n)`.
fn engine_with(n: u64) -> Engine {
    let mut engine = Engine::new();
    for id in 0..n {
        let conn = ConnId(id);
        assert!(engine.connect(conn));
        engine
            .handle_request(
                conn,
                Request::Validate {
                    magic: VALIDATION_MAGIC,
                },
            )
            .expect("VALIDATE with the magic is accepted");
    }
    engine
}

fn hot_paths(c: &mut Criterion) {
    let mut group = c.benchmark_group("engine");
    let value = vec![0x42u8; 64];

    let mut engine = engine_with(1);
    group.bench_function("set_overwrite_64B", |b| {
        b.iter(|| {
            let outcome = engine.handle_request(
                ConnId(0),
                Request::Set {
                    key: KEY,
                    value: black_box(&value),
                },
            );
            black_box(outcome.is_ok())
        })
    });

    let mut engine = engine_with(1);
    group.bench_function("add", |b| {
        b.iter(|| {
            let outcome = engine.handle_request(
                ConnId(0),
                Request::Add {
                    key: KEY,
                    delta: black_box(1),
                },
            );
            black_box(outcome.is_ok())
        })
    });

    let mut engine = engine_with(1);
    engine
        .handle_request(
            ConnId(0),
            Request::Set {
                key: KEY,
                value: &value,
            },
        )
        .expect("SET is accepted");
    group.bench_function("get_64B", |b| {
        b.iter(|| {
            let outcome = engine.handle_request(
                ConnId(0),
                Request::Get {
                    key: black_box(KEY),
                },
            );
            black_box(outcome.is_ok())
        })
    });

    let list = one_key_list(KEY);
    let keys = KeyList::new(1, &list).expect("one well-formed key");
    let mut engine = engine_with(1);
    engine
        .handle_request(
            ConnId(0),
            Request::Set {
                key: KEY,
                value: &value,
            },
        )
        .expect("SET is accepted");
    group.bench_function("wait_ready", |b| {
        b.iter(|| {
            let outcome = engine.handle_request(
                ConnId(0),
                Request::Wait {
                    keys: black_box(keys),
                },
            );
            black_box(outcome.is_ok())
        })
    });

    // Connection 0 waits on a missing key, connection 1 sets it (waking 0), and the key
    // is deleted again so the next iteration waits too.
    let mut engine = engine_with(2);
    group.bench_function("wait_then_set_wakes", |b| {
        b.iter(|| {
            let waited = engine
                .handle_request(ConnId(0), Request::Wait { keys })
                .is_ok();
            let set = engine
                .handle_request(
                    ConnId(1),
                    Request::Set {
                        key: KEY,
                        value: &value,
                    },
                )
                .is_ok();
            let mut woken = 0;
            while engine.poll_wakeup().is_some() {
                woken += 1;
            }
            let deleted = engine
                .handle_request(ConnId(1), Request::DeleteKey { key: KEY })
                .is_ok();
            black_box((waited, set, woken, deleted))
        })
    });
    group.finish();
}

criterion_group!(benches, hot_paths);
criterion_main!(benches);
