//! Which transport and which channels two peers use for a pipe: TensorPipe's brochure /
//! answer handshake, as a pure function of both sides' offers.
//!
//! The rules are TensorPipe's (`core/pipe_impl.cc`, see `reference/tensorpipe.md` §1.2):
//!
//! 1. The **connector** sends a [`Brochure`]: for every transport it offers, a *domain
//!    descriptor*; for every channel, a descriptor per device type. Descriptors are opaque
//!    strings and two endpoints can use a kind only if their descriptors for it are
//!    **equal** (TensorPipe's default `canCommunicateWithRemote`). For shm it is the boot
//!    id plus the network namespace, so two processes on different hosts never agree.
//! 2. The **listener** answers ([`answer_brochure`]):
//!    * transport: it walks *its own* transports by descending priority and takes the
//!      first one the connector also advertised with an equal descriptor
//!      (`selectTransport`). No such transport is an error
//!      ([`NegotiateError::NoCommonTransport`]) naming both sides' offers;
//!    * channels: for every `(listener device type, connector device type)` pair it walks
//!      *its own* channels by descending priority and takes the first one that handles
//!      that pair ([`ChannelKind::handles`]) and for which its descriptor for its device
//!      type equals the connector's descriptor for the connector's device type
//!      (`selectChannels`). A pair no channel can serve is left without one; sending a
//!      tensor between such devices is then impossible, which the caller reports when it
//!      happens (as TensorPipe does).
//!
//!    The [`BrochureAnswer`] carries the choices and the listener's own channel
//!    descriptors.
//! 3. The **connector** accepts the answer ([`accept_answer`]): it checks that it offered
//!    the chosen transport with the same descriptor, then recomputes the channel choice
//!    with *its own* priorities against the listener's descriptors and refuses an answer
//!    that differs ("Inconsistent channel selection", as TensorPipe's client does). Both
//!    sides therefore need the same priority order on the channels they share: PyTorch's
//!    defaults, or the same `channels` option.
//!
//! Both sides end up with the same role-neutral [`Negotiated`] value.
//!
//! Differences from TensorPipe, on purpose: channels are chosen per *device type* pair,
//! not per device pair (TensorPipe keys descriptors by `Device{type, index}`), and every
//! kind's compatibility is descriptor equality (TensorPipe's `cuda_ipc` instead parses
//! its descriptors and requires different processes with peer access; a runtime must
//! fold what has to match into the descriptor string and leave `cuda_ipc` out where it
//! cannot work). Names are rdzv's: `tcp` for TensorPipe's `uv` and `mpt` for `mpt_uv`
//! (both old names parse).
//!
//! Nothing here allocates: offers and brochures are fixed-size tables borrowing their
//! descriptors, so negotiation works without `alloc`. This module does not discover which
//! kinds are viable, compute descriptors, listen, connect or open the extra
//! connections the chosen kinds need; the runtime does.
//!
//! ```
//! use rdzv_core::device::DeviceType;
//! use rdzv_core::negotiate::*;
//!
//! # fn main() -> Result<(), String> {
//! // Both sides: PyTorch's default priorities, restricted to what is viable here.
//! let build = |shm: &'static str| -> Result<Offer<'static>, OfferError> {
//!     let mut offer = Offer::new();
//!     for (kind, priority) in Ranking::<TransportKind>::defaults().iter() {
//!         match kind {
//!             TransportKind::Shm => offer.add_transport(kind, priority, shm)?,
//!             TransportKind::Tcp => offer.add_transport(kind, priority, "tcp:*")?,
//!             _ => {} // no InfiniBand here
//!         }
//!     }
//!     let basic = ChannelKind::Basic;
//!     offer.add_channel(basic, basic.default_priority(), DeviceDescriptors::cpu("any"))?;
//!     Ok(offer)
//! };
//! let listener = build("shm:boot-1_4026531992").map_err(|e| e.to_string())?;
//! let connector = build("shm:boot-2_4026531992").map_err(|e| e.to_string())?;
//!
//! let brochure = connector.brochure(); // sent by the connector
//! let answer = answer_brochure(&listener, &brochure).map_err(|e| e.to_string())?;
//! let agreed = accept_answer(&connector, &answer).map_err(|e| e.to_string())?;
//! assert_eq!(agreed, answer.negotiated());
//! assert_eq!(agreed.transport, TransportKind::Tcp); // different hosts: no shm
//! assert_eq!(
//!     agreed.channel_for(Role::Connector, DeviceType::Cpu, DeviceType::Cpu),
//!     Some(ChannelKind::Basic)
//! );
//! # Ok(())
//! # }
//! ```

