//! The bound on what the server may send a plugin session in answer to one request.
//!
//! sqlx reads each message of the server's whole before it hands any of it on: a plugin
//! statement that returns one value of a gigabyte (`SELECT repeat('x', 1e9)`, or an error
//! that quotes such a value) made the host hold a gigabyte for that session, and a plugin
//! with many sessions could take the host's memory. The host counts what a query returns
//! only as rows arrive, too late for that. Nothing in Postgres bounds the size of a value
//! or of a message.
//!
//! So plugin sessions reach the server through this guard, in the host's process: sqlx
//! connects to a Unix socket in a directory only the host's user can enter, and the guard
//! relays each connection to the server the way the database URL says (TCP or a Unix
//! socket). It counts the bytes the server sends after each of the session's sends, and
//! ends the connection, on both sides, past `limit`: sqlx's read fails there, holding at most
//! twice `limit` (it copies what it reads once). The bytes pass through as they are, so TLS
//! is negotiated between sqlx and the server as before, and the count holds whether or not
//! they are encrypted. It costs each round trip a hop: two reads, two writes and a wake-up.
//!
//! Invariant: with `database.guard_plugin_sessions` on, every plugin session's connection
//! passes through a guard whose limit is at least what the host itself reads in one answer on
//! such a session (`Config::plugin_answer_bytes`).

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixListener, UnixStream};

/// Where the server is, as the database URL says.
#[derive(Clone, Debug)]
pub enum Upstream {
    Tcp { host: String, port: u16 },
    Unix(PathBuf),
}

impl Upstream {
    /// Where `options` reach the server: its Unix socket if they name a directory, as libpq
    /// and sqlx take a host that starts with `/`, otherwise TCP.
    pub fn of(options: &sqlx::postgres::PgConnectOptions) -> Upstream {
        let socket = |dir: &Path| Upstream::Unix(dir.join(format!(".s.PGSQL.{}", options.get_port())));
        match options.get_socket() {
            Some(dir) => socket(dir),
            None if options.get_host().starts_with('/') => socket(Path::new(options.get_host())),
            None => Upstream::Tcp {
                host: options.get_host().to_string(),
                port: options.get_port(),
            },
        }
    }
}

/// A guard's listening socket, and what it counts. Dropping it stops accepting new
/// connections; the ones relayed already run until either side ends them.
pub struct Guard {
    dir: tempfile::TempDir,
    accepting: tokio::task::JoinHandle<()>,
    cuts: Arc<Cuts>,
}

/// The connections a guard ended for sending too much.
pub struct Cuts {
    limit: usize,
    count: AtomicU64,
    /// When the last one was ended, in nanoseconds after `epoch` (0: none yet).
    last: AtomicU64,
    epoch: Instant,
}

impl Cuts {
    fn record(&self) {
        let at = self.epoch.elapsed().as_nanos().max(1) as u64;
        self.last.store(at, Ordering::Release);
        self.count.fetch_add(1, Ordering::AcqRel);
    }

    /// Whether a connection was ended at `since` or later.
    pub fn since(&self, since: Instant) -> bool {
        let last = self.last.load(Ordering::Acquire);
        last != 0 && since.saturating_duration_since(self.epoch).as_nanos() as u64 <= last
    }

    /// How many connections were ended.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Acquire)
    }

    /// The most a connection may be sent in answer to one request.
    pub fn limit(&self) -> usize {
        self.limit
    }
}

/// How long a relayed connection waits for the server to accept it.
const CONNECT_WITHIN: Duration = Duration::from_secs(30);

/// The buffer of each direction of a relayed connection.
const BUFFER: usize = 64 * 1024;

impl Guard {
    /// Listens, in a new directory of the system's temporary one that only this user may
    /// enter, for connections to relay to `upstream`, each sent at most `limit` bytes by the
    /// server per send of its own. sqlx reaches it with
    /// `PgConnectOptions::socket(guard.socket_dir())` and the same `port`.
    pub fn open(upstream: Upstream, port: u16, limit: usize, plugin: Arc<str>) -> io::Result<Guard> {
        use std::os::unix::fs::PermissionsExt;
        // No other user of the machine may connect through it.
        let dir = tempfile::Builder::new()
            .prefix("obx-guard-")
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir()?;
        let listener = UnixListener::bind(dir.path().join(format!(".s.PGSQL.{port}")))?;
        let cuts = Arc::new(Cuts {
            limit,
            count: AtomicU64::new(0),
            last: AtomicU64::new(0),
            epoch: Instant::now(),
        });
        let accepting = tokio::spawn(accept(listener, upstream, cuts.clone(), plugin));
        Ok(Guard { dir, accepting, cuts })
    }

