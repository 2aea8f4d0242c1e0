//! Developer commands, run as `cargo xtask <command>`:
//!
//! * `run`  — builds the example plugins and runs `obx serve` with them. Without a
//!   `DATABASE_URL`, the host starts a throwaway Postgres.
//! * `test` — builds the plugins and runs the whole test suite.
//! * `plugins` — builds the plugins only.
//! * `bench` — the benchmarks (docs/benchmarks.md).
//! * `chaos` — the fault-injection suite (docs/reliability.md).
//! * `broker` — installs the Kafka-protocol broker the tests also run against (tansu), once.
//!
//! Each first makes sure what it needs is installed: the `wasm32-wasip2` target, and the
//! Postgres server binaries (from the system's packages, when missing).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Build the example plugins and run the host with them.
    Run {
        /// Build the host with optimisations.
        #[arg(long)]
        release: bool,
        /// Arguments passed on to `obx serve`.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Build the plugins and run every test.
    Test {
        /// Arguments passed on to `cargo test`, e.g. a test name filter.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Build the plugins (wasm32-wasip2 components).
    Plugins,
    /// Run the benchmarks (release build); see docs/benchmarks.md.
    Bench {
        /// Arguments passed on to obx-bench, e.g. `relay --rows 100000`.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Install tansu, the broker `test` also runs the Kafka tests against (once; about 11
    /// minutes on 2 cores), unless `test` would not start it (`KAFKA_BROKERS` or
    /// `OBX_SKIP_EXTERNAL_BROKER` set). `test` installs it when missing; CI installs it first,
    /// so that building it does not count against the test step's time.
    Broker,
    /// Run the fault-injection suite (release build); see docs/reliability.md.
    Chaos {
        /// Arguments passed on to obx-chaos, e.g. `--kills 40 --report chaos.md`.
        #[arg(last = true)]
        args: Vec<String>,
    },
}

/// The plugins `cargo xtask run` serves.
const EXAMPLE_PLUGINS: &[&str] = &["orders", "inventory", "payments", "shipping", "notifications"];

fn main() -> Result<()> {
    let cli = Cli::parse();
    let root = workspace_root();
    match cli.command {
        Task::Plugins => build_plugins(&root).map(drop),
        Task::Broker if std::env::var_os("OBX_SKIP_EXTERNAL_BROKER").is_some() => Ok(()),
        Task::Broker if std::env::var("KAFKA_BROKERS").is_ok_and(|b| !b.is_empty()) => Ok(()),
        Task::Broker => ensure_tansu(),
        Task::Test { args } => {
            ensure_postgres()?;
            ensure_command("kcat", "kcat")?;
            ensure_interop(&root)?;
            let plugins = build_plugins(&root)?;
            let mut cmd = cargo();
            cmd.current_dir(&root)
                .args(["test", "--workspace", "--no-fail-fast"])
                .args(&args);
            cmd.env("OBX_TEST_PLUGINS_DIR", &plugins);
            // For `obx plugin new --lang python` (host/tests/plugin_new.rs).
            cmd.env(
                "COMPONENTIZE_PY",
                componentize_py(&plugins_target(&root.join("plugins"))),
            );
            let in_process = run(&mut cmd);
            // The Kafka tests again, against a broker outside the process: the one in
            // KAFKA_BROKERS, or a tansu started here (OBX_SKIP_EXTERNAL_BROKER=1 skips this).
            let external = if std::env::var_os("OBX_SKIP_EXTERNAL_BROKER").is_some() || !args.is_empty() {
                Ok(())
            } else {
                external_broker_tests(&root, &plugins)
            };
            in_process.and(external)
        }
        Task::Bench { args } => {
            ensure_postgres()?;
            // The profile suite samples with perf; without it, the report says so and goes on.
            if let Err(e) = ensure_command("perf", "linux-perf") {
                eprintln!("perf is not available ({e:#}): the report has no CPU breakdown");
            }
            // The HTTP suite's load generator.
            ensure_command("wrk", "wrk")?;
            let plugins = build_plugins(&root)?;
            build_extra_plugins(&root, &plugins)?;
            let args = if args.is_empty() {
                vec!["report".to_string()]
            } else {
                args
            };
            run_release_tool(&root, &plugins, "obx-bench", &args)
        }
        Task::Chaos { mut args } => {
            ensure_postgres()?;
            let plugins = build_plugins(&root)?;
            if args.iter().any(|a| a == "tansu" || a == "--broker=tansu")
                && !args.iter().any(|a| a.starts_with("--tansu=") || a == "--tansu")
            {
                // A tansu that can keep its data in SQLite, so that the suite can restart it.
                let tansu = ensure_tansu_with_sqlite()?;
                args.extend(["--tansu".to_string(), tansu.display().to_string()]);
            }
            run_release_tool(&root, &plugins, "obx-chaos", &args)
        }
        Task::Run { release, args } => {
            ensure_postgres()?;
            let built = build_plugins(&root)?;
            let dir = root.join("target/obx-run/plugins.d");
            std::fs::create_dir_all(&dir)?;
            for name in EXAMPLE_PLUGINS {
                let file = format!("{name}.wasm");
                // Copy to a temporary name, then rename: the host never sees half a file.
                let tmp = dir.join(format!(".{file}.tmp"));
                std::fs::copy(built.join(&file), &tmp)?;
                std::fs::rename(&tmp, dir.join(&file))?;
            }
            println!("serving {} from {}", EXAMPLE_PLUGINS.join(", "), dir.display());
            let mut cmd = cargo();
            cmd.current_dir(&root).args(["run", "--package", "obx"]);
            if release {
                cmd.arg("--release");
            }
            cmd.args(["--", "serve"]).args(&args).env("OBX_PLUGINS__DIR", &dir);
            run(&mut cmd)
        }
    }
}

/// Runs the relay, delayed-event and consumption tests against an external broker.
fn external_broker_tests(root: &Path, plugins: &Path) -> Result<()> {
    let mut tansu = None;
    let brokers = match std::env::var("KAFKA_BROKERS") {
        Ok(b) if !b.is_empty() => b,
        _ => {
            ensure_tansu()?;
            let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            let url = format!("tcp://127.0.0.1:{port}");
            let child = Command::new("tansu")
                .args(["broker", "--storage-engine", "memory://tansu/", "--listener-url", &url])
                .args(["--advertised-listener-url", &url])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .context("starting tansu")?;
            tansu = Some(child);
            wait_for_port(port)?;
            format!("127.0.0.1:{port}")
        }
    };
    println!("\n=== relay and consumption tests against the external broker at {brokers}");
    let result = run(cargo()
        .current_dir(root)
        .args([
            "test",
            "--package",
            "obx-tests",
            "--test",
            "relay",
            "--test",
            "delayed",
            "--test",
            "consume",
            "--no-fail-fast",
        ])
        .env("OBX_TEST_PLUGINS_DIR", plugins)
        .env("KAFKA_BROKERS", &brokers));
    if let Some(mut child) = tansu {
        let _ = child.kill();
        let _ = child.wait();
    }
    result
}

/// Builds `obx` and the tool `bin` of `tests/` (release), and runs the tool with `args`.
/// One build for both binaries: the same features, so nothing is built twice.
fn run_release_tool(root: &Path, plugins: &Path, bin: &str, args: &[String]) -> Result<()> {
    run(cargo().current_dir(root).args([
        "build",
        "--release",
        "--package",
        "obx",
        "--package",
        "obx-tests",
        "--bin",
        "obx",
        "--bin",
        bin,
    ]))?;
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(|d| root.join(d))
        .unwrap_or_else(|| root.join("target"));
    let mut cmd = Command::new(target.join("release").join(bin));
    cmd.current_dir(root).args(args).env("OBX_TEST_PLUGINS_DIR", plugins);
    run(&mut cmd)
}

/// Copies of `hotswap` under other names, so that the memory benchmark can load ten
/// distinct plugins.
fn build_extra_plugins(root: &Path, out: &Path) -> Result<()> {
    let plugins = root.join("plugins");
    let target = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => plugins.join(dir),
        None => plugins.join("target"),
    };
    for name in ["bench_extra_a", "bench_extra_b", "bench_extra_c"] {
        // A target directory per name: Cargo does not rebuild when only the variable read
        // by `option_env!` changes.
        let named = target.join("variants").join(name);
        run(cargo()
            .current_dir(&plugins)
            .args([
                "build",
                "--release",
                "--target",
                "wasm32-wasip2",
                "--package",
                "hotswap",
            ])
            .arg("--target-dir")
            .arg(&named)
            .env("OBX_HOTSWAP_NAME", name))?;
        std::fs::copy(
            named.join("wasm32-wasip2/release/hotswap.wasm"),
            out.join(format!("{name}.wasm")),
        )?;
    }
    Ok(())
}

/// tansu, an Apache Kafka–compatible broker, built from crates.io once (about 11 minutes).
fn ensure_tansu() -> Result<()> {
    if on_path("tansu") {
        return Ok(());
    }
    eprintln!("installing tansu (cargo install, about 11 minutes on 2 cores; once)");
    run(cargo().args(["install", "tansu", "--locked", "--features", "dynostore,postgres"]))
}

/// tansu built with SQLite storage as well (the `libsql` feature), installed once into
/// `~/.cache/obx/tansu-sqlite`, apart from the `tansu` on the PATH.
fn ensure_tansu_with_sqlite() -> Result<PathBuf> {
    let home = std::env::var_os("HOME").context("HOME is not set")?;
    let root = PathBuf::from(home).join(".cache/obx/tansu-sqlite");
    let binary = root.join("bin/tansu");
    if binary.exists() {
        return Ok(binary);
    }
    eprintln!("installing tansu with SQLite storage (cargo install, about 15 minutes on 2 cores; once)");
    run(cargo()
        .args([
            "install",
            "tansu",
            "--locked",
            "--features",
            "dynostore,postgres,libsql",
            "--root",
        ])
        .arg(&root))?;
    Ok(binary)
}

fn wait_for_port(port: u16) -> Result<()> {
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    bail!("nothing listens on port {port}")
}

/// kafkajs, for the interop test: a producer as services following the seed use.
fn ensure_interop(root: &Path) -> Result<()> {
    let dir = root.join("tests/interop");
    if dir.join("node_modules/kafkajs").exists() && dir.join("node_modules/@asyncapi/parser").exists() {
        return Ok(());
    }
    if !on_path("npm") {
        apt_install(&["nodejs", "npm"])?;
    }
    run(Command::new("npm")
        .current_dir(&dir)
        .args(["ci", "--no-audit", "--no-fund"]))
}

fn on_path(command: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|paths| std::env::split_paths(&paths).any(|p| p.join(command).exists()))
}

