//! `HashStore`: an in-process store, for tests and embedded use.
//!
//! It is the core store engine behind a mutex, so every operation means exactly what it
//! means on the TCP server (libuv semantics: queues, `list_keys`, compare_set waking
//! waiters). Blocking calls (`get`, `wait`, blocking `queue_pop`) sleep on a condition
//! variable that every mutation signals. Keys are stored as given, without the TCP
//! client's `/` prefix, as in PyTorch's `HashStore`.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdzv_core::store::engine::Engine;
use rdzv_core::store::{
    CheckResponse, ConnId, KeyList, PairList, Request, Response, VALIDATION_MAGIC,
};

use super::{Store, StoreError, DEFAULT_TIMEOUT};

/// The one connection id the in-process store speaks to its engine with.
const SELF: ConnId = ConnId(0);

struct Shared {
    engine: Mutex<Engine>,
    changed: Condvar,
    timeout: Mutex<Duration>,
}

/// An in-process store. Cloning (or [`Store::clone_store`]) shares the same data.
#[derive(Clone)]
pub struct HashStore {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for HashStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HashStore").finish_non_exhaustive()
    }
}

impl Default for HashStore {
    fn default() -> Self {
        HashStore::new()
    }
}

fn key_list(keys: &[&str]) -> Vec<u8> {
    let mut out = Vec::with_capacity(keys.iter().map(|k| k.len() + 8).sum());
    for k in keys {
        out.extend_from_slice(&(k.len() as u64).to_le_bytes());
        out.extend_from_slice(k.as_bytes());
    }
    out
}

impl HashStore {
    /// An empty store with PyTorch's default timeout (300 s).
    pub fn new() -> Self {
        let mut engine = Engine::new();
        engine.connect(SELF);
        let validated = engine.handle_request(
            SELF,
            Request::Validate {
                magic: VALIDATION_MAGIC,
            },
        );
        debug_assert!(validated.is_ok());
        HashStore {
            shared: Arc::new(Shared {
                engine: Mutex::new(engine),
                changed: Condvar::new(),
                timeout: Mutex::new(DEFAULT_TIMEOUT),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Engine> {
        self.shared.engine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs one request on the engine and maps its reply with `f`; wakes blocked callers
    /// if it may have changed something.
    fn run<T>(
        &self,
        request: Request<'_>,
        mutates: bool,
        f: impl FnOnce(Option<Response<'_>>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut engine = self.lock();
        let result = match engine.handle_request(SELF, request) {
            Ok(outcome) => f(outcome.reply),
            Err(close) => Err(StoreError::InvalidArgument(close.to_string())),
        };
        // The in-process store never registers engine waits, so nothing is owed.
        while engine.poll_wakeup().is_some() {}
        drop(engine);
        if mutates {
            self.shared.changed.notify_all();
        }
        result
    }

    fn present(engine: &mut Engine, keys: &[&str], encoded: &[u8]) -> bool {
        let Some(list) = KeyList::new(keys.len(), encoded) else {
            return false;
        };
        matches!(
            engine.handle_request(SELF, Request::Check { keys: list }),
            Ok(outcome) if outcome.reply == Some(Response::Check(CheckResponse::Ready))
        )
    }

    /// Blocks until every key is present or `timeout` passes (zero waits forever, as
    /// PyTorch's HashStore does).
    fn wait_present(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let encoded = key_list(keys);
        let deadline = (!timeout.is_zero()).then(|| Instant::now() + timeout);
        let mut engine = self.lock();
        loop {
            if Self::present(&mut engine, keys, &encoded) {
                return Ok(());
            }
            engine = match deadline {
                None => self
                    .shared
                    .changed
                    .wait(engine)
                    .unwrap_or_else(|p| p.into_inner()),
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(StoreError::Timeout {
                            ms: timeout.as_millis(),
                            keys: keys.iter().map(|k| k.to_string()).collect(),
                        });
                    }
                    self.shared
                        .changed
                        .wait_timeout(engine, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
    }
}

impl Store for HashStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.run(
            Request::Set {
                key: key.as_bytes(),
                value,
            },
            true,
            |_| Ok(()),
        )
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        self.wait_present(&[key], self.timeout())?;
        self.run(
            Request::Get {
                key: key.as_bytes(),
            },
            false,
            |r| match r {
                Some(Response::Value(v)) => Ok(v.to_vec()),
                other => Err(unexpected("GET", other)),
            },
        )
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let mut engine = self.lock();
        let result = match engine.handle_request(
            SELF,
            Request::Add {
                key: key.as_bytes(),
                delta,
            },
        ) {
            Ok(outcome) => match outcome.reply {
                Some(Response::Int(v)) => Ok(v),
                other => Err(unexpected("ADD", other)),
            },
            Err(close) => Err(StoreError::NotACounter {
                key: key.to_string(),
                detail: close.to_string(),
            }),
        };
        // A failed ADD closes the engine's connection; open it again.
        if result.is_err() {
            engine.connect(SELF);
            let _ = engine.handle_request(
                SELF,
                Request::Validate {
                    magic: VALIDATION_MAGIC,
                },
            );
        }
        drop(engine);
        self.shared.changed.notify_all();
        result
    }

    fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        self.run(
            Request::CompareSet {
                key: key.as_bytes(),
                expected,
                desired,
            },
            true,
            |r| match r {
                Some(Response::Value(v)) => Ok(v.to_vec()),
                other => Err(unexpected("COMPARE_SET", other)),
            },
        )
    }

    fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let encoded = key_list(keys);
        Ok(Self::present(&mut self.lock(), keys, &encoded))
    }

    fn wait(&self, keys: &[&str], timeout: Option<Duration>) -> Result<(), StoreError> {
        self.wait_present(keys, timeout.unwrap_or_else(|| self.timeout()))
    }

    fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        self.run(
            Request::DeleteKey {
                key: key.as_bytes(),
            },
            true,
            |r| match r {
                Some(Response::Int(n)) => Ok(n == 1),
                other => Err(unexpected("DELETE_KEY", other)),
            },
        )
    }

    fn num_keys(&self) -> Result<i64, StoreError> {
        self.run(Request::GetNumKeys, false, |r| match r {
            Some(Response::Int(n)) => Ok(n),
            other => Err(unexpected("GETNUMKEYS", other)),
        })
    }

    fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.run(
            Request::Append {
                key: key.as_bytes(),
                value,
            },
            true,
            |_| Ok(()),
        )
    }

    fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError> {
        self.wait_present(keys, self.timeout())?;
        let encoded = key_list(keys);
        let list = KeyList::new(keys.len(), &encoded)
            .ok_or_else(|| StoreError::InvalidArgument("key list".into()))?;
        self.run(Request::MultiGet { keys: list }, false, |r| match r {
            Some(Response::Values(values)) => Ok(values.into_iter().map(<[u8]>::to_vec).collect()),
            other => Err(unexpected("MULTI_GET", other)),
        })
    }

    fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), StoreError> {
        let mut encoded = Vec::new();
        for (k, v) in pairs {
            encoded.extend_from_slice(&(k.len() as u64).to_le_bytes());
            encoded.extend_from_slice(k.as_bytes());
            encoded.extend_from_slice(&(v.len() as u64).to_le_bytes());
            encoded.extend_from_slice(v);
        }
        let list = PairList::new(pairs.len(), &encoded)
            .ok_or_else(|| StoreError::InvalidArgument("pair list".into()))?;
        self.run(Request::MultiSet { pairs: list }, true, |_| Ok(()))
    }

    fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.run(
            Request::QueuePush {
                key: key.as_bytes(),
                value,
            },
            true,
            |_| Ok(()),
        )
    }

