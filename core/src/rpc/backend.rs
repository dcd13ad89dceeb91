//! The RPC backend registry of `torch.distributed.rpc.backend_registry`, generic over
//! what a backend handler is (a pair of function pointers, a boxed constructor, an enum).
//!
//! The registry decides only the bookkeeping and PyTorch's messages: a name registers
//! once ("RPC backend {name}: already registered"), names compare exactly, and listing
//! follows `BackendType`'s member order. PyTorch rebuilds the `BackendType` enum on every
//! registration with the new member *first* (`dict({new: ...}, **existing)`), so members
//! list newest first; [`BackendRegistry::names`] does the same. Looking up a name nobody
//! registered is [`UnknownBackend`], which shows the `TypeError` `init_rpc` raises for a
//! backend that is not a `BackendType` member. Nothing here constructs options or starts
//! an agent.

use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

/// PyTorch's built-in backend.
pub const TENSORPIPE: &str = "TENSORPIPE";
/// The fault-injecting test backend (`faulty_agent_backend_registry.py`).
pub const FAULTY_TENSORPIPE: &str = "FAULTY_TENSORPIPE";

/// A backend of this name exists: "RPC backend {name}: already registered".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AlreadyRegistered {
    /// The name.
    pub name: String,
}

impl fmt::Display for AlreadyRegistered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RPC backend {}: already registered", self.name)
    }
}

#[cfg(feature = "std")]
impl std::error::Error for AlreadyRegistered {}

/// No backend of this name: "Argument backend must be a member of BackendType" (the
/// `TypeError` of `init_rpc`; the name is kept for the caller).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownBackend {
    /// The name looked up.
    pub name: String,
}

impl fmt::Display for UnknownBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Argument backend must be a member of BackendType")
    }
}

#[cfg(feature = "std")]
impl std::error::Error for UnknownBackend {}

/// Registered backends, newest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendRegistry<H> {
    newest_first: Vec<(String, H)>,
}

impl<H> Default for BackendRegistry<H> {
    fn default() -> Self {
        Self::new()
    }
}

impl<H> BackendRegistry<H> {
    /// An empty registry.
    pub const fn new() -> Self {
        BackendRegistry {
            newest_first: Vec::new(),
        }
    }

    /// `register_backend(name, ...)`.
    ///
    /// # Errors
    /// [`AlreadyRegistered`] if `name` is taken; the registry is unchanged.
    pub fn register_backend(&mut self, name: &str, handler: H) -> Result<(), AlreadyRegistered> {
        if self.backend_registered(name) {
            return Err(AlreadyRegistered {
                name: String::from(name),
            });
        }
        self.newest_first.insert(0, (String::from(name), handler));
        Ok(())
    }

    /// `backend_registered(name)`: whether `name` (compared exactly) is registered.
    pub fn backend_registered(&self, name: &str) -> bool {
        self.newest_first.iter().any(|(known, _)| known == name)
    }

    /// The handler registered as `name` (`BackendType[name].value`).
    ///
    /// # Errors
    /// [`UnknownBackend`] if nothing is registered under `name`.
    pub fn backend(&self, name: &str) -> Result<&H, UnknownBackend> {
        self.newest_first
            .iter()
            .find(|(known, _)| known == name)
            .map(|(_, handler)| handler)
            .ok_or_else(|| UnknownBackend {
                name: String::from(name),
            })
    }

    /// The registered names in `BackendType` order: newest first.
    pub fn names(&self) -> impl Iterator<Item = &str> + '_ {
        self.newest_first.iter().map(|(name, _)| name.as_str())
    }

    /// How many backends are registered.
    pub fn len(&self) -> usize {
        self.newest_first.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.newest_first.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;
    use alloc::vec;
    use proptest::prelude::*;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Handler {
        TensorPipe,
        Faulty,
    }

    #[test]
    fn registers_once_with_pytorchs_message() {
        let mut registry = BackendRegistry::new();
        assert!(registry.is_empty());
        registry
            .register_backend(TENSORPIPE, Handler::TensorPipe)
            .unwrap();
        assert!(registry.backend_registered("TENSORPIPE"));
        assert!(!registry.backend_registered("tensorpipe"));
        let err = registry
            .register_backend(TENSORPIPE, Handler::Faulty)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "RPC backend TENSORPIPE: already registered"
        );
        assert_eq!(registry.backend(TENSORPIPE), Ok(&Handler::TensorPipe));
        registry
            .register_backend(FAULTY_TENSORPIPE, Handler::Faulty)
            .unwrap();
        assert_eq!(registry.len(), 2);
        assert_eq!(
            registry.names().collect::<Vec<_>>(),
            vec!["FAULTY_TENSORPIPE", "TENSORPIPE"]
        );
        let unknown = registry.backend("GLOO").unwrap_err();
        assert_eq!(unknown.name, "GLOO");
        assert_eq!(
            unknown.to_string(),
            "Argument backend must be a member of BackendType"
        );
    }

    proptest! {
        #[test]
        fn behaves_like_a_newest_first_dict(names in proptest::collection::vec("[A-C]{1,2}", 0..20)) {
            let mut registry = BackendRegistry::new();
            let mut model: Vec<(String, usize)> = Vec::new();
            for (i, name) in names.iter().enumerate() {
                let fresh = !model.iter().any(|(n, _)| n == name);
                prop_assert_eq!(registry.register_backend(name, i).is_ok(), fresh);
                if fresh {
                    model.insert(0, (name.clone(), i));
                }
            }
            prop_assert_eq!(registry.names().collect::<Vec<_>>(), model.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>());
            for (name, i) in &model {
                prop_assert_eq!(registry.backend(name), Ok(i));
            }
        }
    }
}
