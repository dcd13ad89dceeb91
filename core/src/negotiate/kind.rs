//! The transports and channels rdzv knows, their names, default priorities and the device
//! types each channel moves data between; and how a user's ordered list of names becomes
//! priorities.

use core::fmt;
use core::str::FromStr;

use crate::device::{DeviceType, RejectedInput};

/// Whether a name is a transport's or a channel's; used in messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KindClass {
    /// A transport (`shm`, `ibv`, `tcp`).
    Transport,
    /// A channel (`cma`, `mpt`, `basic`, `cuda_*`).
    Channel,
}

impl KindClass {
    /// `transport` or `channel`.
    pub const fn name(self) -> &'static str {
        match self {
            KindClass::Transport => "transport",
            KindClass::Channel => "channel",
        }
    }

    /// The canonical names of every kind of this class, highest default priority first.
    pub fn known_names(self) -> impl Iterator<Item = &'static str> {
        let (transports, channels): (&[TransportKind], &[ChannelKind]) = match self {
            KindClass::Transport => (&TransportKind::ALL, &[]),
            KindClass::Channel => (&[], &ChannelKind::ALL),
        };
        transports
            .iter()
            .map(|t| t.name())
            .chain(channels.iter().map(|c| c.name()))
    }
}

/// The most kinds of one class; the capacity of [`Ranking`].
pub const MAX_KINDS: usize = 8;

/// What [`TransportKind`] and [`ChannelKind`] have in common: a *kind* is a transport
/// or a channel. (A *backend* is something else: the RPC agent `init_rpc` starts, in
/// `rpc::backend`.)
pub trait Kind:
    Copy + Eq + fmt::Debug + fmt::Display + FromStr<Err = ParseKindError> + 'static
{
    /// Which class this is.
    const CLASS: KindClass;
    /// Every kind of the class, highest default priority first.
    const ALL: &'static [Self];
    /// The canonical name.
    fn name(self) -> &'static str;
    /// PyTorch's priority for it (higher wins).
    fn default_priority(self) -> i64;
    /// A dense index (`0..ALL.len()`), for tables keyed by kind.
    fn index(self) -> usize;
}

/// A transport: how a pipe's control messages and CPU payloads travel.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[non_exhaustive]
pub enum TransportKind {
    /// Shared-memory ring buffers between processes of one host (and network namespace).
    Shm,
    /// InfiniBand / RoCE verbs.
    Ibv,
    /// TCP (TensorPipe's `uv`).
    Tcp,
}

impl TransportKind {
    /// Every transport, highest default priority first.
    pub const ALL: [TransportKind; 3] =
        [TransportKind::Shm, TransportKind::Ibv, TransportKind::Tcp];

    /// How many transports there are.
    pub const COUNT: usize = Self::ALL.len();

    /// The canonical name: `shm`, `ibv` or `tcp`.
    pub const fn name(self) -> &'static str {
        match self {
            TransportKind::Shm => "shm",
            TransportKind::Ibv => "ibv",
            TransportKind::Tcp => "tcp",
        }
    }

    /// PyTorch's priority: shm 200, ibv 100, tcp (`uv`) 0.
    pub const fn default_priority(self) -> i64 {
        match self {
            TransportKind::Shm => 200,
            TransportKind::Ibv => 100,
            TransportKind::Tcp => 0,
        }
    }

    /// A dense index (`0..COUNT`), the position in [`ALL`](Self::ALL).
    pub const fn index(self) -> usize {
        match self {
            TransportKind::Shm => 0,
            TransportKind::Ibv => 1,
            TransportKind::Tcp => 2,
        }
    }
}

impl Kind for TransportKind {
    const CLASS: KindClass = KindClass::Transport;
    const ALL: &'static [Self] = &TransportKind::ALL;
    fn name(self) -> &'static str {
        TransportKind::name(self)
    }
    fn default_priority(self) -> i64 {
        TransportKind::default_priority(self)
    }
    fn index(self) -> usize {
        TransportKind::index(self)
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TransportKind {
    type Err = ParseKindError;

    /// Accepts the canonical names and TensorPipe's `uv` for `tcp`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "uv" => Ok(TransportKind::Tcp),
            _ => TransportKind::ALL
                .into_iter()
                .find(|t| t.name() == s)
                .ok_or_else(|| ParseKindError::new(KindClass::Transport, s)),
        }
    }
}

