//! `_group_membership_management`: the dynamic group's store token, taken around a
//! member's join and leave, as two machines over store operations in the vocabulary of
//! [`super::shutdown`] ([`Action`], [`Outcome`]), so that one driver runs them all.
//!
//! - [`TokenAcquire`]: `compare_set(RpcGroupManagementToken, "", my_token)` until the
//!   reply is `my_token`; while another member holds it, `wait` for that member's
//!   `{its_token}` "Done" key, then try again. An empty reply cannot come from that
//!   compare-set ([`token_step`]): the machine then waits for the management key itself
//!   and pauses [`RETRY_PAUSE_MS`] before trying again, so that it never spins.
//! - [`TokenRelease`]: `set(RpcGroupManagementToken, "")`, then `set({my_token}, "Done")`.
//!
//! The machines take no time themselves: the pause is an action, timed by the runtime.

use alloc::string::{String, ToString};

use super::shutdown::{Action, JoinError, Outcome};
use super::store_keys::{token_step, RpcKeys, TokenStep, TOKEN_DONE};

/// How long [`TokenAcquire`] pauses before it tries again after waiting for the
/// management key itself.
pub const RETRY_PAUSE_MS: u64 = 10;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Acquiring {
    CompareSet,
    Wait { key: String, then_pause: bool },
    Pause,
    Acquired,
    Failed,
}

/// Takes the group token for `my_token` (see the module documentation).
#[derive(Debug, Clone)]
pub struct TokenAcquire {
    keys: RpcKeys,
    key: String,
    token: String,
    state: Acquiring,
    error: Option<JoinError>,
}

impl TokenAcquire {
    /// Starts taking the token of the group under `keys` for `my_token`
    /// ([`membership_token`](super::store_keys::membership_token)).
    pub fn new(keys: &RpcKeys, my_token: &str) -> TokenAcquire {
        TokenAcquire {
            keys: keys.clone(),
            key: keys.group_management_token(),
            token: my_token.to_string(),
            state: Acquiring::CompareSet,
            error: None,
        }
    }

    /// What the runtime must do next.
    pub fn poll_action(&self) -> Action<'_> {
        match &self.state {
            Acquiring::CompareSet => Action::StoreCompareSet {
                key: &self.key,
                expected: b"",
                desired: self.token.as_bytes(),
            },
            Acquiring::Wait { key, .. } => Action::StoreWait { key },
            Acquiring::Pause => Action::Pause {
                millis: RETRY_PAUSE_MS,
            },
            Acquiring::Acquired => Action::Done,
            Acquiring::Failed => Action::Failed,
        }
    }

    /// Takes the outcome of the last action.
    ///
    /// # Errors
    /// [`JoinError::UnexpectedOutcome`] when `outcome` does not answer the pending action
    /// (a driver bug); the machine has failed then.
    pub fn handle(&mut self, outcome: Outcome<'_>) -> Result<(), JoinError> {
        let state = core::mem::replace(&mut self.state, Acquiring::Failed);
        self.state = match (state, outcome) {
            (Acquiring::CompareSet, Outcome::Compared(returned)) => {
                match token_step(&self.keys, &self.token, returned) {
                    TokenStep::Acquired => Acquiring::Acquired,
                    TokenStep::WaitFor { key } => Acquiring::Wait {
                        then_pause: key == self.key,
                        key,
                    },
                }
            }
            (Acquiring::Wait { then_pause, .. }, Outcome::Waited) => {
                if then_pause {
                    Acquiring::Pause
                } else {
                    Acquiring::CompareSet
                }
            }
            (Acquiring::Pause, Outcome::Paused) => Acquiring::CompareSet,
            (state, got) => {
                let error = JoinError::UnexpectedOutcome {
                    expected: acquiring_action(&state),
                    got: got.name(),
                };
                self.error = Some(error.clone());
                return Err(error);
            }
        };
        Ok(())
    }

    /// Whether the token is held.
    pub fn is_acquired(&self) -> bool {
        self.state == Acquiring::Acquired
    }

    /// Why the machine failed, once it has.
    pub fn error(&self) -> Option<&JoinError> {
        self.error.as_ref()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Releasing {
    Clear,
    MarkDone,
    Released,
    Failed,
}

/// The name of the action a state waits on, for errors.
fn acquiring_action(state: &Acquiring) -> &'static str {
    match state {
        Acquiring::CompareSet => "store compare_set",
        Acquiring::Wait { .. } => "store wait",
        Acquiring::Pause => "pause",
        Acquiring::Acquired => "done",
        Acquiring::Failed => "failed",
    }
}

