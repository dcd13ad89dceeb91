//! `cuda_gdr` through the RPC agent between two processes, on a verbs device without a
//! GPU: both workers plug in a device runtime whose "CUDA memory" is host memory and
//! which lends and borrows it exactly as the CUDA runtime does, minus CUDA: a
//! `GdrNode` (lending endpoint and borrower), loans described by `CudaGdrDescriptor`s
//! (`GdrNode::descriptor`), checked (`check_descriptor`) and fetched with one-sided RDMA
//! READs (`GdrNode::read`). Only its registrations differ: host memory (`HostRegion`) for
//! `GdrRegistrar`'s device memory. Echo round trips carry tensors of 0 B, 1 B,
//! 1 MiB + 3 and 8 MiB on `cuda:0` both ways, verified byte for byte, and the agent counts
//! their bytes on `cuda_gdr`, none on `cuda_basic`.
//!
//! The second process is this test binary, re-run with `RDZV_GDR_RPC_CHILD` set. Skipped
//! (with the reason) on hosts without verbs; `rdma/softroce/run` runs it in a Soft-RoCE VM,
//! where a missing device fails it.

mod verbs_env;

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

use rdzv_core::device::{Device, DeviceType};
use rdzv_core::device_map::{DeviceMap, DeviceMaps};
use rdzv_core::negotiate::ChannelKind;
use rdzv_rdma::cuda::agent::gdr::{check_descriptor, GdrNode};
use rdzv_rdma::ibv::lending::HostRegion;
use rdzv_rdma::ibv::sys::AccessFlags;
use rdzv_rdma::ibv::IbvSelection;
use rdzv_uring::rpc::{
    init_rpc, CallContext, ChannelUnavailable, DeviceBuffer, DeviceError, DeviceErrorSource,
    DeviceLoan, DeviceOp, DevicePlugin, DeviceRuntime, HostBytes, HostMemory, Message, RpcAgent,
    RpcOptions, Tensor,
};

const CHILD_ENV: &str = "RDZV_GDR_RPC_CHILD";
const STORE_ENV: &str = "RDZV_GDR_RPC_STORE";
const TEST: &str = "cuda_tensors_move_over_cuda_gdr_between_two_processes";
const SIZES: [usize; 4] = [0, 1, (1 << 20) + 3, 8 << 20];

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29) ^ seed ^ (i >> 12) as u8)
        .collect()
}

/// A one-device "CUDA" runtime whose lending channel is `cuda_gdr`, over a real GDR node.
struct HostGdr {
    node: GdrNode,
}

impl HostGdr {
    fn bytes(memory: &DeviceBuffer) -> Result<&[u8], String> {
        memory
            .downcast_ref::<HostMemory>()
            .map(|m| m.bytes())
            .ok_or_else(|| "not memory of this runtime".to_string())
    }
}

impl DeviceRuntime for HostGdr {
    fn device_count(&self) -> usize {
        1
    }

    fn copy_to_host(&self, memory: &DeviceBuffer) -> Result<HostBytes, DeviceError> {
        Self::bytes(memory)
            .map(|bytes| bytes.to_vec().into())
            .map_err(|e| DeviceError::new(DeviceOp::CopyToHost, e))
    }

    fn copy_from_host(&self, device: Device, bytes: Vec<u8>) -> Result<DeviceBuffer, DeviceError> {
        Ok(DeviceBuffer::new(HostMemory::new(device, bytes)))
    }

    fn lending_channels(&self) -> Vec<(ChannelKind, Result<String, ChannelUnavailable>)> {
        vec![(
            ChannelKind::CudaGdr,
            Ok(rdzv_rdma::cuda::descriptor::GDR_DESCRIPTOR.to_string()),
        )]
    }

    fn lend(&self, channel: ChannelKind, memory: &DeviceBuffer) -> Result<DeviceLoan, DeviceError> {
        self.lend_bytes(channel, memory)
            .map_err(|e| DeviceError::new(DeviceOp::Lend, e))
    }

    fn borrow(
        &self,
        channel: ChannelKind,
        device: Device,
        len: u64,
        descriptor: &[u8],
    ) -> Result<DeviceBuffer, DeviceError> {
        self.borrow_bytes(channel, len, descriptor)
            .map_err(|e| DeviceError::new(DeviceOp::Borrow, e))
            .and_then(|bytes| self.copy_from_host(device, bytes))
    }
}

impl HostGdr {
    fn lend_bytes(
        &self,
        channel: ChannelKind,
        memory: &DeviceBuffer,
    ) -> Result<DeviceLoan, String> {
        if channel != ChannelKind::CudaGdr {
            return Err(format!("asked to lend over {channel}, not offered"));
        }
        let bytes = Self::bytes(memory)?;
        let process = rdzv_uring::channel::current_identity().map_err(|e| e.to_string())?;
        // As the CUDA runtime registers the allocation per loan, this registers a copy.
        let region = if bytes.is_empty() {
            None
        } else {
            Some(
                HostRegion::from_bytes(self.node.domain(), bytes, AccessFlags::REMOTE_READ)
                    .map_err(|e| e.to_string())?,
            )
        };
        let (address, rkey) = region.as_ref().map_or((0, 0), |r| (r.addr(), r.rkey()));
        Ok(DeviceLoan {
            descriptor: self
                .node
                .descriptor(process, address, rkey, bytes.len() as u64, 0),
            hold: Box::new(region),
        })
    }

