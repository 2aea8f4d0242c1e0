//! Configuration: built-in defaults, then an optional TOML file, then environment
//! variables (`OBX_SECTION__KEY`, plus the conventional `DATABASE_URL`).
//!
//! Every key has a default, so `obx serve` runs with no file at all. [`Config::validate`]
//! refuses values that make no sense, naming the key. Secrets are held in [`Secret`], whose
//! `Debug` and `Display` never show the value.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub service: ServiceConfig,
    pub http: HttpConfig,
    pub database: DatabaseConfig,
    pub plugins: PluginsConfig,
    pub limits: Limits,
    pub kafka: KafkaConfig,
    pub relay: RelayConfig,
    pub consumer: ConsumerConfig,
    pub retention: RetentionConfig,
    pub telemetry: TelemetryConfig,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServiceConfig {
    /// The service this host belongs to. Consumer groups are `<name>.<plugin>`, so two
    /// services must not share a name on one Kafka cluster.
    pub name: String,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        ServiceConfig { name: "obx".into() }
    }
}

/// Event consumption: the Kafka consumers of the plugins' subscriptions, and the inbox
/// processors.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConsumerConfig {
    pub enabled: bool,
    /// Attempts of a failing handler before its event is parked in the dead-letter table.
    pub max_attempts: u32,
    #[serde(with = "humantime_serde")]
    pub backoff_initial: Duration,
    /// The longest wait between attempts, and between the tries of a handler that keeps
    /// losing to concurrent work (which wait a quarter of the time since the first such
    /// failure, from the backoff up to this).
    #[serde(with = "humantime_serde")]
    pub backoff_max: Duration,
    /// How long an event or a timer whose handler keeps losing to concurrent work (a lock
    /// wait past `limits.lock_timeout`, a deadlock) is tried again without those failures
    /// counting as attempts, from the first of them: a reload's migration or a long
    /// transaction then holds its key up, not parks it. Past it, they count, so that a lock
    /// nobody releases ends in a dead letter rather than a key (in dedup mode, a partition)
    /// held for ever. 0 counts them all.
    #[serde(with = "humantime_serde")]
    pub contention_grace: Duration,
    /// Larger messages are quarantined.
    pub max_message_bytes: usize,
    /// Partitions a plugin's consumer works on at once (each partition stays in order).
    pub lanes: u32,
    /// The most events a lane takes from its queue at once (whatever it has queued, up to
    /// this: a batch never waits to fill): in dedup mode they run in one transaction, a
    /// savepoint each; in inbox mode they are stored with one statement. Inbox processors
    /// handle up to this many events (a key's next ones) in one transaction too. 1 turns
    /// batching off. Postgres keeps 64
    /// subtransactions per transaction in shared memory, and more slow down every
    /// session's snapshots, so the limit is 64.
    pub batch_max_events: u32,
    /// The most message bytes a lane takes from its queue at once, and the most timer
    /// payload bytes a timer batch takes.
    pub batch_max_bytes: usize,
    /// Inbox processors per host.
    pub inbox_processors: u32,
    /// Fallback poll of the inbox processors.
    #[serde(with = "humantime_serde")]
    pub inbox_poll_interval: Duration,
    /// librdkafka `auto.commit.interval.ms`: how often stored offsets are committed.
    pub auto_commit_interval_ms: u32,
    /// Who decides which host consumes which partition. `leases` (the default): the hosts
    /// lease partitions from each other in Postgres, which notices a killed host at once
    /// (its sessions end with its process), so its partitions move within about a second;
    /// offsets are still committed to the group on the broker. `group`: the broker's group
    /// coordinator (Kafka's `subscribe`), which notices a dead member only after
    /// `session_timeout`. The settings below, up to `instance_id`, apply to `group` only.
    /// The hosts of a service must agree: change it with all of them stopped.
    pub assignment: Assignment,
    /// How long the group waits for a silent member (a killed host) before its partitions
    /// go to the others: Kafka's `session.timeout.ms`. Brokers refuse values below their
    /// `group.min.session.timeout.ms` (6 s unless changed).
    #[serde(with = "humantime_serde")]
    pub session_timeout: Duration,
    /// How often a member tells the group it is alive, and so how soon it hears of a
    /// rebalance: Kafka's `heartbeat.interval.ms`. Below a third of `session_timeout`.
    #[serde(with = "humantime_serde")]
    pub heartbeat_interval: Duration,
    /// How partitions are spread over the group's members: `cooperative-sticky` (members keep
    /// their partitions while the group rebalances; only moved partitions pause), `range` or
    /// `roundrobin` (every member stops for every rebalance). The hosts of a service must
    /// agree: change it with all of them stopped.
    pub assignor: String,
    /// This host's identity in its groups (Kafka's static membership, `group.instance.id`):
    /// a host that restarts under the same id within `session_timeout` takes back its
    /// partitions without a rebalance. Unique per host of a service, stable across its
    /// restarts (a pod name of a StatefulSet); a host that stops for good holds its
    /// partitions until `session_timeout` ends. Unset: dynamic membership.
    pub instance_id: Option<String>,
    /// A consumer that holds partitions the broker has newer messages for, and has received
    /// or finished none for this long, leaves its group and joins it again (a broker that
    /// lost track of the group, a fetcher that stopped). 0 turns the check off.
    #[serde(with = "humantime_serde")]
    pub stuck_after: Duration,
}

/// See [`ConsumerConfig::assignment`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Assignment {
    Leases,
    Group,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        ConsumerConfig {
            enabled: true,
            max_attempts: 5,
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            contention_grace: Duration::from_secs(600),
            max_message_bytes: 1024 * 1024,
            lanes: 8,
            batch_max_events: 32,
            batch_max_bytes: 1024 * 1024,
            inbox_processors: 4,
            inbox_poll_interval: Duration::from_millis(500),
            auto_commit_interval_ms: 1000,
            assignment: Assignment::Leases,
            session_timeout: Duration::from_secs(6),
            heartbeat_interval: Duration::from_millis(500),
            assignor: "cooperative-sticky".into(),
            instance_id: None,
            stuck_after: Duration::from_secs(15),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// Where the command and admin API listens. Loopback by default; anywhere else,
    /// `http.auth` must hold tokens for both scopes.
    pub listen: SocketAddr,
    /// The largest request body accepted, in bytes.
    pub max_body_bytes: usize,
    /// The most bytes of request bodies all connections may hold at once, each request
    /// counted by what it has sent, in whole KiB, as it arrives. A request whose body does
    /// not fit is answered 503 `busy` (`api/bodies.rs`). At least `http.max_body_bytes`.
    pub max_body_bytes_in_flight: usize,
    /// Requests that take longer, from their head's arrival, are answered 408 if their body
    /// had not all arrived, 503 otherwise.
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// The most HTTP connections open at once; past that the server stops accepting until
    /// one closes. Keeps peers from taking the descriptors the host needs.
    pub max_connections: usize,
    /// A connection that has not sent a request's whole head within this long is closed: a
    /// slow sender, or a keep-alive connection idle that long.
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// A connection whose peer takes no byte of an answer for this long is closed: a peer
    /// that sends requests and never reads the answers would hold its place for ever.
    #[serde(with = "humantime_serde")]
    pub write_timeout: Duration,
    /// How long a graceful shutdown (SIGTERM or SIGINT) may take: in-flight commands (for
    /// half of it at most; those still running then are cut and rolled back, or, if their
    /// `COMMIT` had been sent, may have taken effect) and events, the relay's last batch. A
    /// second signal stops at once.
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: Duration,
    pub auth: AuthConfig,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            max_body_bytes: 1024 * 1024,
            max_body_bytes_in_flight: 64 * 1024 * 1024,
            request_timeout: Duration::from_secs(30),
            max_connections: 1024,
            header_read_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
            shutdown_timeout: Duration::from_secs(30),
            auth: AuthConfig::default(),
        }
    }
}