/// The workspace this run is for. `cargo run` says where the package is at run time; the
/// path compiled in is only a fallback, since two checkouts that share a target directory
/// share one `xtask` binary, built from whichever ran last.
fn workspace_root() -> PathBuf {
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest_dir
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// Builds every guest plugin and returns the directory of the `.wasm` files. The hot-reload
/// tests also need other builds of the `hotswap` plugin; they land beside the rest as
/// `hotswap_<variant>.wasm`.
fn build_plugins(root: &Path) -> Result<PathBuf> {
    ensure_wasm_target()?;
    let plugins = root.join("plugins");
    run(cargo()
        .current_dir(&plugins)
        .args(["build", "--release", "--target", "wasm32-wasip2"]))?;
    let target = plugins_target(&plugins);
    let out = target.join("wasm32-wasip2/release");
    for (feature, name) in [
        ("v2", "hotswap_v2"),
        ("broken-migration", "hotswap_broken"),
        ("bad-manifest", "hotswap_bad_manifest"),
        ("amplified-manifest", "hotswap_amplified"),
        ("sleepy-describe", "hotswap_sleepy"),
    ] {
        let variant_target = target.join("variants").join(feature);
        run(cargo()
            .current_dir(&plugins)
            .args([
                "build",
                "--release",
                "--target",
                "wasm32-wasip2",
                "--package",
                "hotswap",
            ])
            .args(["--no-default-features", "--features", feature])
            .arg("--target-dir")
            .arg(&variant_target))?;
        std::fs::copy(
            variant_target.join("wasm32-wasip2/release/hotswap.wasm"),
            out.join(format!("{name}.wasm")),
        )?;
    }
    build_python_plugin(&plugins.join("shipping-py"), &target, &out.join("shipping.wasm"))?;
    build_js_plugin(&plugins.join("notifications-js"), &out.join("notifications.wasm"))?;
    Ok(out)
}

/// The componentize-py release the Python plugins are built with.
const COMPONENTIZE_PY: &str = "componentize-py==0.25.1";

/// The componentize-py that [`build_python_plugin`] installs under `target`.
fn componentize_py(target: &Path) -> PathBuf {
    target.join("tools/python/bin/componentize-py")
}

/// The target directory the plugins build in.
fn plugins_target(plugins: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => plugins.join(dir),
        None => plugins.join("target"),
    }
}

