//! The listening socket: created here (not by glommio) so that the backlog is the host's
//! `somaxconn` rather than glommio's fixed 1024, and so that an unspecified host listens
//! dual-stack on `[::]` like PyTorch's libuv server, falling back to `0.0.0.0`.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};

use socket2::{Domain, Protocol, Socket, Type};

/// The backlog we ask for; the kernel clamps it to `net.core.somaxconn`.
pub const REQUESTED_BACKLOG: i32 = 65535;

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
/// several executors each own a listener on the same port.
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
    fn wildcard_is_dual_stack_first() {
        let addrs = candidate_addrs(None, 7).unwrap();
        assert!(addrs[0].is_ipv6() && addrs[1].is_ipv4());
    }
}
