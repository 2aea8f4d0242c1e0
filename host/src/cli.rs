//! The `obx` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

use crate::config::Config;
use sqlx::PgPool;

#[derive(Parser)]
#[command(
    name = "obx",
    version,
    about = "Host for event-driven services: Wasm plugins, Postgres transactions, a transactional outbox"
)]
struct Cli {
    /// A TOML config file. Environment variables (OBX_SECTION__KEY, DATABASE_URL) override it.
    #[arg(long, short, global = true, env = "OBX_CONFIG")]
    config: Option<PathBuf>,
    /// How the log is written (to stderr): `text`, or `json`, one object per line.
    #[arg(long, global = true, env = "OBX_LOG_FORMAT", value_enum, default_value_t = crate::telemetry::LogFormat::Text)]
    log_format: crate::telemetry::LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Runs the host: loads the plugins, serves the HTTP API.
    Serve,
    /// Applies the host's schema migrations to the configured database, then exits.
    Migrate,
    /// Plugin tools.
    Plugin {
        #[command(subcommand)]
        command: PluginCommand,
    },
    /// Prints the WIT contract of plugins (`obx:plugin`), or writes it to a directory.
    Wit {
        /// Write `obx.wit` into this directory instead of printing it.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Outbox tools.
    Outbox {
        #[command(flatten)]
        host: HostArgs,
        #[command(subcommand)]
        command: OutboxCommand,
    },
    /// The event catalogue of a running host's plugins: who emits each event and who
    /// consumes it; or an AsyncAPI 3.0 document of it.
    Catalog {
        #[command(flatten)]
        host: HostArgs,
        /// Print an AsyncAPI 3.0 document (JSON).
        #[arg(long)]
        asyncapi: bool,
        /// Print the raw JSON of GET /v1/catalog.
        #[arg(long, conflicts_with = "asyncapi")]
        json: bool,
    },
    /// A terminal summary of a running host: plugins, outbox backlog, consumer lag, dead
    /// letters, errors.
    Status {
        #[command(flatten)]
        host: HostArgs,
        /// Print the raw JSON of GET /v1/status.
        #[arg(long)]
        json: bool,
    },
    /// The dead-letter table: events whose handler kept failing, and quarantined messages.
    /// Through the running host's admin API, or the database with --direct.
    Dlq {
        #[command(flatten)]
        host: HostArgs,
        #[command(subcommand)]
        command: DlqCommand,
    },
    /// Configuration tools.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
}

/// How an admin command reaches the service: a running host's admin API (the default), or,
/// for a host that is down, the database itself (`--direct`).
#[derive(clap::Args, Clone)]
struct HostArgs {
    /// The host's address; default: http.listen of the configuration.
    #[arg(long, global = true)]
    url: Option<String>,
    /// An admin token; default: the first of http.auth.admin_tokens in the configuration.
    #[arg(long, global = true, env = "OBX_ADMIN_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Go to the database (DATABASE_URL) and the brokers directly, not through a host.
    #[arg(long, global = true)]
    direct: bool,
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Loads the configuration (file and environment) and validates it, as `serve` would,
    /// without connecting to anything. Exit status 1 names the bad key and the reason.
    Check {
        /// Print the effective configuration, secrets redacted.
        #[arg(long)]
        print: bool,
    },
}

#[derive(Subcommand)]
enum DlqCommand {
    /// Lists parked events (newest first), with how many later events of their key wait.
    List {
        /// Only this plugin's.
        #[arg(long)]
        plugin: Option<String>,
        /// Also retried and discarded ones.
        #[arg(long)]
        all: bool,
        #[arg(long)]
        json: bool,
    },
    /// Sends parked events back to be processed, attempts reset; their keys follow in order.
    Retry { ids: Vec<i64> },
    /// Marks parked events processed without running them; their keys move on.
    Discard { ids: Vec<i64> },
    /// Lists quarantined messages (not events: no eventId, not JSON, ...), newest first.
    Quarantine {
        #[arg(long)]
        plugin: Option<String>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum OutboxCommand {
    /// Publishes stored events again, in id order, with the header `obx-replay: true`.
    /// Give an id range, a time range, an aggregate, or several of these.
    Replay {
        /// First outbox id (inclusive).
        #[arg(long)]
        from_id: Option<i64>,
        /// Last outbox id (inclusive).
        #[arg(long)]
        to_id: Option<i64>,
        /// Events created at or after this RFC 3339 time.
        #[arg(long)]
        since: Option<chrono::DateTime<chrono::Utc>>,
        /// Events created before this RFC 3339 time.
        #[arg(long)]
        until: Option<chrono::DateTime<chrono::Utc>>,
        #[arg(long)]
        aggregate_type: Option<String>,
        #[arg(long)]
        aggregate_id: Option<String>,
    },
}

#[derive(Subcommand)]
enum PluginCommand {
    /// Makes a new plugin project: the WIT, a build script, a test script that runs
    /// `obx plugin test`, and a plugin with two commands, a subscription and a migration.
    New {
        /// The plugin's name: a-z, 0-9 and _, starting with a letter.
        name: String,
        #[arg(long, value_enum)]
        lang: crate::scaffold::Language,
        /// Where to make it (default: a new directory named after the plugin).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Puts a component through the conformance check: manifest, migrations on an empty
    /// schema, every command and subscription answering with ok or a typed error. Uses a
    /// scratch database (on DATABASE_URL's server, or a throwaway one) and drops it after.
    Test {
        file: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Validates a component against the obx:plugin world and prints its manifest. Offline.
    Check {
        file: PathBuf,
        /// Print the manifest as JSON.
        #[arg(long)]
        json: bool,
    },
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    crate::telemetry::init_logging(cli.log_format);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Serve => {
            let config = Config::load(cli.config.as_deref())?;
            let bound = config.http.shutdown_timeout;
            let mut signals = Signals::new()?;
            let host = tokio::select! {
                host = crate::app::start(config) => host?,
                _ = signals.next() => {
                    tracing::warn!("signal received while starting; stopping");
                    return Ok(ExitCode::from(130));
                }
            };
            signals.next().await;
            tracing::info!(bound = ?bound, "shutting down; a second signal stops at once");
            let started = std::time::Instant::now();
            tokio::select! {
                stopped = tokio::time::timeout(bound, host.shutdown()) => match stopped {
                    Ok(result) => {
                        result?;
                        tracing::info!(took = ?started.elapsed(), "stopped");
                        Ok(ExitCode::SUCCESS)
                    }
                    Err(_) => {
                        // Whatever was not finished was not committed: its commands got no
                        // answer, its events are redelivered, its outbox rows are relayed
                        // by the next start.
                        tracing::error!(bound = ?bound, "graceful shutdown did not finish in time; stopping now");
                        std::process::exit(1);
                    }
                },
                _ = signals.next() => {
                    tracing::warn!("second signal: stopping now");
                    std::process::exit(130);
                }
            }
        }
        Command::Config {
            command: ConfigCommand::Check { print },
        } => config_check(cli.config, print),
        Command::Migrate => {
            let config = Config::load(cli.config.as_deref())?;
            let url = config
                .database
                .url
                .as_ref()
                .context("`obx migrate` needs a database: set DATABASE_URL or database.url")?;
            let pool = crate::db::connect(url.expose(), &config.database).await?;
            crate::db::migrate(&pool).await?;
            println!("host schema is up to date");
            Ok(ExitCode::SUCCESS)
        }
        Command::Plugin {
            command: PluginCommand::Check { file, json },
        } => plugin_check(cli.config, file, json).await,
        Command::Plugin {
            command: PluginCommand::New { name, lang, dir },
        } => plugin_new(&name, lang, dir),
        Command::Wit { out } => wit(out),
        Command::Outbox {
            host,
            command:
                OutboxCommand::Replay {
                    from_id,
                    to_id,
                    since,
                    until,
                    aggregate_type,
                    aggregate_id,
                },
        } => {
            let filter = crate::outbox::replay::ReplayFilter {
                from_id,
                to_id,
                since,
                until,
                aggregate_type,
                aggregate_id,
            };
            outbox_replay(cli.config, host, filter).await
        }
        Command::Dlq { host, command } => dlq(cli.config, host, command).await,
        Command::Status { host, json } => status(cli.config, host, json).await,
        Command::Catalog { host, asyncapi, json } => catalog(cli.config, host, asyncapi, json).await,
        Command::Plugin {
            command: PluginCommand::Test { file, json },
        } => plugin_test(cli.config, file, json).await,
    }
}

/// A running host's admin API.
struct Admin {
    base: String,
    token: Option<String>,
    client: reqwest::Client,
}

impl Admin {
    fn new(config: &Config, host: &HostArgs) -> Admin {
        let base = host
            .url
            .clone()
            .unwrap_or_else(|| format!("http://{}", config.http.listen));
        let token = host
            .token
            .clone()
            .or_else(|| config.http.auth.admin_tokens.first().map(|t| t.expose().to_string()));
        Admin {
            base: base.trim_end_matches('/').to_string(),
            token,
            client: reqwest::Client::new(),
        }
    }

    async fn get(&self, path: &str, query: &[(&str, String)]) -> Result<serde_json::Value> {
        self.send(self.client.get(format!("{}{path}", self.base)).query(query))
            .await
    }

    async fn post(&self, path: &str, body: &impl serde::Serialize) -> Result<serde_json::Value> {
        self.send(self.client.post(format!("{}{path}", self.base)).json(body))
            .await
    }

    async fn send(&self, mut request: reqwest::RequestBuilder) -> Result<serde_json::Value> {
        request = request.timeout(std::time::Duration::from_secs(60));
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        let base = &self.base;
        let response = request.send().await.with_context(|| {
            format!(
                "reaching the host at {base} (is it running? For a host that is down, `obx dlq` and \
                 `obx outbox replay` take --direct, with DATABASE_URL)"
            )
        })?;
        let code = response.status();
        let body: serde_json::Value = response
            .json()
            .await
            .with_context(|| format!("reading {base}'s answer"))?;
        if !code.is_success() {
            anyhow::bail!(
                "{base} answered {code}: {}",
                body["error"]["message"].as_str().unwrap_or("?")
            );
        }
        Ok(body)
    }
}

async fn catalog(config: Option<PathBuf>, host: HostArgs, asyncapi: bool, json: bool) -> Result<ExitCode> {
    if host.direct {
        anyhow::bail!("`obx catalog` asks a running host; --direct does not apply to it");
    }
    let config = Config::load(config.as_deref())?;
    let admin = Admin::new(&config, &host);
    let format = if asyncapi { "asyncapi" } else { "json" };
    let body = admin.get("/v1/catalog", &[("format", format.to_string())]).await?;
    if asyncapi || json {
        println!("{}", serde_json::to_string_pretty(&body)?);
        return Ok(ExitCode::SUCCESS);
    }
    let catalog: crate::catalog::Catalog = serde_json::from_value(body).context("reading the catalogue")?;
    if catalog.events.is_empty() {
        println!("no events: no plugin emits or consumes any");
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<[String; 4]> = catalog
        .events
        .iter()
        .map(|e| {
            let consumers: Vec<String> = e
                .consumed_by
                .iter()
                .map(|c| format!("{} ({})", c.plugin, c.mode))
                .collect();
            let or_dash = |s: String| if s.is_empty() { "-".to_string() } else { s };
            [
                e.kafka_topic.clone(),
                e.event_type.clone(),
                or_dash(e.emitted_by.join(", ")),
                or_dash(consumers.join(", ")),
            ]
        })
        .collect();
    print_table(&["topic", "event type", "emitted by", "consumed by"], &rows);
    Ok(ExitCode::SUCCESS)
}

/// Prints rows under a header, each column as wide as its widest cell.
fn print_table<const N: usize>(header: &[&str; N], rows: &[[String; N]]) {
    let mut widths = header.map(str::len);
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: [&str; N]| {
        let padded: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        println!("{}", padded.join("  ").trim_end());
    };
    line(*header);
    for row in rows {
        line(std::array::from_fn(|i| row[i].as_str()));
    }
}

async fn status(config: Option<PathBuf>, host: HostArgs, json: bool) -> Result<ExitCode> {
    if host.direct {
        anyhow::bail!("`obx status` asks a running host; --direct does not apply to it");
    }
    let config = Config::load(config.as_deref())?;
    let admin = Admin::new(&config, &host);
    let base = admin.base.clone();
    let body = admin.get("/v1/status", &[]).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&body)?);
        return Ok(ExitCode::SUCCESS);
    }
    let ready = body["ready"].as_bool().unwrap_or(false);
    println!("OBX at {base}: {}", if ready { "ready" } else { "NOT READY" });
    println!("\nplugins");
    let none = Vec::new();
    for p in body["plugins"].as_array().unwrap_or(&none) {
        let s = |k: &str| p[k].as_str().unwrap_or("-").to_string();
        println!(
            "  {:<16} {:<10} {:<7} loaded {}  file {}",
            s("name"),
            s("version"),
            s("state"),
            s("loaded_at"),
            s("file")
        );
        if let Some(e) = p["last_error"].as_str() {
            println!("    last error: {e}");
        }
    }
    let o = &body["outbox"];
    println!(
        "\noutbox: {} unpublished, oldest {:.1} s, {} rows failing delivery, {} set aside (refused for good)",
        o["backlog"],
        o["oldest_unpublished_seconds"].as_f64().unwrap_or(0.0),
        o["rows_failing"],
        o["rows_set_aside"]
    );
    println!(
        "\nconsumption\n  {:<16} {:>8} {:>8} {:>13} {:>12}",
        "plugin", "lag", "inbox", "dead letters", "quarantined"
    );
    for c in body["consumption"].as_array().unwrap_or(&none) {
        // As strings: a JSON value ignores the width it is printed with.
        let n = |k: &str| c[k].as_i64().map_or_else(|| "-".to_string(), |n| n.to_string());
        println!(
            "  {:<16} {:>8} {:>8} {:>13} {:>12}",
            c["plugin"].as_str().unwrap_or("?"),
            n("lag"),
            n("inbox_backlog"),
            n("dead_letters"),
            n("quarantined")
        );
    }
    Ok(if ready { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

async fn plugin_test(config: Option<PathBuf>, file: PathBuf, json: bool) -> Result<ExitCode> {
    let config = Config::load(config.as_deref())?;
    let checks = crate::conformance::run(&file, &config).await?;
    let passed = checks.iter().all(|c| c.passed);
    if json {
        println!("{}", serde_json::to_string_pretty(&checks)?);
    } else {
        println!("{}:", file.display());
        for c in &checks {
            println!("  {} {}: {}", if c.passed { "ok  " } else { "FAIL" }, c.rule, c.detail);
        }
        println!("{}", if passed { "conformant" } else { "NOT conformant" });
    }
    Ok(if passed { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// Where an admin command goes: a host's API, or the database itself.
enum Target {
    Host(Admin),
    Database(PgPool),
}

impl Target {
    async fn of(config: &Config, host: &HostArgs) -> Result<Target> {
        if !host.direct {
            return Ok(Target::Host(Admin::new(config, host)));
        }
        let url = config
            .database
            .url
            .as_ref()
            .context("--direct needs the database: set DATABASE_URL or database.url")?;
        Ok(Target::Database(
            crate::db::connect(url.expose(), &config.database).await?,
        ))
    }
}

/// The query of `GET /v1/dlq` and `/v1/quarantine`.
fn dlq_query(plugin: Option<String>, all: bool) -> Vec<(&'static str, String)> {
    let mut query = vec![("all", all.to_string())];
    query.extend(plugin.map(|p| ("plugin", p)));
    query
}

async fn dlq(config: Option<PathBuf>, host: HostArgs, command: DlqCommand) -> Result<ExitCode> {
    use crate::inbox::dlq;
    let config = Config::load(config.as_deref())?;
    let target = Target::of(&config, &host).await?;
    match command {
        DlqCommand::List { plugin, all, json } => {
            let letters: Vec<dlq::DeadLetter> = match &target {
                Target::Database(pool) => dlq::list(pool, plugin.as_deref(), all).await?,
                Target::Host(admin) => {
                    serde_json::from_value(admin.get("/v1/dlq", &dlq_query(plugin.clone(), all)).await?)?
                }
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&letters)?);
            } else if letters.is_empty() {
                println!("no parked events");
            } else {
                println!(
                    "{:>6}  {:<10}  {:<14}  {:<20}  {:>8}  {:>7}  error",
                    "id", "status", "plugin", "key", "attempts", "waiting"
                );
                for d in letters {
                    println!(
                        "{:>6}  {:<10}  {:<14}  {:<20}  {:>8}  {:>7}  {} ({} {})",
                        d.id,
                        d.status,
                        d.consumer,
                        d.partition_key.unwrap_or_default(),
                        d.attempts,
                        d.waiting,
                        d.error,
                        d.event_type,
                        d.event_id
                    );
                }
            }
        }
        DlqCommand::Retry { ids } | DlqCommand::Discard { ids } if ids.is_empty() => {
            anyhow::bail!("give the ids of the dead letters (see `obx dlq list`)");
        }
        DlqCommand::Retry { ids } => {
            for id in ids {
                match &target {
                    Target::Database(pool) => dlq::retry(pool, id).await?,
                    Target::Host(admin) => drop(admin.post(&format!("/v1/dlq/{id}/retry"), &()).await?),
                }
                println!("{id}: sent back for processing");
            }
        }
        DlqCommand::Discard { ids } => {
            for id in ids {
                match &target {
                    Target::Database(pool) => dlq::discard(pool, id).await?,
                    Target::Host(admin) => drop(admin.post(&format!("/v1/dlq/{id}/discard"), &()).await?),
                }
                println!("{id}: discarded");
            }
        }
        DlqCommand::Quarantine { plugin, json } => {
            let rows: Vec<dlq::Quarantined> = match &target {
                Target::Database(pool) => dlq::quarantined(pool, plugin.as_deref()).await?,
                Target::Host(admin) => {
                    serde_json::from_value(admin.get("/v1/quarantine", &dlq_query(plugin.clone(), false)).await?)?
                }
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else if rows.is_empty() {
                println!("no quarantined messages");
            } else {
                for q in rows {
                    println!(
                        "{:>6}  {}  {}[{}]@{}  {}",
                        q.id, q.consumer, q.topic, q.kafka_partition, q.kafka_offset, q.reason
                    );
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn outbox_replay(
    config: Option<PathBuf>,
    host: HostArgs,
    filter: crate::outbox::replay::ReplayFilter,
) -> Result<ExitCode> {
    let config = Config::load(config.as_deref())?;
    if !host.direct {
        if filter.is_empty() {
            anyhow::bail!(crate::outbox::replay::NO_FILTER);
        }
        let answer = Admin::new(&config, &host).post("/v1/outbox/replay", &filter).await?;
        println!("replayed {} events", answer["replayed"]);
        return Ok(ExitCode::SUCCESS);
    }
    let url = config
        .database
        .url
        .as_ref()
        .context("replay needs a database: set DATABASE_URL or database.url")?;
    if config.kafka.brokers.trim().is_empty() {
        anyhow::bail!("replay needs brokers: set KAFKA_BROKERS or kafka.brokers");
    }
    let pool = crate::db::connect(url.expose(), &config.database).await?;
    let brokers = crate::kafka::Brokers::start(&config.kafka)?;
    let producer = crate::outbox::relay::producer(
        &brokers,
        &config.kafka,
        config.relay.linger_ms,
        Some(std::time::Duration::from_secs(30)),
    )?;
    let sent = crate::outbox::replay::replay(&pool, &producer, &config.kafka, &filter).await?;
    println!("replayed {sent} events");
    Ok(ExitCode::SUCCESS)
}

fn plugin_new(name: &str, language: crate::scaffold::Language, dir: Option<PathBuf>) -> Result<ExitCode> {
    let dir = dir.unwrap_or_else(|| PathBuf::from(name));
    let files = crate::scaffold::new_project(name, language, &dir)?;
    println!("made plugin {name} in {}:", dir.display());
    for f in files {
        println!("  {}", f.display());
    }
    println!(
        "next: cd {} && ./test.sh   (builds {name}.wasm and runs `obx plugin test` on it)",
        dir.display()
    );
    Ok(ExitCode::SUCCESS)
}

fn wit(out: Option<PathBuf>) -> Result<ExitCode> {
    match out {
        None => print!("{}", crate::scaffold::WIT),
        Some(dir) => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let path = dir.join("obx.wit");
            std::fs::write(&path, crate::scaffold::WIT).with_context(|| format!("writing {}", path.display()))?;
            println!(
                "wrote {} (obx:plugin@{})",
                path.display(),
                crate::scaffold::wit_version()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn plugin_check(config: Option<PathBuf>, file: PathBuf, json: bool) -> Result<ExitCode> {
    let config = Config::load(config.as_deref())?;
    let bytes = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
    // Offline: no database, no broker. It shares the host's compile cache, so a second check
    // of a file is quick.
    let runtime = crate::runtime::Runtime::new(config.limits, config.plugins.cache_settings())?;
    let started = std::time::Instant::now();
    match crate::runtime::loader::load(&runtime, bytes).await {
        Ok(plugin) => {
            let m = &plugin.manifest;
            if json {
                println!("{}", serde_json::to_string_pretty(m)?);
            } else {
                println!("{}: ok", file.display());
                println!("  plugin        {} {}", m.name, m.version);
                println!("  sha256        {}", plugin.sha256);
                println!(
                    "  compiled      {} ({:.1} s)",
                    if plugin.from_cache {
                        "from the compile cache"
                    } else {
                        "now"
                    },
                    started.elapsed().as_secs_f64()
                );
                println!("  commands      {}", m.commands.join(", "));
                for s in &m.subscriptions {
                    let types = if s.event_types.is_empty() {
                        "*".to_string()
                    } else {
                        s.event_types.join(", ")
                    };
                    println!("  subscription  {} [{types}] ({:?})", s.topic, s.mode);
                }
                for mig in &m.migrations {
                    println!(
                        "  migration     {} {} ({} statements)",
                        mig.id,
                        mig.name,
                        mig.statements.len()
                    );
                }
                for p in &m.payloads {
                    let example = if p.example.is_some() { ", with an example" } else { "" };
                    println!(
                        "  payload       {} on {}: a JSON Schema{example}",
                        p.event_type, p.topic
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("{}: {e}", file.display());
            Ok(ExitCode::FAILURE)
        }
    }
}

/// SIGTERM and SIGINT, as one stream.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    async fn next(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}

/// `obx config check`: loads and validates the configuration as `serve` would, offline.
fn config_check(file: Option<PathBuf>, print: bool) -> Result<ExitCode> {
    match Config::load(file.as_deref()) {
        Ok(config) => {
            if print {
                // Secrets serialize as "[redacted]".
                print!(
                    "{}",
                    toml::to_string_pretty(&config).context("printing the configuration")?
                );
            } else {
                println!("configuration is valid");
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("error: {e}");
            Ok(ExitCode::FAILURE)
        }
    }
}
