use super::*;
use proptest::prelude::*;
use std::string::{String, ToString};
use std::vec::Vec;

use DeviceType::{Cpu, Cuda};

const SHM_HOST_A: &str = "shm:boot-a_4026531992";
const SHM_HOST_B: &str = "shm:boot-b_4026531992";

/// What PyTorch registers on a CUDA host by default, with the given per-host descriptors.
fn pytorch_like<'a>(shm: &'a str, host: &'a str) -> Offer<'a> {
    let mut offer = Offer::new();
    for (kind, priority) in Ranking::<TransportKind>::defaults().iter() {
        let descriptor = match kind {
            TransportKind::Shm => shm,
            TransportKind::Ibv => "ibv:*",
            _ => "tcp:*",
        };
        offer.add_transport(kind, priority, descriptor).unwrap();
    }
    for (kind, priority) in Ranking::<ChannelKind>::defaults().iter() {
        let descriptors = match kind {
            ChannelKind::Xth => continue,
            ChannelKind::Cma => DeviceDescriptors::cpu(host),
            ChannelKind::Mpt => DeviceDescriptors::cpu("16:tcp:*"),
            ChannelKind::Basic => DeviceDescriptors::cpu("any"),
            ChannelKind::CudaXth => continue,
            ChannelKind::CudaIpc => DeviceDescriptors::cuda(host),
            ChannelKind::CudaGdr => continue,
            _ => DeviceDescriptors::cpu("any").with(Cuda, "any"),
        };
        offer.add_channel(kind, priority, descriptors).unwrap();
    }
    offer
}

/// The full handshake; returns (listener's decision, connector's decision).
fn handshake(
    listener: &Offer<'_>,
    connector: &Offer<'_>,
) -> Result<(Negotiated, Negotiated), NegotiateError> {
    let brochure = connector.brochure();
    let answer = answer_brochure(listener, &brochure)?;
    let accepted = accept_answer(connector, &answer)?;
    Ok((answer.negotiated(), accepted))
}

#[test]
fn same_host_uses_shm_cma_and_cuda_ipc() {
    let a = pytorch_like(SHM_HOST_A, "host-a");
    let b = pytorch_like(SHM_HOST_A, "host-a");
    let (decided, accepted) = handshake(&a, &b).unwrap();
    assert_eq!(decided, accepted);
    assert_eq!(decided.transport, TransportKind::Shm);
    assert_eq!(decided.channels.get(Cpu, Cpu), Some(ChannelKind::Cma));
    assert_eq!(decided.channels.get(Cuda, Cuda), Some(ChannelKind::CudaIpc));
    assert_eq!(
        decided.channels.get(Cpu, Cuda),
        Some(ChannelKind::CudaBasic)
    );
    assert_eq!(
        decided.channels.get(Cuda, Cpu),
        Some(ChannelKind::CudaBasic)
    );
    assert_eq!(
        decided.channels_in_use().collect::<Vec<_>>(),
        [
            ChannelKind::Cma,
            ChannelKind::CudaIpc,
            ChannelKind::CudaBasic
        ]
    );
}

#[test]
fn different_hosts_fall_back_to_ibv_mpt_and_cuda_basic() {
    let a = pytorch_like(SHM_HOST_A, "host-a");
    let b = pytorch_like(SHM_HOST_B, "host-b");
    let (decided, accepted) = handshake(&a, &b).unwrap();
    assert_eq!(decided, accepted);
    assert_eq!(decided.transport, TransportKind::Ibv);
    assert_eq!(decided.channels.get(Cpu, Cpu), Some(ChannelKind::Mpt));
    assert_eq!(
        decided.channels.get(Cuda, Cuda),
        Some(ChannelKind::CudaBasic)
    );
    assert_eq!(
        decided.channel_for(Role::Connector, Cuda, Cpu),
        decided.channels.get(Cpu, Cuda)
    );
}

