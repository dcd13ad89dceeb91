//! Which transport and channel pairs one side of the benchmark can run, and, when it
//! cannot, the reason to print.
//!
//! A transport is first asked whether it works on this host at all (`shm`: shared memory
//! and the host identity; `ibv`: `rdzv_rdma::ibv::probe_env`), then the RPC agent of this
//! build is asked whether it runs that transport with those channels:
//! [`RpcOptions::check`] gives what `init_rpc` would offer with the same options, or the
//! agent's own reason for refusing them, without joining or starting anything. Between
//! two hosts `shm` is also refused when the two sides' shared-memory domains (boot id
//! and network namespace) differ. This module does not measure or start anything that
//! outlives a call.

use rdzv_core::negotiate::{ChannelKind, TransportKind};
use rdzv_uring::rpc::{InitError, RpcOptions};

use super::spec::Channels;

/// The transports measured when `--transport` is not given, in column order.
pub(super) const DEFAULT_TRANSPORTS: [TransportKind; 3] =
    [TransportKind::Tcp, TransportKind::Shm, TransportKind::Ibv];

pub(super) use rdzv_uring::rpc::error_chain;

/// This host's shared-memory domain (`shm:<boot id>_<net namespace>`), when shm works.
pub(super) fn shm_domain() -> Option<String> {
    rdzv_uring::shm::viability()
        .ok()
        .map(|domain| domain.as_str().to_string())
}

/// Whether `transport` works on this host; the reason when it does not.
pub(super) fn transport_here(transport: TransportKind) -> Result<(), String> {
    match transport {
        TransportKind::Shm => rdzv_uring::shm::viability()
            .map(|_| ())
            .map_err(|e| format!("not viable: {}", error_chain(&e))),
        TransportKind::Ibv => match rdzv_rdma::ibv::probe_env() {
            rdzv_rdma::ibv::IbvViability::Viable(_) => Ok(()),
            rdzv_rdma::ibv::IbvViability::NotViable(reason) => {
                Err(format!("not viable: {}", error_chain(&reason)))
            }
        },
        _ => Ok(()),
    }
}

/// Whether this build's RPC agent runs `transport` with `channels`; its reason when not.
pub(super) fn agent_runs(transport: TransportKind, channels: Channels) -> Result<(), String> {
    let mut options = RpcOptions::default();
    options.transports = Some(vec![transport.name().to_string()]);
    options.channels = channels.option();
    options.listen_host = Some([127, 0, 0, 1].into());
    options.transport_plugins = vec![rdzv_rdma::ibv::transport::IbvPlugin::default().into()];
    // The CUDA channels need the CUDA runtime: without a GPU it does not open, and the
    // agent says so.
    options.device_plugins = vec![std::sync::Arc::new(rdzv_rdma::cuda::agent::CudaPlugin)];
    match options.check() {
        Ok(_) => Ok(()),
        Err(InitError::InvalidOption { reason, .. }) => Err(reason),
        Err(e) => Err(error_chain(&e)),
    }
}

/// Whether the pair moves CUDA tensors (one CUDA channel only): it echoes a tensor on
/// `cuda:0`. The default list echoes CPU tensors.
pub(super) fn is_cuda(channels: Channels) -> bool {
    matches!(
        channels,
        Channels::Only(
            ChannelKind::CudaXth
                | ChannelKind::CudaIpc
                | ChannelKind::CudaGdr
                | ChannelKind::CudaBasic
        )
    )
}

/// [`transport_here`], for a CUDA channel whether CUDA works here, then [`agent_runs`].
/// `cuda_xth` never runs: the benchmark's two sides are two processes.
pub(super) fn pair_here(transport: TransportKind, channel: Channels) -> Result<(), String> {
    transport_here(transport)?;
    if channel == Channels::Only(ChannelKind::CudaXth) {
        return Err("cuda_xth works within one process, and the two sides are two".into());
    }
    if is_cuda(channel) {
        rdzv_rdma::cuda::agent::CudaRuntime::open().map_err(|e| e.to_string())?;
    }
    agent_runs(transport, channel)
}

