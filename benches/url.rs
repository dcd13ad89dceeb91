//! Criterion benchmarks of rendezvous URL parsing (`RendezvousUrl::parse`, Python's
//! `urlparse` rules) on the URLs jobs actually pass.
//!
//! `cargo bench --bench url`; `cargo test` only builds this file.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rdzv_core::url::RendezvousUrl;

fn parse(c: &mut Criterion) {
    let cases = [
        ("tcp_ipv4", "tcp://10.0.0.1:29500?rank=17&world_size=4096"),
        (
            "tcp_ipv6",
            "tcp://[fe80::1%eth0]:29500?world_size=4096&use_libuv=1",
        ),
        ("env", "env://"),
        ("file", "file:///scratch/job-1234/rdzv-store?world_size=8"),
    ];
    let mut group = c.benchmark_group("url_parse");
    for (name, url) in cases {
        assert!(RendezvousUrl::parse(url).is_ok(), "{url} should parse");
        group.throughput(Throughput::Bytes(url.len() as u64));
        group.bench_function(name, |b| {
            b.iter(|| RendezvousUrl::parse(black_box(url)).is_ok())
        });
    }
    group.finish();
}

criterion_group!(benches, parse);
criterion_main!(benches);
