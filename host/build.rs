// `sqlx::migrate!` embeds ../migrations at compile time; a new migration file must rebuild
// the host, which cargo does not know without this.
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
