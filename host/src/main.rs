fn main() -> std::process::ExitCode {
    obx::cli::main()
}
