//! Plugin SQL is confined: the parser refuses every statement class a plugin must not run,
//! Postgres refuses what the plugin's role has no right to, and values travel typed.

use std::time::Duration;

use obx_tests::{spawn_host, spawn_host_with, TestHost};
use serde_json::{json, Value};

/// Runs `sql` through the testbed plugin; returns the answer's status and the SQL error's
/// variant (the rejection reason) or the result.
async fn run(host: &TestHost, sql: &str, params: Value) -> (u16, Value) {
    let a = host
        .command("testbed", "sql", json!({ "sql": sql, "params": params }))
        .await;
    match a.status {
        409 => (409, a.body["error"]["reason"].clone()),
        s => (s, a.body),
    }
}

async fn assert_forbidden(host: &TestHost, sql: &str) {
    let (status, reason) = run(host, sql, json!([])).await;
    assert_eq!(
        (status, reason.as_str()),
        (409, Some("forbidden")),
        "{sql} was not refused"
    );
}

#[tokio::test]
async fn each_forbidden_statement_class_is_refused() {
    let host = spawn_host(&["orders", "testbed"]).await;
    // Transaction control.
    assert_forbidden(&host, "COMMIT").await;
    assert_forbidden(&host, "ROLLBACK").await;
    assert_forbidden(&host, "BEGIN").await;
    assert_forbidden(&host, "SAVEPOINT s").await;
    // SET and RESET.
    assert_forbidden(&host, "SET statement_timeout = 0").await;
    assert_forbidden(&host, "RESET statement_timeout").await;
    // Role changes, including through set_config.
    assert_forbidden(&host, "SET ROLE postgres").await;
    assert_forbidden(&host, "RESET ROLE").await;
    assert_forbidden(&host, "SET SESSION AUTHORIZATION postgres").await;
    assert_forbidden(&host, "SELECT set_config('role', 'postgres', true)").await;
    assert_forbidden(&host, "SELECT * FROM pg_catalog.set_config('role', 'postgres', false)").await;
    // COPY, LISTEN/NOTIFY, DO.
    assert_forbidden(&host, "COPY items TO STDOUT").await;
    assert_forbidden(&host, "LISTEN obx").await;
    assert_forbidden(&host, "NOTIFY obx, 'hello'").await;
    assert_forbidden(&host, "SELECT pg_notify('obx', 'hello')").await;
    assert_forbidden(&host, "DO $$ BEGIN RAISE NOTICE 'x'; END $$").await;
    // DDL outside migrations.
    assert_forbidden(&host, "CREATE TABLE sneaky (id int)").await;
    assert_forbidden(&host, "DROP TABLE items").await;
    assert_forbidden(&host, "ALTER TABLE items ADD COLUMN x int").await;
    assert_forbidden(&host, "TRUNCATE items").await;
    assert_forbidden(&host, "GRANT SELECT ON items TO PUBLIC").await;
    // Several statements in one call.
    assert_forbidden(&host, "SELECT 1; SELECT 2").await;
    assert_forbidden(&host, "INSERT INTO items (id) VALUES ('a'); COMMIT").await;
    // The host's tables and other plugins' tables.
    assert_forbidden(
        &host,
        "INSERT INTO obx.outbox_event (event_id) VALUES (gen_random_uuid())",
    )
    .await;
    assert_forbidden(&host, "SELECT * FROM obx.outbox_event").await;
    assert_forbidden(&host, "SELECT * FROM orders.orders").await;
    assert_forbidden(&host, "WITH x AS (SELECT * FROM orders.orders) SELECT * FROM x").await;
    assert_forbidden(&host, "SELECT * FROM pg_authid").await;

    // None of it left a trace, and the plugin still works.
    let ok = host.command("testbed", "ok", json!({ "id": "still-fine" })).await;
    assert_eq!(ok.status, 200);
    host.shutdown().await;
}

