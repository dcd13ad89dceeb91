//! Golden frames, split points, limits and property tests for the codec.
//!
//! Expected bytes are spelled out by hand (or built by the independent `Model` encoder
//! below), never produced by the encoder under test.

use std::boxed::Box;
use std::string::ToString;
use std::vec;
use std::vec::Vec;

use proptest::prelude::*;

use super::*;
use crate::store::message::{
    CheckResponse, KeyList, PairList, QueryType, Request, Response, WaitResponse, VALIDATION_MAGIC,
};

// ---------------------------------------------------------------------------------------
// Hand-written frame building (independent of the encoder under test).

/// Parses whitespace-separated hex bytes.
fn hex(text: &str) -> Vec<u8> {
    text.split_whitespace()
        .map(|b| u8::from_str_radix(b, 16).expect("test hex"))
        .collect()
}

fn le64(n: u64) -> [u8; 8] {
    n.to_le_bytes()
}

/// A `u64` length-prefixed string.
fn s(bytes: &[u8]) -> Vec<u8> {
    let mut out = le64(bytes.len() as u64).to_vec();
    out.extend_from_slice(bytes);
    out
}

fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

fn keys_encoded(keys: &[&[u8]]) -> Vec<u8> {
    keys.iter().flat_map(|k| s(k)).collect()
}

fn pairs_encoded(pairs: &[(&[u8], &[u8])]) -> Vec<u8> {
    pairs
        .iter()
        .flat_map(|(k, v)| cat(&[&s(k), &s(v)]))
        .collect()
}

// ---------------------------------------------------------------------------------------
// Golden requests.

/// Every query type once (two for a few), as `(frame, check)`; `check` compares the
/// decoded request with what the frame means.
/// Checks that a decoded request means what its golden frame says.
type RequestCheck = Box<dyn Fn(&Request<'_>)>;

fn golden_requests() -> Vec<(Vec<u8>, RequestCheck)> {
    let ab = keys_encoded(&[b"/a", b"/b"]);
    let pairs = pairs_encoded(&[(b"/a", b"1"), (b"/b", b"")]);
    let list_check = |expect: Vec<&'static [u8]>| {
        move |keys: &KeyList<'_>| {
            assert_eq!(keys.len(), expect.len());
            assert_eq!(keys.iter().collect::<Vec<_>>(), expect);
        }
    };
    vec![
        (
            b"\x00\xce\xf7\x85\x3c".to_vec(),
            Box::new(|r: &Request<'_>| {
                assert_eq!(
                    *r,
                    Request::Validate {
                        magic: VALIDATION_MAGIC
                    }
                )
            }),
        ),
        (
            hex("00 de ad be ef"),
            Box::new(|r: &Request<'_>| assert_eq!(*r, Request::Validate { magic: 0xefbe_adde })),
        ),
        (
            hex("0d 78 56 34 12"),
            Box::new(|r: &Request<'_>| assert_eq!(*r, Request::Ping { nonce: 0x1234_5678 })),
        ),
        (
            hex("01 02 00 00 00 00 00 00 00 2f 6b 02 00 00 00 00 00 00 00 76 31"),
            Box::new(|r: &Request<'_>| {
                assert_eq!(
                    *r,
                    Request::Set {
                        key: b"/k",
                        value: b"v1"
                    }
                )
            }),
        ),
        (
            cat(&[&[2], &s(b"/k"), &s(b""), &s(b"new")]),
            Box::new(|r: &Request<'_>| {
                assert_eq!(
                    *r,
                    Request::CompareSet {
                        key: b"/k",
                        expected: b"",
                        desired: b"new"
                    }
                )
            }),
        ),
        (
            cat(&[&[3], &s(b"/k")]),
            Box::new(|r: &Request<'_>| assert_eq!(*r, Request::Get { key: b"/k" })),
        ),
        (
            cat(&[&[4], &s(b"init/"), &1i64.to_le_bytes()]),
            Box::new(|r: &Request<'_>| {
                assert_eq!(
                    *r,
                    Request::Add {
                        key: b"init/",
                        delta: 1
                    }
                )
            }),
        ),
        (
            cat(&[&[4], &s(b"/c"), &hex("ff ff ff ff ff ff ff ff")]),
            Box::new(|r: &Request<'_>| {
                assert_eq!(
                    *r,
                    Request::Add {
                        key: b"/c",
                        delta: -1
                    }
                )
            }),
        ),
        (
            cat(&[&[5], &le64(2), &ab]),
            Box::new(move |r: &Request<'_>| match r {
                Request::Check { keys } => list_check(vec![b"/a", b"/b"])(keys),
                other => panic!("{other:?}"),
            }),
        ),
        (
            cat(&[&[6], &le64(1), &s(b"/a")]),
            Box::new(move |r: &Request<'_>| match r {
                Request::Wait { keys } => list_check(vec![b"/a"])(keys),
                other => panic!("{other:?}"),
            }),
        ),
        (
            cat(&[&[6], &le64(0)]),
            Box::new(move |r: &Request<'_>| match r {
                Request::Wait { keys } => list_check(vec![])(keys),
                other => panic!("{other:?}"),
            }),
        ),
        (
            vec![7],
            Box::new(|r: &Request<'_>| assert_eq!(*r, Request::GetNumKeys)),
        ),
        (
            cat(&[&[8], &s(b"/k")]),
            Box::new(|r: &Request<'_>| assert_eq!(*r, Request::DeleteKey { key: b"/k" })),
        ),
        (
            cat(&[&[9], &s(b"/k"), &s(b"x")]),
            Box::new(|r: &Request<'_>| {
                assert_eq!(
                    *r,
                    Request::Append {
                        key: b"/k",
                        value: b"x"
                    }
                )
            }),
        ),
        (
            cat(&[&[10], &le64(2), &ab]),
            Box::new(move |r: &Request<'_>| match r {
                Request::MultiGet { keys } => list_check(vec![b"/a", b"/b"])(keys),
                other => panic!("{other:?}"),
            }),
        ),
        (
            cat(&[&[11], &2i64.to_le_bytes(), &pairs]),
            Box::new(|r: &Request<'_>| match r {
                Request::MultiSet { pairs } => {
                    assert_eq!(pairs.len(), 2);
                    let got: Vec<_> = pairs.iter().collect();
                    assert_eq!(got, [(&b"/a"[..], &b"1"[..]), (&b"/b"[..], &b""[..])]);
                }
                other => panic!("{other:?}"),
            }),
        ),
        (
            vec![12],
            Box::new(|r: &Request<'_>| assert_eq!(*r, Request::CancelWait)),
        ),
        (
            cat(&[&[14], &s(b"q"), &s(b"e")]),
            Box::new(|r: &Request<'_>| {
                assert_eq!(
                    *r,
                    Request::QueuePush {
                        key: b"q",
                        value: b"e"
                    }
                )
            }),
        ),
        (
            cat(&[&[15], &s(b"q")]),
            Box::new(|r: &Request<'_>| assert_eq!(*r, Request::QueuePop { key: b"q" })),
        ),
        (
            cat(&[&[16], &s(b"q")]),
            Box::new(|r: &Request<'_>| assert_eq!(*r, Request::QueueLen { key: b"q" })),
        ),
        (
            vec![17],
            Box::new(|r: &Request<'_>| assert_eq!(*r, Request::ListKeys)),
        ),
        (
            cat(&[&[18], &s(b"/b"), &4i64.to_le_bytes()]),
            Box::new(|r: &Request<'_>| {
                assert_eq!(
                    *r,
                    Request::Barrier {
                        key: b"/b",
                        world_size: 4
                    }
                )
            }),
        ),
    ]
}

