//! `rdzv._rdzv.ReceivedBuffer`: a received tensor's bytes, handed to Python without a
//! copy. It owns the buffer the agent received them into and shows it to numpy through
//! `__array_interface__` (`numpy.asarray(buffer)` is a `uint8` array over the same
//! memory, which keeps the `ReceivedBuffer` alive as its `base`); `rdzv/rpc/_serialize.py`
//! rebuilds arrays, tensors and memoryviews over it. When Python drops it, a large buffer
//! goes back to the agent's recycled buffers for the next receive.

use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict};

use super::sys::ReceivedBytes;

/// A received tensor's bytes (writable, like the `bytearray` they used to be).
#[pyclass(module = "rdzv._rdzv", name = "ReceivedBuffer", frozen)]
pub(crate) struct ReceivedBuffer {
    bytes: ReceivedBytes,
}

impl ReceivedBuffer {
    /// Owns `buffer`.
    pub(crate) fn new(buffer: Vec<u8>) -> ReceivedBuffer {
        ReceivedBuffer {
            bytes: ReceivedBytes::from_vec(buffer),
        }
    }
}

#[pymethods]
impl ReceivedBuffer {
    /// numpy's array interface (version 3): a one-dimensional, writable `uint8` array of
    /// the bytes, at their address.
    #[getter(__array_interface__)]
    fn array_interface<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let interface = PyDict::new(py);
        interface.set_item("version", 3)?;
        interface.set_item("shape", (self.bytes.len(),))?;
        interface.set_item("typestr", "|u1")?;
        interface.set_item("data", (self.bytes.address(), false))?;
        Ok(interface)
    }

    /// The length in bytes.
    fn __len__(&self) -> usize {
        self.bytes.len()
    }

    /// A copy of the bytes, as `bytes`.
    fn tobytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        self.bytes.with_bytes(|bytes| PyBytes::new(py, bytes))
    }

    /// A copy of the bytes, as a `bytearray` (where numpy is not installed).
    fn tobytearray<'py>(&self, py: Python<'py>) -> Bound<'py, PyByteArray> {
        self.bytes.with_bytes(|bytes| PyByteArray::new(py, bytes))
    }

    fn __repr__(&self) -> String {
        format!("<rdzv ReceivedBuffer of {} bytes>", self.bytes.len())
    }
}
