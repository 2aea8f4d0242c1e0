//! What SQL a plugin may run. A real parser (sqlparser, Postgres dialect) checks every
//! statement before it reaches Postgres:
//!
//! * a handler statement must be one SELECT, INSERT, UPDATE or DELETE (or WITH over those);
//! * a migration may also create, alter and drop tables, indexes, views, sequences and types;
//! * either way it may name only the plugin's own schema, never the system catalogs, and
//!   never call a function that changes settings or roles, runs SQL text, touches files or
//!   the network, or administers the server.
//!
//! The checked statement is printed back from the syntax tree, and that text is what runs,
//! so Postgres executes exactly what was checked. Statements are sent one at a time with
//! the extended protocol, which also refuses several statements in one string.
//!
//! Before anything is parsed, a statement's size and shape are bounded: at most
//! `limits.max_statement_bytes`, nested at most [`MAX_NESTING`] deep, and at most
//! [`MAX_RUN_TOKENS`] tokens between two commas or brackets. The parser's own recursion
//! limit guards parsing, but a flat chain such as `1+1+…` parses without recursion into a
//! tree as deep as the chain, and walking, printing or dropping that tree recurses: on a
//! Wasm host call's stack it would overflow. The bounds keep every tree shallow enough.
//!
//! This is defence in depth, not the wall. The wall is Postgres: plugin statements run on
//! sessions logged in as the plugin's own role (`db::sessions`), which has no privilege on
//! the host's schema or any other plugin's, and which `RESET ROLE` cannot leave. The parser
//! keeps plugins to the statements the contract offers, refuses what would outlive the call
//! on a pooled session (temporary objects, advisory locks, settings), and refuses function
//! calls it cannot see by name: Postgres reads `(x).f` as `f(x)` (attribute notation).

use std::ops::ControlFlow;

use sqlparser::ast::{
    AccessExpr, AlterTableOperation, ColumnDef, ColumnOption, Expr, Ident, ObjectName, ObjectNamePart, ObjectType,
    SetExpr, Statement, TableConstraint, TableFactor, Visit, Visitor,
};
use sqlparser::dialect::PostgreSqlDialect;
use sqlparser::keywords::Keyword;
use sqlparser::parser::Parser;
use sqlparser::tokenizer::{Token, Tokenizer};

/// Why a statement was not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// The statement is well-formed but not allowed for plugins.
    #[error("{0}")]
    Forbidden(String),
    /// The statement could not be parsed.
    #[error("{0}")]
    Invalid(String),
}

/// Where a statement comes from: a handler call or a plugin migration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Context {
    Handler,
    Migration,
}

/// How deeply brackets may nest in a statement.
pub const MAX_NESTING: usize = 64;
/// How many tokens may follow one another without a comma or bracket between them: this
/// bounds the depth of an operator chain such as `1+1+…`.
pub const MAX_RUN_TOKENS: usize = 1024;
/// A migration may hold several statements: this many times `limits.max_statement_bytes`.
const MIGRATION_STATEMENTS: usize = 16;

/// Checks one handler statement of at most `max_bytes` bytes and returns the text to run.
pub fn check_handler_statement(sql: &str, own_schema: &str, max_bytes: usize) -> Result<String, PolicyError> {
    let statements = parse(sql, Context::Handler, max_bytes)?;
    if statements.len() > 1 {
        return Err(forbidden(
            "several statements in one call are not allowed; run them one at a time",
        ));
    }
    let statement = statements.into_iter().next().expect("parse returns at least one");
    if !is_data_statement(&statement) {
        return Err(forbidden(&format!(
            "only SELECT, INSERT, UPDATE, DELETE and WITH are allowed in handlers, not {}",
            statement_name(&statement)
        )));
    }
    check_tree(&statement, own_schema, Context::Handler)?;
    Ok(statement.to_string())
}

