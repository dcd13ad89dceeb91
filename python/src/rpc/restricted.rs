//! Restricted mode's payloads ([`rdzv_core::rpc::restricted`]) to and from Python objects:
//! the `_rdzv.restricted_*` functions that `rdzv/rpc/_restricted.py` calls.
//!
//! Only plain data crosses: `None`, `bool`, `int` (in `i64`'s range), `float`, `str`,
//! `bytes`/`bytearray` (received as `bytes`), `list`, `tuple`, `dict` with `str` or `int`
//! keys. Anything else is offered to the caller's `tensor_hook(obj)`, which returns `None`
//! (refused: `TypeError`) or `(framework, dtype, shape, buffer)`; the buffer goes out of
//! band as one of the message's tensors and the payload keeps a reference to it. On
//! decoding, each reference is handed to `make_tensor(framework, dtype, shape, index)`,
//! which rebuilds the array from the received buffer. Nothing here imports or calls code
//! that a payload names.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple,
};

use rdzv_core::rpc::restricted::{
    decode, encode, validate_name, Framework, Key, Limits, Payload, PayloadRef, TensorRef, Value,
    MAGIC,
};

/// Deeper than this, a Python object is refused before it is walked further (the core's
/// decoder refuses the same depth, and this stops self-referencing lists).
const MAX_DEPTH: usize = 32;

struct ToValue<'a, 'py> {
    hook: &'a Bound<'py, PyAny>,
    buffers: Bound<'py, PyList>,
}

