//! The decisions every c10d store shares, as pure functions.
//!
//! PyTorch's stores agree on a handful of rules: how `compare_set` resolves its four cases,
//! that counters (`add`, TCPStore's `BARRIER`) are stored as ASCII decimal and re-read with
//! `std::stoll`, which writes wake which waiters, and the key names of `Store::barrier`'s
//! add-then-wait fallback. The TCPStore state machine ([`super::engine`]) and the runtime's
//! FileStore/HashStore call these functions so that each rule is written once. Nothing
//! here owns a map, a waiter or a connection; callers look values up and apply the outcome.

use super::QueryType;
use core::fmt;

/// What a `compare_set(key, expected, desired)` does, given the key's current value.
///
/// PyTorch (`LibUVStoreDaemon::compareAndSet`, `FileStore::compareSet`,
/// `HashStore::compareSet`) resolves four cases:
///
/// | current | `expected` | store | reply |
/// |---|---|---|---|
/// | missing | empty | `desired` | `desired` |
/// | missing | non-empty | unchanged | `expected` (PyTorch's own comment: "we are 'lying' to the caller") |
/// | equal to `expected` | any | `desired` | `desired` |
/// | different | any | unchanged | the current value |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompareSetOutcome<'a> {
    /// Store these bytes (the `desired` value) under the key and reply with them.
    Write(&'a [u8]),
    /// Leave the store unchanged and reply with these bytes.
    Keep(&'a [u8]),
}

impl<'a> CompareSetOutcome<'a> {
    /// The bytes the caller receives.
    pub fn reply(self) -> &'a [u8] {
        match self {
            CompareSetOutcome::Write(bytes) | CompareSetOutcome::Keep(bytes) => bytes,
        }
    }

    /// Whether the store must write the desired value.
    pub fn writes(self) -> bool {
        matches!(self, CompareSetOutcome::Write(_))
    }
}

/// Decides a `compare_set` (see [`CompareSetOutcome`] for the four cases).
pub fn compare_set<'a>(
    current: Option<&'a [u8]>,
    expected: &'a [u8],
    desired: &'a [u8],
) -> CompareSetOutcome<'a> {
    match current {
        None if expected.is_empty() => CompareSetOutcome::Write(desired),
        None => CompareSetOutcome::Keep(expected),
        Some(current) if current == expected => CompareSetOutcome::Write(desired),
        Some(current) => CompareSetOutcome::Keep(current),
    }
}

/// Why a stored counter could not be read or advanced.
///
/// PyTorch's servers call `std::stoll` on the stored bytes; its exceptions close the
/// connection that asked. We report the same failure as a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CounterError {
    /// The stored value does not start (after whitespace and a sign) with a decimal digit:
    /// `std::stoll` throws `std::invalid_argument`.
    NotANumber,
    /// The stored number does not fit in an `i64`: `std::stoll` throws `std::out_of_range`.
    OutOfRange,
    /// The stored number plus the delta does not fit in an `i64`.
    Overflow,
}

impl fmt::Display for CounterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CounterError::NotANumber => {
                "stored value is not a base-10 integer (std::stoll: invalid_argument)"
            }
            CounterError::OutOfRange => {
                "stored value is out of the range of int64 (std::stoll: out_of_range)"
            }
            CounterError::Overflow => "adding the delta overflows int64",
        })
    }
}