#[test]
fn golden_requests_cover_every_query_type() {
    let mut seen: Vec<u8> = golden_requests().iter().map(|(f, _)| f[0]).collect();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen, (0..=18).collect::<Vec<u8>>());
}

#[test]
fn golden_requests_decode_and_encode() {
    let limits = Limits::default();
    for (frame, check) in golden_requests() {
        let Ok(Decoded::Complete(request, consumed)) = decode_request(&frame, &limits) else {
            panic!("{frame:02x?} did not decode");
        };
        check(&request);
        assert_eq!(consumed, frame.len(), "{frame:02x?}");
        assert_eq!(request.encoded_len(), frame.len());

        let mut out = Vec::new();
        request.encode_into(&mut out);
        assert_eq!(out, frame);

        let mut buf = vec![0xAA; frame.len() + 3];
        assert_eq!(request.encode(&mut buf), Ok(frame.len()));
        assert_eq!(&buf[..frame.len()], &frame[..]);
        assert_eq!(&buf[frame.len()..], [0xAA; 3], "wrote past the frame");
        let short = &mut buf[..frame.len() - 1];
        assert_eq!(
            request.encode(short),
            Err(EncodeError::InsufficientSize {
                needed: frame.len()
            })
        );
    }
}

#[test]
fn encode_appends_without_clearing() {
    let mut out = vec![0x42];
    Request::GetNumKeys.encode_into(&mut out);
    Request::Ping { nonce: 7 }.encode_into(&mut out);
    assert_eq!(out, hex("42 07 0d 07 00 00 00"));
}

#[test]
fn trailing_bytes_are_left_unconsumed() {
    let limits = Limits::default();
    for (frame, check) in golden_requests() {
        let mut stream = frame.clone();
        stream.extend_from_slice(&hex("01 02 03"));
        let Ok(Decoded::Complete(request, consumed)) = decode_request(&stream, &limits) else {
            panic!("{frame:02x?} did not decode with trailing bytes");
        };
        check(&request);
        assert_eq!(consumed, frame.len());
    }
}

#[test]
fn every_split_point_is_partial_until_the_end() {
    let limits = Limits::default();
    for (frame, _) in golden_requests() {
        let whole = decode_request(&frame, &limits).unwrap();
        let mut decoder = RequestDecoder::new(limits);
        for cut in 0..frame.len() {
            let prefix = &frame[..cut];
            let stateless = decode_request(prefix, &limits);
            let Ok(Decoded::Partial(needed)) = stateless else {
                panic!("{frame:02x?} cut at {cut}: {stateless:?}");
            };
            assert!(
                needed >= 1 && cut + needed <= frame.len(),
                "hint {needed} at {cut}"
            );
            assert_eq!(decoder.decode(prefix), stateless);
        }
        assert_eq!(decoder.decode(&frame), Ok(whole));
    }
}

/// A `CHECK` of 1000 keys fed one byte at a time: the decoder walks each key once, the
/// total the stateless decoder spends on a single whole frame.
#[test]
fn request_decoder_walks_each_key_once() {
    let count = 1000usize;
    let mut frame = vec![QueryType::Check as u8];
    frame.extend_from_slice(&(count as u64).to_le_bytes());
    for i in 0..count {
        let key = std::format!("key{i}");
        frame.extend_from_slice(&(key.len() as u64).to_le_bytes());
        frame.extend_from_slice(key.as_bytes());
    }
    let mut decoder = RequestDecoder::new(Limits::default());
    for cut in 0..frame.len() {
        assert!(matches!(
            decoder.decode(&frame[..cut]),
            Ok(Decoded::Partial(_))
        ));
    }
    assert!(decoder.decode(&frame).unwrap().is_complete());
    assert_eq!(decoder.items_walked(), count as u64);
}

#[test]
fn partial_hints_are_exact_for_fixed_fields() {
    let limits = Limits::default();
    assert_eq!(decode_request(b"", &limits), Ok(Decoded::Partial(1)));
    assert_eq!(decode_request(b"\x00", &limits), Ok(Decoded::Partial(4)));
    assert_eq!(
        decode_request(b"\x00\xce", &limits),
        Ok(Decoded::Partial(3))
    );
    // SET with nothing after the type byte: two length prefixes at least.
    assert_eq!(decode_request(b"\x01", &limits), Ok(Decoded::Partial(16)));
    // SET whose key length says 5 and value has not started: 5 + 8.
    let set = cat(&[&[1], &le64(5)]);
    assert_eq!(decode_request(&set, &limits), Ok(Decoded::Partial(13)));
    // ADD with its key: the i64 delta.
    let add = cat(&[&[4], &s(b"/k")]);
    assert_eq!(decode_request(&add, &limits), Ok(Decoded::Partial(8)));
    // CHECK of 3 keys, none arrived: three length prefixes.
    let check = cat(&[&[5], &le64(3)]);
    assert_eq!(decode_request(&check, &limits), Ok(Decoded::Partial(24)));
    // MULTI_SET of 2 pairs, first key in: its value, then one pair.
    let multi = cat(&[&[11], &2i64.to_le_bytes(), &s(b"/a")]);
    assert_eq!(decode_request(&multi, &limits), Ok(Decoded::Partial(24)));
}

#[test]
fn concatenated_frames_decode_one_by_one() {
    let limits = Limits::default();
    let frames: Vec<Vec<u8>> = golden_requests().into_iter().map(|(f, _)| f).collect();
    let stream = frames.concat();
    let mut rest = &stream[..];
    let mut decoder = RequestDecoder::new(limits);
    for frame in &frames {
        let Ok(Decoded::Complete(request, consumed)) = decoder.decode(rest) else {
            panic!("stream broke before {frame:02x?}");
        };
        assert_eq!(consumed, frame.len());
        let mut out = Vec::new();
        request.encode_into(&mut out);
        assert_eq!(&out, frame);
        rest = &rest[consumed..];
    }
    assert!(rest.is_empty());
    assert_eq!(decoder.decode(rest), Ok(Decoded::Partial(1)));
}

