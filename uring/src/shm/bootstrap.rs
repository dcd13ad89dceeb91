//! The bootstrap exchange over the UNIX control socket: addresses, the hello message with
//! the file descriptors passed by `SCM_RIGHTS`, and the verdict that ends the handshake.
//!
//! The socket is `SOCK_SEQPACKET`, so every message arrives whole and the fds arrive
//! with the hello that describes them. Each side sends one hello, then reads the peer's:
//!
//! | bytes  | field                                            |
//! |--------|--------------------------------------------------|
//! | 0..8   | magic `RDZVSHM\0`                                |
//! | 8..10  | version (`u16` LE, 1)                            |
//! | 10..12 | boot id length (`u16` LE, at most 64)            |
//! | 12..16 | reserved, zero                                   |
//! | 16..24 | inbox data capacity (`u64` LE, power of two)     |
//! | 24..32 | largest message the sender accepts (`u64` LE)    |
//! | 32..40 | network namespace inode (`u64` LE)               |
//! | 40..104| boot id (ASCII, zero-padded)                     |
//!
//! with three fds: the sender's inbox memfd, its data eventfd (signalled when its inbox
//! gets a record) and its space eventfd (signalled when its outbox, our inbox, gets
//! room). After mapping the peer's inbox each side sends a verdict, a 1-byte `0`, or `1`
//! followed by a UTF-8 reason, and reads the peer's; only then is the connection up.
//! Both sides run the same steps, so neither waits on the other in a cycle.
//!
//! After the handshake the socket carries no data; it is kept only so that the peer's
//! death shows as end-of-file. This module does not map segments or decide what to check
//! in the hello (the connection does); it encodes, decodes and moves the bytes and fds.

use std::fmt;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::time::Duration;

use rustix::io::Errno;
use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketAddrUnix,
};

use super::viability::{valid_boot_id, HostIdentity, MAX_BOOT_ID_LEN};
use super::ShmError;

/// Where a shm listener listens: an abstract-namespace name (no file, gone with the
/// socket; TensorPipe's choice) or a filesystem path.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ShmAddr {
    /// A name in the abstract namespace (written `@name`), private to the network
    /// namespace.
    Abstract(Vec<u8>),
    /// A socket file. It is not removed when the listener is dropped.
    Path(PathBuf),
}

impl ShmAddr {
    /// Parses `@name` as an abstract name and anything else as a path.
    pub fn parse(text: &str) -> ShmAddr {
        match text.strip_prefix('@') {
            Some(name) => ShmAddr::Abstract(name.as_bytes().to_vec()),
            None => ShmAddr::Path(PathBuf::from(text)),
        }
    }

    pub(crate) fn to_socket_addr(&self) -> Result<SocketAddrUnix, ShmError> {
        match self {
            ShmAddr::Abstract(name) => SocketAddrUnix::new_abstract_name(name),
            ShmAddr::Path(path) => SocketAddrUnix::new(path.as_path()),
        }
        .map_err(|errno| ShmError::Address {
            op: "encode",
            addr: self.to_string(),
            source: errno.into(),
        })
    }

    pub(crate) fn from_socket_addr(addr: &SocketAddrUnix) -> Option<ShmAddr> {
        if let Some(name) = addr.abstract_name() {
            return Some(ShmAddr::Abstract(name.to_vec()));
        }
        let path = addr.path_bytes()?;
        Some(ShmAddr::Path(PathBuf::from(
            String::from_utf8_lossy(path).into_owned(),
        )))
    }
}

impl fmt::Display for ShmAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShmAddr::Abstract(name) => write!(f, "@{}", String::from_utf8_lossy(name)),
            ShmAddr::Path(path) => write!(f, "{}", path.display()),
        }
    }
}

const HELLO_MAGIC: [u8; 8] = *b"RDZVSHM\0";
const HELLO_VERSION: u16 = 1;
pub(crate) const HELLO_LEN: usize = 104;
/// The fds every hello carries.
const HELLO_FDS: usize = 3;
/// The longest verdict: a status byte and a reason.
const VERDICT_MAX: usize = 257;

/// What a side announces about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    /// The sender's inbox data capacity.
    pub(crate) capacity: u64,
    /// The largest message the sender accepts.
    pub(crate) max_message_len: u64,
    /// The sender's host identity.
    pub(crate) identity: HostIdentity,
}