/// Whether `byte` is whitespace for C's `isspace` in the "C" locale.
fn is_c_space(byte: u8) -> bool {
    matches!(byte, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

/// Reads a stored counter the way `std::stoll(value)` does (base 10).
///
/// Leading C whitespace is skipped, one optional `+` or `-` is accepted, then at least one
/// ASCII digit must follow; anything after the digits (including a NUL) is ignored.
/// `" 42abc"` is 42, `"-0"` is 0, `"0x10"` is 0, `"abc"`, `""` and `"- 1"` are
/// [`CounterError::NotANumber`], and a number outside `i64` is [`CounterError::OutOfRange`].
pub fn parse_counter(value: &[u8]) -> Result<i64, CounterError> {
    // What rdzv itself stores (`Decimal`): plain digits, at most 18 of them, in one pass.
    if let Some(magnitude) = plain_digits(value) {
        return Ok(magnitude);
    }
    let start = value
        .iter()
        .position(|&b| !is_c_space(b))
        .unwrap_or(value.len());
    let rest = value.get(start..).unwrap_or_default();
    let (negative, digits) = match rest.split_first() {
        Some((b'-', tail)) => (true, tail),
        Some((b'+', tail)) => (false, tail),
        _ => (false, rest),
    };
    let len = digits
        .iter()
        .position(|b| !b.is_ascii_digit())
        .unwrap_or(digits.len());
    let digits = digits.get(..len).unwrap_or_default();
    if digits.is_empty() {
        return Err(CounterError::NotANumber);
    }
    // Up to 18 digits cannot overflow a u64 (nor, with their sign, an i64): the common
    // case takes no checks per digit.
    if digits.len() <= 18 {
        let magnitude = digits
            .iter()
            .fold(0u64, |total, &digit| total * 10 + u64::from(digit - b'0'));
        // Below 10^18, so the cast cannot wrap.
        let magnitude = magnitude as i64;
        return Ok(if negative { -magnitude } else { magnitude });
    }
    // Accumulate towards the sign so that i64::MIN, whose magnitude has no positive i64,
    // parses.
    let mut total: i64 = 0;
    for &digit in digits {
        let digit = i64::from(digit - b'0');
        total = total
            .checked_mul(10)
            .and_then(|t| {
                if negative {
                    t.checked_sub(digit)
                } else {
                    t.checked_add(digit)
                }
            })
            .ok_or(CounterError::OutOfRange)?;
    }
    Ok(total)
}

/// The value of `value` when it is 1 to 18 ASCII digits and nothing else (no sign, no
/// space, no tail), which cannot overflow; `None` for anything else. Up to 16 digits are
/// checked and converted eight at a time ([`eight_digits`]).
#[inline]
fn plain_digits(value: &[u8]) -> Option<i64> {
    let total = match value.len() {
        1..=8 => eight_digits(value)?,
        9..=16 => {
            let (high, low) = value.split_at(value.len() - 8);
            eight_digits(high)? * 100_000_000 + eight_digits(low)?
        }
        17..=18 => {
            let mut total = 0u64;
            for &byte in value {
                let digit = byte.wrapping_sub(b'0');
                if digit > 9 {
                    return None;
                }
                total = total * 10 + u64::from(digit);
            }
            total
        }
        _ => return None,
    };
    // Below 10^18, so the cast cannot wrap.
    Some(total as i64)
}

/// The value of 1 to 8 ASCII digits, all checked and converted at once in one `u64`
/// (the first digit in the lowest byte, padded in front with `'0'`); `None` if any byte
/// is not a digit.
#[inline]
fn eight_digits(digits: &[u8]) -> Option<u64> {
    let n = digits.len();
    let pad_bits = 8 * 8usize.checked_sub(n)?;
    // The digits in the top `n` bytes, without a copy: two overlapping 4-byte reads
    // place the same byte wherever they overlap.
    let word = if n >= 4 {
        let low = u64::from(u32::from_le_bytes(digits.get(..4)?.try_into().ok()?));
        let high = u64::from(u32::from_le_bytes(digits.get(n - 4..)?.try_into().ok()?));
        (high << 32) | (low << pad_bits)
    } else {
        digits.iter().enumerate().fold(0u64, |word, (i, &byte)| {
            word | u64::from(byte) << (pad_bits + 8 * i)
        })
    };
    // '0' in the bytes below them.
    let pad = 0x3030_3030_3030_3030u64
        .checked_shr(64 - pad_bits as u32)
        .unwrap_or(0);
    let d = (word | pad).wrapping_sub(0x3030_3030_3030_3030);
    // A byte below '0' wraps into its top half, one above '9' carries into it with the
    // 6 added; the lowest such byte takes no borrow or carry from below, so it shows.
    if (d | d.wrapping_add(0x0606_0606_0606_0606)) & 0xF0F0_F0F0_F0F0_F0F0 != 0 {
        return None;
    }
    // Pairs, then fours, then eight (each step: 10^k times the higher digits plus the
    // lower ones, in the lane below).
    let d = (d.wrapping_mul(10 << 8 | 1) >> 8) & 0x00FF_00FF_00FF_00FF;
    let d = (d.wrapping_mul(100 << 16 | 1) >> 16) & 0x0000_FFFF_0000_FFFF;
    Some(d.wrapping_mul(10_000 << 32 | 1) >> 32)
}

/// The new value of an `add(key, delta)`: `delta` plus the stored counter, a missing key
/// counting as 0. Store [`Decimal::new`]`(result)` afterwards.
pub fn add_counter(current: Option<&[u8]>, delta: i64) -> Result<i64, CounterError> {
    let base = match current {
        Some(value) => parse_counter(value)?,
        None => 0,
    };
    base.checked_add(delta).ok_or(CounterError::Overflow)
}

/// The arrival number of a TCPStore `BARRIER` on a key holding `current`: the stored
/// counter plus one, a missing key giving 1.
pub fn barrier_count(current: Option<&[u8]>) -> Result<i64, CounterError> {
    add_counter(current, 1)
}

/// Whether the `BARRIER` arrival numbered `count` releases the barrier
/// (`count >= world_size`; a world size of 0 or less releases every arrival).
pub fn barrier_released(count: i64, world_size: i64) -> bool {
    count >= world_size
}

/// "00" to "99", for [`Decimal::new`].
const DIGIT_PAIRS: &[u8; 200] = b"\
    0001020304050607080910111213141516171819\
    2021222324252627282930313233343536373839\
    4041424344454647484950515253545556575859\
    6061626364656667686970717273747576777879\
    8081828384858687888990919293949596979899";

/// An `i64` written as `std::to_string` writes it: ASCII decimal, `-` for negatives, no
/// padding. Lives on the stack (20 bytes covers `i64::MIN`).
#[derive(Clone, Copy)]
pub struct Decimal {
    buf: [u8; 20],
    start: usize,
}

impl Decimal {
    /// Formats `value`.
    pub fn new(value: i64) -> Decimal {
        let mut buf = [0u8; 20];
        let mut start = buf.len();
        let mut magnitude = value.unsigned_abs();
        // Two digits per division (a counter's ADD formats one on every call).
        while magnitude >= 100 {
            // Below 100, so the cast cannot truncate.
            let pair = 2 * (magnitude % 100) as usize;
            magnitude /= 100;
            start -= 2;
            buf[start..start + 2].copy_from_slice(&DIGIT_PAIRS[pair..pair + 2]);
        }
        // Below 100 now.
        let pair = 2 * magnitude as usize;
        if magnitude >= 10 {
            start -= 2;
            buf[start..start + 2].copy_from_slice(&DIGIT_PAIRS[pair..pair + 2]);
        } else {
            start -= 1;
            buf[start] = DIGIT_PAIRS[pair + 1];
        }
        if value < 0 {
            start -= 1;
            buf[start] = b'-';
        }
        Decimal { buf, start }
    }

    /// The ASCII digits.
    pub fn as_bytes(&self) -> &[u8] {
        self.buf.get(self.start..).unwrap_or_default()
    }
}

impl fmt::Debug for Decimal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Decimal({self})")
    }
}

