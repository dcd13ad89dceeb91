//! `etcd://HOST:PORT[,HOST:PORT…]/RUN_ID?nodes=MIN:MAX&…`: the elastic rendezvous kept in
//! an etcd cluster, parsed.
//!
//! It decides what such a URL means: the members' client endpoints (each `HOST:PORT`, the
//! port defaulting to etcd's 2379), the run id (the path), the etcd key prefix the
//! rendezvous lives under (`etcd_prefix`, default [`DEFAULT_ETCD_PREFIX`]), and every other
//! query key exactly as `elastic://` reads them ([`ElasticUrl::set`]). It does not talk to
//! etcd, and it does not decide how the machine's store operations map onto etcd's
//! primitives (the runtime's etcd store does).

use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::fmt;

use super::{ElasticSettings, ElasticUrl, NodeRange, SettingsError, DEFAULT_READ_TIMEOUT};
use crate::query::QueryView;

/// etcd's default client port.
pub const DEFAULT_ETCD_PORT: u16 = 2379;
/// The etcd key prefix of an `etcd://` rendezvous when the URL names none: its keys are
/// `/rdzv/rdzv.elastic.{run_id}/…` and the rounds' stores `/rdzv/torch.rendezvous.…`.
pub const DEFAULT_ETCD_PREFIX: &str = "rdzv";

/// `etcd://HOST:PORT[,HOST:PORT…]/RUN_ID?nodes=MIN:MAX&…`, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EtcdRendezvousUrl {
    /// The members' client endpoints, `host:port` each, in the URL's order.
    pub endpoints: Vec<String>,
    /// The etcd key prefix (no leading or trailing `/`).
    pub prefix: String,
    /// Everything `elastic://` also has; `host` and `port` are the first endpoint's.
    pub elastic: ElasticUrl,
}

/// Why an `etcd://` rendezvous URL was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EtcdUrlError<'a> {
    /// The URL does not start with `etcd://`.
    Scheme,
    /// An endpoint is not `HOST` or `HOST:PORT` with a port in 1..=65535.
    Endpoint {
        /// The endpoint as written.
        text: &'a str,
    },
    /// `etcd_prefix` is empty or holds a NUL byte.
    Prefix {
        /// The value given.
        text: &'a str,
    },
    /// The elastic settings (`nodes`, timeouts, run id, query) were refused.
    Settings(SettingsError<'a>),
}

impl<'a> From<SettingsError<'a>> for EtcdUrlError<'a> {
    fn from(error: SettingsError<'a>) -> Self {
        EtcdUrlError::Settings(error)
    }
}

impl fmt::Display for EtcdUrlError<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const FORM: &str = "etcd://HOST:PORT[,HOST:PORT...]/RUN_ID?nodes=MIN:MAX";
        match self {
            Self::Scheme => write!(f, "etcd:// rendezvous: the URL must look like {FORM}"),
            Self::Endpoint { text } => write!(
                f,
                "etcd:// rendezvous: endpoint {text:?} is not HOST or HOST:PORT (port 1-65535); \
                 expected {FORM}"
            ),
            Self::Prefix { text } => write!(
                f,
                "etcd:// rendezvous: etcd_prefix={text:?} must be non-empty and hold no NUL byte"
            ),
            Self::Settings(error) => error.fmt(f),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for EtcdUrlError<'_> {}

impl EtcdRendezvousUrl {
    /// Parses the URL. The query takes `elastic://`'s keys ([`ElasticUrl::parse`]) and
    /// `etcd_prefix` (torchelastic's etcd backend's name for it); `read_timeout` is also
    /// how long one etcd request keeps retrying across the endpoints before it fails.
    ///
    /// # Errors
    /// [`EtcdUrlError`] naming what is wrong.
    pub fn parse(url: &str) -> Result<Self, EtcdUrlError<'_>> {
        let rest = url
            .get(..7)
            .filter(|scheme| scheme.eq_ignore_ascii_case("etcd://"))
            .and_then(|_| url.get(7..))
            .ok_or(EtcdUrlError::Scheme)?;
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let rest = rest.split_once('#').map_or(rest, |(before, _)| before);
        let (hosts, path) = rest.split_once('/').unwrap_or((rest, ""));
        let mut endpoints = Vec::new();
        for text in hosts.split(',') {
            endpoints.push(endpoint(text)?);
        }
        let query = QueryView::parse(query).map_err(SettingsError::Query)?;
        let nodes = NodeRange::parse(query.get("nodes").unwrap_or("1:1"))?;
        let (host, port) = endpoints
            .first()
            .and_then(|first| first.rsplit_once(':'))
            .map(|(host, port)| (host.to_string(), port.parse().unwrap_or(DEFAULT_ETCD_PORT)))
            .ok_or(EtcdUrlError::Endpoint { text: hosts })?;
        let mut elastic = ElasticUrl {
            host,
            port,
            settings: ElasticSettings::new(path.trim_matches('/'), nodes),
            node_id: None,
            read_timeout: DEFAULT_READ_TIMEOUT,
            is_host: None,
        };
        let mut prefix = DEFAULT_ETCD_PREFIX;
        for (key, value) in query.iter() {
            match key {
                "etcd_prefix" => {
                    prefix = value.trim_matches('/');
                    if prefix.is_empty() || prefix.contains('\0') {
                        return Err(EtcdUrlError::Prefix { text: value });
                    }
                }
                _ => elastic.set(key, value)?,
            }
        }
        elastic.settings.check()?;
        Ok(EtcdRendezvousUrl {
            endpoints,
            prefix: prefix.to_string(),
            elastic,
        })
    }

    /// The endpoints joined by commas, as they appear in the URL (for messages).
    pub fn endpoints_text(&self) -> String {
        self.endpoints.join(",")
    }
}

