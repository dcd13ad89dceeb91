//! The static group's start-up: the core's `StaticInit` (names, device maps, addresses,
//! barrier) driven against the store, starting the agent when it asks.

use std::sync::Arc;

use rdzv_core::rpc::startup::StaticInit;

use super::host::AgentHost;
use super::Start;
use crate::rpc::agent::RpcAgent;
use crate::rpc::drive::drive_start;
use crate::rpc::error::InitError;

pub(super) fn init_static(start: Start, world_size: u32) -> Result<RpcAgent, InitError> {
    let me = start.me.clone();
    let store = Arc::clone(&start.store);
    // Each wait for the other workers lasts what one blocking store call may.
    let timeout_ms = u64::try_from(store.timeout().as_millis()).unwrap_or(u64::MAX);
    let mut machine = StaticInit::new(&start.keys, &me, world_size, start.devices(), timeout_ms);
    let mut host = AgentHost::new(start, Some(world_size));
    drive_start(&*store, &mut host, me.name(), &mut machine)?;
    let agent = host.into_agent()?;
    tracing::info!(name = %me.name(), rank = me.id().get(), address = %agent.address, "RPC agent started");
    Ok(agent)
}