impl fmt::Display for Decimal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Only ASCII digits and '-' are ever written.
        self.as_bytes()
            .iter()
            .try_for_each(|&b| fmt::Write::write_char(f, char::from(b)))
    }
}

/// Whether a key counts as present for `CHECK` and `WAIT`: it is in the key/value map, or
/// a queue of that name holds at least one element (libuv `checkKeys`, `HashStore::check`).
pub fn key_present(in_map: bool, queue_len: usize) -> bool {
    in_map || queue_len > 0
}

/// Whom a write wakes among the waiters on its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// Nobody.
    None,
    /// Every waiter on the key.
    All,
    /// At most one waiter (the first, in registration order, that the write completes).
    One,
}

/// Whom each query wakes on the key it writes (libuv semantics).
///
/// `SET`, `ADD`, `APPEND`, `MULTI_SET` (each key), `COMPARE_SET` (in all four cases, even
/// when it writes nothing) wake all waiters; `QUEUE_PUSH` wakes one; `BARRIER` wakes all,
/// but only on the arrival that releases it ([`barrier_released`]); `DELETE_KEY` and the
/// read-only queries wake nobody.
pub fn wake_policy(query: QueryType) -> Wake {
    match query {
        QueryType::Set
        | QueryType::Add
        | QueryType::Append
        | QueryType::MultiSet
        | QueryType::CompareSet
        | QueryType::Barrier => Wake::All,
        QueryType::QueuePush => Wake::One,
        _ => Wake::None,
    }
}

