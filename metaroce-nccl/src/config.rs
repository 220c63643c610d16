//! The plugin's configuration, from `METAROCE_` environment variables.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `METAROCE_ADDRS` | the plugin's devices: a comma-separated list, one entry per device, each an IP address or several joined by `+` (one per plane of that device) | the addresses of `METAROCE_IFNAME`, else the first IPv4 address of an interface that is up and not loopback, else `127.0.0.1` |
//! | `METAROCE_IFNAME` | interface names, comma-separated, one device each (their first IPv4 address) | none |
//! | `METAROCE_BACKEND` | `auto`, `uring`, `portable` or `af_xdp` (root; `METAROCE_ADDRS` an Ethernet interface's address) | `auto` |
//! | `METAROCE_PATHS` | paths (source ports) per connection | the core's default |
//! | `METAROCE_SPEED_MBPS` | the speed `getProperties` reports, Mbps | `100000` |
//! | `METAROCE_PROGRESS` | who drives each device's endpoint: `caller` (NCCL's proxy thread, in each `test`, `isend` and `irecv`, with the endpoint thread taking over while they are not called; see `Device::open_polled`) or `thread` (the endpoint thread alone) | `caller` |
//! | `METAROCE_EAGER_BYTES` | messages up to this size go at once into buffers the receiver keeps posted, and are copied from there, instead of waiting for the receiver to announce NCCL's buffer (at most 262144; 0: never; both sides use the smaller value) | `8192` |
//! | `METAROCE_BUSY_POLL_US` | how long the endpoint thread polls before it sleeps, µs (`thread` progress only) | `0` |
//! | `METAROCE_CONNECT_TIMEOUT_MS` | how long `connect`/`accept` may take before they fail | `60000` |
//! | `METAROCE_PSK_FILE` | a file of exactly 32 bytes, the pre-shared key of the authenticated mode (PROTOCOL §3.2): every connection proves the key in its handshake and seals every datagram with AES-128-GCM; ranks with different keys (or one without) get no connection, and their `connect`/`accept` fail with an error that names the key. Every rank must use the same file. Make one with `head -c 32 /dev/urandom > key` | none: datagrams go unsealed |
//! | `METAROCE_FAULT_DROP` | probability that a received datagram is dropped (testing) | `0` |
//! | `METAROCE_FAULT_SEED` | seed of the fault injector | `1` |
//!
//! ```
//! let cfg = metaroce_nccl::Config::from_lookup(|k| match k {
//!     "METAROCE_ADDRS" => Some("10.0.0.1+10.0.1.1,127.0.0.1".into()),
//!     "METAROCE_BACKEND" => Some("portable".into()),
//!     _ => None,
//! })
//! .unwrap();
//! assert_eq!(cfg.devices.len(), 2);
//! assert_eq!(cfg.devices[0].planes.len(), 2);
//! ```

use metaroce_io::{Backend, DriverConfig, FaultConfig};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

/// A configuration variable that could not be used.
#[derive(Debug, thiserror::Error)]
#[error("{var}={value:?}: {why}")]
pub struct ConfigError {
    /// The variable.
    pub var: &'static str,
    /// Its value.
    pub value: String,
    /// What is wrong with it.
    pub why: String,
}

/// One device of the plugin: its plane addresses (the first one is the
/// address the device binds and peers reach).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSpec {
    /// One address per plane, at least one.
    pub planes: Vec<IpAddr>,
    /// The name `getProperties` reports.
    pub name: String,
}

/// `METAROCE_EAGER_BYTES` unless set.
pub(crate) const DEFAULT_EAGER_BYTES: usize = 8192;
/// The largest `METAROCE_EAGER_BYTES` (each receive comm keeps 32 buffers
/// of this size posted).
pub(crate) const MAX_EAGER_BYTES: usize = 256 << 10;

/// Who drives a device's endpoint (`METAROCE_PROGRESS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// The threads that call the plugin (NCCL's proxy thread), each call a
    /// turn of the endpoint; the endpoint thread drives it while nobody
    /// calls ([`metaroce_io::Device::open_polled`]).
    Caller,
    /// The endpoint thread alone ([`metaroce_io::Device::open`]).
    Thread,
}

/// Everything the plugin reads from the environment.
#[derive(Debug, Clone)]
pub struct Config {
    /// The devices `devices` counts, in order.
    pub devices: Vec<DeviceSpec>,
    /// The driver backend.
    pub backend: Backend,
    /// Paths per connection, if set.
    pub paths: Option<u8>,
    /// Reported speed, Mbps.
    pub speed_mbps: i32,
    /// Who drives the endpoints.
    pub progress: Progress,
    /// Messages up to this size go eagerly.
    pub eager_bytes: usize,
    /// Busy polling of the endpoint thread.
    pub busy_poll: Duration,
    /// Bound on `connect`/`accept`.
    pub connect_timeout: Duration,
    /// Injected loss (tests).
    pub fault_drop: f64,
    /// Seed of the fault injector.
    pub fault_seed: u64,
    /// The pre-shared key of the authenticated mode, if any.
    pub psk: Option<metaroce_io::proto::Psk>,
}

