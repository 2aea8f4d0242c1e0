//! The suite's Kafka-protocol broker: librdkafka's mock cluster in this process, or a tansu
//! process of its own.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use obx::kafka::MockBroker;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;

pub enum Broker {
    Mock(MockBroker),
    Tansu(Tansu),
}

/// A tansu process. With SQLite storage (a tansu built with the `libsql` feature) it keeps
/// its topics, messages and offsets across a restart, so the suite can SIGKILL it and start
/// it again; with in-memory storage it would come back empty, so it is not taken down.
pub struct Tansu {
    binary: PathBuf,
    sqlite: bool,
    /// The working directory, where SQLite storage keeps its file.
    dir: tempfile::TempDir,
    port: u16,
    child: Option<Child>,
}

impl Tansu {
    fn spawn(&mut self) -> Result<()> {
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let storage = if self.sqlite {
            "sqlite://tansu.db"
        } else {
            "memory://tansu/"
        };
        let mut command = Command::new(&self.binary);
        command
            .current_dir(self.dir.path())
            .args(["broker", "--storage-engine", storage])
            .args(["--listener-url", &url, "--advertised-listener-url", &url]);
        // OBX_CHAOS_TANSU_LOG: tansu's RUST_LOG (e.g. "warn"; "info" slows tansu down several
        // times over); its output is then kept.
        match std::env::var("OBX_CHAOS_TANSU_LOG") {
            Ok(filter) => {
                let path = std::env::temp_dir().join(format!("obx-chaos-tansu-{}.log", self.port));
                let log = std::fs::OpenOptions::new().create(true).append(true).open(&path)?;
                println!("tansu's log: {}", path.display());
                command.env("RUST_LOG", filter).stdout(log.try_clone()?).stderr(log);
            }
            Err(_) => {
                command.stdout(Stdio::null()).stderr(Stdio::null());
            }
        }
        let child = command
            .spawn()
            .with_context(|| format!("starting {}", self.binary.display()))?;
        self.child = Some(child);
        wait_for_port(self.port)
    }

    /// Adds the index tansu 0.6's SQLite schema lacks: its `header` table has none, so each
    /// fetched record's headers are found by scanning every header of every record stored,
    /// and a fetch slows down as the topic grows (1.9 ms per record after a full run's load,
    /// 4.7 ms with a cold cache after a restart, which held the broker-restart recovery at
    /// 14 s). Run once, after tansu has created its tables; `OBX_CHAOS_TANSU_STOCK=1` skips
    /// it, to measure tansu as shipped. Python's sqlite3 module is the client: tansu holds the
    /// file, and SQLite's WAL lets a second connection write it.
    fn index_headers(&self) -> Result<()> {
        let db = self.dir.path().join("tansu.db");
        let status = Command::new("python3")
            .args(["-c", INDEX_HEADERS])
            .arg(&db)
            .status()
            .context("running python3 to index tansu's header table (OBX_CHAOS_TANSU_STOCK=1 skips it)")?;
        if !status.success() {
            bail!("indexing tansu's header table failed: {status}");
        }
        Ok(())
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill(); // SIGKILL
            let _ = child.wait();
        }
    }
}

impl Broker {
    /// `kind` is `mock` or `tansu`; `storage` (tansu only) `memory` or `sqlite`.
    pub fn start(kind: &str, binary: PathBuf, storage: &str) -> Result<Broker> {
        match kind {
            "mock" => Ok(Broker::Mock(MockBroker::start(1)?)),
            "tansu" => {
                let sqlite = match storage {
                    "memory" => false,
                    "sqlite" => true,
                    other => bail!("unknown tansu storage {other:?}: memory or sqlite"),
                };
                let mut tansu = Tansu {
                    binary,
                    sqlite,
                    dir: tempfile::tempdir()?,
                    port: std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port(),
                    child: None,
                };
                tansu.spawn()?;
                if sqlite && std::env::var_os("OBX_CHAOS_TANSU_STOCK").is_none() {
                    tansu.index_headers()?;
                }
                Ok(Broker::Tansu(tansu))
            }
            other => bail!("unknown broker {other:?}: mock or tansu"),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Broker::Mock(_) => "librdkafka's mock cluster",
            Broker::Tansu(t) if t.sqlite => "tansu 0.6 (SQLite storage)",
            Broker::Tansu(_) => "tansu 0.6 (memory storage)",
        }
    }

    pub fn bootstrap(&self) -> String {
        match self {
            Broker::Mock(m) => m.bootstrap(),
            Broker::Tansu(t) => format!("127.0.0.1:{}", t.port),
        }
    }

    pub async fn create_topic(&self, topic: &str, partitions: i32) -> Result<()> {
        if let Broker::Mock(m) = self {
            return m.create_topic(topic, partitions);
        }
        let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .create()?;
        let topic = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
        for result in admin.create_topics([&topic], &AdminOptions::new()).await? {
            result.map_err(|(t, e)| anyhow::anyhow!("creating {t}: {e}"))?;
        }
        Ok(())
    }

    /// What [`Broker::outage`] does to this broker, for the report; `None` if it cannot.
    pub fn outage_name(&self) -> Option<&'static str> {
        match self {
            Broker::Mock(_) => Some("broker down 8 s"),
            Broker::Tansu(t) if t.sqlite => Some("broker process SIGKILLed, restarted 8 s later"),
            Broker::Tansu(_) => None,
        }
    }

    /// Takes the broker away for `length` and brings it back, if it can come back with its
    /// data. Returns when it accepts connections again.
    pub async fn outage(&mut self, length: Duration) -> Result<bool> {
        match self {
            Broker::Mock(m) => {
                m.down(1)?;
                tokio::time::sleep(length).await;
                m.up(1)?;
            }
            Broker::Tansu(t) if t.sqlite => {
                t.kill();
                tokio::time::sleep(length).await;
                tokio::task::block_in_place(|| t.spawn())?;
            }
            Broker::Tansu(_) => return Ok(false),
        }
        Ok(true)
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if let Broker::Tansu(t) = self {
            t.kill();
        }
    }
}

/// Creates tansu's missing header index, waiting up to 10 s for tansu to create the table.
const INDEX_HEADERS: &str = r#"
import sqlite3, sys, time
for attempt in range(100):
    try:
        db = sqlite3.connect(sys.argv[1], timeout=30)
        db.execute('CREATE INDEX IF NOT EXISTS obx_header_record ON header (topition, offset_id)')
        db.commit()
        break
    except sqlite3.OperationalError as e:
        if 'no such table' not in str(e):
            raise
        time.sleep(0.1)
else:
    sys.exit('tansu did not create its header table within 10 s')
"#;

fn wait_for_port(port: u16) -> Result<()> {
    let started = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if started.elapsed() > Duration::from_secs(30) {
            bail!("tansu is not listening on port {port} after 30 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}
