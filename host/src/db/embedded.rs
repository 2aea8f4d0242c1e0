//! A throwaway Postgres cluster, started from the system's binaries in a temporary
//! directory. `obx serve` uses it when no database URL is configured, and the test harness
//! uses it when `DATABASE_URL` is not set. It is for trying OBX out and for tests: its data
//! is deleted when it stops.
//!
//! Invariants:
//! * The server never outlives the process that started it. It is spawned from a dedicated
//!   thread with `PR_SET_PDEATHSIG`, so even a SIGKILL of this process stops it.
//! * Connections over TCP authenticate with SCRAM passwords, as on a real server: the
//!   superuser's is random, and a plugin role's login is checked like anywhere else.

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// A running throwaway cluster. Dropping it stops the server and deletes its data.
pub struct EmbeddedPostgres {
    dir: tempfile::TempDir,
    port: u16,
    /// The password of the `postgres` superuser.
    password: String,
    pid: u32,
    bindir: PathBuf,
    settings: Vec<(String, String)>,
    run_as: Option<(u32, u32)>,
}

impl EmbeddedPostgres {
    /// Creates and starts a cluster on a free loopback port. `settings` are extra
    /// `-c name=value` server settings.
    pub fn start(settings: &[(&str, &str)]) -> Result<EmbeddedPostgres> {
        let bindir = find_bindir()?;
        let run_as = postgres_user_if_root()?;
        reap_stale_dirs();
        let dir = tempfile::Builder::new().prefix("obx-pg-").tempdir()?;
        if let Some((uid, gid)) = run_as {
            chown(dir.path(), uid, gid)?;
        }
        let data = dir.path().join("data");
        let password = uuid::Uuid::new_v4().simple().to_string();
        let pwfile = dir.path().join("pwfile");
        std::fs::write(&pwfile, &password)?;
        if let Some((uid, gid)) = run_as {
            chown(&pwfile, uid, gid)?;
        }

        let mut initdb = Command::new(bindir.join("initdb"));
        initdb
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "--auth-local=trust", "--auth-host=scram-sha-256"])
            .arg(format!("--pwfile={}", pwfile.display()))
            .args(["-E", "UTF8", "--no-sync"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some((uid, gid)) = run_as {
            initdb.uid(uid).gid(gid);
        }
        let out = initdb.output().context("running initdb")?;
        let _ = std::fs::remove_file(&pwfile);
        if !out.status.success() {
            bail!("initdb failed: {}", String::from_utf8_lossy(&out.stderr).trim());
        }

        let port = free_port()?;
        let settings: Vec<(String, String)> = settings.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let pid = spawn_server(&bindir, dir.path(), port, &settings, run_as)?;
        let pg = EmbeddedPostgres {
            dir,
            port,
            password,
            pid,
            bindir,
            settings,
            run_as,
        };
        pg.wait_ready(Duration::from_secs(30))?;
        Ok(pg)
    }

    /// Stops the server (fast shutdown: sessions are cut, open transactions roll back) and
    /// starts it again on the same data and port. For fault tests.
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        self.pid = spawn_server(&self.bindir, self.dir.path(), self.port, &self.settings, self.run_as)?;
        self.wait_ready(Duration::from_secs(30))
    }

    /// The URL of database `db` on this cluster, as the `postgres` superuser.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres:{}@127.0.0.1:{}/{db}", self.password, self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's log file, for diagnosing a failed start.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }

    fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            let status = Command::new(self.bindir.join("pg_isready"))
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", "postgres", "-q"])
                .status()
                .context("running pg_isready")?;
            if status.success() {
                return Ok(());
            }
            // SAFETY: signal 0 only checks that the process exists.
            if unsafe { libc::kill(self.pid as i32, 0) } != 0 {
                let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
                bail!("postgres exited during start-up:\n{log}");
            }
            if start.elapsed() > timeout {
                bail!("postgres did not become ready within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the server (fast shutdown) and waits for it to exit.
    pub fn stop(&self) {
        // SAFETY: plain signal to our own child.
        unsafe { libc::kill(self.pid as i32, libc::SIGINT) };
        let start = Instant::now();
        while unsafe { libc::kill(self.pid as i32, 0) } == 0 && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for EmbeddedPostgres {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Makes `user` the owner of a new database `db`, as a host should run (see
/// [`create_host_user`]). `admin_url` is a superuser's. Returns the URL of `db` as `user`.
pub async fn create_owner(admin_url: &str, user: &str, password: &str, db: &str) -> Result<String> {
    use sqlx::Connection;
    let mut admin = sqlx::PgConnection::connect(admin_url)
        .await
        .context("connecting as the superuser")?;
    create_host_user(&mut admin, user, password).await?;
    create_database(&mut admin, db, user).await?;
    let base = admin_url.rsplit_once('@').map(|(_, rest)| rest).unwrap_or(admin_url);
    let host = base.split('/').next().unwrap_or(base);
    Ok(format!("postgres://{user}:{password}@{host}/{db}"))
}

/// Creates (or updates) the login role a host runs as: `CREATEROLE` and no superuser
/// rights, allowed to set `temp_file_limit` for the roles it creates. `admin` is a
/// superuser's connection.
pub async fn create_host_user(admin: &mut sqlx::PgConnection, user: &str, password: &str) -> Result<()> {
    let user_q = quote_ident(user);
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)")
        .bind(user)
        .fetch_one(&mut *admin)
        .await?;
    let verifier = super::scram::verifier(password);
    let verb = if exists { "ALTER" } else { "CREATE" };
    for sql in [
        format!("{verb} ROLE {user_q} LOGIN CREATEROLE NOSUPERUSER PASSWORD '{verifier}'"),
        format!("GRANT SET ON PARAMETER temp_file_limit TO {user_q}"),
    ] {
        match sqlx::Executor::execute(&mut *admin, sql.as_str()).await {
            Ok(_) => {}
            // Another process created the same role at the same moment.
            Err(sqlx::Error::Database(e)) if matches!(e.code().as_deref(), Some("42710" | "23505" | "XX000")) => {}
            Err(e) => return Err(e).with_context(|| format!("setting up the host's user {user}")),
        }
    }
    Ok(())
}

/// Creates database `db` owned by `owner`.
pub async fn create_database(admin: &mut sqlx::PgConnection, db: &str, owner: &str) -> Result<()> {
    let create = format!("CREATE DATABASE {} OWNER {}", quote_ident(db), quote_ident(owner));
    sqlx::Executor::execute(&mut *admin, create.as_str())
        .await
        .with_context(|| format!("creating database {db}"))?;
    Ok(())
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Removes the directories of throwaway clusters whose server is gone: a process that was
/// killed, or a test process (whose cluster lives in a static), leaves its directory behind.
/// Only directories older than ten minutes are touched, so a cluster being created by
/// another process right now is left alone.
fn reap_stale_dirs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let is_ours = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("obx-pg-"));
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().unwrap_or_default() > Duration::from_secs(600));
        if !is_ours || !old {
            continue;
        }
        let pid = std::fs::read_to_string(path.join("data/postmaster.pid"))
            .ok()
            .and_then(|s| s.lines().next().and_then(|l| l.trim().parse::<i32>().ok()));
        // SAFETY: signal 0 only checks that the process exists.
        let alive = pid.is_some_and(|pid| unsafe { libc::kill(pid, 0) } == 0);
        if !alive {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

fn spawn_server(
    bindir: &Path,
    dir: &Path,
    port: u16,
    settings: &[(String, String)],
    run_as: Option<(u32, u32)>,
) -> Result<u32> {
    let mut server = Command::new(bindir.join("postgres"));
    server
        .arg("-D")
        .arg(dir.join("data"))
        .arg("-p")
        .arg(port.to_string())
        .arg("-k")
        .arg(dir)
        .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
        .args(["-c", "full_page_writes=off", "-c", "max_connections=200"]);
    for (name, value) in settings {
        server.arg("-c").arg(format!("{name}={value}"));
    }
    server.stdin(Stdio::null()).stdout(Stdio::null());
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("server.log"))?;
    server.stderr(log);
    if let Some((uid, gid)) = run_as {
        server.uid(uid).gid(gid);
    }
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        server.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGQUIT) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    spawn_from_keeper_thread(server)
}

/// Spawns `cmd` from a thread that lives exactly as long as the child, and reaps it.
/// `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, so the child
/// must not be spawned from a short-lived thread (a tokio blocking thread, a test thread).
fn spawn_from_keeper_thread(mut cmd: Command) -> Result<u32> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("obx-pg-keeper".into())
        .spawn(move || match cmd.spawn() {
            Ok(mut child) => {
                let _ = tx.send(Ok(child.id()));
                let _ = child.wait();
            }
            Err(e) => {
                let _ = tx.send(Err(e));
            }
        })?;
    rx.recv().context("keeper thread died")?.context("spawning postgres")
}

/// Finds the directory of `initdb`/`postgres`: `$OBX_PG_BINDIR`, then `pg_config --bindir`,
/// then the newest `/usr/lib/postgresql/*/bin` (Debian and Ubuntu).
pub fn find_bindir() -> Result<PathBuf> {
    if let Ok(dir) = std::env::var("OBX_PG_BINDIR") {
        return Ok(PathBuf::from(dir));
    }
    let mut candidates = Vec::new();
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        if out.status.success() {
            candidates.push(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
        }
    }
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        let mut versions: Vec<(u32, PathBuf)> = entries
            .flatten()
            .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
            .collect();
        versions.sort();
        candidates.extend(versions.into_iter().rev().map(|(_, p)| p));
    }
    candidates
        .into_iter()
        .find(|d| d.join("initdb").exists() && d.join("postgres").exists())
        .context(
            "no Postgres server binaries found (looked at $OBX_PG_BINDIR, pg_config --bindir and \
             /usr/lib/postgresql/*/bin). Install them (`apt-get install postgresql`) or set \
             DATABASE_URL to an existing server",
        )
}

/// Postgres refuses to run as root; when we are root, run it as the `postgres` user.
fn postgres_user_if_root() -> Result<Option<(u32, u32)>> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    // Looked up once: `getpwnam` parses each passwd entry into one static record, so a
    // second thread's lookup (tests start clusters in parallel) could read another user's ids
    // from it, and initdb then failed as that user.
    static POSTGRES: std::sync::OnceLock<Option<(u32, u32)>> = std::sync::OnceLock::new();
    let ids = *POSTGRES.get_or_init(|| {
        let name = std::ffi::CString::new("postgres").unwrap();
        // SAFETY: getpwnam returns a pointer into static storage or null; it is read at once,
        // and only here, once.
        let pw = unsafe { libc::getpwnam(name.as_ptr()) };
        // SAFETY: pw, when non-null, points to a valid passwd record.
        (!pw.is_null()).then(|| unsafe { ((*pw).pw_uid, (*pw).pw_gid) })
    });
    match ids {
        Some(ids) => Ok(Some(ids)),
        None => bail!("running as root, and there is no `postgres` user to run the server as"),
    }
}

fn chown(path: &Path, uid: u32, gid: u32) -> Result<()> {
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).with_context(|| format!("chown {}", path.display()))
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}
