//! One plugin, several builds (cargo features), so that the hot-reload tests can replace a
//! version with another: `v1`, `v2` (a new migration and a subscription), and
//! `broken-migration` (a new migration that fails).

use obx_sdk::{
    execute, invalid, Command, DeliveryMode, Event, Guest, HandlerError, Manifest, Migration, SqlValue, Subscription,
};
use serde_json::json;

struct Hotswap;

const VERSION: &str = if cfg!(feature = "v1") { "1.0.0" } else { "2.0.0" };

fn migrations() -> Vec<Migration> {
    let mut m = vec![Migration {
        id: 1,
        name: "calls".into(),
        sql: "CREATE TABLE calls (version text NOT NULL)".into(),
    }];
    if cfg!(feature = "v2") {
        m.push(Migration {
            id: 2,
            name: "events".into(),
            sql: "CREATE TABLE events (event_id uuid NOT NULL)".into(),
        });
    }
    if cfg!(feature = "broken-migration") {
        // Fails: the table exists already.
        m.push(Migration {
            id: 2,
            name: "broken".into(),
            sql: "CREATE TABLE calls (id int)".into(),
        });
    }
    m
}

/// `n` strings that all are the same `bytes` bytes of memory: what a hostile guest can hand
/// the host so that copying them costs `n` times their memory.
fn aliased(n: usize, bytes: usize) -> Vec<String> {
    let one = std::mem::ManuallyDrop::new("c".repeat(bytes));
    let (ptr, len) = (one.as_ptr() as *mut u8, one.len());
    // SAFETY: none is written. Each would be freed by describe's post-return, a double free,
    // but the host refuses the manifest first and throws the instance away without it.
    (0..n)
        .map(|_| unsafe { String::from_raw_parts(ptr, len, len) })
        .collect()
}

impl Guest for Hotswap {
    fn describe() -> Manifest {
        if cfg!(feature = "sleepy-describe") {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
        let subscriptions = if cfg!(feature = "v2") {
            vec![Subscription {
                topic: "hotswap.events".into(),
                event_types: vec![],
                mode: DeliveryMode::Dedup,
            }]
        } else {
            vec![]
        };
        Manifest {
            name: if cfg!(feature = "bad-manifest") {
                "Hot Swap!".into()
            } else {
                // The benchmark builds a few copies under other names, to load ten plugins.
                option_env!("OBX_HOTSWAP_NAME").unwrap_or("hotswap").into()
            },
            version: VERSION.into(),
            commands: if cfg!(feature = "amplified-manifest") {
                aliased(512, 8 << 20)
            } else {
                vec!["version".into(), "work".into()]
            },
            subscriptions,
            emits: vec![],
            migrations: migrations(),
        }
    }

    fn handle_command(command: Command) -> Result<String, HandlerError> {
        match command.name.as_str() {
            "version" => Ok(json!({ "version": VERSION }).to_string()),
            // Takes a while (a busy wait of `ms`), then records which version served it.
            "work" => {
                let p: serde_json::Value =
                    serde_json::from_str(&command.payload).map_err(|e| invalid(e.to_string()))?;
                let until =
                    std::time::Instant::now() + std::time::Duration::from_millis(p["ms"].as_u64().unwrap_or(20));
                while std::time::Instant::now() < until {
                    std::hint::spin_loop();
                }
                execute(
                    "INSERT INTO calls (version) VALUES ($1)",
                    &[SqlValue::Text(VERSION.into())],
                )?;
                Ok(json!({ "version": VERSION }).to_string())
            }
            other => Err(invalid(format!("unknown command {other}"))),
        }
    }

    fn handle_event(event: Event) -> Result<(), HandlerError> {
        execute(
            "INSERT INTO events (event_id) VALUES ($1)",
            &[SqlValue::Uuid(event.event_id)],
        )?;
        Ok(())
    }
}

obx_sdk::export_plugin!(Hotswap);
