//! The store battery (`store_base`, what the TCP store passes) against `EtcdStore`, and
//! what only a cluster can do: a member restarted, a dead first endpoint, the whole
//! cluster stopped.
//!
//! A cluster comes from `RDZV_ETCD_ENDPOINTS` (`host:port,…`, as `.ci/run` exports for its
//! three-member cluster), or else the battery starts one `etcd` member for this test
//! binary (if `etcd` is on `PATH`). Each battery test works under its own prefix. The
//! fault tests always start their own members on free loopback ports, each with its own
//! data directory (`etcd_cluster`, shared with `rendezvous_etcd.rs`). Without a cluster and without the binary, each test prints SKIPPED and why.

mod etcd_cluster;
mod store_base;

use std::process::Command;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use etcd_cluster::{fastrand_u64, free_port, leader, shared_endpoints, Cluster};
use rdzv::uring::store::etcd::{EtcdConfig, EtcdStore, DEFAULT_MAX_REQUEST_BYTES};
use rdzv::uring::{Store, StoreError};

/// A store on the shared cluster under a prefix of its own, or `None` after printing
/// why the test is skipped.
fn store(test: &str) -> Option<EtcdStore> {
    match shared_endpoints() {
        Ok(endpoints) => {
            let prefix = format!(
                "rdzv-test/{test}/{}-{:x}",
                std::process::id(),
                fastrand_u64()
            );
            let mut config = EtcdConfig::new(endpoints, &prefix);
            config.timeout = Duration::from_secs(20);
            config.request_timeout = Duration::from_secs(10);
            Some(EtcdStore::new(config))
        }
        Err(why) => {
            eprintln!("SKIPPED {test}: {why}");
            None
        }
    }
}

macro_rules! battery {
    ($($name:ident => $body:expr;)*) => {$(
        #[test]
        fn $name() {
            let Some(store) = store(stringify!($name)) else { return };
            #[allow(clippy::redundant_closure_call)]
            ($body)(store);
        }
    )*};
}

