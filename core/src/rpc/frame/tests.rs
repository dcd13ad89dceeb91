use alloc::string::ToString;
use alloc::vec;
use alloc::vec::Vec;

use proptest::prelude::*;

use super::*;
use crate::device::{Device, DeviceType};
use crate::negotiate::ChannelKind;
use crate::negotiate::{accept_answer, answer_brochure, DeviceDescriptors, Offer, TransportKind};
use crate::rpc::name::WorkerId;

fn cpu_basic(len: u64) -> TensorDescriptor {
    TensorDescriptor {
        source: Device::CPU,
        target: Device::CPU,
        channel: ChannelKind::Basic,
        len,
        channel_descriptor_len: 0,
    }
}

fn cuda_ipc(len: u64) -> TensorDescriptor {
    TensorDescriptor {
        source: Device::cuda(0),
        target: Device::cuda(1),
        channel: ChannelKind::CudaIpc,
        len,
        channel_descriptor_len: 0,
    }
}

fn cpu_cma(len: u64, descriptor_len: u8) -> TensorDescriptor {
    TensorDescriptor {
        source: Device::CPU,
        target: Device::CPU,
        channel: ChannelKind::Cma,
        len,
        channel_descriptor_len: descriptor_len,
    }
}

fn encode(frame: &OutgoingFrame<'_>) -> Vec<u8> {
    let mut out = Vec::new();
    frame.encode_to_vec(&mut out).unwrap();
    out
}

fn decode(bytes: &[u8]) -> Frame<'_> {
    match decode_frame(bytes, &FrameLimits::DEFAULT).unwrap() {
        Decoded::Complete(frame, used) => {
            assert_eq!(used, bytes.len());
            frame
        }
        Decoded::Partial(n) => panic!("partial, {n} more"),
    }
}

#[test]
fn header_layout_is_fixed_little_endian() {
    let frame = OutgoingFrame::request(0x0102_0304_0506_0708, "add", b"md", b"payload");
    let bytes = encode(&frame);
    let expected_head: [u8; HEADER_LEN] = [
        b'R', b'Z', b'R', b'P', 1, 2, 0, 0, // magic, version, kind, flags
        8, 7, 6, 5, 4, 3, 2, 1, // message id
        3, 0, 0, 0, // handler name length
        2, 0, 0, 0, // metadata length
        7, 0, 0, 0, 0, 0, 0, 0, // payload length
        0, 0, 0, 0, // tensor count
        0, 0, 0, 0, // reserved
    ];
    assert_eq!(bytes.get(..HEADER_LEN), Some(&expected_head[..]));
    assert_eq!(bytes.get(HEADER_LEN..), Some(&b"addmdpayload"[..]));
    assert_eq!(frame.encoded_len(), bytes.len());
}

#[test]
fn descriptor_layout() {
    let t = TensorDescriptor {
        source: Device::cuda(3),
        target: Device::CPU,
        channel: ChannelKind::CudaBasic,
        len: 0x1122,
        channel_descriptor_len: 0x33,
    };
    assert_eq!(
        t.to_bytes(),
        [1, 1, 3, 0, 0, 0, 7, 0x33, 0x22, 0x11, 0, 0, 0, 0, 0, 0]
    );
    assert_eq!(TensorDescriptor::from_bytes(&t.to_bytes(), 0), Ok(t));
    let current = TensorDescriptor {
        source: Device::cuda_current(),
        target: Device::cuda(255),
        channel: ChannelKind::CudaXth,
        len: 0,
        channel_descriptor_len: 0,
    };
    assert_eq!(
        TensorDescriptor::from_bytes(&current.to_bytes(), 0),
        Ok(current)
    );
}