/// Checks a migration (one or more statements, each of at most `max_bytes` bytes in spirit:
/// the whole may hold [`MIGRATION_STATEMENTS`] times that) and returns the statements to
/// run, in order.
pub fn check_migration(sql: &str, own_schema: &str, max_bytes: usize) -> Result<Vec<String>, PolicyError> {
    let statements = parse(sql, Context::Migration, max_bytes.saturating_mul(MIGRATION_STATEMENTS))?;
    let mut out = Vec::with_capacity(statements.len());
    for statement in statements {
        if !is_data_statement(&statement) && !is_allowed_ddl(&statement) {
            return Err(forbidden(&format!(
                "{} is not allowed in a migration; migrations may create, alter and drop \
                 tables, indexes, views, sequences and types in the plugin's own schema, \
                 and run data statements",
                statement_name(&statement)
            )));
        }
        check_created_names(&statement, own_schema)?;
        check_not_temporary(&statement)?;
        check_created_relations(&statement)?;
        check_tree(&statement, own_schema, Context::Migration)?;
        out.push(statement.to_string());
    }
    Ok(out)
}

fn forbidden(msg: &str) -> PolicyError {
    PolicyError::Forbidden(msg.to_string())
}

fn parse(sql: &str, context: Context, max_bytes: usize) -> Result<Vec<Statement>, PolicyError> {
    if sql.len() > max_bytes {
        return Err(PolicyError::Forbidden(format!(
            "the statement is {} bytes, over the limit of {max_bytes}",
            sql.len()
        )));
    }
    let dialect = PostgreSqlDialect {};
    // Name the class of a forbidden statement even when the parser does not know its
    // syntax (DO blocks, LISTEN, ...): look at its first keyword.
    let tokens = Tokenizer::new(&dialect, sql)
        .tokenize()
        .map_err(|e| PolicyError::Invalid(format!("cannot tokenize the statement: {e}")))?;
    check_shape(&tokens)?;
    if let Some(Token::Word(word)) = tokens.iter().find(|t| !matches!(t, Token::Whitespace(_))) {
        if let Some(reason) = forbidden_leading_keyword(word.keyword, context) {
            return Err(PolicyError::Forbidden(reason));
        }
    }
    let statements = Parser::parse_sql(&dialect, sql)
        .map_err(|e| PolicyError::Invalid(format!("cannot parse the statement: {e}")))?;
    if statements.is_empty() {
        return Err(PolicyError::Invalid("the statement is empty".into()));
    }
    Ok(statements)
}

/// Bounds nesting and the length of runs between commas and brackets, on the flat token list,
/// before any tree is built (see the module's documentation).
fn check_shape(tokens: &[Token]) -> Result<(), PolicyError> {
    let too_deep = || {
        PolicyError::Forbidden(format!(
            "the statement nests or chains too deeply (at most {MAX_NESTING} levels of brackets and \
             {MAX_RUN_TOKENS} tokens between commas or brackets)"
        ))
    };
    // The run length of each open bracket level; the last is the current one.
    let mut runs: Vec<usize> = vec![0];
    for token in tokens {
        match token {
            Token::Whitespace(_) => {}
            Token::LParen | Token::LBracket | Token::LBrace => {
                *runs.last_mut().expect("never empty") += 1;
                runs.push(0);
                if runs.len() > MAX_NESTING {
                    return Err(too_deep());
                }
            }
            Token::RParen | Token::RBracket | Token::RBrace => {
                if runs.len() > 1 {
                    runs.pop();
                }
            }
            Token::Comma | Token::SemiColon => *runs.last_mut().expect("never empty") = 0,
            _ => {
                let run = runs.last_mut().expect("never empty");
                *run += 1;
                if *run > MAX_RUN_TOKENS {
                    return Err(too_deep());
                }
            }
        }
    }
    Ok(())
}

fn forbidden_leading_keyword(keyword: Keyword, context: Context) -> Option<String> {
    use Keyword as K;
    let msg = match keyword {
        K::BEGIN | K::START | K::COMMIT | K::END | K::ROLLBACK | K::ABORT | K::SAVEPOINT | K::RELEASE => {
            "transaction control is not allowed: the host owns the transaction"
        }
        K::SET | K::RESET => "SET and RESET are not allowed: the host sets the role, search path and timeouts",
        K::COPY => "COPY is not allowed",
        K::LISTEN | K::UNLISTEN | K::NOTIFY => "LISTEN, UNLISTEN and NOTIFY are not allowed",
        K::DO => "DO blocks are not allowed",
        K::CALL | K::EXECUTE | K::PREPARE | K::DEALLOCATE => "CALL, PREPARE and EXECUTE are not allowed",
        K::LOCK => "LOCK is not allowed; use SELECT ... FOR UPDATE",
        K::VACUUM | K::ANALYZE | K::CLUSTER | K::REINDEX | K::DISCARD | K::LOAD => {
            "maintenance and session commands are not allowed"
        }
        K::GRANT | K::REVOKE => "GRANT and REVOKE are not allowed",
        K::CREATE | K::ALTER | K::DROP | K::TRUNCATE | K::COMMENT | K::REFRESH | K::IMPORT
            if context == Context::Handler =>
        {
            "DDL is not allowed in handlers; put schema changes in the manifest's migrations"
        }
        _ => return None,
    };
    Some(msg.to_string())
}

