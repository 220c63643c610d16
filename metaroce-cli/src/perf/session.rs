//! One run from each end: the server's (`serve_run`) and the client's
//! (`client_run`), over a control [`Link`]: the exchange of QPs and
//! regions, the data phase, and what each side verified.

use super::*;

/// What the server checked of the client's stream, and with `bidir` how
/// its own stream went.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct ServeOutcome {
    pub(super) received: ServerResult,
    pub(super) sent: Option<Direction>,
}

/// The server's side of one run over `link`: reads the client's `Hello`,
/// accepts its connection, exposes a region, verifies every message (and
/// with `bidir` runs the same stream back to the client).
/// `peer_ip`, if known, is the client's address (its control connection's).
pub(super) fn serve_run(
    drv: &mut Driver,
    link: &Link,
    peer_ip: Option<IpAddr>,
) -> anyhow::Result<ServeOutcome> {
    let setup = Duration::from_secs(10);
    // Anything left over from an earlier run is not ours.
    while drv.endpoint().poll_event().is_some() {}
    let mut conn = None;
    let take = |e: Event, conn: &mut Option<ConnectionHandle>| {
        if let Event::Incoming { conn: c, peer } = e {
            if peer_ip.is_none_or(|ip| ip == peer.ip()) {
                *conn = Some(c);
            }
        }
    };
    let p = match drive_until_msg(drv, link, setup, |e| take(e, &mut conn))? {
        Msg::Hello { version, params } => {
            if version != VERSION {
                link.send(Msg::Refused {
                    version: VERSION,
                    reason: format!(
                        "control protocol version {version}, this server speaks {VERSION}"
                    ),
                });
                return Err(PerfError::VersionMismatch {
                    ours: VERSION,
                    theirs: version,
                }
                .into());
            }
            if let Err(e) = validate(&params) {
                link.send(Msg::Refused {
                    version: VERSION,
                    reason: e.to_string(),
                });
                return Err(e.into());
            }
            params
        }
        m => return Err(unexpected(m, "Hello")),
    };
    link.send(Msg::Welcome {
        version: VERSION,
        udp_port: drv.local_addr().port(),
    });
    let mut client = None;
    while client.is_none() || conn.is_none() {
        if client.is_none() {
            match drive_until_msg(drv, link, setup, |e| take(e, &mut conn))? {
                Msg::ClientQps { qpns, region } if qpns.len() == p.qps as usize => {
                    if p.bidir && region.is_none() {
                        return Err(PerfError::Protocol(
                            "a bidirectional run without the client's region".into(),
                        )
                        .into());
                    }
                    client = Some((qpns, region));
                }
                m => return Err(unexpected(m, "ClientQps")),
            }
        } else {
            drive(drv, setup, |d| {
                while let Some(e) = d.endpoint().poll_event() {
                    take(e, &mut conn);
                }
                conn.is_some()
            })?;
            if conn.is_none() {
                bail!("the client's metaroce connection did not arrive");
            }
        }
    }
    let conn = conn.context("no client connected")?;
    let (client_qpns, client_region) = client.unwrap_or_default();
    let ep = drv.endpoint();
    let (pd, send_cq, recv_cq, qps) = create_qps(ep, &p)?;
    for (&qp, &remote) in qps.iter().zip(&client_qpns) {
        ep.connect_qp(qp, conn, Qpn(remote))?;
    }
    let mut resp = Responder::new(ep, pd, recv_cq, &qps, &p)?;
    let mut req = match client_region {
        Some(region) if p.bidir => Some(Requester::new(ep, pd, send_cq, &qps, &p, region)?),
        _ => None,
    };
    let region = resp.region();
    link.send(Msg::Ready {
        qpns: qps.iter().map(|q| q.0).collect(),
        rkey: region.rkey,
        addr: region.addr,
        slots: region.slots,
    });
    // The server's own stream (bidir) waits for the client's `Start`.
    let ex = data_phase(drv, link, conn, req.as_mut(), Some(&mut resp), false);
    // Let the last ACKs go out, then free the run's resources.
    drive(drv, Duration::from_millis(20), |_| false)?;
    let now = drv.now();
    let ep = drv.endpoint();
    for &qp in &qps {
        let _ = ep.destroy_qp(qp);
    }
    let _ = ep.dereg_mr(resp.mr.lkey);
    if let Some(r) = &req {
        let _ = ep.dereg_mr(r.mr.lkey);
    }
    let retransmits = ep.connection_stats(conn).map_or(0, |s| s.retransmits);
    let _ = ep.close(now, conn);
    let ex = ex?;
    let sent = match (&req, ex.peer_result) {
        (Some(r), Some(pr)) => Some(Direction::of(r, &pr, retransmits, p.size)),
        _ => None,
    };
    Ok(ServeOutcome {
        received: resp.res,
        sent,
    })
}

