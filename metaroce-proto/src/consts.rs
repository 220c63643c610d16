//! Every constant of the protocol, in one place, named as in `docs/PROTOCOL.md`.
//!
//! Wire constants (sizes, codes) are fixed by the specification. Defaults of
//! tunables live in [`crate::config`] and refer to the `DEFAULT_*` values here.

use core::time::Duration;

/// The protocol version this implementation speaks (`VERSION` in the spec).
pub const VERSION: u8 = 1;

/// The UDP destination port every endpoint listens on (`METAROCE_PORT`).
///
/// The UDP *source* port is the path's ECMP entropy and varies per path.
pub const METAROCE_PORT: u16 = 4792;

/// Size of the common header that starts every packet (`COMMON_HEADER_LEN`).
pub const COMMON_HEADER_LEN: usize = 8;

/// Size of the fixed part of a DATA packet header, common header included
/// (`DATA_HEADER_LEN`); the opcode extension follows it.
pub const DATA_HEADER_LEN: usize = 40;

/// Size of the fixed part of an ACK packet, common header included (`ACK_HEADER_LEN`).
pub const ACK_HEADER_LEN: usize = 28;

/// Size of the fixed part of a per-path entry in an ACK
/// (`ACK_PATH_ENTRY_MIN_LEN`): an entry whose SACK bitvector is all zero
/// (every packet arrived in order) takes only this.
pub const ACK_PATH_ENTRY_MIN_LEN: usize = 16;

/// Largest size of one per-path entry in an ACK, the whole SACK bitvector
/// included (`ACK_PATH_ENTRY_LEN`).
pub const ACK_PATH_ENTRY_LEN: usize = ACK_PATH_ENTRY_MIN_LEN + SACK_BYTES;

/// Size of one per-stream entry in an ACK (`ACK_STREAM_ENTRY_LEN`).
pub const ACK_STREAM_ENTRY_LEN: usize = 8;

/// Size of one NAK entry in an ACK (`ACK_NAK_ENTRY_LEN`).
pub const ACK_NAK_ENTRY_LEN: usize = 12;

/// ACK option kind (not critical): the receiver's window for this sender,
/// a big-endian u32 of bytes it may keep in flight (PROTOCOL §6.5, §14).
pub const ACK_OPT_RECV_WINDOW: u8 = 0x01;

/// ACK flag (byte 2): a DATA packet of the same connection follows the ACK
/// in the datagram, and byte 3 gives the ACK's options length, so the ACK
/// ends before the datagram does (PROTOCOL §6.7). Sent only to a peer that
/// advertised the coalescing capability in its HELLO or ACCEPT.
pub const ACK_FLAG_COALESCED: u8 = 0x01;

/// Width of the per-path selective acknowledgement bitvector, in bits (`SACK_BITS`).
///
/// A sender never has a path's packets outstanding over a span of more than
/// this many sequence numbers, so the bitvector always describes all of them.
pub const SACK_BITS: u32 = 256;

/// How far after a path's `ack_psn` a PSN may lie and still be taken
/// (`PSN_WINDOW`, PROTOCOL §9.2): one at `ack_psn + PSN_WINDOW` or later is
/// refused (`PsnOutOfWindow`) and moves no window state.
///
/// A sender's PSN runs ahead of the receiver's `ack_psn` only by the span
/// rule's `SACK_BITS` plus the PSNs it sent that never arrived while it
/// declared them lost (a dead route probed at most once per `max_rto`): a
/// route would have to swallow 65,280 packets in a row, hours of probing,
/// before a genuine packet met this bound. A single forged PSN half the
/// sequence space ahead, taken, would otherwise move the window past
/// everything the sender has sent, and every later ACK of the path would be
/// refused as acknowledging unsent PSNs.
pub const PSN_WINDOW: u32 = 65_536;

/// Bytes of the SACK bitvector (`SACK_BYTES`).
pub const SACK_BYTES: usize = (SACK_BITS / 8) as usize;

/// Largest number of paths a connection may have (`MAX_PATHS`). Path ids are `0..MAX_PATHS`.
pub const MAX_PATHS: usize = 64;

/// Largest number of planes (local addresses) a connection may span (`MAX_PLANES`).
///
/// HELLO and ACCEPT carry at most `MAX_PLANES - 1` additional plane addresses
/// (plane 0 is the packet's source address).
pub const MAX_PLANES: usize = 8;

/// Width of the receiver's connection-sequence (CSN) duplicate window (`CSN_WINDOW`).
///
/// A sender never has CSNs outstanding over a span larger than this.
pub const CSN_WINDOW: u32 = 65_536;