/// Builds a Python plugin with componentize-py, installed from PyPI into a virtualenv of
/// the target directory the first time. Skipped when the component was built from the same
/// source.
fn build_python_plugin(dir: &Path, target: &Path, out: &Path) -> Result<()> {
    // Installed even when the component is fresh: the guide's and `plugin new`'s tests use it.
    let venv = target.join("tools/python");
    let tool = componentize_py(target);
    if !tool.exists() {
        let python = if on_path("python3") { "python3" } else { "python" };
        if run(Command::new(python).arg("-m").arg("venv").arg(&venv)).is_err() {
            apt_install(&["python3-venv"])?;
            run(Command::new("python3").arg("-m").arg("venv").arg(&venv))?;
        }
        run(Command::new(venv.join("bin/pip")).args(["install", "--quiet", COMPONENTIZE_PY]))?;
    }
    let stamp = Stamp::of(out, &[&dir.join("app.py"), &dir.join("../../wit/obx.wit")])?;
    if stamp.is_fresh() {
        return Ok(());
    }
    run(Command::new(tool)
        .current_dir(dir)
        .args([
            "-d",
            "../../wit",
            "-w",
            "obx:plugin/plugin",
            "componentize",
            "app",
            "-o",
        ])
        .arg(out))?;
    stamp.record()
}

