//! A lane's sending side: a caller's request from the caller's thread, a handler's
//! response from the thread that ran it, and the frames the pipe's protocol owes the
//! peer (acks, goodbyes), each under the lane's send lock with its mpt stripes.

use std::sync::Arc;

use rdzv_core::negotiate::Role;
use rdzv_core::rpc::frame::FrameKind;
use rdzv_core::rpc::pipe::{Refusal, Transmit};

use super::{Lane, Machine, SendFailure};
use crate::rpc::calls::Pending;
use crate::rpc::error::{CallError, PipeFailure, TransportError};
use crate::rpc::mailbox::Call;
use crate::rpc::message::Message;
use crate::rpc::mpt::LanesError;
use crate::rpc::outgoing::{response_frame, sent_bytes, tensor_frame};
use crate::rpc::recycle;
use crate::rpc::tensors::{FrameExports, Streamed};
use crate::rpc::transport::OwnedFrame;

impl Lane {
    /// Sends what the protocol owes the peer (acks, a goodbye). A lane that cannot send
    /// any more is ending: its end releases what the acks would have.
    pub(super) fn flush(&self) {
        let transmits = self.machine().transmits();
        self.transmit(transmits);
    }

    /// Sends frames the protocol owes the peer (polled already).
    pub(super) fn transmit(&self, transmits: Vec<Transmit>) {
        for transmit in transmits {
            let (kind, message_id) = transmit.frame();
            let _ = self.send(OwnedFrame::empty(kind, message_id));
        }
    }

    /// Sends a call's request on this lane, from the caller's thread.
    /// `me`: this worker's name, for the error if the calls table is closed.
    pub(crate) fn call(self: &Arc<Self>, me: &str, call: Call) {
        let Call {
            message_id,
            peer,
            handler,
            message,
            timeout,
            completion,
        } = call;
        let pending = Pending {
            peer,
            handler: handler.clone(),
            pipe: self.id,
            sent_bytes: 0,
            timeout,
            completion,
        };
        if let Err(pending) = self.calls.register(message_id, pending) {
            let name = me.to_string();
            self.calls
                .complete(&pending.completion, Err(CallError::ShutDown { name }));
            return;
        }
        self.send_request(message_id, handler, message);
    }

    /// Sends the request of call `message_id`, already pending on this lane (a call
    /// that timed out meanwhile is skipped).
    pub(crate) fn send_request(&self, message_id: u64, handler: String, message: Message) {
        let mut frame = OwnedFrame {
            handler,
            metadata: message.metadata,
            payload: message.payload,
            ..OwnedFrame::empty(FrameKind::Request, message_id)
        };
        let mut exports = FrameExports::default();
        let built = tensor_frame(
            &self.framer,
            &mut frame,
            &mut exports,
            message.tensors,
            &self.peer,
            (Role::Connector, &self.negotiated, self.streams()),
            false,
        );
        if let Err(e) = built {
            // Nothing was sent: this call alone fails.
            if let Some(pending) = self.calls.take(message_id) {
                self.calls.complete(&pending.completion, Err(e));
            }
            return;
        }
        self.calls.set_sent(message_id, sent_bytes(&frame));
        let streamed = exports.take_streamed();
        // What it lends is held until the reply arrives or the lane ends.
        let lent = (!exports.is_empty()).then_some(exports);
        let accepted = match &mut *self.machine() {
            Machine::Client(pipe) => pipe.send_request(message_id, lent).map_err(|r| r.reason),
            Machine::Inbound(_) => Err(Refusal::NotServing),
        };
        if let Err(refusal) = accepted {
            // Never sent: this call alone fails (what it would have lent is dropped).
            if let Some(pending) = self.calls.take(message_id) {
                let error = CallError::PipeBroken {
                    peer: self.peer.clone(),
                    reason: PipeFailure::protocol(refusal),
                };
                self.calls.fail(pending, error);
            }
            return;
        }
        match self.send_with(frame, streamed) {
            Ok(_) => {}
            // Fault injection: this request alone fails, as if it had not been sent.
            Err(SendFailure::Injected { handler }) => {
                if let Machine::Client(pipe) = &mut *self.machine() {
                    drop(pipe.unsent(message_id));
                }
                if let Some(pending) = self.calls.take(message_id) {
                    let error = CallError::InjectedFault {
                        peer: pending.peer.clone(),
                        handler,
                    };
                    self.calls.fail(pending, error);
                }
            }
            Err(SendFailure::Broken(reason)) => self.end(reason),
        }
    }

    /// Sends the response to request `message_id` of this inbound lane.
    pub(crate) fn respond(&self, message_id: u64, result: Result<Message, String>) {
        let (frame, mut exports) = response_frame(
            &self.framer,
            message_id,
            result,
            &self.peer,
            (Role::Listener, &self.negotiated, self.streams()),
        );
        let streamed = exports.take_streamed();
        // What it lends is held until the caller's ack, or the lane's end.
        let lent = (!exports.is_empty()).then_some(exports);
        let accepted = match &mut *self.machine() {
            Machine::Inbound(pipe) => pipe.respond(message_id, lent).map_err(|r| r.reason),
            Machine::Client(_) => Err(Refusal::NotServing),
        };
        if let Err(refusal) = accepted {
            // The lane ended (or said goodbye) while the handler ran: nobody waits for
            // the response here, and what it would have lent was never seen.
            tracing::debug!(peer = %self.peer, message_id, %refusal, "an RPC response is dropped");
            return;
        }
        let sent = self.send_with(frame, streamed);
        if let Err(reason) = sent {
            tracing::debug!(peer = %self.peer, %reason, "an RPC response could not be sent");
            self.stop();
        }
    }

    /// Sends a goodbye (graceful shutdown); failures are expected then and ignored.
    pub(crate) fn goodbye(&self) {
        match &mut *self.machine() {
            Machine::Client(pipe) => pipe.goodbye(),
            Machine::Inbound(pipe) => pipe.goodbye(),
        }
        self.flush();
    }

    pub(super) fn send(&self, frame: OwnedFrame) -> Result<u64, SendFailure> {
        self.send_with(frame, Vec::new())
    }

    /// Sends `frame` and then, under the same lock, the stripes of its `streamed` (mpt)
    /// tensors. The buffers the transport does not keep go back to the recycle pool.
    pub(super) fn send_with(
        &self,
        frame: OwnedFrame,
        streamed: Streamed,
    ) -> Result<u64, SendFailure> {
        let mut sender = self.sender.lock().unwrap_or_else(|p| p.into_inner());
        let (sent, back) = sender.send_owned(frame).map_err(|e| match e {
            TransportError::InjectedFault { handler } => SendFailure::Injected { handler },
            other => SendFailure::Broken(PipeFailure::transport(other)),
        })?;
        if streamed.is_empty() {
            drop(sender);
            if let Some(back) = back {
                recycle::give_all(back.tensor_data);
            }
            return Ok(sent);
        }
        let pushed = match self.mpt.get() {
            Some(mpt) => mpt.push(&streamed),
            None => Err(LanesError::NoLanes),
        };
        drop(sender);
        if let Some(back) = back {
            recycle::give_all(back.tensor_data);
        }
        recycle::give_all(streamed.into_iter().map(|(_, data)| data).collect());
        pushed
            .map(|()| sent)
            .map_err(|e| SendFailure::Broken(PipeFailure::local(e)))
    }
}