/// Bearer tokens, by scope. With no tokens at all (allowed on loopback only) the API is open.
/// Each value may be given as is, or as `file:/path` or `env:NAME`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// Tokens that may run commands (`POST /v1/commands/...`).
    pub command_tokens: Vec<Secret>,
    /// Tokens that may use every admin endpoint: read the status, plugins, metrics, dead
    /// letters, quarantine, timers and catalog, and act: retry or discard a dead letter,
    /// cancel or retry timers, replay the outbox.
    pub admin_tokens: Vec<Secret>,
    /// Tokens that may only read what admin tokens read (`GET` only): for monitoring, such
    /// as a Prometheus scrape of `/metrics`, whose configuration is widely readable.
    pub read_tokens: Vec<Secret>,
}

impl AuthConfig {
    pub fn enabled(&self) -> bool {
        !self.command_tokens.is_empty() || !self.admin_tokens.is_empty() || !self.read_tokens.is_empty()
    }

    /// Every token with the key of its list.
    fn all(&self) -> impl Iterator<Item = (&'static str, &Secret)> {
        [
            ("http.auth.command_tokens", &self.command_tokens),
            ("http.auth.admin_tokens", &self.admin_tokens),
            ("http.auth.read_tokens", &self.read_tokens),
        ]
        .into_iter()
        .flat_map(|(key, tokens)| tokens.iter().map(move |t| (key, t)))
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DatabaseConfig {
    /// `postgres://user:password@host:port/db?sslmode=...`. When absent, `obx serve` starts a
    /// throwaway Postgres from the system's binaries (for trying OBX out, not for production).
    #[serde(serialize_with = "show_database_url")]
    pub url: Option<Secret>,
    pub max_connections: u32,
    /// Connections each plugin's own pool may open (its sessions log in as the plugin's
    /// role); opened on demand and closed after a minute idle. This also caps how many calls
    /// of one plugin run at once, so a slow plugin cannot take every connection.
    pub plugin_max_connections: u32,
    /// Sessions a plugin's role may have open at once, across all hosts: its Postgres
    /// `CONNECTION LIMIT`, which the plugin cannot change. At least `plugin_max_connections`
    /// times the number of hosts.
    pub plugin_role_connections: u32,
    /// How long a call waits for a free connection before it is refused with 503.
    #[serde(with = "humantime_serde")]
    pub acquire_timeout: Duration,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        DatabaseConfig {
            url: None,
            max_connections: 16,
            plugin_max_connections: 8,
            plugin_role_connections: 64,
            acquire_timeout: Duration::from_secs(5),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PluginsConfig {
    /// The directory of plugin components (`*.wasm`), loaded at start.
    pub dir: PathBuf,
    /// Watch the directory: load new files, reload replaced ones, unload deleted ones.
    pub watch: bool,
    /// How long a file must stay unchanged before it is loaded.
    #[serde(with = "humantime_serde")]
    pub debounce: Duration,
    /// How often the watcher compares the directory with what is loaded, for events the
    /// watch lost (a replaced directory, an overflowed queue), and tries again the files
    /// whose load failed for a reason that may pass (the database was away, or busy with
    /// another host's migration).
    #[serde(with = "humantime_serde")]
    pub rescan_interval: Duration,
    /// Keep compiled components in a cache the host owns, so restarts skip compilation.
    pub cache: bool,
    /// Where the compile cache lives; default `$XDG_CACHE_HOME/obx/components` or
    /// `~/.cache/obx/components`. Never the plugin directory.
    pub cache_dir: Option<PathBuf>,
    /// The most the compile cache may hold; the least recently used entries go first.
    pub cache_max_bytes: u64,
}

impl Default for PluginsConfig {
    fn default() -> Self {
        PluginsConfig {
            dir: PathBuf::from("plugins.d"),
            watch: true,
            debounce: Duration::from_millis(250),
            rescan_interval: Duration::from_secs(30),
            cache: true,
            cache_dir: None,
            cache_max_bytes: 1 << 30,
        }
    }
}

/// `path` with links and `..` resolved as far as it exists (a cache directory may not exist
/// yet), and the rest as written, its `..` taken lexically.
fn resolved(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    if let Ok(real) = absolute.canonicalize() {
        return real;
    }
    let mut lexical = PathBuf::new();
    for part in absolute.components() {
        match part {
            std::path::Component::ParentDir => {
                lexical.pop();
            }
            std::path::Component::CurDir => {}
            other => lexical.push(other),
        }
    }
    let absolute = lexical;
    let mut existing = absolute.as_path();
    let mut rest = Vec::new();
    loop {
        if let Ok(real) = existing.canonicalize() {
            return rest.iter().rev().fold(real, |p, part| p.join(part));
        }
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                existing = parent;
            }
            _ => return absolute,
        }
    }
}

impl PluginsConfig {
    /// The compile cache directory, if caching is on.
    pub fn cache_dir(&self) -> Option<PathBuf> {
        if !self.cache {
            return None;
        }
        self.cache_dir.clone().or_else(default_cache_dir)
    }
}

/// Where the compile cache lives unless `plugins.cache_dir` says: `$XDG_CACHE_HOME/obx/components`,
/// or `~/.cache/obx/components`.
fn default_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("obx").join("components"))
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KafkaConfig {
    /// Bootstrap servers, `host:port,host:port`. Empty: an in-process mock cluster (for trying
    /// OBX out and for tests; its messages are lost at exit).
    pub brokers: String,
    pub client_id: String,
    /// Brokers in the embedded mock cluster.
    pub embedded_brokers: u32,
    /// Prepended to every topic name on the brokers (e.g. `staging.`), so that several
    /// environments can share one Kafka cluster. Plugins and the outbox use the names without it.
    pub topic_prefix: String,
    /// Create missing topics (those plugins subscribe to, and those the relay publishes to),
    /// where the brokers allow it. Off: topics must be provisioned beforehand.
    pub create_topics: bool,
    /// Partitions of the topics OBX creates (`-1`: the brokers' default).
    pub topic_partitions: i32,
    /// How the relay maps a partition key to a partition (librdkafka's `partitioner`).
    /// `murmur2_random`, the default, is the hash of Kafka's Java client, kafkajs and the
    /// other clients that follow it: a key goes to the same partition whichever of them sends
    /// it. `consistent_random` is librdkafka's own default (CRC-32), what OBX used before.
    pub partitioner: Partitioner,
    /// CloudEvents binary mode for some topics: see [`CloudEventsConfig`].
    pub cloudevents: CloudEventsConfig,
    /// Extra librdkafka properties, e.g. `"security.protocol" = "SASL_SSL"`. They override
    /// OBX's own settings, except those the delivery guarantees rest on, which are refused
    /// (see `reserved_kafka_property`). Values are kept as secrets: `obx config check --print` shows
    /// only those whose names say nothing of passwords, keys, secrets or tokens.
    #[serde(serialize_with = "show_kafka_properties")]
    pub properties: BTreeMap<String, Secret>,
}

impl Default for KafkaConfig {
    fn default() -> Self {
        KafkaConfig {
            brokers: String::new(),
            client_id: "obx".into(),
            embedded_brokers: 1,
            topic_prefix: String::new(),
            create_topics: true,
            topic_partitions: -1,
            partitioner: Partitioner::Murmur2Random,
            cloudevents: CloudEventsConfig::default(),
            properties: BTreeMap::new(),
        }
    }
}

/// CloudEvents 1.0 in Kafka's binary mode: the messages of `topics` carry `ce_specversion`,
/// `ce_id` (the event id), `ce_type`, `ce_source`, `ce_subject` (the aggregate id),
/// `ce_time` and `content-type` next to the seed's headers, so that Knative, Dapr, Event
/// Grid and other CloudEvents readers take them as they are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CloudEventsConfig {
    /// Topics, as plugins name them (without `topic_prefix`); `"*"`: every topic.
    pub topics: Vec<String>,
    /// The start of each event's `ce_source`, which goes on with `/` and the emitting
    /// plugin's name: `/obx/orders` by default.
    pub source: String,
}

