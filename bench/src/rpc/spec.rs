//! What one run is made of: a (transport, channels) [`Pair`], the two workers' names and
//! the echo handler's. The session, the timing and the viability checks all name these;
//! this leaf decides nothing about how a run goes.

use std::fmt;

use rdzv_core::negotiate::{ChannelKind, TransportKind};

/// The worker names: rank 0 measures, rank 1 serves.
pub(super) const NAMES: [&str; 2] = ["bench-rpc-0", "bench-rpc-1"];
/// The handler both sides register: it returns what it is given.
pub(super) const ECHO: &str = "echo";

/// The channels a pair's agents offer: the agent's own default list (what users get
/// from `init_rpc` without a `channels` option), or one channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Channels {
    /// The agent's default list: large CPU tensors over xth or cma where viable, else
    /// over mpt with tcp, else inline (`basic`).
    Default,
    /// Only this channel.
    Only(ChannelKind),
}

impl Channels {
    /// The name of [`Channels::Default`] in plans and skipped rows.
    pub(super) const DEFAULT_NAME: &'static str = "default";

    /// `default`, or the channel's name.
    pub(super) fn name(self) -> &'static str {
        match self {
            Channels::Default => Self::DEFAULT_NAME,
            Channels::Only(kind) => kind.name(),
        }
    }

    /// The agents' `channels` option.
    pub(super) fn option(self) -> Option<Vec<String>> {
        match self {
            Channels::Default => None,
            Channels::Only(kind) => Some(vec![kind.name().to_string()]),
        }
    }
}

impl fmt::Display for Channels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A transport and the channels its tensors may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Pair {
    pub(super) transport: TransportKind,
    pub(super) channel: Channels,
}

impl fmt::Display for Pair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.transport, self.channel)
    }
}
