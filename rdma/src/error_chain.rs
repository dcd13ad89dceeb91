//! [`ErrorChain`]: an error and its sources on one line, for logs and reports; and
//! [`panic_message`], the text of a panic caught around a foreign library's call.
//!
//! A leaf: it names nothing else of the crate, so every module (sys, ibv, cuda, the
//! report) can use it. It decides only how a chain is joined (the RPC agent's
//! `error_chain`) and how a panic payload reads, not what any error says.

use std::fmt;

/// Displays an error followed by each of its sources, joined with `": "` (the agent's one
/// `error_chain`: a source whose text is already there is not repeated).
pub(crate) struct ErrorChain<'a>(pub(crate) &'a (dyn std::error::Error + 'static));

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&rdzv_uring::rpc::error_chain(self.0))
    }
}

/// The text of a panic caught around a foreign library's call (cudarc panics when the
/// driver library is missing).
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}
