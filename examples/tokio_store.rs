//! A PyTorch-compatible TCPStore server on tokio: the third driver of core's store step,
//! beside rdzv's io_uring and epoll loops, and what "embed the core in your own runtime"
//! means. `cargo run --example tokio_store -- 127.0.0.1:29500`, then point
//! `torch.distributed.TCPStore(..., is_master=False)` or `rdzv store --addr` at it.
//!
//! It uses `rdzv_core` only, the embedding API (`rdzv_uring`'s loops keep their read
//! buffers, fairness rounds and metrics private): [`Engine`] holds the keys and waiters,
//! [`Session::serve`] serves one request of one connection as a value, and this file does
//! what a driver does, nothing more:
//! - it moves bytes between a socket and the step (one task per connection);
//! - it hands the step `now` (milliseconds since the server started);
//! - it carries out the wake-ups the step returns for *other* connections (into their
//!   inbox, under the engine's lock, then their `Notify`) and the closes (after writing
//!   what is owed; the connection leaves the engine, so its waiters go with it).
//!
//! Every rule (framing, `VALIDATE` first, wire limits, the per-connection budget and the
//! high-water mark, the store's memory) is the step's, so this server refuses what rdzv's
//! own loops refuse. It leaves out what is a runtime's choice: `--allow`/tokens (a
//! `Session::with_access` away), metrics, a round's fairness cap, graceful drain.
//! A wake-up owed to a connection is taken from its inbox under the same lock as its next
//! request, so it always goes out before any reply decided after it.

use std::collections::HashMap;
use std::future::{poll_fn, Future};
use std::io;
use std::pin::pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;
use std::time::Instant;

use rdzv_core::store::budget::Budget;
use rdzv_core::store::codec::Limits;
use rdzv_core::store::engine::Engine;
use rdzv_core::store::session::{Session, Step, Wake};
use rdzv_core::store::ConnId;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// Most bytes read at once (less when the budget leaves less).
const READ_CHUNK: usize = 64 << 10;

/// The store: one engine behind a lock, shared by every connection's task.
pub struct Server {
    state: Mutex<State>,
    started: Instant,
    budget: Budget,
}

struct State {
    engine: Engine,
    /// Each open connection's wake-ups not yet taken, and how to wake its task.
    inboxes: HashMap<ConnId, (Vec<u8>, Arc<Notify>)>,
    next_id: u64,
}

/// What one turn left the connection to do.
enum Then {
    Read,
    ServeAgain,
    Close,
}

