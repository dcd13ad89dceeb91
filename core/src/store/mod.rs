//! The c10d TCPStore protocol: message types, the wire codec, and the store state machine.
//!
//! [`message`] names what travels, [`codec`] turns it into and out of bytes (PyTorch 2.15
//! layout, byte for byte), and [`engine`] decides what each request does to the store.
//! No module here reads a socket or a clock.

#[cfg(feature = "alloc")]
pub mod access;
pub mod budget;
pub mod codec;
#[cfg(feature = "alloc")]
pub mod engine;
pub mod file_log;
pub mod message;
pub mod semantics;
#[cfg(feature = "alloc")]
pub mod session;

pub use message::*;
