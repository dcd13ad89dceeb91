//! `rdzv._rdzv`: the Python extension module of the `rdzv` package.
//!
//! It binds, with PyO3, what Python users need from the runtime crate: the store server
//! ([`server::PyStoreServer`], `rdzv_uring::StoreServer` in this process), the store
//! client ([`store::PyStore`], every c10d `Store` operation under torch's names),
//! `rendezvous(url)` and the elastic rendezvous handle ([`rendezvous`]). Every call that
//! can block (network, waits, joins) releases the GIL. Errors become the exception classes
//! of `rdzv/_errors.py` ([`errors`]).
//!
//! It decides nothing about protocols: every rule is `rdzv-core`'s, every socket
//! `rdzv-uring`'s. The torchrun rendezvous handler is Python (`rdzv/torchrun.py`), over
//! this module and torch's own `TCPStore` client.

use pyo3::prelude::*;

mod duration;
mod errors;
mod rendezvous;
mod rpc;
mod server;
mod store;

/// The extension module `rdzv._rdzv`; `rdzv/__init__.py` re-exports it.
#[pymodule]
fn _rdzv(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<server::PyStoreServer>()?;
    m.add_class::<store::PyStore>()?;
    m.add_class::<rendezvous::PyElasticRendezvous>()?;
    m.add_class::<rendezvous::PyRound>()?;
    m.add_function(wrap_pyfunction!(rendezvous::rendezvous, m)?)?;
    rpc::register(m)?;
    Ok(())
}
