//! PyTorch's `RendezvousTest`, `RendezvousEnvTest`, `RendezvousTCPTest` and
//! `RendezvousFileTest` cases (test/distributed/test_store.py), plus the agent-store
//! modes, multi-tenancy and custom schemes, over real loopback sockets. Each test picks
//! its own port by binding port 0, and passes its environment explicitly: the test
//! process's environment is never changed.

use std::collections::HashMap;
use std::net::TcpListener;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use rdzv::core::env::{EmptyEnv, Env};
use rdzv::core::query::QueryView;
use rdzv::core::rendezvous::{NodeParams, StorePlan, TcpStorePlan, ATTEMPT_PREFIX_VAR};
use rdzv::core::url::RendezvousUrl;
use rdzv::uring::rendezvous::{
    register_rendezvous_handler, rendezvous, rendezvous_with, Rendezvous, RendezvousError,
    RendezvousOptions, StoreRole,
};
use rdzv::uring::store::hash::HashStore;
use rdzv::uring::store::tcp::TcpStore;
use rdzv::uring::{ServerOptions, Store, StoreServer};

/// A port nobody listens on right now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("bind port 0")
        .port()
}

fn env(vars: &[(&str, &str)]) -> HashMap<String, String> {
    vars.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn options(timeout: Duration) -> RendezvousOptions {
    RendezvousOptions::with_timeout(timeout)
}

const TEN_SECONDS: Duration = Duration::from_secs(10);

fn given(rank: Option<u32>, world_size: Option<u32>) -> NodeParams {
    NodeParams::Given { rank, world_size }
}

/// Rendezvous with no node parameters, an explicit environment and a 10 s timeout.
fn rdzv_env(url: &str, env: &impl Env) -> Result<Rendezvous, RendezvousError> {
    rendezvous_with(url, given(None, None), env, &options(TEN_SECONDS))
}

fn error_text(result: Result<Rendezvous, RendezvousError>) -> String {
    match result {
        Ok(r) => format!("unexpected rendezvous {r:?}"),
        Err(e) => e.to_string(),
    }
}

fn tcp_plan(r: &Rendezvous) -> TcpStorePlan {
    match r.plan.as_ref().map(|plan| &plan.store) {
        Some(StorePlan::Tcp(plan)) => plan.clone(),
        other => panic!("expected a TCP store plan, got {other:?}"),
    }
}

/// A server standing in for the torchelastic agent's: not multi-tenant, on a fresh port.
fn agent_server() -> StoreServer {
    StoreServer::start(ServerOptions {
        host: None,
        port: 0,
        ..ServerOptions::default()
    })
    .expect("start the agent's server")
}

#[test]
fn unknown_handler() {
    // RendezvousTest.test_unknown_handler
    assert_eq!(
        error_text(rendezvous("invalid://", None, None)),
        "No rendezvous handler for invalid://"
    );
    match rdzv_env("InValid://h?rank=0&world_size=1", &EmptyEnv) {
        Err(RendezvousError::NoHandler { scheme, .. }) => assert_eq!(scheme, "invalid"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn url_with_node_params() {
    // RendezvousTest.test_url_with_node_params
    assert_eq!(
        error_text(rendezvous("file:///tmp/x?rank=0", Some(0), Some(1))),
        "The url: file:///tmp/x?rank=0 has node-specific arguments(rank, world_size) already."
    );
    assert_eq!(
        error_text(rendezvous("tcp://h:1?world_size=2", Some(0), None)),
        "The url: tcp://h:1?world_size=2 has node-specific arguments(rank, world_size) already."
    );
}

#[test]
fn env_nominal() {
    // RendezvousEnvTest.test_nominal
    let port = free_port().to_string();
    let env = env(&[
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", &port),
        ("RANK", "0"),
    ]);
    let r = rdzv_env("env://", &env).expect("rendezvous");
    assert_eq!((r.rank, r.world_size), (0, Some(1)));
    let plan = tcp_plan(&r);
    assert!(plan.is_server && plan.multi_tenant && !plan.agent_store);
    assert_eq!(plan.timeout, TEN_SECONDS);
    r.store.set("key0", b"value0").expect("set");
    assert_eq!(r.store.get("key0").expect("get"), b"value0");
}

#[test]
fn env_inferred_params_read_rank_and_world_size() {
    // _create_store_from_options: world_size=None, RANK/WORLD_SIZE fill in.
    let port = free_port().to_string();
    let env = env(&[
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", &port),
        ("RANK", "0"),
    ]);
    let r = rendezvous_with(
        "env://",
        NodeParams::Inferred { rank: Some(5) },
        &env,
        &options(TEN_SECONDS),
    )
    .expect("rendezvous");
    assert_eq!((r.rank, r.world_size), (0, Some(1)));
}

#[test]
fn env_errors() {
    let prefix = "Error initializing torch.distributed using env:// rendezvous: ";
    let env = env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "h")]);
    assert_eq!(
        error_text(rdzv_env("env://", &env)),
        format!("{prefix}environment variable MASTER_PORT expected, but not set")
    );
    assert_eq!(
        error_text(rdzv_env("env://", &EmptyEnv)),
        format!("{prefix}environment variable RANK expected, but not set")
    );
}

#[test]
fn tcp_common_errors() {
    // RendezvousTCPTest.test_common_errors
    let prefix = "Error initializing torch.distributed using tcp:// rendezvous: ";
    for (url, message) in [
        ("tcp://127.0.0.1?rank=0&world_size=1", "port number missing"),
        (
            "tcp://127.0.0.1:23456?world_size=1",
            "rank parameter missing",
        ),
        (
            "tcp://127.0.0.1:23456?rank=0",
            "world size parameter missing",
        ),
    ] {
        let result = rdzv_env(url, &EmptyEnv);
        assert!(matches!(result, Err(RendezvousError::Plan(_))), "{url}");
        assert_eq!(error_text(result), format!("{prefix}{message}"), "{url}");
    }
}

#[test]
fn file_common_errors() {
    // RendezvousFileTest.test_common_errors; the errors come before any store is built.
    let prefix = "Error initializing torch.distributed using file:// rendezvous: ";
    for (url, message) in [
        ("file://?rank=0&world_size=1", "path missing"),
        ("file:///tmp/foo?world_size=1", "rank parameter missing"),
        ("file:///tmp/foo?rank=0", "world size parameter missing"),
    ] {
        assert_eq!(
            error_text(rdzv_env(url, &EmptyEnv)),
            format!("{prefix}{message}"),
            "{url}"
        );
    }
}

#[test]
fn file_nominal() {
    // RendezvousFileTest.test_nominal: two ranks share one store file.
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store");
    let url = format!("file://{}?world_size=2", path.display());
    let r0 = rdzv_env(&format!("{url}&rank=0"), &EmptyEnv).expect("rank 0");
    let r1 = rdzv_env(&format!("{url}&rank=1"), &EmptyEnv).expect("rank 1");
    assert_eq!((r0.rank, r0.world_size), (0, Some(2)));
    assert_eq!((r1.rank, r1.world_size), (1, Some(2)));
    match &r0
        .plan
        .as_ref()
        .expect("bundled handlers make a plan")
        .store
    {
        StorePlan::File(plan) => assert_eq!(plan.path, path.display().to_string()),
        other => panic!("{other:?}"),
    }
    r0.store.set("key0", b"value0").expect("set");
    assert_eq!(r1.store.get("key0").expect("get"), b"value0");
    r1.store.set("key1", b"value1").expect("set");
    assert_eq!(r0.store.get("key1").expect("get"), b"value1");
    assert!(path.exists());
    // A fixed-size store's file goes with its last handle.
    drop(r0);
    drop(r1);
    assert!(!path.exists(), "the last handle removes {}", path.display());
}

#[test]
fn file_store_open_failure_names_rank_and_path() {
    // A directory where the store file should be: opening it fails, and says where.
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("file://{}?rank=1&world_size=2", dir.path().display());
    match rdzv_env(&url, &EmptyEnv) {
        Err(e @ RendezvousError::FileStore { rank: 1, .. }) => {
            let text = e.to_string();
            assert!(text.contains(&dir.path().display().to_string()), "{text}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn tcp_nominal() {
    // RendezvousTCPTest.test_nominal: rank 0 hosts, rank 1 connects, they share keys.
    let url = format!("tcp://127.0.0.1:{}?world_size=2", free_port());
    let ranks: Vec<_> = (0..2u32)
        .map(|rank| {
            let url = format!("{url}&rank={rank}");
            thread::spawn(move || rdzv_env(&url, &EmptyEnv))
        })
        .collect();
    let mut stores = Vec::new();
    for (rank, handle) in (0u32..).zip(ranks) {
        let r = handle.join().expect("rank thread").expect("rendezvous");
        assert_eq!((r.rank, r.world_size), (rank, Some(2)));
        let plan = tcp_plan(&r);
        assert_eq!(plan.is_server, rank == 0);
        assert!(plan.multi_tenant && !plan.agent_store);
        stores.push(r.store);
    }
    stores[0].set("key0", b"value0").expect("set");
    assert_eq!(stores[1].get("key0").expect("get"), b"value0");
    stores[1].set("key1", b"value1").expect("set");
    assert_eq!(stores[0].get("key1").expect("get"), b"value1");
}

#[test]
fn tcp_node_params_from_the_caller() {
    // dist.rendezvous(url, rank, world_size): the URL is rewritten before the handler.
    let url = format!("tcp://127.0.0.1:{}", free_port());
    let r = rendezvous_with(
        &url,
        given(Some(0), Some(1)),
        &EmptyEnv,
        &options(TEN_SECONDS),
    )
    .expect("rendezvous");
    assert_eq!((r.rank, r.world_size), (0, Some(1)));
    r.store.set("k", b"v").expect("set");
    assert_eq!(r.store.get("k").expect("get"), b"v");
}

#[test]
fn tcp_store_timeout_set() {
    // RendezvousTCPTest.test_tcp_store_timeout_set
    let url = format!("tcp://127.0.0.1:{}?world_size=1&rank=0", free_port());
    let r = rdzv_env(&url, &EmptyEnv).expect("rendezvous");
    assert_eq!(r.store.timeout(), TEN_SECONDS);
    r.store.set_timeout(Duration::from_millis(100));
    let start = Instant::now();
    let error = r.store.get("nonexistent key").expect_err("times out");
    assert_eq!(
        error.to_string(),
        "wait timeout after 100ms, keys: /nonexistent key"
    );
    assert!(start.elapsed() < TEN_SECONDS);
}

#[test]
fn tcp_store_timeout_doesnt_break_client() {
    // RendezvousTCPTest.test_tcp_store_timeout_doest_break_client, with the short
    // timeout given to the rendezvous itself.
    let url = format!("tcp://127.0.0.1:{}?world_size=1&rank=0", free_port());
    let r = rendezvous_with(
        &url,
        given(None, None),
        &EmptyEnv,
        &options(Duration::from_millis(100)),
    )
    .expect("rendezvous");
    let start = Instant::now();
    let error = r.store.get("the_key").expect_err("times out");
    assert_eq!(
        error.to_string(),
        "wait timeout after 100ms, keys: /the_key"
    );
    r.store.set("the_key", b"x").expect("set");
    assert_eq!(r.store.get("the_key").expect("get"), b"x");
    assert!(start.elapsed() < TEN_SECONDS);
}

#[test]
fn tcp_store_url_with_libuv() {
    // RendezvousTCPTest.test_tcp_store_url_with_libuv: both values are accepted (rdzv has
    // one server backend) and the plan records the flag.
    for (flag, expected) in [("1", true), ("0", false)] {
        let url = format!(
            "tcp://127.0.0.1:{}?world_size=1&rank=0&use_libuv={flag}",
            free_port()
        );
        let r = rdzv_env(&url, &EmptyEnv).expect("rendezvous");
        assert_eq!(tcp_plan(&r).use_libuv, expected);
        r.store.set("k", b"v").expect("set");
        assert_eq!(r.store.get("k").expect("get"), b"v");
    }
}

#[test]
fn tcp_connect_timeout_names_rank_and_address() {
    // RendezvousTCPTest.test_dns_timeout, against a port nobody listens on (no DNS).
    let port = free_port();
    let url = format!("tcp://127.0.0.1:{port}?world_size=2&rank=1");
    let result = rendezvous_with(
        &url,
        given(None, None),
        &EmptyEnv,
        &options(Duration::from_millis(300)),
    );
    match &result {
        Err(RendezvousError::Store {
            rank: 1,
            role: StoreRole::Client,
            port: p,
            ..
        }) if *p == port => {}
        other => panic!("{other:?}"),
    }
    let text = error_text(result);
    assert!(text.starts_with("rank 1: "), "{text}");
    assert!(
        text.contains(&format!(
            "The client socket has timed out after 300ms while trying to connect to \
             (127.0.0.1, {port})"
        )),
        "{text}"
    );
}

#[test]
fn multi_tenant_reuse() {
    // Two rendezvous of rank 0 on one port in one process share one server.
    let url = format!("tcp://127.0.0.1:{}?world_size=1&rank=0", free_port());
    let first = rdzv_env(&url, &EmptyEnv).expect("first");
    let second = rdzv_env(&url, &EmptyEnv).expect("second reuses the server");
    assert!(tcp_plan(&second).is_server);
    first.store.set("shared", b"yes").expect("set");
    assert_eq!(second.store.get("shared").expect("get"), b"yes");
}

#[test]
fn agent_store_mode_makes_every_rank_a_client() {
    // torchelastic: the agent hosts the server; with TORCHELASTIC_USE_AGENT_STORE=True
    // rank 0 does not try to host and every rank connects to MASTER_ADDR:MASTER_PORT.
    let server = agent_server();
    let port = server.port().to_string();
    // PyTorch 2.4 and later: the bare store, no restart count needed.
    let bare: Vec<Rendezvous> = (0..2u32)
        .map(|rank| {
            let env = env(&[
                ("TORCHELASTIC_USE_AGENT_STORE", "True"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", &port),
                ("RANK", &rank.to_string()),
                ("WORLD_SIZE", "2"),
            ]);
            rdzv_env("env://", &env).expect("rendezvous")
        })
        .collect();
    for r in &bare {
        let plan = tcp_plan(r);
        assert!(plan.agent_store && !plan.is_server && plan.prefix.is_none());
    }
    bare[0].store.set("bare", b"0").expect("set");
    assert_eq!(bare[1].store.get("bare").expect("get"), b"0");
    let agent = TcpStore::connect("127.0.0.1", server.port(), TEN_SECONDS).expect("agent");
    assert_eq!(agent.get("bare").expect("get"), b"0");
    assert!(agent.delete_key("bare").expect("delete"));

    // Before 2.4 (RDZV_TORCHELASTIC_ATTEMPT_PREFIX=1): the store seen through
    // PrefixStore(f"/worker/attempt_{TORCHELASTIC_RESTART_COUNT}").
    let join = |rank: u32, attempt: &str| {
        let env = env(&[
            (ATTEMPT_PREFIX_VAR, "1"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", attempt),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", &port),
            ("RANK", &rank.to_string()),
            ("WORLD_SIZE", "2"),
        ]);
        rdzv_env("env://", &env).expect("rendezvous")
    };
    let ranks: Vec<Rendezvous> = (0..2u32).map(|rank| join(rank, "0")).collect();
    for (rank, r) in (0u32..).zip(&ranks) {
        assert_eq!((r.rank, r.world_size), (rank, Some(2)));
        let plan = tcp_plan(r);
        assert!(plan.agent_store && !plan.is_server && !plan.multi_tenant);
        assert_eq!(plan.prefix.as_deref(), Some("/worker/attempt_0"));
    }
    // The agent (a plain client of its own server) sees what the ranks write under
    // prefix + "/" + key (c10d PrefixStore::joinKey), and nothing unprefixed.
    ranks[0].store.set("from0", b"a").expect("set");
    ranks[1].store.set("from1", b"b").expect("set");
    assert_eq!(agent.get("/worker/attempt_0/from0").expect("get"), b"a");
    assert_eq!(agent.get("/worker/attempt_0/from1").expect("get"), b"b");
    assert!(!agent.check(&["from0"]).expect("check"));
    let mut keys = agent.list_keys().expect("list_keys");
    keys.sort();
    assert_eq!(keys, ["/worker/attempt_0/from0", "/worker/attempt_0/from1"]);
    // A rank's own view is unprefixed, and the agent's writes under the prefix reach it.
    agent
        .set("/worker/attempt_0/from_agent", b"c")
        .expect("set");
    assert_eq!(ranks[1].store.get("from_agent").expect("get"), b"c");
    assert_eq!(ranks[0].store.add("counter", 2).expect("add"), 2);
    assert_eq!(agent.add("/worker/attempt_0/counter", 1).expect("add"), 3);

    // A restarted job (the agent bumps TORCHELASTIC_RESTART_COUNT) does not see the
    // previous attempt's keys.
    let restarted = join(0, "1");
    assert!(!restarted.store.check(&["from0"]).expect("check"));
    restarted.store.set("from0", b"again").expect("set");
    assert_eq!(agent.get("/worker/attempt_1/from0").expect("get"), b"again");
    assert_eq!(ranks[1].store.get("from0").expect("get"), b"a");

    // Without the restart count it is an error naming the variable (Python: KeyError).
    let no_count = env(&[
        (ATTEMPT_PREFIX_VAR, "1"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", &port),
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
    ]);
    let result = rdzv_env("env://", &no_count);
    assert!(
        matches!(result, Err(RendezvousError::Plan(_))),
        "{result:?}"
    );
    let text = error_text(result);
    assert!(
        text.starts_with("KeyError: 'TORCHELASTIC_RESTART_COUNT'"),
        "{text}"
    );

    // The Python check is exact: "true" is not agent-store mode, so rank 0 tries to host
    // on the agent's port, and (MASTER_PORT differing) the bind failure is an error.
    let env = env(&[
        ("TORCHELASTIC_USE_AGENT_STORE", "true"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "1"),
    ]);
    let url = format!("tcp://127.0.0.1:{port}?world_size=1&rank=0");
    let result = rdzv_env(&url, &env);
    assert!(
        matches!(
            result,
            Err(RendezvousError::Store {
                rank: 0,
                role: StoreRole::Server,
                ..
            })
        ),
        "{result:?}"
    );
}

#[test]
fn bind_failure_escape_hatch() {
    // The C++ TCPStore (test_agent_store): a busy port is an error, unless
    // TORCHELASTIC_USE_AGENT_STORE is truthy (C++ rules) and MASTER_PORT is that port.
    let server = agent_server();
    let port = server.port();
    let url = format!("tcp://127.0.0.1:{port}?world_size=1&rank=0");

    let text = error_text(rdzv_env(&url, &EmptyEnv));
    assert!(
        text.starts_with(&format!(
            "rank 0: hosting the TCPStore server of 127.0.0.1:{port} failed: "
        )),
        "{text}"
    );
    assert!(
        text.contains("The server socket has failed to listen on any local network address"),
        "{text}"
    );

    let port_text = port.to_string();
    let wrong_port = env(&[("TORCHELASTIC_USE_AGENT_STORE", "1"), ("MASTER_PORT", "1")]);
    assert!(rdzv_env(&url, &wrong_port).is_err());

    for truthy in ["1", "yes", "T", "true", "True"] {
        let env = env(&[
            ("TORCHELASTIC_USE_AGENT_STORE", truthy),
            ("TORCHELASTIC_RESTART_COUNT", "0"),
            ("MASTER_PORT", &port_text),
        ]);
        let r = rdzv_env(&url, &env).expect("continues as a client");
        // Without MASTER_ADDR, even "True" is not Python's agent-store mode (PyTorch
        // 2.15's _agent_store_serves compares the endpoint): every value goes through
        // the C++ hatch.
        assert!(tcp_plan(&r).is_server, "{truthy}");
        r.store.set(&format!("hatch/{truthy}"), b"1").expect("set");
    }
    let agent = TcpStore::connect("127.0.0.1", port, TEN_SECONDS).expect("agent");
    assert_eq!(agent.get("hatch/yes").expect("get"), b"1");
}

#[test]
fn custom_scheme_registration() {
    // register_rendezvous_handler: a scheme of our own, served by an in-process store.
    let shared: Arc<dyn Store> = Arc::new(HashStore::new());
    let store = Arc::clone(&shared);
    register_rendezvous_handler(
        "myscheme",
        move |url: &str, env: &dyn Env, options: &RendezvousOptions| {
            let parsed = RendezvousUrl::parse(url)
                .map_err(|e| RendezvousError::Handler(e.to_string().into()))?;
            let query = QueryView::parse(parsed.query())
                .map_err(|e| RendezvousError::Handler(e.to_string().into()))?;
            let number = |key: &str| -> Result<u32, RendezvousError> {
                query
                    .get(key)
                    .and_then(|v| v.parse().ok())
                    .ok_or_else(|| RendezvousError::Handler(format!("{key} missing").into()))
            };
            let rank = number("rank")?;
            let world_size = number("world_size")?;
            assert_eq!(options.timeout, TEN_SECONDS);
            let tag = env.var("MY_TAG").unwrap_or("none");
            store
                .set(&format!("joined/{rank}"), tag.as_bytes())
                .map_err(|e| RendezvousError::Handler(Box::new(e)))?;
            Ok(Rendezvous::new(Arc::clone(&store), rank, Some(world_size)))
        },
    )
    .expect("first registration");

    let tagged = env(&[("MY_TAG", "blue")]);
    let r = rendezvous_with(
        "MyScheme://anywhere",
        given(Some(1), Some(3)),
        &tagged,
        &options(TEN_SECONDS),
    )
    .expect("custom rendezvous");
    assert_eq!((r.rank, r.world_size), (1, Some(3)));
    assert!(r.plan.is_none());
    assert_eq!(shared.get("joined/1").expect("get"), b"blue");

    assert_eq!(
        error_text(rdzv_env("myscheme://anywhere", &EmptyEnv)),
        "rank missing"
    );
    let again = register_rendezvous_handler("myscheme", |_: &str, _: &dyn Env, _: &_| {
        Err(RendezvousError::Unsupported("never called".into()))
    });
    assert_eq!(
        again.map_err(|e| e.to_string()),
        Err("Rendezvous handler for myscheme:// already registered".to_string())
    );
    assert_eq!(
        register_rendezvous_handler("tcp", |_: &str, _: &dyn Env, _: &_| {
            Err(RendezvousError::Unsupported("never called".into()))
        })
        .map_err(|e| e.to_string()),
        Err("Rendezvous handler for tcp:// already registered".to_string())
    );
}

#[test]
fn elastic_contact_given_at_start_comes_with_the_first_round() {
    // torchrun's handler gives its MASTER_ADDR:MASTER_PORT with the node; given at start,
    // it rides on the first roster line, so every member learns rank 0's with the world
    // (a set_contact after the start may lose the race with the driver's first arrival).
    use rdzv::core::rendezvous::elastic::{ElasticSettings, NodeRange};
    use rdzv::uring::rendezvous::elastic::{Contact, ElasticRendezvous};
    let server = agent_server();
    let port = server.port();
    let mut settings = ElasticSettings::new("contact", NodeRange::new(3, 3).expect("range"));
    settings.join_timeout = Duration::from_secs(20);
    // Leaving ends a wait within one interval.
    settings.keep_alive_interval = Duration::from_millis(200);
    let nodes: Vec<ElasticRendezvous> = (0..3)
        .map(|i| {
            let driver =
                TcpStore::connect_without_ping("127.0.0.1", port, TEN_SECONDS).expect("driver");
            let connect: rdzv::uring::rendezvous::elastic::StoreConnector = Box::new(move || {
                TcpStore::connect("127.0.0.1", port, TEN_SECONDS)
                    .map(|tcp| Arc::new(tcp) as Arc<dyn Store>)
            });
            let contact = format!("10.0.0.{i}:2950{i}");
            ElasticRendezvous::start_lazy_with_contact(
                Box::new(driver),
                connect,
                settings.clone(),
                format!("node{i}"),
                Some(Contact::Fixed(contact)),
            )
            .expect("start")
        })
        .collect();
    let rounds: Vec<_> = nodes
        .iter()
        .map(|node| node.next_rendezvous().expect("a round"))
        .collect();
    let rank0 = nodes
        .iter()
        .zip(&rounds)
        .find(|(_, round)| round.rank == 0)
        .map(|(node, _)| node.node().trim_start_matches("node").to_string())
        .expect("a rank 0");
    let want = format!("10.0.0.{rank0}:2950{rank0}");
    for round in &rounds {
        assert_eq!(round.world_size, 3);
        assert_eq!(round.master.as_deref(), Some(want.as_str()), "{round:?}");
    }
    for node in &nodes {
        node.leave(TEN_SECONDS);
    }
}

#[test]
fn a_rejoining_rank_0_offers_a_fresh_port() {
    // torchrun's MASTER_PORT: c10d picks a free port for every round. A node rejoins the
    // next round on its own as soon as it sees its round end, before its agent hears of
    // it, so a contact set then comes a round late; Contact::FreePort offers a port free
    // at each arrival instead.
    use rdzv::core::rendezvous::elastic::{ElasticSettings, NodeRange};
    use rdzv::uring::rendezvous::elastic::{Contact, ElasticRendezvous};
    let server = agent_server();
    let port = server.port();
    let mut settings = ElasticSettings::new("fresh-contact", NodeRange::new(2, 2).expect("range"));
    settings.join_timeout = Duration::from_secs(20);
    settings.keep_alive_interval = Duration::from_millis(200);
    let start = |name: &str| {
        let driver =
            TcpStore::connect_without_ping("127.0.0.1", port, TEN_SECONDS).expect("driver");
        let connect: rdzv::uring::rendezvous::elastic::StoreConnector = Box::new(move || {
            TcpStore::connect("127.0.0.1", port, TEN_SECONDS)
                .map(|tcp| Arc::new(tcp) as Arc<dyn Store>)
        });
        let contact = Contact::FreePort {
            host: format!("{name}.example"),
        };
        ElasticRendezvous::start_lazy_with_contact(
            Box::new(driver),
            connect,
            settings.clone(),
            name,
            Some(contact),
        )
        .expect("start")
    };
    // Node names order newcomers' ranks: "a" is rank 0.
    let a = start("a");
    let b = start("b");
    let both = |a: &ElasticRendezvous, b: &ElasticRendezvous| {
        thread::scope(|s| {
            let rb = s.spawn(|| b.next_rendezvous().expect("b's round"));
            (
                a.next_rendezvous().expect("a's round"),
                rb.join().expect("b"),
            )
        })
    };
    let mut ports = Vec::new();
    for round in 0..3 {
        let (ra, rb) = both(&a, &b);
        assert_eq!((ra.round, ra.rank, rb.rank), (round, 0, 1));
        assert_eq!(ra.master, rb.master);
        let master = ra.master.expect("rank 0's contact");
        let (host, port) = master.rsplit_once(':').expect("host:port");
        assert_eq!(host, "a.example");
        let port: u16 = port.parse().expect("a port");
        assert_ne!(port, 0);
        // The rounds' workers run (here: hold the port) until b's fail.
        let workers = TcpListener::bind(("0.0.0.0", port)).expect("the offered port is free");
        ports.push(port);
        // b's workers fail; a's agent learns of it and restarts too (torchrun's
        // num_nodes_waiting), while its old workers may still hold their port.
        b.worker_failed();
        let deadline = Instant::now() + TEN_SECONDS;
        while a.num_nodes_waiting().expect("waiting") == 0 {
            assert!(Instant::now() < deadline, "a never saw b waiting");
            thread::sleep(Duration::from_millis(20));
        }
        drop(workers);
    }
    ports.dedup();
    assert_eq!(ports.len(), 3, "a fresh port every round: {ports:?}");
    a.leave(TEN_SECONDS);
    b.leave(TEN_SECONDS);
}