impl Default for CloudEventsConfig {
    fn default() -> Self {
        CloudEventsConfig {
            topics: Vec::new(),
            source: "/obx".into(),
        }
    }
}

impl CloudEventsConfig {
    /// Whether the messages of `topic` (without the prefix) carry CloudEvents headers.
    pub fn covers(&self, topic: &str) -> bool {
        self.topics.iter().any(|t| t == "*" || t == topic)
    }
}

/// See [`KafkaConfig::partitioner`]: librdkafka's partitioners, by their names there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Partitioner {
    /// Java-compatible murmur2 (keyless messages at random; OBX's always have keys).
    Murmur2Random,
    /// Java-compatible murmur2, keyless messages to one partition.
    Murmur2,
    /// CRC-32 of the key (librdkafka's default).
    ConsistentRandom,
    Consistent,
    Fnv1aRandom,
    Fnv1a,
    Random,
}

impl Partitioner {
    /// The value of librdkafka's `partitioner` property.
    pub fn librdkafka_name(self) -> &'static str {
        match self {
            Partitioner::Murmur2Random => "murmur2_random",
            Partitioner::Murmur2 => "murmur2",
            Partitioner::ConsistentRandom => "consistent_random",
            Partitioner::Consistent => "consistent",
            Partitioner::Fnv1aRandom => "fnv1a_random",
            Partitioner::Fnv1a => "fnv1a",
            Partitioner::Random => "random",
        }
    }
}

/// librdkafka's default `message.max.bytes`.
pub const DEFAULT_MESSAGE_MAX_BYTES: usize = 1_000_000;

/// Room a message needs besides its payload: the key and each header are at most 1 KiB
/// (see `outbox::RawEvent::validate`), plus the record's framing.
pub const MESSAGE_OVERHEAD_BYTES: usize = 8 * 1024;

impl KafkaConfig {
    /// The user's librdkafka properties that a client applies: all but those OBX keeps to
    /// itself (see `reserved_kafka_name`), which may only repeat OBX's values and, under
    /// another of their names (`delivery.timeout.ms`, `topic.message.timeout.ms`), could win
    /// over the value a client sets (replay's finite `message.timeout.ms`).
    pub fn user_properties(&self) -> impl Iterator<Item = (&str, &str)> {
        self.properties
            .iter()
            .filter(|(name, _)| reserved_kafka_name(name).is_none())
            .map(|(name, value)| (name.as_str(), value.expose()))
    }

    /// The largest message the producer will send: `message.max.bytes` from the properties,
    /// or librdkafka's default.
    pub fn producer_max_message_bytes(&self) -> usize {
        self.properties
            .get("message.max.bytes")
            .and_then(|v| v.expose().trim().parse().ok())
            .unwrap_or(DEFAULT_MESSAGE_MAX_BYTES)
    }
}

/// The outbox relay: publishes committed outbox rows to Kafka.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RelayConfig {
    pub enabled: bool,
    /// Rows claimed per transaction.
    pub batch_size: u32,
    /// Bytes claimed per transaction, of payloads, keys and header fields (a claim keeps at
    /// least one row): with rows of up to `limits.max_payload_bytes`, `batch_size` alone
    /// would let one claim, and the producer's queue after it, hold about a gigabyte.
    pub batch_max_bytes: usize,
    /// The fallback poll; commits on this host, and NOTIFY from other hosts, wake the relay
    /// at once.
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// How long one claim waits for the broker's acknowledgements before it commits what was
    /// acknowledged; the rest stays in flight and is collected by later claims.
    #[serde(with = "humantime_serde")]
    pub ack_timeout: Duration,
    /// A producer whose oldest message has waited this long for its acknowledgement while
    /// the broker answers it is replaced by a new one, which sends the unacknowledged rows
    /// again in order.
    #[serde(with = "humantime_serde")]
    pub stall_timeout: Duration,
    /// First delay after a failed delivery; it doubles with each attempt up to `backoff_max`.
    #[serde(with = "humantime_serde")]
    pub backoff_initial: Duration,
    #[serde(with = "humantime_serde")]
    pub backoff_max: Duration,
    /// librdkafka `linger.ms`: how long the producer waits to fill a batch.
    pub linger_ms: u32,
    /// The shortest time between two claims: under a steady stream of commits, events gather
    /// for up to this long and go out together.
    #[serde(with = "humantime_serde")]
    pub min_step_interval: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            enabled: true,
            batch_size: 1000,
            batch_max_bytes: 16 * 1024 * 1024,
            poll_interval: Duration::from_secs(1),
            ack_timeout: Duration::from_secs(5),
            stall_timeout: Duration::from_secs(5),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(30),
            linger_ms: 1,
            min_step_interval: Duration::from_millis(5),
        }
    }
}

/// Deletes old rows: published outbox rows, the dedup window of `processed_event`, processed
/// inbox rows, stored idempotency answers. Unpublished and unprocessed rows are never deleted.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetentionConfig {
    /// Published outbox rows older than this are deleted.
    #[serde(with = "humantime_serde")]
    pub outbox_after: Duration,
    /// The dedup window: `processed_event` rows older than this are deleted. An event
    /// redelivered after it would run again, so keep it longer than any redelivery.
    #[serde(with = "humantime_serde")]
    pub processed_after: Duration,
    /// Processed inbox rows older than this are deleted.
    #[serde(with = "humantime_serde")]
    pub inbox_after: Duration,
    /// Stored `Idempotency-Key` answers older than this are deleted.
    #[serde(with = "humantime_serde")]
    pub idempotency_after: Duration,
    /// How often the job runs.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Rows deleted per statement, so that no deletion holds locks for long.
    pub batch_size: u32,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        RetentionConfig {
            outbox_after: Duration::from_secs(7 * 24 * 3600),
            processed_after: Duration::from_secs(14 * 24 * 3600),
            inbox_after: Duration::from_secs(7 * 24 * 3600),
            idempotency_after: Duration::from_secs(24 * 3600),
            interval: Duration::from_secs(600),
            batch_size: 5000,
        }
    }
}

