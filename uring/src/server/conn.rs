//! The accept loops and the per-connection tasks.
//!
//! Executor 0 owns the store engine. Its own connections call the engine directly. With
//! `threads > 1`, every other executor accepts connections on its own `SO_REUSEPORT`
//! listener, cuts the bytes it reads into whole frames (checking the limits), and
//! forwards them to executor 0 over a glommio shared channel; executor 0 runs them
//! through the engine and sends back the bytes each connection is owed (replies and
//! wake-ups), in order. The engine and the tables of one executor are `Rc<RefCell<_>>`
//! shared by its tasks; no borrow is ever held across an `.await`.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_lite::{AsyncReadExt, AsyncWriteExt};
use glommio::channels::local_channel::{self, LocalReceiver, LocalSender};
use glommio::channels::shared_channel::{ConnectedReceiver, ConnectedSender};
use glommio::net::{TcpListener, TcpStream};
use rdzv_core::store::codec::{Decoded, Limits, RequestDecoder};
use rdzv_core::store::engine::Engine;
use rdzv_core::store::{ConnId, WaitResponse};

use super::session::{self, ReadBuf};
use super::StatsCells;

/// Connection ids carry their executor in the top bits.
const EXECUTOR_SHIFT: u32 = 48;

fn conn_id(executor: usize, n: u64) -> ConnId {
    ConnId(((executor as u64) << EXECUTOR_SHIFT) | (n & ((1 << EXECUTOR_SHIFT) - 1)))
}

fn executor_of(conn: ConnId) -> usize {
    (conn.0 >> EXECUTOR_SHIFT) as usize
}

/// What an accepting executor sends the engine owner.
pub(super) enum ToOwner {
    /// A connection was accepted.
    Connect(ConnId),
    /// Whole request frames from a connection, in order.
    Frames(ConnId, Vec<u8>),
    /// A connection closed.
    Disconnect(ConnId),
}

/// What the engine owner sends an accepting executor.
pub(super) enum FromOwner {
    /// Bytes a connection is owed (replies and wake-ups), in order.
    Bytes(ConnId, Vec<u8>),
    /// The engine refused the connection: flush and close it.
    Close(ConnId),
}

/// What other tasks tell a connection task.
enum ConnMsg {
    /// Bytes to write (wake-ups from this executor's engine, or the owner's output).
    Bytes(Vec<u8>),
    /// One STOP_WAITING byte (the common wake-up, without allocating).
    Wake(WaitResponse),
    /// The engine refused the connection: flush and close.
    Close,
    /// The server is shutting down: flush and close.
    Shutdown,
}

/// Shared by the tasks of the owner executor.
struct Owner {
    engine: RefCell<Engine>,
    /// Connections accepted by the owner itself.
    conns: RefCell<HashMap<ConnId, LocalSender<ConnMsg>>>,
    /// Channels to the accepting executors (index = executor - 1).
    remotes: Vec<ConnectedSender<FromOwner>>,
    /// Bytes owed to remote connections, flushed after each batch.
    outbox: RefCell<HashMap<ConnId, Vec<u8>>>,
    limits: Limits,
    local_live: Cell<usize>,
    remote_live: Cell<usize>,
    stats: Arc<StatsCells>,
}

impl Owner {
    /// Publishes the engine's counts for [`super::StoreServer::stats`].
    fn publish(&self, engine: &Engine) {
        let live = self.local_live.get() + self.remote_live.get();
        self.stats.connections.store(live, Ordering::Relaxed);
        self.stats
            .waiters
            .store(engine.waiter_count(), Ordering::Relaxed);
        self.stats.keys.store(engine.num_keys(), Ordering::Relaxed);
    }

    /// Hands the engine's pending wake-ups to their connections; the ones for `me` are
    /// encoded straight into `out`.
    fn route_wakeups(&self, engine: &mut Engine, me: ConnId, out: &mut Vec<u8>) {
        while let Some((conn, wake)) = engine.poll_wakeup() {
            if conn == me {
                out.push(wake as u8);
            } else if executor_of(conn) == 0 {
                if let Some(tx) = self.conns.borrow().get(&conn) {
                    // Unbounded: never fails while the receiver lives.
                    let _ = tx.try_send(ConnMsg::Wake(wake));
                }
            } else {
                self.outbox
                    .borrow_mut()
                    .entry(conn)
                    .or_default()
                    .push(wake as u8);
            }
        }
    }

