//! Worker names from Python: core's rule ([`validate_worker_name`]), raised as torch's
//! `WorkerInfo` raises it (`RuntimeError`, with torch's text).

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use rdzv_core::rpc::name::validate_worker_name;

/// Raises ``RuntimeError`` ("Worker name must match ^[A-Za-z0-9-_:]*$, and must be
/// non-empty and shorter than 128 chars, but got …") unless ``name`` can name a worker.
#[pyfunction]
pub(crate) fn check_worker_name(name: &str) -> PyResult<()> {
    validate_worker_name(name).map_err(|e| PyRuntimeError::new_err(e.to_string()))
}
