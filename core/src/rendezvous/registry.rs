//! The scheme → handler registry of `register_rendezvous_handler`, generic over what a
//! handler is (a function pointer, a boxed closure, an enum of bundled handlers...).
//!
//! The registry decides only the bookkeeping and PyTorch's messages: a scheme registers
//! once ("Rendezvous handler for {scheme}:// already registered"), and looking up a URL's
//! scheme that nobody registered fails with "No rendezvous handler for {scheme}://".
//! Schemes are compared as Python compares dictionary keys: exactly. A URL's scheme reads
//! lowercase (as Python's `urlparse` lowercases it), so `TCP://...` finds the handler
//! registered as `tcp`, and a handler registered with capitals is never found through a
//! URL, as in PyTorch. Nothing here calls a handler.
//!
//! [`FixedHandlerRegistry`] keeps at most `N` handlers without a heap (a full registry is
//! its own error); `HandlerRegistry` (with `alloc`) grows as needed.

use core::fmt;

use crate::url::{LowercaseStr, RendezvousUrl};

/// Why a handler could not be registered.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegisterError<'a> {
    /// A handler is already registered for this scheme.
    AlreadyRegistered {
        /// The scheme.
        scheme: &'a str,
    },
    /// A [`FixedHandlerRegistry`] holds as many handlers as it can.
    Full {
        /// Its capacity.
        capacity: usize,
    },
}

impl fmt::Display for RegisterError<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::AlreadyRegistered { scheme } => {
                write!(f, "Rendezvous handler for {scheme}:// already registered")
            }
            Self::Full { capacity } => write!(
                f,
                "Rendezvous handler registry is full: it holds at most {capacity} handlers"
            ),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for RegisterError<'_> {}

/// No handler is registered for a scheme: "No rendezvous handler for {scheme}://".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoHandler<'a> {
    scheme: LowercaseStr<'a>,
}

impl<'a> NoHandler<'a> {
    /// The scheme that was looked up (its `Display` is the form in the message).
    pub fn scheme(&self) -> LowercaseStr<'a> {
        self.scheme
    }

    /// The error for a URL whose scheme has no handler.
    pub(crate) fn for_url(url: &RendezvousUrl<'a>) -> Self {
        Self {
            scheme: url.scheme(),
        }
    }
}

impl fmt::Display for NoHandler<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "No rendezvous handler for {}://", self.scheme)
    }
}

#[cfg(feature = "std")]
impl std::error::Error for NoHandler<'_> {}

/// A registry of at most `N` handlers that needs no heap; schemes are borrowed.
#[derive(Debug, Clone)]
pub struct FixedHandlerRegistry<'s, H, const N: usize> {
    handlers: heapless::Vec<(&'s str, H), N>,
}

impl<'s, H, const N: usize> Default for FixedHandlerRegistry<'s, H, N> {
    fn default() -> Self {
        Self::new()
    }
}

impl<'s, H, const N: usize> FixedHandlerRegistry<'s, H, N> {
    /// An empty registry.
    pub const fn new() -> Self {
        Self {
            handlers: heapless::Vec::new(),
        }
    }

    /// `register_rendezvous_handler(scheme, handler)`.
    ///
    /// # Errors
    /// [`RegisterError::AlreadyRegistered`] if `scheme` has a handler (checked first, as
    /// in PyTorch), [`RegisterError::Full`] if `N` handlers are registered.
    pub fn register(&mut self, scheme: &'s str, handler: H) -> Result<(), RegisterError<'s>> {
        if self.contains(scheme) {
            return Err(RegisterError::AlreadyRegistered { scheme });
        }
        self.handlers
            .push((scheme, handler))
            .map_err(|_| RegisterError::Full { capacity: N })
    }

    /// Whether `scheme` (compared exactly) has a handler.
    pub fn contains(&self, scheme: &str) -> bool {
        self.handlers.iter().any(|(known, _)| *known == scheme)
    }

    /// The handler registered for exactly `scheme`.
    ///
    /// # Errors
    /// [`NoHandler`] naming `scheme` as given.
    pub fn handler<'q>(&self, scheme: &'q str) -> Result<&H, NoHandler<'q>> {
        self.handlers
            .iter()
            .find(|(known, _)| *known == scheme)
            .map(|(_, handler)| handler)
            .ok_or(NoHandler {
                scheme: LowercaseStr::verbatim(scheme),
            })
    }

    /// The handler for `url`'s scheme (read lowercase), as `_rendezvous_helper` picks it.
    ///
    /// # Errors
    /// [`NoHandler`] naming the lowercase scheme.
    pub fn handler_for<'u>(&self, url: &RendezvousUrl<'u>) -> Result<&H, NoHandler<'u>> {
        let scheme = url.scheme();
        self.handlers
            .iter()
            .find(|(known, _)| scheme == *known)
            .map(|(_, handler)| handler)
            .ok_or(NoHandler::for_url(url))
    }

    /// The registered schemes, in registration order.
    pub fn schemes(&self) -> impl Iterator<Item = &'s str> + '_ {
        self.handlers.iter().map(|(scheme, _)| *scheme)
    }

    /// The number of registered handlers.
    pub fn len(&self) -> usize {
        self.handlers.len()
    }

    /// Whether no handler is registered.
    pub fn is_empty(&self) -> bool {
        self.handlers.is_empty()
    }
}

#[cfg(feature = "alloc")]
pub use growing::HandlerRegistry;

#[cfg(feature = "alloc")]
mod growing {
    use alloc::collections::BTreeMap;
    use alloc::string::{String, ToString};

    use super::{LowercaseStr, NoHandler, RegisterError};
    use crate::url::RendezvousUrl;

