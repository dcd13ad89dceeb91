//! `cuda_gdr` in the CUDA runtime of the agent: device memory lent over GPUDirect RDMA.
//!
//! The lender registers the tensor's allocation with the NIC
//! ([`GdrRegistrar`](crate::cuda::gdr::GdrRegistrar)) in the verbs domain of its
//! [`LendingEndpoint`], and the descriptor (`rdzv_core::channel::cuda::CudaGdrDescriptor`)
//! tells the peer the endpoint's address, the device address, the rkey and the length. The
//! borrower allocates memory on its target device, registers it in its own domain and
//! reads the lent range into it with one RDMA READ ([`Borrower::read_into`]): NIC to NIC,
//! device memory to device memory, without either host's memory or CPU in the data path.
//! The data path itself is [`crate::ibv::lending`], tested with host memory on Soft-RoCE.
//!
//! This module holds all of `cuda_gdr` in the runtime: whether to offer the channel
//! ([`gdr_offer`]), which address peers reach the endpoint at ([`advertised_ip`]), the
//! node (endpoint and borrower, [`GdrNode`]), the registered device memory a read lands
//! in ([`GdrTarget`]), the channel's state in the runtime ([`GdrState`]: the offer, the
//! node started on first use, a registrar per device) and its two sides ([`lend`],
//! [`borrow`]). Registering device memory with a NIC is [`crate::cuda::gdr`]'s (the
//! probe's viability uses it too). None of it has run against a GPU and
//! NIC (none on the development hosts): the decisions are unit-tested, the rest compiles.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use rdzv_core::channel::cuda::CudaGdrDescriptor;
use rdzv_core::channel::ProcessIdentity;

use std::sync::Mutex;

use rdzv_uring::rpc::{DeviceBuffer, DeviceLoan, DeviceMemory as _};

use super::device::DeviceState;
use super::{lock, Cause, CudaMemory};
use crate::cuda::gdr::{GdrError, GdrPath, GdrRegistrar, GdrRegistration};
use crate::cuda::memory::{CoveredDeviceMemory, DeviceAllocation, DeviceRange};
use crate::cuda::viability::{ChannelVerdict, CudaChannel, LendingRefused};
use crate::cuda::PeerMemory;
use crate::error_chain::ErrorChain;
use crate::ibv::connection::{ConnectionError, VerbsDomain};
use crate::ibv::lending::{Borrower, LendingEndpoint, LendingError, LendingOptions, ReadTarget};
use crate::ibv::sys::AccessFlags;
use crate::ibv::topology::Gid;
use crate::ibv::IbvSelection;
use crate::ibv::IbvViability;
use crate::sys::cuda::{DeviceRegistration, OwnedDeviceMemory};

