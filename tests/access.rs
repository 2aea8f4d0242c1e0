//! Who may use the API, and what it never shows: bearer tokens by scope, and secrets kept
//! out of logs, answers, `/metrics` and `/v1/status`.

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use obx::config::Secret;
use obx_tests::*;
use serde_json::json;

const COMMAND_TOKEN: &str = "cmd-token-4f1d2c3b5a697887";
const ADMIN_TOKEN: &str = "adm-token-9e8d7c6b5a4f3e2d";
const READ_TOKEN: &str = "read-token-1a2b3c4d5e6f7a8b";
const KAFKA_PASSWORD: &str = "kafka-password-3d5f7a9b";

/// Everything any part of this test process logs, at debug level and above.
fn captured() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = log.clone();
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("debug"))
            .with_ansi(false)
            .with_writer(move || Sink(sink.clone()))
            .init();
        log
    })
}

struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A host that needs tokens, and the broker it relays to (kept alive by the caller).
async fn guarded_host() -> (TestHost, TestBroker) {
    captured();
    let broker = broker();
    let database = fresh_database().await;
    // The test server checks passwords: the host's is in the URL.
    assert!(database.contains(HOST_PASSWORD), "{database}");
    let host = spawn_host_on(&database, &["orders", "testbed"], |c| {
        broker.configure(c);
        c.database.url = Some(Secret::new(database.clone()));
        c.kafka
            .properties
            .insert("sasl.password".into(), Secret::new(KAFKA_PASSWORD));
        c.http.auth.command_tokens = vec![Secret::new(COMMAND_TOKEN)];
        c.http.auth.admin_tokens = vec![Secret::new(ADMIN_TOKEN)];
        c.http.auth.read_tokens = vec![Secret::new(READ_TOKEN)];
    })
    .await;
    (host, broker)
}

async fn send(host: &TestHost, method: &str, path: &str, auth: Option<&str>) -> (u16, String, Option<String>) {
    let client = reqwest::Client::new();
    let url = format!("{}{path}", host.url);
    let mut req = match method {
        "POST" => client
            .post(url)
            .header("content-type", "application/json")
            .body(json!({ "customerId": "c-1", "amount": 5 }).to_string()),
        _ => client.get(url),
    };
    if let Some(auth) = auth {
        req = req.header("authorization", auth);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let challenge = r
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap().to_string());
    (status, r.text().await.unwrap(), challenge)
}

