//! The roster and the size value: how a round's arrivals are written and read, how the
//! closer deals ranks, and which slot an open round's node watches. Pure functions of
//! the bytes the store holds.

use alloc::string::String;
use alloc::vec::Vec;

use super::MAX_SLOTS;

/// One arrival of a round, as its roster says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::rendezvous::elastic) struct Entry<'a> {
    pub(in crate::rendezvous::elastic) slot: u32,
    /// The round and rank this node held last.
    pub(in crate::rendezvous::elastic) prev: Option<(u64, u32)>,
    /// What it tells the others when it is rank 0.
    pub(in crate::rendezvous::elastic) contact: Option<&'a str>,
    pub(in crate::rendezvous::elastic) node: &'a str,
}

/// One line of a round's roster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::rendezvous::elastic) enum Line<'a> {
    Joined(Entry<'a>),
    Gone(u32),
}

/// The roster's lines: `+{slot} {round}:{rank}|- {contact}|- {node}` for an arrival,
/// `-{slot}` for a departure. Lines that are neither are skipped.
pub(in crate::rendezvous::elastic) fn parse_roster(
    roster: &[u8],
) -> impl Iterator<Item = Line<'_>> {
    // A round's roster has a line per arrival and per departure: more lines than twice
    // the most slots are not ours.
    let most = 2 * MAX_SLOTS as usize;
    roster.split(|&b| b == b'\n').take(most).filter_map(|line| {
        let line = core::str::from_utf8(line).ok()?;
        if let Some(slot) = line.strip_prefix('-') {
            return slot.parse().ok().map(Line::Gone);
        }
        let mut parts = line.strip_prefix('+')?.splitn(4, ' ');
        let slot = parts.next()?.parse().ok()?;
        let prev = match parts.next()? {
            "-" => None,
            text => {
                let (round, rank) = text.split_once(':')?;
                Some((round.parse().ok()?, rank.parse().ok()?))
            }
        };
        let contact = match parts.next()? {
            "-" => None,
            text => Some(text),
        };
        let node = parts.next().unwrap_or("");
        Some(Line::Joined(Entry {
            slot,
            prev,
            contact,
            node,
        }))
    })
}

/// The size value: `{N};{slot of rank 0},{slot of rank 1},…[;{rank 0's contact}]`, or
/// `0` (shut down): the slots by rank and rank 0's contact. `None` when it is anything
/// else, or names more than `max` members.
pub(in crate::rendezvous::elastic) fn parse_world(
    value: &[u8],
    max: u32,
) -> Option<(Vec<u32>, Option<String>, Option<u32>)> {
    let text = core::str::from_utf8(value).ok()?;
    if text == "0" {
        return Some((Vec::new(), None, None));
    }
    let (size, rest) = text.split_once(';')?;
    let (slots, master) = match rest.split_once(';') {
        Some((slots, contact)) => (slots, Some(String::from(contact))),
        None => (rest, None),
    };
    let (size, closer) = match size.split_once(':') {
        Some((size, closer)) => (size, Some(closer.parse().ok()?)),
        None => (size, None),
    };
    let size: u32 = size.parse().ok()?;
    if size == 0 || size > max {
        return None;
    }
    let mut world = Vec::new();
    world.try_reserve_exact(size as usize).ok()?;
    for slot in slots.split(',') {
        if world.len() == size as usize {
            return None;
        }
        world.push(slot.parse().ok()?);
    }
    (world.len() == size as usize).then_some((world, master, closer))
}