#[test]
fn no_common_transport_names_both_offers() {
    let mut listener = Offer::new();
    listener
        .add_transport(TransportKind::Shm, 200, SHM_HOST_A)
        .unwrap();
    listener
        .add_transport(TransportKind::Tcp, 0, "tcp:*")
        .unwrap();
    let mut connector = Offer::new();
    connector
        .add_transport(TransportKind::Shm, 200, SHM_HOST_B)
        .unwrap();
    connector
        .add_transport(TransportKind::Ibv, 100, "ibv:*")
        .unwrap();
    let err = answer_brochure(&listener, &connector.brochure()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "No common transport: the listener offers [shm, tcp] and the connector offers \
         [shm, ibv]; both offer [shm] but with different domain descriptors (e.g. \
         different hosts for shm)"
    );
    let err = answer_brochure(&Offer::new(), &Brochure::new()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "No common transport: the listener offers [] and the connector offers []"
    );
}

#[test]
fn the_listeners_transport_priorities_decide() {
    // Listener: `transports=["tcp", "shm"]`; connector: defaults (shm first).
    let order = Ranking::<TransportKind>::from_names(&["tcp", "shm"]).unwrap();
    let mut listener = Offer::new();
    for (kind, priority) in order.iter() {
        let d = if kind == TransportKind::Shm {
            SHM_HOST_A
        } else {
            "tcp:*"
        };
        listener.add_transport(kind, priority, d).unwrap();
    }
    let connector = pytorch_like(SHM_HOST_A, "host-a");
    let (decided, accepted) = handshake(&listener, &connector).unwrap();
    assert_eq!(decided.transport, TransportKind::Tcp);
    assert_eq!(accepted.transport, TransportKind::Tcp);
    // Reversed roles: the default-ranked listener picks shm.
    let (decided, _) = handshake(&connector, &listener).unwrap();
    assert_eq!(decided.transport, TransportKind::Shm);
}

#[test]
fn conflicting_channel_priorities_are_refused_by_the_connector() {
    let mut listener = Offer::new();
    listener
        .add_transport(TransportKind::Tcp, 0, "tcp:*")
        .unwrap();
    let mut connector = listener.clone();
    for (kind, priority) in Ranking::<ChannelKind>::from_names(&["basic", "mpt"])
        .unwrap()
        .iter()
    {
        listener
            .add_channel(kind, priority, DeviceDescriptors::cpu("x"))
            .unwrap();
    }
    for (kind, priority) in Ranking::<ChannelKind>::from_names(&["mpt", "basic"])
        .unwrap()
        .iter()
    {
        connector
            .add_channel(kind, priority, DeviceDescriptors::cpu("x"))
            .unwrap();
    }
    let answer = answer_brochure(&listener, &connector.brochure()).unwrap();
    assert_eq!(answer.channels.get(Cpu, Cpu), Some(ChannelKind::Basic));
    let err = accept_answer(&connector, &answer).unwrap_err();
    assert_eq!(
        err,
        NegotiateError::InconsistentChannelSelection {
            listener_device: Cpu,
            connector_device: Cpu,
            listener_choice: Some(ChannelKind::Basic),
            connector_choice: Some(ChannelKind::Mpt),
        }
    );
    assert_eq!(
        err.to_string(),
        "Inconsistent channel selection: between cpu (listener) and cpu (connector) devices \
         the listener chose basic but the connector's priorities choose mpt; both sides must \
         rank shared channels in the same order"
    );
}

#[test]
fn a_forged_transport_is_refused() {
    let connector = pytorch_like(SHM_HOST_A, "host-a");
    let listener = pytorch_like(SHM_HOST_A, "host-a");
    let mut answer = answer_brochure(&listener, &connector.brochure()).unwrap();
    answer.transport.domain_descriptor = SHM_HOST_B;
    let err = accept_answer(&connector, &answer).unwrap_err();
    assert_eq!(
        err.to_string(),
        "The two endpoints disagree on whether transport shm can be used to communicate"
    );
    let mut tcp_only = Offer::new();
    tcp_only
        .add_transport(TransportKind::Tcp, 0, "tcp:*")
        .unwrap();
    let answer = answer_brochure(&listener, &connector.brochure()).unwrap();
    assert_eq!(
        accept_answer(&tcp_only, &answer),
        Err(NegotiateError::TransportMismatch {
            transport: TransportKind::Shm
        })
    );
}

