//! Postgres's `numeric` in its binary form, both ways, in time linear in the digits: a
//! plugin's decimal text to a parameter, and a result column back to the text Postgres
//! would write.
//!
//! Binary `numeric` is four 16-bit words (the count of base-10000 digits, the weight of the
//! first one, the sign, the display scale) and then the base-10000 digits. A decimal through
//! a big integer (bigdecimal's parse, then sqlx's encoding) cost the square of its length:
//! 147,500 digits held a worker thread for tens of milliseconds, and a statement could carry
//! several.

use sqlx::postgres::types::Oid;
use sqlx::postgres::{PgArgumentBuffer, PgTypeInfo};
use sqlx::{Encode, Postgres, Type};

const POSITIVE: u16 = 0x0000;
const NEGATIVE: u16 = 0x4000;
const NAN: u16 = 0xC000;
const INFINITY: u16 = 0xD000;
const NEGATIVE_INFINITY: u16 = 0xF000;
/// Postgres's limit on the digits after the point.
const MAX_DISPLAY_SCALE: i64 = 0x3FFF;
/// Postgres 15 refuses an exponent from `INT_MAX / 2` on, even on zero ("value overflows
/// numeric format"); every smaller one is a number or out of range by its weight or scale.
const MAX_EXPONENT: i64 = i32::MAX as i64 / 2 - 1;

/// What C's `isspace` counts as space, which Postgres trims around a number (and `strtol`
/// skips before an exponent): Rust's ASCII whitespace and the vertical tab.
fn is_c_space(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

/// Why a decimal text is not a `numeric` parameter.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    /// Not a number as Postgres's `numeric` input reads one.
    Syntax,
    /// A number, but more digits before the point (131,072) or after it (16,383) than
    /// `numeric` holds.
    Range,
}

/// A `numeric` parameter, already in its binary form.
pub(super) struct Param(Vec<u8>);

impl Type<Postgres> for Param {
    fn type_info() -> PgTypeInfo {
        PgTypeInfo::with_oid(Oid(1700))
    }
}

impl Encode<'_, Postgres> for Param {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        buf.extend_from_slice(&self.0);
        Ok(sqlx::encode::IsNull::No)
    }
}

/// The parameter for `text`, read as Postgres 15 reads a `numeric`: spaces around it, a sign,
/// digits with or without a point, an exponent (`1.5e3`), `NaN`, `Infinity` and `inf`.
pub(super) fn param(text: &str) -> Result<Param, Refusal> {
    let text = text.trim_matches(|c: char| c.is_ascii() && is_c_space(c as u8));
    let (negative, unsigned) = match text.as_bytes().first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    if unsigned.eq_ignore_ascii_case("infinity") || unsigned.eq_ignore_ascii_case("inf") {
        return Ok(Param(header(
            0,
            0,
            if negative { NEGATIVE_INFINITY } else { INFINITY },
            0,
        )));
    }
    if text.eq_ignore_ascii_case("nan") {
        return Ok(Param(header(0, 0, NAN, 0)));
    }
    let decimal = Decimal::read(unsigned.as_bytes())?;
    let scale = (decimal.after_point - decimal.exponent).max(0);
    if scale > MAX_DISPLAY_SCALE {
        return Err(Refusal::Range);
    }
    let digits = &decimal.digits;
    let (Some(first), Some(last)) = (
        digits.iter().position(|&d| d != 0),
        digits.iter().rposition(|&d| d != 0),
    ) else {
        return Ok(Param(header(0, 0, POSITIVE, scale as u16)));
    };
    // The decimal exponent of the first significant digit, and the base-10000 digit it is in.
    let top = decimal.before_point + decimal.exponent - first as i64 - 1;
    let weight = top.div_euclid(4);
    let Ok(weight) = i16::try_from(weight) else {
        return Err(Refusal::Range);
    };
    let lead = (4 * i64::from(weight) + 3 - top) as usize;
    let significant = &digits[first..=last];
    let groups = (lead + significant.len()).div_ceil(4);
    let count = u16::try_from(groups).map_err(|_| Refusal::Range)?;
    let sign = if negative { NEGATIVE } else { POSITIVE };
    let mut bytes = header(count, weight, sign, scale as u16);
    bytes.reserve(groups * 2);
    let padded = std::iter::repeat_n(0u8, lead).chain(significant.iter().copied());
    let mut group = 0u16;
    let mut filled = 0;
    for digit in padded {
        group = group * 10 + u16::from(digit);
        filled += 1;
        if filled == 4 {
            bytes.extend_from_slice(&group.to_be_bytes());
            (group, filled) = (0, 0);
        }
    }
    if filled > 0 {
        group *= 10u16.pow(4 - filled);
        bytes.extend_from_slice(&group.to_be_bytes());
    }
    Ok(Param(bytes))
}