fn is_data_statement(statement: &Statement) -> bool {
    matches!(
        statement,
        Statement::Query(_) | Statement::Insert(_) | Statement::Update(_) | Statement::Delete(_)
    )
}

fn is_allowed_ddl(statement: &Statement) -> bool {
    match statement {
        Statement::CreateTable(_)
        | Statement::AlterTable(_)
        | Statement::CreateIndex(_)
        | Statement::CreateView(_)
        | Statement::CreateType { .. }
        | Statement::AlterType(_)
        | Statement::CreateSequence { .. }
        | Statement::Comment { .. } => true,
        Statement::Drop { object_type, .. } => matches!(
            object_type,
            ObjectType::Table
                | ObjectType::View
                | ObjectType::MaterializedView
                | ObjectType::Index
                | ObjectType::Sequence
                | ObjectType::Type
        ),
        _ => false,
    }
}

/// A short name for a statement, for messages: its leading keywords.
fn statement_name(statement: &Statement) -> String {
    let text = statement.to_string();
    let words: Vec<&str> = text.split_whitespace().take(2).collect();
    let name = match words.as_slice() {
        [first, second] if ["CREATE", "ALTER", "DROP"].contains(first) => {
            format!("{first} {second}")
        }
        [first, ..] => first.to_string(),
        [] => "this statement".to_string(),
    };
    name.to_uppercase()
}

/// Objects a migration creates must land in the plugin's own schema.
fn check_created_names(statement: &Statement, own_schema: &str) -> Result<(), PolicyError> {
    let name = match statement {
        Statement::CreateTable(t) => Some(&t.name),
        Statement::CreateView(v) => Some(&v.name),
        Statement::CreateIndex(i) => i.name.as_ref(),
        Statement::CreateSequence { name, .. } => Some(name),
        Statement::CreateType { name, .. } => Some(name),
        _ => None,
    };
    match name {
        Some(name) => check_object_name(name, own_schema, "create"),
        None => Ok(()),
    }
}

/// Temporary objects outlive the call on a pooled session, and the temporary schema is
/// searched before the plugin's own: refused, whatever the role may do.
fn check_not_temporary(statement: &Statement) -> Result<(), PolicyError> {
    let temporary = match statement {
        Statement::CreateTable(t) => t.temporary,
        Statement::CreateView(v) => v.temporary,
        Statement::CreateSequence { temporary, .. } => *temporary,
        _ => false,
    };
    if temporary {
        return Err(forbidden("temporary tables, views and sequences are not allowed"));
    }
    Ok(())
}

/// The most relations (indexes, sequences) one migration statement may create besides its
/// table. Each holds a lock to the migration's end, in the lock table the whole server shares
/// (6,400 entries with Postgres's defaults); the host counts what a plugin owns after every
/// statement (`limits.max_relations`), and this bounds what one statement adds before that.
pub const MAX_RELATIONS_PER_STATEMENT: usize = 64;

/// Refuses a CREATE or ALTER TABLE that would create more than
/// [`MAX_RELATIONS_PER_STATEMENT`] indexes (primary keys, unique constraints) and sequences
/// (serial and identity columns) at once: `UNIQUE (a, b), UNIQUE (a, c), …` fits thousands in
/// one statement.
fn check_created_relations(statement: &Statement) -> Result<(), PolicyError> {
    let created = match statement {
        Statement::CreateTable(t) => {
            t.constraints.iter().filter(|c| has_index(c)).count()
                + t.columns.iter().map(column_relations).sum::<usize>()
        }
        Statement::AlterTable(a) => a
            .operations
            .iter()
            .map(|op| match op {
                AlterTableOperation::AddConstraint { constraint, .. } => usize::from(has_index(constraint)),
                AlterTableOperation::AddColumn { column_def, .. } => column_relations(column_def),
                _ => 0,
            })
            .sum(),
        _ => 0,
    };
    if created > MAX_RELATIONS_PER_STATEMENT {
        return Err(forbidden(&format!(
            "the statement would create {created} indexes and sequences at once, over the limit \
             of {MAX_RELATIONS_PER_STATEMENT}"
        )));
    }
    Ok(())
}

