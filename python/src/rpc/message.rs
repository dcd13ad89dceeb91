//! Messages between Python and the agent: a request or reply is Python's
//! `(metadata: bytes, payload: bytes, buffers: list)`, where `payload` is the pickle and
//! `buffers` its out-of-band buffers (`rdzv/rpc/_serialize.py` makes both). Each buffer
//! becomes one CPU tensor of the [`Message`], so that it travels beside the pickle over
//! the agent's channels; received tensors come back as `bytearray`s.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyList, PyTuple};

use rdzv_uring::rpc::{Message, Tensor};

/// The bytes of a `bytes`, a `bytearray` or any other bytes-like object (a
/// `PickleBuffer.raw()` view), copied. The extension is built for the stable ABI of
/// Python 3.9, which has no buffer protocol: other objects go through `bytes(object)`,
/// one copy more.
pub(crate) fn buffer_bytes(what: &str, object: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(bytes) = object.cast::<PyBytes>() {
        return Ok(bytes.as_bytes().to_vec());
    }
    if let Ok(array) = object.cast::<PyByteArray>() {
        return Ok(array.to_vec());
    }
    let bytes = object
        .py()
        .get_type::<PyBytes>()
        .call1((object,))
        .map_err(|e| PyTypeError::new_err(format!("{what} must be bytes-like: {e}")))?;
    Ok(bytes.cast::<PyBytes>()?.as_bytes().to_vec())
}

/// `(metadata, payload, buffers)` from Python as a message of CPU tensors.
pub(crate) fn from_python(
    metadata: &Bound<'_, PyAny>,
    payload: &Bound<'_, PyAny>,
    buffers: &Bound<'_, PyAny>,
) -> PyResult<Message> {
    let mut message = Message {
        metadata: buffer_bytes("metadata", metadata)?,
        payload: buffer_bytes("payload", payload)?,
        tensors: Vec::new(),
    };
    for (index, buffer) in buffers.try_iter()?.enumerate() {
        let data = buffer_bytes(&format!("buffer {index}"), &buffer?)?;
        message.tensors.push(Tensor::cpu(data));
    }
    Ok(message)
}

/// A tuple `(metadata, payload, buffers)` from Python, as a message.
pub(crate) fn from_tuple(reply: &Bound<'_, PyAny>) -> PyResult<Message> {
    let tuple = reply.cast::<PyTuple>().map_err(|_| {
        PyTypeError::new_err("an RPC reply must be a tuple (metadata, payload, buffers)")
    })?;
    if tuple.len() != 3 {
        return Err(PyTypeError::new_err(format!(
            "an RPC reply must be a tuple (metadata, payload, buffers), got {} items",
            tuple.len()
        )));
    }
    from_python(
        &tuple.get_item(0)?,
        &tuple.get_item(1)?,
        &tuple.get_item(2)?,
    )
}

/// A received message as `(metadata: bytes, payload: bytes, buffers: list[bytearray])`.
///
/// # Errors
/// `TypeError` for a tensor in device memory, which this binding does not hand to Python.
pub(crate) fn to_python<'py>(py: Python<'py>, message: &Message) -> PyResult<Bound<'py, PyTuple>> {
    let buffers = PyList::empty(py);
    for (index, tensor) in message.tensors.iter().enumerate() {
        if tensor.memory.is_some() {
            return Err(PyTypeError::new_err(format!(
                "tensor {index} of the message is in {} memory; rdzv.rpc hands only CPU \
                 tensors to Python",
                tensor.device
            )));
        }
        buffers.append(PyByteArray::new(py, &tensor.data))?;
    }
    (
        PyBytes::new(py, &message.metadata),
        PyBytes::new(py, &message.payload),
        buffers,
    )
        .into_pyobject(py)
}
