//! Which RDMA device, port and GID the user asked for.
//!
//! This module decides how the `RDZV_IB_DEVICE`, `RDZV_IB_PORT` and `RDZV_IB_GID_INDEX`
//! environment variables (or the same fields set in code) become an [`IbvConfig`], and which
//! values are rejected. It does not read the process environment by itself unless asked
//! through [`IbvConfig::from_process_env`]: [`IbvConfig::from_env`] takes a lookup closure so
//! that tests and embedders never have to mutate the environment. It does not check that the
//! device, port or GID exists; that is [`select`](super::select)'s job.

use std::ffi::OsStr;

/// Environment variable naming the RDMA device to use, e.g. `mlx5_0` or `rxe0`.
pub const ENV_DEVICE: &str = "RDZV_IB_DEVICE";
/// Environment variable naming the 1-based physical port number to use, e.g. `1`.
pub const ENV_PORT: &str = "RDZV_IB_PORT";
/// Environment variable naming the GID table index to use, e.g. `3`.
pub const ENV_GID_INDEX: &str = "RDZV_IB_GID_INDEX";

/// Longest device name libibverbs produces (`IBV_SYSFS_NAME_MAX` is 64 bytes including
/// the terminating NUL).
const MAX_DEVICE_NAME_LEN: usize = 63;

/// The user's choice of RDMA device, port and GID. `None` means "pick automatically".
///
/// Automatic choice (see [`select`](super::select::select)): the first device, in
/// libibverbs order, with an `ACTIVE` port; for an Ethernet (RoCE) port the RoCE v2 GID that
/// carries an IPv4 address, for an InfiniBand port GID index 0.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IbvConfig {
    /// Device name as libibverbs reports it (`ibv_get_device_name`), e.g. `mlx5_0`.
    pub device: Option<String>,
    /// 1-based physical port number.
    pub port: Option<u8>,
    /// Index into the port's GID table.
    pub gid_index: Option<u32>,
}

/// A configuration value that could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IbvConfigError {
    /// The variable is set but is not valid UTF-8.
    #[error("{var} is not valid UTF-8")]
    NotUnicode {
        /// The environment variable.
        var: &'static str,
    },
    /// The variable is set to something that is not a valid value.
    #[error("{var}={value:?} is not valid: expected {expected}")]
    InvalidValue {
        /// The environment variable.
        var: &'static str,
        /// The value as it was found (before trimming).
        value: String,
        /// What a valid value looks like.
        expected: &'static str,
    },
}

impl IbvConfig {
    /// Reads the configuration through `lookup`, which maps an environment variable name to
    /// its value (or `None` when unset). A variable that is set to an empty (or all
    /// whitespace) string counts as unset; surrounding whitespace is ignored.
    ///
    /// ```
    /// use rdzv_rdma::ibv::IbvConfig;
    /// let cfg = IbvConfig::from_env(|var| match var {
    ///     "RDZV_IB_DEVICE" => Some("mlx5_1"),
    ///     "RDZV_IB_PORT" => Some("2"),
    ///     _ => None,
    /// })
    /// .unwrap();
    /// assert_eq!(cfg.device.as_deref(), Some("mlx5_1"));
    /// assert_eq!(cfg.port, Some(2));
    /// assert_eq!(cfg.gid_index, None);
    /// ```
    pub fn from_env<F, V>(mut lookup: F) -> Result<Self, IbvConfigError>
    where
        F: FnMut(&str) -> Option<V>,
        V: AsRef<OsStr>,
    {
        let device = read_var(&mut lookup, ENV_DEVICE)?
            .map(|value| parse_device(&value))
            .transpose()?;
        let port = read_var(&mut lookup, ENV_PORT)?
            .map(|value| parse_port(&value))
            .transpose()?;
        let gid_index = read_var(&mut lookup, ENV_GID_INDEX)?
            .map(|value| parse_gid_index(&value))
            .transpose()?;
        Ok(Self {
            device,
            port,
            gid_index,
        })
    }

    /// [`from_env`](Self::from_env) over the real process environment.
    pub fn from_process_env() -> Result<Self, IbvConfigError> {
        Self::from_env(|var: &str| std::env::var_os(var))
    }
}

/// Looks `var` up and returns its value, `None` for unset or blank.
fn read_var<F, V>(lookup: &mut F, var: &'static str) -> Result<Option<String>, IbvConfigError>
where
    F: FnMut(&str) -> Option<V>,
    V: AsRef<OsStr>,
{
    let Some(raw) = lookup(var) else {
        return Ok(None);
    };
    let Some(text) = raw.as_ref().to_str() else {
        return Err(IbvConfigError::NotUnicode { var });
    };
    if text.trim().is_empty() {
        Ok(None)
    } else {
        Ok(Some(text.to_owned()))
    }
}

fn parse_device(value: &str) -> Result<String, IbvConfigError> {
    let name = value.trim();
    let valid = name.len() <= MAX_DEVICE_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'/' && b != b':');
    if valid {
        Ok(name.to_owned())
    } else {
        Err(IbvConfigError::InvalidValue {
            var: ENV_DEVICE,
            value: value.to_owned(),
            expected: "an RDMA device name such as mlx5_0 (at most 63 printable ASCII characters, no '/' or ':')",
        })
    }
}