fn has_index(constraint: &TableConstraint) -> bool {
    matches!(constraint, TableConstraint::Unique(_) | TableConstraint::PrimaryKey(_))
}

/// The indexes and sequences a column definition creates: one per unique or primary key
/// option, one per identity (or generated) option, one for a serial type.
fn column_relations(column: &ColumnDef) -> usize {
    let options = column
        .options
        .iter()
        .filter(|o| {
            matches!(
                o.option,
                ColumnOption::Unique(_) | ColumnOption::PrimaryKey(_) | ColumnOption::Generated { .. }
            )
        })
        .count();
    let serial = matches!(
        column.data_type.to_string().to_ascii_lowercase().as_str(),
        "serial" | "serial2" | "serial4" | "serial8" | "smallserial" | "bigserial"
    );
    options + usize::from(serial)
}

/// Normalises one identifier the way Postgres does: unquoted names fold to lower case.
fn ident_value(part: &ObjectNamePart) -> Result<String, PolicyError> {
    match part {
        ObjectNamePart::Identifier(ident) => Ok(if ident.quote_style.is_some() {
            ident.value.clone()
        } else {
            ident.value.to_lowercase()
        }),
        ObjectNamePart::Function(_) => Err(forbidden("computed object names are not allowed")),
    }
}

fn split_name(name: &ObjectName) -> Result<(Option<String>, String), PolicyError> {
    let parts = name.0.iter().map(ident_value).collect::<Result<Vec<_>, _>>()?;
    match parts.as_slice() {
        [object] => Ok((None, object.clone())),
        [schema, object] => Ok((Some(schema.clone()), object.clone())),
        _ => Err(forbidden(&format!(
            "{name}: names with a database part are not allowed"
        ))),
    }
}

/// A table, view or sequence name: only the plugin's own schema, never the catalogs.
fn check_object_name(name: &ObjectName, own_schema: &str, what: &str) -> Result<(), PolicyError> {
    let (schema, object) = split_name(name)?;
    match schema {
        Some(schema) if schema != own_schema => Err(PolicyError::Forbidden(format!(
            "{name}: a plugin can {what} objects only in its own schema `{own_schema}`"
        ))),
        _ if object.starts_with("pg_") || object.starts_with("information_schema") => Err(PolicyError::Forbidden(
            format!("{name}: the system catalogs are not available to plugins"),
        )),
        _ => Ok(()),
    }
}

/// A function name: built-ins (optionally `pg_catalog.`-qualified) or the plugin's own,
/// minus those that would break the confinement.
fn check_function_name(name: &ObjectName, own_schema: &str) -> Result<(), PolicyError> {
    let (schema, function) = split_name(name)?;
    if let Some(schema) = &schema {
        if schema != "pg_catalog" && schema != own_schema {
            return Err(PolicyError::Forbidden(format!(
                "{name}: a plugin can call functions only from pg_catalog and its own schema"
            )));
        }
    }
    match denied_function(&function.to_lowercase()) {
        Some(reason) => Err(PolicyError::Forbidden(format!("{function}(): {reason}"))),
        None => Ok(()),
    }
}

/// Harmless `pg_*` functions a handler may call.
const ALLOWED_PG_FUNCTIONS: &[&str] = &[
    "pg_typeof",
    "pg_column_size",
    "pg_size_pretty",
    "pg_size_bytes",
    "pg_input_is_valid",
];

