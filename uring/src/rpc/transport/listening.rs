//! [`Listening`]: a transport's listener served by an accept thread of its own, for
//! transports whose accepting blocks (shm's bootstrap over a Unix socket, ibv's queue
//! pair setup over TCP): the thread queues what it accepts for [`Transport::accept`](
//! super::Transport::accept), and dropping the transport stops it.

use std::os::fd::AsFd;
use std::sync::Arc;

use super::TransportError;
use crate::queue::Queue;

/// A listening socket, the queue its accept thread fills, and the address it listens
/// on. Dropping it closes the queue and shuts the socket down, which ends the thread's
/// `accept` at once.
pub struct Listening<T> {
    listener: Arc<dyn AsFd + Send + Sync>,
    queue: Arc<Queue<T>>,
    address: String,
}

impl<T: Send + 'static> Listening<T> {
    /// Starts the thread `name`, which runs `serve(listener, queue)`: it accepts until
    /// the queue is closed (look after each accept: [`Queue::is_closed`]) and pushes what
    /// peers should get from [`next`](Self::next).
    ///
    /// # Errors
    /// [`TransportError::Listen`] when the thread cannot start.
    pub fn start<L: AsFd + Send + Sync + 'static>(
        name: &str,
        listener: L,
        address: String,
        serve: impl FnOnce(&L, &Arc<Queue<T>>) + Send + 'static,
    ) -> Result<Listening<T>, TransportError> {
        let listener = Arc::new(listener);
        let queue = Arc::new(Queue::unbounded());
        let (thread_listener, thread_queue) = (Arc::clone(&listener), Arc::clone(&queue));
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || serve(&thread_listener, &thread_queue))
            .map_err(|source| TransportError::Listen {
                address: address.clone(),
                source,
            })?;
        Ok(Listening {
            listener,
            queue,
            address,
        })
    }

    /// What the accept thread queued next; `None` once the listener is closed.
    pub async fn next(&self) -> Option<T> {
        self.queue.pop().await
    }

    /// The address peers connect to.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The error of an accept that found the listener closed.
    pub fn closed(&self) -> TransportError {
        TransportError::Accept {
            address: self.address.clone(),
            source: std::io::Error::other("the listener is closed"),
        }
    }
}

/// [`Transport::accept`](super::Transport::accept) for a transport whose accept thread
/// queues `Result<T, E>` into `listening` (`None` before `listen`): the next accepted
/// `T`, or the error that says what failed: not listening yet (`transport` names it),
/// the accept (`E` as an I/O error through `into_io`), or a closed listener.
///
/// # Errors
/// [`TransportError::Accept`] in each of those three cases.
pub async fn accept_next<T: Send + 'static, E: Send + 'static>(
    listening: Option<&Listening<Result<T, E>>>,
    transport: &str,
    into_io: impl FnOnce(E) -> std::io::Error,
) -> Result<T, TransportError> {
    let Some(listening) = listening else {
        return Err(not_listening(transport));
    };
    match listening.next().await {
        Some(Ok(accepted)) => Ok(accepted),
        Some(Err(e)) => Err(TransportError::accepting(listening.address())(into_io(e))),
        None => Err(listening.closed()),
    }
}

/// The error of [`Transport::accept`](super::Transport::accept) on a transport that is
/// not listening (`transport` names it).
pub fn not_listening(transport: &str) -> TransportError {
    TransportError::Accept {
        address: transport.to_string(),
        source: std::io::Error::other("the transport is not listening (call listen first)"),
    }
}

impl<T> std::fmt::Debug for Listening<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listening")
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

impl<T> Drop for Listening<T> {
    fn drop(&mut self) {
        self.queue.close();
        // Wakes the accept thread: accept on a shut-down socket fails at once.
        if let Err(error) =
            rustix::net::shutdown(self.listener.as_fd(), rustix::net::Shutdown::Both)
        {
            tracing::debug!(address = %self.address, %error, "shutting a listener down failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_thread_ends_when_the_listener_is_dropped() {
        let socket = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
        let Ok(bound) = socket.local_addr() else {
            panic!("the test socket has no address");
        };
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let listening = Listening::start(
            "test-accept",
            socket,
            bound.to_string(),
            move |listener, queue| {
                loop {
                    let accepted = listener.accept();
                    if queue.is_closed() {
                        break;
                    }
                    if let Ok((_, from)) = accepted {
                        let _ = queue.push(from);
                    }
                }
                let _ = done_tx.send(());
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(listening.address(), bound.to_string());
        let peer = std::net::TcpStream::connect(bound);
        assert!(peer.is_ok());
        let got = futures_lite::future::block_on(listening.next());
        assert!(got.is_some());
        drop(listening);
        assert!(done_rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .is_ok());
    }
}
