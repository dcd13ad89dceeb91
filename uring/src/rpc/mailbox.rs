//! What user threads and pool threads ask of the I/O thread: a call whose pipe is not
//! open yet, a reset, a close. Many threads push; the I/O thread takes them in batches.

use std::sync::Arc;

use rdzv_core::rpc::timeouts::RpcTimeout;

use super::message::{Completion, Message};

/// A call on its way to the I/O thread.
pub(crate) struct Call {
    pub message_id: u64,
    pub peer: String,
    pub handler: String,
    pub message: Message,
    pub timeout: RpcTimeout,
    pub completion: Arc<Completion>,
}

/// What user threads and pool threads ask of the I/O thread.
pub(crate) enum Command {
    /// Send a request.
    Call(Call),
    /// Close every pipe; calls on them fail, later calls open new ones.
    ResetPipes,
    /// Close everything and stop; `goodbye` sends goodbye frames first.
    Close { goodbye: bool },
}

/// The commands for the I/O thread: many threads push, its task takes them in batches.
pub(crate) type Mailbox = crate::queue::Queue<Command>;