/// Traces: where the host's spans are exported, over OTLP/HTTP. Off unless an endpoint is
/// set, here or in the standard `OTEL_EXPORTER_OTLP_ENDPOINT` /
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (which take precedence). The other standard
/// `OTEL_*` variables apply too: `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
/// `OTEL_TRACES_SAMPLER`, `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_PROTOCOL`
/// (`http/protobuf` or `http/json`), `OTEL_BSP_*`, and `OTEL_SDK_DISABLED`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// The collector's OTLP/HTTP address, such as `http://otel-collector:4318`; spans go to
    /// its `/v1/traces`.
    pub otlp_endpoint: Option<String>,
}

/// Limits that bound what one plugin call can cost. Each is documented in the plugin
/// author's guide; exceeding one fails the call and rolls its transaction back.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Wall-clock budget of one handler call, Wasm and SQL together, from when the call gets
    /// one of `max_concurrent_calls` slots. A guest that is still running when it passes is
    /// interrupted. A call waits at most this long for a slot; one that gets none is refused
    /// as busy (503 for a command; an event or a timer is tried again, its attempt not
    /// counted).
    #[serde(with = "humantime_serde")]
    pub call_deadline: Duration,
    /// Linear memory a plugin instance may grow to, in bytes.
    pub memory_bytes: u64,
    /// The largest component file that is compiled, in bytes.
    pub max_component_bytes: u64,
    /// How long compiling one component may take.
    #[serde(with = "humantime_serde")]
    pub compile_timeout: Duration,
    /// Compiles that may run at once (each uses every CPU; memory is what this bounds). A
    /// compile past `compile_timeout` cannot be stopped and keeps its slot until it ends.
    pub max_concurrent_compiles: u32,
    /// Events one call may emit.
    pub max_emits_per_call: u32,
    /// The largest event payload, and the largest command response, in bytes.
    pub max_payload_bytes: usize,
    /// The payload bytes of all the events one call may emit.
    pub max_emit_bytes_per_call: usize,
    /// Rows one query may return to a plugin.
    pub max_rows: u32,
    /// Bytes of column data one query may return to a plugin, counted as rows arrive.
    pub max_result_bytes: usize,
    /// The longest SQL statement a plugin may send, in bytes (a migration: each statement).
    pub max_statement_bytes: usize,
    /// Postgres `work_mem` of plugin sessions, in bytes.
    pub work_mem_bytes: u64,
    /// Postgres `temp_file_limit` of plugin sessions, in bytes. Setting it needs
    /// `GRANT SET ON PARAMETER temp_file_limit TO <host user>` (see docs/operations.md).
    pub temp_file_bytes: u64,
    /// Postgres `statement_timeout` for plugin statements.
    #[serde(with = "humantime_serde")]
    pub statement_timeout: Duration,
    /// Postgres `lock_timeout` for plugin statements.
    #[serde(with = "humantime_serde")]
    pub lock_timeout: Duration,
    /// Calls that run at once across all plugins; the rest wait for a slot.
    pub max_concurrent_calls: u32,
    /// Relations (tables, partitions, indexes, sequences, views, and their TOAST tables) a
    /// plugin's migrations may leave its role owning. A statement on a table takes a lock on
    /// each of its indexes, inheritance children and TOAST relations, in a lock table the whole
    /// server shares (docs/operations.md).
    pub max_relations: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            call_deadline: Duration::from_secs(5),
            memory_bytes: 128 * 1024 * 1024,
            max_component_bytes: 128 * 1024 * 1024,
            compile_timeout: Duration::from_secs(120),
            max_concurrent_compiles: 2,
            max_emits_per_call: 1000,
            // Fits librdkafka's default message.max.bytes (1,000,000) with the key and headers.
            max_payload_bytes: 960 * 1024,
            max_emit_bytes_per_call: 16 * 1024 * 1024,
            max_rows: 10_000,
            max_result_bytes: 16 * 1024 * 1024,
            max_statement_bytes: 64 * 1024,
            work_mem_bytes: 4 * 1024 * 1024,
            temp_file_bytes: 1024 * 1024 * 1024,
            statement_timeout: Duration::from_secs(2),
            lock_timeout: Duration::from_secs(1),
            max_concurrent_calls: 256,
            max_relations: 500,
        }
    }
}

/// A configuration value that must never be shown: `Debug`, `Display` and `Serialize` all
/// give `[redacted]`. In a file or a variable it may be the value itself, `file:/path` (the
/// file's contents, trimmed) or `env:NAME` (another variable's value).
#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }
    /// The value itself. Call it only where the value is handed to the client library.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Replaces a `file:` or `env:` reference by what it refers to.
    fn resolve(&mut self, key: &str) -> Result<(), ConfigError> {
        let invalid = |reason: String| ConfigError::Invalid {
            key: key.to_string(),
            reason,
        };
        if let Some(path) = self.0.strip_prefix("file:") {
            let value = std::fs::read_to_string(path).map_err(|e| invalid(format!("cannot read {path}: {e}")))?;
            self.0 = value.trim_end_matches(['\n', '\r']).to_string();
        } else if let Some(name) = self.0.strip_prefix("env:") {
            self.0 = std::env::var(name).map_err(|_| invalid(format!("the variable {name} is not set")))?;
        }
        Ok(())
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str("[redacted]")
    }
}

/// The database URL with its password replaced, for `obx config check --print`.
fn show_database_url<S: serde::Serializer>(url: &Option<Secret>, serializer: S) -> Result<S::Ok, S::Error> {
    match url.as_ref().map(|u| url::Url::parse(u.expose())) {
        None => serializer.serialize_none(),
        Some(Ok(mut parsed)) => {
            if parsed.password().is_some() {
                let _ = parsed.set_password(Some("REDACTED"));
            }
            // Query parameters may carry a password too (`?password=`).
            if parsed.query_pairs().any(|(k, _)| k.contains("password")) {
                parsed.set_query(Some("REDACTED"));
            }
            serializer.serialize_some(parsed.as_str())
        }
        Some(Err(_)) => serializer.serialize_some("[redacted]"),
    }
}

