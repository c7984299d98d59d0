//! A TCP fault proxy between an adapter and its broker, switchable at run
//! time: the network faults a graceful broker restart never shows.
//!
//! ```text
//! adapter ──► 127.0.0.1:<proxy> ──(mode)──► broker
//! ```
//!
//! - [`Mode::Pass`]: bytes flow.
//! - [`Mode::Delay`]: every chunk waits first (a slow link).
//! - [`Mode::Throttle`]: at most so many bytes a second each way.
//! - [`Mode::BlackHole`]: connections stay open and nothing flows (a
//!   partition, a frozen peer); new connections are accepted and hang.
//! - [`Mode::Reset`]: every connection is reset (RST), new ones at once
//!   (a broker that is gone).
//! - [`Mode::CutAfter`]: each direction of every connection forwards so many
//!   more bytes, then the connection is reset (a link that dies mid-frame).
//!
//! Switching mode applies to open connections too. The proxy listens on
//! 127.0.0.1 only, and stops when dropped.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the proxy does to traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward everything.
    Pass,
    /// Hold every chunk this long before forwarding it.
    Delay(Duration),
    /// At most this many bytes a second, each direction of each connection.
    Throttle(u64),
    /// Keep every socket, forward nothing.
    BlackHole,
    /// Reset every connection.
    Reset,
    /// Forward this many more bytes per direction, then reset.
    CutAfter(usize),
}

/// A running proxy (stops when dropped).
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    mode: watch::Sender<Mode>,
    accept: JoinHandle<()>,
    accepted: Arc<AtomicUsize>,
}

impl FaultProxy {
    /// A proxy on a free loopback port in front of `upstream`.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<FaultProxy> {
        Self::start_on("127.0.0.1:0".parse().expect("a loopback address"), upstream).await
    }

    /// A proxy on `listen` (a port chosen before the broker was reachable,
    /// say) in front of `upstream`.
    pub async fn start_on(listen: SocketAddr, upstream: SocketAddr) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let (mode, watch) = watch::channel(Mode::Pass);
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = accepted.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(serve(client, upstream, watch.clone()));
            }
        });
        Ok(FaultProxy {
            addr,
            mode,
            accept,
            accepted,
        })
    }

    /// Where adapters connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `127.0.0.1:<port>` of [`FaultProxy::addr`].
    pub fn host_port(&self) -> String {
        self.addr.to_string()
    }

    /// Switches every connection, open or new, to `mode`.
    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    /// The mode in force.
    pub fn mode(&self) -> Mode {
        *self.mode.borrow()
    }

    /// Connections accepted so far (how often a client reconnected).
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::Relaxed)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        // Open connections notice the closed channel and end.
        self.mode.send_replace(Mode::Reset);
    }
}