// ---------------------------------------------------------------------------------------
// Limits and invalid requests.

#[test]
fn huge_key_is_rejected_from_its_length_field_alone() {
    // GET claiming a 4 GiB key: nine bytes are enough to know.
    let frame = cat(&[&[3], &le64(1 << 32)]);
    assert_eq!(frame.len(), 9);
    let error = decode_request(&frame, &Limits::default()).unwrap_err();
    assert_eq!(
        error,
        DecodeError::LengthOverLimit {
            query: QueryType::Get,
            field: Field::Key,
            claimed: 1 << 32,
            limit: 8192
        }
    );
    assert_eq!(
        error.to_string(),
        "GET key length 4294967296 exceeds the limit of 8192 bytes"
    );
    // One byte short of the length field: still waiting.
    assert_eq!(
        decode_request(&frame[..8], &Limits::default()),
        Ok(Decoded::Partial(1))
    );
}

#[test]
fn huge_value_names_query_field_claim_and_limit() {
    let frame = cat(&[&[1], &s(b"/k"), &le64(1 << 32)]);
    let error = decode_request(&frame, &Limits::default()).unwrap_err();
    assert_eq!(
        error.to_string(),
        "SET value length 4294967296 exceeds the limit of 8388608 bytes"
    );
    assert_eq!(error.query(), Some(QueryType::Set));

    let cas = cat(&[&[2], &s(b"/k"), &s(b""), &le64(8 * 1024 * 1024 + 1)]);
    assert_eq!(
        decode_request(&cas, &Limits::default())
            .unwrap_err()
            .to_string(),
        "COMPARE_SET desired value length 8388609 exceeds the limit of 8388608 bytes"
    );
    let pairs = cat(&[&[11], &1i64.to_le_bytes(), &s(b"/a"), &le64(u64::MAX)]);
    assert_eq!(
        decode_request(&pairs, &Limits::default()).unwrap_err(),
        DecodeError::LengthOverLimit {
            query: QueryType::MultiSet,
            field: Field::Value,
            claimed: u64::MAX,
            limit: 8 * 1024 * 1024
        }
    );
}

#[test]
fn lengths_at_the_limit_are_accepted() {
    let limits = Limits::default();
    let key = vec![b'k'; 8192];
    let frame = cat(&[&[3], &s(&key)]);
    assert_eq!(
        decode_request(&frame[..9], &limits),
        Ok(Decoded::Partial(8192))
    );
    assert_eq!(
        decode_request(&frame, &limits),
        Ok(Decoded::Complete(Request::Get { key: &key }, frame.len()))
    );
    let longer = cat(&[&[3], &le64(8193)]);
    assert!(decode_request(&longer, &limits).is_err());
    let relaxed = limits.with_max_key_len(8193);
    assert_eq!(
        decode_request(&longer, &relaxed),
        Ok(Decoded::Partial(8193))
    );
}

#[test]
fn key_counts_are_checked_before_any_key_arrives() {
    let limits = Limits::default();
    for query in [5u8, 6, 10] {
        let frame = cat(&[&[query], &le64(128 * 1024 + 1)]);
        let error = decode_request(&frame, &limits).unwrap_err();
        assert!(matches!(
            error,
            DecodeError::CountOverLimit {
                field: Field::KeyCount,
                claimed: 131_073,
                limit: 131_072,
                ..
            }
        ));
    }
    let frame = cat(&[&[5], &le64(200_000)]);
    assert_eq!(
        decode_request(&frame, &limits).unwrap_err().to_string(),
        "CHECK key count 200000 exceeds the limit of 131072"
    );
    let at_limit = cat(&[&[5], &le64(128 * 1024)]);
    assert_eq!(
        decode_request(&at_limit, &limits),
        Ok(Decoded::Partial(128 * 1024 * 8))
    );
    let multi = cat(&[&[11], &(128 * 1024 + 1i64).to_le_bytes()]);
    assert!(matches!(
        decode_request(&multi, &limits),
        Err(DecodeError::CountOverLimit {
            query: QueryType::MultiSet,
            field: Field::PairCount,
            ..
        })
    ));
}

#[test]
fn keys_inside_lists_are_limited() {
    let frame = cat(&[&[6], &le64(2), &s(b"/a"), &le64(9000)]);
    assert_eq!(
        decode_request(&frame, &Limits::default()).unwrap_err(),
        DecodeError::LengthOverLimit {
            query: QueryType::Wait,
            field: Field::Key,
            claimed: 9000,
            limit: 8192
        }
    );
}

#[test]
fn negative_multi_set_count_is_an_error() {
    let frame = cat(&[&[11], &(-1i64).to_le_bytes()]);
    let error = decode_request(&frame, &Limits::default()).unwrap_err();
    assert_eq!(
        error,
        DecodeError::NegativeCount {
            query: QueryType::MultiSet,
            field: Field::PairCount,
            claimed: -1
        }
    );
    assert_eq!(error.to_string(), "MULTI_SET pair count -1 is negative");
}

#[test]
fn unknown_query_bytes_fail_on_the_first_byte() {
    for byte in (19..=255u8).filter(|&byte| byte != QueryType::Stats.as_u8()) {
        let error = decode_request(&[byte], &Limits::default()).unwrap_err();
        assert_eq!(error, DecodeError::UnknownQuery { byte });
        assert_eq!(error.query(), None);
        assert_eq!(peek_query_type(&[byte, 0, 0]), Err(error));
    }
    assert_eq!(
        DecodeError::UnknownQuery { byte: 0x13 }.to_string(),
        "invalid command: query type byte 19 (0x13) is not a TCPStore query"
    );
}

#[test]
fn peek_reports_the_query_before_the_body() {
    assert_eq!(peek_query_type(b""), Ok(None));
    assert_eq!(peek_query_type(b"\x01"), Ok(Some(QueryType::Set)));
    assert_eq!(peek_query_type(b"\x00\xce"), Ok(Some(QueryType::Validate)));
    // An HTTP probe ("GET /") is not a TCPStore frame: 'G' is 0x47.
    assert_eq!(
        peek_query_type(b"GET / HTTP/1.1"),
        Err(DecodeError::UnknownQuery { byte: b'G' })
    );
}

#[test]
fn unlimited_limits_wait_instead_of_failing() {
    let frame = cat(&[&[3], &le64(1 << 40)]);
    assert_eq!(
        decode_request(&frame, &Limits::UNLIMITED),
        Ok(Decoded::Partial(1 << 40))
    );
}

// ---------------------------------------------------------------------------------------
// The resuming decoder.

