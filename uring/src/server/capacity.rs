//! Whether this host can hold a store of a given world size: the listen backlog
//! (`net.core.somaxconn`) must take a storm of every rank connecting at once, and the
//! open-file limit must hold a descriptor per rank. This module only compares numbers
//! and words the warnings; the caller reads the limits and raises what it may.

/// Descriptors the server needs beside its connections: listeners, epoll and event
/// descriptors per loop, stdio, log files, the runtime's own.
pub const RESERVED_FDS: u64 = 64;

/// One line per limit of this host that cannot hold `world_size` ranks, saying what to
/// change; empty when both suffice. `somaxconn` is `None` when it could not be read.
pub fn capacity_shortfalls(
    world_size: u64,
    somaxconn: Option<u32>,
    open_files: u64,
) -> Vec<String> {
    let mut lines = Vec::new();
    if let Some(max) = somaxconn {
        if u64::from(max) < world_size {
            lines.push(format!(
                "net.core.somaxconn={max} caps the listen backlog below the world size \
                 {world_size}: when every rank connects at once some may see resets and \
                 retry. Raise it with `sysctl -w net.core.somaxconn={}`",
                world_size.next_power_of_two().clamp(4096, 65535)
            ));
        }
    }
    let needed = world_size.saturating_add(RESERVED_FDS);
    if open_files < needed {
        lines.push(format!(
            "the open-file limit (RLIMIT_NOFILE) is {open_files}, below the {needed} \
             descriptors a world size of {world_size} needs: connections past it will be \
             refused. Raise the hard limit (`ulimit -Hn`, systemd `LimitNOFILE=`, or \
             /etc/security/limits.conf)"
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enough_of_both_says_nothing() {
        assert!(capacity_shortfalls(1024, Some(4096), 1 << 20).is_empty());
        assert!(capacity_shortfalls(4096, None, 1 << 20).is_empty());
    }

    #[test]
    fn each_shortfall_names_its_limit_and_the_fix() {
        let lines = capacity_shortfalls(16384, Some(4096), 1024);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(
            lines[0].contains("somaxconn=4096")
                && lines[0].contains("sysctl -w net.core.somaxconn=16384")
        );
        assert!(lines[1].contains("RLIMIT_NOFILE) is 1024") && lines[1].contains("16448"));
        let only_fds = capacity_shortfalls(2000, Some(4096), 2000);
        assert_eq!(only_fds.len(), 1);
        assert!(only_fds[0].contains("RLIMIT_NOFILE"));
    }
}
