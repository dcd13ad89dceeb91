//! The checks behind this crate's cargo-fuzz target (`fuzz/fuzz_targets/metrics_http.rs`),
//! public so that `uring/tests/fuzz_corpus.rs` replays the committed seeds and random
//! inputs through exactly the same assertions in every `cargo test`.
//!
//! What is checked: the `--metrics` HTTP endpoint's request-head reader and router
//! (`server::metrics`) never panic on any bytes, only the request line decides the
//! answer, a complete head stays complete as more bytes arrive, and a request line of
//! `GET /metrics` answers with the figures whatever follows it. Nothing here opens a
//! socket.

use crate::server::metrics::{head_complete, route, Route, MAX_HEAD};

/// Feeds `data`, as a request head received by the metrics thread, to its reader and
/// router, alone and inside requests whose answer is known.
///
/// # Panics
/// When the reader or router breaks its contract (that is the finding).
pub fn metrics_http(data: &[u8]) {
    let answer = route(data);
    if answer == Route::TooLarge {
        assert!(data.len() >= MAX_HEAD && !head_complete(data));
    }
    let mut longer = data.to_vec();
    longer.push(b'X');
    if head_complete(data) {
        assert!(head_complete(&longer), "a complete head stays complete");
    }
    longer.extend_from_slice(b"\r\n\r\n");
    assert!(head_complete(&longer), "an empty line completes any head");
    // Only the request line counts: whatever follows its end changes nothing.
    if let Some(end) = data.iter().position(|&b| b == b'\n') {
        let mut first_line = data.get(..=end).unwrap_or_default().to_vec();
        first_line.extend_from_slice(b"\n");
        if data.len() < MAX_HEAD {
            assert_eq!(route(&first_line), answer, "headers changed the answer");
        }
    }
    // `GET /metrics`, then a space or a query string: the figures, whatever follows.
    let tail = data.get(..data.len().min(MAX_HEAD / 2)).unwrap_or_default();
    for prefix in [&b"GET /metrics "[..], b"GET /metrics?"] {
        let mut request = prefix.to_vec();
        request.extend_from_slice(tail);
        assert_eq!(route(&request), Route::Metrics, "{request:?}");
    }
    // Another method, or another path, is never served the figures.
    let mut post = b"POST /metrics ".to_vec();
    post.extend_from_slice(tail);
    assert_eq!(route(&post), Route::MethodNotAllowed);
}