#[test]
fn resuming_decoder_matches_stateless_byte_by_byte() {
    let keys: Vec<Vec<u8>> = (0..300u32)
        .map(|i| std::format!("/key/{i}").into_bytes())
        .collect();
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    let frame = cat(&[&[6], &le64(keys.len() as u64), &keys_encoded(&refs)]);
    let limits = Limits::default();
    let mut decoder = RequestDecoder::new(limits);
    for cut in 0..frame.len() {
        let got = decoder.decode(&frame[..cut]);
        assert_eq!(got, decode_request(&frame[..cut], &limits), "cut {cut}");
    }
    let Ok(Decoded::Complete(Request::Wait { keys: list }, consumed)) = decoder.decode(&frame)
    else {
        panic!("WAIT did not decode");
    };
    assert_eq!(consumed, frame.len());
    assert_eq!(list.iter().collect::<Vec<_>>(), refs);
}

#[test]
fn resuming_decoder_recovers_when_the_buffer_changes() {
    let limits = Limits::default();
    let check = cat(&[&[5], &le64(3), &keys_encoded(&[b"/a", b"/b", b"/c"])]);
    let wait = cat(&[&[6], &le64(3), &keys_encoded(&[b"/x", b"/y", b"/z"])]);
    let mut decoder = RequestDecoder::new(limits);
    assert!(matches!(
        decoder.decode(&check[..25]),
        Ok(Decoded::Partial(_))
    ));
    // A different query with the same count: the saved progress must not apply.
    assert_eq!(decoder.decode(&wait), decode_request(&wait, &limits));
    // A shorter buffer than the saved progress: start over rather than index past it.
    assert!(matches!(
        decoder.decode(&check[..30]),
        Ok(Decoded::Partial(_))
    ));
    assert!(matches!(
        decoder.decode(&check[..12]),
        Ok(Decoded::Partial(_))
    ));
    assert_eq!(decoder.decode(&check), decode_request(&check, &limits));
    decoder.reset();
    assert_eq!(decoder.decode(&check), decode_request(&check, &limits));
    assert_eq!(decoder.limits(), &limits);
}

#[test]
fn resuming_decoder_forgets_progress_after_an_error() {
    let limits = Limits::default().with_max_key_len(4);
    let mut decoder = RequestDecoder::new(limits);
    let bad = cat(&[&[10], &le64(2), &s(b"/a"), &le64(99)]);
    assert!(decoder.decode(&bad[..20]).is_ok());
    assert!(decoder.decode(&bad).is_err());
    let good = cat(&[&[10], &le64(1), &s(b"/a")]);
    assert!(decoder.decode(&good).unwrap().is_complete());
}

// ---------------------------------------------------------------------------------------
// Replies.

fn pending(query: QueryType) -> PendingReply {
    PendingReply::new(query, 0).expect("query has a reply")
}

/// `(reply, bytes, expected view)` for every reply shape.
fn golden_responses() -> Vec<(PendingReply, Vec<u8>, ResponseView<'static>)> {
    fn leak(bytes: Vec<u8>) -> &'static [u8] {
        Vec::leak(bytes)
    }
    let two_values = leak(keys_encoded(&[b"1", b""]));
    let listed = leak(keys_encoded(&[b"/a", b"init/"]));
    vec![
        (
            pending(QueryType::Ping),
            hex("78 56 34 12"),
            ResponseView::Pong(0x1234_5678),
        ),
        (
            pending(QueryType::Get),
            cat(&[&le64(2), b"v1"]),
            ResponseView::Value(b"v1"),
        ),
        (
            pending(QueryType::Get),
            le64(0).to_vec(),
            ResponseView::Value(b""),
        ),
        (
            pending(QueryType::CompareSet),
            s(b"new"),
            ResponseView::Value(b"new"),
        ),
        (
            pending(QueryType::Add),
            hex("06 00 00 00 00 00 00 00"),
            ResponseView::Int(6),
        ),
        (
            pending(QueryType::GetNumKeys),
            (-2i64).to_le_bytes().to_vec(),
            ResponseView::Int(-2),
        ),
        (
            pending(QueryType::DeleteKey),
            1i64.to_le_bytes().to_vec(),
            ResponseView::Int(1),
        ),
        (
            pending(QueryType::QueueLen),
            0i64.to_le_bytes().to_vec(),
            ResponseView::Int(0),
        ),
        (
            pending(QueryType::Check),
            vec![0],
            ResponseView::Check(CheckResponse::Ready),
        ),
        (
            pending(QueryType::Check),
            vec![1],
            ResponseView::Check(CheckResponse::NotReady),
        ),
        (
            pending(QueryType::Wait),
            vec![0],
            ResponseView::Wait(WaitResponse::StopWaiting),
        ),
        (
            pending(QueryType::Barrier),
            vec![0],
            ResponseView::Wait(WaitResponse::StopWaiting),
        ),
        (
            pending(QueryType::CancelWait),
            vec![1],
            ResponseView::Wait(WaitResponse::WaitCanceled),
        ),
        (
            PendingReply::new(QueryType::MultiGet, 2).unwrap(),
            two_values.to_vec(),
            ResponseView::Values(KeyList::new(2, two_values).unwrap()),
        ),
        (
            PendingReply::new(QueryType::MultiGet, 0).unwrap(),
            Vec::new(),
            ResponseView::Values(KeyList::new(0, b"").unwrap()),
        ),
        (
            pending(QueryType::QueuePop),
            cat(&[&2i64.to_le_bytes(), &s(b"e")]),
            ResponseView::QueuePop {
                len_before: 2,
                value: Some(b"e"),
            },
        ),
        (
            pending(QueryType::QueuePop),
            0i64.to_le_bytes().to_vec(),
            ResponseView::QueuePop {
                len_before: 0,
                value: None,
            },
        ),
        (
            pending(QueryType::ListKeys),
            cat(&[&2i64.to_le_bytes(), listed]),
            ResponseView::Keys(KeyList::new(2, listed).unwrap()),
        ),
        (
            pending(QueryType::ListKeys),
            0i64.to_le_bytes().to_vec(),
            ResponseView::Keys(KeyList::new(0, b"").unwrap()),
        ),
    ]
}

#[test]
fn queries_without_replies_have_no_pending_reply() {
    for query in QueryType::ALL {
        let silent = matches!(
            query,
            QueryType::Validate
                | QueryType::Set
                | QueryType::Append
                | QueryType::MultiSet
                | QueryType::QueuePush
        );
        assert_eq!(PendingReply::new(query, 3).is_none(), silent, "{query:?}");
    }
    let keys = keys_encoded(&[b"/a", b"/b", b"/c"]);
    let request = Request::MultiGet {
        keys: KeyList::new(3, &keys).unwrap(),
    };
    assert_eq!(
        PendingReply::for_request(&request),
        PendingReply::new(QueryType::MultiGet, 3)
    );
    assert_eq!(
        PendingReply::for_request(&Request::Set {
            key: b"k",
            value: b"v"
        }),
        None
    );
}

