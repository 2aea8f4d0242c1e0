//! A plugin for the host's system tests. Each command does something a real plugin might
//! do by mistake or by malice, after first writing a row and emitting an event, so that a
//! test can check that nothing of a failed call was committed.
//!
//! Payload: `{"id": "..."}` plus command-specific fields.

use obx_sdk::{
    emit, execute, invalid, query, reject, Command, DeliveryMode, Event, Guest, HandlerError, Manifest, Migration,
    OutboxEvent, SqlError, SqlValue, Subscription,
};
use serde_json::{json, Value};

struct Testbed;

impl Guest for Testbed {
    fn describe() -> Manifest {
        obx_sdk::declare_payload("testbed.contract", "ItemEmitted", EMITTED_SCHEMA, None);
        obx_sdk::declare_payload("testbed.events", "Checked", CHECKED_SCHEMA, Some(r#"{"qty": 1}"#));
        obx_sdk::declare_payload("testbed.contract", "ItemWritten", &costly_schema(), None);
        obx_sdk::declare_payload("testbed.events", "Weighed", &costly_schema(), None);
        // An example its own handler rejects: `obx plugin test` must call that out.
        obx_sdk::declare_payload(
            "testbed.inbox",
            "Refused",
            r#"{"type": "object"}"#,
            Some(r#"{"reject": true}"#),
        );
        Manifest {
            name: "testbed".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            commands: [
                "ok",
                "reject",
                "invalid",
                "fail",
                "trap",
                "loop",
                "oom",
                "recurse",
                "sql",
                "sql_then_ok",
                "emit",
                "counter",
                "respond",
                "huge",
                "aliased_params",
                "sequenced",
                "stain",
                "statics",
                "residue",
                "stain_then_residue",
                "stain_then_trap",
                "schedule",
                "cancel",
            ]
            .into_iter()
            .map(String::from)
            .collect(),
            subscriptions: vec![
                Subscription {
                    topic: "testbed.events".into(),
                    event_types: vec![],
                    mode: DeliveryMode::Dedup,
                },
                Subscription {
                    topic: "testbed.inbox".into(),
                    event_types: vec![],
                    mode: DeliveryMode::Inbox,
                },
            ],
            emits: declared_events(),
            migrations: vec![
                Migration {
                    id: 1,
                    name: "items and counters".into(),
                    sql: "CREATE TABLE items (id text PRIMARY KEY, note text); \
                          CREATE TABLE counters (name text PRIMARY KEY, n bigint NOT NULL)"
                        .into(),
                },
                Migration {
                    id: 2,
                    name: "effects of events".into(),
                    // No key on purpose: a second effect of one event would show as a second row.
                    sql: "CREATE TABLE effects (event_id uuid NOT NULL, topic text NOT NULL, key text, \
                                                seq bigint, attempt integer NOT NULL, \
                                                at timestamptz NOT NULL DEFAULT clock_timestamp())"
                        .into(),
                },
                Migration {
                    id: 3,
                    name: "timers fired".into(),
                    // No key on purpose: a timer that took effect twice would show as two rows.
                    sql: "CREATE TABLE timers_fired (name text NOT NULL, key text NOT NULL, payload jsonb, \
                                                     due_at timestamptz NOT NULL, attempt integer NOT NULL, \
                                                     at timestamptz NOT NULL DEFAULT clock_timestamp()); \
                          CREATE TABLE deferred (id text, \
                                                 CONSTRAINT deferred_once UNIQUE (id) DEFERRABLE INITIALLY DEFERRED)"
                        .into(),
                },
                Migration {
                    id: 4,
                    name: "handler runs".into(),
                    // Sequences: a rolled-back run still counts, so a test sees every attempt.
                    sql: "CREATE SEQUENCE flaky_runs; CREATE SEQUENCE poison_runs".into(),
                },
            ],
        }
    }

    fn handle_command(command: Command) -> Result<String, HandlerError> {
        let p: Value = serde_json::from_str(&command.payload).map_err(|e| invalid(e.to_string()))?;
        let id = p["id"].as_str().unwrap_or("none").to_string();
        match command.name.as_str() {
            "counter" => return counter(&id),
            "sql" => return run_sql(&p),
            "emit" => return emit_many(&id, &p),
            "respond" => return Ok(p["body"].as_str().unwrap_or("").to_string()),
            // A response of `bytes` bytes, built in the guest.
            // A statement whose `count` parameters are all the same `bytes` bytes of memory:
            // copied whole, `count` times their memory. Answers the SQL error, if any.
            "aliased_params" => {
                let (count, bytes) = (p["count"].as_u64().unwrap_or(0), p["bytes"].as_u64().unwrap_or(0));
                let one = std::mem::ManuallyDrop::new("p".repeat(bytes as usize));
                let (ptr, len) = (one.as_ptr() as *mut u8, one.len());
                // SAFETY: none is written, and the list is never dropped: each would be freed.
                let params = std::mem::ManuallyDrop::new(
                    (0..count)
                        .map(|_| SqlValue::Text(unsafe { String::from_raw_parts(ptr, len, len) }))
                        .collect::<Vec<_>>(),
                );
                return Ok(match query("SELECT 1", &params) {
                    Ok(_) => json!({ "ran": true }),
                    Err(e) => json!({ "error": format!("{e:?}") }),
                }
                .to_string());
            }
            "huge" => {
                let n = p["bytes"].as_u64().unwrap_or(0) as usize;
                return Ok(format!("\"{}\"", "x".repeat(n.saturating_sub(2))));
            }
            "sequenced" => return sequenced(&p),
            "schedule" => return schedule(&p),
            "cancel" => {
                let name = p["name"].as_str().unwrap_or("");
                let key = p["key"].as_str().unwrap_or("");
                return Ok(obx_sdk::cancel_timer(name, key)?.to_string());
            }
            "stain" => return Ok(stain().to_string()),
            // Where the stained statics lie: the host resets a memory's first bytes in place
            // (data copied back from the image) and the rest by decommitting it.
            "statics" => {
                return Ok(
                    json!({ "stained": (&raw const STAINED) as usize, "seeded": (&raw const SEEDED) as usize })
                        .to_string(),
                )
            }
            "residue" => return Ok(residue(p["pages"].as_u64().unwrap_or(0) as usize).to_string()),
            // Shows that `residue` sees what `stain` leaves, within one call.
            "stain_then_residue" => {
                let pages = stain();
                return Ok(residue(pages).to_string());
            }
            "stain_then_trap" => {
                stain();
                panic!("the testbed traps with a stained memory");
            }
            _ => {}
        }
        write_and_emit(&id)?;
        match command.name.as_str() {
            "ok" => Ok(json!({ "id": id }).to_string()),
            // `{"bytes": n}`: with a message of n bytes, which the host must cut.
            "reject" => match p["bytes"].as_u64() {
                Some(n) => Err(reject("testbed-says-no", &"r".repeat(n as usize))),
                None => Err(reject("testbed-says-no", "the testbed rejects this")),
            },
            "invalid" => Err(invalid("the testbed finds this input invalid")),
            "fail" => Err(HandlerError::Failed("the testbed failed, with secret internals".into())),
            "trap" => panic!("the testbed traps"),
            "loop" => {
                let mut n = 0u64;
                loop {
                    n = std::hint::black_box(n.wrapping_add(1));
                }
            }
            "oom" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(std::hint::black_box(vec![1u8; 1 << 20]));
                }
            }
            "recurse" => Ok(recurse(std::hint::black_box(u64::MAX)).to_string()),
            "sql_then_ok" => {
                let _ignored = query("SELECT 1 / 0", &[]);
                Ok("{}".into())
            }
            other => Err(invalid(format!("unknown command {other}"))),
        }
    }

    /// Records one row in `effects` per event it takes effect on. The payload may ask it to
    /// fail (`"poison": true`; `"poison": "after-effect"` fails after writing its effect, which
    /// must then not commit), to reject (`"reject": true`), or to emit a follow-up event to
    /// the topic in `"then"`.
    fn handle_event(event: Event) -> Result<(), HandlerError> {
        let p: Value = serde_json::from_str(&event.payload).map_err(|e| invalid(e.to_string()))?;
        // `{"loop": true}`: spins until the call's deadline.
        if p["loop"] == true {
            let mut n = 0u64;
            loop {
                n = std::hint::black_box(n.wrapping_add(1));
            }
        }
        // `{"sleep_ms": n}`: sleeps n ms in WASI, blocked in the host, where the epoch cannot
        // stop it.
        if let Some(ms) = p["sleep_ms"].as_u64() {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
        // `{"gate": true}`: waits for the row lock of counter `gate`, which a test can hold.
        if p["gate"] == true {
            execute("UPDATE counters SET n = n + 1 WHERE name = 'gate'", &[])?;
        }
        // `{"flaky": n}`: fails on the n-th run of any flaky event, counted across rollbacks.
        if let Some(n) = p["flaky"].as_i64() {
            if next_run("flaky_runs")? == n {
                return Err(HandlerError::Failed(format!("flaky event, failed on run {n}")));
            }
        }
        if p["poison"] == "counted" {
            let run = next_run("poison_runs")?;
            return Err(HandlerError::Failed(format!("poisoned event, run {run}")));
        }
        if p["poison"] == true {
            return Err(HandlerError::Failed(format!(
                "poisoned event, attempt {}",
                event.attempt
            )));
        }
        if p["reject"] == true {
            return Err(reject("testbed-rejects-event", "the testbed rejects this event"));
        }
        // `{"fail": {"bytes": n}}`: fails with an error of n bytes that holds a NUL, which no
        // Postgres text can.
        if let Some(bytes) = p["fail"]["bytes"].as_u64() {
            let mut words = String::from("the handler's words\0");
            words.extend(std::iter::repeat_n('w', (bytes as usize).saturating_sub(words.len())));
            return Err(HandlerError::Failed(words));
        }
        execute(
            "INSERT INTO effects (event_id, topic, key, seq, attempt) VALUES ($1, $2, $3, $4, $5)",
            &[
                SqlValue::Uuid(event.event_id.clone()),
                SqlValue::Text(event.topic.clone()),
                event.key.clone().map_or(SqlValue::Null, SqlValue::Text),
                p["seq"].as_i64().map_or(SqlValue::Null, SqlValue::Int),
                SqlValue::Int(event.attempt.into()),
            ],
        )?;
        if p["poison"] == "after-effect" {
            return Err(HandlerError::Failed(format!(
                "poisoned event, failed after its effect, attempt {}",
                event.attempt
            )));
        }
        // Breaks a deferred constraint: the handler returns `ok`, the violation shows at commit;
        // with "raise", a deferred trigger raises an error of its own there (a test makes the
        // table and trigger on a plugin session: migrations may not create functions).
        if p["defer_violation"] == true {
            execute(
                "INSERT INTO deferred (id) VALUES ($1), ($1)",
                &[SqlValue::Text(event.event_id.clone())],
            )?;
        } else if p["defer_violation"] == "raise" {
            execute(
                "INSERT INTO deferred_raise (id) VALUES ($1)",
                &[SqlValue::Text(event.event_id.clone())],
            )?;
        }
        // Emits as the `emit` command does, with these arguments.
        if let Some(args) = p.get("emit") {
            emit_many(&event.event_id, args)?;
        }
        if let Some(topic) = p["then"].as_str() {
            emit(&OutboxEvent {
                event_id: None,
                aggregate_type: "Item".into(),
                aggregate_id: event.key.clone().unwrap_or_else(|| event.event_id.clone()),
                event_type: "FollowUp".into(),
                payload: json!({ "causationId": event.event_id }).to_string(),
                topic: topic.into(),
                partition_key: event.key.clone(),
            })?;
        }
        Ok(())
    }
}

fn write_and_emit(id: &str) -> Result<(), HandlerError> {
    execute(
        "INSERT INTO items (id, note) VALUES ($1, 'written')",
        &[SqlValue::Text(id.into())],
    )?;
    emit(&OutboxEvent {
        event_id: None,
        aggregate_type: "Item".into(),
        aggregate_id: id.into(),
        event_type: "ItemWritten".into(),
        payload: json!({ "id": id }).to_string(),
        topic: "testbed.events".into(),
        partition_key: None,
    })?;
    Ok(())
}

/// The fault suite's command: takes the next number of `key` (under the counter's row lock,
/// so numbers commit in order), and emits it keyed by `key`. With `"fail": true` it fails
/// after emitting, so nothing of it may ever be seen.
fn sequenced(p: &Value) -> Result<String, HandlerError> {
    let key = p["key"].as_str().ok_or_else(|| invalid("key is required"))?;
    let rows = query(
        "INSERT INTO counters (name, n) VALUES ($1, 1) \
         ON CONFLICT (name) DO UPDATE SET n = counters.n + 1 RETURNING n",
        &[SqlValue::Text(format!("seq:{key}"))],
    )?;
    let seq = rows.value(0, "n").and_then(SqlValue::as_int).unwrap_or(-1);
    let event = OutboxEvent {
        event_id: None,
        aggregate_type: "Sequence".into(),
        aggregate_id: key.into(),
        event_type: "Sequenced".into(),
        payload: json!({ "key": key, "seq": seq, "nonce": p["nonce"] }).to_string(),
        topic: "testbed.events".into(),
        partition_key: Some(key.into()),
    };
    // `delay_ms` publishes it later, through emit-delayed.
    match p["delay_ms"].as_u64() {
        Some(ms) => obx_sdk::emit_delayed(&event, ms)?,
        None => emit(&event)?,
    };
    if let Some(ms) = p["timer_ms"].as_u64() {
        let payload = json!({ "key": key, "seq": seq, "nonce": p["nonce"] }).to_string();
        obx_sdk::schedule_timer("seq", &format!("{key}:{seq}"), ms, &payload)?;
    }
    if p["fail"] == true {
        return Err(HandlerError::Failed("asked to fail after emitting".into()));
    }
    Ok(json!({ "key": key, "seq": seq }).to_string())
}

/// A word no call writes but `stain`. It lives in the code only (an immediate), never in
/// linear memory, so `residue` finds it only where a call put it.
const STAIN: u64 = 0x0bc0_ffee_5a1e_d00d;

static mut STAINED: [u64; 512] = [0; 512];

/// What [`SEEDED`] holds in the component's image (its data segment), and after every reset.
const SEED: u64 = 0x5eed_5eed_5eed_5eed;
/// An initialised static: `stain` overwrites it, and a reset must copy the image back, not
/// only clear it.
static mut SEEDED: [u64; 64] = [SEED; 64];

/// Writes [`STAIN`] across 4 MiB of heap (grown memory) and a static, and keeps them: what
/// a later call could see if memory outlived its Store. Returns the memory's size in pages.
fn stain() -> usize {
    let heap: &'static mut [u64] = Vec::leak(vec![STAIN; 512 * 1024]);
    std::hint::black_box(&heap);
    // SAFETY: one call runs at a time in an instance; nothing else touches this static.
    unsafe {
        let stained = &raw mut STAINED;
        for i in 0..512 {
            std::ptr::write_volatile((stained as *mut u64).add(i), STAIN);
        }
        let seeded = &raw mut SEEDED;
        for i in 0..64 {
            std::ptr::write_volatile((seeded as *mut u64).add(i), STAIN);
        }
    }
    core::arch::wasm32::memory_size(0)
}

/// Counts the words of linear memory that hold [`STAIN`], after growing it to at least
/// `pages` (a fresh instance's pages past its initial size are not even mapped), and the
/// words of [`SEEDED`] that do not hold [`SEED`].
fn residue(pages: usize) -> usize {
    let size = core::arch::wasm32::memory_size(0);
    if pages > size && core::arch::wasm32::memory_grow(0, pages - size) == usize::MAX {
        return usize::MAX;
    }
    let end = core::arch::wasm32::memory_size(0) * 65536;
    let mut found = 0;
    // From 8: address 0 is the null pointer.
    for address in (8..end).step_by(8) {
        // SAFETY: every address below memory_size * 64 KiB is in bounds, and any bit pattern
        // is a valid u64. The constant stays an immediate: `black_box` would put a copy on
        // the stack.
        if unsafe { std::ptr::read_volatile(address as *const u64) } == STAIN {
            found += 1;
        }
    }
    let seeded = &raw const SEEDED;
    // SAFETY: as in `stain`.
    found
        + (0..64)
            .filter(|i| unsafe { std::ptr::read_volatile((seeded as *const u64).add(*i)) } != SEED)
            .count()
}

fn recurse(n: u64) -> u64 {
    if n == 0 {
        return 0;
    }
    let frame = std::hint::black_box([n; 64]);
    recurse(n - 1).wrapping_add(frame[7])
}

/// The next value of `sequence`: a count of runs that a rollback does not undo.
fn next_run(sequence: &str) -> Result<i64, HandlerError> {
    let rows = query(&format!("SELECT nextval('{sequence}') AS n"), &[])?;
    Ok(rows.value(0, "n").and_then(SqlValue::as_int).unwrap_or(-1))
}

fn counter(name: &str) -> Result<String, HandlerError> {
    let rows = query(
        "INSERT INTO counters (name, n) VALUES ($1, 1) \
         ON CONFLICT (name) DO UPDATE SET n = counters.n + 1 RETURNING n",
        &[SqlValue::Text(name.into())],
    )?;
    let n = rows.value(0, "n").and_then(SqlValue::as_int).unwrap_or(-1);
    Ok(json!({ "n": n }).to_string())
}

/// Runs `{"sql": ..., "params": [...], "mode": "query"|"execute"}`. A SQL error comes back
/// as a rejection whose code names the error variant, so a test can see it typed.
fn run_sql(p: &Value) -> Result<String, HandlerError> {
    let sql = p["sql"].as_str().ok_or_else(|| invalid("sql is required"))?;
    let params: Vec<SqlValue> = p["params"]
        .as_array()
        .map(|a| a.iter().map(to_sql).collect())
        .unwrap_or_default();
    let result = if p["mode"] == "execute" {
        execute(sql, &params).map(|n| json!({ "affected": n }))
    } else {
        query(sql, &params).map(|rows| {
            let rows: Vec<Value> = rows
                .rows
                .iter()
                .map(|r| Value::Array(r.iter().map(from_sql).collect()))
                .collect();
            json!({ "rows": rows })
        })
    };
    result.map(|v| v.to_string()).map_err(|e| {
        let (code, message) = match e {
            SqlError::Forbidden(m) => ("forbidden".to_string(), m),
            SqlError::Invalid(m) => ("invalid".to_string(), m),
            SqlError::Database(d) => (format!("database:{}", d.code), d.message),
            SqlError::Timeout(m) => ("timeout".to_string(), m),
            SqlError::Limit(m) => ("limit".to_string(), m),
            SqlError::Aborted => ("aborted".to_string(), String::new()),
        };
        reject(&code, &message)
    })
}

/// JSON to a parameter: null, bool, integer, float, string; `{"uuid": "..."}` and the like
/// for the other variants.
fn to_sql(v: &Value) -> SqlValue {
    match v {
        Value::Null => SqlValue::Null,
        Value::Bool(b) => SqlValue::Boolean(*b),
        Value::Number(n) if n.is_i64() => SqlValue::Int(n.as_i64().unwrap()),
        Value::Number(n) => SqlValue::Float(n.as_f64().unwrap_or_default()),
        Value::String(s) => SqlValue::Text(s.clone()),
        Value::Object(o) => {
            let s = |k: &str| o[k].as_str().unwrap_or_default().to_string();
            match o.keys().next().map(String::as_str) {
                Some("uuid") => SqlValue::Uuid(s("uuid")),
                Some("json") => SqlValue::Json(s("json")),
                Some("timestamp") => SqlValue::Timestamp(s("timestamp")),
                Some("date") => SqlValue::Date(s("date")),
                Some("numeric") => SqlValue::Numeric(s("numeric")),
                Some("bytes") => SqlValue::Bytes(s("bytes").into_bytes()),
                _ => SqlValue::Null,
            }
        }
        Value::Array(_) => SqlValue::Null,
    }
}

fn from_sql(v: &SqlValue) -> Value {
    match v {
        SqlValue::Null => Value::Null,
        SqlValue::Boolean(b) => json!(b),
        SqlValue::Int(i) => json!(i),
        SqlValue::Float(f) => json!(f),
        SqlValue::Bytes(b) => json!({ "bytes": b }),
        SqlValue::Text(s) => json!(s),
        SqlValue::Json(s) => json!({ "json": s }),
        SqlValue::Uuid(s) => json!({ "uuid": s }),
        SqlValue::Timestamp(s) => json!({ "timestamp": s }),
        SqlValue::Date(s) => json!({ "date": s }),
        SqlValue::Numeric(s) => json!({ "numeric": s }),
    }
}

/// Emits events and answers ok, stopping at the first error. Fields: `count` (default 1),
/// or `keys` (one event per key, in order); `topic`, or `topics` (event i goes to
/// `topics[i % n]`); `event_type`; `key`; `seq` (copied into each payload); `payload_bytes`
/// (pads it); `payload` (sent as it is); `payload_text` (the payload's text, as it is).
/// The topics the testbed may emit to (tests pick one per purpose), each with every event
/// type it emits. Anything else is refused by the host, which the hostile tests rely on.
const TOPICS: &[&str] = &[
    "testbed.events",
    "testbed.inbox",
    "testbed.saga",
    "testbed.rollback",
    "testbed.alpha",
    "testbed.beta",
    "testbed.gamma",
    "testbed.order",
    "testbed.outage",
    "testbed.killed",
    "testbed.replay",
    "testbed.retention",
    "testbed.contract",
];

/// The payload contract of ItemEmitted on testbed.contract (what `emit` checks), and of
/// Checked on testbed.events (what the event path checks before the handler).
const EMITTED_SCHEMA: &str = r#"{"type": "object", "required": ["id"],
    "properties": {"id": {"type": "string"}, "i": {"type": "integer"}}}"#;
const CHECKED_SCHEMA: &str = r#"{"type": "object", "required": ["qty"],
    "properties": {"qty": {"type": "integer", "minimum": 1}}}"#;

