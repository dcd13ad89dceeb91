//! Fuzz checks for [`crate::store::file_log`]: the FileStore log parser, fed arbitrary
//! bytes as a file's contents, and the record encoder, fed records cut from the bytes.
//!
//! For every input: no panic; the whole records and the torn tail cover the input
//! exactly, classified as torn or corrupt consistently; each record re-encodes to exactly the bytes it was read from; a cut of the
//! input parses to a prefix of the records (whole records stay whole); the records cut
//! from the input parse back from their encoding unchanged; and, with `alloc`, a cache
//! fed the input in two pieces (as a file that grew between two reads) ends in the same
//! state as one fed it whole.

use super::split_point;
use crate::store::file_log::{scan_record, Record, Records, Scanned, MIN_RECORD_LEN};

/// Drives the log parser and encoder with `data`.
pub fn file_log(data: &[u8]) {
    let mut records = Records::new(data);
    let mut at = 0usize;
    let mut count = 0usize;
    for record in records.by_ref() {
        let len = record.encoded_len().unwrap_or(usize::MAX);
        let frame = data.get(at..at.saturating_add(len));
        assert!(frame.is_some(), "record runs past the input");
        check_encoding(&record, frame.unwrap_or_default());
        at += len;
        count += 1;
    }
    assert_eq!(records.consumed(), at);
    let tail = records.torn_tail();
    match tail {
        None => assert_eq!(at, data.len()),
        Some(torn) => {
            assert_eq!(at + torn.len, data.len());
            assert!(torn.len >= 1 && torn.claimed > torn.len as u64);
        }
    }
    check_tail(records.remainder(), tail);

    // A cut chosen by the data: a prefix of the records, then at most a torn tail.
    let cut = split_point(data);
    let head = data.get(..cut).unwrap_or(data);
    let mut prefix = Records::new(head);
    let mut whole = Records::new(data);
    let mut kept = 0usize;
    for record in prefix.by_ref() {
        assert_eq!(Some(record), whole.next(), "a cut changed a record");
        kept += 1;
    }
    assert!(kept <= count);
    assert!(prefix.consumed() <= cut);
    assert_eq!(
        prefix.consumed() + prefix.torn_tail().map_or(0, |t| t.len),
        cut
    );

    round_trip(data);

    #[cfg(feature = "alloc")]
    replay_in_pieces(data, cut);
}

/// The torn-or-corrupt classification agrees with the parse: it spans the same bytes,
/// and a corrupt tail names a whole FileStore record inside them.
fn check_tail(rest: &[u8], torn: Option<crate::store::file_log::Torn>) {
    use crate::store::file_log::{classify_tail, is_store_key, Tail};
    let tail = classify_tail(rest);
    assert_eq!(tail.map(|t| t.len()), torn.map(|t| t.len));
    match tail {
        Some(Tail::Corrupt(corrupt)) => {
            assert_eq!(Some(corrupt.bad), torn);
            assert!(corrupt.record_at >= 1);
            match scan_record(rest.get(corrupt.record_at..).unwrap_or_default()) {
                Scanned::Complete(record, _) => assert!(is_store_key(record.key)),
                other => panic!("corruption names no record: {other:?}"),
            }
        }
        Some(Tail::Torn(t)) => assert_eq!(Some(t), torn),
        None => {}
    }
}

/// Encodes into a buffer of exactly the right size (must give `frame`) and one byte short
/// (must say how much it needs).
fn check_encoding(record: &Record<'_>, frame: &[u8]) {
    const STACK: usize = 4096;
    let mut buf = [0u8; STACK];
    let needed = frame.len();
    if let Some(exact) = buf.get_mut(..needed) {
        assert_eq!(record.encode(exact), Ok(needed));
        assert_eq!(exact, frame, "re-encoding is not canonical");
    }
    if let Some(short) = needed.checked_sub(1).and_then(|n| buf.get_mut(..n)) {
        assert_eq!(
            record.encode(short),
            Err(crate::store::file_log::EncodeError::InsufficientSize { needed })
        );
    }
    #[cfg(feature = "alloc")]
    {
        let mut out = alloc::vec::Vec::new();
        assert_eq!(record.encode_into(&mut out), Ok(needed));
        assert_eq!(out, frame, "re-encoding is not canonical");
    }
}

/// Cuts `data` into records (each piece's first byte picks its key and value lengths),
/// encodes each and parses it back.
fn round_trip(data: &[u8]) {
    let mut rest = data;
    let mut buf = [0u8; 512];
    while let Some((&shape, tail)) = rest.split_first() {
        let key_len = usize::from(shape & 0x0F).min(tail.len());
        let (key, tail) = tail.split_at(key_len);
        let value_len = usize::from(shape >> 4).min(tail.len());
        let (value, tail) = tail.split_at(value_len);
        rest = tail;
        let record = Record::new(key, value);
        let Ok(len) = record.encode(&mut buf) else {
            panic!("a small record does not fit 512 bytes");
        };
        assert_eq!(len, MIN_RECORD_LEN + key.len() + value.len());
        let encoded = buf.get(..len).unwrap_or_default();
        assert_eq!(scan_record(encoded), Scanned::Complete(record, len));
        // Every shorter prefix of the encoding is torn, never a record.
        for cut in 0..len {
            let prefix = encoded.get(..cut).unwrap_or_default();
            match scan_record(prefix) {
                Scanned::Incomplete(torn) => assert_eq!(torn.len, cut),
                Scanned::Empty => assert_eq!(cut, 0),
                Scanned::Complete(..) => panic!("a cut record parsed as whole"),
            }
        }
    }
}

#[cfg(feature = "alloc")]
fn replay_in_pieces(data: &[u8], cut: usize) {
    use crate::store::file_log::LogCache;

    let mut whole = LogCache::new();
    if let Some(from) = whole.read_from(data.len() as u64) {
        assert_eq!(from, 0);
        whole.replay(data);
    }
    let mut pieces = LogCache::new();
    for len in [cut, data.len()] {
        if let Some(from) = pieces.read_from(len as u64) {
            let from = usize::try_from(from).unwrap_or(usize::MAX);
            let grown = data.get(from..len);
            assert!(grown.is_some(), "offset past the bytes read");
            pieces.replay(grown.unwrap_or_default());
        }
    }
    assert_eq!(pieces, whole);
    assert_eq!(
        whole.offset() + whole.tail().map_or(0, |t| t.len() as u64),
        data.len() as u64
    );
    assert!(whole.len() <= data.len() / MIN_RECORD_LEN);
}
