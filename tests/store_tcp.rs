//! PyTorch's `test/distributed/test_store.py` cases for TCPStore and PrefixStore(TCPStore),
//! ported to Rust, against rdzv's server over real loopback sockets. Each test starts its
//! own server on port 0, so they run in parallel.

mod store_base;
#[macro_use]
mod store_io;

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdzv::core::store::QueryType;
use rdzv::uring::server::IdleSpin;
use rdzv::uring::store::tcp::{TcpStore, TcpStoreOptions};
use rdzv::uring::store::PrefixStore;
use rdzv::uring::{IoMode, ServerOptions, Store, StoreServer};

fn server(io: IoMode) -> StoreServer {
    let server = StoreServer::start(ServerOptions {
        host: Some("127.0.0.1".into()),
        port: 0,
        io,
        ..ServerOptions::default()
    })
    .expect("start server");
    assert_eq!(server.io_mode(), io);
    server
}

fn client(server: &StoreServer) -> TcpStore {
    TcpStore::connect("127.0.0.1", server.port(), Duration::from_secs(10)).expect("connect")
}

/// StoreTestBase's cases (shared with the file and hash stores); `num_keys_total` is 5
/// here (no `init/` key: these clients do not count workers).
fn all_base_tests(store: &dyn Store, num_keys_total: i64) {
    store_base::set_get_check(store, num_keys_total);
    store_base::compare_set(store);
    store_base::simple_wait(store);
    store_base::append(store);
    store_base::multi_set_get(store);
    store_base::queues(store);
    store_base::queues_nonblocking(store);
}

fn tcp_store_base_tests(io: IoMode) {
    let server = server(io);
    let store = client(&server);
    all_base_tests(&store, 5);
}

fn prefix_tcp_store_base_tests(io: IoMode) {
    let server = server(io);
    let store: Arc<dyn Store> = Arc::new(client(&server));
    let prefixed = PrefixStore::new("test_prefix", Arc::clone(&store));
    all_base_tests(&prefixed, 5);
    // The keys really live under the prefix on the server.
    assert_eq!(store.get("test_prefix/key").unwrap(), b"6");
    let listed = prefixed.list_keys().unwrap();
    assert!(listed.contains(&"key3".to_string()), "{listed:?}");
}

fn queue_pop_times_out(io: IoMode) {
    let server = server(io);
    let store = client(&server);
    store.set_timeout(Duration::from_millis(10));
    let err = store.queue_pop("non_existant", true).unwrap_err();
    assert!(err.to_string().contains("timeout"), "{err}");
}

fn clone_shares_the_store(io: IoMode) {
    let server = server(io);
    let a = client(&server);
    let b = a.clone_store().unwrap();
    a.set("foo", b"bar").unwrap();
    assert_eq!(b.get("foo").unwrap(), b"bar");
}

fn numkeys_delkeys(io: IoMode) {
    let server = server(io);
    let store = client(&server);
    assert_eq!(store.num_keys().unwrap(), 0);
    store.add("key", 1).unwrap();
    store.set("key0", b"value0").unwrap();
    store.add("key1", 1).unwrap();
    store.set("key2", b"value2").unwrap();
    store.add("key3", 1).unwrap();
    assert_eq!(store.num_keys().unwrap(), 5);
    assert!(store.delete_key("key").unwrap());
    assert_eq!(store.num_keys().unwrap(), 4);
    store.set_timeout(Duration::from_secs(2));
    assert!(store.get("key").is_err());
    assert!(store.delete_key("key0").unwrap());
    assert!(store.delete_key("key3").unwrap());
    assert!(!store.delete_key("key3").unwrap());
    assert_eq!(store.num_keys().unwrap(), 2);
    store.set("key4", b"value4").unwrap();
    assert_eq!(store.num_keys().unwrap(), 3);
    assert_eq!(store.get("key1").unwrap(), b"1");
    assert_eq!(store.get("key2").unwrap(), b"value2");
    assert_eq!(store.get("key4").unwrap(), b"value4");
}