/// Gives the group token back (see the module documentation).
#[derive(Debug, Clone)]
pub struct TokenRelease {
    key: String,
    done_key: String,
    state: Releasing,
    error: Option<JoinError>,
}

impl TokenRelease {
    /// Starts giving back the token of the group under `keys` that `my_token` holds.
    pub fn new(keys: &RpcKeys, my_token: &str) -> TokenRelease {
        TokenRelease {
            key: keys.group_management_token(),
            done_key: keys.token_done(my_token),
            state: Releasing::Clear,
            error: None,
        }
    }

    /// What the runtime must do next.
    pub fn poll_action(&self) -> Action<'_> {
        match self.state {
            Releasing::Clear => Action::StoreSet {
                key: &self.key,
                value: b"",
            },
            Releasing::MarkDone => Action::StoreSet {
                key: &self.done_key,
                value: TOKEN_DONE,
            },
            Releasing::Released => Action::Done,
            Releasing::Failed => Action::Failed,
        }
    }

    /// Takes the outcome of the last action.
    ///
    /// # Errors
    /// [`JoinError::UnexpectedOutcome`] when `outcome` does not answer the pending action
    /// (a driver bug); the machine has failed then.
    pub fn handle(&mut self, outcome: Outcome<'_>) -> Result<(), JoinError> {
        self.state = match (self.state, outcome) {
            (Releasing::Clear, Outcome::Set) => Releasing::MarkDone,
            (Releasing::MarkDone, Outcome::Set) => Releasing::Released,
            (_, got) => {
                let error = JoinError::UnexpectedOutcome {
                    expected: self.poll_action().name(),
                    got: got.name(),
                };
                self.state = Releasing::Failed;
                self.error = Some(error.clone());
                return Err(error);
            }
        };
        Ok(())
    }

    /// Why the machine failed, once it has.
    pub fn error(&self) -> Option<&JoinError> {
        self.error.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::store_keys::{membership_token, Membership};
    use crate::store::semantics::compare_set;
    use alloc::collections::BTreeMap;
    use alloc::vec::Vec;
    use proptest::prelude::*;

    /// One member's way through acquire, hold, release.
    enum Member {
        Acquiring(TokenAcquire),
        Holding(TokenRelease),
        Releasing(TokenRelease),
        Done,
    }

    /// A store and a virtual clock that the members' actions run against.
    #[derive(Default)]
    struct World {
        store: BTreeMap<String, Vec<u8>>,
        now_ms: u64,
    }

    impl World {
        /// Runs `action`; `None` while it blocks (a wait for a missing key).
        fn run(&mut self, action: Action<'_>) -> Option<Outcome<'static>> {
            Some(match action {
                Action::StoreCompareSet {
                    key,
                    expected,
                    desired,
                } => {
                    let current = self.store.get(key).cloned();
                    let decided = compare_set(current.as_deref(), expected, desired);
                    let (writes, reply) = (decided.writes(), decided.reply().to_vec());
                    if writes {
                        self.store.insert(key.to_string(), desired.to_vec());
                    }
                    Outcome::Compared(Vec::leak(reply))
                }
                Action::StoreWait { key } => {
                    self.store.contains_key(key).then_some(())?;
                    Outcome::Waited
                }
                Action::StoreSet { key, value } => {
                    self.store.insert(key.to_string(), value.to_vec());
                    Outcome::Set
                }
                Action::Pause { millis } => {
                    self.now_ms += millis;
                    Outcome::Paused
                }
                other => panic!("the token machines never ask for {}", other.name()),
            })
        }
    }

    /// Steps member `m` once, if it can move.
    fn step(world: &mut World, keys: &RpcKeys, members: &mut [Member], m: usize) {
        let token = membership_token(&alloc::format!("w{m}"), Membership::Join);
        let next = match &mut members[m] {
            Member::Acquiring(machine) => {
                let Some(outcome) = world.run(machine.poll_action()) else {
                    return;
                };
                machine.handle(outcome).expect("outcomes answer actions");
                machine
                    .is_acquired()
                    .then(|| Member::Holding(TokenRelease::new(keys, &token)))
            }
            Member::Holding(release) => Some(Member::Releasing(release.clone())),
            Member::Releasing(machine) => {
                let outcome = world.run(machine.poll_action()).expect("sets never block");
                machine.handle(outcome).expect("outcomes answer actions");
                (machine.poll_action() == Action::Done).then_some(Member::Done)
            }
            Member::Done => None,
        };
        if let Some(next) = next {
            members[m] = next;
        }
    }

    fn members(keys: &RpcKeys, n: usize) -> Vec<Member> {
        (0..n)
            .map(|m| {
                let token = membership_token(&alloc::format!("w{m}"), Membership::Join);
                Member::Acquiring(TokenAcquire::new(keys, &token))
            })
            .collect()
    }

    proptest! {
        /// Under any interleaving at most one member holds the token, and once the
        /// schedule ends, running the members in turn lets every one of them through.
        #[test]
        fn one_holder_at_a_time_and_everyone_gets_through(
            n in 2usize..5,
            schedule in proptest::collection::vec(0usize..4, 0..200),
        ) {
            let keys = RpcKeys::new(0);
            let mut world = World::default();
            let mut members = members(&keys, n);
            for m in schedule.into_iter().filter(|m| *m < n) {
                step(&mut world, &keys, &mut members, m);
                // The join or leave runs while holding; releasing starts by clearing
                // the token, after which the next member may take it.
                let holding = members
                    .iter()
                    .filter(|m| matches!(m, Member::Holding(_)))
                    .count();
                prop_assert!(holding <= 1, "{holding} members hold the token");
            }
            for _ in 0..(n * 20) {
                for m in 0..n {
                    step(&mut world, &keys, &mut members, m);
                }
            }
            prop_assert!(members.iter().all(|m| matches!(m, Member::Done)));
        }
    }

    #[test]
    fn a_free_token_is_taken_at_once_and_released_in_two_sets() {
        let keys = RpcKeys::new(3);
        let token = membership_token("a", Membership::Join);
        let mut acquire = TokenAcquire::new(&keys, &token);
        let key = keys.group_management_token();
        assert_eq!(
            acquire.poll_action(),
            Action::StoreCompareSet {
                key: &key,
                expected: b"",
                desired: token.as_bytes()
            }
        );
        acquire
            .handle(Outcome::Compared(token.as_bytes()))
            .expect("answers the compare-set");
        assert!(acquire.is_acquired());
        assert_eq!(acquire.poll_action(), Action::Done);

        let mut release = TokenRelease::new(&keys, &token);
        assert_eq!(
            release.poll_action(),
            Action::StoreSet {
                key: &key,
                value: b""
            }
        );
        release.handle(Outcome::Set).expect("answers the set");
        let done = keys.token_done(&token);
        assert_eq!(
            release.poll_action(),
            Action::StoreSet {
                key: &done,
                value: TOKEN_DONE
            }
        );
        release.handle(Outcome::Set).expect("answers the set");
        assert_eq!(release.poll_action(), Action::Done);
    }

    #[test]
    fn a_held_token_is_waited_for_and_an_empty_reply_pauses() {
        let keys = RpcKeys::new(0);
        let mut acquire = TokenAcquire::new(&keys, "Token_for_b_join");
        acquire
            .handle(Outcome::Compared(b"Token_for_a_join"))
            .expect("answers the compare-set");
        let theirs = keys.token_done("Token_for_a_join");
        assert_eq!(acquire.poll_action(), Action::StoreWait { key: &theirs });
        acquire.handle(Outcome::Waited).expect("answers the wait");
        assert!(matches!(
            acquire.poll_action(),
            Action::StoreCompareSet { .. }
        ));
        // An empty reply: wait for the management key, pause, then try again.
        acquire
            .handle(Outcome::Compared(b""))
            .expect("answers the compare-set");
        let key = keys.group_management_token();
        assert_eq!(acquire.poll_action(), Action::StoreWait { key: &key });
        acquire.handle(Outcome::Waited).expect("answers the wait");
        assert_eq!(
            acquire.poll_action(),
            Action::Pause {
                millis: RETRY_PAUSE_MS
            }
        );
        acquire.handle(Outcome::Paused).expect("answers the pause");
        assert!(matches!(
            acquire.poll_action(),
            Action::StoreCompareSet { .. }
        ));
    }

    #[test]
    fn a_wrong_outcome_fails_the_machine() {
        let keys = RpcKeys::new(0);
        let mut acquire = TokenAcquire::new(&keys, "Token_for_a_join");
        let error = acquire.handle(Outcome::Set).expect_err("not an answer");
        assert_eq!(
            error,
            JoinError::UnexpectedOutcome {
                expected: "store compare_set",
                got: "set"
            }
        );
        assert_eq!(acquire.poll_action(), Action::Failed);
        assert_eq!(acquire.error(), Some(&error));
        let mut release = TokenRelease::new(&keys, "Token_for_a_join");
        assert!(release.handle(Outcome::Waited).is_err());
        assert_eq!(release.poll_action(), Action::Failed);
    }
}
