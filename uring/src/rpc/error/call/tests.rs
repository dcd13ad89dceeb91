//! Every kind of [`CallError`]: its kind, whether it is retryable, its peer, its text.

use rdzv_core::rpc::frame::EncodeError;
use rdzv_core::rpc::timeouts::RpcTimeoutError;

use super::{CallError, CallErrorKind, RRefWaitTimeout};
use crate::rpc::error::{
    error_chain, ChannelFailure, PipeFailure, RRefFailure, RpcError, TransportError, UsageError,
};

fn peer() -> String {
    "bob".to_string()
}

/// One error of every variant, with the kind, retryability and peer it must report.
fn every_error() -> Vec<(CallError, CallErrorKind, bool, Option<&'static str>)> {
    use CallErrorKind as K;
    vec![
        (
            CallError::Timeout {
                peer: peer(),
                error: RpcTimeoutError { timeout_ms: 50 },
            },
            K::Timeout,
            true,
            Some("bob"),
        ),
        (
            CallError::Remote {
                peer: peer(),
                handler: "echo".into(),
                message: "boom".into(),
            },
            K::Remote,
            false,
            Some("bob"),
        ),
        (
            CallError::Connect {
                peer: peer(),
                address: "tcp://127.0.0.1:1".into(),
                reason: PipeFailure::Closed,
            },
            K::Connect,
            true,
            Some("bob"),
        ),
        (
            CallError::Handshake {
                peer: peer(),
                reason: PipeFailure::Refused("no common transport".into()),
            },
            K::Handshake,
            false,
            Some("bob"),
        ),
        (
            CallError::PipeBroken {
                peer: peer(),
                reason: PipeFailure::Reset,
            },
            K::PipeBroken,
            true,
            Some("bob"),
        ),
        (
            CallError::NoChannel {
                peer: peer(),
                source_device: "cuda:0".into(),
                target_device: "cpu".into(),
            },
            K::NoChannel,
            false,
            Some("bob"),
        ),
        (
            CallError::Channel {
                channel: "cma",
                peer: peer(),
                index: Some(1),
                reason: ChannelFailure::NoConnections,
            },
            K::Channel,
            false,
            Some("bob"),
        ),
        (
            CallError::Device {
                channel: "cuda_ipc",
                peer: peer(),
                index: 2,
                source: Box::new(std::io::Error::other("cuIpcGetMemHandle failed")),
            },
            K::Channel,
            false,
            Some("bob"),
        ),
        (
            CallError::Encode {
                peer: peer(),
                source: Box::new(EncodeError::DataCount {
                    expected: 2,
                    given: 1,
                }),
            },
            K::Encode,
            false,
            Some("bob"),
        ),
        (
            CallError::InjectedFault {
                peer: peer(),
                handler: "echo".into(),
            },
            K::InjectedFault,
            true,
            Some("bob"),
        ),
        (
            CallError::ShutDown { name: "me".into() },
            K::ShutDown,
            false,
            None,
        ),
        (
            CallError::FlushTimeout { pending: 3 },
            K::Timeout,
            true,
            None,
        ),
        (
            CallError::RRefWait(RRefWaitTimeout::Flush {
                timeout: std::time::Duration::from_millis(20),
                futures: 1,
                users: 0,
                calls: 2,
            }),
            K::Timeout,
            true,
            None,
        ),
        (
            CallError::RRef {
                rref: "GloballyUniqueId(1, 2)".into(),
                owner: peer(),
                reason: RRefFailure::Handler {
                    message: "boom".into(),
                },
            },
            K::Remote,
            false,
            Some("bob"),
        ),
        (
            CallError::RRef {
                rref: "GloballyUniqueId(1, 2)".into(),
                owner: peer(),
                reason: RRefFailure::Unreachable {
                    source: Box::new(CallError::PipeBroken {
                        peer: peer(),
                        reason: PipeFailure::Reset,
                    }),
                },
            },
            K::PipeBroken,
            true,
            Some("bob"),
        ),
        (
            CallError::Resources {
                what: "a thread",
                source: std::io::Error::other("no memory"),
            },
            K::Resources,
            false,
            None,
        ),
        (
            UsageError::UnknownWorker { name: peer() }.into(),
            K::Usage,
            false,
            Some("bob"),
        ),
        (UsageError::BlockingInline.into(), K::Usage, false, None),
    ]
}