/// Why `cuda_gdr` could not start, or a loan over it could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GdrLendingError {
    /// [`ENV_GDR_ADDR`] is set to something that is not an IP address.
    #[error("{ENV_GDR_ADDR}={value:?} is not an IP address for the cuda_gdr endpoint")]
    BadAddress {
        /// The variable's value.
        value: String,
    },
    /// The RDMA port's GID holds no IPv4 address (InfiniBand) and none was configured.
    #[error(
        "the RDMA port's GID {gid} holds no IPv4 address; set {ENV_GDR_ADDR} to this \
         host's address for the cuda_gdr endpoint"
    )]
    NoAddress {
        /// The GID, as an IPv6 address.
        gid: Ipv6Addr,
    },
    /// The peer's descriptor does not decode.
    #[error("malformed cuda_gdr descriptor from the peer")]
    Descriptor(#[source] rdzv_core::channel::DecodeError),
    /// The descriptor lends another length than the frame says.
    #[error("the cuda_gdr descriptor lends {lent} bytes, the frame says {len}")]
    LengthMismatch {
        /// Bytes the descriptor lends.
        lent: u64,
        /// Bytes the frame announces.
        len: u64,
    },
    /// The RDMA device could not be opened for the node.
    #[error("cuda_gdr: cannot open the RDMA device")]
    Device(#[source] Box<ConnectionError>),
    /// The lending endpoint could not start.
    #[error("cuda_gdr: cannot start the lending endpoint")]
    Endpoint(#[source] Box<LendingError>),
    /// The RDMA READ of a loan failed.
    #[error("cuda_gdr: reading {length} bytes lent by pid {pid} from its device {device}")]
    Read {
        /// Bytes lent.
        length: u64,
        /// The lender's process id.
        pid: u32,
        /// The lender's device ordinal.
        device: u32,
        /// The verb and its work completion status (e.g. `IBV_WC_REM_ACCESS_ERR`).
        #[source]
        source: Box<LendingError>,
    },
}

/// The environment variable naming the IP address peers reach this process's GDR endpoint
/// at (it wins over the address in a RoCE GID).
pub const ENV_GDR_ADDR: &str = "RDZV_GDR_ADDR";

/// What the registrations of `cuda_gdr` allow: the lender's peer READs them, the
/// borrower's READs write into them.
pub fn gdr_access() -> AccessFlags {
    AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ
}

/// `cuda_gdr`'s offer: its domain descriptor when the probe found it viable and this
/// process can be identified, else why not.
///
/// # Errors
/// [`LendingRefused`]: the probe's verdict, or the process's identity that could not be
/// read.
pub fn gdr_offer(
    verdict: Option<&ChannelVerdict>,
    process_known: Result<(), &str>,
) -> Result<String, LendingRefused> {
    let channel = CudaChannel::Gdr;
    match verdict {
        Some(ChannelVerdict::NotViable(reason)) => Err(LendingRefused::NotViable {
            channel,
            reason: reason.clone(),
        }),
        None => Err(LendingRefused::NotAssessed { channel }),
        Some(ChannelVerdict::Viable(_)) => match process_known {
            Ok(()) => Ok(crate::cuda::descriptor::GDR_DESCRIPTOR.to_owned()),
            Err(e) => Err(LendingRefused::Unidentified {
                channel,
                reason: e.to_owned(),
            }),
        },
    }
}

/// The address peers reach the GDR endpoint at: `configured` (the value of
/// [`ENV_GDR_ADDR`]) when set, else the IPv4 address of a RoCE v2 GID (`::ffff:a.b.c.d`).
/// InfiniBand GIDs carry no IP address: such hosts must set [`ENV_GDR_ADDR`].
///
/// # Errors
/// A `configured` value that is not an IP address, or neither source gives one.
pub fn advertised_ip(configured: Option<&str>, gid: Gid) -> Result<IpAddr, GdrLendingError> {
    if let Some(text) = configured {
        return text
            .trim()
            .parse::<IpAddr>()
            .map_err(|_| GdrLendingError::BadAddress {
                value: text.to_owned(),
            });
    }
    gid.ipv4_mapped()
        .map(IpAddr::V4)
        .ok_or_else(|| GdrLendingError::NoAddress { gid: gid.to_ipv6() })
}

/// Where the endpoint listens for peers that reach it at `advertised`: every address of
/// the same family, any port.
pub fn bind_address(advertised: IpAddr) -> SocketAddr {
    match advertised {
        IpAddr::V4(_) => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
        IpAddr::V6(_) => SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0),
    }
}

/// The loan a peer's `descriptor` announces, checked against the frame's `len` (untrusted
/// bytes: anything else is an error, never a panic).
///
/// # Errors
/// A malformed descriptor, or one that lends another length than the frame says.
pub fn check_descriptor(descriptor: &[u8], len: u64) -> Result<CudaGdrDescriptor, GdrLendingError> {
    let lent = CudaGdrDescriptor::decode(descriptor).map_err(GdrLendingError::Descriptor)?;
    if lent.length != len {
        return Err(GdrLendingError::LengthMismatch {
            lent: lent.length,
            len,
        });
    }
    Ok(lent)
}

/// One process's `cuda_gdr` node: the lending endpoint and the borrower, sharing one verbs
/// domain (registrations of both sides live there).
#[derive(Debug)]
pub struct GdrNode {
    endpoint: LendingEndpoint,
    advertised: SocketAddr,
    borrower: Borrower,
}

impl GdrNode {
    /// Opens `selection`'s device and starts the endpoint, reachable at `advertised`.
    ///
    /// # Errors
    /// The device cannot be opened ([`GdrLendingError::Device`]) or the listener made
    /// ([`GdrLendingError::Endpoint`]).
    pub fn open(selection: &IbvSelection, advertised: IpAddr) -> Result<GdrNode, GdrLendingError> {
        let domain =
            VerbsDomain::open(selection).map_err(|e| GdrLendingError::Device(Box::new(e)))?;
        let options = LendingOptions::default();
        let endpoint = LendingEndpoint::start(
            selection,
            domain.clone(),
            bind_address(advertised),
            &options,
        )
        .map_err(|e| GdrLendingError::Endpoint(Box::new(e)))?;
        let advertised = SocketAddr::new(advertised, endpoint.local_addr().port());
        Ok(GdrNode {
            endpoint,
            advertised,
            borrower: Borrower::new(selection, domain, options),
        })
    }

    /// The verbs domain both sides register in.
    pub fn domain(&self) -> &VerbsDomain {
        self.endpoint.domain()
    }

    /// The endpoint's address as peers reach it.
    pub fn advertised(&self) -> SocketAddr {
        self.advertised
    }

    /// The descriptor of a loan by `process` of `length` bytes at `address`, registered
    /// under `rkey` in this node's domain, on device `device`.
    pub fn descriptor(
        &self,
        process: ProcessIdentity,
        address: u64,
        rkey: u32,
        length: u64,
        device: u32,
    ) -> Vec<u8> {
        CudaGdrDescriptor {
            process,
            endpoint_addr: CudaGdrDescriptor::encode_ip(self.advertised.ip()),
            endpoint_port: self.advertised.port(),
            address,
            rkey,
            length,
            device,
        }
        .encode()
        .to_vec()
    }

    /// Reads the loan `lent` (from [`check_descriptor`]) into `target`, registered in this
    /// node's domain, and hands it back filled.
    ///
    /// # Errors
    /// [`GdrLendingError::Read`]: it names the lender, and its source the verb and the
    /// work completion status (e.g. `IBV_WC_REM_ACCESS_ERR`).
    pub fn read<T: ReadTarget>(
        &self,
        lent: &CudaGdrDescriptor,
        target: T,
    ) -> Result<T, GdrLendingError> {
        let lender = SocketAddr::new(lent.endpoint_ip(), lent.endpoint_port);
        self.borrower
            .read_into(lender, target, lent.address, lent.rkey)
            .map_err(|source| GdrLendingError::Read {
                length: lent.length,
                pid: lent.process.pid,
                device: lent.device,
                source: Box::new(source),
            })
    }
}

/// Fresh device memory registered for a read to land in (the registration goes before
/// the memory; the `ReadTarget` impl is `sys::cuda`'s, beside the coverage check).
pub type GdrTarget = CoveredDeviceMemory<Arc<GdrRegistration>, CudaMemory>;

impl DeviceRegistration for Arc<GdrRegistration> {
    fn lkey(&self) -> u32 {
        GdrRegistration::lkey(self)
    }

    fn registered(&self) -> (u64, u64) {
        self.range()
    }
}

impl OwnedDeviceMemory for CudaMemory {
    fn device_range(&self) -> DeviceRange<'_> {
        self.range()
    }
}