#[test]
fn request_with_inline_and_out_of_band_tensors_round_trips() {
    let tensors = [
        cpu_basic(3),
        cuda_ipc(1 << 20),
        cpu_basic(2),
        cpu_cma(1 << 30, 4),
    ];
    let data: [&[u8]; 4] = [b"abc", b"", b"de", b"CMA!"];
    let frame =
        OutgoingFrame::request(7, "my_fn", b"meta", b"pickle").with_tensors(&tensors, &data);
    let bytes = encode(&frame);
    assert_eq!(
        bytes.len(),
        HEADER_LEN + 4 * DESCRIPTOR_LEN + 5 + 4 + 6 + 5 + 4
    );
    // Out-of-band data is announced (by its channel's descriptor), not carried.
    assert!(bytes.ends_with(b"pickleabcdeCMA!"));
    let decoded = decode(&bytes);
    assert_eq!(decoded.kind(), FrameKind::Request);
    assert_eq!(decoded.message_id(), 7);
    assert_eq!(decoded.handler(), "my_fn");
    assert_eq!(decoded.metadata(), b"meta");
    assert_eq!(decoded.payload(), b"pickle");
    assert_eq!(decoded.tensor_count(), 4);
    assert_eq!(decoded.tensors().collect::<Vec<_>>(), tensors.to_vec());
    let with_data: Vec<_> = decoded.tensors_with_data().map(|(_, d)| d).collect();
    assert_eq!(
        with_data,
        vec![
            TensorData::Inline(&b"abc"[..]),
            TensorData::Channel(&b""[..]),
            TensorData::Inline(&b"de"[..]),
            TensorData::Channel(&b"CMA!"[..]),
        ]
    );
    assert_eq!(with_data[3].inline(), None);
    assert_eq!(with_data[0].inline(), Some(&b"abc"[..]));
    assert_eq!(decoded.data_section(), b"abcdeCMA!");
    assert_eq!(decoded.as_bytes(), &bytes[..]);

    // Re-encoding the decoded frame gives the same bytes.
    let (mut t, mut i) = (Vec::new(), Vec::new());
    assert_eq!(encode(&decoded.to_outgoing(&mut t, &mut i)), bytes);

    // The head alone, for a vectored write.
    let mut head = [0u8; HEADER_LEN + 4 * DESCRIPTOR_LEN];
    assert_eq!(frame.encode_head(&mut head), Ok(head.len()));
    let mut gathered = head.to_vec();
    for part in frame.slices() {
        gathered.extend_from_slice(part);
    }
    assert_eq!(gathered, bytes);
}

#[test]
fn every_kind_round_trips() {
    let frames = [
        OutgoingFrame::response(3, b"m", b"result"),
        OutgoingFrame::error(4, "RPC ran for more than set timeout (10 ms)"),
        OutgoingFrame::goodbye(),
        OutgoingFrame {
            payload: b"x",
            ..OutgoingFrame::empty(FrameKind::Handshake, 0)
        },
        OutgoingFrame::request(u64::MAX, "", b"", b""),
        OutgoingFrame::ack(5),
    ];
    for frame in frames {
        let bytes = encode(&frame);
        let decoded = decode(&bytes);
        assert_eq!(decoded.kind(), frame.kind);
        assert_eq!(decoded.payload(), frame.payload);
    }
    let error = encode(&OutgoingFrame::error(4, "boom"));
    assert_eq!(decode(&error).error_message(), Some("boom"));
    assert_eq!(
        decode(&encode(&OutgoingFrame::goodbye())).error_message(),
        None
    );
    let ack = encode(&OutgoingFrame::ack(77));
    assert_eq!(ack.len(), HEADER_LEN);
    assert_eq!(ack[5], 6, "the ack's kind byte");
    assert_eq!(decode(&ack).message_id(), 77);
}

