//! Two drivers connected to each other and driven from one thread: what
//! tests, benchmarks and examples on one machine start from.

use crate::{DriverError, IoDriver};
use metaroce_proto::verbs::{ConnectionHandle, VerbsError};
use metaroce_proto::{ConnectionError, Event};
use std::time::{Duration, Instant};

/// Why [`connect_pair`] did not connect.
#[derive(Debug, thiserror::Error)]
pub enum PairError {
    /// Polling a driver failed.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// The client endpoint refused to open the connection.
    #[error("cannot open the connection: {0}")]
    Connect(#[from] VerbsError),
    /// The handshake failed (refused, or no answer within the endpoint's
    /// handshake timeout).
    #[error("handshake failed: {0}")]
    Lost(ConnectionError),
    /// The handshake did not finish within the caller's limit.
    #[error("handshake did not finish within {0:?}")]
    Timeout(Duration),
}

/// Connects `client` to `server` (which must be listening, as every
/// endpoint is) by polling both from this thread until each side has its
/// connection: returns the client's and the server's handle.
///
/// Meant for fresh drivers: the events polled meanwhile are consumed (only
/// the handshake's own are expected).
///
/// ```
/// use metaroce_io::{connect_pair, Driver, DriverConfig, IoDriver};
/// use metaroce_proto::ConnectionState;
/// use std::time::Duration;
/// let cfg = DriverConfig::new("127.0.0.1:0".parse().unwrap());
/// let mut a = Driver::bind(cfg.clone()).unwrap();
/// let mut b = Driver::bind(cfg).unwrap();
/// let (ca, cb) = connect_pair(&mut a, &mut b, Duration::from_secs(5)).unwrap();
/// assert_eq!(a.endpoint().connection_state(ca), Some(ConnectionState::Established));
/// assert_eq!(b.endpoint().connection_state(cb), Some(ConnectionState::Established));
/// ```
pub fn connect_pair<D: IoDriver>(
    client: &mut D,
    server: &mut D,
    limit: Duration,
) -> Result<(ConnectionHandle, ConnectionHandle), PairError> {
    let start = Instant::now();
    let now = client.now();
    let conn = client.endpoint().connect(now, server.local_addr())?;
    let (mut up, mut accepted) = (false, None);
    while !(up && accepted.is_some()) {
        if start.elapsed() > limit {
            return Err(PairError::Timeout(limit));
        }
        client.poll(Duration::ZERO)?;
        server.poll(Duration::ZERO)?;
        while let Some(e) = client.endpoint().poll_event() {
            match e {
                Event::Connected(c) if c == conn => up = true,
                Event::ConnectionLost { conn: c, error } if c == conn => {
                    return Err(PairError::Lost(error))
                }
                _ => {}
            }
        }
        while let Some(e) = server.endpoint().poll_event() {
            if let Event::Incoming { conn, .. } = e {
                accepted = Some(conn);
            }
        }
    }
    Ok((conn, accepted.expect("loop ends with it")))
}
