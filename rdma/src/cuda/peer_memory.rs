//! Whether a GPU peer-memory client is loaded, the kernel side of GPUDirect RDMA "path A"
//! (register a `cuMemAlloc` pointer with plain `ibv_reg_mr`).
//!
//! This module decides what counts as evidence of the client: NVIDIA's `nvidia-peermem`
//! (driver R470 and later) or Mellanox OFED's older `nv_peer_mem`, found through the
//! `memory_peers` sysfs entry that NCCL and TensorPipe check, `/sys/module`, or
//! `/proc/modules`. [`detect_with`] is pure over a path-existence check and the text of
//! `/proc/modules`; [`detect`] feeds it from the real filesystem. It does not check the
//! other route ("path B", dma-buf), which is a per-device CUDA attribute reported by
//! [`probe`](super::probe), nor whether the NIC's driver accepts peer memory.

use std::fmt;
use std::path::Path;

/// A kernel module that lets RDMA NICs register GPU memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerMemoryClient {
    /// `nvidia-peermem` (module `nvidia_peermem`), shipped with NVIDIA drivers since R470.
    NvidiaPeermem,
    /// `nv_peer_mem`, the older module from Mellanox OFED.
    NvPeerMem,
}

impl fmt::Display for PeerMemoryClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PeerMemoryClient::NvidiaPeermem => "nvidia-peermem",
            PeerMemoryClient::NvPeerMem => "nv_peer_mem",
        })
    }
}

/// What [`detect`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerMemory {
    /// The client found, if any.
    pub client: Option<PeerMemoryClient>,
    /// Where it was found (a path, or `/proc/modules`).
    pub evidence: Option<&'static str>,
}

impl PeerMemory {
    /// Whether a peer-memory client is loaded.
    pub fn is_loaded(&self) -> bool {
        self.client.is_some()
    }
}

impl fmt::Display for PeerMemory {
    /// `nvidia-peermem (/sys/module/nvidia_peermem)` or `none`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.client, self.evidence) {
            (Some(client), Some(evidence)) => write!(f, "{client} ({evidence})"),
            (Some(client), None) => write!(f, "{client}"),
            (None, _) => f.write_str("none"),
        }
    }
}

const PROC_MODULES: &str = "/proc/modules";

/// Paths whose existence proves a client is loaded, most authoritative first.
const PATH_EVIDENCE: [(&str, PeerMemoryClient); 4] = [
    (
        "/sys/kernel/mm/memory_peers/nvidia-peermem/version",
        PeerMemoryClient::NvidiaPeermem,
    ),
    (
        "/sys/module/nvidia_peermem",
        PeerMemoryClient::NvidiaPeermem,
    ),
    (
        "/sys/kernel/mm/memory_peers/nv_mem/version",
        PeerMemoryClient::NvPeerMem,
    ),
    ("/sys/module/nv_peer_mem", PeerMemoryClient::NvPeerMem),
];

/// Detects the client on this host.
pub fn detect() -> PeerMemory {
    let proc_modules = std::fs::read_to_string(PROC_MODULES).ok();
    detect_with(|path| Path::new(path).exists(), proc_modules.as_deref())
}

/// Detects the client from `exists` (does this absolute path exist?) and the text of
/// `/proc/modules` (`None` when it cannot be read, e.g. a kernel without module support).
pub fn detect_with(exists: impl Fn(&str) -> bool, proc_modules: Option<&str>) -> PeerMemory {
    for (path, client) in PATH_EVIDENCE {
        if exists(path) {
            return PeerMemory {
                client: Some(client),
                evidence: Some(path),
            };
        }
    }
    let loaded = |module: &str| {
        proc_modules.is_some_and(|text| {
            text.lines()
                .any(|line| line.split_whitespace().next() == Some(module))
        })
    };
    let client = if loaded("nvidia_peermem") {
        Some(PeerMemoryClient::NvidiaPeermem)
    } else if loaded("nv_peer_mem") {
        Some(PeerMemoryClient::NvPeerMem)
    } else {
        None
    };
    PeerMemory {
        client,
        evidence: client.map(|_| PROC_MODULES),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODULES: &str = "nvidia_uvm 1523712 2 - Live 0x0000000000000000 (POE)\n\
                           nvidia 56717312 170 nvidia_uvm, Live 0x0000000000000000 (POE)\n";

    #[test]
    fn nothing_found() {
        let found = detect_with(|_| false, Some(MODULES));
        assert_eq!(
            found,
            PeerMemory {
                client: None,
                evidence: None
            }
        );
        assert!(!found.is_loaded());
        assert_eq!(found.to_string(), "none");
        assert!(!detect_with(|_| false, None).is_loaded());
    }

    #[test]
    fn memory_peers_entry_wins() {
        let found = detect_with(
            |p| p.starts_with("/sys/kernel/mm/memory_peers/nvidia-peermem"),
            None,
        );
        assert_eq!(found.client, Some(PeerMemoryClient::NvidiaPeermem));
        assert_eq!(
            found.to_string(),
            "nvidia-peermem (/sys/kernel/mm/memory_peers/nvidia-peermem/version)"
        );
    }

    #[test]
    fn sys_module_entry() {
        let found = detect_with(|p| p == "/sys/module/nv_peer_mem", None);
        assert_eq!(found.client, Some(PeerMemoryClient::NvPeerMem));
    }

    #[test]
    fn proc_modules_needs_an_exact_module_name() {
        let with = format!("{MODULES}nvidia_peermem 16384 0 - Live 0x0 (POE)\n");
        let found = detect_with(|_| false, Some(&with));
        assert_eq!(found.client, Some(PeerMemoryClient::NvidiaPeermem));
        assert_eq!(found.evidence, Some("/proc/modules"));
        // A module whose name merely starts with the client's name does not count.
        let lookalike = "nvidia_peermem_extra 16384 0 - Live 0x0\n";
        assert!(!detect_with(|_| false, Some(lookalike)).is_loaded());
        let old = "nv_peer_mem 16384 0 - Live 0x0\n";
        assert_eq!(
            detect_with(|_| false, Some(old)).client,
            Some(PeerMemoryClient::NvPeerMem)
        );
    }
}
