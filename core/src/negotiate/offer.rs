//! What each side brings to the handshake: its [`Offer`] (kinds, priorities and
//! domain descriptors; kept locally) and the [`Brochure`] it sends (the same without
//! priorities, as in TensorPipe).

use core::fmt;

use super::kind::{ChannelKind, KindClass, OfferError, TransportKind};
use crate::device::DeviceType;

/// A channel's domain descriptor for each device type it is offered for.
///
/// Two endpoints can use the channel between a local device of type `a` and a remote
/// device of type `b` only if the local descriptor for `a` equals the remote descriptor
/// for `b` (and the channel handles that pair, see [`ChannelKind::handles`]).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
pub struct DeviceDescriptors<'a> {
    #[serde(borrow)]
    by_type: [Option<&'a str>; DeviceType::COUNT],
}

impl<'a> DeviceDescriptors<'a> {
    /// No device types.
    pub const fn none() -> Self {
        DeviceDescriptors {
            by_type: [None; DeviceType::COUNT],
        }
    }

    /// Only CPU memory, with this descriptor.
    pub const fn cpu(descriptor: &'a str) -> Self {
        Self::none().with(DeviceType::Cpu, descriptor)
    }

    /// Only CUDA memory, with this descriptor.
    pub const fn cuda(descriptor: &'a str) -> Self {
        Self::none().with(DeviceType::Cuda, descriptor)
    }

    /// This set plus (or with a replaced) descriptor for `device`.
    pub const fn with(mut self, device: DeviceType, descriptor: &'a str) -> Self {
        self.by_type[device.index()] = Some(descriptor);
        self
    }