mod kind;
mod offer;
#[cfg(feature = "alloc")]
mod rank;

pub use kind::{
    ChannelKind, Kind, KindClass, OfferError, ParseKindError, Ranking, TransportKind, MAX_KINDS,
};
pub use offer::{Brochure, DeviceDescriptors, Offer, TransportSet};
#[cfg(feature = "alloc")]
pub use rank::{rank, RankError, Ranked, Refusable, Refused, MPT_NEEDS_TCP};

use core::fmt;

use crate::device::DeviceType;

/// Which end of a pipe a process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// The side that accepted the connection and answers the brochure.
    Listener,
    /// The side that connected and sent the brochure.
    Connector,
}

/// The transport the listener chose, with its own domain descriptor for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct TransportChoice<'a> {
    /// The transport.
    pub kind: TransportKind,
    /// The listener's domain descriptor for it.
    pub domain_descriptor: &'a str,
}

/// One channel decision: tensors between a listener device of type `listener` and a
/// connector device of type `connector` (either direction) travel over `channel`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChannelChoice {
    /// The device type on the listener's side.
    pub listener: DeviceType,
    /// The device type on the connector's side.
    pub connector: DeviceType,
    /// The channel.
    pub channel: ChannelKind,
}

/// The channel chosen for every `(listener device type, connector device type)` pair.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
pub struct ChannelTable {
    by_pair: [[Option<ChannelKind>; DeviceType::COUNT]; DeviceType::COUNT],
}

impl ChannelTable {
    /// No channel for any pair.
    pub const fn new() -> Self {
        ChannelTable {
            by_pair: [[None; DeviceType::COUNT]; DeviceType::COUNT],
        }
    }

    /// The channel between a listener device of type `listener` and a connector device of
    /// type `connector`.
    pub fn get(&self, listener: DeviceType, connector: DeviceType) -> Option<ChannelKind> {
        self.by_pair
            .get(listener.index())
            .and_then(|row| row.get(connector.index()))
            .copied()
            .flatten()
    }

    fn set(&mut self, listener: DeviceType, connector: DeviceType, channel: Option<ChannelKind>) {
        if let Some(cell) = self
            .by_pair
            .get_mut(listener.index())
            .and_then(|row| row.get_mut(connector.index()))
        {
            *cell = channel;
        }
    }

    /// Every pair that has a channel, listener type major.
    pub fn iter(&self) -> impl Iterator<Item = ChannelChoice> + '_ {
        DeviceType::ALL.into_iter().flat_map(move |listener| {
            DeviceType::ALL.into_iter().filter_map(move |connector| {
                self.get(listener, connector).map(|channel| ChannelChoice {
                    listener,
                    connector,
                    channel,
                })
            })
        })
    }
}

/// The listener's reply to a [`Brochure`] (TensorPipe's `BrochureAnswer`, without the
/// address and registration ids, which the runtime adds).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct BrochureAnswer<'a> {
    /// The chosen transport.
    #[serde(borrow)]
    pub transport: TransportChoice<'a>,
    /// The chosen channels.
    pub channels: ChannelTable,
    /// The listener's descriptors for every channel it offers (and no transports), so
    /// that the connector can check the choice against its own priorities.
    #[serde(borrow)]
    pub listener_channels: Brochure<'a>,
}

