//! QUIC endpoints (quinn, ring) carrying frames: one uni-stream per frame, so a large slice never
//! holds up a small one, and a [`QuicTransport`] implementing the runtime's `Transport`.
//!
//! A connection is symmetric once established: both sides open uni-streams on it, whichever side
//! dialed. Every stream carries exactly one frame (a slice or a control message, told apart by the
//! header's kind). A frame that fails validation closes the whole connection: the peer is broken or
//! hostile, and the runtime cannot make progress on a partial step anyway.

use super::frame::{Frame, FrameError, Limits};
use super::stream::{BufferSource, read_single_frame, write_control, write_slice_chunks};
use super::tls::NodeTls;
use legion_ops::partition::DeviceId;
use legion_runtime::{SliceMessage, Transport};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::udp::{RecvMeta, Transmit};
use quinn::{
    AsyncUdpSocket, Connection, Endpoint, EndpointConfig, Runtime, TokioRuntime, TransportConfig,
    UdpPoller, VarInt,
};
use std::collections::HashMap;
use std::io::IoSliceMut;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

/// Application close codes.
pub const CLOSE_MALFORMED: VarInt = VarInt::from_u32(1);
pub const CLOSE_SHUTDOWN: VarInt = VarInt::from_u32(2);

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error(transparent)]
    Tls(#[from] super::tls::TlsError),
    #[error("TLS configuration not usable for QUIC: {0}")]
    QuicTls(String),
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("connect: {0}")]
    Connect(#[from] quinn::ConnectError),
    #[error("connection: {0}")]
    Connection(#[from] quinn::ConnectionError),
    #[error("stream write: {0}")]
    Write(#[from] quinn::WriteError),
    #[error("stream closed: {0}")]
    Closed(#[from] quinn::ClosedStream),
    #[error(transparent)]
    Frame(#[from] FrameError),
}

/// What arrives from peers.
#[derive(Debug)]
pub enum Inbound {
    Slice(SliceMessage),
    /// A control message and the connection it came on, to reply on.
    Control {
        peer: SocketAddr,
        conn: Connection,
        bytes: Vec<u8>,
    },
}

/// Called on a tokio worker thread for every frame received; must not block for long (the worker
/// forwards slices to its device actors' mailboxes).
pub type Handler = Arc<dyn Fn(Inbound) + Send + Sync>;

/// Transport parameters. The defaults favour bulk slices on a LAN: large flow-control windows so
/// a multi-megabyte slice is never throttled by the receiver, and many concurrent streams since a
/// step sends many slices at once.
#[derive(Clone, Debug)]
pub struct QuicOptions {
    pub limits: Limits,
    pub max_concurrent_streams: u32,
    pub stream_receive_window: u32,
    pub receive_window: u32,
    pub send_window: u64,
    pub keep_alive: Duration,
    pub idle_timeout: Duration,
    /// Requested UDP socket send and receive buffer size (0: the system default). The kernel caps
    /// it at `net.core.{r,w}mem_max`.
    pub udp_buffer: usize,
    /// Largest UDP payload that path MTU discovery may probe up to. Packets start at QUIC's safe
    /// 1200 bytes and grow only as far as the path carries them (probes too large for the
    /// interface fail locally and cost nothing on the wire), so a high bound is free on a
    /// 1500-byte network and saves most per-packet work (header protection, acks, syscalls,
    /// per-datagram bookkeeping) on jumbo-frame links and loopback, where datagrams reach 64 KiB.
    ///
    /// The starting size stays 1200 (quinn's `initial_mtu`): a server may send only three times
    /// what it has received before the client's address is validated, and quinn will not send a
    /// datagram larger than that budget, so an initial MTU above ~3600 bytes deadlocks the
    /// handshake.
    pub max_mtu: u16,
    /// Whether a connection interleaves the data of its open streams (quinn's default round robin)
    /// instead of sending each stream to completion in the order the streams were written.
    ///
    /// Off: slices then leave in the order the devices sent them, and the first one sent arrives
    /// first instead of every slice in flight arriving near the end of the burst. A step's early
    /// slices (the last layers' gradients) gate the next work (their owners' updates), and the
    /// planner's simulator models a link as carrying one message at a time, in order: with
    /// interleaving, a 2-host data-parallel AlexNet step took 18% longer than simulated.
    pub interleave_streams: bool,
}

impl Default for QuicOptions {
    fn default() -> QuicOptions {
        QuicOptions {
            limits: Limits::default(),
            max_concurrent_streams: 1024,
            stream_receive_window: 16 << 20,
            receive_window: 64 << 20,
            send_window: 64 << 20,
            keep_alive: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(10),
            udp_buffer: 8 << 20,
            // The most a UDP datagram can carry; MTU discovery settles on what the path allows.
            max_mtu: 65527,
            interleave_streams: false,
        }
    }
}

impl QuicOptions {
    fn transport_config(&self) -> TransportConfig {
        let mut t = TransportConfig::default();
        t.max_concurrent_uni_streams(self.max_concurrent_streams.into())
            // Slices and control use uni-streams only.
            .max_concurrent_bidi_streams(0u32.into())
            .stream_receive_window(self.stream_receive_window.into())
            .receive_window(self.receive_window.into())
            .send_window(self.send_window)
            .keep_alive_interval(Some(self.keep_alive))
            .send_fairness(self.interleave_streams);
        let mut mtu = quinn::MtuDiscoveryConfig::default();
        mtu.upper_bound(self.max_mtu);
        t.mtu_discovery_config(Some(mtu));
        if let Ok(idle) = self.idle_timeout.try_into() {
            t.max_idle_timeout(Some(idle));
        }
        t
    }
}

/// A bound endpoint: accepts peers with cluster certificates and dials peers.
pub struct QuicNode {
    endpoint: Endpoint,
    handler: Handler,
    buffers: Option<BufferSource>,
    limits: Limits,
}

impl QuicNode {
    /// Binds `addr` and starts accepting. Must be called inside a tokio runtime.
    pub fn bind(
        addr: SocketAddr,
        tls: &NodeTls,
        options: &QuicOptions,
        handler: Handler,
    ) -> Result<QuicNode, NetError> {
        QuicNode::bind_with_buffers(addr, tls, options, handler, None)
    }

    /// [`bind`](Self::bind), reading received slices into buffers from `buffers` where it has one.
    pub fn bind_with_buffers(
        addr: SocketAddr,
        tls: &NodeTls,
        options: &QuicOptions,
        handler: Handler,
        buffers: Option<BufferSource>,
    ) -> Result<QuicNode, NetError> {
        let transport = Arc::new(options.transport_config());
        let server_crypto = QuicServerConfig::try_from(tls.server.clone())
            .map_err(|e| NetError::QuicTls(e.to_string()))?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
        server.transport_config(transport.clone());
        let client_crypto = QuicClientConfig::try_from(tls.client.clone())
            .map_err(|e| NetError::QuicTls(e.to_string()))?;
        let mut client = quinn::ClientConfig::new(Arc::new(client_crypto));
        client.transport_config(transport);

        let socket = std::net::UdpSocket::bind(addr)?;
        if options.udp_buffer > 0 {
            // Bursts of a multi-megabyte slice overflow the default buffer; the loss then reads
            // as congestion and shrinks the window.
            let state = quinn::udp::UdpSocketState::new((&socket).into())?;
            state.set_send_buffer_size((&socket).into(), options.udp_buffer)?;
            state.set_recv_buffer_size((&socket).into(), options.udp_buffer)?;
            tracing::debug!(
                send = state.send_buffer_size((&socket).into())?,
                recv = state.recv_buffer_size((&socket).into())?,
                "UDP socket buffers"
            );
        }
        let mut endpoint_config = EndpointConfig::default();
        endpoint_config
            .max_udp_payload_size(options.max_mtu.max(1200))
            .map_err(|e| NetError::QuicTls(format!("max_mtu: {e}")))?;
        let runtime = Arc::new(TokioRuntime);
        let socket = Arc::new(GsoSplitSocket {
            inner: runtime.wrap_udp_socket(socket)?,
        });
        let mut endpoint =
            Endpoint::new_with_abstract_socket(endpoint_config, Some(server), socket, runtime)?;
        endpoint.set_default_client_config(client);
        let node = QuicNode {
            endpoint,
            handler,
            buffers,
            limits: options.limits,
        };
        node.spawn_accept_loop();
        Ok(node)
    }

    pub fn local_addr(&self) -> Result<SocketAddr, NetError> {
        Ok(self.endpoint.local_addr()?)
    }

    /// Dials a peer; `server_name` must be one of the names in its certificate (its node name,
    /// `localhost`, or its address). The connection then carries frames both ways.
    pub async fn connect(
        &self,
        addr: SocketAddr,
        server_name: &str,
    ) -> Result<Connection, NetError> {
        let conn = self.endpoint.connect(addr, server_name)?.await?;
        tokio::spawn(serve_connection(
            conn.clone(),
            self.handler.clone(),
            self.buffers.clone(),
            self.limits,
        ));
        Ok(conn)
    }

    /// Dials `count` (at least one) separate connections to the same peer, for
    /// [`QuicTransport::route_many`]. quinn drives each connection from a single task (packetising,
    /// encrypting, acknowledging), so one connection keeps one core busy at most; several let a
    /// step's slices use more cores at both ends. The peer serves each like any other connection.
    pub async fn connect_many(
        &self,
        addr: SocketAddr,
        server_name: &str,
        count: usize,
    ) -> Result<Vec<Connection>, NetError> {
        let mut conns = Vec::with_capacity(count.max(1));
        for _ in 0..count.max(1) {
            conns.push(self.connect(addr, server_name).await?);
        }
        Ok(conns)
    }

    /// Closes every connection and stops accepting.
    pub async fn shutdown(&self) {
        self.endpoint.close(CLOSE_SHUTDOWN, b"shutdown");
        self.endpoint.wait_idle().await;
    }

    fn spawn_accept_loop(&self) {
        let endpoint = self.endpoint.clone();
        let handler = self.handler.clone();
        let buffers = self.buffers.clone();
        let limits = self.limits;
        tokio::spawn(async move {
            while let Some(incoming) = endpoint.accept().await {
                let (handler, buffers) = (handler.clone(), buffers.clone());
                tokio::spawn(async move {
                    let remote = incoming.remote_address();
                    match incoming.await {
                        Ok(conn) => serve_connection(conn, handler, buffers, limits).await,
                        // A client that gave up on its own handshake (a launcher's short
                        // greeting timing out) is routine.
                        Err(e) if handshake_abandoned(&e) => {
                            tracing::debug!(%remote, "handshake abandoned: {e}")
                        }
                        // Includes peers without a cluster-signed certificate.
                        Err(e) => tracing::warn!(%remote, "peer rejected: {e}"),
                    }
                });
            }
        });
    }
}

/// Receives frames on `conn` until it closes: one task per stream, so streams complete in any order.
async fn serve_connection(
    conn: Connection,
    handler: Handler,
    buffers: Option<BufferSource>,
    limits: Limits,
) {
    let peer = conn.remote_address();
    loop {
        let mut recv = match conn.accept_uni().await {
            Ok(recv) => recv,
            Err(e) => {
                tracing::debug!(%peer, "connection ended: {e}");
                return;
            }
        };
        let (conn, handler, buffers) = (conn.clone(), handler.clone(), buffers.clone());
        tokio::spawn(async move {
            match read_single_frame(&mut recv, &limits, buffers.as_ref()).await {
                Ok(Frame::Slice(msg)) => handler(Inbound::Slice(msg)),
                Ok(Frame::Control(bytes)) => handler(Inbound::Control { peer, conn, bytes }),
                Err(FrameError::Io(e)) => tracing::debug!(%peer, "stream aborted: {e}"),
                Err(e) => {
                    tracing::error!(%peer, "malformed frame, closing the connection: {e}");
                    conn.close(CLOSE_MALFORMED, e.to_string().as_bytes());
                }
            }
        });
    }
}

/// Sends one slice on its own uni-stream. The payload is handed to quinn as a reference to the
/// slice's buffer rather than copied into its send queue: the only copy left on the send path is
/// the one into each packet, which encryption needs anyway.
pub async fn send_slice(conn: &Connection, msg: &SliceMessage) -> Result<(), NetError> {
    let mut send = conn.open_uni().await?;
    write_slice_chunks(&mut send, msg).await?;
    send.finish()?;
    Ok(())
}

/// Stream priority of control messages; slices keep quinn's default, 0.
const CONTROL_PRIORITY: i32 = 1;

/// Stream priority of heartbeats: above every control message, so that one does not wait behind
/// a large reply (a `ReadDone` of a job's weights takes seconds over a slow link, longer than the
/// driver waits for a heartbeat).
const HEARTBEAT_PRIORITY: i32 = 2;

/// A client that gave up on its own handshake (a launcher's short greeting timing out) is routine,
/// unlike a refusal (no cluster-signed certificate).
fn handshake_abandoned(e: &quinn::ConnectionError) -> bool {
    match e {
        quinn::ConnectionError::ApplicationClosed(_) | quinn::ConnectionError::TimedOut => true,
        quinn::ConnectionError::ConnectionClosed(close) => {
            close.error_code == quinn::TransportErrorCode::APPLICATION_ERROR
        }
        _ => false,
    }
}

/// Sends one control message on its own uni-stream.
pub async fn send_control(conn: &Connection, bytes: &[u8]) -> Result<(), NetError> {
    send_prioritised(conn, bytes, CONTROL_PRIORITY).await
}

/// Sends a heartbeat (an encoded control message) ahead of every other control message queued on
/// the connection.
pub async fn send_heartbeat(conn: &Connection, bytes: &[u8]) -> Result<(), NetError> {
    send_prioritised(conn, bytes, HEARTBEAT_PRIORITY).await
}

async fn send_prioritised(conn: &Connection, bytes: &[u8], priority: i32) -> Result<(), NetError> {
    let mut send = conn.open_uni().await?;
    // Streams go one after another (see `QuicOptions::interleave_streams`): a control message
    // must not wait behind the bulk slices queued on the same connection.
    send.set_priority(priority)?;
    write_control(&mut send, bytes).await?;
    send.finish()?;
    Ok(())
}

/// The connections slices for one device go over, used in turn.
struct Route {
    conns: Vec<Connection>,
    next: AtomicUsize,
}

impl Route {
    fn pick(&self) -> Connection {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.conns.len();
        self.conns[i].clone()
    }
}

/// The runtime's transport over QUIC: a routing table from device to the connection(s) of the
/// process hosting it. `send` never blocks: the write runs as a task on `runtime`.
pub struct QuicTransport {
    runtime: tokio::runtime::Handle,
    routes: RwLock<HashMap<DeviceId, Arc<Route>>>,
    /// Devices of this process, reached without the network.
    local: Option<Arc<dyn Transport>>,
}

impl QuicTransport {
    pub fn new(
        runtime: tokio::runtime::Handle,
        local: Option<Arc<dyn Transport>>,
    ) -> QuicTransport {
        QuicTransport {
            runtime,
            routes: RwLock::new(HashMap::new()),
            local,
        }
    }

    /// Slices for `device` go over `conn` from now on.
    pub fn route(&self, device: DeviceId, conn: Connection) {
        self.route_many(device, vec![conn]);
    }

    /// Slices for `device` go over `conns` from now on, each slice on the next connection in turn
    /// (see [`QuicNode::connect_many`]). Every slice is a whole frame on its own stream, so the
    /// receiver needs no reassembly across connections; slices were never ordered anyway. An empty
    /// list removes the route.
    pub fn route_many(&self, device: DeviceId, conns: Vec<Connection>) {
        let mut routes = self.routes.write().unwrap_or_else(|e| e.into_inner());
        if conns.is_empty() {
            routes.remove(&device);
        } else {
            let next = AtomicUsize::new(0);
            routes.insert(device, Arc::new(Route { conns, next }));
        }
    }
}

impl Transport for QuicTransport {
    fn send(&self, msg: SliceMessage) {
        let conn = self
            .routes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&msg.to)
            .map(|route| route.pick());
        match (conn, &self.local) {
            (Some(conn), _) => {
                self.runtime.spawn(async move {
                    if let Err(e) = send_slice(&conn, &msg).await {
                        tracing::error!(
                            device = msg.to,
                            step = msg.step,
                            copy = msg.copy,
                            peer = %conn.remote_address(),
                            "slice not sent: {e}"
                        );
                    }
                });
            }
            (None, Some(local)) => local.send(msg),
            (None, None) => tracing::error!(device = msg.to, "no route to device; slice dropped"),
        }
    }
}

/// The largest UDP payload one `sendmsg` can carry, a GSO batch included: the 16-bit length of an
/// IPv4 packet less its IP and UDP headers.
const MAX_SENDMSG_PAYLOAD: usize = 65535 - 20 - 8;

/// quinn's UDP socket, except that a GSO batch larger than one `sendmsg` can carry is sent in
/// several calls.
///
/// quinn batches up to 10 datagrams of the current MTU into one GSO send. Once MTU discovery has
/// grown datagrams past 6.5 kB, as on jumbo-frame links and loopback, such a batch exceeds 64 KiB
/// and the kernel refuses it with EMSGSIZE, which quinn-udp swallows without a word because it
/// expects EMSGSIZE only from MTU probes (a probe is a single datagram, so it gets through and
/// raises the MTU). Every full batch is then lost until black-hole detection drops the MTU back
/// to 1200 bytes: a high `max_mtu` bought nothing. Splitting the batch makes large datagrams
/// usable.
#[derive(Debug)]
struct GsoSplitSocket {
    inner: Arc<dyn AsyncUdpSocket>,
}

impl AsyncUdpSocket for GsoSplitSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &Transmit) -> std::io::Result<()> {
        let segment = match transmit.segment_size {
            Some(segment) if transmit.contents.len() > MAX_SENDMSG_PAYLOAD => segment,
            _ => return self.inner.try_send(transmit),
        };
        let per_send = (MAX_SENDMSG_PAYLOAD / segment).max(1) * segment;
        // A WouldBlock after the first part makes quinn retry the whole batch later: the parts
        // already sent arrive twice and the receiver drops the duplicates, which is cheaper than
        // losing the rest (a congestion signal).
        for part in transmit.contents.chunks(per_send) {
            self.inner.try_send(&Transmit {
                contents: part,
                segment_size: (part.len() > segment).then_some(segment),
                ..transmit.clone()
            })?;
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<std::io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        // quinn runs MTU discovery only on sockets that never fragment.
        self.inner.may_fragment()
    }
}
