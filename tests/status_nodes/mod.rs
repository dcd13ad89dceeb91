//! What the status tests share: a store server with `--metrics` on loopback, and `rdzv
//! rendezvous` node processes, killed when dropped.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use rdzv::core::store::access::AccessPolicy;
use rdzv::uring::{ServerOptions, StoreServer};

/// A store server on a free loopback port, with `--metrics` on another, under `access`.
pub(crate) fn server(access: AccessPolicy) -> StoreServer {
    StoreServer::start(ServerOptions {
        host: Some("127.0.0.1".into()),
        port: 0,
        metrics: Some("127.0.0.1:0".parse().expect("an address")),
        access,
        ..ServerOptions::default()
    })
    .expect("a server with --metrics")
}

/// One node process.
pub(crate) struct Node(pub(crate) Child);

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `rdzv rendezvous URL --node-id NAME`, its output drained so that it never
/// blocks on a full pipe.
pub(crate) fn node(url: &str, name: &str) -> Node {
    let mut child = Command::new(env!("CARGO_BIN_EXE_rdzv"))
        .args(["rendezvous", url, "--node-id", name])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn rdzv rendezvous");
    let stdout = child.stdout.take().expect("piped");
    std::thread::spawn(move || BufReader::new(stdout).lines().map_while(Result::ok).count());
    Node(child)
}
