//! Wires a host together: database, runtime, plugins, dispatcher, HTTP. `obx serve` and the
//! system tests both start hosts through [`start`].

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use sqlx::PgPool;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::api::{self, AppState};
use crate::config::Config;
use crate::db::sessions::Sessions;
use crate::db::{self, embedded::EmbeddedPostgres};
use crate::dispatch::Dispatcher;
use crate::inbox::processor::Processor;
use crate::inbox::supervisor::Supervisor;
use crate::kafka::Brokers;
use crate::outbox::notifier;
use crate::outbox::relay::Relay;
use crate::retention;
use crate::runtime::cache::CacheSettings;
use crate::runtime::registry::Registry;
use crate::runtime::{loader, watcher, Runtime};
use crate::signal::Signal;

/// A running host. Dropping it does not stop it; call [`Host::shutdown`].
pub struct Host {
    pub addr: std::net::SocketAddr,
    pub pool: PgPool,
    pub registry: Arc<Registry>,
    pub runtime: Arc<Runtime>,
    pub brokers: Arc<Brokers>,
    pub dispatcher: Arc<Dispatcher>,
    /// The plugins' own database sessions.
    pub sessions: Arc<Sessions>,
    ready: Arc<AtomicBool>,
    stop_http: watch::Sender<bool>,
    stop_tasks: watch::Sender<bool>,
    stop_consumers: watch::Sender<bool>,
    server: JoinHandle<()>,
    /// Kafka consumers and inbox processors.
    consumers: Vec<JoinHandle<()>>,
    /// Background loops: relay, notifier, retention.
    tasks: Vec<JoinHandle<()>>,
    /// The throwaway database, when no URL was configured; stopped with the host.
    _embedded: Option<EmbeddedPostgres>,
}

