//! Bulk RDMA WRITE between two endpoints over loopback UDP.
//!
//! ```sh
//! cargo run --release --example bulk_write -- [MiB] [on-demand]
//! ```
//!
//! A server exposes a memory region (its rkey and address are the
//! out-of-band exchange an application does, as with rdma_cm private data);
//! a client WRITEs into it and the server checks every byte. Registration
//! maps every page of the server's region, as `ibv_reg_mr` pins them;
//! `on-demand` registers it `AccessFlags::ON_DEMAND` instead, and the
//! transfer then takes the page faults, on the server's driver thread.

use metaroce_io::{connect_pair, Driver, DriverConfig};
use metaroce_proto::verbs::*;
use std::time::{Duration, Instant};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mib: usize = std::env::args().nth(1).map_or(Ok(256), |a| a.parse())?;
    let len = mib << 20;
    let on_demand = match std::env::args().nth(2).as_deref() {
        None => AccessFlags::NONE,
        Some("on-demand") => AccessFlags::ON_DEMAND,
        Some(other) => return Err(format!("unknown option {other:?} (on-demand)").into()),
    };
    let mut client = Driver::bind(DriverConfig::new("127.0.0.1:0".parse()?))?;
    let mut server = Driver::bind(DriverConfig::new("127.0.0.1:0".parse()?))?;
    println!("backend: {}", client.backend());

    // Connect and wait for both sides to know the connection.
    let (conn_c, conn_s) = connect_pair(&mut client, &mut server, Duration::from_secs(10))?;

    // Verbs objects on both sides; QP numbers and the region's key and
    // address cross "out of band" (here: local variables).
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + (i >> 12)) as u8).collect();
    let (c, s) = (client.endpoint(), server.endpoint());
    let (pdc, pds) = (c.alloc_pd(), s.alloc_pd());
    let (cqc, cqs) = (c.create_cq(256), s.create_cq(256));
    let src = c.reg_mr(pdc, RegionBuf::copy_of(&data), 0, AccessFlags::NONE)?;
    // Registration maps every page of the destination, as `ibv_reg_mr`
    // pins a region's pages: the timed transfer takes no page faults.
    let dst = s.reg_mr(
        pds,
        RegionBuf::zeroed(len),
        0x10_0000_0000,
        AccessFlags::REMOTE_WRITE | on_demand,
    )?;
    let qc = c.create_qp(QpInit::new(pdc, cqc, cqc))?;
    let qs = s.create_qp(QpInit::new(pds, cqs, cqs))?;
    c.connect_qp(qc, conn_c, qs)?;
    s.connect_qp(qs, conn_s, qc)?;

    // WRITE in 1 MiB pieces, 16 outstanding.
    let piece = 1 << 20;
    let pieces = len.div_ceil(piece);
    let (mut posted, mut done) = (0usize, 0usize);
    let start = Instant::now();
    let mut wcs = Vec::new();
    while done < pieces {
        let now = client.now();
        let c = client.endpoint();
        while posted < pieces && posted - done < 16 {
            let off = posted * piece;
            let n = piece.min(len - off) as u32;
            let remote = RemoteAddr {
                rkey: dst.rkey,
                addr: dst.addr + off as u64,
            };
            c.post_send(
                now,
                qc,
                SendWr::new(
                    posted as u64,
                    SendOp::Write(remote),
                    Sge {
                        lkey: src.lkey,
                        addr: off as u64,
                        len: n,
                    },
                ),
            )?;
            posted += 1;
        }
        wcs.clear();
        c.poll_cq(cqc, 64, &mut wcs)?;
        for wc in &wcs {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            done += 1;
        }
        client.poll(Duration::from_micros(100))?;
        server.poll(Duration::from_micros(100))?;
    }
    let secs = start.elapsed().as_secs_f64();
    let ok = server
        .endpoint()
        .mr(dst.lkey)
        .is_some_and(|m| m == &data[..]);
    println!(
        "wrote {mib} MiB in {:.3} s: {:.2} Gbit/s, every byte {}",
        secs,
        len as f64 * 8.0 / secs / 1e9,
        if ok { "verified" } else { "NOT matching" }
    );
    if !ok {
        return Err("payload mismatch".into());
    }
    Ok(())
}
