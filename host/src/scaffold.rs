//! `obx plugin new` and `obx wit`: a standalone plugin project in Rust, Python or
//! JavaScript, outside any checkout of OBX. Each carries the WIT it was made against, a
//! build script, a test script that runs `obx plugin test`, and a small plugin with two
//! commands, a subscription and a migration. The templates are in `host/templates/`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _, Result};

/// The host's contract, as plugins are built against it.
pub const WIT: &str = include_str!("../../wit/obx.wit");

/// The componentize-py and ComponentizeJS releases a new project pins (the example plugins
/// are built with the same: `xtask`'s `COMPONENTIZE_PY` and plugins/notifications-js).
const COMPONENTIZE_PY: &str = "0.25.1";
const COMPONENTIZE_JS: &str = "0.23.0";

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Language {
    Rust,
    Python,
    Javascript,
}

struct Template {
    path: &'static str,
    text: &'static str,
    executable: bool,
}

const fn file(path: &'static str, text: &'static str) -> Template {
    Template {
        path,
        text,
        executable: false,
    }
}

const fn script(path: &'static str, text: &'static str) -> Template {
    Template {
        path,
        text,
        executable: true,
    }
}

const RUST: &[Template] = &[
    file("Cargo.toml", include_str!("../templates/rust/Cargo.toml")),
    file(
        ".cargo/config.toml",
        include_str!("../templates/rust/cargo-config.toml"),
    ),
    file("src/lib.rs", include_str!("../templates/rust/src/lib.rs")),
    script("build.sh", include_str!("../templates/rust/build.sh")),
    script("test.sh", include_str!("../templates/rust/test.sh")),
];

const PYTHON: &[Template] = &[
    file("app.py", include_str!("../templates/python/app.py")),
    script("build.sh", include_str!("../templates/python/build.sh")),
    script("test.sh", include_str!("../templates/python/test.sh")),
];

const JAVASCRIPT: &[Template] = &[
    file("app.js", include_str!("../templates/javascript/app.js")),
    file("package.json", include_str!("../templates/javascript/package.json")),
    script("build.sh", include_str!("../templates/javascript/build.sh")),
    script("test.sh", include_str!("../templates/javascript/test.sh")),
];

const COMMON: &[Template] = &[
    file("README.md", include_str!("../templates/README.md")),
    file(".gitignore", include_str!("../templates/gitignore")),
    file("wit/obx.wit", WIT),
];

impl Language {
    fn templates(self) -> &'static [Template] {
        match self {
            Language::Rust => RUST,
            Language::Python => PYTHON,
            Language::Javascript => JAVASCRIPT,
        }
    }

    fn words(self) -> (&'static str, &'static str) {
        match self {
            Language::Rust => (
                "Rust",
                "Needs Rust with the `wasm32-wasip2` target (`rustup target add wasm32-wasip2`).",
            ),
            Language::Python => (
                "Python",
                "Needs componentize-py on the PATH (or in `COMPONENTIZE_PY`): \
                 `pip install componentize-py==0.25.1`, in a virtualenv.",
            ),
            Language::Javascript => (
                "JavaScript",
                "Needs Node.js and npm; the build installs ComponentizeJS from npm the first time.",
            ),
        }
    }
}

/// The version of the `obx:plugin` package that [`WIT`] declares.
pub fn wit_version() -> &'static str {
    WIT.lines()
        .find_map(|l| l.trim().strip_prefix("package obx:plugin@"))
        .and_then(|rest| rest.strip_suffix(';'))
        .expect("wit/obx.wit declares package obx:plugin@<version>;")
}

/// Writes a new plugin project named `name` in `language` into `dir`, which must not exist
/// or be empty. Returns the files written, relative to `dir`.
pub fn new_project(name: &str, language: Language, dir: &Path) -> Result<Vec<PathBuf>> {
    crate::runtime::manifest::check_name(name).map_err(|e| anyhow::anyhow!("plugin {e}"))?;
    if dir.exists() {
        let mut entries = std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?;
        if entries.next().is_some() {
            bail!("{} already exists and is not empty", dir.display());
        }
    }
    let (language_name, requirements) = language.words();
    let vars: &[(&str, &str)] = &[
        ("{{name}}", name),
        ("{{language}}", language_name),
        ("{{requirements}}", requirements),
        ("{{build}}", "./build.sh"),
        ("{{test}}", "./test.sh"),
        ("{{wit_version}}", wit_version()),
        ("{{componentize_py}}", COMPONENTIZE_PY),
        ("{{componentize_js}}", COMPONENTIZE_JS),
    ];
    let mut written = Vec::new();
    for template in language.templates().iter().chain(COMMON) {
        let path = dir.join(template.path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        }
        let text = if template.path == "wit/obx.wit" {
            template.text.to_string()
        } else {
            fill(template.text, vars)
        };
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        if template.executable {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
        }
        written.push(PathBuf::from(template.path));
    }
    Ok(written)
}

fn fill(text: &str, vars: &[(&str, &str)]) -> String {
    vars.iter()
        .fold(text.to_string(), |t, (key, value)| t.replace(key, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_placeholder_is_filled_and_names_are_checked() {
        for language in [Language::Rust, Language::Python, Language::Javascript] {
            let dir = tempfile::tempdir().unwrap();
            let files = new_project("ledger", language, dir.path()).unwrap();
            for f in &files {
                let text = std::fs::read_to_string(dir.path().join(f)).unwrap();
                assert!(
                    !text.contains("{{"),
                    "{language:?} {}: an unfilled placeholder",
                    f.display()
                );
            }
            assert!(files.iter().any(|f| f.ends_with("wit/obx.wit")));
            // A second time into the same directory is refused.
            assert!(new_project("ledger", language, dir.path()).is_err());
        }
        let dir = tempfile::tempdir().unwrap();
        let e = new_project("Ledger-1", Language::Rust, &dir.path().join("x")).unwrap_err();
        assert!(e.to_string().contains("a-z, 0-9 and _"), "{e}");
        assert_eq!(wit_version().split('.').count(), 3);
    }
}