impl Server {
    pub fn new(budget: Budget) -> Arc<Server> {
        let engine = Engine::with_budget(budget);
        let inboxes = HashMap::new();
        let state = Mutex::new(State {
            engine,
            inboxes,
            next_id: 0,
        });
        Arc::new(Server {
            state,
            started: Instant::now(),
            budget,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Waiters the engine holds and connections it knows, for tests and logs.
    pub fn counts(&self) -> (usize, usize) {
        let state = self.lock();
        (state.engine.waiter_count(), state.engine.connection_count())
    }

    /// Accepts until the listener fails, one task per connection.
    pub async fn serve(self: Arc<Self>, listener: TcpListener) -> io::Result<()> {
        loop {
            let (stream, peer) = listener.accept().await?;
            let server = Arc::clone(&self);
            tokio::spawn(async move {
                if let Err(error) = server.connection(stream).await {
                    tracing::debug!(%peer, %error, "store connection failed");
                }
            });
        }
    }

    async fn connection(self: Arc<Self>, mut stream: TcpStream) -> io::Result<()> {
        stream.set_nodelay(true)?;
        let notify = Arc::new(Notify::new());
        let id = {
            let mut state = self.lock();
            state.next_id += 1;
            let id = ConnId(state.next_id);
            state.engine.connect(id);
            state.inboxes.insert(id, (Vec::new(), Arc::clone(&notify)));
            id
        };
        let session = Session::new(id, Limits::default(), self.budget);
        let result = self.drive(&mut stream, &notify, session).await;
        let mut wakes = Vec::new();
        let mut state = self.lock();
        state.engine.disconnect(id);
        state.inboxes.remove(&id);
        while let Some(wake) = state.engine.poll_wakeup() {
            wakes.push(wake);
        }
        route(state, &mut wakes);
        result
    }

    /// Serves, writes, then waits for bytes or a wake-up; until the step or the peer
    /// closes.
    async fn drive(
        &self,
        stream: &mut TcpStream,
        notify: &Notify,
        mut session: Session,
    ) -> io::Result<()> {
        let (mut input, mut out, mut wakes) = (Vec::new(), Vec::new(), Vec::new());
        loop {
            let then = self.turn(&mut session, &mut input, &mut out, &mut wakes);
            // Every reply is written before more is read: the peer's reading paces it.
            stream.write_all(&out).await?;
            out.clear();
            match then {
                Then::Close => {
                    // FIN after the replies, and what the peer sent (up to 256 KiB)
                    // discarded: a close with unread input would send RST, and a reset
                    // drops the replies not yet sent.
                    stream.shutdown().await?;
                    let mut sink = [0u8; 16 << 10];
                    for _ in 0..16 {
                        if !matches!(stream.try_read(&mut sink), Ok(1..)) {
                            break;
                        }
                    }
                    return Ok(());
                }
                Then::ServeAgain => continue,
                Then::Read => {}
            }
            let room = self.budget.max_conn_bytes.saturating_sub(input.len());
            let room = room.min(READ_CHUNK);
            let filled = input.len();
            if room == 0 || input.try_reserve(room).is_err() {
                return Ok(());
            }
            input.resize(filled + room, 0);
            let mut notified = pin!(notify.notified());
            let read = loop {
                let woken = poll_fn(|cx| match notified.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Ok(true)),
                    Poll::Pending => stream.poll_read_ready(cx).map_ok(|()| false),
                })
                .await?;
                if woken {
                    break Ok(0);
                }
                match stream.try_read(&mut input[filled..]) {
                    Ok(0) => break Err(io::ErrorKind::UnexpectedEof),
                    Ok(n) => break Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                    Err(e) => return Err(e),
                }
            };
            input.truncate(filled + read.unwrap_or(0));
            if read.is_err() {
                return Ok(()); // the peer closed: no reply is owed
            }
        }
    }

    /// One turn under the lock: the connection's inbox first, then its whole requests
    /// through the step, then the wake-ups it owes the others.
    fn turn(
        &self,
        session: &mut Session,
        input: &mut Vec<u8>,
        out: &mut Vec<u8>,
        wakes: &mut Vec<Wake>,
    ) -> Then {
        let now_ms = self.started.elapsed().as_millis() as u64;
        let mut state = self.lock();
        if let Some((inbox, _)) = state.inboxes.get_mut(&session.id()) {
            out.append(inbox);
        }
        let mut used = 0;
        let then = loop {
            let step = session.serve(
                &mut state.engine,
                &input[used..],
                out.len(),
                out,
                wakes,
                now_ms,
            );
            match step {
                Step::Served { used: n, .. } | Step::Authenticated { used: n } => used += n,
                Step::Partial { .. } => break Then::Read,
                Step::Blocked => break Then::ServeAgain,
                Step::Close(refusal) => {
                    tracing::warn!(conn = session.id().0, reason = %refusal, "closing store connection");
                    break Then::Close;
                }
            }
        };
        route(state, wakes);
        input.drain(..used);
        then
    }
}

/// Moves each wake-up into its connection's inbox (a connection gone has none) and wakes
/// those tasks after the unlock.
fn route(mut state: MutexGuard<'_, State>, wakes: &mut Vec<Wake>) {
    let mut woken = Vec::new();
    for (target, wake) in wakes.drain(..) {
        if let Some((inbox, notify)) = state.inboxes.get_mut(&target) {
            inbox.push(wake as u8);
            woken.push(Arc::clone(notify));
        }
    }
    drop(state);
    woken.iter().for_each(|notify| notify.notify_one());
}

#[allow(dead_code)] // The integration test includes this file for `Server` alone.
fn main() -> io::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:29500".into());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_io()
        .build()?;
    runtime.block_on(async {
        let listener = TcpListener::bind(&addr).await?;
        println!(
            "rdzv store step on tokio, listening on {}",
            listener.local_addr()?
        );
        Server::new(Budget::default()).serve(listener).await
    })
}
