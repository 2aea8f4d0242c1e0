//! What Postgres's `jsonb` refuses that JSON allows. Events are stored as `jsonb` (the
//! outbox, the inbox), so a value is checked here before it is taken: an emitted event is
//! refused with the reason, a consumed message quarantined with it, a command's payload
//! answered 400, rather than failing at the database, where an inbox partition retried it
//! for ever. `jsonb` refuses:
//!
//! * the escape `\u0000` (NUL) in a string or a key ("unsupported Unicode escape sequence");
//! * a surrogate escape that is not a pair, high then low ("Unicode low surrogate must follow
//!   a high surrogate");
//! * a number beyond `numeric`'s range: more than 131,072 digits before the decimal point,
//!   more than 16,383 after it ("value overflows numeric format");
//! * arrays and objects nested too deep for its recursive parser ("stack depth limit
//!   exceeded": between 10,000 and 20,000 levels with Postgres 15's default
//!   `max_stack_depth`); refused here past [`MAX_DEPTH`], whatever the server's setting.

/// The most decimal digits `numeric` holds before its point, less one: the largest power of
/// ten of a digit (32,768 base-10,000 digits).
const MAX_DECIMAL_WEIGHT: i64 = 131_071;
/// The most decimal digits `numeric` holds after its point (`NUMERIC_DSCALE_MAX`).
const MAX_SCALE: i64 = 16_383;
/// The deepest nesting of arrays and objects taken.
pub const MAX_DEPTH: usize = 4096;
/// Postgres refuses an exponent this large outright, whatever the digits.
const MAX_EXPONENT: i64 = i32::MAX as i64 / 2;

/// Why `json` (already known to be valid JSON) cannot be stored as `jsonb`, if it cannot.
pub fn refusal(json: &str) -> Option<&'static str> {
    printed_len(json).err()
}

/// How many bytes `jsonb` prints `json` as (already known to be valid JSON), at most; or why it
/// cannot be stored. What is read back from a `jsonb` column is this text: the relay publishes
/// it, and inbox claims read it. It prints a string as written or shorter (an escape
/// such as `\u00e9` becomes the character), a space after each `,` and `:`, no other
/// whitespace, and every number in full, as `numeric` does: the 9 bytes of `1e131071` print
/// as 131,072 digits, so 10,000 of them made a value Postgres could not print at all.
pub fn printed_len(json: &str) -> Result<usize, &'static str> {
    let bytes = json.as_bytes();
    let (mut i, mut depth, mut printed) = (0, 0usize, 0usize);
    while i < bytes.len() {
        let (end, len) = match bytes[i] {
            b'"' => {
                let end = string_end(bytes, i + 1)?;
                (end, end - i)
            }
            b'-' | b'0'..=b'9' => number(bytes, i)?,
            b'[' | b'{' => {
                depth += 1;
                if depth > MAX_DEPTH {
                    return Err(DEPTH);
                }
                (i + 1, 1)
            }
            b']' | b'}' => {
                depth = depth.saturating_sub(1);
                (i + 1, 1)
            }
            b',' | b':' => (i + 1, 2),
            b' ' | b'\t' | b'\n' | b'\r' => (i + 1, 0),
            _ => (i + 1, 1),
        };
        i = end;
        printed = printed.saturating_add(len);
    }
    Ok(printed)
}

/// Where the value read ends, or why it cannot be stored.
type Step = Result<usize, &'static str>;

