//! Postgres over TLS: the `sslmode` family of URL parameters reaches the connection, a
//! verified connection is encrypted, and a server whose certificate the configured CA did
//! not sign is refused. The certificates are made here with the `openssl` command.

use std::path::Path;
use std::process::Command;

use obx::config::DatabaseConfig;
use obx::db::embedded::EmbeddedPostgres;

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("running openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA, and a certificate for localhost signed by it.
fn certificates(dir: &Path) {
    let subject_alt = dir.join("san.ext");
    std::fs::write(&subject_alt, "subjectAltName=DNS:localhost,IP:127.0.0.1\n").unwrap();
    for ca in ["ca", "other-ca"] {
        openssl(
            dir,
            &[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                "-subj",
                &format!("/CN=obx test {ca}"),
                "-keyout",
                &format!("{ca}.key"),
                "-out",
                &format!("{ca}.pem"),
            ],
        );
    }
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            "server.pem",
            "-extfile",
            "san.ext",
        ],
    );
    // The server runs as `postgres` when the tests run as root: it must read its key, and
    // Postgres wants the key private to its owner.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(dir.join("server.key"), std::fs::Permissions::from_mode(0o600)).unwrap();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        let ok = Command::new("chown")
            .args(["postgres:postgres"])
            .arg(dir.join("server.key"))
            .status()
            .unwrap()
            .success();
        assert!(ok, "chown of the server key");
    }
}

#[tokio::test]
async fn postgres_over_tls_is_verified_and_encrypted() {
    let dir = tempfile::tempdir().unwrap();
    certificates(dir.path());
    let file = |name: &str| dir.path().join(name).display().to_string();
    let pg = EmbeddedPostgres::start(&[
        ("ssl", "on"),
        ("ssl_cert_file", &file("server.pem")),
        ("ssl_key_file", &file("server.key")),
    ])
    .unwrap();
    let base = pg.url("postgres").replace("127.0.0.1", "localhost");
    let config = DatabaseConfig::default();

    for mode in [
        format!("sslmode=verify-full&sslrootcert={}", file("ca.pem")),
        format!("sslmode=verify-ca&sslrootcert={}", file("ca.pem")),
        "sslmode=require".to_string(),
    ] {
        let pool = obx::db::connect(&format!("{base}?{mode}"), &config)
            .await
            .unwrap_or_else(|e| panic!("{mode}: {e:#}"));
        let encrypted: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert!(encrypted, "{mode}: the connection is not encrypted");
        pool.close().await;
    }

    // A CA that did not sign the server's certificate: refused, with a message that says so.
    let wrong = format!("{base}?sslmode=verify-full&sslrootcert={}", file("other-ca.pem"));
    let e = format!("{:#}", obx::db::connect(&wrong, &config).await.unwrap_err());
    assert!(e.contains("connecting to Postgres"), "{e}");
    assert!(e.to_lowercase().contains("certificate") || e.contains("tls"), "{e}");
}