    /// The directory sqlx connects in.
    pub fn socket_dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn cuts(&self) -> &Arc<Cuts> {
        &self.cuts
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

async fn accept(listener: UnixListener, upstream: Upstream, cuts: Arc<Cuts>, plugin: Arc<str>) {
    loop {
        let client = match listener.accept().await {
            Ok((client, _)) => client,
            Err(e) => {
                // Out of descriptors, say: sqlx's connect fails, and the call with it.
                tracing::warn!(plugin = %plugin, error = %e, "a plugin session could not be accepted");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (upstream, cuts, plugin) = (upstream.clone(), cuts.clone(), plugin.clone());
        tokio::spawn(async move {
            if let Err(e) = relay(client, &upstream, &cuts, &plugin).await {
                tracing::debug!(plugin = %plugin, error = %e, "a plugin session's connection failed");
            }
        });
    }
}

/// Relays `client` to the server until either side ends, or the server sends more than
/// `limit` bytes after one of the client's sends.
async fn relay(client: UnixStream, upstream: &Upstream, cuts: &Cuts, plugin: &str) -> io::Result<()> {
    match upstream {
        Upstream::Tcp { host, port } => {
            // sqlx gives up on its side after `database.acquire_timeout`; this ends the
            // relay's wait for a server that does not answer.
            let server = tokio::time::timeout(CONNECT_WITHIN, TcpStream::connect((host.as_str(), *port)))
                .await
                .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connecting to the server timed out"))??;
            server.set_nodelay(true)?;
            let (read, write) = server.into_split();
            both_ways(client, read, write, cuts, plugin).await
        }
        Upstream::Unix(path) => {
            let server = UnixStream::connect(path).await?;
            let (read, write) = server.into_split();
            both_ways(client, read, write, cuts, plugin).await
        }
    }
}

async fn both_ways(
    client: UnixStream,
    mut server_read: impl AsyncRead + Unpin,
    mut server_write: impl AsyncWrite + Unpin,
    cuts: &Cuts,
    plugin: &str,
) -> io::Result<()> {
    let (mut client_read, mut client_write) = client.into_split();
    // What the server sent since the client last sent.
    let answered = AtomicUsize::new(0);
    let up = async {
        let mut buf = vec![0u8; BUFFER];
        loop {
            let n = client_read.read(&mut buf).await?;
            if n == 0 {
                return io::Result::Ok(());
            }
            answered.store(0, Ordering::Relaxed);
            server_write.write_all(&buf[..n]).await?;
        }
    };
    let down = async {
        let mut buf = vec![0u8; BUFFER];
        loop {
            let n = server_read.read(&mut buf).await?;
            if n == 0 {
                return io::Result::Ok(());
            }
            if answered.fetch_add(n, Ordering::Relaxed) + n > cuts.limit {
                cuts.record();
                metrics::counter!("obx_plugin_sessions_cut_total", "plugin" => plugin.to_string()).increment(1);
                tracing::warn!(
                    plugin,
                    limit = cuts.limit,
                    "the server sent a plugin session more than the limit in answer to one request: \
                     the session was ended"
                );
                return Ok(());
            }
            client_write.write_all(&buf[..n]).await?;
        }
    };
    tokio::select! {
        r = up => r,
        r = down => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// A server that answers each request of 4 bytes, `n` big-endian, with `n` bytes.
    async fn server() -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut n = [0u8; 4];
                    while s.read_exact(&mut n).await.is_ok() {
                        let answer = vec![b'x'; u32::from_be_bytes(n) as usize];
                        if s.write_all(&answer).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Upstream::Tcp {
            host: "127.0.0.1".into(),
            port,
        }
    }

    /// Asks for `n` bytes through the guard; what came back before the answer ended.
    async fn ask(client: &mut UnixStream, n: u32) -> usize {
        if client.write_all(&n.to_be_bytes()).await.is_err() {
            return 0;
        }
        let mut got = 0;
        let mut buf = vec![0u8; 1 << 16];
        while got < n as usize {
            match client.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(k) => got += k,
            }
        }
        got
    }

    #[tokio::test]
    async fn answers_up_to_the_limit_pass_and_a_longer_one_ends_the_connection() {
        const LIMIT: usize = 1 << 20;
        let guard = Guard::open(server().await, 5432, LIMIT, "p".into()).unwrap();
        let path = guard.socket_dir().join(".s.PGSQL.5432");
        let mut client = UnixStream::connect(&path).await.unwrap();
        // Each send starts a new count: two answers of three quarters of the limit pass.
        for _ in 0..2 {
            assert_eq!(ask(&mut client, (LIMIT * 3 / 4) as u32).await, LIMIT * 3 / 4);
        }
        assert_eq!(ask(&mut client, LIMIT as u32).await, LIMIT);
        assert_eq!(guard.cuts().count(), 0);
        let before = Instant::now();
        let got = ask(&mut client, 64 << 20).await;
        assert!(got <= LIMIT, "{got} bytes passed");
        assert_eq!(guard.cuts().count(), 1);
        assert!(guard.cuts().since(before));
        assert!(!guard.cuts().since(Instant::now()));
        // The connection is ended on the client's side too.
        assert_eq!(ask(&mut client, 1).await, 0);
        // Other connections go on.
        let mut other = UnixStream::connect(&path).await.unwrap();
        assert_eq!(ask(&mut other, 10).await, 10);
    }

    #[tokio::test]
    async fn only_its_own_user_may_reach_the_socket() {
        use std::os::unix::fs::PermissionsExt;
        let guard = Guard::open(server().await, 5432, 1024, "p".into()).unwrap();
        let mode = std::fs::metadata(guard.socket_dir()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        let dir = guard.socket_dir().to_path_buf();
        drop(guard);
        assert!(!dir.exists());
    }
}
