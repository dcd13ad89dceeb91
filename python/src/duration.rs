//! Timeouts from Python: a number of seconds or a `datetime.timedelta` (as torch takes).

use std::time::Duration;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// `seconds` (an `int`, a `float` or a `timedelta`) as a [`Duration`].
///
/// # Errors
/// `TypeError` for anything else; `ValueError` for a negative, NaN or huge value.
pub(crate) fn from_py(what: &str, seconds: &Bound<'_, PyAny>) -> PyResult<Duration> {
    let value: f64 = if seconds.hasattr("total_seconds")? {
        seconds.call_method0("total_seconds")?.extract()?
    } else {
        seconds.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "{what} must be a number of seconds or a datetime.timedelta, not {}",
                seconds
                    .get_type()
                    .name()
                    .map_or_else(|_| "?".to_string(), |n| n.to_string())
            ))
        })?
    };
    Duration::try_from_secs_f64(value).map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a finite number of seconds >= 0, got {value}"
        ))
    })
}

/// Like [`from_py`], with `None` as `default`.
pub(crate) fn optional(
    what: &str,
    seconds: Option<&Bound<'_, PyAny>>,
    default: Duration,
) -> PyResult<Duration> {
    match seconds {
        Some(s) if !s.is_none() => from_py(what, s),
        _ => Ok(default),
    }
}
