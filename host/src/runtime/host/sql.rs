//! `obx:plugin/sql`: one statement at a time on the call's transaction.
//!
//! Every statement passes the SQL policy first (`sql_policy`), and what runs is the text
//! the policy printed back. Values travel only as bind parameters. The statement runs on
//! the call's session, logged in as the plugin's own role, with the role's search path and
//! timeouts. A query's result is bounded in rows and in bytes, counted as rows arrive; past
//! either bound the session is abandoned rather than drained. The first failure marks the
//! call as unable to commit.

use chrono::{DateTime, NaiveDate, NaiveDateTime, SecondsFormat, Utc};
use futures::TryStreamExt;
use sqlx::postgres::types::Oid;
use sqlx::postgres::{PgArgumentBuffer, PgArguments, PgDatabaseError, PgRow, PgTypeInfo, PgTypeKind, PgValueRef};
use sqlx::{Arguments, Column, Decode, Encode, Postgres, Row, Type, TypeInfo, ValueRef};
use uuid::Uuid;

use super::numeric;
use crate::db::sessions::SLOW_STATEMENT;
use crate::runtime::bindings::sql::{self as wit, DatabaseError, Host, RowSet, SqlError};
use crate::runtime::bindings::types::SqlValue;
use crate::runtime::state::CallState;
use crate::sql_policy::PolicyError;
use crate::text::{clipped, shown};

enum Mode {
    Query,
    Execute,
}

enum Outcome {
    Rows(RowSet),
    Affected(u64),
}

impl Host for CallState {
    async fn query(&mut self, statement: String, params: Vec<SqlValue>) -> Result<RowSet, SqlError> {
        match self.run(&statement, params, Mode::Query).await? {
            Outcome::Rows(rows) => Ok(rows),
            Outcome::Affected(_) => unreachable!("query mode returns rows"),
        }
    }

    async fn execute(&mut self, statement: String, params: Vec<SqlValue>) -> Result<u64, SqlError> {
        match self.run(&statement, params, Mode::Execute).await? {
            Outcome::Affected(n) => Ok(n),
            Outcome::Rows(_) => unreachable!("execute mode returns a count"),
        }
    }
}

impl CallState {
    async fn run(&mut self, statement: &str, params: Vec<SqlValue>, mode: Mode) -> Result<Outcome, SqlError> {
        if self.tx.is_none() {
            return Err(SqlError::Forbidden(
                "SQL is available only inside handle-command and handle-event".into(),
            ));
        }
        if self.failure.is_some() {
            return Err(SqlError::Aborted);
        }
        if std::time::Instant::now() >= self.deadline {
            self.fail("the call deadline passed during SQL");
            return Err(SqlError::Timeout("the call deadline has passed".into()));
        }
        let checked = self
            .plugin
            .check_statement(statement, &self.limits)
            .map_err(|e| match e {
                PolicyError::Forbidden(m) => SqlError::Forbidden(m),
                PolicyError::Invalid(m) => SqlError::Invalid(m),
            })?;
        let (args, signature) = bind_all(params).map_err(SqlError::Invalid)?;
        // sqlx caches prepared statements by their text alone; the parameter types are part
        // of a prepared statement, so they must be part of the text too.
        let sql = format!("{checked} /* obx:{signature} */");
        let (max_rows, max_bytes) = (self.limits.max_rows as usize, self.limits.max_result_bytes);
        let tx = self.sending().expect("checked above");
        let sent = std::time::Instant::now();
        let mut abandoned = false;
        let mut lost_race = false;
        let mut mapped = |e: sqlx::Error| {
            lost_race = crate::db::lost_a_race(&e);
            map_error(e)
        };
        let result = match mode {
            Mode::Execute => sqlx::query_with(&sql, args)
                .execute(&mut **tx)
                .await
                .map(|r| Outcome::Affected(r.rows_affected()))
                .map_err(&mut mapped),
            Mode::Query => {
                let mut stream = sqlx::query_with(&sql, args).fetch(&mut **tx);
                let mut rows = Vec::new();
                let mut columns = Vec::new();
                let mut failed = None;
                // Bytes as received, and as held once converted (which can be far more: a
                // numeric of a few bytes on the wire may be 131,072 digits as text, and a NULL
                // is no bytes there). Both are bounded.
                let (mut received, mut held) = (0usize, 0usize);
                loop {
                    match stream.try_next().await {
                        Ok(Some(row)) => {
                            received += row_bytes(&row);
                            let converted = if rows.len() == max_rows || received > max_bytes {
                                Err(RowError::Limit)
                            } else {
                                convert_row(&row, max_bytes - held.min(max_bytes))
                            };
                            match converted {
                                Ok((values, bytes)) => {
                                    if columns.is_empty() {
                                        columns = describe_columns(&row);
                                    }
                                    held += bytes;
                                    rows.push(values);
                                }
                                Err(RowError::Limit) => {
                                    failed = Some(SqlError::Limit(format!(
                                        "the query returned more than {max_rows} rows or {max_bytes} bytes; \
                                         add a LIMIT or select less"
                                    )));
                                    abandoned = true;
                                    break;
                                }
                                Err(RowError::Invalid(m)) => {
                                    failed = Some(SqlError::Invalid(m));
                                    abandoned = true;
                                    break;
                                }
                            }
                        }
                        Ok(None) => break,
                        Err(e) => {
                            // A database error ends the result; anything else (a row sqlx could
                            // not read) may leave the rest of it coming.
                            abandoned |= !matches!(e, sqlx::Error::Database(_));
                            failed = Some(mapped(e));
                            break;
                        }
                    }
                }
                match failed {
                    Some(e) => Err(e),
                    None => Ok(Outcome::Rows(RowSet { columns, rows })),
                }
            }
        };
        if abandoned {
            // The rest of the result is still coming: never read it. Read later, by the
            // rollback after the failed call, it was read outside the call's slot and
            // deadline, for as long as the statement ran on (without a statement timeout, for
            // ever). A poisoned session is closed and its backend ended instead.
            tx.poison();
        }
        if sent.elapsed() >= SLOW_STATEMENT {
            tracing::warn!(
                plugin = %self.plugin.name, elapsed_ms = sent.elapsed().as_millis() as u64,
                statement = statement_head(&checked), "a plugin statement was slow"
            );
        }
        if let Err(e) = &result {
            // The statement ran, or half ran: this call can only roll back now.
            self.fail_statement(format!("a statement failed: {}", describe(e)), lost_race);
        }
        result
    }
}