pub async fn start(mut config: Config) -> Result<Host> {
    // One spelling of every plugin file's path: notify names files under the absolute path
    // of the directory it watches, so a relative one would make each file two to the registry.
    config.plugins.dir = std::path::absolute(&config.plugins.dir)
        .with_context(|| format!("resolving the plugin directory {}", config.plugins.dir.display()))?;
    // The recorder first, so that nothing done at start-up goes uncounted.
    let metrics = crate::telemetry::metrics();
    crate::otel::init(&config.telemetry, &config.service.name)?;
    let (url, embedded) = match &config.database.url {
        Some(url) => (url.expose().to_string(), None),
        None => {
            tracing::warn!("no database URL configured: starting a throwaway Postgres (its data is deleted at exit)");
            let pg = tokio::task::spawn_blocking(|| EmbeddedPostgres::start(&[]))
                .await?
                .context("starting the throwaway Postgres")?;
            tracing::info!(port = pg.port(), "throwaway Postgres is up");
            // The host runs as it should in production: a user named `obx` that owns its
            // database, with CREATEROLE and no superuser rights.
            let password = uuid::Uuid::new_v4().simple().to_string();
            let url = db::embedded::create_owner(&pg.url("postgres"), "obx", &password, "obx").await?;
            (url, Some(pg))
        }
    };
    let pool = db::connect(&url, &config.database).await?;
    // Before the migrations: a server refused is left as it was.
    db::refuse_prepared_transactions(&pool).await?;
    db::migrate(&pool).await?;
    let relays = config.relay.enabled.then(|| config.kafka.partitioner.librdkafka_name());
    db::installation::check_shared_kafka_settings(&pool, relays, &config.kafka.topic_prefix, true).await?;
    warn_if_superuser(&pool).await;
    for advice in config.advice() {
        tracing::warn!("{advice}");
    }
    let sessions = Arc::new(Sessions::new(&url, pool.clone(), &config.database)?);

    let runtime = Runtime::new(config.limits.clone(), CacheSettings::of(&config.plugins))?;
    let registry = Arc::new(Registry::new(sessions.clone()));
    load_plugin_dir(&runtime, &pool, &registry, &config.plugins.dir).await?;

    let brokers = Arc::new(Brokers::start(&config.kafka)?);
    let signal = Signal::default();
    let (stop_tasks, tasks_stopped) = watch::channel(false);
    let mut tasks = Vec::new();
    let relay_owns_all = Arc::new(std::sync::atomic::AtomicBool::new(false));
    if config.relay.enabled {
        let relay = Relay {
            database_url: url.clone(),
            brokers: brokers.clone(),
            kafka: config.kafka.clone(),
            config: config.relay.clone(),
            signal: signal.subscribe(),
            shutdown: tasks_stopped.clone(),
            owns_all: relay_owns_all.clone(),
        };
        tasks.push(tokio::spawn(relay.run()));
    }
    tasks.push(tokio::spawn(notifier::run(
        url.clone(),
        signal.subscribe(),
        tasks_stopped.clone(),
        relay_owns_all,
    )));
    tasks.push(tokio::spawn(crate::telemetry::run_database_gauges(
        pool.clone(),
        std::time::Duration::from_secs(2),
        tasks_stopped.clone(),
    )));
    tasks.push(tokio::spawn(retention::run(
        pool.clone(),
        config.retention.clone(),
        tasks_stopped,
    )));
    let dispatcher = Arc::new(Dispatcher::new(
        pool.clone(),
        sessions.clone(),
        runtime.clone(),
        registry.clone(),
        signal,
    ));

    // Consumption: a consumer per plugin with subscriptions (following the plugins as they
    // are loaded and unloaded), and the inbox processors. The watcher stops with them.
    let (stop_consumers, consumers_stopped) = watch::channel(false);
    let mut consumers = Vec::new();
    let lag = Arc::new(crate::inbox::ConsumerLag::default());
    if config.plugins.watch {
        consumers.push(watcher::spawn(
            &config.plugins,
            runtime.clone(),
            pool.clone(),
            registry.clone(),
            consumers_stopped.clone(),
        )?);
    }
    if config.consumer.enabled {
        let inbox = Signal::default();
        let supervisor = Supervisor {
            lag: lag.clone(),
            service: config.service.name.clone(),
            dispatcher: dispatcher.clone(),
            registry: registry.clone(),
            brokers: brokers.clone(),
            kafka: config.kafka.clone(),
            config: config.consumer.clone(),
            inbox: inbox.clone(),
        };
        consumers.push(tokio::spawn(supervisor.run(consumers_stopped.clone())));
        let timers = crate::timers::TimerService {
            dispatcher: dispatcher.clone(),
            registry: registry.clone(),
            config: config.consumer.clone(),
            shutdown: consumers_stopped.clone(),
        };
        consumers.push(tokio::spawn(timers.run()));
        let freeing = Arc::new(crate::inbox::Freeing::default());
        for _ in 0..config.consumer.inbox_processors {
            let processor = Processor {
                turn: Default::default(),
                dispatcher: dispatcher.clone(),
                registry: registry.clone(),
                config: config.consumer.clone(),
                wake: inbox.subscribe(),
                shutdown: consumers_stopped.clone(),
                one_at_a_time: Default::default(),
                failing: Default::default(),
                freeing: freeing.clone(),
            };
            consumers.push(tokio::spawn(processor.run()));
        }
    }
    let ready = Arc::new(AtomicBool::new(false));
    let state = AppState {
        dispatcher: dispatcher.clone(),
        registry: registry.clone(),
        pool: pool.clone(),
        admin_pool: db::connect_admin(&url, &config.database, config.http.request_timeout)?,
        ready: ready.clone(),
        metrics,
        lag,
        brokers: brokers.clone(),
        kafka: config.kafka.clone(),
        relay: config.relay.clone(),
        replay_part: config.http.request_timeout / 2,
        service: config.service.name.clone(),
        readiness: Default::default(),
    };
    let listener = tokio::net::TcpListener::bind(config.http.listen)
        .await
        .with_context(|| format!("binding {} (http.listen)", config.http.listen))?;
    let addr = listener.local_addr()?;
    let (stop_http, stopped) = watch::channel(false);
    let (wind_down, winding_down) = watch::channel(false);
    let router = api::router(state, &config.http, winding_down);
    let limits = api::server::Limits {
        max_connections: api::descriptors::connection_cap(
            config.http.max_connections,
            config.database.max_connections + db::ADMIN_CONNECTIONS,
        ),
        header_read_timeout: config.http.header_read_timeout,
        write_timeout: config.http.write_timeout,
        drain: config.http.shutdown_timeout / 2,
    };
    let server = tokio::spawn(api::server::serve(listener, router, limits, stopped, wind_down));
    ready.store(true, Ordering::SeqCst);
    tracing::info!(%addr, "serving");
    Ok(Host {
        addr,
        pool,
        registry,
        runtime,
        brokers,
        dispatcher,
        sessions,
        ready,
        stop_http,
        stop_tasks,
        stop_consumers,
        server,
        consumers,
        tasks,
        _embedded: embedded,
    })
}

