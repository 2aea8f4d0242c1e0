//! What checking a payload against a plugin's schema can cost, bounded before the check runs.
//!
//! A JSON Schema validator does as much work as its schema asks for: twenty levels of
//! `anyOf` that each name the next level twice make a million subschemas out of a 2 KiB
//! schema, and `jsonschema` inlines them when it compiles and walks each one when it checks.
//! The check runs on a host thread, outside the guest's deadline, so a plugin's schema must
//! not be able to make it long. Two bounds hold it:
//!
//! - **At load**, [`analyse`] expands the schema as the validator would (following `$ref`)
//!   and refuses one that expands past [`MAX_SUBSCHEMAS`], nests past [`MAX_NESTING`], refers
//!   to itself, or uses what this analysis cannot follow (non-local or dynamic references,
//!   embedded resources). What is left is a finite tree, and its weight at each depth of the
//!   payload is known.
//! - **At each check**, [`Cost::of`] multiplies that weight by the payload's nodes at each
//!   depth: an upper bound on the subschema applications the check can make. A payload
//!   over [`MAX_CHECK_COST`] is refused before the validator sees it.

use serde_json::Value;

/// Subschemas a schema may expand to, references followed (weighted: an `enum` of n values
/// weighs n more).
pub const MAX_SUBSCHEMAS: u64 = 20_000;
/// Schemas nested in one another on one path, references followed.
pub const MAX_NESTING: usize = 64;
/// The most subschema applications one check may make: about a tenth of a second.
pub const MAX_CHECK_COST: u64 = 4_000_000;
/// The deepest payload `serde_json` parses; deeper schema levels never apply.
const MAX_PAYLOAD_DEPTH: usize = 128;

/// The weight of a schema's subschemas at each depth of the payload they apply to.
#[derive(Debug, Default)]
pub struct Cost {
    by_depth: Vec<u64>,
}

impl Cost {
    /// An upper bound on the work of checking `payload`, in subschema applications.
    pub fn of(&self, payload: &Value) -> u64 {
        let mut total = 0u64;
        let mut pending = vec![(payload, 0usize)];
        while let Some((value, depth)) = pending.pop() {
            let Some(&weight) = self.by_depth.get(depth) else {
                continue; // no subschema reaches this deep
            };
            total = total.saturating_add(weight.saturating_mul(node_units(value)));
            match value {
                Value::Array(items) => pending.extend(items.iter().map(|v| (v, depth + 1))),
                Value::Object(fields) => {
                    // Names are checked too (`propertyNames`, `patternProperties`).
                    if let Some(&below) = self.by_depth.get(depth + 1) {
                        let names: u64 = fields.keys().map(|k| 1 + k.len() as u64 / 64).sum();
                        total = total.saturating_add(below.saturating_mul(names));
                    }
                    pending.extend(fields.values().map(|v| (v, depth + 1)));
                }
                _ => {}
            }
        }
        total
    }
}

/// One node's share: a long string costs more to match (`pattern`, `format`).
fn node_units(value: &Value) -> u64 {
    match value {
        Value::String(s) => 1 + s.len() as u64 / 64,
        _ => 1,
    }
}

/// Expands `schema` and weighs it, or says why it may not be used.
pub fn analyse(schema: &Value) -> Result<Cost, String> {
    if let Some(draft) = schema.get("$schema").and_then(Value::as_str) {
        if draft.contains("draft-03") || draft.contains("draft-04") {
            return Err(format!(
                "{draft} is not supported: use 2020-12 (the default), 2019-09, draft-07 or draft-06"
            ));
        }
    }
    let mut anchors = std::collections::HashMap::new();
    collect_anchors(schema, &mut anchors);
    let mut walk = Walk {
        root: schema,
        anchors,
        cost: Cost::default(),
        total: 0,
        path: Vec::new(),
    };
    walk.schema(schema, 0)?;
    Ok(walk.cost)
}

struct Walk<'a> {
    root: &'a Value,
    anchors: std::collections::HashMap<&'a str, &'a Value>,
    cost: Cost,
    total: u64,
    /// The schemas on the way from the root to the current one, to find a cycle.
    path: Vec<*const Value>,
}

impl<'a> Walk<'a> {
    fn schema(&mut self, schema: &'a Value, depth: usize) -> Result<(), String> {
        let at = schema as *const Value;
        if self.path.contains(&at) {
            return Err("it refers to itself (a recursive $ref), which payload schemas may not".into());
        }
        if self.path.len() >= MAX_NESTING {
            return Err(format!(
                "it nests more than {MAX_NESTING} schemas deep, references followed"
            ));
        }
        let weight = weight(schema);
        self.total += weight;
        if self.total > MAX_SUBSCHEMAS {
            return Err(format!(
                "it expands to more than {MAX_SUBSCHEMAS} subschemas, references followed"
            ));
        }
        if depth < MAX_PAYLOAD_DEPTH {
            if self.cost.by_depth.len() <= depth {
                self.cost.by_depth.resize(depth + 1, 0);
            }
            self.cost.by_depth[depth] += weight;
        }
        let Value::Object(keywords) = schema else {
            return Ok(()); // `true` or `false`
        };
        self.path.push(at);
        let walked = self.keywords(keywords, depth);
        self.path.pop();
        walked
    }

