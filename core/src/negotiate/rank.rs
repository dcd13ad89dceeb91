//! Which transports and channels one worker offers, in which order: the `transports` and
//! `channels` options (or PyTorch's default priorities), cut down to what this build runs
//! and to what the runtime found viable in this process.
//!
//! [`rank`] decides; the runtime only probes. It hands over every transport the build
//! runs here (`shm`, `tcp`, plugged-in ones) with a verdict (viable, or the reason it is
//! not), the channels the build runs, and a way to ask one channel's viability. A
//! channel's viability is asked only for channels that would otherwise be offered, in
//! priority order, because some probes have effects (cma's under Yama `ptrace_scope` 1
//! lets this user's processes read this one). The rules:
//!
//! 1. the option's names are parsed into a [`Ranking`] (unknown or repeated names are
//!    [`RankError::Names`]); without the option, every kind with its default
//!    priority;
//! 2. a listed kind this build does not run is [`RankError::NotInBuild`]; one that is
//!    only in the defaults is skipped silently (no ibv plugin, no ibv);
//! 3. a kind found not viable is left out and recorded in [`Ranked::refused`] with
//!    its reason;
//! 4. `mpt` is left out when no `tcp` transport is offered: its lanes are tcp
//!    connections;
//! 5. a class with nothing left is [`RankError::NoneLeft`] carrying every refusal, or
//!    [`RankError::NothingListed`] when nothing was listed that the build runs.
//!
//! Offers come out highest priority first. This module neither probes, opens nor
//! listens; the two sides' offers meet in [`answer_brochure`](super::answer_brochure).

use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

use super::{ChannelKind, Kind, KindClass, OfferError, Ranking, TransportKind};

/// The reason `mpt` is refused when no tcp transport is offered.
pub const MPT_NEEDS_TCP: &str = "mpt is not offered because this worker runs no tcp transport";

/// A kind that a worker leaves out of its offer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Refusable {
    /// A transport.
    Transport(TransportKind),
    /// A channel.
    Channel(ChannelKind),
}

impl fmt::Display for Refusable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusable::Transport(kind) => write!(f, "transport {kind}"),
            Refusable::Channel(kind) => write!(f, "channel {kind}"),
        }
    }
}

/// A kind left out, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// What was left out.
    pub kind: Refusable,
    /// Why, as the runtime's probe (or rule 4) said it.
    pub reason: String,
}

/// What a worker offers: transports and channels, highest priority first, and what was
/// left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ranked<D> {
    /// The transports with their priorities; never empty.
    pub transports: Vec<(TransportKind, i64)>,
    /// The channels with their priorities and what the viability probe returned for
    /// them (the runtime's domain descriptor); never empty.
    pub channels: Vec<(ChannelKind, i64, D)>,
    /// The kinds that would have been offered but were found not viable.
    pub refused: Vec<Refused>,
}

/// Why a worker has no offer.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RankError {
    /// The option's names do not form a ranking (unknown or repeated name).
    Names {
        /// Transport or channel.
        class: KindClass,
        /// What is wrong with the names.
        source: OfferError,
    },
    /// The option names a kind this build does not run.
    NotInBuild {
        /// Transport or channel.
        class: KindClass,
        /// The kind named.
        name: &'static str,
        /// What this build runs instead.
        runs: Vec<&'static str>,
    },
    /// Nothing that this build runs was listed (an empty list, or only kinds that
    /// are not in it).
    NothingListed {
        /// Transport or channel.
        class: KindClass,
        /// What this build runs.
        runs: Vec<&'static str>,
    },
    /// Every listed kind of the class was found not viable.
    NoneLeft {
        /// Transport or channel.
        class: KindClass,
        /// The refusals of that class, highest priority first.
        refused: Vec<Refused>,
    },
}

impl RankError {
    /// The option at fault: `transports` or `channels`.
    pub fn option(&self) -> &'static str {
        let class = match self {
            RankError::Names { class, .. }
            | RankError::NotInBuild { class, .. }
            | RankError::NothingListed { class, .. }
            | RankError::NoneLeft { class, .. } => *class,
        };
        match class {
            KindClass::Transport => "transports",
            KindClass::Channel => "channels",
        }
    }
}

