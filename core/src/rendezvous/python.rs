//! Python's text conventions that PyTorch's messages inherit: `repr()` of a `str` and the
//! literals `int()` accepts in base 10.
//!
//! This module decides how a value is quoted in an error message and which strings count
//! as integers, so that our messages read like the ones PyTorch users search for. It does
//! not carry Unicode tables: non-ASCII characters that Python would escape in a `repr`
//! are recognised only approximately (controls, non-space whitespace and a few format
//! characters), and `int()`'s non-ASCII decimal digits (`int("١٢")` is `12` in Python)
//! are rejected.

use core::fmt::{self, Write};

/// Python's `repr(s)` for a `str`, written lazily: `'abc'`, `"it's"`, `'a\tb'`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PyRepr<'a>(pub(crate) &'a str);

impl PyRepr<'_> {
    fn quote(&self) -> char {
        if self.0.contains('\'') && !self.0.contains('"') {
            '"'
        } else {
            '\''
        }
    }
}

/// Characters `str.isprintable()` rejects, approximated without Unicode tables.
fn is_unprintable(c: char) -> bool {
    c.is_control()
        || (c.is_whitespace() && c != ' ')
        || matches!(
            c,
            '\u{ad}' | '\u{200b}'..='\u{200f}' | '\u{2060}'..='\u{2064}' | '\u{feff}'
        )
}

impl fmt::Display for PyRepr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let quote = self.quote();
        f.write_char(quote)?;
        for c in self.0.chars() {
            match c {
                '\\' => f.write_str("\\\\")?,
                '\t' => f.write_str("\\t")?,
                '\n' => f.write_str("\\n")?,
                '\r' => f.write_str("\\r")?,
                c if c == quote => {
                    f.write_char('\\')?;
                    f.write_char(c)?;
                }
                c if is_unprintable(c) => {
                    let code = u32::from(c);
                    if code < 0x100 {
                        write!(f, "\\x{code:02x}")?;
                    } else if code < 0x1_0000 {
                        write!(f, "\\u{code:04x}")?;
                    } else {
                        write!(f, "\\U{code:08x}")?;
                    }
                }
                c => f.write_char(c)?,
            }
        }
        f.write_char(quote)
    }
}

/// A writer that passes through at most `left` characters, then drops the rest silently
/// (CPython's `%.200R` in `PyErr_Format`).
struct Truncate<'f, 'g> {
    out: &'f mut fmt::Formatter<'g>,
    left: usize,
}

impl Write for Truncate<'_, '_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for c in s.chars() {
            if self.left == 0 {
                return Ok(());
            }
            self.left -= 1;
            self.out.write_char(c)?;
        }
        Ok(())
    }
}

/// The message of the `ValueError` that `int(value)` raises in Python:
/// `invalid literal for int() with base 10: 'abc'` (the repr cut at 200 characters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct InvalidIntLiteral<'a>(pub(crate) &'a str);

impl fmt::Display for InvalidIntLiteral<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("invalid literal for int() with base 10: ")?;
        let mut cut = Truncate { out: f, left: 200 };
        write!(cut, "{}", PyRepr(self.0))
    }
}

/// A Python integer as `int(text)` reads it, kept as text so that any size fits:
/// the sign and the digits (which may still hold `_` separators and leading zeros).
///
/// `Display` writes `str(int(text))`: no `+`, no `_`, no leading zeros, no `-0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PyInt<'a> {
    negative: bool,
    digits: &'a str,
}

impl<'a> PyInt<'a> {
    /// Reads `text` the way Python's `int(text)` does in base 10: surrounding whitespace,
    /// one optional sign, ASCII digits with single `_` between digits. `None` where Python
    /// raises `ValueError` (and for non-ASCII digits, which Python would accept).
    pub(crate) fn parse(text: &'a str) -> Option<Self> {
        let trimmed = text.trim_matches(char::is_whitespace);
        let (negative, digits) = match trimmed.as_bytes().first() {
            Some(b'-') => (true, trimmed.get(1..)?),
            Some(b'+') => (false, trimmed.get(1..)?),
            _ => (false, trimmed),
        };
        let bytes = digits.as_bytes();
        let well_formed = !bytes.is_empty()
            && bytes.first().is_some_and(u8::is_ascii_digit)
            && bytes.last().is_some_and(u8::is_ascii_digit)
            && bytes.iter().all(|b| b.is_ascii_digit() || *b == b'_')
            && !digits.contains("__");
        well_formed.then_some(Self { negative, digits })
    }

