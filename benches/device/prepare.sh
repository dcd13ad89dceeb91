#!/usr/bin/env bash
# Builds, here on the development machine, everything the GPU host check
# (benches/device/run.sh) runs, strips it, and puts it in .device/ (which
# .git/info/exclude ignores, so the `device` tool carries it with `carry: [".device"]`).
# The lent host has no network and no Rust: it runs only these binaries, PyTorch 2.11
# and the Python scripts in benches/ and tests/pytorch/.
#
# Usage: benches/device/prepare.sh       then, through the device tool:
#        bash benches/device/run.sh      with carry [".device"]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.device
rm -rf "$out"
mkdir -p "$out/bin"
grep -qx '/.device/' .git/info/exclude 2>/dev/null || {
    mkdir -p .git/info
    echo '/.device/' >>.git/info/exclude
}

echo "building the release rdzv binary" >&2
cargo build --release --bin rdzv
cp target/release/rdzv "$out/bin/rdzv"

# Test binaries: cargo prints each executable it built as JSON; keep the named ones.
test_bin() { # $1 = package, the rest = cargo test selectors; copies to $out/bin/<name>
    local package="$1"
    shift
    cargo test --release -p "$package" "$@" --no-run --message-format=json 2>/dev/null |
        python3 -c '
import json, shutil, sys
out = sys.argv[1]
for line in sys.stdin:
    msg = json.loads(line)
    exe = msg.get("executable")
    if msg.get("reason") == "compiler-artifact" and exe and msg.get("profile", {}).get("test"):
        name = msg["target"]["name"].replace("-", "_")
        if msg["target"]["kind"] == ["lib"]:
            name += "_lib"
        shutil.copy(exe, f"{out}/bin/{name}")
        print(f"  {out}/bin/{name}", file=sys.stderr)
' "$out"
}
echo "building the CUDA test binaries" >&2
test_bin rdzv-rdma --test cuda_agent --lib
test_bin rdzv-uring --test rpc_cuda

for bin in "$out"/bin/*; do
    objcopy --strip-debug "$bin"
done
git rev-parse --short HEAD >"$out/commit"
du -sh "$out" >&2
echo "ready: carry .device (must stay under 64 MiB in all)" >&2