impl CoveredDeviceMemory<Arc<GdrRegistration>, CudaMemory> {
    /// `memory`, registered by `registration`, which must be in the borrower's domain
    /// with local write access ([`gdr_access`]; otherwise the NIC fails the read) and
    /// must cover it (checked: the NIC writes where the registration says).
    ///
    /// # Errors
    /// [`GdrError::NotCovered`] when the registration does not cover the memory.
    pub fn new(
        registration: Arc<GdrRegistration>,
        memory: CudaMemory,
    ) -> Result<GdrTarget, GdrError> {
        CoveredDeviceMemory::covering(registration, memory).map_err(
            |(_, _, (base, registered), (ptr, len))| GdrError::NotCovered {
                ptr,
                len,
                base,
                registered,
            },
        )
    }

    /// The memory, its registration released.
    pub fn into_memory(self) -> CudaMemory {
        let (registration, memory) = self.into_parts();
        drop(registration);
        memory
    }
}

/// What the runtime keeps for `cuda_gdr`: its offer, the probe's registration path per
/// device, the GDR node (started on first use) and one registrar per device.
#[derive(Debug)]
pub(super) struct GdrState {
    /// `cuda_gdr`'s domain descriptor, or why it cannot run.
    pub(super) offer: Result<String, LendingRefused>,
    /// Each device's registration path (from the probe), by ordinal.
    paths: Vec<GdrPath>,
    peer_memory: PeerMemory,
    node: Mutex<Option<Arc<GdrNode>>>,
    registrars: Mutex<Vec<Option<GdrRegistrar>>>,
}