/// The verb of "not ... the RPC agent of this build".
fn verb(class: KindClass) -> &'static str {
    match class {
        KindClass::Transport => "wired into",
        KindClass::Channel => "implemented by",
    }
}

/// Writes `items` joined by `separator`.
fn join<T: fmt::Display>(
    f: &mut fmt::Formatter<'_>,
    items: impl IntoIterator<Item = T>,
    separator: &str,
) -> fmt::Result {
    for (i, item) in items.into_iter().enumerate() {
        if i > 0 {
            f.write_str(separator)?;
        }
        write!(f, "{item}")?;
    }
    Ok(())
}

impl fmt::Display for RankError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RankError::Names { source, .. } => fmt::Display::fmt(source, f),
            RankError::NotInBuild { class, name, runs } => {
                write!(
                    f,
                    "{} {name} is not {} the RPC agent of this build; use ",
                    class.name(),
                    verb(*class)
                )?;
                join(f, runs, ", ")
            }
            RankError::NothingListed { class, runs } => {
                write!(f, "no {} left; list ", class.name())?;
                join(f, runs, ", ")
            }
            RankError::NoneLeft { class, refused } => {
                write!(f, "no {} left: ", class.name())?;
                join(f, refused.iter().map(|r| &r.reason), "; ")
            }
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for RankError {}

/// The kinds of one class in the option's order (or the defaults), highest priority
/// first, keeping those in `runs` (rules 1 and 2).
fn listed<K: Kind, S: AsRef<str>>(
    names: Option<&[S]>,
    runs: &[K],
) -> Result<Vec<(K, i64)>, RankError> {
    let ranking = Ranking::<K>::from_option(names).map_err(|source| RankError::Names {
        class: K::CLASS,
        source,
    })?;
    let runs_names = || runs.iter().map(|k| k.name()).collect::<Vec<_>>();
    let mut usable = Vec::new();
    for (kind, priority) in ranking.iter() {
        if runs.contains(&kind) {
            usable.push((kind, priority));
        } else if names.is_some() {
            return Err(RankError::NotInBuild {
                class: K::CLASS,
                name: kind.name(),
                runs: runs_names(),
            });
        }
    }
    if usable.is_empty() {
        return Err(RankError::NothingListed {
            class: K::CLASS,
            runs: runs_names(),
        });
    }
    usable.sort_by_key(|&(_, priority)| core::cmp::Reverse(priority));
    Ok(usable)
}

/// The offer of one worker (see the module documentation for the rules).
///
/// * `transports`, `channels`: the options, `None` for the defaults;
/// * `transports_here`: every transport this build runs in this process, with whether
///   it is viable (the reason when not); a transport missing here is not run;
/// * `channels_run`: the channels this build runs;
/// * `channel_here`: a channel's viability, asked only for channels that would
///   otherwise be offered; its `Ok` value (a domain descriptor) is kept in the offer.
///
/// # Errors
/// [`RankError`] when the names are bad or nothing is left of a class.
pub fn rank<D, S: AsRef<str>>(
    transports: Option<&[S]>,
    channels: Option<&[S]>,
    transports_here: &[(TransportKind, Result<(), String>)],
    channels_run: &[ChannelKind],
    mut channel_here: impl FnMut(ChannelKind) -> Result<D, String>,
) -> Result<Ranked<D>, RankError> {
    let runs: Vec<TransportKind> = transports_here.iter().map(|&(kind, _)| kind).collect();
    let mut refused = Vec::new();
    let mut offered_transports = Vec::new();
    for (kind, priority) in listed(transports, &runs)? {
        let verdict = transports_here
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, verdict)| verdict);
        match verdict {
            Some(Err(reason)) => refused.push(Refused {
                kind: Refusable::Transport(kind),
                reason: reason.clone(),
            }),
            _ => offered_transports.push((kind, priority)),
        }
    }
    if offered_transports.is_empty() {
        return Err(RankError::NoneLeft {
            class: KindClass::Transport,
            refused,
        });
    }
    let tcp = offered_transports
        .iter()
        .any(|&(kind, _)| kind == TransportKind::Tcp);
    let mut offered_channels = Vec::new();
    let mut channels_refused = Vec::new();
    for (kind, priority) in listed(channels, channels_run)? {
        let verdict = if kind == ChannelKind::Mpt && !tcp {
            Err(String::from(MPT_NEEDS_TCP))
        } else {
            channel_here(kind)
        };
        match verdict {
            Ok(descriptor) => offered_channels.push((kind, priority, descriptor)),
            Err(reason) => channels_refused.push(Refused {
                kind: Refusable::Channel(kind),
                reason,
            }),
        }
    }
    if offered_channels.is_empty() {
        return Err(RankError::NoneLeft {
            class: KindClass::Channel,
            refused: channels_refused,
        });
    }
    refused.extend(channels_refused);
    Ok(Ranked {
        transports: offered_transports,
        channels: offered_channels,
        refused,
    })
}

