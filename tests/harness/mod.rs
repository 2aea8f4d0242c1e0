//! The one place that knows how to start what the system tests need: a Postgres server,
//! a database per test, the plugin components, and hosts that serve them.
//!
//! * Postgres: `OBX_TEST_DATABASE_URL` (an admin URL to an existing server) if set,
//!   otherwise one throwaway cluster per test process, started from the system's binaries.
//!   Every test gets a database of its own, owned by [`HOST_USER`]: hosts run as a user
//!   with `CREATEROLE` and no superuser rights, as in production.
//! * Plugins: built by `cargo xtask test` into `plugins/target/wasm32-wasip2/release/`
//!   (or `OBX_TEST_PLUGINS_DIR`).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use obx::config::{Config, Secret};
use obx::db::embedded::EmbeddedPostgres;
use serde_json::Value;
use sqlx::PgPool;

/// The database user test hosts run as: `CREATEROLE`, no superuser rights, and the owner of
/// each test's database.
pub const HOST_USER: &str = "obx_test_host";
/// [`HOST_USER`]'s password.
pub const HOST_PASSWORD: &str = "obx-test-host-password";

/// A Postgres server for this test process.
struct Server {
    admin_url: String,
    /// `host:port`, to build per-test URLs.
    address: String,
    _embedded: Option<EmbeddedPostgres>,
}

fn server() -> &'static Server {
    static SERVER: OnceLock<Server> = OnceLock::new();
    SERVER.get_or_init(|| {
        let (admin_url, embedded) = match std::env::var("OBX_TEST_DATABASE_URL") {
            Ok(url) => (url, None),
            Err(_) => {
                let pg = EmbeddedPostgres::start(&[]).expect("starting a throwaway Postgres for the tests");
                (pg.url("postgres"), Some(pg))
            }
        };
        let address = admin_url
            .rsplit_once('@')
            .and_then(|(_, rest)| rest.split('/').next())
            .expect("an admin URL of the form postgres://user:password@host:port/db")
            .to_string();
        Server {
            admin_url,
            address,
            _embedded: embedded,
        }
    })
}

/// A superuser's URL of the test server, for tests that set things up as an administrator.
pub fn admin_url() -> String {
    server().admin_url.clone()
}

/// Creates an empty database for one test, owned by [`HOST_USER`], and returns its URL as
/// that user.
pub async fn fresh_database() -> String {
    use sqlx::Connection;
    static HOST_USER_READY: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    let server = server();
    let name = format!("obx_test_{}", uuid::Uuid::new_v4().simple());
    let mut admin = sqlx::PgConnection::connect(&server.admin_url)
        .await
        .expect("connecting to the test server");
    HOST_USER_READY
        .get_or_init(|| async {
            let mut admin = sqlx::PgConnection::connect(&server.admin_url).await.expect("admin");
            obx::db::embedded::create_host_user(&mut admin, HOST_USER, HOST_PASSWORD)
                .await
                .expect("creating the test host's user");
        })
        .await;
    obx::db::embedded::create_database(&mut admin, &name, HOST_USER)
        .await
        .expect("CREATE DATABASE");
    let _ = admin.close().await;
    database_url(&name)
}

/// The URL of database `name` on the test server, as [`HOST_USER`].
pub fn database_url(name: &str) -> String {
    format!("postgres://{HOST_USER}:{HOST_PASSWORD}@{}/{name}", server().address)
}

/// The compiled component of example or test plugin `name`.
pub fn plugin(name: &str) -> PathBuf {
    let dir = std::env::var_os("OBX_TEST_PLUGINS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugins/target/wasm32-wasip2/release"));
    let path = dir.join(format!("{}.wasm", name.replace('-', "_")));
    assert!(
        path.exists(),
        "{} is missing: the test plugins are built by `cargo xtask test` \
         (or `cargo build --release --target wasm32-wasip2` in plugins/)",
        path.display()
    );
    path
}