fn parse<T: std::str::FromStr>(
    var: &'static str,
    v: Option<String>,
    default: T,
) -> Result<T, ConfigError>
where
    T::Err: std::fmt::Display,
{
    match v {
        None => Ok(default),
        Some(s) => s.trim().parse().map_err(|e: T::Err| ConfigError {
            var,
            value: s.clone(),
            why: e.to_string(),
        }),
    }
}

impl Config {
    /// Reads the process environment.
    pub fn from_env() -> Result<Config, ConfigError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `get` (for tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let devices = if let Some(list) = get("METAROCE_ADDRS") {
            let mut devs = Vec::new();
            for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
                let planes = entry
                    .split('+')
                    .map(|a| a.trim().parse::<IpAddr>())
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| ConfigError {
                        var: "METAROCE_ADDRS",
                        value: list.clone(),
                        why: e.to_string(),
                    })?;
                devs.push(DeviceSpec {
                    name: format!("metaroce:{entry}"),
                    planes,
                });
            }
            devs
        } else if let Some(names) = get("METAROCE_IFNAME") {
            let mut devs = Vec::new();
            for name in names.split(',').map(str::trim).filter(|e| !e.is_empty()) {
                let ip = interface_ipv4(Some(name)).ok_or_else(|| ConfigError {
                    var: "METAROCE_IFNAME",
                    value: names.clone(),
                    why: format!("no IPv4 address on an interface named {name}"),
                })?;
                devs.push(DeviceSpec {
                    name: format!("metaroce:{name}"),
                    planes: vec![ip],
                });
            }
            devs
        } else {
            let ip = interface_ipv4(None).unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
            vec![DeviceSpec {
                name: format!("metaroce:{ip}"),
                planes: vec![ip],
            }]
        };
        if devices.is_empty() {
            return Err(ConfigError {
                var: "METAROCE_ADDRS",
                value: String::new(),
                why: "no device".into(),
            });
        }
        let backend = match get("METAROCE_BACKEND") {
            None => Backend::Auto,
            Some(s) => s
                .parse()
                .map_err(|e: metaroce_io::UnknownBackend| ConfigError {
                    var: "METAROCE_BACKEND",
                    value: s.clone(),
                    why: e.to_string(),
                })?,
        };
        let paths = match get("METAROCE_PATHS") {
            None => None,
            v => Some(parse("METAROCE_PATHS", v, 0u8)?),
        };
        let fault_drop: f64 = parse("METAROCE_FAULT_DROP", get("METAROCE_FAULT_DROP"), 0.0)?;
        if !(0.0..=1.0).contains(&fault_drop) {
            return Err(ConfigError {
                var: "METAROCE_FAULT_DROP",
                value: fault_drop.to_string(),
                why: "not in [0, 1]".into(),
            });
        }
        let eager_bytes: usize = parse(
            "METAROCE_EAGER_BYTES",
            get("METAROCE_EAGER_BYTES"),
            DEFAULT_EAGER_BYTES,
        )?;
        if eager_bytes > MAX_EAGER_BYTES {
            return Err(ConfigError {
                var: "METAROCE_EAGER_BYTES",
                value: eager_bytes.to_string(),
                why: format!("more than {MAX_EAGER_BYTES}"),
            });
        }
        let progress = match get("METAROCE_PROGRESS").as_deref().map(str::trim) {
            None | Some("caller") => Progress::Caller,
            Some("thread") => Progress::Thread,
            Some(other) => {
                return Err(ConfigError {
                    var: "METAROCE_PROGRESS",
                    value: other.into(),
                    why: "neither caller nor thread".into(),
                })
            }
        };
        let psk = match get("METAROCE_PSK_FILE") {
            None => None,
            Some(path) => Some(
                metaroce_io::read_psk_file(std::path::Path::new(path.trim())).map_err(|e| {
                    ConfigError {
                        var: "METAROCE_PSK_FILE",
                        value: path.clone(),
                        why: e.to_string(),
                    }
                })?,
            ),
        };
        Ok(Config {
            psk,
            devices,
            backend,
            paths,
            progress,
            eager_bytes,
            speed_mbps: parse("METAROCE_SPEED_MBPS", get("METAROCE_SPEED_MBPS"), 100_000)?,
            busy_poll: Duration::from_micros(parse(
                "METAROCE_BUSY_POLL_US",
                get("METAROCE_BUSY_POLL_US"),
                0,
            )?),
            connect_timeout: Duration::from_millis(parse(
                "METAROCE_CONNECT_TIMEOUT_MS",
                get("METAROCE_CONNECT_TIMEOUT_MS"),
                60_000,
            )?),
            fault_drop,
            fault_seed: parse("METAROCE_FAULT_SEED", get("METAROCE_FAULT_SEED"), 1)?,
        })
    }

    /// The driver configuration of a new endpoint on device `dev`, on a
    /// free port; `salt` varies the fault seed between endpoints.
    pub(crate) fn driver(&self, dev: &DeviceSpec, salt: u64) -> DriverConfig {
        let mut cfg = DriverConfig::new(SocketAddr::new(dev.planes[0], 0));
        cfg.planes = dev.planes[1..].to_vec();
        cfg.backend = self.backend;
        cfg.busy_poll = self.busy_poll;
        cfg.endpoint.psk = self.psk;
        if let Some(p) = self.paths {
            cfg.endpoint.paths = p;
            cfg.send_sockets = 2 * usize::from(p);
        }
        if self.fault_drop > 0.0 {
            cfg.faults = FaultConfig {
                seed: self.fault_seed ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15),
                drop: self.fault_drop,
                ..FaultConfig::default()
            };
        }
        cfg
    }
}