#[test]
fn golden_responses_decode_and_encode() {
    let limits = Limits::default();
    for (pending, frame, expected) in golden_responses() {
        let what = pending.query().name();
        assert_eq!(
            decode_response_view(pending, &frame, &limits),
            Ok(Decoded::Complete(expected, frame.len())),
            "{what}"
        );
        assert_eq!(expected.encoded_len(), frame.len());
        let mut out = Vec::new();
        expected.encode_into(&mut out).unwrap();
        assert_eq!(out, frame, "{what}");

        let response = expected.to_response();
        assert_eq!(
            decode_response(pending, &frame, &limits),
            Ok(Decoded::Complete(response.clone(), frame.len()))
        );
        let mut out = Vec::new();
        response.encode_into(&mut out).unwrap();
        assert_eq!(out, frame, "{what}");
        let mut buf = vec![0u8; frame.len()];
        assert_eq!(response.encode(&mut buf), Ok(frame.len()));
        assert_eq!(buf, frame);
        if let Some(short) = frame.len().checked_sub(1) {
            assert_eq!(
                response.encode(&mut buf[..short]),
                Err(EncodeError::InsufficientSize {
                    needed: frame.len()
                })
            );
        }

        // Trailing bytes (the next reply) are not consumed.
        let mut stream = frame.clone();
        stream.extend_from_slice(&[9, 9, 9]);
        assert_eq!(
            decode_response_view(pending, &stream, &limits),
            Ok(Decoded::Complete(expected, frame.len()))
        );
    }
}

#[test]
fn responses_convert_to_the_alloc_types() {
    let two = keys_encoded(&[b"1", b""]);
    let view = ResponseView::Values(KeyList::new(2, &two).unwrap());
    assert_eq!(
        Response::from(view),
        Response::Values(vec![&b"1"[..], &b""[..]])
    );
    let keys = keys_encoded(&[b"/a"]);
    assert_eq!(
        ResponseView::Keys(KeyList::new(1, &keys).unwrap()).to_response(),
        Response::Keys(vec![&b"/a"[..]])
    );
}

#[test]
fn every_response_split_point_is_partial_until_the_end() {
    let limits = Limits::default();
    for (pending, frame, expected) in golden_responses() {
        let mut decoder = ResponseDecoder::new(pending, limits);
        assert_eq!(decoder.pending(), pending);
        for cut in 0..frame.len() {
            let stateless = decode_response_view(pending, &frame[..cut], &limits);
            let Ok(Decoded::Partial(needed)) = stateless else {
                panic!("{} cut at {cut}: {stateless:?}", pending.query().name());
            };
            assert!(needed >= 1 && cut + needed <= frame.len());
            assert_eq!(decoder.decode(&frame[..cut]), stateless);
        }
        assert_eq!(
            decoder.decode_response(&frame),
            Ok(Decoded::Complete(expected.to_response(), frame.len()))
        );
    }
}

#[test]
fn hostile_reply_lengths_are_rejected_before_waiting() {
    let limits = Limits::default();
    // pytorch/pytorch#129367: a 1.3 TB length in a GET reply.
    let frame = le64(1_300_000_000_000);
    assert_eq!(
        decode_response_view(pending(QueryType::Get), &frame, &limits).unwrap_err(),
        DecodeError::LengthOverLimit {
            query: QueryType::Get,
            field: Field::ReplyValue,
            claimed: 1_300_000_000_000,
            limit: 8 * 1024 * 1024
        }
    );
    let list = cat(&[&(1i64 << 40).to_le_bytes()]);
    assert_eq!(
        decode_response_view(pending(QueryType::ListKeys), &list, &limits)
            .unwrap_err()
            .to_string(),
        "LIST_KEYS reply key count 1099511627776 exceeds the limit of 16777216"
    );
    let negative = (-5i64).to_le_bytes();
    assert_eq!(
        decode_response_view(pending(QueryType::ListKeys), &negative, &limits).unwrap_err(),
        DecodeError::NegativeCount {
            query: QueryType::ListKeys,
            field: Field::ReplyKeyCount,
            claimed: -5
        }
    );
    let long_key = cat(&[&1i64.to_le_bytes(), &le64(10_000)]);
    assert!(matches!(
        decode_response_view(pending(QueryType::ListKeys), &long_key, &limits),
        Err(DecodeError::LengthOverLimit {
            field: Field::ReplyKey,
            ..
        })
    ));
    let pop = cat(&[&3i64.to_le_bytes(), &le64(u64::MAX)]);
    assert!(decode_response_view(pending(QueryType::QueuePop), &pop, &limits).is_err());
    let multi = cat(&[&s(b"ok"), &le64(9 << 20)]);
    assert!(matches!(
        decode_response_view(
            PendingReply::new(QueryType::MultiGet, 2).unwrap(),
            &multi,
            &limits
        ),
        Err(DecodeError::LengthOverLimit {
            query: QueryType::MultiGet,
            field: Field::ReplyValue,
            ..
        })
    ));
}

#[test]
fn one_byte_replies_reject_unknown_values() {
    let limits = Limits::default();
    let error = decode_response_view(pending(QueryType::Check), &[7], &limits).unwrap_err();
    assert_eq!(
        error.to_string(),
        "CHECK reply byte 7 is neither READY (0) nor NOT_READY (1)"
    );
    let error = decode_response_view(pending(QueryType::Wait), &[2], &limits).unwrap_err();
    assert_eq!(
        error.to_string(),
        "WAIT reply byte 2 is neither STOP_WAITING (0) nor WAIT_CANCELED (1)"
    );
}

#[test]
fn cancel_wait_race_decodes_byte_by_byte() {
    // PyTorch `doWait`: after a timeout the client sends CANCEL_WAIT and may read a late
    // STOP_WAITING before the WAIT_CANCELED.
    let limits = Limits::default();
    let stream = [0u8, 1];
    let reply = pending(QueryType::CancelWait);
    let Ok(Decoded::Complete(first, 1)) = decode_response_view(reply, &stream, &limits) else {
        panic!("no first byte");
    };
    assert_eq!(first, ResponseView::Wait(WaitResponse::StopWaiting));
    assert_eq!(
        decode_response_view(reply, &stream[1..], &limits),
        Ok(Decoded::Complete(
            ResponseView::Wait(WaitResponse::WaitCanceled),
            1
        ))
    );
}

