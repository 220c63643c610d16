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

/// How long a side waits for each step of a run's setup: the server, and
/// the loopback test's client (a remote client's waits follow its
/// `--connect-timeout`, see [`client_setup`]).
pub(super) const SETUP: Duration = Duration::from_secs(10);

/// What the server has of a run once its setup exchange is done.
struct ServerSetup {
    p: RunParams,
    conn: ConnectionHandle,
    client_qpns: Vec<u32>,
    client_region: Option<Region>,
}

/// The server's side of one run over `link`: reads the client's `Hello`,
/// accepts its connection, exposes a region, verifies every message (and
/// with `bidir` runs the same stream back to the client).
/// `peer_ip`, if known, is the client's address (its control connection's).
///
/// A client that goes away before its run starts (its control connection
/// closes or stalls, or a newer one takes over, see [`Link::watch`]) is
/// [`PerfError::Abandoned`]: a client that retries comes back.
pub(super) fn serve_run(
    drv: &mut Driver,
    link: &Link,
    peer_ip: Option<IpAddr>,
) -> anyhow::Result<ServeOutcome> {
    // Anything left over from an earlier run is not ours.
    while drv.endpoint().poll_event().is_some() {}
    let mut conn = None;
    let ServerSetup {
        p,
        conn,
        client_qpns,
        client_region,
    } = match serve_setup(drv, link, peer_ip, &mut conn) {
        Ok(s) => s,
        Err(e) => {
            if let Some(c) = conn {
                let now = drv.now();
                let _ = drv.endpoint().close(now, c);
            }
            return Err(abandoned(e, true));
        }
    };
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
    let ex = ex.map_err(|e| abandoned(e, false))?;
    let sent = match (&req, ex.peer_result) {
        (Some(r), Some(pr)) => Some(Direction::of(r, &pr, retransmits, p.size)),
        _ => None,
    };
    Ok(ServeOutcome {
        received: resp.res,
        sent,
    })
}

/// The server's setup exchange: `Hello` (refused if its version or flags
/// are wrong), `Welcome`, then the client's QPs and its metaroce
/// connection (`conn` as soon as it arrives, so a failure can close it).
fn serve_setup(
    drv: &mut Driver,
    link: &Link,
    peer_ip: Option<IpAddr>,
    conn: &mut Option<ConnectionHandle>,
) -> anyhow::Result<ServerSetup> {
    let take = |e: Event, conn: &mut Option<ConnectionHandle>| {
        if let Event::Incoming { conn: c, peer } = e {
            if peer_ip.is_none_or(|ip| ip == peer.ip()) {
                *conn = Some(c);
            }
        }
    };
    let p = match drive_until_msg(drv, link, SETUP, "Hello", |e| take(e, conn))? {
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
            match drive_until_msg(drv, link, SETUP, "ClientQps", |e| take(e, conn))? {
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
            let mut stop = None;
            drive(drv, SETUP, |d| {
                while let Some(e) = d.endpoint().poll_event() {
                    take(e, conn);
                }
                // The client says nothing more until `Ready`, but its
                // control connection may close, or a newer one take over.
                match link.try_recv() {
                    Ok(None) => {}
                    Ok(Some(m)) => stop = Some(unexpected(m, "nothing before Ready")),
                    Err(e) => stop = Some(e.into()),
                }
                conn.is_some() || stop.is_some()
            })?;
            if let Some(e) = stop {
                return Err(e);
            }
            if conn.is_none() {
                bail!("the client's metaroce connection did not arrive");
            }
        }
    }
    let (client_qpns, client_region) = client.unwrap_or_default();
    Ok(ServerSetup {
        p,
        conn: conn.context("no client connected")?,
        client_qpns,
        client_region,
    })
}

/// `e`, as [`PerfError::Abandoned`] if it says the client left before its
/// run started: a newer connection took over, or (`in_setup`) the
/// control connection closed or stalled during the setup exchange.
fn abandoned(e: anyhow::Error, in_setup: bool) -> anyhow::Error {
    match e.downcast::<PerfError>() {
        Ok(p @ PerfError::Superseded { .. }) => PerfError::Abandoned(Box::new(p)).into(),
        Ok(p @ (PerfError::Closed | PerfError::Stalled { .. })) if in_setup => {
            PerfError::Abandoned(Box::new(p)).into()
        }
        Ok(p) => p.into(),
        Err(e) => e,
    }
}

/// The client's side of one run over `link` against the server at
/// `server_ip`: the setup exchange, then the data phase.
pub(super) fn client_run(
    opts: &RunOpts,
    drv: &mut Driver,
    link: &Link,
    server_ip: IpAddr,
    budget: Budget,
) -> anyhow::Result<Report> {
    let ready = client_setup(opts, drv, link, server_ip, budget)?;
    client_measure(opts, drv, link, ready)
}

/// What the client has of a run once the server said `Ready`.
pub(super) struct ClientReady {
    p: RunParams,
    conn: ConnectionHandle,
    pd: PdHandle,
    send_cq: CqHandle,
    qps: Vec<Qpn>,
    /// With `bidir`: where the server's stream lands.
    resp: Option<Responder>,
    remote_qpns: Vec<u32>,
    remote: Region,
}