/// The first IPv4 address of the interface `name`, or with `None` of the
/// first interface that is up and not loopback.
fn interface_ipv4(name: Option<&str>) -> Option<IpAddr> {
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `ifap` with a list it allocates, which we
    // free with freeifaddrs below and do not use after.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return None;
    }
    let mut found = None;
    let mut cur = ifap;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, alive
        // until freeifaddrs; its name is a NUL-terminated string and its
        // address, when not NULL and of family AF_INET, a sockaddr_in.
        let (ifname, flags, addr, next) = unsafe {
            let ifa = &*cur;
            let ifname = std::ffi::CStr::from_ptr(ifa.ifa_name).to_string_lossy();
            let addr = if !ifa.ifa_addr.is_null()
                && i32::from((*ifa.ifa_addr).sa_family) == libc::AF_INET
            {
                let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
            } else {
                None
            };
            (ifname.into_owned(), ifa.ifa_flags, addr, ifa.ifa_next)
        };
        if let Some(a) = addr {
            let up = flags & libc::IFF_UP as u32 != 0;
            let lo = flags & libc::IFF_LOOPBACK as u32 != 0;
            let wanted = match name {
                Some(n) => n == ifname,
                None => up && !lo,
            };
            if wanted {
                found = Some(IpAddr::V4(a));
                break;
            }
        }
        cur = next;
    }
    // SAFETY: `ifap` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(ifap) };
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_values_are_refused_with_the_variable_named() {
        let e =
            Config::from_lookup(|k| (k == "METAROCE_BACKEND").then(|| "rdma".into())).unwrap_err();
        assert_eq!(e.var, "METAROCE_BACKEND");
        let e = Config::from_lookup(|k| (k == "METAROCE_ADDRS").then(|| "10.0.0.x".into()))
            .unwrap_err();
        assert_eq!(e.var, "METAROCE_ADDRS");
        let e =
            Config::from_lookup(|k| (k == "METAROCE_FAULT_DROP").then(|| "2".into())).unwrap_err();
        assert_eq!(e.var, "METAROCE_FAULT_DROP");
        let e =
            Config::from_lookup(|k| (k == "METAROCE_PROGRESS").then(|| "nic".into())).unwrap_err();
        assert_eq!(e.var, "METAROCE_PROGRESS");
        let e = Config::from_lookup(|k| (k == "METAROCE_EAGER_BYTES").then(|| "1000000".into()))
            .unwrap_err();
        assert_eq!(e.var, "METAROCE_EAGER_BYTES");
        let c = Config::from_lookup(|_| None).unwrap();
        assert_eq!(c.progress, Progress::Caller);
        let c =
            Config::from_lookup(|k| (k == "METAROCE_PROGRESS").then(|| "thread".into())).unwrap();
        assert_eq!(c.progress, Progress::Thread);
    }

    /// A key file of 32 bytes goes into every endpoint's configuration; a
    /// missing file or one of another length is refused, naming the
    /// variable and saying why.
    #[test]
    fn the_key_file_is_read_into_the_endpoints() {
        let dir = std::env::temp_dir().join(format!("metaroce-nccl-psk-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("key");
        std::fs::write(&key, [9u8; 32]).unwrap();
        let with = |path: &std::path::Path| {
            let path = path.display().to_string();
            Config::from_lookup(move |k| match k {
                "METAROCE_PSK_FILE" => Some(path.clone()),
                "METAROCE_ADDRS" => Some("127.0.0.1".into()),
                _ => None,
            })
        };
        let c = with(&key).unwrap();
        assert_eq!(c.psk, Some(metaroce_io::proto::Psk::new([9u8; 32])));
        let d = c.driver(&c.devices[0], 0);
        assert_eq!(d.endpoint.psk, c.psk);
        assert!(Config::from_lookup(|_| None).unwrap().psk.is_none());
        std::fs::write(&key, [9u8; 31]).unwrap();
        let e = with(&key).unwrap_err();
        assert_eq!(e.var, "METAROCE_PSK_FILE");
        assert!(e.why.contains("31 bytes"), "{e}");
        let e = with(&dir.join("missing")).unwrap_err();
        assert_eq!(e.var, "METAROCE_PSK_FILE");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn loopback_interface_resolves() {
        let cfg = Config::from_lookup(|k| (k == "METAROCE_IFNAME").then(|| "lo".into())).unwrap();
        assert_eq!(cfg.devices[0].planes, vec![IpAddr::V4(Ipv4Addr::LOCALHOST)]);
        assert!(Config::from_lookup(|k| (k == "METAROCE_IFNAME").then(|| "nope0".into())).is_err());
    }
}
