//! Two QUIC nodes on loopback: slices of both dtypes, mutual TLS against foreign CAs, malformed
//! frames, and the user-space fault injection.

use legion_cluster::net::fault::{FaultConfig, FaultyTransport};
use legion_cluster::net::quic::{
    CLOSE_MALFORMED, Handler, Inbound, QuicNode, QuicOptions, QuicTransport, send_control,
    send_slice,
};
use legion_cluster::net::tls::{ClusterCa, NodeIdentity};
use legion_runtime::Buffer;
use legion_runtime::{SliceMessage, Transport};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
use tokio::time::timeout;

const LOOPBACK: &str = "127.0.0.1:0";

fn loopback() -> SocketAddr {
    LOOPBACK.parse().unwrap()
}

/// A node whose received frames go to a channel.
fn node(identity: &NodeIdentity) -> (QuicNode, UnboundedReceiver<Inbound>) {
    let (tx, rx) = unbounded_channel();
    let handler: Handler = Arc::new(move |m| {
        let _ = tx.send(m);
    });
    let tls = identity.tls().unwrap();
    let node = QuicNode::bind(loopback(), &tls, &QuicOptions::default(), handler).unwrap();
    (node, rx)
}

fn data(f64s: bool, len: usize, salt: u64) -> Buffer {
    if f64s {
        Buffer::F64((0..len).map(|i| (i as f64) * 0.5 + salt as f64).collect())
    } else {
        Buffer::F32((0..len).map(|i| (i % 4099) as f32 - salt as f32).collect())
    }
}

async fn next_slice(rx: &mut UnboundedReceiver<Inbound>, wait: Duration) -> Option<SliceMessage> {
    match timeout(wait, rx.recv()).await {
        Ok(Some(Inbound::Slice(msg))) => Some(msg),
        Ok(Some(other)) => panic!("unexpected {other:?}"),
        Ok(None) | Err(_) => None,
    }
}

struct Pair {
    a: QuicNode,
    b: QuicNode,
    a_rx: UnboundedReceiver<Inbound>,
    b_rx: UnboundedReceiver<Inbound>,
    /// The connection A dialed to B, which `a_to_b` sends on.
    ab: quinn::Connection,
    /// A's transport: device 1 lives on B.
    a_to_b: Arc<QuicTransport>,
    /// B's transport: device 0 lives on A.
    b_to_a: Arc<QuicTransport>,
}