/// The start of a statement's text, for a log line: its values travel as parameters and are
/// not in it, but a statement may be long.
fn statement_head(statement: &str) -> &str {
    crate::text::prefix(statement, 200)
}

fn describe(e: &SqlError) -> String {
    match e {
        SqlError::Database(d) => format!("{} ({})", d.message, d.code),
        SqlError::Forbidden(m) | SqlError::Invalid(m) | SqlError::Timeout(m) | SqlError::Limit(m) => m.clone(),
        SqlError::Aborted => "aborted".into(),
    }
}

/// The most of a database error's message the plugin gets, and the host logs: Postgres quotes
/// the offending value whole (`SELECT $1::int` with 100 MiB of text), and the message was
/// copied and logged whole, more than once.
const MAX_DB_MESSAGE: usize = 4096;

fn map_error(e: sqlx::Error) -> SqlError {
    match e {
        sqlx::Error::Database(db) => {
            let Some(pg) = db.try_downcast_ref::<PgDatabaseError>() else {
                return SqlError::Database(DatabaseError {
                    code: db.code().map(|c| c.into_owned()).unwrap_or_default(),
                    message: clipped(db.message(), MAX_DB_MESSAGE).into_owned(),
                    constraint: db.constraint().map(str::to_string),
                });
            };
            match pg.code() {
                "57014" => SqlError::Timeout("the statement timed out (statement_timeout)".into()),
                "55P03" => SqlError::Timeout("the statement waited too long for a lock (lock_timeout)".into()),
                code => SqlError::Database(DatabaseError {
                    code: code.to_string(),
                    message: clipped(pg.message(), MAX_DB_MESSAGE).into_owned(),
                    constraint: pg.constraint().map(str::to_string),
                }),
            }
        }
        sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_) | sqlx::Error::Encode(_) => {
            SqlError::Invalid(clipped(&e.to_string(), MAX_DB_MESSAGE).into_owned())
        }
        _ => SqlError::Database(DatabaseError {
            code: "08006".into(),
            message: "the connection to the database failed".into(),
            constraint: None,
        }),
    }
}

/// SQL NULL sent with an unspecified type, so that Postgres infers it from its use.
struct UntypedNull;

impl Type<Postgres> for UntypedNull {
    fn type_info() -> PgTypeInfo {
        PgTypeInfo::with_oid(Oid(0))
    }
}

impl Encode<'_, Postgres> for UntypedNull {
    fn encode_by_ref(&self, _buf: &mut PgArgumentBuffer) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        Ok(sqlx::encode::IsNull::Yes)
    }
}

/// The longest text of a `numeric` parameter: Postgres's own limit (131,072 digits before the
/// point, 16,383 after), with room for a sign, a point and an exponent; a longer one is
/// refused before it is read. Reading one costs time linear in its length ([`numeric`]).
const MAX_NUMERIC_CHARS: usize = 147_500;

