//! `obx plugin test FILE`: a conformance check any component can be put through, whatever
//! language it was written in. It checks that
//!
//! 1. the file is a component of the `obx:plugin/plugin` world and its manifest is valid;
//! 2. the plugin's migrations apply cleanly to an empty schema;
//! 3. every declared command answers (ok, or a typed error) to an empty payload, without
//!    trapping, within the deadline;
//! 4. an undeclared command gets a typed error, not a trap;
//! 5. every subscription's handler answers (ok, or a typed error) to an empty event;
//! 6. every consumed event with a declared payload schema is handled with `ok` when its
//!    payload is valid: the declared example, or a sample built from the schema.
//!
//! It runs against a scratch database it creates and drops: on the configured server, or on
//! a throwaway Postgres when none is configured. Nothing is committed.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use sqlx::PgPool;

use crate::config::Config;
use crate::db::embedded::EmbeddedPostgres;
use crate::db::sessions::Sessions;
use crate::dispatch::CommandError;
use crate::runtime::bindings::guest;
use crate::runtime::cache::CacheSettings;
use crate::runtime::{loader, CallError, Plugin, Runtime};

/// One rule, and whether the component keeps it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Check {
    pub rule: String,
    pub passed: bool,
    pub detail: String,
}

impl Check {
    fn pass(rule: impl Into<String>, detail: impl Into<String>) -> Check {
        Check {
            rule: rule.into(),
            passed: true,
            detail: detail.into(),
        }
    }
    fn fail(rule: impl Into<String>, detail: impl Into<String>) -> Check {
        Check {
            rule: rule.into(),
            passed: false,
            detail: detail.into(),
        }
    }
}

/// Runs every check that applies; stops early only when the component cannot be loaded.
pub async fn run(file: &Path, config: &Config) -> Result<Vec<Check>> {
    let mut checks = Vec::new();
    let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    let runtime = Runtime::new(config.limits.clone(), CacheSettings::of(&config.plugins))?;
    let plugin = match loader::load(&runtime, bytes, loader::SLOT_WAIT).await {
        Ok(p) => {
            let m = &p.manifest;
            checks.push(Check::pass(
                "component, world and manifest",
                format!(
                    "{} {}: {} commands, {} subscriptions, {} migrations",
                    m.name,
                    m.version,
                    m.commands.len(),
                    m.subscriptions.len(),
                    m.migrations.len()
                ),
            ));
            p
        }
        Err(e) => {
            checks.push(Check::fail("component, world and manifest", e.to_string()));
            return Ok(checks);
        }
    };

    let scratch = Scratch::create(config).await?;
    let result = check_with_database(&runtime, &plugin, &scratch, &mut checks).await;
    scratch.drop().await;
    result?;
    Ok(checks)
}

async fn check_with_database(
    runtime: &Arc<Runtime>,
    plugin: &Plugin,
    scratch: &Scratch,
    checks: &mut Vec<Check>,
) -> Result<()> {
    let sessions = &scratch.sessions;
    match crate::runtime::plugin_schema::prepare(&scratch.pool, sessions, &plugin.manifest, runtime.limits()).await {
        Ok(()) => checks.push(Check::pass(
            "migrations apply to an empty schema",
            format!("{} applied", plugin.manifest.migrations.len()),
        )),
        Err(e) => {
            checks.push(Check::fail("migrations apply to an empty schema", e.to_string()));
            return Ok(());
        }
    }
    for command in &plugin.manifest.commands {
        let outcome = call_command(runtime, plugin, sessions, command).await?;
        checks.push(match outcome {
            Ok(answer) => Check::pass(format!("command {command} answers"), answer),
            Err(problem) => Check::fail(format!("command {command} answers"), problem),
        });
    }
    let unknown = "obx-conformance-undeclared";
    let outcome = call_command(runtime, plugin, sessions, unknown).await?;
    checks.push(match outcome {
        Ok(answer) if answer.starts_with("typed error") => {
            Check::pass("an undeclared command gets a typed error", answer)
        }
        Ok(answer) => Check::fail(
            "an undeclared command gets a typed error",
            format!("it answered {answer}"),
        ),
        Err(problem) => Check::fail("an undeclared command gets a typed error", problem),
    });
    for subscription in &plugin.manifest.subscriptions {
        let event_type = subscription
            .event_types
            .first()
            .cloned()
            .unwrap_or_else(|| "ConformanceProbe".into());
        let result = call_event(runtime, plugin, sessions, &subscription.topic, &event_type, "{}".into()).await?;
        let rule = format!("events of {} ({event_type}) are handled", subscription.topic);
        checks.push(match result {
            Ok(()) => Check::pass(rule, "ok".to_string()),
            Err(CallError::Handler(e)) => Check::pass(rule, format!("typed error: {}", CommandError::from(e).code())),
            Err(e) => Check::fail(rule, describe(e)),
        });
    }
    check_valid_events(runtime, plugin, sessions, checks).await
}

