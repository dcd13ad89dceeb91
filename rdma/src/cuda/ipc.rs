//! `cuda_ipc`: CUDA tensors between two processes of one host, through a staging outbox
//! opened once (TensorPipe's design, `reference/tensorpipe.md` §3).
//!
//! Each sender owns an **outbox**: one `cuMemAlloc` of `slots × slot_len` bytes with one
//! `cuIpcGetMemHandle`, and one interprocess event per slot (created up front, as TensorPipe
//! does, to avoid a driver deadlock when creating them later). Per chunk the sender copies
//! its tensor into a slot on its stream, records the slot's event and sends a descriptor
//! (slot, offset, length; the first descriptor of a connection also carries the outbox's
//! memory and event handles). The receiver opens the outbox once (`cuIpcOpenMemHandle`,
//! `cuIpcOpenEventHandle`) and keeps it open, makes its stream wait on the slot's event,
//! copies the slot into its tensor, records the same event, and acknowledges the slot; the
//! sender makes its stream wait on that event before it fills the slot again. Up to `slots`
//! chunks are in flight. Staging costs a second device copy but avoids what sank the direct
//! design: handles opened per tensor, closed with an implicit device synchronisation, and
//! keeping user memory from being freed.
//!
//! The wire format ([`IpcMessage`]) and the pipeline ([`send_ipc`], [`recv_ipc`]) are pure
//! and generic over the device halves ([`OutboxSide`], [`InboxSide`]), so they are tested
//! here with host memory; [`CudaIpcSender`] and [`CudaIpcReceiver`] are the CUDA halves. A
//! handle cannot be opened by the process that created it, so the two ends must live in
//! different processes (same-process pairs use `cuda_xth`). This module does not check peer
//! access between the two GPUs beforehand: opening fails with the driver's error.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::safe::CudaStream;

use super::byte_channel::ByteChannel;
use super::channel_error::CudaChannelError;
use super::memory::{copy_device_async, DeviceAllocation, DeviceRange, Gpu, IpcMapping, RawEvent};
use super::staging::chunks;

/// Magic bytes that open a `cuda_ipc` transfer.
pub const IPC_MAGIC: [u8; 4] = *b"RZCI";
/// Size of a CUDA IPC memory or event handle.
pub const HANDLE_LEN: usize = 64;
/// Most slots an outbox may have (bounds what a peer can make the receiver open).
pub const MAX_SLOTS: usize = 64;
/// TensorPipe's outbox: 4 slots of 8 MiB.
pub const DEFAULT_SLOTS: usize = 4;
/// TensorPipe's outbox slot size.
pub const DEFAULT_SLOT_LEN: usize = 8 << 20;

const TAG_HEADER: u8 = 0x48; // 'H'
const TAG_CHUNK: u8 = 0x43; // 'C'
const TAG_ACK: u8 = 0x41; // 'A'
const FLAG_OUTBOX: u8 = 1;

/// What a receiver needs to open a sender's outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxInfo {
    /// The sender's process id.
    pub pid: u32,
    /// The outbox's id, unique within the sender's process.
    pub outbox_id: u64,
    /// Number of slots.
    pub slot_count: u32,
    /// Bytes per slot.
    pub slot_len: u64,
    /// `cuIpcGetMemHandle` of the outbox allocation.
    pub mem_handle: [u8; HANDLE_LEN],
    /// `cuIpcGetEventHandle` of each slot's event.
    pub event_handles: Vec<[u8; HANDLE_LEN]>,
}

/// One `cuda_ipc` message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IpcMessage {
    /// Opens a transfer of `total` bytes (sender → receiver).
    Header {
        /// Bytes in the transfer.
        total: u64,
    },
    /// A filled slot (sender → receiver).
    Chunk {
        /// Slot index.
        slot: u32,
        /// Offset of the chunk in the tensor.
        offset: u64,
        /// Bytes in the slot.
        len: u64,
        /// The outbox, the first time this connection uses it.
        outbox: Option<Box<OutboxInfo>>,
    },
    /// The receiver has enqueued its copy out of `slot` and recorded the slot's event
    /// (receiver → sender).
    Ack {
        /// Slot index.
        slot: u32,
    },
}

const HEADER_LEN: usize = 1 + 4 + 8;
const CHUNK_FIXED_LEN: usize = 1 + 1 + 4 + 8 + 8;
const OUTBOX_FIXED_LEN: usize = 4 + 8 + 4 + 8 + HANDLE_LEN;
const ACK_LEN: usize = 1 + 4;

