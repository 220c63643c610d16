//! Waking a driver that sleeps in its `poll`, from another thread.
//!
//! A driver waits for a datagram or its next timer; a thread that hands it
//! work (the async API's command queue) must be able to cut that wait short.
//! A [`Waker`] is one end of a non-blocking Unix datagram socket pair whose
//! other end the driver waits on next to its UDP socket (`ppoll` in the
//! portable backend, a multishot `POLL_ADD` on the ring in the io_uring one).
//! Wakes coalesce: one byte is written until the driver has drained it.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Cuts a driver's wait short from any thread; cheap to clone.
///
/// ```no_run
/// use metaroce_io::{Driver, DriverConfig};
/// use std::time::Duration;
/// let mut drv = Driver::bind(DriverConfig::new("127.0.0.1:0".parse().unwrap())).unwrap();
/// let waker = drv.waker().unwrap();
/// std::thread::spawn(move || waker.wake());
/// drv.poll(Duration::from_secs(1)).unwrap(); // returns soon after the wake
/// ```
#[derive(Debug, Clone)]
pub struct Waker {
    inner: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    tx: UnixDatagram,
    /// A byte is written and not drained yet.
    pending: AtomicBool,
}

impl Waker {
    /// Makes the driver's current or next wait return at once.
    pub fn wake(&self) {
        if !self.inner.pending.swap(true, Ordering::AcqRel) {
            // A full socket buffer means wakes are already pending.
            let _ = self.inner.tx.send(&[1]);
        }
    }
}

/// The driver's end: what it waits on and drains.
#[derive(Debug)]
pub(crate) struct WakeReceiver {
    rx: UnixDatagram,
    waker: Waker,
}

impl WakeReceiver {
    /// The waker of the receiver in `slot`, creating the receiver on the
    /// first call (a driver that nobody wakes never opens the socket pair).
    pub(crate) fn waker_in(slot: &mut Option<WakeReceiver>) -> io::Result<Waker> {
        let r = match slot {
            Some(r) => r,
            None => slot.insert(WakeReceiver::new()?),
        };
        Ok(r.waker())
    }

    /// A connected pair, both ends non-blocking.
    pub(crate) fn new() -> io::Result<Self> {
        let (tx, rx) = UnixDatagram::pair()?;
        tx.set_nonblocking(true)?;
        rx.set_nonblocking(true)?;
        Ok(WakeReceiver {
            rx,
            waker: Waker {
                inner: Arc::new(Shared {
                    tx,
                    pending: AtomicBool::new(false),
                }),
            },
        })
    }

    /// A handle for other threads.
    pub(crate) fn waker(&self) -> Waker {
        self.waker.clone()
    }

    /// The descriptor to wait on.
    pub(crate) fn fd(&self) -> RawFd {
        self.rx.as_raw_fd()
    }

    /// Consumes the pending wakes. The bytes go first and the flag after
    /// them: a wake before the flag is cleared finds it set and writes
    /// nothing, but the driver is awake and looks for work after this; a
    /// wake after it writes a new byte. (Clearing the flag first would let
    /// a racing wake's byte be read here, leaving the flag set with nothing
    /// to read, and every later wake swallowed.)
    pub(crate) fn drain(&self) {
        let mut b = [0u8; 64];
        while self.rx.recv(&mut b).is_ok() {}
        self.waker.inner.pending.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wakes_coalesce_and_none_is_lost_after_a_drain() {
        let r = WakeReceiver::new().unwrap();
        let w = r.waker();
        for _ in 0..100 {
            w.wake();
        }
        let mut b = [0u8; 8];
        assert_eq!(r.rx.recv(&mut b).unwrap(), 1, "one byte for many wakes");
        assert!(r.rx.recv(&mut b).is_err(), "and only one");
        r.drain();
        w.wake();
        assert_eq!(
            r.rx.recv(&mut b).unwrap(),
            1,
            "a wake after a drain is sent"
        );
    }

    /// A wake that lands while the driver drains must not leave the flag set
    /// with no byte to read: every later wake would then be swallowed and the
    /// driver would sleep through them all. One thread wakes without pause,
    /// the other drains each time the socket is readable; the socket must
    /// never stay empty for long while wakes keep coming.
    #[test]
    fn a_wake_racing_a_drain_is_never_lost() {
        let r = WakeReceiver::new().unwrap();
        let w = r.waker();
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let waking = std::thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                w.wake();
            }
        });
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        let mut drains = 0u64;
        let mut stuck = false;
        while std::time::Instant::now() < deadline {
            let mut pfd = libc::pollfd {
                fd: r.fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: `pfd` is one valid, initialised pollfd that outlives
            // the call.
            let n = unsafe { libc::poll(&mut pfd, 1, 200) };
            if n == 0 {
                stuck = true;
                break;
            }
            r.drain();
            drains += 1;
        }
        stop.store(true, Ordering::Relaxed);
        waking.join().unwrap();
        assert!(
            !stuck,
            "after {drains} drains the socket stayed empty for 200 ms while wakes kept coming (pending: {})",
            r.waker.inner.pending.load(Ordering::Relaxed)
        );
        assert!(drains > 100, "only {drains} drains in a second");
    }
}