/// Binds every parameter and returns the arguments with their type signature. The values are
/// the plugin's: each is checked, and quoted in an error only in part ([`crate::text::shown`]).
fn bind_all(params: Vec<SqlValue>) -> Result<(PgArguments, String), String> {
    let mut args = PgArguments::default();
    let mut signature = String::with_capacity(params.len());
    for (i, value) in params.into_iter().enumerate() {
        let n = i + 1;
        let added = match value {
            SqlValue::Null => add(&mut args, &mut signature, '0', UntypedNull),
            SqlValue::Boolean(b) => add(&mut args, &mut signature, 'b', b),
            SqlValue::Int(v) => add(&mut args, &mut signature, 'i', v),
            SqlValue::Float(v) => add(&mut args, &mut signature, 'f', v),
            SqlValue::Text(s) => add(&mut args, &mut signature, 't', s),
            SqlValue::Bytes(b) => add(&mut args, &mut signature, 'y', b),
            // Checked and sent as the text it is: parsed into a tree, 120 MiB of `[0,0,…]`
            // took about 2 GiB of the host's memory. What `jsonb` would refuse is refused
            // here, as before, where the statement would fail the call. Numbers reach `jsonb`
            // as written (through the tree they went by a double: 1.50 became 1.5).
            SqlValue::Json(s) => {
                let v = serde_json::value::RawValue::from_string(s)
                    .map_err(|e| format!("parameter ${n} is not valid JSON: {e}"))?;
                if let Some(reason) = crate::jsonb::refusal(v.get()) {
                    return Err(format!("parameter ${n} cannot be jsonb: {reason}"));
                }
                add(&mut args, &mut signature, 'j', sqlx::types::Json(v))
            }
            SqlValue::Uuid(s) => {
                let v = Uuid::parse_str(&s).map_err(|_| format!("parameter ${n} ({}) is not a UUID", shown(&s)))?;
                add(&mut args, &mut signature, 'u', v)
            }
            SqlValue::Timestamp(s) => {
                let v = DateTime::parse_from_rfc3339(&s)
                    .map_err(|_| format!("parameter ${n} ({}) is not an RFC 3339 timestamp", shown(&s)))?
                    .with_timezone(&Utc);
                add(&mut args, &mut signature, 's', v)
            }
            SqlValue::Date(s) => {
                let v = NaiveDate::parse_from_str(&s, "%Y-%m-%d")
                    .map_err(|_| format!("parameter ${n} ({}) is not a YYYY-MM-DD date", shown(&s)))?;
                add(&mut args, &mut signature, 'd', v)
            }
            SqlValue::Numeric(s) => {
                if s.len() > MAX_NUMERIC_CHARS {
                    return Err(format!(
                        "parameter ${n} is a number of {} characters; Postgres's numeric holds at most \
                         {MAX_NUMERIC_CHARS}",
                        s.len()
                    ));
                }
                let v = numeric::param(&s).map_err(|refusal| match refusal {
                    numeric::Refusal::Syntax => format!("parameter ${n} ({}) is not a number", shown(&s)),
                    numeric::Refusal::Range => format!("parameter ${n} ({}) is out of numeric's range", shown(&s)),
                })?;
                add(&mut args, &mut signature, 'n', v)
            }
        };
        added.map_err(|e| format!("parameter ${n} could not be encoded: {e}"))?;
    }
    Ok((args, signature))
}

fn add<'q, T>(
    args: &mut PgArguments,
    signature: &mut String,
    tag: char,
    value: T,
) -> Result<(), sqlx::error::BoxDynError>
where
    T: Encode<'q, Postgres> + Type<Postgres> + 'q,
{
    signature.push(tag);
    args.add(value)
}

/// The bytes of a row's column values, as received.
fn row_bytes(row: &PgRow) -> usize {
    (0..row.len())
        .map(|i| {
            row.try_get_raw(i)
                .ok()
                .and_then(|v| v.as_bytes().ok())
                .map_or(0, <[u8]>::len)
        })
        .sum()
}

fn describe_columns(row: &PgRow) -> Vec<wit::Column> {
    row.columns()
        .iter()
        .map(|c| wit::Column {
            name: c.name().to_string(),
            type_name: c.type_info().name().to_lowercase(),
        })
        .collect()
}

/// Why a row was not converted.
enum RowError {
    /// It would take more than the room left for the result.
    Limit,
    Invalid(String),
}

