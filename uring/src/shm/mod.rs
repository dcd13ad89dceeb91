//! Shared-memory rings: byte messages between two processes on one host through
//! shared-memory rings, TensorPipe's design (`reference/tensorpipe.md` §2.2) with a
//! wake-up scheme that does not burn a core. The RPC agent's `shm` transport
//! (`rpc::shm_transport`) runs on them.
//!
//! - **Segments** (`segment`): each side creates its *inbox*, a sealed memfd (2 MiB of
//!   ring by default) with a header page of atomics, and maps the peer's inbox as its
//!   outbox. The mapping itself is `crate::sys::shm` (the crate's `unsafe` code).
//! - **Ring** (`ring`): a single-producer single-consumer ring of length-prefixed
//!   records that wrap; messages larger than the ring are cut into fragments and
//!   reassembled. Everything read from shared memory is untrusted and bounds-checked: a
//!   buggy or hostile peer gets [`ShmError::Corrupted`], never an out-of-bounds access.
//! - **Bootstrap** (`bootstrap`): a UNIX `SOCK_SEQPACKET` socket (abstract name or
//!   path) carries one hello per side with the memfd and two eventfds (`SCM_RIGHTS`),
//!   then a verdict. Afterwards the socket is kept only to see the peer die.
//! - **Connection** (`connection`): blocking `send` / `recv` / `recv_into`, non-blocking
//!   `try_send` / `try_recv`. A waiting side spins briefly, then announces that it sleeps
//!   and waits on its eventfd and the socket; the other side signals only when that
//!   announcement is up, so a busy pair makes no syscall per message.
//! - **Viability** (`viability`): boot id plus network namespace, and a test
//!   allocation; the domain descriptor `shm:<boot_id>_<netns>` for
//!   `rdzv_core::negotiate`.
//!
//! ```
//! use rdzv_uring::shm::{ShmAddr, ShmConnection, ShmListener, ShmOptions};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let listener = ShmListener::bind_unnamed(ShmOptions::default())?;
//! let addr = listener.local_addr().clone();
//! let client = std::thread::spawn(move || -> Result<Vec<u8>, rdzv_uring::shm::ShmError> {
//!     let mut conn = ShmConnection::connect(&addr, ShmOptions::default())?;
//!     conn.send(b"ping")?;
//!     conn.recv()
//! });
//! let mut conn = listener.accept()?;
//! assert_eq!(conn.recv()?, b"ping");
//! conn.send(b"pong")?;
//! assert_eq!(client.join().expect("client thread")?, b"pong");
//! # Ok(())
//! # }
//! ```
//!
//! Not here: transport negotiation (`rdzv_core::negotiate`), RPC framing, and large
//! tensors, which go through a `cma` channel (`process_vm_readv`) rather than the ring.
#![deny(unsafe_code)]

mod bootstrap;
mod connection;
mod error;
mod ring;
mod segment;
mod viability;

pub use bootstrap::ShmAddr;
pub use connection::{ShmConnection, ShmListener, ShmOptions, ShmReceiver, ShmSender};
pub use error::{NotViable, ShmError};
pub use viability::{viability, DomainDescriptor, HostIdentity};
