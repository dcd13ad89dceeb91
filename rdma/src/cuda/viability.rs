//! Which CUDA channels can be offered on this host, each with a human reason when not.
//!
//! [`assess`] is a pure function of the host facts ([`ChannelFacts`]: the CUDA probe's
//! answer and whether an RDMA device is usable), unit-tested with fake facts; [`probe`]
//! gathers the facts from the real host through the guarded probes ([`super::probe`],
//! [`crate::ibv::probe_env`]) and never panics. The rules:
//!
//! - `cuda_basic`, `cuda_xth`, `cuda_ipc`: the driver library loads, `cuInit` succeeds and
//!   there is at least one device. (`cuda_ipc` additionally needs peer access between the
//!   two processes' GPUs, which only the pair can tell; see
//!   [`descriptor`](super::descriptor).)
//! - `cuda_gdr`: all of the above, an RDMA device with an active port, and for every
//!   device a registration path ([`gdr::choose_registration_path`]): dma-buf
//!   (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`, driver 11.7+) or a loaded peer-memory
//!   module (`nvidia-peermem`, `nv_peer_mem`).
//!
//! This module does not compute descriptors or build offers.

use std::fmt;

use rdzv_core::negotiate::ChannelKind;

use super::gdr::{self, GdrPath, GdrPathError};
use super::CudaViability;

/// One of the CUDA channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CudaChannel {
    /// Staging through pinned host memory over a CPU channel.
    Basic,
    /// Copies within one process.
    Xth,
    /// CUDA IPC between processes of one host.
    Ipc,
    /// GPUDirect RDMA.
    Gdr,
}

impl CudaChannel {
    /// Every CUDA channel, highest default priority first.
    pub const ALL: [CudaChannel; 4] = [
        CudaChannel::Xth,
        CudaChannel::Ipc,
        CudaChannel::Gdr,
        CudaChannel::Basic,
    ];

    /// The negotiation kind.
    pub fn kind(self) -> ChannelKind {
        match self {
            CudaChannel::Basic => ChannelKind::CudaBasic,
            CudaChannel::Xth => ChannelKind::CudaXth,
            CudaChannel::Ipc => ChannelKind::CudaIpc,
            CudaChannel::Gdr => ChannelKind::CudaGdr,
        }
    }
}

impl fmt::Display for CudaChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind().name())
    }
}

/// Whether an RDMA device is usable, as the ibv probe answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RdmaFact {
    /// A device with an active port, e.g. `mlx5_0 port 1`.
    Usable(String),
    /// None, with the probe's reason.
    Unusable(String),
}

/// The host facts [`assess`] decides from.
#[derive(Debug)]
pub struct ChannelFacts {
    /// The CUDA probe's answer.
    pub cuda: CudaViability,
    /// The RDMA probe's answer.
    pub rdma: RdmaFact,
}

/// Why a CUDA channel cannot be offered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ChannelNotViable {
    /// CUDA itself is unusable.
    #[error("CUDA is not viable: {0}")]
    Cuda(String),
    /// GPUDirect RDMA needs an RDMA device.
    #[error("no usable InfiniBand/RoCE device: {0}")]
    NoRdmaDevice(String),
    /// A GPU has no way to register its memory with the NIC.
    #[error(transparent)]
    NoRegistrationPath(#[from] GdrPathError),
}

/// Why the CUDA runtime does not offer a lending channel (`cuda_xth`, `cuda_ipc`,
/// `cuda_gdr`): the source of the agent's `ChannelUnavailable` for it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LendingRefused {
    /// The probe found the channel not viable here.
    #[error("{channel}: not viable: {reason}")]
    NotViable {
        /// The channel.
        channel: CudaChannel,
        /// Why.
        #[source]
        reason: ChannelNotViable,
    },
    /// The probe did not assess the channel.
    #[error("{channel}: not assessed by the probe")]
    NotAssessed {
        /// The channel.
        channel: CudaChannel,
    },
    /// This process or host could not be identified, which the channel's descriptors
    /// name.
    #[error("{channel} not viable: {reason}")]
    Unidentified {
        /// The channel.
        channel: CudaChannel,
        /// What reading `/proc` said.
        reason: String,
    },
}

/// What [`assess`] found for one channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChannelVerdict {
    /// The channel can be offered. For `cuda_gdr`, the registration path of each device
    /// in ordinal order; empty for the other channels.
    Viable(Vec<GdrPath>),
    /// It cannot, and why.
    NotViable(ChannelNotViable),
}