    /// The descriptor for `device`, if the channel is offered for it.
    pub fn get(&self, device: DeviceType) -> Option<&'a str> {
        self.by_type.get(device.index()).copied().flatten()
    }

    /// `(device type, descriptor)` for every device type offered.
    pub fn iter(&self) -> impl Iterator<Item = (DeviceType, &'a str)> + '_ {
        DeviceType::ALL
            .into_iter()
            .filter_map(|t| self.get(t).map(|d| (t, d)))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TransportEntry<'a> {
    priority: i64,
    descriptor: &'a str,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ChannelEntry<'a> {
    priority: i64,
    descriptors: DeviceDescriptors<'a>,
}

/// One side's viable transports and channels, each with its priority (higher wins) and
/// domain descriptor(s). Descriptors are opaque strings borrowed from the caller, e.g.
/// `shm:<boot_id>_<netns inode>` for shm, `tcp:*` for TCP.
///
/// A listener's offer must list only the transports it has a listening address for
/// (TensorPipe's first condition in `selectTransport`). Each kind appears at most once
/// and no two kinds of one class share a priority.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Offer<'a> {
    transports: [Option<TransportEntry<'a>>; TransportKind::COUNT],
    channels: [Option<ChannelEntry<'a>>; ChannelKind::COUNT],
}

impl<'a> Offer<'a> {
    /// Nothing offered.
    pub const fn new() -> Self {
        Offer {
            transports: [None; TransportKind::COUNT],
            channels: [None; ChannelKind::COUNT],
        }
    }

    /// Offers `kind` with this priority and domain descriptor.
    pub fn add_transport(
        &mut self,
        kind: TransportKind,
        priority: i64,
        domain_descriptor: &'a str,
    ) -> Result<(), OfferError> {
        if self.transport(kind).is_some() {
            return Err(OfferError::Duplicate {
                class: KindClass::Transport,
                name: kind.name(),
            });
        }
        if let Some((first, _, _)) = self.transports().find(|&(_, p, _)| p == priority) {
            return Err(OfferError::PriorityClash {
                class: KindClass::Transport,
                priority,
                first: first.name(),
                second: kind.name(),
            });
        }
        if let Some(slot) = self.transports.get_mut(kind.index()) {
            *slot = Some(TransportEntry {
                priority,
                descriptor: domain_descriptor,
            });
        }
        Ok(())
    }

    /// Offers `kind` with this priority, for the device types `descriptors` names.
    pub fn add_channel(
        &mut self,
        kind: ChannelKind,
        priority: i64,
        descriptors: DeviceDescriptors<'a>,
    ) -> Result<(), OfferError> {
        if let Some((device, _)) = descriptors
            .iter()
            .find(|(t, _)| !kind.device_types().contains(t))
        {
            return Err(OfferError::UnsupportedDevice {
                channel: kind,
                device,
            });
        }
        if self.channel(kind).is_some() {
            return Err(OfferError::Duplicate {
                class: KindClass::Channel,
                name: kind.name(),
            });
        }
        if let Some((first, _, _)) = self.channels().find(|&(_, p, _)| p == priority) {
            return Err(OfferError::PriorityClash {
                class: KindClass::Channel,
                priority,
                first: first.name(),
                second: kind.name(),
            });
        }
        if let Some(slot) = self.channels.get_mut(kind.index()) {
            *slot = Some(ChannelEntry {
                priority,
                descriptors,
            });
        }
        Ok(())
    }

    /// `kind`'s priority and domain descriptor, if offered.
    pub fn transport(&self, kind: TransportKind) -> Option<(i64, &'a str)> {
        self.transports
            .get(kind.index())
            .copied()
            .flatten()
            .map(|e| (e.priority, e.descriptor))
    }

    /// `kind`'s priority and device descriptors, if offered.
    pub fn channel(&self, kind: ChannelKind) -> Option<(i64, DeviceDescriptors<'a>)> {
        self.channels
            .get(kind.index())
            .copied()
            .flatten()
            .map(|e| (e.priority, e.descriptors))
    }

    /// `(transport, priority, descriptor)` for every transport offered, highest priority
    /// first.
    pub fn transports(&self) -> impl Iterator<Item = (TransportKind, i64, &'a str)> {
        let mut all: heapless::Vec<(TransportKind, i64, &'a str), { TransportKind::COUNT }> =
            heapless::Vec::new();
        for kind in TransportKind::ALL {
            if let Some((p, d)) = self.transport(kind) {
                // Cannot fail: one entry per kind.
                let _ = all.push((kind, p, d));
            }
        }
        all.sort_unstable_by_key(|e| core::cmp::Reverse(e.1));
        all.into_iter()
    }

    /// `(channel, priority, descriptors)` for every channel offered, highest priority
    /// first.
    pub fn channels(&self) -> impl Iterator<Item = (ChannelKind, i64, DeviceDescriptors<'a>)> {
        let mut all: heapless::Vec<
            (ChannelKind, i64, DeviceDescriptors<'a>),
            { ChannelKind::COUNT },
        > = heapless::Vec::new();
        for kind in ChannelKind::ALL {
            if let Some((p, d)) = self.channel(kind) {
                // Cannot fail: one entry per kind.
                let _ = all.push((kind, p, d));
            }
        }
        all.sort_unstable_by_key(|e| core::cmp::Reverse(e.1));
        all.into_iter()
    }

    /// What this side advertises: its kinds and descriptors, without priorities.
    pub fn brochure(&self) -> Brochure<'a> {
        let mut brochure = Brochure::new();
        for (kind, _, descriptor) in self.transports() {
            brochure = brochure.with_transport(kind, descriptor);
        }
        for (kind, _, descriptors) in self.channels() {
            brochure = brochure.with_channel(kind, descriptors);
        }
        brochure
    }
}

/// What the connecting side sends first (TensorPipe's `Brochure`): for every transport it
/// offers, its domain descriptor; for every channel, its descriptor per device type.
///
/// Priorities are not sent: the listener decides with its own, and the connector checks
/// the decision against its own (see [`super::accept_answer`]). Descriptors borrow from
/// the buffer the brochure was decoded from.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
pub struct Brochure<'a> {
    #[serde(borrow)]
    transports: [Option<&'a str>; TransportKind::COUNT],
    #[serde(borrow)]
    channels: [Option<DeviceDescriptors<'a>>; ChannelKind::COUNT],
}

impl<'a> Brochure<'a> {
    /// Advertises nothing.
    pub const fn new() -> Self {
        Brochure {
            transports: [None; TransportKind::COUNT],
            channels: [None; ChannelKind::COUNT],
        }
    }

    /// This brochure, also (or again) advertising `kind` with this domain descriptor.
    pub fn with_transport(mut self, kind: TransportKind, domain_descriptor: &'a str) -> Self {
        if let Some(slot) = self.transports.get_mut(kind.index()) {
            *slot = Some(domain_descriptor);
        }
        self
    }

    /// This brochure, also (or again) advertising `kind` with these device descriptors.
    pub fn with_channel(mut self, kind: ChannelKind, descriptors: DeviceDescriptors<'a>) -> Self {
        if let Some(slot) = self.channels.get_mut(kind.index()) {
            *slot = Some(descriptors);
        }
        self
    }

    /// The domain descriptor advertised for `kind`.
    pub fn transport(&self, kind: TransportKind) -> Option<&'a str> {
        self.transports.get(kind.index()).copied().flatten()
    }

    /// The device descriptors advertised for `kind`.
    pub fn channel(&self, kind: ChannelKind) -> Option<DeviceDescriptors<'a>> {
        self.channels.get(kind.index()).copied().flatten()
    }

    /// The transports advertised, in [`TransportKind::ALL`] order.
    pub fn transport_set(&self) -> TransportSet {
        TransportKind::ALL
            .into_iter()
            .filter(|&k| self.transport(k).is_some())
            .collect()
    }

    pub(super) fn channel_table(&self) -> &[Option<DeviceDescriptors<'a>>; ChannelKind::COUNT] {
        &self.channels
    }
}

/// A set of transports, shown as `[shm, tcp]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TransportSet {
    bits: u8,
}

impl TransportSet {
    /// The empty set.
    pub const fn new() -> Self {
        TransportSet { bits: 0 }
    }

    /// Adds `kind`.
    pub fn insert(&mut self, kind: TransportKind) {
        self.bits |= 1 << kind.index();
    }

    /// Whether `kind` is in the set.
    pub fn contains(&self, kind: TransportKind) -> bool {
        self.bits & (1 << kind.index()) != 0
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.bits == 0
    }

    /// The members, in [`TransportKind::ALL`] order.
    pub fn iter(&self) -> impl Iterator<Item = TransportKind> + '_ {
        TransportKind::ALL
            .into_iter()
            .filter(move |&k| self.contains(k))
    }
}

const _: () = assert!(TransportKind::COUNT <= 8);

impl FromIterator<TransportKind> for TransportSet {
    fn from_iter<I: IntoIterator<Item = TransportKind>>(iter: I) -> Self {
        let mut set = TransportSet::new();
        for kind in iter {
            set.insert(kind);
        }
        set
    }
}

impl fmt::Display for TransportSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, kind) in self.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(kind.name())?;
        }
        f.write_str("]")
    }
}
