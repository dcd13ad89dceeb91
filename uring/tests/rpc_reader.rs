//! Handlers that run on the thread that read their request
//! (`Handler::runs_on_reader`, as `rdzv.rpc`'s Python handler does), with real agents
//! over tcp on a `file://` store: such a handler runs on the inbound pipe's reader, not
//! the pool; one that blocks until a later request on the same pipe arrives is read past
//! (another thread reads the pipe on once it has run 2 ms), where a reader that only ran
//! it would wait forever; it may make a blocking nested call, which an inline handler
//! may not; and readers and the pool together run at most `num_worker_threads` handlers
//! at once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use rdzv_uring::rpc::{CallContext, Handler, Message, RpcAgent, RpcOptions};

mod common;

use common::{loopback_tcp, pair_of};

/// A handler that runs on readers, made of a closure.
struct OnReader<F>(F);

impl<F> Handler for OnReader<F>
where
    F: Fn(&CallContext, Message) -> Result<Message, String> + Send + Sync + 'static,
{
    fn call(&self, ctx: &CallContext, request: Message) -> Result<Message, String> {
        (self.0)(ctx, request)
    }

    fn runs_on_reader(&self) -> bool {
        true
    }
}

/// The name of the thread running this.
fn thread_name() -> String {
    thread::current().name().unwrap_or("unnamed").to_string()
}

fn text(reply: &Message) -> String {
    String::from_utf8_lossy(&reply.payload).into_owned()
}

/// A latch that `open` opens and `wait_open` waits for.
#[derive(Default)]
struct Latch {
    open: Mutex<bool>,
    opened: Condvar,
}

impl Latch {
    fn open(&self) {
        *self.open.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.opened.notify_all();
    }

    /// Whether it opened within `timeout`.
    fn wait_open(&self, timeout: Duration) -> bool {
        let open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let (open, _) = self
            .opened
            .wait_timeout_while(open, timeout, |open| !*open)
            .unwrap_or_else(|p| p.into_inner());
        *open
    }
}

fn with_latch(url: &str, latch: &Arc<Latch>) -> RpcOptions {
    let (waits, opens) = (Arc::clone(latch), Arc::clone(latch));
    loopback_tcp(url)
        .with_handler(
            "wait_open",
            OnReader(move |_: &CallContext, _: Message| {
                let opened = waits.wait_open(Duration::from_secs(20));
                let what = if opened { "opened" } else { "never opened" };
                Ok(Message::from_payload(format!(
                    "{what} on {}",
                    thread_name()
                )))
            }),
        )
        .with_handler(
            "open",
            OnReader(move |_: &CallContext, _: Message| {
                opens.open();
                Ok(Message::from_payload(thread_name()))
            }),
        )
        .with_handler(
            "nested_echo",
            OnReader(|ctx: &CallContext, m: Message| {
                ctx.client
                    .rpc_sync(&ctx.caller, "echo", m)
                    .map_err(|e| format!("the nested call failed: {e}"))
            }),
        )
}

/// Alice and bob, each with the latch handlers over a latch of its own.
fn latched_pair(dir: &tempfile::TempDir) -> (RpcAgent, RpcAgent) {
    pair_of(dir, |url, _| with_latch(url, &Arc::new(Latch::default())))
}

fn shut(a: RpcAgent, b: RpcAgent) {
    let t = thread::spawn(move || b.shutdown(true));
    a.shutdown(true).unwrap_or_else(|e| panic!("alice: {e}"));
    t.join()
        .unwrap_or_else(|_| panic!("bob's shutdown panicked"))
        .unwrap_or_else(|e| panic!("bob: {e}"));
}

#[test]
fn a_handler_waiting_for_a_later_request_on_its_pipe_is_read_past() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = latched_pair(&dir);
    // Warm the pipe, so that both calls below go on one lane.
    let first = a
        .rpc_sync("bob", "echo", Message::from_payload(b"hi".to_vec()))
        .unwrap_or_else(|e| panic!("warm-up: {e}"));
    assert_eq!(first.payload, b"hi");
    let started = Instant::now();
    let waiting = a.rpc_async("bob", "wait_open", Message::default());
    // Bob's reader is inside `wait_open` now (or soon): this request is read only by the
    // thread that takes over.
    let opened_by = a
        .rpc_sync("bob", "open", Message::default())
        .unwrap_or_else(|e| panic!("open: {e}"));
    let waited = waiting.wait().unwrap_or_else(|e| panic!("wait_open: {e}"));
    let took = started.elapsed();
    assert!(
        text(&waited).starts_with("opened on rdzv-rpc-lane-"),
        "wait_open ran on the pipe's reader and saw the latch open: {}",
        text(&waited)
    );
    assert!(
        text(&opened_by).starts_with("rdzv-rpc-lane-"),
        "open ran on a reader too: {}",
        text(&opened_by)
    );
    assert!(
        took < Duration::from_secs(5),
        "the blocked reader was read past within the stall limit, not the latch's 20 s: {took:?}"
    );
    // The pipe is still served afterwards, by the thread that took over.
    for i in 0..20u8 {
        let reply = a
            .rpc_sync("bob", "echo", Message::from_payload(vec![i]))
            .unwrap_or_else(|e| panic!("echo {i} after the takeover: {e}"));
        assert_eq!(reply.payload, [i]);
    }
    shut(a, b);
}

#[test]
fn a_handler_on_the_reader_may_wait_for_a_nested_call() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = latched_pair(&dir);
    for i in 0..10u8 {
        let reply = a
            .rpc_sync("bob", "nested_echo", Message::from_payload(vec![i; 3]))
            .unwrap_or_else(|e| panic!("nested call {i}: {e}"));
        assert_eq!(
            reply.payload, [i; 3],
            "bob called alice back and relayed it"
        );
    }
    shut(a, b);
}

#[test]
fn readers_and_the_pool_run_at_most_num_worker_threads_handlers_at_once() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let (a, b) = {
        let (running, most) = (Arc::clone(&running), Arc::clone(&most));
        pair_of(&dir, move |url, _| {
            let (running, most) = (Arc::clone(&running), Arc::clone(&most));
            let mut options = loopback_tcp(url).with_handler(
                "busy",
                OnReader(move |_: &CallContext, _: Message| {
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    thread::sleep(Duration::from_millis(30));
                    running.fetch_sub(1, Ordering::SeqCst);
                    Ok(Message::from_payload(thread_name()))
                }),
            );
            options.num_worker_threads = 2;
            options
        })
    };
    let calls: Vec<_> = (0..8)
        .map(|_| a.rpc_async("bob", "busy", Message::default()))
        .collect();
    let threads: Vec<String> = calls
        .into_iter()
        .map(|f| text(&f.wait().unwrap_or_else(|e| panic!("busy: {e}"))))
        .collect();
    assert_eq!(
        most.load(Ordering::SeqCst),
        2,
        "two slots, both used, never more: ran on {threads:?}"
    );
    assert!(
        threads.iter().any(|t| t.starts_with("rdzv-rpc-lane-")),
        "some ran on the reader: {threads:?}"
    );
    shut(a, b);
}