    /// The significant digits, skipping separators and leading zeros (empty for zero).
    fn significant(&self) -> impl Iterator<Item = u8> + 'a {
        self.digits
            .bytes()
            .filter(|b| *b != b'_')
            .skip_while(|b| *b == b'0')
    }

    /// Whether the value is zero.
    fn is_zero(&self) -> bool {
        self.significant().next().is_none()
    }

    /// Whether the value is negative (`-0` is not).
    pub fn is_negative(&self) -> bool {
        self.negative && !self.is_zero()
    }

    /// Whether the value is exactly `-1`, PyTorch's "not given".
    pub(crate) fn is_minus_one(&self) -> bool {
        self.to_i64() == Some(-1)
    }

    /// The value, if it fits an `i64`.
    pub fn to_i64(&self) -> Option<i64> {
        let mut magnitude: i64 = 0;
        for digit in self.significant() {
            magnitude = magnitude
                .checked_mul(10)?
                .checked_sub(i64::from(digit - b'0'))?;
        }
        // Accumulated as a negative number so that i64::MIN fits.
        if self.negative {
            Some(magnitude)
        } else {
            magnitude.checked_neg()
        }
    }
}

impl fmt::Display for PyInt<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_zero() {
            return f.write_char('0');
        }
        if self.negative {
            f.write_char('-')?;
        }
        for digit in self.significant() {
            f.write_char(char::from(digit))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::format;
    use std::string::ToString;

    #[test]
    fn repr_matches_python() {
        // Expected values printed by CPython 3.11 `repr()`.
        let cases = [
            ("abc", "'abc'"),
            ("", "''"),
            ("it's", "\"it's\""),
            ("a'b\"c", "'a\\'b\"c'"),
            ("a\\b", "'a\\\\b'"),
            ("t\tn\nr\r", "'t\\tn\\nr\\r'"),
            ("\u{0}\u{7f}", "'\\x00\\x7f'"),
            ("\u{a0}", "'\\xa0'"),
            ("\u{2028}", "'\\u2028'"),
            ("１", "'１'"),
            ("é", "'é'"),
        ];
        for (input, expected) in cases {
            assert_eq!(PyRepr(input).to_string(), expected, "{input:?}");
        }
    }

    #[test]
    fn int_literals_match_python() {
        let good = [
            ("0", "0", Some(0)),
            ("-0", "0", Some(0)),
            ("+7", "7", Some(7)),
            (" 42\n", "42", Some(42)),
            ("007", "7", Some(7)),
            ("1_000", "1000", Some(1000)),
            ("-1", "-1", Some(-1)),
            ("\u{b}5\u{a0}\u{85}", "5", Some(5)),
            (
                "-9223372036854775808",
                "-9223372036854775808",
                Some(i64::MIN),
            ),
            ("9223372036854775807", "9223372036854775807", Some(i64::MAX)),
            ("9223372036854775808", "9223372036854775808", None),
            (
                "123456789012345678901234567890",
                "123456789012345678901234567890",
                None,
            ),
        ];
        for (input, shown, value) in good {
            let parsed = PyInt::parse(input).unwrap_or_else(|| panic!("{input:?}"));
            assert_eq!(parsed.to_string(), shown, "{input:?}");
            assert_eq!(parsed.to_i64(), value, "{input:?}");
        }
        for bad in [
            "",
            " ",
            "-",
            "+",
            "abc",
            "1.0",
            "1e3",
            "_1",
            "1_",
            "1__0",
            "0x10",
            "--1",
            "+-1",
            "1 2",
            "١٢",
            "\u{1c}5",
            "\u{200b}5",
        ] {
            assert_eq!(PyInt::parse(bad), None, "{bad:?}");
        }
        assert!(PyInt::parse("-1").is_some_and(|v| v.is_minus_one()));
        assert!(PyInt::parse("-01").is_some_and(|v| v.is_minus_one()));
        assert!(!PyInt::parse("-0").is_some_and(|v| v.is_negative()));
    }

    #[test]
    fn invalid_literal_message_is_cut_like_cpython() {
        assert_eq!(
            InvalidIntLiteral("abc").to_string(),
            "invalid literal for int() with base 10: 'abc'"
        );
        let long = "x".repeat(300);
        let message = InvalidIntLiteral(&long).to_string();
        // `%.200R`: the repr (quotes included) is cut at 200 characters.
        assert_eq!(
            message,
            format!(
                "invalid literal for int() with base 10: '{}",
                "x".repeat(199)
            )
        );
    }
}
