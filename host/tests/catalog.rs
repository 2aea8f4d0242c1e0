//! `obx catalog` against a host serving the example chain: the table a reader sees, and
//! the AsyncAPI document, checked by the AsyncAPI project's own parser (@asyncapi/parser,
//! run by node from tests/interop).

use std::path::Path;
use std::time::Duration;

mod common;

use common::{blocks, obx, serve_with, stop, wait_ready, Served};

const CHAIN: &[&str] = &["orders", "inventory", "payments", "shipping", "notifications"];

fn catalog(base: &str, args: &[&str]) -> String {
    let out = obx().arg("catalog").args(args).args(["--url", base]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "obx catalog {args:?}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn the_example_chain_has_a_catalogue_and_a_valid_asyncapi_document() {
    let Served {
        mut child,
        log,
        base,
        _plugins,
    } = serve_with(&[], CHAIN, &[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(wait_ready(&reqwest::Client::new(), &base, Duration::from_secs(180)));

    // The table: one row per event, emitter and consumers side by side.
    let table = catalog(&base, &[]);
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("topic") && lines[0].contains("consumed by"),
        "{table}"
    );
    let row = |event: &str| {
        *lines
            .iter()
            .find(|l| l.split_whitespace().nth(1) == Some(event))
            .unwrap_or_else(|| panic!("no row for {event}:\n{table}"))
    };
    for (event, emitter, consumer) in [
        ("OrderCreated", "orders", "inventory (dedup)"),
        ("ProductReserved", "inventory", "payments (inbox)"),
        ("PaymentRequested", "payments", "shipping (dedup)"),
        ("PaymentConfirmed", "payments", "orders (dedup)"),
        ("PaymentTimedOut", "payments", "inventory (dedup)"),
        ("ShipmentScheduled", "shipping", "notifications (dedup)"),
    ] {
        let line = row(event);
        assert!(line.contains(emitter) && line.contains(consumer), "{line}");
    }
    // Emitted, consumed by nobody in this service.
    assert!(row("CustomerNotified").trim_end().ends_with('-'), "{table}");
    // The plugin guide shows this very table.
    let guide = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/plugin-guide.md")).unwrap();
    let section = &guide[guide
        .find("## The event catalogue")
        .expect("the guide's catalogue section")..];
    let shown = blocks(section, "text").into_iter().next().expect("a text block");
    assert_eq!(
        shown.trim_end(),
        table.trim_end(),
        "docs/plugin-guide.md shows another catalogue"
    );

    // AsyncAPI: what the AsyncAPI tools read.
    let document = catalog(&base, &["--asyncapi"]);
    let parsed: serde_json::Value = serde_json::from_str(&document).unwrap();
    assert_eq!(parsed["asyncapi"], "3.0.0");
    assert_eq!(parsed["channels"]["order.events"]["address"], "order.events");
    assert_eq!(
        parsed["operations"]["inventory.receive.order.events.OrderCreated"]["action"],
        "receive"
    );
    // OrderCreated's declared schema and example (plugins/contracts/) are the message's.
    let created = &parsed["channels"]["order.events"]["messages"]["OrderCreated"];
    assert_eq!(created["payload"]["required"][0], "orderId", "{created}");
    assert_eq!(created["examples"][0]["payload"]["customerId"], "c-1", "{created}");
    // Every event of the chain has a declared schema, in each of the three languages.
    for (channel, message) in [
        ("order.events", "OrderCreated"),
        ("inventory.events", "ProductReserved"),
        ("inventory.events", "ProductReservationFailed"),
        ("payment.events", "PaymentRequested"),
        ("shipping.events", "ShipmentScheduled"),
        ("notification.events", "CustomerNotified"),
    ] {
        let payload = &parsed["channels"][channel]["messages"][message]["payload"];
        assert!(
            payload["required"].is_array(),
            "{message} has no declared schema: {payload}"
        );
    }
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), &document).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/interop/validate-asyncapi.js");
    assert!(
        script.with_file_name("node_modules/@asyncapi/parser").exists(),
        "@asyncapi/parser is not installed: `cargo xtask test` runs `npm ci` in tests/interop"
    );
    let out = std::process::Command::new("node")
        .arg(&script)
        .arg(file.path())
        .output()
        .expect("running node");
    let said = String::from_utf8_lossy(&out.stdout);
    eprintln!("{said}");
    assert!(
        out.status.success(),
        "the AsyncAPI parser refused the document:\n{said}{}\n{document}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("valid AsyncAPI 3.0.0"), "{said}");

    let status = stop(&mut child);
    let log = log.join().unwrap().join("\n");
    assert!(status.success(), "exit status {status}; log:\n{log}");
}
