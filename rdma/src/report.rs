//! The combined RDMA + CUDA viability report that `rdzv rdma probe` prints.
//!
//! This module decides the report's field layout: a flat list of `key: value` lines whose
//! keys (listed on [`ViabilityReport::fields`]) stay stable so that scripts can grep them.
//! It does no probing of its own beyond calling [`ibv::probe`] and [`cuda::probe`].

use std::fmt;

use crate::cuda::{self, yes_no, CudaViability};
use crate::error_chain::ErrorChain;
use crate::ibv::{self, IbvConfig, IbvViability};

/// Result of probing both RDMA (ibverbs) and CUDA on this host.
#[derive(Debug)]
pub struct ViabilityReport {
    /// RDMA verbs: viable with a device/port/GID selection, or the reason not.
    pub ibv: IbvViability,
    /// CUDA: viable with devices and GPUDirect facts, or the reason not.
    pub cuda: CudaViability,
}

impl ViabilityReport {
    /// Probes both with an explicit RDMA configuration.
    pub fn probe(config: &IbvConfig) -> Self {
        Self {
            ibv: ibv::probe(config),
            cuda: cuda::probe(),
        }
    }

    /// Probes both, reading the RDMA configuration from `RDZV_IB_DEVICE`, `RDZV_IB_PORT`
    /// and `RDZV_IB_GID_INDEX`.
    pub fn probe_env() -> Self {
        Self {
            ibv: ibv::probe_env(),
            cuda: cuda::probe(),
        }
    }

    /// The report as ordered `(key, value)` pairs; [`Display`](fmt::Display) prints them as
    /// `key: value` lines.
    ///
    /// Keys, always present: `ibv` and `cuda` (`viable` or `not viable`).
    /// When not viable: `ibv.reason` / `cuda.reason` (the error and its causes).
    /// When RDMA is viable: `ibv.device`, `ibv.port`, `ibv.link_layer`, `ibv.lid`,
    /// `ibv.gid`, `ibv.gid_index`, `ibv.gid_type`, `ibv.active_mtu`, `ibv.max_msg_size`,
    /// `ibv.speed` (`unknown` when the device did not report one).
    /// When CUDA is viable: `cuda.driver_version`, `cuda.device_count`,
    /// `cuda.peer_memory`, then for each device `N`: `cuda.device.N.name`,
    /// `cuda.device.N.compute_capability`, `cuda.device.N.total_memory` (bytes),
    /// `cuda.device.N.pci_bus_id`, `cuda.device.N.gpu_direct_rdma`, `cuda.device.N.dma_buf`
    /// (`yes`, `no` or `unknown`).
    pub fn fields(&self) -> Vec<(String, String)> {
        let mut fields = Vec::new();
        let mut push = |key: &str, value: String| fields.push((key.to_owned(), value));
        match &self.ibv {
            IbvViability::Viable(sel) => {
                push("ibv", "viable".into());
                push("ibv.device", sel.device.clone());
                push("ibv.port", sel.port.to_string());
                push("ibv.link_layer", sel.link_layer.to_string());
                push("ibv.lid", sel.lid.to_string());
                push("ibv.gid", sel.gid.to_string());
                push("ibv.gid_index", sel.gid_index.to_string());
                push("ibv.gid_type", sel.gid_type.to_string());
                push("ibv.active_mtu", or_unknown(sel.active_mtu));
                push("ibv.max_msg_size", sel.max_msg_size.to_string());
                push("ibv.speed", or_unknown(sel.speed));
            }
            IbvViability::NotViable(reason) => {
                push("ibv", "not viable".into());
                push("ibv.reason", ErrorChain(reason).to_string());
            }
        }
        match &self.cuda {
            CudaViability::Viable(report) => {
                push("cuda", "viable".into());
                push("cuda.driver_version", or_unknown(report.driver_version));
                push("cuda.device_count", report.devices.len().to_string());
                push("cuda.peer_memory", report.peer_memory.to_string());
                for device in &report.devices {
                    let key = |field: &str| format!("cuda.device.{}.{field}", device.ordinal);
                    let (major, minor) = device.compute_capability;
                    push(&key("name"), device.name.clone());
                    push(&key("compute_capability"), format!("{major}.{minor}"));
                    push(&key("total_memory"), device.total_memory.to_string());
                    push(&key("pci_bus_id"), or_unknown(device.pci_bus_id.as_ref()));
                    push(
                        &key("gpu_direct_rdma"),
                        yes_no(device.gpu_direct_rdma).into(),
                    );
                    push(&key("dma_buf"), yes_no(device.dma_buf).into());
                }
            }
            CudaViability::NotViable(reason) => {
                push("cuda", "not viable".into());
                push("cuda.reason", ErrorChain(reason).to_string());
            }
        }
        fields
    }
}

