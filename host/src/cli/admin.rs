//! The commands that ask a running host through its admin API (`obx status`, `obx catalog`,
//! `obx dlq`, `obx outbox replay`), or, with `--direct`, the database itself.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use sqlx::PgPool;

use super::{DlqCommand, HostArgs, PageArgs, TimersCommand};
use crate::config::Config;
use crate::paging::Page;

/// A running host's admin API.
struct Admin {
    base: String,
    token: Option<String>,
    client: reqwest::Client,
    /// How long an answer may take: the host answers within `http.request_timeout`, or, for
    /// a request whose work was committing, within a second timeout.
    timeout: std::time::Duration,
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
            timeout: config.http.request_timeout * 2 + std::time::Duration::from_secs(10),
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

    /// A page of the list at `path`, its filter in `query`: the rows, and the cursor of the
    /// next page from the answer's `Link` header.
    async fn page<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        mut query: Vec<(&'static str, String)>,
        page: &PageArgs,
    ) -> Result<Page<T>> {
        query.extend(page.after.clone().map(|a| ("after", a)));
        query.extend(page.limit.map(|n| ("limit", n.to_string())));
        let request = self.client.get(format!("{}{path}", self.base)).query(&query);
        let (body, headers) = self.send_for_headers(request).await?;
        let rows = serde_json::from_value(body).with_context(|| format!("reading {}'s list", self.base))?;
        let next = headers
            .get(reqwest::header::LINK)
            .and_then(|v| v.to_str().ok())
            .and_then(next_cursor);
        Ok(Page { rows, next })
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> Result<serde_json::Value> {
        Ok(self.send_for_headers(request).await?.0)
    }

    async fn send_for_headers(
        &self,
        mut request: reqwest::RequestBuilder,
    ) -> Result<(serde_json::Value, reqwest::header::HeaderMap)> {
        request = request.timeout(self.timeout);
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
        let headers = response.headers().clone();
        let text = response
            .text()
            .await
            .with_context(|| format!("reading {base}'s answer ({code})"))?;
        let body = serde_json::from_str::<serde_json::Value>(&text);
        if !code.is_success() {
            // The host's errors are JSON; a proxy's, or the HTTP layer's, may not be.
            let message = match &body {
                Ok(body) => body["error"]["message"].as_str().unwrap_or("?").to_string(),
                Err(_) => text.chars().take(200).collect::<String>().trim().to_string(),
            };
            anyhow::bail!("{base} answered {code}: {message}");
        }
        let body = body.with_context(|| format!("reading {base}'s answer: it is not JSON"))?;
        Ok((body, headers))
    }
}

/// The cursor `after` of a `Link: <...>; rel="next"` header's address.
fn next_cursor(link: &str) -> Option<String> {
    let address = link.split_once('<')?.1.split_once('>')?.0;
    let query = address.split_once('?')?.1;
    url::form_urlencoded::parse(query.as_bytes())
        .find(|(k, _)| k == "after")
        .map(|(_, v)| v.into_owned())
}

/// After a page of a list: how to print the next one, if there is one.
fn say_more(next: Option<&str>, command: &str) {
    if let Some(after) = next {
        eprintln!("(more past these: `{command} --after {after}`, with the same filters)");
    }
}

pub(super) async fn catalog(config: Option<PathBuf>, host: HostArgs, asyncapi: bool, json: bool) -> Result<ExitCode> {
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

pub(super) async fn status(config: Option<PathBuf>, host: HostArgs, json: bool) -> Result<ExitCode> {
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
        "\noutbox: {} unpublished, oldest {:.1} s, {} rows failing delivery, {} set aside (refused for good), \
         {} delayed (not due yet)",
        o["backlog"],
        o["oldest_unpublished_seconds"].as_f64().unwrap_or(0.0),
        o["rows_failing"],
        o["rows_set_aside"],
        o["delayed"]
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
        Ok(Target::Database(super::database(config, "--direct").await?))
    }
}

/// The filter of a list's query: `GET /v1/dlq` and `/v1/quarantine` (`all`), `/v1/timers`
/// (`parked`).
fn list_query((flag, on): (&'static str, bool), plugin: Option<String>) -> Vec<(&'static str, String)> {
    let mut query = vec![(flag, on.to_string())];
    query.extend(plugin.map(|p| ("plugin", p)));
    query
}

/// Discards the parked events of `plugin` up to the highest parked when it begins, a batch
/// to a transaction, until a batch comes back short; the number discarded. On an error, what
/// the batches before it discarded is said first: they are committed.
async fn discard_parked(target: &Target, plugin: &str) -> Result<u64> {
    let (mut total, mut through) = (0, None);
    loop {
        let batch = discard_batch(target, plugin, through).await;
        let done = match batch {
            Ok(done) => done,
            Err(e) if total > 0 => return Err(e.context(format!("{total} parked events were discarded before"))),
            Err(e) => return Err(e),
        };
        total += done.discarded;
        through = Some(done.through);
        if !done.more {
            return Ok(total);
        }
    }
}

async fn discard_batch(target: &Target, plugin: &str, through: Option<i64>) -> Result<crate::inbox::dlq::Discarded> {
    match target {
        Target::Database(pool) => Ok(crate::inbox::dlq::discard_parked(pool, plugin, through).await?),
        Target::Host(admin) => {
            let mut query = url::form_urlencoded::Serializer::new(String::new());
            query.append_pair("plugin", plugin);
            if let Some(through) = through {
                query.append_pair("through", &through.to_string());
            }
            let answer = admin.post(&format!("/v1/dlq/discard?{}", query.finish()), &()).await?;
            serde_json::from_value(answer).context("reading the host's answer")
        }
    }
}

pub(super) async fn dlq(config: Option<PathBuf>, host: HostArgs, command: DlqCommand) -> Result<ExitCode> {
    use crate::inbox::dlq;
    let config = Config::load(config.as_deref())?;
    let target = Target::of(&config, &host).await?;
    match command {
        DlqCommand::List {
            plugin,
            all,
            json,
            page,
        } => {
            let Page { rows: letters, next } = match &target {
                Target::Database(pool) => dlq::list(pool, plugin.as_deref(), all, &page.request()).await?,
                Target::Host(admin) => {
                    admin
                        .page("/v1/dlq", list_query(("all", all), plugin.clone()), &page)
                        .await?
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
            say_more(next.as_deref(), "obx dlq list");
        }
        DlqCommand::Discard {
            parked: Some(plugin), ..
        } => {
            let total = discard_parked(&target, &plugin).await?;
            println!("{plugin}: {total} parked events discarded");
        }
        DlqCommand::Retry { ids } | DlqCommand::Discard { ids, .. } if ids.is_empty() => {
            anyhow::bail!("give the ids of the dead letters (see `obx dlq list`), or --parked PLUGIN to discard");
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
        DlqCommand::Discard { ids, .. } => {
            for id in ids {
                match &target {
                    Target::Database(pool) => dlq::discard(pool, id).await?,
                    Target::Host(admin) => drop(admin.post(&format!("/v1/dlq/{id}/discard"), &()).await?),
                }
                println!("{id}: discarded");
            }
        }
        DlqCommand::Quarantine { plugin, json, page } => {
            let Page { rows, next } = match &target {
                Target::Database(pool) => dlq::quarantined(pool, plugin.as_deref(), &page.request()).await?,
                Target::Host(admin) => {
                    admin
                        .page("/v1/quarantine", list_query(("all", false), plugin.clone()), &page)
                        .await?
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
            say_more(next.as_deref(), "obx dlq quarantine");
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub(super) async fn timers(config: Option<PathBuf>, host: HostArgs, command: TimersCommand) -> Result<ExitCode> {
    use crate::timers::{self, TimerId, TimerRow};
    let config = Config::load(config.as_deref())?;
    let target = Target::of(&config, &host).await?;
    match command {
        TimersCommand::List {
            plugin,
            parked,
            json,
            page,
        } => {
            let Page { rows, next } = match &target {
                Target::Database(pool) => timers::list(pool, plugin.as_deref(), parked, &page.request()).await?,
                Target::Host(admin) => {
                    let query = list_query(("parked", parked), plugin.clone());
                    admin.page::<TimerRow>("/v1/timers", query, &page).await?
                }
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else if rows.is_empty() {
                println!("no timers");
            } else {
                let cells: Vec<[String; 6]> = rows
                    .into_iter()
                    .map(|t| {
                        let state = if t.parked_at.is_some() { "parked" } else { "pending" };
                        [
                            t.plugin,
                            t.name,
                            t.key,
                            t.due_at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                            format!("{state} ({} failed)", t.attempts),
                            t.last_error.unwrap_or_default(),
                        ]
                    })
                    .collect();
                print_table(&["plugin", "name", "key", "due", "state", "last error"], &cells);
            }
            say_more(next.as_deref(), "obx timers list");
        }
        TimersCommand::Cancel { plugin, name, key } | TimersCommand::Retry { plugin, name, key }
            if plugin.is_empty() || name.is_empty() || key.is_empty() =>
        {
            anyhow::bail!("give the timer's plugin, name and key (see `obx timers list`)");
        }
        TimersCommand::Cancel { plugin, name, key } => {
            let id = TimerId { plugin, name, key };
            let found = match &target {
                Target::Database(pool) => timers::cancel(pool, &id).await?,
                Target::Host(admin) => admin.post("/v1/timers/cancel", &id).await.map(|_| true)?,
            };
            anyhow::ensure!(found, "no timer {} {} {}", id.plugin, id.name, id.key);
            println!("{} {} {}: cancelled", id.plugin, id.name, id.key);
        }
        TimersCommand::Retry { plugin, name, key } => {
            let id = TimerId { plugin, name, key };
            let found = match &target {
                Target::Database(pool) => timers::retry(pool, &id).await?,
                Target::Host(admin) => admin.post("/v1/timers/retry", &id).await.map(|_| true)?,
            };
            anyhow::ensure!(found, "no parked timer {} {} {}", id.plugin, id.name, id.key);
            println!("{} {} {}: sent back to fire now", id.plugin, id.name, id.key);
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub(super) async fn outbox_replay(
    config: Option<PathBuf>,
    host: HostArgs,
    filter: crate::outbox::replay::ReplayFilter,
) -> Result<ExitCode> {
    let config = Config::load(config.as_deref())?;
    if !host.direct {
        if filter.is_empty() {
            anyhow::bail!(crate::outbox::replay::NO_FILTER);
        }
        // In parts: each answer says where the rest begins.
        let admin = Admin::new(&config, &host);
        let (mut filter, mut sent, mut refused) = (filter, 0, 0);
        loop {
            let answer = admin.post("/v1/outbox/replay?parts=true", &filter).await;
            let answer = match (answer, filter.from_id) {
                (Ok(answer), _) => answer,
                (Err(e), Some(from)) if sent > 0 => {
                    return Err(e.context(format!("{sent} events were replayed; to go on, add --from-id {from}")));
                }
                (Err(e), _) => return Err(e),
            };
            sent += answer["replayed"].as_u64().unwrap_or(0);
            refused += answer["refused"].as_u64().unwrap_or(0);
            match answer["next_from_id"].as_i64() {
                Some(next) if answer["done"] == false => filter.from_id = Some(next),
                _ => break,
            }
        }
        println!("replayed {sent} events");
        if refused > 0 {
            eprintln!("the broker refused {refused} rows set aside again: they stay set aside (see the host's log)");
            return Ok(ExitCode::FAILURE);
        }
        return Ok(ExitCode::SUCCESS);
    }
    if config.database.url.is_none() {
        anyhow::bail!("replay needs the database: set DATABASE_URL or database.url");
    }
    if config.kafka.brokers.trim().is_empty() {
        anyhow::bail!("replay needs brokers: set KAFKA_BROKERS or kafka.brokers");
    }
    let pool = super::database(&config, "replay").await?;
    let brokers = crate::kafka::Brokers::start(&config.kafka)?;
    let producer = crate::outbox::relay::producer(
        &brokers,
        &config.kafka,
        &config.relay,
        Some(std::time::Duration::from_secs(30)),
    )?;
    let sent =
        crate::outbox::replay::replay(&pool, &producer, &config.kafka, &filter, config.relay.batch_max_bytes).await?;
    println!("replayed {sent} events");
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::next_cursor;

    #[test]
    fn the_next_pages_cursor_is_read_from_the_link_header() {
        let link = r#"</v1/timers?parked=false&plugin=a+b&after=7b2278227d>; rel="next""#;
        assert_eq!(next_cursor(link).as_deref(), Some("7b2278227d"));
        assert_eq!(
            next_cursor("</v1/dlq?after=12%2B3>; rel=\"next\"").as_deref(),
            Some("12+3")
        );
        assert_eq!(next_cursor("</v1/dlq?all=true>; rel=\"next\""), None);
        assert_eq!(next_cursor("garbage"), None);
    }
}
