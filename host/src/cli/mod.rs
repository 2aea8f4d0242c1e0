//! The `obx` command line: its arguments, and `serve`, `migrate` and `config check`. The
//! commands that talk to a running host are in `admin`, the plugin author's in `plugin`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

use crate::config::Config;

mod admin;
mod plugin;

use admin::{catalog, dlq, outbox_replay, status, timers};
use plugin::{plugin_check, plugin_new, plugin_release_event, plugin_test, wit};

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
    /// Durable timers: list them, cancel one, send a parked one back to fire. Through the
    /// running host's admin API, or the database with --direct.
    Timers {
        #[command(flatten)]
        host: HostArgs,
        #[command(subcommand)]
        command: TimersCommand,
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
enum TimersCommand {
    /// Lists timers, earliest due first, a page at a time.
    List {
        /// Only this plugin's.
        #[arg(long)]
        plugin: Option<String>,
        /// Only parked ones (their handler kept failing).
        #[arg(long)]
        parked: bool,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        page: PageArgs,
    },
    /// Cancels a timer, pending or parked: it never fires.
    Cancel { plugin: String, name: String, key: String },
    /// Sends a parked timer back to fire now, its attempts reset.
    Retry { plugin: String, name: String, key: String },
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
        #[command(flatten)]
        page: PageArgs,
    },
    /// Sends parked events back to be processed, attempts reset; their keys follow in order.
    Retry { ids: Vec<i64> },
    /// Marks parked events processed without running them; their keys move on.
    Discard {
        ids: Vec<i64>,
        /// Every parked event of this plugin instead of ids, a thousand to a transaction.
        #[arg(long, value_name = "PLUGIN", conflicts_with = "ids")]
        parked: Option<String>,
    },
    /// Lists quarantined messages (not events: no eventId, not JSON, ...), newest first.
    Quarantine {
        #[arg(long)]
        plugin: Option<String>,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        page: PageArgs,
    },
}

/// Which page of a list to print. A list longer than a page ends with the `--after` that
/// prints the next one (on stderr, so that `--json` stays one array).
#[derive(clap::Args)]
struct PageArgs {
    /// Start past this point of the list: the cursor the previous page ended with.
    #[arg(long)]
    after: Option<String>,
    /// At most this many rows (1 to 1,000; 1,000 if not given).
    #[arg(long)]
    limit: Option<i64>,
}

impl PageArgs {
    fn request(&self) -> crate::paging::PageRequest {
        crate::paging::PageRequest {
            after: self.after.clone(),
            limit: self.limit,
        }
    }
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
        /// The rows the relay set aside (refused for good) instead of published ones: each is
        /// sent after its key's later events, and marked published once acknowledged.
        #[arg(long)]
        set_aside: bool,
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
    /// Frees an event type a plugin declared, so that another plugin may declare it (an
    /// event type on a topic is one plugin's, for every version of it ever loaded). On the
    /// database (DATABASE_URL). First run no version of the plugin that emits it: from then
    /// on its emits of it are refused, and a host that loads a version still declaring it
    /// takes it back while it is free.
    ReleaseEvent {
        plugin: String,
        topic: String,
        event_type: String,
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
            let pool = database(&config, "`obx migrate`").await?;
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
        Command::Plugin {
            command:
                PluginCommand::ReleaseEvent {
                    plugin,
                    topic,
                    event_type,
                },
        } => plugin_release_event(cli.config, &plugin, &topic, &event_type).await,
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
                    set_aside,
                },
        } => {
            let filter = crate::outbox::replay::ReplayFilter {
                from_id,
                to_id,
                since,
                until,
                aggregate_type,
                aggregate_id,
                set_aside,
            };
            outbox_replay(cli.config, host, filter).await
        }
        Command::Dlq { host, command } => dlq(cli.config, host, command).await,
        Command::Timers { host, command } => timers(cli.config, host, command).await,
        Command::Status { host, json } => status(cli.config, host, json).await,
        Command::Catalog { host, asyncapi, json } => catalog(cli.config, host, asyncapi, json).await,
        Command::Plugin {
            command: PluginCommand::Test { file, json },
        } => plugin_test(cli.config, file, json).await,
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

/// The configured database, for a command that works on it (`command` names it in the error
/// when none is configured).
async fn database(config: &Config, command: &str) -> Result<sqlx::PgPool> {
    let url = config
        .database
        .url
        .as_ref()
        .with_context(|| format!("{command} needs the database: set DATABASE_URL or database.url"))?;
    crate::db::connect(url.expose(), &config.database).await
}

/// `obx config check`: loads and validates the configuration as `serve` would, offline.
fn config_check(file: Option<PathBuf>, print: bool) -> Result<ExitCode> {
    match Config::load(file.as_deref()) {
        Ok(config) => {
            for advice in config.advice() {
                eprintln!("warning: {advice}");
            }
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