battery! {
    set_get_check => |s: EtcdStore| store_base::set_get_check(&s, 5);
    compare_set => |s: EtcdStore| store_base::compare_set(&s);
    simple_wait => |s: EtcdStore| store_base::simple_wait(&s);
    append => |s: EtcdStore| store_base::append(&s);
    multi_set_get => |s: EtcdStore| store_base::multi_set_get(&s);
    clone_shares_the_data => |s: EtcdStore| store_base::clone_shares(&s);
    queues => |s: EtcdStore| store_base::queues(&s);
    queues_nonblocking => |s: EtcdStore| store_base::queues_nonblocking(&s);
    queues_bidirectional => |s: EtcdStore| store_base::queues_bidirectional(&s);
    barrier_fallback => |s: EtcdStore| store_base::barrier(&s, 4);
    queues_timeout => |s: EtcdStore| {
        let started = Instant::now();
        store_base::queues_timeout(&s);
        assert!(started.elapsed() < Duration::from_secs(5));
    };
    multi_threaded_wait => |s: EtcdStore| {
        let other: Arc<dyn Store> = Arc::from(s.clone_store().unwrap());
        store_base::multi_threaded_wait(Arc::new(s), other);
    };
    delete_and_list_keys => |s: EtcdStore| {
        s.set("a", b"1").unwrap();
        s.set("b", b"2").unwrap();
        s.queue_push("b", b"queued").unwrap();
        assert!(s.delete_key("a").unwrap());
        assert!(!s.delete_key("a").unwrap());
        // Queue elements are not keys.
        assert_eq!(s.num_keys().unwrap(), 1);
        assert_eq!(s.list_keys().unwrap(), vec!["b".to_string()]);
    };
    add_on_text_is_an_error_and_the_store_stays_usable => |s: EtcdStore| {
        s.set("text", b"abc").unwrap();
        let err = s.add("text", 1).unwrap_err();
        assert!(matches!(err, StoreError::NotACounter { .. }), "{err:?}");
        assert_eq!(s.add("n", 2).unwrap(), 2);
        assert_eq!(s.get("text").unwrap(), b"abc");
    };
    get_times_out_on_a_missing_key => |s: EtcdStore| {
        s.set_timeout(Duration::from_millis(200));
        let started = Instant::now();
        let err = s.get("nothing").unwrap_err();
        assert!(matches!(err, StoreError::Timeout { ms: 200, .. }), "{err:?}");
        assert!(started.elapsed() < Duration::from_secs(3));
    };
    get_waits_for_a_later_set => |s: EtcdStore| {
        let setter = s.clone_store().unwrap();
        let handle = thread::spawn(move || {
            thread::sleep(Duration::from_millis(100));
            setter.set("late", b"here").unwrap();
        });
        assert_eq!(s.get("late").unwrap(), b"here");
        handle.join().unwrap();
    };
    concurrent_adds_count_every_arrival => |s: EtcdStore| {
        let threads: Vec<_> = (0..4).map(|_| {
            let clone = s.clone_store().unwrap();
            thread::spawn(move || (0..10).map(|_| clone.add("c", 1).unwrap()).collect::<Vec<_>>())
        }).collect();
        let mut all: Vec<i64> = threads.into_iter().flat_map(|t| t.join().unwrap()).collect();
        all.sort_unstable();
        assert_eq!(all, (1..=40).collect::<Vec<_>>());
        assert_eq!(s.get("c").unwrap(), b"40");
    };
    values_up_to_etcds_request_limit => |s: EtcdStore| {
        // The largest value the store accepts for this key is one etcd accepts too.
        let mut len = DEFAULT_MAX_REQUEST_BYTES;
        let err = s.set("big", &vec![7u8; len]).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("1572864") && text.contains("--max-request-bytes"), "{text}");
        while s.set("big", &vec![7u8; len]).is_err() {
            len -= 64;
        }
        assert!(len > 1_500_000, "only {len} bytes fit");
        assert_eq!(s.get("big").unwrap().len(), len);
    };
    adds_after_another_handle_wrote_see_its_value => |s: EtcdStore| {
        // A handle's remembered counter is only a guess: another handle's writes win.
        let other = s.clone_store().unwrap();
        assert_eq!(s.add("c", 1).unwrap(), 1);
        other.set("c", b"100").unwrap();
        assert_eq!(s.add("c", 1).unwrap(), 101);
        other.set("c", b"text").unwrap();
        let err = s.add("c", 1).unwrap_err();
        assert!(matches!(err, StoreError::NotACounter { .. }), "{err:?}");
        assert!(other.delete_key("c").unwrap());
        assert_eq!(s.add("c", 5).unwrap(), 5);
        s.append("a", b"x").unwrap();
        other.set("a", b"y").unwrap();
        s.append("a", b"z").unwrap();
        assert_eq!(other.get("a").unwrap(), b"yz");
    };
    waits_racing_sets_lose_none => |s: EtcdStore| {
        // A set landing between a wait's check and its watch must still release it: the
        // watch starts at the revision after the check.
        let setter = s.clone_store().unwrap();
        let handle = thread::spawn(move || {
            for i in 0..30 {
                setter.set(&format!("race{i}"), b"1").unwrap();
            }
        });
        for i in 0..30 {
            s.wait(&[&format!("race{i}")], Some(Duration::from_secs(5))).unwrap();
        }
        handle.join().unwrap();
    };
    prefixes_keep_stores_apart => |s: EtcdStore| {
        let other = store("prefixes_keep_stores_apart_other").unwrap();
        s.set("k", b"mine").unwrap();
        assert!(!other.check(&["k"]).unwrap());
        assert_eq!(other.num_keys().unwrap(), 0);
    };
}

