//! The RPC rows of one (transport, channel) pair: rank 0's agent times `rpc_sync` echoes
//! of one tensor per payload size to rank 1 and checks every echo. The tensor is on the
//! CPU, or for a CUDA channel on `cuda:0` of both sides (put there and read back outside
//! the timed call).
//!
//! It first opens the pipe with an empty call and checks that the pipe runs on the
//! transport asked for (both workers offer only that one, so anything else is a bug worth
//! failing on). With the agent's default channel list, the rows name the channel the pipe
//! negotiated for large CPU tensors (smaller ones travel inline, as for any user). Each
//! size gets one unrecorded warm-up echo. For CPU pairs, the sizes 0 B and 1 MiB (when
//! measured: `--sizes 0,1M`) also get a `remote(echo)` + `to_here` row, under the
//! transport `"{transport} rref"`. The agents and the protocol
//! are `rdzv_uring::rpc`'s; this module only calls and times.

use std::time::Instant;

use indicatif::ProgressBar;
use rdzv_core::device::Device;
use rdzv_core::device_map::DeviceMap;
use rdzv_rdma::cuda::agent::CudaMemory;
use rdzv_uring::rpc::{init_rpc, DeviceBuffer, Message, RpcAgent, RpcOptions, Tensor};

use super::payload::Payload;
use super::row::{human_size, samples, Row, RunMode};
use super::spec::{Channels, Pair, ECHO, NAMES};
use super::viability::is_cuda;
use crate::BenchError;

/// Starts rank 0's agent with `options`, measures every `(payload bytes, iterations)`,
/// and leaves the group (also after a failure).
pub(super) fn measure(
    mut options: RpcOptions,
    pair: Pair,
    sizes: &[(usize, usize)],
    mode: RunMode,
    bar: &ProgressBar,
) -> Result<Vec<Row>, BenchError> {
    if is_cuda(pair.channel) {
        let gpu = Device::cuda(0);
        options
            .device_maps
            .insert(NAMES[1], DeviceMap::from_iter([(gpu, gpu)]));
    }
    bar.set_message(format!("{pair}: joining"));
    let in_pair = |source: BenchError| BenchError::Pair {
        pair: pair.to_string(),
        source: Box::new(source),
    };
    let agent = init_rpc(NAMES[0], 0, Some(2), options).map_err(|e| in_pair(e.into()))?;
    let measured = (|| -> Result<Vec<Row>, BenchError> {
        agent.rpc_sync(NAMES[1], ECHO, Message::default())?;
        let running = agent.pipe_transport(NAMES[1]);
        if running != Some(pair.transport) {
            return Err(BenchError::Unexpected(format!(
                "the pipe asked to run on {} runs on {}",
                pair.transport,
                running.map_or("nothing", |k| k.name())
            )));
        }
        // The default list: name the channel the pipe took for large CPU tensors.
        let channel = match pair.channel {
            Channels::Only(kind) => kind.name(),
            Channels::Default => agent
                .pipe_channel(NAMES[1])
                .map_or(Channels::DEFAULT_NAME, |kind| kind.name()),
        };
        let cpu = !is_cuda(pair.channel);
        let rref = sizes
            .iter()
            .filter(|&&(len, _)| cpu && RREF_SIZES.contains(&len));
        let echoes = sizes.iter().map(|&size| (size, false));
        echoes
            .chain(rref.map(|&size| (size, true)))
            .map(|(size, rref)| echo_row(&agent, (pair, channel, mode), size, rref, bar))
            .collect()
    })();
    let joined = agent.join();
    let rows = measured.map_err(in_pair)?;
    joined.map_err(|e| in_pair(e.into()))?;
    Ok(rows)
}

/// The payload sizes that also get a `remote + to_here` row, when they are measured.
const RREF_SIZES: [usize; 2] = [0, 1 << 20];

/// How long `to_here` waits for the owner's value.
const RREF_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Times `rpc_sync` echoes of `len` bytes or, with `rref`, `remote(echo)` followed by
/// `to_here` (the RRef's value fetched from rank 1), beside the `rpc_sync` rows, with the
/// transport named `"{transport} rref"` (its own column; the channel is the echo rows'
/// one, and the progress bar counts only the echoes).
fn echo_row(
    agent: &RpcAgent,
    (pair, channel, mode): (Pair, &str, RunMode),
    (len, iters): (usize, usize),
    rref: bool,
    bar: &ProgressBar,
) -> Result<Row, BenchError> {
    let payload = Payload::new(len);
    let (rref_suffix, what) = if rref {
        (" rref", "to_here")
    } else {
        ("", "the echo")
    };
    bar.set_message(format!("{pair}{rref_suffix} {}", human_size(len as u64)));
    let cuda = is_cuda(pair.channel);
    let samples = samples(iters, (!rref).then_some(bar), |iter| {
        let bytes = payload.message(iter);
        let tensor = if cuda {
            let memory =
                CudaMemory::upload(Device::cuda(0), &bytes).map_err(|source| BenchError::Cuda {
                    what: format!("uploading {len} bytes to cuda:0"),
                    source: Box::new(source),
                })?;
            Tensor::on_device(DeviceBuffer::new(memory))
        } else {
            Tensor::cpu(bytes)
        };
        let message = Message::default().with_tensor(tensor);
        let started = Instant::now();
        let reply = if rref {
            agent.remote(NAMES[1], ECHO, message)?.to_here(RREF_WAIT)?
        } else {
            agent.rpc_sync(NAMES[1], ECHO, message)?
        };
        let took = started.elapsed();
        match reply.tensors.as_slice() {
            [tensor] if cuda => payload.verify(iter, &echoed_from_device(tensor)?, what)?,
            [tensor] => payload.verify(iter, &tensor.data, what)?,
            tensors => {
                return Err(BenchError::Unexpected(format!(
                    "{what} returned {} tensors instead of 1",
                    tensors.len()
                )))
            }
        }
        Ok(took)
    })?;
    let transport = format!("{}{rref_suffix}", pair.transport.name());
    Ok(Row::from_samples(
        &transport, channel, mode, len as u64, samples,
    ))
}

/// The host copy of an echoed CUDA tensor.
fn echoed_from_device(tensor: &Tensor) -> Result<Vec<u8>, BenchError> {
    let memory = tensor
        .memory
        .as_ref()
        .and_then(|m| m.downcast_ref::<CudaMemory>())
        .ok_or_else(|| {
            BenchError::Unexpected(format!(
                "the echo came back as a {} tensor without CUDA memory",
                tensor.device
            ))
        })?;
    memory.to_host().map_err(|source| BenchError::Cuda {
        what: format!("reading the echoed tensor back from {}", tensor.device),
        source: Box::new(source),
    })
}