fn denied_function(name: &str) -> Option<&'static str> {
    if name == "set_config" {
        return Some("changing settings or the role is not allowed");
    }
    if name.starts_with("pg_") && !ALLOWED_PG_FUNCTIONS.contains(&name) {
        return Some("server administration and advisory-lock functions are not allowed");
    }
    if name.starts_with("lo_") || name == "lowrite" || name == "loread" {
        return Some("large-object functions are not allowed");
    }
    if name.starts_with("dblink") {
        return Some("connections to other databases are not allowed");
    }
    if name.contains("_to_xml") || name == "ts_stat" || name == "ts_rewrite" {
        return Some("functions that run SQL text are not allowed");
    }
    if name.starts_with("binary_upgrade_") {
        return Some("not allowed");
    }
    None
}

/// Walks every node of a statement: nested statements, relations, function calls.
fn check_tree(statement: &Statement, own_schema: &str, context: Context) -> Result<(), PolicyError> {
    struct Checker<'a> {
        own_schema: &'a str,
        context: Context,
    }
    impl Visitor for Checker<'_> {
        type Break = PolicyError;

        fn pre_visit_statement(&mut self, s: &Statement) -> ControlFlow<PolicyError> {
            let allowed = is_data_statement(s) || (self.context == Context::Migration && is_allowed_ddl(s));
            if !allowed {
                return ControlFlow::Break(PolicyError::Forbidden(format!(
                    "{} is not allowed inside another statement",
                    statement_name(s)
                )));
            }
            ControlFlow::Continue(())
        }

        fn pre_visit_query(&mut self, q: &sqlparser::ast::Query) -> ControlFlow<PolicyError> {
            if let Err(e) = check_set_expr(&q.body) {
                return ControlFlow::Break(e);
            }
            ControlFlow::Continue(())
        }

        fn pre_visit_relation(&mut self, name: &ObjectName) -> ControlFlow<PolicyError> {
            match check_object_name(name, self.own_schema, "use") {
                Ok(()) => ControlFlow::Continue(()),
                Err(e) => ControlFlow::Break(e),
            }
        }

        fn pre_visit_table_factor(&mut self, t: &TableFactor) -> ControlFlow<PolicyError> {
            // A function in FROM (`FROM f(...)`) parses as a table with arguments.
            let function = match t {
                TableFactor::Table {
                    name, args: Some(_), ..
                } => Some(name),
                TableFactor::Function { name, .. } => Some(name),
                _ => None,
            };
            if let Some(name) = function {
                if let Err(e) = check_function_name(name, self.own_schema) {
                    return ControlFlow::Break(e);
                }
            }
            ControlFlow::Continue(())
        }

        fn pre_visit_expr(&mut self, e: &Expr) -> ControlFlow<PolicyError> {
            let checked = match e {
                Expr::Function(f) => check_function_name(&f.name, self.own_schema),
                Expr::CompoundFieldAccess { root, access_chain } => check_attribute_notation(root, access_chain),
                // `t.f` calls f(t) when t is a table and f is not a column of it.
                Expr::CompoundIdentifier(parts) => parts.last().map_or(Ok(()), check_field_name),
                _ => Ok(()),
            };
            match checked {
                Ok(()) => ControlFlow::Continue(()),
                Err(e) => ControlFlow::Break(e),
            }
        }
    }

    match statement.visit(&mut Checker { own_schema, context }) {
        ControlFlow::Continue(()) => Ok(()),
        ControlFlow::Break(e) => Err(e),
    }
}

/// `(x).f` is a call of `f(x)` when `x` has no field `f`. Allowed only on a column (a
/// composite column's field, or an array element), and never with the name of a function
/// that is denied by name.
fn check_attribute_notation(root: &Expr, chain: &[AccessExpr]) -> Result<(), PolicyError> {
    let plain_column = |e: &Expr| matches!(e, Expr::Identifier(_) | Expr::CompoundIdentifier(_));
    let column_root = match root {
        Expr::Nested(inner) => plain_column(inner),
        other => plain_column(other),
    };
    let dotted = chain.iter().any(|a| matches!(a, AccessExpr::Dot(_)));
    if dotted && !column_root {
        return Err(forbidden(
            "attribute notation `(x).f` is allowed only on a column: Postgres reads it as the call f(x)",
        ));
    }
    for access in chain {
        if let AccessExpr::Dot(field) = access {
            match field {
                Expr::Identifier(ident) => check_field_name(ident)?,
                _ => return Err(forbidden("only a field name may follow `.`")),
            }
        }
    }
    Ok(())
}

