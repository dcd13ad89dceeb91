//! A dynamic group's join, and the members' handlers for joins and leaves.

use std::collections::HashMap;
use std::sync::Arc;

use rdzv_core::device_map::{create_reverse_mapping, validate_device_maps, DeviceMaps, GroupKind};
use rdzv_core::rpc::membership::{decode_leave, JoinAnnouncement, GROUP_JOIN, GROUP_LEAVE};
use rdzv_core::rpc::name::WorkerId;
use rdzv_core::rpc::store_keys::{
    append_worker_info, check_rank_claim, parse_worker_infos, NameTable,
};

use super::Start;
use crate::rpc::agent::RpcAgent;
use crate::rpc::error::store_error;
use crate::rpc::error::RpcError;
use crate::rpc::message::Message;
use crate::rpc::registry::{Group, Peer, Registry};

/// A dynamic member's join, under the group token: claim the rank, read the members,
/// check device maps, start, tell every member, then list this worker.
pub(super) fn join_dynamic(start: Start) -> Result<RpcAgent, RpcError> {
    let me = start.me.clone();
    let (store, keys) = (Arc::clone(&start.store), start.keys.clone());
    let key = keys.rank_name(me.id());
    let returned = store
        .compare_set(&key, b"", me.name().as_bytes())
        .map_err(store_error("compare_set", &key))?;
    check_rank_claim(&me, &returned)?;
    let list_key = keys.all_worker_infos();
    // compare_set from "" to "" reads the list, creating it empty if it is missing.
    let list = store
        .compare_set(&list_key, b"", b"")
        .map_err(store_error("compare_set", &list_key))?;
    let members: Vec<(String, WorkerId)> = parse_worker_infos(&list)?
        .into_iter()
        .map(|(n, id)| (n.to_string(), id))
        .collect();
    let mut names = NameTable::new(&me);
    for (name, id) in &members {
        names.insert(name.as_bytes(), *id)?;
    }

    let mine = start.devices();
    start.publish_devices()?;
    let mut workers = vec![mine.clone()];
    for (_, id) in &members {
        workers.push(start.read_devices(u32::try_from(id.get()).unwrap_or(0))?);
    }
    validate_device_maps(&workers, GroupKind::Dynamic)?;
    let reverse_device_maps = create_reverse_mapping(me.name(), &workers);

    let mut peers = HashMap::new();
    for (name, id) in &members {
        peers.insert(
            name.clone(),
            Peer {
                id: *id,
                address: start.read_address(name)?,
            },
        );
    }
    let device_maps = start.options.device_maps.clone();
    let agent = start.start_agent(None)?;
    peers.insert(
        me.name().to_string(),
        Peer {
            id: me.id(),
            address: agent.address.clone(),
        },
    );
    *agent.shared.registry.group_mut() = Group {
        peers,
        device_maps,
        reverse_device_maps,
    };
    let announcement = JoinAnnouncement {
        name: me.name().to_string(),
        id: me.id().get(),
        address: agent.address.clone(),
        devices: mine.clone(),
    }
    .encode()
    .map_err(|reason| RpcError::BadDeviceInfo {
        rank: u32::try_from(me.id().get()).unwrap_or(0),
        reason,
    })?;
    for (name, _) in &members {
        agent.rpc_sync(
            name,
            GROUP_JOIN,
            Message::from_payload(announcement.clone()),
        )?;
    }
    let text = String::from_utf8_lossy(&list).into_owned();
    let listed = append_worker_info(&text, &me)?;
    store
        .set(&list_key, listed.as_bytes())
        .map_err(store_error("set", &list_key))?;
    tracing::info!(name = %me.name(), members = members.len(), "RPC agent joined a dynamic group");
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
        } = JoinAnnouncement::decode(&m.payload)?;
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
        let name = decode_leave(&m.payload)?.to_string();
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
