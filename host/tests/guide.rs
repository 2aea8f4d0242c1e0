//! The plugin guide cannot rot: every `rust`, `python` and `js` block of
//! docs/plugin-guide.md is extracted, built with its language's tool chain, and put
//! through `obx plugin test`. Each language's block must also show what the guide promises:
//! a command, a query with parameters and typed results, an emit, a log line, typed errors,
//! a subscription and payload schemas.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

mod common;

use common::{blocks, obx, run, serve_dir, stop, wait_ready, Served};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Builds a Rust block as the `src/lib.rs` of a crate of its own; returns the component.
fn build_rust(code: &str, dir: &Path, index: usize) -> PathBuf {
    let name = format!("guide_rust_{index}");
    std::fs::create_dir_all(dir.join("src")).unwrap();
    std::fs::create_dir_all(dir.join("wit")).unwrap();
    std::fs::copy(repo().join("wit/obx.wit"), dir.join("wit/obx.wit")).unwrap();
    std::fs::write(dir.join("src/lib.rs"), code).unwrap();
    std::fs::write(
        dir.join("Cargo.toml"),
        format!(
            "[package]\nname = \"{name}\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n\
             [lib]\ncrate-type = [\"cdylib\"]\n\n\
             [dependencies]\nwit-bindgen = \"0.61\"\nserde_json = \"1\"\n\n[workspace]\n"
        ),
    )
    .unwrap();
    // Beside the shared target directory, never in it: `cargo test` holds its lock.
    let target = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(t) => PathBuf::from(t).join("scaffold"),
        None => dir.join("target"),
    };
    run(
        "cargo build (the guide's Rust)",
        Command::new("cargo")
            .current_dir(dir)
            .args(["build", "--release", "--target", "wasm32-wasip2"])
            .env("CARGO_TARGET_DIR", &target),
    );
    target.join(format!("wasm32-wasip2/release/{name}.wasm"))
}

fn build_python(code: &str, dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("app.py"), code).unwrap();
    let out = dir.join("guide.wasm");
    let tool = std::env::var("COMPONENTIZE_PY").unwrap_or_else(|_| "componentize-py".into());
    run(
        "componentize-py (the guide's Python)",
        Command::new(tool)
            .current_dir(dir)
            .arg("-d")
            .arg(repo().join("wit"))
            .args(["-w", "obx:plugin/timed-plugin", "componentize", "app", "-o"])
            .arg(&out),
    );
    out
}

fn build_js(code: &str, dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("app.js"), code).unwrap();
    let out = dir.join("guide.wasm");
    // The ComponentizeJS that `cargo xtask test` installs for the example plugin.
    let tool = repo().join("plugins/notifications-js/node_modules/.bin/componentize-js");
    assert!(tool.exists(), "{} is missing: run `cargo xtask test`", tool.display());
    run(
        "componentize-js (the guide's JavaScript)",
        Command::new(tool)
            .current_dir(dir)
            .arg("app.js")
            .arg("--wit")
            .arg(repo().join("wit"))
            .args(["--world-name", "timed-plugin"])
            .args(["-d", "stdio", "random", "clocks", "http", "fetch-event", "-o"])
            .arg(&out),
    );
    out
}

/// What each language's block must show: a command, a query with parameters and typed
/// results, an emit, a log line, typed errors, a subscription, payload schemas, a timer.
const SHOWS: &[(&str, &[&str])] = &[
    (
        "rust",
        &[
            "fn handle_command",
            "query(",
            "SqlValue::Numeric(balance)",
            "emit(",
            "log(",
            "HandlerError::Rejected",
            "Subscription {",
            "fn handle_event",
            "declare_payload(",
            "schedule(",
            "fn handle_timer",
        ],
    ),
    (
        "python",
        &[
            "def handle_command",
            "sql.query",
            ".value",
            "outbox.emit",
            "log.log",
            "HandlerError_Rejected",
            "handler.Subscription",
            "def handle_event",
            "contract.declare_payload(",
            "timers.schedule(",
            "def handle_timer",
        ],
    ),
    (
        "js",
        &[
            "handleCommand",
            "query(",
            ".val",
            "emit(",
            "log(",
            "'rejected'",
            "subscriptions:",
            "handleEvent",
            "declarePayload(",
            "schedule(",
            "handleTimer",
        ],
    ),
];

