//! Keys kept as one etcd key per write, for values that many clients write at once: a
//! *tally* (a counter that only grows by fixed units) and a *log* (a value that only
//! grows by appended lines). The elastic rendezvous keeps a round's arrivals,
//! acknowledgements and roster this way (`rdzv_core::rendezvous::elastic::key_use`).
//!
//! As one value, every write of such a key is a compare-and-swap transaction, and N
//! clients writing at once make each loser retry: O(N) requests each. Spread out, every
//! write creates a key of its own and never conflicts:
//! - a tally `K` with units `u…` is the keys `K\0t{u:016x}/{id}`; an increment by `u` is
//!   one transaction that creates `…{u:016x}/{id}` and counts every unit's keys *after*
//!   that write (etcd's reads inside a transaction see its earlier writes), so the reply
//!   is the value as of that increment, as `ADD` gives it. A read counts the units' keys in
//!   one transaction.
//! - a log `K` is the keys `K\0l{id}`; an append puts one, and a read ranges over them in
//!   the order they were created (`create_revision`) and concatenates them.
//!
//! `{id}` is 128 random bits, drawn once per write, so a write resent after a lost answer
//! rewrites its own key instead of counting twice: an increment's transaction is guarded
//! by "my key is still missing", and when that compare fails, the lost copy applied, and
//! its value is read back as of the revision it was created at.
//!
//! These keys contain NUL, so they are not user keys (`NUM_KEYS` and `LIST_KEYS` skip
//! them). A tally and a log are only for clients that agree on them; nothing here is
//! PyTorch's semantics, which the [`Store`](super::Store) methods keep.

use serde_json::{json, Value};

use super::gateway::{b64, prefix_end, RangeReply};
use super::{put_op, range_op, unchanged, EtcdStore, StoreError};

/// 128 random bits as hex: a write's own key.
fn write_id() -> String {
    format!("{:032x}", fastrand::u128(..))
}

impl EtcdStore {
    /// `full` + `\0` + `tag`: where a spread key's parts live.
    fn spread_prefix(&self, key: &str, tag: &str) -> Result<Vec<u8>, StoreError> {
        let mut prefix = self.key(key)?;
        prefix.push(0);
        prefix.extend_from_slice(tag.as_bytes());
        Ok(prefix)
    }

    fn unit_prefixes(&self, key: &str, units: &[i64]) -> Result<Vec<Vec<u8>>, StoreError> {
        units
            .iter()
            .map(|unit| self.spread_prefix(key, &format!("t{unit:016x}/")))
            .collect()
    }

    /// Adds `delta` (0, a read, or exactly one of `units`) to the tally `key` and returns
    /// its value as of this write: the sum over `units` of the unit times its count. One
    /// transaction, whatever other clients do at the same time.
    pub fn tally_add(&self, key: &str, delta: i64, units: &[i64]) -> Result<i64, StoreError> {
        if delta != 0 && !units.contains(&delta) {
            return Err(StoreError::InvalidArgument(format!(
                "etcd tally {key}: an increment must be one of the units {units:?}, not {delta}"
            )));
        }
        self.check_ops("tally add", units.len() + 1)?;
        let prefixes = self.unit_prefixes(key, units)?;
        let counts = |revision: Option<i64>| -> Vec<Value> {
            prefixes
                .iter()
                .map(|prefix| {
                    let mut range =
                        json!({"key": b64(prefix), "range_end": b64(&prefix_end(prefix))});
                    match revision {
                        // etcd's `count` ignores the create-revision filter: count the
                        // keys it returns instead.
                        Some(revision) => {
                            range["keys_only"] = Value::Bool(true);
                            range["max_create_revision"] = Value::String(revision.to_string());
                        }
                        None => range["count_only"] = Value::Bool(true),
                    }
                    json!({ "request_range": range })
                })
                .collect()
        };
        let deadline = self.request_deadline();
        let sum = |ranges: &[Option<&RangeReply>], filtered: bool| -> i64 {
            units
                .iter()
                .zip(ranges)
                .map(|(unit, range)| {
                    let count = range.map_or(0, |r| {
                        if filtered {
                            r.kvs.len() as i64
                        } else {
                            r.count
                        }
                    });
                    unit.saturating_mul(count)
                })
                .fold(0i64, i64::saturating_add)
        };
        let Some(unit_index) = units.iter().position(|u| *u == delta) else {
            let reply = self.txn(Vec::new(), counts(None), Vec::new(), deadline)?;
            let ranges: Vec<_> = reply
                .responses
                .iter()
                .map(|r| r.response_range.as_ref())
                .collect();
            return Ok(sum(&ranges, false));
        };
        let mut mine = prefixes[unit_index].clone();
        mine.extend_from_slice(write_id().as_bytes());
        let mut success = vec![put_op(&mine, b"")];
        success.extend(counts(None));
        let reply = self.txn(
            vec![unchanged(&mine, &None)],
            success,
            vec![range_op(&mine, None, false)],
            deadline,
        )?;
        if reply.succeeded {
            let ranges: Vec<_> = reply
                .responses
                .iter()
                .skip(1)
                .map(|r| r.response_range.as_ref())
                .collect();
            return Ok(sum(&ranges, false));
        }
        // A copy sent earlier applied (its answer was lost): the value as of its write.
        let created = reply
            .responses
            .first()
            .and_then(|r| r.response_range.as_ref())
            .and_then(|r| r.kvs.first())
            .map(|kv| kv.create_revision)
            .ok_or_else(|| StoreError::Protocol {
                peer: self.gateway.endpoints(),
                detail: format!(
                    "etcd tally {key}: the increment's key is neither missing nor present"
                ),
            })?;
        let reply = self.txn(Vec::new(), counts(Some(created)), Vec::new(), deadline)?;
        let ranges: Vec<_> = reply
            .responses
            .iter()
            .map(|r| r.response_range.as_ref())
            .collect();
        Ok(sum(&ranges, true))
    }

    /// Appends `value` to the log `key` as a key of its own: one put, never a conflict.
    pub fn log_append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.check_size("log append", &[(key, value)])?;
        let mut mine = self.spread_prefix(key, "l")?;
        mine.extend_from_slice(write_id().as_bytes());
        self.txn(
            Vec::new(),
            vec![put_op(&mine, value)],
            Vec::new(),
            self.request_deadline(),
        )
        .map(drop)
    }

    /// The log `key`: its appended values in the order they were written (empty if none).
    pub fn log_read(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        let prefix = self.spread_prefix(key, "l")?;
        let body = json!({"key": b64(&prefix), "range_end": b64(&prefix_end(&prefix)),
            "sort_target": "CREATE", "sort_order": "ASCEND"});
        let reply = self.range(body, self.request_deadline())?;
        let mut log = Vec::new();
        for kv in reply.kvs {
            log.extend_from_slice(&kv.value);
        }
        Ok(log)
    }
}