/// Configuration for a test host: loopback on a free port, short deadlines.
pub fn test_config(database_url: &str, plugin_dir: &Path) -> Config {
    let mut config = Config::default();
    config.http.listen = "127.0.0.1:0".parse().unwrap();
    config.database.url = Some(Secret::new(database_url));
    config.database.max_connections = 20;
    config.plugins.dir = plugin_dir.to_path_buf();
    config.limits.call_deadline = Duration::from_millis(1500);
    config.limits.memory_bytes = 64 * 1024 * 1024;
    config.kafka.brokers = std::env::var("KAFKA_BROKERS").unwrap_or_default();
    if !config.kafka.brokers.is_empty() {
        // A shared external broker: each test's hosts get topics of their own.
        let db = database_url.rsplit('/').next().unwrap_or("db");
        config.kafka.topic_prefix = format!("{}.", &db[db.len().saturating_sub(8)..]);
    }
    config.relay.poll_interval = Duration::from_millis(200);
    config.relay.backoff_max = Duration::from_secs(1);
    // Hosts on one database are one service: they share consumer groups.
    let db = database_url.rsplit('/').next().unwrap_or("db");
    config.service.name = format!("test-{db}");
    config.consumer.backoff_initial = Duration::from_millis(20);
    config.consumer.backoff_max = Duration::from_millis(200);
    config.consumer.inbox_poll_interval = Duration::from_millis(100);
    config
}

/// A producer for a test's own messages (as another service would send them).
pub fn producer(bootstrap: &str) -> rdkafka::producer::FutureProducer {
    rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("message.timeout.ms", "10000")
        .create()
        .expect("test producer")
}

/// Sends one raw message and waits for its acknowledgement.
pub async fn send_raw(
    producer: &rdkafka::producer::FutureProducer,
    topic: &str,
    key: Option<&[u8]>,
    value: Option<&[u8]>,
    headers: &[(&str, &[u8])],
) {
    use rdkafka::message::{Header, OwnedHeaders};
    let mut h = OwnedHeaders::new();
    for (k, v) in headers {
        h = h.insert(Header {
            key: k,
            value: Some(*v),
        });
    }
    let mut record: rdkafka::producer::FutureRecord<'_, [u8], [u8]> =
        rdkafka::producer::FutureRecord::to(topic).headers(h);
    if let Some(k) = key {
        record = record.key(k);
    }
    if let Some(v) = value {
        record = record.payload(v);
    }
    producer
        .send(record, Duration::from_secs(10))
        .await
        .map_err(|(e, _)| e)
        .expect("sending a test message");
}

/// `headers` with one more header, whose name may be any bytes (rdkafka's `Header` takes a
/// `&str`): as a producer that treats header names as bytes sends it.
pub fn with_raw_header(
    headers: rdkafka::message::OwnedHeaders,
    name: &[u8],
    value: &[u8],
) -> rdkafka::message::OwnedHeaders {
    // `as_borrowed` is the native list itself, seen through a zero-sized type.
    let native =
        headers.as_borrowed() as *const rdkafka::message::BorrowedHeaders as *mut rdkafka::bindings::rd_kafka_headers_t;
    // SAFETY: the list is alive; librdkafka copies the name and the value.
    let err = unsafe {
        rdkafka::bindings::rd_kafka_header_add(
            native,
            name.as_ptr().cast(),
            name.len() as isize,
            value.as_ptr().cast(),
            value.len() as isize,
        )
    };
    assert_eq!(err, rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR);
    headers
}

/// Sends an event the way a service following the seed does: `eventId` and `eventType`
/// headers, a JSON value. Returns its event id.
pub async fn send_event(
    producer: &rdkafka::producer::FutureProducer,
    topic: &str,
    key: &str,
    event_type: &str,
    payload: &Value,
) -> uuid::Uuid {
    let id = uuid::Uuid::new_v4();
    send_event_with_id(producer, topic, key, event_type, payload, id).await;
    id
}