#[test]
fn a_forged_channel_choice_is_refused() {
    let connector = pytorch_like(SHM_HOST_A, "host-a");
    let listener = pytorch_like(SHM_HOST_A, "host-a");
    let mut answer = answer_brochure(&listener, &connector.brochure()).unwrap();
    answer.channels.set(Cuda, Cuda, Some(ChannelKind::CudaGdr));
    assert!(matches!(
        accept_answer(&connector, &answer),
        Err(NegotiateError::InconsistentChannelSelection {
            listener_device: Cuda,
            connector_device: Cuda,
            ..
        })
    ));
}

#[test]
fn pairs_without_a_channel_stay_unassigned() {
    let mut a = Offer::new();
    a.add_transport(TransportKind::Tcp, 0, "tcp:*").unwrap();
    a.add_channel(ChannelKind::Basic, 1000, DeviceDescriptors::cpu("any"))
        .unwrap();
    let (decided, accepted) = handshake(&a, &a.clone()).unwrap();
    assert_eq!(decided, accepted);
    assert_eq!(decided.channels.iter().count(), 1);
    assert_eq!(decided.channels.get(Cuda, Cuda), None);
    assert_eq!(decided.channel_for(Role::Listener, Cpu, Cuda), None);
}

#[test]
fn cuda_basic_never_serves_cpu_to_cpu() {
    let mut a = Offer::new();
    a.add_transport(TransportKind::Tcp, 0, "tcp:*").unwrap();
    a.add_channel(
        ChannelKind::CudaBasic,
        0,
        DeviceDescriptors::cpu("any").with(Cuda, "any"),
    )
    .unwrap();
    let (decided, _) = handshake(&a, &a.clone()).unwrap();
    assert_eq!(decided.channels.get(Cpu, Cpu), None);
    assert_eq!(
        decided.channels.get(Cpu, Cuda),
        Some(ChannelKind::CudaBasic)
    );
}

#[test]
fn cuda_basic_is_carried_by_the_cpu_channel() {
    // Both sides stage on the CPU side; only `b` holds CUDA memory.
    let offer = |cuda: bool| {
        let mut o = Offer::new();
        o.add_transport(TransportKind::Tcp, 0, "tcp:*").unwrap();
        o.add_channel(ChannelKind::Cma, 1200, DeviceDescriptors::cpu("host"))
            .unwrap();
        o.add_channel(ChannelKind::Basic, 1000, DeviceDescriptors::cpu("any"))
            .unwrap();
        let staged = DeviceDescriptors::cpu("staged");
        let staged = if cuda {
            staged.with(Cuda, "staged")
        } else {
            staged
        };
        o.add_channel(ChannelKind::CudaBasic, 0, staged).unwrap();
        o
    };
    let (a, b) = (offer(false), offer(true));
    let (decided, accepted) = handshake(&a, &b).unwrap();
    assert_eq!(decided, accepted);
    // `a` listens: its CPU memory to `b`'s CUDA memory goes over cuda_basic, whose
    // bytes cma carries; `b` has no CUDA memory to receive into on `a`'s side.
    assert_eq!(
        decided.channel_for(Role::Listener, Cpu, Cuda),
        Some(ChannelKind::CudaBasic)
    );
    assert_eq!(
        decided.carrier_for(Role::Listener, Cpu, Cuda),
        Some(ChannelKind::Cma)
    );
    assert_eq!(
        decided.carrier_for(Role::Connector, Cuda, Cpu),
        Some(ChannelKind::Cma)
    );
    assert_eq!(decided.carrier_for(Role::Listener, Cuda, Cuda), None);
    assert_eq!(
        decided.carrier_for(Role::Listener, Cpu, Cpu),
        Some(ChannelKind::Cma)
    );
    // Without a CPU channel the staged bytes travel in the pipe's frames.
    let mut c = Offer::new();
    c.add_transport(TransportKind::Tcp, 0, "tcp:*").unwrap();
    c.add_channel(
        ChannelKind::CudaBasic,
        0,
        DeviceDescriptors::cpu("staged").with(Cuda, "staged"),
    )
    .unwrap();
    let (decided, _) = handshake(&c, &c.clone()).unwrap();
    assert_eq!(
        decided.carrier_for(Role::Connector, Cuda, Cuda),
        Some(ChannelKind::Basic)
    );
}