#[test]
fn queue_pop_replies_must_be_consistent() {
    let mut out = Vec::new();
    let missing = Response::QueuePop {
        len_before: 2,
        value: None,
    };
    assert_eq!(
        missing.encode_into(&mut out),
        Err(EncodeError::QueuePopMismatch {
            len_before: 2,
            has_value: false
        })
    );
    let extra = ResponseView::QueuePop {
        len_before: 0,
        value: Some(b"x"),
    };
    assert_eq!(
        extra.encode(&mut [0u8; 64]),
        Err(EncodeError::QueuePopMismatch {
            len_before: 0,
            has_value: true
        })
    );
    assert!(out.is_empty());
    assert_eq!(
        missing.encode(&mut [0u8; 64]).unwrap_err().to_string(),
        "QUEUE_POP reply with length 2 must carry a value"
    );
    // A negative length (no server sends one) round-trips without a value.
    let odd = (-1i64).to_le_bytes();
    assert_eq!(
        decode_response_view(pending(QueryType::QueuePop), &odd, &Limits::default()),
        Ok(Decoded::Complete(
            ResponseView::QueuePop {
                len_before: -1,
                value: None
            },
            8
        ))
    );
}

#[test]
fn insufficient_size_message_says_how_much() {
    assert_eq!(
        Request::Ping { nonce: 1 }
            .encode(&mut [0u8; 2])
            .unwrap_err()
            .to_string(),
        "insufficient size, need 5 bytes"
    );
}

// ---------------------------------------------------------------------------------------
// Property tests against an independent model.

/// An owned request, encoded by hand below.
#[derive(Debug, Clone)]
enum Model {
    Validate(u32),
    Set(Vec<u8>, Vec<u8>),
    CompareSet(Vec<u8>, Vec<u8>, Vec<u8>),
    Get(Vec<u8>),
    Add(Vec<u8>, i64),
    Check(Vec<Vec<u8>>),
    Wait(Vec<Vec<u8>>),
    GetNumKeys,
    DeleteKey(Vec<u8>),
    Append(Vec<u8>, Vec<u8>),
    MultiGet(Vec<Vec<u8>>),
    MultiSet(Vec<(Vec<u8>, Vec<u8>)>),
    CancelWait,
    Ping(u32),
    QueuePush(Vec<u8>, Vec<u8>),
    QueuePop(Vec<u8>),
    QueueLen(Vec<u8>),
    ListKeys,
    Stats,
    Barrier(Vec<u8>, i64),
}

impl Model {
    fn frame(&self) -> Vec<u8> {
        let ks = |keys: &[Vec<u8>]| -> Vec<u8> {
            let mut out = le64(keys.len() as u64).to_vec();
            for k in keys {
                out.extend(s(k));
            }
            out
        };
        match self {
            Model::Validate(m) => cat(&[&[0], &m.to_le_bytes()]),
            Model::Set(k, v) => cat(&[&[1], &s(k), &s(v)]),
            Model::CompareSet(k, e, d) => cat(&[&[2], &s(k), &s(e), &s(d)]),
            Model::Get(k) => cat(&[&[3], &s(k)]),
            Model::Add(k, d) => cat(&[&[4], &s(k), &d.to_le_bytes()]),
            Model::Check(keys) => cat(&[&[5], &ks(keys)]),
            Model::Wait(keys) => cat(&[&[6], &ks(keys)]),
            Model::GetNumKeys => vec![7],
            Model::DeleteKey(k) => cat(&[&[8], &s(k)]),
            Model::Append(k, v) => cat(&[&[9], &s(k), &s(v)]),
            Model::MultiGet(keys) => cat(&[&[10], &ks(keys)]),
            Model::MultiSet(pairs) => {
                let mut out = cat(&[&[11], &(pairs.len() as i64).to_le_bytes()]);
                for (k, v) in pairs {
                    out.extend(s(k));
                    out.extend(s(v));
                }
                out
            }
            Model::CancelWait => vec![12],
            Model::Ping(n) => cat(&[&[13], &n.to_le_bytes()]),
            Model::QueuePush(k, v) => cat(&[&[14], &s(k), &s(v)]),
            Model::QueuePop(k) => cat(&[&[15], &s(k)]),
            Model::QueueLen(k) => cat(&[&[16], &s(k)]),
            Model::ListKeys => vec![17],
            Model::Stats => vec![0x52],
            Model::Barrier(k, w) => cat(&[&[18], &s(k), &w.to_le_bytes()]),
        }
    }

    fn of(request: &Request<'_>) -> Model {
        let v = |b: &[u8]| b.to_vec();
        let list = |keys: &KeyList<'_>| keys.iter().map(v).collect::<Vec<_>>();
        match *request {
            Request::Validate { magic } => Model::Validate(magic),
            Request::Set { key, value } => Model::Set(v(key), v(value)),
            Request::CompareSet {
                key,
                expected,
                desired,
            } => Model::CompareSet(v(key), v(expected), v(desired)),
            Request::Get { key } => Model::Get(v(key)),
            Request::Add { key, delta } => Model::Add(v(key), delta),
            Request::Check { ref keys } => Model::Check(list(keys)),
            Request::Wait { ref keys } => Model::Wait(list(keys)),
            Request::GetNumKeys => Model::GetNumKeys,
            Request::DeleteKey { key } => Model::DeleteKey(v(key)),
            Request::Append { key, value } => Model::Append(v(key), v(value)),
            Request::MultiGet { ref keys } => Model::MultiGet(list(keys)),
            Request::MultiSet { pairs } => {
                Model::MultiSet(pairs.iter().map(|(k, x)| (v(k), v(x))).collect())
            }
            Request::CancelWait => Model::CancelWait,
            Request::Ping { nonce } => Model::Ping(nonce),
            Request::QueuePush { key, value } => Model::QueuePush(v(key), v(value)),
            Request::QueuePop { key } => Model::QueuePop(v(key)),
            Request::QueueLen { key } => Model::QueueLen(v(key)),
            Request::ListKeys => Model::ListKeys,
            Request::Stats => Model::Stats,
            Request::Barrier { key, world_size } => Model::Barrier(v(key), world_size),
        }
    }
}

impl PartialEq for Model {
    fn eq(&self, other: &Model) -> bool {
        self.frame() == other.frame()
    }
}

fn bytes() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..12)
}

fn keys() -> impl Strategy<Value = Vec<Vec<u8>>> {
    proptest::collection::vec(bytes(), 0..5)
}

