//! `obx plugin new` as a plugin author uses it, for each language: from an empty directory,
//! make the project, run its own test script (build, then `obx plugin test`), then load the
//! three plugins into a running host, which answers their commands and runs their
//! subscriptions.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

mod common;

use common::{obx, run, serve_dir, stop, wait_ready, Served};

const LANGUAGES: &[(&str, &str)] = &[("rust", "notes_rs"), ("python", "notes_py"), ("javascript", "notes_js")];

/// Where the Rust project builds: beside the shared target directory, never inside it (this
/// test runs under `cargo test`, which holds that directory's lock).
fn rust_target_dir(scratch: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => PathBuf::from(dir).join("scaffold"),
        None => scratch.join("target"),
    }
}

/// componentize-py: `COMPONENTIZE_PY` (which `cargo xtask test` sets to the one it
/// installed), or the PATH's.
fn componentize_py() -> String {
    std::env::var("COMPONENTIZE_PY").unwrap_or_else(|_| "componentize-py".into())
}

/// A PATH on which `obx` is the binary under test.
fn path_with_obx() -> std::ffi::OsString {
    let bin = Path::new(env!("CARGO_BIN_EXE_obx")).parent().unwrap().to_path_buf();
    let mut dirs = vec![bin];
    dirs.extend(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()));
    std::env::join_paths(dirs).unwrap()
}

#[test]
fn a_new_plugin_in_each_language_builds_passes_its_test_and_runs_in_a_host() {
    let scratch = tempfile::tempdir().unwrap();
    let mut built = Vec::new();
    for (language, name) in LANGUAGES {
        let made = run(
            &format!("obx plugin new {name} --lang {language}"),
            obx()
                .current_dir(scratch.path())
                .args(["plugin", "new", name, "--lang", language]),
        );
        assert!(made.contains(&format!("made plugin {name}")), "{made}");
        let dir = scratch.path().join(name);
        assert!(dir.join("wit/obx.wit").exists() && dir.join("README.md").exists());
        if *language == "rust" {
            // The stack that lets the host keep a call's pages resident (runtime::pool).
            let config = std::fs::read_to_string(dir.join(".cargo/config.toml")).unwrap();
            assert!(config.contains("-zstack-size=65536"), "{config}");
        }
        let started = Instant::now();
        let tested = run(
            &format!("{language}: ./test.sh"),
            Command::new(dir.join("test.sh"))
                .current_dir(&dir)
                .env("PATH", path_with_obx())
                .env("CARGO_TARGET_DIR", rust_target_dir(scratch.path()))
                .env("COMPONENTIZE_PY", componentize_py())
                .env_remove("DATABASE_URL"),
        );
        assert!(tested.contains("conformant"), "{language}: {tested}");
        // Its NoteAdded schema's example went through the handler.
        assert!(tested.contains("a valid NoteAdded"), "{language}: {tested}");
        eprintln!("{language}: built and tested in {:?}", started.elapsed());
        built.push((*name, dir.join(format!("{name}.wasm"))));
    }

    // The three in one host: each answers its commands, and its subscription marks the
    // note seen once the relay has published NoteAdded and the consumer handled it.
    let plugins = tempfile::tempdir().unwrap();
    for (name, wasm) in &built {
        std::fs::copy(wasm, plugins.path().join(format!("{name}.wasm"))).unwrap();
    }
    let Served {
        mut child,
        log,
        base,
        _plugins,
    } = serve_dir(&[], plugins, &[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let client = reqwest::Client::new();
    rt.block_on(async {
        wait_ready(&client, &base, Duration::from_secs(180)).await;
        for (name, _) in &built {
            let call = |command: &str, body: serde_json::Value| {
                client
                    .post(format!("{base}/v1/commands/{name}/{command}"))
                    .json(&body)
                    .send()
            };
            let added = call("AddNote", serde_json::json!({"text": "hello"})).await.unwrap();
            assert_eq!(added.status(), 200, "{name}: {}", added.text().await.unwrap());
            let id = added.json::<serde_json::Value>().await.unwrap()["id"]
                .as_str()
                .unwrap()
                .to_string();
            let refused = call("GetNote", serde_json::json!({"id": "not-a-uuid"})).await.unwrap();
            assert_eq!(refused.status(), 400, "{name}: a malformed id");
            let unknown = call("GetNote", serde_json::json!({"id": uuid::Uuid::new_v4().to_string()}))
                .await
                .unwrap();
            assert_eq!(unknown.status(), 409, "{name}: an unknown note");
            let started = Instant::now();
            loop {
                let note: serde_json::Value = call("GetNote", serde_json::json!({"id": id}))
                    .await
                    .unwrap()
                    .json()
                    .await
                    .unwrap();
                assert_eq!(note["text"], "hello", "{name}: {note}");
                if note["seen"] == true {
                    break;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "{name}: NoteAdded was not handled in 30 s: {note}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });
    let status = stop(&mut child);
    let log = log.join().unwrap().join("\n");
    assert!(status.success(), "exit status {status}; log:\n{log}");
}

#[test]
fn obx_wit_prints_the_contract_and_writes_it_where_asked() {
    let printed = run("obx wit", obx().arg("wit"));
    assert!(printed.contains("package obx:plugin@"), "{printed}");
    assert!(printed.contains("world plugin"), "{printed}");
    let dir = tempfile::tempdir().unwrap();
    let said = run(
        "obx wit --out",
        obx().args(["wit", "--out"]).arg(dir.path().join("wit")),
    );
    assert!(said.contains("obx.wit"), "{said}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("wit/obx.wit")).unwrap(),
        printed
    );
    let refused = obx()
        .args(["plugin", "new", "Bad-Name", "--lang", "rust"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("a-z, 0-9 and _"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}