#[cfg(test)]
mod tests {
    use alloc::format;
    use alloc::string::ToString;
    use alloc::vec;

    use proptest::prelude::*;

    use super::*;

    const ALL_CHANNELS: [ChannelKind; 8] = ChannelKind::ALL;

    fn here(shm: Result<(), &str>) -> Vec<(TransportKind, Result<(), String>)> {
        vec![
            (TransportKind::Shm, shm.map_err(str::to_string)),
            (TransportKind::Tcp, Ok(())),
        ]
    }

    fn viable(kind: ChannelKind) -> Result<String, String> {
        Ok(format!("{kind}:here"))
    }

    fn kinds<D>(ranked: &Ranked<D>) -> (Vec<TransportKind>, Vec<ChannelKind>) {
        (
            ranked.transports.iter().map(|&(k, _)| k).collect(),
            ranked.channels.iter().map(|&(k, _, _)| k).collect(),
        )
    }

    #[test]
    fn defaults_offer_everything_viable_by_priority() {
        let ranked = rank::<_, &str>(None, None, &here(Ok(())), &ALL_CHANNELS, viable).unwrap();
        assert_eq!(
            ranked.transports,
            vec![(TransportKind::Shm, 200), (TransportKind::Tcp, 0)]
        );
        assert_eq!(
            ranked.channels[0],
            (ChannelKind::Xth, 1300, "xth:here".into())
        );
        assert_eq!(kinds(&ranked).1, ChannelKind::ALL.to_vec());
        assert!(ranked.refused.is_empty());
    }

    #[test]
    fn what_is_not_viable_is_refused_with_its_reason() {
        let no_cma = |kind| match kind {
            ChannelKind::Cma => Err("ptrace_scope is 3".to_string()),
            other => viable(other),
        };
        let ranked =
            rank::<_, &str>(None, None, &here(Err("no boot id")), &ALL_CHANNELS, no_cma).unwrap();
        assert_eq!(ranked.transports, vec![(TransportKind::Tcp, 0)]);
        assert!(!kinds(&ranked).1.contains(&ChannelKind::Cma));
        assert_eq!(
            ranked.refused,
            vec![
                Refused {
                    kind: Refusable::Transport(TransportKind::Shm),
                    reason: "no boot id".into()
                },
                Refused {
                    kind: Refusable::Channel(ChannelKind::Cma),
                    reason: "ptrace_scope is 3".into()
                }
            ]
        );
    }

    #[test]
    fn the_option_order_sets_priorities() {
        let ranked = rank(
            Some(&["tcp", "shm"][..]),
            Some(&["cma", "basic"][..]),
            &here(Ok(())),
            &ALL_CHANNELS,
            viable,
        )
        .unwrap();
        assert_eq!(
            ranked.transports,
            vec![(TransportKind::Tcp, 1), (TransportKind::Shm, 0)]
        );
        assert_eq!(kinds(&ranked).1, vec![ChannelKind::Cma, ChannelKind::Basic]);
        assert_eq!(ranked.channels[1].1, 0);
        // Old TensorPipe names parse.
        let uv = rank(
            Some(&["uv"][..]),
            None,
            &here(Ok(())),
            &ALL_CHANNELS,
            viable,
        )
        .unwrap();
        assert_eq!(uv.transports, vec![(TransportKind::Tcp, 0)]);
    }

