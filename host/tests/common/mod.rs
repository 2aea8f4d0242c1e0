//! What the tests that run the `obx` binary share. Each test binary uses part of it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The compiled component of test or example plugin `name` (file name with underscores).
pub fn plugin(name: &str) -> PathBuf {
    let dir = std::env::var_os("OBX_TEST_PLUGINS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugins/target/wasm32-wasip2/release"));
    let path = dir.join(format!("{name}.wasm"));
    assert!(
        path.exists(),
        "{} is missing: build the plugins with `cargo xtask test`",
        path.display()
    );
    path
}

/// Waits until `GET {base}/readyz` answers 200; panics after `limit`.
pub async fn wait_ready(client: &reqwest::Client, base: &str, limit: Duration) {
    let started = Instant::now();
    loop {
        if let Ok(r) = client.get(format!("{base}/readyz")).send().await {
            if r.status() == 200 {
                return;
            }
        }
        assert!(started.elapsed() < limit, "the host did not become ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The `obx` binary, with nothing of the environment's configuration: no `DATABASE_URL`,
/// no `OBX_CONFIG`, no OpenTelemetry endpoint.
pub fn obx() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_obx"));
    cmd.env_remove("DATABASE_URL")
        .env_remove("OBX_CONFIG")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .env("RUST_LOG", "info");
    cmd
}

/// A child process killed when the test ends, even by a failed assertion (a host left
/// running would hold the test's output pipe open).
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A host that `obx serve` runs.
pub struct Served {
    pub child: KillOnDrop,
    /// Its log lines, collected until it exits.
    pub log: std::thread::JoinHandle<Vec<String>>,
    pub base: String,
    pub _plugins: tempfile::TempDir,
}

/// `obx serve` on the embedded default with `args`, serving the orders plugin on a free port.
pub fn serve(args: &[&str]) -> Served {
    serve_with(args, &["orders"], &[])
}

/// `obx serve` on the embedded default with `args` and `env`, serving `plugins` (the
/// compiled test and example plugins of those names) on a free port.
pub fn serve_with(args: &[&str], plugins: &[&str], env: &[(&str, &str)]) -> Served {
    let dir = tempfile::tempdir().unwrap();
    for name in plugins {
        std::fs::copy(plugin(name), dir.path().join(format!("{name}.wasm"))).unwrap();
    }
    serve_dir(args, dir, env)
}

/// `obx serve` on the embedded default with `args` and `env`, serving the plugin
/// directory `dir` on a free port.
pub fn serve_dir(args: &[&str], dir: tempfile::TempDir, env: &[(&str, &str)]) -> Served {
    serve_adjusted(args, dir, env, |_| {})
}

/// [`serve_dir`], with `adjust` given the command before it is spawned.
pub fn serve_adjusted(
    args: &[&str],
    dir: tempfile::TempDir,
    env: &[(&str, &str)],
    adjust: impl FnOnce(&mut Command),
) -> Served {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut command = obx();
    command
        .args(args)
        .arg("serve")
        .env("OBX_HTTP__LISTEN", format!("127.0.0.1:{port}"))
        .env("OBX_PLUGINS__DIR", dir.path())
        .envs(env.iter().copied())
        .stderr(Stdio::piped());
    adjust(&mut command);
    let mut child = KillOnDrop(command.spawn().unwrap());
    let stderr = child.0.stderr.take().unwrap();
    let log = std::thread::spawn(move || BufReader::new(stderr).lines().map_while(Result::ok).collect::<Vec<_>>());
    Served {
        child,
        log,
        base: format!("http://127.0.0.1:{port}"),
        _plugins: dir,
    }
}

/// Sends SIGTERM and waits (15 s at most) for the host to stop: its exit status.
pub fn stop(child: &mut KillOnDrop) -> std::process::ExitStatus {
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
    let stopping = Instant::now();
    loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            return status;
        }
        assert!(
            stopping.elapsed() < Duration::from_secs(15),
            "the host did not stop on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The fenced blocks of `markdown` in `language`, dedented by their fence's indentation.
pub fn blocks(markdown: &str, language: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut current: Option<(usize, Vec<String>)> = None;
    for line in markdown.lines() {
        let indent = line.len() - line.trim_start().len();
        let fence = line.trim_start();
        match &mut current {
            None if fence == format!("```{language}") => current = Some((indent, Vec::new())),
            Some((_, lines)) if fence == "```" => {
                found.push(lines.join("\n") + "\n");
                current = None;
            }
            Some((indent, lines)) => lines.push(line.get(*indent..).unwrap_or("").to_string()),
            None => {}
        }
    }
    assert!(current.is_none(), "an unclosed ```{language} block");
    found
}

/// Runs `cmd` and returns its stdout and stderr; panics with both when it fails.
pub fn run(what: &str, cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{what} failed ({}):\n{text}", out.status);
    text
}