#[test]
fn offer_errors() {
    let mut o = Offer::new();
    o.add_transport(TransportKind::Tcp, 0, "tcp:*").unwrap();
    assert_eq!(
        o.add_transport(TransportKind::Tcp, 5, "tcp:*")
            .unwrap_err()
            .to_string(),
        "transport tcp is listed more than once"
    );
    assert_eq!(
        o.add_transport(TransportKind::Shm, 0, "shm:x")
            .unwrap_err()
            .to_string(),
        "transports tcp and shm both have priority 0"
    );
    o.add_channel(ChannelKind::Basic, 1, DeviceDescriptors::cpu("any"))
        .unwrap();
    assert_eq!(
        o.add_channel(ChannelKind::Mpt, 1, DeviceDescriptors::cpu("m"))
            .unwrap_err()
            .to_string(),
        "channels basic and mpt both have priority 1"
    );
    assert_eq!(
        o.add_channel(ChannelKind::Basic, 2, DeviceDescriptors::cpu("any"))
            .unwrap_err()
            .to_string(),
        "channel basic is listed more than once"
    );
    assert_eq!(
        o.add_channel(ChannelKind::CudaIpc, 3, DeviceDescriptors::cpu("x"))
            .unwrap_err()
            .to_string(),
        "channel cuda_ipc does not handle cpu devices"
    );
    // Failed additions leave the offer as it was.
    assert_eq!(o.transports().count(), 1);
    assert_eq!(o.channels().count(), 1);
}

#[test]
fn brochures_drop_priorities_and_keep_descriptors() {
    let a = pytorch_like(SHM_HOST_A, "host-a");
    let brochure = a.brochure();
    assert_eq!(brochure.transport(TransportKind::Shm), Some(SHM_HOST_A));
    assert_eq!(brochure.channel(ChannelKind::CudaGdr), None);
    assert_eq!(
        brochure
            .channel(ChannelKind::CudaIpc)
            .and_then(|d| d.get(Cuda)),
        Some("host-a")
    );
    assert_eq!(brochure.transport_set().to_string(), "[shm, ibv, tcp]");
    let answer = answer_brochure(&a, &brochure).unwrap();
    assert_eq!(
        answer.listener_channels.transport_set(),
        TransportSet::new()
    );
}

// ---- properties -----------------------------------------------------------------------

const DESCRIPTORS: [&str; 2] = ["p", "q"];

/// One side's raw choices: a descriptor (or absence) per transport, and per channel and
/// device type.
#[derive(Debug, Clone)]
struct Side {
    transports: [Option<usize>; TransportKind::COUNT],
    channels: [[Option<usize>; DeviceType::COUNT]; ChannelKind::COUNT],
}

fn side() -> impl Strategy<Value = Side> {
    let pick = || proptest::option::weighted(0.7, 0..DESCRIPTORS.len());
    (
        proptest::array::uniform3(pick()),
        proptest::array::uniform8(proptest::array::uniform2(pick())),
    )
        .prop_map(|(transports, channels)| Side {
            transports,
            channels,
        })
}

