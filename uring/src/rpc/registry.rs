//! Who is in the group and which handlers answer: the [`Registry`], read by every call
//! and request, written by start-up, [`register_handler`](super::RpcAgent::register_handler)
//! and a dynamic group's joins and leaves.
//!
//! Locks are held only to read or change an entry, never across I/O or a handler.

use std::collections::HashMap;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use rdzv_core::device_map::DeviceMaps;
use rdzv_core::rpc::name::WorkerId;

use super::handler::Handler;

/// A member of the group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Peer {
    pub id: WorkerId,
    pub address: String,
}

/// What init learned about the group (a dynamic group's members change it).
#[derive(Debug, Clone, Default)]
pub(crate) struct Group {
    /// Every member, this worker included, by name.
    pub peers: HashMap<String, Peer>,
    /// Maps for requests, by destination name.
    pub device_maps: DeviceMaps,
    /// Maps for responses, by caller name.
    pub reverse_device_maps: DeviceMaps,
}

/// The group and the handlers, by name.
pub(crate) struct Registry {
    group: RwLock<Group>,
    handlers: RwLock<HashMap<String, Arc<dyn Handler>>>,
}

impl Registry {
    /// An empty group with these handlers.
    pub(crate) fn new(handlers: HashMap<String, Arc<dyn Handler>>) -> Registry {
        Registry {
            group: RwLock::new(Group::default()),
            handlers: RwLock::new(handlers),
        }
    }

    pub(crate) fn group(&self) -> RwLockReadGuard<'_, Group> {
        self.group.read().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn group_mut(&self) -> RwLockWriteGuard<'_, Group> {
        self.group.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The handler registered as `name`.
    pub(crate) fn handler(&self, name: &str) -> Option<Arc<dyn Handler>> {
        self.handlers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .map(Arc::clone)
    }

    /// The handlers, to register more.
    pub(crate) fn handlers_mut(&self) -> RwLockWriteGuard<'_, HashMap<String, Arc<dyn Handler>>> {
        self.handlers.write().unwrap_or_else(|p| p.into_inner())
    }
}
