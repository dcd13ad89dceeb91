//! What rdzv's multi-process tests share, in every crate of the workspace.
//!
//! A two-process test starts its own binary again as a peer. If the parent test
//! panics or is killed, that peer must not wait minutes (in a `join`, an accept or a
//! read) for a process that is gone. The parent therefore holds the write end of the
//! peer's standard input for as long as it needs the peer: a [`Peer`] keeps that
//! *lifeline* open until it is dropped, and the peer runs [`exit_when_parent_gone`],
//! which reads its standard input on a thread and exits the process the moment it
//! reaches end of file. The kernel closes the pipe however the parent ends (a panic
//! that unwinds and drops the [`Peer`], `SIGKILL`, an abort), so the peer exits
//! within milliseconds in every case.
//!
//! Peers that talk to their parent over standard input (a line protocol) get the same
//! guarantee from the end of file they read; they do not need the watcher.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

use std::ffi::OsStr;
use std::io::Read;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The exit status of a peer whose parent went away.
pub const PARENT_GONE_EXIT: i32 = 86;

/// How long [`Peer`]'s drop waits for a peer to exit on its own before killing it.
const DROP_GRACE: Duration = Duration::from_secs(5);

/// A peer process that exits when its parent lets go of it.
///
/// Dropping a `Peer` closes the lifeline, waits up to 5 s for the process to end, then
/// kills it, so no test leaves a process behind, passing or failing.
#[derive(Debug)]
pub struct Peer {
    what: String,
    child: Child,
    lifeline: Option<ChildStdin>,
}