impl GdrState {
    /// The state for `count` devices: offered per `verdict` (the probe's) when the
    /// process is known.
    pub(super) fn new(
        verdict: Option<&ChannelVerdict>,
        process_known: Result<(), &str>,
        peer_memory: PeerMemory,
        count: usize,
    ) -> GdrState {
        let paths = match verdict {
            Some(ChannelVerdict::Viable(paths)) => paths.clone(),
            _ => Vec::new(),
        };
        GdrState {
            offer: gdr_offer(verdict, process_known),
            paths,
            peer_memory,
            node: Mutex::new(None),
            registrars: Mutex::new((0..count).map(|_| None).collect()),
        }
    }

    /// The GDR node, started now if this is the first use; only when `cuda_gdr` is
    /// offered.
    fn node(&self) -> Result<Arc<GdrNode>, Cause> {
        self.offer
            .as_ref()
            .map_err(|refused| Cause::from(refused.clone()))?;
        let mut node = lock(&self.node);
        if let Some(node) = node.as_ref() {
            return Ok(Arc::clone(node));
        }
        let selection = match crate::ibv::probe_env() {
            IbvViability::Viable(selection) => selection,
            IbvViability::NotViable(reason) => {
                return Err(
                    format!("cuda_gdr: no usable RDMA device: {}", ErrorChain(&reason)).into(),
                )
            }
        };
        let configured = std::env::var(ENV_GDR_ADDR).ok();
        let advertised = advertised_ip(configured.as_deref(), selection.gid)?;
        let started = Arc::new(GdrNode::open(&selection, advertised)?);
        tracing::info!(
            endpoint = %started.advertised(),
            device = %selection.device,
            "cuda_gdr endpoint started"
        );
        *node = Some(Arc::clone(&started));
        Ok(started)
    }

    /// A registration of the whole allocation `allocation` of device `ordinal` in the GDR
    /// node's domain, held only by the caller (dropping it deregisters).
    fn register(
        &self,
        node: &GdrNode,
        ordinal: usize,
        allocation: &DeviceAllocation,
    ) -> Result<Arc<GdrRegistration>, Cause> {
        let gpu = allocation.gpu().clone();
        let path = *self.paths.get(ordinal).ok_or_else(|| {
            format!("cuda_gdr: the probe found no registration path for CUDA device {ordinal}")
        })?;
        let mut registrars = lock(&self.registrars);
        let slot = registrars
            .get_mut(ordinal)
            .ok_or_else(|| format!("cuda_gdr: no CUDA device {ordinal}"))?;
        let registrar = slot.get_or_insert_with(|| {
            GdrRegistrar::new(
                Arc::clone(node.domain().pd()),
                &gpu,
                path,
                &self.peer_memory,
                gdr_access(),
                1,
            )
        });
        let registration = registrar.register(allocation.range()).map_err(Cause::from);
        // Nothing stays cached: the caller's handle is the only one, so the registration
        // ends with the loan (or the read), before the allocation can be freed.
        registrar.forget_all();
        registration
    }
}

/// `cuda_gdr`'s lending side: registers `own`'s allocation (complete: the peer's NIC
/// reads it once this returns) and describes it for the peer; the loan holds the
/// registration and `memory` until the peer answered.
pub(super) fn lend(
    gdr: &GdrState,
    process: ProcessIdentity,
    memory: &DeviceBuffer,
    own: &CudaMemory,
) -> Result<DeviceLoan, Cause> {
    let device = u32::from(own.device.index().unwrap_or(0));
    let length = own.len as u64;
    let node = gdr.node()?;
    let address = own.range().ptr();
    let registration = if length == 0 {
        None
    } else {
        let ordinal = super::cuda_ordinal(own.device)?;
        Some(gdr.register(&node, ordinal, own.allocation())?)
    };
    let rkey = registration.as_ref().map_or(0, |r| r.rkey());
    let descriptor = node.descriptor(process, address, rkey, length, device);
    // The registration goes before the memory (tuple fields drop in order); both live
    // until the peer answered.
    Ok(DeviceLoan {
        descriptor,
        hold: Box::new((registration, memory.clone())),
    })
}