#[test]
fn every_plugin_snippet_of_the_guide_builds_and_passes_the_conformance_check() {
    let guide = std::fs::read_to_string(repo().join("docs/plugin-guide.md")).unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let mut built = 0;
    for (language, shows) in SHOWS {
        let found = blocks(&guide, language);
        assert!(!found.is_empty(), "the guide has no {language} block");
        let all = found.concat();
        for s in *shows {
            assert!(all.contains(s), "the guide's {language} does not show {s:?}");
        }
        for (i, code) in found.iter().enumerate() {
            let dir = scratch.path().join(format!("{language}-{i}"));
            let wasm = match *language {
                "rust" => build_rust(code, &dir, i),
                "python" => build_python(code, &dir),
                _ => build_js(code, &dir),
            };
            let tested = run(
                &format!("obx plugin test (the guide's {language} block {i})"),
                obx().args(["plugin", "test"]).arg(&wasm),
            );
            assert!(tested.contains("conformant"), "{language} block {i}:\n{tested}");
            if i == 0 {
                deposits_add_up_and_an_overdraft_is_rejected(language, &wasm);
            }
            built += 1;
        }
    }
    eprintln!("built and tested {built} blocks of the guide");
}

/// The guide's `ledger` in a running host does what the guide says it does.
fn deposits_add_up_and_an_overdraft_is_rejected(language: &str, wasm: &Path) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(wasm, dir.path().join("ledger.wasm")).unwrap();
    let Served {
        mut child,
        log,
        base,
        _plugins,
    } = serve_dir(&[], dir, &[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let client = reqwest::Client::new();
    rt.block_on(async {
        wait_ready(&client, &base, Duration::from_secs(180)).await;
        let deposit = |amount: &str| {
            client
                .post(format!("{base}/v1/commands/ledger/Deposit"))
                .json(&serde_json::json!({ "account": "a-1", "amount": amount }))
                .send()
        };
        for (amount, balance) in [("12.50", "12.50"), ("7.5", "20.00")] {
            let r = deposit(amount).await.unwrap();
            assert_eq!(r.status(), 200, "{language}");
            let body: serde_json::Value = r.json().await.unwrap();
            assert_eq!(body["balance"], balance, "{language}: {body}");
        }
        let overdraft = deposit("-100").await.unwrap();
        assert_eq!(overdraft.status(), 409, "{language}");
        let body: serde_json::Value = overdraft.json().await.unwrap();
        assert_eq!(body["error"]["code"], "rejected", "{language}: {body}");
        let nonsense = deposit("lots").await.unwrap();
        assert_eq!(nonsense.status(), 400, "{language}: an amount that is not a number");
        // The deposits scheduled a statement a day ahead: one timer, pending.
        let timers = |client: reqwest::Client, base: String| async move {
            let status: serde_json::Value = client
                .get(format!("{base}/v1/status"))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let ledger = status["timers"]
                .as_array()
                .and_then(|t| t.iter().find(|t| t["plugin"] == "ledger").cloned());
            ledger.map_or((0, 0), |t| {
                (t["pending"].as_i64().unwrap_or(0), t["parked"].as_i64().unwrap_or(0))
            })
        };
        assert_eq!(timers(client.clone(), base.clone()).await, (1, 0), "{language}");
        // A deposit that asks for its statement now: the timer fires, and its handler succeeds
        // (a failing one would be retried, then parked).
        let soon = client
            .post(format!("{base}/v1/commands/ledger/Deposit"))
            .json(&serde_json::json!({ "account": "a-1", "amount": "1", "statementInMs": 100 }))
            .send()
            .await
            .unwrap();
        assert_eq!(soon.status(), 200, "{language}");
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let (pending, parked) = timers(client.clone(), base.clone()).await;
            assert_eq!(parked, 0, "{language}: the statement timer's handler failed");
            if pending == 0 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{language}: the statement timer never fired"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let status = stop(&mut child);
    assert!(status.success(), "{language}: {}", log.join().unwrap().join("\n"));
}

#[test]
fn the_block_extractor_dedents_and_skips_other_languages() {
    let md = "text\n   ```rust\n   fn a() {}\n     b();\n   ```\n```sh\nls\n```\n```rust\nc\n```\n";
    assert_eq!(blocks(md, "rust"), ["fn a() {}\n  b();\n", "c\n"]);
    assert_eq!(blocks(md, "sh"), ["ls\n"]);
}