impl BrochureAnswer<'_> {
    /// The decision this answer states.
    pub fn negotiated(&self) -> Negotiated {
        Negotiated {
            transport: self.transport.kind,
            channels: self.channels,
        }
    }
}

/// What both ends of a pipe agreed on. Role-neutral: both sides hold the same value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Negotiated {
    /// The transport for the pipe's control messages and payloads.
    pub transport: TransportKind,
    /// The channel per device-type pair.
    pub channels: ChannelTable,
}

impl Negotiated {
    /// The channel that a side playing `role` uses between its `local` device type and the
    /// peer's `remote` device type.
    pub fn channel_for(
        &self,
        role: Role,
        local: DeviceType,
        remote: DeviceType,
    ) -> Option<ChannelKind> {
        match role {
            Role::Listener => self.channels.get(local, remote),
            Role::Connector => self.channels.get(remote, local),
        }
    }

    /// The channel whose bytes move a tensor between a `local` and a `remote` device of
    /// these types on this pipe: the one negotiated for the pair, except that
    /// `cuda_basic` stages through host memory and sends the staged bytes over the
    /// pipe's CPU ↔ CPU channel (`basic`, the pipe's own frames, when none was
    /// negotiated). `None` when no channel serves the pair.
    pub fn carrier_for(
        &self,
        role: Role,
        local: DeviceType,
        remote: DeviceType,
    ) -> Option<ChannelKind> {
        match self.channel_for(role, local, remote)? {
            ChannelKind::CudaBasic => Some(
                self.channel_for(role, DeviceType::Cpu, DeviceType::Cpu)
                    .unwrap_or(ChannelKind::Basic),
            ),
            other => Some(other),
        }
    }

    /// The channels used for at least one pair, each once, in [`ChannelKind::ALL`] order.
    pub fn channels_in_use(&self) -> impl Iterator<Item = ChannelKind> + '_ {
        ChannelKind::ALL
            .into_iter()
            .filter(move |&c| self.channels.iter().any(|choice| choice.channel == c))
    }
}

/// Why a handshake failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum NegotiateError {
    /// No transport is offered by both sides with equal domain descriptors.
    NoCommonTransport {
        /// The listener's transports.
        listener: TransportSet,
        /// The connector's transports.
        connector: TransportSet,
        /// Transports both offer, with different domain descriptors.
        mismatched: TransportSet,
    },
    /// The answer names a transport this side did not offer, or offered with a different
    /// domain descriptor.
    TransportMismatch {
        /// The transport the listener chose.
        transport: TransportKind,
    },
    /// With its own priorities the connector would choose a different channel for a pair.
    InconsistentChannelSelection {
        /// The listener's device type.
        listener_device: DeviceType,
        /// The connector's device type.
        connector_device: DeviceType,
        /// What the listener chose.
        listener_choice: Option<ChannelKind>,
        /// What the connector would choose.
        connector_choice: Option<ChannelKind>,
    },
}

struct ChoiceName(Option<ChannelKind>);

impl fmt::Display for ChoiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.map_or("no channel", ChannelKind::name))
    }
}

impl fmt::Display for NegotiateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NegotiateError::NoCommonTransport {
                listener,
                connector,
                mismatched,
            } => {
                write!(
                    f,
                    "No common transport: the listener offers {listener} and the connector \
                     offers {connector}"
                )?;
                if !mismatched.is_empty() {
                    write!(
                        f,
                        "; both offer {mismatched} but with different domain descriptors \
                         (e.g. different hosts for shm)"
                    )?;
                }
                Ok(())
            }
            NegotiateError::TransportMismatch { transport } => write!(
                f,
                "The two endpoints disagree on whether transport {transport} can be used to \
                 communicate"
            ),
            NegotiateError::InconsistentChannelSelection {
                listener_device,
                connector_device,
                listener_choice,
                connector_choice,
            } => write!(
                f,
                "Inconsistent channel selection: between {listener_device} (listener) and \
                 {connector_device} (connector) devices the listener chose {} but the \
                 connector's priorities choose {}; both sides must rank shared channels in \
                 the same order",
                ChoiceName(*listener_choice),
                ChoiceName(*connector_choice)
            ),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for NegotiateError {}