impl ChannelVerdict {
    /// Whether the channel can be offered.
    pub fn is_viable(&self) -> bool {
        matches!(self, ChannelVerdict::Viable(_))
    }
}

impl fmt::Display for ChannelVerdict {
    /// `viable`, `viable (dma-buf, peer memory)` or `not viable: <reason>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChannelVerdict::Viable(paths) if paths.is_empty() => f.write_str("viable"),
            ChannelVerdict::Viable(paths) => {
                f.write_str("viable (")?;
                for (i, path) in paths.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{path}")?;
                }
                f.write_str(")")
            }
            ChannelVerdict::NotViable(reason) => write!(f, "not viable: {reason}"),
        }
    }
}

/// Decides whether `channel` can be offered given `facts`.
pub fn assess(channel: CudaChannel, facts: &ChannelFacts) -> ChannelVerdict {
    let report = match &facts.cuda {
        CudaViability::Viable(report) if !report.devices.is_empty() => report,
        CudaViability::Viable(_) => {
            return ChannelVerdict::NotViable(ChannelNotViable::Cuda("no CUDA device found".into()))
        }
        CudaViability::NotViable(reason) => {
            return ChannelVerdict::NotViable(ChannelNotViable::Cuda(
                crate::error_chain::ErrorChain(reason).to_string(),
            ))
        }
    };
    match channel {
        CudaChannel::Basic | CudaChannel::Xth | CudaChannel::Ipc => {
            ChannelVerdict::Viable(Vec::new())
        }
        CudaChannel::Gdr => {
            if let RdmaFact::Unusable(reason) = &facts.rdma {
                return ChannelVerdict::NotViable(ChannelNotViable::NoRdmaDevice(reason.clone()));
            }
            let paths: Result<Vec<GdrPath>, GdrPathError> = report
                .devices
                .iter()
                .map(|device| {
                    gdr::choose_registration_path(
                        device,
                        report.driver_version,
                        &report.peer_memory,
                    )
                })
                .collect();
            match paths {
                Ok(paths) => ChannelVerdict::Viable(paths),
                Err(err) => ChannelVerdict::NotViable(err.into()),
            }
        }
    }
}

/// Every CUDA channel's verdict on this host.
#[derive(Debug)]
pub struct ChannelsReport {
    /// The facts decided from.
    pub facts: ChannelFacts,
    /// `(channel, verdict)` in [`CudaChannel::ALL`] order.
    pub verdicts: Vec<(CudaChannel, ChannelVerdict)>,
}

impl ChannelsReport {
    /// The verdict for `channel`.
    pub fn verdict(&self, channel: CudaChannel) -> Option<&ChannelVerdict> {
        self.verdicts
            .iter()
            .find(|(c, _)| *c == channel)
            .map(|(_, v)| v)
    }
}

impl fmt::Display for ChannelsReport {
    /// One line per channel: `cuda_ipc: not viable: CUDA is not viable: ...`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (channel, verdict)) in self.verdicts.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{channel}: {verdict}")?;
        }
        Ok(())
    }
}

/// Decides every channel from already gathered facts.
pub fn assess_all(facts: ChannelFacts) -> ChannelsReport {
    let verdicts = CudaChannel::ALL
        .into_iter()
        .map(|channel| (channel, assess(channel, &facts)))
        .collect();
    ChannelsReport { facts, verdicts }
}

