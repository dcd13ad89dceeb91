//! Criterion benchmarks of the TCPStore wire codec: encoding and decoding the requests
//! and replies of the hot path (`ADD`, `GET`, `SET`, `WAIT`), in bytes per second.
//!
//! `cargo bench --bench codec`; `cargo test` only builds this file.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rdzv_core::store::codec::{decode_request, decode_response_view, Limits, PendingReply};
use rdzv_core::store::{KeyList, QueryType, Request, Response};

const KEY: &[u8] = b"/torch.distributed/rank_17/counter";

fn one_key_list(key: &[u8]) -> Vec<u8> {
    let mut list = (key.len() as u64).to_le_bytes().to_vec();
    list.extend_from_slice(key);
    list
}

fn requests(c: &mut Criterion) {
    let small = vec![0x42u8; 64];
    let large = vec![0x42u8; 64 * 1024];
    let wait_keys = one_key_list(KEY);
    let wait = KeyList::new(1, &wait_keys).expect("one well-formed key");
    let cases: [(&str, Request<'_>); 5] = [
        ("add", Request::Add { key: KEY, delta: 1 }),
        ("get", Request::Get { key: KEY }),
        (
            "set_64B",
            Request::Set {
                key: KEY,
                value: &small,
            },
        ),
        (
            "set_64KiB",
            Request::Set {
                key: KEY,
                value: &large,
            },
        ),
        ("wait_1_key", Request::Wait { keys: wait }),
    ];
    let limits = Limits::default();

    let mut group = c.benchmark_group("request_encode");
    for (name, request) in &cases {
        let mut out = vec![0u8; request.encoded_len()];
        group.throughput(Throughput::Bytes(out.len() as u64));
        group.bench_function(*name, |b| {
            b.iter(|| black_box(request).encode(black_box(&mut out)))
        });
    }
    group.finish();

    let mut group = c.benchmark_group("request_decode");
    for (name, request) in &cases {
        let mut frame = Vec::new();
        request.encode_into(&mut frame);
        group.throughput(Throughput::Bytes(frame.len() as u64));
        group.bench_function(*name, |b| {
            b.iter(|| decode_request(black_box(&frame), &limits))
        });
    }
    group.finish();
}

fn responses(c: &mut Criterion) {
    let limits = Limits::default();
    let value_64 = vec![b'7'; 64];
    let value_64k = vec![b'7'; 64 * 1024];
    let cases: [(&str, QueryType, Response<'_>); 4] = [
        ("add_int", QueryType::Add, Response::Int(4096)),
        ("get_64B", QueryType::Get, Response::Value(&value_64)),
        ("get_64KiB", QueryType::Get, Response::Value(&value_64k)),
        (
            "wait_stop",
            QueryType::Wait,
            Response::Wait(rdzv_core::store::WaitResponse::StopWaiting),
        ),
    ];

    let mut group = c.benchmark_group("response_encode");
    for (name, _, response) in &cases {
        let mut out = vec![0u8; response.encoded_len()];
        group.throughput(Throughput::Bytes(out.len() as u64));
        group.bench_function(*name, |b| {
            b.iter(|| black_box(response).encode(black_box(&mut out)))
        });
    }
    group.finish();

    let mut group = c.benchmark_group("response_decode");
    for (name, query, response) in &cases {
        let mut frame = Vec::new();
        response
            .encode_into(&mut frame)
            .expect("these responses encode");
        let pending = PendingReply::new(*query, 0).expect("these queries have replies");
        group.throughput(Throughput::Bytes(frame.len() as u64));
        group.bench_function(*name, |b| {
            b.iter(|| decode_response_view(pending, black_box(&frame), &limits))
        });
    }
    group.finish();
}

criterion_group!(benches, requests, responses);
criterion_main!(benches);
