//! Traces over OTLP, as an operator sees them: `obx serve` runs the example chain and
//! exports to an OTLP/HTTP receiver that this test runs, and one order is one span tree,
//! from the HTTP request to the last plugin of the chain.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::IntoResponse;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;

mod common;

use common::{serve_with, stop, wait_ready, KillOnDrop, Served};

/// What the receiver was sent: each span with its resource's `service.name`.
type Received = Arc<Mutex<Vec<(String, Span)>>>;

/// An OTLP/HTTP receiver (protobuf) on a free port: its base address, and what it receives.
async fn receiver() -> (String, Received) {
    let received = Received::default();
    let app = axum::Router::new()
        .route("/v1/traces", axum::routing::post(take))
        .with_state(received.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), received)
}

async fn take(State(received): State<Received>, headers: HeaderMap, body: Bytes) -> impl IntoResponse {
    if headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()) != Some("application/x-protobuf") {
        return StatusCode::UNSUPPORTED_MEDIA_TYPE.into_response();
    }
    let Ok(request) = ExportTraceServiceRequest::decode(body) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let mut spans = received.lock().unwrap();
    for resource in request.resource_spans {
        let service = resource
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find_map(|kv| (kv.key == "service.name").then(|| text(kv)))
            .unwrap_or_default();
        for scope in resource.scope_spans {
            spans.extend(scope.spans.into_iter().map(|s| (service.clone(), s)));
        }
    }
    // An empty ExportTraceServiceResponse: everything was accepted.
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/x-protobuf")],
        Vec::new(),
    )
        .into_response()
}

fn text(kv: &KeyValue) -> String {
    match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        other => format!("{other:?}"),
    }
}

fn attribute(span: &Span, key: &str) -> Option<String> {
    span.attributes.iter().find(|kv| kv.key == key).map(text)
}

/// The spans of one trace, by span id.
struct Tree<'a> {
    spans: HashMap<&'a [u8], &'a Span>,
}

impl<'a> Tree<'a> {
    fn children(&self, parent: &Span) -> Vec<&'a Span> {
        let mut children: Vec<&Span> = self
            .spans
            .values()
            .filter(|s| s.parent_span_id == parent.span_id)
            .copied()
            .collect();
        children.sort_by_key(|s| s.start_time_unix_nano);
        children
    }

    /// The tree under `span`, one span per line, for a reader of the test's output.
    fn draw(&self, span: &Span, depth: usize, out: &mut String) {
        out.push_str(&format!("{}{}\n", "  ".repeat(depth), span.name));
        for child in self.children(span) {
            self.draw(child, depth + 1, out);
        }
    }

    /// The one child of `parent` named `name` (and, with `plugin`, of that plugin).
    fn only_child(&self, parent: &Span, name: &str, plugin: Option<&str>) -> &'a Span {
        let found: Vec<&Span> = self
            .children(parent)
            .into_iter()
            .filter(|s| s.name == name && plugin.is_none_or(|p| attribute(s, "obx.plugin").as_deref() == Some(p)))
            .collect();
        assert_eq!(
            found.len(),
            1,
            "{:?} should have one child {name:?} ({plugin:?}); its children: {:?}",
            parent.name,
            self.children(parent).iter().map(|s| &s.name).collect::<Vec<_>>()
        );
        found[0]
    }
}

