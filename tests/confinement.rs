//! Confinement that Postgres enforces. Every test here assumes the worst: a plugin that got
//! any SQL it liked past the SQL policy. It runs on a session logged in as its own role, and
//! that alone must keep it from the host's tables, other plugins' data and the host's
//! privileges, and nothing it does on the session may outlive its call.

use std::time::{Duration, Instant};

use obx::runtime::manifest::{EventDeclaration, Manifest, Migration};
use obx::runtime::plugin_schema::Release;
use obx_tests::*;
use serde_json::json;
use sqlx::{Connection, PgConnection, Row};

/// Runs `sql` on `session` and returns the SQLSTATE it failed with, or `None` if it worked.
async fn sqlstate(session: &mut PgConnection, sql: &str) -> Option<String> {
    match sqlx::raw_sql(sql).execute(&mut *session).await {
        Ok(_) => None,
        Err(e) => Some(
            e.as_database_error()
                .and_then(|d| d.code().map(|c| c.into_owned()))
                .unwrap_or_else(|| format!("not a database error: {e}")),
        ),
    }
}

async fn scalar(session: &mut PgConnection, sql: &str) -> String {
    sqlx::query_scalar::<_, String>(sql)
        .fetch_one(&mut *session)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// The strongest SQL a plugin can get is a session of its own role with no policy at all.
/// With it, it still cannot become anyone else, read or write `obx.*` or another plugin's
/// schema, reach files, programs or other databases, create temporary objects, or use the
/// host's functions for anything but itself.
#[tokio::test]
async fn a_plugin_with_any_sql_still_cannot_reach_the_host_or_another_plugin() {
    let host = spawn_host(&["orders", "testbed"]).await;
    let created = host
        .command(
            "orders",
            "CreateOrder",
            json!({ "customerId": "c-1", "amount": 5, "items": [] }),
        )
        .await;
    assert_eq!(created.status, 200, "{}", created.text);
    let role = host.plugin_role("testbed").await;
    let mut s = host.plugin_session("testbed").await;

    // It is itself, whatever it does to its role.
    assert_eq!(scalar(&mut s, "SELECT session_user::text").await, role);
    for escape in [
        "RESET ROLE",
        "SELECT set_config('role', 'none', false)",
        "SET SESSION AUTHORIZATION DEFAULT",
    ] {
        let _ = sqlstate(&mut s, escape).await;
        assert_eq!(
            scalar(&mut s, "SELECT current_user::text").await,
            role,
            "after {escape}"
        );
    }
    for (escape, code) in [
        (format!("SET ROLE {HOST_USER}"), "42501"),
        ("SET ROLE postgres".to_string(), "42501"),
        ("SET SESSION AUTHORIZATION postgres".to_string(), "42501"),
        (format!("GRANT {HOST_USER} TO CURRENT_USER"), "42501"),
        ("ALTER ROLE CURRENT_USER SUPERUSER".to_string(), "42501"),
        ("ALTER ROLE CURRENT_USER CREATEROLE".to_string(), "42501"),
        ("ALTER ROLE CURRENT_USER CONNECTION LIMIT -1".to_string(), "42501"),
        ("ALTER ROLE CURRENT_USER RESET temp_file_limit".to_string(), "42501"),
    ] {
        assert_eq!(sqlstate(&mut s, &escape).await.as_deref(), Some(code), "{escape}");
    }

    // The host's tables and another plugin's, in every direction.
    for sql in [
        "SELECT * FROM obx.outbox_event",
        "SELECT * FROM obx.plugin_credential",
        "SELECT * FROM obx.idempotency_key",
        "INSERT INTO obx.outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, topic, \
         partition_key, plugin_name, plugin_version) VALUES (gen_random_uuid(), 'Payment', 'p', \
         'PaymentCaptured', '{}', 'payment.events', 'p', 'payments', '1')",
        "UPDATE obx.outbox_event SET published_at = now()",
        "DELETE FROM obx.processed_event",
        "SELECT * FROM orders.orders",
        "UPDATE orders.orders SET amount = 0",
        "CREATE TABLE orders.planted (x int)",
        "CREATE VIEW testbed.peek AS SELECT * FROM orders.orders",
        "SELECT obx.session_plugin()",
        "SELECT obx.park_event('orders', gen_random_uuid(), 1, 'parked by another plugin')",
    ] {
        assert_eq!(sqlstate(&mut s, sql).await.as_deref(), Some("42501"), "{sql}");
    }
    // Whatever the server offers beyond its own schema.
    for sql in [
        "CREATE TEMPORARY TABLE uuid (x int)",
        "CREATE SCHEMA evil",
        "SELECT pg_read_file('/etc/passwd')",
        "COPY (SELECT 1) TO PROGRAM 'true'",
        "COPY testbed.items FROM '/etc/passwd'",
        "SELECT lo_import('/etc/passwd')",
        "CREATE EXTENSION dblink",
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename <> current_user",
        "ALTER SCHEMA orders OWNER TO CURRENT_USER",
        "DROP SCHEMA obx CASCADE",
    ] {
        let code = sqlstate(&mut s, sql).await;
        assert!(
            matches!(code.as_deref(), Some("42501" | "58P01" | "0A000")),
            "{sql}: {code:?}"
        );
    }
    // Its own schema is its own: a function there runs as the plugin, even as a definer.
    assert_eq!(
        sqlstate(
            &mut s,
            "CREATE FUNCTION testbed.whoami() RETURNS text SECURITY DEFINER LANGUAGE sql AS 'SELECT current_user::text'"
        )
        .await,
        None
    );
    assert_eq!(scalar(&mut s, "SELECT testbed.whoami()").await, role);

    // The host's functions act for the session's plugin only, and check what they are given.
    let emit = |topic: &str, event_type: &str| {
        format!(
            "SELECT obx_api.emit('9.9.9', NULL, ARRAY[gen_random_uuid()], ARRAY['Item'], ARRAY['forged'], \
             ARRAY['{event_type}'], ARRAY['{{}}'], ARRAY['{topic}'], ARRAY['forged'])"
        )
    };
    for (topic, event_type) in [
        ("__consumer_offsets", "ItemEmitted"),
        ("payment.events", "PaymentCaptured"),
        ("testbed.events", "Undeclared"),
    ] {
        assert_eq!(
            sqlstate(&mut s, &emit(topic, event_type)).await.as_deref(),
            Some("42501"),
            "{topic} {event_type}"
        );
    }
    assert_eq!(sqlstate(&mut s, &emit("testbed.events", "ItemEmitted")).await, None);
    let plugin_of_forged: String =
        sqlx::query_scalar("SELECT plugin_name FROM obx.outbox_event WHERE aggregate_id = 'forged'")
            .fetch_one(&host.db)
            .await
            .unwrap();
    assert_eq!(plugin_of_forged, "testbed", "an event is always its session's plugin's");
    let _ = sqlstate(&mut s, "SELECT * FROM obx_api.claim_idempotency_key('stolen', '\\x00')").await;
    assert_eq!(
        host.count("SELECT count(*) FROM obx.idempotency_key WHERE key = 'stolen' AND plugin = 'testbed'")
            .await,
        1
    );
    // A batch's records can be given back only by the transaction that made them: a plugin
    // cannot forget that an event it handled earlier was processed, and so have it run again.
    let handled = uuid::Uuid::new_v4();
    sqlx::query("INSERT INTO obx.processed_event (consumer, event_id) VALUES ('testbed', $1)")
        .bind(handled)
        .execute(&host.db)
        .await
        .unwrap();
    let forget = format!("SELECT obx_api.forget_events(ARRAY['{handled}'::uuid])");
    assert_eq!(sqlstate(&mut s, &forget).await, None);
    assert_eq!(
        host.count(&format!(
            "SELECT count(*) FROM obx.processed_event WHERE event_id = '{handled}'"
        ))
        .await,
        1
    );
    let too_many = "SELECT * FROM obx_api.begin_events(array_fill(gen_random_uuid(), ARRAY[65]), \
                    array_fill('t'::text, ARRAY[65]), array_fill('k'::text, ARRAY[65]))";
    assert_eq!(sqlstate(&mut s, too_many).await.as_deref(), Some("22023"));
    let _ = s.close().await;

    // The host serves both plugins as before.
    let ok = host.command("testbed", "ok", json!({ "id": "after" })).await;
    assert_eq!(ok.status, 200, "{}", ok.text);
    assert_eq!(host.count("SELECT count(*) FROM orders.orders").await, 1);
    host.shutdown().await;
}

/// A database whose schemas let PUBLIC create objects (`public` on a Postgres before 15, or
/// on a cluster upgraded from one), or that lets PUBLIC create schemas, is mended when the
/// host starts: a plugin past the SQL policy cannot keep tables or functions outside its own
/// schema, where the host never clears them and where a function named like a built-in is a
/// trap for an administrator whose `search_path` reaches it. Before, the host revoked only
/// `TEMPORARY`, and the plugin's `CREATE` went through.
#[tokio::test]
async fn a_plugin_cannot_create_objects_outside_its_schema_where_public_was_granted_it() {
    use sqlx::ConnectOptions;
    let url = fresh_database().await;
    let name = url.rsplit('/').next().unwrap().to_string();
    let admin_options: sqlx::postgres::PgConnectOptions = admin_url().parse().unwrap();
    let mut admin = admin_options.database(&name).connect().await.unwrap();
    for grant in [
        "GRANT CREATE ON SCHEMA public TO PUBLIC".to_string(),
        format!("GRANT CREATE ON DATABASE {name} TO PUBLIC"),
    ] {
        sqlx::query(&grant).execute(&mut admin).await.unwrap();
    }
    let _ = admin.close().await;
    let host = spawn_host_on(&url, &["testbed"], |_| {}).await;
    let mut session = host.plugin_session("testbed").await;
    for sql in [
        "CREATE TABLE public.planted (x int)",
        "CREATE FUNCTION public.lower(varchar) RETURNS text LANGUAGE sql AS 'SELECT 1'",
        "CREATE SCHEMA planted",
    ] {
        let e = sqlx::raw_sql(sql).execute(&mut session).await.expect_err(sql);
        let code = e.as_database_error().and_then(|d| d.code()).map(|c| c.to_string());
        assert_eq!(code.as_deref(), Some("42501"), "{sql}: {e}");
    }
    host.shutdown().await;
}

/// Whatever a call leaves on its session (session advisory locks, settings, cursors, LISTEN,
/// a transaction it never ended) is gone before the session serves another call.
#[tokio::test]
async fn nothing_a_call_leaves_on_its_session_survives_it() {
    let host = spawn_host_with(&["testbed"], |c| c.database.plugin_max_connections = 1).await;
    let sessions = host.host.sessions.clone();
    let probe = "SELECT pg_backend_pid(), \
        (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid())::int4 AS locks, \
        current_setting('work_mem') || ' ' || current_setting('statement_timeout') || ' ' || \
        current_setting('search_path') || ' ' || current_setting('client_min_messages') AS settings, \
        (SELECT count(*) FROM pg_cursors)::int4 AS cursors, \
        (SELECT count(*) FROM pg_listening_channels())::int4 AS listens";
    let clean = |row: &sqlx::postgres::PgRow| {
        (
            row.get::<i32, _>("locks"),
            row.get::<String, _>("settings"),
            row.get::<i32, _>("cursors"),
            row.get::<i32, _>("listens"),
        )
    };
    let mut tx = sessions.begin("testbed").await.unwrap();
    let before = sqlx::query(probe).fetch_one(&mut *tx).await.unwrap();
    let first_pid: i32 = before.get(0);
    let expected = clean(&before);
    assert_eq!(expected.0, 0);
    // Postgres sends a plugin session no notices (see `obx::telemetry`'s log filter).
    assert!(expected.1.ends_with(" error"), "{}", expected.1);
    for sql in [
        "SELECT pg_advisory_lock(7)",
        "SELECT pg_advisory_lock(hashtext('obx.plugin.testbed'))",
        "SET work_mem = '512MB'",
        "SET statement_timeout = 0",
        "SET client_min_messages = notice",
        "SELECT set_config('search_path', 'public', false)",
        "DECLARE kept CURSOR WITH HOLD FOR SELECT 1",
        "LISTEN obx_outbox",
    ] {
        sqlx::raw_sql(sql)
            .execute(&mut *tx)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    tx.commit().await.unwrap();

    let mut tx = sessions.begin("testbed").await.unwrap();
    let after = sqlx::query(probe).fetch_one(&mut *tx).await.unwrap();
    assert_eq!(
        after.get::<i32, _>(0),
        first_pid,
        "the pool of one gave the same session back"
    );
    assert_eq!(clean(&after), expected, "state survived a commit");

    // The same after a rollback: session advisory locks are not transactional. They are
    // released at once, not at the session's next call: held by an idle pooled session
    // (up to a minute), they would keep a plugin's locks, thousands of them, in the server's
    // shared lock table, which every session of every database needs.
    sqlx::raw_sql("SELECT pg_advisory_lock(8)")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let idle_locks = format!("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = {first_pid}");
    assert_eq!(
        host.count(&idle_locks).await,
        0,
        "an idle pooled session holds a plugin's lock"
    );
    let mut tx = sessions.begin("testbed").await.unwrap();
    let after = sqlx::query(probe).fetch_one(&mut *tx).await.unwrap();
    assert_eq!(after.get::<i32, _>(0), first_pid);
    assert_eq!(clean(&after), expected, "state survived a rollback");

    // A transaction that never ended (a lost call) closes its session: never reused.
    sqlx::raw_sql("SELECT pg_advisory_lock(9)")
        .execute(&mut *tx)
        .await
        .unwrap();
    drop(tx);
    let mut tx = sessions.begin("testbed").await.unwrap();
    let after = sqlx::query(probe).fetch_one(&mut *tx).await.unwrap();
    assert_ne!(
        after.get::<i32, _>(0),
        first_pid,
        "an unfinished session went back to the pool"
    );
    assert_eq!(clean(&after), expected);
    tx.rollback().await.unwrap();
    eventually(Duration::from_secs(5), "the dropped session's lock is gone", || async {
        host.count(
            "SELECT count(*) FROM pg_locks \
             WHERE locktype = 'advisory' AND classid = 0 AND objid = 9 AND objsubid = 1",
        )
        .await
            == 0
    })
    .await;

    // A session where the plugin made a prepared statement (one could take the name of the
    // host's own), or ended the host's transaction itself, is closed after the call. A call
    // whose transaction the plugin ended fails at its commit, and what the host writes at
    // the commit (its outbox rows, its Idempotency-Key answer) is not committed: it was,
    // in the round trip's implicit transaction, beside writes the plugin had rolled back.
    for tamper in [
        "DO $$ BEGIN EXECUTE 'PREPARE planted AS SELECT 1'; END $$",
        "COMMIT",
        "ROLLBACK",
        "ROLLBACK; BEGIN",
    ] {
        let mut tx = sessions.begin("testbed").await.unwrap();
        let pid = sqlx::query(probe).fetch_one(&mut *tx).await.unwrap().get::<i32, _>(0);
        sqlx::raw_sql(tamper).execute(&mut *tx).await.unwrap();
        sqlx::raw_sql("SET search_path = public")
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.write_at_commit("INSERT INTO testbed.items (id, note) VALUES ('at-commit', 'host')".into());
        let committed = tx.commit().await;
        let at_commit = host
            .count("SELECT count(*) FROM testbed.items WHERE id = 'at-commit'")
            .await;
        if tamper.starts_with("DO") {
            committed.unwrap();
            assert_eq!(at_commit, 1);
            sqlx::query("DELETE FROM testbed.items")
                .execute(&host.db)
                .await
                .unwrap();
        } else {
            let e = committed.expect_err(tamper);
            let code = e.as_database_error().and_then(|d| d.code()).map(|c| c.into_owned());
            assert_eq!(code.as_deref(), Some("OBX01"), "{tamper}: {e}");
            assert_eq!(at_commit, 0, "{tamper}: the host's writes at the commit went through");
        }
        let mut tx = sessions.begin("testbed").await.unwrap();
        let after = sqlx::query(probe).fetch_one(&mut *tx).await.unwrap();
        assert_ne!(after.get::<i32, _>(0), pid, "{tamper}: the session was reused");
        assert_eq!(clean(&after), expected, "{tamper}");
        let planted = host
            .count("SELECT count(*) FROM pg_prepared_statements WHERE from_sql")
            .await;
        assert_eq!(planted, 0);
        tx.rollback().await.unwrap();
    }
    // Nor can the plugin pass the check with an `=` of its own, ahead of pg_catalog's on its
    // search path (the check names the operator it compares with).
    let mut tx = sessions.begin("testbed").await.unwrap();
    sqlx::raw_sql(
        "CREATE FUNCTION testbed.always(bigint, bigint) RETURNS boolean LANGUAGE sql AS 'SELECT true'; \
         CREATE FUNCTION testbed.never(bigint, bigint) RETURNS boolean LANGUAGE sql AS 'SELECT false'; \
         CREATE OPERATOR testbed.= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = testbed.always); \
         CREATE OPERATOR testbed.<> (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = testbed.never); \
         COMMIT; SET search_path = testbed, pg_catalog",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.write_at_commit("INSERT INTO testbed.items (id, note) VALUES ('at-commit', 'host')".into());
    let e = tx
        .commit()
        .await
        .expect_err("a check passed with the plugin's operator");
    let code = e.as_database_error().and_then(|d| d.code()).map(|c| c.into_owned());
    assert_eq!(code.as_deref(), Some("OBX01"), "{e}");
    assert_eq!(
        host.count("SELECT count(*) FROM testbed.items WHERE id = 'at-commit'")
            .await,
        0
    );
    sqlx::raw_sql("DROP FUNCTION testbed.always, testbed.never CASCADE")
        .execute(&host.db)
        .await
        .unwrap();
    // A keyed rejection's commit rolls back to the handler's savepoint first: in a
    // transaction the plugin ended, that fails, and nothing commits either.
    for tamper in ["COMMIT", "ROLLBACK; BEGIN"] {
        let mut tx = sessions.begin("testbed").await.unwrap();
        sqlx::raw_sql(&format!("SAVEPOINT obx_handler; {tamper}"))
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.undo_at_commit_to("obx_handler");
        tx.write_at_commit("INSERT INTO testbed.items (id, note) VALUES ('at-commit', 'host')".into());
        tx.commit().await.expect_err(tamper);
        let at_commit = host
            .count("SELECT count(*) FROM testbed.items WHERE id = 'at-commit'")
            .await;
        assert_eq!(at_commit, 0, "{tamper}: the host's writes at the commit went through");
    }
    // A rollback clears what a plugin committed itself, too.
    let mut tx = sessions.begin("testbed").await.unwrap();
    sqlx::raw_sql("COMMIT; SET search_path = public; LISTEN obx_outbox")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let mut tx = sessions.begin("testbed").await.unwrap();
    let after = sqlx::query(probe).fetch_one(&mut *tx).await.unwrap();
    assert_eq!(
        clean(&after),
        expected,
        "state a plugin committed itself survived a rollback"
    );
    tx.rollback().await.unwrap();

    // And through the host: calls keep working on the cleaned session.
    let ok = host.command("testbed", "ok", json!({ "id": "clean" })).await;
    assert_eq!(ok.status, 200, "{}", ok.text);
    host.shutdown().await;
}

/// One plugin's slow calls use up its own sessions only: another plugin keeps answering.
#[tokio::test]
async fn a_slow_plugin_cannot_take_every_connection() {
    let host = spawn_host_with(&["orders", "testbed"], |c| {
        c.database.plugin_max_connections = 2;
        c.database.acquire_timeout = Duration::from_secs(10);
    })
    .await;
    let host = std::sync::Arc::new(host);
    // More calls that each hold a session until the call deadline (1.5 s) than the host
    // has connections of its own (20 in tests): with one shared pool they would take all.
    let slow: Vec<_> = (0..30)
        .map(|i| {
            let host = host.clone();
            tokio::spawn(async move { host.command("testbed", "loop", json!({ "id": format!("s{i}") })).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    for i in 0..5 {
        let a = host
            .command(
                "orders",
                "CreateOrder",
                json!({ "customerId": format!("c{i}"), "amount": 1, "items": [] }),
            )
            .await;
        assert_eq!(a.status, 200, "{}", a.text);
    }
    let took = started.elapsed();
    assert!(took < Duration::from_secs(3), "orders waited behind testbed: {took:?}");
    for call in slow {
        // Each ran to its deadline, or waited for one of testbed's two sessions and gave up.
        let a = call.await.unwrap();
        assert!(matches!(a.code(), "deadline_exceeded" | "busy"), "{}", a.text);
    }
    std::sync::Arc::try_unwrap(host).ok().unwrap().shutdown().await;
}

fn manifest(name: &str, migrations: &[&str]) -> Manifest {
    Manifest {
        name: name.into(),
        version: "1.0.0".into(),
        commands: vec![],
        subscriptions: vec![],
        emits: vec![EventDeclaration {
            topic: format!("{name}.events"),
            event_type: "Happened".into(),
        }],
        migrations: migrations
            .iter()
            .enumerate()
            .map(|(i, sql)| Migration {
                id: i as u32 + 1,
                name: format!("m{i}"),
                sql: sql.to_string(),
                statements: vec![],
            })
            .collect(),
        payloads: vec![],
    }
}

/// A migration is checked before it runs, and runs on the plugin's own session: one that
/// got past the policy meets the same wall as a handler.
#[tokio::test]
async fn hostile_migrations_are_refused_or_run_harmlessly() {
    let host = spawn_host(&["testbed"]).await;
    let limits = host.host.runtime.limits().clone();
    let prepare = |m: Manifest| {
        let (pool, sessions, limits) = (host.db.clone(), host.host.sessions.clone(), limits.clone());
        async move { obx::runtime::plugin_schema::prepare(&pool, &sessions, &m, &limits).await }
    };

    // Refused by the policy, before anything runs.
    let huge = format!("CREATE TABLE t (x int DEFAULT {})", vec!["1"; 1_000_000].join("+"));
    let deep = format!("CREATE TABLE t (x int DEFAULT {})", vec!["1"; 20_000].join("+"));
    for (sql, needle) in [
        ("CREATE TEMPORARY TABLE uuid (x int)", "temporary"),
        ("CREATE TEMP TABLE orders (x int)", "temporary"),
        (
            "CREATE TABLE t (x int DEFAULT (('x')).pg_advisory_lock)",
            "attribute notation",
        ),
        (
            "CREATE TABLE t (x text DEFAULT ('SELECT 1').ts_stat::text)",
            "attribute notation",
        ),
        (huge.as_str(), "bytes"),
        (deep.as_str(), "too deeply"),
    ] {
        let started = Instant::now();
        let e = manifest("hostile", &[sql])
            .validate(limits.max_statement_bytes)
            .unwrap_err();
        assert!(e.contains(needle), "{}: {e}", &sql[..sql.len().min(60)]);
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "checking took {:?}",
            started.elapsed()
        );
    }

    // Past the policy (statements set by hand, as if it had a hole): Postgres refuses.
    for sql in [
        "SELECT set_config('role', 'none', true); CREATE TABLE obx.planted (x int)",
        "RESET ROLE; INSERT INTO obx.outbox_event DEFAULT VALUES",
        "CREATE TEMPORARY TABLE uuid (x int)",
        "UPDATE testbed.items SET note = 'mine'",
    ] {
        let mut m = manifest("hostile", &[sql]);
        m.migrations[0].statements = sql.split("; ").map(String::from).collect();
        let e = prepare(m).await.unwrap_err().to_string();
        assert!(e.contains("permission denied"), "{sql}: {e}");
    }
    assert_eq!(
        host.count("SELECT count(*) FROM pg_class WHERE relname = 'planted' OR relpersistence = 't'")
            .await,
        0
    );
    assert_eq!(
        host.count("SELECT count(*) FROM obx.plugin_migration WHERE plugin = 'hostile'")
            .await,
        0
    );
    // A sound one still applies, and the host still serves.
    let mut m = manifest("hostile", &["CREATE TABLE notes (id int PRIMARY KEY)"]);
    m.validate(limits.max_statement_bytes).unwrap();
    prepare(m).await.unwrap();
    let ok = host.command("testbed", "ok", json!({ "id": "still" })).await;
    assert_eq!(ok.status, 200);
    host.shutdown().await;
}

/// A plugin's migrations may not leave more relations in its schema than
/// `limits.max_relations`: a statement on a table with thousands of inheritance children locks
/// each of them, and enough such locks fill the lock table every session of the server shares.
#[tokio::test]
async fn migrations_that_would_leave_too_many_relations_are_refused() {
    let host = spawn_host(&["testbed"]).await;
    let prepare = |m: Manifest, max_relations: u32| {
        let mut limits = host.host.runtime.limits().clone();
        limits.max_relations = max_relations;
        let (pool, sessions) = (host.db.clone(), host.host.sessions.clone());
        async move {
            let mut m = m;
            m.validate(limits.max_statement_bytes).unwrap();
            obx::runtime::plugin_schema::prepare(&pool, &sessions, &m, &limits).await
        }
    };
    let children = |n: usize| {
        (0..n)
            .map(|i| format!("CREATE TABLE c{i} () INHERITS (p)"))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let relations = "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                     WHERE n.nspname = 'crowded'";

    let crowded = children(20);
    let e = prepare(manifest("crowded", &["CREATE TABLE p (x int)", &crowded]), 20)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("21 relations") && e.contains("limits.max_relations (20)"),
        "{e}"
    );
    // None of the migrations stayed, the first one neither.
    assert_eq!(host.count(relations).await, 0);
    assert_eq!(
        host.count("SELECT count(*) FROM obx.plugin_migration WHERE plugin = 'crowded'")
            .await,
        0
    );

    // A table's TOAST table and its index count too: they are locked with it.
    let e = prepare(manifest("crowded", &["CREATE TABLE t (x text)"]), 2)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("3 relations"), "{e}");

    // Within the bound they apply; a schema over a bound lowered later still loads, and a
    // migration that leaves it smaller applies.
    let fitting = children(19);
    let fits = |more: &'static [&'static str]| {
        let mut migrations = vec!["CREATE TABLE p (x int)", fitting.as_str()];
        migrations.extend(more);
        manifest("crowded", &migrations)
    };
    prepare(fits(&[]), 20).await.unwrap();
    assert_eq!(host.count(relations).await, 20);
    prepare(fits(&[]), 10).await.unwrap();
    prepare(fits(&["DROP TABLE c0"]), 10).await.unwrap();
    assert_eq!(host.count(relations).await, 19);
    let e = prepare(
        fits(&[
            "DROP TABLE c0",
            "CREATE TABLE c0 () INHERITS (p); CREATE TABLE c20 () INHERITS (p)",
        ]),
        10,
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(e.contains("20 relations"), "{e}");
    host.shutdown().await;
}

/// A plugin may not take a name that puts its schema in someone's search path: the host's
/// user, any other role, an existing schema, or one the host keeps.
#[tokio::test]
async fn plugin_names_that_could_redirect_a_search_path_are_refused() {
    let host = spawn_host(&["testbed"]).await;
    let limits = host.host.runtime.limits().clone();
    for name in ["obx", "public", "postgres", "pg_evil", "obx_api", "information_schema"] {
        let e = manifest(name, &[]).validate(limits.max_statement_bytes).unwrap_err();
        assert!(e.contains("reserved"), "{name}: {e}");
    }
    let mut admin = PgConnection::connect(&admin_url()).await.unwrap();
    let role = format!("someone_{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    sqlx::raw_sql(&format!("CREATE ROLE {role}"))
        .execute(&mut admin)
        .await
        .unwrap();
    sqlx::raw_sql("CREATE SCHEMA squatted").execute(&host.db).await.unwrap();
    for name in [HOST_USER, role.as_str(), "squatted"] {
        let m = manifest(name, &[]);
        let e = obx::runtime::plugin_schema::prepare(&host.db, &host.host.sessions, &m, &limits)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("reserved"), "{name}: {e}");
    }
    sqlx::raw_sql(&format!("DROP ROLE {role}"))
        .execute(&mut admin)
        .await
        .unwrap();
    host.shutdown().await;
}

/// A host whose database user is named `obx`, like the schema it keeps, restarts: its
/// search path is pinned, so `"$user"` does not move sqlx's history between starts. A host
/// from before the pin, whose history sits in `public`, has it moved, not replayed.
#[tokio::test]
async fn a_host_whose_user_is_named_obx_restarts() {
    let mut admin = PgConnection::connect(&admin_url()).await.unwrap();
    obx::db::embedded::create_host_user(&mut admin, "obx", "obx-user-password")
        .await
        .unwrap();
    let db = format!("obx_named_{}", uuid::Uuid::new_v4().simple());
    obx::db::embedded::create_database(&mut admin, &db, "obx")
        .await
        .unwrap();
    let url = database_url(&db)
        .replacen(HOST_USER, "obx", 1)
        .replacen(HOST_PASSWORD, "obx-user-password", 1);
    for start in 0..3 {
        let host = spawn_host_on(&url, &["testbed"], |_| {}).await;
        let ok = host
            .command("testbed", "ok", json!({ "id": format!("start-{start}") }))
            .await;
        assert_eq!(ok.status, 200, "start {start}: {}", ok.text);
        assert_eq!(
            host.count("SELECT count(*) FROM pg_tables WHERE tablename = '_sqlx_migrations'")
                .await,
            1
        );
        assert_eq!(
            host.count("SELECT count(*) FROM pg_tables WHERE tablename = '_sqlx_migrations' AND schemaname = 'obx'")
                .await,
            1
        );
        if start == 1 {
            // As a host before the pin left it.
            sqlx::raw_sql("ALTER TABLE obx._sqlx_migrations SET SCHEMA public")
                .execute(&host.db)
                .await
                .unwrap();
        }
        host.shutdown().await;
    }
}

/// A prepared transaction outlives its session, with its locks: a plugin could leave one
/// holding the relay's, which only its owner or a superuser can end. A host refuses to
/// start on a server that allows them, and says why.
#[tokio::test]
async fn a_host_refuses_a_server_that_allows_prepared_transactions() {
    let pg = tokio::task::spawn_blocking(|| {
        obx::db::embedded::EmbeddedPostgres::start(&[("max_prepared_transactions", "2")])
    })
    .await
    .unwrap()
    .unwrap();
    let url = obx::db::embedded::create_owner(&pg.url("postgres"), "obx", "obx-user-password", "obx")
        .await
        .unwrap();
    let plugins = tempfile::tempdir().unwrap();
    let e = obx::app::start(test_config(&url, plugins.path()))
        .await
        .err()
        .expect("the host refused the server")
        .to_string();
    assert!(e.contains("max_prepared_transactions = 2"), "{e}");
}

/// A host starts on a database that a newer host of the service has migrated further (a
/// rolling upgrade, with this host restarted meanwhile): the newer migrations keep the previous
/// version working. sqlx refused it before ("migration 9999 was previously applied but is
/// missing"), so the old host could not come back until it was upgraded.
#[tokio::test]
async fn a_host_starts_on_a_schema_a_newer_host_migrated() {
    let host = spawn_host(&["testbed"]).await;
    let url = host.database_url.clone();
    sqlx::raw_sql(
        "INSERT INTO obx._sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (9999, 'from a newer host', true, '\\x00', 0)",
    )
    .execute(&host.db)
    .await
    .unwrap();
    host.shutdown().await;
    let host = spawn_host_on(&url, &["testbed"], |_| {}).await;
    let ok = host.command("testbed", "ok", json!({ "id": "after" })).await;
    assert_eq!(ok.status, 200, "{}", ok.text);
    host.shutdown().await;
}

/// Plugins emit only what their manifest declares, never to Kafka's own topics, and never a
/// payload the producer could not send.
#[tokio::test]
async fn emits_are_limited_to_declared_events_that_can_be_delivered() {
    let host = spawn_host(&["testbed"]).await;
    for (case, body) in [
        ("an undeclared topic", json!({ "id": "a", "topic": "payment.events" })),
        ("Kafka's own topic", json!({ "id": "b", "topic": "__consumer_offsets" })),
        (
            "an undeclared event type",
            json!({ "id": "c", "topic": "testbed.events", "event_type": "PaymentCaptured" }),
        ),
        (
            "a payload the producer cannot send",
            json!({ "id": "d", "topic": "testbed.events", "payload_bytes": 1_040_000 }),
        ),
    ] {
        let a = host.command("testbed", "emit", body).await;
        assert_eq!((a.status, a.code()), (500, "transaction_aborted"), "{case}: {}", a.text);
    }
    assert_eq!(host.count("SELECT count(*) FROM obx.outbox_event").await, 0);
    let a = host
        .command("testbed", "emit", json!({ "id": "e", "topic": "testbed.events" }))
        .await;
    assert_eq!(a.status, 200, "{}", a.text);
    assert_eq!(host.count("SELECT count(*) FROM obx.outbox_event").await, 1);
    host.shutdown().await;
}

/// Event ids are one namespace (the outbox's unique index, every consumer's record of what it
/// processed), but the database makes every id a plugin's session passes the plugin's own:
/// given another plugin's event id, a plugin emits an event of another id, and that plugin's
/// event stays as it was, whether the id goes through `emit` or the session calls
/// `obx_api.emit` itself. The same id given twice is still one event.
#[tokio::test]
async fn a_plugin_cannot_emit_another_plugins_event_ids() {
    let host = spawn_host(&["testbed", "orders"]).await;
    for customer in ["c-1", "c-2"] {
        let order = host
            .command("orders", "CreateOrder", json!({ "customerId": customer, "amount": 5 }))
            .await;
        assert_eq!(order.status, 200, "{}", order.text);
    }
    let orders: Vec<uuid::Uuid> =
        sqlx::query_scalar("SELECT event_id FROM obx.outbox_event WHERE plugin_name = 'orders' ORDER BY id")
            .fetch_all(&host.db)
            .await
            .unwrap();
    let (theirs, also_theirs) = (orders[0], orders[1]);

    let emit = |id: &'static str, given: String| {
        host.command(
            "testbed",
            "emit",
            json!({ "id": id, "topic": "testbed.events", "event_id": given }),
        )
    };
    let a = emit("taken", theirs.to_string()).await;
    assert_eq!(a.status, 200, "{}", a.text);
    let ours = a.body["ids"][0].as_str().unwrap().to_string();
    assert_ne!(ours, theirs.to_string());
    let owners: Vec<(String, String)> =
        sqlx::query_as("SELECT event_id::text, plugin_name FROM obx.outbox_event ORDER BY id")
            .fetch_all(&host.db)
            .await
            .unwrap();
    assert_eq!(
        owners,
        [
            (theirs.to_string(), "orders".into()),
            (also_theirs.to_string(), "orders".into()),
            (ours.clone(), "testbed".into())
        ]
    );

    // Given again, the same id is the same event: the second emit is refused at the commit.
    let again = emit("again", theirs.to_string()).await;
    assert_eq!(
        (again.status, again.code()),
        (500, "transaction_aborted"),
        "{}",
        again.text
    );
    assert_eq!(host.count("SELECT count(*) FROM obx.outbox_event").await, 3);

    // The wall is the database's: a session that calls obx_api.emit itself, with another of
    // the other plugin's ids, writes an id of its own, computed as the host computes it.
    let mut s = host.plugin_session("testbed").await;
    let mut tx = s.begin().await.unwrap();
    sqlx::query(
        "SELECT obx_api.emit('1', NULL, ARRAY[$1]::uuid[], ARRAY['Item'], ARRAY['i'], ARRAY['ItemEmitted'], \
         ARRAY['{}'], ARRAY['testbed.events'], ARRAY['k'])",
    )
    .bind(also_theirs)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    s.close().await.unwrap();
    let written: Vec<uuid::Uuid> =
        sqlx::query_scalar("SELECT event_id FROM obx.outbox_event WHERE plugin_name = 'testbed' ORDER BY id")
            .fetch_all(&host.db)
            .await
            .unwrap();
    assert_eq!(
        written,
        [
            ours.parse().unwrap(),
            obx::outbox::stored_event_id(&host.plugin_role("testbed").await, also_theirs)
        ]
    );
    host.shutdown().await;
}

/// `jsonb` prints every number in full, and the relay publishes a payload as `jsonb` prints
/// it: 90 KB of `1e131071` prints as 1.3 GB, past what Postgres can print. Such an event,
/// emitted from the plugin's session, was stored, and every claim of its relay shard failed
/// on it ("out of memory"), so no plugin's event on that shard was published again. The
/// database now refuses any payload that prints past the bound (migration 0035; 600 such
/// numbers print as 79 MB), as the host does before it (`outbox::tests::refuses_bad_fields`
/// has the host's reason: here the call fails either way); the relay keeps flowing.
#[tokio::test]
async fn a_payload_that_prints_past_its_bound_is_refused_and_the_relay_flows_on() {
    let host = spawn_host(&["testbed"]).await;
    let numbers = |n: usize| format!("[{}1]", "1e131071,".repeat(n - 1));
    // Through the outbox import: refused at the emit, nothing of the call committed.
    let a = host
        .command("testbed", "emit", json!({ "id": "wide", "payload_text": numbers(600) }))
        .await;
    assert_eq!((a.status, a.code()), (500, "transaction_aborted"), "{}", a.text);
    // Straight from the plugin's session: the database refuses it too.
    let mut s = host.plugin_session("testbed").await;
    let event = |payload: &str| {
        format!(
            "SELECT obx_api.emit('1', NULL, ARRAY[gen_random_uuid()], ARRAY['Item'], ARRAY['i'], \
             ARRAY['ItemEmitted'], ARRAY['{payload}'], ARRAY['testbed.events'], ARRAY['k'])"
        )
    };
    let refused = sqlx::query(&event(&numbers(600))).execute(&mut s).await.unwrap_err();
    assert!(refused.to_string().contains("as jsonb prints it"), "{refused}");
    s.close().await.unwrap();
    assert_eq!(host.count("SELECT count(*) FROM obx.outbox_event").await, 0);
    an_event_emitted_now_is_published(&host).await;
    host.shutdown().await;
}

/// Called straight from a plugin session, `obx_api.emit_calls` (what the host calls),
/// `obx_api.emit_each` and `obx_api.emit` (kept for hosts of previous versions, written on
/// it) refuse each bad
/// event with its reason and its place, alone and behind a good one, and write none of the
/// call's events.
#[tokio::test]
async fn emit_refuses_each_bad_event_with_its_reason_and_writes_nothing() {
    let host = spawn_host(&["testbed"]).await;
    let mut s = host.plugin_session("testbed").await;
    let good = "gen_random_uuid(), 'Item', 'i', 'ItemEmitted', '{}', 'testbed.events', 'k'";
    for (bad, why) in [
        (
            "NULL, 'Item', 'i', 'ItemEmitted', '{}', 'testbed.events', 'k'",
            "no event id or payload",
        ),
        (
            "gen_random_uuid(), 'Item', 'i', 'ItemEmitted', NULL, 'testbed.events', 'k'",
            "no event id or payload",
        ),
        (
            "gen_random_uuid(), '', 'i', 'ItemEmitted', '{}', 'testbed.events', 'k'",
            "must be 1-1024 bytes",
        ),
        (
            "gen_random_uuid(), 'Item', 'i', 'ItemEmitted', '{}', 'testbed.events', NULL",
            "must be 1-1024 bytes",
        ),
        (
            "gen_random_uuid(), 'Item', repeat('i',1025), 'ItemEmitted', '{}', 'testbed.events', 'k'",
            "must be 1-1024 bytes",
        ),
        (
            "gen_random_uuid(), 'Item', 'i', 'ItemEmitted', '{}', '__consumer_offsets', 'k'",
            "is not declared",
        ),
        (
            "gen_random_uuid(), 'Item', 'i', 'Undeclared', '{}', 'testbed.events', 'k'",
            "is not declared",
        ),
        (
            "gen_random_uuid(), 'Item', 'i', 'PaymentCaptured', '{}', 'payment.events', 'k'",
            "is not declared",
        ),
        (
            "gen_random_uuid(), 'Item', 'i', 'ItemEmitted', '\"' || repeat('x',983040) || '\"', 'testbed.events', 'k'",
            "over the limit",
        ),
    ] {
        for (events, n) in [(vec![bad], 1), (vec![good, bad], 2)] {
            let traceparents = &["tp"; 2][..events.len()];
            let calls = &[1; 2][..events.len()];
            for sql in [
                emit_sql(&events),
                emit_each_sql(&events, traceparents),
                emit_calls_sql(&events, calls, traceparents),
            ] {
                let e = sqlx::raw_sql(&sql).execute(&mut s).await.expect_err(&sql);
                let d = e.as_database_error().expect("a database error");
                assert_eq!(d.code().as_deref(), Some("42501"), "{bad}: {d}");
                assert!(
                    d.message().contains(&format!("event {n}: ")) && d.message().contains(why),
                    "{bad}: {d}"
                );
            }
        }
    }
    // Each event's trace context is held to 128 bytes, and there is one for each event.
    let long = "x".repeat(129);
    let e = sqlx::raw_sql(&emit_each_sql(&[good, good], &["tp", &long]))
        .execute(&mut s)
        .await
        .unwrap_err();
    let d = e.as_database_error().expect("a database error");
    assert_eq!(d.code().as_deref(), Some("42501"), "{d}");
    assert!(
        d.message().contains("event 2: the trace context is over 128 bytes"),
        "{d}"
    );
    let e = sqlx::raw_sql(&emit_each_sql(&[good, good], &["tp"]))
        .execute(&mut s)
        .await
        .unwrap_err();
    assert_eq!(
        e.as_database_error().and_then(|d| d.code()).as_deref(),
        Some("22023"),
        "{e}"
    );
    assert_eq!(host.count("SELECT count(*) FROM obx.outbox_event").await, 0);
    // One good event is written, as the session's plugin's.
    let one = emit_sql(&[good]);
    sqlx::raw_sql(&one).execute(&mut s).await.unwrap();
    assert_eq!(
        host.count("SELECT count(*) FROM obx.outbox_event WHERE plugin_name = 'testbed' AND payload = '{}'")
            .await,
        1
    );
    host.shutdown().await;
}

/// `obx_api.emit_calls` holds each call of a statement to the plugin's limits, not the whole
/// statement (a batch's rows go in one): with four events and 10 payload bytes a call, two
/// calls of three events pass, one call of six does not, nor a call over the bytes, though
/// calls within them pass together; and call
/// sizes that do not add up to the events are refused once they matter, and arrays with
/// other bounds than 1 are counted as written. Nothing refused is written.
#[tokio::test]
async fn emit_calls_holds_each_call_of_a_statement_to_the_limits() {
    let host = spawn_host(&["testbed"]).await;
    host.limits_recorded_by_another_host("testbed", "max_emits_per_call = 4, max_emit_bytes_per_call = 10")
        .await;
    let mut s = host.plugin_session("testbed").await;
    let small = "gen_random_uuid(), 'Item', 'i', 'ItemEmitted', '{}', 'testbed.events', 'k'";
    let big = "gen_random_uuid(), 'Item', 'i', 'ItemEmitted', '\"abcdefghij\"', 'testbed.events', 'k'";
    let mid = "gen_random_uuid(), 'Item', 'i', 'ItemEmitted', '\"abcd\"', 'testbed.events', 'k'";
    let six = [small; 6];
    for (events, calls, refused) in [
        (&six[..], &[6][..], Some(("54000", "at most 4 events"))),
        (&six[..], &[3, 2][..], Some(("22023", "do not add up"))),
        (&six[..], &[3, 4][..], Some(("22023", "do not add up"))),
        (&six[..], &[0, 6][..], Some(("22023", "do not add up"))),
        (&six[..], &[][..], Some(("22023", "do not add up"))),
        (
            &[small, small, big][..],
            &[2, 1][..],
            Some(("54000", "at most 10 payload bytes")),
        ),
        (&six[..], &[3, 3][..], None),
        (&six[..], &[1; 6][..], None),
        (&[mid, mid, small][..], &[1, 2][..], None),
    ] {
        let sql = emit_calls_sql(events, calls, &vec!["tp"; events.len()]);
        let before = host.count("SELECT count(*) FROM obx.outbox_event").await;
        let result = sqlx::raw_sql(&sql).execute(&mut s).await;
        let after = host.count("SELECT count(*) FROM obx.outbox_event").await;
        match refused {
            Some((code, why)) => {
                let e = result.expect_err(&sql);
                let d = e.as_database_error().expect("a database error");
                assert_eq!(d.code().as_deref(), Some(code), "{calls:?}: {d}");
                assert!(d.message().contains(why), "{calls:?}: {d}");
                assert_eq!(after, before, "{calls:?}: nothing written");
            }
            None => {
                result.expect(&sql);
                assert_eq!(after - before, events.len() as i64, "{calls:?}");
            }
        }
    }
    // Arrays whose bounds do not start at 1 are counted as they are written: the first
    // payload, over the bytes of a call, is found in its call all the same.
    let sql = emit_calls_sql(&[big, small, small], &[1, 2], &["tp"; 3]).replace(
        r#"ARRAY['"abcdefghij"', '{}', '{}']::text[]"#,
        r#"'[0:2]={"\"abcdefghij\"","{}","{}"}'::text[]"#,
    );
    assert!(sql.contains("[0:2]"), "{sql}");
    let e = sqlx::raw_sql(&sql).execute(&mut s).await.expect_err(&sql);
    let d = e.as_database_error().expect("a database error");
    assert_eq!(d.code().as_deref(), Some("54000"), "{d}");
    host.shutdown().await;
}

/// The host's default limits of one call's events, which one outbox statement keeps to.
const PER_STATEMENT: obx::outbox::writer::PerStatement = obx::outbox::writer::PerStatement {
    events: 1000,
    payload_bytes: 16 << 20,
};

/// The host writes a call's outbox rows at its commit, as SQL text on the plugin's own session
/// and after whatever the plugin did to it. With the session's string syntax, client encoding
/// and search path set against that text, values made of quotes, backslashes, array syntax and
/// characters outside ASCII are still stored exactly as given, and the host's check before the
/// commit still runs; an event `obx_api.emit` refuses fails the commit, domain write and all.
#[tokio::test]
async fn outbox_rows_written_at_commit_are_stored_as_given_whatever_the_session_settings() {
    let host = spawn_host(&["testbed"]).await;
    let schema: String = sqlx::query_scalar("SELECT schema_name FROM obx.plugin WHERE name = 'testbed'")
        .fetch_one(&host.db)
        .await
        .unwrap();
    let values = [
        "it's",
        "back\\slash\\'",
        "'); COMMIT; SELECT ('",
        "\u{30bd}\u{8868}\\'x",
        "\u{1f600}\u{7f}\u{e9}\t\n",
        "\"{},NULL\"",
        "NULL",
    ];
    let event = |value: &str, delay_ms: u64| obx::outbox::NewEvent {
        event_id: uuid::Uuid::now_v7(),
        aggregate_type: "Item".into(),
        aggregate_id: value.into(),
        event_type: "ItemEmitted".into(),
        payload: json!({ "s": value }).to_string(),
        topic: "testbed.events".into(),
        partition_key: format!("{value}-key"),
        delay_ms,
    };
    let hostile = format!(
        "CREATE TYPE \"{schema}\".text AS (x int); CREATE TYPE \"{schema}\".uuid AS (x int); \
         SET search_path = \"{schema}\", pg_catalog; SET standard_conforming_strings = off; \
         SET backslash_quote = on; SET client_encoding = 'SJIS'"
    );
    let mut events: Vec<_> = values.iter().map(|v| event(v, 0)).collect();
    events.push(event("later's", 3_600_000));
    let tampered = format!(
        "obx_plugin_sessions_tampered_total{{role=\"{}\"}}",
        host.plugin_role("testbed").await
    );
    let mut tx = host.host.sessions.begin("testbed").await.unwrap();
    sqlx::raw_sql(&hostile).execute(&mut *tx).await.unwrap();
    // Two calls' rows, as a batch of consumed events writes them: each call's trace context
    // on its own rows.
    let traces = [
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "t'\"{},NULL\\'",
    ];
    let calls = [
        obx::outbox::writer::CallRows {
            version: "0.1.0",
            traceparent: traces[0],
            events: &events[..3],
        },
        obx::outbox::writer::CallRows {
            version: "0.1.0",
            traceparent: traces[1],
            events: &events[3..],
        },
    ];
    obx::outbox::writer::insert_at_commit(&mut tx, &calls, PER_STATEMENT);
    tx.commit().await.expect("the commit, with the outbox rows");

    let rows: Vec<(String, String, String, String, String)> = sqlx::query_as(
        "SELECT aggregate_id, partition_key, payload->>'s', plugin_name, traceparent FROM obx.outbox_event \
         ORDER BY id",
    )
    .fetch_all(&host.db)
    .await
    .unwrap();
    let expected: Vec<_> = values
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let trace = traces[usize::from(i >= 3)].to_string();
            (
                v.to_string(),
                format!("{v}-key"),
                v.to_string(),
                "testbed".to_string(),
                trace,
            )
        })
        .collect();
    assert_eq!(rows, expected);
    let delayed: (String, String) = sqlx::query_as("SELECT aggregate_id, payload->>'s' FROM obx.outbox_delayed")
        .fetch_one(&host.db)
        .await
        .unwrap();
    assert_eq!(delayed, ("later's".to_string(), "later's".to_string()));

    // The check before the commit found the host's own transaction.
    assert_eq!(metric_value(&tampered), 0.0, "the session was taken for tampered with");

    // A refused event fails the commit: neither the domain write nor any event is kept.
    let mut tx = host.host.sessions.begin("testbed").await.unwrap();
    sqlx::raw_sql("INSERT INTO items (id, note) VALUES ('refused', 'x')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let mut refused = event("refused", 0);
    refused.event_type = "Undeclared".into();
    let call = obx::outbox::writer::CallRows {
        version: "0.1.0",
        traceparent: traces[0],
        events: &[event("fine", 0), refused],
    };
    obx::outbox::writer::insert_at_commit(&mut tx, &[call], PER_STATEMENT);
    let e = tx
        .commit()
        .await
        .expect_err("an undeclared event refused at the commit");
    let d = e.as_database_error().expect("a database error");
    assert_eq!(d.code().as_deref(), Some("42501"), "{d}");
    assert!(
        d.message().contains("event 2: ") && d.message().contains("is not declared"),
        "{d}"
    );
    assert_eq!(
        host.count("SELECT count(*) FROM obx.outbox_event").await,
        values.len() as i64
    );
    assert_eq!(
        host.count(&format!("SELECT count(*) FROM \"{schema}\".items WHERE id = 'refused'"))
            .await,
        0
    );
    host.shutdown().await;
}

/// A call of `obx_api.emit` with `events`, each given as its seven comma-separated SQL
/// values (none holds a comma), turned into the function's seven arrays.
fn emit_sql(events: &[&str]) -> String {
    format!("SELECT obx_api.emit('1', NULL, {})", emit_arrays(events))
}

/// The seven arrays of `events` (see [`emit_sql`]), comma-separated.
fn emit_arrays(events: &[&str]) -> String {
    let arrays: Vec<String> = (0..7)
        .map(|i| {
            let column: Vec<&str> = events
                .iter()
                .map(|e| e.split(", ").nth(i).expect("seven values"))
                .collect();
            let of = if i == 0 { "uuid" } else { "text" };
            format!("ARRAY[{}]::{of}[]", column.join(", "))
        })
        .collect();
    arrays.join(", ")
}

/// A call of `obx_api.emit_each` with `events`, as [`emit_sql`] takes them, and a trace
/// context for each of `traceparents`.
fn emit_each_sql(events: &[&str], traceparents: &[&str]) -> String {
    let traceparents: Vec<String> = traceparents.iter().map(|t| format!("'{t}'")).collect();
    format!(
        "SELECT obx_api.emit_each('1', ARRAY[{}]::text[], {})",
        traceparents.join(", "),
        emit_arrays(events)
    )
}

/// A call of `obx_api.emit_calls` with `events`, as [`emit_sql`] takes them, made by calls of
/// the sizes `calls`, and a trace context for each of `traceparents`.
fn emit_calls_sql(events: &[&str], calls: &[i32], traceparents: &[&str]) -> String {
    let calls: Vec<String> = calls.iter().map(i32::to_string).collect();
    let traceparents: Vec<String> = traceparents.iter().map(|t| format!("'{t}'")).collect();
    format!(
        "SELECT obx_api.emit_calls('1', ARRAY[{}]::int4[], ARRAY[{}]::text[], {})",
        calls.join(", "),
        traceparents.join(", "),
        emit_arrays(events)
    )
}

/// A plugin may change its own role's password (Postgres lets every role); the host then sets
/// a new one at its next login. Its role's connection limit is not the plugin's to change.
#[tokio::test]
async fn a_plugin_that_changes_its_password_is_given_a_new_one() {
    let host = spawn_host(&["testbed"]).await;
    let role = host.plugin_role("testbed").await;
    let limit = host
        .count(&format!(
            "SELECT rolconnlimit::int8 FROM pg_roles WHERE rolname = '{role}'"
        ))
        .await;
    assert_eq!(limit, 64);
    let mut s = host.plugin_session("testbed").await;
    sqlx::raw_sql("ALTER ROLE CURRENT_USER PASSWORD 'chosen-by-the-author'")
        .execute(&mut s)
        .await
        .unwrap();
    let _ = s.close().await;
    // Every open session of the plugin ends, so the host must log in again.
    let mut admin = PgConnection::connect(&admin_url()).await.unwrap();
    sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1")
        .bind(&role)
        .execute(&mut admin)
        .await
        .unwrap();
    let ok = host.command("testbed", "ok", json!({ "id": "relogin" })).await;
    assert_eq!(ok.status, 200, "{}", ok.text);
    // The author's password no longer works.
    let options: sqlx::postgres::PgConnectOptions = host.database_url.parse().unwrap();
    let chosen = sqlx::ConnectOptions::connect(&options.username(&role).password("chosen-by-the-author")).await;
    assert!(chosen.is_err(), "the author's own password still logs in");
    host.shutdown().await;
}

/// With two hosts, the one refused second takes the password the first set rather than set
/// another: each set one in turn, undoing the other's, so that a host whose sessions had to
/// log in again was refused (its own new password a minute old at most: it sets none then).
#[tokio::test]
async fn two_hosts_refused_the_plugins_password_agree_on_the_new_one() {
    let a = spawn_host(&["testbed"]).await;
    let b = spawn_host_on(&a.database_url, &["testbed"], |_| {}).await;
    let role = a.plugin_role("testbed").await;
    let admin = sqlx::PgPool::connect(&admin_url()).await.unwrap();
    // Every open session of the plugin ends, so that the host must log in again.
    let logged_out = || async {
        sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1")
            .bind(&role)
            .execute(&admin)
            .await
            .unwrap();
    };
    for (host, id) in [(&a, "a0"), (&b, "b0")] {
        let ok = host.command("testbed", "ok", json!({ "id": id })).await;
        assert_eq!(ok.status, 200, "{}", ok.text);
    }
    let mut s = a.plugin_session("testbed").await;
    sqlx::raw_sql("ALTER ROLE CURRENT_USER PASSWORD 'chosen-by-the-author'")
        .execute(&mut s)
        .await
        .unwrap();
    let _ = s.close().await;
    for (host, id) in [(&a, "a1"), (&b, "b1"), (&a, "a2"), (&b, "b2")] {
        logged_out().await;
        let ok = host.command("testbed", "ok", json!({ "id": id })).await;
        assert_eq!(ok.status, 200, "{id}: {}", ok.text);
    }
    b.shutdown().await;
    a.shutdown().await;
}

/// A plugin session that holds the host's migration lock (sqlx's advisory lock, whose key
/// anyone can compute from the database's name) does not keep hosts from starting: the host
/// ends it, and bounds its wait. Before, `migrate` waited for it with no bound, at every
/// start of every host of the service.
#[tokio::test]
async fn a_plugin_session_that_holds_the_migration_lock_does_not_stop_a_host_from_starting() {
    let host = spawn_host(&["testbed"]).await;
    let mut session = host.plugin_session("testbed").await;
    let database: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(&mut session)
        .await
        .unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(obx::db::migration_lock_key(&database))
        .execute(&mut session)
        .await
        .unwrap();
    let migrated = tokio::time::timeout(Duration::from_secs(30), obx::db::migrate(&host.host.pool)).await;
    migrated
        .expect("the migrations waited 30 s for the plugin's lock")
        .unwrap();
    assert!(
        sqlx::query("SELECT 1").execute(&mut session).await.is_err(),
        "the plugin's session was ended"
    );
    host.shutdown().await;
}

/// Plugin code that runs at a `COMMIT` (a deferred trigger) cannot make the commit run for
/// ever. Postgres turns the statement timeout off before a `COMMIT` runs its deferred
/// triggers, and a session may change its own timeouts anyway: the host bounds the commit's
/// round trip (four times `statement_timeout` and two seconds) and ends the backend past it, which
/// undoes the transaction. Before, a commit slept for an hour, holding its session, an open
/// transaction (and with it the xmin horizon of the whole cluster) and the host's task.
#[tokio::test]
async fn plugin_code_at_commit_cannot_run_past_the_commits_bound() {
    let host = spawn_host_with(&["testbed"], |c| c.limits.statement_timeout = Duration::from_secs(1)).await;
    let mut tx = host.host.sessions.begin("testbed").await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE hang (n int); \
         CREATE FUNCTION hang() RETURNS trigger LANGUAGE plpgsql AS \
           $$ BEGIN PERFORM pg_sleep(3600); RETURN NULL; END $$; \
         CREATE CONSTRAINT TRIGGER hang AFTER INSERT ON hang DEFERRABLE INITIALLY DEFERRED \
           FOR EACH ROW EXECUTE FUNCTION hang(); \
         SELECT set_config('statement_timeout', '0', false), set_config('lock_timeout', '0', false); \
         INSERT INTO hang VALUES (1)",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    let started = Instant::now();
    let commit = tokio::time::timeout(Duration::from_secs(30), tx.commit()).await;
    let took = started.elapsed();
    let commit = commit.unwrap_or_else(|_| panic!("the commit still ran after {took:?}"));
    assert!(commit.is_err(), "the commit was cancelled, not committed");
    assert!(took < Duration::from_secs(10), "the commit ran for {took:?}");
    let undone = "SELECT count(*) FROM pg_tables WHERE schemaname = 'testbed' AND tablename = 'hang'";
    assert_eq!(host.count(undone).await, 0, "the transaction was undone, table and all");
    let role = host.plugin_role("testbed").await;
    let sleeping = format!("SELECT count(*) FROM pg_stat_activity WHERE usename = '{role}' AND state = 'active'");
    eventually(Duration::from_secs(10), "the backend is ended", || async {
        host.count(&sleeping).await == 0
    })
    .await;
    host.shutdown().await;
}

/// Plugin code can still run at a `COMMIT`, after everything the host sends before it: a
/// deferred constraint trigger. What it leaves on the session is cleared at the session's
/// next `BEGIN`, and a session where it made a prepared statement is closed then. No inbox
/// processor runs: one waiting for the plugin's only session took it as the test's commit
/// let it go, and its `BEGIN` cleared the trigger's lock before the test could see it.
#[tokio::test]
async fn what_plugin_code_leaves_at_commit_is_cleared_before_the_next_call() {
    let host = spawn_host_with(&["testbed"], |c| {
        c.database.plugin_max_connections = 1;
        c.consumer.inbox_processors = 0;
    })
    .await;
    let sessions = host.host.sessions.clone();
    type State = (i32, i32, String, i32, i32);
    let probe = "SELECT pg_backend_pid(), \
        (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid())::int4, \
        current_setting('work_mem'), \
        (SELECT count(*) FROM pg_listening_channels())::int4, \
        (SELECT count(*) FROM pg_prepared_statements WHERE from_sql)::int4";
    let mut tx = sessions.begin("testbed").await.unwrap();
    let before: State = sqlx::query_as(probe).fetch_one(&mut *tx).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE late (n int); \
         CREATE FUNCTION late() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           PERFORM pg_advisory_lock(11); \
           PERFORM set_config('work_mem', '600MB', false); \
           EXECUTE 'LISTEN late'; \
           IF NEW.n = 2 THEN EXECUTE 'PREPARE planted_late AS SELECT 1'; END IF; \
           RETURN NULL; END $$; \
         CREATE CONSTRAINT TRIGGER late AFTER INSERT ON late DEFERRABLE INITIALLY DEFERRED \
           FOR EACH ROW EXECUTE FUNCTION late(); \
         INSERT INTO late VALUES (1)",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let fired = host
        .count("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = 0 AND objid = 11")
        .await;
    assert!(
        fired >= 1,
        "the trigger ran at COMMIT: its lock is held by the idle session"
    );

    let mut tx = sessions.begin("testbed").await.unwrap();
    let after: State = sqlx::query_as(probe).fetch_one(&mut *tx).await.unwrap();
    assert_eq!(after, before, "what the trigger left at COMMIT reached the next call");

    sqlx::raw_sql("INSERT INTO late VALUES (2)")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let mut tx = sessions.begin("testbed").await.unwrap();
    let last: State = sqlx::query_as(probe).fetch_one(&mut *tx).await.unwrap();
    assert_ne!(
        last.0, before.0,
        "a session with a prepared statement made at COMMIT was reused"
    );
    assert_eq!(
        (last.1, last.2, last.3, last.4),
        (before.1, before.2, before.3, before.4)
    );
    tx.rollback().await.unwrap();
    host.shutdown().await;
}

/// `pg_locks` is readable by every session, so a plugin with any SQL could find the relay's
/// locks and take them, holding up every plugin's events. Its session is terminated, and the
/// outbox keeps flowing.
#[tokio::test]
async fn a_plugin_session_that_takes_the_relays_locks_is_ended() {
    let host = spawn_host(&["testbed"]).await;
    let mut s = host.plugin_session("testbed").await;
    // As an attacker would: the relay's namespace from pg_locks, then every shard and a
    // thousand member locks (which would shrink each relay's share to one shard).
    let space = relay_lock_space(&mut s).await;
    sqlx::query("SELECT pg_try_advisory_lock($1::int4, g) FROM generate_series(0, 63) g")
        .bind(space)
        .execute(&mut s)
        .await
        .unwrap();
    take_relay_member_locks(&mut s, space).await;
    an_event_emitted_now_is_published(&host).await;
    // The relay looks at its lock space once a second.
    assert_session_ends(&mut s).await;
    host.shutdown().await;
}

/// `pg_terminate_backend` needs the privileges of the plugin's role, which rest on the host's
/// membership in it. On some Postgres versions (before 16, where a role counted as its own
/// admin while it was its session's user) a plugin's session could revoke it, and then hold
/// the relay's locks for good. The host grants it again, in the transaction that ends the
/// session. The plugin tries first; where the server refuses (as 15.x here does), the
/// revoke is done as a superuser, as the plugin could have.
#[tokio::test]
async fn a_plugin_that_revokes_the_hosts_membership_in_its_role_is_still_ended() {
    let host = spawn_host(&["testbed"]).await;
    let mut s = host.plugin_session("testbed").await;
    let me: String = sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(&mut s)
        .await
        .unwrap();
    let revoke = format!("REVOKE \"{me}\" FROM {HOST_USER}");
    if let Err(e) = sqlx::query(&revoke).execute(&mut s).await {
        eprintln!("the plugin's own revoke was refused: {e}");
        let mut admin = PgConnection::connect(&admin_url()).await.unwrap();
        sqlx::query(&revoke).execute(&mut admin).await.unwrap();
    }
    let member = || async {
        sqlx::query_scalar::<_, bool>("SELECT pg_has_role(current_user, $1, 'USAGE')")
            .bind(&me)
            .fetch_one(&host.db)
            .await
            .unwrap()
    };
    assert!(!member().await, "revoked");
    // Member locks of the relay's, which no relay holds (see the test above).
    let space = relay_lock_space(&mut s).await;
    take_relay_member_locks(&mut s, space).await;
    assert_session_ends(&mut s).await;
    assert!(member().await, "the host's membership in the plugin's role is back");
    an_event_emitted_now_is_published(&host).await;
    host.shutdown().await;
}

/// The relay ends plugin sessions that hold its locks, but never another application's: a
/// superuser host is a member of every role, so neither membership nor a name like a
/// plugin role's makes a plugin.
/// Here the host is made a member of a role of another application, whose session holds
/// locks in the relay's classes for several of the relay's steps.
#[tokio::test]
async fn a_session_of_another_application_that_holds_the_relays_locks_is_left_alone() {
    use sqlx::ConnectOptions;
    let host = spawn_host(&["testbed"]).await;
    // Named as OBX names roles: another service's host, say, whose user is `obx_…` too.
    let role = format!("obx_bystander_{}", uuid::Uuid::new_v4().simple());
    let database: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(&host.db)
        .await
        .unwrap();
    let mut admin = PgConnection::connect(&admin_url()).await.unwrap();
    for statement in [
        format!("CREATE ROLE {role} LOGIN PASSWORD 'bystander-password'"),
        format!("GRANT {role} TO {HOST_USER}"),
        format!("GRANT CONNECT ON DATABASE {database} TO {role}"),
    ] {
        sqlx::query(&statement).execute(&mut admin).await.unwrap();
    }
    let options: sqlx::postgres::PgConnectOptions = host.database_url.parse().unwrap();
    let mut s = options
        .username(&role)
        .password("bystander-password")
        .connect()
        .await
        .unwrap();
    let space = relay_lock_space(&mut s).await;
    let taken: Vec<bool> =
        sqlx::query_scalar("SELECT pg_try_advisory_lock(($1 | 1)::int4, g) FROM generate_series(1000, 1009) g")
            .bind(space)
            .fetch_all(&mut s)
            .await
            .unwrap();
    assert!(taken.iter().all(|t| *t), "{taken:?}");
    // The relay looks at its lock space once a second.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let alive = sqlx::query("SELECT 1").execute(&mut s).await;
    assert!(alive.is_ok(), "another application's session was ended: {alive:?}");
    let _ = s.close().await;
    host.shutdown().await;
    let _ = sqlx::query(&format!("DROP OWNED BY {role}")).execute(&mut admin).await;
    let _ = sqlx::query(&format!("DROP ROLE {role}")).execute(&mut admin).await;
}

/// Any session may NOTIFY any channel it can name, so a plugin that knew the relays'
/// wake-up channel could queue a million notifications in one call, each a relay step. The
/// channel is random per installation, and no plugin can read its name.
#[tokio::test]
async fn a_plugin_cannot_learn_the_channel_that_wakes_the_relays() {
    let host = spawn_host(&["testbed"]).await;
    let channel: String = sqlx::query_scalar("SELECT notify_channel FROM obx.installation")
        .fetch_one(&host.db)
        .await
        .unwrap();
    assert!(channel.starts_with("obx_outbox_") && channel.len() == 27, "{channel}");
    let mut s = host.plugin_session("testbed").await;
    let read = sqlx::query_scalar::<_, String>("SELECT notify_channel FROM obx.installation")
        .fetch_one(&mut s)
        .await;
    let code = match &read {
        Err(sqlx::Error::Database(e)) => e.code().map(|c| c.to_string()),
        _ => None,
    };
    assert_eq!(code.as_deref(), Some("42501"), "a plugin read the channel: {read:?}");
    // The relay listens on it (and on nothing a plugin could guess).
    let listening = format!("SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN \"{channel}\"'");
    eventually(Duration::from_secs(10), "the relay listens on the channel", || async {
        host.count(&listening).await >= 1
    })
    .await;
    let guessable = "SELECT count(*) FROM pg_stat_activity \
                     WHERE datname = current_database() AND query = 'LISTEN \"obx_outbox\"'";
    assert_eq!(host.count(guessable).await, 0);
    host.shutdown().await;
}

/// The relay's lock namespace, as an attacker would find it: `pg_locks` is readable by every
/// session (in this database: other tests' relays hold theirs on the same server).
async fn relay_lock_space(s: &mut PgConnection) -> i64 {
    for _ in 0..100 {
        let space = sqlx::query_scalar::<_, i64>(
            "SELECT classid::int8 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 \
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
             GROUP BY classid HAVING count(*) > 1 ORDER BY count(*) DESC LIMIT 1",
        )
        .fetch_optional(&mut *s)
        .await
        .unwrap();
        if let Some(space) = space {
            return space;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the relay holds no shards");
}

/// The intruder's next statement: it may find its session ended already, by a host step that
/// ran between its first lock and this one (seen in 1 of 6 runs).
fn ended_already_or_ok(result: sqlx::Result<sqlx::postgres::PgQueryResult>) {
    match result {
        Ok(_) => {}
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("57P01") => {}
        Err(sqlx::Error::Io(_)) => {}
        Err(e) => panic!("the intruder's second statement failed otherwise: {e}"),
    }
}

/// Takes a thousand of the relay's member locks (in lock space `space`) on plugin session `s`,
/// as an attacker would; the host may end the session meanwhile.
async fn take_relay_member_locks(s: &mut PgConnection, space: i64) {
    let taken = sqlx::query("SELECT pg_try_advisory_lock(($1 | 1)::int4, g) FROM generate_series(1000, 2000) g")
        .bind(space)
        .execute(&mut *s)
        .await;
    ended_already_or_ok(taken);
}

/// Asserts that testbed's next event, the first one of the test, is published within 20 s.
async fn an_event_emitted_now_is_published(host: &TestHost) {
    let a = host
        .command("testbed", "emit", json!({ "id": "through", "topic": "testbed.events" }))
        .await;
    assert_eq!(a.status, 200, "{}", a.text);
    eventually(Duration::from_secs(20), "the event is published", || async {
        host.count("SELECT count(*) FROM obx.outbox_event WHERE published_at IS NOT NULL")
            .await
            == 1
    })
    .await;
}

/// Asserts that `s` is ended (by the host) within 10 s.
async fn assert_session_ends(s: &mut PgConnection) {
    for _ in 0..100 {
        if sqlx::query("SELECT 1").execute(&mut *s).await.is_err() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the intruding session is still alive after 10 s");
}

/// A plugin session that takes locks in the consumers' lease classes (a group's membership,
/// a thousand partition ids) is ended by the next lease step, and consumption goes on.
#[tokio::test]
async fn a_plugin_session_that_takes_the_consumers_lease_locks_is_ended() {
    let host = spawn_host(&["testbed"]).await;
    let mut s = host.plugin_session("testbed").await;
    // As an attacker would: the one advisory lock held in share mode in this database is a
    // consumer's group membership; its class, less one, is the partitions' class.
    let mut group = None;
    for _ in 0..100 {
        group = sqlx::query_as::<_, (i64, i64)>(
            "SELECT classid::int8, objid::int8 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 \
               AND mode = 'ShareLock' AND granted \
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) LIMIT 1",
        )
        .fetch_optional(&mut s)
        .await
        .unwrap();
        if group.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (class, group) = group.expect("the consumer holds its group's membership");
    sqlx::query("SELECT pg_try_advisory_lock_shared($1::int4, $2::int4)")
        .bind(class)
        .bind(group)
        .execute(&mut s)
        .await
        .unwrap();
    let more = sqlx::query("SELECT pg_try_advisory_lock(($1 - 1)::int4, g) FROM generate_series(1, 1000) g")
        .bind(class)
        .execute(&mut s)
        .await;
    ended_already_or_ok(more);
    assert_session_ends(&mut s).await;
    let id = send_event(
        &producer(&host.host.brokers.bootstrap),
        &host.topic("testbed.events"),
        "k",
        "Thing",
        &json!({ "seq": 1 }),
    )
    .await;
    eventually(Duration::from_secs(20), "the event takes effect", || async {
        host.count(&format!("SELECT count(*) FROM testbed.effects WHERE event_id = '{id}'"))
            .await
            == 1
    })
    .await;
    host.shutdown().await;
}

/// An event type on a topic is one plugin's: another may not declare it, and so cannot
/// forge it, even under its own name.
#[tokio::test]
async fn a_plugin_may_not_declare_another_plugins_events() {
    let host = spawn_host(&["orders", "testbed"]).await;
    let limits = host.host.runtime.limits().clone();
    let mut m = manifest("forger", &[]);
    m.emits = vec![EventDeclaration {
        topic: "order.events".into(),
        event_type: "OrderCreated".into(),
    }];
    m.validate(limits.max_statement_bytes).unwrap();
    let e = obx::runtime::plugin_schema::prepare(&host.db, &host.host.sessions, &m, &limits)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("emitted by plugin \"orders\""), "{e}");
    assert_eq!(
        host.count("SELECT count(*) FROM obx.plugin_emit WHERE plugin = 'forger'")
            .await,
        0
    );

    // Only the operator moves an event to another plugin (`obx plugin release-event`), and
    // only from the plugin that holds it.
    let release = |plugin: &'static str, event_type: &'static str| {
        obx::runtime::plugin_schema::release_event(&host.db, plugin, "order.events", event_type)
    };
    assert_eq!(
        release("testbed", "OrderCreated").await.unwrap(),
        Release::HeldBy("orders".into())
    );
    assert_eq!(release("orders", "OrderShipped").await.unwrap(), Release::Undeclared);
    assert_eq!(release("orders", "OrderCreated").await.unwrap(), Release::Released);
    // The database follows at once: the orders plugin's emits of it are refused, and nothing
    // of the command stays.
    let orders = "SELECT count(*) FROM orders.orders";
    let before = host.count(orders).await;
    let a = host
        .command("orders", "CreateOrder", json!({ "customerId": "c-1", "amount": 10 }))
        .await;
    assert_eq!(
        (a.status, &a.body["error"]["code"]),
        (500, &json!("transaction_aborted")),
        "{}",
        a.text
    );
    assert_eq!(host.count(orders).await, before);
    // And the other plugin may declare it now.
    obx::runtime::plugin_schema::prepare(&host.db, &host.host.sessions, &m, &limits)
        .await
        .unwrap();
    assert_eq!(
        host.count("SELECT count(*) FROM obx.plugin_emit WHERE plugin = 'forger' AND event_type = 'OrderCreated'")
            .await,
        1
    );
    host.shutdown().await;
}

/// Every function that runs with the host's rights (`SECURITY DEFINER`) pins its search path,
/// so that a plugin session, whose search path is the plugin's to set, cannot redirect a name
/// in it to an object of its own; and none of the host's functions is executable by PUBLIC
/// (a plugin role is granted `obx_api` alone). A migration that forgets either fails here.
#[tokio::test]
async fn the_hosts_functions_pin_their_search_path_and_are_not_public() {
    let host = spawn_host(&["testbed"]).await;
    let unpinned: Vec<String> = sqlx::query_scalar(
        "SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
         WHERE n.nspname IN ('obx', 'obx_api') AND p.prosecdef \
           AND NOT coalesce(p.proconfig @> ARRAY['search_path=pg_catalog, pg_temp'], false) \
         ORDER BY 1",
    )
    .fetch_all(&host.db)
    .await
    .unwrap();
    assert!(
        unpinned.is_empty(),
        "SECURITY DEFINER without a pinned search path: {unpinned:?}"
    );
    let definers: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
         WHERE n.nspname = 'obx_api' AND p.prosecdef",
    )
    .fetch_one(&host.db)
    .await
    .unwrap();
    assert!(
        definers >= 10,
        "only {definers} SECURITY DEFINER functions found in obx_api"
    );
    let public: Vec<String> = sqlx::query_scalar(
        "SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
         WHERE n.nspname IN ('obx', 'obx_api') AND has_function_privilege('public', p.oid, 'EXECUTE') \
         ORDER BY 1",
    )
    .fetch_all(&host.db)
    .await
    .unwrap();
    assert!(public.is_empty(), "executable by PUBLIC: {public:?}");
    host.shutdown().await;
}
