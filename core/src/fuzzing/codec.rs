//! Fuzz checks for the TCPStore codec: the server's request decoder and the client's
//! reply decoder, fed arbitrary bytes.
//!
//! For every input: no panic; `Partial` asks for at least one byte; a complete frame used
//! at most the bytes given, re-encodes to exactly those bytes (the encoding is canonical)
//! and decodes the same from just those bytes; decoding the input in two pieces split at
//! a point the data chooses (with the resuming decoder) gives what decoding it whole
//! gives; and tighter limits never accept what the defaults reject.

use super::{check_display, split_point};
use core::fmt;

use crate::store::codec::{
    decode_request, decode_response_view, peek_query_type, DecodeError, Decoded, EncodeError,
    Limits, PendingReply, RequestDecoder, ResponseDecoder, ResponseView,
};
use crate::store::message::{QueryType, Request, StoreStats};

/// Server side: `data` is the byte stream a client sent.
pub fn codec_request(data: &[u8]) {
    let limits = Limits::default();
    let whole = decode_request(data, &limits);
    check_request(data, &whole);

    match (peek_query_type(data), &whole) {
        (Ok(None), result) => assert_eq!(*result, Ok(Decoded::Partial(1))),
        (Ok(Some(query)), Ok(Decoded::Complete(request, _))) => {
            assert_eq!(request.query_type(), query)
        }
        (Err(peeked), result) => assert_eq!(*result, Err(peeked)),
        (Ok(Some(_)), _) => {}
    }

    // The same stream, arriving in two pieces, through the resuming decoder.
    let split = split_point(data);
    let head = data.get(..split).unwrap_or(data);
    let mut decoder = RequestDecoder::new(limits);
    let first = decoder.decode(head);
    assert_eq!(
        first,
        decode_request(head, &limits),
        "resuming decoder, first piece"
    );
    check_prefix(&first, &whole, split, data.len());
    let second = decoder.decode(data);
    assert_eq!(
        second, whole,
        "resuming decoder, whole input after a split at {split}"
    );

    // Tighter limits may reject more, never accept something else.
    let tight = tight_limits(data);
    let strict = decode_request(data, &tight);
    check_request(data, &strict);
    if let Ok(Decoded::Complete(..)) = strict {
        assert_eq!(strict, whole, "tight limits accepted a different frame");
    }
}

/// Client side: `data[0]` picks the query the reply answers (modulo 20, rdzv's `STATS` last), `data[1]` the
/// number of keys a `MULTI_GET` asked for (modulo 8), and the rest is what the server
/// sent.
pub fn codec_response(data: &[u8]) {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let query = QueryType::ALL[usize::from(selector) % QueryType::ALL.len()];
    let (count, body) = match rest.split_first() {
        Some((&count, body)) => (usize::from(count % 8), body),
        None => (0, rest),
    };
    let Some(pending) = PendingReply::new(query, count) else {
        let silent = [
            QueryType::Validate,
            QueryType::Set,
            QueryType::Append,
            QueryType::MultiSet,
            QueryType::QueuePush,
        ];
        assert!(
            silent.contains(&query),
            "{} should have a reply",
            query.name()
        );
        return;
    };
    assert_eq!(pending.query(), query);

    let limits = Limits::default();
    let whole = decode_response_view(pending, body, &limits);
    check_response(pending, body, &whole);

    let split = split_point(body);
    let head = body.get(..split).unwrap_or(body);
    let mut decoder = ResponseDecoder::new(pending, limits);
    let first = decoder.decode(head);
    assert_eq!(first, decode_response_view(pending, head, &limits));
    check_prefix(&first, &whole, split, body.len());
    let second = decoder.decode(body);
    assert_eq!(
        second, whole,
        "resuming decoder, whole reply after a split at {split}"
    );

    let tight = tight_limits(data);
    let strict = decode_response_view(pending, body, &tight);
    check_response(pending, body, &strict);
    if let Ok(Decoded::Complete(..)) = strict {
        assert_eq!(strict, whole, "tight limits accepted a different reply");
    }
}

fn check_request(data: &[u8], result: &Result<Decoded<Request<'_>>, DecodeError>) {
    match result {
        Ok(Decoded::Partial(needed)) => assert!(*needed >= 1),
        Ok(Decoded::Complete(request, consumed)) => {
            let consumed = *consumed;
            assert!(consumed >= 1 && consumed <= data.len());
            let frame = data.get(..consumed).unwrap_or(data);
            assert_eq!(request.encoded_len(), consumed);
            check_lists(request);
            check_encoding(frame, |out| request.encode(out));
            #[cfg(feature = "alloc")]
            {
                let mut out = alloc::vec::Vec::new();
                request.encode_into(&mut out);
                assert_eq!(out, frame, "re-encoding is not canonical");
            }
            let again = decode_request(frame, &Limits::default());
            assert_eq!(again, Ok(Decoded::Complete(*request, consumed)));
        }
        Err(error) => check_display(error),
    }
}