impl IpcMessage {
    /// The encoded bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            IpcMessage::Header { total } => {
                out.push(TAG_HEADER);
                out.extend_from_slice(&IPC_MAGIC);
                out.extend_from_slice(&total.to_le_bytes());
            }
            IpcMessage::Chunk {
                slot,
                offset,
                len,
                outbox,
            } => {
                out.push(TAG_CHUNK);
                out.push(if outbox.is_some() { FLAG_OUTBOX } else { 0 });
                out.extend_from_slice(&slot.to_le_bytes());
                out.extend_from_slice(&offset.to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
                if let Some(info) = outbox {
                    out.extend_from_slice(&info.pid.to_le_bytes());
                    out.extend_from_slice(&info.outbox_id.to_le_bytes());
                    out.extend_from_slice(&info.slot_count.to_le_bytes());
                    out.extend_from_slice(&info.slot_len.to_le_bytes());
                    out.extend_from_slice(&info.mem_handle);
                    for handle in &info.event_handles {
                        out.extend_from_slice(handle);
                    }
                }
            }
            IpcMessage::Ack { slot } => {
                out.push(TAG_ACK);
                out.extend_from_slice(&slot.to_le_bytes());
            }
        }
        out
    }

    /// Decodes one message from the start of `bytes`: `Ok(Some((message, consumed)))`,
    /// `Ok(None)` if more bytes are needed, or an error for bytes that are no message.
    pub fn decode(bytes: &[u8]) -> Result<Option<(IpcMessage, usize)>, CudaChannelError> {
        let mut reader = Reader { bytes, pos: 0 };
        let Some(tag) = reader.u8() else {
            return Ok(None);
        };
        let message = match tag {
            TAG_HEADER => {
                let Some(magic) = reader.take(4) else {
                    return Ok(None);
                };
                if magic != IPC_MAGIC {
                    return Err(malformed(format!("bad magic {magic:02x?}")));
                }
                let Some(total) = reader.u64() else {
                    return Ok(None);
                };
                IpcMessage::Header { total }
            }
            TAG_CHUNK => {
                let (Some(flags), Some(slot), Some(offset), Some(len)) =
                    (reader.u8(), reader.u32(), reader.u64(), reader.u64())
                else {
                    return Ok(None);
                };
                if flags & !FLAG_OUTBOX != 0 {
                    return Err(malformed(format!("unknown chunk flags {flags:#04x}")));
                }
                let outbox = if flags & FLAG_OUTBOX != 0 {
                    let (Some(pid), Some(outbox_id), Some(slot_count), Some(slot_len)) =
                        (reader.u32(), reader.u64(), reader.u32(), reader.u64())
                    else {
                        return Ok(None);
                    };
                    let Some(mem_handle) = reader.handle() else {
                        return Ok(None);
                    };
                    let count = slot_count as usize;
                    if count == 0 || count > MAX_SLOTS {
                        return Err(malformed(format!(
                            "outbox with {slot_count} slots (1 to {MAX_SLOTS} allowed)"
                        )));
                    }
                    if slot_len == 0 {
                        return Err(malformed("outbox with empty slots".to_owned()));
                    }
                    let mut event_handles = Vec::with_capacity(count);
                    for _ in 0..count {
                        let Some(handle) = reader.handle() else {
                            return Ok(None);
                        };
                        event_handles.push(handle);
                    }
                    Some(Box::new(OutboxInfo {
                        pid,
                        outbox_id,
                        slot_count,
                        slot_len,
                        mem_handle,
                        event_handles,
                    }))
                } else {
                    None
                };
                IpcMessage::Chunk {
                    slot,
                    offset,
                    len,
                    outbox,
                }
            }
            TAG_ACK => {
                let Some(slot) = reader.u32() else {
                    return Ok(None);
                };
                IpcMessage::Ack { slot }
            }
            other => return Err(malformed(format!("unknown message tag {other:#04x}"))),
        };
        Ok(Some((message, reader.pos)))
    }

    /// Reads one message from `channel`.
    pub fn read_from<C: ByteChannel + ?Sized>(
        channel: &mut C,
    ) -> Result<IpcMessage, CudaChannelError> {
        let read = |channel: &mut C, buf: &mut Vec<u8>, n: usize| {
            let start = buf.len();
            buf.resize(start + n, 0);
            channel
                .recv_bytes(&mut buf[start..])
                .map_err(CudaChannelError::cpu("receiving a cuda_ipc message"))
        };
        let mut buf = Vec::with_capacity(CHUNK_FIXED_LEN);
        read(channel, &mut buf, 1)?;
        let fixed = match buf.first().copied() {
            Some(TAG_HEADER) => HEADER_LEN,
            Some(TAG_CHUNK) => CHUNK_FIXED_LEN,
            Some(TAG_ACK) => ACK_LEN,
            Some(other) => return Err(malformed(format!("unknown message tag {other:#04x}"))),
            None => return Err(malformed("empty read".to_owned())),
        };
        read(channel, &mut buf, fixed - 1)?;
        if buf
            .get(1)
            .is_some_and(|flags| buf[0] == TAG_CHUNK && flags & FLAG_OUTBOX != 0)
        {
            read(channel, &mut buf, OUTBOX_FIXED_LEN)?;
            let count_at = CHUNK_FIXED_LEN + 4 + 8;
            let mut raw = [0u8; 4];
            if let Some(bytes) = buf.get(count_at..count_at + 4) {
                raw.copy_from_slice(bytes);
            }
            let count = u32::from_le_bytes(raw) as usize;
            if count == 0 || count > MAX_SLOTS {
                return Err(malformed(format!(
                    "outbox with {count} slots (1 to {MAX_SLOTS} allowed)"
                )));
            }
            read(channel, &mut buf, count * HANDLE_LEN)?;
        }
        match IpcMessage::decode(&buf)? {
            Some((message, used)) if used == buf.len() => Ok(message),
            _ => Err(malformed("truncated message".to_owned())),
        }
    }

    fn write_to<C: ByteChannel + ?Sized>(&self, channel: &mut C) -> Result<(), CudaChannelError> {
        channel
            .send_bytes(&self.encode())
            .map_err(CudaChannelError::cpu("sending a cuda_ipc message"))
    }
}

