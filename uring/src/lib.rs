//! `rdzv-uring`: the io_uring runtime that drives `rdzv-core`.
#![warn(missing_docs)]