/// ItemWritten on testbed.contract (emitted) and Weighed on testbed.events (consumed): an
/// array whose every item is one of 1,000 numbers, which the host may have to compare with
/// each of them. Cheap to declare, dear to check.
fn costly_schema() -> String {
    let choices: Vec<Value> = (0..1000).map(|i| json!({ "const": i })).collect();
    json!({ "type": "array", "items": { "anyOf": choices } }).to_string()
}

fn declared_events() -> Vec<obx_sdk::EventDeclaration> {
    TOPICS
        .iter()
        .flat_map(|t| obx_sdk::emits(t, &["ItemEmitted", "ItemWritten", "Sequenced", "FollowUp"]))
        .collect()
}

/// Emits `count` events (or one per `keys`), each with the event id `event_id` if given, and
/// answers how many went out, the ids `emit` gave back, and the first refusal.
fn emit_many(id: &str, p: &Value) -> Result<String, HandlerError> {
    let strings = |v: &Value| -> Option<Vec<String>> {
        v.as_array()
            .map(|a| a.iter().filter_map(|s| s.as_str().map(String::from)).collect())
    };
    let topics =
        strings(&p["topics"]).unwrap_or_else(|| vec![p["topic"].as_str().unwrap_or("testbed.events").to_string()]);
    let keys = strings(&p["keys"]);
    let count = keys
        .as_ref()
        .map(|k| k.len() as u64)
        .or(p["count"].as_u64())
        .unwrap_or(1);
    let mut ids = Vec::new();
    let mut error = Value::Null;
    for i in 0..count {
        let key = keys
            .as_ref()
            .map(|k| k[i as usize].clone())
            .or_else(|| p["key"].as_str().map(String::from));
        let payload = match (p["payload_bytes"].as_u64(), p.get("payload")) {
            (Some(n), _) => json!({ "pad": "x".repeat(n as usize) }),
            (None, Some(given)) => given.clone(),
            (None, None) => json!({ "id": id, "i": i, "key": key, "seq": p["seq"] }),
        };
        let event = OutboxEvent {
            event_id: p["event_id"].as_str().map(String::from),
            aggregate_type: "Item".into(),
            aggregate_id: key.clone().unwrap_or_else(|| format!("{id}-{i}")),
            event_type: p["event_type"].as_str().unwrap_or("ItemEmitted").into(),
            // `payload_text`: the payload's JSON text as given, which the guest may get
            // wrong in ways a JSON value cannot be (an escape Postgres refuses).
            payload: p["payload_text"]
                .as_str()
                .map_or_else(|| payload.to_string(), String::from),
            topic: topics[i as usize % topics.len()].clone(),
            partition_key: key,
        };
        match emit(&event) {
            Ok(event_id) => ids.push(event_id),
            Err(e) => {
                error = json!(format!("{e:?}"));
                // A hostile guest keeps trying; a polite one stops at the first refusal.
                if p["ignore_errors"] != true {
                    break;
                }
            }
        }
    }
    Ok(json!({ "emitted": ids.len(), "ids": ids, "error": error }).to_string())
}