pub async fn send_event_with_id(
    producer: &rdkafka::producer::FutureProducer,
    topic: &str,
    key: &str,
    event_type: &str,
    payload: &Value,
    id: uuid::Uuid,
) {
    let id = id.to_string();
    let value = payload.to_string();
    send_raw(
        producer,
        topic,
        Some(key.as_bytes()),
        Some(value.as_bytes()),
        &[("eventId", id.as_bytes()), ("eventType", event_type.as_bytes())],
    )
    .await;
}

/// A Kafka-protocol broker for a test: the one in `KAFKA_BROKERS` if set, otherwise a fresh
/// librdkafka mock cluster (real wire protocol, in memory).
pub struct TestBroker {
    pub bootstrap: String,
    pub mock: Option<obx::kafka::MockBroker>,
}

pub fn broker() -> TestBroker {
    match std::env::var("KAFKA_BROKERS") {
        Ok(b) if !b.trim().is_empty() => TestBroker {
            bootstrap: b,
            mock: None,
        },
        _ => {
            let mock = obx::kafka::MockBroker::start(1).expect("starting a mock Kafka cluster");
            TestBroker {
                bootstrap: mock.bootstrap(),
                mock: Some(mock),
            }
        }
    }
}

impl TestBroker {
    /// Creates a topic, as a host that consumes it would: a broker outside the process does
    /// not create one when a producer first writes to it.
    pub async fn create_topic(&self, topic: &str) {
        self.create_topic_with(topic, if self.mock.is_some() { 4 } else { -1 })
            .await
    }

    /// Creates a topic of `partitions` partitions (`-1`: the broker's default).
    pub async fn create_topic_with(&self, topic: &str, partitions: i32) {
        if let Some(mock) = &self.mock {
            mock.create_topic(topic, partitions).expect("creating a topic");
            return;
        }
        let kafka = obx::config::KafkaConfig {
            brokers: self.bootstrap.clone(),
            topic_partitions: partitions,
            ..Default::default()
        };
        let brokers = obx::kafka::Brokers::start(&kafka).expect("a client of the brokers");
        obx::kafka::ensure_topics(&brokers, &kafka, &[topic.to_string()]).await;
    }

    /// Points a host at this broker.
    pub fn configure(&self, config: &mut Config) {
        config.kafka.brokers = self.bootstrap.clone();
        if self.mock.is_some() {
            // The mock cluster creates topics on first use, and does not serve CreateTopics.
            config.kafka.create_topics = false;
        }
    }
}

/// A message as a test reads it back from a topic.
#[derive(Debug, Clone)]
pub struct Received {
    pub key: Option<String>,
    pub payload: String,
    pub headers: std::collections::BTreeMap<String, String>,
    pub partition: i32,
    pub offset: i64,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.payload).unwrap_or(Value::Null)
    }
}

/// Reads `topic` from the beginning of every partition until `count` messages have arrived
/// or `timeout` has passed, and returns them in arrival order.
pub async fn consume(bootstrap: &str, topic: &str, count: usize, timeout: Duration) -> Vec<Received> {
    use rdkafka::consumer::{Consumer, StreamConsumer};
    use rdkafka::message::{Headers, Message};
    use rdkafka::{ClientConfig, Offset, TopicPartitionList};

    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("obx-test-{}", uuid::Uuid::new_v4()))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .expect("test consumer");
    let deadline = tokio::time::Instant::now() + timeout;
    // Wait for the topic to exist, then read all of its partitions from the start.
    let partitions = loop {
        let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(2));
        if let Ok(m) = metadata {
            if let Some(t) = m.topics().iter().find(|t| t.name() == topic && t.error().is_none()) {
                if !t.partitions().is_empty() {
                    break t.partitions().iter().map(|p| p.id()).collect::<Vec<_>>();
                }
            }
        }
        if tokio::time::Instant::now() > deadline {
            return Vec::new();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut assignment = TopicPartitionList::new();
    for p in partitions {
        assignment.add_partition_offset(topic, p, Offset::Beginning).unwrap();
    }
    consumer.assign(&assignment).unwrap();
    let mut out = Vec::new();
    while out.len() < count {
        let Ok(next) = tokio::time::timeout_at(deadline, consumer.recv()).await else {
            break;
        };
        let m = next.expect("consuming");
        let headers = m
            .headers()
            .map(|h| {
                h.iter()
                    .filter_map(|h| Some((h.key.to_string(), String::from_utf8(h.value?.to_vec()).ok()?)))
                    .collect()
            })
            .unwrap_or_default();
        out.push(Received {
            key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
            payload: m
                .payload()
                .map(|p| String::from_utf8_lossy(p).into_owned())
                .unwrap_or_default(),
            headers,
            partition: m.partition(),
            offset: m.offset(),
        });
    }
    out
}

