//! Devices as rendezvous and RPC name them: `cpu`, `cuda` (the current CUDA device) and
//! `cuda:N`.
//!
//! This module decides which device strings are valid and what they mean, following the
//! parser of `c10::Device` (`c10/core/Device.cpp`) for the two device types rdzv moves
//! tensors between: a type name (`[A-Za-z_]+`) optionally followed by `:` and a decimal
//! index without leading zeros, nothing else (no sign, no whitespace, no upper case).
//! [`Device`]'s `Display` writes what `str(torch.device(..))` writes, so parsing and
//! printing round-trip, and [`Device::repr`] writes what Python's `repr` writes, which
//! PyTorch's error messages embed. It does not know how many devices a machine has, nor
//! which device is "current": both are the caller's facts (see [`crate::device_map`]).
//!
//! Deliberate differences from PyTorch, all on inputs PyTorch rejects or mangles:
//! * device types other than `cpu` and `cuda` (`mps`, `xpu`, …) are rejected with
//!   PyTorch's "Expected one of …" message listing only the two rdzv supports;
//! * PyTorch keeps the index in an `int8_t` and silently wraps `cuda:200` to a negative
//!   index before rejecting it; rdzv keeps a `u8`, accepts `0..=255` and rejects larger
//!   indices with PyTorch's "Could not parse device index" message.

use core::fmt;
use core::str::FromStr;

/// How many bytes of a rejected input an error keeps for its message.
pub const REJECTED_INPUT_CAPACITY: usize = 64;

/// The start of an input that was rejected, kept (without a heap) so that error messages
/// can quote it. Inputs longer than [`REJECTED_INPUT_CAPACITY`] bytes are cut at a
/// character boundary and shown with a trailing `...`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RejectedInput {
    text: heapless::String<REJECTED_INPUT_CAPACITY>,
    truncated: bool,
}

impl RejectedInput {
    /// Keeps (the start of) `input`.
    pub fn new(input: &str) -> Self {
        let mut text = heapless::String::new();
        let mut truncated = false;
        for ch in input.chars() {
            if text.push(ch).is_err() {
                truncated = true;
                break;
            }
        }
        RejectedInput { text, truncated }
    }

    /// The kept text (the whole input unless [`is_truncated`](Self::is_truncated)).
    pub fn as_str(&self) -> &str {
        self.text.as_str()
    }

    /// Whether the input was longer than what was kept.
    pub fn is_truncated(&self) -> bool {
        self.truncated
    }
}

impl fmt::Display for RejectedInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)?;
        if self.truncated {
            f.write_str("...")?;
        }
        Ok(())
    }
}

/// The kind of a device.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[non_exhaustive]
pub enum DeviceType {
    /// Host memory (`cpu`).
    Cpu,
    /// An NVIDIA GPU (`cuda`).
    Cuda,
}

impl DeviceType {
    /// Every device type, in [`index`](Self::index) order.
    pub const ALL: [DeviceType; 2] = [DeviceType::Cpu, DeviceType::Cuda];

    /// How many device types there are.
    pub const COUNT: usize = Self::ALL.len();

    /// PyTorch's name for it: `cpu` or `cuda`.
    pub const fn name(self) -> &'static str {
        match self {
            DeviceType::Cpu => "cpu",
            DeviceType::Cuda => "cuda",
        }
    }

    /// A dense index (`0..COUNT`), for tables keyed by device type.
    pub const fn index(self) -> usize {
        match self {
            DeviceType::Cpu => 0,
            DeviceType::Cuda => 1,
        }
    }

    /// The device type with the given name (exactly `cpu` or `cuda`).
    pub fn from_name(name: &str) -> Option<DeviceType> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }
}

impl fmt::Display for DeviceType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A device: a [`DeviceType`] and an optional index, like `torch.device`.
///
/// `cuda` (no index) means "the current CUDA device" and is a different device from
/// `cuda:0`, exactly as `torch.device("cuda") != torch.device("cuda:0")`. The only index a
/// CPU device may carry is 0 (`cpu:0`, which is again different from `cpu`).
///
/// Ordering is by type, then index (no index first); it exists for sorted containers and
/// deterministic output, not as a statement about hardware.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(try_from = "RawDevice", into = "RawDevice")]
pub struct Device {
    kind: DeviceType,
    index: Option<u8>,
}

/// The serialized shape of a [`Device`], checked on the way in.
#[derive(Clone, Copy, serde::Serialize, serde::Deserialize)]
struct RawDevice {
    kind: DeviceType,
    index: Option<u8>,
}

impl From<Device> for RawDevice {
    fn from(device: Device) -> Self {
        RawDevice {
            kind: device.kind,
            index: device.index,
        }
    }
}

impl TryFrom<RawDevice> for Device {
    type Error = DeviceError;

    fn try_from(raw: RawDevice) -> Result<Self, Self::Error> {
        Device::new(raw.kind, raw.index)
    }
}

impl Device {
    /// `cpu`.
    pub const CPU: Device = Device {
        kind: DeviceType::Cpu,
        index: None,
    };

    /// `cpu`, the host.
    pub const fn cpu() -> Device {
        Device::CPU
    }

