//! A plugin's payload contract: the compiled JSON Schemas of the payloads it declared
//! (`obx:plugin/contract`). `emit` checks what the plugin sends against them, the event path
//! checks what it receives, and the conformance check builds sample events from them.
//!
//! Schemas come from plugins, so compiling and checking must be safe with hostile ones:
//! no remote or file `$ref` is fetched (the resolvers are not built in), and `pattern` uses
//! the `regex` engine, whose matching time is linear, never a backtracking one.

use std::collections::HashMap;

use serde_json::Value;

use super::manifest::PayloadContract;

#[derive(Default)]
pub struct Contracts {
    by_event: HashMap<(String, String), jsonschema::Validator>,
}

impl std::fmt::Debug for Contracts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.by_event.keys()).finish()
    }
}

impl Contracts {
    /// Compiles every declared schema and checks each example against its own schema.
    pub fn compile(payloads: &[PayloadContract]) -> Result<Contracts, String> {
        let mut by_event = HashMap::new();
        for p in payloads {
            let what = format!("the payload schema of {} on {:?}", p.event_type, p.topic);
            // The draft is the schema's `$schema`, 2020-12 when it names none.
            let validator = jsonschema::options()
                .should_validate_formats(true)
                .with_pattern_options(jsonschema::PatternOptions::regex())
                .build(&p.schema)
                .map_err(|e| format!("contract: {what} is not a valid JSON Schema: {e}"))?;
            if let Some(example) = &p.example {
                validator.validate(example).map_err(|e| {
                    format!(
                        "contract: the example of {} breaks its schema: {}",
                        p.event_type,
                        describe(&e)
                    )
                })?;
            }
            by_event.insert((p.topic.clone(), p.event_type.clone()), validator);
        }
        Ok(Contracts { by_event })
    }

    pub fn is_empty(&self) -> bool {
        self.by_event.is_empty()
    }

    /// Checks `payload` (JSON text) against the schema of `event_type` on `topic`, if one
    /// was declared: `Err` names the first field that breaks it.
    pub fn check(&self, topic: &str, event_type: &str, payload: &str) -> Result<(), String> {
        let Some(validator) = self.by_event.get(&(topic.to_string(), event_type.to_string())) else {
            return Ok(());
        };
        let value: Value = serde_json::from_str(payload).map_err(|e| format!("the payload is not JSON: {e}"))?;
        validator.validate(&value).map_err(|e| describe(&e))
    }
}

/// A validation error as `at /items/0/quantity: "three" is not of type "integer"`.
fn describe(e: &jsonschema::ValidationError<'_>) -> String {
    let path = e.instance_path().to_string();
    let at = if path.is_empty() { "/".to_string() } else { path };
    format!("at {at}: {e}")
}

