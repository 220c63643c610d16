//! The out-of-band control channel of `metaroce perf`, as perftest's TCP
//! exchange or rdma_cm's private data: QP numbers, rkey, address, slot
//! count, the run's parameters, and at the end what the server verified.
//!
//! Wire format: each message is a 4-byte big-endian length followed by that
//! many bytes of JSON (one [`Msg`]). Every run starts with the client's
//! [`Msg::Hello`], which carries [`VERSION`]; a server that speaks another
//! version answers [`Msg::Refused`] with its own version and closes.
//!
//! Both the loopback test (in-memory channels) and the remote one (a TCP
//! connection) use a [`Link`], so one protocol drives both.

use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::mpsc;

use crate::perf::Op;

/// Version of the control protocol. Bump on any incompatible change.
///
/// v2: `--bidir` (the server runs a stream of its own towards the client:
/// [`Msg::ClientQps`] carries the client's region, [`Msg::Start`] starts
/// the server's stream, [`Msg::Done`] goes both ways and carries the
/// sender's own figures). A v1 peer's `Hello` still parses, so it gets a
/// clear version mismatch rather than a protocol error.
///
/// v3: a new payload pattern (`perf::pattern`, cheaper to write and to
/// check): a v2 peer would see every byte of a v3 peer's messages as
/// corrupt, so the two refuse each other instead.
pub const VERSION: u32 = 3;

/// Largest control message accepted, bytes (they are all tiny).
const MAX_MSG: u32 = 1 << 20;

/// Why a `metaroce perf` run could not start or finish.
#[derive(Debug, thiserror::Error)]
pub enum PerfError {
    /// The control connection to the server could not be opened.
    #[error("cannot reach metaroce perf server at {addr}: {cause}")]
    Unreachable {
        /// The address as given.
        addr: String,
        /// The OS error (in the message, so not repeated as a source).
        cause: io::Error,
    },
    /// Client and server speak different control protocol versions.
    #[error(
        "control protocol version mismatch: this metaroce speaks v{ours}, the peer speaks v{theirs}"
    )]
    VersionMismatch {
        /// Our [`VERSION`].
        ours: u32,
        /// The peer's.
        theirs: u32,
    },
    /// The address to listen on is taken (or cannot be bound).
    #[error("port in use: cannot bind {what} {addr}: {cause}")]
    PortInUse {
        /// "UDP" or "TCP control".
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// The OS error (in the message, so not repeated as a source).
        cause: io::Error,
    },
    /// The flags make no sense (checked on both sides).
    #[error("bad flags: {0}")]
    BadFlags(String),
    /// The server refused the run.
    #[error("server refused the run: {0}")]
    Refused(String),
    /// The peer sent something unexpected, or went away.
    #[error("control protocol: {0}")]
    Protocol(String),
}

/// What the client asks for.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RunParams {
    /// Operation.
    pub op: Op,
    /// Message size, bytes.
    pub size: u64,
    /// Outstanding work requests in all.
    pub depth: u32,
    /// Queue pairs the work requests are spread over (round robin).
    pub qps: u32,
    /// Whether payloads are checked.
    pub verify: bool,
    /// Test duration, seconds (the server derives its time limits from it).
    pub duration: f64,
    /// Both ways at once: the server also runs the same operation towards
    /// the client over the same QPs (absent in a v1 `Hello`).
    #[serde(default)]
    pub bidir: bool,
}

/// A region the peer's work requests target.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Region {
    /// Remote key.
    pub rkey: u32,
    /// Address of its first byte.
    pub addr: u64,
    /// Message slots in it (iteration `i` uses slot `i % slots`).
    pub slots: u64,
}

