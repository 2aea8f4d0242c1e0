//! The `obx` binary as a user runs it: `plugin check` offline, and `serve` on the embedded
//! default (no database URL: a throwaway Postgres from the system's binaries).

use std::path::Path;
use std::time::Duration;

mod common;

use common::{obx, plugin, serve, serve_adjusted, stop, wait_ready, Served};

fn check(file: &Path) -> (bool, String, String) {
    let out = obx().args(["plugin", "check"]).arg(file).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A Python component takes seconds to compile; the second check of the same file takes
/// its compiled code from the compile cache.
#[test]
fn a_second_check_of_a_python_plugin_uses_the_compile_cache() {
    let cache = tempfile::tempdir().unwrap();
    let check = || {
        let out = obx()
            .args(["plugin", "check"])
            .arg(plugin("shipping"))
            .env("OBX_PLUGINS__CACHE_DIR", cache.path())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
        stdout
    };
    let first = check();
    assert!(first.contains("compiled      now"), "{first}");
    let second = check();
    assert!(second.contains("compiled      from the compile cache"), "{second}");
}

/// `plugin check` names the contract version and world a component targets: the host runs
/// components of obx:plugin@0.2.0 and 0.2.1 side by side.
#[test]
fn plugin_check_names_the_contract_a_plugin_targets() {
    let (ok, stdout, stderr) = check(&plugin("legacy"));
    assert!(ok, "{stderr}");
    assert!(stdout.contains("contract      obx:plugin@0.2.0 (plugin)"), "{stdout}");
    let (ok, stdout, stderr) = check(&plugin("testbed"));
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("contract      obx:plugin@0.2.1 (timed-plugin)"),
        "{stdout}"
    );
}

#[test]
fn plugin_check_prints_the_manifest_of_a_good_plugin() {
    let (ok, stdout, stderr) = check(&plugin("orders"));
    assert!(ok, "{stderr}");
    assert!(stdout.contains("orders 0.1.0"), "{stdout}");
    assert!(stdout.contains("CreateOrder"), "{stdout}");
    assert!(
        stdout.contains("payload       OrderCreated on order.events: a JSON Schema, with an example"),
        "{stdout}"
    );

    let out = obx()
        .args(["plugin", "check", "--json"])
        .arg(plugin("orders"))
        .output()
        .unwrap();
    let manifest: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(manifest["name"], "orders");
    assert_eq!(manifest["migrations"][0]["id"], 1);
}

#[test]
fn plugin_check_refuses_what_is_not_a_plugin() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("notes.wasm");
    std::fs::write(&text, "this is not wasm").unwrap();
    let random = dir.path().join("random.wasm");
    // Random bytes (a fixed xorshift stream, so a failure reproduces).
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let bytes: Vec<u8> = (0..64 * 1024)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    std::fs::write(&random, bytes).unwrap();
    let core = dir.path().join("core.wasm");
    // The smallest valid core module: magic and version 1.
    std::fs::write(&core, b"\0asm\x01\0\0\0").unwrap();
    let truncated = dir.path().join("truncated.wasm");
    let orders = std::fs::read(plugin("orders")).unwrap();
    std::fs::write(&truncated, &orders[..orders.len() / 2]).unwrap();

    for (file, expected) in [
        (text, "not a WebAssembly file"),
        (random, "not a WebAssembly file"),
        (core, "core WebAssembly module, not a component"),
        (truncated, "failed to compile"),
        (plugin("other_world"), "does not fit the obx:plugin/plugin@0.2 world"),
    ] {
        let (ok, _, stderr) = check(&file);
        assert!(!ok, "{} was accepted", file.display());
        assert!(stderr.contains(expected), "{}: {stderr}", file.display());
    }
}