/// The listener's transport choice: its own transports by descending priority, the first
/// the connector advertised with an equal domain descriptor.
pub fn select_transport<'a>(
    listener: &Offer<'a>,
    connector: &Brochure<'_>,
) -> Result<TransportChoice<'a>, NegotiateError> {
    listener
        .transports()
        .find(|&(kind, _, descriptor)| connector.transport(kind) == Some(descriptor))
        .map(|(kind, _, domain_descriptor)| TransportChoice {
            kind,
            domain_descriptor,
        })
        .ok_or_else(|| {
            let listener_set: TransportSet = listener.transports().map(|(k, _, _)| k).collect();
            let connector_set = connector.transport_set();
            NegotiateError::NoCommonTransport {
                listener: listener_set,
                connector: connector_set,
                mismatched: listener_set
                    .iter()
                    .filter(|&k| connector_set.contains(k))
                    .collect(),
            }
        })
}

/// The channel choice made by the side holding `local`, playing `role`, against the
/// other side's channel descriptors: for every (local type, remote type) pair, the first
/// of `local`'s channels by descending priority that handles the pair and whose local
/// descriptor equals the remote one.
pub fn select_channels(local: &Offer<'_>, remote: &Brochure<'_>, role: Role) -> ChannelTable {
    let remote = remote.channel_table();
    let mut table = ChannelTable::new();
    for local_type in DeviceType::ALL {
        for remote_type in DeviceType::ALL {
            let chosen = local
                .channels()
                .find(|&(kind, _, descriptors)| {
                    let theirs = remote
                        .get(kind.index())
                        .copied()
                        .flatten()
                        .and_then(|d| d.get(remote_type));
                    kind.handles(local_type, remote_type)
                        && descriptors.get(local_type).is_some()
                        && descriptors.get(local_type) == theirs
                })
                .map(|(kind, _, _)| kind);
            match role {
                Role::Listener => table.set(local_type, remote_type, chosen),
                Role::Connector => table.set(remote_type, local_type, chosen),
            }
        }
    }
    table
}

/// The listener's side of the handshake: answers the connector's `brochure` with
/// `listener`'s priorities.
pub fn answer_brochure<'a>(
    listener: &Offer<'a>,
    brochure: &Brochure<'_>,
) -> Result<BrochureAnswer<'a>, NegotiateError> {
    let transport = select_transport(listener, brochure)?;
    Ok(BrochureAnswer {
        transport,
        channels: select_channels(listener, brochure, Role::Listener),
        listener_channels: listener
            .channels()
            .fold(Brochure::new(), |b, (kind, _, descriptors)| {
                b.with_channel(kind, descriptors)
            }),
    })
}

/// The connector's side of the handshake: checks the listener's `answer` against
/// `connector` (the offer whose brochure was sent) and returns the agreed decision.
pub fn accept_answer(
    connector: &Offer<'_>,
    answer: &BrochureAnswer<'_>,
) -> Result<Negotiated, NegotiateError> {
    let transport = answer.transport.kind;
    match connector.transport(transport) {
        Some((_, descriptor)) if descriptor == answer.transport.domain_descriptor => {}
        _ => return Err(NegotiateError::TransportMismatch { transport }),
    }
    let ours = select_channels(connector, &answer.listener_channels, Role::Connector);
    for listener_device in DeviceType::ALL {
        for connector_device in DeviceType::ALL {
            let listener_choice = answer.channels.get(listener_device, connector_device);
            let connector_choice = ours.get(listener_device, connector_device);
            if listener_choice != connector_choice {
                return Err(NegotiateError::InconsistentChannelSelection {
                    listener_device,
                    connector_device,
                    listener_choice,
                    connector_choice,
                });
            }
        }
    }
    Ok(answer.negotiated())
}

#[cfg(test)]
mod tests;
