//! Entry points shared by the cargo-fuzz targets in `fuzz/` and the corpus replay test.
//!
//! Each function takes arbitrary bytes, drives one parser with them and asserts the
//! properties that must hold for *every* input (no panic, round trips, limits). They are
//! public so that `fuzz/` and `tests/` can reach them; they are not part of the API.
#![doc(hidden)]

mod codec;
mod file_log;
mod query;
#[cfg(feature = "alloc")]
mod rpc_frame;
mod url;

pub use codec::{codec_request, codec_response};
pub use file_log::file_log;
pub use query::query;
#[cfg(feature = "alloc")]
pub use rpc_frame::rpc_frame;
pub use url::url;