    /// Sends what remote connections are owed.
    async fn flush_outbox(&self) {
        let owed: Vec<(ConnId, Vec<u8>)> = self.outbox.borrow_mut().drain().collect();
        for (conn, bytes) in owed {
            if let Some(tx) = self.remotes.get(executor_of(conn).wrapping_sub(1)) {
                let _ = tx.send(FromOwner::Bytes(conn, bytes)).await;
            }
        }
    }

    fn disconnect(&self, conn: ConnId) {
        let mut engine = self.engine.borrow_mut();
        engine.disconnect(conn);
        // A disconnect can release others (never this one, it is gone).
        let mut sink = Vec::new();
        self.route_wakeups(&mut engine, conn, &mut sink);
        self.publish(&engine);
    }
}

/// Serves every complete request at the start of `pending` through the owner's engine,
/// encoding replies into `out` (see [`session::serve_frames`]).
fn serve_buffered(
    owner: &Owner,
    decoder: &mut RequestDecoder,
    id: ConnId,
    peer: &str,
    pending: &[u8],
    out: &mut Vec<u8>,
) -> (usize, bool) {
    let mut engine = owner.engine.borrow_mut();
    let served = session::serve_frames(
        owner.stats.metrics.as_ref(),
        &mut engine,
        decoder,
        id,
        &peer,
        pending,
        out,
        |engine, out| owner.route_wakeups(engine, id, out),
    );
    owner.publish(&engine);
    (served.used, served.close)
}

/// Accepts until `stop` is set. Polls the flag every 50 ms, so that shutdown needs no
/// wake-up connection (with `SO_REUSEPORT` one could not reach every listener).
///
/// The accept future is kept alive across those ticks: glommio's accept is an io_uring
/// operation, and dropping one that the kernel has just completed would orphan the
/// accepted connection. It is dropped only at shutdown.
async fn accept_until_stopped(
    listener: &TcpListener,
    stop: &AtomicBool,
    mut on_accept: impl FnMut(TcpStream),
) {
    let mut pending = Box::pin(listener.accept());
    loop {
        let accepted = futures_lite::future::or(async { Some(pending.as_mut().await) }, async {
            glommio::timer::sleep(Duration::from_millis(50)).await;
            None
        })
        .await;
        match accepted {
            None => {
                if stop.load(Ordering::Acquire) {
                    return;
                }
            }
            Some(result) => {
                pending = Box::pin(listener.accept());
                match result {
                    Ok(stream) => on_accept(stream),
                    Err(e) => {
                        // EMFILE and friends: back off a little instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        glommio::timer::sleep(Duration::from_millis(10)).await;
                    }
                }
                if stop.load(Ordering::Acquire) {
                    return;
                }
            }
        }
    }
}

/// Tells every connection task to flush and stop, then waits for them (up to `drain`).
async fn drain_connections(
    conns: &RefCell<HashMap<ConnId, LocalSender<ConnMsg>>>,
    live: impl Fn() -> usize,
    drain: Duration,
) {
    let senders: Vec<LocalSender<ConnMsg>> = conns.borrow_mut().drain().map(|(_, tx)| tx).collect();
    for tx in &senders {
        let _ = tx.try_send(ConnMsg::Shutdown);
    }
    drop(senders);
    let deadline = Instant::now() + drain;
    while live() > 0 && Instant::now() < deadline {
        glommio::timer::sleep(Duration::from_millis(1)).await;
    }
}

/// The engine owner (executor 0): serves its own connections and the frames the other
/// executors forward, until `stop` is set.
pub(super) async fn serve_owner(
    listener: TcpListener,
    limits: Limits,
    drain: Duration,
    stop: Arc<AtomicBool>,
    stats: Arc<StatsCells>,
    from_remotes: Vec<ConnectedReceiver<ToOwner>>,
    to_remotes: Vec<ConnectedSender<FromOwner>>,
) {
    let owner = Rc::new(Owner {
        engine: RefCell::new(Engine::new()),
        conns: RefCell::new(HashMap::new()),
        remotes: to_remotes,
        outbox: RefCell::new(HashMap::new()),
        limits,
        local_live: Cell::new(0),
        remote_live: Cell::new(0),
        stats,
    });
    let relays: Vec<_> = from_remotes
        .into_iter()
        .map(|rx| glommio::spawn_local(relay(Rc::clone(&owner), rx)).detach())
        .collect();
    let mut next = 0u64;
    accept_until_stopped(&listener, &stop, |stream| {
        next += 1;
        let id = conn_id(0, next);
        let (tx, rx) = local_channel::new_unbounded();
        owner.conns.borrow_mut().insert(id, tx);
        owner.engine.borrow_mut().connect(id);
        owner.local_live.set(owner.local_live.get() + 1);
        owner.publish(&owner.engine.borrow());
        let task_owner = Rc::clone(&owner);
        glommio::spawn_local(async move {
            run_local_conn(stream, id, &task_owner, rx).await;
            task_owner.conns.borrow_mut().remove(&id);
            task_owner
                .local_live
                .set(task_owner.local_live.get().saturating_sub(1));
            task_owner.disconnect(id);
            task_owner.flush_outbox().await;
        })
        .detach();
    })
    .await;
    drop(listener);
    // Graceful shutdown: no more accepts; every connection flushes what it owes. The
    // relays keep running until the other executors have drained theirs.
    drain_connections(
        &owner.conns,
        || owner.local_live.get() + owner.remote_live.get(),
        drain,
    )
    .await;
    for relay in relays {
        relay.cancel();
    }
    tracing::info!(
        unfinished = owner.local_live.get() + owner.remote_live.get(),
        "store server stopped"
    );
}

