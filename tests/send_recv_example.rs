//! The SEND/RECV server example (`examples/send_recv_server.rs`) run as a
//! test: a server and three clients over loopback on the async API, every
//! reply checked byte for byte by the client (a wrong or missing reply is
//! an error, and so a failure here).

#[allow(dead_code)]
#[path = "../examples/send_recv_server.rs"]
mod example;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_send_recv_server_answers_every_request_of_three_clients() {
    let run = example::loopback(3, 1500, 3000);
    let reports = tokio::time::timeout(std::time::Duration::from_secs(60), run)
        .await
        .expect("the example finished in time")
        .expect("every reply arrived and matched");
    assert_eq!(reports.len(), 3);
    for r in &reports {
        assert_eq!(r.requests, 500);
        assert_eq!(r.latencies_us.len(), 500);
        assert_eq!(r.bytes, 2 * 500 * 3000);
    }
}