fn malformed(detail: String) -> CudaChannelError {
    CudaChannelError::protocol("cuda_ipc message", detail)
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let out = self.bytes.get(self.pos..self.pos.checked_add(n)?)?;
        self.pos += n;
        Some(out)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).and_then(|b| b.first().copied())
    }
    fn u32(&mut self) -> Option<u32> {
        let mut raw = [0u8; 4];
        raw.copy_from_slice(self.take(4)?);
        Some(u32::from_le_bytes(raw))
    }
    fn u64(&mut self) -> Option<u64> {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(self.take(8)?);
        Some(u64::from_le_bytes(raw))
    }
    fn handle(&mut self) -> Option<[u8; HANDLE_LEN]> {
        let mut raw = [0u8; HANDLE_LEN];
        raw.copy_from_slice(self.take(HANDLE_LEN)?);
        Some(raw)
    }
}

/// The sender's device half: an outbox bound to one source tensor and stream.
pub trait OutboxSide {
    /// The outbox, as the receiver must open it.
    fn info(&self) -> &OutboxInfo;
    /// Enqueues the copy of `len` bytes at `offset` of the source into `slot`, then records
    /// the slot's event.
    fn fill(&mut self, slot: usize, offset: usize, len: usize) -> Result<(), CudaChannelError>;
    /// Orders later work after the receiver's copy out of `slot` (acknowledged).
    fn reclaim(&mut self, slot: usize) -> Result<(), CudaChannelError>;
}

/// The receiver's device half: opened outboxes and one destination tensor and stream.
pub trait InboxSide {
    /// Opens `info`'s outbox (or keeps it if already open).
    fn open(&mut self, info: &OutboxInfo) -> Result<(), CudaChannelError>;
    /// `(slot count, slot length)` of the open outbox, if any.
    fn geometry(&self) -> Option<(usize, u64)>;
    /// Waits (on the device) for `slot`'s event, enqueues the copy of its first `len` bytes
    /// to `offset` of the destination, and records the slot's event.
    fn drain(&mut self, slot: usize, offset: usize, len: usize) -> Result<(), CudaChannelError>;
}

/// Sends a `total`-byte tensor through the outbox. `peer_has_outbox` is the connection's
/// memory of whether the outbox handles were already sent; it is set once they are.
pub fn send_ipc<S, C>(
    side: &mut S,
    peer_has_outbox: &mut bool,
    total: usize,
    channel: &mut C,
) -> Result<(), CudaChannelError>
where
    S: OutboxSide + ?Sized,
    C: ByteChannel + ?Sized,
{
    let slots = side.info().slot_count as usize;
    let slot_len = usize::try_from(side.info().slot_len).unwrap_or(usize::MAX);
    if slots == 0 || slot_len == 0 {
        return Err(CudaChannelError::InvalidPool { slots, slot_len });
    }
    IpcMessage::Header {
        total: total as u64,
    }
    .write_to(channel)?;
    let mut in_flight: VecDeque<usize> = VecDeque::with_capacity(slots);
    let mut busy = vec![false; slots];
    for (i, (offset, len)) in chunks(total, slot_len).enumerate() {
        let slot = i % slots;
        while busy.get(slot).copied().unwrap_or(false) {
            await_ack(side, channel, &mut in_flight, &mut busy)?;
        }
        side.fill(slot, offset, len)?;
        let outbox = (!*peer_has_outbox).then(|| Box::new(side.info().clone()));
        IpcMessage::Chunk {
            slot: slot as u32,
            offset: offset as u64,
            len: len as u64,
            outbox,
        }
        .write_to(channel)?;
        *peer_has_outbox = true;
        if let Some(flag) = busy.get_mut(slot) {
            *flag = true;
        }
        in_flight.push_back(slot);
    }
    while !in_flight.is_empty() {
        await_ack(side, channel, &mut in_flight, &mut busy)?;
    }
    Ok(())
}