#[tokio::test]
async fn postgres_refuses_what_the_plugin_role_may_not_touch() {
    let host = spawn_host(&["orders", "testbed"]).await;
    // Unqualified names resolve in the plugin's own schema only.
    let (status, reason) = run(&host, "SELECT * FROM orders", json!([])).await;
    assert_eq!(
        (status, reason),
        (409, json!("database:42P01")),
        "relation does not exist"
    );
    let (status, reason) = run(&host, "SELECT * FROM outbox_event", json!([])).await;
    assert_eq!((status, reason), (409, json!("database:42P01")));

    // The second wall on its own: as the plugin's role, the host's and other plugins'
    // tables are out of reach even for a statement that got past the parser.
    for sql in [
        "SELECT * FROM obx.outbox_event",
        "SELECT * FROM orders.orders",
        "INSERT INTO obx.outbox_event DEFAULT VALUES",
    ] {
        let mut tx = host.db.begin().await.unwrap();
        sqlx::raw_sql("SET LOCAL ROLE obx_plugin_testbed")
            .execute(&mut *tx)
            .await
            .unwrap();
        let err = sqlx::raw_sql(sql).execute(&mut *tx).await.expect_err(sql);
        assert_eq!(
            err.as_database_error().and_then(|e| e.code()).as_deref(),
            Some("42501"),
            "{sql}: {err}"
        );
    }
    host.shutdown().await;
}

#[tokio::test]
async fn plugin_statements_run_under_the_plugin_role_and_timeouts() {
    let host = spawn_host_with(&["testbed"], |c| {
        c.limits.statement_timeout = Duration::from_millis(300)
    })
    .await;
    let (status, body) = run(
        &host,
        "SELECT current_user::text, current_setting('search_path'), current_setting('statement_timeout'), \
                current_setting('lock_timeout')",
        json!([]),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["rows"][0],
        json!(["obx_plugin_testbed", "\"testbed\"", "300ms", "1s"])
    );

    // A statement slower than the statement timeout is stopped, with a typed error.
    let (status, reason) = run(&host, "SELECT count(*) FROM generate_series(1, 1000000000)", json!([])).await;
    assert_eq!((status, reason), (409, json!("timeout")));
    host.shutdown().await;
}

#[tokio::test]
async fn values_travel_typed_in_both_directions() {
    let host = spawn_host(&["testbed"]).await;
    let (status, body) = run(
        &host,
        "SELECT $1::bigint, $2::float8, $3::bool, $4::text, $5::uuid, $6::jsonb, $7::timestamptz, $8::date, \
                $9::numeric, $10::bytea, $11::int4, NULL::text",
        json!([
            42,
            2.5,
            true,
            "it's \"quoted\"; DROP TABLE items; --",
            { "uuid": "5f0c7a51-0b5e-4a8e-9a0e-0d1f2c3b4a59" },
            { "json": "{\"a\": [1, 2]}" },
            { "timestamp": "2026-11-30T12:00:00.123456Z" },
            { "date": "2026-11-30" },
            { "numeric": "12345678901234567890.12" },
            { "bytes": "abc" },
            7
        ]),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["rows"][0],
        json!([
            42,
            2.5,
            true,
            "it's \"quoted\"; DROP TABLE items; --",
            { "uuid": "5f0c7a51-0b5e-4a8e-9a0e-0d1f2c3b4a59" },
            { "json": "{\"a\":[1,2]}" },
            { "timestamp": "2026-11-30T12:00:00.123456Z" },
            { "date": "2026-11-30" },
            { "numeric": "12345678901234567890.12" },
            { "bytes": [97, 98, 99] },
            7,
            null
        ])
    );
    // The table survived the "injection": values are never pasted into SQL.
    assert_eq!(host.count("SELECT count(*) FROM testbed.items").await, 0);

    // The same statement text with other parameter types is prepared anew, not misread.
    let (status, body) = run(&host, "SELECT $1::text IS NULL", json!([null])).await;
    assert_eq!((status, &body["rows"][0]), (200, &json!([true])), "{body}");
    // With no context to infer it from, an untyped NULL is Postgres's error, typed.
    let (status, reason) = run(&host, "SELECT $1 IS NULL", json!([null])).await;
    assert_eq!((status, reason), (409, json!("database:42P18")));
    let (status, body) = run(&host, "SELECT pg_typeof($1)::text", json!([5])).await;
    assert_eq!((status, &body["rows"][0]), (200, &json!(["bigint"])));
    let (status, body) = run(&host, "SELECT pg_typeof($1)::text", json!(["five"])).await;
    assert_eq!((status, &body["rows"][0]), (200, &json!(["text"])));

    // A malformed typed value is refused before it reaches Postgres.
    let (status, reason) = run(&host, "SELECT $1::uuid", json!([{ "uuid": "not-a-uuid" }])).await;
    assert_eq!((status, reason), (409, json!("invalid")));
    host.shutdown().await;
}