#[test]
fn every_kind_reports_its_kind_retryability_and_peer() {
    for (error, kind, retryable, peer) in every_error() {
        assert_eq!(error.kind(), kind, "{error:?}");
        assert_eq!(error.is_retryable(), retryable, "{error:?}");
        assert_eq!(error.peer(), peer, "{error:?}");
        assert_eq!(
            error.is_timeout(),
            kind == CallErrorKind::Timeout,
            "{error:?}"
        );
        assert_eq!(
            error.is_remote(),
            kind == CallErrorKind::Remote,
            "{error:?}"
        );
        assert_eq!(error.is_usage(), kind == CallErrorKind::Usage, "{error:?}");
        assert_eq!(
            error.usage().is_some(),
            matches!(error, CallError::Usage(_))
        );
        assert!(!error.to_string().is_empty());
        // The umbrella keeps the text and the rule.
        let text = error.to_string();
        let any = RpcError::from(error);
        assert_eq!(any.to_string(), text);
        assert_eq!(any.is_retryable(), retryable);
    }
}

#[test]
fn the_retry_rule_is_the_documented_one() {
    use CallErrorKind as K;
    let retryable = [K::Timeout, K::PipeBroken, K::Connect, K::InjectedFault];
    let not = [
        K::Remote,
        K::Handshake,
        K::NoChannel,
        K::Channel,
        K::Encode,
        K::ShutDown,
        K::Resources,
        K::Usage,
    ];
    assert!(retryable.iter().all(|k| k.is_retryable()));
    assert!(not.iter().all(|k| !k.is_retryable()));
}

#[test]
fn pytorch_texts_are_kept() {
    let timeout = CallError::Timeout {
        peer: peer(),
        error: RpcTimeoutError { timeout_ms: 50 },
    };
    assert_eq!(
        timeout.to_string(),
        "RPC ran for more than set timeout (50 ms) and will now be marked with an error"
    );
    let injected = CallError::InjectedFault {
        peer: peer(),
        handler: "echo".into(),
    };
    assert_eq!(
        injected.to_string(),
        "Send attempt failed intentionally for echo"
    );
    assert_eq!(
        CallError::FlushTimeout { pending: 2 }.to_string(),
        "Timed out waiting to flush pending futures, had 2 pending futures"
    );
    let wait = CallError::RRefWait(RRefWaitTimeout::OwnersAndForks {
        timeout: std::time::Duration::from_millis(1500),
        owners: 2,
        forks: 1,
        rank: 3,
        had_owners: 1,
        had_forks: 0,
    });
    assert_eq!(
        wait.to_string(),
        "Timed out waiting 1.5s for 2 owners and 1 forks on rank 3, had 1 owners and 0 forks"
    );
    let usage = CallError::from(UsageError::UnknownWorker { name: peer() });
    assert_eq!(
        usage.to_string(),
        UsageError::UnknownWorker { name: peer() }.to_string()
    );
}