/// Where the string whose contents start at `i` ends (past its closing quote), or why it
/// cannot be stored.
fn string_end(bytes: &[u8], mut i: usize) -> Step {
    // A high surrogate escape waits for its low half, which must come next.
    let mut pending_high = false;
    while i < bytes.len() {
        match bytes[i] {
            b'"' if !pending_high => return Ok(i + 1),
            b'\\' if bytes.get(i + 1) == Some(&b'u') => {
                // Not four hex digits: not JSON, which was checked before.
                let Some(unit) = bytes.get(i + 2..i + 6).and_then(hex) else {
                    return Ok(bytes.len());
                };
                match (pending_high, unit) {
                    (_, 0) => return Err(NUL),
                    (false, 0xD800..=0xDBFF) => pending_high = true,
                    (true, 0xDC00..=0xDFFF) => pending_high = false,
                    (false, 0xDC00..=0xDFFF) | (true, _) => return Err(SURROGATE),
                    (false, _) => {}
                }
                i += 6;
            }
            _ if pending_high => return Err(SURROGATE),
            b'\\' => i += 2,
            _ => i += 1,
        }
    }
    Ok(bytes.len())
}

/// Where the number starting at `start` ends and how long `numeric` prints it, or why
/// `numeric` cannot hold it.
fn number(bytes: &[u8], start: usize) -> Result<(usize, usize), &'static str> {
    let mut i = start + usize::from(bytes[start] == b'-');
    let digits = |i: usize| bytes[i..].iter().take_while(|b| b.is_ascii_digit()).count();
    let int_len = digits(i);
    let int = &bytes[i..i + int_len];
    i += int_len;
    let frac = if bytes.get(i) == Some(&b'.') {
        let len = digits(i + 1);
        i += 1 + len;
        &bytes[i - len..i]
    } else {
        &bytes[i..i]
    };
    let mut exponent: i64 = 0;
    if matches!(bytes.get(i), Some(b'e' | b'E')) {
        i += 1;
        let negative = bytes.get(i) == Some(&b'-');
        i += usize::from(matches!(bytes.get(i), Some(b'-' | b'+')));
        let len = digits(i);
        for &d in &bytes[i..i + len] {
            // Saturates: anything past the bound is refused alike.
            exponent = (exponent * 10 + i64::from(d - b'0')).min(MAX_EXPONENT);
        }
        if negative {
            exponent = -exponent;
        }
        i += len;
    }
    let (weight, scale) = fits_numeric(int, frac, exponent)?;
    // A sign, the digits before the point (at least a 0), and the point and the scale's.
    let before = weight.map_or(1, |w| (w + 1).max(1));
    let after = if scale > 0 { scale + 1 } else { 0 };
    Ok((i, usize::from(bytes[start] == b'-') + (before + after) as usize))
}

/// Whether `numeric` holds the number `int.frac` × 10^`exponent`, as Postgres decides it: the
/// scale (digits after the point, trailing zeros too) counts even for zero, the weight (the
/// power of ten of the first digit that is not zero) only for a number that is not zero.
/// Returns the weight (`None` for zero) and the scale.
fn fits_numeric(int: &[u8], frac: &[u8], exponent: i64) -> Result<(Option<i64>, i64), &'static str> {
    if exponent.abs() >= MAX_EXPONENT {
        return Err(NUMBER);
    }
    let scale = (frac.len() as i64 - exponent).max(0);
    let first = int.iter().chain(frac).position(|&d| d != b'0');
    let weight = first.map(|p| int.len() as i64 - 1 - p as i64 + exponent);
    if scale > MAX_SCALE || weight.is_some_and(|w| w > MAX_DECIMAL_WEIGHT) {
        return Err(NUMBER);
    }
    Ok((weight, scale))
}

fn hex(four: &[u8]) -> Option<u32> {
    u32::from_str_radix(std::str::from_utf8(four).ok()?, 16).ok()
}

const NUL: &str = "it holds the escape \\u0000 (NUL), which Postgres's jsonb cannot store";
const SURROGATE: &str = "it holds a surrogate escape that is not a pair (a high one, then a low one), \
                         which Postgres's jsonb cannot store";
const DEPTH: &str = "it nests arrays and objects over 4,096 deep, past what Postgres's jsonb parser takes";
const NUMBER: &str = "it holds a number beyond the range of Postgres's numeric (131,072 digits before \
                      the point, 16,383 after it)";

