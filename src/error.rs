//! The error every subcommand of the `rdzv` binary returns: one line on stderr, exit
//! code 1 (`main` prints it).
//!
//! A leaf: it names no other module of the binary, so the command line (`cli`) and the
//! subcommands it calls (`bench`, `demo`, `store_client`, ...) can all use it without a
//! circle. It does not decide which error a subcommand reports.

/// Errors the CLI reports: one line on stderr, exit code 1.
pub(crate) type CliError = Box<dyn std::error::Error + Send + Sync>;
