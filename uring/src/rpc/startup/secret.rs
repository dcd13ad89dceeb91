//! The group secret a worker starts with ([`RpcSecret`]): given, from the environment,
//! or shared through the rendezvous store; core's `rpc::auth` decides what it proves.

use std::sync::Arc;

use rdzv_core::rpc::auth::check_secret;
use rdzv_core::rpc::store_keys::RpcKeys;

use crate::rpc::error::{store_error, InitError};
use crate::rpc::options::RpcSecret;
use crate::store::Store;

/// The secret itself, when the environment gives one.
pub(crate) const SECRET_ENV: &str = "RDZV_RPC_SECRET";
/// A file holding the secret (its first line), when the environment names one.
pub(crate) const SECRET_FILE_ENV: &str = "RDZV_RPC_SECRET_FILE";
/// The most a secret file may hold.
const MAX_SECRET_FILE_BYTES: u64 = 4096;
/// The length of a secret a worker makes for the group.
const MADE_LEN: usize = 32;

/// The secret this worker proves and checks with, `None` for [`RpcSecret::Disabled`].
///
/// # Errors
/// [`InitError::InvalidOption`] for a secret too short, an unreadable file or no random
/// source; the store's error when it cannot share one.
pub(super) fn group_secret(
    choice: &RpcSecret,
    store: &dyn Store,
    keys: &RpcKeys,
) -> Result<Option<Arc<[u8]>>, InitError> {
    let secret = match choice {
        RpcSecret::Disabled => return Ok(None),
        RpcSecret::Given(secret) => secret.clone(),
        RpcSecret::Shared => match from_env()? {
            Some(secret) => secret,
            None => shared(store, keys)?,
        },
    };
    check_secret(&secret).map_err(|e| invalid(e.to_string()))?;
    Ok(Some(secret.into()))
}

fn invalid(reason: String) -> InitError {
    InitError::InvalidOption {
        option: "secret",
        reason,
    }
}

/// `RDZV_RPC_SECRET`, else the first line of `RDZV_RPC_SECRET_FILE`.
fn from_env() -> Result<Option<Vec<u8>>, InitError> {
    if let Some(secret) = std::env::var_os(SECRET_ENV).filter(|s| !s.is_empty()) {
        return Ok(Some(secret.into_encoded_bytes()));
    }
    let Some(path) = std::env::var_os(SECRET_FILE_ENV).filter(|s| !s.is_empty()) else {
        return Ok(None);
    };
    // At most a few KiB: the file names a secret, not a stream (`/dev/zero` must not
    // fill memory).
    let shown = std::path::Path::new(&path).display().to_string();
    let mut text = Vec::new();
    std::fs::File::open(&path)
        .and_then(|file| {
            use std::io::Read;
            file.take(MAX_SECRET_FILE_BYTES + 1).read_to_end(&mut text)
        })
        .map_err(|e| invalid(format!("cannot read {SECRET_FILE_ENV}={shown}: {e}")))?;
    if text.len() as u64 > MAX_SECRET_FILE_BYTES {
        return Err(invalid(format!(
            "{SECRET_FILE_ENV}={shown} is longer than {MAX_SECRET_FILE_BYTES} bytes: it must \
             hold the secret on its first line"
        )));
    }
    let line = text.split(|&b| b == b'\n').next().unwrap_or_default();
    Ok(Some(line.strip_suffix(b"\r").unwrap_or(line).to_vec()))
}

/// The secret of the group's store: this worker's fresh one if it is first, else the one
/// already there (one compare-set either way).
fn shared(store: &dyn Store, keys: &RpcKeys) -> Result<Vec<u8>, InitError> {
    let mut made = [0u8; MADE_LEN];
    getrandom::fill(&mut made)
        .map_err(|e| invalid(format!("the operating system's random source failed: {e}")))?;
    let key = keys.group_secret();
    let held = store
        .compare_set(&key, b"", &made)
        .map_err(store_error("compare_set", &key))?;
    Ok(held)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::hash::HashStore;

    #[test]
    fn the_first_worker_makes_the_secret_and_the_others_read_it() {
        let store = HashStore::new();
        let keys = RpcKeys::new(0);
        let first = group_secret(&RpcSecret::Shared, &store, &keys)
            .unwrap()
            .unwrap();
        let second = group_secret(&RpcSecret::Shared, &store, &keys)
            .unwrap()
            .unwrap();
        assert_eq!(first.len(), MADE_LEN);
        assert_eq!(first, second);
        // Another group (another init counter) gets another.
        let other = group_secret(&RpcSecret::Shared, &store, &RpcKeys::new(1))
            .unwrap()
            .unwrap();
        assert_ne!(first, other);
    }

    #[test]
    fn a_given_secret_is_checked_and_disabled_is_none() {
        let store = HashStore::new();
        let keys = RpcKeys::new(0);
        let given = RpcSecret::Given(b"sixteen bytes ok".to_vec());
        assert_eq!(
            &*group_secret(&given, &store, &keys).unwrap().unwrap(),
            b"sixteen bytes ok"
        );
        let short = group_secret(&RpcSecret::Given(b"short".to_vec()), &store, &keys);
        assert!(
            matches!(&short, Err(e) if e.to_string().contains("at least 16")),
            "{short:?}"
        );
        assert!(group_secret(&RpcSecret::Disabled, &store, &keys)
            .unwrap()
            .is_none());
    }
}