#[test]
fn serve_runs_on_the_embedded_database_and_stops_on_sigterm() {
    let Served {
        mut child,
        log,
        base,
        _plugins,
    } = serve(&[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let client = reqwest::Client::new();
    let order_id = rt.block_on(async {
        wait_ready(&client, &base, Duration::from_secs(60)).await;
        let r = client
            .post(format!("{base}/v1/commands/orders/CreateOrder"))
            .json(&serde_json::json!({ "customerId": "c-1", "amount": 10 }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.json::<serde_json::Value>().await.unwrap()["orderId"]
            .as_str()
            .unwrap()
            .to_string()
    });
    // The admin commands go through the host: no DATABASE_URL (the embedded database's URL
    // is printed nowhere), and the brokers are the host's in-process mock cluster.
    let run = |args: &[&str]| {
        let out = obx().args(args).args(["--url", &base]).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "obx {args:?}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    assert_eq!(run(&["dlq", "list"]).trim(), "no parked events");
    assert_eq!(run(&["dlq", "quarantine"]).trim(), "no quarantined messages");
    assert_eq!(
        run(&["dlq", "discard", "--parked", "orders"]).trim(),
        "orders: 0 parked events discarded"
    );
    let typo = obx()
        .args(["dlq", "discard", "--parked", "ordres", "--url", &base])
        .output()
        .unwrap();
    assert!(
        !typo.status.success() && String::from_utf8_lossy(&typo.stderr).contains("no plugin is named \"ordres\""),
        "a name that is no plugin's is refused: {}",
        String::from_utf8_lossy(&typo.stderr)
    );
    assert_eq!(run(&["timers", "list", "--limit", "1"]).trim(), "no timers");
    let refused = obx()
        .args(["timers", "list", "--limit", "0", "--url", &base])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("limit must be between 1 and 1000"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    // A replay sends published events only: the order's event, once the relay has sent it.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let replayed = run(&["outbox", "replay", "--aggregate-id", &order_id]);
        if replayed.trim() == "replayed 1 events" {
            break;
        }
        assert_eq!(replayed.trim(), "replayed 0 events");
        assert!(
            std::time::Instant::now() < deadline,
            "the order's event was never published"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let refused = obx().args(["dlq", "retry", "999", "--url", &base]).output().unwrap();
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("no parked dead letter with id 999"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    // `obx status`: each consumption row lines up with its header.
    let status = obx().args(["status", "--url", &base]).output().unwrap();
    let text = String::from_utf8_lossy(&status.stdout).into_owned();
    let lines: Vec<&str> = text.lines().collect();
    let header = lines
        .iter()
        .position(|l| l.trim_start().starts_with("plugin "))
        .expect(&text);
    let rows = &lines[header + 1..];
    assert!(!rows.is_empty(), "no consumption rows:\n{text}");
    for row in rows {
        assert_eq!(
            row.len(),
            lines[header].len(),
            "a row out of line with its header:\n{text}"
        );
    }

    let status = stop(&mut child);
    let log = log.join().unwrap().join("\n");
    assert!(status.success(), "exit status {status}; log:\n{log}");
    assert!(log.contains("throwaway Postgres"), "{log}");
    assert!(
        !log.contains('\x1b'),
        "a log written to a pipe has colour codes:\n{log}"
    );
}

/// With the usual soft open-files limit, idle HTTP peers could take every descriptor and leave
/// none for Postgres. `obx serve` raises its soft limit to the hard one, and lowers
/// `http.max_connections` (1,024 by default) below that, with a warning, where it does not fit.
#[test]
fn serve_raises_its_open_files_limit_and_fits_its_connections_under_it() {
    use std::os::unix::process::CommandExt;
    let Served {
        mut child,
        log,
        base,
        _plugins,
    } = serve_adjusted(&[], tempfile::tempdir().unwrap(), &[], |command| {
        // SAFETY: setrlimit is async-signal-safe and touches only the struct given.
        unsafe {
            command.pre_exec(|| {
                let limit = libc::rlimit {
                    rlim_cur: 256,
                    rlim_max: 800,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(wait_ready(&reqwest::Client::new(), &base, Duration::from_secs(60)));
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", child.0.id())).unwrap();
    let open_files = limits.lines().find(|l| l.starts_with("Max open files")).unwrap();
    let figures: Vec<&str> = open_files.split_whitespace().skip(3).take(2).collect();
    assert_eq!(figures, ["800", "800"], "{open_files}");
    let status = stop(&mut child);
    let log = log.join().unwrap().join("\n");
    assert!(status.success(), "exit status {status}; log:\n{log}");
    assert!(log.contains("http.max_connections is more than"), "{log}");
    // 800, less 512 and the two pools (16 and 2 sessions).
    assert!(log.contains("cap=270"), "{log}");
}

/// An error answer that is not the host's JSON (a proxy's page, the HTTP layer's own
/// refusal) is reported with its status and the start of its text, not as an unreadable
/// answer.
#[test]
fn obx_status_reports_the_status_of_an_error_that_is_not_json() {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let proxy = std::thread::spawn(move || {
        let (mut peer, _) = listener.accept().unwrap();
        let mut head = [0u8; 4096];
        let _ = peer.read(&mut head);
        let page = "<html><body>Bad Gateway</body></html>";
        let answer = format!(
            "HTTP/1.1 502 Bad Gateway\r\ncontent-type: text/html\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{page}",
            page.len()
        );
        peer.write_all(answer.as_bytes()).unwrap();
    });
    let out = obx().args(["status", "--url", &url]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("502") && stderr.contains("Bad Gateway"), "{stderr}");
    // Joined only once the answer shows the peer was reached: it would wait for ever on a
    // `status` that never connected.
    proxy.join().unwrap();
}

#[test]
fn a_json_log_is_one_object_per_line_and_an_unknown_format_is_refused() {
    let Served {
        mut child,
        log,
        base,
        _plugins,
    } = serve(&["--log-format", "json"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(wait_ready(&reqwest::Client::new(), &base, Duration::from_secs(60)));
    let status = stop(&mut child);
    let log = log.join().unwrap();
    assert!(status.success(), "exit status {status}; log:\n{}", log.join("\n"));
    assert!(log.len() >= 3, "{log:?}");
    for line in &log {
        let entry: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(entry["level"].is_string() && entry["fields"].is_object(), "{line}");
    }
    assert!(log.iter().any(|l| l.contains("throwaway Postgres")), "{log:?}");

    let out = obx().args(["--log-format", "yaml", "status"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("yaml") && stderr.contains("json") && stderr.contains("text"),
        "{stderr}"
    );
}

#[test]
fn plugin_test_fails_a_handler_that_refuses_a_valid_event_and_says_what_that_would_do() {
    let out = obx().args(["plugin", "test"]).arg(plugin("testbed")).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    let line = stdout
        .lines()
        .find(|l| l.contains("a valid Refused on testbed.inbox"))
        .unwrap_or_else(|| panic!("no line for the declared example:\n{stdout}"));
    assert!(line.trim_start().starts_with("FAIL"), "{line}");
    assert!(line.contains("rejected") && line.contains("parked at once"), "{line}");
    // The example that the handler takes passes.
    assert!(
        stdout.contains("ok   a valid Checked on testbed.events is handled with ok"),
        "{stdout}"
    );
}

/// `obx plugin release-event` works on the database: with none configured, it says so and
/// changes nothing (`tests/confinement.rs` releases a declaration on a real one).
#[test]
fn plugin_release_event_without_a_database_says_it_needs_one() {
    let out = obx()
        .args(["plugin", "release-event", "orders", "order.events", "OrderCreated"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("needs the database: set DATABASE_URL"), "{stderr}");
}