/// Runs the frames one accepting executor forwards through the engine.
async fn relay(owner: Rc<Owner>, rx: ConnectedReceiver<ToOwner>) {
    while let Some(msg) = rx.recv().await {
        match msg {
            ToOwner::Connect(conn) => {
                owner.engine.borrow_mut().connect(conn);
                owner.remote_live.set(owner.remote_live.get() + 1);
                owner.publish(&owner.engine.borrow());
            }
            ToOwner::Frames(conn, frames) => {
                let mut out = Vec::new();
                // Whole frames: a fresh decoder completes each at once.
                let mut decoder = RequestDecoder::new(owner.limits);
                let (_, close) =
                    serve_buffered(&owner, &mut decoder, conn, "forwarded", &frames, &mut out);
                if !out.is_empty() {
                    owner
                        .outbox
                        .borrow_mut()
                        .entry(conn)
                        .or_default()
                        .extend(out);
                }
                owner.flush_outbox().await;
                if close {
                    if let Some(tx) = owner.remotes.get(executor_of(conn).wrapping_sub(1)) {
                        let _ = tx.send(FromOwner::Close(conn)).await;
                    }
                }
            }
            ToOwner::Disconnect(conn) => {
                owner
                    .remote_live
                    .set(owner.remote_live.get().saturating_sub(1));
                owner.disconnect(conn);
                owner.flush_outbox().await;
            }
        }
    }
}

/// An accepting executor (1..threads): owns sockets, forwards frames to the owner.
#[allow(clippy::too_many_arguments)]
pub(super) async fn serve_remote(
    executor: usize,
    listener: TcpListener,
    limits: Limits,
    drain: Duration,
    stop: Arc<AtomicBool>,
    to_owner: ConnectedSender<ToOwner>,
    from_owner: ConnectedReceiver<FromOwner>,
) {
    let to_owner = Rc::new(to_owner);
    let conns: Rc<RefCell<HashMap<ConnId, LocalSender<ConnMsg>>>> = Rc::default();
    let live = Rc::new(Cell::new(0usize));
    let dispatch_conns = Rc::clone(&conns);
    let dispatcher = glommio::spawn_local(async move {
        while let Some(msg) = from_owner.recv().await {
            let (conn, msg) = match msg {
                FromOwner::Bytes(conn, bytes) => (conn, ConnMsg::Bytes(bytes)),
                FromOwner::Close(conn) => (conn, ConnMsg::Close),
            };
            if let Some(tx) = dispatch_conns.borrow().get(&conn) {
                let _ = tx.try_send(msg);
            }
        }
    })
    .detach();
    let mut next = 0u64;
    accept_until_stopped(&listener, &stop, |stream| {
        next += 1;
        let id = conn_id(executor, next);
        let (tx, rx) = local_channel::new_unbounded();
        conns.borrow_mut().insert(id, tx);
        live.set(live.get() + 1);
        let (task_conns, task_live, task_to_owner) =
            (Rc::clone(&conns), Rc::clone(&live), Rc::clone(&to_owner));
        glommio::spawn_local(async move {
            if task_to_owner.send(ToOwner::Connect(id)).await.is_ok() {
                run_remote_conn(stream, id, &task_to_owner, rx, limits).await;
                let _ = task_to_owner.send(ToOwner::Disconnect(id)).await;
            }
            task_conns.borrow_mut().remove(&id);
            task_live.set(task_live.get().saturating_sub(1));
        })
        .detach();
    })
    .await;
    drop(listener);
    drain_connections(&conns, || live.get(), drain).await;
    dispatcher.cancel();
}