/// The value of one series of this process's metrics, written as the exposition format
/// writes it (`name{label="…"}`, or `name` alone); 0 while it has not been recorded.
pub fn metric_value(series: &str) -> f64 {
    let needle = format!("{series} ");
    obx::telemetry::metrics()
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(&needle))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Waits until `check` holds, polling, or panics after `timeout`.
pub async fn eventually<F, Fut>(timeout: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Resets this process's peak resident memory (`VmHWM`) to what it holds now.
pub fn reset_peak_rss() {
    std::fs::write("/proc/self/clear_refs", "5").expect("resetting the peak RSS");
}

/// This process's peak resident memory since the last [`reset_peak_rss`], in bytes.
pub fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmHWM");
    kib * 1024
}

/// A host serving some plugins, on its own database.
pub struct TestHost {
    pub host: obx::app::Host,
    pub url: String,
    /// The URL of the host's database.
    pub database_url: String,
    /// Prepended to topic names on the broker (see `kafka.topic_prefix`).
    pub topic_prefix: String,
    /// A pool on the host's database, for the tests' own checks (as the host's user).
    pub db: PgPool,
    pub plugin_dir: tempfile::TempDir,
    client: reqwest::Client,
}

/// Starts a host on a fresh database with the given plugins in its plugin directory.
pub async fn spawn_host(plugins: &[&str]) -> TestHost {
    spawn_host_with(plugins, |_| {}).await
}

/// Like [`spawn_host`], with a chance to adjust the configuration.
pub async fn spawn_host_with(plugins: &[&str], adjust: impl FnOnce(&mut Config)) -> TestHost {
    let database_url = fresh_database().await;
    spawn_host_on(&database_url, plugins, adjust).await
}

/// Starts another host on an existing database: several hosts of one service.
pub async fn spawn_host_on(database_url: &str, plugins: &[&str], adjust: impl FnOnce(&mut Config)) -> TestHost {
    init_logging();
    let database_url = database_url.to_string();
    let plugin_dir = tempfile::tempdir().unwrap();
    for name in plugins {
        let src = plugin(name);
        std::fs::copy(&src, plugin_dir.path().join(src.file_name().unwrap())).unwrap();
    }
    let mut config = test_config(&database_url, plugin_dir.path());
    adjust(&mut config);
    let topic_prefix = config.kafka.topic_prefix.clone();
    let host = obx::app::start(config).await.expect("starting the host");
    let db = PgPool::connect(&database_url).await.unwrap();
    TestHost {
        url: host.url(),
        host,
        database_url,
        topic_prefix,
        db,
        plugin_dir,
        client: reqwest::Client::new(),
    }
}

/// An HTTP answer: status, headers and JSON body (`Value::Null` when the body is not JSON).
pub struct Answer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Value,
    pub text: String,
}

impl Answer {
    /// The stable error code of an error answer.
    pub fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or("")
    }
}

impl TestHost {
    /// The name on the broker of topic `logical`.
    pub fn topic(&self, logical: &str) -> String {
        format!("{}{logical}", self.topic_prefix)
    }

