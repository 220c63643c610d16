//! SEND/RECV ping-pong between two endpoints over loopback UDP: round-trip
//! latency of small messages.
//!
//! ```sh
//! cargo run --release --example ping_pong -- [ROUNDS] [BYTES]
//! ```

use metaroce_io::{connect_pair, Driver, DriverConfig};
use metaroce_proto::verbs::*;
use std::time::{Duration, Instant};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rounds: usize = std::env::args().nth(1).map_or(Ok(10_000), |a| a.parse())?;
    let size: u32 = std::env::args().nth(2).map_or(Ok(8), |a| a.parse())?;
    let mut a = Driver::bind(DriverConfig::new("127.0.0.1:0".parse()?))?;
    let mut b = Driver::bind(DriverConfig::new("127.0.0.1:0".parse()?))?;
    let (conn_a, conn_b) = connect_pair(&mut a, &mut b, Duration::from_secs(10))?;
    // Each side: a buffer to send from and one to receive into.
    let side = |d: &mut Driver| -> Result<(Qpn, CqHandle, MrInfo), Box<dyn std::error::Error>> {
        let e = d.endpoint();
        let pd = e.alloc_pd();
        let cq = e.create_cq(64);
        let mr = e.reg_mr(
            pd,
            RegionBuf::zeroed(2 * size.max(1) as usize),
            0,
            AccessFlags::LOCAL_WRITE,
        )?;
        let qp = e.create_qp(QpInit::new(pd, cq, cq))?;
        Ok((qp, cq, mr))
    };
    let (qa, cqa, mra) = side(&mut a)?;
    let (qb, cqb, mrb) = side(&mut b)?;
    a.endpoint().connect_qp(qa, conn_a, qb)?;
    b.endpoint().connect_qp(qb, conn_b, qa)?;
    let recv = |mr: &MrInfo| RecvWr {
        wr_id: 0,
        sge: Sge {
            lkey: mr.lkey,
            addr: u64::from(size),
            len: size,
        }
        .into(),
    };
    let send = |mr: &MrInfo| {
        SendWr::new(
            0,
            SendOp::Send,
            Sge {
                lkey: mr.lkey,
                addr: 0,
                len: size,
            },
        )
    };
    a.endpoint().post_recv(qa, recv(&mra))?;
    b.endpoint().post_recv(qb, recv(&mrb))?;

    let mut lat = Vec::with_capacity(rounds);
    let mut wcs = Vec::new();
    for _ in 0..rounds {
        let t0 = Instant::now();
        let now = a.now();
        a.endpoint().post_send(now, qa, send(&mra))?;
        // B answers as soon as the ping lands; A waits for the pong.
        let mut got_pong = false;
        while !got_pong {
            a.poll(Duration::ZERO)?;
            b.poll(Duration::ZERO)?;
            wcs.clear();
            b.endpoint().poll_cq(cqb, 8, &mut wcs)?;
            for wc in &wcs {
                if wc.opcode == WcOpcode::Recv {
                    let now = b.now();
                    b.endpoint().post_recv(qb, recv(&mrb))?;
                    b.endpoint().post_send(now, qb, send(&mrb))?;
                }
            }
            wcs.clear();
            a.endpoint().poll_cq(cqa, 8, &mut wcs)?;
            for wc in &wcs {
                if wc.opcode == WcOpcode::Recv {
                    a.endpoint().post_recv(qa, recv(&mra))?;
                    got_pong = true;
                }
            }
        }
        lat.push(t0.elapsed());
    }
    lat.sort();
    let us = |q: f64| lat[((lat.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
    println!(
        "{rounds} round trips of {size} B ({}): p50 {:.1} us, p99 {:.1} us, min {:.1} us",
        a.backend(),
        us(0.5),
        us(0.99),
        us(0.0)
    );
    Ok(())
}