/// Every consumed event with a declared schema gets a payload that matches it (the declared
/// example, or a sample built from the schema) and must be handled with `ok`: a handler
/// that refuses a valid event would park real ones.
async fn check_valid_events(
    runtime: &Arc<Runtime>,
    plugin: &Plugin,
    sessions: &Sessions,
    checks: &mut Vec<Check>,
) -> Result<()> {
    let consumed = plugin
        .manifest
        .payloads
        .iter()
        .filter(|p| plugin.manifest.consumes(&p.topic, &p.event_type));
    for p in consumed {
        let rule = format!("a valid {} on {} is handled with ok", p.event_type, p.topic);
        let (payload, source) = match (&p.example, crate::runtime::contract::sample(&p.schema)) {
            (Some(example), _) => (example.clone(), "the declared example"),
            (None, Some(sample)) => (sample, "a sample built from the schema"),
            (None, None) => {
                checks.push(Check::pass(
                    rule,
                    "not checked: no example, and the schema asks for more than a sample has; declare an example",
                ));
                continue;
            }
        };
        let result = call_event(runtime, plugin, sessions, &p.topic, &p.event_type, payload.to_string()).await?;
        checks.push(match result {
            Ok(()) => Check::pass(rule, format!("ok, with {source}")),
            Err(CallError::Handler(e)) => {
                let code = CommandError::from(e).code();
                let fate = if code == "handler_failed" {
                    "retried, then parked"
                } else {
                    "parked at once"
                };
                Check::fail(
                    rule,
                    format!(
                        "{source} got {code}: in `obx serve` a real {} like it would be {fate}, holding up its key",
                        p.event_type
                    ),
                )
            }
            Err(e) => Check::fail(rule, describe(e)),
        });
    }
    Ok(())
}

/// Calls `handle-event` with one event in a transaction that is rolled back.
async fn call_event(
    runtime: &Arc<Runtime>,
    plugin: &Plugin,
    sessions: &Sessions,
    topic: &str,
    event_type: &str,
    payload: String,
) -> Result<Result<(), CallError>> {
    let event = guest::Event {
        event_id: uuid::Uuid::new_v4().to_string(),
        event_type: event_type.into(),
        topic: topic.into(),
        key: Some("conformance".into()),
        payload,
        headers: vec![],
        attempt: 1,
    };
    let tx = sessions.begin(&plugin.manifest.name).await?;
    let out = runtime.handle_event(plugin, tx, event, None).await;
    if let Some(tx) = out.tx {
        let _ = tx.rollback().await;
    }
    Ok(out.result)
}

/// Calls one command with `{}`; `Ok` with what it answered, or `Err` with why that breaks
/// the contract.
async fn call_command(
    runtime: &Arc<Runtime>,
    plugin: &Plugin,
    sessions: &Sessions,
    name: &str,
) -> Result<Result<String, String>> {
    let tx = sessions.begin(&plugin.manifest.name).await?;
    let command = guest::Command {
        name: name.into(),
        payload: "{}".into(),
        request_id: "conformance".into(),
    };
    let out = runtime.handle_command(plugin, tx, command, None).await;
    if let Some(tx) = out.tx {
        let _ = tx.rollback().await;
    }
    Ok(match out.result {
        Ok(response) => match serde_json::from_str::<serde::de::IgnoredAny>(&response) {
            Ok(_) => Ok("ok".into()),
            Err(e) => Err(format!("the response is not JSON: {e}")),
        },
        Err(CallError::Handler(e)) => Ok(format!("typed error: {}", CommandError::from(e).code())),
        Err(e) => Err(describe(e)),
    })
}

fn describe(e: CallError) -> String {
    match CommandError::from(e) {
        CommandError::Deadline => "it ran past the deadline".into(),
        CommandError::Trapped(detail) => format!("it trapped: {}", first_line(&detail)),
        CommandError::MemoryLimit(detail) => format!("it exceeded the memory limit: {}", first_line(&detail)),
        CommandError::Aborted(detail) => format!("it returned ok after a failed statement: {detail}"),
        other => other.to_string(),
    }
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or(s)
}

/// A database created for the check and dropped after it, with the plugin roles it made.
struct Scratch {
    pool: PgPool,
    sessions: Sessions,
    admin: PgPool,
    name: String,
    _embedded: Option<EmbeddedPostgres>,
}

impl Scratch {
    async fn create(config: &Config) -> Result<Scratch> {
        let (admin_url, embedded) = match &config.database.url {
            Some(url) => (url.expose().to_string(), None),
            None => {
                let pg = tokio::task::spawn_blocking(|| EmbeddedPostgres::start(&[])).await??;
                (pg.url("postgres"), Some(pg))
            }
        };
        let admin = PgPool::connect(&admin_url)
            .await
            .context("connecting to Postgres for the scratch database")?;
        let name = format!("obx_conformance_{}", uuid::Uuid::new_v4().simple());
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&admin)
            .await
            .context("creating the scratch database")?;
        let url = match admin_url.rsplit_once('/') {
            Some((base, rest)) => {
                let query = rest.split_once('?').map(|(_, q)| format!("?{q}")).unwrap_or_default();
                format!("{base}/{name}{query}")
            }
            None => anyhow::bail!("cannot tell the database from the URL"),
        };
        let pool = crate::db::connect(&url, &config.database).await?;
        crate::db::migrate(&pool).await?;
        let sessions = Sessions::new(&url, pool.clone(), &config.database)?;
        Ok(Scratch {
            sessions,
            pool,
            admin,
            name,
            _embedded: embedded,
        })
    }

    async fn drop(self) {
        // Roles belong to the whole cluster: drop the scratch installation's with it.
        let roles: Vec<String> = sqlx::query_scalar("SELECT role_name FROM obx.plugin")
            .fetch_all(&self.pool)
            .await
            .unwrap_or_default();
        self.sessions.close().await;
        self.pool.close().await;
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name))
            .execute(&self.admin)
            .await;
        for role in roles {
            let _ = sqlx::query(&format!("DROP ROLE IF EXISTS \"{}\"", role.replace('"', "\"\"")))
                .execute(&self.admin)
                .await;
        }
        self.admin.close().await;
    }
}