/// Suffix of the counter key of `Store::barrier`'s default (add-then-wait) implementation.
pub const BARRIER_NUM_MEMBERS_SUFFIX: &[u8] = b"/num_members";
/// Suffix of the key the last arrival sets in `Store::barrier`'s default implementation.
pub const BARRIER_LAST_MEMBER_SUFFIX: &[u8] = b"/last_member";
/// The value the last arrival stores under the `/last_member` key.
pub const BARRIER_LAST_MEMBER_VALUE: &[u8] = b"1";

/// The two keys `Store::barrier(key, world_size, timeout)`'s default implementation uses,
/// for stores without a native barrier (FileStore, HashStore, PrefixStore):
/// `idx = add(num_members, 1)`; if [`barrier_fallback_is_last`]`(idx, world_size)`, then
/// `set(last_member, "1")`; finally `wait([last_member], timeout)`.
#[cfg(feature = "alloc")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BarrierFallbackKeys {
    /// `key + "/num_members"`: the arrival counter.
    pub num_members: alloc::vec::Vec<u8>,
    /// `key + "/last_member"`: set by the last arrival, awaited by all.
    pub last_member: alloc::vec::Vec<u8>,
}

/// The keys of `Store::barrier`'s default implementation for `key`.
#[cfg(feature = "alloc")]
pub fn barrier_fallback_keys(key: &[u8]) -> BarrierFallbackKeys {
    let join = |suffix: &[u8]| {
        let mut joined = alloc::vec::Vec::with_capacity(key.len() + suffix.len());
        joined.extend_from_slice(key);
        joined.extend_from_slice(suffix);
        joined
    };
    BarrierFallbackKeys {
        num_members: join(BARRIER_NUM_MEMBERS_SUFFIX),
        last_member: join(BARRIER_LAST_MEMBER_SUFFIX),
    }
}