/// A librdkafka property OBX keeps to itself: why, and the values that only repeat what OBX
/// uses anyway (none: refused whatever its value). The delivery guarantees rest on these,
/// and `kafka.properties` would override them for the relay's producer and the consumers
/// alike. librdkafka's aliases are matched too, and its `topic.` prefix for topic settings;
/// names are case-sensitive there.
fn reserved_kafka_name(name: &str) -> Option<(&'static str, &'static [&'static str])> {
    let name = name.strip_prefix("topic.").unwrap_or(name);
    Some(match name {
        "enable.idempotence" => (ORDER, &["true"]),
        "max.in.flight.requests.per.connection" | "max.in.flight" => (ORDER, &[]),
        "queuing.strategy" => (ORDER, &["fifo"]),
        "retries" | "message.send.max.retries" => (ORDER, &["2147483647"]),
        "enable.gapless.guarantee" => ("the relay handles a failed send itself, in its key's order", &["false"]),
        "acks" | "request.required.acks" => (
            "an event is marked published when the broker acknowledges it, and with fewer \
             acknowledgements than acks=all a broker's failure loses marked events",
            &["all", "-1"],
        ),
        "message.timeout.ms" | "delivery.timeout.ms" => (
            "the relay's messages never expire, which keeps a key's order through an outage",
            &["0"],
        ),
        "partitioner" => ("set kafka.partitioner, which every host of the service must share", &[]),
        "enable.auto.offset.store" => (OFFSETS, &["false"]),
        "enable.auto.commit" | "auto.commit.enable" => (OFFSETS, &["true"]),
        "auto.offset.reset" => (
            "a new consumer group starts at the earliest events, so that none is skipped",
            &["earliest", "smallest", "beginning"],
        ),
        "group.id" | "group.instance.id" => (
            "each plugin's consumer group is named by OBX (consumer.instance_id sets the \
             static member id)",
            &[],
        ),
        _ => return None,
    })
}

/// Why a `kafka.properties` entry is refused, if it is: a reserved property set to anything
/// but what OBX uses anyway (compared without case).
fn reserved_kafka_property(name: &str, value: &str) -> Option<&'static str> {
    let (reason, ours) = reserved_kafka_name(name)?;
    let value = value.trim().to_ascii_lowercase();
    (!ours.contains(&value.as_str())).then_some(reason)
}

/// Why the relay's producer settings are reserved.
const ORDER: &str = "a retried batch could land after a later one, out of its key's order";
/// Why the consumers' offset settings are reserved.
const OFFSETS: &str = "a consumer stores an offset only once its event's transaction has committed, and \
                       commits the stored ones itself; otherwise a crash could skip events";

/// Kafka properties, with the values of those that may be credentials redacted.
fn show_kafka_properties<S: serde::Serializer>(
    properties: &BTreeMap<String, Secret>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut map = serializer.serialize_map(Some(properties.len()))?;
    for (name, value) in properties {
        let sensitive = ["password", "secret", "key", "jaas", "token", "credential"]
            .iter()
            .any(|word| name.contains(word));
        if sensitive {
            map.serialize_entry(name, "[redacted]")?;
        } else {
            map.serialize_entry(name, value.expose())?;
        }
    }
    map.end()
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

/// A configuration that could not be loaded or does not make sense. The message names the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{0}")]
    Load(String),
    #[error("invalid value for `{key}`: {reason}")]
    Invalid { key: String, reason: String },
}