/// Largest number of messages per queue pair that may be in progress at a
/// receiver at once, counted from its oldest unfinished message (`MSG_WINDOW`).
pub const MSG_WINDOW: u32 = 4_096;

/// Largest message the protocol carries, in bytes (`MAX_MESSAGE_LEN`): lengths are `u32`.
pub const MAX_MESSAGE_LEN: u64 = u32::MAX as u64;

/// Largest number of scatter/gather elements in one work request
/// (`MAX_SGE`): the bound of a QP's `max_send_sge` and `max_recv_sge`.
pub const MAX_SGE: usize = 4;

/// Smallest path MTU (UDP payload bytes) an endpoint accepts (`MIN_MTU`).
pub const MIN_MTU: u16 = 256;

/// Largest path MTU (UDP payload bytes) an endpoint accepts (`MAX_MTU`).
pub const MAX_MTU: u16 = 9_000;

/// Size of a HELLO packet; HELLOs are padded to it so that the server's
/// stateless COOKIE reply is never larger than the request (`HELLO_LEN`).
pub const HELLO_LEN: usize = 64;

/// Size of the cookie a server hands out (`COOKIE_LEN`).
pub const COOKIE_LEN: usize = 16;

/// Size of the CRC32C trailer that ends every datagram of a connection
/// that negotiated it (`CRC32C_TRAILER_LEN`, PROTOCOL §3.1).
pub const CRC32C_TRAILER_LEN: usize = 4;

/// Size of a pre-shared key (`PSK_LEN`, PROTOCOL §3.2).
pub const PSK_LEN: usize = 32;

/// Size of each side's handshake nonce (`HANDSHAKE_NONCE_LEN`, PROTOCOL §3.2).
pub const HANDSHAKE_NONCE_LEN: usize = 16;

/// Size of each side's key proof in the handshake (`AEAD_PROOF_LEN`, PROTOCOL §3.2).
pub const AEAD_PROOF_LEN: usize = 16;

/// Size of the AES-128-GCM tag of a sealed datagram (`AEAD_TAG_LEN`, PROTOCOL §3.2).
pub const AEAD_TAG_LEN: usize = 16;

/// Size of a sealed datagram's sequence number (`AEAD_SEQ_LEN`, PROTOCOL §3.2).
pub const AEAD_SEQ_LEN: usize = 8;

/// Bytes a sealed datagram ends with: its tag and its sequence number
/// (`AEAD_TRAILER_LEN`, PROTOCOL §3.2).
pub const AEAD_TRAILER_LEN: usize = AEAD_TAG_LEN + AEAD_SEQ_LEN;

/// How long a cookie stays valid (`COOKIE_LIFETIME`).
pub const COOKIE_LIFETIME: Duration = Duration::from_secs(10);

/// Largest number of ACK options' bytes accepted after the entries (`MAX_OPTIONS_LEN`).
pub const MAX_OPTIONS_LEN: usize = 256;

/// A full data segment carries a multiple of this many payload bytes
/// (`SEGMENT_ALIGN`) where that keeps GSO batches whole; see
/// [`segment_payload`](crate::wire::segment_payload).
pub const SEGMENT_ALIGN: usize = 64;

/// The unit message lengths come in (`SEGMENT_UNIT`): a page. Full
/// segments are sized to be a multiple or a divisor of it where the
/// path's MTU allows (see [`segment_payload`](crate::wire::segment_payload)).
pub const SEGMENT_UNIT: usize = 4096;

/// Default UDP payload MTU of a path: a 4 KiB payload plus headers (`DEFAULT_MTU`).
pub const DEFAULT_MTU: u16 = 4_096 + 64;

/// Default number of paths per connection (`DEFAULT_PATHS`): two per
/// spine of an 8-spine fabric. Paths hashed at random onto 8 spines cover
/// about five of them with 8 paths and seven with 16, and a connection
/// crowded onto a few spines runs at their share: on the simulated 64-host
/// fabric the slowest of 64 flows ran at 72 Gbit/s with 8 paths and 90
/// with 16 (`docs/BENCHMARKS.md`, the slowest of finite flows).
pub const DEFAULT_PATHS: u8 = 16;

/// Default initial retransmission timeout (`DEFAULT_INITIAL_RTO`).
pub const DEFAULT_INITIAL_RTO: Duration = Duration::from_millis(2);

/// Default lower bound of the retransmission timeout (`DEFAULT_MIN_RTO`).
///
/// Loss is normally repaired by SACK at once; the timeout is the last resort,
/// and on a host stack it must ride out scheduling delays. Fabrics with
/// microsecond RTTs (the simulator) configure a lower bound of their own.
pub const DEFAULT_MIN_RTO: Duration = Duration::from_millis(2);

