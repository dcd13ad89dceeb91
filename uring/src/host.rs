//! What identifies this host, boot and namespaces, read from `/proc`: the boot id
//! (`/proc/sys/kernel/random/boot_id`) and namespace inode numbers (`/proc/self/ns/*`).
//!
//! The shm transport, the cma and xth channels and the CUDA channels build their domain
//! descriptors and process identities from these; this is the one place that reads and
//! parses them. It decides nothing about viability.

use std::io;

/// Where the kernel publishes the id of the current boot.
pub const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";
/// This process's network namespace.
pub const NET_NS_PATH: &str = "/proc/self/ns/net";
/// This process's pid namespace.
pub const PID_NS_PATH: &str = "/proc/self/ns/pid";
/// This process's user namespace.
pub const USER_NS_PATH: &str = "/proc/self/ns/user";
/// This process's IPC namespace.
pub const IPC_NS_PATH: &str = "/proc/self/ns/ipc";

/// Why a process identity could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdentityError {
    /// A `/proc` file could not be read or stat'ed.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A `/proc` file holds something unexpected.
    #[error("cannot parse {path}: {what}")]
    Malformed {
        /// The file.
        path: String,
        /// What was wrong.
        what: &'static str,
    },
}

/// The boot id of this host: its 16 bytes and its text form.
pub fn boot_id() -> Result<([u8; 16], String), IdentityError> {
    let text = std::fs::read_to_string(BOOT_ID_PATH).map_err(|source| IdentityError::Read {
        path: BOOT_ID_PATH.into(),
        source,
    })?;
    let text = text.trim();
    let bytes = parse_boot_id(text).ok_or_else(|| IdentityError::Malformed {
        path: BOOT_ID_PATH.into(),
        what: "not a UUID",
    })?;
    Ok((bytes, text.to_owned()))
}

/// Parses a UUID (32 hex digits, dashes anywhere ignored).
fn parse_boot_id(text: &str) -> Option<[u8; 16]> {
    let mut out = [0u8; 16];
    let mut digits = text.bytes().filter(|&b| b != b'-');
    for byte in &mut out {
        let high = hex_value(digits.next()?)?;
        let low = hex_value(digits.next()?)?;
        *byte = high << 4 | low;
    }
    digits.next().is_none().then_some(out)
}

fn hex_value(digit: u8) -> Option<u8> {
    char::from(digit)
        .to_digit(16)
        .and_then(|v| u8::try_from(v).ok())
}

/// The inode number of a namespace file, which identifies the namespace.
pub fn namespace_inode(path: &str) -> Result<u64, IdentityError> {
    rustix::fs::stat(path)
        .map(|stat| stat.st_ino)
        .map_err(|errno| IdentityError::Read {
            path: path.into(),
            source: errno.into(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_id_parsing() {
        assert_eq!(
            parse_boot_id("6f2ad3f1-2b9e-4c55-9a43-0f3f5e1d7c01"),
            Some([
                0x6f, 0x2a, 0xd3, 0xf1, 0x2b, 0x9e, 0x4c, 0x55, 0x9a, 0x43, 0x0f, 0x3f, 0x5e, 0x1d,
                0x7c, 0x01
            ])
        );
        assert_eq!(parse_boot_id(""), None);
        assert_eq!(parse_boot_id("6f2ad3f1"), None);
        assert_eq!(parse_boot_id("zz2ad3f1-2b9e-4c55-9a43-0f3f5e1d7c01"), None);
        assert_eq!(
            parse_boot_id("6f2ad3f1-2b9e-4c55-9a43-0f3f5e1d7c0100"),
            None
        );
    }

    #[test]
    fn this_host_has_an_identity() {
        let (bytes, text) = boot_id().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(parse_boot_id(&text), Some(bytes));
        for path in [NET_NS_PATH, PID_NS_PATH, USER_NS_PATH, IPC_NS_PATH] {
            assert!(namespace_inode(path).is_ok_and(|inode| inode > 0), "{path}");
        }
        assert!(matches!(
            namespace_inode("/proc/self/ns/no-such-namespace"),
            Err(IdentityError::Read { .. })
        ));
    }
}