fn timeout_does_not_break_client(io: IoMode) {
    let server = server(io);
    let store = client(&server);
    store.set_timeout(Duration::from_millis(100));
    let started = Instant::now();
    let err = store.get("nonexistent key").unwrap_err();
    assert_eq!(
        err.to_string(),
        "wait timeout after 100ms, keys: /nonexistent key"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    // The connection is still good.
    store.set("the_key", b"v").unwrap();
    assert_eq!(store.get("the_key").unwrap(), b"v");
}

fn multi_worker_with_fixed_world_size(io: IoMode) {
    let server = server(io);
    let port = server.port();
    let setter = client(&server);
    setter.set("key", b"value").unwrap();
    let workers: Vec<_> = (0..5)
        .map(|i| {
            std::thread::spawn(move || {
                let store = TcpStore::connect("127.0.0.1", port, Duration::from_secs(10)).unwrap();
                assert_eq!(store.get("key").unwrap(), b"value");
                store
                    .set(&format!("key{i}"), format!("{i}").as_bytes())
                    .unwrap();
                assert_eq!(
                    store
                        .compare_set(&format!("key{i}"), format!("{i}").as_bytes(), b"x")
                        .unwrap(),
                    b"x"
                );
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    assert_eq!(setter.num_keys().unwrap(), 6);
}

fn wait_is_released_by_another_thread(io: IoMode) {
    let server = server(io);
    let port = server.port();
    let waiter = std::thread::spawn(move || {
        let store = TcpStore::connect("127.0.0.1", port, Duration::from_secs(10)).unwrap();
        store.wait(&["key1"], Some(Duration::from_secs(5))).unwrap();
        store.get("key1").unwrap()
    });
    std::thread::sleep(Duration::from_millis(50));
    client(&server).set("key1", b"value1").unwrap();
    assert_eq!(waiter.join().unwrap(), b"value1");
}

fn list_keys_and_native_barrier(io: IoMode) {
    let server = server(io);
    let store = client(&server);
    store.set("a", b"1").unwrap();
    store.set("b", b"2").unwrap();
    let mut keys = store.list_keys().unwrap();
    keys.sort();
    assert_eq!(keys, ["a", "b"]);
    let port = server.port();
    let ranks: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(move || {
                let s = TcpStore::connect("127.0.0.1", port, Duration::from_secs(10)).unwrap();
                s.barrier("bar", 4, Some(Duration::from_secs(10))).unwrap();
            })
        })
        .collect();
    for r in ranks {
        r.join().unwrap();
    }
    // A barrier that nobody else joins times out with PyTorch's message and leaves the
    // connection usable.
    let err = store
        .barrier("lonely", 2, Some(Duration::from_millis(100)))
        .unwrap_err();
    assert_eq!(err.to_string(), "barrier timeout after 100ms, key: lonely");
    assert_eq!(store.get("a").unwrap(), b"1");
}

fn address_already_in_use(io: IoMode) {
    let first = server(io);
    let err = StoreServer::start(ServerOptions {
        host: Some("127.0.0.1".into()),
        port: first.port(),
        io,
        ..ServerOptions::default()
    })
    .unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with("The server socket has failed to listen on any local network address"),
        "{text}"
    );
    assert!(text.contains(&first.port().to_string()), "{text}");
}

#[test]
fn multitenancy_shares_one_server() {
    let first = server(IoMode::IoUring);
    let port = first.port();
    drop(first);
    // Two masters asking for the same port in one process share one server.
    let mut options = TcpStoreOptions::client("127.0.0.1", 0);
    options.is_master = true;
    options.multi_tenant = true;
    options.timeout = Duration::from_secs(10);
    let a = TcpStore::new(options.clone()).unwrap();
    let port_a = a.port();
    assert_ne!(port_a, 0);
    options.port = port_a;
    let b = TcpStore::new(options).unwrap();
    assert_eq!(b.port(), port_a);
    a.set("shared", b"yes").unwrap();
    assert_eq!(b.get("shared").unwrap(), b"yes");
    let _ = port;
}

#[test]
fn world_size_zero_is_rejected() {
    let mut options = TcpStoreOptions::client("127.0.0.1", 1);
    options.world_size = Some(0);
    let err = TcpStore::new(options).unwrap_err();
    assert_eq!(err.to_string(), "TCPStore world size cannot be 0");
}

#[test]
fn master_times_out_on_missing_clients() {
    let mut options = TcpStoreOptions::client("127.0.0.1", 0);
    options.is_master = true;
    options.world_size = Some(2);
    options.wait_for_workers = true;
    options.timeout = Duration::from_secs(1);
    let err = TcpStore::new(options).unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with("Timed out after 1 seconds waiting for clients. 1/2 clients joined."),
        "{text}"
    );
}

#[test]
fn connect_to_nothing_times_out_with_pytorchs_message() {
    // Bind then drop to find a port with no listener.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let started = Instant::now();
    let err = TcpStore::connect("127.0.0.1", port, Duration::from_millis(300)).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        err.to_string().starts_with(
            "The client socket has timed out after 300ms while trying to connect to (127.0.0.1,"
        ),
        "{err}"
    );
}