/// Default upper bound of the retransmission timeout (`DEFAULT_MAX_RTO`).
pub const DEFAULT_MAX_RTO: Duration = Duration::from_millis(500);

/// Default number of consecutive timeouts without progress before a
/// connection fails with retry-exceeded (`DEFAULT_RETRY_CNT`, as `retry_cnt` in verbs).
pub const DEFAULT_RETRY_CNT: u8 = 7;

/// Default least time each retry is given before a connection, or a QP's
/// progress probes, fail (`DEFAULT_RETRY_TIMEOUT`): RoCE's `timeout` 14
/// (67 ms), rounded. With `retry_cnt` 7 a failure needs half a second of
/// silence at least, however short the RTO: a host stall (a thread off its
/// core on a busy machine) shorter than that fails nothing.
pub const DEFAULT_RETRY_TIMEOUT: Duration = Duration::from_millis(64);

/// Default number of RNR retries before a request fails (`DEFAULT_RNR_RETRY`).
/// The value 7 means "retry forever", as in verbs.
pub const DEFAULT_RNR_RETRY: u8 = 7;

/// Default time a requester waits after an RNR NAK before retrying (`DEFAULT_RNR_TIMER`).
pub const DEFAULT_RNR_TIMER: Duration = Duration::from_micros(100);

/// Default longest wait of an ACK the peer asked for, for a DATA packet of
/// this side's to ride on (`DEFAULT_ACK_HOLD`, PROTOCOL §12): a responder
/// that answers within it sends its ACK and its response in one datagram.
pub const DEFAULT_ACK_HOLD: Duration = Duration::from_micros(20);

/// An asked-for ACK waits for DATA to ride on only if this side sent DATA
/// on the connection within this long (`ACK_HOLD_SENDING`): a receiver
/// that only receives acknowledges at once.
pub const ACK_HOLD_SENDING: Duration = Duration::from_millis(1);

/// Default delayed-ACK timer (`DEFAULT_ACK_DELAY`).
pub const DEFAULT_ACK_DELAY: Duration = Duration::from_micros(20);

/// Default number of data packets a receiver takes before it sends an ACK
/// without waiting for the delayed-ACK timer (`DEFAULT_ACK_EVERY`).
pub const DEFAULT_ACK_EVERY: u32 = 4;

/// Default first HELLO retransmission interval (`DEFAULT_HANDSHAKE_RTO`);
/// it doubles with each attempt (20, 40, 80 ms ...: about 5 s for 8 attempts).
pub const DEFAULT_HANDSHAKE_RTO: Duration = Duration::from_millis(20);

/// Default number of HELLO attempts before a connection attempt fails (`DEFAULT_HANDSHAKE_RETRIES`).
pub const DEFAULT_HANDSHAKE_RETRIES: u8 = 8;

/// Default bytes a sender puts in flight to a peer that grants rates before
/// its first grant arrives (`DEFAULT_FIRST_FLIGHT`): one packet. A receiver
/// with N new senders then sees N packets in the first round trip, not N
/// initial windows, and its first ACKs already share its capacity N ways.
pub const DEFAULT_FIRST_FLIGHT: u64 = 4096;

/// Default initial congestion window of a connection, in bytes (`DEFAULT_INITIAL_WINDOW`).
pub const DEFAULT_INITIAL_WINDOW: u64 = 256 * 1024;

/// Default largest congestion window of a connection, in bytes (`DEFAULT_MAX_WINDOW`).
pub const DEFAULT_MAX_WINDOW: u64 = 64 * 1024 * 1024;

/// Default smallest congestion window of a connection, in bytes (`DEFAULT_MIN_WINDOW`).
pub const DEFAULT_MIN_WINDOW: u64 = 8 * 1024;

/// Consecutive congested rounds (RTTs whose ECN marks or queueing delay cut
/// the window) after which a path moves to another source port, i.e.
/// another ECMP route (`REPATH_ROUNDS`). One unlucky hash can leave a
/// connection with no path over some spine, or too many over one; moving
/// starved paths (see `REPATH_WINDOW_SHARE`) walks them off crowded routes,
/// as PLB does for single-path flows.
pub const REPATH_ROUNDS: u32 = 4;

/// A path moves only while its window is below the connection's mean path
/// window divided by this (`REPATH_WINDOW_SHARE`).
pub const REPATH_WINDOW_SHARE: u64 = 3;

/// Paths that move at once when every active path's window is at its
/// minimum (`REPATH_ALL_MIN_DRAWS`): windows then no longer show which
/// route has room, and each move is a draw among the routes.
pub const REPATH_ALL_MIN_DRAWS: usize = 2;

