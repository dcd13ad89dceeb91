//! Worker names and ids: which names an RPC worker may carry, and [`WorkerInfo`].
//!
//! The rules are `WorkerInfo`'s constructor in PyTorch's `rpc_agent.h`: a name is 1 to 127
//! bytes, each an ASCII letter, an ASCII digit, `-`, `_` or `:` (the docs write it as
//! `^[A-Za-z0-9-_:]*$` plus the length rule), and an id is a `worker_id_t`, an `int16_t`.
//! Every rejected name gets PyTorch's one message, "Worker name must match
//! ^[A-Za-z0-9-_:]*$, and must be non-empty and shorter than 128 chars, but got {name}";
//! the error variant says which rule failed. A name longer than
//! [`REJECTED_INPUT_CAPACITY`](crate::device::REJECTED_INPUT_CAPACITY) bytes is quoted cut
//! short with a trailing `...` (PyTorch quotes it whole).
//!
//! This module decides validity only; it does not assign ids or check uniqueness across a
//! group (see [`super::store_keys`]).

use alloc::string::String;
use core::fmt;

use crate::device::RejectedInput;

/// PyTorch's `WorkerInfo::MAX_NAME_LEN`: a worker name must be *shorter* than this many
/// bytes.
pub const MAX_NAME_LEN: usize = 128;

/// Whether `byte` may appear in a worker name: `[A-Za-z0-9-_:]`.
pub const fn is_name_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b':')
}

/// Why a worker name was rejected. All variants display PyTorch's single message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum NameError {
    /// The name is empty.
    Empty,
    /// The name is [`MAX_NAME_LEN`] bytes or longer.
    TooLong {
        /// The name (its start, for long names).
        name: RejectedInput,
        /// Its length in bytes.
        len: usize,
    },
    /// The name contains a byte outside `[A-Za-z0-9-_:]`.
    InvalidCharacter {
        /// The name (its start, for long names).
        name: RejectedInput,
        /// Byte offset of the first offending character.
        at: usize,
    },
}

impl fmt::Display for NameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Worker name must match ^[A-Za-z0-9-_:]*$, and must be non-empty and shorter than \
             {MAX_NAME_LEN} chars, but got "
        )?;
        match self {
            NameError::Empty => Ok(()),
            NameError::TooLong { name, .. } | NameError::InvalidCharacter { name, .. } => {
                write!(f, "{name}")
            }
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for NameError {}

/// Checks `name` against PyTorch's worker name rules.
///
/// # Errors
/// [`NameError`] naming the first rule broken: emptiness, then length, then characters.
pub fn validate_worker_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.len() >= MAX_NAME_LEN {
        return Err(NameError::TooLong {
            name: RejectedInput::new(name),
            len: name.len(),
        });
    }
    match name.bytes().position(|b| !is_name_byte(b)) {
        Some(at) => Err(NameError::InvalidCharacter {
            name: RejectedInput::new(name),
            at,
        }),
        None => Ok(()),
    }
}

/// Checks a name received as bytes (from a store) and returns it as text. Valid names are
/// ASCII, so bytes that are not UTF-8 are an [`NameError::InvalidCharacter`] at the first
/// offending byte.
///
/// # Errors
/// [`NameError`] as for [`validate_worker_name`].
pub fn validate_worker_name_bytes(name: &[u8]) -> Result<&str, NameError> {
    match core::str::from_utf8(name) {
        Ok(text) => validate_worker_name(text).map(|()| text),
        Err(e) => {
            let valid = name.get(..e.valid_up_to()).unwrap_or_default();
            let shown = core::str::from_utf8(valid).unwrap_or_default();
            if name.is_empty() {
                return Err(NameError::Empty);
            }
            if name.len() >= MAX_NAME_LEN {
                return Err(NameError::TooLong {
                    name: RejectedInput::new(shown),
                    len: name.len(),
                });
            }
            let at = name
                .iter()
                .position(|&b| !is_name_byte(b))
                .unwrap_or(e.valid_up_to());
            Err(NameError::InvalidCharacter {
                name: RejectedInput::new(shown),
                at,
            })
        }
    }
}

