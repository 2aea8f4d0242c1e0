//! Hot loading from the watched plugin directory: drop, replace and delete with no restart;
//! invalid and half-written files; a replace under load; a failing migration; consumers that
//! follow the new manifest.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use obx_tests::{eventually, peak_rss, plugin, producer, reset_peak_rss, send_event, spawn_host_with, Gate, TestHost};
use serde_json::{json, Value};

/// Deploys a component the recommended way: write to a temporary name, then rename.
fn deploy(host: &TestHost, component: &str, as_name: &str) {
    let dir = host.plugin_dir.path();
    let tmp = dir.join(format!(".{as_name}.tmp"));
    std::fs::copy(plugin(component), &tmp).unwrap();
    std::fs::rename(&tmp, dir.join(as_name)).unwrap();
}

async fn watched_host() -> TestHost {
    spawn_host_with(&[], |c| {
        c.plugins.debounce = Duration::from_millis(100);
    })
    .await
}

async fn version(host: &TestHost) -> Option<String> {
    let a = host.command("hotswap", "version", json!({})).await;
    a.body["version"].as_str().map(String::from)
}

async fn status(host: &TestHost, file: &str) -> Value {
    let list = host.get("/v1/plugins").await.body;
    list["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["file"].as_str().is_some_and(|f| f.ends_with(file)))
        .cloned()
        .unwrap_or(Value::Null)
}

async fn serving(host: &TestHost, expected: &str) {
    eventually(
        Duration::from_secs(20),
        &format!("version {expected} serving"),
        || async { version(host).await.as_deref() == Some(expected) },
    )
    .await;
}

async fn unloaded(host: &TestHost) {
    eventually(Duration::from_secs(20), "hotswap unloaded", || async {
        host.command("hotswap", "version", json!({})).await.code() == "unknown_plugin"
    })
    .await;
}

#[tokio::test]
async fn drop_replace_and_delete_without_a_restart() {
    let host = watched_host().await;
    assert_eq!(
        host.command("hotswap", "version", json!({})).await.code(),
        "unknown_plugin"
    );

    deploy(&host, "hotswap", "hotswap.wasm");
    serving(&host, "1.0.0").await;
    let s = status(&host, "hotswap.wasm").await;
    assert_eq!(
        (s["state"].as_str(), s["version"].as_str()),
        (Some("active"), Some("1.0.0"))
    );
    assert_eq!(s["sha256"].as_str().unwrap().len(), 64);
    assert!(s["loaded_at"].is_string());
    assert_eq!(s["commands"], json!(["version", "work"]));

    deploy(&host, "hotswap_v2", "hotswap.wasm");
    serving(&host, "2.0.0").await;
    assert_eq!(
        host.count("SELECT count(*) FROM obx.plugin_migration WHERE plugin = 'hotswap'")
            .await,
        2
    );

    std::fs::remove_file(host.plugin_dir.path().join("hotswap.wasm")).unwrap();
    unloaded(&host).await;
    assert!(status(&host, "hotswap.wasm").await.is_null());
    host.shutdown().await;
}

#[tokio::test]
async fn an_invalid_file_is_reported_and_changes_nothing() {
    let host = watched_host().await;
    deploy(&host, "hotswap", "hotswap.wasm");
    serving(&host, "1.0.0").await;
    std::fs::write(host.plugin_dir.path().join("garbage.wasm"), b"definitely not wasm").unwrap();
    std::fs::write(host.plugin_dir.path().join("core.wasm"), b"\0asm\x01\0\0\0").unwrap();
    eventually(Duration::from_secs(20), "both failures listed", || async {
        status(&host, "garbage.wasm").await["state"] == "failed"
            && status(&host, "core.wasm").await["state"] == "failed"
    })
    .await;
    let garbage = status(&host, "garbage.wasm").await;
    assert!(
        garbage["last_error"]
            .as_str()
            .unwrap()
            .contains("not a WebAssembly file"),
        "{garbage}"
    );
    assert!(status(&host, "core.wasm").await["last_error"]
        .as_str()
        .unwrap()
        .contains("core WebAssembly module"));
    // An editor's temporary file is not even looked at.
    std::fs::write(host.plugin_dir.path().join(".hotswap.wasm.swp"), b"junk").unwrap();
    std::fs::write(host.plugin_dir.path().join("notes.txt"), b"junk").unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(status(&host, ".hotswap.wasm.swp").await.is_null());
    assert!(status(&host, "notes.txt").await.is_null());
    assert_eq!(version(&host).await.as_deref(), Some("1.0.0"));
    host.shutdown().await;
}

#[tokio::test]
async fn a_half_written_file_never_loads_and_the_old_version_keeps_serving() {
    let host = watched_host().await;
    deploy(&host, "hotswap", "hotswap.wasm");
    serving(&host, "1.0.0").await;

    // Written in place, in two halves with a pause longer than the debounce: the first half
    // is seen, and refused; the old version keeps serving; the whole file then loads.
    let v2 = std::fs::read(plugin("hotswap_v2")).unwrap();
    let target = host.plugin_dir.path().join("hotswap.wasm");
    std::fs::write(&target, &v2[..v2.len() / 2]).unwrap();
    eventually(Duration::from_secs(20), "the half file refused", || async {
        status(&host, "hotswap.wasm").await["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("failed to compile"))
    })
    .await;
    assert_eq!(version(&host).await.as_deref(), Some("1.0.0"), "the old version serves");
    assert_eq!(status(&host, "hotswap.wasm").await["state"], "active");
    std::fs::write(&target, &v2).unwrap();
    serving(&host, "2.0.0").await;
    assert!(status(&host, "hotswap.wasm").await["last_error"].is_null());
    host.shutdown().await;
}

#[tokio::test]
async fn a_replace_under_200_concurrent_commands_fails_none() {
    let host = Arc::new(watched_host().await);
    deploy(&host, "hotswap", "hotswap.wasm");
    serving(&host, "1.0.0").await;

    let mut calls = Vec::new();
    for i in 0..200 {
        let host = host.clone();
        calls.push(tokio::spawn(async move {
            // Spread over ~4 s so that the replace lands well inside it, even on a loaded
            // machine (over ~2 s, one CI run saw every call answered by the old version).
            tokio::time::sleep(Duration::from_millis(i * 20)).await;
            host.command("hotswap", "work", json!({ "ms": 30 })).await
        }));
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    deploy(&host, "hotswap_v2", "hotswap.wasm");
    let mut versions = std::collections::BTreeMap::new();
    for call in calls {
        let a = call.await.unwrap();
        assert_eq!(a.status, 200, "a command failed during the replace: {}", a.text);
        *versions
            .entry(a.body["version"].as_str().unwrap().to_string())
            .or_insert(0) += 1;
    }
    assert_eq!(versions.values().sum::<i32>(), 200);
    assert!(
        versions.contains_key("1.0.0") && versions.contains_key("2.0.0"),
        "both versions served: {versions:?}"
    );
    assert_eq!(host.count("SELECT count(*) FROM hotswap.calls").await, 200);
}

/// Deploys the hotswap version whose migration 2 Postgres refuses, and waits until the
/// failure is reported.
async fn deploy_broken_migration(host: &TestHost) {
    deploy(host, "hotswap_broken", "hotswap.wasm");
    eventually(Duration::from_secs(20), "the failed migration reported", || async {
        status(host, "hotswap.wasm").await["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("migration 2 (broken) failed"))
    })
    .await;
}

#[tokio::test]
async fn a_plugin_whose_migration_fails_leaves_the_old_version_serving() {
    let host = watched_host().await;
    deploy(&host, "hotswap", "hotswap.wasm");
    serving(&host, "1.0.0").await;
    deploy_broken_migration(&host).await;
    let s = status(&host, "hotswap.wasm").await;
    assert_eq!(
        (s["state"].as_str(), s["version"].as_str()),
        (Some("active"), Some("1.0.0")),
        "{s}"
    );
    assert_eq!(version(&host).await.as_deref(), Some("1.0.0"));
    let a = host.command("hotswap", "work", json!({ "ms": 1 })).await;
    assert_eq!(a.status, 200, "{}", a.text);
    // Nothing of the failed migration stayed.
    assert_eq!(
        host.count("SELECT count(*) FROM obx.plugin_migration WHERE plugin = 'hotswap'")
            .await,
        1
    );
    let metrics = host.get("/metrics").await.text;
    assert!(
        metrics.contains("obx_plugin_load_failures_total"),
        "failures are counted"
    );
    host.shutdown().await;
}

#[tokio::test]
async fn consumers_follow_the_new_manifest() {
    let host = watched_host().await;
    deploy(&host, "hotswap", "hotswap.wasm");
    serving(&host, "1.0.0").await;
    // Version 2 subscribes to hotswap.events: a consumer starts for it.
    deploy(&host, "hotswap_v2", "hotswap.wasm");
    serving(&host, "2.0.0").await;
    let p = producer(&host.host.brokers.bootstrap);
    let id = send_event(&p, &host.topic("hotswap.events"), "k", "Ping", &json!({})).await;
    eventually(Duration::from_secs(30), "the event handled by version 2", || async {
        host.count(&format!("SELECT count(*) FROM hotswap.events WHERE event_id = '{id}'"))
            .await
            == 1
    })
    .await;
    host.shutdown().await;
}

#[tokio::test]
async fn a_restart_loads_from_the_compile_cache() {
    let cache = tempfile::tempdir().unwrap();
    let with_cache = |c: &mut obx::config::Config| c.plugins.cache_dir = Some(cache.path().to_path_buf());
    let first = spawn_host_with(&["hotswap"], with_cache).await;
    assert_eq!(version(&first).await.as_deref(), Some("1.0.0"));
    let entries = std::fs::read_dir(cache.path()).unwrap().count();
    assert_eq!(entries, 1, "one compiled component cached");
    let url = first.database_url.clone();
    first.shutdown().await;
    let before = cache_hits();
    let second = obx_tests::spawn_host_on(&url, &["hotswap"], with_cache).await;
    assert_eq!(version(&second).await.as_deref(), Some("1.0.0"));
    assert!(cache_hits() > before, "the restart used the cache");
    // The cache is the host's own: never the plugin directory.
    assert!(!Path::new(&second.plugin_dir.path()).join("hotswap.cwasm").exists());
    second.shutdown().await;
}

fn cache_hits() -> u64 {
    let rendered = obx::telemetry::metrics().render();
    rendered
        .lines()
        .find_map(|l| l.strip_prefix("obx_plugin_compile_cache_hits_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// A guest's `describe` can return lists whose strings all are the same bytes of its memory,
/// each copied whole: 512 commands over one 8 MiB string would be 4 GiB for the host (a
/// longer list, any amount, and at every restart). The host copies at most 128 MiB of a
/// result; past it the load fails, and the host serves on.
#[tokio::test]
async fn a_manifest_whose_commands_all_alias_one_string_is_refused_within_a_bound() {
    let host = watched_host().await;
    reset_peak_rss();
    let before = peak_rss();
    deploy(&host, "hotswap_amplified", "hotswap.wasm");
    eventually(Duration::from_secs(20), "the manifest refused", || async {
        status(&host, "hotswap.wasm").await["last_error"].is_string()
    })
    .await;
    let grew = peak_rss().saturating_sub(before);
    let error = status(&host, "hotswap.wasm").await["last_error"].clone();
    assert!(error.as_str().unwrap().contains("too much data"), "{error}");
    assert!(grew < 512 << 20, "the host's peak memory grew by {} MiB", grew >> 20);
    deploy(&host, "hotswap", "hotswap.wasm");
    serving(&host, "1.0.0").await;
    host.shutdown().await;
}

/// A `describe` that sleeps is blocked on the host, where the epoch deadline never fires:
/// the load is bounded all the same, fails as past the deadline, and the watcher goes on to
/// the next file. Before, the load waited for the hour, and the watcher with it.
#[tokio::test]
async fn a_describe_that_sleeps_fails_at_the_deadline_and_the_watcher_goes_on() {
    let host = watched_host().await;
    deploy(&host, "hotswap_sleepy", "sleepy.wasm");
    eventually(Duration::from_secs(20), "the sleeping describe refused", || async {
        status(&host, "sleepy.wasm").await["last_error"].is_string()
    })
    .await;
    let error = status(&host, "sleepy.wasm").await["last_error"].clone();
    assert!(error.as_str().unwrap().contains("deadline"), "{error}");
    deploy(&host, "hotswap", "hotswap.wasm");
    serving(&host, "1.0.0").await;
    host.shutdown().await;
}

/// A load that waits does not hold back another plugin's file: here hotswap's load waits for
/// its registry row, which another host holds while it runs hotswap's migrations (for up to
/// 15 minutes). The watcher loads files side by side, so orders is served meanwhile. Before,
/// orders waited for hotswap's load to end, here at its 30 s lock timeout.
#[tokio::test]
async fn a_load_that_waits_does_not_hold_back_another_plugins_file() {
    let host = watched_host().await;
    deploy(&host, "hotswap", "hotswap.wasm");
    serving(&host, "1.0.0").await;
    let mut other_host = host.db.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM obx.plugin WHERE name = 'hotswap' FOR UPDATE")
        .execute(&mut *other_host)
        .await
        .unwrap();
    deploy(&host, "hotswap_v2", "hotswap.wasm");
    eventually(
        Duration::from_secs(20),
        "hotswap's load waiting for its row",
        || async { host.lock_waits().await > 0 },
    )
    .await;

    deploy(&host, "orders", "orders.wasm");
    eventually(
        Duration::from_secs(10),
        "orders served while hotswap's load waits",
        || async { status(&host, "orders.wasm").await["state"] == "active" },
    )
    .await;
    assert_eq!(
        version(&host).await.as_deref(),
        Some("1.0.0"),
        "hotswap's load still waits"
    );
    let a = host
        .command("orders", "CreateOrder", json!({ "customerId": "c-1", "amount": 5 }))
        .await;
    assert_eq!(a.status, 200, "{}", a.text);

    other_host.rollback().await.unwrap();
    serving(&host, "2.0.0").await;
    host.shutdown().await;
}

/// A file far over `limits.max_component_bytes` (here a sparse file of 4 GiB) is refused as
/// too large without being read: it was read whole first, into the host's memory.
#[tokio::test]
async fn a_file_over_the_size_limit_is_refused_without_being_read() {
    let host = spawn_host_with(&[], |c| {
        c.plugins.debounce = Duration::from_millis(100);
        c.limits.max_component_bytes = 16 << 20;
    })
    .await;
    reset_peak_rss();
    let before = peak_rss();
    let huge = host.plugin_dir.path().join(".huge.wasm.tmp");
    std::fs::File::create(&huge).unwrap().set_len(4 << 30).unwrap();
    std::fs::rename(&huge, host.plugin_dir.path().join("huge.wasm")).unwrap();
    eventually(Duration::from_secs(20), "the file refused", || async {
        status(&host, "huge.wasm").await["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("over the limit"))
    })
    .await;
    let grew = peak_rss().saturating_sub(before);
    assert!(grew < 256 << 20, "the host's peak memory grew by {} MiB", grew >> 20);
    host.shutdown().await;
}

/// A host whose watcher also rescans its directory every second.
async fn rescanning_host() -> TestHost {
    spawn_host_with(&[], |c| {
        c.plugins.debounce = Duration::from_millis(100);
        c.plugins.rescan_interval = Duration::from_secs(1);
    })
    .await
}

/// A load that failed for what the file holds (a migration Postgres refuses) is not tried
/// again while the file stays as it is; a load the database failed is tried again at the
/// next rescan, with no event for its file. Here the new version's provisioning waits for
/// the plugin's registry row, which another session holds (as another host loading it
/// would), and that wait's session is ended. Before, the old version served until the file
/// changed again.
#[tokio::test]
async fn a_load_the_database_failed_is_tried_again_at_the_next_rescan() {
    use sqlx::Connection as _;
    let host = rescanning_host().await;
    deploy(&host, "hotswap", "hotswap.wasm");
    serving(&host, "1.0.0").await;
    deploy_broken_migration(&host).await;
    let failed_at = status(&host, "hotswap.wasm").await["failed_at"].clone();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        status(&host, "hotswap.wasm").await["failed_at"],
        failed_at,
        "a refused migration was tried again"
    );

    let mut other = sqlx::PgConnection::connect(&host.database_url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut other).await.unwrap();
    sqlx::query("SELECT name FROM obx.plugin WHERE name = 'hotswap' FOR UPDATE")
        .execute(&mut other)
        .await
        .unwrap();
    deploy(&host, "hotswap_v2", "hotswap.wasm");
    let waiting = "FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database() \
                   AND query LIKE '%FROM obx.plugin WHERE name%'";
    eventually(
        Duration::from_secs(20),
        "the load waits for the registry row",
        || async { host.count(&format!("SELECT count(*) {waiting}")).await >= 1 },
    )
    .await;
    host.count(&format!("SELECT count(pg_terminate_backend(pid)) {waiting}"))
        .await;
    eventually(Duration::from_secs(20), "the failed load reported", || async {
        status(&host, "hotswap.wasm").await["failed_at"] != failed_at
    })
    .await;
    assert_eq!(version(&host).await.as_deref(), Some("1.0.0"));
    sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
    serving(&host, "2.0.0").await;
    assert!(status(&host, "hotswap.wasm").await["last_error"].is_null());
    host.shutdown().await;
}

/// A deploy that replaces the plugin directory whole (removed, made again, filled): the
/// watch stayed on the removed directory, so changes in the new one went unseen (here the
/// file's removal: the plugin served on). The rescan finds them. (It also watches the
/// directory anew; this test cannot tell that from the rescan alone.)
#[tokio::test]
async fn a_plugin_directory_replaced_whole_is_followed() {
    let host = rescanning_host().await;
    deploy(&host, "hotswap", "hotswap.wasm");
    serving(&host, "1.0.0").await;
    let dir = host.plugin_dir.path();
    std::fs::remove_dir_all(dir).unwrap();
    std::fs::create_dir(dir).unwrap();
    deploy(&host, "hotswap_v2", "hotswap.wasm");
    serving(&host, "2.0.0").await;
    std::fs::remove_file(dir.join("hotswap.wasm")).unwrap();
    unloaded(&host).await;
    host.shutdown().await;
}

/// `plugins.dir` given as a relative path, as the default `plugins.d` is. The files loaded
/// at start were known by their relative paths, and notify names them by absolute ones: a
/// replaced file was refused as "already provided" by itself, and the old version served on.
#[tokio::test]
async fn a_plugin_directory_given_by_a_relative_path_is_hot_reloaded() {
    let host = spawn_host_with(&["hotswap"], |c| {
        c.plugins.debounce = Duration::from_millis(100);
        let cwd = std::env::current_dir().unwrap();
        let up = "../".repeat(cwd.components().count() - 1);
        c.plugins.dir = Path::new(&up).join(c.plugins.dir.strip_prefix("/").unwrap());
    })
    .await;
    serving(&host, "1.0.0").await;
    deploy(&host, "hotswap_v2", "hotswap.wasm");
    serving(&host, "2.0.0").await;
    host.shutdown().await;
}

/// A compile cannot be stopped, so one that runs past `limits.compile_timeout` goes on after
/// its load failed. Such compiles hold the host's compile slots (here two) until they end:
/// more files that compile for too long wait for a slot, fail as busy, and are tried again at
/// a rescan, rather than each adding a compiling thread and its memory (before, every such
/// file started a compile of its own). A component in the compile cache needs no slot and
/// loads meanwhile; a compile that ran past its time is not cached, so its file is refused
/// every time, after a restart too.
#[tokio::test(flavor = "multi_thread")]
async fn compiles_past_their_timeout_hold_the_compile_slots_and_do_not_pile_up() {
    let cache = tempfile::tempdir().unwrap();
    let cache_dir = cache.path().to_path_buf();
    let host = spawn_host_with(&[], |c| {
        c.plugins.debounce = Duration::from_millis(100);
        c.plugins.rescan_interval = Duration::from_secs(1);
        c.plugins.cache_dir = Some(cache_dir);
        // The Python component takes seconds to compile, the Rust one a fraction of this.
        c.limits.compile_timeout = Duration::from_secs(1);
        c.limits.max_concurrent_compiles = 2;
    })
    .await;
    let cached = || std::fs::read_dir(cache.path()).unwrap().count();
    deploy(&host, "hotswap", "hotswap.wasm");
    serving(&host, "1.0.0").await;
    std::fs::remove_file(host.plugin_dir.path().join("hotswap.wasm")).unwrap();
    unloaded(&host).await;
    assert_eq!(cached(), 1);

    let runtime = host.host.runtime.clone();
    let slots = runtime.compile_slots();
    let files: Vec<String> = (0..slots + 2).map(|i| format!("slow_{i}.wasm")).collect();
    for file in &files {
        deploy(&host, "shipping", file);
    }
    let most = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (runtime, most) = (runtime.clone(), most.clone());
        tokio::spawn(async move {
            loop {
                most.fetch_max(runtime.compiles_running(), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    eventually(Duration::from_secs(60), "files failed as busy", || async {
        failed_with(&host, &files, "no compile slot").await >= 2
    })
    .await;
    assert_eq!(runtime.compiles_running(), slots);
    // Every slot is taken: the cached component loads all the same, at once.
    deploy(&host, "hotswap", "hotswap.wasm");
    eventually(Duration::from_secs(5), "the cached component serving", || async {
        version(&host).await.as_deref() == Some("1.0.0")
    })
    .await;
    assert_eq!(
        runtime.compiles_running(),
        slots,
        "the slots were freed before it loaded"
    );
    // Each file is tried again once the slots free, and compiles in turn.
    eventually(
        Duration::from_secs(180),
        "every file compiled past its timeout",
        || async { failed_with(&host, &files, "compiling took longer").await == files.len() },
    )
    .await;
    sampler.abort();
    let most = most.load(Ordering::Relaxed);
    assert_eq!(most, slots, "compiles ran at once, with {slots} slots");
    eventually(
        Duration::from_secs(60),
        "the compiles past their time ended",
        || async { runtime.compiles_running() == 0 },
    )
    .await;
    assert_eq!(cached(), 1, "a compile past its time was cached");
    host.shutdown().await;
}

/// How many of `files` last failed with an error that says `what`.
async fn failed_with(host: &TestHost, files: &[String], what: &str) -> usize {
    let mut failed = 0;
    for file in files {
        failed += status(host, file).await["last_error"]
            .as_str()
            .is_some_and(|e| e.contains(what)) as usize;
    }
    failed
}

/// A consumer whose plugin is away for a moment goes on when it is back. Here the supervisor
/// is busy stopping testbed's consumer (unloaded, whose handler waits on a lock) while
/// hotswap is unloaded, gets an event, and is loaded again with the same subscriptions.
/// Hotswap's lane, finding no plugin, ended with the event unsettled, and the supervisor kept
/// the consumer listed as running: hotswap's events waited for its next change of
/// subscriptions or a restart of the host. The lane now waits for the plugin, or for its
/// consumer's stop.
#[tokio::test]
async fn a_consumer_whose_plugin_is_away_for_a_moment_goes_on_when_it_is_back() {
    let host = spawn_host_with(&["testbed"], |c| {
        c.plugins.debounce = Duration::from_millis(100);
        c.limits.statement_timeout = Duration::from_secs(60);
        c.limits.call_deadline = Duration::from_secs(60);
        c.limits.lock_timeout = Duration::from_secs(60);
    })
    .await;
    deploy(&host, "hotswap_v2", "hotswap.wasm");
    let loaded = || async { version(&host).await.as_deref() == Some("2.0.0") };
    eventually(Duration::from_secs(20), "hotswap loaded", loaded).await;
    let p = producer(&host.host.brokers.bootstrap);
    let first = send_event(&p, &host.topic("hotswap.events"), "k", "Ping", &json!({})).await;
    let handled = |id: uuid::Uuid| {
        let host = &host;
        async move {
            host.count(&format!("SELECT count(*) FROM hotswap.events WHERE event_id = '{id}'"))
                .await
                == 1
        }
    };
    eventually(Duration::from_secs(20), "hotswap's consumer runs", || handled(first)).await;

    // testbed's handler waits for the gate; testbed is unloaded, and the supervisor waits
    // for its consumer to finish that event.
    let gate = Gate::hold(&host.database_url).await;
    send_event(
        &p,
        &host.topic("testbed.events"),
        "k",
        "Thing",
        &json!({ "gate": true }),
    )
    .await;
    eventually(Duration::from_secs(20), "testbed's handler waits", || async {
        host.lock_waits().await >= 1
    })
    .await;
    std::fs::remove_file(host.plugin_dir.path().join("testbed.wasm")).unwrap();
    eventually(Duration::from_secs(20), "testbed unloaded", || async {
        host.command("testbed", "ok", json!({})).await.code() == "unknown_plugin"
    })
    .await;

    // Meanwhile hotswap goes, gets an event, and comes back.
    std::fs::remove_file(host.plugin_dir.path().join("hotswap.wasm")).unwrap();
    eventually(Duration::from_secs(20), "hotswap unloaded", || async {
        version(&host).await.is_none()
    })
    .await;
    let second = send_event(&p, &host.topic("hotswap.events"), "k", "Ping", &json!({})).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    deploy(&host, "hotswap_v2", "hotswap.wasm");
    eventually(Duration::from_secs(20), "hotswap loaded again", loaded).await;
    gate.release().await;
    eventually(Duration::from_secs(30), "hotswap's second event handled", || {
        handled(second)
    })
    .await;
    host.shutdown().await;
}

/// Hosts of one installation that load different plugins at the same moment all load them.
/// Each load grants on `obx_api`, and Postgres refuses a second concurrent change of one
/// catalog row ("tuple concurrently updated"): a host's plugin stayed unloaded until its file
/// changed. The loads now take turns.
#[tokio::test]
async fn hosts_that_load_different_plugins_at_once_all_load_them() {
    let first = spawn_host_with(&[], |_| {}).await;
    let url = first.database_url.clone();
    let plugins = ["orders", "inventory", "payments", "testbed"];
    let start = |i: usize| obx_tests::spawn_host_on(&url, &plugins[i..=i], |_| {});
    let (a, b, c, d) = tokio::join!(start(0), start(1), start(2), start(3));
    let hosts = [a, b, c, d];
    for (host, plugin) in hosts.iter().zip(plugins) {
        let listed = host.get("/v1/plugins").await.body;
        let loaded = listed["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == plugin && p["last_error"].is_null());
        assert!(loaded, "{plugin} did not load: {listed}");
    }
    for host in hosts {
        host.shutdown().await;
    }
    first.shutdown().await;
}

/// A file refused because another file provides the same plugin loads once that file is
/// gone. It was refused for good (until it changed), and the plugin stayed unloaded.
#[tokio::test]
async fn a_file_refused_for_a_plugin_another_provides_loads_when_that_one_goes() {
    let host = watched_host().await;
    deploy(&host, "hotswap", "a.wasm");
    eventually(Duration::from_secs(20), "a.wasm serves hotswap", || async {
        version(&host).await.as_deref() == Some("1.0.0")
    })
    .await;
    deploy(&host, "hotswap_v2", "b.wasm");
    eventually(Duration::from_secs(20), "b.wasm refused", || async {
        status(&host, "b.wasm").await["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("already provided by"))
    })
    .await;
    std::fs::remove_file(host.plugin_dir.path().join("a.wasm")).unwrap();
    eventually(Duration::from_secs(20), "b.wasm serves hotswap", || async {
        version(&host).await.as_deref() == Some("2.0.0")
    })
    .await;
    host.shutdown().await;
}

/// Two files of one plugin dropped at once are loaded side by side, and take their turns in
/// the registry: one serves, the other is refused as provided by the first, and only the
/// migrations of the one that serves ran.
#[tokio::test]
async fn two_files_of_one_plugin_dropped_at_once_take_turns() {
    let host = watched_host().await;
    deploy(&host, "hotswap", "a.wasm");
    deploy(&host, "hotswap_v2", "b.wasm");
    let refused = |s: &Value| {
        s["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("already provided by"))
    };
    eventually(
        Duration::from_secs(20),
        "one file serving, the other refused",
        || async {
            let (a, b) = (status(&host, "a.wasm").await, status(&host, "b.wasm").await);
            (a["state"] == "active" && refused(&b)) || (b["state"] == "active" && refused(&a))
        },
    )
    .await;
    let serving = version(&host).await.expect("hotswap serves");
    let a_serves = status(&host, "a.wasm").await["state"] == "active";
    assert_eq!(serving, if a_serves { "1.0.0" } else { "2.0.0" });
    let migrations = host
        .count("SELECT count(*) FROM obx.plugin_migration WHERE plugin = 'hotswap'")
        .await;
    assert_eq!(migrations, if a_serves { 1 } else { 2 }, "serving {serving}");
    host.shutdown().await;
}
