//! How the host logs in as a plugin's role: the role's password, created and rotated here.
//!
//! The password is random, stored in `obx.plugin_credential` (which only the host can read),
//! and sent to the server as a SCRAM verifier, so it never travels or is logged in clear
//! text. A plugin that got SQL past the policy can change its own role's password (Postgres
//! lets every role do that): the host then fails to log in, and sets a new one
//! ([`rotate`]). Postgres caps the role's sessions (`CONNECTION LIMIT`), which the plugin
//! cannot change, so a login it took over cannot use up the server's connections.

use anyhow::{Context, Result};
use sqlx::PgConnection;

// Role names were validated as `obx_<hex>_[a-z0-9_]*`, so quoting them is enough.
use super::ddl;

/// How a plugin's role logs in, and the settings its sessions start with.
#[derive(Clone, PartialEq, Eq)]
pub struct Login {
    pub role: String,
    pub password: String,
    /// The role's own settings again, as startup options: they come after any the database
    /// URL carries, so the URL cannot loosen them.
    pub settings: Vec<(&'static str, String)>,
    /// The longest a commit's round trip may take before the host ends its backend.
    /// Postgres times no part of a `COMMIT`: `statement_timeout` is off while the deferred
    /// triggers it runs execute, and those are plugin code.
    pub commit_within: std::time::Duration,
}

impl std::fmt::Debug for Login {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Login")
            .field("role", &self.role)
            .finish_non_exhaustive()
    }
}

/// Creates the plugin's login role if needed (with at most `connection_limit` sessions), makes
/// the host a member of it, and returns its password.
pub async fn ensure_role(conn: &mut PgConnection, role: &str, connection_limit: u32) -> Result<String> {
    let stored: Option<String> = sqlx::query_scalar("SELECT password FROM obx.plugin_credential WHERE role_name = $1")
        .bind(role)
        .fetch_optional(&mut *conn)
        .await?;
    let limit: Option<i32> = sqlx::query_scalar("SELECT rolconnlimit FROM pg_catalog.pg_roles WHERE rolname = $1")
        .bind(role)
        .fetch_optional(&mut *conn)
        .await?;
    let password = match (stored, limit) {
        (Some(password), Some(_)) => password,
        (_, Some(_)) => rotate(conn, role).await?,
        (_, None) => create(conn, role).await?,
    };
    if limit != Some(connection_limit as i32) {
        ddl(
            conn,
            &format!("ALTER ROLE \"{role}\" CONNECTION LIMIT {connection_limit}"),
        )
        .await?;
    }
    // The host needs the role's privileges, not only a membership. The plugin's role is a
    // member of nothing.
    super::reclaim_privileges(conn, &[role.to_string()])
        .await
        .with_context(|| format!("granting the host the privileges of {role}"))?;
    Ok(password)
}

/// What [`renew`] came to.
pub enum Renewed {
    /// Another host set this one since the caller's `known`.
    Taken(String),
    /// This one was set now.
    Set(String),
    /// The stored one is still the caller's, and it could not set another.
    Kept,
}

/// Takes the stored password of `role` if it is no longer `known` (another host set one
/// since), or else sets a new one if `may_set`. The stored row is locked meanwhile, so that
/// hosts refused at once take turns: each set one in turn, undoing the one before, and the
/// hosts went on setting new ones, a minute apart each, for as long as they ran.
pub async fn renew(conn: &mut PgConnection, role: &str, known: &str, may_set: bool) -> Result<Renewed> {
    use sqlx::Connection;
    let mut tx = conn.begin().await?;
    let stored: Option<String> =
        sqlx::query_scalar("SELECT password FROM obx.plugin_credential WHERE role_name = $1 FOR UPDATE")
            .bind(role)
            .fetch_optional(&mut *tx)
            .await?;
    if let Some(stored) = stored.filter(|s| s != known) {
        return Ok(Renewed::Taken(stored));
    }
    if !may_set {
        return Ok(Renewed::Kept);
    }
    let password = rotate(&mut tx, role).await?;
    tx.commit().await?;
    Ok(Renewed::Set(password))
}

/// Gives `role` a new random password, and stores it.
pub async fn rotate(conn: &mut PgConnection, role: &str) -> Result<String> {
    let password = random_password();
    let verifier = super::scram::verifier(&password);
    ddl(conn, &format!("ALTER ROLE \"{role}\" LOGIN PASSWORD '{verifier}'")).await?;
    store(conn, role, &password).await?;
    Ok(password)
}

async fn create(conn: &mut PgConnection, role: &str) -> Result<String> {
    let password = random_password();
    let verifier = super::scram::verifier(&password);
    ddl(
        conn,
        &format!("CREATE ROLE \"{role}\" LOGIN NOINHERIT NOCREATEDB NOCREATEROLE NOREPLICATION PASSWORD '{verifier}'"),
    )
    .await
    .context("the host's database user needs CREATEROLE")?;
    store(conn, role, &password).await?;
    Ok(password)
}

async fn store(conn: &mut PgConnection, role: &str, password: &str) -> Result<()> {
    sqlx::query(
        "INSERT INTO obx.plugin_credential (role_name, password) VALUES ($1, $2) \
         ON CONFLICT (role_name) DO UPDATE SET password = EXCLUDED.password",
    )
    .bind(role)
    .bind(password)
    .execute(conn)
    .await?;
    Ok(())
}

/// 64 hex digits from two random UUIDs: 244 random bits.
fn random_password() -> String {
    let mut out = String::with_capacity(64);
    while out.len() < 64 {
        out.push_str(&uuid::Uuid::new_v4().simple().to_string());
    }
    out.truncate(64);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_long_and_hex() {
        let p = random_password();
        assert_eq!(p.len(), 64);
        assert!(p.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(p, random_password());
    }
}