enum Event {
    Read(std::io::Result<usize>),
    Msg(Option<ConnMsg>),
}

fn peer_of(stream: &TcpStream) -> String {
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(%peer, error = %e, "TCP_NODELAY failed");
    }
    peer
}

/// Serves one of the owner's own connections until it closes or the server stops.
async fn run_local_conn(
    mut stream: TcpStream,
    id: ConnId,
    owner: &Owner,
    rx: LocalReceiver<ConnMsg>,
) {
    let peer = peer_of(&stream);
    let mut input = ReadBuf::new();
    let mut decoder = RequestDecoder::new(owner.limits);
    let mut out: Vec<u8> = Vec::with_capacity(256);
    loop {
        let (used, close) =
            serve_buffered(owner, &mut decoder, id, &peer, input.pending(), &mut out);
        input.consume(used);
        // Wake-ups owed to other executors' connections leave with this batch.
        if !owner.outbox.borrow().is_empty() {
            owner.flush_outbox().await;
        }
        if close {
            let _ = stream.write_all(&out).await;
            return;
        }
        if !out.is_empty() {
            if let Err(e) = stream.write_all(&out).await {
                tracing::debug!(%peer, error = %e, "store connection write failed");
                return;
            }
            out.clear();
        }
        let event = futures_lite::future::or(
            async { Event::Read(stream.read(input.spare()).await) },
            async { Event::Msg(rx.recv().await) },
        )
        .await;
        match event {
            Event::Read(Ok(0)) => return,
            Event::Read(Ok(n)) => input.filled += n,
            Event::Read(Err(e)) => {
                tracing::debug!(%peer, error = %e, "store connection read failed");
                return;
            }
            Event::Msg(Some(ConnMsg::Wake(wake))) => out.push(wake as u8),
            Event::Msg(Some(ConnMsg::Bytes(bytes))) => out.extend_from_slice(&bytes),
            Event::Msg(Some(ConnMsg::Close | ConnMsg::Shutdown)) | Event::Msg(None) => {
                let _ = stream.write_all(&out).await;
                return;
            }
        }
    }
}

/// Serves a connection of an accepting executor: whole frames go to the owner, the
/// owner's bytes go to the socket.
async fn run_remote_conn(
    mut stream: TcpStream,
    id: ConnId,
    to_owner: &ConnectedSender<ToOwner>,
    rx: LocalReceiver<ConnMsg>,
    limits: Limits,
) {
    let peer = peer_of(&stream);
    let mut input = ReadBuf::new();
    let mut decoder = RequestDecoder::new(limits);
    loop {
        // Cut whole frames; the owner decodes them again, knowing they are complete.
        let pending = input.pending();
        let mut used = 0;
        let mut bad = false;
        while used < pending.len() {
            match decoder.decode(&pending[used..]) {
                Ok(Decoded::Complete(_, n)) => used += n,
                Ok(Decoded::Partial(_)) => break,
                Err(error) => {
                    tracing::warn!(%peer, %error, "closing store connection: bad request");
                    bad = true;
                    break;
                }
            }
        }
        if used > 0 {
            let frames = pending[..used].to_vec();
            if to_owner.send(ToOwner::Frames(id, frames)).await.is_err() {
                return;
            }
            input.consume(used);
        }
        if bad {
            // Like PyTorch: a protocol violation closes the connection.
            return;
        }
        let event = futures_lite::future::or(
            async { Event::Read(stream.read(input.spare()).await) },
            async { Event::Msg(rx.recv().await) },
        )
        .await;
        match event {
            Event::Read(Ok(0)) => return,
            Event::Read(Ok(n)) => input.filled += n,
            Event::Read(Err(e)) => {
                tracing::debug!(%peer, error = %e, "store connection read failed");
                return;
            }
            Event::Msg(Some(ConnMsg::Bytes(bytes))) => {
                if stream.write_all(&bytes).await.is_err() {
                    return;
                }
            }
            Event::Msg(Some(ConnMsg::Wake(wake))) => {
                if stream.write_all(&[wake as u8]).await.is_err() {
                    return;
                }
            }
            Event::Msg(Some(ConnMsg::Close | ConnMsg::Shutdown)) | Event::Msg(None) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_ids_carry_their_executor() {
        for executor in [0usize, 1, 7, 255] {
            for n in [1u64, 2, 1 << 40] {
                assert_eq!(executor_of(conn_id(executor, n)), executor);
            }
        }
        assert_ne!(conn_id(1, 5), conn_id(2, 5));
    }
}