impl Hello {
    pub(crate) fn encode(&self) -> Result<[u8; HELLO_LEN], ShmError> {
        let boot_id = self.identity.boot_id.as_bytes();
        if boot_id.len() > MAX_BOOT_ID_LEN {
            return Err(ShmError::Handshake {
                detail: format!("boot id of {} bytes is too long", boot_id.len()),
            });
        }
        let mut out = [0u8; HELLO_LEN];
        out[..8].copy_from_slice(&HELLO_MAGIC);
        out[8..10].copy_from_slice(&HELLO_VERSION.to_le_bytes());
        // At most 64, checked above.
        out[10..12].copy_from_slice(&(boot_id.len() as u16).to_le_bytes());
        out[16..24].copy_from_slice(&self.capacity.to_le_bytes());
        out[24..32].copy_from_slice(&self.max_message_len.to_le_bytes());
        out[32..40].copy_from_slice(&self.identity.net_namespace.to_le_bytes());
        out[40..40 + boot_id.len()].copy_from_slice(boot_id);
        Ok(out)
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Hello, ShmError> {
        let bad = |detail: String| ShmError::Handshake { detail };
        let bytes: &[u8; HELLO_LEN] = bytes.try_into().map_err(|_| {
            bad(format!(
                "hello of {} bytes, expected {HELLO_LEN}",
                bytes.len()
            ))
        })?;
        if bytes[..8] != HELLO_MAGIC {
            return Err(bad("peer is not an rdzv shm endpoint (bad magic)".into()));
        }
        // Offsets below are constants inside the 104-byte array.
        let u16_at = |i: usize| u16::from_le_bytes([bytes[i], bytes[i + 1]]);
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[i..i + 8]);
            u64::from_le_bytes(b)
        };
        let version = u16_at(8);
        if version != HELLO_VERSION {
            return Err(bad(format!(
                "peer speaks shm handshake version {version}, we speak {HELLO_VERSION}"
            )));
        }
        let boot_id_len = usize::from(u16_at(10));
        let boot_id = (boot_id_len <= MAX_BOOT_ID_LEN)
            .then(|| bytes.get(40..40 + boot_id_len))
            .flatten()
            .and_then(|raw| std::str::from_utf8(raw).ok())
            .filter(|s| valid_boot_id(s))
            .ok_or_else(|| bad("peer sent a malformed boot id".into()))?;
        Ok(Hello {
            capacity: u64_at(16),
            max_message_len: u64_at(24),
            identity: HostIdentity {
                boot_id: boot_id.to_owned(),
                net_namespace: u64_at(32),
            },
        })
    }
}

/// Sets the send and receive timeouts of the handshake.
pub(crate) fn set_timeouts(socket: &OwnedFd, timeout: Duration) -> Result<(), ShmError> {
    use rustix::net::sockopt::{set_socket_timeout, Timeout};
    let timeout = Some(timeout.max(Duration::from_millis(1)));
    set_socket_timeout(socket, Timeout::Recv, timeout)
        .and_then(|()| set_socket_timeout(socket, Timeout::Send, timeout))
        .map_err(ShmError::syscall("setsockopt(SO_RCVTIMEO/SO_SNDTIMEO)"))
}