/// A path counts as queued when judging moves once its smoothed RTT is
/// this many times the least RTT the connection has seen (and that plus
/// the delay target), `REPATH_QUEUED_RTTS`: where every path is queued,
/// every route is a bottleneck, or some route has no path, or all share
/// a delay the connection did not make, and only a move can tell (§9.1).
/// A queue the delay signal keeps within its target stays under it.
pub const REPATH_QUEUED_RTTS: u32 = 4;

/// Smoothed RTTs between two path moves of one connection (`REPATH_COOLDOWN_RTTS`):
/// a move must show its effect before the next.
pub const REPATH_COOLDOWN_RTTS: u32 = 8;

/// An RTT sample of a path more than this many times the median smoothed
/// RTT of its connection's active paths is slow (`SLOW_PATH_FACTOR`;
/// §9.1); a path with `SLOW_PATH_SAMPLES` more slow samples than others
/// moves to a new source port. Four: spraying evens out ordinary queues
/// (paths of one connection differ by less than 2× on a loaded fabric),
/// while a link at a tenth of its rate holds packets 10-100× longer.
pub const SLOW_PATH_FACTOR: u32 = 4;

/// A path is slow once its slow RTT samples outnumber the others by this
/// many on its present route (`SLOW_PATH_SAMPLES`; see `SLOW_PATH_FACTOR`).
pub const SLOW_PATH_SAMPLES: u32 = 4;

/// Source ports a connection remembers as slow, not to go back to them
/// for 512 smoothed RTTs, the longest wait between congested-path moves
/// (`SLOW_PORTS_KEPT`).
pub const SLOW_PORTS_KEPT: usize = 8;

/// The wait between path moves doubles with every move, at most this many
/// times (`REPATH_MAX_BACKOFF`): 8 × 2^6 = 512 smoothed RTTs. Where every
/// route is congested (loopback, one bottleneck) moves cannot help, and a
/// connection there moved a path every 2 ms without it.
pub const REPATH_MAX_BACKOFF: u32 = 6;

/// A path that carries ACKs but no data of its own is checked with a NOP
/// once this many smoothed RTTs (at least one RTO) have passed since it
/// last carried an acknowledged packet (`ACK_PATH_CHECK_RTTS`, §9.1). ACKs
/// are not acknowledged, so without the check a route that silently drops
/// everything (a blackholed spine) would swallow the ACKs sent on it for
/// as long as the connection lives.
pub const ACK_PATH_CHECK_RTTS: u32 = 16;

/// ...and once it carried at least this many ACKs since its last DATA
/// packet (`ACK_PATH_CHECK_ACKS`): a check costs a NOP and the peer's ACK of
/// it, at most one per 64 ACKs. (The peer's ACK crosses the link the
/// receiver's grants fill exactly: one check per 16 RTTs per path overran
/// an incast receiver's link by 0.4% in the simulator, its queue 88 KB ->
/// 530 KB; one per 16 ACKs left 189 KB and cost 4% of a 16-host run's
/// goodput at 10% loss; one per 64 ACKs leaves 88 KB.)
pub const ACK_PATH_CHECK_ACKS: u32 = 64;

/// Length of an epoch of the RTT peak filter, in smoothed RTTs
/// (`RTT_PEAK_EPOCH_RTTS`; at least the minimum RTO): the peak is the
/// largest RTT sample of the current epoch and the one before (§13.3).
pub const RTT_PEAK_EPOCH_RTTS: u32 = 16;

/// Default queueing delay a sender tolerates before it slows down (`DEFAULT_DELAY_TARGET`).
pub const DEFAULT_DELAY_TARGET: Duration = Duration::from_micros(100);

/// Packets declared lost in a row, with no delivery between them, after
/// which a path is declared failed while other paths deliver (`PATH_FAIL_LOSSES`).
/// Random loss of 10% reaches it once in 10^4 packets; a dead route at once.
pub const PATH_FAIL_LOSSES: u32 = 4;

/// Default time a sender counts as active for the receiver's grant after its
/// last data packet (`DEFAULT_RECEIVER_ACTIVE_WINDOW`).
pub const DEFAULT_RECEIVER_ACTIVE_WINDOW: Duration = Duration::from_micros(100);

/// Default largest number of outstanding RDMA READs per QP (`DEFAULT_MAX_RD_ATOMIC`).
pub const DEFAULT_MAX_RD_ATOMIC: u8 = 16;

/// ACKs that repeat path entries after a packet the receiver already had
/// came again (`REPEAT_ACKS_AFTER_DUPLICATE`, PROTOCOL §6.2): its report
/// was lost with an ACK, so later reports are sent more than once.
pub const REPEAT_ACKS_AFTER_DUPLICATE: u32 = 1024;