/// Server-side setup the client allows for on top of its wait for `Ready`:
/// the server registers and writes its region (and with `bidir` one more
/// of the same size) first, at no less than 256 MiB/s.
fn region_setup_time(p: &RunParams) -> Duration {
    let bytes = Layout::new(p).slots * p.size * if p.bidir { 2 } else { 1 };
    Duration::from_secs_f64(bytes as f64 / f64::from(256u32 << 20))
}

/// The client's setup exchange: `Hello`, `Welcome`, the metaroce
/// connection, `ClientQps`, `Ready`. Each wait for the server (the
/// metaroce handshake included) takes at most `budget.each` (the wait for
/// `Ready` more, for the server's region), and none runs past the
/// budget's deadline: a wait that ends so is [`PerfError::Stalled`] (or
/// [`PerfError::NoConnection`]), for the caller to try again on a new
/// control connection and a new endpoint.
pub(super) fn client_setup(
    opts: &RunOpts,
    drv: &mut Driver,
    link: &Link,
    server_ip: IpAddr,
    budget: Budget,
) -> anyhow::Result<ClientReady> {
    let p = opts.params();
    link.send(Msg::Hello {
        version: VERSION,
        params: p.clone(),
    });
    let udp_port = match drive_until_msg(drv, link, budget.cap(budget.each), "Welcome", |_| {})? {
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
    // Cut at the attempt's timeout: the handshake's HELLOs take one path,
    // and a silent one only fails after seconds; a new attempt comes from
    // a new endpoint, so from new UDP source ports as well.
    drive(drv, budget.cap(budget.each), |d| {
        while let Some(e) = d.endpoint().poll_event() {
            match e {
                Event::Connected(c) if c == conn => up = true,
                Event::ConnectionLost { error, .. } => failed = Some(error),
                _ => {}
            }
        }
        up || failed.is_some()
    })?;
    if failed == Some(metaroce_proto::ConnectionError::KeyRefused) {
        return Err(PerfError::KeyRefused { addr: server_addr }.into());
    }
    if let Some(e) = failed {
        return Err(PerfError::NoConnection {
            addr: server_addr,
            why: e.to_string(),
        }
        .into());
    }
    if !up {
        return Err(PerfError::NoConnection {
            addr: server_addr,
            why: "no answer".into(),
        }
        .into());
    }
    let ep = drv.endpoint();
    let (pd, send_cq, recv_cq, qps) = create_qps(ep, &p)?;
    // With --bidir the server's stream lands here: receives go up before
    // the server learns where to send.
    let resp = if p.bidir {
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
    let ready_wait = budget.cap(budget.each + region_setup_time(&p));
    let (remote_qpns, remote) = match drive_until_msg(drv, link, ready_wait, "Ready", |_| {})? {
        Msg::Ready {
            qpns,
            rkey,
            addr,
            slots,
        } if qpns.len() == qps.len() => (qpns, Region { rkey, addr, slots }),
        m => return Err(unexpected(m, "Ready")),
    };
    Ok(ClientReady {
        p,
        conn,
        pd,
        send_cq,
        qps,
        resp,
        remote_qpns,
        remote,
    })
}

/// The client's data phase, once the server said `Ready`, and its report.
pub(super) fn client_measure(
    opts: &RunOpts,
    drv: &mut Driver,
    link: &Link,
    ready: ClientReady,
) -> anyhow::Result<Report> {
    let ClientReady {
        p,
        conn,
        pd,
        send_cq,
        qps,
        mut resp,
        remote_qpns,
        remote,
    } = ready;
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
        xdp_mode: drv.xdp_info().map(|i| i.mode.to_string()),
        xdp: drv.xdp_info().map(|_| XdpCounters::of(&drv.stats())),
        busy_poll_us: opts.side.busy_poll_us,
        msg_size: size,
        mtu: drv.endpoint().connection_mtu(conn).unwrap_or(0),
        mtu_asked: opts.side.mtu(),
        qps: p.qps,
        bidir: p.bidir,
        verify: p.verify,
        integrity: drv
            .endpoint()
            .connection_protection(conn)
            .map_or("none", |p| p.name()),
        security: match drv.endpoint().connection_protection(conn) {
            Some(p @ metaroce_proto::Protection::Aes128Gcm) => p.name(),
            _ => "none",
        },
        integrity_failures: drv
            .endpoint()
            .stats()
            .rejects
            .get(metaroce_proto::RejectReason::BadIntegrity),
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
        intervals: intervals(
            &req.timeline,
            TIMELINE_STEP,
            opts.interval.unwrap_or(1.0),
            elapsed,
        ),
        interval_given: opts.interval.is_some(),
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
                cwnd: p.cwnd,
                failures: p.failures,
                moves: p.moves,
                slow_moves: p.slow_moves,
                state: match p.state {
                    Some(PathState::Probing) => "probing",
                    _ => "active",
                },
            })
            .collect(),
    })
}