/// Builds a JavaScript plugin with ComponentizeJS, installed from npm (`npm ci`) the first
/// time. Skipped when the component was built from the same source (the install is not).
fn build_js_plugin(dir: &Path, out: &Path) -> Result<()> {
    // Installed even when the component is fresh: the guide's test builds with it too.
    if !dir.join("node_modules/.bin/componentize-js").exists() {
        if !on_path("npm") {
            apt_install(&["nodejs", "npm"])?;
        }
        run(Command::new("npm")
            .current_dir(dir)
            .args(["ci", "--no-audit", "--no-fund"]))?;
    }
    let stamp = Stamp::of(out, &[&dir.join("app.js"), &dir.join("../../wit/obx.wit")])?;
    if stamp.is_fresh() {
        return Ok(());
    }
    run(Command::new(dir.join("node_modules/.bin/componentize-js"))
        .current_dir(dir)
        .args(["app.js", "--wit", "../../wit", "--world-name", "plugin"])
        .args(["-d", "stdio", "random", "clocks", "http", "fetch-event", "-o"])
        .arg(out))?;
    stamp.record()
}

/// What a component was built from: a digest of its inputs' contents, kept beside it. Not
/// their times: two checkouts that share a target directory write the same component file.
struct Stamp {
    file: PathBuf,
    digest: String,
    output_exists: bool,
}

impl Stamp {
    fn of(output: &Path, inputs: &[&Path]) -> Result<Stamp> {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        for input in inputs {
            std::fs::read(input)
                .with_context(|| format!("reading {}", input.display()))?
                .hash(&mut hasher);
        }
        let mut file = output.as_os_str().to_owned();
        file.push(".inputs");
        Ok(Stamp {
            file: PathBuf::from(file),
            digest: format!("{:016x}", hasher.finish()),
            output_exists: output.exists(),
        })
    }

    fn is_fresh(&self) -> bool {
        self.output_exists && std::fs::read_to_string(&self.file).is_ok_and(|d| d.trim() == self.digest)
    }

    fn record(&self) -> Result<()> {
        std::fs::write(&self.file, &self.digest).with_context(|| format!("writing {}", self.file.display()))
    }
}

fn ensure_wasm_target() -> Result<()> {
    let out = Command::new("rustup").args(["target", "list", "--installed"]).output();
    match out {
        Ok(out)
            if String::from_utf8_lossy(&out.stdout)
                .lines()
                .any(|l| l.trim() == "wasm32-wasip2") =>
        {
            Ok(())
        }
        Ok(_) => run(Command::new("rustup").args(["target", "add", "wasm32-wasip2"])),
        Err(_) => {
            // No rustup: assume the toolchain has the target, and let cargo say otherwise.
            eprintln!("warning: rustup not found; assuming wasm32-wasip2 is installed");
            Ok(())
        }
    }
}

/// The host starts a throwaway Postgres from the system's binaries when no database URL is
/// given; install them if they are missing (Debian and Ubuntu).
fn ensure_postgres() -> Result<()> {
    let found = std::fs::read_dir("/usr/lib/postgresql")
        .map(|dirs| dirs.flatten().any(|d| d.path().join("bin/initdb").exists()))
        .unwrap_or(false);
    if found || std::env::var_os("OBX_PG_BINDIR").is_some() {
        return Ok(());
    }
    apt_install(&["postgresql"])
}

/// Installs `package` when `command` is not on the PATH.
fn ensure_command(command: &str, package: &str) -> Result<()> {
    let found =
        std::env::var_os("PATH").is_some_and(|paths| std::env::split_paths(&paths).any(|p| p.join(command).exists()));
    if found {
        return Ok(());
    }
    apt_install(&[package])
}

fn apt_install(packages: &[&str]) -> Result<()> {
    eprintln!("installing {} with apt-get", packages.join(" "));
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc_geteuid() } == 0;
    let apt = |args: &[&str]| -> Result<()> {
        let mut cmd = if root {
            Command::new("apt-get")
        } else {
            Command::new("sudo")
        };
        if !root {
            cmd.arg("apt-get");
        }
        run(cmd.args(args).env("DEBIAN_FRONTEND", "noninteractive"))
    };
    apt(&["update", "-qq"])?;
    let mut args = vec!["install", "-y", "-qq", "--no-install-recommends"];
    args.extend_from_slice(packages);
    apt(&args)
}

extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}