/// A channel: how tensors travel once a pipe is up.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[non_exhaustive]
pub enum ChannelKind {
    /// Cross-memory attach (`process_vm_readv`) between processes of one host. CPU only.
    Cma,
    /// Multiplexing over several TCP lanes (TensorPipe's `mpt_uv`). CPU only.
    Mpt,
    /// The pipe's own transport connection. CPU only.
    Basic,
    /// CUDA copies within one process. CUDA only.
    CudaXth,
    /// CUDA IPC between processes of one host. CUDA only.
    CudaIpc,
    /// GPUDirect RDMA over InfiniBand. CUDA only.
    CudaGdr,
    /// Staging through pinned host memory over a CPU channel. Any pair that involves a
    /// CUDA device (it refuses CPU ↔ CPU).
    CudaBasic,
    /// A copy within one process (both workers in the same address space). CPU only.
    Xth,
}

impl ChannelKind {
    /// Every channel, highest default priority first.
    pub const ALL: [ChannelKind; 8] = [
        ChannelKind::Xth,
        ChannelKind::Cma,
        ChannelKind::Mpt,
        ChannelKind::Basic,
        ChannelKind::CudaXth,
        ChannelKind::CudaIpc,
        ChannelKind::CudaGdr,
        ChannelKind::CudaBasic,
    ];

    /// How many channels there are.
    pub const COUNT: usize = Self::ALL.len();

    /// The canonical name: `xth`, `cma`, `mpt`, `basic`, `cuda_xth`, `cuda_ipc`,
    /// `cuda_gdr`, `cuda_basic`.
    pub const fn name(self) -> &'static str {
        match self {
            ChannelKind::Cma => "cma",
            ChannelKind::Mpt => "mpt",
            ChannelKind::Basic => "basic",
            ChannelKind::CudaXth => "cuda_xth",
            ChannelKind::CudaIpc => "cuda_ipc",
            ChannelKind::CudaGdr => "cuda_gdr",
            ChannelKind::CudaBasic => "cuda_basic",
            ChannelKind::Xth => "xth",
        }
    }

    /// PyTorch's priority: cma 1200, mpt 1100, basic 1000, cuda_xth 400, cuda_ipc 300,
    /// cuda_gdr 200, cuda_basic 0. CPU channels outrank CUDA channels because some CUDA
    /// channels also move CPU data, less efficiently. `xth`, which PyTorch does not
    /// register, gets 1300: within one process nothing is cheaper, and its domain
    /// descriptor names the process, so two processes never pick it.
    pub const fn default_priority(self) -> i64 {
        match self {
            ChannelKind::Cma => 1200,
            ChannelKind::Mpt => 1100,
            ChannelKind::Basic => 1000,
            ChannelKind::CudaXth => 400,
            ChannelKind::CudaIpc => 300,
            ChannelKind::CudaGdr => 200,
            ChannelKind::CudaBasic => 0,
            ChannelKind::Xth => 1300,
        }
    }

    /// A dense index (`0..COUNT`), the position in [`ALL`](Self::ALL).
    pub const fn index(self) -> usize {
        match self {
            ChannelKind::Xth => 0,
            ChannelKind::Cma => 1,
            ChannelKind::Mpt => 2,
            ChannelKind::Basic => 3,
            ChannelKind::CudaXth => 4,
            ChannelKind::CudaIpc => 5,
            ChannelKind::CudaGdr => 6,
            ChannelKind::CudaBasic => 7,
        }
    }

    /// The device types this channel advertises descriptors for.
    pub const fn device_types(self) -> &'static [DeviceType] {
        match self {
            ChannelKind::Xth | ChannelKind::Cma | ChannelKind::Mpt | ChannelKind::Basic => {
                &[DeviceType::Cpu]
            }
            ChannelKind::CudaXth | ChannelKind::CudaIpc | ChannelKind::CudaGdr => {
                &[DeviceType::Cuda]
            }
            ChannelKind::CudaBasic => &[DeviceType::Cpu, DeviceType::Cuda],
        }
    }

    /// Whether this channel can move a tensor between a `local` and a `remote` device of
    /// these types. Symmetric in its two arguments.
    pub const fn handles(self, local: DeviceType, remote: DeviceType) -> bool {
        match self {
            ChannelKind::Xth | ChannelKind::Cma | ChannelKind::Mpt | ChannelKind::Basic => {
                matches!((local, remote), (DeviceType::Cpu, DeviceType::Cpu))
            }
            ChannelKind::CudaXth | ChannelKind::CudaIpc | ChannelKind::CudaGdr => {
                matches!((local, remote), (DeviceType::Cuda, DeviceType::Cuda))
            }
            ChannelKind::CudaBasic => {
                !matches!((local, remote), (DeviceType::Cpu, DeviceType::Cpu))
            }
        }
    }

    /// Whether a frame may name this channel for the bytes of a tensor between a
    /// `source` and a `target` device of these types: the channels that
    /// [`handle`](Self::handles) the pair, and, where `cuda_basic` serves it, the CPU
    /// channels, which carry the host copy `cuda_basic` stages (see
    /// [`Negotiated::carrier_for`](super::Negotiated::carrier_for)).
    pub const fn carries(self, source: DeviceType, target: DeviceType) -> bool {
        self.handles(source, target)
            || (ChannelKind::CudaBasic.handles(source, target)
                && self.handles(DeviceType::Cpu, DeviceType::Cpu))
    }
}

