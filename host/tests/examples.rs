//! The scripts in examples/, run as a user runs them: with bash and curl, against `obx serve`.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{serve_with, wait_ready, Served};

/// examples/saga.sh shows both endings of the payment saga: a payment confirmed in time
/// completes its order; one whose deadline passes is timed out, its stock released and its
/// order cancelled, and it can no longer be confirmed.
#[test]
fn the_saga_example_shows_both_endings() {
    let Served {
        child,
        log,
        base,
        _plugins,
    } = serve_with(&[], &["orders", "inventory", "payments"], &[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(wait_ready(&reqwest::Client::new(), &base, Duration::from_secs(180)));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/saga.sh");
    let out = Command::new("bash")
        .arg(script)
        .env("OBX_URL", &base)
        .env("DEADLINE_MS", "1500")
        .output()
        .unwrap();
    drop(child);
    let said = String::from_utf8_lossy(&out.stdout);
    let logged = log.join().unwrap_or_default().join("\n");
    assert!(
        out.status.success(),
        "{said}\n{}\n{logged}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!said.contains("still not"), "{said}");
    for shown in [
        "\"deadlineMs\":1500",
        "\"status\":\"confirmed\"",
        "paid",
        "timed_out",
        "cancelled",
        // 10 in stock, 2 kept by the paid order, 3 released by the compensation.
        "stock after the compensation: {\"productId\":\"p-saga\",\"quantity\":10,\"reserved\":2}",
        "payment-timed-out",
    ] {
        assert!(said.contains(shown), "{shown:?} not in:\n{said}");
    }
}