fn await_ack<S, C>(
    side: &mut S,
    channel: &mut C,
    in_flight: &mut VecDeque<usize>,
    busy: &mut [bool],
) -> Result<(), CudaChannelError>
where
    S: OutboxSide + ?Sized,
    C: ByteChannel + ?Sized,
{
    let expected = in_flight
        .pop_front()
        .ok_or_else(|| malformed("acknowledgement with no chunk in flight".to_owned()))?;
    match IpcMessage::read_from(channel)? {
        IpcMessage::Ack { slot } if slot as usize == expected => {
            side.reclaim(expected)?;
            if let Some(flag) = busy.get_mut(expected) {
                *flag = false;
            }
            Ok(())
        }
        IpcMessage::Ack { slot } => Err(malformed(format!(
            "acknowledgement for slot {slot}, expected slot {expected}"
        ))),
        other => Err(malformed(format!(
            "expected an acknowledgement, got {other:?}"
        ))),
    }
}

/// Receives a transfer into a `total`-byte tensor.
pub fn recv_ipc<S, C>(side: &mut S, total: usize, channel: &mut C) -> Result<(), CudaChannelError>
where
    S: InboxSide + ?Sized,
    C: ByteChannel + ?Sized,
{
    let sent = match IpcMessage::read_from(channel)? {
        IpcMessage::Header { total } => total,
        other => {
            return Err(malformed(format!(
                "expected a transfer header, got {other:?}"
            )))
        }
    };
    if sent != total as u64 {
        return Err(CudaChannelError::LengthMismatch {
            sent,
            expected: total as u64,
        });
    }
    let mut next = 0u64;
    while next < sent {
        let IpcMessage::Chunk {
            slot,
            offset,
            len,
            outbox,
        } = IpcMessage::read_from(channel)?
        else {
            return Err(malformed("expected a chunk descriptor".to_owned()));
        };
        if let Some(info) = outbox {
            side.open(&info)?;
        }
        let Some((slots, slot_len)) = side.geometry() else {
            return Err(malformed(
                "chunk before the outbox was described".to_owned(),
            ));
        };
        let end = offset.saturating_add(len);
        if offset != next || len == 0 || len > slot_len || end > sent || slot as usize >= slots {
            return Err(malformed(format!(
                "chunk slot {slot} [{offset}, +{len}) does not continue at {next} within \
                 {sent} bytes and {slots} slots of {slot_len}"
            )));
        }
        // Both fit in usize: `end <= sent == total`.
        side.drain(slot as usize, offset as usize, len as usize)?;
        IpcMessage::Ack { slot }.write_to(channel)?;
        next = end;
    }
    Ok(())
}

static NEXT_OUTBOX_ID: AtomicU64 = AtomicU64::new(1);

/// A sender's staging outbox on one device.
#[derive(Debug)]
pub struct Outbox {
    gpu: Gpu,
    memory: DeviceAllocation,
    events: Vec<RawEvent>,
    info: OutboxInfo,
}

impl Outbox {
    /// Allocates `slots × slot_len` bytes on `gpu` with `cuMemAlloc`, exports it and
    /// creates one interprocess event per slot.
    pub fn new(gpu: &Gpu, slots: usize, slot_len: usize) -> Result<Outbox, CudaChannelError> {
        if slots == 0 || slots > MAX_SLOTS || slot_len == 0 {
            return Err(CudaChannelError::InvalidPool { slots, slot_len });
        }
        let total = slots
            .checked_mul(slot_len)
            .ok_or(CudaChannelError::InvalidPool { slots, slot_len })?;
        let memory = gpu.alloc(total)?;
        let mem_handle = memory.ipc_handle()?;
        let mut events = Vec::with_capacity(slots);
        let mut event_handles = Vec::with_capacity(slots);
        for _ in 0..slots {
            // CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING, as an exported event needs.
            let event = RawEvent::new(gpu, true)?;
            event_handles.push(event.ipc_handle()?);
            events.push(event);
        }
        let info = OutboxInfo {
            pid: std::process::id(),
            outbox_id: NEXT_OUTBOX_ID.fetch_add(1, Ordering::Relaxed),
            slot_count: slots as u32,
            slot_len: slot_len as u64,
            mem_handle,
            event_handles,
        };
        Ok(Outbox {
            gpu: gpu.clone(),
            memory,
            events,
            info,
        })
    }

    /// What a receiver needs to open it.
    pub fn info(&self) -> &OutboxInfo {
        &self.info
    }
}