/// Schedules the timer `name`/`key` with `payload` after `delay_ms`; fails afterwards when
/// `fail` is set (so nothing of it may commit).
fn schedule(p: &Value) -> Result<String, HandlerError> {
    let name = p["name"].as_str().unwrap_or("");
    let key = p["key"].as_str().unwrap_or("");
    let payload = p.get("payload").cloned().unwrap_or(json!({})).to_string();
    if let Err(e) = obx_sdk::schedule_timer(name, key, p["delay_ms"].as_u64().unwrap_or(0), &payload) {
        return Err(invalid(format!("{e:?}")));
    }
    if p["fail"].as_bool() == Some(true) {
        return Err(HandlerError::Failed("the testbed failed after scheduling".into()));
    }
    Ok(json!({ "scheduled": name }).to_string())
}

/// Records each firing; fails when the payload says `fail`, schedules a follow-up timer when
/// it names `then` (`{"then": {"name", "delay_ms", "cancel_first"}}`), emits when it holds
/// `emit` (the `emit` command's arguments), breaks a deferred constraint when it says
/// `defer_violation`, and breaks and mends one when it says `defer_then_mend`.
impl obx_sdk::TimerGuest for Testbed {
    fn handle_timer(timer: obx_sdk::Timer) -> Result<(), HandlerError> {
        let payload: Value = serde_json::from_str(&timer.payload).unwrap_or(Value::Null);
        // Waits for the row lock of counter `gate`, which a test can hold.
        if payload["gate"] == true {
            execute("UPDATE counters SET n = n + 1 WHERE name = 'gate'", &[])?;
        }
        execute(
            "INSERT INTO timers_fired (name, key, payload, due_at, attempt) VALUES ($1, $2, $3, $4, $5)",
            &[
                SqlValue::Text(timer.name.clone()),
                SqlValue::Text(timer.key.clone()),
                SqlValue::Json(timer.payload.clone()),
                SqlValue::Timestamp(timer.due_at.clone()),
                SqlValue::Int(i64::from(timer.attempt)),
            ],
        )?;
        if let Some(then) = payload.get("then") {
            let name = then["name"].as_str().unwrap_or("then");
            if then["cancel_first"].as_bool() == Some(true) {
                obx_sdk::cancel_timer(name, &timer.key)?;
            }
            obx_sdk::schedule_timer(name, &timer.key, then["delay_ms"].as_u64().unwrap_or(0), "{}")?;
        }
        // Emits as the `emit` command does, with these arguments.
        if let Some(args) = payload.get("emit") {
            emit_many(&timer.key, args)?;
        }
        // Breaks a deferred constraint: the handler returns `ok`, the violation shows later.
        if payload["defer_violation"].as_bool() == Some(true) {
            execute(
                "INSERT INTO deferred (id) VALUES ($1), ($1)",
                &[SqlValue::Text(timer.key.clone())],
            )?;
        }
        // Breaks a deferred constraint for a moment, and mends it before returning: fine while
        // the constraint is deferred, refused at once if it were immediate.
        if payload["defer_then_mend"].as_bool() == Some(true) {
            let key = [SqlValue::Text(timer.key.clone())];
            execute("INSERT INTO deferred (id) VALUES ($1), ($1)", &key)?;
            execute("DELETE FROM deferred WHERE id = $1", &key)?;
            execute("INSERT INTO deferred (id) VALUES ($1)", &key)?;
        }
        if payload["fail"].as_bool() == Some(true) {
            return Err(HandlerError::Failed("the testbed's timer failed".into()));
        }
        Ok(())
    }
}

obx_sdk::export_plugin!(Testbed, timers);
