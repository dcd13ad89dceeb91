//! Fuzz checks for [`crate::rendezvous::elastic`].
//!
//! For every input: parsing the front as an `elastic://` URL (and as a `nodes` range,
//! and as an `etcd://` URL) never panics, accepts only settings that pass their own checks, and refuses with a
//! message; and an [`ElasticNode`] fed the rest of the bytes as arbitrary store replies,
//! local events and clock jumps never panics, never has two actions outstanding, and
//! once done asks for nothing more.

use alloc::vec::Vec;
use core::time::Duration;

use super::utf8_prefix;
use crate::fuzzing::{check_display, split_point};
use crate::rendezvous::elastic::{
    ElasticNode, ElasticSettings, ElasticUrl, EtcdRendezvousUrl, Instant, LocalEvent, NodeRange,
    StoreAction, StoreReply,
};

/// Parses the front of `data` as settings, then drives a node with the rest.
pub fn elastic(data: &[u8]) {
    let at = split_point(data);
    let (front, rest) = data.split_at(at);
    let text = utf8_prefix(front);
    match ElasticUrl::parse(text) {
        Ok(url) => {
            assert_eq!(url.settings.check(), Ok(()));
            assert!(url.settings.nodes.min >= 1);
            assert!(url.settings.nodes.max >= url.settings.nodes.min);
        }
        Err(error) => check_display(&error),
    }
    match NodeRange::parse(text) {
        Ok(range) => assert!(range.min >= 1 && range.max >= range.min),
        Err(error) => check_display(&error),
    }
    etcd_url(text);
    drive(rest);
}

/// `text` (and `etcd://` + `text`) as an `etcd://` rendezvous URL: never a panic; an
/// accepted one has endpoints, settings that pass their checks, and a usable prefix.
fn etcd_url(text: &str) {
    let prefixed = alloc::format!("etcd://{text}");
    for candidate in [text, prefixed.as_str()] {
        match EtcdRendezvousUrl::parse(candidate) {
            Ok(url) => {
                assert!(!url.endpoints.is_empty());
                assert!(url.endpoints.iter().all(|e| e.contains(':')));
                assert_eq!(url.elastic.settings.check(), Ok(()));
                assert!(!url.prefix.is_empty() && !url.prefix.contains('\0'));
            }
            Err(error) => check_display(&error),
        }
    }
}

fn drive(data: &[u8]) {
    let min = u32::from(data.first().copied().unwrap_or(1) % 4).max(1);
    let max = min + u32::from(data.get(1).copied().unwrap_or(0) % 3);
    let Ok(nodes) = NodeRange::new(min, max) else {
        return;
    };
    let mut settings = ElasticSettings::new("fuzz", nodes);
    settings.keep_alive_interval = Duration::from_millis(100);
    settings.last_call = Duration::from_millis(300);
    settings.join_timeout = Duration::from_secs(5);
    let mut node = ElasticNode::new(settings, "n");
    node.handle_local(LocalEvent::Join);
    let mut now = Instant::ZERO;
    let mut value: Vec<u8> = Vec::new();
    for chunk in data.get(2..).unwrap_or_default().chunks(2) {
        let (op, arg) = (chunk[0], chunk.get(1).copied().unwrap_or(0));
        now = now.saturating_add(Duration::from_millis(u64::from(arg) * 10));
        match op % 12 {
            0 => node.handle_local(LocalEvent::Leave),
            1 => node.handle_local(LocalEvent::Shutdown),
            2 => node.handle_local(LocalEvent::WorkerFailed),
            _ => {}
        }
        let action = node.poll_action(now);
        if node.is_done() {
            assert!(action.is_none());
        }
        if action.is_some() {
            assert!(node.poll_action(now).is_none(), "two actions outstanding");
        }
        value.clear();
        value.extend_from_slice(alloc::format!("{}", i64::from(arg % 8) - 1).as_bytes());
        let number = i64::from(arg % 8) - 1;
        // Mostly a reply of the kind the action asks for (to reach deep states), now
        // and then any reply at all.
        let reply = match (&action, op % 16) {
            (_, 15) | (None, _) => match arg % 6 {
                0 => StoreReply::Checked(true),
                1 => StoreReply::Added(number),
                2 => StoreReply::Set,
                3 => StoreReply::Value(chunk),
                4 => StoreReply::Waited,
                _ => StoreReply::TimedOut,
            },
            (Some(StoreAction::Check { .. }), _) => StoreReply::Checked(arg % 4 == 0),
            (Some(StoreAction::Add { .. }), _) => StoreReply::Added(number),
            (Some(StoreAction::Set { .. } | StoreAction::Append { .. }), _) => StoreReply::Set,
            (Some(StoreAction::CompareSet { .. } | StoreAction::Get { .. }), _) => {
                StoreReply::Value(if op % 7 == 0 { chunk } else { &value })
            }
            (Some(StoreAction::Pause { .. }), _) => StoreReply::TimedOut,
            (Some(StoreAction::Wait { .. }), _) => {
                if arg % 2 == 0 {
                    StoreReply::Waited
                } else {
                    StoreReply::TimedOut
                }
            }
        };
        if action.is_some() || op % 16 == 15 {
            node.handle_reply(reply, now);
        }
        while let Some(event) = node.poll_event() {
            if let crate::rendezvous::elastic::Event::Failed(error) = &event {
                check_display(error);
            }
        }
    }
}