fn check_response(
    pending: PendingReply,
    body: &[u8],
    result: &Result<Decoded<ResponseView<'_>>, DecodeError>,
) {
    match result {
        Ok(Decoded::Partial(needed)) => assert!(*needed >= 1),
        Ok(Decoded::Complete(ResponseView::Stats(stats), consumed)) => {
            // A STATS reply may carry more or fewer counters than this version knows
            // (forward compatibility), so its encoding is canonical only for the
            // counters known: re-encoding and decoding again gives the same figures.
            assert!(*consumed <= body.len());
            let mut out = [0u8; 8 * (StoreStats::COUNTERS + 1)];
            let view = ResponseView::Stats(*stats);
            assert_eq!(view.encode(&mut out), Ok(out.len()));
            let again = decode_response_view(pending, &out, &Limits::default());
            assert_eq!(again, Ok(Decoded::Complete(view, out.len())));
        }
        Ok(Decoded::Complete(view, consumed)) => {
            let consumed = *consumed;
            assert!(consumed <= body.len());
            let frame = body.get(..consumed).unwrap_or(body);
            assert_eq!(view.encoded_len(), consumed);
            check_encoding(frame, |out| view.encode(out));
            if let ResponseView::Values(list) | ResponseView::Keys(list) = view {
                assert_eq!(list.iter().count(), list.len());
            }
            #[cfg(feature = "alloc")]
            {
                let response = view.to_response();
                assert_eq!(response.encoded_len(), consumed);
                let mut out = alloc::vec::Vec::new();
                assert_eq!(response.encode_into(&mut out), Ok(()));
                assert_eq!(out, frame, "re-encoding is not canonical");
                let decoded =
                    crate::store::codec::decode_response(pending, body, &Limits::default());
                assert_eq!(decoded, Ok(Decoded::Complete(response, consumed)));
            }
            let again = decode_response_view(pending, frame, &Limits::default());
            assert_eq!(again, Ok(Decoded::Complete(*view, consumed)));
        }
        Err(error) => {
            assert_eq!(error.query(), Some(pending.query()));
            check_display(error);
        }
    }
}

/// What decoding a prefix of `len_whole` bytes cut at `split` may say, given what
/// decoding the whole says: a complete frame or an error stays the same, and a `Partial`
/// hint never asks for more than the whole frame has.
fn check_prefix<T: fmt::Debug + PartialEq>(
    prefix: &Result<Decoded<T>, DecodeError>,
    whole: &Result<Decoded<T>, DecodeError>,
    split: usize,
    len_whole: usize,
) {
    match prefix {
        Ok(Decoded::Complete(..)) | Err(_) => assert_eq!(prefix, whole, "split at {split}"),
        Ok(Decoded::Partial(needed)) => match whole {
            Ok(Decoded::Complete(_, consumed)) => {
                assert!(
                    split + needed <= *consumed,
                    "hint {needed} at {split} overshoots"
                )
            }
            Ok(Decoded::Partial(more)) => assert!(split + needed <= len_whole + more),
            Err(_) => {}
        },
    }
}

/// Encodes into a buffer of exactly the right size (must fit) and one byte short (must
/// say how much it needs), comparing with `frame` where the buffer fits on the stack.
fn check_encoding(frame: &[u8], encode: impl Fn(&mut [u8]) -> Result<usize, EncodeError>) {
    const STACK: usize = 4096;
    let mut buf = [0u8; STACK];
    let needed = frame.len();
    if needed <= STACK {
        let exact = buf.get_mut(..needed).unwrap_or(&mut []);
        assert_eq!(encode(exact), Ok(needed));
        assert_eq!(
            buf.get(..needed),
            Some(frame),
            "re-encoding is not canonical"
        );
        if let Some(short) = needed.checked_sub(1).and_then(|n| buf.get_mut(..n)) {
            assert_eq!(encode(short), Err(EncodeError::InsufficientSize { needed }));
        }
    } else {
        assert_eq!(
            encode(&mut buf),
            Err(EncodeError::InsufficientSize { needed })
        );
    }
}

fn check_lists(request: &Request<'_>) {
    match request {
        Request::Check { keys } | Request::Wait { keys } | Request::MultiGet { keys } => {
            assert_eq!(keys.iter().count(), keys.len())
        }
        Request::MultiSet { pairs } => assert_eq!(pairs.iter().count(), pairs.len()),
        _ => {}
    }
}

/// Small limits chosen by the data, so that limit errors are reached often.
fn tight_limits(data: &[u8]) -> Limits {
    let pick = |i: usize, modulus: u8| u64::from(data.get(i).map_or(0, |b| b % modulus));
    Limits::PYTORCH
        .with_max_key_len(pick(1, 16))
        .with_max_value_len(pick(2, 32))
        .with_max_key_count(pick(3, 4))
        .with_max_listed_keys(pick(4, 4))
}
