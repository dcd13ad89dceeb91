//! A worker's published address, the value of its `addrs/{name}` store key
//! ([`super::store_keys`]): the addresses of its listeners, each `scheme://...`, highest
//! priority first, joined by [`ADDRESS_SEPARATOR`]
//! (`shm://@00a1f;tcp://10.0.0.1:4000;mpt://10.0.0.1:4001`). A transport's scheme is its
//! name ([`TransportKind::name`]); the mpt connection listener, which is no transport, goes
//! last under `mpt`.
//!
//! This module only writes and reads the format; which listeners exist and which
//! transport a pipe uses are the runtime's and [`crate::negotiate`]'s.

use alloc::string::String;

use crate::negotiate::TransportKind;

/// Separates the listeners' addresses in a worker's published address.
pub const ADDRESS_SEPARATOR: char = ';';

/// A worker's published address: its listeners' addresses (each `scheme://...`),
/// highest priority first, joined by [`ADDRESS_SEPARATOR`].
pub fn join_addresses<'a>(addresses: impl IntoIterator<Item = &'a str>) -> String {
    let mut joined = String::new();
    for address in addresses {
        if !joined.is_empty() {
            joined.push(ADDRESS_SEPARATOR);
        }
        joined.push_str(address);
    }
    joined
}

/// The address of `kind`'s listener in a worker's published address (scheme
/// included), if it has one.
pub fn address_for(published: &str, kind: TransportKind) -> Option<&str> {
    published.split(ADDRESS_SEPARATOR).find(|address| {
        address
            .strip_prefix(kind.name())
            .is_some_and(|rest| rest.starts_with("://"))
    })
}

/// What follows `scheme://` in the first entry of `published` with that scheme (the
/// mpt connection listener's `ip:port`, say), if there is one.
pub fn after_scheme<'a>(published: &'a str, scheme: &str) -> Option<&'a str> {
    published
        .split(ADDRESS_SEPARATOR)
        .find_map(|address| address.strip_prefix(scheme)?.strip_prefix("://"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec::Vec;

    #[test]
    fn published_addresses_carry_every_listener() {
        let published = join_addresses(["shm://@00a1f", "tcp://10.0.0.1:4000"]);
        assert_eq!(published, "shm://@00a1f;tcp://10.0.0.1:4000");
        assert_eq!(
            address_for(&published, TransportKind::Tcp),
            Some("tcp://10.0.0.1:4000")
        );
        assert_eq!(
            address_for(&published, TransportKind::Shm),
            Some("shm://@00a1f")
        );
        assert_eq!(address_for("tcp://10.0.0.1:4000", TransportKind::Shm), None);
        assert_eq!(join_addresses(["tcp://1.2.3.4:5"]), "tcp://1.2.3.4:5");
        assert_eq!(join_addresses([]), "");
    }

    #[test]
    fn a_scheme_matches_whole() {
        assert_eq!(address_for("tcpx://1", TransportKind::Tcp), None);
        assert_eq!(address_for("tcp:1", TransportKind::Tcp), None);
        let published = "tcp://10.0.0.1:4000;mpt://10.0.0.1:4001";
        assert_eq!(after_scheme(published, "mpt"), Some("10.0.0.1:4001"));
        assert_eq!(after_scheme(published, "tcp"), Some("10.0.0.1:4000"));
        assert_eq!(after_scheme("mptx://1;tcp://2", "mpt"), None);
        assert_eq!(after_scheme("", "mpt"), None);
    }

    proptest::proptest! {
        /// Every listener joined in is found again under its scheme, in priority order.
        #[test]
        fn joined_addresses_split_back(hosts in proptest::collection::vec("[a-z0-9.:@]{0,12}", 1..4)) {
            let schemes = ["shm", "ibv", "tcp"];
            let entries: Vec<String> = hosts
                .iter()
                .zip(schemes)
                .map(|(host, scheme)| alloc::format!("{scheme}://{host}"))
                .collect();
            let published = join_addresses(entries.iter().map(String::as_str));
            for (entry, (host, scheme)) in entries.iter().zip(hosts.iter().zip(schemes)) {
                proptest::prop_assert_eq!(after_scheme(&published, scheme), Some(host.as_str()));
                let kind = match scheme {
                    "shm" => TransportKind::Shm,
                    "ibv" => TransportKind::Ibv,
                    _ => TransportKind::Tcp,
                };
                proptest::prop_assert_eq!(address_for(&published, kind), Some(entry.as_str()));
            }
        }
    }
}