impl Kind for ChannelKind {
    const CLASS: KindClass = KindClass::Channel;
    const ALL: &'static [Self] = &ChannelKind::ALL;
    fn name(self) -> &'static str {
        ChannelKind::name(self)
    }
    fn default_priority(self) -> i64 {
        ChannelKind::default_priority(self)
    }
    fn index(self) -> usize {
        ChannelKind::index(self)
    }
}

impl fmt::Display for ChannelKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ChannelKind {
    type Err = ParseKindError;

    /// Accepts the canonical names and TensorPipe's `mpt_uv` for `mpt`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "mpt_uv" => Ok(ChannelKind::Mpt),
            _ => ChannelKind::ALL
                .into_iter()
                .find(|c| c.name() == s)
                .ok_or_else(|| ParseKindError::new(KindClass::Channel, s)),
        }
    }
}

const _: () = assert!(TransportKind::COUNT <= MAX_KINDS && ChannelKind::COUNT <= MAX_KINDS);

/// A transport or channel name that rdzv does not know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseKindError {
    class: KindClass,
    name: RejectedInput,
}

impl ParseKindError {
    fn new(class: KindClass, name: &str) -> Self {
        ParseKindError {
            class,
            name: RejectedInput::new(name),
        }
    }

    /// Whether a transport or a channel name was expected.
    pub fn class(&self) -> KindClass {
        self.class
    }

    /// The name that was given.
    pub fn name(&self) -> &RejectedInput {
        &self.name
    }
}

impl fmt::Display for ParseKindError {
    /// PyTorch's `Unknown transport: <name>` / `Unknown channel: <name>`, followed by the
    /// names rdzv knows.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = self.class.name();
        write!(f, "Unknown {what}: {} (known {what}s: ", self.name)?;
        for (i, known) in self.class.known_names().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(known)?;
        }
        f.write_str(")")
    }
}

#[cfg(feature = "std")]
impl std::error::Error for ParseKindError {}

/// Why a ranking or an offer could not be built.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum OfferError {
    /// A name in the user's list is not a known transport or channel.
    Unknown(ParseKindError),
    /// The same kind was listed or added twice.
    Duplicate {
        /// Transport or channel.
        class: KindClass,
        /// Its canonical name.
        name: &'static str,
    },
    /// Two kinds of one class were given the same priority (TensorPipe refuses this:
    /// the order between them would be arbitrary).
    PriorityClash {
        /// Transport or channel.
        class: KindClass,
        /// The shared priority.
        priority: i64,
        /// The kind that had it first.
        first: &'static str,
        /// The kind added with it.
        second: &'static str,
    },
    /// A channel was given a descriptor for a device type it does not handle.
    UnsupportedDevice {
        /// The channel.
        channel: ChannelKind,
        /// The device type.
        device: DeviceType,
    },
}