    #[test]
    fn bad_names_and_kinds_outside_the_build_are_errors() {
        let err = rank(
            Some(&["carrier-pigeon"][..]),
            None,
            &here(Ok(())),
            &ALL_CHANNELS,
            viable,
        )
        .unwrap_err();
        assert!(matches!(err, RankError::Names { .. }));
        assert_eq!(err.option(), "transports");
        assert!(err.to_string().contains("carrier-pigeon"), "{err}");
        let err = rank(
            None,
            Some(&["basic", "basic"][..]),
            &here(Ok(())),
            &ALL_CHANNELS,
            viable,
        )
        .unwrap_err();
        assert!(matches!(err, RankError::Names { .. }));
        assert_eq!(err.option(), "channels");
        let err = rank(
            Some(&["ibv", "tcp"][..]),
            None,
            &here(Ok(())),
            &ALL_CHANNELS,
            viable,
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "transport ibv is not wired into the RPC agent of this build; use shm, tcp"
        );
        let err =
            rank::<_, &str>(Some(&[][..]), None, &here(Ok(())), &ALL_CHANNELS, viable).unwrap_err();
        assert_eq!(err.to_string(), "no transport left; list shm, tcp");
        let err = rank(
            None,
            Some(&["cma"][..]),
            &here(Ok(())),
            &[ChannelKind::Basic],
            viable,
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "channel cma is not implemented by the RPC agent of this build; use basic"
        );
    }

    #[test]
    fn a_plugged_in_transport_counts_as_run() {
        let mut with_ibv = here(Ok(()));
        with_ibv.insert(1, (TransportKind::Ibv, Ok(())));
        let ranked = rank::<_, &str>(None, None, &with_ibv, &ALL_CHANNELS, viable).unwrap();
        assert_eq!(
            ranked.transports,
            vec![
                (TransportKind::Shm, 200),
                (TransportKind::Ibv, 100),
                (TransportKind::Tcp, 0)
            ]
        );
        with_ibv[1].1 = Err("no verbs here".into());
        let err = rank(Some(&["ibv"][..]), None, &with_ibv, &ALL_CHANNELS, viable).unwrap_err();
        assert_eq!(err.to_string(), "no transport left: no verbs here");
    }

    #[test]
    fn nothing_left_names_every_refusal() {
        let none = |kind: ChannelKind| -> Result<String, String> { Err(format!("no {kind}")) };
        let err = rank(
            None,
            Some(&["cma", "xth"][..]),
            &here(Ok(())),
            &ALL_CHANNELS,
            none,
        )
        .unwrap_err();
        assert_eq!(err.to_string(), "no channel left: no cma; no xth");
        assert_eq!(err.option(), "channels");
    }

    #[test]
    fn mpt_needs_tcp_and_its_probe_is_not_asked() {
        let mut asked = Vec::new();
        let err = rank(
            Some(&["shm"][..]),
            Some(&["mpt"][..]),
            &here(Ok(())),
            &ALL_CHANNELS,
            |kind| {
                asked.push(kind);
                viable(kind)
            },
        )
        .unwrap_err();
        assert!(asked.is_empty());
        assert_eq!(err.to_string(), format!("no channel left: {MPT_NEEDS_TCP}"));
        let ranked = rank(
            Some(&["shm"][..]),
            Some(&["mpt", "basic"][..]),
            &here(Ok(())),
            &ALL_CHANNELS,
            viable,
        )
        .unwrap();
        assert_eq!(kinds(&ranked).1, vec![ChannelKind::Basic]);
        assert_eq!(ranked.refused[0].kind, Refusable::Channel(ChannelKind::Mpt));
    }

    #[test]
    fn channels_outside_the_list_are_never_probed() {
        let mut asked = Vec::new();
        rank(
            None,
            Some(&["basic"][..]),
            &here(Ok(())),
            &ALL_CHANNELS,
            |kind| {
                asked.push(kind);
                viable(kind)
            },
        )
        .unwrap();
        assert_eq!(asked, vec![ChannelKind::Basic]);
    }

    fn subset<K: Copy + fmt::Debug>(all: &'static [K]) -> impl Strategy<Value = Vec<K>> {
        proptest::sample::subsequence(all, 0..=all.len()).prop_shuffle()
    }

