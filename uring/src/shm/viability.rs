//! Whether the shm transport can work here, and with whom: the host identity (boot id
//! plus network namespace) and the domain descriptor built from it.
//!
//! Two endpoints may use shm only if their descriptors are equal, which
//! `rdzv_core::negotiate` checks: `shm:<boot_id>_<netns inode>`, TensorPipe's format.
//! The boot id tells hosts (and reboots) apart; the network namespace keeps containers
//! that share a kernel but not a network apart, since they cannot reach each other's
//! abstract UNIX sockets. Viability also needs a test allocation, as TensorPipe does: a
//! 1 MiB sealed memfd segment, mapped and unmapped (memfd can be refused by seccomp
//! policies or memory limits).
//!
//! This module reads `/proc`; it does not cache results, listen or connect.

use std::fmt;

use crate::host::{self, NET_NS_PATH};

use super::error::NotViable;
use super::segment::Segment;

/// The test allocation's data region: 1 MiB, as TensorPipe's.
const TEST_ALLOCATION: usize = 1 << 20;
/// The longest boot id accepted (the kernel writes a 36-character UUID).
pub(crate) const MAX_BOOT_ID_LEN: usize = 64;

/// What identifies "the same host" for shared memory: the kernel boot and the network
/// namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostIdentity {
    /// `/proc/sys/kernel/random/boot_id`, without the newline.
    pub boot_id: String,
    /// The inode number of `/proc/self/ns/net`.
    pub net_namespace: u64,
}

impl HostIdentity {
    /// Reads the identity of the host and namespace this process runs in.
    pub fn current() -> Result<HostIdentity, NotViable> {
        let (_, boot_id) = host::boot_id().map_err(|source| NotViable::Host { source })?;
        let net_namespace =
            host::namespace_inode(NET_NS_PATH).map_err(|source| NotViable::Host { source })?;
        Ok(HostIdentity {
            boot_id,
            net_namespace,
        })
    }

    /// The domain descriptor for this identity.
    pub fn descriptor(&self) -> DomainDescriptor {
        DomainDescriptor(format!("shm:{}_{}", self.boot_id, self.net_namespace))
    }
}

/// Whether `value` looks like a boot id: 1 to 64 hex digits and dashes.
pub(crate) fn valid_boot_id(value: &str) -> bool {
    (1..=MAX_BOOT_ID_LEN).contains(&value.len())
        && value.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

/// The shm transport's domain descriptor, `shm:<boot_id>_<netns>`: pass
/// [`DomainDescriptor::as_str`] to `rdzv_core::negotiate::Offer::add_transport` for
/// `TransportKind::Shm`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DomainDescriptor(String);

impl DomainDescriptor {
    /// The descriptor text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for DomainDescriptor {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for DomainDescriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Checks that the shm transport can work in this process and returns its domain
/// descriptor: the host identity must be readable and a 1 MiB segment must be
/// allocatable and mappable.
pub fn viability() -> Result<DomainDescriptor, NotViable> {
    let identity = HostIdentity::current()?;
    Segment::create(TEST_ALLOCATION).map_err(|source| NotViable::Allocation { source })?;
    Ok(identity.descriptor())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_has_tensorpipe_shape() {
        let identity = HostIdentity {
            boot_id: "6f2ad3f1-2b9e-4c55-9a43-0f3f5e1d7c01".into(),
            net_namespace: 4026531992,
        };
        assert_eq!(
            identity.descriptor().as_str(),
            "shm:6f2ad3f1-2b9e-4c55-9a43-0f3f5e1d7c01_4026531992"
        );
    }

    #[test]
    fn boot_id_validation() {
        assert!(valid_boot_id("6f2ad3f1-2b9e-4c55-9a43-0f3f5e1d7c01"));
        assert!(!valid_boot_id(""));
        assert!(!valid_boot_id("not a boot id"));
        assert!(!valid_boot_id(&"a".repeat(65)));
    }

    #[test]
    fn this_host_is_viable_and_stable() {
        let first = viability().expect("shm viable on a Linux test host");
        let second = viability().expect("shm viable on a Linux test host");
        assert_eq!(first, second);
        assert!(first.as_str().starts_with("shm:"));
    }
}