fn or_unknown<T: fmt::Display>(value: Option<T>) -> String {
    value.map_or_else(|| "unknown".to_owned(), |v| v.to_string())
}

impl fmt::Display for ViabilityReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (key, value) in self.fields() {
            writeln!(f, "{key}: {value}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::{CudaDevice, CudaNotViable, CudaReport, DriverVersion, PeerMemory};
    use crate::ibv::select::IbvSelection;
    use crate::ibv::topology::{Gid, GidType, LinkLayer, Mtu};
    use crate::ibv::{IbvError, IbvNotViable};
    use std::io;

    #[test]
    fn not_viable_layout() {
        let report = ViabilityReport {
            ibv: IbvViability::NotViable(IbvNotViable::Verbs(IbvError::GetDeviceList {
                source: io::Error::from_raw_os_error(libc::ENOMEM),
            })),
            cuda: CudaViability::NotViable(CudaNotViable::NoDevices { source: None }),
        };
        let text = report.to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert_eq!(lines[0], "ibv: not viable");
        assert!(
            lines[1].starts_with("ibv.reason: ibv_get_device_list failed: "),
            "{text}"
        );
        assert_eq!(lines[2], "cuda: not viable");
        assert_eq!(lines[3], "cuda.reason: no CUDA device found");
    }

    #[test]
    fn viable_layout() {
        let report = ViabilityReport {
            ibv: IbvViability::Viable(IbvSelection {
                device: "mlx5_0".into(),
                port: 1,
                link_layer: LinkLayer::InfiniBand,
                lid: 12,
                gid: Gid([0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]),
                gid_index: 0,
                gid_type: GidType::InfiniBand,
                active_mtu: Some(Mtu::B4096),
                max_msg_size: 1 << 30,
                speed: None,
            }),
            cuda: CudaViability::Viable(CudaReport {
                driver_version: Some(DriverVersion(12080)),
                devices: vec![CudaDevice {
                    ordinal: 0,
                    name: "NVIDIA H100".into(),
                    compute_capability: (9, 0),
                    total_memory: 1 << 34,
                    pci_bus_id: None,
                    gpu_direct_rdma: Some(true),
                    dma_buf: Some(false),
                }],
                peer_memory: PeerMemory {
                    client: None,
                    evidence: None,
                },
            }),
        };
        let expected = "\
ibv: viable
ibv.device: mlx5_0
ibv.port: 1
ibv.link_layer: InfiniBand
ibv.lid: 12
ibv.gid: fe80::1
ibv.gid_index: 0
ibv.gid_type: IB
ibv.active_mtu: 4096
ibv.max_msg_size: 1073741824
ibv.speed: unknown
cuda: viable
cuda.driver_version: 12.8
cuda.device_count: 1
cuda.peer_memory: none
cuda.device.0.name: NVIDIA H100
cuda.device.0.compute_capability: 9.0
cuda.device.0.total_memory: 17179869184
cuda.device.0.pci_bus_id: unknown
cuda.device.0.gpu_direct_rdma: yes
cuda.device.0.dma_buf: no
";
        assert_eq!(report.to_string(), expected);
    }
}