fn model() -> impl Strategy<Value = Model> {
    prop_oneof![
        any::<u32>().prop_map(Model::Validate),
        (bytes(), bytes()).prop_map(|(k, v)| Model::Set(k, v)),
        (bytes(), bytes(), bytes()).prop_map(|(k, e, d)| Model::CompareSet(k, e, d)),
        bytes().prop_map(Model::Get),
        (bytes(), any::<i64>()).prop_map(|(k, d)| Model::Add(k, d)),
        keys().prop_map(Model::Check),
        keys().prop_map(Model::Wait),
        Just(Model::GetNumKeys),
        bytes().prop_map(Model::DeleteKey),
        (bytes(), bytes()).prop_map(|(k, v)| Model::Append(k, v)),
        keys().prop_map(Model::MultiGet),
        proptest::collection::vec((bytes(), bytes()), 0..4).prop_map(Model::MultiSet),
        Just(Model::CancelWait),
        any::<u32>().prop_map(Model::Ping),
        (bytes(), bytes()).prop_map(|(k, v)| Model::QueuePush(k, v)),
        bytes().prop_map(Model::QueuePop),
        bytes().prop_map(Model::QueueLen),
        Just(Model::ListKeys),
        Just(Model::Stats),
        (bytes(), any::<i64>()).prop_map(|(k, w)| Model::Barrier(k, w)),
    ]
}

/// An owned reply with the query it answers.
#[derive(Debug, Clone)]
enum ReplyModel {
    Pong(u32),
    Value(Vec<u8>),
    Int(i64),
    Check(bool),
    Wait(bool),
    Values(Vec<Vec<u8>>),
    QueuePop(i64, Vec<u8>),
    Keys(Vec<Vec<u8>>),
}

impl ReplyModel {
    fn pending(&self) -> PendingReply {
        match self {
            ReplyModel::Pong(_) => pending(QueryType::Ping),
            ReplyModel::Value(_) => pending(QueryType::Get),
            ReplyModel::Int(_) => pending(QueryType::Add),
            ReplyModel::Check(_) => pending(QueryType::Check),
            ReplyModel::Wait(_) => pending(QueryType::Wait),
            ReplyModel::Values(values) => {
                PendingReply::new(QueryType::MultiGet, values.len()).unwrap()
            }
            ReplyModel::QueuePop(..) => pending(QueryType::QueuePop),
            ReplyModel::Keys(_) => pending(QueryType::ListKeys),
        }
    }

    fn frame(&self) -> Vec<u8> {
        match self {
            ReplyModel::Pong(n) => n.to_le_bytes().to_vec(),
            ReplyModel::Value(v) => s(v),
            ReplyModel::Int(n) => n.to_le_bytes().to_vec(),
            ReplyModel::Check(ready) => vec![u8::from(!ready)],
            ReplyModel::Wait(canceled) => vec![u8::from(*canceled)],
            ReplyModel::Values(values) => values.iter().flat_map(|v| s(v)).collect(),
            ReplyModel::QueuePop(len, v) if *len > 0 => cat(&[&len.to_le_bytes(), &s(v)]),
            ReplyModel::QueuePop(len, _) => len.to_le_bytes().to_vec(),
            ReplyModel::Keys(keys) => {
                let mut out = (keys.len() as i64).to_le_bytes().to_vec();
                out.extend(keys.iter().flat_map(|k| s(k)));
                out
            }
        }
    }
}

fn reply_model() -> impl Strategy<Value = ReplyModel> {
    prop_oneof![
        any::<u32>().prop_map(ReplyModel::Pong),
        bytes().prop_map(ReplyModel::Value),
        any::<i64>().prop_map(ReplyModel::Int),
        any::<bool>().prop_map(ReplyModel::Check),
        any::<bool>().prop_map(ReplyModel::Wait),
        keys().prop_map(ReplyModel::Values),
        (-3i64..4, bytes()).prop_map(|(n, v)| ReplyModel::QueuePop(n, v)),
        keys().prop_map(ReplyModel::Keys),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn requests_round_trip(model in model(), tail in bytes()) {
        let frame = model.frame();
        let mut stream = frame.clone();
        stream.extend_from_slice(&tail);
        let decoded = decode_request(&stream, &Limits::default());
        let Ok(Decoded::Complete(request, consumed)) = decoded else {
            panic!("{model:?} gave {decoded:?}");
        };
        prop_assert_eq!(consumed, frame.len());
        prop_assert_eq!(Model::of(&request), model);
        let mut out = Vec::new();
        request.encode_into(&mut out);
        prop_assert_eq!(&out, &frame);
        prop_assert_eq!(request.encoded_len(), frame.len());
        let mut buf = vec![0u8; frame.len()];
        prop_assert_eq!(request.encode(&mut buf), Ok(frame.len()));
        prop_assert_eq!(buf, frame);
    }

    /// A client's check before sending agrees with the server's decoder: the same
    /// verdict, the same error, under small random limits.
    #[test]
    fn check_limits_agrees_with_the_decoder(
        model in model(),
        key_len in 0u64..8,
        value_len in 0u64..8,
        key_count in 0u64..4,
    ) {
        let limits = Limits::UNLIMITED
            .with_max_key_len(key_len)
            .with_max_value_len(value_len)
            .with_max_key_count(key_count);
        let frame = model.frame();
        let Ok(Decoded::Complete(request, _)) = decode_request(&frame, &Limits::UNLIMITED) else {
            panic!("{model:?} does not decode");
        };
        let decoded = decode_request(&frame, &limits).map(|_| ());
        prop_assert_eq!(request.check_limits(&limits), decoded);
    }

    #[test]
    fn requests_survive_any_chunking(
        model in model(),
        chunks in proptest::collection::vec(1usize..7, 0..40),
    ) {
        let frame = model.frame();
        let limits = Limits::default();
        let mut decoder = RequestDecoder::new(limits);
        let mut have = 0;
        for step in chunks {
            have = (have + step).min(frame.len());
            let got = decoder.decode(&frame[..have]);
            prop_assert_eq!(got, decode_request(&frame[..have], &limits));
            if have == frame.len() {
                break;
            }
            let Ok(Decoded::Partial(needed)) = got else {
                panic!("prefix {have} of {model:?} gave {got:?}");
            };
            prop_assert!(have + needed <= frame.len());
        }
        decoder.reset();
        prop_assert_eq!(
            decoder.decode(&frame).map(|d| d.map(|r| Model::of(&r))),
            Ok(Decoded::Complete(model, frame.len()))
        );
    }

    #[test]
    fn concatenated_requests_decode_in_order(models in proptest::collection::vec(model(), 0..8)) {
        let frames: Vec<Vec<u8>> = models.iter().map(Model::frame).collect();
        let stream = frames.concat();
        let mut decoder = RequestDecoder::default();
        let mut at = 0;
        for (model, frame) in models.iter().zip(&frames) {
            let decoded = decoder.decode(&stream[at..]);
            let Ok(Decoded::Complete(request, consumed)) = decoded else {
                panic!("{model:?} at {at} gave {decoded:?}");
            };
            prop_assert_eq!(consumed, frame.len());
            prop_assert_eq!(&Model::of(&request), model);
            at += consumed;
        }
        prop_assert_eq!(at, stream.len());
    }

    #[test]
    fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..64)) {
        crate::fuzzing::codec_request(&data);
        crate::fuzzing::codec_response(&data);
        // Biased towards valid query bytes, small lengths and counts.
        let mut biased = data.clone();
        if let Some(first) = biased.first_mut() {
            *first %= 19;
        }
        for byte in biased.iter_mut().skip(1).step_by(3) {
            *byte %= 4;
        }
        crate::fuzzing::codec_request(&biased);
        crate::fuzzing::codec_response(&biased);
    }

    #[test]
    fn replies_round_trip(model in reply_model(), tail in bytes()) {
        let frame = model.frame();
        let pending = model.pending();
        let mut stream = frame.clone();
        stream.extend_from_slice(&tail);
        let decoded = decode_response_view(pending, &stream, &Limits::default());
        let Ok(Decoded::Complete(view, consumed)) = decoded else {
            panic!("{model:?} gave {decoded:?}");
        };
        prop_assert_eq!(consumed, frame.len());
        let mut out = Vec::new();
        view.encode_into(&mut out).unwrap();
        prop_assert_eq!(&out, &frame);
        let mut out = Vec::new();
        view.to_response().encode_into(&mut out).unwrap();
        prop_assert_eq!(&out, &frame);

        let mut decoder = ResponseDecoder::new(pending, Limits::default());
        for cut in 0..frame.len() {
            let got = decoder.decode(&frame[..cut]);
            prop_assert_eq!(got, decode_response_view(pending, &frame[..cut], &Limits::default()));
            prop_assert!(matches!(got, Ok(Decoded::Partial(n)) if cut + n <= frame.len()));
        }
        prop_assert_eq!(decoder.decode(&frame), Ok(Decoded::Complete(view, consumed)));
    }
}

