//! A dynamic group's join, and the members' handlers for joins and leaves.

use std::sync::Arc;

use rdzv_core::device_map::{create_reverse_mapping, DeviceMaps};
use rdzv_core::rpc::membership::{decode_leave, JoinAnnouncement, GROUP_JOIN, GROUP_LEAVE};
use rdzv_core::rpc::name::WorkerId;
use rdzv_core::rpc::startup::DynamicJoin;

use super::host::AgentHost;
use super::Start;
use crate::rpc::agent::RpcAgent;
use crate::rpc::drive::drive_start;
use crate::rpc::error::InitError;
use crate::rpc::message::Message;
use crate::rpc::registry::{Peer, Registry};

/// A dynamic member's join, under the group token: the core's `DynamicJoin` (claim the
/// rank, read the members, check device maps, start, tell every member, list this
/// worker) driven against the store.
pub(super) fn join_dynamic(start: Start) -> Result<RpcAgent, InitError> {
    let me = start.me.clone();
    let store = Arc::clone(&start.store);
    let mut machine = DynamicJoin::new(&start.keys, &me, start.devices());
    let mut host = AgentHost::new(start, None);
    drive_start(&*store, &mut host, me.name(), &mut machine)?;
    let agent = host.into_agent()?;
    tracing::info!(name = %me.name(), members = machine.members().count(), "RPC agent joined a dynamic group");
    Ok(agent)
}

/// `_update_group_membership` for joins and leaves, as handlers of worker `me` that hold
/// the registry weakly (the registry owns its handlers).
pub(super) fn register_membership_handlers(registry: &Arc<Registry>, me: &str) {
    let weak = Arc::downgrade(registry);
    let me = me.to_string();
    let join = move |_: &crate::rpc::CallContext, m: Message| -> Result<Message, String> {
        let registry = weak.upgrade().ok_or("the agent is gone")?;
        let JoinAnnouncement {
            name,
            id,
            address,
            devices,
        } = JoinAnnouncement::decode(&m.payload).map_err(|e| e.to_string())?;
        let reverse = create_reverse_mapping(&me, std::slice::from_ref(&devices));
        let mut group = registry.group_mut();
        group.peers.insert(
            name.clone(),
            Peer {
                id: WorkerId::from(id),
                address,
            },
        );
        if let Some(map) = reverse.get(&name) {
            group.reverse_device_maps.insert(name, map.clone());
        }
        Ok(Message::default())
    };
    let weak = Arc::downgrade(registry);
    let leave = move |_: &crate::rpc::CallContext, m: Message| -> Result<Message, String> {
        let registry = weak.upgrade().ok_or("the agent is gone")?;
        let name = decode_leave(&m.payload)
            .map_err(|e| e.to_string())?
            .to_string();
        let mut group = registry.group_mut();
        group.peers.remove(&name);
        let kept: DeviceMaps = group
            .reverse_device_maps
            .iter()
            .filter(|(peer, _)| *peer != name)
            .map(|(peer, map)| (peer.to_string(), map.clone()))
            .collect();
        group.reverse_device_maps = kept;
        Ok(Message::default())
    };
    let mut handlers = registry.handlers_mut();
    handlers.insert(GROUP_JOIN.to_string(), Arc::new(join));
    handlers.insert(GROUP_LEAVE.to_string(), Arc::new(leave));
}