/// The client's side of one run over `link` against the server at `server_ip`.
pub(super) fn client_run(
    opts: &RunOpts,
    drv: &mut Driver,
    link: &Link,
    server_ip: IpAddr,
) -> anyhow::Result<Report> {
    let setup = Duration::from_secs(10);
    let p = opts.params();
    link.send(Msg::Hello {
        version: VERSION,
        params: p.clone(),
    });
    let udp_port = match drive_until_msg(drv, link, setup, |_| {})? {
        Msg::Welcome { udp_port, .. } => udp_port,
        Msg::Refused { version, .. } if version != VERSION => {
            return Err(PerfError::VersionMismatch {
                ours: VERSION,
                theirs: version,
            }
            .into())
        }
        Msg::Refused { reason, .. } => return Err(PerfError::Refused(reason).into()),
        m => return Err(unexpected(m, "Welcome")),
    };
    let server_addr = SocketAddr::new(server_ip, udp_port);
    let now = drv.now();
    let conn = drv.endpoint().connect(now, server_addr)?;
    let mut up = false;
    let mut failed = None;
    drive(drv, setup, |d| {
        while let Some(e) = d.endpoint().poll_event() {
            match e {
                Event::Connected(c) if c == conn => up = true,
                Event::ConnectionLost { error, .. } => failed = Some(error),
                _ => {}
            }
        }
        up || failed.is_some()
    })?;
    if let Some(e) = failed {
        bail!("cannot connect to {server_addr}: {e}");
    }
    if !up {
        bail!("cannot connect to {server_addr}: no answer");
    }
    let ep = drv.endpoint();
    let (pd, send_cq, recv_cq, qps) = create_qps(ep, &p)?;
    // With --bidir the server's stream lands here: receives go up before
    // the server learns where to send.
    let mut resp = if p.bidir {
        for &qp in &qps {
            // INIT takes receives; `connect_qp` goes on from there.
            let attrs = QpAttrs {
                access: Some(AccessFlags::ALL),
                ..Default::default()
            };
            ep.modify_qp(qp, QpState::Init, attrs)?;
        }
        Some(Responder::new(ep, pd, recv_cq, &qps, &p)?)
    } else {
        None
    };
    link.send(Msg::ClientQps {
        qpns: qps.iter().map(|q| q.0).collect(),
        region: resp.as_ref().map(Responder::region),
    });
    let (remote_qpns, remote) = match drive_until_msg(drv, link, setup, |_| {})? {
        Msg::Ready {
            qpns,
            rkey,
            addr,
            slots,
        } if qpns.len() == qps.len() => (qpns, Region { rkey, addr, slots }),
        m => return Err(unexpected(m, "Ready")),
    };
    let ep = drv.endpoint();
    for (&qp, &r) in qps.iter().zip(&remote_qpns) {
        ep.connect_qp(qp, conn, Qpn(r))?;
    }
    let mut req = Requester::new(ep, pd, send_cq, &qps, &p, remote)?;
    if p.bidir {
        link.send(Msg::Start);
    }
    let ex = data_phase(drv, link, conn, Some(&mut req), resp.as_mut(), true)?;
    let cs = drv.endpoint().connection_stats(conn).unwrap_or_default();
    // Keep answering until the server is done with its last ACKs.
    drive(drv, Duration::from_millis(20), |_| false)?;
    let size = p.size;
    let peer_result = ex.peer_result.unwrap_or_default();
    let tx = Direction::of(&req, &peer_result, cs.retransmits, size);
    let rx = match (&resp, ex.peer_done) {
        (Some(r), Some(d)) => Some(Direction::from_peer(&d, &r.res, p.op, size)),
        _ => None,
    };
    let both = |f: fn(&Direction) -> u64| f(&tx) + rx.as_ref().map_or(0, f);
    let hist = &req.hist;
    let us = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
    let elapsed = tx.duration_s;
    Ok(Report {
        op: p.op,
        backend: drv.backend().to_string(),
        busy_poll_us: opts.side.busy_poll_us,
        msg_size: size,
        mtu: drv.endpoint().connection_mtu(conn).unwrap_or(0),
        mtu_asked: opts.side.mtu,
        qps: p.qps,
        bidir: p.bidir,
        verify: p.verify,
        iterations: both(|d| d.iterations),
        bytes: both(|d| d.bytes),
        duration_s: elapsed,
        gbps: tx.gbps + rx.as_ref().map_or(0.0, |d| d.gbps),
        msg_rate_mps: tx.iterations as f64 / elapsed / 1e6
            + rx.as_ref()
                .map_or(0.0, |d| d.iterations as f64 / d.duration_s / 1e6),
        lat_min_us: hist.min() as f64 / 1000.0,
        lat_p50_us: us(0.5),
        lat_avg_us: hist.mean() / 1000.0,
        lat_p99_us: us(0.99),
        lat_p999_us: us(0.999),
        retransmits: both(|d| d.retransmits),
        rto_fires: cs.rto_fires,
        verified_bytes: both(|d| d.verified_bytes),
        corrupt_bytes: both(|d| d.corrupt_bytes),
        tx: p.bidir.then_some(tx),
        rx,
        paths: cs
            .paths
            .iter()
            .map(|p| PathReport {
                id: p.id,
                src_port: p.src_port,
                packets: p.packets_sent,
                bytes: p.bytes_sent,
                retransmits: p.retransmits,
                lost: p.packets_lost,
                spurious: p.spurious_losses,
                lost_by_time: p.lost_by_time,
                lost_by_timeout: p.lost_by_timeout,
                spurious_by_time: p.spurious_by_time,
                spurious_by_timeout: p.spurious_by_timeout,
                ecn_marks: p.ce_marks,
                rtt_us: p.srtt_ns as f64 / 1000.0,
                failures: p.failures,
                moves: p.moves,
                state: match p.state {
                    Some(PathState::Probing) => "probing",
                    _ => "active",
                },
            })
            .collect(),
    })
}