/// A worker's id (PyTorch's `worker_id_t`, an `int16_t`): its rank in a static group.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct WorkerId(i16);

/// An id outside `int16_t`: "RPC worker id {id} out of bound of int16_t."
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerIdError {
    /// The id given.
    pub id: i64,
}

impl fmt::Display for WorkerIdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RPC worker id {} out of bound of int16_t.", self.id)
    }
}

#[cfg(feature = "std")]
impl std::error::Error for WorkerIdError {}

impl WorkerId {
    /// The id `id`.
    pub const fn from_i16(id: i16) -> WorkerId {
        WorkerId(id)
    }

    /// The id `id`, which must fit an `int16_t`. PyTorch checks only the upper bound and
    /// silently wraps ids below `-32768`; rdzv rejects them with the same message.
    ///
    /// # Errors
    /// [`WorkerIdError`] if `id` does not fit.
    pub fn new(id: i64) -> Result<WorkerId, WorkerIdError> {
        i16::try_from(id)
            .map(WorkerId)
            .map_err(|_| WorkerIdError { id })
    }

    /// The id as a number.
    pub const fn get(self) -> i16 {
        self.0
    }
}

impl From<i16> for WorkerId {
    fn from(id: i16) -> Self {
        WorkerId(id)
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Why a [`WorkerInfo`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WorkerInfoError {
    /// The id does not fit an `int16_t`.
    Id(WorkerIdError),
    /// The name breaks the naming rules.
    Name(NameError),
}

impl fmt::Display for WorkerInfoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkerInfoError::Id(e) => e.fmt(f),
            WorkerInfoError::Name(e) => e.fmt(f),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for WorkerInfoError {}

impl From<NameError> for WorkerInfoError {
    fn from(e: NameError) -> Self {
        WorkerInfoError::Name(e)
    }
}

impl From<WorkerIdError> for WorkerInfoError {
    fn from(e: WorkerIdError) -> Self {
        WorkerInfoError::Id(e)
    }
}

/// A worker's name and id, both checked (PyTorch's `WorkerInfo`). Displays as PyTorch's
/// `operator<<`: `WorkerInfo(id=0, name=worker0)`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerInfo {
    name: String,
    id: WorkerId,
}

impl WorkerInfo {
    /// A worker info from a name and an id (`WorkerInfo(name, id)`). As in PyTorch the id is
    /// checked first.
    ///
    /// # Errors
    /// [`WorkerInfoError`] if the id does not fit an `int16_t` or the name is invalid.
    pub fn new(name: &str, id: i64) -> Result<WorkerInfo, WorkerInfoError> {
        let id = WorkerId::new(id)?;
        validate_worker_name(name)?;
        Ok(WorkerInfo {
            name: String::from(name),
            id,
        })
    }

    /// A worker info from an id already known to fit.
    ///
    /// # Errors
    /// [`NameError`] if the name is invalid.
    pub fn with_id(name: &str, id: WorkerId) -> Result<WorkerInfo, NameError> {
        validate_worker_name(name)?;
        Ok(WorkerInfo {
            name: String::from(name),
            id,
        })
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The id.
    pub fn id(&self) -> WorkerId {
        self.id
    }
}

impl fmt::Display for WorkerInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WorkerInfo(id={}, name={})", self.id, self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;
    use proptest::prelude::*;

    const PREFIX: &str = "Worker name must match ^[A-Za-z0-9-_:]*$, and must be non-empty and \
                          shorter than 128 chars, but got ";

    #[test]
    fn accepts_pytorch_style_names() {
        for name in ["worker0", "trainer-1", "ps_0", "a:b:c", "A", "0", "-_:"] {
            assert_eq!(validate_worker_name(name), Ok(()), "{name}");
        }
        assert!(validate_worker_name(&"a".repeat(127)).is_ok());
    }

    #[test]
    fn rejects_what_pytorch_rejects_with_its_message() {
        // The cases of PyTorch's test_invalid_names.
        let star = validate_worker_name("abc*").unwrap_err();
        assert_eq!(
            star,
            NameError::InvalidCharacter {
                name: RejectedInput::new("abc*"),
                at: 3
            }
        );
        assert_eq!(star.to_string(), alloc::format!("{PREFIX}abc*"));
        assert!(matches!(
            validate_worker_name(" "),
            Err(NameError::InvalidCharacter { at: 0, .. })
        ));
        let empty = validate_worker_name("").unwrap_err();
        assert_eq!(empty, NameError::Empty);
        assert_eq!(empty.to_string(), PREFIX);
        assert!(empty.to_string().contains("must be non-empty"));
        let long = validate_worker_name(&"a".repeat(500)).unwrap_err();
        assert!(matches!(long, NameError::TooLong { len: 500, .. }));
        assert!(long.to_string().contains("shorter than 128"));
        assert!(long.to_string().ends_with("..."));
        assert!(validate_worker_name(&"a".repeat(128)).is_err());
        // Non-ASCII letters and digits are not `isalnum` in the C locale.
        assert!(validate_worker_name("wörker").is_err());
        assert!(validate_worker_name("w٣").is_err());
        assert!(validate_worker_name("a.b").is_err());
        assert!(validate_worker_name("a/b").is_err());
        assert!(validate_worker_name("a,b").is_err());
    }

    #[test]
    fn worker_ids_are_int16() {
        assert_eq!(WorkerId::new(0).map(WorkerId::get), Ok(0));
        assert_eq!(WorkerId::new(32767).map(WorkerId::get), Ok(32767));
        assert_eq!(WorkerId::new(-1).map(WorkerId::get), Ok(-1));
        let err = WorkerId::new(32768).unwrap_err();
        assert_eq!(
            err.to_string(),
            "RPC worker id 32768 out of bound of int16_t."
        );
        assert!(WorkerId::new(-32769).is_err());
    }

    #[test]
    fn worker_info_checks_id_then_name_and_displays_like_pytorch() {
        let info = WorkerInfo::new("worker3", 3).unwrap();
        assert_eq!(info.name(), "worker3");
        assert_eq!(info.id(), WorkerId::from(3));
        assert_eq!(info.to_string(), "WorkerInfo(id=3, name=worker3)");
        assert!(matches!(
            WorkerInfo::new("bad name", 1 << 20),
            Err(WorkerInfoError::Id(_))
        ));
        assert!(matches!(
            WorkerInfo::new("bad name", 1),
            Err(WorkerInfoError::Name(_))
        ));
        assert!(WorkerInfo::with_id("", WorkerId::from(0)).is_err());
    }

    #[test]
    fn byte_names_are_checked_like_text() {
        assert_eq!(validate_worker_name_bytes(b"worker1"), Ok("worker1"));
        assert_eq!(validate_worker_name_bytes(b""), Err(NameError::Empty));
        assert!(matches!(
            validate_worker_name_bytes(b"ab\xffcd"),
            Err(NameError::InvalidCharacter { at: 2, .. })
        ));
        assert!(matches!(
            validate_worker_name_bytes(&[0xff; 200]),
            Err(NameError::TooLong { len: 200, .. })
        ));
    }

    proptest! {
        #[test]
        fn bytes_and_text_agree(name in proptest::collection::vec(any::<u8>(), 0..140)) {
            let by_bytes = validate_worker_name_bytes(&name);
            if let Ok(text) = core::str::from_utf8(&name) {
                prop_assert_eq!(by_bytes.clone().map(|_| ()), validate_worker_name(text));
            }
            if let Ok(text) = by_bytes {
                prop_assert_eq!(text.as_bytes(), &name[..]);
            }
        }

        #[test]
        fn validity_is_the_regex_plus_length(name in "[A-Za-z0-9_:*. é-]{0,140}") {
            let expected = !name.is_empty()
                && name.len() < MAX_NAME_LEN
                && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_:".contains(&b));
            prop_assert_eq!(validate_worker_name(&name).is_ok(), expected);
            if let Err(e) = validate_worker_name(&name) {
                prop_assert!(e.to_string().starts_with(PREFIX));
            }
        }
    }
}
