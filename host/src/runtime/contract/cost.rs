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
//!   to itself, or uses what this analysis does not bound. References may only name a
//!   definition of the root (`#/$defs/NAME`, `#/definitions/NAME`), so that the analysis and
//!   the validator cannot resolve one differently; keywords whose work does not follow the
//!   payload's shape (`unevaluated*`, dynamic references, `contentSchema`, `format: regex`)
//!   are refused. What is left is a finite tree, and its weight at each depth of the
//!   payload is known.
//! - **At each check**, [`Cost::of`] multiplies that weight by the payload's values at each
//!   depth, the per-byte cost of `pattern` and `format` by the bytes of the strings there,
//!   and `uniqueItems` by the square of an array's length: an upper bound on the work of
//!   the check. A payload over [`MAX_CHECK_COST`] is refused before the validator sees it.

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
/// What one `multipleOf` may cost per value: a fraction of extreme floats is worked out
/// exactly, with big integers.
const MULTIPLE_OF_COST: u64 = 500;
/// Distinct `pattern`s (and `patternProperties` names) one plugin's schemas may hold: each
/// is compiled at load, and each keeps a matching cache per thread.
pub const MAX_PATTERNS: usize = 64;
/// The deepest payload `serde_json` parses; deeper schema levels never apply.
const MAX_PAYLOAD_DEPTH: usize = 128;

/// The weight of a schema's subschemas at each depth of the payload they apply to.
#[derive(Debug, Default)]
pub struct Cost {
    by_depth: Vec<Level>,
    /// How many times describing a failure may evaluate a subschema: reporting an error
    /// evaluates each `anyOf`/`oneOf` branch again, once per level of them above it.
    pub describe_factor: u64,
    /// The distinct patterns the schema holds.
    pub patterns: Vec<String>,
}

/// What the subschemas that apply at one depth cost: per value, and per byte of a string
/// (or of a property name, one level down).
#[derive(Debug, Default, Clone, Copy)]
struct Level {
    per_value: u64,
    per_byte: u64,
    /// `uniqueItems` subschemas: each compares an array's items with one another.
    unique: u64,
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
                    // Items whose hashes collide are compared with one another, each
                    // comparison as long as the items.
                    let unique = if level.unique > 0 {
                        let n = items.len() as u64;
                        level.unique.saturating_mul(n.saturating_mul(nodes(value)))
                    } else {
                        0
                    };
                    level.per_value.saturating_add(unique)
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
    // A nested `$id` starts a resource of its own, whose references resolve against it;
    // wherever it is (even where no reference reaches), it could change what one names.
    // So does a nested `$schema` (another draft, whose identifier may be `id`).
    if let Value::Object(root) = schema {
        for (key, value) in root {
            if key != "$id" && holds(value, "$id") {
                return Err("a subschema has its own $id, which payload schemas may not".into());
            }
            if key != "$schema" && holds(value, "$schema") {
                return Err("a subschema has its own $schema, which payload schemas may not".into());
            }
        }
    }
    let mut walk = Walk {
        root: schema,
        cost: Cost::default(),
        total: 0,
        path: Vec::new(),
        beyond: Level::default(),
        patterns: std::collections::BTreeSet::new(),
        alternatives: 0,
    };
    walk.schema(schema, 0)?;
    // Definitions no reference reaches are still compiled: they are held to the same rules.
    for defs in ["$defs", "definitions"] {
        for def in schema
            .get(defs)
            .and_then(Value::as_object)
            .into_iter()
            .flat_map(|d| d.values())
        {
            walk.schema(def, MAX_PAYLOAD_DEPTH)?;
        }
    }
    walk.cost.patterns = walk.patterns.into_iter().map(str::to_string).collect();
    walk.cost.describe_factor += 2;
    Ok(walk.cost)
}