fn server_with_threads(io: IoMode, threads: usize) -> StoreServer {
    StoreServer::start(ServerOptions {
        host: Some("127.0.0.1".into()),
        port: 0,
        threads,
        io,
        ..ServerOptions::default()
    })
    .expect("start server")
}

fn base_tests_with_three_executors(io: IoMode) {
    let server = server_with_threads(io, 3);
    // Several connections, so that SO_REUSEPORT spreads them over the executors.
    for _ in 0..6 {
        let store = client(&server);
        store.set("spread", b"x").unwrap();
    }
    let store = client(&server);
    let prefixed = PrefixStore::new("three", Arc::new(client(&server)) as Arc<dyn Store>);
    all_base_tests(&prefixed, 6);
    assert_eq!(store.get("three/key3").unwrap(), b"21");
}

fn waits_and_barriers_cross_executors(io: IoMode) {
    let server = server_with_threads(io, 2);
    let port = server.port();
    let ranks = 16;
    let handles: Vec<_> = (0..ranks)
        .map(|rank| {
            std::thread::spawn(move || {
                let s = TcpStore::connect("127.0.0.1", port, Duration::from_secs(10)).unwrap();
                s.set(&format!("rank/{rank}"), format!("{rank}").as_bytes())
                    .unwrap();
                let keys: Vec<String> = (0..ranks).map(|r| format!("rank/{r}")).collect();
                let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                let all = s.multi_get(&refs).unwrap();
                assert_eq!(all.len(), ranks);
                s.barrier("done", ranks as i64, Some(Duration::from_secs(10)))
                    .unwrap();
                s.add("counter", 1).unwrap()
            })
        })
        .collect();
    let mut counts: Vec<i64> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    counts.sort();
    assert_eq!(counts, (1..=ranks as i64).collect::<Vec<_>>());
    assert_eq!(server.stats().waiters, 0);
}

