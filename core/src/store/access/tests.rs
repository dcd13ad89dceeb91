use super::*;
use crate::store::codec::{decode_request, Decoded, Limits};
use alloc::string::{String, ToString};
use alloc::vec;
use core::net::Ipv6Addr;
use proptest::prelude::*;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[test]
fn allowlists_match_v4_v6_and_mapped_peers() {
    let allow = Allowlist::parse("10.0.0.0/8, 192.168.1.7,::1,[fd00::]/8").unwrap();
    assert_eq!(allow.networks().len(), 4);
    for peer in [
        "10.1.2.3",
        "192.168.1.7",
        "::1",
        "fd12::5",
        "::ffff:10.9.9.9",
    ] {
        assert!(allow.allows(ip(peer)), "{peer}");
    }
    for peer in [
        "11.0.0.1",
        "192.168.1.8",
        "::2",
        "fe80::1",
        "::ffff:11.0.0.1",
    ] {
        assert!(!allow.allows(ip(peer)), "{peer}");
    }
    // A rule written as a mapped network is the IPv4 network it maps.
    let mapped = Allowlist::parse("::ffff:10.0.0.0/104").unwrap();
    assert_eq!(mapped.networks()[0].to_string(), "10.0.0.0/8");
    assert!(mapped.allows(ip("10.200.0.1")));
    assert!(mapped.allows(ip("::ffff:10.200.0.1")));
    assert!(!mapped.allows(ip("11.0.0.1")));
    // 0.0.0.0/0 is every IPv4 peer; ::/0 is every IPv6 address, the mapped IPv4 ones
    // included (as a dual-stack socket bound to :: takes IPv4 too).
    let any4 = Allowlist::parse("0.0.0.0/0").unwrap();
    assert!(any4.allows(ip("8.8.8.8")) && any4.allows(ip("::ffff:1.2.3.4")));
    assert!(!any4.allows(ip("2001:db8::1")));
    let any6 = Allowlist::parse("::/0").unwrap();
    assert!(any6.allows(ip("2001:db8::1")) && any6.allows(ip("1.2.3.4")));
    // A mapped address under a prefix shorter than the mapped range stays an IPv6
    // network, and still holds the IPv4 peers it maps (found by the fuzzer).
    let wide = Allowlist::parse("::ffff:10.0.0.0/4").unwrap();
    assert!(wide.allows(ip("10.0.0.0")) && wide.allows(ip("::ffff:10.0.0.0")));
    assert!(!Allowlist::parse("fd00::/8").unwrap().allows(ip("10.0.0.1")));
}

#[test]
fn bad_allowlists_say_which_entry() {
    assert_eq!(Allowlist::parse(""), Err(AllowlistError::Empty));
    assert_eq!(Allowlist::parse(" , "), Err(AllowlistError::Empty));
    assert_eq!(
        Allowlist::parse("10.0.0.0/8,host.example"),
        Err(AllowlistError::BadAddress { index: 1 })
    );
    assert_eq!(
        Allowlist::parse("10.0.0.0/33"),
        Err(AllowlistError::BadPrefixLen {
            index: 0,
            prefix_len: 33,
            max: 32
        })
    );
    assert_eq!(
        Allowlist::parse("10.0.0.0/x"),
        Err(AllowlistError::BadAddress { index: 0 })
    );
    assert!(AllowlistError::BadAddress { index: 1 }
        .to_string()
        .contains("entry 2"));
}

const OPERATOR: &str = "6tq2bX0n8Wc1pFv4LmZs7QyR";
const JOB1: &str = "f0H3kd8Jq2LmZp5Vw9XyTb1C";

fn file() -> String {
    alloc::format!("# operators\n{OPERATOR}\n\n  # job 1\n{JOB1}   /job1/  \n")
}

