//! A plugin's payload contract: the compiled JSON Schemas of the payloads it declared
//! (`obx:plugin/contract`). `emit` checks what the plugin sends against them, the event path
//! checks what it receives, and the conformance check builds sample events from them.
//!
//! Schemas come from plugins, so compiling and checking must be safe with hostile ones:
//! no remote or file `$ref` is fetched (the resolvers are not built in and only local
//! references are allowed), `pattern` uses the `regex` engine, whose matching time is
//! linear, never a backtracking one, with a bounded program size, and what a check may
//! cost is bounded before it runs ([`cost`]).

mod cost;
mod sample;

use std::collections::HashMap;

use serde_json::Value;

use super::manifest::PayloadContract;
pub use cost::{MAX_CHECK_COST, MAX_NESTING, MAX_PATTERNS, MAX_SUBSCHEMAS};
pub use sample::sample;

/// The most a compiled `pattern` may take, in bytes of the `regex` crate's program: every
/// common pattern we tried fits (`^(\w|-){1,100}$`, a Unicode class repeated, needs 24 KiB),
/// and how slow a pattern can match grows with it.
const MAX_PATTERN_PROGRAM_BYTES: usize = 32 * 1024;
/// The `regex` crate's lazy DFA cache, per pattern and thread.
const PATTERN_DFA_BYTES: usize = 256 * 1024;

#[derive(Default)]
pub struct Contracts {
    by_event: HashMap<(String, String), Contract>,
}

struct Contract {
    validator: jsonschema::Validator,
    cost: cost::Cost,
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
        let mut patterns = std::collections::BTreeSet::new();
        // The examples of one plugin share one check's budget.
        let mut examples_budget = MAX_CHECK_COST;
        for p in payloads {
            let what = format!("the payload schema of {} on {:?}", p.event_type, p.topic);
            // Before the validator compiles it: compiling costs what the schema expands to.
            let cost = cost::analyse(&p.schema).map_err(|e| format!("contract: {what} may not be used: {e}"))?;
            patterns.extend(cost.patterns.iter().cloned());
            if patterns.len() > MAX_PATTERNS {
                return Err(format!(
                    "contract: the payload schemas of one plugin may hold at most {MAX_PATTERNS} distinct patterns"
                ));
            }
            let validator =
                validator(&p.schema).map_err(|e| format!("contract: {what} is not a valid JSON Schema: {e}"))?;
            let contract = Contract { validator, cost };
            if let Some(example) = &p.example {
                contract
                    .check(example, &mut examples_budget, false)
                    .map_err(|e| format!("contract: the example of {} {e}", p.event_type))?;
            }
            by_event.insert((p.topic.clone(), p.event_type.clone()), contract);
        }
        Ok(Contracts { by_event })
    }

    pub fn is_empty(&self) -> bool {
        self.by_event.is_empty()
    }

    /// Checks `payload` (JSON text) against the schema of `event_type` on `topic`, if one
    /// was declared, and takes what the check may cost from `budget` (in the units of
    /// [`cost`]; [`MAX_CHECK_COST`] for all the emits of one call). `Err` completes "the
    /// payload of T …": it names the first field that breaks the schema, or says the check
    /// would cost more than is left.
    pub fn check(&self, topic: &str, event_type: &str, payload: &str, budget: &mut u64) -> Result<(), String> {
        self.check_with(topic, event_type, payload, budget, false)
    }

    /// [`Contracts::check`] for an event a plugin consumes, with a budget of its own. A check
    /// that may be long runs off the async runtime's worker (`block_in_place`), so that a
    /// batch of costly events does not hold up the host's other tasks.
    pub fn check_consumed(&self, topic: &str, event_type: &str, payload: &str) -> Result<(), String> {
        self.check_with(topic, event_type, payload, &mut MAX_CHECK_COST.clone(), true)
    }

    fn check_with(
        &self,
        topic: &str,
        event_type: &str,
        payload: &str,
        budget: &mut u64,
        offload: bool,
    ) -> Result<(), String> {
        let Some(contract) = self.by_event.get(&(topic.to_string(), event_type.to_string())) else {
            return Ok(());
        };
        let value: Value = serde_json::from_str(payload).map_err(|e| format!("is not JSON: {e}"))?;
        contract.check(&value, budget, offload)
    }
}

