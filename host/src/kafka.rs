//! Kafka: client configuration shared by the relay, replay and the consumers, and the
//! embedded broker used when no brokers are configured.
//!
//! The embedded broker is librdkafka's mock cluster. It speaks the real Kafka protocol on a
//! loopback port, so any client (kcat included) can connect to it, but it keeps messages in
//! memory only: it is for trying OBX out and for tests, never for production.

use anyhow::{Context, Result};
use rdkafka::config::ClientConfig;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;

use crate::config::KafkaConfig;

/// The brokers a host talks to.
pub struct Brokers {
    /// `host:port,...`
    pub bootstrap: String,
    mock: Option<MockBroker>,
}

impl Brokers {
    /// Connects to the configured brokers, or starts the embedded mock cluster when none are
    /// configured.
    pub fn start(config: &KafkaConfig) -> Result<Brokers> {
        if !config.brokers.trim().is_empty() {
            return Ok(Brokers {
                bootstrap: config.brokers.trim().to_string(),
                mock: None,
            });
        }
        let mock = MockBroker::start(config.embedded_brokers)?;
        let bootstrap = mock.bootstrap();
        tracing::warn!(
            %bootstrap,
            "no Kafka brokers configured: started an in-memory mock cluster (messages are lost at exit)"
        );
        Ok(Brokers {
            bootstrap,
            mock: Some(mock),
        })
    }

    /// The embedded mock cluster, if this host runs one: for fault injection in tests.
    pub fn mock(&self) -> Option<&MockBroker> {
        self.mock.as_ref()
    }

    /// librdkafka settings for a client of these brokers: the user's properties on top of
    /// ours, so that a user can point OBX at a managed Kafka (TLS, SASL, ...).
    pub fn client_config(&self, config: &KafkaConfig) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.bootstrap)
            .set("client.id", &config.client_id);
        for (key, value) in config.user_properties() {
            c.set(key, value);
        }
        c
    }
}

/// Creates the topics that do not exist yet, with the brokers' default partition count and
/// replication factor. A consumer whose topics all exist when it subscribes joins its group
/// at once; one that subscribes to a missing topic waits for a rebalance once it appears.
/// Where the brokers refuse (no permission, auto-creation managed elsewhere), that is logged
/// and the consumer subscribes anyway.
pub async fn ensure_topics(brokers: &Brokers, config: &KafkaConfig, topics: &[String]) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::error::RDKafkaErrorCode;
    use std::time::Duration;

    let admin: AdminClient<DefaultClientContext> = match brokers.client_config(config).create() {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!(error = %e, "cannot create a Kafka admin client");
            return;
        }
    };
    let existing: Vec<String> = match admin.inner().fetch_metadata(None, Duration::from_secs(5)) {
        Ok(m) => m
            .topics()
            .iter()
            .filter(|t| t.error().is_none())
            .map(|t| t.name().to_string())
            .collect(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the topic list");
            return;
        }
    };
    let missing: Vec<&String> = topics.iter().filter(|t| !existing.contains(t)).collect();
    if missing.is_empty() {
        return;
    }
    if let Some(mock) = brokers.mock() {
        for topic in missing {
            let _ = mock.create_topic(topic, config.topic_partitions.max(4));
        }
        return;
    }
    let new: Vec<NewTopic<'_>> = missing
        .iter()
        .map(|t| NewTopic::new(t, config.topic_partitions, TopicReplication::Fixed(-1)))
        .collect();
    let options = AdminOptions::new()
        .operation_timeout(Some(Duration::from_secs(5)))
        .request_timeout(Some(Duration::from_secs(5)));
    match tokio::time::timeout(Duration::from_secs(6), admin.create_topics(&new, &options)).await {
        Ok(Ok(results)) => {
            for result in results {
                match result {
                    Ok(topic) => tracing::info!(%topic, "created topic"),
                    Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                    Err((topic, code)) => tracing::warn!(%topic, ?code, "could not create topic"),
                }
            }
        }
        Ok(Err(e)) => tracing::warn!(error = %e, "could not create topics"),
        Err(_) => tracing::warn!("creating topics timed out"),
    }
}

