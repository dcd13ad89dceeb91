//! The listening sockets: created here so that the backlog is the host's `somaxconn`
//! (a runtime's default is often a fixed 1024), that every event loop gets its own
//! `SO_REUSEPORT` listener on the one port, and so that an unspecified host listens
//! dual-stack on `[::]` like PyTorch's libuv server, falling back to `0.0.0.0`.
//!
//! A server can also take over a listening socket it inherited ([`adopt_listener`]):
//! `rdzv store serve --listen-fd N` (PyTorch's `master_listen_fd`) or systemd socket
//! activation ([`systemd_listen_fd`]). Every event loop then accepts on a duplicate of
//! that one socket; the kernel hands each connection to one of them.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::os::fd::{BorrowedFd, RawFd};

use socket2::{Domain, Protocol, SockRef, Socket, Type};

/// The first descriptor systemd passes (`SD_LISTEN_FDS_START`).
pub const SD_LISTEN_FDS_START: RawFd = 3;

/// The descriptor systemd's socket activation passes to this process, from the values
/// of `LISTEN_PID` and `LISTEN_FDS` (as `sd_listen_fds(3)` reads them): `Ok(None)` when
/// they are unset or meant for another process (`LISTEN_PID` is not `my_pid`), fd 3 when
/// `LISTEN_FDS` is 1 or more (only the first is served; more are logged by the caller),
/// and an error saying what is wrong when they are set for this process but malformed.
pub fn systemd_listen_fd(
    listen_pid: Option<&str>,
    listen_fds: Option<&str>,
    my_pid: u32,
) -> Result<Option<(RawFd, u32)>, String> {
    let Some(pid) = listen_pid else {
        return Ok(None);
    };
    match pid.trim().parse::<u32>() {
        Ok(pid) if pid == my_pid => {}
        Ok(_) => return Ok(None),
        Err(_) => return Err(format!("LISTEN_PID={pid:?} is not a process id")),
    }
    let fds = listen_fds.unwrap_or("");
    match fds.trim().parse::<u32>() {
        Ok(0) => Err("LISTEN_FDS=0: systemd passed no socket to serve on".into()),
        Ok(n) => Ok(Some((SD_LISTEN_FDS_START, n))),
        Err(_) => Err(format!(
            "LISTEN_FDS={fds:?} is not a number of sockets (LISTEN_PID names this process)"
        )),
    }
}

/// `count` sockets to accept on, all duplicates of the inherited listening socket `fd`,
/// after checking that `fd` is an open, listening IPv4/IPv6 TCP socket. The inherited
/// descriptor itself stays open and owned by the caller; the duplicates are made
/// non-blocking (a flag the original shares) and close-on-exec.
///
/// Errors say which check failed and what to do, e.g. "fd 3 is not listening".
pub fn adopt_listener(fd: RawFd, count: usize) -> io::Result<Vec<Socket>> {
    let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidInput, what);
    if fd < 0 {
        return Err(invalid(format!("--listen-fd {fd}: not a file descriptor")));
    }
    crate::sys::fd::with_inherited(fd, |borrowed| adopt_borrowed(borrowed, fd, count))
        .unwrap_or_else(|| {
            Err(invalid(format!(
                "fd {fd} is not open in this process (was it inherited? the parent must \
                 clear FD_CLOEXEC on it)"
            )))
        })
}

/// [`adopt_listener`]'s checks and duplicates, on the open descriptor `borrowed`
/// (number `fd`).
fn adopt_borrowed(borrowed: BorrowedFd<'_>, fd: RawFd, count: usize) -> io::Result<Vec<Socket>> {
    let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidInput, what);
    let stat = rustix::fs::fstat(borrowed)?;
    if rustix::fs::FileType::from_raw_mode(stat.st_mode) != rustix::fs::FileType::Socket {
        return Err(invalid(format!("fd {fd} is not a socket")));
    }
    let sock = SockRef::from(&borrowed);
    let domain = sock.domain()?;
    if domain != Domain::IPV4 && domain != Domain::IPV6 {
        return Err(invalid(format!(
            "fd {fd} is not an IPv4 or IPv6 socket ({domain:?}); the store serves TCP"
        )));
    }
    let kind = sock.r#type()?;
    if kind != Type::STREAM {
        return Err(invalid(format!(
            "fd {fd} is not a TCP (stream) socket ({kind:?})"
        )));
    }
    if !sock.is_listener()? {
        return Err(invalid(format!(
            "fd {fd} is a TCP socket but is not listening: bind and listen() before passing it"
        )));
    }
    let first = Socket::from(borrowed.try_clone_to_owned()?);
    first.set_nonblocking(true)?;
    first.set_cloexec(true)?;
    let mut sockets = Vec::with_capacity(count.max(1));
    for _ in 1..count.max(1) {
        let more = first.try_clone()?;
        more.set_cloexec(true)?;
        sockets.push(more);
    }
    sockets.insert(0, first);
    Ok(sockets)
}

