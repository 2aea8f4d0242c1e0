//! Sample payloads for the conformance check, built from a schema.

use serde_json::Value;

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
    // Only a schema a plugin could declare: `analyse` first bounds what checking costs.
    super::cost::analyse(schema).ok()?;
    let valid = super::validator(schema).ok()?.is_valid(&candidate);
    valid.then_some(candidate)
}