/// A payload that `schema` accepts, for the conformance check when a plugin declared a
/// schema but no example: each required property with a value of its type (its `const`,
/// its first `enum` value, or its `default` when it has one). `None` when the schema asks
/// for more than that (the check then says so and skips the event).
pub fn sample(schema: &Value) -> Option<Value> {
    fn build(schema: &Value, depth: usize) -> Option<Value> {
        if depth > 16 {
            return None;
        }
        if let Some(v) = schema.get("const").or_else(|| schema.get("default")) {
            return Some(v.clone());
        }
        if let Some(first) = schema.get("enum").and_then(Value::as_array).and_then(|e| e.first()) {
            return Some(first.clone());
        }
        let kind = match schema.get("type") {
            Some(Value::String(t)) => t.as_str(),
            Some(Value::Array(types)) => types.iter().find_map(Value::as_str).unwrap_or("null"),
            _ if schema.get("properties").is_some() => "object",
            _ => return Some(Value::Object(Default::default())),
        };
        Some(match kind {
            "object" => {
                let mut object = serde_json::Map::new();
                let required = schema
                    .get("required")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default();
                for name in required.iter().filter_map(Value::as_str) {
                    let property = schema
                        .pointer(&format!("/properties/{}", escape(name)))
                        .unwrap_or(&Value::Null);
                    object.insert(name.to_string(), build(property, depth + 1)?);
                }
                Value::Object(object)
            }
            "array" => Value::Array(vec![]),
            "string" => Value::String(match schema.get("format").and_then(Value::as_str) {
                Some("uuid") => "00000000-0000-4000-8000-000000000000".into(),
                Some("date-time") => "2026-01-01T00:00:00Z".into(),
                Some("date") => "2026-01-01".into(),
                _ => "sample".into(),
            }),
            "integer" | "number" => Value::from(schema.get("minimum").and_then(Value::as_i64).unwrap_or(1).max(1)),
            "boolean" => Value::Bool(true),
            _ => Value::Null,
        })
    }
    fn escape(name: &str) -> String {
        name.replace('~', "~0").replace('/', "~1")
    }
    let candidate = build(schema, 0)?;
    let valid = jsonschema::options()
        .with_pattern_options(jsonschema::PatternOptions::regex())
        .build(schema)
        .ok()?
        .is_valid(&candidate);
    valid.then_some(candidate)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn contract(schema: Value, example: Option<Value>) -> PayloadContract {
        PayloadContract {
            topic: "order.events".into(),
            event_type: "OrderCreated".into(),
            schema,
            example,
        }
    }

    fn order_schema() -> Value {
        json!({
            "type": "object",
            "required": ["orderId", "items"],
            "properties": {
                "orderId": { "type": "string", "format": "uuid" },
                "items": { "type": "array", "items": {
                    "type": "object", "required": ["quantity"],
                    "properties": { "quantity": { "type": "integer", "minimum": 1 } }
                } }
            }
        })
    }

    #[test]
    fn a_payload_that_breaks_the_schema_is_refused_with_its_field_named() {
        let contracts = Contracts::compile(&[contract(order_schema(), None)]).unwrap();
        let ok = r#"{"orderId": "7f1c1f8e-6c1e-4b8e-9d4a-3f0e2b8f0a11", "items": [{"quantity": 2}]}"#;
        assert_eq!(contracts.check("order.events", "OrderCreated", ok), Ok(()));
        let bad = r#"{"orderId": "7f1c1f8e-6c1e-4b8e-9d4a-3f0e2b8f0a11", "items": [{"quantity": "two"}]}"#;
        let e = contracts.check("order.events", "OrderCreated", bad).unwrap_err();
        assert!(e.contains("/items/0/quantity"), "{e}");
        let e = contracts
            .check("order.events", "OrderCreated", r#"{"orderId": "x", "items": []}"#)
            .unwrap_err();
        assert!(e.contains("/orderId"), "{e}");
        // Undeclared events are not checked.
        assert_eq!(contracts.check("order.events", "OrderShipped", "{}"), Ok(()));
    }

    #[test]
    fn bad_schemas_and_examples_are_refused_and_remote_refs_are_not_fetched() {
        let e = Contracts::compile(&[contract(json!({"type": "nonsense"}), None)]).unwrap_err();
        assert!(e.contains("not a valid JSON Schema"), "{e}");
        let e = Contracts::compile(&[contract(order_schema(), Some(json!({"orderId": 1})))]).unwrap_err();
        assert!(e.contains("example"), "{e}");
        let remote = json!({ "$ref": "http://169.254.169.254/latest/meta-data" });
        assert!(Contracts::compile(&[contract(remote, None)]).is_err());
        let file = json!({ "$ref": "file:///etc/passwd" });
        assert!(Contracts::compile(&[contract(file, None)]).is_err());
    }

    #[test]
    fn a_catastrophic_pattern_is_matched_in_linear_time() {
        let schema = json!({ "type": "string", "pattern": "^(a+)+$" });
        let contracts = Contracts::compile(&[contract(schema, None)]).unwrap();
        let payload = format!("\"{}!\"", "a".repeat(100_000));
        let started = std::time::Instant::now();
        assert!(contracts.check("order.events", "OrderCreated", &payload).is_err());
        assert!(
            started.elapsed() < std::time::Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn samples_follow_the_schema() {
        let sample = sample(&order_schema()).unwrap();
        assert_eq!(sample["orderId"], "00000000-0000-4000-8000-000000000000");
        assert_eq!(sample["items"], json!([]));
        assert!(super::sample(&json!({"type": "string", "pattern": "^x{3}$"})).is_none());
    }
}