/// Whether the arrival numbered `arrival` (the result of `add(num_members, 1)`) is the one
/// that sets `/last_member` in `Store::barrier`'s default: exactly `arrival == world_size`,
/// so later arrivals on a used key do not set it again.
pub fn barrier_fallback_is_last(arrival: i64, world_size: i64) -> bool {
    arrival == world_size
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::string::ToString;

    #[test]
    fn compare_set_four_cases() {
        assert_eq!(
            compare_set(None, b"", b"new"),
            CompareSetOutcome::Write(b"new")
        );
        assert_eq!(
            compare_set(None, b"wrong_old_value", b"new"),
            CompareSetOutcome::Keep(b"wrong_old_value")
        );
        assert_eq!(
            compare_set(Some(b"old"), b"old", b"new"),
            CompareSetOutcome::Write(b"new")
        );
        assert_eq!(
            compare_set(Some(b"cur"), b"old", b"new"),
            CompareSetOutcome::Keep(b"cur")
        );
        // An existing empty value matches an empty expectation.
        assert_eq!(
            compare_set(Some(b""), b"", b"x"),
            CompareSetOutcome::Write(b"x")
        );
        assert_eq!(
            compare_set(Some(b"cur"), b"", b"x"),
            CompareSetOutcome::Keep(b"cur")
        );
        assert!(CompareSetOutcome::Write(b"a").writes());
        assert!(!CompareSetOutcome::Keep(b"a").writes());
        assert_eq!(CompareSetOutcome::Keep(b"a").reply(), b"a");
    }

    #[test]
    fn parse_counter_follows_stoll() {
        assert_eq!(parse_counter(b"42"), Ok(42));
        assert_eq!(parse_counter(b" \t\n\x0b\x0c\r42"), Ok(42));
        assert_eq!(parse_counter(b"+7"), Ok(7));
        assert_eq!(parse_counter(b"-7"), Ok(-7));
        assert_eq!(parse_counter(b"-0"), Ok(0));
        assert_eq!(parse_counter(b"12abc"), Ok(12));
        assert_eq!(parse_counter(b"12 34"), Ok(12));
        assert_eq!(parse_counter(b"0x10"), Ok(0));
        assert_eq!(parse_counter(b"5\x006"), Ok(5));
        assert_eq!(parse_counter(b"007"), Ok(7));
        assert_eq!(parse_counter(b"0"), Ok(0));
        assert_eq!(
            parse_counter(b"123456789012345678"),
            Ok(123_456_789_012_345_678)
        );
        assert_eq!(
            parse_counter(b"1234567890123456789"),
            Ok(1_234_567_890_123_456_789)
        );
        assert_eq!(parse_counter(b"9223372036854775807"), Ok(i64::MAX));
        assert_eq!(parse_counter(b"-9223372036854775808"), Ok(i64::MIN));
        assert_eq!(
            parse_counter(b"9223372036854775808"),
            Err(CounterError::OutOfRange)
        );
        assert_eq!(
            parse_counter(b"-9223372036854775809"),
            Err(CounterError::OutOfRange)
        );
        assert_eq!(
            parse_counter(b"99999999999999999999999x"),
            Err(CounterError::OutOfRange)
        );
        for bad in [
            &b""[..],
            b" ",
            b"abc",
            b"-",
            b"+",
            b"- 1",
            b"+-1",
            b"x1",
            b"\x001",
        ] {
            assert_eq!(parse_counter(bad), Err(CounterError::NotANumber), "{bad:?}");
        }
    }

    #[test]
    fn add_counter_starts_at_zero_and_checks_overflow() {
        assert_eq!(add_counter(None, 5), Ok(5));
        assert_eq!(add_counter(None, -5), Ok(-5));
        assert_eq!(add_counter(Some(b"10"), -3), Ok(7));
        assert_eq!(add_counter(Some(b"abc"), 1), Err(CounterError::NotANumber));
        assert_eq!(
            add_counter(Some(b"9223372036854775807"), 1),
            Err(CounterError::Overflow)
        );
        assert_eq!(
            add_counter(Some(b"-9223372036854775808"), -1),
            Err(CounterError::Overflow)
        );
        assert_eq!(barrier_count(None), Ok(1));
        assert_eq!(barrier_count(Some(b"2")), Ok(3));
        assert!(barrier_released(3, 3));
        assert!(barrier_released(1, 0));
        assert!(barrier_released(1, -4));
        assert!(!barrier_released(2, 3));
    }

    #[test]
    fn decimal_matches_to_string() {
        for value in [
            0,
            1,
            -1,
            9,
            10,
            -10,
            12345,
            i64::MAX,
            i64::MIN,
            i64::MIN + 1,
        ] {
            assert_eq!(Decimal::new(value).as_bytes(), value.to_string().as_bytes());
        }
        assert_eq!(Decimal::new(-12).to_string(), "-12");
        assert_eq!(std::format!("{:?}", Decimal::new(3)), "Decimal(3)");
    }

    #[test]
    fn presence_and_wake_policy() {
        assert!(key_present(true, 0));
        assert!(key_present(false, 1));
        assert!(!key_present(false, 0));
        assert_eq!(wake_policy(QueryType::Set), Wake::All);
        assert_eq!(wake_policy(QueryType::CompareSet), Wake::All);
        assert_eq!(wake_policy(QueryType::QueuePush), Wake::One);
        assert_eq!(wake_policy(QueryType::DeleteKey), Wake::None);
        assert_eq!(wake_policy(QueryType::Get), Wake::None);
    }

    #[cfg(feature = "alloc")]
    #[test]
    fn barrier_fallback() {
        let keys = barrier_fallback_keys(b"/job");
        assert_eq!(keys.num_members, b"/job/num_members");
        assert_eq!(keys.last_member, b"/job/last_member");
        assert!(barrier_fallback_is_last(4, 4));
        assert!(!barrier_fallback_is_last(5, 4));
        assert!(!barrier_fallback_is_last(3, 4));
    }

    /// `stoll`, re-stated with the standard library: trim C whitespace, take the longest
    /// `[+-]?[0-9]+` prefix, parse it.
    fn reference_stoll(value: &[u8]) -> Result<i64, CounterError> {
        let trimmed: &[u8] = {
            let start = value.iter().take_while(|b| is_c_space(**b)).count();
            &value[start..]
        };
        let sign = usize::from(matches!(trimmed.first(), Some(b'+' | b'-')));
        let digits = trimmed[sign..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count();
        if digits == 0 {
            return Err(CounterError::NotANumber);
        }
        let text = std::str::from_utf8(&trimmed[..sign + digits]).expect("ascii");
        text.parse::<i64>().map_err(|_| CounterError::OutOfRange)
    }

    proptest! {
        #[test]
        fn parse_counter_agrees_with_reference(value in proptest::collection::vec(
            prop_oneof![
                Just(b' '), Just(b'\t'), Just(b'-'), Just(b'+'), Just(b'x'), Just(0u8),
                b'0'..=b'9', b'0'..=b'9', b'0'..=b'9', any::<u8>(),
            ],
            0..24,
        )) {
            prop_assert_eq!(parse_counter(&value), reference_stoll(&value));
        }

        #[test]
        fn plain_digits_agree_with_reference(
            mut digits in proptest::collection::vec(b'0'..=b'9', 1..=18),
            flaw in proptest::option::of((any::<prop::sample::Index>(), any::<u8>())),
        ) {
            // Every length the eight-at-a-time path takes, whole or with one byte
            // replaced by any byte at any place (the checks' borrows and carries).
            if let Some((at, byte)) = flaw {
                let at = at.index(digits.len());
                digits[at] = byte;
            }
            prop_assert_eq!(plain_digits(&digits), reference_stoll(&digits).ok().filter(|_| {
                digits.iter().all(u8::is_ascii_digit)
            }));
            prop_assert_eq!(parse_counter(&digits), reference_stoll(&digits));
        }

        #[test]
        fn decimal_round_trips(value in any::<i64>()) {
            prop_assert_eq!(parse_counter(Decimal::new(value).as_bytes()), Ok(value));
        }

        #[test]
        fn decimal_agrees_with_to_string(value in any::<i64>(), digits in 0u32..19) {
            // Every length, not only the long numbers `any::<i64>()` mostly draws.
            let value = value % 10i64.pow(digits).max(1);
            let (decimal, expected) = (Decimal::new(value), value.to_string());
            prop_assert_eq!(decimal.as_bytes(), expected.as_bytes());
        }
    }
}
