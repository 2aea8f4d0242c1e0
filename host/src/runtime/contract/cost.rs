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
//! - **At each check**, [`Cost::of`] multiplies that weight by the payload's values at each
//!   depth, and the per-byte cost of `pattern` and `format` by the bytes of the strings
//!   there: an upper bound on the work of the check. A payload over [`MAX_CHECK_COST`] is
//!   refused before the validator sees it.

use serde_json::Value;

/// Subschemas a schema may expand to, references followed (weighted: an `enum` of n values
/// weighs n more).
pub const MAX_SUBSCHEMAS: u64 = 20_000;
/// Schemas nested in one another on one path, references followed.
pub const MAX_NESTING: usize = 64;
/// The most one check may cost, in units of about one subschema applied to one value (2 to
/// 200 ns on this machine; see `runtime::contract::tests`): at worst a few tenths of a second.
pub const MAX_CHECK_COST: u64 = 4_000_000;
/// What matching one `pattern` costs per byte of string, in those units: a pattern within
/// the regex program bound (`MAX_PATTERN_PROGRAM_BYTES`) that defeats the lazy DFA took up
/// to 1.1 µs a byte here, 24 of the cheapest units.
const PATTERN_BYTE_COST: u64 = 24;
/// What checking one `format` (or decoding a `contentEncoding`) costs per byte.
const FORMAT_BYTE_COST: u64 = 1;
/// The deepest payload `serde_json` parses; deeper schema levels never apply.
const MAX_PAYLOAD_DEPTH: usize = 128;

/// The weight of a schema's subschemas at each depth of the payload they apply to.
#[derive(Debug, Default)]
pub struct Cost {
    by_depth: Vec<Level>,
}

/// What the subschemas that apply at one depth cost: per value, and per byte of a string
/// (or of a property name, one level down).
#[derive(Debug, Default, Clone, Copy)]
struct Level {
    per_value: u64,
    per_byte: u64,
}

impl Level {
    fn of_string(&self, s: &str) -> u64 {
        let bytes = s.len() as u64;
        self.per_value
            .saturating_mul(1 + bytes / 64)
            .saturating_add(self.per_byte.saturating_mul(bytes))
    }
}

impl Cost {
    /// An upper bound on the work of checking `payload`, in units of about one subschema
    /// applied to one value.
    pub fn of(&self, payload: &Value) -> u64 {
        let mut total = 0u64;
        let mut pending = vec![(payload, 0usize)];
        while let Some((value, depth)) = pending.pop() {
            let Some(level) = self.by_depth.get(depth) else {
                continue; // no subschema reaches this deep
            };
            let cost = match value {
                Value::String(s) => level.of_string(s),
                Value::Array(items) => {
                    pending.extend(items.iter().map(|v| (v, depth + 1)));
                    level.per_value
                }
                Value::Object(fields) => {
                    // Names are checked one level down (`propertyNames`, `patternProperties`).
                    if let Some(below) = self.by_depth.get(depth + 1) {
                        let names = fields.keys().map(|k| below.of_string(k));
                        total = total.saturating_add(names.fold(0, u64::saturating_add));
                    }
                    pending.extend(fields.values().map(|v| (v, depth + 1)));
                    level.per_value
                }
                _ => level.per_value,
            };
            total = total.saturating_add(cost);
        }
        total
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
        beyond: Level::default(),
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
    /// Where levels deeper than any payload add up, unused.
    beyond: Level,
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
        self.level(depth).per_value += weight;
        self.level(depth).per_byte += scans(schema);
        if let Some(Value::Object(patterns)) = schema.get("patternProperties") {
            // Matched against each property name, one level down.
            self.level(depth + 1).per_byte += PATTERN_BYTE_COST * patterns.len() as u64;
        }
        let Value::Object(keywords) = schema else {
            return Ok(()); // `true` or `false`
        };
        self.path.push(at);
        let walked = self.keywords(keywords, depth);
        self.path.pop();
        walked
    }

    /// The level at `depth`; one that no payload reaches when deeper than a payload can be.
    fn level(&mut self, depth: usize) -> &mut Level {
        if depth >= MAX_PAYLOAD_DEPTH {
            return &mut self.beyond;
        }
        if self.cost.by_depth.len() <= depth {
            self.cost.by_depth.resize(depth + 1, Level::default());
        }
        &mut self.cost.by_depth[depth]
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
                "$dynamicRef" | "$recursiveRef" | "$dynamicAnchor" | "$recursiveAnchor" | "contentSchema" => {
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
                | "unevaluatedItems" => self.schema(value, depth + 1)?,
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

/// What a schema weighs on its own, per value: one, plus what comparing against its `const`
/// and `enum` values, and going through its lists of names (`required`, `properties`, ...),
/// can cost.
fn weight(schema: &Value) -> u64 {
    let Value::Object(keywords) = schema else {
        return 1;
    };
    let mut weight = 1;
    for (keyword, value) in keywords {
        weight += match (keyword.as_str(), value) {
            ("const", value) => nodes(value),
            ("enum", Value::Array(values)) => values.iter().map(nodes).sum::<u64>(),
            ("required", Value::Array(names)) => names.len() as u64,
            (
                "properties" | "patternProperties" | "dependentRequired" | "dependentSchemas" | "dependencies",
                Value::Object(entries),
            ) => entries
                .values()
                .map(|v| if v.is_array() { nodes(v) } else { 1 })
                .sum::<u64>(),
            _ => 0,
        };
    }
    weight
}

/// What a schema costs per byte of a string it checks: its `pattern`, `format` and
/// `contentEncoding`.
fn scans(schema: &Value) -> u64 {
    let has = |keyword| schema.get(keyword).is_some();
    let mut per_byte = 0;
    if has("pattern") {
        per_byte += PATTERN_BYTE_COST;
    }
    if has("format") {
        per_byte += FORMAT_BYTE_COST;
    }
    if has("contentEncoding") || has("contentMediaType") {
        per_byte += FORMAT_BYTE_COST;
    }
    per_byte
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