impl Host {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops everything at once, as a crash would, minus the process exit: no draining, no
    /// flushing, connections dropped. For tests of what survives a crash. Except the Kafka
    /// consumers: only their supervisor is aborted, and each consumer, seeing its stop
    /// channel closed, winds down on its own after this returns (its lanes end their batches,
    /// its offsets are committed, its leases released). A crash before the offset commit
    /// needs a process killed (`tests/consume.rs`'s SIGKILL tests).
    pub async fn kill(self) {
        self.ready.store(false, Ordering::SeqCst);
        self.server.abort();
        for task in self.consumers.iter().chain(&self.tasks) {
            task.abort();
        }
        let _ = self.server.await;
        for task in self.consumers.into_iter().chain(self.tasks) {
            let _ = task.await;
        }
        self.sessions.close().await;
        self.pool.close().await;
    }

    /// Stops in order: readiness goes false; the HTTP server stops accepting and lets
    /// in-flight commands finish, for its drain at most (half of `http.shutdown_timeout`);
    /// consumers and inbox processors finish the event in hand and commit their offsets; the
    /// relay flushes what it has in flight; the pool closes.
    pub async fn shutdown(self) -> Result<()> {
        self.ready.store(false, Ordering::SeqCst);
        let _ = self.stop_http.send(true);
        self.server.await?;
        let _ = self.stop_consumers.send(true);
        for task in self.consumers {
            let _ = task.await;
        }
        let _ = self.stop_tasks.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
        self.sessions.close().await;
        self.pool.close().await;
        // The spans of the work just finished; the exporter blocks, so off the runtime.
        let _ = tokio::task::spawn_blocking(crate::otel::flush).await;
        Ok(())
    }
}

/// The host needs no superuser rights (see docs/operations.md); with them, a bug in a host
/// function would have them too.
async fn warn_if_superuser(pool: &PgPool) {
    let superuser: bool = sqlx::query_scalar("SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user")
        .fetch_one(pool)
        .await
        .unwrap_or(false);
    if superuser {
        tracing::warn!(
            "the host's database user is a superuser; it needs only CREATEROLE and its own \
             database (docs/operations.md). Plugins stay confined either way"
        );
    }
}

/// Loads every component in `dir`. A plugin that fails is reported and skipped; the host
/// serves the others.
pub async fn load_plugin_dir(runtime: &Arc<Runtime>, pool: &PgPool, registry: &Registry, dir: &Path) -> Result<()> {
    if !dir.exists() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating the plugin directory {}", dir.display()))?;
    }
    for path in watcher::component_files(dir)? {
        let _ = registry.load_file(runtime, pool, &path, loader::SLOT_WAIT).await;
    }
    Ok(())
}