/// One control message.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Msg {
    /// Client → server, first: who we are and what to run.
    Hello {
        /// The client's [`VERSION`].
        version: u32,
        /// The run.
        params: RunParams,
    },
    /// Server → client: accepted; the metaroce UDP port to connect to.
    Welcome {
        /// The server's [`VERSION`].
        version: u32,
        /// UDP port of the server's endpoint.
        udp_port: u16,
    },
    /// Server → client: not accepted (`version` says which the server speaks).
    Refused {
        /// The server's [`VERSION`].
        version: u32,
        /// Why.
        reason: String,
    },
    /// Client → server: the connection is up; the client's QP numbers.
    ClientQps {
        /// One per QP, in round-robin order.
        qpns: Vec<u32>,
        /// With `bidir`: the region the server's stream targets (its
        /// receives are posted already).
        #[serde(default)]
        region: Option<Region>,
    },
    /// Server → client: the server's QPs and the region the client targets.
    Ready {
        /// One per QP, matching [`Msg::ClientQps`].
        qpns: Vec<u32>,
        /// Remote key of the region.
        rkey: u32,
        /// Its address.
        addr: u64,
        /// Message slots in it (iteration `i` uses slot `i % slots`).
        slots: u64,
    },
    /// Client → server, with `bidir`: the client's QPs are connected; the
    /// server starts its own stream.
    Start,
    /// Either way: this side's stream is over (the client's always; the
    /// server's with `bidir`).
    Done {
        /// Completed work requests.
        iterations: u64,
        /// Seconds from the first post to the last completion.
        #[serde(default)]
        elapsed_s: f64,
        /// Bytes the sender checked itself (READ) and found right ...
        #[serde(default)]
        verified_bytes: u64,
        /// ... and wrong.
        #[serde(default)]
        corrupt_bytes: u64,
        /// The sender's retransmissions on the connection.
        #[serde(default)]
        retransmits: u64,
    },
    /// The answer to [`Msg::Done`]: what the receiving side verified.
    Result {
        /// Bytes that matched their pattern.
        verified_bytes: u64,
        /// Bytes that did not (or arrived in failed completions).
        corrupt_bytes: u64,
        /// Messages the server saw.
        messages: u64,
    },
    /// Either way: the run failed on this side.
    Abort {
        /// Why.
        reason: String,
    },
}

/// Writes one length-prefixed message.
pub fn write_msg(w: &mut impl Write, m: &Msg) -> io::Result<()> {
    let body = serde_json::to_vec(m).map_err(io::Error::other)?;
    let len = u32::try_from(body.len()).map_err(io::Error::other)?;
    w.write_all(&len.to_be_bytes())?;
    w.write_all(&body)?;
    w.flush()
}

/// Reads one length-prefixed message; `Ok(None)` on a clean end of stream.
pub fn read_msg(r: &mut impl Read) -> io::Result<Option<Msg>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes(len);
    if len > MAX_MSG {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("control message of {len} bytes (at most {MAX_MSG})"),
        ));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    serde_json::from_slice(&body)
        .map(Some)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// One side of a control channel: messages in, messages out.
///
/// Receiving never blocks the caller's driver loop for longer than asked,
/// so the endpoint keeps running while it waits.
#[derive(Debug)]
pub struct Link {
    tx: mpsc::Sender<Msg>,
    rx: mpsc::Receiver<Msg>,
    stream: Option<TcpStream>,
}

impl Link {
    /// Two connected in-memory ends (the loopback test).
    pub fn pair() -> (Link, Link) {
        let (a_tx, b_rx) = mpsc::channel();
        let (b_tx, a_rx) = mpsc::channel();
        (
            Link {
                tx: a_tx,
                rx: a_rx,
                stream: None,
            },
            Link {
                tx: b_tx,
                rx: b_rx,
                stream: None,
            },
        )
    }

