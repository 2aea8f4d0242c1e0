//! What the tests that run the `obx` binary share.

use std::path::{Path, PathBuf};
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
