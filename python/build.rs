//! With the `bundle-cli` feature (turned on by maturin, see `pyproject.toml`), builds the
//! `rdzv` command-line binary for the same target and profile, and copies it to
//! `rdzv/_bin/rdzv`, where the wheel picks it up; the `rdzv` console script of the wheel
//! runs it (`rdzv/_cli.py`). maturin ships no binary for a PyO3 extension, so this is
//! how `pip install` still puts the `rdzv` command on PATH.
//!
//! The binary builds in a target directory of its own (`target/rdzv-cli`, or
//! `$RDZV_CLI_TARGET_DIR`): the outer cargo holds the lock of the main one. maturin's
//! linker settings (`--zig` for manylinux) reach it through the environment, since it
//! builds with an explicit `--target`. Without the feature (`cargo build`, `cargo test`,
//! `cargo clippy`) this script does nothing.

use std::env;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    println!("cargo:rerun-if-env-changed=RDZV_CLI_TARGET_DIR");
    if env::var_os("CARGO_FEATURE_BUNDLE_CLI").is_none() {
        return ExitCode::SUCCESS;
    }
    match bundle() {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("rdzv-python build.rs: {message}");
            ExitCode::FAILURE
        }
    }
}

fn var(name: &str) -> Result<String, String> {
    env::var(name).map_err(|_| format!("cargo did not set {name}"))
}

fn bundle() -> Result<(), String> {
    let manifest_dir = PathBuf::from(var("CARGO_MANIFEST_DIR")?);
    let root = manifest_dir
        .parent()
        .ok_or("the python crate has no parent directory")?
        .to_path_buf();
    // Rebuild the binary whenever the sources it is made of change.
    for watched in [
        "src",
        "core/src",
        "uring/src",
        "rdma/src",
        "Cargo.toml",
        "Cargo.lock",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(watched).display());
    }
    let target = var("TARGET")?;
    let release = var("PROFILE")? == "release";
    let target_dir = env::var_os("RDZV_CLI_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target").join("rdzv-cli"));
    let cargo = env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"));

    let mut command = Command::new(cargo);
    command
        .current_dir(&root)
        .args([
            "build",
            "--package",
            "rdzv",
            "--bin",
            "rdzv",
            "--target",
            &target,
        ])
        .arg("--target-dir")
        .arg(&target_dir);
    if release {
        // The wheel wants a small binary: no debug info, symbols stripped.
        command.args([
            "--release",
            "--config",
            "profile.release.debug=0",
            "--config",
            "profile.release.strip=true",
        ]);
    }
    // What cargo set for this build script describes this package, not the child build.
    for (name, _) in env::vars_os() {
        let name_text = name.to_string_lossy();
        if name_text.starts_with("CARGO_FEATURE_")
            || name_text.starts_with("CARGO_CFG_")
            || name_text.starts_with("CARGO_PKG_")
            || name_text.starts_with("CARGO_MANIFEST_")
            || name_text.starts_with("DEP_")
            || matches!(
                name_text.as_ref(),
                "CARGO_TARGET_DIR"
                    | "CARGO_BUILD_TARGET_DIR"
                    | "OUT_DIR"
                    | "TARGET"
                    | "HOST"
                    | "NUM_JOBS"
                    | "OPT_LEVEL"
                    | "DEBUG"
                    | "PROFILE"
                    | "RUSTC_LINKER"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_CRATE_NAME"
            )
        {
            command.env_remove(&name);
        }
    }
    let status = command
        .status()
        .map_err(|e| format!("cannot run cargo to build the rdzv binary: {e}"))?;
    if !status.success() {
        return Err(format!(
            "building the rdzv binary (cargo build -p rdzv --bin rdzv --target {target}) failed: {status}"
        ));
    }
    let profile_dir = if release { "release" } else { "debug" };
    let built = target_dir.join(&target).join(profile_dir).join("rdzv");
    let bundled = manifest_dir.join("rdzv").join("_bin");
    copy(&built, &bundled)
}

fn copy(built: &Path, bundled_dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(bundled_dir)
        .map_err(|e| format!("cannot create {}: {e}", bundled_dir.display()))?;
    let bundled = bundled_dir.join("rdzv");
    // Replace, never write through: a running `rdzv` may hold the old file open.
    let staging = bundled_dir.join(".rdzv.tmp");
    std::fs::copy(built, &staging).map_err(|e| {
        format!(
            "cannot copy the rdzv binary {} to {}: {e}",
            built.display(),
            staging.display()
        )
    })?;
    std::fs::rename(&staging, &bundled)
        .map_err(|e| format!("cannot move the rdzv binary to {}: {e}", bundled.display()))
}