#[test]
fn a_device_failure_names_the_tensor_and_keeps_the_runtime_error_as_its_source() {
    #[derive(Debug, thiserror::Error)]
    #[error("cannot lend a tensor on cuda:0 over cuda_ipc")]
    struct Lend(#[source] std::io::Error);
    let error = CallError::Device {
        channel: "cuda_ipc",
        peer: peer(),
        index: 1,
        source: Box::new(Lend(std::io::Error::other("CUDA_ERROR_OUT_OF_MEMORY"))),
    };
    assert_eq!(
        error.to_string(),
        "tensor 1 over the cuda_ipc channel with bob: cannot lend a tensor on cuda:0 over \
         cuda_ipc: CUDA_ERROR_OUT_OF_MEMORY"
    );
    let source = std::error::Error::source(&error).map(ToString::to_string);
    assert_eq!(
        source.as_deref(),
        Some("cannot lend a tensor on cuda:0 over cuda_ipc")
    );
}

#[test]
fn a_channel_failure_says_which_tensor_and_prints_its_cause_once() {
    #[derive(Debug, thiserror::Error)]
    #[error("process_vm_readv from pid 7 failed")]
    struct Read(#[source] std::io::Error);
    let error = CallError::Channel {
        channel: "cma",
        peer: peer(),
        index: Some(3),
        reason: ChannelFailure::read(Read(std::io::Error::other("ESRCH"))),
    };
    let text = "tensor transfer over the cma channel with bob failed: tensor 3: \
                process_vm_readv from pid 7 failed: ESRCH";
    assert_eq!(error.to_string(), text);
    assert_eq!(error_chain(&error), text);
    // The channel's own error stays reachable for a caller that inspects it.
    let reason = std::error::Error::source(&error).expect("the reason");
    let read = std::error::Error::source(reason).expect("the read error");
    assert!(read.downcast_ref::<Read>().is_some());
    // A check of the agent's own has no source and no tensor prefix when none is named.
    let refused = CallError::Channel {
        channel: "xth",
        peer: peer(),
        index: None,
        reason: ChannelFailure::LengthMismatch {
            announced: 5,
            frame: 6,
        },
    };
    assert_eq!(
        refused.to_string(),
        "tensor transfer over the xth channel with bob failed: its descriptor announces 5 \
         bytes, the frame 6"
    );
}

#[test]
fn an_rref_failure_has_its_call_as_source_and_kind() {
    let remote = CallError::Timeout {
        peer: peer(),
        error: RpcTimeoutError { timeout_ms: 50 },
    };
    let error = CallError::RRef {
        rref: "GloballyUniqueId(1, 2)".into(),
        owner: peer(),
        reason: RRefFailure::CreationFailed {
            source: std::sync::Arc::new(remote),
        },
    };
    assert!(error.is_timeout() && error.is_retryable());
    let text = "RRef GloballyUniqueId(1, 2) owned by bob: RRef creation via rpc.remote() failed \
                (RPC ran for more than set timeout (50 ms) and will now be marked with an \
                error), and it is possible that the RRef on the owner node does not exist; \
                call remote() again";
    assert_eq!(error.to_string(), text);
    assert_eq!(error_chain(&error), text);
    let reason = std::error::Error::source(&error).expect("the reason");
    let call = std::error::Error::source(reason).expect("the remote() call");
    // The remote() call's own error, shared by every to_here that reports it.
    let call = call
        .downcast_ref::<std::sync::Arc<CallError>>()
        .expect("the call's CallError");
    assert!(call.is_timeout());
    let not_ready = RRefFailure::NotReady {
        timeout: std::time::Duration::from_millis(30),
    };
    assert_eq!(not_ready.kind(), CallErrorKind::Timeout);
    assert_eq!(not_ready.to_string(), "the value is not ready after 30ms");
}

#[test]
fn a_pipe_failure_reads_once_through_the_call_error() {
    let io = std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        "refused by the kernel",
    );
    let error = CallError::Connect {
        peer: "w1".into(),
        address: "tcp://10.0.0.2:4000".into(),
        reason: PipeFailure::transport(TransportError::Connect {
            address: "tcp://10.0.0.2:4000".into(),
            source: io,
        }),
    };
    let text = error_chain(&error);
    assert!(
        text.starts_with("cannot open an RPC pipe to w1 at tcp://10.0.0.2:4000: "),
        "{text}"
    );
    assert!(text.contains("refused by the kernel"), "{text}");
    assert_eq!(text.matches("refused by the kernel").count(), 1, "{text}");
    assert!(text.ends_with("is w1 still running?"), "{text}");
    let broken = CallError::PipeBroken {
        peer: "w1".into(),
        reason: PipeFailure::protocol(rdzv_core::rpc::pipe::Refusal::Closing),
    };
    let text = error_chain(&broken);
    assert!(text.contains("(this worker said goodbye)"), "{text}");
    assert_eq!(text.matches("said goodbye").count(), 1, "{text}");
    let source = std::error::Error::source(&broken).map(ToString::to_string);
    assert_eq!(
        source.as_deref(),
        Some("the pipe is closing (this worker said goodbye)")
    );
}
