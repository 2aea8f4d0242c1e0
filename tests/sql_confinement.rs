//! Plugin SQL is confined: the parser refuses every statement class a plugin must not run,
//! Postgres refuses what the plugin's role has no right to, and values travel typed.

use std::time::Duration;

use obx_tests::{eventually, spawn_host, spawn_host_with, TestHost};
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

/// `sql` is cut off at the result's bound: `sql-error::limit`.
async fn assert_cut_off(host: &TestHost, sql: &str) {
    let (status, reason) = run(host, sql, json!([])).await;
    assert_eq!((status, reason.as_str()), (409, Some("limit")), "{sql}");
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
        let mut session = host.plugin_session("testbed").await;
        let err = sqlx::raw_sql(sql).execute(&mut session).await.expect_err(sql);
        assert_eq!(
            err.as_database_error().and_then(|e| e.code()).as_deref(),
            Some("42501"),
            "{sql}: {err}"
        );
    }
    host.shutdown().await;
}

#[tokio::test]
async fn plugin_statements_run_on_the_plugin_login_with_its_timeouts() {
    let host = spawn_host_with(&["testbed"], |c| {
        c.limits.statement_timeout = Duration::from_millis(300)
    })
    .await;
    let (status, body) = run(
        &host,
        "SELECT session_user::text, current_user::text, current_setting('search_path'), \
                current_setting('statement_timeout'), current_setting('lock_timeout')",
        json!([]),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let role = host.plugin_role("testbed").await;
    assert_eq!(body["rows"][0], json!([role, role, "testbed", "300ms", "1s"]));

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
            // As Postgres writes it: passed through as text, never built into a tree.
            { "json": "{\"a\": [1, 2]}" },
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

/// A `numeric` parameter is the number Postgres reads from its text: the host writes its
/// binary form itself, and each case here is compared with Postgres's own reading of the same
/// text as a literal. What Postgres would refuse, the host refuses before the statement.
#[tokio::test]
async fn numeric_parameters_are_what_postgres_reads_from_their_text() {
    let host = spawn_host(&["testbed"]).await;
    for text in [
        "0",
        "-0",
        "0.000",
        "12.50",
        "-12.50",
        " +7 ",
        "00012.3400",
        ".5",
        "5.",
        "1e5",
        "1.5e1",
        "1.50e1",
        "1E-3",
        "123e-2",
        "-0.0001",
        "9999.9999",
        "10000",
        "100000000",
        "123456789012345678901234567890.123456789",
        "-98765.4321e-10",
        "NaN",
        "nan",
        "Infinity",
        "-inf",
        "+INFINITY",
        "+inf",
        "\t\n7\r\n",
        "\u{b}5\u{c}",
        "1e+5",
        "1e0005",
        "5.e3",
        "+.5",
        "0e-16383",
        "1e131071",
        "0e1073741822",
        // Postgres 15 reads the exponent with `strtol`, which skips spaces (16 does not).
        "1e 5",
        "1e\t-3",
    ] {
        let sql = format!("SELECT $1::numeric::text, '{text}'::numeric::text");
        let (status, body) = run(&host, &sql, json!([{ "numeric": text }])).await;
        assert_eq!(status, 200, "{text:?}: {body}");
        let row = &body["rows"][0];
        assert_eq!(row[0], row[1], "{text:?}: the parameter against Postgres's reading");
    }
    // Not numbers (not `0x10` or `1_000` either: Postgres 16 reads those, and the host refuses
    // them), and numbers out of numeric's range: refused by the host as Postgres refuses the
    // same literal.
    let refused: [(&[&str], &str); 2] = [
        (&["", "-", ".", "1e", "abc", "1.2.3", "1 2", "-nan"], "database:22P02"),
        (
            &["1e131072", "0e-16384", "0e1073741823", "1e99999999999999999999"],
            "database:22003",
        ),
    ];
    for (texts, postgres) in refused {
        for text in texts {
            let (status, reason) = run(&host, "SELECT $1::numeric", json!([{ "numeric": text }])).await;
            assert_eq!((status, reason), (409, json!("invalid")), "{text:?}");
            let (status, reason) = run(&host, &format!("SELECT '{text}'::numeric"), json!([])).await;
            assert_eq!(
                (status, reason),
                (409, json!(postgres)),
                "{text:?}: Postgres refuses it too"
            );
        }
    }
    host.shutdown().await;
}

/// Parameters whose size the plugin chooses cost the host their size, not more, and come back
/// in errors only in part. A 16 MiB number was parsed in time that grows with the square of
/// its length (a minute on a worker thread); JSON was built into a tree of about 16 times its
/// size; and Postgres's error, which quotes the value whole, was copied and logged whole.
#[tokio::test]
async fn hostile_parameters_cost_their_size_and_come_back_short() {
    let host = spawn_host(&["testbed"]).await;
    let answer = |params: Value, sql: &'static str| {
        let host = &host;
        async move {
            host.command("testbed", "sql", json!({ "sql": sql, "params": params }))
                .await
        }
    };
    // Longer than any numeric Postgres holds: refused before it is parsed.
    let a = answer(json!([{ "numeric": "7".repeat(200_000) }]), "SELECT $1::numeric").await;
    assert_eq!(
        (a.status, &a.body["error"]["reason"]),
        (409, &json!("invalid")),
        "{}",
        a.text
    );
    assert!(a.text.contains("147500") && a.text.len() < 2_000, "{}", a.text);
    // Eight that each fit, read in time linear in their digits (through a big integer they
    // cost the square of their length: tens of milliseconds each on a worker thread).
    let eight: Vec<Value> = (0..8).map(|_| json!({ "numeric": "7".repeat(125_500) })).collect();
    let a = answer(
        json!(eight),
        "SELECT length(($1::numeric + $2::numeric + $3::numeric + $4::numeric + $5::numeric + $6::numeric \
         + $7::numeric + $8::numeric)::text)::int8",
    )
    .await;
    assert_eq!((a.status, &a.body["rows"][0]), (200, &json!([125_501])), "{}", a.text);
    // The largest a numeric holds still goes through, before the point and after it.
    let a = answer(
        json!([{ "numeric": format!("{}.5", "9".repeat(131_000)) }]),
        "SELECT length($1::numeric::text)",
    )
    .await;
    assert_eq!((a.status, &a.body["rows"][0]), (200, &json!([131_002])), "{}", a.text);
    let most = "9".repeat(131_072);
    let a = answer(
        json!([{ "numeric": most }]),
        "SELECT $1::numeric::text = repeat('9', 131072)",
    )
    .await;
    assert_eq!((a.status, &a.body["rows"][0]), (200, &json!([true])), "{}", a.text);
    let finest = format!("0.{}1", "0".repeat(16_382));
    let a = answer(json!([{ "numeric": finest }]), "SELECT scale($1::numeric)").await;
    assert_eq!((a.status, &a.body["rows"][0]), (200, &json!([16_383])), "{}", a.text);
    // Past numeric's range: refused before the statement, as Postgres would refuse it.
    let a = answer(json!([{ "numeric": "1e131072" }]), "SELECT $1::numeric").await;
    assert_eq!(a.body["error"]["reason"], json!("invalid"), "{}", a.text);
    assert!(a.text.contains("out of numeric's range"), "{}", a.text);
    // JSON travels as its text, into jsonb.
    let array = format!("[{}0]", "0,".repeat(99_999));
    let a = answer(json!([{ "json": array }]), "SELECT jsonb_array_length($1)::int8").await;
    assert_eq!((a.status, &a.body["rows"][0]), (200, &json!([100_000])), "{}", a.text);
    // What jsonb refuses is refused before the statement, which would fail the call.
    let a = answer(json!([{ "json": r#"["\ud800"]"# }]), "SELECT $1::jsonb").await;
    assert_eq!(a.body["error"]["reason"], json!("invalid"), "{}", a.text);
    // Numbers reach jsonb as written.
    let a = answer(json!([{ "json": "[1.50]" }]), "SELECT ($1::jsonb)::text").await;
    assert_eq!((a.status, &a.body["rows"][0]), (200, &json!(["[1.50]"])), "{}", a.text);
    // A malformed value, and Postgres's error quoting 900 KB of text (a command's body holds
    // 1 MiB): both come back short.
    let a = answer(json!([{ "uuid": "x".repeat(900_000) }]), "SELECT $1::uuid").await;
    assert_eq!(
        a.body["error"]["reason"],
        json!("invalid"),
        "{}",
        &a.text[..a.text.len().min(300)]
    );
    assert!(a.text.len() < 2_000, "{} bytes", a.text.len());
    let a = answer(json!(["x".repeat(900_000)]), "SELECT $1::int").await;
    assert_eq!(
        a.body["error"]["reason"],
        json!("database:22P02"),
        "{}",
        &a.text[..a.text.len().min(300)]
    );
    assert!(a.text.len() < 10_000, "{} bytes", a.text.len());
    host.shutdown().await;
}

/// Postgres reads `(x).f` as the call `f(x)`, which a parser sees as a field: refused unless
/// it is a column's field, and never with a denied function's name. Temporary objects, and
/// statements too large or too deep to walk safely, are refused too; the host keeps serving
/// and no plugin session holds anything afterwards.
#[tokio::test]
async fn calls_in_attribute_notation_temporary_objects_and_monster_statements_are_refused() {
    let host = spawn_host(&["testbed"]).await;
    for sql in [
        "SELECT ('SELECT set_config(''role'', ''none'', true)').ts_stat::text",
        "SELECT ('SELECT 1').query_to_xml",
        "SELECT ('role').set_config",
        "SELECT (42::bigint).pg_advisory_lock",
        "SELECT ($1::bigint).pg_advisory_lock",
        "SELECT (1.5::float8).pg_sleep",
        "SELECT ('/etc/passwd').lo_import",
        "SELECT (0::oid).lo_unlink",
        "SELECT (n).pg_advisory_lock FROM counters",
        "SELECT c.pg_sleep FROM counters c",
        "SELECT (SELECT 'x').ts_stat",
        "CREATE TEMPORARY TABLE uuid (x int)",
        "SELECT * INTO TEMPORARY t FROM items",
        "SELECT * FROM pg_temp.items",
    ] {
        let params = if sql.contains("$1") { json!([7]) } else { json!([]) };
        let (status, reason) = run(&host, sql, params).await;
        assert_eq!(
            (status, reason.as_str()),
            (409, Some("forbidden")),
            "{sql} was not refused"
        );
    }
    // A composite column's field is still fine.
    let (status, body) = run(&host, "SELECT (c).name FROM counters c", json!([])).await;
    assert_eq!(status, 200, "{body}");

    // Statements that once aborted the host: too large, or a chain too deep to drop.
    for (terms, why) in [(50_000, "over 64 KiB"), (20_000, "within 64 KiB, too deep")] {
        let sql = format!("SELECT {}", vec!["1"; terms].join("+"));
        let (status, reason) = run(&host, &sql, json!([])).await;
        assert_eq!((status, reason.as_str()), (409, Some("forbidden")), "{why}");
    }
    let nested = format!("SELECT {}1{}", "(".repeat(500), ")".repeat(500));
    let (status, reason) = run(&host, &nested, json!([])).await;
    assert_eq!((status, reason.as_str()), (409, Some("forbidden")));
    // Long but shallow statements are fine.
    let wide = format!("SELECT {}", vec!["1 + 1"; 1500].join(", "));
    let (status, body) = run(&host, &wide, json!([])).await;
    assert_eq!(status, 200, "{body}");

    let ok = host.command("testbed", "ok", json!({ "id": "alive" })).await;
    assert_eq!(ok.status, 200);
    let role = host.plugin_role("testbed").await;
    let held = host
        .count(&format!(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
             WHERE l.locktype = 'advisory' AND a.usename = '{role}'"
        ))
        .await;
    assert_eq!(held, 0);
    host.shutdown().await;
}

/// The host process's resident memory now.
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

/// A query's result is bounded in bytes as well as rows, counted as rows arrive: the host
/// stops reading, abandons the session, and does not grow past the cap.
#[tokio::test]
async fn a_huge_result_set_is_cut_off_without_growing_the_host() {
    let host = spawn_host_with(&["testbed"], |c| c.limits.max_result_bytes = 8 * 1024 * 1024).await;
    let before = rss();
    // 400 MB of rows, 1 MB each.
    assert_cut_off(&host, "SELECT repeat('x', 1000000) FROM generate_series(1, 400)").await;
    let grown = rss().saturating_sub(before);
    assert!(grown < 96 * 1024 * 1024, "the host grew by {} MB", grown / 1024 / 1024);
    abandoned_and_the_plugin_works_on(host).await;
}

/// The abandoned session was ended on the server too, and the plugin keeps working.
async fn abandoned_and_the_plugin_works_on(host: TestHost) {
    let role = host.plugin_role("testbed").await;
    eventually(Duration::from_secs(5), "the abandoned backend ends", || async {
        host.count(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = '{role}' AND state = 'active'"
        ))
        .await
            == 0
    })
    .await;
    let (status, body) = run(&host, "SELECT count(*) FROM generate_series(1, 10)", json!([])).await;
    assert_eq!(status, 200, "{body}");
    host.shutdown().await;
}

/// A row the host cannot read (a type plugins cannot read) fails the statement with the
/// rest of its result unread: the session is abandoned, its backend ended, as for a result
/// past its bound. It went back to the call, whose rollback then read the rest of the result,
/// outside the call's slot and deadline, for as long as the statement ran on: this request
/// waited for `http.request_timeout` (30 s) and was answered 503.
#[tokio::test]
async fn a_result_abandoned_at_a_row_the_host_cannot_read_is_not_drained() {
    let host = spawn_host_with(&["testbed"], |c| c.limits.statement_timeout = Duration::from_secs(60)).await;
    let started = std::time::Instant::now();
    // A set-returning function in the select list streams its rows (in FROM, Postgres would
    // make them all before the first).
    let (status, reason) = run(&host, "SELECT ARRAY[generate_series(1, 1000000000)]", json!([])).await;
    assert_eq!((status, reason.as_str()), (409, Some("invalid")), "{reason}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "answered after {:?}",
        started.elapsed()
    );
    abandoned_and_the_plugin_works_on(host).await;
}

/// The result's bound counts what the host holds, not only what arrives: a `numeric` of a
/// few bytes on the wire is 131,072 digits as text, and a NULL is no bytes at all. Before,
/// this query's 100 KB came in as 1.3 GB of text.
#[tokio::test]
async fn a_result_that_is_small_on_the_wire_and_large_as_values_is_cut_off() {
    let host = spawn_host_with(&["testbed"], |c| c.limits.max_result_bytes = 8 * 1024 * 1024).await;
    let before = rss();
    let columns = vec!["n"; 100].join(", ");
    assert_cut_off(
        &host,
        &format!("SELECT {columns} FROM (SELECT rpad('1', 131000, '0')::numeric AS n) t, generate_series(1, 100)"),
    )
    .await;
    let nulls = vec!["NULL::int"; 1000].join(", ");
    assert_cut_off(&host, &format!("SELECT {nulls} FROM generate_series(1, 10000)")).await;
    let grown = rss().saturating_sub(before);
    assert!(grown < 96 * 1024 * 1024, "the host grew by {} MB", grown / 1024 / 1024);
    let (status, body) = run(&host, "SELECT 12.50::numeric, NULL::int", json!([])).await;
    assert_eq!(status, 200, "{body}");
    host.shutdown().await;
}