impl Drop for Outbox {
    fn drop(&mut self) {
        // The receiver may still be copying out of the slots; never free them under it.
        for event in &self.events {
            let _ = event.synchronize();
        }
    }
}

struct BoundOutbox<'o, 's, 'd> {
    outbox: &'o Outbox,
    src: DeviceRange<'d>,
    stream: &'s CudaStream,
}

impl BoundOutbox<'_, '_, '_> {
    fn slot_range(&self, slot: usize, len: usize) -> Result<DeviceRange<'_>, CudaChannelError> {
        let slot_len = self.outbox.info.slot_len as usize;
        if len > slot_len {
            return Err(CudaChannelError::protocol(
                "cuda_ipc slot",
                format!("{len} bytes exceed a {slot_len}-byte slot"),
            ));
        }
        slot.checked_mul(slot_len)
            .and_then(|start| self.outbox.memory.range().slice(start, len))
            .ok_or_else(|| CudaChannelError::protocol("cuda_ipc slot", format!("no slot {slot}")))
    }

    fn event(&self, slot: usize) -> Result<&RawEvent, CudaChannelError> {
        self.outbox
            .events
            .get(slot)
            .ok_or_else(|| CudaChannelError::protocol("cuda_ipc slot", format!("no slot {slot}")))
    }
}

impl OutboxSide for BoundOutbox<'_, '_, '_> {
    fn info(&self) -> &OutboxInfo {
        &self.outbox.info
    }

    fn fill(&mut self, slot: usize, offset: usize, len: usize) -> Result<(), CudaChannelError> {
        let src = self.src.slice(offset, len).ok_or_else(|| {
            CudaChannelError::protocol(
                "cuda_ipc chunk",
                format!("[{offset}, +{len}) exceeds the source"),
            )
        })?;
        let dst = self.slot_range(slot, len)?;
        let src_gpu = Gpu::of_stream(self.stream);
        copy_device_async(dst, &self.outbox.gpu, src, &src_gpu, self.stream)?;
        self.event(slot)?.record(self.stream)
    }

    fn reclaim(&mut self, slot: usize) -> Result<(), CudaChannelError> {
        self.event(slot)?.wait_on(self.stream)
    }
}

/// The sending end of a `cuda_ipc` channel.
#[derive(Debug)]
pub struct CudaIpcSender<C> {
    channel: C,
    outbox: Outbox,
    peer_has_outbox: bool,
}

impl<C: ByteChannel> CudaIpcSender<C> {
    /// A sender with a `slots × slot_len` outbox on `gpu` (TensorPipe: [`DEFAULT_SLOTS`] ×
    /// [`DEFAULT_SLOT_LEN`]), talking to the receiver over `channel`.
    pub fn new(
        gpu: &Gpu,
        channel: C,
        slots: usize,
        slot_len: usize,
    ) -> Result<Self, CudaChannelError> {
        Ok(CudaIpcSender {
            channel,
            outbox: Outbox::new(gpu, slots, slot_len)?,
            peer_has_outbox: false,
        })
    }

    /// Sends `src`, produced by work on `stream`, a stream of the outbox's device (`src`
    /// itself may live on another device with peer access). Returns when the receiver has
    /// acknowledged every chunk; `stream` is then ordered after the receiver's copies, so the source may be
    /// reused by later work on it.
    pub fn send(
        &mut self,
        src: DeviceRange<'_>,
        stream: &CudaStream,
    ) -> Result<(), CudaChannelError> {
        self.outbox.gpu.check_stream(stream)?;
        let total = src.len();
        let mut side = BoundOutbox {
            outbox: &self.outbox,
            src,
            stream,
        };
        send_ipc(
            &mut side,
            &mut self.peer_has_outbox,
            total,
            &mut self.channel,
        )
    }
}

/// A peer's outbox opened in this process.
#[derive(Debug)]
struct OpenedOutbox {
    key: (u32, u64),
    slots: usize,
    slot_len: u64,
    events: Vec<RawEvent>,
    /// Closed after the copies out of it completed (`Drop` waits for the events first).
    mapping: IpcMapping,
}

impl Drop for OpenedOutbox {
    fn drop(&mut self) {
        for event in &self.events {
            let _ = event.synchronize();
        }
    }
}

/// The receiving end of a `cuda_ipc` channel.
#[derive(Debug)]
pub struct CudaIpcReceiver<C> {
    channel: C,
    gpu: Gpu,
    opened: Option<OpenedOutbox>,
}

impl<C: ByteChannel> CudaIpcReceiver<C> {
    /// A receiver on `gpu`, talking to the sender over `channel`.
    pub fn new(gpu: &Gpu, channel: C) -> Self {
        CudaIpcReceiver {
            channel,
            gpu: gpu.clone(),
            opened: None,
        }
    }