    /// A link over a TCP connection: a reader and a writer thread move the
    /// length-prefixed messages between the socket and the channels. The
    /// channel closes when the peer closes or sends garbage.
    pub fn tcp(stream: TcpStream) -> io::Result<Link> {
        stream.set_nodelay(true)?;
        let mut rd = stream.try_clone()?;
        let mut wr = stream.try_clone()?;
        let (in_tx, in_rx) = mpsc::channel();
        let (out_tx, out_rx) = mpsc::channel::<Msg>();
        std::thread::spawn(move || {
            while let Ok(Some(m)) = read_msg(&mut rd) {
                if in_tx.send(m).is_err() {
                    break;
                }
            }
        });
        std::thread::spawn(move || {
            for m in out_rx {
                if write_msg(&mut wr, &m).is_err() {
                    break;
                }
            }
            let _ = wr.shutdown(Shutdown::Write);
        });
        Ok(Link {
            tx: out_tx,
            rx: in_rx,
            stream: Some(stream),
        })
    }

    /// Queues a message for the peer (a gone peer shows up on receive).
    pub fn send(&self, m: Msg) {
        let _ = self.tx.send(m);
    }

    /// The next message if one is there; an error if the peer went away.
    pub fn try_recv(&self) -> Result<Option<Msg>, PerfError> {
        match self.rx.try_recv() {
            Ok(m) => Ok(Some(m)),
            Err(mpsc::TryRecvError::Empty) => Ok(None),
            Err(mpsc::TryRecvError::Disconnected) => Err(gone()),
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // Wake the reader thread; the writer ends when `tx` drops.
        if let Some(s) = &self.stream {
            let _ = s.shutdown(Shutdown::Read);
        }
    }
}

fn gone() -> PerfError {
    PerfError::Protocol("the peer closed the control connection".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_length_prefixed() {
        let msgs = [
            Msg::Hello {
                version: VERSION,
                params: RunParams {
                    op: Op::Read,
                    size: 4096,
                    depth: 16,
                    qps: 2,
                    verify: true,
                    duration: 1.5,
                    bidir: true,
                },
            },
            Msg::ClientQps {
                qpns: vec![3],
                region: Some(Region {
                    rkey: 9,
                    addr: 0x1000_0000,
                    slots: 4,
                }),
            },
            Msg::Start,
            Msg::Ready {
                qpns: vec![1, 2],
                rkey: 7,
                addr: 0x1000_0000,
                slots: 32,
            },
            Msg::Done {
                iterations: 9,
                elapsed_s: 0.5,
                verified_bytes: 0,
                corrupt_bytes: 0,
                retransmits: 2,
            },
        ];
        let mut buf = Vec::new();
        for m in &msgs {
            write_msg(&mut buf, m).unwrap();
        }
        assert_eq!(
            u32::from_be_bytes(buf[..4].try_into().unwrap()) as usize + 4,
            {
                let first = serde_json::to_vec(&msgs[0]).unwrap();
                first.len() + 4
            }
        );
        let mut r = &buf[..];
        for m in &msgs {
            assert_eq!(read_msg(&mut r).unwrap().as_ref(), Some(m));
        }
        assert_eq!(read_msg(&mut r).unwrap(), None);
    }

    #[test]
    fn a_v1_hello_still_parses_so_its_version_can_be_refused() {
        let v1 = br#"{"type":"hello","version":1,"params":{"op":"write","size":64,"depth":4,"qps":1,"verify":true,"duration":1.0}}"#;
        let mut buf = (v1.len() as u32).to_be_bytes().to_vec();
        buf.extend_from_slice(v1);
        match read_msg(&mut &buf[..]).unwrap() {
            Some(Msg::Hello { version, params }) => {
                assert_eq!(version, 1);
                assert!(!params.bidir);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn oversized_and_garbage_messages_are_refused() {
        let mut r = &[0xffu8, 0xff, 0xff, 0xff][..];
        assert!(read_msg(&mut r).is_err());
        let mut buf = 3u32.to_be_bytes().to_vec();
        buf.extend_from_slice(b"{x}");
        assert!(read_msg(&mut &buf[..]).is_err());
    }
}