impl Peer {
    /// Starts `command` with a lifeline on its standard input. `what` names the peer in
    /// panics ("peer for test X").
    ///
    /// # Panics
    /// When the process cannot be started (a test failure, with the reason).
    pub fn spawn(what: impl Into<String>, mut command: Command) -> Peer {
        let what = what.into();
        command.stdin(Stdio::piped());
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("starting the {what}: {e}"));
        let lifeline = child.stdin.take();
        Peer {
            what,
            child,
            lifeline,
        }
    }

    /// Starts this test binary again, running only `test` (`--exact --nocapture`, and
    /// `extra` harness arguments), with `env` set so that the test plays the peer.
    pub fn spawn_test<K, V>(test: &str, extra: &[&str], env: &[(K, V)]) -> Peer
    where
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        let exe = std::env::current_exe()
            .unwrap_or_else(|e| panic!("finding this test binary to start a peer: {e}"));
        let mut command = Command::new(exe);
        command.args([test, "--exact", "--nocapture"]).args(extra);
        for (key, value) in env {
            command.env(key, value);
        }
        Peer::spawn(format!("peer process for test {test}"), command)
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The child, for its piped output or a signal.
    pub fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }

    /// Waits for the peer to exit, keeping the lifeline open meanwhile (unlike
    /// [`Child::wait`], which would close it first and make the peer quit early).
    ///
    /// # Panics
    /// When waiting fails, or the peer is still running after `limit` (then it is
    /// killed first).
    pub fn wait(&mut self, limit: Duration) -> ExitStatus {
        match self.wait_timeout(limit) {
            Some(status) => status,
            None => {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("the {} was still running after {limit:?}", self.what);
            }
        }
    }

    /// Waits up to `limit` for the peer to exit; `None` if it is still running.
    pub fn wait_timeout(&mut self, limit: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        let mut pause = Duration::from_millis(1);
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if start.elapsed() >= limit => return None,
                Ok(None) => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(50));
                }
                Err(e) => panic!("waiting for the {}: {e}", self.what),
            }
        }
    }

    /// Waits up to `limit` and asserts that the peer exited successfully.
    pub fn expect_success(mut self, limit: Duration) {
        let status = self.wait(limit);
        assert!(status.success(), "the {} failed: {status}", self.what);
    }

    /// Lets go of the peer now: closes the lifeline, so the peer exits.
    pub fn release(&mut self) {
        self.lifeline = None;
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.lifeline = None;
        if self.wait_timeout(DROP_GRACE).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// In a peer: exits the process with [`PARENT_GONE_EXIT`] as soon as the parent lets
/// go (standard input reaches end of file, or cannot be read). Returns at once; the
/// watching happens on a thread.
pub fn exit_when_parent_gone() {
    let spawned = std::thread::Builder::new()
        .name("parent-watch".into())
        .spawn(|| {
            let mut stdin = std::io::stdin();
            let mut buf = [0u8; 64];
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
            eprintln!(
                "peer process {}: the parent test process is gone (standard input closed); exiting",
                std::process::id()
            );
            std::process::exit(PARENT_GONE_EXIT);
        });
    if let Err(e) = spawned {
        panic!("starting the parent-watch thread: {e}");
    }
}

/// In a test that may be a peer: the value of `var` if this process is one (and then
/// the parent watch is running), `None` in the parent.
pub fn peer_env(var: &str) -> Option<String> {
    let value = std::env::var(var).ok()?;
    exit_when_parent_gone();
    Some(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROLE: &str = "RDZV_TEST_SUPPORT_ROLE";

    /// The peer's part of the tests below: waits for its parent, forever if need be.
    #[test]
    fn peer_role() {
        let Some(role) = peer_env(ROLE) else {
            return;
        };
        match role.as_str() {
            "sleep" => std::thread::sleep(Duration::from_secs(600)),
            "exit" => std::process::exit(0),
            other => panic!("unknown role {other}"),
        }
    }

    #[test]
    fn a_peer_exits_when_the_parent_lets_go() {
        let mut peer = Peer::spawn_test("tests::peer_role", &[], &[(ROLE, "sleep")]);
        assert_eq!(peer.wait_timeout(Duration::from_millis(300)), None);
        let start = Instant::now();
        peer.release();
        let status = peer.wait(Duration::from_secs(10));
        assert_eq!(status.code(), Some(PARENT_GONE_EXIT));
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
    }

    #[test]
    fn a_peer_exits_when_the_parent_test_panics() {
        let id = std::thread::spawn(|| {
            let peer = Peer::spawn_test("tests::peer_role", &[], &[(ROLE, "sleep")]);
            let id = peer.id();
            std::panic::resume_unwind(Box::new(id));
        })
        .join()
        .expect_err("the thread panicked")
        .downcast::<u32>()
        .expect("the pid");
        // The unwinding dropped the Peer, which waited for the process to end.
        let alive = std::path::Path::new(&format!("/proc/{id}/status"))
            .exists()
            .then(|| std::fs::read_to_string(format!("/proc/{id}/status")).unwrap_or_default())
            .filter(|s| !s.contains("State:\tZ"));
        assert!(alive.is_none(), "peer {id} still alive: {alive:?}");
    }

    #[test]
    fn waiting_keeps_the_lifeline_open() {
        let peer = Peer::spawn_test("tests::peer_role", &[], &[(ROLE, "exit")]);
        peer.expect_success(Duration::from_secs(30));
    }
}

/// The payload of a test handler's request for a generated tensor (the `make` handlers
/// of the RPC tests): the length as 8 little-endian bytes, then the pattern's seed.
pub fn make_request(len: u64, seed: u8) -> Vec<u8> {
    let mut payload = len.to_le_bytes().to_vec();
    payload.push(seed);
    payload
}

/// The length (the payload's first 8 little-endian bytes; 0 when it has fewer) and the
/// seed (the 9th byte; 0 when absent) of a [`make_request`].
///
/// # Errors
/// When the length does not fit this process's address space.
pub fn parse_make_request(payload: &[u8]) -> Result<(usize, u8), String> {
    let len = payload
        .get(..8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map_or(0, u64::from_le_bytes);
    let len = usize::try_from(len).map_err(|e| format!("a length of {len} bytes: {e}"))?;
    Ok((len, payload.get(8).copied().unwrap_or(0)))
}

#[cfg(test)]
mod make_request_tests {
    use super::*;

    #[test]
    fn a_make_request_round_trips() {
        assert_eq!(parse_make_request(&make_request(4096, 7)), Ok((4096, 7)));
        assert_eq!(parse_make_request(&[]), Ok((0, 0)));
        assert_eq!(parse_make_request(&5u64.to_le_bytes()), Ok((5, 0)));
    }
}