fn parse_port(value: &str) -> Result<u8, IbvConfigError> {
    match value.trim().parse::<u8>() {
        Ok(port) if port >= 1 => Ok(port),
        _ => Err(IbvConfigError::InvalidValue {
            var: ENV_PORT,
            value: value.to_owned(),
            expected: "a port number from 1 to 255",
        }),
    }
}

fn parse_gid_index(value: &str) -> Result<u32, IbvConfigError> {
    // libibverbs takes the GID index as a C `int`, so anything above `i32::MAX` would wrap.
    match value.trim().parse::<u32>() {
        Ok(index) if i32::try_from(index).is_ok() => Ok(index),
        _ => Err(IbvConfigError::InvalidValue {
            var: ENV_GID_INDEX,
            value: value.to_owned(),
            expected: "a GID table index from 0 to 2147483647",
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::ffi::OsString;

    fn env(pairs: &[(&str, &str)]) -> Result<IbvConfig, IbvConfigError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        IbvConfig::from_env(|var| map.get(var).cloned())
    }

    #[test]
    fn unset_means_automatic() {
        assert_eq!(env(&[]), Ok(IbvConfig::default()));
    }

    #[test]
    fn all_three_variables_are_read() {
        let cfg = env(&[
            (ENV_DEVICE, "mlx5_3"),
            (ENV_PORT, "2"),
            (ENV_GID_INDEX, "3"),
        ])
        .unwrap();
        assert_eq!(
            cfg,
            IbvConfig {
                device: Some("mlx5_3".into()),
                port: Some(2),
                gid_index: Some(3),
            }
        );
    }

    #[test]
    fn whitespace_is_trimmed_and_blank_is_unset() {
        let cfg = env(&[
            (ENV_DEVICE, "  rxe0\n"),
            (ENV_PORT, " 1 "),
            (ENV_GID_INDEX, "   "),
        ])
        .unwrap();
        assert_eq!(cfg.device.as_deref(), Some("rxe0"));
        assert_eq!(cfg.port, Some(1));
        assert_eq!(cfg.gid_index, None);
    }

    #[test]
    fn port_abc_is_a_clear_error() {
        let err = env(&[(ENV_PORT, "abc")]).unwrap_err();
        assert_eq!(
            err,
            IbvConfigError::InvalidValue {
                var: ENV_PORT,
                value: "abc".into(),
                expected: "a port number from 1 to 255",
            }
        );
        assert_eq!(
            err.to_string(),
            "RDZV_IB_PORT=\"abc\" is not valid: expected a port number from 1 to 255"
        );
    }

    #[test]
    fn port_zero_negative_and_too_large_are_rejected() {
        for bad in ["0", "-1", "256", "1.5", "0x1"] {
            let err = env(&[(ENV_PORT, bad)]).unwrap_err();
            assert!(
                matches!(err, IbvConfigError::InvalidValue { var: ENV_PORT, .. }),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn gid_index_bounds() {
        assert_eq!(env(&[(ENV_GID_INDEX, "0")]).unwrap().gid_index, Some(0));
        assert_eq!(
            env(&[(ENV_GID_INDEX, "2147483647")]).unwrap().gid_index,
            Some(2_147_483_647)
        );
        for bad in ["2147483648", "-3", "three", "1e3"] {
            let err = env(&[(ENV_GID_INDEX, bad)]).unwrap_err();
            assert!(
                matches!(
                    err,
                    IbvConfigError::InvalidValue {
                        var: ENV_GID_INDEX,
                        ..
                    }
                ),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn device_names_are_validated() {
        for bad in ["mlx5 0", "../mlx5_0", "mlx5_0:1", "m\u{e9}lx"] {
            let err = env(&[(ENV_DEVICE, bad)]).unwrap_err();
            assert!(
                matches!(
                    err,
                    IbvConfigError::InvalidValue {
                        var: ENV_DEVICE,
                        ..
                    }
                ),
                "{bad}: {err}"
            );
        }
        let long = "x".repeat(64);
        assert!(env(&[(ENV_DEVICE, &long)]).is_err());
        let longest = "x".repeat(63);
        assert_eq!(
            env(&[(ENV_DEVICE, &longest)]).unwrap().device,
            Some(longest)
        );
    }

    #[test]
    fn non_unicode_value_is_an_error_not_unset() {
        use std::os::unix::ffi::OsStringExt;
        let bad = OsString::from_vec(vec![b'm', 0xff, b'x']);
        let err = IbvConfig::from_env(|var| (var == ENV_DEVICE).then(|| bad.clone())).unwrap_err();
        assert_eq!(err, IbvConfigError::NotUnicode { var: ENV_DEVICE });
    }

    #[test]
    fn lookup_sees_exactly_the_three_names() {
        let mut asked = Vec::new();
        let cfg = IbvConfig::from_env(|var| {
            asked.push(var.to_owned());
            None::<&str>
        })
        .unwrap();
        assert_eq!(cfg, IbvConfig::default());
        assert_eq!(asked, [ENV_DEVICE, ENV_PORT, ENV_GID_INDEX]);
    }
}
