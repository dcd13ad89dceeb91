//! Entry points shared by the cargo-fuzz targets in `fuzz/` and the corpus replay test.
//!
//! Each function takes arbitrary bytes, drives one parser with them and asserts the
//! properties that must hold for *every* input (no panic, round trips, limits). They are
//! public so that `fuzz/` and `tests/` can reach them; they are not part of the API.
#![doc(hidden)]

#[cfg(feature = "alloc")]
mod access;
mod channel;
mod codec;
#[cfg(feature = "alloc")]
mod elastic;
mod file_log;
mod query;
#[cfg(feature = "alloc")]
mod rpc_frame;
#[cfg(feature = "alloc")]
mod rpc_restricted;
#[cfg(feature = "alloc")]
mod serve_step;
mod url;

#[cfg(feature = "alloc")]
pub use access::access;
pub use channel::channel_descriptors;
pub use codec::{codec_request, codec_response};
#[cfg(feature = "alloc")]
pub use elastic::elastic;
pub use file_log::file_log;
pub use query::query;
#[cfg(feature = "alloc")]
pub use rpc_frame::rpc_frame;
#[cfg(feature = "alloc")]
pub use rpc_restricted::rpc_restricted;
#[cfg(feature = "alloc")]
pub use serve_step::{serve_step, serve_step_with};
pub use url::url;

use core::fmt::{self, Write};

/// Asserts that an error's `Display` writes a non-empty message (without allocating).
pub(crate) fn check_display(error: &impl core::fmt::Display) {
    struct Count(usize);
    impl Write for Count {
        fn write_str(&mut self, s: &str) -> core::fmt::Result {
            self.0 += s.len();
            Ok(())
        }
    }
    let mut count = Count(0);
    assert!(write!(count, "{error}").is_ok());
    assert!(count.0 > 0, "empty error message");
}

/// A split point in `0..=data.len()` chosen by the data itself.
pub(crate) fn split_point(data: &[u8]) -> usize {
    let sum = data.iter().fold(0usize, |acc, &b| {
        acc.wrapping_mul(31).wrapping_add(usize::from(b))
    });
    sum % (data.len() + 1)
}

/// A writer that compares what it is given with an expected text.
struct Expect<'a> {
    rest: &'a str,
    matches: bool,
}

impl Write for Expect<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        match self.rest.strip_prefix(s) {
            Some(rest) if self.matches => self.rest = rest,
            _ => self.matches = false,
        }
        Ok(())
    }
}

/// Whether `value` displays as exactly `expected`.
pub(crate) fn displays_as(value: &dyn fmt::Display, expected: &str) -> bool {
    let mut expect = Expect {
        rest: expected,
        matches: true,
    };
    let written = write!(expect, "{value}").is_ok();
    written && expect.matches && expect.rest.is_empty()
}

/// The longest valid UTF-8 prefix of `data`.
pub(crate) fn utf8_prefix(data: &[u8]) -> &str {
    match core::str::from_utf8(data) {
        Ok(text) => text,
        Err(error) => data
            .get(..error.valid_up_to())
            .and_then(|valid| core::str::from_utf8(valid).ok())
            .unwrap_or(""),
    }
}