/// Wake-ups that cross loops: 16 connections WAIT on their own keys, and one more SETs
/// them all. On two loops SO_REUSEPORT spreads the 17 connections by their ports, so
/// some waiters (all but a 2^-16 chance) live on the loop the setter does not: their
/// wake-ups go through that loop's inbox and wake it (its eventfd on io_uring, its
/// `mio::Waker` on epoll). `STATS` and the server's counters see every loop's
/// connections and waiters.
fn waits_released_from_another_loop(io: IoMode) {
    let server = server_with_threads(io, 2);
    let port = server.port();
    let waiters = 16;
    let handles: Vec<_> = (0..waiters)
        .map(|i| {
            std::thread::spawn(move || {
                let s = TcpStore::connect("127.0.0.1", port, Duration::from_secs(10)).unwrap();
                s.wait(&[&format!("cross/{i}")], Some(Duration::from_secs(10)))
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.stats().waiters < waiters {
        assert!(
            Instant::now() < deadline,
            "the waiters never registered: {:?}",
            server.stats()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let setter = client(&server);
    let stats = setter.stats().expect("stats");
    assert_eq!(stats.connections, waiters as u64 + 1, "{stats:?}");
    assert_eq!(stats.waiters, waiters as u64, "{stats:?}");
    for i in 0..waiters {
        setter.set(&format!("cross/{i}"), b"1").unwrap();
    }
    for handle in handles {
        handle.join().unwrap().expect("released by the SET");
    }
    assert_eq!(server.stats().waiters, 0);
    assert_eq!(setter.num_keys().unwrap(), waiters as i64);
}

/// Two loops that poll before they sleep (`--spin-us 50`): they serve, release waits
/// across loops, and shut down with clients still connected, counting none left.
fn spinning_loops_serve_and_shut_down(io: IoMode) {
    let server = StoreServer::start(ServerOptions {
        host: Some("127.0.0.1".into()),
        port: 0,
        threads: 2,
        spin_before_park: IdleSpin::For(Duration::from_micros(50)),
        io,
        ..ServerOptions::default()
    })
    .expect("start server");
    let stores: Vec<TcpStore> = (0..4).map(|_| client(&server)).collect();
    all_base_tests(&stores[0], 5);
    let port = server.port();
    let waiter = std::thread::spawn(move || {
        let s = TcpStore::connect("127.0.0.1", port, Duration::from_secs(10)).unwrap();
        s.wait(&["spin/late"], Some(Duration::from_secs(10)))
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.stats().waiters == 0 {
        assert!(Instant::now() < deadline, "the WAIT never registered");
        std::thread::sleep(Duration::from_millis(5));
    }
    for store in &stores {
        assert!(store.add("spin/count", 1).unwrap() > 0);
    }
    stores[3].set("spin/late", b"1").unwrap();
    waiter.join().unwrap().expect("released");
    assert_eq!(stores[1].add("spin/count", 0).unwrap(), 4);
    let shutting = Instant::now();
    server.shutdown();
    assert!(shutting.elapsed() < Duration::from_secs(7));
    assert_eq!(server.stats().connections, 0, "{:?}", server.stats());
}

/// Many connections waking each other: 64 ranks meet at a barrier
/// twice, every rank counts itself, and nothing is left waiting.
fn sixty_four_ranks_wake_each_other(io: IoMode) {
    let server = server(io);
    let port = server.port();
    let ranks = 64;
    let handles: Vec<_> = (0..ranks)
        .map(|_| {
            std::thread::spawn(move || {
                let s = TcpStore::connect("127.0.0.1", port, Duration::from_secs(20)).unwrap();
                s.barrier("first", ranks, Some(Duration::from_secs(20)))
                    .unwrap();
                let n = s.add("counter", 1).unwrap();
                s.barrier("second", ranks, Some(Duration::from_secs(20)))
                    .unwrap();
                n
            })
        })
        .collect();
    let mut counts: Vec<i64> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    counts.sort();
    assert_eq!(counts, (1..=ranks).collect::<Vec<_>>());
    assert_eq!(server.stats().waiters, 0);
}

/// Shutdown with clients connected and one waiting: it returns, and the clients see
/// their connections closed rather than hanging.
fn shutdown_with_connected_and_waiting_clients_returns(io: IoMode) {
    let server = server(io);
    let port = server.port();
    let idle = client(&server);
    idle.set("k", b"v").unwrap();
    let waiter = std::thread::spawn(move || {
        let s = TcpStore::connect("127.0.0.1", port, Duration::from_secs(10)).unwrap();
        s.wait(&["never"], Some(Duration::from_secs(10)))
    });
    let started = Instant::now();
    while server.stats().waiters == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the wait never arrived"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let shutting = Instant::now();
    server.shutdown();
    assert!(
        shutting.elapsed() < Duration::from_secs(7),
        "{:?}",
        shutting.elapsed()
    );
    assert!(
        waiter.join().unwrap().is_err(),
        "the waiter must see the close"
    );
    assert!(idle.get("k").is_err());
}

/// rdzv's STATS query over real sockets: the figures follow what clients did, on every
/// event loop (they share the engine's counters and the session's byte counting).
fn stats_reports_connections_keys_waiters_and_requests(io: IoMode) {
    let server = server(io);
    let a = client(&server);
    let b = client(&server);
    a.set("one", b"1").unwrap();
    a.set("two", b"2").unwrap();
    assert_eq!(a.get("one").unwrap(), b"1");
    a.queue_push("q", b"x").unwrap();
    let waiter = std::thread::spawn(move || b.wait(&["released"], Some(Duration::from_secs(10))));
    // The waiter is registered once the server counts it.
    let deadline = Instant::now() + Duration::from_secs(10);
    let stats = loop {
        let stats = a.stats().expect("stats");
        if stats.waiters == 1 || Instant::now() > deadline {
            break stats;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(stats.waiters, 1, "{stats:?}");
    assert!(stats.connections >= 2, "{stats:?}");
    // TcpStore keys carry PyTorch's prefix; the queue is not a key.
    assert!(stats.keys >= 2, "{stats:?}");
    assert_eq!(stats.queues, 1, "{stats:?}");
    assert!(stats.requests_of(QueryType::Set) >= 2, "{stats:?}");
    assert!(stats.requests_of(QueryType::Get) >= 1, "{stats:?}");
    assert!(stats.requests_of(QueryType::Validate) >= 2, "{stats:?}");
    assert!(stats.requests_of(QueryType::Stats) >= 1, "{stats:?}");
    assert!(stats.bytes_in > 0 && stats.bytes_out > 0, "{stats:?}");
    a.set("released", b"go").unwrap();
    waiter.join().unwrap().expect("the waiter is released");
    std::thread::sleep(Duration::from_millis(20));
    let later = a.stats().expect("stats");
    assert_eq!(later.waiters, 0, "{later:?}");
    assert!(later.bytes_in > stats.bytes_in, "{later:?}");
    assert!(later.requests_of(QueryType::Stats) > stats.requests_of(QueryType::Stats));
    assert!(later.uptime_ms >= stats.uptime_ms);
}

/// A server that closes the connection on an unknown query (what PyTorch's TCPStore
/// does) makes `stats()` fail at once with an error that says so, not hang.
#[test]
fn stats_against_a_server_that_refuses_it_says_so() {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let refuser = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        // Answers what the client's connect sends (VALIDATE, PING), then does what
        // PyTorch's TCPStore does with an unknown type byte: closes the connection.
        loop {
            let mut query = [0u8; 1];
            conn.read_exact(&mut query).unwrap();
            let mut word = [0u8; 4];
            match QueryType::from_u8(query[0]) {
                Some(QueryType::Validate) => conn.read_exact(&mut word).unwrap(),
                Some(QueryType::Ping) => {
                    conn.read_exact(&mut word).unwrap();
                    conn.write_all(&word).unwrap();
                }
                other => {
                    assert_eq!(other, Some(QueryType::Stats));
                    break;
                }
            }
        }
        drop(conn);
    });
    let store = TcpStore::connect("127.0.0.1", port, Duration::from_secs(10)).expect("connect");
    let started = Instant::now();
    let error = store
        .stats()
        .expect_err("the refusing server cannot answer STATS");
    refuser.join().unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "it must not hang"
    );
    let text = error.to_string();
    assert!(
        text.contains("does not answer rdzv's STATS query")
            && text.contains("is it PyTorch's TCPStore?")
            && text.contains(&port.to_string()),
        "{text}"
    );
}

/// `ServerOptions::metrics` serves `GET /metrics` over HTTP/1.1; every event loop
/// records request durations and publishes its figures there.
fn metrics_are_served_over_http(io: IoMode) {
    use std::io::{Read, Write};
    let server = StoreServer::start(ServerOptions {
        host: Some("127.0.0.1".into()),
        port: 0,
        io,
        metrics: Some("127.0.0.1:0".parse().unwrap()),
        ..ServerOptions::default()
    })
    .expect("start server");
    let metrics = server.metrics_addr().expect("metrics are served");
    let store = client(&server);
    for i in 0..3 {
        store.set(&format!("k{i}"), b"v").unwrap();
    }
    // SET has no reply; this round trip makes sure all three were served.
    assert_eq!(store.get("k2").unwrap(), b"v");
    let mut http = std::net::TcpStream::connect(metrics).expect("connect to metrics");
    http.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut response = String::new();
    http.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    assert!(
        // Header names are case-insensitive; hyper writes them in lower case.
        response
            .to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{response}"
    );
    let sample = |series: &str| {
        response
            .lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {series} in\n{response}"))
            .to_string()
    };
    assert_eq!(sample("rdzv_store_keys"), "3");
    assert_eq!(sample("rdzv_store_connections"), "1");
    assert_eq!(sample("rdzv_store_requests_total{query=\"SET\"}"), "3");
    assert_eq!(
        sample("rdzv_store_request_duration_seconds_count{query=\"SET\"}"),
        "3"
    );
    server.shutdown();
}

/// With three loops `STATS` sees every connection's requests, whichever loop accepted
/// it.
fn stats_on_three_executors(io: IoMode) {
    let server = server_with_threads(io, 3);
    let clients: Vec<TcpStore> = (0..4).map(|_| client(&server)).collect();
    for (i, store) in clients.iter().enumerate() {
        store.set(&format!("k{i}"), b"v").unwrap();
        // SET has no reply: a round trip on the same connection makes sure it was
        // served before another connection asks.
        assert_eq!(store.get(&format!("k{i}")).unwrap(), b"v");
    }
    let stats = clients[0].stats().expect("stats");
    assert_eq!(stats.requests_of(QueryType::Set), 4, "{stats:?}");
    assert_eq!(stats.keys, 4, "{stats:?}");
    assert_eq!(stats.connections, 4, "{stats:?}");
}

on_every_io!(
    stats_on_three_executors,
    metrics_are_served_over_http,
    stats_reports_connections_keys_waiters_and_requests,
    tcp_store_base_tests,
    prefix_tcp_store_base_tests,
    queue_pop_times_out,
    clone_shares_the_store,
    numkeys_delkeys,
    timeout_does_not_break_client,
    multi_worker_with_fixed_world_size,
    wait_is_released_by_another_thread,
    list_keys_and_native_barrier,
    address_already_in_use,
    base_tests_with_three_executors,
    waits_and_barriers_cross_executors,
    sixty_four_ranks_wake_each_other,
    waits_released_from_another_loop,
    spinning_loops_serve_and_shut_down,
    shutdown_with_connected_and_waiting_clients_returns,
);