    proptest! {
        /// Against a model: the offer is exactly the listed, run and viable kinds,
        /// in the listed order, and what was listed and not viable is refused.
        #[test]
        fn offers_follow_the_model(
            listed_t in proptest::option::of(subset(&TransportKind::ALL)),
            listed_c in proptest::option::of(subset(&ChannelKind::ALL)),
            runs_t in subset(&TransportKind::ALL),
            runs_c in subset(&ChannelKind::ALL),
            bad_t in subset(&TransportKind::ALL),
            bad_c in subset(&ChannelKind::ALL),
        ) {
            let names_t = listed_t.as_ref().map(|v| v.iter().map(|k| k.name()).collect::<Vec<_>>());
            let names_c = listed_c.as_ref().map(|v| v.iter().map(|k| k.name()).collect::<Vec<_>>());
            let here: Vec<_> = runs_t
                .iter()
                .map(|&k| (k, if bad_t.contains(&k) { Err(format!("{k} bad")) } else { Ok(()) }))
                .collect();
            let result = rank(names_t.as_deref(), names_c.as_deref(), &here, &runs_c, |k| {
                if bad_c.contains(&k) { Err(format!("{k} bad")) } else { Ok(k) }
            });
            // The model: order by option (or default priority), keep the run ones.
            let order_t: Vec<TransportKind> = match &listed_t {
                Some(v) => v.clone(),
                None => Ranking::<TransportKind>::defaults().iter().map(|(k, _)| k).collect(),
            };
            let order_c: Vec<ChannelKind> = match &listed_c {
                Some(v) => v.clone(),
                None => Ranking::<ChannelKind>::defaults().iter().map(|(k, _)| k).collect(),
            };
            let outside_t = listed_t.is_some() && order_t.iter().any(|k| !runs_t.contains(k));
            let outside_c = listed_c.is_some() && order_c.iter().any(|k| !runs_c.contains(k));
            let run_t: Vec<_> = order_t.iter().copied().filter(|k| runs_t.contains(k)).collect();
            let ok_t: Vec<_> = run_t.iter().copied().filter(|k| !bad_t.contains(k)).collect();
            let tcp = ok_t.contains(&TransportKind::Tcp);
            let run_c: Vec<_> = order_c.iter().copied().filter(|k| runs_c.contains(k)).collect();
            let ok_c: Vec<_> = run_c
                .iter()
                .copied()
                .filter(|k| !bad_c.contains(k) && (tcp || *k != ChannelKind::Mpt))
                .collect();
            match result {
                Ok(ranked) => {
                    prop_assert!(!outside_t && !outside_c);
                    prop_assert_eq!(kinds(&ranked), (ok_t.clone(), ok_c.clone()));
                    for w in ranked.transports.windows(2) {
                        prop_assert!(w[0].1 > w[1].1);
                    }
                    for w in ranked.channels.windows(2) {
                        prop_assert!(w[0].1 > w[1].1);
                    }
                    for &(k, _, d) in &ranked.channels { prop_assert_eq!(k, d); }
                    let refused: Vec<_> = ranked.refused.iter().map(|r| r.kind).collect();
                    let expected: Vec<_> = run_t.iter().filter(|k| !ok_t.contains(k)).map(|&k| Refusable::Transport(k))
                        .chain(run_c.iter().filter(|k| !ok_c.contains(k)).map(|&k| Refusable::Channel(k)))
                        .collect();
                    prop_assert_eq!(refused, expected);
                }
                Err(RankError::NotInBuild { class, .. }) => {
                    let expected = match class {
                        KindClass::Transport => outside_t,
                        KindClass::Channel => !outside_t && outside_c,
                    };
                    prop_assert!(expected);
                }
                Err(RankError::NothingListed { class, .. }) => {
                    let expected = match class {
                        KindClass::Transport => run_t.is_empty(),
                        KindClass::Channel => !ok_t.is_empty() && run_c.is_empty(),
                    };
                    prop_assert!(expected);
                }
                Err(RankError::NoneLeft { class, refused }) => {
                    prop_assert!(!refused.is_empty());
                    let expected = match class {
                        KindClass::Transport => ok_t.is_empty(),
                        KindClass::Channel => !ok_t.is_empty() && ok_c.is_empty(),
                    };
                    prop_assert!(expected);
                }
                Err(e) => prop_assert!(false, "unexpected {}", e),
            }
        }
    }
}