/// `cuda_gdr`'s borrowing side: `len` bytes lent as `descriptor`, read with one RDMA READ
/// into fresh memory of `state` (device `ordinal`), registered in the node's domain.
pub(super) fn borrow(
    gdr: &GdrState,
    state: &DeviceState,
    ordinal: usize,
    len: u64,
    descriptor: &[u8],
) -> Result<DeviceBuffer, Cause> {
    let lent = check_descriptor(descriptor, len)?;
    let len = usize::try_from(len).map_err(|_| format!("{len} bytes do not fit here"))?;
    let memory = state.alloc(len)?;
    if memory.is_empty() {
        return Ok(DeviceBuffer::new(memory));
    }
    let node = gdr.node()?;
    let registration = gdr.register(&node, ordinal, memory.allocation())?;
    let target = GdrTarget::new(registration, memory)?;
    let filled = node.read(&lent, target)?;
    Ok(DeviceBuffer::new(filled.into_memory()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::viability::ChannelNotViable;
    use crate::sys::cuda::covers;

    #[test]
    fn a_target_must_lie_inside_its_registration() {
        assert!(covers((0x1000, 0x100), (0x1000, 0x100)));
        assert!(covers((0x1000, 0x100), (0x1080, 0x10)));
        assert!(!covers((0x1000, 0x100), (0x0fff, 0x10)), "starts before");
        assert!(!covers((0x1000, 0x100), (0x10f8, 0x10)), "ends after");
        assert!(
            !covers((u64::MAX - 4, 8), (u64::MAX - 4, 1)),
            "overflowing registration"
        );
        assert!(!covers((0, u64::MAX), (u64::MAX, 2)), "overflowing target");
    }

    #[test]
    fn descriptors_are_checked_against_the_frame() {
        let lent = CudaGdrDescriptor {
            process: ProcessIdentity {
                boot_id: [1; 16],
                pid_namespace: 2,
                user_namespace: 3,
                pid: 4,
                start_time: 5,
            },
            endpoint_addr: CudaGdrDescriptor::encode_ip(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            endpoint_port: 4000,
            address: 0x1000,
            rkey: 9,
            length: 64,
            device: 0,
        };
        let bytes = lent.encode();
        assert_eq!(check_descriptor(&bytes, 64).ok(), Some(lent));
        let reason = check_descriptor(&bytes, 65).unwrap_err().to_string();
        assert!(
            reason.contains("lends 64 bytes, the frame says 65"),
            "{reason}"
        );
        assert!(check_descriptor(&bytes[1..], 64).is_err());
        assert!(check_descriptor(b"cuda_gdr", 8).is_err());
    }

    #[test]
    fn offered_only_when_viable_and_identified() {
        let viable = ChannelVerdict::Viable(Vec::new());
        assert_eq!(
            gdr_offer(Some(&viable), Ok(())),
            Ok("cuda_gdr:*".to_owned())
        );
        let no_nic =
            ChannelVerdict::NotViable(ChannelNotViable::NoRdmaDevice("no device".to_owned()));
        let reason = gdr_offer(Some(&no_nic), Ok(())).unwrap_err().to_string();
        assert!(reason.starts_with("cuda_gdr: not viable:"), "{reason}");
        assert!(reason.contains("no device"), "{reason}");
        assert_eq!(
            gdr_offer(None, Ok(())),
            Err(LendingRefused::NotAssessed {
                channel: CudaChannel::Gdr
            })
        );
        let reason = gdr_offer(Some(&viable), Err("no /proc")).unwrap_err();
        assert!(matches!(reason, LendingRefused::Unidentified { .. }));
        assert!(reason.to_string().contains("no /proc"), "{reason}");
    }

    #[test]
    fn the_endpoint_address_comes_from_the_environment_or_a_roce_gid() {
        let mut roce = [0u8; 16];
        roce[10] = 0xff;
        roce[11] = 0xff;
        roce[12..].copy_from_slice(&[192, 168, 7, 9]);
        let roce = Gid(roce);
        let mut ib = [0u8; 16];
        ib[0] = 0xfe;
        ib[1] = 0x80;
        ib[15] = 1;
        let ib = Gid(ib);
        assert_eq!(
            advertised_ip(None, roce).ok(),
            Some(IpAddr::V4(Ipv4Addr::new(192, 168, 7, 9)))
        );
        assert_eq!(
            advertised_ip(Some(" 10.0.0.2 "), roce).ok(),
            Some(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)))
        );
        assert_eq!(
            advertised_ip(Some("fd00::5"), ib).ok(),
            Some("fd00::5".parse::<IpAddr>().unwrap())
        );
        let reason = advertised_ip(None, ib).unwrap_err().to_string();
        assert!(reason.contains(ENV_GDR_ADDR), "{reason}");
        assert!(advertised_ip(Some("host.example"), roce).is_err());
        assert_eq!(
            bind_address("fd00::5".parse().unwrap()),
            "[::]:0".parse().unwrap()
        );
        assert_eq!(
            bind_address(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            "0.0.0.0:0".parse().unwrap()
        );
    }
}