#[test]
fn token_files_parse_with_comments_and_prefixes() {
    let table = TokenTable::parse(file().as_bytes()).unwrap();
    assert_eq!(table.len(), 2);
    assert!(!table.is_empty());
    let op = table.authenticate(OPERATOR.as_bytes()).unwrap();
    assert_eq!(table.scope(op), &Scope::All);
    let job = table.authenticate(JOB1.as_bytes()).unwrap();
    assert_eq!(table.scope(job), &Scope::Prefix(b"/job1/".to_vec()));
    assert_eq!(table.authenticate(b"6tq2bX0n8Wc1pFv4LmZs7QyX"), None);
    assert_eq!(table.authenticate(b""), None);
    // No secret in debug output.
    let debug = alloc::format!("{table:?}");
    assert!(
        !debug.contains(OPERATOR) && !debug.contains(JOB1),
        "{debug}"
    );
    assert_eq!(client_token(file().as_bytes()), Ok(OPERATOR));
    assert_eq!(
        client_token(alloc::format!("{JOB1} /job1/\n").as_bytes()),
        Ok(JOB1)
    );
}

#[test]
fn bad_token_files_name_the_line_and_never_the_token() {
    let cases: [(String, TokenFileError); 6] = [
        (
            "short\n".into(),
            TokenFileError::BadLength { line: 1, len: 5 },
        ),
        (
            alloc::format!("# c\n{OPERATOR} /p/ extra\n"),
            TokenFileError::TrailingText { line: 2 },
        ),
        (
            alloc::format!("{OPERATOR}\n{JOB1}\n{OPERATOR} /x/\n"),
            TokenFileError::Duplicate { line: 3, first: 1 },
        ),
        ("# nothing\n\n".into(), TokenFileError::Empty),
        (
            alloc::format!("{}\n", "x".repeat(MAX_TOKEN_LEN + 1)),
            TokenFileError::BadLength {
                line: 1,
                len: MAX_TOKEN_LEN + 1,
            },
        ),
        (
            "ok-but-has-é-in-it-xx\n".into(),
            TokenFileError::BadCharacter { line: 1 },
        ),
    ];
    for (text, want) in cases {
        let got = TokenTable::parse(text.as_bytes());
        assert_eq!(got, Err(want), "{text:?}");
        let shown = want.to_string();
        assert!(
            !shown.contains(OPERATOR) && !shown.contains(JOB1),
            "{shown}"
        );
    }
    assert_eq!(
        TokenTable::parse(b"# a\n\xff\xfe\n"),
        Err(TokenFileError::NotUtf8 { line: 2 })
    );
    assert_eq!(client_token(b"# none\n"), Err(TokenFileError::Empty));
}

/// A request decoded from its frame (lists need their wire form).
fn frame_of(bytes: &[u8]) -> Request<'_> {
    match decode_request(bytes, &Limits::default()) {
        Ok(Decoded::Complete(request, _)) => request,
        other => panic!("{other:?}"),
    }
}

fn list_frame(query: QueryType, keys: &[&[u8]]) -> Vec<u8> {
    let mut out = vec![query.as_u8()];
    out.extend_from_slice(&(keys.len() as u64).to_le_bytes());
    for key in keys {
        out.extend_from_slice(&(key.len() as u64).to_le_bytes());
        out.extend_from_slice(key);
    }
    out
}

