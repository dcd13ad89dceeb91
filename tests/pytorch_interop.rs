//! PyTorch interop (optional: never needed in CI). Set `RDZV_TORCH_PYTHON` to a Python
//! that can `import torch` to run `tests/pytorch/run.sh` against the release binary;
//! without it the test says it is skipped and why.

use std::process::Command;

#[test]
fn pytorch_interop_both_directions() {
    let Ok(python) = std::env::var("RDZV_TORCH_PYTHON") else {
        println!(
            "skipped: set RDZV_TORCH_PYTHON to a python with torch to run tests/pytorch/run.sh"
        );
        return;
    };
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new("bash")
        .arg(format!("{root}/tests/pytorch/run.sh"))
        .env("PYTHON", &python)
        .env("RDZV", env!("CARGO_BIN_EXE_rdzv"))
        .output()
        .expect("run tests/pytorch/run.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("5 passed, 0 failed") || stdout.contains("skipped:"),
        "{stdout}"
    );
}