#[test]
fn encoders_refuse_what_decoders_reject() {
    let t = [cpu_basic(1)];
    let data: [&[u8]; 1] = [b"x"];
    let bad = [
        (
            OutgoingFrame::response(1, b"", b"").with_tensors(&t, &data),
            None,
        ),
        (
            OutgoingFrame {
                handler: "h",
                ..OutgoingFrame::response(1, b"", b"")
            },
            Some(FrameError::NotAllowed {
                kind: FrameKind::Response,
                field: FrameField::HandlerName,
            }),
        ),
        (
            OutgoingFrame::error(1, "e").with_tensors(&t, &data),
            Some(FrameError::NotAllowed {
                kind: FrameKind::Error,
                field: FrameField::Tensors,
            }),
        ),
        (
            OutgoingFrame {
                payload: b"x",
                ..OutgoingFrame::goodbye()
            },
            Some(FrameError::NotAllowed {
                kind: FrameKind::Goodbye,
                field: FrameField::Payload,
            }),
        ),
        (
            OutgoingFrame {
                payload: b"x",
                ..OutgoingFrame::ack(1)
            },
            Some(FrameError::NotAllowed {
                kind: FrameKind::Ack,
                field: FrameField::Payload,
            }),
        ),
        (
            OutgoingFrame::ack(1).with_tensors(&t, &data),
            Some(FrameError::NotAllowed {
                kind: FrameKind::Ack,
                field: FrameField::Tensors,
            }),
        ),
        (
            OutgoingFrame::empty(FrameKind::Handshake, 9),
            Some(FrameError::NotAllowed {
                kind: FrameKind::Handshake,
                field: FrameField::MessageId,
            }),
        ),
    ];
    for (frame, expected) in bad {
        let result = frame.header();
        match expected {
            Some(e) => assert_eq!(result, Err(EncodeError::Invalid(e))),
            None => assert!(result.is_ok(), "responses may carry tensors"),
        }
    }
    // Tensor data must match the descriptors: one slice per tensor, of its length.
    let two = [cpu_basic(1), cpu_basic(2)];
    let frame = OutgoingFrame::request(1, "f", b"", b"").with_tensors(&two, &data);
    assert_eq!(
        frame.header(),
        Err(EncodeError::DataCount {
            expected: 2,
            given: 1
        })
    );
    let wrong: [&[u8]; 2] = [b"x", b"xyz"];
    let frame = OutgoingFrame::request(1, "f", b"", b"").with_tensors(&two, &wrong);
    assert_eq!(
        frame.header(),
        Err(EncodeError::DataLength {
            tensor: 1,
            expected: 2,
            given: 3
        })
    );
    let extra: [&[u8]; 2] = [b"x", b"y"];
    let frame = OutgoingFrame::request(1, "f", b"", b"").with_tensors(&t, &extra);
    assert!(matches!(frame.header(), Err(EncodeError::DataCount { .. })));
    // A channel tensor's slice is its channel descriptor, of the announced length.
    let cma = [cpu_cma(1 << 20, 3)];
    let frame = OutgoingFrame::request(1, "f", b"", b"").with_tensors(&cma, &extra[..1]);
    assert_eq!(
        frame.header(),
        Err(EncodeError::DataLength {
            tensor: 0,
            expected: 3,
            given: 1
        })
    );
    // A basic tensor has no channel descriptor.
    let basic_with_descriptor = [TensorDescriptor {
        channel_descriptor_len: 1,
        ..cpu_basic(1)
    }];
    let frame =
        OutgoingFrame::request(1, "f", b"", b"").with_tensors(&basic_with_descriptor, &data);
    assert_eq!(
        frame.header(),
        Err(EncodeError::Invalid(FrameError::NonZeroReserved {
            offset: 7,
            tensor: Some(0)
        }))
    );
    // A CUDA channel cannot carry a tensor from the CPU (a CPU channel can: it carries
    // cuda_basic's staged copy).
    let mismatched = [TensorDescriptor {
        source: Device::CPU,
        ..cuda_ipc(1)
    }];
    let frame = OutgoingFrame::request(1, "f", b"", b"").with_tensors(&mismatched, &[b""]);
    assert!(matches!(
        frame.header(),
        Err(EncodeError::Invalid(FrameError::ChannelMismatch {
            tensor: 0,
            ..
        }))
    ));
    // Too small a buffer says how much is needed.
    let frame = OutgoingFrame::request(1, "f", b"meta", b"");
    let mut small = [0u8; 10];
    assert_eq!(
        frame.encode(&mut small),
        Err(EncodeError::InsufficientSize {
            needed: HEADER_LEN + 5,
            available: 10
        })
    );
    assert_eq!(
        frame.encode_head(&mut small),
        Err(EncodeError::InsufficientSize {
            needed: HEADER_LEN,
            available: 10
        })
    );
    let mut exact = [0u8; HEADER_LEN + 5];
    assert_eq!(frame.encode(&mut exact), Ok(HEADER_LEN + 5));
}