    /// A registry that grows as needed (requires `alloc`); schemes are owned.
    #[derive(Debug, Clone)]
    pub struct HandlerRegistry<H> {
        handlers: BTreeMap<String, H>,
    }

    impl<H> Default for HandlerRegistry<H> {
        fn default() -> Self {
            Self::new()
        }
    }

    impl<H> HandlerRegistry<H> {
        /// An empty registry.
        pub const fn new() -> Self {
            Self {
                handlers: BTreeMap::new(),
            }
        }

        /// `register_rendezvous_handler(scheme, handler)`.
        ///
        /// # Errors
        /// [`RegisterError::AlreadyRegistered`] if `scheme` has a handler.
        pub fn register<'s>(
            &mut self,
            scheme: &'s str,
            handler: H,
        ) -> Result<(), RegisterError<'s>> {
            if self.handlers.contains_key(scheme) {
                return Err(RegisterError::AlreadyRegistered { scheme });
            }
            self.handlers.insert(scheme.to_string(), handler);
            Ok(())
        }

        /// Whether `scheme` (compared exactly) has a handler.
        pub fn contains(&self, scheme: &str) -> bool {
            self.handlers.contains_key(scheme)
        }

        /// The handler registered for exactly `scheme`.
        ///
        /// # Errors
        /// [`NoHandler`] naming `scheme` as given.
        pub fn handler<'q>(&self, scheme: &'q str) -> Result<&H, NoHandler<'q>> {
            self.handlers.get(scheme).ok_or(NoHandler {
                scheme: LowercaseStr::verbatim(scheme),
            })
        }

        /// The handler for `url`'s scheme (read lowercase), as `_rendezvous_helper`
        /// picks it.
        ///
        /// # Errors
        /// [`NoHandler`] naming the lowercase scheme.
        pub fn handler_for<'u>(&self, url: &RendezvousUrl<'u>) -> Result<&H, NoHandler<'u>> {
            let scheme = url.scheme();
            let found = match scheme.as_lowercase() {
                Some(lower) => self.handlers.get(lower),
                None => self.handlers.get(scheme.to_string().as_str()),
            };
            found.ok_or(NoHandler::for_url(url))
        }

        /// The registered schemes, in sorted order.
        pub fn schemes(&self) -> impl Iterator<Item = &str> + '_ {
            self.handlers.keys().map(String::as_str)
        }

        /// The number of registered handlers.
        pub fn len(&self) -> usize {
            self.handlers.len()
        }

        /// Whether no handler is registered.
        pub fn is_empty(&self) -> bool {
            self.handlers.is_empty()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::string::ToString;

    #[test]
    fn fixed_registry_follows_pytorch() {
        let mut registry: FixedHandlerRegistry<'_, u8, 2> = FixedHandlerRegistry::new();
        assert!(registry.is_empty());
        registry.register("tcp", 1).expect("first");
        assert_eq!(
            registry.register("tcp", 2).map_err(|e| e.to_string()),
            Err("Rendezvous handler for tcp:// already registered".to_string())
        );
        registry.register("env", 3).expect("second");
        assert_eq!(
            registry.register("file", 4),
            Err(RegisterError::Full { capacity: 2 })
        );
        // Already-registered wins over full, as the dict check comes first in PyTorch.
        assert_eq!(
            registry.register("env", 5),
            Err(RegisterError::AlreadyRegistered { scheme: "env" })
        );
        assert_eq!(registry.handler("tcp"), Ok(&1));
        assert_eq!(
            registry.schemes().collect::<std::vec::Vec<_>>(),
            ["tcp", "env"]
        );

        let url = RendezvousUrl::parse("TCP://h:1").expect("valid");
        assert_eq!(registry.handler_for(&url), Ok(&1));
        // RendezvousTest.test_unknown_handler
        let url = RendezvousUrl::parse("invalid://").expect("valid");
        assert_eq!(
            registry.handler_for(&url).map_err(|e| e.to_string()),
            Err("No rendezvous handler for invalid://".to_string())
        );
        let url = RendezvousUrl::parse("InValid://").expect("valid");
        assert_eq!(
            registry.handler_for(&url).map_err(|e| e.to_string()),
            Err("No rendezvous handler for invalid://".to_string())
        );
        assert_eq!(
            registry.handler("TCP").map_err(|e| e.to_string()),
            Err("No rendezvous handler for TCP://".to_string())
        );
        // A URL without a scheme looks up the empty scheme.
        let url = RendezvousUrl::parse("/tmp/x").expect("valid");
        assert_eq!(
            registry.handler_for(&url).map_err(|e| e.to_string()),
            Err("No rendezvous handler for ://".to_string())
        );
    }

    #[cfg(feature = "alloc")]
    #[test]
    fn growing_registry_follows_pytorch() {
        let mut registry = HandlerRegistry::new();
        for (index, scheme) in ["tcp", "env", "file", "Upper"].into_iter().enumerate() {
            registry.register(scheme, index).expect("new scheme");
        }
        assert_eq!(
            registry.register("file", 9).map_err(|e| e.to_string()),
            Err("Rendezvous handler for file:// already registered".to_string())
        );
        assert_eq!(registry.len(), 4);
        let url = RendezvousUrl::parse("FILE:///tmp/x").expect("valid");
        assert_eq!(registry.handler_for(&url), Ok(&2));
        // Registered with capitals: never found through a URL, as in PyTorch.
        let url = RendezvousUrl::parse("Upper://x").expect("valid");
        assert_eq!(
            registry.handler_for(&url).map_err(|e| e.to_string()),
            Err("No rendezvous handler for upper://".to_string())
        );
        assert_eq!(registry.handler("Upper"), Ok(&3));
        assert!(registry.contains("env"));
    }
}
