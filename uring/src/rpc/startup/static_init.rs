//! The static group's start-up: names, device maps, agent, addresses, barrier.

use std::collections::HashMap;
use std::sync::Arc;

use rdzv_core::device_map::exchange_and_check_device_maps;
use rdzv_core::rpc::name::WorkerId;
use rdzv_core::rpc::store_keys::{static_ranks_to_fetch, NameTable};

use super::Start;
use crate::rpc::agent::RpcAgent;
use crate::rpc::device::Devices;
use crate::rpc::error::store_error;
use crate::rpc::error::RpcError;
use crate::rpc::options::RpcOptions;
use crate::rpc::registry::{Group, Peer};

pub(super) fn init_static(start: Start, world_size: u32) -> Result<RpcAgent, RpcError> {
    let me = start.me.clone();
    let rank = start.rank();
    let (store, keys) = (Arc::clone(&start.store), start.keys.clone());
    let key = keys.rank_name(me.id());
    store
        .set(&key, me.name().as_bytes())
        .map_err(store_error("set", &key))?;
    let world = u16::try_from(world_size).map_err(|_| RpcError::InvalidOption {
        option: "world_size",
        reason: format!("{world_size} workers exceed the worker id range"),
    })?;
    let mut names = NameTable::new(&me);
    let mut ranked_names: Vec<(WorkerId, String)> = vec![(me.id(), me.name().to_string())];
    for id in static_ranks_to_fetch(me.id(), world) {
        let key = keys.rank_name(id);
        let value = store.get(&key).map_err(store_error("get", &key))?;
        names.insert(&value, id)?;
        ranked_names.push((id, String::from_utf8_lossy(&value).into_owned()));
    }
    ranked_names.sort_by_key(|(id, _)| id.get());

    // Devices: every worker's (name, device_count, device_maps, devices).
    let mine = start.devices();
    start.publish_devices()?;
    let mut workers = Vec::with_capacity(ranked_names.len());
    for r in 0..world_size {
        workers.push(if r == rank {
            mine.clone()
        } else {
            start.read_devices(r)?
        });
    }
    let setup = exchange_and_check_device_maps(&mine, &workers)?;

    let mut peers = HashMap::new();
    let device_maps = start.options.device_maps.clone();
    let reader = Start {
        me: me.clone(),
        options: RpcOptions::default(),
        store: Arc::clone(&store),
        keys: keys.clone(),
        transports: Vec::new(),
        shm: None,
        plugged: Vec::new(),
        channels: Vec::new(),
        devices: Devices::default(),
        handlers: HashMap::new(),
    };
    let agent = start.start_agent(Some(world_size))?;
    for (id, peer_name) in &ranked_names {
        let address = if *id == me.id() {
            agent.address.clone()
        } else {
            reader.read_address(peer_name)?
        };
        peers.insert(peer_name.clone(), Peer { id: *id, address });
    }
    *agent.shared.registry.group_mut() = Group {
        peers,
        device_maps,
        reverse_device_maps: setup.reverse_device_maps,
    };
    let key = keys.init_barrier();
    store
        .barrier(&key, i64::from(world_size), None)
        .map_err(store_error("barrier", &key))?;
    tracing::info!(name = %me.name(), rank, address = %agent.address, "RPC agent started");
    Ok(agent)
}
