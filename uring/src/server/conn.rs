//! The accept loop and the per-connection task.
//!
//! The engine and the table of live connections are `Rc<RefCell<_>>` shared by the tasks
//! of one executor; no borrow is ever held across an `.await`.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_lite::{AsyncReadExt, AsyncWriteExt};
use glommio::channels::local_channel::{self, LocalReceiver, LocalSender};
use glommio::net::{TcpListener, TcpStream};
use rdzv_core::store::codec::{self, Decoded, Limits};
use rdzv_core::store::engine::Engine;
use rdzv_core::store::{ConnId, WaitResponse};

use super::StatsCells;

/// What other tasks tell a connection task.
enum ConnMsg {
    /// The engine released one of this connection's waits.
    Wake(WaitResponse),
    /// The server is shutting down: flush and close.
    Shutdown,
}

struct Ctx {
    engine: RefCell<Engine>,
    conns: RefCell<HashMap<ConnId, LocalSender<ConnMsg>>>,
    limits: Limits,
    live: Cell<usize>,
    stats: Arc<StatsCells>,
}

impl Ctx {
    /// Publishes the engine's counts for [`super::StoreServer::stats`].
    fn publish(&self, engine: &Engine) {
        self.stats
            .connections
            .store(self.live.get(), Ordering::Relaxed);
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
            } else if let Some(tx) = self.conns.borrow().get(&conn) {
                // Unbounded: never fails while the receiver lives; a closed one is gone.
                let _ = tx.try_send(ConnMsg::Wake(wake));
            }
        }
    }
}