/// A field name that is also a denied function's name is refused: `(col).pg_sleep` calls it.
fn check_field_name(ident: &Ident) -> Result<(), PolicyError> {
    match denied_function(&ident.value.to_lowercase()) {
        Some(reason) => Err(PolicyError::Forbidden(format!(
            "{}: attribute notation calls a function of that name; {reason}",
            ident.value
        ))),
        None => Ok(()),
    }
}

/// Forms of query body that the relation walk would not see, or that create objects.
fn check_set_expr(body: &SetExpr) -> Result<(), PolicyError> {
    match body {
        SetExpr::Select(select) if select.into.is_some() => Err(forbidden(
            "SELECT INTO creates a table and is not allowed; use INSERT ... SELECT",
        )),
        SetExpr::Table(_) => Err(forbidden("the TABLE shorthand is not allowed; use SELECT * FROM")),
        SetExpr::Merge(_) => Err(forbidden("MERGE is not allowed")),
        SetExpr::SetOperation { left, right, .. } => {
            check_set_expr(left)?;
            check_set_expr(right)
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: usize = 64 * 1024;

    fn handler(sql: &str) -> Result<String, PolicyError> {
        check_handler_statement(sql, "orders", MAX)
    }

    fn migration(sql: &str) -> Result<Vec<String>, PolicyError> {
        check_migration(sql, "orders", MAX)
    }

    fn assert_forbidden(sql: &str, needle: &str) {
        match handler(sql) {
            Err(PolicyError::Forbidden(msg)) => {
                assert!(msg.contains(needle), "{sql}: message {msg:?} lacks {needle:?}")
            }
            other => panic!("{sql}: expected Forbidden, got {other:?}"),
        }
    }

    #[test]
    fn data_statements_pass_and_keep_placeholders() {
        for sql in [
            "SELECT id, amount FROM orders WHERE id = $1",
            "INSERT INTO orders (id, amount) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING",
            "UPDATE orders.orders SET status = 'paid' WHERE id = $1 RETURNING id",
            "DELETE FROM orders WHERE created_at < now() - interval '1 day'",
            "WITH moved AS (DELETE FROM a WHERE x = $1 RETURNING *) INSERT INTO b SELECT * FROM moved",
            "SELECT gen_random_uuid(), pg_catalog.now(), coalesce($1, 'x')",
            "SELECT * FROM orders FOR UPDATE SKIP LOCKED",
        ] {
            let out = handler(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
            assert_eq!(out.matches('$').count(), sql.matches('$').count(), "{out}");
        }
    }

    #[test]
    fn transaction_control_is_refused() {
        for sql in [
            "COMMIT",
            "ROLLBACK",
            "BEGIN",
            "SAVEPOINT a",
            "RELEASE SAVEPOINT a",
            "END",
        ] {
            assert_forbidden(sql, "transaction control");
        }
    }

    #[test]
    fn settings_and_roles_are_refused() {
        assert_forbidden("SET statement_timeout = 0", "SET and RESET");
        assert_forbidden("RESET ROLE", "SET and RESET");
        assert_forbidden("SET ROLE postgres", "SET and RESET");
        assert_forbidden("SELECT set_config('role', 'postgres', true)", "set_config");
        assert_forbidden("SELECT pg_catalog.set_config('role', 'postgres', true)", "set_config");
        assert_forbidden("SELECT \"set_config\"('role', 'postgres', true)", "set_config");
        assert_forbidden("SELECT * FROM set_config('role', 'postgres', true)", "set_config");
        assert_forbidden(
            "SELECT 1 WHERE EXISTS (SELECT SET_CONFIG('statement_timeout', '0', true))",
            "set_config",
        );
    }

    #[test]
    fn other_classes_are_refused() {
        assert_forbidden("COPY orders TO STDOUT", "COPY");
        assert_forbidden("LISTEN x", "LISTEN");
        assert_forbidden("NOTIFY x, 'y'", "LISTEN");
        assert_forbidden("DO $$ BEGIN PERFORM 1; END $$", "DO blocks");
        assert_forbidden("CREATE TABLE t (id int)", "DDL");
        assert_forbidden("DROP TABLE orders", "DDL");
        assert_forbidden("SELECT 1; SELECT 2", "several statements");
        assert_forbidden("SELECT 1; COMMIT", "several statements");
        assert_forbidden("SELECT * INTO t2 FROM orders", "SELECT INTO");
        assert_forbidden("SELECT pg_sleep(10)", "administration");
        assert_forbidden("SELECT pg_advisory_lock(1)", "administration");
        assert_forbidden("SELECT query_to_xml('select 1', true, true, '')", "SQL text");
        assert_forbidden("LOCK TABLE orders", "LOCK");
    }

    #[test]
    fn other_schemas_and_catalogs_are_refused() {
        assert_forbidden("INSERT INTO obx.outbox_event (event_id) VALUES ($1)", "own schema");
        assert_forbidden("SELECT * FROM inventory.stock", "own schema");
        assert_forbidden("SELECT * FROM \"Orders\".orders", "own schema");
        assert_forbidden("SELECT * FROM pg_authid", "catalogs");
        assert_forbidden("SELECT * FROM pg_catalog.pg_roles", "own schema");
        assert_forbidden("SELECT * FROM information_schema.tables", "own schema");
        assert_forbidden("SELECT x FROM a WHERE id IN (SELECT id FROM billing.t)", "own schema");
        assert_forbidden("SELECT other.f(1)", "pg_catalog and its own schema");
        assert_forbidden("SELECT * FROM db.orders.orders", "database part");
    }

    #[test]
    fn attribute_notation_is_refused_except_on_columns() {
        for sql in [
            "SELECT ('SELECT set_config(''role'', ''none'', true)').ts_stat::text",
            "SELECT (42).pg_advisory_lock",
            "SELECT ($1).pg_sleep",
            "SELECT (now()).x",
            "SELECT ((SELECT 1)).x",
        ] {
            assert_forbidden(sql, "attribute notation");
        }
        // On a column, a denied function's name is refused all the same.
        assert_forbidden("SELECT (n).pg_advisory_lock FROM counters", "pg_advisory_lock");
        assert_forbidden("SELECT c.pg_sleep FROM counters c", "pg_sleep");
        assert_forbidden("SELECT (c).lo_import FROM counters c", "lo_import");
        for sql in [
            "SELECT (c).name FROM counters c",
            "SELECT (o.address).city FROM orders o",
            "SELECT tags[1] FROM items",
            "SELECT o.id FROM orders o",
        ] {
            handler(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
        }
    }

    #[test]
    fn temporary_objects_are_refused() {
        for sql in [
            "CREATE TEMPORARY TABLE uuid (x int)",
            "CREATE TEMP TABLE t (x int)",
            "CREATE TEMP VIEW v AS SELECT 1",
            "CREATE TEMP SEQUENCE s",
        ] {
            match migration(sql) {
                Err(PolicyError::Forbidden(m)) => assert!(m.contains("temporary"), "{sql}: {m}"),
                other => panic!("{sql}: expected Forbidden, got {other:?}"),
            }
        }
        assert_forbidden("SELECT * FROM pg_temp.t", "own schema");
        assert_forbidden("SELECT * FROM pg_temp_3.t", "own schema");
    }

    #[test]
    fn size_and_shape_are_bounded_before_parsing() {
        let chain = |n: usize| format!("SELECT {}", vec!["1"; n].join("+"));
        assert_forbidden(&chain(50_000), "bytes");
        assert_forbidden(&chain(MAX_RUN_TOKENS), "too deeply");
        handler(&chain(MAX_RUN_TOKENS / 2 - 2)).unwrap();
        assert_forbidden(
            &format!("SELECT {}1{}", "(".repeat(MAX_NESTING), ")".repeat(MAX_NESTING)),
            "too deeply",
        );
        assert_forbidden(&format!("SELECT 1{}", "::int".repeat(600)), "too deeply");
        // Wide is fine: commas end a run.
        handler(&format!("SELECT {}", vec!["1 + 1"; 5000].join(", "))).unwrap();
        let values = vec!["(1, 'a', -1)"; 2000].join(", ");
        migration(&format!(
            "CREATE TABLE t (a int, b text, c int); INSERT INTO t VALUES {values}"
        ))
        .unwrap();
    }

    /// The deepest tree the bounds allow is checked, printed and dropped on a stack much
    /// smaller than what a Wasm host call has left (the fiber's 2 MiB, less the guest's
    /// at most 1 MiB).
    #[test]
    fn the_deepest_allowed_statement_fits_a_small_stack() {
        let worst = [
            format!("SELECT {}", vec!["1"; MAX_RUN_TOKENS / 2].join("+")),
            format!("SELECT 1{}", "::int".repeat(MAX_RUN_TOKENS / 3)),
            format!(
                "SELECT x FROM t WHERE {}",
                vec!["a = 1"; MAX_RUN_TOKENS / 4].join(" AND ")
            ),
            format!("SELECT {}1{}", "(".repeat(MAX_NESTING - 1), ")".repeat(MAX_NESTING - 1)),
        ];
        let checked = std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(move || worst.iter().map(|sql| handler(sql).is_ok()).collect::<Vec<_>>())
            .unwrap()
            .join()
            .expect("the check overflowed a 256 KiB stack");
        assert_eq!(checked.len(), 4);
    }

    #[test]
    fn garbage_is_invalid() {
        assert!(matches!(handler("SELEC 1"), Err(PolicyError::Invalid(_))));
        assert!(matches!(handler(""), Err(PolicyError::Invalid(_))));
    }

    /// One statement may not create thousands of indexes or sequences, each locked to the
    /// migration's end; a table with a few of each passes.
    #[test]
    fn a_migration_statement_creates_a_bounded_number_of_relations() {
        let many = |each: &dyn Fn(usize) -> String, n: usize| (0..n).map(each).collect::<Vec<_>>().join(", ");
        let columns = many(&|i| format!("c{i} int"), 70);
        let unique = |n| {
            format!(
                "CREATE TABLE t ({columns}, {})",
                many(&|i| format!("UNIQUE (c0, c{i})"), n)
            )
        };
        assert!(migration(&unique(MAX_RELATIONS_PER_STATEMENT)).is_ok());
        for sql in [
            unique(MAX_RELATIONS_PER_STATEMENT + 1),
            format!("CREATE TABLE t ({})", many(&|i| format!("c{i} bigserial"), 65)),
            format!("CREATE TABLE t ({})", many(&|i| format!("c{i} int UNIQUE"), 65)),
            format!(
                "CREATE TABLE t ({})",
                many(&|i| format!("c{i} int GENERATED ALWAYS AS IDENTITY"), 65)
            ),
            format!("ALTER TABLE t {}", many(&|i| format!("ADD UNIQUE (c0, c{i})"), 65)),
            format!("ALTER TABLE t {}", many(&|i| format!("ADD COLUMN d{i} serial"), 65)),
        ] {
            match migration(&sql) {
                Err(PolicyError::Forbidden(m)) => assert!(m.contains("indexes and sequences"), "{m}"),
                other => panic!("{}: expected Forbidden, got {other:?}", &sql[..60]),
            }
        }
        assert!(migration("CREATE TABLE t (id bigserial PRIMARY KEY, k text UNIQUE, n int)").is_ok());
    }

    #[test]
    fn migrations_allow_ddl_in_own_schema_only() {
        let stmts = migration(
            "CREATE TABLE orders (id uuid PRIMARY KEY, amount numeric(12,2) NOT NULL, \
             status text NOT NULL DEFAULT 'pending', created_at timestamptz NOT NULL DEFAULT now());\n\
             CREATE INDEX ix_orders_status ON orders(status);",
        )
        .unwrap();
        assert_eq!(stmts.len(), 2);
        for (sql, needle) in [
            ("CREATE TABLE public.t (id int)", "own schema"),
            (
                "CREATE FUNCTION f() RETURNS int AS 'select 1' LANGUAGE sql",
                "not allowed",
            ),
            (
                "CREATE TABLE t (id int DEFAULT (set_config('role','postgres',true))::int)",
                "set_config",
            ),
            ("GRANT SELECT ON orders TO PUBLIC", "GRANT"),
            ("CREATE SCHEMA x", "not allowed"),
            ("CREATE VIEW v AS SELECT * FROM obx.outbox_event", "own schema"),
            ("SET search_path = public", "SET"),
            ("BEGIN", "transaction control"),
        ] {
            match migration(sql) {
                Err(PolicyError::Forbidden(m)) => assert!(m.contains(needle), "{sql}: {m}"),
                other => panic!("{sql}: expected Forbidden, got {other:?}"),
            }
        }
    }
}
