//! `rdzv._rdzv.RRef`: the agent's [`RRef`] for Python. Reference counting, forks and
//! the owner's confirmation are the agent's (core's RRef machine); the value lives in
//! Python on its owner (`rdzv/rpc/_rref.py` keeps it, keyed by the key the `remote()`
//! request carried), so that methods called through the proxies change the one object.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use rdzv_uring::rpc::RRef;

use super::errors;

/// One reference to a value on its owner.
#[pyclass(module = "rdzv._rdzv", name = "RRef", frozen)]
pub(crate) struct PyRRef {
    pub(crate) rref: RRef,
}

#[pymethods]
impl PyRRef {
    /// The owner's `(name, id)`.
    fn owner(&self) -> (String, i64) {
        (
            self.rref.owner().to_string(),
            i64::from(self.rref.owner_id().get()),
        )
    }

    /// Whether this worker owns the value.
    fn is_owner(&self) -> bool {
        self.rref.is_owner()
    }

    /// Whether the owner has confirmed this reference (always on the owner).
    fn confirmed_by_owner(&self) -> bool {
        self.rref.confirmed_by_owner()
    }

    /// The RRef's id, as text.
    fn id(&self) -> String {
        self.rref.id().to_string()
    }

    /// This RRef forked to worker `to`: bytes for `to` to turn back into an RRef
    /// (`RpcAgent.rref_from_fork`), exactly once.
    fn fork_to<'py>(&self, py: Python<'py>, to: &str) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self
            .rref
            .fork_to(to)
            .map_err(|e| errors::usage(e.to_string()))?;
        Ok(PyBytes::new(py, &bytes))
    }
}
