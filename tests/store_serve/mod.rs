//! A `rdzv store serve` child with small limits (issue 24's memory budget), so that its
//! RSS is its own, and the raw PyTorch-protocol frames the budget tests attack it with.
//! Used by `store_hostile.rs` (fd limit, SIGTERM) and `store_latency.rs` (every attack
//! class while a good client asks); each uses a part, hence the `dead_code` allowance.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

use rdzv::uring::store::tcp::TcpStore;
use rdzv::uring::{IoMode, Store};

pub(crate) const VALIDATE: [u8; 5] = [0x00, 0xce, 0xf7, 0x85, 0x3c];

/// The limits every budget test runs the server with.
pub(crate) const MAX_VALUE: usize = 1 << 20;
pub(crate) const MAX_STORE: usize = 16 << 20;
pub(crate) const MAX_CONN: usize = 4 << 20;
pub(crate) const HIGH_WATER: usize = 1 << 20;
/// What the server's RSS may exceed its budget by: the allocator's slack and freed pages
/// not yet returned, thread stacks, and the copy a read buffer makes while it grows.
pub(crate) const RSS_SLACK_KIB: u64 = 48 << 10;

pub(crate) fn string(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s);
}

pub(crate) fn set_frame(key: &[u8], value: &[u8]) -> Vec<u8> {
    let mut f = vec![1u8];
    string(&mut f, key);
    string(&mut f, value);
    f
}

pub(crate) fn get_frame(key: &[u8]) -> Vec<u8> {
    let mut f = vec![3u8];
    string(&mut f, key);
    f
}

/// Reads until EOF or error; returns true if the server closed the connection.
pub(crate) fn closed_by_server(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 64];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

/// A `store serve` child with the budget above.
pub(crate) struct Serve {
    pub(crate) peer: rdzv_test_support::Peer,
    pub(crate) port: u16,
}

impl Serve {
    pub(crate) fn start(io: IoMode, nofile: Option<u32>) -> Serve {
        Serve::start_with(io, nofile, MAX_VALUE, MAX_CONN)
    }

    /// [`Serve::start`] with another value and connection limit (the store limit and
    /// the mark as there).
    pub(crate) fn start_with(
        io: IoMode,
        nofile: Option<u32>,
        max_value: usize,
        max_conn: usize,
    ) -> Serve {
        let exe = env!("CARGO_BIN_EXE_rdzv");
        let io = match io {
            IoMode::Epoll => "epoll",
            _ => "io-uring",
        };
        let args = format!(
            "store serve --host 127.0.0.1 --port 0 --threads 1 --io {io} \
             --max-value-bytes {max_value} --max-store-bytes {MAX_STORE} \
             --max-conn-bytes {max_conn} --out-high-water {HIGH_WATER}"
        );
        let mut command = Command::new("sh");
        // `ulimit -n` lowers the hard limit too, so the server cannot raise it.
        let limit = nofile.map_or(String::new(), |n| format!("ulimit -n {n} && "));
        command
            .args(["-c", &format!("{limit}exec {exe} {args}")])
            .stdout(Stdio::piped())
            .stderr(if std::env::var_os("RDZV_TEST_SERVER_LOG").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            });
        let mut peer = rdzv_test_support::Peer::spawn("rdzv store serve", command);
        let stdout = peer.child_mut().stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("the listening line");
        let port = line
            .trim()
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
        Serve { peer, port }
    }

    pub(crate) fn raw(&self) -> TcpStream {
        let s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_nodelay(true).unwrap();
        s
    }

    pub(crate) fn store(&self) -> TcpStore {
        TcpStore::connect("127.0.0.1", self.port, Duration::from_secs(10)).unwrap()
    }

    /// How long the server's threads have waited for a CPU while runnable, in all
    /// (`/proc/PID/task/*/schedstat`, the scheduler's run delay); `None` where the
    /// kernel does not keep it.
    pub(crate) fn run_delay(&self) -> Option<Duration> {
        let tasks = std::fs::read_dir(format!("/proc/{}/task", self.peer.id())).ok()?;
        let mut total = Duration::ZERO;
        for task in tasks.flatten() {
            total += run_delay_of(&task.path().join("schedstat"))?;
        }
        Some(total)
    }

    /// A field of /proc/PID/status, in KiB.
    pub(crate) fn status_kib(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.peer.id()))
            .expect("the server's /proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("no {field} in the server's status"))
    }

    /// The server is alive, still serves, and its peak RSS stayed under `budget` bytes
    /// above `base_kib` plus the slack.
    pub(crate) fn check(&mut self, what: &str, base_kib: u64, budget: usize) {
        assert!(
            self.peer.child_mut().try_wait().unwrap().is_none(),
            "{what}: the server died"
        );
        assert_eq!(self.store().get("precious").unwrap(), b"kept", "{what}");
        let peak = self.status_kib("VmHWM:");
        let bound = base_kib + (budget as u64 >> 10) + RSS_SLACK_KIB;
        println!("{what}: peak RSS {peak} KiB (start {base_kib} KiB, bound {bound} KiB)");
        assert!(
            peak <= bound,
            "{what}: peak RSS {peak} KiB over {bound} KiB"
        );
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.peer.child_mut().kill();
    }
}

/// The run delay in a `schedstat` file (its second field, in nanoseconds): how long
/// the task has waited for a CPU while runnable.
pub(crate) fn run_delay_of(schedstat: &std::path::Path) -> Option<Duration> {
    let text = std::fs::read_to_string(schedstat).ok()?;
    let nanos = text.split_whitespace().nth(1)?.parse().ok()?;
    Some(Duration::from_nanos(nanos))
}

/// SET has no reply: a GET on the same connection makes sure it was applied before
/// another connection asks for the key.
pub(crate) fn set_and_confirm(serve: &Serve, key: &str, value: &[u8]) {
    let store = serve.store();
    store.set(key, value).unwrap();
    assert_eq!(store.get(key).unwrap().len(), value.len());
}
