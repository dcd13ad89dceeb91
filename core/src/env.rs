//! The environment lookup seam: how core asks for `RANK`, `MASTER_ADDR`, `USE_LIBUV` and
//! friends without reading the process environment.
//!
//! Core never calls `std::env`; every function that PyTorch would have read
//! `os.environ` from takes an [`Env`] that the caller supplies. The runtime crates
//! implement it over the real environment (for instance by snapshotting
//! `std::env::vars()` into a `HashMap<String, String>`, which implements [`Env`] with the
//! `std` feature), tests and embedders pass a [`MapEnv`] over a slice. This module
//! decides only how a name is looked up; what a variable means is decided in
//! [`crate::rendezvous`].

/// A read-only view of environment variables.
///
/// `var` returns `None` for an unset variable; a set but empty variable is `Some("")`
/// (PyTorch treats the two alike in some places and not in others, and
/// [`crate::rendezvous`] follows it case by case).
pub trait Env {
    /// The value of the variable `name`, if set.
    fn var(&self, name: &str) -> Option<&str>;
}

impl<E: Env + ?Sized> Env for &E {
    fn var(&self, name: &str) -> Option<&str> {
        (**self).var(name)
    }
}

/// An environment with no variables set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EmptyEnv;

impl Env for EmptyEnv {
    fn var(&self, _name: &str) -> Option<&str> {
        None
    }
}

/// An environment over a slice of `(name, value)` pairs, usable without a heap.
///
/// When a name appears more than once, the last pair wins, as if the variable had been
/// set several times.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MapEnv<'a> {
    vars: &'a [(&'a str, &'a str)],
}

impl<'a> MapEnv<'a> {
    /// An environment holding `vars`.
    pub const fn new(vars: &'a [(&'a str, &'a str)]) -> Self {
        Self { vars }
    }
}

impl Env for MapEnv<'_> {
    fn var(&self, name: &str) -> Option<&str> {
        self.vars
            .iter()
            .rev()
            .find(|(key, _)| *key == name)
            .map(|(_, value)| *value)
    }
}

#[cfg(feature = "alloc")]
impl Env for alloc::collections::BTreeMap<alloc::string::String, alloc::string::String> {
    fn var(&self, name: &str) -> Option<&str> {
        self.get(name).map(alloc::string::String::as_str)
    }
}

#[cfg(feature = "std")]
impl<S: core::hash::BuildHasher> Env
    for std::collections::HashMap<std::string::String, std::string::String, S>
{
    fn var(&self, name: &str) -> Option<&str> {
        self.get(name).map(std::string::String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup<E: Env + ?Sized>(env: &E, name: &str) -> Option<std::string::String> {
        env.var(name).map(std::string::ToString::to_string)
    }

    #[test]
    fn slice_env_last_wins() {
        let env = MapEnv::new(&[("RANK", "0"), ("EMPTY", ""), ("RANK", "1")]);
        assert_eq!(env.var("RANK"), Some("1"));
        assert_eq!(env.var("EMPTY"), Some(""));
        assert_eq!(env.var("rank"), None);
        assert_eq!(lookup(&&env, "RANK").as_deref(), Some("1"));
        assert_eq!(EmptyEnv.var("RANK"), None);
    }

    #[cfg(feature = "alloc")]
    #[test]
    fn maps_are_environments() {
        let mut map = std::collections::BTreeMap::new();
        map.insert("MASTER_ADDR".into(), "10.0.0.1".into());
        assert_eq!(lookup(&map, "MASTER_ADDR").as_deref(), Some("10.0.0.1"));
        #[cfg(feature = "std")]
        {
            let hash: std::collections::HashMap<_, _> = map.into_iter().collect();
            assert_eq!(lookup(&hash, "MASTER_ADDR").as_deref(), Some("10.0.0.1"));
        }
    }
}