#[test]
fn pair_list_views_are_zero_copy() {
    let pairs = pairs_encoded(&[(b"/a", b"1")]);
    let frame = cat(&[&[11], &1i64.to_le_bytes(), &pairs]);
    let Ok(Decoded::Complete(Request::MultiSet { pairs: list }, _)) =
        decode_request(&frame, &Limits::default())
    else {
        panic!("MULTI_SET did not decode");
    };
    assert_eq!(list, PairList::new(1, &frame[9..]).unwrap());
    assert!(std::ptr::eq(list.encoded(), &frame[9..]));
}

// ---------------------------------------------------------------------------------------
// rdzv's STATS extension.

/// A STATS reply carrying `count` counters numbered 100, 101, ...
fn stats_reply(count: u64) -> Vec<u8> {
    let mut out = le64(count).to_vec();
    for i in 0..count {
        out.extend_from_slice(&le64(100 + i));
    }
    out
}

#[test]
fn stats_request_is_one_byte_outside_pytorchs_range() {
    let frame = hex("52");
    assert_eq!(
        decode_request(&frame, &Limits::default()),
        Ok(Decoded::Complete(Request::Stats, 1))
    );
    assert_eq!(Request::Stats.encoded_len(), 1);
    let mut out = [0u8; 1];
    assert_eq!(Request::Stats.encode(&mut out), Ok(1));
    assert_eq!(out, [0x52]);
    assert_eq!(peek_query_type(&frame), Ok(Some(QueryType::Stats)));
    assert!(QueryType::Stats.as_u8() > 18, "outside PyTorch's 0..=18");
}

#[test]
fn stats_reply_round_trips_and_waits_for_every_byte() {
    use crate::store::message::StoreStats;
    let pending = pending(QueryType::Stats);
    let limits = Limits::default();
    let bytes = stats_reply(StoreStats::COUNTERS as u64);
    let Ok(Decoded::Complete(ResponseView::Stats(stats), used)) =
        decode_response_view(pending, &bytes, &limits)
    else {
        panic!("a whole STATS reply must decode");
    };
    assert_eq!(used, bytes.len());
    assert_eq!(stats.connections, 100);
    assert_eq!(stats.uptime_ms, 106);
    assert_eq!(stats.requests_of(QueryType::Validate), 107);
    assert_eq!(stats.requests_of(QueryType::Stats), 126);
    // Canonical: encoding the decoded reply gives back the bytes.
    let mut out = Vec::new();
    Response::Stats(Box::new(stats))
        .encode_into(&mut out)
        .unwrap();
    assert_eq!(out, bytes);
    // Every strict prefix is partial, with an exact hint once the count is in.
    for cut in 0..bytes.len() {
        match decode_response_view(pending, &bytes[..cut], &limits) {
            Ok(Decoded::Partial(needed)) => {
                assert!(needed >= 1);
                if cut >= 8 {
                    assert_eq!(needed, bytes.len() - cut, "hint at {cut}");
                }
            }
            other => panic!("prefix of {cut} bytes gave {other:?}"),
        }
    }
    // The resuming decoder agrees, fed in two pieces.
    let mut decoder = ResponseDecoder::new(pending, limits);
    assert!(matches!(
        decoder.decode(&bytes[..13]),
        Ok(Decoded::Partial(_))
    ));
    assert_eq!(
        decoder.decode(&bytes),
        Ok(Decoded::Complete(ResponseView::Stats(stats), bytes.len()))
    );
}

#[test]
fn stats_reply_tolerates_more_or_fewer_counters_and_refuses_a_huge_count() {
    use crate::store::message::StoreStats;
    let pending = pending(QueryType::Stats);
    let limits = Limits::default();
    // A newer server's extra counters are consumed and ignored.
    let longer = stats_reply(StoreStats::COUNTERS as u64 + 3);
    let Ok(Decoded::Complete(ResponseView::Stats(stats), used)) =
        decode_response_view(pending, &longer, &limits)
    else {
        panic!("a longer STATS reply must decode");
    };
    assert_eq!(used, longer.len());
    assert_eq!(stats.keys, 101);
    // An older server's missing counters read as 0.
    let shorter = stats_reply(2);
    let Ok(Decoded::Complete(ResponseView::Stats(stats), 24)) =
        decode_response_view(pending, &shorter, &limits)
    else {
        panic!("a shorter STATS reply must decode");
    };
    assert_eq!(
        (stats.connections, stats.keys, stats.waiters),
        (100, 101, 0)
    );
    // A hostile count is refused from its eight bytes.
    let huge = le64(MAX_STATS_COUNTERS + 1);
    assert_eq!(
        decode_response_view(pending, &huge, &limits),
        Err(DecodeError::CountOverLimit {
            query: QueryType::Stats,
            field: Field::StatsCount,
            claimed: MAX_STATS_COUNTERS + 1,
            limit: MAX_STATS_COUNTERS,
        })
    );
}