    /// `POST /v1/commands/{plugin}/{command}` with a JSON body.
    pub async fn command(&self, plugin: &str, command: &str, body: Value) -> Answer {
        self.request(
            plugin,
            command,
            body.to_string().into_bytes(),
            &[("content-type", "application/json")],
        )
        .await
    }

    /// Like [`TestHost::command`], with an `Idempotency-Key`.
    pub async fn command_with_key(&self, plugin: &str, command: &str, body: Value, key: &str) -> Answer {
        self.request(
            plugin,
            command,
            body.to_string().into_bytes(),
            &[("content-type", "application/json"), ("idempotency-key", key)],
        )
        .await
    }

    /// A raw command request, for malformed bodies and headers.
    pub async fn request(&self, plugin: &str, command: &str, body: Vec<u8>, headers: &[(&str, &str)]) -> Answer {
        let mut req = self
            .client
            .post(format!("{}/v1/commands/{plugin}/{command}", self.url))
            .body(body);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        into_answer(req.send().await.expect("request")).await
    }

    /// `POST {path}` with a JSON body (the admin API).
    pub async fn post_json(&self, path: &str, body: Value) -> Answer {
        into_answer(
            self.client
                .post(format!("{}{path}", self.url))
                .json(&body)
                .send()
                .await
                .expect("request"),
        )
        .await
    }

    pub async fn get(&self, path: &str) -> Answer {
        into_answer(
            self.client
                .get(format!("{}{path}", self.url))
                .send()
                .await
                .expect("request"),
        )
        .await
    }

    /// The most outbox rows of `topic` one transaction wrote (rows keep the id of the
    /// transaction that wrote them until the relay marks them: for hosts with the relay off).
    pub async fn largest_outbox_batch(&self, topic: &str) -> i64 {
        sqlx::query_scalar(
            "SELECT max(n) FROM (SELECT count(*) AS n FROM obx.outbox_event WHERE topic = $1 \
             GROUP BY xmin::text) batches",
        )
        .bind(topic)
        .fetch_one(&self.db)
        .await
        .unwrap()
    }

