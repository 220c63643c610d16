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

    /// Consumes the pending wakes. The flag is cleared first: a wake that
    /// races with this writes a new byte, so it is never lost.
    pub(crate) fn drain(&self) {
        self.waker.inner.pending.store(false, Ordering::Release);
        let mut b = [0u8; 64];
        while self.rx.recv(&mut b).is_ok() {}
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
}
