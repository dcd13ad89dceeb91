//! What the core's start-up machines ask of the agent they start: listen (start the
//! agent), install the group, call a member. The store operations are `drive`'s.

use rdzv_core::device_map::DeviceMaps;
use rdzv_core::rpc::startup::StartupGroup;

use super::Start;
use crate::rpc::agent::RpcAgent;
use crate::rpc::drive::StartHost;
use crate::rpc::error::InitError;
use crate::rpc::message::Message;
use crate::rpc::registry::{Group, Peer};

/// The agent being started: first what it starts from, then the running agent.
pub(super) struct AgentHost {
    start: Option<Start>,
    world_size: Option<u32>,
    device_maps: DeviceMaps,
    agent: Option<RpcAgent>,
}

impl AgentHost {
    pub(super) fn new(start: Start, world_size: Option<u32>) -> AgentHost {
        AgentHost {
            device_maps: start.options.device_maps.clone(),
            start: Some(start),
            world_size,
            agent: None,
        }
    }

    fn agent(&self) -> Result<&RpcAgent, InitError> {
        self.agent
            .as_ref()
            .ok_or_else(|| InitError::Internal("it used the agent before starting it"))
    }

    /// The started agent, once the machine is done.
    pub(super) fn into_agent(self) -> Result<RpcAgent, InitError> {
        self.agent
            .ok_or_else(|| InitError::Internal("it finished without starting the agent"))
    }
}

impl StartHost for AgentHost {
    type Error = InitError;

    fn listen(&mut self) -> Result<String, InitError> {
        let start = self
            .start
            .take()
            .ok_or_else(|| InitError::Internal("it asked to start the agent twice"))?;
        let agent = start.start_agent(self.world_size)?;
        let address = agent.address.clone();
        self.agent = Some(agent);
        Ok(address)
    }

    fn install(&mut self, group: &StartupGroup) -> Result<(), InitError> {
        let peers = group
            .peers
            .iter()
            .map(|p| {
                (
                    p.name.clone(),
                    Peer {
                        id: p.id,
                        address: p.address.clone(),
                    },
                )
            })
            .collect();
        *self.agent()?.dispatch.registry.group_mut() = Group {
            peers,
            device_maps: self.device_maps.clone(),
            reverse_device_maps: group.reverse_device_maps.clone(),
        };
        Ok(())
    }

    fn call(&mut self, to: &str, method: &str, payload: &[u8]) -> Result<(), InitError> {
        self.agent()?
            .rpc_sync(to, method, Message::from_payload(payload.to_vec()))
            .map(|_| ())
            .map_err(InitError::from)
    }
}