    fn keywords(&mut self, keywords: &'a serde_json::Map<String, Value>, depth: usize) -> Result<(), String> {
        for (keyword, value) in keywords {
            match keyword.as_str() {
                "$ref" => {
                    let target = self.resolve(value)?;
                    self.schema(target, depth)?;
                }
                "$id" if self.path.len() > 1 => {
                    return Err("a subschema has its own $id, which payload schemas may not".into());
                }
                "$dynamicRef" | "$recursiveRef" | "$dynamicAnchor" | "$recursiveAnchor" => {
                    return Err(format!("{keyword} is not supported in payload schemas"));
                }
                // Applied to the same value.
                "not" | "if" | "then" | "else" => self.schema(value, depth)?,
                "allOf" | "anyOf" | "oneOf" => self.each(value, depth)?,
                "dependentSchemas" | "dependencies" => self.each_named(value, depth)?,
                // Applied to what the value holds.
                "additionalProperties"
                | "unevaluatedProperties"
                | "propertyNames"
                | "contains"
                | "additionalItems"
                | "unevaluatedItems"
                | "contentSchema" => self.schema(value, depth + 1)?,
                "items" | "prefixItems" => match value {
                    Value::Array(_) => self.each(value, depth + 1)?,
                    _ => self.schema(value, depth + 1)?,
                },
                "properties" | "patternProperties" => self.each_named(value, depth + 1)?,
                _ => {} // annotations, assertions, and `$defs` (reached through `$ref`)
            }
        }
        Ok(())
    }

    fn each(&mut self, schemas: &'a Value, depth: usize) -> Result<(), String> {
        for schema in schemas.as_array().into_iter().flatten() {
            self.schema(schema, depth)?;
        }
        Ok(())
    }

    /// The schemas of a map of them (`properties`); `dependencies` may also map to names.
    fn each_named(&mut self, schemas: &'a Value, depth: usize) -> Result<(), String> {
        for schema in schemas.as_object().into_iter().flat_map(|m| m.values()) {
            if schema.is_object() || schema.is_boolean() {
                self.schema(schema, depth)?;
            }
        }
        Ok(())
    }

    /// The schema a `$ref` names within this document: `#`, `#/json/pointer` or `#anchor`.
    fn resolve(&self, reference: &Value) -> Result<&'a Value, String> {
        let reference = reference.as_str().ok_or("a $ref is not a string")?;
        let unknown = || format!("$ref {reference:?} names no schema of this document");
        let Some(fragment) = reference.strip_prefix('#') else {
            return Err(format!(
                "$ref {reference:?} is not local: payload schemas may only refer within themselves (#...)"
            ));
        };
        let fragment = percent_decode(fragment).ok_or_else(unknown)?;
        if fragment.is_empty() || fragment.starts_with('/') {
            return self.root.pointer(&fragment).ok_or_else(unknown);
        }
        self.anchors.get(fragment.as_str()).copied().ok_or_else(unknown)
    }
}

/// What a schema weighs on its own: one, plus what comparing against its `const` and `enum`
/// values, and matching its `pattern`, can cost.
fn weight(schema: &Value) -> u64 {
    let Value::Object(keywords) = schema else {
        return 1;
    };
    let mut weight = 1;
    if let Some(value) = keywords.get("const") {
        weight += nodes(value);
    }
    if let Some(Value::Array(values)) = keywords.get("enum") {
        weight += values.iter().map(nodes).sum::<u64>();
    }
    if let Some(Value::String(pattern)) = keywords.get("pattern") {
        weight += pattern.len() as u64 / 16;
    }
    if let Some(Value::Object(patterns)) = keywords.get("patternProperties") {
        weight += patterns.keys().map(|p| 1 + p.len() as u64 / 16).sum::<u64>();
    }
    weight
}

fn nodes(value: &Value) -> u64 {
    match value {
        Value::Array(items) => 1 + items.iter().map(nodes).sum::<u64>(),
        Value::Object(fields) => 1 + fields.values().map(nodes).sum::<u64>(),
        _ => 1,
    }
}

/// Every `"$anchor": name` of the document, the first of each name.
fn collect_anchors<'a>(value: &'a Value, anchors: &mut std::collections::HashMap<&'a str, &'a Value>) {
    match value {
        Value::Object(fields) => {
            if let Some(name) = fields.get("$anchor").and_then(Value::as_str) {
                anchors.entry(name).or_insert(value);
            }
            fields.values().for_each(|v| collect_anchors(v, anchors));
        }
        Value::Array(items) => items.iter().for_each(|v| collect_anchors(v, anchors)),
        _ => {}
    }
}

/// A URI fragment's `%XX` escapes decoded; `None` when it is not valid UTF-8 after them.
fn percent_decode(fragment: &str) -> Option<String> {
    let bytes = fragment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = fragment.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}