#[tokio::test]
async fn unauthenticated_and_wrongly_scoped_requests_are_refused() {
    let (host, _broker) = guarded_host().await;
    let command = "/v1/commands/orders/CreateOrder";
    let bearer = |t: &str| format!("Bearer {t}");
    let wrong = bearer("not-a-token-of-ours-at-all");
    let (cmd, adm, read) = (bearer(COMMAND_TOKEN), bearer(ADMIN_TOKEN), bearer(READ_TOKEN));

    // (method, path, authorization, expected status)
    let cases: Vec<(&str, &str, Option<&str>, u16)> = vec![
        // A read token reads what an admin token reads, and acts on nothing.
        ("POST", command, Some(&read), 403),
        ("GET", "/v1/status", Some(&read), 200),
        ("GET", "/v1/plugins", Some(&read), 200),
        ("GET", "/metrics", Some(&read), 200),
        ("GET", "/v1/dlq", Some(&read), 200),
        ("GET", "/v1/quarantine", Some(&read), 200),
        ("GET", "/v1/timers", Some(&read), 200),
        ("GET", "/v1/catalog", Some(&read), 200),
        ("POST", "/v1/dlq/1/retry", Some(&read), 403),
        ("POST", "/v1/dlq/1/discard", Some(&read), 403),
        ("POST", "/v1/dlq/discard?plugin=orders", Some(&read), 403),
        ("POST", "/v1/timers/cancel", Some(&read), 403),
        ("POST", "/v1/timers/retry", Some(&read), 403),
        ("POST", "/v1/outbox/replay", Some(&read), 403),
        ("POST", "/v1/status", Some(&read), 405),
        ("POST", "/v1/status", None, 401),
        ("POST", command, None, 401),
        ("POST", command, Some(&wrong), 401),
        ("POST", command, Some("Basic YWRtaW46YWRtaW4="), 401),
        ("POST", command, Some(COMMAND_TOKEN), 401), // no scheme
        ("POST", command, Some("Bearer "), 401),
        ("POST", command, Some(&adm), 403),
        ("POST", command, Some(&cmd), 200),
        ("POST", "/v1/commands/nope/Nope", None, 401), // no hint that the plugin is absent
        ("GET", "/v1/status", None, 401),
        ("GET", "/v1/status", Some(&wrong), 401),
        ("GET", "/v1/status", Some(&cmd), 403),
        ("GET", "/v1/status", Some(&adm), 200),
        ("GET", "/v1/plugins", None, 401),
        ("GET", "/v1/plugins", Some(&cmd), 403),
        ("GET", "/v1/plugins", Some(&adm), 200),
        ("GET", "/metrics", None, 401),
        ("GET", "/metrics", Some(&cmd), 403),
        ("GET", "/metrics", Some(&adm), 200),
        ("GET", "/v1/dlq", None, 401),
        ("GET", "/v1/dlq", Some(&cmd), 403),
        ("GET", "/v1/dlq", Some(&adm), 200),
        ("POST", "/v1/dlq/1/retry", None, 401),
        ("POST", "/v1/dlq/1/discard", Some(&cmd), 403),
        ("POST", "/v1/dlq/discard?plugin=orders", Some(&cmd), 403),
        ("POST", "/v1/dlq/discard?plugin=orders", None, 401),
        ("POST", "/v1/dlq/discard?plugin=orders", Some(&adm), 200), // none parked: 0 discarded
        ("POST", "/v1/dlq/1/retry", Some(&adm), 404),               // nothing parked
        ("GET", "/v1/quarantine", None, 401),
        ("GET", "/v1/quarantine", Some(&cmd), 403),
        ("GET", "/v1/quarantine", Some(&adm), 200),
        ("POST", "/v1/outbox/replay", None, 401),
        ("POST", "/v1/outbox/replay", Some(&cmd), 403),
        ("POST", "/v1/outbox/replay", Some(&adm), 422), // a command's body is not a filter
        ("GET", "/v1/timers", None, 401),
        ("GET", "/v1/timers", Some(&cmd), 403),
        ("GET", "/v1/timers", Some(&adm), 200),
        ("POST", "/v1/timers/cancel", None, 401),
        ("POST", "/v1/timers/cancel", Some(&cmd), 403),
        ("POST", "/v1/timers/retry", None, 401),
        ("POST", "/v1/timers/retry", Some(&cmd), 403),
        ("GET", "/v1/catalog", None, 401),
        ("GET", "/v1/catalog", Some(&cmd), 403),
        ("GET", "/v1/catalog", Some(&adm), 200),
        ("GET", "/v1/catalog?format=asyncapi", Some(&adm), 200),
        ("GET", "/v1/catalog?format=yaml", Some(&adm), 400),
        ("GET", "/healthz", None, 200),
        ("GET", "/readyz", None, 200),
    ];
    for (method, path, auth, expected) in cases {
        let (status, body, challenge) = send(&host, method, path, auth).await;
        assert_eq!(status, expected, "{method} {path} with {auth:?}: {body}");
        match status {
            401 => {
                assert_eq!(challenge.as_deref(), Some("Bearer"), "{method} {path}");
                let body: serde_json::Value = serde_json::from_str(&body).unwrap();
                assert_eq!(body["error"]["code"], "unauthorized");
                assert_eq!(body["error"]["message"], "authentication required");
            }
            403 => {
                let body: serde_json::Value = serde_json::from_str(&body).unwrap();
                assert_eq!(body["error"]["code"], "forbidden");
                assert_eq!(body["error"]["message"], "not allowed");
            }
            _ => {}
        }
    }
    host.shutdown().await;
}

#[tokio::test]
async fn secrets_never_reach_logs_or_endpoints() {
    let (host, _broker) = guarded_host().await;
    let (cmd, adm) = (format!("Bearer {COMMAND_TOKEN}"), format!("Bearer {ADMIN_TOKEN}"));
    let mut seen = Vec::new();
    for (method, path, auth) in [
        ("POST", "/v1/commands/orders/CreateOrder", Some(cmd.as_str())),
        ("POST", "/v1/commands/testbed/fail", Some(&cmd)),
        ("POST", "/v1/commands/testbed/sql", Some(&cmd)),
        ("POST", "/v1/commands/nope/Nope", Some(&cmd)),
        ("POST", "/v1/commands/orders/CreateOrder", Some(&adm)),
        (
            "POST",
            "/v1/commands/orders/CreateOrder",
            Some("Bearer wrong-token-0123456789"),
        ),
        ("GET", "/v1/status", Some(&adm)),
        ("GET", "/v1/plugins", Some(&adm)),
        ("GET", "/metrics", Some(&adm)),
        ("GET", "/nowhere", Some(&adm)),
    ] {
        let (status, body, _) = send(&host, method, path, auth).await;
        seen.push(format!("{method} {path} -> {status}: {body}"));
    }
    // The plugins' own database passwords are secrets too.
    let plugin_passwords: Vec<String> = sqlx::query_scalar("SELECT password FROM obx.plugin_credential")
        .fetch_all(&host.db)
        .await
        .unwrap();
    assert_eq!(plugin_passwords.len(), 2);
    // Let the relay publish and log what it does.
    eventually(std::time::Duration::from_secs(20), "the outbox drains", || async {
        host.count("SELECT count(*) FROM obx.outbox_event WHERE published_at IS NULL")
            .await
            == 0
    })
    .await;
    host.shutdown().await;

    let log = String::from_utf8(captured().lock().unwrap().clone()).unwrap();
    assert!(log.contains("DEBUG") || log.contains("INFO"), "nothing was captured");
    let endpoints = seen.join("\n");
    assert!(endpoints.contains("/v1/status -> 200"), "{endpoints}");
    assert!(endpoints.contains("/metrics -> 200"), "{endpoints}");
    let plugin_secrets = plugin_passwords.iter().map(String::as_str);
    for secret in [COMMAND_TOKEN, ADMIN_TOKEN, HOST_PASSWORD, KAFKA_PASSWORD]
        .into_iter()
        .chain(plugin_secrets)
    {
        assert!(!log.contains(secret), "{secret} is in the log");
        assert!(!endpoints.contains(secret), "{secret} is in an answer:\n{endpoints}");
    }
}