impl Config {
    /// Loads defaults, then `file` if given, then the environment.
    pub fn load(file: Option<&Path>) -> Result<Config, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        if let Some(file) = file {
            if !file.exists() {
                return Err(ConfigError::Load(format!(
                    "config file {} does not exist",
                    file.display()
                )));
            }
            figment = figment.merge(Toml::file(file));
        }
        figment = figment
            .merge(Env::raw().only(&["DATABASE_URL"]).map(|_| "database.url".into()))
            .merge(Env::raw().only(&["KAFKA_BROKERS"]).map(|_| "kafka.brokers".into()))
            // Only sectioned names are configuration (`OBX_LIMITS__CALL_DEADLINE`); other
            // OBX_ variables (OBX_CONFIG, OBX_LOG_FORMAT, ...) belong to other parts.
            .merge(Env::prefixed("OBX_").filter(|k| k.as_str().contains("__")).split("__"));
        let mut config: Config = figment.extract().map_err(|e| ConfigError::Load(describe(e)))?;
        config.resolve_secrets()?;
        config.validate()?;
        Ok(config)
    }

    fn resolve_secrets(&mut self) -> Result<(), ConfigError> {
        if let Some(url) = &mut self.database.url {
            url.resolve("database.url")?;
        }
        for (name, value) in &mut self.kafka.properties {
            value.resolve(&format!("kafka.properties.{name}"))?;
        }
        for (i, token) in self.http.auth.command_tokens.iter_mut().enumerate() {
            token.resolve(&format!("http.auth.command_tokens[{i}]"))?;
        }
        for (i, token) in self.http.auth.admin_tokens.iter_mut().enumerate() {
            token.resolve(&format!("http.auth.admin_tokens[{i}]"))?;
        }
        for (i, token) in self.http.auth.read_tokens.iter_mut().enumerate() {
            token.resolve(&format!("http.auth.read_tokens[{i}]"))?;
        }
        Ok(())
    }

    /// Values that work but are likely a mistake, each a sentence naming its keys; the host
    /// logs them at start. Not refused: a test, or an operator who means it, may want them.
    pub fn advice(&self) -> Vec<String> {
        let l = &self.limits;
        let mut advice = Vec::new();
        // A command may wait a deadline for a call slot, run for one, then commit.
        let command = l.call_deadline * 2 + l.statement_timeout + Duration::from_secs(1);
        if self.http.request_timeout < command {
            advice.push(format!(
                "http.request_timeout ({:?}) is shorter than a command may take (twice \
                 limits.call_deadline, plus limits.statement_timeout for the commit, plus 1s: {:?}): \
                 a command that would have succeeded may be cut off and answered 503 (one whose \
                 commit has begun is waited for)",
                self.http.request_timeout, command
            ));
        }
        if l.lock_timeout >= l.statement_timeout {
            advice.push(format!(
                "limits.lock_timeout ({:?}) is not shorter than limits.statement_timeout ({:?}): a \
                 command waiting for an Idempotency-Key another holds may be answered 503 \
                 database_unavailable instead of 409 idempotency_key_in_use",
                l.lock_timeout, l.statement_timeout
            ));
        }
        // Dedup consumers remember an event for processed_after, inbox ones for inbox_after.
        let r = &self.retention;
        let (window, key) = match r.inbox_after < r.processed_after {
            true => (r.inbox_after, "retention.inbox_after"),
            false => (r.processed_after, "retention.processed_after"),
        };
        if r.outbox_after > window {
            advice.push(format!(
                "retention.outbox_after ({:?}) is longer than {key} ({window:?}): a replay of \
                 events published before consumers' dedup window runs their handlers again",
                r.outbox_after
            ));
        }
        advice
    }

    /// Refuses values that cannot work, naming the key and the reason.
    pub fn validate(&self) -> Result<(), ConfigError> {
        fn invalid(key: &'static str, reason: &str) -> Result<(), ConfigError> {
            Err(ConfigError::Invalid {
                key: key.to_string(),
                reason: reason.to_string(),
            })
        }
        let l = &self.limits;
        if let Some(url) = &self.database.url {
            let u = url.expose();
            if !(u.starts_with("postgres://") || u.starts_with("postgresql://")) {
                return invalid("database.url", "must start with postgres:// or postgresql://");
            }
            // sslmode, sslrootcert and the rest are checked here, not at the first connect.
            // sqlx's message names the parameter, never the password.
            if let Err(e) = <sqlx::postgres::PgConnectOptions as std::str::FromStr>::from_str(u) {
                return invalid("database.url", &e.to_string());
            }
        }
        if let Some(endpoint) = &self.telemetry.otlp_endpoint {
            match url::Url::parse(endpoint) {
                Ok(u) if matches!(u.scheme(), "http" | "https") && u.has_host() => {}
                _ => return invalid("telemetry.otlp_endpoint", "must be an http:// or https:// URL"),
            }
        }
        let auth = &self.http.auth;
        if !self.http.listen.ip().is_loopback() {
            if auth.command_tokens.is_empty() {
                return invalid(
                    "http.auth.command_tokens",
                    "is required when http.listen is not a loopback address",
                );
            }
            if auth.admin_tokens.is_empty() {
                return invalid(
                    "http.auth.admin_tokens",
                    "is required when http.listen is not a loopback address",
                );
            }
        }
        for (_, token) in auth.all() {
            if token.expose().len() < 16 {
                return invalid("http.auth", "every token must be at least 16 characters");
            }
            // What an `Authorization: Bearer` header can carry as it is read (trimmed): a token
            // with a control or a non-ASCII character, or a space at either end, would be
            // refused every time.
            let t = token.expose();
            if !t.bytes().all(|b| b.is_ascii_graphic() || b == b' ') || t.trim() != t {
                return invalid(
                    "http.auth",
                    "every token must be printable ASCII, with no space at either end (a file: or env: secret with a trailing space?)",
                );
            }
        }
        let mut seen = std::collections::HashMap::new();
        for (key, token) in auth.all() {
            if seen.insert(token.expose(), key).is_some_and(|first| first != key) {
                return invalid(
                    key,
                    "a token may not be in two lists: each token has one scope (an admin token is refused for commands, a read token for actions)",
                );
            }
        }
        if self.http.shutdown_timeout.is_zero() {
            return invalid("http.shutdown_timeout", "must be greater than 0");
        }
        if self.database.max_connections < 2 {
            return invalid("database.max_connections", "must be at least 2");
        }
        if self.http.max_body_bytes == 0 {
            return invalid("http.max_body_bytes", "must be greater than 0");
        }
        if self.http.max_body_bytes_in_flight < self.http.max_body_bytes {
            return invalid("http.max_body_bytes_in_flight", "must be at least http.max_body_bytes");
        }
        if self.http.max_connections == 0 {
            return invalid("http.max_connections", "must be greater than 0");
        }
        if self.http.header_read_timeout < Duration::from_millis(100) {
            return invalid("http.header_read_timeout", "must be at least 100ms");
        }
        if self.http.write_timeout < Duration::from_millis(100) {
            return invalid("http.write_timeout", "must be at least 100ms");
        }
        if l.call_deadline < Duration::from_millis(10) {
            return invalid("limits.call_deadline", "must be at least 10ms");
        }
        if l.memory_bytes < 1024 * 1024 {
            return invalid("limits.memory_bytes", "must be at least 1 MiB");
        }
        if l.max_component_bytes == 0 {
            return invalid("limits.max_component_bytes", "must be greater than 0");
        }
        if l.max_concurrent_calls == 0 {
            return invalid("limits.max_concurrent_calls", "must be greater than 0");
        }
        if l.max_concurrent_compiles == 0 {
            return invalid("limits.max_concurrent_compiles", "must be greater than 0");
        }
        if l.max_payload_bytes == 0 {
            return invalid("limits.max_payload_bytes", "must be greater than 0");
        }
        if let Some((name, reason)) = self
            .kafka
            .properties
            .iter()
            .find_map(|(name, value)| reserved_kafka_property(name, value.expose()).map(|reason| (name, reason)))
        {
            return Err(ConfigError::Invalid {
                key: format!("kafka.properties.{name}"),
                reason: format!("is set by OBX and may not be overridden: {reason}"),
            });
        }
        let producer_max = self.kafka.producer_max_message_bytes();
        if l.max_payload_bytes + MESSAGE_OVERHEAD_BYTES > producer_max {
            return invalid(
                "limits.max_payload_bytes",
                &format!(
                    "must leave {} bytes for the key and headers within the producer's \
                     message.max.bytes ({producer_max}): at most {}",
                    MESSAGE_OVERHEAD_BYTES,
                    producer_max.saturating_sub(MESSAGE_OVERHEAD_BYTES)
                ),
            );
        }
        if l.max_result_bytes < 1024 {
            return invalid("limits.max_result_bytes", "must be at least 1024");
        }
        if !(1024..=16 * 1024 * 1024).contains(&l.max_statement_bytes) {
            return invalid("limits.max_statement_bytes", "must be between 1 KiB and 16 MiB");
        }
        if l.max_relations == 0 {
            return invalid("limits.max_relations", "must be at least 1");
        }
        if l.work_mem_bytes < 64 * 1024 {
            return invalid("limits.work_mem_bytes", "must be at least 64 KiB (Postgres's minimum)");
        }
        if self.database.plugin_max_connections == 0 {
            return invalid("database.plugin_max_connections", "must be at least 1");
        }
        if self.database.plugin_role_connections < self.database.plugin_max_connections {
            return invalid(
                "database.plugin_role_connections",
                "must be at least database.plugin_max_connections",
            );
        }
        if l.statement_timeout.is_zero() {
            return invalid(
                "limits.statement_timeout",
                "must be greater than 0 (0 would disable it)",
            );
        }
        if let Some(cache) = self.plugins.cache_dir() {
            // Whoever may write the plugin directory could put a directory of their own in
            // the cache's place, and the host would run the native code it finds there.
            if resolved(&cache).starts_with(resolved(&self.plugins.dir)) {
                return invalid(
                    "plugins.cache_dir",
                    "must not be the plugin directory or inside it: whoever may write plugins could replace \
                     the compiled code the host runs",
                );
            }
        }
        if self.plugins.rescan_interval < Duration::from_millis(100) {
            return invalid("plugins.rescan_interval", "must be at least 100ms");
        }
        if self.relay.batch_size == 0 {
            return invalid("relay.batch_size", "must be greater than 0");
        }
        if self.kafka.partitioner == Partitioner::Random {
            return invalid(
                "kafka.partitioner",
                "random puts each of a key's events on any partition, out of order; choose a hash",
            );
        }
        if self.relay.batch_max_bytes == 0 {
            return invalid("relay.batch_max_bytes", "must be greater than 0");
        }
        if self.relay.ack_timeout.is_zero() {
            return invalid("relay.ack_timeout", "must be greater than 0");
        }
        if self.relay.stall_timeout < Duration::from_millis(100) {
            return invalid("relay.stall_timeout", "must be at least 100ms");
        }
        if self.relay.backoff_initial.is_zero() || self.relay.backoff_max < self.relay.backoff_initial {
            return invalid(
                "relay.backoff_initial",
                "must be greater than 0 and at most relay.backoff_max",
            );
        }
        if self.service.name.is_empty()
            || !self
                .service
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        {
            return invalid("service.name", "must be non-empty, of A-Z a-z 0-9 . _ -");
        }
        if self.consumer.max_attempts == 0 {
            return invalid("consumer.max_attempts", "must be at least 1");
        }
        if self.consumer.lanes == 0 {
            return invalid("consumer.lanes", "must be at least 1");
        }
        if !(1..=64).contains(&self.consumer.batch_max_events) {
            return invalid("consumer.batch_max_events", "must be 1 to 64");
        }
        let c = &self.consumer;
        if c.session_timeout < Duration::from_secs(1) || c.session_timeout > Duration::from_secs(3600) {
            return invalid("consumer.session_timeout", "must be between 1s and 1h");
        }
        if c.heartbeat_interval.is_zero() || c.heartbeat_interval * 3 > c.session_timeout {
            return invalid(
                "consumer.heartbeat_interval",
                "must be greater than 0 and at most a third of consumer.session_timeout",
            );
        }
        let assignors = ["cooperative-sticky", "range", "roundrobin"];
        if !assignors.contains(&c.assignor.as_str()) {
            return invalid("consumer.assignor", "must be cooperative-sticky, range or roundrobin");
        }
        if let Some(id) = &c.instance_id {
            if id.is_empty() || id.len() > 200 || !id.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c)) {
                return invalid("consumer.instance_id", "must be 1-200 characters of A-Z a-z 0-9 . _ -");
            }
        }
        if self.consumer.batch_max_bytes == 0 {
            return invalid("consumer.batch_max_bytes", "must be greater than 0");
        }
        if self.consumer.backoff_initial.is_zero() || self.consumer.backoff_max < self.consumer.backoff_initial {
            return invalid(
                "consumer.backoff_initial",
                "must be greater than 0 and at most consumer.backoff_max",
            );
        }
        if self.retention.batch_size == 0 {
            return invalid("retention.batch_size", "must be greater than 0");
        }
        if self.retention.interval.is_zero() {
            return invalid("retention.interval", "must be greater than 0");
        }
        if l.lock_timeout.is_zero() {
            return invalid("limits.lock_timeout", "must be greater than 0 (0 would disable it)");
        }
        Ok(())
    }
}