/// `HOST` or `HOST:PORT` (an IPv6 host in brackets) to `host:port`.
fn endpoint(text: &str) -> Result<String, EtcdUrlError<'_>> {
    let bad = EtcdUrlError::Endpoint { text };
    let (host, port) = if let Some(inner) = text.strip_prefix('[') {
        let (host, after) = inner.split_once(']').ok_or(bad)?;
        match after {
            "" => (host, None),
            _ => (host, Some(after.strip_prefix(':').ok_or(bad)?)),
        }
    } else {
        match text.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (text, None),
        }
    };
    let valid_host = !host.is_empty()
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._:".contains(&b));
    if !valid_host {
        return Err(bad);
    }
    let port = match port {
        None => DEFAULT_ETCD_PORT,
        Some(port) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => {
            match port.parse::<u16>() {
                Ok(port) if port > 0 => port,
                _ => return Err(bad),
            }
        }
        Some(_) => return Err(bad),
    };
    Ok(if text.starts_with('[') {
        alloc::format!("[{host}]:{port}")
    } else {
        alloc::format!("{host}:{port}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::time::Duration;

    #[test]
    fn endpoints_run_id_and_elastic_keys() {
        let url = EtcdRendezvousUrl::parse(
            "etcd://10.0.0.1:2379,etcd-b,[::1]:23790/job7?nodes=2:8&last_call=5s&\
             keep_alive_interval=1s&read_timeout=7&etcd_prefix=/team/a/&node_id=n1",
        )
        .unwrap();
        assert_eq!(
            url.endpoints,
            ["10.0.0.1:2379", "etcd-b:2379", "[::1]:23790"]
        );
        assert_eq!(
            url.endpoints_text(),
            "10.0.0.1:2379,etcd-b:2379,[::1]:23790"
        );
        assert_eq!(url.prefix, "team/a");
        let e = &url.elastic;
        assert_eq!((e.host.as_str(), e.port), ("10.0.0.1", 2379));
        assert_eq!(e.settings.run_id, "job7");
        assert_eq!((e.settings.nodes.min, e.settings.nodes.max), (2, 8));
        assert_eq!(e.settings.last_call, Duration::from_secs(5));
        assert_eq!(e.settings.keep_alive_interval, Duration::from_secs(1));
        assert_eq!(e.read_timeout, Duration::from_secs(7));
        assert_eq!(e.node_id.as_deref(), Some("n1"));
    }

    #[test]
    fn defaults_are_elastics_and_the_rdzv_prefix() {
        let url = EtcdRendezvousUrl::parse("ETCD://h/r?rank=3&world_size=4").unwrap();
        assert_eq!(url.endpoints, ["h:2379"]);
        assert_eq!(url.prefix, DEFAULT_ETCD_PREFIX);
        let elastic = ElasticUrl::parse("elastic://h/r").unwrap();
        assert_eq!(url.elastic.settings, elastic.settings);
        assert_eq!(url.elastic.read_timeout, elastic.read_timeout);
    }

    #[test]
    fn bad_urls_say_what_is_wrong() {
        let error = |text: &str| EtcdRendezvousUrl::parse(text).unwrap_err().to_string();
        assert!(error("elastic://h:1/r").contains("must look like etcd://"));
        for bad in [
            "etcd://h:1,,h:2/r",
            "etcd://h:0/r",
            "etcd://h:70000/r",
            "etcd://h:x/r",
            "etcd:///r",
            "etcd://[::1/r",
            "etcd://a b:1/r",
        ] {
            assert!(error(bad).contains("is not HOST or HOST:PORT"), "{bad}");
        }
        assert!(error("etcd://h:1/").contains("run id"));
        assert!(error("etcd://h:1/r?nodes=3:2").contains("maximum number"));
        assert!(error("etcd://h:1/r?bogus=1").contains("unknown query key bogus"));
        assert!(error("etcd://h:1/r?etcd_prefix=/").contains("etcd_prefix"));
        assert!(error("etcd://h:1/r?last_call=soon").contains("last_call=soon"));
    }
}