/// One request over a connection of its own, written as a browser or a hostile page would
/// send it; the answer's status and body.
async fn raw(host: &TestHost, head: &str, body: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = host.url.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "{head}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    let status = answer.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

#[tokio::test]
async fn a_host_without_tokens_serves_no_web_page_and_no_rebound_name() {
    let host = spawn_host(&["orders"]).await;
    let port = host.url.rsplit(':').next().unwrap().to_string();
    let create = "POST /v1/commands/orders/CreateOrder HTTP/1.1";
    let order = r#"{"customerId": "c-1", "amount": 5}"#;
    // (the request's head after its start line, what it is)
    let hostile = [
        // Any page may post to 127.0.0.1 with no CORS preflight: `fetch` in no-cors mode with
        // a body of no type sends no Content-Type at all.
        (
            format!("Host: 127.0.0.1:{port}\r\nOrigin: https://evil.example"),
            "a cross-site post",
        ),
        (
            format!("Host: 127.0.0.1:{port}\r\nOrigin: null\r\nContent-Type: text/plain"),
            "a sandboxed frame",
        ),
        // DNS rebinding: the page's own name now points at 127.0.0.1, so it is same-origin.
        (
            format!("Host: rebound.evil.example:{port}\r\nContent-Type: application/json"),
            "a rebound name",
        ),
        (
            format!("Host: localhost:{port}\r\nHost: evil.example:{port}"),
            "two Host headers",
        ),
        // A page on this machine is of another origin too: a dev server's, a notebook's.
        (
            format!("Host: localhost:{port}\r\nOrigin: http://localhost:3000\r\nSec-Fetch-Site: same-site"),
            "a local page",
        ),
        (
            format!("Host: localhost:{port}\r\nOrigin: http://localhost:3000"),
            "a local page, in a browser that sends no Sec-Fetch-Site",
        ),
    ];
    for (head, what) in &hostile {
        let (status, body) = raw(&host, &format!("{create}\r\n{head}"), order).await;
        assert_eq!(status, 403, "{what}: {body}");
        let body: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["error"]["code"], "local_only", "{what}");
    }
    // A rebound name cannot read either, nor can a page's no-cors GET (it sends no Origin).
    for head in [
        format!("Host: rebound.evil.example:{port}"),
        format!("Host: 127.0.0.1:{port}\r\nSec-Fetch-Site: cross-site"),
    ] {
        let (status, _) = raw(&host, &format!("GET /v1/status HTTP/1.1\r\n{head}"), "").await;
        assert_eq!(status, 403, "{head}");
    }
    // Health and readiness stay open, for probes through any name.
    for path in ["/healthz", "/readyz"] {
        let head = format!("GET {path} HTTP/1.1\r\nHost: rebound.evil.example:{port}");
        assert_eq!(raw(&host, &head, "").await.0, 200, "{path}");
    }
    assert_eq!(
        host.count("SELECT count(*) FROM obx.outbox_event").await,
        0,
        "a refused command ran"
    );

    // This machine's callers are served, a URL typed into its browser among them.
    let local = [
        format!("Host: 127.0.0.1:{port}\r\nContent-Type: application/json"),
        format!("Host: localhost:{port}\r\nSec-Fetch-Site: none\r\nContent-Type: application/json"),
        format!("Host: [::1]:{port}\r\nContent-Type: application/json"),
    ];
    for head in &local {
        let (status, body) = raw(&host, &format!("{create}\r\n{head}"), order).await;
        assert_eq!(status, 200, "{head}: {body}");
    }
    assert_eq!(host.count("SELECT count(*) FROM obx.outbox_event").await, 3);
    host.shutdown().await;
}

#[tokio::test]
async fn a_host_with_tokens_serves_any_name_its_proxy_gives() {
    let (host, _broker) = guarded_host().await;
    let port = host.url.rsplit(':').next().unwrap().to_string();
    let head = format!(
        "POST /v1/commands/orders/CreateOrder HTTP/1.1\r\nHost: orders.example.com:{port}\r\n\
         Origin: https://app.example.com\r\nAuthorization: Bearer {COMMAND_TOKEN}\r\nContent-Type: application/json"
    );
    let (status, body) = raw(&host, &head, r#"{"customerId": "c-1", "amount": 5}"#).await;
    assert_eq!(status, 200, "{body}");
    host.shutdown().await;
}