#[test]
fn a_prefix_bound_token_reaches_only_its_keys() {
    let policy = AccessPolicy::new(None, Some(TokenTable::parse(file().as_bytes()).unwrap()));
    assert!(policy.requires_tokens());
    let fresh = policy.new_connection();
    assert_eq!(fresh, ConnAccess::AwaitingAuth);
    // A PyTorch client's first request.
    assert_eq!(
        policy.authorize(fresh, &Request::Validate { magic: 0x3c85f7ce }),
        Err(Refusal::NotAuthenticated { byte: 0 })
    );
    assert_eq!(
        policy.authenticate(fresh, Some(b"not-a-token-at-all!!")),
        Err(Refusal::BadToken)
    );
    assert_eq!(policy.authenticate(fresh, None), Err(Refusal::BadToken));
    let job = policy.authenticate(fresh, Some(JOB1.as_bytes())).unwrap();
    assert!(matches!(job, ConnAccess::Granted(_)));
    assert_eq!(
        policy.authenticate(job, Some(JOB1.as_bytes())),
        Err(Refusal::AuthTwice)
    );
    let ok = |r: &Request<'_>| policy.authorize(job, r);
    assert_eq!(ok(&Request::Ping { nonce: 1 }), Ok(()));
    assert_eq!(ok(&Request::Validate { magic: 1 }), Ok(()));
    assert_eq!(ok(&Request::CancelWait), Ok(()));
    assert_eq!(
        ok(&Request::Set {
            key: b"/job1/k",
            value: b"v"
        }),
        Ok(())
    );
    assert_eq!(
        ok(&Request::Add {
            key: b"/job1/n",
            delta: 1
        }),
        Ok(())
    );
    assert_eq!(ok(&Request::QueuePop { key: b"/job1/q" }), Ok(()));
    assert_eq!(
        ok(&Request::Get { key: b"/job2/k" }),
        Err(Refusal::KeyOutsidePrefix {
            query: QueryType::Get
        })
    );
    assert_eq!(
        ok(&Request::Get { key: b"/job1" }),
        Err(Refusal::KeyOutsidePrefix {
            query: QueryType::Get
        }),
        "the prefix itself without its slash is outside"
    );
    let both = list_frame(QueryType::MultiGet, &[b"/job1/a", b"/job2/b"]);
    assert_eq!(
        ok(&frame_of(&both)),
        Err(Refusal::KeyOutsidePrefix {
            query: QueryType::MultiGet
        })
    );
    let mine = list_frame(QueryType::Wait, &[b"/job1/a", b"/job1/b"]);
    assert_eq!(ok(&frame_of(&mine)), Ok(()));
    for query in [Request::GetNumKeys, Request::ListKeys, Request::Stats] {
        assert_eq!(
            ok(&query),
            Err(Refusal::QueryNotAllowed {
                query: query.query_type()
            })
        );
    }
    // The operator's token reaches everything.
    let op = policy
        .authenticate(fresh, Some(OPERATOR.as_bytes()))
        .unwrap();
    assert_eq!(policy.authorize(op, &Request::Stats), Ok(()));
    assert_eq!(
        policy.authorize(op, &Request::Get { key: b"/job2/k" }),
        Ok(())
    );
    // Refusal texts never hold a token, and say what to do.
    assert!(Refusal::NotAuthenticated { byte: 0 }
        .to_string()
        .contains("PyTorch"));
}

#[test]
fn the_open_policy_is_pytorch_s() {
    let policy = AccessPolicy::open();
    assert!(!policy.requires_tokens());
    assert_eq!(policy.admit(ip("203.0.113.9")), Ok(()));
    let conn = policy.new_connection();
    assert_eq!(conn, ConnAccess::Open);
    assert_eq!(policy.authorize(conn, &Request::Stats), Ok(()));
    assert_eq!(
        policy.authenticate(conn, Some(OPERATOR.as_bytes())),
        Err(Refusal::BadToken)
    );
    let walled = AccessPolicy::new(Some(Allowlist::parse("127.0.0.0/8").unwrap()), None);
    assert_eq!(walled.admit(ip("::ffff:127.0.0.1")), Ok(()));
    let refused = walled.admit(ip("::ffff:10.0.0.1")).unwrap_err();
    assert_eq!(
        refused,
        Refusal::PeerNotAllowed {
            peer: ip("10.0.0.1")
        }
    );
    let mut counters = AccessCounters::default();
    counters.record(&refused);
    counters.record(&Refusal::BadToken);
    counters.record(&Refusal::NotAuthenticated { byte: 0 });
    counters.record(&Refusal::QueryNotAllowed {
        query: QueryType::Stats,
    });
    assert_eq!(
        counters,
        AccessCounters {
            refused_peers: 1,
            refused_tokens: 2,
            refused_requests: 1
        }
    );
}