    /// A single number from the host's database.
    pub async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&self.db)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Sets plugin `name`'s emit limits in its registry row (`set`: e.g.
    /// `max_emits_per_call = 4`), as another host with other `limits` writes them when it
    /// loads the plugin: the database holds this host's emits to them.
    pub async fn limits_recorded_by_another_host(&self, name: &str, set: &str) {
        let updated = sqlx::query(&format!("UPDATE obx.plugin SET {set} WHERE name = $1"))
            .bind(name)
            .execute(&self.db)
            .await
            .unwrap_or_else(|e| panic!("{set}: {e}"))
            .rows_affected();
        assert_eq!(updated, 1, "plugin {name} is registered");
    }

    /// Transactions committed in this host's database so far, as `pg_stat_database` counts
    /// them, read after 1.5 s: backends report their counts when idle, at most once a second.
    pub async fn commits_so_far(&self) -> i64 {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        self.count("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
            .await
    }

    /// Makes, in the testbed plugin's schema, the table `deferred_raise` whose deferred
    /// trigger raises an error of its own (P0001) at the commit of any transaction that
    /// inserted into it. Done on the plugin's session, as a plugin that got past the SQL
    /// policy would: migrations may not create functions, and the database lets the role.
    pub async fn make_deferred_raise(&self) {
        self.make_deferred("RAISE EXCEPTION 'the testbed refuses % at commit', NEW.id;")
            .await
    }

    /// As [`TestHost::make_deferred_raise`], with a trigger that holds the commit `seconds`
    /// instead of refusing it: plugin code at the commit that runs on.
    pub async fn make_deferred_sleep(&self, seconds: f64) {
        self.make_deferred(&format!("PERFORM pg_sleep({seconds}); RETURN NULL;"))
            .await
    }

    /// As [`TestHost::make_deferred_raise`], with a trigger that locks the row of [`Gate`]:
    /// while a test holds the gate, such a commit waits for it until `limits.lock_timeout`.
    pub async fn make_deferred_gate(&self) {
        self.make_deferred("PERFORM n FROM testbed.counters WHERE name = 'gate' FOR UPDATE; RETURN NULL;")
            .await
    }

    /// The table `deferred_raise` with a deferred trigger running `body` at the commit.
    async fn make_deferred(&self, body: &str) {
        let mut session = self.plugin_session("testbed").await;
        sqlx::raw_sql(&format!(
            "CREATE TABLE deferred_raise (id text); \
             CREATE FUNCTION deferred_raise() RETURNS trigger LANGUAGE plpgsql AS \
               $$ BEGIN {body} END $$; \
             CREATE CONSTRAINT TRIGGER deferred_raise AFTER INSERT ON deferred_raise \
               DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION deferred_raise()"
        ))
        .execute(&mut session)
        .await
        .unwrap();
    }

    /// How many sessions of this host's database wait for a lock now.
    pub async fn lock_waits(&self) -> i64 {
        self.count(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .await
    }

    /// How many transactions of plugin `name` wait for a lock over `during`, from the first
    /// one seen (within 30 s): a handler's tries at a lock held meanwhile, each of which waits
    /// for it until `limits.lock_timeout`. Sampled every 10 ms, so each wait must last longer.
    pub async fn tries_at_a_lock(&self, name: &str, during: Duration) -> usize {
        let role = self.plugin_role(name).await;
        let waiting = || async {
            sqlx::query_scalar::<_, String>(
                "SELECT pid::text || ' ' || xact_start::text FROM pg_stat_activity \
                 WHERE usename = $1 AND wait_event_type = 'Lock'",
            )
            .bind(&role)
            .fetch_all(&self.db)
            .await
            .unwrap()
        };
        let mut seen = std::collections::HashSet::new();
        let first_by = tokio::time::Instant::now() + Duration::from_secs(30);
        while seen.is_empty() {
            assert!(
                tokio::time::Instant::now() < first_by,
                "no handler of {name} waits for a lock"
            );
            seen.extend(waiting().await);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let end = tokio::time::Instant::now() + during;
        while tokio::time::Instant::now() < end {
            seen.extend(waiting().await);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        seen.len()
    }

    /// The database role of plugin `name`.
    pub async fn plugin_role(&self, name: &str) -> String {
        sqlx::query_scalar("SELECT role_name FROM obx.plugin WHERE name = $1")
            .bind(name)
            .fetch_one(&self.db)
            .await
            .unwrap_or_else(|e| panic!("no role for plugin {name}: {e}"))
    }

    /// A database session logged in as plugin `name`'s role, the way the host opens them:
    /// what a plugin could do with any SQL at all, had it got past the SQL policy.
    pub async fn plugin_session(&self, name: &str) -> sqlx::PgConnection {
        use sqlx::{ConnectOptions, Row};
        let row = sqlx::query(
            "SELECT c.role_name, c.password FROM obx.plugin p \
             JOIN obx.plugin_credential c ON c.role_name = p.role_name WHERE p.name = $1",
        )
        .bind(name)
        .fetch_one(&self.db)
        .await
        .unwrap();
        let options: sqlx::postgres::PgConnectOptions = self.database_url.parse().unwrap();
        options
            .username(row.get("role_name"))
            .password(row.get("password"))
            .connect()
            .await
            .expect("logging in as the plugin's role")
    }

    /// Stops the host, within a minute: a session of the test's still holding a lock the
    /// host's tasks wait on (they have no lock timeout) fails the test instead of hanging it.
    pub async fn shutdown(self) {
        let stop = async {
            self.db.close().await;
            self.host.shutdown().await.unwrap();
        };
        tokio::time::timeout(Duration::from_secs(60), stop)
            .await
            .expect("the host did not shut down within a minute (a connection of the test's still out?)");
    }
}

async fn into_answer(r: reqwest::Response) -> Answer {
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let text = r.text().await.unwrap_or_default();
    let body = serde_json::from_str(&text).unwrap_or(Value::Null);
    Answer {
        status,
        headers,
        body,
        text,
    }
}

/// Logs to the test output, filtered by `RUST_LOG` (default: warnings).
pub fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

/// Runs `tests/interop/{script}` under node with its own kafkajs (`cargo xtask test` runs
/// `npm ci` there), as a service that follows the seed would, and panics with its stderr if
/// it fails. kafkajs's idempotent mode needs InitProducerId, which neither broker available
/// here (librdkafka's mock, tansu on memory) serves to it, so it is off.
pub async fn run_kafkajs(script: &str, args: &[&str]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("interop").join(script);
    assert!(
        script.with_file_name("node_modules").exists(),
        "kafkajs is not installed: `cargo xtask test` runs `npm ci` in tests/interop"
    );
    let out = tokio::process::Command::new("node")
        .env("KAFKAJS_NO_PARTITIONER_WARNING", "1")
        .env("IDEMPOTENT", "0")
        .arg(&script)
        .args(args)
        .output()
        .await
        .expect("running node");
    assert!(
        out.status.success(),
        "kafkajs failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The partition Kafka's Java client (and kafkajs, and librdkafka's `murmur2_random`) gives
/// `key` among `partitions`: its murmur2 hash, made positive, modulo the count.
pub fn murmur2_partition(key: &[u8], partitions: u32) -> u32 {
    (murmur2(key) as u32 & 0x7fff_ffff) % partitions
}

/// Murmur2 as Kafka's Java client computes it (`org.apache.kafka.common.utils.Utils`):
/// seed 0x9747b28c, little-endian words, the tail bytes last.
pub fn murmur2(data: &[u8]) -> i32 {
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let mut h: u32 = 0x9747_b28c ^ data.len() as u32;
    let mut words = data.chunks_exact(4);
    for w in &mut words {
        let mut k = u32::from_le_bytes([w[0], w[1], w[2], w[3]]).wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M) ^ k;
    }
    let tail = words.remainder();
    if !tail.is_empty() {
        for (i, b) in tail.iter().enumerate().rev() {
            h ^= (*b as u32) << (8 * i);
        }
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// A session that holds the row lock of the testbed's counter `gate`: testbed handlers given
/// `"gate": true` (events, timers) and statements that update the counter wait for it, without
/// burning CPU, until [`Gate::release`].
pub struct Gate(sqlx::PgConnection);

impl Gate {
    /// Creates the counter if need be, and takes its lock, on the database at `database_url`.
    pub async fn hold(database_url: &str) -> Gate {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(database_url).await.unwrap();
        for statement in [
            "INSERT INTO testbed.counters (name, n) VALUES ('gate', 0) ON CONFLICT DO NOTHING",
            "BEGIN",
            "SELECT n FROM testbed.counters WHERE name = 'gate' FOR UPDATE",
        ] {
            sqlx::query(statement).execute(&mut conn).await.unwrap();
        }
        Gate(conn)
    }

    /// Lets the waiting handlers go.
    pub async fn release(mut self) {
        sqlx::query("COMMIT").execute(&mut self.0).await.unwrap();
    }
}

#[cfg(test)]
mod tests {
    /// The values Kafka's own tests (`UtilsTest.testMurmur2`) and kafkajs's murmur2 give.
    #[test]
    fn murmur2_agrees_with_kafkas_java_client() {
        for (key, hash) in [
            ("21", -973932308),
            ("foobar", -790332482),
            ("a-little-bit-long-string", -985981536),
            ("a-little-bit-longer-string", -1486304829),
            ("lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
            ("abc", 479470107),
        ] {
            assert_eq!(super::murmur2(key.as_bytes()), hash, "{key}");
        }
    }
}
