//! [`ErrorChain`]: an error and its sources on one line, for logs and reports.
//!
//! A leaf: it names nothing else of the crate, so every module (sys, ibv, cuda, the
//! report) can use it. It decides only how a chain is joined (the RPC agent's
//! `error_chain`), not what any error says.

use std::fmt;

/// Displays an error followed by each of its sources, joined with `": "` (the agent's one
/// `error_chain`: a source whose text is already there is not repeated).
pub(crate) struct ErrorChain<'a>(pub(crate) &'a (dyn std::error::Error + 'static));

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&rdzv_uring::rpc::error_chain(self.0))
    }
}