#[cfg(test)]
mod tests {
    use super::{printed_len, refusal};

    /// Postgres 15's `octet_length('…'::jsonb::text)` of each: what the relay publishes and a
    /// claim reads back.
    #[test]
    fn the_printed_length_is_what_postgres_prints_or_more() {
        let exact = [
            (r#"{"a":1,"b":[1,2]}"#, 21),
            ("1e131071", 131_072),
            ("0.001e131074", 131_072),
            ("4.9E-324", 327),
            ("-0.5E+3", 4),
            ("1.50", 4),
            ("0e999999", 1),
            ("1e-5", 7),
            ("2E+10", 11),
            ("  [ 1 , 2 ]  ", 6),
            ("123.456e-2", 7),
            (r#"{"n": -12.75, "m": [0, 1e-5, 2E+10]}"#, 45),
            ("0.000", 5),
            ("100e-2", 4),
        ];
        for (json, printed) in exact {
            assert_eq!(printed_len(json), Ok(printed), "{json}");
        }
        // Printed shorter than counted: an escape becomes its character, -0 becomes 0.
        for (json, printed) in [(r#""\u00e9""#, 4), ("-0", 1)] {
            assert!(printed_len(json).unwrap() >= printed, "{json}");
        }
        let many = format!("[{}1]", "1e131071,".repeat(9_999));
        assert!(printed_len(&many).unwrap() > 1 << 30, "what Postgres cannot print");
    }

    #[test]
    fn a_nul_escape_is_refused_wherever_it_is_and_escaped_text_is_not() {
        for refused in [r#""\u0000""#, r#"{"a": ["x\u0000y"]}"#, r#"{"k\u0000": 1}"#] {
            assert!(refusal(refused).is_some(), "{refused}");
        }
        for fine in [r#"{"a": "\\u0000"}"#, r#"{"a": "\u0001"}"#, "{}", r#"[1, "u0000"]"#] {
            assert_eq!(refusal(fine), None, "{fine}");
        }
    }

    /// Postgres 15's answers to these, read from `SELECT '…'::jsonb`.
    #[test]
    fn surrogates_and_numbers_are_refused_where_postgres_refuses_them() {
        let refused = [
            r#""\ud800""#,
            r#""\udc00""#,
            r#"{"a": "\ud800x"}"#,
            r#"["\ud800\u0041"]"#,
            r#""\ud800\ud800""#,
            "1e131072",
            "10e131071",
            "-1e131072",
            "1e-16384",
            "1.5e-16383",
            "0.0e-999999",
            "1e2147483647",
            "1e-2147483648",
            "1e9999999999",
            "[1, 2, 1e999999]",
        ];
        for json in refused {
            assert!(refusal(json).is_some(), "{json}");
        }
        let digits = format!("[1{}]", "0".repeat(131_072));
        assert!(refusal(&digits).is_some(), "131,073 digits");
        let fine = [
            r#""\ud83d\ude00""#,
            r#"{"\ud83d\ude00": "\\ud800"}"#,
            r#""\uD83D\uDE00 and \u00e9""#,
            "1e131071",
            "9.9e131071",
            "123e131069",
            "0.001e131074",
            "1e-16383",
            "0e999999",
            "1e400",
            "-0.5E+3",
            r#"{"n": -12.75, "m": [0, 1e-5, 2E+10]}"#,
        ];
        for json in fine {
            assert_eq!(refusal(json), None, "{json}");
        }
        let digits = format!("[1{}]", "0".repeat(131_071));
        assert_eq!(refusal(&digits), None, "131,072 digits");
        let nested = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert_eq!(refusal(&nested(super::MAX_DEPTH)), None);
        assert!(refusal(&nested(super::MAX_DEPTH + 1)).is_some());
        assert!(refusal(&format!(
            "[{}]",
            r#"{"a": [1, {"b": "]]]]"}], "c": {}}, "#.repeat(5000) + "0"
        ))
        .is_none());
    }
}