/// A check that may cost more than this (in the units of [`cost`]; about 20 ms at worst)
/// is run off the async runtime's worker where the caller allows it.
const LONG_CHECK: u64 = 100_000;

impl Contract {
    fn check(&self, value: &Value, budget: &mut u64, offload: bool) -> Result<(), String> {
        let cost = self.cost.of(value);
        if cost > *budget {
            return Err(format!(
                "is too costly to check against its declared schema: it could cost {cost} units, \
                 and {budget} of the {MAX_CHECK_COST} a check may cost are left"
            ));
        }
        *budget -= cost;
        let long = offload && cost > LONG_CHECK;
        if off_worker(long, || self.validator.is_valid(value)) {
            return Ok(());
        }
        // Naming the field evaluates the subschemas again, more than once under `anyOf`.
        let describing = cost.saturating_mul(self.cost.describe_factor);
        if describing > *budget {
            return Err("breaks its declared schema (naming the field would cost more than the \
                        check may)"
                .into());
        }
        *budget -= describing;
        off_worker(long, || {
            self.validator
                .validate(value)
                .map_err(|e| format!("breaks its declared schema {}", describe(&e)))
        })
    }
}

/// Runs `work`, off the async runtime's worker (`block_in_place`) when it is `long` and the
/// runtime can spare the worker (a multi-threaded one).
fn off_worker<T>(long: bool, work: impl FnOnce() -> T) -> T {
    let multi_thread = || {
        tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
    };
    if long && multi_thread() {
        tokio::task::block_in_place(work)
    } else {
        work()
    }
}

/// The validator of a schema that [`cost::analyse`] accepted. The draft is the schema's
/// `$schema`, 2020-12 when it names none.
fn validator(schema: &Value) -> Result<jsonschema::Validator, String> {
    let patterns = jsonschema::PatternOptions::regex()
        .size_limit(MAX_PATTERN_PROGRAM_BYTES)
        .dfa_size_limit(PATTERN_DFA_BYTES);
    jsonschema::options()
        .should_validate_formats(true)
        .with_pattern_options(patterns)
        .build(schema)
        .map_err(|e| e.to_string())
}

