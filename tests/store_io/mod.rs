//! Runs a store test against every server event loop: `on_every_io!(a, b)` makes
//! `io_uring::a`, `epoll::a`, `io_uring::b` and `epoll::b`, each calling `a(IoMode)` /
//! `b(IoMode)` in the including file.

/// Generates one `#[test]` per event loop for each named `fn name(io: IoMode)`.
#[macro_export]
macro_rules! on_every_io {
    ($($name:ident),* $(,)?) => {
        mod io_uring {
            $(
                #[test]
                fn $name() {
                    super::$name(rdzv::uring::IoMode::IoUring)
                }
            )*
        }
        mod epoll {
            $(
                #[test]
                fn $name() {
                    super::$name(rdzv::uring::IoMode::Epoll)
                }
            )*
        }
    };
}