/// Deals ranks `0..N` to the members (`N = members.len()`, in any order); returns their
/// slots by rank. A member that held rank `r < N` in its last round keeps it (when two
/// claim one rank, the later round's holder wins, then the lower slot); the others take
/// the free ranks in the order of their node names (then slots), as PyTorch sorts
/// participants by node descriptor.
pub(super) fn deal_ranks(members: &[Entry<'_>]) -> Vec<u32> {
    let n = members.len();
    let mut by_rank: Vec<Option<u32>> = alloc::vec![None; n];
    let mut claims: Vec<&Entry<'_>> = members
        .iter()
        .filter(|e| e.prev.is_some_and(|(_, rank)| (rank as usize) < n))
        .collect();
    claims.sort_by_key(|e| (core::cmp::Reverse(e.prev.map(|(round, _)| round)), e.slot));
    let mut placed: Vec<u32> = Vec::new();
    for e in claims {
        if let Some((_, rank)) = e.prev {
            if by_rank[rank as usize].is_none() {
                by_rank[rank as usize] = Some(e.slot);
                placed.push(e.slot);
            }
        }
    }
    placed.sort_unstable();
    let mut rest: Vec<&Entry<'_>> = members
        .iter()
        .filter(|e| placed.binary_search(&e.slot).is_err())
        .collect();
    rest.sort_by(|a, b| a.node.cmp(b.node).then(a.slot.cmp(&b.slot)));
    let mut rest = rest.into_iter();
    by_rank
        .into_iter()
        .map(|slot| slot.or_else(|| rest.next().map(|e| e.slot)).unwrap_or(0))
        .collect()
}

/// The slot that the node at `slot` watches in an open round of `count` arrivals: the
/// nearest one below it round the ring (`slot − 1`, …, `1`, `count`, …) that it has not
/// found gone; `None` when there is none.
pub(super) fn ring_target(slot: u32, count: u32, marked: &[u32]) -> Option<u32> {
    let count = count.max(slot);
    (1..count)
        .map(|k| (slot + count - 1 - k) % count + 1)
        .find(|t| *t != slot && !marked.contains(t))
}

#[cfg(test)]
mod unit {
    use super::*;

    fn entry(slot: u32, prev: Option<(u64, u32)>, node: &str) -> Entry<'_> {
        Entry {
            slot,
            prev,
            contact: None,
            node,
        }
    }

    #[test]
    fn ranks_stay_with_survivors_and_newcomers_sort_by_name() {
        // Survivors of round 3 at ranks 2 and 0; newcomers z and b; a stale claim of rank
        // 0 from round 1 loses to round 3's.
        let members = [
            entry(1, Some((3, 2)), "s2"),
            entry(2, None, "z"),
            entry(3, Some((3, 0)), "s0"),
            entry(4, Some((1, 0)), "old"),
            entry(5, None, "b"),
        ];
        assert_eq!(deal_ranks(&members), [3, 5, 1, 4, 2]);
        // A claim beyond the new world size is a newcomer's.
        assert_eq!(
            deal_ranks(&[entry(7, Some((0, 5)), "x"), entry(8, None, "a")]),
            [8, 7]
        );
    }

    #[test]
    fn ring_targets_skip_the_marked() {
        assert_eq!(ring_target(3, 5, &[]), Some(2));
        assert_eq!(ring_target(1, 5, &[]), Some(5));
        assert_eq!(ring_target(1, 5, &[5, 4]), Some(3));
        assert_eq!(ring_target(2, 3, &[1, 3]), None);
        assert_eq!(ring_target(1, 1, &[]), None);
    }

    #[test]
    fn rosters_and_worlds_parse_or_refuse() {
        let lines: Vec<Line<'_>> =
            parse_roster(b"+1 - - a b\n+2 4:1 h:29500 n2\n-1\ngarbage\n+x - - y\n+3 -\n").collect();
        let mut with_contact = entry(2, Some((4, 1)), "n2");
        with_contact.contact = Some("h:29500");
        assert_eq!(
            lines,
            [
                Line::Joined(entry(1, None, "a b")),
                Line::Joined(with_contact),
                Line::Gone(1),
            ]
        );
        assert_eq!(
            parse_world(b"3;4,1,2", 4),
            Some((alloc::vec![4, 1, 2], None, None))
        );
        assert_eq!(
            parse_world(b"3:2;4,1,2", 4),
            Some((alloc::vec![4, 1, 2], None, Some(2)))
        );
        assert_eq!(
            parse_world(b"2:5;4,1;[::1]:29500", 4),
            Some((alloc::vec![4, 1], Some("[::1]:29500".into()), Some(5)))
        );
        assert_eq!(parse_world(b"0", 4), Some((Vec::new(), None, None)));
        for bad in [
            &b"3;1,2"[..],
            b"5;1,2,3,4,5",
            b"2;1,2,3",
            b"lots",
            b"2;a,b",
            b"2:x;1,2",
            b"2",
        ] {
            assert_eq!(parse_world(bad, 4), None, "{bad:?}");
        }
    }
}
