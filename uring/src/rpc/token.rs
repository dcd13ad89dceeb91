//! `_group_membership_management`: the dynamic group's store token, taken around a
//! join and a leave.

use std::time::Duration;

use rdzv_core::rpc::store_keys::{token_step, RpcKeys, TokenStep, TOKEN_DONE};

use crate::rpc::error::store_error;
use crate::rpc::error::RpcError;
use crate::store::Store;

/// `_group_membership_management`'s acquire: compare-set the group token until it is
/// ours, waiting for the holder's `Done` in between.
pub(crate) fn acquire_token(
    store: &dyn Store,
    keys: &RpcKeys,
    token: &str,
) -> Result<(), RpcError> {
    let key = keys.group_management_token();
    loop {
        let returned = store
            .compare_set(&key, b"", token.as_bytes())
            .map_err(store_error("compare_set", &key))?;
        match token_step(keys, token, &returned) {
            TokenStep::Acquired => return Ok(()),
            TokenStep::WaitFor { key: wait } => {
                store
                    .wait(&[&wait], None)
                    .map_err(store_error("wait", &wait))?;
                if wait == key {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }
}

/// `_group_membership_management`'s release.
pub(crate) fn release_token(
    store: &dyn Store,
    keys: &RpcKeys,
    token: &str,
) -> Result<(), RpcError> {
    let key = keys.group_management_token();
    store.set(&key, b"").map_err(store_error("set", &key))?;
    let done = keys.token_done(token);
    store
        .set(&done, TOKEN_DONE)
        .map_err(store_error("set", &done))
}
