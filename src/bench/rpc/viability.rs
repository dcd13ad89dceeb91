//! Which transport and channel pairs one side of the benchmark can run, and, when it
//! cannot, the reason to print.
//!
//! A transport is first asked whether it works on this host at all (`shm`: shared memory
//! and the host identity; `ibv`: `rdzv_rdma::ibv::probe_env`), then the RPC agent of this
//! build is asked whether it runs that transport with that channel. The agent checks its
//! `transports` and `channels` options before it rendezvouses, so [`agent_runs`] calls
//! `init_rpc` with a URL whose scheme has no handler: the options are refused with the
//! agent's own reason, or accepted and the call then fails at the rendezvous without
//! having joined anything. Between two hosts `shm` is also refused when the two sides'
//! shared-memory domains (boot id and network namespace) differ. This module does not
//! measure or start anything that outlives a call.

use rdzv_core::negotiate::{ChannelKind, TransportKind};
use rdzv_uring::rpc::{init_rpc, RpcError, RpcOptions};

/// The transports measured when `--transport` is not given, in column order.
pub(super) const DEFAULT_TRANSPORTS: [TransportKind; 3] =
    [TransportKind::Tcp, TransportKind::Shm, TransportKind::Ibv];

/// A URL whose scheme no rendezvous handler serves (see the module documentation).
const PROBE_URL: &str = "rdzvbenchprobe://127.0.0.1:1";

/// `error` and its sources, joined with `: `.
pub(super) fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// This host's shared-memory domain (`shm:<boot id>_<net namespace>`), when shm works.
pub(super) fn shm_domain() -> Option<String> {
    rdzv_uring::transport::shm::viability()
        .ok()
        .map(|domain| domain.as_str().to_string())
}

/// Whether `transport` works on this host; the reason when it does not.
pub(super) fn transport_here(transport: TransportKind) -> Result<(), String> {
    match transport {
        TransportKind::Shm => rdzv_uring::transport::shm::viability()
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

/// Whether this build's RPC agent runs `transport` with `channel`; its reason when not.
pub(super) fn agent_runs(transport: TransportKind, channel: ChannelKind) -> Result<(), String> {
    let mut options = RpcOptions::new(PROBE_URL);
    options.transports = Some(vec![transport.name().to_string()]);
    options.channels = Some(vec![channel.name().to_string()]);
    options.num_worker_threads = 1;
    options.listen_host = Some([127, 0, 0, 1].into());
    options.transport_plugins = vec![std::sync::Arc::new(
        rdzv_rdma::ibv::transport::IbvPlugin::default(),
    )];
    // The CUDA channels need the CUDA runtime: without a GPU it does not open, and the
    // agent says so.
    options.device_plugins = vec![std::sync::Arc::new(rdzv_rdma::cuda::agent::CudaPlugin)];
    match init_rpc("rdzv-bench-probe", 0, Some(1), options) {
        Err(RpcError::InvalidOption { reason, .. }) => Err(reason),
        Err(e @ RpcError::Backends { .. }) => Err(error_chain(&e)),
        // The options passed; the rendezvous failed as intended.
        Err(_) => Ok(()),
        Ok(agent) => {
            // Only if someone registered the probe's scheme: it ran, so it is runnable.
            let _ = agent.shutdown(false);
            Ok(())
        }
    }
}

/// Whether `channel` moves CUDA tensors: its pair echoes a tensor on `cuda:0`.
pub(super) fn is_cuda(channel: ChannelKind) -> bool {
    matches!(
        channel,
        ChannelKind::CudaXth | ChannelKind::CudaIpc | ChannelKind::CudaGdr | ChannelKind::CudaBasic
    )
}

/// [`transport_here`], for a CUDA channel whether CUDA works here, then [`agent_runs`].
/// `cuda_xth` never runs: the benchmark's two sides are two processes.
pub(super) fn pair_here(transport: TransportKind, channel: ChannelKind) -> Result<(), String> {
    transport_here(transport)?;
    if channel == ChannelKind::CudaXth {
        return Err("cuda_xth works within one process, and the two sides are two".into());
    }
    if is_cuda(channel) {
        rdzv_rdma::cuda::agent::CudaRuntime::open()?;
    }
    agent_runs(transport, channel)
}

/// The serving side's verdict on a pair the measuring side asked for: [`pair_here`],
/// and for `shm` the same shared-memory domain on both sides.
pub(super) fn pair_on_serving_side(
    transport: TransportKind,
    channel: ChannelKind,
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
        agent_runs(TransportKind::Tcp, ChannelKind::Basic).unwrap();
    }

    #[test]
    fn the_agent_explains_what_it_does_not_run() {
        // Neither is in the agent yet on this build; once one is, it runs (Ok) instead,
        // and that is what the benchmark must then measure.
        for (transport, channel) in [
            (TransportKind::Ibv, ChannelKind::Basic),
            (TransportKind::Tcp, ChannelKind::CudaGdr),
        ] {
            if let Err(reason) = agent_runs(transport, channel) {
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
            assert!(is_cuda(channel));
            match (&cuda, pair_here(TransportKind::Tcp, channel)) {
                (Ok(_), verdict) => verdict.unwrap(),
                (Err(_), Ok(())) => panic!("{channel} ran without CUDA"),
                (Err(_), Err(reason)) => assert!(reason.contains("CUDA is not viable"), "{reason}"),
            }
        }
        let err = pair_here(TransportKind::Tcp, ChannelKind::CudaXth).unwrap_err();
        assert!(err.contains("within one process"), "{err}");
        assert!(!is_cuda(ChannelKind::Cma));
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
        pair_on_serving_side(TransportKind::Shm, ChannelKind::Basic, Some(&here)).unwrap();
        let err = pair_on_serving_side(TransportKind::Shm, ChannelKind::Basic, Some("shm:other"))
            .unwrap_err();
        assert!(err.contains("different hosts"), "{err}");
        assert!(pair_on_serving_side(TransportKind::Shm, ChannelKind::Basic, None).is_err());
        pair_on_serving_side(TransportKind::Tcp, ChannelKind::Basic, None).unwrap();
    }

    #[test]
    fn error_chains_do_not_repeat_a_transparent_source() {
        let inner = std::io::Error::other("inner");
        assert_eq!(error_chain(&inner), "inner");
    }
}