/// Sends our hello with our three fds.
pub(crate) fn send_hello(
    socket: &OwnedFd,
    hello: &Hello,
    fds: [BorrowedFd<'_>; HELLO_FDS],
) -> Result<(), ShmError> {
    let bytes = hello.encode()?;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(HELLO_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(ShmError::Handshake {
            detail: "ancillary buffer too small for three fds".into(),
        });
    }
    let sent = retry(|| {
        sendmsg(
            socket,
            &[IoSlice::new(&bytes)],
            &mut control,
            SendFlags::NOSIGNAL,
        )
    })
    .map_err(handshake_io("send the hello"))?;
    if sent != bytes.len() {
        return Err(ShmError::Handshake {
            detail: format!("sent {sent} of {} hello bytes", bytes.len()),
        });
    }
    Ok(())
}

/// Receives the peer's hello and its three fds (`[memfd, data eventfd, space eventfd]`).
pub(crate) fn recv_hello(socket: &OwnedFd) -> Result<(Hello, [OwnedFd; HELLO_FDS]), ShmError> {
    let mut bytes = [0u8; HELLO_LEN + 1];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(HELLO_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let received = retry(|| {
        recvmsg(
            socket,
            &mut [IoSliceMut::new(&mut bytes)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )
    })
    .map_err(handshake_io("receive the peer's hello"))?;
    // Take ownership of whatever fds arrived first, so that every one is closed on error.
    let mut fds: Vec<OwnedFd> = Vec::with_capacity(HELLO_FDS);
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = message {
            fds.extend(rights);
        }
    }
    if received.bytes == 0 {
        return Err(ShmError::Handshake {
            detail: "peer closed the socket during the handshake".into(),
        });
    }
    if received
        .flags
        .intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC)
    {
        return Err(ShmError::Handshake {
            detail: "peer's hello or its fds were truncated".into(),
        });
    }
    let hello = Hello::decode(bytes.get(..received.bytes).unwrap_or(&[]))?;
    let fds: [OwnedFd; HELLO_FDS] =
        fds.try_into()
            .map_err(|fds: Vec<OwnedFd>| ShmError::Handshake {
                detail: format!("peer passed {} fds, expected {HELLO_FDS}", fds.len()),
            })?;
    Ok((hello, fds))
}

/// Sends our verdict on the peer's hello: accepted, or refused with a reason.
pub(crate) fn send_verdict(socket: &OwnedFd, verdict: Result<(), &str>) -> Result<(), ShmError> {
    let mut message = Vec::with_capacity(VERDICT_MAX);
    match verdict {
        Ok(()) => message.push(0),
        Err(reason) => {
            message.push(1);
            let mut end = reason.len().min(VERDICT_MAX - 1);
            while !reason.is_char_boundary(end) {
                end -= 1;
            }
            message.extend_from_slice(&reason.as_bytes()[..end]);
        }
    }
    retry(|| rustix::net::send(socket, &message, SendFlags::NOSIGNAL))
        .map_err(handshake_io("send the verdict"))?;
    Ok(())
}

/// Receives the peer's verdict on our hello.
pub(crate) fn recv_verdict(socket: &OwnedFd) -> Result<(), ShmError> {
    let mut message = [0u8; VERDICT_MAX];
    let (n, _) = retry(|| rustix::net::recv(socket, &mut message, RecvFlags::empty()))
        .map_err(handshake_io("receive the peer's verdict"))?;
    match message.get(..n) {
        Some([0]) => Ok(()),
        Some([1, reason @ ..]) => Err(ShmError::Rejected {
            reason: String::from_utf8_lossy(reason).into_owned(),
        }),
        Some([]) | None => Err(ShmError::Handshake {
            detail: "peer closed the socket before its verdict".into(),
        }),
        Some(_) => Err(ShmError::Handshake {
            detail: "peer sent a malformed verdict".into(),
        }),
    }
}

/// Retries `f` while it is interrupted by a signal.
pub(crate) fn retry<T>(mut f: impl FnMut() -> Result<T, Errno>) -> Result<T, Errno> {
    loop {
        match f() {
            Err(Errno::INTR) => continue,
            other => return other,
        }
    }
}

fn handshake_io(step: &'static str) -> impl FnOnce(Errno) -> ShmError {
    move |errno| {
        if errno == Errno::AGAIN {
            ShmError::Handshake {
                detail: format!("timed out waiting to {step}"),
            }
        } else {
            ShmError::Syscall {
                op: step,
                source: errno.into(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        Hello {
            capacity: 2 << 20,
            max_message_len: 1 << 30,
            identity: HostIdentity {
                boot_id: "6f2ad3f1-2b9e-4c55-9a43-0f3f5e1d7c01".into(),
                net_namespace: 4026531992,
            },
        }
    }

    #[test]
    fn hello_round_trips() {
        let bytes = hello().encode().unwrap();
        assert_eq!(Hello::decode(&bytes).unwrap(), hello());
    }

    #[test]
    fn malformed_hellos_are_errors() {
        let good = hello().encode().unwrap();
        assert!(Hello::decode(&good[..50]).is_err());
        let mut bad_magic = good;
        bad_magic[0] = b'X';
        assert!(Hello::decode(&bad_magic).is_err());
        let mut bad_version = good;
        bad_version[8] = 9;
        assert!(Hello::decode(&bad_version).is_err());
        let mut long_boot_id = good;
        long_boot_id[10..12].copy_from_slice(&1000u16.to_le_bytes());
        assert!(Hello::decode(&long_boot_id).is_err());
        let mut bad_boot_id = good;
        bad_boot_id[40] = b'!';
        assert!(Hello::decode(&bad_boot_id).is_err());
    }

    #[test]
    fn addresses_parse_and_print() {
        assert_eq!(ShmAddr::parse("@rdzv"), ShmAddr::Abstract(b"rdzv".to_vec()));
        assert_eq!(
            ShmAddr::parse("/tmp/x.sock"),
            ShmAddr::Path("/tmp/x.sock".into())
        );
        assert_eq!(ShmAddr::Abstract(b"a".to_vec()).to_string(), "@a");
    }
}
