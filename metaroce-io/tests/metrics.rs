//! Metrics from a live loopback transfer, scraped over HTTP.

use metaroce_io::{Driver, DriverConfig, Metrics, MetricsServer};
use metaroce_proto::verbs::*;
use metaroce_proto::{EndpointConfig, Event};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(c, "GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
    let mut out = String::new();
    c.read_to_string(&mut out).unwrap();
    out
}

/// The value of the series `name{labels}` in an exposition text.
fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no series {series}"))
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn live_transfer_then_scrape() {
    const LEN: usize = 2 << 20;
    let start = Instant::now();
    let mut cfg = DriverConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.endpoint = EndpointConfig {
        paths: 2,
        ..EndpointConfig::default()
    };
    cfg.send_sockets = 4;
    let mut a = Driver::bind(cfg.clone()).unwrap();
    let mut b = Driver::bind(cfg).unwrap();
    let now = a.now();
    let conn = a.endpoint().connect(now, b.local_addr()).unwrap();
    let (mut up, mut conn_b) = (false, None);
    while !(up && conn_b.is_some()) {
        assert!(start.elapsed() < Duration::from_secs(10));
        a.poll(Duration::ZERO).unwrap();
        b.poll(Duration::ZERO).unwrap();
        while let Some(e) = a.endpoint().poll_event() {
            up |= matches!(e, Event::Connected(c) if c == conn);
        }
        while let Some(e) = b.endpoint().poll_event() {
            if let Event::Incoming { conn, .. } = e {
                conn_b = Some(conn);
            }
        }
    }
    let (pda, pdb) = (a.endpoint().alloc_pd(), b.endpoint().alloc_pd());
    let (cqa, cqb) = (a.endpoint().create_cq(64), b.endpoint().create_cq(64));
    let qa = a.endpoint().create_qp(QpInit::new(pda, cqa, cqa)).unwrap();
    let qb = b.endpoint().create_qp(QpInit::new(pdb, cqb, cqb)).unwrap();
    a.endpoint().connect_qp(qa, conn, qb).unwrap();
    b.endpoint().connect_qp(qb, conn_b.unwrap(), qa).unwrap();
    let src = a
        .endpoint()
        .reg_mr(pda, vec![7u8; LEN].into_boxed_slice(), 0, AccessFlags::NONE)
        .unwrap();
    let dst = b
        .endpoint()
        .reg_mr(
            pdb,
            vec![0u8; LEN].into_boxed_slice(),
            0,
            AccessFlags::REMOTE_WRITE,
        )
        .unwrap();
    let wr = SendWr::new(
        1,
        SendOp::Write(RemoteAddr {
            rkey: dst.rkey,
            addr: dst.addr,
        }),
        Sge {
            lkey: src.lkey,
            addr: src.addr,
            len: LEN as u32,
        },
    );
    let now = a.now();
    a.endpoint().post_send(now, qa, wr).unwrap();
    let mut wc = Vec::new();
    while wc.is_empty() {
        assert!(start.elapsed() < Duration::from_secs(10), "WRITE timed out");
        a.poll(Duration::ZERO).unwrap();
        b.poll(Duration::ZERO).unwrap();
        a.endpoint().poll_cq(cqa, 4, &mut wc).unwrap();
    }
    assert_eq!(wc[0].status, WcStatus::Success);

    // Both endpoints in one registry.
    let mut ma = Metrics::new("a").unwrap();
    let mut mb = Metrics::with_registry(ma.registry().clone(), "b").unwrap();
    ma.update(a.endpoint());
    ma.update_driver(&a.stats());
    mb.update(b.endpoint());
    mb.update_driver(&b.stats());
    let server = MetricsServer::start("127.0.0.1:0", ma.registry().clone()).unwrap();
    let addr = server.local_addr();
    let resp = get(addr, "/metrics");
    assert!(resp.starts_with("HTTP/1.1 200 OK\r\n"), "{resp}");
    assert!(resp.contains("Content-Type: text/plain; version=0.0.4"));
    let body = &resp[resp.find("\r\n\r\n").unwrap() + 4..];
    for name in [
        "metaroce_bytes_sent_total",
        "metaroce_datagrams_received_total",
        "metaroce_rejects_total",
        "metaroce_connections",
        "metaroce_connection_retransmits_total",
        "metaroce_connection_fast_retransmits_total",
        "metaroce_connection_rto_fires_total",
        "metaroce_connection_cwnd_bytes",
        "metaroce_connection_srtt_seconds",
        "metaroce_connection_rate_hint_bits_per_second",
        "metaroce_connection_peer_window_bytes",
        "metaroce_path_bytes_sent_total",
        "metaroce_path_ecn_ce_marks_total",
        "metaroce_path_state",
        "metaroce_path_srtt_seconds",
        "metaroce_driver_datagrams_sent_total",
        "metaroce_driver_faults_dropped_total",
        "metaroce_driver_busy_polls_total",
        "metaroce_driver_late_drains_total",
        "metaroce_driver_idle_turns_total",
    ] {
        assert!(
            body.contains(&format!("# TYPE {name} ")),
            "{name} missing:\n{body}"
        );
    }
    let sent = value(body, "metaroce_bytes_sent_total{endpoint=\"a\"}");
    let recv = value(body, "metaroce_bytes_received_total{endpoint=\"b\"}");
    assert!(sent >= LEN as f64, "a sent {sent} bytes");
    assert!(recv >= LEN as f64, "b received {recv} bytes");
    let c = conn.index();
    let payload = value(
        body,
        &format!("metaroce_connection_payload_bytes_sent_total{{conn=\"{c}\",endpoint=\"a\"}}"),
    );
    assert!(payload >= LEN as f64, "{payload}");
    // The driver gave b a receive buffer to share, so its ACKs carried a
    // window that a keeps to.
    let window = value(
        body,
        &format!("metaroce_connection_peer_window_bytes{{conn=\"{c}\",endpoint=\"a\"}}"),
    );
    assert!(window > 0.0, "no window from the receiver: {window}");
    let paths: f64 = (0..2)
        .map(|p| {
            value(
                body,
                &format!(
                    "metaroce_path_bytes_sent_total{{conn=\"{c}\",endpoint=\"a\",path=\"{p}\"}}"
                ),
            )
        })
        .sum();
    assert!(paths > 0.0);
    assert_eq!(value(body, "metaroce_connections{endpoint=\"a\"}"), 1.0);
    println!(
        "scraped {} bytes; a sent {sent} bytes, b received {recv}",
        body.len()
    );

    assert!(get(addr, "/nope").starts_with("HTTP/1.1 404"));
    // A second update only moves counters forward.
    ma.update(a.endpoint());
    assert!(ma
        .encode()
        .contains("metaroce_bytes_sent_total{endpoint=\"a\"} "));

    drop(server);
    assert!(
        TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err(),
        "the server closed its socket"
    );
}