/// Figment's errors name the key already; keep only what helps a person fix the file.
fn describe(e: figment::Error) -> String {
    e.into_iter()
        .map(|e| {
            let key = e.path.join(".");
            if key.is_empty() {
                e.kind.to_string()
            } else {
                format!("invalid value for `{key}`: {}", e.kind)
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        Config::default().validate().unwrap();
        assert!(
            Config::default().advice().is_empty(),
            "{:?}",
            Config::default().advice()
        );
    }

    /// A managed Kafka's client snippet that repeats what OBX sets anyway is accepted.
    #[test]
    fn kafka_properties_that_repeat_obx_own_values_are_accepted() {
        let mut c = Config::default();
        for (name, value) in [
            ("acks", "ALL"),
            ("topic.request.required.acks", "-1"),
            ("enable.idempotence", "True"),
            ("retries", "2147483647"),
            ("enable.auto.offset.store", "false"),
            ("auto.offset.reset", "earliest"),
            ("security.protocol", "SASL_SSL"),
        ] {
            c.kafka.properties.insert(name.into(), Secret::new(value));
        }
        c.validate().unwrap();
        c.kafka
            .properties
            .insert("auto.offset.reset".into(), Secret::new("latest"));
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("kafka.properties.auto.offset.reset"), "{e}");
    }

    #[test]
    fn a_request_timeout_shorter_than_a_command_may_take_is_advised_against() {
        let mut c = Config::default();
        c.limits.call_deadline = Duration::from_secs(10);
        c.limits.statement_timeout = Duration::from_secs(5);
        c.http.request_timeout = Duration::from_secs(25);
        c.validate().unwrap();
        let advice = c.advice();
        assert_eq!(advice.len(), 1, "{advice:?}");
        assert!(advice[0].starts_with("http.request_timeout (25s)"), "{advice:?}");
        assert!(advice[0].contains("26s"), "{advice:?}");
        c.http.request_timeout = Duration::from_secs(26);
        assert!(c.advice().is_empty());
    }

    /// A lock wait that outlasts the statement would answer a command waiting for another's
    /// Idempotency-Key 503, not 409: advised against (it worked before, so it is not refused).
    #[test]
    fn a_lock_timeout_not_below_the_statement_timeout_is_advised_against() {
        let mut c = Config::default();
        c.limits.statement_timeout = Duration::from_secs(1);
        c.validate().unwrap();
        let advice = c.advice();
        assert_eq!(advice.len(), 1, "{advice:?}");
        assert!(advice[0].starts_with("limits.lock_timeout (1s)"), "{advice:?}");
        c.limits.lock_timeout = Duration::from_millis(500);
        assert!(c.advice().is_empty());
    }

    /// A replay reaches back as far as the outbox keeps rows; consumers skip only what the
    /// dedup window remembers: a longer outbox is advised against.
    #[test]
    fn an_outbox_kept_longer_than_the_dedup_window_is_advised_against() {
        let mut c = Config::default();
        c.retention.outbox_after = Duration::from_secs(10 * 24 * 3600);
        c.validate().unwrap();
        let advice = c.advice();
        assert_eq!(advice.len(), 1, "{advice:?}");
        assert!(advice[0].starts_with("retention.outbox_after (864000s)"), "{advice:?}");
        // Inbox consumers' window is the shorter here.
        assert!(advice[0].contains("retention.inbox_after (604800s)"), "{advice:?}");
        c.retention.outbox_after = c.retention.inbox_after;
        assert!(c.advice().is_empty());
    }

    #[test]
    fn secret_is_redacted() {
        let s = Secret::new("postgres://u:hunter2@h/db");
        assert_eq!(format!("{s:?} {s}"), "[redacted] [redacted]");
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail API
    fn environment_overrides_and_other_obx_variables_are_ignored() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("OBX_LIMITS__CALL_DEADLINE", "750ms");
            jail.set_env("OBX_LOG_FORMAT", "json");
            jail.set_env("OBX_TEST_PLUGINS_DIR", "/tmp");
            jail.set_env("DATABASE_URL", "postgres://u:p@h/db");
            let c = Config::load(None).map_err(|e| e.to_string())?;
            assert_eq!(c.limits.call_deadline, Duration::from_millis(750));
            assert_eq!(c.database.url.unwrap().expose(), "postgres://u:p@h/db");
            jail.set_env("OBX_LIMTS__CALL_DEADLINE", "1s");
            let e = Config::load(None).unwrap_err().to_string();
            assert!(e.contains("limts"), "{e}");
            Ok(())
        });
    }

    /// Every class of bad configuration is refused by `Config::load` (what `serve` and
    /// `obx config check` run), with a message that names the key.
    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail API
    fn each_invalid_class_names_its_key() {
        let cases: &[(&str, &str, &str)] = &[
            ("unknown key", "[limits]\ncall_deadlin = \"1s\"", "call_deadlin"),
            ("unknown section", "[relays]\nenabled = true", "relays"),
            (
                "wrong type",
                "[database]\nmax_connections = \"many\"",
                "max_connections",
            ),
            (
                "bad duration",
                "[limits]\ncall_deadline = \"5 parsecs\"",
                "call_deadline",
            ),
            ("bad address", "[http]\nlisten = \"localhost\"", "listen"),
            (
                "rescan too often",
                "[plugins]\nrescan_interval = \"1ms\"",
                "plugins.rescan_interval",
            ),
            (
                "a compile cache inside the plugin directory",
                "[plugins]\ndir = \"/tmp\"\ncache_dir = \"/var/../tmp/obx-missing/../.obx-cache\"",
                "plugins.cache_dir",
            ),
            ("url scheme", "[database]\nurl = \"mysql://u:pw@h/db\"", "database.url"),
            (
                "sslmode",
                "[database]\nurl = \"postgres://u:pw@h/db?sslmode=sometimes\"",
                "database.url",
            ),
            (
                "a property the relay's order rests on",
                "[kafka.properties]\n\"enable.idempotence\" = \"false\"",
                "kafka.properties.enable.idempotence",
            ),
            (
                "a property at-least-once rests on",
                "[kafka.properties]\nacks = \"1\"",
                "kafka.properties.acks",
            ),
            (
                "a consumer's offset store",
                "[kafka.properties]\n\"enable.auto.offset.store\" = \"true\"",
                "kafka.properties.enable.auto.offset.store",
            ),
            (
                "a reserved property as a topic setting",
                "[kafka.properties]\n\"topic.acks\" = \"1\"",
                "kafka.properties.topic.acks",
            ),
            (
                "a partitioner that keeps no key's order",
                "[kafka]\npartitioner = \"random\"",
                "kafka.partitioner",
            ),
            (
                "retries that end",
                "[kafka.properties]\nretries = \"3\"",
                "kafka.properties.retries",
            ),
            (
                "the partitioner as a property",
                "[kafka.properties]\npartitioner = \"random\"",
                "kafka.properties.partitioner",
            ),
            (
                "public listen without command tokens",
                "[http]\nlisten = \"0.0.0.0:8080\"",
                "http.auth.command_tokens",
            ),
            (
                "public listen without admin tokens",
                "[http]\nlisten = \"0.0.0.0:8080\"\n[http.auth]\ncommand_tokens = [\"0123456789abcdef0123\"]",
                "http.auth.admin_tokens",
            ),
            ("short token", "[http.auth]\nadmin_tokens = [\"short\"]", "http.auth"),
            (
                "a token no header can carry",
                "[http.auth]\nadmin_tokens = [\"0123456789abcdef0123 \"]",
                "http.auth",
            ),
            (
                "a non-ASCII token",
                "[http.auth]\nadmin_tokens = [\"ünïcödé-token-0123456789\"]",
                "http.auth",
            ),
            (
                "a token in both scopes",
                "[http.auth]\ncommand_tokens = [\"0123456789abcdef0123\"]\nadmin_tokens = [\"0123456789abcdef0123\"]",
                "http.auth.admin_tokens",
            ),
            (
                "an admin token that is a read token too",
                "[http.auth]\nadmin_tokens = [\"0123456789abcdef0123\"]\nread_tokens = [\"0123456789abcdef0123\"]",
                "http.auth.read_tokens",
            ),
            (
                "secret file missing",
                "[http.auth]\nadmin_tokens = [\"file:/nonexistent/obx-token\"]",
                "http.auth.admin_tokens[0]",
            ),
            (
                "secret variable missing",
                "[kafka.properties]\n\"sasl.password\" = \"env:OBX_TEST_UNSET_VARIABLE\"",
                "kafka.properties.sasl.password",
            ),
            (
                "OTLP endpoint without a scheme",
                "[telemetry]\notlp_endpoint = \"collector:4318\"",
                "telemetry.otlp_endpoint",
            ),
            (
                "zero shutdown bound",
                "[http]\nshutdown_timeout = \"0s\"",
                "http.shutdown_timeout",
            ),
            ("no connections", "[http]\nmax_connections = 0", "http.max_connections"),
            (
                "header timeout too short",
                "[http]\nheader_read_timeout = \"10ms\"",
                "http.header_read_timeout",
            ),
            (
                "write timeout too short",
                "[http]\nwrite_timeout = \"10ms\"",
                "http.write_timeout",
            ),
            (
                "pool too small",
                "[database]\nmax_connections = 1",
                "database.max_connections",
            ),
            (
                "zero statement timeout",
                "[limits]\nstatement_timeout = \"0s\"",
                "limits.statement_timeout",
            ),
            (
                "tiny memory cap",
                "[limits]\nmemory_bytes = 1000",
                "limits.memory_bytes",
            ),
            ("empty batch", "[relay]\nbatch_size = 0", "relay.batch_size"),
            ("service name", "[service]\nname = \"a b\"", "service.name"),
            (
                "heartbeat not below the session",
                "[consumer]\nsession_timeout = \"3s\"\nheartbeat_interval = \"2s\"",
                "consumer.heartbeat_interval",
            ),
            (
                "unknown assignment",
                "[consumer]\nassignment = \"broker\"",
                "consumer.assignment",
            ),
            (
                "unknown partitioner",
                "[kafka]\npartitioner = \"java\"",
                "kafka.partitioner",
            ),
            (
                "unknown assignor",
                "[consumer]\nassignor = \"sticky\"",
                "consumer.assignor",
            ),
            (
                "instance id",
                "[consumer]\ninstance_id = \"host 1\"",
                "consumer.instance_id",
            ),
        ];
        for (class, text, key) in cases {
            figment::Jail::expect_with(|jail| {
                jail.create_file("obx.toml", text)?;
                let e = Config::load(Some(Path::new("obx.toml"))).expect_err(class).to_string();
                assert!(e.contains(key), "{class}: {e:?} does not name {key}");
                assert!(!e.contains("pw@"), "{class}: the password leaked: {e}");
                Ok(())
            });
        }
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail API
    fn secrets_come_from_files_and_variables_and_never_print() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("token", "file-token-0123456789\n")?;
            jail.set_env("OBX_TEST_KAFKA_PASSWORD", "kafka-pass-0123456789");
            let dir = jail.directory().to_path_buf();
            jail.create_file(
                "obx.toml",
                &format!(
                    "[database]\nurl = \"postgres://u:db-pass-0123456789@h/db?sslmode=require\"\n\
                     [kafka.properties]\n\"sasl.password\" = \"env:OBX_TEST_KAFKA_PASSWORD\"\n\
                     \"security.protocol\" = \"SASL_SSL\"\n\
                     [http.auth]\ncommand_tokens = [\"file:{}/token\"]\nadmin_tokens = [\"admin-token-0123456789\"]",
                    dir.display()
                ),
            )?;
            let c = Config::load(Some(Path::new("obx.toml"))).map_err(|e| e.to_string())?;
            assert_eq!(c.http.auth.command_tokens[0].expose(), "file-token-0123456789");
            assert_eq!(c.kafka.properties["sasl.password"].expose(), "kafka-pass-0123456789");
            let shown = format!("{}\n{c:?}", toml::to_string(&c).unwrap());
            for secret in ["file-token", "kafka-pass", "db-pass", "admin-token"] {
                assert!(!shown.contains(secret), "{secret} shown:\n{shown}");
            }
            assert!(shown.contains("SASL_SSL"), "{shown}");
            assert!(shown.contains("postgres://u:REDACTED@h/db?sslmode=require"), "{shown}");
            Ok(())
        });
    }

    #[test]
    fn invalid_value_names_its_key() {
        let mut c = Config::default();
        c.limits.statement_timeout = Duration::ZERO;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("limits.statement_timeout"), "{e}");
        let mut c = Config::default();
        c.http.max_body_bytes_in_flight = c.http.max_body_bytes - 1;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("http.max_body_bytes_in_flight"), "{e}");
    }
}
