//! SQL constants for statements the host writes as text, to send over the simple protocol in
//! the round trip of a commit (a query with parameters needs a round trip of its own).
//!
//! Those statements run on a plugin's session, after the plugin's own statements in the same
//! transaction, so nothing about the session can be trusted: the plugin may have changed
//! `standard_conforming_strings`, `client_encoding` or `search_path`. So a text constant is an
//! escape string (`E'…'`, whose backslashes mean the same under every setting) written in
//! printable ASCII only (which reads the same in every client encoding Postgres accepts),
//! quotes doubled, every other character as a `\u`/`\U` escape; and types are named with
//! their schema. A value cannot end its constant early whatever its bytes.

use std::fmt::Write;

/// Appends `value` as a text constant.
pub fn push_text(sql: &mut String, value: &str) {
    sql.reserve(value.len() + 3);
    sql.push_str("E'");
    for c in value.chars() {
        match c {
            '\'' => sql.push_str("''"),
            '\\' => sql.push_str("\\\\"),
            ' '..='~' => sql.push(c),
            c if (c as u32) <= 0xFFFF => _ = write!(sql, "\\u{:04X}", c as u32),
            c => _ = write!(sql, "\\U{:08X}", c as u32),
        }
    }
    sql.push('\'');
}

/// Appends `values` as one array constant of `element` (a type named with its schema, such
/// as `pg_catalog.text`): each element quoted in the array's own syntax, never `NULL`.
pub fn push_array<'a>(sql: &mut String, values: impl IntoIterator<Item = &'a str>, element: &str) {
    let mut array = String::from("{");
    for (i, value) in values.into_iter().enumerate() {
        if i > 0 {
            array.push(',');
        }
        array.push('"');
        for c in value.chars() {
            if c == '"' || c == '\\' {
                array.push('\\');
            }
            array.push(c);
        }
        array.push('"');
    }
    array.push('}');
    push_text(sql, &array);
    sql.push_str("::");
    sql.push_str(element);
    sql.push_str("[]");
}

/// Appends `bytes` as a `bytea` value: their hexadecimal digits, decoded.
pub fn push_bytes(sql: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    sql.reserve(2 * bytes.len() + 40);
    sql.push_str("pg_catalog.decode(E'");
    for b in bytes {
        sql.push(HEX[usize::from(b >> 4)] as char);
        sql.push(HEX[usize::from(b & 15)] as char);
    }
    sql.push_str("', E'hex')");
}

/// Appends `value` as a text constant, or a typed `NULL`.
pub fn push_optional_text(sql: &mut String, value: Option<&str>) {
    match value {
        Some(v) => push_text(sql, v),
        None => sql.push_str("NULL::pg_catalog.text"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(value: &str) -> String {
        let mut sql = String::new();
        push_text(&mut sql, value);
        sql
    }

    #[test]
    fn text_constants_are_printable_ascii_with_quotes_doubled() {
        assert_eq!(text("plain"), "E'plain'");
        assert_eq!(text("it's"), "E'it''s'");
        assert_eq!(text("a\\'b"), "E'a\\\\''b'");
        assert_eq!(text("tab\tnl\n"), "E'tab\\u0009nl\\u000A'");
        assert_eq!(text("é😀"), "E'\\u00E9\\U0001F600'");
        assert!(text("'; COMMIT; --\u{5c}\u{27}ü")
            .bytes()
            .all(|b| (b' '..=b'~').contains(&b)));
    }

    #[test]
    fn bytes_are_hexadecimal_digits() {
        let mut sql = String::new();
        push_bytes(&mut sql, b"\x00'\\\xff");
        assert_eq!(sql, "pg_catalog.decode(E'00275cff', E'hex')");
    }

    #[test]
    fn array_elements_are_quoted_in_the_array_syntax() {
        let mut sql = String::new();
        push_array(&mut sql, ["a", "b\"c", "d\\e", "NULL", ""], "pg_catalog.text");
        assert_eq!(
            sql,
            "E'{\"a\",\"b\\\\\"c\",\"d\\\\\\\\e\",\"NULL\",\"\"}'::pg_catalog.text[]"
        );
    }
}