proptest! {
    /// IPv4 matching against a model written with shifts; a mapped peer is matched
    /// exactly as its IPv4 address.
    #[test]
    fn v4_networks_match_the_model(net in any::<u32>(), peer in any::<u32>(), len in 0u8..=32) {
        let list = alloc::format!("{}/{len}", Ipv4Addr::from(net));
        let allow = Allowlist::parse(&list).unwrap();
        let shift = 32 - u32::from(len);
        let model = net.checked_shr(shift).unwrap_or(0) == peer.checked_shr(shift).unwrap_or(0);
        let v4 = Ipv4Addr::from(peer);
        prop_assert_eq!(allow.allows(IpAddr::V4(v4)), model);
        prop_assert_eq!(allow.allows(IpAddr::V6(v4.to_ipv6_mapped())), model);
    }

    #[test]
    fn v6_networks_match_the_model(net in any::<u128>(), peer in any::<u128>(), len in 0u8..=128) {
        let net_addr = Ipv6Addr::from(net);
        prop_assume!(net_addr.to_ipv4_mapped().is_none());
        let peer_addr = Ipv6Addr::from(peer);
        prop_assume!(peer_addr.to_ipv4_mapped().is_none());
        let allow = Allowlist::parse(&alloc::format!("{net_addr}/{len}")).unwrap();
        let shift = 128 - u32::from(len);
        let model = net.checked_shr(shift).unwrap_or(0) == peer.checked_shr(shift).unwrap_or(0);
        prop_assert_eq!(allow.allows(IpAddr::V6(peer_addr)), model);
    }

    /// A prefix-bound token may name a key exactly when the key starts with its prefix.
    #[test]
    fn keys_are_allowed_exactly_under_the_prefix(
        prefix in proptest::collection::vec(any::<u8>().prop_filter("graphic", |b| b.is_ascii_graphic()), 1..6),
        keys in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..8), 1..4),
    ) {
        let prefix = String::from_utf8(prefix).unwrap();
        let text = alloc::format!("{JOB1} {prefix}\n");
        let policy = AccessPolicy::new(None, Some(TokenTable::parse(text.as_bytes()).unwrap()));
        let conn = policy.authenticate(policy.new_connection(), Some(JOB1.as_bytes())).unwrap();
        let keys: Vec<Vec<u8>> = keys.into_iter().map(|k| {
            // Half the keys under the prefix.
            if k.first().is_some_and(|b| b % 2 == 0) { [prefix.as_bytes(), &k].concat() } else { k }
        }).collect();
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let all_inside = refs.iter().all(|k| k.starts_with(prefix.as_bytes()));
        let frame = list_frame(QueryType::Check, &refs);
        prop_assert_eq!(policy.authorize(conn, &frame_of(&frame)).is_ok(), all_inside);
        prop_assert_eq!(
            policy.authorize(conn, &Request::Set { key: refs[0], value: b"" }).is_ok(),
            refs[0].starts_with(prefix.as_bytes())
        );
    }
}

#[test]
fn a_status_grant_reads_the_status_page_and_no_key() {
    const WATCHER: &str = "Wq8c2Lm0Zp5Vw9XyTb1Cf0H3";
    let text = alloc::format!("{}{WATCHER} @status\n", file());
    let policy = AccessPolicy::new(None, Some(TokenTable::parse(text.as_bytes()).unwrap()));
    assert!(policy.grants_status(Some(WATCHER.as_bytes())));
    assert!(policy.grants_status(Some(OPERATOR.as_bytes())));
    assert!(
        !policy.grants_status(Some(JOB1.as_bytes())),
        "a prefix-bound token"
    );
    assert!(!policy.grants_status(Some(b"not-a-token-at-all!!")));
    assert!(!policy.grants_status(None));
    assert!(AccessPolicy::open().grants_status(None), "no tokens: open");
    let watcher = policy
        .authenticate(policy.new_connection(), Some(WATCHER.as_bytes()))
        .unwrap();
    assert_eq!(
        policy.authorize(watcher, &Request::Ping { nonce: 1 }),
        Ok(())
    );
    for request in [Request::Get { key: b"" }, Request::Get { key: b"/job1/k" }] {
        assert_eq!(
            policy.authorize(watcher, &request),
            Err(Refusal::KeyOutsidePrefix {
                query: QueryType::Get
            })
        );
    }
    assert!(policy.authorize(watcher, &Request::ListKeys).is_err());
}
