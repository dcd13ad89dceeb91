//! `rdzv-rdma`: verbs and CUDA.
#![warn(missing_docs)]