/// Each node dials the other and sends on the connection it dialed.
async fn pair() -> Pair {
    let ca = ClusterCa::generate().unwrap();
    let (a, a_rx) = node(&ca.issue("node-a", &[]).unwrap());
    let (b, b_rx) = node(&ca.issue("node-b", &[]).unwrap());
    let ab = a.connect(b.local_addr().unwrap(), "node-b").await.unwrap();
    let ba = b.connect(a.local_addr().unwrap(), "node-a").await.unwrap();
    let rt = tokio::runtime::Handle::current();
    let a_to_b = Arc::new(QuicTransport::new(rt.clone(), None));
    a_to_b.route(1, ab.clone());
    let b_to_a = Arc::new(QuicTransport::new(rt, None));
    b_to_a.route(0, ba);
    Pair {
        a,
        b,
        a_rx,
        b_rx,
        ab,
        a_to_b,
        b_to_a,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_exchange_slices_of_both_dtypes_concurrently() {
    let mut p = pair().await;
    // 1 element up to 4 MiB (f32) and 2 MiB (f64), all in flight at once in both directions.
    let lens = [1usize, 7, 1000, 65_537, 1 << 20];
    let mut sent = Vec::new();
    for (copy, &len) in lens.iter().enumerate() {
        for f64s in [false, true] {
            let copy = (copy * 2 + f64s as usize) as u32;
            let len = if f64s { len.div_ceil(2) } else { len };
            let (step, salt) = (5, copy as u64);
            p.a_to_b.send(SliceMessage {
                step,
                copy,
                to: 1,
                data: data(f64s, len, salt).into(),
            });
            p.b_to_a.send(SliceMessage {
                step,
                copy: copy + 100,
                to: 0,
                data: data(f64s, len, salt + 1).into(),
            });
            sent.push((copy, f64s, len));
        }
    }
    let wait = Duration::from_secs(30);
    for (rx, to, offset) in [(&mut p.b_rx, 1, 0u32), (&mut p.a_rx, 0, 100)] {
        let mut got = Vec::new();
        for _ in 0..sent.len() {
            got.push(next_slice(rx, wait).await.expect("slice not delivered"));
        }
        got.sort_by_key(|m| m.copy);
        for (msg, &(copy, f64s, len)) in got.iter().zip(&sent) {
            assert_eq!((msg.step, msg.copy, msg.to), (5, copy + offset, to));
            let salt = copy as u64 + (offset > 0) as u64;
            assert_eq!(*msg.data, data(f64s, len, salt), "copy {}", msg.copy);
        }
    }
    p.a.shutdown().await;
    p.b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_striped_over_several_connections_all_arrive_intact() {
    let ca = ClusterCa::generate().unwrap();
    let (a, _a_rx) = node(&ca.issue("node-a", &[]).unwrap());
    let (b, mut b_rx) = node(&ca.issue("node-b", &[]).unwrap());
    let conns = a
        .connect_many(b.local_addr().unwrap(), "node-b", 3)
        .await
        .unwrap();
    assert_eq!(conns.len(), 3);
    let transport = QuicTransport::new(tokio::runtime::Handle::current(), None);
    transport.route_many(1, conns.clone());
    let count = 12u32;
    for copy in 0..count {
        transport.send(SliceMessage {
            step: 2,
            copy,
            to: 1,
            data: data(copy % 2 == 1, 100_000, copy as u64).into(),
        });
    }
    let mut got = Vec::new();
    for _ in 0..count {
        let msg = next_slice(&mut b_rx, Duration::from_secs(30)).await;
        got.push(msg.expect("slice not delivered"));
    }
    got.sort_by_key(|m| m.copy);
    for (copy, msg) in (0..count).zip(&got) {
        assert_eq!((msg.step, msg.copy, msg.to), (2, copy, 1));
        assert_eq!(*msg.data, data(copy % 2 == 1, 100_000, copy as u64));
    }
    // Round robin: every connection carried its share of streams.
    for conn in &conns {
        assert!(
            conn.stats().udp_tx.bytes > 4 * 400_000,
            "{:?}",
            conn.stats()
        );
    }
    a.shutdown().await;
    b.shutdown().await;
}

/// A connection sends its streams one after another, in the order written: a small slice written
/// after a large one goes out only once all of the large one has (interleaving would send it in the
/// first packets), and a control message overtakes the slices queued before it.
///
/// The order is checked on the sender's byte count, not on delivery times: each stream is read by
/// its own task, and on a loaded machine a large slice's reader can still be copying its last
/// megabytes when the small slice sent after it has long been handed over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_arrive_in_the_order_sent_and_control_messages_overtake_them() {
    const LARGE_LEN: usize = 2 << 20;
    let large_bytes = (LARGE_LEN * std::mem::size_of::<f32>()) as u64;
    let mut p = pair().await;
    let big = |copy| SliceMessage {
        step: 1,
        copy,
        to: 1,
        data: data(false, LARGE_LEN, copy as u64).into(),
    };
    let small = SliceMessage {
        step: 1,
        copy: 1,
        to: 1,
        data: data(false, 1, 1).into(),
    };
    let sent_before = p.ab.stats().udp_tx.bytes;
    // each call returns once its data is buffered on the connection, before much of it is sent
    send_slice(&p.ab, &big(0)).await.unwrap();
    send_slice(&p.ab, &small).await.unwrap();
    send_slice(&p.ab, &big(2)).await.unwrap();
    send_control(&p.ab, b"heartbeat").await.unwrap();
    let mut order = Vec::new();
    // Bytes the sender had put on the wire by the time the small slice was received: at least
    // what it had sent when the small slice's first packet left.
    let mut sent_by_small = None;
    while order.len() < 4 {
        match timeout(Duration::from_secs(30), p.b_rx.recv()).await {
            Ok(Some(Inbound::Slice(msg))) => {
                if msg.copy == 1 {
                    sent_by_small = Some(p.ab.stats().udp_tx.bytes - sent_before);
                }
                order.push(format!("slice {}", msg.copy));
            }
            Ok(Some(Inbound::Control { bytes, .. })) => {
                assert_eq!(bytes, b"heartbeat");
                order.push("control".to_string());
            }
            other => panic!("{other:?}"),
        }
    }
    let sent_by_small = sent_by_small.expect("small slice not delivered");
    assert!(
        sent_by_small >= large_bytes,
        "{order:?}: the small slice was received when {sent_by_small} bytes had been sent, \
         fewer than the {large_bytes} of the large slice written before it"
    );
    assert_ne!(order[3], "control", "{order:?}");
    p.a.shutdown().await;
    p.b.shutdown().await;
}

/// quinn sends up to 10 datagrams in one GSO `sendmsg`; once MTU discovery grows them past 6.5 kB
/// (loopback carries 64 KiB), the batch must be split or the kernel drops it, black-hole detection
/// fires and the MTU falls back to 1200 bytes.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn datagrams_grow_to_the_loopback_mtu_without_black_holes() {
    let mut p = pair().await;
    let conn = p.ab.clone();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut copy = 0;
    let mut send_one = async |copy: u32| {
        let len = 1 << 20;
        p.a_to_b.send(SliceMessage {
            step: 0,
            copy,
            to: 1,
            data: data(false, len, copy as u64).into(),
        });
        let got = next_slice(&mut p.b_rx, Duration::from_secs(10)).await;
        let got = got.expect("slice not delivered");
        assert_eq!(*got.data, data(false, len, copy as u64));
    };
    // MTU discovery starts after the handshake and takes a few round trips per step (its probes
    // are single datagrams, which pass whatever the batching).
    while conn.stats().path.current_mtu < 16_000 && Instant::now() < deadline {
        send_one(copy).await;
        copy += 1;
    }
    // Then enough full-size batches that a dropped one would be detected.
    for _ in 0..16 {
        send_one(copy).await;
        copy += 1;
    }
    let stats = conn.stats().path;
    assert!(stats.current_mtu >= 16_000, "{stats:?}");
    assert_eq!(stats.black_holes_detected, 0, "{stats:?}");
    p.a.shutdown().await;
    p.b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_from_another_ca_cannot_connect() {
    let ca = ClusterCa::generate().unwrap();
    let (server, mut server_rx) = node(&ca.issue("node-b", &[]).unwrap());
    // Trusts the cluster CA (so the server passes), but its own certificate is foreign.
    let other = ClusterCa::generate().unwrap();
    let mut rogue = other.issue("rogue", &[]).unwrap();
    rogue.ca_pem = ca.cert_pem().to_string();
    let (client, _rx) = node(&rogue);

    // In TLS 1.3 the client may finish its side before the server has checked the client's
    // certificate, so the refusal shows either as a failed connect or as the connection closing.
    let addr = server.local_addr().unwrap();
    if let Ok(conn) = client.connect(addr, "node-b").await {
        let msg = SliceMessage {
            step: 0,
            copy: 0,
            to: 1,
            data: Buffer::F32(vec![1.0]).into(),
        };
        let _ = send_slice(&conn, &msg).await;
        let reason = timeout(Duration::from_secs(5), conn.closed())
            .await
            .expect("connection with a foreign certificate stayed open");
        assert!(
            reason.to_string().to_lowercase().contains("certificate")
                || reason.to_string().contains("crypto"),
            "{reason}"
        );
    }
    assert!(
        next_slice(&mut server_rx, Duration::from_millis(300))
            .await
            .is_none()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_certificate_from_another_ca_is_refused() {
    let ca = ClusterCa::generate().unwrap();
    let (client, _rx) = node(&ca.issue("node-a", &[]).unwrap());
    let other = ClusterCa::generate().unwrap();
    let (rogue_server, _srx) = node(&other.issue("node-b", &[]).unwrap());
    let err = client
        .connect(rogue_server.local_addr().unwrap(), "node-b")
        .await
        .expect_err("client accepted a server certificate from another CA");
    assert!(
        err.to_string().to_lowercase().contains("certificate"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_for_another_name_is_refused() {
    let ca = ClusterCa::generate().unwrap();
    let (client, _rx) = node(&ca.issue("node-a", &[]).unwrap());
    let (server, _srx) = node(&ca.issue("node-b", &[]).unwrap());
    let addr = server.local_addr().unwrap();
    assert!(client.connect(addr, "node-c").await.is_err());
    // The address and localhost are in every node certificate.
    client.connect(addr, "localhost").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_frame_closes_the_connection_and_the_node_keeps_serving() {
    let ca = ClusterCa::generate().unwrap();
    let (client, _rx) = node(&ca.issue("node-a", &[]).unwrap());
    let (server, mut server_rx) = node(&ca.issue("node-b", &[]).unwrap());
    let addr = server.local_addr().unwrap();

    let conn = client.connect(addr, "node-b").await.unwrap();
    let mut send = conn.open_uni().await.unwrap();
    send.write_all(&[0xAB; 100]).await.unwrap();
    send.finish().unwrap();
    let reason = timeout(Duration::from_secs(5), conn.closed())
        .await
        .unwrap();
    match reason {
        quinn::ConnectionError::ApplicationClosed(close) => {
            assert_eq!(close.error_code, CLOSE_MALFORMED)
        }
        // The server's close packet can be dropped (loopback drops datagrams when other tests
        // keep the cores busy); once the server has forgotten the connection it answers the
        // client's next packet with a stateless reset. Either way the server closed it.
        quinn::ConnectionError::Reset => {}
        other => panic!("closed for another reason: {other}"),
    }

    let conn = client.connect(addr, "node-b").await.unwrap();
    let msg = SliceMessage {
        step: 1,
        copy: 2,
        to: 3,
        data: Buffer::F64(vec![4.0]).into(),
    };
    send_slice(&conn, &msg).await.unwrap();
    let got = next_slice(&mut server_rx, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(got.data, msg.data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injected_delay_delays_delivery() {
    let mut p = pair().await;
    let rt = tokio::runtime::Handle::current();
    let mut elapsed = Vec::new();
    for delay in [Duration::ZERO, Duration::from_millis(300)] {
        let config = FaultConfig {
            delay,
            ..FaultConfig::default()
        };
        let faulty = FaultyTransport::new(p.a_to_b.clone(), config, rt.clone());
        let start = Instant::now();
        faulty.send(SliceMessage {
            step: 0,
            copy: 0,
            to: 1,
            data: data(false, 1000, 0).into(),
        });
        next_slice(&mut p.b_rx, Duration::from_secs(10))
            .await
            .unwrap();
        elapsed.push(start.elapsed());
    }
    assert!(elapsed[1] >= Duration::from_millis(300), "{elapsed:?}");
    assert!(
        elapsed[1] - elapsed[0] >= Duration::from_millis(250),
        "{elapsed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injected_loss_drops_exactly_the_chosen_messages_and_disconnect_drops_the_rest() {
    let mut p = pair().await;
    let config = FaultConfig {
        drop_probability: 0.4,
        seed: 11,
        ..FaultConfig::default()
    };
    let expected: BTreeSet<u32> = (0..40u32).filter(|&i| !config.drops(i as u64)).collect();
    assert!(expected.len() > 10 && expected.len() < 35);
    let faulty = FaultyTransport::new(p.a_to_b.clone(), config, tokio::runtime::Handle::current());
    for copy in 0..40u32 {
        faulty.send(SliceMessage {
            step: 0,
            copy,
            to: 1,
            data: data(true, 10, copy as u64).into(),
        });
    }
    let mut got = BTreeSet::new();
    while let Some(msg) = next_slice(&mut p.b_rx, Duration::from_millis(500)).await {
        got.insert(msg.copy);
    }
    assert_eq!(got, expected);
    assert_eq!(faulty.dropped(), 40 - expected.len() as u64);

    // A forced disconnect loses everything after it and closes the link it routes over.
    let conn =
        p.a.connect(p.b.local_addr().unwrap(), "node-b")
            .await
            .unwrap();
    let transport = Arc::new(QuicTransport::new(tokio::runtime::Handle::current(), None));
    transport.route(1, conn.clone());
    let lossless = FaultyTransport::new(
        transport,
        FaultConfig::default(),
        tokio::runtime::Handle::current(),
    );
    let closing = conn.clone();
    lossless.on_disconnect(move || closing.close(0u32.into(), b"fault injection"));
    let msg = |step| SliceMessage {
        step,
        copy: 0,
        to: 1,
        data: data(false, 10, 0).into(),
    };
    lossless.send(msg(1));
    assert_eq!(
        next_slice(&mut p.b_rx, Duration::from_secs(5))
            .await
            .unwrap()
            .step,
        1
    );
    lossless.disconnect();
    lossless.send(msg(2));
    assert!(
        next_slice(&mut p.b_rx, Duration::from_millis(300))
            .await
            .is_none()
    );
    assert_eq!(lossless.dropped(), 1);
    assert!(conn.close_reason().is_some());
    let _ = &p.b_to_a;
}