    /// `cuda:index`.
    pub const fn cuda(index: u8) -> Device {
        Device {
            kind: DeviceType::Cuda,
            index: Some(index),
        }
    }

    /// `cuda`: the current CUDA device, whichever the process has selected.
    pub const fn cuda_current() -> Device {
        Device {
            kind: DeviceType::Cuda,
            index: None,
        }
    }

    /// A device from its parts; fails only for a CPU index other than 0, which PyTorch
    /// rejects with "CPU device index must be -1 or zero".
    pub fn new(kind: DeviceType, index: Option<u8>) -> Result<Device, DeviceError> {
        match (kind, index) {
            (DeviceType::Cpu, Some(i)) if i != 0 => Err(DeviceError::CpuIndex { index: i }),
            _ => Ok(Device { kind, index }),
        }
    }

    /// The device type.
    pub const fn kind(self) -> DeviceType {
        self.kind
    }

    /// The index, if one was given (`cuda:1` → `Some(1)`, `cuda` → `None`).
    pub const fn index(self) -> Option<u8> {
        self.index
    }

    /// Whether this is a CPU device (`cpu` or `cpu:0`).
    pub const fn is_cpu(self) -> bool {
        matches!(self.kind, DeviceType::Cpu)
    }

    /// Whether this is a CUDA device (`cuda` or `cuda:N`).
    pub const fn is_cuda(self) -> bool {
        matches!(self.kind, DeviceType::Cuda)
    }

    /// Python's `repr(torch.device(..))`: `device(type='cpu')`,
    /// `device(type='cuda', index=0)`. PyTorch's error messages embed this form.
    pub const fn repr(self) -> DeviceRepr {
        DeviceRepr(self)
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.index {
            Some(index) => write!(f, "{}:{}", self.kind.name(), index),
            None => f.write_str(self.kind.name()),
        }
    }
}

/// Shows a [`Device`] as Python's `repr` does; made by [`Device::repr`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRepr(Device);

impl fmt::Display for DeviceRepr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.index {
            Some(index) => write!(f, "device(type='{}', index={})", self.0.kind.name(), index),
            None => write!(f, "device(type='{}')", self.0.kind.name()),
        }
    }
}

/// Why a device string or device was rejected. The messages are PyTorch's.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeviceError {
    /// The string was empty.
    Empty,
    /// The string is not `name` or `name:index` (e.g. `cuda:-1`, `cuda:x`, `cuda:01`,
    /// ` cuda`, `cuda:`).
    Invalid {
        /// The rejected string.
        input: RejectedInput,
    },
    /// The type name is well formed but is neither `cpu` nor `cuda` (e.g. `gpu:0`).
    UnknownType {
        /// The type name as written.
        name: RejectedInput,
    },
    /// The index is made of digits but is too large for a device index.
    IndexOutOfRange {
        /// The whole string; the index is what follows the `:`.
        input: RejectedInput,
    },
    /// A CPU device with an index other than 0.
    CpuIndex {
        /// The index given.
        index: u8,
    },
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceError::Empty => f.write_str("Device string must not be empty"),
            DeviceError::Invalid { input } => write!(f, "Invalid device string: '{input}'"),
            DeviceError::UnknownType { name } => write!(
                f,
                "Expected one of cpu, cuda device type at start of device string: {name}"
            ),
            DeviceError::IndexOutOfRange { input } => {
                let index = input.as_str().split_once(':').map_or("", |(_, i)| i);
                let cut = if input.is_truncated() { "..." } else { "" };
                write!(
                    f,
                    "Could not parse device index '{index}{cut}' in device string '{input}'"
                )
            }
            DeviceError::CpuIndex { index } => {
                write!(f, "CPU device index must be -1 or zero, got {index}")
            }
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for DeviceError {}

impl FromStr for Device {
    type Err = DeviceError;