/// Runs the accept loop until `stop` is set, then drains every connection.
pub(super) async fn serve(
    listener: TcpListener,
    limits: Limits,
    drain: Duration,
    stop: Arc<AtomicBool>,
    stats: Arc<StatsCells>,
) {
    let ctx = Rc::new(Ctx {
        engine: RefCell::new(Engine::new()),
        conns: RefCell::new(HashMap::new()),
        limits,
        live: Cell::new(0),
        stats,
    });
    let mut next_id = 0u64;
    loop {
        let accepted = listener.accept().await;
        if stop.load(Ordering::Acquire) {
            break;
        }
        let stream = match accepted {
            Ok(s) => s,
            Err(e) => {
                // EMFILE and friends: back off a little instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                glommio::timer::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        next_id += 1;
        let id = ConnId(next_id);
        let (tx, rx) = local_channel::new_unbounded();
        ctx.conns.borrow_mut().insert(id, tx);
        ctx.engine.borrow_mut().connect(id);
        ctx.live.set(ctx.live.get() + 1);
        ctx.publish(&ctx.engine.borrow());
        let task_ctx = Rc::clone(&ctx);
        glommio::spawn_local(async move {
            run_conn(stream, id, &task_ctx, rx).await;
            close_conn(&task_ctx, id);
        })
        .detach();
    }
    // Graceful shutdown: no more accepts; every connection flushes what it owes.
    let senders: Vec<LocalSender<ConnMsg>> =
        ctx.conns.borrow_mut().drain().map(|(_, tx)| tx).collect();
    for tx in &senders {
        let _ = tx.try_send(ConnMsg::Shutdown);
    }
    drop(senders);
    let deadline = Instant::now() + drain;
    while ctx.live.get() > 0 && Instant::now() < deadline {
        glommio::timer::sleep(Duration::from_millis(1)).await;
    }
    tracing::info!(unfinished = ctx.live.get(), "store server stopped");
}

fn close_conn(ctx: &Ctx, id: ConnId) {
    ctx.conns.borrow_mut().remove(&id);
    let mut engine = ctx.engine.borrow_mut();
    engine.disconnect(id);
    // A disconnect can release others (never this one, it is gone).
    let mut sink = Vec::new();
    ctx.route_wakeups(&mut engine, id, &mut sink);
    ctx.live.set(ctx.live.get().saturating_sub(1));
    ctx.publish(&engine);
}

/// Serves every complete request at the start of `pending`, encoding replies into `out`.
/// Returns how many bytes it consumed and whether the connection must be closed.
fn serve_buffered(
    ctx: &Ctx,
    id: ConnId,
    peer: &str,
    pending: &[u8],
    out: &mut Vec<u8>,
) -> (usize, bool) {
    let mut used = 0;
    let mut engine = ctx.engine.borrow_mut();
    while used < pending.len() {
        let request = match codec::decode_request(&pending[used..], &ctx.limits) {
            Ok(Decoded::Complete(request, n)) => {
                used += n;
                request
            }
            Ok(Decoded::Partial(_)) => break,
            Err(error) => {
                tracing::warn!(%peer, %error, "closing store connection: bad request");
                return (used, true);
            }
        };
        match engine.handle_request(id, request) {
            Ok(outcome) => {
                // Own wake-ups first, then the reply (the engine's polling order).
                for _ in 0..outcome.own_wakeups {
                    out.push(WaitResponse::StopWaiting as u8);
                }
                if let Some(response) = outcome.reply {
                    if let Err(error) = response.encode_into(out) {
                        // Only an inconsistent QUEUE_POP reply fails to encode, and the
                        // engine never makes one. Close rather than send garbage.
                        tracing::error!(%peer, %error, "cannot encode a reply");
                        return (used, true);
                    }
                }
            }
            Err(close) => {
                tracing::warn!(%peer, reason = %close, "closing store connection");
                return (used, true);
            }
        }
        ctx.route_wakeups(&mut engine, id, out);
    }
    (used, false)
}

enum Event {
    Read(std::io::Result<usize>),
    Msg(Option<ConnMsg>),
}

/// Serves one connection until it closes, errs, or the server stops.
async fn run_conn(mut stream: TcpStream, id: ConnId, ctx: &Ctx, rx: LocalReceiver<ConnMsg>) {
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(%peer, error = %e, "TCP_NODELAY failed");
    }
    let mut inbuf = vec![0u8; 4096];
    let mut start = 0usize;
    let mut filled = 0usize;
    let mut out: Vec<u8> = Vec::with_capacity(256);
    loop {
        // Serve every complete request that has arrived.
        let (used, close) = serve_buffered(ctx, id, &peer, &inbuf[start..filled], &mut out);
        start += used;
        if close {
            let _ = stream.write_all(&out).await;
            return;
        }
        ctx.publish(&ctx.engine.borrow());
        if start == filled {
            start = 0;
            filled = 0;
        } else if filled == inbuf.len() {
            if start > 0 {
                inbuf.copy_within(start..filled, 0);
                filled -= start;
                start = 0;
            } else {
                // A request larger than the buffer: grow with what has really arrived
                // (the decoder already checked the claimed lengths against the limits).
                let bigger = inbuf.len().saturating_mul(2);
                inbuf.resize(bigger, 0);
            }
        }
        if !out.is_empty() {
            if let Err(e) = stream.write_all(&out).await {
                tracing::debug!(%peer, error = %e, "store connection write failed");
                return;
            }
            out.clear();
        }
        let event = futures_lite::future::or(
            async { Event::Read(stream.read(&mut inbuf[filled..]).await) },
            async { Event::Msg(rx.recv().await) },
        )
        .await;
        match event {
            Event::Read(Ok(0)) => return,
            Event::Read(Ok(n)) => filled += n,
            Event::Read(Err(e)) => {
                tracing::debug!(%peer, error = %e, "store connection read failed");
                return;
            }
            Event::Msg(Some(ConnMsg::Wake(wake))) => out.push(wake as u8),
            Event::Msg(Some(ConnMsg::Shutdown)) | Event::Msg(None) => {
                let _ = stream.write_all(&out).await;
                return;
            }
        }
    }
}
