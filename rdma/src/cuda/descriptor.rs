//! Domain descriptors of the CUDA channels for [`rdzv_core::negotiate`].
//!
//! Negotiation offers a channel between two peers only when their descriptors are equal,
//! so each descriptor folds in exactly what must match for the channel to work:
//!
//! - `cuda_xth`: the same process: `cuda_xth:<boot id>_<pid namespace inode>_<pid>`
//!   (TensorPipe's process identifier).
//! - `cuda_ipc`: the same host (boot id) and the same IPC and PID namespace view, so that
//!   CUDA IPC handles can be opened: `cuda_ipc:<boot id>_<ipc namespace inode>`. Within one
//!   process this also matches, but `cuda_xth` outranks `cuda_ipc` (priority 400 vs 300)
//!   and is chosen there. Peer access between the two GPUs is not encoded (different
//!   processes may see different `CUDA_VISIBLE_DEVICES`); a host where it is missing must
//!   leave `cuda_ipc` out of its offer.
//! - `cuda_gdr`: `cuda_gdr:*`, any two hosts whose GPUDirect RDMA is viable (TensorPipe's
//!   `"*"`): the NIC handshake itself decides the rest.
//! - `cuda_basic`: the descriptor of the CPU channel it runs over, unchanged.
//!
//! The formatting functions are pure; [`HostIdentity::current`] reads `/proc`. This module
//! does not decide viability ([`viability`](super::viability)) or negotiate.

use std::io;

/// The facts about this process the descriptors are made of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostIdentity {
    /// `/proc/sys/kernel/random/boot_id`, trimmed.
    pub boot_id: String,
    /// Inode of `/proc/self/ns/pid`.
    pub pid_namespace: u64,
    /// Inode of `/proc/self/ns/ipc`.
    pub ipc_namespace: u64,
    /// This process's id.
    pub pid: u32,
}

impl HostIdentity {
    /// Reads the identity of the calling process from `/proc`.
    pub fn current() -> io::Result<HostIdentity> {
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?;
        let boot_id = boot_id.trim();
        if boot_id.is_empty() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "empty boot_id"));
        }
        Ok(HostIdentity {
            boot_id: boot_id.to_owned(),
            pid_namespace: namespace_inode("/proc/self/ns/pid")?,
            ipc_namespace: namespace_inode("/proc/self/ns/ipc")?,
            pid: std::process::id(),
        })
    }

    /// `cuda_xth:<boot id>_<pid ns>_<pid>`.
    pub fn xth_descriptor(&self) -> String {
        format!(
            "cuda_xth:{}_{}_{}",
            self.boot_id, self.pid_namespace, self.pid
        )
    }

    /// `cuda_ipc:<boot id>_<ipc ns>`.
    pub fn ipc_descriptor(&self) -> String {
        format!("cuda_ipc:{}_{}", self.boot_id, self.ipc_namespace)
    }
}

/// The `cuda_gdr` descriptor.
pub const GDR_DESCRIPTOR: &str = "cuda_gdr:*";

fn namespace_inode(path: &str) -> io::Result<u64> {
    let target = std::fs::read_link(path)?;
    let text = target.to_string_lossy();
    parse_namespace_link(&text).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{path} links to {text:?}, not <kind>:[<inode>]"),
        )
    })
}

/// The inode of a namespace link target such as `pid:[4026531836]`.
pub fn parse_namespace_link(target: &str) -> Option<u64> {
    let (_, rest) = target.split_once(":[")?;
    rest.strip_suffix(']')?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(pid: u32) -> HostIdentity {
        HostIdentity {
            boot_id: "0b5a3c7e-1f0e-4bb5-9d4e-2c8f0a6b7d11".into(),
            pid_namespace: 4026531836,
            ipc_namespace: 4026531839,
            pid,
        }
    }

    #[test]
    fn descriptors_match_exactly_where_the_channel_works() {
        let (a, b) = (identity(100), identity(200));
        assert_ne!(
            a.xth_descriptor(),
            b.xth_descriptor(),
            "xth: same process only"
        );
        assert_eq!(a.ipc_descriptor(), b.ipc_descriptor(), "ipc: same host");
        assert_eq!(
            a.xth_descriptor(),
            "cuda_xth:0b5a3c7e-1f0e-4bb5-9d4e-2c8f0a6b7d11_4026531836_100"
        );
        let other_host = HostIdentity {
            boot_id: "ffffffff-1f0e-4bb5-9d4e-2c8f0a6b7d11".into(),
            ..identity(100)
        };
        assert_ne!(a.ipc_descriptor(), other_host.ipc_descriptor());
        let other_ipc_ns = HostIdentity {
            ipc_namespace: 1,
            ..identity(100)
        };
        assert_ne!(a.ipc_descriptor(), other_ipc_ns.ipc_descriptor());
    }

    #[test]
    fn namespace_links() {
        assert_eq!(parse_namespace_link("pid:[4026531836]"), Some(4026531836));
        assert_eq!(parse_namespace_link("ipc:[1]"), Some(1));
        assert_eq!(parse_namespace_link("pid:4026531836"), None);
        assert_eq!(parse_namespace_link("pid:[x]"), None);
        assert_eq!(parse_namespace_link(""), None);
    }

    #[test]
    fn this_process_has_an_identity() {
        let me = HostIdentity::current().expect("/proc is mounted");
        assert_eq!(me.pid, std::process::id());
        assert!(me.xth_descriptor().ends_with(&format!("_{}", me.pid)));
    }
}
