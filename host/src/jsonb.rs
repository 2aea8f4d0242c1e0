//! What Postgres's `jsonb` refuses that JSON allows: the escape `\u0000` (NUL) in a string or
//! a key ("unsupported Unicode escape sequence"). Events are stored as `jsonb` (the outbox,
//! the inbox), so a value is checked here before it is taken: an emitted event is refused
//! with the reason, a consumed message quarantined with it, rather than failing at the
//! database, where an inbox partition retried it for ever.

/// Why `json` (already known to be valid JSON) cannot be stored as `jsonb`, if it cannot.
pub fn refusal(json: &str) -> Option<&'static str> {
    // Only a value that has the six characters at all is parsed: `\\u0000` (an escaped
    // backslash, then text) has them too, and is fine.
    if !json.contains("\\u0000") {
        return None;
    }
    let value: serde_json::Value = serde_json::from_str(json).ok()?;
    has_nul(&value).then_some("it holds the escape \\u0000 (NUL), which Postgres's jsonb cannot store")
}

fn has_nul(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::String(s) => s.contains('\0'),
        serde_json::Value::Array(items) => items.iter().any(has_nul),
        serde_json::Value::Object(fields) => fields.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::refusal;

    #[test]
    fn a_nul_escape_is_refused_wherever_it_is_and_escaped_text_is_not() {
        for refused in [r#""\u0000""#, r#"{"a": ["x\u0000y"]}"#, r#"{"k\u0000": 1}"#] {
            assert!(refusal(refused).is_some(), "{refused}");
        }
        for fine in [r#"{"a": "\\u0000"}"#, r#"{"a": "\u0001"}"#, "{}", r#"[1, "u0000"]"#] {
            assert_eq!(refusal(fine), None, "{fine}");
        }
    }
}