    /// Receives a transfer into `dst` (its length must equal the sender's), copying on
    /// `stream`, a stream of this receiver's device; `dst` is ready once `stream` has passed the returned point.
    pub fn recv(
        &mut self,
        dst: DeviceRange<'_>,
        stream: &CudaStream,
    ) -> Result<(), CudaChannelError> {
        self.gpu.check_stream(stream)?;
        let total = dst.len();
        let mut side = BoundInbox {
            gpu: &self.gpu,
            opened: &mut self.opened,
            dst,
            stream,
        };
        recv_ipc(&mut side, total, &mut self.channel)
    }
}

struct BoundInbox<'r, 's, 'd> {
    gpu: &'r Gpu,
    opened: &'r mut Option<OpenedOutbox>,
    dst: DeviceRange<'d>,
    stream: &'s CudaStream,
}

fn open_outbox(gpu: &Gpu, info: &OutboxInfo) -> Result<OpenedOutbox, CudaChannelError> {
    let mapping = IpcMapping::open(gpu, &info.mem_handle)?;
    // Never trust the peer's geometry: the mapping must hold every slot.
    let needed = (info.slot_count as u64).checked_mul(info.slot_len);
    let available = mapping.len() as u64;
    if needed.is_none_or(|n| n > available) {
        return Err(CudaChannelError::protocol(
            "cuda_ipc outbox",
            format!(
                "{} slots of {} bytes announced, {available} bytes mapped",
                info.slot_count, info.slot_len
            ),
        ));
    }
    let events = info
        .event_handles
        .iter()
        .map(|handle| RawEvent::open_ipc(gpu, handle))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(OpenedOutbox {
        key: (info.pid, info.outbox_id),
        slots: info.slot_count as usize,
        slot_len: info.slot_len,
        events,
        mapping,
    })
}