/// The serving side's verdict on a pair the measuring side asked for: [`pair_here`],
/// and for `shm` the same shared-memory domain on both sides.
pub(super) fn pair_on_serving_side(
    transport: TransportKind,
    channel: Channels,
    measuring_shm_domain: Option<&str>,
) -> Result<(), String> {
    pair_here(transport, channel).map_err(|reason| format!("on the serving side: {reason}"))?;
    if transport == TransportKind::Shm {
        let here = shm_domain();
        if here.is_none() || here.as_deref() != measuring_shm_domain {
            return Err(
                "the two sides are on different hosts or network namespaces (shm needs one)".into(),
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_and_basic_always_run() {
        transport_here(TransportKind::Tcp).unwrap();
        agent_runs(TransportKind::Tcp, Channels::Only(ChannelKind::Basic)).unwrap();
        // The agent's default list always has basic to fall back on.
        agent_runs(TransportKind::Tcp, Channels::Default).unwrap();
    }

    #[test]
    fn the_agent_explains_what_it_does_not_run() {
        // Neither is in the agent yet on this build; once one is, it runs (Ok) instead,
        // and that is what the benchmark must then measure.
        for (transport, channel) in [
            (TransportKind::Ibv, ChannelKind::Basic),
            (TransportKind::Tcp, ChannelKind::CudaGdr),
        ] {
            if let Err(reason) = agent_runs(transport, Channels::Only(channel)) {
                assert!(!reason.is_empty());
                assert!(
                    reason.contains(transport.name()) || reason.contains(channel.name()),
                    "{reason}"
                );
            }
        }
    }

    #[test]
    fn cuda_pairs_run_only_with_cuda() {
        let cuda = rdzv_rdma::cuda::agent::CudaRuntime::open();
        for channel in [ChannelKind::CudaIpc, ChannelKind::CudaBasic] {
            assert!(is_cuda(Channels::Only(channel)));
            match (
                &cuda,
                pair_here(TransportKind::Tcp, Channels::Only(channel)),
            ) {
                (Ok(_), verdict) => verdict.unwrap(),
                (Err(_), Ok(())) => panic!("{channel} ran without CUDA"),
                (Err(_), Err(reason)) => assert!(reason.contains("CUDA is not viable"), "{reason}"),
            }
        }
        let err = pair_here(TransportKind::Tcp, Channels::Only(ChannelKind::CudaXth)).unwrap_err();
        assert!(err.contains("within one process"), "{err}");
        assert!(!is_cuda(Channels::Only(ChannelKind::Cma)));
        assert!(!is_cuda(Channels::Default));
    }

    #[test]
    fn ibv_without_verbs_says_why() {
        match transport_here(TransportKind::Ibv) {
            Ok(()) => eprintln!("ibv is viable on this host: nothing to check"),
            Err(reason) => assert!(reason.starts_with("not viable: "), "{reason}"),
        }
    }

    #[test]
    fn shm_across_domains_is_refused_on_the_serving_side() {
        let Some(here) = shm_domain() else {
            eprintln!("SKIP: shm is not viable here");
            return;
        };
        pair_on_serving_side(
            TransportKind::Shm,
            Channels::Only(ChannelKind::Basic),
            Some(&here),
        )
        .unwrap();
        let err = pair_on_serving_side(
            TransportKind::Shm,
            Channels::Only(ChannelKind::Basic),
            Some("shm:other"),
        )
        .unwrap_err();
        assert!(err.contains("different hosts"), "{err}");
        assert!(
            pair_on_serving_side(TransportKind::Shm, Channels::Only(ChannelKind::Basic), None)
                .is_err()
        );
        pair_on_serving_side(TransportKind::Tcp, Channels::Only(ChannelKind::Basic), None).unwrap();
    }

    #[test]
    fn error_chains_do_not_repeat_a_transparent_source() {
        let inner = std::io::Error::other("inner");
        assert_eq!(error_chain(&inner), "inner");
    }
}