/// The side's offer with the given priorities (`None`: not registered).
fn offer_of(
    side: &Side,
    transports: &Ranking<TransportKind>,
    channels: &Ranking<ChannelKind>,
) -> Offer<'static> {
    let mut offer = Offer::new();
    for (kind, priority) in transports.iter() {
        if let Some(d) = side.transports[kind.index()] {
            offer.add_transport(kind, priority, DESCRIPTORS[d]).unwrap();
        }
    }
    for (kind, priority) in channels.iter() {
        let mut descriptors = DeviceDescriptors::none();
        for t in kind.device_types() {
            if let Some(d) = side.channels[kind.index()][t.index()] {
                descriptors = descriptors.with(*t, DESCRIPTORS[d]);
            }
        }
        offer.add_channel(kind, priority, descriptors).unwrap();
    }
    offer
}

fn defaults(side: &Side) -> Offer<'static> {
    offer_of(side, &Ranking::defaults(), &Ranking::defaults())
}

fn ranking<K: Kind>(order: Vec<usize>) -> Ranking<K> {
    let names: Vec<&str> = order.iter().map(|&i| K::ALL[i].name()).collect();
    Ranking::from_names(&names).unwrap()
}

fn transport_order() -> impl Strategy<Value = Vec<usize>> {
    Just((0..TransportKind::COUNT).collect::<Vec<_>>()).prop_shuffle()
}

fn channel_order() -> impl Strategy<Value = Vec<usize>> {
    Just((0..ChannelKind::COUNT).collect::<Vec<_>>()).prop_shuffle()
}

/// Whether `kind` can serve (listener type, connector type) between these offers.
fn usable(l: &Offer<'_>, c: &Offer<'_>, kind: ChannelKind, lt: DeviceType, ct: DeviceType) -> bool {
    let mine = l.channel(kind).and_then(|(_, d)| d.get(lt));
    let theirs = c.channel(kind).and_then(|(_, d)| d.get(ct));
    kind.handles(lt, ct) && mine.is_some() && mine == theirs
}