impl InboxSide for BoundInbox<'_, '_, '_> {
    fn open(&mut self, info: &OutboxInfo) -> Result<(), CudaChannelError> {
        if self
            .opened
            .as_ref()
            .is_some_and(|o| o.key == (info.pid, info.outbox_id))
        {
            return Ok(());
        }
        // Close a previous outbox before opening the new one.
        *self.opened = None;
        *self.opened = Some(open_outbox(self.gpu, info)?);
        Ok(())
    }

    fn geometry(&self) -> Option<(usize, u64)> {
        self.opened.as_ref().map(|o| (o.slots, o.slot_len))
    }

    fn drain(&mut self, slot: usize, offset: usize, len: usize) -> Result<(), CudaChannelError> {
        let opened = self
            .opened
            .as_ref()
            .ok_or_else(|| malformed("chunk before the outbox was described".to_owned()))?;
        let event = opened
            .events
            .get(slot)
            .ok_or_else(|| malformed(format!("no slot {slot}")))?;
        // `open_outbox` checked that the mapping holds `slots × slot_len` bytes, and
        // `recv_ipc` that `slot < slots` and `len <= slot_len`; the mapping stays open
        // while `self.opened` holds it, and the sender does not refill the slot before our
        // acknowledgement, which follows the event recorded below.
        let src = (slot as u64)
            .checked_mul(opened.slot_len)
            .and_then(|start| usize::try_from(start).ok())
            .and_then(|start| opened.mapping.source().slice(start, len))
            .ok_or_else(|| malformed(format!("slot {slot} overflows")))?;
        let dst = self
            .dst
            .slice(offset, len)
            .ok_or_else(|| malformed(format!("[{offset}, +{len}) exceeds the receiving tensor")))?;
        event.wait_on(self.stream)?;
        copy_device_async(dst, self.gpu, src, self.gpu, self.stream)?;
        event.record(self.stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::byte_channel::StreamChannel;
    use proptest::prelude::*;
    use std::os::unix::net::UnixStream;
    use std::sync::{Arc, Mutex};

    fn info(slots: u32, slot_len: u64) -> OutboxInfo {
        OutboxInfo {
            pid: 4242,
            outbox_id: 7,
            slot_count: slots,
            slot_len,
            mem_handle: [0xAB; HANDLE_LEN],
            event_handles: (0..slots).map(|i| [i as u8; HANDLE_LEN]).collect(),
        }
    }

    #[test]
    fn messages_round_trip() {
        let messages = [
            IpcMessage::Header { total: 64 << 20 },
            IpcMessage::Chunk {
                slot: 3,
                offset: 24 << 20,
                len: 8 << 20,
                outbox: None,
            },
            IpcMessage::Chunk {
                slot: 0,
                offset: 0,
                len: 1,
                outbox: Some(Box::new(info(4, 8 << 20))),
            },
            IpcMessage::Ack { slot: 2 },
        ];
        for message in messages {
            let bytes = message.encode();
            assert_eq!(
                IpcMessage::decode(&bytes).expect("valid"),
                Some((message.clone(), bytes.len()))
            );
            for cut in 0..bytes.len() {
                assert_eq!(
                    IpcMessage::decode(&bytes[..cut]).expect("prefix"),
                    None,
                    "cut {cut}"
                );
            }
            let (a, b) = UnixStream::pair().expect("socketpair");
            StreamChannel::new(a).send_bytes(&bytes).expect("send");
            assert_eq!(
                IpcMessage::read_from(&mut StreamChannel::new(b)).expect("read"),
                message
            );
        }
    }

    #[test]
    fn hostile_messages_are_refused() {
        assert!(IpcMessage::decode(&[0x99]).is_err());
        let mut header = IpcMessage::Header { total: 1 }.encode();
        header[1] = b'X';
        assert!(IpcMessage::decode(&header).is_err());
        let mut chunk = IpcMessage::Chunk {
            slot: 0,
            offset: 0,
            len: 1,
            outbox: None,
        }
        .encode();
        chunk[1] = 0x80;
        assert!(IpcMessage::decode(&chunk).is_err(), "unknown flag");
        // An outbox claiming too many slots is refused before its handles are read.
        let mut big = IpcMessage::Chunk {
            slot: 0,
            offset: 0,
            len: 1,
            outbox: Some(Box::new(info(1, 8))),
        }
        .encode();
        let count_at = CHUNK_FIXED_LEN + 4 + 8;
        big[count_at..count_at + 4].copy_from_slice(&(MAX_SLOTS as u32 + 1).to_le_bytes());
        assert!(IpcMessage::decode(&big).is_err());
        let (a, b) = UnixStream::pair().expect("socketpair");
        StreamChannel::new(a).send_bytes(&big).expect("send");
        let err = IpcMessage::read_from(&mut StreamChannel::new(b)).expect_err("refused");
        assert!(
            err.to_string().starts_with("malformed cuda_ipc message"),
            "{err}"
        );
        let zero_len = IpcMessage::Chunk {
            slot: 0,
            offset: 0,
            len: 1,
            outbox: Some(Box::new(info(1, 0))),
        }
        .encode();
        assert!(IpcMessage::decode(&zero_len).is_err());
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = IpcMessage::decode(&bytes);
        }
    }

    /// Host-memory outbox shared by the fake sender and receiver, with per-slot state that
    /// catches a slot refilled before its acknowledgement.
    #[derive(Default)]
    struct SharedOutbox {
        slots: Vec<Vec<u8>>,
        filled_unacked: Vec<bool>,
    }

    struct FakeOutbox {
        info: OutboxInfo,
        shared: Arc<Mutex<SharedOutbox>>,
        src: Vec<u8>,
        reclaims: usize,
    }

    impl OutboxSide for FakeOutbox {
        fn info(&self) -> &OutboxInfo {
            &self.info
        }
        fn fill(&mut self, slot: usize, offset: usize, len: usize) -> Result<(), CudaChannelError> {
            let mut shared = self.shared.lock().expect("lock");
            assert!(
                !shared.filled_unacked[slot],
                "slot {slot} refilled before its ack"
            );
            shared.slots[slot][..len].copy_from_slice(&self.src[offset..offset + len]);
            shared.filled_unacked[slot] = true;
            Ok(())
        }
        fn reclaim(&mut self, _slot: usize) -> Result<(), CudaChannelError> {
            self.reclaims += 1;
            Ok(())
        }
    }

    struct FakeInbox {
        shared: Arc<Mutex<SharedOutbox>>,
        opened: Option<OutboxInfo>,
        opens: usize,
        dst: Vec<u8>,
    }

    impl InboxSide for FakeInbox {
        fn open(&mut self, info: &OutboxInfo) -> Result<(), CudaChannelError> {
            self.opens += 1;
            self.opened = Some(info.clone());
            Ok(())
        }
        fn geometry(&self) -> Option<(usize, u64)> {
            self.opened
                .as_ref()
                .map(|i| (i.slot_count as usize, i.slot_len))
        }
        fn drain(
            &mut self,
            slot: usize,
            offset: usize,
            len: usize,
        ) -> Result<(), CudaChannelError> {
            let mut shared = self.shared.lock().expect("lock");
            assert!(
                shared.filled_unacked[slot],
                "slot {slot} drained before it was filled"
            );
            self.dst[offset..offset + len].copy_from_slice(&shared.slots[slot][..len]);
            shared.filled_unacked[slot] = false;
            Ok(())
        }
    }

    /// Runs several transfers over one connection; returns what arrived, and the number of
    /// outbox opens.
    fn transfers(payloads: Vec<Vec<u8>>, slots: u32, slot_len: u64) -> (Vec<Vec<u8>>, usize) {
        let shared = Arc::new(Mutex::new(SharedOutbox {
            slots: vec![vec![0; slot_len as usize]; slots as usize],
            filled_unacked: vec![false; slots as usize],
        }));
        let (a, b) = UnixStream::pair().expect("socketpair");
        let lens: Vec<usize> = payloads.iter().map(Vec::len).collect();
        let sender_shared = Arc::clone(&shared);
        let sender = std::thread::spawn(move || {
            let mut channel = StreamChannel::new(a);
            let mut peer_has_outbox = false;
            for src in payloads {
                let total = src.len();
                let mut side = FakeOutbox {
                    info: info(slots, slot_len),
                    shared: Arc::clone(&sender_shared),
                    src,
                    reclaims: 0,
                };
                send_ipc(&mut side, &mut peer_has_outbox, total, &mut channel).expect("send");
                assert_eq!(
                    side.reclaims,
                    total.div_ceil(slot_len as usize),
                    "every slot use is reclaimed"
                );
            }
        });
        let mut channel = StreamChannel::new(b);
        let mut inbox = FakeInbox {
            shared,
            opened: None,
            opens: 0,
            dst: Vec::new(),
        };
        let mut received = Vec::new();
        for len in lens {
            inbox.dst = vec![0; len];
            recv_ipc(&mut inbox, len, &mut channel).expect("recv");
            received.push(std::mem::take(&mut inbox.dst));
        }
        sender.join().expect("sender thread");
        (received, inbox.opens)
    }

    #[test]
    fn outbox_is_described_once_per_connection() {
        let payloads: Vec<Vec<u8>> = [0usize, 1, 100, 4096, 10_000]
            .iter()
            .map(|&n| (0..n).map(|i| (i % 253) as u8).collect())
            .collect();
        let (received, opens) = transfers(payloads.clone(), 4, 1000);
        assert_eq!(received, payloads);
        assert_eq!(opens, 1);
    }

    #[test]
    fn receiver_refuses_out_of_order_chunks() {
        let (a, b) = UnixStream::pair().expect("socketpair");
        let mut tx = StreamChannel::new(a);
        tx.send_bytes(&IpcMessage::Header { total: 10 }.encode())
            .expect("send");
        tx.send_bytes(
            &IpcMessage::Chunk {
                slot: 0,
                offset: 4,
                len: 6,
                outbox: Some(Box::new(info(2, 8))),
            }
            .encode(),
        )
        .expect("send");
        let shared = Arc::new(Mutex::new(SharedOutbox::default()));
        let mut inbox = FakeInbox {
            shared,
            opened: None,
            opens: 0,
            dst: vec![0; 10],
        };
        let err = recv_ipc(&mut inbox, 10, &mut StreamChannel::new(b)).expect_err("gap");
        assert!(err.to_string().contains("does not continue at 0"), "{err}");
    }

    #[test]
    fn receiver_refuses_chunks_before_the_outbox() {
        let (a, b) = UnixStream::pair().expect("socketpair");
        let mut tx = StreamChannel::new(a);
        tx.send_bytes(&IpcMessage::Header { total: 1 }.encode())
            .expect("send");
        tx.send_bytes(
            &IpcMessage::Chunk {
                slot: 0,
                offset: 0,
                len: 1,
                outbox: None,
            }
            .encode(),
        )
        .expect("send");
        let shared = Arc::new(Mutex::new(SharedOutbox::default()));
        let mut inbox = FakeInbox {
            shared,
            opened: None,
            opens: 0,
            dst: vec![0; 1],
        };
        let err = recv_ipc(&mut inbox, 1, &mut StreamChannel::new(b)).expect_err("no outbox");
        assert!(err.to_string().contains("before the outbox"), "{err}");
    }

    #[test]
    fn length_mismatch() {
        let (a, b) = UnixStream::pair().expect("socketpair");
        StreamChannel::new(a)
            .send_bytes(&IpcMessage::Header { total: 5 }.encode())
            .expect("send");
        let shared = Arc::new(Mutex::new(SharedOutbox::default()));
        let mut inbox = FakeInbox {
            shared,
            opened: None,
            opens: 0,
            dst: vec![0; 6],
        };
        let err = recv_ipc(&mut inbox, 6, &mut StreamChannel::new(b)).expect_err("mismatch");
        assert!(matches!(
            err,
            CudaChannelError::LengthMismatch {
                sent: 5,
                expected: 6
            }
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn any_geometry_moves_any_bytes(
            payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..3000), 1..4),
            slots in 1u32..5, slot_len in 1u64..600,
        ) {
            let (received, opens) = transfers(payloads.clone(), slots, slot_len);
            prop_assert_eq!(received, payloads.clone());
            let any_bytes = payloads.iter().any(|p| !p.is_empty());
            prop_assert_eq!(opens, usize::from(any_bytes));
        }
    }
}
