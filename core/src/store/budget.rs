//! How much memory a store server lets its clients make it hold, and how each byte is
//! counted. Every byte a client can pin is in exactly one of three accounts:
//!
//! * **per value** ([`Budget::max_value_bytes`]): a stored value, including what
//!   `APPEND` builds from many small requests, and a queue element;
//! * **in total** ([`Budget::max_store_bytes`]): every key, value and queue element the
//!   store holds, and every key a pending `WAIT` registered, each entry also charged
//!   [`ENTRY_OVERHEAD`] for the map's bookkeeping (so a flood of empty keys is bounded
//!   too);
//! * **per connection** ([`Budget::max_conn_bytes`]): the connection's unfinished request
//!   and its unsent replies. A connection stops being served once its unsent replies
//!   pass [`Budget::out_high_water`] (backpressure), so it pins at most the mark plus
//!   one reply, and a reply that would not fit the budget is never built.
//!
//! A request over an account closes its connection (PyTorch's protocol has no error
//! reply); the store is left as it was. This module only holds the numbers and the
//! arithmetic; the engine charges the store account and `session` the connection one.
//! It does not bound the number of connections: the server's worst case is
//! `max_store_bytes + connections x max_conn_bytes`.

/// Bytes charged per stored entry (a key/value pair, a queue element, a key a `WAIT`
/// registered) beside its own bytes: a hash-map slot, a boxed key and a vector header
/// take about this much.
pub const ENTRY_OVERHEAD: usize = 64;

/// The memory limits of one store server. See the [module docs](self) for the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Most bytes one stored value (or queue element) may hold, `APPEND` included.
    pub max_value_bytes: usize,
    /// Most bytes the store may hold in all (keys, values, queue elements, waited keys,
    /// each plus [`ENTRY_OVERHEAD`]).
    pub max_store_bytes: usize,
    /// Most bytes one connection may hold: its unfinished request plus its unsent
    /// replies.
    pub max_conn_bytes: usize,
    /// A connection whose unsent replies exceed this gets no more requests served until
    /// its peer reads them.
    pub out_high_water: usize,
}

/// PyTorch's libuv value limit (8 MiB), which the codec enforces on the wire too.
pub const DEFAULT_MAX_VALUE_BYTES: usize = 8 << 20;
/// 2 GiB: a PyTorch job keeps kilobytes per rank in its store (addresses, NCCL ids,
/// counters), so this holds 256 values of the largest size PyTorch allows, and a shared
/// host survives a runaway client.
pub const DEFAULT_MAX_STORE_BYTES: usize = 2 << 30;
/// 64 MiB: the largest single request PyTorch's limits allow for one value (8 MiB)
/// several times over, and a `MULTI_GET` of 7 such values.
pub const DEFAULT_MAX_CONN_BYTES: usize = 64 << 20;
/// 4 MiB of unsent replies before a connection stops being served.
pub const DEFAULT_OUT_HIGH_WATER: usize = 4 << 20;

impl Default for Budget {
    fn default() -> Self {
        Budget {
            max_value_bytes: DEFAULT_MAX_VALUE_BYTES,
            max_store_bytes: DEFAULT_MAX_STORE_BYTES,
            max_conn_bytes: DEFAULT_MAX_CONN_BYTES,
            out_high_water: DEFAULT_OUT_HIGH_WATER,
        }
    }
}

impl Budget {
    /// No limits: for an in-process store whose only client is its owner.
    pub const UNLIMITED: Budget = Budget {
        max_value_bytes: usize::MAX,
        max_store_bytes: usize::MAX,
        max_conn_bytes: usize::MAX,
        out_high_water: usize::MAX,
    };

    /// What one entry of `key` and `value` bytes is charged.
    pub const fn entry_cost(key: usize, value: usize) -> usize {
        key.saturating_add(value).saturating_add(ENTRY_OVERHEAD)
    }

    /// Whether a connection that owes `owed` unsent bytes may be served another request.
    pub const fn may_serve(&self, owed: usize) -> bool {
        owed <= self.out_high_water
    }

    /// Whether a reply of `len` bytes fits beside `owed` unsent bytes and `input`
    /// unserved request bytes.
    pub const fn reply_fits(&self, owed: usize, input: usize, len: usize) -> bool {
        owed.saturating_add(input).saturating_add(len) <= self.max_conn_bytes
    }

    /// Whether a request that needs `input` bytes in all fits beside `owed` unsent
    /// bytes.
    pub const fn request_fits(&self, owed: usize, input: usize) -> bool {
        owed.saturating_add(input) <= self.max_conn_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_connection_account_holds_the_mark_plus_one_reply() {
        let budget = Budget {
            max_value_bytes: 100,
            max_store_bytes: 1000,
            max_conn_bytes: 300,
            out_high_water: 100,
        };
        assert!(budget.may_serve(100));
        assert!(!budget.may_serve(101));
        assert!(budget.reply_fits(100, 0, 200));
        assert!(!budget.reply_fits(100, 1, 200));
        assert!(!budget.reply_fits(usize::MAX, 0, 1), "no overflow");
        assert!(budget.request_fits(0, 300));
        assert!(!budget.request_fits(1, 300));
    }

    #[test]
    fn an_entry_costs_its_bytes_and_the_overhead() {
        assert_eq!(Budget::entry_cost(3, 5), 8 + ENTRY_OVERHEAD);
        assert_eq!(Budget::entry_cost(usize::MAX, 1), usize::MAX);
    }
}