fn transpose(n: Negotiated) -> Negotiated {
    let mut channels = ChannelTable::new();
    for choice in n.channels.iter() {
        channels.set(choice.connector, choice.listener, Some(choice.channel));
    }
    Negotiated {
        transport: n.transport,
        channels,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn the_answer_is_offered_by_both_and_highest_priority(a in side(), b in side()) {
        let (listener, connector) = (defaults(&a), defaults(&b));
        match answer_brochure(&listener, &connector.brochure()) {
            Err(NegotiateError::NoCommonTransport { .. }) => {
                for (kind, _, d) in listener.transports() {
                    prop_assert_ne!(connector.transport(kind).map(|(_, c)| c), Some(d));
                }
            }
            Err(other) => prop_assert!(false, "unexpected {other}"),
            Ok(answer) => {
                let chosen = answer.transport.kind;
                let (priority, descriptor) = listener.transport(chosen).unwrap();
                prop_assert_eq!(descriptor, answer.transport.domain_descriptor);
                prop_assert_eq!(connector.transport(chosen).map(|(_, d)| d), Some(descriptor));
                for (kind, p, d) in listener.transports() {
                    if connector.transport(kind).map(|(_, c)| c) == Some(d) {
                        prop_assert!(p <= priority, "{kind} ({p}) beats {chosen} ({priority})");
                    }
                }
                for lt in DeviceType::ALL {
                    for ct in DeviceType::ALL {
                        let best = ChannelKind::ALL
                            .into_iter()
                            .filter(|&k| usable(&listener, &connector, k, lt, ct))
                            .max_by_key(|&k| listener.channel(k).map(|(p, _)| p));
                        prop_assert_eq!(answer.channels.get(lt, ct), best);
                    }
                }
                // Both ends agree, and the connector's reading equals the decision.
                prop_assert_eq!(accept_answer(&connector, &answer), Ok(answer.negotiated()));
            }
        }
    }

    #[test]
    fn either_side_listening_gives_the_same_decision(a in side(), b in side()) {
        let (a, b) = (defaults(&a), defaults(&b));
        let ab = handshake(&a, &b);
        let ba = handshake(&b, &a);
        match (ab, ba) {
            (Ok((ab_l, ab_c)), Ok((ba_l, ba_c))) => {
                prop_assert_eq!(ab_l, ab_c);
                prop_assert_eq!(ba_l, ba_c);
                prop_assert_eq!(ab_l, transpose(ba_l));
                for x in DeviceType::ALL {
                    for y in DeviceType::ALL {
                        // a's view of (a-type x, b-type y) is the same in both roles.
                        prop_assert_eq!(
                            ab_l.channel_for(Role::Listener, x, y),
                            ba_l.channel_for(Role::Connector, x, y)
                        );
                    }
                }
            }
            (Err(e1), Err(e2)) => {
                let is_no_common = |e: &NegotiateError| matches!(e, NegotiateError::NoCommonTransport { .. });
                prop_assert!(is_no_common(&e1) && is_no_common(&e2), "{} / {}", e1, e2);
            }
            (x, y) => prop_assert!(false, "one direction failed: {:?} / {:?}", x, y),
        }
    }

    #[test]
    fn same_user_order_on_both_sides_always_agrees(
        a in side(), b in side(), t in transport_order(), c in channel_order(),
        t_len in 1..=TransportKind::COUNT, c_len in 0..=ChannelKind::COUNT,
    ) {
        let transports: Ranking<TransportKind> = ranking(t[..t_len].to_vec());
        let channels: Ranking<ChannelKind> = ranking(c[..c_len].to_vec());
        let listener = offer_of(&a, &transports, &channels);
        let connector = offer_of(&b, &transports, &channels);
        if let Ok(answer) = answer_brochure(&listener, &connector.brochure()) {
            prop_assert_eq!(accept_answer(&connector, &answer), Ok(answer.negotiated()));
            let again = answer_brochure(&listener, &connector.brochure());
            prop_assert_eq!(again, Ok(answer), "deterministic");
        }
    }

    #[test]
    fn different_orders_agree_or_are_refused(
        a in side(), b in side(), ta in transport_order(), tb in transport_order(),
        ca in channel_order(), cb in channel_order(),
    ) {
        let listener = offer_of(&a, &ranking(ta), &ranking(ca));
        let connector = offer_of(&b, &ranking(tb), &ranking(cb));
        if let Ok(answer) = answer_brochure(&listener, &connector.brochure()) {
            match accept_answer(&connector, &answer) {
                Ok(n) => prop_assert_eq!(n, answer.negotiated()),
                Err(NegotiateError::InconsistentChannelSelection { listener_device, connector_device, listener_choice, connector_choice }) => {
                    prop_assert_ne!(listener_choice, connector_choice);
                    prop_assert_eq!(answer.channels.get(listener_device, connector_device), listener_choice);
                }
                Err(other) => prop_assert!(false, "unexpected {other}"),
            }
        }
    }

    #[test]
    fn brochure_order_and_rebuilding_do_not_matter(a in side(), b in side(), order in channel_order()) {
        let listener = defaults(&a);
        let connector = defaults(&b);
        let brochure = connector.brochure();
        // The same advertisement built in another order.
        let mut rebuilt = Brochure::new();
        for i in order {
            let kind = ChannelKind::ALL[i];
            if let Some(d) = brochure.channel(kind) {
                rebuilt = rebuilt.with_channel(kind, d);
            }
        }
        for kind in TransportKind::ALL.into_iter().rev() {
            if let Some(d) = brochure.transport(kind) {
                rebuilt = rebuilt.with_transport(kind, d);
            }
        }
        prop_assert_eq!(rebuilt, brochure);
        prop_assert_eq!(answer_brochure(&listener, &rebuilt), answer_brochure(&listener, &brochure));
    }

    #[test]
    fn errors_render(a in side(), b in side()) {
        let (l, c) = (defaults(&a), defaults(&b));
        if let Err(e) = answer_brochure(&l, &c.brochure()) {
            let text: String = e.to_string();
            prop_assert!(text.starts_with("No common transport: the listener offers ["));
        }
    }
}