    fn borrow_bytes(
        &self,
        channel: ChannelKind,
        len: u64,
        descriptor: &[u8],
    ) -> Result<Vec<u8>, DeviceErrorSource> {
        if channel != ChannelKind::CudaGdr {
            return Err(format!("asked to borrow over {channel}, not offered").into());
        }
        let lent = check_descriptor(descriptor, len)?;
        let len = usize::try_from(len)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        let target = HostRegion::new(self.node.domain(), len, AccessFlags::LOCAL_WRITE)?;
        let filled = self.node.read(&lent, target)?;
        Ok(filled.to_vec())
    }
}

struct HostGdrPlugin(IbvSelection);

impl DevicePlugin for HostGdrPlugin {
    fn device_type(&self) -> DeviceType {
        DeviceType::Cuda
    }
    fn open(&self) -> Result<Arc<dyn DeviceRuntime>, DeviceError> {
        let node = GdrNode::open(&self.0, IpAddr::V4(Ipv4Addr::LOCALHOST))
            .map_err(|e| DeviceError::new(DeviceOp::Open, e))?;
        Ok(Arc::new(HostGdr { node }))
    }
}

fn echo(_: &CallContext, m: Message) -> Result<Message, String> {
    Ok(m)
}

fn options(url: &str, selection: &IbvSelection) -> RpcOptions {
    let mut options = RpcOptions::new(url).with_handler("echo", echo);
    options.listen_host = Some([127, 0, 0, 1].into());
    options.init_counter = Some(0);
    options.num_worker_threads = 2;
    options.rpc_timeout = Duration::from_secs(120);
    options.transports = Some(vec!["tcp".into()]);
    options.device_plugins = vec![Arc::new(HostGdrPlugin(selection.clone()))];
    options
}

fn bytes_on(agent: &RpcAgent, channel: ChannelKind) -> u64 {
    agent
        .tensor_bytes_by_channel()
        .into_iter()
        .find(|&(kind, _)| kind == channel)
        .map_or(0, |(_, bytes)| bytes)
}

#[test]
fn cuda_tensors_move_over_cuda_gdr_between_two_processes() {
    let Some(selection) = verbs_env::selection_or_skip(TEST) else {
        return;
    };
    if std::env::var_os(CHILD_ENV).is_some() {
        rdzv_test_support::exit_when_parent_gone();
        let url = std::env::var(STORE_ENV).unwrap_or_else(|_| panic!("{STORE_ENV} is not set"));
        let agent = init_rpc("peer", 1, Some(2), options(&url, &selection))
            .unwrap_or_else(|e| panic!("child init_rpc: {e}"));
        agent.join().unwrap_or_else(|e| panic!("child join: {e}"));
        return;
    }
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let url = format!("file://{}", dir.path().join("store").display());
    let mut child = rdzv_test_support::Peer::spawn_test(
        TEST,
        &["--test-threads=1"],
        &[(CHILD_ENV, "1"), (STORE_ENV, url.as_str())],
    );
    let mut options = options(&url, &selection);
    let mut maps = DeviceMaps::new();
    maps.insert(
        "peer",
        DeviceMap::from_iter([(Device::cuda(0), Device::cuda(0))]),
    );
    options.device_maps = maps;
    let agent = match init_rpc("main", 0, Some(2), options) {
        Ok(agent) => agent,
        Err(e) => {
            drop(child);
            panic!("parent init_rpc: {e}");
        }
    };
    let mut sent = 0u64;
    for (n, len) in SIZES.into_iter().enumerate() {
        let data = pattern(len, n as u8);
        let memory = DeviceBuffer::new(HostMemory::new(Device::cuda(0), data.clone()));
        let request = Message::from_payload(format!("{len}").into_bytes())
            .with_tensor(Tensor::on_device(memory));
        let reply = agent
            .rpc_sync("peer", "echo", request)
            .unwrap_or_else(|e| panic!("echo of a {len}-byte cuda:0 tensor: {e}"));
        let tensor = reply.tensors.first().expect("the tensor comes back");
        assert_eq!(tensor.device, Device::cuda(0));
        let memory = tensor.memory.as_ref().expect("device memory");
        let got = memory
            .downcast_ref::<HostMemory>()
            .map(|m| m.bytes().to_vec())
            .expect("memory of this runtime");
        assert!(
            got == data,
            "the {len}-byte tensor differs after the round trip"
        );
        sent += len as u64;
    }
    let on_gdr = bytes_on(&agent, ChannelKind::CudaGdr);
    let on_basic = bytes_on(&agent, ChannelKind::CudaBasic);
    println!("tensor bytes: cuda_gdr {on_gdr}, cuda_basic {on_basic}");
    assert!(on_gdr >= sent, "cuda_gdr carried {on_gdr} of {sent} bytes");
    assert_eq!(on_basic, 0, "nothing staged through cuda_basic");
    agent.join().unwrap_or_else(|e| panic!("parent join: {e}"));
    let status = child.wait(Duration::from_secs(60));
    assert!(status.success(), "the child failed: {status}");
}