#[test]
fn failover_when_the_first_endpoint_is_down() {
    let endpoints = match shared_endpoints() {
        Ok(e) => e,
        Err(why) => return eprintln!("SKIPPED failover_when_the_first_endpoint_is_down: {why}"),
    };
    // A port nothing listens on, first.
    let dead = format!("127.0.0.1:{}", free_port());
    let mut all = vec![dead.clone()];
    all.extend(endpoints);
    let mut config = EtcdConfig::new(all, &format!("rdzv-test/failover/{:x}", fastrand_u64()));
    config.request_timeout = Duration::from_secs(5);
    let store = EtcdStore::new(config);
    let started = Instant::now();
    store.set("k", b"v").unwrap();
    assert_eq!(store.get("k").unwrap(), b"v");
    assert_eq!(store.add("n", 3).unwrap(), 3);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn member_restarted_clients_carry_on() {
    let Some(mut cluster) = Cluster::start(3) else {
        return eprintln!("SKIPPED member_restarted_clients_carry_on: no etcd binary on PATH");
    };
    let mut config = EtcdConfig::new(cluster.endpoints(), "restart");
    config.request_timeout = Duration::from_secs(10);
    config.timeout = Duration::from_secs(10);
    let store = EtcdStore::new(config);
    store.set("before", b"1").unwrap();
    assert_eq!(store.add("n", 1).unwrap(), 1);
    // A waiter across the failure.
    let waiter = store.clone_store().unwrap();
    let waiting = thread::spawn(move || waiter.get("after"));
    for victim in 0..3 {
        // The first endpoint is the one the client uses; then the others in turn.
        cluster.members[victim].kill();
        assert_eq!(store.get("before").unwrap(), b"1");
        assert_eq!(store.add("n", 1).unwrap(), 2 + victim as i64);
        store.set(&format!("during{victim}"), b"x").unwrap();
        cluster.restart(victim);
    }
    store.set("after", b"2").unwrap();
    assert_eq!(waiting.join().unwrap().unwrap(), b"2");
    assert_eq!(store.get("n").unwrap(), b"4");
}

#[test]
fn whole_cluster_stopped_every_op_fails_naming_etcd_within_its_timeout() {
    let Some(mut cluster) = Cluster::start(1) else {
        return eprintln!(
            "SKIPPED whole_cluster_stopped_every_op_fails_naming_etcd_within_its_timeout: no etcd binary on PATH"
        );
    };
    let limit = Duration::from_millis(800);
    let mut config = EtcdConfig::new(cluster.endpoints(), "stopped");
    config.request_timeout = limit;
    config.timeout = limit;
    let store = EtcdStore::new(config);
    store.set("k", b"v").unwrap();
    store.queue_push("q", b"1").unwrap();
    let waiter = store.clone_store().unwrap();
    let waiting = thread::spawn(move || {
        let started = Instant::now();
        (waiter.wait(&["never"], None), started.elapsed())
    });
    thread::sleep(Duration::from_millis(100));
    for member in &mut cluster.members {
        member.kill();
    }
    type Op<'a> = (
        &'a str,
        Box<dyn Fn(&EtcdStore) -> Result<(), StoreError> + 'a>,
    );
    let ops: Vec<Op> = vec![
        ("set", Box::new(|s| s.set("k", b"w"))),
        ("get", Box::new(|s| s.get("k").map(drop))),
        ("add", Box::new(|s| s.add("n", 1).map(drop))),
        (
            "compare_set",
            Box::new(|s| s.compare_set("k", b"v", b"x").map(drop)),
        ),
        ("check", Box::new(|s| s.check(&["k"]).map(drop))),
        ("wait", Box::new(|s| s.wait(&["k"], None))),
        ("delete_key", Box::new(|s| s.delete_key("k").map(drop))),
        ("num_keys", Box::new(|s| s.num_keys().map(drop))),
        ("list_keys", Box::new(|s| s.list_keys().map(drop))),
        ("append", Box::new(|s| s.append("k", b"x"))),
        ("multi_get", Box::new(|s| s.multi_get(&["k"]).map(drop))),
        ("multi_set", Box::new(|s| s.multi_set(&[("a", b"1")]))),
        ("queue_push", Box::new(|s| s.queue_push("q", b"2"))),
        ("queue_pop", Box::new(|s| s.queue_pop("q", true).map(drop))),
        ("queue_len", Box::new(|s| s.queue_len("q").map(drop))),
    ];
    for (name, op) in ops {
        let started = Instant::now();
        let err = op(&store).expect_err(name);
        let took = started.elapsed();
        let text = err.to_string();
        assert!(text.contains("etcd"), "{name}: {text}");
        assert!(
            text.contains(&cluster.members[0].endpoint()),
            "{name}: {text}"
        );
        assert!(
            took < limit + Duration::from_secs(2),
            "{name} took {took:?}"
        );
    }
    let (result, took) = waiting.join().unwrap();
    assert!(result.is_err(), "{result:?}");
    assert!(
        took < limit + Duration::from_secs(3),
        "the wait took {took:?}"
    );
}