fn header(count: u16, weight: i16, sign: u16, scale: u16) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(8);
    bytes.extend_from_slice(&count.to_be_bytes());
    bytes.extend_from_slice(&weight.to_be_bytes());
    bytes.extend_from_slice(&sign.to_be_bytes());
    bytes.extend_from_slice(&scale.to_be_bytes());
    bytes
}

/// An unsigned decimal as written: its digits, how many of them stand before the point and
/// after it, and its exponent.
struct Decimal {
    digits: Vec<u8>,
    before_point: i64,
    after_point: i64,
    exponent: i64,
}

impl Decimal {
    /// `digits[.digits][e[+-]digits]` or `.digits[...]`, and nothing else; as `strtol` reads
    /// Postgres 15's exponent, spaces may come between the `e` and it.
    fn read(text: &[u8]) -> Result<Decimal, Refusal> {
        let mut decimal = Decimal {
            digits: Vec::with_capacity(text.len()),
            before_point: 0,
            after_point: 0,
            exponent: 0,
        };
        let mut rest = text;
        let mut point = false;
        while let Some((&c, tail)) = rest.split_first() {
            match c {
                b'0'..=b'9' => {
                    decimal.digits.push(c - b'0');
                    *(if point {
                        &mut decimal.after_point
                    } else {
                        &mut decimal.before_point
                    }) += 1;
                }
                b'.' if !point => point = true,
                _ => break,
            }
            rest = tail;
        }
        if decimal.digits.is_empty() {
            return Err(Refusal::Syntax);
        }
        if let Some((b'e' | b'E', tail)) = rest.split_first() {
            let tail = &tail[tail.iter().take_while(|c| is_c_space(**c)).count()..];
            let (negative, tail) = match tail.split_first() {
                Some((b'-', t)) => (true, t),
                Some((b'+', t)) => (false, t),
                _ => (false, tail),
            };
            if tail.is_empty() || !tail.iter().all(u8::is_ascii_digit) {
                return Err(Refusal::Syntax);
            }
            let magnitude = tail
                .iter()
                .try_fold(0i64, |n, d| n.checked_mul(10)?.checked_add(i64::from(d - b'0')))
                .filter(|n| *n <= MAX_EXPONENT)
                .ok_or(Refusal::Range)?;
            decimal.exponent = if negative { -magnitude } else { magnitude };
            rest = &[];
        }
        if rest.is_empty() {
            Ok(decimal)
        } else {
            Err(Refusal::Syntax)
        }
    }
}

/// The `i`th 16-bit word of a binary `numeric`: its count, weight, sign and scale, then its
/// digits.
fn word(bytes: &[u8], i: usize) -> Option<i16> {
    bytes.get(i * 2..i * 2 + 2).map(|b| i16::from_be_bytes([b[0], b[1]]))
}

/// At most how long [`text`] makes this binary `numeric`: four digits per base-10000 digit
/// before the point (a few bytes on the wire can stand for 131,072 digits), and the display
/// scale after it.
pub(super) fn text_len(bytes: &[u8]) -> Result<usize, String> {
    let (Some(weight), Some(dscale)) = (word(bytes, 1), word(bytes, 3)) else {
        return Err("truncated numeric".into());
    };
    let integral = if weight < 0 { 1 } else { 4 * (weight as usize + 1) };
    let fraction = match dscale as u16 as usize {
        0 => 0,
        scale => scale + 1,
    };
    Ok((1 + integral + fraction).max("-Infinity".len()))
}