struct Walk<'a> {
    root: &'a Value,
    cost: Cost,
    total: u64,
    /// The schemas on the way from the root to the current one, to find a cycle.
    path: Vec<*const Value>,
    /// Where levels deeper than any payload add up, unused.
    beyond: Level,
    patterns: std::collections::BTreeSet<&'a str>,
    /// `anyOf`/`oneOf` keywords above the current schema.
    alternatives: u64,
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
        if schema.get("uniqueItems") == Some(&Value::Bool(true)) {
            self.level(depth).unique += 1;
        }
        if let Some(Value::String(pattern)) = schema.get("pattern") {
            self.patterns.insert(pattern);
        }
        if let Some(Value::Object(patterns)) = schema.get("patternProperties") {
            // Matched against each property name one level down, and again by
            // `additionalProperties`.
            self.level(depth + 1).per_byte += 2 * PATTERN_BYTE_COST * patterns.len() as u64;
            self.patterns.extend(patterns.keys().map(String::as_str));
        }
        if self.patterns.len() > MAX_PATTERNS {
            return Err(format!("it holds more than {MAX_PATTERNS} distinct patterns"));
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
                "$dynamicRef"
                | "$recursiveRef"
                | "$dynamicAnchor"
                | "$recursiveAnchor"
                | "contentSchema"
                | "unevaluatedProperties"
                | "unevaluatedItems" => {
                    return Err(format!("{keyword} is not supported in payload schemas"));
                }
                "format" if value == "regex" => {
                    return Err("format \"regex\" is not supported in payload schemas".into());
                }
                // Applied to the same value.
                "not" | "if" | "then" | "else" => self.schema(value, depth)?,
                "allOf" => self.each(value, depth)?,
                "anyOf" | "oneOf" => {
                    self.alternatives += 1;
                    self.cost.describe_factor = self.cost.describe_factor.max(self.alternatives);
                    let walked = self.each(value, depth);
                    self.alternatives -= 1;
                    walked?
                }
                "dependentSchemas" | "dependencies" => self.each_named(value, depth)?,
                // Applied to what the value holds.
                "additionalProperties" | "propertyNames" | "contains" | "additionalItems" => {
                    self.schema(value, depth + 1)?
                }
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

    /// The schema a `$ref` names: a definition of the root, `#/$defs/NAME` or
    /// `#/definitions/NAME` (its name escaped as a JSON pointer and a URI fragment).
    fn resolve(&self, reference: &Value) -> Result<&'a Value, String> {
        let reference = reference.as_str().ok_or("a $ref is not a string")?;
        let refused = || {
            format!(
                "$ref {reference:?} is not supported: a payload schema may only refer to a \
                 definition of its own root, as \"#/$defs/NAME\" or \"#/definitions/NAME\""
            )
        };
        let (defs, name) = [("$defs", "#/$defs/"), ("definitions", "#/definitions/")]
            .into_iter()
            .find_map(|(defs, prefix)| Some((defs, reference.strip_prefix(prefix)?)))
            .ok_or_else(refused)?;
        // No percent escapes: the validator decodes them before it splits the pointer, so
        // `x%2Fy` would name `$defs.x.y` there and `$defs["x/y"]` here.
        if name.contains('/') || name.contains('%') {
            return Err(refused());
        }
        let name = name.replace("~1", "/").replace("~0", "~");
        self.root
            .get(defs)
            .and_then(|d| d.get(&name))
            .ok_or_else(|| format!("$ref {reference:?} names no definition of this schema"))
    }
}

/// What a schema weighs on its own, per value: one, plus what comparing against its `const`
/// and `enum` values, and going through its lists of names (`required`, `properties`, ...),
/// can cost.
fn weight(schema: &Value) -> u64 {
    let Value::Object(keywords) = schema else {
        return 1;
    };
    // Every keyword is looked at, even one the validator does not know.
    let mut weight = 1 + keywords.len() as u64;
    for (keyword, value) in keywords {
        weight += match (keyword.as_str(), value) {
            ("const", value) => nodes(value),
            ("enum", Value::Array(values)) => values.iter().map(nodes).sum::<u64>(),
            ("required", Value::Array(names)) => names.len() as u64,
            ("multipleOf", _) => MULTIPLE_OF_COST,
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

/// Whether `value` holds an object with a `key` key, at any depth.
fn holds(value: &Value, key: &str) -> bool {
    match value {
        Value::Object(fields) => fields.contains_key(key) || fields.values().any(|v| holds(v, key)),
        Value::Array(items) => items.iter().any(|v| holds(v, key)),
        _ => false,
    }
}