impl<'py> ToValue<'_, 'py> {
    fn key(&self, key: &Bound<'py, PyAny>) -> PyResult<Key> {
        if key.is_instance_of::<PyString>() {
            return Ok(Key::Str(key.extract()?));
        }
        if key.is_instance_of::<PyInt>() && !key.is_instance_of::<PyBool>() {
            return Ok(Key::Int(int(key)?));
        }
        Err(PyTypeError::new_err(format!(
            "restricted-mode RPC: dict keys must be str or int, not {}",
            type_name(key)
        )))
    }

    fn value(&self, obj: &Bound<'py, PyAny>, depth: usize) -> PyResult<Value> {
        if obj.is_none() {
            return Ok(Value::None);
        }
        if let Ok(b) = obj.cast::<PyBool>() {
            return Ok(Value::Bool(b.is_true()));
        }
        if obj.is_instance_of::<PyInt>() {
            return Ok(Value::Int(int(obj)?));
        }
        if obj.is_instance_of::<PyFloat>() {
            // numpy.float64 is a float too: it travels as the numpy scalar it is.
            if !obj.is_exact_instance_of::<PyFloat>() {
                if let Some(scalar) = self.described(obj)? {
                    return Ok(scalar);
                }
            }
            return Ok(Value::Float(obj.extract()?));
        }
        if obj.is_instance_of::<PyString>() {
            return Ok(Value::Str(obj.extract()?));
        }
        if let Ok(b) = obj.cast::<PyBytes>() {
            return Ok(Value::Bytes(b.as_bytes().to_vec()));
        }
        if let Ok(b) = obj.cast::<PyByteArray>() {
            return Ok(Value::Bytes(b.to_vec()));
        }
        let container = obj.is_instance_of::<PyList>()
            || obj.is_instance_of::<PyTuple>()
            || obj.is_instance_of::<PyDict>();
        if container && depth >= MAX_DEPTH {
            return Err(PyValueError::new_err(format!(
                "restricted-mode RPC: cannot send a value nested deeper than {MAX_DEPTH} levels"
            )));
        }
        if let Ok(list) = obj.cast::<PyList>() {
            let items = list
                .iter()
                .map(|item| self.value(&item, depth + 1))
                .collect::<PyResult<_>>()?;
            return Ok(Value::List(items));
        }
        if let Ok(tuple) = obj.cast::<PyTuple>() {
            let items = tuple
                .iter()
                .map(|item| self.value(&item, depth + 1))
                .collect::<PyResult<_>>()?;
            return Ok(Value::Tuple(items));
        }
        if let Ok(dict) = obj.cast::<PyDict>() {
            let mut items = Vec::with_capacity(dict.len());
            for (k, v) in dict.iter() {
                items.push((self.key(&k)?, self.value(&v, depth + 1)?));
            }
            return Ok(Value::Dict(items));
        }
        self.tensor(obj)
    }

    fn tensor(&self, obj: &Bound<'py, PyAny>) -> PyResult<Value> {
        self.described(obj)?.ok_or_else(|| {
            PyTypeError::new_err(format!(
                "restricted-mode RPC carries only None, bool, int, float, str, bytes, list, \
                 tuple, dict, numpy arrays and scalars and CPU torch tensors, not {}",
                type_name(obj)
            ))
        })
    }

    /// `obj` as the tensor hook describes it; `None` when the hook does not know it.
    fn described(&self, obj: &Bound<'py, PyAny>) -> PyResult<Option<Value>> {
        let described = self.hook.call1((obj,))?;
        if described.is_none() {
            return Ok(None);
        }
        let (framework, dtype, shape, buffer): (String, String, Vec<u64>, Bound<'py, PyAny>) =
            described.extract().map_err(|e| {
                PyTypeError::new_err(format!(
                    "tensor_hook must return None or (framework, dtype, shape, buffer): {e}"
                ))
            })?;
        let framework = Framework::from_name(&framework).ok_or_else(|| {
            PyValueError::new_err(format!(
                "restricted-mode RPC: unknown tensor framework {framework:?} (numpy, torch or \
                 numpy-scalar)"
            ))
        })?;
        let index = u32::try_from(self.buffers.len()).map_err(|_| {
            PyValueError::new_err("restricted-mode RPC: too many tensors in one message")
        })?;
        self.buffers.append(buffer)?;
        Ok(Some(Value::Tensor(TensorRef {
            index,
            framework,
            dtype,
            shape,
        })))
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".to_string())
}

fn int(obj: &Bound<'_, PyAny>) -> PyResult<i64> {
    obj.extract::<i64>().map_err(|_| {
        PyValueError::new_err(format!(
            "restricted-mode RPC carries ints from {} to {}; {} is out of range",
            i64::MIN,
            i64::MAX,
            obj
        ))
    })
}

fn encoded<'py>(py: Python<'py>, payload: PayloadRef<'_>) -> PyResult<Bound<'py, PyBytes>> {
    let mut out = Vec::new();
    encode(payload, &mut out).map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(PyBytes::new(py, &out))
}

/// `(payload, buffers)` of a restricted call of the function registered as `name`.
#[pyfunction]
pub(crate) fn restricted_encode_call<'py>(
    py: Python<'py>,
    name: &str,
    args: &Bound<'py, PyAny>,
    kwargs: &Bound<'py, PyDict>,
    tensor_hook: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyList>)> {
    let to = ToValue {
        hook: tensor_hook,
        buffers: PyList::empty(py),
    };
    let args = args
        .try_iter()?
        .map(|a| to.value(&a?, 1))
        .collect::<PyResult<Vec<_>>>()?;
    let mut kw = Vec::with_capacity(kwargs.len());
    for (k, v) in kwargs.iter() {
        let key: String = k.extract().map_err(|_| {
            PyTypeError::new_err("restricted-mode RPC: keyword argument names must be str")
        })?;
        kw.push((key, to.value(&v, 1)?));
    }
    let payload = encoded(
        py,
        PayloadRef::Call {
            name,
            args: &args,
            kwargs: &kw,
        },
    )?;
    Ok((payload, to.buffers))
}

/// `(payload, buffers)` of a restricted result.
#[pyfunction]
pub(crate) fn restricted_encode_value<'py>(
    py: Python<'py>,
    value: &Bound<'py, PyAny>,
    tensor_hook: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyList>)> {
    let to = ToValue {
        hook: tensor_hook,
        buffers: PyList::empty(py),
    };
    let value = to.value(value, 0)?;
    let payload = encoded(py, PayloadRef::Value(&value))?;
    Ok((payload, to.buffers))
}