/// Waits up to 60 s for the receiver to have a span that `wanted` picks.
async fn wait_for_span(received: &Received, wanted: impl Fn(&Span) -> bool) {
    let started = Instant::now();
    while !received.lock().unwrap().iter().any(|(_, s)| wanted(s)) {
        let names: Vec<String> = received.lock().unwrap().iter().map(|(_, s)| s.name.clone()).collect();
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "not the span awaited in 60 s; received: {names:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

const CHAIN: &[&str] = &["orders", "inventory", "payments", "shipping", "notifications"];
/// Each event of the chain and the plugin that handles it.
const HANDLED: &[(&str, &str)] = &[
    ("OrderCreated", "inventory"),
    ("ProductReserved", "payments"),
    ("PaymentRequested", "shipping"),
    ("ShipmentScheduled", "notifications"),
];
/// The caller's trace: the order's HTTP request continues it.
const CALLER_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const CALLER_SPAN: &str = "b7ad6b7169203331";

/// `obx serve` with `plugins` and `env`, exporting its traces every 100 ms (rather than every
/// 5 s) to a receiver of this test's, which runs on the returned runtime.
fn serve_exporting(plugins: &[&str], env: &[(&str, &str)]) -> (tokio::runtime::Runtime, Received, Served) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (endpoint, received) = rt.block_on(receiver());
    let mut all = vec![
        ("OBX_TELEMETRY__OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    all.extend_from_slice(env);
    let served = serve_with(&[], plugins, &all);
    (rt, received, served)
}

/// Stops the host, asserts it exited cleanly, and returns its log.
fn stop_cleanly(child: &mut KillOnDrop, log: std::thread::JoinHandle<Vec<String>>) -> String {
    let status = stop(child);
    let log = log.join().unwrap().join("\n");
    assert!(status.success(), "exit status {status}; log:\n{log}");
    log
}

#[test]
fn one_order_is_one_span_tree_from_the_http_request_to_the_last_plugin_of_the_chain() {
    let (rt, received, served) = serve_exporting(CHAIN, &[("OTEL_SERVICE_NAME", "shop")]);
    let Served {
        mut child,
        log,
        base,
        _plugins,
    } = served;
    let trace_id = hex::decode(CALLER_TRACE).unwrap();
    let client = reqwest::Client::new();
    rt.block_on(async {
        wait_ready(&client, &base, Duration::from_secs(180)).await;
        let post = |plugin: &str, command: &str, body: serde_json::Value| {
            client
                .post(format!("{base}/v1/commands/{plugin}/{command}"))
                .json(&body)
        };
        let stocked = post(
            "inventory",
            "AddStock",
            serde_json::json!({"productId": "p-1", "quantity": 10}),
        )
        .send()
        .await
        .unwrap();
        assert_eq!(stocked.status(), 200);
        let order = post(
            "orders",
            "CreateOrder",
            serde_json::json!({"customerId": "c-1", "amount": 42.5, "items": [{"productId": "p-1", "quantity": 3}]}),
        )
        .header("traceparent", format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01"))
        .send()
        .await
        .unwrap();
        assert_eq!(order.status(), 200);
        let answered = order.headers()["traceparent"].to_str().unwrap().to_string();
        assert!(answered.starts_with(&format!("00-{CALLER_TRACE}-")), "{answered}");
        // The chain's end: the last plugin's event, published.
        let last = "publish notification.events";
        wait_for_span(&received, |s| s.trace_id == trace_id && s.name == last).await;
    });
    let log = stop_cleanly(&mut child, log);
    assert!(log.contains("exporting traces over OTLP"), "{log}");

    let received = received.lock().unwrap();
    let ours: Vec<&(String, Span)> = received.iter().filter(|(_, s)| s.trace_id == trace_id).collect();
    assert!(
        ours.iter().all(|(service, _)| service == "shop"),
        "OTEL_SERVICE_NAME was not used"
    );
    let tree = Tree {
        spans: ours.iter().map(|(_, s)| (&s.span_id[..], s)).collect(),
    };
    assert_eq!(tree.spans.len(), ours.len(), "a span id was exported twice");

    // One root, under the caller's span: the HTTP request.
    let roots: Vec<&&Span> = tree
        .spans
        .values()
        .filter(|s| !tree.spans.contains_key(&s.parent_span_id[..]))
        .collect();
    assert_eq!(
        roots.len(),
        1,
        "spans whose parent is not in the trace: {:?}",
        roots.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
    let http = roots[0];
    let mut drawn = String::new();
    tree.draw(http, 0, &mut drawn);
    eprintln!("{} spans:\n{drawn}", tree.spans.len());
    assert_eq!(http.name, "POST /v1/commands/{plugin}/{command}");
    assert_eq!(hex::encode(&http.parent_span_id), CALLER_SPAN);
    assert_eq!(http.kind, SpanKind::Server as i32);
    assert_eq!(attribute(http, "http.response.status_code").as_deref(), Some("200"));
    assert_eq!(
        attribute(http, "url.path").as_deref(),
        Some("/v1/commands/orders/CreateOrder")
    );

    let command = tree.only_child(http, "command orders.CreateOrder", None);
    assert_eq!(attribute(command, "obx.outcome").as_deref(), Some("ok"));
    tree.only_child(command, "call orders handle-command", None);
    let mut outbox = tree.only_child(command, "outbox insert", None);
    for (event, plugin) in HANDLED {
        assert_eq!(outbox.kind, SpanKind::Producer as i32);
        assert_published(&tree, outbox);
        let process = tree.only_child(outbox, &format!("process {event}"), Some(plugin));
        assert_eq!(process.kind, SpanKind::Consumer as i32);
        assert!(
            process.start_time_unix_nano >= outbox.start_time_unix_nano,
            "{event} was handled before it was written"
        );
        tree.only_child(process, &format!("call {plugin} handle-event"), None);
        outbox = tree.only_child(process, "outbox insert", None);
    }
    let last = assert_published(&tree, outbox);
    assert_eq!(last.name, "publish notification.events");
    for span in tree.spans.values() {
        assert!(span.end_time_unix_nano >= span.start_time_unix_nano, "{}", span.name);
        let failed = span.status.as_ref().is_some_and(|s| s.code == 2);
        assert!(!failed, "{} failed: {:?}", span.name, span.status);
    }
}

/// The relay's publish of the rows `outbox` wrote: acknowledged, at a partition and offset.
fn assert_published<'a>(tree: &Tree<'a>, outbox: &Span) -> &'a Span {
    let published: Vec<&Span> = tree
        .children(outbox)
        .into_iter()
        .filter(|s| s.name.starts_with("publish "))
        .collect();
    assert_eq!(
        published.len(),
        1,
        "the rows of {:?} were published {} times",
        outbox.name,
        published.len()
    );
    let publish = published[0];
    assert_eq!(publish.kind, SpanKind::Producer as i32);
    assert!(attribute(publish, "messaging.kafka.offset").is_some(), "{publish:?}");
    assert!(
        attribute(publish, "messaging.destination.partition.id").is_some(),
        "{publish:?}"
    );
    publish
}

/// A timer's firing is a trace of its own: the `timer` span, with the guest call under it,
/// as an event's handling has its `call ... handle-event`, and a link to the span of the
/// command that scheduled it.
#[test]
fn a_fired_timer_is_a_trace_of_its_own_linked_to_the_command_that_scheduled_it() {
    let (rt, received, served) = serve_exporting(&["testbed"], &[]);
    let Served {
        mut child,
        log,
        base,
        _plugins,
    } = served;
    let client = reqwest::Client::new();
    rt.block_on(async {
        wait_ready(&client, &base, Duration::from_secs(180)).await;
        let scheduled = client
            .post(format!("{base}/v1/commands/testbed/schedule"))
            .json(&serde_json::json!({ "id": "t", "name": "ring", "key": "k-1", "delay_ms": 0 }))
            .header("traceparent", format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01"))
            .send()
            .await
            .unwrap();
        assert_eq!(scheduled.status(), 200);
        wait_for_span(&received, |s| s.name == "call testbed handle-timer").await;
        wait_for_span(&received, |s| s.name == "command testbed.schedule").await;
    });
    stop_cleanly(&mut child, log);

    let received = received.lock().unwrap();
    let timer = received
        .iter()
        .map(|(_, s)| s)
        .find(|s| s.name == "timer ring")
        .unwrap_or_else(|| {
            panic!(
                "no timer span: {:?}",
                received.iter().map(|(_, s)| &s.name).collect::<Vec<_>>()
            )
        });
    let tree = Tree {
        spans: received
            .iter()
            .filter(|(_, s)| s.trace_id == timer.trace_id)
            .map(|(_, s)| (&s.span_id[..], s))
            .collect(),
    };
    assert_eq!(attribute(timer, "obx.plugin").as_deref(), Some("testbed"));
    let caller_trace = hex::decode(CALLER_TRACE).unwrap();
    assert_ne!(timer.trace_id, caller_trace, "the firing is a trace of its own");
    let command = received
        .iter()
        .map(|(_, s)| s)
        .find(|s| s.trace_id == caller_trace && s.name == "command testbed.schedule")
        .expect("the scheduling command's span");
    let links: Vec<(&[u8], &[u8])> = timer.links.iter().map(|l| (&l.trace_id[..], &l.span_id[..])).collect();
    assert_eq!(
        links,
        [(&command.trace_id[..], &command.span_id[..])],
        "the timer links to the command that scheduled it"
    );
    let call = tree.only_child(timer, "call testbed handle-timer", None);
    assert_eq!(
        attribute(call, "obx.plugin.version").as_deref().map(str::is_empty),
        Some(false)
    );
    for span in tree.spans.values() {
        let failed = span.status.as_ref().is_some_and(|s| s.code == 2);
        assert!(!failed, "{} failed: {:?}", span.name, span.status);
    }
}