impl fmt::Display for OfferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OfferError::Unknown(e) => fmt::Display::fmt(e, f),
            OfferError::Duplicate { class, name } => {
                write!(f, "{} {name} is listed more than once", class.name())
            }
            OfferError::PriorityClash {
                class,
                priority,
                first,
                second,
            } => write!(
                f,
                "{}s {first} and {second} both have priority {priority}",
                class.name()
            ),
            OfferError::UnsupportedDevice { channel, device } => {
                write!(f, "channel {channel} does not handle {device} devices")
            }
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for OfferError {}

impl From<ParseKindError> for OfferError {
    fn from(e: ParseKindError) -> Self {
        OfferError::Unknown(e)
    }
}

/// The kinds of one class that a process registers, each with its priority, highest
/// first: PyTorch's defaults, or the user's `transports` / `channels` option.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ranking<K: Kind> {
    entries: heapless::Vec<(K, i64), MAX_KINDS>,
}

impl<K: Kind> Ranking<K> {
    /// Every kind of the class with PyTorch's default priority.
    pub fn defaults() -> Self {
        let mut entries = heapless::Vec::new();
        for &kind in K::ALL.iter().take(MAX_KINDS) {
            // Cannot fail: `take` keeps within the capacity.
            let _ = entries.push((kind, kind.default_priority()));
        }
        entries.sort_unstable_by_key(|e: &(K, i64)| core::cmp::Reverse(e.1));
        Ranking { entries }
    }

    /// Only the named kinds, first highest, as PyTorch's agent registers a
    /// `_transports` / `_channels` list: priority = `len - 1 - position`. Unknown and
    /// repeated names are errors.
    pub fn from_names<S: AsRef<str>>(names: &[S]) -> Result<Self, OfferError> {
        let mut kinds: heapless::Vec<K, MAX_KINDS> = heapless::Vec::new();
        for name in names {
            let kind: K = name.as_ref().parse()?;
            let duplicate = OfferError::Duplicate {
                class: K::CLASS,
                name: kind.name(),
            };
            if kinds.contains(&kind) {
                return Err(duplicate);
            }
            // Capacity: more than MAX_KINDS distinct kinds cannot exist.
            kinds.push(kind).map_err(|_| duplicate)?;
        }
        let mut entries = heapless::Vec::new();
        let count = kinds.len();
        for (position, kind) in kinds.into_iter().enumerate() {
            let priority = (count - 1 - position) as i64;
            let _ = entries.push((kind, priority));
        }
        Ok(Ranking { entries })
    }

    /// [`from_names`](Self::from_names) if the option is set, else
    /// [`defaults`](Self::defaults).
    pub fn from_option<S: AsRef<str>>(names: Option<&[S]>) -> Result<Self, OfferError> {
        match names {
            Some(names) => Self::from_names(names),
            None => Ok(Self::defaults()),
        }
    }