/// A loopback port nothing listens on (bound, read, released): a broker
/// address that refuses connections until a proxy takes the port.
///
/// It is taken below the kernel's ephemeral range (32768 and up on Linux):
/// a port from that range can be given meanwhile to an outgoing connection
/// — another test's, or the daemon's own retries, which on Linux can
/// connect a socket to itself when its source port is the port it dials —
/// and the proxy then finds it in use.
pub fn unused_port() -> std::io::Result<SocketAddr> {
    const FIRST: u16 = 20_000;
    const COUNT: u16 = 12_000;
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
        ^ std::process::id().rotate_left(16);
    let start = (seed % u32::from(COUNT)) as u16;
    for i in 0..COUNT {
        let port = FIRST + (start + i) % COUNT;
        if let Ok(listener) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            return listener.local_addr();
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()
}

async fn serve(client: TcpStream, upstream: SocketAddr, mut mode: watch::Receiver<Mode>) {
    // A connection that arrives during a black hole hangs until the mode
    // changes; during a reset it is reset at once.
    loop {
        let now = *mode.borrow_and_update();
        match now {
            Mode::Reset => return reset(client),
            Mode::BlackHole => {
                if mode.changed().await.is_err() {
                    return reset(client);
                }
            }
            _ => break,
        }
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        return reset(client);
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let (done_tx, done_rx) = watch::channel(false);
    let up = tokio::spawn(pump(
        client_read,
        server_write,
        mode.clone(),
        done_rx.clone(),
    ));
    let down = tokio::spawn(pump(server_read, client_write, mode, done_rx));
    // Either direction ending (EOF or reset) ends both.
    let (up, down) = match futures::future::select(up, down).await {
        futures::future::Either::Left((up, down)) => {
            let _ = done_tx.send(true);
            (up, down.await)
        }
        futures::future::Either::Right((down, up)) => {
            let _ = done_tx.send(true);
            (up.await, down)
        }
    };
    // A fault resets both sockets; an EOF just drops them (FIN).
    if let (Ok(Some((client_read, server_write))), Ok(Some((server_read, client_write)))) =
        (up, down)
    {
        if let Ok(client) = client_read.reunite(client_write) {
            reset(client);
        }
        if let Ok(server) = server_read.reunite(server_write) {
            reset(server);
        }
    }
}

/// Copies one direction under the current mode. Returns the halves when
/// the connection must be reset (so the caller can send RST on them).
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut mode: watch::Receiver<Mode>,
    mut done: watch::Receiver<bool>,
) -> Option<(OwnedReadHalf, OwnedWriteHalf)> {
    let mut buf = vec![0u8; 16 * 1024];
    let mut budget: Option<usize> = None;
    loop {
        let current = *mode.borrow_and_update();
        match current {
            Mode::Reset => return Some((from, to)),
            Mode::BlackHole => {
                tokio::select! {
                    changed = mode.changed() => if changed.is_err() { return Some((from, to)) },
                    _ = done.wait_for(|d| *d) => return Some((from, to)),
                }
                continue;
            }
            Mode::CutAfter(n) => {
                if budget.is_none() {
                    budget = Some(n);
                }
            }
            _ => budget = None,
        }
        let read = tokio::select! {
            read = from.read(&mut buf) => read,
            changed = mode.changed() => {
                if changed.is_err() { return Some((from, to)); }
                continue;
            }
            _ = done.wait_for(|d| *d) => return Some((from, to)),
        };
        let n = match read {
            Ok(0) => {
                let _ = to.shutdown().await;
                return None;
            }
            Ok(n) => n,
            Err(_) => return Some((from, to)),
        };
        let mut chunk = &buf[..n];
        let now = *mode.borrow();
        match now {
            Mode::Delay(d) => tokio::time::sleep(d).await,
            Mode::Throttle(per_second) => {
                let secs = n as f64 / per_second.max(1) as f64;
                tokio::time::sleep(Duration::from_secs_f64(secs)).await;
            }
            _ => {}
        }
        if let Some(left) = budget.as_mut() {
            let pass = chunk.len().min(*left);
            *left -= pass;
            chunk = &chunk[..pass];
        }
        if to.write_all(chunk).await.is_err() {
            return Some((from, to));
        }
        if budget == Some(0) {
            return Some((from, to));
        }
    }
}

/// Closes with RST instead of FIN: the peer sees "connection reset".
fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn echo_server() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn roundtrip(addr: SocketAddr, wait: Duration) -> std::io::Result<Vec<u8>> {
        let mut s = TcpStream::connect(addr).await?;
        s.write_all(b"ping").await?;
        let mut got = vec![0u8; 4];
        tokio::time::timeout(wait, s.read_exact(&mut got))
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer"))??;
        Ok(got)
    }

    #[tokio::test]
    async fn modes_do_what_they_say() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        assert_eq!(
            roundtrip(proxy.addr(), Duration::from_secs(5))
                .await
                .unwrap(),
            b"ping"
        );

        proxy.set(Mode::BlackHole);
        let e = roundtrip(proxy.addr(), Duration::from_millis(300))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);

        proxy.set(Mode::Reset);
        assert!(roundtrip(proxy.addr(), Duration::from_secs(5))
            .await
            .is_err());

        proxy.set(Mode::Delay(Duration::from_millis(200)));
        let started = std::time::Instant::now();
        assert_eq!(
            roundtrip(proxy.addr(), Duration::from_secs(5))
                .await
                .unwrap(),
            b"ping"
        );
        assert!(
            started.elapsed() >= Duration::from_millis(400),
            "each way waited"
        );

        proxy.set(Mode::CutAfter(2));
        assert!(roundtrip(proxy.addr(), Duration::from_secs(5))
            .await
            .is_err());

        proxy.set(Mode::Pass);
        assert_eq!(
            roundtrip(proxy.addr(), Duration::from_secs(5))
                .await
                .unwrap(),
            b"ping"
        );
    }

    #[tokio::test]
    async fn an_open_connection_is_black_holed_and_released() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        s.write_all(b"one!").await.unwrap();
        let mut got = [0u8; 4];
        s.read_exact(&mut got).await.unwrap();
        proxy.set(Mode::BlackHole);
        s.write_all(b"two!").await.unwrap();
        let held = tokio::time::timeout(Duration::from_millis(300), s.read_exact(&mut got)).await;
        assert!(held.is_err(), "nothing flows in a black hole");
        proxy.set(Mode::Pass);
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut got))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&got, b"two!");
    }
}