/// A validation error as `at /items/0/quantity: "three" is not of type "integer"`.
fn describe(e: &jsonschema::ValidationError<'_>) -> String {
    let path = e.instance_path().to_string();
    let at = if path.is_empty() { "/".to_string() } else { path };
    format!("at {at}: {e}")
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

    fn check(contracts: &Contracts, event_type: &str, payload: &str) -> Result<(), String> {
        contracts.check("order.events", event_type, payload, &mut MAX_CHECK_COST.clone())
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
        assert_eq!(check(&contracts, "OrderCreated", ok), Ok(()));
        let bad = r#"{"orderId": "7f1c1f8e-6c1e-4b8e-9d4a-3f0e2b8f0a11", "items": [{"quantity": "two"}]}"#;
        let e = check(&contracts, "OrderCreated", bad).unwrap_err();
        assert!(e.contains("/items/0/quantity"), "{e}");
        let e = check(&contracts, "OrderCreated", r#"{"orderId": "x", "items": []}"#).unwrap_err();
        assert!(e.contains("/orderId"), "{e}");
        // Undeclared events are not checked.
        assert_eq!(check(&contracts, "OrderShipped", "{}"), Ok(()));
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
        assert!(check(&contracts, "OrderCreated", &payload).is_err());
        assert!(
            started.elapsed() < std::time::Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
    }

    /// `levels` of `anyOf` that each name the next level twice: 2^levels subschemas.
    fn doubling(levels: usize) -> Value {
        let mut defs = serde_json::Map::new();
        for i in 0..levels {
            let next = json!({ "$ref": format!("#/$defs/d{}", i + 1) });
            defs.insert(format!("d{i}"), json!({ "anyOf": [next, next] }));
        }
        defs.insert(format!("d{levels}"), json!({ "type": "string" }));
        json!({ "$defs": defs, "$ref": "#/$defs/d0" })
    }

    fn timed<T>(what: &str, f: impl FnOnce() -> T) -> T {
        let started = std::time::Instant::now();
        let out = f();
        let took = started.elapsed();
        assert!(took < std::time::Duration::from_secs(2), "{what} took {took:?}");
        out
    }

    #[test]
    fn a_schema_that_expands_past_the_bound_is_refused_at_load_at_once() {
        // 9 levels (512 ways through; with each definition also weighed on its own, about
        // 12,000 weighted subschemas) are allowed.
        let contracts = timed("9 levels", || Contracts::compile(&[contract(doubling(9), None)])).unwrap();
        timed("a check", || assert!(check(&contracts, "OrderCreated", "1").is_err()));
        // 20 levels are a million: checking a payload took 5.4 s (a debug build), 22 took 33 s.
        let e = timed("20 levels", || Contracts::compile(&[contract(doubling(20), None)])).unwrap_err();
        assert!(e.contains("expands to more than 20000 subschemas"), "{e}");
        // 40 would be a trillion.
        let e = timed("40 levels", || Contracts::compile(&[contract(doubling(40), None)])).unwrap_err();
        assert!(e.contains("may not be used"), "{e}");
        // An `enum` of 30,000 values weighs as much, and so does a list of 30,000 names.
        let big_enum = json!({ "enum": (0..30_000).collect::<Vec<_>>() });
        let e = Contracts::compile(&[contract(big_enum, None)]).unwrap_err();
        assert!(e.contains("expands"), "{e}");
        let names: Vec<String> = (0..30_000).map(|i| format!("{i}")).collect();
        let e = Contracts::compile(&[contract(json!({ "required": names }), None)]).unwrap_err();
        assert!(e.contains("expands"), "{e}");
    }

    #[test]
    fn references_a_bound_cannot_follow_are_refused() {
        let refused = [
            (json!({ "type": "array", "items": { "$ref": "#" } }), "is not supported"),
            (
                json!({ "$defs": { "a": { "allOf": [{ "$ref": "#/$defs/a" }] } }, "$ref": "#/$defs/a" }),
                "refers to itself",
            ),
            (json!({ "$ref": "order.json#/$defs/a" }), "is not supported"),
            (json!({ "$ref": "#/$defs/missing" }), "names no definition"),
            (json!({ "$ref": "#nowhere" }), "is not supported"),
            (
                json!({ "$ref": "#/$defs/a%+1" , "$defs": { "a": {} } }),
                "is not supported",
            ),
            // A pointer into a definition could pass through a resource with its own base.
            (
                json!({ "$defs": { "e": { "properties": { "p": {} } } }, "$ref": "#/$defs/e/properties/p" }),
                "is not supported",
            ),
            (json!({ "$dynamicRef": "#meta" }), "$dynamicRef is not supported"),
            // The validator decodes `%2F` before it splits the pointer: `$defs.x.y` there.
            (
                json!({ "$defs": { "x/y": true, "x": { "y": {} } }, "$ref": "#/$defs/x%2Fy" }),
                "is not supported",
            ),
            // Another draft below the root could take its base from `id`.
            (
                json!({ "allOf": [{ "$schema": "http://json-schema.org/draft-04/schema#", "id": "http://e.example/p" }] }),
                "its own $schema",
            ),
            (
                json!({ "$defs": { "a": { "$defs": { "b": { "$id": "json-schema:///" } } } } }),
                "its own $id",
            ),
            // Held to the rules even where no reference reaches (the validator indexes them).
            (
                json!({ "$defs": { "b": { "$dynamicAnchor": "x" } } }),
                "$dynamicAnchor is not supported",
            ),
            (
                json!({ "$defs": { "e": { "$id": "https://o.example/e", "properties": { "p": { "$ref": "#/$defs/z" } } } } }),
                "its own $id",
            ),
            (
                json!({ "contentMediaType": "application/json", "contentSchema": { "type": "array" } }),
                "contentSchema is not supported",
            ),
            // Marking what nested `unevaluated*` saw re-checks every branch at every level.
            (
                json!({ "allOf": [{ "allOf": [{}], "unevaluatedProperties": false }], "unevaluatedProperties": false }),
                "unevaluatedProperties is not supported",
            ),
            (
                json!({ "items": { "unevaluatedItems": false } }),
                "unevaluatedItems is not supported",
            ),
            // Its syntax check is quadratic in the named groups of the string.
            (json!({ "format": "regex" }), "format \"regex\" is not supported"),
            (
                json!({ "properties": { "a": { "$id": "https://x.example/a", "type": "string" } } }),
                "its own $id",
            ),
            (
                json!({ "$schema": "http://json-schema.org/draft-04/schema#" }),
                "draft-04",
            ),
        ];
        for (schema, reason) in refused {
            let e = Contracts::compile(&[contract(schema.clone(), None)]).unwrap_err();
            assert!(e.contains(reason), "{schema}: {e}");
        }
        // 70 schemas, each inside the last through a $ref: deeper than the bound.
        let mut defs = serde_json::Map::new();
        for i in 0..70 {
            defs.insert(format!("d{i}"), json!({ "$ref": format!("#/$defs/d{}", i + 1) }));
        }
        defs.insert("d70".into(), json!({ "type": "string" }));
        let deep = json!({ "$defs": defs, "$ref": "#/$defs/d0" });
        let e = Contracts::compile(&[contract(deep, None)]).unwrap_err();
        assert!(e.contains("nests more than 64"), "{e}");
        // What is allowed: references to the root's definitions, their names escaped too.
        let fine = json!({
            "$defs": { "a_b": { "type": "integer" } },
            "definitions": { "c/d": { "minimum": 1 } },
            "properties": { "n": { "$ref": "#/$defs/a_b" }, "q": { "$ref": "#/definitions/c~1d" } }
        });
        let contracts = Contracts::compile(&[contract(fine, None)]).unwrap();
        assert_eq!(check(&contracts, "OrderCreated", r#"{"n": 1, "q": 2}"#), Ok(()));
        assert!(check(&contracts, "OrderCreated", r#"{"n": "x", "q": 2}"#)
            .unwrap_err()
            .contains("/n"));
        assert!(check(&contracts, "OrderCreated", r#"{"n": 1, "q": 0}"#)
            .unwrap_err()
            .contains("/q"));
    }

    #[test]
    fn a_check_that_could_cost_too_much_is_refused_before_it_runs() {
        // Each item of the array is compared with 1,000 objects of 15 nodes.
        let choices: Vec<Value> = (0..1_000)
            .map(|i| json!({ "a": [i, i, i, i, i, i], "b": [i, i, i, i, i, i] }))
            .collect();
        let schema = json!({ "type": "array", "items": { "anyOf": choices.iter().map(|c| json!({ "const": c })).collect::<Vec<_>>() } });
        let contracts = Contracts::compile(&[contract(schema, None)]).unwrap();
        let few = serde_json::to_string(&vec![json!({ "a": 1 }); 100]).unwrap();
        assert!(timed("100 items", || check(&contracts, "OrderCreated", &few))
            .unwrap_err()
            .contains("breaks its declared schema"));
        let many = serde_json::to_string(&vec![json!({ "a": 1 }); 100_000]).unwrap();
        let e = timed("100,000 items", || check(&contracts, "OrderCreated", &many)).unwrap_err();
        assert!(
            e.starts_with("is too costly to check against its declared schema"),
            "{e}"
        );

        // A big payload against an ordinary schema is checked.
        let items = vec![json!({ "quantity": 2 }); 50_000];
        let order = json!({ "orderId": "7f1c1f8e-6c1e-4b8e-9d4a-3f0e2b8f0a11", "items": items }).to_string();
        assert!(order.len() > 700_000);
        let contracts = Contracts::compile(&[contract(order_schema(), None)]).unwrap();
        assert_eq!(
            timed("a 700 KB order", || check(&contracts, "OrderCreated", &order)),
            Ok(())
        );
        let contract = contracts.by_event.values().next().unwrap();
        let cost = contract.cost.of(&serde_json::from_str(&order).unwrap());
        assert_eq!(
            cost, 600_080,
            "what docs/plugin-guide.md says an order of 50,000 items costs"
        );
    }

    /// Patterns that defeat the regex crate's lazy DFA match at up to 1.1 µs a byte (against
    /// a few ns for ordinary ones), and a program bound of 256 KiB let one take 6.6 s over
    /// a 900 KB string. With 32 KiB, and each byte under a pattern costing 24 units, the
    /// longest string such a pattern may check is about 166 KB: 0.18 s at worst here.
    #[test]
    fn a_pattern_that_defeats_the_dfa_checks_only_as_much_as_the_bound_allows() {
        let refused = Contracts::compile(&[contract(json!({ "pattern": r"(\W|\b){100}x" }), None)]).unwrap_err();
        assert!(refused.contains("not a valid JSON Schema"), "{refused}");
        for pattern in [r"(\W|\B){20}x", r"(\b|\B|\W){10}x"] {
            let contracts = Contracts::compile(&[contract(json!({ "pattern": pattern }), None)]).unwrap();
            let edge = serde_json::to_string(&("a".repeat(160_000) + "x")).unwrap();
            timed(pattern, || check(&contracts, "OrderCreated", &edge)).unwrap();
            let over = serde_json::to_string(&"a".repeat(170_000)).unwrap();
            let e = timed(pattern, || check(&contracts, "OrderCreated", &over)).unwrap_err();
            assert!(e.contains("too costly"), "{e}");
        }
        // A common pattern that needs the larger program still compiles.
        Contracts::compile(&[contract(json!({ "pattern": r"^(\w|-){1,100}$" }), None)]).unwrap();
    }

    /// Work that does not follow the schema's size: `uniqueItems` compares items pairwise
    /// when their hashes collide (`[0]`, `[{}]`, `[[0]]`... collide whatever the seed), a
    /// `multipleOf` of extreme floats is worked out with big integers, and a definition
    /// with thousands of unknown keys reached thousands of times is all walked.
    #[test]
    fn keywords_whose_work_is_not_one_step_per_value_are_weighed_as_such() {
        let contracts = Contracts::compile(&[contract(json!({ "uniqueItems": true }), None)]).unwrap();
        let colliding: Vec<Value> = (0..70_000)
            .map(|i| {
                let mut v = json!(0);
                for _ in 0..(i % 7) {
                    v = json!([v, {}]);
                }
                json!([v, i])
            })
            .collect();
        let e = timed("70,000 unique items", || {
            check(&contracts, "OrderCreated", &serde_json::to_string(&colliding).unwrap())
        })
        .unwrap_err();
        assert!(e.contains("too costly"), "{e}");
        let few = serde_json::to_string(&(0..1_000).collect::<Vec<_>>()).unwrap();
        assert_eq!(check(&contracts, "OrderCreated", &few), Ok(()));
        // Long items whose hashes collide: each comparison walks them.
        let long: Vec<Value> = (0..1_800).map(|i| json!([vec![0; 240], i % 2 == 0])).collect();
        let e = timed("1,800 long unique items", || {
            check(&contracts, "OrderCreated", &serde_json::to_string(&long).unwrap())
        })
        .unwrap_err();
        assert!(e.contains("too costly"), "{e}");

        let tiny = json!({ "items": { "multipleOf": 1.1e-300 } });
        let contracts = Contracts::compile(&[contract(tiny, None)]).unwrap();
        let huge = serde_json::to_string(&vec![1e308; 7_000]).unwrap();
        let _ = timed("7,000 extreme multipleOf checks", || {
            check(&contracts, "OrderCreated", &huge)
        });
        let more = serde_json::to_string(&vec![1e308; 160_000]).unwrap();
        assert!(check(&contracts, "OrderCreated", &more)
            .unwrap_err()
            .contains("too costly"));

        let mut wide = serde_json::Map::new();
        for i in 0..7_000 {
            wide.insert(format!("k{i}"), json!(0));
        }
        let fan_out = json!({ "$defs": { "w": wide }, "allOf": vec![json!({ "$ref": "#/$defs/w" }); 500] });
        let e = timed("a wide definition", || Contracts::compile(&[contract(fan_out, None)])).unwrap_err();
        assert!(e.contains("expands"), "{e}");

        let patterns: Vec<Value> = (0..65).map(|i| json!({ "pattern": format!("^a{{{i}}}$") })).collect();
        let e = Contracts::compile(&[contract(json!({ "anyOf": patterns }), None)]).unwrap_err();
        assert!(e.contains("more than 64 distinct patterns"), "{e}");
    }

    /// Reporting which field broke the schema evaluates each `anyOf` branch again, once per
    /// level of `anyOf` above it: 58 levels over a slow pattern would take 59 times the check.
    #[test]
    fn naming_the_field_is_within_the_bound_too() {
        let mut schema = json!({ "pattern": r"(\W|\B){20}x" });
        for _ in 0..58 {
            schema = json!({ "anyOf": [schema, false] });
        }
        let contracts = Contracts::compile(&[contract(schema, None)]).unwrap();
        let payload = serde_json::to_string(&"a".repeat(140_000)).unwrap();
        let e = timed("58 levels of anyOf over a slow pattern", || {
            check(&contracts, "OrderCreated", &payload)
        })
        .unwrap_err();
        assert!(e.contains("naming the field would cost more"), "{e}");
        // With one level, the field is named.
        let one = json!({ "anyOf": [{ "type": "integer" }, false] });
        let contracts = Contracts::compile(&[contract(one, None)]).unwrap();
        assert!(check(&contracts, "OrderCreated", "\"x\"").unwrap_err().contains("at /"));
    }

    #[test]
    fn the_emits_of_one_call_share_one_budget() {
        let contracts = Contracts::compile(&[contract(order_schema(), None)]).unwrap();
        let items = vec![json!({ "quantity": 2 }); 50_000];
        let order = json!({ "orderId": "7f1c1f8e-6c1e-4b8e-9d4a-3f0e2b8f0a11", "items": items }).to_string();
        let mut budget = MAX_CHECK_COST;
        let mut checked = 0;
        while contracts
            .check("order.events", "OrderCreated", &order, &mut budget)
            .is_ok()
        {
            checked += 1;
        }
        assert!((1..100).contains(&checked), "{checked} checks");
        let e = contracts
            .check("order.events", "OrderCreated", &order, &mut budget)
            .unwrap_err();
        assert!(e.contains("are left"), "{e}");
    }

    #[test]
    fn samples_follow_the_schema() {
        let sample = sample(&order_schema()).unwrap();
        assert_eq!(sample["orderId"], "00000000-0000-4000-8000-000000000000");
        assert_eq!(sample["items"], json!([]));
        assert!(super::sample(&json!({"type": "string", "pattern": "^x{3}$"})).is_none());
    }
}