    /// `(kind, priority)`, highest priority first.
    pub fn iter(&self) -> impl Iterator<Item = (K, i64)> + '_ {
        self.entries.iter().copied()
    }

    /// The priority of `kind`, if it is registered.
    pub fn priority(&self, kind: K) -> Option<i64> {
        self.entries
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|&(_, p)| p)
    }

    /// How many kinds are registered.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none are.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::string::ToString;

    #[test]
    fn names_round_trip_and_aliases() {
        for t in TransportKind::ALL {
            assert_eq!(t.name().parse::<TransportKind>(), Ok(t));
            assert_eq!(t.to_string(), t.name());
            assert_eq!(TransportKind::ALL[t.index()], t);
        }
        for c in ChannelKind::ALL {
            assert_eq!(c.name().parse::<ChannelKind>(), Ok(c));
            assert_eq!(c.to_string(), c.name());
            assert_eq!(ChannelKind::ALL[c.index()], c);
        }
        assert_eq!("uv".parse::<TransportKind>(), Ok(TransportKind::Tcp));
        assert_eq!("mpt_uv".parse::<ChannelKind>(), Ok(ChannelKind::Mpt));
    }

    #[test]
    fn default_priorities_are_pytorchs_and_all_is_sorted_by_them() {
        let t: [i64; 3] = TransportKind::ALL.map(TransportKind::default_priority);
        assert_eq!(t, [200, 100, 0]);
        let c: [i64; 8] = ChannelKind::ALL.map(ChannelKind::default_priority);
        assert_eq!(c, [1300, 1200, 1100, 1000, 400, 300, 200, 0]);
    }

    #[test]
    fn unknown_names_list_the_known_ones() {
        let e = "tcpp".parse::<TransportKind>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "Unknown transport: tcpp (known transports: shm, ibv, tcp)"
        );
        let e = "SHM".parse::<TransportKind>().unwrap_err();
        assert_eq!(e.class(), KindClass::Transport);
        assert_eq!(e.name().as_str(), "SHM");
        let e = "xht".parse::<ChannelKind>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "Unknown channel: xht (known channels: xth, cma, mpt, basic, cuda_xth, cuda_ipc, \
             cuda_gdr, cuda_basic)"
        );
    }

    #[test]
    fn handles_is_symmetric_and_matches_device_types() {
        for c in ChannelKind::ALL {
            for a in DeviceType::ALL {
                for b in DeviceType::ALL {
                    assert_eq!(c.handles(a, b), c.handles(b, a));
                    if c.handles(a, b) {
                        assert!(c.device_types().contains(&a) && c.device_types().contains(&b));
                    }
                }
            }
        }
        assert!(!ChannelKind::CudaBasic.handles(DeviceType::Cpu, DeviceType::Cpu));
        assert!(ChannelKind::CudaBasic.handles(DeviceType::Cpu, DeviceType::Cuda));
        assert!(ChannelKind::CudaBasic.handles(DeviceType::Cuda, DeviceType::Cuda));
        assert!(!ChannelKind::Basic.handles(DeviceType::Cuda, DeviceType::Cuda));
        assert!(!ChannelKind::CudaIpc.handles(DeviceType::Cpu, DeviceType::Cuda));
        // CPU channels carry cuda_basic's staged bytes; device channels carry nothing
        // for a pair they do not handle.
        assert!(ChannelKind::Cma.carries(DeviceType::Cuda, DeviceType::Cpu));
        assert!(ChannelKind::Basic.carries(DeviceType::Cuda, DeviceType::Cuda));
        assert!(ChannelKind::Mpt.carries(DeviceType::Cpu, DeviceType::Cpu));
        assert!(!ChannelKind::CudaIpc.carries(DeviceType::Cpu, DeviceType::Cuda));
        assert!(!ChannelKind::CudaXth.carries(DeviceType::Cpu, DeviceType::Cpu));
    }

    #[test]
    fn rankings() {
        let d = Ranking::<TransportKind>::defaults();
        assert_eq!(
            d.iter().collect::<std::vec::Vec<_>>(),
            [
                (TransportKind::Shm, 200),
                (TransportKind::Ibv, 100),
                (TransportKind::Tcp, 0)
            ]
        );
        let r = Ranking::<ChannelKind>::from_names(&["basic", "cuda_basic", "mpt_uv"]).unwrap();
        assert_eq!(
            r.iter().collect::<std::vec::Vec<_>>(),
            [
                (ChannelKind::Basic, 2),
                (ChannelKind::CudaBasic, 1),
                (ChannelKind::Mpt, 0)
            ]
        );
        assert_eq!(r.priority(ChannelKind::Cma), None);
        assert_eq!(
            Ranking::<TransportKind>::from_option(None::<&[&str]>).unwrap(),
            Ranking::defaults()
        );
        assert!(Ranking::<TransportKind>::from_names::<&str>(&[])
            .unwrap()
            .is_empty());
        let e = Ranking::<TransportKind>::from_names(&["tcp", "uv"]).unwrap_err();
        assert_eq!(e.to_string(), "transport tcp is listed more than once");
        let e = Ranking::<ChannelKind>::from_option(Some(&["basic", "nope"][..])).unwrap_err();
        assert!(e
            .to_string()
            .starts_with("Unknown channel: nope (known channels: xth, cma,"));
        let many = ["shm"; 20];
        assert!(Ranking::<TransportKind>::from_names(&many).is_err());
    }
}