/// librdkafka's in-process mock cluster.
pub struct MockBroker(MockCluster<'static, DefaultProducerContext>);

// SAFETY: librdkafka's mock cluster API is thread-safe: every call takes the cluster's own
// lock. The wrapper only forwards those calls and the destructor.
unsafe impl Send for MockBroker {}
// SAFETY: as above.
unsafe impl Sync for MockBroker {}

impl MockBroker {
    pub fn start(brokers: u32) -> Result<MockBroker> {
        let cluster = MockCluster::new(brokers.max(1) as i32).context("starting the embedded Kafka mock cluster")?;
        Ok(MockBroker(cluster))
    }

    pub fn bootstrap(&self) -> String {
        self.0.bootstrap_servers()
    }

    /// Takes every broker down: connections are refused until [`MockBroker::up`].
    pub fn down(&self, brokers: u32) -> Result<()> {
        for id in 1..=brokers.max(1) as i32 {
            self.0.broker_down(id)?;
        }
        Ok(())
    }

    pub fn up(&self, brokers: u32) -> Result<()> {
        for id in 1..=brokers.max(1) as i32 {
            self.0.broker_up(id)?;
        }
        Ok(())
    }

    /// Answers the next `count` requests of `api` with `error` (a fault for tests).
    pub fn fail_requests(
        &self,
        api: rdkafka::types::RDKafkaApiKey,
        error: rdkafka::types::RDKafkaRespErr,
        count: usize,
    ) {
        self.0.request_errors(api, &vec![error; count]);
    }

    /// Makes every broker answer each request `delay` late (a slow network, for tests).
    pub fn delay(&self, brokers: u32, delay: std::time::Duration) -> Result<()> {
        for id in 1..=brokers.max(1) as i32 {
            self.0.broker_round_trip_time(id, delay)?;
        }
        Ok(())
    }

    /// Makes `partition` of `topic` leaderless (`leader` `None`), or led by broker `leader`:
    /// a partition without a leader takes no messages, and its producers wait.
    pub fn lead(&self, topic: &str, partition: i32, leader: Option<i32>) -> Result<()> {
        self.0.partition_leader(topic, partition, leader)?;
        Ok(())
    }

    /// Creates a topic with a given number of partitions.
    pub fn create_topic(&self, topic: &str, partitions: i32) -> Result<()> {
        self.0.create_topic(topic, partitions, 1)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::producer::BaseProducer;

    use super::*;
    use crate::config::{KafkaConfig, Secret};

    fn producer_with(properties: &[(&str, &str)]) -> Result<BaseProducer, String> {
        let mut config = KafkaConfig {
            brokers: "127.0.0.1:9".into(),
            ..KafkaConfig::default()
        };
        for (k, v) in properties {
            config.properties.insert(k.to_string(), Secret::new(*v));
        }
        let brokers = Brokers::start(&config).map_err(|e| e.to_string())?;
        brokers.client_config(&config).create().map_err(|e| e.to_string())
    }

    /// The settings of managed Kafka services are accepted by the librdkafka OBX is built
    /// with (TLS and SASL compiled in), so a user can point OBX at one.
    #[test]
    fn managed_kafka_security_settings_are_supported() {
        let ca = "/etc/ssl/certs/ca-certificates.crt";
        let ca_props: &[(&str, &str)] = if std::path::Path::new(ca).exists() {
            &[("ssl.ca.location", ca)]
        } else {
            &[]
        };
        for mechanism in ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] {
            let mut props = vec![
                ("security.protocol", "SASL_SSL"),
                ("sasl.mechanisms", mechanism),
                ("sasl.username", "obx"),
                ("sasl.password", "secret"),
            ];
            props.extend_from_slice(ca_props);
            producer_with(&props).unwrap_or_else(|e| panic!("{mechanism}: {e}"));
        }
        let mut tls = vec![
            ("security.protocol", "SSL"),
            ("ssl.endpoint.identification.algorithm", "https"),
        ];
        tls.extend_from_slice(ca_props);
        producer_with(&tls).unwrap();
        producer_with(&[("security.protocol", "SASL_SSL"), ("sasl.mechanisms", "OAUTHBEARER")]).unwrap();
    }

    #[test]
    fn a_bad_kafka_property_is_refused_by_name() {
        let e = producer_with(&[("security.protocol", "carrier-pigeon")]).err().unwrap();
        assert!(e.contains("security.protocol"), "{e}");
        let e = producer_with(&[("no.such.property", "1")]).err().unwrap();
        assert!(e.contains("no.such.property"), "{e}");
    }
}