/// Probes this host (CUDA driver and devices, peer memory, RDMA devices) and decides every
/// CUDA channel. Never panics on a host without a driver or NIC.
pub fn probe() -> ChannelsReport {
    let cuda = super::probe();
    // The RDMA probe only matters for cuda_gdr, and only when CUDA works.
    let rdma = if cuda.is_viable() {
        match crate::ibv::probe_env() {
            crate::ibv::IbvViability::Viable(selection) => {
                RdmaFact::Usable(format!("{} port {}", selection.device, selection.port))
            }
            crate::ibv::IbvViability::NotViable(reason) => {
                RdmaFact::Unusable(crate::error_chain::ErrorChain(&reason).to_string())
            }
        }
    } else {
        RdmaFact::Unusable("not probed: CUDA is not viable".into())
    };
    assess_all(ChannelFacts { cuda, rdma })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::{
        CudaDevice, CudaNotViable, CudaReport, DriverVersion, PeerMemory, PeerMemoryClient,
    };

    fn device(ordinal: i32, dma_buf: Option<bool>) -> CudaDevice {
        CudaDevice {
            ordinal,
            name: "NVIDIA H100 80GB HBM3".into(),
            compute_capability: (9, 0),
            total_memory: 85_520_809_984,
            pci_bus_id: Some("0000:3b:00.0".into()),
            gpu_direct_rdma: Some(true),
            dma_buf,
        }
    }

    fn facts(devices: Vec<CudaDevice>, peer: bool, rdma: bool) -> ChannelFacts {
        ChannelFacts {
            cuda: CudaViability::Viable(CudaReport {
                driver_version: Some(DriverVersion(12080)),
                devices,
                peer_memory: PeerMemory {
                    client: peer.then_some(PeerMemoryClient::NvidiaPeermem),
                    evidence: peer.then_some("/proc/modules"),
                },
            }),
            rdma: if rdma {
                RdmaFact::Usable("mlx5_0 port 1".into())
            } else {
                RdmaFact::Unusable("the kernel has no RDMA verbs support".into())
            },
        }
    }

    #[test]
    fn no_driver_makes_every_channel_not_viable_with_the_reason() {
        let report = assess_all(ChannelFacts {
            cuda: CudaViability::NotViable(CudaNotViable::DriverLibraryMissing),
            rdma: RdmaFact::Unusable("not probed".into()),
        });
        for (channel, verdict) in &report.verdicts {
            assert!(!verdict.is_viable(), "{channel}");
            assert!(
                verdict
                    .to_string()
                    .contains("the CUDA driver library (libcuda) cannot be loaded"),
                "{verdict}"
            );
        }
        assert!(report
            .to_string()
            .starts_with("cuda_xth: not viable: CUDA is not viable"));
    }

    #[test]
    fn zero_devices_is_not_viable() {
        let verdict = assess(CudaChannel::Basic, &facts(vec![], true, true));
        assert_eq!(
            verdict.to_string(),
            "not viable: CUDA is not viable: no CUDA device found"
        );
    }

    #[test]
    fn device_channels_need_only_a_device() {
        let f = facts(vec![device(0, None)], false, false);
        for channel in [CudaChannel::Basic, CudaChannel::Xth, CudaChannel::Ipc] {
            assert_eq!(assess(channel, &f), ChannelVerdict::Viable(vec![]));
        }
    }

    #[test]
    fn gdr_needs_a_nic_and_a_path_for_every_device() {
        let no_nic = assess(
            CudaChannel::Gdr,
            &facts(vec![device(0, Some(true))], true, false),
        );
        assert_eq!(
            no_nic.to_string(),
            "not viable: no usable InfiniBand/RoCE device: the kernel has no RDMA verbs support"
        );
        let dma_buf = assess(
            CudaChannel::Gdr,
            &facts(vec![device(0, Some(true))], false, true),
        );
        assert_eq!(dma_buf, ChannelVerdict::Viable(vec![GdrPath::DmaBuf]));
        let mixed = assess(
            CudaChannel::Gdr,
            &facts(
                vec![device(0, Some(true)), device(1, Some(false))],
                true,
                true,
            ),
        );
        assert_eq!(
            mixed,
            ChannelVerdict::Viable(vec![GdrPath::DmaBuf, GdrPath::PeerMemory])
        );
        assert_eq!(mixed.to_string(), "viable (dma-buf, peer memory)");
        let none = assess(
            CudaChannel::Gdr,
            &facts(
                vec![device(0, Some(true)), device(1, Some(false))],
                false,
                true,
            ),
        );
        assert!(!none.is_viable());
        assert!(none.to_string().contains("CUDA device 1"), "{none}");
    }

    #[test]
    fn kinds_and_names() {
        assert_eq!(CudaChannel::Ipc.kind(), ChannelKind::CudaIpc);
        assert_eq!(CudaChannel::Gdr.to_string(), "cuda_gdr");
        let priorities: Vec<i64> = CudaChannel::ALL
            .iter()
            .map(|c| c.kind().default_priority())
            .collect();
        assert!(priorities.windows(2).all(|w| w[0] > w[1]), "{priorities:?}");
    }

    #[test]
    fn probing_this_host_never_panics() {
        let report = probe();
        println!("{report}");
        assert_eq!(report.verdicts.len(), CudaChannel::ALL.len());
        if !crate::cuda::driver_library_present() {
            assert!(report.verdicts.iter().all(|(_, v)| !v.is_viable()));
        }
    }
}