/// A row's values, and the bytes they hold, if that is at most `room`. A numeric's text is
/// measured before it is written.
fn convert_row(row: &PgRow, room: usize) -> Result<(Vec<SqlValue>, usize), RowError> {
    let mut values = Vec::with_capacity(row.len());
    let mut held = 0usize;
    for i in 0..row.len() {
        let invalid = |e: String| RowError::Invalid(format!("column {} ({}): {e}", i + 1, row.columns()[i].name()));
        let value = row.try_get_raw(i).map_err(|e| invalid(e.to_string()))?;
        if value.type_info().name() == "NUMERIC" && !value.is_null() {
            let text = numeric::text_len(value.as_bytes().map_err(|e| invalid(e.to_string()))?);
            if held + text.map_err(invalid)? > room {
                return Err(RowError::Limit);
            }
        }
        let value = convert_value(value).map_err(invalid)?;
        held += held_bytes(&value);
        if held > room {
            return Err(RowError::Limit);
        }
        values.push(value);
    }
    Ok((values, held))
}

/// The bytes a converted value takes in the host's memory: itself, and its text or bytes.
fn held_bytes(value: &SqlValue) -> usize {
    let heap = match value {
        SqlValue::Text(s)
        | SqlValue::Json(s)
        | SqlValue::Uuid(s)
        | SqlValue::Timestamp(s)
        | SqlValue::Date(s)
        | SqlValue::Numeric(s) => s.len(),
        SqlValue::Bytes(b) => b.len(),
        SqlValue::Null | SqlValue::Boolean(_) | SqlValue::Int(_) | SqlValue::Float(_) => 0,
    };
    std::mem::size_of::<SqlValue>() + heap
}

fn decode<'r, T: Decode<'r, Postgres>>(value: PgValueRef<'r>) -> Result<T, String> {
    T::decode(value).map_err(|e| e.to_string())
}

fn convert_value(value: PgValueRef<'_>) -> Result<SqlValue, String> {
    if value.is_null() {
        return Ok(SqlValue::Null);
    }
    let type_info = value.type_info().into_owned();
    Ok(match type_info.name() {
        "BOOL" => SqlValue::Boolean(decode(value)?),
        "INT2" => SqlValue::Int(decode::<i16>(value)?.into()),
        "INT4" => SqlValue::Int(decode::<i32>(value)?.into()),
        "INT8" => SqlValue::Int(decode(value)?),
        "FLOAT4" => SqlValue::Float(decode::<f32>(value)?.into()),
        "FLOAT8" => SqlValue::Float(decode(value)?),
        "TEXT" | "VARCHAR" | "BPCHAR" | "NAME" | "CHAR" => SqlValue::Text(decode(value)?),
        "BYTEA" => SqlValue::Bytes(decode(value)?),
        "JSON" | "JSONB" => SqlValue::Json(json_text(value)?),
        "UUID" => SqlValue::Uuid(decode::<Uuid>(value)?.to_string()),
        "TIMESTAMPTZ" => SqlValue::Timestamp(rfc3339(decode::<DateTime<Utc>>(value)?)),
        "TIMESTAMP" => SqlValue::Timestamp(rfc3339(decode::<NaiveDateTime>(value)?.and_utc())),
        "DATE" => SqlValue::Date(decode::<NaiveDate>(value)?.format("%Y-%m-%d").to_string()),
        "NUMERIC" => SqlValue::Numeric(numeric::text(value.as_bytes().map_err(|e| e.to_string())?)?),
        other => match type_info.kind() {
            // The binary form of an enum value is its label.
            PgTypeKind::Enum(_) => SqlValue::Text(
                std::str::from_utf8(value.as_bytes().map_err(|e| e.to_string())?)
                    .map_err(|e| e.to_string())?
                    .to_string(),
            ),
            _ => {
                return Err(format!(
                    "type {} cannot be read by plugins; cast it in the statement, e.g. `col::text`",
                    other.to_lowercase()
                ))
            }
        },
    })
}

/// A `json` or `jsonb` value as Postgres writes it, passed through as text: parsed into a
/// tree first, a result of `[0,0,…]` took some sixteen times its bytes in the host.
fn json_text(value: PgValueRef<'_>) -> Result<String, String> {
    let binary = value.format() == sqlx::postgres::PgValueFormat::Binary;
    let jsonb = value.type_info().name() == "JSONB";
    let bytes = value.as_bytes().map_err(|e| e.to_string())?;
    let text = match bytes {
        // Binary `jsonb` is a version byte (1), then the text.
        [1, text @ ..] if binary && jsonb => text,
        _ if binary && jsonb => return Err("unknown jsonb format version".into()),
        text => text,
    };
    String::from_utf8(text.to_vec()).map_err(|e| e.to_string())
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::AutoSi, true)
}