/// The backlog we ask for; the kernel clamps it to `net.core.somaxconn`.
pub const REQUESTED_BACKLOG: i32 = 65535;

/// The backlog the kernel grants when it caps `requested` at `somaxconn`, or `None` when
/// it grants all of it (or `somaxconn` could not be read). The server only notes the cap
/// (at info): whether a cap below the request matters depends on how many ranks connect
/// at once, which `rdzv store serve --world-size` checks and warns about
/// ([`super::capacity::capacity_shortfalls`]). A default host's 4096 holds the demo's 4
/// workers and most jobs, so it is no warning.
pub fn backlog_cap(somaxconn: Option<u32>, requested: i32) -> Option<u32> {
    let max = somaxconn?;
    (i64::from(max) < i64::from(requested)).then_some(max)
}

/// Reads `/proc/sys/net/core/somaxconn`, if it can.
pub fn somaxconn() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The addresses to try for `host` (all of them, in resolver order), or the dual-stack
/// wildcard then the IPv4 wildcard when `host` is `None`.
pub fn candidate_addrs(host: Option<&str>, port: u16) -> io::Result<Vec<SocketAddr>> {
    match host {
        None | Some("") => Ok(vec![
            SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port),
            SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port),
        ]),
        Some(h) => {
            let h = h.trim_start_matches('[').trim_end_matches(']');
            Ok((h, port).to_socket_addrs()?.collect())
        }
    }
}

/// Binds and listens on the first address of `addrs` that works. `reuse_port` lets
/// several event loops each own a listener on the same port.
///
/// On failure the error lists every address tried, like PyTorch's "The server socket has
/// failed to listen on any local network address." message.
pub fn listen(addrs: &[SocketAddr], reuse_port: bool, backlog: i32) -> io::Result<Socket> {
    let mut failures = Vec::new();
    for addr in addrs {
        match listen_one(*addr, reuse_port, backlog) {
            Ok(socket) => return Ok(socket),
            Err(e) => failures.push(format!("{addr}: {e}")),
        }
    }
    let port = addrs.first().map(|a| a.port()).unwrap_or(0);
    let kind = if failures.iter().any(|f| f.contains("in use")) {
        io::ErrorKind::AddrInUse
    } else {
        io::ErrorKind::Other
    };
    Err(io::Error::new(
        kind,
        format!(
            "The server socket has failed to listen on any local network address. port: {port}, tried: {}",
            failures.join("; ")
        ),
    ))
}

/// `count` listeners on one address: the first address of `addrs` that works, with
/// `SO_REUSEPORT` when `count > 1` so that the kernel spreads connections over them.
///
/// A port that another server already listens on is refused even when that server set
/// `SO_REUSEPORT` too (two rdzv servers, or a stale one): the port is first taken by a
/// plain listener, which fails if anyone listens there, then released to the group.
pub fn listen_group(addrs: &[SocketAddr], count: usize, backlog: i32) -> io::Result<Vec<Socket>> {
    let probe = listen(addrs, false, backlog)?;
    if count <= 1 {
        return Ok(vec![probe]);
    }
    let addr = probe
        .local_addr()?
        .as_socket()
        .ok_or_else(|| io::Error::other("listening socket has no address"))?;
    drop(probe);
    (0..count).map(|_| listen(&[addr], true, backlog)).collect()
}

