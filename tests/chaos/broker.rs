//! The suite's Kafka-protocol broker: librdkafka's mock cluster in this process, or a tansu
//! process of its own.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use obx::kafka::MockBroker;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;

pub enum Broker {
    Mock(MockBroker),
    /// tansu with in-memory storage: a restart would lose every topic, so the suite does
    /// not take it down.
    Tansu {
        child: Child,
        bootstrap: String,
    },
}

impl Broker {
    pub fn start(kind: &str) -> Result<Broker> {
        match kind {
            "mock" => Ok(Broker::Mock(MockBroker::start(1)?)),
            "tansu" => {
                let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
                let url = format!("tcp://127.0.0.1:{port}");
                let child = Command::new("tansu")
                    .args(["broker", "--storage-engine", "memory://tansu/"])
                    .args(["--listener-url", &url, "--advertised-listener-url", &url])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .context("starting tansu (installed by `cargo xtask test`)")?;
                let bootstrap = format!("127.0.0.1:{port}");
                wait_for_port(port)?;
                Ok(Broker::Tansu { child, bootstrap })
            }
            other => bail!("unknown broker {other:?}: mock or tansu"),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Broker::Mock(_) => "librdkafka's mock cluster",
            Broker::Tansu { .. } => "tansu 0.6 (memory storage)",
        }
    }

    pub fn bootstrap(&self) -> String {
        match self {
            Broker::Mock(m) => m.bootstrap(),
            Broker::Tansu { bootstrap, .. } => bootstrap.clone(),
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

    /// Takes the broker away for `length`, if this broker can come back with its data.
    pub async fn outage(&self, length: Duration) -> Result<bool> {
        let Broker::Mock(m) = self else {
            return Ok(false);
        };
        m.down(1)?;
        tokio::time::sleep(length).await;
        m.up(1)?;
        Ok(true)
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if let Broker::Tansu { child, .. } = self {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

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
