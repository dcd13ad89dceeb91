//! Messages between Python and the agent: a request or reply is Python's
//! `(metadata: bytes, payload: bytes, buffers: list)`, where `payload` is the pickle and
//! `buffers` its out-of-band buffers (`rdzv/rpc/_serialize.py` makes both). Each buffer
//! becomes one CPU tensor of the [`Message`], so that it travels beside the pickle over
//! the agent's channels.
//!
//! A buffer is bytes-like (copied: small ones), or one with `address`, `length` and
//! `owner` (`_serialize.lent`), a buffer Python lends for the send (`_serialize.py` lends those of at least
//! 16 KiB): the tensor reads the bytes where they are ([`LentBuffer`], `Tensor::lent`),
//! and `owner` stays alive until the agent is done with them. Received tensors come back as
//! [`ReceivedBuffer`]s, which own the received bytes (no copy).

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyList, PyTuple};

use rdzv_uring::rpc::{Message, Tensor};

use super::received::ReceivedBuffer;
use super::sys::LentBuffer;

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
        message.tensors.push(tensor(index, &buffer?)?);
    }
    Ok(message)
}

/// Out-of-band buffer `index` as a tensor: lent for one that `rdzv.rpc._serialize.lent`
/// made (with attributes `address`, `length` and `owner`), else a copy of its bytes.
fn tensor(index: usize, buffer: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    let py = buffer.py();
    if buffer.is_instance_of::<PyBytes>() || buffer.is_instance_of::<PyByteArray>() {
        return Ok(Tensor::cpu(buffer_bytes(
            &format!("buffer {index}"),
            buffer,
        )?));
    }
    let Some(address) = buffer.getattr_opt(intern!(py, "address"))? else {
        return Ok(Tensor::cpu(buffer_bytes(
            &format!("buffer {index}"),
            buffer,
        )?));
    };
    let lent = |e: PyErr| {
        PyTypeError::new_err(format!(
            "buffer {index}: a lent buffer has address: int, length: int and owner: {e}"
        ))
    };
    let address: usize = address.extract().map_err(lent)?;
    let len: usize = buffer
        .getattr(intern!(py, "length"))
        .and_then(|l| l.extract())
        .map_err(lent)?;
    let owner = buffer.getattr(intern!(py, "owner")).map_err(lent)?.unbind();
    let lent = LentBuffer::new(address, len, owner)
        .map_err(|e| PyValueError::new_err(format!("buffer {index} cannot be lent: {e}")))?;
    Ok(Tensor::lent(lent))
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

/// A received message as `(metadata: bytes, payload: bytes, buffers:
/// list[ReceivedBuffer])`: each tensor's bytes move into a `ReceivedBuffer`, uncopied. A
/// lent tensor (a message that never left this process) is copied into one.
///
/// # Errors
/// `TypeError` for a tensor in device memory, which this binding does not hand to Python.
pub(crate) fn to_python(py: Python<'_>, message: Message) -> PyResult<Bound<'_, PyTuple>> {
    let buffers = PyList::empty(py);
    for (index, tensor) in message.tensors.into_iter().enumerate() {
        let data = match &tensor.memory {
            None => tensor.data,
            Some(_) => match tensor.lent_bytes() {
                Some(bytes) => bytes.to_vec(),
                None => {
                    return Err(PyTypeError::new_err(format!(
                        "tensor {index} of the message is in {} memory; rdzv.rpc hands only \
                         CPU tensors to Python",
                        tensor.device
                    )))
                }
            },
        };
        buffers.append(Bound::new(py, ReceivedBuffer::new(data))?)?;
    }
    (
        PyBytes::new(py, &message.metadata),
        PyBytes::new(py, &message.payload),
        buffers,
    )
        .into_pyobject(py)
}