    fn queue_pop(&self, key: &str, block: bool) -> Result<Vec<u8>, StoreError> {
        let timeout = self.timeout();
        let deadline = Instant::now() + timeout;
        loop {
            if block {
                let left = if timeout.is_zero() {
                    Duration::ZERO
                } else {
                    deadline
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_nanos(1))
                };
                self.wait_present(&[key], left)?;
            }
            let popped = self.run(
                Request::QueuePop {
                    key: key.as_bytes(),
                },
                true,
                |r| match r {
                    Some(Response::QueuePop { value, .. }) => Ok(value.map(<[u8]>::to_vec)),
                    other => Err(unexpected("QUEUE_POP", other)),
                },
            )?;
            match popped {
                Some(v) => return Ok(v),
                // Another thread took the element between the wait and the pop.
                None if block => continue,
                None => return Err(StoreError::QueueEmpty),
            }
        }
    }

    fn queue_len(&self, key: &str) -> Result<i64, StoreError> {
        self.run(
            Request::QueueLen {
                key: key.as_bytes(),
            },
            false,
            |r| match r {
                Some(Response::Int(n)) => Ok(n),
                other => Err(unexpected("QUEUE_LEN", other)),
            },
        )
    }

    fn list_keys(&self) -> Result<Vec<String>, StoreError> {
        self.run(Request::ListKeys, false, |r| match r {
            Some(Response::Keys(keys)) => Ok(keys
                .into_iter()
                .map(|k| String::from_utf8_lossy(k).into_owned())
                .collect()),
            other => Err(unexpected("LIST_KEYS", other)),
        })
    }

    fn timeout(&self) -> Duration {
        *self
            .shared
            .timeout
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    fn set_timeout(&self, timeout: Duration) {
        *self
            .shared
            .timeout
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = timeout;
    }

    fn clone_store(&self) -> Result<Box<dyn Store>, StoreError> {
        Ok(Box::new(self.clone()))
    }
}

fn unexpected(query: &str, reply: Option<Response<'_>>) -> StoreError {
    StoreError::InvalidArgument(format!(
        "store engine gave {query} an unexpected reply {reply:?}"
    ))
}
