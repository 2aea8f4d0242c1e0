//! The plugin author's commands: `obx plugin new`, `check` and `test`, and `obx wit`; and the
//! operator's `obx plugin release-event`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};

use crate::config::Config;
use crate::runtime::cache::CacheSettings;
use crate::runtime::Runtime;

pub(super) async fn plugin_test(config: Option<PathBuf>, file: PathBuf, json: bool) -> Result<ExitCode> {
    let config = Config::load(config.as_deref())?;
    let checks = crate::conformance::run(&file, &config).await?;
    let passed = checks.iter().all(|c| c.passed);
    if json {
        println!("{}", serde_json::to_string_pretty(&checks)?);
    } else {
        println!("{}:", file.display());
        for c in &checks {
            println!("  {} {}: {}", if c.passed { "ok  " } else { "FAIL" }, c.rule, c.detail);
        }
        println!("{}", if passed { "conformant" } else { "NOT conformant" });
    }
    Ok(if passed { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

pub(super) fn plugin_new(name: &str, language: crate::scaffold::Language, dir: Option<PathBuf>) -> Result<ExitCode> {
    let dir = dir.unwrap_or_else(|| PathBuf::from(name));
    let files = crate::scaffold::new_project(name, language, &dir)?;
    println!("made plugin {name} in {}:", dir.display());
    for f in files {
        println!("  {}", f.display());
    }
    println!(
        "next: cd {} && ./test.sh   (builds {name}.wasm and runs `obx plugin test` on it)",
        dir.display()
    );
    Ok(ExitCode::SUCCESS)
}

pub(super) fn wit(out: Option<PathBuf>) -> Result<ExitCode> {
    match out {
        None => print!("{}", crate::scaffold::WIT),
        Some(dir) => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let path = dir.join("obx.wit");
            std::fs::write(&path, crate::scaffold::WIT).with_context(|| format!("writing {}", path.display()))?;
            println!(
                "wrote {} (obx:plugin@{})",
                path.display(),
                crate::scaffold::wit_version()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub(super) async fn plugin_check(config: Option<PathBuf>, file: PathBuf, json: bool) -> Result<ExitCode> {
    let config = Config::load(config.as_deref())?;
    let bytes = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
    // Offline: no database, no broker. It shares the host's compile cache, so a second check
    // of a file is quick.
    let runtime = Runtime::new(config.limits, CacheSettings::of(&config.plugins))?;
    let started = std::time::Instant::now();
    match crate::runtime::loader::load(&runtime, bytes, crate::runtime::loader::SLOT_WAIT).await {
        Ok(plugin) => {
            let m = &plugin.manifest;
            if json {
                println!("{}", serde_json::to_string_pretty(m)?);
            } else {
                println!("{}: ok", file.display());
                println!("  plugin        {} {}", m.name, m.version);
                println!("  sha256        {}", plugin.sha256);
                let world = if plugin.timed() { "timed-plugin" } else { "plugin" };
                println!("  contract      obx:plugin@{} ({world})", plugin.contract_version);
                println!(
                    "  compiled      {} ({:.1} s)",
                    if plugin.from_cache {
                        "from the compile cache"
                    } else {
                        "now"
                    },
                    started.elapsed().as_secs_f64()
                );
                println!("  commands      {}", m.commands.join(", "));
                for s in &m.subscriptions {
                    let types = if s.event_types.is_empty() {
                        "*".to_string()
                    } else {
                        s.event_types.join(", ")
                    };
                    println!("  subscription  {} [{types}] ({:?})", s.topic, s.mode);
                }
                for mig in &m.migrations {
                    println!(
                        "  migration     {} {} ({} statements)",
                        mig.id,
                        mig.name,
                        mig.statements.len()
                    );
                }
                for p in &m.payloads {
                    let example = if p.example.is_some() { ", with an example" } else { "" };
                    println!(
                        "  payload       {} on {}: a JSON Schema{example}",
                        p.event_type, p.topic
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("{}: {e}", file.display());
            Ok(ExitCode::FAILURE)
        }
    }
}

pub(super) async fn plugin_release_event(
    config: Option<PathBuf>,
    plugin: &str,
    topic: &str,
    event_type: &str,
) -> Result<ExitCode> {
    use crate::runtime::plugin_schema::{release_event, Release};
    let config = Config::load(config.as_deref())?;
    let pool = super::database(&config, "`obx plugin release-event`").await?;
    let release = release_event(&pool, plugin, topic, event_type)
        .await
        .context("releasing the declaration (is this an OBX database? `obx migrate` makes its schema)")?;
    match release {
        Release::Released => {
            println!("released {event_type} on topic {topic} from plugin {plugin}: another plugin may declare it now");
            Ok(ExitCode::SUCCESS)
        }
        Release::HeldBy(holder) => {
            eprintln!("error: {event_type} on topic {topic} is declared by plugin {holder:?}, not {plugin:?}");
            Ok(ExitCode::FAILURE)
        }
        // Already free (a second run, say): what was asked for holds.
        Release::Undeclared => {
            println!("no plugin declares {event_type} on topic {topic}: it is free");
            Ok(ExitCode::SUCCESS)
        }
    }
}