#[test]
fn partial_frames_say_how_much_is_missing() {
    let tensors = [cpu_basic(4)];
    let inline: [&[u8]; 1] = [b"data"];
    let bytes = encode(&OutgoingFrame::request(1, "f", b"m", b"p").with_tensors(&tensors, &inline));
    let limits = FrameLimits::DEFAULT;
    assert_eq!(decode_frame(&[], &limits), Ok(Decoded::Partial(HEADER_LEN)));
    assert_eq!(
        decode_frame(&bytes[..10], &limits),
        Ok(Decoded::Partial(HEADER_LEN - 10))
    );
    // Header known, descriptor not yet: at least up to the payload's end.
    let fixed = HEADER_LEN + DESCRIPTOR_LEN + 3;
    assert_eq!(
        decode_frame(&bytes[..HEADER_LEN], &limits),
        Ok(Decoded::Partial(fixed - HEADER_LEN))
    );
    // Descriptor known: the exact total.
    for cut in HEADER_LEN + DESCRIPTOR_LEN..bytes.len() {
        assert_eq!(
            decode_frame(&bytes[..cut], &limits),
            Ok(Decoded::Partial(bytes.len() - cut))
        );
    }
    // Bytes after the frame belong to the next one.
    let mut two = bytes.clone();
    two.extend_from_slice(&bytes);
    match decode_frame(&two, &limits) {
        Ok(Decoded::Complete(frame, used)) => {
            assert_eq!(used, bytes.len());
            assert_eq!(frame.as_bytes(), &bytes[..]);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_byte_at_a_time_through_the_resuming_decoder() {
    let tensors = [cpu_basic(2), cuda_ipc(9), cpu_basic(1), cpu_cma(9, 2)];
    let inline: [&[u8]; 4] = [b"ab", b"", b"c", b"de"];
    let bytes =
        encode(&OutgoingFrame::request(5, "fn", b"m", b"pl").with_tensors(&tensors, &inline));
    let mut decoder = FrameDecoder::new(FrameLimits::DEFAULT);
    for cut in 0..bytes.len() {
        let got = decoder.decode(&bytes[..cut]).unwrap();
        assert_eq!(
            got,
            decode_frame(&bytes[..cut], &FrameLimits::DEFAULT).unwrap()
        );
        assert!(!got.is_complete());
        assert_eq!(decoder.header().is_some(), cut >= HEADER_LEN);
    }
    let whole = decoder.decode(&bytes).unwrap();
    assert_eq!(whole, decode_frame(&bytes, &FrameLimits::DEFAULT).unwrap());
    assert!(whole.is_complete());
    // And it is ready for the next frame.
    assert!(decoder.header().is_none());
    assert!(decoder.decode(&bytes).unwrap().is_complete());
    decoder.reset();
}

type HeaderEdit = fn(&mut [u8; HEADER_LEN]);

fn header_bytes(edit: impl FnOnce(&mut [u8; HEADER_LEN])) -> [u8; HEADER_LEN] {
    let mut head = Header {
        kind: FrameKind::Request,
        message_id: 1,
        handler_len: 0,
        metadata_len: 0,
        payload_len: 0,
        tensor_count: 0,
    }
    .to_bytes();
    edit(&mut head);
    head
}

#[test]
fn bad_headers_are_rejected_early() {
    let limits = FrameLimits::DEFAULT;
    assert_eq!(decode_frame(b"GET ", &limits), Err(FrameError::BadMagic));
    assert_eq!(decode_frame(b"X", &limits), Err(FrameError::BadMagic));
    assert_eq!(decode_frame(b"RZ", &limits), Ok(Decoded::Partial(38)));
    let cases: [(HeaderEdit, FrameError); 6] = [
        (|h| h[4] = 2, FrameError::UnsupportedVersion { version: 2 }),
        (|h| h[5] = 0, FrameError::UnknownKind { byte: 0 }),
        (|h| h[5] = 7, FrameError::UnknownKind { byte: 7 }),
        (
            |h| h[7] = 1,
            FrameError::NonZeroReserved {
                offset: 6,
                tensor: None,
            },
        ),
        (
            |h| h[39] = 1,
            FrameError::NonZeroReserved {
                offset: 36,
                tensor: None,
            },
        ),
        (
            |h| h[5] = FrameKind::Goodbye.to_byte(),
            FrameError::NotAllowed {
                kind: FrameKind::Goodbye,
                field: FrameField::MessageId,
            },
        ),
    ];
    for (edit, expected) in cases {
        let head = header_bytes(edit);
        assert_eq!(decode_frame(&head, &limits), Err(expected));
        // The error is reported as soon as the field is complete.
        let field_end = match expected {
            FrameError::UnsupportedVersion { .. } => 5,
            FrameError::UnknownKind { .. } => 6,
            FrameError::NonZeroReserved { offset: 6, .. } => 8,
            FrameError::NotAllowed { .. } => 16,
            _ => HEADER_LEN,
        };
        assert_eq!(decode_frame(&head[..field_end], &limits), Err(expected));
        assert!(decode_frame(&head[..field_end - 1], &limits).is_ok());
    }
}

#[test]
fn limits_are_checked_from_the_header() {
    let limits = FrameLimits::DEFAULT;
    // A 4 GiB payload claim is rejected from the header alone.
    let head = header_bytes(|h| h[24..32].copy_from_slice(&(4u64 << 30).to_le_bytes()));
    assert_eq!(
        decode_frame(&head[..32], &limits),
        Err(FrameError::OverLimit {
            field: FrameField::Payload,
            claimed: 4 << 30,
            limit: 1 << 30
        })
    );
    let head = header_bytes(|h| h[16..20].copy_from_slice(&2000u32.to_le_bytes()));
    assert!(matches!(
        decode_frame(&head, &limits),
        Err(FrameError::OverLimit {
            field: FrameField::HandlerName,
            ..
        })
    ));
    let head = header_bytes(|h| h[20..24].copy_from_slice(&u32::MAX.to_le_bytes()));
    assert!(matches!(
        decode_frame(&head, &limits),
        Err(FrameError::OverLimit {
            field: FrameField::Metadata,
            ..
        })
    ));
    let head = header_bytes(|h| h[32..36].copy_from_slice(&u32::MAX.to_le_bytes()));
    assert!(matches!(
        decode_frame(&head, &limits),
        Err(FrameError::OverLimit {
            field: FrameField::Tensors,
            ..
        })
    ));
    // Equal to the limit is fine.
    let tight = FrameLimits::DEFAULT.with_max_payload(3);
    let bytes = encode(&OutgoingFrame::request(1, "", b"", b"abc"));
    assert!(decode_frame(&bytes, &tight).unwrap().is_complete());
    assert!(decode_frame(&bytes, &tight.with_max_payload(2)).is_err());

    // Per-tensor and inline limits are checked per descriptor as it arrives.
    let tensors = [cpu_basic(3), cpu_basic(3)];
    let inline: [&[u8]; 2] = [b"abc", b"def"];
    let bytes = encode(&OutgoingFrame::request(1, "", b"", b"").with_tensors(&tensors, &inline));
    let inline_limit = FrameLimits::DEFAULT.with_max_inline_bytes(5);
    assert_eq!(
        decode_frame(&bytes[..HEADER_LEN + 2 * DESCRIPTOR_LEN], &inline_limit),
        Err(FrameError::OverLimit {
            field: FrameField::InlineBytes,
            claimed: 6,
            limit: 5
        })
    );
    assert!(decode_frame(&bytes[..HEADER_LEN + DESCRIPTOR_LEN], &inline_limit).is_ok());
    let tensor_limit = FrameLimits::DEFAULT.with_max_tensor_bytes(2);
    assert_eq!(
        decode_frame(&bytes, &tensor_limit),
        Err(FrameError::OverLimit {
            field: FrameField::TensorBytes,
            claimed: 3,
            limit: 2
        })
    );
    assert!(matches!(
        decode_frame(&bytes, &FrameLimits::HANDSHAKE),
        Err(FrameError::OverLimit { .. })
    ));
    // An out-of-band tensor larger than memory is fine: it is not in the frame.
    let huge = [TensorDescriptor {
        len: u64::MAX,
        ..cuda_ipc(0)
    }];
    let bytes = encode(&OutgoingFrame::request(1, "", b"", b"").with_tensors(&huge, &[b""]));
    assert!(decode_frame(&bytes, &FrameLimits::UNLIMITED)
        .unwrap()
        .is_complete());
    // Channel descriptors count towards the data section and have their own limit.
    let tensors = [cpu_cma(1 << 30, 4), cpu_basic(2)];
    let data: [&[u8]; 2] = [b"desc", b"ab"];
    let bytes = encode(&OutgoingFrame::request(1, "", b"", b"").with_tensors(&tensors, &data));
    assert!(decode_frame(&bytes, &FrameLimits::DEFAULT)
        .unwrap()
        .is_complete());
    assert_eq!(
        decode_frame(&bytes, &FrameLimits::DEFAULT.with_max_channel_descriptor(3)),
        Err(FrameError::OverLimit {
            field: FrameField::ChannelDescriptor,
            claimed: 4,
            limit: 3
        })
    );
    assert_eq!(
        decode_frame(&bytes, &FrameLimits::DEFAULT.with_max_inline_bytes(5)),
        Err(FrameError::OverLimit {
            field: FrameField::InlineBytes,
            claimed: 6,
            limit: 5
        })
    );
    assert!(
        decode_frame(&bytes, &FrameLimits::DEFAULT.with_max_inline_bytes(6))
            .unwrap()
            .is_complete()
    );
    // An inline one is not.
    let huge_inline = [cpu_basic(u64::MAX)];
    let mut bytes = header_bytes(|h| h[32..36].copy_from_slice(&1u32.to_le_bytes())).to_vec();
    bytes.extend_from_slice(&huge_inline[0].to_bytes());
    assert!(matches!(
        decode_frame(&bytes, &FrameLimits::UNLIMITED),
        Err(FrameError::TooLarge { .. })
    ));
}

#[test]
fn bad_descriptors() {
    let limits = FrameLimits::DEFAULT;
    let with_descriptor = |d: [u8; DESCRIPTOR_LEN]| {
        let mut bytes = header_bytes(|h| h[32..36].copy_from_slice(&1u32.to_le_bytes())).to_vec();
        bytes.extend_from_slice(&d);
        decode_frame(&bytes, &limits).map(|d| d.is_complete())
    };
    let good = cpu_basic(0).to_bytes();
    assert!(with_descriptor(good).is_ok());
    let edits: [(usize, u8, FrameError); 7] = [
        (0, 2, FrameError::InvalidDevice { tensor: 0 }),
        (1, 2, FrameError::InvalidDevice { tensor: 0 }),
        (2, 1, FrameError::InvalidDevice { tensor: 0 }), // index without the flag
        (4, 1, FrameError::InvalidDevice { tensor: 0 }), // fine flag...
        (6, 8, FrameError::UnknownChannel { tensor: 0, byte: 8 }),
        (
            7,
            1,
            FrameError::NonZeroReserved {
                offset: 7,
                tensor: Some(0),
            },
        ),
        (
            6,
            ChannelKind::CudaIpc.index() as u8,
            FrameError::ChannelMismatch {
                tensor: 0,
                channel: ChannelKind::CudaIpc,
                source: DeviceType::Cpu,
                target: DeviceType::Cpu,
            },
        ),
    ];
    for (at, value, expected) in edits {
        let mut d = good;
        d[at] = value;
        if at == 4 {
            // cpu with an index: only 0 is valid.
            d[5] = 1;
        }
        assert_eq!(with_descriptor(d), Err(expected), "byte {at} = {value}");
    }
    let mut cpu0 = good;
    cpu0[1] = 1; // cpu:0 is a valid device
    assert!(with_descriptor(cpu0).is_ok());
    // Byte 7 is the channel descriptor length for other channels.
    let mut cma = good;
    cma[6] = ChannelKind::Cma.index() as u8;
    cma[7] = 200;
    assert_eq!(with_descriptor(cma), Ok(false));
}

#[test]
fn handler_names_must_be_utf8() {
    let mut bytes = encode(&OutgoingFrame::request(1, "ab", b"", b"xyz"));
    bytes[HEADER_LEN] = 0xff;
    // Reported as soon as the name is complete, before the payload arrives.
    assert_eq!(
        decode_frame(&bytes[..HEADER_LEN + 2], &FrameLimits::DEFAULT),
        Err(FrameError::HandlerNotUtf8)
    );
    assert!(decode_frame(&bytes[..HEADER_LEN + 1], &FrameLimits::DEFAULT).is_ok());
}

#[test]
fn error_messages_read_well() {
    let e = FrameError::OverLimit {
        field: FrameField::Payload,
        claimed: 10,
        limit: 5,
    };
    assert_eq!(
        e.to_string(),
        "Invalid RPC frame: payload of 10 is over the limit of 5"
    );
    assert_eq!(
        FrameError::NotAllowed {
            kind: FrameKind::Goodbye,
            field: FrameField::Payload
        }
        .to_string(),
        "Invalid RPC frame: a goodbye frame cannot carry a payload"
    );
    assert!(FrameError::BadMagic
        .to_string()
        .contains("not an rdzv RPC agent"));
}

fn offers() -> (Offer<'static>, Offer<'static>) {
    let build = |shm: &'static str| {
        let mut offer = Offer::new();
        offer.add_transport(TransportKind::Shm, 200, shm).unwrap();
        offer.add_transport(TransportKind::Tcp, 0, "tcp:*").unwrap();
        offer
            .add_channel(ChannelKind::Basic, 1000, DeviceDescriptors::cpu("any"))
            .unwrap();
        offer
            .add_channel(ChannelKind::CudaIpc, 300, DeviceDescriptors::cuda("boot-1"))
            .unwrap();
        offer
    };
    (build("shm:a"), build("shm:a"))
}

#[test]
fn the_handshake_round_trips_through_postcard() {
    let (listener, connector) = offers();
    let brochure = connector.brochure();
    let hello = Handshake::Hello {
        name: "worker1",
        id: WorkerId::from(1),
        brochure,
        lanes_token: 0x0123_4567_89ab_cdef,
        challenge: [7; 32],
    };
    let mut buf = [0u8; 512];
    let n = hello.encode(&mut buf).unwrap();
    assert_eq!(n, hello.encoded_len().unwrap());
    let frame = decode_frame(&buf[..n], &FrameLimits::HANDSHAKE)
        .unwrap()
        .complete()
        .unwrap();
    assert_eq!(frame.kind(), FrameKind::Handshake);
    let got = decode_handshake(&frame).unwrap();
    assert_eq!(got, hello);

    // The listener answers from what it decoded; the connector accepts.
    let Handshake::Hello {
        brochure: theirs, ..
    } = got
    else {
        panic!("not a hello")
    };
    let answer = answer_brochure(&listener, &theirs).unwrap();
    let reply = Handshake::Answer {
        name: "worker0",
        id: WorkerId::from(0),
        answer,
        challenge: [9; 32],
        proof: Some([3; 32]),
    };
    let mut out = Vec::new();
    reply.encode_to_vec(&mut out).unwrap();
    let frame = decode(&out);
    let Handshake::Answer {
        answer: received,
        name,
        id,
        challenge,
        proof,
    } = decode_handshake(&frame).unwrap()
    else {
        panic!("not an answer")
    };
    assert_eq!((name, id), ("worker0", WorkerId::from(0)));
    assert_eq!((challenge, proof), ([9; 32], Some([3; 32])));
    let agreed = accept_answer(&connector, &received).unwrap();
    assert_eq!(agreed.transport, TransportKind::Shm);

    let refused = Handshake::Refused {
        reason: "no common transport",
    };
    let mut out = Vec::new();
    refused.encode_to_vec(&mut out).unwrap();
    assert_eq!(decode_handshake(&decode(&out)), Ok(refused));
    // The connector's proof, and the listener's welcome.
    for message in [
        Handshake::Proof {
            proof: Some([5; 32]),
        },
        Handshake::Proof { proof: None },
        Handshake::Welcome,
    ] {
        let mut out = Vec::new();
        message.encode_to_vec(&mut out).unwrap();
        assert_eq!(decode_handshake(&decode(&out)), Ok(message));
    }

    // Too small a buffer says how much is needed.
    let mut small = [0u8; 8];
    assert!(matches!(
        hello.encode(&mut small),
        Err(EncodeError::InsufficientSize { needed, .. }) if needed == n
    ));
}

#[test]
fn bad_handshakes() {
    let request = encode(&OutgoingFrame::request(1, "f", b"", b""));
    assert_eq!(
        decode_handshake(&decode(&request)),
        Err(HandshakeError::NotAHandshake {
            kind: FrameKind::Request
        })
    );
    let garbage = encode(&OutgoingFrame {
        payload: &[0xff, 0xff, 0xff],
        ..OutgoingFrame::empty(FrameKind::Handshake, 0)
    });
    assert!(matches!(
        decode_handshake(&decode(&garbage)),
        Err(HandshakeError::Malformed(_))
    ));
    // A valid message followed by junk.
    let refused = Handshake::Refused { reason: "r" };
    let mut payload = Vec::new();
    refused.encode_to_vec(&mut payload).unwrap();
    let mut body = payload[HEADER_LEN..].to_vec();
    body.push(0);
    let trailing = encode(&OutgoingFrame {
        payload: &body,
        ..OutgoingFrame::empty(FrameKind::Handshake, 0)
    });
    assert_eq!(
        decode_handshake(&decode(&trailing)),
        Err(HandshakeError::TrailingBytes { count: 1 })
    );
    // An invalid worker name.
    let (_, connector) = offers();
    let bad = Handshake::Hello {
        name: "bad name",
        id: WorkerId::from(0),
        brochure: connector.brochure(),
        lanes_token: 0,
        challenge: [0; 32],
    };
    let mut out = Vec::new();
    bad.encode_to_vec(&mut out).unwrap();
    assert!(matches!(
        decode_handshake(&decode(&out)),
        Err(HandshakeError::InvalidName(_))
    ));
}

fn device() -> impl Strategy<Value = Device> {
    prop_oneof![
        Just(Device::CPU),
        Just(Device::cuda_current()),
        any::<u8>().prop_map(Device::cuda),
    ]
}

fn descriptor() -> impl Strategy<Value = TensorDescriptor> {
    (
        device(),
        device(),
        0usize..ChannelKind::COUNT,
        0u64..64,
        0u8..80,
    )
        .prop_filter_map(
            "channel must serve the devices",
            |(source, target, channel, len, descriptor_len)| {
                let channel = ChannelKind::ALL[channel];
                channel
                    .carries(source.kind(), target.kind())
                    .then_some(TensorDescriptor {
                        source,
                        target,
                        channel,
                        len,
                        channel_descriptor_len: if channel == ChannelKind::Basic {
                            0
                        } else {
                            descriptor_len
                        },
                    })
            },
        )
}

#[derive(Debug, Clone)]
struct Parts {
    kind: FrameKind,
    id: u64,
    handler: alloc::string::String,
    metadata: Vec<u8>,
    payload: Vec<u8>,
    tensors: Vec<TensorDescriptor>,
    inline: Vec<Vec<u8>>,
}

fn parts() -> impl Strategy<Value = Parts> {
    (
        proptest::sample::select(FrameKind::ALL.to_vec()),
        any::<u64>(),
        "\\PC{0,8}",
        proptest::collection::vec(any::<u8>(), 0..16),
        proptest::collection::vec(any::<u8>(), 0..64),
        proptest::collection::vec(descriptor(), 0..5),
        any::<u64>(),
    )
        .prop_map(|(kind, id, handler, metadata, payload, tensors, seed)| {
            let mut p = Parts {
                kind,
                id,
                handler,
                metadata,
                payload,
                tensors,
                inline: Vec::new(),
            };
            // Empty what the kind cannot carry.
            if !kind.allows(FrameField::MessageId) {
                p.id = 0;
            }
            if !kind.allows(FrameField::HandlerName) {
                p.handler.clear();
            }
            if !kind.allows(FrameField::Metadata) {
                p.metadata.clear();
            }
            if !kind.allows(FrameField::Payload) {
                p.payload.clear();
            }
            if !kind.allows(FrameField::Tensors) {
                p.tensors.clear();
            }
            p.inline = p
                .tensors
                .iter()
                .map(|t| {
                    (0..t.data_len())
                        .map(|i| (seed >> (i % 64)) as u8)
                        .collect()
                })
                .collect();
            p
        })
}

proptest! {
    #[test]
    fn encode_then_decode_is_identity(p in parts(), split in any::<prop::sample::Index>()) {
        let inline: Vec<&[u8]> = p.inline.iter().map(Vec::as_slice).collect();
        let frame = OutgoingFrame {
            kind: p.kind,
            message_id: p.id,
            handler: &p.handler,
            metadata: &p.metadata,
            payload: &p.payload,
            tensors: &p.tensors,
            tensor_data: &inline,
        };
        let bytes = encode(&frame);
        prop_assert_eq!(bytes.len(), frame.encoded_len());
        let mut buf = vec![0u8; bytes.len()];
        prop_assert_eq!(frame.encode(&mut buf), Ok(bytes.len()));
        prop_assert_eq!(&buf, &bytes);
        let decoded = decode(&bytes);
        prop_assert_eq!(decoded.kind(), p.kind);
        prop_assert_eq!(decoded.message_id(), p.id);
        prop_assert_eq!(decoded.handler(), p.handler.as_str());
        prop_assert_eq!(decoded.metadata(), &p.metadata[..]);
        prop_assert_eq!(decoded.payload(), &p.payload[..]);
        prop_assert_eq!(decoded.tensors().collect::<Vec<_>>(), p.tensors.clone());
        let data: Vec<&[u8]> = decoded.tensors_with_data().map(|(_, d)| d.bytes()).collect();
        prop_assert_eq!(data, inline.clone());
        for (tensor, entry) in decoded.tensors_with_data() {
            prop_assert_eq!(tensor.is_inline(), entry.inline().is_some());
        }

        // Split anywhere: the resuming decoder agrees with a one-shot decode.
        let cut = split.index(bytes.len() + 1);
        let mut decoder = FrameDecoder::new(FrameLimits::DEFAULT);
        let first = decoder.decode(&bytes[..cut]).unwrap();
        prop_assert_eq!(first, decode_frame(&bytes[..cut], &FrameLimits::DEFAULT).unwrap());
        prop_assert_eq!(first.is_complete(), cut == bytes.len());
        if let Decoded::Partial(n) = first {
            prop_assert!(cut + n <= bytes.len());
        }
        let second = decoder.decode(&bytes).unwrap();
        prop_assert_eq!(second, decode_frame(&bytes, &FrameLimits::DEFAULT).unwrap());
    }

    #[test]
    fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..256)) {
        crate::fuzzing::rpc_frame(&data);
    }
}
