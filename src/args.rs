//! Command-line values shared by the subcommands: a number of seconds, a `HOST:PORT`.
//!
//! Below `cli` and the subcommands, above only [`crate::error`]; it parses values and
//! does not define options (clap's derive in `cli` and each subcommand does).

use std::net::ToSocketAddrs;
use std::time::Duration;

use crate::error::CliError;

pub(crate) fn seconds(s: f64, what: &str) -> Result<Duration, CliError> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| format!("{what} must be a non-negative number of seconds, got {s}").into())
}

pub(crate) fn split_addr(addr: &str) -> Result<(String, u16), CliError> {
    let (host, port) = addr
        .rsplit_once(':')
        .ok_or_else(|| format!("--addr must be HOST:PORT, got {addr:?}"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("port must have value from 0 to 65535 but was {port}."))?;
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    (host.as_str(), port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {host}: {e}"))?;
    Ok((host, port))
}