fn listen_one(addr: SocketAddr, reuse_port: bool, backlog: i32) -> io::Result<Socket> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    if addr.is_ipv6() {
        socket.set_only_v6(false)?;
    }
    socket.set_reuse_address(true)?;
    if reuse_port {
        socket.set_reuse_port(true)?;
    }
    socket.set_nonblocking(true)?;
    socket.set_cloexec(true)?;
    socket.bind(&addr.into())?;
    socket.listen(backlog)?;
    Ok(socket)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backlog_cap_only_when_somaxconn_is_below_the_request() {
        assert_eq!(backlog_cap(Some(4096), REQUESTED_BACKLOG), Some(4096));
        assert_eq!(backlog_cap(Some(65535), REQUESTED_BACKLOG), None);
        assert_eq!(backlog_cap(Some(1 << 20), REQUESTED_BACKLOG), None);
        assert_eq!(backlog_cap(None, REQUESTED_BACKLOG), None);
        assert_eq!(backlog_cap(Some(128), 16), None);
        assert_eq!(backlog_cap(Some(u32::MAX), i32::MAX), None);
    }

    #[test]
    fn busy_port_reports_every_address() {
        let first = listen(&candidate_addrs(Some("127.0.0.1"), 0).unwrap(), false, 16).unwrap();
        let port = first.local_addr().unwrap().as_socket().unwrap().port();
        let err = listen(
            &candidate_addrs(Some("127.0.0.1"), port).unwrap(),
            false,
            16,
        )
        .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
        assert!(err
            .to_string()
            .starts_with("The server socket has failed to listen on any local network address"));
        assert!(err.to_string().contains(&port.to_string()));
    }

    #[test]
    fn a_group_shares_one_port_and_refuses_a_second_group() {
        let addrs = candidate_addrs(Some("127.0.0.1"), 0).unwrap();
        let group = listen_group(&addrs, 3, 16).unwrap();
        let ports: Vec<u16> = group
            .iter()
            .map(|s| s.local_addr().unwrap().as_socket().unwrap().port())
            .collect();
        assert!(ports.iter().all(|&p| p == ports[0] && p != 0), "{ports:?}");
        let again = candidate_addrs(Some("127.0.0.1"), ports[0]).unwrap();
        let err = listen_group(&again, 2, 16).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse, "{err}");
    }

    #[test]
    fn systemd_variables_name_fd_3_only_for_this_process() {
        assert_eq!(systemd_listen_fd(None, Some("1"), 7), Ok(None));
        assert_eq!(systemd_listen_fd(Some("8"), Some("1"), 7), Ok(None));
        assert_eq!(systemd_listen_fd(Some("7"), Some("1"), 7), Ok(Some((3, 1))));
        assert_eq!(systemd_listen_fd(Some("7"), Some("2"), 7), Ok(Some((3, 2))));
        assert!(systemd_listen_fd(Some("7"), Some("0"), 7)
            .unwrap_err()
            .contains("LISTEN_FDS=0"));
        assert!(systemd_listen_fd(Some("7"), None, 7)
            .unwrap_err()
            .contains("LISTEN_FDS"));
        assert!(systemd_listen_fd(Some("x"), Some("1"), 7)
            .unwrap_err()
            .contains("LISTEN_PID"));
    }

    #[test]
    fn adopts_a_listening_socket_and_refuses_anything_else() {
        use std::os::fd::AsRawFd;
        let listening = listen(&candidate_addrs(Some("127.0.0.1"), 0).unwrap(), false, 16).unwrap();
        let adopted = adopt_listener(listening.as_raw_fd(), 3).unwrap();
        assert_eq!(adopted.len(), 3);
        for socket in &adopted {
            assert_eq!(
                socket.local_addr().unwrap(),
                listening.local_addr().unwrap()
            );
            assert_ne!(socket.as_raw_fd(), listening.as_raw_fd());
        }
        let not_listening = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).unwrap();
        let err = adopt_listener(not_listening.as_raw_fd(), 1).unwrap_err();
        assert!(err.to_string().contains("is not listening"), "{err}");
        let udp = Socket::new(Domain::IPV4, Type::DGRAM, None).unwrap();
        let err = adopt_listener(udp.as_raw_fd(), 1).unwrap_err();
        assert!(err.to_string().contains("not a TCP"), "{err}");
        let file = std::fs::File::open("/proc/self/status").unwrap();
        let err = adopt_listener(file.as_raw_fd(), 1).unwrap_err();
        assert!(err.to_string().contains("is not a socket"), "{err}");
        let err = adopt_listener(1_000_000, 1).unwrap_err();
        assert!(err.to_string().contains("is not open"), "{err}");
        let (unix, _) = std::os::unix::net::UnixStream::pair().unwrap();
        let err = adopt_listener(unix.as_raw_fd(), 1).unwrap_err();
        assert!(err.to_string().contains("not an IPv4 or IPv6"), "{err}");
    }

    #[test]
    fn wildcard_is_dual_stack_first() {
        let addrs = candidate_addrs(None, 7).unwrap();
        assert!(addrs[0].is_ipv6() && addrs[1].is_ipv4());
    }
}