/// Renders Postgres's binary `numeric` as Postgres renders it as text, keeping its display
/// scale: `12.50` stays `12.50`, and no precision is lost on the way.
pub(super) fn text(bytes: &[u8]) -> Result<String, String> {
    use std::fmt::Write;
    let field = |i: usize| word(bytes, i).ok_or("truncated numeric".to_string());
    let (ndigits, weight, sign, dscale) = (
        field(0)? as u16 as usize,
        field(1)?,
        field(2)? as u16,
        field(3)? as u16 as usize,
    );
    match sign {
        NAN => return Ok("NaN".into()),
        INFINITY => return Ok("Infinity".into()),
        NEGATIVE_INFINITY => return Ok("-Infinity".into()),
        POSITIVE | NEGATIVE => {}
        _ => return Err("malformed numeric: an unknown sign".into()),
    }
    // What Postgres's own `numeric_recv` checks: as many digits as the count says, each a
    // base-10000 digit (a wider one would be written longer than `text_len` allowed for).
    let digits: Vec<i16> = (0..ndigits)
        .map_while(|d| word(bytes, 4 + d).filter(|digit| (0..10_000).contains(digit)))
        .collect();
    if bytes.len() != 8 + 2 * ndigits || digits.len() != ndigits {
        return Err("malformed numeric".into());
    }
    // Digits past either end are zeros.
    let digit = |d: i32| {
        usize::try_from(d)
            .ok()
            .and_then(|d| digits.get(d))
            .copied()
            .unwrap_or(0)
    };
    let mut out = String::new();
    if sign == NEGATIVE {
        out.push('-');
    }
    if weight < 0 {
        out.push('0');
    } else {
        for d in 0..=i32::from(weight) {
            let _ = if d == 0 {
                write!(out, "{}", digit(d))
            } else {
                write!(out, "{:04}", digit(d))
            };
        }
    }
    if dscale > 0 {
        let mut fraction = String::with_capacity(dscale + 4);
        let mut d = i32::from(weight) + 1;
        while fraction.len() < dscale {
            let _ = write!(fraction, "{:04}", digit(d));
            d += 1;
        }
        fraction.truncate(dscale);
        out.push('.');
        out.push_str(&fraction);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::{param, text, text_len, Refusal};

    /// Postgres's binary `numeric`: digit count, weight, sign, display scale, base-10000 digits.
    fn numeric(weight: i16, sign: u16, dscale: u16, digits: &[i16]) -> Vec<u8> {
        let mut bytes = Vec::new();
        for word in [digits.len() as i16, weight, sign as i16, dscale as i16]
            .iter()
            .chain(digits)
        {
            bytes.extend_from_slice(&word.to_be_bytes());
        }
        bytes
    }

    #[test]
    fn a_numeric_is_measured_before_it_is_written_and_never_longer() {
        let cases = [
            (numeric(0, 0, 2, &[12, 5000]), "12.50"),
            (numeric(-1, 0x4000, 3, &[5]), "-0.000"),
            (numeric(1, 0, 0, &[1, 0]), "10000"),
            (numeric(0, 0xC000, 0, &[]), "NaN"),
            (numeric(0, 0xF000, 0, &[]), "-Infinity"),
        ];
        for (bytes, written) in &cases {
            assert_eq!(text(bytes).unwrap(), *written);
            assert!(text_len(bytes).unwrap() >= written.len(), "{written}");
        }
        // 131,072 digits from 10 bytes: the size is known without writing them.
        let huge = numeric(32767, 0, 0, &[1]);
        let len = text_len(&huge).unwrap();
        assert!(len >= 131_068, "{len}");
        assert_eq!(text(&huge).unwrap().len(), 131_069);
        assert!(text_len(&[0, 1]).is_err());
    }

    /// What a server that is not Postgres, or a broken one, sends is refused, never written
    /// longer than measured: digits outside base 10000, an unknown sign, fewer or more digits
    /// than the count says.
    #[test]
    fn a_malformed_numeric_from_the_server_is_refused() {
        let mut short = numeric(1, 0, 0, &[1, 2]);
        short.truncate(short.len() - 2);
        let mut long = numeric(0, 0, 0, &[1]);
        long.extend_from_slice(&[0, 7]);
        for bytes in [
            numeric(0, 0, 0, &[10_000]),
            numeric(0, 0, 0, &[-1]),
            numeric(0, 0, 0, &[i16::MIN]),
            numeric(0, 0x1234, 0, &[1]),
            short,
            long,
        ] {
            assert!(text(&bytes).is_err(), "{bytes:?}");
        }
    }

    /// The bytes themselves, for a few: count, weight, sign, scale, base-10000 digits, the
    /// first and last of them not zero.
    #[test]
    fn a_decimal_is_written_in_base_10000_aligned_on_its_point() {
        let bytes = |input: &str| param(input).unwrap().0;
        assert_eq!(bytes("12.50"), numeric(0, 0, 2, &[12, 5000]));
        assert_eq!(bytes("-0.0001"), numeric(-1, 0x4000, 4, &[1]));
        assert_eq!(bytes("10000"), numeric(1, 0, 0, &[1]));
        assert_eq!(bytes("123456789"), numeric(2, 0, 0, &[1, 2345, 6789]));
        assert_eq!(bytes("0.000"), numeric(0, 0, 3, &[]));
        assert_eq!(bytes("1e131071"), numeric(32767, 0, 0, &[1000]));
        assert_eq!(bytes("-inf"), numeric(0, 0xF000, 0, &[]));
    }

    /// A decimal's parameter is the binary form Postgres itself would make of it: each case
    /// written back is Postgres's own text for the input (`'<input>'::numeric::text`).
    /// `tests/sql_confinement.rs` checks the same against a server.
    #[test]
    fn a_decimal_becomes_the_numeric_postgres_reads_from_it() {
        let round_trip = |input: &str| text(&param(input).unwrap_or_else(|e| panic!("{input}: {e:?}")).0).unwrap();
        for (input, written) in [
            ("0", "0"),
            ("-0", "0"),
            ("0.000", "0.000"),
            ("12.50", "12.50"),
            ("-12.50", "-12.50"),
            ("  +7 ", "7"),
            ("00012.3400", "12.3400"),
            (".5", "0.5"),
            ("5.", "5"),
            ("1e5", "100000"),
            ("1.5e1", "15"),
            ("1.50e1", "15.0"),
            ("1E-3", "0.001"),
            ("123e-2", "1.23"),
            ("0.0001", "0.0001"),
            ("10000", "10000"),
            ("99999999.99999999", "99999999.99999999"),
            (
                "123456789012345678901234567890.123456789",
                "123456789012345678901234567890.123456789",
            ),
            ("NaN", "NaN"),
            ("nan", "NaN"),
            ("Infinity", "Infinity"),
            ("-inf", "-Infinity"),
            ("+INFINITY", "Infinity"),
            ("+inf", "Infinity"),
            ("\t\n7\r\n", "7"),
            ("\u{b}5\u{c}", "5"),
            ("1e+5", "100000"),
            ("1e0005", "100000"),
            ("1e 5", "100000"),
            ("1e\t-3", "0.001"),
            ("5.e3", "5000"),
            ("+.5", "0.5"),
            ("0e1073741822", "0"),
        ] {
            assert_eq!(round_trip(input), written, "{input}");
        }
        let most = "9".repeat(131_072);
        assert_eq!(round_trip(&most), most);
        assert_eq!(round_trip("0e-16383"), format!("0.{}", "0".repeat(16_383)));
        let finest = format!("0.{}1", "0".repeat(16_382));
        assert_eq!(round_trip(&finest), finest);
        for bad in [
            "", " ", "-", "+", ".", "-.", "1e", "1e+", "1e-", "1e 5x", "1e5.5", "e5", "abc", "1.2.3", "1 2", "0x10",
            "1_000", "--1", "-nan", "+nan", "infin", "\u{a0}5",
        ] {
            assert_eq!(param(bad).err(), Some(Refusal::Syntax), "{bad:?}");
        }
        for out in [
            format!("1{}", "0".repeat(131_072)),
            format!("0.{}1", "0".repeat(16_383)),
            "1e131072".to_string(),
            "1e-16384".to_string(),
            "0e-16384".to_string(),
            "0e1073741823".to_string(),
            "0e2000000000".to_string(),
            "1e99999999999999999999".to_string(),
        ] {
            assert_eq!(param(&out).err(), Some(Refusal::Range), "{}", &out[..out.len().min(12)]);
        }
    }
}