/// The payload of a restricted exception: its type name and message.
#[pyfunction]
pub(crate) fn restricted_encode_exception<'py>(
    py: Python<'py>,
    type_name: &str,
    message: &str,
) -> PyResult<Bound<'py, PyBytes>> {
    encoded(py, PayloadRef::Exception { type_name, message })
}

/// Raises `ValueError` if `name` cannot be a registered function's name.
#[pyfunction]
pub(crate) fn restricted_validate_name(name: &str) -> PyResult<()> {
    validate_name(name).map_err(|e| PyValueError::new_err(format!("{name:?}: {e}")))
}

fn to_python<'py>(
    py: Python<'py>,
    value: Value,
    make_tensor: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Value::None => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, b).to_owned().into_any(),
        Value::Int(i) => i.into_pyobject(py)?.into_any(),
        Value::Float(x) => PyFloat::new(py, x).into_any(),
        Value::Str(s) => PyString::new(py, &s).into_any(),
        Value::Bytes(b) => PyBytes::new(py, &b).into_any(),
        Value::Tensor(t) => {
            let shape = PyTuple::new(py, &t.shape)?;
            make_tensor.call1((t.framework.name(), t.dtype, shape, t.index))?
        }
        Value::List(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(to_python(py, item, make_tensor)?)?;
            }
            list.into_any()
        }
        Value::Tuple(items) => {
            let items = items
                .into_iter()
                .map(|item| to_python(py, item, make_tensor))
                .collect::<PyResult<Vec<_>>>()?;
            PyTuple::new(py, items)?.into_any()
        }
        Value::Dict(items) => {
            let dict = PyDict::new(py);
            for (key, item) in items {
                let item = to_python(py, item, make_tensor)?;
                match key {
                    Key::Int(i) => dict.set_item(i, item)?,
                    Key::Str(s) => dict.set_item(s, item)?,
                }
            }
            dict.into_any()
        }
    })
}

/// Decodes a restricted payload: `("call", name, args: tuple, kwargs: dict)`,
/// `("value", value)` or `("exception", type_name, message)`. Raises `ValueError`, saying
/// why, for a payload that is not restricted (checked first: a pickle is never read) or
/// is malformed.
#[pyfunction]
pub(crate) fn restricted_decode<'py>(
    py: Python<'py>,
    payload: &[u8],
    make_tensor: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyTuple>> {
    let decoded =
        decode(payload, &Limits::default()).map_err(|e| PyValueError::new_err(e.to_string()))?;
    match decoded {
        Payload::Call(call) => {
            let args = call
                .args
                .into_iter()
                .map(|a| to_python(py, a, make_tensor))
                .collect::<PyResult<Vec<_>>>()?;
            let kwargs = PyDict::new(py);
            for (k, v) in call.kwargs {
                kwargs.set_item(k, to_python(py, v, make_tensor)?)?;
            }
            ("call", call.name, PyTuple::new(py, args)?, kwargs).into_pyobject(py)
        }
        Payload::Value(v) => {
            let v = to_python(py, v, make_tensor)?;
            PyTuple::new(py, [PyString::new(py, "value").into_any(), v])
        }
        Payload::Exception { type_name, message } => {
            ("exception", type_name, message).into_pyobject(py)
        }
    }
}

/// Registers the functions and `RESTRICTED_MAGIC` on the `_rdzv` module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("RESTRICTED_MAGIC", PyBytes::new(m.py(), MAGIC))?;
    m.add(
        "RESTRICTED_DTYPES",
        PyTuple::new(m.py(), rdzv_core::rpc::restricted::DTYPES)?,
    )?;
    m.add_function(wrap_pyfunction!(restricted_encode_call, m)?)?;
    m.add_function(wrap_pyfunction!(restricted_encode_value, m)?)?;
    m.add_function(wrap_pyfunction!(restricted_encode_exception, m)?)?;
    m.add_function(wrap_pyfunction!(restricted_validate_name, m)?)?;
    m.add_function(wrap_pyfunction!(restricted_decode, m)?)
}