/// A device's metrics, served with its refresher, are current when
/// scraped: the counters a scrape shows lie between the endpoint's own
/// stats read just before and just after it, though traffic ran right up
/// to the first read (the periodic refresh, every 250 ms, lags behind).
#[test]
fn device_metrics_are_current_when_scraped() {
    use metaroce_io::{connect_qp_pair, AccessFlags, Device};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let metrics = Metrics::new("dev").unwrap();
        let registry = metrics.registry().clone();
        let cfg = || DriverConfig::new("127.0.0.1:0".parse().unwrap());
        let a = Device::open_with_metrics(cfg(), metrics).await.unwrap();
        let b = Device::open(cfg()).await.unwrap();
        let server =
            MetricsServer::start_with_refresh("127.0.0.1:0", registry, a.metrics_refresher())
                .unwrap();
        let (qa, qb) = connect_qp_pair(&a, &b).await.unwrap();
        let src = qa.pd.reg_mr(vec![5u8; 4096], AccessFlags::NONE).await.unwrap();
        let dst = qb.pd.reg_mr(vec![0u8; 4096], AccessFlags::LOCAL_WRITE).await.unwrap();
        for round in 0..5 {
            // Traffic, then the scrape at once.
            for _ in 0..20 {
                let got = qb.qp.recv(dst.sge(0, 4096).unwrap());
                qa.qp.send(src.sge(0, 4096).unwrap()).await.unwrap();
                got.await.unwrap();
            }
            let before = a.stats().await.unwrap().datagrams_sent;
            let addr = server.local_addr();
            let text = tokio::task::spawn_blocking(move || get(addr, "/metrics"))
                .await
                .unwrap();
            let after = a.stats().await.unwrap().datagrams_sent;
            let series = "metaroce_datagrams_sent_total{endpoint=\"dev\"}";
            let scraped = text
                .lines()
                .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
                .map(|v| v.trim().parse::<u64>().unwrap());
            assert!(
                scraped.is_some_and(|n| (before..=after).contains(&n)),
                "round {round}: scraped {scraped:?}, the endpoint had sent {before} before the scrape and {after} after"
            );
        }
    });
}
