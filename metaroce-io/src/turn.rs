//! One turn of a socket driver's loop, shared by the drivers that read
//! their sockets themselves (portable, AF_XDP): send, receive, and only if
//! neither happened nor made anything for the caller, wait (busy polling
//! first, then sleeping) until the core's next timer, at most `max_wait`;
//! then the timers, then send what they made.

use crate::fault::{self, Faults};
use crate::{Clock, DriverError, DriverStats};
use metaroce_proto::Endpoint;
use std::time::Duration;

/// What a driver lends [`poll_turn`].
pub(crate) trait TurnParts {
    /// The endpoint, the clock, the fault injector and the counters.
    fn parts(&mut self) -> (&mut Endpoint, &Clock, Option<&Faults>, &mut DriverStats);
    /// Work that comes before the turn proper (side channels); whether it
    /// received anything.
    fn before(&mut self) -> Result<bool, DriverError> {
        Ok(false)
    }
    /// Sends what the core has, up to the turn's budget; whether any went.
    fn flush(&mut self) -> Result<bool, DriverError>;
    /// Reads what arrived, up to the turn's budget; whether any did.
    fn receive(&mut self) -> Result<bool, DriverError>;
    /// Delivers held-back datagrams (fault injection) that are due.
    fn release(&mut self) -> bool;
    /// Watches for work for up to the busy-poll time (at most `wait`);
    /// whether some came.
    fn busy_poll(&mut self, wait: Duration) -> Result<bool, DriverError>;
    /// Sleeps until something is readable, at most `timeout`.
    fn wait_readable(&mut self, timeout: Duration) -> Result<bool, DriverError>;
}

/// One turn; whether it did anything (sent or received a datagram, ran a
/// timer, made a completion or an event).
pub(crate) fn poll_turn<D: TurnParts>(d: &mut D, max_wait: Duration) -> Result<bool, DriverError> {
    let unpolled = d.parts().0.unpolled();
    let side = d.before()?;
    let sent = d.flush()?;
    let got = side | d.receive()? | d.release();
    // Completions or events this turn made (a request that failed locally
    // when its turn to be sent came sends nothing) are the caller's to see
    // before the turn may sleep.
    let made = d.parts().0.unpolled() != unpolled;
    let mut waited = false;
    // A turn that may not wait (a caller that polls) has nothing to work
    // out here: no clock reading, no timer lookup.
    if !sent && !got && !made && !max_wait.is_zero() {
        let (ep, clock, faults, _) = d.parts();
        let now = clock.now();
        let wait = fault::timer_wait(ep, faults, now, max_wait);
        if !wait.is_zero() {
            let deadline = now + wait;
            if d.busy_poll(wait)? {
                d.parts().3.busy_polls += 1;
            } else {
                // What the busy poll spent counts against the wait.
                let left = d.parts().1.until(deadline);
                if !left.is_zero() {
                    d.parts().3.waits += 1;
                    d.wait_readable(left)?;
                }
            }
            d.receive()?;
            d.release();
            waited = true;
        }
    }
    let (ep, clock, _, _) = d.parts();
    let now = clock.now();
    let mut timers = false;
    if ep.poll_timeout().is_some_and(|t| t <= now) {
        ep.handle_timeout(now);
        timers = true;
    }
    // Nothing sent, received, made, waited for or due: the endpoint is as
    // the first flush left it, with nothing to send (a polling caller's
    // idle turn).
    let busy = sent || got || made || timers;
    let sent_after = (busy || waited) && d.flush()?;
    Ok(busy || sent_after)
}
