//! rdzv facade.
pub use rdzv_core as core;
pub use rdzv_rdma as rdma;
pub use rdzv_uring as uring;