#[test]
fn cli_runs_store_subcommands_against_etcd() {
    let endpoints = match shared_endpoints() {
        Ok(e) => e,
        Err(why) => return eprintln!("SKIPPED cli_runs_store_subcommands_against_etcd: {why}"),
    };
    let addr = format!(
        "etcd://{}/rdzv-test/cli/{:x}",
        endpoints.join(","),
        fastrand_u64()
    );
    let rdzv = |args: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_rdzv"))
            .args(["store", "--addr", &addr, "--connect-timeout", "5"])
            .args(args)
            .output()
            .expect("run rdzv");
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    assert_eq!(rdzv(&["set", "k", "v"]).0, Some(0));
    assert_eq!(rdzv(&["get", "k"]).1, "v\n");
    assert_eq!(rdzv(&["add", "n", "2"]).1, "2\n");
    assert_eq!(rdzv(&["add", "n", "3"]).1, "5\n");
    assert_eq!(rdzv(&["compare-set", "k", "v", "w"]).1, "w\n");
    assert_eq!(rdzv(&["keys"]).1, "k\nn\n");
    assert_eq!(rdzv(&["num-keys"]).1, "2\n");
    assert_eq!(rdzv(&["queue", "push", "q", "e"]).0, Some(0));
    assert_eq!(rdzv(&["queue", "pop", "q"]).1, "e\n");
    let (code, _, err) = rdzv(&["wait", "missing", "--timeout", "0.3"]);
    assert_eq!(code, Some(2), "{err}");
    let (code, _, err) = rdzv(&["stats"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("etcdctl"), "{err}");
}

#[test]
fn leader_killed_while_clients_write_they_carry_on() {
    let Some(mut cluster) = Cluster::start(3) else {
        return eprintln!(
            "SKIPPED leader_killed_while_clients_write_they_carry_on: no etcd binary on PATH"
        );
    };
    let Some(victim) = leader(&cluster) else {
        panic!("no member says it leads");
    };
    let mut config = EtcdConfig::new(cluster.endpoints(), "leader");
    config.request_timeout = Duration::from_secs(10);
    // Start on the leader, so that its death cuts the client's own connection.
    config.endpoints.rotate_left(victim);
    let store = Arc::new(EtcdStore::new(config));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (store, stop) = (Arc::clone(&store), Arc::clone(&stop));
        thread::spawn(move || {
            let (mut sets, mut adds, mut unknown) = (0, 0, 0);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                store.set(&format!("k{sets}"), b"v").unwrap();
                sets += 1;
                match store.add("n", 1) {
                    Ok(_) => adds += 1,
                    // A lost answer is reported, never resent (it could count twice).
                    Err(err) if err.to_string().contains("may or may not") => unknown += 1,
                    Err(err) => panic!("add failed: {err}"),
                }
            }
            (sets, adds, unknown)
        })
    };
    thread::sleep(Duration::from_millis(300));
    cluster.members[victim].kill();
    let killed = Instant::now();
    // Writes go on after an election among the two left.
    let before = store.add("after-kill", 1).unwrap();
    assert_eq!(before, 1);
    thread::sleep(Duration::from_millis(300));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (sets, adds, unknown) = writer.join().unwrap();
    assert!(killed.elapsed() < Duration::from_secs(10));
    assert!(sets > 0 && adds > 0);
    let counted = store.get("n").unwrap();
    let counted: i64 = String::from_utf8_lossy(&counted).parse().unwrap();
    assert!(
        (adds..=adds + unknown).contains(&counted),
        "{counted} counted for {adds} adds and {unknown} unknown"
    );
    assert!(store.check(&[&format!("k{}", sets - 1)]).unwrap());
}

/// A tally written by 16 threads at once: every increment's reply is its own value (the
/// low units distinct, 1..=16), departures count in their own unit, a read sums them, and
/// the tally's keys are no user keys.
#[test]
fn a_tally_counts_concurrent_increments_exactly_once_each() {
    let Some(store) = store("tally") else { return };
    let store = Arc::new(store);
    let units = [1i64, 1 << 32];
    let threads: Vec<_> = (0..16)
        .map(|_| {
            let store = Arc::clone(&store);
            thread::spawn(move || store.tally_add("t", 1, &units).expect("tally add"))
        })
        .collect();
    let mut seen: Vec<i64> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    seen.sort_unstable();
    assert_eq!(seen, (1..=16).collect::<Vec<_>>());
    assert_eq!(
        store.tally_add("t", 1 << 32, &units).unwrap(),
        (1 << 32) + 16
    );
    assert_eq!(store.tally_add("t", 0, &units).unwrap(), (1 << 32) + 16);
    let refused = store.tally_add("t", 2, &units).unwrap_err().to_string();
    assert!(refused.contains("one of the units"), "{refused}");
    assert_eq!(
        store.num_keys().unwrap(),
        0,
        "a tally's keys are not user keys"
    );
}

/// A log appended to by 8 threads, 4 lines each: a read has every line once, and each
/// thread's lines in the order it wrote them.
#[test]
fn a_log_keeps_every_line_in_write_order() {
    let Some(store) = store("log") else { return };
    let store = Arc::new(store);
    assert!(store.log_read("roster").unwrap().is_empty());
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let store = Arc::clone(&store);
            thread::spawn(move || {
                for i in 0..4 {
                    store
                        .log_append("roster", format!("{t}.{i};").as_bytes())
                        .expect("append");
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    let log = String::from_utf8(store.log_read("roster").unwrap()).unwrap();
    let lines: Vec<&str> = log.split_terminator(';').collect();
    assert_eq!(lines.len(), 32, "{log}");
    for t in 0..8 {
        let mine: Vec<&str> = lines
            .iter()
            .copied()
            .filter(|l| l.starts_with(&format!("{t}.")))
            .collect();
        let expected: Vec<String> = (0..4).map(|i| format!("{t}.{i}")).collect();
        assert_eq!(mine, expected, "{log}");
    }
}