    /// Parses `cpu`, `cpu:0`, `cuda` or `cuda:N` with `c10::Device`'s grammar,
    /// `([a-zA-Z_]+)(?::([1-9]\d*|0))?`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() {
            return Err(DeviceError::Empty);
        }
        let invalid = || DeviceError::Invalid {
            input: RejectedInput::new(s),
        };
        let (name, index) = match s.split_once(':') {
            Some((name, index)) => (name, Some(index)),
            None => (s, None),
        };
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphabetic() || b == b'_') {
            return Err(invalid());
        }
        if let Some(digits) = index {
            let well_formed = !digits.is_empty()
                && digits.bytes().all(|b| b.is_ascii_digit())
                && (digits == "0" || !digits.starts_with('0'));
            if !well_formed {
                return Err(invalid());
            }
        }
        let kind = DeviceType::from_name(name).ok_or_else(|| DeviceError::UnknownType {
            name: RejectedInput::new(name),
        })?;
        let index = match index {
            None => None,
            Some(digits) => {
                Some(
                    digits
                        .parse::<u8>()
                        .map_err(|_| DeviceError::IndexOutOfRange {
                            input: RejectedInput::new(s),
                        })?,
                )
            }
        };
        Device::new(kind, index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::format;
    use std::string::{String, ToString};

    fn parse(s: &str) -> Result<Device, DeviceError> {
        s.parse()
    }

    fn message(s: &str) -> String {
        match parse(s) {
            Ok(d) => panic!("{s:?} parsed as {d}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn parses_the_valid_forms() {
        assert_eq!(parse("cpu"), Ok(Device::cpu()));
        assert_eq!(parse("cpu:0"), Device::new(DeviceType::Cpu, Some(0)));
        assert_eq!(parse("cuda"), Ok(Device::cuda_current()));
        assert_eq!(parse("cuda:0"), Ok(Device::cuda(0)));
        assert_eq!(parse("cuda:7"), Ok(Device::cuda(7)));
        assert_eq!(parse("cuda:10"), Ok(Device::cuda(10)));
        assert_eq!(parse("cuda:255"), Ok(Device::cuda(255)));
    }

    #[test]
    fn distinguishes_what_torch_distinguishes() {
        assert_ne!(parse("cuda"), parse("cuda:0"));
        assert_ne!(parse("cpu"), parse("cpu:0"));
        let cpu0 = parse("cpu:0").unwrap();
        assert!(cpu0.is_cpu());
        assert_eq!(cpu0.index(), Some(0));
        assert!(Device::cuda_current().is_cuda());
        assert_eq!(Device::cuda_current().index(), None);
    }

    #[test]
    fn rejects_garbage_with_torch_messages() {
        assert_eq!(message(""), "Device string must not be empty");
        for bad in [
            "cuda:-1", "cuda:x", "cuda:", "cuda:01", "cuda:00", ":0", ":", " cuda", "cuda ",
            "cuda:0 ", "cuda:+1", "cu da", "cuda0", "cuda:1:2", "9cuda", "cuda:٣",
        ] {
            assert_eq!(
                message(bad),
                format!("Invalid device string: '{bad}'"),
                "{bad:?}"
            );
        }
        assert_eq!(
            message("gpu:0"),
            "Expected one of cpu, cuda device type at start of device string: gpu"
        );
        assert_eq!(
            message("CUDA"),
            "Expected one of cpu, cuda device type at start of device string: CUDA"
        );
        assert_eq!(
            message("mps"),
            "Expected one of cpu, cuda device type at start of device string: mps"
        );
        assert_eq!(
            message("cuda:256"),
            "Could not parse device index '256' in device string 'cuda:256'"
        );
        assert_eq!(
            message("cuda:99999999999999999999"),
            "Could not parse device index '99999999999999999999' in device string \
             'cuda:99999999999999999999'"
        );
        assert_eq!(
            message("cpu:1"),
            "CPU device index must be -1 or zero, got 1"
        );
    }

    #[test]
    fn long_rejected_inputs_are_cut_at_a_char_boundary() {
        let long = "é".repeat(100);
        let err = parse(&long).unwrap_err();
        let DeviceError::Invalid { input } = &err else {
            panic!("unexpected {err:?}");
        };
        assert!(input.is_truncated());
        assert_eq!(input.as_str(), "é".repeat(32));
        assert!(err.to_string().ends_with("...'"));
    }

    #[test]
    fn display_and_repr_match_python() {
        assert_eq!(Device::cpu().to_string(), "cpu");
        assert_eq!(Device::cuda(3).to_string(), "cuda:3");
        assert_eq!(Device::cuda_current().to_string(), "cuda");
        assert_eq!(Device::cpu().repr().to_string(), "device(type='cpu')");
        assert_eq!(
            Device::cuda(0).repr().to_string(),
            "device(type='cuda', index=0)"
        );
        assert_eq!(
            parse("cpu:0").unwrap().repr().to_string(),
            "device(type='cpu', index=0)"
        );
        assert_eq!(
            Device::cuda_current().repr().to_string(),
            "device(type='cuda')"
        );
    }

    #[test]
    fn new_checks_the_cpu_index() {
        assert_eq!(
            Device::new(DeviceType::Cpu, Some(2)),
            Err(DeviceError::CpuIndex { index: 2 })
        );
        assert_eq!(Device::new(DeviceType::Cuda, Some(2)), Ok(Device::cuda(2)));
        assert_eq!(Device::new(DeviceType::Cpu, None), Ok(Device::CPU));
    }

    fn any_device() -> impl Strategy<Value = Device> {
        prop_oneof![
            Just(Device::cpu()),
            Just(Device::CPU_0_FOR_TESTS),
            Just(Device::cuda_current()),
            any::<u8>().prop_map(Device::cuda),
        ]
    }

    impl Device {
        const CPU_0_FOR_TESTS: Device = Device {
            kind: DeviceType::Cpu,
            index: Some(0),
        };
    }

    proptest! {
        #[test]
        fn display_round_trips(device in any_device()) {
            prop_assert_eq!(device.to_string().parse::<Device>(), Ok(device));
        }

        #[test]
        fn parsing_never_panics_and_accepts_only_canonical_text(s in "\\PC{0,12}|(cpu|cuda)(:[0-9-]{0,4})?") {
            if let Ok(device) = s.parse::<Device>() {
                prop_assert_eq!(device.to_string(), s);
            }
        }
    }
}
